"""Keeps the worker's event-loop timer from hoarding cancelled entries.

Every ledgered message carries a soft and a hard time limit, so that the prefork pool
can stop a run that outlives its lease. For each task it starts, the pool's main process
schedules the soft timeout on the event loop's timer, and cancels it when the task ends.
kombu's timer only marks a cancelled entry: the entry, its arguments and the task
objects they reference stay on the timer's heap until the entry's time comes, by default
`expire_in_seconds` (15 minutes) later. A worker running hundreds of short jobs a second
holds hundreds of thousands of them, and its main process grows by about 0.6 kB per run
until they start to come due.

`drop_cancelled` takes them off every `PURGE_EVERY_SECONDS` instead, on the event
loop's own thread, so the main process holds only the entries of the last few seconds.
"""

from __future__ import annotations

import heapq
import logging
from typing import Any

log = logging.getLogger(__name__)

PURGE_EVERY_SECONDS = 10.0


def drop_cancelled(timer: Any) -> int:
    """Remove the cancelled entries from a kombu `Timer`'s heap; returns how many.

    The heap is rebuilt in place: the timer's running iterator holds the same list.
    Must run on the thread that runs the timer (the hub's), as every timer call does.
    """
    queue = getattr(timer, "_queue", None)
    if not isinstance(queue, list):
        return 0  # a timer of another shape: nothing we know how to clean
    kept = [item for item in queue if not getattr(item[2], "canceled", False)]
    dropped = len(queue) - len(kept)
    if dropped:
        queue[:] = kept
        heapq.heapify(queue)
    return dropped


def purge_regularly(hub: Any) -> None:
    """Drop the cancelled entries of `hub`'s timer every `PURGE_EVERY_SECONDS`."""
    hub.call_repeatedly(PURGE_EVERY_SECONDS, _purge, hub.timer)


def _purge(timer: Any) -> None:
    try:
        drop_cancelled(timer)
    except Exception:  # a kombu whose timer changed shape: keep the worker running
        log.exception("dropping cancelled timer entries failed")
