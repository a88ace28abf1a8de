"""Aggregate throughput from several publisher processes, against raw Celery, and what
one dispatch costs the ledger end to end; and the floor of one PostgreSQL here.

    .venv/bin/python bench/scale.py          # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=5 BENCH_DISPATCHES=8000 .venv/bin/python bench/scale.py
    BENCH_ROUNDS=1 BENCH_DISPATCHES=400 BENCH_FLOOR=400 .venv/bin/python bench/scale.py  # smoke

PostgreSQL runs with its default durability (fsync and synchronous_commit on). Two
prefork `celery worker` processes (two children each; BENCH_WORKERS=1x4 for one of four)
consume one queue for the whole run. Round after round, for 1, 4 and 8 publisher
processes (BENCH_PUBLISHERS), it times
BENCH_DISPATCHES no-op dispatches published and run to completion, raw and ledgered,
alternating which goes first:

- raw: each publisher process sends its share with `apply_async`;
- questpie: each sends its share with `publish()`, every one with a new idempotency key.

The publisher processes are spawned (a fresh interpreter each), connect to the ledger
and the broker, and wait; the clock runs from the moment all are released until the
no-op task's Redis counter (`bench/app.py`) reaches the count. Each publisher then ends
the ordinary way (its function returns, the interpreter exits and runs its exit
handlers), and must exit with 0.

Around each measurement it reads the server's own counters: transactions that wrote
(the next transaction id, `pg_current_snapshot()`: only a writing transaction takes
one); from `pg_stat_database` for the ledger's database, `xact_commit` (every commit,
read-only statements too) and rows inserted, updated and deleted; from `pg_stat_wal`,
WAL fsyncs; and WAL bytes (`pg_current_wal_lsn()`). The statistics are read after 11 s
idle, when every server process has reported its counters. What a raw measurement's
window shows is the fleet's background (the workers' relays, the publishers' start-up
round trip, this script's reads), since raw dispatches never reach the ledger; the
ledgered window's figures less that background rate over its length, divided by the
dispatch count, are what one dispatch costs the ledger.

The floor, in the same rounds: N processes (1, 4, 8) each inserting BENCH_FLOOR / N new
keyed rows through the bare driver (psycopg, autocommit, one `INSERT ... ON CONFLICT DO
NOTHING RETURNING` each), into a copy of the dispatch table with the same indexes that
nothing else reads: commits per second one PostgreSQL does here, and the WAL fsyncs
each commit cost (below 1 when PostgreSQL flushed several commits at once). And one
process doing the same with `synchronous_commit=off` for its session: the cost of the
statement and its commit without waiting for the disk.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.services import PostgresServer, RedisServer, Worker  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
DISPATCHES = int(os.environ.get("BENCH_DISPATCHES", "4000"))
FLOOR_INSERTS = int(os.environ.get("BENCH_FLOOR", "4000"))
PUBLISHERS = tuple(int(n) for n in os.environ.get("BENCH_PUBLISHERS", "1,4,8").split(","))
#: The fleet: PROCESSESxCHILDREN prefork workers (`1x4`: one worker of four slots).
WORKERS, SLOTS = (int(n) for n in os.environ.get("BENCH_WORKERS", "2x2").split("x"))
QUEUE = "bench-scale"
KINDS = ("questpie", "raw")
COUNTER = {"questpie": "bench:noop", "raw": "bench:raw"}
#: Long enough for every idle server process to have reported its statistics: PostgreSQL
#: 15 reports a backend's counters when it goes idle, but no sooner than a second after
#: its last report, and then only after 10 s idle (PGSTAT_IDLE_INTERVAL).
SETTLE_SECONDS = 11.0
FLOOR_TABLE = "bench_floor_dispatch"
#: The floor's row for one process committing without waiting for the WAL flush.
RELAXED = 0
NO_FLUSH = "?options=-c%20synchronous_commit%3Doff"
FLOOR_INSERT = (
    f"INSERT INTO {FLOOR_TABLE} (id, job_name, idempotency_key, status, payload, options, "
    "attempt, send_count, created_at, run_after, next_send_at, secret) VALUES "
    "(%s, 'bench.noop', %s, 'pending', %s, '{}', 0, 0, now(), now(), "
    "now() + interval '30 s', false) ON CONFLICT DO NOTHING RETURNING id"
)
SNAPSHOT = (
    # The next transaction id: only a transaction that writes takes one, at once.
    "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint, d.xact_commit, "
    "d.tup_inserted + d.tup_updated + d.tup_deleted, w.wal_sync, "
    "pg_current_wal_lsn() - '0/0' FROM pg_stat_database d, pg_stat_wal w "
    "WHERE d.datname = %s"
)


@dataclass(frozen=True)
class Usage:
    """The server's counters at one moment, or their change over a window."""

    seconds: float
    writes: float  # transactions that wrote (took a transaction id), read at once
    commits: float  # every committed transaction, read-only ones too (reported late)
    row_writes: float
    fsyncs: float
    wal_bytes: float

    def __sub__(self, other: Usage) -> Usage:
        return Usage(
            self.seconds - other.seconds,
            self.writes - other.writes,
            self.commits - other.commits,
            self.row_writes - other.row_writes,
            self.fsyncs - other.fsyncs,
            self.wal_bytes - other.wal_bytes,
        )

    def net_of(self, background: Usage) -> Usage:
        """This window less `background`'s rate over its length."""
        scale = self.seconds / background.seconds
        return Usage(
            self.seconds,
            self.writes - background.writes * scale,
            self.commits - background.commits * scale,
            self.row_writes - background.row_writes * scale,
            self.fsyncs - background.fsyncs * scale,
            self.wal_bytes - background.wal_bytes * scale,
        )


class Counters:
    """Reads the server's counters for one database, from another one."""

    def __init__(self, admin_url: str, database: str) -> None:
        self.conn = psycopg.connect(admin_url, autocommit=True)
        self.database = database

    def read(self) -> Usage:
        row = self.conn.execute(SNAPSHOT, (self.database,)).fetchone()
        assert row is not None
        xid, commits, rows, fsyncs, lsn = row
        return Usage(time.monotonic(), xid, commits, rows, fsyncs, float(lsn))

    def settled(self) -> Usage:
        time.sleep(SETTLE_SECONDS)
        return self.read()


def driver_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


# --- the publisher processes (spawned: a fresh interpreter each) --------------------------


def publish_share(kind: str, count: int, run: str, ready: Any, start: EventType) -> None:
    """Connect, wait for the start, publish `count` dispatches, and return: the process
    then exits the ordinary way, its exit handlers run."""
    bench_app = importlib.import_module("bench.app")  # configured by the environment
    bench_app.questpie.get_policy("bench.noop")  # a ledger round trip: its pool is open
    with bench_app.celery_app.producer_or_acquire() as producer:
        producer.connection.ensure_connection(max_retries=3)
    ready.put(os.getpid())
    start.wait()
    if kind == "raw":
        for i in range(count):
            bench_app.raw.apply_async(args=[{"n": i}], queue=QUEUE)
    else:
        client = bench_app.questpie.queue.bench_noop
        for i in range(count):
            client.publish({"n": i}, idempotency_key=f"{run}-{i}", queue=QUEUE)


def insert_share(url: str, count: int, run: str, ready: Any, start: EventType) -> None:
    """The floor: `count` new keyed rows through the bare driver, one commit each."""
    conn = psycopg.connect(url, autocommit=True)
    ready.put(os.getpid())
    start.wait()
    for i in range(count):
        conn.execute(FLOOR_INSERT, (str(uuid.uuid4()), f"{run}-{i}", f'{{"n": {i}}}')).fetchone()
    conn.close()


def shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if p < total % parts else 0) for p in range(parts)]


def released(ctx: Any, target: Any, parts: int, total: int, first: Any) -> tuple[list[Any], Any]:
    """Spawn `parts` processes running `target(first, share, run, ready, start)`, wait
    until every one is ready; returns them and the start event, not yet set."""
    ready, start = ctx.Queue(), ctx.Event()
    run = uuid.uuid4().hex[:10]
    procs = [
        ctx.Process(target=target, args=(first, share, f"{run}-{p}", ready, start))
        for p, share in enumerate(shares(total, parts))
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=180)
    return procs, start


def ended(procs: list[Any]) -> None:
    for proc in procs:
        proc.join(120)
        if proc.exitcode != 0:
            raise SystemExit(f"a process exited with {proc.exitcode}")


# --- the measurements ---------------------------------------------------------------------


def dispatches(
    ctx: Any, kind: str, publishers: int, counters: Counters, counter: redis.Redis
) -> tuple[float, Usage]:
    """(dispatches per second, the ledger's usage over the window)."""
    counter.delete(COUNTER[kind])
    procs, start = released(ctx, publish_share, publishers, DISPATCHES, kind)
    before = counters.read()
    began = time.monotonic()
    start.set()
    deadline = began + 600
    while int(counter.get(COUNTER[kind]) or 0) < DISPATCHES:
        if time.monotonic() > deadline:
            ran = int(counter.get(COUNTER[kind]) or 0)
            raise SystemExit(f"{kind}: {ran} of {DISPATCHES} ran within 600 s")
        time.sleep(0.005)
    rate = DISPATCHES / (time.monotonic() - began)
    ended(procs)
    usage = counters.settled() - before
    done = int(counter.get(COUNTER[kind]) or 0)
    if done != DISPATCHES:
        raise SystemExit(f"{kind}: {done} runs for {DISPATCHES} dispatches")
    return rate, usage


def floor(ctx: Any, processes: int, url: str, counters: Counters) -> tuple[float, Usage]:
    """(commits per second, the usage) of the bare driver's keyed INSERT."""
    procs, start = released(ctx, insert_share, processes, FLOOR_INSERTS, url)
    before = counters.read()
    began = time.monotonic()
    start.set()
    ended(procs)
    rate = FLOOR_INSERTS / (time.monotonic() - began)
    return rate, counters.settled() - before


def spread(values: list[float], digits: int = 0) -> str:
    return (
        f"{statistics.median(values):,.{digits}f} "
        f"({min(values):,.{digits}f}-{max(values):,.{digits}f})"
    )


def main() -> None:
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    ctx = multiprocessing.get_context("spawn")
    workers: list[Worker] = []
    try:
        ledger_url, broker = postgres.create_database("scale"), redis_server.url()
        database = ledger_url.rsplit("/", 1)[1]
        os.environ["BENCH_BROKER"] = broker  # the spawned publishers inherit these
        os.environ["BENCH_LEDGER"] = ledger_url
        bench_app = importlib.import_module("bench.app")
        bench_app.questpie.migrate()
        bench_app.questpie.close()
        with psycopg.connect(driver_url(ledger_url), autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {FLOOR_TABLE} (LIKE questpie_queue_dispatch INCLUDING ALL)")
        env = {"BENCH_BROKER": broker, "BENCH_LEDGER": ledger_url}
        for _ in range(WORKERS):
            worker = Worker(env, concurrency=SLOTS, queues=QUEUE, app="bench.app:celery_app")
            workers.append(worker.start())
        counters = Counters(driver_url(postgres.url()), database)
        counter = redis.Redis.from_url(broker)
        rates: dict[tuple[str, int], list[float]] = {}
        usage: dict[tuple[str, int], list[Usage]] = {}
        floors: dict[int, list[tuple[float, Usage]]] = {}
        for r in range(ROUNDS):
            for p, publishers in enumerate(PUBLISHERS):
                kinds = KINDS if (r + p) % 2 == 0 else KINDS[::-1]
                for kind in kinds:
                    rate, used = dispatches(ctx, kind, publishers, counters, counter)
                    rates.setdefault((kind, publishers), []).append(rate)
                    usage.setdefault((kind, publishers), []).append(used)
                    print(
                        f"round {r + 1}, {publishers} publishers, {kind}: {rate:,.0f}/s; "
                        f"the window: {used.seconds:.1f} s, {used.writes:.0f} writing "
                        f"transactions, {used.commits:.0f} commits, "
                        f"{used.row_writes:.0f} rows written, {used.fsyncs:.0f} fsyncs"
                    )
            for processes in PUBLISHERS:
                floors.setdefault(processes, []).append(
                    floor(ctx, processes, driver_url(ledger_url), counters)
                )
            # No WAL flush at commit: what the statement itself costs, CPU and all.
            floors.setdefault(RELAXED, []).append(
                floor(ctx, 1, driver_url(ledger_url) + NO_FLUSH, counters)
            )
        counters.conn.close()
    finally:
        for worker in workers:
            worker.stop()
        redis_server.close()
        postgres.close()
    report(rates, usage, floors)


def report(
    rates: dict[tuple[str, int], list[float]],
    usage: dict[tuple[str, int], list[Usage]],
    floors: dict[int, list[tuple[float, Usage]]],
) -> None:
    print(
        f"\n{ROUNDS} rounds of {DISPATCHES:,} no-op dispatches published and run, {WORKERS} "
        f"prefork worker(s) of {SLOTS} children; PostgreSQL (default durability), Redis"
    )
    print("| publishers | questpie, dispatches/s | raw Celery, dispatches/s | questpie / raw |")
    print("|---|---|---|---|")
    for n in PUBLISHERS:
        ours, raw = rates[("questpie", n)], rates[("raw", n)]
        ratios = [a / b for a, b in zip(ours, raw, strict=True)]
        print(f"| {n} | {spread(ours)} | {spread(raw)} | {spread(ratios, 2)}x |")

    print("\nwhat one dispatch costs the ledger, net of the fleet's background (median, min-max)")
    print(
        "| publishers | writing transactions | commits | rows written | WAL fsyncs | WAL bytes "
        "| background commits/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in PUBLISHERS:
        nets = [
            ours.net_of(raw)
            for ours, raw in zip(usage[("questpie", n)], usage[("raw", n)], strict=True)
        ]

        def each(field: str, digits: int, nets: list[Usage] = nets) -> str:
            return spread([getattr(u, field) / DISPATCHES for u in nets], digits)

        background = [u.commits / u.seconds for u in usage[("raw", n)]]
        print(
            f"| {n} | {each('writes', 2)} | {each('commits', 2)} | {each('row_writes', 2)} | "
            f"{each('fsyncs', 2)} | {each('wal_bytes', 0)} | {spread(background, 1)} |"
        )

    print(f"\nfloor: {FLOOR_INSERTS:,} keyed INSERTs through the bare driver, one commit each")
    print("| processes | commits/s | WAL fsyncs per commit |")
    print("|---|---|---|")
    for n in (*PUBLISHERS, RELAXED):
        commits = [rate for rate, _ in floors[n]]
        per = [u.fsyncs / FLOOR_INSERTS for _, u in floors[n]]
        label = "1, `synchronous_commit=off`" if n == RELAXED else str(n)
        print(f"| {label} | {spread(commits)} | {spread(per, 2)} |")


if __name__ == "__main__":
    main()
