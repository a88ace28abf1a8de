"""The decisions of a publish with no ledger and no broker: what a chunk's insert settles,
who first sends a new row, and the steps of a publish's chunk plan (publish/planner.py);
what an insert that ran twice counts as inserted (ledger/inserts.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from questpie_celery._runtime.plans import drive
from questpie_celery.jobs.definition import JobContext, JobDefinition
from questpie_celery.jobs.ids import derive_dispatch_id
from questpie_celery.jobs.options import StoredOptions, resolve_options
from questpie_celery.jobs.policies import QueuePolicy
from questpie_celery.ledger import NewDispatch, inserts
from questpie_celery.ledger.dispatches import DispatchStatements
from questpie_celery.publish import planner
from questpie_celery.publish.planner import Chunk, Route, first_send
from questpie_celery.send.outbox import ETA_HORIZON_SECONDS, FirstSend, is_far_off


def _row(
    dispatch_id: str, *, key: str | None = None, policy: QueuePolicy | None = None
) -> NewDispatch:
    return NewDispatch(
        id=dispatch_id,
        job_name="j",
        payload={},
        options=StoredOptions(),
        idempotency_key=key,
        policy=policy,
    )


def _chunk(*rows: NewDispatch, first: FirstSend | None = None) -> Chunk:
    chunk = Chunk()
    for row in rows:
        chunk.add(Route(row.id, row, first or FirstSend(True)))
    return chunk


EXCLUSIVE = QueuePolicy.EXCLUSIVE


def test_a_key_twice_in_a_chunk_is_sent_once_and_both_get_its_id() -> None:
    chunk = _chunk(_row("a", key="k"), _row("a", key="k"))
    settled = chunk.settle({"a"}, set())
    assert [row.id for row in settled.send] == ["a"]
    assert chunk.ids == ["a", "a"] and not settled.suppressed


def test_a_known_key_is_answered_before_the_policy_and_a_taken_slot_suppresses() -> None:
    known, taken, unkeyed = (
        _row("known", key="k1", policy=EXCLUSIVE),
        _row("taken", key="k2", policy=EXCLUSIVE),
        _row("unkeyed", policy=EXCLUSIVE),
    )
    chunk = _chunk(known, taken, unkeyed)
    # Only keyed rows under a policy need the read-back: an unkeyed one can only have
    # met the slot.
    assert chunk.contested(set()) == ["known", "taken"]
    settled = chunk.settle(set(), {"known"})
    assert chunk.ids == ["known", None, None]
    assert settled.suppressed == [taken, unkeyed] and not settled.send


def test_a_failed_read_back_leaves_only_the_contested_items_undecided() -> None:
    chunk = _chunk(
        _row("in", key="k0", policy=EXCLUSIVE),
        _row("contested", key="k1", policy=EXCLUSIVE),
        _row("unkeyed", policy=EXCLUSIVE),
    )
    settled = chunk.settle({"in"}, None)
    assert settled.undecided == [1]
    assert [row.id for row in settled.send] == ["in"]
    assert [row.id for row in settled.suppressed] == ["unkeyed"]
    assert chunk.ids == ["in", "contested", None]


@pytest.mark.parametrize(
    ("first", "send", "wake"),
    [
        (FirstSend(True), True, False),
        (FirstSend(False, send_in=0.0, wake_relays=True), False, True),
    ],
)
def test_inserted_rows_are_sent_by_their_publisher_or_wake_the_relays(
    first: FirstSend, send: bool, wake: bool
) -> None:
    chunk = _chunk(_row("a"), first=first)
    settled = chunk.settle({"a"}, set())
    assert bool(settled.send) is send and settled.wake_relays is wake
    # Nothing inserted: nothing to send, no relay to wake.
    nothing = _chunk(_row("b", key="k"), first=first).settle(set(), set())
    assert not nothing.send and not nothing.wake_relays


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_an_insert_that_ran_twice_reads_back_what_it_did_not_see(dialect: str) -> None:
    sql = DispatchStatements(dialect)
    batch = [_row("a"), _row("b"), _row("c")]
    steps: list[inserts.Run] = []

    def run(answers: list[inserts.Ran]) -> Any:
        def step(run: inserts.Run) -> inserts.Ran:
            steps.append(run)
            return answers.pop(0)

        return step

    # Ran twice: a row it did not see may be its first run's, which nobody sent.
    found = inserts.drive(
        inserts.insert_many(sql, batch), run([([{"id": "a"}], True), ([{"id": "c"}], False)])
    )
    assert found == {"a", "c"}
    assert steps[1].stmt is sql.existing and steps[1].params == {"dispatch_ids": ["b", "c"]}
    assert steps[0].rerun_if_rolled_back and not steps[0].durable
    # Ran once: what it did not see is another's.
    steps.clear()
    assert inserts.drive(inserts.insert_many(sql, batch), run([([{"id": "a"}], False)])) == {"a"}
    assert len(steps) == 1
    # One row alone: the same rule, read back with `exists`.
    steps.clear()
    assert inserts.drive(inserts.insert(sql, batch[0]), run([([], True), ([{"id": "a"}], False)]))
    assert steps[1].stmt is sql.exists
    assert not inserts.drive(inserts.insert(sql, batch[0]), run([([], False)]))
    # Nothing to insert or to look for: no statement at all.
    steps.clear()
    assert inserts.drive(inserts.insert_many(sql, []), run([])) == set()
    assert inserts.drive(inserts.existing(sql, []), run([])) == set()
    assert not steps


NOW = datetime(2030, 1, 1, tzinfo=UTC)
FAR = NOW + timedelta(seconds=ETA_HORIZON_SECONDS + 1)
NEAR = NOW + timedelta(seconds=ETA_HORIZON_SECONDS)


def test_a_start_beyond_the_eta_horizon_is_far_off_and_waits_for_the_relay() -> None:
    assert is_far_off(FAR, NOW) and not is_far_off(NEAR, NOW) and not is_far_off(None, NOW)
    # Beyond the horizon the relay sends it, a horizon before its start; eager mode
    # sends everything at once, unless there is no commit hook to send it after.
    horizon = timedelta(seconds=ETA_HORIZON_SECONDS)
    relayed = FirstSend(False, next_send_at=FAR - horizon)
    assert first_send(FAR, NOW, eager=False, after_commit_hook=True) == relayed
    assert first_send(FAR, NOW, eager=True, after_commit_hook=True) == FirstSend(True)
    assert first_send(FAR, NOW, eager=True, after_commit_hook=False) == relayed


@pytest.mark.parametrize("eager", [False, True])
def test_a_row_with_no_commit_hook_wakes_the_relays_and_any_other_is_sent_by_its_publisher(
    eager: bool,
) -> None:
    woken = FirstSend(False, send_in=0.0, wake_relays=True)
    assert first_send(NEAR, NOW, eager=eager, after_commit_hook=False) == woken
    assert first_send(None, NOW, eager=eager, after_commit_hook=True) == FirstSend(True)


class _Body(BaseModel):
    n: int


def _handler(payload: _Body, ctx: JobContext) -> None:
    del payload, ctx


DEFINITION = JobDefinition(name="planner.numbers", schema=_Body, handler=_handler)


def _plan(keys: list[str | None], policy: QueuePolicy = QueuePolicy.STANDARD) -> planner.Plan:
    options = [resolve_options({}, {"idempotency_key": key}) for key in keys]
    bodies = [{"n": n} for n in range(len(keys))]
    return planner.Plan(DEFINITION, bodies, options, policy, None, lambda: False)


def _driven(plan: planner.Plan, size: int, answers: dict[str, Any]) -> tuple[Any, list[Any]]:
    """Drive `planner.publish`, answering an insert with the rows `answers["inserted"]`
    names (all when absent) and a read-back with `answers["known"]`."""
    steps: list[Any] = []

    def run(step: planner.Step) -> Any:
        steps.append(step)
        if isinstance(step, planner.Insert):
            inserted = answers.get("inserted")
            return {row.id for row in step.rows if inserted is None or row.id in inserted}
        if isinstance(step, planner.ReadBack):
            return answers["known"]
        return None

    return drive(planner.publish(plan, size), run), steps


def test_the_chunk_plan_inserts_settles_and_sends_each_chunk_before_the_next() -> None:
    plan = _plan(["a", None, "c"])
    ids, steps = _driven(plan, 2, {})
    assert [type(step).__name__ for step in steps] == ["Insert", "Send", "Insert", "Send"]
    # Unkeyed items of a standard job are plain messages, with no row.
    first, second = steps[1], steps[3]
    assert [row.id for row in first.settled.send] == [ids[0]] and len(first.plain) == 1
    assert first.plain[0][0] == ids[1]
    assert [row.id for row in second.settled.send] == [ids[2]] and not second.plain
    assert all(isinstance(dispatch_id, str) for dispatch_id in ids)


def test_the_chunk_plan_reads_back_only_contested_rows_and_answers_none_for_the_refused() -> None:
    known, taken = (derive_dispatch_id(DEFINITION.name, key) for key in ("known", "taken"))
    plan = _plan(["known", "taken", None], QueuePolicy.EXCLUSIVE)
    ids, steps = _driven(plan, 10, {"inserted": set(), "known": {known}})
    assert [type(step).__name__ for step in steps] == ["Insert", "ReadBack", "Send"]
    # The unkeyed row can only have met the slot: it needs no read-back.
    assert steps[1] == planner.ReadBack([known, taken])
    assert ids == [known, None, None]
    assert [row.idempotency_key for row in steps[2].settled.suppressed] == ["taken", None]
    assert not steps[2].settled.send and not steps[2].plain


def test_a_read_back_answered_none_leaves_the_contested_items_undecided() -> None:
    chunk = _chunk(
        _row("in", key="k0", policy=EXCLUSIVE),
        _row("contested", key="k1", policy=EXCLUSIVE),
    )
    steps = planner.insert_chunk(chunk)
    assert isinstance(next(steps), planner.Insert)
    assert steps.send({"in"}) == planner.ReadBack(["contested"])
    with pytest.raises(StopIteration) as done:
        steps.send(None)
    assert done.value.value.undecided == [1]


def test_a_plan_of_plain_messages_never_asks_whether_sends_are_eager() -> None:
    asked: list[bool] = []

    def eager() -> bool:
        asked.append(True)
        return False

    options = [resolve_options({}, {}) for _ in range(3)]
    bodies = [{"n": n} for n in range(3)]
    plain = planner.Plan(DEFINITION, bodies, options, QueuePolicy.STANDARD, None, eager)
    assert all(plain.route(index).new is None for index in range(3)) and not asked
    keyed = [resolve_options({}, {"idempotency_key": f"k{n}"}) for n in range(3)]
    rows = planner.Plan(DEFINITION, bodies, keyed, QueuePolicy.STANDARD, None, eager)
    assert all(rows.route(index).new is not None for index in range(3)) and asked == [True]
