"""Environments built from wheels for the Levanter tests (tests/test_levanter.py).

Each is a fresh venv whose .pth file gives it this interpreter's installed packages (jax,
equinox, ...), less every haliax and axkern distribution (a folder of links, so pip sees them
as installed). The wheels: marin-levanter and marin-haliax 0.2.227, the small packages
Levanter imports, haliax 1.4.dev453, downloaded once from PyPI into a cache
(`AXKERN_TEST_WHEELS`, else `~/.cache/axkern/test-wheels`), and axkern built from this checkout.

marin-levanter and marin-haliax declare Python >= 3.12; on 3.11 (CI) they are installed with
`--ignore-requires-python`, and pip evaluates axkern's requirements as on 3.12 (the only
Pythons a Levanter environment exists on): `pip(..., markers_as="3.12")` runs pip with its
marker environment saying 3.12 (the plain installs say 3.11 or 3.12, whichever Python runs
them). Levanter's model modules import there with the stand-ins of tests/levanter_standins.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.2.227.dev40316220070"
LEVANTER = [
    f"marin-levanter=={VERSION}",
    f"marin-haliax=={VERSION}",
    "draccus==0.11.6",
    "mergedeep==1.3.4",
    "toml==0.10.2",
    "typing_inspect==0.9.0",
    "humanfriendly==10.0",
]
HALIAX = "haliax==1.4.dev453"
PIP_MARKERS_AS = """
import sys
from pip._vendor.packaging import markers
environment = markers.default_environment()
environment.update(python_version=MARKERS_AS, python_full_version=MARKERS_AS + ".0")
markers.default_environment = lambda: dict(environment)
from pip._internal.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
HALIAX_DISTRIBUTIONS = """
import importlib.metadata as md, json
print(json.dumps(sorted({d.metadata["Name"] for d in md.distributions()
                         if any(str(f) == "haliax/__init__.py" for f in d.files or [])})))
"""


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs)


def _checked(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = _run(cmd, **kwargs)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def _wheel_name(requirement: str) -> str:
    name, version = requirement.split("==")
    return f"{re.sub(r'[-.]', '_', name).lower()}-{version}-"


def wheels(build: Path) -> Path:
    """The folder of every wheel the environments install, axkern's built from this checkout."""
    cache = Path(os.environ.get("AXKERN_TEST_WHEELS") or Path.home() / ".cache" / "axkern" / "test-wheels")
    cache.mkdir(parents=True, exist_ok=True)
    wanted = [*LEVANTER, HALIAX]
    have = {p.name.lower() for p in cache.glob("*.whl")}
    missing = [r for r in wanted if not any(n.startswith(_wheel_name(r)) for n in have)]
    if missing:  # downloaded beside the cache, then moved in whole (other workers may be reading it)
        fresh = Path(tempfile.mkdtemp(dir=cache))
        _checked(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--pre", "--only-binary=:all:"]
            + ["--python-version", "3.12", "-q", "-d", fresh, *missing]
        )
        for p in fresh.glob("*.whl"):
            os.replace(p, cache / p.name)
        shutil.rmtree(fresh)
    folder = build / "wheels"
    folder.mkdir()
    for p in cache.glob("*.whl"):
        if any(p.name.lower().startswith(_wheel_name(r)) for r in wanted):
            shutil.copy(p, folder)
    tree = build / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, tree / name)
    for name in ("src", "native"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    _checked(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", folder, tree]
    )
    return folder


def venv(path: Path) -> tuple[Path, Path]:
    """A fresh venv seeing this interpreter's packages but haliax's and axkern's: (python, site)."""
    view = path / "packages"
    view.mkdir(parents=True)
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        name = entry.name.lower()
        if name.startswith(("haliax", "axkern", "__editable__", "marin_")) or name.endswith(".pth"):
            continue
        if name != "__pycache__":
            (view / entry.name).symlink_to(entry)
    _checked([sys.executable, "-m", "venv", "--without-pip", path / "venv"])
    python = path / "venv" / "bin" / "python"
    site = Path(
        _checked([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )
    (site / "axkern_test_packages.pth").write_text(f"{view}\n")
    return python, site


def pip(python: Path, *args, markers_as: str | None = None) -> subprocess.CompletedProcess:
    """pip in the venv of `python`; `markers_as` (e.g. "3.12"): requirement markers evaluated as on
    that Python."""
    code = PIP_MARKERS_AS.replace("MARKERS_AS", repr(markers_as))
    cmd = [python, "-c", code] if markers_as else [python, "-m", "pip"]
    return _run([*cmd, "--disable-pip-version-check", *args])


def _levanter_wheels(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.glob("*.whl") if any(p.name.lower().startswith(_wheel_name(r)) for r in LEVANTER)
    )


def _haliax_files(site: Path) -> dict[str, str]:
    return {
        str(p.relative_to(site)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((site / "haliax").rglob("*.py"))
    }


def _imports(python: Path, code: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = _run([python, "-c", f"{code}\nprint('ok')"], env=env)
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else proc.stderr[-3000:]


def install_beside_levanter(folder: Path, path: Path) -> tuple[Path, dict]:
    """A Levanter environment (marin-levanter and marin-haliax installed, no haliax), then
    `pip install axkern` from the wheels as on Python 3.12. Returns the python and a report."""
    python, site = venv(path)
    shutil.copy(ROOT / "tests" / "levanter_standins.py", site / "axkern_test_levanter_standins.py")
    (site / "axkern_test_levanter_standins.pth").write_text("import axkern_test_levanter_standins\n")
    proc = pip(python, "install", "--no-deps", "--no-index", "--no-compile", "--ignore-requires-python", "-q",
               *_levanter_wheels(folder))  # fmt: skip
    if proc.returncode:
        raise RuntimeError(proc.stdout + proc.stderr)
    before = _haliax_files(site)
    (axkern_wheel,) = folder.glob("axkern-*.whl")
    install = pip(python, "install", "--no-index", "--find-links", folder, "--no-compile",
                  "--ignore-requires-python", axkern_wheel, markers_as="3.12")  # fmt: skip
    installed = re.findall(r"Successfully installed (.*)", install.stdout)
    check = pip(python, "check", markers_as="3.12").stdout.strip().splitlines()
    report = {
        "pip install": install.stdout + install.stderr,
        "installed": sorted(n.rsplit("-", 1)[0] for n in (installed[0].split() if installed else [])),
        "haliax files changed": sorted(
            k
            for k in before.keys() | _haliax_files(site).keys()
            if before.get(k) != _haliax_files(site).get(k)
        ),  # fmt: skip
        "haliax distributions": json.loads(_checked([python, "-c", HALIAX_DISTRIBUTIONS]).stdout),
        "pip check": check,
        "pip check about axkern or haliax": [
            line for line in check if re.search(r"axkern|haliax", line, re.I)
        ],
        "imports": _imports(
            python,
            "import axkern, axkern.levanter, levanter.models.llama, haliax.partitioning\n"
            "assert hasattr(haliax.partitioning, 'shard_map')",
        ),
    }
    return python, report


def plain_install(folder: Path, path: Path, python_version: str) -> dict:
    """`pip install axkern` from the wheels into an environment without haliax, its markers
    evaluated as on `python_version` ("3.11" or "3.12")."""
    python, _ = venv(path)
    (axkern_wheel,) = folder.glob("axkern-*.whl")
    install = pip(python, "install", "--no-index", "--find-links", folder, "--no-compile",
                  "--ignore-requires-python", axkern_wheel, markers_as=python_version)  # fmt: skip
    return {
        "pip install": install.stdout + install.stderr,
        "expected haliax": "marin-haliax" if python_version == "3.12" else "haliax",
        "haliax distributions": json.loads(_checked([python, "-c", HALIAX_DISTRIBUTIONS]).stdout),
        "pip check": [
            ln
            for ln in pip(python, "check", markers_as=python_version).stdout.strip().splitlines()
            if ln != "No broken requirements found."
        ],  # fmt: skip
        "imports": _imports(
            python,
            "import haliax as hax, jax.numpy as jnp, axkern\n"
            "B, E, V = hax.Axis('batch', 4), hax.Axis('embed', 8), hax.Axis('vocab', 16)\n"
            "loss = axkern.fused_cross_entropy(hax.ones((B, E)), hax.zeros((E, V)), hax.zeros(B, dtype=jnp.int32))\n"
            "assert abs(float(loss) - float(jnp.log(16))) < 1e-5",
        ),
    }
