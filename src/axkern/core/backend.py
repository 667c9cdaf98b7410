"""What we are running on: platform, device kind, compute capability, tuned-table key."""

from __future__ import annotations

import functools
import os
import re

import jax

__all__ = ["platform", "device_kind", "compute_capability", "device_key", "is_hopper", "mosaic_gpu_reason"]


def _default_device() -> jax.Device:
    return jax.devices()[0]


def platform() -> str:
    """The default backend's platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``."""
    p = _default_device().platform
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def device_kind() -> str:
    """The device kind string JAX reports, e.g. ``"NVIDIA H200"``, ``"TPU v5 lite"``, ``"cpu"``."""
    return _default_device().device_kind


def compute_capability() -> tuple[int, int] | None:
    """CUDA compute capability ``(major, minor)`` of the default GPU, or ``None`` off CUDA."""
    dev = _default_device()
    cc = getattr(dev, "compute_capability", None)
    if cc is None:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


_HOPPER_KEYS = ("nvidia_h100", "nvidia_h200", "nvidia_h800", "nvidia_gh200")


def is_hopper(spec) -> bool:
    """Whether a call's GPU is a Hopper (compute capability 9.x): asked of the default device
    on a GPU, else read from the spec's device key (a spec made for another machine)."""
    cc = compute_capability() if platform() == "gpu" else None
    if cc is not None:
        return cc[0] == 9
    return spec.device_key.startswith(_HOPPER_KEYS)


def mosaic_gpu_reason(spec, import_error: Exception | None) -> str | None:
    """Why a Pallas Mosaic GPU kernel of 16-bit operands cannot serve `spec` (its module's
    import failed, not a Hopper GPU, not bf16 or fp16), or None."""
    if import_error is not None:
        return f"jax.experimental.pallas.mosaic_gpu does not import here ({import_error})"
    if spec.platform != "gpu" or not is_hopper(spec):
        return f"the Mosaic GPU kernel needs a Hopper GPU (compute capability 9.x), not {spec.device_kind}"
    if spec.dtype not in ("bfloat16", "float16"):
        return f"the Mosaic GPU kernel takes bf16 or fp16, not {spec.dtype}"
    return None


_DETERMINISTIC_FLAGS = re.compile(
    r"--xla_gpu_(deterministic_ops|exclude_nondeterministic_ops)(=(true|1))?(\s|$)", re.IGNORECASE
)


def deterministic() -> bool:
    """Whether `XLA_FLAGS` asks XLA for run-to-run identical results on GPU
    (`--xla_gpu_deterministic_ops` or `--xla_gpu_exclude_nondeterministic_ops`): kernels whose
    additions' order varies between runs are then not chosen by default."""
    return bool(_DETERMINISTIC_FLAGS.search(os.environ.get("XLA_FLAGS", "")))


_TPU_KINDS = {
    "tpu v5 lite": "tpu_v5e",
    "tpu v5e": "tpu_v5e",
    "tpu v5p": "tpu_v5p",
    "tpu v5": "tpu_v5p",
    "tpu v6 lite": "tpu_v6e",
    "tpu v6e": "tpu_v6e",
    "tpu v4": "tpu_v4",
    "tpu7x": "tpu_v7x",
}


@functools.cache
def key_for(kind: str) -> str:
    """Normalise a device-kind string into the key of a tuned table.

    ``"NVIDIA H200"`` -> ``"nvidia_h200"``, ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia_h100"``,
    ``"TPU v5 lite"`` -> ``"tpu_v5e"``, anything on the host -> ``"cpu"``.
    """
    k = kind.strip().lower()
    if k == "cpu" or k.startswith("cpu"):
        return "cpu"
    if k in _TPU_KINDS:
        return _TPU_KINDS[k]
    m = re.match(r"nvidia\s+(?:geforce\s+)?([a-z]+\d+[a-z]*)", k)
    if m:
        return f"nvidia_{m.group(1)}"
    return re.sub(r"[^a-z0-9]+", "_", k).strip("_")


def device_key() -> str:
    """Key of the tuned block-size tables for the default device (e.g. ``"nvidia_h200"``)."""
    return key_for(device_kind()) if platform() != "cpu" else "cpu"
