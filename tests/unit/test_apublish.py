"""apublish in the fast lane: a SQLite ledger (its work in threads), memory://, no worker.

Concurrent calls of one loop are gathered into multi-row inserts; these tests check
that gathering changes nothing a caller can see: ids, repeats, suppressions, errors,
and nothing written for a rejected call.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pydantic import BaseModel, field_validator

from questpie_celery import (
    JobContext,
    LedgerUnavailableError,
    PayloadValidationError,
    PublishOptionsError,
    Questpie,
    QuestpieError,
    derive_dispatch_id,
    job,
)
from questpie_celery.ledger.aio import AsyncLedger
from tests.support.aio import run
from tests.unit.helpers import IdleApp
from tests.unit.test_eager import charge, runs


def test_gathered_calls_answer_as_sequential_publishes_would(idle: IdleApp) -> None:
    record = idle.questpie.queue.record
    before_rows, before_messages = idle.written()

    async def body() -> list[str | None]:
        return await asyncio.gather(
            *(record.apublish({"tag": "g"}, idempotency_key=f"g:{i % 7}") for i in range(40))
        )

    ids = run(idle.questpie, body)
    assert ids == [derive_dispatch_id("record", f"g:{i % 7}") for i in range(40)]
    rows, messages = idle.written()
    assert (rows - before_rows, messages - before_messages) == (7, 7)  # one per key


def test_a_policy_slot_is_decided_in_arrival_order(idle: IdleApp) -> None:
    short = idle.questpie.queue.policy_short

    async def body() -> list[str | None]:
        return await asyncio.gather(
            *(short.apublish({"tag": "p"}, singleton_key=f"slot-{i % 2}") for i in range(6))
        )

    ids = run(idle.questpie, body)
    # `short` keeps one queued dispatch per slot: the first call of each slot wins.
    assert [i is not None for i in ids] == [True, True, False, False, False, False]


def test_rejected_calls_write_nothing_and_the_others_go_on(idle: IdleApp) -> None:
    record = idle.questpie.queue.record
    before = idle.written()

    async def body() -> list[Any]:
        return await asyncio.gather(
            record.apublish({}, idempotency_key="bad-payload"),
            record.apublish({"tag": "x"}, priority=42),
            record.apublish({"tag": "x"}, idempotency_key="fine"),
            return_exceptions=True,
        )

    results = run(idle.questpie, body)
    assert isinstance(results[0], PayloadValidationError)
    assert isinstance(results[1], PublishOptionsError)
    assert results[2] == derive_dispatch_id("record", "fine")
    assert idle.written() == (before[0] + 1, before[1] + 1)


def test_apublish_many_names_the_bad_item_and_writes_nothing(idle: IdleApp) -> None:
    record = idle.questpie.queue.record
    before = idle.written()
    payloads: list[dict[str, Any]] = [{"tag": "ok"}] * 30 + [{}]
    with pytest.raises(PayloadValidationError, match="item 30"):
        run(
            idle.questpie,
            lambda: record.apublish_many(payloads, idempotency_keys=[f"m{i}" for i in range(31)]),
        )
    assert idle.written() == before


def test_unknown_keywords_and_wrong_transactions_are_refused(idle: IdleApp) -> None:
    record = idle.questpie.queue.record
    with pytest.raises(TypeError, match="start_after"):
        run(idle.questpie, lambda: record.apublish({"tag": "x"}, countdown=5))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="idempotency_keys"):
        run(idle.questpie, lambda: record.apublish_many([], idempotency_key="k"))  # type: ignore[arg-type]
    with pytest.raises(PublishOptionsError, match="publish\\(\\)"):
        run(idle.questpie, lambda: record.apublish({"tag": "x"}, session="no"))  # type: ignore[arg-type]
    with pytest.raises(PublishOptionsError, match="list of payloads"):
        run(idle.questpie, lambda: record.apublish_many({"tag": "x"}))  # type: ignore[arg-type]


def test_eager_mode_runs_the_handler_through_the_fence(tmp_path: Path) -> None:
    app = Celery("eager-async", broker="memory://")
    app.conf.task_always_eager = True
    questpie = Questpie(app, ledger_url=f"sqlite:///{tmp_path / 'l.db'}", jobs=[charge])
    questpie.migrate()
    runs.clear()
    try:

        async def body() -> list[str | None]:
            return [
                await questpie.queue.eager_charge.apublish({"order_id": "a"}, idempotency_key="k"),
                await questpie.queue.eager_charge.apublish({"order_id": "a"}, idempotency_key="k"),
            ]

        first, again = run(questpie, body)
        assert first == again == derive_dispatch_id("eager.charge", "k")
        assert runs == [("eager.charge", first, 1)]
    finally:
        questpie.close()


class Abort(BaseException):
    """What a validator of the project's might raise: not an Exception."""


class Numbered(BaseModel):
    n: int

    @field_validator("n")
    @classmethod
    def refuse_five(cls, value: int) -> int:
        if value == 5:
            raise Abort()
        return value


@job(name="apublish.numbered", schema=Numbered)
def numbered(payload: Numbered, ctx: JobContext) -> None:
    del payload, ctx


def test_a_base_exception_in_one_call_leaves_the_others_answered(tmp_path: Path) -> None:
    app = Celery("numbered", broker="memory://")
    questpie = Questpie(app, ledger_url=f"sqlite:///{tmp_path / 'l.db'}", jobs=[numbered])
    questpie.migrate()
    client = questpie.client(numbered)
    try:

        async def body() -> list[Any]:
            calls = (client.apublish({"n": n}, idempotency_key=f"n{n}") for n in range(10))
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)

        results = run(questpie, body)
        assert [isinstance(r, str) for r in results] == [n != 5 for n in range(10)]
        assert isinstance(results[5], QuestpieError)
    finally:
        questpie.close()


def test_a_failed_existence_check_fails_only_the_calls_that_needed_it(
    idle: IdleApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot taken by an earlier publish makes the keyed call's insert a conflict that
    needs the existence check; the call whose row was written is answered regardless."""
    short = idle.questpie.queue.policy_short
    assert short.publish({"tag": "holder"}, singleton_key="held") is not None

    async def unreachable(self: AsyncLedger, dispatch_ids: Any) -> set[str]:
        raise LedgerUnavailableError("the dispatch ledger database cannot be reached")

    monkeypatch.setattr(AsyncLedger, "existing", unreachable)

    async def body() -> list[Any]:
        return await asyncio.gather(
            short.apublish({"tag": "free"}, singleton_key="free-slot"),
            short.apublish({"tag": "contested"}, singleton_key="held"),
            return_exceptions=True,
        )

    free, contested = run(idle.questpie, body)
    assert isinstance(free, str) and idle.questpie.queue.get_status(free) is not None
    # A singleton-keyed call has no idempotency key: nothing to check, it is suppressed.
    assert contested is None

    async def keyed() -> list[Any]:
        return await asyncio.gather(
            short.apublish({"tag": "free"}, singleton_key="free-slot-2"),
            short.apublish({"tag": "contested"}, idempotency_key="k-held"),
            return_exceptions=True,
        )

    assert short.publish({"tag": "holder"}) is not None  # the job's unkeyed slot ""
    free, contested = run(idle.questpie, keyed)
    assert isinstance(free, str) and idle.questpie.queue.get_status(free) is not None
    assert isinstance(contested, LedgerUnavailableError)


def test_a_test_swapping_the_broker_makes_questpie_read_its_kind_again(tmp_path: Path) -> None:
    """How priorities are sent depends on the broker's kind, read once per broker: the
    testing plugin's swap to memory:// and back must not leave the old kind cached."""
    from questpie_celery.testing.celery_app import celery_settings  # noqa: PLC0415

    app = Celery("kind", broker="redis://127.0.0.1:9/0")
    questpie = Questpie(app, ledger_url=f"sqlite:///{tmp_path / 'l.db'}")
    sender = questpie._sender
    sender._kind = "redis"  # as a first send caches it
    try:
        with celery_settings(app, {"broker_url": "memory://"}):
            assert sender._kind is None
            sender._kind = "memory"
        assert sender._kind is None
    finally:
        questpie.close()
