#!/usr/bin/env bash
# The selection-overlap report on stories260K at a tiny context (the
# harness is what is checked): per layer a mean share, a histogram over
# every (layer, step) after the first that adds up, and a clear failure for
# a policy that reads every row.
set -euo pipefail
bin="$1"; model="$2"; tok="$3"
text="$(dirname "$model")/../../tests/testdata/tiny_text.txt"
out="${TEST_TMPDIR:-/tmp}/overlap"
python3 bench/selection_overlap.py --binary="$bin" --model="$model" \
  --tokenizer="$tok" --text="$text" --ctx=120 --decode_tokens=6 \
  --out="$out" > /dev/null 2>&1
python3 - "$out.json" "$out.md" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert len(r["step_layer"]) == 5, r["step_layer"]  # steps 2..6
assert len(r["layer_mean"]) == 5, r  # stories260K's layers
assert sum(r["counts"]) == 5 * 5, r["counts"]
assert all(0 <= x <= 1 for s in r["step_layer"] for x in s), r
assert max(x for s in r["step_layer"] for x in s) > 0, r
md = open(sys.argv[2]).read()
assert "| share | (layer, step) pairs |" in md and "| 4 |" in md, md
print("selection_overlap: ok")
PY
if python3 bench/selection_overlap.py --binary="$bin" --model="$model" \
    --tokenizer="$tok" --text="$text" --ctx=120 --decode_tokens=6 \
    --policy=full --out="$out.full" > /dev/null 2> "$out.err"; then
  echo "selection_overlap.py --policy=full should fail"; exit 1
fi
grep -q "reads every row" "$out.err"
