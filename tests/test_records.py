"""benchmarks/records.py: a diagnostic's record names the command as it was run (with `OUT=<folder>`
in place of the folder) and lands in `$OUT`."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "records.py"
_spec = importlib.util.spec_from_file_location("records", _PATH)
records = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(records)


def test_the_record_names_the_command_and_lands_in_out(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/some_script.py", "now", "--fast"])
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    head = records.header("some_script.py", case="c", rows=[])
    assert head["command"] == "OUT=<folder> python3 benchmarks/some_script.py now --fast"
    assert head["case"] == "c" and head["rows"] == [] and head["device"] and head["jax"]
    path = records.write(head, "some.json")
    assert path == tmp_path / "out" / "some.json"
    assert json.loads(path.read_text()) == head
