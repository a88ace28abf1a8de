"""A burst of keyed publishes, timed until the broker has every message, against raw Celery.

    .venv/bin/python bench/burst.py          # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=9 BENCH_BURST=2000 .venv/bin/python bench/burst.py

A ledgered `publish()` returns once its row is durable and leaves the send to a thread of
the process, so a per-call time (bench/run.py) says when the caller may go on, not when
the work reached the broker. This measures the second: N `publish()` calls with new
idempotency keys, then `questpie.flush()`, which returns once every message was accepted
by the broker, against N raw `apply_async` calls (each of which returns once its message
was accepted). Also with `durability="relaxed"` (commits that do not wait for the disk),
and from 8 threads of one process (N in all) against 8 threads of raw `apply_async`.
Each measure also reports this process's CPU time per call (every thread's): with one
GIL, a burst takes at least its CPU time.

PostgreSQL runs with its default durability (fsync and synchronous_commit on). The
measures are interleaved round by round, each round starting at the next measure; each
figure is the median over the rounds with its min-max, and the ratio to raw is the median
of the per-round ratios. The floor is measured in the same run: the bare driver's INSERT
of each row (psycopg, autocommit) and then a raw send, one after the other; and the bare
INSERTs alone: the commits a durable publish waits for, one after another, whatever runs
beside them. Also the same N keyed payloads in ONE `publish_many`, until sent, against the
N raw calls (its floors are bench/bulk.py's: one N-row INSERT, N pipelined raw sends).
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Any

import psycopg
from celery import Celery

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import BARE_INSERT, until_sent  # noqa: E402
from questpie_celery import Questpie  # noqa: E402
from questpie_celery.jobs.ids import random_dispatch_id  # noqa: E402
from questpie_celery.send.behind import GATHER_ROWS, GATHER_SECONDS  # noqa: E402
from tests.support.services import PostgresServer, RedisServer  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "7"))
BURST = int(os.environ.get("BENCH_BURST", "1000"))
THREADS = 8
BEHIND = "floor: driver INSERT, raw sends behind on a second thread"
RELAXED_BEHIND = "the same floor, relaxed (synchronous_commit off)"
MANY = "one publish_many of them, new keys, until sent"


def in_threads(burst: Callable[[int], object]) -> Callable[[], object]:
    """The burst split over `THREADS` threads started together."""

    def run() -> None:
        threads = [threading.Thread(target=burst, args=(BURST // THREADS,)) for _ in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    return run


def main() -> None:
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    try:
        os.environ["BENCH_BROKER"] = redis_server.url()
        os.environ["BENCH_LEDGER"] = postgres.url()
        app = importlib.import_module("bench.app")  # configured by the variables above
        app.questpie.migrate()
        relaxed_celery = Celery("bench-relaxed", broker=redis_server.url())
        relaxed_celery.conf.update(task_ignore_result=True)
        relaxed = Questpie(
            relaxed_celery, ledger_url=postgres.url(), durability="relaxed", jobs=[app.noop]
        )
        samples = bursts(app, relaxed, postgres.url())
        relaxed.close()
        app.questpie.close()
    finally:
        redis_server.close()
        postgres.close()
    report(samples)


def bursts(app: Any, relaxed: Questpie, pg_url: str) -> dict[str, list[float]]:
    queue = f"bench-idle-{uuid.uuid4().hex[:6]}"  # nobody consumes it
    durable_client, relaxed_client = app.questpie.queue.bench_noop, relaxed.queue.bench_noop
    driver = psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"))
    driver.autocommit = True

    def raw(count: int) -> None:
        for i in range(count):
            app.raw.apply_async(args=[{"n": i}], queue=queue)

    def keyed(client: Any) -> Callable[[int], None]:
        def burst(count: int) -> None:
            for i in range(count):
                client.publish({"n": i}, idempotency_key=uuid.uuid4().hex, queue=queue)

        return burst

    def many(client: Any) -> Callable[[int], None]:
        payloads = [{"n": i} for i in range(BURST)]

        def burst(count: int) -> None:
            keys = [uuid.uuid4().hex for _ in range(count)]
            client.publish_many(payloads[:count], idempotency_keys=keys, queue=queue)

        return burst

    def floor(count: int) -> None:
        for i in range(count):
            driver.execute(BARE_INSERT, (random_dispatch_id(), f'{{"n": {i}}}')).fetchone()
            app.raw.apply_async(args=[{"n": i}], queue=queue)

    def commits(count: int) -> None:
        for i in range(count):
            driver.execute(BARE_INSERT, (random_dispatch_id(), f'{{"n": {i}}}')).fetchone()

    relaxed_driver = psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"))
    relaxed_driver.autocommit = True
    relaxed_driver.execute("SET synchronous_commit TO off")

    def behind(connection: psycopg.Connection[Any]) -> Callable[[int], None]:
        """The design's own floor: the caller's thread commits each row through the bare
        driver and goes on, while a second thread of the process sends what was committed,
        gathered and pipelined as `publish()`'s send thread does it, over one producer:
        no validation, no planning, no SQLAlchemy, nothing of ours."""

        def burst(count: int) -> None:
            committed: SimpleQueue[int | None] = SimpleQueue()

            def sender() -> None:
                with app.celery_app.producer_or_acquire() as producer:
                    while True:
                        items = [committed.get()]
                        # Gathered as the send thread gathers: up to GATHER_ROWS, for up
                        # to GATHER_SECONDS.
                        until = time.monotonic() + GATHER_SECONDS
                        while items[-1] is not None and len(items) < GATHER_ROWS:
                            left = until - time.monotonic()
                            try:
                                items.append(
                                    committed.get(timeout=left)
                                    if left > 0
                                    else committed.get_nowait()
                                )
                            except Empty:
                                break
                        sends = [item for item in items if item is not None]
                        with producer.batch(max_size=max(len(sends), 1)):
                            for i in sends:
                                app.raw.apply_async(args=[{"n": i}], queue=queue, producer=producer)
                        if len(sends) < len(items):
                            return  # the end mark, always last

            thread = threading.Thread(target=sender)
            thread.start()
            for i in range(count):
                connection.execute(BARE_INSERT, (random_dispatch_id(), f'{{"n": {i}}}')).fetchone()
                committed.put(i)
            committed.put(None)
            thread.join()

        return burst

    def flushed(burst: Callable[[], object], questpie: Questpie) -> Callable[[], None]:
        def run() -> None:
            burst()
            if not until_sent(questpie):
                raise RuntimeError("the sends did not finish in 120 s")

        return run

    measures: dict[str, Callable[[], object]] = {
        "raw apply_async": lambda: raw(BURST),
        "publish, new key, until sent": flushed(lambda: keyed(durable_client)(BURST), app.questpie),
        "publish, new key, relaxed, until sent": flushed(
            lambda: keyed(relaxed_client)(BURST), relaxed
        ),
        MANY: flushed(lambda: many(durable_client)(BURST), app.questpie),
        "floor: driver INSERT, then raw apply_async": lambda: floor(BURST),
        "floor: driver INSERT alone": lambda: commits(BURST),
        BEHIND: lambda: behind(driver)(BURST),
        RELAXED_BEHIND: lambda: behind(relaxed_driver)(BURST),
        f"raw apply_async, {THREADS} threads": in_threads(raw),
        f"publish, new key, {THREADS} threads, until sent": flushed(
            in_threads(keyed(durable_client)), app.questpie
        ),
    }
    names = list(measures)
    for measure in measures.values():  # warm up connections and caches
        measure()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(ROUNDS):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            started, cpu = time.perf_counter(), time.process_time()
            measures[name]()
            samples[name].append(time.perf_counter() - started)
            CPU.setdefault(name, []).append(time.process_time() - cpu)
            # The acceptance marks batched in the background are written now, off the
            # clock, rather than during whichever measure comes next.
            app.questpie.flush(120)
            relaxed.flush(120)
    app.celery_app.connection_for_write().default_channel.client.delete(queue)
    driver.close()
    relaxed_driver.close()
    return samples


#: This process's CPU time (every thread's) per burst, by measure: with one GIL, a burst
#: cannot take less time than its CPU.
CPU: dict[str, list[float]] = {}


def report(samples: dict[str, list[float]]) -> None:
    against = {  # each measure and the raw figure it is held against
        "publish, new key, until sent": "raw apply_async",
        "publish, new key, relaxed, until sent": "raw apply_async",
        MANY: "raw apply_async",
        "floor: driver INSERT, then raw apply_async": "raw apply_async",
        "floor: driver INSERT alone": "raw apply_async",
        BEHIND: "raw apply_async",
        RELAXED_BEHIND: "raw apply_async",
        f"publish, new key, {THREADS} threads, until sent": f"raw apply_async, {THREADS} threads",
    }
    floor = samples["floor: driver INSERT, then raw apply_async"]
    print(
        f"\n{ROUNDS} interleaved rounds of {BURST} calls; PostgreSQL (default durability) "
        "ledger, Redis broker"
    )
    print(
        "| measure | burst, median (min-max) ms | / raw, median (min-max) | / floor "
        "| this process's CPU per call, µs |"
    )
    print("|---|---|---|---|---|")
    for name, values in samples.items():
        cells = [f"{statistics.median(values) * 1e3:.0f} ({min(values) * 1e3:.0f}-"]
        cells[0] += f"{max(values) * 1e3:.0f})"
        base = against.get(name)
        if base is None:
            cells += ["1.00x", ""]
        else:
            ratios = [v / b for v, b in zip(values, samples[base], strict=True)]
            cells.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
            to_floor = [v / f for v, f in zip(values, floor, strict=True)]
            own_floor = "threads" not in name and name != MANY
            cells.append(f"{statistics.median(to_floor):.2f}x" if own_floor else "")
        cells.append(f"{statistics.median(CPU[name]) / BURST * 1e6:.0f}")
        print(f"| `{name}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
