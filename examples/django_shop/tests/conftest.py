"""A real `celery -A shop worker` for the tests, on pytest-django's test database.

The tests need PostgreSQL (`DATABASE_URL=postgres://...`) and a broker
(`CELERY_BROKER_URL`). pytest-django creates the test database `test_<name>` and runs the
migrations (the ledger's included); the worker is then pointed at that same database.
A worker is another process: it sees only committed rows, so the tests that use it are
`transaction=True` tests, whose writes really commit (and which empty the tables after).
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.db import connection

PROJECT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def mail_folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="shop-mail-") as folder:
        yield Path(folder)


@pytest.fixture(scope="session")
def project_env(
    django_db_setup: None, django_db_blocker: object, mail_folder: Path
) -> dict[str, str]:
    """The environment of a process of this project on the test database."""
    url = os.environ.get("DATABASE_URL", "")
    if urlsplit(url).scheme not in ("postgres", "postgresql"):
        pytest.skip("the worker tests need DATABASE_URL=postgres://...")
    test_db = connection.settings_dict["NAME"]  # test_<name>, made by pytest-django
    return {
        **os.environ,
        "DATABASE_URL": urlsplit(url)._replace(path=f"/{test_db}").geturl(),
        "EMAIL_FILE_PATH": str(mail_folder),
    }


@pytest.fixture(scope="session")
def worker(project_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`celery -A shop worker`, started once; yields the path of its log."""
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "shop", "worker", "-l", "info", "-c", "2",
             "--without-gossip", "--without-mingle", "--without-heartbeat"],
            cwd=PROJECT, env=project_env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while " ready." not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start:\n{log.read_text()}")
            time.sleep(0.1)
        yield log
    finally:
        # Stopped before pytest-django drops the test database (it holds connections).
        # SIGTERM to the main process only (a warm shutdown, which stops the pool's
        # children itself): sent to the whole group, it can kill a child holding the
        # pool's queue lock, and the main process then waits for it for ever at exit.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
