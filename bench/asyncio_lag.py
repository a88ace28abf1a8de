"""Publishing from an event loop: the loop's lag and the throughput, on PostgreSQL and Redis.

    .venv/bin/python bench/asyncio_lag.py     # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=7 BENCH_CONCURRENT=200 .venv/bin/python bench/asyncio_lag.py

PostgreSQL runs with its default durability. One event loop serves the whole run, as an
ASGI server's does. Each round, interleaved:

- `apublish`: N tasks publish keyed dispatches (new keys) concurrently, while a ticker
  coroutine sleeps 1 ms at a time and records how late each wake-up is: the loop's lag.
- `publish() in the loop`: the same N publishes made with the blocking `publish()`
  from a coroutine, as code that knows no better would; the ticker measures that too.
- `publish() sequential`: N blocking `publish()` calls one after another, outside the
  loop, the throughput goal.
- `idle loop`: the ticker alone for as long as the apublish burst took: the floor of
  the lag on this machine.
- `raw apply_async`: N raw sends, for scale.
- `apublish, broker down`: BENCH_DOWN_CONCURRENT (20) tasks publish keyed dispatches
  through a second app whose broker nothing listens on, while the ticker runs: the loop's
  lag while the send threads wait out kombu's retries and the rows are left for the
  relay (tests/integration/test_asyncio.py checks that the loop goes on meanwhile; how
  long its other tasks wait is this row's lag).

Printed: median wall time per mode with min-max over the rounds, and the lag's p50,
p99 and max over all of a mode's ticks. `BENCH_GC_FREEZE=1` calls `gc.freeze()` once
the app is loaded, as a server can after start-up: the rare full collection of the
objects loaded at start then no longer lands in a round.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import jobapp  # noqa: E402
from tests.support.services import PostgresServer, RedisServer, free_port  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
COUNT = int(os.environ.get("BENCH_CONCURRENT", "200"))
DOWN_COUNT = int(os.environ.get("BENCH_DOWN_CONCURRENT", "20"))
TICK = 0.001


class Ticker:
    """Sleeps TICK at a time and records each wake-up's lateness."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._stop = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop:
            asked = loop.time()
            await asyncio.sleep(TICK)
            self.lags.append(loop.time() - asked - TICK)

    def stop(self) -> None:
        self._stop = True


async def with_ticker(work: Any) -> tuple[float, list[float]]:
    ticker = Ticker()
    ticking = asyncio.create_task(ticker.run())
    await asyncio.sleep(0.01)  # let it start
    started = time.perf_counter()
    await work()
    elapsed = time.perf_counter() - started
    ticker.stop()
    await ticking
    return elapsed, ticker.lags


async def rounds(
    bench_app: Any, down: Any
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    client = bench_app.questpie.queue.bench_noop
    down_client = down.queue.record
    raw_task = bench_app.raw
    queue = f"bench-idle-{uuid.uuid4().hex[:6]}"

    def keys() -> list[str]:
        run = uuid.uuid4().hex
        return [f"{run}-{i}" for i in range(COUNT)]

    async def apublish() -> None:
        await asyncio.gather(
            *(
                client.apublish({"n": i}, idempotency_key=k, queue=queue)
                for i, k in enumerate(keys())
            )
        )

    async def blocking_in_loop() -> None:
        for i, k in enumerate(keys()):
            client.publish({"n": i}, idempotency_key=k, queue=queue)

    def sequential() -> None:
        for i, k in enumerate(keys()):
            client.publish({"n": i}, idempotency_key=k, queue=queue)

    def raw() -> None:
        for i in range(COUNT):
            raw_task.apply_async(args=[{"n": i}], queue=queue)

    async def apublish_broker_down() -> None:
        run = uuid.uuid4().hex
        await asyncio.gather(
            *(
                down_client.apublish({"tag": run}, idempotency_key=f"{run}-{i}")
                for i in range(DOWN_COUNT)
            )
        )

    times: dict[str, list[float]] = {}
    lags: dict[str, list[float]] = {}
    await apublish()  # warm up: connections, caches, threads
    sequential()
    for _ in range(ROUNDS):
        elapsed, lag = await with_ticker(apublish)
        times.setdefault(f"{COUNT} concurrent apublish", []).append(elapsed)
        lags.setdefault(f"{COUNT} concurrent apublish", []).extend(lag)

        async def idle(span: float = elapsed) -> None:
            await asyncio.sleep(span)

        idle_time, idle_lag = await with_ticker(idle)
        times.setdefault("idle loop (same span)", []).append(idle_time)
        lags.setdefault("idle loop (same span)", []).extend(idle_lag)

        elapsed, lag = await with_ticker(blocking_in_loop)
        times.setdefault(f"{COUNT} publish() in the loop", []).append(elapsed)
        lags.setdefault(f"{COUNT} publish() in the loop", []).extend(lag)

        started = time.perf_counter()
        sequential()
        times.setdefault(f"{COUNT} publish() sequential", []).append(time.perf_counter() - started)

        started = time.perf_counter()
        raw()
        times.setdefault(f"{COUNT} raw apply_async", []).append(time.perf_counter() - started)

        elapsed, lag = await with_ticker(apublish_broker_down)
        times.setdefault(f"{DOWN_COUNT} apublish, broker down", []).append(elapsed)
        lags.setdefault(f"{DOWN_COUNT} apublish, broker down", []).extend(lag)
    await bench_app.questpie.aclose()
    await down.aclose()
    bench_app.celery_app.connection_for_write().default_channel.client.delete(queue)
    return times, lags


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    try:
        os.environ["BENCH_BROKER"] = redis_server.url()
        os.environ["BENCH_LEDGER"] = postgres.url()
        bench_app = importlib.import_module("bench.app")
        bench_app.questpie.migrate()
        # The same ledger, a broker nothing listens on: every send is refused (and said
        # so at WARNING, twice a round: not this benchmark's news).
        logging.getLogger("questpie_celery.send.outbox").setLevel(logging.ERROR)
        _, down = jobapp.build(broker=f"redis://127.0.0.1:{free_port()}/0", ledger=postgres.url())
        if os.environ.get("BENCH_GC_FREEZE"):
            gc.freeze()  # what a server can do once started: see docs/asyncio.md
        try:
            times, lags = asyncio.run(rounds(bench_app, down))
        finally:
            down.close()
        bench_app.questpie.close()
    finally:
        redis_server.close()
        postgres.close()
    sequential = statistics.median(times[f"{COUNT} publish() sequential"])
    print(
        f"{ROUNDS} rounds of {COUNT} keyed publishes; PostgreSQL with default durability, Redis\n"
    )
    print(
        f"| {'mode':32} | {'median ms':>9} | {'min-max ms':>11} | {'/ sequential':>12} "
        f"| {'lag p50 ms':>10} | {'lag p99 ms':>10} | {'lag max ms':>10} |"
    )
    print(f"|{'-' * 34}|{'-' * 11}|{'-' * 13}|{'-' * 14}|{'-' * 12}|{'-' * 12}|{'-' * 12}|")
    for name, values in times.items():
        median = statistics.median(values)
        spread = f"{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}"
        lag = lags.get(name)
        lag_cells = (
            f"{percentile(lag, 0.5) * 1e3:10.2f} | {percentile(lag, 0.99) * 1e3:10.2f} | "
            f"{max(lag) * 1e3:10.2f}"
            if lag
            else f"{'':>10} | {'':>10} | {'':>10}"
        )
        print(
            f"| {name:32} | {median * 1e3:9.1f} | {spread:>11} | {median / sequential:11.2f}x "
            f"| {lag_cells} |"
        )


if __name__ == "__main__":
    main()
