"""Durable Canvas in one process: results as the ledger keeps them (whole, bounded, read
back only as the reader accepts), and the chords and batches refused before anything
is written (a member, body or callback that is not a `LedgerTask`, a nested header, an
unknown failure policy)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, group
from kombu.exceptions import ContentDisallowed
from pydantic import BaseModel
from sqlalchemy import create_engine, func, select

from questpie_celery import CanvasError, LedgerTask, PublishOptionsError, Questpie, chord
from questpie_celery.canvas.results import MAX_RESULT_BYTES, decode, decode_json, encode
from questpie_celery.errors import ResultNotStorableError
from questpie_celery.ledger.schema import canvas_table, dispatch_table


@dataclass(frozen=True)
class Report:
    pages: int


class Summary(BaseModel):
    pages: int


def test_a_result_is_kept_whole_by_its_serializer_and_read_back_as_accepted() -> None:
    assert encode(None, "json") is None
    kept = encode({"pages": 3}, "json")
    assert decode(kept, ["json"]) == {"pages": 3}
    assert decode_json(kept) == {"pages": 3}
    # A job's handler may return a model: kept as pydantic writes it.
    assert decode(encode(Summary(pages=2), "json"), ["json"]) == {"pages": 2}
    pickled = encode(Report(5), "pickle")
    assert decode(pickled, ["pickle", "json"]) == Report(5)
    with pytest.raises(ContentDisallowed):
        decode(pickled, ["json"])
    assert decode_json(pickled) is None  # never unpickled without the app's consent


def test_a_result_too_large_or_unserializable_is_refused_never_truncated() -> None:
    with pytest.raises(ResultNotStorableError, match=f"at most {MAX_RESULT_BYTES}"):
        encode("x" * (MAX_RESULT_BYTES + 1), "json")
    with pytest.raises(ResultNotStorableError, match="cannot be serialized with 'json'"):
        encode(object(), "json")


@pytest.fixture
def app(tmp_path: Path) -> Iterator[tuple[Celery, Questpie]]:
    app = Celery("canvas", broker="memory://", set_as_current=False)

    @app.task(base=LedgerTask, shared=False, name="ledgered")
    def ledgered(value: int) -> int:
        return value

    @app.task(shared=False, name="plain")
    def plain(values: list[int]) -> int:
        return sum(values)

    @app.task(base=LedgerTask, shared=False, name="gather")
    def gather(values: list[int]) -> int:
        return sum(values)

    questpie = Questpie(app, ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}")
    questpie.migrate()
    yield app, questpie
    questpie.close()


def _written(tmp_path: Path) -> tuple[int, int]:
    """Canvases and dispatches in the ledger."""
    with create_engine(f"sqlite:///{tmp_path / 'ledger.db'}").connect() as conn:
        canvases = conn.execute(select(func.count()).select_from(canvas_table)).scalar()
        dispatches = conn.execute(select(func.count()).select_from(dispatch_table)).scalar()
    return int(canvases or 0), int(dispatches or 0)


def test_a_chord_that_cannot_be_durable_is_refused_before_anything_is_written(
    app: tuple[Celery, Questpie], tmp_path: Path
) -> None:
    celery_app, _ = app
    ledgered, plain, gather = (celery_app.tasks[n] for n in ("ledgered", "plain", "gather"))
    with pytest.raises(CanvasError, match="'plain' is not a LedgerTask"):
        chord([ledgered.s(1), ledgered.s(2)])(plain.s())
    with pytest.raises(CanvasError, match="member 1 'plain' is not a LedgerTask"):
        chord([ledgered.s(1), plain.s([2])])(gather.s())
    with pytest.raises(CanvasError, match="nested groups"):
        chord([ledgered.s(1), group(ledgered.s(2), ledgered.s(3))])(gather.s())
    with pytest.raises(CanvasError, match="on_member_failure must be 'fail' or 'run'"):
        chord([ledgered.s(1)], gather.s(), on_member_failure="skip")  # type: ignore[arg-type]
    assert _written(tmp_path) == (0, 0)


def test_a_batch_callback_must_be_a_ledger_task_and_batch_id_needs_one(
    app: tuple[Celery, Questpie], tmp_path: Path
) -> None:
    celery_app, questpie = app

    class Item(BaseModel):
        n: int

    from questpie_celery import job  # noqa: PLC0415  (a job of this test's own)

    @job(name="item", schema=Item)
    def item(payload: Item, ctx: Any) -> int:
        return payload.n

    questpie.register(item)
    client = questpie.queue["item"]
    with pytest.raises(CanvasError, match="'plain' is not a LedgerTask"):
        client.publish_many([{"n": 1}], on_complete=celery_app.tasks["plain"].s())
    with pytest.raises(PublishOptionsError, match="batch_id names a batch with on_complete"):
        client.publish_many([{"n": 1}], batch_id="b-1")
    assert _written(tmp_path) == (0, 0)


def test_an_eager_chord_runs_inline_as_celerys(app: tuple[Celery, Questpie]) -> None:
    celery_app, _ = app
    celery_app.conf.task_always_eager = True
    ledgered, gather = celery_app.tasks["ledgered"], celery_app.tasks["gather"]
    assert chord([ledgered.s(1), ledgered.s(2)])(gather.s()).get() == 3


def test_a_jobs_task_member_with_a_mistaken_call_is_refused_before_anything_is_written(
    app: tuple[Celery, Questpie], tmp_path: Path
) -> None:
    celery_app, questpie = app

    class Item(BaseModel):
        n: int

    from questpie_celery import job  # noqa: PLC0415  (a job of this test's own)

    @job(name="member-item", schema=Item)
    def item(payload: Item, ctx: Any) -> int:
        return payload.n

    questpie.register(item)
    member = questpie.queue["member-item"].task
    with pytest.raises(CanvasError, match="chord member 0 'member-item': a job's task takes"):
        chord([member.s({"n": 1}, 2)])(celery_app.tasks["gather"].s())
    assert _written(tmp_path) == (0, 0)
