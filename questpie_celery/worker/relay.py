"""The relay: finishes what a dead or unlucky process left half-done.

It runs inside every `celery worker` (a bootstep, in the main process) and as
`questpie-celery relay`; several relays share the work safely because every
change it makes is a conditional update that only one of them can win.

Each pass, in this order:

0. handles the deliveries this worker saw end without a run (`hear_unrun`: a pool
   process lost before its claim, a revoked message), so a dispatch whose message
   Celery acknowledged and dropped is sent again at once, not after `redeliver_after`;
1. ends claims whose lease lapsed (the worker died, or the run outlived
   `expire_in_seconds`) as failed attempts, retried or failed as the dispatch's
   options say, handing their slots on; this needs no broker, so it comes first;
2. records `failed` the due dispatches that are out of sends (no broker either);
3. sends rows that are due and not yet claimed: a publisher died or the broker
   refused, a `publish(connection=...)` committed, a far-off `start_after`
   nears, an accepted message no worker claimed within `redeliver_after`, a
   retry that waited in the ledger or whose message was lost;
4. sends parked runs whose slot is free.

Now and then (a minute apart, for half a second at most) a running relay also
applies retention to ended dispatches: see `worker/retention.py`.

Due rows are taken a batch at a time, in one statement that no other relay's can
overlap, and each batch is sent over one broker connection; batches follow each other
until nothing is due, for at most `PASS_SEND_SECONDS` (then the next pass follows at
once, so a long backlog does not hold up steps 1, 2 and 4). After the broker refuses one
send, the pass sends nothing more: with the broker down each send would only wait out
its connection timeout. The rest of that batch is given back, due again soon.

On PostgreSQL a running relay also listens for the notification a
`publish(connection=...)` makes in the caller's transaction, and makes a pass as soon
as that transaction commits instead of waiting out its interval. The notification is
only a hint: without it (SQLite, or the listening connection lost and not yet back) the
relay polls every interval as before.

A lease that lapsed during a ledger outage may belong to a worker that is alive
and was only cut off by the same outage. So after a pass that could not reach
the ledger, a running relay waits until it has reached the ledger again for
`LAPSE_GRACE_SECONDS` before it ends lapsed leases: long enough for such a
holder to renew its claim or record its outcome (both retry every second or
two), which saves the second run a premature lapse would cost.

A ledger that stalls instead of failing (a pooler paused, a table lock, a server
starved) cuts holders off just as well, without any error to say so: their renewals
wait behind the same stall as the relay's read of lapsed leases. So a read of lapsed
leases that took longer than `STALL_SECONDS` ends none of them, and the grace starts
again from its end (unless every read is that slow: then the ledger is slow, not
stalled, and leases lapse as usual, so no dead worker's slot is held for ever).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ..canvas.completion import Completion
from ..errors import LedgerBusyError, LedgerSchemaError, LedgerUnavailableError, QuestpieError
from ..ledger import Ledger, SendWakeups
from ..send.outbox import Outbox
from .outcomes import Outcomes, Unrun
from .retention import Retention
from .slots import Slots

log = logging.getLogger(__name__)

DEFAULT_RELAY_INTERVAL_SECONDS = 2.0
#: How long a relay must have reached the ledger (after an outage, or since it started)
#: before it ends lapsed leases.
LAPSE_GRACE_SECONDS = 10.0
#: A read of lapsed leases slower than this was a stall of the ledger, not a lapse.
STALL_SECONDS = 2.0
#: Past this many stalled reads in a row, the ledger is slow, not stalled: leases lapse.
MAX_STALLS_IN_A_ROW = 3
#: How often the relays, together, record the backlog the status page plots, and how long
#: samples are kept.
BACKLOG_SAMPLE_SECONDS = 30.0
BACKLOG_KEEP_SECONDS = 2 * 3600.0
#: How often a relay tries again when the ledger had no backlog table (before `migrate`).
BACKLOG_RETRY_SECONDS = 300.0
#: Due rows a relay takes in one statement and sends over one broker connection: enough to
#: make the statement's round trip a small part of sending, few enough that a relay dying
#: mid-batch leaves only this many rows late (until their backoff ends).
RELAY_BATCH_SIZE = 200
#: How long one pass keeps sending batches; then the next pass, which follows at once,
#: ends lapsed leases and sends parked runs before it goes on with the backlog.
PASS_SEND_SECONDS = 10.0
#: After its listening connection is lost, a relay polls, and tries to listen again this
#: often.
RELISTEN_SECONDS = 5.0
#: The least time from the start of one pass to a pass a notification wakes: a stream of
#: commits is served in passes this far apart, not one pass per commit in every relay.
WAKE_GAP_SECONDS = 0.05
#: Deliveries that ended without a run a relay keeps to handle, at most: past that (the
#: ledger down for long under a stream of lost pool processes) the oldest are left to
#: `redeliver_after`.
MAX_UNRUN_WAITING = 10_000
# How long one wait for a notification lasts, and how often a waiting relay checks that it
# should stop: bounds how long stopping takes.
_LISTEN_SLICE_SECONDS = 1.0
_STOP_CHECK_SECONDS = 0.1


class Relay:
    def __init__(
        self,
        ledger: Ledger,
        outbox: Outbox,
        outcomes: Outcomes,
        slots: Slots,
        interval: float = DEFAULT_RELAY_INTERVAL_SECONDS,
        retention: Retention | None = None,
        completion: Completion | None = None,
    ) -> None:
        self._ledger = ledger  # its outage line, `idle` between passes
        self._completion = completion  # ends the chords and batches a dead process left
        self._claims = ledger.claims
        self._ledger_slots = ledger.slots
        self._ledger_relay = ledger.relay
        self._outbox = outbox
        self._outcomes = outcomes
        self._slots = slots
        self.interval = interval
        self._retention = retention
        self._unrun: deque[Unrun] = deque(maxlen=MAX_UNRUN_WAITING)
        self._unrun_lock = threading.Lock()
        #: When a pass's read of lapsed leases came back from a stall (see STALL_SECONDS).
        self._stalled_at: float | None = None
        self._stalls = 0  # stalled reads of lapsed leases in a row
        self._wake = threading.Event()  # a commit notified rows for it, or a delivery ended unrun

    def hear_unrun(self, delivery: Unrun) -> None:
        """A delivery ended without a run (heard in the worker's main process, in its event
        loop: so only noted here, never a statement); the next pass, which it starts at
        once, handles it."""
        with self._unrun_lock:
            self._unrun.append(delivery)
        self._wake.set()

    def _handle_unrun(self) -> int:
        with self._unrun_lock:
            waiting = list(self._unrun)
            self._unrun.clear()
        moved = 0
        for index, delivery in enumerate(waiting):
            try:
                moved += self._outcomes.unrun(delivery)
            except (LedgerUnavailableError, LedgerBusyError, LedgerSchemaError):
                with self._unrun_lock:  # the ledger is away: the next pass tries them again
                    self._unrun.extendleft(reversed(waiting[index:]))
                raise
            except QuestpieError as exc:
                # Refused for good (a statement this delivery can never pass): tried again,
                # it would fail every pass, and nothing due would ever be sent. Its row, if
                # any, still has its own next send. No traceback: the error says it all.
                log.error(  # noqa: TRY400
                    "dispatch %s of job %s: its delivery ended unrun and could not be "
                    "recorded (%s); left to its row's own next send",
                    delivery.dispatch_id,
                    delivery.job_name,
                    exc,
                    extra={"dispatch_id": delivery.dispatch_id, "job_name": delivery.job_name},
                )
        return moved

    def run_once(self, *, end_lapsed_leases: bool = True) -> int:
        """One pass; returns how many dispatches it moved on."""
        return self._pass(end_lapsed_leases=end_lapsed_leases)[0]

    def _pass(self, *, end_lapsed_leases: bool) -> tuple[int, bool]:
        """One pass: (dispatches moved on, whether it stopped sending with rows still due)."""
        moved = self._handle_unrun()
        if end_lapsed_leases:
            asked = time.monotonic()
            expired = self._claims.expired()
            answered = time.monotonic()
            stalled = answered - asked > STALL_SECONDS
            self._stalls = self._stalls + 1 if stalled else 0
            # A ledger slow on every read is slow, not paused: its holders' renewals get
            # through as well as this read does, and a dead worker's slot must free.
            if not stalled or self._stalls > MAX_STALLS_IN_A_ROW:
                moved += sum(self._outcomes.lapsed(row) for row in expired)
            else:
                self._stalled_at = answered
                if expired:
                    log.warning(
                        "the ledger stalled for %.0fs; %d lapsed leases wait out the grace, "
                        "so that workers held up by the same stall can renew them",
                        answered - asked,
                        len(expired),
                    )
        # Giving up needs no broker.
        moved += sum(self._outcomes.gave_up(row) for row in self._outbox.due_out_of_sends())
        deadline = time.monotonic() + PASS_SEND_SECONDS
        while True:
            batch = self._outbox.relay_batch(RELAY_BATCH_SIZE)
            moved += batch.sent
            if batch.refused:
                return moved, False  # parked runs wait for a broker that takes sends
            if batch.taken < RELAY_BATCH_SIZE:
                break  # nothing more is due (or other relays hold the rest)
            if time.monotonic() >= deadline:
                return moved + self._send_parked(), True
        return moved + self._send_parked(), False

    def _send_parked(self) -> int:
        ended = self._completion.sweep() if self._completion is not None else 0
        return (
            ended
            + self._slots.send_all_waiting()
            + sum(
                self._slots.send_next(job_name, slot)
                for job_name, slot in self._ledger_slots.free_parked_slots()
            )
        )

    def _sample_backlog(self, *, warn: bool) -> bool:
        """Record the backlog for the status page; False while the ledger lacks the table
        (warned about once, not on every retry)."""
        try:
            # A little under the period, so the relay that sampled last time wins again
            # rather than each relay deferring to the others' slightly younger samples.
            self._ledger_relay.sample_backlog(
                every=BACKLOG_SAMPLE_SECONDS * 0.9, keep=BACKLOG_KEEP_SECONDS
            )
        except LedgerSchemaError:
            if not warn:
                return False
            log.warning(
                "the ledger has no backlog table yet (schema older than this version); "
                "run `%s` so the status page can plot the relay's backlog",
                self._ledger.migrate_command,
            )
            return False
        except QuestpieError:
            pass  # the ledger is unreachable: the next pass says so
        return True

    def run_forever(self, stop: threading.Event) -> None:
        wake = self._wake
        done = threading.Event()  # tells the listener this loop ended
        wakeups = self._ledger_relay.send_wakeups()
        if wakeups is not None:
            threading.Thread(
                target=self._listen,
                args=(wakeups, wake, done),
                name="questpie-relay-listen",
                daemon=True,
            ).start()
        try:
            self._loop(stop, wake)
        finally:
            done.set()

    def _loop(self, stop: threading.Event, wake: threading.Event) -> None:
        # The kinds of failure told since the last pass that succeeded: each is told once,
        # so one (a ledger error) never silences another (a bug) that repeats every pass.
        told: set[type[Exception]] = set()
        reachable_since: float | None = None  # since when every pass reached the ledger
        sampling, last_sample = True, float("-inf")
        while not stop.is_set():
            wake.clear()  # a notification from here on calls for another pass
            started = time.monotonic()
            more_due = False
            try:
                settled = (
                    reachable_since is not None and started - reachable_since >= LAPSE_GRACE_SECONDS
                )
                more_due = self._pass(end_lapsed_leases=settled)[1]
                self._ledger.outage.reached()
                if reachable_since is None:
                    reachable_since = started
                if self._stalled_at is not None:  # the grace starts again, from its end
                    reachable_since, self._stalled_at = self._stalled_at, None
                if told:
                    log.warning("relay passes succeed again")
                told.clear()
                # After a schema error, only every few minutes: until `migrate` runs.
                wait = BACKLOG_SAMPLE_SECONDS if sampling else BACKLOG_RETRY_SECONDS
                if started - last_sample >= wait:
                    last_sample = started
                    sampling = self._sample_backlog(warn=sampling)
                if self._retention is not None:
                    self._retention.now_and_then()  # rate-limited; never raises
            except LedgerUnavailableError as exc:
                # The ledger's outage line tells the log (once, then each minute).
                reachable_since = None
                self._ledger.outage.failed(exc)
                log.debug("relay pass failed (%s); retrying every %gs", exc, self.interval)
            except QuestpieError as exc:
                reachable_since = None
                if type(exc) not in told:
                    log.warning(
                        "relay pass failed (%s); retrying every %gs. Dispatches waiting "
                        "on the relay move on once it succeeds",
                        exc,
                        self.interval,
                    )
                told.add(type(exc))
            except Exception as exc:
                # Never let one bad pass end recovery for the life of the worker; one
                # traceback until a pass succeeds, not one a pass.
                if type(exc) not in told:
                    log.exception("relay pass failed unexpectedly; trying again")
                told.add(type(exc))
            self._ledger.idle()  # a pass is a unit of work: Django's connection rules apply
            if more_due:
                continue  # a backlog: the next pass follows at once
            if self._woken(stop, wake, self.interval):
                stop.wait(max(0.0, started + WAKE_GAP_SECONDS - time.monotonic()))

    @staticmethod
    def _woken(stop: threading.Event, wake: threading.Event, seconds: float) -> bool:
        """Wait up to `seconds` for a notification; False when the time ran out or the
        relay is asked to stop."""
        deadline = time.monotonic() + seconds
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if wake.wait(min(left, _STOP_CHECK_SECONDS)):
                return True
        return False

    def _listen(self, wakeups: SendWakeups, wake: threading.Event, done: threading.Event) -> None:
        """Hold the listening connection and set `wake` on every notification; reopen it
        when it is lost (the loop polls meanwhile). Never raises: a relay that stopped
        listening would still poll, but only every interval.

        A lost connection is opened again at once: if that fails, the ledger cannot be
        reached, which its outage line tells (this thread adds nothing); if it succeeds,
        only that connection was lost (a server restart, an idle timeout), said at INFO.
        """
        outage = self._ledger.outage
        lost: Exception | None = None  # why the connection just closed, not said yet
        lost_at = float("-inf")
        unexpected = False  # a traceback was logged; the next one waits for a success
        while not done.is_set():
            try:
                wakeups.open()
            except QuestpieError as exc:
                outage.failed(exc)
                lost = None
                done.wait(RELISTEN_SECONDS)
                continue
            except Exception:
                if not unexpected:
                    log.exception("relay's listener failed unexpectedly; it polls meanwhile")
                unexpected = True
                wakeups.close()
                done.wait(RELISTEN_SECONDS)
                continue
            outage.reached()
            unexpected = False
            # What committed while nobody listened was announced to no one: look now.
            wake.set()
            if lost is not None:
                log.info(
                    "relay's listening connection was lost (%s); it listens for committed "
                    "dispatches again",
                    lost,
                )
                lost = None
            try:
                while not done.is_set():
                    if wakeups.wait(_LISTEN_SLICE_SECONDS):
                        wake.set()
            except Exception as exc:
                lost = exc
            wakeups.close()
            # At once the first time; a connection lost again soon after waits a while.
            if time.monotonic() - lost_at < RELISTEN_SECONDS:
                done.wait(RELISTEN_SECONDS)
            lost_at = time.monotonic()
        wakeups.close()
