"""questpie_celery against procrastinate and DBOS Transact, PostgreSQL-native task queues,
end to end, at several worker shapes.

    .venv/bin/pip install -e '.[bench]'      # procrastinate and dbos, pinned
    .venv/bin/python bench/pg_peer.py        # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=1 BENCH_DISPATCHES=200 BENCH_SHAPES=1x2 .venv/bin/python bench/pg_peer.py

The first is the full run (3 rounds of 1000 jobs at four shapes: about 5 minutes on the
2-core machine), the second a smoke of half a minute.

One run, one PostgreSQL with its default durability (fsync and synchronous_commit on),
one Redis. Four systems, each measured as N no-op jobs published from this process with
new keys and run to completion by worker processes started for the measure (and stopped
after it), each job counting its run with a Redis INCR, as bench/run.py's tasks do:

- questpie: `publish(..., idempotency_key=<new key>)`, run by `celery worker` processes
  (prefork, Redis broker), through the fence (claim, then completion, in the ledger);
- raw Celery, for reference: `apply_async`, the same `celery worker`s;
- procrastinate: `configure(queueing_lock=<new key>).defer(...)` (a repeated lock raises
  `AlreadyEnqueued`) through its psycopg 3 connector, its own schema applied in the same
  database, run by `procrastinate worker` processes (jobs are taken by its asyncio loop,
  and a plain function like this one runs in a thread);
- DBOS Transact: `with SetWorkflowID(<new key>): queue.enqueue(noop, n)` (the workflow
  id is the key: a second enqueue of it answers the first workflow), its system database
  a database of its own in the same server, run by DBOS worker processes
  (bench/dbos_app.py), each listening to the queue with `worker_concurrency` = the slots.

Shapes: BENCH_SHAPES (default "1x2,1x4,2x2,2x4") lists PROCESSESxSLOTS, applied to every
system alike: that many worker processes on the measure's queue, each running that many
jobs at once (prefork children for Celery, procrastinate's `--concurrency`, DBOS's
`worker_concurrency`). The benchmark machine has 2 cores: 1x2 gives each slot a core,
the others oversubscribe it as a busier deployment would. All are mostly waiting on
PostgreSQL's commits here. The Celery and procrastinate workers log at info, a line or
two per job; DBOS logs nothing per workflow at info.

DBOS's queues poll: each worker's queue thread looks for work every
`polling_interval_sec` of the queue (DBOS 3 keeps it in the system database with the
queue; 1 s by default) and claims at most its free slots per poll; nothing wakes it
sooner. BENCH_DBOS_POLL (seconds, comma-separated; each value is a system of its own in
the table) sets it. The default here, 0.001 (1 ms, DBOS's floor for its other pollers),
is its best: with DBOS's default of 1 s a worker takes at most `slots` jobs a second
(a smoke at 1x2 and 100 jobs: 2 dispatches/s, against 146 at 1 ms and 98 at 10 ms),
and 1 ms beat 10 ms at 1x2, 1x4 and 2x2 in a smoke of all four shapes (10 ms won at
2x4, with two pollers on two busy cores). Its price: an idle worker polling every 1 ms
takes about half a core (53%, and 11% of one in PostgreSQL; 23% and 5% at 10 ms, 2% and
under 1% at 1 s), which the measure pays too, as a deployment would.

Each figure is dispatches per second from the first publish to the last completed run
(so it counts the publishing, the queue and the runs, overlapped as they are in
production). Before the clock starts every worker process is ready and one job has run,
so their start-up, their connection pools and their LISTEN are out of the figure.
Measures are interleaved round by round (in each round and shape, the systems start one
further along); the table gives, per shape, the median over the rounds with the
min-max, and the ratios of questpie's rate to each other system's as medians of the
per-round ratios. The load average at the start and the end of the run is printed with
it: the machine is shared, and a busy one lowers every figure.

Before the timing, a short check that each guarantee holds through a real worker (one
process, one slot, so runs are in order): the same key published twice, then once more
after the run, and a sentinel job after it, to know that anything sent before it has
run. Publishing the same key twice must run once (the script stops if not): questpie and
DBOS answer the first id, procrastinate raises `AlreadyEnqueued`. Raw Celery has no key;
two sends with one task id run twice, shown for reference. The third call shows the
difference in scope: procrastinate's lock is gone once its job left the queue,
questpie's key and DBOS's workflow id hold for good (as long as the row is kept).

BENCH_ROUNDS (default 3), BENCH_DISPATCHES (jobs per measure, round and shape, default
1000), BENCH_SHAPES and BENCH_DBOS_POLL change its size.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
SHAPES = [
    (int(procs), int(slots))
    for procs, slots in (
        shape.strip().split("x")
        for shape in os.environ.get("BENCH_SHAPES", "1x2,1x4,2x2,2x4").split(",")
    )
]
DBOS_POLLS = [float(s) for s in os.environ.get("BENCH_DBOS_POLL", "0.001").split(",")]

QUESTPIE, RAW, PROCRASTINATE = "questpie", "raw Celery", "procrastinate"


def dbos_kind(poll: float) -> str:
    return f"DBOS (poll {poll * 1000:g} ms)"


DBOS_KINDS = {dbos_kind(poll): poll for poll in DBOS_POLLS}
KINDS = [QUESTPIE, RAW, PROCRASTINATE, *DBOS_KINDS]
COUNTER = {
    QUESTPIE: "bench:noop",
    PROCRASTINATE: "bench:procrastinate",
    RAW: "bench:raw",
    **dict.fromkeys(DBOS_KINDS, "bench:dbos"),
}


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


@dataclass
class DbosWorker(CeleryProcess):
    """A real DBOS worker process (bench/dbos_app.py) listening to one queue; its slots
    are the queue's `worker_concurrency`, registered before it starts."""

    env: dict[str, str]
    queue: str
    log_path: Path = field(default_factory=lambda: Path(tempfile.mktemp(prefix="qp-dbos-")))
    proc: subprocess.Popen[bytes] | None = None
    cwd: Path = ROOT
    pythonpath: str = str(ROOT)

    def start(self, timeout: float = 60.0) -> DbosWorker:
        cmd = [sys.executable, "-c", "from bench.dbos_app import main; main()", self.queue]
        self._launch(cmd, ready="dbos worker ready", what="DBOS worker", timeout=timeout)
        return self


AnyWorker = Worker | ProcrastinateWorker | DbosWorker


class Fleet:
    """Worker processes started together and stopped together (in threads: each takes
    seconds to start and to stop on its own)."""

    def __init__(self, workers: list[AnyWorker]) -> None:
        self.workers = workers
        with ThreadPoolExecutor(len(workers)) as pool:
            started = [pool.submit(worker.start) for worker in workers]
        errors = [error for future in started if (error := future.exception()) is not None]
        if errors:
            self.stop()
            raise errors[0]

    def stop(self) -> None:
        with ThreadPoolExecutor(len(self.workers)) as pool:
            list(pool.map(lambda worker: worker.stop(), self.workers))


class Systems:
    """The systems' publish calls and workers, on one PostgreSQL and one Redis."""

    def __init__(self, pg_url: str, redis_url: str) -> None:
        self.env = {"BENCH_BROKER": redis_url, "BENCH_LEDGER": pg_url}
        os.environ.update(self.env)
        # Imported once the variables above configure them.
        self.apps: Any = importlib.import_module("bench.pg_peer_app")
        self.apps.questpie.migrate()
        self.apps.app.open()
        self.apps.app.schema_manager.apply_schema()
        self.dbos: Any = importlib.import_module("bench.dbos_app")
        # This process only enqueues: it listens to no queue.
        self.dbos.launch("bench-publisher", [])
        self.dbos_queues: dict[str, Any] = {}
        self.counter = redis.Redis.from_url(redis_url)

    def close(self) -> None:
        self.dbos.shutdown()
        self.apps.app.close()
        self.apps.questpie.close()

    def publisher(self, kind: str, queue: str, slots: int) -> Callable[[int, str], str]:
        """Send job `n` with key `key` (raw Celery has none: the key is its task id);
        answer what the call answered. DBOS's queue is registered here, with `slots`
        as each worker's concurrency and the kind's poller."""
        if kind == QUESTPIE:
            client = self.apps.questpie.queue.bench_noop
            return lambda n, key: str(client.publish({"n": n}, idempotency_key=key, queue=queue))
        if kind == PROCRASTINATE:
            task = self.apps.noop
            return lambda n, key: str(task.configure(queueing_lock=key, queue=queue).defer(n=n))
        if kind in DBOS_KINDS:
            registered = self.dbos.register(queue, slots, DBOS_KINDS[kind])
            self.dbos_queues[queue] = registered
            return lambda n, key: self.dbos.enqueue(registered, n, key)
        raw = self.apps.raw
        return lambda n, key: str(raw.apply_async(args=[{"n": n}], task_id=key, queue=queue).id)

    def workers(self, kind: str, queue: str, procs: int, slots: int) -> Fleet:
        def one() -> AnyWorker:
            if kind == PROCRASTINATE:
                return ProcrastinateWorker(self.env, queue=queue, concurrency=slots)
            if kind in DBOS_KINDS:
                return DbosWorker(self.env, queue=queue)
            return Worker(
                self.env, concurrency=slots, queues=queue, app="bench.pg_peer_app:celery_app"
            )

        return Fleet([one() for _ in range(procs)])

    def send_sentinel(self, kind: str, queue: str) -> None:
        if kind == PROCRASTINATE:
            self.apps.sentinel.configure(queue=queue).defer()
        elif kind in DBOS_KINDS:
            self.dbos_queues[queue].enqueue(self.dbos.sentinel)
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
        publish = self.publisher(kind, queue, 1)

        def call() -> str:
            try:
                return publish(-1, key)[:8]
            except AlreadyEnqueued:
                return "AlreadyEnqueued"

        first, second = call(), call()
        fleet = self.workers(kind, queue, 1, 1)
        try:
            self.send_sentinel(kind, queue)
            self.wait_for(self.apps.SENTINEL, 1)
            twice = self.runs(COUNTER[kind])
            third = call()
            self.send_sentinel(kind, queue)
            self.wait_for(self.apps.SENTINEL, 2)
            thrice = self.runs(COUNTER[kind])
        finally:
            fleet.stop()
            self.counter.delete(queue)
        if kind != RAW and twice != 1:
            raise RuntimeError(f"{kind}: the same key published twice ran {twice} times")
        return (
            f"{kind + ':':20s} 1st {first}; 2nd {second}; runs {twice}. "
            f"After the run: 3rd {third}; runs {thrice}"
        )

    def rate(self, kind: str, procs: int, slots: int) -> float:
        """N new keys published and run to completion by `procs` worker processes of
        `slots` each: dispatches per second, from the first publish to the last run."""
        queue, run = f"bench-pg-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:8]
        publish = self.publisher(kind, queue, slots)
        counter = COUNTER[kind]
        fleet = self.workers(kind, queue, procs, slots)
        try:
            # One run first: the workers' pools are open and they are listening.
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
            fleet.stop()
            self.counter.delete(queue)
        return DISPATCHES / elapsed


Samples = dict[tuple[int, int], dict[str, list[float]]]


def main() -> None:
    # A SIGTERM (from `timeout`, say) still stops the servers and the workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_start, began = os.getloadavg(), time.monotonic()
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    try:
        systems = Systems(postgres.url(), redis_server.url())
        try:
            checks = [systems.check(kind) for kind in KINDS]
            samples: Samples = {shape: {kind: [] for kind in KINDS} for shape in SHAPES}
            for round_ in range(ROUNDS):
                for index, shape in enumerate(SHAPES):
                    start = (round_ + index) % len(KINDS)
                    for kind in KINDS[start:] + KINDS[:start]:
                        rate = systems.rate(kind, *shape)
                        samples[shape][kind].append(rate)
                        print(
                            f"round {round_ + 1} {shape[0]}x{shape[1]} {kind}: {rate:.1f}/s",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            systems.close()
    finally:
        redis_server.close()
        postgres.close()
    load_end, took = os.getloadavg(), time.monotonic() - began
    print("\nThe same key twice before the run, once after (one real worker, one slot):")
    for line in checks:
        print(f"  {line}")
    print_table(samples, load_start, load_end, took)


def print_table(
    samples: Samples,
    load_start: tuple[float, float, float],
    load_end: tuple[float, float, float],
    took: float,
) -> None:
    def spread(values: list[float], unit: str = "", digits: int = 0) -> str:
        return (
            f"{statistics.median(values):.{digits}f}{unit} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})"
        )

    def ratio(shape: tuple[int, int], to: str) -> str:
        mine, theirs = samples[shape][QUESTPIE], samples[shape][to]
        return spread([a / b for a, b in zip(mine, theirs, strict=True)], "x", 2)

    def load(figures: tuple[float, float, float]) -> str:
        return " ".join(f"{figure:.2f}" for figure in figures)

    others = [kind for kind in KINDS if kind != QUESTPIE]
    polls = ", ".join(f"{poll * 1000:g} ms" for poll in DBOS_POLLS)
    print(
        f"\n{ROUNDS} interleaved rounds of {DISPATCHES} jobs per system and shape; "
        "PostgreSQL (default durability), Redis broker and counters; "
        f"procrastinate {importlib.metadata.version('procrastinate')}, "
        f"DBOS {importlib.metadata.version('dbos')} (queue polling_interval_sec {polls}), "
        f"celery {importlib.metadata.version('celery')}. "
        f"Load average (1, 5, 15 min) {load(load_start)} at the start, "
        f"{load(load_end)} at the end; {took / 60:.1f} min in all.\n"
    )
    print(
        "Dispatches/s end to end, median (min-max) over the rounds; shape = worker "
        "processes x slots per process.\n"
    )
    header = ["shape", *KINDS, *(f"questpie / {kind}" for kind in others)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for shape in SHAPES:
        cells = [f"{shape[0]}x{shape[1]}"]
        cells += [spread(samples[shape][kind]) for kind in KINDS]
        cells += [ratio(shape, kind) for kind in others]
        print("| " + " | ".join(cells) + " |")
    print(
        "\nquestpie: `publish(idempotency_key=)`, celery worker (prefork); raw Celery: "
        "`apply_async`, celery worker (prefork); procrastinate: `defer()` with "
        "`queueing_lock`, procrastinate worker; DBOS: `SetWorkflowID(key)` + "
        "`Queue.enqueue`, DBOS worker (`worker_concurrency` = slots)."
    )


if __name__ == "__main__":
    main()
