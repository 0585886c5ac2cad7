#!/usr/bin/env bash
# Runs a focused set of C++ unit tests under one sanitizer:
#   scripts/sanitizer_tests.sh asan   # AddressSanitizer + UBSan
#   scripts/sanitizer_tests.sh tsan   # ThreadSanitizer
# (configs in .bazelrc; each builds into its own output directory). Any
# sanitizer report fails its test. The set covers the memory node's store,
# data planes and client and the worker's KV caches and backend, kept small
# so that CI's cold build of each stays within a few minutes on two cores.
# TSan leaves out what runs through gRPC, whose Debian build is not
# instrumented (its own synchronization would be invisible to TSan).
# Extra arguments go to `bazel test`.
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

config="${1:-}"
shift || true
case "$config" in
  -h|--help)
    awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"
    exit 0
    ;;
  asan)
    targets=(
      //kv_memory_service/store:kv_store_test
      //common:thread_pool_test
      //kv_memory_service/store:prefix_test
      //kv_memory_service/client:kv_client_test
      //kv_memory_service/server:tls_test
      //kv_memory_service/tcp:fetch_socket_server_test
      //kv_memory_service/shm:shm_test
      //kv_memory_service/sharded:sharded_kv_client_test
      //gpu_worker:kv_cache_test
      //gpu_worker:policy_test
      //gpu_worker:backend_test
      //gpu_worker:perplexity_test
      //common:address_test
      //common:acceptor_test
    )
    ;;
  tsan)
    targets=(
      //kv_memory_service/store:kv_store_test
      //common:thread_pool_test
      //kv_memory_service/store:prefix_test
      //kv_memory_service/tcp:fetch_socket_server_test
      //kv_memory_service/shm:shm_test
      //gpu_worker:kv_cache_test
      //gpu_worker:backend_test
      //speculator:speculator_test
    )
    ;;
  *)
    echo "usage: $0 asan|tsan [bazel test args...] (see --help)" >&2
    exit 2
    ;;
esac

exec bazel test --config="$config" "${targets[@]}" \
  --test_env=INFINIGEN_ROOT="$root" --keep_going "$@"
