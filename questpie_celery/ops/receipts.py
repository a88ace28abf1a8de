"""Every view of a dispatch row: what a program may learn about a dispatch (its status,
and a secret one's receipt), what an operator sees of it (`DispatchDetail`), and what a
test sees of it (`Dispatch`).

None holds a ciphertext, key material or an error message; only the operator's detail
and the test's view hold a payload, and never a secret one's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal

from ..canvas.results import decode_json
from ..ledger import DispatchRow
from ..ledger.canvases import Canvases, CanvasRow, MemberState
from ..ledger.schema import RESENDABLE, TERMINAL

ReceiptStatus = Literal["queued", "completed", "failed", "cancelled"]


@dataclass(frozen=True)
class Receipt:
    """The life of one secret dispatch, without its payload or any key material."""

    dispatch_id: str
    job_name: str
    idempotency_key: str
    status: ReceiptStatus
    created_at: datetime
    queued_at: datetime | None
    handled_at: datetime | None

    @classmethod
    def of(cls, row: DispatchRow | None) -> Receipt | None:
        """A secret dispatch's receipt; None for any other row."""
        if row is None or not row.secret or row.idempotency_key is None:
            return None
        return cls(
            dispatch_id=row.id,
            job_name=row.job_name,
            idempotency_key=row.idempotency_key,
            status=receipt_status(row.status),
            created_at=row.created_at,
            queued_at=row.queued_at,
            handled_at=row.finished_at,
        )


@dataclass(frozen=True)
class DispatchStatus:
    """Where one ledgered dispatch stands (`questpie.queue.get_status`)."""

    dispatch_id: str
    job_name: str
    idempotency_key: str | None
    singleton_key: str | None
    status: str
    """pending, queued, parked, active, retry, completed, failed or cancelled."""
    attempt: int
    """Claims so far: 1 once the first run started."""
    last_error: str | None
    """The exception class of the last failed attempt, never its message."""
    secret: bool
    created_at: datetime
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    group_key: str | None = None
    """The group it counts against for its job's concurrency and rate limits."""
    waiting_for: str | None = None
    """Why it waits, when a limit holds it: "concurrency" (every seat of its group is
    taken; it is parked) or "rate" (no start of its group's window is left)."""
    cancel_requested_at: datetime | None = None
    """When a cancel found it running: it goes on, is not retried, ends as cancelled
    (a cancelled dispatch with a `started_at` was cancelled after it started)."""
    canvas_id: str | None = None
    """The chord or batch it is a member of."""
    result: Any = None
    """What its completed run returned, when that is kept as JSON (a job's, or an
    adopted task's with the json serializer); None otherwise, and for a secret one."""

    @classmethod
    def of(cls, row: DispatchRow | None) -> DispatchStatus | None:
        if row is None:
            return None
        return cls(
            dispatch_id=row.id,
            job_name=row.job_name,
            idempotency_key=row.idempotency_key,
            singleton_key=row.singleton_key,
            status=row.status,
            attempt=row.attempt,
            last_error=row.last_error,
            secret=row.secret,
            created_at=row.created_at,
            queued_at=row.queued_at,
            started_at=row.started_at,
            finished_at=row.finished_at,
            group_key=row.group_key,
            waiting_for=row.waiting_for,
            cancel_requested_at=row.cancel_requested_at,
            canvas_id=row.canvas_id,
            result=decode_json(row.result),
        )


@dataclass(frozen=True)
class CanvasStatus:
    """Where a chord or a batch stands (`questpie.queue.get_status(chord_or_batch_id)`):
    how many of its members are in each status, and its callback's dispatch."""

    canvas_id: str
    kind: str
    """chord or batch."""
    status: str
    """open (members still to end), completed (its callback sent), failed (a member
    failed a chord whose policy is `fail`) or cancelled."""
    on_member_failure: str
    members: int
    counts: dict[str, int]
    """Members by status; `removed` for a member whose row retention deleted."""
    callback_id: str | None
    failed_member: str | None
    created_at: datetime
    finished_at: datetime | None

    @classmethod
    def of(cls, canvases: Canvases, canvas_id: str) -> CanvasStatus | None:
        """The canvas of this id, or whose callback this is (the body of a chord that is
        still open has no dispatch yet: it answers its chord's status)."""
        canvas = canvases.get(canvas_id) or canvases.by_callback(canvas_id)
        if canvas is None:
            return None
        # Counted by the ledger, without reading the members' results.
        counts = member_counts(canvases, canvas.members)
        return cls(
            canvas_id=canvas.id,
            kind=canvas.kind,
            status=canvas.status,
            on_member_failure=canvas.on_member_failure,
            members=len(canvas.members),
            counts=counts,
            callback_id=canvas.callback_id,
            failed_member=canvas.failed_member,
            created_at=canvas.created_at,
            finished_at=canvas.finished_at,
        )


def receipt_status(ledger_status: str) -> ReceiptStatus:
    """Everything short of an outcome is `queued` (accepted, relaying, parked, running)."""
    if ledger_status in TERMINAL:
        return ledger_status  # type: ignore[return-value]
    return "queued"


@dataclass(frozen=True)
class DispatchDetail:
    """Everything a person needs about one ledgered dispatch, short of a secret."""

    dispatch_id: str
    job_name: str
    status: str
    attempt: int
    idempotency_key: str | None
    singleton_key: str | None
    policy: str | None
    last_error: str | None
    secret: bool
    key_erased: bool | None  # for a secret dispatch: its key and ciphertext are gone
    #: Retention dropped the payload and options of this ended keyed dispatch: the payload
    #: and the option fields below are None, not the defaults.
    pruned: bool
    payload: dict[str, Any] | None  # never for a secret dispatch
    priority: int | None
    queue: str | None
    retry_limit: int | None
    retry_delay: float | None
    retry_backoff: bool | None
    expire_in_seconds: int | None
    #: The relay's sends of the attempt waiting to be sent; None when none waits (the
    #: dispatch runs, is parked or has ended), since the count starts again at each claim.
    send_count: int | None
    created_at: datetime
    #: When the broker first accepted a message of it (at the latest, its first claim).
    queued_at: datetime | None
    #: When its latest attempt was claimed.
    started_at: datetime | None
    #: When it ended (completed, failed or cancelled); None until then, and again once
    #: requeued.
    finished_at: datetime | None
    run_after: datetime
    #: When the relay looks at it next; None when nothing is due for the relay.
    next_send_at: datetime | None
    lease_expires_at: datetime | None
    #: The group it counts against for its job's limits, and what it waits for, if one
    #: holds it ("concurrency" or "rate").
    group_key: str | None = None
    waiting_for: str | None = None
    #: When a cancel found it running (it ends as cancelled, and is not retried).
    cancel_requested_at: datetime | None = None
    #: The chord or batch it is a member of (`questpie-celery canvases show ID`).
    canvas_id: str | None = None

    @classmethod
    def of(cls, row: DispatchRow) -> DispatchDetail:
        run = None if row.pruned else row.options.run
        waits_for_relay = row.status in RESENDABLE
        return cls(
            dispatch_id=row.id,
            job_name=row.job_name,
            status=row.status,
            attempt=row.attempt,
            idempotency_key=row.idempotency_key,
            singleton_key=row.singleton_key,
            policy=str(row.policy) if row.policy is not None else None,
            last_error=row.last_error,
            secret=row.secret,
            key_erased=row.secret_wrapped_key is None if row.secret else None,
            pruned=row.pruned,
            payload=None if row.secret else row.payload,
            priority=row.options.priority,
            queue=row.options.queue,
            retry_limit=run.retry_limit if run else None,
            retry_delay=run.retry_delay if run else None,
            retry_backoff=run.retry_backoff if run else None,
            expire_in_seconds=run.expire_in_seconds if run else None,
            send_count=row.send_count if waits_for_relay else None,
            created_at=row.created_at,
            queued_at=row.queued_at,
            started_at=row.started_at,
            finished_at=row.finished_at,
            run_after=row.run_after,
            next_send_at=row.next_send_at if waits_for_relay else None,
            lease_expires_at=row.lease_expires_at,
            group_key=row.group_key,
            waiting_for=row.waiting_for,
            cancel_requested_at=row.cancel_requested_at,
            canvas_id=row.canvas_id,
        )

    def to_json(self) -> dict[str, Any]:
        return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class CanvasMember:
    """One member of a chord or batch as an operator sees it: never its result."""

    position: int
    #: None where a queue policy refused the member when the canvas was published.
    dispatch_id: str | None
    job_name: str | None
    #: The dispatch's status; `refused` (no dispatch), or `removed` (retention deleted
    #: its row).
    status: str
    last_error: str | None


@dataclass(frozen=True)
class CanvasDetail:
    """A chord or a batch as an operator sees it: its members by status and its
    callback's dispatch; never the callback's or errbacks' signatures, nor a result."""

    canvas_id: str
    kind: str
    """chord or batch."""
    status: str
    """open, completed, failed or cancelled."""
    on_member_failure: str
    members: int
    #: Members by status, as `CanvasStatus` counts them (`removed`, `refused`).
    counts: dict[str, int]
    callback_id: str | None
    #: The status of the callback's dispatch; None while it has no row (the canvas is
    #: open, or failed or was cancelled and the callback never ran).
    callback_status: str | None
    failed_member: str | None
    created_at: datetime
    finished_at: datetime | None

    @classmethod
    def of(
        cls, row: CanvasRow, counts: dict[str, int], callback: MemberState | None
    ) -> CanvasDetail:
        return cls(
            canvas_id=row.id,
            kind=row.kind,
            status=row.status,
            on_member_failure=row.on_member_failure,
            members=len(row.members),
            counts=counts,
            callback_id=row.callback_id,
            callback_status=callback.status if callback is not None else None,
            failed_member=row.failed_member,
            created_at=row.created_at,
            finished_at=row.finished_at,
        )

    def to_json(self) -> dict[str, Any]:
        return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in asdict(self).items()}


def member_counts(canvases: Canvases, members: list[str | None]) -> dict[str, int]:
    """Members by status, counted per position as `CanvasStatus` counts them: one
    grouped count per thousand ids, unless an id appears twice (a key that named a
    dispatch already a member), when each member's status is read."""
    present = [member for member in members if member is not None]
    counts: dict[str, int] = {}
    if len(set(present)) == len(present):
        counts = canvases.member_counts(present)
        removed = len(present) - sum(counts.values())
    else:
        states = canvases.member_states(present)
        for member in present:
            if member in states:
                status = states[member].status
                counts[status] = counts.get(status, 0) + 1
        removed = sum(member not in states for member in present)
    if removed:
        counts["removed"] = removed
    if refused := len(members) - len(present):
        counts["refused"] = refused
    return counts


def canvas_members(canvases: Canvases, row: CanvasRow) -> list[CanvasMember]:
    """Each member of the canvas in order, with its job, status and error class."""
    states = canvases.member_states(row.members)
    found: list[CanvasMember] = []
    for position, member in enumerate(row.members):
        state = states.get(member) if member is not None else None
        if state is None:
            status = "removed" if member is not None else "refused"
            found.append(CanvasMember(position, member, None, status, None))
        else:
            found.append(
                CanvasMember(position, member, state.job_name, state.status, state.last_error)
            )
    return found


@dataclass(frozen=True)
class Dispatch:
    """One dispatch as a test sees it (`questpie_celery.testing`): a ledgered one is
    `Dispatch.of` its detail; the harness records an unledgered one from Celery's signals."""

    id: str
    job_name: str
    #: The idempotency key, or None.
    key: str | None
    singleton_key: str | None
    #: The ledger's word: pending, queued, parked, active, retry, completed, failed or
    #: cancelled. An
    #: unledgered dispatch is queued until it runs, then active, retry, completed or failed.
    status: str
    #: Runs started so far (the ledger's attempt counter for a ledgered dispatch).
    attempts: int
    #: The payload as published; always None for a secret dispatch.
    payload: dict[str, Any] | None
    secret: bool
    #: The exception class name of the last failed attempt, or None.
    last_error: str | None
    #: False for a plain Celery message that has no ledger row.
    ledgered: bool

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def of(cls, detail: DispatchDetail) -> Dispatch:
        return cls(
            id=detail.dispatch_id,
            job_name=detail.job_name,
            key=detail.idempotency_key,
            singleton_key=detail.singleton_key,
            status=detail.status,
            attempts=detail.attempt,
            payload=None if detail.secret else detail.payload,
            secret=detail.secret,
            last_error=detail.last_error,
            ledgered=True,
        )
