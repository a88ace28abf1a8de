"""What a job's flow-control limits cost a run, and whether a limited group slows others.

    .venv/bin/python -m bench.limits        # starts its own PostgreSQL
    BENCH_ROUNDS=9 BENCH_RUNS=1000 BENCH_ISOLATION_ROUNDS=21 .venv/bin/python -m bench.limits

Ledger-level: the ledger's own calls from this process, as the fence makes them, with no
Celery worker and no broker. PostgreSQL runs with its default durability (fsync and
synchronous_commit on), as in production, and holds 100,000 rows of other jobs before
the first round (`bench/fixture.py`, `BENCH_FILL`), so that it plans the statements as
it does on a ledger in use.

1. **Claim cost.** One run is the claim and the outcome (`claim`, then `finish`) of a
   queued row, inserted before the clock starts. The measures, interleaved round by
   round, each round starting at the next measure (`BENCH_ROUNDS` rounds of
   `BENCH_RUNS` runs):

   - no limit: `claim`, `finish`;
   - `concurrency=50`, with a group key: the claim takes a seat of the row's group in the
     same UPDATE; the seats are free, so it never blocks;
   - the same with 10 of the group's 50 seats held by other runs all along (the claim
     picks the lowest free seat above them);
   - a rate of 1,000 per 1.0 s: `claim`, `take_permit`, `finish`, as the fence makes
     them (the group's permits are 1,000 rows; fewer runs than that are made in any
     second, so it never refuses, and any refusal is counted and reported);
   - a rate of 10 per 0.01 s: the same with 10 permit rows (a run takes longer than a
     thousandth of a second, so it never refuses either);
   - floor: the two durable writes of a run through the bare driver (psycopg,
     autocommit): an `UPDATE ... RETURNING *` of the row, then an `UPDATE` ending it.

   Each figure is the median over the rounds with its min-max; each ratio is the median
   of the per-round ratios to the unlimited run in the same round. Over each measure it
   reads this process's CPU time and PostgreSQL's (every process of the server), per run.
   Then it reports the plans PostgreSQL made for the claims and the permit on the
   ledger's connection, and PostgreSQL's own planning and execution time of the
   unlimited and the seated claim, prepared as the ledger's connection runs them
   (EXPLAIN ANALYZE EXECUTE, rolled back); and, as a probe, of the seated claim with its
   status comparisons written as literals instead of parameters.

2. **Isolation.** One thread runs an unlimited job's claim and finish loop (`BENCH_LOOP`
   runs on new rows, `BENCH_ISOLATION_ROUNDS` rounds) while a neighbour, from just before
   the loop starts until it ends, makes either:

   - blocked claims: `concurrency=1` claims of queued rows of one group whose one seat
     another run holds (each comes back `blocked`; nothing is written); or
   - the control: claims of another job's queued rows, with no limit (each one commits).

   The neighbour is a second thread of this process (sharing its GIL), or a process of
   its own on a ledger of its own (as another worker's pool process is); the loop alone
   is measured too, for context. All five cases are interleaved round by round; the
   ratio is the loop's runs a second beside the blocked claims over its runs a second
   beside the control, per round. Each neighbour's calls a second and CPU per call
   (`time.thread_time`) are reported beside it.

No figure is asserted: the script reports what it measured.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu import CpuMeter  # noqa: E402
from bench.fixture import fill  # noqa: E402
from bench.floor import CLAIM, FINISH  # noqa: E402
from questpie_celery.jobs.ids import random_dispatch_id  # noqa: E402
from questpie_celery.jobs.options import StoredOptions  # noqa: E402
from questpie_celery.ledger import Ledger, NewDispatch, open_ledger  # noqa: E402
from tests.support.services import PostgresServer, child_pids  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "7"))
RUNS = int(os.environ.get("BENCH_RUNS", "500"))
#: The isolation loop's runs per round.
LOOP = int(os.environ.get("BENCH_LOOP", "150"))
#: Isolation's rounds: short ones, many, so that a slow moment of the machine falls on
#: every case alike.
ISOLATION_ROUNDS = int(os.environ.get("BENCH_ISOLATION_ROUNDS", "15"))
#: Ended and in-flight rows of other jobs the ledger holds before the first round.
FILL_ROWS = int(os.environ.get("BENCH_FILL", "100000"))
LEASE = 60.0
#: The control neighbour's supply of rows per round: more than it can claim in the loop.
CONTROL_ROWS = int(os.environ.get("BENCH_CONTROL_ROWS", str(LOOP * 6)))
#: Queued rows of the held group that the blocked neighbour claims over and over.
HOT_ROWS = 100
HELD_SEATS = 10


NO_LIMIT = "no limit"
SEATED = "concurrency=50, group key"
SEATED_HELD = f"concurrency=50, group key, {HELD_SEATS} seats held"
RATED = "rate 1,000 per 1.0 s"
RATED_SMALL = "rate 10 per 0.01 s"
FLOOR = "floor: driver UPDATE ... RETURNING, then UPDATE"

#: Rate limit refusals seen, by measure (expected none).
REFUSED: dict[str, int] = {}


def queued(ledger: Ledger, job: str, count: int, group: str | None = None) -> list[str]:
    """`count` new queued rows of `job` (in `group`), due now: what a delivery claims."""
    rows = [
        NewDispatch(
            id=random_dispatch_id(),
            job_name=job,
            payload={},
            options=StoredOptions(),
            group_key=group,
            status="queued",
        )
        for _ in range(count)
    ]
    for start in range(0, count, 1000):
        ledger.dispatches.insert_many(rows[start : start + 1000])
    return [row.id for row in rows]


def claimed(ledger: Ledger, dispatch_id: str, job: str, concurrency: int | None = None) -> str:
    claim = ledger.claims.claim(dispatch_id, job, 1, LEASE, concurrency=concurrency)
    if claim.token is None:
        raise RuntimeError(f"claim of {job} came back {claim.outcome}")
    return claim.token


def main() -> None:
    postgres = PostgresServer(durable=True).start()
    try:
        url = postgres.url()
        ledger = open_ledger(url)
        ledger.migration.migrate()
        # Weeks of work already in the ledger (bench/fixture.py), so that PostgreSQL plans
        # the claims as it does on a ledger in use, from the first round to the last.
        fill(ledger.engine, FILL_ROWS)
        postmaster = int((postgres.data / "postmaster.pid").read_text().split()[0])
        driver = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
        driver.autocommit = True
        started = time.perf_counter()
        costs, cpu = claim_costs(ledger, driver, postmaster)
        own_plans = ledger_plans(ledger)
        plans = planned(ledger, url)
        isolated = isolation(ledger, url)
        elapsed = time.perf_counter() - started
        driver.close()
        ledger.close()
    finally:
        postgres.close()
    report_costs(costs, cpu, plans, own_plans)
    report_isolation(isolated)
    print(f"\nmeasured in {elapsed:.0f} s")


def claim_costs(
    ledger: Ledger, driver: psycopg.Connection[Any], postmaster: int
) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    # Seats held by other runs all along, for the measure that picks a seat above them.
    for dispatch_id in queued(ledger, "bench.seated-held", HELD_SEATS, "busy"):
        claimed(ledger, dispatch_id, "bench.seated-held", 50)

    def unlimited(ids: list[str]) -> None:
        for dispatch_id in ids:
            token = claimed(ledger, dispatch_id, "bench.unlimited")
            ledger.claims.finish(dispatch_id, token, "completed", None)

    def seated(job: str) -> Callable[[list[str]], None]:
        def run(ids: list[str]) -> None:
            for dispatch_id in ids:
                token = claimed(ledger, dispatch_id, job, 50)
                ledger.claims.finish(dispatch_id, token, "completed", None)

        return run

    def rated(name: str, job: str, count: int, window: float) -> Callable[[list[str]], None]:
        def run(ids: list[str]) -> None:
            for dispatch_id in ids:
                token = claimed(ledger, dispatch_id, job)
                if ledger.limits.take_permit(job, "tenant", count, window) is not None:
                    REFUSED[name] = REFUSED.get(name, 0) + 1
                ledger.claims.finish(dispatch_id, token, "completed", None)

        return run

    def floor(ids: list[str]) -> None:
        for dispatch_id in ids:
            driver.execute(CLAIM, (dispatch_id,)).fetchone()
            driver.execute(FINISH, (dispatch_id,))

    # Each measure: its job, its rows' group, and the run loop.
    measures: dict[str, tuple[str, str | None, Callable[[list[str]], None]]] = {
        NO_LIMIT: ("bench.unlimited", None, unlimited),
        SEATED: ("bench.seated", "tenant", seated("bench.seated")),
        SEATED_HELD: ("bench.seated-held", "busy", seated("bench.seated-held")),
        RATED: ("bench.rated", "tenant", rated(RATED, "bench.rated", 1000, 1.0)),
        RATED_SMALL: (
            "bench.rated-small",
            "tenant",
            rated(RATED_SMALL, "bench.rated-small", 10, 0.01),
        ),
        FLOOR: ("bench.floor", None, floor),
    }
    names = list(measures)
    for job, group, run in measures.values():  # warm up: connections, prepares, permits
        run(queued(ledger, job, 50, group))
    REFUSED.clear()
    meter = CpuMeter(
        {
            "this process": lambda: [os.getpid()],
            "PostgreSQL": lambda: [postmaster, *child_pids(postmaster)],
        }
    )
    samples: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_ in range(ROUNDS):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            job, group, run = measures[name]
            ids = queued(ledger, job, RUNS, group)
            meter.start()
            began = time.perf_counter()
            run(ids)
            samples[name].append((time.perf_counter() - began) / RUNS)
            cpu[name].append({k: v / RUNS for k, v in meter.stop().items()})
    return samples, cpu


def numbered(sql: str) -> tuple[str, list[str]]:
    """A compiled statement's text with its parameters as $1, $2, ... in the order each
    first appears (as psycopg sends it), and their names in that order."""
    order: list[str] = []

    def number(found: re.Match[str]) -> str:
        if found.group(1) not in order:
            order.append(found.group(1))
        return f"${order.index(found.group(1)) + 1}"

    return re.sub(r"%\((\w+)\)s", number, sql), order


def ledger_plans(ledger: Ledger) -> dict[str, str]:
    """The generic and custom plans PostgreSQL made for the claims' and the permit's
    statements on the ledger's connection so far (psycopg prepares a statement on its
    fifth run; PostgreSQL plans its next five runs afresh, then keeps a generic plan
    unless that plan looks dearer than the fresh ones did)."""
    statements = {
        "claim, no limit": ledger.claims._sql.claim,  # the bench looks inside
        "claim, seated": ledger.claims._sql.claim_seated,
        "take_permit": ledger.limits._sql.take_permit,
    }
    with ledger.engine.connect() as conn:
        found = {
            row[0]: (row[1], row[2])
            for row in conn.exec_driver_sql(
                "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
            )
        }
    plans = {}
    for name, stmt in statements.items():
        text_, _ = numbered(stmt.compile(dialect=ledger.engine.dialect).string)
        counts = found.get(text_)
        plans[name] = f"{counts[0]} generic, {counts[1]} custom" if counts else "not prepared on it"
    return plans


def literal_statuses(sql: str, values: Mapping[str, Any]) -> str:
    """The probe: the statement with every status it compares written as a literal."""
    for key, value in values.items():
        if key.startswith("status_"):
            sql = sql.replace(f"%({key})s::VARCHAR", f"'{value}'")
    return sql


def planned(ledger: Ledger, url: str) -> dict[str, tuple[float, float, str]]:
    """PostgreSQL's planning and execution time (ms, medians of 20) of the unlimited and
    the seated claim's UPDATE, each on a queued row and rolled back, run as the ledger's
    connections run them: prepared, past the five runs after which PostgreSQL may keep a
    generic plan. With the plans it made for those 20. The probe rows are the seated
    claim with its status comparisons written as literals: not the package's statement."""
    sql = ledger.claims._sql  # the bench looks inside, for the statements' text
    kinds = {
        NO_LIMIT: (sql.claim, "bench.unlimited", None, None, False),
        SEATED: (sql.claim_seated, "bench.seated", "tenant", 50, False),
        SEATED_HELD: (sql.claim_seated, "bench.seated-held", "busy", 50, False),
        f"probe: {SEATED}, statuses as literals": (
            sql.claim_seated, "bench.seated", "tenant", 50, True
        ),
        f"probe: {SEATED_HELD}, statuses as literals": (
            sql.claim_seated, "bench.seated-held", "busy", 50, True
        ),
    }  # fmt: skip
    conn = psycopg.connect(
        url.replace("postgresql+psycopg://", "postgresql://"),
        autocommit=True,
        cursor_factory=psycopg.ClientCursor,
    )
    times: dict[str, tuple[float, float, str]] = {}
    for number, (name, (stmt, job, group, limit, literal)) in enumerate(kinds.items()):
        compiled = stmt.compile(dialect=ledger.engine.dialect)
        base = {"previous": 0, "lease": LEASE, "any_time": False, "job": job}
        if limit is not None:
            base["limit"] = limit
        text_ = compiled.string
        if literal:
            text_ = literal_statuses(
                text_, compiled.construct_params({**base, "dispatch_id": "", "new_token": ""})
            )
        text_, order = numbered(text_)
        prepared = f"bench_claim_{number}"
        conn.execute(f"PREPARE {prepared} AS {text_}")
        explain = f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {prepared}("
        explain += ", ".join(["%s"] * len(order)) + ")"
        planning, execution, counted = [], [], (0, 0)
        for run, dispatch_id in enumerate(queued(ledger, job, 25, group)):
            params = {**base, "dispatch_id": dispatch_id, "new_token": str(uuid.uuid4())}
            values = compiled.construct_params(params)
            with conn.transaction(force_rollback=True):
                row = conn.execute(explain, [values[key] for key in order]).fetchone()
            assert row is not None and row[0][0]["Plan"]["Actual Rows"] == 1  # it claimed
            if run == 4:
                counted = plan_counts(conn, prepared)
            if run >= 5:  # PostgreSQL's five fresh plans made
                planning.append(row[0][0]["Planning Time"])
                execution.append(row[0][0]["Execution Time"])
        generic, custom = plan_counts(conn, prepared)
        made = f"{generic - counted[0]} generic, {custom - counted[1]} custom"
        times[name] = (statistics.median(planning), statistics.median(execution), made)
    conn.close()
    return times


def plan_counts(conn: psycopg.Connection[Any], prepared: str) -> tuple[int, int]:
    row = conn.execute(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name = %s",
        (prepared,),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


class Count:
    """A neighbour's calls so far, read by the timing thread (`multiprocessing.Value`'s
    shape, for a neighbour thread)."""

    value = 0


def neighbour(
    ledger: Ledger, kind: str, ids: list[str], stop: Any, calls: Any
) -> tuple[int, float]:
    """Claims of `kind` ("blocked" or "control") over `ids` until `stop` is set: how
    many, and the CPU seconds of the calling thread."""
    cpu, made = time.thread_time(), 0
    while not stop.is_set() and (kind == "blocked" or made < len(ids)):
        if kind == "blocked":
            dispatch_id = ids[made % len(ids)]
            claim = ledger.claims.claim(dispatch_id, "bench.limited", 1, LEASE, concurrency=1)
            if claim.outcome != "blocked" or claim.blocked_by != "concurrency":
                raise RuntimeError(f"a claim of the held group came back {claim.outcome}")
        else:
            claimed(ledger, ids[made], "bench.other")
        made += 1
        calls.value = made
    return made, time.thread_time() - cpu


def neighbour_process(url: str, stop: Any, calls: Any, orders: Connection) -> None:
    """A neighbour in a process of its own, on a ledger of its own: one order (its kind
    and rows) at a time, answered with its calls and CPU seconds, until None."""
    ledger = open_ledger(url)
    while (order := orders.recv()) is not None:
        kind, ids = order
        orders.send(neighbour(ledger, kind, ids, stop, calls))
    ledger.close()


def in_thread(
    answer: list[tuple[int, float]],
    ledger: Ledger,
    kind: str,
    ids: list[str],
    stop: Any,
    calls: Any,
) -> None:
    answer.append(neighbour(ledger, kind, ids, stop, calls))


THREAD, PROCESS = "thread", "process"
ALONE = "alone"


def isolation(ledger: Ledger, url: str) -> dict[str, dict[str, list[float]]]:
    # One group whose one seat a run holds all along, and its rows the neighbour claims.
    (holder,) = queued(ledger, "bench.limited", 1, "hot")
    claimed(ledger, holder, "bench.limited", 1)
    hot = queued(ledger, "bench.limited", HOT_ROWS, "hot")
    spawn = multiprocessing.get_context("spawn")
    stop, calls = spawn.Event(), spawn.Value("q", 0)
    orders, theirs = spawn.Pipe()
    child = spawn.Process(target=neighbour_process, args=(url, stop, calls, theirs))
    child.start()

    def loop(ids: list[str]) -> tuple[float, float]:
        cpu, began = time.thread_time(), time.perf_counter()
        for dispatch_id in ids:
            token = claimed(ledger, dispatch_id, "bench.unlimited-loop")
            ledger.claims.finish(dispatch_id, token, "completed", None)
        return time.perf_counter() - began, time.thread_time() - cpu

    cases = [ALONE] + [
        f"{kind} claims, {where}" for where in (THREAD, PROCESS) for kind in ("blocked", "control")
    ]
    results: dict[str, dict[str, list[float]]] = {
        case: {"rate": [], "cpu": [], "neighbour rate": [], "neighbour cpu": []} for case in cases
    }
    ran_out = 0
    try:
        loop(queued(ledger, "bench.unlimited-loop", 50))  # warm up
        for round_ in range(-1, ISOLATION_ROUNDS):  # round -1 warms the neighbours up, unrecorded
            for case in cases[round_ % len(cases) :] + cases[: round_ % len(cases)]:
                ids = queued(ledger, "bench.unlimited-loop", LOOP)
                kind, where = case.split(" claims, ") if case != ALONE else ("", "")
                rows = hot if kind == "blocked" else queued(ledger, "bench.other", CONTROL_ROWS)
                stop.clear()
                calls.value = 0
                answer: list[tuple[int, float]] = []
                thread = None
                if where == THREAD:
                    count = Count()
                    thread = threading.Thread(
                        target=in_thread, args=(answer, ledger, kind, rows, stop, count)
                    )
                    thread.start()
                    seen: Any = count
                else:
                    seen = calls
                    if where == PROCESS:
                        orders.send((kind, rows))
                while where and not seen.value:  # the neighbour under way before the clock
                    time.sleep(0.001)
                before = seen.value
                elapsed, cpu = loop(ids)
                during = seen.value - before
                stop.set()
                if thread is not None:
                    thread.join()
                elif where == PROCESS:
                    answer.append(orders.recv())
                if round_ < 0:
                    continue
                if answer:
                    made, their_cpu = answer[0]
                    ran_out += kind == "control" and made >= len(rows)
                    results[case]["neighbour rate"].append(during / elapsed)
                    results[case]["neighbour cpu"].append(their_cpu / max(made, 1))
                results[case]["rate"].append(LOOP / elapsed)
                results[case]["cpu"].append(cpu / LOOP)
    finally:
        orders.send(None)
        child.join(30)
    if ran_out:
        print(f"the control neighbour ran out of rows {ran_out} times: raise BENCH_CONTROL_ROWS")
    return results


def spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    median = statistics.median(values) * scale
    low, high = min(values) * scale, max(values) * scale
    return f"{median:,.{digits}f} ({low:,.{digits}f}-{high:,.{digits}f})"


def report_costs(
    samples: dict[str, list[float]],
    cpu: dict[str, list[dict[str, float]]],
    plans: dict[str, tuple[float, float, str]],
    own_plans: dict[str, str],
) -> None:
    base = samples[NO_LIMIT]
    print(
        f"\n{ROUNDS} interleaved rounds of {RUNS} runs (claim, then finish) per measure; "
        "PostgreSQL with default durability, ledger calls in one thread"
    )
    print(
        "| measure | per run, median (min-max) µs | / no limit, median (min-max) "
        "| / floor | CPU per run, µs: this process | PostgreSQL |"
    )
    print("|---|---|---|---|---|---|")
    for name, values in samples.items():
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        to_floor = [v / f for v, f in zip(values, samples[FLOOR], strict=True)]
        mine = statistics.median(r["this process"] for r in cpu[name]) * 1e6
        server = statistics.median(r["PostgreSQL"] for r in cpu[name]) * 1e6
        cells = [
            spread(values, 1e6),
            spread(ratios, digits=2).replace(" (", "x (") if name != NO_LIMIT else "1.00x",
            f"{statistics.median(to_floor):.2f}x" if name != FLOOR else "1.00x",
            f"{mine:,.0f}",
            f"{server:,.0f}",
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if REFUSED:
        print(
            "rate limit refusals (expected none): "
            + ", ".join(f"{k}: {v}" for k, v in REFUSED.items())
        )
    else:
        print("rate limit refusals: none")
    print("\nPlans PostgreSQL made on the ledger's connection over the rounds")
    for name, made in own_plans.items():
        print(f"- {name}: {made}")
    print(
        "\nPostgreSQL's own time for the claim's UPDATE, prepared (EXPLAIN ANALYZE EXECUTE, "
        "medians of 20 after 5), ms"
    )
    print("| claim | planning | execution | plans made for the 20 |")
    print("|---|---|---|---|")
    for name, (planning, execution, plan) in plans.items():
        print(f"| {name} | {planning:.3f} | {execution:.3f} | {plan} |")


def report_isolation(results: dict[str, dict[str, list[float]]]) -> None:
    print(
        f"\nIsolation: {ISOLATION_ROUNDS} interleaved rounds; an unlimited job's loop of {LOOP} "
        "claim+finish runs in one thread, beside a neighbour in another thread of the same "
        "process or in a process of its own"
    )
    print(
        "| case | loop runs/s, median (min-max) | loop CPU per run, µs "
        "| neighbour calls/s | neighbour CPU per call, µs |"
    )
    print("|---|---|---|---|---|")
    for case, figures in results.items():
        cells = [spread(figures["rate"]), f"{statistics.median(figures['cpu']) * 1e6:,.0f}"]
        if figures["neighbour rate"]:
            cells.append(spread(figures["neighbour rate"]))
            cells.append(f"{statistics.median(figures['neighbour cpu']) * 1e6:,.0f}")
        else:
            cells += ["", ""]
        print(f"| {case} | " + " | ".join(cells) + " |")
    alone = results[ALONE]["rate"]
    for where in (THREAD, PROCESS):
        blocked = results[f"blocked claims, {where}"]["rate"]
        control = results[f"control claims, {where}"]["rate"]
        ratios = [b / c for b, c in zip(blocked, control, strict=True)]
        to_alone = [b / a for b, a in zip(blocked, alone, strict=True)]
        print(
            f"neighbour in a {where}: loop beside blocked claims / beside the control "
            f"{spread(ratios, digits=2)} (goal >= 0.95); / alone {spread(to_alone, digits=2)}"
        )


if __name__ == "__main__":
    main()
