"""The ledger's rows as the rest of the package sees them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from ..jobs.options import StoredOptions
from ..jobs.policies import QueuePolicy
from .schema import Status


@dataclass(frozen=True)
class DispatchRow:
    """One ledger row.

    `pruned`: retention dropped the payload and options of this ended keyed dispatch.
    Its `payload` is then None and its `options` are the defaults, standing in for what
    is gone; only an ended row is ever pruned, and nothing sends an ended row again.
    """

    id: str
    job_name: str
    idempotency_key: str | None
    singleton_key: str | None
    status: Status
    policy: QueuePolicy | None
    slot: str | None
    payload: dict[str, Any] | None
    secret: bool
    secret_ciphertext: bytes | None
    secret_wrapped_key: bytes | None
    secret_key_id: str | None
    options: StoredOptions
    attempt: int
    claim_token: str | None
    lease_expires_at: datetime | None
    run_after: datetime
    send_count: int
    next_send_at: datetime | None
    created_at: datetime
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    last_error: str | None
    group_key: str | None = None
    #: The concurrency seat it holds while it runs (a limited job's run only).
    seat: int | None = None
    #: Why it waits for its job's limits: "concurrency" or "rate"; None otherwise.
    waiting_for: str | None = None
    #: When a cancel found it running (it ends as `cancelled`, and is not retried).
    cancel_requested_at: datetime | None = None
    #: The burst it gathers while it waits to start, for a debounced dispatch.
    debounce_key: str | None = None
    #: How many claims it has had: its latest claim's fencing token.
    claim_generation: int | None = None
    #: The chord or batch it is a member of.
    canvas_id: str | None = None
    #: What its completed run returned, encoded (`canvas/results.py`).
    result: Any = None
    pruned: bool = False

    @classmethod
    def from_mapping(cls, row: Mapping[Any, Any]) -> DispatchRow:
        values = {name: row[name] for name in cls.__dataclass_fields__ if name != "pruned"}
        # "" is how the limit indexes spell no group (see `statements.group_written`).
        values["group_key"] = values["group_key"] or None
        if values["options"] is None:
            return cls(**{**values, "options": StoredOptions()}, pruned=True)
        return cls(**values)

    @property
    def limited_slot(self) -> tuple[str, str] | None:
        """(job, slot) when the row's policy limits runs: it may park, and hands on."""
        if self.policy is not None and self.policy.limits_runs and self.slot is not None:
            return self.job_name, self.slot
        return None


@dataclass(frozen=True)
class NewDispatch:
    """A row to insert. Times left None are the database's now (plus `send_in`)."""

    id: str
    job_name: str
    payload: dict[str, Any] | None
    options: StoredOptions
    idempotency_key: str | None = None
    singleton_key: str | None = None
    group_key: str | None = None
    policy: QueuePolicy | None = None
    #: "queued" for a delivery the worker takes into the ledger: the broker already has it.
    status: Literal["pending", "queued"] = "pending"
    #: Claims already made: 0 for a new dispatch; more for a row written again from the
    #: delivery of a later attempt.
    attempt: int = 0
    run_after: datetime | None = None
    #: When the relay first looks at the row: this time, or `send_in` seconds from now.
    next_send_at: datetime | None = None
    send_in: float = 0.0
    secret_ciphertext: bytes | None = None
    secret_wrapped_key: bytes | None = None
    secret_key_id: str | None = None
    #: The chord or batch it is a member of.
    canvas_id: str | None = None

    @property
    def slot(self) -> str | None:
        """The policy slot: the singleton key, or "" for the job as a whole."""
        if self.policy is None or not self.policy.ledgered:
            return None
        return self.singleton_key or ""


ClaimOutcome = Literal["claimed", "done", "stale", "busy", "blocked", "unknown", "early"]
#: What a `blocked` claim waits for: its policy slot, or a seat of its job's concurrency
#: limit (the rate limit turns a run away after its claim: `Limits.wait_for_rate`).
BlockedBy = Literal["slot", "concurrency"]


@dataclass(frozen=True)
class Claim:
    """The result of trying to take the execution claim of one delivery.

    `unknown` covers a row that does not exist and one that belongs to another job;
    `early` a delivery for the attempt the row waits for, before its `run_after`.
    """

    outcome: ClaimOutcome
    row: DispatchRow | None = None
    token: str | None = None
    #: For `early`: seconds until the row is due, on the database's clock.
    due_in: float = 0.0
    #: For `blocked`: what it waits for.
    blocked_by: BlockedBy = "slot"
    #: Whether the completion the claim carried landed (None: it carried none).
    carried: bool | None = None


@dataclass(frozen=True)
class ScheduleRow:
    """One schedule: a job's cron, its payload and options, and its next tick."""

    job_name: str
    source: Literal["call", "option"]  # schedule(), or the job's options={"cron": ...}
    cron: str
    tz: str
    payload: dict[str, Any]
    singleton_key: str | None
    options: StoredOptions
    next_fire_at: datetime
    last_fire_at: datetime | None = None
    last_dispatch_id: str | None = None
    group_key: str | None = None

    @classmethod
    def from_mapping(cls, row: Mapping[Any, Any]) -> ScheduleRow:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})
