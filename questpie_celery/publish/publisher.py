"""Publishing on the sync ledger: a plan's rows inserted, then the outbox.

The decisions are the planner's (`publish/planner.py`); this executes them: the statements
on the ledger (in the caller's transaction when there is one) and the sends. A bulk
publish is the planner's chunk plan (`planner.publish`), driven here a step at a time;
`publish/aio.py` awaits the same plan. A failure after the insert leaves a row that a
retry or the relay can finish.

What both publishers do beside the plan is written here once, as functions of the parts
they share: the policy a publish is accepted under, its keyring, the plain messages'
sends and the report of what a policy suppressed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from .._runtime import telemetry
from .._runtime.plans import drive
from ..errors import BrokerError, PublishOptionsError
from ..intake.new_rows import report_suppressed
from ..intake.recorded_policy import PolicyBook
from ..jobs.crypto import Keyring
from ..jobs.definition import JobDefinition
from ..jobs.options import DispatchOptions
from ..jobs.policies import QueuePolicy
from ..ledger import (
    Ledger,
    NewDispatch,
    caller_connection,
    send_after_commit,
)
from ..send.broker import MessageHeader, Sender
from ..send.outbox import Outbox
from . import planner
from .shared_inserts import SharedInserts

# Named as before the package had parts: projects configure this logger by name.
log = logging.getLogger("questpie_celery.publish")

#: Items of a bulk publish per ledger statement and per pipelined batch of sends.
BATCH_SIZE = 1000

#: `Session.info` key: how to send the rows of a session an `AsyncSession` drives.
ASYNC_SEND = "questpie_async_send"


def queue_policy(
    policies: PolicyBook,
    definition: JobDefinition[Any],
    options: Sequence[DispatchOptions],
    span: telemetry.Span,
) -> QueuePolicy:
    """The policy the dispatches are accepted under (the items of one call share it).

    May read or record the job's policy in the ledger, once per cache period.
    """
    policy = policies.effective(definition, options[0].queue_policy)
    span.set(policy=str(policy))
    # A debounced or throttled dispatch's singleton key names its burst or window.
    if (
        not policy.ledgered
        and not options[0].flow_controlled
        and any(item.singleton_key is not None for item in options)
    ):
        policies.warn_ignored_singleton_key(definition.name)
    return policy


def keyring_for(keyring: Callable[[], Keyring], options: DispatchOptions) -> Keyring | None:
    """The keyring a secret dispatch seals with (or why it may not); None otherwise."""
    return keyring() if options.secret_payload else None


def send_unledgered(
    sender: Sender,
    job_name: str,
    dispatch_id: str,
    body: dict[str, Any],
    options: DispatchOptions,
    trace: Mapping[str, str] | None = None,
) -> None:
    sender.send(
        job_name=job_name,
        dispatch_id=dispatch_id,
        payload=body,
        header=MessageHeader(ledgered=False, run=options.run),
        priority=options.priority,
        queue=options.queue,
        eta=options.start_after,
        carry=options.carry,
        trace=trace,
    )


def send_plain(
    sender: Sender, job_name: str, items: list[tuple[str, dict[str, Any], DispatchOptions]]
) -> None:
    """Send dispatches that need no ledger row, as `apply_async` would: a refusal
    raises `BrokerError` (the ledgered items of the call are safe by then)."""
    try:
        with sender.batch(len(items)):
            for dispatch_id, body, item in items:
                send_unledgered(sender, job_name, dispatch_id, body, item)
    except BrokerError as exc:
        raise BrokerError(
            f"the broker refused a batch of {len(items)} unkeyed dispatches of job "
            f"{job_name!r} ({type(exc.__cause__).__name__}); sent in one pipeline, some "
            "may have arrived and will run. Items with idempotency keys are ledgered "
            "and can be published again safely"
        ) from exc.__cause__


def report(settled: planner.Settled) -> None:
    """Report each item a taken policy slot refused (log line and signal)."""
    for row in settled.suppressed:
        report_suppressed(row)


@dataclass(frozen=True)
class CallerTransaction:
    """The caller's transaction a publish writes its rows in: its connection, and what
    sends those rows once it commits (None for a bare Connection, which has no commit
    hook: the relay sends them, woken by the commit where the database can say so)."""

    connection: Connection
    after_commit: Callable[[Sequence[str]], None] | None


class Publisher:
    def __init__(
        self,
        ledger: Ledger,
        outbox: Outbox,
        sender: Sender,
        policies: PolicyBook,
        keyring: Callable[[], Keyring],
    ) -> None:
        self._ledger = ledger  # its ambient transaction, and the caller's connection's check
        self._dispatches = ledger.dispatches
        self._debounce = ledger.debounce
        self._throttle = ledger.throttle
        self._relay = ledger.relay  # wakes the relays when a caller's transaction commits
        self._outbox = outbox
        self._sender = sender
        self._policies = policies
        self._keyring = keyring  # the keyring a secret publish seals with, or why not
        # Whether sends run the task inline, asked by the planner only when it makes a row.
        self._eager = lambda: sender.eager
        # Concurrent single publishes of this process share a multi-row insert.
        self._shared = SharedInserts(self._dispatches.insert, self._dispatches.insert_many)

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

    def publish_many(
        self,
        definition: JobDefinition[Any],
        payloads: Sequence[Any],
        options: Sequence[DispatchOptions],
        *,
        session: Session | None = None,
        connection: Connection | None = None,
    ) -> list[str | None]:
        """Validate every payload, then publish them in order, as that many `publish`
        calls would, a chunk at a time: one insert and one pipelined send per chunk."""
        with telemetry.span(
            "questpie.publish_many", job=definition.name, count=len(payloads)
        ) as span:
            ids = self._publish_many(definition, payloads, options, session, connection, span)
            span.set(accepted=sum(dispatch_id is not None for dispatch_id in ids))
            return ids

    def _publish_many(
        self,
        definition: JobDefinition[Any],
        payloads: Sequence[Any],
        options: Sequence[DispatchOptions],
        session: Session | None,
        connection: Connection | None,
        span: telemetry.Span,
    ) -> list[str | None]:
        if not options:
            return []
        keyring = keyring_for(self._keyring, options[0])
        bodies = planner.validate(definition, payloads)
        with self._caller(session, connection) as caller:
            if self._sender.eager:
                # Eager mode runs each dispatch as it is published, so a later item can
                # see an earlier one finished (its policy slot free again): one by one.
                return [
                    self._publish_in(definition, [body], [item], keyring, caller, span)[0]
                    for body, item in zip(bodies, options, strict=True)
                ]
            return self._publish_in(definition, bodies, options, keyring, caller, span, many=True)

    def _publish(
        self,
        definition: JobDefinition[Any],
        payload: Any,
        options: DispatchOptions,
        session: Session | None,
        connection: Connection | None,
        span: telemetry.Span,
    ) -> str | None:
        keyring = keyring_for(self._keyring, options)
        body = definition.to_json(payload)
        if session is None and connection is None and self._ledger.ambient is None:
            # The common case, on every plain publish: no caller's transaction to look for.
            return self._publish_in(definition, [body], [options], keyring, None, span)[0]
        with self._caller(session, connection) as caller:
            return self._publish_in(definition, [body], [options], keyring, caller, span)[0]

    def _publish_in(
        self,
        definition: JobDefinition[Any],
        bodies: list[dict[str, Any]],
        options: Sequence[DispatchOptions],
        keyring: Keyring | None,
        caller: CallerTransaction | None,
        span: telemetry.Span,
        *,
        many: bool = False,
    ) -> list[str | None]:
        """Publish validated dispatches, in `caller`'s transaction when there is one, a
        chunk at a time: one insert and one pipelined send per chunk (`many`), or one
        dispatch (not `many`: `bodies` holds one) on its own statements and its own send."""
        if options[0].debounce_seconds is not None and self._sender.eager:
            # Eager mode runs each publish at once, as Celery's ignores a countdown.
            options = [replace(item, debounce_seconds=None) for item in options]
        if options[0].throttle_seconds is not None and caller is not None:
            raise PublishOptionsError(
                "throttle_seconds cannot be used in a caller's transaction (session=, "
                "connection=, or a Django atomic block): its window is taken in a "
                "transaction of its own"
            )
        policy = queue_policy(self._policies, definition, options, span)
        plan = planner.Plan(
            definition,
            bodies,
            options,
            policy,
            keyring,
            self._eager,
            in_transaction=caller is not None,
            commit_hook=caller is None or caller.after_commit is not None,
        )
        if options[0].flow_controlled:
            return [self._publish_controlled(plan, index, caller) for index in range(len(bodies))]
        if not many:
            return [self._publish_one(plan, caller)]
        conn = caller.connection if caller is not None else None

        def run(step: planner.Step) -> set[str] | None:
            """One step of the plan: a statement (in `caller`'s transaction when there is
            one), or a chunk's sends."""
            if isinstance(step, planner.Insert):
                return self._dispatches.insert_many(step.rows, conn)
            if isinstance(step, planner.ReadBack):
                return self._dispatches.existing(step.dispatch_ids, conn)
            report(step.settled)
            self._hand_over(step.settled, caller)
            if step.plain:
                send_plain(self._sender, definition.name, step.plain)
            return None

        return drive(planner.publish(plan, BATCH_SIZE), run)

    def _publish_one(self, plan: planner.Plan, caller: CallerTransaction | None) -> str | None:
        """A plan of one item, decided as a chunk of one would be, without a chunk's
        bookkeeping: the most frequent publish, so every step saved counts."""
        route = plan.route(0)
        new = route.new
        if new is None:
            assert route.plain is not None
            send_unledgered(self._sender, plan.job_name, route.dispatch_id, *route.plain)
            return route.dispatch_id
        conn = caller.connection if caller is not None else None
        if self._insert(new, conn):
            self._hand_over(planner.first_sent(new, route), caller)
            return new.id
        known = planner.contested(new) and self._dispatches.exists(new.id, conn)
        if planner.refused(new, known):
            report_suppressed(new)
            return None
        return new.id

    def _publish_controlled(
        self, plan: planner.Plan, index: int, caller: CallerTransaction | None
    ) -> str | None:
        """One debounced or throttled item, on statements of its own (also in a bulk
        publish: a burst or a window is decided one publish at a time)."""
        route = plan.route(index)
        new, item = route.new, plan.options[index]
        assert new is not None  # such an item always has a row
        conn = caller.connection if caller is not None else None
        if item.debounce_seconds is not None:
            assert item.debounce_max_seconds is not None
            dispatch_id, inserted = self._debounce.join(
                new,
                key=item.flow_key,
                debounce=item.debounce_seconds,
                most=item.debounce_max_seconds,
                conn=conn,
            )
            if dispatch_id is None:
                report_suppressed(new)
            elif inserted:
                self._hand_over(planner.first_sent(new, route), caller)
            return dispatch_id
        assert item.throttle_seconds is not None and conn is None
        taken = self._throttle.insert(new, key=item.flow_key, window=item.throttle_seconds)
        if taken == "accepted":
            self._hand_over(planner.first_sent(new, route), caller)
            return new.id
        known = taken == "not inserted" and new.idempotency_key is not None
        if known and self._dispatches.exists(new.id):
            return new.id  # a known key answers its id, before any throttle
        report_suppressed(new, throttled=item.throttle_seconds if taken == "closed" else None)
        return None

    def _insert(self, new: NewDispatch, conn: Connection | None) -> bool:
        """Insert one publish's row: in a statement shared with concurrent publishes of
        this process where it can be."""
        if conn is None and self._dispatches.inserts_in_batches:
            return self._shared.insert(new)
        return self._dispatches.insert(new, conn)

    def _hand_over(self, settled: planner.Settled, caller: CallerTransaction | None) -> None:
        """Send newly inserted rows now, after the caller's commit, or leave them to the
        relay (woken by the commit where the database can say so)."""
        rows = settled.send
        if rows and caller is None:
            # The rows are durable: the broker's part goes on after this call returns (a
            # bulk publish's batch, when nothing else waits, is sent before: see behind.py).
            self._outbox.send_behind(rows)
        elif rows:
            assert caller is not None and caller.after_commit is not None  # it has a hook
            caller.after_commit([row.id for row in rows])
        elif settled.wake_relays and caller is not None:
            self._relay.wake_relays(caller.connection)

    @contextmanager
    def _caller(
        self, session: Session | None, connection: Connection | None
    ) -> Iterator[CallerTransaction | None]:
        """The caller's transaction a publish writes in, if any: the `session=` or
        `connection=` passed, or, with neither, a transaction of the framework that owns
        the ledger's connections (Django's atomic block), which counts as a session."""
        with ExitStack() as stack:
            open_ambient = self._ledger.ambient
            ambient = (
                stack.enter_context(open_ambient())
                if session is None and connection is None and open_ambient is not None
                else None
            )
            if ambient is not None:
                send = self._outbox.send_committed
                yield CallerTransaction(
                    ambient.connection, lambda ids: ambient.after_commit(ids, send)
                )
                return
            conn = caller_connection(self._ledger, session, connection)
            if conn is None:
                yield None
            elif session is not None:
                sender = self.committed_sender(session)
                yield CallerTransaction(conn, lambda ids: send_after_commit(session, ids, sender))
            else:
                yield CallerTransaction(conn, None)  # a Connection has no commit hook

    def committed_sender(self, session: Session) -> Callable[[Sequence[str]], None]:
        """What sends a session's rows once it commits: inline, or for a session that an
        `AsyncSession` drives, handed to the send threads (its commit runs in the loop)."""
        handoff = session.info.get(ASYNC_SEND)
        return handoff if handoff is not None else self._outbox.send_committed
