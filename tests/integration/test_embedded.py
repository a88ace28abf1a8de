"""The embedded default: SQLite ledger file, `filesystem://` broker, two prefork children."""

from __future__ import annotations

from questpie_celery import derive_dispatch_id
from tests.support.stack import Stack, tag


def test_keyed_and_unkeyed_publish_run_on_sqlite_and_filesystem(sqlite_fs: Stack) -> None:
    t = tag()
    queue = sqlite_fs.questpie.queue
    keyed = queue.record.publish({"tag": t}, idempotency_key=f"emb:{t}")
    assert keyed == derive_dispatch_id("record", f"emb:{t}")
    assert queue.record.publish({"tag": t}, idempotency_key=f"emb:{t}") == keyed
    unkeyed = queue.record.publish({"tag": t})
    sqlite_fs.wait_status(keyed, "completed")
    ends = sqlite_fs.wait_ends(t, 2)
    assert sorted(r["dispatch_id"] for r in ends) == sorted([keyed, unkeyed])


def test_several_prefork_children_share_the_sqlite_ledger(sqlite_fs: Stack) -> None:
    t = tag()
    gate = sqlite_fs.gate()
    # The first attempts wait at the gate until both children hold one: both take work.
    ids = [
        sqlite_fs.questpie.queue.record.publish(
            {"tag": t, "fail_times": 1, "gate": str(gate), "gate_attempts": 1},
            idempotency_key=f"many:{t}:{n}",
        )
        for n in range(12)
    ]
    sqlite_fs.wait_runs(t, 2)
    gate.open()
    for dispatch_id in ids:
        assert dispatch_id is not None
        assert sqlite_fs.wait_status(dispatch_id, "completed", timeout=60).attempt == 2
    runs = sqlite_fs.runs(t)
    assert len(runs) == 24
    assert len({r["pid"] for r in runs}) == 2  # both children took work
    assert "database is locked" not in sqlite_fs.worker.log()
