"""Every Python block of README.md and docs/ runs, and what it prints is what the page shows.

A page's Python blocks run top to bottom in one namespace (a later block may use an earlier
block's names). A block of `>>>` lines runs as a doctest. A `text` block that follows a
Python block with nothing but blank lines between is that block's printed output and must
match it (doctest's `...` stands for any text, whitespace runs compare equal). A block
preceded by `<!-- docs-test: skip (why) -->` is left out, with its reason on the page.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", flags=re.S | re.M)
SKIP = re.compile(r"<!-- docs-test: skip \(([^)]+)\) -->\s*$")
_CHECK = doctest.OutputChecker()
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def blocks(text: str) -> list[tuple[str, str, str | None, int]]:
    """`(code, expected output or None, skip reason or None, line)` for each Python block."""
    fences = list(FENCE.finditer(text))
    out = []
    for i, m in enumerate(fences):
        if m.group(1) != "python":
            continue
        expected = None
        if i + 1 < len(fences):
            nxt = fences[i + 1]
            if nxt.group(1) == "text" and not text[m.end() : nxt.start()].strip():
                expected = nxt.group(2)
        skip = SKIP.search(text[: m.start()])
        out.append(
            (m.group(2), expected, skip.group(1) if skip else None, text.count("\n", 0, m.start()) + 1)
        )
    return out


def _run(code: str, scope: dict, name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if code.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(code, scope, name, name, 0)
            runner = doctest.DocTestRunner(optionflags=_FLAGS)
            runner.run(test, out=out.write, clear_globs=False)
            assert not runner.failures, out.getvalue()
            return ""
        exec(compile(code, name, "exec"), scope)
    return out.getvalue()


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_python_blocks_run_and_print_what_the_page_shows(page):
    rel = page.relative_to(REPO).as_posix()
    scope: dict = {"__name__": "__docs__"}
    for code, expected, skip, line in blocks(page.read_text()):
        if skip:
            continue
        printed = _run(code, scope, f"{rel}:{line}")
        if expected is not None:
            want = expected.strip() + "\n"
            assert _CHECK.check_output(want, printed.strip() + "\n", _FLAGS), (
                f"{rel}:{line} printed\n{printed}\nbut the page shows\n{expected}"
            )


def test_the_runner_finds_outputs_skips_and_doctests():
    page = (
        "```python\nprint(1)\n```\n\n```text\n1\n```\n"
        "<!-- docs-test: skip (needs a cluster) -->\n```python\nboom\n```\n"
        "```python\n>>> 1 + 1\n2\n```\n"
    )
    (a, b, c) = blocks(page)
    assert a[1] == "1\n" and a[2] is None
    assert b[2] == "needs a cluster"
    assert c[1] is None and _run(c[0], {}, "doctest") == ""
    with pytest.raises(AssertionError):
        _run(">>> 1 + 1\n3\n", {}, "doctest")
    assert sum(len([b for b in blocks(p.read_text()) if not b[2]]) for p in PAGES) >= 15
