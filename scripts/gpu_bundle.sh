#!/usr/bin/env bash
# Builds on this (CPU) machine and bundles what a GPU host without Bazel or
# a package registry needs to run the GPU tests and benchmarks:
#
#   scripts/gpu_bundle.sh [--out=DIR] [--no_cuda_libs] [--no_smollm2] [--archive]
#
# DIR (default device_bundle/, git-ignored) receives bin/ (infinigen with
# its CUDA backend plugin libinfinigen_cuda.so beside it, kv_memory_server,
# h2d_bandwidth, gather_bandwidth, flash_attention_bench and the CUDA test
# binaries), lib/ (every shared library they load that is not part of the
# C library or the NVIDIA driver), models/stories260K, the SmolLM2 GGUF when the fetch script has
# cached it, run.sh (scripts/gpu_host_run.sh) and gpu_bench.sh
# (scripts/gpu_bench.sh, with bench/hf_baseline.py and its report). On the
# GPU host:
#
#   DIR/run.sh OUT_DIR          the CUDA tests and the SmolLM2 benchmarks
#   DIR/gpu_bench.sh OUT_DIR    the llama-2-7b-shaped benchmark against
#                               Hugging Face Transformers (8 minutes)
#
# --archive also writes DIR.tar.xz (for hosts reached through a size-limited
# copy, such as the device machine's 64 MiB carry): unpack it there with
# `tar -xJf DIR.tar.xz`.
#
# --no_cuda_libs leaves out libcudart/libcublas (hundreds of MB) for hosts
# that have a CUDA 13 runtime of their own; run.sh then looks for them in
# the host's CUDA install and Python packages (nvidia-*-cu13 wheels).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
OUT="${ROOT}/device_bundle"
CUDA_LIBS=1
SMOLLM2=1
ARCHIVE=0
for arg in "$@"; do
  case "${arg}" in
    --out=*) OUT="${arg#--out=}" ;;
    --no_cuda_libs) CUDA_LIBS=0 ;;
    --no_smollm2) SMOLLM2=0 ;;
    --archive) ARCHIVE=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "gpu_bundle.sh: unknown argument '${arg}' (see --help)" >&2; exit 2 ;;
  esac
done
if [ ! -x /usr/local/cuda/bin/nvcc ] && [ -z "${CUDA_PATH:-}" ]; then
  echo "gpu_bundle.sh: no CUDA toolkit here (nvcc); the bundle would hold no GPU code" >&2
  exit 1
fi

TARGETS=(
  //gpu_worker:infinigen
  //gpu_worker/backend/cuda:libinfinigen_cuda.so
  //kv_memory_service:kv_memory_server
  //bench/h2d:h2d_bandwidth
  //bench/h2d:gather_bandwidth
  //bench/gpu:flash_attention_bench
  //gpu_worker/backend/cuda:kernels_test
  //gpu_worker/backend/cuda:cuda_backend_test
  //tests:cuda_engine_parity_test
)
echo "gpu_bundle.sh: building ${TARGETS[*]}" >&2
bazel build "${TARGETS[@]}" >&2

rm -rf "${OUT}"
mkdir -p "${OUT}/bin" "${OUT}/lib" "${OUT}/models"
for t in "${TARGETS[@]}"; do
  path="bazel-bin/$(echo "${t#//}" | tr ':' '/')"
  cp -L "${path}" "${OUT}/bin/"
done
cp -rL models/stories260K "${OUT}/models/"
# The tiny random Gemma 3 checkpoint the parity test runs (tests/testdata).
mkdir -p "${OUT}/tests/testdata"
cp -rL tests/testdata/hf_tiny_gemma3 "${OUT}/tests/testdata/"
if [ "${SMOLLM2}" = 1 ] && [ -f models_cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p "${OUT}/models_cache/smollm2-135m"
  cp models_cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf "${OUT}/models_cache/smollm2-135m/"
fi

# Shared libraries: everything ldd resolves except the C library family and
# the driver (libcuda comes with the host's driver).
# ldd the binaries where Bazel built them: test binaries find Bazel's own
# shared libraries (_solib_*) through rpaths relative to that place.
for t in "${TARGETS[@]}"; do
  ldd "bazel-bin/$(echo "${t#//}" | tr ':' '/')" | awk '/=> \//{print $3}'
done | sort -u | while read -r lib; do
  name="$(basename "${lib}")"
  case "${name}" in
    *"=> not found"*) ;;
    libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libcuda.so*) continue ;;
    libcudart.so*|libcublas.so*|libcublasLt.so*)
      [ "${CUDA_LIBS}" = 1 ] || continue ;;
  esac
  cp -L "${lib}" "${OUT}/lib/"
done
cp scripts/gpu_host_run.sh "${OUT}/run.sh"
chmod +x "${OUT}/run.sh"
cp scripts/gpu_bench.sh "${OUT}/gpu_bench.sh"
cp scripts/gpu_libs.sh "${OUT}/gpu_libs.sh"
mkdir -p "${OUT}/bench"
cp bench/hf_baseline.py bench/gpu_bench_report.py "${OUT}/bench/"
git rev-parse HEAD > "${OUT}/COMMIT" 2>/dev/null || echo unknown > "${OUT}/COMMIT"
du -sh "${OUT}" >&2
if [ "${ARCHIVE}" = 1 ]; then
  tar -C "$(dirname "${OUT}")" -cJf "${OUT}.tar.xz" "$(basename "${OUT}")"
  du -sh "${OUT}.tar.xz" >&2
  echo "${OUT}.tar.xz"
else
  echo "${OUT}"
fi
