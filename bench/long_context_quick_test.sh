#!/usr/bin/env bash
# The long-context sweep on stories260K at tiny contexts (the harness is
# what is checked): one run per text, context and line, each policy at the
# fraction asked, full as the reference of every table; --reuse runs
# nothing that OUT.jsonl holds; bad --runs is one line.
set -euo pipefail
bin="$1"; model="$2"; tok="$3"
text="$(dirname "$model")/../../tests/testdata/tiny_text.txt"
out="${TEST_TMPDIR:-/tmp}/long_context"
runs=full,infinigen@0.5,oracle@0.5,quest@0.5,h2o@0.5
python3 bench/long_context.py --binary="$bin" --model="$model" \
  --texts="$text" --contexts=96,160 --scored=32 --runs=$runs \
  --out="$out" -- --tokenizer="$tok" > /dev/null 2>&1
python3 - "$out.jsonl" "$out.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert len(rows) == 2 * 5, len(rows)
assert {(r["ctx"], r["policy"]) for r in rows} == {
    (c, p) for c in (96, 160)
    for p in ("full", "infinigen", "oracle", "quest", "h2o")}, rows
for r in rows:
    assert r["tokens"] == 32 and r["prompt_tokens"] == r["ctx"] - 32, r
    if r["policy"] == "full":
        assert r["target_fetch"] is None and r["fetch_fraction_mean"] == 1.0
    else:
        assert r["target_fetch"] == 0.5, r
        assert abs(r["fetch_fraction_mean"] - 0.5) < 0.1, r
md = open(sys.argv[2]).read()
for c in (96, 160):
    assert f"tiny_text.txt, ctx {c}" in md, md
assert md.count("| full | — |") == 2 and md.count("+0.0%") >= 2, md
print("long_context: ok")
PY
before=$(md5sum < "$out.jsonl")
python3 bench/long_context.py --binary=/nonexistent --model="$model" \
  --texts="$text" --contexts=96,160 --scored=32 --runs=$runs --reuse \
  --out="$out" > /dev/null
[ "$(md5sum < "$out.jsonl")" = "$before" ]
# --report_only: the table of what is there, a line not run marked so.
python3 bench/long_context.py --binary=/nonexistent --model="$model" \
  --texts="$text" --contexts=96,160 --scored=32 --runs=$runs,h2o@0.25 \
  --report_only --out="$out" > /dev/null
[ "$(md5sum < "$out.jsonl")" = "$before" ]
[ "$(grep -c '| h2o | 0.25 | not run |' "$out.md")" = 2 ]
if python3 bench/long_context.py --model="$model" --texts="$text" \
    --runs=full,h2o@2 --out="$out" 2> "$out.err"; then
  echo "bad --runs accepted"; exit 1
fi
grep -q "the fraction must be in (0, 1\]" "$out.err"
echo "long_context reuse and errors: ok"
