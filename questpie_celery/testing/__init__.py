"""`questpie_celery.testing`: a pytest plugin for projects that use questpie_celery.

Its entry point (`questpie_celery_pytest`, outside this package so that every pytest run
of an environment with the package installed stays light) declares the ini options and
turns the fixtures on once a project enables them: see docs/testing.md. The fixtures are
in `fixtures.py`; `Harness` and `Dispatch`, what they give a test, are importable from
here for type annotations.
"""

from __future__ import annotations

from questpie_celery_pytest import FIXTURES

from ..ops.receipts import Dispatch
from .harness import Harness

__all__ = ["FIXTURES", "Dispatch", "Harness"]
