"""The oracle rule of DESIGN.md and small input makers shared by the op tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# atol of the oracle rule, relative to the oracle's largest magnitude, per dtype.
ATOL = {"float32": 1e-5, "bfloat16": 2e-3, "float16": 3e-4, "float64": 1e-12}


def x64():
    """Context manager enabling float64 (the name moved between JAX releases)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # pragma: no cover - older jax

    return enable_x64()


def to64(tree):
    return jax.tree.map(
        lambda a: (
            np.asarray(a, np.float64) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else np.asarray(a)
        ),
        tree,
    )


def assert_oracle_rule(got, same_dtype_ref, oracle, dtype: str, what: str = "") -> None:
    """`max|impl - oracle| <= 2 * max|reference_in_same_dtype - oracle| + atol`, per leaf. NaN never passes."""
    leaves = zip(jax.tree.leaves(got), jax.tree.leaves(same_dtype_ref), jax.tree.leaves(oracle), strict=True)
    for i, (g, r, o) in enumerate(leaves):
        g, r, o = (np.asarray(v, np.float64) for v in (g, r, o))
        assert g.shape == o.shape, f"{what}[{i}]: shape {g.shape} != oracle {o.shape}"
        assert not np.isnan(g).any(), f"{what}[{i}]: NaN in output"
        scale = max(np.abs(o).max(initial=0.0), 1e-30)
        err = np.abs(g - o).max(initial=0.0)
        ref_err = np.abs(r - o).max(initial=0.0)
        bound = 2 * ref_err + ATOL[dtype] * scale
        assert err <= bound, (
            f"{what}[{i}]: max|impl - oracle| = {err:.3e} > 2 * {ref_err:.3e} + atol = {bound:.3e} "
            f"(scale {scale:.3e}, dtype {dtype})"
        )


def ce_inputs(key, n, d, v, dtype, *, logit_scale=2.0):
    """Random `x [n, d]`, `w [d, v]`, `labels [n]`, with logits of order `logit_scale`."""
    kx, kw, kl = jax.random.split(key, 3)
    x = jax.random.normal(kx, (n, d), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (d, v), jnp.float32) * (logit_scale / np.sqrt(d))).astype(dtype)
    labels = jax.random.randint(kl, (n,), 0, v)
    return x, w, labels


def assert_nonfinite_rule(got, want, what: str = "", rtol: float = 1e-4) -> None:
    """The non-finite rule of docs/guide.md, per leaf: `got` is non-finite (NaN, or an infinity
    the arithmetic kept) exactly where the reference `want` is, and close to it elsewhere."""
    leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    for i, (g, w) in enumerate(leaves):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, f"{what}[{i}]: shape {g.shape} != reference {w.shape}"
        bad_g, bad_w = ~np.isfinite(g), ~np.isfinite(w)
        if (bad_g != bad_w).any():
            extra, missing = np.argwhere(bad_g & ~bad_w), np.argwhere(bad_w & ~bad_g)
            raise AssertionError(
                f"{what}[{i}]: non-finite pattern differs from the reference: {len(extra)} extra "
                f"(first {extra[:3].tolist()}), {len(missing)} missing (first {missing[:3].tolist()})"
            )
        ok = ~bad_w
        scale = max(np.abs(w[ok]).max(initial=0.0), 1e-30)
        err = np.abs(g[ok] - w[ok]).max(initial=0.0)
        assert err <= rtol * scale + 1e-6, (
            f"{what}[{i}]: finite values differ by {err:.3e} (scale {scale:.3e})"
        )


def poke(a, index, value):
    """`a` with `a[index] = value` (a NaN or an infinity placed by a test)."""
    return jnp.asarray(a).at[index].set(value)


# the loss ops' options, one case each and all together (`"where": True`: a random mask)
LOSS_OPTIONS = {
    "plain": {},
    "soft_cap": {"logits_soft_cap": 2.5},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"logsumexp_weight": 1e-2},
    "ignore": {"ignore_index": -100},
    "where": {"where": True},
    "all": {
        "logits_soft_cap": 4.0,
        "label_smoothing": 0.2,
        "logsumexp_weight": 1e-3,
        "ignore_index": -1,
        "where": True,
    },
}


def equations(jaxpr, *, into_conds=True, into_kernels=True):
    """Every equation of `jaxpr` and of its sub-jaxprs (`into_conds=False`: none inside a `cond`;
    `into_kernels=False`: none inside a Pallas kernel's body, whose `pl.when`s are conds too)."""
    for e in jaxpr.eqns:
        yield e
        if (e.primitive.name == "cond" and not into_conds) or (
            e.primitive.name == "pallas_call" and not into_kernels
        ):
            continue
        for v in e.params.values():
            for j in v if isinstance(v, (tuple, list)) else (v,):
                j = getattr(j, "jaxpr", j)
                if hasattr(j, "eqns"):
                    yield from equations(j, into_conds=into_conds, into_kernels=into_kernels)
