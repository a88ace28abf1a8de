"""Chords and batches: the canvas row, its members, and the one write that ends it.

A canvas (a chord, or a batch published with `on_complete`) is one row of
`questpie_queue_canvas`, written in the transaction that inserts its members' dispatch
rows, each of which names it (`canvas_id`). Whoever records a member's end asks whether
any member is still to end (one look in a partial index of the open members), and the
one that finds none ends the canvas: a conditional update from `open`, in the
transaction that inserts the callback's dispatch row. Of two that ask at once both may
find none, and exactly one update matches; a process that dies between a member's end
and that transaction leaves the canvas open for the relay's sweep (`open_canvases`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Delete,
    Insert,
    Select,
    Update,
    bindparam,
    delete,
    func,
    select,
    tuple_,
    update,
)
from sqlalchemy.orm import Session

from ..jobs.ids import unstorable_id
from .errors import translate_errors
from .executor import Part
from .schema import (
    RUNNING,
    WAITING,
    CanvasKind,
    CanvasStatus,
    OnMemberFailure,
    UTCDateTime,
    canvas_table,
    dispatch_table,
)
from .statements import db_time, insert_or_nothing, seconds

#: Before any canvas: where a sweep starts.
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Members read per statement (an `IN` list of ids).
MEMBERS_PER_READ = 1000


@dataclass(frozen=True)
class NewCanvas:
    """A canvas to record with its members."""

    id: str
    kind: CanvasKind
    members: list[str | None]
    on_member_failure: OnMemberFailure = "fail"
    callback: dict[str, Any] | None = None
    errbacks: list[dict[str, Any]] | None = None
    callback_id: str | None = None


@dataclass(frozen=True)
class CanvasRow:
    id: str
    kind: CanvasKind
    status: CanvasStatus
    on_member_failure: OnMemberFailure
    members: list[str | None]
    callback: dict[str, Any] | None
    errbacks: list[dict[str, Any]] | None
    callback_id: str | None
    failed_member: str | None
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class MemberState:
    """What the operator sees of one member (or a callback's dispatch): never its result."""

    id: str
    job_name: str
    status: str
    last_error: str | None


@dataclass(frozen=True)
class CanvasState:
    status: CanvasStatus
    kind: CanvasKind
    on_member_failure: OnMemberFailure


@dataclass(frozen=True)
class MemberEnd:
    """What a chord's callback, or a batch's summary, needs of one member."""

    id: str
    status: str
    result: Any
    last_error: str | None


class CanvasStatements:
    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        c = canvas_table.c
        t = dispatch_table.c
        # An id applied twice (a frozen chord applied again) inserts nothing.
        self.insert: Insert = insert_or_nothing(dialect, canvas_table).values(
            status="open", created_at=db_time(), finished_at=None, failed_member=None
        )
        self.get: Select[Any] = select(canvas_table).where(c.id == bindparam("canvas_id"))
        self.by_callback: Select[Any] = select(canvas_table).where(
            c.callback_id == bindparam("callback_id")
        )
        # One look in the partial index of members that have yet to end.
        self.open_member: Select[Any] = (
            select(t.id)
            .where(t.canvas_id == bindparam("canvas_id"), t.status.in_(WAITING + RUNNING))
            .limit(1)
        )
        self.members: Select[Any] = select(t.id, t.status, t.result, t.last_error).where(
            t.id.in_(bindparam("dispatch_ids", expanding=True))
        )
        self.close: Update = (
            update(canvas_table)
            .where(c.id == bindparam("canvas_id"), c.status == "open")
            .values(
                status=bindparam("status"),
                failed_member=bindparam("failed_member"),
                finished_at=db_time(),
            )
            .returning(c.id)
        )
        # Open canvases the sweep looks at: opened a while ago, oldest first.
        # Open canvases the sweep looks at: opened a while ago, and no member that names
        # them is still to end (one look each in the open members' index), oldest first.
        # A canvas that waits for its members is never among them, however many wait.
        member_open = (
            select(t.id).where(t.canvas_id == c.id, t.status.in_(WAITING + RUNNING)).exists()
        )
        # Keyset order: a sweep goes on after the last canvas the previous one looked at,
        # so canvases that wait on a member of no chord (a key seen before) cannot keep
        # it from the ones behind them.
        self.open_canvases: Select[Any] = (
            select(c.id, c.created_at)
            .where(
                c.status == "open",
                c.created_at < db_time(-seconds("older_than")),
                tuple_(c.created_at, c.id)
                > tuple_(bindparam("after_at", type_=UTCDateTime), bindparam("after_id")),
                ~member_open,
            )
            .order_by(c.created_at, c.id)
            .limit(bindparam("limit"))
        )
        # What a member's end needs to know of its canvas, without its members' ids.
        self.state: Select[Any] = select(c.status, c.kind, c.on_member_failure).where(
            c.id == bindparam("canvas_id")
        )
        # Retention: chords and batches that ended long ago, oldest first.
        self.prune_ended: Delete = delete(canvas_table).where(
            c.id.in_(
                select(c.id)
                .where(c.status != "open", c.finished_at < db_time(-seconds("older_than")))
                .order_by(c.finished_at)
                .limit(bindparam("limit"))
                .scalar_subquery()
            )
        )
        self.listed: Select[Any] = (
            select(canvas_table).order_by(c.created_at.desc()).limit(bindparam("limit"))
        )
        # The operator's reads: members counted by status, and members without results.
        self.member_counts: Select[Any] = (
            select(t.status, func.count().label("count"))
            .where(t.id.in_(bindparam("dispatch_ids", expanding=True)))
            .group_by(t.status)
        )
        self.member_states: Select[Any] = select(t.id, t.job_name, t.status, t.last_error).where(
            t.id.in_(bindparam("dispatch_ids", expanding=True))
        )


def filtered_query(*, status: str | None, kind: str | None, limit: int) -> Select[Any]:
    """The newest canvases, of one status and kind if given (built per call, like the
    operator's other filtered lists)."""
    c = canvas_table.c
    stmt = select(canvas_table)
    if status is not None:
        stmt = stmt.where(c.status == status)
    if kind is not None:
        stmt = stmt.where(c.kind == kind)
    return stmt.order_by(c.created_at.desc(), c.id.desc()).limit(limit)


class Canvases(Part):
    """Recording chords and batches, and ending each exactly once."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = CanvasStatements(dialect, preamble)

    def session(self) -> Session:
        """A Session on the ledger's database, in which a canvas and its members are
        written in one transaction (its commit sends the members, as any publish in a
        session)."""
        return Session(bind=self._db._transactional)

    def record(self, canvas: NewCanvas, conn: Connection) -> bool:
        """Insert the canvas row in the transaction that inserts its members; False when
        a canvas of its id exists (nothing is inserted)."""
        params = {
            "id": canvas.id,
            "kind": canvas.kind,
            "on_member_failure": canvas.on_member_failure,
            "members": canvas.members,
            "callback": canvas.callback,
            "errbacks": canvas.errbacks,
            "callback_id": canvas.callback_id,
        }
        with translate_errors(self._db.migrate_command):
            return bool(conn.execute(self._sql.insert, params).rowcount)

    def state(self, canvas_id: str) -> CanvasState | None:
        """A canvas's status and policy, read without its members' ids (a chord of
        10,000 members holds 10,000 of them)."""
        row = self._db._first(self._sql.state, {"canvas_id": canvas_id})
        if row is None:
            return None
        return CanvasState(row["status"], row["kind"], row["on_member_failure"])

    def get(self, canvas_id: object) -> CanvasRow | None:
        if not isinstance(canvas_id, str) or unstorable_id(canvas_id) is not None:
            return None
        return _canvas(self._db._first(self._sql.get, {"canvas_id": canvas_id}))

    def by_callback(self, callback_id: object) -> CanvasRow | None:
        """The canvas whose callback's dispatch id this is (before the callback exists)."""
        if not isinstance(callback_id, str) or unstorable_id(callback_id) is not None:
            return None
        return _canvas(self._db._first(self._sql.by_callback, {"callback_id": callback_id}))

    def has_open_member(self, canvas_id: str) -> bool:
        """Whether a member that names this canvas has yet to end."""
        return bool(self._db._execute(self._sql.open_member, {"canvas_id": canvas_id}))

    def member_ends(self, member_ids: Sequence[str | None]) -> dict[str, MemberEnd]:
        """The members' statuses and results, by id (a member retention removed, or one
        never inserted, is absent)."""
        ids = [member for member in member_ids if member is not None]
        found: dict[str, MemberEnd] = {}
        for start in range(0, len(ids), MEMBERS_PER_READ):
            chunk = ids[start : start + MEMBERS_PER_READ]
            for row in self._db._execute(self._sql.members, {"dispatch_ids": chunk}):
                found[row["id"]] = MemberEnd(
                    row["id"], row["status"], row["result"], row["last_error"]
                )
        return found

    @contextmanager
    def closing(
        self, canvas_id: str, status: CanvasStatus, failed_member: str | None = None
    ) -> Iterator[Session | None]:
        """End an open canvas as `status`: yields the transaction's session when this
        caller ended it (what follows from the end, its callback's rows, is published in
        it, commits with it and is sent once it commits), None when it had ended."""
        params = {"canvas_id": canvas_id, "status": status, "failed_member": failed_member}
        with (
            translate_errors(self._db.migrate_command),
            self.session() as session,
            session.begin(),
        ):
            won = session.execute(self._sql.close, params).first() is not None
            yield session if won else None

    def open_canvases(
        self,
        *,
        older_than: float,
        after: tuple[datetime, str] | None = None,
        limit: int = 100,
    ) -> list[tuple[datetime, str]]:
        """Canvases still open `older_than` seconds after they were recorded whose
        members that name them have all ended (a look whose process died is owed), as
        (created_at, id) in that order, after `after`."""
        after_at, after_id = after or (_EPOCH, "")
        params = {
            "older_than": older_than,
            "limit": limit,
            "after_at": after_at,
            "after_id": after_id,
        }
        rows = self._db._execute(self._sql.open_canvases, params)
        return [(row["created_at"], row["id"]) for row in rows]

    def prune_ended(self, *, older_than: float, limit: int) -> int:
        """Delete up to `limit` canvases that ended over `older_than` seconds ago (their
        members are retention's as any dispatch is); how many."""
        params = {"older_than": older_than, "limit": limit}
        return int(self._db._execute(self._sql.prune_ended, params))

    def listed(self, limit: int = 50) -> list[CanvasRow]:
        """The newest canvases, for the operator's views."""
        rows = self._db._execute(self._sql.listed, {"limit": limit})
        return [canvas for row in rows if (canvas := _canvas(row)) is not None]

    def filtered(
        self, *, status: str | None = None, kind: str | None = None, limit: int = 50
    ) -> list[CanvasRow]:
        """The newest canvases, of one status and kind if given, for the operator."""
        rows = self._db._execute(filtered_query(status=status, kind=kind, limit=limit), {})
        return [canvas for row in rows if (canvas := _canvas(row)) is not None]

    def member_counts(self, member_ids: Sequence[str | None]) -> dict[str, int]:
        """How many of these dispatches are in each status (one grouped count per
        `MEMBERS_PER_READ` ids; a member retention removed, or one never inserted, is
        not counted)."""
        ids = [member for member in member_ids if member is not None]
        counts: dict[str, int] = {}
        for start in range(0, len(ids), MEMBERS_PER_READ):
            chunk = ids[start : start + MEMBERS_PER_READ]
            for row in self._db._execute(self._sql.member_counts, {"dispatch_ids": chunk}):
                counts[row["status"]] = counts.get(row["status"], 0) + int(row["count"])
        return counts

    def member_states(self, member_ids: Sequence[str | None]) -> dict[str, MemberState]:
        """These dispatches' jobs, statuses and error classes, by id, without their
        payloads or results (an absent id has no row)."""
        ids = [member for member in member_ids if member is not None]
        found: dict[str, MemberState] = {}
        for start in range(0, len(ids), MEMBERS_PER_READ):
            chunk = ids[start : start + MEMBERS_PER_READ]
            for row in self._db._execute(self._sql.member_states, {"dispatch_ids": chunk}):
                found[row["id"]] = MemberState(
                    row["id"], row["job_name"], row["status"], row["last_error"]
                )
        return found


def _canvas(row: Any) -> CanvasRow | None:
    if row is None:
        return None
    return CanvasRow(**{name: row[name] for name in CanvasRow.__dataclass_fields__})
