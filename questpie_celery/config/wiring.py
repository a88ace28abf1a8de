"""The parts of one `Questpie`, made from its `Settings` and wired together.

From the bottom up: the ledger; the outbox (the one way a row becomes a message); slots
and outcomes (how a run waits and how an attempt ends); the fence and the worker's task;
publishing and the queue client; the relay. Each part gets only the collaborators it
uses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from celery import Celery

from ..canvas.completion import Completion
from ..canvas.recording import Recorder
from ..client import JobClient, JobRegistry, Lookups, QueueClient
from ..errors import PublishOptionsError
from ..intake.recorded_policy import PolicyBook
from ..jobs.context import AppContext
from ..jobs.crypto import MIN_SECRET_BYTES, Keyring
from ..jobs.definition import JobDefinition
from ..jobs.limits import Limits
from ..ledger import DispatchRow, Ledger, is_private_sqlite
from ..ledger.aio import AsyncLedger
from ..ops.receipts import CanvasStatus, DispatchStatus, Receipt
from ..publish.aio import AsyncPublisher
from ..publish.publisher import Publisher
from ..publish.schedules import Schedules
from ..send.broker import Sender
from ..send.outbox import Outbox
from ..send.threads import SendThreads
from ..worker.admission import Admission
from ..worker.cancels import Cancellation
from ..worker.delivery_wait import DeliveryWait
from ..worker.fence import Fence
from ..worker.leases import LeaseKeeper
from ..worker.outcomes import Outcomes
from ..worker.relay import Relay
from ..worker.retention import Retention
from ..worker.slots import Slots
from ..worker.task import Runner
from .settings import Settings

V = TypeVar("V")
Reader = Callable[[str], V | None]
AsyncReader = Callable[[str], Awaitable[V | None]]


@dataclass(frozen=True)
class Parts:
    """What a `Questpie` is made of."""

    context: AppContext
    ledger: Ledger
    aledger: AsyncLedger
    sender: Sender
    outbox: Outbox
    policies: PolicyBook
    publisher: Publisher
    sends: SendThreads
    retention: Retention
    relay: Relay
    runner: Runner
    registry: JobRegistry
    schedules: Schedules
    cancellation: Cancellation
    completion: Completion
    recorder: Recorder
    queue: QueueClient
    client_for: Callable[[JobDefinition[Any]], JobClient[Any]]
    """A registered job's client (`questpie.queue.<job>`), made on the parts above."""


def wire(settings: Settings, discover: Callable[[], None]) -> Parts:
    """Make every part; `discover` registers the jobs declared but not registered yet
    (the queue client and the schedules call it for a name they do not know)."""
    celery_app = settings.celery_app
    context = AppContext(settings.context)
    engine, pooled = settings.ledger.open(relaxed=settings.relaxed, pooled=settings.pooled)
    ledger = Ledger(engine, relaxed=settings.relaxed, pooled=pooled)
    sender = Sender(celery_app)
    outbox = Outbox(ledger, sender, settings.redeliver_after)
    policies = PolicyBook(ledger)
    registry = JobRegistry()

    def limits_of(job_name: str) -> Limits | None:
        client = registry.by_name(job_name)
        return client.definition.limits if client is not None else None

    completion = Completion(ledger, celery_app)
    slots = Slots(
        ledger,
        outbox,
        limits_of,
        lambda: list(registry.definitions()),
        member_ended=completion.member_ended,
    )
    outcomes = Outcomes(ledger, outbox, slots, completion.member_ended)
    waits = DeliveryWait(ledger, sender)
    admission = Admission(ledger, waits, redeliver_after=lambda: outbox.redeliver_after)
    fence = Fence(
        ledger,
        LeaseKeeper(ledger, settings.lease_seconds),
        slots,
        outcomes,
        settings.keyring,
        context=context,
        waits=waits,
        admission=admission,
    )
    keyring = _keyring_for(settings.keyring, ledger)
    publisher = Publisher(ledger, outbox, sender, policies, keyring)
    aledger = AsyncLedger(ledger)
    sends = SendThreads()
    apublisher = AsyncPublisher(
        aledger,
        outbox,
        sender,
        sends,
        policies,
        keyring,
        publish=publisher.publish,
        publish_many=publisher.publish_many,
    )
    retention = Retention(
        ledger, settings.retention, redeliver_after=_redelivery_window(celery_app, outbox)
    )
    relay = Relay(ledger, outbox, outcomes, slots, settings.relay_interval, retention, completion)
    # A delivery the worker's main process saw end unrun goes to the relay running there.
    runner = Runner(
        fence, admission, waits, policies, context, relay.hear_unrun, outbox.sent_behind
    )

    def registered_definition(job_name: str) -> JobDefinition[Any] | None:
        client = registry.by_name(job_name)
        if client is None:
            discover()
            client = registry.by_name(job_name)
        return client.definition if client is not None else None

    schedules = Schedules(ledger, publisher, registered_definition, settings.fire_retention)
    cancellation = Cancellation(ledger, slots, completion)
    recorder = Recorder(ledger, completion, publisher.publish_many)
    return Parts(
        context=context,
        ledger=ledger,
        aledger=aledger,
        sender=sender,
        outbox=outbox,
        policies=policies,
        publisher=publisher,
        sends=sends,
        retention=retention,
        relay=relay,
        runner=runner,
        registry=registry,
        schedules=schedules,
        cancellation=cancellation,
        completion=completion,
        recorder=recorder,
        queue=QueueClient(registry, _lookups(ledger, aledger), discover, cancellation),
        client_for=lambda definition: JobClient(
            definition, publisher, apublisher, schedules, celery_app, cancellation, recorder
        ),
    )


def _lookups(ledger: Ledger, aledger: AsyncLedger) -> Lookups:
    """How the queue client reads one dispatch's receipt or status (a chord's or a
    batch's, for an id no dispatch has)."""
    dispatch_status = _reader(ledger, DispatchStatus.of)
    adispatch_status = _areader(aledger, DispatchStatus.of)

    def status(dispatch_id: str) -> DispatchStatus | CanvasStatus | None:
        return dispatch_status(dispatch_id) or CanvasStatus.of(ledger.canvases, dispatch_id)

    async def astatus(dispatch_id: str) -> DispatchStatus | CanvasStatus | None:
        found = await adispatch_status(dispatch_id)
        if found is not None:
            return found
        return await asyncio.to_thread(CanvasStatus.of, ledger.canvases, dispatch_id)

    return Lookups(_reader(ledger, Receipt.of), status, _areader(aledger, Receipt.of), astatus)


def _reader(ledger: Ledger, view: Callable[[DispatchRow | None], V | None]) -> Reader[V]:
    def read(dispatch_id: str) -> V | None:
        # The ledger answers an id no row can have (not a str, say) as an unknown one.
        return view(ledger.get(dispatch_id))

    return read


def _areader(
    aledger: AsyncLedger, view: Callable[[DispatchRow | None], V | None]
) -> AsyncReader[V]:
    async def read(dispatch_id: str) -> V | None:
        return view(await aledger.get(dispatch_id))

    return read


def _keyring_for(keyring: Keyring | None, ledger: Ledger) -> Callable[[], Keyring]:
    def keyring_for_publish() -> Keyring:
        """The keyring a secret publish seals with, or the reason it may not."""
        if keyring is None:
            raise PublishOptionsError(
                f"secret_payload needs Questpie(secret=...) of at least {MIN_SECRET_BYTES} bytes"
            )
        if is_private_sqlite(ledger.engine):
            raise PublishOptionsError(
                "secret_payload needs a ledger that workers and the relay share; an "
                "in-memory SQLite ledger is private to this process, so no terminal state "
                "could ever be recorded for the dispatch"
            )
        return keyring

    return keyring_for_publish


def _redelivery_window(celery_app: Celery, outbox: Outbox) -> Callable[[], float]:
    def redelivery_window() -> float:
        """How long after its end a message of a dispatch may still come again:
        `redeliver_after`, raised to the broker's visibility timeout by `Questpie`'s
        `_configure`. A Celery app configured lazily (`config_from_object`, as Django
        projects are) loads its settings, and so runs `_configure`, only when one is first
        read, which in a process that only prunes nothing else has done."""
        if not celery_app.configured:
            celery_app.conf.get("broker_url")  # loads them: on_after_configure
        return outbox.redeliver_after

    return redelivery_window
