"""Ids no ledger row can have (`questpie_celery.jobs.ids.unstorable_id`), and every operation
that takes a dispatch id, for tests that hold each one's answer to such an id to its
answer to an id that is merely unknown."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from click.testing import CliRunner
from sqlalchemy import Engine, event

from questpie_celery import Questpie
from questpie_celery.cli.commands import main
from questpie_celery.jobs.ids import MAX_DISPATCH_ID_BYTES, unstorable_id
from questpie_celery.ledger import dispatch_table

#: An id that could be stored, but that no row has.
UNKNOWN = "no-such-dispatch"

#: Ids no row can have, by what is wrong with them.
UNSTORABLE: dict[str, object] = {
    "nul": "\x00",
    "nul-inside": "job-\x00-1",
    "lone-surrogate": "\ud800",
    "too-long": "ü" * (MAX_DISPATCH_ID_BYTES // 2 + 1),  # fewer characters than bytes
    "empty": "",
    "an-int": 12,
    "none": None,
}
assert all(unstorable_id(value) is not None for value in UNSTORABLE.values())
assert unstorable_id(UNKNOWN) is None

#: The ones the command line can be given (an argument is a str).
UNSTORABLE_TEXT = {name: v for name, v in UNSTORABLE.items() if isinstance(v, str)}


@dataclass(frozen=True)
class Answer:
    """What an operation did: returned `value`, or raised `error` saying `message`."""

    value: object = None
    error: type[BaseException] | None = None
    message: str = ""


def answer_of(call: Callable[[], object], dispatch_id: object) -> Answer:
    """Run `call`; its answer, with the id (as `repr` shows it) in a message made general."""
    try:
        return Answer(value=call())
    except Exception as exc:  # the answer is what is compared
        return Answer(error=type(exc), message=str(exc).replace(repr(dispatch_id), "<id>", 1))


def _run(coroutine: Awaitable[object]) -> object:
    async def wait() -> object:
        return await coroutine

    return asyncio.run(wait())


#: Every operation that takes a dispatch id, blocking and awaited, in Python.
OPERATIONS: dict[str, Callable[[Questpie, Any], object]] = {
    "queue.cancel": lambda q, i: q.queue.cancel(i),
    "queue.acancel": lambda q, i: _run(q.queue.acancel(i)),
    "queue.get_status": lambda q, i: q.queue.get_status(i),
    "queue.aget_status": lambda q, i: _run(q.queue.aget_status(i)),
    "queue.get_receipt": lambda q, i: q.queue.get_receipt(i),
    "queue.aget_receipt": lambda q, i: _run(q.queue.aget_receipt(i)),
    "operator.show": lambda q, i: q.operator.show(i),
    "operator.cancel": lambda q, i: q.operator.cancel(i),
    "operator.requeue": lambda q, i: q.operator.requeue(i),
}


def answer(questpie: Questpie, operation: str, dispatch_id: object) -> tuple[Answer, int]:
    """What `operation` answers for `dispatch_id`, and how many statements it sent to the
    ledger's dispatch table meanwhile."""
    with statements() as sent:
        found = answer_of(lambda: OPERATIONS[operation](questpie, dispatch_id), dispatch_id)
    return found, len(sent)


#: The commands that take a dispatch id.
COMMANDS = ("show", "cancel", "requeue")


@dataclass(frozen=True)
class Printed:
    exit_code: int
    output: str

    def naming(self, known: str, other: str) -> Printed:
        """What this would print for `other` where it printed about `known` (quoted as
        `repr` quotes, or as it is, where a lone surrogate is written as its escape)."""
        raw = other.encode("utf-8", "backslashreplace").decode()
        shown = (repr(known), repr(other)) if repr(known) in self.output else (known, raw)
        return Printed(self.exit_code, self.output.replace(*shown, 1))


def run_command(command: str, dispatch_id: str, ledger_url: str) -> tuple[Printed, int]:
    """`questpie-celery dispatches COMMAND ID --ledger-url URL`, in this process: what it
    printed, and how many statements it sent to the ledger's dispatch table."""
    with statements() as sent:
        done = CliRunner().invoke(
            main, ["dispatches", command, dispatch_id, "--ledger-url", ledger_url]
        )
    assert done.exception is None or isinstance(done.exception, SystemExit), repr(done.exception)
    return Printed(done.exit_code, done.output), len(sent)


@contextlib.contextmanager
def statements() -> Iterator[list[str]]:
    """The statements on the ledger's dispatch table that any engine in this process
    (an asyncio engine's too) sends to its database meanwhile."""
    sent: list[str] = []

    def heard(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if dispatch_table.name in statement:
            sent.append(statement)

    event.listen(Engine, "before_cursor_execute", heard)
    try:
        yield sent
    finally:
        event.remove(Engine, "before_cursor_execute", heard)
