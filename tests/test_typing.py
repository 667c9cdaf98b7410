"""Type checkers see axkern after the README's editable install: mypy and pyright check a user's
file that calls the named and the positional API, and report a deliberate type error in it.

The checkout is installed editable (`pip install -e`, as the README does) into a fresh venv, from
a copy of the tree; a .pth file gives that venv this interpreter's site-packages for the
dependencies (as tests/core/test_native.py does for the wheel).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

USER_FILE = """\
import haliax as hax
import jax
import jax.numpy as jnp

import axkern
import axkern.positional

Batch, Embed, Vocab = hax.Axis("batch", 8), hax.Axis("embed", 16), hax.Axis("vocab", 32)
x = hax.random.normal(jax.random.PRNGKey(0), (Batch, Embed))
w = hax.random.normal(jax.random.PRNGKey(1), (Embed, Vocab))
labels = hax.zeros(Batch, dtype=jnp.int32)

loss = axkern.fused_cross_entropy(x, w, labels, Embed="embed", Vocab=Vocab, logits_soft_cap=SOFT_CAP)
per_token = axkern.positional.fused_cross_entropy(x.array, w.array, labels.array, reduction=None)
mean = axkern.positional.fused_cross_entropy_loss(x.array, w.array, labels.array)
with axkern.use(fused_cross_entropy="xla"):
    decision = axkern.explain(axkern.fused_cross_entropy, x, w, labels)
names: dict[str, tuple[str, ...]] = axkern.implementations("fused_cross_entropy")
sizes = axkern.CrossEntropyBlockSizes(block_tokens=128, block_vocab=256)
"""
# haliax ships no py.typed: its names are Any to the checker, as a user's config would say
MYPY_INI = "[mypy]\n[mypy-haliax.*]\nignore_missing_imports = True\n"


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs)


@pytest.fixture(scope="module")
def editable_venv(tmp_path_factory) -> Path:
    """The python of a fresh venv with a copy of the checkout installed by `pip install -e`."""
    work = tmp_path_factory.mktemp("editable")
    tree = work / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    for name in ("src", "native"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    venv = work / "venv"
    assert _run([sys.executable, "-m", "venv", "--without-pip", venv]).returncode == 0
    python = venv / "bin" / "python"
    site = Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )
    (site / "axkern_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", python]
    proc = _run([*pip, "install", "--no-deps", "--no-build-isolation", "-q", "-e", tree])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # a static path file, not setuptools' import-hook finder (which type checkers cannot follow)
    (pth,) = site.glob("__editable__*axkern*.pth")
    assert pth.read_text().strip() == str(tree / "src")
    assert not list(site.glob("__editable__*finder*.py"))
    return python


@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("user")
    (folder / "typed_ok.py").write_text(USER_FILE.replace("SOFT_CAP", "30.0"))
    (folder / "typed_bad.py").write_text(USER_FILE.replace("SOFT_CAP", '"thirty"'))
    (folder / "mypy.ini").write_text(MYPY_INI)
    return folder


def _bad_line() -> int:
    return next(i for i, line in enumerate(USER_FILE.splitlines(), 1) if "SOFT_CAP" in line)


def test_the_package_ships_its_typing_marker():
    assert (ROOT / "src" / "axkern" / "py.typed").is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()


def test_mypy_checks_a_users_file(editable_venv, user_files):
    proc = _run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--python-executable",
            editable_venv,
            "--config-file",
            "mypy.ini",
            "--cache-dir",
            user_files / ".mypy_cache",
            "typed_ok.py",
            "typed_bad.py",
        ],
        cwd=user_files,
    )
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert proc.returncode == 1, out
    # the good file passes: axkern and its types were found
    assert not [e for e in errors if e.startswith("typed_ok.py")], out
    # the bad one fails on exactly the deliberate error
    assert len(errors) == 1, out
    assert errors[0].startswith(f"typed_bad.py:{_bad_line()}:") and "logits_soft_cap" in errors[0], out


def test_pyright_checks_a_users_file(editable_venv, user_files):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = _run(
        [sys.executable, "-m", "pyright", "--pythonpath", editable_venv, "typed_ok.py", "typed_bad.py"],
        cwd=user_files,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    errors = re.findall(r"^\s*(\S+\.py):(\d+):\d+ - error: (.*)$", out, flags=re.M)
    assert [(Path(f).name, int(n)) for f, n, _ in errors] == [("typed_bad.py", _bad_line())], out
    assert "logits_soft_cap" in errors[0][2], out
