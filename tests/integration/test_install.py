"""A new user's install: the wheel, the README's install line, a fresh virtual environment,
and a real worker started from it that runs a published job."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import venv
from pathlib import Path

from sqlalchemy import create_engine, text

from tests.support.services import ROOT, PostgresServer, RedisServer, Worker

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


def readme_install_line() -> str:
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("pip install "):
            return line
    raise AssertionError("the README has no pip install line")


def test_the_readme_install_line_gives_a_working_worker(
    postgres: PostgresServer, redis_server: RedisServer, tmp_path: Path
) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
    )
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # The README's exact line, with the freshly built wheel found first.
    line = readme_install_line()
    assert line == "pip install 'questpie-celery[postgres,redis]'"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--find-links", str(wheels),
         "questpie-celery[postgres,redis]"],
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
    migrated = subprocess.run(
        [str(cli), "migrate", "-A", "shop:questpie"],
        cwd=project, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stderr
    # The status page is an extra of its own: without it, the command says how to get it.
    web = subprocess.run(
        [str(cli), "web", "-A", "shop:questpie"],
        cwd=project, env=env, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert web.returncode == 1
    assert "pip install 'questpie-celery[web]'" in web.stderr
    worker = Worker(
        settings, app="shop:celery_app", python=str(python), cwd=project, pythonpath=str(project)
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
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and status != "completed":
            with engine.connect() as conn:
                status = conn.execute(
                    text("SELECT status FROM questpie_queue_dispatch WHERE id = :id"),
                    {"id": dispatch_id},
                ).scalar()
            time.sleep(0.1)
        engine.dispose()
        assert status == "completed", worker.log()
        assert f"Task send-welcome-email[{dispatch_id}] succeeded" in worker.log()
        assert "Traceback" not in worker.log()
    finally:
        worker.stop()
