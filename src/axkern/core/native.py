"""Native CUDA kernels: build with nvcc on first use, cache, load with cffi, register with XLA FFI.

Sources live in the top-level `native/<name>/` folder of the repository (shared headers in
`native/common/`); the wheel ships them as `axkern/_native/`. A library is compiled for the
visible GPU's architecture (`-gencode=arch=compute_90a,code=sm_90a` on Hopper) into
`<cache>/<sha256 of sources, flags, nvcc, jaxlib>/`, where `<cache>` is `AXKERN_CACHE_DIR` or
the user cache directory (`~/.cache/axkern/native` on Linux). A build runs under a file lock
(`filelock`), so processes sharing the cache build once, in a temporary folder that is moved
into place when complete. The compiler runs in a process group of its own, which a watcher
process kills when the builder dies (even by SIGKILL), so no nvcc, cudafe++ or ptxas outlives
its builder. The compiler and its children hold a lock on the temporary folder: the next
build removes a folder left by a killed build only when no process holds it. Beside the `.so`
lies its sha256: an entry whose bytes do not match (or whose digest is not one) is rebuilt,
never loaded. The library is loaded with `cffi.FFI().dlopen`; each handler's address is wrapped in
`jax.ffi.pycapsule` and registered with `jax.ffi.register_ffi_target(..., platform="CUDA")`.

Environment: `AXKERN_NVCC` (the compiler; else `$CUDA_HOME/bin/nvcc`, else `nvcc` on PATH),
`AXKERN_NVCC_TIMEOUT` (seconds before a build is stopped, default 600; a number that is not
positive and finite, or above 1e6, is a `ValueError`), `AXKERN_CACHE_DIR`.

No nvcc, no GPU, an unknown arch, a failed, hanging or unrunnable compiler, a cache that cannot
be written or locked, a library that does not load: `Unsupported` with the reason, remembered
for the process (`load` does not retry), never a crash.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import filelock
import platformdirs

from . import backend
from .op import Unsupported

__all__ = [
    "Library",
    "LIBRARIES",
    "Unsupported",
    "nvcc",
    "arch_flags",
    "cache_root",
    "build_timeout",
    "run_compiler",
    "source_dir",
    "build",
    "load",
    "unavailable",
    "status",
]

DEFAULT_TIMEOUT = 600.0  # seconds; stops a hung compiler (docs/decisions.md, "MoE and core")
MAX_TIMEOUT = 1e6  # seconds: what the waits below can take (a poll's milliseconds fit a C int)


@dataclasses.dataclass(frozen=True)
class Library:
    """One shared library: its source folder under `native/` and the FFI handlers it exports."""

    name: str
    handlers: tuple[str, ...]


LIBRARIES = {
    "moe": Library(
        "moe",
        (
            "AxkernMoeRoute",
            "AxkernMoeDispatch",
            "AxkernMoeGatherSum",
            "AxkernMoeCombineBwd",
            "AxkernMoeLayout",
        ),
    ),
    "moe_ep": Library("moe_ep", ("AxkernEpDispatch", "AxkernEpGatherSum", "AxkernEpCombineBwd")),
    "short_conv": Library("short_conv", ("AxkernShortConvFwd", "AxkernShortConvBwd")),
}


def source_dir() -> Path:
    """The CUDA sources: `axkern/_native/` in an installed wheel, `native/` beside `src/` in a checkout."""
    package = Path(__file__).resolve().parents[1]
    candidates = (package / "_native", package.parents[1] / "native")
    for folder in candidates:
        if (folder / "common").is_dir():
            return folder
    raise Unsupported(f"the CUDA sources are missing: neither {candidates[0]} nor {candidates[1]} exists")


def sources(lib: Library) -> list[Path]:
    folder = source_dir() / lib.name
    return (
        sorted(folder.glob("*.cu"))
        + sorted(folder.glob("*.cuh"))
        + sorted((source_dir() / "common").glob("*.cuh"))
    )


def nvcc() -> str | None:
    """Path of nvcc: `AXKERN_NVCC`, then `$CUDA_HOME/bin/nvcc` (or `$CUDA_PATH`), then PATH; or None."""
    explicit = os.environ.get("AXKERN_NVCC", "").strip()
    if explicit:
        return explicit  # not checked here: a path that cannot run is a reason naming it
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build_timeout() -> float:
    """Seconds an nvcc run may take before it is stopped: `AXKERN_NVCC_TIMEOUT`, default 600.
    A value that is not a number of seconds in (0, 1e6] is a `ValueError` naming the variable."""
    raw = os.environ.get("AXKERN_NVCC_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT:  # NaN and infinities too
        raise ValueError(
            f"AXKERN_NVCC_TIMEOUT={raw!r}: expected a positive number of seconds, at most {MAX_TIMEOUT:g}"
        )
    return value


# Kills the compiler's process group (argv[1]) unless the builder writes "done" on its standard
# input before closing it: a builder that dies, even by SIGKILL, closes it without a word.
_WATCHER = """
import os, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
if sys.stdin.read() != "done":
    try:
        os.killpg(int(sys.argv[1]), signal.SIGKILL)
    except OSError:
        pass
"""


def _watch(group: int) -> subprocess.Popen | None:
    """A process that kills process group `group` when this process dies (see `_WATCHER`)."""
    if not sys.executable:
        return None
    try:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHER, str(group)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:
        return None


def _release(watcher: subprocess.Popen | None) -> None:
    if watcher is None:
        return
    with contextlib.suppress(OSError):
        watcher.stdin.write(b"done")
    with contextlib.suppress(OSError):
        watcher.stdin.close()
    watcher.wait()


def run_compiler(cmd: list[str], timeout: float, keep: tuple[int, ...] = ()) -> tuple[int, str, str]:
    """Run nvcc: its exit status, stdout and stderr (decoded as UTF-8, bytes that are not
    replaced). A compiler that cannot start or does not finish within `timeout` seconds is an
    `Unsupported` naming it. It runs in a process group of its own, which is killed on a timeout,
    on an exception here (Ctrl-C) and, through a watcher process, when this process dies, so that
    its children (cudafe++, cicc, ptxas) never outlive it. It inherits the descriptors `keep`."""
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            encoding="utf-8",
            errors="replace",
            start_new_session=True,
            pass_fds=keep,
        )
    except OSError as e:
        raise Unsupported(
            f"nvcc at {cmd[0]} cannot be run ({type(e).__name__}: {e.strerror or e}); "
            "set AXKERN_NVCC or CUDA_HOME to a working one"
        ) from e
    watcher = _watch(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as e:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            raise Unsupported(
                f"nvcc at {cmd[0]} did not finish within {timeout:g} s and was stopped "
                "(AXKERN_NVCC_TIMEOUT sets the limit)"
            ) from None
        raise
    finally:
        _release(watcher)
    return proc.returncode, out, err


@functools.cache
def _nvcc_version(path: str, timeout: float) -> str:
    code, out, _ = run_compiler([path, "--version"], timeout)
    return out.strip().splitlines()[-1] if code == 0 and out.strip() else "unknown"


def arch_flags(cc: tuple[int, int]) -> list[str]:
    """nvcc target flags for a compute capability; `a` variants (wgmma, setmaxnreg) on 9.0 and 10.x."""
    major, minor = cc
    if major < 7:
        raise Unsupported(f"compute capability {major}.{minor} is older than 7.0, which the kernels need")
    suffix = "a" if (major, minor) in ((9, 0), (10, 0), (10, 1)) else ""
    return [f"-gencode=arch=compute_{major}{minor}{suffix},code=sm_{major}{minor}{suffix}"]


def cache_root() -> Path:
    """`AXKERN_CACHE_DIR`, else `native/` in the user cache directory (`~/.cache/axkern/native` on Linux)."""
    return Path(os.environ.get("AXKERN_CACHE_DIR") or platformdirs.user_cache_path("axkern") / "native")


def _jax_include() -> str:
    import jax

    return jax.ffi.include_dir()


def _key(lib: Library, flags: list[str], version: str) -> str:
    import jaxlib

    h = hashlib.sha256()
    for path in sources(lib):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(version.encode())
    h.update(jaxlib.__version__.encode())
    return h.hexdigest()[:32]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(path: Path) -> bool:
    """A cache entry is intact when its bytes match the digest written beside it at build time.
    (Not "dlopen works": a truncated library can kill the process inside dlopen.) The digest is
    compared as bytes: a sidecar holding anything else is a mismatch, not a decoding error."""
    sidecar = path.with_suffix(".sha256")
    return path.is_file() and sidecar.is_file() and sidecar.read_bytes().strip() == _digest(path).encode()


_COMPILING = ".compiling"  # in a temporary folder: locked by its builder and the compiler's processes


def _in_use(folder: Path) -> bool:
    """Whether a live process (a compiler that outlived its builder) holds `folder`'s lock."""
    try:
        fd = os.open(folder / _COMPILING, os.O_RDWR)
    except OSError:  # none: its builder died before it started the compiler
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _library(lib: str | Library) -> Library:
    if isinstance(lib, Library):
        return lib
    if lib not in LIBRARIES:
        raise ValueError(f"unknown native library {lib!r}; the libraries are {sorted(LIBRARIES)}")
    return LIBRARIES[lib]


def build(lib: str | Library, cc: tuple[int, int] | None = None, *, nvcc_path: str | None = None) -> Path:
    """Path of library `lib`'s `.so` for compute capability `cc`, compiled now unless an intact copy is cached.

    Needs nvcc, not a GPU: `build("moe", (9, 0))` compiles for Hopper on any machine; without
    `cc` the visible GPU's is used. Every failure is an `Unsupported` with the reason."""
    lib = _library(lib)
    if cc is None:
        cc = backend.compute_capability()
        if cc is None:
            raise Unsupported("no CUDA GPU visible to build for; pass a compute capability such as (9, 0)")
    nvcc_path = nvcc_path or nvcc()
    if nvcc_path is None:
        raise Unsupported("nvcc not found (set AXKERN_NVCC or CUDA_HOME, or put nvcc on PATH)")
    flags = arch_flags(cc)
    timeout = build_timeout()
    root = cache_root()
    key = _key(lib, flags, _nvcc_version(nvcc_path, timeout))
    target = root / key / f"lib{lib.name}.so"
    lock = root / f"{key}.lock"
    try:
        if _intact(target):
            return target
        root.mkdir(parents=True, exist_ok=True)
        # a waiter gives up only after the holder's own build would have been stopped
        with filelock.FileLock(lock, timeout=2 * timeout + 60):
            for stale in root.glob(f".tmp-{key}-*"):  # left by a build that was killed
                if not _in_use(stale):
                    shutil.rmtree(stale, ignore_errors=True)
            if not _intact(target):  # absent, corrupt, or built by another process while we waited
                _compile(lib, flags, nvcc_path, timeout, root, key)
    except filelock.Timeout as e:
        raise Unsupported(
            f"another process held the build lock {lock} for over {2 * timeout + 60:g} s"
        ) from e
    except OSError as e:
        raise Unsupported(
            f"the native build cache {root} cannot be used ({type(e).__name__}: {e}); it must be a "
            "writable directory on a filesystem with file locks: set AXKERN_CACHE_DIR to one"
        ) from e
    return target


def _compile(lib: Library, flags: list[str], nvcc_path: str, timeout: float, root: Path, key: str) -> None:
    """Compile into a fresh temporary folder and move it into place as `root/key` (under the lock)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
    lock = os.open(tmp / _COMPILING, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held by the compiler's processes too (`keep`)
        so = tmp / f"lib{lib.name}.so"
        cmd = [
            nvcc_path,
            "-std=c++17",
            "-O3",
            "-shared",
            "-Xcompiler",
            "-fPIC",
            *flags,
            "-isystem",
            _jax_include(),
            "-I",
            str(source_dir() / "common"),
            *[str(p) for p in sources(lib) if p.suffix == ".cu"],
            "-o",
            str(so),
        ]
        code, out, err = run_compiler(cmd, timeout, keep=(lock,))
        if code != 0:
            first = "\n".join(err.strip().splitlines()[:8])
            raise Unsupported(f"nvcc failed building {lib.name} (exit status {code}): {first}")
        if not so.is_file():
            raise Unsupported(f"nvcc exited 0 building {lib.name} but wrote no {so.name}")
        so.with_suffix(".sha256").write_text(_digest(so) + "\n")
        (tmp / "build.log").write_text(" ".join(cmd) + "\n" + out + err)
        # readable by the owner's group and others, as a shared cache needs (mkdtemp makes 0700)
        for path, mode in (
            (so, 0o755),
            (so.with_suffix(".sha256"), 0o644),
            (tmp / "build.log", 0o644),
            (tmp, 0o755),
        ):
            path.chmod(mode)
        (tmp / _COMPILING).unlink()
        folder = root / key
        if folder.exists():  # a corrupt entry: replaced whole, never rewritten in place (a mapped
            shutil.rmtree(folder)  # copy in a running process keeps its own inode)
        os.replace(tmp, folder)
    finally:
        os.close(lock)
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when moved into place


def _open(path: Path, lib: Library):
    """dlopen `path` after checking its bytes against its digest (a mismatch is never loaded)."""
    import cffi

    if not _intact(path):
        raise Unsupported(f"{path} does not match the sha256 beside it (changed after it was built)")
    ffi = cffi.FFI()
    ffi.cdef("".join(f"void* {h}(void*);" for h in lib.handlers))
    return ffi, ffi.dlopen(str(path))


@functools.cache
def _registered(name: str, cc: tuple[int, int]) -> tuple[str, ...]:
    import jax

    lib = LIBRARIES[name]
    path = build(lib, cc)
    ffi, handle = _open(path, lib)
    for h in lib.handlers:
        address = int(ffi.cast("uintptr_t", getattr(handle, h)))
        fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(address)
        jax.ffi.register_ffi_target(h, jax.ffi.pycapsule(fn), platform="CUDA")
    _handles.append((ffi, handle))  # keep the library loaded
    return lib.handlers


_handles: list = []
_failed: dict[tuple[str, tuple[int, int]], str] = {}  # a failed build or load is not retried in this process


def load(name: str) -> tuple[str, ...]:
    """Build (if needed), load and register library `name` for the visible GPU; its FFI target names.

    A build or load that fails for any reason is an `Unsupported` with the reason, remembered
    for the rest of the process: every later call raises the same reason at once (so an op
    that falls back warns once) instead of running nvcc again."""
    _library(name)
    if backend.platform() != "gpu":
        raise Unsupported(f"no CUDA GPU visible (platform {backend.platform()})")
    cc = backend.compute_capability()
    if cc is None:
        raise Unsupported("the GPU reports no CUDA compute capability (not an NVIDIA GPU?)")
    build_timeout()  # a malformed setting is the user's error to fix, not a fallback
    if (name, cc) in _failed:
        raise Unsupported(_failed[(name, cc)])
    try:
        return _registered(name, cc)
    except Exception as e:
        detail = str(e) if isinstance(e, Unsupported) else f"{type(e).__name__}: {e}"
        reason = f"native library {name!r}: {detail} (not retried in this process)"
        _failed[(name, cc)] = reason
        raise Unsupported(reason) from e


def unavailable(name: str) -> str | None:
    """Why library `name` cannot be used here (`load`'s reason; built on first use), or None:
    what an implementation's `supports` returns last."""
    try:
        load(name)
    except Unsupported as e:
        return str(e)
    return None


def status() -> dict[str, str]:
    """A line per library for `axkern info`: loaded, or why not."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = "loaded: " + ", ".join(load(name))
        except Unsupported as e:
            out[name] = f"unavailable: {e}"
    return out
