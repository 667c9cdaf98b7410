"""A tiny Levanter-style language model (haliax + equinox) on axkern's kernels.

One block of each kind, pre-norm and residual:

- attention with grouped-query heads over packed documents (`axkern.attention`, mask
  `Causal() & Segments(doc ids)`, so tiles across documents are skipped);
- a Mamba-2 mixer: `axkern.short_conv` with SiLU over `x, B, C`, then `axkern.ssd`;
- a mixture-of-experts MLP: `axkern.moe_dispatch` → `jax.lax.ragged_dot` → `axkern.moe_combine`;
- the loss, `axkern.fused_cross_entropy`, which never forms the `[tokens, vocab]` logits.

`python examples/tiny_lm.py` trains it for 10 steps on synthetic packed documents (each one
counts up from a random start, so the next token is learnable), printing the loss and what
`axkern.explain` says each op runs. `axkern bench --cases examples/tiny_lm.py` times one
training step (`cases()` below), against the same step with every op's `reference`.
"""

from __future__ import annotations

import sys

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp

import axkern
from axkern import masks

Batch = hax.Axis("batch", 2)
Pos = hax.Axis("position", 32)
Embed = hax.Axis("embed", 32)
Vocab = hax.Axis("vocab", 64)
Heads, KVHeads, HeadDim = hax.Axis("heads", 4), hax.Axis("kv_heads", 2), hax.Axis("head_size", 8)
# Mamba-2: `heads x head_size` channels of x, one group of B and C
SSMHeads, SSMState, Groups = hax.Axis("heads", 4), hax.Axis("state", 8), hax.Axis("groups", 1)
Conv = hax.Axis("conv_channels", SSMHeads.size * HeadDim.size + 2 * Groups.size * SSMState.size)
Width = hax.Axis("width", 4)
Experts, TopK, Mlp = hax.Axis("experts", 4), hax.Axis("topk", 2), hax.Axis("mlp", 64)


def _init(key, axes, scale=None):
    fan_in = axes[0].size
    return hax.random.normal(key, axes) * (scale if scale is not None else fan_in**-0.5)


def rms_norm(x: hax.NamedArray, gain: hax.NamedArray) -> hax.NamedArray:
    return x * hax.rsqrt(hax.mean(hax.square(x), axis=Embed) + 1e-6) * gain


class Attention(eqx.Module):
    norm: hax.NamedArray
    wq: hax.NamedArray
    wk: hax.NamedArray
    wv: hax.NamedArray
    wo: hax.NamedArray

    @staticmethod
    def init(key):
        k = jax.random.split(key, 4)
        return Attention(
            hax.ones(Embed),
            _init(k[0], (Embed, Heads, HeadDim)),
            _init(k[1], (Embed, KVHeads, HeadDim)),
            _init(k[2], (Embed, KVHeads, HeadDim)),
            _init(k[3], (Heads, HeadDim, Embed), (Heads.size * HeadDim.size) ** -0.5),
        )

    def __call__(self, x, doc_ids):
        h = rms_norm(x, self.norm)
        q = hax.dot(h, self.wq, axis=Embed)
        k = hax.dot(h, self.wk, axis=Embed).rename({"position": "key_position"})
        v = hax.dot(h, self.wv, axis=Embed).rename({"position": "key_position"})
        mask = masks.Causal() & masks.Segments(doc_ids, doc_ids.rename({"position": "key_position"}))
        out = axkern.attention(q, k, v, mask=mask)
        return x + hax.dot(out, self.wo, axis=(Heads, HeadDim))


class Mamba2(eqx.Module):
    norm: hax.NamedArray
    w_in: hax.NamedArray  # embed -> conv channels (x, B, C)
    w_z: hax.NamedArray
    w_dt: hax.NamedArray
    conv: hax.NamedArray
    A_log: hax.NamedArray
    dt_bias: hax.NamedArray
    D: hax.NamedArray
    w_out: hax.NamedArray

    @staticmethod
    def init(key):
        k = jax.random.split(key, 5)
        return Mamba2(
            hax.ones(Embed),
            _init(k[0], (Embed, Conv)),
            _init(k[1], (Embed, SSMHeads, HeadDim)),
            _init(k[2], (Embed, SSMHeads)),
            _init(k[3], (Width, Conv), 0.5),
            hax.zeros(SSMHeads),
            hax.full(SSMHeads, -1.0),
            hax.ones(SSMHeads),
            _init(k[4], (SSMHeads, HeadDim, Embed), (SSMHeads.size * HeadDim.size) ** -0.5),
        )

    def __call__(self, x, doc_ids):
        h = rms_norm(x, self.norm)
        xbc = axkern.short_conv(
            hax.dot(h, self.w_in, axis=Embed), self.conv, Channel=Conv, segment_ids=doc_ids, activation="silu"
        )
        n_x, n_s = SSMHeads.size * HeadDim.size, Groups.size * SSMState.size
        lead = (xbc.resolve_axis("batch"), xbc.resolve_axis("position"))
        data = xbc.rearrange((*lead, Conv)).array
        shape = data.shape[:2]
        xs = hax.named(
            data[..., :n_x].reshape(*shape, SSMHeads.size, HeadDim.size), (*lead, SSMHeads, HeadDim)
        )
        B = hax.named(data[..., n_x : n_x + n_s].reshape(*shape, Groups.size, -1), (*lead, Groups, SSMState))
        C = hax.named(data[..., n_x + n_s :].reshape(*shape, Groups.size, -1), (*lead, Groups, SSMState))
        y = axkern.ssd(
            xs,
            hax.dot(h, self.w_dt, axis=Embed),
            -hax.exp(self.A_log),
            B,
            C,
            D=self.D,
            z=hax.dot(h, self.w_z, axis=Embed),
            dt_bias=self.dt_bias,
            dt_softplus=True,
            segment_ids=doc_ids,
            chunk_size=16,
        )
        return x + hax.dot(y, self.w_out, axis=(SSMHeads, HeadDim))


class MoE(eqx.Module):
    norm: hax.NamedArray
    router: hax.NamedArray
    w_in: jax.Array  # [experts, embed, mlp]
    w_out: jax.Array  # [experts, mlp, embed]

    @staticmethod
    def init(key):
        k = jax.random.split(key, 3)
        return MoE(
            hax.ones(Embed),
            _init(k[0], (Embed, Experts)),
            jax.random.normal(k[1], (Experts.size, Embed.size, Mlp.size)) * Embed.size**-0.5,
            jax.random.normal(k[2], (Experts.size, Mlp.size, Embed.size)) * Mlp.size**-0.5,
        )

    def __call__(self, x):
        h = rms_norm(x, self.norm)
        lead = (h.resolve_axis("batch"), h.resolve_axis("position"))
        logits = hax.dot(h, self.router, axis=Embed).rearrange((*lead, Experts))
        top_w, top_i = jax.lax.top_k(logits.array, TopK.size)
        topk_idx = hax.named(top_i, (*lead, TopK))
        topk_w = hax.named(jax.nn.softmax(top_w, axis=-1), (*lead, TopK))
        expert_x, group_sizes, routing = axkern.moe_dispatch(h, topk_idx, num_experts=Experts.size)
        rows = expert_x.rearrange(("dispatched", "embed")).array
        hidden = jax.nn.silu(jax.lax.ragged_dot(rows, self.w_in, group_sizes.array))
        out = jax.lax.ragged_dot(hidden, self.w_out, group_sizes.array)
        expert_y = hax.named(out, (expert_x.resolve_axis("dispatched"), Embed))
        return x + axkern.moe_combine(expert_y, topk_w, routing)


class TinyLM(eqx.Module):
    embed: hax.NamedArray
    attention: Attention
    mamba: Mamba2
    moe: MoE
    norm: hax.NamedArray
    lm_head: hax.NamedArray

    @staticmethod
    def init(key):
        k = jax.random.split(key, 5)
        return TinyLM(
            _init(k[0], (Vocab, Embed), 1.0),
            Attention.init(k[1]),
            Mamba2.init(k[2]),
            MoE.init(k[3]),
            hax.ones(Embed),
            _init(k[4], (Embed, Vocab)),
        )

    def loss(self, tokens, doc_ids):
        x = self.embed.take(Vocab, tokens)
        x = self.attention(x, doc_ids)
        x = self.mamba(x, doc_ids)
        x = self.moe(x)
        h = rms_norm(x, self.norm)
        # position t predicts t + 1 within its document
        targets = hax.roll(tokens, -1, "position")
        same_doc = hax.roll(doc_ids, -1, "position") == doc_ids
        pos = tokens.resolve_axis("position")
        keep = same_doc & (hax.arange(pos) < pos.size - 1)
        return axkern.fused_cross_entropy(h, self.lm_head, targets, where=keep)


def batch(key, batch: int = Batch.size, seq: int = Pos.size):
    """Packed documents of 4-16 tokens, each counting up (mod vocab) from a random start."""
    k1, k2 = jax.random.split(key)
    starts = jax.random.bernoulli(k1, 1 / 10, (batch, seq)).at[:, 0].set(True)
    doc = jnp.cumsum(starts, axis=1)
    offset = jax.random.randint(k2, (batch, seq), 0, Vocab.size)
    first = jnp.where(starts, jnp.arange(seq), 0)
    first = jax.lax.cummax(first, axis=1)
    start_tok = jnp.take_along_axis(offset, first, axis=1)
    tokens = (start_tok + jnp.arange(seq) - first) % Vocab.size
    return hax.named(tokens, (Batch.resize(batch), Pos.resize(seq))), hax.named(
        doc, (Batch.resize(batch), Pos.resize(seq))
    )


def adam(lr=1e-2, b1=0.9, b2=0.99, eps=1e-8):
    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return (zeros, zeros, jnp.zeros((), jnp.int32))

    def update(grads, state, params):
        m, v, t = state
        t = t + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        c1, c2 = 1 - b1**t, 1 - b2**t
        params = jax.tree.map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), params, m, v)
        return params, (m, v, t)

    return init, update


def make_step():
    _, update = adam()

    @eqx.filter_jit
    def step(model, opt_state, tokens, doc_ids):
        params, static = eqx.partition(model, eqx.is_array)
        loss, grads = jax.value_and_grad(lambda p: eqx.combine(p, static).loss(tokens, doc_ids))(params)
        params, opt_state = update(grads, opt_state, params)
        return eqx.combine(params, static), opt_state, loss

    return step


def train(steps: int = 10, seed: int = 0, log=print) -> list[float]:
    model = TinyLM.init(jax.random.PRNGKey(seed))
    init, _ = adam()
    opt_state = init(eqx.filter(model, eqx.is_array))
    step = make_step()
    tokens, doc_ids = batch(jax.random.PRNGKey(seed + 1))
    for decision in axkern.explain(lambda m: m.loss(tokens, doc_ids), model):
        log(decision)
    losses = []
    for i in range(steps):
        tokens, doc_ids = batch(jax.random.PRNGKey(seed + 1 + i))
        model, opt_state, loss = step(model, opt_state, tokens, doc_ids)
        losses.append(float(loss))
        log(f"step {i}: loss {losses[-1]:.4f}")
    return losses


def cases(*, preset=None, tokens=None, dtype=None):
    """`axkern bench --cases examples/tiny_lm.py`: one training step (forward, backward, update).
    Implementation `default` lets each op's dispatcher choose; `reference` runs every op's reference."""
    from axkern.bench import Case

    seq = tokens or Pos.size
    ops = ("attention", "short_conv", "ssd", "moe_dispatch", "moe_combine", "fused_cross_entropy")

    def make(key):
        model = TinyLM.init(key)
        toks, doc_ids = batch(jax.random.fold_in(key, 1), seq=seq)
        init, _ = adam()
        return model, init(eqx.filter(model, eqx.is_array)), toks, doc_ids

    def forward(impl, model, opt_state, toks, doc_ids):
        choice = {op: "reference" for op in ops} if impl == "reference" else {}
        with axkern.use(**choice):
            return make_step()(model, opt_state, toks, doc_ids)[2]

    return [
        Case(
            op="tiny_lm",
            label=f"train step B={Batch.size} S={seq} D={Embed.size} V={Vocab.size}",
            dims={"batch": Batch.size, "seq": seq, "embed": Embed.size, "vocab": Vocab.size},
            dtype="float32",
            make=make,
            forward=forward,
            loss=None,
            grad_argnums=(),
            flops_forward=0.0,
            flops_backward=0.0,
            passes=("fwd",),
        )
    ]


if __name__ == "__main__":
    losses = train(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
    sys.exit(0 if losses[-1] < losses[0] else 1)
