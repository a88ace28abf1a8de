"""Publishing one validated dispatch: ledger row (when needed), then the broker.

Routing (SPEC section 3): an unkeyed dispatch of a standard job outside a
transaction is a plain `send_task` under a fresh UUID, with no ledger row.
Everything else is written to the ledger first, so a failure after that point
leaves a pending row that a retry or the relay can finish.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, event
from sqlalchemy.orm import Session

from .acceptance import AcceptanceRecorder
from .broker import MessageHeader, Sender
from .errors import BrokerError, LedgerSchemaError, PublishOptionsError
from .ids import derive_dispatch_id, random_dispatch_id
from .ledger import Ledger, NewDispatch, utcnow
from .options import DispatchOptions, RunOptions

log = logging.getLogger(__name__)

_SESSION_PENDING = "questpie_pending_dispatches"
_SESSION_LISTENING = "questpie_listening"


class Dispatcher:
    def __init__(self, ledger: Ledger, sender: Sender) -> None:
        self.ledger = ledger
        self.sender = sender
        self.acceptance = AcceptanceRecorder(ledger)

    def dispatch(
        self,
        job_name: str,
        body: dict[str, Any],
        options: DispatchOptions,
        *,
        session: Session | None = None,
        connection: Connection | None = None,
    ) -> str | None:
        transactional = session is not None or connection is not None
        if options.idempotency_key is None and not transactional:
            dispatch_id = random_dispatch_id()
            self.sender.send(
                job_name=job_name,
                dispatch_id=dispatch_id,
                payload=body,
                header=MessageHeader(ledgered=False, run=options.run),
                priority=options.priority,
                queue=options.queue,
                eta=options.start_after,
            )
            return dispatch_id

        dispatch_id = (
            derive_dispatch_id(job_name, options.idempotency_key)
            if options.idempotency_key is not None
            else random_dispatch_id()
        )
        new = NewDispatch(
            id=dispatch_id,
            job_name=job_name,
            idempotency_key=options.idempotency_key,
            singleton_key=options.singleton_key,
            payload=body,
            options={
                "run": options.run.to_dict(),
                "priority": options.priority,
                "queue": options.queue,
            },
            run_after=options.start_after or utcnow(),
        )
        if session is not None:
            with _needs_ledger_tables("session"):
                inserted = self.ledger.insert_dispatch(new, conn=session.connection())
            if inserted:
                self._send_after_commit(session, dispatch_id)
            return dispatch_id
        if connection is not None:
            # A Connection has no after-commit hook: the relay sends the row once committed.
            with _needs_ledger_tables("connection"):
                self.ledger.insert_dispatch(new, conn=connection)
            return dispatch_id
        if self.ledger.insert_dispatch(new):
            self.send_pending(new)
        return dispatch_id

    def send_pending(self, new: NewDispatch) -> None:
        """Send the first message of a freshly written row; failures leave it pending."""
        try:
            self.sender.send(
                job_name=new.job_name,
                dispatch_id=new.id,
                payload=new.payload,
                header=MessageHeader(ledgered=True, attempt=1, run=_run_of(new.options)),
                priority=new.options.get("priority"),
                queue=new.options.get("queue"),
                eta=new.run_after if new.run_after > utcnow() else None,
            )
        except BrokerError as exc:
            log.warning(
                "dispatch %s of job %s is in the ledger but the broker refused it (%s); "
                "it stays pending for the relay",
                new.id,
                new.job_name,
                type(exc.__cause__).__name__,
                extra={"dispatch_id": new.id, "job_name": new.job_name},
            )
            return
        self.acceptance.record(new.id)

    def _send_after_commit(self, session: Session, dispatch_id: str) -> None:
        # Ids stay listed across a rollback on purpose: the commit that follows re-reads
        # each one and skips what is gone, which is simpler than tracking savepoints.
        session.info.setdefault(_SESSION_PENDING, []).append(dispatch_id)
        if not session.info.get(_SESSION_LISTENING):
            session.info[_SESSION_LISTENING] = True
            event.listen(session, "after_commit", self._after_commit)

    def _after_commit(self, session: Session) -> None:
        ids = session.info.pop(_SESSION_PENDING, [])
        for dispatch_id in ids:
            # Re-read: after_commit fires even when the savepoint that held the row
            # rolled back, and then there is nothing to send.
            row = self.ledger.get(dispatch_id)
            if row is None or row.status != "pending":
                continue
            self.send_pending(
                NewDispatch(
                    id=row.id,
                    job_name=row.job_name,
                    idempotency_key=row.idempotency_key,
                    singleton_key=row.singleton_key,
                    payload=row.payload,
                    options=row.options,
                    run_after=row.run_after,
                )
            )


@contextmanager
def _needs_ledger_tables(kind: str) -> Iterator[None]:
    try:
        yield
    except LedgerSchemaError:
        raise LedgerSchemaError(
            f"publish({kind}=...) writes the ledger row in your transaction, so the {kind}'s "
            "database needs the ledger tables: run questpie.migrate() or "
            "`questpie-celery migrate` against it"
        ) from None


def _run_of(options: dict[str, Any]) -> RunOptions:
    return RunOptions.from_dict(options.get("run"))


def check_transaction_args(session: object, connection: object) -> None:
    if session is not None and connection is not None:
        raise PublishOptionsError("pass session or connection, not both")
    if session is not None and not isinstance(session, Session):
        raise PublishOptionsError("session must be a sqlalchemy.orm.Session")
    if connection is not None and not isinstance(connection, Connection):
        raise PublishOptionsError("connection must be a sqlalchemy.Connection")
