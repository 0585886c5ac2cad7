#!/usr/bin/env bash
# A short run of kv_fetch_bench, as CI runs it: the 7B-class layer (every
# row, and 10% of the rows) on the in-process, shared-memory and TCP planes,
# a prompt's append of that layer on each of those planes, a one-sided
# reader's whole sequence (open, prompt append, first read of every page,
# close) in process and over shm, and a prefill's append of a
# llama-2-7b layer into the in-process node,
# against a memcpy of the same bytes in the same run, printed as a table of
# p50 and x_memcpy. Exits 1 when a plane fails (its set-up, or rows that
# differ from the appended ones); nothing is asserted about time.
#
#   bench/kv_fetch_bench/smoke.sh [KV_FETCH_BENCH] [MIN_TIME_SECONDS]
set -uo pipefail
cd "$(dirname "$0")/../.."
bin="${1:-bazel-bin/bench/kv_fetch_bench/kv_fetch_bench}"
min_time="${2:-0.1}"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
"$bin" --planes=inproc,shm,tcp \
  --benchmark_filter='^((memcpy|memcpy_mt|inproc|shm|tcp|note_inproc|note_shm|note_leading_inproc|note_leading_shm|sequence_inproc|sequence_shm|append_inproc|append_shm|append_tcp)/7b_layer/|(memcpy|append_inproc|append_resident_inproc)/llama2_7b_layer/)' \
  --benchmark_min_time="$min_time" --benchmark_format=json >"$out" 2>/dev/null
rc=$?
python3 - "$out" "$rc" <<'PY'
import json, sys
path, rc = sys.argv[1], int(sys.argv[2])
try:
    with open(path) as f:
        report = json.load(f)
except (OSError, ValueError) as e:
    print(f"kv_fetch_bench smoke: no report ({e}), exit status {rc}")
    sys.exit(1)
ctx = report.get("context", {})
print(f"kv_fetch_bench smoke ({ctx.get('machine', '?')}): "
      "7B-class layers, p50 against single-thread memcpy")
print(f"{'case':<40} {'p50 us':>10} {'GB/s':>7} {'x_memcpy':>9}")
failed = rc != 0
for b in report.get("benchmarks", []):
    name = b["name"].removesuffix("/real_time")
    if b.get("error_occurred"):
        failed = True
        print(f"{name:<40} ERROR {b.get('error_message', '')}")
        continue
    ratio = b.get("x_memcpy")
    print(f"{name:<40} {b['p50_us']:>10.0f} {b['GB/s']:>7.2f} "
          f"{'' if ratio is None else f'{ratio:.2f}':>9}")
sys.exit(1 if failed else 0)
PY
