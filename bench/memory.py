"""A worker's memory after 1,000 and after 100,000 fenced no-op runs.

    .venv/bin/python bench/memory.py                       # starts its own PostgreSQL and Redis
    BENCH_RUNS=20000 .venv/bin/python bench/memory.py
    BENCH_TRACE_RUNS=20000 .venv/bin/python bench/memory.py   # and where the growth is

PostgreSQL runs with its default durability, Redis is the broker. The queue is filled
first with keyed `publish_many` calls (1,000 payloads each) of bench/app.py's fenced
no-op job, then one `celery worker` (prefork, one child, so each run is claimed and
completed in the ledger by the same process) drains it. Runs are counted through Redis
INCR, as bench/run.py does; at 1,000 runs and every checkpoint after, the VmRSS (and
RssAnon) of the pool child and of the worker's main process are read from /proc.

Before that, a probe of 2,000 runs estimates how fast this machine fills and drains the
queue, and BENCH_RUNS (100,000 by default) is lowered to a multiple of 10,000 that fits
in BENCH_BUDGET seconds (480 by default) when it would not.

With BENCH_CONTROL=1, the same number of raw Celery no-op tasks (`apply_async`, no
ledger) is drained the same way afterwards, to tell Celery's own growth from ours: once
plain, once sent with the time limits every ledgered message carries (a soft limit of
`expire_in_seconds`, a hard one 30 s later). BENCH_EXPIRE=S publishes with
`expire_in_seconds=S` (and gives the second control the same limits). With
BENCH_TRACE_RUNS=N, one more worker runs N fenced runs with tracemalloc on in its main
process and its child (bench/memory_app.py), snapshots after 1,000 and N tasks, and the
largest differences are printed by the line that allocated them, with their call stacks.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import sys
import tempfile
import time
import tracemalloc
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questpie_celery.jobs.options import DEFAULT_EXPIRE_IN_SECONDS  # noqa: E402
from questpie_celery.send.broker import HARD_TIME_LIMIT_GRACE_SECONDS  # noqa: E402
from tests.support.services import PostgresServer, RedisServer, Worker  # noqa: E402

RUNS = int(os.environ.get("BENCH_RUNS", "100000"))
BUDGET = float(os.environ.get("BENCH_BUDGET", "480"))
TRACE_RUNS = int(os.environ.get("BENCH_TRACE_RUNS", "0"))
CONTROL = os.environ.get("BENCH_CONTROL", "") == "1"
EXPIRE = int(os.environ["BENCH_EXPIRE"]) if os.environ.get("BENCH_EXPIRE") else None
PROBE = 2000
FIRST = 1000
CHUNK = 1000
COUNTER = "bench:noop"


@dataclass
class Sample:
    runs: int
    seconds: float
    child_rss: int  # kB
    child_anon: int
    main_rss: int
    main_anon: int
    child_pid: int


def main() -> None:
    # A SIGTERM (from `timeout`, say) still stops the servers and the worker.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    try:
        pg_url, redis_url = postgres.url(), redis_server.url()
        os.environ["BENCH_BROKER"] = redis_url
        os.environ["BENCH_LEDGER"] = pg_url
        app = importlib.import_module("bench.memory_app")  # configured by the variables above
        app.questpie.migrate()
        env = {"BENCH_BROKER": redis_url, "BENCH_LEDGER": pg_url}
        fill_rate, drain_rate, _ = drain(app, redis_url, env, PROBE, [PROBE])
        per_run = 1 / fill_rate + 1 / drain_rate
        runs = RUNS
        if RUNS * per_run > BUDGET:
            runs = max(int(BUDGET / per_run) // 10_000 * 10_000, 10_000)
        print(
            f"probe: fills {fill_rate:.0f} publishes/s, drains {drain_rate:.0f} runs/s; "
            f"{RUNS} runs would take about {RUNS * per_run:.0f} s, measuring {runs}",
            flush=True,
        )
        steps = {FIRST, 2_000, 5_000, *range(10_000, runs + 1, 10_000), runs}
        checkpoints = sorted(step for step in steps if step <= runs)
        _, rate, samples = drain(app, redis_url, env, runs, checkpoints)
        report("fenced no-op jobs", samples, rate, runs)
        if CONTROL:
            _, rate, samples = drain(app, redis_url, env, runs, checkpoints, kind="raw")
            report("raw Celery no-op tasks", samples, rate, runs)
            _, rate, samples = drain(app, redis_url, env, runs, checkpoints, kind="raw-limited")
            report(
                "raw Celery no-op tasks sent with the time limits a ledgered message carries",
                samples,
                rate,
                runs,
            )
        if TRACE_RUNS:
            trace(app, redis_url, env, TRACE_RUNS)
        app.questpie.close()
    finally:
        redis_server.close()
        postgres.close()


def drain(
    app: Any,
    redis_url: str,
    env: dict[str, str],
    runs: int,
    checkpoints: list[int],
    kind: str = "fenced",
) -> tuple[float, float, list[Sample]]:
    """Fill a fresh queue with `runs` keyed publishes (or, for kind "raw", plain
    `apply_async` calls of a raw no-op task), then drain it through one worker with one
    child; returns publishes per second, runs per second (after the first 1% of runs,
    so without start-up) and a sample at each checkpoint."""
    counter_key = COUNTER if kind == "fenced" else "bench:raw"
    # What a ledgered message carries: a soft time limit of expire_in_seconds (900 s by
    # default) and a hard one 30 s later; "raw-limited" sends raw tasks with the same.
    soft = EXPIRE or DEFAULT_EXPIRE_IN_SECONDS
    limits = (
        {"soft_time_limit": soft, "time_limit": soft + HARD_TIME_LIMIT_GRACE_SECONDS}
        if kind == "raw-limited"
        else {}
    )
    counter = redis.Redis.from_url(redis_url)
    counter.delete(counter_key)
    queue = f"bench-memory-{uuid.uuid4().hex[:6]}"
    run = uuid.uuid4().hex[:8]
    client = app.questpie.queue.bench_noop
    started = time.perf_counter()
    for first in range(0, runs, CHUNK):
        count = min(CHUNK, runs - first)
        if kind != "fenced":
            with app.celery_app.producer_or_acquire() as producer:
                for i in range(count):
                    app.raw.apply_async(
                        args=[{"n": first + i}], queue=queue, producer=producer, **limits
                    )
            continue
        client.publish_many(
            [{"n": first + i} for i in range(count)],
            idempotency_keys=[f"memory-{run}-{first + i}" for i in range(count)],
            queue=queue,
            expire_in_seconds=EXPIRE,
        )
    fill_rate = runs / (time.perf_counter() - started)
    worker = Worker(env, concurrency=1, queues=queue, app="bench.memory_app:celery_app")
    worker.start()
    assert worker.proc is not None
    main_pid = worker.proc.pid
    samples: list[Sample] = []
    warm = max(runs // 100, 1)
    warm_at: float | None = None
    warm_done = 0
    began = time.perf_counter()
    try:
        pending = list(checkpoints)
        last_done, last_progress = 0, began
        while pending:
            done = int(counter.get(counter_key) or 0)
            now = time.perf_counter()
            if done != last_done:
                last_done, last_progress = done, now
            elif now - last_progress > 60:
                raise RuntimeError(
                    f"no run finished for 60 s, after {done}:\n{worker.log()[-3000:]}"
                )
            if warm_at is None and done >= warm:
                warm_at, warm_done = now, done
            if done >= pending[0]:
                pending.pop(0)
                child = only_child(main_pid)
                samples.append(
                    Sample(
                        done,
                        now - began,
                        *memory(child),
                        *memory(main_pid),
                        child,
                    )
                )
                print(f"  {samples[-1]}", flush=True)
                continue
            if not worker.alive():
                raise RuntimeError(f"the worker died after {done} runs:\n{worker.log()[-3000:]}")
            time.sleep(0.02)
        finished = time.perf_counter()
    finally:
        worker.stop()
        counter.delete(queue)
        Path(worker.log_path).unlink(missing_ok=True)
    assert warm_at is not None
    drain_rate = (runs - warm_done) / max(finished - warm_at, 1e-9)
    return fill_rate, drain_rate, samples


def only_child(pid: int) -> int:
    """The pid of the one pool process of a worker whose main process is `pid`."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The fields after the command's closing parenthesis: state, ppid, ...
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    if len(children) != 1:
        raise RuntimeError(f"worker {pid} has children {children}, not one")
    return children[0]


def memory(pid: int) -> tuple[int, int]:
    """VmRSS and RssAnon of a process, in kB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in {"VmRSS", "RssAnon"}:
            fields[name] = int(value.split()[0])
    return fields["VmRSS"], fields["RssAnon"]


def report(what: str, samples: list[Sample], rate: float, runs: int) -> None:
    print(f"\nworker RSS, prefork with one child, {runs:,} {what} at {rate:.0f}/s")
    print("| runs | child VmRSS MiB | child RssAnon MiB | main VmRSS MiB | main RssAnon MiB |")
    print("|---|---|---|---|---|")
    for s in samples:
        print(
            f"| {s.runs:,} | {s.child_rss / 1024:.1f} | {s.child_anon / 1024:.1f} | "
            f"{s.main_rss / 1024:.1f} | {s.main_anon / 1024:.1f} |"
        )
    if len({s.child_pid for s in samples}) != 1:
        print("the pool child was replaced during the run; figures mix processes")
    first, last = samples[0], samples[-1]
    per_10k = 10_000 / max(last.runs - first.runs, 1)
    for process, a, b in (
        ("child", first.child_rss, last.child_rss),
        ("main", first.main_rss, last.main_rss),
    ):
        print(
            f"{process}: {a / 1024:.1f} MiB at {first.runs:,} runs, {b / 1024:.1f} MiB at "
            f"{last.runs:,}: {100 * (b - a) / a:+.1f}%, {(b - a) * per_10k:+.0f} kB per 10k runs"
        )


def trace(app: Any, redis_url: str, env: dict[str, str], runs: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="qp-trace-"))
    traced = {
        **env,
        "BENCH_TRACEMALLOC": f"{FIRST},{runs}",
        "BENCH_TRACEMALLOC_DIR": str(folder),
    }
    try:
        # One child runs one task at a time, so once run N + 10 has finished, the
        # child's snapshot after run N and the main process's after receiving N are on
        # disk.
        drain(app, redis_url, traced, runs + 20, [runs + 10])
        for process in ("child", "main"):
            (before,) = folder.glob(f"{process}-*-{FIRST}.snap")
            (after,) = folder.glob(f"{process}-*-{runs}.snap")
            old = tracemalloc.Snapshot.load(str(before))
            new = tracemalloc.Snapshot.load(str(after))
            print(f"\ntracemalloc in the {process} process, {FIRST:,} -> {runs:,} tasks:")
            print(f"  traced total {total(old) / 1024:.0f} kB -> {total(new) / 1024:.0f} kB")
            print("  largest growth by allocating line:")
            for stat in new.compare_to(old, "lineno")[:12]:
                print(f"    {stat}")
            print("  largest growth by call stack:")
            for stat in new.compare_to(old, "traceback")[:4]:
                print(f"    {stat.size_diff / 1024:+.1f} kB in {stat.count_diff:+} blocks")
                for line in stat.traceback.format(limit=14, most_recent_first=True):
                    print(f"      {line}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def total(snapshot: tracemalloc.Snapshot) -> int:
    return sum(stat.size for stat in snapshot.statistics("filename"))


if __name__ == "__main__":
    main()
