"""questpie_celery against celery-once and celery-singleton, in one run, on the same Redis.

    .venv/bin/pip install -e '.[bench]'    # the two peers, pinned
    .venv/bin/python bench/peers.py        # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=11 .venv/bin/python bench/peers.py

PostgreSQL runs with its default durability. First a short check of what each one does
with a repeated call before and after the run, through a real worker (prefork, one
child). Then the publish costs, interleaved round by round (each round starts at the next
measure, so no measure always runs first): raw `apply_async`; celery-once's `QueueOnce`
and celery-singleton's `Singleton` with new arguments and with arguments whose lock is
held; `publish()` with a new and a repeated idempotency key; and the floors: for the
ledger, a bare psycopg `INSERT ... ON CONFLICT DO NOTHING RETURNING` of a new row (then a
raw send) and of a conflicting row, and the cheapest answer PostgreSQL gives about a row (a
`SELECT` by primary key), and the least a keyed publish of a repeated key does (the
payload validated, the key's id derived, the ledger's own INSERT on the bare driver); for
the locks, a bare Redis `SET NX` of a new key
(then a raw send) and of a held key. Each figure is the median over the rounds with its
min-max; the ratio to raw `apply_async` is the median of the per-round ratios, with their
min-max.
"""

from __future__ import annotations

import importlib
import itertools
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import redis
from celery import Celery
from celery_once import AlreadyQueued  # type: ignore[import-untyped]
from sqlalchemy import create_engine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import BARE_INSERT, timed  # noqa: E402
from questpie_celery import Questpie  # noqa: E402
from questpie_celery.jobs.ids import derive_dispatch_id, random_dispatch_id  # noqa: E402
from questpie_celery.jobs.options import resolve_options  # noqa: E402
from questpie_celery.ledger.direct import DriverStatement  # noqa: E402
from questpie_celery.ledger.dispatches import DispatchStatements  # noqa: E402
from tests.support.services import PostgresServer, RedisServer, Worker  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "7"))
PUBLISHES = int(os.environ.get("BENCH_PUBLISHES", "300"))

RAW = "raw apply_async"
LEDGER_NEW_FLOOR = "floor: driver INSERT, then raw apply_async"
LEDGER_REPEAT_FLOOR = "floor: driver conflicting INSERT"
LEDGER_READ_FLOOR = "floor: driver SELECT of a row by id"
LOCK_NEW_FLOOR = "floor: Redis SET NX, then raw apply_async"
LOCK_REPEAT_FLOOR = "floor: Redis SET NX of a held key"
REPEATED = "publish, repeated key"
LEAST_REPEATED = "the least keyed publish, repeated key"
RELAXED_NEW = "publish, new key, relaxed durability"
FLOOR_OF = {  # each measure and the floor it is held against
    "celery-once, new args": LOCK_NEW_FLOOR,
    "celery-once, locked args (AlreadyQueued)": LOCK_REPEAT_FLOOR,
    "celery-singleton, new args": LOCK_NEW_FLOOR,
    "celery-singleton, locked args": LOCK_REPEAT_FLOOR,
    "publish, new key": LEDGER_NEW_FLOOR,
    REPEATED: LEDGER_REPEAT_FLOOR,
}


READ_BY_ID = "SELECT id FROM questpie_queue_dispatch WHERE id = %s"


def main() -> None:
    # A SIGTERM (from `timeout`, say) still stops the servers and the worker.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    try:
        pg_url, redis_url = postgres.url(), redis_server.url()
        os.environ["BENCH_BROKER"] = redis_url
        os.environ["BENCH_LEDGER"] = pg_url
        app = importlib.import_module("bench.peers_app")  # configured by the variables above
        app.questpie.migrate()
        behaviour = check_behaviour(app, redis_url, pg_url)
        samples = publish_costs(app, pg_url, redis_url)
        app.questpie.close()
    finally:
        redis_server.close()
        postgres.close()
    print("\nWhat a repeated call does, before and after the first run (one real worker):")
    for line in behaviour:
        print(f"  {line}")
    print_table(samples)


def check_behaviour(app: Any, redis_url: str, pg_url: str) -> list[str]:
    """Publish the same call twice, let a worker run it, then publish it once more."""
    counter = redis.Redis.from_url(redis_url)
    counter.delete("bench:once", "bench:singleton", "bench:noop")
    queue = f"bench-check-{uuid.uuid4().hex[:6]}"
    args = [{"n": -1}]
    key = f"check-{uuid.uuid4().hex[:8]}"
    lines: list[str] = []

    def once_call() -> str:
        try:
            return f"queued {app.once.apply_async(args=args, queue=queue).id[:8]}"
        except AlreadyQueued as exc:
            return f"AlreadyQueued (lock expires in {exc.countdown:.0f} s)"

    once_lock = app.once.get_key(args, {})
    singleton_lock = app.singleton.generate_lock(app.singleton.name, args, {})
    publish = app.questpie.queue.bench_noop.publish
    lines += [
        f"celery-once:      1st {once_call()}; 2nd {once_call()}; "
        f"lock TTL {counter.ttl(once_lock)} s",
        f"celery-singleton: 1st {app.singleton.apply_async(args=args, queue=queue).id[:8]}; "
        f"2nd {app.singleton.apply_async(args=args, queue=queue).id[:8]}; "
        f"lock TTL {counter.ttl(singleton_lock)} (-1: none)",
        f"questpie publish: 1st {publish({'n': -1}, idempotency_key=key, queue=queue)[:8]}; "
        f"2nd {publish({'n': -1}, idempotency_key=key, queue=queue)[:8]}",
    ]
    worker = Worker(
        {"BENCH_BROKER": redis_url, "BENCH_LEDGER": pg_url},
        concurrency=1,
        queues=queue,
        app="bench.peers_app:celery_app",
    ).start()
    try:
        wait_for(counter, {"bench:once": 1, "bench:singleton": 1, "bench:noop": 1})
        lines += [
            f"after the run: celery-once lock exists: {bool(counter.exists(once_lock))}, "
            f"3rd call {once_call()}",
            f"after the run: celery-singleton lock exists: "
            f"{bool(counter.exists(singleton_lock))}, 3rd call "
            f"{app.singleton.apply_async(args=args, queue=queue).id[:8]}",
            f"after the run: questpie 3rd publish "
            f"{publish({'n': -1}, idempotency_key=key, queue=queue)[:8]}",
        ]
        time.sleep(3)  # whatever the third calls sent has run by now
        runs = {name: int(counter.get(f"bench:{name}") or 0) for name in ("once", "singleton")}
        runs["questpie"] = int(counter.get("bench:noop") or 0)
        lines.append(f"handler runs for three calls with the same arguments or key: {runs}")
    finally:
        worker.stop()
        counter.delete(queue)
    return lines


def wait_for(counter: redis.Redis, targets: dict[str, int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while any(int(counter.get(name) or 0) < n for name, n in targets.items()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker did not run {targets} in {timeout} s")
        time.sleep(0.05)


def publish_costs(app: Any, pg_url: str, redis_url: str) -> dict[str, list[float]]:
    raw_task, once, singleton = app.raw, app.once, app.singleton
    client = app.questpie.queue.bench_noop
    # Nobody consumes this queue during the publish benchmark.
    queue = f"bench-idle-{uuid.uuid4().hex[:6]}"
    run = uuid.uuid4().hex[:8]
    fresh = itertools.count(1)  # arguments no lock has seen
    held = [{"n": 0}]  # arguments whose locks are taken below and never released
    once.apply_async(args=held, queue=queue)
    singleton.apply_async(args=held, queue=queue)
    repeated_key = f"repeat-{run}"
    client.publish({"n": 0}, idempotency_key=repeated_key, queue=queue)

    driver = psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"))
    driver.autocommit = True
    existing = random_dispatch_id()
    driver.execute(BARE_INSERT, (existing, '{"n": 0}'))
    locks = redis.Redis.from_url(redis_url)
    locks.set(f"bench-lock-{run}-held", "x")

    def driver_insert(i: int) -> object:
        return driver.execute(BARE_INSERT, (random_dispatch_id(), f'{{"n": {i}}}')).fetchone()

    def once_locked(i: int) -> object:
        try:
            return once.apply_async(args=held, queue=queue)
        except AlreadyQueued:
            return None

    # The same job on a relaxed ledger: commits that do not wait for the disk.
    relaxed_celery = Celery("bench-relaxed", broker=redis_url)
    relaxed_celery.conf.update(task_ignore_result=True)
    relaxed_questpie = Questpie(
        relaxed_celery, ledger_url=pg_url, durability="relaxed", jobs=[app.noop_job]
    )
    relaxed = relaxed_questpie.queue.bench_noop

    modes: dict[str, Callable[[int], object]] = {
        RAW: lambda i: raw_task.apply_async(args=[{"n": i}], queue=queue),
        RELAXED_NEW: lambda i: relaxed.publish(
            {"n": i}, idempotency_key=f"{run}-{uuid.uuid4().hex}", queue=queue
        ),
        "celery-once, new args": lambda i: once.apply_async(args=[{"n": next(fresh)}], queue=queue),
        "celery-once, locked args (AlreadyQueued)": once_locked,
        "celery-singleton, new args": lambda i: singleton.apply_async(
            args=[{"n": next(fresh)}], queue=queue
        ),
        "celery-singleton, locked args": lambda i: singleton.apply_async(args=held, queue=queue),
        "publish, new key": lambda i: client.publish(
            {"n": i}, idempotency_key=f"{run}-{uuid.uuid4().hex}", queue=queue
        ),
        REPEATED: lambda i: client.publish({"n": i}, idempotency_key=repeated_key, queue=queue),
        LEDGER_NEW_FLOOR: lambda i: (
            driver_insert(i),
            raw_task.apply_async(args=[{"n": i}], queue=queue),
        ),
        LEDGER_REPEAT_FLOOR: lambda i: driver.execute(
            BARE_INSERT, (existing, f'{{"n": {i}}}')
        ).fetchone(),
        # The cheapest answer PostgreSQL gives about a row: a primary-key lookup.
        LEDGER_READ_FLOOR: lambda i: driver.execute(READ_BY_ID, (existing,)).fetchone(),
        LOCK_NEW_FLOOR: lambda i: (
            locks.set(f"bench-lock-{run}-{uuid.uuid4().hex}", "x", nx=True, ex=3600),
            raw_task.apply_async(args=[{"n": i}], queue=queue),
        ),
        LOCK_REPEAT_FLOOR: lambda i: locks.set(f"bench-lock-{run}-held", "x", nx=True, ex=3600),
    }
    # What any keyed publish must do, with nothing else: validate the payload, derive the
    # key's id, and ask the ledger with its own INSERT (on the bare driver).
    insert = DriverStatement(
        DispatchStatements("postgresql").insert, create_engine(pg_url)
    )  # compiled for the dialect
    bare = SimpleNamespace(connection=SimpleNamespace(dbapi_connection=driver, info={}))
    stored_options = resolve_options(app.noop_job.options, {"queue": queue}).stored()

    def least_repeated(i: int) -> object:
        body = app.noop_job.to_json({"n": i})  # validated, as publish() validates it
        params = {
            "id": derive_dispatch_id(app.noop_job.name, repeated_key),
            "job_name": app.noop_job.name,
            "idempotency_key": repeated_key,
            "singleton_key": None,
            "group_key": None,
            "status": "queued",
            "attempt": 0,
            "policy": None,
            "slot": None,
            "payload": body,
            "secret": False,
            "secret_ciphertext": None,
            "secret_wrapped_key": None,
            "secret_key_id": None,
            "options": stored_options,
            "run_after": None,
            "next_send_at": None,
            "send_in": 30.0,
        }
        return insert.run(bare, params)  # type: ignore[arg-type]  # reads the driver only

    modes[LEAST_REPEATED] = least_repeated
    for mode in modes.values():  # warm up connections and caches
        timed(mode, 20, app.questpie, relaxed_questpie)
    names = list(modes)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(ROUNDS):
        start = round_ % len(names)
        for name in names[start:] + names[:start]:
            samples[name].append(timed(modes[name], PUBLISHES, app.questpie, relaxed_questpie))
    app.celery_app.connection_for_write().default_channel.client.delete(queue)
    driver.close()
    return samples


def print_table(samples: dict[str, list[float]]) -> None:
    median = {name: statistics.median(values) for name, values in samples.items()}

    def us(name: str) -> str:
        values = samples[name]
        return f"{median[name] * 1e6:.0f} ({min(values) * 1e6:.0f}-{max(values) * 1e6:.0f})"

    def ratio(name: str, to: str) -> str:
        per_round = [a / b for a, b in zip(samples[name], samples[to], strict=True)]
        return f"{statistics.median(per_round):.2f}x ({min(per_round):.2f}-{max(per_round):.2f})"

    print(
        f"\n{ROUNDS} interleaved rounds of {PUBLISHES} calls; PostgreSQL (default durability) "
        "ledger, Redis broker and locks"
    )
    print("| measure | per call, µs: median (min-max) | / raw `apply_async` | / its floor |")
    print("|---|---|---|---|")
    for name in samples:
        floor = FLOOR_OF.get(name)
        against = f"{ratio(name, floor)} of {floor.removeprefix('floor: ')}" if floor else ""
        print(f"| {name} | {us(name)} | {ratio(name, RAW)} | {against} |")

    def head_to_head(ours: str, peers: list[str]) -> str:
        faster = [min(values) for values in zip(*(samples[peer] for peer in peers), strict=True)]
        per_round = [a / b for a, b in zip(samples[ours], faster, strict=True)]
        return f"{statistics.median(per_round):.2f}x ({min(per_round):.2f}-{max(per_round):.2f})"

    def above(name: str, floor: str) -> str:
        per_round = [(a - b) * 1e6 for a, b in zip(samples[name], samples[floor], strict=True)]
        return f"{statistics.median(per_round):.0f} ({min(per_round):.0f}-{max(per_round):.0f})"

    # The goals compare within each round, where both ran on the same moment of the machine.
    print("\nHead to head, the ratio of each round (median, min-max):")
    locked = ["celery-once, locked args (AlreadyQueued)", "celery-singleton, locked args"]
    print(f"- publish, repeated key / the faster lock held: {head_to_head(REPEATED, locked)}")
    print(
        f"- the least keyed publish, repeated key / the faster lock held: "
        f"{head_to_head(LEAST_REPEATED, locked)}"
    )
    print(
        "- a repeated call above its floor, µs, round by round: publish "
        f"{above(REPEATED, LEDGER_REPEAT_FLOOR)}; celery-once "
        f"{above(locked[0], LOCK_REPEAT_FLOOR)}; celery-singleton "
        f"{above(locked[1], LOCK_REPEAT_FLOOR)}"
    )
    print(
        "- the floors: PostgreSQL's cheapest answer (SELECT by id) / Redis SET NX of a held "
        f"key: {ratio(LEDGER_READ_FLOOR, LOCK_REPEAT_FLOOR)}; the conflicting INSERT / the "
        f"SELECT: {ratio(LEDGER_REPEAT_FLOOR, LEDGER_READ_FLOOR)}"
    )
    new = ["celery-once, new args"]
    print(f"- publish, new key, relaxed / celery-once, new args: {head_to_head(RELAXED_NEW, new)}")


if __name__ == "__main__":
    main()
