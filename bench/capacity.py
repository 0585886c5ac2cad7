#!/usr/bin/env python3
"""Worker memory by policy: what each KV policy holds on the worker, what the
memory node holds, and the largest batch each can serve under a worker limit.

Starts one `kv_memory_server` (shared-memory plane) on this machine, then runs
`infinigen bench-decode --json` once per (context, batch, policy), each in its
own process so that its peak RSS is its own, and tabulates worker KV bytes,
worker peak RSS, memory-node bytes and tokens/s. The headline: for each
policy and context, the largest batch whose worker KV fits --limit, found
with `bench-decode --plan_only --max_worker_kv_bytes` (the engine's own
refusal, before it allocates). Writes OUT.md, OUT.csv and (with matplotlib)
OUT.png.

Example (SmolLM2-135M):
  bench/capacity.py --model=$(scripts/fetch_smollm2.sh) \
    --text=../shared/data/pride_and_prejudice.txt \
    --skew=models_cache/smollm2-135m/smollm2.skew \
    --contexts=2048,8000 --batches=1,4,8 --limit_mib=512 \
    --out=bench/results/capacity_smollm2
"""
import argparse
import csv
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

import benchutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_sweep import start_server  # noqa: E402

MIB = 1024.0 * 1024.0


def bench(a, address, ctx, batch, policy, extra=()):
    cmd = [a.binary, "bench-decode", f"--model={a.model}", f"--ctx={ctx}",
           f"--batch={batch}", f"--decode_tokens={a.decode_tokens}",
           f"--policy={policy}", f"--kv_service={address}", "--json"]
    if a.text:
        cmd.append(f"--text={a.text}")
    if a.skew:
        cmd.append(f"--skew={a.skew}")
    cmd += list(extra)
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def fits(a, ctx, batch, policy, limit):
    """True when bench-decode --plan_only accepts the configuration."""
    out = bench(a, "inproc:", ctx, batch, policy,
                ["--plan_only", f"--max_worker_kv_bytes={limit}"])
    if out.returncode == 0:
        return True
    if "--max_worker_kv_bytes" in out.stderr:
        return False
    sys.exit(f"capacity.py: plan failed:\n{out.stderr[-2000:]}")


def largest_batch(a, ctx, policy, limit, cap):
    """The largest batch in [0, cap] that fits (0 if none); fits() is
    monotone in the batch."""
    if not fits(a, ctx, 1, policy, limit):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(a, ctx, hi, policy, limit):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(a, ctx, mid, policy, limit):
            lo = mid
        else:
            hi = mid
    return lo


def plot(rows, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("capacity.py: no matplotlib; skipped the plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = {}
    for r in rows:
        lines.setdefault((r["policy"], int(r["ctx"])), []).append(
            (int(r["batch"]), float(r["worker_kv_bytes"]) / MIB))
    for (policy, ctx), pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"{policy}, ctx {ctx}")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("worker KV MiB")
    ax.set_yscale("log")
    ax.legend(fontsize=6)
    ax.set_title("KV memory held by the worker", fontsize=9)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)


def main():
    ap = benchutil.parser(__doc__.split("\n")[0])
    ap.add_argument("--binary", default="bazel-bin/gpu_worker/infinigen")
    ap.add_argument("--server",
                    default="bazel-bin/kv_memory_service/kv_memory_server")
    ap.add_argument("--model", default="")
    ap.add_argument("--text", default="")
    ap.add_argument("--skew", default="")
    ap.add_argument("--contexts", default="2048,8000")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--policies", default="ideal,full,infinigen,h2o,int4")
    ap.add_argument("--decode_tokens", type=int, default=16)
    ap.add_argument("--limit_mib", type=float, default=512,
                    help="worker KV limit of the headline table, MiB")
    ap.add_argument("--max_batch", type=int, default=1024,
                    help="largest batch the headline search tries")
    ap.add_argument("--out", help="output path without suffix (default: a new directory under ./bench_out)")
    ap.add_argument("--plot_only", action="store_true",
                    help="only redraw OUT.png from an earlier OUT.csv")
    a = ap.parse_args()
    a.binary = benchutil.repo_path(a.binary)
    a.server = benchutil.repo_path(a.server)
    if a.out is None:
        a.out = benchutil.fresh_out("capacity")
    if a.plot_only:
        with open(a.out + ".csv") as f:
            plot(list(csv.DictReader(l for l in f if not l.startswith("#"))),
                 a.out)
        return
    if not a.model:
        ap.error("--model is required")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_server(a.server, "shm", tmp)
        try:
            for ctx in a.contexts.split(","):
                for batch in a.batches.split(","):
                    for policy in a.policies.split(","):
                        out = bench(a, address, ctx, batch, policy)
                        if out.returncode != 0:
                            sys.exit(f"capacity.py: failed:\n"
                                     f"{out.stderr[-2000:]}")
                        for line in out.stdout.splitlines():
                            if line.startswith("{"):
                                r = json.loads(line)
                                rows.append(r)
                                print(f"ctx {ctx:>5} b{batch} {policy:9s} "
                                      f"worker KV "
                                      f"{r['worker_kv_bytes'] / MIB:8.1f} MiB"
                                      f", RSS {r['peak_rss_bytes'] / MIB:6.0f}"
                                      f" MiB, {r['tokens_per_s']:.2f} tok/s",
                                      file=sys.stderr, flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    limit = int(a.limit_mib * MIB)
    headline = []
    for ctx in a.contexts.split(","):
        for policy in a.policies.split(","):
            b = largest_batch(a, ctx, policy, limit, a.max_batch)
            headline.append({"ctx": int(ctx), "policy": policy, "batch": b})
            print(f"ctx {ctx:>5} {policy:9s} largest batch under "
                  f"{a.limit_mib:g} MiB: {b}", file=sys.stderr, flush=True)

    cmdline = benchutil.command_line()
    with open(a.out + ".md", "w") as f:
        f.write("# Worker memory by policy\n\n"
                f"Command: `{cmdline}`  \nMachine: {platform.machine()}, "
                f"{os.cpu_count()} cores, CPU backend, KV node "
                f"`kv_memory_server` over shm on the same host; "
                f"{time.time() - started:.0f} s\n\n"
                "Each row is its own `infinigen bench-decode` process "
                f"({a.decode_tokens} decode steps), so its peak RSS (model "
                "weights included) is its own. Worker KV: what the worker "
                "holds for K/V rows, fetch staging and policy state; node "
                "KV: what the memory node reserves for the run's "
                "sequences.\n\n")
        f.write(f"## Largest batch under a worker KV limit of "
                f"{a.limit_mib:g} MiB\n\n"
                "| context | " +
                " | ".join(a.policies.split(",")) + " |\n|---|" +
                "---|" * len(a.policies.split(",")) + "\n")
        for ctx in a.contexts.split(","):
            cells = [str(h["batch"]) for h in headline
                     if h["ctx"] == int(ctx)]
            f.write(f"| {ctx} | " + " | ".join(cells) + " |\n")
        f.write(f"\n(search capped at batch {a.max_batch}; found with "
                "`bench-decode --plan_only --max_worker_kv_bytes`)\n\n")
        groups = {}
        for r in rows:
            groups.setdefault((r["ctx"], r["batch"]), []).append(r)
        for (ctx, batch), rs in groups.items():
            by = {r["policy"]: r for r in rs}
            f.write(f"## Context {ctx}, batch {batch}\n\n"
                    "| policy | worker KV MiB | vs ideal | worker peak RSS "
                    "MiB | vs ideal | node KV MiB | tokens/s |\n"
                    "|---|---|---|---|---|---|---|\n")
            for r in rs:
                ideal = by.get("ideal")
                kv_ratio = (f"{r['worker_kv_bytes'] / ideal['worker_kv_bytes']:.3f}x"
                            if ideal else "")
                rss_ratio = (f"{r['peak_rss_bytes'] / ideal['peak_rss_bytes']:.2f}x"
                             if ideal else "")
                f.write(f"| {r['policy']} | {r['worker_kv_bytes'] / MIB:.1f} | "
                        f"{kv_ratio} | {r['peak_rss_bytes'] / MIB:.0f} | "
                        f"{rss_ratio} | "
                        f"{r['memory_node_bytes'] / MIB:.1f} | "
                        f"{r['tokens_per_s']:.2f} |\n")
            f.write("\n")
    with open(a.out + ".csv", "w", newline="") as f:
        keys = ["policy", "ctx", "batch", "decode_tokens", "worker_kv_bytes",
                "peak_rss_bytes", "memory_node_bytes", "tokens_per_s",
                "p50_ms", "p99_ms", "fetch_fraction_mean"]
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        for h in headline:
            f.write(f"# largest batch under {a.limit_mib:g} MiB: "
                    f"{h['policy']} ctx {h['ctx']}: {h['batch']}\n")
    plot(rows, a.out)
    print(open(a.out + ".md").read())


if __name__ == "__main__":
    main()
