"""Publishing from an event loop: `apublish`, `apublish_many`.

The same decisions as `publish.py`, in the same order, from the same code; only
the waiting differs. The ledger is awaited (`ledger.aio`), and the broker send,
which kombu only does synchronously, runs on a few threads of our own. So the
loop never waits on the broker or the database, only on its own Python.

In a caller's `AsyncSession` or `AsyncConnection`, the sync publish runs through
SQLAlchemy's `run_sync`: its statements go over the caller's async connection,
inside the caller's transaction, with the sync path's savepoint rules. Only the
send after commit changes: it is handed to the send threads, because the commit
runs in the loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from . import telemetry
from .broker import Sender
from .errors import PublishOptionsError
from .jobs import JobDefinition
from .ledger.aio import AsyncLedger
from .options import DispatchOptions
from .outbox import Outbox
from .policies import QueuePolicy
from .publish import ASYNC_SEND, Publisher

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Threads that talk to the broker for publishers in event loops. A send takes the
#: broker a fraction of a millisecond, so a few keep up with many concurrent publishes,
#: and they hold no more than a few of the producer pool's connections.
SEND_THREADS = 4


class SendThreads:
    """A small pool of threads for kombu's blocking sends, made on first use (and made
    again in a forked child, where the parent's threads do not exist)."""

    def __init__(self, size: int = SEND_THREADS) -> None:
        self._size = size
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        """Run `call(*args)` on a send thread; the loop goes on meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor(), functools.partial(call, *args)
        )

    def submit(self, call: Callable[..., None], *args: Any) -> None:
        """Run `call(*args)` on a send thread without waiting for it (a commit hook)."""
        self._executor().submit(call, *args).add_done_callback(_log_failure)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(self._size, thread_name_prefix="questpie-send")
                self._pid = os.getpid()
            return self._pool


def _log_failure(done: Future[None]) -> None:
    # send_committed logs and leaves to the relay what it could not send; anything else
    # escaping it is a bug worth a traceback, not a silent thread.
    if not done.cancelled() and done.exception() is not None:
        log.error("sending committed dispatches failed", exc_info=done.exception())


class AsyncPublisher:
    """`Publisher`'s decisions, awaited."""

    def __init__(
        self,
        publisher: Publisher,
        ledger: AsyncLedger,
        outbox: Outbox,
        sender: Sender,
        sends: SendThreads,
    ) -> None:
        self._publisher = publisher
        self._ledger = ledger
        self._outbox = outbox
        self._sender = sender
        self._sends = sends

    async def publish(
        self,
        definition: JobDefinition[Any],
        payload: Any,
        options: DispatchOptions,
        *,
        session: object = None,
        connection: object = None,
    ) -> str | None:
        if session is not None or connection is not None:
            return await self._in_transaction(
                functools.partial(self._publisher.publish, definition, payload, options),
                definition,
                session,
                connection,
            )
        if self._sender.eager:
            # Eager mode runs the handler inline, which may block: a thread of its own.
            return await asyncio.to_thread(self._publisher.publish, definition, payload, options)
        with telemetry.span("questpie.publish", job=definition.name) as span:
            dispatch_id = await self._publish(definition, payload, options, span)
            span.set(dispatch_id=dispatch_id, outcome="accepted" if dispatch_id else "suppressed")
            return dispatch_id

    async def publish_many(
        self,
        definition: JobDefinition[Any],
        payloads: Sequence[Any],
        options: Sequence[DispatchOptions],
        *,
        session: object = None,
        connection: object = None,
    ) -> list[str | None]:
        if session is not None or connection is not None:
            return await self._in_transaction(
                functools.partial(self._publisher.publish_many, definition, payloads, options),
                definition,
                session,
                connection,
            )
        if self._sender.eager or not options:
            return await asyncio.to_thread(
                self._publisher.publish_many, definition, payloads, options
            )
        with telemetry.span(
            "questpie.publish_many", job=definition.name, count=len(payloads)
        ) as span:
            ids = await self._publish_many(definition, payloads, options, span)
            span.set(accepted=sum(dispatch_id is not None for dispatch_id in ids))
            return ids

    async def _publish(
        self,
        definition: JobDefinition[Any],
        payload: Any,
        options: DispatchOptions,
        span: telemetry.Span,
    ) -> str | None:
        publisher = self._publisher
        keyring = publisher.keyring_for(options)
        body = definition.to_json(payload)
        policy = await self._policy(definition, [options], span)
        route = publisher.route(definition.name, body, options, policy, keyring, None, None)
        if route.new is None:
            await self._sends.run(
                publisher.send_unledgered, definition.name, route.dispatch_id, body, options
            )
            return route.dispatch_id
        new = route.new
        if not await self._ledger.insert(new):
            known = publisher.needs_existence_check(new) and await self._ledger.exists(new.id)
            return publisher.not_inserted(new, known)
        if route.first.publisher_sends:
            await self._sends.run(functools.partial(self._outbox.send, new, attempt=1))
        return new.id

    async def _publish_many(
        self,
        definition: JobDefinition[Any],
        payloads: Sequence[Any],
        options: Sequence[DispatchOptions],
        span: telemetry.Span,
    ) -> list[str | None]:
        publisher = self._publisher
        keyring, bodies = publisher.validate_many(definition, payloads, options)
        policy = await self._policy(definition, options, span)
        ids: list[str | None] = []
        for chunk in publisher.chunks(
            definition.name, bodies, options, policy, keyring, None, None
        ):
            inserted = await self._ledger.insert_many(chunk.rows)
            contested = chunk.contested(inserted)
            known = await self._ledger.existing(contested) if contested else set()
            to_send = publisher.settle(chunk, inserted, known)
            if chunk.first.publisher_sends and to_send:
                await self._sends.run(self._outbox.send_many, list(to_send.values()))
            if chunk.plain:
                await self._sends.run(publisher.send_plain, definition.name, chunk.plain)
            ids += chunk.ids
        return ids

    async def _policy(
        self,
        definition: JobDefinition[Any],
        options: Sequence[DispatchOptions],
        span: telemetry.Span,
    ) -> QueuePolicy:
        """The job's policy; read from (or recorded in) the ledger in a thread, once per
        cache period, and from memory otherwise."""
        if self._publisher.policy_is_cached(definition):
            return self._publisher.policy(definition, options, span)
        return await asyncio.to_thread(self._publisher.policy, definition, options, span)

    async def _in_transaction(
        self,
        publish: Callable[..., T],
        definition: JobDefinition[Any],
        session: object,
        connection: object,
    ) -> T:
        """Run the sync publish inside the caller's async transaction."""
        if session is not None and connection is not None:
            raise PublishOptionsError("pass session or connection, not both")
        if session is not None and not isinstance(session, AsyncSession):
            raise PublishOptionsError(
                "apublish's session must be a sqlalchemy.ext.asyncio.AsyncSession "
                "(a sync Session goes to publish())"
            )
        if connection is not None and not isinstance(connection, AsyncConnection):
            raise PublishOptionsError(
                "apublish's connection must be a sqlalchemy.ext.asyncio.AsyncConnection "
                "(a sync Connection goes to publish())"
            )
        # What the sync path would read from the ledger on the loop, read in a thread
        # first: the job's policy (read, never recorded here) and the ledger's identity.
        if not self._publisher.policy_is_cached(definition):
            await asyncio.to_thread(self._publisher.read_policy, definition)
        await self._ledger.know_identity()
        if isinstance(session, AsyncSession):
            session.sync_session.info[ASYNC_SEND] = self._send_committed

            def in_session(sync_session: Session) -> T:
                return publish(session=sync_session)

            return await session.run_sync(in_session)
        assert isinstance(connection, AsyncConnection)

        def in_connection(sync_connection: Connection) -> T:
            return publish(connection=sync_connection)

        return await connection.run_sync(in_connection)

    def _send_committed(self, dispatch_ids: Sequence[str]) -> None:
        self._sends.submit(self._outbox.send_committed, list(dispatch_ids))
