#!/usr/bin/env bash
# The GPU benchmark in one call, on a GPU host, from a bundle made by
# scripts/gpu_bundle.sh (it is the bundle's gpu_bench.sh):
#
#   gpu_bench.sh OUT_DIR [--budget_s=480] [--model_config=llama-2-7b]
#                [--decode_tokens=64] [--shapes=4096x1,32768x1,8192x8,16384x1]
#                [--big=32768x5|none] [--backend=cuda]
#                [--infinigen=bin/infinigen] [--skew=PATH]
#                [--dry_run]
#
# Runs, the goals' runs at every shape first, then the node's gather, h2o
# and int4, each under what is left of the budget (default 480 s; a run the
# budget cuts short is recorded as timed out, later ones as skipped):
#   h2d_bandwidth                 pinned and pageable host-to-device copies
#   gather_bandwidth              one-sided reads of a layer's rows (all,
#                                 and 10%) from cudaHostAlloc'd and from
#                                 registered mmap memory (4 KiB pages, huge
#                                 pages, and touched by the device before
#                                 the rows are written, as the CUDA
#                                 backend's PinHost does), and the first
#                                 read of freshly registered rows
#   flash_attention_bench         prefill attention TFLOP/s (llama-2-7b's
#                                 heads, a 2048-query chunk, first and last
#                                 of a 32768-token prompt) against the WMMA
#                                 kernel
#   infinigen skew                once, on dummy weights and synthetic tokens
#                                 (--skew=PATH: kept there and reused by a
#                                 later call; default OUT_DIR/runs/dummy.skew)
#   infinigen bench-decode        --load_format=dummy at --model_config's
#                                 shape, fp16 weights on the GPU: ideal, full,
#                                 h2o, int4, and infinigen at
#                                 --target_fetch=0.1, at each of --shapes
#                                 (CTXxBATCH); full and infinigen also with
#                                 --kv_direct_reads
#   bench/hf_baseline.py          Hugging Face Transformers at the same shapes:
#                                 DynamicCache (KV on the GPU) and its
#                                 offloaded cache (KV in host memory)
#   KV beyond the GPU             --big, ctx 32768 x batch 5 (80 GiB of fp16
#                                 KV for llama-2-7b, more than an H100's 80
#                                 GB; the host holds it beside the dummy
#                                 weights' 25 GiB): ideal (refused), full,
#                                 infinigen
# and writes OUT_DIR/gpu_bench.json and OUT_DIR/gpu_bench.md
# (bench/gpu_bench_report.py), each run's output and stderr in OUT_DIR/runs/.
# --dry_run prints the commands and writes the report of what exists.
# --backend=cpu and --infinigen=PATH run the same commands on a CPU build (a
# smoke test of the script; the figures are not the GPU's).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT=""
BUDGET=480
MODEL=llama-2-7b
STEPS=64
DRY=0
SHAPES="4096x1,32768x1,8192x8,16384x1"
BIG="32768x5"
BACKEND=cuda
INFINIGEN=""
SKEW=""
for arg in "$@"; do
  case "${arg}" in
    --budget_s=*) BUDGET="${arg#--budget_s=}" ;;
    --model_config=*) MODEL="${arg#--model_config=}" ;;
    --decode_tokens=*) STEPS="${arg#--decode_tokens=}" ;;
    --dry_run) DRY=1 ;;
    --shapes=*) SHAPES="${arg#--shapes=}" ;;
    --big=*) BIG="${arg#--big=}" ;;
    --backend=*) BACKEND="${arg#--backend=}" ;;
    --infinigen=*) INFINIGEN="${arg#--infinigen=}" ;;
    --skew=*) SKEW="${arg#--skew=}" ;;
    -h|--help)
      awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"
      exit 0 ;;
    -*) echo "gpu_bench.sh: unknown flag '${arg}' (see --help)" >&2; exit 2 ;;
    *) if [ -n "${OUT}" ]; then
         echo "gpu_bench.sh: one OUT_DIR, got '${OUT}' and '${arg}'" >&2
         exit 2
       fi
       OUT="${arg}" ;;
  esac
done
if [ -z "${OUT}" ]; then
  echo "gpu_bench.sh: OUT_DIR is required (see --help)" >&2
  exit 2
fi
case "${BUDGET}${STEPS}" in
  *[!0-9]*) echo "gpu_bench.sh: --budget_s and --decode_tokens take whole numbers" >&2
            exit 2 ;;
esac
for shape in ${SHAPES//,/ } $([ "${BIG}" = none ] || echo "${BIG}"); do
  case "${shape}" in
    [0-9]*x[0-9]*) ;;
    *) echo "gpu_bench.sh: a shape is CTXxBATCH, got '${shape}'" >&2; exit 2 ;;
  esac
done
# A config.json path (not a preset name) is read after the cd below.
if [ -e "${MODEL}" ]; then
  MODEL="$(cd "$(dirname "${MODEL}")" && pwd)/$(basename "${MODEL}")"
fi
if [ -z "${INFINIGEN}" ]; then
  INFINIGEN="${HERE}/bin/infinigen"
elif [ -d "$(dirname "${INFINIGEN}")" ]; then
  INFINIGEN="$(cd "$(dirname "${INFINIGEN}")" && pwd)/$(basename "${INFINIGEN}")"
fi
mkdir -p "${OUT}/runs"
OUT="$(cd "${OUT}" && pwd)"
if [ -n "${SKEW}" ]; then
  mkdir -p "$(dirname "${SKEW}")"
  SKEW="$(cd "$(dirname "${SKEW}")" && pwd)/$(basename "${SKEW}")"
else
  SKEW="${OUT}/runs/dummy.skew"
fi
cd "${HERE}"
# The Python scripts: bench/ in a bundle or in the repository (this file's
# ../bench).
BENCH="${HERE}/bench"
[ -f "${BENCH}/hf_baseline.py" ] || BENCH="${HERE}/../bench"
# The bundle's libraries, and the CUDA runtime where it has none.
source "${HERE}/gpu_libs.sh"
START=$(date +%s)
DEADLINE=$((START + BUDGET))
IG=("${INFINIGEN}")
DUMMY=(--load_format=dummy "--model_config=${MODEL}" "--backend=${BACKEND}")

# run NAME CMD...: runs CMD under the budget left, stdout to runs/NAME.out,
# stderr to runs/NAME.err, and its outcome to runs/NAME.meta.json.
run() {
  local name="$1"; shift
  local left=$((DEADLINE - $(date +%s)))
  echo "+ ${*}" >&2
  if [ "${DRY}" = 1 ]; then return 0; fi
  local rc=0 timed_out=false skipped=false t0 t1
  printf '%s\n' "$@" > "${OUT}/runs/${name}.cmd"
  t0=$(date +%s%N)
  if [ "${left}" -lt 5 ]; then
    skipped=true; rc=124
  else
    timeout --signal=TERM --kill-after=10 "${left}" "$@" \
      > "${OUT}/runs/${name}.out" 2> "${OUT}/runs/${name}.err" || rc=$?
    [ "${rc}" = 124 ] || [ "${rc}" = 137 ] && timed_out=true
  fi
  t1=$(date +%s%N)
  printf '{"name": "%s", "rc": %d, "timed_out": %s, "skipped": %s, "seconds": %s}\n' \
    "${name}" "${rc}" "${timed_out}" "${skipped}" \
    "$(awk -v a="${t0}" -v b="${t1}" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')" \
    > "${OUT}/runs/${name}.meta.json"
  echo "  ${name}: rc ${rc}$([ "${timed_out}" = true ] && echo ', timed out')$([ "${skipped}" = true ] && echo ', skipped: no budget left')" >&2
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader,nounits \
    || echo "none,none,0"
} > "${OUT}/device.csv" 2>/dev/null
[ -f COMMIT ] && cp COMMIT "${OUT}/commit.txt"

run h2d "$(dirname "${INFINIGEN}")/h2d_bandwidth" --sizes=192K,3M,48M --json
run gather "$(dirname "${INFINIGEN}")/gather_bandwidth" --fractions=1,0.1 \
  --memory=host_alloc,registered,registered_huge,registered_touched --json
run flash "$(dirname "${INFINIGEN}")/flash_attention_bench" --prefixes=0,30720 \
  --json
# The skew depends only on the model's shape (the dummy weights are
# deterministic): one made by an earlier call is reused.
if [ -s "${SKEW}" ]; then
  echo "+ reusing the skew ${SKEW}" >&2
else
  run skew "${IG[@]}" skew "${DUMMY[@]}" --calibration_tokens=256 "--out=${SKEW}"
fi

# bench NAME CTX BATCH POLICIES [FLAGS...]: infinigen's runs at one shape.
bench() {
  local name="$1" ctx="$2" batch="$3" policies="$4"; shift 4
  run "${name}" "${IG[@]}" bench-decode "${DUMMY[@]}" "--ctx=${ctx}" \
    "--batch=${batch}" "--decode_tokens=${STEPS}" "--policy=${policies}" \
    --json "$@"
}
# hf NAME CTX BATCH CACHE: Transformers at one shape.
hf() {
  run "$1" python3 "${BENCH}/hf_baseline.py" "--model_config=${MODEL}" \
    "--ctx=$2" "--batch=$3" "--cache=$4" "--decode_tokens=${STEPS}" \
    "--device=$([ "${BACKEND}" = cpu ] && echo cpu || echo cuda)"
}

# First the runs the goals compare, at every shape, so that a budget that
# runs out takes the others: ideal, the offloading policies with one-sided
# reads (the GPU reads the rows from the node's memory) and Transformers.
for shape in ${SHAPES//,/ }; do
  ctx="${shape%x*}"; batch="${shape#*x}"; tag="ctx${ctx}_b${batch}"
  # ideal alone: where its KV does not fit it is refused, and the others run.
  bench "ig_ideal_${tag}" "${ctx}" "${batch}" ideal
  hf "hf_dynamic_${tag}" "${ctx}" "${batch}" dynamic
  bench "ig_full_direct_${tag}" "${ctx}" "${batch}" full \
    --kv_direct_reads=true
  bench "ig_infinigen_direct_${tag}" "${ctx}" "${batch}" infinigen \
    --target_fetch=0.1 "--skew=${SKEW}" --kv_direct_reads=true
  hf "hf_offloaded_${tag}" "${ctx}" "${batch}" offloaded
done
# KV larger than the GPU's memory, smaller than the host's (--big=none: not
# run).
if [ "${BIG}" != none ]; then
  ctx="${BIG%x*}"; batch="${BIG#*x}"
  bench big_ideal "${ctx}" "${batch}" ideal
  bench big_full "${ctx}" "${batch}" full
  bench big_infinigen "${ctx}" "${batch}" infinigen --target_fetch=0.1 \
    "--skew=${SKEW}"
fi

# Then the node's gather, h2o and int4.
for shape in ${SHAPES//,/ }; do
  ctx="${shape%x*}"; batch="${shape#*x}"; tag="ctx${ctx}_b${batch}"
  bench "ig_full_${tag}" "${ctx}" "${batch}" full
  bench "ig_infinigen_${tag}" "${ctx}" "${batch}" infinigen \
    --target_fetch=0.1 "--skew=${SKEW}"
  bench "ig_${tag}" "${ctx}" "${batch}" h2o,int4
done
python3 "${BENCH}/gpu_bench_report.py" "${OUT}" --model_config="${MODEL}"
