"""The worker bootstep that runs the relay inside every `celery worker`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from celery import bootsteps

from ..errors import QuestpieError
from .hub_timer import purge_regularly
from .relay import Relay

log = logging.getLogger(__name__)


class RelayStep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
    """Runs the relay in the worker's main process, after the pool has forked, and
    keeps the event loop's timer clear of cancelled time limits (see `hub_timer`).

    Before the relay starts, it records the queue policy of every job the worker
    serves, so publishers and workers agree on them. Celery creates the step
    itself, so its collaborators are class attributes of a subclass made by
    `relay_step()`.
    """

    requires: ClassVar[set[str]] = {"celery.worker.components:Pool"}
    relay: ClassVar[Relay]
    record_policies: ClassVar[Callable[[], None]]
    #: Refuses, by raising, a worker whose jobs are configured in a way that would
    #: mislead (a questpie `rate_limit` beside Celery's own on one job).
    check_jobs: ClassVar[Callable[[], None]]

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, worker: Any) -> None:
        type(self).check_jobs()
        try:
            type(self).record_policies()
        except QuestpieError as exc:
            log.warning("could not record queue policies in the ledger: %s", exc)
        self._thread = threading.Thread(
            target=self.relay.run_forever, args=(self._stop,), name="questpie-relay", daemon=True
        )
        self._thread.start()
        hub = getattr(worker, "hub", None)  # the event loop of prefork on Redis or AMQP
        if hub is not None:
            purge_regularly(hub)

    def stop(self, worker: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    terminate = stop


def relay_step(
    relay: Relay, record_policies: Callable[[], None], check_jobs: Callable[[], None]
) -> type[RelayStep]:
    """A `RelayStep` bound to one `Questpie`'s relay, for `app.steps["worker"]`."""
    return type(
        "QuestpieRelayStep",
        (RelayStep,),
        {
            "relay": relay,
            "record_policies": staticmethod(record_policies),
            "check_jobs": staticmethod(check_jobs),
        },
    )
