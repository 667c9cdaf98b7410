"""Temporary memory of an op's programs compiled for a GPU on a machine without one: each
implementation's forward and forward+backward at a bench preset, as `axkern bench` builds them
(the same cases, cotangent and dispatcher), compiled by XLA's GPU compiler for a described
device (a GPU target configuration: `--target h200` or `h100`) and read back with
`compiled.memory_analysis()`, the figure `axkern bench` reports as `temp_gib`. Nothing runs:
the numbers are XLA's buffer assignment for that device, not a measurement of a run (XLA
compiles without autotuning here, which can move a figure a little: docs/ops/ssd.md compares
the two on an H200).

Needs JAX's CUDA plugin at jax's own version beside jax (`pip install jax-cuda13-plugin==V
jax-cuda13-pjrt==V`; no GPU, driver or CUDA install): XLA's GPU compiler and its deviceless
topology. The dispatcher sees the described GPU (`axkern.core.backend`'s default device), Pallas'
Triton lowering its compute capability.

`--target v5e` compiles for a TPU v5e chip instead, with libtpu's compiler and deviceless
topology (libtpu at jax's pin beside jax: `pip install 'jax[tpu]==V'`; no chip): the dispatcher
sees that chip, Pallas' Mosaic lowering its facts (a one-device abstract mesh of its kind). On
the chip `axkern bench` reported the same bytes for the same tree (SSD at the 2.7B layer).

    OUT=<folder> python3 benchmarks/diagnostics/compiled_memory.py ssd mamba2_2.7b --impl mosaic_gpu

writes `$OUT/compiled_memory_<op>_<preset>.json` and prints each row. `--only TEXT` keeps the
cases whose label contains it; `--blocks IMPL:FIELD=VALUE` runs an implementation with those
block-size fields over those the dispatcher picks (`bench.replaced_blocks`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sys
from pathlib import Path
from unittest import mock

import jax

from axkern import bench
from axkern.core import backend

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests`
from tests.gpu_lowering import as_cuda  # noqa: E402 - after the root is on the path

# GPU target configurations (XLA's `stream_executor.GpuTargetConfigProto`, text form): the device
# facts XLA's compiler reads (compute capability, shared memory, SMs, memory size); the
# spellings `device_description_str` gives are JAX's device kinds
_TARGET = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{name}"
"""
TARGETS = {
    "h200": _TARGET.format(bandwidth=4800000000000, memory=151397597184, name="NVIDIA H200"),
    "h100": _TARGET.format(bandwidth=3352000000000, memory=85520809984, name="NVIDIA H100 80GB HBM3"),
}
# TPU targets: a chip of libtpu's deviceless topology (the smallest it describes; a program on
# one device compiles as on a one-chip machine of that generation)
TPU_TARGETS = {"v5e": "v5e:2x2"}


def target_device(target: str) -> jax.Device:
    """A compile-only device of `target` (a key of `TARGETS` or `TPU_TARGETS`)."""
    return tpu_device(target) if target in TPU_TARGETS else gpu_device(target)


def tpu_device(target: str) -> jax.Device:
    """A compile-only TPU chip of `target` (a key of `TPU_TARGETS`), from libtpu's deviceless
    topology: its compiler, no chip."""
    from jax.experimental import topologies

    # libtpu reads the machine's accelerator from the environment; none is here
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    try:
        topology = topologies.get_topology_desc(TPU_TARGETS[target], "tpu")
    except Exception as e:  # noqa: BLE001 - say what is missing
        raise SystemExit(
            f"no deviceless TPU topology here ({type(e).__name__}: {str(e)[:200]}); it needs libtpu at "
            f"jax's pin: pip install 'jax[tpu]=={jax.__version__}' (or that libtpu beside jax)"
        ) from e
    return topology.devices[0]


def gpu_device(target: str) -> jax.Device:
    """A compile-only CUDA device of `target` (a key of `TARGETS`), from the CUDA plugin's
    deviceless topology."""
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            "", platform="cuda", target_config=TARGETS[target], topology="1x1x1"
        )
    except Exception as e:  # noqa: BLE001 - say what is missing
        raise SystemExit(
            f"no deviceless CUDA topology here ({type(e).__name__}: {str(e)[:200]}); it needs JAX's CUDA "
            f"plugin at jax's version: pip install jax-cuda13-plugin=={jax.__version__} "
            f"jax-cuda13-pjrt=={jax.__version__}"
        ) from e
    return topology.devices[0]


@contextlib.contextmanager
def dispatching_for(device: jax.Device):
    """The dispatcher's default device is `device` (a CPU's own default needs nothing), and
    Triton lowers for a Hopper GPU where it is one."""
    if device.platform == "cpu":
        yield
        return
    with mock.patch.object(backend, "_default_device", lambda: device):
        with as_cuda() if device.platform != "tpu" else on_tpu(device):
            yield


def on_tpu(device: jax.Device):
    """Pallas' Mosaic lowering reads the chip's facts from the abstract mesh's device (else from
    the default device, here a CPU): a one-device mesh of `device`'s kind."""
    abstract = jax.sharding.AbstractDevice(device.device_kind, getattr(device, "num_cores", 1), "tpu")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("device",), abstract_device=abstract)
    )


def temp_bytes(fn, args, device: jax.Device) -> dict:
    """`fn(*args)` (`args` arrays or `jax.ShapeDtypeStruct`s) compiled for `device`: its
    `memory_analysis()` sizes in bytes."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    with dispatching_for(device):
        stats = jax.jit(fn).trace(*placed).lower().compile().memory_analysis()
    return {
        "temp": stats.temp_size_in_bytes,
        "arguments": stats.argument_size_in_bytes,
        "outputs": stats.output_size_in_bytes,
    }


def rows(case, impl: str, device: jax.Device) -> list[dict]:
    """The forward's and forward+backward's sizes (GiB) of `case` run by `impl` on `device`, as
    `axkern bench` builds the two programs."""
    with dispatching_for(device):
        shapes = case.shapes()
        cotangent = jax.eval_shape(lambda *a: case.forward("reference", *a), *shapes)
    if case.loss is None:  # a random cotangent pulled back
        both = bench.forward_backward(case, impl), (cotangent, *shapes)
    else:  # the case's loss differentiated
        both = bench.loss_and_grad(case, impl), shapes
    out = []
    for pass_, (fn, args) in (("fwd", (case.forward_for(impl), shapes)), ("fwd+bwd", both)):
        if pass_ not in case.passes:
            continue
        row = {"case": case.label, "implementation": impl, "pass": pass_}
        try:
            sizes = temp_bytes(fn, args, device)
            row.update({f"{k}_gib": v / 2**30 for k, v in sizes.items()})
        except Exception as e:  # noqa: BLE001 - report it and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("op")
    p.add_argument("preset")
    p.add_argument("--tokens", type=int)
    p.add_argument("--impl", required=True, help="comma-separated implementation names")
    p.add_argument("--target", default="h200", choices=sorted(TARGETS) + sorted(TPU_TARGETS))
    p.add_argument("--only", help="the cases whose label contains this text (default: all the preset's)")
    p.add_argument(
        "--blocks",
        help="IMPL:FIELD=VALUE[,FIELD=VALUE]: those fields over the block sizes the dispatcher picks",
    )
    a = p.parse_args()
    device = target_device(a.target)
    out = {
        "command": "OUT=<folder> python3 benchmarks/diagnostics/compiled_memory.py "
        + " ".join(
            [a.op, a.preset]
            + ([f"--tokens {a.tokens}"] if a.tokens else [])
            + [f"--impl {a.impl}", f"--target {a.target}"]
            + ([f"--only {shlex.quote(a.only)}"] if a.only else [])
            + ([f"--blocks {shlex.quote(a.blocks)}"] if a.blocks else [])
        ),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "device": f"{device.device_kind} (compiled for, not run on)",
        "rows": [],
    }
    cases = [c for c in bench.cases_for(a.op, preset=a.preset, tokens=a.tokens) if (a.only or "") in c.label]
    if not cases:
        raise SystemExit(f"no case of {a.op} {a.preset} has {a.only!r} in its label")
    with bench.replaced_blocks(a.op, a.blocks) if a.blocks else contextlib.nullcontext():
        for case in cases:
            for impl in a.impl.split(","):
                for row in rows(case, impl, device):
                    print(json.dumps(row), flush=True)
                    out["rows"].append(row)
    folder = Path(os.environ.get("OUT", "."))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"compiled_memory_{a.op}_{a.preset}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
