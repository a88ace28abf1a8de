"""Secret payloads: plaintext reaches the handler and nothing else.

A canary secret is published and then searched for, raw and encoded, in
everything Celery and this package can write: the broker message, the Redis
databases (broker, and result backend with result_extended), every table of the
ledger database, the worker's DEBUG log, task events, `inspect` output, and the
errors and results of failing and retried runs. The canary scan runs on Redis,
where the result backend lives; erasure, tampering, rotation and receipts run on
RabbitMQ too.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from sqlalchemy import Engine, inspect, select, text, update

from questpie_celery import PublishOptionsError, Questpie, Receipt
from questpie_celery.jobs.crypto import fingerprint
from questpie_celery.ledger import dispatch_table
from tests.integration.conftest import new_stack
from tests.support import jobapp
from tests.support.brokers import capture, deliver, idle_queue, queue_depth
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

SECRET = "s" * 16 + "-test-secret-0123456789abcdef"
OLD_SECRET = "o" * 16 + "-old-secret-0123456789abcdefgh"


def forms(canary: str) -> list[bytes]:
    raw = canary.encode()
    return [
        raw,
        base64.b64encode(raw),
        base64.urlsafe_b64encode(raw),
        base64.b64encode(raw).rstrip(b"="),
        raw.hex().encode(),
    ]


def assert_absent(canary: str, where: str, blob: bytes | str) -> None:
    data = blob.encode() if isinstance(blob, str) else blob
    for form in forms(canary):
        assert form not in data, f"canary found in {where}"
    # A base64 form may start at any of three offsets: check a shorter, aligned core too.
    for offset in range(3):
        core = base64.b64encode(canary.encode()[offset:])[4:-4]
        assert core not in data, f"canary (base64, offset {offset}) found in {where}"


def redis_dump(url: str) -> bytes:
    """Every key and value of one Redis database."""
    client = redis.Redis.from_url(url)
    out: list[object] = []
    try:
        for key in client.scan_iter():
            out.append(key)
            kind = client.type(key)
            if kind == b"string":
                out.append(client.get(key))
            elif kind == b"list":
                out.extend(client.lrange(key, 0, -1))
            elif kind == b"hash":
                for name, value in client.hgetall(key).items():
                    out += [name, value]
            elif kind == b"set":
                out.extend(client.smembers(key))
            elif kind == b"zset":
                out.extend(client.zrange(key, 0, -1))
    finally:
        client.close()
    return b"\n".join(v if isinstance(v, bytes) else str(v).encode() for v in out)


def ledger_dump(engine: Engine) -> bytes:
    """Every row of every table in the ledger's database."""
    out: list[str] = []
    with engine.connect() as conn:
        tables = inspect(conn).get_table_names()
        assert "questpie_queue_dispatch" in tables
        for table in tables:
            for row in conn.execute(text(f'SELECT * FROM "{table}"')):
                out.append(repr(tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)))
    return "\n".join(out).encode()


class EventLog:
    """Collects every event on the broker's event exchange while the block runs."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EventLog:
        self._thread.start()
        # Subscribed once an event of our own comes back: none sent later is missed.
        probe = uuid.uuid4().hex
        with self.app.events.default_dispatcher() as dispatcher:

            def heard() -> bool:
                if any(e.get("probe") == probe for e in list(self.events)):
                    return True
                dispatcher.send("test-probe", probe=probe)
                return False

            wait_until(heard, "the event receiver to subscribe (hear a probe)", 20, 0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(10)

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self._receiver = self.app.events.Receiver(conn, handlers={"*": self.events.append})
            with contextlib.suppress(TimeoutError, OSError):
                self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def has(self, kind: str, dispatch_id: str) -> bool:
        return any(e["type"] == kind and e.get("uuid") == dispatch_id for e in list(self.events))

    def dump(self) -> str:
        return repr(self.events)


def _secret_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, broker: str
) -> Iterator[Stack]:
    env = {"QP_TEST_SECRET": SECRET, "QP_TEST_PREVIOUS": OLD_SECRET}
    if broker == "redis":
        env["QP_TEST_EXTENDED"] = "1"  # everything Celery can record, into the result backend
    made = new_stack(request, tmp_path_factory.mktemp("secret"), broker, env=env, loglevel="debug")
    yield made
    made.close()


@pytest.fixture(scope="module")
def secret_redis(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """Redis broker and result backend with result_extended, events, track_started."""
    yield from _secret_stack(request, tmp_path_factory, "redis")


@pytest.fixture(scope="module")
def secret_rabbitmq(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    yield from _secret_stack(request, tmp_path_factory, "rabbitmq")


@pytest.fixture(scope="module", params=["redis", "rabbitmq"])
def secret_stack(request: pytest.FixtureRequest) -> Stack:
    """A stack with a secret (and an older one), its worker logging at DEBUG."""
    stack: Stack = request.getfixturevalue(f"secret_{request.param}")
    return stack


def canary() -> str:
    return f"https://example.test/magic/CANARY-{uuid.uuid4().hex}"


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def publisher(stack: Stack, secret: str) -> Questpie:
    """Another process's `Questpie` on the stack's broker, ledger and queue."""
    _, questpie = jobapp.build(
        broker=stack.env["QP_TEST_BROKER"],
        ledger=stack.env["QP_TEST_LEDGER"],
        queue=stack.queue_name,
        secret=secret,
    )
    return questpie


def test_plaintext_reaches_the_handler_and_nothing_else(secret_redis: Stack) -> None:
    stack = secret_redis
    secret, t = canary(), tag()
    queue = stack.questpie.queue
    idle = idle_queue()
    gate = stack.gate()
    with EventLog(stack.celery_app) as events:
        # 0. A message that stays in the broker: an idle queue holds it to the end.
        held = queue.secret_link.publish(
            {"tag": t, "link": secret}, idempotency_key=f"held:{t}", secret_payload=True, queue=idle
        )
        assert held is not None
        # 1. A run that fails once (its error names the secret), retries, then completes
        #    and returns a value that echoes the secret.
        first = queue.secret_link.publish(
            {"tag": t, "link": secret, "fail_times": 1, "gate": str(gate)},
            idempotency_key=f"link:{t}",
            secret_payload=True,
        )
        assert first is not None
        # While it runs: what `celery inspect` shows.
        stack.wait_status(first, "active")
        inspector = stack.celery_app.control.inspect(timeout=5, limit=1)  # one worker
        shown = repr([inspector.active(), inspector.reserved(), inspector.scheduled()])
        assert first in shown  # the inspection did see the running task
        assert_absent(secret, "celery inspect", shown)
        gate.open()
        stack.wait_status(first, "completed", timeout=60)
        # 2. A run that fails for good with the secret in its exception message.
        second = queue.secret_link.publish(
            {"tag": t, "link": secret, "permanent": True},
            idempotency_key=f"link2:{t}",
            secret_payload=True,
        )
        assert second is not None
        stack.wait_status(second, "failed")
        wait_until(
            lambda: (
                events.has("task-retried", first)
                and events.has("task-succeeded", first)
                and events.has("task-failed", second)
            ),
            "the worker's task events",
        )
    runs = stack.runs(t)
    assert [(r["dispatch_id"], r["attempt"]) for r in runs] == [(first, 1), (first, 2), (second, 1)]
    assert {r["note"] for r in runs} == {digest(secret)}  # the handler saw the plaintext

    # The result backend (result_extended) and the broker's Redis database.
    result = AsyncResult(second, app=stack.celery_app)
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "SecretJobError"
    assert "PermanentFailure" in str(result.result)
    done = AsyncResult(first, app=stack.celery_app)
    assert done.state == "SUCCESS"
    assert done.result is None  # the return value (it echoes the secret) is not kept
    broker_db = redis_dump(stack.env["QP_TEST_BROKER"])
    assert held.encode() in broker_db  # the dump holds the waiting message
    assert_absent(secret, "the broker's Redis", broker_db)
    backend_db = redis_dump(stack.env["QP_TEST_BACKEND"])
    assert first.encode() in backend_db and second.encode() in backend_db
    assert_absent(secret, "the result backend", backend_db)
    message = capture(stack, idle)
    assert message.headers["id"] == held
    assert json.loads(message.body)[0] == [None]  # the message carries no payload at all
    assert_absent(secret, "the broker message", message.body)
    assert_absent(secret, "the broker message's headers", repr(message.headers))
    # The whole ledger database (every table), and the worker's DEBUG log.
    assert_absent(secret, "the ledger database", ledger_dump(stack.ledger.engine))
    log = stack.worker.log()
    assert "SecretJobError" in log
    assert any("Retry" in line for line in stack.worker.log_about(first))
    assert_absent(secret, "the worker log", log)
    # Task events: sent, received, started, retried, succeeded and failed.
    kinds = {e["type"] for e in events.events}
    assert {"task-sent", "task-received", "task-started", "task-retried", "task-failed"} <= kinds
    assert_absent(secret, "task events", events.dump())


def test_completion_erases_the_key_and_a_duplicate_does_not_run(secret_stack: Stack) -> None:
    stack = secret_stack
    secret, t = canary(), tag()
    idle = idle_queue()
    dispatch_id = stack.questpie.queue.secret_link.publish(
        {"tag": t, "link": secret}, idempotency_key=f"dup:{t}", secret_payload=True, queue=idle
    )
    assert dispatch_id is not None
    waiting = stack.row(dispatch_id)
    assert waiting.payload is None  # only ciphertext, from the start
    assert waiting.secret_ciphertext is not None and waiting.secret_wrapped_key is not None
    message = capture(stack, idle)
    deliver(stack, message)
    row = stack.wait_status(dispatch_id, "completed")
    assert (row.payload, row.secret_ciphertext, row.secret_wrapped_key) == (None, None, None)
    deliver(stack, message)  # the broker delivers it again
    stack.wait_log(dispatch_id, "skipped (done)")
    [run] = stack.runs(t)
    assert run["note"] == digest(secret)


def test_tampered_or_swapped_ciphertext_fails_closed(secret_stack: Stack) -> None:
    stack = secret_stack
    t = tag()
    idle = idle_queue()
    ids = [
        stack.questpie.queue.secret_link.publish(
            {"tag": t, "link": canary()},
            idempotency_key=f"tamper:{t}:{n}",
            secret_payload=True,
            queue=idle,
        )
        for n in range(3)
    ]
    a, b, c = ids
    assert a is not None and b is not None and c is not None
    row_a, row_b, row_c = (stack.row(i) for i in (a, b, c))
    assert row_c.secret_ciphertext is not None
    flipped = bytes([row_c.secret_ciphertext[-1] ^ 1])
    with stack.ledger.engine.begin() as conn:
        # Swap a's and b's ciphertexts; flip one bit of c's.
        for target, source in ((a, row_b), (b, row_a)):
            conn.execute(
                update(dispatch_table)
                .where(dispatch_table.c.id == target)
                .values(secret_ciphertext=source.secret_ciphertext)
            )
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == c)
            .values(secret_ciphertext=row_c.secret_ciphertext[:-1] + flipped)
        )
    for _ in ids:
        deliver(stack, capture(stack, idle))
    for dispatch_id in (a, b, c):
        row = stack.wait_status(dispatch_id, "failed")
        assert (row.attempt, row.last_error) == (1, "SecretDecryptionError")  # not retried
        assert row.secret_ciphertext is None and row.secret_wrapped_key is None
        if stack.broker == "redis":  # the stack with a result backend
            result = AsyncResult(dispatch_id, app=stack.celery_app)
            result.get(timeout=10, propagate=False)
            assert type(result.result).__name__ == "SecretJobError"
    assert stack.runs(t) == []  # the handler never ran


def test_rotation_previous_secrets_open_old_work(secret_stack: Stack) -> None:
    """Work sealed under the old secret runs on a worker that lists it as previous."""
    stack = secret_stack
    secret, t = canary(), tag()
    old_publisher = publisher(stack, OLD_SECRET)
    try:
        dispatch_id = old_publisher.queue.secret_link.publish(
            {"tag": t, "link": secret}, idempotency_key=f"rot:{t}", secret_payload=True
        )
    finally:
        old_publisher.close()
    assert dispatch_id is not None
    assert stack.row(dispatch_id).secret_key_id == fingerprint(OLD_SECRET.encode())
    stack.wait_status(dispatch_id, "completed")
    assert [r["note"] for r in stack.runs(t)] == [digest(secret)]


def test_wrong_secret_fails_closed(secret_stack: Stack) -> None:
    stack = secret_stack
    t = tag()
    stranger = publisher(stack, "x" * 40)
    try:
        dispatch_id = stranger.queue.secret_link.publish(
            {"tag": t, "link": canary()}, idempotency_key=f"wrong:{t}", secret_payload=True
        )
    finally:
        stranger.close()
    assert dispatch_id is not None
    row = stack.wait_status(dispatch_id, "failed")
    assert row.last_error == "SecretDecryptionError"
    assert row.secret_ciphertext is None and row.secret_wrapped_key is None
    assert stack.runs(t) == []


def test_receipts_through_the_lifecycle(secret_stack: Stack) -> None:
    stack = secret_stack
    t = tag()
    queue = stack.questpie.queue
    idle = idle_queue()
    dispatch_id = queue.secret_link.publish(
        {"tag": t, "link": canary()}, idempotency_key=f"rcpt:{t}", secret_payload=True, queue=idle
    )
    assert dispatch_id is not None
    receipt = queue.get_receipt(dispatch_id)
    assert isinstance(receipt, Receipt)
    assert (receipt.status, receipt.job_name, receipt.idempotency_key) == (
        "queued", "secret.link", f"rcpt:{t}",
    )  # fmt: skip
    assert receipt.created_at.tzinfo is not None and receipt.handled_at is None
    # The broker's acceptance is recorded off the publish path; it lasts (no worker reads
    # the idle queue).
    stack.wait_status(dispatch_id, "queued", timeout=10)
    receipt = queue.get_receipt(dispatch_id)
    assert receipt is not None and receipt.status == "queued"
    assert receipt.queued_at is not None and receipt.queued_at >= receipt.created_at
    with pytest.raises(AttributeError):
        receipt.status = "completed"  # type: ignore[misc]  # frozen
    deliver(stack, capture(stack, idle))
    stack.wait_status(dispatch_id, "completed")
    done = queue.get_receipt(dispatch_id)
    assert done is not None and done.status == "completed"
    assert done.handled_at is not None and done.handled_at >= receipt.queued_at
    assert set(vars(done)) == {
        "dispatch_id", "job_name", "idempotency_key", "status", "created_at", "queued_at",
        "handled_at",
    }  # fmt: skip
    failing = queue.secret_link.publish(
        {"tag": t, "link": canary(), "permanent": True},
        idempotency_key=f"rcpt-fail:{t}",
        secret_payload=True,
    )
    assert failing is not None
    stack.wait_status(failing, "failed")
    failed = queue.get_receipt(failing)
    assert failed is not None and failed.status == "failed"
    # Non-secret dispatches and unknown ids have no receipt.
    plain = queue.record.publish({"tag": t}, idempotency_key=f"plain:{t}", queue=idle)
    assert plain is not None
    assert queue.get_receipt(plain) is None
    assert queue.get_receipt(str(uuid.uuid4())) is None


def test_secret_publish_preconditions(pg_db: str) -> None:
    link = {"tag": "x", "link": "https://example.test/one-time"}
    _, no_secret = jobapp.build(broker="memory://", ledger=pg_db)
    _, short = jobapp.build(broker="memory://", ledger=pg_db, secret="too-short")
    memory = Questpie(Celery("m", broker="memory://"), ledger_url="sqlite://", secret=SECRET)
    memory.register(jobapp.secret_link)
    try:
        with pytest.raises(PublishOptionsError, match="32 bytes"):
            no_secret.queue.secret_link.publish(link, idempotency_key="k", secret_payload=True)
        with pytest.raises(PublishOptionsError, match="32 bytes"):
            short.queue.secret_link.publish(link, idempotency_key="k", secret_payload=True)
        with pytest.raises(PublishOptionsError, match="idempotency_key"):
            short.queue.secret_link.publish(link, secret_payload=True)
        with pytest.raises(PublishOptionsError, match="in-memory"):
            memory.queue.secret_link.publish(link, idempotency_key="k", secret_payload=True)
    finally:
        for questpie in (no_secret, short, memory):
            questpie.close()


def test_secret_validation_error_holds_no_input(secret_stack: Stack) -> None:
    stack = secret_stack
    secret = canary()
    idle = idle_queue()
    with pytest.raises(ValueError, match=r"secret\.link") as caught:
        stack.questpie.queue.secret_link.publish(
            {"tag": 5, "link": secret, "sleep": secret},
            idempotency_key=f"bad:{secret}",
            secret_payload=True,
            queue=idle,
        )
    assert_absent(secret, "the validation error", str(caught.value))
    assert caught.value.__cause__ is None
    with stack.ledger.engine.connect() as conn:
        rows = conn.execute(
            select(dispatch_table.c.id).where(dispatch_table.c.idempotency_key == f"bad:{secret}")
        ).all()
    assert rows == []
    assert queue_depth(stack, idle) == 0
