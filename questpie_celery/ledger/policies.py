"""The queue policy recorded for each job: the one in force, whatever a process's code
says (see `intake/recorded_policy.py`, which caches it)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Insert, Select, bindparam, select
from sqlalchemy.dialects import postgresql, sqlite

from ..jobs.policies import QueuePolicy
from .executor import Part
from .schema import policy_table
from .statements import db_time, insert_or_nothing


class PolicyStatements:
    """The recorded policies' statements for one dialect (written with the server's
    default settings: they are rare)."""

    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        now = db_time()
        p = policy_table.c
        self.get_policy: Select[Any] = select(p.policy).where(p.job_name == bindparam("job"))
        self.record_policy: Insert = insert_or_nothing(dialect, policy_table).values(
            job_name=bindparam("job"),
            policy=bindparam("policy", type_=p.policy.type),
            updated_at=now,
        )
        upsert = (postgresql if dialect == "postgresql" else sqlite).insert(policy_table)
        self.set_policy: Insert = upsert.values(
            job_name=bindparam("job"),
            policy=bindparam("policy", type_=p.policy.type),
            updated_at=now,
        ).on_conflict_do_update(
            index_elements=[p.job_name],
            set_={"policy": upsert.excluded.policy, "updated_at": upsert.excluded.updated_at},
        )


class Policies(Part):
    """Reading and recording each job's queue policy."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = PolicyStatements(dialect, preamble)

    def get(self, job_name: str) -> QueuePolicy | None:
        found = self._db._first(self._sql.get_policy, {"job": job_name})
        return None if found is None else QueuePolicy.parse(found["policy"])

    def record(self, job_name: str, policy: QueuePolicy) -> QueuePolicy:
        """Record a job's policy unless one is recorded; return the one in force."""
        self._db._execute(self._sql.record_policy, {"job": job_name, "policy": policy})
        return self.get(job_name) or policy

    def set(self, job_name: str, policy: QueuePolicy) -> None:
        """Change a job's recorded policy on purpose (new dispatches follow it)."""
        self._db._execute(self._sql.set_policy, {"job": job_name, "policy": policy})
