#!/usr/bin/env bash
# What the next H200 session should run first, in one `run` call (about 9 minutes of device
# time): the GPU tests and benchmarks of everything written since the last device run but
# never run on a GPU (ssd pallas_gpu, attention pallas_gpu/cudnn, bench --peers). Each step
# has its own timeout so one hang does not eat the call; everything lands in $OUT/next.tgz.
#
#   mkdir -p .whl/peers && cp ../shared/wheels/*.whl .whl/ && cp ../shared/wheels/peers/*.whl .whl/peers/
#   run(command="bash benchmarks/h200_next.sh", carry=[".whl"])
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --target /tmp/site ../shared/wheels/peers/*.whl 2>/dev/null \
  || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/peers/*.whl 2>/dev/null || true
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 PATH=/usr/local/cuda/bin:$PATH
R=$OUT/next
mkdir -p "$R"
step() { local t=$1 name=$2; shift 2; echo "== $name"; timeout "$t" "$@" > "$R/$name.log" 2>&1; echo "$name rc=$?" | tee -a "$R/steps.txt"; }
step 150 gpu_tests_ssd env AXKERN_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ssd_gpu.py -rs
step 150 gpu_tests_attention env AXKERN_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py -rs
step 120 bench_ssd python3 -m axkern.cli bench ssd --preset mamba2_2.7b --impl xla,pallas_gpu --repeats 5 --json "$R/ssd_mamba2_2.7b.json"
step 150 bench_attention python3 -m axkern.cli bench attention --preset h200 --impl xla,pallas_gpu,cudnn --repeats 5 --json "$R/attention_h200.json"
step 150 bench_ce_peers python3 -m axkern.cli bench fused_cross_entropy --preset llama3 --impl xla --peers --repeats 5 --json "$R/fused_cross_entropy_llama3_peers.json"
tar czf "$OUT/next.tgz" -C "$OUT" next && rm -rf "$R"
