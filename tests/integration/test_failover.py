"""A PostgreSQL failover under load: a durable primary with a synchronous streaming
standby, every client on one multi-host URL (`host=primary,standby`,
`target_session_attrs=read-write`); a publisher, a prefork worker and two `celery beat`
processes run while the primary crashes and the standby is promoted a few seconds later.
The crash is a hard one with commits in doubt: the primary's WAL senders stall first, so
the statements committing meanwhile wait for a standby that never hears of them, and then
every process of the primary is SIGKILLed (no shutdown, nothing more sent).

Nothing `publish()` returned an id for is lost, nothing completes twice, and the
questpie schedule (every minute, the finest a five-field cron has) fires each tick
once: the failover is timed to straddle a minute boundary, so one tick falls due while
no server takes writes; it fires late, after the promotion, and once.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select, text

from questpie_celery import QuestpieError
from questpie_celery.ledger import dispatch_table
from questpie_celery.publish.schedules import FIRE_KEY_PREFIX
from tests.support import jobapp
from tests.support.background import Background
from tests.support.services import (
    ROOT,
    Beat,
    PostgresServer,
    PostgresStandby,
    RedisServer,
    multi_host_url,
    synchronous_pair,
)
from tests.support.stack import Stack, build_stack, tag
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.failover, pytest.mark.worker]

ONE_MINUTE = timedelta(minutes=1)
#: How long the primary's WAL senders stall before it crashes: the commits made meanwhile
#: wait for the standby, which never hears of them.
STALL_SECONDS = 1.5
#: How long no server takes writes: the primary is dead and the standby not yet promoted.
SWITCH_SECONDS = 4.0


@dataclass
class Publisher(Background):
    """Publishes keyed dispatches one after another from a thread; a publish that fails
    is made again under the same key until it returns an id, as a careful caller would.
    Every id returned is kept, and every failure with the moment it happened."""

    stack: Stack
    tag: str
    ids: list[str] = field(default_factory=list)
    refused: list[tuple[float, str]] = field(default_factory=list)
    unexpected: list[BaseException] = field(default_factory=list)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                found = self.stack.questpie.queue.record.publish(
                    {"tag": self.tag}, idempotency_key=f"{self.tag}:{n}"
                )
            except QuestpieError as exc:
                self.refused.append((time.monotonic(), type(exc).__name__))
                self._stop.wait(0.1)
                continue  # the same key again
            except Exception as exc:
                self.unexpected.append(exc)
                self._stop.wait(0.1)
                continue
            assert found is not None
            self.ids.append(found)
            n += 1
            self._stop.wait(0.05)


def next_boundary(after: datetime) -> datetime:
    return (after + timedelta(minutes=1)).replace(second=0, microsecond=0)


@pytest.fixture
def pair() -> Iterator[tuple[PostgresServer, PostgresStandby]]:
    primary, standby = synchronous_pair()
    yield primary, standby
    primary.close()
    standby.close()


def server_says(server: PostgresServer, query: str) -> list[tuple[object, ...]]:
    engine = create_engine(server.url(), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(query))]
    finally:
        engine.dispose()


@pytest.mark.timeout(480)
def test_the_primary_dies_and_its_synchronous_standby_takes_over(
    pair: tuple[PostgresServer, PostgresStandby],
    postgres: PostgresServer,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    primary, standby = pair
    database = primary.create_database("failover").rsplit("/", 1)[1]
    env = {
        "QP_TEST_LEDGER": multi_host_url(database, primary, standby),
        "QP_TEST_RUNS": postgres.create_database("failoverruns"),
        "QP_TEST_BROKER": redis_server.url(redis_server.new_db()),
        "QP_TEST_RELAY": "0.5",
    }
    stack = build_stack(env, tmp_path, "redis")
    beats: list[Beat] = []
    publisher = Publisher(stack, tag())
    fires = tag()
    try:
        # Durable, and synchronous: what the primary acknowledges is on the standby's disk.
        assert server_says(primary, "SHOW fsync") == [("on",)]
        assert server_says(standby, "SHOW fsync") == [("on",)]
        stack.questpie.queue.record.schedule({"tag": fires}, "* * * * *")
        first = stack.questpie.schedules.list()[0].next_fire_at
        beats = [
            Beat(stack.env, app="tests.support.jobapp:celery_app", cwd=ROOT,
                 pythonpath=str(ROOT)).start()
            for _ in range(2)
        ]  # fmt: skip
        publisher.start()
        # The switch straddles a minute boundary: that tick falls due with no writable
        # server, after some publishes have gone through.
        wait_until(lambda: len(publisher.ids) >= 20, "publishes before the failover", 60)
        boundary = next_boundary(datetime.now(UTC) + timedelta(seconds=5))
        time.sleep((boundary - datetime.now(UTC)).total_seconds() - 2 - STALL_SECONDS)  # timing
        assert server_says(primary, "SELECT sync_state FROM pg_stat_replication") == [("sync",)]
        primary.crash(stall_replication=STALL_SECONDS)
        killed = time.monotonic()
        assert datetime.now(UTC) < boundary, "the primary took too long to die"
        # Stopped and gone: a publish still on its way back may yet return, no other.
        stopped_with = len(publisher.ids) + 1
        time.sleep(SWITCH_SECONDS)  # the switch itself: nothing takes writes meanwhile
        assert len(publisher.ids) <= stopped_with, "publishes went through with no primary"
        standby.promote()
        promoted = time.monotonic()
        assert datetime.now(UTC) > boundary, "the tick did not fall due during the switch"
        at_promotion = len(publisher.ids)
        wait_until(lambda: len(publisher.ids) >= at_promotion + 20, "publishes afterwards", 60)
        # The next tick, on the new primary, as on any other minute.
        after = boundary + timedelta(minutes=1)
        time.sleep(max((after - datetime.now(UTC)).total_seconds(), 0))  # the timing
        publisher.stop()

        ids = set(publisher.ids)
        assert len(ids) == len(publisher.ids), "a publish returned another publish's id"
        assert not publisher.unexpected, publisher.unexpected
        assert publisher.refused, "no publish met the failover"
        # What a client sees during the switch: the ledger is unavailable, nothing else.
        assert {error for _, error in publisher.refused} == {"LedgerUnavailableError"}

        def fire_rows() -> dict[str, str]:
            with stack.ledger.engine.connect() as conn:
                found = conn.execute(
                    select(dispatch_table.c.idempotency_key, dispatch_table.c.status).where(
                        dispatch_table.c.idempotency_key.like(f"{FIRE_KEY_PREFIX}%")
                    )
                )
                return {key: status for key, status in found}

        minutes = [
            first + timedelta(minutes=n) for n in range(int((after - first) / ONE_MINUTE) + 1)
        ]
        assert boundary in minutes
        ticks = [f"{FIRE_KEY_PREFIX}call:{minute:%Y-%m-%dT%H:%M:%SZ}" for minute in minutes]

        def settled() -> bool:
            fired = fire_rows()
            return all(
                (row := stack.ledger.get(i)) is not None and row.status == "completed" for i in ids
            ) and all(fired.get(tick) == "completed" for tick in ticks)

        def unsettled() -> str:
            rows = {i: stack.ledger.get(i) for i in ids}
            missing = sorted(i for i, row in rows.items() if row is None)
            waiting = Counter(row.status for row in rows.values() if row is not None)
            return (
                f"{len(missing)} published dispatches are not in the ledger after the "
                f"failover (e.g. {missing[:3]}); statuses {dict(waiting)}; ticks {fire_rows()}"
            )

        wait_until(
            settled,
            "every dispatch and schedule tick to complete after the failover",
            120,
            0.2,
            explain=unsettled,
        )
        for beat in beats:
            beat.stop()
        stack.worker.stop()  # gracefully: any run still going records its end first

        with stack.runs_engine.connect() as conn:
            runs = jobapp.runs_table.c
            ends = Counter(
                conn.execute(
                    select(runs.dispatch_id).where(runs.tag == publisher.tag, runs.phase == "end")
                ).scalars()
            )
            tick_ends = Counter(
                conn.execute(
                    select(runs.idempotency_key).where(runs.tag == fires, runs.phase == "end")
                ).scalars()
            )
        assert set(ends) == ids, f"published, never ran: {ids - set(ends)}"
        assert all(n == 1 for n in ends.values()), {i: n for i, n in ends.items() if n > 1}
        # Each tick once: those before, the one that fell due in the switch (late), the next.
        assert set(fire_rows()) == set(ticks), fire_rows()
        assert tick_ends == Counter({tick: 1 for tick in ticks}), tick_ends
        statuses = Counter(row.status for i in ids if (row := stack.ledger.get(i)) is not None)
        assert statuses == Counter({"completed": len(ids)})
        print(
            f"\nfailover: {len(ids)} published, {len(publisher.refused)} refused publishes "
            f"over {publisher.refused[-1][0] - publisher.refused[0][0]:.1f}s (no writable "
            f"server for {promoted - killed:.1f}s), ticks {sorted(tick_ends)}"
        )
    finally:
        publisher.stop()
        for beat in beats:
            beat.stop()
        stack.close()
