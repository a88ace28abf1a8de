"""`Ledger`: the connection to the ledger's database, and its operations by concept.

The operations live by concept beside their statements, each a part of the ledger
(`ledger.claims.claim(...)`); how each one runs its statement (autocommit, the one
rerun, reading back) is `executor.py`'s, which `Ledger` is:

- `migration`: creating and upgrading the schema, the ledger's identity
- `dispatches`: inserting rows (one, a batch, in a caller's transaction), reading them,
  recording the broker's acceptance
- `debounce`, `throttle`: a debounced publish's burst, a throttled publish's window
- `claims`: the fence's claim, its lease, and how an attempt ends
- `cancels`: cancelling a dispatch (ended before it starts, or marked while it runs)
- `slots`: parking runs, handing queue policy slots on
- `limits`: the rate limit's permits, runs waiting for a limit sent on, groups' counts
- `policies`: the queue policy recorded for each job
- `relay`: the relay's takes, give-backs, give-ups, wake-ups and backlog samples
- `schedules`: schedules and beat ticks
- `retention`: pruning ended dispatches and spent schedule history
- `views`: the operator's reads and requeue, and the Django admin's reads
- `canvases`: chords and batches, and the one write that ends each
"""

from __future__ import annotations

from sqlalchemy import Engine

from .cancels import Cancels
from .canvases import Canvases
from .claims import Claims
from .debounce import Debounce
from .dispatches import Dispatches
from .engine import create_ledger_engine
from .executor import Executor
from .limits import Limits
from .migration import Migration
from .policies import Policies
from .relay import Relay
from .retention import Retention
from .schedules import Schedules
from .slots import Slots
from .throttle import Throttle
from .views import Views


class Ledger(Executor):
    """The dispatch ledger in one database: the connection every part shares (`get`,
    `now`, `rebind`, `close`, `idle`, ...) and the parts, one per concept, that the rest
    of the package calls (`ledger.claims`, `ledger.dispatches`, ...).

    Composed rather than assembled from mixins: a caller holds the part it uses, and a
    test replaces one operation on that part (`monkeypatch.setattr(ledger.claims,
    "renew", ...)`), which every caller holding the part then meets. The parts hold this
    object as their executor, so a `rebind` moves them all.
    """

    def __init__(self, engine: Engine, *, relaxed: bool = False, pooled: bool = False) -> None:
        super().__init__(engine, relaxed=relaxed, pooled=pooled)
        self.migration = Migration(self)
        self.dispatches = Dispatches(self)
        # After `dispatches`: their inserts are its insert (see `Executor.attach`).
        self.debounce = Debounce(self, self.dispatches)
        self.throttle = Throttle(self, self.dispatches)
        self.claims = Claims(self)
        self.cancels = Cancels(self)
        self.slots = Slots(self)
        self.limits = Limits(self)
        self.policies = Policies(self)
        self.relay = Relay(self)
        self.schedules = Schedules(self)
        self.retention = Retention(self)
        self.views = Views(self)
        self.canvases = Canvases(self)


def open_ledger(url: str, *, relaxed: bool = False, pooled: bool = False) -> Ledger:
    """A `Ledger` on an engine of its own, for tools that have a URL and no `Questpie`
    (`pooled`: the URL reaches PostgreSQL through a pooler in transaction mode)."""
    return Ledger(
        create_ledger_engine(url, relaxed=relaxed, pooled=pooled), relaxed=relaxed, pooled=pooled
    )
