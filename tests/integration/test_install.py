"""A new user's install: the wheel, the README's install line, a fresh virtual environment,
and a real worker started from it that runs a published job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import urllib.request
import venv
from pathlib import Path

from sqlalchemy import create_engine, text

from tests.support.services import ROOT, PostgresServer, RedisServer, Worker, free_port
from tests.support.waiting import wait_until

PROJECT = """
from celery import Celery
from pydantic import BaseModel
from questpie_celery import JobContext, Questpie, job
import os

celery_app = Celery("shop", broker=os.environ["SHOP_BROKER"])


class WelcomePayload(BaseModel):
    user_id: str


@job(name="send-welcome-email", schema=WelcomePayload, options={"retry_limit": 3})
def send_welcome_email(payload: WelcomePayload, ctx: JobContext) -> None:
    del payload, ctx


questpie = Questpie(celery_app, ledger_url=os.environ["SHOP_LEDGER"], jobs=[send_welcome_email])
"""


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return None


def readme_install_line() -> str:
    """The quick start's install line, without its comment."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("pip install "):
            return line.split("#", 1)[0].strip()
    raise AssertionError("the README has no pip install line")


def test_the_readme_install_line_gives_a_working_worker(
    postgres: PostgresServer, redis_server: RedisServer, tmp_path: Path
) -> None:
    # Built from a copy: setuptools builds in the source tree (build/, *.egg-info), which
    # the worker processes of tests running beside this one import from.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT, source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
        ),
    )  # fmt: skip
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(source)],
        check=True,
    )
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # The README's exact line, with the freshly built wheel found first.
    line = readme_install_line()
    assert line == "pip install 'questpie-celery[postgres,redis,web]'"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--find-links", str(wheels),
         "questpie-celery[postgres,redis,web]"],
        check=True,
    )  # fmt: skip
    # The package comes from the wheel, not from this checkout.
    where = subprocess.run(
        [str(python), "-c", "import questpie_celery; print(questpie_celery.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert where.stdout.startswith(str(env_dir)), where.stdout
    project = tmp_path / "proj"
    project.mkdir()
    (project / "shop.py").write_text(textwrap.dedent(PROJECT))
    settings = {
        "SHOP_BROKER": redis_server.url(redis_server.new_db()),
        "SHOP_LEDGER": postgres.create_database(),
        "PYTHONPATH": str(project),
    }
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | settings
    cli = env_dir / "bin" / "questpie-celery"
    # The quick start's commands as written: -A takes what celery -A takes.
    migrated = subprocess.run(
        [str(cli), "migrate", "-A", "shop"],
        cwd=project, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stderr
    # The status page the next section shows: the install line brought what it needs.
    port = free_port()
    with (tmp_path / "web.log").open("wb") as web_log:
        web = subprocess.Popen(
            [str(cli), "web", "-A", "shop", "--port", str(port)],
            cwd=project, env=env, stdout=web_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        page = wait_until(lambda: _get(f"http://127.0.0.1:{port}/"), "the status page", 60, 0.2)
        assert "<title>questpie ledger</title>" in page, page
    finally:
        web.terminate()
        web.wait(30)
    worker = Worker(
        settings, app="shop", python=str(python), cwd=project, pythonpath=str(project)
    ).start()
    try:
        published = subprocess.run(
            [str(python), "-c",
             "from shop import questpie; print(questpie.queue.send_welcome_email.publish("
             "{'user_id': 'usr_123'}, idempotency_key='welcome:usr_123'))"],
            cwd=project, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert published.returncode == 0, published.stderr
        dispatch_id = published.stdout.strip()
        engine = create_engine(settings["SHOP_LEDGER"])
        status: list[str | None] = [None]

        def completed() -> bool:
            with engine.connect() as conn:
                status[0] = conn.execute(
                    text("SELECT status FROM questpie_queue_dispatch WHERE id = :id"),
                    {"id": dispatch_id},
                ).scalar()
            return status[0] == "completed"

        try:
            wait_until(
                completed,
                f"dispatch {dispatch_id} to complete",
                60,
                0.1,
                explain=lambda: f"it is {status[0]}\n{worker.log()}",
            )
        finally:
            engine.dispose()
        assert f"Task send-welcome-email[{dispatch_id}] succeeded" in worker.log()
        assert "Traceback" not in worker.log()
    finally:
        worker.stop()
