"""Secret payloads: plaintext reaches the handler and nothing else.

A canary secret is published and then searched for, raw and base64-encoded, in
everything Celery and this package can write: the broker message, the Redis
databases (broker and result backend with result_extended), the whole ledger
database, the worker's DEBUG log, task events, `inspect` output, and the errors
and results of failing and retried runs.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from sqlalchemy import Engine, inspect, select, text, update

from questpie_celery import PublishOptionsError, Questpie, Receipt
from questpie_celery.ledger import dispatch_table
from tests import jobapp
from tests.conftest import Stack, make_stack, tag

SECRET = "s" * 16 + "-test-secret-0123456789abcdef"
OLD_SECRET = "o" * 16 + "-old-secret-0123456789abcdefgh"
IDLE = "secret-idle"


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
    client = redis.Redis.from_url(url)
    out: list[bytes] = []
    for key in client.scan_iter():
        out.append(key)
        kind = client.type(key)
        if kind == b"string":
            out.append(client.get(key) or b"")
        elif kind == b"list":
            out.extend(client.lrange(key, 0, -1))
        elif kind == b"hash":
            for field, value in client.hgetall(key).items():
                out += [field, value]
        elif kind == b"set":
            out.extend(client.smembers(key))
        elif kind == b"zset":
            out.extend(member for member, _ in client.zrange(key, 0, -1, withscores=True))
    client.close()
    return b"\n".join(out)


def ledger_dump(engine: Engine) -> bytes:
    out: list[str] = []
    with engine.connect() as conn:
        for table in inspect(conn).get_table_names():
            for row in conn.execute(text(f'SELECT * FROM "{table}"')):
                out.append(repr(tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)))
    return "\n".join(out).encode()


class EventLog:
    """Collects every task event the worker sends, for the duration of a test."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EventLog:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(1)
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(10)

    _receiver: Any = None

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self._receiver = self.app.events.Receiver(conn, handlers={"*": self.events.append})
            self._ready.set()
            with contextlib.suppress(TimeoutError, OSError):
                self._receiver.capture(limit=None, timeout=None, wakeup=True)

    def dump(self) -> str:
        return repr(self.events)


@pytest.fixture(scope="module")
def secret_stack(pg_url: str, redis_url: str) -> Iterator[Stack]:
    base = redis_url.rsplit("/", 1)[0]
    env = {
        "QP_TEST_BROKER": f"{base}/2",
        "QP_TEST_BACKEND": f"{base}/3",
        "QP_TEST_LEDGER": pg_url,
        "QP_TEST_SECRET": SECRET,
        "QP_TEST_PREVIOUS": OLD_SECRET,
        "QP_TEST_EXTENDED": "1",
    }
    yield from make_stack(env, loglevel="debug")


def canary() -> str:
    return f"https://example.test/magic/CANARY-{uuid.uuid4().hex}"


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def move_message(stack: Stack, source: str) -> bytes:
    """Take the one message waiting in `source` and hand it to the worker's queue."""
    client = redis.Redis.from_url(stack.env["QP_TEST_BROKER"])
    raw = client.rpop(source)
    assert isinstance(raw, bytes)
    client.lpush("celery", raw)
    client.close()
    return raw


def test_plaintext_reaches_the_handler_and_nothing_else(secret_stack: Stack) -> None:
    stack = secret_stack
    secret, t = canary(), tag()
    queue = stack.questpie.queue
    with EventLog(stack.celery_app) as events:
        # 1. A run that fails once (its error names the secret), retries, then completes
        #    and returns a value that echoes the secret.
        held = queue.secret_link.publish(
            {"tag": t, "link": secret}, idempotency_key=f"held:{t}", secret_payload=True, queue=IDLE
        )
        assert held is not None
        client = redis.Redis.from_url(stack.env["QP_TEST_BROKER"])
        message = client.rpop(IDLE)
        client.close()
        assert isinstance(message, bytes) and held.encode() in message
        assert_absent(secret, "the broker message", message)
        first = queue.secret_link.publish(
            {"tag": t, "link": secret, "fail_times": 1, "sleep": 1.5},
            idempotency_key=f"link:{t}",
            secret_payload=True,
        )
        assert first is not None
        # While it runs: what `celery inspect` shows.
        stack.wait_status(first, "active")
        inspector = stack.celery_app.control.inspect(timeout=2)
        shown = repr([inspector.active(), inspector.reserved(), inspector.scheduled()])
        assert "secret.link" in shown  # the inspection did see the task
        assert_absent(secret, "celery inspect", shown)
        stack.wait_status(first, "completed", timeout=60)
        # 2. A run that fails for good with the secret in its exception message.
        second = queue.secret_link.publish(
            {"tag": t, "link": secret, "permanent": True},
            idempotency_key=f"link2:{t}",
            secret_payload=True,
        )
        assert second is not None
        stack.wait_status(second, "failed")
    runs = stack.runs(t)
    assert [(r["dispatch_id"], r["attempt"]) for r in runs] == [(first, 1), (first, 2), (second, 1)]
    assert {r["note"] for r in runs} == {digest(secret)}  # the handler saw the plaintext

    # The result backend (result_extended) and the broker's Redis database.
    result = AsyncResult(second, app=stack.celery_app)
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "SecretJobError"
    assert "PermanentFailure" in str(result.result)
    assert AsyncResult(first, app=stack.celery_app).result is None  # return value not kept
    base = stack.env["QP_TEST_BROKER"]
    assert_absent(secret, "the broker's Redis", redis_dump(base))
    assert_absent(secret, "the result backend", redis_dump(stack.env["QP_TEST_BACKEND"]))
    # The whole ledger database (every table), and the worker's DEBUG log.
    assert_absent(secret, "the ledger database", ledger_dump(stack.engine))
    log = stack.worker.log()
    assert "SecretJobError" in log
    assert_absent(secret, "the worker log", log)
    # Task events, sent, received, started, retried, succeeded and failed.
    kinds = {e["type"] for e in events.events}
    assert {"task-received", "task-started", "task-retried", "task-failed"} <= kinds
    assert_absent(secret, "task events", events.dump())


def test_completion_erases_the_key_and_a_duplicate_does_not_run(secret_stack: Stack) -> None:
    stack = secret_stack
    secret, t = canary(), tag()
    dispatch_id = stack.questpie.queue.secret_link.publish(
        {"tag": t, "link": secret}, idempotency_key=f"dup:{t}", secret_payload=True, queue=IDLE
    )
    assert dispatch_id is not None
    raw = move_message(stack, IDLE)
    row = stack.wait_status(dispatch_id, "completed")
    assert (row.payload, row.secret_ciphertext, row.secret_wrapped_key) == (None, None, None)
    client = redis.Redis.from_url(stack.env["QP_TEST_BROKER"])
    client.lpush("celery", raw)  # the broker delivers it again
    time.sleep(1.5)
    assert client.llen("celery") == 0
    client.close()
    assert len(stack.runs(t)) == 1


def test_tampered_or_swapped_ciphertext_fails_closed(secret_stack: Stack) -> None:
    stack = secret_stack
    t = tag()
    ids = [
        stack.questpie.queue.secret_link.publish(
            {"tag": t, "link": canary()},
            idempotency_key=f"tamper:{t}:{n}",
            secret_payload=True,
            queue=IDLE,
        )
        for n in range(3)
    ]
    a, b, c = ids
    assert a is not None and b is not None and c is not None
    row_a, row_b, row_c = (stack.ledger.get(i) for i in (a, b, c))
    assert row_a and row_b and row_c and row_c.secret_ciphertext is not None
    flipped = bytes([row_c.secret_ciphertext[-1] ^ 1])
    with stack.engine.begin() as conn:
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
        move_message(stack, IDLE)
    for dispatch_id in ids:
        row = stack.wait_status(dispatch_id, "failed")
        assert row.last_error == "SecretDecryptionError"
        assert row.secret_ciphertext is None and row.secret_wrapped_key is None
        result = AsyncResult(dispatch_id, app=stack.celery_app)
        result.get(timeout=10, propagate=False)
        assert type(result.result).__name__ == "SecretJobError"
    assert stack.runs(t) == []  # the handler never ran


def test_rotation_previous_secrets_open_old_work(secret_stack: Stack) -> None:
    """Work sealed under the old secret runs on a worker that lists it as previous."""
    stack = secret_stack
    secret, t = canary(), tag()
    _, old_publisher = jobapp.build(
        broker=stack.env["QP_TEST_BROKER"], ledger=stack.env["QP_TEST_LEDGER"], secret=OLD_SECRET
    )
    dispatch_id = old_publisher.queue.secret_link.publish(
        {"tag": t, "link": secret}, idempotency_key=f"rot:{t}", secret_payload=True
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "completed")
    assert [r["note"] for r in stack.runs(t)] == [digest(secret)]
    old_publisher.close()


def test_wrong_secret_fails_closed(secret_stack: Stack) -> None:
    stack = secret_stack
    t = tag()
    _, stranger = jobapp.build(
        broker=stack.env["QP_TEST_BROKER"],
        ledger=stack.env["QP_TEST_LEDGER"],
        secret="x" * 40,
    )
    dispatch_id = stranger.queue.secret_link.publish(
        {"tag": t, "link": canary()}, idempotency_key=f"wrong:{t}", secret_payload=True
    )
    assert dispatch_id is not None
    row = stack.wait_status(dispatch_id, "failed")
    assert row.last_error == "SecretDecryptionError"
    assert row.secret_wrapped_key is None
    assert stack.runs(t) == []
    stranger.close()


def test_receipts_through_the_lifecycle(secret_stack: Stack) -> None:
    stack = secret_stack
    t = tag()
    queue = stack.questpie.queue
    dispatch_id = queue.secret_link.publish(
        {"tag": t, "link": canary()}, idempotency_key=f"rcpt:{t}", secret_payload=True, queue=IDLE
    )
    assert dispatch_id is not None
    receipt = queue.get_receipt(dispatch_id)
    assert isinstance(receipt, Receipt)
    assert (receipt.status, receipt.job_name, receipt.idempotency_key) == (
        "queued", "secret.link", f"rcpt:{t}",
    )  # fmt: skip
    assert receipt.created_at.tzinfo is not None and receipt.handled_at is None
    deadline = time.monotonic() + 5
    while receipt.queued_at is None and time.monotonic() < deadline:
        time.sleep(0.05)
        receipt = queue.get_receipt(dispatch_id)
        assert receipt is not None
    assert receipt.queued_at is not None and receipt.queued_at >= receipt.created_at
    with pytest.raises(AttributeError):
        receipt.status = "completed"  # type: ignore[misc]  # frozen
    move_message(stack, IDLE)
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
    plain = queue.record.publish({"tag": t}, idempotency_key=f"plain:{t}")
    assert plain is not None
    assert queue.get_receipt(plain) is None
    assert queue.get_receipt(str(uuid.uuid4())) is None


def test_secret_publish_preconditions(pg_unit_url: str) -> None:
    link = {"tag": "x", "link": "https://example.test/one-time"}
    _, no_secret = jobapp.build(broker="memory://", ledger=pg_unit_url)
    with pytest.raises(PublishOptionsError, match="32 bytes"):
        no_secret.queue.secret_link.publish(link, idempotency_key="k", secret_payload=True)
    _, short = jobapp.build(broker="memory://", ledger=pg_unit_url, secret="too-short")
    with pytest.raises(PublishOptionsError, match="32 bytes"):
        short.queue.secret_link.publish(link, idempotency_key="k", secret_payload=True)
    with pytest.raises(PublishOptionsError, match="idempotency_key"):
        short.queue.secret_link.publish(link, secret_payload=True)
    memory = Questpie(Celery("m", broker="memory://"), ledger_url="sqlite://", secret=SECRET)
    memory.register(jobapp.secret_link)
    with pytest.raises(PublishOptionsError, match="in-memory"):
        memory.queue.secret_link.publish(link, idempotency_key="k", secret_payload=True)
    for questpie in (no_secret, short, memory):
        questpie.close()


def test_secret_validation_error_holds_no_input(secret_stack: Stack) -> None:
    secret = canary()
    with pytest.raises(ValueError, match=r"secret\.link") as caught:
        secret_stack.questpie.queue.secret_link.publish(
            {"tag": 5, "link": secret, "sleep": secret},
            idempotency_key=f"bad:{secret}",
            secret_payload=True,
        )
    assert_absent(secret, "the validation error", str(caught.value))
    assert caught.value.__cause__ is None
    with secret_stack.engine.connect() as conn:
        count = conn.execute(
            select(dispatch_table.c.id).where(dispatch_table.c.idempotency_key == f"bad:{secret}")
        ).all()
    assert count == []
