"""The threads that send for publishers in event loops: kombu only sends synchronously,
and a loop must never wait on the broker."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from .._runtime.forking import reset_in_child

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Threads that talk to the broker for publishers in event loops. A send takes the
#: broker a fraction of a millisecond, so a few keep up with many concurrent publishes,
#: and they hold no more than a few of the producer pool's connections.
SEND_THREADS = 4


class SendThreads:
    """A small pool of threads for kombu's blocking sends, made on first use (and made
    again in a forked child, where the parent's threads do not exist)."""

    _pool: ThreadPoolExecutor | None
    _pending: int  # calls `submit` handed over that have not ended yet

    def __init__(self, size: int = SEND_THREADS) -> None:
        self._size = size
        self._forked()
        reset_in_child(self._forked)

    def _forked(self) -> None:
        # A forked child has none of its parent's threads, waits for none of its parent's
        # calls, and may have been forked while a parent's thread held the lock: all anew.
        self._pool = None
        self._pending = 0
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        """Run `call(*args)` on a send thread, in the caller's context (its trace goes
        into the messages); the loop goes on meanwhile."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self._executor(), functools.partial(context.run, call, *args)
        )

    def submit(self, call: Callable[..., None], *args: Any) -> None:
        """Run `call(*args)` on a send thread without waiting for it (a commit hook);
        `drain` waits for it."""
        executor = self._executor()
        with self._lock:
            self._pending += 1
        executor.submit(call, *args).add_done_callback(self._one_ended)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every call `submit` handed over so far has ended; False if
        `timeout` (seconds) ran out first."""
        with self._ended:
            return self._ended.wait_for(lambda: self._pending == 0, timeout)

    def _one_ended(self, done: Future[None]) -> None:
        _log_failure(done)
        with self._ended:
            self._pending -= 1
            self._ended.notify_all()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._size, thread_name_prefix="questpie-send")
            return self._pool


def _log_failure(done: Future[None]) -> None:
    # send_committed logs and leaves to the relay what it could not send; anything else
    # escaping it is a bug worth a traceback, not a silent thread.
    if not done.cancelled() and done.exception() is not None:
        log.error("sending committed dispatches failed", exc_info=done.exception())
