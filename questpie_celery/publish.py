"""Publishing one validated dispatch: a ledger row (when needed), then the outbox.

An unkeyed dispatch of a `standard` job, outside a transaction, not secret and
not delayed beyond the ETA horizon, is a plain Celery message under a fresh
UUID, with no ledger row. Everything else is written to the ledger first, so a
failure after that point leaves a row that a retry or the relay can finish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from . import telemetry
from .broker import MessageHeader, Sender
from .crypto import Keyring
from .ids import derive_dispatch_id, random_dispatch_id
from .jobs import JobDefinition
from .ledger import Ledger, NewDispatch, caller_connection, send_after_commit
from .options import DispatchOptions
from .outbox import Outbox
from .policies import QueuePolicy
from .recorded_policy import PolicyBook
from .signals import publish_suppressed

log = logging.getLogger(__name__)


class Publisher:
    def __init__(
        self,
        ledger: Ledger,
        outbox: Outbox,
        sender: Sender,
        policies: PolicyBook,
        keyring: Callable[[], Keyring],
    ) -> None:
        self._ledger = ledger
        self._outbox = outbox
        self._sender = sender
        self._policies = policies
        self._keyring = keyring  # the keyring a secret publish seals with, or why not

    def publish(
        self,
        definition: JobDefinition[Any],
        payload: Any,
        options: DispatchOptions,
        *,
        session: Session | None = None,
        connection: Connection | None = None,
    ) -> str | None:
        """Validate the payload, then route the dispatch; return its id, or None when a
        queue policy suppressed it."""
        with telemetry.span("questpie.publish", job=definition.name) as span:
            dispatch_id = self._publish(definition, payload, options, session, connection, span)
            span.set(dispatch_id=dispatch_id, outcome="accepted" if dispatch_id else "suppressed")
            return dispatch_id

    def _publish(
        self,
        definition: JobDefinition[Any],
        payload: Any,
        options: DispatchOptions,
        session: Session | None,
        connection: Connection | None,
        span: telemetry.Span,
    ) -> str | None:
        keyring = self._keyring() if options.secret_payload else None
        body = definition.to_json(payload)
        caller = caller_connection(self._ledger, session, connection)
        policy = self._policies.effective(definition, options.queue_policy)
        span.set(policy=str(policy))
        if not policy.ledgered and options.singleton_key is not None:
            self._policies.warn_ignored_singleton_key(definition.name)
        now = datetime.now(UTC)
        if (
            options.idempotency_key is None
            and caller is None
            and not policy.ledgered
            and not options.secret_payload
            and not self._outbox.is_far_off(options.start_after, now)
        ):
            dispatch_id = random_dispatch_id()
            self._sender.send(
                job_name=definition.name,
                dispatch_id=dispatch_id,
                payload=body,
                header=MessageHeader(ledgered=False, run=options.run),
                priority=options.priority,
                queue=options.queue,
                eta=options.start_after,
            )
            return dispatch_id
        return self._publish_ledgered(
            definition.name, body, options, policy, keyring, now, caller, session
        )

    def _publish_ledgered(
        self,
        job_name: str,
        body: dict[str, Any],
        options: DispatchOptions,
        policy: QueuePolicy,
        keyring: Keyring | None,
        now: datetime,
        caller: Connection | None,
        session: Session | None,
    ) -> str | None:
        key = options.idempotency_key
        dispatch_id = derive_dispatch_id(job_name, key) if key is not None else random_dispatch_id()
        sealed = keyring.seal(body, job_name=job_name, dispatch_id=dispatch_id) if keyring else None
        first = self._outbox.first_send(
            options.start_after, now, after_commit_hook=caller is None or session is not None
        )
        new = NewDispatch(
            id=dispatch_id,
            job_name=job_name,
            idempotency_key=key,
            singleton_key=options.singleton_key,
            # A secret dispatch stores only ciphertext, and its message carries no payload.
            payload=None if sealed else body,
            secret_ciphertext=sealed.ciphertext if sealed else None,
            secret_wrapped_key=sealed.wrapped_key if sealed else None,
            secret_key_id=sealed.key_id if sealed else None,
            options=options.stored(),
            run_after=options.start_after,
            next_send_at=first.next_send_at,
            send_in=first.send_in,
            policy=policy if policy.ledgered else None,
        )
        if not self._ledger.insert(new, caller):
            return self._not_inserted(new, caller)
        if session is not None:
            if first.publisher_sends:
                send_after_commit(session, dispatch_id, self._outbox.send_committed)
        elif first.publisher_sends:
            self._outbox.send(new, attempt=1)
        return dispatch_id

    def _not_inserted(self, new: NewDispatch, conn: Connection | None) -> str | None:
        """The insert met an existing row: the key's own (a repeat) or a policy slot's."""
        if new.slot is None:
            return new.id  # no slot index applies, so only the key's own row can conflict
        if new.idempotency_key is not None and self._ledger.exists(new.id, conn):
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
            policy=str(new.policy),
        )
        return None
