#!/usr/bin/env bash
# A short run of the decode path with and without the worker's row cache,
# as CI runs it: one `infinigen bench-decode` per setting of InfiniGen at
# --target_fetch=0.1 on SmolLM2-135M (ctx 1024, 16 steps, the in-process
# node), printed as a table of tokens/s, KV bytes fetched per token and the
# hit rate, with each figure's ratio against the run without the cache.
# Exits 1 when a run fails or the two runs' selections differ; nothing is
# asserted about time.
#
#   bench/row_cache_smoke.sh [INFINIGEN] [MODEL]
set -uo pipefail
cd "$(dirname "$0")/.."
bin="${1:-bazel-bin/gpu_worker/infinigen}"
model="${2:-$(scripts/fetch_smollm2.sh)}" || exit 1
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
for cache in 0 0.125; do
  "$bin" bench-decode --model="$model" \
    --ctx=1024 --decode_tokens=16 --policy=infinigen --row_cache="$cache" \
    --skew_cache_dir=none --calibration_tokens=512 --json 2>/dev/null |
    tail -1 >>"$out" || exit 1
done
python3 - "$out" <<'PY'
import json, platform, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
if len(rows) != 2:
    print(f"row cache smoke: {len(rows)} of 2 runs reported")
    sys.exit(1)
off, on = rows
print(f"row cache smoke ({platform.machine()}, infinigen, ctx 1024, "
      f"16 steps):")
print("| row cache | tokens/s | x off | KV bytes/token | x off | hit rate |")
print("|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['row_cache']:g} | {r['tokens_per_s']:.2f} | "
          f"{r['tokens_per_s'] / off['tokens_per_s']:.2f}x | "
          f"{r['bytes_fetched_per_token']:.0f} | "
          f"{r['bytes_fetched_per_token'] / off['bytes_fetched_per_token']:.2f}x"
          f" | {100 * r['row_cache_hit_rate']:.1f}% |")
sys.exit(0 if on["fetch_fraction_mean"] == off["fetch_fraction_mean"] else 1)
PY
