"""Cancelling dispatches: `questpie.queue.cancel(...)`, its job form and the CLI's.

Celery's `revoke` lives in the memory of the workers that hear it: a worker that was
down, restarted or started later never does. A ledgered dispatch's deliveries all claim
its row first, so ending the row ends the dispatch for every worker at once, whenever
its message arrives. What the ledger does with each state is `ledger/cancels.py`'s; here
is what follows: the slot or seat a cancelled run leaves is handed on, the cancel is
told (a log line and the `dispatch_cancelled` signal), and the caller learns whether the
dispatch will run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..canvas.completion import Completion
from ..errors import UnknownDispatchError
from ..ledger import Ledger
from ..signals import dispatch_cancelled
from .slots import Slots

log = logging.getLogger(__name__)


class Cancellation:
    def __init__(
        self, ledger: Ledger, slots: Slots | None, completion: Completion | None = None
    ) -> None:
        """`slots` hands a freed slot or seat on at once; without (a tool that reaches
        only the ledger, no broker), the relays' safety net sends the next run soon.
        `completion` ends a chord or batch a cancel completes (without, the relays do)."""
        self._ledger = ledger  # a canvas member's row, before it is cancelled
        self._cancels = ledger.cancels
        self._canvases = ledger.canvases
        self._slots = slots
        self._completion = completion

    def cancel(self, dispatch_id: str) -> bool:
        """Cancel a dispatch: True when it will not run again (ended now if it had not
        started; a running one goes on, is not retried, and its end is `cancelled`);
        False when it had ended already, and nothing changed.

        A chord's or batch's id cancels it: it ends as `cancelled` (its callback never
        runs), and so does each member that has not started; True when it was open.

        Raises `UnknownDispatchError` for an id the ledger holds no row of, and for one
        no row can have (not a str, empty, a NUL, a lone surrogate, too long).
        """
        done = self._cancels.cancel(dispatch_id)
        if done.outcome == "unknown" and (canvas := self._canvases.get(dispatch_id)) is not None:
            with self._canvases.closing(canvas.id, "cancelled") as session:
                was_open = session is not None
            for member in canvas.members:
                if member is not None:
                    self._cancel_member(member, canvas.id)
            log.info(
                "%s %s cancelled%s",
                canvas.kind,
                canvas.id,
                "" if was_open else " (it had ended already; its members were looked at)",
                extra={"canvas_id": canvas.id},
            )
            return was_open
        if done.outcome == "unknown":
            raise UnknownDispatchError(
                f"no dispatch {dispatch_id!r} in the ledger: no such id, retention removed "
                "its ended row, or it never had one (an unkeyed publish of a standard job "
                "without limits is a plain Celery message; give it an idempotency key to "
                "make it cancellable)"
            )
        row = done.row
        assert row is not None
        if done.outcome == "ended":
            log.info(
                "dispatch %s of job %s: not cancelled, it had already ended (%s)",
                row.id,
                row.job_name,
                row.status,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )
            return False
        started = done.outcome == "requested"
        if started:
            log.info(
                "dispatch %s of job %s cancelled while it runs: it goes on, is not retried, "
                "and ends as cancelled",
                row.id,
                row.job_name,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )
        else:
            log.info(
                "dispatch %s of job %s cancelled (it was %s); it never runs",
                row.id,
                row.job_name,
                done.was,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )
            if self._slots is not None:
                self._slots.hand_on_or_leave(row, cancelled=True)
            if self._completion is not None:
                self._completion.member_ended(row, "cancelled", None)
        dispatch_cancelled.send(
            sender=row.job_name, job_name=row.job_name, dispatch_id=row.id, started=started
        )
        return True

    def _cancel_member(self, member: str, canvas_id: str) -> None:
        """Cancel a member of the canvas, unless it is a dispatch the canvas only shares
        (its key named one that existed before: others may wait for it)."""
        row = self._ledger.get(member)
        if row is None or row.canvas_id != canvas_id:
            return
        with contextlib.suppress(UnknownDispatchError):  # retention removed it meanwhile
            self.cancel(member)

    async def acancel(self, dispatch_id: str) -> bool:
        """`cancel()` from an event loop: the ledger's writes run on a worker thread."""
        return await asyncio.to_thread(self.cancel, dispatch_id)
