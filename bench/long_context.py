#!/usr/bin/env python3
"""Perplexity at long context for every KV policy at equal fetch, per text.

For each --texts file and each --contexts length C, runs
`infinigen perplexity --ctx=C --max_windows=1 --prompt_tokens=C-SCORED
--policy=P [--target_fetch=F] --json`: the text's first window of C tokens,
its first C-SCORED tokens prefilled, its last SCORED tokens teacher-forced
through the policy's decode path (what each policy fetched is what decoding
read). --runs lists the lines as POLICY or POLICY@FRACTION (full as the
reference). Each run's JSON line goes to OUT.jsonl as it finishes, with
"text", "ctx", "policy" and "target_fetch"; --reuse keeps the runs an
earlier OUT.jsonl already holds (same text, ctx, policy and fraction), so
an interrupted sweep goes on where it stopped; --report_only runs nothing
and writes the report of what OUT.jsonl holds.

Writes OUT.md (a table per text and context: perplexity, its change against
full, the mean fraction fetched) and, where matplotlib is, OUT.png (the
change against full by fraction fetched, a panel per context).

Example (Gemma 3 270M, 8K and 32K tokens of two novels):
  bench/long_context.py --model=$(scripts/fetch_gemma3.sh) \\
    --texts=../shared/data/moby-dick.txt,../shared/data/pride_and_prejudice.txt \\
    --contexts=8192,32768 --out=bench/results/gemma3_long_context
"""
import json
import os
import platform
import subprocess
import sys
import time

import benchutil

DEFAULT_RUNS = ("full,infinigen@0.1,oracle@0.1,quest@0.1,h2o@0.1,"
                "infinigen@0.05,oracle@0.05,quest@0.05,h2o@0.05")


def key(text, ctx, policy, target):
    return (os.path.basename(text), int(ctx), policy,
            None if target is None else float(target))


def run_one(a, text, ctx, policy, target):
    cmd = [a.binary, "perplexity", f"--model={a.model}", f"--text={text}",
           f"--ctx={ctx}", "--max_windows=1",
           f"--prompt_tokens={ctx - a.scored}", "--json"]
    cmd += benchutil.policy_flags(policy, target) + a.extra
    started = time.time()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    if out.returncode != 0:
        sys.exit(f"long_context.py: {' '.join(cmd)} failed:\n"
                 f"{out.stderr[-2000:]}")
    j = json.loads(out.stdout.strip().splitlines()[-1])
    j.update({"text": os.path.basename(text), "ctx": ctx, "policy": policy,
              "target_fetch": target,
              "wall_seconds": round(time.time() - started, 1)})
    return j


def write_report(a, rows, texts, contexts, runs):
    by = {key(r["text"], r["ctx"], r["policy"], r["target_fetch"]): r
          for r in rows}
    cmdline = benchutil.command_line()
    with open(a.out + ".md", "w") as fh:
        fh.write("# Perplexity at long context by KV policy\n\n"
                 f"Command: `{cmdline}`  \n"
                 f"Each run: `infinigen perplexity --model=MODEL --text=TEXT "
                 f"--ctx=C --max_windows=1 --prompt_tokens=C-{a.scored} "
                 "--policy=P [--target_fetch=F] --json`"
                 + (" (its JSON line in OUT.jsonl)  \n" if not a.report_only
                    else "; this report was written from the JSON lines in "
                    f"`{os.path.basename(a.out)}.jsonl`  \n")
                 + f"Machine: {platform.machine()}, {os.cpu_count()} cores  \n"
                 f"Model: `{os.path.basename(a.model)}`. One window per text "
                 f"and context: its first ctx tokens, the last {a.scored} "
                 "scored through each policy's decode path. \"fetched\" is "
                 "the mean fraction of the cached rows of the offloaded "
                 "layers read per step.\n")
        for text in texts:
            for ctx in contexts:
                ref = by.get(key(text, ctx, "full", None))
                cells = [(p, f, by.get(key(text, ctx, p, f)))
                         for p, f in runs]
                if not any(r for _, _, r in cells):
                    continue
                fh.write(f"\n## {os.path.basename(text)}, ctx {ctx}\n\n"
                         "| policy | target fetch | perplexity | vs full | "
                         "fetched |\n|---|---|---|---|---|\n")
                for p, f, r in cells:
                    if r is None:
                        fh.write(f"| {p} | {f if f else '—'} | not run | | |\n")
                        continue
                    vs = (f"{100 * (r['ppl'] / ref['ppl'] - 1):+.1f}%"
                          if ref else "")
                    fh.write(f"| {p} | {f if f else '—'} | {r['ppl']:.4f} | "
                             f"{vs} | {100 * r['fetch_fraction_mean']:.2f}% |\n")
    plt = benchutil.pyplot("long_context.py")
    if plt is None:
        return
    policies = list(dict.fromkeys(p for p, f in runs if f is not None))
    fig, axes = plt.subplots(1, len(contexts),
                             figsize=(4.2 * len(contexts), 3.6),
                             squeeze=False)
    markers = ["o", "s", "^", "D", "v", "P"]
    for ax, ctx in zip(axes[0], contexts):
        for ti, text in enumerate(texts):
            ref = by.get(key(text, ctx, "full", None))
            if ref is None:
                continue
            for pi, p in enumerate(policies):
                pts = sorted((r["fetch_fraction_mean"],
                              100 * (r["ppl"] / ref["ppl"] - 1))
                             for (t, c, q, f), r in by.items()
                             if t == os.path.basename(text) and c == ctx
                             and q == p and f is not None)
                if not pts:
                    continue
                ax.plot([100 * x for x, _ in pts], [y for _, y in pts],
                        marker=markers[pi % len(markers)],
                        linestyle="-" if ti == 0 else "--",
                        color=f"C{pi}",
                        label=f"{p} ({os.path.splitext(os.path.basename(text))[0]})")
        ax.axhline(0, color="gray", linewidth=0.8)
        ax.set_title(f"ctx {ctx}", fontsize=9)
        ax.set_xlabel("rows fetched (% of cached)")
        ax.set_ylabel("perplexity vs full (%)")
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=120, bbox_inches="tight")


def main():
    ap = benchutil.parser(__doc__.split("\n")[0])
    ap.add_argument("--binary", default="bazel-bin/gpu_worker/infinigen")
    ap.add_argument("--model", required=True)
    ap.add_argument("--texts", required=True, help="comma-separated files")
    ap.add_argument("--contexts", default="8192,32768",
                    help="comma-separated window lengths in tokens")
    ap.add_argument("--runs", default=DEFAULT_RUNS,
                    help="comma-separated POLICY or POLICY@FRACTION")
    ap.add_argument("--scored", type=int, default=256,
                    help="tokens at each window's end scored while decoding")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the runs OUT.jsonl holds")
    ap.add_argument("--report_only", action="store_true",
                    help="run nothing: the report of what OUT.jsonl holds "
                    "(the rest marked not run)")
    ap.add_argument("--out", help="output path without suffix (default: a "
                    "new directory under ./bench_out)")
    ap.add_argument("extra", nargs="*",
                    help="more infinigen flags, after --")
    a = ap.parse_args()
    a.binary = benchutil.repo_path(a.binary)
    if a.out is None:
        a.out = benchutil.fresh_out("long_context")
    texts = [t for t in a.texts.split(",") if t]
    for t in texts:
        if not os.path.exists(t):
            sys.exit(f"long_context.py: --texts: no file {t}")
    try:
        contexts = [int(c) for c in a.contexts.split(",") if c]
    except ValueError:
        sys.exit(f"long_context.py: --contexts: not numbers: {a.contexts}")
    if any(c <= a.scored for c in contexts):
        sys.exit("long_context.py: every context must exceed --scored")
    runs = benchutil.parse_runs(a.runs, "long_context.py: --runs")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    rows = []
    if a.report_only and not os.path.exists(a.out + ".jsonl"):
        sys.exit(f"long_context.py: --report_only: no {a.out}.jsonl")
    if (a.reuse or a.report_only) and os.path.exists(a.out + ".jsonl"):
        with open(a.out + ".jsonl") as fh:
            rows = [json.loads(l) for l in fh if l.strip()]
    elif os.path.exists(a.out + ".jsonl"):
        os.remove(a.out + ".jsonl")
    have = {key(r["text"], r["ctx"], r["policy"], r["target_fetch"])
            for r in rows}
    todo = [(t, c, p, f) for t in texts for c in contexts for p, f in runs
            if key(t, c, p, f) not in have and not a.report_only]
    for n, (t, c, p, f) in enumerate(todo, 1):
        r = run_one(a, t, c, p, f)
        rows.append(r)
        with open(a.out + ".jsonl", "a") as fh:
            fh.write(json.dumps(r, sort_keys=True) + "\n")
        print(f"[{n}/{len(todo)}] {os.path.basename(t)} ctx {c} "
              f"{p}{'@' + str(f) if f else ''}: ppl {r['ppl']:.4f} at "
              f"{100 * r['fetch_fraction_mean']:.2f}% fetched "
              f"({r['wall_seconds']:.0f} s)", file=sys.stderr, flush=True)
    write_report(a, rows, texts, contexts, runs)
    print(open(a.out + ".md").read())


if __name__ == "__main__":
    main()
