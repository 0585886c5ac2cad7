#!/usr/bin/env python3
"""Which of the answer's rows each policy's selection reads, per layer.

For RULER samples (bench/ruler_tasks.py, the same ones bench/ruler.py
scores), runs `infinigen generate --watch_text=ANSWERS` under each policy:
greedy, the task's max_tokens, one process per sample and policy. The
watched rows are the prompt tokens of every occurrence of each expected
string (a needle's value, the common words); per offloaded layer, the
share of them a decode step's plan selected, of those it could select,
averaged over the steps (watched_recall_per_layer). With the oracle (each
head's exact top rows by attention) as a line, the table says where a
policy's speculation misses rows the exact attention would read, and the
score beside it whether the answer suffered.

Tokens are counted (to fit each sample to its length) by one
`infinigen serve` started here with --policy=full and stopped by PID.
OUT.md: per task, the mean score and recall of each policy, then the
per-layer recall; OUT.json: every run.

Example (Gemma 3 270M at 4096 tokens, the tasks InfiniGen lost there):
  bench/needle_recall.py \\
    --model_file=models_cache/gemma3-270m/gemma-3-270m-q4_k_m.gguf \\
    --tasks=niah_multikey_3,cwe --lengths=4096 --samples=2 \\
    --policies=oracle@0.1,infinigen@0.1,infinigen@0.05 \\
    --haystack=../shared/data/pride_and_prejudice.txt \\
    --out=bench/results/needle_recall_gemma3_4k
"""
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import types

import benchutil
import ruler
import ruler_tasks

SCRIPT = "needle_recall.py"


def parse_args():
    ap = benchutil.parser(__doc__, raw=True)
    ap.add_argument("--binary", default="bazel-bin/gpu_worker/infinigen")
    ap.add_argument("--model_file", required=True)
    ap.add_argument("--tokenizer_file", default="")
    ap.add_argument("--tasks", default="niah_multikey_3,cwe",
                    help="comma-separated RULER tasks (json_kv, whose "
                    "expected pairs hold commas, is not watched)")
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--haystack",
                    default="../shared/data/pride_and_prejudice.txt",
                    help="the text of the haystacks, as bench/ruler.py's")
    ap.add_argument("--policies", default="oracle@0.1,infinigen@0.1",
                    help="POLICY@FRACTION items, as bench/ruler.py's")
    ap.add_argument("--start_timeout", type=float, default=300)
    ap.add_argument("--timeout", type=float, default=1800,
                    help="seconds one generate may take")
    ap.add_argument("--out", required=True, help="output path, no suffix")
    ap.add_argument("extra", nargs="*",
                    help="flags after -- for every generate and the serve")
    a = ap.parse_args()
    a.tasks = [t for t in a.tasks.split(",") if t]
    bad = [t for t in a.tasks if t not in ruler_tasks.TASKS or t == "json_kv"]
    if bad:
        ap.error(f"--tasks: {', '.join(bad)}: not a task this watches "
                 f"(choose from {', '.join(t for t in ruler_tasks.TASKS if t != 'json_kv')})")
    try:
        a.lengths = [int(x) for x in a.lengths.split(",") if x]
    except ValueError:
        ap.error(f"--lengths must be integers, got {a.lengths!r}")
    a.lines = []
    for item in [p for p in a.policies.split(",") if p]:
        name, _, fraction = item.partition("@")
        try:
            f = float(fraction) if fraction else None
        except ValueError:
            ap.error(f"--policies: {item!r}: the fraction is not a number")
        a.lines.append((item, name, f))
    if not a.lines:
        ap.error("--policies is empty")
    if a.samples < 1:
        ap.error("--samples must be at least 1")
    a.haystack = benchutil.repo_path(a.haystack)
    for path, what in ((a.binary, "--binary"), (a.model_file, "--model_file"),
                       (a.haystack, "--haystack")):
        if not os.path.exists(path):
            ap.error(f"{what}: {path} does not exist")
    return a


def build(a):
    """The samples, fitted by a `serve`'s /tokenize."""
    hay = ruler_tasks.Haystack.from_file(a.haystack)
    sa = types.SimpleNamespace(binary=a.binary, model_file=a.model_file,
                               tokenizer_file=a.tokenizer_file, jobs=1,
                               extra=a.extra, start_timeout=a.start_timeout)
    tmp = tempfile.mkdtemp(prefix="needle_recall_")
    server = ruler.Server(sa, "full", ["--policy=full"],
                          os.path.join(tmp, "serve.log"))
    try:
        server.start()
        ep = ruler.Endpoint(server.url + "/v1")
        ep.connect()
        samples = []
        for L in a.lengths:
            for t in a.tasks:
                for i in range(a.samples):
                    s = ruler_tasks.make_sample(t, L, i, a.seed, hay,
                                                ep.tokenize)
                    s.update(task=t, length=L, sample=i)
                    samples.append(s)
        return samples, tmp
    finally:
        server.stop()


def run_one(a, s, line, tmp):
    label, name, fraction = line
    prompt = os.path.join(tmp, "prompt.txt")
    with open(prompt, "w") as f:
        f.write(s["prompt"])
    cmd = [a.binary, "generate", f"--model={a.model_file}",
           f"--prompt_file={prompt}",
           f"--max_new_tokens={ruler_tasks.TASKS[s['task']].max_tokens}",
           "--temperature=0", "--json", f"--policy={name}",
           "--watch_text=" + ",".join(s["expected"])]
    if a.tokenizer_file:
        cmd.append(f"--tokenizer={a.tokenizer_file}")
    if fraction is not None:
        cmd.append(f"--target_fetch={fraction}")
    cmd += a.extra
    t0 = time.time()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=a.timeout, errors="replace")
    if r.returncode != 0:
        tail = r.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise ruler.Fail(f"generate under {label} exited {r.returncode}: "
                         f"{tail[0]}")
    j = json.loads(r.stdout.strip().splitlines()[-1])
    return {
        "task": s["task"], "length": s["length"], "sample": s["sample"],
        "line": label, "expected": s["expected"],
        "score": ruler_tasks.score(s["task"], j["text"], s["expected"]),
        "watched_tokens": j["watched_tokens"],
        "recall": j["watched_recall"],
        "recall_per_layer": j["watched_recall_per_layer"],
        "seconds": round(time.time() - t0, 1), "text": j["text"],
    }


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def fmt(x, scale=100):
    return "—" if x is None else f"{scale * x:.1f}"


def write(a, rows, seconds):
    with open(a.out + ".json", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    labels = [l[0] for l in a.lines]
    out = ["# Which of the answer's rows each policy reads", "",
           "Command: `bench/needle_recall.py " + " ".join(sys.argv[1:]) + "`  ",
           f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
           f"{platform.system()}; {seconds:.0f} s", "",
           "Watched rows: the prompt tokens of every occurrence of each "
           "expected string. Recall: the share of them (over the KV heads) "
           "a decode step's plan selected, of those it could select, over "
           "the steps; x100. Score: RULER's, x100. Means over "
           f"{a.samples} sample(s) a task.", ""]
    for L in a.lengths:
        out += [f"## Length {L}", "",
                "| task | watched tokens | " + " | ".join(
                    f"{l} score | {l} recall" for l in labels) + " |",
                "|---|---|" + "---|---|" * len(labels)]
        for t in a.tasks:
            mine = [r for r in rows if r["task"] == t and r["length"] == L]
            cells = []
            for l in labels:
                rs = [r for r in mine if r["line"] == l]
                cells += [fmt(mean([r["score"] for r in rs])),
                          fmt(mean([r["recall"] for r in rs]))]
            watched = mean([r["watched_tokens"] for r in mine])
            out.append(f"| {t} | {watched:.0f} | " + " | ".join(cells) + " |")
        out.append("")
        for t in a.tasks:
            mine = [r for r in rows if r["task"] == t and r["length"] == L]
            n_layers = max((len(r["recall_per_layer"]) for r in mine),
                           default=0)
            out += [f"### {t}: recall per offloaded layer", "",
                    "| layer | " + " | ".join(labels) + " |",
                    "|---|" + "---|" * len(labels)]
            for layer in range(n_layers):
                cells = []
                for l in labels:
                    vals = [r["recall_per_layer"][layer] for r in mine
                            if r["line"] == l and
                            layer < len(r["recall_per_layer"])]
                    cells.append(fmt(mean(vals)))
                out.append(f"| {layer} | " + " | ".join(cells) + " |")
            out.append("")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(out))


def main():
    a = parse_args()
    t0 = time.time()
    try:
        samples, tmp = build(a)
    except (ruler.Fail, ruler_tasks.TaskError) as e:
        print(f"{SCRIPT}: {e}", file=sys.stderr)
        return 1
    rows, total, k = [], len(samples) * len(a.lines), 0
    try:
        for s in samples:
            for line in a.lines:
                k += 1
                r = run_one(a, s, line, tmp)
                rows.append(r)
                print(f"[{k}/{total}] {r['line']} {r['task']} L{r['length']} "
                      f"#{r['sample']}: score {r['score']:.2f}, recall "
                      f"{fmt(r['recall'])} of {r['watched_tokens']} tokens "
                      f"({r['seconds']} s)", file=sys.stderr, flush=True)
    except (ruler.Fail, subprocess.TimeoutExpired) as e:
        print(f"{SCRIPT}: {e}", file=sys.stderr)
        return 1
    finally:
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    write(a, rows, time.time() - t0)
    print(f"{SCRIPT}: wrote {a.out}.md and {a.out}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
