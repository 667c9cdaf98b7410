"""Start a `jax.distributed` cluster of CPU processes on 127.0.0.1, wait for it with a deadline, reap it.

`launch(command, processes, folder)` runs `command(process_id, coordinator)` once per process,
each with `local_devices` CPU devices (`XLA_FLAGS`) and `JAX_PLATFORMS=cpu`. It returns when
all have exited, when one has failed (the others would wait for it in a collective), or at
the deadline; whatever still runs then is killed, and every process is reaped before it
returns. Output goes to files in `folder`, not pipes, so a chatty process never blocks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Launch:
    returncodes: list[int | None]
    stdout: list[str]
    stderr: list[str]
    timed_out: bool
    seconds: float

    def json_lines(self) -> list[dict]:
        """Every stdout line that is a JSON object, from every process (other lines are skipped)."""
        return [
            json.loads(line) for text in self.stdout for line in text.splitlines() if line.startswith("{")
        ]

    def tail(self, process: int, lines: int = 30) -> str:
        return "\n".join(self.stderr[process].splitlines()[-lines:])


def launch(
    command: Callable[[int, str], list[str]],
    processes: int,
    folder: Path,
    *,
    local_devices: int = 1,
    timeout_s: float = 300.0,
    cwd: Path | None = None,
) -> Launch:
    # the test run's other XLA flags (tests/conftest.py's choice of fusion emitters) go along
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env = {
        **os.environ,
        "XLA_FLAGS": " ".join([f"--xla_force_host_platform_device_count={local_devices}", *kept]),
        "JAX_PLATFORMS": "cpu",
    }
    coordinator = f"127.0.0.1:{free_port()}"
    procs, files = [], []
    start = time.monotonic()
    timed_out = False
    try:
        for i in range(processes):
            out, err = open(folder / f"process{i}.out", "w+"), open(folder / f"process{i}.err", "w+")
            files += [out, err]
            procs.append(subprocess.Popen(command(i, coordinator), stdout=out, stderr=err, env=env, cwd=cwd))
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(codes):
                break
            if time.monotonic() - start > timeout_s:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        texts = []
        for f in files:
            f.seek(0)
            texts.append(f.read())
            f.close()
    return Launch(
        [p.returncode for p in procs], texts[0::2], texts[1::2], timed_out, time.monotonic() - start
    )
