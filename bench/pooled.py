"""What a pooled ledger's statements cost: the ledger's hot path with and without
`pooled=True`, directly and through PgBouncer in transaction mode.

    .venv/bin/python bench/pooled.py            # starts its own PostgreSQL and PgBouncer
    BENCH_ROUNDS=9 .venv/bin/python bench/pooled.py

PostgreSQL runs with its default durability, as in production; each mode is measured
durable and relaxed. One unit of work is the three writes of a fenced keyed dispatch:
its INSERT, the worker's claim and its completion. The modes, interleaved round by
round (medians with min-max, per unit of work):

- unpooled: the ledger as without a pooler (settings at connection startup; psycopg
  prepares each statement on the server after its fifth run);
- no prepares: the same statements with psycopg's prepared statements off (what
  `prepare_threshold=None` alone costs);
- pooled, direct: `pooled=True` against the server itself (no prepares, and each write
  sets the ledger's settings for its own transaction);
- pooled, through PgBouncer: the same through the pooler (one more hop per statement).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import event

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questpie_celery.jobs.ids import random_dispatch_id  # noqa: E402
from questpie_celery.jobs.options import StoredOptions  # noqa: E402
from questpie_celery.ledger import Ledger, NewDispatch, create_ledger_engine  # noqa: E402
from tests.support.services import PgBouncerServer, PostgresServer  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
UNITS = int(os.environ.get("BENCH_UNITS", "200"))


def _no_prepares(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.prepare_threshold = None


def unit_of_work(ledger: Ledger) -> Callable[[], None]:
    def run() -> None:
        new = NewDispatch(
            id=random_dispatch_id(),
            job_name="bench.noop",
            payload={"n": 1},
            options=StoredOptions(),
            idempotency_key=random_dispatch_id(),
        )
        assert ledger.dispatches.insert(new)
        claim = ledger.claims.claim(new.id, "bench.noop", 1, 60)
        assert claim.token is not None
        assert ledger.claims.finish(new.id, claim.token, "completed", None)

    return run


def main() -> None:
    postgres = PostgresServer(durable=True).start()
    bouncer = PgBouncerServer(postgres).start()
    try:
        direct = postgres.create_database("bench")
        through = bouncer.url(direct)
        ledgers: dict[str, Ledger] = {}
        for relaxed in (False, True):
            kind = "relaxed" if relaxed else "durable"
            ledgers[f"unpooled, {kind}"] = Ledger(
                create_ledger_engine(direct, relaxed=relaxed), relaxed=relaxed
            )
            # The unpooled engine with its prepares turned off: only they differ.
            unprepared = create_ledger_engine(direct, relaxed=relaxed)
            event.listen(unprepared, "connect", _no_prepares)
            ledgers[f"no prepares, {kind}"] = Ledger(unprepared, relaxed=relaxed)
            for where, url in (("direct", direct), ("through PgBouncer", through)):
                ledgers[f"pooled, {where}, {kind}"] = Ledger(
                    create_ledger_engine(url, relaxed=relaxed, pooled=True),
                    relaxed=relaxed,
                    pooled=True,
                )
        next(iter(ledgers.values())).migration.migrate()
        modes = {name: unit_of_work(ledger) for name, ledger in ledgers.items()}
        for mode in modes.values():  # warm up connections, caches and prepares
            for _ in range(20):
                mode()
        samples: dict[str, list[float]] = {name: [] for name in modes}
        for _ in range(ROUNDS):
            for name, mode in modes.items():
                started = time.perf_counter()
                for _ in range(UNITS):
                    mode()
                samples[name].append((time.perf_counter() - started) / UNITS)
        print(f"{ROUNDS} rounds of {UNITS} units (INSERT, claim, completion); µs per unit")
        for kind in ("durable", "relaxed"):
            base = statistics.median(samples[f"unpooled, {kind}"])
            for name, values in samples.items():
                if name.endswith(kind):
                    median = statistics.median(values)
                    print(
                        f"{name:<38} {median * 1e6:7.0f} ({min(values) * 1e6:.0f}-"
                        f"{max(values) * 1e6:.0f})  {median / base:.2f}x"
                    )
        for ledger in ledgers.values():
            ledger.close()
    finally:
        bouncer.close()
        postgres.close()


if __name__ == "__main__":
    main()
