"""Lowering for a CUDA GPU on a machine without one: what the GPU kernels' lowering tests share.

`lower_for_cuda(fn, *args)` traces `fn` and lowers it for the `cuda` platform
(`jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))`) under an abstract mesh of no axes
whose device is a Hopper GPU (`as_cuda`). Pallas' Triton lowering asks for the GPU's compute
capability: jax 0.10 lowers without it, jax 0.11 reads it from the current abstract mesh's
device, else from the default device (a CPU: "No supported GPU devices found"). Mosaic GPU kernels
lower either way.

What the lowering checks: every Pallas-level step (block shapes, the kernel bodies' primitives and
their Triton or Mosaic GPU lowering rules). What only the GPU's compiler checks (Triton's and
Mosaic GPU's passes to PTX, shared memory at run time) and the values are `tests/gpu`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax

__all__ = ["DEFAULT_DEVICE_KIND", "as_cuda", "lower_for_cuda"]

# the GPU the project's Hopper kernels run on (JAX's spelling of its device kind)
DEFAULT_DEVICE_KIND = "NVIDIA H200"
_SMS = 132


@contextlib.contextmanager
def as_cuda(device_kind: str = DEFAULT_DEVICE_KIND) -> Iterator[None]:
    """Trace under an abstract mesh (no axes) whose device is a CUDA GPU of `device_kind`, so
    that Pallas' Triton lowering reads that GPU's compute capability."""
    device = jax.sharding.AbstractDevice(device_kind, _SMS, "gpu")
    # no axes: the device alone (a mesh axis would give the traced values shardings in their types)
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lower_for_cuda(fn: Callable, *args, device_kind: str = DEFAULT_DEVICE_KIND) -> jax.stages.Lowered:
    """`fn(*args)` traced under `as_cuda(device_kind)` and lowered for the `cuda` platform;
    `args` may be `jax.ShapeDtypeStruct`s. Nothing is compiled."""
    with as_cuda(device_kind):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
