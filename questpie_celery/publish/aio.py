"""Publishing from an event loop: `apublish`, `apublish_many`.

The same decisions as `publish/publisher.py`, in the same order, from the same code (the
planner's, `publish/planner.py`, whose chunk plan this awaits; the policy, keyring and
plain sends of `publish/publisher.py`); only the waiting differs. The ledger is awaited
(`ledger.aio`), and the broker send, which kombu only does synchronously, runs on
a few threads of our own. So the loop never waits on the broker or the database,
only on its own Python.

In a caller's `AsyncSession` or `AsyncConnection`, the sync publish (given to
`AsyncPublisher` as `publish` and `publish_many`) runs through SQLAlchemy's `run_sync`:
its statements go over the caller's async connection, inside the caller's transaction,
with the sync path's savepoint rules. Only the send after commit changes: it is handed
to the send threads, because the commit runs in the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import weakref
from collections import deque
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.orm import Session

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from .._runtime import telemetry
from .._runtime.plans import adrive
from ..errors import PublishOptionsError, QuestpieError
from ..intake.recorded_policy import PolicyBook
from ..jobs.crypto import Keyring
from ..jobs.definition import JobDefinition
from ..jobs.options import DispatchOptions, resolve_options
from ..jobs.policies import QueuePolicy
from ..ledger import NewDispatch
from ..ledger.aio import AsyncLedger
from ..send.broker import Sender
from ..send.outbox import FirstSend, Outbox
from ..send.threads import SendThreads
from . import planner
from .planner import Chunk, Route
from .publisher import (
    ASYNC_SEND,
    keyring_for,
    queue_policy,
    report,
    send_plain,
    send_unledgered,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Requests the batcher validates before it lets the loop run again, and messages per
#: pipelined send: each slice holds the loop (or the GIL) for a millisecond or two.
SLICE = 10
SEND_SLICE = 10
#: Rows per multi-row insert of gathered `apublish` calls (and of `apublish_many`).
FLUSH_SIZE = 100


@dataclass(eq=False)  # compared (and hashed) by identity: one per call
class _Wanted:
    """One `apublish` waiting for the batcher: what it asked, and where its answer goes.

    The payload is dropped once the request is prepared: the batcher's later frames
    hold many callers' requests, and none of them may show another's payload."""

    definition: JobDefinition[Any]
    payload: Any
    given: Mapping[str, Any]
    span: telemetry.Span
    trace: dict[str, str]  # the caller's trace context, for a send made in a thread
    answer: asyncio.Future[str | None]


@dataclass
class _Group:
    """Consecutive rows of one round that share what `ledger.dispatches.insert_many`
    needs shared."""

    key: tuple[Any, ...]
    first: FirstSend
    items: list[tuple[_Wanted, Route]] = field(default_factory=list)


class AsyncPublisher:
    """The planner's decisions, awaited.

    Concurrent `apublish` calls of one event loop are gathered: each call only queues
    its request and waits, and one batcher per loop validates them a few at a time
    (letting the loop run between), inserts the rows that share a statement's shape in
    one multi-row statement, and sends their messages in short pipelined batches. The
    decisions are `publish_many`'s, which are those of the same publishes made one after
    another, in the order the calls arrived.
    """

    def __init__(
        self,
        ledger: AsyncLedger,
        outbox: Outbox,
        sender: Sender,
        sends: SendThreads,
        policies: PolicyBook,
        keyring: Callable[[], Keyring],
        *,
        publish: Callable[..., str | None],
        publish_many: Callable[..., list[str | None]],
    ) -> None:
        """`publish` and `publish_many`: the sync publisher's, for the calls that take its
        path (in a caller's transaction, eager, debounced or throttled)."""
        self._ledger = ledger
        self._outbox = outbox
        self._sender = sender
        self._sends = sends
        self._policies = policies
        self._keyring = keyring  # the keyring a secret publish seals with, or why not
        # Whether sends run the task inline, asked by the planner only when it makes a row.
        self._eager = lambda: sender.eager
        self._sync_publish = publish
        self._sync_publish_many = publish_many
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Batcher] = (
            weakref.WeakKeyDictionary()
        )

    async def publish(
        self,
        definition: JobDefinition[Any],
        payload: Any,
        given: Mapping[str, Any],
        *,
        session: object = None,
        connection: object = None,
    ) -> str | None:
        """Publish one dispatch; `given` holds the call's options, not yet resolved."""
        direct = session is not None or connection is not None or self._sender.eager
        if direct or _flow_controlled(definition, given):
            options = resolve_options(definition.options, given)
            call = functools.partial(self._sync_publish, definition, payload, options)
            if session is not None or connection is not None:
                # Also in eager mode: the sync path runs the handler after the commit.
                return await self._in_transaction(call, definition, session, connection)
            # Eager mode runs the handler inline, which may block; a debounced or
            # throttled publish runs statements of its own, one by one: a thread.
            return await asyncio.to_thread(call)
        with telemetry.span("questpie.publish", job=definition.name) as span:
            loop = asyncio.get_running_loop()
            batcher = self._batchers.get(loop)
            if batcher is None:
                batcher = self._batchers[loop] = _Batcher(self)
            answer: asyncio.Future[str | None] = loop.create_future()
            batcher.add(_Wanted(definition, payload, given, span, telemetry.carrier(), answer))
            dispatch_id = await answer
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
                functools.partial(self._sync_publish_many, definition, payloads, options),
                definition,
                session,
                connection,
            )
        if self._sender.eager or not options or options[0].flow_controlled:
            return await asyncio.to_thread(self._sync_publish_many, definition, payloads, options)
        with telemetry.span(
            "questpie.publish_many", job=definition.name, count=len(payloads)
        ) as span:
            ids = await self._publish_many(definition, payloads, options, span)
            span.set(accepted=sum(dispatch_id is not None for dispatch_id in ids))
            return ids

    async def _publish_many(
        self,
        definition: JobDefinition[Any],
        payloads: Sequence[Any],
        options: Sequence[DispatchOptions],
        span: telemetry.Span,
    ) -> list[str | None]:
        keyring = keyring_for(self._keyring, options[0])
        bodies: list[dict[str, Any]] = []
        for start in range(0, len(payloads), SLICE):
            # Validated a slice at a time, letting the loop run between slices.
            bodies += planner.validate(
                definition, payloads[start : start + SLICE], first_index=start
            )
            await asyncio.sleep(0)
        policy = await self._policy(definition, options, span)
        plan = planner.Plan(definition, bodies, options, policy, keyring, self._eager)

        async def run(step: planner.Step) -> set[str] | None:
            """One step of the plan: a statement awaited, or a chunk's sends."""
            if not isinstance(step, planner.Send):
                return await self._execute(step)
            report(step.settled)
            await self._send_rows(step.settled.send)
            for plain in _slices(step.plain, SEND_SLICE):
                await self._sends.run(send_plain, self._sender, definition.name, plain)
            await asyncio.sleep(0)
            return None

        return await adrive(planner.publish(plan, FLUSH_SIZE), run)

    async def _execute(self, step: planner.Insert | planner.ReadBack) -> set[str]:
        """A plan's statement: a chunk's insert in one statement, or its read-back."""
        if isinstance(step, planner.Insert):
            return await self._ledger.insert_many(step.rows)
        return await self._ledger.existing(step.dispatch_ids)

    async def _send_rows(
        self, rows: list[NewDispatch], traces: dict[str, dict[str, str]] | None = None
    ) -> None:
        """Send first attempts in short pipelined batches: a send thread holds the GIL
        while Celery builds a batch's messages, and the loop must not wait long for it."""
        for batch in _slices(rows, SEND_SLICE):
            await self._sends.run(self._outbox.send_many, batch, traces)

    # --- the batcher's steps ------------------------------------------------------------

    async def prepare(self, wanted: _Wanted) -> Route:
        """Resolve, validate and route one request (what `publish` does before writing)."""
        definition = wanted.definition
        options = resolve_options(definition.options, wanted.given)
        keyring = keyring_for(self._keyring, options)
        body, wanted.payload = definition.to_json(wanted.payload), None
        policy = await self._policy(definition, [options], wanted.span)
        return planner.Plan(definition, [body], [options], policy, keyring, self._eager).route(0)

    async def send_plain(self, wanted: _Wanted, route: Route) -> None:
        """An unledgered dispatch, sent alone: a refusal is this call's error only."""
        assert route.plain is not None
        body, options = route.plain
        try:
            await self._sends.run(
                send_unledgered,
                self._sender,
                wanted.definition.name,
                route.dispatch_id,
                body,
                options,
                wanted.trace,  # the batcher's context is not this caller's
            )
        except BaseException as exc:
            _fail(wanted, exc)
            if not isinstance(exc, Exception):
                raise
        else:
            _answer(wanted, route.dispatch_id)

    async def flush(self, group: _Group) -> None:
        """Insert a group's rows in one statement and decide each; the sends (and the
        answers, which follow them) go on in a task of their own."""
        chunk = Chunk()
        for _, route in group.items:
            chunk.add(route)
        unknown: Exception | None = None

        async def run(step: planner.Insert | planner.ReadBack) -> set[str] | None:
            """A statement of the chunk's plan; an error reading back whether contested
            rows' keys exist leaves only those items undecided (answered None)."""
            nonlocal unknown
            if isinstance(step, planner.ReadBack):
                try:
                    return await self._execute(step)
                except Exception as exc:
                    unknown = exc
                    return None
            return await self._execute(step)

        try:
            settled = await adrive(planner.insert_chunk(chunk), run)
        except BaseException as exc:  # nothing of the group was written (or it is unknown)
            for wanted, _ in group.items:
                _fail(wanted, exc)
            if isinstance(exc, Exception):
                return
            raise
        report(settled)
        # Only the items that needed the read-back fail: the others are decided.
        undecided = set(settled.undecided)
        answers = [
            (wanted, unknown if index in undecided else chunk.ids[index])
            for index, (wanted, _) in enumerate(group.items)
        ]
        # Every row's own, empty or not: the batcher's context is not its caller's.
        traces = {route.dispatch_id: wanted.trace for wanted, route in group.items}
        spawn(self._send_then_answer(settled.send, traces, answers))

    async def _send_then_answer(
        self,
        rows: list[NewDispatch],
        traces: dict[str, dict[str, str]],
        answers: Sequence[tuple[_Wanted, str | BaseException | None]],
    ) -> None:
        try:
            await self._send_rows(rows, traces)
        except Exception as exc:
            # The rows are in the ledger: the relay sends what this did not.
            log.warning(
                "sending %d accepted dispatch(es) failed (%s); the relay sends them",
                len(rows),
                type(exc).__name__,
            )
        finally:
            for wanted, answer in answers:
                if isinstance(answer, BaseException):
                    _fail(wanted, answer)
                else:
                    _answer(wanted, answer)

    async def _policy(
        self,
        definition: JobDefinition[Any],
        options: Sequence[DispatchOptions],
        span: telemetry.Span,
    ) -> QueuePolicy:
        """The job's policy; read from (or recorded in) the ledger in a thread, once per
        cache period, and from memory otherwise."""
        if self._policies.is_cached(definition.name):
            return queue_policy(self._policies, definition, options, span)
        return await asyncio.to_thread(queue_policy, self._policies, definition, options, span)

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
        session_type, connection_type = _async_types()
        if session is not None and not isinstance(session, session_type):
            raise PublishOptionsError(
                "apublish's session must be a sqlalchemy.ext.asyncio.AsyncSession "
                "(a sync Session goes to publish())"
            )
        if connection is not None and not isinstance(connection, connection_type):
            raise PublishOptionsError(
                "apublish's connection must be a sqlalchemy.ext.asyncio.AsyncConnection "
                "(a sync Connection goes to publish())"
            )
        # What the sync path would read from the ledger on the loop, read in a thread
        # first: the job's policy (read, never recorded here) and the ledger's identity.
        if not self._policies.is_cached(definition.name):
            await asyncio.to_thread(self._policies.read, definition.name)
        await self._ledger.know_identity()
        if session is not None:
            assert isinstance(session, session_type)
            session.sync_session.info[ASYNC_SEND] = self._send_committed

            def in_session(sync_session: Session) -> T:
                return publish(session=sync_session)

            return await session.run_sync(in_session)
        assert isinstance(connection, connection_type)

        def in_connection(sync_connection: Connection) -> T:
            return publish(connection=sync_connection)

        return await connection.run_sync(in_connection)

    def _send_committed(self, dispatch_ids: Sequence[str]) -> None:
        self._sends.submit(self._outbox.send_committed, list(dispatch_ids))


class _Batcher:
    """Gathers one event loop's concurrent `apublish` calls (see `AsyncPublisher`).

    It holds no reference to its loop: a loop closed without `aclose()` must still be
    collected, with its ledger connections."""

    def __init__(self, publisher: AsyncPublisher) -> None:
        self._publisher = publisher
        self._pending: deque[_Wanted] = deque()
        self._draining = False

    def add(self, wanted: _Wanted) -> None:
        self._pending.append(wanted)
        if not self._draining:
            self._draining = True
            spawn(self._drain())

    async def _drain(self) -> None:
        """Take the waiting calls a round at a time, in the order they arrived: prepare
        them a slice at a time, then insert each run of calls that share a statement's
        shape, one run after another, so every policy decision falls in arrival order."""
        in_hand: set[_Wanted] = set()  # taken, and not yet answered or handed to a task
        try:
            while self._pending:
                groups: list[_Group] = []
                taken = 0
                while self._pending and taken < FLUSH_SIZE:
                    for _ in range(min(SLICE, len(self._pending))):
                        wanted = self._pending.popleft()
                        taken += 1
                        in_hand.add(wanted)
                        if not await self._take(wanted, groups):
                            in_hand.discard(wanted)
                    await asyncio.sleep(0)  # the loop runs between slices
                for group in groups:
                    await self._publisher.flush(group)
                    in_hand.difference_update(wanted for wanted, _ in group.items)
        except BaseException as exc:
            # Whatever stopped the batcher (the loop shutting down, say), no caller is
            # left waiting for ever.
            for wanted in (*in_hand, *self._pending):
                _fail(wanted, exc)
            self._pending.clear()
            if not isinstance(exc, Exception):
                raise
        finally:
            self._draining = False

    async def _take(self, wanted: _Wanted, groups: list[_Group]) -> bool:
        """Prepare one call; True if it joined a group, False if it is answered or sent."""
        if wanted.answer.done():  # the caller was cancelled before its turn
            return False
        try:
            route = await self._publisher.prepare(wanted)
        except BaseException as exc:  # this call's own error; nothing was written
            _fail(wanted, exc)
            if isinstance(exc, KeyboardInterrupt | SystemExit | asyncio.CancelledError):
                raise
            return False
        if route.new is None:
            spawn(self._publisher.send_plain(wanted, route))
            return False
        new = route.new
        key = (
            new.job_name,
            new.status,
            new.options,
            new.run_after,
            new.policy,
            new.secret_ciphertext is not None,
            route.first,
        )
        # Only the last group may take it: joining an earlier one would jump the queue.
        if not groups or groups[-1].key != key:
            groups.append(_Group(key, route.first))
        groups[-1].items.append((wanted, route))
        return True


#: Tasks spawned by batchers, held: the loop keeps only weak references to tasks.
_SPAWNED: set[asyncio.Task[None]] = set()


def _flow_controlled(definition: JobDefinition[Any], given: Mapping[str, Any]) -> bool:
    """Debounced or throttled, by the call's options or the job's (which it inherits)."""
    return any(
        given.get(name) is not None or name in definition.options
        for name in ("debounce_seconds", "throttle_seconds")
    )


def spawn(work: Coroutine[Any, Any, None]) -> None:
    task = asyncio.get_running_loop().create_task(work)
    _SPAWNED.add(task)
    task.add_done_callback(_SPAWNED.discard)


def _answer(wanted: _Wanted, dispatch_id: str | None) -> None:
    if not wanted.answer.done():
        wanted.answer.set_result(dispatch_id)


def _fail(wanted: _Wanted, exc: BaseException) -> None:
    """Fail one caller with an exception of its own.

    One error often fails many callers; sharing one exception object would let a caller
    see another's frames (and their payloads) in its traceback. Each gets a fresh copy
    with no cause: the package's errors are written to hold no payload, and anything
    else is named by its class only."""
    if wanted.answer.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        wanted.answer.cancel()
        return
    copy: BaseException | None = None
    if isinstance(exc, QuestpieError):
        with contextlib.suppress(Exception):
            copy = type(exc)(*exc.args)
    if copy is None:
        copy = QuestpieError(f"apublish failed: {type(exc).__name__}")
    copy.__suppress_context__ = True
    wanted.answer.set_exception(copy)


def _async_types() -> tuple[type[AsyncSession], type[AsyncConnection]]:
    """SQLAlchemy's asyncio classes, imported when first needed: they need greenlet (the
    `asyncio` extra), which a project that never publishes from asyncio does without."""
    try:
        from sqlalchemy.ext import asyncio as sa_asyncio  # noqa: PLC0415
    except ImportError:
        raise PublishOptionsError(
            "apublish(session=/connection=) takes SQLAlchemy's AsyncSession/AsyncConnection, "
            "which need greenlet: pip install 'questpie-celery[asyncio]'"
        ) from None
    return sa_asyncio.AsyncSession, sa_asyncio.AsyncConnection


def _slices(items: list[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
