"""Publishers of the test project, each run as a process: `python scenario.py NAME TAG`.

Each prints one JSON line of what it saw (ids, visibility), for the test to check
against what the worker did. The test process itself never imports Django.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

import django
import django.utils.timezone

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
django.setup()

from django.db import connections, transaction  # noqa: E402
from proj.celery import questpie  # noqa: E402
from shop.models import Order  # noqa: E402


class Boom(Exception):
    pass


def seen_elsewhere(dispatch_id: str | None) -> bool:
    """Whether another connection (another thread's, so another of Django's) sees it."""
    assert dispatch_id is not None
    seen: list[bool] = []

    def look() -> None:
        seen.append(questpie.queue.get_status(dispatch_id) is not None)
        connections.close_all()

    thread = threading.Thread(target=look)
    thread.start()
    thread.join()
    return seen[0]


def atomic(tag: str) -> dict[str, Any]:
    """Commits, nested savepoints, a rolled-back savepoint, a rolled-back block."""
    record = questpie.queue["shop.record"]
    out: dict[str, Any] = {}
    with transaction.atomic():
        Order.objects.create(tag=tag)
        out["a"] = record.publish({"tag": f"{tag}-a"}, idempotency_key=f"{tag}-a")
        out["a_seen_before_commit"] = seen_elsewhere(out["a"])
        with transaction.atomic():  # a savepoint, released
            out["b"] = record.publish({"tag": f"{tag}-b"})  # unkeyed: ledgered all the same
        with contextlib.suppress(Boom), transaction.atomic():
            # A savepoint, rolled back: only its rows go.
            out["c"] = record.publish({"tag": f"{tag}-c"}, idempotency_key=f"{tag}-c")
            raise Boom
        out["many"] = record.publish_many(
            [{"tag": f"{tag}-m1"}, {"tag": f"{tag}-m2"}],
            idempotency_keys=[f"{tag}-m1", f"{tag}-m2"],
        )
        # A marker sent now, before the commit, as a plain call (sent at once, unledgered;
        # its tag is not the test's): the worker takes its queue in order, so a message
        # of the block sent before the commit would be received before the marker.
        out["marker"] = questpie.celery_app.send_task(
            "shop.record", args=[{"tag": f"marker-{tag}"}]
        ).id
        out["committed_at"] = time.time()
    out["a_seen_after_commit"] = seen_elsewhere(out["a"])
    with contextlib.suppress(Boom), transaction.atomic():
        out["d"] = record.publish({"tag": f"{tag}-d"}, idempotency_key=f"{tag}-d")
        raise Boom
    out["d_status"] = str(questpie.queue.get_status(out["d"]))
    # Outside any atomic block: as without Django (a row in autocommit, then the send).
    out["e"] = record.publish({"tag": f"{tag}-e"}, idempotency_key=f"{tag}-e")
    out["orders"] = Order.objects.filter(tag=tag).count()
    return out


def features(tag: str) -> dict[str, Any]:
    """Keys, a queue policy, a secret payload and its receipt, schedules."""
    queue = questpie.queue
    out: dict[str, Any] = {}
    with transaction.atomic():
        first = queue["shop.record"].publish({"tag": f"{tag}-k"}, idempotency_key=f"{tag}-k")
        again = queue["shop.record"].publish({"tag": f"{tag}-k"}, idempotency_key=f"{tag}-k")
        out["key"] = [first, again]
        out["exclusive"] = [
            queue["shop.exclusive"].publish({"tag": f"{tag}-x1"}, singleton_key=tag),
            queue["shop.exclusive"].publish({"tag": f"{tag}-x2"}, singleton_key=tag),
        ]
        out["secret"] = queue["shop.magic-link"].publish(
            {"tag": f"{tag}-s", "link": "https://example.com/login/very-secret"},
            idempotency_key=f"{tag}-s",
            secret_payload=True,
        )
    out["key_after"] = queue["shop.record"].publish({"tag": f"{tag}-k"}, idempotency_key=f"{tag}-k")
    receipt = queue.get_receipt(out["secret"])
    out["receipt"] = receipt.status if receipt is not None else None
    queue["shop.record"].schedule({"tag": f"{tag}-cron"}, "*/5 * * * *", tz="Europe/Bratislava")
    out["schedules"] = [info.job_name for info in questpie.schedules.list()]
    queue["shop.record"].unschedule()
    out["schedules_after"] = [info.job_name for info in questpie.schedules.list()]
    return out


def receipt(dispatch_id: str) -> dict[str, Any]:
    found = questpie.queue.get_receipt(dispatch_id)
    return {"status": found.status if found is not None else None}


def die(tag: str) -> dict[str, Any]:
    """Commit, then die before questpie's on_commit send: only the relay can send it."""
    with transaction.atomic():
        transaction.on_commit(lambda: os._exit(0))  # registered first, so it runs first
        dispatch_id = questpie.queue["shop.record"].publish(
            {"tag": f"{tag}-dead"}, idempotency_key=f"{tag}-dead"
        )
        print(json.dumps({"id": dispatch_id}), flush=True)
    raise AssertionError("the on_commit callback should have ended the process")


def swallowed(tag: str) -> dict[str, Any]:
    """A ledger statement fails inside an atomic block and the caller catches it: the
    block must roll back (and drop its on_commit callbacks), not commit half of it."""
    from questpie_celery.errors import QuestpieError  # noqa: PLC0415

    exclusive = questpie.queue["shop.exclusive"]
    first = exclusive.publish({"tag": f"{tag}-1"}, singleton_key=tag)
    with connections["default"].cursor() as cursor:  # it ended: its slot is free again
        cursor.execute(
            "UPDATE questpie_queue_dispatch SET status = 'failed', finished_at = %s WHERE id = %s",
            [django.utils.timezone.now(), first],
        )
    # Takes the slot, and keeps it: no worker reads that queue.
    exclusive.publish({"tag": f"{tag}-2"}, singleton_key=tag, queue="nobody-reads-this")
    fired: list[bool] = []
    caught = ""
    with contextlib.suppress(Exception), transaction.atomic():
        Order.objects.create(tag=tag)
        transaction.on_commit(lambda: fired.append(True))
        try:
            questpie.operator.requeue(first or "")  # meets the taken slot's index
        except QuestpieError as exc:
            caught = type(exc).__name__
    return {
        "caught": caught,
        "fired": bool(fired),
        "order": Order.objects.filter(tag=tag).exists(),
    }


def fire(tag: str) -> dict[str, Any]:
    """A schedule's due tick fired on the Django ledger, as `celery beat` fires it: the
    tick is made due now (rather than waiting for the next minute), then fired twice,
    as two beats would."""
    record = questpie.queue["shop.record"]
    record.schedule({"tag": tag}, "* * * * *")
    # In the ledger's own layout of times: the database's clock, a minute ago.
    minute_ago = (
        "now() - interval '1 minute'"
        if connections["default"].vendor == "postgresql"
        else "strftime('%Y-%m-%d %H:%M:%f000', 'now', '-1 minute')"
    )
    with connections["default"].cursor() as cursor:
        cursor.execute(
            f"UPDATE questpie_schedule SET next_fire_at = {minute_ago} WHERE job_name = %s",
            ["shop.record"],
        )
    questpie.schedules.fire_due()
    questpie.schedules.fire_due()
    [info] = [i for i in questpie.schedules.list() if i.job_name == "shop.record"]
    record.unschedule()
    return {"dispatch": info.last_dispatch_id}


def publish(tag: str) -> dict[str, Any]:
    return {"id": questpie.queue["shop.record"].publish({"tag": tag}, idempotency_key=tag)}


def next_transaction_id() -> int | None:
    """The id PostgreSQL gives the next transaction that writes; None on SQLite."""
    from django.db import connection  # noqa: PLC0415

    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
        return int(cursor.fetchone()[0])


def threads(tag: str) -> dict[str, Any]:
    """Eight threads publishing new keys at once, each on its own Django connection."""
    record = questpie.queue["shop.record"]
    ids: list[str | None] = []
    barrier = threading.Barrier(8)

    def publish(number: int) -> None:
        try:
            barrier.wait()
            ids.extend(
                record.publish({"tag": tag}, idempotency_key=f"{tag}-{number}-{n}")
                for n in range(25)
            )
        finally:
            connections.close_all()

    before = next_transaction_id()
    workers = [threading.Thread(target=publish, args=(number,)) for number in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    after = next_transaction_id()
    writes = None if after is None or before is None else after - before
    return {"ids": ids, "writes": writes}


def listens(tag: str) -> dict[str, Any]:
    """Whether this project's relays would hold a LISTEN (not behind a pooler)."""
    return {"listens": questpie._ledger.relay.send_wakeups() is not None}


if __name__ == "__main__":
    scenario = {
        f.__name__: f
        for f in (atomic, features, receipt, die, publish, swallowed, fire, listens, threads)
    }[sys.argv[1]]
    print(json.dumps(scenario(sys.argv[2])), flush=True)
