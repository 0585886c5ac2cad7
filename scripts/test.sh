#!/usr/bin/env bash
# Runs every test: installs the build's Debian packages, fetches the larger
# real model into the git-ignored cache (tests that need it skip without it),
# runs `bazel test //...`, and ends with one line `N passed, N failed,
# N skipped` counted over the individual test cases.
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

./scripts/install_deps.sh || exit 1
./scripts/fetch_smollm2.sh >/dev/null ||
  echo "test.sh: SmolLM2 could not be fetched; tests that need it will skip" >&2

log="$(mktemp)"
bazel test //... --test_env=INFINIGEN_ROOT="$root" --keep_going "$@" 2>&1 |
  tee "$log" | grep -vE '^(Loading|Analyzing|INFO: From|\[[0-9,]+ / [0-9,]+\])'
rc=${PIPESTATUS[0]}

python3 scripts/count_tests.py "$log" bazel-testlogs
rm -f "$log"
exit "$rc"
