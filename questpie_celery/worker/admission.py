"""Admission: writing a delivery's ledger row at the worker, before the fence claims it.

A plain Celery call (`delay`, `send_task`, Canvas, a beat entry) of a job whose
queue policy is not `standard` is taken into the ledger first, as a row under the
message's id, so its policy holds however it was sent. Its row is built, and a taken
slot reported, exactly as a publish's (`intake/new_rows.py`).

On a relaxed ledger, a delivery whose row a database crash lost (its commit had not
reached the disk) has its row written again from its message, so it still runs, once.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable
from typing import Any

from celery import Task
from celery.exceptions import Ignore

from ..errors import DispatchIdError, PayloadValidationError
from ..intake.new_rows import new_dispatch, report_suppressed
from ..jobs.definition import JobDefinition
from ..jobs.ids import shown_id, unstorable_id
from ..jobs.options import StoredOptions, resolve_options
from ..jobs.policies import QueuePolicy
from ..ledger import Ledger, NewDispatch
from ..send.broker import MessageHeader, carry_from_request
from ..send.outbox import FirstSend
from .delivery_wait import DeliveryWait

#: The logger these lines always had (a project's logging configuration names it): the
#: fence took deliveries in before this module did.
log = logging.getLogger("questpie_celery.fence")

#: How far a sender's clock may run ahead of the database's before a relaxed fence could
#: mistake a pruned row's late message for one whose row a crash lost.
SENDER_CLOCK_MARGIN_SECONDS = 60.0


class Admission:
    def __init__(
        self, ledger: Ledger, waits: DeliveryWait, *, redeliver_after: Callable[[], float]
    ) -> None:
        self._ledger = ledger  # `get`: whether a relaxed ledger lost the row
        self._dispatches = ledger.dispatches
        self._retention = ledger.retention
        self._waits = waits
        self._redeliver_after = redeliver_after

    def plain(
        self,
        task: Task,
        definition: JobDefinition[Any],
        policy: QueuePolicy,
        header: MessageHeader | None,
        payload: Any,
    ) -> tuple[dict[str, Any], MessageHeader]:
        """Take an unledgered delivery of a policy-limited job into the ledger: its payload
        and the header it goes back with, ready for its claim. `Ignore` when its policy
        suppressed it; `DispatchIdError` when its task id cannot be a dispatch id."""
        refused = unstorable_id(task.request.id)
        if refused is not None:
            # No row can hold it, so its policy cannot hold: refused, not run unfenced.
            # Failing it (not ignoring it) stores the error as Celery's result of the call.
            log.error(
                "a plain call of job %s has task id %s, which cannot be a dispatch id (%s); "
                "refused, not run",
                definition.name,
                shown_id(task.request.id),
                refused,
                extra={"job_name": definition.name},
            )
            raise DispatchIdError(
                f"task id {shown_id(task.request.id)} of job {definition.name!r} cannot be a "
                f"dispatch id ({refused}); the call was not run"
            )
        body = definition.to_json(payload)  # a malformed payload fails the message
        keys = definition.call_keys(payload) if definition.call_keys is not None else {}
        options = resolve_options(definition.options, keys)
        # Sent back while the ledger was away, the delivery says so (with its token), and
        # keeps its run options: it stays a plain delivery, to be taken in again.
        back = MessageHeader(
            ledgered=False,
            run=header.run if header is not None else options.run,
            token=(header.token if header is not None else None) or str(uuid.uuid4()),
        )
        new = new_dispatch(
            definition.name,
            body,
            # The delivery is here: a start the job declares was its sender's to apply.
            dataclasses.replace(options, start_after=None),
            policy,
            None,  # a plain call's payload came in the clear, and is kept as it came
            # The broker has it already; the relay looks again after the redelivery window.
            FirstSend(False, send_in=self._redeliver_after()),
            StoredOptions(
                run=back.run,
                priority=options.priority,
                queue=options.queue,
                # Its route, headers and Canvas links, so a later send keeps them.
                carry=carry_from_request(task.request),
            ),
            dispatch_id=task.request.id,
            status="queued",  # this is its delivery
        )

        def adopt() -> bool:
            return self._dispatches.insert(new) or self._dispatches.exists(new.id)

        if not self._waits.run(task, adopt, back):
            report_suppressed(new, delivery=True)
            raise Ignore()
        return body, back

    def take_back(
        self,
        task: Task,
        definition: JobDefinition[Any],
        attempt: int,
        payload: Any,
        back: MessageHeader,
        policy: Callable[[], QueuePolicy],
    ) -> bool:
        """On a relaxed ledger, write again the row of a delivery whose row a database
        crash lost (its commit had not reached the disk), so the delivery still runs,
        once: two copies of it race for the one row like any two deliveries.

        Only a dispatch the message can rebuild is taken back: a standard job's, with its
        payload in the message. A secret payload lives only in its row (and is committed
        durably for that reason); a policy job's singleton key is not in the message.
        """
        dispatch_id: str = task.request.id
        if self._ledger.get(dispatch_id) is not None:
            return False  # a row of another job under this id: not ours to take
        # Retention and the beat delete only rows that ended before the time they record
        # first, and every send of a row comes before its end: a message sent after that
        # time cannot be a deleted row's. (With a margin for the sender's clock.)
        pruned_before = self._retention.pruned_before()
        if back.sent_at is None or (
            pruned_before is not None
            and back.sent_at - SENDER_CLOCK_MARGIN_SECONDS <= pruned_before.timestamp()
        ):
            return _not_taken_back(
                dispatch_id,
                definition.name,
                "its message may be older than rows the ledger has pruned (it may have run "
                "and been deleted)",
            )
        if payload is None or definition.limits.active or policy().ledgered:
            return _not_taken_back(
                dispatch_id,
                definition.name,
                "the message cannot rebuild it (a secret's payload, a policy job's slot, "
                "a limited job's group)",
            )
        try:
            body = definition.to_json(payload)
        except PayloadValidationError:
            return False  # not a message we sent; the claim's "unknown" stands
        new = NewDispatch(
            id=dispatch_id,
            job_name=definition.name,
            payload=body,
            options=StoredOptions(run=back.run, carry=carry_from_request(task.request)),
            status="queued",  # this delivery is its message
            attempt=attempt - 1,
            send_in=self._redeliver_after(),
        )
        log.warning(
            "dispatch %s of job %s: its ledger row is missing (lost in a database crash on "
            "a relaxed ledger); written again from its message",
            dispatch_id,
            definition.name,
            extra={"dispatch_id": dispatch_id, "job_name": definition.name},
        )
        return self._dispatches.insert(new) or self._dispatches.exists(dispatch_id)


def _not_taken_back(dispatch_id: str, job_name: str, why: str) -> bool:
    log.warning(
        "dispatch %s of job %s: its ledger row is missing and %s; skipped",
        dispatch_id,
        job_name,
        why,
        extra={"dispatch_id": dispatch_id, "job_name": job_name},
    )
    return False
