"""The relay: finishes what a dead or unlucky process left half-done.

It runs inside every `celery worker` (a bootstep, in the main process) and as
`questpie-celery relay`; several relays share the work safely because every
change it makes is a conditional update that only one of them can win.

What it does:

- sends rows that are due and were never accepted: a publisher died or the broker
  refused, a `publish(connection=...)` committed, a far-off `start_after` nears;
- sends again accepted dispatches that no worker claimed within `redeliver_after`
  (a lost or purged message), and retries whose message was lost;
- ends a claim whose lease lapsed (its worker died, or the run outlived
  `expire_in_seconds`) as a failed attempt: retried as the dispatch's options say,
  or recorded `failed`, and its slot handed on;
- sends a parked run whose slot is free (the worker that freed the slot normally
  does this at once; this covers one that died first).

Sends back off exponentially (capped at an hour, and never sooner than
`redeliver_after` for a dispatch the broker already accepted); after
`MAX_RELAY_SENDS` the dispatch is recorded `failed`, a secret one with its key
erased. Every unfinished dispatch therefore reaches a terminal state.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any, ClassVar

from celery import bootsteps

from .dispatch import Dispatcher, relay_time_for_retry
from .errors import QuestpieError
from .ledger import DispatchRow, Ledger, utcnow
from .options import RunOptions
from .slots import SlotKeeper

log = logging.getLogger(__name__)

DEFAULT_RELAY_INTERVAL_SECONDS = 2.0
MAX_RELAY_SENDS = 25
MAX_BACKOFF_SECONDS = 3600.0


class Relay:
    def __init__(
        self,
        ledger: Ledger,
        dispatcher: Dispatcher,
        slots: SlotKeeper,
        interval: float = DEFAULT_RELAY_INTERVAL_SECONDS,
    ) -> None:
        self.ledger = ledger
        self.dispatcher = dispatcher
        self.slots = slots
        self.interval = interval

    def run_once(self) -> int:
        """One pass; returns how many dispatches it moved on."""
        moved = 0
        for row in self.ledger.due_for_send():
            moved += self._resend(row)
        for row in self.ledger.expired_claims():
            moved += self._recover(row)
        for job_name, slot in self.ledger.free_parked_slots():
            moved += self.slots.send_next(job_name, slot)
        return moved

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except QuestpieError as exc:
                log.warning("relay pass failed (%s); trying again", type(exc).__name__)
            except Exception:
                # Never let one bad pass end recovery for the life of the worker.
                log.exception("relay pass failed unexpectedly; trying again")
            stop.wait(self.interval)

    def _resend(self, row: DispatchRow) -> bool:
        if row.send_count >= MAX_RELAY_SENDS:
            if not self.ledger.give_up(row):
                return False
            log.warning(
                "dispatch %s of job %s: no worker took it after %d sends; failed",
                row.id,
                row.job_name,
                row.send_count,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )
            self.slots.hand_on(row)
            return True
        backoff = min(2.0 ** (row.send_count + 1), MAX_BACKOFF_SECONDS)
        if row.status != "pending":  # the broker accepted it once: it may just be waiting
            backoff = max(backoff, self.ledger.redeliver_after.total_seconds())
        taken = self.ledger.take_for_send(row, utcnow() + timedelta(seconds=backoff))
        if taken is None:
            return False  # another relay took it
        log.info(
            "relay sends dispatch %s of job %s (%s, send %d)",
            row.id,
            row.job_name,
            row.status,
            taken.send_count,
            extra={"dispatch_id": row.id, "job_name": row.job_name},
        )
        return self.dispatcher.send_row(taken, attempt=taken.attempt + 1)

    def _recover(self, row: DispatchRow) -> bool:
        run = RunOptions.from_dict(row.options.get("run"))
        if row.attempt <= run.retry_limit:
            delay = run.delay_before_retry(row.attempt)
            relay_at = relay_time_for_retry(delay)
            if not self.ledger.expire_claim(row, retry_in=delay, relay_at=relay_at):
                return False  # renewed or recovered by someone else meanwhile
            log.warning(
                "dispatch %s of job %s: lease expired on attempt %d; retrying",
                row.id,
                row.job_name,
                row.attempt,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )
            if relay_at is None:  # due soon: send it now; else a later pass sends it
                fresh = self.ledger.get(row.id)
                if fresh is not None and fresh.status == "retry":
                    self.dispatcher.send_row(fresh, attempt=fresh.attempt + 1)
            return True
        if not self.ledger.expire_claim(row, retry_in=None):
            return False
        log.warning(
            "dispatch %s of job %s: lease expired on its last attempt; failed",
            row.id,
            row.job_name,
            extra={"dispatch_id": row.id, "job_name": row.job_name},
        )
        self.slots.hand_on(row)
        return True


class RelayStep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
    """Runs the relay in the worker's main process, after the pool has forked.

    Before the consumer starts, it also records the queue policy of every job the
    worker serves, so publishers and workers agree on them.
    """

    requires: ClassVar[set[str]] = {"celery.worker.components:Pool"}
    questpie: ClassVar[Any]

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, worker: Any) -> None:
        try:
            self.questpie.policies.record_all(self.questpie.definitions.values())
        except QuestpieError as exc:
            log.warning("could not record queue policies in the ledger: %s", exc)
        self._thread = threading.Thread(
            target=self.questpie.relay.run_forever, args=(self._stop,), name="questpie-relay",
            daemon=True,
        )  # fmt: skip
        self._thread.start()

    def stop(self, worker: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    terminate = stop
