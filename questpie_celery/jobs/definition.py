"""Job definitions: a handler, the pydantic schema of its payload, and its options."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import re
import weakref
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, get_args

from celery import Celery, current_app
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python
from typing_extensions import TypeVar as DefaultedTypeVar

from ..errors import JobDefinitionError, PayloadValidationError, PublishOptionsError
from .keywords import JobOptions
from .limits import Limits
from .options import validate_job_options

P = TypeVar("P", bound=BaseModel)
T = TypeVar("T")
#: The type of `ctx.app`: what `Questpie(context=...)` builds for each run. Its default
#: makes a bare `JobContext` mean `JobContext[None]`, as it was before there was an `app`.
#: Covariant: a context is read-only, so `JobContext[Sub]` may stand for `JobContext[Base]`.
AppT_co = DefaultedTypeVar("AppT_co", default=None, covariant=True)

JOB_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
_NON_ALNUM = re.compile(r"[^A-Za-z0-9]+")


@dataclass(frozen=True)
class JobContext(Generic[AppT_co]):
    """What a handler learns about the run it is part of.

    Annotate a handler's `ctx` as `JobContext[AppServices]` to have `ctx.app` typed as
    what your `Questpie(context=...)` factory builds; a bare `JobContext` types it as None.
    """

    dispatch_id: str
    job_name: str
    idempotency_key: str | None
    attempt: int
    """1 on the first run, 2 on the first retry, ..."""
    retry_limit: int
    singleton_key: str | None = None
    # None is right only for JobContext[None], which is what a context built without a
    # factory is; with one, the run sets `app` to what the factory built.
    app: AppT_co = None  # type: ignore[assignment]
    """What `Questpie(context=...)` built for this run; None without a factory."""
    fencing_token: int = 0
    """Grows with every claim of the dispatch: a run started later has a larger one.
    Hand it to a store you control with each write, and have the store refuse a write
    with a smaller token than one it has seen, so that a run which stood still past its
    lease and woke beside its retry cannot write over the retry. 0 for a run the ledger
    does not fence (an unkeyed delivery of a `standard` job)."""
    _cancelled: Callable[[], bool] = dataclasses.field(
        default=lambda: False, repr=False, compare=False
    )

    @property
    def cancel_requested(self) -> bool:
        """Whether the dispatch was cancelled while this run goes on: it is not
        interrupted and will not be retried; a handler that polls this may stop early.
        The news comes with the lease's renewals, every third of a lease."""
        return self._cancelled()


#: What `@job` accepts: the handler's `ctx` may be a bare `JobContext` or one typed with
#: its application services (`JobContext[AppServices]`); the factory, not the decorator,
#: decides what `ctx.app` holds at run time.
HandlerContext = JobContext[Any]

Handler = Callable[[P, HandlerContext], Any] | Callable[[P, HandlerContext], Awaitable[Any]]


class JobDefinition(Generic[P]):
    """A named handler with a payload schema. Create one with `@job(...)`."""

    def __init__(
        self,
        *,
        name: str,
        schema: type[P],
        handler: Callable[[P, HandlerContext], Any],
        options: JobOptions | None = None,
    ) -> None:
        if not isinstance(name, str) or not JOB_NAME_PATTERN.fullmatch(name):
            raise JobDefinitionError(f"job name {name!r} must match {JOB_NAME_PATTERN.pattern}")
        if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
            raise JobDefinitionError(f"job {name!r}: schema must be a pydantic BaseModel subclass")
        if not callable(handler):
            raise JobDefinitionError(f"job {name!r}: handler must be callable")
        _check_signature(name, handler)
        try:
            validated = validate_job_options(options)
        except PublishOptionsError as exc:
            raise JobDefinitionError(f"job {name!r}: {exc}") from None
        if "cron" in validated and _has_secret_fields(schema):
            raise JobDefinitionError(
                f"job {name!r}: options.cron stores its payload in the ledger as it is, and "
                "the schema has secret fields"
            )
        if "cron" in validated:
            # A fixed schedule fires with the payload {}: refuse it now, not at 6 a.m.
            try:
                schema.model_validate({})
            except ValidationError as exc:
                fields = ", ".join(
                    f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['type']}" for e in exc.errors()
                )
                raise JobDefinitionError(
                    f"job {name!r}: options.cron fires with the payload {{}}, which "
                    f"{schema.__name__} rejects ({fields})"
                ) from None
        self.name = name
        self.schema: type[P] = schema
        self.handler = handler
        self.options: JobOptions = validated
        #: Its `concurrency_limit` and `rate_limit`, enforced by the ledger's claim.
        self.limits = Limits.of(validated)
        #: Also true for a callable object whose `__call__` is `async def`: its call
        #: returns a coroutine that must be run, not dropped.
        self.is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            type(handler).__call__
        )
        self._has_secret_fields = _has_secret_fields(schema)
        #: A failed run is retried while retries are left (a job's); False for an adopted
        #: Celery task, which is retried only when it asks (`RetryIn`), as in Celery.
        self.retries_failures = True
        #: The keys of one call, from its payload, for a plain delivery the worker takes
        #: into the ledger (an adopted task's `singleton_key` and `group_key` templates);
        #: a job's keys are its declared options.
        self.call_keys: Callable[[Any], Mapping[str, str | None]] | None = None
        #: How a completed run's return value is kept in the ledger: JSON for a job; an
        #: adopted task's own serializer (see `canvas/results.py`).
        self.result_serializer = "json"
        #: The Celery apps whose `Questpie` made this job's task (see `task`).
        self._apps: weakref.WeakSet[Celery] = weakref.WeakSet()

    @property
    def task(self) -> Any:
        """The Celery task this job compiles to, for a plain Celery call: `.delay(...)`,
        `.apply_async(...)`, `.s(...)` and Canvas (unledgered for a standard job; see
        docs/dispatching.md, "Calling the task directly").

        It is the task on the Celery app whose `Questpie` registered the job. A job no
        `Questpie` registered yet is looked up on Celery's current app, finalizing it
        (which registers the `@job`s that autodiscovery declared), as `shared_task` does.
        """
        return self._task()

    def _task(self) -> Any:
        if not self._apps:
            _ = current_app.tasks  # finalizes it: its Questpie adopts this job
        apps = list(self._apps)
        if len(apps) == 1:
            return apps[0].tasks[self.name]
        usage = f"questpie.queue.{self.attribute_name}.task"
        if not apps:
            raise _NoTask(
                f"job {self.name!r} has no Celery task yet: no Questpie registered it (use "
                f"Questpie(..., jobs=[...]) or questpie.register(...), then {usage})"
            )
        raise _NoTask(
            f"job {self.name!r} is registered with {len(apps)} Celery apps, so it has as many "
            f"tasks: use {usage} of the Questpie you mean"
        )

    def compiled_on(self, app: Celery) -> None:
        """Record that `app` now has this job's task (called by `Questpie.register`)."""
        self._apps.add(app)

    def __getattr__(self, attribute: str) -> Any:
        if attribute == "task":
            # `task` raised an AttributeError (`_NoTask`): Python asks here next, and its
            # message, saying which task to use, is the one to raise.
            return self._task()
        if attribute in _TASK_ATTRIBUTES:
            handler = getattr(self.handler, "__name__", "handler")
            raise AttributeError(
                f"{handler} is the definition of job {self.name!r}, not its Celery task: "
                f"{handler}.task.{attribute}(...) is a plain Celery call (unledgered for a "
                f"standard job), questpie.queue.{self.attribute_name}.publish(...) dispatches "
                "it with keys, policies and the ledger",
                name=attribute,
                obj=self,
            )
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {attribute!r}",
            name=attribute,
            obj=self,
        )

    @property
    def has_secret_fields(self) -> bool:
        """Whether the schema holds pydantic `Secret*` values anywhere."""
        return self._has_secret_fields

    @property
    def attribute_name(self) -> str:
        """The name under which `questpie.queue` exposes this job."""
        return job_attribute_name(self.name)

    def validate(self, payload: P | Mapping[str, Any]) -> P:
        """Return the payload as a schema instance, or raise `PayloadValidationError`.

        The error names the failing fields and error types and never repeats an input
        value (the payload may be secret, and error messages travel to logs); it is
        raised outside the `except` block, so it chains nothing that holds them either.
        """
        if isinstance(payload, self.schema):
            # Re-validate so an instance built with model_construct() is checked too.
            payload = _jsonable(payload.model_dump(by_alias=True))
        if not isinstance(payload, Mapping):
            raise PayloadValidationError(
                f"payload for job {self.name!r} must be a mapping or a "
                f"{self.schema.__name__}, got {type(payload).__name__}"
            )
        problems = None
        try:
            return self.schema.model_validate(dict(payload))
        except ValidationError as exc:
            problems = "; ".join(
                f"{_field_path(self.schema, err['loc'])}: {err['type']}"
                for err in exc.errors(include_input=False, include_url=False)
            )
        except Exception as exc:
            # A validator that raised something else: its message may quote the input.
            problems = f"a validator raised {type(exc).__name__}"
        raise PayloadValidationError(
            f"payload for job {self.name!r} does not match {self.schema.__name__}: {problems}"
        )

    def to_json(self, payload: P | Mapping[str, Any]) -> dict[str, Any]:
        """Validate and return the JSON object that crosses the broker (or gets sealed).

        Dumped by alias, so the worker's validation accepts it, and with pydantic's
        `Secret*` values unwrapped: the handler needs the value, not its mask.
        """
        model = self.validate(payload)
        if not self._has_secret_fields:  # pydantic's own JSON dump is much faster
            return model.model_dump(mode="json", by_alias=True)
        dumped = _jsonable(model.model_dump(by_alias=True))
        assert isinstance(dumped, dict)
        return dumped

    def __call__(self, payload: P, ctx: HandlerContext) -> Any:
        """Call the handler directly (useful in a project's unit tests)."""
        return self.handler(payload, ctx)

    def __repr__(self) -> str:
        return f"<JobDefinition {self.name!r} schema={self.schema.__name__}>"


#: Every definition `@job` made in this process, in order: a `Questpie` registers the ones
#: nobody registered when its Celery app is finalized (as Celery does with `shared_task`),
#: so jobs in modules that `app.autodiscover_tasks()` imports need no listing.
_declared: list[JobDefinition[Any]] = []


def job(
    *, name: str, schema: type[P], options: JobOptions | None = None
) -> Callable[[Callable[[P, HandlerContext], Any]], JobDefinition[P]]:
    """Turn `handler(payload, ctx)` into a `JobDefinition`.

    Register it with `Questpie(jobs=[...])` or `questpie.register(...)`; a definition no
    `Questpie` registered is registered when the Celery app is finalized (a worker
    starting, or the first lookup of an unknown name in `questpie.queue`).
    """

    def decorate(handler: Callable[[P, HandlerContext], Any]) -> JobDefinition[P]:
        definition = JobDefinition(name=name, schema=schema, handler=handler, options=options)
        _declared.append(definition)
        return definition

    return decorate


class _NoTask(JobDefinitionError, AttributeError):
    """A definition without one Celery task: an `AttributeError` too, so `hasattr`,
    `getattr(..., default)`, `inspect.getmembers` and `mock.create_autospec` see no
    `task` attribute instead of stopping on it."""


#: What a Celery task offers and a definition does not: `definition.delay(...)` and the
#: like say where the task is.
_TASK_ATTRIBUTES = frozenset(
    {"delay", "apply_async", "apply", "s", "si", "signature", "subtask", "retry", "AsyncResult"}
    | {"map", "starmap", "chunks"}
)


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _check_signature(name: str, handler: Callable[..., Any]) -> None:
    """Refuse a handler that cannot be called as `handler(payload, ctx)`: it would be
    accepted here and fail at every run."""
    try:
        # What is called is the handler itself: a functools.wraps wrapper of its own
        # signature (one adapting a payload-only function, say) takes what it says.
        signature = inspect.signature(handler, follow_wrapped=False)
        if all(p.kind in _VARIADIC for p in signature.parameters.values()):
            # A wrapper taking anything hands it on: what it wraps must take it.
            signature = inspect.signature(handler)
    except (TypeError, ValueError):
        return  # some builtins have none to read: their call will tell
    try:
        signature.bind(object(), object())
    except TypeError as exc:
        label = getattr(handler, "__qualname__", None) or type(handler).__name__
        raise JobDefinitionError(
            f"job {name!r}: its handler {label}{signature} cannot be called as "
            f"handler(payload, ctx) ({exc}); write it as "
            f"def {getattr(handler, '__name__', 'handler')}(payload, ctx: JobContext)"
        ) from None


def declared_jobs() -> tuple[JobDefinition[Any], ...]:
    """The definitions `@job` has made in this process so far."""
    return tuple(_declared)


def _has_secret_fields(schema: type[BaseModel], seen: frozenset[type] = frozenset()) -> bool:
    """Whether any field, however nested, may hold one of pydantic's `Secret*` values."""
    if schema in seen:
        return False
    for field in schema.model_fields.values():
        stack = [field.annotation]
        while stack:
            annotation = stack.pop()
            if isinstance(annotation, type):
                if hasattr(annotation, "get_secret_value"):
                    return True
                if issubclass(annotation, BaseModel) and _has_secret_fields(
                    annotation, seen | {schema}
                ):
                    return True
            stack.extend(get_args(annotation))
            origin = getattr(annotation, "__origin__", None)
            if origin is not None and hasattr(origin, "get_secret_value"):
                return True
    return False


def _jsonable(value: Any) -> Any:
    if hasattr(value, "get_secret_value"):  # SecretStr, SecretBytes, Secret[...]
        return _jsonable(value.get_secret_value())
    if isinstance(value, Mapping):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(item) for item in value]
    return to_jsonable_python(value)


def _field_path(schema: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """The failing field's path, naming only the schema's own fields.

    Anything else in a location (a mapping key, an extra field's name) came from the
    input, which may be secret, so it is shown as `[key]`.
    """
    parts: list[str] = []
    model: type[BaseModel] | None = schema
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
            continue
        field = _field_named(model, part) if model is not None else None
        if field is None:
            parts.append("[key]")
            model = None
            continue
        parts.append(part)
        model = _model_in(field.annotation)
    return ".".join(parts) or "<root>"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, directly or as the one model of an Optional/Union."""
    candidates = [annotation, *get_args(annotation)]
    models = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
    return models[0] if len(models) == 1 else None


def _field_named(model: type[BaseModel], name: str) -> FieldInfo | None:
    for field_name, field in model.model_fields.items():
        if name in (field_name, field.alias):
            return field
    return None


def job_attribute_name(job_name: str) -> str:
    """`send-welcome-email` -> `send_welcome_email`."""
    return _NON_ALNUM.sub("_", job_name.lower())


def call_handler(definition: JobDefinition[Any], model: Any, ctx: HandlerContext) -> Any:
    """Run the handler; an `async def` one gets an event loop of its own for the run
    (made in a thread of its own where a loop already runs in this one: eager mode
    called from a coroutine)."""
    if definition.is_async:
        if in_running_loop():
            return in_fresh_thread(lambda: asyncio.run(definition.handler(model, ctx)))
        return asyncio.run(definition.handler(model, ctx))
    return run_returned(definition.handler(model, ctx))


def run_returned(result: Any) -> Any:
    """What a sync-looking handler returned; a coroutine it returned (a plain wrapper of an
    `async def`) is run to its end here, since dropping it would record a run that did
    nothing as completed."""
    if not inspect.iscoroutine(result):
        return result
    if in_running_loop():
        return in_fresh_thread(lambda: asyncio.run(result))
    return asyncio.run(result)


def in_running_loop() -> bool:
    """Whether an event loop runs in this thread (so no other can be run here)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def in_fresh_thread(work: Callable[[], T]) -> T:
    """`work()` in a new thread, waited for: for an event loop that cannot run here."""
    with ThreadPoolExecutor(1, thread_name_prefix="questpie-run") as pool:
        return pool.submit(work).result()
