"""Benchmark questpie_celery against raw Celery, in one run, on PostgreSQL and Redis.

    .venv/bin/python bench/run.py            # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=7 .venv/bin/python bench/run.py

PostgreSQL runs with its default durability (fsync and synchronous_commit on), as in
production. Publish costs are measured interleaved (raw, each questpie mode, and each
floor, round after round); every figure is the median over the rounds with its min-max,
as a ratio to raw `apply_async` and to its floor measured in the same run. The floors
use the bare driver (psycopg, autocommit, no SQLAlchemy): one `INSERT ... ON CONFLICT DO
NOTHING RETURNING` of a new row, the same INSERT meeting an existing row, and the new
row's INSERT followed by a raw send. Worker throughput drains the same number of raw
and ledgered no-op messages through one prefork worker (2 children): ledgered / raw.
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

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questpie_celery.jobs.ids import random_dispatch_id  # noqa: E402
from questpie_celery.jobs.options import StoredOptions  # noqa: E402
from questpie_celery.ledger import NewDispatch, open_ledger  # noqa: E402
from tests.support.services import PostgresServer, RedisServer, Worker  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
PUBLISHES = int(os.environ.get("BENCH_PUBLISHES", "300"))
DRAIN = int(os.environ.get("BENCH_DRAIN", "1000"))


def until_sent(questpie: Any) -> bool:
    """Wait until the broker took every message `questpie`'s publishes handed to its send
    thread. Not `questpie.flush()`, which also writes the acceptance marks batched so far:
    work a publish leaves to a background thread, not part of reaching the broker."""
    return bool(questpie._outbox.sent_behind(120))  # the bench looks inside


def timed(batch: Callable[[int], object], count: int, *questpies: Any) -> float:
    """Seconds per call of `batch`, until the broker has every message: a ledgered
    publish returns before its send, so the clock stops once each `Questpie` in
    `questpies` has sent its messages (a raw call sends before it returns)."""
    started = time.perf_counter()
    for i in range(count):
        batch(i)
    for questpie in questpies:
        until_sent(questpie)
    return (time.perf_counter() - started) / count


def main() -> None:
    postgres = PostgresServer(durable=True).start()
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


BARE_INSERT = (
    "INSERT INTO questpie_queue_dispatch (id, job_name, status, payload, options, attempt, "
    "send_count, created_at, run_after, next_send_at, secret) VALUES (%s, 'bench.noop', "
    "'pending', %s, '{}', 0, 0, now(), now(), now() + interval '30 s', false) "
    "ON CONFLICT DO NOTHING RETURNING id"
)


def publish_costs(bench_app: Any, pg_url: str) -> dict[str, list[float]]:
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
        return ledger.dispatches.insert(
            NewDispatch(
                id=random_dispatch_id(),
                job_name="bench.noop",
                payload={"n": i},
                options=StoredOptions(queue=queue),
            )
        )

    driver = psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"))
    driver.autocommit = True
    existing = random_dispatch_id()
    driver.execute(BARE_INSERT, (existing, '{"n": 0}'))

    def driver_insert(i: int) -> object:
        return driver.execute(BARE_INSERT, (random_dispatch_id(), f'{{"n": {i}}}')).fetchone()

    def driver_conflict(i: int) -> object:
        return driver.execute(BARE_INSERT, (existing, f'{{"n": {i}}}')).fetchone()

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
        # Our own ledger's INSERT through SQLAlchemy, for reference.
        "ledger INSERT alone": bare_insert,
        # The floors: what any ledger-first design pays, through the bare driver.
        "floor: driver INSERT": driver_insert,
        "floor: driver conflicting INSERT": driver_conflict,
        "floor: driver INSERT, then raw apply_async": lambda i: (
            driver_insert(i),
            raw_task.apply_async(args=[{"n": i}], queue=queue),
        ),
    }
    for mode in modes.values():  # warm up connections and caches
        timed(mode, 20, bench_app.questpie)
    samples: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(ROUNDS):
        for name, mode in modes.items():
            samples[name].append(timed(mode, PUBLISHES, bench_app.questpie))
    bench_app.celery_app.connection_for_write().default_channel.client.delete(queue)
    ledger.close()
    driver.close()
    return samples


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


def print_table(samples: dict[str, list[float]], throughput: dict[str, float]) -> None:
    raw_floor = "raw apply_async"
    new_floor = "floor: driver INSERT, then raw apply_async"
    repeat_floor = "floor: driver conflicting INSERT"
    rows = {  # each measure and the floor it is held against
        "publish, no key": raw_floor,
        "publish, new key": new_floor,
        "publish, repeated key": repeat_floor,
        "exclusive job, accepted": new_floor,
        "exclusive job, suppressed": repeat_floor,
        "secret publish, new key": new_floor,
        "ledger INSERT alone": "floor: driver INSERT",
        "floor: driver INSERT": "floor: driver INSERT",
        repeat_floor: repeat_floor,
        new_floor: new_floor,
    }
    median = {name: statistics.median(values) for name, values in samples.items()}
    raw = median[raw_floor]

    def spread(name: str) -> str:
        values = samples[name]
        return f"{min(values) * 1e6:.0f}-{max(values) * 1e6:.0f}"

    print(
        f"\n{ROUNDS} interleaved rounds of {PUBLISHES} publishes; PostgreSQL (default "
        "durability) ledger, Redis broker"
    )
    print("| measure | per call, median (min-max) µs | / raw apply_async | / its floor | floor |")
    print("|---|---|---|---|---|")
    print(f"| raw `apply_async` | {raw * 1e6:.0f} ({spread(raw_floor)}) | 1.00x | | |")
    for name, floor in rows.items():
        print(
            f"| `{name}` | {median[name] * 1e6:.0f} ({spread(name)}) | "
            f"{median[name] / raw:.2f}x | {median[name] / median[floor]:.2f}x | {floor} |"
        )
    ratio = throughput["ledgered"] / throughput["raw"]
    print(
        f"| worker throughput, fenced no-op jobs ({DRAIN} each, 2 children) | "
        f"{throughput['ledgered']:.0f}/s vs {throughput['raw']:.0f}/s raw | {ratio:.2f}x | | |"
    )
    secret_run = throughput["secret"] / throughput["ledgered"]
    print(
        f"| worker throughput, secret vs plain fenced jobs | {throughput['secret']:.0f}/s vs "
        f"{throughput['ledgered']:.0f}/s | {secret_run:.2f}x | | |"
    )


if __name__ == "__main__":
    main()
