"""examples/django_shop's own pytest-django tests, run as a user runs them: `pytest` in
the example's folder (its pytest.ini names the settings), on PostgreSQL and Redis, with
the real `celery -A shop worker` its conftest starts.

A subprocess keeps Django's settings out of this process. pytest-django creates the test
database from DATABASE_URL's name (`test_<name>`) on the suite's server, migrates it and
drops it after; the database named in the URL itself is never created.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.support.services import ROOT, PostgresServer, RedisServer

EXAMPLE = ROOT / "examples" / "django_shop"
TESTS = {
    "test_a_placed_order_is_confirmed_once",
    "test_a_declined_card_rolls_everything_back",
    "test_a_process_killed_after_commit_still_confirms_once",
    "test_the_admin_pages_render_and_never_show_a_secret",
}


def test_the_django_shop_examples_tests_pass(
    postgres: PostgresServer, redis_server: RedisServer
) -> None:
    database = f"shop_{os.getpid()}"
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{postgres.user}@127.0.0.1:{postgres.port}/{database}",
        "CELERY_BROKER_URL": redis_server.url(redis_server.new_db()),
    }
    for inherited in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH"):
        env.pop(inherited, None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-v"],
        cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    passed = set(re.findall(r"::(test_\w+) PASSED", output))
    assert passed == TESTS, output
