"""The shape every op folder shares, and the import rules that keep the oracle independent:
core never imports ops, implementations never import each other, `reference.py` imports only
jax, every `pallas_call` is named, and every op call runs under a named scope."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp

SRC = Path(__file__).resolve().parents[1] / "src" / "axkern"
OPS = sorted(p for p in (SRC / "ops").iterdir() if p.is_dir() and (p / "api.py").exists())
IMPLEMENTATIONS = {
    "reference",
    "xla",
    "xla_ragged",
    "pallas_gpu",
    "pallas_tpu",
    "mosaic_gpu",
    "cuda",
    "cudnn",
}
# api: the Ops, positional functions, role tables; named: the named functions over those tables
SHARED = {"__init__", "api", "named", "blocks", "common", "arg_specs"}


def _imports(path: Path) -> list[tuple[str, int]]:
    """`(absolute module, line)` for every import in `path`, relative ones resolved."""
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]
    return out


def test_every_op_folder_has_the_same_file_names():
    for op in OPS:
        names = {p.stem for p in op.glob("*.py")} | {
            p.name for p in op.iterdir() if p.is_dir() and p.name != "__pycache__" and p.name != "tuned"
        }
        unknown = names - IMPLEMENTATIONS - SHARED
        assert not unknown, f"{op.name}: files outside the op-folder shape: {sorted(unknown)}"
        assert {"api", "reference", "arg_specs"} <= names, (
            f"{op.name}: missing { ({'api', 'reference', 'arg_specs'} - names) }"
        )


def test_core_never_imports_ops():
    for path in (SRC / "core").rglob("*.py"):
        for mod, line in _imports(path):
            assert not mod.startswith("axkern.ops"), f"{path.relative_to(SRC)}:{line} imports {mod}"


def test_implementations_never_import_each_other():
    for op in OPS:
        pkg = f"axkern.ops.{op.name}"
        for impl in IMPLEMENTATIONS:
            path = op / f"{impl}.py"
            if not path.exists():
                continue
            for mod, line in _imports(path):
                other = mod[len(pkg) + 1 :].split(".")[0] if mod.startswith(pkg + ".") else None
                assert other not in IMPLEMENTATIONS - {impl}, f"{op.name}/{impl}.py:{line} imports {mod}"


def test_reference_imports_only_jax():
    for op in OPS:
        for mod, line in _imports(op / "reference.py"):
            assert mod == "__future__" or mod.startswith("__future__.") or mod.split(".")[0] == "jax", (
                f"{op.name}/reference.py:{line} imports {mod}: the oracle imports nothing but jax"
            )


def test_every_pallas_call_is_named():
    for path in (SRC / "ops").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "pallas_call":
                keywords = {k.arg for k in node.keywords}
                assert "name" in keywords, f"{path.relative_to(SRC)}:{node.lineno}: pallas_call without name="


def test_op_calls_run_under_a_named_scope():
    from axkern.positional import short_conv

    x = jnp.ones((1, 8, 4))
    w = jnp.ones((3, 4))
    text = jax.jit(lambda x, w: short_conv(x, w, implementation="xla")).lower(x, w).as_text(debug_info=True)
    assert "axkern.short_conv/xla" in text
