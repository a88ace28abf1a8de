"""bench/app.py's Celery project plus one task of each peer (needs the `bench` extra).

celery-once's `QueueOnce` and celery-singleton's `Singleton` both lock on the task's name
and arguments in Redis; here both use the broker's Redis, as they would by default.
"""

from __future__ import annotations

import os
from typing import Any

from celery_once import QueueOnce  # type: ignore[import-untyped]
from celery_singleton import Singleton  # type: ignore[import-untyped]

from bench.app import bump, celery_app, questpie, raw
from bench.app import noop as noop_job

__all__ = ["celery_app", "noop_job", "once", "questpie", "raw", "singleton"]

# celery-once 3.0.1 reads its backend from `conf.ONCE`; its default lock timeout is an
# hour. celery-singleton uses the result backend's Redis, else the broker's (there is no
# result backend here), and by default its locks never expire.
celery_app.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {"url": os.environ.get("BENCH_BROKER", ""), "default_timeout": 60 * 60},
}


@celery_app.task(name="bench.once", base=QueueOnce)  # type: ignore[untyped-decorator]
def once(payload: dict[str, Any]) -> None:
    del payload
    bump("bench:once")


@celery_app.task(name="bench.singleton", base=Singleton)  # type: ignore[untyped-decorator]
def singleton(payload: dict[str, Any]) -> None:
    del payload
    bump("bench:singleton")
