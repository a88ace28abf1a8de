"""The five queue policies and the slot rules each one imposes.

A policy limits how many dispatches of one *slot* (a job as a whole, or one
`singleton_key` of it) may be waiting and running at once:

| policy      | waiting (pending, queued, parked) | running (active, awaiting retry) |
|-------------|-----------------------------------|----------------------------------|
| `standard`  | unlimited                         | unlimited                        |
| `short`     | one                               | unlimited                        |
| `singleton` | unlimited                         | one                              |
| `stately`   | one                               | one                              |
| `exclusive` | one in both together                                                 |

The ledger turns each rule into a partial unique index, so the database, not
a check-then-act in Python, decides who gets a slot.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, get_args

QueuePolicyName = Literal["standard", "short", "singleton", "stately", "exclusive"]
"""The policy names a user writes (`queue_policy="stately"`)."""


class QueuePolicy(StrEnum):
    """One queue policy and its slot rules; a `str`, so it compares equal to its name."""

    STANDARD = "standard"
    SHORT = "short"
    SINGLETON = "singleton"
    STATELY = "stately"
    EXCLUSIVE = "exclusive"

    @property
    def one_waiting(self) -> bool:
        """At most one dispatch of a slot waits to run."""
        return self in (QueuePolicy.SHORT, QueuePolicy.STATELY)

    @property
    def one_running(self) -> bool:
        """At most one dispatch of a slot runs (or awaits its retry)."""
        return self in (QueuePolicy.SINGLETON, QueuePolicy.STATELY)

    @property
    def one_overall(self) -> bool:
        """At most one dispatch of a slot waits or runs."""
        return self is QueuePolicy.EXCLUSIVE

    @property
    def limits_runs(self) -> bool:
        """A delivered run may find its slot busy: it parks, and a finished run hands on."""
        return self.one_running or self.one_overall

    @property
    def ledgered(self) -> bool:
        """Every dispatch of the job needs a ledger row (all policies but `standard`)."""
        return self is not QueuePolicy.STANDARD

    @classmethod
    def parse(cls, value: object) -> QueuePolicy | None:
        """The policy named `value`, or None when it names none."""
        try:
            return cls(value) if isinstance(value, str) else None
        except ValueError:
            return None


# The Literal exists for type checkers; this keeps it and the enum one vocabulary.
if set(get_args(QueuePolicyName)) != {policy.value for policy in QueuePolicy}:  # pragma: no cover
    raise AssertionError("QueuePolicyName and QueuePolicy disagree")
