"""A publish's inserts and existence checks as plans: the statements to run and what
their results mean, with no I/O.

A plan is a generator: it yields each statement it needs run (`Run`) and is sent back
what the statement returned and whether it ran twice (as `Ledger._run` reports). The
sync ledger drives a plan on its engine (`drive`), the asyncio ledger awaits each step on
its own (`adrive`); so the read-back rule (what an insert that ran again on a fresh
connection counts as inserted) is written once, here.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sqlalchemy import Insert, Select
from sqlalchemy.sql import Executable

from .._runtime.plans import adrive, drive
from .rows import NewDispatch

T = TypeVar("T")


class Statements(Protocol):
    """The statements a plan runs: `dispatches.DispatchStatements` of the ledger's dialect."""

    insert: Insert
    insert_batch: Insert | None
    existing: Select[Any]
    exists: Select[Any]


@dataclass(frozen=True)
class Run:
    """One statement of a plan, run in autocommit as `Ledger._run` runs it."""

    stmt: Executable
    params: Any
    #: Committed to disk before it returns, even on a relaxed ledger.
    durable: bool = False
    #: Run again when the server undid it to break a deadlock.
    rerun_if_rolled_back: bool = False


#: What a statement returned (its rows, or its row count) and whether it ran twice.
Ran = tuple[Any, bool]
Plan = Generator[Run, Ran, T]

__all__ = ["Plan", "Ran", "Run", "Statements", "adrive", "drive"]


def insert(sql: Statements, new: NewDispatch, *, again: bool = False) -> Plan[bool]:
    """Insert the row unless its id (or its policy slot) is taken; True if inserted.
    `again`: an earlier statement that failed may have written it (see
    `Dispatches.insert`)."""
    # A secret's ciphertext exists nowhere else: a relaxed ledger still waits for the
    # disk before the publisher is told it is accepted.
    secret = new.secret_ciphertext is not None
    rows, reran = yield Run(sql.insert, row_params(new), durable=secret)
    if rows:
        return True
    # A retried insert that now conflicts may have been our own first try. A row under a
    # random id can only be ours; for a key's derived id, a second send of another
    # publisher's row is harmless (the fence drops the duplicate).
    return (reran or again) and (yield from exists(sql, new.id))


def insert_many(sql: Statements, batch: Sequence[NewDispatch]) -> Plan[set[str]]:
    """Insert the rows in order, each unless its id or policy slot is taken; the ids
    inserted. One statement on PostgreSQL, the insert per row on SQLite."""
    if not batch:
        return set()
    stmt: Executable
    params: Any
    if sql.insert_batch is not None:
        stmt, params = sql.insert_batch, batch_params(batch)
    else:
        stmt, params = sql.insert, [row_params(new) for new in batch]
    secret = batch[0].secret_ciphertext is not None  # as in `insert`
    rows, reran = yield Run(stmt, params, durable=secret, rerun_if_rolled_back=True)
    inserted = {row["id"] for row in rows}
    if reran:
        # As in `insert`: a row found now may be our first try's, which nobody sent.
        inserted |= yield from existing(sql, [new.id for new in batch if new.id not in inserted])
    return inserted


def existing(sql: Statements, dispatch_ids: Sequence[str]) -> Plan[set[str]]:
    """Which of these rows exist."""
    if not dispatch_ids:
        return set()
    rows, _ = yield Run(sql.existing, {"dispatch_ids": list(dispatch_ids)})
    return {row["id"] for row in rows}


def exists(sql: Statements, dispatch_id: str) -> Plan[bool]:
    """Whether the row exists."""
    rows, _ = yield Run(sql.exists, {"dispatch_id": dispatch_id})
    return bool(rows)


def row_params(new: NewDispatch) -> dict[str, Any]:
    return {
        "id": new.id,
        "job_name": new.job_name,
        "idempotency_key": new.idempotency_key,
        "singleton_key": new.singleton_key,
        "group_key": new.group_key,
        "status": new.status,
        "attempt": new.attempt,
        "policy": new.policy if new.slot is not None else None,
        "slot": new.slot,
        "payload": new.payload,
        "secret": new.secret_ciphertext is not None,
        "secret_ciphertext": new.secret_ciphertext,
        "secret_wrapped_key": new.secret_wrapped_key,
        "secret_key_id": new.secret_key_id,
        "options": new.options,
        "run_after": new.run_after,
        "next_send_at": new.next_send_at,
        "send_in": new.send_in,
        "canvas_id": new.canvas_id,
    }


def batch_params(batch: Sequence[NewDispatch]) -> dict[str, Any]:
    """`insert_batch`'s parameters: the values the rows share once, the others as arrays."""
    first = batch[0]
    if not all(same_statement(first, new) for new in batch):
        # Storing one row's options under another's id would be a silent corruption.
        raise ValueError("the rows of a batch must share job, status, options and times")
    params = {name: value for name, value in row_params(first).items() if name in _SHARED}
    params["policy"] = next((new.policy for new in batch if new.slot is not None), None)
    for name in _PER_ROW:
        params[f"{name}s"] = [getattr(new, name) for new in batch]
    return params


def same_statement(first: NewDispatch, other: NewDispatch) -> bool:
    """Whether `other` can go in `first`'s multi-row insert: everything but its id, keys,
    slot, payload and secret is the same, and both are first attempts (the statement
    writes attempt 0)."""
    return first.attempt == other.attempt == 0 and _shape(first) == _shape(other)


def _shape(new: NewDispatch) -> tuple[Any, ...]:
    return (
        new.job_name,
        new.status,
        new.policy if new.slot is not None else None,
        new.secret_ciphertext is not None,
        new.options,
        new.run_after,
        new.next_send_at,
        new.send_in,
        new.canvas_id,
    )


_SHARED = (
    "job_name", "status", "secret", "options", "run_after", "next_send_at", "send_in",
    "canvas_id",
)  # fmt: skip
_PER_ROW = (
    "id", "idempotency_key", "singleton_key", "group_key", "slot", "payload",
    "secret_ciphertext", "secret_wrapped_key", "secret_key_id",
)  # fmt: skip
