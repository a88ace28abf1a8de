"""Does the ledger stay as fast at a million rows as at ten thousand? And retention.

    .venv/bin/python bench/million.py                       # starts its own PostgreSQL
    BENCH_ROUNDS=11 BENCH_OPS=300 .venv/bin/python bench/million.py
    BENCH_RETENTION=0 .venv/bin/python bench/million.py     # the comparison only
    BENCH_PG_OPTIONS="-c wal_compression=lz4" .venv/bin/python bench/million.py

PostgreSQL runs with its default durability. Two ledgers in one server, filled by
`bench/fixture.py` (one set-based INSERT each): BENCH_SMALL rows (10,000) and BENCH_LARGE
rows (1,000,000). Round after round, alternating which ledger goes first, it times on
each, per call:

- a keyed publish with a new key: `publish()` as an application calls it (validation,
  the ledger row, the send; the broker is Celery's in-memory one, so the send costs
  the same in both);
- a claim: `ledger.claims.claim` as the worker's fence calls it, of the rows just published;
- the relay's due scan: `ledger.relay.due_out_of_sends(0)`, with 20 rows due in both ledgers
  (every due row: the index range the relay's batch take reads, without its writes).

Each figure is the median of the round medians, with their min-max, the WAL bytes
written per call, and the ratio of the large ledger's time to the small one's.

It prints the large ledger's size on disk as filled: the table (with its TOAST) and
each index, in all and per row.

Then it prints the plans (EXPLAIN ANALYZE, BUFFERS) of those statements, of retention's
and of the beat's pruning on the large ledger; runs retention over it (what the first
run after enabling it finds: about three quarters of the rows), timing each statement
and a publish loop running beside it; and weighs retention's index: a retention pass
with nothing to do and a dispatch's terminal write, with and without it.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from celery import Celery
from pydantic import BaseModel
from sqlalchemy import Engine, event, text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fixture import fill  # noqa: E402
from questpie_celery import JobContext, Questpie, job  # noqa: E402
from questpie_celery.jobs.options import FIRE_KEY_PREFIX  # noqa: E402
from questpie_celery.ledger import Ledger  # noqa: E402
from questpie_celery.worker.retention import RETENTION_BATCH, Retention  # noqa: E402
from tests.support.services import PostgresServer  # noqa: E402

SMALL = int(os.environ.get("BENCH_SMALL", "10000"))
LARGE = int(os.environ.get("BENCH_LARGE", "1000000"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "9"))
OPS = int(os.environ.get("BENCH_OPS", "200"))
WEEK = 7 * 86400.0


class Order(BaseModel):
    order_id: int
    email: str


@job(name="bench.order", schema=Order)
def order(payload: Order, ctx: JobContext) -> None:
    del payload, ctx


class Ledgered:
    """One filled ledger, and a `Questpie` publishing into it."""

    def __init__(self, name: str, url: str, rows: int) -> None:
        self.name, self.rows = name, rows
        app = Celery(f"bench-{name}", broker="memory://")
        app.conf.update(task_ignore_result=True)
        # retention=None: nothing prunes while it is measured; prune() is called on purpose.
        self.questpie = Questpie(app, ledger_url=url, jobs=[order], retention=None)
        self.questpie.migrate()
        self.ledger: Ledger = self.questpie._ledger  # the benchmark times its operations
        started = time.perf_counter()
        fill(self.ledger.engine, rows)
        print(f"{name}: filled {rows:,} rows in {time.perf_counter() - started:.0f}s")
        self.client = self.questpie.client(order)

    @property
    def engine(self) -> Engine:
        return self.ledger.engine


def per_call(action: Callable[[int], object], count: int) -> float:
    """Median µs of `count` calls."""
    times = []
    for i in range(count):
        started = time.perf_counter()
        action(i)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


SIZES = """
SELECT c.relname, pg_relation_size(c.oid)
  + CASE WHEN c.relkind = 'r' THEN coalesce(pg_relation_size(c.reltoastrelid), 0) ELSE 0 END
FROM pg_class c
WHERE c.relname = 'questpie_queue_dispatch'
   OR c.oid IN (SELECT indexrelid FROM pg_index
                WHERE indrelid = 'questpie_queue_dispatch'::regclass)
ORDER BY c.relkind DESC, c.relname
"""


def sizes(ledgered: Ledgered) -> None:
    """The dispatch table and each of its indexes on disk, in all and per row."""
    with ledgered.engine.connect() as conn:
        found = conn.execute(text(SIZES)).all()
    print(f"\non disk at {ledgered.rows:,} rows (bytes per row):")
    for name, size in found:
        print(f"   {name:<40} {size / 2**20:>8.1f} MiB {size / ledgered.rows:>7.0f}")
    total = sum(size for _, size in found)
    print(f"   {'in all':<40} {total / 2**20:>8.1f} MiB {total / ledgered.rows:>7.0f}")


def wal_position(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_current_wal_insert_lsn() - '0/0'")).scalar_one())


def one_round(ledgered: Ledgered) -> dict[str, tuple[float, float]]:
    """(median µs, WAL bytes) per call of each measured operation."""
    run = uuid.uuid4().hex[:8]
    ids: list[str] = []

    def publish(i: int) -> None:
        dispatch_id = ledgered.client.publish(
            {"order_id": i, "email": f"c{i}@example.com"}, idempotency_key=f"{run}-{i}"
        )
        assert dispatch_id is not None
        ids.append(dispatch_id)

    def claim(i: int) -> None:
        assert ledgered.ledger.claims.claim(ids[i], "bench.order", 1, 60.0).outcome == "claimed"

    def due(_: int) -> None:
        assert len(ledgered.ledger.relay.due_out_of_sends(0)) >= 20

    measured = {}
    for name, action in (
        ("keyed publish, new key", publish),
        ("claim (Ledger.claim)", claim),
        ("relay's due scan (Ledger.due_out_of_sends)", due),
    ):
        before = wal_position(ledgered.engine)
        median = per_call(action, OPS)
        measured[name] = (median, (wal_position(ledgered.engine) - before) / OPS)
    return measured


def compare(small: Ledgered, large: Ledgered) -> None:
    seen: dict[str, dict[str, list[tuple[float, float]]]] = {small.name: {}, large.name: {}}
    for r in range(ROUNDS):
        for ledgered in (small, large) if r % 2 == 0 else (large, small):
            for name, value in one_round(ledgered).items():
                seen[ledgered.name].setdefault(name, []).append(value)
    print(f"\n{'per call, µs (WAL bytes)':<40} {small.name:>28} {large.name:>28} {'ratio':>7}")
    for name in seen[small.name]:
        a, b = seen[small.name][name], seen[large.name][name]
        ratio = statistics.median(t for t, _ in b) / statistics.median(t for t, _ in a)
        print(f"{name:<40} {span(a):>28} {span(b):>28} {ratio:>6.2f}x")


def span(values: list[tuple[float, float]]) -> str:
    times = [t for t, _ in values]
    wal = statistics.median(w for _, w in values)
    return f"{statistics.median(times):.0f} ({min(times):.0f}-{max(times):.0f}) ({wal:.0f})"


# --- plans -----------------------------------------------------------------------------


@contextmanager
def captured(engine: Engine) -> Iterator[list[tuple[str, Any]]]:
    """The statements (and their driver parameters) the ledger sends meanwhile."""
    seen: list[tuple[str, Any]] = []

    def grab(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        seen.append((statement, params))

    event.listen(engine, "before_cursor_execute", grab)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", grab)


def explain(engine: Engine, title: str, statement: str, params: Any) -> None:
    """EXPLAIN (ANALYZE, BUFFERS) of a statement the ledger sent, rolled back."""
    print(f"\n-- {title}")
    # The ledger's engine runs in autocommit; this needs a transaction to roll back.
    with engine.connect().execution_options(isolation_level="READ COMMITTED") as conn:
        tx = conn.begin()
        rows = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS) {statement}", params).all()
        tx.rollback()
    for (line,) in rows:
        print(f"   {line}")


def plans(large: Ledgered) -> None:
    """The plans of the statements measured above, and of retention's and the beat's, as
    the ledger sends them (captured), each run again under EXPLAIN ANALYZE, rolled back."""
    ledger = large.ledger
    key = f"plan-{uuid.uuid4().hex}"
    with captured(large.engine) as seen:
        first = large.client.publish({"order_id": 1, "email": "p@example.com"}, idempotency_key=key)
        assert first is not None
        ledger.claims.claim(first, "bench.order", 1, 60.0)
        ledger.relay.due_out_of_sends(0)
        # No backoff: the rows it takes stay due, for the plan of the same take below.
        ledger.relay.take_due(100, max_sends=25, first_backoff=0, max_backoff=0, accepted_backoff=0)
        ledger.retention.prune_schedule_history(
            key_prefix=FIRE_KEY_PREFIX, older_than=WEEK, limit=0
        )
    insert = pick(seen, "INSERT INTO questpie_queue_dispatch")
    claim = pick(seen, "UPDATE questpie_queue_dispatch SET", "claim_token=")
    due = pick(seen, "SELECT questpie_queue_dispatch.id", "next_send_at <=")
    take = pick(seen, "UPDATE questpie_queue_dispatch SET", "SKIP LOCKED")
    beat = pick(seen, "DELETE FROM questpie_queue_dispatch")
    # The insert and the claim again, on rows of their own: the captured ones happened.
    explain(
        large.engine, "keyed publish: its insert", insert[0], {**insert[1], "id": str(uuid.uuid4())}
    )
    other = large.client.publish({"order_id": 2, "email": "q@example.com"}, idempotency_key=key)
    explain(
        large.engine,
        "claim, a job new to the statistics",
        claim[0],
        {**claim[1], "dispatch_id": other},
    )
    with large.engine.connect() as conn:
        known = conn.execute(
            text("SELECT id, job_name FROM questpie_queue_dispatch WHERE status = 'queued' LIMIT 1")
        ).one()
    explain(
        large.engine,
        "claim, a job the statistics know",
        claim[0],
        {**claim[1], "dispatch_id": known.id, "job": known.job_name},
    )
    explain(large.engine, "the relay's due scan", *due)
    explain(large.engine, "the relay's batch take", *take)
    for keyed, title in ((False, "retention: delete unkeyed"), (True, "retention: prune keyed")):
        statement, params = retention_statement(ledger, keyed)
        explain(large.engine, f"{title}, a batch of {RETENTION_BATCH}", statement, params)
    explain(
        large.engine, f"the beat's pruning of fires, a batch of {RETENTION_BATCH}", *batch_of(beat)
    )


def pick(seen: list[tuple[str, Any]], start: str, *holding: str) -> tuple[str, Any]:
    """The first captured statement that starts so and holds each of `holding` (other
    threads, the acceptance recorder's, also send statements meanwhile)."""
    return next(
        (statement, params)
        for statement, params in seen
        if statement.startswith(start) and all(h in statement for h in holding)
    )


def batch_of(captured: tuple[str, Any]) -> tuple[str, Any]:
    """A batch captured with a limit of 0 (which changes nothing), its size put back."""
    statement, params = captured
    return statement, {k: RETENTION_BATCH if v == 0 else v for k, v in params.items()}


def retention_statement(ledger: Ledger, keyed: bool) -> tuple[str, Any]:
    """A retention batch as the ledger sends it."""
    with captured(ledger.engine) as seen:
        ledger.retention.prune_ended(
            keyed=keyed, older_than=WEEK, limit=0, spare_key_prefix=FIRE_KEY_PREFIX
        )
    verb = "UPDATE" if keyed else "DELETE"
    return batch_of(
        pick(
            seen,
            f"{verb} FROM questpie_queue_dispatch"
            if not keyed
            else f"{verb} questpie_queue_dispatch SET payload",
        )
    )


# --- retention ---------------------------------------------------------------------------


def publish_loop(ledgered: Ledgered, stop: threading.Event, latencies: list[float]) -> None:
    run = uuid.uuid4().hex[:8]
    i = 0
    while not stop.is_set():
        i += 1
        started = time.perf_counter()
        ledgered.client.publish(
            {"order_id": i, "email": f"c{i}@example.com"}, idempotency_key=f"{run}-{i}"
        )
        latencies.append((time.perf_counter() - started) * 1e3)


def latency(values: list[float]) -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"median {statistics.median(values):.2f} ms, p99 {p99:.2f} ms, max {max(values):.2f} ms"


def retention_pass(large: Ledgered) -> None:
    """Retention over the large ledger, as `questpie-celery prune` runs it, with a publish
    loop beside it: how long each statement holds its rows, and what a publish feels."""
    ledger = large.ledger
    took: list[float] = []
    prune_ended = ledger.retention.prune_ended

    def timed_prune(**kwargs: Any) -> int:
        started = time.perf_counter()
        try:
            return prune_ended(**kwargs)
        finally:
            took.append((time.perf_counter() - started) * 1e3)

    # The beat deletes spent fires (its own rows) as it runs: do what it would have done.
    started = time.perf_counter()
    fires = 0
    while batch := ledger.retention.prune_schedule_history(
        key_prefix=FIRE_KEY_PREFIX, older_than=WEEK, limit=RETENTION_BATCH
    ):
        fires += batch
    print(f"\nthe beat's pruning: {fires:,} fires in {time.perf_counter() - started:.1f} s")

    alone: list[float] = []
    stop = threading.Event()
    threading.Timer(5.0, stop.set).start()
    publish_loop(large, stop, alone)

    beside: list[float] = []
    stop = threading.Event()
    loop = threading.Thread(target=publish_loop, args=(large, stop, beside))
    loop.start()
    ledger.retention.prune_ended = timed_prune  # type: ignore[method-assign]
    started = time.perf_counter()
    try:
        result = Retention(ledger, WEEK).prune(WEEK)
    finally:
        wall = time.perf_counter() - started
        ledger.retention.prune_ended = prune_ended  # type: ignore[method-assign]
        stop.set()
        loop.join()
    with large.engine.connect() as conn:
        left = conn.execute(text("SELECT count(*) FROM questpie_queue_dispatch")).scalar()
    print(
        f"retention over {large.name}: deleted {result.deleted:,}, pruned {result.pruned:,}, "
        f"{left:,} rows left"
    )
    print(
        f"   {len(took)} statements of up to {RETENTION_BATCH} rows: {sum(took) / 1e3:.1f} s in "
        f"statements, {wall:.1f} s wall (it pauses as long as each batch took)"
    )
    print(
        f"   one statement: median {statistics.median(took):.1f} ms, max {max(took):.1f} ms "
        f"(the longest any row stays locked)"
    )
    print(f"   publish alone:           {latency(alone)}")
    print(f"   publish beside the pass: {latency(beside)}")


def index_cost(large: Ledgered) -> None:
    """Retention's index against its write cost: an idle retention pass (what every relay
    runs once a minute once retention has caught up) and a terminal write, with and
    without the index; WAL bytes measure the write cost without fsync's noise. Each
    measurement starts alike: vacuumed (as autovacuum would have, after the pass) and
    checkpointed."""
    ledger = large.ledger
    retention = Retention(ledger, WEEK)
    explained: set[bool] = set()
    print()
    for with_index in (False, True, False, True):
        with large.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            if with_index:
                ledger.migration.migrate()  # creates the index (again)
            else:
                conn.execute(text("DROP INDEX IF EXISTS questpie_queue_dispatch_ended"))
            conn.execute(text("VACUUM ANALYZE questpie_queue_dispatch"))
            conn.execute(text("CHECKPOINT"))
        idle = per_call(lambda _: retention.prune(WEEK), 10) / 1e3
        finish, wal = terminal_writes(large)
        label = "with" if with_index else "without"
        print(
            f"{label:>7} the index: idle retention pass {idle:.2f} ms, terminal write "
            f"{finish:.0f} µs and {wal:.0f} WAL bytes each"
        )
        if with_index not in explained:
            explained.add(with_index)
            explain(
                large.engine,
                f"retention: prune keyed, with nothing to do, {label} the index",
                *retention_statement(ledger, keyed=True),
            )


def terminal_writes(large: Ledgered) -> tuple[float, float]:
    """(median µs, WAL bytes) of `ledger.claims.finish` on freshly claimed rows."""
    ledger = large.ledger
    run = uuid.uuid4().hex[:8]
    claims = []
    for i in range(OPS):
        dispatch_id = large.client.publish(
            {"order_id": i, "email": "f@example.com"}, idempotency_key=f"{run}-{i}"
        )
        assert dispatch_id is not None
        claims.append(ledger.claims.claim(dispatch_id, "bench.order", 1, 60.0))

    def finish(i: int) -> None:
        claim = claims[i]
        assert claim.row is not None and claim.token is not None
        assert ledger.claims.finish(claim.row.id, claim.token, "completed", None)

    with large.engine.connect() as conn:
        before = conn.execute(text("SELECT pg_current_wal_insert_lsn()")).scalar()
        median = per_call(finish, OPS)
        wal = conn.execute(
            text("SELECT pg_current_wal_insert_lsn() - CAST(:before AS pg_lsn)"),
            {"before": str(before)},
        ).scalar()
    return median, float(wal) / OPS


def main() -> None:
    postgres = PostgresServer(durable=True)
    # Server settings to try, e.g. "-c wal_compression=lz4".
    postgres.options += " " + os.environ.get("BENCH_PG_OPTIONS", "")
    postgres.start()
    try:
        small = Ledgered(
            "10k rows" if SMALL == 10000 else f"{SMALL:,} rows",
            postgres.create_database("small"),
            SMALL,
        )
        large = Ledgered(
            "1M rows" if LARGE == 1000000 else f"{LARGE:,} rows",
            postgres.create_database("large"),
            LARGE,
        )
        sizes(large)
        # Both ledgers start from the same point of a checkpoint cycle, not wherever the
        # fills' WAL left it: after a checkpoint, a page's first change logs the whole page.
        with large.engine.connect() as conn:
            conn.execute(text("CHECKPOINT"))
        compare(small, large)
        if os.environ.get("BENCH_RETENTION", "1") != "0":
            plans(large)
            retention_pass(large)
            index_cost(large)
        small.questpie.close()
        large.questpie.close()
    finally:
        postgres.close()


if __name__ == "__main__":
    main()
