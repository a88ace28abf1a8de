"""`Questpie`: binds job definitions, a Celery app and a dispatch ledger together."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from celery import Celery
from sqlalchemy import Engine

from .broker import Sender, configure_app, visibility_timeout
from .client import JobClient, QueueClient
from .crypto import MIN_SECRET_BYTES, Keyring
from .dispatch import Dispatcher
from .errors import ConfigurationError, JobDefinitionError, PublishOptionsError
from .forking import reset_in_child
from .jobs import JobContext, JobDefinition, P, job
from .leases import LeaseKeeper
from .ledger import DEFAULT_REDELIVER_AFTER_SECONDS, Ledger, create_ledger_engine
from .options import JobOptions
from .policies import PolicyBook
from .receipts import Receipt, receipt_status
from .relay import DEFAULT_RELAY_INTERVAL_SECONDS, Relay, RelayStep
from .slots import SlotKeeper
from .worker import Runner

log = logging.getLogger(__name__)

DEFAULT_LEASE_SECONDS = 60.0


class Questpie:
    """The questpie side of one Celery app.

    Pass exactly one of `ledger_url` (a SQLAlchemy URL: `postgresql+psycopg://...`
    or `sqlite:///path`) and `engine`. Registering a job creates the Celery task
    named after it on `celery_app`, so `celery -A proj worker` runs it.
    """

    def __init__(
        self,
        celery_app: Celery,
        *,
        ledger_url: str | None = None,
        engine: Engine | None = None,
        secret: str | bytes | None = None,
        previous_secrets: Iterable[str | bytes] = (),
        jobs: Iterable[JobDefinition[Any]] = (),
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        relay_interval: float = DEFAULT_RELAY_INTERVAL_SECONDS,
        redeliver_after: float = DEFAULT_REDELIVER_AFTER_SECONDS,
    ) -> None:
        if not isinstance(celery_app, Celery):
            raise ConfigurationError("celery_app must be a celery.Celery application")
        if (ledger_url is None) == (engine is None):
            raise ConfigurationError("pass exactly one of ledger_url= and engine=")
        if engine is not None and not isinstance(engine, Engine):
            raise ConfigurationError("engine must be a sqlalchemy.Engine")
        lease_seconds = _positive_seconds(lease_seconds, "lease_seconds")
        relay_interval = _positive_seconds(relay_interval, "relay_interval")
        self._redeliver_after = _positive_seconds(redeliver_after, "redeliver_after")
        current = _as_secret(secret, "secret")
        previous = tuple(
            s for s in (_as_secret(p, "previous_secrets") for p in previous_secrets) if s
        )
        # A secret shorter than 32 bytes is kept out of the keyring: secret publishes then
        # fail with a clear error, and nothing is ever sealed under a weak key.
        self.keyring = (
            Keyring(current, tuple(p for p in previous if len(p) >= MIN_SECRET_BYTES))
            if current is not None and len(current) >= MIN_SECRET_BYTES
            else None
        )

        self.celery_app = celery_app
        self.engine = engine if engine is not None else create_ledger_engine(str(ledger_url))
        self.ledger = Ledger(self.engine, redeliver_after=self._redeliver_after)
        self.sender = Sender(celery_app)
        self.dispatcher = Dispatcher(self.ledger, self.sender)
        self.policies = PolicyBook(self.ledger)
        slots = SlotKeeper(self.ledger, self.dispatcher)
        leases = LeaseKeeper(self.ledger, lease_seconds)
        self.runner = Runner(self.ledger, leases, slots, self.keyring)
        self.relay = Relay(self.ledger, self.dispatcher, slots, relay_interval)
        self.queue = QueueClient(self)
        self._definitions: dict[str, JobDefinition[Any]] = {}
        self._clients_by_name: dict[str, JobClient[Any]] = {}
        self._clients_by_attribute: dict[str, JobClient[Any]] = {}
        self.tasks: dict[str, Any] = {}

        if celery_app.configured:
            self._configure()
        else:
            celery_app.on_after_configure.connect(self._on_configure, weak=False)
        # Pooled connections must not be shared across fork (SPEC section 10): a prefork
        # child, a gunicorn worker or a multiprocessing child each opens its own.
        reset_in_child(self._after_fork)
        celery_app.steps["worker"].add(type("QuestpieRelayStep", (RelayStep,), {"questpie": self}))
        self.register(*jobs)

    # registration

    def register(self, *definitions: JobDefinition[Any]) -> None:
        """Register job definitions, creating a Celery task for each."""
        for definition in definitions:
            if not isinstance(definition, JobDefinition):
                raise JobDefinitionError(
                    f"expected a JobDefinition (made with @job), got {type(definition).__name__}"
                )
            existing = self._definitions.get(definition.name)
            if existing is definition:
                continue
            if existing is not None:
                raise JobDefinitionError(f"job {definition.name!r} is registered twice")
            attribute = definition.attribute_name
            clash = self._clients_by_attribute.get(attribute)
            if clash is not None:
                raise JobDefinitionError(
                    f"jobs {clash.name!r} and {definition.name!r} would both be queue.{attribute}"
                )
            client: JobClient[Any] = JobClient(definition, self)
            self._definitions[definition.name] = definition
            self._clients_by_name[definition.name] = client
            self._clients_by_attribute[attribute] = client
            self.tasks[definition.name] = self.runner.register(self.celery_app, definition)

    def job(
        self, *, name: str, schema: type[P], options: JobOptions | None = None
    ) -> Callable[[Callable[[P, JobContext], Any]], JobDefinition[P]]:
        """Like `@job`, and registers the definition with this `Questpie`."""
        make = job(name=name, schema=schema, options=options)

        def decorate(handler: Callable[[P, JobContext], Any]) -> JobDefinition[P]:
            definition = make(handler)
            self.register(definition)
            return definition

        return decorate

    def client(self, definition: JobDefinition[P]) -> JobClient[P]:
        """The typed client of a registered definition (`publish` checks the schema type)."""
        client = self._clients_by_name.get(definition.name)
        if client is None or client.definition is not definition:
            raise JobDefinitionError(f"job {definition.name!r} is not registered here")
        return client

    @property
    def definitions(self) -> dict[str, JobDefinition[Any]]:
        return dict(self._definitions)

    # ledger

    def migrate(self) -> int:
        """Create or upgrade the ledger schema; idempotent. Returns the schema version."""
        return self.ledger.migrate()

    def close(self) -> None:
        """Write what is still batched and release the ledger's connections.

        Call it before discarding a `Questpie` in a long-lived process (tests, scripts);
        a process that simply exits needs nothing: pending batches are written at exit.
        """
        self.dispatcher.acceptance.close()
        self.engine.dispose()

    def _receipt(self, dispatch_id: str) -> Receipt | None:
        if not isinstance(dispatch_id, str):
            return None
        row = self.ledger.get(dispatch_id)
        if row is None or not row.secret or row.idempotency_key is None:
            return None
        return Receipt(
            dispatch_id=row.id,
            job_name=row.job_name,
            idempotency_key=row.idempotency_key,
            status=receipt_status(row.status),
            created_at=row.created_at,
            queued_at=row.queued_at,
            handled_at=row.finished_at,
        )

    def keyring_for_publish(self) -> Keyring:
        """The keyring a secret publish seals with, or the reason it may not."""
        if self.keyring is None:
            raise PublishOptionsError(
                f"secret_payload needs Questpie(secret=...) of at least {MIN_SECRET_BYTES} bytes"
            )
        if _is_private_sqlite(self.engine):
            raise PublishOptionsError(
                "secret_payload needs a ledger that workers and the relay share; an "
                "in-memory SQLite ledger is private to this process, so no terminal state "
                "could ever be recorded for the dispatch"
            )
        return self.keyring

    # Celery hooks

    def _on_configure(self, sender: Any = None, **_: Any) -> None:
        self._configure()

    def _configure(self) -> None:
        configure_app(self.celery_app)
        # Redelivering sooner than the broker's own visibility timeout would only race it.
        visibility = visibility_timeout(self.celery_app)
        self.ledger.redeliver_after = timedelta(seconds=max(self._redeliver_after, visibility))

    def _after_fork(self) -> None:
        self.engine.dispose(close=False)


def _positive_seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigurationError(f"{name} must be a number of seconds > 0")
    return float(value)


def _is_private_sqlite(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite" and engine.url.database in (None, "", ":memory:")


def _as_secret(value: str | bytes | None, name: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    raise ConfigurationError(f"{name} must be str or bytes")
