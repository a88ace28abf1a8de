"""`LedgerTask`: an existing Celery task gains the ledger where it stands.

    @app.task(base=LedgerTask, ledger={"idempotency_key": "doc:{document_id}"})
    def process_document(document_id, overrides=None): ...

The task keeps its name, its signature, its serializer, its options and its result;
every call site (`delay`, `apply_async`, `.s()` in Canvas, beat) keeps working and goes
through the ledger. A call is one dispatch of the task: its arguments, serialized by the
app's own serializer, are the dispatch's payload (see `calls.py`); keys are computed
from the arguments (see `keys.py`) or given per call (`apply_async(...,
idempotency_key=...)`, `sig.set(idempotency_key=...)`).

At the worker a message of ours runs through the same fence as a job's: a delivery
whose dispatch already ran is acknowledged without running. Celery's own retries keep
their meaning: `self.retry()` and `autoretry_for` make the next attempt of the same
dispatch, up to `max_retries`, and any other exception fails the dispatch for good, as
it fails the task in Celery.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Protocol

from celery import Celery, Task, states
from celery.result import AsyncResult
from celery.signals import task_postrun
from celery.utils.time import maybe_make_aware

from ..errors import ConfigurationError, JobDefinitionError, PublishOptionsError
from ..jobs.context import RetryIn
from ..jobs.definition import JobContext, JobDefinition
from ..jobs.ids import random_dispatch_id, unstorable_id
from ..jobs.keywords import ADOPTED_CALL_OPTIONS, ADOPTED_TASK_OPTIONS, JobOptions
from ..jobs.options import (
    MAX_EXPIRE_IN_SECONDS,
    MAX_RETRY_LIMIT,
    DispatchOptions,
    resolve_options,
    validate_job_options,
)
from ..send.broker import HEADER
from ..worker.task import DeliveryRequest, Runner
from .calls import Call, canvas_options, pack, unpack
from .keys import KEY_OPTIONS, KeyTemplate

#: Celery's options kept with the dispatch for every send of it, with Celery's meaning:
#: its route, its priority (as the broker reads it), its expiry, time limits and result
#: setting, and the retry count of a call Celery's own `retry()` made (an unfenced run's).
_KEPT_OPTIONS = (
    "exchange",
    "routing_key",
    "priority",
    "soft_time_limit",
    "time_limit",
    "ignore_result",
    "retries",
)


class Publish(Protocol):
    """How an adopted task's call becomes a dispatch (the `Questpie`'s publisher)."""

    def __call__(
        self,
        definition: JobDefinition[Any],
        payload: Any,
        options: DispatchOptions,
        *,
        session: Any = None,
        connection: Any = None,
    ) -> str | None: ...


@dataclass(frozen=True)
class Adoption:
    """What a `Questpie` gave one adopted task: its job, its runner, its publisher."""

    definition: JobDefinition[Call]
    runner: Runner
    publish: Publish
    #: In eager mode, the `EagerResult` of the run a call just made inline, if it made one.
    eager_result: Callable[[str], Any]


@dataclass(frozen=True)
class Dispatch:
    """One call of an adopted task, ready to publish: its serialized call and its
    options (a chord publishes many at once, `questpie_celery.chord`)."""

    call: Call
    options: DispatchOptions


#: The `Questpie` of each Celery app, as the adopter of its `LedgerTask`s.
_ADOPTERS: weakref.WeakKeyDictionary[Celery, Callable[[LedgerTask], None]] = (
    weakref.WeakKeyDictionary()
)


def serve(app: Celery, adopter: Callable[[LedgerTask], None]) -> None:
    """Make `adopter` adopt the `LedgerTask`s of `app` (a `Questpie` does this)."""
    _ADOPTERS[app] = adopter


class LedgerRefused(AsyncResult):  # type: ignore[misc]  # celery ships no type information
    """The answer to a call its queue policy or throttle refused: nothing was sent, and
    nothing will run. `refused` is True, its `state` is `REFUSED`, and `get()` answers
    None at once; its id is one no dispatch has."""

    refused = True

    @property
    def state(self) -> str:
        return REFUSED

    status = state

    def ready(self) -> bool:
        return True

    def get(self, *args: Any, **kwargs: Any) -> None:
        return None


#: The state of a `LedgerRefused` (not one of Celery's: nothing ran, nothing is stored).
REFUSED = "REFUSED"
#: The request attribute naming the id Celery froze for a keyed Canvas member.
MIRROR = "questpie_mirror"


def _mirror(sender: Any = None, retval: Any = None, state: str | None = None, **_: Any) -> None:
    """In the process that ran it: store a keyed Canvas member's outcome under the id
    Celery froze for it too, where its group or chord reads it (the dispatch's own id
    has it already). A secret dispatch's result is None here, as under its own id."""
    if not isinstance(sender, LedgerTask) or state not in (states.SUCCESS, states.FAILURE):
        return
    request = sender.request
    frozen = getattr(request, MIRROR, None)
    if frozen is None or frozen == request.id or sender.ignore_result:
        return
    sender.backend.store_result(frozen, retval, state, request=request)


task_postrun.connect(_mirror, weak=False)


class LedgerTask(Task):  # type: ignore[misc]  # celery ships no type information
    """Base class of a Celery task whose calls go through the ledger:
    `@app.task(base=LedgerTask, ledger={...})` or `@shared_task(base=LedgerTask, ...)`.

    `ledger` takes the options a job declares (`queue_policy`, `concurrency_limit`,
    `rate_limit`, `debounce_seconds`, `debounce_max_seconds`, `throttle_seconds`,
    `expire_in_seconds`, `secret_payload`) and the keys (`idempotency_key`,
    `singleton_key`, `group_key`), each a `str.format` template over the task's
    arguments or a callable taking them. The same names are taken per call by
    `apply_async(...)` and by a signature's options (`sig.set(...)`).
    """

    #: The task's ledger options (`@app.task(base=LedgerTask, ledger={...})`).
    ledger: ClassVar[Mapping[str, Any] | None] = None
    #: Its messages carry no time limits of ours: the task's own (`soft_time_limit`,
    #: `time_limit`) hold, as Celery declares them.
    questpie_own_time_limits = True
    Request = DeliveryRequest
    #: Set when a `Questpie` adopts the task (see `Adoption`).
    questpie_adoption: Adoption | None = None
    questpie_definition: JobDefinition[Call] | None = None
    questpie_runner: Runner | None = None
    _questpie_keys: ClassVar[tuple[KeyTemplate, ...]] = ()
    _questpie_job_options: ClassVar[JobOptions] = {}
    _questpie_secret: ClassVar[bool] = False

    @property
    def questpie_secret(self) -> bool:
        """Whether its calls are secret (`secret_payload` in its ledger options)."""
        return self._questpie_secret

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Celery makes each task's class from its function: check its ledger options now,
        # so a template naming an argument the task lacks fails where it is declared.
        if "run" in cls.__dict__:
            cls._questpie_read_options()

    @classmethod
    def _questpie_read_options(cls) -> None:
        name = cls.__dict__.get("name") or cls.__name__
        options = dict(cls.ledger or {})
        unknown = sorted(set(options) - ADOPTED_TASK_OPTIONS)
        if unknown:
            raise JobDefinitionError(
                f"task {name!r}: unknown ledger option(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(ADOPTED_TASK_OPTIONS))}"
            )
        signature = _signature_of(cls.__dict__["run"])
        cls._questpie_keys = tuple(
            KeyTemplate(option, options.pop(option), signature, name)
            for option in KEY_OPTIONS
            if options.get(option) is not None
        )
        cls._questpie_secret = bool(options.pop("secret_payload", False))
        try:
            cls._questpie_job_options = validate_job_options(
                {k: v for k, v in options.items() if k not in KEY_OPTIONS}
            )
        except PublishOptionsError as exc:
            raise JobDefinitionError(f"task {name!r}: {exc}") from None

    # --- sending ------------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> AsyncResult:
        """Celery's `apply_async`, through the ledger: the answer's id is the dispatch
        id (a repeated key's is the first call's). The ledger options are taken here
        beside Celery's; `countdown`/`eta` become the dispatch's `start_after`, held in
        the ledger; custom `headers` travel on every send of the dispatch."""
        headers = options.get("headers") or {}
        if HEADER in headers:
            request = self.request
            if not (getattr(request, "questpie_unfenced", False) and task_id == request.id):
                # A send of our own: a delivery sent back to the broker as it came.
                return super().apply_async(
                    args, kwargs, task_id, producer, link, link_error, shadow, **options
                )
            # Celery's own `retry()` of a run with no ledger row: the same call again.
            headers = {name: value for name, value in headers.items() if name != HEADER}
        adoption = self._adopted()
        session, connection = options.pop("session", None), options.pop("connection", None)
        made = self.questpie_dispatch(
            args, kwargs, task_id, {**options, "link": link, "link_error": link_error}, headers
        )
        dispatch_id = adoption.publish(
            adoption.definition, made.call, made.options, session=session, connection=connection
        )
        if dispatch_id is None:
            return LedgerRefused(random_dispatch_id(), app=self.app, task_name=self.name)
        if self.app.conf.task_always_eager:
            ran = adoption.eager_result(dispatch_id)
            if ran is not None:
                return ran
        return self.AsyncResult(dispatch_id)

    def questpie_dispatch(
        self,
        args: Any,
        kwargs: Any,
        task_id: str | None,
        options: dict[str, Any],
        headers: Mapping[str, Any] | None = None,
    ) -> Dispatch:
        """One call as a dispatch: its keys rendered, its arguments and Canvas options
        serialized, Celery's options it keeps for every send, all validated. `options`
        are `apply_async`'s (Celery's and the ledger's; `link`, `link_error` among them)."""
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        given = {name: options.pop(name) for name in ADOPTED_CALL_OPTIONS if name in options}
        # A chain's link (Celery passes the links after it as `chain`, [] for the last;
        # a retry Celery makes passes None): a row under the id Celery froze for it, so a
        # link delivered twice, or sent on twice, starts the next one once.
        chain_link = options.get("chain") is not None
        for template in self._questpie_keys:
            if given.get(template.option) is None:
                given[template.option] = template.render(args, kwargs)
        if given.get("secret_payload") is None and self._questpie_secret:
            given["secret_payload"] = True
        given["start_after"] = self._start_after(options)
        queue = options.get("queue")
        given["queue"] = getattr(queue, "name", queue)
        serializer = options.get("serializer") or self.serializer or self.app.conf.task_serializer
        canvas = canvas_options(options)
        if task_id is not None and given.get("idempotency_key") is not None:
            # Celery froze this id (a group's or chord's member) and will read the result
            # there; the key names the dispatch. The run's result is stored under both.
            canvas[MIRROR] = task_id
        call = pack(args, kwargs, canvas, serializer)
        given["headers"] = (headers if headers is not None else options.get("headers")) or None
        carry = {k: options[k] for k in _KEPT_OPTIONS if options.get(k) is not None}
        expires = options.get("expires")
        if expires is not None:
            # A moment, not a span: every send of the dispatch expires at the same time.
            carry["expires"] = self._moment(expires).isoformat()
        resolved = resolve_options(self._adopted().definition.options, given)
        dispatch_id = task_id
        if resolved.idempotency_key is not None:
            dispatch_id = None  # a key names its own dispatch
        elif dispatch_id is not None and (why := unstorable_id(dispatch_id)) is not None:
            raise PublishOptionsError(f"task_id cannot be a dispatch id: {why}")
        resolved = replace(
            resolved,
            carry={**resolved.carry, **carry},
            # A frozen id (Canvas) names an unkeyed call's dispatch; a key names its own.
            dispatch_id=dispatch_id,
            chain_link=chain_link,
        )
        return Dispatch(call, resolved)

    def _moment(self, when: float | str | datetime) -> datetime:
        """A Celery time option (seconds from now, an ISO string, a datetime) in UTC."""
        if isinstance(when, int | float):
            return datetime.now(UTC) + timedelta(seconds=when)
        if isinstance(when, str):
            when = datetime.fromisoformat(when)
        aware: datetime = maybe_make_aware(when, self.app.timezone)
        return aware.astimezone(UTC)

    def _start_after(self, options: Mapping[str, Any]) -> float | datetime | None:
        countdown, eta = options.get("countdown"), options.get("eta")
        if countdown:
            return float(countdown)
        return None if eta is None else self._moment(eta)

    # --- running ------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request.called_directly:  # an in-process call: the function, as Celery
            return super().__call__(*args, **kwargs)
        adoption = self._adopted()
        request = self.request
        serializer = self.serializer or self.app.conf.task_serializer
        return adoption.runner.execute_adopted(
            self,
            args,
            kwargs,
            lambda: pack(args, kwargs, _canvas_of(request), serializer).model_dump(),
            lambda payload: self._run_call(Call.model_validate(payload), attempt=None),
        )

    def _run_call(self, call: Call, *, attempt: int | None) -> Any:
        """Run `call`, with its arguments and Canvas options on the request. `attempt`:
        the ledger fences this run, and it is that attempt of its dispatch (`self.retry()`
        is then the ledger's); None for a message of ours with no ledger row, which
        Celery's own `retry()` calls again under its id."""
        arguments = unpack(call, self.app.conf.accept_content)
        request = self.request
        for name, value in arguments.canvas.items():
            setattr(request, name, value)
        if attempt is not None:
            request.retries = attempt - 1
            request.questpie_fenced = True
        else:
            request.questpie_unfenced = True
        # The arguments are on the request while the task runs (its own code, and
        # Celery's `retry()`, read them there), and gone once it returns: what Celery
        # stores of the request afterwards (`result_extended`) is the message's own, which
        # holds nothing of a secret call.
        sent = request.args, request.kwargs
        request.args, request.kwargs = list(arguments.args), arguments.kwargs
        try:
            return self.run(*arguments.args, **arguments.kwargs)
        finally:
            request.args, request.kwargs = sent

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's `retry`; in a run the ledger fences, the next attempt of the same
        dispatch, sent by the ledger (`args` and `kwargs` are the dispatch's own: a
        retry runs the call it retries)."""
        request = self.request
        if not getattr(request, "questpie_fenced", False):
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        limit = self.max_retries if max_retries is None else max_retries
        if limit is not None and request.retries >= limit:
            if exc is not None:
                raise exc
            raise self.MaxRetriesExceededError(
                f"Can't retry {self.name}[{request.id}]: max retries ({limit}) exceeded"
            )
        if countdown is None:
            if eta is not None:
                when = maybe_make_aware(eta, self.app.timezone)
                countdown = max(0.0, (when - datetime.now(UTC)).total_seconds())
            else:
                countdown = float(self.default_retry_delay or 0)
        raise RetryIn(float(countdown), exc)

    # --- the Questpie ---------------------------------------------------------------------

    def _adopted(self) -> Adoption:
        adoption = self.questpie_adoption
        if adoption is None:
            adopter = _ADOPTERS.get(self.app)
            if adopter is None:
                _ = self.app.tasks  # finalizing the app makes its Questpie, if it has one
                adopter = _ADOPTERS.get(self.app)
            if adopter is None:
                raise ConfigurationError(
                    f"task {self.name!r} has base=LedgerTask, but no Questpie was made for its "
                    "Celery app (Questpie(app, ledger_url=...) in the module that makes the app)"
                )
            adopter(self)
            adoption = self.questpie_adoption
            assert adoption is not None
        return adoption

    def questpie_job(self) -> JobDefinition[Call]:
        """The job this task is in the ledger (its name is the task's)."""
        options: JobOptions = {
            "retry_limit": MAX_RETRY_LIMIT if self.max_retries is None else self.max_retries,
            "expire_in_seconds": int(
                min(
                    self.time_limit or self.app.conf.task_time_limit or MAX_EXPIRE_IN_SECONDS,
                    MAX_EXPIRE_IN_SECONDS,
                )
            ),
            **self._questpie_job_options,
        }
        task = self

        def handle(call: Call, ctx: JobContext[Any]) -> Any:
            return task._run_call(call, attempt=ctx.attempt)

        definition = JobDefinition(name=self.name, schema=Call, handler=handle, options=options)
        # Celery fails a task for good on any exception it was not told to retry.
        definition.retries_failures = False
        definition.call_keys = self._slot_keys
        # Its result kept as its calls are sent: pickle in a pickle project.
        definition.result_serializer = self.serializer or self.app.conf.task_serializer
        return definition

    def _slot_keys(self, payload: Any) -> dict[str, str | None]:
        """The `singleton_key` and `group_key` of a plain delivery taken into the ledger
        (a `send_task` by name), from its arguments: its policy slot and its limits' group
        are the call's, as for a call through `apply_async`. Its idempotency key is not:
        the delivery's own id names its row."""
        arguments = unpack(Call.model_validate(payload), self.app.conf.accept_content)
        return {
            template.option: template.render(arguments.args, arguments.kwargs)
            for template in self._questpie_keys
            if template.option != "idempotency_key"
        }


def _signature_of(run: Any) -> inspect.Signature:
    """The signature a call binds to: the function's, without the task (`bind=True`)."""
    function = run.__func__ if isinstance(run, staticmethod) else run
    signature = inspect.signature(function)
    if isinstance(run, staticmethod):
        return signature
    parameters = list(signature.parameters.values())[1:]  # `self`: the task
    return signature.replace(parameters=parameters)


def _canvas_of(request: Any) -> dict[str, Any]:
    """The Canvas options of the delivery being run (a plain one, taken into the ledger)."""
    found = {
        "callbacks": request.callbacks,
        "errbacks": request.errbacks,
        "chain": request.chain,
        "chord": request.chord,
        "group": request.group,
        "group_index": request.group_index,
    }
    return {name: value for name, value in found.items() if value is not None}
