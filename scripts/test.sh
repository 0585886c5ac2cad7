#!/usr/bin/env bash
# Runs every test: installs the build's Debian packages, fetches the larger
# real models into the git-ignored cache (tests that need them skip without),
# runs `bazel test //...`, then a focused set of unit tests under ASan+UBSan
# and TSan (scripts/sanitizer_tests.sh), a few seconds of each libFuzzer
# target (fuzz/run.sh), and ends with one line `N passed, N failed,
# N skipped` counted over the individual test cases of all of them.
set -uo pipefail
for arg in "$@"; do
  case "$arg" in
  -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "test.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
root="$PWD"

./scripts/install_deps.sh || exit 1
./scripts/fetch_smollm2.sh >/dev/null ||
  echo "test.sh: SmolLM2 could not be fetched; tests that need it will skip" >&2
./scripts/fetch_gemma3.sh >/dev/null ||
  echo "test.sh: Gemma 3 could not be fetched; tests that need it will skip" >&2

quiet='^(Loading|Analyzing|INFO: From|\[[0-9,]+ / [0-9,]+\])'
# The unit tests run the OpenBLAS kernels the binaries choose for this CPU
# (gpu_worker/backend/cpu/blas_kernels.h), not the ones OpenBLAS picks alone.
blas=()
if bazel build //gpu_worker:infinigen >/dev/null 2>&1; then
  core=$(INFINIGEN_LOG_LEVEL=debug bazel-bin/gpu_worker/infinigen --help 2>&1 >/dev/null |
    sed -n 's/.*OpenBLAS kernels: //p')
  [ -n "$core" ] && blas=(--test_env=OPENBLAS_CORETYPE="$core")
fi
log="$(mktemp)"
bazel test //... --test_env=INFINIGEN_ROOT="$root" "${blas[@]}" --keep_going "$@" 2>&1 |
  tee "$log" | grep -vE "$quiet"
rc=${PIPESTATUS[0]}
# Each run's log and its test logs (bazel-testlogs follows the last run).
counted=("$log" "$(readlink -f bazel-testlogs)")

# A short run of the fetch benchmark (bench/kv_fetch_bench/smoke.sh): its
# table of memcpy ratios printed, one check in the count (it fails only when
# a plane fails, never on time).
blog="$(mktemp)"
if bench/kv_fetch_bench/smoke.sh; then
  echo "//bench/kv_fetch_bench:smoke PASSED" >"$blog"
else
  echo "//bench/kv_fetch_bench:smoke FAILED" >"$blog"
  [ "$rc" -eq 0 ] && rc=1
fi
counted+=("$blog" "bench/kv_fetch_bench")

# A short run of the decode path with and without the row cache
# (bench/row_cache_smoke.sh): its ratios printed, one check in the count
# (it fails only when a run fails or the selections differ, never on time).
rlog="$(mktemp)"
if bench/row_cache_smoke.sh; then
  echo "//bench:row_cache_smoke PASSED" >"$rlog"
else
  echo "//bench:row_cache_smoke FAILED" >"$rlog"
  [ "$rc" -eq 0 ] && rc=1
fi
counted+=("$rlog" "bench")

# The docs, results and README speak to users: no words of how the project
# was developed in them (one check in the count).
dlog="$(mktemp)"
if grep -rniE "stop [0-9]+|stop's|next stop|this stop|helper session|issue [0-9]+" docs bench README.md; then
  echo "//docs:no_process_words FAILED" >"$dlog"
  [ "$rc" -eq 0 ] && rc=1
else
  echo "//docs:no_process_words PASSED" >"$dlog"
fi
counted+=("$dlog" "docs")

# The tree's shape (scripts/check_layers.sh: file sizes, the layers, no
# two units including each other's headers; one check in the count).
llog="$(mktemp)"
if bash scripts/check_layers.sh; then
  echo "//scripts:check_layers PASSED" >"$llog"
else
  echo "//scripts:check_layers FAILED" >"$llog"
  [ "$rc" -eq 0 ] && rc=1
fi
counted+=("$llog" "scripts")

# The images built and run as the manifests say (scripts/container_test.py:
# both images, the disaggregated and single-node overlays over TCP and shm,
# the memory node killed and restarted, SIGTERM); one check in the count,
# SKIPPED where containers cannot run on this machine.
clog="$(mktemp)"
python3 scripts/container_test.py 2>&1 | tee "$clog"
crc=${PIPESTATUS[0]}
[ "$crc" -ne 0 ] && [ "$rc" -eq 0 ] && rc=$crc
counted+=("$clog" "scripts")

# Then a focused set of unit tests under ASan+UBSan and under TSan
# (scripts/sanitizer_tests.sh), counted in the same line.
for config in asan tsan; do
  slog="$(mktemp)"
  ./scripts/sanitizer_tests.sh "$config" 2>&1 | tee "$slog" | grep -vE "$quiet"
  src=${PIPESTATUS[0]}
  [ "$src" -ne 0 ] && [ "$rc" -eq 0 ] && rc=$src
  counted+=("$slog" "$(readlink -f bazel-testlogs)")
done

# And a short smoke of each libFuzzer target (fuzz/run.sh): its seeds, then
# a few seconds of fuzzing; one check per target in the count.
flog="$(mktemp)"
ftable="$(mktemp)"
fuzz/run.sh "${FUZZ_SMOKE_SECONDS:-5}" >"$ftable"
frc=$?
cat "$ftable"
awk 'NR > 1 { print "//fuzz:" $1, ($NF == "ok" ? "PASSED" : "FAILED") }' \
  "$ftable" >"$flog"
rm -f "$ftable"
[ "$frc" -ne 0 ] && [ "$rc" -eq 0 ] && rc=$frc
counted+=("$flog" "fuzz/out")

python3 scripts/count_tests.py "${counted[@]}"
for ((i = 0; i < ${#counted[@]}; i += 2)); do rm -f "${counted[$i]}"; done
exit "$rc"
