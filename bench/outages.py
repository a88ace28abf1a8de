"""How long a caller waits when the ledger or the broker is down.

    .venv/bin/python bench/outages.py        # starts its own PostgreSQL and Redis
    BENCH_ROUNDS=5 .venv/bin/python bench/outages.py

The tests check what happens in each of these cases (the error, the row left for the
relay, the sends not tried, the loop or the caller not waiting on a send); how long it
takes is a figure of the machine it runs on, so it is measured here, not asserted
there. Each round, one after another:

- `keyed publish, ledger refuses`: a keyed publish to a ledger URL nothing listens on,
  until its LedgerUnavailableError (tests/integration/test_faults.py).
- `keyed publish, ledger silent`: the same to a port that accepts connections and never
  answers: the connect timeout (tests/unit/test_promises.py).
- `unkeyed publish, ledger refuses`: a plain publish with that ledger, until the broker
  has it (it needs no row).
- `keyed publish, broker down`: a keyed publish with a broker nothing listens on, until
  it returns (its row written; its send follows); `its send, refused`: the flush after
  it, until the refused send has left the row to the relay.
- `the same key again, broker down`: answered from the ledger.
- `unkeyed publish, broker down`: until its BrokerError (kombu's retries under the
  publish's retry policy).
- `relay pass, broker down`: one pass over BENCH_DUE due rows (5), which tries one send
  (tests/integration/test_relay.py).
- `claim of a held row`: a claim of a row another transaction holds, until its
  LedgerBusyError: the ledger's lock timeout (tests/integration/test_ledger_driver_cursor.py).

Printed: the median time per case with its min-max over the rounds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine, create_engine, select, update

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questpie_celery import (  # noqa: E402
    BrokerError,
    LedgerBusyError,
    LedgerUnavailableError,
    Questpie,
)
from questpie_celery.ledger import dispatch_table, open_ledger  # noqa: E402
from tests.support import jobapp  # noqa: E402
from tests.support.services import PostgresServer, RedisServer, free_port  # noqa: E402
from tests.unit.helpers import new_dispatch  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
DUE = int(os.environ.get("BENCH_DUE", "5"))


def closed_broker() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


def closed_ledger() -> str:
    return f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none"


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and then never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        listener.close()


def timed(call: Callable[[], object], *expected: type[BaseException]) -> float:
    """How long `call` takes to return or to raise one of `expected`."""
    started = time.perf_counter()
    with contextlib.suppress(*expected):
        call()
    return time.perf_counter() - started


def one_round(pg: str, broker: str, silent: int, figures: dict[str, list[float]]) -> None:
    def note(name: str, seconds: float) -> None:
        figures.setdefault(name, []).append(seconds)

    key = uuid.uuid4().hex
    engine = create_engine(pg)  # the test's own, to write rows and hold them
    try:
        measure(pg, broker, silent, key, engine, note)
    finally:
        engine.dispose()


def measure(
    pg: str,
    broker: str,
    silent: int,
    key: str,
    engine: Engine,
    note: Callable[[str, float], None],
) -> None:
    def keyed(questpie: Questpie) -> Callable[[], object]:
        return lambda: questpie.queue.record.publish({"tag": key}, idempotency_key=key)

    def unkeyed(questpie: Questpie) -> Callable[[], object]:
        return lambda: questpie.queue.record.publish({"tag": key})

    _, questpie = jobapp.build(broker=broker, ledger=closed_ledger())
    try:
        note("keyed publish, ledger refuses", timed(keyed(questpie), LedgerUnavailableError))
        note("unkeyed publish, ledger refuses", timed(unkeyed(questpie)))
    finally:
        questpie.close()

    silent_url = f"postgresql+psycopg://nobody@127.0.0.1:{silent}/none"
    _, questpie = jobapp.build(broker=broker, ledger=silent_url)
    try:
        note("keyed publish, ledger silent", timed(keyed(questpie), LedgerUnavailableError))
    finally:
        questpie.close()

    _, questpie = jobapp.build(broker=closed_broker(), ledger=pg)
    try:
        note("keyed publish, broker down", timed(keyed(questpie)))
        note("its send, refused", timed(lambda: questpie.flush(60)))
        note("the same key again, broker down", timed(keyed(questpie)))
        note("unkeyed publish, broker down", timed(unkeyed(questpie), BrokerError))
        # Rows due for the relay now, for one pass that meets the broker down.
        record = questpie.queue.record
        due = [record.publish({"tag": key}, idempotency_key=f"{key}-{n}") for n in range(DUE)]
        questpie.flush(60)
        with engine.begin() as conn:
            conn.execute(
                update(dispatch_table)
                .where(dispatch_table.c.id.in_(due))
                .values(next_send_at=datetime.now(UTC) - timedelta(seconds=1))
            )
        note("relay pass, broker down", timed(lambda: questpie.run_relay(once=True)))
    finally:
        questpie.close()

    ledger = open_ledger(pg)
    try:
        held = new_dispatch()
        assert ledger.dispatches.insert(held)
        with engine.begin() as conn:
            conn.execute(
                select(dispatch_table.c.id).where(dispatch_table.c.id == held.id).with_for_update()
            )
            note(
                "claim of a held row",
                timed(lambda: ledger.claims.claim(held.id, "record", 1, 60), LedgerBusyError),
            )
    finally:
        ledger.close()


def main() -> None:
    # Each refusal is said at WARNING: expected here, not this benchmark's news.
    logging.getLogger("questpie_celery").setLevel(logging.CRITICAL)
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    figures: dict[str, list[float]] = {}
    try:
        pg = postgres.create_database("outages")
        setup = open_ledger(pg)
        setup.migration.migrate()
        setup.close()
        with silent_port() as silent:
            for _ in range(ROUNDS):
                one_round(pg, redis_server.url(), silent, figures)
    finally:
        redis_server.close()
        postgres.close()
    print(f"{ROUNDS} rounds; PostgreSQL with default durability, Redis\n")
    print(f"| {'case':34} | {'median s':>8} | {'min-max s':>11} |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 13}|")
    for name, values in figures.items():
        spread = f"{min(values):.2f}-{max(values):.2f}"
        print(f"| {name:34} | {statistics.median(values):8.2f} | {spread:>11} |")


if __name__ == "__main__":
    main()
