"""Running a test's coroutine as a script would: in an event loop of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from questpie_celery import Questpie

T = TypeVar("T")


def run(questpie: Questpie, body: Callable[[], Awaitable[T]]) -> T:
    """Run `body` in a fresh event loop, closing that loop's ledger connections after."""

    async def main() -> T:
        try:
            return await body()
        finally:
            await questpie.aclose()

    return asyncio.run(main())
