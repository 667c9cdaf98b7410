#!/usr/bin/env bash
# The GPU tests and the benches of one op on any CUDA machine (a maintainer's script).
#
#   bash benchmarks/gpu.sh OP            the op's GPU tests, then its benches at the GPU preset
#   bash benchmarks/gpu.sh tests         every GPU test (tests/gpu and the non-finite rule's tests),
#                                        in one pytest with GPU_TEST_WORKERS (default 8) processes
#                                        sharing the GPU where pytest-xdist is installed
#   bash benchmarks/gpu.sh tune OP ARGS  `axkern tune OP ARGS --write-table`; the tables it wrote land in
#                                        $OUT/gpu/tuned/<op folder>/, the tuning cache in $OUT/gpu/cache/
#   bash benchmarks/gpu.sh list          the ops and their presets
#
# OP is an op folder: attention, cross_entropy, fused_cross_entropy, mamba3, moe, moe_ep, short_conv, ssd;
# `gpu.sh attention_peers` runs attention's GPU preset with `--peers` (tokamax); `gpu.sh attention_mosaic`
# the Mosaic GPU kernels' tests; `ssd_mosaic` the SSD Mosaic GPU kernels' tests; `ssd_mosaic_bench` the
# layer beside pallas_gpu and the peers; `ssd_chunks` `mosaic_gpu`'s default (chunks of 64) and its
# whole kernels at chunks of 128 at every length of the preset, beside mamba_ssm (128's run as
# ssd/sweep.json beside the preset's); `gpu.sh fp16` the fp16 GPU tests of SSD and Mamba-3 and their fp16
# benches; `gpu.sh kernel_times OP PRESET --impl A,B` runs benchmarks/diagnostics/kernel_times.py (device
# time per kernel, through PyTorch's profiler); `gpu.sh fused_cross_entropy_dw` runs
# benchmarks/diagnostics/fused_cross_entropy_dw.py (the reduced loss's dw accumulations at llama3's size:
# time, temporary memory, oracle rule, with the peers).
# Wheels in an ignored `.whl/` folder (for a machine without network: whatever its image lacks
# of the dependencies, e.g. haliax, beartype, cffi, platformdirs, filelock; `.whl/peers/` for
# the peers, with `.whl/peers/levanter/` (its wheel and small dependencies) and `.whl/levanter_stubs/` for Levanter and `.whl/mamba_ssm_triton/` for mamba_ssm's
# Triton kernels; `.whl/peers/tokamax/` for tokamax and what it needs, with `.whl/xprof_stub/` for
# the profiler package it imports) are installed into /tmp/site first. Logs and the
# benches' JSON go under $OUT/gpu (./gpu-run without $OUT): one log per step, steps.txt with each
# step's exit status and seconds, <op>/<preset>.json per bench (the layout of benchmarks/results).
# Each step has its own timeout (seconds) so one hung kernel leaves the others their time.
set -u
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl $(compgen -G ".whl/peers/*.whl") $(compgen -G ".whl/peers/levanter/*.whl")
  if compgen -G ".whl/peers/tokamax/*.whl" > /dev/null; then  # apart: a failure here leaves the rest installed
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/peers/tokamax/*.whl ||
      echo "tokamax's wheels did not install: its bench peers will say it is not installed"
  fi
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD/.whl/levanter_stubs:$PWD/.whl/mamba_ssm_triton
  [ -d .whl/xprof_stub ] && PYTHONPATH=$PYTHONPATH:$PWD/.whl/xprof_stub
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PATH=/usr/local/cuda/bin:$PATH
R=${OUT:-$PWD/gpu-run}/gpu
mkdir -p "$R"
# BUNDLE=1: the run's folder packed into one file on exit (benchmarks/bundle.sh)
. "$(dirname "$0")/bundle.sh"
step() {
  local t=$1 name=$2; shift 2
  echo "== $name"
  local s=$SECONDS
  # interrupted at its limit (pytest then prints what failed so far), killed 15 s later if it
  # ignores the signal (a hung kernel)
  timeout -s INT -k 15 "$t" "$@" > "$R/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - s))s" | tee -a "$R/steps.txt"
}
axkern="python3 -m axkern"
# -v: each test named as it ends, so a log cut by its limit shows which ones had not
gpu_tests="env AXKERN_TEST_GPU=1 python3 -m pytest -v -p no:cacheprovider -rs"
bench() {  # bench OP PRESET [more axkern bench arguments]
  local op=$1 preset=$2; shift 2
  mkdir -p "$R/$op"
  step "${BENCH_T:-240}" "bench_${op}_$preset" $axkern bench "$op" --preset "$preset" --repeats 5 --json "$R/$op/$preset.json" "$@"
}
tests() {  # tests FILE: the op's GPU tests
  [ -f "tests/gpu/$1" ] && step 300 "gpu_tests_${1%.py}" $gpu_tests "tests/gpu/$1"
}
case "${1:-}" in
tests)  # memory grows as each process needs it, so that the processes share the GPU
  workers=()
  python3 -c "import xdist" 2> /dev/null && workers=(-n "${GPU_TEST_WORKERS:-8}")
  step 540 gpu_tests env XLA_PYTHON_CLIENT_PREALLOCATE=false $gpu_tests --tb=short "${workers[@]}" tests/gpu \
    tests/ops/test_short_conv_nonfinite.py tests/ops/test_ssd_nonfinite.py
  ;;
attention) tests test_attention_gpu.py; tests test_attention_mosaic_gpu.py; bench attention h200 ;;
attention_peers) BENCH_T=540 bench attention h200 --peers ;;  # beside tokamax's mosaic and cudnn
attention_mosaic)  # the Mosaic GPU kernels' GPU tests (four processes share the GPU; memory grows as needed)
  step 420 gpu_tests_attention_mosaic_gpu env XLA_PYTHON_CLIENT_PREALLOCATE=false $gpu_tests -n 4 tests/gpu/test_attention_mosaic_gpu.py
  ;;
cross_entropy) bench cross_entropy llama3 ;;
fused_cross_entropy)
  tests test_fused_cross_entropy_gpu.py
  bench fused_cross_entropy llama3 --tokens 16384
  bench fused_cross_entropy_loss llama3 --tokens 16384
  ;;
fused_cross_entropy_dw)  # the reduced loss's dw accumulations at llama3's size, beside the peers
  step 300 fused_cross_entropy_dw python3 benchmarks/diagnostics/fused_cross_entropy_dw.py --peers --json "$R/fused_cross_entropy_dw.json"
  ;;
mamba3) tests test_mamba3_gpu.py; BENCH_T=540 bench mamba3 mamba3_2.7b --peers ;;
moe) tests test_moe_gpu.py; bench moe_dispatch dsv3; bench moe_combine dsv3 ;;
moe_ep) bench moe_ep_dispatch e64; bench moe_ep_combine e64 ;;
short_conv) tests test_short_conv_gpu.py; bench short_conv mamba ;;
ssd) tests test_ssd_gpu.py; BENCH_T=420 bench ssd mamba2_2.7b --tokens 4096 --impl pallas_gpu,mosaic_gpu,xla --peers ;;
ssd_mosaic)  # the Mosaic GPU kernels' GPU tests: each kernel against its emulation, then the
  # layer against the oracle (four processes: the oracle runs on the CPU)
  step 150 gpu_tests_ssd_mosaic_kernels $gpu_tests --tb=short tests/gpu/test_ssd_gpu.py -k emulation
  step 420 gpu_tests_ssd_mosaic_gpu env XLA_PYTHON_CLIENT_PREALLOCATE=false $gpu_tests -n 4 --tb=short \
    tests/gpu/test_ssd_gpu.py -k "mosaic_gpu_against_oracle or without_d_and_the_gate or non_finite_rule or default_is"
  ;;
ssd_mosaic_bench)  # the layer beside pallas_gpu and the peers
  BENCH_T=420 bench ssd mamba2_2.7b --tokens 4096 --impl pallas_gpu,mosaic_gpu --peers
  ;;
ssd_chunks)  # chunks of 64 (the default) and of 128 (the fused forward and the whole backward by tiles)
  BENCH_T=420 bench ssd mamba2_2.7b --impl mosaic_gpu --peers
  step 420 bench_ssd_chunk128 $axkern bench ssd --preset mamba2_2.7b --impl mosaic_gpu --repeats 5 --peers \
    --blocks mosaic_gpu:chunk_size=128,forward=fused,scan_backward=none,group_sums=kernels --json "$R/ssd/sweep.json"
  ;;
fp16)  # fp16 against the oracle (SSD's xla and pallas_gpu, Mamba-3's pallas_gpu), then timed at the 2.7B layers
  step 300 gpu_tests_fp16 env XLA_PYTHON_CLIENT_PREALLOCATE=false $gpu_tests -n 4 --tb=short \
    tests/gpu/test_ssd_gpu.py tests/gpu/test_mamba3_gpu.py -k "float16 and not bfloat16"
  mkdir -p "$R/ssd" "$R/mamba3"  # sweep_fp16.json: not the presets' (bf16) tables
  step 240 bench_ssd_fp16 $axkern bench ssd --preset mamba2_2.7b --tokens 4096 --dtype float16 \
    --impl pallas_gpu,xla --repeats 5 --json "$R/ssd/sweep_fp16.json"
  step 300 bench_mamba3_fp16 $axkern bench mamba3 --preset mamba3_2.7b --dtype float16 --only SISO \
    --impl pallas_gpu,xla --repeats 3 --json "$R/mamba3/sweep_fp16.json"
  ;;
kernel_times)  # device time per kernel: gpu.sh kernel_times OP PRESET [--tokens N] --impl A,B
  shift; step 540 "kernel_times_${1:?usage: gpu.sh kernel_times OP PRESET --impl A,B}" \
    env OUT="$R" python3 benchmarks/diagnostics/kernel_times.py "$@"
  ;;
tune)
  op=${2:?usage: gpu.sh tune OP [axkern tune arguments]}; shift 2
  export AXKERN_CACHE_DIR="$R/cache"  # the tuning cache comes back with the logs
  step 560 "tune_$op" $axkern tune "$op" --write-table --json "$R/tune_$op.json" "$@"
  for d in src/axkern/ops/*/tuned; do  # the shipped tables, to copy back into the checkout
    mkdir -p "$R/tuned/$(basename "$(dirname "$d")")" && cp "$d"/*.json "$R/tuned/$(basename "$(dirname "$d")")/"
  done
  ;;
list) $axkern bench --list-presets ;;
*)
  echo "usage: gpu.sh tests|fp16|attention|attention_peers|attention_mosaic|cross_entropy|fused_cross_entropy|fused_cross_entropy_dw|mamba3|moe|moe_ep|short_conv|ssd|ssd_mosaic|ssd_mosaic_bench|ssd_chunks|kernel_times|list, or gpu.sh tune OP [args]"
  exit 2
  ;;
esac
