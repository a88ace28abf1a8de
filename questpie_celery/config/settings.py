"""The options of one `Questpie`, validated in one place: `Settings.of(...)`.

A `Settings` is frozen and already checked: every number is a float within its
bounds, the secrets are a keyring (or None), and where the ledger comes from is a
`LedgerSource`: a URL, an engine you made, or one that a framework supplies. A
framework's source (Django's) is reached through `framework_ledger`, the one hook that
imports it, and only when asked for; nothing else here knows which frameworks exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol

from celery import Celery
from sqlalchemy import Engine

from ..errors import ConfigurationError
from ..jobs.context import ContextFactory, checked_factory
from ..jobs.crypto import MIN_SECRET_BYTES, Keyring
from ..jobs.definition import JobDefinition
from ..ledger import create_ledger_engine

#: The claim's lease (see docs/operations.md, "Constants").
DEFAULT_LEASE_SECONDS = 60.0

#: The longest retention period: a database's interval arithmetic overflows not far beyond.
MAX_RETENTION_SECONDS = 100 * 365 * 86400.0

#: How the ledger commits: on disk before each write returns, or a moment later.
Durability = Literal["durable", "relaxed"]


class LedgerSource(Protocol):
    """Where a `Questpie`'s ledger engine comes from."""

    def relaxed_refusal(self) -> str | None:
        """Why `durability='relaxed'` cannot apply to this ledger, or None when it can
        (the ledger makes its own connections, so it sets how they commit)."""

    def open(self, *, relaxed: bool, pooled: bool) -> tuple[Engine, bool]:
        """The engine, and whether it is reached through a pooler in transaction mode
        (`pooled`, or what the source's own settings say)."""


@dataclass(frozen=True)
class UrlLedger:
    """A ledger URL: the ledger makes its engine, tuned for its dialect."""

    url: str

    def relaxed_refusal(self) -> str | None:
        return None

    def open(self, *, relaxed: bool, pooled: bool) -> tuple[Engine, bool]:
        return create_ledger_engine(self.url, relaxed=relaxed, pooled=pooled), pooled


@dataclass(frozen=True)
class GivenEngine:
    """An engine the project made: used as it is."""

    engine: Engine

    def relaxed_refusal(self) -> str | None:
        return (
            "durability='relaxed' sets how the ledger's own connections commit, so it "
            "needs ledger_url=; with engine=, set synchronous_commit on your engine"
        )

    def open(self, *, relaxed: bool, pooled: bool) -> tuple[Engine, bool]:
        return self.engine, pooled


def given_ledger(ledger_url: object, engine: object) -> LedgerSource | None:
    """The source `ledger_url=` or `engine=` names (at most one is given), or None."""
    if engine is not None and not isinstance(engine, Engine):
        raise ConfigurationError("engine must be a sqlalchemy.Engine")
    if ledger_url is not None and not isinstance(ledger_url, str):
        raise ConfigurationError("ledger_url must be a str")
    if engine is not None:
        return GivenEngine(engine)
    return UrlLedger(ledger_url) if ledger_url is not None else None


def framework_ledger(name: str | None) -> LedgerSource | None:
    """The hook to a framework's ledger: the one of Django's `DATABASES` alias `name`,
    or (`name` None) the one a Django project with the app installed implies, if any.
    The Django app is imported only here, and only when called: it is an optional extra,
    above this module."""
    from ..contrib.django.source import DjangoLedger, installed  # noqa: PLC0415

    return installed() if name is None else DjangoLedger(name)


@dataclass(frozen=True)
class Settings:
    """Every option of one `Questpie`, validated (see `Questpie` for what each does)."""

    celery_app: Celery
    ledger: LedgerSource
    keyring: Keyring | None
    jobs: tuple[JobDefinition[Any], ...]
    lease_seconds: float
    relay_interval: float
    redeliver_after: float
    fire_retention: float
    durability: Durability
    retention: float | None
    context: ContextFactory | None
    pooled: bool

    @property
    def relaxed(self) -> bool:
        return self.durability == "relaxed"

    @classmethod
    def of(
        cls,
        celery_app: object,
        *,
        ledger_url: object,
        engine: object,
        django_database: object,
        secret: object,
        previous_secrets: Iterable[object],
        jobs: Iterable[JobDefinition[Any]],
        lease_seconds: object,
        relay_interval: object,
        redeliver_after: object,
        fire_retention: object,
        durability: object,
        retention: object,
        context: object,
        pooled: object,
    ) -> Settings:
        """The options as `Questpie(...)` takes them (its signature holds their defaults),
        checked in this order, each mistake a `ConfigurationError` that says what to pass
        instead."""
        if not isinstance(celery_app, Celery):
            raise ConfigurationError("celery_app must be a celery.Celery application")
        factory = checked_factory(context)
        if django_database is not None and not isinstance(django_database, str):
            raise ConfigurationError("django_database must be an alias of DATABASES (a str)")
        given = sum(x is not None for x in (ledger_url, engine, django_database))
        if given > 1:
            raise ConfigurationError(
                "pass exactly one of ledger_url=, engine= and django_database= (or, in a "
                "Django project with questpie_celery.contrib.django installed, none)"
            )
        ledger = (
            framework_ledger(django_database)
            if given == 0 or django_database is not None
            else given_ledger(ledger_url, engine)
        )
        if ledger is None:
            raise ConfigurationError(
                "pass exactly one of ledger_url= and engine= (or, in a Django project, "
                "add 'questpie_celery.contrib.django' to INSTALLED_APPS, or pass "
                "django_database=)"
            )
        if durability not in ("durable", "relaxed"):
            raise ConfigurationError("durability must be 'durable' or 'relaxed'")
        if not isinstance(pooled, bool):
            raise ConfigurationError("pooled must be True or False")
        refusal = ledger.relaxed_refusal()
        if durability == "relaxed" and refusal is not None:
            raise ConfigurationError(refusal)
        lease = positive_seconds(lease_seconds, "lease_seconds")
        interval = positive_seconds(relay_interval, "relay_interval")
        redeliver = positive_seconds(redeliver_after, "redeliver_after")
        kept = None if retention is None else period(retention, "retention", allow_zero=False)
        current = _as_secret(secret, "secret")
        previous = tuple(
            s for s in (_as_secret(p, "previous_secrets") for p in previous_secrets) if s
        )
        return cls(
            celery_app=celery_app,
            ledger=ledger,
            keyring=_keyring(current, previous),
            jobs=tuple(jobs),
            lease_seconds=lease,
            relay_interval=interval,
            redeliver_after=redeliver,
            fire_retention=positive_seconds(fire_retention, "fire_retention"),
            durability="relaxed" if durability == "relaxed" else "durable",
            retention=kept,
            context=factory,
            pooled=pooled,
        )


def _keyring(current: bytes | None, previous: tuple[bytes, ...]) -> Keyring | None:
    # A secret shorter than 32 bytes is kept out of the keyring: secret publishes then
    # fail with a clear error, and nothing is ever sealed under a weak key.
    if current is None or len(current) < MIN_SECRET_BYTES:
        return None
    return Keyring(current, tuple(p for p in previous if len(p) >= MIN_SECRET_BYTES))


def period(value: object, name: str, *, allow_zero: bool) -> float:
    """A retention period: seconds or a timedelta, finite and within bounds."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{name} must be a number of seconds or a timedelta")
    low = "0" if allow_zero else "above 0"
    if not (value >= 0 if allow_zero else value > 0) or not value <= MAX_RETENTION_SECONDS:
        raise ConfigurationError(
            f"{name} must be {low} and at most {MAX_RETENTION_SECONDS:.0f} seconds (100 years)"
        )
    return float(value)


def positive_seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigurationError(f"{name} must be a number of seconds > 0")
    return float(value)


def _as_secret(value: object, name: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    raise ConfigurationError(f"{name} must be str or bytes")
