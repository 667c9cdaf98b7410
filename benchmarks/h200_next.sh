#!/usr/bin/env bash
# One device call (at most 9.8 minutes): GPU tests of the fused cross-entropy's new paths
# (pallas_gpu, the reduced loss with gradients formed in the forward) and of the cuDNN
# sliding-window fix, sweeps of the loss's token block and the Pallas kernel's tiles,
# a probe of where the pallas_gpu SSD forward spends its time, and the llama3 CE benchmark
# beside Liger/cut-cross-entropy. Each step has its own timeout; all lands in $OUT/next.tgz.
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
step 130 gpu_tests_ce env AXKERN_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_cross_entropy_gpu.py -rs -s
step 45 gpu_tests_attention_cudnn env AXKERN_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py -k cudnn -rs
step 70 sweep_ce_loss python3 benchmarks/sweep_fused_cross_entropy.py --target loss --block-tokens 512,1024,2048,4096 --repeats 5 --json "$R/ce_loss_sweep.json"
step 100 sweep_ce_pallas python3 benchmarks/sweep_fused_cross_entropy.py --target pallas_gpu --block-tokens 64,128 --block-vocab 128,256 --block-embed 64 --num-warps 4,8 --num-stages 3 --repeats 5 --json "$R/ce_pallas_sweep.json"
step 70 ssd_probe python3 benchmarks/ssd_gpu_probe.py --json "$R/ssd_probe.json"
step 90 bench_ce_loss python3 -m axkern.cli bench fused_cross_entropy_loss --preset llama3 --impl xla --peers --repeats 5 --json "$R/fused_cross_entropy_loss_llama3.json"
step 80 bench_ce_stats python3 -m axkern.cli bench fused_cross_entropy --preset llama3 --impl xla,pallas_gpu --repeats 5 --json "$R/fused_cross_entropy_llama3.json"
