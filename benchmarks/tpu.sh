#!/usr/bin/env bash
# The TPU tests and the benches on one TPU chip (a maintainer's script), step after step: one
# program at a time can hold the chip, so nothing runs beside another.
#
#   bash benchmarks/tpu.sh STEP...     the steps, in the order given
#   bash benchmarks/tpu.sh list        the steps and each op's presets
#
# Steps:
#   info                    `axkern info --all` on the chip, and the device key (device_key.txt)
#   tests                   tests/tpu's device tests (AXKERN_TEST_TPU=1, -m tpu, one process; JAX sees the
#                           chip and the host's CPU, where the float64 oracles run): junit.xml,
#                           records.jsonl (per check the oracle's dtype, the largest error, the
#                           same-dtype reference's error and the oracle rule's bound), the log
#   tests_smoke             the same, the Pallas TPU kernels' cases only (-k pallas_tpu)
#                           (TPU_TESTS: the test files or folders of both, default tests/tpu)
#   tune_attention          `axkern tune attention --preset tpu --impl pallas_tpu --repeats 3 --write-table`,
#                           one step (300 s) per case that TUNE_ONLY names (comma-separated parts of case
#                           labels; default causal, which took 215 s on a v5e; TUNE_ONLY="causal,window1024,docs1024"
#                           for all three): the tuning cache under $OUT/tpu/cache (AXKERN_CACHE_DIR), every
#                           candidate's row in tune/attention_<case>.json, the written table copied to tune/
#   tune_ssd                `axkern tune ssd --preset tpu --impl pallas_tpu --repeats 3 --write-table`, one
#                           step (420 s: twelve candidates, eight of which took 256 s on a v5e; TUNE_ONLY_SSD, when
#                           set, names the cases as TUNE_ONLY does for attention):
#                           the cache under $OUT/tpu/cache, every candidate's row in tune/ssd.json, the written
#                           table copied to tune/
#   tune_mamba3             the same for mamba3 (its SISO case unless TUNE_ONLY_MAMBA3 names others)
#   bench_attention         attention at the `tpu` preset, pallas_tpu and xla, beside splash attention (--peers)
#   bench_attention_shapes  attention at `tpu_shapes` (GQA 32/8, head dims 64 and 256), pallas_tpu and xla
#   bench_fused_cross_entropy       the per-token op at Llama-3's size (8192 tokens)
#   bench_fused_cross_entropy_loss  the reduced loss at Llama-3's size (8192 tokens; the `tpu` preset:
#                           Llama-3's and Gemma's)
#   bench_fused_cross_entropy_loss_gemma  the reduced loss at Gemma's vocabulary (8192 tokens), where the
#                           loss has no `tpu` preset
#   bench_short_conv        short_conv at the Mamba layer's sizes
#   bench_ssd               ssd at the Mamba-2 2.7B layer (length 4096), beside Levanter's path (--peers)
#   bench_mamba3            mamba3 at the Mamba-3 2.7B layer (SISO, then MIMO of rank 4), beside Levanter's
#   bench_all               every bench above, the most wanted first
#   all                     info, tests, bench_all
#
# An op's bench takes its `tpu` preset where it has one (`axkern bench --list-presets`), else the
# preset named here; `--impl pallas_tpu,xla --repeats 5` (BENCH_ARGS adds arguments to every bench;
# BENCH_PRESET=quick times every op at its quick preset instead: a check of this script on a CPU).
# Wheels for what the machine's image lacks (Python 3.11: haliax, equinox, jaxtyping, beartype,
# cffi, rich, platformdirs, filelock, flax, aqtp, jmp, ...) in the ignored `.whl-tpu/` folder are
# installed into /tmp/site first, which goes after the image's own JAX on PYTHONPATH; with
# `.whl-tpu/peers/levanter/` (marin-levanter's wheel and its small dependencies, installed in
# spite of its Python >= 3.12) and `.whl-tpu/levanter_stubs/` (../shared/peers) the `ssd` and
# `mamba3` benches time Levanter's path beside ours (`--peers`). Logs and the
# benches' JSON go under $OUT/tpu (./tpu-run/tpu without $OUT): one log per step, steps.txt with
# each step's exit status and seconds, <op>/<preset>.json per bench (the layout of
# benchmarks/results). Each step has its own timeout (seconds), cut to what is left of TPU_BUDGET
# (seconds since the script started, default 560); a step with less than 45 s
# left is skipped and steps.txt says so.
set -u
export PYTHONUNBUFFERED=1
R=${OUT:-$PWD/tpu-run}/tpu
mkdir -p "$R"
# BUNDLE=1: the run's folder packed into one file on exit (benchmarks/bundle.sh)
. "$(dirname "$0")/bundle.sh"
if compgen -G ".whl-tpu/*.whl" > /dev/null; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --upgrade \
    --target /tmp/site .whl-tpu/*.whl > "$R/install.log" 2>&1 ||
    echo "the wheels did not install (install.log): the steps below will say what does not import"
  if compgen -G ".whl-tpu/peers/levanter/*.whl" > /dev/null; then  # apart: Levanter declares Python >= 3.12
    PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --upgrade \
      --ignore-requires-python --target /tmp/site .whl-tpu/peers/levanter/*.whl >> "$R/install.log" 2>&1 ||
      echo "Levanter's wheels did not install (install.log): the benches' peers will say it is not installed"
  fi
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site:$PWD/src
  [ -d .whl-tpu/levanter_stubs ] && PYTHONPATH=$PYTHONPATH:$PWD/.whl-tpu/levanter_stubs
else
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src
fi
BUDGET=${TPU_BUDGET:-560}
step() {  # step TIMEOUT NAME COMMAND...
  local t=$1 name=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 45 ]; then
    echo "$name skipped: ${left}s left of TPU_BUDGET=$BUDGET" | tee -a "$R/steps.txt"
    return
  fi
  [ "$t" -gt "$left" ] && t=$left
  echo "== $name (limit ${t}s)"
  local s=$SECONDS rc
  # interrupted at its limit (pytest then prints what failed so far and writes its XML; a bench has
  # written the cases it finished), killed 15 s later if it ignores the signal (a hung kernel)
  timeout -s INT -k 15 "$t" "$@" > "$R/$name.log" 2>&1
  rc=$?
  # the chip may refuse a program started just after another ended: once more, a little later
  if [ "$rc" -ne 0 ] && [ $((SECONDS - s)) -lt 60 ] && grep -q "libtpu multi-process lockfile\|TPU is already in use" "$R/$name.log" \
    && [ $((BUDGET - SECONDS)) -gt 60 ]; then
    mv "$R/$name.log" "$R/$name.refused.log"
    sleep 10
    t=$((BUDGET - SECONDS < t ? BUDGET - SECONDS : t))
    timeout -s INT -k 15 "$t" "$@" > "$R/$name.log" 2>&1
    rc=$?
  fi
  echo "$name rc=$rc $((SECONDS - s))s" | tee -a "$R/steps.txt"
}
# what the helper processes read must not open the chip that a step may hold
presets=$(JAX_PLATFORMS=cpu python3 -m axkern bench --list-presets 2> "$R/presets.log")
[ -n "$presets" ] || echo "axkern bench --list-presets printed nothing (presets.log): the benches take the presets named here" |
  tee -a "$R/steps.txt"
has_preset() {  # has_preset OP PRESET
  echo "$presets" | sed -n "s/^$1: //p" | tr ',' '\n' | sed 's/ (default)//; s/ //g' | grep -qx "$2"
}
bench() {  # bench TIMEOUT NAME OP PRESET [PRESET ARGUMENTS] -- [ARGUMENTS]: the `tpu` preset where the op has one
  local t=$1 name=$2 op=$3 preset=$4; shift 4
  local fallback=() more=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do fallback+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  more=("$@")
  if [ -n "${BENCH_PRESET:-}" ]; then  # one preset for every bench (a check of this script on a CPU)
    preset=$BENCH_PRESET fallback=()
  elif [ "${AUTO_TPU:-1}" = 1 ] && has_preset "$op" tpu; then  # AUTO_TPU=0: the preset named
    preset=tpu fallback=()
  fi
  mkdir -p "$R/$op"
  # shellcheck disable=SC2086
  step "$t" "$name" python3 -m axkern bench "$op" --preset "$preset" "${fallback[@]}" --impl pallas_tpu,xla \
    --repeats 5 --json "$R/$op/$preset.json" "${more[@]}" ${BENCH_ARGS:-}
}
steps() {  # the step names of this file's header
  sed -n '/^# Steps:/,/^#$/p' "$0" | sed -n 's/^#   \([a-z0-9_]\+\) .*/\1/p'
}
run_step() {
  case "$1" in
  info)
    step 90 info python3 -c 'import sys, jax
from axkern.cli import main
from axkern.core import backend
print("jax", jax.__version__, jax.devices())
key = backend.device_key()
print("device key:", key)
open(sys.argv[1], "w").write(key + "\n")
sys.exit(main(["info", "--all"]))' "$R/device_key.txt"
    ;;
  tests | tests_smoke)
    mkdir -p "$R/tests"
    rm -f "$R/tests/records.jsonl"
    local k=()
    [ "$1" = tests_smoke ] && k=(-k pallas_tpu)
    # the float64 oracles run on the host's CPU device: JAX is asked for it beside the chip
    local platforms=tpu,cpu
    [ "${AXKERN_TEST_TPU:-1}" = interpret ] && platforms=cpu
    step 480 "$1" env AXKERN_TEST_TPU="${AXKERN_TEST_TPU:-1}" AXKERN_TEST_TPU_RECORD="$R/tests/records.jsonl" \
      JAX_PLATFORMS="$platforms" python3 -m pytest -v -p no:cacheprovider -rs --durations=60 \
      --junitxml="$R/tests/junit.xml" -m tpu "${k[@]}" ${TPU_TESTS:-tests/tpu}
    ;;
  tune_attention)
    mkdir -p "$R/tune"
    local c
    for c in $(echo "${TUNE_ONLY:-causal}" | tr ',' ' '); do  # each case its own limit: a cut one keeps the others
      step 300 "tune_attention_$c" env AXKERN_CACHE_DIR="$R/cache" python3 -m axkern tune attention --preset tpu \
        --impl pallas_tpu --repeats 3 --write-table --json "$R/tune/attention_$c.json" --only "$c"
    done
    cp src/axkern/ops/attention/tuned/tpu_*.json "$R/tune/" 2> /dev/null ||
      echo "tune_attention: no table written under src/axkern/ops/attention/tuned/" | tee -a "$R/steps.txt"
    ;;
  tune_ssd | tune_mamba3)
    local op=${1#tune_} only
    if [ "$op" = ssd ]; then only=${TUNE_ONLY_SSD:-}; else only=${TUNE_ONLY_MAMBA3:-SISO}; fi
    mkdir -p "$R/tune"
    step 420 "$1" env AXKERN_CACHE_DIR="$R/cache" python3 -m axkern tune "$op" --preset tpu --impl pallas_tpu \
      --repeats 3 --write-table --json "$R/tune/$op.json" ${only:+--only "$only"}
    cp src/axkern/ops/"$op"/tuned/tpu_*.json "$R/tune/" 2> /dev/null ||
      echo "$1: no table written under src/axkern/ops/$op/tuned/" | tee -a "$R/steps.txt"
    ;;
  bench_attention) bench 240 bench_attention attention h200 --tokens 2048 -- --peers ;;
  bench_attention_shapes)
    has_preset attention tpu_shapes && AUTO_TPU=0 bench 180 bench_attention_shapes attention tpu_shapes
    has_preset attention tpu_shapes || echo "bench_attention_shapes skipped: no tpu_shapes preset listed" | tee -a "$R/steps.txt"
    ;;
  bench_fused_cross_entropy) bench 120 "$1" fused_cross_entropy llama3 --tokens 8192 ;;
  bench_fused_cross_entropy_loss) bench 150 "$1" fused_cross_entropy_loss llama3 --tokens 8192 ;;
  bench_fused_cross_entropy_loss_gemma)  # where the loss has no `tpu` preset (which holds Gemma's vocabulary)
    if has_preset fused_cross_entropy_loss tpu && [ -z "${BENCH_PRESET:-}" ]; then
      echo "$1 skipped: the tpu preset of fused_cross_entropy_loss has Gemma's vocabulary" | tee -a "$R/steps.txt"
    else
      AUTO_TPU=0 bench 120 "$1" fused_cross_entropy_loss gemma --tokens 8192
    fi
    ;;
  bench_short_conv) bench 100 "$1" short_conv mamba ;;
  bench_ssd) bench 150 "$1" ssd mamba2_2.7b --tokens 4096 -- --peers ;;
  bench_mamba3) bench 240 "$1" mamba3 mamba3_2.7b -- --peers ;;
  bench_all)
    local s
    for s in bench_attention bench_fused_cross_entropy_loss bench_ssd bench_mamba3 bench_short_conv \
      bench_fused_cross_entropy bench_fused_cross_entropy_loss_gemma bench_attention_shapes; do
      run_step "$s"
    done
    ;;
  all)
    local s
    for s in info tests bench_all; do run_step "$s"; done
    ;;
  list)
    steps
    echo "$presets"
    ;;
  *)
    echo "tpu.sh: unknown step '$1'; the steps: $(steps | tr '\n' ' ')" >&2
    return 2
    ;;
  esac
}
[ $# -gt 0 ] || set -- list
for s in "$@"; do run_step "$s" || exit $?; done
