"""Adopted Celery tasks (`base=LedgerTask`) in one process: their ledger options checked
where they are declared, keys computed from the arguments, the call serialized by the
app's serializer, and (in eager mode) the same guarantees as a job's publish."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, Task
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from questpie_celery import (
    ConfigurationError,
    JobDefinitionError,
    LedgerRefused,
    LedgerTask,
    PayloadValidationError,
    PublishOptionsError,
    Questpie,
)
from questpie_celery.adopted.calls import canvas_options, pack, unpack
from questpie_celery.adopted.keys import KeyTemplate


@dataclass(frozen=True)
class Upload:
    path: str
    pages: tuple[int, ...] = ()


def signature(function: Any) -> inspect.Signature:
    return inspect.signature(function)


def test_a_template_fills_positional_arguments_by_name_and_defaults() -> None:
    def process(document_id: int, mode: str = "full", **rest: Any) -> None: ...

    key = KeyTemplate("idempotency_key", "doc:{document_id}:{mode}:{who}", signature(process), "t")
    assert key.render((7,), {"who": "ann"}) == "doc:7:full:ann"
    assert key.render((), {"document_id": 8, "mode": "fast", "who": "bo"}) == "doc:8:fast:bo"


def test_a_callable_key_takes_the_tasks_arguments() -> None:
    def process(upload: Upload) -> None: ...

    key = KeyTemplate("idempotency_key", lambda upload: upload.path, signature(process), "t")
    assert key.render((Upload("/a"),), {}) == "/a"


def test_a_key_the_call_cannot_fill_is_an_option_error_that_quotes_nothing() -> None:
    def process(upload: Upload) -> None: ...

    key = KeyTemplate("idempotency_key", "{upload.missing}", signature(process), "t")
    with pytest.raises(PublishOptionsError, match="idempotency_key") as raised:
        key.render((Upload("/secret/path"),), {})
    assert "/secret/path" not in str(raised.value)


def test_a_template_naming_an_argument_the_task_lacks_fails_where_it_is_declared() -> None:
    app = Celery("adopt", broker="memory://", set_as_current=False)
    _ = app.tasks  # finalized: the decorator makes the task's class at once
    with pytest.raises(JobDefinitionError, match=r"\{document\}, which the task does not take"):

        @app.task(base=LedgerTask, ledger={"idempotency_key": "doc:{document}"}, shared=False)
        def process(document_id: int) -> None: ...


def test_an_unknown_ledger_option_is_refused_naming_the_known_ones() -> None:
    app = Celery("adopt", broker="memory://", set_as_current=False)
    _ = app.tasks
    with pytest.raises(JobDefinitionError, match=r"unknown ledger option.*'retry_limit'"):

        @app.task(base=LedgerTask, ledger={"retry_limit": 3}, shared=False)
        def process(document_id: int) -> None: ...


def test_bind_true_leaves_the_task_out_of_the_signature() -> None:
    app = Celery("adopt", broker="memory://", set_as_current=False)
    _ = app.tasks

    @app.task(bind=True, base=LedgerTask, ledger={"singleton_key": "{index}"}, shared=False)
    def rebuild(self: Task, index: str) -> str:
        return f"{self.name}:{index}"

    assert rebuild._questpie_keys[0].render(("main",), {}) == "main"


def test_a_pickled_call_round_trips_and_an_app_that_refuses_pickle_refuses_it() -> None:
    call = pack((Upload("/a", (1, 2)),), {"force": True}, {"group": "g"}, "pickle")
    assert call.base64
    back = unpack(call, ["pickle", "json"])
    assert back.args == (Upload("/a", (1, 2)),)
    assert (back.kwargs, back.canvas) == ({"force": True}, {"group": "g"})
    with pytest.raises(PayloadValidationError, match="accept_content refuses"):
        unpack(call, ["json"])


def test_arguments_the_serializer_cannot_carry_are_an_option_error() -> None:
    with pytest.raises(PublishOptionsError, match="could not be serialized with 'json'"):
        pack((Upload("/a"),), {}, {}, "json")


def test_canvas_options_take_celerys_names() -> None:
    found = canvas_options({"link": "cb", "link_error": ["e"], "group_id": "g", "queue": "q"})
    assert found == {"callbacks": ["cb"], "errbacks": ["e"], "group": "g"}


@pytest.fixture
def eager(tmp_path: Path) -> Iterator[tuple[Celery, Questpie, list[tuple[Any, ...]]]]:
    """An app in eager mode with its pickle serializer, two adopted tasks, a ledger."""
    app = Celery("adopt", broker="memory://", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        task_serializer="pickle",
        accept_content=["pickle", "json"],
    )
    ran: list[tuple[Any, ...]] = []

    @app.task(base=LedgerTask, ledger={"idempotency_key": "up:{upload.path}"}, shared=False)
    def ingest(upload: Upload, force: bool = False) -> str:
        ran.append((upload, force))
        return upload.path

    @app.task(base=LedgerTask, shared=False)
    def plain(value: int) -> int:
        ran.append((value,))
        return value

    questpie = Questpie(app, ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}")
    questpie.migrate()
    yield app, questpie, ran
    questpie.close()


def test_the_same_key_twice_runs_once_and_answers_the_same_id(
    eager: tuple[Celery, Questpie, list[tuple[Any, ...]]],
) -> None:
    app, questpie, ran = eager
    ingest = app.tasks[f"{__name__}.ingest"]
    first = ingest.delay(Upload("/x"))
    again = ingest.apply_async((Upload("/x"),), {"force": True})
    assert first.id == again.id
    assert first.get(timeout=1) == "/x"  # eager: Celery's EagerResult, as without the ledger
    assert ran == [(Upload("/x"), False)]
    status = questpie.queue.get_status(first.id)
    assert status is not None and status.status == "completed"


def test_a_call_its_policy_refuses_answers_a_refused_result_not_none(tmp_path: Path) -> None:
    """`short` keeps one queued run per key: with no worker reading, the second call of
    the same index is refused, and says so."""
    app = Celery("adopt", broker="memory://", set_as_current=False)

    @app.task(
        base=LedgerTask,
        ledger={"singleton_key": "{index}", "queue_policy": "short"},
        shared=False,
    )
    def rebuild(index: str) -> None: ...

    questpie = Questpie(app, ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        questpie.migrate()
        first = rebuild.delay("main")
        refused = rebuild.delay("main")
        assert not isinstance(first, LedgerRefused)
        assert isinstance(refused, LedgerRefused) and refused.refused
        assert refused.id != first.id
        assert (refused.state, refused.ready(), refused.get(timeout=1)) == ("REFUSED", True, None)
    finally:
        questpie.close()


def test_an_in_process_call_is_the_function(
    eager: tuple[Celery, Questpie, list[tuple[Any, ...]]],
) -> None:
    app, _questpie, ran = eager
    assert app.tasks[f"{__name__}.plain"](5) == 5
    assert ran == [(5,)]


def test_a_task_whose_app_has_no_questpie_says_so() -> None:
    app = Celery("alone", broker="memory://", set_as_current=False)

    @app.task(base=LedgerTask, shared=False)
    def lonely(value: int) -> int:
        return value

    with pytest.raises(ConfigurationError, match="no Questpie was made for its Celery app"):
        lonely.delay(1)


def test_a_bad_ledger_option_value_fails_where_the_task_is_declared() -> None:
    app = Celery("adopt", broker="memory://", set_as_current=False)
    _ = app.tasks
    with pytest.raises(JobDefinitionError, match="rate_limit"):

        @app.task(base=LedgerTask, ledger={"rate_limit": "often"}, shared=False)
        def process(document_id: int) -> None: ...


def test_apply_async_with_a_session_rides_in_the_callers_transaction(tmp_path: Path) -> None:
    """The call's row is written in the caller's transaction: a rollback leaves no trace,
    and only a commit lets it run."""
    app = Celery("adopt", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    ran: list[int] = []

    @app.task(base=LedgerTask, ledger={"idempotency_key": "tx:{n}"}, shared=False)
    def step(n: int) -> None:
        ran.append(n)

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    questpie = Questpie(app, ledger_url=url)
    caller = create_engine(url)
    try:
        questpie.migrate()
        with Session(caller) as session:
            rolled_back = step.apply_async((1,), session=session)
            session.rollback()
        with Session(caller) as session:
            committed = step.apply_async((2,), session=session)
            assert ran == []
            session.commit()
        assert ran == [2]
        assert questpie.queue.get_status(rolled_back.id) is None
        status = questpie.queue.get_status(committed.id)
        assert status is not None and status.status == "completed"
    finally:
        caller.dispose()
        questpie.close()
