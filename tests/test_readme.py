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


def _kernel_rows(text: str, header: str) -> dict[str, str]:
    """The rows of the table whose header starts with `header`: each op named in a row's first
    cell (in backticks) -> the rest of that row."""
    table = text.split(header, 1)[1].split("\n\n", 1)[0]
    rows: dict[str, str] = {}
    for line in table.splitlines()[2:]:
        first, rest = line.strip("|").split("|", 1)
        for op in re.findall(r"`(\w+)`", first):
            assert op not in rows, f"{op} has two rows"
            rows[op] = rest
    return rows


TABLES = {
    "README.md": (README, "| op | what | implementations |"),
    "docs/index.md": ((REPO / "docs" / "index.md").read_text(), "| op | math | implementations"),
}


def test_the_kernel_tables_name_every_op_and_its_implementations():
    import axkern

    for page, (text, header) in TABLES.items():
        rows = _kernel_rows(text, header)
        assert set(rows) == set(axkern.ops()), f"{page}: the kernels table and axkern.ops() differ"
        for op, row in rows.items():
            named = set(re.findall(r"`(\w+)`", row))
            missing = set(axkern.implementations(op)) - named
            assert not missing, f"{page}: the row of {op} does not name {sorted(missing)}"


def test_the_kernels_table_names_the_device_of_every_figure():
    rows = _kernel_rows(README, "| op | what | implementations |")
    for op, row in rows.items():
        goal = row.rsplit("|", 2)[-2]
        # each clause with a measured figure (x, %, ms, GiB) names the device it was measured on
        for clause in re.split(r";", goal):
            if re.search(r"\d(x|%| ms| GiB)", clause):
                assert re.search(r"on (the H[12]00|a TPU v5e)", clause), (
                    f"{op}: no device for {clause.strip()!r}"
                )


def test_the_readme_says_how_to_install_for_each_device_and_extra():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, jax in (("cuda13", "jax[cuda13]"), ("cuda12", "jax[cuda12]"), ("tpu", "jax[tpu]")):
        assert extras[extra] == [jax] and f'pip install -e ".[{extra}]"' in README
    assert "`.[report]` for `axkern report`" in README and "`.[docs]` for `mkdocs serve`" in README
    assert "docs/levanter.md" in README and "axkern.levanter" in README
    assert "DESIGN" not in README
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_the_docs_index_gives_the_parallel_test_command():
    index = TABLES["docs/index.md"][0]
    assert "pytest -n auto --dist worksteal" in index and "marked **planned**" not in index
