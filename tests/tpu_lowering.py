"""Lowering for a TPU on a machine without one: what the Pallas TPU kernels' lowering tests share.

`lower_for_tpu(fn, *args)` traces `fn` as on a TPU and lowers it for the `tpu` platform
(`jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))`). Two things make that work on a
CPU:

- The dispatcher must see a TPU, so that it picks `pallas_tpu` compiled (not in interpret mode)
  with the block sizes it would choose on the chip (the heuristic, or the tuned table of the
  chip's key): `axkern.core.backend`'s default device is replaced, for the call, by a stand-in
  with the TPU's platform and device kind.
- Pallas' Mosaic lowering asks for the chip's facts (`pltpu.get_tpu_info()`: sublanes, lanes,
  generation), which it reads from the current abstract mesh's device, else from the default
  device (a CPU: `Unsupported TPU device kind: cpu`). The call is traced and lowered under a
  one-device abstract mesh whose device is the TPU named.

What the lowering checks: every Pallas-level step (block shapes, the kernel body's primitives
and their Mosaic lowering rules) and the Mosaic dialect's op verifiers, which reject what the
chip's vector unit lacks (e.g. a `bf16` finiteness test on a chip without a `bf16` VPU). What
only the chip's compiler checks (the vector layouts Mosaic infers and applies, VMEM limits)
and the values are `tests/tpu`'s.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from unittest import mock

import jax

from axkern.core import backend

__all__ = [
    "DEFAULT_DEVICE_KIND",
    "as_tpu",
    "lane_sparse_arrays",
    "lower_for_tpu",
    "matmuls",
    "mosaic_kernels",
    "tpu_custom_calls",
]

# the chip the project's kernels were first run on (a one-core TPU v5e)
DEFAULT_DEVICE_KIND = "TPU v5 lite"


@dataclasses.dataclass(frozen=True)
class _Device:
    """What the dispatcher asks of the default device (`axkern.core.backend`)."""

    device_kind: str
    platform: str = "tpu"
    num_cores: int = 1


@contextlib.contextmanager
def as_tpu(device_kind: str = DEFAULT_DEVICE_KIND, num_cores: int = 1) -> Iterator[None]:
    """Trace as on a TPU of `device_kind` (JAX's spelling, e.g. `"TPU v5 lite"`, `"TPU v6 lite"`,
    `"TPU v5p"`): the dispatcher sees the platform `tpu` and that kind, and Pallas' Mosaic
    lowering reads that chip's facts."""
    device = _Device(device_kind, num_cores=num_cores)
    mesh = jax.sharding.AbstractMesh(
        (1,), ("device",), abstract_device=jax.sharding.AbstractDevice(device_kind, num_cores, "tpu")
    )
    with mock.patch.object(backend, "_default_device", lambda: device), jax.sharding.use_abstract_mesh(mesh):
        yield


def lower_for_tpu(fn: Callable, *args, device_kind: str = DEFAULT_DEVICE_KIND) -> jax.stages.Lowered:
    """`fn(*args)` traced as on a TPU of `device_kind` (`as_tpu`) and lowered for the `tpu`
    platform; `args` may be `jax.ShapeDtypeStruct`s. A kernel that breaks a Mosaic rule raises
    here (Pallas' `VerificationError`, a `ValueError` on a block shape); nothing is compiled."""
    with as_tpu(device_kind):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))


def _calls(lowered: jax.stages.Lowered) -> list[str]:
    return re.findall(r"stablehlo\.custom_call @tpu_custom_call\(.*", lowered.as_text())


def tpu_custom_calls(lowered: jax.stages.Lowered) -> list[str]:
    """The names of the Mosaic kernels in a lowered program (`pl.pallas_call(name=...)`), in
    the order the program text holds them."""
    return [m.group(1) for c in _calls(lowered) for m in [re.search(r'kernel_name = "([^"]+)"', c)] if m]


def lane_sparse_arrays(lowered: jax.stages.Lowered, rows: int = 128) -> list[str]:
    """The operand and result types of the Mosaic kernels in a lowered program whose last
    dimension is 1 over at least `rows` rows (e.g. `tensor<1x4x512x1xf32>`): in a TPU's memory the
    last dimension fills 128 lanes, so such an array takes 128 times its values' bytes."""
    out = []
    for call in _calls(lowered):
        for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", call.rsplit(" : ", 1)[-1]):
            shape = [int(d) for d in dims.rstrip("x").split("x")]
            if len(shape) >= 2 and shape[-1] == 1 and shape[-2] >= rows:
                out.append(f"tensor<{dims.rstrip('x')}>")
    return out


def mosaic_kernels(lowered: jax.stages.Lowered) -> list[tuple[str, str]]:
    """`(name, Mosaic module as text)` of each kernel in a lowered program: the serialized body
    of its custom call, parsed back (its ops spelt as serialized, e.g. `stable_mosaic.tpu.matmul`
    with its `precision`)."""
    from jax._src.lib import tpu  # Mosaic's dialect (its memory spaces)
    from jaxlib.mlir import ir

    out = []
    for call in _calls(lowered):
        name = re.search(r'kernel_name = "([^"]+)"', call)
        body = re.search(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22", call)
        if name is None or body is None:
            raise ValueError(f"a TPU custom call without a kernel name or body: {call[:200]}")
        ctx = ir.Context()
        tpu.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True  # the serialized ops' names
        with ctx:
            out.append((name.group(1), str(ir.Module.parse(base64.b64decode(body.group(1))))))
    return out


def matmuls(module: str) -> list[tuple[str, str, str | None]]:
    """`(lhs element type, rhs element type, contract precision or None)` of each Mosaic matmul
    in a kernel's module text (`mosaic_kernels`): e.g. `("f32", "f32", "fp32")`, a float32
    product at full precision; `None`, Mosaic's default."""
    out = []
    for line in module.splitlines():
        if 'tpu.matmul"' not in line:
            continue
        types = re.search(r":\s*\(vector<[^>]*x(\w+)>, vector<[^>]*x(\w+)>", line)
        precision = re.search(r"contract_precision<(\w+)>", line)
        if types is None:
            raise ValueError(f"a matmul whose operand types are not read: {line.strip()[:200]}")
        out.append((types.group(1), types.group(2), precision and precision.group(1)))
    return out
