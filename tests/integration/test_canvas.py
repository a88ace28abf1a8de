"""Durable Canvas on real workers, Redis and RabbitMQ: chords of adopted tasks whose body
runs exactly once (also when members are killed, replayed, fail or are cancelled),
chains whose replayed link starts the next once, batches with a completion callback,
and the results the ledger keeps.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import tests.support.canvasapp  # noqa: F401  (its shared tasks, on every app)
from questpie_celery import CanvasStatus, chord
from tests.integration.conftest import new_stack
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
