"""The ledger's tables, and the vocabulary of a dispatch's life.

A ledgered dispatch is one row of `questpie_queue_dispatch`, keyed by its
dispatch id. Its `status` moves

    pending ──(broker accepted)──▶ queued ──(claim)──▶ active ──▶ completed
       │                           │   ▲                 │
       │                  (slot busy)  └─ parked         ├──▶ failed
       └─────────────(claim)───────┴────────────────────▶│
                                        retry ◀──────────┘ (claimed again)

Any row not yet started (pending, queued, parked, retry) can be `cancelled`: terminal,
like `completed` and `failed`. A cancel that finds the row `active` only marks it
(`cancel_requested_at`); the run goes on, and its end is written as `cancelled`.

`attempt` counts claims. A claim sets a random `claim_token` (the fencing
token) and a lease; only a statement that names the current token and finds the
row `active` can record an outcome, so a worker whose lease was taken over can
never overwrite its successor's result. The token stays on the row after the
holder records an outcome, so a holder whose connection died mid-write can read
back whether its write landed; recovering a lapsed lease clears it.

An ended row does not stay whole for ever: retention deletes an ended unkeyed row,
and prunes an ended keyed one to what answers its key (id, job, key, status, times),
dropping its payload and its options (`options` NULL). Nothing sends an ended row
again, so nothing needs them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    Dialect,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    and_,
)
from sqlalchemy.types import DateTime, TypeDecorator

from ..jobs.options import StoredOptions
from ..jobs.policies import QueuePolicy

SCHEMA_VERSION = 9

Status = Literal[
    "pending", "queued", "parked", "active", "retry", "completed", "failed", "cancelled"
]
#: States from which a delivery may take the execution claim.
CLAIMABLE: tuple[Status, ...] = ("pending", "queued", "retry")
TERMINAL: tuple[Status, ...] = ("completed", "failed", "cancelled")
#: States a cancel ends at once: accepted and not started (a retry waits for its start).
CANCELLABLE: tuple[Status, ...] = ("pending", "queued", "parked", "retry")
#: Accepted and waiting to run. A run awaiting its retry keeps the slot it held: running.
WAITING: tuple[Status, ...] = ("pending", "queued", "parked")
RUNNING: tuple[Status, ...] = ("active", "retry")
#: The states of a run that waits for its job's limits (`waiting_for` set): parked for a
#: seat, on its way to one, or set back for its rate window (as queued, or as a retry).
LIMIT_WAITING: tuple[Status, ...] = ("parked", "queued", "retry")
#: States the relay (re)sends once their next_send_at has passed.
RESENDABLE: tuple[Status, ...] = ("pending", "queued", "retry")

#: `last_error` of an attempt whose lease lapsed, and of a dispatch the relay gave up on.
LEASE_EXPIRED = "LeaseExpired"
RELAY_GAVE_UP = "RelayGaveUp"
#: `last_error` of a dispatch whose message a worker revoked, or dropped as expired,
#: before any run of that delivery began.
REVOKED = "Revoked"
EXPIRED = "Expired"


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every dialect (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class StoredOptionsType(TypeDecorator[StoredOptions]):
    """The `options` column: JSON in the database, `StoredOptions` in Python; None for a
    dispatch row retention pruned."""

    impl = JSON
    cache_ok = True

    def process_bind_param(
        self, value: StoredOptions | None, dialect: Dialect
    ) -> dict[str, Any] | None:
        return None if value is None else value.to_json()

    def process_result_value(self, value: Any, dialect: Dialect) -> StoredOptions | None:
        # SQL NULL is a pruned row's: not the defaults, which would misstate its options.
        return None if value is None else StoredOptions.from_json(value)


class PolicyType(TypeDecorator[QueuePolicy]):
    """A policy name in the database, a `QueuePolicy` in Python."""

    impl = String(16)
    cache_ok = True

    def process_bind_param(self, value: QueuePolicy | None, dialect: Dialect) -> str | None:
        return None if value is None else str(value)

    def process_result_value(self, value: str | None, dialect: Dialect) -> QueuePolicy | None:
        return QueuePolicy.parse(value)


metadata = MetaData()
"""The ledger schema, for a project's own Alembic migrations (`target_metadata`)."""

dispatch_table = Table(
    "questpie_queue_dispatch",
    metadata,
    # The id is derived from (job name, idempotency key) when there is a key, so
    # uniqueness of the id is uniqueness of the pair: no wide index on the key. A plain
    # Celery call taken into the ledger keeps its own task id, of any length (unbounded
    # since schema version 5; `ids.unstorable_id` says which ids fit at all).
    Column("id", Text, primary_key=True),
    Column("job_name", String(200), nullable=False),
    Column("idempotency_key", Text, nullable=True),
    Column("singleton_key", Text, nullable=True),
    # The group a run counts against for its job's concurrency and rate limits (NULL: the
    # job as a whole); added in schema version 6, as `seat` and `waiting_for`.
    Column("group_key", Text, nullable=True),
    Column("status", String(16), nullable=False),
    # The queue policy in force when the dispatch was accepted, and the slot it occupies
    # (its singleton key, or "" for the job as a whole); NULL for standard dispatches.
    Column("policy", PolicyType, nullable=True),
    Column("slot", Text, nullable=True),
    Column("payload", JSON, nullable=True),
    # Secret dispatches keep no payload: only its ciphertext and the wrapped data key,
    # both erased when the dispatch completes or fails for good.
    Column("secret", Boolean, nullable=False, default=False),
    Column("secret_ciphertext", LargeBinary, nullable=True),
    Column("secret_wrapped_key", LargeBinary, nullable=True),
    Column("secret_key_id", String(64), nullable=True),
    # What sending the message again needs: run options, priority, queue, Celery options.
    # NULL once retention pruned the ended row (nullable since schema version 4).
    Column("options", StoredOptionsType, nullable=True),
    Column("attempt", Integer, nullable=False, default=0),
    Column("claim_token", String(36), nullable=True),
    # How many claims the dispatch has had (schema version 8; NULL: none since then): the
    # handler's fencing token, which grows with every claim, also where `attempt` is
    # given back (a run cancelled or set back before its handler began).
    Column("claim_generation", Integer, nullable=True),
    # The concurrency seat a run of a limited job holds while it runs (0 to limit - 1).
    Column("seat", Integer, nullable=True),
    # Why a waiting run waits for its job's limits ("concurrency", "rate"): set when it is
    # parked for one, kept while it is on its way again, cleared by its claim.
    Column("waiting_for", String(16), nullable=True),
    Column("lease_expires_at", UTCDateTime, nullable=True),
    # When a cancel found the run active (schema version 7): it is not retried, its end
    # is written as `cancelled`, and its handler sees `ctx.cancel_requested`.
    Column("cancel_requested_at", UTCDateTime, nullable=True),
    # The burst a debounced dispatch gathers (schema version 7): its singleton key, or ""
    # for the job as a whole; cleared by its claim, so a new burst starts after it.
    Column("debounce_key", Text, nullable=True),
    # The chord or batch the dispatch is a member of (schema version 9): its end may be
    # the one that completes it (see `canvases.py`).
    Column("canvas_id", Text, nullable=True),
    # What a completed run returned, encoded by its serializer (schema version 9;
    # `canvas/results.py`): None when it returned nothing storable, or it was secret.
    Column("result", JSON, nullable=True),
    Column("run_after", UTCDateTime, nullable=False),
    # Relay sends of the current attempt, and when the relay may (re)send the row next
    # if nothing else moved it on: a publisher that died before sending, a lost message.
    Column("send_count", Integer, nullable=False, default=0),
    Column("next_send_at", UTCDateTime, nullable=True),
    Column("last_error", String(200), nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("queued_at", UTCDateTime, nullable=True),
    Column("started_at", UTCDateTime, nullable=True),
    Column("finished_at", UTCDateTime, nullable=True),
    Index("questpie_queue_dispatch_due", "status", "next_send_at"),
    # The operator's views: newest first, overall and per job.
    Index("questpie_queue_dispatch_created", "created_at", "id"),
    Index("questpie_queue_dispatch_job_created", "job_name", "created_at"),
)


def _slot_index(name: str, rule: str, statuses: tuple[Status, ...]) -> None:
    """A partial unique index: at most one row per (job, slot) in `statuses`, for the
    policies whose `rule` property holds."""
    t = dispatch_table.c
    policies = [str(policy) for policy in QueuePolicy if getattr(policy, rule)]
    where = and_(t.policy.in_(policies), t.status.in_(statuses))
    Index(name, t.job_name, t.slot, unique=True, postgresql_where=where, sqlite_where=where)


# The queue policies, enforced by the database: a publish or a claim that would break one
# fails its unique index, so concurrent publishers and workers can never both win a slot,
# and no lock exists that could outlive its holder.
_slot_index("questpie_slot_waiting", "one_waiting", WAITING)
_slot_index("questpie_slot_running", "one_running", RUNNING)
_slot_index("questpie_slot_exclusive", "one_overall", WAITING + RUNNING)


def _limit_indexes() -> None:
    """The concurrency limit, enforced by the database: a run holds one of its group's
    numbered seats while it runs, and a unique index allows each seat to one run, so of
    two workers that pick the same seat one fails and picks again. A run that ends leaves
    its seat by leaving the running states: no count to keep, nothing a dead worker holds
    past its lease. And the waiting runs of each group, found in order to send on."""
    t = dispatch_table.c
    # A run without a group key has "" written there as it takes a seat or starts to
    # wait (a plain column, not an expression: NULLs would never conflict).
    group = t.group_key
    seated = and_(t.seat.is_not(None), t.status.in_(RUNNING))
    Index(
        "questpie_limit_seat",
        t.job_name,
        group,
        t.seat,
        unique=True,
        postgresql_where=seated,
        sqlite_where=seated,
    )
    waiting = and_(t.waiting_for.is_not(None), t.status.in_(LIMIT_WAITING))
    Index(
        "questpie_limit_waiting",
        t.job_name,
        group,
        t.created_at,
        postgresql_where=waiting,
        sqlite_where=waiting,
    )


_limit_indexes()


def _debounce_index() -> None:
    """At most one open burst per (job, debounce key): a debounced publish updates the
    burst's waiting row (latest payload, later start) or, with none, inserts one; two
    publishers that both insert meet this index, and the loser updates instead."""
    t = dispatch_table.c
    open_burst = and_(t.debounce_key.is_not(None), t.status.in_(WAITING))
    Index(
        "questpie_debounce_burst",
        t.job_name,
        t.debounce_key,
        unique=True,
        postgresql_where=open_burst,
        sqlite_where=open_burst,
    )


_debounce_index()


def _retention_index() -> None:
    """Retention's scan: ended rows it has yet to delete or prune, oldest end first.

    Partial, so it costs a write only when a dispatch ends (a publish adds no entry, and
    `finished_at` is set by exactly the terminal writes), and a row leaves it once pruned
    (`options` NULL) or deleted: its size is what ended within the retention period, not
    the ledger's history. Added in schema version 4.
    """
    t = dispatch_table.c
    where = and_(t.finished_at.is_not(None), t.options.is_not(None))
    Index(
        "questpie_queue_dispatch_ended",
        t.finished_at,
        postgresql_where=where,
        sqlite_where=where,
    )


_retention_index()


def _canvas_index() -> None:
    """The members of a chord or batch that have yet to end: "has every member ended?",
    asked at each member's end, is one look here, not a scan of the members. A member
    leaves the index as it ends; rows of no canvas are never in it."""
    t = dispatch_table.c
    where = and_(t.canvas_id.is_not(None), t.status.in_(WAITING + RUNNING))
    Index(
        "questpie_queue_dispatch_canvas_open",
        t.canvas_id,
        postgresql_where=where,
        sqlite_where=where,
    )


_canvas_index()

CanvasKind = Literal["chord", "batch"]
CanvasStatus = Literal["open", "completed", "failed", "cancelled"]
OnMemberFailure = Literal["fail", "run"]

#: Chords and batches (schema version 9): what completes when every member has ended.
#: `members` holds the member dispatch ids in order (None where a queue policy refused
#: one); `callback` and `errbacks` the signatures to send, encoded by the app's
#: serializer. `status` leaves `open` exactly once, by a conditional update in the
#: transaction that inserts the callback's (or the errbacks') dispatch rows.
canvas_table = Table(
    "questpie_queue_canvas",
    metadata,
    Column("id", Text, primary_key=True),
    Column("kind", String(8), nullable=False),
    Column("status", String(16), nullable=False),
    Column("on_member_failure", String(8), nullable=False),
    Column("members", JSON, nullable=False),
    Column("callback", JSON, nullable=True),
    Column("errbacks", JSON, nullable=True),
    # The callback's dispatch id, fixed when the canvas is applied (Celery's frozen id).
    Column("callback_id", Text, nullable=True),
    # The member whose failure ended it (`failed`).
    Column("failed_member", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("finished_at", UTCDateTime, nullable=True),
    Index("questpie_queue_canvas_open", "status", "created_at"),
    Index("questpie_queue_canvas_callback", "callback_id"),
)

policy_table = Table(
    "questpie_queue_policy",
    metadata,
    Column("job_name", String(200), primary_key=True),
    Column("policy", PolicyType, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
)

#: The rate limit's permits: `count` numbered rows per (job, group), each holding when a
#: run last started on it. A start takes a permit whose last start is at least the
#: window ago, with a conditional update, so each permit starts at most one run per
#: window and no window ever holds more than `count` starts. Added in schema version 6.
rate_permit_table = Table(
    "questpie_rate_permit",
    metadata,
    Column("job_name", String(200), primary_key=True),
    Column("group_key", Text, primary_key=True),  # "" for the job as a whole
    Column("seat", Integer, primary_key=True),
    Column("started_at", UTCDateTime, nullable=False),
    # A start takes the group's longest-unused permit: found without sorting them all.
    Index("questpie_rate_permit_unused", "job_name", "group_key", "started_at"),
)

#: Throttle windows (schema version 7): per (job, throttle key), the dispatch the window
#: accepted and when the next may be accepted. A throttled publish takes the window with
#: a conditional upsert in the transaction that inserts its row, so of concurrent
#: publishers exactly one is accepted per window.
throttle_table = Table(
    "questpie_throttle",
    metadata,
    Column("job_name", String(200), primary_key=True),
    Column("throttle_key", Text, primary_key=True),  # "" for the job as a whole
    Column("dispatch_id", Text, nullable=False),
    Column("open_at", UTCDateTime, nullable=False),
    Index("questpie_throttle_open", "open_at"),
)

schema_version_table = Table(
    "questpie_schema_version",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("applied_at", UTCDateTime, nullable=False),
)

#: Facts about the ledger database itself; today its identity, a random id set by the
#: first migration, which tells a caller's database apart from the ledger's.
info_table = Table(
    "questpie_ledger_info",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)
LEDGER_ID_KEY = "ledger_id"
#: The newest end time (ISO 8601, UTC, the database's clock) before which retention or the
#: beat may have deleted ended rows: a message sent later cannot be one of theirs.
PRUNED_BEFORE_KEY = "pruned_before"

#: The relay's backlog over time, for the status page: how many dispatches were due for
#: the relay to send, sampled about twice a minute by whichever relay comes first, kept
#: for two hours. Added in schema version 3.
backlog_table = Table(
    "questpie_relay_backlog",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("sampled_at", UTCDateTime, nullable=False),
    Column("backlog", Integer, nullable=False),
    Index("questpie_relay_backlog_sampled", "sampled_at"),
)

#: Schedules: at most one per job and source, `call` for `schedule()` and `option` for
#: a job's `options={"cron": ...}`. `next_fire_at` is the tick a beat fires next; the
#: beat that fires a tick moves it on with a conditional update, so of several beats
#: exactly one does. Added in schema version 3.
schedule_table = Table(
    "questpie_schedule",
    metadata,
    Column("job_name", String(200), primary_key=True),
    Column("source", String(8), primary_key=True),
    Column("cron", String(200), nullable=False),
    Column("tz", String(64), nullable=False),
    Column("payload", JSON, nullable=False),
    Column("singleton_key", Text, nullable=True),
    Column("group_key", Text, nullable=True),  # added in version 6
    Column("options", StoredOptionsType, nullable=False),
    Column("next_fire_at", UTCDateTime, nullable=False),
    Column("last_fire_at", UTCDateTime, nullable=True),
    Column("last_dispatch_id", Text, nullable=True),  # unbounded since version 5, as `id`
    Column("updated_at", UTCDateTime, nullable=False),
    Index("questpie_schedule_due", "next_fire_at"),
)

#: The ticks of the app's own `beat_schedule` entries that some beat claimed: the first
#: beat to insert (entry, tick) sends it, every other beat skips it. Added in version 3.
beat_tick_table = Table(
    "questpie_beat_tick",
    metadata,
    Column("entry", String(200), primary_key=True),
    Column("tick", String(40), primary_key=True),
    # Who claimed it: a beat whose claim was retried after a dropped connection reads
    # this back to learn whether the first try was its own.
    Column("claimer", String(36), nullable=False),
    Column("claimed_at", UTCDateTime, nullable=False),
    Index("questpie_beat_tick_claimed", "claimed_at"),
)
