"""Real servers for the test suite: PostgreSQL, Redis, RabbitMQ and `celery worker` processes.

Each server is started from the binaries on the machine, on free ports, in a
temporary folder, and can be stopped and started again on the same port (the
restart tests do). PostgreSQL refuses to run as root, so as root it runs as the
`postgres` user.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
from celery import Celery
from kombu import Connection
from sqlalchemy import create_engine, text

from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent.parent


class _Ports:
    """Ports for this process's servers, from a band of its own below the kernel's
    ephemeral range (32768 and up): no outgoing connection takes one between its choice
    and the server's bind. The band is held for the process's life by an flock on a file
    under the temporary folder, so pytest-xdist's workers, and any other suite run on
    the machine at the same time, never pick the same port."""

    BANDS, SIZE, FIRST = 12, 1500, 10000

    def __init__(self) -> None:
        self._first: int | None = None
        self._lock: IO[str] | None = None
        self._handed_out: set[int] = set()

    def _band(self) -> int:
        if self._first is None:
            # /tmp whatever TMPDIR says: every suite on the machine must see the same locks.
            folder = Path("/tmp") / "questpie-test-ports"
            folder.mkdir(exist_ok=True)
            with contextlib.suppress(PermissionError):
                folder.chmod(0o1777)  # any user's suite may take a free band
            for index in range(self.BANDS):
                try:
                    lock = (folder / f"band-{index}").open("a")
                except PermissionError:
                    continue  # another user's; theirs to hold
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    lock.close()
                    continue
                self._first, self._lock = self.FIRST + index * self.SIZE, lock
                atexit.register(lock.close)  # held to the end, closed before teardown
                break
            else:
                raise RuntimeError(f"all {self.BANDS} port bands are held by other test runs")
        return self._first

    def free(self) -> int:
        band = self._band()
        for port in range(band, band + self.SIZE):
            if port in self._handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            self._handed_out.add(port)
            return port
        raise RuntimeError(f"no free port left in {band}-{band + self.SIZE - 1}")


_ports = _Ports()


def free_port() -> int:
    """A port nothing listens on, and that no other test process will pick."""
    return _ports.free()


def listens(port: int) -> bool:
    """Whether something accepts connections on `port`."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    wait_until(lambda: listens(port), f"something to listen on port {port}", timeout, 0.05)


def child_pids(pid: int) -> list[int]:
    """The running processes (zombies left out) whose parent is `pid`, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        state, parent = stat.rsplit(")", 1)[1].split()[:2]
        if int(parent) == pid and state != "Z":
            found.append(int(entry))
    return sorted(found)


def _running(pid: int) -> bool:
    """Whether a process still exists and is not a zombie (a zombie acts no more; its
    reaping is up to its new parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return ""


def _pg_bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
        return str(candidate)
    raise RuntimeError(f"PostgreSQL's {name} is not installed")


class PostgresServer:
    """A PostgreSQL cluster of its own. `durable=False` turns fsync off: tests only."""

    def __init__(self, *, durable: bool = False) -> None:
        self.as_root = os.geteuid() == 0
        self.base = Path(tempfile.mkdtemp(prefix="qp-pg-"))
        self.data = self.base / "data"
        self.port = free_port()
        self.user = "postgres" if self.as_root else os.environ.get("USER", "postgres")
        self._run_as = ["runuser", "-u", "postgres", "--"] if self.as_root else []
        if self.as_root:
            shutil.chown(self.base, "postgres", "postgres")
        subprocess.run(
            [*self._run_as, _pg_bin("initdb"), "-D", str(self.data), "-U", self.user,
             "-A", "trust", "--no-sync"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.options = (
            f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c max_connections=300"
        )
        if not durable:
            self.options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._databases = 0

    def start(self) -> PostgresServer:
        subprocess.run(
            [*self._run_as, _pg_bin("pg_ctl"), "-D", str(self.data), "-o", self.options,
             "-l", str(self.base / "log"), "-w", "start"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        return self

    def stop(self, mode: str = "fast") -> None:
        subprocess.run(
            [*self._run_as, _pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"],
            check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{database}"

    def crash(self, *, stall_replication: float = 0.0) -> None:
        """SIGKILL every process of the server at once, as a power cut would: no shutdown,
        no checkpoint, nothing more sent to a standby. With `stall_replication`, its WAL
        senders are stopped (SIGSTOP) that long first, so the commits made meanwhile
        reach no standby: a synchronous primary's clients are still waiting for theirs
        when it dies, an asynchronous one's were told they committed."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        if stall_replication:
            senders = [pid for pid in child_pids(postmaster) if "walsender" in _cmdline(pid)]
            assert senders, "no WAL sender to stall: is a standby streaming?"
            for pid in senders:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(stall_replication)  # the stall itself
        doomed = [postmaster, *child_pids(postmaster)]
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda: not any(_running(pid) for pid in doomed),
            f"PostgreSQL's processes {doomed} to die of SIGKILL",
            30,
        )

    def create_database(self, prefix: str = "qp") -> str:
        """A new, empty database on this server; returns its URL."""
        self._databases += 1
        name = f"{prefix}_{os.getpid()}_{self._databases}"
        admin = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
        return self.url(name)

    def terminate_backends(self, database_url: str) -> int:
        """Kill every server process serving `database_url`'s database (as a failover,
        a restart or an idle timeout would), except our own; returns how many."""
        name = database_url.rsplit("/", 1)[1]
        admin = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            killed = conn.execute(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": name},
            ).scalar_one()
        admin.dispose()
        return int(killed)

    def set_read_only(self, database_url: str, read_only: bool) -> None:
        """Make `database_url`'s database refuse writes (SQLSTATE 25006), as a standby or
        a primary being demoted in a failover does, or accept them again; the sessions
        open on it are ended so that new ones pick the setting up."""
        name = database_url.rsplit("/", 1)[1]
        admin = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(
                text(
                    f'ALTER DATABASE "{name}" SET default_transaction_read_only = '
                    f"{'on' if read_only else 'off'}"
                )
            )
        admin.dispose()
        self.terminate_backends(database_url)

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)


class PgBouncerServer:
    """A PgBouncer of its own in front of `postgres`, in transaction mode, with its stock
    settings otherwise: no `ignore_startup_parameters`, no prepared statements, as a
    fleet's pooler (or a managed one) runs. Every database of the server is reachable
    under its own name. PgBouncer refuses to run as root, so as root it runs as the
    `postgres` user."""

    def __init__(self, postgres: PostgresServer) -> None:
        binary = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
        if binary is None:
            raise RuntimeError("pgbouncer is not installed (apt-get install pgbouncer)")
        self.binary = binary
        self.postgres = postgres
        self.base = Path(tempfile.mkdtemp(prefix="qp-pgbouncer-"))
        self.port = free_port()
        self.config = self.base / "pgbouncer.ini"
        users = self.base / "userlist.txt"
        users.write_text(f'"{postgres.user}" ""\n')
        self.config.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={postgres.port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "pool_mode = transaction\n"
            "auth_type = trust\n"
            # The console's PAUSE and RESUME, for tests of a stalled pooler.
            f"admin_users = {postgres.user}\n"
            f"auth_file = {users}\n"
            f"logfile = {self.base / 'log'}\n"
            f"pidfile = {self.base / 'pid'}\n"
        )
        self._run_as = ["-u", "postgres"] if postgres.as_root else []
        if postgres.as_root:
            for path in (self.base, users, self.config):
                shutil.chown(path, "postgres", "postgres")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PgBouncerServer:
        self.proc = subprocess.Popen(
            [self.binary, *self._run_as, "-q", str(self.config)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            wait_for_port(self.port)
        except AssertionError:
            raise RuntimeError(f"pgbouncer did not start:\n{self.log()}") from None
        return self

    def console(self, command: str) -> None:
        """Run `command` (PAUSE, RESUME, ...) on PgBouncer's admin console."""
        subprocess.run(
            ["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.postgres.user,
             "-d", "pgbouncer", "-c", command],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip

    def url(self, database_url: str) -> str:
        """The URL of `database_url`'s database (on `postgres`) through this pooler."""
        name = database_url.rsplit("/", 1)[1]
        return f"postgresql+psycopg://{self.postgres.user}@127.0.0.1:{self.port}/{name}"

    def log(self) -> str:
        path = self.base / "log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.base, ignore_errors=True)


class PostgresStandby(PostgresServer):
    """A streaming standby of a running `primary`: a copy made with `pg_basebackup -R`
    (which writes the `primary_conninfo` and `standby.signal` a standby needs), read-only
    until `promote()`. Durable, like its primary should be: it holds the copies a
    synchronous primary waits for."""

    def __init__(self, primary: PostgresServer) -> None:  # no initdb: the copy is the cluster
        self.as_root = primary.as_root
        self.base = Path(tempfile.mkdtemp(prefix="qp-pg-standby-"))
        self.data = self.base / "data"
        self.port = free_port()
        self.user = primary.user
        self._run_as = primary._run_as
        if self.as_root:
            shutil.chown(self.base, "postgres", "postgres")
        subprocess.run(
            [*self._run_as, _pg_bin("pg_basebackup"), "-D", str(self.data), "-h", "127.0.0.1",
             "-p", str(primary.port), "-U", self.user, "-R", "-X", "stream", "-c", "fast"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.options = (
            f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c max_connections=300"
        )
        self._databases = 0

    def promote(self) -> None:
        """End recovery: from now on this server accepts writes (`pg_ctl promote`)."""
        subprocess.run(
            [*self._run_as, _pg_bin("pg_ctl"), "-D", str(self.data), "-w", "promote"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip


def synchronous_pair(timeout: float = 60.0) -> tuple[PostgresServer, PostgresStandby]:
    """A durable primary and its synchronous streaming standby, both running: every
    commit the primary acknowledges is on the standby's disk too
    (`synchronous_standby_names`, `synchronous_commit=on`), so promoting the standby
    after the primary dies loses nothing a client was told had committed."""
    primary = PostgresServer(durable=True).start()
    standby = PostgresStandby(primary).start()
    admin = create_engine(primary.url(), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            # Set on the primary only, after the copy: the standby, once promoted, has
            # no standby of its own to wait for.
            conn.execute(text("ALTER SYSTEM SET synchronous_standby_names = '*'"))
            conn.execute(text("ALTER SYSTEM SET synchronous_commit = 'on'"))
            conn.execute(text("SELECT pg_reload_conf()"))
        states: list[str] = []

        def synchronous() -> bool:
            with admin.connect() as conn:
                found = conn.execute(text("SELECT sync_state FROM pg_stat_replication")).all()
            states[:] = [state for (state,) in found]
            return states == ["sync"]

        wait_until(
            synchronous,
            "the standby to be synchronous",
            timeout,
            0.1,
            explain=lambda: f"pg_stat_replication says {states}",
        )
        return primary, standby
    finally:
        admin.dispose()


def multi_host_url(database: str, *servers: PostgresServer) -> str:
    """One URL for several servers, as libpq takes it: clients try each in turn and keep
    the first that accepts writes (`target_session_attrs=read-write`)."""
    hosts = "&".join(f"host=127.0.0.1:{server.port}" for server in servers)
    return (
        f"postgresql+psycopg://{servers[0].user}@/{database}?{hosts}"
        "&target_session_attrs=read-write"
    )


class RedisServer:
    """A Redis server of its own, with 256 databases so every stack gets one."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.port = free_port()
        self.folder = tempfile.mkdtemp(prefix="qp-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self._databases = 0

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.folder, "--databases", "256"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()  # a paused server cannot act on SIGTERM
            self.proc.terminate()
            self.proc.wait(10)

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def pause(self) -> None:
        """Stop the server process (SIGSTOP): connections stay open, nothing is answered,
        as with a server stalled by a long fork or a network that drops packets."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused server go on (SIGCONT)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def new_db(self) -> int:
        self._databases += 1
        if self._databases >= 256:
            raise RuntimeError("out of Redis databases")
        return self._databases

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def _amqp_ready(url: str) -> bool:
    try:
        with Connection(url, connect_timeout=1) as conn:
            conn.connect()
            return True
    except Exception:
        return False


class RabbitServer:
    """A RabbitMQ node of its own (plugins off, state in a temporary folder)."""

    def __init__(self) -> None:
        script = shutil.which("rabbitmq-server", path="/usr/lib/rabbitmq/bin:" + os.environ["PATH"])
        if script is None:
            raise RuntimeError("rabbitmq-server is not installed (apt-get install rabbitmq-server)")
        self.script = script
        self.base = Path(tempfile.mkdtemp(prefix="qp-rabbit-"))
        (self.base / "enabled_plugins").write_text("[].\n")
        self.port = free_port()
        self.env = {
            **os.environ,
            "RABBITMQ_NODENAME": f"qp{self.port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.base / "none"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self) -> RabbitServer:
        with (self.base / "out.log").open("ab") as out:
            self.proc = subprocess.Popen(
                [self.script], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        proc = self.proc

        def log() -> str:
            return (self.base / "out.log").read_text(errors="replace")

        def ready() -> bool:
            if _amqp_ready(self.url()):
                return True
            if proc.poll() is not None:
                raise RuntimeError(f"RabbitMQ exited:\n{log()}")
            return False

        wait_until(ready, "RabbitMQ to take connections", 90, 0.5, explain=log)
        return self

    def stop(self) -> None:
        """Stop the node (SIGTERM to its process group) and keep its state: `start()`
        brings it back on the same port, with its durable queues and their messages."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.base, ignore_errors=True)


class CeleryProcess:
    """What a `celery worker` and a `celery beat` process share: starting one in a
    session of its own (so signals reach its children), its log, stopping and killing."""

    env: dict[str, str]
    cwd: Path
    pythonpath: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None

    def _launch(self, cmd: list[str], *, ready: str, what: str, timeout: float) -> None:
        env = {**os.environ, **self.env, "PYTHONPATH": self.pythonpath}
        # The log is appended to across restarts: only this start's lines say it is ready.
        earlier = len(self.log())
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=self.cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        proc = self.proc

        def started() -> bool:
            if ready in self.log()[earlier:]:
                return True
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited early:\n{self.log()}")
            return False

        try:
            wait_until(started, f"{what} to log {ready!r}", timeout, 0.1, explain=self.log)
        except AssertionError:
            self.stop()
            raise

    def log(self) -> str:
        """The worker's log as written: a task id may hold a carriage return, which
        universal newlines would turn into a line feed."""
        if not self.log_path.exists():
            return ""
        with open(self.log_path, errors="replace", newline="") as file:
            return file.read()

    def stop(self) -> None:
        """A warm shutdown, as an operator's `kill -TERM <pid>` asks for it: the signal goes
        to the main process only. Sent to the whole group it also kills the pool children,
        and a child that dies holding billiard's queue lock leaves the main process waiting
        on it for ever (the SIGKILL below then ends it, 30 s later)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group: no goodbye, and pool children die mid-run."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


#: How Celery's worker logs the end of a delivery it took (celery.app.trace): its
#: success, its failure, its `Ignore` or its retry.
DELIVERY_ENDS = ("] succeeded in ", "] raised ", "] ignored", "] retry: ", "] INTERNAL ERROR")


@dataclass
class Worker(CeleryProcess):
    """A real `celery worker` process running tests/support/jobapp.py."""

    env: dict[str, str]
    concurrency: int = 2
    pool: str = "prefork"
    queues: str | None = None
    app: str = "tests.support.jobapp:celery_app"
    loglevel: str = "info"
    log_path: Path = field(default_factory=lambda: Path(tempfile.mktemp(prefix="qp-worker-")))
    proc: subprocess.Popen[bytes] | None = None
    python: str = sys.executable
    cwd: Path = ROOT
    pythonpath: str = str(ROOT)

    def start(self, timeout: float = 60.0) -> Worker:
        cmd = [
            self.python, "-m", "celery", "-A", self.app, "worker",
            "-l", self.loglevel, "-P", self.pool, "-c", str(self.concurrency),
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-n", f"qp-{os.getpid()}-{time.monotonic_ns()}@localhost",
        ]  # fmt: skip
        if self.queues:
            cmd += ["-Q", self.queues]
        self._launch(cmd, ready=" ready.", what="celery worker", timeout=timeout)
        return self

    def log_about(self, dispatch_id: str) -> list[str]:
        """The worker's log lines that name one dispatch."""
        return [line for line in self.log().splitlines() if dispatch_id in line]

    def unfinished(self, dispatch_id: str | None = None) -> int:
        """How many deliveries (of one dispatch, or of any) this worker took and has not
        ended: its "received" lines less the ends Celery logged for them (a success, a
        failure, an `Ignore`, a retry). The log runs on across restarts: a delivery a
        killed worker held stays unfinished."""
        lines = self.log_about(dispatch_id) if dispatch_id else self.log().splitlines()
        received = sum("] received" in line for line in lines)
        return received - sum(any(end in line for end in DELIVERY_ENDS) for line in lines)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Beat(CeleryProcess):
    """A real `celery beat` process."""

    env: dict[str, str]
    app: str
    cwd: Path
    pythonpath: str
    log_path: Path = field(default_factory=lambda: Path(tempfile.mktemp(prefix="qp-beat-")))
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> Beat:
        cmd = [
            sys.executable, "-m", "celery", "-A", self.app, "beat", "-l", "info",
            "--pidfile=", "-s", str(self.log_path) + ".schedule",
        ]  # fmt: skip
        self._launch(cmd, ready="beat: Starting...", what="celery beat", timeout=timeout)
        return self


@dataclass
class Flower(CeleryProcess):
    """A real Flower (`celery flower`, from PyPI) on a stack's broker, its HTTP API open
    without authentication, on 127.0.0.1 only. Persistent: on `stop()` it saves what its
    events told it (its task states) to `db`, so a test can read that too."""

    env: dict[str, str]
    app: str = "tests.support.jobapp:celery_app"
    port: int = field(default_factory=free_port)
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="qp-flower-")))
    proc: subprocess.Popen[bytes] | None = None
    cwd: Path = ROOT
    pythonpath: str = str(ROOT)

    def __post_init__(self) -> None:
        self.log_path = self.folder / "log"
        self.env = {**self.env, "FLOWER_UNAUTHENTICATED_API": "true"}

    @property
    def db(self) -> Path:
        return self.folder / "state"

    def saved_state(self) -> bytes:
        """The bytes of the task states Flower last saved (its dbm files)."""
        return b"".join(
            path.read_bytes()
            for path in self.folder.glob("state*")
            if not path.name.startswith("state.tmp")
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> Flower:
        cmd = [
            sys.executable, "-m", "celery", "-A", self.app, "flower",
            f"--port={self.port}", "--address=127.0.0.1", "--persistent=True",
            f"--db={self.db}", "--logging=debug",
            # Saved every half second too, not only at its exit: an exit that outlasts
            # `stop()`'s patience would be killed before it saved.
            "--state_save_interval=500",
        ]  # fmt: skip
        self._launch(cmd, ready="Visit me at", what="flower", timeout=timeout)
        wait_for_port(self.port, timeout)
        self._wait_subscribed(timeout)
        return self

    def _wait_subscribed(self, timeout: float) -> None:
        """Wait until Flower hears the broker's events: it subscribes after it listens
        on its port, and an event sent before is lost to it. A probe worker's heartbeat
        is sent until Flower lists that worker, then the probe says it went offline."""
        app = Celery("flower-probe", broker=self.env["QP_TEST_BROKER"])
        probe = f"flower-probe-{uuid.uuid4().hex[:8]}@localhost"
        try:
            with app.connection_for_write() as conn:
                dispatcher = app.events.Dispatcher(conn, hostname=probe)

                def heard() -> bool:
                    if probe in self.get("/workers?json=1").text:
                        return True
                    dispatcher.send("worker-heartbeat", freq=60.0, active=0, processed=0)
                    return False

                wait_until(heard, "flower to hear events", timeout, 0.1, explain=self.log)
                dispatcher.send("worker-offline")
                dispatcher.close()
        finally:
            app.close()

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
