#!/usr/bin/env bash
# One device call (at most 5.7 minutes): the GPU tests of the reduced CE loss not yet run
# (dw accumulated in bf16 at 8192x4096x128256, float32, the H200 table), llama3 beside Liger and
# cut-cross-entropy after the undifferentiated value got its own tiles, gemma and qwen2, and
# the SSD GPU tests at the smaller shape in bf16. All lands in $OUT/next.tgz.
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
step 110 gpu_tests_ce env AXKERN_TEST_GPU=1 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_fused_cross_entropy_gpu.py -rs -s -k "(loss_gradients and (8192 or float32)) or h200_table"
step 80 bench_ce_loss_llama3 python3 -m axkern.cli bench fused_cross_entropy_loss --preset llama3 --impl xla --peers --repeats 5 --json "$R/fused_cross_entropy_loss_llama3.json"
for p in gemma qwen2; do
  step 35 bench_ce_loss_$p python3 -m axkern.cli bench fused_cross_entropy_loss --preset $p --impl xla --repeats 3 --json "$R/fused_cross_entropy_loss_$p.json"
done
step 80 gpu_tests_ssd env AXKERN_TEST_GPU=1 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_ssd_gpu.py -rs -k "dims1 and bfloat16"
