#!/usr/bin/env bash
# bench/needle_recall.py on stories260K, small enough for CI: one sample of
# a single-needle task under full and the oracle at half the rows; full
# reads every watched row on every layer, the oracle no more, each score
# is RULER's of its output, the report has every table; bad input is one
# line and a non-zero exit.
set -euo pipefail
bin="$1"; model="$2"; tok="$3"
text="$(dirname "$model")/../../tests/testdata/tiny_text.txt"
dir="${TEST_TMPDIR:-$(mktemp -d)}"
out="$dir/recall"

python3 bench/needle_recall.py --binary="$bin" --model_file="$model" \
  --tokenizer_file="$tok" --haystack="$text" --tasks=niah_single_1 \
  --lengths=896 --samples=1 --policies=full,oracle@0.5 --out="$out" \
  -- --threads=1 --max_seq_len=1280 2> "$out.stderr"
python3 - "$out" <<'PY'
import json, sys
sys.path.insert(0, "bench")
import ruler_tasks
out = sys.argv[1]
rows = [json.loads(l) for l in open(out + ".json")]
assert [r["line"] for r in rows] == ["full", "oracle@0.5"], rows
full, oracle = rows
assert full["watched_tokens"] == oracle["watched_tokens"] > 0, rows
assert full["recall"] == 1.0, full
assert full["recall_per_layer"] and all(
    x == 1.0 for x in full["recall_per_layer"]), full
assert 0.0 <= oracle["recall"] <= 1.0, oracle
assert len(oracle["recall_per_layer"]) == len(full["recall_per_layer"])
for r in rows:
    assert r["score"] == ruler_tasks.score(r["task"], r["text"],
                                           r["expected"]), r
md = open(out + ".md").read()
assert md.startswith("# Which of the answer's rows each policy reads\n"), md
assert "| niah_single_1 | %d | 100.0 |" % full["watched_tokens"] in md or \
    "| niah_single_1 | %d | 0.0 | 100.0 |" % full["watched_tokens"] in md, md
assert "### niah_single_1: recall per offloaded layer" in md, md
PY
# Bad input: one line and exit 2; nothing written.
if python3 bench/needle_recall.py --binary="$bin" --model_file="$model" \
    --tasks=json_kv --out="$dir/bad" 2> "$dir/bad.err"; then
  echo "json_kv was accepted" >&2; exit 1
fi
grep -q "not a task this watches" "$dir/bad.err"
test ! -e "$dir/bad.md"
echo "needle_recall quick test passed"
