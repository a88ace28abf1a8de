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

from dataclasses import replace
from typing import Any

from celery import Celery
from celery.canvas import Signature, _chord, group
from celery.result import AsyncResult
from celery.utils import uuid

from .adopted.task import CANVAS_OPTION, Dispatch, LedgerRefused, LedgerTask
from .app import questpie_of
from .canvas.recording import ON_MEMBER_FAILURE, check_ledgered
from .errors import CanvasError
from .jobs.ids import random_dispatch_id
from .jobs.options import DispatchOptions
from .ledger.schema import OnMemberFailure

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
            check_ledgered(app, member, f"chord member {index}")
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
            for task, run in _runs(made):
                recording.members.extend(
                    task.questpie_publish_many(
                        run, session=recording.session, connection=recording.connection
                    )
                )
        results = [
            AsyncResult(dispatch_id, app=app)
            if dispatch_id is not None
            else LedgerRefused(random_dispatch_id(), app=app, task_name=task.name)
            for dispatch_id, (task, _) in zip(recording.members, made, strict=True)
        ]
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


def _member_dispatch(
    app: Celery,
    member: Signature,
    partial_args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    index: int,
    group_id: str,
    root_id: str | None,
    options: dict[str, Any],
) -> tuple[LedgerTask, Dispatch]:
    """A member's call as its dispatch, merged with the chord's arguments and options
    as Celery merges a signature's when it is applied."""
    args, merged_kwargs, merged = member._merge(
        partial_args, kwargs or {}, {**options, "group_id": group_id, "group_index": index}
    )
    if root_id is not None:
        merged["root_id"] = root_id
    merged[CANVAS_OPTION] = group_id
    task: LedgerTask = app.tasks[member.task]
    task_id = merged.pop("task_id", None)
    return task, task.questpie_dispatch(args, merged_kwargs, task_id, merged)


def _runs(made: list[tuple[LedgerTask, Dispatch]]) -> list[tuple[LedgerTask, list[Dispatch]]]:
    """The members in header order, in runs of one task and one set of options: each
    run is one `publish_many` (one statement per chunk of its rows)."""
    runs: list[tuple[LedgerTask, list[Dispatch]]] = []
    for task, dispatch in made:
        if runs and runs[-1][0] is task and _same_options(runs[-1][1][0], dispatch):
            runs[-1][1].append(dispatch)
        else:
            runs.append((task, [dispatch]))
    return runs


def _same_options(first: Dispatch, other: Dispatch) -> bool:
    """Whether `other` can share `first`'s `publish_many`: they differ in their keys,
    their ids and their calls only."""
    return _shared(first.options) == _shared(other.options)


def _shared(options: DispatchOptions) -> DispatchOptions:
    return replace(
        options, idempotency_key=None, singleton_key=None, group_key=None, dispatch_id=None
    )


def _errbacks(body: Signature) -> list[Any]:
    """The errbacks the chord runs when it fails: the body's (the chord's own are
    added to the body, as Celery adds them)."""
    found = body.options.get("link_error") or ()
    return [Signature(e, app=body.app) if isinstance(e, dict) else e for e in found]
