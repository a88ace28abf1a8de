"""The decisions of a publish with no ledger and no broker: what a chunk's insert settles
(publish/planner.py), and what an insert that ran twice counts as inserted (ledger/inserts.py)."""

from __future__ import annotations

from typing import Any

import pytest

from questpie_celery.jobs.options import StoredOptions
from questpie_celery.jobs.policies import QueuePolicy
from questpie_celery.ledger import NewDispatch, inserts
from questpie_celery.ledger.dispatches import DispatchStatements
from questpie_celery.publish.planner import Chunk, Route
from questpie_celery.send.outbox import FirstSend


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
