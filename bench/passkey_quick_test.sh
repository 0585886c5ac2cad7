#!/usr/bin/env bash
# The pass key benchmark on stories260K, small enough for CI (the model is
# too small to find a key; what is checked is the harness): every policy
# sees the same trials, each row is scored against its own key, the table
# has every policy and context, and each policy fetches what it was asked.
set -euo pipefail
bin="$1"; model="$2"; tok="$3"
text="$(dirname "$model")/../../tests/testdata/tiny_text.txt"
out="${TEST_TMPDIR:-/tmp}/passkey"
python3 bench/passkey.py --binary="$bin" --model="$model" --tokenizer="$tok" \
  --haystack="$text" --contexts=128,256 --trials=2 --fetch=0.7 \
  --sample_chars=400 --jobs=2 --out="$out" > /dev/null 2>&1
python3 - "$out.csv" "$out.md" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
lines = {"full", "h2o @0.7", "oracle @0.7", "quest16 @0.7",
         "infinigen @0.7", "infinigen-uniform @0.7",
         "infinigen+sinks4+recent32 @0.7"}
assert {r["line"] for r in rows} == lines, {r["line"] for r in rows}
assert len(rows) == len(lines) * 2 * 2, len(rows)
# The same trials for every policy.
trials = {}
for r in rows:
    t = (r["context"], r["trial"])
    trials.setdefault(t, set()).add((r["key"], r["depth"]))
assert all(len(v) == 1 for v in trials.values()), trials
for r in rows:
    assert r["correct"] == str(int(r["answer"].startswith(r["key"]))), r
    assert 0.8 * int(r["context"]) <= int(r["prompt_tokens"]) <= int(r["context"]), r
    f = float(r["fetch_fraction_mean"])
    if r["line"] == "full":
        assert f == 1.0, r
    elif r["line"] in ("oracle @0.7", "infinigen @0.7",
                       "infinigen-uniform @0.7", "h2o @0.7"):
        assert abs(f - 0.7) < 0.05, r
md = open(sys.argv[2]).read()
for line in lines:
    assert f"| {line} |" in md, line
print("passkey: ok")
PY
