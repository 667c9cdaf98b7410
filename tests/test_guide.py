"""The guide's Python blocks run as written, in order, and the explain output it shows is what prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

GUIDE = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()


def test_guide_examples_run_and_print_what_the_guide_shows():
    blocks = re.findall(r"```python\n(.*?)```", GUIDE, flags=re.S)
    assert len(blocks) >= 3
    scope: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, code in enumerate(blocks):
            exec(compile(code, f"docs/guide.md[python block {i}]", "exec"), scope)
    shown = re.findall(r"```text\n(.*?)```", GUIDE, flags=re.S)[0].strip()
    assert out.getvalue().strip() == shown
