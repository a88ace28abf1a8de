"""The queue policy vocabulary, the slot rules of each policy, and that the ledger's
partial unique indexes (which enforce the rules) follow exactly those rules."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, cast, get_args

import pytest
from celery import Celery
from celery.exceptions import Ignore
from pydantic import BaseModel
from sqlalchemy import BindParameter, Index, text

from questpie_celery import JobContext, QueuePolicy, QueuePolicyName, job
from questpie_celery.errors import DispatchIdError, LedgerBusyError
from questpie_celery.ledger import Ledger, dispatch_table, open_ledger
from questpie_celery.send.broker import Sender
from questpie_celery.signals import publish_suppressed
from questpie_celery.worker.admission import Admission
from questpie_celery.worker.delivery_wait import DeliveryWait
from tests.unit.helpers import IdleApp, new_dispatch, sqlite_now, sqlite_url

# The table of the policies module's docstring, written out: (one_waiting, one_running,
# one_overall). `standard` limits nothing.
RULES: dict[str, tuple[bool, bool, bool]] = {
    "standard": (False, False, False),
    "short": (True, False, False),
    "singleton": (False, True, False),
    "stately": (True, True, False),
    "exclusive": (False, False, True),
}
WAITING = {"pending", "queued", "parked"}
RUNNING = {"active", "retry"}
# index name -> (the rule it enforces, the statuses it covers)
SLOT_INDEXES: dict[str, tuple[str, set[str]]] = {
    "questpie_slot_waiting": ("one_waiting", WAITING),
    "questpie_slot_running": ("one_running", RUNNING),
    "questpie_slot_exclusive": ("one_overall", WAITING | RUNNING),
}


def test_vocabulary() -> None:
    assert [str(policy) for policy in QueuePolicy] == list(RULES)
    assert set(get_args(QueuePolicyName)) == set(RULES)
    for name in RULES:
        policy = QueuePolicy(name)
        assert policy == name  # a str: compares equal to its name
        assert isinstance(policy, str)
        assert f"{policy}" == name
        assert policy.value == name


@pytest.mark.parametrize("name", list(RULES))
def test_slot_rules(name: str) -> None:
    policy = QueuePolicy(name)
    _, one_running, one_overall = RULES[name]
    assert (policy.one_waiting, policy.one_running, policy.one_overall) == RULES[name]
    # A run may find its slot busy exactly when runs are limited.
    assert policy.limits_runs is (one_running or one_overall)
    # Every policy but standard needs a ledger row for each dispatch.
    assert policy.ledgered is (name != "standard")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("standard", QueuePolicy.STANDARD), ("stately", QueuePolicy.STATELY),
     (QueuePolicy.EXCLUSIVE, QueuePolicy.EXCLUSIVE), ("Stately", None), (" short", None),
     ("fifo", None), ("", None), (None, None), (3, None), (b"short", None),
     (["short"], None)],
)  # fmt: skip
def test_parse(value: object, expected: QueuePolicy | None) -> None:
    assert QueuePolicy.parse(value) is expected


@pytest.mark.parametrize("name", list(RULES))
def test_a_new_dispatch_takes_a_slot_only_under_a_ledgered_policy(name: str) -> None:
    policy = QueuePolicy(name)
    keyed = new_dispatch(policy=policy, singleton_key="tenant-1")
    whole = new_dispatch(policy=policy)
    if policy.ledgered:
        assert (keyed.slot, whole.slot) == ("tenant-1", "")  # "" is the job as a whole
    else:
        assert (keyed.slot, whole.slot) == (None, None)
    assert new_dispatch(singleton_key="tenant-1").slot is None  # no policy, no slot


def _policies_in(where: Any) -> tuple[set[str], set[str]]:
    """(policies, statuses) of an index's `policy IN (...) AND status IN (...)`."""
    found: dict[str, set[str]] = {}
    for clause in where.clauses:
        assert isinstance(clause.right, BindParameter)
        values = cast(list[str], clause.right.value)
        found[clause.left.name] = {str(value) for value in values}
    assert set(found) == {"policy", "status"}
    return found["policy"], found["status"]


def _index(name: str) -> Index:
    [index] = [i for i in dispatch_table.indexes if i.name == name]
    return index


@pytest.mark.parametrize("index_name", list(SLOT_INDEXES))
def test_slot_indexes_in_the_metadata_list_exactly_the_rules_policies(index_name: str) -> None:
    rule, statuses = SLOT_INDEXES[index_name]
    expected = {str(policy) for policy in QueuePolicy if getattr(policy, rule)}
    # ... and the same set from the written-out table, so a wrong rule fails too.
    position = ("one_waiting", "one_running", "one_overall").index(rule)
    assert expected == {name for name, rules in RULES.items() if rules[position]}
    index = _index(index_name)
    assert index.unique
    assert [column.name for column in index.columns] == ["job_name", "slot"]
    for dialect in ("postgresql", "sqlite"):
        assert _policies_in(index.dialect_options[dialect]["where"]) == (expected, statuses)


def test_no_other_unique_index_limits_the_dispatch_table() -> None:
    # The policy slots' indexes, and the concurrency limit's seats (held only while a run
    # holds a seat: a limited job's), and a debounced job's one open burst per key (its
    # column is set only on a debounced dispatch's row).
    unique = {index.name for index in dispatch_table.indexes if index.unique}
    assert unique == {*SLOT_INDEXES, "questpie_limit_seat", "questpie_debounce_burst"}
    burst = next(i for i in dispatch_table.indexes if i.name == "questpie_debounce_burst")
    assert [column.name for column in burst.columns] == ["job_name", "debounce_key"]
    assert "debounce_key IS NOT NULL" in str(burst.dialect_options["postgresql"]["where"])
    seat = next(index for index in dispatch_table.indexes if index.name == "questpie_limit_seat")
    assert [column.name for column in seat.columns] == ["job_name", "group_key", "seat"]
    assert "seat IS NOT NULL" in str(seat.dialect_options["postgresql"]["where"])


def test_slot_indexes_in_a_migrated_database_list_exactly_the_rules_policies(
    ledger: Ledger,
) -> None:
    with ledger.engine.connect() as conn:
        created: dict[str, str] = dict(
            conn.execute(
                text("SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")
            ).all()
        )
    for index_name, (rule, statuses) in SLOT_INDEXES.items():
        sql = created[index_name]
        assert sql.startswith(f"CREATE UNIQUE INDEX {index_name} ")
        policy_list = re.search(r"policy IN \(([^)]*)\)", sql)
        status_list = re.search(r"status IN \(([^)]*)\)", sql)
        assert policy_list is not None and status_list is not None, sql
        policies = set(re.findall(r"'([a-z]+)'", policy_list.group(1)))
        assert policies == {str(p) for p in QueuePolicy if getattr(p, rule)}
        assert set(re.findall(r"'([a-z]+)'", status_list.group(1))) == statuses


def _claim(ledger: Ledger, dispatch_id: str) -> str:
    return ledger.claims.claim(dispatch_id, "policy.job", 1, 60).outcome


@pytest.mark.parametrize("name", list(RULES))
def test_the_database_enforces_each_policys_rules(ledger: Ledger, name: str) -> None:
    """Two dispatches in one slot: what may wait and what may run beside each other."""
    policy = QueuePolicy(name)
    one_waiting, one_running, one_overall = RULES[name]

    def dispatch(key: str = "slot-a") -> Any:
        return new_dispatch("policy.job", policy=policy, singleton_key=key)

    first, second = dispatch(), dispatch()
    assert ledger.dispatches.insert(first) is True
    # A second waiting dispatch of the same slot.
    assert ledger.dispatches.insert(second) is not (one_waiting or one_overall)
    # Another slot of the same job is never affected.
    assert ledger.dispatches.insert(dispatch("slot-b")) is True
    assert _claim(ledger, first.id) == "claimed"
    if one_overall:
        assert ledger.dispatches.insert(second) is False  # one run holds the whole slot
        return
    # The first now runs, so a waiting place is free again (where only one may wait, the
    # second gets in now; elsewhere it was in already and its id is taken).
    assert ledger.dispatches.insert(second) is one_waiting
    assert _claim(ledger, second.id) == ("blocked" if one_running else "claimed")
    row = ledger.get(second.id)
    assert row is not None
    assert row.status == ("pending" if one_running else "active")
    if one_running:
        # Once the first run ends for good, the slot's running place is free.
        first_row = ledger.get(first.id)
        assert first_row is not None and first_row.claim_token is not None
        assert ledger.claims.finish(first.id, first_row.claim_token, "completed", None) is True
        assert _claim(ledger, second.id) == "claimed"


class Count(BaseModel):
    n: int


@job(
    name="policies.plain",
    schema=Count,
    options={"queue_policy": "exclusive", "start_after": 600, "priority": 3, "queue": "jobs"},
)
def plain_job(payload: Count, ctx: JobContext) -> None:
    """Never run here: only its plain deliveries' admission is."""


def test_a_plain_delivery_of_a_policy_job_is_taken_in_as_a_publish_would_write_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its row is under the message's id, `queued` (the broker has it), with the job's
    options and the delivery's own headers and route; not the job's declared start (the
    delivery is here already: a row due in ten minutes would turn it away as early). A
    second one meets the taken slot and is suppressed, reported as a publish's is."""
    ledger = open_ledger(sqlite_url(tmp_path))
    ledger.migration.migrate()
    app = Celery("admission", broker="memory://")

    def run(self: Any, payload: Any) -> None:
        """The job's task: only its request is read here."""

    task = app.task(name=plain_job.name, bind=True)(run)
    admission = Admission(ledger, DeliveryWait(ledger, Sender(app)), redeliver_after=lambda: 3600.0)
    heard: list[dict[str, Any]] = []

    def on_suppressed(sender: str, **kwargs: Any) -> None:
        heard.append({"sender": sender, **kwargs})

    publish_suppressed.connect(on_suppressed)
    try:
        task.push_request(
            id="plain-1",
            headers={"x-trace": "abc"},
            delivery_info={"exchange": "", "routing_key": "elsewhere"},
        )
        body, back = admission.plain(task, plain_job, QueuePolicy.EXCLUSIVE, None, {"n": 1})
        task.pop_request()
        assert body == {"n": 1} and not back.ledgered and back.token
        row = ledger.get("plain-1")
        assert row is not None
        assert (row.status, row.policy, row.attempt) == ("queued", QueuePolicy.EXCLUSIVE, 0)
        assert row.run_after is not None and row.run_after <= sqlite_now(ledger)  # due now
        assert (row.options.priority, row.options.queue) == (3, "jobs")
        assert row.options.carry == {"headers": {"x-trace": "abc"}, "queue": "elsewhere"}

        task.push_request(id="plain-2", headers={}, delivery_info={})
        with caplog.at_level(logging.INFO), pytest.raises(Ignore):
            admission.plain(task, plain_job, QueuePolicy.EXCLUSIVE, None, {"n": 2})
        task.pop_request()
        assert ledger.get("plain-2") is None
        assert heard == [
            {"sender": plain_job.name, "signal": publish_suppressed,
             "job_name": plain_job.name, "singleton_key": None, "policy": "exclusive"}
        ]  # fmt: skip
        assert (
            "delivery plain-2 of job policies.plain suppressed by its exclusive queue policy "
            "(slot '' is taken)"
        ) in caplog.messages
    finally:
        publish_suppressed.disconnect(on_suppressed)
        ledger.close()


def test_the_worker_and_publish_lines_keep_the_loggers_operators_filter_on(
    idle: IdleApp, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A publish's suppression is told under `questpie_celery.publish`, and what the worker
    tells of a delivery before its run (a suppressed plain delivery, a refused task id)
    under `questpie_celery.fence`, as before those lines moved to
    `intake/new_rows.py`, `worker/admission.py` and `worker/delivery_wait.py`: a
    project's logging configuration names those loggers."""
    short = idle.questpie.queue.policy_short
    with caplog.at_level(logging.INFO):
        assert short.publish({"tag": "a"}, singleton_key="loggers") is not None
        assert short.publish({"tag": "b"}, singleton_key="loggers") is None
    told = [r for r in caplog.records if "suppressed by its short queue policy" in r.message]
    assert [r.name for r in told] == ["questpie_celery.publish"]

    ledger = open_ledger(sqlite_url(tmp_path))
    ledger.migration.migrate()
    app = Celery("admission-loggers", broker="memory://")

    def run(self: Any, payload: Any) -> None:
        """The job's task: only its request is read here."""

    # Only its request is read: a name of its own keeps Celery's registry unambiguous.
    task = app.task(name=f"{plain_job.name}.loggers", bind=True)(run)
    admission = Admission(ledger, DeliveryWait(ledger, Sender(app)), redeliver_after=lambda: 1.0)
    caplog.clear()
    try:
        with caplog.at_level(logging.INFO):
            task.push_request(id="taken-1", headers={}, delivery_info={})
            admission.plain(task, plain_job, QueuePolicy.EXCLUSIVE, None, {"n": 1})
            task.pop_request()
            task.push_request(id="taken-2", headers={}, delivery_info={})
            with pytest.raises(Ignore):  # its slot is taken
                admission.plain(task, plain_job, QueuePolicy.EXCLUSIVE, None, {"n": 2})
            task.pop_request()
            task.push_request(id="x" * 10_000, headers={}, delivery_info={})
            with pytest.raises(DispatchIdError):
                admission.plain(task, plain_job, QueuePolicy.EXCLUSIVE, None, {"n": 1})
            task.pop_request()
            held = iter([LedgerBusyError("a row is held"), None])

            def claim_once_held() -> bool:
                error = next(held)
                if error is not None:
                    raise error
                return True

            task.push_request(id="waits-1", headers={}, delivery_info={})
            assert DeliveryWait(ledger, Sender(app)).unledgered(
                task, claim_once_held, None, plain_job
            )
            task.pop_request()
    finally:
        ledger.close()
    worker_lines = {
        r.name
        for r in caplog.records
        if "delivery taken-2" in r.message
        or "cannot be a dispatch id" in r.message
        or "dispatch waits-1: the ledger is unreachable or busy" in r.message
    }
    assert worker_lines == {"questpie_celery.fence"}
