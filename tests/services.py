"""Real servers for the test suite: PostgreSQL, Redis and `celery worker` processes.

PostgreSQL and Redis are started from the binaries on the machine, on free ports,
in a temporary folder, unless QP_TEST_PG_URL / QP_TEST_REDIS_URL point at running
ones. PostgreSQL refuses to run as root, so as root it runs as the `postgres` user.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kombu import Connection

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout}s")


def _pg_bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
        return str(candidate)
    raise RuntimeError(f"PostgreSQL's {name} is not installed")


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yield a SQLAlchemy URL of a fresh PostgreSQL server's `postgres` database."""
    if os.environ.get("QP_TEST_PG_URL"):
        yield os.environ["QP_TEST_PG_URL"]
        return
    as_root = os.geteuid() == 0
    base = Path(tempfile.mkdtemp(prefix="qp-pg-"))
    data = base / "data"
    port = free_port()
    run_as: list[str] = ["runuser", "-u", "postgres", "--"] if as_root else []
    if as_root:
        shutil.chown(base, "postgres", "postgres")
    user = "postgres" if as_root else os.environ.get("USER", "postgres")
    subprocess.run(
        [*run_as, _pg_bin("initdb"), "-D", str(data), "-U", user, "-A", "trust", "--no-sync"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    options = (
        f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off "
        "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
    )
    subprocess.run(
        [
            *run_as,
            _pg_bin("pg_ctl"),
            "-D",
            str(data),
            "-o",
            options,
            "-l",
            str(base / "log"),
            "-w",
            "start",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    try:
        yield f"postgresql+psycopg://{user}@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*run_as, _pg_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Yield the URL of a fresh Redis server (database 0)."""
    if os.environ.get("QP_TEST_REDIS_URL"):
        yield os.environ["QP_TEST_REDIS_URL"]
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    folder = tempfile.mkdtemp(prefix="qp-redis-")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            folder,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Worker:
    """A real `celery worker` process running tests/jobapp.py."""

    env: dict[str, str]
    concurrency: int = 2
    pool: str = "prefork"
    queues: str | None = None
    app: str = "tests.jobapp:celery_app"
    loglevel: str = "info"
    log_path: Path = field(default_factory=lambda: Path(tempfile.mktemp(prefix="qp-worker-")))
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> Worker:
        cmd = [
            sys.executable, "-m", "celery", "-A", self.app, "worker",
            "-l", self.loglevel, "-P", self.pool, "-c", str(self.concurrency),
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-n", f"qp-{os.getpid()}-{time.monotonic_ns()}@localhost",
        ]  # fmt: skip
        if self.queues:
            cmd += ["-Q", self.queues]
        env = {**os.environ, **self.env, "PYTHONPATH": str(ROOT)}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in self.log():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"celery worker exited early:\n{self.log()}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"celery worker not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL the whole process group: the pool children die mid-run."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _amqp_ready(url: str) -> bool:
    try:
        with Connection(url, connect_timeout=1) as conn:
            conn.connect()
            return True
    except Exception:
        return False


@contextlib.contextmanager
def rabbitmq_server() -> Iterator[str]:
    """Yield the AMQP URL of a fresh RabbitMQ node (plugins off, state in a temp folder)."""
    if os.environ.get("QP_TEST_AMQP_URL"):
        yield os.environ["QP_TEST_AMQP_URL"]
        return
    script = shutil.which("rabbitmq-server", path="/usr/lib/rabbitmq/bin:" + os.environ["PATH"])
    if script is None:
        raise RuntimeError("rabbitmq-server is not installed (apt-get install rabbitmq-server)")
    base = Path(tempfile.mkdtemp(prefix="qp-rabbit-"))
    (base / "enabled_plugins").write_text("[].\n")
    port = free_port()
    env = {
        **os.environ,
        "RABBITMQ_NODENAME": f"qp{port}@localhost",
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_NODE_PORT": str(port),
        "RABBITMQ_DIST_PORT": str(free_port()),
        "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
        "RABBITMQ_LOG_BASE": str(base / "log"),
        "RABBITMQ_CONFIG_FILE": str(base / "none"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
    }
    with (base / "out.log").open("wb") as out:
        proc = subprocess.Popen(
            [script], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"amqp://guest:guest@127.0.0.1:{port}//"
    try:
        deadline = time.monotonic() + 90
        while not _amqp_ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"RabbitMQ did not start:\n{(base / 'out.log').read_text(errors='replace')}"
                )
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)
