"""The dispatch ledger: its tables and every SQL statement this package runs.

This is the only module that talks SQL. It is written with SQLAlchemy Core and
runs on PostgreSQL (psycopg 3) and SQLite; dialect differences stay here.

A ledgered dispatch is one row of `questpie_queue_dispatch`, keyed by its
dispatch id. Its `status` moves

    pending ──(broker accepted)──▶ queued ──(claim)──▶ active ──▶ completed
       │                              ▲                  │
       └──────────(claim)─────────────┼──────────────────┤──▶ failed
                                      └──── retry ◀──────┘

`attempt` counts claims. A claim sets a random `claim_token` (the fencing token)
and a lease; only a statement that names the current token can record an outcome,
so a worker whose lease was taken over can never overwrite its successor's result.
"""

from __future__ import annotations

import logging
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    Connection,
    DateTime,
    Dialect,
    Engine,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    and_,
    bindparam,
    case,
    create_engine,
    event,
    exc,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import RowMapping, make_url
from sqlalchemy.sql import Executable
from sqlalchemy.types import TypeDecorator

from .errors import LedgerError, LedgerSchemaError, LedgerUnavailableError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DEFAULT_REDELIVER_AFTER_SECONDS = 3600.0
SQLITE_BUSY_TIMEOUT_MS = 15_000
PG_CONNECT_TIMEOUT_SECONDS = 5
PG_LOCK_TIMEOUT_MS = 5_000

Status = Literal["pending", "queued", "parked", "active", "retry", "completed", "failed"]
#: States from which a delivery may take the execution claim.
CLAIMABLE: tuple[Status, ...] = ("pending", "queued", "retry")
TERMINAL: tuple[Status, ...] = ("completed", "failed")
#: Accepted and waiting to run (a run awaiting its retry keeps the slot it held: active).
WAITING: tuple[Status, ...] = ("pending", "queued", "parked")
#: States the relay (re)sends once their next_send_at has passed.
RESENDABLE: tuple[Status, ...] = ("pending", "queued", "retry")
RUNNING: tuple[Status, ...] = ("active", "retry")


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


metadata = MetaData()
"""The ledger schema, for a project's own Alembic migrations (`target_metadata`)."""

dispatch_table = Table(
    "questpie_queue_dispatch",
    metadata,
    # The id is derived from (job name, idempotency key) when there is a key, so
    # uniqueness of the id is uniqueness of the pair: no wide index on the key.
    Column("id", String(36), primary_key=True),
    Column("job_name", String(200), nullable=False),
    Column("idempotency_key", Text, nullable=True),
    Column("singleton_key", Text, nullable=True),
    Column("status", String(16), nullable=False),
    # The queue policy in force when the dispatch was accepted, and the slot it occupies
    # (its singleton key, or "" for the job as a whole); NULL for standard dispatches.
    Column("policy", String(16), nullable=True),
    Column("slot", Text, nullable=True),
    Column("payload", JSON, nullable=True),
    # Secret dispatches keep no payload: only its ciphertext and the wrapped data key,
    # both erased when the dispatch completes or fails for good.
    Column("secret", Boolean, nullable=False, default=False),
    Column("secret_ciphertext", LargeBinary, nullable=True),
    Column("secret_wrapped_key", LargeBinary, nullable=True),
    Column("secret_key_id", String(64), nullable=True),
    # What the relay needs to send the message again: run options, priority, queue.
    Column("options", JSON, nullable=False),
    Column("attempt", Integer, nullable=False, default=0),
    Column("claim_token", String(36), nullable=True),
    Column("lease_expires_at", UTCDateTime, nullable=True),
    Column("run_after", UTCDateTime, nullable=False),
    # Relay sends so far, and when the relay may (re)send the row next if nothing else
    # moved it on: a publisher that died before sending, a lost message, a lost retry.
    Column("send_count", Integer, nullable=False, default=0),
    Column("next_send_at", UTCDateTime, nullable=True),
    Column("last_error", String(200), nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("queued_at", UTCDateTime, nullable=True),
    Column("started_at", UTCDateTime, nullable=True),
    Column("finished_at", UTCDateTime, nullable=True),
    Index("questpie_queue_dispatch_due", "status", "next_send_at"),
)


def _slot_index(name: str, policies: tuple[str, ...], statuses: tuple[Status, ...]) -> Index:
    """A partial unique index: at most one row per (job, slot) in these states."""
    t = dispatch_table.c
    where = and_(t.policy.in_(policies), t.status.in_(statuses))
    return Index(
        name,
        t.job_name,
        t.slot,
        unique=True,
        postgresql_where=where,
        sqlite_where=where,
    )


# The queue policies, enforced by the database (pg-boss's approach): a publish or a claim
# that would break one fails its unique index, so concurrent publishers and workers can
# never both win a slot, and no lock exists that could outlive its holder.
_slot_index("questpie_slot_waiting", ("short", "stately"), WAITING)
_slot_index("questpie_slot_running", ("singleton", "stately"), RUNNING)
_slot_index("questpie_slot_exclusive", ("exclusive",), WAITING + RUNNING)

policy_table = Table(
    "questpie_queue_policy",
    metadata,
    Column("job_name", String(200), primary_key=True),
    Column("policy", String(16), nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
)

schema_version_table = Table(
    "questpie_schema_version",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("applied_at", UTCDateTime, nullable=False),
)


def utcnow() -> datetime:
    return datetime.now(UTC)


# --- engines -------------------------------------------------------------------------------


#: Engines made by create_ledger_engine() that already run in autocommit.
_AUTOCOMMIT_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def create_ledger_engine(url: str) -> Engine:
    """Create an engine tuned for the ledger's access pattern on its dialect."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
        _configure_sqlite(engine)
        return engine
    connect_args: dict[str, Any] = {}
    if parsed.get_backend_name() == "postgresql":
        connect_args["connect_timeout"] = PG_CONNECT_TIMEOUT_SECONDS
        # A caller's long transaction that wrote a policy row holds its slot until it ends;
        # a publish meeting it waits this long at most, then fails with a LedgerError.
        connect_args["options"] = f"-c lock_timeout={PG_LOCK_TIMEOUT_MS}"
    # Autocommit: every ledger statement stands alone, so BEGIN/COMMIT round trips would
    # be pure cost. No pool_pre_ping either, for the same reason: a connection the server
    # dropped fails one statement with LedgerUnavailableError and is discarded.
    engine = create_engine(url, connect_args=connect_args, isolation_level="AUTOCOMMIT")
    _AUTOCOMMIT_ENGINES.add(engine)
    return engine


def _configure_sqlite(engine: Engine) -> None:
    # Several prefork children write the same file: WAL lets readers run beside the
    # writer, and BEGIN IMMEDIATE takes the write lock up front, so two writers queue on
    # the busy timeout instead of failing with "database is locked" on lock upgrade.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # let SQLAlchemy's BEGIN below rule
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        if connection.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            connection.exec_driver_sql("BEGIN IMMEDIATE")


# --- rows ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchRow:
    """One ledger row, as the rest of the package sees it."""

    id: str
    job_name: str
    idempotency_key: str | None
    singleton_key: str | None
    status: Status
    policy: str | None
    slot: str | None
    payload: dict[str, Any] | None
    secret: bool
    secret_ciphertext: bytes | None
    secret_wrapped_key: bytes | None
    secret_key_id: str | None
    options: dict[str, Any]
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

    @classmethod
    def from_mapping(cls, row: Mapping[Any, Any]) -> DispatchRow:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class NewDispatch:
    id: str
    job_name: str
    idempotency_key: str | None
    singleton_key: str | None
    payload: dict[str, Any] | None
    options: dict[str, Any]
    run_after: datetime
    policy: str | None = None
    slot: str | None = None
    next_send_at: datetime | None = None
    secret_ciphertext: bytes | None = None
    secret_wrapped_key: bytes | None = None
    secret_key_id: str | None = None


ClaimOutcome = Literal["claimed", "done", "stale", "busy", "blocked", "unknown"]


@dataclass(frozen=True)
class Claim:
    """The result of trying to take the execution claim of one delivery."""

    outcome: ClaimOutcome
    row: DispatchRow | None = None
    token: str | None = None


# --- the ledger ----------------------------------------------------------------------------


class _Statements:
    """Every statement, built once per dialect with bind parameters.

    Reusing one statement object lets SQLAlchemy skip construction and cache-key
    generation on each call, which is most of its per-statement cost.
    """

    def __init__(self, dialect: str) -> None:
        t = dispatch_table.c
        by_id = t.id == bindparam("dispatch_id")
        held = and_(by_id, t.claim_token == bindparam("token"), t.status == "active")
        claimable = or_(*(t.status == status for status in CLAIMABLE))
        # The VALUES clause comes from the parameters' keys at execution.
        self.insert = _insert_or_nothing(dialect, dispatch_table).returning(t.id)
        self.get = select(dispatch_table).where(by_id)
        self.exists = select(t.id).where(by_id)
        # A fast worker may already have claimed the row: keep its status then.
        self.mark_queued = (
            update(dispatch_table)
            .where(by_id)
            .values(
                queued_at=func.coalesce(t.queued_at, bindparam("now", type_=UTCDateTime)),
                status=case((t.status == "pending", "queued"), else_=t.status),
                # Only a row still waiting for its first claim gets a redelivery time: a
                # row that moved on already has the right one.
                next_send_at=case(
                    (t.status == "pending", bindparam("redeliver_at", type_=UTCDateTime)),
                    else_=t.next_send_at,
                ),
            )
        )
        self.claim = (
            update(dispatch_table)
            .where(by_id, claimable, t.attempt == bindparam("previous_attempt"))
            .values(
                status="active",
                attempt=t.attempt + 1,
                send_count=0,  # the relay's budget counts sends per attempt
                claim_token=bindparam("new_token"),
                lease_expires_at=bindparam("new_lease"),
                started_at=bindparam("now"),
            )
            .returning(*dispatch_table.c)
        )
        self.renew = (
            update(dispatch_table).where(held).values(lease_expires_at=bindparam("new_lease"))
        )
        # What ending a claim writes: for good, or until a retry.
        ended: dict[str, Any] = {
            "claim_token": None,
            "lease_expires_at": None,
            "last_error": bindparam("error"),
        }
        terminal = {
            **ended,
            "finished_at": bindparam("now"),
            # Key erasure is part of the terminal write, never a second step.
            "secret_ciphertext": None,
            "secret_wrapped_key": None,
        }
        retrying = {
            **ended,
            "status": "retry",
            "run_after": bindparam("new_run_after"),
            "next_send_at": bindparam("redeliver_at"),
        }
        self.finish = (
            update(dispatch_table).where(held).values(status=bindparam("new_status"), **terminal)
        )
        self.retry = update(dispatch_table).where(held).values(**retrying)
        self.park = (
            update(dispatch_table)
            .where(by_id, claimable, t.attempt == bindparam("previous_attempt"))
            .values(status="parked")
        )
        in_slot = and_(t.job_name == bindparam("job"), t.slot == bindparam("slot_key"))
        self.oldest_parked = (
            select(t.id).where(in_slot, t.status == "parked").order_by(t.created_at, t.id).limit(1)
        )
        self.unpark = (
            update(dispatch_table)
            .where(by_id, t.status == "parked")
            .values(status="queued", next_send_at=bindparam("redeliver_at"))
            .returning(*dispatch_table.c)
        )
        self.due = (
            select(dispatch_table)
            .where(t.status.in_(RESENDABLE), t.next_send_at <= bindparam("now"))
            .order_by(t.next_send_at)
            .limit(bindparam("limit"))
        )
        # Taking a row for a send is conditional on the exact next_send_at we read, so of
        # several relays exactly one sends it.
        seen = and_(
            by_id, t.status == bindparam("seen_status"), t.next_send_at == bindparam("seen_next")
        )
        self.take_for_send = (
            update(dispatch_table)
            .where(seen)
            .values(send_count=t.send_count + 1, next_send_at=bindparam("next"))
            .returning(*dispatch_table.c)
        )
        self.give_up = (
            update(dispatch_table)
            .where(seen)
            .values(status="failed", **{**terminal, "last_error": RELAY_GAVE_UP})
        )
        self.slot_running = (
            select(t.id).where(in_slot, t.status.in_(RUNNING), t.policy.is_not(None)).limit(1)
        )
        self.expired = (
            select(dispatch_table)
            .where(t.status == "active", t.lease_expires_at < bindparam("now"))
            .order_by(t.lease_expires_at)
            .limit(bindparam("limit"))
        )
        lapsed = and_(held, t.lease_expires_at < bindparam("now"))
        self.expire_retry = update(dispatch_table).where(lapsed).values(**retrying)
        self.expire_fail = update(dispatch_table).where(lapsed).values(status="failed", **terminal)
        running = dispatch_table.alias("running")
        self.free_parked_slots = (
            select(t.job_name, t.slot)
            .where(
                t.status == "parked",
                # A slot is free when nothing runs in it and no run is on its way to it
                # (an unparked or newly accepted run whose message is still in the broker).
                ~select(running.c.id)
                .where(
                    running.c.job_name == t.job_name,
                    running.c.slot == t.slot,
                    running.c.status.in_((*RUNNING, "pending", "queued")),
                )
                .exists(),
            )
            .distinct()
            .limit(bindparam("limit"))
        )
        p = policy_table.c
        self.get_policy = select(p.policy).where(p.job_name == bindparam("job"))
        self.record_policy = _insert_or_nothing(dialect, policy_table)


class Ledger:
    """Every statement against the ledger tables, addressed by what it does.

    Each operation outside `migrate` is a single statement, run in autocommit: one
    round trip, atomic on its own, and no transaction left open to hold row locks.
    """

    def __init__(
        self, engine: Engine, *, redeliver_after: float = DEFAULT_REDELIVER_AFTER_SECONDS
    ) -> None:
        self.engine = engine
        self.redeliver_after = timedelta(seconds=redeliver_after)
        self._autocommit: Engine
        self._transactional: Engine
        if engine in _AUTOCOMMIT_ENGINES:
            self._autocommit = engine
            self._transactional = engine.execution_options(isolation_level="READ COMMITTED")
        else:
            self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
            self._transactional = engine
        self._sql = _Statements(engine.dialect.name)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def _first(
        self, stmt: Executable, params: dict[str, Any], *, conflict_ok: bool = False
    ) -> RowMapping | None:
        with translate_errors(), self._autocommit.connect() as conn:
            try:
                return conn.execute(stmt, params).mappings().first()
            except exc.IntegrityError:
                # Only the queue-policy slot indexes can refuse these statements.
                if conflict_ok:
                    raise _SlotTaken() from None
                raise

    def _all(self, stmt: Executable, params: dict[str, Any]) -> list[RowMapping]:
        with translate_errors(), self._autocommit.connect() as conn:
            return list(conn.execute(stmt, params).mappings())

    def _count(self, stmt: Executable, params: dict[str, Any]) -> int:
        with translate_errors(), self._autocommit.connect() as conn:
            return conn.execute(stmt, params).rowcount

    # schema

    def migrate(self) -> int:
        """Create or upgrade the schema; safe to run again. Returns the schema version."""
        with translate_errors(), self._transactional.begin() as conn:
            metadata.create_all(conn, checkfirst=True)
            current = conn.execute(
                select(schema_version_table.c.version).order_by(
                    schema_version_table.c.version.desc()
                )
            ).scalar()
            if current is None or current < SCHEMA_VERSION:
                conn.execute(
                    _insert_or_nothing(self.dialect, schema_version_table).values(
                        version=SCHEMA_VERSION, applied_at=utcnow()
                    )
                )
        return SCHEMA_VERSION

    def schema_version(self) -> int | None:
        with translate_errors(), self.engine.connect() as conn:
            return conn.execute(select(func.max(schema_version_table.c.version))).scalar()

    # publish side

    def insert_dispatch(self, new: NewDispatch, conn: Connection | None = None) -> bool:
        """Insert the row unless its id exists. True when this call inserted it.

        One statement, so concurrent publishers of one key race inside the database:
        exactly one of them gets True. With `conn`, it runs in the caller's transaction.
        """
        params = {
            "id": new.id,
            "job_name": new.job_name,
            "idempotency_key": new.idempotency_key,
            "singleton_key": new.singleton_key,
            "status": "pending",
            "payload": new.payload,
            "options": new.options,
            "attempt": 0,
            "run_after": new.run_after,
            "send_count": 0,
            "next_send_at": new.next_send_at,
            "created_at": utcnow(),
            "policy": new.policy,
            "slot": new.slot,
            "secret": new.secret_ciphertext is not None,
            "secret_ciphertext": new.secret_ciphertext,
            "secret_wrapped_key": new.secret_wrapped_key,
            "secret_key_id": new.secret_key_id,
        }
        if conn is not None:
            stmt = self._sql.insert
            if conn.dialect.name != self.dialect:
                stmt = _Statements(conn.dialect.name).insert
            with translate_errors():
                return conn.execute(stmt, params).first() is not None
        return self._first(self._sql.insert, params) is not None

    def mark_queued(self, accepted: Sequence[tuple[str, datetime]]) -> None:
        """Record that the broker accepted these dispatches (id, when), in one batch."""
        if not accepted:
            return
        params = [
            {"dispatch_id": dispatch_id, "now": when, "redeliver_at": when + self.redeliver_after}
            for dispatch_id, when in accepted
        ]
        with translate_errors(), self._autocommit.connect() as conn:
            conn.execute(self._sql.mark_queued, params)

    def exists(self, dispatch_id: str, conn: Connection | None = None) -> bool:
        """Whether the row exists (with `conn`: as the caller's transaction sees it)."""
        params = {"dispatch_id": dispatch_id}
        if conn is not None:
            with translate_errors():
                return conn.execute(self._sql.exists, params).first() is not None
        return self._first(self._sql.exists, params) is not None

    def get(self, dispatch_id: str) -> DispatchRow | None:
        row = self._first(self._sql.get, {"dispatch_id": dispatch_id})
        return DispatchRow.from_mapping(row) if row else None

    # worker side

    def claim(self, dispatch_id: str, attempt: int, lease_seconds: float) -> Claim:
        """Take the execution claim for delivery `attempt` of a dispatch, atomically.

        Succeeds only when the row is claimable and has made exactly `attempt - 1`
        claims, so a delivery of an attempt the row has moved past is `stale`, one of
        a finished dispatch is `done`, and one that meets a live claim is `busy`.
        """
        token = str(uuid.uuid4())
        now = utcnow()
        try:
            row = self._first(
                self._sql.claim,
                {
                    "dispatch_id": dispatch_id,
                    "previous_attempt": attempt - 1,
                    "new_token": token,
                    "new_lease": now + timedelta(seconds=lease_seconds),
                    "now": now,
                },
                conflict_ok=True,
            )
        except _SlotTaken:
            return Claim("blocked")
        if row is not None:
            return Claim("claimed", DispatchRow.from_mapping(row), token)
        # Not claimed: read the row only to say why (the answer may be a moment old).
        found = self.get(dispatch_id)
        if found is None:
            return Claim("unknown")
        if found.status in TERMINAL:
            return Claim("done", found)
        if found.status == "active" and found.attempt == attempt:
            return Claim("busy", found)
        return Claim("stale", found)

    def renew(self, dispatch_id: str, token: str, lease_seconds: float) -> bool:
        """Extend a live claim; False when the claim is no longer ours."""
        expires = utcnow() + timedelta(seconds=lease_seconds)
        params = {"dispatch_id": dispatch_id, "token": token, "new_lease": expires}
        return self._count(self._sql.renew, params) == 1

    def complete(self, dispatch_id: str, token: str) -> bool:
        """Record completion; only the claim holder can. False when the claim was lost."""
        return self._finish(dispatch_id, token, status="completed", error=None)

    def fail(self, dispatch_id: str, token: str, error: str) -> bool:
        """Record failure for good; only the claim holder can."""
        return self._finish(dispatch_id, token, status="failed", error=error)

    def _finish(self, dispatch_id: str, token: str, *, status: Status, error: str | None) -> bool:
        params = {
            "dispatch_id": dispatch_id,
            "token": token,
            "new_status": status,
            "now": utcnow(),
            "error": error,
        }
        return self._count(self._sql.finish, params) == 1

    def schedule_retry(
        self, dispatch_id: str, token: str, delay: float, error: str, *, relay_at: datetime | None
    ) -> bool:
        """Release the claim after a failed attempt and make the row due again later.

        `relay_at` is when the relay should send the retry; None when the caller sends
        it now (the relay then only steps in if that message is lost).
        """
        run_after = utcnow() + timedelta(seconds=delay)
        params = {
            "dispatch_id": dispatch_id,
            "token": token,
            "new_run_after": run_after,
            "redeliver_at": relay_at or run_after + self.redeliver_after,
            "error": error,
        }
        return self._count(self._sql.retry, params) == 1

    # queue policies

    def park(self, dispatch_id: str, attempt: int) -> bool:
        """Set a delivered run aside until its slot frees; not an attempt."""
        params = {"dispatch_id": dispatch_id, "previous_attempt": attempt - 1}
        return self._count(self._sql.park, params) == 1

    def slot_running(self, job_name: str, slot: str) -> bool:
        """Whether a run holds the running slot (active, or awaiting its retry)."""
        return self._first(self._sql.slot_running, {"job": job_name, "slot_key": slot}) is not None

    def unpark_next(self, job_name: str, slot: str) -> DispatchRow | None:
        """Move the oldest parked run of a slot back to `queued`; the caller sends it.

        A conditional update, so of several processes handing the same slot on, one
        wins each parked row and exactly one message is sent for it.
        """
        for _ in range(5):
            oldest = self._first(self._sql.oldest_parked, {"job": job_name, "slot_key": slot})
            if oldest is None:
                return None
            params = {"dispatch_id": oldest["id"], "redeliver_at": utcnow() + self.redeliver_after}
            row = self._first(self._sql.unpark, params)
            if row is not None:
                return DispatchRow.from_mapping(row)
        return None

    def free_parked_slots(self, limit: int = 100) -> list[tuple[str, str]]:
        """(job, slot) pairs holding parked runs while nothing runs in the slot."""
        rows = self._all(self._sql.free_parked_slots, {"limit": limit})
        return [(r["job_name"], r["slot"]) for r in rows]

    def expired_claims(self, limit: int = 100) -> list[DispatchRow]:
        """Active rows whose lease has lapsed: their holder died or overran."""
        rows = self._all(self._sql.expired, {"now": utcnow(), "limit": limit})
        return [DispatchRow.from_mapping(r) for r in rows]

    def expire_claim(
        self, row: DispatchRow, *, retry_in: float | None, relay_at: datetime | None = None
    ) -> bool:
        """End a lapsed claim as a failed attempt: retry after `retry_in` s, or fail.

        `relay_at` is when the relay should send the retry (None: the caller sends it now).
        """
        now = utcnow()
        params: dict[str, Any] = {
            "dispatch_id": row.id,
            "token": row.claim_token,
            "now": now,
            "error": LEASE_EXPIRED,
        }
        if retry_in is None:
            return self._count(self._sql.expire_fail, params) == 1
        params["new_run_after"] = now + timedelta(seconds=retry_in)
        params["redeliver_at"] = relay_at or params["new_run_after"] + self.redeliver_after
        return self._count(self._sql.expire_retry, params) == 1

    def get_policy(self, job_name: str) -> str | None:
        row = self._first(self._sql.get_policy, {"job": job_name})
        return None if row is None else str(row["policy"])

    def record_policy(self, job_name: str, policy: str) -> str:
        """Record a job's policy unless one is recorded; return the one in force."""
        self._count(
            self._sql.record_policy,
            {"job_name": job_name, "policy": policy, "updated_at": utcnow()},
        )
        return self.get_policy(job_name) or policy

    def set_policy(self, job_name: str, policy: str) -> None:
        """Change a job's recorded policy on purpose (new dispatches follow it)."""
        dialect = postgresql if self.dialect == "postgresql" else sqlite
        stmt = dialect.insert(policy_table).values(
            job_name=job_name, policy=policy, updated_at=utcnow()
        )
        self._count(
            stmt.on_conflict_do_update(
                index_elements=[policy_table.c.job_name],
                set_={"policy": stmt.excluded.policy, "updated_at": stmt.excluded.updated_at},
            ),
            {},
        )

    # the relay's sends

    def due_for_send(self, limit: int = 100) -> list[DispatchRow]:
        rows = self._all(self._sql.due, {"now": utcnow(), "limit": limit})
        return [DispatchRow.from_mapping(r) for r in rows]

    def take_for_send(self, row: DispatchRow, next_send_at: datetime) -> DispatchRow | None:
        """Count one relay send of `row` and set when the next may be; None if we lost."""
        taken = self._first(
            self._sql.take_for_send,
            {
                "dispatch_id": row.id,
                "seen_status": row.status,
                "seen_next": row.next_send_at,
                "next": next_send_at,
            },
        )
        return DispatchRow.from_mapping(taken) if taken else None

    def give_up(self, row: DispatchRow) -> bool:
        """Record `failed` (erasing a secret's key) after the relay ran out of sends."""
        params = {
            "dispatch_id": row.id,
            "seen_status": row.status,
            "seen_next": row.next_send_at,
            "now": utcnow(),
        }
        return self._count(self._sql.give_up, params) == 1


class _SlotTaken(Exception):
    """A statement met a queue-policy slot index."""


LEASE_EXPIRED = "LeaseExpired"
RELAY_GAVE_UP = "RelayGaveUp"


def _insert_or_nothing(dialect: str, table: Table) -> Any:
    if dialect == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing()
    if dialect == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing()
    raise LedgerError(f"the ledger supports PostgreSQL and SQLite, not {dialect!r}")


_PG_LOCK_NOT_AVAILABLE = "55P03"
_PG_UNDEFINED_TABLE = "42P01"


@contextmanager
def translate_errors() -> Iterator[None]:
    """Turn SQLAlchemy's errors into the package's own, once, at the boundary."""
    try:
        yield
    except exc.DBAPIError as error:
        sqlstate = getattr(error.orig, "sqlstate", None)
        if sqlstate == _PG_UNDEFINED_TABLE or "no such table" in str(error.orig):
            raise LedgerSchemaError() from error
        if sqlstate == _PG_LOCK_NOT_AVAILABLE:
            raise LedgerError(
                "a ledger row is held by another open transaction (lock_timeout reached); "
                "try again once it ends"
            ) from error
        if error.connection_invalidated or isinstance(
            error, exc.OperationalError | exc.InterfaceError
        ):
            raise LedgerUnavailableError(
                f"the dispatch ledger database cannot be reached: {type(error.orig).__name__}"
            ) from error
        raise LedgerError(f"ledger statement failed: {type(error.orig).__name__}") from error
    except exc.SQLAlchemyError as error:
        raise LedgerError(f"ledger statement failed: {type(error).__name__}") from error
