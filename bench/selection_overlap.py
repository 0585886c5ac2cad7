#!/usr/bin/env python3
"""How much of a decode step's selection the previous step selected too.

Runs one `infinigen bench-decode` of a selecting policy with its row cache
on (which watches each layer's selections), then writes OUT.md: per layer,
the mean share of a step's selected rows that the layer's previous step
selected as well, and a histogram of that share over every (layer, step)
from the second step on; OUT.json holds the figures and, when matplotlib is
available, OUT.png draws the histogram.

Example (SmolLM2-135M):
  bench/selection_overlap.py --model=$(scripts/fetch_smollm2.sh) \\
    --text=../shared/data/pride_and_prejudice.txt --ctx=8000 \\
    --skew=models_cache/smollm2-135m/smollm2.skew \\
    --out=bench/results/selection_overlap_smollm2
"""
import json
import os
import platform
import subprocess
import sys
import time

import benchutil

BINS = [0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]


def histogram(values):
    """Counts per bin [BINS[i], BINS[i + 1]), the last one closed."""
    counts = [0] * (len(BINS) - 1)
    for v in values:
        for i in range(len(BINS) - 1):
            if v < BINS[i + 1] or i == len(BINS) - 2:
                counts[i] += 1
                break
    return counts


def plot(overlap, out, title):
    plt = benchutil.pyplot("selection_overlap.py")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist([x for step in overlap for x in step], bins=20, range=(0, 1))
    ax.set_xlabel("share of a step's selection also selected at the step "
                  "before")
    ax.set_ylabel("(layer, step) pairs")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)


def main():
    ap = benchutil.parser(__doc__.split("\n")[0])
    ap.add_argument("--binary", default="bazel-bin/gpu_worker/infinigen")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--text", default="")
    ap.add_argument("--ctx", type=int, default=8000)
    ap.add_argument("--decode_tokens", type=int, default=32)
    ap.add_argument("--policy", default="infinigen")
    ap.add_argument("--skew", default="")
    ap.add_argument("--extra", default="",
                    help="more flags for bench-decode, space-separated")
    ap.add_argument("--out", help="output path without suffix (default: a "
                    "new directory under ./bench_out)")
    a = ap.parse_args()
    a.binary = benchutil.repo_path(a.binary)
    if a.out is None:
        a.out = benchutil.fresh_out("overlap")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    cmd = [a.binary, "bench-decode", f"--model={a.model}", f"--ctx={a.ctx}",
           f"--decode_tokens={a.decode_tokens}", f"--policy={a.policy}",
           "--row_cache=1", "--json"]
    if a.tokenizer:
        cmd.append(f"--tokenizer={a.tokenizer}")
    if a.text:
        cmd.append(f"--text={a.text}")
    if a.skew:
        cmd.append(f"--skew={a.skew}")
    cmd += a.extra.split()
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    started = time.time()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    if r.returncode != 0:
        sys.exit(f"selection_overlap.py: bench-decode failed:\n"
                 f"{r.stderr[-2000:]}")
    row = json.loads([l for l in r.stdout.splitlines()
                      if l.startswith("{")][-1])
    overlap = row["selection_overlap_step_layer"]
    if not overlap:
        sys.exit(f"selection_overlap.py: {a.policy} reported no selections "
                 "(a policy that reads every row, or a device backend)")
    n_layers = len(overlap[0])
    means = [sum(step[l] for step in overlap) / len(overlap)
             for l in range(n_layers)]
    flat = [x for step in overlap for x in step]
    counts = histogram(flat)
    with open(a.out + ".json", "w") as f:
        json.dump({"command": cmd, "layer_mean": means, "bins": BINS,
                   "counts": counts, "step_layer": overlap,
                   "fetch_fraction_mean": row["fetch_fraction_mean"]}, f)
    name = os.path.basename(a.model)
    with open(a.out + ".md", "w") as f:
        f.write(f"# Overlap of consecutive steps' selections: {a.policy}, "
                f"{name}, context {a.ctx}\n\n"
                f"Command: `{benchutil.command_line()}` "
                f"({time.time() - started:.0f} s)  \n"
                f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
                f"CPU backend  \n"
                f"{row['fetch_fraction_mean'] * 100:.1f}% of the cached rows "
                f"selected per step; {len(overlap)} steps after the first, "
                f"{n_layers} layers. The share is of each step's selected "
                f"rows (every KV head of the layer) that the layer's "
                f"previous step selected too: what a worker that kept the "
                f"last step's rows would not fetch again.\n\n"
                f"Mean over all: {sum(flat) / len(flat):.3f}; lowest layer "
                f"mean: {min(means):.3f} (layer {means.index(min(means))})."
                f"\n\n| share | (layer, step) pairs |\n|---|---|\n")
        for i, c in enumerate(counts):
            hi = "]" if i == len(counts) - 1 else ")"
            f.write(f"| [{BINS[i]:.2f}, {BINS[i + 1]:.2f}{hi} | {c} |\n")
        f.write("\n| layer | mean share |\n|---|---|\n")
        for l, m in enumerate(means):
            f.write(f"| {l} | {m:.3f} |\n")
    plot(overlap, a.out, f"{a.policy}, {name}, ctx {a.ctx}")
    print(open(a.out + ".md").read())


if __name__ == "__main__":
    main()
