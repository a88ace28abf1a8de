"""A DBOS Transact app for bench/pg_peer.py (needs the `bench` extra), and its worker.

Its system database is a database of its own (BENCH_DBOS_DB, `bench_dbos` by default)
in the ledger's PostgreSQL (BENCH_LEDGER), created and migrated by DBOS at launch. The
workflow is the same no-op as the other systems' jobs, a plain function counting its run
in Redis (as bench/app.py's `bump`); the sentinel is counted apart, as
bench/pg_peer_app.py's.

The publishing side (bench/pg_peer.py's own process) launches DBOS listening to no queue
of its own, registers each measure's queue (with the measure's `worker_concurrency` and
the poller's `polling_interval_sec`: DBOS 3 keeps a queue's configuration in the system
database) and enqueues with `SetWorkflowID(key)` + `Queue.enqueue`: the workflow id is
the idempotency key, for good (a second enqueue of the id answers the first workflow).

The worker is one process, `python -m bench.dbos_app QUEUE`, launching DBOS to listen to
that queue only; its queue thread polls the queue every `polling_interval_sec` and starts
what it claims in DBOS's thread pool, up to the queue's `worker_concurrency` at once. It
logs "dbos worker ready" once launched, and shuts down on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import uuid

import redis
from dbos import DBOS, DBOSConfig, Queue, SetWorkflowID

__all__ = ["SENTINEL", "enqueue", "launch", "noop", "register", "sentinel", "shutdown"]

SENTINEL = "bench:pg_sentinel"
COUNTER = "bench:dbos"
_counters: dict[int, redis.Redis] = {}


def bump(name: str) -> None:
    """Count a finished run in Redis, as bench/app.py's `bump` does (not imported from
    there: this worker needs nothing of the Celery project)."""
    pid = os.getpid()
    if pid not in _counters:
        _counters[pid] = redis.Redis.from_url(os.environ["BENCH_BROKER"])
    _counters[pid].incr(name)


def database_url() -> str:
    """The DBOS system database: BENCH_DBOS_DB in BENCH_LEDGER's server."""
    ledger = os.environ["BENCH_LEDGER"].replace("postgresql+psycopg://", "postgresql://")
    server = ledger.rsplit("/", 1)[0]
    return f"{server}/{os.environ.get('BENCH_DBOS_DB', 'bench_dbos')}"


def launch(executor_id: str, listen: list[str]) -> None:
    """Configure and launch DBOS in this process, dequeuing from `listen` only."""
    config: DBOSConfig = {
        "name": "bench-dbos",
        "system_database_url": database_url(),
        # One fixed version for the publisher and every worker: a worker dequeues only
        # its own version's workflows.
        "application_version": "bench",
        "executor_id": executor_id,
        "log_level": os.environ.get("BENCH_DBOS_LOG_LEVEL", "INFO"),
    }
    DBOS(config=config)
    DBOS.listen_queues(listen)
    DBOS.launch()


@DBOS.workflow(name="bench.dbos_noop")
def noop(n: int) -> None:
    del n
    bump(COUNTER)


@DBOS.workflow(name="bench.dbos_sentinel")
def sentinel() -> None:
    bump(SENTINEL)


def register(name: str, slots: int, polling_interval_sec: float) -> Queue:
    """Register (or update) a queue: `slots` workflows at once in each worker process."""
    return DBOS.register_queue(
        name,
        worker_concurrency=slots,
        polling_interval_sec=polling_interval_sec,
        on_conflict="always_update",
    )


def enqueue(queue: Queue, n: int, key: str) -> str:
    """Enqueue the no-op with workflow id `key`; answer the workflow's id."""
    with SetWorkflowID(key):
        return queue.enqueue(noop, n).get_workflow_id()


def shutdown() -> None:
    DBOS.destroy()


def main() -> None:
    queue = sys.argv[1]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    launch(f"bench-worker-{os.getpid()}-{uuid.uuid4().hex[:6]}", [queue])
    print("dbos worker ready", flush=True)
    while not stop.wait(1.0):
        pass
    DBOS.destroy(workflow_completion_timeout_sec=5)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
