"""An adopted Celery task's keyed `delay()` against a job's keyed `publish()` and raw
`delay()`, until the broker has every message, in one run.

    .venv/bin/python bench/adopted.py          # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=9 BENCH_BURST=2000 .venv/bin/python bench/adopted.py

`bench.adopted` is a plain Celery task with `base=LedgerTask` and a key template over
one of its arguments: each `delay(n, key)` serializes the call with the app's serializer,
writes its row and leaves the send to the process's send thread, as a job's `publish()`
does with its validated payload. The goal: the adopted path within 1.10x of the job's.
Measures are interleaved round by round; figures are medians with their min-max, ratios
the median of the per-round ratios. PostgreSQL runs at its default durability.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import until_sent  # noqa: E402
from tests.support.services import PostgresServer, RedisServer  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "7"))
BURST = int(os.environ.get("BENCH_BURST", "1000"))


def main() -> None:
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    try:
        os.environ["BENCH_BROKER"] = redis_server.url()
        os.environ["BENCH_LEDGER"] = postgres.url()
        app = importlib.import_module("bench.app")  # configured by the variables above
        app.questpie.migrate()
        samples = bursts(app)
        app.questpie.close()
    finally:
        redis_server.close()
        postgres.close()
    report(samples)


def bursts(app: Any) -> dict[str, list[float]]:
    queue = f"bench-idle-{uuid.uuid4().hex[:6]}"  # nobody consumes it
    client = app.questpie.queue.bench_noop

    def flushed(burst: Callable[[int], None]) -> Callable[[], None]:
        def run() -> None:
            burst(BURST)
            if not until_sent(app.questpie):
                raise RuntimeError("the sends did not finish in 120 s")

        return run

    def raw(count: int) -> None:
        for i in range(count):
            app.raw.apply_async(args=[{"n": i}], queue=queue)

    def job(count: int) -> None:
        for i in range(count):
            client.publish({"n": i}, idempotency_key=uuid.uuid4().hex, queue=queue)

    def adopted(count: int) -> None:
        for i in range(count):
            app.adopted.apply_async((i, uuid.uuid4().hex), queue=queue)

    measures: dict[str, Callable[[], object]] = {
        "raw apply_async": lambda: raw(BURST),
        "job: publish(), new key, until sent": flushed(job),
        "adopted: apply_async(), key from its argument, until sent": flushed(adopted),
    }
    names = list(measures)
    for measure in measures.values():  # warm up connections and caches
        measure()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(ROUNDS):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            started = time.perf_counter()
            measures[name]()
            samples[name].append(time.perf_counter() - started)
    app.celery_app.connection_for_write().default_channel.client.delete(queue)
    return samples


def report(samples: dict[str, list[float]]) -> None:
    raw = samples["raw apply_async"]
    job = samples["job: publish(), new key, until sent"]
    print(f"\n{ROUNDS} interleaved rounds of {BURST} calls; PostgreSQL (default durability), Redis")
    print("| measure | burst, median (min-max) ms | / raw | / the job's publish |")
    print("|---|---|---|---|")
    for name, times in samples.items():
        to_raw = [t / r for t, r in zip(times, raw, strict=True)]
        to_job = [t / j for t, j in zip(times, job, strict=True)]
        print(
            f"| `{name}` | {statistics.median(times) * 1000:.0f} "
            f"({min(times) * 1000:.0f}-{max(times) * 1000:.0f}) "
            f"| {statistics.median(to_raw):.2f}x ({min(to_raw):.2f}-{max(to_raw):.2f}) "
            f"| {statistics.median(to_job):.2f}x ({min(to_job):.2f}-{max(to_job):.2f}) |"
        )


if __name__ == "__main__":
    main()
