"""The decisions of a publish, written once, with no I/O.

What a publish decides (each payload's JSON, where each dispatch goes, the rows to
insert, what the insert and the read-back of its contested rows settled, what to send,
what a policy suppressed) is decided here. `publish/publisher.py` executes a plan on the ledger
and the broker, `publish/aio.py` awaits the same plan from an event loop: the two differ
only in how they run a statement and send.

An unkeyed dispatch of a `standard` job without limits, neither debounced nor
throttled, outside a transaction, not secret and not delayed beyond the ETA horizon, is
a plain Celery message under a fresh UUID, with no ledger row. Everything else becomes a
ledger row first.

A plan's items are taken a chunk at a time (one insert, one pipelined send each), by
`publish`, a generator in the style of `ledger/inserts.py`: it yields each step (`Insert`
a chunk's rows, `ReadBack` its contested ones, `Send` what it settled) and is sent back
that step's answer. `publish/publisher.py` drives it, `publish/aio.py` awaits it (with
`_runtime/plans.py`'s `drive` and `adrive`); the batcher of concurrent `apublish` calls
awaits one chunk's `insert_chunk`. A single publish, the most frequent call, is decided
by the same rules on its one row, with none of a chunk's bookkeeping (`Route`,
`contested`, `refused`, `first_sent`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from ..errors import PayloadValidationError
from ..intake.new_rows import new_dispatch
from ..jobs.crypto import Keyring
from ..jobs.definition import JobDefinition
from ..jobs.ids import random_dispatch_id
from ..jobs.options import DispatchOptions, StoredOptions
from ..jobs.policies import QueuePolicy
from ..ledger import NewDispatch
from ..send.outbox import ETA_HORIZON_SECONDS, FirstSend, is_far_off


def validate(
    definition: JobDefinition[Any], payloads: Sequence[Any], *, first_index: int = 0
) -> list[dict[str, Any]]:
    """Every payload's JSON; a bad one is named by its index (counted from
    `first_index` when validating a slice)."""
    bodies: list[dict[str, Any]] = []
    for index, payload in enumerate(payloads, start=first_index):
        try:
            bodies.append(definition.to_json(payload))
        except PayloadValidationError as exc:
            raise PayloadValidationError(f"item {index}: {exc}") from None
    return bodies


def contested(new: NewDispatch) -> bool:
    """Whether a row that was not inserted is a repeat or a suppression, told apart by
    whether its key's row exists: a keyed row under a policy. Any other row that was not
    inserted is a repeat of its key (no policy), or refused by its policy's slot (no key)."""
    return new.slot is not None and new.idempotency_key is not None


def refused(new: NewDispatch, known: bool) -> bool:
    """Whether a row that was not inserted was refused by a taken policy slot. `known`:
    its key's row exists, which answers the publish with its id before any policy."""
    return new.slot is not None and not known


def first_send(
    start_after: datetime | None, now: datetime, *, eager: bool, after_commit_hook: bool
) -> FirstSend:
    """When a new row is first sent, and by whom: its publisher now (or after the
    caller's commit), or the relay (a start beyond the ETA horizon, or a caller's
    transaction with no after-commit hook). `eager`: sends run the task inline."""
    if eager and after_commit_hook:
        return FirstSend(True)  # eager mode runs everything at once, as Celery's does
    if is_far_off(start_after, now) and start_after is not None:
        return FirstSend(False, next_send_at=start_after - timedelta(seconds=ETA_HORIZON_SECONDS))
    if not after_commit_hook:
        # A Connection has no after-commit hook: the relay sends it once committed,
        # woken by the commit where the database can say so.
        return FirstSend(False, send_in=0.0, wake_relays=True)
    return FirstSend(True)


#: The first send of a route or a chunk that has no row (immutable, so shared).
_NO_ROW = FirstSend(False)


@dataclass
class Route:
    """Where one dispatch goes: a plain message under `dispatch_id` (no `new`), or the
    ledger row `new`, first sent as `first` says."""

    dispatch_id: str
    new: NewDispatch | None = None
    first: FirstSend = _NO_ROW
    #: A plain message's body and options, kept for a sender that sends it later.
    plain: tuple[dict[str, Any], DispatchOptions] | None = None


@dataclass(frozen=True)
class Settled:
    """What a chunk's insert decided."""

    #: Newly inserted rows their publisher sends now (or after the caller's commit).
    send: list[NewDispatch]
    #: Rows were inserted that the relays send, woken by the caller's commit.
    wake_relays: bool
    #: Items a taken policy slot refused: each is reported (log line and signal).
    suppressed: list[NewDispatch]
    #: Items left undecided because whether their key's row exists could not be read.
    undecided: list[int]


def first_sent(new: NewDispatch, route: Route) -> Settled:
    """What to do with one newly inserted row, sent as its route says."""
    sends = route.first.publisher_sends
    return Settled(
        send=[new] if sends else [],
        wake_relays=not sends and route.first.wake_relays,
        suppressed=[],
        undecided=[],
    )


@dataclass
class Chunk:
    """Items of a publish inserted in one statement: ids in order (None once
    suppressed), the rows to insert by item index (first sent as `first` says: the rows
    of one statement share it), and the items sent as plain messages."""

    ids: list[str | None] = field(default_factory=list)
    news: dict[int, NewDispatch] = field(default_factory=dict)
    plain: list[tuple[str, dict[str, Any], DispatchOptions]] = field(default_factory=list)
    first: FirstSend = _NO_ROW

    def add(self, route: Route) -> None:
        if route.new is not None:
            self.first = route.first
            self.news[len(self.ids)] = route.new
        else:
            assert route.plain is not None
            self.plain.append((route.dispatch_id, *route.plain))
        self.ids.append(route.dispatch_id)

    @property
    def rows(self) -> list[NewDispatch]:
        return list(self.news.values())

    def contested(self, inserted: set[str]) -> list[str]:
        """Keyed rows under a policy that were not inserted: repeats or suppressions,
        told apart by whether their key's row exists."""
        return [new.id for new in self.news.values() if new.id not in inserted and contested(new)]

    def settle(self, inserted: set[str], known: set[str] | None) -> Settled:
        """Decide each ledgered item: inserted, or not (a key already in the ledger or
        earlier in the chunk, or a taken policy slot, which a known key still answers
        with its id: a known key is answered before any policy). `known` is None when
        the contested rows could not be read back: those items stay undecided."""
        if not self.news:
            return Settled([], False, [], [])  # plain messages only
        inserted_rows: dict[str, NewDispatch] = {}  # by id: a key twice is sent once
        suppressed: list[NewDispatch] = []
        undecided: list[int] = []
        contested = set(self.contested(inserted)) if known is None else set()
        for index, row in self.news.items():
            if row.id in inserted:
                inserted_rows.setdefault(row.id, row)
            elif row.id in contested:
                undecided.append(index)
            elif refused(row, row.id in (known or ())):
                self.ids[index] = None
                suppressed.append(row)
        rows = list(inserted_rows.values())
        return Settled(
            send=rows if self.first.publisher_sends else [],
            wake_relays=bool(rows) and not self.first.publisher_sends and self.first.wake_relays,
            suppressed=suppressed,
            undecided=undecided,
        )


class Plan:
    """One publish call's items (of one job, sharing every option but their keys),
    routed and built into rows."""

    def __init__(
        self,
        definition: JobDefinition[Any],
        bodies: Sequence[dict[str, Any]],
        options: Sequence[DispatchOptions],
        policy: QueuePolicy,
        keyring: Keyring | None,
        eager: Callable[[], bool],
        *,
        in_transaction: bool = False,
        commit_hook: bool = True,
    ) -> None:
        """`eager`: whether sends run the task inline (`Sender.eager`), asked only when
        a row is made. `in_transaction`: written in a caller's transaction, which has an
        after-commit hook unless it is a bare Connection."""
        self.job_name = definition.name
        self.bodies = bodies
        self._now = datetime.now(UTC)
        debounce = options[0].debounce_seconds if options else None
        if debounce is not None:
            # A new burst's row starts a quiet period from now (the ledger writes its
            # start by the database's clock; this one is its message's countdown).
            start = self._now + timedelta(seconds=debounce)
            options = [replace(item, start_after=start) for item in options]
        self.options = options
        self.policy = policy
        self.keyring = keyring
        self._eager = eager
        self._commit_hook = commit_hook
        shared = options[0]  # the items differ in their keys only
        #: An unkeyed item needs no ledger row: a plain message.
        self.plain_ok = (
            not in_transaction
            and not policy.ledgered
            # Its runs' claims count against its limits in the ledger: each needs a row.
            and not definition.limits.active
            # A burst or a window is a row's.
            and not shared.flow_controlled
            and not shared.secret_payload
            # A chord's or batch's member is counted by its row's end; a chain's link
            # is fenced, so that a replay starts the next link once.
            and shared.canvas_id is None
            and not shared.chain_link
            and not is_far_off(shared.start_after, self._now)
        )
        # What the rows share, made with the first row: a plain message needs neither.
        self._first: FirstSend | None = None
        self._stored: StoredOptions | None = None

    @property
    def first(self) -> FirstSend:
        """When the rows are first sent, and by whom."""
        if self._first is None:
            start_after = self.options[0].start_after
            self._first = first_send(
                start_after, self._now, eager=self._eager(), after_commit_hook=self._commit_hook
            )
        return self._first

    @property
    def stored(self) -> StoredOptions:
        """One copy of the options the rows have in common."""
        if self._stored is None:
            self._stored = self.options[0].stored()
        return self._stored

    def route(self, index: int) -> Route:
        """Where item `index` goes: a plain message, or a ledger row first."""
        item = self.options[index]
        body = self.bodies[index]
        if self.plain_ok and item.idempotency_key is None:
            return Route(item.dispatch_id or random_dispatch_id(), plain=(body, item))
        new = new_dispatch(
            self.job_name, body, item, self.policy, self.keyring, self.first, self.stored
        )
        return Route(new.id, new, self.first)

    def chunks(self, size: int) -> Iterator[Chunk]:
        """The items `size` at a time, in order."""
        for start in range(0, len(self.bodies), size):
            chunk = Chunk()
            for index in range(start, min(start + size, len(self.bodies))):
                chunk.add(self.route(index))
            yield chunk


# --- the plan of a publish, a chunk at a time --------------------------------------------


@dataclass(frozen=True)
class Insert:
    """Insert a chunk's rows in one statement, in order, each unless its id or policy
    slot is taken (`ledger.dispatches.insert_many`); answered with the ids inserted."""

    rows: list[NewDispatch]


@dataclass(frozen=True)
class ReadBack:
    """Which of these rows exist (`ledger.dispatches.existing`); answered with their ids, or None
    when they could not be read (the items that needed them stay undecided)."""

    dispatch_ids: list[str]


@dataclass(frozen=True)
class Send:
    """What a chunk's insert settled: report the items a policy suppressed, send (or
    hand over) the newly inserted rows, then the chunk's plain messages; answered with
    None."""

    settled: Settled
    plain: list[tuple[str, dict[str, Any], DispatchOptions]]


Step = Insert | ReadBack | Send


def insert_chunk(chunk: Chunk) -> Generator[Insert | ReadBack, Any, Settled]:
    """Insert a chunk's rows and settle each item: whether a contested row's key exists
    is read back (see `Chunk.contested`)."""
    inserted: set[str] = yield Insert(chunk.rows)
    contested = chunk.contested(inserted)
    known: set[str] | None = (yield ReadBack(contested)) if contested else set()
    return chunk.settle(inserted, known)


def publish(plan: Plan, size: int) -> Generator[Step, Any, list[str | None]]:
    """The plan's items `size` at a time, in order: each chunk inserted, settled and
    sent before the next; the ids, None where a policy suppressed an item."""
    ids: list[str | None] = []
    for chunk in plan.chunks(size):
        settled = yield from insert_chunk(chunk)
        yield Send(settled, chunk.plain)
        ids += chunk.ids
    return ids
