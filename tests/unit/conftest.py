"""Fixtures of the fast lane: no servers, no worker process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.unit.helpers import IdleApp


@pytest.fixture(scope="module")
def idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IdleApp]:
    """A Questpie on a SQLite file and memory://, publishing to a queue nobody reads."""
    made = IdleApp.build(tmp_path_factory.mktemp("idle"))
    yield made
    made.close()
