"""Every op's named function under each of its sharding rules, across processes on 127.0.0.1.

One launch starts `PROCESSES` copies of `tests/multihost_worker.py` (8 CPU devices in all,
`jax.distributed` with gloo collectives); each runs every case of `multihost_worker.CASES`
sharded over the global mesh and compares its shards of the values and gradients with a
single-process run. The tests here read what each process reported.
`AXKERN_TEST_PROCESSES=4` runs the same cases on 4 processes of 2 devices.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import axkern
from tests.cluster import Launch, launch
from tests.multihost_worker import CASES, GLOBAL_DEVICES

WORKER = Path(__file__).with_name("multihost_worker.py")
PROCESSES = int(os.environ.get("AXKERN_TEST_PROCESSES", "2"))
TIMEOUT_S = 480


def run_worker(folder: Path, *, worker: Path = WORKER, timeout_s: float = TIMEOUT_S) -> Launch:
    def command(process_id: int, coordinator: str) -> list[str]:
        return [
            sys.executable,
            str(worker),
            "--coordinator",
            coordinator,
            "--num-processes",
            str(PROCESSES),
            "--process-id",
            str(process_id),
        ]

    return launch(command, PROCESSES, folder, local_devices=GLOBAL_DEVICES // PROCESSES, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Launch:
    return run_worker(tmp_path_factory.mktemp("multihost"))


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_across_processes_equals_single_process(cluster, case):
    results = {(r["case"], r["process"]): r for r in cluster.json_lines()}
    for process in range(PROCESSES):
        r = results.get((case, process))
        assert r is not None, (
            f"process {process} reported nothing for {case!r} (exit codes {cluster.returncodes}, "
            f"timed out: {cluster.timed_out} after {cluster.seconds:.0f} s); its stderr ends:\n"
            + cluster.tail(process)
        )
        assert r["ok"], f"process {process}, {case}: {r['message']}"
    if not all(results[(case, p)]["manual"] for p in range(PROCESSES)):
        pytest.fail(f"{case}: the named layer ran without shard_map under the mapping")


def test_every_process_exits_cleanly(cluster):
    assert not cluster.timed_out, f"the processes ran past {TIMEOUT_S} s"
    for process, rc in enumerate(cluster.returncodes):
        assert rc == 0, f"process {process} exited with {rc}; its stderr ends:\n{cluster.tail(process)}"


def test_expert_parallel_transport_has_a_case():
    assert hasattr(axkern.positional, "moe_ep_dispatch")
    assert any(c.startswith("moe_ep/") for c in CASES), (
        "add the transport's xla path to multihost_worker.CASES"
    )


def test_a_hung_cluster_is_killed_and_reaped(tmp_path):
    # a worker that never finishes: the launch returns at its deadline with every process gone
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\nprint('{}', flush=True)\ntime.sleep(600)\n")
    run = run_worker(tmp_path, worker=sleeper, timeout_s=3.0)
    assert run.timed_out and all(rc is not None and rc != 0 for rc in run.returncodes)
    assert run.seconds < 30 and len(run.json_lines()) == PROCESSES


def test_a_failing_process_ends_the_launch(tmp_path):
    failing = tmp_path / "failing.py"
    failing.write_text(
        "import sys, time\nif '--process-id' in sys.argv and sys.argv[sys.argv.index('--process-id') + 1] == '1':\n"
        "    sys.exit('process 1 fails')\ntime.sleep(600)\n"
    )
    run = run_worker(tmp_path, worker=failing, timeout_s=120.0)
    assert not run.timed_out and run.returncodes[1] == 1 and run.returncodes[0] != 0
    assert "process 1 fails" in run.stderr[1] and run.seconds < 60
