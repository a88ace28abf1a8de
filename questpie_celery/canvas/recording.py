"""Recording a chord or batch: its row and its members' rows in one transaction.

The members are published in a Session of the canvas's own (or the caller's, for a
batch published in the caller's transaction), each naming the canvas; the canvas row
goes in the same transaction, once the member ids are known. The members' messages
leave when it commits, as any publish in a session's do. A member whose key names a
dispatch that already exists is that dispatch: the canvas waits for its end too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from celery import Celery
from celery.canvas import Signature
from sqlalchemy import Connection
from sqlalchemy.orm import Session

from ..errors import CanvasError
from ..jobs.definition import JobDefinition
from ..jobs.options import DispatchOptions
from ..ledger import Ledger
from ..ledger.canvases import NewCanvas
from ..ledger.schema import CanvasKind, OnMemberFailure
from .completion import Completion

ON_MEMBER_FAILURE: tuple[OnMemberFailure, ...] = ("fail", "run")


class PublishMany(Protocol):
    """The publisher's `publish_many`: validated payloads of one job, one statement per
    chunk of rows that share their options."""

    def __call__(
        self,
        definition: JobDefinition[Any],
        payloads: Sequence[Any],
        options: Sequence[DispatchOptions],
        *,
        session: Session | None = None,
        connection: Connection | None = None,
    ) -> list[str | None]: ...


@dataclass
class Recording:
    """A canvas being written: where its members are published, and their ids."""

    id: str
    session: Session | None
    connection: Connection | None
    publish_many: PublishMany
    members: list[str | None] = field(default_factory=list)

    def publish(
        self,
        definition: JobDefinition[Any],
        payloads: Sequence[Any],
        options: Sequence[DispatchOptions],
    ) -> list[str | None]:
        """Publish members of one job that share their options (apart from their keys
        and ids), in the canvas's transaction, each naming the canvas; their ids, in
        order, are the canvas's next members."""
        ids = self.publish_many(
            definition,
            payloads,
            [replace(item, canvas_id=self.id) for item in options],
            session=self.session,
            connection=self.connection,
        )
        self.members.extend(ids)
        return ids


def check_ledgered(
    app: Celery, sig: Any, what: str, *, callback: bool = False, jobs: bool = False
) -> Signature:
    """`sig` as a signature of a task whose calls go through the ledger (a `LedgerTask`,
    or with `jobs`, a job's own task); anything else cannot be sent exactly once, and is
    refused before anything is written. A `callback` (a body, an errback, `on_complete`)
    is kept in the canvas row until the canvas ends, arguments included: one of a secret
    task is refused."""
    if not isinstance(sig, Signature) or type(sig) is not Signature:
        raise CanvasError(
            f"{what} must be one task's signature (task.s(...) or task.si(...)), not "
            f"{type(sig).__name__}: nested groups, chains and chords are not made durable"
        )
    task = app.tasks.get(sig.task)
    # Duck-typed: `adopted.LedgerTask` and a job's task sit above this package.
    job = jobs and isinstance(getattr(task, "questpie_definition", None), JobDefinition)
    if task is None or not (hasattr(task, "questpie_job") or job):
        raise CanvasError(
            f"{what} {sig.task!r} is not a LedgerTask: give it base=LedgerTask "
            "(@app.task(base=LedgerTask)) so that it is sent through the ledger"
        )
    if callback and (sig.options.get("secret_payload") or getattr(task, "questpie_secret", False)):
        raise CanvasError(
            f"{what} {sig.task!r} has a secret payload: a callback is kept with its "
            "arguments until its chord or batch ends, where a secret may not be; give it "
            "the secret's reference (an id) instead"
        )
    return sig


class Recorder:
    def __init__(self, ledger: Ledger, completion: Completion, publish_many: PublishMany) -> None:
        self._canvases = ledger.canvases
        self._completion = completion
        self._publish_many = publish_many

    @contextmanager
    def recording(
        self,
        canvas_id: str,
        kind: CanvasKind,
        *,
        callback: Signature | None,
        callback_id: str | None = None,
        errbacks: list[Signature] | None = None,
        on_member_failure: OnMemberFailure = "fail",
        session: Session | None = None,
        connection: Connection | None = None,
    ) -> Iterator[Recording]:
        """Write a canvas: the body publishes its members in the yielded `Recording`'s
        session or connection and appends their ids; the canvas row follows in the same
        transaction. In a transaction of its own unless the caller passes theirs."""
        if on_member_failure not in ON_MEMBER_FAILURE:
            raise CanvasError(
                f"on_member_failure must be 'fail' or 'run', not {on_member_failure!r}"
            )
        stored_callback = (
            self._completion.encode_signature(callback) if callback is not None else None
        )
        stored_errbacks = [self._completion.encode_signature(e) for e in errbacks or ()]
        own = session is None and connection is None
        with ExitStack() as stack:
            if own:
                session = stack.enter_context(self._canvases.session())
                stack.enter_context(session.begin())
            else:
                # In the caller's transaction, a savepoint: a chord refused half-way
                # leaves nothing of itself there.
                nested = session if session is not None else connection
                assert nested is not None
                stack.enter_context(nested.begin_nested())
            recording = Recording(canvas_id, session, connection, self._publish_many)
            yield recording
            refused = [i for i, member in enumerate(recording.members) if member is None]
            if kind == "chord" and refused:
                raise CanvasError(
                    f"chord member {refused[0]} was refused by its queue policy (its slot "
                    "is taken): nothing of the chord was applied"
                )
            conn = connection if connection is not None else session.connection()  # type: ignore[union-attr]
            recorded = self._canvases.record(
                NewCanvas(
                    id=canvas_id,
                    kind=kind,
                    members=recording.members,
                    on_member_failure=on_member_failure,
                    callback=stored_callback,
                    errbacks=stored_errbacks or None,
                    callback_id=callback_id,
                ),
                conn,
            )
            if not recorded:
                raise CanvasError(
                    f"a {kind} of id {canvas_id!r} was applied already (a frozen signature "
                    "applied twice): nothing of it was applied again"
                )
        if own:
            # The members' messages left with the commit. Every member may have ended
            # already (keys seen before), or there are none.
            self._completion.settle(canvas_id)
