"""Ledger URLs as users paste them, turned into the URL the ledger runs on.

A PostgreSQL URL of any driver SQLAlchemy knows (`postgres://`, `postgresql://`,
`+psycopg2`, `+asyncpg`, `+pg8000`, `+psycopg_async`) runs on psycopg 3: its
connection parameters are libpq's, as psycopg2's are, and the few that asyncpg
spells its own way are translated or refused saying what to write. A SQLite URL runs
on Python's `sqlite3` (`+aiosqlite` names the same file). Everything else, and every
parameter the driver would refuse only when it first connects, is a
`ConfigurationError` now, naming what to write; no message repeats a password.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Never

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from ..errors import ConfigurationError
from .errors import POOLED_HINT

_PG_DRIVERS = ("psycopg", "psycopg2", "psycopg2cffi", "asyncpg", "pg8000", "psycopg_async")
_SQLITE_DRIVERS = ("pysqlite", "aiosqlite")
#: The parameters of Python's sqlite3 that SQLAlchemy reads from a SQLite URL.
_SQLITE_PARAMETERS = ("timeout", "check_same_thread", "cached_statements", "detect_types", "uri")
#: asyncpg's `ssl` values that are libpq's `sslmode` values, meaning the same.
_SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
#: Parameters of other drivers (and of psycopg's Python API) a pasted URL may carry,
#: with what to write for the ledger instead.
_FOREIGN = {
    "prepared_statement_cache_size": f"for a pooler in transaction mode, {POOLED_HINT}",
    "statement_cache_size": f"for a pooler in transaction mode, {POOLED_HINT}",
    "prepare_threshold": f"for a pooler in transaction mode, {POOLED_HINT}",
    "timeout": "write connect_timeout=<seconds>",
    "command_timeout": "write options=-c%20statement_timeout%3D<milliseconds>",
    "ssl": f"write sslmode= with one of {', '.join(_SSL_MODES)}",
    "sslcontext": "write sslmode=, sslrootcert=, sslcert= and sslkey=",
}
_SQLITE_ENDINGS = (".sqlite3", ".sqlite", ".db")
FIX_SQLITE = "write sqlite:////absolute/path/ledger.sqlite3"


def ledger_url(url: str) -> URL:
    """The URL the ledger's engine runs on, or a `ConfigurationError` saying what to write."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError(
            f"the ledger URL is empty: write postgresql+psycopg://user:password@host/db or "
            f"{FIX_SQLITE.removeprefix('write ')}"
        )
    url = url.strip()
    # An '@' means a user (and maybe a password) of a URL that lost its scheme or a
    # slash, not a file: that message would repeat it.
    if "://" not in url and "@" not in url and ("/" in url or url.endswith(_SQLITE_ENDINGS)):
        _refuse_path(url)
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ConfigurationError(
            "invalid ledger URL: write postgresql+psycopg://user:password@host:5432/db or "
            f"{FIX_SQLITE.removeprefix('write ')}"
        ) from None
    except ValueError:  # a port that is not a number: several hosts in the authority
        raise ConfigurationError(
            "invalid ledger URL: its port is not a number. For several hosts write "
            "postgresql+psycopg://user:password@/db?host=h1:5432&host=h2:5433"
        ) from None
    backend, _, driver = parsed.drivername.partition("+")
    if backend in ("postgres", "postgresql"):
        return _postgresql(parsed, driver)
    if backend == "sqlite":
        return _sqlite(parsed, driver)
    raise ConfigurationError(
        f"the ledger runs on PostgreSQL or SQLite, not {backend!r} "
        f"(write postgresql+psycopg://... or sqlite:///path)"
    )


def _refuse_path(path: str) -> Never:
    raise ConfigurationError(
        f"the ledger URL is a file path: write sqlite:///{os.path.abspath(path)} (sqlite:/// "
        "and the absolute path; a relative one would differ between working directories)"
    )


def _postgresql(parsed: URL, driver: str) -> URL:
    if driver and driver not in _PG_DRIVERS:
        raise ConfigurationError(
            f"the ledger runs PostgreSQL on psycopg 3, not {driver!r}: write postgresql+psycopg://"
        )
    if parsed.host is not None and "@" in parsed.host:
        raise ConfigurationError(
            "the ledger URL holds more than one '@': percent-encode its password "
            "(urllib.parse.quote(password, safe=''); '@' is %40, ':' %3A, '/' %2F)"
        )
    query = dict(parsed.query)
    ssl = query.pop("ssl", None)
    if ssl is not None:
        if ssl not in _SSL_MODES or "sslmode" in query:
            raise ConfigurationError(_foreign("ssl"))
        query["sslmode"] = ssl  # asyncpg's spelling of the same setting
    known = _libpq_keywords()
    for key, value in query.items():
        if key in _FOREIGN:
            raise ConfigurationError(_foreign(key))
        if key not in known:
            raise ConfigurationError(
                f"the ledger URL's parameter {key!r} is none of the connection parameters "
                "psycopg 3 takes (libpq's: sslmode, connect_timeout, application_name, "
                "options, target_session_attrs, ...); remove it"
            )
        if not isinstance(value, str) and key not in ("host", "port", "hostaddr"):
            raise ConfigurationError(f"the ledger URL gives {key!r} more than once")
    return parsed.set(drivername="postgresql+psycopg", query=query)


def _foreign(key: str) -> str:
    return f"the ledger URL's parameter {key!r} is not one psycopg 3 takes there: {_FOREIGN[key]}"


def _libpq_keywords() -> frozenset[str]:
    """The connection parameters the installed libpq takes (no connection made)."""
    try:
        from psycopg import pq  # noqa: PLC0415  (the postgres extra)
    except ImportError:
        raise ConfigurationError(
            "a PostgreSQL ledger runs on psycopg 3, which is not installed: "
            "pip install 'questpie-celery[postgres]'"
        ) from None
    return frozenset(option.keyword.decode() for option in pq.Conninfo.get_defaults())


def _sqlite(parsed: URL, driver: str) -> URL:
    if driver and driver not in _SQLITE_DRIVERS:
        raise ConfigurationError(
            f"the ledger opens SQLite with Python's sqlite3, not {driver!r}: {FIX_SQLITE}"
        )
    if parsed.host or parsed.username or parsed.password or parsed.port:
        # sqlite://ledger.sqlite3: two slashes make the file name a host.
        raise ConfigurationError(
            f"a SQLite URL has no host: write sqlite:///{os.path.abspath(parsed.host or '')} "
            "(sqlite:/// and the absolute path)"
        )
    query: Mapping[str, object] = parsed.query
    if query.get("uri") not in ("true", "1"):
        for key in query:
            if key not in _SQLITE_PARAMETERS:
                raise ConfigurationError(
                    f"the ledger URL's parameter {key!r} is not one of Python's sqlite3 "
                    f"({', '.join(_SQLITE_PARAMETERS)}); SQLite's own URI parameters need "
                    "uri=true too"
                )
    return parsed.set(drivername="sqlite")
