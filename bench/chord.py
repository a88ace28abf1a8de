"""A durable chord (`questpie_celery.chord`) against Celery's own (`celery.chord` on the
Redis result backend), end to end, in one run.

    .venv/bin/python -m bench.chord                          # 5 rounds of 1,000 members
    .venv/bin/python -m bench.chord --members 200 --rounds 3 # smoke

It starts its own PostgreSQL (default durability: fsync and synchronous_commit on),
Redis (broker on db 0, result backend on db 1) and one prefork `celery worker` (`-c 2`)
running `bench/chord_app.py`, for the whole run. Round after round, alternating which
goes first, it applies a chord of `--members` no-op members and a body:

- questpie: `questpie_celery.chord` of `LedgerTask`s: the chord and its members written
  to the ledger in one transaction when applied, each member's end recorded with its
  outcome, the body sent through the ledger by the worker that records the last end;
- Celery: `celery.chord` of plain tasks, the same no-ops: each member's result stored
  in Redis and counted there (the Redis backend's native chord: no `chord_unlock`).

The figure is the time from `apply_async` to the body's start (the body writes
`time.time()` to Redis first thing; the bench takes it before `apply_async`), split by
the members' first and last end (the dispatch rows' `finished_at` for questpie, the
results' `date_done` in Redis for Celery): `apply_async` itself; from its call to the
first member's end (Celery's members run while it is still sending, questpie's once
the transaction has committed); from the first member's end to the last one's, the
members' run; and from there to the body's start, the callback's latency. Ratios are
questpie / Celery, the median of the per-round ratios with their min-max. Over the same
span it reads, from `/proc`, the CPU time of this process, of the worker's main process
and its pool, of PostgreSQL and of Redis, reported per member.

The ledger's cost, as `bench/scale.py` counts it: around each chord the server's own
counters (writing transactions by the next transaction id, commits, rows written and
WAL fsyncs from `pg_stat_database` and `pg_stat_wal`, read 11 s after the chord ended
so that every server process has reported them); a Celery round's window, when nothing
is written to the ledger, gives the background rate (the worker's relay) that the
questpie window's figures are taken net of, then divided by the member count. With
`pg_stat_statements` loaded (the default; `--no-statements` leaves it out), also the
statements the ledger's database ran over the chord, per member, in all and by
statement. Last, one more questpie chord, not among the rounds, has its
`apply_async` traced: the statements and commits its thread makes through psycopg, each
timed, and the time spent outside them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import redis
from celery import chord as celery_chord

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu import CpuMeter  # noqa: E402
from bench.scale import Counters, Usage, driver_url  # noqa: E402
from questpie_celery import chord as questpie_chord  # noqa: E402
from tests.support.services import PostgresServer, RedisServer, Worker, child_pids  # noqa: E402

KINDS = ("questpie", "celery")
#: The chord's wait for its body, at most.
TIMEOUT_SECONDS = 600.0
STATEMENTS = (
    "SELECT s.queryid, s.calls, s.rows, s.query FROM pg_stat_statements s "
    "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s"
)
#: (calls, rows, the statement's text) by queryid.
Statements = dict[int, tuple[int, int, str]]


@dataclass
class Round:
    """One chord, applied and run to its body's start."""

    kind: str
    apply: float  # seconds in `apply_async`
    first_end: float  # from `apply_async` to the first member's end
    members: float  # from the first member's end to the last one's
    first_start: float | None  # from `apply_async` to the first member's claim (questpie)
    callback: float  # from the last member's end to the body's start
    total: float  # from `apply_async` to the body's start
    usage: Usage  # the ledger's counters over the window
    ended: Usage  # the counters that end the window
    cpu: dict[str, float]  # CPU seconds by process group, `apply_async` to the body's start
    statements: Statements = field(default_factory=dict)  # over the window


class Tracer:
    """The statements and commits the calling thread makes through psycopg while
    `tracing()`, each timed: what `apply_async` spends in the driver and the server."""

    def __init__(self) -> None:
        self.spent: dict[str, list[float]] = {}  # label: [calls, seconds]

    def _add(self, label: str, seconds: float) -> None:
        entry = self.spent.setdefault(label, [0.0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    @contextmanager
    def tracing(self) -> Iterator[None]:
        thread = threading.get_ident()
        execute, commit = psycopg.Cursor.execute, psycopg.Connection.commit

        def timed(call: Callable[..., Any], label: Callable[..., str]) -> Callable[..., Any]:
            def traced(this: Any, *args: Any, **kwargs: Any) -> Any:
                if threading.get_ident() != thread:
                    return call(this, *args, **kwargs)
                started = time.perf_counter()
                try:
                    return call(this, *args, **kwargs)
                finally:
                    self._add(label(*args), time.perf_counter() - started)

            return traced

        psycopg.Cursor.execute = timed(execute, lambda query, *_: shorten(text_of(query), 60))  # type: ignore[method-assign]
        psycopg.Connection.commit = timed(commit, lambda *_: "(the driver's commit)")  # type: ignore[method-assign]
        try:
            yield
        finally:
            psycopg.Cursor.execute = execute  # type: ignore[method-assign]
            psycopg.Connection.commit = commit  # type: ignore[method-assign]


def text_of(query: Any) -> str:
    if isinstance(query, bytes):
        return query.decode(errors="replace")
    return query if isinstance(query, str) else type(query).__name__


class Bench:
    def __init__(
        self,
        app: ModuleType,
        counters: Counters,
        ledger: psycopg.Connection[Any],
        redis_url: str,
        meter: CpuMeter,
        statements: bool,
    ) -> None:
        self.app = app
        self.counters = counters
        self.ledger = ledger
        self.marks = redis.Redis.from_url(redis_url + "0")
        self.results = redis.Redis.from_url(redis_url + "1")
        self.meter = meter
        self.with_statements = statements

    def statements(self) -> Statements:
        if not self.with_statements:
            return {}
        rows = self.counters.conn.execute(STATEMENTS, (self.counters.database,)).fetchall()
        found: Statements = {}
        for queryid, calls, count, query in rows:
            calls_before, rows_before, _ = found.get(queryid, (0, 0, query))
            found[queryid] = (calls_before + calls, rows_before + count, query)
        return found

    def chord(
        self,
        kind: str,
        count: int,
        before: Usage,
        *,
        settle: bool = True,
        tracer: Tracer | None = None,
    ) -> Round:
        """Apply one chord of `count` members, wait for its body's start and end, and
        (`settle`) for the counters to settle; `before`: the counters, settled, before
        it. With a `tracer`, `apply_async`'s statements are traced."""
        run = uuid.uuid4().hex[:12]
        app = self.app
        if kind == "questpie":
            header = [app.member.s(i) for i in range(count)]
            body, make = app.body.s(run), questpie_chord
        else:
            header = [app.raw_member.s(i) for i in range(count)]
            body, make = app.raw_body.s(run), celery_chord
        statements_before = self.statements()
        self.meter.start()
        started = time.time()
        if tracer is None:
            result = make(header)(body)
        else:
            with tracer.tracing():
                result = make(header)(body)
        applied = time.time()
        key = f"bench:chord:body:{run}"
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while (mark := self.marks.get(key)) is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"{kind}: the body did not start within {TIMEOUT_SECONDS} s")
            time.sleep(0.002)
        cpu = self.meter.stop()
        body_started = float(mark)
        member_ids = [member.id for member in result.parent.results]
        if kind == "questpie":
            first_start, first_end, last_end = self.ledger_ends(result.parent.id, count)
            self.wait_ended(result.id)
            app.questpie.flush(120)  # the publisher's acceptance marks written
        else:
            first_start = None  # Celery's results do not say when a member started
            first_end, last_end = self.backend_ends(member_ids)
            while not result.ready():
                time.sleep(0.01)
        after = self.counters.settled() if settle else self.counters.read()
        return Round(
            kind=kind,
            apply=applied - started,
            first_end=first_end - started,
            members=last_end - first_end,
            first_start=None if first_start is None else first_start - started,
            callback=body_started - last_end,
            total=body_started - started,
            usage=after - before,
            ended=after,
            cpu=cpu,
            statements=diff(self.statements(), statements_before),
        )

    def ledger_ends(self, canvas_id: str, count: int) -> tuple[float, float, float]:
        """The members' first start (claim), first end and last end (their rows'
        `started_at` and `finished_at`)."""
        row = self.ledger.execute(
            "SELECT count(*), extract(epoch FROM min(started_at)), "
            "extract(epoch FROM min(finished_at)), "
            "extract(epoch FROM max(finished_at)) "
            "FROM questpie_queue_dispatch WHERE canvas_id = %s AND finished_at IS NOT NULL",
            (canvas_id,),
        ).fetchone()
        assert row is not None
        if row[0] != count:
            raise SystemExit(f"questpie: {row[0]} of {count} members ended before the body")
        return float(row[1]), float(row[2]), float(row[3])

    def wait_ended(self, dispatch_id: str) -> None:
        """Until the body's dispatch has ended (its writes are the chord's)."""
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            row = self.ledger.execute(
                "SELECT status FROM questpie_queue_dispatch WHERE id = %s", (dispatch_id,)
            ).fetchone()
            if row is not None and row[0] == "completed":
                return
            time.sleep(0.01)
        raise SystemExit(f"questpie: the body {dispatch_id} did not complete")

    def backend_ends(self, member_ids: list[str]) -> tuple[float, float]:
        """The members' first and last end (their results' `date_done` in Redis)."""
        keys = [f"celery-task-meta-{member_id}" for member_id in member_ids]
        ends = []
        for start in range(0, len(keys), 500):
            for stored in self.results.mget(keys[start : start + 500]):
                if stored is None:
                    raise SystemExit("celery: a member's result is missing")
                done = datetime.fromisoformat(json.loads(stored)["date_done"])
                if done.tzinfo is None:
                    done = done.replace(tzinfo=UTC)
                ends.append(done.timestamp())
        return min(ends), max(ends)


def diff(after: Statements, before: Statements) -> Statements:
    changed: Statements = {}
    for queryid, (calls, count, query) in after.items():
        calls_before, rows_before, _ = before.get(queryid, (0, 0, query))
        if calls > calls_before:
            changed[queryid] = (calls - calls_before, count - rows_before, query)
    return changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--members", type=int, default=1000, help="members per chord (1,000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each kind (5)")
    parser.add_argument(
        "--no-statements",
        action="store_true",
        help="leave pg_stat_statements out (no statement counts)",
    )
    args = parser.parse_args(argv)
    with_statements = not args.no_statements
    load_before = os.getloadavg()
    postgres = PostgresServer(durable=True)
    if with_statements:
        postgres.options += " -c shared_preload_libraries=pg_stat_statements"
    postgres.start()
    redis_server = RedisServer().start()
    worker: Worker | None = None
    rounds: list[Round] = []
    tracer = Tracer()
    try:
        ledger_url = postgres.create_database("chord")
        database = ledger_url.rsplit("/", 1)[1]
        redis_url = redis_server.url(0)[:-1]  # the database's number follows
        env = {
            "BENCH_BROKER": redis_url + "0",
            "BENCH_BACKEND": redis_url + "1",
            "BENCH_LEDGER": ledger_url,
        }
        os.environ.update(env)
        app = importlib.import_module("bench.chord_app")  # configured by the variables above
        app.questpie.migrate()
        counters = Counters(driver_url(postgres.url()), database)
        if with_statements:
            counters.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        worker = Worker(env, concurrency=2, app="bench.chord_app:celery_app").start()
        assert worker.proc is not None and redis_server.proc is not None
        main_pid, redis_pid = worker.proc.pid, redis_server.proc.pid
        postmaster = int((postgres.data / "postmaster.pid").read_text().split()[0])
        meter = CpuMeter(
            {
                "bench (apply_async)": lambda: [os.getpid()],
                "worker main": lambda: [main_pid],
                "pool processes": lambda: child_pids(main_pid),
                "PostgreSQL": lambda: [postmaster, *child_pids(postmaster)],
                "Redis": lambda: [redis_pid],
            }
        )
        ledger = psycopg.connect(driver_url(ledger_url), autocommit=True)
        bench = Bench(app, counters, ledger, redis_url, meter, with_statements)
        for kind in KINDS:  # warm up the connections, the worker's and ours
            bench.chord(kind, 20, counters.read(), settle=False)
        before = counters.settled()
        for r in range(args.rounds):
            for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                done = bench.chord(kind, args.members, before)
                before = done.ended  # the settled read that ended its window
                rounds.append(done)
                print(
                    f"round {r + 1}, {kind}: body started {done.total:.2f} s after "
                    f"apply_async (apply {done.apply * 1000:.0f} ms, first member's end "
                    f"{done.first_end * 1000:.0f} ms, members {done.members:.2f} s, callback "
                    f"{done.callback * 1000:.0f} ms); "
                    f"{done.usage.writes:.0f} writing transactions in {done.usage.seconds:.1f} s",
                    flush=True,
                )
        # One more questpie chord, its `apply_async` traced: not among the rounds.
        traced = bench.chord("questpie", args.members, before, settle=False, tracer=tracer)
        ledger.close()
        counters.conn.close()
        app.questpie.close()
    finally:
        if worker is not None:
            worker.stop()
        redis_server.close()
        postgres.close()
    report(rounds, args.members, with_statements, load_before, os.getloadavg())
    report_trace(tracer, traced, args.members)


def spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    scaled = [v * scale for v in values]
    return (
        f"{statistics.median(scaled):,.{digits}f} "
        f"({min(scaled):,.{digits}f}-{max(scaled):,.{digits}f})"
    )


def report(
    rounds: list[Round],
    members: int,
    with_statements: bool,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> None:
    ours = [r for r in rounds if r.kind == "questpie"]
    theirs = [r for r in rounds if r.kind == "celery"]

    def loads(load: tuple[float, float, float]) -> str:
        return ", ".join(f"{v:.2f}" for v in load)

    print(
        f"\n{len(ours)} rounds, alternating, of a chord of {members:,} no-op members and a "
        "body; one prefork worker (-c 2); PostgreSQL (default durability) ledger, Redis "
        f"broker and result backend; load average {loads(load_before)} before, "
        f"{loads(load_after)} after"
    )
    print("| measure, median (min-max) | questpie `chord` | Celery `chord` | questpie / Celery |")
    print("|---|---|---|---|")
    rows: list[tuple[str, str, float, int]] = [
        ("`apply_async` to the body's start, s", "total", 1.0, 2),
        ("`apply_async` itself, ms", "apply", 1000.0, 0),
        ("`apply_async` to the first member's end, ms", "first_end", 1000.0, 0),
        ("the first member's end to the last one's, s", "members", 1.0, 2),
        ("the last member's end to the body's start, ms", "callback", 1000.0, 0),
    ]
    for label, name, scale, digits in rows:
        a = [getattr(r, name) for r in ours]
        b = [getattr(r, name) for r in theirs]
        ratios = [x / y for x, y in zip(a, b, strict=True) if y > 0]
        ratio = f"{spread(ratios, digits=2)}x" if ratios else ""
        print(f"| {label} | {spread(a, scale, digits)} | {spread(b, scale, digits)} | {ratio} |")
    starts = [r.first_start for r in ours if r.first_start is not None]
    print(
        f"| `apply_async` to the first member's start (its claim), ms | "
        f"{spread(starts, 1000.0)} | | |"
    )
    rate_a = [(members - 1) / r.members for r in ours]
    rate_b = [(members - 1) / r.members for r in theirs]
    ratios = [x / y for x, y in zip(rate_a, rate_b, strict=True)]
    print(
        f"| members ended per second, first end to last | {spread(rate_a)} | {spread(rate_b)} "
        f"| {spread(ratios, digits=2)}x |"
    )

    print(
        "\nCPU per member, µs, from `apply_async` to the body's start (median); `others`: "
        "the machine's less the processes listed (other work on the machine)"
    )
    groups = list(ours[0].cpu)
    print("| chord | " + " | ".join(groups) + " | others |")
    print("|---|" + "---|" * (len(groups) + 1))
    for kind, kind_rounds in (("questpie", ours), ("Celery", theirs)):
        cells = [statistics.median(r.cpu[g] for r in kind_rounds) * 1e6 / members for g in groups]
        others = statistics.median(
            r.cpu["machine"] - sum(v for g, v in r.cpu.items() if g != "machine")
            for r in kind_rounds
        )
        cells.append(others * 1e6 / members)
        print(f"| {kind} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |")

    nets = [a.usage.net_of(b.usage) for a, b in zip(ours, theirs, strict=True)]

    def each(field_name: str, digits: int = 2) -> str:
        return spread([getattr(u, field_name) / members for u in nets], digits=digits)

    print(
        "\nthe questpie chord's cost to the ledger, per member, net of the background "
        "(a Celery round's window), median (min-max)"
    )
    print("| writing transactions | commits | rows written | WAL fsyncs | WAL bytes |")
    print("|---|---|---|---|---|")
    print(
        f"| {each('writes')} | {each('commits')} | {each('row_writes')} | {each('fsyncs')} "
        f"| {each('wal_bytes', 0)} |"
    )
    if not with_statements:
        print("(statements not counted: --no-statements)")
        return
    background = [
        sum(calls for calls, _, _ in b.statements.values()) / b.usage.seconds for b in theirs
    ]
    per_member = [
        (sum(calls for calls, _, _ in a.statements.values()) - rate * a.usage.seconds) / members
        for a, rate in zip(ours, background, strict=True)
    ]
    print(
        "\nstatements in the ledger's database (pg_stat_statements), per member, net of the "
        f"background: {spread(per_member, digits=2)}; the last round's, by statement:"
    )
    print("| statement | calls per member | rows per member |")
    print("|---|---|---|")
    for calls, count, query in sorted(ours[-1].statements.values(), reverse=True)[:10]:
        print(f"| `{shorten(query)}` | {calls / members:.3f} | {count / members:.3f} |")


def report_trace(tracer: Tracer, traced: Round, members: int) -> None:
    """Where one more questpie chord's `apply_async` spent its time."""
    print(
        f"\none more questpie chord of {members:,}, its `apply_async` traced (the calling "
        "thread's statements and commits through psycopg, each timed round trip included): "
        f"{traced.apply * 1000:.0f} ms in all"
    )
    print("| part | calls | ms | share |")
    print("|---|---|---|---|")
    in_driver = 0.0
    for label, (calls, seconds) in sorted(tracer.spent.items(), key=lambda kv: -kv[1][1]):
        in_driver += seconds
        print(
            f"| `{label.replace('|', chr(92) + '|')}` | {calls:,.0f} | {seconds * 1000:.1f} "
            f"| {seconds / traced.apply:.0%} |"
        )
    outside = traced.apply - in_driver
    print(
        "| outside the driver (signatures, options, payloads, Celery's chord, SQLAlchemy) "
        f"| | {outside * 1000:.1f} | {outside / traced.apply:.0%} |"
    )


def shorten(query: str, width: int = 90) -> str:
    flat = " ".join(query.split()).replace("|", "\\|")
    return flat if len(flat) <= width else flat[: width - 3] + "..."


if __name__ == "__main__":
    main()
