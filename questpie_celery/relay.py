"""The relay: finishes what a dead or unlucky process left half-done.

It runs inside every `celery worker` (a bootstep, in the main process) and as
`questpie-celery relay`; several relays share the work safely because every
change it makes is a conditional update that only one of them can win.

Each pass, in this order:

1. ends claims whose lease lapsed (the worker died, or the run outlived
   `expire_in_seconds`) as failed attempts, retried or failed as the dispatch's
   options say, handing their slots on; this needs no broker, so it comes first;
2. sends rows that are due and not yet claimed: a publisher died or the broker
   refused, a `publish(connection=...)` committed, a far-off `start_after`
   nears, an accepted message no worker claimed within `redeliver_after`, a
   retry that waited in the ledger or whose message was lost; a dispatch out of
   sends is recorded `failed`;
3. sends parked runs whose slot is free.

Now and then (a minute apart, for half a second at most) a running relay also
applies retention to ended dispatches: see `retention.py`.

After the broker refuses one send, the pass sends nothing more: with the broker
down each send would only wait out its connection timeout.

A lease that lapsed during a ledger outage may belong to a worker that is alive
and was only cut off by the same outage. So after a pass that could not reach
the ledger, a running relay waits until it has reached the ledger again for
`LAPSE_GRACE_SECONDS` before it ends lapsed leases: long enough for such a
holder to renew its claim or record its outcome (both retry every second or
two), which saves the second run a premature lapse would cost.
"""

from __future__ import annotations

import logging
import threading
import time

from .errors import LedgerSchemaError, QuestpieError
from .ledger import Ledger
from .outbox import Outbox
from .outcomes import Outcomes
from .retention import Retention
from .slots import Slots

log = logging.getLogger(__name__)

DEFAULT_RELAY_INTERVAL_SECONDS = 2.0
#: How long a relay must have reached the ledger (after an outage, or since it started)
#: before it ends lapsed leases.
LAPSE_GRACE_SECONDS = 10.0
#: How often the relays, together, record the backlog the status page plots, and how long
#: samples are kept.
BACKLOG_SAMPLE_SECONDS = 30.0
BACKLOG_KEEP_SECONDS = 2 * 3600.0
#: How often a relay tries again when the ledger had no backlog table (before `migrate`).
BACKLOG_RETRY_SECONDS = 300.0


class Relay:
    def __init__(
        self,
        ledger: Ledger,
        outbox: Outbox,
        outcomes: Outcomes,
        slots: Slots,
        interval: float = DEFAULT_RELAY_INTERVAL_SECONDS,
        retention: Retention | None = None,
    ) -> None:
        self._ledger = ledger
        self._outbox = outbox
        self._outcomes = outcomes
        self._slots = slots
        self.interval = interval
        self._retention = retention

    def run_once(self, *, end_lapsed_leases: bool = True) -> int:
        """One pass; returns how many dispatches it moved on."""
        moved = 0
        if end_lapsed_leases:
            moved += sum(self._outcomes.lapsed(row) for row in self._ledger.expired_claims())
        broker_up = True
        for row in self._ledger.due_for_send():
            if self._outbox.out_of_sends(row):
                moved += self._outcomes.gave_up(row)
            elif broker_up:
                result = self._outbox.resend(row)
                moved += result == "sent"
                broker_up = result != "refused"
        if broker_up:
            for job_name, slot in self._ledger.free_parked_slots():
                moved += self._slots.send_next(job_name, slot)
        return moved

    def _sample_backlog(self, *, warn: bool) -> bool:
        """Record the backlog for the status page; False while the ledger lacks the table
        (warned about once, not on every retry)."""
        try:
            # A little under the period, so the relay that sampled last time wins again
            # rather than each relay deferring to the others' slightly younger samples.
            self._ledger.sample_backlog(
                every=BACKLOG_SAMPLE_SECONDS * 0.9, keep=BACKLOG_KEEP_SECONDS
            )
        except LedgerSchemaError:
            if not warn:
                return False
            log.warning(
                "the ledger has no backlog table yet (schema older than this version); "
                "run `questpie-celery migrate` so the status page can plot the relay's backlog"
            )
            return False
        except QuestpieError:
            pass  # the ledger is unreachable: the next pass says so
        return True

    def run_forever(self, stop: threading.Event) -> None:
        failing = False
        reachable_since: float | None = None  # since when every pass reached the ledger
        sampling, last_sample = True, float("-inf")
        while not stop.is_set():
            started = time.monotonic()
            try:
                settled = (
                    reachable_since is not None and started - reachable_since >= LAPSE_GRACE_SECONDS
                )
                self.run_once(end_lapsed_leases=settled)
                if reachable_since is None:
                    reachable_since = started
                if failing:
                    log.warning("relay passes succeed again")
                failing = False
                # After a schema error, only every few minutes: until `migrate` runs.
                wait = BACKLOG_SAMPLE_SECONDS if sampling else BACKLOG_RETRY_SECONDS
                if started - last_sample >= wait:
                    last_sample = started
                    sampling = self._sample_backlog(warn=sampling)
                if self._retention is not None:
                    self._retention.now_and_then()  # rate-limited; never raises
            except QuestpieError as exc:
                reachable_since = None
                if not failing:
                    log.warning(
                        "relay pass failed (%s); retrying every %.0fs. Dispatches waiting "
                        "on the relay move on once it succeeds",
                        exc,
                        self.interval,
                    )
                failing = True
            except Exception:
                # Never let one bad pass end recovery for the life of the worker.
                log.exception("relay pass failed unexpectedly; trying again")
            stop.wait(self.interval)
