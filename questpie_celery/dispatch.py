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
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import Connection, event
from sqlalchemy.orm import Session

from .acceptance import AcceptanceRecorder
from .broker import MessageHeader, Sender
from .crypto import Keyring
from .errors import BrokerError, LedgerSchemaError, PublishOptionsError, QuestpieError
from .ids import derive_dispatch_id, random_dispatch_id
from .ledger import Ledger, NewDispatch, utcnow
from .options import DispatchOptions, RunOptions
from .policies import STANDARD
from .signals import publish_suppressed

log = logging.getLogger(__name__)

#: A dispatch due further ahead than this waits in the ledger, not as a broker ETA held
#: in worker memory (which Redis duplicates past its visibility timeout).
ETA_HORIZON_SECONDS = 60.0
#: How long the relay leaves a freshly written row to the process that wrote it.
PENDING_GRACE_SECONDS = 30.0


def relay_time_for_retry(delay: float) -> datetime | None:
    """When the relay should send a retry due in `delay` s; None to send it at once.

    A retry further out than the ETA horizon waits in the ledger instead of sitting in a
    worker's memory as an ETA.
    """
    if delay <= ETA_HORIZON_SECONDS:
        return None
    return utcnow() + timedelta(seconds=delay - ETA_HORIZON_SECONDS)


_SESSION_PENDING = "questpie_pending_dispatches"
_SESSION_LISTENING = "questpie_listening"


class SendableRow(Protocol):
    """What sending a ledgered dispatch needs; a new or a stored row both have it."""

    @property
    def id(self) -> str: ...
    @property
    def job_name(self) -> str: ...
    @property
    def payload(self) -> dict[str, Any] | None: ...
    @property
    def options(self) -> dict[str, Any]: ...
    @property
    def run_after(self) -> datetime: ...


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
        policy: str = STANDARD,
        keyring: Keyring | None = None,
        session: Session | None = None,
        connection: Connection | None = None,
    ) -> str | None:
        transactional = session is not None or connection is not None
        now = utcnow()
        far_off = options.start_after is not None and options.start_after > now + timedelta(
            seconds=ETA_HORIZON_SECONDS
        )
        if (
            options.idempotency_key is None
            and not transactional
            and policy == STANDARD
            and not far_off
            and not options.secret_payload
        ):
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
        limited = policy != STANDARD
        sealed = None
        if options.secret_payload:
            if keyring is None:  # the client checks first; this keeps plaintext out regardless
                raise PublishOptionsError("secret_payload needs a secret of at least 32 bytes")
            sealed = keyring.seal(body, job_name=job_name, dispatch_id=dispatch_id)
        new = NewDispatch(
            id=dispatch_id,
            job_name=job_name,
            idempotency_key=options.idempotency_key,
            singleton_key=options.singleton_key,
            # A secret dispatch stores only ciphertext, and its message carries no payload.
            payload=None if sealed else body,
            secret_ciphertext=sealed.ciphertext if sealed else None,
            secret_wrapped_key=sealed.wrapped_key if sealed else None,
            secret_key_id=sealed.key_id if sealed else None,
            options={
                "run": options.run.to_dict(),
                "priority": options.priority,
                "queue": options.queue,
            },
            run_after=options.start_after or now,
            # When the relay takes over if nothing else moved the row on: shortly before
            # a far-off start, at once for a Connection's row, else after a grace period.
            next_send_at=(
                options.start_after - timedelta(seconds=ETA_HORIZON_SECONDS)
                if far_off and options.start_after is not None
                else now
                if connection is not None
                else now + timedelta(seconds=PENDING_GRACE_SECONDS)
            ),
            policy=policy if limited else None,
            slot=(options.singleton_key or "") if limited else None,
        )
        if session is not None:
            with _needs_ledger_tables("session"):
                inserted = self.ledger.insert_dispatch(new, conn=session.connection())
            if inserted:
                if not far_off:
                    self._send_after_commit(session, dispatch_id)
                return dispatch_id
            return self._not_inserted(new, conn=session.connection())
        if connection is not None:
            # A Connection has no after-commit hook: the relay sends the row once committed.
            with _needs_ledger_tables("connection"):
                inserted = self.ledger.insert_dispatch(new, conn=connection)
            return dispatch_id if inserted else self._not_inserted(new, conn=connection)
        if self.ledger.insert_dispatch(new):
            if not far_off:  # a far-off dispatch waits in the ledger for the relay
                self.send_row(new, attempt=1)
            return dispatch_id
        return self._not_inserted(new)

    def _not_inserted(self, new: NewDispatch, conn: Connection | None = None) -> str | None:
        """The insert met an existing row: the key's own (a repeat) or a policy slot's."""
        if new.policy is None:
            return new.id  # no slot index applies, so only the key's own row can conflict
        if new.idempotency_key is not None and self.ledger.exists(new.id, conn=conn):
            return new.id  # a known key is answered before any policy
        log.info(
            "publish of job %s suppressed by its %s queue policy (slot %r is taken)",
            new.job_name,
            new.policy,
            new.slot,
            extra={"job_name": new.job_name, "singleton_key": new.singleton_key},
        )
        publish_suppressed.send(
            sender=new.job_name,
            job_name=new.job_name,
            singleton_key=new.singleton_key,
            policy=new.policy,
        )
        return None

    def send_row(self, row: SendableRow, *, attempt: int) -> bool:
        """Send the message for `attempt` of a ledgered dispatch; False if the broker refused.

        A refusal leaves the row as it is (pending, queued or retry) for the relay.
        """
        now = utcnow()
        try:
            self.sender.send(
                job_name=row.job_name,
                dispatch_id=row.id,
                payload=row.payload,
                header=MessageHeader(
                    ledgered=True, attempt=attempt, run=RunOptions.from_dict(row.options.get("run"))
                ),
                priority=row.options.get("priority"),
                queue=row.options.get("queue"),
                eta=row.run_after if row.run_after > now else None,
            )
        except BrokerError as exc:
            log.warning(
                "dispatch %s of job %s is in the ledger but the broker refused it (%s); "
                "it stays pending in the ledger for the relay",
                row.id,
                row.job_name,
                type(exc.__cause__).__name__,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )
            return False
        if attempt == 1:
            self.acceptance.record(row.id)
        return True

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
            try:
                row = self.ledger.get(dispatch_id)
                if row is not None and row.status == "pending":
                    self.send_row(row, attempt=1)
            except QuestpieError as exc:
                # The caller's commit succeeded; the relay sends the row after its grace.
                log.warning(
                    "dispatch %s committed but not sent (%s); the relay will send it",
                    dispatch_id,
                    type(exc).__name__,
                    extra={"dispatch_id": dispatch_id},
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


def check_transaction_args(session: object, connection: object) -> None:
    if session is not None and connection is not None:
        raise PublishOptionsError("pass session or connection, not both")
    if session is not None and not isinstance(session, Session):
        raise PublishOptionsError("session must be a sqlalchemy.orm.Session")
    if connection is not None and not isinstance(connection, Connection):
        raise PublishOptionsError("connection must be a sqlalchemy.Connection")
