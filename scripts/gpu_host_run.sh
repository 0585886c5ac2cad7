#!/usr/bin/env bash
# Runs the GPU tests and GPU benchmarks of a bundle made by
# scripts/gpu_bundle.sh, on a GPU host, and writes every result to OUT_DIR:
#
#   run.sh OUT_DIR [--quick] [--sanitize]
#
#   device.txt            nvidia-smi and the CUDA libraries used
#   tests/*.xml, *.log    the CUDA kernel, backend and engine parity tests
#   h2d.md, h2d.jsonl     pinned and pageable host-to-device bandwidth
#   shm_*.log             one-sided reads over shm on the GPU against the
#                         node's gather (stories260K, greedy)
#   decode_*.md, .jsonl   infinigen bench-decode on the GPU (SmolLM2-135M
#                         when bundled, else stories260K): contexts 4K-32K,
#                         batch 1-16, policies ideal, full, infinigen, h2o,
#                         int4; --quick runs one context and batch
#   sanitize_*.log        (--sanitize) compute-sanitizer's memcheck and
#                         racecheck on the tensor-core prefill, the
#                         one-sided gather and the strided K/V copies
#   summary.txt           pass/fail per step
# Exits non-zero if a test failed.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:-}"
QUICK=0
SANITIZE=0
for arg in "${@:2}"; do
  case "${arg}" in
    --quick) QUICK=1 ;;
    --sanitize) SANITIZE=1 ;;
    *) echo "run.sh: unknown flag '${arg}' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "${OUT}" ] || [ "${OUT}" = "-h" ] || [ "${OUT}" = "--help" ]; then
  awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"
  [ -z "${OUT}" ] && exit 2 || exit 0
fi
case "${OUT}" in
  -*) echo "run.sh: unknown flag '${OUT}' (OUT_DIR first; see --help)" >&2
      exit 2 ;;
esac
mkdir -p "${OUT}/tests"
OUT="$(cd "${OUT}" && pwd)"
# The bundle's libraries, and the CUDA runtime where it has none.
source "${HERE}/gpu_libs.sh"
cd "${HERE}"
export INFINIGEN_ROOT="${HERE}"
SUMMARY="${OUT}/summary.txt"
: > "${SUMMARY}"
FAILED=0
{
  nvidia-smi || echo "nvidia-smi: not found"
  for b in bin/*; do echo "== ${b}"; ldd "${b}" | grep -E "cuda|cublas" ; done
} > "${OUT}/device.txt" 2>&1

for t in kernels_test cuda_backend_test cuda_engine_parity_test; do
  if "bin/${t}" --gtest_output="xml:${OUT}/tests/${t}.xml" > "${OUT}/tests/${t}.log" 2>&1; then
    passed="$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "${OUT}/tests/${t}.log")"
    skipped="$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "${OUT}/tests/${t}.log")"
    echo "PASS ${t}: ${passed:-0} passed, ${skipped:-0} skipped (a skip says why in the log)" >> "${SUMMARY}"
  else
    echo "FAIL ${t} (see tests/${t}.log)" >> "${SUMMARY}"
    FAILED=1
  fi
done

# compute-sanitizer on the kernels where a race or a stray access would
# hide: the tensor-core prefill, the one-sided gather (by index and whole
# layers), the strided copies, the device-side selection, the staged rows'
# attention (by slot of a row cache too) and the row cache's scatter.
if [ "${SANITIZE}" = 1 ]; then
  SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)"
  for tool in memcheck racecheck; do
    for run in "kernels_test:*Flash*:*GatherRows*:*SelectTopK*:*Combine*:*Staged*:*Slotted*" \
               "cuda_backend_test:*CopyRows*:*HalfPrecisionPrefill*:*HalfKvCache*:*SelectTopK*:*AttendStaged*:*QueuedCopies*:*BatchedProducts*:*EncodesHalf*:*LeadingRows*"; do
      t="${run%%:*}"; filter="${run#*:}"
      log="${OUT}/sanitize_${tool}_${t}.log"
      if [ -z "${SAN}" ]; then
        echo "FAIL sanitize: no compute-sanitizer on this host" >> "${SUMMARY}"
        FAILED=1
        break 2
      fi
      # Bounded: racecheck can take minutes on a long kernel.
      timeout "${SANITIZE_TIMEOUT_S:-180}" "${SAN}" --tool "${tool}" \
        --error-exitcode 1 "bin/${t}" --gtest_filter="${filter}" \
        > "${log}" 2>&1
      rc=$?
      if [ "${rc}" = 0 ]; then
        echo "PASS compute-sanitizer ${tool} ${t} (${filter}): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "${log}" | tail -1)" >> "${SUMMARY}"
      elif [ "${rc}" = 124 ]; then
        echo "FAIL compute-sanitizer ${tool} ${t}: over ${SANITIZE_TIMEOUT_S:-180} s (see $(basename "${log}"))" >> "${SUMMARY}"
        FAILED=1
      else
        echo "FAIL compute-sanitizer ${tool} ${t} (see $(basename "${log}"))" >> "${SUMMARY}"
        FAILED=1
      fi
    done
  done
fi

if bin/h2d_bandwidth --sizes=16K,192K,3M,12M,48M > "${OUT}/h2d.md" 2>&1 &&
   bin/h2d_bandwidth --sizes=16K,192K,3M,12M,48M --json > "${OUT}/h2d.jsonl" 2>&1; then
  echo "PASS h2d_bandwidth" >> "${SUMMARY}"
else
  echo "FAIL h2d_bandwidth (see h2d.md)" >> "${SUMMARY}"
fi

# One-sided reads over shm on the GPU: the node's rows mapped read-only and
# registered with CUDA give the node's gather's greedy text.
SOCK="$(mktemp -u /tmp/infinigen_kv_XXXXXX.sock)"
bin/kv_memory_server --listen=127.0.0.1:0 --shm_listen="unix:${SOCK}" \
  > "${OUT}/shm_direct_server.log" 2>&1 &
KV=$!
for _ in $(seq 100); do [ -S "${SOCK}" ] && break; sleep 0.1; done
GEN=(bin/infinigen generate --backend=cuda --policy=full
     --model=models/stories260K/stories260K.bin
     --tokenizer=models/stories260K/tok512.bin --prompt="Once upon a time"
     --max_new_tokens=40 --temperature=0 --kv_service="shm:unix:${SOCK}")
gathered="$("${GEN[@]}" 2> "${OUT}/shm_gather.log")"
direct="$("${GEN[@]}" --kv_direct_reads 2> "${OUT}/shm_direct.log")"
kill "${KV}" 2>/dev/null; wait "${KV}" 2>/dev/null
rm -f "${SOCK}" "${SOCK}.lock"
if [ -n "${gathered}" ] && [ "${gathered}" = "${direct}" ] &&
   ! grep -q "could not be pinned" "${OUT}/shm_direct.log"; then
  echo "PASS shm one-sided reads on the GPU: the gather's text" >> "${SUMMARY}"
else
  echo "FAIL shm one-sided reads on the GPU (see shm_direct.log, shm_gather.log)" >> "${SUMMARY}"
  FAILED=1
fi

MODEL="models_cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
EXTRA=()
CONTEXTS="4000 8000 16000 32000"
BATCHES="1 4 16"
if [ ! -f "${MODEL}" ]; then
  MODEL="models/stories260K/stories260K.bin"
  EXTRA=(--tokenizer=models/stories260K/tok512.bin)
  CONTEXTS="200 480"   # stories260K's context is 512 (ctx + 32 steps)
fi
if [ "${QUICK}" = 1 ]; then
  CONTEXTS="${CONTEXTS%% *}"
  BATCHES="1"
fi
for ctx in ${CONTEXTS}; do
  for batch in ${BATCHES}; do
    name="decode_ctx${ctx}_b${batch}"
    if bin/infinigen bench-decode --backend=cuda --model="${MODEL}" "${EXTRA[@]}" \
        --ctx="${ctx}" --batch="${batch}" --decode_tokens=32 \
        --policy=ideal,full,infinigen,h2o,int4 --json \
        > "${OUT}/${name}.md" 2> "${OUT}/${name}.log"; then
      grep '^{' "${OUT}/${name}.md" >> "${OUT}/decode.jsonl"
      echo "PASS ${name}" >> "${SUMMARY}"
    else
      echo "FAIL ${name} (see ${name}.log)" >> "${SUMMARY}"
    fi
  done
done
cat "${SUMMARY}"
exit "${FAILED}"
