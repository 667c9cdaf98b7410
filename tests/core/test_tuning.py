"""The tuning path: the per-user cache, the dispatcher's order (cache > table > heuristic), the
sweep's check against the reference, autotuning on a miss, and `axkern tune`."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import warnings

import jax
import jax.numpy as jnp
import pytest

import axkern
from axkern import cli
from axkern.bench import Case, tune
from axkern.core import blocks, compat, op, registry, tuning
from axkern.core.op import Implementation, Op


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "cache_path", lambda key: tmp_path / "tuning" / f"{key}.json")
    return tmp_path / "tuning"


def test_cache_root_is_the_environment_variable_or_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AXKERN_CACHE_DIR", str(tmp_path))
    assert tuning.cache_root() == tmp_path
    monkeypatch.delenv("AXKERN_CACHE_DIR")
    assert tuning.cache_root().name == "axkern"


def _entry(op_name, impl, bucket, bs):
    return {"op": op_name, "implementation": impl, "bucket": bucket, "block_sizes": bs}


def test_store_merges_replaces_and_looks_up(cache):
    assert tuning.read_cache("cpu") == ()
    tuning.store(
        "cpu", [_entry("a", "xla", {"n": 8}, {"block": 4}), _entry("a", "xla", {"n": 16}, {"block": 8})]
    )
    tuning.store("cpu", [_entry("a", "xla", {"n": 8}, {"block": 2})])
    assert tuning.lookup("cpu", "a", "xla", {"n": 8}) == {"block": 2}
    assert tuning.lookup("cpu", "a", "xla", {"n": 16}) == {"block": 8}
    assert tuning.lookup("cpu", "a", "pallas_gpu", {"n": 8}) is None
    assert tuning.lookup("cpu", "b", "xla", {"n": 8}) is None
    assert len(json.loads((cache / "cpu.json").read_text())["entries"]) == 2


def test_a_corrupt_cache_names_its_file(cache):
    cache.mkdir(parents=True)
    (cache / "cpu.json").write_text("{not json")
    with pytest.raises(ValueError, match="cpu.json"):
        tuning.read_cache("cpu")


def _store_one(i: int) -> None:
    for j in range(5):
        tuning.store("cpu", [_entry("op", "xla", {"writer": i, "n": j}, {"block": j + 1})])


def test_concurrent_writers_keep_every_entry(cache):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fork after JAX started: the children use no JAX
        ctx = multiprocessing.get_context("fork")
        procs = [ctx.Process(target=_store_one, args=(i,)) for i in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    entries = json.loads((cache / "cpu.json").read_text())["entries"]
    assert sorted((e["bucket"]["writer"], e["bucket"]["n"]) for e in entries) == [
        (i, j) for i in range(4) for j in range(5)
    ]


# -- a toy op: a blocked sum whose block size 3 is wrong -----------------------------------------


@dataclasses.dataclass(frozen=True)
class _Blocks(blocks.BlockSizes):
    block: int = 4


def _blocked_sum(x, *, block_sizes):
    b = block_sizes.block
    n = x.shape[0]
    parts = [jnp.sum(x[i : i + b], axis=0) for i in range(0, n, b)]
    total = sum(parts)
    return total + (1.0 if b == 3 else 0.0)  # a broken kernel at one block size


@pytest.fixture
def toy(cache):
    toy_op = Op(
        "tuning_toy",
        [
            Implementation(
                "xla",
                _blocked_sum,
                block_sizes=_Blocks,
                heuristic=lambda spec: _Blocks(block=4),
                space=lambda spec: [_Blocks(block=b) for b in (2, 3, 8)],
            ),
            Implementation("reference", lambda x: jnp.sum(x, axis=0)),
        ],
        default_order={"cpu": ("xla",)},
        package="axkern.ops.ssd",  # ships no cpu table
        bucket=lambda spec: dict(spec.dims) | {"dtype": spec.dtype},
    )

    def call(x, implementation=None):
        return toy_op(
            toy_op.spec({"n": x.shape[0], "d": x.shape[1]}, x.dtype), x, implementation=implementation
        )

    yield toy_op, call
    registry.OPS.pop("tuning_toy", None)


def _toy_case(call):
    return Case(
        op="tuning_toy",
        label="n=16 d=4",
        dims={"n": 16, "d": 4},
        dtype="float32",
        make=lambda key: (jax.random.normal(key, (16, 4)),),
        forward=lambda impl, x: call(x, impl),
        loss=None,
        grad_argnums=(0,),
        flops_forward=64.0,
        flops_backward=64.0,
    )


def test_sweep_rejects_a_wrong_candidate_and_stores_the_fastest_right_one(toy):
    toy_op, call = toy
    result = tune.sweep(_toy_case(call), "xla", repeats=1)
    tried = [bs.block for bs, _ in result.rows]
    assert tried == [4, 2, 3, 8]  # the heuristic's first
    rows = dict((bs.block, r) for bs, r in result.rows)
    assert not result.accepted(rows[3])
    assert all(result.accepted(rows[b]) for b in (2, 4, 8))
    assert all(r.ms_min <= r.ms <= r.ms_max for r in rows.values())
    assert result.best.block != 3 and result.best_row.ms == min(rows[b].ms for b in (2, 4, 8))
    tune.save([result], command="test")
    x = jnp.ones((16, 4))
    d = axkern.explain(call, x)
    assert (d.block_source, d.block_sizes) == ("cache", result.best)


def test_cache_comes_before_the_table_and_the_table_before_the_heuristic(toy, monkeypatch):
    toy_op, call = toy
    x = jnp.ones((16, 4))
    assert axkern.explain(call, x).block_source == "heuristic"
    bucket = {"n": 16, "d": 4, "dtype": "float32"}
    table = ({"op": "tuning_toy", "implementation": "xla", "bucket": bucket, "block_sizes": {"block": 2}},)
    monkeypatch.setattr(blocks, "load_table", lambda package, key: table)
    d = axkern.explain(call, x)
    assert (d.block_source, d.block_sizes) == ("table", _Blocks(block=2))
    tuning.store("cpu", [_entry("tuning_toy", "xla", bucket, {"block": 8})])
    d = axkern.explain(call, x)
    assert (d.block_source, d.block_sizes) == ("cache", _Blocks(block=8))
    assert "(from cache)" in str(d)


def test_a_sweeps_candidate_wins_over_the_cases_own_block_sizes(toy):
    toy_op, call = toy
    x = jnp.ones((16, 4))
    explicit = lambda x: toy_op(toy_op.spec({"n": 16, "d": 4}, x.dtype), x, block_sizes={"block": 2})  # noqa: E731
    assert axkern.explain(explicit, x).block_source == "argument"
    with tuning.forced("tuning_toy", "xla", {"block": 8}):
        d = axkern.explain(explicit, x)
    assert (d.block_source, d.block_sizes) == ("tuning", _Blocks(block=8))


def test_replaced_fields_go_over_the_cache_and_the_heuristic_not_an_argument(toy):
    toy_op, call = toy
    x = jnp.ones((16, 4))
    with tuning.replaced("tuning_toy", "xla", {"block": 2}):
        d = axkern.explain(call, x)
        assert (d.block_source, d.block_sizes) == ("replaced", _Blocks(block=2))
        assert "(from replaced)" in str(d)
    bucket = {"n": 16, "d": 4, "dtype": "float32"}
    tuning.store("cpu", [_entry("tuning_toy", "xla", bucket, {"block": 8})])
    assert axkern.explain(call, x).block_sizes == _Blocks(block=8)
    with tuning.replaced("tuning_toy", "xla", {"block": 2}):  # over the cache's 8 too
        assert axkern.explain(call, x).block_sizes == _Blocks(block=2)
        explicit = lambda x: toy_op(toy_op.spec({"n": 16, "d": 4}, x.dtype), x, block_sizes={"block": 4})  # noqa: E731
        assert axkern.explain(explicit, x).block_sizes == _Blocks(block=4)  # an argument stays
    with tuning.replaced("tuning_toy", "reference", {"block": 2}):  # another implementation's
        assert axkern.explain(call, x).block_sizes == _Blocks(block=8)
    assert tuning.replaced_fields("tuning_toy", "xla") is None


def test_a_function_jitted_outside_a_replacement_is_traced_again_inside(toy):
    if compat.jit_context(None) is None:  # pragma: no cover - a jax without user contexts
        pytest.skip("this jax has no jit cache context (jax.make_user_context)")
    toy_op, call = toy
    traced = []
    f = jax.jit(lambda x: traced.append(axkern.explain(call, x).block_sizes.block) or call(x))
    x = jnp.ones((16, 4))
    f(x)
    with tuning.replaced("tuning_toy", "xla", {"block": 3}):  # the broken block size: seen in the value
        got = f(x)
    f(x)
    assert traced == [4, 3] and float(got[0]) == 17.0 and float(f(x)[0]) == 16.0


def test_autotune_is_off_by_default_and_tunes_a_miss_when_asked(toy, cache):
    toy_op, call = toy
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 4))
    jax.jit(call)(x)
    assert not (cache / "cpu.json").exists()
    with axkern.use(autotune=True):
        got = jax.jit(call)(x)
    assert jnp.allclose(got, x.sum(0), atol=1e-5)
    (e,) = json.loads((cache / "cpu.json").read_text())["entries"]
    assert e["op"] == "tuning_toy" and e["block_sizes"]["block"] != 3
    assert axkern.explain(call, x).block_source == "cache"


def test_autotune_without_a_registered_autotuner_says_so(toy, cache):
    toy_op, call = toy
    registered = tuning.autotuner()  # `import axkern` registers one
    tuning.register_autotuner(None)
    try:
        with axkern.use(autotune=True), pytest.raises(RuntimeError, match="no autotuner is registered"):
            call(jnp.ones((16, 4)))
    finally:
        tuning.register_autotuner(registered)
    assert not (cache / "cpu.json").exists()


def test_autotune_runs_inside_a_sharded_named_call(cache, monkeypatch):
    # the sweep runs eagerly inside the caller's shard_map trace, outside its mesh; over two of
    # xla's tiles (each candidate is a compile: the sweep's place is what this checks; every
    # space's candidates are validated in test_every_tunable_space_validates_and_starts_with_the_heuristic)
    import haliax as hax
    import numpy as np
    from jax.sharding import Mesh

    from axkern import masks

    attention = op.get_op("attention")
    xla = attention.implementations["xla"]
    two = dataclasses.replace(xla, space=lambda spec: xla.space(spec)[:2])
    monkeypatch.setitem(attention.implementations, "xla", two)
    Batch, Pos, Heads, HeadDim = (
        hax.Axis(n, s) for n, s in (("batch", 4), ("position", 32), ("heads", 8), ("head_size", 8))
    )
    q = hax.random.normal(jax.random.PRNGKey(0), (Batch, Pos, Heads, HeadDim))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    call = lambda q: axkern.attention(q, q, q, mask=masks.Causal(), implementation="xla")  # noqa: E731
    want = call(q)
    with axkern.use(autotune=True), hax.partitioning.set_mesh(mesh):
        with hax.axis_mapping({"batch": "data", "heads": "model"}):
            got = jax.jit(call)(q)
    np.testing.assert_allclose(np.asarray(got.array), np.asarray(want.array), rtol=1e-5, atol=1e-5)
    (e,) = json.loads((cache / "cpu.json").read_text())["entries"]
    assert e["op"] == "attention" and e["implementation"] == "xla"


def test_autotune_reads_the_environment(monkeypatch):
    monkeypatch.setenv("AXKERN_AUTOTUNE", "1")
    assert axkern.core.config.current().autotune is True
    with axkern.use(autotune=False):
        assert axkern.core.config.current().autotune is False


def test_cli_tune_stores_in_the_cache_and_writes_the_table(cache, tmp_path, monkeypatch, capsys):
    table = tmp_path / "table" / "cpu.json"
    monkeypatch.setattr(tune, "table_path", lambda op_name, key: table)
    argv = ["tune", "fused_cross_entropy_loss", "--tokens", "16", "--repeats", "1", "--write-table"]
    assert cli.main(argv + ["--source", "here"]) == 0
    (e,) = json.loads((cache / "cpu.json").read_text())["entries"]
    assert e["op"] == "fused_cross_entropy_loss" and e["implementation"] == "xla"
    assert e["command"].startswith("axkern tune fused_cross_entropy_loss")
    assert set(e["ms"]) == {"min", "median", "max"}
    (t,) = json.loads(table.read_text())["entries"]
    assert t["block_sizes"] == e["block_sizes"] and t["source"] == "here"
    assert "best" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["tune", "nope"], "OP: unknown op"),
        (["tune", "cross_entropy"], "tunable implementation"),
        (["tune", "ssd", "--impl", "cudnn"], "--impl: expected tunable"),
        (["tune", "ssd", "--source", "x"], "--source: expected with --write-table"),
        (["tune", "fused_cross_entropy_loss", "--only", "no-such-case"], "--only: expected parts of these"),
    ],
)
def test_cli_tune_usage_errors(argv, expected, capsys):
    assert cli.main(argv) == 2
    assert expected in capsys.readouterr().err


_DIMS = {
    "fused_cross_entropy": {"tokens": 4096, "embed": 1024, "vocab": 32768},
    "fused_cross_entropy_loss": {"tokens": 4096, "embed": 1024, "vocab": 32768},
    "attention": {
        "batch": 1,
        "q_len": 512,
        "kv_len": 512,
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 64,
        "v_dim": 64,
    },
    "short_conv": {"batch": 2, "seq": 512, "channels": 1024, "width": 4},
    "ssd": {"batch": 1, "length": 1024, "heads": 4, "head_dim": 64, "state": 64, "groups": 1},
    "mamba3": {
        "batch": 1,
        "length": 1024,
        "heads": 4,
        "head_dim": 64,
        "state": 64,
        "groups": 1,
        "rank": 1,
        "n_angles": 16,
    },
}


def test_every_tunable_space_validates_and_starts_with_the_heuristic():
    for name, o in op.registered_ops().items():
        for impl in o.implementations.values():
            if impl.space is None:
                continue
            spec = o.spec(_DIMS[name], jnp.bfloat16)
            cands = tune.candidates(impl, spec)
            assert len(cands) > 1 and all(c.validate(spec) is None for c in cands)
            assert cands[0] == impl.heuristic(spec)


def test_bench_checks_a_peer_unless_it_computes_something_else(toy):
    from axkern import bench

    _, call = toy

    def wrong(x):
        return jnp.sum(x, axis=0) + 1.0

    def other(x):
        return jnp.sum(x, axis=0) * 2.0

    other.incomparable = "a doubled sum"
    case = dataclasses.replace(_toy_case(call), peers={"wrong": wrong, "other": other})
    rows = {
        r.implementation: r
        for r in bench.measure(case, ["peer:wrong", "peer:other"], passes=("fwd",), repeats=1)
    }
    assert rows["peer:wrong"].max_rel_error > 0.01
    assert rows["peer:other"].max_rel_error is None and rows["peer:other"].ms is not None
    assert rows["peer:other"].note == "not checked: a doubled sum"


# -- a cache that cannot be read or written -------------------------------------------------------

_BUCKET = {"n": 16, "d": 4, "dtype": "float32"}


def _file(entries) -> bytes:
    return json.dumps({"device_key": "cpu", "entries": entries}).encode()


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (_file([1]), r"entry 0 .*not an object"),
        (_file([{"op": "tuning_toy", "implementation": "xla", "bucket": _BUCKET}]), r"entry 0 .*block_sizes"),
        (
            _file([{"op": "tuning_toy", "implementation": "xla", "bucket": _BUCKET, "block_sizes": [8]}]),
            r"entry 0 .*block_sizes",
        ),
        (
            _file([_entry("tuning_toy", "xla", _BUCKET, {"block": 8, "blok": 2})]),
            r"entry 0 \(tuning_toy/xla .*unknown fields \['blok'\]",
        ),
        (_file([_entry("tuning_toy", "xla", _BUCKET, {"block": 0})]), r"entry 0 .*positive int, got 0"),
        (_file([_entry("tuning_toy", "xla", _BUCKET, {"block": "8"})]), r"entry 0 .*positive int, got '8'"),
        (b'{"entries": 1}', "not a tuning cache"),
        (b"[]", "not a tuning cache"),
        (b'{"entries": [\xff\xfe]}', "cannot be read"),
        (b"{not json", "cannot be read"),
    ],
    ids=[
        "entry-not-an-object",
        "no-block-sizes",
        "block-sizes-a-list",
        "unknown-field",
        "zero",
        "a-string",
        "entries-not-a-list",
        "not-an-object",
        "not-utf8",
        "not-json",
    ],
)
def test_a_malformed_cache_warns_naming_the_file_and_the_table_serves(toy, cache, monkeypatch, content, says):
    toy_op, call = toy
    table = ({"op": "tuning_toy", "implementation": "xla", "bucket": _BUCKET, "block_sizes": {"block": 2}},)
    monkeypatch.setattr(blocks, "load_table", lambda package, key: table)
    cache.mkdir(parents=True)
    (cache / "cpu.json").write_bytes(content)
    x = jnp.arange(64.0).reshape(16, 4)
    with pytest.warns(tuning.CacheWarning, match=r"cpu\.json.*" + says):
        d = axkern.explain(call, x)
    assert (d.block_source, d.block_sizes) == ("table", _Blocks(block=2))
    monkeypatch.setattr(blocks, "load_table", lambda package, key: ())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per file
        d = axkern.explain(call, x)
        assert (d.block_source, d.block_sizes) == ("heuristic", _Blocks(block=4))
        assert jnp.array_equal(call(x), x.sum(0))


def test_a_cache_entry_of_another_shape_or_with_unknown_fields_of_its_own_is_fine(toy, cache):
    toy_op, call = toy
    cache.mkdir(parents=True)
    good = _entry("tuning_toy", "xla", _BUCKET, {"block": 8}) | {"ms": {"median": 1.0}, "extra": [1]}
    other = _entry("other_op", "xla", {"n": 1}, {"whatever": 0})
    (cache / "cpu.json").write_bytes(json.dumps({"entries": [other, good], "more": 1}).encode())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = axkern.explain(call, jnp.ones((16, 4)))
    assert (d.block_source, d.block_sizes) == ("cache", _Blocks(block=8))


def test_a_tuning_folder_that_is_a_file_warns_and_the_heuristic_serves(toy, cache):
    toy_op, call = toy
    cache.write_text("")  # `tuning` is a plain file
    with pytest.warns(tuning.CacheWarning, match=r"tuning/cpu\.json cannot be read"):
        d = axkern.explain(call, jnp.ones((16, 4)))
    assert (d.block_source, d.block_sizes) == ("heuristic", _Blocks(block=4))


@pytest.fixture(params=["under-a-file", "permission-denied"])
def unwritable(request, cache, tmp_path, monkeypatch):
    """A cache that cannot be written. Made by a path below a regular file, or by a write that
    raises PermissionError: a read-only mode would not stop the tests when they run as root."""
    if request.param == "under-a-file":
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "tuning" / "cpu.json"
        monkeypatch.setattr(tuning, "cache_path", lambda key: path)
        return path

    def refused(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(tuning, "write_json", refused)
    return cache / "cpu.json"


def test_autotune_into_an_unwritable_cache_uses_the_winner_and_warns(toy, unwritable, monkeypatch):
    toy_op, call = toy
    monkeypatch.setattr(tune, "_unkept", {})  # winners this process could not keep
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 4))
    with axkern.use(autotune=True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = call(x)
        d = axkern.explain(call, x)  # explain never sweeps: the winner was not kept
    assert jnp.allclose(got, x.sum(0), atol=1e-5)
    kept = [str(w.message) for w in caught if issubclass(w.category, tuning.CacheWarning)]
    assert any(str(unwritable) in m and "could not be kept" in m for m in kept), kept
    assert d.block_source == "heuristic"


def test_cli_tune_into_an_unwritable_cache_prints_the_winner_and_says_it_was_not_kept(unwritable, capsys):
    argv = ["tune", "fused_cross_entropy_loss", "--tokens", "16", "--repeats", "1"]
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert "best" in out  # the sweep's table marks the winner
    assert str(unwritable) in err and "not kept" in err
