"""Driving a plan: a generator that yields each step it needs done and is sent back
what the step answered, so one decision is written once and run sync or awaited.

The ledger's insert plans (`ledger/inserts.py`) and a publish's chunk plan
(`publish/planner.py`) are such generators; `drive` runs one, `adrive` awaits one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

S = TypeVar("S")  # a step
A = TypeVar("A")  # what a step answers
T = TypeVar("T")  # what the plan answers


def drive(plan: Generator[S, A, T], run: Callable[[S], A]) -> T:
    """Do each step of `plan` with `run`, sending back its answer; return the plan's."""
    try:
        step = next(plan)
    except StopIteration as done:
        return _answer(plan, done)
    while True:
        answer = run(step)  # outside the `try`: a StopIteration of its own is no answer
        try:
            step = plan.send(answer)
        except StopIteration as done:
            return _answer(plan, done)


async def adrive(plan: Generator[S, A, T], run: Callable[[S], Awaitable[A]]) -> T:
    """As `drive`, awaiting each step."""
    try:
        step = next(plan)
    except StopIteration as done:
        return _answer(plan, done)
    while True:
        answer = await run(step)  # outside the `try`, as in `drive`
        try:
            step = plan.send(answer)
        except StopIteration as done:
            return _answer(plan, done)


def _answer(plan: Generator[Any, Any, T], done: StopIteration) -> T:
    """What a finished `plan` answered (typed by the plan; StopIteration's is Any)."""
    answer: T = done.value
    return answer
