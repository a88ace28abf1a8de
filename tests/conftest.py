"""Markers, applied by where a test lives and what it uses.

- `services`: every test under tests/integration (it starts real servers);
  `pytest -m "not services"` (or `pytest tests/unit`) is the fast lane.
- `worker`: the test runs a real `celery worker` process.
- `rabbitmq`: the test runs against RabbitMQ.
- `soak`, `failover` (set by their modules): the long runs, minutes each. They run only
  when asked: with `QP_TEST_LONG=1` (`./scripts/test` without arguments, so CI, sets
  it), with a `-m` expression that names them, or when their file is named.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

INTEGRATION = Path(__file__).parent / "integration"

# `pytester` runs small projects that use the questpie_celery.testing plugin, as users would.
pytest_plugins = ["pytester"]


LONG = ("soak", "failover")


def _asked_for(config: pytest.Config, item: pytest.Item) -> bool:
    if os.environ.get("QP_TEST_LONG"):
        return True
    expression = config.option.markexpr or ""
    if any(re.search(rf"\b{name}\b", expression) for name in LONG):
        return True
    named = {Path(arg.split("::")[0]).resolve() for arg in config.args}
    return Path(str(item.fspath)).resolve() in named


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    long = [i for i in items if any(i.get_closest_marker(m) for m in LONG)]
    skipped = [i for i in long if not _asked_for(config, i)]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [i for i in items if i not in skipped]
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.services)
        names = getattr(item, "fixturenames", ())
        if any("stack" in name for name in names):
            item.add_marker(pytest.mark.worker)
        if "rabbitmq" in item.name:
            item.add_marker(pytest.mark.rabbitmq)
