"""OpenTelemetry spans for publish, claim, run and end of attempt, with the trace context
carried through the message, checked with the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals
from kombu import Connection
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel

from questpie_celery import JobContext, Questpie, job

EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))
SECRET = "t" * 40


class Traced(BaseModel):
    tag: str
    link: str = ""
    fail_times: int = 0


@job(name="traced", schema=Traced, options={"retry_limit": 2})
def traced(payload: Traced, ctx: JobContext) -> None:
    if ctx.attempt <= payload.fail_times:
        raise RuntimeError(f"planned failure with {payload.link}")


def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, eager: bool) -> Questpie:
    del monkeypatch
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    app = Celery("traced", broker="memory://")
    app.conf.task_always_eager = eager
    app.conf.task_default_queue = f"traced-{uuid.uuid4().hex[:6]}"
    questpie = Questpie(app, ledger_url=url, jobs=[traced], secret=SECRET)
    questpie.migrate()
    return questpie


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """This test's tracer provider, in place of the process-wide one (which can be set
    only once, and would trace every later test of the session)."""
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: PROVIDER)
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


def named(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == name]


def attrs(span: ReadableSpan) -> dict[str, object]:
    return dict(span.attributes or {})


def carried(queue: str, count: int) -> dict[str, tuple[str, str]]:
    """(trace id, parent span id) from the `traceparent` header of each of the next
    `count` messages on `queue` of the in-memory broker, by dispatch id."""
    found: dict[str, tuple[str, str]] = {}
    with Connection("memory://") as conn:
        simple = conn.SimpleQueue(queue)
        for _ in range(count):
            message = simple.get(timeout=5)
            message.ack()
            _, trace_id, span_id, _ = message.headers["traceparent"].split("-")
            found[message.headers["id"]] = (trace_id, span_id)
    return found


def test_a_delivery_continues_the_publish_trace(
    tmp_path: Path, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    questpie = make(tmp_path, monkeypatch, eager=True)
    dispatch_id = questpie.queue.traced.publish(
        {"tag": "traced", "fail_times": 1}, idempotency_key="trace-1"
    )
    [publish] = named(spans, "questpie.publish")
    assert publish.kind == trace.SpanKind.PRODUCER
    assert attrs(publish) == {
        "questpie.job": "traced",
        "questpie.dispatch_id": dispatch_id,
        "questpie.outcome": "accepted",
        "questpie.policy": "standard",
    }
    deliveries = named(spans, "questpie.deliver")
    assert sorted(int(str(attrs(d)["questpie.attempt"])) for d in deliveries) == [1, 2]
    by_attempt = {attrs(d)["questpie.attempt"]: d for d in deliveries}
    first, retry = by_attempt[1], by_attempt[2]
    assert first.kind == trace.SpanKind.CONSUMER
    # The first delivery is a child of the publish; the retry, of the run that failed.
    assert first.parent is not None and first.parent.span_id == publish.context.span_id
    assert retry.context.trace_id == publish.context.trace_id
    assert (attrs(first)["questpie.outcome"], attrs(retry)["questpie.outcome"]) == (
        "retrying",
        "completed",
    )
    for name in ("questpie.claim", "questpie.run", "questpie.end"):
        assert len(named(spans, name)) == 2, name
    questpie.close()


def test_the_trace_context_travels_in_the_message(
    tmp_path: Path, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    questpie = make(tmp_path, monkeypatch, eager=False)
    queue = questpie.celery_app.conf.task_default_queue
    dispatch_id = questpie.queue.traced.publish({"tag": "carried"}, idempotency_key="trace-2")
    [publish] = named(spans, "questpie.publish")
    assert publish.context is not None and dispatch_id is not None
    assert carried(queue, 1)[dispatch_id][0] == f"{publish.context.trace_id:032x}"
    questpie.close()


def test_spans_hold_no_payload(
    tmp_path: Path, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    questpie = make(tmp_path, monkeypatch, eager=True)
    canary = f"canary-{uuid.uuid4().hex}"
    questpie.queue.traced.publish(
        {"tag": "s", "link": canary, "fail_times": 1},
        idempotency_key="trace-secret",
        secret_payload=True,
    )
    finished = spans.get_finished_spans()
    assert finished
    for span in finished:
        text = f"{span.name} {span.attributes} {span.events} {span.status}"
        assert canary not in text, span.name
    questpie.close()


def test_without_a_tracer_provider_spans_are_not_made_and_with_one_they_are() -> None:
    # In a process of its own: the global provider can be set only once per process.
    script = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from questpie_celery._runtime import telemetry
with telemetry.span("questpie.publish", job="j") as before:
    assert before._span is None, "a span was made with no provider set"
trace.set_tracer_provider(TracerProvider())
with telemetry.span("questpie.publish", job="j") as after:
    assert after._span is not None and after._span.is_recording()
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "ok", done.stderr


def test_gathered_apublish_calls_each_carry_their_own_trace(
    tmp_path: Path, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sends of gathered calls run on send threads, outside each caller's context:
    every message must still carry the trace of the call that published it."""
    questpie = make(tmp_path, monkeypatch, eager=False)
    queue = questpie.celery_app.conf.task_default_queue
    tracer = PROVIDER.get_tracer("test")

    async def call(name: str, key: str | None) -> tuple[int, str | None]:
        with tracer.start_as_current_span(name) as outer:
            dispatch_id = await questpie.queue.traced.apublish({"tag": name}, idempotency_key=key)
            return outer.get_span_context().trace_id, dispatch_id

    async def main() -> list[tuple[int, str | None]]:
        try:
            return await asyncio.gather(
                call("a", "k-a"), call("b", "k-b"), call("c", None), call("d", "k-d")
            )
        finally:
            await questpie.aclose()

    traces = {dispatch_id: trace_id for trace_id, dispatch_id in asyncio.run(main())}
    for dispatch_id, (trace_id, _) in carried(queue, 4).items():
        assert trace_id == f"{traces[dispatch_id]:032x}"
    questpie.close()


def test_apublish_many_carries_the_callers_trace(
    tmp_path: Path, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    questpie = make(tmp_path, monkeypatch, eager=False)
    queue = questpie.celery_app.conf.task_default_queue
    tracer = PROVIDER.get_tracer("test")

    async def main() -> int:
        try:
            with tracer.start_as_current_span("bulk") as outer:
                await questpie.queue.traced.apublish_many(
                    [{"tag": "k"}, {"tag": "plain"}], idempotency_keys=["many-k", None]
                )
                return outer.get_span_context().trace_id
        finally:
            await questpie.aclose()

    trace_id = asyncio.run(main())
    assert [found for found, _ in carried(queue, 2).values()] == [f"{trace_id:032x}"] * 2
    questpie.close()


def test_each_publish_many_carries_its_own_callers_trace(
    tmp_path: Path, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch reads the caller's trace context once: two calls from one thread, under two
    # spans, must not share the first one's.
    questpie = make(tmp_path, monkeypatch, eager=False)
    queue = questpie.celery_app.conf.task_default_queue
    tracer = PROVIDER.get_tracer("test")
    expected: dict[str, int] = {}
    for call in range(2):
        with tracer.start_as_current_span(f"bulk-{call}") as outer:
            ids = questpie.queue.traced.publish_many(
                [{"tag": f"{call}-{n}"} for n in range(3)],
                idempotency_keys=[f"many-{call}-{n}" if n else None for n in range(3)],
            )
            for dispatch_id in ids:
                assert dispatch_id is not None
                expected[dispatch_id] = outer.get_span_context().trace_id
    for dispatch_id, (trace_id, _) in carried(queue, 6).items():
        assert trace_id == f"{expected[dispatch_id]:032x}"
    questpie.close()


def test_a_publish_made_while_a_batch_is_open_carries_its_own_trace(
    tmp_path: Path, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A `before_task_publish` handler that publishes under a span of its own, while a
    # publish_many's batch is open on the thread: its message must not carry the batch's
    # trace (found by a reviewer).
    questpie = make(tmp_path, monkeypatch, eager=False)
    queue = questpie.celery_app.conf.task_default_queue
    tracer = PROVIDER.get_tracer("test")
    inner: dict[str, Any] = {}

    def audit(sender: object = None, **_: object) -> None:
        if sender == "traced" and not inner:
            with tracer.start_as_current_span("audit") as span:
                inner["span"] = span.get_span_context().span_id
                inner["dispatch"] = questpie.queue.traced.publish(
                    {"tag": "nested"}, idempotency_key="nested"
                )

    signals.before_task_publish.connect(audit, weak=False)
    try:
        with tracer.start_as_current_span("bulk"):
            questpie.queue.traced.publish_many(
                [{"tag": "a"}, {"tag": "b"}], idempotency_keys=["a", "b"]
            )
        assert questpie.flush(timeout=10)  # the sends, and the handler's, are made
    finally:
        signals.before_task_publish.disconnect(audit)
    parents = {dispatch_id: span_id for dispatch_id, (_, span_id) in carried(queue, 3).items()}
    questpie.close()
    [own] = [
        s
        for s in named(spans, "questpie.publish")
        if s.parent is not None and s.parent.span_id == inner["span"]
    ]
    assert own.context is not None
    assert parents[inner["dispatch"]] == f"{own.context.span_id:016x}"
