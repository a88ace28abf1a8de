"""The worker's event-loop timer drops cancelled entries (the pool's soft time limits of
finished runs) instead of holding them until they come due."""

from __future__ import annotations

import time

from kombu.asynchronous import Hub
from kombu.asynchronous.timer import Timer

from questpie_celery.worker.hub_timer import PURGE_EVERY_SECONDS, drop_cancelled, purge_regularly


def test_cancelled_entries_leave_the_heap_and_the_rest_fire_in_order() -> None:
    timer = Timer()
    fired: list[int] = []
    entries = [timer.call_after(0.01 * (n + 1), fired.append, (n,)) for n in range(8)]
    for n in (0, 3, 4, 7):
        entries[n].cancel()
    assert drop_cancelled(timer) == 4
    assert len(timer) == 4
    assert drop_cancelled(timer) == 0
    time.sleep(0.1)  # the scenario: past every entry's time (0.08 s at most), as the timer measures
    for _, (_, entry) in zip(range(10), timer, strict=False):
        if entry is None:
            break
        entry()
    assert fired == [1, 2, 5, 6]


def test_a_running_iterator_sees_the_purged_heap() -> None:
    # The hub iterates the timer with one long-lived generator that holds the heap list:
    # the purge must change that list in place, not replace it.
    timer = Timer()
    fired: list[str] = []
    soon = timer.call_after(0.0, fired.append, ("soon",))
    scheduler = iter(timer)
    _, first = next(scheduler)
    assert first is soon
    gone = timer.call_after(0.0, fired.append, ("cancelled",))
    timer.call_after(0.0, fired.append, ("kept",))
    gone.cancel()
    drop_cancelled(timer)
    timer.call_after(0.0, fired.append, ("entered after",))
    first()
    for _ in range(4):
        _, entry = next(scheduler)
        if entry is None:
            break
        entry()
    assert fired == ["soon", "kept", "entered after"]


def test_a_hub_purges_on_its_own_timer() -> None:
    hub = Hub()
    try:
        purge_regularly(hub)
        [scheduled] = hub.timer.queue
        assert scheduled.eta - time.monotonic() <= PURGE_EVERY_SECONDS
        for n in range(5):
            hub.call_later(600, print, n).cancel()
        assert len(hub.timer) == 6
        scheduled.entry()  # the purge, as the hub fires it
        # What remains: the purge, fired by hand here (the hub would have popped it
        # first), and its entry for the next round.
        assert [item.entry.canceled for item in hub.timer.queue] == [False, False]
    finally:
        hub.close()
