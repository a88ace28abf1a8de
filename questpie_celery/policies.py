"""Which queue policy is in force for a job, as recorded in the ledger.

The first process to record a job's policy wins (pg-boss: the queue's policy is
fixed when it is created). Workers record every registered job's policy before
they consume; a publisher records a declared or publish-time policy only while
none is recorded. A different declaration later is logged and ignored;
`questpie-celery policy set JOB POLICY` changes it on purpose.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from .jobs import JobDefinition
from .ledger import Ledger

log = logging.getLogger(__name__)

STANDARD = "standard"
#: Policies that limit runs, so a delivered run may have to wait for its slot.
RUN_LIMITED = frozenset({"singleton", "stately", "exclusive"})
#: How long a process trusts its cached copy of a recorded policy.
POLICY_CACHE_SECONDS = 10.0


class PolicyBook:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._cache: dict[str, tuple[str | None, float]] = {}
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def effective(self, definition: JobDefinition[Any], requested: str | None) -> str:
        """The policy a new dispatch is accepted under.

        `requested` is the call's queue_policy merged over the job's; it counts only
        while the ledger records none for the job.
        """
        recorded = self._recorded(definition.name)
        if recorded is None and requested is not None and requested != STANDARD:
            recorded = self._store(definition.name, requested)
        if recorded is not None:
            self._check_declared(definition, recorded)
        return recorded or STANDARD

    def record_all(self, definitions: Iterable[JobDefinition[Any]]) -> None:
        """Record the declared policy (or standard) of every job that has none."""
        for definition in definitions:
            declared = definition.options.get("queue_policy") or STANDARD
            self._check_declared(definition, self._store(definition.name, declared))

    def warn_ignored_singleton_key(self, job_name: str) -> None:
        self._warn_once(
            (job_name, "singleton_key"),
            "job %s has the standard queue policy: singleton_key has no effect",
            job_name,
        )

    def _recorded(self, job_name: str) -> str | None:
        cached = self._cache.get(job_name)
        now = time.monotonic()
        if cached is not None and now - cached[1] < POLICY_CACHE_SECONDS:
            return cached[0]
        policy = self.ledger.get_policy(job_name)
        self._cache[job_name] = (policy, now)
        return policy

    def _store(self, job_name: str, policy: str) -> str:
        recorded = self.ledger.record_policy(job_name, policy)
        self._cache[job_name] = (recorded, time.monotonic())
        return recorded

    def _check_declared(self, definition: JobDefinition[Any], recorded: str) -> None:
        declared = definition.options.get("queue_policy")
        if declared is not None and declared != recorded:
            self._warn_once(
                (definition.name, f"declared:{declared}:{recorded}"),
                "job %s declares queue_policy=%s but the ledger records %s, which stays in "
                "force; run `questpie-celery policy set %s %s` to change it",
                definition.name,
                declared,
                recorded,
                definition.name,
                declared,
            )

    def _warn_once(self, key: tuple[str, str], message: str, *args: object) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(message, *args)
