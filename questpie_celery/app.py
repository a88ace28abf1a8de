"""`Questpie`: binds job definitions, a Celery app and a dispatch ledger together.

Its options are validated in `settings.py` and its parts made and wired in
`config/wiring.py`; what is here is the front: registering jobs, Celery's hooks, and the
operations a project calls.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import ModuleType
from typing import Any, Never

import click
from celery import Celery
from celery.signals import worker_init
from sqlalchemy import Engine

from ._runtime.outages import Outage
from .adopted.task import Adoption, LedgerTask, serve
from .client import JobClient
from .config.settings import DEFAULT_LEASE_SECONDS, Durability, Settings, given_ledger, period
from .config.wiring import wire
from .errors import (
    ConfigurationError,
    JobDefinitionError,
    LedgerUnavailableError,
    PublishOptionsError,
    QuestpieError,
)
from .jobs.context import ContextFactory
from .jobs.definition import HandlerContext, JobDefinition, P, declared_jobs, job
from .jobs.keywords import JobOptions
from .jobs.policies import QueuePolicy
from .ops.operations import Operator
from .publish.schedules import DEFAULT_FIRE_RETENTION_SECONDS, Schedules
from .send.broker import configure_app, use_ledger_scheduler, visibility_timeout
from .send.outbox import DEFAULT_REDELIVER_AFTER_SECONDS
from .worker.bootstep import relay_step
from .worker.relay import DEFAULT_RELAY_INTERVAL_SECONDS
from .worker.retention import DEFAULT_RETENTION_SECONDS, Pruned

log = logging.getLogger(__name__)

#: The `Questpie` of each Celery app, for the beat scheduler that `celery beat` creates.
_BY_APP: weakref.WeakKeyDictionary[Celery, Questpie] = weakref.WeakKeyDictionary()


def questpie_of(app: Celery) -> Questpie | None:
    """The `Questpie` made for `app` in this process, if any."""
    return _BY_APP.get(app)


#: Definitions some `Questpie` of this process registered (so none adopts them again).
_REGISTERED: weakref.WeakSet[JobDefinition[Any]] = weakref.WeakSet()


class Questpie:
    """The questpie side of one Celery app.

    Pass at most one of `ledger_url` (a SQLAlchemy URL: `postgresql+psycopg://...`
    or `sqlite:///path`), `engine` and `django_database` (an alias of Django's
    `DATABASES`: the ledger then lives in that database, on the connections Django
    holds; see `questpie_celery.contrib.django`). With none of them, the ledger lives in
    Django's `QUESTPIE_DATABASE` setting's database (`"default"`) when
    `questpie_celery.contrib.django` is in `INSTALLED_APPS`; otherwise it is an error.
    Registering a job creates the Celery task named after it on `celery_app`, so
    `celery -A proj worker` runs it.

    `context` is a zero-argument factory of the application's services for one run (a
    database session, an HTTP client, settings): handlers get what it builds as
    `ctx.app`. It may return a plain object, a context manager or an async context
    manager, entered before each run and exited after it (see `questpie_celery.jobs.context`).
    Without it, `ctx.app` is None. Tests swap it with `override_context(...)`.

    `pooled=True` says the PostgreSQL ledger is reached through a connection pooler in
    transaction mode (PgBouncer, RDS Proxy, Supavisor): no connection then keeps state
    from one transaction to the next, and relays poll every `relay_interval` instead of
    listening for commits (see docs/operations.md, "Behind a pooler"). On Django,
    `QUESTPIE_POOLED = True` does the same.
    """

    def __init__(
        self,
        celery_app: Celery,
        *,
        ledger_url: str | None = None,
        engine: Engine | None = None,
        django_database: str | None = None,
        secret: str | bytes | None = None,
        previous_secrets: Iterable[str | bytes] = (),
        jobs: Iterable[JobDefinition[Any]] = (),
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        relay_interval: float = DEFAULT_RELAY_INTERVAL_SECONDS,
        redeliver_after: float = DEFAULT_REDELIVER_AFTER_SECONDS,
        fire_retention: float = DEFAULT_FIRE_RETENTION_SECONDS,
        durability: Durability = "durable",
        retention: float | timedelta | None = DEFAULT_RETENTION_SECONDS,
        context: ContextFactory | None = None,
        pooled: bool = False,
    ) -> None:
        settings = self._settings = Settings.of(
            celery_app,
            ledger_url=ledger_url,
            engine=engine,
            django_database=django_database,
            secret=secret,
            previous_secrets=previous_secrets,
            jobs=jobs,
            lease_seconds=lease_seconds,
            relay_interval=relay_interval,
            redeliver_after=redeliver_after,
            fire_retention=fire_retention,
            durability=durability,
            retention=retention,
            context=context,
            pooled=pooled,
        )
        parts = wire(settings, self._discover)
        self._celery_app = celery_app
        self._context = parts.context
        self._ledger = parts.ledger
        self._aledger = parts.aledger
        self._sender = parts.sender
        self._outbox = parts.outbox
        self._policies = parts.policies
        self._publisher = parts.publisher
        self._sends = parts.sends
        self._retention = parts.retention
        self._relay = parts.relay
        self._runner = parts.runner
        self._registry = parts.registry
        self._schedules = parts.schedules
        self._cancellation = parts.cancellation
        #: Writes a chord or batch with its members (`questpie_celery.chord`).
        self.canvas_recorder = parts.recorder
        self._client_for = parts.client_for
        self._tasks: dict[str, Any] = {}
        self.queue = parts.queue
        """The queue client: `questpie.queue.<job>.publish(...)`, `get_receipt(...)`."""

        if celery_app.configured:
            self._configure()
        else:
            celery_app.on_after_configure.connect(self._on_configure, weak=False)
        celery_app.steps["worker"].add(
            relay_step(self._relay, self._record_policies, self._check_rate_limits)
        )
        # A worker finalizes its app after importing the modules autodiscovery found and
        # before its pool forks: the declared jobs become tasks in every child.
        celery_app.on_after_finalize.connect(self._on_finalize, weak=False)
        # Before the pool forks, read (and record) every job's policy: each child then
        # starts knowing them, also if the ledger goes down later.
        worker_init.connect(self._on_worker_init, weak=False)
        _BY_APP[celery_app] = self
        serve(celery_app, self._adopt)
        self.register(*settings.jobs)
        if celery_app.finalized:
            self._adopt_tasks()

    # --- registration ---------------------------------------------------------------------

    def register(self, *definitions: JobDefinition[Any]) -> None:
        """Register job definitions, creating a Celery task for each."""
        for definition in definitions:
            if not isinstance(definition, JobDefinition):
                raise JobDefinitionError(
                    f"expected a JobDefinition (made with @job), got {type(definition).__name__}"
                )
            if self._registry.add(self._client_for(definition)):
                self._tasks[definition.name] = self._runner.register(self._celery_app, definition)
                definition.compiled_on(self._celery_app)
                _REGISTERED.add(definition)

    def _on_finalize(self, sender: Any = None, **_: Any) -> None:
        self._register_declared()
        self._adopt_tasks()

    def _adopt_tasks(self) -> None:
        """Adopt the app's `LedgerTask`s that are not yet (each becomes a job of the
        ledger under its own name)."""
        for task in list(self._celery_app.tasks.values()):
            if isinstance(task, LedgerTask) and task.questpie_adoption is None:
                self._adopt(task)

    def _adopt(self, task: LedgerTask) -> None:
        definition = task.questpie_job()
        if not self._registry.add(self._client_for(definition)):
            raise JobDefinitionError(f"task {task.name!r}: a job of that name is registered")
        definition.compiled_on(self._celery_app)
        self._tasks[definition.name] = task
        task.questpie_definition = definition
        task.questpie_runner = self._runner
        task.questpie_adoption = Adoption(
            definition,
            self._runner,
            self._publisher.publish,
            self._sender.eager_result,
        )

    def _on_worker_init(self, sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not self._celery_app:
            return
        try:
            self._record_policies()
        except QuestpieError as exc:
            log.warning(
                "could not read the queue policies before the pool started (%s); deliveries "
                "of plain calls wait for the ledger until they can be read",
                exc,
            )
        self.sync_job_schedules()
        self._ledger.idle()  # as in _record_policies

    def sync_job_schedules(self) -> bool:
        """Store the schedules that registered jobs declare with `options={"cron": ...}`
        (workers and beats do this as they start). A ledger that cannot be reached is
        logged, not raised, and False returned: a beat tries again until it succeeds."""
        try:
            self._schedules.sync_job_options(self.definitions)
        except LedgerUnavailableError as exc:
            self._ledger.outage.failed(exc)  # its line tells the log, once a minute at most
            log.info("could not store the jobs' cron schedules yet (%s)", exc)
            return False
        except QuestpieError as exc:
            log.warning("could not store the jobs' cron schedules yet (%s)", exc)
            return False
        self._ledger.outage.reached()
        return True

    def _discover(self) -> None:
        """An unknown name was asked for: import the modules autodiscovery names (as a
        worker would), then register the jobs they declared."""
        if not self._register_declared():
            self._celery_app.loader.import_default_modules()
            self._register_declared()

    def _register_declared(self) -> int:
        """Register every `@job` definition no `Questpie` registered; returns how many.

        One that collides with a registered job is skipped with a warning: finalizing a
        Celery app must not fail on it.
        """
        added = 0
        for definition in declared_jobs():
            if definition in _REGISTERED:
                continue
            try:
                self.register(definition)
                added += 1
            except JobDefinitionError as exc:
                log.warning("declared job %s not registered: %s", definition.name, exc)
                _REGISTERED.add(definition)  # do not try it again
        return added

    def job(
        self, *, name: str, schema: type[P], options: JobOptions | None = None
    ) -> Callable[[Callable[[P, HandlerContext], Any]], JobDefinition[P]]:
        """Like `@job`, and registers the definition with this `Questpie`."""
        make = job(name=name, schema=schema, options=options)

        def decorate(handler: Callable[[P, HandlerContext], Any]) -> JobDefinition[P]:
            definition = make(handler)
            self.register(definition)
            return definition

        return decorate

    def client(self, definition: JobDefinition[P]) -> JobClient[P]:
        """The typed client of a registered definition (`publish` checks the schema type)."""
        client = self._registry.by_name(definition.name)
        if client is None or client.definition is not definition:
            raise JobDefinitionError(f"job {definition.name!r} is not registered here")
        return client

    @contextmanager
    def override_context(self, factory: ContextFactory | None) -> Iterator[None]:
        """Build `ctx.app` with `factory` instead, until the block ends; for tests.

        It applies to every run in this process while the block lasts (eager mode's
        inline runs, a worker started in this process), not to worker processes started
        elsewhere. `None` runs handlers without services. Blocks nest.
        """
        with self._context.override(factory):
            yield

    @property
    def celery_app(self) -> Celery:
        return self._celery_app

    @property
    def user_options(self) -> Never:
        """What `celery -A` reads first of the app it loaded: handed a `Questpie` instead
        of a Celery app, the command stops with a line saying what to write."""
        celery_spec = spelling_of(self._celery_app, near=self)
        raise CeleryAppExpected(
            f"celery -A takes your Celery app, and {spelling_of(self) or 'what it was given'} "
            f"is its Questpie: write celery -A {celery_spec or 'module:celery_app'} (or the "
            "module alone, which Celery searches). questpie-celery -A takes either."
        )

    @property
    def definitions(self) -> dict[str, JobDefinition[Any]]:
        """The registered job definitions, by job name."""
        return self._registry.definitions()

    @property
    def tasks(self) -> dict[str, Any]:
        """The Celery task of each registered job, by job name."""
        return dict(self._tasks)

    # --- the ledger -----------------------------------------------------------------------

    def migrate(self) -> int:
        """Create or upgrade the ledger schema; idempotent. Returns the schema version."""
        return self._ledger.migration.migrate()

    def rebind_ledger(
        self, *, ledger_url: str | None = None, engine: Engine | None = None
    ) -> Engine:
        """Point this `Questpie` at another ledger database; returns the engine it used
        until now, neither closed nor disposed, so it can be rebound back.

        For tests only (`questpie_celery.testing` gives each test a throwaway ledger this
        way): a project builds its `Questpie` at import time, and its jobs are bound to it.
        Every part shares one `Ledger`, rebound here; the policies read from the old
        database are forgotten, and acceptance marks batched for it are written to it
        first. Never use it in production, nor while this process runs handlers, a relay
        or publishes in another thread: those would finish against the other database.
        Other processes are not told. `durability` and `pooled` stay as configured.
        """
        one = (ledger_url is None) != (engine is None)
        source = given_ledger(ledger_url, engine) if one else None
        if source is None:
            raise ConfigurationError("pass exactly one of ledger_url= and engine=")
        new, _ = source.open(relaxed=self._ledger.relaxed, pooled=self._ledger.pooled)
        previous = self._ledger.engine
        self._outbox.flush()
        self._ledger.rebind(new)
        self._aledger.rebound()
        self._policies.forget()
        return previous

    def broker_changed(self) -> None:
        """Read the Celery app's broker settings again after they changed: the broker's
        kind (how priorities are sent) and its visibility timeout. For tests, which swap
        the broker of an app configured already; `questpie_celery.testing` calls it."""
        self._sender.forget_broker()
        self._configure()

    def _ledger_idle(self) -> None:
        """The calling thread is between units of work (for `LedgerScheduler`'s ticks)."""
        self._ledger.idle()

    @property
    def _ledger_outage(self) -> Outage:
        """Whether this process reaches the ledger (for `LedgerScheduler`'s ticks)."""
        return self._ledger.outage

    def set_policy(self, job_name: str, policy: QueuePolicy | str) -> None:
        """Record `policy` for a job on purpose; dispatches accepted from now on follow it
        here, and in every other process within `POLICY_SETTLE_SECONDS` (their caches)."""
        parsed = QueuePolicy.parse(policy)
        if parsed is None:
            raise PublishOptionsError(f"queue_policy must be one of {', '.join(QueuePolicy)}")
        self._policies.set(job_name, parsed)

    def get_policy(self, job_name: str) -> QueuePolicy | None:
        """The policy the ledger records for a job, or None when none is recorded."""
        return self._policies.recorded(job_name)

    def run_relay(
        self,
        *,
        once: bool = False,
        stop: threading.Event | None = None,
        end_lapsed_leases: bool = False,
    ) -> int:
        """Run the relay in this process: one pass (`once`), or until `stop` is set.

        A single pass cannot tell a dead worker from one cut off by an outage that just
        ended, so it ends lapsed leases only when asked to (`end_lapsed_leases`, for when
        you know their workers are gone); a running relay ends them after its grace.
        Returns how many dispatches a single pass moved on (0 when running on).
        """
        if once:
            return self._relay.run_once(end_lapsed_leases=end_lapsed_leases)
        self._relay.run_forever(stop or threading.Event())
        return 0

    @property
    def retention(self) -> float | None:
        """Seconds after which ended dispatches are deleted (unkeyed) or pruned (keyed);
        None when they are kept for ever."""
        return self._retention.period

    def prune(self, older_than: float | timedelta | None = None) -> Pruned:
        """Apply retention now, until nothing is left: delete the unkeyed dispatches and
        prune the keyed ones that ended over `older_than` seconds ago (default: this
        app's `retention`); an unkeyed one only once `redeliver_after` has passed since
        its end too, as a copy of its message may come again until then. Running relays
        do the same a little at a time."""
        if older_than is None:
            if self._retention.period is None:
                raise ConfigurationError(
                    "this app keeps ended dispatches for ever (retention=None); "
                    "pass older_than to prune anyway"
                )
            return self._retention.prune(self._retention.period)
        return self._retention.prune(period(older_than, "older_than", allow_zero=True))

    @property
    def operator(self) -> Operator:
        """An operator's view of the ledger: dispatches, show, stuck, failed, counts,
        requeue, cancel."""
        return Operator(
            self._ledger,
            redeliver_after=self._outbox.redeliver_after,
            cancellation=self._cancellation,
        )

    @property
    def schedules(self) -> Schedules:
        """The ledger's schedules: `list()` them; beat fires them (`fire_due()`)."""
        return self._schedules

    @property
    def relay_interval(self) -> float:
        return self._relay.interval

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every message this process's publishes handed over has been sent
        (or, refused by the broker, left to the relay), and write the acceptance marks
        batched so far; False if `timeout` seconds ran out first.

        `publish()` returns once the dispatch is durable in the ledger, and its message
        goes to the broker just after, from a thread of this process. A script that
        exits needs nothing (the exit waits for those sends); a test or a program that
        reads the broker itself right after publishing calls this first. That includes
        the sends an `AsyncSession`'s commit handed to the send threads.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        drained = self._sends.drain(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._outbox.flush(left) and drained

    def close(self) -> None:
        """Write what is still batched and release the ledger's connections.

        Call it before discarding a `Questpie` in a long-lived process (tests, scripts);
        a process that simply exits needs nothing: pending batches are written at exit.
        """
        self._sends.close()
        self._outbox.close()
        self._ledger.close()

    async def aclose(self) -> None:
        """`close()`, from an event loop: also closes the connections this loop's
        `apublish` calls opened (an asyncio engine's connections belong to their loop)."""
        await self._aledger.close()
        await asyncio.to_thread(self.close)

    def _check_rate_limits(self) -> None:
        """Refuse to start a worker where a job with a questpie `rate_limit` also has
        Celery's own (`task_annotations`, `task_default_rate_limit`): the two would count
        differently (Celery's per worker process, ours across every worker), and the
        slower would silently win."""
        for definition in self._registry.definitions().values():
            if definition.limits.rate is None:
                continue
            celery_limit = getattr(self._celery_app.tasks.get(definition.name), "rate_limit", None)
            if celery_limit:
                raise JobDefinitionError(
                    f"job {definition.name!r} has rate_limit={definition.options['rate_limit']!r}"
                    f", counted by the ledger across every worker, and Celery's own "
                    f"rate_limit {celery_limit!r} (per worker process, from task_annotations "
                    "or task_default_rate_limit); keep one: remove Celery's for this job"
                )

    def _record_policies(self) -> None:
        try:
            self._policies.record_all(self._registry.definitions().values())
        finally:
            # Called where no task runs (a worker's main thread, as it starts): nothing
            # else would let Django close the connection used (CONN_MAX_AGE).
            self._ledger.idle()

    # --- Celery hooks ---------------------------------------------------------------------

    def _on_configure(self, sender: Any = None, **_: Any) -> None:
        self._configure()

    def _configure(self) -> None:
        configure_app(self._celery_app)
        use_ledger_scheduler(self._celery_app)
        # Redelivering sooner than the broker's own visibility timeout would only race it.
        visibility = visibility_timeout(self._celery_app)
        self._outbox.redeliver_after = max(self._settings.redeliver_after, visibility)


class CeleryAppExpected(click.UsageError, ConfigurationError, AttributeError):
    """A Celery command was handed a `Questpie` where it takes the Celery app.

    A `click.UsageError`, so Celery's command line prints it as one `Error:` line and
    exits; an `AttributeError`, so `hasattr(questpie, "user_options")` stays False."""


def spelling_of(value: object, *, near: object = None) -> str | None:
    """`module:attribute` of an imported module's attribute that is `value` (preferring
    the module that also holds `near`), or None: for messages that say what to write."""
    found: list[tuple[bool, str]] = []
    for name, module in list(sys.modules.items()):
        if name == "__main__" or not isinstance(module, ModuleType):
            continue
        held = list(getattr(module, "__dict__", {}).items())
        for attribute, item in held:
            if item is value and not attribute.startswith("_"):
                found.append((not any(v is near for _, v in held), f"{name}:{attribute}"))
    return min(found)[1] if found else None
