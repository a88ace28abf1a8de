"""Existing Celery tasks adopted where they stand (`base=LedgerTask`), on real workers,
Redis and RabbitMQ, with the app's pickle serializer: their call sites unchanged
(`delay`, `apply_async`, Canvas, a replayed message, a killed pool process).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chord, group

from questpie_celery import LedgerTask
from tests.integration.conftest import StackFactory, new_stack
from tests.support.adoptedapp import Overrides
from tests.support.brokers import capture, deliver, idle_queue
from tests.support.services import Beat, RedisServer
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

SECRET = "a" * 16 + "-adopted-secret-0123456789abcdef"
CANARY = "4111-CANARY-1111-adopted"
#: The app's pickle serializer; Celery refuses to run such a worker as root unless told
#: (the suite runs as root in CI).
PICKLE = {"QP_TEST_SERIALIZER": "pickle", "C_FORCE_ROOT": "1"}


@pytest.fixture(scope="module", params=["redis", "rabbitmq"])
def adopted_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """The pickle serializer, a secret, a Redis result backend (on RabbitMQ too), two
    pool processes, a short lease and a fast relay."""
    redis_server: RedisServer = request.getfixturevalue("redis_server")
    env = {
        **PICKLE,
        "QP_TEST_SECRET": SECRET,
        "QP_TEST_BACKEND": redis_server.url(redis_server.new_db()),
        "QP_TEST_LEASE": "4",
        "QP_TEST_RELAY": "0.5",
        "QP_TEST_EXTENDED": "1",  # result_extended, task events: all Celery can record
    }
    made = new_stack(request, tmp_path_factory.mktemp("adopted"), request.param, env=env)
    yield made
    made.close()


def task(stack: Stack, name: str) -> Any:
    """The stack's app's instance of one of `adoptedapp`'s shared tasks (each stack has
    its own app, and Celery's current app is whichever was made last)."""
    return stack.celery_app.tasks[f"adopted.{name}"]


def test_the_tasks_are_adopted_under_their_own_names(adopted_stack: Stack) -> None:
    task = adopted_stack.celery_app.tasks["adopted.process_document"]
    assert isinstance(task, LedgerTask)
    assert "adopted.process_document" in adopted_stack.questpie.definitions


def test_a_double_click_runs_once_with_the_apps_serializer(adopted_stack: Stack) -> None:
    """Two `delay`s of the same document (a dataclass only pickle carries): one dispatch
    id, one run, and its result in the app's result backend."""
    t = tag()
    document = 7_000 + hash(t) % 1_000
    first = task(adopted_stack, "process_document").delay(document, Overrides("cs", (1, 2)), tag=t)
    second = task(adopted_stack, "process_document").apply_async((document,), {"tag": t})
    assert first.id == second.id
    assert first.get(timeout=30) == {"document_id": document, "language": "cs"}
    runs = adopted_stack.wait_ends(t, 1)
    assert len(runs) == 1
    assert adopted_stack.runs(t)[0]["note"] == "language=cs"
    assert adopted_stack.wait_status(first.id, "completed").attempt == 1


def test_a_key_set_on_a_signature_travels_with_it(adopted_stack: Stack) -> None:
    """`sig.set(idempotency_key=...)`: the key is an option of the signature, as Canvas
    carries its options; applied twice, one dispatch and one run."""
    t = tag()
    signature = task(adopted_stack, "asks_retry").s(t, 0).set(idempotency_key=f"set:{t}")
    first, again = signature.apply_async(), signature.apply_async()
    assert first.id == again.id
    assert first.get(timeout=30) == "done"
    adopted_stack.wait_status(first.id, "completed")
    assert len(adopted_stack.runs(t)) == 1


def test_a_replayed_message_runs_nothing_twice(adopted_stack: Stack) -> None:
    """The broker delivers an adopted task's message again, byte for byte, after its run
    and while a copy races it: the task ran once."""
    t = tag()
    idle = idle_queue()
    result = task(adopted_stack, "process_document").apply_async((1, None), {"tag": t}, queue=idle)
    adopted_stack.wait_status(result.id, "queued")
    message = capture(adopted_stack, idle)
    deliver(adopted_stack, message, copies=3)
    assert result.get(timeout=30) == {"document_id": 1, "language": None}
    adopted_stack.wait_status(result.id, "completed")
    deliver(adopted_stack, message)  # after the end, too
    wait_until(
        lambda: adopted_stack.celery_app.AsyncResult(result.id).state == "SUCCESS",
        "the result to stay",
    )
    adopted_stack.wait_settled(result.id)
    assert len(adopted_stack.runs(t)) == 1


def test_a_singleton_never_overlaps_itself_across_two_workers(adopted_stack: Stack) -> None:
    """Calls of one index while a run holds it wait their turn, on any worker: never two
    runs at once, and none lost."""
    other = adopted_stack.start_worker()
    try:
        t = tag()
        gate = adopted_stack.gate()
        first = task(adopted_stack, "rebuild_index").delay("main", t, str(gate))
        adopted_stack.wait_runs(t, 1)
        later = [task(adopted_stack, "rebuild_index").delay("main", t) for _ in range(3)]
        gate.open()
        for result in (first, *later):
            adopted_stack.wait_status(result.id, "completed")
        ends = adopted_stack.wait_ends(t, 1 + len({r.id for r in later} - {first.id}))
        starts = adopted_stack.runs(t)
        assert at_most_one_at_a_time(starts, ends)
    finally:
        other.stop()


def at_most_one_at_a_time(starts: list[dict[str, Any]], ends: list[dict[str, Any]]) -> bool:
    """No moment with two runs between their start and their end (an end recorded at the
    same instant as a start counts first)."""
    events = sorted([(r["ran_at"], 1) for r in starts] + [(r["ran_at"], -1) for r in ends])
    running = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        running += step
        if running > 1:
            return False
    return True


def test_a_plain_send_task_of_a_singleton_waits_for_the_run_that_holds_its_key(
    adopted_stack: Stack,
) -> None:
    """A service without the package sends the task by name while a run of the same
    index holds its slot: the worker takes the delivery in under the index computed from
    its arguments, so it waits its turn instead of running beside it."""
    t = tag()
    index = f"idx-{t}"
    gate = adopted_stack.gate()
    first = task(adopted_stack, "rebuild_index").delay(index, t, str(gate))
    adopted_stack.wait_runs(t, 1)
    sent = adopted_stack.celery_app.send_task(
        "adopted.rebuild_index",
        args=(index, t),
        serializer="pickle",
        queue=adopted_stack.queue_name,
    )
    row = adopted_stack.wait_status(sent.id, "parked")  # its slot is busy
    assert row.singleton_key == index
    gate.open()
    for dispatch_id in (first.id, sent.id):
        adopted_stack.wait_status(dispatch_id, "completed")
    ends = adopted_stack.wait_ends(t, 2)
    assert at_most_one_at_a_time(adopted_stack.runs(t), ends)


def test_celerys_expiry_and_time_limits_travel_with_the_call(adopted_stack: Stack) -> None:
    """`expires` (as one moment for every send) and per-call time limits stay Celery's."""
    idle = idle_queue()
    result = task(adopted_stack, "process_document").apply_async(
        (hash(tag()) % 1_000,),
        {"tag": tag()},
        queue=idle,
        expires=600,
        soft_time_limit=5,
        time_limit=9,
    )
    adopted_stack.wait_status(result.id, "queued")
    message = capture(adopted_stack, idle)
    assert message.headers["expires"] is not None
    assert list(message.headers["timelimit"]) == [9, 5]


def test_secret_arguments_reach_the_task_and_nothing_else(adopted_stack: Stack) -> None:
    t = tag()
    idle = idle_queue()
    result = task(adopted_stack, "charge").apply_async(("order-1-" + t, CANARY, t), queue=idle)
    adopted_stack.wait_status(result.id, "queued")
    message = capture(adopted_stack, idle)
    assert CANARY.encode() not in message.body
    assert CANARY not in repr(message.headers) + repr(message.properties)
    deliver(adopted_stack, message)
    row = adopted_stack.wait_status(result.id, "completed")
    assert adopted_stack.runs(t)[0]["note"] == f"card-length={len(CANARY)}"
    assert row.payload is None
    assert CANARY not in repr(row)
    assert CANARY not in adopted_stack.worker.log()
    assert result.get(timeout=30) is None
    for url in (adopted_stack.env["QP_TEST_BACKEND"], adopted_stack.env["QP_TEST_BROKER"]):
        if url.startswith("redis"):
            store = redis.Redis.from_url(url)
            for key in store.scan_iter():
                kind = store.type(key)
                if kind == b"string":
                    assert CANARY.encode() not in (store.get(key) or b""), key


def test_autoretry_for_retries_the_same_dispatch_up_to_max_retries(adopted_stack: Stack) -> None:
    t = tag()
    result = task(adopted_stack, "flaky").delay(t, fail_times=2)
    assert result.get(timeout=30) == 2
    assert [r["attempt"] for r in adopted_stack.runs(t)] == [1, 2, 3]
    assert adopted_stack.wait_status(result.id, "completed").attempt == 3


def test_an_exception_celery_would_not_retry_fails_the_dispatch_for_good(
    adopted_stack: Stack,
) -> None:
    t = tag()
    result = task(adopted_stack, "flaky").delay(t, boom=True)
    with pytest.raises(ValueError, match="not retried"):
        result.get(timeout=30)
    row = adopted_stack.wait_status(result.id, "failed")
    assert (row.attempt, row.last_error) == (1, "ValueError")
    assert len(adopted_stack.runs(t)) == 1


def test_self_retry_is_the_next_attempt_and_max_retries_holds(adopted_stack: Stack) -> None:
    """A keyed call (the key given at the call site): `self.retry()` makes the next
    attempt of the same dispatch, and `max_retries` still ends it."""
    asks_retry = task(adopted_stack, "asks_retry")
    t = tag()
    done = asks_retry.apply_async((t, 2), idempotency_key=t)
    assert done.get(timeout=30) == "done"
    assert [r["attempt"] for r in adopted_stack.runs(t)] == [1, 2, 3]
    assert adopted_stack.wait_status(done.id, "completed").attempt == 3
    t = tag()
    failing = asks_retry.apply_async((t, 5), idempotency_key=t)
    with pytest.raises(Exception, match="max retries"):
        failing.get(timeout=30)
    assert adopted_stack.wait_status(failing.id, "failed").attempt == 3


def test_an_unkeyed_call_retries_as_celery_does(adopted_stack: Stack) -> None:
    """With no key, no policy and no limits, a call needs no ledger row: `self.retry()`
    and `max_retries` are Celery's own."""
    t = tag()
    assert task(adopted_stack, "asks_retry").delay(t, 2).get(timeout=30) == "done"
    assert [r["attempt"] for r in adopted_stack.runs(t)] == [1, 2, 3]
    t = tag()
    with pytest.raises(Exception, match="Can't retry"):
        task(adopted_stack, "asks_retry").delay(t, 5).get(timeout=30)
    assert len(adopted_stack.runs(t)) == 3


def test_custom_headers_travel_on_the_first_send_and_on_every_retry(
    adopted_stack: Stack,
) -> None:
    t = tag()
    result = task(adopted_stack, "tracked").apply_async(
        (t,), {"fail_times": 2}, headers={"trigger_source": "upload-form"}
    )
    adopted_stack.wait_status(result.id, "completed")
    assert [r["note"] for r in adopted_stack.runs(t)] == ["trigger_source=upload-form"] * 3


def test_a_chord_of_adopted_tasks_runs_its_body_once(adopted_stack: Stack) -> None:
    t = tag()
    result = chord([task(adopted_stack, "square").s(x, t) for x in (1, 2, 3)])(
        task(adopted_stack, "total").s(t)
    )
    assert result.get(timeout=30) == 14
    body = wait_until(
        lambda: (
            [r for r in adopted_stack.runs(t, phase="end") if r["job_name"] == "adopted.total"]
            or None
        ),
        "the chord's body to run",
    )
    assert [r["note"] for r in body] == ["1,4,9"]


def test_a_group_of_unkeyed_adopted_tasks_answers_under_the_ids_celery_froze(
    adopted_stack: Stack,
) -> None:
    t = tag()
    result = group(task(adopted_stack, "asks_retry").s(f"{t}-{i}", 0) for i in range(3))()
    assert result.get(timeout=30) == ["done"] * 3


def test_a_group_of_keyed_adopted_tasks_answers_under_the_ids_celery_froze(
    adopted_stack: Stack,
) -> None:
    """Each member's key names its dispatch; its result is also stored where the group
    reads it."""
    t = tag()
    first = 50_000 + hash(t) % 1_000
    members = (
        task(adopted_stack, "process_document").s(first + i, tag=f"{t}-{i}") for i in range(3)
    )
    results = group(members)().get(timeout=30)
    assert [r["document_id"] for r in results] == [first, first + 1, first + 2]


def test_the_tasks_own_soft_time_limit_holds(adopted_stack: Stack) -> None:
    assert task(adopted_stack, "patient").delay(tag()).get(timeout=30) == "soft limit"


def test_a_beat_entry_of_an_adopted_task_fires_unchanged(adopted_stack: Stack) -> None:
    """`celery beat` with the ledger's scheduler, and an ordinary beat entry naming an
    adopted task: each tick is one run."""
    t = tag()
    beat = Beat(
        {**adopted_stack.env, "QP_TEST_BEAT_TAG": t},
        app="tests.support.jobapp:celery_app",
        cwd=Path.cwd(),
        pythonpath=str(Path.cwd()),
    ).start()
    try:
        adopted_stack.wait_ends(t, 2, timeout=60)
    finally:
        beat.stop()
    assert "Traceback" not in beat.log()


def test_a_pool_process_killed_mid_run_loses_nothing(adopted_stack: Stack) -> None:
    """SIGKILL of the pool process while the task runs: its lease lapses, the relay sends
    the dispatch again, and it completes; the killed run never wrote its end."""
    t = tag()
    gate = adopted_stack.gate()
    result = task(adopted_stack, "process_document").delay(
        99_000 + hash(t) % 1_000, tag=t, gate=str(gate)
    )
    first = adopted_stack.wait_runs(t, 1)[0]
    os.kill(int(first["pid"]), signal.SIGKILL)
    wait_until(lambda: len(adopted_stack.runs(t)) >= 2, "the run to start again", 60)
    gate.open()
    row = adopted_stack.wait_status(result.id, "completed", timeout=60)
    assert row.attempt == 2
    assert len(adopted_stack.runs(t, phase="end")) == 1


def test_an_in_process_call_runs_the_function(adopted_stack: Stack) -> None:
    """A management command calling the task as a function: Celery's own behaviour,
    no ledger, no broker."""
    assert task(adopted_stack, "shout")("hello") == "HELLO"


def runs_named(stack: Stack, t: str, name: str) -> list[dict[str, Any]]:
    return [r for r in stack.runs(t) if r["job_name"] == name]


@pytest.mark.parametrize("broker", ["redis"])
def test_a_plain_send_task_of_a_singleton_is_taken_into_the_ledger(
    make_stack: StackFactory, broker: str, tmp_path: Path
) -> None:
    """A service without the package sends the task by name: its policy holds all the
    same (the worker takes the delivery into the ledger)."""
    stack = make_stack(broker, env=PICKLE)
    t = tag()
    sent = stack.celery_app.send_task(
        "adopted.rebuild_index", args=("plain", t), serializer="pickle", queue=stack.queue_name
    )
    row = stack.wait_status(sent.id, "completed")
    assert row.job_name == "adopted.rebuild_index"
    assert len(runs_named(stack, t, "adopted.rebuild_index")) == 1
