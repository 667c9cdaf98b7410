"""Every op's named function under each of its sharding rules, across processes on 127.0.0.1.

One launch starts `PROCESSES` copies of `tests/multihost_worker.py` (8 CPU devices in all,
`jax.distributed` with gloo collectives); each runs every case of `multihost_worker.CASES`
sharded over the global mesh and compares its shards of the values and gradients with a
single-process run. The tests here read what each process reported.
`AXKERN_TEST_PROCESSES=4` runs the same cases on 4 processes of 2 devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import axkern
from tests.multihost_worker import CASES, GLOBAL_DEVICES

WORKER = Path(__file__).with_name("multihost_worker.py")
PROCESSES = int(os.environ.get("AXKERN_TEST_PROCESSES", "2"))
TIMEOUT_S = 480


def free_port() -> int:
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

    def results(self) -> dict[tuple[str, int], dict]:
        out = {}
        for text in self.stdout:
            for line in text.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    out[(r["case"], r["process"])] = r
        return out

    def tail(self, process: int, lines: int = 30) -> str:
        return "\n".join(self.stderr[process].splitlines()[-lines:])


def launch(
    processes: int,
    folder: Path,
    *,
    cases: list[str] | None = None,
    timeout_s: float = TIMEOUT_S,
    worker: Path = WORKER,
) -> Launch:
    """Run `worker` as `processes` processes of one `jax.distributed` cluster on 127.0.0.1.

    Returns when all have exited, one has failed, or `timeout_s` has passed; every process
    still running then is killed, and all are reaped before this returns.
    """
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={GLOBAL_DEVICES // processes}",
        "JAX_PLATFORMS": "cpu",
    }
    port = free_port()
    procs, files = [], []
    start = time.monotonic()
    timed_out = False
    try:
        for i in range(processes):
            out, err = open(folder / f"process{i}.out", "w+"), open(folder / f"process{i}.err", "w+")
            files += [out, err]
            cmd = [sys.executable, str(worker), "--coordinator", f"127.0.0.1:{port}"]
            cmd += ["--num-processes", str(processes), "--process-id", str(i)]
            if cases:
                cmd += ["--cases", ",".join(cases)]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env))
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if any(codes):  # one failed: the others would wait on it
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Launch:
    return launch(PROCESSES, tmp_path_factory.mktemp("multihost"))


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_across_processes_equals_single_process(cluster, case):
    results = cluster.results()
    for process in range(PROCESSES):
        r = results.get((case, process))
        assert r is not None, (
            f"process {process} reported nothing for {case!r} (exit codes {cluster.returncodes}, "
            f"timed out: {cluster.timed_out} after {cluster.seconds:.0f} s); its stderr ends:\n"
            + cluster.tail(process)
        )
        assert r["ok"], f"process {process}, {case}: {r['message']}"
    if not all(results[(case, p)]["manual"] for p in range(PROCESSES)):
        if case.startswith("moe/"):
            pytest.xfail(
                "the MoE named ops have no token-parallel rule: they run without shard_map, "
                "partitioned by XLA (values and gradients match)"
            )
        pytest.fail(f"{case}: the named layer ran without shard_map under the mapping")


def test_every_process_exits_cleanly(cluster):
    assert not cluster.timed_out, f"the processes ran past {TIMEOUT_S} s"
    for process, rc in enumerate(cluster.returncodes):
        assert rc == 0, f"process {process} exited with {rc}; its stderr ends:\n{cluster.tail(process)}"


def test_expert_parallel_transport_has_a_case():
    if not hasattr(axkern, "moe_ep_dispatch"):
        pytest.skip("axkern has no expert-parallel transport (moe_ep_dispatch, moe_ep_combine)")
    assert any(c.startswith("moe_ep/") for c in CASES), (
        "axkern.moe_ep_dispatch exists: add its xla path to multihost_worker.CASES"
    )


def test_a_hung_cluster_is_killed_and_reaped(tmp_path):
    # a worker that never finishes: the launch returns at its deadline with every process gone
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text('import time\nprint(\'{"case": "x", "process": 0}\', flush=True)\ntime.sleep(600)\n')
    run = launch(2, tmp_path, timeout_s=1.0, worker=sleeper)
    assert run.timed_out and all(rc is not None and rc != 0 for rc in run.returncodes)
    assert run.seconds < 30 and ("x", 0) in run.results()


def test_a_failing_process_ends_the_launch(tmp_path):
    failing = tmp_path / "failing.py"
    failing.write_text(
        "import sys, time\nif '--process-id' in sys.argv and sys.argv[sys.argv.index('--process-id') + 1] == '1':\n"
        "    sys.exit('process 1 fails')\ntime.sleep(600)\n"
    )
    run = launch(2, tmp_path, timeout_s=120.0, worker=failing)
    assert not run.timed_out and run.returncodes[1] == 1 and run.returncodes[0] != 0
    assert "process 1 fails" in run.stderr[1] and run.seconds < 60
