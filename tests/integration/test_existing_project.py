"""examples/existing_project run as its README says: `questpie-celery migrate -A proj`,
then a real `celery -A proj worker` (and `celery beat`) in the example's folder, on
PostgreSQL and Redis, with the project's pickle serializer.

The test process imports the project as its web process would, and calls the tasks
through the project's own call sites (`proj/services.py`), which the adoption left
untouched. The example's README shows the adoption as a diff of `proj/tasks.py`; the
first test holds the diff to the file.
"""

from __future__ import annotations

import gc
import importlib
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, select

from questpie_celery import derive_dispatch_id
from questpie_celery.ledger import dispatch_table
from tests.support.services import ROOT, Beat, PostgresServer, RedisServer, Worker
from tests.support.waiting import wait_until

EXAMPLE = ROOT / "examples" / "existing_project"
SECRET = "the existing project's secret, 32 bytes or more"


@dataclass
class Project:
    env: dict[str, str]
    celery: ModuleType  # proj.celery, as this process imported it
    services: ModuleType  # proj.services: the call sites
    tasks: ModuleType
    worker: Worker
    engine: Engine  # this test's own look at the ledger

    def status(self, dispatch_id: str) -> Any:
        return self.celery.questpie.queue.get_status(dispatch_id)

    def wait_status(self, dispatch_id: str, status: str, timeout: float = 30) -> Any:
        return wait_until(
            lambda: (found := self.status(dispatch_id)) and found.status == status and found,
            f"dispatch {dispatch_id} to be {status}",
            timeout,
            0.05,
            explain=self.worker.log,
        )

    def settled(self) -> None:
        """Wait until the worker has ended every delivery it took."""
        wait_until(
            lambda: self.worker.unfinished() == 0,
            "the worker to end every delivery it took",
            30,
            0.05,
            explain=self.worker.log,
        )

    def logged(self, text: str) -> int:
        """How many lines of the worker's log hold `text` (the tasks log what they do)."""
        return sum(text in line for line in self.worker.log().splitlines())


def _run(*args: str, env: dict[str, str]) -> None:
    done = subprocess.run(
        args,
        cwd=EXAMPLE,
        env={**os.environ, **env, "PYTHONPATH": str(EXAMPLE)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"


def _forget_proj() -> None:
    for name in [m for m in sys.modules if m == "proj" or m.startswith("proj.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def project_stack(postgres: PostgresServer, redis_server: RedisServer) -> Iterator[Project]:
    env = {
        "LEDGER_URL": postgres.create_database("existing"),
        "BROKER_URL": redis_server.url(redis_server.new_db()),
        "RESULT_BACKEND": redis_server.url(redis_server.new_db()),
        "QUESTPIE_SECRET": SECRET,
        # Celery runs a worker that accepts pickle as root only when told (CI is root).
        "C_FORCE_ROOT": "1",
    }
    # As the README says, in the example's folder: migrate, then start the worker.
    _run(str(Path(sys.executable).parent / "questpie-celery"), "migrate", "-A", "proj", env=env)
    worker = Worker(env, app="proj", cwd=EXAMPLE, pythonpath=str(EXAMPLE)).start()
    patch = pytest.MonkeyPatch()
    for name, value in env.items():
        patch.setenv(name, value)  # the project reads its settings when imported
    patch.syspath_prepend(str(EXAMPLE))
    _forget_proj()
    celery_module = importlib.import_module("proj.celery")
    celery_module.app.set_current()  # the shared tasks' proxies resolve to this app
    project = Project(
        env=env,
        celery=celery_module,
        services=importlib.import_module("proj.services"),
        tasks=importlib.import_module("proj.tasks"),
        worker=worker,
        engine=create_engine(env["LEDGER_URL"]),
    )
    try:
        yield project
    finally:
        worker.stop()
        # The tests' AsyncResults unsubscribe from the Redis result backend when they are
        # collected: now, while Redis runs, not at the session's end, after it stopped.
        gc.collect()
        celery_module.questpie.close()
        celery_module.app.close()
        project.engine.dispose()
        patch.undo()
        _forget_proj()


def readme_diff() -> str:
    readme = (EXAMPLE / "README.md").read_text()
    found = re.search(r"```diff\n(.*?)```", readme, re.DOTALL)
    assert found, "the example's README shows no diff"
    return found[1]


def test_the_readmes_diff_is_the_adoption_of_proj_tasks() -> None:
    """Each hunk's new side is in proj/tasks.py as it stands, and no task's decorator
    gained more than three lines (its call sites none: the diff names no other file)."""
    diff = readme_diff()
    source = (EXAMPLE / "proj" / "tasks.py").read_text()
    assert diff.startswith("--- a/proj/tasks.py\n+++ b/proj/tasks.py\n"), diff
    hunks = re.split(r"^@@[^\n]*@@[^\n]*\n", diff, flags=re.MULTILINE)[1:]
    assert hunks, diff
    for hunk in hunks:
        lines = hunk.splitlines()
        new_side = "".join(line[1:] + "\n" for line in lines if not line.startswith("-"))
        assert new_side in source, new_side
        assert sum(line.startswith("+") for line in lines) <= 3, hunk


def test_a_double_upload_processes_the_document_once(project_stack: Project) -> None:
    """The call site, twice (a double click): one dispatch id, one run, with the
    dataclass the pickle serializer carries and the call site's custom header."""
    project = project_stack
    document = 10_000 + uuid.uuid4().int % 1_000_000
    request = f"req-{uuid.uuid4().hex[:8]}"
    Processing = project.tasks.Processing
    first = project.services.document_uploaded(document, Processing("cs"), request)
    second = project.services.document_uploaded(document, Processing("de"), request)
    assert (
        first.id
        == second.id
        == derive_dispatch_id("proj.tasks.process_document", f"process:{document}")
    )
    assert first.get(timeout=30) == {"document_id": document, "language": "cs", "pages": 3}
    row = project.wait_status(first.id, "completed")
    assert (row.attempt, row.idempotency_key) == (1, f"process:{document}")
    project.settled()
    assert project.logged(f"processing document {document} in cs (request {request})") == 1
    assert project.logged(f"processing document {document} ") == 1


def test_the_chord_over_a_batch_runs_its_plain_body(project_stack: Project) -> None:
    """A chord of the adopted task with a plain Celery task as its body, called as the
    project calls it, on the Redis result backend: each document once, the body once."""
    project = project_stack
    batch = f"batch-{uuid.uuid4().hex[:8]}"
    documents = [20_000_000 + uuid.uuid4().int % 1_000_000 + i * 1_000_000 for i in range(3)]
    result = project.services.import_batch(batch, documents)
    assert result.get(timeout=60) == {"batch_id": batch, "documents": 3, "pages": 9}
    for document in documents:
        dispatch_id = derive_dispatch_id("proj.tasks.process_document", f"process:{document}")
        project.wait_status(dispatch_id, "completed")
    project.settled()
    assert project.logged(f"batch {batch}: 3 documents, 9 pages") == 1
    for document in documents:
        assert project.logged(f"processing document {document} ") == 1


def test_a_secret_charge_runs_once_and_its_token_is_nowhere(project_stack: Project) -> None:
    project = project_stack
    order = f"order-{uuid.uuid4().hex[:8]}"
    token = f"tok-CANARY-{uuid.uuid4().hex}"
    first = project.services.pay(order, token)
    assert project.services.pay(order, token).id == first.id
    assert first.get(timeout=30) is None  # a secret task's result is not stored
    row = project.wait_status(first.id, "completed")
    assert row.secret
    project.settled()
    assert project.logged(f"charged order {order} (a token of {len(token)} characters)") == 1
    with project.engine.connect() as conn:
        stored = conn.execute(select(dispatch_table).where(dispatch_table.c.id == first.id)).one()
    assert token not in repr(stored)
    assert token not in project.worker.log()


BEAT_PROJECT = """
# The example's app, its beat entry every 2 s instead of every quarter of an hour.
from proj.celery import app

entry = app.conf.beat_schedule["rebuild-search-index"]
app.conf.beat_schedule = {"rebuild-search-index": {**entry, "schedule": 2.0}}
"""


def test_the_beat_entry_of_an_adopted_task_goes_through_the_ledger(
    project_stack: Project, tmp_path: Path
) -> None:
    """`celery beat` sends the example's entry; the adopted task's policy (`stately`,
    per index) makes each fire a dispatch in the ledger, and the worker runs it."""
    project = project_stack
    (tmp_path / "beatproj.py").write_text(textwrap.dedent(BEAT_PROJECT))
    beat = Beat(
        project.env, app="beatproj:app", cwd=tmp_path, pythonpath=f"{EXAMPLE}:{tmp_path}"
    ).start()
    table = dispatch_table.c

    def completed() -> list[Any]:
        with project.engine.connect() as conn:
            return list(
                conn.execute(
                    select(dispatch_table).where(
                        table.job_name == "proj.tasks.rebuild_index",
                        table.status == "completed",
                    )
                )
            )

    try:
        rows = wait_until(completed, "a fire of the beat entry to complete", 30, 0.1,
                          explain=lambda: beat.log() + project.worker.log())  # fmt: skip
    finally:
        beat.stop()
    # Its key computed from the entry's args: beat called the task's `apply_async` (a
    # plain send by name would be taken in at the worker, against the job as a whole).
    assert (rows[0].policy, rows[0].singleton_key) == ("stately", "search")
    assert "Sending due task rebuild-search-index (proj.tasks.rebuild_index)" in beat.log()
    assert "Traceback" not in beat.log(), beat.log()
    project.settled()
    assert project.logged("rebuilt index search") >= 1
