"""The Celery side of a test: settings changed for its duration, an in-process worker."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.worker import state

from ..app import questpie_of

_UNSET = object()

#: What the fixtures run a test's Celery app on unless the project says otherwise (the
#: `questpie_celery_config` fixture): Celery's in-memory broker, which the test and the
#: in-process worker share, and an in-memory result store, so no test needs a server.
DEFAULT_CELERY_CONFIG: Mapping[str, Any] = {
    "broker_url": "memory://",
    "result_backend": "cache+memory://",
    # The in-memory transport polls its queues; once a second by default, so each message
    # would wait up to that long for the in-process worker.
    "broker_transport_options": {"polling_interval": 0.02},
}

#: Celery's own test worker sets up logging as `celery worker` does, which by default
#: takes the root logger over and with it pytest's log capture.
WORKER_SETTINGS: Mapping[str, Any] = {"worker_hijack_root_logger": False}


@contextmanager
def celery_settings(app: Celery, settings: Mapping[str, Any]) -> Iterator[None]:
    """`app` with `settings` for the duration; then the settings it had.

    A broker or result backend changed here takes effect at once: the app's cached
    connection pool, producer pool and result backend are dropped on the way in and on
    the way out.
    """
    if not settings:
        yield
        return
    conf = app.conf
    before = {name: conf.get(name, _UNSET) for name in settings}
    conf.update(settings)
    _drop_connections(app)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is _UNSET:
                conf.pop(name, None)
            else:
                conf[name] = value
        _drop_connections(app)


def _drop_connections(app: Celery) -> None:
    # Celery caches these from the broker and backend URLs when first used. The pools are
    # only let go, not closed: kombu keeps one per broker URL for the whole process and
    # would hand the closed one out again.
    app._pool = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None
    if hasattr(app, "_backend_cache"):
        app._backend_cache = None
    app._local.__dict__.pop("backend", None)
    questpie = questpie_of(app)
    if questpie is not None:
        questpie.broker_changed()  # how it sends priorities depends on the broker


@contextmanager
def in_process_worker(app: Celery, **parameters: Any) -> Iterator[Any]:
    """A `celery worker` in a thread of this process, as Celery's own `start_worker`
    runs it; yields its WorkController. questpie's worker bootstep runs in it as in any
    worker: it records the jobs' queue policies and runs the relay."""
    if app.conf.task_always_eager:
        raise RuntimeError(
            "task_always_eager is on: publish() runs handlers inline and a worker would "
            "receive nothing (use questpie_eager or questpie_worker, not both)"
        )
    options: dict[str, Any] = {
        "pool": "solo",
        "concurrency": 1,
        "loglevel": logging.WARNING,
        # Its ping task needs a result backend that can answer; the test does not.
        "perform_ping_check": False,
        "shutdown_timeout": 30.0,
    }
    options.update(parameters)
    with celery_settings(app, WORKER_SETTINGS), start_worker(app, **options) as worker:
        try:
            yield worker
        finally:
            _wake_to_stop(app)


def _wake_to_stop(app: Celery) -> None:
    """Ask the worker to stop, and wake it so that it does so now.

    `start_worker` asks too, but its consumer (a blocking loop on the in-memory broker)
    looks only between waits for a message of up to 2 s, and waits once more after it saw
    the request: 4 s per test. Two broadcast pings, which every worker's control queue
    receives, end both waits at once.
    """
    state.should_terminate = 0
    for _ in range(2):
        try:
            app.control.broadcast("ping", reply=False)
        except Exception:  # remote control off, or the broker gone: it stops in 4 s anyway
            return
        time.sleep(0.05)
