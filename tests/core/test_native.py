"""The native path without a GPU: every .cu compiles, the cache and lock work, failures are reasons.

Needs nvcc (CI has CUDA 13's); without it the compile tests are skipped with that reason and
only the no-nvcc failure path runs.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from axkern import cli
from axkern.core import native
from axkern.core.op import Unsupported

NVCC = native.nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
CU_FILES = sorted(native.source_dir().rglob("*.cu"))


def test_there_are_sources():
    assert CU_FILES and all(p.is_file() for p in CU_FILES)


@needs_nvcc
@pytest.mark.parametrize("path", CU_FILES, ids=[p.name for p in CU_FILES])
def test_every_cu_compiles_for_hopper(path, tmp_path):
    cmd = [
        NVCC,
        "-std=c++17",
        "-c",
        *native.arch_flags((9, 0)),
        "-isystem",
        native._jax_include(),
        "-I",
        str(native.source_dir() / "common"),
        str(path),
        "-o",
        str(tmp_path / "out.o"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr


def _builds(cache: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in cache.rglob("build.log"))


@needs_nvcc
def test_build_caches_and_rebuilds_a_corrupt_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_CACHE_DIR", str(tmp_path))
    lib = native.LIBRARIES["moe"]
    path = native.build(lib, (9, 0))
    assert path.is_file() and path.parent.parent == tmp_path and native._intact(path)
    # dlopen works without a GPU (in a child: this process must not map a file it then corrupts)
    probe = f"from axkern.core import native; native._open(__import__('pathlib').Path({str(path)!r}), native.LIBRARIES['moe'])"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0
    assert native.build(lib, (9, 0)) == path and _builds(tmp_path) == 1  # cached: not rebuilt
    garbage = path.with_name("garbage")
    garbage.write_bytes(b"not a shared library")
    garbage.replace(path)  # a crashed writer's leftovers
    assert native.build(lib, (9, 0)) == path and _builds(tmp_path) == 2  # corrupt: rebuilt
    assert native._intact(path)
    assert native.build(lib, (8, 0)) != path  # another arch, another entry


@needs_nvcc
def test_processes_sharing_a_cache_build_once_and_all_load_it(tmp_path):
    # as hosts on one shared filesystem: processes released together into the build of the same
    # library in the same cache build it once, and every one of them loads that build
    cache, go = tmp_path / "cache", tmp_path / "go"
    code = textwrap.dedent(
        f"""
        import os, pathlib, sys, time
        from axkern.core import native
        pathlib.Path({str(tmp_path)!r}, "ready" + sys.argv[1]).touch()
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        lib = native.LIBRARIES["moe"]
        path = native.build(lib, (9, 0))
        native._open(path, lib)  # dlopen works without a GPU
        print(path, native._digest(path))
        """
    )
    env = {**os.environ, "AXKERN_CACHE_DIR": str(cache)}
    n = 4
    procs = []
    try:
        for i in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, str(i)], env=env, stdout=subprocess.PIPE, text=True
                )
            )
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready*"))) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        go.touch()
        outs = [p.communicate(timeout=900)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0] * n
    assert len(set(outs)) == 1 and _builds(cache) == 1
    folder = Path(outs[0].split()[0]).parent
    assert sorted(p.name for p in folder.iterdir()) == [
        "build.log",
        "libmoe.sha256",
        "libmoe.so",
    ]  # no temporaries


def test_failures_are_unsupported_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_CACHE_DIR", str(tmp_path))
    with pytest.raises(Unsupported, match="no CUDA GPU visible"):
        native.load("moe")  # this machine has no GPU
    with pytest.raises(Unsupported, match="older than 7.0"):
        native.arch_flags((6, 1))
    monkeypatch.setattr(native, "nvcc", lambda: None)
    with pytest.raises(Unsupported, match="nvcc not found"):
        native.build(native.LIBRARIES["moe"], (9, 0))
    assert native.status()["moe"].startswith("unavailable:")


@needs_nvcc
def test_a_failed_build_is_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "common").mkdir()
    (tmp_path / "broken" / "broken.cu").write_text("this is not C++;\n")
    monkeypatch.setattr(native, "source_dir", lambda: tmp_path)
    with pytest.raises(Unsupported, match="nvcc failed building broken"):
        native.build(native.Library("broken", ("Nothing",)), (9, 0))


@needs_nvcc
def test_cli_build_native(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AXKERN_CACHE_DIR", str(tmp_path))
    assert cli.main(["build-native", "--arch", "9.0"]) == 0
    assert str(tmp_path) in capsys.readouterr().out
    assert cli.main(["build-native"]) == 2  # no GPU and no --arch


def test_a_failed_load_is_not_retried(monkeypatch):
    # as if on a GPU: the first failure runs the build, later calls fall back at once
    calls = []

    def failing(name, cc):
        calls.append(name)
        raise Unsupported("nvcc failed building moe: boom")

    monkeypatch.setattr(native.backend, "platform", lambda: "gpu")
    monkeypatch.setattr(native.backend, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(native, "_registered", failing)
    monkeypatch.setattr(native, "_failed", {})
    with pytest.raises(Unsupported, match="boom"):
        native.load("moe")
    with pytest.raises(Unsupported, match="not retried"):
        native.load("moe")
    assert calls == ["moe"]


@needs_nvcc
def test_a_cache_without_file_locks_is_a_reason(tmp_path, monkeypatch):
    # a shared filesystem mounted without lock support: flock fails with ENOLCK
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setenv("AXKERN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native.backend, "platform", lambda: "gpu")
    monkeypatch.setattr(native.backend, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(native, "_failed", {})
    monkeypatch.setattr(native.fcntl, "flock", no_locks)
    with pytest.raises(Unsupported, match=r"No locks available.*must be writable and support file locks"):
        native.load("moe")
    with pytest.raises(Unsupported, match="not retried"):
        native.load("moe")
