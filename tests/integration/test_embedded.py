"""The embedded default: SQLite ledger file, `filesystem://` broker, two prefork children."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from questpie_celery import derive_dispatch_id
from tests.support.services import ROOT
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


#: What differs from one run of the demo to the next: its temporary folder, the time, and
#: random (version 4) ids. Keyed ids derive from their key, the same in every run.
_RUN_TO_RUN = [
    (re.compile(r"\S*questpie-demo-[^/\s]+"), "<folder>"),
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "<id>"),
    (re.compile(r"handled_at=\d\d:\d\d:\d\d"), "handled_at=<time>"),
]


def _shape(printed: str) -> list[list[str]]:
    """The demo's output as its sections (blocks between blank lines), with what
    differs between runs masked, and the worker's lines in a fixed order: its two
    children run them in whatever order they take them."""
    for pattern, mask in _RUN_TO_RUN:
        printed = pattern.sub(mask, printed)
    sections = [block.splitlines() for block in printed.strip().split("\n\n")]
    return [
        [s[0], *sorted(s[1:])] if s[0].startswith("what the worker ran") else s for s in sections
    ]


@pytest.mark.worker
def test_the_demo_prints_what_the_readme_shows() -> None:
    readme = (ROOT / "README.md").read_text()
    shown = readme.split("What the demo prints", 1)[1].split("```text\n", 1)[1].split("```")[0]
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert _shape(done.stdout) == _shape(shown)
