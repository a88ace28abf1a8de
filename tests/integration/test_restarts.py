"""PostgreSQL and Redis restarted under a running worker, its relay and a publishing loop.

Publishes that need the ledger fail with a clear `LedgerUnavailableError` only while
it is down and work again without restarting anything; no accepted dispatch is
lost and none completes twice.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
from sqlalchemy import select

from questpie_celery import BrokerError, LedgerUnavailableError, QuestpieError
from tests.support import jobapp
from tests.support.background import Background
from tests.support.services import PostgresServer, RedisServer
from tests.support.stack import Stack, build_stack, tag
from tests.support.waiting import wait_until

#: How long each server stays down.
OUTAGE_SECONDS = 4.0


@dataclass
class PublishLoop(Background):
    """Publishes keyed dispatches back to back in a thread, noting each outcome."""

    JOIN_SECONDS: ClassVar[float] = 30

    stack: Stack
    tag: str
    accepted: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # each refusal's error class
    #: "accepted" or "refused", each publish's in the order they came back.
    outcomes: list[str] = field(default_factory=list)
    unexpected: list[BaseException] = field(default_factory=list)
    last_success: float = 0.0

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                dispatch_id = self.stack.questpie.queue.record.publish(
                    {"tag": self.tag, "sleep": 0.2}, idempotency_key=f"{self.tag}:{n}"
                )
            except LedgerUnavailableError as exc:
                self.refused.append(type(exc).__name__)
                self.outcomes.append("refused")
                time.sleep(0.1)  # the publisher's pace while refused: not a wait
                continue
            except Exception as exc:
                self.unexpected.append(exc)
                continue
            assert dispatch_id is not None
            self.accepted.append(dispatch_id)
            self.outcomes.append("accepted")
            self.last_success = time.monotonic()
            time.sleep(0.05)  # the publisher's pace: not a wait

    def successes_after(self, moment: float) -> bool:
        return self.last_success > moment


def completions(stack: Stack, t: str) -> Counter[str]:
    """How many times each dispatch of `t` ran its handler to the end."""
    with stack.runs_engine.connect() as conn:
        ids = conn.execute(
            select(jobapp.runs_table.c.dispatch_id).where(
                jobapp.runs_table.c.tag == t, jobapp.runs_table.c.phase == "end"
            )
        ).scalars()
        return Counter(ids)


def assert_each_completed_once(
    stack: Stack, loop: PublishLoop, timeout: float, *, supervise: bool = False
) -> None:
    """Every accepted dispatch completes, and none twice.

    With `supervise`, a worker that exited is started again, as a process supervisor
    (systemd, Kubernetes) would: kombu's Redis transport can end a worker with an
    "Unrecoverable error" when the connection drops while it restores unacknowledged
    messages. The ledger must make that harmless: nothing lost, nothing run twice.
    """
    accepted = set(loop.accepted)
    assert len(accepted) == len(loop.accepted), "a publish returned another publish's id"

    def all_done() -> bool:
        if supervise and not stack.worker.alive():
            stack.worker.start()
        return all(
            (row := stack.ledger.get(i)) is not None and row.status == "completed" for i in accepted
        )

    try:
        wait_until(all_done, "every accepted dispatch to complete", timeout)
    except AssertionError:
        stuck = [
            (i, row.status, row.attempt, row.send_count, row.next_send_at, row.last_error)
            for i in sorted(accepted)
            if (row := stack.ledger.get(i)) is not None and row.status != "completed"
        ]
        raise AssertionError(f"not completed: {stuck}\n{stack.worker.log()[-6000:]}") from None
    ran = completions(stack, loop.tag)
    twice = {i: n for i, n in ran.items() if n > 1}
    assert not twice, f"dispatches completed more than once: {twice}"
    assert accepted <= set(ran), f"accepted but never ran: {accepted - set(ran)}"


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


def test_postgres_restarted_under_worker_relay_and_publishers(
    own_postgres: PostgresServer, redis_server: RedisServer, tmp_path: Path
) -> None:
    env = {
        "QP_TEST_LEDGER": own_postgres.create_database(),
        # Runs are recorded outside the database that goes down.
        "QP_TEST_RUNS": f"sqlite:///{tmp_path / 'runs.sqlite3'}",
        "QP_TEST_BROKER": redis_server.url(redis_server.new_db()),
        "QP_TEST_LEASE": "20",
        "QP_TEST_RELAY": "0.5",
    }
    stack = build_stack(env, tmp_path, "redis")
    loop = PublishLoop(stack, tag()).start()
    try:
        wait_until(lambda: len(loop.accepted) >= 10, "publishes before the outage", 30)
        before_stop = len(loop.outcomes)
        own_postgres.stop()
        time.sleep(OUTAGE_SECONDS)  # the outage itself: this is the scenario, not a wait
        own_postgres.start()
        restarted = time.monotonic()
        after_restart = len(loop.outcomes)
        wait_until(lambda: loop.successes_after(restarted + 1), "publishes after restart", 30)
        accepted_after = len(loop.accepted)
        wait_until(lambda: len(loop.accepted) >= accepted_after + 10, "more publishes", 30)
    finally:
        loop.stop()
    try:
        assert not loop.unexpected, f"unexpected errors: {loop.unexpected!r}"
        assert loop.refused, "no publish met the outage"
        # Refusals came only while the database was down (plus the moment its first
        # connections were being re-established), and were all LedgerUnavailableError:
        # none before the stop, and none once a publish went through after the restart.
        assert set(loop.refused) == {"LedgerUnavailableError"}
        outcomes = loop.outcomes
        assert "refused" not in outcomes[:before_stop], outcomes
        back = outcomes.index("accepted", after_restart)
        assert "refused" not in outcomes[back:], (outcomes[:back], outcomes[back:])
        assert_each_completed_once(stack, loop, timeout=90)
        assert stack.worker.alive()
    finally:
        stack.close()


def test_redis_restarted_under_worker_relay_and_publishers(
    postgres: PostgresServer, own_redis: RedisServer, tmp_path: Path
) -> None:
    env = {
        "QP_TEST_LEDGER": postgres.create_database(),
        "QP_TEST_BROKER": own_redis.url(1),
        "QP_TEST_RELAY": "0.5",
        # Redis here keeps no data across its restart: the messages it held are gone,
        # and the relay must send them again; a short redelivery time keeps the test short.
        "QP_TEST_REDELIVER": "5",
        "QP_TEST_VISIBILITY": "5",
    }
    stack = build_stack(env, tmp_path, "redis")
    loop = PublishLoop(stack, tag()).start()
    try:
        wait_until(lambda: len(loop.accepted) >= 10, "publishes before the outage", 30)
        own_redis.stop()
        time.sleep(OUTAGE_SECONDS)  # the outage itself
        # A keyed publish needs only the ledger: it is accepted while the broker is down.
        during = stack.questpie.queue.record.publish(
            {"tag": loop.tag}, idempotency_key=f"{loop.tag}:during"
        )
        assert during is not None
        loop.accepted.append(during)
        # An unkeyed one has no row to fall back on: it says so.
        with pytest.raises(BrokerError):
            stack.questpie.queue.record.publish({"tag": "unkeyed-during-outage"})
        own_redis.start()
        restarted = time.monotonic()
        wait_until(lambda: loop.successes_after(restarted + 1), "publishes after restart", 30)
    finally:
        loop.stop()
    try:
        assert not [e for e in loop.unexpected if not isinstance(e, QuestpieError)]
        assert_each_completed_once(stack, loop, timeout=120, supervise=True)
    finally:
        stack.close()
