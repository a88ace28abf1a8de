"""How a delivery waits for the ledger before it runs, and goes back to the broker.

Every step the worker takes for a delivery before its handler runs (reading the
job's policy, taking a plain call into the ledger, the claim, parking) waits out an
unreachable ledger, a held row or a ledger not migrated yet, by `LedgerWait`'s rule.
Past the patience, and before the run's soft time limit (which would otherwise end
the wait with the message already acknowledged), the delivery goes back to the
broker carrying its token, rather than being lost; if the broker refuses that too,
it keeps trying both. An eager run waits for nothing: `publish()` is waiting on it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from celery import Task
from celery.exceptions import Ignore, SoftTimeLimitExceeded

from ..errors import BrokerError, LedgerSchemaError, LedgerUnavailableError
from ..jobs.definition import JobDefinition
from ..jobs.options import resolve_options
from ..ledger import Ledger
from ..send.broker import MessageHeader, Sender
from .waiting import TRANSIENT, LedgerWait

#: The logger these lines always had (a project's logging configuration names it): the
#: fence's, whose wait this was before this module took it over.
log = logging.getLogger("questpie_celery.fence")

T = TypeVar("T")

#: How long a delivery waits for an unreachable ledger before going back to the broker.
CLAIM_PATIENCE_SECONDS = 30.0
#: The countdown of a delivery sent back to the broker while the ledger is unreachable.
REQUEUE_DELAY_SECONDS = 5.0
#: The longest pause between two tries while the ledger (or the broker) is unreachable.
MAX_PAUSE_SECONDS = 5.0
#: How long before a run's soft time limit a delivery stops waiting for the ledger.
SOFT_LIMIT_MARGIN_SECONDS = 2.0


class DeliveryWait:
    def __init__(self, ledger: Ledger, sender: Sender) -> None:
        self._sender = sender
        self._wait = LedgerWait(
            ledger,
            patience=CLAIM_PATIENCE_SECONDS,
            first_pause=0.2,
            max_pause=MAX_PAUSE_SECONDS,
            waits_for=(*TRANSIENT, LedgerSchemaError),
        )

    def unledgered(
        self,
        task: Task,
        step: Callable[[], T],
        header: MessageHeader | None,
        definition: JobDefinition[Any],
    ) -> T:
        """`step` waited out like a claim, for a delivery not yet in the ledger."""
        back = header or MessageHeader(
            ledgered=False, run=resolve_options(definition.options, {}).run
        )
        if back.token is None:
            back = MessageHeader(back.ledgered, back.attempt, back.run, str(uuid.uuid4()))
        return self.run(task, step, back)

    def run(self, task: Task, step: Callable[[], T], back: MessageHeader) -> T:
        """Run a step of the delivery, waiting out a ledger outage, a held row, or a
        ledger not migrated yet (its tables missing: the delivery runs once `migrate`
        made them); past the patience, send it back carrying `back` (its token)."""

        def tell(level: int, exc: Exception) -> None:
            log.log(
                level,
                "dispatch %s: %s (%s); waiting to claim it",
                task.request.id,
                "the ledger is not migrated"
                if isinstance(exc, LedgerSchemaError)
                else "the ledger is unreachable or busy",
                exc,
                extra={"dispatch_id": task.request.id},
            )

        def out_of_time(exc: Exception) -> None:
            if self._send_back(task, exc, back):
                raise Ignore() from None

        def soft_limit(limit: SoftTimeLimitExceeded) -> None:
            # A limit that fell anyway (in a statement, say): go back to the broker.
            if self._send_back(task, LedgerUnavailableError("soft time limit"), back):
                raise Ignore() from None
            raise limit

        return self._wait.run(
            step,
            tell=tell,
            out_of_time=out_of_time,
            soft_limit=soft_limit,
            within=time_before_soft_limit(task),
            # publish() is waiting on an eager run inline: tell it at once.
            waits_for=() if task.request.is_eager else None,
        )

    def _send_back(self, task: Task, exc: Exception, back: MessageHeader) -> bool:
        """Send the same message again (id, payload, route, headers, with `back` as its
        questpie header); its next delivery claims. False when the broker refused it."""
        try:
            self._sender.send_back(task, back, REQUEUE_DELAY_SECONDS)
        except BrokerError as refused:
            log.info(
                "dispatch %s: the ledger is unreachable (%s) and the broker refused the "
                "delivery back (%s); trying both again",
                task.request.id,
                exc,
                type(refused.__cause__).__name__,
                extra={"dispatch_id": task.request.id},
            )
            return False
        log.info(
            "dispatch %s: the ledger stayed unreachable (%s); the delivery went back to the "
            "broker and runs when the ledger is back",
            task.request.id,
            exc,
            extra={"dispatch_id": task.request.id},
        )
        return True


def time_before_soft_limit(task: Task) -> float:
    """Seconds left, from now, for waiting before the run's soft time limit (a margin
    left); infinity when it has none."""
    limits = task.request.timelimit or (None, None)
    soft = limits[1] if len(limits) > 1 else None
    soft = soft or task.soft_time_limit or task.app.conf.task_soft_time_limit
    if not soft:
        return float("inf")
    started = getattr(task.request, "questpie_started", None) or time.monotonic()
    return max(float(soft) - SOFT_LIMIT_MARGIN_SECONDS - (time.monotonic() - started), 0.0)
