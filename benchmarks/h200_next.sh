#!/usr/bin/env bash
# Device calls of the 2026-11-30 third session (each at most 9.5 minutes):
#   bash benchmarks/h200_next.sh ce     the cross-entropy presets at N = 8192/16384/32768 (the reduced
#                                       loss with float32 dw beside Liger, cut-cross-entropy, PyTorch and
#                                       plain JAX), the per-token op with pallas_gpu now first on GPU, the
#                                       GPU tests that have not run (float32 loss at 128256, the table)
#   bash benchmarks/h200_next.sh rest   the SSD GPU tests (float32 now tf32x3), the attention GPU tests
#                                       (packed documents), qwen2/gemma/llama3@32768 with the reduced loss's
#                                       new block heuristic, and the attention bench (docs1024 case)
#   bash benchmarks/h200_next.sh last   (4.5 minutes) the float32 SSD tests at chunk 64, llama3 at N=32768
#   bash benchmarks/h200_next.sh next   for the next session: a sweep of attention's pallas_gpu tiles, warps
#                                       and stages (-> the H200 table: copy $OUT/next/attention_tuned/ into
#                                       src/axkern/ops/attention/tuned/ and fix the DATE in its source), the
#                                       GPU order (cudnn, pallas_gpu, xla) and pallas_gpu's soft cap and
#                                       sinks on the GPU, the attention bench with the tuned tiles
#   bash benchmarks/h200_next.sh next2  the SSD bench with the other shapes, the SSD GPU tests
#   bash benchmarks/h200_next.sh ce_tests  all 12 per-token cross-entropy GPU tests, verbose
#   bash benchmarks/h200_next.sh f32    (fourth session) the float32 GPU tests after the precision
#                                       changes (cross-entropy `xla` products at HIGHEST, SSD
#                                       `pallas_gpu` exact float32), the float32 SSD timing
#   bash benchmarks/h200_next.sh f32b   the float32 reduced-loss test at 128256 (cut short in `f32`),
#                                       the float32 SSD GPU tests against the float64 oracle, xla too
#   bash benchmarks/h200_next.sh final  (4 minutes) the bf16 cross-entropy cases at 128256 after the
#                                       xla change, SSD xla bf16 on the GPU, float32 SSD xla timing
#   bash benchmarks/h200_next.sh s5     (next session, first; ~5 min) attention's masking-free FULL tiles,
#                                       changed in the fourth session without a GPU: all attention GPU
#                                       tests and the bench (packed documents: >= 0.8x of causal now?)
#   bash benchmarks/h200_next.sh s5b    (~8 min) the float32 SSD segment sums, also untested on a GPU:
#                                       all SSD GPU tests (xla and pallas_gpu), the float32 timing
#   bash benchmarks/h200_next.sh s6     (fifth session) SSD's per-kernel profile; attention's three
#                                       kernels swept each on its own -> the H200 table
#   bash benchmarks/h200_next.sh s7a    the per-kernel attention tiles (GPU tests, bench), the SSD
#                                       recurrence kernel (profile)
#   bash benchmarks/h200_next.sh s7b    the SSD kernels' warps, per kernel
#   bash benchmarks/h200_next.sh s7c    the SSD recurrence kernel: bench and GPU tests
#   bash benchmarks/h200_next.sh s8     (next session, first; ~4 min) attention's default per-kernel
#                                       tiles against the float64 oracle (bf16, float32), all attention tests
#   bash benchmarks/h200_next.sh s8b    (~7 min) all SSD GPU tests (length 1500: 24 or 12 chunks)
# Each step has its own timeout; everything lands in $OUT/next.tgz.
#
#   mkdir -p .whl/peers && cp ../shared/wheels/*.whl .whl/ && cp ../shared/wheels/peers/*.whl .whl/peers/
#   run(command="bash benchmarks/h200_next.sh ce", carry=[".whl"])
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .whl/peers/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 PATH=/usr/local/cuda/bin:$PATH
R=$OUT/next
mkdir -p "$R"
step() { local t=$1 name=$2; shift 2; echo "== $name"; local s=$SECONDS; timeout "$t" "$@" > "$R/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - s))s" | tee -a "$R/steps.txt"; }
trap 'tar czf "$OUT/next.tgz" -C "$OUT" next' EXIT
# `timeout` runs commands, not shell functions: these expand to words
bench="python3 -m axkern.cli bench"
gpu_tests="env AXKERN_TEST_GPU=1 python3 -m pytest -v -p no:cacheprovider -rs --timeout"
case "${1:-}" in
ce)
  step 220 bench_ce_loss_llama3 $bench fused_cross_entropy_loss --preset llama3 --impl xla,reference --peers --repeats 5 --json "$R/fused_cross_entropy_loss_llama3.json"
  step 50 bench_ce_llama3 $bench fused_cross_entropy --preset llama3 --tokens 16384 --impl pallas_gpu,xla,reference --repeats 5 --json "$R/fused_cross_entropy_llama3.json"
  for p in llama2 qwen2 gemma; do
    step 65 bench_ce_loss_$p $bench fused_cross_entropy_loss --preset $p --impl xla --repeats 3 --json "$R/fused_cross_entropy_loss_$p.json"
  done
  step 100 gpu_tests_ce $gpu_tests 90 tests/gpu/test_fused_cross_entropy_gpu.py -k "(loss_gradients and float32 and 128256) or h200_table"
  ;;
rest)
  step 150 gpu_tests_ssd $gpu_tests 60 tests/gpu/test_ssd_gpu.py
  step 110 gpu_tests_attention $gpu_tests 60 tests/gpu/test_attention_gpu.py
  for p in qwen2 gemma; do  # the reduced loss's new heuristic (D / 2 rows)
    step 45 bench_ce_loss_$p $bench fused_cross_entropy_loss --preset $p --tokens 16384 --impl xla --repeats 3 --json "$R/fused_cross_entropy_loss_$p.json"
  done
  step 40 bench_ce_loss_llama3_32768 $bench fused_cross_entropy_loss --preset llama3 --tokens 32768 --impl xla --repeats 3 --json "$R/fused_cross_entropy_loss_llama3_32768.json"
  step 175 bench_attention $bench attention --preset h200 --impl xla,pallas_gpu,cudnn --repeats 5 --json "$R/attention_h200.json"
  ;;
last)  # after `rest`: float32 SSD at chunk 64 (128 is refused now), llama3 at N=32768 given time
  step 150 gpu_tests_ssd_f32 $gpu_tests 60 tests/gpu/test_ssd_gpu.py -k float32
  step 85 bench_ce_loss_llama3_32768 $bench fused_cross_entropy_loss --preset llama3 --tokens 32768 --impl xla --repeats 3 --json "$R/fused_cross_entropy_loss_llama3_32768.json"
  ;;
next)  # the next session's first call: attention's Triton tiles, warps and stages, then the order tests
  step 260 sweep_attention python3 benchmarks/sweep_attention.py --block-q 64,128 --block-kv 64,128 --num-warps 4,8 --num-stages 2,3 --json "$R/attention_sweep.json"
  step 20 tune_attention python3 benchmarks/tune_table.py --sweep "$R/attention_sweep.json" --op attention --impl pallas_gpu --package axkern.ops.attention --device-key nvidia_h200 --source benchmarks/results/nvidia_h200/attention/sweep.json
  cp -r src/axkern/ops/attention/tuned "$R/attention_tuned" 2>/dev/null
  step 120 gpu_tests_attention $gpu_tests 60 tests/gpu/test_attention_gpu.py -k "order or soft_cap"
  step 170 bench_attention $bench attention --preset h200 --impl pallas_gpu,cudnn --repeats 5 --json "$R/attention_h200.json"
  ;;
ce_tests)  # the cross-entropy GPU tests in full and verbose (some per-token cases never ran: quiet, cut-short runs)
  step 560 gpu_tests_ce $gpu_tests 150 tests/gpu/test_fused_cross_entropy_gpu.py -k "test_on_gpu_against_oracle"
  ;;
next2)  # the second: the SSD bench with the other shapes and a random cotangent; SSD GPU tests
  step 300 bench_ssd $bench ssd --preset mamba2_2.7b --impl xla,pallas_gpu --repeats 5 --json "$R/ssd_mamba2_2.7b.json"
  step 200 gpu_tests_ssd $gpu_tests 60 tests/gpu/test_ssd_gpu.py
  ;;
f32)  # float32 at full precision: the cross-entropy xla products, the SSD pallas_gpu products
  step 270 gpu_tests_ce_f32 $gpu_tests 150 tests/gpu/test_fused_cross_entropy_gpu.py -k "float32 and not h200_table"
  step 170 gpu_tests_ssd_f32 $gpu_tests 80 tests/gpu/test_ssd_gpu.py -k float32
  step 100 bench_ssd_f32 $bench ssd --preset mamba2_2.7b --tokens 4096 --dtype float32 --impl xla,pallas_gpu --repeats 3 --json "$R/ssd_mamba2_2.7b_float32.json"
  ;;
f32b)
  step 200 gpu_tests_ce_loss_f32 $gpu_tests 190 tests/gpu/test_fused_cross_entropy_gpu.py -k "loss_gradients and float32 and 128256"
  step 300 gpu_tests_ssd_f32 $gpu_tests 80 -rxX tests/gpu/test_ssd_gpu.py -k float32
  ;;
final)
  step 90 gpu_tests_ce_bf16 $gpu_tests 85 tests/gpu/test_fused_cross_entropy_gpu.py -k "test_on_gpu_against_oracle and bfloat16 and 128256"
  step 70 gpu_tests_ssd_xla_bf16 $gpu_tests 60 tests/gpu/test_ssd_gpu.py -k "xla and bfloat16"
  step 45 bench_ssd_f32_xla $bench ssd --preset mamba2_2.7b --tokens 4096 --dtype float32 --impl xla --repeats 3 --json "$R/ssd_mamba2_2.7b_float32_xla.json"
  ;;
s5)
  step 180 gpu_tests_attention $gpu_tests 60 tests/gpu/test_attention_gpu.py
  step 150 bench_attention $bench attention --preset h200 --impl pallas_gpu,cudnn --repeats 5 --json "$R/attention_h200.json"
  ;;
s5b)
  step 330 gpu_tests_ssd $gpu_tests 80 tests/gpu/test_ssd_gpu.py
  step 120 bench_ssd_f32 $bench ssd --preset mamba2_2.7b --tokens 4096 --dtype float32 --impl xla,pallas_gpu --repeats 3 --json "$R/ssd_mamba2_2.7b_float32.json"
  ;;
s6)  # fifth session: where SSD's time goes (per-kernel profile, chunks 64 and 128); attention's
     # kernels swept each on its own (forward, then dk/dv, then dq) -> the H200 table
  step 150 ssd_profile python3 benchmarks/ssd_profile.py --chunk 64,128 --json "$R/ssd_profile.json"
  step 380 sweep_attention python3 benchmarks/sweep_attention.py --per-kernel --peers cudnn --repeats 3 \
    --fwd 128x64x4x2,128x64x4x3,128x64x8x2,128x64x8x3,128x128x8x2,128x128x8x3,128x32x4x3,64x64x4x3,64x128x4x3 \
    --dkv 32x128x4x2,32x128x4x3,32x128x8x2,64x128x4x2,64x128x8x2,16x128x4x2,32x64x4x2,32x64x4x3,64x64x4x2 \
    --dq 64x64x4x2,128x32x4x2,128x32x4x3,128x32x8x2,128x64x4x2,128x64x8x2,64x32x4x2,64x32x4x3 \
    --json "$R/attention_sweep.json"
  step 20 tune_attention python3 benchmarks/tune_table.py --sweep "$R/attention_sweep.json" --op attention --impl pallas_gpu --package axkern.ops.attention --device-key nvidia_h200 --source benchmarks/results/nvidia_h200/attention/sweep.json
  cp -r src/axkern/ops/attention/tuned "$R/attention_tuned" 2>/dev/null
  ;;
s7a)  # the per-kernel attention tiles on the GPU (tests, bench); the SSD recurrence kernel's profile
  step 180 gpu_tests_attention $gpu_tests 60 tests/gpu/test_attention_gpu.py
  step 150 bench_attention $bench attention --preset h200 --impl pallas_gpu,cudnn --repeats 5 --json "$R/attention_h200.json"
  step 70 ssd_profile python3 benchmarks/ssd_profile.py --chunk 64 --json "$R/ssd_profile.json"
  ;;
s7b)  # the SSD kernels' Triton warps (4, 8) per kernel, chunks of 64 and 128
  step 150 ssd_profile_warps python3 benchmarks/ssd_profile.py --chunk 64,128 --num-warps 4,8 --json "$R/ssd_profile_warps.json"
  ;;
s7c)  # the SSD recurrence kernel: the bench (main shape, then the others) and all SSD GPU tests
  step 100 bench_ssd $bench ssd --preset mamba2_2.7b --tokens 4096 --impl xla,pallas_gpu --repeats 5 --json "$R/ssd_mamba2_2.7b.json"
  step 320 gpu_tests_ssd $gpu_tests 80 tests/gpu/test_ssd_gpu.py
  step 120 bench_ssd_shapes $bench ssd --preset mamba2_2.7b --impl pallas_gpu --repeats 3 --json "$R/ssd_mamba2_2.7b_shapes.json"
  ;;
s8)  # next session, first: attention's per-kernel default tiles against the float64 oracle on the
     # GPU (bf16 and float32, head dim 128), the rest of the attention GPU tests
  step 300 gpu_tests_attention $gpu_tests 120 tests/gpu/test_attention_gpu.py
  ;;
s8b)  # all SSD GPU tests (length 1500 now: chunk counts that are not powers of two)
  step 540 gpu_tests_ssd $gpu_tests 100 tests/gpu/test_ssd_gpu.py
  ;;
*) echo "usage: h200_next.sh ce|rest|last|next|next2|ce_tests|f32|f32b|final|s5|s5b|s6|s7a|s7b|s7c|s8|s8b"; exit 2 ;;
esac
