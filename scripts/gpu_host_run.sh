#!/usr/bin/env bash
# Runs the GPU tests and GPU benchmarks of a bundle made by
# scripts/gpu_bundle.sh, on a GPU host, and writes every result to OUT_DIR:
#
#   run.sh OUT_DIR [--quick]
#
#   device.txt            nvidia-smi and the CUDA libraries used
#   tests/*.xml, *.log    the CUDA kernel, backend and engine parity tests
#   h2d.md, h2d.jsonl     pinned and pageable host-to-device bandwidth
#   decode_*.md, .jsonl   infinigen bench-decode on the GPU (SmolLM2-135M
#                         when bundled, else stories260K): contexts 4K-32K,
#                         batch 1-16, policies ideal, full, infinigen, h2o,
#                         int4; --quick runs one context and batch
#   summary.txt           pass/fail per step
# Exits non-zero if a test failed.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:-}"
QUICK=0
[ "${2:-}" = "--quick" ] && QUICK=1
if [ -z "${OUT}" ] || [ "${OUT}" = "-h" ] || [ "${OUT}" = "--help" ]; then
  awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"
  [ -z "${OUT}" ] && exit 2 || exit 0
fi
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

if bin/h2d_bandwidth --sizes=16K,192K,3M,12M,48M > "${OUT}/h2d.md" 2>&1 &&
   bin/h2d_bandwidth --sizes=16K,192K,3M,12M,48M --json > "${OUT}/h2d.jsonl" 2>&1; then
  echo "PASS h2d_bandwidth" >> "${SUMMARY}"
else
  echo "FAIL h2d_bandwidth (see h2d.md)" >> "${SUMMARY}"
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
