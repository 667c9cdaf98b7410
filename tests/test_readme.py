"""The README stays true: its commands are what CI runs (its Python runs in tests/test_markdown.py)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_first_two_commands_are_install_and_run():
    bash = _blocks("bash")
    assert "axkern bench --quick" in bash[0] and "pip install" in bash[0]
    assert "pytest" in bash[1] and '".[test]"' in bash[1]
    ci = (REPO / ".ci" / "run").read_text()
    assert bash[1].strip() in ci, ".ci/run must run exactly the README's test command"
