"""The docs site builds with `mkdocs build --strict` (broken links, bad `:::` refs and griffe warnings
fail), and the many-hosts guide's commands run as written on the CPU."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.cluster import free_port

REPO = Path(__file__).resolve().parents[1]


def test_docs_build_strict(tmp_path):
    site = tmp_path / "site"
    config = str(REPO / "mkdocs.yml")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mute material's end-of-life banner
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}\n{result.stdout}"
    assert (site / "index.html").is_file()


def test_the_api_reference_renders_every_public_name():
    import axkern
    from axkern import positional

    rendered = {
        m
        for page in (REPO / "docs").rglob("*.md")
        for m in re.findall(r"^::: (\S+)", page.read_text(), flags=re.M)
    }
    names = [
        f"axkern.{n}" for n in axkern.__all__ if n not in ("masks", "positional", "ops", "implementations")
    ]
    names += [f"axkern.positional.{n}" for n in positional.__all__]
    names += ["axkern.core.op.ops", "axkern.core.op.implementations", "axkern.masks"]
    assert not [n for n in names if n not in rendered], "public names missing from the docs' `:::` blocks"
    # `axkern.ops` is the function: `::: axkern.ops` would render the subpackage of the same name
    assert "axkern.ops" not in rendered


def test_the_many_hosts_commands_run_as_written_on_the_cpu():
    # every command block that starts a cluster on 127.0.0.1, run by bash in the repository root
    # (on a free port instead of the one written), with this environment's `python` and `axkern`
    text = (REPO / "docs" / "many-hosts.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if "127.0.0.1" in b]
    assert len(blocks) == 2, "the example and `axkern info`"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    outs = []
    for block in blocks:
        script = re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{free_port()}", block)
        proc = subprocess.Popen(
            ["bash", "-e", "-c", script],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: the background process is killed with it
        )
        try:
            out, err = proc.communicate(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.returncode == 0, f"{script}\nfailed:\n{err[-3000:]}"
        outs.append(out)
    example, info = outs
    loss = re.search(r"loss ([\d.]+) \(one device: ([\d.]+)\)", example)
    assert loss and abs(float(loss[1]) - float(loss[2])) < 1e-4, example
    assert "fused_cross_entropy: xla" in example and "vocab=128" in example, example
    assert re.search(r"processes\s+│ 2 \(this is process 0\)", info), info
    assert re.search(r"global devices\s+│ 8 ", info), info
