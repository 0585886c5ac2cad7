#!/usr/bin/env python3
"""Long-context retrieval: a pass key planted in a long text, asked at the end.

Each trial takes a stretch of --haystack (about --contexts tokens), plants
"The pass key is NNNNN. Remember it. NNNNN is the pass key." at a random
depth, and ends with "What is the pass key? The pass key is"; the model
decodes greedily through the KV policy and the trial counts when the key's
digits come first in the answer (exact match). Every policy sees the same
trials (keys, depths and stretches come from --seed), at the same target
fetched fraction (--fetch, through `infinigen generate --target_fetch`);
`full` fetches every row and is the reference. The prompt is prefilled
densely, so what is measured is whether each policy fetches the planted
rows when the answer is decoded.

Writes OUT.md (accuracy per context and policy, with the mean fetched
fraction), OUT.csv (one row per trial) and, with matplotlib, OUT.png.

Example (SmolLM2-135M, Pride and Prejudice as the haystack):
  bench/passkey.py --model=$(scripts/fetch_smollm2.sh) \
    --haystack=../shared/data/pride_and_prejudice.txt \
    --skew=bench/results/accuracy_smollm2.skew --contexts=1024,2048 \
    --trials=20 --fetch=0.1 --out=bench/results/passkey_smollm2
"""
import argparse
import concurrent.futures
import csv
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time

import benchutil

QUESTION = "\n\nWhat is the pass key? The pass key is"
INTRO = "There is a pass key hidden in this text. Find it and remember it.\n\n"


def policies(a):
    """(line, flags) for every compared policy at fraction f."""
    lines = [("full", ["--policy=full"])]
    for f in [float(x) for x in a.fetch.split(",")]:
        t = [f"--target_fetch={f}"]
        inf = ["--policy=infinigen", f"--partial_ratio={a.partial_ratio}"]
        if a.skew:
            inf.append(f"--skew={a.skew}")
        lines += [
            (f"h2o @{f:g}", ["--policy=h2o"] + t),
            (f"oracle @{f:g}", ["--policy=oracle"] + t),
            (f"quest{a.page_tokens} @{f:g}",
             ["--policy=quest", f"--page_tokens={a.page_tokens}"] + t),
            (f"infinigen @{f:g}", inf + t),
            (f"infinigen-uniform @{f:g}",
             inf + t + ["--head_budgets=uniform"]),
            (f"infinigen+sinks{a.sinks}+recent{a.recent} @{f:g}",
             inf + t + [f"--sink_tokens={a.sinks}",
                        f"--recent_tokens={a.recent}"]),
        ]
    wanted = set(a.lines.split(",")) if a.lines else None
    return [l for l in lines
            if wanted is None or l[0].split(" @")[0] in wanted]


def generate(a, prompt, flags, max_new, too_long_ok=False):
    """The JSON line of `infinigen generate`; with too_long_ok, None for a
    prompt longer than the model's context."""
    # The prompt goes in a file: a 32K-token one is longer than one command
    # line argument may be.
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="passkey_",
                                     delete=False) as fh:
        fh.write(prompt)
    cmd = [a.binary, "generate", f"--model={a.model}", "--temperature=0",
           f"--max_new_tokens={max_new}", "--json", "--threads=1",
           f"--backend={a.backend}", f"--prompt_file={fh.name}"] + flags
    if a.tokenizer:
        cmd.append(f"--tokenizer={a.tokenizer}")
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    finally:
        os.remove(fh.name)
    if out.returncode != 0:
        if too_long_ok and "the context holds" in out.stderr:
            return None
        shown = [c if len(c) < 200 else c[:60] + "...'" for c in cmd]
        sys.exit(f"passkey.py: {' '.join(shown)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def trials(a, text, chars_per_token):
    """The same trials for every policy: (context, trial, key, depth, the
    stretch of text the key goes in)."""
    rng = random.Random(a.seed)
    made = []
    for ctx in [int(c) for c in a.contexts.split(",")]:
        # Room for the intro, the needle, the question and the answer.
        fixed = len(INTRO) + len(QUESTION) + 64
        chars = int((ctx - a.max_new_tokens) * chars_per_token) - fixed
        if chars >= len(text):
            sys.exit(f"passkey.py: --haystack has {len(text)} characters; "
                     f"context {ctx} needs about {chars}")
        for i in range(a.trials):
            start = rng.randrange(len(text) - chars)
            hay = text[start:start + chars]
            key = rng.randrange(10000, 100000)
            depth = rng.random()
            made.append((ctx, i, key, depth, hay))
    return made


def plant(hay, key, depth):
    """The prompt: the needle in `hay` at `depth`, between words."""
    cut = int(len(hay) * depth)
    space = hay.rfind(" ", 0, cut)
    cut = space + 1 if space > 0 else cut
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    return INTRO + hay[:cut] + needle + hay[cut:] + QUESTION


def main():
    ap = benchutil.parser(__doc__.split("\n")[0])
    ap.add_argument("--binary", default="bazel-bin/gpu_worker/infinigen")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--haystack", required=True, help="text to hide keys in")
    ap.add_argument("--contexts", default="1024,2048",
                    help="comma-separated prompt lengths in tokens")
    ap.add_argument("--trials", type=int, default=20,
                    help="trials per context")
    ap.add_argument("--fetch", default="0.1",
                    help="comma-separated target fetched fractions")
    ap.add_argument("--skew", default="",
                    help="infinigen's skew file (default: the binary's own "
                    "calibration, on the text it carries)")
    ap.add_argument("--partial_ratio", default="auto",
                    help="infinigen --partial_ratio (auto: the binary's)")
    ap.add_argument("--page_tokens", type=int, default=16)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--recent", type=int, default=32)
    ap.add_argument("--lines", default="",
                    help="only these policies (full, h2o, oracle, questN, "
                    "infinigen, infinigen-uniform, infinigen+sinksN+recentN), "
                    "comma-separated")
    ap.add_argument("--max_new_tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sample_chars", type=int, default=4000,
                    help="characters of the haystack that measure its "
                    "characters per token (fewer than the model's context)")
    ap.add_argument("--backend", default="cpu",
                    help="the engine's backend (cpu, cuda, auto)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="generate processes at once (one thread each)")
    ap.add_argument("--out", help="output path without suffix (default: a new directory under ./bench_out)")
    a = ap.parse_args()
    a.binary = benchutil.repo_path(a.binary)
    if a.out is None:
        a.out = benchutil.fresh_out("passkey")
    if a.trials < 1:
        sys.exit("passkey.py: --trials must be >= 1")

    with open(a.haystack, encoding="utf-8", errors="replace") as f:
        text = re.sub(r"\s+", " ", f.read())
    # Characters per token of this text under the model's tokenizer.
    sample = text[:a.sample_chars]
    n = generate(a, sample, [], 1)["prompt_tokens"]
    chars_per_token = len(sample) / n
    made = trials(a, text, chars_per_token)
    lines = policies(a)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)

    started = time.time()
    jobs = [(line, flags, t) for line, flags in lines for t in made]
    rows = []

    def one(job):
        line, flags, (ctx, i, key, depth, hay) = job
        # A stretch denser in tokens than the sample may not fit the
        # model's context: 5% less of it, the key at the same depth (the
        # same for every policy, which all see the same stretch).
        for attempt in range(5):
            j = generate(a, plant(hay, key, depth), flags, a.max_new_tokens,
                         too_long_ok=attempt < 4)
            if j is not None:
                break
            hay = hay[:int(len(hay) * 0.95)]
        answer = j["text"].strip()
        return {"context": ctx, "line": line, "trial": i, "key": key,
                "depth": round(depth, 4), "prompt_tokens": j["prompt_tokens"],
                "correct": int(answer.startswith(str(key))),
                "fetch_fraction_mean": j["fetch_fraction_mean"],
                "answer": answer}

    with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
        for k, r in enumerate(pool.map(one, jobs), 1):
            rows.append(r)
            print(f"[{k}/{len(jobs)}] ctx {r['context']} {r['line']:30s} "
                  f"trial {r['trial']:3d} key {r['key']} at "
                  f"{100 * r['depth']:3.0f}%: "
                  f"{'ok   ' if r['correct'] else 'wrong'} {r['answer']!r}",
                  file=sys.stderr, flush=True)

    contexts = list(dict.fromkeys(r["context"] for r in rows))
    summary = {}
    for r in rows:
        s = summary.setdefault((r["line"], r["context"]),
                               {"n": 0, "ok": 0, "fetch": 0.0, "tokens": 0})
        s["n"] += 1
        s["ok"] += r["correct"]
        s["fetch"] += r["fetch_fraction_mean"]
        s["tokens"] += r["prompt_tokens"]

    cmdline = benchutil.command_line()
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    with open(a.out + ".md", "w") as fh:
        fh.write(f"# Pass key retrieval\n\nCommand: `{cmdline}`  \n"
                 f"Machine: {machine}; {time.time() - started:.0f} s  \n"
                 f"Model: `{a.model}`; haystack: `{a.haystack}`; {a.trials} "
                 f"trials per context (seed {a.seed}), greedy, exact match "
                 "of the key's five digits at the start of the answer.\n\n"
                 "Accuracy (correct / trials), and in brackets the mean "
                 "fraction of cached KV rows fetched per decode step.\n\n")
        fh.write("| policy | " + " | ".join(
            f"ctx {c} (~{summary[(lines[0][0], c)]['tokens'] // summary[(lines[0][0], c)]['n']} tok)"
            if (lines[0][0], c) in summary else f"ctx {c}"
            for c in contexts) + " |\n")
        fh.write("|---" * (len(contexts) + 1) + "|\n")
        for line, _ in lines:
            cells = []
            for c in contexts:
                s = summary[(line, c)]
                cells.append(f"{s['ok']}/{s['n']} "
                             f"({100 * s['fetch'] / s['n']:.1f}%)")
            fh.write(f"| {line} | " + " | ".join(cells) + " |\n")
    with open(a.out + ".csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(sorted(rows, key=lambda r: (r["context"], r["line"],
                                                r["trial"])))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for line, _ in lines:
            ax.plot(contexts,
                    [summary[(line, c)]["ok"] / summary[(line, c)]["n"]
                     for c in contexts], marker="o", label=line)
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts)
        ax.set_xticklabels([str(c) for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("pass key accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(os.path.basename(a.model), fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.out + ".png", dpi=120)
    except ImportError:
        print("passkey.py: no matplotlib; skipped the plot", file=sys.stderr)
    print(open(a.out + ".md").read())


if __name__ == "__main__":
    main()
