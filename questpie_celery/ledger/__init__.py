"""The dispatch ledger: the only part of the package that talks SQL.

- `schema`: the tables, the status vocabulary and the policy slot indexes
- `engine`: engines tuned per dialect, and their life across forks
- `statements`: what every statement is built from, on the database's clock
- `executor`: how every operation runs its statement (the one rerun, errors translated),
  and `Part`, what each concept's operations are over it
- `store`: `Ledger`, that executor composed of one part per concept, which the rest of
  the package calls through (`ledger.claims`, `ledger.dispatches`, `ledger.slots`,
  `ledger.limits`, `ledger.policies`, `ledger.relay`, `ledger.schedules`,
  `ledger.retention`, `ledger.views`, `ledger.migration`, ...), each module with its
  statements
- `inserts`: a publish's inserts as plans, which `dispatches` runs and `aio` awaits
- `transactions`: rows written in a caller's Session or Connection
- `wakeups`: relays listening for commits that wrote rows for them (PostgreSQL)
- `errors`: SQLAlchemy's errors turned into the package's own
"""

from .claims import CarriedEnd
from .engine import (
    Ambient,
    AmbientTransaction,
    Borrowed,
    borrowed_by,
    create_ledger_engine,
    is_private_sqlite,
    mark_borrowed,
)
from .limits import GroupCounts
from .rows import Claim, DispatchRow, NewDispatch, ScheduleRow
from .schema import (
    EXPIRED,
    LEASE_EXPIRED,
    RELAY_GAVE_UP,
    REVOKED,
    SCHEMA_VERSION,
    Status,
    dispatch_table,
    metadata,
    policy_table,
)
from .store import Ledger, open_ledger
from .transactions import caller_connection, send_after_commit
from .wakeups import SendWakeups

__all__ = [
    "EXPIRED",
    "LEASE_EXPIRED",
    "RELAY_GAVE_UP",
    "REVOKED",
    "SCHEMA_VERSION",
    "Ambient",
    "AmbientTransaction",
    "Borrowed",
    "CarriedEnd",
    "Claim",
    "DispatchRow",
    "GroupCounts",
    "Ledger",
    "NewDispatch",
    "ScheduleRow",
    "SendWakeups",
    "Status",
    "borrowed_by",
    "caller_connection",
    "create_ledger_engine",
    "dispatch_table",
    "is_private_sqlite",
    "mark_borrowed",
    "metadata",
    "open_ledger",
    "policy_table",
    "send_after_commit",
]
