#!/usr/bin/env bash
# The accuracy sweep on stories260K, small enough for CI: every policy runs,
# the table has a row for each, and the ordering the paper reports holds on
# the extremes (full fetches everything, ideal nothing).
set -euo pipefail
bin="$1"; model="$2"; tok="$3"
text="$(dirname "$model")/../../tests/testdata/tiny_text.txt"
out="${TEST_TMPDIR:-/tmp}/acc"
python3 bench/accuracy.py --binary="$bin" --model="$model" --tokenizer="$tok" \
  --text="$text" --ctx=256 --windows=1 --prompt_tokens=32 --out="$out" \
  --calibration_tokens=200 > /dev/null
python3 - "$out.csv" <<'PY'
import csv, sys
rows = {r["name"]: r for r in csv.DictReader(open(sys.argv[1]))}
want = ["ideal", "full", "infinigen", "h2o", "int4",
        "infinigen pool 0.8 fifo", "infinigen pool 0.8 lru",
        "infinigen pool 0.8 counter"]
missing = [w for w in want if w not in rows]
assert not missing, f"missing rows: {missing}"
assert float(rows["full"]["fetch_fraction_mean"]) == 1.0
assert float(rows["ideal"]["fetch_fraction_mean"]) == 0.0
assert float(rows["h2o"]["fetch_fraction_max"]) <= 0.2 + 0.02
inf = float(rows["infinigen"]["fetch_fraction_mean"])
assert 0 < inf < 1, inf
ppl_full, ppl_ideal = float(rows["full"]["ppl"]), float(rows["ideal"]["ppl"])
assert abs(ppl_full / ppl_ideal - 1) < 0.01, (ppl_full, ppl_ideal)
print("accuracy table: ok")
PY

# The sweep (stories260K has 5 layers): two lines, then a third joining them
# with --reuse, which keeps the first run's rows as they were.
sweep=(python3 bench/accuracy.py --binary="$bin" --model="$model"
       --tokenizer="$tok" --text="$text" --ctx=256 --windows=1
       --prompt_tokens=32 --out="$out" --calibration_tokens=200
       --n_layers=5 --sweep=0.6)
"${sweep[@]}" --lines=h2o,oracle > /dev/null 2>&1
cp "${out}_sweep.csv" "${out}_first.csv"
"${sweep[@]}" --lines=quest16 --reuse > /dev/null 2>&1
python3 - "${out}_first.csv" "${out}_sweep.csv" <<'PY'
import csv, sys
first = {r["line"]: r for r in csv.DictReader(open(sys.argv[1]))}
both = {r["line"]: r for r in csv.DictReader(open(sys.argv[2]))}
assert set(first) == {"full", "h2o", "oracle"}, set(first)
assert set(both) == {"full", "h2o", "oracle", "quest16"}, set(both)
for line in first:
    assert first[line] == both[line], (line, first[line], both[line])
q = float(both["quest16"]["fetch_fraction_mean"])
assert 0.4 < q <= 0.6 + 0.05, q  # layers 0 and 1 whole, then pages
print("accuracy sweep: ok")
PY
