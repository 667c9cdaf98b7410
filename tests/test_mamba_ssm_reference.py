"""mamba3's float64 oracle (axkern's `reference`) against mamba_ssm's own torch references of the
Mamba-3 recurrences, SISO (`mamba3_siso_step_ref`) and MIMO (`mamba3_MIMO_step_ref`), on shared
inputs: values, final states and every gradient (the initial states' among them). A different
convention (angles and their wrap, the trapezoid's shift, the states' layouts, the gate, MIMO's
projections) would show as errors of order one; they agree to float64 rounding, less the
float32 cotangent both take.

MIMO's reference rotates the pairs `(2i, 2i + 1)` where axkern (and mamba_ssm's MIMO kernels)
rotate `(i, i + N/2)`: a permutation of the state's dims, under which the outputs do not change;
the script feeds it `q`, `k`, their biases and the states with the dims interleaved and turns
the final states back. Its `v` state holds `x ⊙ W_x` per rank where axkern's holds `x`, and its
angle state is not wrapped to `[0, 2π)`: the script forms the one from the other inside the
differentiated program, and the angles are compared modulo 2π.

The references live in upstream's `tests/ops/triton/test_mamba3_siso.py` and
`tests/ops/tilelang/test_mamba3_mimo.py` (state-spaces/mamba), not in this repository or its
peers: put the folders holding those files, and the `mamba_ssm` package the first imports
(`../shared/peers/mamba_ssm_triton`), on `PYTHONPATH`. It runs in a subprocess of the
interpreter named by `MAMBA_SSM_PYTHON` (one with torch, einops and triton; the CPU build of
torch serves), else this one. Where torch or a reference's file is missing the test skips,
saying why (as in CI), or fails when `MAMBA_SSM_PYTHON` is set; any other error fails.
"""

from __future__ import annotations

import os
import sys
import textwrap

import numpy as np
import pytest

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
    except ModuleNotFoundError as e:  # torch, or the reference's file (anything else fails)
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

_MIMO_SCRIPT = textwrap.dedent(
    """
    import json, math, sys
    import numpy as np
    try:
        import torch
        from test_mamba3_mimo import mamba3_MIMO_step_ref
    except ModuleNotFoundError as e:  # torch, or the reference's file (anything else fails)
        print(json.dumps({"skip": f"{type(e).__name__}: {e}"}))
        sys.exit(0)
    src, dst = sys.argv[1], sys.argv[2]
    data = np.load(src)
    a = {n: torch.tensor(data[n], dtype=torch.float64).requires_grad_(True) for n in data.files}
    n = a["q"].shape[-1]
    mix = lambda t: torch.stack([t[..., : n // 2], t[..., n // 2 :]], -1).reshape(t.shape)  # dims i, i + n/2 -> 2i, 2i + 1
    unmix = lambda t: torch.cat([t[..., 0::2], t[..., 1::2]], -1)
    states = (
        a["angle_state"],
        mix(a["ssm_state"]),
        mix(a["k_state"]).permute(0, 2, 1, 3),  # [b, r, h, n] -> [b, h, r, n]
        a["v_state"][:, :, None, :] * a["W_x"][None],  # x -> x * W_x per rank
    )
    y, (angle, ssm, k_state, v_state) = mamba3_MIMO_step_ref(
        mix(a["q"]), mix(a["k"]), a["v"], a["adt"], a["dt"], a["trap"], mix(a["q_bias"]), mix(a["k_bias"]),
        a["angles"], a["W_x"], a["W_o"], D=a["D"], Z=a["z"], MIMO_Z=a["W_z"], Input_States=states,
    )
    cot = torch.cos(torch.arange(y.numel(), dtype=torch.float32)).double().reshape(y.shape)
    (y.double() * cot).sum().backward()
    res = {
        "y": y,
        "final_angle_state": torch.remainder(angle, 2 * math.pi),
        "final_ssm_state": unmix(ssm),
        "final_k_state": unmix(k_state).permute(0, 2, 1, 3),
        "final_v_state_times_W_x": v_state,
    }
    res.update({"grad_" + n: t.grad for n, t in a.items() if t.grad is not None})
    np.savez(dst, **{k: v.detach().double().numpy() for k, v in res.items()})
    print(json.dumps({"ok": sorted(res)}))
    """
)


def test_mamba_ssms_torch_reference_agrees_with_the_oracle(tmp_path):
    # the GPU comparison's inputs: B1 L256 H4 P64 N128, 32 angles, D, z and all four states
    arrays, _ = make(3, 1, 256, 4, 64, 1, 128, 32, 0, "bfloat16", segments=False)
    theirs = _reference(arrays, tmp_path, _SCRIPT, "mamba_ssm's torch reference (test_mamba3_siso)")
    want = oracle(_ours, arrays)
    assert {f"grad_{n}" for n in (*ARGS, *STATE)} | {"y"} | {f"final_{s}" for s in STATE} <= set(theirs), (
        sorted(theirs)
    )
    _compare(want, theirs, "SISO")


def test_mamba_ssms_torch_mimo_reference_agrees_with_the_oracle(tmp_path):
    # MIMO of rank 3, 8 angles of a 32-dim state (dims 8-15 and 24-31 not rotated), length 50
    arrays, _ = make(5, 1, 50, 4, 16, 1, 32, 8, 3, "float32", segments=False)
    theirs = _reference(arrays, tmp_path, _MIMO_SCRIPT, "mamba_ssm's torch reference (test_mamba3_mimo)")
    want = oracle(_ours, arrays)
    want["final_v_state_times_W_x"] = (
        want.pop("final_v_state")[:, :, None, :] * np.asarray(arrays["W_x"])[None]
    )
    finals = {"final_angle_state", "final_ssm_state", "final_k_state", "final_v_state_times_W_x"}
    assert {f"grad_{n}" for n in arrays} | {"y"} | finals <= set(theirs), sorted(theirs)
    _compare(want, theirs, "MIMO rank 3")


def _reference(arrays, tmp_path, script, what):
    """The reference's outputs by `script`; a missing module skips, unless `MAMBA_SSM_PYTHON`
    names the interpreter (then it fails)."""
    python = os.environ.get("MAMBA_SSM_PYTHON")
    try:
        return _theirs(arrays, tmp_path, script, what, python or sys.executable)
    except pytest.skip.Exception as e:
        if python:
            pytest.fail(f"MAMBA_SSM_PYTHON={python}: {e}")
        raise


def _compare(want, theirs, what):
    errs = {}
    for name in sorted(set(want) & set(theirs)):
        w, t = np.asarray(want[name], np.float64), np.asarray(theirs[name], np.float64)
        d = t - w
        if name == "final_angle_state":  # the same angle modulo 2π
            d = np.remainder(d + np.pi, 2 * np.pi) - np.pi
        errs[name] = np.abs(d).max() / max(np.abs(w).max(), 1e-30)
    print(f"\nmamba_ssm's {what} reference, relative error against the float64 oracle:")
    for name, e in errs.items():
        print(f"  {name}: {e:.2e}")
    assert len(errs) == len(theirs), sorted(set(theirs) - set(errs))
    bad = {name: f"{e:.2e}" for name, e in errs.items() if not e <= RTOL}
    assert not bad, f"beyond {RTOL} of the largest magnitude: {bad}"
