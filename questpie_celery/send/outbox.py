"""The outbox: the one way a ledger row becomes a broker message.

Publishing, the worker (retries), parking and the relay all send through it. It
owns the decisions about *when*: how long a fresh row is left to its publisher
before the relay steps in, which delays wait in the ledger rather than as a
broker ETA, how a retry is sent, how relay sends back off, and when the relay
gives up. After a send the broker refused, the row is made due for the relay
soon; once the broker accepted a first send, the row is marked `queued`
(batched, off the publish path).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from .._runtime.outages import Outage
from ..errors import BrokerError, LedgerUnavailableError, QuestpieError
from ..jobs.options import StoredOptions
from ..ledger import DispatchRow, Ledger
from .acceptance import AcceptanceRecorder
from .behind import SendBehind
from .broker import MessageHeader, Sender

log = logging.getLogger(__name__)

#: A dispatch due further ahead than this waits in the ledger, not as a broker ETA held
#: in worker memory (which Redis duplicates past its visibility timeout and RabbitMQ
#: refuses past its consumer_timeout).
ETA_HORIZON_SECONDS = 60.0
#: How long the relay leaves a freshly written row to the process that wrote it.
PENDING_GRACE_SECONDS = 30.0
#: After a refused send, how soon the relay tries.
REFUSED_SEND_RETRY_SECONDS = 5.0
#: Relay sends per attempt before the dispatch is recorded failed.
MAX_RELAY_SENDS = 25
#: The relay's backoff after the first send of an attempt; it doubles with each send.
FIRST_RELAY_BACKOFF_SECONDS = 2.0
MAX_RELAY_BACKOFF_SECONDS = 3600.0
#: An accepted dispatch no worker claimed within this long is sent again.
DEFAULT_REDELIVER_AFTER_SECONDS = 3600.0


def is_far_off(start_after: datetime | None, now: datetime) -> bool:
    """Too far ahead for a broker ETA: the dispatch waits in the ledger."""
    return start_after is not None and start_after > now + timedelta(seconds=ETA_HORIZON_SECONDS)


class Sendable(Protocol):
    """What a send needs of a row: a stored row and a new one both have it."""

    @property
    def id(self) -> str: ...
    @property
    def job_name(self) -> str: ...
    @property
    def payload(self) -> dict[str, Any] | None: ...
    @property
    def options(self) -> StoredOptions: ...
    @property
    def run_after(self) -> datetime | None: ...


@dataclass(frozen=True)
class FirstSend:
    """When a new row is first sent: by its publisher now, or by the relay."""

    publisher_sends: bool
    next_send_at: datetime | None = None  # an absolute relay time (a far-off start)
    send_in: float = PENDING_GRACE_SECONDS  # else: the relay's first look, from now
    wake_relays: bool = False  # the caller's commit wakes the relays to send it


@dataclass(frozen=True)
class RetryPlan:
    """When a failed attempt runs again, and who sends its message."""

    retry_in: float
    relay_in: float  # when the relay sends it if no message has claimed it by then
    send_now: bool  # the caller sends it at once, with `retry_in` as countdown


@dataclass(frozen=True)
class RelayBatch:
    """What one batch of relay sends did."""

    taken: int  # rows taken for sending (no other relay sends them)
    sent: int  # of those, messages the broker took
    refused: bool  # the broker refused one; the rest of the batch was given back


class Outbox:
    def __init__(self, ledger: Ledger, sender: Sender, redeliver_after: float) -> None:
        self._ledger = ledger  # its outage line
        self._dispatches = ledger.dispatches
        self._relay = ledger.relay
        self._claims = ledger.claims  # a delivery that ended unclaimed
        self._sender = sender
        self.redeliver_after = redeliver_after
        self._acceptance = AcceptanceRecorder(ledger, lambda: self.redeliver_after)
        # Registered after the recorder, so its exit flush runs first (atexit runs in
        # reverse) and the acceptances of its last sends are written after it.
        self._behind = SendBehind(self.send_many)
        #: Whether the relay's sends reach the broker (see `_runtime/outages.py`).
        self.broker_outage = Outage("the broker")

    def close(self) -> None:
        """Send what waits to be sent, then write the acceptance marks still batched."""
        self._behind.close()
        self._acceptance.close()

    def flush(self, timeout: float | None = None) -> bool:
        """Send what waits to be sent (for up to `timeout` seconds), then write the
        acceptance marks batched so far; go on as before. False if the time ran out."""
        sent = self._behind.flush(timeout)
        self._acceptance.flush()
        return sent

    def sent_behind(self, timeout: float | None = None) -> bool:
        """Wait until the rows handed to `send_behind` so far are sent (or left to the
        relay); False if `timeout` ran out first."""
        return self._behind.flush(timeout)

    def send_behind(self, rows: Sequence[Sendable]) -> None:
        """Send the first attempts of new rows after the caller goes on, or, for a batch
        of several while nothing else waits, before it returns, as one pipelined batch
        (see `send/behind.py`); in eager mode, at once, as Celery's eager mode does."""
        if self._sender.eager:
            self.send_many(rows)
        else:
            self._behind.submit(rows)

    # --- when ---------------------------------------------------------------------------

    def plan_retry(self, delay: float) -> RetryPlan:
        if delay <= ETA_HORIZON_SECONDS or self._sender.eager:
            return RetryPlan(delay, delay + self.redeliver_after, send_now=True)
        # A long wait stays in the ledger, not in a worker's memory as an ETA.
        return RetryPlan(delay, delay - ETA_HORIZON_SECONDS, send_now=False)

    def resend_unclaimed(self, dispatch_id: str, job_name: str, attempt: int) -> bool:
        """A delivery of `attempt` ended without a run and without a claim (its pool
        process died first, say), after the broker had it acknowledged: the relay sends the
        row again at once rather than after `redeliver_after`. False when the row moved on
        (the delivery did claim it, or another one did)."""
        return self._claims.send_unclaimed_now(
            dispatch_id, job_name, attempt, horizon=ETA_HORIZON_SECONDS
        )

    def due_out_of_sends(self) -> list[DispatchRow]:
        """Rows due for the relay that had every send of their attempt: the relay gives
        up on them instead."""
        return self._relay.due_out_of_sends(MAX_RELAY_SENDS)

    # --- sending ------------------------------------------------------------------------

    def send(
        self,
        row: Sendable,
        *,
        attempt: int,
        countdown: float | None = None,
        carry: Mapping[str, Any] | None = None,
        refused_retry_in: float = REFUSED_SEND_RETRY_SECONDS,
    ) -> bool:
        """Send the message for `attempt` of a ledgered dispatch; False if refused.

        A refused send leaves the row due for the relay in `refused_retry_in` seconds.
        `carry` overrides the Celery options stored with the row (the delivery being
        retried has the newest).
        """
        now = datetime.now(UTC)
        if not self._sender.eager and is_far_off(row.run_after, now):
            # Its start moved far ahead while it waited (a debounced burst that gathered
            # while parked): it waits in the ledger, as a far-off publish does, and the
            # relay sends it with an ETA inside the horizon.
            assert row.run_after is not None
            wait = (row.run_after - now).total_seconds() - ETA_HORIZON_SECONDS
            self._due_soon([row.id], attempt, wait)
            return True
        try:
            self._send(row, attempt=attempt, countdown=countdown, carry=carry)
        except BrokerError as exc:
            log.warning(
                "dispatch %s of job %s: the broker refused attempt %d (%s); it stays in "
                "the ledger and the relay sends it",
                row.id,
                row.job_name,
                attempt,
                type(exc.__cause__).__name__,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )
            self._due_soon([row.id], attempt, refused_retry_in)
            return False
        if attempt == 1:
            self._acceptance.record(row.id)
        return True

    def _send(
        self,
        row: Sendable,
        *,
        attempt: int,
        countdown: float | None,
        carry: Mapping[str, Any] | None,
        trace: Mapping[str, str] | None = None,
    ) -> None:
        options = row.options
        run_after = row.run_after
        if run_after is not None and run_after <= datetime.now(UTC):
            run_after = None
        self._sender.send(
            job_name=row.job_name,
            dispatch_id=row.id,
            payload=row.payload,
            header=MessageHeader(ledgered=True, attempt=attempt, run=options.run),
            priority=options.priority,
            queue=options.queue,
            countdown=countdown,
            # An ETA only within the horizon: further out, rows wait in the ledger.
            eta=run_after if countdown is None else None,
            carry=options.carry if carry is None else carry,
            trace=trace,
        )

    def _due_soon(self, dispatch_ids: Sequence[str], attempt: int, send_in: float) -> None:
        with self._carrying_on(
            "%d dispatch(es) (first %s): could not mark them due for the relay (%s); "
            "the relay sends them at their fallback time",
            len(dispatch_ids),
            dispatch_ids[0],
        ):
            self._relay.send_soon(dispatch_ids, attempt - 1, send_in)

    def send_committed(self, dispatch_ids: Sequence[str]) -> None:
        """Send rows a caller's transaction committed; skip what its savepoints dropped."""
        try:
            rows = self._dispatches.get_many(dispatch_ids)
        except QuestpieError as exc:
            # The caller's commit succeeded; the relay sends the rows after their grace.
            log.warning(
                "%d committed dispatch(es) not sent (%s); the relay will send them",
                len(dispatch_ids),
                type(exc).__name__,
            )
            return
        self.send_many([row for row in rows if row.status == "pending"])

    def send_many(
        self,
        rows: Sequence[Sendable],
        traces: Mapping[str, Mapping[str, str]] | None = None,
    ) -> list[bool]:
        """Send the first attempt of many ledgered dispatches over one producer connection,
        pipelined where the broker allows; return, per row, whether the broker took it.

        When the broker refuses, the rest are not tried; every row not known to be taken
        is left due for the relay soon. With pipelining, which sends arrived is unknown
        after a failure: those count as refused, and a second copy the relay sends is one
        the worker's fence drops. `traces` holds, by dispatch id, the trace context of a
        publisher the send does not run for (see `Sender.send`).
        """
        if not rows:
            return []  # a batch of nothing (a savepoint dropped every row) sends nothing
        taken = [False] * len(rows)
        first_error: BaseException | None = None
        refusal: BrokerError | None = None
        try:
            with self._sender.batch(len(rows)):
                for index, row in enumerate(rows):
                    try:
                        trace = traces.get(row.id) if traces is not None else None
                        self._send(row, attempt=1, countdown=None, carry=None, trace=trace)
                        taken[index] = True
                    except BrokerError as exc:
                        refusal = exc
                        break
                    except Exception as exc:
                        # Only eager mode raises here (a handler's error, with
                        # task_eager_propagates): run the others before passing it on.
                        first_error = first_error or exc
                        taken[index] = True
        except BrokerError as exc:
            refusal = exc
            taken = [False] * len(rows)
        for row, was_taken in zip(rows, taken, strict=True):
            if was_taken:
                self._acceptance.record(row.id)
        refused = [row for row, was_taken in zip(rows, taken, strict=True) if not was_taken]
        if refused:
            first = refused[0]
            log.warning(
                "dispatch %s of job %s%s: the broker refused it (%s); it stays in the ledger "
                "and the relay sends it",
                first.id,
                first.job_name,
                f" and {len(refused) - 1} more" if len(refused) > 1 else "",
                type(refusal.__cause__).__name__ if refusal is not None else "unknown",
                extra={"dispatch_id": first.id, "job_name": first.job_name},
            )
            self._due_soon([row.id for row in refused], 1, REFUSED_SEND_RETRY_SECONDS)
        if first_error is not None:
            raise first_error
        return taken

    def relay_batch(self, limit: int) -> RelayBatch:
        """The relay's sends: take up to `limit` due rows in one statement (each send
        counted and backed off, none taken by another relay), then send them as one
        broker batch (`Sender.batch`: one producer, pipelined where the transport can).

        After the broker refuses one, the rest are not tried (with the broker down, each
        would only wait out its connection timeout): the refused send counts, and the rows
        after it are given back, uncounted and due again in `REFUSED_SEND_RETRY_SECONDS`.
        When the batch fails as a whole (a pipeline), which of its messages arrived is
        unknown: its first row counts as refused and the others are given back; a second
        message of one that did arrive is dropped by the fence.
        """
        taken = self._relay.take_due(
            limit,
            max_sends=MAX_RELAY_SENDS,
            first_backoff=FIRST_RELAY_BACKOFF_SECONDS,
            max_backoff=MAX_RELAY_BACKOFF_SECONDS,
            # The broker accepted the row once: it may just be waiting in a busy queue.
            accepted_backoff=self.redeliver_after,
        )
        if not taken:
            return RelayBatch(0, 0, refused=False)
        sent = 0  # rows, from the first, whose sends were made before any refusal
        refusal: BrokerError | None = None
        try:
            with self._sender.batch(len(taken)):
                for row in taken:
                    log.info(
                        "relay sends dispatch %s of job %s (%s, send %d)",
                        row.id,
                        row.job_name,
                        row.status,
                        row.send_count,
                        extra={"dispatch_id": row.id, "job_name": row.job_name},
                    )
                    try:
                        self._send(row, attempt=row.attempt + 1, countdown=None, carry=None)
                    except BrokerError as exc:
                        refusal = exc  # the sends made before it go out as the batch ends
                        break
                    sent += 1
        except BrokerError as exc:
            sent, refusal = 0, exc
        except BaseException:
            # Not a refusal: an interrupt, or in eager mode a handler's error propagating
            # from its send. A pipelined batch that ends this way is discarded unsent, so no
            # row of it counts as taken by the broker: all are given back, due again soon
            # (a copy that did go out is dropped by the fence).
            self._give_back(taken)
            raise
        if refusal is not None:
            self.broker_outage.failed(refusal.__cause__ or refusal)
            self._relay_refused(taken, sent, refusal)
        elif sent:
            self.broker_outage.reached()
        self._accepted([row.id for row in taken[:sent] if row.attempt == 0])
        return RelayBatch(len(taken), sent, refused=refusal is not None)

    def _relay_refused(self, taken: list[DispatchRow], sent: int, exc: BrokerError) -> None:
        refused = taken[sent]
        # The broker's outage line tells the log of it; which dispatch waits is detail.
        log.info(
            "dispatch %s of job %s: the broker refused the relay's send (%s); %d more of "
            "its batch wait for the next pass",
            refused.id,
            refused.job_name,
            type(exc.__cause__).__name__,
            len(taken) - sent - 1,
            extra={"dispatch_id": refused.id, "job_name": refused.job_name},
        )
        # It backs off as a pending row does, not by redeliver_after: the broker never took
        # this send, so nothing of it can be waiting there.
        backoff = min(
            FIRST_RELAY_BACKOFF_SECONDS * 2.0 ** (refused.send_count - 1),
            MAX_RELAY_BACKOFF_SECONDS,
        )
        self._due_soon([refused.id], refused.attempt + 1, backoff)
        self._give_back(taken[sent + 1 :])

    def _give_back(self, unsent: list[DispatchRow]) -> None:
        """Rows the relay took and did not send: uncounted, due again soon."""
        if not unsent:
            return
        with self._carrying_on(
            "%d dispatch(es) the relay took but did not send could not be made due "
            "again (%s); the relay sends them when their backoff ends",
            len(unsent),
        ):
            self._relay.give_back(unsent, REFUSED_SEND_RETRY_SECONDS)

    def _accepted(self, dispatch_ids: list[str]) -> None:
        """Record the broker's acceptance of first sends right after the batch, rather
        than by the background recorder: a pending row's backoff is only seconds, and a
        long pass must not find it still pending and due again and send it twice."""
        if not dispatch_ids:
            return
        with self._carrying_on(
            "could not record broker acceptance of %d dispatch(es) (%s); they stay "
            "pending and the relay sends them again",
            len(dispatch_ids),
        ):
            self._dispatches.mark_queued(dispatch_ids, self.redeliver_after)

    @contextmanager
    def _carrying_on(self, failed: str, *args: object) -> Iterator[None]:
        """Around a ledger write the relay can do without: when it fails, say so in
        `failed` (a format whose last `%s` is the error's type) and go on. An outage
        goes to the ledger's outage line and this line to DEBUG; anything else is a
        WARNING."""
        try:
            yield
            self._ledger.outage.reached()
        except QuestpieError as exc:
            level = logging.WARNING
            if isinstance(exc, LedgerUnavailableError):
                self._ledger.outage.failed(exc)
                level = logging.DEBUG
            # stacklevel: the line names the write's method, not this helper.
            log.log(level, failed, *args, type(exc).__name__, stacklevel=3)
