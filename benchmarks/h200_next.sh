#!/usr/bin/env bash
# One device call (at most 9.5 minutes): the SSD kernels with TF32 products (GPU tests, the
# Mamba-2 layer forward+backward against xla), the reduced CE loss after the dw fix (sweep of
# its token block -> the shipped H200 table, GPU tests, llama3 beside Liger and
# cut-cross-entropy, the other presets). Each step has its own timeout; all lands in
# $OUT/next.tgz (the table the sweep chose in $OUT/next/tuned_nvidia_h200.json).
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
step 120 gpu_tests_ssd env AXKERN_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ssd_gpu.py -rs
step 90 bench_ssd python3 -m axkern.cli bench ssd --preset mamba2_2.7b --impl xla,pallas_gpu --repeats 5 --json "$R/ssd_mamba2_2.7b.json"
step 80 sweep_ce_loss python3 benchmarks/sweep_fused_cross_entropy.py --target loss --block-tokens 256,512,1024,2048 --repeats 5 --json "$R/ce_loss_sweep.json"
step 20 tune_ce_loss python3 benchmarks/tune_table.py --sweep "$R/ce_loss_sweep.json" --op fused_cross_entropy_loss --impl xla --package axkern.ops.fused_cross_entropy --max-temp-gib 1.0 --source benchmarks/results/h200/fused_cross_entropy_loss_sweep_2026-11-30.json
cp src/axkern/ops/fused_cross_entropy/tuned/nvidia_h200.json "$R/tuned_nvidia_h200.json"
step 100 gpu_tests_ce env AXKERN_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_cross_entropy_gpu.py -rs -s -k "loss_gradients or h200_table or (8192 and bfloat16 and pallas)"
step 80 bench_ce_loss_llama3 python3 -m axkern.cli bench fused_cross_entropy_loss --preset llama3 --impl xla --peers --repeats 5 --json "$R/fused_cross_entropy_loss_llama3.json"
for p in llama2 qwen2 gemma; do
  step 35 bench_ce_loss_$p python3 -m axkern.cli bench fused_cross_entropy_loss --preset $p --impl xla --repeats 3 --json "$R/fused_cross_entropy_loss_$p.json"
done
