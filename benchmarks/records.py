"""The record a diagnostic script writes: its header (the command, with `OUT=<folder>` and the
script's arguments, the date, jax and the device) and the JSON file under `$OUT`."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import jax


def header(script: str, **fields) -> dict:
    """`script`'s command line as run (`OUT=<folder> python3 benchmarks/<script> <arguments>`),
    the date, jax's version and the first device's kind, then `fields`."""
    return {
        "command": " ".join(["OUT=<folder> python3", f"benchmarks/{script}", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        **fields,
    }


def write(record: dict, name: str) -> Path:
    """`record` as `$OUT/<name>` (the working folder without `OUT`)."""
    folder = Path(os.environ.get("OUT", "."))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path
