"""The `filesystem://` transport a Questpie uses: no message lost to a reader that takes
its file while it is written, which kombu's own transport does on a loaded machine."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue

from questpie_celery import Questpie
from questpie_celery.filesystem import TRANSPORT, Transport
from questpie_celery.send.broker import broker_kind
from tests.support.waiting import wait_until


@pytest.fixture
def busy_cpus() -> Iterator[None]:
    """Two processes spinning, so the writer is preempted between its steps: the window
    kombu's transport leaves open. Under this load it lost about one message in eleven."""
    spin = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    yield
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_reader_polling_while_messages_are_written_gets_each_whole(
    tmp_path: Path, busy_cpus: None
) -> None:
    folder = tmp_path / "messages"
    folder.mkdir()
    # kombu's default control folder is "control" in the working directory.
    options = {
        "data_folder_in": str(folder), "data_folder_out": str(folder),
        "control_folder": str(tmp_path / "control"),
    }  # fmt: skip
    exchange = Exchange("x", "direct")
    queue = Queue("q", exchange, "q")
    count = 2000

    def write() -> None:
        with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as conn:
            producer = conn.Producer()
            for n in range(count):
                producer.publish(
                    {"n": n, "pad": "x" * 2000}, exchange=exchange, routing_key="q",
                    declare=[queue],
                )  # fmt: skip

    got: list[int] = []
    failures: list[BaseException] = []
    writer = threading.Thread(target=write)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as conn:
        channel = conn.channel()
        queue(channel).declare()
        writer.start()

        def all_read() -> bool:
            try:
                message = queue(channel).get(no_ack=True)
            except Exception as exc:  # what kombu's transport raises: a JSONDecodeError
                failures.append(exc)
            else:
                if message is not None:
                    got.append(message.payload["n"])
            return len(got) + len(failures) >= count

        wait_until(all_read, f"the {count} messages read as they are written", 60, 0)
    writer.join()
    assert failures == []
    assert sorted(got) == list(range(count))
    assert list(folder.iterdir()) == []  # nothing half-written left behind


def test_a_questpie_on_a_filesystem_app_uses_it_unless_the_app_chose_a_transport(
    tmp_path: Path,
) -> None:
    plain = Celery("fs", broker="filesystem://")
    Questpie(plain, ledger_url=f"sqlite:///{tmp_path / 'a.sqlite3'}")
    with plain.connection_for_write() as conn:
        assert isinstance(conn.transport, Transport)

    chosen = Celery("fs", broker="filesystem://")
    chosen.conf.broker_transport = "kombu.transport.filesystem:Transport"
    Questpie(chosen, ledger_url=f"sqlite:///{tmp_path / 'b.sqlite3'}")
    with chosen.connection_for_write() as conn:
        assert type(conn.transport).__module__ == "kombu.transport.filesystem"

    redis = Celery("r", broker="redis://localhost:6379/0")
    Questpie(redis, ledger_url=f"sqlite:///{tmp_path / 'c.sqlite3'}")
    assert not redis.conf.broker_transport


def test_the_transport_follows_the_broker_when_it_changes_and_only_when_it_is_all_files(
    tmp_path: Path,
) -> None:
    app = Celery("fs", broker="filesystem://")
    questpie = Questpie(app, ledger_url=f"sqlite:///{tmp_path / 'a.sqlite3'}")
    assert app.conf.broker_transport == TRANSPORT
    # What the pytest plugin does for a test: another broker, then the app's own back.
    app.conf.broker_url = "memory://"
    questpie.broker_changed()
    with app.connection_for_write() as conn:
        assert type(conn.transport).__module__ == "kombu.transport.memory"
    app.conf.broker_url = "filesystem://"
    questpie.broker_changed()
    assert app.conf.broker_transport == TRANSPORT

    # The setting reaches every URL the app connects to: not ours if one is not a folder.
    mixed = Celery("fs", broker="filesystem://")
    mixed.conf.broker_read_url = "memory://"
    Questpie(mixed, ledger_url=f"sqlite:///{tmp_path / 'b.sqlite3'}")
    with mixed.connection_for_read() as conn:
        assert type(conn.transport).__module__ == "kombu.transport.memory"

    # Failover lists, as a list or joined by ";", are read by their first URL.
    listed = Celery("fs", broker=["filesystem://", "filesystem://"])
    Questpie(listed, ledger_url=f"sqlite:///{tmp_path / 'c.sqlite3'}")
    assert listed.conf.broker_transport == TRANSPORT
    joined = Celery("fs", broker="filesystem://;memory://")
    Questpie(joined, ledger_url=f"sqlite:///{tmp_path / 'd.sqlite3'}")
    assert not joined.conf.broker_transport  # a failover to memory:// is not all files
    # The same reading tells a Redis failover list for what it is (priorities, timeouts).
    assert broker_kind(Celery("r", broker=["redis://a//", "redis://b//"])) == "redis"
