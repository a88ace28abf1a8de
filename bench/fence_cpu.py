"""CPU a fenced run costs the process that runs it, measured in one process.

    .venv/bin/python bench/fence_cpu.py      # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=9 BENCH_RUNS=2000 .venv/bin/python bench/fence_cpu.py

`bench/worker.py` measures what a user's worker does, but on a 2-core VM its rates move
by 20% between rounds, more than a change to the fence does. This one measures only the
part the fence adds, in the place it adds it: the messages a worker would receive are
taken off Redis as published, then run one after another in this process through Celery's
own tracer (what a prefork pool process calls for each message), with the process's CPU
clock read around each round. Interleaved round by round:

- `raw`: a plain Celery task (the benchmark's Redis counter, which every kind bumps);
- `floor`: a plain task making the two durable writes of a fenced run through the bare
  driver (bench/floor.py);
- `fenced`: questpie's messages of a no-op job, every delivery claimed and recorded;
- `lean fence`: the same messages through `bench.app.LeanFence`, the least a fence does
  (the header read, the ledger's own claim and outcome statements on the bare driver,
  the row read, the payload validated, the handler run with its context), with nothing
  for leases, outages, tracing or errors.

PostgreSQL runs with its default durability. Each figure is the median CPU µs per run
over the rounds (min-max); `fenced - floor` is what the fence costs above its two writes,
and `fenced - lean fence` what it costs above the least a fence does.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from celery.app.trace import build_tracer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench.worker as drain  # noqa: E402
from tests.support.services import PostgresServer, RedisServer  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "7"))
RUNS = int(os.environ.get("BENCH_RUNS", "1000"))
KINDS = ("raw", "floor", "lean fence", "fenced")
HOST = "bench@localhost"

Message = tuple[str, str, list[Any], dict[str, Any], dict[str, Any]]


def main() -> None:
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    try:
        os.environ["BENCH_BROKER"] = redis_server.url()
        os.environ["BENCH_LEDGER"] = postgres.url()
        app = importlib.import_module("bench.app")
        app.questpie.migrate()
        broker = redis.Redis.from_url(redis_server.url())
        tracers: dict[str, Any] = {}
        cpu: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for kind in KINDS:  # a first round of each, not counted: imports, plans, pools
            run_all(app, tracers, received(app, broker, kind))
        for _ in range(ROUNDS):
            for kind in KINDS:
                cpu[kind].append(run_all(app, tracers, received(app, broker, kind)))
        app.questpie.close()
    finally:
        redis_server.close()
        postgres.close()
    print_table(cpu)


def received(bench_app: Any, broker: redis.Redis, kind: str) -> list[Message]:
    """`RUNS` messages of `kind`, published as bench/worker.py publishes them and taken
    off the queue as a worker receives them (the request Celery's strategy builds)."""
    queue = f"bench-cpu-{uuid.uuid4().hex[:6]}"
    drain.fill(bench_app, "fenced" if kind == "lean fence" else kind, queue, RUNS)
    bench_app.questpie.flush(120)
    messages: list[Message] = []
    while (raw := broker.rpop(queue)) is not None:
        envelope = json.loads(raw)  # type: ignore[arg-type]
        headers = envelope["headers"]
        args, kwargs, embed = json.loads(base64.b64decode(envelope["body"]))
        request = {
            **headers,
            "properties": envelope["properties"],
            "reply_to": None,
            "correlation_id": headers["id"],
            "delivery_info": {"exchange": "", "routing_key": queue, "redelivered": False},
            "args": args,
            "kwargs": kwargs,
            "hostname": HOST,
            "is_eager": False,
            **(embed or {}),
        }
        task = "bench.lean_fence" if kind == "lean fence" else headers["task"]
        messages.append((task, headers["id"], args, kwargs, request))
    assert len(messages) == RUNS, f"{len(messages)} of {RUNS} messages on the queue"
    return messages


def run_all(bench_app: Any, tracers: dict[str, Any], messages: list[Message]) -> float:
    """Run every message through Celery's tracer; CPU µs per run."""
    started = time.process_time()
    for name, task_id, args, kwargs, request in messages:
        tracer = tracers.get(name)
        if tracer is None:
            task = bench_app.celery_app.tasks[name]
            tracer = tracers[name] = build_tracer(
                name, task, app=bench_app.celery_app, eager=False, hostname=HOST
            )
        _, failed, _, _ = tracer(task_id, args, kwargs, dict(request))
        assert failed is None, f"{name} {task_id} ended {failed.state}"
    return (time.process_time() - started) * 1e6 / len(messages)


def print_table(cpu: dict[str, list[float]]) -> None:
    print(
        f"\n{ROUNDS} interleaved rounds of {RUNS} runs each, in one process through "
        "Celery's tracer; PostgreSQL with default durability, Redis"
    )
    print("| kind | CPU per run, µs: median (min-max) |")
    print("|---|---|")
    for kind, values in cpu.items():
        print(f"| {kind} | {statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f}) |")
    for ours, floor in (("fenced", "floor"), ("lean fence", "floor"), ("fenced", "lean fence")):
        above = [a - b for a, b in zip(cpu[ours], cpu[floor], strict=True)]
        print(
            f"| {ours} - {floor}, round by round | {statistics.median(above):.0f} "
            f"({min(above):.0f}-{max(above):.0f}) |"
        )


if __name__ == "__main__":
    main()
