"""Publishing one validated dispatch: a ledger row (when needed), then the outbox.

An unkeyed dispatch of a `standard` job, outside a transaction, not secret and
not delayed beyond the ETA horizon, is a plain Celery message under a fresh
UUID, with no ledger row. Everything else is written to the ledger first, so a
failure after that point leaves a row that a retry or the relay can finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from . import telemetry
from .broker import MessageHeader, Sender
from .crypto import Keyring
from .dispatch_rows import new_dispatch, report_suppressed
from .errors import BrokerError, PayloadValidationError
from .ids import random_dispatch_id
from .jobs import JobDefinition
from .ledger import (
    Ledger,
    NewDispatch,
    caller_connection,
    send_after_commit,
)
from .options import DispatchOptions
from .outbox import FirstSend, Outbox
from .policies import QueuePolicy
from .recorded_policy import PolicyBook

#: Items of a bulk publish per ledger statement and per pipelined batch of sends.
BATCH_SIZE = 1000

#: `Session.info` key: how to send the rows of a session an `AsyncSession` drives.
ASYNC_SEND = "questpie_async_send"


@dataclass(frozen=True)
class CallerTransaction:
    """The caller's transaction a publish writes its rows in: its connection, and what
    sends those rows once it commits (None for a bare Connection, which has no commit
    hook: the relay sends them, woken by the commit where the database can say so)."""

    connection: Connection
    after_commit: Callable[[Sequence[str]], None] | None


@dataclass
class Route:
    """Where one dispatch goes: a plain message under `dispatch_id` (no `new`), or the
    ledger row `new`, first sent as `first` says."""

    dispatch_id: str
    new: NewDispatch | None = None
    first: FirstSend = field(default_factory=lambda: FirstSend(False))
    #: A plain message's body and options, kept for a sender that sends it later.
    plain: tuple[dict[str, Any], DispatchOptions] | None = None


@dataclass
class Chunk:
    """Up to `BATCH_SIZE` items of a bulk publish: ids in order (None once suppressed),
    the rows to insert by item index, and the items sent as plain messages."""

    first: FirstSend
    ids: list[str | None] = field(default_factory=list)
    news: dict[int, NewDispatch] = field(default_factory=dict)
    plain: list[tuple[str, dict[str, Any], DispatchOptions]] = field(default_factory=list)

    @property
    def rows(self) -> list[NewDispatch]:
        return list(self.news.values())

    def contested(self, inserted: set[str]) -> list[str]:
        """Keyed rows under a policy that were not inserted: repeats or suppressions."""
        return [
            new.id
            for new in self.news.values()
            if new.id not in inserted and Publisher.needs_existence_check(new)
        ]


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
        keyring, bodies = self.validate_many(definition, payloads, options)
        with self._caller(session, connection) as caller:
            if self._sender.eager:
                # Eager mode runs each dispatch as it is published, so a later item can
                # see an earlier one finished (its policy slot free again): one by one.
                return [
                    self._publish_in(definition, body, item, keyring, caller, span)
                    for body, item in zip(bodies, options, strict=True)
                ]
            policy = self.policy(definition, options, span)
            ids: list[str | None] = []
            for chunk in self.chunks(definition.name, bodies, options, policy, keyring, caller):
                conn = caller.connection if caller is not None else None
                inserted = self._ledger.insert_many(chunk.rows, conn)
                contested = chunk.contested(inserted)
                known = self._ledger.existing(contested, conn) if contested else set()
                to_send = self.settle(chunk, inserted, known)
                if to_send:
                    self._hand_over(chunk.first, caller, list(to_send.values()))
                if chunk.plain:
                    self.send_plain(definition.name, chunk.plain)
                ids += chunk.ids
            return ids

    def validate_many(
        self,
        definition: JobDefinition[Any],
        payloads: Sequence[Any],
        options: Sequence[DispatchOptions],
        *,
        first_index: int = 0,
    ) -> tuple[Keyring | None, list[dict[str, Any]]]:
        """The keyring a secret batch seals with, and every payload's JSON; a bad one is
        named by its index (counted from `first_index` when validating a slice)."""
        keyring = self.keyring_for(options[0])
        bodies: list[dict[str, Any]] = []
        for index, payload in enumerate(payloads, start=first_index):
            try:
                bodies.append(definition.to_json(payload))
            except PayloadValidationError as exc:
                raise PayloadValidationError(f"item {index}: {exc}") from None
        return keyring, bodies

    def policy(
        self,
        definition: JobDefinition[Any],
        options: Sequence[DispatchOptions],
        span: telemetry.Span,
    ) -> QueuePolicy:
        """The policy the dispatches are accepted under (the items of one call share it).

        May read or record the job's policy in the ledger, once per cache period.
        """
        policy = self._policies.effective(definition, options[0].queue_policy)
        span.set(policy=str(policy))
        if not policy.ledgered and any(item.singleton_key is not None for item in options):
            self._policies.warn_ignored_singleton_key(definition.name)
        return policy

    def policy_is_cached(self, definition: JobDefinition[Any]) -> bool:
        """Whether `policy` would answer without the ledger."""
        return self._policies.is_cached(definition.name)

    def read_policy(self, definition: JobDefinition[Any]) -> None:
        """Read the job's recorded policy into the cache (writing nothing)."""
        self._policies.read(definition.name)

    def keyring_for(self, options: DispatchOptions) -> Keyring | None:
        """The keyring a secret dispatch seals with (or why it may not); None otherwise."""
        return self._keyring() if options.secret_payload else None

    def chunks(
        self,
        job_name: str,
        bodies: list[dict[str, Any]],
        options: Sequence[DispatchOptions],
        policy: QueuePolicy,
        keyring: Keyring | None,
        caller: CallerTransaction | None,
        *,
        size: int = BATCH_SIZE,
    ) -> Iterator[Chunk]:
        """The items `size` at a time: each chunk with its rows, plain messages and ids."""
        shared = options[0]  # the items differ in their keys only
        now = datetime.now(UTC)
        first = self._first_send(shared, caller, now)
        plain_ok = self._may_skip_ledger(shared, policy, caller, now)
        stored = shared.stored()
        for start in range(0, len(bodies), size):
            chunk = Chunk(first)
            for index in range(start, min(start + size, len(bodies))):
                item = options[index]
                if plain_ok and item.idempotency_key is None:
                    plain_id = random_dispatch_id()
                    chunk.ids.append(plain_id)
                    chunk.plain.append((plain_id, bodies[index], item))
                    continue
                new = new_dispatch(job_name, bodies[index], item, policy, keyring, first, stored)
                chunk.news[len(chunk.ids)] = new
                chunk.ids.append(new.id)
            yield chunk

    def settle(self, chunk: Chunk, inserted: set[str], known: set[str]) -> dict[str, NewDispatch]:
        """Decide each ledgered item of an inserted chunk; return the rows to send.

        Not inserted: a key already in the ledger (or earlier in the chunk), or a taken
        policy slot, which a known key still answers with its id, as `publish` does.
        """
        to_send: dict[str, NewDispatch] = {}  # by id: a key twice in a chunk is sent once
        for index, row in chunk.news.items():
            if row.id in inserted:
                to_send.setdefault(row.id, row)
            elif row.slot is not None and row.id not in known:
                chunk.ids[index] = None
                report_suppressed(row)
        return to_send

    def _may_skip_ledger(
        self,
        options: DispatchOptions,
        policy: QueuePolicy,
        caller: CallerTransaction | None,
        now: datetime,
    ) -> bool:
        """An unkeyed dispatch with these options needs no ledger row: a plain message."""
        return (
            caller is None
            and not policy.ledgered
            and not options.secret_payload
            and not self._outbox.is_far_off(options.start_after, now)
        )

    def send_unledgered(
        self,
        job_name: str,
        dispatch_id: str,
        body: dict[str, Any],
        options: DispatchOptions,
        trace: Mapping[str, str] | None = None,
    ) -> None:
        self._sender.send(
            job_name=job_name,
            dispatch_id=dispatch_id,
            payload=body,
            header=MessageHeader(ledgered=False, run=options.run),
            priority=options.priority,
            queue=options.queue,
            eta=options.start_after,
            trace=trace,
        )

    def send_plain(
        self, job_name: str, items: list[tuple[str, dict[str, Any], DispatchOptions]]
    ) -> None:
        """Send dispatches that need no ledger row, as `apply_async` would: a refusal
        raises `BrokerError` (the ledgered items of the call are safe by then)."""
        try:
            with self._sender.batch(len(items)):
                for dispatch_id, body, item in items:
                    self.send_unledgered(job_name, dispatch_id, body, item)
        except BrokerError as exc:
            raise BrokerError(
                f"the broker refused a batch of {len(items)} unkeyed dispatches of job "
                f"{job_name!r} ({type(exc.__cause__).__name__}); sent in one pipeline, some "
                "may have arrived and will run. Items with idempotency keys are ledgered "
                "and can be published again safely"
            ) from exc.__cause__

    def _publish(
        self,
        definition: JobDefinition[Any],
        payload: Any,
        options: DispatchOptions,
        session: Session | None,
        connection: Connection | None,
        span: telemetry.Span,
    ) -> str | None:
        keyring = self.keyring_for(options)
        body = definition.to_json(payload)
        if session is None and connection is None and self._ledger.ambient is None:
            # The common case, on every plain publish: no caller's transaction to look for.
            return self._publish_in(definition, body, options, keyring, None, span)
        with self._caller(session, connection) as caller:
            return self._publish_in(definition, body, options, keyring, caller, span)

    def _publish_in(
        self,
        definition: JobDefinition[Any],
        body: dict[str, Any],
        options: DispatchOptions,
        keyring: Keyring | None,
        caller: CallerTransaction | None,
        span: telemetry.Span,
    ) -> str | None:
        """Publish one validated dispatch, in `caller`'s transaction when there is one."""
        policy = self.policy(definition, [options], span)
        route = self.route(definition.name, body, options, policy, keyring, caller)
        if route.new is None:
            self.send_unledgered(definition.name, route.dispatch_id, body, options)
            return route.dispatch_id
        new = route.new
        conn = caller.connection if caller is not None else None
        if not self._ledger.insert(new, conn):
            known = self.needs_existence_check(new) and self._ledger.exists(new.id, conn)
            return self.not_inserted(new, known)
        self._hand_over(route.first, caller, [new])
        return new.id

    def _hand_over(
        self, first: FirstSend, caller: CallerTransaction | None, rows: list[NewDispatch]
    ) -> None:
        """Send newly inserted rows now, after the caller's commit, or leave them to the
        relay (woken by the commit where the database can say so)."""
        if first.publisher_sends:
            if caller is None:
                if len(rows) == 1:
                    self._outbox.send(rows[0], attempt=1)
                else:
                    self._outbox.send_many(rows)
            else:
                assert caller.after_commit is not None  # publisher_sends: it has a hook
                caller.after_commit([row.id for row in rows])
        elif first.wake_relays and caller is not None:
            self._ledger.wake_relays(caller.connection)

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

    def route(
        self,
        job_name: str,
        body: dict[str, Any],
        options: DispatchOptions,
        policy: QueuePolicy,
        keyring: Keyring | None,
        caller: CallerTransaction | None,
    ) -> Route:
        """Where one validated dispatch goes: a plain message, or a ledger row first."""
        now = datetime.now(UTC)
        if options.idempotency_key is None and self._may_skip_ledger(options, policy, caller, now):
            return Route(random_dispatch_id())
        first = self._first_send(options, caller, now)
        new = new_dispatch(job_name, body, options, policy, keyring, first)
        return Route(new.id, new, first)

    def _first_send(
        self, options: DispatchOptions, caller: CallerTransaction | None, now: datetime
    ) -> FirstSend:
        hooked = caller is None or caller.after_commit is not None
        return self._outbox.first_send(options.start_after, now, after_commit_hook=hooked)

    @staticmethod
    def needs_existence_check(new: NewDispatch) -> bool:
        """A refused insert of a keyed row under a policy: its key's own row, or the slot's?"""
        return new.slot is not None and new.idempotency_key is not None

    def not_inserted(self, new: NewDispatch, known: bool) -> str | None:
        """The answer to an insert that met an existing row: the key's own (a repeat,
        `known`) or a policy slot's (suppressed). Without a slot only the key's own row
        can conflict."""
        if new.slot is None or known:
            return new.id  # a known key is answered before any policy
        report_suppressed(new)
        return None

    def committed_sender(self, session: Session) -> Callable[[Sequence[str]], None]:
        """What sends a session's rows once it commits: inline, or for a session that an
        `AsyncSession` drives, handed to the send threads (its commit runs in the loop)."""
        handoff = session.info.get(ASYNC_SEND)
        return handoff if handoff is not None else self._outbox.send_committed
