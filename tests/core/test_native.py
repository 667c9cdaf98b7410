"""The native path with the real nvcc and without a GPU: the sources compile, the wheel ships them.

The library is compiled once per test run, into a cache shared by the xdist workers (the
`moe_library` fixture); the wheel's venv builds into the same cache, so whichever comes first
compiles and the other finds the build. Without nvcc the compile tests skip with that reason.
The loader's failure paths are in test_native_failures.py, with stand-in compilers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from axkern import cli
from axkern.core import native

ROOT = Path(__file__).resolve().parents[2]
needs_nvcc = pytest.mark.skipif(native.nvcc() is None, reason="nvcc is not installed on this machine")


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory):
    """axkern built as a wheel from a copy of the checkout, installed without dependencies into a
    fresh venv whose .pth file points at this interpreter's site-packages for the dependencies."""
    work = tmp_path_factory.mktemp("wheel")
    tree = work / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    for name in ("src", "native"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", str(tree), "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist")])
    (wheel,) = (work / "dist").glob("axkern-*.whl")
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)])
    site = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    ).stdout.strip()
    Path(site, "axkern_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    return wheel, venv, Path(site), env


def test_every_source_belongs_to_a_library():
    assert native.source_dir() == ROOT / "native"  # a checkout: the top-level folder
    found = {p for p in native.source_dir().rglob("*") if p.suffix in (".cu", ".cuh")}
    used = {p for lib in native.LIBRARIES.values() for p in native.sources(lib)}
    assert found and found == used  # so building every library compiles every .cu


def test_the_wheel_ships_the_sources_and_the_loader_finds_them(installed_wheel):
    wheel, venv, site, env = installed_wheel
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("axkern/_native/")}
    expected = {
        "axkern/_native/" + p.relative_to(ROOT / "native").as_posix()
        for p in (ROOT / "native").rglob("*")
        if p.suffix in (".cu", ".cuh")
    }
    assert shipped == expected
    probe = (
        "import axkern; from axkern.core import native; print(axkern.__file__); print(native.source_dir())"
    )
    package, sources = _run([str(venv / "bin" / "python"), "-c", probe], env=env).stdout.split()
    assert Path(package).is_relative_to(site)  # the installed copy, not the checkout
    assert Path(sources) == site / "axkern" / "_native"


@needs_nvcc
def test_the_installed_wheel_compiles_a_native_op(installed_wheel, native_cache):
    _, venv, _, env = installed_wheel
    env = {**env, "AXKERN_CACHE_DIR": str(native_cache)}
    out = _run([str(venv / "bin" / "axkern"), "build-native", "moe", "--arch", "9.0"], env=env).stdout
    built = Path(out.split("moe:", 1)[1].split()[0])
    # the same cache entry as the checkout's: the key hashes every source's name and bytes
    lib, flags = native.LIBRARIES["moe"], native.arch_flags((9, 0))
    key = native._key(lib, flags, native._nvcc_version(native.nvcc(), native.build_timeout()))
    assert built == native_cache / key / "libmoe.so" and native._intact(built)


@needs_nvcc
def test_the_library_builds_once_and_dlopens_without_a_gpu(moe_library, native_cache, monkeypatch):
    folder = moe_library.parent
    assert folder.parent == native_cache and native._intact(moe_library)
    assert sorted(p.name for p in folder.iterdir()) == ["build.log", "libmoe.sha256", "libmoe.so"]
    # no temporaries of this build left (another worker may be building another library)
    assert not list(native_cache.glob(f".tmp-{folder.name}-*"))
    for path in (folder, *folder.iterdir()):
        assert path.stat().st_mode & 0o044 == 0o044, f"{path} is not readable by group and others"

    def no_compile(*args):
        raise AssertionError("an intact cache entry was compiled again")

    monkeypatch.setenv("AXKERN_CACHE_DIR", str(native_cache))
    monkeypatch.setattr(native, "_compile", no_compile)
    assert native.build("moe", (9, 0)) == moe_library
    ffi, handle = native._open(moe_library, native.LIBRARIES["moe"])
    assert all(int(ffi.cast("uintptr_t", getattr(handle, h))) for h in native.LIBRARIES["moe"].handlers)


@needs_nvcc
def test_cli_build_native(moe_library, native_cache, monkeypatch, capsys):
    monkeypatch.setenv("AXKERN_CACHE_DIR", str(native_cache))
    assert cli.main(["build-native", "--arch", "9.0"]) == 0
    assert str(moe_library) in capsys.readouterr().out
    assert cli.main(["build-native"]) == 2  # no GPU and no --arch
    assert cli.main(["build-native", "no_such_library", "--arch", "9.0"]) == 2
