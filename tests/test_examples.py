"""The expert-parallel example runs on 8 host devices, positional and named, and matches the dense
layer; its bench case runs. The many-hosts example without a cluster prints its usage."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ep_moe_example_matches_the_dense_layer():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(REPO / "examples" / "ep_moe.py"), "--tokens", "16", "--capacity-factor", "4"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "8 devices (cpu)" in out.stdout and "\ndropped pairs: 0" in out.stdout
    assert "named: dropped pairs: 0" in out.stdout
    checked = 0
    for line in out.stdout.splitlines():
        m = re.match(r"max \|([\w ]+) - dense\|: (\S+)", line)
        if m:
            assert float(m.group(2)) < 1e-4, line
            checked += 1
    assert checked == 10, out.stdout  # y and four gradients, positional and named


def test_many_hosts_without_a_cluster_prints_its_usage():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for flags in ([], ["--coordinator", "127.0.0.1:1"]):
        proc = subprocess.run(
            [sys.executable, str(REPO / "examples" / "many_hosts.py"), *flags],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("usage: many_hosts.py") and "Traceback" not in proc.stderr
        assert "--process-id" in proc.stderr.splitlines()[-1]
