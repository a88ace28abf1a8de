"""Debounce and throttle without servers: their options (bounds, defaults, inheritance,
the refused combinations), a publish's rows and messages on a SQLite ledger and
memory://, and eager mode."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pydantic import BaseModel
from sqlalchemy import select

from questpie_celery import JobContext, Questpie, job
from questpie_celery.errors import PublishOptionsError
from questpie_celery.jobs.options import (
    DEFAULT_DEBOUNCE_MAX_FACTOR,
    MAX_START_AFTER_SECONDS,
    resolve_many_options,
    resolve_options,
    validate_job_options,
)
from questpie_celery.ledger import Ledger
from questpie_celery.ledger.schema import throttle_table
from questpie_celery.signals import publish_suppressed
from questpie_celery.worker.retention import Retention
from tests.unit.helpers import IdleApp


def test_debounce_max_defaults_to_ten_quiet_periods() -> None:
    options = resolve_options({}, {"debounce_seconds": 2})
    assert options.debounce_seconds == 2.0
    assert options.debounce_max_seconds == 2.0 * DEFAULT_DEBOUNCE_MAX_FACTOR == 20.0
    assert options.flow_controlled and options.flow_key == ""
    keyed = resolve_options({}, {"debounce_seconds": 2, "singleton_key": "user-1"})
    assert keyed.flow_key == "user-1"
    longest = resolve_options({}, {"debounce_seconds": MAX_START_AFTER_SECONDS})
    assert longest.debounce_max_seconds == MAX_START_AFTER_SECONDS


def test_a_publish_inherits_the_jobs_debounce_and_throttle_and_may_override_them() -> None:
    job_options = validate_job_options({"debounce_seconds": 1, "debounce_max_seconds": 3})
    inherited = resolve_options(job_options, {})
    assert (inherited.debounce_seconds, inherited.debounce_max_seconds) == (1.0, 3.0)
    overridden = resolve_options(job_options, {"debounce_seconds": 2.5})
    assert (overridden.debounce_seconds, overridden.debounce_max_seconds) == (2.5, 3.0)
    throttled = resolve_options(validate_job_options({"throttle_seconds": 60}), {})
    assert throttled.throttle_seconds == 60.0 and throttled.debounce_seconds is None
    items = resolve_many_options(job_options, {}, None, ["a", None], 2)
    assert [item.flow_key for item in items] == ["a", ""]


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"debounce_seconds": 0}, "debounce_seconds must be a number of seconds above 0"),
        ({"debounce_seconds": -1}, "above 0"),
        ({"debounce_seconds": float("nan")}, "above 0"),
        ({"debounce_seconds": True}, "number of seconds"),
        ({"debounce_seconds": "1"}, "number of seconds"),
        ({"debounce_seconds": MAX_START_AFTER_SECONDS + 1}, "at most"),
        ({"throttle_seconds": 0}, "throttle_seconds must be"),
        ({"throttle_seconds": float("inf")}, "throttle_seconds must be"),
        ({"debounce_max_seconds": 5}, "needs debounce_seconds"),
        ({"debounce_seconds": 2, "debounce_max_seconds": 1}, "at least debounce_seconds"),
        ({"debounce_seconds": 1, "idempotency_key": "k"}, "idempotency_key"),
        ({"debounce_seconds": 1, "secret_payload": True}, "secret_payload"),
        (
            {"debounce_seconds": 1, "secret_payload": True, "idempotency_key": "k"},
            "secret_payload",
        ),
        ({"debounce_seconds": 1, "start_after": 10}, "start_after"),
        ({"debounce_seconds": 1, "throttle_seconds": 1}, "cannot both be set"),
    ],
)
def test_refused_options_are_value_errors(options: dict[str, Any], words: str) -> None:
    with pytest.raises(PublishOptionsError, match=words) as refused:
        resolve_options({}, options)
    assert isinstance(refused.value, ValueError)


def test_a_job_declaring_a_refused_combination_is_refused_where_it_is_declared() -> None:
    with pytest.raises(PublishOptionsError, match="start_after"):
        validate_job_options({"debounce_seconds": 1, "start_after": 5})
    with pytest.raises(PublishOptionsError, match="needs debounce_seconds"):
        validate_job_options({"debounce_max_seconds": 5})
    with pytest.raises(PublishOptionsError, match="above 0"):
        validate_job_options({"throttle_seconds": 0})


def test_a_bulk_publishs_item_key_is_refused_by_its_index() -> None:
    with pytest.raises(PublishOptionsError, match="item 1: debounce_seconds and idempotency_key"):
        resolve_many_options({}, {"debounce_seconds": 1}, [None, "k"], None, 2)


# --- publishing on SQLite and memory:// ---------------------------------------------------


def test_a_debounced_burst_is_one_row_and_one_message(idle: IdleApp) -> None:
    client = idle.questpie.queue["debounce.record"]
    rows, messages = idle.written()
    ids = [client.publish({"tag": "b", "seq": str(n)}, singleton_key="burst-1") for n in range(5)]
    assert len(set(ids)) == 1 and ids[0] is not None
    assert idle.written() == (rows + 1, messages + 1)  # the first publish's message only
    row = idle.ledger.get(ids[0])
    assert row is not None
    assert row.payload == {"tag": "b", "seq": "4"} and row.debounce_key == "burst-1"
    assert row.status in ("pending", "queued")


def test_a_throttled_publish_inside_its_window_is_suppressed_and_told(idle: IdleApp) -> None:
    client = idle.questpie.queue["throttle.record"]
    heard: list[dict[str, Any]] = []

    def listen(sender: Any, **kw: Any) -> None:
        heard.append({"sender": sender, **kw})

    publish_suppressed.connect(listen, weak=False)
    try:
        rows, messages = idle.written()
        first = client.publish({"tag": "t"}, singleton_key="w-1")
        second = client.publish({"tag": "t"}, singleton_key="w-1")
        other = client.publish({"tag": "t"}, singleton_key="w-2")
        many = client.publish_many([{"tag": "t"}] * 2, singleton_keys=["w-3", "w-3"])
    finally:
        publish_suppressed.disconnect(listen)
    assert first is not None and second is None and other is not None
    assert many[0] is not None and many[1] is None
    assert idle.written() == (rows + 3, messages + 3)
    assert heard == [
        {
            "sender": "throttle.record",
            "signal": publish_suppressed,
            "job_name": "throttle.record",
            "singleton_key": key,
            "policy": "throttle",
        }
        for key in ("w-1", "w-3")
    ]


def test_a_known_key_answers_its_id_before_its_throttle(idle: IdleApp) -> None:
    client = idle.questpie.queue["throttle.record"]
    first = client.publish({"tag": "t"}, idempotency_key="throttle-known")
    assert first is not None
    assert client.publish({"tag": "t"}, idempotency_key="throttle-known") == first
    # An unknown key inside the job's window is suppressed, and leaves no row.
    assert client.publish({"tag": "t"}, idempotency_key="throttle-new") is None
    assert client.publish({"tag": "t"}, idempotency_key="throttle-new") is None


# --- eager mode ---------------------------------------------------------------------------


class Note(BaseModel):
    n: int


ran: list[tuple[str, int]] = []


@job(name="eager.debounced", schema=Note, options={"debounce_seconds": 30})
def eager_debounced(payload: Note, ctx: JobContext) -> None:
    ran.append((ctx.dispatch_id, payload.n))


@job(name="eager.throttled", schema=Note, options={"throttle_seconds": 30})
def eager_throttled(payload: Note, ctx: JobContext) -> None:
    ran.append((ctx.dispatch_id, payload.n))


@pytest.fixture
def eager(tmp_path: Path) -> Iterator[Questpie]:
    app = Celery("eager-flow", broker="memory://")
    app.conf.task_always_eager = True
    made = Questpie(
        app,
        ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}",
        jobs=[eager_debounced, eager_throttled],
    )
    made.migrate()
    ran.clear()
    yield made
    made.close()


def test_eager_mode_runs_each_debounced_publish_at_once(eager: Questpie) -> None:
    # As Celery's eager mode ignores a countdown: no quiet period to wait out in a test.
    ids = [eager.queue["eager.debounced"].publish({"n": n}) for n in range(3)]
    assert len(set(ids)) == 3
    assert ran == [(dispatch_id, n) for n, dispatch_id in enumerate(ids)]


def test_eager_mode_keeps_the_throttle(eager: Questpie) -> None:
    client = eager.queue["eager.throttled"]
    first = client.publish({"n": 1})
    assert client.publish({"n": 2}) is None
    assert ran == [(first, 1)]


# --- retention ------------------------------------------------------------------------------


def test_the_relays_retention_step_deletes_windows_open_again_for_an_hour(ledger: Ledger) -> None:
    now = datetime.now(UTC)
    with ledger.engine.begin() as conn:
        conn.execute(
            throttle_table.insert(),
            [
                {
                    "job_name": "j",
                    "throttle_key": "old",
                    "dispatch_id": "a",
                    "open_at": now - timedelta(hours=2),
                },
                {
                    "job_name": "j",
                    "throttle_key": "recent",
                    "dispatch_id": "b",
                    "open_at": now - timedelta(minutes=5),
                },
                {
                    "job_name": "j",
                    "throttle_key": "closed",
                    "dispatch_id": "c",
                    "open_at": now + timedelta(minutes=5),
                },
            ],
        )
    Retention(ledger, None).now_and_then()  # no retention period: windows go all the same
    with ledger.engine.connect() as conn:
        left = conn.execute(select(throttle_table.c.throttle_key)).scalars().all()
    assert sorted(left) == ["closed", "recent"]


def test_a_singleton_key_of_a_debounced_standard_job_is_not_called_ignored(
    idle: IdleApp, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        idle.questpie.queue["debounce.record"].publish({"tag": "w"}, singleton_key="warn-1")
        idle.questpie.queue["throttle.record"].publish({"tag": "w"}, singleton_key="warn-1")
        idle.questpie.queue["record"].publish({"tag": "w"}, singleton_key="warn-1")
    warned = [
        r.getMessage() for r in caplog.records if "singleton_key has no effect" in r.getMessage()
    ]
    assert warned == ["job record has the standard queue policy: singleton_key has no effect"]
