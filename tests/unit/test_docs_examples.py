"""The handler-context example of docs/context.md, run as written.

A ```python block whose first line is a comment naming a file (`# proj/celery.py`) is
written to that path in a fresh folder; the `tests/` files among them are then run by
pytest in a process of their own, as a project that copied them would run them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```python\n# (?P<path>[\w/.-]+\.py)\n(?P<body>.*?)```", re.DOTALL)


def example_files(document: str, heading: str | None) -> dict[str, str]:
    """The named blocks of `document`, or of its section under `heading`."""
    text = (ROOT / document).read_text()
    if heading is not None:
        start = text.index(f"\n## {heading}\n")
        end = text.find("\n## ", start + 1)
        text = text[start : end if end != -1 else None]
    return {m["path"]: f"# {m['path']}\n{m['body']}" for m in BLOCK.finditer(text)}


@pytest.mark.parametrize(
    ("document", "heading"),
    [("docs/context.md", None)],
)
def test_the_example_runs_as_written(document: str, heading: str | None, tmp_path: Path) -> None:
    files = example_files(document, heading)
    tests = [path for path in files if path.startswith("tests/")]
    assert tests, f"{document} has no tests/ example"
    for path, body in files.items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        (target.parent / "__init__.py").touch()
        target.write_text(body)
    (tmp_path / "tests" / "__init__.py").unlink()  # a plain test folder, as pytest expects
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed" in done.stdout, done.stdout
