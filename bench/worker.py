"""Fenced worker throughput against raw Celery, as a user's worker meets it.

    .venv/bin/python bench/worker.py         # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=5 BENCH_DRAIN=2000 .venv/bin/python bench/worker.py

Each round fills a queue with no-op messages and lets one prefork worker (`-c 2`) drain
it, for each kind in turn (interleaved, so a slow moment of the machine hits them all):

- `raw`: a plain Celery task;
- `floor`: a plain Celery task that makes, through the bare driver, the two durable
  writes a fenced run makes (the claim and the outcome): what any fence on a durable
  ledger costs at least;
- `floor, our messages`: questpie's own messages (the same `publish_many` as `fenced`:
  header, payload, per-message time limits), run by a worker in which the job is that
  plain two-write task: what the messages cost Celery's worker, without the fence;
- `lean fence`: the same messages through `bench.app.LeanFence`, the least a fence does
  (the header read, the ledger's own claim and outcome statements on the bare driver,
  the row read, the payload validated, the handler run with its context; nothing for
  leases, outages, tracing or errors);
- `fenced`: a questpie job, every delivery claimed and recorded in the ledger;
- `floor, our messages, relaxed`, `lean fence, relaxed` and `fenced, relaxed`: the same
  three on a worker whose writes do not wait for the disk (`durability="relaxed"`; the
  bare driver with `synchronous_commit=off`).

Rates count from the first finished run to the last (worker start-up excluded); each is
reported as the median over the rounds with its min-max, and as a ratio to `raw`. Over the
same span it reads the CPU time of the worker's main process, of its two pool processes,
of PostgreSQL's and of Redis's, and reports each per run: with both cores busy, the CPU a
run costs in all is what sets the rate.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu import CpuMeter  # noqa: E402
from tests.support.services import PostgresServer, RedisServer, Worker, child_pids  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
DRAIN = int(os.environ.get("BENCH_DRAIN", "2000"))
KINDS = (
    "raw",
    "floor",
    "floor, our messages",
    "lean fence",
    "fenced",
    "floor, our messages, relaxed",
    "lean fence, relaxed",
    "fenced, relaxed",
)
COUNTERS = {
    "raw": "bench:raw",
    "floor": "bench:raw_two_writes",
    "floor, our messages": "bench:noop",
    "lean fence": "bench:noop",
    "fenced": "bench:noop",
    "floor, our messages, relaxed": "bench:noop",
    "lean fence, relaxed": "bench:noop",
    "fenced, relaxed": "bench:noop",
}
#: Each kind's own floor: its messages, the fence taken out.
OWN_FLOOR = {
    "lean fence": "floor, our messages",
    "fenced": "floor, our messages",
    "lean fence, relaxed": "floor, our messages, relaxed",
    "fenced, relaxed": "floor, our messages, relaxed",
}


def main() -> None:
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    try:
        pg_url, redis_url = postgres.url(), redis_server.url()
        os.environ["BENCH_BROKER"] = redis_url
        os.environ["BENCH_LEDGER"] = pg_url
        app = importlib.import_module("bench.app")
        app.questpie.migrate()
        rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
        cpu: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
        for _ in range(ROUNDS):
            for kind in KINDS:
                rate, used = drain(app, kind, redis_url, pg_url, postgres, redis_server)
                rates[kind].append(rate)
                cpu[kind].append(used)
        app.questpie.close()
    finally:
        redis_server.close()
        postgres.close()
    print_table(rates)
    print_cpu(cpu)


def fill(bench_app: Any, kind: str, queue: str, count: int = DRAIN) -> None:
    client = bench_app.questpie.queue.bench_noop
    payloads = [{"n": i} for i in range(count)]
    keys = [f"{uuid.uuid4().hex}-{i}" for i in range(count)]
    if kind.startswith(("fenced", "floor, our messages", "lean")):
        client.publish_many(payloads, idempotency_keys=keys, queue=queue)
        return
    producer_app = bench_app.celery_app
    if kind == "floor":
        # Rows for the floor's writes to update, their messages left on a queue nobody reads.
        idle = f"bench-idle-{uuid.uuid4().hex[:6]}"
        ids = client.publish_many(payloads, idempotency_keys=keys, queue=idle)
        bench_app.questpie.flush(120)  # their sends made before the queue is dropped
        producer_app.connection_for_write().default_channel.client.delete(idle)
        with producer_app.producer_or_acquire() as producer, producer.batch(max_size=count):
            for dispatch_id in ids:
                bench_app.raw_two_writes.apply_async(
                    args=[dispatch_id], queue=queue, producer=producer
                )
        return
    with producer_app.producer_or_acquire() as producer, producer.batch(max_size=count):
        for payload in payloads:
            bench_app.raw.apply_async(args=[payload], queue=queue, producer=producer)


def drain(
    bench_app: Any,
    kind: str,
    redis_url: str,
    pg_url: str,
    postgres: PostgresServer,
    redis_server: RedisServer,
) -> tuple[float, dict[str, float]]:
    """Runs per second, and CPU µs per run by group of processes."""
    counter = redis.Redis.from_url(redis_url)
    key = COUNTERS[kind]
    counter.delete(key)
    queue = f"bench-drain-{uuid.uuid4().hex[:6]}"
    fill(bench_app, kind, queue)
    # Every message sent and the publisher's batched acceptance marks written before the
    # drain starts.
    bench_app.questpie.flush(120)
    env = {"BENCH_BROKER": redis_url, "BENCH_LEDGER": pg_url}
    if kind.endswith("relaxed"):
        env["BENCH_DURABILITY"] = "relaxed"
    if kind.startswith("floor, our messages"):
        env["BENCH_NOOP"] = "floor"
    if kind.startswith("lean fence"):
        env["BENCH_NOOP"] = "lean"
    worker = Worker(env, concurrency=2, queues=queue, app="bench.app:celery_app")
    worker.start()
    assert worker.proc is not None and redis_server.proc is not None
    main_pid, redis_pid = worker.proc.pid, redis_server.proc.pid
    postmaster = int((postgres.data / "postmaster.pid").read_text().split()[0])
    meter = CpuMeter(
        {
            "worker main": lambda: [main_pid],
            "pool processes": lambda: child_pids(main_pid),
            "PostgreSQL": lambda: [postmaster, *child_pids(postmaster)],
            "Redis": lambda: [redis_pid],
        }
    )
    first_seen = None
    done_at_start = 0
    while (done := int(counter.get(key) or 0)) < DRAIN:
        if first_seen is None and done > 0:
            first_seen, done_at_start = time.perf_counter(), done
            meter.start()
        time.sleep(0.005)
    finished = time.perf_counter()
    used = meter.stop() if first_seen is not None else {}
    worker.stop()
    runs = max(DRAIN - done_at_start, 1)
    per_run = {name: seconds * 1e6 / runs for name, seconds in used.items()}
    return DRAIN / max(finished - (first_seen or finished), 1e-9), per_run


def print_table(rates: dict[str, list[float]]) -> None:
    raw = statistics.median(rates["raw"])
    floor = statistics.median(rates["floor"])
    print(
        f"\n{ROUNDS} interleaved rounds, {DRAIN} no-op messages each, one prefork worker "
        "(-c 2); PostgreSQL with default durability, Redis"
    )
    print("| kind | runs/s, median (min-max) | / raw | / floor | / its own floor |")
    print("|---|---|---|---|---|")
    for kind, values in rates.items():
        median = statistics.median(values)
        own = OWN_FLOOR.get(kind)
        mine = f"{median / statistics.median(rates[own]):.2f}x" if own else ""
        print(
            f"| {kind} | {median:.0f} ({min(values):.0f}-{max(values):.0f}) "
            f"| {median / raw:.2f}x | {median / floor:.2f}x | {mine} |"
        )


def print_cpu(cpu: dict[str, list[dict[str, float]]]) -> None:
    groups = [name for name in next(iter(cpu.values()))[0] if name != "machine"]
    print("\nCPU per run, µs (median over the rounds)")
    print("| kind | " + " | ".join(groups) + " | all listed | machine |")
    print("|---|" + "---|" * (len(groups) + 2))
    for kind, rounds in cpu.items():
        medians = [statistics.median(r[name] for r in rounds) for name in groups]
        listed = statistics.median(sum(r[name] for name in groups) for r in rounds)
        machine = statistics.median(r["machine"] for r in rounds)
        cells = " | ".join(f"{m:.0f}" for m in medians)
        print(f"| {kind} | {cells} | {listed:.0f} | {machine:.0f} |")


if __name__ == "__main__":
    main()
