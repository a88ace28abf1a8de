"""The broker's half of a ledgered publish, made after `publish()` has returned.

A ledgered publish returns once its row is durable: from then on the row is the truth,
and the relay sends whatever this process does not. So the caller need not wait for
the broker too. Its rows go to one thread of the process, which sends them in publish
order (several at a time over one pipelined producer connection when several wait)
while the caller goes on to its next commit.

What a caller can rely on:

- every row handed over is sent by this thread, or, when the broker refuses it or the
  process dies first, by a relay (its row is pending, due again in seconds);
- rows are sent in the order they were handed over, by every thread of the process;
- at most `MAX_WAITING` rows wait: a slow or dead broker makes the next publish wait
  for room, it never grows memory without bound;
- `flush(timeout)` returns once everything handed over before it was sent (or left to
  the relay); at interpreter exit a flush runs by itself, for up to `EXIT_FLUSH_SECONDS`;
- a forked child starts with nothing waiting (the parent sends what it handed over).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._runtime import telemetry
from .._runtime.forking import finish_at_exit, reset_in_child

log = logging.getLogger(__name__)

#: Rows handed over and not sent yet, at most; the next publish waits for room.
MAX_WAITING = 1000
#: Rows sent in one pipelined batch, at most.
BATCH = 1000
#: While publishes keep coming (the thread sent a batch less than `GATHER_SECONDS` ago),
#: a send thread that finds fewer than `GATHER_ROWS` waiting waits that long for more,
#: unless a flush waits for it: one pipelined batch of many costs the broker's client far
#: less CPU per message than a batch each, and the caller's thread and the send thread
#: share one GIL. A publish after a quiet moment is sent at once.
GATHER_ROWS = 50
GATHER_SECONDS = 0.02
#: How long the interpreter's exit waits for what is still waiting to be sent.
EXIT_FLUSH_SECONDS = 10.0

SendMany = Callable[[Sequence[Any], Mapping[str, Mapping[str, str]] | None], object]


class SendBehind:
    """One thread that sends the rows it is handed, in order (see the module's text).

    `send_many(rows, traces)` is the outbox's: it sends a batch of first attempts and
    leaves every row the broker did not take due for the relay; it does not raise.
    """

    _waiting: deque[tuple[Any, Mapping[str, str]]]
    _handed: int  # rows handed over since the process began (or was forked)
    _done: int  # of those, rows sent or left to the relay
    _changed: threading.Condition
    _thread: threading.Thread | None

    def __init__(self, send_many: SendMany, *, limit: int = MAX_WAITING) -> None:
        self._send_many = send_many
        self._limit = limit
        self._closed = False
        self._forked()
        reset_in_child(self._forked)
        finish_at_exit(self._flush_at_exit)

    def _flush_at_exit(self) -> None:
        self.flush(EXIT_FLUSH_SECONDS)

    def _forked(self) -> None:
        self._waiting = deque()
        self._handed = self._done = 0
        self._flushes = 0  # flushes waiting: the thread sends at once, gathering nothing
        self._changed = threading.Condition()
        self._thread = None

    def submit(self, rows: Sequence[Any]) -> None:
        """Hand rows over for sending; waits while `limit` rows wait already. After
        `close()`, sends them in the caller's thread."""
        if self._closed:
            self._send_many(rows, None)
            return
        trace = telemetry.carrier()  # the publisher's, for a send made in another thread
        # The send thread itself may publish (a `before_task_publish` handler that does):
        # only it makes room, so it never waits for room.
        ours = threading.current_thread() is self._thread
        with self._changed:
            for row in rows:
                while len(self._waiting) >= self._limit and not ours:
                    self._start()  # only it makes room (after one that ended, say)
                    self._changed.wait()
                self._waiting.append((row, trace))
                self._handed += 1
            self._start()
            self._changed.notify_all()

    def _start(self) -> None:
        """Start the send thread if none runs (holding `_changed`). It is recorded only
        once started: a start that fails is tried again by the next submit."""
        if self._thread is None:
            thread = threading.Thread(target=self._loop, name="questpie-send-behind", daemon=True)
            thread.start()
            self._thread = thread

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every row handed over before this call is sent or left to the
        relay; False if `timeout` (seconds) ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            target = self._handed
            if threading.current_thread() is self._thread:
                # Called inside a send (a handler run inline by it, a signal receiver):
                # the rows it would wait for include the batch this very call sends.
                return self._done >= target
            self._flushes += 1
            self._changed.notify_all()
            try:
                return self._flushed(target, deadline)
            finally:
                self._flushes -= 1

    def _flushed(self, target: int, deadline: float | None) -> bool:
        """Wait (holding `_changed`) until `target` rows are done, or until `deadline`."""
        while self._done < target:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._changed.wait(left)
        return True

    def close(self, timeout: float | None = EXIT_FLUSH_SECONDS) -> bool:
        """Flush, then send later rows in the caller's thread."""
        flushed = self.flush(timeout)
        self._closed = True
        return flushed

    def _loop(self) -> None:
        last_sent = 0.0  # when the last batch was sent (monotonic)
        while True:
            with self._changed:
                while not self._waiting:
                    self._changed.wait()
                if time.monotonic() - last_sent < GATHER_SECONDS:
                    self._changed.wait_for(
                        lambda: len(self._waiting) >= GATHER_ROWS or self._flushes > 0,
                        GATHER_SECONDS,
                    )
                batch = [self._waiting.popleft() for _ in range(min(BATCH, len(self._waiting)))]
                self._changed.notify_all()  # room for a publisher waiting on the bound
            rows = [row for row, _ in batch]
            ended = False
            try:
                self._send_many(rows, {row.id: trace for row, trace in batch if trace})
            except BaseException as exc:
                # Not meant to happen (the outbox leaves refused rows to the relay and
                # says so); if it does, the rows are still pending and the relay sends
                # them after their grace. The error's type only: its text could quote a
                # payload. An Exception leaves the thread going on for the next rows; what
                # ends a thread (a SystemExit, a greenlet killed) ends this one, and
                # another takes over what waits, so no flush or publish waits for ever.
                ended = not isinstance(exc, Exception)
                log.error(  # noqa: TRY400 (the type only, as said above)
                    "sending %d dispatch(es) (first %s) failed (%s); the relay sends them",
                    len(rows),
                    rows[0].id,
                    type(exc).__name__,
                )
            last_sent = time.monotonic()
            with self._changed:
                self._done += len(batch)
                if ended:
                    self._thread = None
                    if self._waiting:
                        self._start()
                self._changed.notify_all()
            if ended:
                return
