"""The code docs/asyncio.md quotes from examples/fastapi_app is the code the example's
test runs: every quoted block is in the file it names, character for character."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

# "From [`examples/fastapi_app/app.py`](../examples/fastapi_app/app.py): ...", then the
# block, with nothing but prose between them.
QUOTE = re.compile(
    r"\[`examples/fastapi_app/(?P<file>\w+\.py)`\]\([^)]*\)(?:(?!```).)*?```python\n(?P<code>.*?)```",
    re.DOTALL,
)


def test_every_block_quoted_from_the_fastapi_example_is_in_its_file() -> None:
    page = (ROOT / "docs" / "asyncio.md").read_text()
    quotes = [(m["file"], m["code"]) for m in QUOTE.finditer(page)]
    assert len(quotes) == 3  # the order endpoint, the magic-link endpoint, the lifespan
    for name, code in quotes:
        source = (ROOT / "examples" / "fastapi_app" / name).read_text()
        assert code in source, f"docs/asyncio.md quotes code that {name} does not hold:\n{code}"
