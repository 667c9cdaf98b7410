"""`axkern tune` on a TPU (faked on the CPU: JAX's platform and device kind of a v5e): the winners go
into the op's `tuned/tpu_v5e.json`, and the dispatcher on that chip reads them back from there."""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp
import pytest

import axkern
from axkern import cli
from axkern.bench import tune
from axkern.core import backend, blocks, tuning


@pytest.fixture
def tpu_v5e(tmp_path, monkeypatch):
    """A TPU v5e as JAX names it, a fresh tuning cache, and a package `tables_here` whose `tuned/`
    folder stands in for the op's (the shipped tables stay untouched)."""
    monkeypatch.setattr(backend, "platform", lambda: "tpu")
    monkeypatch.setattr(backend, "device_kind", lambda: "TPU v5 lite")
    monkeypatch.setenv("AXKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "cache_path", lambda key: tmp_path / "cache" / f"{key}.json")
    package = tmp_path / "packages" / "tables_here"
    (package / "tuned").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setattr(tune, "table_path", lambda op, key: package / "tuned" / f"{key}.json")
    blocks.load_table.cache_clear()
    yield package
    blocks.load_table.cache_clear()
    sys.modules.pop("tables_here", None)


def test_the_tpu_table_is_the_op_folders_tuned_file_named_by_the_chip():
    assert backend.key_for("TPU v5 lite") == "tpu_v5e"
    path = tune.table_path("fused_cross_entropy_loss", "tpu_v5e")
    assert path.parts[-4:] == ("ops", "fused_cross_entropy", "tuned", "tpu_v5e.json")


def test_tune_on_a_tpu_writes_its_table_and_the_dispatcher_reads_it_back(tpu_v5e, monkeypatch, capsys):
    op = "fused_cross_entropy_loss"
    argv = ["tune", op, "--impl", "xla", "--tokens", "16", "--repeats", "1", "--write-table"]
    assert cli.main(argv) == 0
    table = json.loads((tpu_v5e / "tuned" / "tpu_v5e.json").read_text())
    assert table["device_key"] == "tpu_v5e"
    (entry,) = table["entries"]
    assert entry["op"] == op and entry["implementation"] == "xla"
    out = "".join(capsys.readouterr().out.split())  # the console folds long lines
    assert f"shippedtable:{tpu_v5e / 'tuned' / 'tpu_v5e.json'}" in out
    # the dispatcher on the chip: the cache (which the tuner also filled) emptied, the table serves
    (tuning.cache_path("tpu_v5e")).unlink()
    found = blocks.lookup("tables_here", "tpu_v5e", "xla", entry["bucket"], op=op)
    assert found == entry["block_sizes"]
    lookup = blocks.lookup
    monkeypatch.setattr(blocks, "lookup", lambda package, *a, **k: lookup("tables_here", *a, **k))
    x, w = jnp.ones((16, 256), jnp.float32), jnp.ones((256, 4096), jnp.float32)
    labels = jnp.zeros((16,), jnp.int32)
    decision = axkern.explain(
        lambda x, w, y: axkern.positional.fused_cross_entropy_loss(x, w, y, implementation="xla"),
        x,
        w,
        labels,
    )
    assert decision.spec.device_key == "tpu_v5e" and decision.block_source == "table"
    assert decision.block_sizes.as_dict() | entry["block_sizes"] == decision.block_sizes.as_dict()
