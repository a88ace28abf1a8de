"""A new dispatch's ledger row, and what is told when a queue policy's slot refuses it:
the one builder and the one report for a publish and for a plain delivery that the
worker takes into the ledger (`worker/admission.py`) alike."""

from __future__ import annotations

import logging
from typing import Any, Literal

from ..jobs.crypto import Keyring
from ..jobs.ids import derive_dispatch_id, random_dispatch_id
from ..jobs.options import DispatchOptions, StoredOptions
from ..jobs.policies import QueuePolicy
from ..ledger import NewDispatch
from ..send.outbox import FirstSend
from ..signals import publish_suppressed

#: The loggers these lines always had (a project's logging configuration names them):
#: a publish's in `publish`, a delivery's in the fence, which took deliveries in then.
_publish_log = logging.getLogger("questpie_celery.publish")
_delivery_log = logging.getLogger("questpie_celery.fence")


def new_dispatch(
    job_name: str,
    body: dict[str, Any],
    options: DispatchOptions,
    policy: QueuePolicy,
    keyring: Keyring | None,
    first: FirstSend,
    stored: StoredOptions | None = None,
    *,
    dispatch_id: str | None = None,
    status: Literal["pending", "queued"] = "pending",
) -> NewDispatch:
    """The row of one dispatch; `stored` shares one copy of the options a batch's rows
    have in common. A plain delivery the worker takes in passes its message's id (else
    one is derived from the key, or random) and `queued` (the broker has it already)."""
    key = options.idempotency_key
    if dispatch_id is None:
        if key is not None:
            dispatch_id = derive_dispatch_id(job_name, key)
        else:
            dispatch_id = options.dispatch_id or random_dispatch_id()
    sealed = keyring.seal(body, job_name=job_name, dispatch_id=dispatch_id) if keyring else None
    return NewDispatch(
        id=dispatch_id,
        job_name=job_name,
        idempotency_key=key,
        singleton_key=options.singleton_key,
        group_key=options.group_key,
        # A secret dispatch stores only ciphertext, and its message carries no payload.
        payload=None if sealed else body,
        secret_ciphertext=sealed.ciphertext if sealed else None,
        secret_wrapped_key=sealed.wrapped_key if sealed else None,
        secret_key_id=sealed.key_id if sealed else None,
        options=stored or options.stored(),
        run_after=options.start_after,
        next_send_at=first.next_send_at,
        send_in=first.send_in,
        policy=policy if policy.ledgered else None,
        status=status,
        canvas_id=options.canvas_id,
    )


def report_suppressed(
    new: NewDispatch, *, delivery: bool = False, throttled: float | None = None
) -> None:
    """Tell the log and `publish_suppressed` that a policy slot refused `new`: a
    publish's row, or (`delivery`) a plain delivery's that the worker took in; or
    (`throttled`: its window's length) that its throttle window was closed, which the
    signal names as the policy `"throttle"`."""
    if throttled is not None:
        _publish_log.info(
            "publish of job %s suppressed by its throttle (one dispatch per %g s per key)",
            new.job_name,
            throttled,
            extra={"job_name": new.job_name, "singleton_key": new.singleton_key},
        )
    elif delivery:
        _delivery_log.info(
            "delivery %s of job %s suppressed by its %s queue policy (slot %r is taken)",
            new.id,
            new.job_name,
            new.policy,
            new.slot,
            extra={"dispatch_id": new.id, "job_name": new.job_name},
        )
    else:
        _publish_log.info(
            "publish of job %s suppressed by its %s queue policy (slot %r is taken)",
            new.job_name,
            new.policy,
            new.slot,
            extra={"job_name": new.job_name, "singleton_key": new.singleton_key},
        )
    publish_suppressed.send(
        sender=new.job_name,
        job_name=new.job_name,
        singleton_key=new.singleton_key,
        policy="throttle" if throttled is not None else str(new.policy),
    )
