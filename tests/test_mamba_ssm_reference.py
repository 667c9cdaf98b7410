"""mamba3's float64 oracle (axkern's `reference`) against mamba_ssm's own torch reference of the
Mamba-3 SISO recurrence, `mamba3_siso_step_ref`, on shared inputs: values, final states and every
gradient (the initial states' among them). A different convention (angles and their wrap, the
trapezoid's shift, the states' layouts, the gate) would show as errors of order one; the two
agree to float64 rounding, less the float32 cotangent both take.

The reference lives in upstream's `tests/ops/triton/test_mamba3_siso.py` (state-spaces/mamba), not
in this repository or its peers: put the folder holding that file, and the `mamba_ssm` package
it imports (`../shared/peers/mamba_ssm_triton`), on `PYTHONPATH`. It runs in a subprocess of the
interpreter named by `MAMBA_SSM_PYTHON` (one with torch, einops and triton; the CPU build of
torch serves), else this one; the test skips, saying why, when the import fails.
"""

from __future__ import annotations

import os
import sys
import textwrap

import numpy as np

from tests.cases.mamba3 import make
from tests.gpu.test_mamba3_mamba_ssm_gpu import ARGS, STATE, _ours, _theirs
from tests.harness import oracle

RTOL = 1e-6  # of each leaf's largest magnitude

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    try:
        import torch
        from test_mamba3_siso import mamba3_siso_step_ref
    except Exception as e:
        print(json.dumps({"skip": f"{type(e).__name__}: {e}"}))
        sys.exit(0)
    src, dst, args, states = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    data = np.load(src)
    leaf = {n: torch.tensor(data[n], dtype=torch.float64).requires_grad_(True) for n in data.files}
    y, finals = mamba3_siso_step_ref(*[leaf[n] for n in args], Input_States=tuple(leaf[s] for s in states))
    cot = torch.cos(torch.arange(y.numel(), dtype=torch.float32)).double().reshape(y.shape)
    (y.double() * cot).sum().backward()
    res = {"y": y}
    res.update({"final_" + s: f for s, f in zip(states, finals)})
    res.update({"grad_" + n: t.grad for n, t in leaf.items() if t.grad is not None})
    np.savez(dst, **{k: v.detach().double().numpy() for k, v in res.items()})
    print(json.dumps({"ok": sorted(res)}))
    """
)


def test_mamba_ssms_torch_reference_agrees_with_the_oracle(tmp_path):
    # the GPU comparison's inputs: B1 L256 H4 P64 N128, 32 angles, D, z and all four states
    arrays, _ = make(3, 1, 256, 4, 64, 1, 128, 32, 0, "bfloat16", segments=False)
    python = os.environ.get("MAMBA_SSM_PYTHON", sys.executable)
    theirs = _theirs(arrays, tmp_path, _SCRIPT, "mamba_ssm's torch reference (test_mamba3_siso)", python)
    want = oracle(_ours, arrays)
    assert {f"grad_{n}" for n in (*ARGS, *STATE)} | {"y"} <= set(theirs), sorted(theirs)
    errs = {}
    for name in sorted(set(want) & set(theirs)):
        w = np.asarray(want[name], np.float64)
        errs[name] = np.abs(theirs[name] - w).max() / max(np.abs(w).max(), 1e-30)
    print("\nmamba_ssm's reference, relative error against the float64 oracle:")
    for name, e in errs.items():
        print(f"  {name}: {e:.2e}")
    bad = {name: f"{e:.2e}" for name, e in errs.items() if not e <= RTOL}
    assert not bad, f"beyond {RTOL} of the largest magnitude: {bad}"
