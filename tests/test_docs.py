"""The docs site builds with `mkdocs build --strict` (broken links, bad `:::` refs and griffe warnings fail)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_docs_build_strict(tmp_path):
    site = tmp_path / "site"
    config = str(REPO / "mkdocs.yml")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mute material's end-of-life banner
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}\n{result.stdout}"
    assert (site / "index.html").is_file()
