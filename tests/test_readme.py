"""The README stays true: its commands are what CI runs, and its example runs and prints what it shows."""

from __future__ import annotations

import contextlib
import io
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


def test_example_runs_and_prints_what_the_readme_shows():
    code = _blocks("python")[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    shown = _blocks("text")[0].strip()
    assert out.getvalue().strip() == shown
