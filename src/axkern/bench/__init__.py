"""The tooling behind `axkern bench`, `axkern tune` and `axkern report` (never imported by `core/` or `ops/`).

- `harness`: `measure` times an op's implementations on a `Case`, with the device timers and
  the matmul and copy ceilings; `cases_for` / `presets_for` read an op's `arg_specs.py`.
- `format`: how rows print (table, JSON, CSV, markdown).
- `results`: the results layout on disk (`<root>/<device_key>/<op>/<preset>.json`).
- `report`: tables from the saved results (the docs' long form, the README's short form); `plots`: their plots.
- `peers`: the PyTorch peers, timed in a subprocess.
- `tune`: block-size sweeps, and `autotune` for a call the dispatcher has no tuned entry for.

The harness's names are re-exported here: `from axkern.bench import cases_for, measure, Row`.
"""

from .harness import (
    DEFAULT_PRESET,
    Case,
    Row,
    cases_for,
    copy_bandwidth,
    cotangent,
    forward_backward,
    loss_and_grad,
    matmul_ceiling,
    measure,
    presets_for,
    replaced_blocks,
    runs_interpreted,
    time_ms,
    time_rounds,
    time_spread,
)

__all__ = [
    "Case",
    "Row",
    "measure",
    "time_ms",
    "time_spread",
    "time_rounds",
    "matmul_ceiling",
    "copy_bandwidth",
    "cotangent",
    "forward_backward",
    "loss_and_grad",
    "cases_for",
    "presets_for",
    "DEFAULT_PRESET",
    "runs_interpreted",
    "replaced_blocks",
]
