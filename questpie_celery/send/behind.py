"""The broker's half of a ledgered publish, made after `publish()` has returned.

A ledgered publish returns once its row is durable: from then on the row is the truth,
and the relay sends whatever this process does not. So the caller need not wait for
the broker too. Its rows go to one thread of the process, which sends them in publish
order (several at a time over one pipelined producer connection when several wait)
while the caller goes on to its next commit.

What a caller can rely on:

- every row handed over is sent by this thread (or by the caller itself, below), or,
  when the broker refuses it or the process dies first, by a relay (its row is
  pending, due again in seconds);
- rows are sent in the order they were handed over, by every thread of the process;
- the rows handed over in one call (a `publish_many` chunk) go to the broker together,
  in one pipelined batch, never split;
- at most `MAX_WAITING` rows wait: a slow or dead broker makes the next publish wait
  for room, it never grows memory without bound (a call handing over more rows than
  that at once waits until nothing else waits, then goes whole);
- `flush(timeout)` returns once everything handed over before it was sent (or left to
  the relay); at interpreter exit a flush runs by itself, for up to `EXIT_FLUSH_SECONDS`;
- a forked child starts with nothing waiting (the parent sends what it handed over).

A call that hands over at least `INLINE_ROWS` rows while nothing waits and nothing is
being sent sends them itself, in the caller's thread, before it returns (as one batch,
as the thread would): the same batch sent by the thread, which wakes on another core
than the caller's, measured about a fifth more CPU, and a bulk publish has little to
overlap with its one send (docs/benchmarks.md, bulk publishing). Rows handed over
meanwhile, by any thread, wait for it and go after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._runtime import telemetry
from .._runtime.forking import finish_at_exit, reset_in_child

log = logging.getLogger(__name__)

#: Rows handed over and not sent yet, at most; the next publish waits for room.
MAX_WAITING = 1000
#: Rows sent in one pipelined batch, at most, unless one call handed over more.
BATCH = 1000
#: While publishes keep coming (the thread sent a batch less than `GATHER_SECONDS` ago),
#: a send thread that finds fewer than `GATHER_ROWS` waiting, all handed over one at a
#: time, waits that long for more, unless a flush waits for it: one pipelined batch of
#: many costs the broker's client far less CPU per message than a batch each, and the
#: caller's thread and the send thread share one GIL. A publish after a quiet moment, and
#: the rows of a call that handed over several at once, are sent at once.
GATHER_ROWS = 50
GATHER_SECONDS = 0.02
#: A call handing over this many rows or more while nothing waits or is being sent sends
#: them in its own thread (see the module's text).
INLINE_ROWS = 2
#: How long the interpreter's exit waits for what is still waiting to be sent.
EXIT_FLUSH_SECONDS = 10.0

SendMany = Callable[[Sequence[Any], Mapping[str, Mapping[str, str]] | None], object]


@dataclass(frozen=True)
class _Handed:
    """The rows of one call, and its publisher's trace context (for a send made in
    another thread)."""

    rows: Sequence[Any]
    trace: Mapping[str, str]


class SendBehind:
    """One thread that sends the rows it is handed, in order (see the module's text).

    `send_many(rows, traces)` is the outbox's: it sends a batch of first attempts and
    leaves every row the broker did not take due for the relay; it does not raise.
    """

    _waiting: deque[_Handed]
    _rows_waiting: int  # rows in `_waiting`
    _several: int  # calls in `_waiting` that handed over more than one row
    _handed: int  # rows handed over since the process began (or was forked)
    _done: int  # of those, rows sent or left to the relay
    _sending: threading.Thread | None  # the thread sending a batch now, if one is
    _changed: threading.Condition
    _thread: threading.Thread | None

    def __init__(
        self, send_many: SendMany, *, limit: int = MAX_WAITING, inline_rows: int = INLINE_ROWS
    ) -> None:
        self._send_many = send_many
        self._limit = limit
        self._inline_rows = inline_rows
        self._closed = False
        self._forked()
        reset_in_child(self._forked)
        finish_at_exit(self._flush_at_exit)

    def _flush_at_exit(self) -> None:
        self.flush(EXIT_FLUSH_SECONDS)

    def _forked(self) -> None:
        self._waiting = deque()
        self._rows_waiting = self._several = 0
        self._handed = self._done = 0
        self._flushes = 0  # flushes waiting: the thread sends at once, gathering nothing
        self._sending = None
        self._changed = threading.Condition()
        self._thread = None

    def submit(self, rows: Sequence[Any]) -> None:
        """Hand rows over for sending; waits while they would not fit beside the rows
        waiting already (see the module's text). After `close()`, sends them in the
        caller's thread."""
        if self._closed:
            self._send_many(rows, None)
            return
        if not rows:
            return
        me = threading.current_thread()
        trace = telemetry.carrier()  # the publisher's, for a send made in another thread
        with self._changed:
            # A send may itself publish (a `before_task_publish` handler that does): only
            # its own batch's end makes room, so it never waits for room.
            if self._sending is not me:
                while self._rows_waiting and self._rows_waiting + len(rows) > self._limit:
                    self._start()  # only it makes room (after one that ended, say)
                    self._changed.wait()
            self._handed += len(rows)
            if len(rows) >= self._inline_rows and not self._waiting and self._sending is None:
                self._sending = me
            else:
                self._waiting.append(_Handed(rows, trace))
                self._rows_waiting += len(rows)
                self._several += len(rows) > 1
                self._start()
                self._changed.notify_all()
                return
        self._send(rows, None)

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
            if self._sending is threading.current_thread():
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
        me = threading.current_thread()
        last_sent = 0.0  # when the last batch was sent (monotonic)
        while True:
            with self._changed:
                while not self._waiting or self._sending is not None:
                    self._changed.wait()
                if time.monotonic() - last_sent < GATHER_SECONDS and not self._several:
                    self._changed.wait_for(
                        lambda: (
                            self._rows_waiting >= GATHER_ROWS
                            or self._several > 0
                            or self._flushes > 0
                        ),
                        GATHER_SECONDS,
                    )
                # Whole calls only: the first always, then more while they fit the batch.
                batch = [self._waiting.popleft()]
                size = len(batch[0].rows)
                while self._waiting and size + len(self._waiting[0].rows) <= BATCH:
                    batch.append(self._waiting.popleft())
                    size += len(batch[-1].rows)
                self._rows_waiting -= size
                self._several -= sum(len(handed.rows) > 1 for handed in batch)
                self._sending = me
                self._changed.notify_all()  # room for a publisher waiting on the bound
            rows = [row for handed in batch for row in handed.rows]
            traces = {
                row.id: handed.trace for handed in batch if handed.trace for row in handed.rows
            }
            if not self._send(rows, traces):
                return
            last_sent = time.monotonic()

    def _send(self, rows: Sequence[Any], traces: Mapping[str, Mapping[str, str]] | None) -> bool:
        """Send a batch this thread took (holding `_sending`, not `_changed`), count it
        done and let the next sender on; False if what it raised ends the thread."""
        ended = False
        try:
            self._send_many(rows, traces)
        except BaseException as exc:
            # Not meant to happen (the outbox leaves refused rows to the relay and says
            # so); if it does, the rows are still pending and the relay sends them after
            # their grace. The error's type only: its text could quote a payload. An
            # Exception leaves the thread going on for the next rows; what ends a thread
            # (a SystemExit, a greenlet killed) ends this one (the send thread's: another
            # takes over what waits; a caller's: it passes on), so no flush or publish
            # waits for ever.
            ended = not isinstance(exc, Exception)
            log.error(  # noqa: TRY400 (the type only, as said above)
                "sending %d dispatch(es) (first %s) failed (%s); the relay sends them",
                len(rows),
                rows[0].id,
                type(exc).__name__,
            )
            if ended and threading.current_thread() is not self._thread:
                raise
        finally:
            with self._changed:
                self._done += len(rows)
                self._sending = None
                me = threading.current_thread()
                if ended and me is self._thread:
                    self._thread = None
                if self._waiting:
                    self._start()
                self._changed.notify_all()
        return not ended
