"""docs/tpu.md's table of what runs on a TPU agrees with the registry: every op, whether it has a
`pallas_tpu` implementation, and its default order on a TPU. A CPU test (no chip needed)."""

from __future__ import annotations

import re
from pathlib import Path

from axkern.core import registry
from axkern.core.op import get_op

PAGE = Path(__file__).resolve().parents[2] / "docs" / "tpu.md"


def test_the_tpu_page_lists_each_ops_kernel_and_default_order():
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \| (.+?) \|$", PAGE.read_text(), flags=re.M)
    table = {op: (kernel, order) for op, kernel, order in rows}
    want = {}
    for name in registry.ops():
        op = get_op(name)
        order = op.default_order.get("tpu", ("xla",))
        assert not callable(order), f"{name}: the page's table needs a fixed TPU order"
        kernel = "`pallas_tpu`" if "pallas_tpu" in op.implementations else "none"
        want[name] = (kernel, ", ".join(f"`{i}`" for i in order))
    assert table == want
