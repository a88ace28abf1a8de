"""Which queue policy is in force for a job, as recorded in the ledger.

The first process to record a job's policy wins (as with pg-boss, a queue's
policy is fixed when it is created). Workers record every registered job's
policy before they consume; a publisher records a declared or publish-time
policy only while none is recorded. A different declaration later is logged
and ignored; `questpie-celery policy set JOB POLICY` changes it on purpose.

Each process caches what it read for `POLICY_CACHE_SECONDS`. While the ledger
cannot be reached, the last policy this process read stays in force. A publisher
that never read one goes by the job's declaration, so an unkeyed publish of a
`standard` job needs no database at all; a worker never guesses: it reads every
job's policy before its pool forks, and a delivery whose job's policy it could
not read waits for the ledger, like a claim. So the worker enforces the recorded
policy on every delivery, however the message was sent. A ledger whose tables are not
there yet (before `migrate`) counts as one that cannot be reached.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..errors import LedgerSchemaError, LedgerUnavailableError
from ..jobs.definition import JobDefinition
from ..jobs.policies import QueuePolicy
from ..ledger import Ledger

log = logging.getLogger(__name__)

#: How long a process trusts its cached copy of a recorded policy.
POLICY_CACHE_SECONDS = 10.0
#: How long after `set` returns every process holds to the new policy: each copy cached
#: before it was read before it, so it has expired by then (a second's margin for the
#: read's own round trip). Not a process cut off from the ledger: it keeps its last read.
POLICY_SETTLE_SECONDS = POLICY_CACHE_SECONDS + 1.0
#: What keeps a process from reading the recorded policy: the ledger is down, or not
#: migrated yet. Either way the process goes by what it last read, or its declaration.
_UNREADABLE = (LedgerUnavailableError, LedgerSchemaError)


class PolicyBook:
    def __init__(self, ledger: Ledger) -> None:
        self._ledger_policies = ledger.policies
        self._cache: dict[str, tuple[QueuePolicy | None, float]] = {}
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def effective(
        self, definition: JobDefinition[Any], requested: QueuePolicy | None
    ) -> QueuePolicy:
        """The policy a new dispatch is accepted under.

        `requested` is the call's queue_policy merged over the job's; it counts only
        while the ledger records none for the job.
        """
        try:
            recorded = self._recorded(definition.name)
        except _UNREADABLE:
            return requested or QueuePolicy.STANDARD  # the declaration: see the docstring
        if recorded is None and requested is not None and requested.ledgered:
            recorded = self._store(definition.name, requested)
        if recorded is not None:
            self._check_declared(definition, recorded)
        return recorded or QueuePolicy.STANDARD

    def in_force(self, definition: JobDefinition[Any]) -> QueuePolicy:
        """The policy a delivery of the job runs under, at a worker.

        Raises `LedgerUnavailableError` when the ledger is down (`LedgerSchemaError`
        before `migrate`) and this process never read the job's policy.
        """
        declared = QueuePolicy.parse(definition.options.get("queue_policy"))
        return self._recorded(definition.name) or declared or QueuePolicy.STANDARD

    def record_all(self, definitions: Iterable[JobDefinition[Any]]) -> None:
        """Record the declared policy (or standard) of every job that has none."""
        for definition in definitions:
            declared = QueuePolicy.parse(definition.options.get("queue_policy"))
            self._check_declared(
                definition, self._store(definition.name, declared or QueuePolicy.STANDARD)
            )

    def set(self, job_name: str, policy: QueuePolicy) -> None:
        """Change a job's recorded policy on purpose; every process holds to it within
        `POLICY_SETTLE_SECONDS` (this one at once)."""
        self._ledger_policies.set(job_name, policy)
        self._cache[job_name] = (policy, time.monotonic())

    def recorded(self, job_name: str) -> QueuePolicy | None:
        """The policy the ledger records for a job (None when none is), read now."""
        return self._ledger_policies.get(job_name)

    def is_cached(self, job_name: str) -> bool:
        """Whether `effective` would answer from memory, without the ledger, for at least
        another second (a caller that must not wait on the ledger checks this first)."""
        cached = self._cache.get(job_name)
        return cached is not None and time.monotonic() - cached[1] < POLICY_CACHE_SECONDS - 1

    def read(self, job_name: str) -> None:
        """Refresh the cached recorded policy now; a ledger that is down is left to the
        publish that follows, which decides as `effective` says."""
        with contextlib.suppress(*_UNREADABLE):
            self._recorded(job_name)

    def forget(self) -> None:
        """Drop every cached policy: the ledger was rebound to another database."""
        self._cache.clear()

    def warn_ignored_singleton_key(self, job_name: str) -> None:
        self._warn_once(
            (job_name, "singleton_key"),
            "job %s has the standard queue policy: singleton_key has no effect",
            job_name,
        )

    def _recorded(self, job_name: str) -> QueuePolicy | None:
        """The cached recorded policy; while the ledger is down, the last one read."""
        cached = self._cache.get(job_name)
        now = time.monotonic()
        if cached is not None and now - cached[1] < POLICY_CACHE_SECONDS:
            return cached[0]
        try:
            policy = self._ledger_policies.get(job_name)
        except _UNREADABLE:
            if cached is not None:
                return cached[0]
            raise
        self._cache[job_name] = (policy, now)
        return policy

    def _store(self, job_name: str, policy: QueuePolicy) -> QueuePolicy:
        recorded = self._ledger_policies.record(job_name, policy)
        self._cache[job_name] = (recorded, time.monotonic())
        return recorded

    def _check_declared(self, definition: JobDefinition[Any], recorded: QueuePolicy) -> None:
        declared = QueuePolicy.parse(definition.options.get("queue_policy"))
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
