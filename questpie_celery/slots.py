"""Run-side queue policy slots: parking a run whose slot is busy, handing a slot on.

A delivered run that its policy keeps from starting (`singleton`, `stately`) is
parked: its message is acknowledged, it is neither failed nor counted as an
attempt, and it waits in the ledger. The worker that frees the slot sends the
oldest parked run of that slot at once; the relay is the safety net for a worker
that dies before it can.
"""

from __future__ import annotations

import logging

from .dispatch import Dispatcher
from .ledger import DispatchRow, Ledger
from .policies import RUN_LIMITED
from .signals import run_parked

log = logging.getLogger(__name__)


class SlotKeeper:
    def __init__(self, ledger: Ledger, dispatcher: Dispatcher) -> None:
        self.ledger = ledger
        self.dispatcher = dispatcher

    def park(self, dispatch_id: str, attempt: int) -> None:
        if not self.ledger.park(dispatch_id, attempt):
            return  # the row moved on meanwhile (finished, or parked by a duplicate)
        row = self.ledger.get(dispatch_id)
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
        if not self.ledger.slot_running(row.job_name, row.slot):
            self.send_next(row.job_name, row.slot)

    def hand_on(self, finished: DispatchRow) -> None:
        """After a run ended for good, start the next parked run of its slot."""
        if finished.policy in RUN_LIMITED and finished.slot is not None:
            self.send_next(finished.job_name, finished.slot)

    def send_next(self, job_name: str, slot: str) -> bool:
        """Unpark the oldest parked run of a slot and send it; True if one was sent."""
        row = self.ledger.unpark_next(job_name, slot)
        if row is None:
            return False
        if self.dispatcher.send_row(row, attempt=row.attempt + 1):
            return True
        # The broker refused: park it again, so the relay finds it.
        self.ledger.park(row.id, row.attempt + 1)
        return False
