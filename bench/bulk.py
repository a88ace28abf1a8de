"""Bulk publishing against raw Celery, in one run, on PostgreSQL and Redis.

    .venv/bin/python bench/bulk.py           # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=7 BENCH_BULK=1000 .venv/bin/python bench/bulk.py

PostgreSQL runs with its default durability. Each round times, interleaved: N raw
`apply_async` calls (what a Celery `group` of N costs to send), N `publish()` calls
with new keys, one `publish_many` of N new keys, the same `publish_many` again (every
key known), and the floors of a bulk publish: one N-row insert through the bare driver,
and N raw sends pipelined over one producer. Figures are medians over the rounds with
their min-max, as ratios to the N raw `apply_async` calls.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import until_sent  # noqa: E402
from questpie_celery.jobs.ids import random_dispatch_id  # noqa: E402
from tests.support.services import PostgresServer, RedisServer  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
COUNT = int(os.environ.get("BENCH_BULK", "1000"))

DRIVER_INSERT = (
    "INSERT INTO questpie_queue_dispatch (id, job_name, status, payload, options, attempt, "
    "send_count, created_at, run_after, next_send_at, secret) "
    "SELECT id, 'bench.noop', 'pending', payload, '{}', 0, 0, now(), now(), "
    "now() + interval '30 s', false FROM unnest(%s::varchar[], %s::json[]) AS r(id, payload) "
    "ON CONFLICT DO NOTHING RETURNING id"
)


def main() -> None:
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    try:
        pg_url = postgres.url()
        os.environ["BENCH_BROKER"] = redis_server.url()
        os.environ["BENCH_LEDGER"] = pg_url
        app = importlib.import_module("bench.app")
        app.questpie.migrate()
        samples = bulk_costs(app, pg_url)
        app.questpie.close()
    finally:
        redis_server.close()
        postgres.close()
    print_table(samples)


def bulk_costs(bench_app: Any, pg_url: str) -> dict[str, list[float]]:
    raw_task = bench_app.raw
    celery_app = bench_app.celery_app
    client = bench_app.questpie.queue.bench_noop
    queue = f"bench-idle-{uuid.uuid4().hex[:6]}"
    driver = psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"))
    driver.autocommit = True
    payloads = [{"n": i} for i in range(COUNT)]
    known: list[list[str]] = []

    def raw_calls() -> None:
        for payload in payloads:
            raw_task.apply_async(args=[payload], queue=queue)

    def publish_calls() -> None:
        run = uuid.uuid4().hex
        for i, payload in enumerate(payloads):
            client.publish(payload, idempotency_key=f"{run}-{i}", queue=queue)

    def publish_many_new() -> None:
        keys = [f"{uuid.uuid4().hex}-{i}" for i in range(COUNT)]
        client.publish_many(payloads, idempotency_keys=keys, queue=queue)
        known.append(keys)

    def publish_many_known() -> None:
        client.publish_many(payloads, idempotency_keys=known[-1], queue=queue)

    def driver_insert() -> None:
        ids = [random_dispatch_id() for _ in payloads]
        driver.execute(DRIVER_INSERT, (ids, [json.dumps(p) for p in payloads])).fetchall()

    def pipelined_sends() -> None:
        with celery_app.producer_or_acquire() as producer, producer.batch(max_size=COUNT):
            for payload in payloads:
                raw_task.apply_async(args=[payload], queue=queue, producer=producer)

    modes: dict[str, Callable[[], None]] = {
        f"{COUNT} raw apply_async": raw_calls,
        f"{COUNT} publish(), new keys": publish_calls,
        f"publish_many of {COUNT} new keys": publish_many_new,
        f"publish_many of {COUNT} known keys": publish_many_known,
        f"floor: driver {COUNT}-row INSERT": driver_insert,
        f"floor: {COUNT} raw sends, pipelined": pipelined_sends,
    }
    for mode in modes.values():  # warm up connections and caches
        mode()
    samples: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(ROUNDS):
        for name, mode in modes.items():
            started = time.perf_counter()
            mode()
            # Until the broker has every message: a ledgered publish sends after it returns.
            until_sent(bench_app.questpie)
            samples[name].append(time.perf_counter() - started)
            # The acceptance marks batched in the background are written now, off the
            # clock, rather than during the next mode.
            bench_app.questpie.flush(120)
    celery_app.connection_for_write().default_channel.client.delete(queue)
    driver.close()
    return samples


def print_table(samples: dict[str, list[float]]) -> None:
    raw = statistics.median(next(iter(samples.values())))
    print(f"{ROUNDS} rounds of {COUNT} payloads; PostgreSQL with default durability, Redis\n")
    print(f"| {'mode':40} | {'median ms':>9} | {'min-max ms':>13} | {'/ raw':>6} |")
    print(f"|{'-' * 42}|{'-' * 11}|{'-' * 15}|{'-' * 8}|")
    for name, values in samples.items():
        median = statistics.median(values)
        spread = f"{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}"
        print(f"| {name:40} | {median * 1e3:9.1f} | {spread:>13} | {median / raw:5.2f}x |")


if __name__ == "__main__":
    main()
