"""Every public function's docstring carries a short example, and the example runs as a doctest;
public functions have return annotations and typed axis parameters."""

from __future__ import annotations

import doctest
import inspect

import pytest

import axkern
from axkern import haliax_compat, levanter, positional
from axkern.bench import results


def _public() -> dict[str, object]:
    out = {
        f"axkern.{n}": getattr(axkern, n) for n in axkern.__all__ if inspect.isfunction(getattr(axkern, n))
    }
    out |= {f"axkern.positional.{n}": getattr(positional, n) for n in positional.__all__}
    out |= {f"axkern.bench.results.{n}": getattr(results, n) for n in ("versions", "path_for")}
    out |= {f"axkern.levanter.{n}": getattr(levanter, n) for n in levanter.__all__ if n != "AttentionMask"}
    out |= {"axkern.haliax_compat.dot_product_attention": haliax_compat.dot_product_attention}
    return out


PUBLIC = _public()


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_docstring_example_runs(name):
    fn = inspect.unwrap(PUBLIC[name])
    tests = doctest.DocTestFinder(recurse=False).find(fn, name, globs={})
    examples = [e for t in tests for e in t.examples]
    assert examples, f"{name}: its docstring has no >>> example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for t in tests:
        runner.run(t, out=report.append)
    assert not runner.failures, "".join(report)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_return_and_axis_parameters_are_annotated(name):
    sig = inspect.signature(inspect.unwrap(PUBLIC[name]))
    assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return annotation"
    axes = [p for p in sig.parameters.values() if p.name[:1].isupper() and p.kind == p.KEYWORD_ONLY]
    for p in axes:  # `Embed="embed"`-style selectors; `A`, `B`, `C`, `D` of ssd are arrays
        if isinstance(p.default, str):
            assert "AxisSelector" in str(p.annotation), (
                f"{name}: axis parameter {p.name} is not an AxisSelector"
            )
