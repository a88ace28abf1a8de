"""Ledger rows written in the caller's own transaction (`publish(session=...)`).

Two things only the caller's transaction can tell us live here: whether the
caller's database is the ledger's at all, and when that transaction really
committed, so the rows written in it can be sent.

SQLAlchemy fires a Session's `after_commit` when a savepoint is released too,
although nothing is committed then; only the commit of the outermost
transaction sends. A row whose savepoint rolled back is gone by then, so the
ids are re-read before anything is sent.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session, SessionTransaction

from ..errors import LedgerSchemaError, PublishOptionsError
from .store import Ledger

_PENDING = "questpie_pending_dispatches"
_LISTENING = "questpie_listening"

#: Per caller engine: does its database hold this ledger? (engine -> ledger id -> answer)
_SAME_DATABASE: weakref.WeakKeyDictionary[Engine, dict[str, bool]] = weakref.WeakKeyDictionary()


def caller_connection(ledger: Ledger, session: object, connection: object) -> Connection | None:
    """The connection of the caller's transaction, checked to reach the ledger's
    database; None when the publish is not transactional."""
    if session is not None and connection is not None:
        raise PublishOptionsError("pass session or connection, not both")
    if session is not None:
        if not isinstance(session, Session):
            raise PublishOptionsError("session must be a sqlalchemy.orm.Session")
        conn, kind = session.connection(), "session"
    elif connection is not None:
        if not isinstance(connection, Connection):
            raise PublishOptionsError("connection must be a sqlalchemy.Connection")
        conn, kind = connection, "connection"
    else:
        return None
    check_same_database(ledger, conn, kind)
    return conn


def check_same_database(ledger: Ledger, conn: Connection, kind: str) -> None:
    """Refuse a caller's transaction on a database other than the ledger's.

    A row written there would be seen by neither the after-commit send nor the relay:
    the dispatch would be lost without a word. The answer is cached per engine.
    """
    if conn.engine is ledger.engine:
        return
    ours = ledger.migration.ledger_id()
    known = _SAME_DATABASE.setdefault(conn.engine, {})
    if ours not in known:
        try:
            # In a savepoint: a failing read must not abort the caller's transaction.
            with conn.begin_nested():
                theirs: str | None = ledger.migration.ledger_id(conn)
        except LedgerSchemaError:
            raise LedgerSchemaError(
                f"publish({kind}=...) writes the ledger row in your transaction, so the "
                f"{kind}'s database needs the ledger tables: run questpie.migrate() or "
                "`questpie-celery migrate` against it"
            ) from None
        known[ours] = theirs == ours
    if not known[ours]:
        raise PublishOptionsError(
            f"the {kind}'s database is not the one this Questpie's ledger lives in: a row "
            "written there would never be sent. Use a session or connection on the ledger's "
            "database, or publish without a transaction"
        )


Sender = Callable[[Sequence[str]], None]


def send_after_commit(session: Session, dispatch_ids: Sequence[str], send: Sender) -> None:
    """Call `send(ids)` with the ids published in `session` once its outermost
    transaction commits; forget them if it rolls back."""
    root = session.get_transaction()
    if root is None:  # pragma: no cover - the row was just written in it
        raise RuntimeError("the session has no transaction")
    pending: dict[SessionTransaction, list[tuple[Sender, str]]]
    pending = session.info.setdefault(_PENDING, {})
    pending.setdefault(root, []).extend((send, dispatch_id) for dispatch_id in dispatch_ids)
    if not session.info.get(_LISTENING):
        session.info[_LISTENING] = True
        event.listen(session, "after_commit", _after_commit)
        event.listen(session, "after_transaction_end", _after_transaction_end)


def _after_commit(session: Session) -> None:
    if session.in_nested_transaction():
        return  # a released savepoint: nothing is committed yet
    published = session.info.get(_PENDING, {}).pop(session.get_transaction(), [])
    by_sender: dict[Sender, list[str]] = {}
    for send, dispatch_id in published:
        by_sender.setdefault(send, []).append(dispatch_id)
    for send, ids in by_sender.items():
        send(ids)


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:  # the root ended; a commit has already taken its ids
        session.info.get(_PENDING, {}).pop(transaction, None)
