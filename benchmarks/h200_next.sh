#!/usr/bin/env bash
# The first device call of the next session (at most 9.2 minutes): what changed after this
# session's device time ran out. The reduced CE loss now accumulates dw in float32: its GPU
# tests (the bf16-accumulated version failed at 8192x4096x128256), a sweep of its token block
# (-> the shipped H200 table, entries under 3 GiB), llama3 beside Liger and cut-cross-entropy,
# the other presets; then the SSD GPU tests that have not all run (TF32 products).
# Each step has its own timeout; all lands in $OUT/next.tgz (the chosen table in
# $OUT/next/tuned_nvidia_h200.json: copy it into src/axkern/ops/fused_cross_entropy/tuned/).
#
#   mkdir -p .whl/peers && cp ../shared/wheels/*.whl .whl/ && cp ../shared/wheels/peers/*.whl .whl/peers/
#   run(command="bash benchmarks/h200_next.sh", carry=[".whl"])
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .whl/peers/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 PATH=/usr/local/cuda/bin:$PATH
R=$OUT/next
mkdir -p "$R"
step() { local t=$1 name=$2; shift 2; echo "== $name"; timeout "$t" "$@" > "$R/$name.log" 2>&1; echo "$name rc=$?" | tee -a "$R/steps.txt"; }
trap 'tar czf "$OUT/next.tgz" -C "$OUT" next' EXIT
step 150 gpu_tests_ce_loss env AXKERN_TEST_GPU=1 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_fused_cross_entropy_gpu.py -rs -s -k "loss_gradients or h200_table"
step 80 sweep_ce_loss python3 benchmarks/sweep_fused_cross_entropy.py --target loss --block-tokens 512,1024,2048 --repeats 5 --json "$R/ce_loss_sweep.json"
step 20 tune_ce_loss python3 benchmarks/tune_table.py --sweep "$R/ce_loss_sweep.json" --op fused_cross_entropy_loss --impl xla --package axkern.ops.fused_cross_entropy --max-temp-gib 3.0 --source benchmarks/results/h200/fused_cross_entropy_loss_sweep_<date>.json
cp src/axkern/ops/fused_cross_entropy/tuned/nvidia_h200.json "$R/tuned_nvidia_h200.json"
step 80 bench_ce_loss_llama3 python3 -m axkern.cli bench fused_cross_entropy_loss --preset llama3 --impl xla --peers --repeats 5 --json "$R/fused_cross_entropy_loss_llama3.json"
for p in gemma; do  # llama2 and qwen2 in the second call
  step 35 bench_ce_loss_$p python3 -m axkern.cli bench fused_cross_entropy_loss --preset $p --impl xla --repeats 3 --json "$R/fused_cross_entropy_loss_$p.json"
done
step 180 gpu_tests_ssd env AXKERN_TEST_GPU=1 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_ssd_gpu.py -rs
# a second call: attention with packed documents (pallas_gpu's run-time schedule) and the new GPU order
#   step 120 gpu_tests_attention env AXKERN_TEST_GPU=1 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_attention_gpu.py -rs
#   step 200 bench_attention python3 -m axkern.cli bench attention --preset h200 --impl xla,pallas_gpu,cudnn --repeats 5 --json "$R/attention_h200.json"
