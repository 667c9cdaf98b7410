"""The dispatcher: order, fallback, warn-once, strict and explicit modes, env vars, explain."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import pytest

import axkern
from axkern.core import blocks, op, registry
from axkern.core.blocks import BlockSizes
from axkern.core.op import Implementation, Op, Unsupported


@dataclasses.dataclass(frozen=True)
class ToyBlocks(BlockSizes):
    block: int = 4

    def check(self, spec):
        if spec.dim("n") % self.block:
            return f"block={self.block} does not divide n={spec.dim('n')}"
        return None


calls: list[tuple[str, object]] = []


def _impl(
    name,
    *,
    supports=lambda spec: None,
    raises=None,
    blocked=False,
    platforms=("cpu", "gpu", "tpu"),
    interpretable=False,
):
    def fn(x, *, block_sizes=None, interpret=None, scale=1.0):
        if raises is not None:
            raise Unsupported(raises)
        calls.append((name, block_sizes, interpret))
        return x * scale + {"fast": 1.0, "slow": 2.0, "last": 3.0, "kernel": 4.0}.get(name, 0.0)

    return Implementation(
        name,
        fn,
        platforms=platforms,
        supports=supports,
        block_sizes=ToyBlocks if blocked else None,
        heuristic=(lambda spec: ToyBlocks(block=2)) if blocked else None,
        interpretable=interpretable,
    )


@pytest.fixture
def toy():
    """A throwaway op: `fast` serves only even n, `slow` always, `kernel` is a gpu-only interpretable one."""
    calls.clear()
    o = Op(
        "toy_op",
        [
            _impl(
                "fast",
                supports=lambda s: None if s.dim("n") % 2 == 0 else f"n={s.dim('n')} is odd",
                blocked=True,
            ),
            _impl("slow"),
            _impl("broken", raises="lowering failed: no such intrinsic"),
            _impl("kernel", platforms=("gpu",), interpretable=True),
        ],
        default_order={"cpu": ("fast", "slow"), "gpu": ("kernel", "fast", "slow")},
        package="tests.core",
        bucket=lambda spec: {"n": spec.dim("n")},
    )

    def call(x, **kw):
        spec = o.spec({"n": x.shape[0]}, x.dtype)
        return o(spec, x, **kw)

    yield o, call
    registry.OPS.pop("toy_op", None)


def test_default_order_picks_first_that_serves(toy):
    _, call = toy
    assert float(call(jnp.zeros(4))[0]) == 1.0  # fast
    assert calls[-1][0] == "fast"
    assert calls[-1][1] == ToyBlocks(block=2)  # heuristic


def test_fallback_warns_once_per_reason(toy):
    _, call = toy
    with pytest.warns(axkern.FallbackWarning, match="skipping 'fast': n=3 is odd"):
        assert float(call(jnp.zeros(3))[0]) == 2.0  # slow
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(jnp.zeros(3))  # same (op, impl, reason): silent
    with pytest.warns(axkern.FallbackWarning, match="n=5 is odd"):
        call(jnp.zeros(5))  # a new reason warns again


def test_strict_mode_raises_instead(toy, monkeypatch):
    _, call = toy
    with axkern.use(strict=True), pytest.raises(Unsupported, match="'fast' cannot serve.*n=3 is odd"):
        call(jnp.zeros(3))
    monkeypatch.setenv("AXKERN_STRICT", "1")
    with pytest.raises(Unsupported, match="n=3 is odd"):
        call(jnp.zeros(3))
    with axkern.use(strict=False), pytest.warns(axkern.FallbackWarning):  # use() beats the environment
        call(jnp.zeros(3))


def test_explicit_implementation_raises_instead_of_falling_back(toy):
    _, call = toy
    with pytest.raises(Unsupported, match="'fast' cannot serve this call: n=3 is odd"):
        call(jnp.zeros(3), implementation="fast")
    with pytest.raises(Unsupported, match="lowering failed"):
        call(jnp.zeros(4), implementation="broken")
    # an ordered tuple falls back within itself
    with pytest.warns(axkern.FallbackWarning, match="lowering failed"):
        assert float(call(jnp.zeros(4), implementation=("broken", "slow"))[0]) == 2.0
    with pytest.raises(
        ValueError, match="unknown implementation 'nope'; known: \\['broken', 'fast', 'kernel', 'slow'\\]"
    ):
        call(jnp.zeros(4), implementation="nope")


def test_unsupported_while_tracing_falls_back(toy):
    o, call = toy
    o.default_order["cpu"] = ("broken", "slow")
    with pytest.warns(axkern.FallbackWarning, match="skipping 'broken': lowering failed"):
        assert float(call(jnp.zeros(4))[0]) == 2.0


def test_all_fail_raises_with_every_reason(toy):
    o, call = toy
    o.default_order["cpu"] = ("broken", "fast")
    with (
        pytest.warns(axkern.FallbackWarning),
        pytest.raises(Unsupported, match="broken: lowering failed.*fast: n=3 is odd"),
    ):
        call(jnp.zeros(3))


def test_use_and_env_override_the_order(toy, monkeypatch):
    _, call = toy
    with axkern.use(toy_op="slow"):
        assert float(call(jnp.zeros(4))[0]) == 2.0
        with axkern.use(toy_op="fast"):  # innermost wins
            assert float(call(jnp.zeros(4))[0]) == 1.0
    monkeypatch.setenv("AXKERN_IMPL_TOY_OP", "slow")
    assert float(call(jnp.zeros(4))[0]) == 2.0
    assert float(call(jnp.zeros(4), implementation="fast")[0]) == 1.0  # the argument beats the env
    monkeypatch.setenv("AXKERN_IMPL_TOY_OP", "broken,slow")  # a list falls back
    with pytest.warns(axkern.FallbackWarning):
        assert float(call(jnp.zeros(4))[0]) == 2.0
    with pytest.raises(ValueError, match="unknown op 'no_such_op'"):
        with axkern.use(no_such_op="x"):
            pass


def test_bad_env_flag_is_an_error(toy, monkeypatch):
    _, call = toy
    monkeypatch.setenv("AXKERN_STRICT", "maybe")
    with pytest.raises(ValueError, match="AXKERN_STRICT='maybe'"):
        call(jnp.zeros(4))


def test_block_sizes_argument_table_heuristic(toy, monkeypatch):
    o, call = toy
    call(jnp.zeros(8), block_sizes=ToyBlocks(block=4))
    assert calls[-1][1] == ToyBlocks(block=4)
    call(jnp.zeros(8), block_sizes={"block": 8})  # a dict is accepted
    assert calls[-1][1] == ToyBlocks(block=8)
    with pytest.raises(ValueError, match="block=3 does not divide n=8"):
        call(jnp.zeros(8), block_sizes=ToyBlocks(block=3))
    with pytest.raises(ValueError, match="must be a positive int"):
        call(jnp.zeros(8), block_sizes=ToyBlocks(block=0))
    with pytest.raises(ValueError, match="unknown fields \\['blok'\\]"):
        call(jnp.zeros(8), block_sizes={"blok": 8})

    table = ({"implementation": "fast", "bucket": {"n": 8}, "block_sizes": {"block": 8}},)
    monkeypatch.setattr(blocks, "load_table", lambda package, key: table)
    d = axkern.explain(call, jnp.zeros(8))
    assert (d.block_sizes, d.block_source) == (ToyBlocks(block=8), "table")
    d = axkern.explain(call, jnp.zeros(6))
    assert (d.block_sizes, d.block_source) == (ToyBlocks(block=2), "heuristic")
    d = axkern.explain(lambda x: call(x, block_sizes=ToyBlocks(block=4)), jnp.zeros(8))
    assert d.block_source == "argument"


def test_invalid_tuned_entry_is_a_reason_not_a_crash(toy, monkeypatch):
    _, call = toy
    table = ({"implementation": "fast", "bucket": {"n": 6}, "block_sizes": {"block": 4}},)
    monkeypatch.setattr(blocks, "load_table", lambda package, key: table)
    d = axkern.explain(call, jnp.zeros(6))
    assert d.implementation == "slow"
    assert d.rejected[0].implementation == "fast"
    assert "block=4 does not divide n=6" in d.rejected[0].reason


def test_platform_and_interpret_mode(toy):
    o, call = toy
    # a gpu-only Pallas-style kernel on cpu: refused in the default order ...
    o.default_order["cpu"] = ("kernel", "slow")
    with pytest.warns(axkern.FallbackWarning, match="runs on gpu, not cpu .*interpret=True"):
        assert float(call(jnp.zeros(4))[0]) == 2.0
    # ... runs interpreted under use(interpret=True) ...
    with axkern.use(interpret=True):
        assert float(call(jnp.zeros(4))[0]) == 4.0
    assert calls[-1] == ("kernel", None, True)
    # ... and when requested explicitly
    d = axkern.explain(lambda x: call(x, implementation="kernel"), jnp.zeros(4))
    assert d.interpret and d.implementation == "kernel"
    assert "(interpret mode)" in str(d)
    with axkern.use(toy_op="kernel"):
        assert axkern.explain(call, jnp.zeros(4)).interpret


def test_an_order_skips_what_would_need_interpret_mode(toy):
    _, call = toy
    # named among others, a kernel off its platform is skipped for the next candidate ...
    d = axkern.explain(lambda x: call(x, implementation=("kernel", "slow")), jnp.zeros(4))
    assert d.implementation == "slow" and not d.interpret
    assert "runs on gpu, not cpu" in d.rejected[0].reason and "interpret=True" in d.rejected[0].reason
    with axkern.use(toy_op=("kernel", "slow")):
        assert axkern.explain(call, jnp.zeros(4)).implementation == "slow"
    # ... unless interpret mode was asked for
    with axkern.use(interpret=True):
        d = axkern.explain(lambda x: call(x, implementation=("kernel", "slow")), jnp.zeros(4))
    assert d.implementation == "kernel" and d.interpret


def test_fallback_warning_points_at_the_callers_line(toy):
    _, call = toy
    with pytest.warns(axkern.FallbackWarning, match="n=7 is odd") as record:
        call(jnp.zeros(7))
    assert record[0].filename == __file__
    # through jit and jaxtyping's checking wrapper of a real op, too
    op.reset_warnings()
    x, w = jnp.zeros((4, 8)), jnp.zeros((8, 16))
    labels = jnp.zeros((4,), jnp.int32)
    with pytest.warns(axkern.FallbackWarning) as record:
        jax.jit(
            lambda x, w: axkern.positional.fused_cross_entropy(
                x, w, labels, implementation=("pallas_tpu", "xla")
            )
        )(x, w)
    assert record[0].filename == __file__, record[0].filename


def test_unknown_axkern_variable_warns_once_naming_the_close_match(toy, monkeypatch):
    from axkern.core import config

    _, call = toy
    monkeypatch.setattr(config, "_warned_variables", set())
    monkeypatch.setenv("AXKERN_IMPL_TOY_OPP", "slow")
    with pytest.warns(
        UserWarning, match="AXKERN_IMPL_TOY_OPP .* ignored; did you mean AXKERN_IMPL_TOY_OP"
    ) as w:
        call(jnp.zeros(4))
    assert w[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(jnp.zeros(4))  # once
    monkeypatch.setenv("AXKERN_STICT", "1")
    with pytest.warns(UserWarning, match="AXKERN_STICT .*did you mean AXKERN_STRICT"):
        call(jnp.zeros(4))
    monkeypatch.setenv("AXKERN_IMPL_TOY_OP", "slow")  # a known one: silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(jnp.zeros(4))


def test_explain_runs_nothing_and_reports(toy):
    _, call = toy
    calls.clear()
    d = axkern.explain(call, jax.ShapeDtypeStruct((3,), jnp.float32))
    assert d.implementation == "slow"
    assert [r.implementation for r in d.rejected] == ["fast"]
    text = str(d)
    assert "toy_op: slow" in text and "skipped fast: n=3 is odd" in text and "n=3" in text
    # explain traces abstractly: the implementation saw tracers only, and nothing warned
    assert all(isinstance(c[1], (type(None), BlockSizes)) for c in calls)

    both = axkern.explain(lambda x: call(call(x)), jnp.zeros(4))
    assert isinstance(both, tuple) and len(both) == 2

    def outer_then_hidden(x):
        y = call(x)
        with op.unrecorded():  # what an implementation runs as part of itself
            return call(y)

    assert axkern.explain(outer_then_hidden, jnp.zeros(4)).implementation == "fast"
    with pytest.raises(ValueError, match="no axkern op was traced"):
        axkern.explain(lambda x: x + 1, jnp.zeros(4))


def test_explain_says_why_the_default_order_is_what_it_is(toy):
    o, call = toy
    o.order_notes["cpu"] = "kernel is left out here: slower than fast in the measured run"
    d = axkern.explain(call, jnp.zeros(4))
    assert d.order_note == o.order_notes["cpu"]
    assert "  order:       kernel is left out here: slower than fast in the measured run" in str(d)
    # a requested implementation is not the default order: no note
    assert axkern.explain(lambda x: call(x, implementation="slow"), jnp.zeros(4)).order_note == ""
    with axkern.use(toy_op="slow"):
        assert axkern.explain(call, jnp.zeros(4)).order_note == ""
    # a platform without a note says nothing more
    o.order_notes.clear()
    d = axkern.explain(call, jnp.zeros(4))
    assert d.order_note == "" and "order:" not in str(d)


def test_jit_retraces_under_new_settings(toy):
    _, call = toy
    f = jax.jit(lambda x: call(x))
    assert float(f(jnp.zeros(4))[0]) == 1.0
    with axkern.use(toy_op="slow"):
        assert float(f(jnp.zeros(4))[0]) == 2.0  # the settings are part of jit's cache key
    assert float(f(jnp.zeros(4))[0]) == 1.0


def test_registry():
    assert "fused_cross_entropy" in axkern.ops()
    assert set(axkern.implementations("fused_cross_entropy")) >= {"xla", "reference"}
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        axkern.implementations("nope")


def test_default_order_may_depend_on_the_call(toy):
    o, call = toy
    o.default_order["cpu"] = lambda spec: ("slow", "fast") if spec.dim("n") > 4 else ("fast", "slow")
    assert axkern.explain(call, jnp.zeros(4)).implementation == "fast"
    assert axkern.explain(call, jnp.zeros(6)).implementation == "slow"


def test_use_takes_effect_in_jitted_functions():
    """A `use(...)` change reaches a function that `eqx.filter_jit` / `jax.jit` already compiled."""
    import equinox as eqx
    import haliax as hax

    import axkern

    Pos, Embed, Width = hax.Axis("position", 8), hax.Axis("embed", 4), hax.Axis("width", 3)
    x = hax.random.normal(jax.random.PRNGKey(0), (Pos, Embed))
    w = hax.random.normal(jax.random.PRNGKey(1), (Width, Embed))
    traces = []

    @eqx.filter_jit
    def f(x, w):
        traces.append(1)
        return axkern.short_conv(x, w)

    f(x, w)
    f(x, w)
    assert len(traces) == 1
    with axkern.use(strict=True, short_conv=("pallas_tpu", "xla")):
        with pytest.raises(axkern.Unsupported, match="pallas_tpu"):
            f(x, w)  # traced again: strict mode refuses the fallback past pallas_tpu
    f(x, w)  # outside the block: the first trace again
    assert len(traces) == 2
    xs = x.array[None]
    g = jax.jit(lambda x: axkern.positional.short_conv(x, w.array))
    g(xs)
    with axkern.use(short_conv="reference"):
        d = axkern.explain(lambda x: axkern.positional.short_conv(x, w.array), xs)
        assert d.implementation == "reference"
        assert g(xs).shape == xs.shape


def test_an_eager_call_runs_its_implementation_as_one_compiled_program(toy):
    _, call = toy
    x = jnp.arange(4.0)
    assert call(x, scale=2.0).tolist() == [1.0, 3.0, 5.0, 7.0]
    assert call(x + 1, scale=2.0).tolist() == [3.0, 5.0, 7.0, 9.0]  # the same program again
    assert len(calls) == 1  # traced once: the second call ran the compiled program
    assert call(x, scale=3.0).tolist() == [1.0, 4.0, 7.0, 10.0] and len(calls) == 2  # other options
    assert call(x, scale=2).tolist() == [1.0, 3.0, 5.0, 7.0] and len(calls) == 3  # an int is not 2.0
    # under a trace the implementation is traced with the caller's program each time
    assert jax.jit(lambda a: call(a, scale=2.0))(x).tolist() == [1.0, 3.0, 5.0, 7.0] and len(calls) == 4
    # an option that is not a plain value (compared by identity) runs as it is, op by op
    assert call(x, scale=jnp.float32(2.0)).tolist() == [1.0, 3.0, 5.0, 7.0] and len(calls) == 5
    assert call(x, scale=jnp.float32(2.0)).tolist() == [1.0, 3.0, 5.0, 7.0] and len(calls) == 6


@pytest.mark.parametrize("form", ["positional", "named"])
@pytest.mark.parametrize("name", ["triton", ("xla", "triton")])
def test_an_unknown_implementation_name_of_a_public_op_is_a_value_error(form, name):
    # the positional signature's Literal names the implementations: a name outside it is the
    # dispatcher's ValueError, as the guide says, not the signature checker's type error
    import haliax as hax

    Batch, Vocab = hax.Axis("batch", 4), hax.Axis("vocab", 10)
    logits, labels = hax.zeros((Batch, Vocab)), hax.zeros(Batch, dtype=jnp.int32)
    if form == "named":
        call = lambda: axkern.cross_entropy(logits, labels, implementation=name)  # noqa: E731
    else:
        call = lambda: axkern.positional.cross_entropy(logits.array, labels.array, implementation=name)  # noqa: E731
    with pytest.raises(
        ValueError, match=r"cross_entropy: unknown implementation 'triton'; known: \['reference', 'xla'\]"
    ):
        call()


@pytest.mark.parametrize("setting", ["strict", "interpret", "autotune"])
@pytest.mark.parametrize("value", ["no", "0", 0, 1, "true"])
def test_use_takes_only_a_bool_or_none(setting, value):
    with pytest.raises(TypeError, match=rf"use\({setting}={value!r}\): expected True, False or None"):
        with axkern.use(**{setting: value}):
            pass
    with axkern.use(**{setting: None}):
        assert getattr(axkern.core.config.current(), setting) is False


def test_every_positional_signature_names_the_implementations_of_its_op():
    # the names the signature checks before the dispatcher runs are the op's own
    import inspect

    from axkern import positional
    from axkern.core import typing as axtyping

    checked = 0
    for name in dir(positional):
        fn = getattr(positional, name)
        inner = getattr(fn, "__wrapped__", None)
        if inner is None or "implementation" not in inspect.signature(fn).parameters:
            continue
        op_name = inner.__name__.removesuffix("_positional")
        assert axtyping._literal_names(inner) == set(registry.get_op(op_name).implementations), name
        checked += 1
    assert checked >= 10
