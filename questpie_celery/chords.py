"""`chord`: Celery's chord, made durable when its members and its body are `LedgerTask`s.

    from questpie_celery import chord

    result = chord(process.s(i) for i in items)(summarize.s())
    result = chord(header, body, on_member_failure="run").apply_async()

It keeps Celery's API and answers (the body's `AsyncResult`, with the header's
`GroupResult` as its `parent`), and Celery's default semantics; what changes is how the
body is reached. The chord and its members are written to the ledger in one
transaction when it is applied; each member's end is recorded with its outcome, and
the end that completes the chord sends the body exactly once, through the ledger, with
the members' results in header order (see `canvas/completion.py`). Nothing polls
(`chord_unlock`), nothing counts in the result backend, and it works with no result
backend at all.

A chord whose members are all plain Celery tasks is Celery's own; one that mixes them is
refused (`CanvasError`), as is a header that nests groups, chains or chords.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from celery import Celery
from celery.canvas import Signature, _chord, group
from celery.result import AsyncResult
from celery.utils import uuid

from .app import questpie_of
from .canvas.recording import ON_MEMBER_FAILURE, check_ledgered
from .errors import CanvasError
from .jobs.definition import JobDefinition
from .jobs.options import DispatchOptions, resolve_options
from .ledger.schema import OnMemberFailure
from .worker.task import JobTask

#: Where a chord keeps its failure policy among its options (it travels with it).
_POLICY_OPTION = "questpie_on_member_failure"


class chord(_chord):  # type: ignore[misc]  # celery ships no type information
    """Celery's `chord`, with one more keyword: `on_member_failure`.

    - `"fail"` (the default, Celery's meaning): a member that fails for good (or is
      cancelled) fails the chord at once. The body does not run; each of the body's
      errbacks (`link_error`) runs once, given the failed member's id, and the body's
      result is a `ChordError` where a result backend is configured.
    - `"run"`: the body runs once every member has ended, given each failed or
      cancelled member's error in its place:
      `{"questpie_failed": {"dispatch_id": ..., "status": ..., "error": ...}}`.
    """

    def __init__(
        self,
        header: Any = None,
        body: Any = None,
        task: str = "celery.chord",
        args: Any = None,
        kwargs: Any = None,
        app: Celery | None = None,
        on_member_failure: OnMemberFailure | None = None,
        **options: Any,
    ) -> None:
        policy = on_member_failure or options.pop(_POLICY_OPTION, None) or "fail"
        if policy not in ON_MEMBER_FAILURE:
            raise CanvasError(f"on_member_failure must be 'fail' or 'run', not {policy!r}")
        super().__init__(header, body, task, args, kwargs, app=app, **options)
        self.options[_POLICY_OPTION] = policy

    def apply_async(self, *args: Any, **options: Any) -> Any:
        """Celery's `apply_async`; `session=` or `connection=` records a durable chord in
        the caller's transaction (its members are sent once it commits), as an adopted
        task's call takes them."""
        caller = options.pop("session", None), options.pop("connection", None)
        # Celery copies the options it is given, which a Session refuses: kept aside
        # for `run`, which it calls on this very signature.
        self._questpie_caller = caller
        try:
            return super().apply_async(*args, **options)
        finally:
            self._questpie_caller = (None, None)

    @property
    def on_member_failure(self) -> OnMemberFailure:
        policy: OnMemberFailure = self.options.get(_POLICY_OPTION, "fail")
        return policy

    def run(
        self,
        header: group,
        body: Signature,
        partial_args: tuple[Any, ...],
        app: Celery | None = None,
        interval: float | None = None,
        countdown: float = 1,
        max_retries: int | None = None,
        eager: bool = False,
        task_id: str | None = None,
        kwargs: dict[str, Any] | None = None,
        header_delay: dict[str, Any] | None = None,
        **options: Any,
    ) -> AsyncResult:
        app = app or self._get_app(body)
        policy = options.pop(_POLICY_OPTION, None) or self.on_member_failure
        questpie = questpie_of(app)
        members = list(header.tasks)
        ledgered = questpie is not None and any(
            hasattr(app.tasks.get(getattr(m, "task", None)), "questpie_job")
            for m in [*members, body]
        )
        if not ledgered and policy == "fail":
            return super().run(  # plain Celery tasks: Celery's own chord
                header,
                body,
                partial_args,
                app,
                interval,
                countdown,
                max_retries,
                eager,
                task_id,
                kwargs,
                header_delay,
                **options,
            )
        if questpie is None:
            raise CanvasError("a durable chord needs a Questpie made for its Celery app")
        for index, member in enumerate(members):
            check_ledgered(app, member, f"chord member {index}", jobs=True)
        check_ledgered(app, body, "the chord's body", callback=True)
        if options.get("link") or options.get("link_error"):
            body = self._add_body_callbacks(body, options)  # the chord's own, as Celery's
        errbacks = [check_ledgered(app, e, "an errback", callback=True) for e in _errbacks(body)]
        # The header's own time options delay its members, as Celery's chord does.
        for key, value in (header_delay or {}).items():
            options[key] = value
        for key in ("countdown", "eta"):
            if key not in (header_delay or {}) and self.options.get(key) is not None:
                options[key] = self.options[key]
        for key in ("chain", "chord", "task_id", "link", "link_error"):
            options.pop(key, None)

        group_id = header.options.get("task_id") or uuid()
        root_id = body.options.get("root_id")
        body_id = task_id or uuid()
        body_result = body.freeze(body_id, group_id=group_id, root_id=root_id)
        made = [
            _member_dispatch(app, member, partial_args, kwargs, index, group_id, root_id, options)
            for index, member in enumerate(members)
        ]
        session, connection = getattr(self, "_questpie_caller", (None, None))
        with questpie.canvas_recorder.recording(
            group_id,
            "chord",
            callback=body,
            callback_id=body_result.id,
            errbacks=errbacks,
            on_member_failure=policy,
            session=session,
            connection=connection,
        ) as recording:
            for definition, run in _runs(made):
                recording.publish(
                    definition,
                    [member.payload for member in run],
                    [member.options for member in run],
                )
        results = [AsyncResult(dispatch_id, app=app) for dispatch_id in recording.members]
        # `get()` waits for the body: a member's state on the way (a pool process killed
        # under it, before its retry ran) is not the chord's, as Celery's parent check
        # would take it. A chord that fails has the body's result say so (ChordError).
        body_result = _BodyResult(body_result.id, app=app)
        body_result.parent = app.GroupResult(group_id, results)
        return body_result


class _BodyResult(AsyncResult):  # type: ignore[misc]  # celery ships no type information
    """The answer of a durable chord: its body's result, whose state is the chord's."""

    def _maybe_reraise_parent_error(self) -> None:
        return None


@dataclass(frozen=True)
class _Member:
    """A member's call as the dispatch it becomes: its job, payload and options."""

    definition: JobDefinition[Any]
    payload: Any
    options: DispatchOptions


def _member_dispatch(
    app: Celery,
    member: Signature,
    partial_args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    index: int,
    group_id: str,
    root_id: str | None,
    options: dict[str, Any],
) -> _Member:
    """A member's call as its dispatch, merged with the chord's arguments and options
    as Celery merges a signature's when it is applied: an adopted task's call, or a
    job's payload (its keys given by the signature's options, `.set(idempotency_key=..)`)."""
    args, merged_kwargs, merged = member._merge(
        partial_args, kwargs or {}, {**options, "group_id": group_id, "group_index": index}
    )
    task = app.tasks[member.task]
    if isinstance(task, JobTask):
        why = task.payload_mistake(args, merged_kwargs)
        if why is not None:
            raise CanvasError(f"chord member {index} {member.task!r}: {why}")
        definition = task.questpie_definition
        keys = {name: merged[name] for name in _JOB_MEMBER_OPTIONS if merged.get(name) is not None}
        return _Member(definition, args[0], resolve_options(definition.options, keys))
    if root_id is not None:
        merged["root_id"] = root_id
    task_id = merged.pop("task_id", None)
    made = task.questpie_dispatch(args, merged_kwargs, task_id, merged)
    return _Member(task.questpie_definition, made.call, made.options)


#: What a job's task takes of a member signature's options: its keys.
_JOB_MEMBER_OPTIONS = ("idempotency_key", "singleton_key", "group_key")


def _runs(made: list[_Member]) -> list[tuple[JobDefinition[Any], list[_Member]]]:
    """The members in header order, in runs of one job and one set of options: each run
    is one `publish_many` (one statement per chunk of its rows)."""
    runs: list[tuple[JobDefinition[Any], list[_Member]]] = []
    for member in made:
        if (
            runs
            and runs[-1][0] is member.definition
            and _shared(runs[-1][1][0].options) == _shared(member.options)
        ):
            runs[-1][1].append(member)
        else:
            runs.append((member.definition, [member]))
    return runs


def _shared(options: DispatchOptions) -> DispatchOptions:
    """What members must share to be inserted by one statement: all but keys and ids."""
    return replace(
        options, idempotency_key=None, singleton_key=None, group_key=None, dispatch_id=None
    )


def _errbacks(body: Signature) -> list[Any]:
    """The errbacks the chord runs when it fails: the body's (the chord's own are
    added to the body, as Celery adds them)."""
    found = body.options.get("link_error") or ()
    return [Signature(e, app=body.app) if isinstance(e, dict) else e for e in found]
