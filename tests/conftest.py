"""Markers, applied by where a test lives and what it uses.

- `services`: every test under tests/integration (it starts real servers);
  `pytest -m "not services"` (or `pytest tests/unit`) is the fast lane.
- `worker`: the test runs a real `celery worker` process.
- `rabbitmq`: the test runs against RabbitMQ.
"""

from __future__ import annotations

from pathlib import Path

import pytest

INTEGRATION = Path(__file__).parent / "integration"

# `pytester` runs small projects that use the questpie_celery.testing plugin, as users would.
pytest_plugins = ["pytester"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.services)
        names = getattr(item, "fixturenames", ())
        if any("stack" in name for name in names):
            item.add_marker(pytest.mark.worker)
        if "rabbitmq" in item.name:
            item.add_marker(pytest.mark.rabbitmq)
