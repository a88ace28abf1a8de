"""Tracing with OpenTelemetry, when it is installed (`pip install 'questpie-celery[otel]'`).

Spans, named after what happens:

- `questpie.publish` (producer) around a `publish()`;
- `questpie.deliver` (consumer) around a delivery at the worker, with `questpie.claim`,
  `questpie.run` (the handler) and `questpie.end` (recording the outcome) inside it.

The trace context travels in the message's headers (W3C `traceparent`), injected when the
message is sent, so a delivery's span is a child of the publish that sent it, and a
retry's of the run that failed. Attributes carry ids and outcomes only
(`questpie.dispatch_id`, `questpie.job`, `questpie.attempt`, `questpie.policy`,
`questpie.outcome`): never a payload, and nothing at all from a secret one. Without
OpenTelemetry installed, every function here does nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
except ImportError:  # pragma: no cover - exercised where OpenTelemetry is absent
    trace = None  # type: ignore[assignment]

Attributes = Mapping[str, str | int | bool | None]


class Span:
    """The part of a span the package uses: setting attributes as they become known."""

    def __init__(self, span: Any = None) -> None:
        self._span = span

    def set(self, **attributes: str | int | bool | None) -> None:
        if self._span is None:
            return
        for name, value in attributes.items():
            if value is not None:
                self._span.set_attribute(f"questpie.{name}", value)


@contextmanager
def span(
    name: str, *, consumer: bool = False, **attributes: str | int | bool | None
) -> Iterator[Span]:
    """A span named `name` around the block (a producer's, or with `consumer` a consumer's)."""
    if trace is None or isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        # No tracer provider is set (yet): every span would be a no-op, and making one
        # still costs a context switch in and out, several times per publish and run.
        yield Span()
        return
    kind = trace.SpanKind.CONSUMER if consumer else trace.SpanKind.PRODUCER
    if name not in ("questpie.publish", "questpie.publish_many", "questpie.deliver"):
        kind = trace.SpanKind.INTERNAL
    tracer = trace.get_tracer("questpie_celery")
    # Celery's Ignore and Retry pass through here as control flow, and an exception's
    # text may quote a payload: outcomes are set as attributes, exceptions not recorded.
    with tracer.start_as_current_span(
        name, kind=kind, record_exception=False, set_status_on_exception=False
    ) as current:
        wrapped = Span(current)
        wrapped.set(**attributes)
        yield wrapped


def current() -> Span:
    """The span the block runs in (to add what became known, such as an outcome)."""
    return Span(trace.get_current_span()) if trace is not None else Span()


def inject(headers: MutableMapping[str, Any]) -> None:
    """Write the current trace context into a message's headers."""
    if trace is not None:
        propagate.inject(headers)


def current_context() -> object:
    """An identity of the current trace context (the same object until a span or an
    `attach` changes it); None when tracing is off."""
    return otel_context.get_current() if trace is not None else None


def carrier() -> dict[str, str]:
    """The current trace context as headers, to send later from another context (a send
    thread); empty when tracing is off."""
    headers: dict[str, str] = {}
    inject(headers)
    return headers


@contextmanager
def continued_from(headers: Mapping[str, Any] | None) -> Iterator[None]:
    """Make the trace context a message's headers carry current for the block."""
    if trace is None or not headers:
        yield
        return
    token = otel_context.attach(propagate.extract(dict(headers)))
    try:
        yield
    finally:
        otel_context.detach(token)
