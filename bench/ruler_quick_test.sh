#!/usr/bin/env bash
# The RULER-style suite on stories260K, small enough for CI (the model is
# too small to answer; what is checked is the harness): the scorers on
# known answers, then every task at two lengths through two servers it
# starts (full and infinigen at half the rows): every task, length and line
# has its rows, every line saw the same samples, each prompt fills its
# length, each score is its output's, the report has every row and the
# JSON lines every sample; an earlier run's rows join a report; bad input
# is one line and a non-zero exit.
set -euo pipefail
bin="$1"; model="$2"; tok="$3"
text="$(dirname "$model")/../../tests/testdata/tiny_text.txt"
dir="${TEST_TMPDIR:-$(mktemp -d)}"
out="$dir/ruler"

python3 bench/ruler_tasks.py --self_test

# stories260K's context is 512 tokens, less than some tasks' shortest
# prompt under its 512-token vocabulary: the servers hold 1280.
# The haystack is named every time: a clone has no ../shared.
serve=(--binary="$bin" --model_file="$model" --tokenizer_file="$tok"
       --haystack="$text")
python3 bench/ruler.py "${serve[@]}" --policies=full,infinigen@0.5 \
  --lengths=896,1280 --samples=2 --jobs=2 --json \
  --out="$out" -- --threads=1 --max_seq_len=1280 \
  > "$out.stdout" 2> "$out.stderr"
python3 - "$out" <<'PY'
import csv, json, re, sys
sys.path.insert(0, "bench")
import ruler_tasks
out = sys.argv[1]
rows = list(csv.DictReader(open(out + ".csv")))
tasks, lengths, lines = list(ruler_tasks.TASKS), (896, 1280), ("full", "infinigen@0.5")
keys = {(r["task"], int(r["length"]), r["line"], int(r["sample"])) for r in rows}
assert len(rows) == len(keys) == len(tasks) * 2 * 2 * 2, len(rows)
assert keys == {(t, L, l, i) for t in tasks for L in lengths for l in lines
                for i in (0, 1)}, keys
samples = {}
for r in rows:
    t, L = r["task"], int(r["length"])
    samples.setdefault((t, L, r["sample"]), set()).add(
        (r["prompt_sha1"], r["expected"]))
    budget = L - ruler_tasks.TASKS[t].max_tokens
    # The server counts what the harness counted, within the length and
    # near it.
    assert r["prompt_tokens"] == r["counted_tokens"], r
    assert 0.9 * budget <= int(r["prompt_tokens"]) <= budget, r
    s = ruler_tasks.score(t, r["output"], json.loads(r["expected"]))
    assert abs(s - float(r["score"])) < 1e-6, r
    assert float(r["seconds"]) >= float(r["ttft_seconds"]) > 0, r
# The same samples for every line, and two different ones per task.
assert all(len(v) == 1 for v in samples.values()), samples
for t in tasks:
    for L in lengths:
        assert samples[(t, L, "0")] != samples[(t, L, "1")], (t, L)
md = open(out + ".md").read()
assert md.startswith("# RULER-style long-context accuracy\n\nCommand: `")
for L in lengths:
    assert f"## Length {L} (" in md, L
    assert f"| {L} | full |" in md and f"| {L} | infinigen@0.5 |" in md
for t in tasks:
    assert len(re.findall(rf"^\| {t}( \*)? \| ", md, re.M)) == 2, t
for l in lines:
    assert f"| {l} | " in md and f"`{l}`: `infinigen serve " in md, l
got = [json.loads(l) for l in open(out + ".stdout")]
assert len(got) == len(rows), len(got)
assert {(g["task"], g["length"], g["line"], g["sample"]) for g in got} == {
    (t, L, l, i) for t, L, l, i in keys}
print("ruler: rows, samples, lengths, scores and report ok")
PY
grep -q "ETA" "$out.stderr"

# An earlier run's rows in a new report, nothing run.
python3 bench/ruler.py --add="$out.csv" --out="$out-added" > /dev/null
grep -q "## Length 1280 (" "$out-added.md"
[ "$(grep -c "^| niah_single_1 " "$out-added.md")" = 2 ]

fails() {  # the command must fail with one line on stderr naming $1
  if python3 bench/ruler.py "${@:2}" > /dev/null 2> "$dir/err"; then
    echo "accepted: ${*:2}"; exit 1
  fi
  [ "$(wc -l < "$dir/err")" = 1 ] || { cat "$dir/err"; exit 1; }
  grep -q -- "$1" "$dir/err" || { cat "$dir/err"; exit 1; }
}
fails "no policy nosuch" "${serve[@]}" --policies=full,nosuch@0.5
fails "the fraction must be in" "${serve[@]}" --policies=h2o@2
fails "no file" "${serve[@]}" --haystack="$dir/none.txt" --out="$out-x"
fails "cannot reach" --base_url=http://127.0.0.1:1/v1 --haystack="$text" \
  --out="$out-x"
fails "past the model's context" "${serve[@]}" --policies=full \
  --lengths=4096 --out="$out-x"
head -c 600 "$text" > "$dir/short.txt"
fails "more text than the haystack" "${serve[@]}" --policies=full \
  --tasks=niah_single_2 --lengths=1024 --haystack="$dir/short.txt" \
  --out="$out-x" -- --max_seq_len=1024
echo "ruler errors: ok"
