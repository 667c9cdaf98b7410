"""Every op the TPU is measured on has a `tpu` preset sized for one chip: each case names its work in
FLOPs and bytes (the bench's share of the matmul ceiling and of the copy bandwidth) and takes its
errors against `xla` (the references' memory at these shapes is past the chip's)."""

from __future__ import annotations

import pytest

from axkern.bench import cases_for, presets_for

TPU_ROWS = {
    "attention": ["causal", "window1024", "docs1024"],
    "fused_cross_entropy": ["llama3: N=8192 D=4096 V=128256", "gemma: N=8192 D=2304 V=262144"],
    "fused_cross_entropy_loss": ["llama3: N=8192 D=4096 V=128256", "gemma: N=8192 D=2304 V=262144"],
    "ssd": ["mamba2_2.7b: B=4 L=4096 H=80 P=64 N=128"],
    "mamba3": [
        "mamba3_2.7b SISO: B=4 L=4096",
        "mamba3_2.7b MIMO R=4: B=1 L=4096",
    ],  # MIMO at B=4 exceeds the chip
    "short_conv": ["B=8 S=4096 C=4096 W=4 silu", "B=8 S=4096 C=4096 W=2 silu", "W=4 segments silu"],
}


@pytest.mark.parametrize("op", sorted(TPU_ROWS))
def test_the_tpu_preset_of_each_op(op):
    assert "tpu" in presets_for(op)
    cases = cases_for(op, preset="tpu")
    assert [any(part in c.label for c in cases) for part in TPU_ROWS[op]] == [True] * len(TPU_ROWS[op])
    assert len(cases) == len(TPU_ROWS[op])
    for c in cases:
        assert c.reference == "xla" and c.dtype == "bfloat16"
        assert c.flops_forward > 0 and c.flops_backward > 0 and c.bytes_forward > 0 and c.bytes_backward > 0
    if op in ("fused_cross_entropy", "fused_cross_entropy_loss"):
        assert [c.dims["tokens"] for c in cases_for(op, preset="tpu", tokens=4096)] == [4096, 4096]
