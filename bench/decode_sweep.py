#!/usr/bin/env python3
"""Decode latency against context length, per policy and data plane.

For each data plane (inproc, shm, tcp: the last two start a real
kv_memory_server process on this machine) and each context length, runs one
`infinigen bench-decode` with every policy (so each comparison is one run),
then writes OUT.md (tables), OUT.csv and, when matplotlib is available,
OUT.png (ms per step against context, one line per policy and plane).

Example (SmolLM2-135M):
  bench/decode_sweep.py --model=$(scripts/fetch_smollm2.sh) \
    --text=../shared/data/pride_and_prejudice.txt --contexts=2048,8000 \
    --batches=1,4 --planes=shm,tcp --out=bench/results/decode_smollm2
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


def start_server(server, plane, tmp):
    ready = os.path.join(tmp, f"ready_{plane}")
    args = [server, "--listen=127.0.0.1:0", f"--ready_file={ready}"]
    shm_path = os.path.join(tmp, "kv.shm.sock")
    if plane == "shm":
        args.append(f"--shm_listen=unix:{shm_path}")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(200):
        if os.path.exists(ready) and open(ready).read().strip():
            break
        if proc.poll() is not None:
            sys.exit(f"decode_sweep.py: {server} exited with {proc.returncode}")
        time.sleep(0.05)
    else:
        proc.kill()
        sys.exit("decode_sweep.py: the KV memory server did not start")
    address = open(ready).read().strip()
    if plane == "shm":
        address = f"shm:unix:{shm_path}"
    return proc, address


def plot(rows, out):
    """OUT.png: p50 ms per step against context, one line per policy, plane
    and batch; with a single context, tokens/s as grouped bars."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("decode_sweep.py: no matplotlib; skipped the plot",
              file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    contexts = sorted({int(r["ctx"]) for r in rows})
    if len(contexts) == 1:
        groups = sorted({(r["plane"], int(r["batch"])) for r in rows})
        policies = list(dict.fromkeys(r["policy"] for r in rows))
        width = 0.8 / max(1, len(policies))
        for j, policy in enumerate(policies):
            xs, ys = [], []
            for i, g in enumerate(groups):
                for r in rows:
                    if (r["plane"], int(r["batch"])) == g and r["policy"] == policy:
                        xs.append(i + j * width)
                        ys.append(float(r["tokens_per_s"]))
            ax.bar(xs, ys, width, label=policy)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"{p}, batch {b}" for p, b in groups])
        ax.set_ylabel("tokens/s")
        ax.set_title(f"decode at context {contexts[0]}", fontsize=9)
        ax.legend(fontsize=7)
    else:
        lines = {}
        for r in rows:
            lines.setdefault((r["plane"], r["policy"], int(r["batch"])),
                             []).append((int(r["ctx"]), float(r["p50_ms"])))
        for (plane, policy, batch), pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"{policy} ({plane}, b{batch})")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("p50 ms per decode step")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)


def main():
    ap = benchutil.parser(__doc__.split("\n")[0])
    ap.add_argument("--binary", default="bazel-bin/gpu_worker/infinigen")
    ap.add_argument("--server",
                    default="bazel-bin/kv_memory_service/kv_memory_server")
    ap.add_argument("--model", default="")
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--text", default="")
    ap.add_argument("--contexts", default="1024,2048,4096,8000")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--decode_tokens", type=int, default=32)
    ap.add_argument("--policies", default="ideal,full,infinigen,h2o,int4")
    ap.add_argument("--planes", default="inproc,shm,tcp")
    ap.add_argument("--skew", default="",
                    help="skew file (default: calibrate on the context)")
    ap.add_argument("--row_caches", default="",
                    help="comma-separated --row_cache values: one run each, "
                         "against the same server (the policies that read "
                         "every row in the first alone); empty: the "
                         "binary's default")
    ap.add_argument("--extra", default="",
                    help="more flags for bench-decode, space-separated")
    ap.add_argument("--out", help="output path without suffix (default: a new directory under ./bench_out)")
    ap.add_argument("--plot_only", action="store_true",
                    help="only redraw OUT.png from an earlier OUT.csv")
    a = ap.parse_args()
    a.binary = benchutil.repo_path(a.binary)
    a.server = benchutil.repo_path(a.server)
    if a.out is None:
        a.out = benchutil.fresh_out("decode")
    if a.plot_only:
        with open(a.out + ".csv") as f:
            plot(list(csv.DictReader(f)), a.out)
        return
    if not a.model:
        ap.error("--model is required")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    rows = []
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for plane in a.planes.split(","):
            proc, address = (None, "inproc:")
            if plane != "inproc":
                proc, address = start_server(a.server, plane, tmp)
            try:
                runs = [(a.policies, None)]
                if a.row_caches:
                    caches = a.row_caches.split(",")
                    selecting = ",".join(
                        p for p in a.policies.split(",")
                        if p not in ("ideal", "full", "int4"))
                    runs = [(a.policies, caches[0])] + [
                        (selecting, c) for c in caches[1:] if selecting]
                for batch, ctx, (policies, cache) in (
                    (b, c, r) for b in a.batches.split(",")
                    for c in a.contexts.split(",") for r in runs):
                    cmd = [a.binary, "bench-decode", f"--model={a.model}",
                           f"--ctx={ctx}", f"--batch={batch}",
                           f"--decode_tokens={a.decode_tokens}",
                           f"--policy={policies}",
                           f"--kv_service={address}", "--json"]
                    if cache is not None:
                        cmd.append(f"--row_cache={cache}")
                    if a.tokenizer:
                        cmd.append(f"--tokenizer={a.tokenizer}")
                    if a.text:
                        cmd.append(f"--text={a.text}")
                    if a.skew:
                        cmd.append(f"--skew={a.skew}")
                    cmd += a.extra.split()
                    print("+", " ".join(cmd), file=sys.stderr, flush=True)
                    out = subprocess.run(cmd, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
                    if out.returncode != 0:
                        sys.exit(f"decode_sweep.py: failed:\n"
                                 f"{out.stderr[-2000:]}")
                    for line in out.stdout.splitlines():
                        if line.startswith("{"):
                            r = json.loads(line)
                            r["plane"] = plane
                            # A selecting policy's row names its cache.
                            if a.row_caches and r["policy"] not in (
                                    "ideal", "full", "int4"):
                                r["policy"] += f" rc={r['row_cache']:g}"
                            rows.append(r)
                            print(f"{plane:6s} b{batch} ctx {ctx:>5} "
                                  f"{r['policy']:9s} "
                                  f"{r['tokens_per_s']:8.2f} tok/s",
                                  file=sys.stderr, flush=True)
            finally:
                if proc is not None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=30)

    cmdline = benchutil.command_line()
    with open(a.out + ".md", "w") as f:
        f.write(f"# Decode speed by policy and data plane\n\n"
                f"Command: `{cmdline}`  \nMachine: {platform.machine()}, "
                f"{os.cpu_count()} cores, CPU backend; "
                f"{time.time() - started:.0f} s\n\n")
        groups = {}
        for r in rows:
            groups.setdefault((r["plane"], r["batch"], r["ctx"]), []).append(r)
        for (plane, batch, ctx), rs in groups.items():
            by = {r["policy"]: r for r in rs}
            f.write(f"## {plane}, batch {batch}, context {ctx}\n\n"
                    "| policy | tokens/s | vs full | vs ideal | p50 ms/step | "
                    "p99 ms/step | KV bytes/token | rows selected | "
                    "row cache hits | fetch wait | peak RSS MiB |\n"
                    "|---|---|---|---|---|---|---|---|---|---|---|\n")
            for r in rs:
                vs_full = (f"{r['tokens_per_s'] / by['full']['tokens_per_s']:.2f}x"
                           if "full" in by else "")
                vs_ideal = (f"{r['tokens_per_s'] / by['ideal']['tokens_per_s']:.2f}x"
                            if "ideal" in by else "")
                f.write(f"| {r['policy']} | {r['tokens_per_s']:.2f} | "
                        f"{vs_full} | {vs_ideal} | {r['p50_ms']:.1f} | "
                        f"{r['p99_ms']:.1f} | "
                        f"{r['bytes_fetched_per_token']:.0f} | "
                        f"{100 * r['fetch_fraction_mean']:.1f}% | "
                        f"{100 * r.get('row_cache_hit_rate', 0):.1f}% | "
                        f"{100 * r['fetch_wait_fraction']:.1f}% | "
                        f"{r['peak_rss_bytes'] / 2**20:.0f} |\n")
            f.write("\n")
    with open(a.out + ".csv", "w", newline="") as f:
        keys = ["plane", "policy", "ctx", "batch", "decode_tokens",
                "tokens_per_s", "p50_ms", "p99_ms", "bytes_fetched_per_token",
                "fetch_fraction_mean", "fetch_wait_fraction",
                "prefill_seconds", "row_cache", "row_cache_hit_rate",
                "rows_fetched_per_token", "row_cache_bytes",
                "peak_rss_bytes"]
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(rows, a.out)
    print(open(a.out + ".md").read())


if __name__ == "__main__":
    main()
