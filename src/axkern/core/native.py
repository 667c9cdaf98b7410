"""Native CUDA kernels: build with nvcc on first use, cache, load with cffi, register with XLA FFI.

Sources live in `axkern/native/<name>/` (shared headers in `axkern/native/common/`). A
library is compiled for the visible GPU's architecture (`-gencode=arch=compute_90a,code=sm_90a`
on Hopper) into `~/.cache/axkern/native/<sha256 of sources, flags, nvcc, jaxlib>/` (override
with `AXKERN_CACHE_DIR`), under a file lock so parallel processes build once, and moved into
place atomically. It is loaded with `cffi.FFI().dlopen`; each handler's address is wrapped in
`jax.ffi.pycapsule` and registered with `jax.ffi.register_ffi_target(..., platform="CUDA")`.

No nvcc, no GPU, an unknown arch, a failed build, a cache that cannot be written or locked:
`Unsupported` with the reason, never a crash. A cache entry that does not load is deleted and rebuilt.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import importlib.resources
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import backend
from .op import Unsupported

__all__ = ["Library", "LIBRARIES", "nvcc", "arch_flags", "cache_root", "build", "load", "status"]


@dataclasses.dataclass(frozen=True)
class Library:
    """One shared library: its source folder under `axkern/native/` and the FFI handlers it exports."""

    name: str
    handlers: tuple[str, ...]


LIBRARIES = {
    "moe": Library(
        "moe",
        (
            "AxkernMoeRoute",
            "AxkernMoeScatterRows",
            "AxkernMoeGatherSum",
            "AxkernMoeCombineBwd",
            "AxkernMoeLayout",
        ),
    ),
    "short_conv": Library("short_conv", ("AxkernShortConvFwd", "AxkernShortConvBwd")),
}


def source_dir() -> Path:
    return Path(str(importlib.resources.files("axkern").joinpath("native")))


def sources(lib: Library) -> list[Path]:
    folder = source_dir() / lib.name
    return (
        sorted(folder.glob("*.cu"))
        + sorted(folder.glob("*.cuh"))
        + sorted((source_dir() / "common").glob("*.cuh"))
    )


def nvcc() -> str | None:
    """Path of nvcc (`$CUDA_HOME/bin`, then PATH), or None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


@functools.cache
def _nvcc_version(path: str) -> str:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else "unknown"


def arch_flags(cc: tuple[int, int]) -> list[str]:
    """nvcc target flags for a compute capability; `a` variants (wgmma, setmaxnreg) on 9.0 and 10.x."""
    major, minor = cc
    if major < 7:
        raise Unsupported(f"compute capability {major}.{minor} is older than 7.0, which the kernels need")
    suffix = "a" if (major, minor) in ((9, 0), (10, 0), (10, 1)) else ""
    return [f"-gencode=arch=compute_{major}{minor}{suffix},code=sm_{major}{minor}{suffix}"]


def cache_root() -> Path:
    return Path(os.environ.get("AXKERN_CACHE_DIR") or Path.home() / ".cache" / "axkern" / "native")


def _jax_include() -> str:
    import jax

    return jax.ffi.include_dir()


def _key(lib: Library, flags: list[str], nvcc_path: str) -> str:
    import jaxlib

    h = hashlib.sha256()
    for path in sources(lib):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(_nvcc_version(nvcc_path).encode())
    h.update(jaxlib.__version__.encode())
    return h.hexdigest()[:32]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(path: Path) -> bool:
    """A cache entry is intact when its bytes match the digest written beside it after the build
    (not "dlopen works": a process that already loaded a path gets the old mapping back)."""
    sidecar = path.with_suffix(".sha256")
    return path.is_file() and sidecar.is_file() and sidecar.read_text().strip() == _digest(path)


def _open(path: Path, lib: Library):
    import cffi

    ffi = cffi.FFI()
    ffi.cdef("".join(f"void* {h}(void*);" for h in lib.handlers))
    return ffi, ffi.dlopen(str(path))


@contextlib.contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(lib: Library, cc: tuple[int, int], *, nvcc_path: str | None = None) -> Path:
    """The library's `.so` for `cc`, compiled now unless a loadable cached copy exists."""
    nvcc_path = nvcc_path or nvcc()
    if nvcc_path is None:
        raise Unsupported("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    flags = arch_flags(cc)
    folder = cache_root() / _key(lib, flags, nvcc_path)
    target = folder / f"lib{lib.name}.so"
    if _intact(target):
        return target
    with _lock(folder.with_suffix(".lock")):
        if _intact(target):  # another process built it while we waited
            return target
        target.unlink(missing_ok=True)  # absent or corrupt: (re)build it
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
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
            tmp,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            Path(tmp).unlink(missing_ok=True)
            first = "\n".join(proc.stderr.strip().splitlines()[:8])
            raise Unsupported(f"nvcc failed building {lib.name}: {first}")
        Path(tmp).with_suffix(".sha256").write_text(_digest(Path(tmp)))
        os.replace(Path(tmp).with_suffix(".sha256"), target.with_suffix(".sha256"))
        os.replace(tmp, target)  # atomic: readers see no half-written library
        with open(folder / "build.log", "a") as log:
            log.write(" ".join(cmd) + "\n")
    return target


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
_failed: dict[tuple[str, tuple[int, int]], str] = {}  # a failed build is not retried in this process


def load(name: str) -> tuple[str, ...]:
    """Build (if needed), load and register library `name` for the visible GPU; its FFI target names.

    A build or load that fails is an `Unsupported` with the reason, remembered for the rest of
    the process so that every later call falls back at once instead of running nvcc again."""
    if backend.platform() != "gpu":
        raise Unsupported(f"no CUDA GPU visible (platform {backend.platform()})")
    cc = backend.compute_capability()
    if cc is None:
        raise Unsupported("the GPU reports no CUDA compute capability (not an NVIDIA GPU?)")
    if (name, cc) in _failed:
        raise Unsupported(_failed[(name, cc)])
    try:
        return _registered(name, cc)
    # a cache that cannot be written or locked (read-only, full, a filesystem without locks)
    except OSError as e:
        reason = (
            f"native library {name!r}: {e} (the build cache {cache_root()} must be writable and support "
            "file locks; set AXKERN_CACHE_DIR to one that does)"
        )
        _failed[(name, cc)] = f"{reason} (failed earlier in this process; not retried)"
        raise Unsupported(reason) from e
    except Unsupported as e:
        _failed[(name, cc)] = f"{e} (failed earlier in this process; not retried)"
        raise


def status() -> dict[str, str]:
    """A line per library for `axkern info`: loaded, or why not."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = "loaded: " + ", ".join(load(name))
        except Unsupported as e:
            out[name] = f"unavailable: {e}"
    return out
