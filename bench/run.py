"""Benchmark questpie_celery against raw Celery, in one run, on PostgreSQL and Redis.

    .venv/bin/python bench/run.py            # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=7 .venv/bin/python bench/run.py

Publish costs are measured interleaved (raw, then each questpie mode, round after
round) and reported as the ratio of medians to raw `apply_async` of a task on the
same broker. Worker throughput drains the same number of raw and ledgered no-op
messages through one prefork worker (2 children) and reports ledgered / raw.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questpie_celery.ids import random_dispatch_id  # noqa: E402
from questpie_celery.ledger import NewDispatch, open_ledger  # noqa: E402
from questpie_celery.options import StoredOptions  # noqa: E402
from tests.support.services import PostgresServer, RedisServer, Worker  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
PUBLISHES = int(os.environ.get("BENCH_PUBLISHES", "300"))
DRAIN = int(os.environ.get("BENCH_DRAIN", "1000"))


def timed(batch: Callable[[int], object], count: int) -> float:
    started = time.perf_counter()
    for i in range(count):
        batch(i)
    return (time.perf_counter() - started) / count


def main() -> None:
    postgres = PostgresServer(durable=bool(os.environ.get("BENCH_DURABLE"))).start()
    redis_server = RedisServer().start()
    try:
        pg_url, redis_url = postgres.url(), redis_server.url()
        os.environ["BENCH_BROKER"] = redis_url
        os.environ["BENCH_LEDGER"] = pg_url
        app = importlib.import_module("bench.app")  # configured by the variables above
        app.questpie.migrate()
        results = publish_costs(app, pg_url)
        throughput = worker_throughput(app, redis_url, pg_url)
        app.questpie.close()
    finally:
        redis_server.close()
        postgres.close()
    print_table(results, throughput)


def publish_costs(bench_app: Any, pg_url: str) -> dict[str, float]:
    raw_task = bench_app.raw
    client = bench_app.questpie.queue.bench_noop
    ledger = open_ledger(pg_url)
    # Nobody consumes this queue during the publish benchmark.
    queue = f"bench-idle-{uuid.uuid4().hex[:6]}"
    run = uuid.uuid4().hex[:8]
    repeated_key = f"repeat-{run}"
    client.publish({"n": 0}, idempotency_key=repeated_key, queue=queue)
    exclusive = bench_app.questpie.queue.bench_exclusive

    def bare_insert(i: int) -> bool:
        return ledger.insert(
            NewDispatch(
                id=random_dispatch_id(),
                job_name="bench.noop",
                payload={"n": i},
                options=StoredOptions(queue=queue),
            )
        )

    taken = f"taken-{run}"
    exclusive.publish({"n": 0}, singleton_key=taken, queue=queue)
    modes: dict[str, Callable[[int], object]] = {
        "raw apply_async": lambda i: raw_task.apply_async(args=[{"n": i}], queue=queue),
        "publish, no key": lambda i: client.publish({"n": i}, queue=queue),
        "publish, new key": lambda i: client.publish(
            {"n": i}, idempotency_key=f"{run}-{uuid.uuid4().hex}", queue=queue
        ),
        "publish, repeated key": lambda i: client.publish(
            {"n": i}, idempotency_key=repeated_key, queue=queue
        ),
        "exclusive job, accepted": lambda i: exclusive.publish(
            {"n": i}, singleton_key=f"{run}-{uuid.uuid4().hex}", queue=queue
        ),
        "exclusive job, suppressed": lambda i: exclusive.publish(
            {"n": i}, singleton_key=taken, queue=queue
        ),
        "secret publish, new key": lambda i: bench_app.questpie.queue.bench_secret.publish(
            {"n": i},
            idempotency_key=f"{run}-{uuid.uuid4().hex}",
            queue=queue,
            secret_payload=True,
        ),
        # What a new key adds to a publish: one ledger INSERT round trip. The floor of
        # any ledger-first design is the two round trips back to back.
        "ledger INSERT alone": bare_insert,
        "ledger INSERT, then raw apply_async": lambda i: (
            bare_insert(i),
            raw_task.apply_async(args=[{"n": i}], queue=queue),
        ),
    }
    for mode in modes.values():  # warm up connections and caches
        timed(mode, 20)
    samples: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(ROUNDS):
        for name, mode in modes.items():
            samples[name].append(timed(mode, PUBLISHES))
    bench_app.celery_app.connection_for_write().default_channel.client.delete(queue)
    ledger.close()
    return {name: statistics.median(values) for name, values in samples.items()}


def worker_throughput(bench_app: Any, redis_url: str, pg_url: str) -> dict[str, float]:
    counter = redis.Redis.from_url(redis_url)
    rates: dict[str, list[float]] = {"raw": [], "ledgered": [], "secret": []}
    for _ in range(max(ROUNDS // 2, 1)):
        for kind, samples in rates.items():
            queue = f"bench-drain-{uuid.uuid4().hex[:6]}"
            counter.delete("bench:raw", "bench:noop", "bench:secret")
            run = uuid.uuid4().hex[:8]
            for i in range(DRAIN):
                if kind == "raw":
                    bench_app.raw.apply_async(args=[{"n": i}], queue=queue)
                else:
                    client = bench_app.questpie.queue[
                        "bench.noop" if kind == "ledgered" else "bench.secret"
                    ]
                    client.publish(
                        {"n": i},
                        idempotency_key=f"drain-{run}-{i}",
                        queue=queue,
                        secret_payload=kind == "secret",
                    )
            worker = Worker(
                {"BENCH_BROKER": redis_url, "BENCH_LEDGER": pg_url},
                concurrency=2,
                queues=queue,
                app="bench.app:celery_app",
            )
            worker.start()
            key = {"raw": "bench:raw", "ledgered": "bench:noop", "secret": "bench:secret"}[kind]
            started = time.perf_counter()
            first_seen = None
            while int(counter.get(key) or 0) < DRAIN:
                if first_seen is None and int(counter.get(key) or 0) > 0:
                    first_seen = time.perf_counter()
                time.sleep(0.01)
            finished = time.perf_counter()
            worker.stop()
            # Time from the first finished run to the last excludes worker start-up.
            begin = first_seen if first_seen is not None else started
            samples.append(DRAIN / max(finished - begin, 1e-9))
    return {kind: statistics.median(values) for kind, values in rates.items()}


def print_table(costs: dict[str, float], throughput: dict[str, float]) -> None:
    raw = costs["raw apply_async"]
    goals = {
        "publish, no key": "<= 1.10x",
        "publish, new key": "<= 1.5x",
        "publish, repeated key": "<= 0.5x",
        "exclusive job, accepted": "(measured)",
        "exclusive job, suppressed": "(measured)",
        "ledger INSERT alone": "(for reference)",
        "ledger INSERT, then raw apply_async": "(the floor for a new key)",
    }
    print(
        f"\n{ROUNDS} interleaved rounds of {PUBLISHES} publishes; PostgreSQL ledger, Redis broker"
    )
    print("| measure | per call | ratio to raw Celery | goal |")
    print("|---|---|---|---|")
    print(f"| raw `apply_async` | {raw * 1e6:.0f} µs | 1.00x | |")
    for name, goal in goals.items():
        print(f"| `{name}` | {costs[name] * 1e6:.0f} µs | {costs[name] / raw:.2f}x | {goal} |")
    ratio = throughput["ledgered"] / throughput["raw"]
    print(
        f"| worker throughput, fenced no-op jobs ({DRAIN} each, 2 children) | "
        f"{throughput['ledgered']:.0f}/s vs {throughput['raw']:.0f}/s raw | "
        f"{ratio:.2f}x | >= 0.6x |"
    )
    secret_publish = costs["secret publish, new key"] / costs["publish, new key"]
    secret_run = throughput["secret"] / throughput["ledgered"]
    print("\nSecret payloads, against the same job without secret_payload")
    print("| measure | secret | plain | ratio |")
    print("|---|---|---|---|")
    print(
        f"| publish, new key | {costs['secret publish, new key'] * 1e6:.0f} µs | "
        f"{costs['publish, new key'] * 1e6:.0f} µs | {secret_publish:.2f}x |"
    )
    print(
        f"| worker throughput | {throughput['secret']:.0f}/s | "
        f"{throughput['ledgered']:.0f}/s | {secret_run:.2f}x |"
    )


if __name__ == "__main__":
    main()
