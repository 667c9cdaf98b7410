"""fused_cross_entropy, positional layer: every implementation against the float64 oracle.

The oracle is the `reference` implementation in float64; the reference itself is checked
against an independent NumPy computation of the loss and its gradients.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axkern
from axkern import CrossEntropyBlockSizes
from axkern.positional import fused_cross_entropy
from axkern.positional import fused_cross_entropy_loss as ce_loss
from tests.cases.fused_cross_entropy import OPTIONS, make, run, run_loss
from tests.harness import check_rules, implementations, oracle
from tests.helpers import assert_oracle_rule, to64, x64
from tests.tpu_lowering import lower_for_tpu


def ce(*args, **kwargs):
    """Per-token `(loss, lse)`."""
    return fused_cross_entropy(*args, reduction=None, return_lse=True, **kwargs)


def inputs(seed, n, d, v, dtype="float32"):
    """`x, w, labels` of a case."""
    arrays, _ = make(seed, n, d, v, dtype)
    return arrays["x"], arrays["w"], arrays["labels"]


# every implementation that runs here (the Pallas kernels in interpret mode), each with tiles
# that divide none of the case's sizes: several token blocks and vocabulary tiles, the last of
# each ragged; pallas_gpu's vocabulary tiles shared unevenly by its splits (2 and 1). pallas_tpu's
# token tiles are lane vectors (multiples of 128): one tile of 128 over the 70 here, several, the
# last ragged, in `test_pallas_tpu_over_ragged_token_tiles`
IMPLS = implementations("fused_cross_entropy", "cpu", interpret=True)
COMPILED = implementations("fused_cross_entropy", "cpu")
TILES = {
    "xla": CrossEntropyBlockSizes(block_tokens=32, block_vocab=96),
    "pallas_gpu": CrossEntropyBlockSizes(block_tokens=32, block_vocab=128, block_embed=64, vocab_splits=2),
    "pallas_tpu": CrossEntropyBlockSizes(block_tokens=128, block_vocab=128),
}
DTYPES = ["float32", "bfloat16"]


def check(impls, seed, n, d, v, dtype, option, block_sizes=TILES):
    arrays, options = make(seed, n, d, v, dtype, OPTIONS[option])
    what = f"fused_cross_entropy N={n} D={d} V={v} {option}"
    got = check_rules(run, impls, arrays, dtype, what, options=options, block_sizes=block_sizes)
    for (loss, _), (dx, dw) in got.values():
        assert loss.dtype == jnp.float32 and dx.dtype == jnp.dtype(dtype) and dw.dtype == jnp.dtype(dtype)


# The kernels compute the soft cap and (with label smoothing) the logit sum; z-loss, ignored
# labels and `where` are applied outside them, in code every implementation shares. So every
# implementation takes the kernels' options, each pair of (dtype, soft cap, logit sum) values
# at least once and "all" (every option together) in both dtypes; the other options run on
# the compiled implementations alone. D = 150 leaves a ragged embedding block for every tile
# above (64 and 128 wide); D = 128 fills them exactly.
KERNEL_CASES = [
    ("plain", "float32", 150),
    ("soft_cap", "bfloat16", 150),
    ("smoothing", "bfloat16", 128),
    ("all", "float32", 150),
    ("all", "bfloat16", 150),
]


@pytest.mark.parametrize("option,dtype,d", KERNEL_CASES)
def test_against_oracle_odd_shape(option, dtype, d):
    check(IMPLS, KERNEL_CASES.index((option, dtype, d)), 70, d, 300, dtype, option)


@pytest.mark.parametrize("option", sorted(set(OPTIONS) - {option for option, _, _ in KERNEL_CASES}))
def test_options_outside_the_kernels_against_oracle(option):
    check(COMPILED, 4, 70, 150, 300, "float32", option)


@pytest.mark.parametrize("dtype,option", [("float32", "all"), ("bfloat16", "soft_cap")])
def test_pallas_tpu_over_ragged_token_tiles(dtype, option):
    """300 tokens in tiles of 128 (the last ragged, its extra lanes unwritten) by vocabulary tiles
    of 128 over 300 columns (the last ragged)."""
    check(["pallas_tpu"], 7, 300, 72, 300, dtype, option, block_sizes={"pallas_tpu": TILES["pallas_tpu"]})


def test_pallas_refusals_name_the_problem():
    x, w, labels = inputs(0, 64, 32, 300, "float32")
    with pytest.raises(axkern.Unsupported, match="block_vocab=100: Triton tiles need a power of two"):
        ce(x, w, labels, implementation="pallas_gpu", block_sizes=dict(block_tokens=32, block_vocab=100))
    with pytest.raises(
        axkern.Unsupported, match="block_vocab=200: the TPU cross-entropy kernels take a multiple of 128"
    ):
        ce(x, w, labels, implementation="pallas_tpu", block_sizes=dict(block_tokens=128, block_vocab=200))
    with pytest.raises(
        axkern.Unsupported, match="block_tokens=32: the TPU cross-entropy kernels take a multiple of 128"
    ):
        ce(x, w, labels, implementation="pallas_tpu", block_sizes=dict(block_tokens=32, block_vocab=128))
    # on the chip, tiles over its VMEM are refused with the figures
    big = dict(block_tokens=4096, block_vocab=4096)
    with pytest.raises(axkern.Unsupported, match=r"need about \d+ MiB of VMEM, over the 96 MiB"):
        lower_for_tpu(
            lambda x, w, l: ce(x, w, l, implementation="pallas_tpu", block_sizes=big),
            jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16),
            jax.ShapeDtypeStruct((4096, 32000), jnp.bfloat16),
            jax.ShapeDtypeStruct((8192,), jnp.int32),
        )
    with x64(), axkern.use(interpret=True):  # interpret mode: the kernel's own float64 check speaks
        d = axkern.explain(lambda *a: ce(*a, implementation=("pallas_gpu", "xla")), *to64((x, w)), labels)
    assert d.implementation == "xla" and "float64" in d.rejected[0].reason


# the reduced loss: its implementations form the gradients in the forward. 150 tokens in
# blocks of 64: two full blocks and a ragged one; dw in slabs of 128 columns: two full and a
# ragged one. Every option in float32 (whose w is its own dw accumulator); in bfloat16 those
# that change the gradient's formula (ignored labels and `where` only drop tokens), each with
# the default (float32) and the compensated dw accumulation. The reduction alternates: each
# dtype meets both, and so does each option run in both dtypes
LOSS_CASES = [
    (dtype, option, ("mean", "sum")[(i + j) % 2], dw)
    for j, dtype in enumerate(DTYPES)
    for i, option in enumerate(OPTIONS)
    if dtype == "float32" or option not in ("ignore", "where")
    for dw in ((None,) if dtype == "float32" else (None, "compensated"))
]


@pytest.mark.parametrize("dtype,option,reduction,dw", LOSS_CASES)
def test_loss_gradients_in_forward_against_oracle(dtype, option, reduction, dw):
    arrays, options = make(5, 150, 40, 300, dtype, OPTIONS[option])
    bs = CrossEntropyBlockSizes(block_tokens=64, block_vocab=128, dw_accumulation=dw)
    what = f"fused_cross_entropy_loss {option} {reduction} dw={dw}"
    kw = dict(reduction=reduction, options=options, block_sizes=bs)
    got = check_rules(run_loss, implementations("fused_cross_entropy_loss", "cpu"), arrays, dtype, what, **kw)
    for impl, (value, (dx, dw)) in got.items():
        assert value.dtype == jnp.float32 and dx.dtype == jnp.dtype(dtype) and dw.dtype == jnp.dtype(dtype)
        # undifferentiated, the same value comes from the streaming forward
        x, w, labels = arrays["x"], arrays["w"], arrays["labels"]
        primal = ce_loss(
            x,
            w,
            labels,
            reduction=reduction,
            where=arrays.get("where"),
            implementation=impl,
            block_sizes=bs,
            **options,
        )
        np.testing.assert_allclose(primal, value, rtol=1e-5)


def test_compensated_dw_meets_the_rule_over_many_blocks_where_plain_does_not():
    # 64 token blocks, each adding a share to every entry of a bf16 dw (slabs of 512 columns,
    # the last ragged): rounding each sum to bf16 (plain) misses the rule for dw; the
    # compensated sums (bf16 or int8 compensation) meet it for every output, as does the
    # float32 accumulator
    arrays, _ = make(11, 2048, 64, 3000, "bfloat16")
    blocks = {
        dw: CrossEntropyBlockSizes(block_tokens=32, block_vocab=512, dw_accumulation=dw)
        for dw in ("compensated", "compensated_int8", "float32", "plain")
    }
    for dw in ("compensated", "compensated_int8", "float32"):
        check_rules(run_loss, ["xla"], arrays, "bfloat16", f"dw={dw}", block_sizes=blocks[dw])
    want, same = oracle(run_loss, arrays), run_loss("reference", arrays)
    value, (dx, dw) = run_loss("xla", arrays, block_sizes=blocks["plain"])
    assert_oracle_rule(
        (value, dx), (same[0], same[1][0]), (want[0], want[1][0]), "bfloat16", "plain loss, dx"
    )
    with pytest.raises(AssertionError, match=r"plain dw\[0\]: max\|impl - oracle\|"):
        assert_oracle_rule(dw, same[1][1], want[1][1], "bfloat16", "plain dw")


def test_explain_names_the_dw_accumulation_and_its_memory():
    n, d, v = 4096, 256, 50000
    shapes = (
        jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
        jax.ShapeDtypeStruct((n,), jnp.int32),
    )
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    bs = dict(block_tokens=512, block_vocab=1000)
    compensated = {**bs, "dw_accumulation": "compensated"}
    backward = axkern.explain(lambda *a: ce_loss(*a, block_sizes=compensated), *shapes).backward
    block = 512 * v * 4 + 512 * 1000 * 2  # the float32 logits block and one slab of dz
    dw = d * v * 2 + d * 1000 * 4  # the bf16 compensation and one float32 slab share
    assert "bfloat16 [D, V] compensation (Kahan), 1000-column slabs" in backward
    assert (
        f"temporary memory up to {mib(block + dw)} (logits block {mib(block)}, dw accumulation {mib(dw)})"
        in backward
    )
    float32 = axkern.explain(lambda *a: ce_loss(*a, block_sizes=bs), *shapes)  # the default
    assert (
        "float32 [D, V] buffer" in float32.backward
        and f"dw accumulation {mib(d * v * 4)}" in float32.backward
    )
    wide = (shapes[0], jax.ShapeDtypeStruct((d, v), jnp.float32), shapes[2])
    gradient = axkern.explain(lambda *a: ce_loss(*a, block_sizes=bs), *wide)
    assert (
        "float32 gradient itself" in gradient.backward
        and f"dw accumulation {mib(d * 1000 * 4)}" in gradient.backward
    )
    int8 = axkern.explain(
        lambda *a: ce_loss(*a, block_sizes={**bs, "dw_accumulation": "compensated_int8"}), *shapes
    )
    assert (
        "int8 [D, V] compensation" in int8.backward
        and f"dw accumulation {mib(d * v + d * 1000 * 4)}" in int8.backward
    )
    with pytest.raises(
        ValueError, match=r"dw_accumulation must be one of 'compensated', 'compensated_int8', "
    ):
        ce_loss(
            jnp.zeros((8, 4)),
            jnp.zeros((4, 6)),
            jnp.zeros(8, jnp.int32),
            block_sizes={"dw_accumulation": "kahan"},
        )


def test_loss_edge_cases():
    x, w, labels = inputs(0, 8, 16, 40, "float32")
    nothing = jnp.zeros((8,), bool)
    value, (dx, dw) = jax.value_and_grad(lambda x, w: ce_loss(x, w, labels, where=nothing), argnums=(0, 1))(
        x, w
    )
    assert value == 0 and not dx.any() and not dw.any()  # mean over no kept token: 0, not NaN
    bad = labels.at[2].set(40)
    dx = np.asarray(jax.grad(lambda x: ce_loss(x, w, bad))(x))
    assert np.isnan(ce_loss(x, w, bad)) and np.isnan(dx[2]).all() and np.isfinite(np.delete(dx, 2, 0)).all()
    assert np.isfinite(ce_loss(x, w, bad, where=jnp.arange(8) != 2))
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        ce_loss(x, w, labels, reduction=None)
    d = axkern.explain(ce_loss, x, w, labels)
    assert d.op == "fused_cross_entropy_loss" and d.implementation == "xla" and "forward" in d.backward


def test_loss_temporary_memory_is_one_logits_block():
    n, d, v = 2048, 64, 8192
    x, w, labels = inputs(0, n, d, v, "bfloat16")
    bs = CrossEntropyBlockSizes(block_tokens=256, block_vocab=v, dw_accumulation="float32")
    grad = jax.jit(
        jax.grad(lambda x, w: ce_loss(x, w, labels, implementation="xla", block_sizes=bs), argnums=(0, 1))
    )
    temp = grad.lower(x, w).compile().memory_analysis().temp_size_in_bytes
    block = 256 * v * (4 + 2)  # float32 logits block and its bf16 dz
    assert temp <= 2 * block + 2 * d * v * 4, f"{temp / 2**20:.1f} MiB"  # and the float32 dw accumulator
    assert temp < n * v * 4 / 4


def test_float32_w_is_its_own_dw_accumulator():
    # no [D, V] buffer beside the float32 gradient: one logits block and slab-sized pieces
    n, d, v = 2048, 512, 8192
    x, w, labels = inputs(0, n, d, v, "float32")
    bs = CrossEntropyBlockSizes(block_tokens=256, block_vocab=1024)
    grad = jax.jit(
        jax.grad(lambda x, w: ce_loss(x, w, labels, implementation="xla", block_sizes=bs), argnums=(0, 1))
    )
    temp = grad.lower(x, w).compile().memory_analysis().temp_size_in_bytes
    assert temp < d * v * 4, f"{temp / 2**20:.1f} MiB beside a {d * v * 4 / 2**20:.0f} MiB gradient"


@given(
    n=st.integers(1, 70),
    d=st.integers(1, 40),
    v=st.integers(1, 300),
    # blocks of at least 3 x 7 (ragged against most sizes) keep the tile loops short on a CPU
    block_tokens=st.integers(3, 80),
    block_vocab=st.integers(7, 350),
    dtype=st.sampled_from(DTYPES),
    option=st.sampled_from(sorted(OPTIONS)),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=max(1, settings.default.max_examples // 2))
def test_xla_against_oracle_random_shapes(n, d, v, block_tokens, block_vocab, dtype, option, seed):
    # sizes and tiles the explicit cases do not take: tiles larger than the problem, one token,
    # a vocabulary of one
    bs = CrossEntropyBlockSizes(block_tokens=block_tokens, block_vocab=block_vocab)
    check(["xla"], seed, n, d, v, dtype, option, bs)


def numpy_loss_and_grads(x, w, labels, cot, *, cap=None, eps=0.0, zw=0.0, ignore=None, where=None):
    """Independent float64 NumPy formulas: loss, lse, and grads of <cot0, loss> + <cot1, lse>."""
    x, w, cot = (np.asarray(a, np.float64) for a in (x, w, cot))
    labels = np.asarray(labels)
    n, v = x.shape[0], w.shape[1]
    raw = x @ w
    z = cap * np.tanh(raw / cap) if cap else raw
    m = z.max(1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(1, keepdims=True)))[:, 0]
    p = np.exp(z - lse[:, None])
    keep = np.ones(n, bool) if where is None else np.asarray(where)
    if ignore is not None:
        keep = keep & (labels != ignore)
    onehot = np.zeros((n, v))
    safe = np.clip(labels, 0, v - 1)
    onehot[np.arange(n), safe] = 1.0
    z_label = z[np.arange(n), safe]
    loss = np.where(keep, lse - (1 - eps) * z_label - eps * z.mean(1) + zw * lse**2, 0.0)
    g_loss = cot[0] * keep
    dz = (g_loss * (1 + 2 * zw * lse) + cot[1])[:, None] * p - g_loss[:, None] * (
        (1 - eps) * onehot + eps / v
    )
    if cap:
        dz = dz * (1 - np.tanh(raw / cap) ** 2)
    return loss, lse, dz @ w.T, x.T @ dz


@pytest.mark.parametrize("option", list(OPTIONS))
def test_reference_against_numpy(option):
    arrays, opts = make(3, 37, 16, 53, "float32", OPTIONS[option])
    (loss, lse), (dx, dw) = oracle(run, arrays, options=opts)
    kw = {
        "cap": opts.get("logits_soft_cap"),
        "eps": opts.get("label_smoothing", 0.0),
        "zw": opts.get("logsumexp_weight", 0.0),
        "ignore": opts.get("ignore_index"),
        "where": arrays.get("where"),
    }
    want = numpy_loss_and_grads(arrays["x"], arrays["w"], arrays["labels"], arrays["cot"], **kw)
    for got, ref, name in zip((loss, lse, dx, dw), want, ("loss", "lse", "dx", "dw"), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("impl", [*COMPILED, "reference"])
def test_out_of_range_label_gives_nan_for_that_token_only(impl):
    x, w, labels = inputs(0, 8, 16, 40, "float32")
    labels = labels.at[2].set(40).at[5].set(-3)
    loss, lse = ce(x, w, labels, implementation=impl)
    assert np.isnan(loss[2]) and np.isnan(loss[5])
    assert np.isfinite(np.delete(np.asarray(loss), [2, 5])).all() and np.isfinite(lse).all()
    # ... unless the token is dropped
    loss, _ = ce(x, w, labels, where=jnp.arange(8) % 3 != 2, ignore_index=-3, implementation=impl)
    assert np.isfinite(loss).all()


def test_check_labels_raises_at_run_time():
    x, w, labels = inputs(0, 8, 16, 40, "float32")
    bad = labels.at[3].set(41)
    with pytest.raises(Exception, match=r"label outside \[0, 40\)"):
        jax.block_until_ready(jax.jit(lambda l: ce(x, w, l, check_labels=True)[0])(bad))
    jax.block_until_ready(jax.jit(lambda l: ce(x, w, l, check_labels=True)[0])(labels))  # fine ones pass
    jax.block_until_ready(ce(x, w, bad.at[3].set(-100), ignore_index=-100, check_labels=True))


@pytest.mark.parametrize("impl", [*COMPILED, "reference"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_inf_in_x_propagate(impl, bad):
    x, w, labels = inputs(1, 6, 8, 30, "float32")
    loss, lse = ce(
        x.at[1, 3].set(bad),
        w,
        labels,
        implementation=impl,
        block_sizes=CrossEntropyBlockSizes(4, 7) if impl == "xla" else None,
    )
    assert not np.isfinite(loss[1]) and not np.isfinite(lse[1])
    assert np.isfinite(np.delete(np.asarray(loss), 1)).all()


def test_type_and_shape_errors():
    x, w, labels = inputs(0, 8, 16, 40, "float32")
    with pytest.raises(jaxtyping.TypeCheckError, match="labels"):
        ce(x, w, labels.astype(jnp.float32))
    with pytest.raises(jaxtyping.TypeCheckError, match="x"):
        ce(x.astype(jnp.int32), w, labels)
    with pytest.raises(jaxtyping.TypeCheckError):
        ce(x, w[:15], labels)  # embed differs
    with pytest.raises(jaxtyping.TypeCheckError):
        ce(x, w, labels[:7])  # tokens differ
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        ce(x, w, labels, label_smoothing=1.5)
    with pytest.raises(ValueError, match="logits_soft_cap must be > 0"):
        ce(x, w, labels, logits_soft_cap=0.0)


def test_jit_vmap_grad_and_filter_jit():
    x, w, labels = inputs(2, 24, 16, 50, "float32")
    xb, lb = x.reshape(3, 8, 16), labels.reshape(3, 8)
    f = lambda x, l: ce(x, w, l, block_sizes=CrossEntropyBlockSizes(5, 11))[0]  # noqa: E731
    looped = jnp.stack([jax.jit(f)(xb[i], lb[i]) for i in range(3)])
    np.testing.assert_allclose(jax.jit(jax.vmap(f))(xb, lb), looped, rtol=1e-6)
    np.testing.assert_allclose(eqx.filter_jit(f)(x, labels), jnp.concatenate(looped), rtol=1e-6)
    g = jax.jit(jax.grad(lambda x, w: jnp.mean(ce(x, w, labels)[0]), argnums=(0, 1)))(x, w)
    g_ref = jax.jit(
        jax.grad(lambda x, w: jnp.mean(ce(x, w, labels, implementation="reference")[0]), argnums=(0, 1))
    )(x, w)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # per-example gradients: grad inside vmap
    per = jax.jit(jax.vmap(jax.grad(lambda x, l: jnp.sum(f(x, l)))))(xb, lb)
    assert per.shape == xb.shape and np.isfinite(per).all()


def test_xla_never_materialises_the_logits():
    """Temporary memory of the compiled forward+backward stays far below one [N, V] float32 buffer."""
    n, d, v = 2048, 64, 8192
    x, w, labels = inputs(0, n, d, v, "float32")
    bs = CrossEntropyBlockSizes(block_tokens=512, block_vocab=1024)

    def temp(impl):
        f = jax.jit(
            jax.grad(
                lambda x, w: jnp.mean(ce(x, w, labels, implementation=impl, block_sizes=bs)[0]),
                argnums=(0, 1),
            )
        )
        stats = f.lower(x, w).compile().memory_analysis()
        return stats.temp_size_in_bytes

    logits_bytes = n * v * 4
    assert temp("reference") >= logits_bytes  # the oracle does materialise
    assert temp("xla") < logits_bytes / 4


def test_explain_positional():
    x, w, labels = inputs(0, 300, 96, 1000, "bfloat16")
    d = axkern.explain(ce, x, w, labels)
    assert d.op == "fused_cross_entropy" and d.implementation == "xla"
    assert d.block_source == "heuristic" and d.spec.dim("vocab") == 1000 and d.spec.dtype == "bfloat16"
    d = axkern.explain(lambda *a: ce(*a, implementation="reference"), x, w, labels)
    assert d.implementation == "reference" and d.block_sizes is None
    with axkern.use(fused_cross_entropy="reference"):
        assert axkern.explain(ce, x, w, labels).implementation == "reference"
