"""questpie_celery against procrastinate, a PostgreSQL-native task queue, end to end.

    .venv/bin/pip install -e '.[bench]'      # procrastinate, pinned
    .venv/bin/python bench/pg_peer.py        # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=7 BENCH_DISPATCHES=2000 .venv/bin/python bench/pg_peer.py

One run, one PostgreSQL with its default durability (fsync and synchronous_commit on),
one Redis. Three measures, each N no-op jobs published from this process and run to
completion by one worker process started for the measure (and stopped after it), each
job counting its run with a Redis INCR, as bench/run.py's tasks do:

- questpie: `publish(..., idempotency_key=<new key>)`, run by a `celery worker`
  (prefork, Redis broker), through the fence (claim, then completion, in the ledger);
- procrastinate: `configure(queueing_lock=<new key>).defer(...)` (a repeated lock raises
  `AlreadyEnqueued`) through its psycopg 3 connector, its own schema applied in the same
  database, run by `procrastinate worker` (one process: jobs are taken by its asyncio
  loop, and a plain function like this one runs in a thread);
- raw Celery, for reference: `apply_async`, the same `celery worker`.

Each figure is dispatches per second from the first publish to the last completed run
(so it counts the publishing, the queue and the runs, overlapped as they are in
production). Before the clock starts the worker is ready and has run one job, so its
start-up, its connection pools and its LISTEN are out of the figure. Measures are
interleaved round by round (each round starts at the next measure); the table gives the
median over the rounds with the min-max, and the ratios questpie / procrastinate and
questpie / raw as medians of the per-round ratios.

Concurrency: BENCH_CONCURRENCY (default 2) runs at once in each worker: prefork children
for Celery, procrastinate's `--concurrency` for procrastinate. 2 because the benchmark
machine has 2 cores, so each prefork child has a core and neither system is measured
oversubscribed; it is also bench/run.py's worker size, so the figures compare with its
worker throughput. Both are mostly waiting on PostgreSQL's commits here, and both would
go faster with more slots. Both workers log at info, a line or two per job.

Before the timing, a short check that each guarantee holds through a real worker (one
slot, so runs are in order): the same key published twice, then once more after the run,
and a sentinel job after it, to know that anything sent before it has run. Publishing the
same key twice must run once (the script stops if not): questpie answers the first id,
procrastinate raises `AlreadyEnqueued`. Raw Celery has no key; two sends with one task id
run twice, shown for reference. The third call shows the difference in scope:
procrastinate's lock is gone once its job left the queue, questpie's key holds for good.

BENCH_ROUNDS (default 3), BENCH_DISPATCHES (jobs per measure and round, default 1000)
and BENCH_CONCURRENCY change its size.
"""

from __future__ import annotations

import importlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from procrastinate.exceptions import AlreadyEnqueued

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.services import (  # noqa: E402
    CeleryProcess,
    PostgresServer,
    RedisServer,
    Worker,
)

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
DISPATCHES = int(os.environ.get("BENCH_DISPATCHES", "1000"))
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "2"))

QUESTPIE, PROCRASTINATE, RAW = "questpie", "procrastinate", "raw Celery"
COUNTER = {QUESTPIE: "bench:noop", PROCRASTINATE: "bench:procrastinate", RAW: "bench:raw"}


@dataclass
class ProcrastinateWorker(CeleryProcess):
    """A real `procrastinate worker` process running bench/pg_peer_app.py's app."""

    env: dict[str, str]
    queue: str
    concurrency: int = 2
    log_path: Path = field(default_factory=lambda: Path(tempfile.mktemp(prefix="qp-procr-")))
    proc: subprocess.Popen[bytes] | None = None
    cwd: Path = ROOT
    pythonpath: str = str(ROOT)

    def start(self, timeout: float = 60.0) -> ProcrastinateWorker:
        cmd = [
            sys.executable, "-m", "procrastinate", "--log-level=info",
            "--app=bench.pg_peer_app.app", "worker",
            f"--concurrency={self.concurrency}", f"--queues={self.queue}",
        ]  # fmt: skip
        self._launch(cmd, ready="Starting worker on", what="procrastinate worker", timeout=timeout)
        return self


class Systems:
    """The three systems' publish calls and workers, on one PostgreSQL and one Redis."""

    def __init__(self, pg_url: str, redis_url: str) -> None:
        self.env = {"BENCH_BROKER": redis_url, "BENCH_LEDGER": pg_url}
        os.environ.update(self.env)
        # Imported once the variables above configure it.
        self.apps: Any = importlib.import_module("bench.pg_peer_app")
        self.apps.questpie.migrate()
        self.apps.app.open()
        self.apps.app.schema_manager.apply_schema()
        self.counter = redis.Redis.from_url(redis_url)

    def close(self) -> None:
        self.apps.app.close()
        self.apps.questpie.close()

    def publisher(self, kind: str, queue: str) -> Callable[[int, str], str]:
        """Send job `n` with key `key` (raw Celery has none: the key is its task id);
        answer what the call answered."""
        if kind == QUESTPIE:
            client = self.apps.questpie.queue.bench_noop
            return lambda n, key: str(client.publish({"n": n}, idempotency_key=key, queue=queue))
        if kind == PROCRASTINATE:
            task = self.apps.noop
            return lambda n, key: str(task.configure(queueing_lock=key, queue=queue).defer(n=n))
        raw = self.apps.raw
        return lambda n, key: str(raw.apply_async(args=[{"n": n}], task_id=key, queue=queue).id)

    def worker(self, kind: str, queue: str, concurrency: int) -> CeleryProcess:
        if kind == PROCRASTINATE:
            return ProcrastinateWorker(self.env, queue=queue, concurrency=concurrency).start()
        return Worker(
            self.env, concurrency=concurrency, queues=queue, app="bench.pg_peer_app:celery_app"
        ).start()

    def send_sentinel(self, kind: str, queue: str) -> None:
        if kind == PROCRASTINATE:
            self.apps.sentinel.configure(queue=queue).defer()
        else:
            self.apps.celery_sentinel.apply_async(queue=queue)

    def runs(self, name: str) -> int:
        return int(self.counter.get(name) or 0)

    def wait_for(self, name: str, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.runs(name) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: {self.runs(name)} of {count} runs in {timeout} s")
            time.sleep(0.005)

    def check(self, kind: str) -> str:
        """The same key twice, a run, the same key once more: how many runs each gets.
        One worker slot, so a sentinel sent after the calls runs after whatever they sent."""
        queue, key = f"bench-check-{uuid.uuid4().hex[:6]}", f"check-{uuid.uuid4().hex}"
        self.counter.delete(COUNTER[kind], self.apps.SENTINEL)
        publish = self.publisher(kind, queue)

        def call() -> str:
            try:
                return publish(-1, key)[:8]
            except AlreadyEnqueued:
                return "AlreadyEnqueued"

        first, second = call(), call()
        worker = self.worker(kind, queue, concurrency=1)
        try:
            self.send_sentinel(kind, queue)
            self.wait_for(self.apps.SENTINEL, 1)
            twice = self.runs(COUNTER[kind])
            third = call()
            self.send_sentinel(kind, queue)
            self.wait_for(self.apps.SENTINEL, 2)
            thrice = self.runs(COUNTER[kind])
        finally:
            worker.stop()
            self.counter.delete(queue)
        if kind != RAW and twice != 1:
            raise RuntimeError(f"{kind}: the same key published twice ran {twice} times")
        return (
            f"{kind + ':':15s} 1st {first}; 2nd {second}; runs {twice}. "
            f"After the run: 3rd {third}; runs {thrice}"
        )

    def rate(self, kind: str) -> float:
        """N new keys published and run to completion by one worker: dispatches per
        second, from the first publish to the last completed run."""
        queue, run = f"bench-pg-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:8]
        publish = self.publisher(kind, queue)
        counter = COUNTER[kind]
        worker = self.worker(kind, queue, CONCURRENCY)
        try:
            # One run first: the worker's pools are open and it is listening.
            self.counter.delete(counter)
            publish(-1, f"warm-{run}")
            self.wait_for(counter, 1)
            self.counter.delete(counter)
            started = time.perf_counter()
            for n in range(DISPATCHES):
                publish(n, f"{run}-{n}")
            self.wait_for(counter, DISPATCHES)
            elapsed = time.perf_counter() - started
        finally:
            worker.stop()
            self.counter.delete(queue)
        return DISPATCHES / elapsed


def main() -> None:
    # A SIGTERM (from `timeout`, say) still stops the servers and the worker.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    try:
        systems = Systems(postgres.url(), redis_server.url())
        checks = [systems.check(kind) for kind in (QUESTPIE, PROCRASTINATE, RAW)]
        kinds = [QUESTPIE, PROCRASTINATE, RAW]
        samples: dict[str, list[float]] = {kind: [] for kind in kinds}
        for round_ in range(ROUNDS):
            start = round_ % len(kinds)
            for kind in kinds[start:] + kinds[:start]:
                samples[kind].append(systems.rate(kind))
        systems.close()
    finally:
        redis_server.close()
        postgres.close()
    print("\nThe same key twice before the run, once after (one real worker, one slot):")
    for line in checks:
        print(f"  {line}")
    print_table(samples)


def print_table(samples: dict[str, list[float]]) -> None:
    def spread(values: list[float], unit: str = "", digits: int = 0) -> str:
        return (
            f"{statistics.median(values):.{digits}f}{unit} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})"
        )

    def ratio(kind: str, to: str) -> str:
        return spread([a / b for a, b in zip(samples[kind], samples[to], strict=True)], "x", 2)

    print(
        f"\n{ROUNDS} interleaved rounds of {DISPATCHES} jobs, one worker of {CONCURRENCY} "
        "slots each; PostgreSQL (default durability), Redis broker and counters"
    )
    print("| measure | dispatches/s end to end: median (min-max) | questpie's rate / its |")
    print("|---|---|---|")
    labels = {
        QUESTPIE: "questpie `publish(idempotency_key=)`, celery worker (prefork)",
        PROCRASTINATE: "procrastinate `defer()` with `queueing_lock`, procrastinate worker",
        RAW: "raw Celery `apply_async`, celery worker (prefork)",
    }
    for kind, label in labels.items():
        against = ratio(QUESTPIE, kind) if kind != QUESTPIE else ""
        print(f"| {label} | {spread(samples[kind])} | {against} |")


if __name__ == "__main__":
    main()
