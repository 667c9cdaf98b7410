"""The house's structure, enforced: the shape every op folder shares, and the import rules that keep the
layers apart. `core/` imports nothing above it; the tooling (`bench/`, `cli/`) sits above the library and
nothing in the library imports it; implementations never import each other; one op folder never imports
another's (the chunked engine in `ops/chunked/` is shared); no private name crosses a module boundary; no
import circle anywhere; `reference.py` imports only jax; every `pallas_call` is named; every op call runs
under a named scope; an implementation with a block-size heuristic declares a space for the tuner; no source
file much over 500 lines; comments and docstrings carry no measurements."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import jax
import jax.numpy as jnp

SRC = Path(__file__).resolve().parents[1] / "src" / "axkern"
OPS = sorted(p for p in (SRC / "ops").iterdir() if p.is_dir() and (p / "api.py").exists())
ENGINES = {"chunked"}  # folders under ops/ that several ops share; not ops themselves
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
# api: the Ops and positional functions; named: the named functions over haliax arrays
SHARED = {"__init__", "api", "named", "blocks", "common", "arg_specs"}
# the package root holds the library's entry points only; the tooling lives in bench/ and cli/
ROOT_MODULES = {"__init__", "__main__", "positional", "masks", "haliax_compat"}
ROOT_PACKAGES = {"core", "ops", "bench", "cli", "levanter"}
TOOLING = ("axkern.bench", "axkern.cli")
MAX_LINES = 520  # "about 500": a longer file holds two ideas


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in SRC.rglob("*.py")}


def _package(path: Path) -> str:
    module = _module(path)
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _from_base(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = _package(path).split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path) -> list[tuple[str, int]]:
    """`(absolute module, line)` for every import in `path` (function-local ones too), relative ones
    resolved; `from m import n` gives both `m` and `m.n`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_base(path, node)
            out.append((mod, node.lineno))
            out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]
    return out


def _edges(path: Path) -> set[str]:
    """The axkern modules `path` imports: `from p import m` names the module `p.m` where `m` is one
    (not the package `p`, whose `__init__` runs first anyway), else `p`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            mod = _from_base(path, node)
            for a in node.names:
                if f"{mod}.{a.name}" in MODULES:
                    out.add(f"{mod}.{a.name}")
                elif mod in MODULES:
                    out.add(mod)
    out.discard(_module(path))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_every_op_folder_has_the_same_file_names():
    for op in OPS:
        names = {p.stem for p in op.glob("*.py")} | {
            p.name for p in op.iterdir() if p.is_dir() and p.name not in ("__pycache__", "tuned")
        }
        unknown = names - IMPLEMENTATIONS - SHARED
        assert not unknown, f"{op.name}: files outside the op-folder shape: {sorted(unknown)}"
        required = {"api", "named", "reference", "arg_specs"}
        assert required <= names, f"{op.name}: missing {sorted(required - names)}"


def _implementation_module(op: Path, impl: str) -> Path | None:
    for path in (op / f"{impl}.py", op / impl / "__init__.py"):
        if path.exists():
            return path
    return None


def test_every_implementation_module_exports_its_implementation():
    # `IMPLEMENTATION = Implementation(...)` (or `<OP>_IMPLEMENTATION` where one module serves several
    # Ops) at module level; api.py builds its Ops from them and builds only the oracle's itself
    for op in OPS:
        for impl in sorted(IMPLEMENTATIONS - {"reference"}):
            path = _implementation_module(op, impl)
            if path is None:
                continue
            exported = [
                t.id
                for node in ast.parse(path.read_text()).body
                if isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", getattr(node.value.func, "attr", None)) == "Implementation"
                for t in node.targets
                if isinstance(t, ast.Name) and (t.id == "IMPLEMENTATION" or t.id.endswith("_IMPLEMENTATION"))
            ]
            assert exported, f"{path.relative_to(SRC)}: no module-level IMPLEMENTATION = Implementation(...)"
        for node in ast.walk(ast.parse((op / "api.py").read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Implementation":
                first = node.args[0] if node.args else None
                assert isinstance(first, ast.Constant) and first.value == "reference", (
                    f"{op.name}/api.py:{node.lineno}: an implementation's Implementation is built in api.py "
                    "(it belongs to its own module)"
                )


def test_core_imports_nothing_above_it():
    for path in (SRC / "core").rglob("*.py"):
        for mod, line in _imports(path):
            assert not mod.startswith("axkern.") or mod.startswith("axkern.core"), (
                f"{path.relative_to(SRC)}:{line} imports {mod}: core/ imports nothing above it"
            )


def test_the_library_never_imports_the_tooling():
    for module, path in MODULES.items():
        if module.startswith(TOOLING) or module in ("axkern", "axkern.__main__"):
            continue
        for mod, line in _imports(path):
            assert not mod.startswith(TOOLING), f"{path.relative_to(SRC)}:{line} imports {mod}"


def test_the_package_root_holds_no_tooling_module():
    modules = {p.stem for p in SRC.glob("*.py")}
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert modules <= ROOT_MODULES, f"modules in the package root: {sorted(modules - ROOT_MODULES)}"
    assert packages <= ROOT_PACKAGES, f"packages in the package root: {sorted(packages - ROOT_PACKAGES)}"


def test_implementations_never_import_each_other():
    for op in OPS:
        pkg = f"axkern.ops.{op.name}"
        for impl in IMPLEMENTATIONS:
            paths = [op / f"{impl}.py"] + sorted((op / impl).rglob("*.py"))
            for path in (p for p in paths if p.exists()):
                for mod, line in _imports(path):
                    other = mod[len(pkg) + 1 :].split(".")[0] if mod.startswith(pkg + ".") else None
                    assert other not in IMPLEMENTATIONS - {impl}, (
                        f"{path.relative_to(SRC)}:{line} imports {mod}"
                    )


def test_an_op_folder_never_imports_another_op_folder():
    names = {op.name for op in OPS}
    for path in (SRC / "ops").rglob("*.py"):
        own = path.relative_to(SRC / "ops").parts[0]
        for mod, line in _imports(path):
            parts = mod.split(".")
            if mod.startswith("axkern.ops.") and len(parts) > 2:
                other = parts[2]
                assert other == own or other not in names, (
                    f"{path.relative_to(SRC)}:{line} imports {mod}: an op reaches another op's code "
                    f"(shared code lives in core/ or in an engine folder: {sorted(ENGINES)})"
                )


def test_no_private_name_crosses_a_module():
    for path in MODULES.values():
        tree = ast.parse(path.read_text())
        imported_modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _from_base(path, node)
                if not base.startswith("axkern"):
                    continue
                for a in node.names:
                    assert not _private(a.name), (
                        f"{path.relative_to(SRC)}:{node.lineno} imports the private {a.name} from {base}"
                    )
                    if f"{base}.{a.name}" in MODULES:
                        imported_modules.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                imported_modules |= {a.asname for a in node.names if a.asname and a.name in MODULES}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in imported_modules
                and _private(node.attr)
            ):
                raise AssertionError(
                    f"{path.relative_to(SRC)}:{node.lineno} reaches the private {node.value.id}.{node.attr}"
                )


def test_no_import_circle():
    graph = {module: _edges(path) for module, path in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def test_every_block_size_heuristic_has_a_space_to_tune():
    # an implementation with a block-size heuristic declares a space for `axkern tune` (the forms
    # its config keeps are then the tuner's to choose; the spaces' own tests say which)
    import axkern  # noqa: F401 - registers the ops
    from axkern.core.op import get_op, registered_ops

    for name in registered_ops():
        op = get_op(name)
        for impl_name, impl in op.implementations.items():
            if impl.heuristic is None:
                continue
            assert impl.space is not None, (
                f"{name}: {impl_name} has a block-size heuristic but no space to tune"
            )


def test_no_source_file_is_much_over_500_lines():
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


# a measurement: a time, a rate, a measured percentage or ratio, or a results / sweep file
MEASUREMENT = re.compile(
    r"\b\d+(\.\d+)?\s?(ms|µs|us|TFLOP/s|GB/s)\b|\b\d+(\.\d+)?\s?%|\b\d+\.\d+x\b|sweep_\w+\.json|benchmarks/(results|logs)/"
)


def _text_lines(path: Path):
    """`(line, text)` of every comment and docstring line in `path`."""
    source = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if (
                isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            ):
                for i, text in enumerate(doc.value.value.splitlines()):
                    yield doc.lineno + i, text


def test_comments_and_docstrings_carry_no_measurements():
    # figures live in docs/ (the op pages, benchmarks.md, decisions.md) beside their commands; the
    # library's own tooling (bench/, cli/) may show units in its help and output
    found = [
        f"{path.relative_to(SRC)}:{line}: {text.strip()}"
        for module, path in MODULES.items()
        if not module.startswith(TOOLING)
        for line, text in _text_lines(path)
        if MEASUREMENT.search(text)
    ]
    assert not found, "measurements in comments or docstrings:\n" + "\n".join(found)


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
