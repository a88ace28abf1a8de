"""`Ledger`: every operation on the ledger tables, addressed by what it does.

The operations live by concept beside their statements; how each one runs its
statement (autocommit, the one rerun, reading back) is `executor.py`'s:

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
"""

from __future__ import annotations

from .cancels import Cancels
from .claims import Claims
from .debounce import Debounce
from .dispatches import Dispatches
from .engine import create_ledger_engine
from .limits import Limits
from .migration import Migration
from .policies import Policies
from .relay import Relay
from .retention import Retention
from .schedules import Schedules
from .slots import Slots
from .throttle import Throttle
from .views import Views


class Ledger(
    Migration,
    Debounce,
    Throttle,
    Dispatches,
    Claims,
    Cancels,
    Slots,
    Limits,
    Policies,
    Relay,
    Schedules,
    Retention,
    Views,
):
    """The dispatch ledger in one database: every operation the rest of the package
    calls, each concept's from its own module.

    Assembled from mixins over one `Executor` rather than composed of parts
    (`ledger.claims.claim(...)`): the callers keep calling `ledger.claim(...)`, and a
    test that replaces one operation on the instance (`monkeypatch.setattr(ledger,
    "renew", ...)`) still replaces it for every caller.
    """


def open_ledger(url: str, *, relaxed: bool = False, pooled: bool = False) -> Ledger:
    """A `Ledger` on an engine of its own, for tools that have a URL and no `Questpie`
    (`pooled`: the URL reaches PostgreSQL through a pooler in transaction mode)."""
    return Ledger(
        create_ledger_engine(url, relaxed=relaxed, pooled=pooled), relaxed=relaxed, pooled=pooled
    )
