"""Fenced worker throughput against raw Celery, as a user's worker meets it.

    .venv/bin/python bench/worker.py         # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=5 BENCH_DRAIN=2000 .venv/bin/python bench/worker.py

Each round fills a queue with no-op messages and lets one prefork worker (`-c 2`) drain
it, for each kind in turn (interleaved, so a slow moment of the machine hits them all):

- `raw`: a plain Celery task;
- `floor`: a plain Celery task that makes, through the bare driver, the two durable
  writes a fenced run makes (the claim and the outcome): what any fence on a durable
  ledger costs at least;
- `fenced`: a questpie job, every delivery claimed and recorded in the ledger;
- `fenced, relaxed`: the same with `durability="relaxed"` on the worker.

Rates count from the first finished run to the last (worker start-up excluded); each is
reported as the median over the rounds with its min-max, and as a ratio to `raw`.
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

from tests.support.services import PostgresServer, RedisServer, Worker  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
DRAIN = int(os.environ.get("BENCH_DRAIN", "2000"))
KINDS = ("raw", "floor", "fenced", "fenced, relaxed")
COUNTERS = {
    "raw": "bench:raw",
    "floor": "bench:raw_two_writes",
    "fenced": "bench:noop",
    "fenced, relaxed": "bench:noop",
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
        for _ in range(ROUNDS):
            for kind in KINDS:
                rates[kind].append(drain(app, kind, redis_url, pg_url))
        app.questpie.close()
    finally:
        redis_server.close()
        postgres.close()
    print_table(rates)


def fill(bench_app: Any, kind: str, queue: str) -> None:
    client = bench_app.questpie.queue.bench_noop
    payloads = [{"n": i} for i in range(DRAIN)]
    keys = [f"{uuid.uuid4().hex}-{i}" for i in range(DRAIN)]
    if kind.startswith("fenced"):
        client.publish_many(payloads, idempotency_keys=keys, queue=queue)
        return
    producer_app = bench_app.celery_app
    if kind == "floor":
        # Rows for the floor's writes to update, their messages left on a queue nobody reads.
        idle = f"bench-idle-{uuid.uuid4().hex[:6]}"
        ids = client.publish_many(payloads, idempotency_keys=keys, queue=idle)
        bench_app.questpie.flush(120)  # their sends made before the queue is dropped
        producer_app.connection_for_write().default_channel.client.delete(idle)
        with producer_app.producer_or_acquire() as producer, producer.batch(max_size=DRAIN):
            for dispatch_id in ids:
                bench_app.raw_two_writes.apply_async(
                    args=[dispatch_id], queue=queue, producer=producer
                )
        return
    with producer_app.producer_or_acquire() as producer, producer.batch(max_size=DRAIN):
        for payload in payloads:
            bench_app.raw.apply_async(args=[payload], queue=queue, producer=producer)


def drain(bench_app: Any, kind: str, redis_url: str, pg_url: str) -> float:
    counter = redis.Redis.from_url(redis_url)
    key = COUNTERS[kind]
    counter.delete(key)
    queue = f"bench-drain-{uuid.uuid4().hex[:6]}"
    fill(bench_app, kind, queue)
    # Every message sent and the publisher's batched acceptance marks written before the
    # drain starts.
    bench_app.questpie.flush(120)
    env = {"BENCH_BROKER": redis_url, "BENCH_LEDGER": pg_url}
    if kind == "fenced, relaxed":
        env["BENCH_DURABILITY"] = "relaxed"
    worker = Worker(env, concurrency=2, queues=queue, app="bench.app:celery_app")
    worker.start()
    first_seen = None
    while int(counter.get(key) or 0) < DRAIN:
        if first_seen is None and int(counter.get(key) or 0) > 0:
            first_seen = time.perf_counter()
        time.sleep(0.005)
    finished = time.perf_counter()
    worker.stop()
    return DRAIN / max(finished - (first_seen or finished), 1e-9)


def print_table(rates: dict[str, list[float]]) -> None:
    raw = statistics.median(rates["raw"])
    print(
        f"\n{ROUNDS} interleaved rounds, {DRAIN} no-op messages each, one prefork worker "
        "(-c 2); PostgreSQL with default durability, Redis"
    )
    print("| kind | runs/s, median (min-max) | / raw |")
    print("|---|---|---|")
    for kind, values in rates.items():
        median = statistics.median(values)
        print(
            f"| {kind} | {median:.0f} ({min(values):.0f}-{max(values):.0f}) | {median / raw:.2f}x |"
        )


if __name__ == "__main__":
    main()
