"""Option bounds: every out-of-range value is a PublishOptionsError before anything is
written, never a UnicodeEncodeError, OverflowError or a database error later."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from questpie_celery import JobContext, JobDefinitionError, PublishOptionsError, job
from questpie_celery.jobs import options as vocabulary
from questpie_celery.jobs.keywords import JOB_ONLY_OPTIONS, JobOptions, PublishOptions
from questpie_celery.jobs.options import (
    DEFAULT_EXPIRE_IN_SECONDS,
    MAX_EXPIRE_IN_SECONDS,
    MAX_QUEUE_NAME_LENGTH,
    MAX_RETRY_DELAY_SECONDS,
    MAX_START_AFTER_SECONDS,
    RunOptions,
    StoredOptions,
    resolve_options,
)
from questpie_celery.ledger import DispatchRow
from tests.support.jobapp import Work
from tests.unit.helpers import IdleApp, new_dispatch

VALID = {"tag": "bounds"}
OUT_OF_BOUNDS: list[tuple[str, dict[str, Any]]] = [
    ("idempotency_key lone surrogate", {"idempotency_key": "\ud800"}),
    ("idempotency_key surrogate inside", {"idempotency_key": "ok-\udfff-ok"}),
    ("singleton_key lone surrogate", {"singleton_key": "\ud800", "queue_policy": "singleton"}),
    ("start_after past datetime range", {"start_after": 251606272082.0}),
    ("start_after just past the bound", {"start_after": MAX_START_AFTER_SECONDS + 1}),
    ("start_after inf", {"start_after": float("inf")}),
    ("retry_delay 1e308", {"retry_delay": 1e308}),
    ("retry_delay just past the bound", {"retry_delay": MAX_RETRY_DELAY_SECONDS + 0.5}),
    ("retry_delay nan", {"retry_delay": float("nan")}),
    ("expire_in_seconds 10**20", {"expire_in_seconds": 10**20}),
    ("expire_in_seconds just past the bound", {"expire_in_seconds": MAX_EXPIRE_IN_SECONDS + 1}),
    ("queue with NUL", {"queue": "jobs\0x"}),
    ("queue with newline", {"queue": "jobs\nx"}),
    ("queue too long", {"queue": "q" * (MAX_QUEUE_NAME_LENGTH + 1)}),
    ("queue not a str", {"queue": 5}),
]


@pytest.mark.parametrize(
    "options", [case[1] for case in OUT_OF_BOUNDS], ids=[case[0] for case in OUT_OF_BOUNDS]
)
def test_out_of_bounds_option_is_rejected_and_writes_nothing(
    idle: IdleApp, options: dict[str, Any]
) -> None:
    before = idle.written()
    with pytest.raises(PublishOptionsError) as caught:
        idle.questpie.queue.record.publish(VALID, **options)
    assert caught.value.__cause__ is None  # not a re-raised UnicodeEncodeError/OverflowError
    assert idle.written() == before
    # Keyed, so the publish would be ledgered: still nothing in the ledger.
    if "idempotency_key" not in options and "singleton_key" not in options:
        with pytest.raises(PublishOptionsError):
            idle.questpie.queue.record.publish(VALID, idempotency_key="bounds:k", **options)
        assert idle.written() == before


EDGE_OF_TIME: list[tuple[str, object]] = [
    ("ISO year 1 east of UTC", "0001-01-01T00:00:00+01:00"),
    ("ISO year 9999 west of UTC", "9999-12-31T23:59:59-01:00"),
    ("datetime year 1 east of UTC", datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1)))),
]


@pytest.mark.parametrize(
    "start_after", [case[1] for case in EDGE_OF_TIME], ids=[case[0] for case in EDGE_OF_TIME]
)
def test_start_after_at_the_edge_of_the_datetime_range_is_an_option_error(
    idle: IdleApp, start_after: object
) -> None:
    """A valid, zone-aware time whose UTC value datetime cannot hold: still the option's
    error (not an OverflowError from converting it), and nothing written."""
    before = idle.written()
    with pytest.raises(PublishOptionsError):
        idle.questpie.queue.record.publish(
            VALID,
            idempotency_key="edge",
            start_after=start_after,  # type: ignore[arg-type]
        )
    assert idle.written() == before


BOUNDARY: list[tuple[str, dict[str, Any]]] = [
    ("start_after at the bound", {"start_after": MAX_START_AFTER_SECONDS}),
    ("retry_delay at the bound", {"retry_delay": MAX_RETRY_DELAY_SECONDS}),
    ("expire_in_seconds at the bound", {"expire_in_seconds": MAX_EXPIRE_IN_SECONDS}),
    ("queue of the longest name", {"queue": "q" * MAX_QUEUE_NAME_LENGTH}),
    ("key of astral characters", {"idempotency_key": "\U0001f600-key"}),
]


@pytest.mark.parametrize(
    "options", [case[1] for case in BOUNDARY], ids=[case[0] for case in BOUNDARY]
)
def test_values_at_the_bounds_are_accepted_and_stored(
    idle: IdleApp, options: dict[str, Any]
) -> None:
    key = options.get("idempotency_key", f"bounds:{sorted(options)}")
    before = datetime.now(UTC)
    dispatch_id = idle.questpie.queue.record.publish(VALID, **{"idempotency_key": key, **options})
    after = datetime.now(UTC)
    assert dispatch_id is not None
    row = idle.ledger.get(dispatch_id)
    assert row is not None
    assert row.idempotency_key == key
    if "retry_delay" in options:
        assert row.options.run.retry_delay == options["retry_delay"]
    if "expire_in_seconds" in options:
        assert row.options.run.expire_in_seconds == options["expire_in_seconds"]
    if "queue" in options:
        assert row.options.queue == options["queue"]
    if "start_after" in options:
        # That many seconds after the publish (the clock read while it resolved its options).
        delay = timedelta(seconds=options["start_after"])
        assert row.run_after is not None
        assert before + delay <= row.run_after <= after + delay, (before, row.run_after, after)


def test_resolve_options_raises_only_publish_options_errors() -> None:
    """The validator on its own, with no Questpie: the same bounds, the same error."""
    for _, options in OUT_OF_BOUNDS:
        with pytest.raises(PublishOptionsError):
            resolve_options({}, options)


@pytest.mark.parametrize(
    "options",
    [{"queue": "a\0b"}, {"retry_delay": 1e308}, {"expire_in_seconds": 10**20},
     {"start_after": 251606272082.0}, {"singleton_key": "\ud800"}],
)  # fmt: skip
def test_job_options_are_held_to_the_same_bounds(options: dict[str, Any]) -> None:
    def handler(payload: Work, ctx: JobContext) -> None:
        del payload, ctx

    with pytest.raises(JobDefinitionError):
        job(name="bounded", schema=Work, options=options)(handler)  # type: ignore[arg-type]


# --- StoredOptions: the ledger's `options` column ------------------------------------------


def test_stored_options_round_trip() -> None:
    stored = StoredOptions(
        run=RunOptions(retry_limit=5, retry_delay=2.5, retry_backoff=True, expire_in_seconds=60),
        priority=7,
        queue="reports",
        carry={"headers": {"x-trace": "abc"}, "link": [{"task": "t"}]},
    )
    data = stored.to_json()
    assert StoredOptions.from_json(data) == stored
    # Without carry, none is written, and the default one comes back.
    plain = StoredOptions(run=RunOptions(retry_limit=0), priority=None, queue=None)
    assert "carry" not in plain.to_json()
    assert StoredOptions.from_json(plain.to_json()) == plain


def test_stored_options_round_trip_through_the_ledger(idle: IdleApp) -> None:
    stored = StoredOptions(
        run=RunOptions(retry_limit=4, retry_delay=0.5, retry_backoff=True, expire_in_seconds=30),
        priority=3,
        queue="reports",
        carry={"headers": {"x-trace": "abc"}},
    )
    new = new_dispatch(options=stored)
    assert idle.ledger.dispatches.insert(new) is True
    row = idle.ledger.get(new.id)
    assert isinstance(row, DispatchRow)
    assert row.options == stored


MALFORMED: list[tuple[str, object]] = [
    ("None", None),
    ("a string", "not json object"),
    ("a list", [1, 2, 3]),
    ("a number", 42),
    ("empty object", {}),
    ("run not an object", {"run": "fast"}),
    ("run of wrong types", {"run": {"retry_limit": "3", "retry_backoff": "yes"}}),
    ("run out of bounds", {"run": {"retry_delay": 1e308, "expire_in_seconds": 10**20}}),
    ("run with NaN", {"run": {"retry_delay": float("nan")}}),
    ("priority out of range", {"priority": 99}),
    ("priority not an int", {"priority": "high"}),
    ("queue empty", {"queue": ""}),
    ("queue not a str", {"queue": ["a"]}),
    ("carry not an object", {"carry": ["x"]}),
]


@pytest.mark.parametrize("data", [case[1] for case in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_stored_options_fall_back_to_defaults(data: object) -> None:
    parsed = StoredOptions.from_json(data)
    default = StoredOptions()
    assert parsed.run == RunOptions()
    assert parsed.run.expire_in_seconds == DEFAULT_EXPIRE_IN_SECONDS
    assert parsed.priority is None
    assert parsed.queue is None
    assert dict(parsed.carry) == {}
    assert parsed == default


def test_malformed_fields_do_not_spoil_the_good_ones() -> None:
    parsed = StoredOptions.from_json(
        {"run": {"retry_limit": 4}, "priority": 99, "queue": "reports", "carry": "x"}
    )
    assert parsed.run.retry_limit == 4
    assert (parsed.priority, parsed.queue, dict(parsed.carry)) == (None, "reports", {})


def test_malformed_options_column_reads_back_as_defaults(idle: IdleApp) -> None:
    """A row whose `options` JSON someone else wrote badly still reads (and can be sent)."""
    new = new_dispatch()
    assert idle.ledger.dispatches.insert(new) is True
    with idle.ledger.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE questpie_queue_dispatch SET options = ? WHERE id = ?",
            ('{"run": [1], "priority": "x", "queue": 7}', new.id),
        )
    row = idle.ledger.get(new.id)
    assert row is not None
    assert row.options == StoredOptions()


def test_every_option_in_the_vocabulary_has_one_validator() -> None:
    """The vocabulary is declared once (`jobs/keywords.py`): every option a publish takes
    is validated, every option a job declares is either a publish's or the job's own."""
    assert vocabulary._VALIDATORS.keys() == PublishOptions.__optional_keys__
    assert JobOptions.__optional_keys__ - JOB_ONLY_OPTIONS <= vocabulary._VALIDATORS.keys()


def test_a_job_option_given_as_none_is_not_given() -> None:
    @job(name="options.none", schema=Work, options={"retry_limit": None, "queue": None})
    def handler(payload: Work, ctx: JobContext) -> None: ...

    assert handler.options == {}


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"questpie": {}}, "it is questpie's"),
        ({1: "x"}, "mapping of str names"),
        ({"when": datetime.now(UTC)}, "must hold JSON values"),
        ("trigger=ui", "mapping of str names"),
    ],
)
def test_custom_headers_are_json_and_never_questpies_own(headers: Any, message: str) -> None:
    with pytest.raises(PublishOptionsError, match=message):
        resolve_options({}, {"headers": headers})


def test_custom_headers_are_kept_for_every_send() -> None:
    options = resolve_options({}, {"headers": {"trigger_source": "ui"}})
    assert options.stored().carry == {"headers": {"trigger_source": "ui"}}
