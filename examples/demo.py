"""End-to-end demo on the embedded default: SQLite ledger, filesystem broker, a real worker.

    python examples/demo.py

It migrates the ledger, starts `celery -A shop worker` (two prefork children),
publishes a few dispatches, and prints what the ledger and the worker did.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, select

from questpie_celery import metadata

dispatch_table = metadata.tables["questpie_queue_dispatch"]

HERE = Path(__file__).resolve().parent
DEMO_DIR = Path(tempfile.mkdtemp(prefix="questpie-demo-"))
os.environ["QUESTPIE_DEMO_DIR"] = str(DEMO_DIR)
os.environ.setdefault("QUESTPIE_SECRET", secrets.token_hex(32))  # the worker inherits it
sys.path.insert(0, str(HERE))

import shop  # noqa: E402 - configured through QUESTPIE_DEMO_DIR above


def start_worker(log_path: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "celery", "-A", "shop:celery_app", "worker",
               "-l", "warning", "-c", "2", "--without-gossip", "--without-mingle"]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            command, cwd=HERE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip
    return worker


def wait_for(dispatch_ids: list[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [shop.questpie.queue.get_status(i) for i in dispatch_ids]
        if all(r is not None and r.status in ("completed", "failed") for r in rows):
            return
        time.sleep(0.2)
    raise SystemExit("the worker did not finish in time; see the log above")


def stored_secret(dispatch_id: str) -> dict[str, Any]:
    """What the ledger table itself holds for a secret dispatch, read with plain SQL."""
    engine = create_engine(f"sqlite:///{DEMO_DIR / 'ledger.sqlite3'}")
    with engine.connect() as conn:
        row = (
            conn.execute(select(dispatch_table).where(dispatch_table.c.id == dispatch_id))
            .mappings()
            .one()
        )
    engine.dispose()
    return dict(row)


def main() -> None:
    print(f"ledger: {DEMO_DIR / 'ledger.sqlite3'}   broker: filesystem://{DEMO_DIR / 'broker'}")
    shop.questpie.migrate()
    log_path = DEMO_DIR / "worker.log"
    worker = start_worker(log_path)
    queue = shop.questpie.queue
    try:
        print("\n1. publish without a key: a plain Celery message under a fresh id, no ledger row")
        plain = queue.send_welcome_email.publish({"user_id": "usr_001"})
        print(f"   dispatch id {plain}")

        print("\n2. publish with an idempotency key: one ledger row, then the broker")
        first = queue.send_welcome_email.publish(
            {"user_id": "usr_123"}, idempotency_key="welcome:usr_123"
        )
        print(f"   dispatch id {first}")

        print("\n3. the same key again, twice: answered from the ledger, nothing sent")
        for _ in range(2):
            again = queue["send-welcome-email"].publish(
                {"user_id": "usr_123"}, idempotency_key="welcome:usr_123"
            )
            print(f"   dispatch id {again}  (same: {again == first})")

        print("\n4. an async job that fails once, then succeeds on its retry")
        retried = queue.charge_card.publish(
            {"order_id": "ord_9", "amount_cents": 1250}, idempotency_key="charge:ord_9"
        )
        print(f"   dispatch id {retried}")

        print("\n5. a PermanentFailure: failed for good, no retry")
        permanent = queue.charge_card.publish(
            {"order_id": "ord_0", "amount_cents": 0}, idempotency_key="charge:ord_0"
        )
        print(f"   dispatch id {permanent}")

        print("\n6. bad input is rejected before anything is written")
        try:
            queue.send_welcome_email.publish({"user": "oops"}, idempotency_key="bad")
        except ValueError as exc:
            print(f"   {type(exc).__name__}: {exc}")

        print("\n7. the broker delivers one message three times, byte for byte")
        held = queue.send_welcome_email.publish(
            {"user_id": "usr_777"}, idempotency_key="welcome:usr_777", queue="held"
        )
        # publish() returns once the row is durable; its message follows from a thread of
        # this process. We read the broker's files ourselves, so wait for it first.
        shop.questpie.flush(timeout=10)
        [message] = (DEMO_DIR / "broker").glob("*.held.msg")  # no worker reads "held"
        for copy in range(3):
            target = f"{copy}-{message.name}".replace(".held.", ".celery.")
            shutil.copy(message, message.with_name(target))
        message.unlink()
        print(f"   dispatch id {held}: three copies handed to the worker")

        print("\n8. a secret payload: encrypted in the ledger, absent from the message")
        link = "https://shop.example/login/one-time-" + secrets.token_urlsafe(16)
        secret_id = queue.send_magic_link.publish(
            {"email": "ada@example.com", "link": link},
            idempotency_key="magic:ada:1",
            secret_payload=True,
            queue="held",
        )
        assert secret_id is not None
        shop.questpie.flush(timeout=10)
        [message] = (DEMO_DIR / "broker").glob("*.held.msg")
        stored = stored_secret(secret_id)
        print(f"   dispatch id {secret_id}")
        print(f"   link in the broker message: {link.encode() in message.read_bytes()}")
        print(
            f"   ledger row: payload={stored['payload']}, ciphertext="
            f"{len(stored['secret_ciphertext'] or b'')} bytes, link in it: "
            f"{link.encode() in (stored['secret_ciphertext'] or b'')}"
        )
        receipt = queue.get_receipt(secret_id)
        assert receipt is not None
        print(f"   receipt before the run: status={receipt.status}")
        message.rename(message.with_name(message.name.replace(".held.", ".celery.")))

        assert first is not None and retried is not None and permanent is not None
        assert held is not None
        wait_for([first, retried, permanent, held, secret_id])
        done = queue.get_receipt(secret_id)
        assert done is not None
        stored = stored_secret(secret_id)
        erased = stored["secret_wrapped_key"] is None and stored["secret_ciphertext"] is None
        print(
            f"   receipt after the run: status={done.status}, handled_at={done.handled_at:%H:%M:%S}"
            f"; key and ciphertext erased: {erased}"
        )
        time.sleep(1)  # let the unledgered run land in the log too
    finally:
        # A warm shutdown: SIGTERM to the main process only, which stops its pool children
        # itself. Sent to the whole group, it can kill a child that holds the pool's queue
        # lock, and the main process then waits for that lock for ever at exit.
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()

    print("\nwhat the worker ran (its log):")
    for line in log_path.read_text().splitlines():
        if "HANDLER" in line:
            print("   " + line.split("HANDLER ", 1)[1])
    runs_777 = log_path.read_text().count("user=usr_777")
    print(f"   -> usr_777's three deliveries ran the handler {runs_777} time(s)")
    print("\nthe ledger:")
    for dispatch_id in (first, retried, permanent, held):
        status = shop.questpie.queue.get_status(dispatch_id)
        assert status is not None
        print(
            f"   {status.dispatch_id}  {status.job_name:<18} key={status.idempotency_key:<16} "
            f"status={status.status:<9} attempts={status.attempt} error={status.last_error}"
        )
    shutil.rmtree(DEMO_DIR, ignore_errors=True)


if __name__ == "__main__":
    main()
