"""Durable Canvas on real workers, Redis and RabbitMQ: chords of adopted tasks whose body
runs exactly once (also when members are killed, replayed, fail or are cancelled),
chains whose replayed link starts the next once, batches with a completion callback,
and the results the ledger keeps.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import chain
from celery.exceptions import ChordError

import tests.support.canvasapp  # noqa: F401  (its shared tasks, on every app)
from questpie_celery import CanvasStatus, chord
from questpie_celery.canvas.completion import Completion
from questpie_celery.canvas.results import encode
from questpie_celery.jobs.options import StoredOptions
from questpie_celery.ledger import NewDispatch
from questpie_celery.ledger.canvases import NewCanvas
from tests.integration.conftest import new_stack
from tests.support.brokers import capture, deliver, idle_queue
from tests.support.services import RedisServer
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until


@pytest.fixture(scope="module", params=["redis", "rabbitmq"])
def canvas_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """Two pool processes, a short lease, a fast relay, and a Redis result backend."""
    redis_server: RedisServer = request.getfixturevalue("redis_server")
    env = {
        "QP_TEST_BACKEND": redis_server.url(redis_server.new_db()),
        "QP_TEST_LEASE": "4",
        "QP_TEST_RELAY": "0.5",
    }
    made = new_stack(request, tmp_path_factory.mktemp("canvas"), request.param, env=env)
    yield made
    made.close()


def task(stack: Stack, name: str) -> Any:
    return stack.celery_app.tasks[f"canvas.{name}"]


def body_calls(stack: Stack, t: str, count: int = 1, phase: str = "body") -> list[Any]:
    """What each run of the body (or errback, or callback) was given, once `count` ran."""
    wait_until(lambda: len(stack.runs(t, phase)) >= count, f"{count} {phase} run(s)")
    return [
        json.loads(r["note"]) if phase != "errback" else r["note"] for r in stack.runs(t, phase)
    ]


def test_a_chords_body_runs_once_with_the_results_in_header_order(canvas_stack: Stack) -> None:
    t = tag()
    header = [task(canvas_stack, "member").s(i, t) for i in range(8)]
    result = chord(header)(task(canvas_stack, "body").s(tag=t))
    assert result.get(timeout=60) == 8
    assert body_calls(canvas_stack, t) == [[i * 10 for i in range(8)]]
    status = canvas_stack.questpie.queue.get_status(result.parent.id)
    assert isinstance(status, CanvasStatus)
    assert (status.kind, status.status, status.counts) == ("chord", "completed", {"completed": 8})
    assert status.callback_id == result.id


@pytest.fixture(scope="module", params=["redis", "rabbitmq"])
def backendless_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """No result backend configured at all."""
    env = {"QP_TEST_LEASE": "4", "QP_TEST_RELAY": "0.5"}
    made = new_stack(request, tmp_path_factory.mktemp("canvas-nb"), request.param, env=env)
    yield made
    made.close()


def test_a_chord_needs_no_result_backend(backendless_stack: Stack) -> None:
    t = tag()
    header = [task(backendless_stack, "member").s(i, t) for i in range(4)]
    result = chord(header)(task(backendless_stack, "body").s(tag=t))
    assert body_calls(backendless_stack, t) == [[0, 10, 20, 30]]
    backendless_stack.wait_status(result.id, "completed")


def test_a_member_failing_for_good_runs_the_errback_once_and_not_the_body(
    canvas_stack: Stack,
) -> None:
    """Celery's meaning, by default: the chord fails at the member's failure, its
    errback runs once given the member's id, and the body's result is a ChordError."""
    t = tag()
    gate = canvas_stack.gate()
    header = [
        task(canvas_stack, "member").s(0, t),
        task(canvas_stack, "member").s(1, t, fail=True),
        task(canvas_stack, "member").s(2, t, gate=str(gate)),
    ]
    body = task(canvas_stack, "body").s(tag=t).on_error(task(canvas_stack, "errback").s(tag=t))
    result = chord(header)(body)
    failed_member = result.parent.results[1].id
    assert body_calls(canvas_stack, t, phase="errback") == [failed_member]
    with pytest.raises(ChordError, match=f"Dependency {failed_member} raised ValueError"):
        result.get(timeout=30)
    gate.open()
    canvas_stack.wait_status(result.parent.results[2].id, "completed")
    status = canvas_stack.questpie.queue.get_status(result.parent.id)
    assert isinstance(status, CanvasStatus)
    assert (status.status, status.failed_member) == ("failed", failed_member)
    assert canvas_stack.ledger.get(result.id) is None  # the body was never sent
    assert canvas_stack.runs(t, "body") == []
    assert len(canvas_stack.runs(t, "errback")) == 1


def test_on_member_failure_run_gives_the_body_each_error_in_its_place(
    canvas_stack: Stack,
) -> None:
    t = tag()
    header = [
        task(canvas_stack, "member").s(0, t),
        task(canvas_stack, "member").s(1, t, fail=True),
        task(canvas_stack, "member").s(2, t),
    ]
    result = chord(header, on_member_failure="run")(task(canvas_stack, "body").s(tag=t))
    assert result.get(timeout=60) == 3
    failed = result.parent.results[1].id
    assert body_calls(canvas_stack, t) == [
        [
            0,
            {"questpie_failed": {"dispatch_id": failed, "status": "failed", "error": "ValueError"}},
            20,
        ]
    ]


def test_a_cancelled_member_counts_as_ended(canvas_stack: Stack) -> None:
    """With `on_member_failure="run"`, a member cancelled before it started holds its
    place with its status; the body runs once the others end."""
    t = tag()
    gate = canvas_stack.gate()
    header = [
        task(canvas_stack, "member").s(0, t, gate=str(gate)),
        task(canvas_stack, "member").s(1, t).set(countdown=3600),
    ]
    result = chord(header, on_member_failure="run")(task(canvas_stack, "body").s(tag=t))
    held = result.parent.results[1].id
    assert canvas_stack.questpie.queue.cancel(held) is True
    gate.open()
    assert body_calls(canvas_stack, t) == [
        [0, {"questpie_failed": {"dispatch_id": held, "status": "cancelled", "error": None}}]
    ]


def test_cancelling_a_chord_cancels_what_has_not_started_and_never_runs_the_body(
    canvas_stack: Stack,
) -> None:
    t = tag()
    header = [task(canvas_stack, "member").s(i, t).set(countdown=3600) for i in range(3)]
    result = chord(header)(task(canvas_stack, "body").s(tag=t))
    queue = canvas_stack.questpie.queue
    assert queue.cancel(result.parent.id) is True
    status = queue.get_status(result.parent.id)
    assert isinstance(status, CanvasStatus)
    assert (status.status, status.counts) == ("cancelled", {"cancelled": 3})
    assert queue.cancel(result.parent.id) is False  # ended already
    assert canvas_stack.ledger.get(result.id) is None


def test_fifty_members_killed_and_replayed_run_once_and_the_body_once(
    canvas_stack: Stack, tmp_path: Any
) -> None:
    """Two workers; three members kill their pool process on their first run; every
    member's message is delivered twice more. Each member ends once, and the body runs
    once with all 50 results in order."""
    other = canvas_stack.start_worker()
    try:
        t = tag()
        idle = idle_queue()
        deaths = {5, 20, 40}
        for index in deaths:
            (tmp_path / f"die-{index}").touch()
        # The others wait in a queue no worker reads, to be delivered three times over (a
        # killed member's retry goes where its calls go: the worker's queue).
        header = [
            task(canvas_stack, "member").s(i, t, die_once=str(tmp_path / f"die-{i}"))
            if i in deaths
            else task(canvas_stack, "member").s(i, t).set(queue=idle)
            for i in range(50)
        ]
        result = chord(header)(task(canvas_stack, "body").s(tag=t))
        messages = [capture(canvas_stack, idle) for _ in range(50 - len(deaths))]
        for message in messages:
            deliver(canvas_stack, message, copies=3)
        assert result.get(timeout=120) == 50
        assert body_calls(canvas_stack, t) == [[i * 10 for i in range(50)]]
        ends = sorted(int(r["note"]) for r in canvas_stack.runs(t, "end"))
        assert ends == list(range(50))
    finally:
        other.stop()
        canvas_stack.extra_workers.remove(other)
    for message in messages[:5]:  # after the end, too
        deliver(canvas_stack, message)
    replayed = [r.id for i, r in enumerate(result.parent.results) if i not in deaths]
    canvas_stack.wait_settled(*replayed[:5], result.id)
    assert len(canvas_stack.runs(t, "body")) == 1
    assert len(canvas_stack.runs(t, "end")) == 50


def test_a_replayed_chain_link_starts_the_next_once(canvas_stack: Stack) -> None:
    t = tag()
    idle = idle_queue()
    steps = chain(
        task(canvas_stack, "step").s(1, t).set(queue=idle),
        task(canvas_stack, "step").s(tag=t),
        task(canvas_stack, "step").s(tag=t),
    )
    result = steps.apply_async()
    first = capture(canvas_stack, idle)
    deliver(canvas_stack, first, copies=3)
    assert result.get(timeout=60) == 4
    deliver(canvas_stack, first)  # after the end, too
    canvas_stack.wait_settled(result.id, result.parent.id, result.parent.parent.id)
    assert sorted(int(r["note"]) for r in canvas_stack.runs(t)) == [1, 2, 3]


def test_a_batch_runs_its_on_complete_once_with_the_counts(canvas_stack: Stack) -> None:
    t = tag()
    batch = f"batch-{t}"
    ids = canvas_stack.questpie.queue["record"].publish_many(
        [{"tag": t}, {"tag": t, "permanent": True}, {"tag": t}],
        idempotency_keys=[f"{t}-0", f"{t}-1", f"{t}-2"],
        on_complete=task(canvas_stack, "on_complete").s(tag=t),
        batch_id=batch,
    )
    digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
    assert body_calls(canvas_stack, t, phase="complete") == [
        [batch, {"completed": 2, "failed": 1}, digest]
    ]
    status = canvas_stack.questpie.queue.get_status(batch)
    assert isinstance(status, CanvasStatus)
    assert (status.kind, status.status) == ("batch", "completed")
    assert len(canvas_stack.runs(t, "complete")) == 1


def test_a_completed_runs_result_is_kept_and_an_unknown_id_is_not_a_queued_one(
    canvas_stack: Stack,
) -> None:
    t = tag()
    queue = canvas_stack.questpie.queue
    ran = queue["record"].publish({"tag": t}, idempotency_key=t)
    assert ran is not None
    assert canvas_stack.wait_status(ran, "completed")
    status = queue.get_status(ran)
    assert status is not None and status.result == t
    later = queue["record"].publish({"tag": t}, idempotency_key=f"{t}-later", start_after=3600)
    assert later is not None
    waiting = queue.get_status(later)
    assert waiting is not None and waiting.status in ("pending", "queued")
    assert queue.get_status(f"{t}-no-such-id") is None


def test_a_chord_whose_last_end_was_not_followed_up_is_ended_by_the_relay(
    canvas_stack: Stack,
) -> None:
    """A worker that died between recording the last member's end and ending the chord
    leaves it open with every member ended: the relay's sweep sends the body, once."""
    t = tag()
    ledger = canvas_stack.ledger
    canvas_id, body_id = f"chord-{t}", f"body-{t}"
    members = []
    for index in range(3):
        new = NewDispatch(
            id=f"member-{t}-{index}",
            job_name="canvas.member",
            payload=None,
            options=StoredOptions(),
            canvas_id=canvas_id,
        )
        assert ledger.dispatches.insert(new)
        claim = ledger.claims.claim(new.id, new.job_name, 1, 60)
        assert claim.token is not None
        kept = encode(index * 10, "json")
        assert ledger.claims.finish(new.id, claim.token, "completed", None, kept)
        members.append(new.id)
    body = task(canvas_stack, "body").s(tag=t)
    completion = Completion(ledger, canvas_stack.celery_app)  # the app's own encoding
    with ledger.canvases.session() as session, session.begin():
        ledger.canvases.record(
            NewCanvas(
                id=canvas_id,
                kind="chord",
                members=members,
                callback=completion.encode_signature(body),
                callback_id=body_id,
            ),
            session.connection(),
        )
    assert body_calls(canvas_stack, t, phase="body") == [[0, 10, 20]]
    canvas_stack.wait_status(body_id, "completed")
    status = canvas_stack.questpie.queue.get_status(canvas_id)
    assert isinstance(status, CanvasStatus) and status.status == "completed"


def test_a_jobs_own_task_is_a_chord_member_its_keys_set_on_its_signature(
    canvas_stack: Stack,
) -> None:
    """A job's task (`queue.<job>.task.s(payload)`) in a durable chord's header: its
    payload validated, its key given by the signature (`.set(idempotency_key=...)`), its
    result in its place; the same key twice is one dispatch, run once."""
    t = tag()
    record = canvas_stack.questpie.queue["record"].task
    header = [
        record.s({"tag": t}).set(idempotency_key=f"{t}-job"),
        task(canvas_stack, "member").s(1, t),
        record.s({"tag": t}).set(idempotency_key=f"{t}-job"),
    ]
    result = chord(header)(task(canvas_stack, "body").s(tag=t))
    assert result.get(timeout=60) == 3
    assert body_calls(canvas_stack, t) == [[t, 10, t]]
    assert result.parent.results[0].id == result.parent.results[2].id
    canvas_stack.wait_settled(result.parent.results[0].id)
    assert len([r for r in canvas_stack.runs(t) if r["job_name"] == "record"]) == 1
