"""The native loader's failure paths, with stand-in nvcc scripts (the real nvcc never runs here).

Each failure must be an `Unsupported` reason (never a raw exception, never a crash), leave no
temporaries, and be remembered by `load` so that nvcc does not run again in the process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import jax.numpy as jnp
import pytest

import axkern
from axkern.core import native
from axkern.core.op import FallbackWarning, Unsupported

MOE = native.LIBRARIES["moe"]


def fake_nvcc(folder: Path, action: str, *, version: str = 'echo "Cuda compilation tools, fake"') -> Path:
    """A stand-in nvcc: runs `version` for `--version`; for a build appends its pid to `calls`,
    sets `$out` to the `-o` path and runs `action` (sh)."""
    script = folder / "nvcc"
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            if [ "$1" = "--version" ]; then {version}; exit 0; fi
            echo $$ >> '{folder / "calls"}'
            out=""; prev=""
            for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
            """
        )
        + action
        + "\n"
    )
    script.chmod(0o755)
    return script


def calls(folder: Path) -> int:
    return len((folder / "calls").read_text().splitlines()) if (folder / "calls").exists() else 0


WRITES_A_FILE = 'printf "not a shared library" > "$out"'


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """A cache of the test's own; no failure or load remembered from another test."""
    monkeypatch.setenv("AXKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AXKERN_NVCC_TIMEOUT", raising=False)
    monkeypatch.setattr(native, "_failed", {})
    native._registered.cache_clear()
    yield
    native._registered.cache_clear()


@pytest.fixture
def as_if_on_a_gpu(monkeypatch):
    monkeypatch.setattr(native.backend, "platform", lambda: "gpu")
    monkeypatch.setattr(native.backend, "compute_capability", lambda: (9, 0))


def no_temporaries(root: Path) -> bool:
    return not list(root.glob(".tmp-*")) if root.is_dir() else True


def test_without_a_gpu_or_nvcc_or_with_an_old_arch(monkeypatch):
    with pytest.raises(Unsupported, match="no CUDA GPU visible"):
        native.load("moe")  # this machine has no GPU
    with pytest.raises(Unsupported, match="no CUDA GPU visible to build for"):
        native.build("moe")
    with pytest.raises(Unsupported, match="older than 7.0"):
        native.arch_flags((6, 1))
    with pytest.raises(ValueError, match="unknown native library 'nope'"):
        native.build("nope", (9, 0))
    monkeypatch.setattr(native, "nvcc", lambda: None)
    with pytest.raises(Unsupported, match="nvcc not found"):
        native.build("moe", (9, 0))
    assert native.status()["moe"].startswith("unavailable:")


def test_nvcc_is_found_through_axkern_nvcc_first(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("AXKERN_NVCC", str(tmp_path / "mine"))
    assert native.nvcc() == str(tmp_path / "mine")


def test_a_build_writes_a_digest_and_group_readable_files(tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, WRITES_A_FILE)))
    path = native.build("moe", (9, 0))
    assert path.read_bytes() == b"not a shared library" and native._intact(path)
    assert path.with_suffix(".sha256").read_text().strip() == native._digest(path)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (path.parent, *path.parent.iterdir())}
    assert modes == {path.parent.name: 0o755, "libmoe.so": 0o755, "libmoe.sha256": 0o644, "build.log": 0o644}
    assert native.build("moe", (9, 0)) == path and calls(tmp_path) == 1  # cached
    assert native.build("moe", (8, 0)) != path and calls(tmp_path) == 2  # another arch, another entry
    assert no_temporaries(tmp_path / "cache")


def test_a_corrupt_entry_is_rebuilt_and_never_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, WRITES_A_FILE)))
    path = native.build("moe", (9, 0))
    path.write_bytes(b"not a shared librarx")  # same size, same source key, other bytes
    with pytest.raises(Unsupported, match="does not match the sha256 beside it"):
        native._open(path, MOE)
    assert native.build("moe", (9, 0)) == path and calls(tmp_path) == 2
    assert native._intact(path)


def test_a_truncated_library_does_not_crash_the_process(moe_library, tmp_path):
    # a real library cut short under its digest and the source key it was built for: dlopen of
    # such a file can kill the process, so the loader must notice and rebuild (a stand-in
    # compiler copying the real library) before it loads anything
    script = fake_nvcc(tmp_path, f'cp "{moe_library}" "$out"')
    cache = tmp_path / "cache"
    code = textwrap.dedent(
        """
        from pathlib import Path
        from axkern.core import native
        path = native.build("moe", (9, 0))
        path.write_bytes(path.read_bytes()[: 4096])
        ffi, handle = native._open(native.build("moe", (9, 0)), native.LIBRARIES["moe"])
        print(int(ffi.cast("uintptr_t", handle.AxkernMoeRoute)) != 0)
        """
    )
    env = {**os.environ, "AXKERN_CACHE_DIR": str(cache), "AXKERN_NVCC": str(script), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True" and calls(tmp_path) == 2


def test_a_failed_build_is_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, 'echo "moe.cu(1): error: boom" >&2; exit 2')))
    with pytest.raises(
        Unsupported, match=r"nvcc failed building moe \(exit status 2\): moe.cu\(1\): error: boom"
    ):
        native.build("moe", (9, 0))
    assert no_temporaries(tmp_path / "cache")
    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, "exit 0")))
    with pytest.raises(Unsupported, match="exited 0 building moe but wrote no libmoe.so"):
        native.build("moe", (9, 0))


def test_nvcc_that_cannot_run_is_a_reason(tmp_path, monkeypatch):
    script = fake_nvcc(tmp_path, WRITES_A_FILE)
    script.chmod(0o644)  # present but not executable (refused to root as well)
    monkeypatch.setenv("AXKERN_NVCC", str(script))
    with pytest.raises(Unsupported, match=r"nvcc at .*nvcc cannot be run \(PermissionError"):
        native.build("moe", (9, 0))
    monkeypatch.setenv("AXKERN_NVCC", str(tmp_path / "missing"))
    with pytest.raises(Unsupported, match=r"cannot be run \(FileNotFoundError"):
        native.build("moe", (9, 0))


@pytest.mark.parametrize("where", ["build", "version"])
def test_nvcc_that_hangs_is_stopped(where, tmp_path, monkeypatch):
    # the stand-in's `sleep` is its child: stopping only the script would leave the pipes open
    if where == "build":
        script = fake_nvcc(tmp_path, "sleep 60")
    else:
        script = fake_nvcc(tmp_path, WRITES_A_FILE, version="sleep 60")
    monkeypatch.setenv("AXKERN_NVCC", str(script))
    monkeypatch.setenv("AXKERN_NVCC_TIMEOUT", "0.5")
    start = time.monotonic()
    with pytest.raises(
        Unsupported, match=r"did not finish within 0.5 s and was stopped \(AXKERN_NVCC_TIMEOUT"
    ):
        native.build("moe", (9, 0))
    assert time.monotonic() - start < 30
    assert no_temporaries(tmp_path / "cache")


def test_a_malformed_timeout_is_an_error(monkeypatch):
    monkeypatch.setenv("AXKERN_NVCC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="AXKERN_NVCC_TIMEOUT='soon': expected a positive number of seconds"):
        native.build_timeout()


def test_a_cache_path_that_is_a_file_is_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, WRITES_A_FILE)))
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("AXKERN_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(Unsupported, match=r"build cache .*file cannot be used \(FileExistsError"):
        native.build("moe", (9, 0))
    monkeypatch.setenv("AXKERN_CACHE_DIR", str(tmp_path / "file" / "below"))
    with pytest.raises(Unsupported, match=r"cannot be used \(NotADirectoryError.*set AXKERN_CACHE_DIR"):
        native.build("moe", (9, 0))
    assert calls(tmp_path) == 0


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes through a read-only mode (the EROFS test covers it)"
)
def test_a_read_only_cache_is_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, WRITES_A_FILE)))
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        with pytest.raises(Unsupported, match=r"cannot be used \(PermissionError"):
            native.build("moe", (9, 0))
    finally:
        cache.chmod(0o755)


def test_a_read_only_filesystem_is_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, WRITES_A_FILE)))

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(Unsupported, match=r"cannot be used \(OSError: \[Errno 30\] Read-only file system"):
        native.build("moe", (9, 0))


def test_a_cache_without_file_locks_is_a_reason(tmp_path, monkeypatch, as_if_on_a_gpu):
    # a shared filesystem mounted without lock support: flock fails with ENOLCK
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, WRITES_A_FILE)))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(
        Unsupported, match=r"No locks available.*writable directory on a filesystem with file locks"
    ):
        native.load("moe")
    with pytest.raises(Unsupported, match="not retried"):
        native.load("moe")
    assert calls(tmp_path) == 0


def test_a_library_that_does_not_load_is_a_reason(tmp_path, monkeypatch, as_if_on_a_gpu):
    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, WRITES_A_FILE)))
    with pytest.raises(Unsupported, match=r"native library 'moe': OSError: cannot load library"):
        native.load("moe")


def test_a_failure_is_remembered_and_the_op_falls_back_with_one_warning(
    tmp_path, monkeypatch, as_if_on_a_gpu
):
    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, 'echo "error: boom" >&2; exit 1')))
    topk = jnp.array([[0, 1], [2, 0], [1, 3]], jnp.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = [axkern.positional.moe_layout(topk, num_experts=4).tokens_per_expert for _ in range(3)]
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallbacks) == 1 and "skipping 'cuda'" in fallbacks[0] and "error: boom" in fallbacks[0]
    assert all(c.tolist() == [2, 2, 1, 1] for c in counts)  # the xla implementation ran
    assert calls(tmp_path) == 1  # nvcc ran once; later calls reused the remembered reason


def test_a_killed_build_leaves_nothing_that_outlives_the_next_build(tmp_path, monkeypatch):
    # a process killed while nvcc writes: its temporary folder stays until the next build of that entry
    script = fake_nvcc(
        tmp_path,
        'if [ -n "$FAKE_NVCC_STALL" ]; then printf partial > "$out"; sleep 60; fi\n' + WRITES_A_FILE,
    )
    monkeypatch.setenv("AXKERN_NVCC", str(script))
    cache = tmp_path / "cache"
    code = "from axkern.core import native; native.build('moe', (9, 0))"
    env = {**os.environ, "FAKE_NVCC_STALL": "1", "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 120
        while not list(cache.glob(".tmp-*/libmoe.so")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the stand-in has written "partial" and sleeps
        assert calls(tmp_path) == 1, "the stand-in compiler never started"
    finally:
        child.kill()
        child.wait()
    nvcc_pid = int((tmp_path / "calls").read_text().split()[0])
    with contextlib.suppress(ProcessLookupError):  # taken down with its builder already
        os.killpg(nvcc_pid, signal.SIGKILL)  # it ran in its own process group
    assert group_gone(nvcc_pid)
    (stale,) = cache.glob(".tmp-*")
    assert (stale / "libmoe.so").read_bytes() == b"partial"
    path = native.build("moe", (9, 0))
    assert native._intact(path) and no_temporaries(cache)


def test_processes_sharing_a_cache_build_once(tmp_path, monkeypatch):
    # as hosts on one shared filesystem: processes released together into the same build wait on
    # the lock, and all but the first find the finished entry
    script = fake_nvcc(tmp_path, "sleep 1\n" + WRITES_A_FILE)
    cache, go = tmp_path / "cache", tmp_path / "go"
    code = textwrap.dedent(
        f"""
        import os, pathlib, sys, time
        from axkern.core import native
        pathlib.Path({str(tmp_path)!r}, "ready" + sys.argv[1]).touch()
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        print(native.build("moe", (9, 0)))
        """
    )
    env = {**os.environ, "AXKERN_CACHE_DIR": str(cache), "AXKERN_NVCC": str(script), "JAX_PLATFORMS": "cpu"}
    procs = []
    try:
        for i in range(2):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, str(i)], env=env, stdout=subprocess.PIPE, text=True
                )
            )
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready*"))) < len(procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        go.touch()
        outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0] * len(procs)
    assert len(set(outs)) == 1 and calls(tmp_path) == 1
    assert native._intact(Path(outs[0])) and no_temporaries(cache)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _stat(pid: str) -> list[str]:
    """State, parent, process group, ... of process `pid` (empty when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return []


def children(pid: int) -> set[int]:
    return {
        int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _stat(p.name)[1:2] == [str(pid)]
    }


def watched(builder: int) -> None:
    """Wait (30 s at most) until `builder` has two children: the compiler and, started right
    after it, whatever takes the compiler down with the builder."""
    deadline = time.monotonic() + 30
    while len(children(builder)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)


def group_gone(pgid: int, within: float = 20.0) -> bool:
    """Whether every process of group `pgid` has ended (zombies count as ended) within `within` s."""
    deadline = time.monotonic() + within
    while any(
        (st := _stat(p.name)) and st[2] == str(pgid) and st[0] not in ("Z", "X")
        for p in Path("/proc").iterdir()
        if p.name.isdigit()
    ):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def gone(pids, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_for(path: Path, within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


# a stand-in compiler that starts a child of its own (as nvcc starts cudafe++, cicc, ptxas) and stalls
STALLS = 'sleep 60 & echo $! > "$(dirname "$0")/grandchild"; printf partial > "$out"; wait'


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_builder_takes_its_compiler_and_the_compilers_children_down(sig, tmp_path):
    script = fake_nvcc(tmp_path, STALLS)
    env = {
        **os.environ,
        "AXKERN_CACHE_DIR": str(tmp_path / "cache"),
        "AXKERN_NVCC": str(script),
        "JAX_PLATFORMS": "cpu",
    }
    code = "from axkern.core import native; native.build('moe', (9, 0))"
    builder = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        wait_for(tmp_path / "grandchild")
        compiler, child = (
            int((tmp_path / "calls").read_text().split()[0]),
            int((tmp_path / "grandchild").read_text()),
        )
        assert alive(compiler) and alive(child)
        watched(builder.pid)
        builder.send_signal(sig)
        builder.wait(30)
        assert gone([compiler, child]), "the compiler outlived its builder"
    finally:
        if builder.poll() is None:
            builder.kill()
            builder.wait()
        for f in ("calls", "grandchild"):
            for pid in (tmp_path / f).read_text().split() if (tmp_path / f).exists() else ():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_build_never_removes_the_folder_a_live_compiler_writes_into(tmp_path, monkeypatch):
    # a compiler that outlived its builder (here: a builder whose compiler was not taken down
    # with it) still writes into its temporary folder: the next build leaves that folder alone
    script = fake_nvcc(tmp_path, 'if [ -n "$FAKE_NVCC_STALL" ]; then ' + STALLS + "; fi\n" + WRITES_A_FILE)
    cache = tmp_path / "cache"
    env = {**os.environ, "AXKERN_CACHE_DIR": str(cache), "AXKERN_NVCC": str(script), "JAX_PLATFORMS": "cpu"}
    code = "from axkern.core import native; native.build('moe', (9, 0))"
    builder = subprocess.Popen([sys.executable, "-c", code], env={**env, "FAKE_NVCC_STALL": "1"})
    try:
        wait_for(tmp_path / "grandchild")
        compiler = int((tmp_path / "calls").read_text().split()[0])
        watched(builder.pid)
        for pid in children(builder.pid) - {compiler}:  # what would take the compiler down with it
            os.kill(pid, signal.SIGKILL)
        builder.kill()
        builder.wait(30)
        orphan = int((tmp_path / "calls").read_text().split()[0])
        assert alive(orphan)
        (live,) = cache.glob(".tmp-*")
        monkeypatch.setenv("AXKERN_NVCC", str(script))
        path = native.build("moe", (9, 0))
        assert native._intact(path)
        assert (live / "libmoe.so").read_bytes() == b"partial", "a live compiler's folder was removed"
    finally:
        if builder.poll() is None:
            builder.kill()
            builder.wait()
        with contextlib.suppress(ProcessLookupError, FileNotFoundError, ValueError):
            os.killpg(int((tmp_path / "calls").read_text().split()[0]), signal.SIGKILL)
    assert group_gone(orphan)
    path.parent.joinpath("libmoe.so").write_bytes(b"changed")  # the next build of the entry
    native.build("moe", (9, 0))
    assert no_temporaries(cache), "the dead compiler's folder stayed"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_info_stops_a_hanging_nvcc_and_its_children(tmp_path, monkeypatch):
    from axkern.cli import info

    fake_nvcc(tmp_path, WRITES_A_FILE, version='sleep 60 & echo $! > "$(dirname "$0")/grandchild"; wait')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("AXKERN_NVCC_TIMEOUT", "0.5")
    start = time.monotonic()
    line = info._nvcc()
    assert time.monotonic() - start < 20
    assert "did not finish within 0.5 s" in line, line
    child = int((tmp_path / "grandchild").read_text())
    assert gone([child]), "nvcc --version's child outlived the timeout"


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "Infinity", "0", "-1", "1e300", "soon", "1 h"])
def test_a_timeout_that_is_not_a_positive_finite_number_is_an_error_naming_it(raw, tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, WRITES_A_FILE)))
    monkeypatch.setenv("AXKERN_NVCC_TIMEOUT", raw)
    with pytest.raises(
        ValueError, match=rf"AXKERN_NVCC_TIMEOUT={raw!r}: expected a positive number of seconds"
    ):
        native.build("moe", (9, 0))
    assert calls(tmp_path) == 0


def test_nvcc_output_that_is_not_utf8_is_read_and_named(tmp_path, monkeypatch):
    latin1 = "printf 'caf\\351 \\377\\n'"
    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, latin1 + " >&2; exit 2", version=latin1)))
    with pytest.raises(Unsupported, match="nvcc failed building moe \\(exit status 2\\): caf\ufffd \ufffd"):
        native.build("moe", (9, 0))
    monkeypatch.setenv(
        "AXKERN_NVCC", str(fake_nvcc(tmp_path, latin1 + " >&2; " + WRITES_A_FILE, version=latin1))
    )
    assert native._intact(native.build("moe", (9, 0)))


@pytest.mark.parametrize("digest", [b"\xff\xfe\x00 not text", b"", b"\n"])
def test_a_digest_overwritten_with_other_bytes_is_a_rebuild(digest, tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_NVCC", str(fake_nvcc(tmp_path, WRITES_A_FILE)))
    path = native.build("moe", (9, 0))
    path.with_suffix(".sha256").write_bytes(digest + os.urandom(32))
    assert native.build("moe", (9, 0)) == path and calls(tmp_path) == 2
    assert native._intact(path)
