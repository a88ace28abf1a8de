"""Acting at one line of a running method, as a signal arriving there would."""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any


def line_of(method: Callable[..., Any], text: str) -> int:
    """The number of the first line of `method` containing `text`."""
    source, first = inspect.getsourcelines(inspect.unwrap(method))
    return next(first + number for number, line in enumerate(source) if text in line)


@contextlib.contextmanager
def at_line(method: Callable[..., Any], text: str, act: Callable[[], None]) -> Iterator[None]:
    """Run `act` once, in this thread, when `method` reaches its line containing `text`:
    what a signal handler arriving there would do."""
    code = inspect.unwrap(method).__code__
    line = line_of(method, text)
    fired: list[bool] = []

    def local(frame: FrameType, event: str, arg: object) -> Any:
        if event == "line" and frame.f_lineno == line and not fired:
            fired.append(True)
            act()
        return local

    def calls(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code is code else None

    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(None)
    assert fired, f"line {line} was not reached"
