#!/usr/bin/env python3
"""Accuracy of every KV policy on one model and text, in one run.

Runs `infinigen perplexity --policy=... --prompt_tokens=... --json` for
ideal, full, infinigen, h2o and int4, and for the memory pool at capacities
1.0 and 0.8 with FIFO, LRU and counter eviction (InfiniGen policy), then
writes OUT.md (a Markdown table), OUT.csv and, when matplotlib is available,
OUT.png (perplexity against the fraction of KV rows fetched per step).

With --sweep=F1,F2,...: a fetch-fraction sweep instead, one line per
policy (oracle, quest, infinigen, infinigen and quest with sinks and a
recent window, h2o; full as the reference): for each target mean fetched
fraction F, oracle, quest and infinigen take --budget so that their dense
layers (whole: 0 and 1 for oracle and quest and the *-dense2 lines, none
for infinigen's default) plus the selecting layers at that budget average
F (alpha 1e9: the cap decides; quest counts pages of --page_tokens), h2o
takes --budget=F. Fractions below what a line's dense layers alone fetch
are skipped for it.
OUT_sweep.{md,csv,png}: perplexity against the fraction actually fetched.
--lines=NAME,... runs only those lines; --reuse keeps the rows of an
earlier OUT_sweep.csv (same line and target) instead of running them again,
so a new line joins an existing sweep.

Example (SmolLM2-135M, WikiText-2, ctx 2048):
  bench/accuracy.py --model=$(scripts/fetch_smollm2.sh) \
    --text=../shared/data/wiki.test.raw --ctx=2048 --windows=4 \
    --prompt_tokens=256 --skew_text=../shared/data/pride_and_prejudice.txt \
    --out=bench/results/accuracy_smollm2
"""
import argparse
import concurrent.futures
import csv
import json
import os
import platform
import subprocess
import sys
import time

import benchutil


def run(binary, args):
    cmd = [binary, "perplexity", "--json"] + args
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    if out.returncode != 0:
        sys.exit(f"accuracy.py: {' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(rows, model, ctx, out):
    """OUT.png: perplexity against the fraction of KV rows fetched."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("accuracy.py: no matplotlib; skipped the plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(100 * r["fetch_fraction_mean"], r["ppl"])
        ax.annotate(r["name"], (100 * r["fetch_fraction_mean"], r["ppl"]),
                    fontsize=7)
    ax.set_xlabel("KV rows fetched per step (%)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{os.path.basename(model)}, ctx {ctx}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)


def sweep(a, common, skew):
    """Perplexity against the fetched fraction, one line per policy."""
    targets = [float(f) for f in a.sweep.split(",")]
    reused = {}
    if a.reuse and os.path.exists(a.out + "_sweep.csv"):
        with open(a.out + "_sweep.csv") as fh:
            for r in csv.DictReader(fh):
                for k in ("ppl", "nll", "fetch_fraction_mean",
                          "fetch_fraction_max", "target", "seconds"):
                    r[k] = float(r[k])
                r["name"] = f"{r['line']} @{r['target']:g}"
                reused[(r["line"], r["target"])] = r
    wanted = set(a.lines.split(",")) if a.lines else None
    rows = []
    started = time.time()
    full = reused.get(("full", 1.0))
    if full is None:
        full = run(a.binary, common + ["--policy=full"])
        full.update(name="full", line="full", target=1.0)
    rows.append(full)
    plan = []  # (line, target, flags, reused row or None)
    for f in targets:
        lines = [("h2o", ["--policy=h2o", f"--budget={f}"])]
        # --target_fetch sets --budget with the alpha rule off; infinigen
        # then takes adaptive head budgets (the default,
        # --head_budgets=auto), the others uniform ones.
        spec = [f"--target_fetch={f}"]
        inf = ["--policy=infinigen", f"--partial_ratio={a.partial_ratio}",
               f"--skew={skew}"] + spec
        lines += [("infinigen", inf),
                  (f"infinigen+sinks{a.sinks}+recent{a.recent}",
                   inf + [f"--sink_tokens={a.sinks}",
                          f"--recent_tokens={a.recent}"]),
                  ("infinigen-uniform", inf + ["--head_budgets=uniform"]),
                  ("oracle-dense0",
                   ["--policy=oracle", "--dense_layers=0"] + spec)]
        if f > 2.0 / a.n_layers:  # what layers 0 and 1 fetch whole
            lines += [
                ("infinigen-dense2", inf + ["--dense_layers=2"]),
                ("oracle", ["--policy=oracle"] + spec),
                ("oracle-adaptive",
                 ["--policy=oracle", f"--skew={skew}",
                  "--head_budgets=adaptive"] + spec),
                (f"quest{a.page_tokens}",
                 ["--policy=quest", f"--page_tokens={a.page_tokens}"] + spec),
                (f"quest{a.page_tokens}+sinks{a.sinks}+recent{a.recent}",
                 ["--policy=quest", f"--page_tokens={a.page_tokens}",
                  f"--sink_tokens={a.sinks}", f"--recent_tokens={a.recent}"]
                 + spec),
            ]
        for line, extra in lines:
            r = reused.get((line, f))
            if r is None and wanted is not None and line not in wanted:
                continue
            plan.append((line, f, extra, r))
    # The runs not reused, --jobs at a time (one thread each when several).
    threads = ["--threads=1"] if a.jobs > 1 else []
    with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
        pending = [None if r is not None else
                   pool.submit(run, a.binary, common + extra + threads)
                   for line, f, extra, r in plan]
        for (line, f, extra, r), job in zip(plan, pending):
            if r is None:
                r = job.result()
                r.update(name=f"{line} @{f:g}", line=line, target=f)
            rows.append(r)
            print(f"{line:28s} target {100 * f:5.1f}%  ppl {r['ppl']:9.4f}  "
                  f"fetched {100 * r['fetch_fraction_mean']:6.2f}%  "
                  f"({100 * (r['ppl'] / full['ppl'] - 1):+.1f}% vs full)",
                  file=sys.stderr, flush=True)
    cmdline = benchutil.command_line()
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    out = a.out + "_sweep"
    with open(out + ".md", "w") as fh:
        fh.write(f"# Perplexity against the fetched fraction\n\nCommand: "
                 f"`{cmdline}`  \nMachine: {machine}; "
                 f"{time.time() - started:.0f} s for the runs made now "
                 f"({sum(r['seconds'] for r in rows):.0f} s of runs in "
                 f"all)  \nModel: `{a.model}`; text: "
                 f"`{a.text}`; ctx {a.ctx}, {a.windows} windows, dense prefix "
                 f"{a.prompt_tokens} tokens, then one token at a time; "
                 f"{full['tokens']} scored tokens per run. full: perplexity "
                 f"{full['ppl']:.4f}.\n\n"
                 "| target fetch | policy | perplexity | vs full | fetched "
                 "(mean) | (max) |\n|---|---|---|---|---|---|\n")
        for r in rows[1:]:
            fh.write(f"| {100 * r['target']:g}% | {r['line']} | {r['ppl']:.4f} | "
                     f"{100 * (r['ppl'] / full['ppl'] - 1):+.2f}% | "
                     f"{100 * r['fetch_fraction_mean']:.2f}% | "
                     f"{100 * r['fetch_fraction_max']:.2f}% |\n")
    with open(out + ".csv", "w", newline="") as fh:
        keys = ["line", "target", "policy", "ppl", "nll", "tokens",
                "fetch_fraction_mean", "fetch_fraction_max", "budget", "alpha",
                "partial_ratio", "ctx", "windows", "prompt_tokens", "seconds"]
        w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for line in dict.fromkeys(r["line"] for r in rows[1:]):
            pts = sorted((100 * r["fetch_fraction_mean"], r["ppl"])
                         for r in rows if r["line"] == line)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=line)
        ax.axhline(full["ppl"], color="gray", linestyle="--", label="full")
        ax.set_yscale("log")  # one policy can be orders of magnitude off
        ax.set_xlabel("KV rows fetched per step (%)")
        ax.set_ylabel("perplexity (log scale)")
        ax.set_title(f"{os.path.basename(a.model)}, ctx {a.ctx}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out + ".png", dpi=120)
    except ImportError:
        print("accuracy.py: no matplotlib; skipped the plot", file=sys.stderr)
    print(open(out + ".md").read())


def main():
    ap = benchutil.parser(__doc__.split("\n")[0])
    ap.add_argument("--binary", default="bazel-bin/gpu_worker/infinigen")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--text", required=True)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--prompt_tokens", type=int, default=256)
    ap.add_argument("--alpha", type=float, default=5.0)
    ap.add_argument("--partial_ratio", default="auto",
                    help="infinigen --partial_ratio (auto: the binary's)")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--skew_text", default="",
                    help="calibration text for the skew (default: --text)")
    ap.add_argument("--calibration_tokens", type=int, default=2048)
    ap.add_argument("--pool", action=argparse.BooleanOptionalAction,
                    default=True, help="also run the 80%% pool experiment")
    ap.add_argument("--out", help="output path without suffix (default: a new directory under ./bench_out)")
    ap.add_argument("--sweep", default="",
                    help="comma-separated target fetch fractions (see above)")
    ap.add_argument("--n_layers", type=int, default=30,
                    help="the model's layers (30 for SmolLM2-135M): sets "
                    "the budget that reaches a target fraction in --sweep")
    ap.add_argument("--sinks", type=int, default=4,
                    help="--sweep: sink tokens of the sinks+recent line")
    ap.add_argument("--recent", type=int, default=32,
                    help="--sweep: recent tokens of the sinks+recent line")
    ap.add_argument("--page_tokens", type=int, default=16,
                    help="--sweep: Quest's page size")
    ap.add_argument("--lines", default="",
                    help="--sweep: only these lines (comma-separated)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="--sweep: runs at once (each --threads=1 when > 1)")
    ap.add_argument("--reuse", action="store_true",
                    help="--sweep: keep the rows of an earlier OUT_sweep.csv")
    ap.add_argument("--plot_only", action="store_true",
                    help="only redraw OUT.png from an earlier OUT.csv")
    a = ap.parse_args()
    a.binary = benchutil.repo_path(a.binary)
    if a.out is None:
        a.out = benchutil.fresh_out("accuracy")
    if a.plot_only:
        with open(a.out + ".csv") as f:
            rows = [{**r, "ppl": float(r["ppl"]),
                     "fetch_fraction_mean": float(r["fetch_fraction_mean"])}
                    for r in csv.DictReader(f)]
        plot(rows, a.model, a.ctx, a.out)
        return

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    common = [f"--model={a.model}", f"--text={a.text}", f"--ctx={a.ctx}",
              f"--max_windows={a.windows}",
              f"--prompt_tokens={a.prompt_tokens}"]
    if a.tokenizer:
        common.append(f"--tokenizer={a.tokenizer}")
    skew = a.out + ".skew"
    cal = [a.binary, "skew", f"--model={a.model}",
           f"--text={a.skew_text or a.text}",
           f"--calibration_tokens={a.calibration_tokens}", f"--out={skew}"]
    if a.tokenizer:
        cal.append(f"--tokenizer={a.tokenizer}")
    print("+", " ".join(cal), file=sys.stderr, flush=True)
    subprocess.run(cal, check=True, stdout=subprocess.DEVNULL)

    if a.sweep:
        sweep(a, common, skew)
        return
    # The alpha rule with its cap (--target_fetch=0: not the binary's
    # default fetch target).
    inf = [f"--alpha={a.alpha}", f"--partial_ratio={a.partial_ratio}",
           f"--budget={a.budget}", f"--skew={skew}", "--target_fetch=0"]
    configs = [
        ("ideal", ["--policy=ideal"]),
        ("full", ["--policy=full"]),
        ("infinigen", ["--policy=infinigen"] + inf),
        ("h2o", ["--policy=h2o", f"--budget={a.budget}"]),
        ("int4", ["--policy=int4"]),
    ]
    if a.pool:
        for ev in ("fifo", "lru", "counter"):
            configs.append((f"infinigen pool 0.8 {ev}",
                            ["--policy=infinigen", "--kv_capacity=0.8",
                             f"--eviction={ev}"] + inf))
    rows = []
    started = time.time()
    for name, extra in configs:
        r = run(a.binary, common + extra)
        r["name"] = name
        rows.append(r)
        print(f"{name:26s} ppl {r['ppl']:9.4f}  fetched "
              f"{100 * r['fetch_fraction_mean']:6.2f}% (max "
              f"{100 * r['fetch_fraction_max']:6.2f}%)", file=sys.stderr,
              flush=True)
    full = next(r for r in rows if r["name"] == "full")

    cmdline = benchutil.command_line()
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    with open(a.out + ".md", "w") as f:
        f.write(f"# KV policy accuracy\n\nCommand: `{cmdline}`  \n"
                f"Machine: {machine}; {time.time() - started:.0f} s  \n"
                f"Model: `{a.model}`; text: `{a.text}`; ctx {a.ctx}, "
                f"{a.windows} windows, dense prefix {a.prompt_tokens} tokens, "
                f"then one token at a time through the policy; "
                f"{full['tokens']} scored tokens per policy.\n\n"
                "| policy | perplexity | vs full | KV rows fetched per step "
                "(mean) | (max) | bytes fetched per step |\n"
                "|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['name']} | {r['ppl']:.4f} | "
                    f"{100 * (r['ppl'] / full['ppl'] - 1):+.2f}% | "
                    f"{100 * r['fetch_fraction_mean']:.2f}% | "
                    f"{100 * r['fetch_fraction_max']:.2f}% | "
                    f"{r['bytes_fetched_per_step']:.0f} |\n")
    with open(a.out + ".csv", "w", newline="") as f:
        keys = ["name", "policy", "ppl", "nll", "tokens",
                "fetch_fraction_mean", "fetch_fraction_max",
                "bytes_fetched_per_step", "alpha", "partial_ratio", "budget",
                "kv_capacity", "eviction", "ctx", "windows", "prompt_tokens",
                "seconds"]
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(rows, a.model, a.ctx, a.out)
    print(open(a.out + ".md").read())


if __name__ == "__main__":
    main()
