"""Random payloads and option sets thrown at publish() and schedule(): every call returns
(an id, None when suppressed, None for a schedule) or raises a clear error, and a call that
raises writes nothing anywhere."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kombu.transport import memory
from sqlalchemy import select

from questpie_celery import Questpie, QuestpieError
from questpie_celery.ledger import Ledger, open_ledger
from questpie_celery.ledger.schema import schedule_table
from tests.support import jobapp
from tests.unit.helpers import row_count

QUEUE = "fuzz-idle"

text = st.text(max_size=40)
numbers = st.one_of(
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
)
anything = st.one_of(st.none(), st.booleans(), numbers, text, st.lists(st.integers(), max_size=3))
when = st.one_of(
    numbers,
    text,
    st.datetimes(timezones=st.sampled_from([UTC, timezone(timedelta(hours=-5))])),
    st.datetimes(),  # naive: refused
    st.datetimes(timezones=st.just(UTC)).map(lambda d: d.isoformat()),
)
options = st.fixed_dictionaries(
    {},
    optional={
        "idempotency_key": st.one_of(text, anything),
        "singleton_key": st.one_of(text, anything),
        "queue_policy": st.one_of(
            st.sampled_from(["standard", "short", "singleton", "stately", "exclusive"]), anything
        ),
        "secret_payload": st.one_of(st.booleans(), anything),
        "priority": st.one_of(st.integers(-3, 12), anything),
        "start_after": when,
        "retry_limit": st.one_of(st.integers(-2, 10**6), anything),
        "retry_delay": st.one_of(numbers, anything),
        "retry_backoff": st.one_of(st.booleans(), anything),
        "expire_in_seconds": st.one_of(st.integers(-2, 10**12), anything),
        "queue": st.one_of(st.just(QUEUE), text, anything),
        "countdown": numbers,  # not an option: a TypeError
    },
)
payloads = st.one_of(
    st.fixed_dictionaries({"tag": text}),
    st.dictionaries(text, anything, max_size=4),
    anything,
)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Questpie, Ledger, Celery]]:
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'ledger.sqlite3'}"
    celery_app = Celery("fuzz", broker="memory://")
    celery_app.conf.task_default_queue = QUEUE
    questpie = Questpie(celery_app, ledger_url=url, jobs=jobapp.JOBS, secret="f" * 40)
    questpie.migrate()
    ledger = open_ledger(url)
    yield questpie, ledger, celery_app
    ledger.close()
    questpie.close()


def messages(celery_app: Celery) -> int:
    """Messages waiting in every queue of the in-memory broker (a fuzzed `queue` option
    may name any)."""
    del celery_app
    return sum(queue.qsize() for queue in memory.Channel.queues.values())


outcomes: dict[str, int] = {"published": 0, "refused": 0}


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # the same examples every run: no flaky suite, a reproducible find
    database=None,  # ... and no replay of examples an earlier local run saved
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Valid calls too, so a run always publishes some (random ones are mostly refused).
@example(payload={"tag": "a"}, chosen={})
@example(payload={"tag": "b"}, chosen={"idempotency_key": "fuzz:b", "priority": 3})
@example(payload={"tag": "c"}, chosen={"queue": QUEUE, "retry_limit": 0})
@example(payload={"tag": "d"}, chosen={"start_after": 5, "retry_backoff": True})
@example(payload={"tag": "e"}, chosen={"singleton_key": "s", "queue_policy": "singleton"})
@given(payload=payloads, chosen=options)
def test_publish_returns_an_id_or_raises_clearly_and_writes_nothing_when_it_raises(
    app: tuple[Questpie, Ledger, Celery], payload: Any, chosen: dict[str, Any]
) -> None:
    questpie, ledger, celery_app = app
    # An earlier example's message may still be on its way (sent after publish returned).
    assert questpie.flush(30)
    rows_before, sent_before = row_count(ledger), messages(celery_app)
    try:
        result = questpie.queue.record.publish(payload, **chosen)
    except TypeError as exc:
        assert "countdown" in chosen or not isinstance(exc, QuestpieError)
        assert "unexpected keyword argument" in str(exc)
    except QuestpieError as exc:
        assert isinstance(exc, ValueError), f"{type(exc).__name__} is not a ValueError: {exc}"
    else:
        assert result is None or isinstance(result, str)
        outcomes["published"] += 1
        return
    outcomes["refused"] += 1
    assert row_count(ledger) == rows_before, "a refused publish wrote a ledger row"
    assert questpie.flush(30)
    assert messages(celery_app) == sent_before, "a refused publish sent a message"


valid_crons = st.sampled_from(["0 6 * * *", "*/5 * * * *", "0 0 13 * FRI", "30 2 * * 7"])
crons = st.one_of(
    valid_crons,
    valid_crons,
    st.just("0 6 * *"),
    st.lists(
        st.sampled_from(["*", "0", "*/3", "1-5", "JAN", "L", "99", "?"]), min_size=4, max_size=6
    ).map(" ".join),
    anything,
)
schedule_options = st.fixed_dictionaries(
    {},
    optional={
        "tz": st.one_of(st.sampled_from(["UTC", "Europe/Prague", "Mars/Base", ""]), anything),
        "singleton_key": st.one_of(text, anything),
        "priority": st.one_of(st.integers(-3, 12), anything),
        "retry_limit": st.one_of(st.integers(-2, 10**6), anything),
        "retry_delay": st.one_of(numbers, anything),
        "retry_backoff": st.one_of(st.booleans(), anything),
        "expire_in_seconds": st.one_of(st.integers(-2, 10**12), anything),
        "queue": st.one_of(st.just(QUEUE), text, anything),
        "idempotency_key": text,  # refused: a PublishOptionsError
        "start_after": when,  # refused
        "secret_payload": st.booleans(),  # refused when True
        "countdown": numbers,  # not an option: a TypeError
    },
)


def schedule_rows(ledger: Ledger) -> list[tuple[Any, ...]]:
    with ledger.engine.connect() as conn:
        return [tuple(row) for row in conn.execute(select(schedule_table))]


schedule_outcomes: dict[str, int] = {"stored": 0, "refused": 0}


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Valid calls too, so a run always stores some (random ones are mostly refused).
@example(payload={"tag": "a"}, cron="0 6 * * *", chosen={})
@example(payload={"tag": "b"}, cron="*/5 * * * *", chosen={"tz": "Europe/Prague"})
@example(payload={"tag": "c"}, cron="0 0 13 * FRI", chosen={"priority": 9, "queue": QUEUE})
@example(payload={"tag": "d"}, cron="30 2 * * 7", chosen={"singleton_key": "s"})
@example(payload={"tag": "e"}, cron="0 6 * * *", chosen={"retry_limit": 0, "tz": "UTC"})
@given(
    payload=st.one_of(st.fixed_dictionaries({"tag": text}), payloads),
    cron=crons,
    chosen=st.one_of(st.just({}), schedule_options),
)
def test_schedule_returns_none_or_raises_clearly_and_changes_nothing_when_it_raises(
    app: tuple[Questpie, Ledger, Celery], payload: Any, cron: Any, chosen: dict[str, Any]
) -> None:
    questpie, ledger, _ = app
    before = schedule_rows(ledger)
    try:
        result = questpie.queue.record.schedule(payload, cron, **chosen)
    except TypeError as exc:
        assert "countdown" in chosen and not isinstance(exc, QuestpieError)
    except QuestpieError as exc:
        assert isinstance(exc, ValueError), f"{type(exc).__name__} is not a ValueError: {exc}"
    else:
        assert result is None
        schedule_outcomes["stored"] += 1
        return
    schedule_outcomes["refused"] += 1
    assert schedule_rows(ledger) == before, "a refused schedule() changed the stored schedule"


def test_the_fuzz_reached_both_outcomes() -> None:
    """A fuzz that only ever raised (or never did) would prove little."""
    assert outcomes["published"] >= 5, outcomes
    assert outcomes["refused"] >= 5
    assert schedule_outcomes["stored"] >= 5
    assert schedule_outcomes["refused"] >= 5
