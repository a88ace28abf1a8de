"""Waiting for an event: the suite's one way, shared by both lanes.

A test waits for something it can observe (a row's state, a run recorded, a log line,
a file, a page) with `wait_until`, never for a length of time: a bare sleep only
stands for the scenario itself (an outage, a stall, the clock passing a window the
code under test measures), with a comment saying so."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def _ran_out(timeout: float, what: str, explain: Callable[[], str] | None) -> AssertionError:
    message = f"timed out after {timeout}s waiting for {what}"
    if explain is not None:
        message += f"\n{explain()}"
    return AssertionError(message)


def wait_until(
    probe: Callable[[], T | None],
    what: str,
    timeout: float = 30.0,
    interval: float = 0.02,
    *,
    explain: Callable[[], str] | None = None,
) -> T:
    """Poll `probe` until it returns something truthy, and return that; fail after
    `timeout` seconds saying `what` was waited for, followed by what `explain()` says
    (the state then, a worker's last lines) when given."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise _ran_out(timeout, what, explain)
        time.sleep(interval)


async def await_until(
    probe: Callable[[], Awaitable[T | None]],
    what: str,
    timeout: float = 30.0,
    interval: float = 0.02,
    *,
    explain: Callable[[], str] | None = None,
) -> T:
    """`wait_until` for a coroutine: awaits `probe()` and sleeps in the event loop."""
    deadline = time.monotonic() + timeout
    while True:
        found = await probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise _ran_out(timeout, what, explain)
        await asyncio.sleep(interval)
