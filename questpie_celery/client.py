"""The queue client: `questpie.queue.<job>.publish(...)` and `questpie.queue.get_receipt(...)`."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from .dispatch import check_transaction_args
from .errors import UnknownJobError
from .jobs import JobDefinition, P
from .options import QueuePolicy, resolve_options
from .policies import STANDARD
from .receipts import Receipt

if TYPE_CHECKING:
    from .app import Questpie


class JobClient(Generic[P]):
    """What the queue client offers for one job."""

    def __init__(self, definition: JobDefinition[P], questpie: Questpie) -> None:
        self.definition = definition
        self._questpie = questpie

    @property
    def name(self) -> str:
        return self.definition.name

    def publish(
        self,
        payload: P | Mapping[str, Any],
        *,
        idempotency_key: str | None = None,
        singleton_key: str | None = None,
        queue_policy: QueuePolicy | None = None,
        secret_payload: bool = False,
        priority: int | None = None,
        start_after: float | str | datetime | None = None,
        retry_limit: int | None = None,
        retry_delay: float | None = None,
        retry_backoff: bool | None = None,
        expire_in_seconds: int | None = None,
        queue: str | None = None,
        session: Session | None = None,
        connection: Connection | None = None,
    ) -> str | None:
        """Enqueue one run; return its dispatch id.

        Everything is validated before anything reaches the ledger or the broker.
        """
        check_transaction_args(session, connection)
        options = resolve_options(
            self.definition.options,
            {
                "idempotency_key": idempotency_key,
                "singleton_key": singleton_key,
                "queue_policy": queue_policy,
                "secret_payload": secret_payload,
                "priority": priority,
                "start_after": start_after,
                "retry_limit": retry_limit,
                "retry_delay": retry_delay,
                "retry_backoff": retry_backoff,
                "expire_in_seconds": expire_in_seconds,
                "queue": queue,
            },
        )
        keyring = None
        if options.secret_payload:
            keyring = self._questpie.keyring_for_publish()
        body = self.definition.to_json(payload)
        policies = self._questpie.policies
        policy = policies.effective(self.definition, options.queue_policy)
        if policy == STANDARD and options.singleton_key is not None:
            policies.warn_ignored_singleton_key(self.definition.name)
        return self._questpie.dispatcher.dispatch(
            self.definition.name,
            body,
            options,
            policy=policy,
            keyring=keyring,
            session=session,
            connection=connection,
        )

    def __repr__(self) -> str:
        return f"<JobClient {self.definition.name!r}>"


class QueueClient:
    """`questpie.queue`: one `JobClient` per registered job, by attribute or by name."""

    def __init__(self, questpie: Questpie) -> None:
        self._questpie = questpie

    def __getattr__(self, attribute: str) -> JobClient[Any]:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        client = self._questpie._clients_by_attribute.get(attribute)
        if client is None:
            raise AttributeError(
                f"no job is registered as queue.{attribute}; known: {self._known()}"
            )
        return client

    def __getitem__(self, job_name: str) -> JobClient[Any]:
        client = self._questpie._clients_by_name.get(job_name)
        if client is None:
            raise UnknownJobError(
                f"no job named {job_name!r} is registered; known: {self._known()}"
            )
        return client

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._questpie._clients_by_attribute})

    def get_receipt(self, dispatch_id: str) -> Receipt | None:
        """The receipt of a secret dispatch, or None for anything else."""
        return self._questpie._receipt(dispatch_id)

    def _known(self) -> str:
        names = sorted(self._questpie._clients_by_name)
        return ", ".join(names) if names else "(none)"
