"""How fast relays send a backlog the broker could not take, and how soon a committed
`publish(connection=...)` is sent.

    .venv/bin/python bench/relay_drain.py        # starts its own PostgreSQL and Redis
    BENCH_ROWS=20000 BENCH_ROUNDS=5 .venv/bin/python bench/relay_drain.py

PostgreSQL runs with its default durability. Each round stops Redis, publishes
BENCH_ROWS dispatches with `publish(connection=...)` (rows written in the caller's
transaction, due for the relay at once), starts Redis again, and times relay processes
sending the whole backlog: one relay alone, then two together. A relay process makes
passes (`run_relay(once=True)`) until one finds nothing to send; the clock runs from
the moment every relay process is ready until the last one is done. Each drain is
checked: every row `queued`, and every dispatch exactly once in the broker's queue.

The floors, measured in the same round on the same Redis: raw `send_task` of as many
messages from one process over one producer, one round trip each; and the same in kombu
batches of a relay batch's size (`Producer.batch`, one pipelined round trip a batch), which
is how a relay sends on Redis with kombu 5.7 or later.

Then one relay runs on its own (`run_relay()`, interval 2 s) while this process commits
BENCH_LATENCY single `publish(connection=...)` transactions, 50 to 150 ms apart, and
times each from its commit to the message's arrival in Redis (read with BRPOP).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from pydantic import BaseModel
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questpie_celery import JobContext, Questpie  # noqa: E402
from questpie_celery.jobs.definition import JobDefinition  # noqa: E402
from questpie_celery.worker.relay import RELAY_BATCH_SIZE  # noqa: E402
from tests.support.services import PostgresServer, RedisServer  # noqa: E402

ROWS = int(os.environ.get("BENCH_ROWS", "10000"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
LATENCY_SAMPLES = int(os.environ.get("BENCH_LATENCY", "60"))
QUEUE = "relay-drain"
#: Rows per publishing transaction while the backlog is built.
PUBLISH_CHUNK = 1000


class Payload(BaseModel):
    n: int


def nothing(payload: Payload, ctx: JobContext) -> None:
    del payload, ctx


JOB = JobDefinition(name="bench.relay-drain", schema=Payload, handler=nothing)


def build(broker: str, ledger: str) -> Questpie:
    app = Celery("bench-relay", broker=broker)
    app.conf.update(task_default_queue=QUEUE, task_ignore_result=True)
    return Questpie(app, ledger_url=ledger, jobs=[JOB])


def drain_child(broker: str, ledger: str, ready: Any, start: EventType, results: Any) -> None:
    """One relay process: get ready, wait for the start, make passes until one sends
    nothing; report (when it finished, dispatches it sent)."""
    questpie = build(broker, ledger)
    questpie.get_policy(JOB.name)  # a first ledger round trip: the pool is open
    with questpie.celery_app.producer_or_acquire() as producer:
        producer.connection.ensure_connection(max_retries=3)
    ready.put(os.getpid())
    start.wait()
    sent = 0
    while moved := questpie.run_relay(once=True):
        sent += moved
    results.put((time.monotonic(), sent))
    questpie.close()


def relay_forever(broker: str, ledger: str, stop: EventType) -> None:
    questpie = build(broker, ledger)
    halt = threading.Event()
    threading.Thread(target=lambda: (stop.wait(), halt.set()), daemon=True).start()
    questpie.run_relay(stop=halt)
    questpie.close()


def publish_backlog(questpie: Questpie, url: str, rows: int) -> None:
    client = questpie.client(JOB)
    engine = create_engine(url)
    for first in range(0, rows, PUBLISH_CHUNK):
        with engine.begin() as conn:
            for n in range(first, min(first + PUBLISH_CHUNK, rows)):
                client.publish(Payload(n=n), connection=conn)
    engine.dispose()


def broker_ids(client: redis.Redis) -> list[str]:
    """The dispatch id of every message waiting in the queue (every priority list)."""
    ids = []
    for key in client.keys(f"{QUEUE}*"):
        for raw in client.lrange(key, 0, -1):
            ids.append(json.loads(raw)["headers"]["id"])
    return ids


def drain(
    ctx: Any, relays: int, broker: str, ledger: str, counter: redis.Redis, engine: Any
) -> float:
    """Rows per second for `relays` relay processes sending the backlog in the ledger."""
    ready, results = ctx.Queue(), ctx.Queue()
    start = ctx.Event()
    procs = [
        ctx.Process(target=drain_child, args=(broker, ledger, ready, start, results))
        for _ in range(relays)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=120)
    began = time.monotonic()
    start.set()
    finished = [results.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(60)
    elapsed = max(at for at, _ in finished) - began
    sent = sum(count for _, count in finished)
    with engine.connect() as conn:
        queued = conn.execute(
            text("SELECT count(*) FROM questpie_queue_dispatch WHERE status = 'queued'")
        ).scalar_one()
    ids = broker_ids(counter)
    if queued != ROWS or len(ids) != ROWS or len(set(ids)) != ROWS or sent != ROWS:
        raise SystemExit(
            f"drain check failed: {queued} queued, {len(ids)} messages "
            f"({len(set(ids))} distinct), {sent} sends reported, of {ROWS}"
        )
    return ROWS / elapsed


def raw_floor(broker: str, counter: redis.Redis, *, pipelined: bool) -> float:
    """Raw `send_task` of as many messages from one process over one producer; with
    `pipelined`, in kombu batches of as many messages as a relay batch holds."""
    app = Celery("bench-raw", broker=broker)
    app.conf.update(task_default_queue=QUEUE, task_ignore_result=True)
    started = time.perf_counter()
    with app.producer_or_acquire() as producer:
        for first in range(0, ROWS, RELAY_BATCH_SIZE):
            with producer.batch() if pipelined else contextlib.nullcontext():
                for n in range(first, min(first + RELAY_BATCH_SIZE, ROWS)):
                    app.send_task(
                        JOB.name,
                        args=[{"n": n}],
                        task_id=f"raw-{n}",
                        producer=producer,
                        serializer="json",
                    )
    rate = ROWS / (time.perf_counter() - started)
    for key in counter.keys(f"{QUEUE}*"):
        counter.delete(key)
    return rate


def latency(
    ctx: Any, questpie: Questpie, broker: str, ledger: str, counter: redis.Redis
) -> list[float]:
    """Commit-to-broker milliseconds of single `publish(connection=...)` transactions."""
    stop = ctx.Event()
    proc = ctx.Process(target=relay_forever, args=(broker, ledger, stop))
    proc.start()
    time.sleep(3)  # the relay's first pass done and its listening connection open
    arrived: dict[str, float] = {}

    def consume() -> None:
        reader = redis.Redis.from_url(broker)
        while len(arrived) < LATENCY_SAMPLES:
            found = reader.brpop([QUEUE], timeout=10)
            if found is None:
                return
            arrived[json.loads(found[1])["headers"]["id"]] = time.monotonic()

    consumer = threading.Thread(target=consume)
    consumer.start()
    client = questpie.client(JOB)
    engine = create_engine(ledger)
    committed: dict[str, float] = {}
    for n in range(LATENCY_SAMPLES):
        with engine.begin() as conn:
            dispatch_id = client.publish(Payload(n=n), connection=conn)
        committed[str(dispatch_id)] = time.monotonic()
        time.sleep(random.uniform(0.05, 0.15))
    consumer.join(30)
    stop.set()
    proc.join(30)
    engine.dispose()
    missing = set(committed) - set(arrived)
    if missing:
        raise SystemExit(f"{len(missing)} latency dispatches never reached the broker")
    return [(arrived[i] - committed[i]) * 1000 for i in committed]


def spread(values: list[float], unit: str, digits: int = 0) -> str:
    return (
        f"{statistics.median(values):,.{digits}f} {unit} "
        f"({min(values):,.{digits}f}-{max(values):,.{digits}f})"
    )


def main() -> None:
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    ctx = multiprocessing.get_context("spawn")
    try:
        ledger = postgres.create_database("relay")
        broker = redis_server.url(1)
        questpie = build(broker, ledger)
        questpie.migrate()
        engine = create_engine(ledger)
        rates: dict[str, list[float]] = {
            "one relay": [],
            "two relays": [],
            "floor": [],
            "pipelined floor": [],
        }
        for _ in range(ROUNDS):
            for relays, name in ((1, "one relay"), (2, "two relays")):
                redis_server.stop()  # the broker is down while the backlog builds up
                publish_backlog(questpie, ledger, ROWS)
                redis_server.start()
                counter = redis.Redis.from_url(broker)
                rates[name].append(drain(ctx, relays, broker, ledger, counter, engine))
                with engine.begin() as conn:
                    conn.execute(text("DELETE FROM questpie_queue_dispatch"))
                for key in counter.keys(f"{QUEUE}*"):
                    counter.delete(key)
            counter = redis.Redis.from_url(broker)
            rates["floor"].append(raw_floor(broker, counter, pipelined=False))
            rates["pipelined floor"].append(raw_floor(broker, counter, pipelined=True))
        latencies = latency(ctx, questpie, broker, ledger, redis.Redis.from_url(broker))
        questpie.close()
        engine.dispose()
    finally:
        redis_server.close()
        postgres.close()
    print(
        f"\n{ROUNDS} rounds, a backlog of {ROWS:,} publish(connection=...) rows each; "
        "PostgreSQL (default durability), Redis"
    )
    print("| measure | median (min-max) |")
    print("|---|---|")
    print(f"| one relay sends the backlog | {spread(rates['one relay'], 'rows/s')} |")
    print(f"| two relays together | {spread(rates['two relays'], 'rows/s')} |")
    print(
        f"| floor: raw send_task, one process, one producer | {spread(rates['floor'], 'msgs/s')} |"
    )
    print(
        f"| floor: the same in kombu batches of {RELAY_BATCH_SIZE} (Producer.batch) | "
        f"{spread(rates['pipelined floor'], 'msgs/s')} |"
    )
    print(
        f"| commit to message in Redis, {LATENCY_SAMPLES} publish(connection=...) "
        f"| {spread(latencies, 'ms', 1)} |"
    )


if __name__ == "__main__":
    main()
