"""The send thread's own rules: order, its bound, flush, close, fork and a failing send;
a call's rows kept in one batch, and sent by the caller itself when nothing else waits.

Its sends are a recording function here: what the outbox sends through it, on a real
broker, is tested in tests/integration/test_send_behind.py.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from questpie_celery.send.behind import SendBehind
from questpie_celery.send.threads import SendThreads


@dataclass(frozen=True)
class Row:
    id: str


class Recorder:
    """A `send_many` that records each batch, and can be held before sending."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.fail_with: BaseException | None = None
        self.nested: SendBehind | None = None
        self.nested_flush: list[bool] = []  # what a flush made inside a send answered
        self.threads: list[str] = []  # the thread each batch was sent in

    def __call__(self, rows: Sequence[Any], traces: Mapping[str, Mapping[str, str]] | None) -> None:
        del traces
        self.entered.set()
        self.hold.wait()
        if self.fail_with is not None:
            raise self.fail_with
        self.batches.append([row.id for row in rows])
        self.threads.append(threading.current_thread().name)
        if self.nested is not None and rows[0].id == "outer":
            # A send that publishes (a before_task_publish handler that does).
            self.nested.submit([Row("inner")])
        if self.nested is not None and rows[0].id == "flusher":
            # A send that flushes (a handler run inline in it, whose delivery then waits
            # for the sends of what it published): it must not wait for itself.
            self.nested_flush.append(self.nested.flush())

    @property
    def sent(self) -> list[str]:
        return [row for batch in self.batches for row in batch]


def rows(*ids: str) -> list[Row]:
    return [Row(i) for i in ids]


def test_rows_are_sent_in_the_order_handed_over_by_every_thread() -> None:
    recorder = Recorder()
    behind = SendBehind(recorder)
    handed: list[str] = []
    lock = threading.Lock()

    def publish(prefix: str) -> None:
        for n in range(200):
            with lock:  # the order they were handed over in, across the threads
                row = f"{prefix}-{n}"
                behind.submit(rows(row))
                handed.append(row)

    threads = [threading.Thread(target=publish, args=(p,)) for p in "abcd"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert behind.flush(10)
    assert recorder.sent == handed
    assert len(recorder.sent) == 800


def test_rows_waiting_together_go_in_one_batch() -> None:
    recorder = Recorder()
    recorder.hold.clear()
    behind = SendBehind(recorder)
    behind.submit(rows("first"))
    assert recorder.entered.wait(5)  # the thread is inside the first send
    behind.submit(rows("a", "b"))
    behind.submit(rows("c"))
    recorder.hold.set()
    assert behind.flush(10)
    assert recorder.batches == [["first"], ["a", "b", "c"]]


def test_a_full_queue_makes_the_next_publish_wait_for_room() -> None:
    recorder = Recorder()
    recorder.hold.clear()
    behind = SendBehind(recorder, limit=2)
    behind.submit(rows("taken"))  # the thread takes it and is held inside the send
    assert recorder.entered.wait(5)
    behind.submit(rows("w1", "w2"))  # fills the queue
    returned = threading.Event()

    def publish() -> None:
        behind.submit(rows("w3"))
        returned.set()

    threading.Thread(target=publish, daemon=True).start()
    assert not returned.wait(0.3), "a publish went past the bound"
    recorder.hold.set()  # the broker answers: room is made
    assert returned.wait(5)
    assert behind.flush(10)
    assert recorder.sent == ["taken", "w1", "w2", "w3"]


def test_flush_says_when_its_time_ran_out() -> None:
    recorder = Recorder()
    recorder.hold.clear()
    behind = SendBehind(recorder)
    behind.submit(rows("slow"))
    assert behind.flush(0.1) is False
    recorder.hold.set()
    assert behind.flush(10) is True


def test_a_send_that_publishes_never_waits_on_its_own_bound() -> None:
    recorder = Recorder()
    behind = SendBehind(recorder, limit=1)
    recorder.nested = behind
    recorder.hold.clear()
    behind.submit(rows("outer"))
    assert recorder.entered.wait(5)
    behind.submit(rows("filler"))  # the queue is full while the outer send publishes
    recorder.hold.set()
    assert behind.flush(10)
    assert sorted(recorder.sent) == ["filler", "inner", "outer"]


def test_after_close_rows_are_sent_in_the_callers_thread() -> None:
    recorder = Recorder()
    behind = SendBehind(recorder)
    behind.submit(rows("before"))
    assert behind.close(10)
    behind.submit(rows("after"))
    assert recorder.sent == ["before", "after"]
    assert recorder.threads == ["questpie-send-behind", threading.current_thread().name]


def test_a_failing_send_is_logged_by_its_type_and_the_thread_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = Recorder()
    recorder.fail_with = RuntimeError("the payload says canary-7f3a")
    behind = SendBehind(recorder)
    with caplog.at_level(logging.ERROR, logger="questpie_celery"):
        behind.submit(rows("doomed"))
        assert behind.flush(10)
    recorder.fail_with = None
    behind.submit(rows("next"))
    assert behind.flush(10)
    assert recorder.sent == ["next"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "RuntimeError" in text and "doomed" in text and "relay" in text
    assert "canary" not in text


def test_a_flush_made_inside_a_send_answers_at_once_instead_of_waiting_for_itself() -> None:
    recorder = Recorder()
    behind = SendBehind(recorder)
    recorder.nested = behind
    behind.submit(rows("flusher"))
    # The flush inside the send has no timeout: waiting for its own batch, it never ends.
    assert behind.flush(10)
    assert recorder.nested_flush == [False]  # its own batch was not sent yet when it asked
    behind.submit(rows("next"))
    assert behind.flush(10)
    assert recorder.sent == ["flusher", "next"]


def in_background(call: Callable[[], object]) -> threading.Event:
    """Run `call` on a thread of its own; the event is set once it returned."""
    returned = threading.Event()

    def run() -> None:
        call()
        returned.set()

    threading.Thread(target=run, daemon=True).start()
    return returned


def test_the_rows_of_one_call_go_in_one_batch_in_order_after_what_waited() -> None:
    recorder = Recorder()
    recorder.hold.clear()
    behind = SendBehind(recorder)
    behind.submit(rows("first"))  # the thread takes it and is held inside the send
    assert recorder.entered.wait(5)
    behind.submit(rows("single"))
    many = [f"m{n}" for n in range(1500)]  # more than a batch and more than the bound
    returned = in_background(lambda: behind.submit(rows(*many)))
    recorder.hold.set()
    assert returned.wait(5)
    assert behind.flush(10)
    assert recorder.batches == [["first"], ["single"], many]


def test_a_call_larger_than_the_room_waits_for_it_once_then_goes_whole() -> None:
    recorder = Recorder()
    recorder.hold.clear()
    behind = SendBehind(recorder, limit=3)
    behind.submit(rows("taken"))
    assert recorder.entered.wait(5)
    behind.submit(rows("w1", "w2"))  # waits: the thread is busy
    returned = in_background(lambda: behind.submit(rows("a", "b", "c", "d", "e")))
    assert not returned.wait(0.3), "a call went past the bound"
    assert behind.flush(0.05) is False
    recorder.hold.set()  # the broker answers: room is made
    assert returned.wait(5)
    assert behind.flush(10)
    assert recorder.batches == [["taken"], ["w1", "w2"], ["a", "b", "c", "d", "e"]]


def test_a_call_of_many_while_nothing_waits_is_sent_before_it_returns() -> None:
    recorder = Recorder()
    behind = SendBehind(recorder, limit=2)
    behind.submit(rows("a", "b", "c"))
    # Sent by the caller's own thread, as one batch, past the bound: nothing else waited.
    assert recorder.batches == [["a", "b", "c"]]
    assert recorder.threads == [threading.current_thread().name]
    assert behind.flush(0)


def test_rows_handed_over_during_a_callers_send_wait_for_it_and_flush_too() -> None:
    recorder = Recorder()
    recorder.hold.clear()
    behind = SendBehind(recorder)
    returned = in_background(lambda: behind.submit(rows("a", "b")))  # sends it itself
    assert recorder.entered.wait(5)
    behind.submit(rows("later"))  # handed over after: goes after
    behind.submit(rows("x", "y"))  # a call of many too, while another sends
    assert behind.flush(0.1) is False  # the caller's batch is not sent yet
    assert recorder.batches == []
    recorder.hold.set()
    assert returned.wait(5)
    assert behind.flush(10)
    assert recorder.sent == ["a", "b", "later", "x", "y"]
    assert recorder.batches[0] == ["a", "b"]


def test_a_callers_own_send_may_publish_and_flush_inside_it() -> None:
    recorder = Recorder()
    behind = SendBehind(recorder, limit=1)
    recorder.nested = behind
    behind.submit(rows("outer", "x"))  # publishes "inner" while it sends
    behind.submit(rows("flusher", "y"))  # flushes while it sends: answers at once
    assert behind.flush(10)
    assert recorder.sent == ["outer", "x", "inner", "flusher", "y"]
    assert recorder.nested_flush == [False]


def test_a_callers_own_send_that_fails_is_logged_and_the_call_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = Recorder()
    recorder.fail_with = RuntimeError("the payload says canary-7f3a")
    behind = SendBehind(recorder)
    with caplog.at_level(logging.ERROR, logger="questpie_celery"):
        behind.submit(rows("doomed", "too"))
    assert behind.flush(0)
    recorder.fail_with = None
    behind.submit(rows("next", "ones"))
    assert recorder.sent == ["next", "ones"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "RuntimeError" in text and "doomed" in text and "relay" in text
    assert "canary" not in text


class Killed(BaseException):
    """What ends a thread rather than fails a call: a greenlet killed, a SystemExit."""


def test_a_send_that_ends_its_thread_leaves_neither_flush_nor_publish_waiting_forever(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = Recorder()
    recorder.fail_with = Killed("the payload says canary-7f3a")
    behind = SendBehind(recorder, limit=2)
    with caplog.at_level(logging.ERROR, logger="questpie_celery"):
        behind.submit(rows("doomed"))
        assert behind.flush(10)  # the batch is the relay's, and said so
    recorder.fail_with = None
    # A queue's worth and more: with no thread left to make room, the third would wait
    # for ever.
    behind.submit(rows("a", "b", "c"))
    assert behind.flush(10)
    assert recorder.sent == ["a", "b", "c"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Killed" in text and "doomed" in text and "relay" in text
    assert "canary" not in text


def test_what_ends_a_callers_own_send_passes_on_and_leaves_nothing_waiting() -> None:
    recorder = Recorder()
    recorder.fail_with = Killed("interrupted")
    behind = SendBehind(recorder)
    with pytest.raises(Killed):
        behind.submit(rows("doomed", "too"))
    recorder.fail_with = None
    behind.submit(rows("next"))  # the thread's
    behind.submit(rows("and", "more"))
    assert behind.flush(10)
    assert recorder.sent == ["next", "and", "more"]


def in_a_child(
    report: Callable[[], str], *, then: Callable[[], object] = lambda: None
) -> tuple[int, str]:
    """Fork: the child runs `report` and leaves at once (killed after 10 s if it is stuck,
    so the test fails rather than hangs); the parent runs `then` meanwhile. Returns the
    child's exit status and its report."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(10)
            os.write(write, report().encode())
        finally:
            os._exit(0)
    then()
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        return status, pipe.read()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_starts_with_nothing_waiting_and_sends_its_own() -> None:
    recorder = Recorder()
    recorder.hold.clear()
    behind = SendBehind(recorder)
    behind.submit(rows("parent-1"))
    assert recorder.entered.wait(5)
    behind.submit(rows("parent-2"))  # waiting in the parent when it forks

    def in_child() -> str:
        recorder.batches.clear()
        recorder.hold.set()  # the child's copy of the event (the parent's stays held)
        empty = behind.flush(1)  # nothing of the parent's is waiting here
        behind.submit(rows("child"))
        flushed = behind.flush(5)
        return f"{empty} {flushed} {recorder.sent}"

    status, seen = in_a_child(in_child)
    assert status == 0
    assert seen == "True True ['child']"
    recorder.hold.set()
    assert behind.flush(10)
    assert recorder.sent == ["parent-1", "parent-2"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_the_event_loops_send_threads_start_anew_in_a_child_forked_mid_call() -> None:
    # The asyncio commit sends' pool: a child forked while a parent's call is running and
    # another thread holds the pool's lock must neither wait for the parent's call nor
    # find the lock held for ever.
    threads = SendThreads(size=1)
    release = threading.Event()
    threads.submit(release.wait, 10)  # a parent's call, still running at the fork
    threads._lock.acquire()  # as a parent's thread inside submit() would at the fork

    def in_child() -> str:
        done: list[str] = []
        threads.submit(done.append, "child")
        drained = threads.drain(5)
        return f"{drained} {done}"

    status, seen = in_a_child(in_child, then=threads._lock.release)
    assert status == 0
    assert seen == "True ['child']"
    assert not threads.drain(0.05)  # the parent still waits for its own call
    release.set()
    assert threads.drain(10)
    threads.close()
