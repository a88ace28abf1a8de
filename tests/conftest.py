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
#: The files that take longest, longest first (measured), so that pytest-xdist, which
#: hands files out in collection order (scripts/test turns its own reordering off),
#: starts them first and the short ones fill in at the end; the unit tests come last of
#: all. Only the order depends on this list.
HEAVIEST = (
    "test_soak", "test_failover", "test_ledger_outages", "test_worker", "test_beat",
    "test_policies", "test_time_limits", "test_faults", "test_django",
)  # fmt: skip


def _schedule(item: pytest.Item) -> tuple[int, int]:
    path = Path(str(item.fspath))
    if INTEGRATION not in path.parents:
        return (2, 0)
    if path.stem in HEAVIEST:
        return (0, HEAVIEST.index(path.stem))
    return (1, 0)


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
    items.sort(key=_schedule)  # stable: within a file, tests keep their order
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.services)
        names = getattr(item, "fixturenames", ())
        if any("stack" in name for name in names):
            item.add_marker(pytest.mark.worker)
        if "rabbitmq" in item.name:
            item.add_marker(pytest.mark.rabbitmq)
