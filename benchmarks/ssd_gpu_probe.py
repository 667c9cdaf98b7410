"""Where does the `pallas_gpu` SSD forward spend its time? (a diagnostic, not a benchmark table)

    python benchmarks/ssd_gpu_probe.py --json out.json

The Mamba-2 2.7B layer (B=4 L=4096 H=80 P=64 N=128, bf16) forward, timed with variants:
chunk 32/64, Triton `num_warps` 4/8, and float32 products at full precision (as shipped)
against TF32 (`precision=DEFAULT`), beside `xla`. Each variant's output is compared with the
shipped kernel's.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from axkern.bench import time_ms
from axkern.core import kernels
from axkern.ops.ssd import chunk_kernels, pallas_gpu
from axkern.ops.ssd.arg_specs import cases
from axkern.ops.ssd.blocks import SSDBlockSizes
from axkern.positional import ssd


def _tf32_dot(a, b, dtype=None, *, trans_a=False, trans_b=False):
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    dtype = jnp.dtype(dtype or a.dtype)
    return lax.dot_general(a.astype(dtype), b.astype(dtype), dims, preferred_element_type=jnp.float32)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    c = cases(preset="mamba2_2.7b")[0]
    args = c.make(jax.random.PRNGKey(0))
    x, dt, A, B, C = args
    rows = []

    def run(label, impl="pallas_gpu", chunk=64):
        fn = jax.jit(
            lambda *z: ssd(
                *z, dt_softplus=True, implementation=impl, block_sizes=SSDBlockSizes(chunk_size=chunk)
            )
        )
        try:
            out = jax.block_until_ready(fn(*args))
            ms = time_ms(fn, args, repeats=a.repeats)
        except Exception as e:
            row = {"variant": label, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        else:
            row = {"variant": label, "ms": ms}
            if rows and "out" in rows[0]:
                ref = rows[0]["out"]
                row["max_abs_diff_vs_first"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
            else:
                row["out"] = out.astype(jnp.float32)
        print(json.dumps({k: v for k, v in row.items() if k != "out"}), flush=True)
        rows.append(row)

    run("xla chunk 256", impl="xla", chunk=256)
    run("pallas_gpu chunk 64 (shipped)")
    run("pallas_gpu chunk 32", chunk=32)
    base_params = pallas_gpu.GpuLayout.call_params
    for warps in (4, 8):
        pallas_gpu.GpuLayout.call_params = lambda self, w=warps: {
            "interpret": self.interpret,
            "compiler_params": plgpu.CompilerParams(num_warps=w, num_stages=2),
        }
        run(f"pallas_gpu chunk 64 num_warps={warps}")
    pallas_gpu.GpuLayout.call_params = base_params
    chunk_kernels._dot = _tf32_dot
    run("pallas_gpu chunk 64 tf32 products")
    run("pallas_gpu chunk 32 tf32 products", chunk=32)
    chunk_kernels._dot = kernels.dot
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "jax": jax.__version__,
                    "device": jax.devices()[0].device_kind,
                    "rows": [{k: v for k, v in r.items() if k != "out"} for r in rows],
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
