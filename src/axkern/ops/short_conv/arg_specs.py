"""Shapes that `axkern bench short_conv` uses. Memory bound: GB/s count the fewest bytes.

Forward: read `x`, write `y` (`2·B·S·C` elements). Backward: read `x` and `dy`, write `dx`
(`3·B·S·C`); weights, bias and states are negligible. The fwd+bwd pass returns `y` and pulls
a fixed random `dy` back (a loss like `sum(y)` would hand XLA a constant cotangent to fold).
The mamba preset runs SiLU (as Mamba does) at widths 2, 4 and 8, with and without segment ids,
at B=8 S=4096 and B=1 S=32768 (C=4096), and a few width-4 rows without an activation. The tpu
preset (one TPU chip) runs B=8 S=4096 C=4096 SiLU at widths 4 and 2, and 4 with segment ids, its
errors taken against `xla`.

Peer (`--peers`, timed in this process): Levanter's Triton kernel
(`levanter.kernels.triton.short_conv`, width 4 only, no bias, activation or state), followed
by the bias and SiLU in XLA where the case has them, as a Levanter model applies them.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from axkern.core.cases import Case

from .api import short_conv_positional

# name: (batch, seq, channels, width, segments, activation)
PRESETS = {
    "quick": [(2, 256, 256, 4, False, "silu")],
    "mamba": [
        *[
            (batch, seq, 4096, width, segments, "silu")
            for batch, seq in ((8, 4096), (1, 32768))
            for segments in (False, True)
            for width in (2, 4, 8)
        ],
        (8, 4096, 4096, 4, False, None),
        (1, 32768, 4096, 4, False, None),
        (8, 4096, 4096, 4, True, None),
    ],
    # one TPU chip: widths 4 and 2, and 4 with packed documents (errors against `xla`)
    "tpu": [
        (8, 4096, 4096, 4, False, "silu"),
        (8, 4096, 4096, 2, False, "silu"),
        (8, 4096, 4096, 4, True, "silu"),
    ],
}


def case(
    batch,
    seq,
    channels,
    width,
    segments=False,
    activation="silu",
    dtype="bfloat16",
    label=None,
    reference="reference",
) -> Case:
    dt = jnp.dtype(dtype)

    def make(key):
        kx, kw, kb, ks = jax.random.split(key, 4)
        x = jax.random.normal(kx, (batch, seq, channels), jnp.float32).astype(dt)
        w = (jax.random.normal(kw, (width, channels), jnp.float32) / width**0.5).astype(dt)
        b = jax.random.normal(kb, (channels,), jnp.float32).astype(dt)
        seg = None
        if segments:  # packed documents of about 1k tokens
            seg = jnp.cumsum(jax.random.bernoulli(ks, 1 / 1024, (batch, seq)), axis=1).astype(jnp.int32)
        return x, w, b, seg

    def forward(impl, x, w, b, seg):
        return short_conv_positional(
            x, w, bias=b, segment_ids=seg, activation=activation, implementation=impl
        )

    elems = float(batch) * seq * channels
    return Case(
        peers={"levanter": _levanter_peer(width, channels, dt, activation)},
        op="short_conv",
        label=label
        or f"B={batch} S={seq} C={channels} W={width}{' segments' if segments else ''} {activation or 'no act'} {dt.name}",
        dims={"batch": batch, "seq": seq, "channels": channels, "width": width},
        dtype=dt.name,
        make=make,
        forward=forward,
        loss=None,  # the backward pulls a random cotangent back
        grad_argnums=(0, 1, 2),
        flops_forward=2 * elems * width,
        flops_backward=4 * elems * width,
        bytes_forward=2 * elems * dt.itemsize,
        bytes_backward=3 * elems * dt.itemsize,
        bound="memory",
        reference=reference,
    )


def _levanter_peer(width, channels, dtype, activation):
    """Levanter's Triton short conv (plus bias and SiLU in XLA), or why it cannot run the case."""
    if importlib.util.find_spec("levanter") is None:
        return "levanter is not installed"
    if width != 4 or channels % 64 or dtype.name not in ("bfloat16", "float32"):
        return "Levanter's Triton kernel takes width 4, channels a multiple of 64, bf16 or float32"

    def forward(x, w, b, seg):
        from levanter.kernels.triton.short_conv import short_conv as levanter_conv

        y = levanter_conv(w, x, seg, implementation="triton_gpu") + b
        return y * jax.nn.sigmoid(y) if activation == "silu" else y

    return forward


def cases(*, preset=None, tokens=None, dtype=None):
    name = preset or "quick"
    if name not in PRESETS:
        raise ValueError(f"short_conv: unknown preset {name!r}; presets are {sorted(PRESETS)}")
    dtype = dtype or ("float32" if name == "quick" else "bfloat16")
    reference = "xla" if name == "tpu" else "reference"
    return [
        case(b, tokens or s, c, w, seg, act, dtype, reference=reference)
        for b, s, c, w, seg, act in PRESETS[name]
    ]


STEP_PRESETS = {"quick": [(4, 256, 4)], "decode": [(64, 4096, 4), (256, 8192, 4)]}
PRESETS_BY_OP = {
    "short_conv": PRESETS,
    "short_conv_step": STEP_PRESETS,
}  # what `axkern bench --list-presets` shows


def cases_short_conv_step(*, preset=None, tokens=None, dtype=None):
    """One decode step (`batch` sequences, one new position each): reads `x_t`, the `W-1` state
    rows and the weight, writes `y_t` and the new state."""
    from .api import short_conv_step_positional

    name = preset or "quick"
    if name not in STEP_PRESETS:
        raise ValueError(f"short_conv_step: unknown preset {name!r}; presets are {sorted(STEP_PRESETS)}")
    dt = jnp.dtype(dtype or ("float32" if name == "quick" else "bfloat16"))
    out = []
    for batch, channels, width in STEP_PRESETS[name]:
        batch = tokens or batch

        def make(key, batch=batch, channels=channels, width=width):
            kx, ks, kw = jax.random.split(key, 3)
            x = jax.random.normal(kx, (batch, channels), jnp.float32).astype(dt)
            s = jax.random.normal(ks, (batch, width - 1, channels), jnp.float32).astype(dt)
            w = (jax.random.normal(kw, (width, channels), jnp.float32) / width**0.5).astype(dt)
            return x, s, w

        def forward(impl, x, s, w):
            return tuple(short_conv_step_positional(x, s, w, activation="silu", implementation=impl))

        elems = float(batch) * channels
        out.append(
            Case(
                op="short_conv_step",
                label=f"B={batch} C={channels} W={width} silu {dt.name}",
                dims={"batch": batch, "channels": channels, "width": width},
                dtype=dt.name,
                make=make,
                forward=forward,
                loss=None,
                grad_argnums=(0, 1, 2),
                flops_forward=2 * elems * width,
                flops_backward=4 * elems * width,
                bytes_forward=2 * elems * width * dt.itemsize,
                bytes_backward=3 * elems * width * dt.itemsize,
                bound="memory",
            )
        )
    return out
