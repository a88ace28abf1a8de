"""How a chord or batch ends: once, by whoever records the end that completes it.

Every write that ends a dispatch (a run's outcome, a lapsed lease's, a cancel, a
revoke) is followed by `member_ended`. For a member of a canvas it asks the ledger
whether any member is still to end; the caller that finds none reads the members' ends
and ends the canvas with one conditional update, in the transaction that inserts the
callback's dispatch row (or the errbacks'), which is sent once that commits. So the
callback is published exactly once: two callers that both find every member ended
meet the conditional update, and one of them wins. A process that dies between a
member's end and that commit leaves the canvas open, and the relay's `sweep` ends it.

The failure policies of a chord:

- `fail` (Celery's): the first member that fails for good, or is cancelled, ends the
  chord as `failed` at once. The body never runs; each of its errbacks runs once, given
  the failed member's id, and the body's result is stored as a `ChordError` where the
  app has a result backend, as Celery does.
- `run`: the body runs once every member has ended, given each failed or cancelled
  member's error in its place: `{"questpie_failed": {"dispatch_id", "status", "error"}}`.

A batch (`publish_many(..., on_complete=...)`) always waits for every item, and its
callback is given `{"batch_id", "counts", "ids"}`: how many items ended in each status,
and the item ids in order.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from celery import Celery
from celery.backends.base import DisabledBackend
from celery.canvas import Signature, signature
from celery.exceptions import ChordError

from ..errors import QuestpieError
from ..ledger import DispatchRow, Ledger
from ..ledger.canvases import CanvasRow, MemberEnd
from ..ledger.schema import TERMINAL
from .results import decode, encode

log = logging.getLogger(__name__)

#: The key of a failed or cancelled member's place in a chord body's results
#: (`on_member_failure="run"`).
FAILED_KEY = "questpie_failed"
#: How long a canvas stays open before the relay's sweep looks at it: its members' own
#: ends settle it sooner, and the sweep is for an end whose process died.
SWEEP_AFTER_SECONDS = 10.0


class Completion:
    def __init__(self, ledger: Ledger, celery_app: Celery) -> None:
        self._canvases = ledger.canvases
        self._app = celery_app
        self._swept_to: tuple[datetime, str] | None = None  # where the next sweep goes on

    # --- the values a canvas keeps --------------------------------------------------------

    def encode_signature(self, sig: Signature) -> dict[str, Any]:
        """A callback's signature as the canvas row keeps it, by the app's serializer."""
        stored = encode(dict(sig), self._app.conf.task_serializer)
        assert stored is not None
        return stored

    def _signature(self, stored: dict[str, Any]) -> Signature:
        return signature(decode(stored, self._app.conf.accept_content), app=self._app)

    # --- ending -------------------------------------------------------------------------

    def member_ended(self, row: DispatchRow, status: str, error: str | None) -> None:
        """After `row` ended for good as `status` (with `error`): end its canvas if that
        was the end it waited for. Best effort: the write that ended the row has landed,
        and a canvas left open is the relay's sweep's."""
        if row.canvas_id is None:
            return
        try:
            self.settle(row.canvas_id, ended=MemberEnd(row.id, status, None, error))
        except QuestpieError as exc:
            log.warning(
                "canvas %s: could not look whether it completed (%s); the relay will",
                row.canvas_id,
                exc,
                extra={"dispatch_id": row.id, "canvas_id": row.canvas_id},
            )

    def settle(self, canvas_id: str, *, ended: MemberEnd | None = None) -> bool:
        """End the canvas if its members allow it; True when this call ended it.
        `ended`: the member whose end prompted the look."""
        failed_now = ended is not None and ended.status != "completed"
        if not failed_now and self._canvases.has_open_member(canvas_id):
            return False  # the common case: one look, and nothing more
        state = self._canvases.state(canvas_id)
        if state is None or state.status != "open":
            return False
        fails_fast = state.kind == "chord" and state.on_member_failure == "fail"
        if failed_now and fails_fast:
            assert ended is not None
            return self._fail(canvas_id, ended.id, ended.last_error)
        if failed_now and self._canvases.has_open_member(canvas_id):
            return False
        canvas = self._canvases.get(canvas_id)
        if canvas is None or canvas.status != "open":
            return False
        ends = self._canvases.member_ends(canvas.members)
        if any(_still_open(member, ends) for member in canvas.members):
            return False  # a member recorded before this canvas (a key seen before)
        if fails_fast:
            for member in canvas.members:
                end = _end_of(member, ends)
                if end.status != "completed":
                    return self._fail(canvas.id, end.id, end.last_error)
        return self._complete(canvas, ends)

    def sweep(self, limit: int = 100) -> int:
        """End the open canvases whose last member's end was not followed by the look
        that ends them (its process died); how many were ended. Each sweep goes on after
        the last canvas the previous one looked at, and starts over once it found fewer
        than `limit`."""
        found = self._canvases.open_canvases(
            older_than=SWEEP_AFTER_SECONDS, after=self._swept_to, limit=limit
        )
        self._swept_to = found[-1] if len(found) == limit else None
        return sum(self.settle(canvas_id) for _, canvas_id in found)

    def _complete(self, canvas: CanvasRow, ends: dict[str, MemberEnd]) -> bool:
        if canvas.callback is None:
            with self._canvases.closing(canvas.id, "completed") as session:
                return session is not None
        callback = self._signature(canvas.callback)
        value = self._results(canvas, ends) if canvas.kind == "chord" else _summary(canvas, ends)
        with self._canvases.closing(canvas.id, "completed") as session:
            if session is None:
                return False
            # Sent once the session commits; the relay's if this process dies first.
            sent = callback.apply_async((value,), task_id=canvas.callback_id, session=session)
        log.info(
            "%s %s completed: its callback %s is sent",
            canvas.kind,
            canvas.id,
            sent.id,
            extra={"canvas_id": canvas.id, "dispatch_id": sent.id},
        )
        return True

    def _fail(self, canvas_id: str, member: str, error: str | None) -> bool:
        canvas = self._canvases.get(canvas_id)
        if canvas is None or canvas.status != "open":
            return False
        errbacks = [self._signature(stored) for stored in canvas.errbacks or ()]
        with self._canvases.closing(canvas_id, "failed", member) as session:
            if session is None:
                return False
            for index, errback in enumerate(errbacks):
                errback.apply_async(
                    (member,), task_id=f"{canvas.id}.errback.{index}", session=session
                )
            # Before the commit: a process that dies after it leaves no body result
            # waiting for ever; one that dies before it leaves the chord open, and the
            # end that ends it again stores the same.
            self._store_chord_error(canvas, member, error)
        log.warning(
            "chord %s failed: its member %s ended %s; its body does not run",
            canvas.id,
            member,
            error or "cancelled",
            extra={"canvas_id": canvas.id, "dispatch_id": member},
        )
        return True

    def _store_chord_error(self, canvas: CanvasRow, member: str, error: str | None) -> None:
        """Where Celery's chord would: the body's result says why it never ran."""
        if canvas.callback_id is None or isinstance(self._app.backend, DisabledBackend):
            return
        try:
            self._app.backend.mark_as_failure(
                canvas.callback_id, ChordError(f"Dependency {member} raised {error}")
            )
        except Exception as exc:  # the chord ends regardless; its backend is a courtesy
            log.warning("chord %s: could not store its ChordError (%s)", canvas.id, exc)

    def _results(self, canvas: CanvasRow, ends: dict[str, MemberEnd]) -> list[Any]:
        """The members' results in header order; a failed member's error in its place."""
        accept = self._app.conf.accept_content
        results = []
        for member in canvas.members:
            end = _end_of(member, ends)
            if end.status == "completed":
                results.append(decode(end.result, accept))
            else:
                results.append(
                    {
                        FAILED_KEY: {
                            "dispatch_id": end.id,
                            "status": end.status,
                            "error": end.last_error,
                        }
                    }
                )
        return results


def _still_open(member: str | None, ends: dict[str, MemberEnd]) -> bool:
    return member is not None and member in ends and ends[member].status not in TERMINAL


def _end_of(member: str | None, ends: dict[str, MemberEnd]) -> MemberEnd:
    """A member's end: a batch's item a queue policy refused is `refused` (a chord with
    one is never applied); a member whose row retention removed, failed."""
    if member is None:
        return MemberEnd("", "refused", None, None)
    return ends.get(member) or MemberEnd(member, "failed", None, "Removed")


def _summary(canvas: CanvasRow, ends: dict[str, MemberEnd]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for member in canvas.members:
        status = _end_of(member, ends).status
        counts[status] = counts.get(status, 0) + 1
    return {"batch_id": canvas.id, "counts": counts, "ids": canvas.members}
