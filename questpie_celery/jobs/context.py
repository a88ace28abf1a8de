"""The handler's context: the per-run application services of `Questpie(context=...)`.

The factory is called with no arguments once a run is let through (after the fence's
claim and the payload's validation), and what it returns becomes `ctx.app`:

- a plain object is used as it is;
- a context manager is entered before the handler and exited after it, and `ctx.app`
  is what `__enter__` returned (so `contextlib.contextmanager` generators work);
- an async context manager is entered and exited in one event loop of the run's own,
  and an `async def` handler runs in that same loop, between the two. A sync handler
  runs between them too, with the loop idle: its services are set up and closed as
  the async code they are, and the handler uses their sync parts.

An object that is both kinds is used as the kind that matches the handler.

Set-up and close belong to the attempt: either failing fails the attempt like a handler
error (and it is retried as one), because a context that commits on close and fails
there has lost the handler's work. A close that fails after the handler failed is
logged, and the handler's error is the one that counts. What `__exit__` returns is
ignored: a context cannot swallow the handler's error and turn a failed attempt into a
completed one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ClaimLostError, ConfigurationError
from .definition import (
    HandlerContext,
    JobDefinition,
    call_handler,
    in_fresh_thread,
    in_running_loop,
)

log = logging.getLogger(__name__)

#: A zero-argument callable building one run's application services.
ContextFactory = Callable[[], Any]


def checked_factory(factory: object) -> ContextFactory | None:
    """`factory` as given to `Questpie(context=...)`, or the reason it cannot be one."""
    if factory is None:
        return None
    if not callable(factory):
        raise ConfigurationError(
            f"context must be a zero-argument callable (or None), got {type(factory).__name__}"
        )
    # Mistakes that would otherwise surface at the first run, in a worker's log.
    if inspect.iscoroutinefunction(factory):
        raise ConfigurationError(
            "context must not be an async def function: return an async context manager "
            "instead (decorate an async generator with contextlib.asynccontextmanager)"
        )
    if inspect.isgeneratorfunction(factory) or inspect.isasyncgenfunction(factory):
        raise ConfigurationError(
            "context is a generator function: decorate it with contextlib.contextmanager "
            "(or asynccontextmanager for an async one)"
        )
    return factory


class RetryIn(Exception):  # not an error: how a run asks for its retry
    """Raised by a run to be retried in `seconds` (an adopted Celery task's `self.retry()`
    or `autoretry_for`): the next attempt of the same dispatch, while it has retries
    left. `cause` is the exception the retry is for, if any."""

    def __init__(self, seconds: float, cause: BaseException | None = None) -> None:
        super().__init__(f"retry in {seconds:g}s")
        self.seconds = seconds
        self.cause = cause


class AppContext:
    """The application's factory, and running a handler inside what it builds."""

    def __init__(self, factory: ContextFactory | None) -> None:
        self._factory = factory

    @contextmanager
    def override(self, factory: ContextFactory | None) -> Iterator[None]:
        """Runs in this process use `factory` until the block ends (then the one before)."""
        previous, self._factory = self._factory, checked_factory(factory)
        try:
            yield
        finally:
            self._factory = previous

    def call(
        self,
        definition: JobDefinition[Any],
        model: Any,
        ctx: HandlerContext,
        *,
        secret: bool,
        held: Callable[[], bool] = lambda: True,
    ) -> Any:
        """Run the handler with `ctx.app` set to what the factory builds for this run.

        `secret`: the payload is a secret one, so a close error logged here shows its
        class name only (its message might quote what the handler saw). `held`: whether
        the run still holds its claim; a context is closed as succeeded only then.
        """
        factory = self._factory
        if factory is None:
            return call_handler(definition, model, ctx)  # nothing else to do: no cost
        made = factory()
        if inspect.iscoroutine(made):
            made.close()  # never awaited: close it so Python does not warn about it
            raise TypeError(
                "the context factory returned a coroutine; return an async context manager"
            )
        kind = type(made)
        is_sync = hasattr(kind, "__enter__") and hasattr(kind, "__exit__")
        is_async = hasattr(kind, "__aenter__") and hasattr(kind, "__aexit__")
        if is_async and (definition.is_async or not is_sync):
            return _in_async_context(definition, model, ctx, made, secret, held)
        if is_sync:
            app = kind.__enter__(made)
            return _around(
                lambda: call_handler(definition, model, dataclasses.replace(ctx, app=app)),
                lambda *end: kind.__exit__(made, *end),
                ctx,
                secret,
                held,
            )
        return call_handler(definition, model, dataclasses.replace(ctx, app=made))


def _in_async_context(
    definition: JobDefinition[Any],
    model: Any,
    ctx: HandlerContext,
    made: Any,
    secret: bool,
    held: Callable[[], bool],
) -> Any:
    """Enter, run and exit in one event loop, so what `__aenter__` bound to its loop (a
    connection pool, a client session) is used and closed in that loop.

    Where a loop already runs in this thread (eager mode inside an `async def` test),
    that loop of the run's own is made in a thread of its own."""
    if in_running_loop():
        return in_fresh_thread(
            lambda: _in_async_context(definition, model, ctx, made, secret, held)
        )
    kind = type(made)
    with asyncio.Runner() as runner:
        app = runner.run(kind.__aenter__(made))
        run_ctx = dataclasses.replace(ctx, app=app)

        def handle() -> Any:
            returned = definition.handler(model, run_ctx)
            # A plain wrapper of an `async def` returns its coroutine: run in this loop.
            return runner.run(returned) if inspect.iscoroutine(returned) else returned

        return _around(
            handle, lambda *end: runner.run(kind.__aexit__(made, *end)), ctx, secret, held
        )


def _around(
    handle: Callable[[], Any],
    close: Callable[[Any, Any, Any], Any],
    ctx: HandlerContext,
    secret: bool,
    held: Callable[[], bool],
) -> Any:
    """`handle()`, then `close(...)` as a `with` statement would, except that a close
    error never replaces the handler's and a close cannot suppress it, and that a run
    which lost its claim meanwhile is closed as failed (`ClaimLostError`): its context
    must not commit work the ledger will not record as this run's, and a retry redoes."""
    try:
        result = handle()
    except BaseException as exc:
        try:
            close(type(exc), exc, exc.__traceback__)
        except Exception as close_error:
            log.warning(
                "dispatch %s of job %s: closing its context raised %s after the handler "
                "raised %s; the handler's error is the one recorded",
                ctx.dispatch_id,
                ctx.job_name,
                type(close_error).__name__ if secret else repr(close_error),
                type(exc).__name__,
                extra={"dispatch_id": ctx.dispatch_id, "job_name": ctx.job_name},
            )
        raise
    if not held():
        lost = ClaimLostError(
            f"dispatch {ctx.dispatch_id}: the run lost its claim before its context closed "
            "(it ran past its time cap, or the ledger was out of reach longer than a lease)"
        )
        close(ClaimLostError, lost, None)
        raise lost
    close(None, None, None)
    return result
