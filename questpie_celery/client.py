"""The queue client: `questpie.queue.<job>.publish(...)` and `questpie.queue.get_receipt(...)`."""

from __future__ import annotations

import difflib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Unpack

from celery import Celery
from celery.canvas import Signature
from celery.utils import uuid
from pydantic import BaseModel
from sqlalchemy import Connection
from sqlalchemy.orm import Session

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from .canvas.recording import Recorder, check_ledgered
from .errors import JobDefinitionError, PublishOptionsError, UnknownJobError
from .jobs.definition import JobDefinition, P, job_attribute_name
from .jobs.ids import derive_dispatch_id, unstorable_id
from .jobs.keywords import ManyOptions, PublishOptions, unknown_option_message
from .jobs.options import DispatchOptions, resolve_many_options, resolve_options
from .ops.receipts import CanvasStatus, DispatchStatus, Receipt
from .publish.aio import AsyncPublisher
from .publish.publisher import Publisher
from .publish.schedules import REFUSED_OPTIONS, Schedules
from .worker.cancels import Cancellation

_MANY_NAMES = ManyOptions.__optional_keys__
_PUBLISH_NAMES = PublishOptions.__optional_keys__


def _known(
    method: str, options: Mapping[str, object], names: frozenset[str] = _PUBLISH_NAMES
) -> dict[str, object]:
    """`options` when each is one of `names`; else the `TypeError` Python raises for an
    unexpected keyword, naming the option meant."""
    unknown = {name: value for name, value in options.items() if name not in names}
    if unknown:
        raise TypeError(unknown_option_message(method, unknown))
    return dict(options)


_HOW_TO_REGISTER = (
    "Register a job with Questpie(..., jobs=[...]), questpie.register(definition) or "
    "@questpie.job(...); a @job in a module that app.autodiscover_tasks() finds is "
    "registered without listing"
)


class JobClient(Generic[P]):
    """What the queue client offers for one job."""

    def __init__(
        self,
        definition: JobDefinition[P],
        publisher: Publisher,
        apublisher: AsyncPublisher,
        schedules: Schedules,
        celery_app: Celery,
        cancellation: Cancellation,
        recorder: Recorder | None = None,
    ) -> None:
        self.definition = definition
        self._recorder = recorder
        self._publisher = publisher
        self._apublisher = apublisher
        self._schedules = schedules
        self._celery_app = celery_app
        self._cancellation = cancellation

    @property
    def name(self) -> str:
        return self.definition.name

    @property
    def task(self) -> Any:
        """The job's Celery task on this app, for a plain Celery call: `.delay(...)`,
        `.apply_async(...)`, `.s(...)` and Canvas (unledgered for a standard job)."""
        return self._celery_app.tasks[self.definition.name]

    def publish(
        self,
        payload: P | Mapping[str, Any],
        *,
        session: Session | None = None,
        connection: Connection | None = None,
        **options: Unpack[PublishOptions],
    ) -> str | None:
        """Enqueue one run; return its dispatch id, or None when its queue policy
        suppressed it.

        Everything is validated before anything reaches the ledger or the broker. An
        unknown keyword is a `TypeError` naming the option meant (type checkers refuse
        it too).
        """
        resolved = resolve_options(self.definition.options, _known("publish", options))
        return self._publisher.publish(
            self.definition, payload, resolved, session=session, connection=connection
        )

    async def apublish(
        self,
        payload: P | Mapping[str, Any],
        *,
        session: AsyncSession | None = None,
        connection: AsyncConnection | None = None,
        **options: Unpack[PublishOptions],
    ) -> str | None:
        """`publish()` from an event loop: the same options, validation and answer.

        The loop is never blocked on the ledger or the broker: the ledger is awaited
        (psycopg's async driver on PostgreSQL, a worker thread on SQLite) and the send
        runs on a small pool of threads. `session=` takes an `AsyncSession` (the row rides
        in its transaction and is sent after its commit) and `connection=` an
        `AsyncConnection` (the relay sends it once committed).
        """
        # Resolved by the publisher: concurrent calls are validated a few at a time.
        given = _known("apublish", options)
        return await self._apublisher.publish(
            self.definition, payload, given, session=session, connection=connection
        )

    def publish_many(
        self,
        payloads: Iterable[P | Mapping[str, Any]],
        *,
        idempotency_keys: Sequence[str | None] | None = None,
        singleton_keys: Sequence[str | None] | None = None,
        group_keys: Sequence[str | None] | None = None,
        session: Session | None = None,
        connection: Connection | None = None,
        on_complete: Signature | None = None,
        batch_id: str | None = None,
        **options: Unpack[ManyOptions],
    ) -> list[str | None]:
        """Enqueue one run per payload, as that many `publish()` calls would; return
        their dispatch ids in order, None where the queue policy suppressed one.

        `idempotency_keys`, `singleton_keys` and `group_keys`, when given, hold one entry
        (or None) per payload; every other option applies to all. Every payload and key is validated
        before anything is written, and an error names the item's index. Items go to the
        ledger a chunk at a time, one statement each, and their messages leave in one
        pipelined batch per chunk.

        `on_complete`, a signature of a `LedgerTask`, runs once after every item has
        ended (completed, failed for good or cancelled), given
        `{"batch_id", "counts", "ids"}` as its first argument; the batch is recorded
        with its items in one transaction, under `batch_id` (a fresh id when not
        given), which `queue.get_status(batch_id)` and `queue.cancel(batch_id)` take.
        """
        items, resolved = self._many_options(
            "publish_many", payloads, options, idempotency_keys, singleton_keys, group_keys
        )
        if on_complete is None:
            if batch_id is not None:
                raise PublishOptionsError("batch_id names a batch with on_complete=")
            return self._publisher.publish_many(
                self.definition, items, resolved, session=session, connection=connection
            )
        if self._recorder is None:  # pragma: no cover - every Questpie wires one
            raise PublishOptionsError("on_complete needs a Questpie's ledger")
        callback = check_ledgered(self._celery_app, on_complete, "on_complete", callback=True)
        batch = batch_id if batch_id is not None else uuid()
        if (why := unstorable_id(batch)) is not None:
            raise PublishOptionsError(f"batch_id cannot be an id: {why}")
        with self._recorder.recording(
            batch,
            "batch",
            callback=callback,
            callback_id=callback.options.get("task_id") or uuid(),
            session=session,
            connection=connection,
        ) as recording:
            return recording.publish(self.definition, items, resolved)

    async def apublish_many(
        self,
        payloads: Iterable[P | Mapping[str, Any]],
        *,
        idempotency_keys: Sequence[str | None] | None = None,
        singleton_keys: Sequence[str | None] | None = None,
        group_keys: Sequence[str | None] | None = None,
        session: AsyncSession | None = None,
        connection: AsyncConnection | None = None,
        **options: Unpack[ManyOptions],
    ) -> list[str | None]:
        """`publish_many()` from an event loop, as `apublish` is `publish()`."""
        items, resolved = self._many_options(
            "apublish_many", payloads, options, idempotency_keys, singleton_keys, group_keys
        )
        return await self._apublisher.publish_many(
            self.definition, items, resolved, session=session, connection=connection
        )

    def _many_options(
        self,
        method: str,
        payloads: Iterable[P | Mapping[str, Any]],
        options: Mapping[str, object],
        idempotency_keys: Sequence[str | None] | None,
        singleton_keys: Sequence[str | None] | None,
        group_keys: Sequence[str | None] | None,
    ) -> tuple[list[P | Mapping[str, Any]], list[DispatchOptions]]:
        singular = {"idempotency_key", "singleton_key", "group_key"} & set(options)
        if singular:
            name = sorted(singular)[0]
            raise TypeError(f"{method}() takes {name}s=[...], one entry per payload, not {name}")
        shared = _known(method, options, _MANY_NAMES)
        if isinstance(payloads, Mapping | BaseModel | str | bytes) or not isinstance(
            payloads, Iterable
        ):
            single = method.replace("_many", "")
            raise PublishOptionsError(
                f"{method} takes a list of payloads; for one payload, use {single}()"
            )
        items = list(payloads)
        resolved = resolve_many_options(
            self.definition.options,
            shared,
            idempotency_keys,
            singleton_keys,
            len(items),
            group_keys,
        )
        return items, resolved

    def schedule(
        self,
        payload: P | Mapping[str, Any],
        cron: str,
        *,
        tz: str | None = None,
        singleton_key: str | None = None,
        group_key: str | None = None,
        priority: int | None = None,
        retry_limit: int | None = None,
        retry_delay: float | None = None,
        retry_backoff: bool | None = None,
        expire_in_seconds: int | None = None,
        queue: str | None = None,
        **refused: Any,
    ) -> None:
        """Run the job on a five-field cron schedule, read in `tz` (an IANA zone name,
        UTC by default). One schedule per job: calling again replaces it, payload and
        options included. `celery beat` fires it; each tick is one dispatch.

        The payload, the cron expression, the zone and every option are validated before
        anything is written. `idempotency_key`, `start_after` and `secret_payload` are
        refused with a `PublishOptionsError` (each fire is keyed by its tick and starts
        at it); any other unknown keyword is a `TypeError`.
        """
        unknown = {k: v for k, v in refused.items() if k not in REFUSED_OPTIONS}
        if unknown:
            raise TypeError(unknown_option_message("schedule", unknown))
        self._schedules.schedule(
            self.definition,
            payload,
            cron,
            tz,
            {
                **refused,
                "singleton_key": singleton_key,
                "group_key": group_key,
                "priority": priority,
                "retry_limit": retry_limit,
                "retry_delay": retry_delay,
                "retry_backoff": retry_backoff,
                "expire_in_seconds": expire_in_seconds,
                "queue": queue,
            },
        )

    def cancel(self, *, idempotency_key: str) -> bool:
        """Cancel the job's dispatch of this idempotency key, as `queue.cancel()` does
        its id: True when it will not run again, False when it had ended already. The key
        keeps its id for good: publishing it again returns that id and runs nothing."""
        return self._cancellation.cancel(self._keyed_id(idempotency_key))

    async def acancel(self, *, idempotency_key: str) -> bool:
        """`cancel()` from an event loop, without blocking it."""
        return await self._cancellation.acancel(self._keyed_id(idempotency_key))

    def _keyed_id(self, idempotency_key: str) -> str:
        if not isinstance(idempotency_key, str) or not idempotency_key:
            raise PublishOptionsError("idempotency_key must be a non-empty str")
        return derive_dispatch_id(self.definition.name, idempotency_key)

    def unschedule(self) -> None:
        """Remove every schedule of the job. One that the job's `options={"cron": ...}`
        declares comes back when a worker or beat next starts with the job; remove the
        option to remove it for good."""
        self._schedules.unschedule(self.definition.name)

    def __repr__(self) -> str:
        return f"<JobClient {self.definition.name!r}>"


class JobRegistry:
    """The jobs registered with one `Questpie`, by name and by attribute name."""

    def __init__(self) -> None:
        self._by_name: dict[str, JobClient[Any]] = {}
        self._by_attribute: dict[str, JobClient[Any]] = {}

    def add(self, client: JobClient[Any]) -> bool:
        """Add a job's client; False if that very definition is registered already."""
        definition = client.definition
        existing = self._by_name.get(definition.name)
        if existing is not None and existing.definition is definition:
            return False
        if existing is not None:
            raise JobDefinitionError(f"job {definition.name!r} is registered twice")
        attribute = definition.attribute_name
        clash = self._by_attribute.get(attribute)
        if clash is not None:
            raise JobDefinitionError(
                f"jobs {clash.name!r} and {definition.name!r} would both be queue.{attribute}"
            )
        self._by_name[definition.name] = client
        self._by_attribute[attribute] = client
        return True

    def by_name(self, job_name: str) -> JobClient[Any] | None:
        return self._by_name.get(job_name)

    def by_attribute(self, attribute: str) -> JobClient[Any] | None:
        return self._by_attribute.get(attribute)

    def attributes(self) -> list[str]:
        return sorted(self._by_attribute)

    def definitions(self) -> dict[str, JobDefinition[Any]]:
        return {name: client.definition for name, client in self._by_name.items()}

    def known(self) -> str:
        return ", ".join(sorted(self._by_name)) or "(none)"

    def suggest(self, asked: str) -> str:
        """What to write instead of an unknown job name or attribute, then the known jobs:
        the job whose handler has that name (`queue.<function name>` is the usual slip),
        else the job whose name or attribute is closest."""
        clients = list(self._by_name.values())
        meant: JobClient[Any] | None
        handler_of = [c for c in clients if getattr(c.definition.handler, "__name__", "") == asked]
        if handler_of:
            meant, why = handler_of[0], f"{asked} is the handler of job {handler_of[0].name!r}; "
        else:
            spellings = {**self._by_attribute, **self._by_name}
            close = difflib.get_close_matches(asked, spellings, n=1) or difflib.get_close_matches(
                job_attribute_name(asked), self._by_attribute, n=1
            )
            meant = spellings[close[0]] if close else None
            why = f"did you mean job {meant.name!r}? " if meant is not None else ""
        known = f"Known jobs: {self.known()}. "
        if meant is None:
            return known
        attribute, name = meant.definition.attribute_name, meant.name
        return f'{why}Write questpie.queue.{attribute} or questpie.queue["{name}"]. {known}'


@dataclass(frozen=True)
class Lookups:
    """How the queue client reads one dispatch, blocking and awaited."""

    receipt: Callable[[str], Receipt | None]
    status: Callable[[str], DispatchStatus | CanvasStatus | None]
    areceipt: Callable[[str], Awaitable[Receipt | None]]
    astatus: Callable[[str], Awaitable[DispatchStatus | CanvasStatus | None]]


class QueueClient:
    """`questpie.queue`: one `JobClient` per registered job, by attribute or by name."""

    def __init__(
        self,
        registry: JobRegistry,
        lookups: Lookups,
        discover: Callable[[], None],
        cancellation: Cancellation,
    ) -> None:
        self._registry = registry
        self._lookups = lookups
        self._cancellation = cancellation
        self._discover = discover  # registers jobs declared but not yet registered

    def __getattr__(self, attribute: str) -> JobClient[Any]:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        client = self._registry.by_attribute(attribute)
        if client is None:
            self._discover()
            client = self._registry.by_attribute(attribute)
        if client is None:
            raise AttributeError(
                f"no job is registered as queue.{attribute}; "
                f"{self._registry.suggest(attribute)}{_HOW_TO_REGISTER}",
                name=attribute,
                obj=self,
            )
        return client

    def __getitem__(self, job_name: str) -> JobClient[Any]:
        client = self._registry.by_name(job_name)
        if client is None:
            self._discover()
            client = self._registry.by_name(job_name)
        if client is None:
            raise UnknownJobError(
                f"no job named {job_name!r} is registered; "
                f"{self._registry.suggest(job_name)}{_HOW_TO_REGISTER}"
            )
        return client

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._registry.attributes()})

    def get_receipt(self, dispatch_id: str) -> Receipt | None:
        """The receipt of a secret dispatch, or None for anything else."""
        return self._lookups.receipt(dispatch_id)

    async def aget_receipt(self, dispatch_id: str) -> Receipt | None:
        """`get_receipt()` from an event loop, without blocking it."""
        return await self._lookups.areceipt(dispatch_id)

    def get_status(self, dispatch_id: str) -> DispatchStatus | CanvasStatus | None:
        """Where a ledgered dispatch stands, or None for an unknown id (and for an
        unledgered dispatch, which has no row). Holds no payload. A chord's id (its
        header's group id) or a batch's answers a `CanvasStatus`, as does the body of
        a chord still open (it has no dispatch until its members have ended)."""
        return self._lookups.status(dispatch_id)

    async def aget_status(self, dispatch_id: str) -> DispatchStatus | CanvasStatus | None:
        """`get_status()` from an event loop, without blocking it."""
        return await self._lookups.astatus(dispatch_id)

    def cancel(self, dispatch_id: str) -> bool:
        """Cancel a ledgered dispatch, for every worker at once (also one that is down
        now and starts later): one that has not started never runs (its slot is freed and
        a secret's key erased); one that runs goes on, is not retried, sees
        `ctx.cancel_requested`, and ends as `cancelled`. True when it will not run again,
        False when it had ended already (nothing changed). `UnknownDispatchError` (a
        `KeyError`) for an id the ledger has no row of."""
        return self._cancellation.cancel(dispatch_id)

    async def acancel(self, dispatch_id: str) -> bool:
        """`cancel()` from an event loop, without blocking it."""
        return await self._cancellation.acancel(dispatch_id)
