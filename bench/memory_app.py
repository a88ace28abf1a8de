"""bench/app.py's Celery project, with tracemalloc snapshots on demand.

With BENCH_TRACEMALLOC="1000,20000" and BENCH_TRACEMALLOC_DIR=<folder>, the worker's
main process starts tracemalloc before it forks its pool (so the children trace too);
each pool child, after its 1,000th and 20,000th finished task, and the main process,
after it has received its 1,000th and 20,000th task, collect garbage and dump a snapshot
to <folder>/child-<pid>-<count>.snap and <folder>/main-<pid>-<count>.snap. Without them
this module adds nothing to bench/app.py.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from pathlib import Path
from typing import Any

from celery.signals import task_postrun, task_received, worker_init

from bench.app import celery_app, noop, questpie, raw

__all__ = ["celery_app", "noop", "questpie", "raw"]

SNAPSHOT_AT = {int(n) for n in os.environ.get("BENCH_TRACEMALLOC", "").split(",") if n}
SNAPSHOT_DIR = Path(os.environ.get("BENCH_TRACEMALLOC_DIR", "."))
FRAMES = 30
_counts = {"child": 0, "main": 0}  # per process: a forked child starts from its copy


def _count(process: str) -> None:
    _counts[process] += 1
    if _counts[process] in SNAPSHOT_AT:
        gc.collect()
        path = SNAPSHOT_DIR / f"{process}-{os.getpid()}-{_counts[process]}.snap"
        tracemalloc.take_snapshot().dump(str(path))


if SNAPSHOT_AT:

    @worker_init.connect  # type: ignore[untyped-decorator]
    def start_tracing(**_: Any) -> None:
        tracemalloc.start(FRAMES)

    @task_received.connect  # type: ignore[untyped-decorator]
    def count_received(**_: Any) -> None:
        _count("main")

    @task_postrun.connect  # type: ignore[untyped-decorator]
    def count_finished(**_: Any) -> None:
        _count("child")
