"""Run-side queue policy slots: parking a run whose slot is busy, handing a slot on.

A delivered run that its policy keeps from starting (`singleton`, `stately`,
`exclusive`) is parked: its message is acknowledged, it is neither failed nor
counted as an attempt, and it waits in the ledger. Whoever ends a run for good
sends the oldest parked run of that slot at once; the relay is the safety net
for a worker that dies before it can.
"""

from __future__ import annotations

import logging

from .ledger import DispatchRow, Ledger
from .outbox import Outbox
from .signals import run_parked

log = logging.getLogger(__name__)


class Slots:
    def __init__(self, ledger: Ledger, outbox: Outbox) -> None:
        self._ledger = ledger
        self._outbox = outbox

    def park(self, dispatch_id: str, job_name: str, attempt: int) -> None:
        """Set delivery `attempt` aside until its slot frees."""
        if not self._ledger.park(dispatch_id, job_name, attempt):
            return  # the row moved on meanwhile (finished, or parked by a duplicate)
        row = self._ledger.get(dispatch_id)
        if row is None or row.slot is None:
            return
        log.info(
            "dispatch %s of job %s parked: its %s slot %r is busy",
            dispatch_id,
            row.job_name,
            row.policy,
            row.slot,
            extra={"dispatch_id": dispatch_id, "job_name": row.job_name},
        )
        run_parked.send(
            sender=row.job_name,
            job_name=row.job_name,
            dispatch_id=dispatch_id,
            singleton_key=row.singleton_key,
        )
        # The holder may have finished between our claim and our park, and then nobody
        # would hand the slot on: look again.
        if not self._ledger.slot_running(row.job_name, row.slot):
            self.send_next(row.job_name, row.slot)

    def hand_on(self, finished: DispatchRow) -> None:
        """After a run ended for good, start the next parked run of its slot."""
        slot = finished.limited_slot
        if slot is not None:
            self.send_next(*slot)

    def send_next(self, job_name: str, slot: str) -> bool:
        """Unpark the oldest parked run of a slot and send it; True if one was sent.

        A refused send leaves it queued and due for the relay.
        """
        row = self._ledger.unpark_next(job_name, slot, self._outbox.redeliver_after)
        if row is None:
            return False
        return self._outbox.send(row, attempt=row.attempt + 1)
