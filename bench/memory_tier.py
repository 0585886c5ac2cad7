#!/usr/bin/env python3
"""Fetch bandwidth and decode speed with a memory tier of 1, 2 and 4
kv_memory_server processes on this host over TCP (kv_memory_service/sharded).

For each node count N: starts N servers on 127.0.0.1, runs the fetch bench
(bench/kv_fetch_bench, its "external" plane at --kv_address=A,B,...) and
`infinigen bench-decode --policy=full --kv_service=A,B,...`, then stops the
servers by PID. Writes OUT.csv, OUT.md (table, command, machine, and the
expected gain on real NICs modelled from the measured per-node figures) and
OUT.svg (aggregate fetch GB/s and tokens/s against N).

  bazel build //kv_memory_service:kv_memory_server //bench/kv_fetch_bench \
      //gpu_worker:infinigen
  bench/memory_tier.py [--nodes=1,2,4] [--ctx=2048] [--decode_tokens=16]
"""

import argparse
import csv
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import benchutil

BIN = benchutil.repo_path("bazel-bin")
SERVER = BIN + "/kv_memory_service/kv_memory_server"
FETCH = BIN + "/bench/kv_fetch_bench/kv_fetch_bench"
WORKER = BIN + "/gpu_worker/infinigen"


def start_servers(n, tmp):
    procs, addrs = [], []
    for i in range(n):
        ready = os.path.join(tmp, "ready%d_of_%d" % (i, n))
        p = subprocess.Popen([SERVER, "--listen=127.0.0.1:0",
                              "--ready_file=" + ready],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        deadline = time.time() + 60
        while not os.path.exists(ready):
            if p.poll() is not None or time.time() > deadline:
                stop_servers(procs)
                sys.exit("memory_tier.py: server %d did not start" % i)
            time.sleep(0.05)
        addrs.append(open(ready).read().strip())
    return procs, addrs


def stop_servers(procs):
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()


def fetch_bench(address, tmp, min_time):
    out = os.path.join(tmp, "fetch.json")
    cmd = [FETCH, "--kv_address=" + address, "--benchmark_filter=external",
           "--benchmark_min_time=%g" % min_time, "--benchmark_out=" + out,
           "--benchmark_out_format=json"]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = {}
    for b in json.load(open(out))["benchmarks"]:
        tokens = int(re.findall(r"\d+", b["name"])[-1])
        if "p50_us" not in b:
            sys.exit("memory_tier.py: %s failed: %s"
                     % (b["name"], b.get("error_message", "no counters")))
        rows[tokens] = (b["p50_us"], b["GB/s"])
    return rows


def decode_bench(a, address):
    cmd = [WORKER, "bench-decode", "--model=" + a.model, "--ctx=%d" % a.ctx,
           "--decode_tokens=%d" % a.decode_tokens, "--policy=full",
           "--kv_service=" + address, "--json"]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True,
                         stderr=subprocess.DEVNULL).stdout
    line = [l for l in out.splitlines() if l.startswith("{")][-1]
    return json.loads(line)


def svg(rows, path):
    """Two bar groups per N: fetch GB/s (largest fetch) and tokens/s, each
    scaled to its own maximum."""
    w, h, pad = 520, 300, 50
    big = max(r["tokens"] for r in rows)
    sel = [r for r in rows if r["tokens"] == big]
    gmax = max(r["fetch_gbps"] for r in sel) or 1
    tmax = max(r["tokens_per_s"] for r in sel) or 1
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
             'font-family="sans-serif" font-size="12">' % (w, h),
             '<text x="%d" y="20">memory tier on one host (TCP loopback): '
             'bars scaled to the largest</text>' % pad]
    slot = (w - 2 * pad) / len(sel)
    for i, r in enumerate(sel):
        x0 = pad + i * slot
        for j, (v, vmax, color, label) in enumerate((
                (r["fetch_gbps"], gmax, "#4477aa", "%.2f GB/s"),
                (r["tokens_per_s"], tmax, "#cc6677", "%.1f tok/s"))):
            bh = (h - 2 * pad) * v / vmax
            x = x0 + 10 + j * (slot / 2 - 5)
            parts.append('<rect x="%.0f" y="%.0f" width="%.0f" height="%.0f" '
                         'fill="%s"/>' % (x, h - pad - bh, slot / 2 - 20, bh,
                                          color))
            parts.append('<text x="%.0f" y="%.0f">%s</text>'
                         % (x, h - pad - bh - 4, label % v))
        parts.append('<text x="%.0f" y="%d">%d node(s)</text>'
                     % (x0 + slot / 3, h - pad + 18, r["nodes"]))
    parts.append('<text x="%d" y="%d" fill="#4477aa">fetch GB/s (%d tokens x '
                 '3 heads)</text><text x="%d" y="%d" fill="#cc6677">bench-decode '
                 'full tokens/s</text>' % (pad, h - 8, big, pad + 250, h - 8))
    parts.append("</svg>")
    open(path, "w").write("\n".join(parts) + "\n")


def main():
    ap = benchutil.parser(__doc__, raw=True)
    ap.add_argument("--nodes", default="1,2,4")
    ap.add_argument("--model",
                    default="models_cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--decode_tokens", type=int, default=16)
    ap.add_argument("--min_time", type=float, default=0.3)
    ap.add_argument("--out", default=None,
                    help="output path without suffix (default: a new "
                    "directory under ./bench_out)")
    a = ap.parse_args()
    if a.out is None:
        a.out = benchutil.fresh_out("memory_tier")
    rows = []
    tmp = tempfile.mkdtemp(prefix="memory_tier.")
    try:
        for n in [int(x) for x in a.nodes.split(",")]:
            procs, addrs = start_servers(n, tmp)
            try:
                address = ",".join(addrs)
                fetch = fetch_bench(address, tmp, a.min_time)
                dec = decode_bench(a, address)
            finally:
                stop_servers(procs)
            for tokens, (p50, gbps) in sorted(fetch.items()):
                rows.append({"nodes": n, "tokens": tokens, "fetch_p50_us": p50,
                             "fetch_gbps": gbps,
                             "tokens_per_s": dec["tokens_per_s"],
                             "decode_p50_ms": dec["p50_ms"]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        wr.writeheader()
        wr.writerows(rows)
    big = max(r["tokens"] for r in rows)
    one = {r["tokens"]: r for r in rows if r["nodes"] == 1}
    small = min(r["tokens"] for r in rows)
    lines = [
        "# Memory tier: 1, 2, 4 kv_memory_server processes on one host (TCP)",
        "",
        "Command: `bench/memory_tier.py %s`  " % " ".join(sys.argv[1:]),
        "Machine: %d cores (%s), %s; servers, fetch bench and worker all on "
        "this host over loopback TCP." % (os.cpu_count(), platform.processor()
                                         or platform.machine(), platform.node()),
        "Fetch = tokens x 3 KV heads x 64 dims x fp16, K and V, one fetch in "
        "flight (bench/kv_fetch_bench, plane `external`); each fetch is split "
        "by KV head over the nodes (with 4 nodes and 3 heads one node idles). "
        "Decode: `infinigen bench-decode --policy=full --ctx=%d "
        "--decode_tokens=%d` on %s." % (a.ctx, a.decode_tokens, a.model),
        "",
        "| nodes | tokens | fetch p50 us | fetch GB/s | vs 1 node | "
        "decode tokens/s | decode p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append("| %d | %d | %.1f | %.2f | %.2fx | %.2f | %.1f |" % (
            r["nodes"], r["tokens"], r["fetch_p50_us"], r["fetch_gbps"],
            one[r["tokens"]]["fetch_p50_us"] / r["fetch_p50_us"],
            r["tokens_per_s"], r["decode_p50_ms"]))
    # Model: a fetch costs a fixed part (the small fetch's p50: round trip,
    # per-call work) plus a part proportional to bytes that N nodes with
    # their own NICs share; the worker's side is assumed not to be the
    # bottleneck (several NICs, as Mooncake's transfer engine).
    t_fixed = one[small]["fetch_p50_us"]
    t1 = one[big]["fetch_p50_us"]
    lines += [
        "",
        "On loopback every node, the client and the copies share this host's "
        "%d cores and one memory bus: the nodes do not add bandwidth here, "
        "they only add parallel gathers and socket copies on the same cores, "
        "so any gain above is bounded by the cores, not by NICs." % os.cpu_count(),
        "",
        "Expected gain on real NICs (one NIC per node, worker not the "
        "bottleneck), modelled from the 1-node figures: t(N) = t_fixed + "
        "(t(1) - t_fixed) / N with t_fixed = %.1f us (the %d-token p50) and "
        "t(1) = %.1f us (the %d-token p50):" % (t_fixed, small, t1, big),
        "",
        "| nodes | modelled %d-token fetch us | modelled gain |" % big,
        "|---|---|---|",
    ]
    for n in sorted({r["nodes"] for r in rows}):
        t = t_fixed + (t1 - t_fixed) / n
        lines.append("| %d | %.1f | %.2fx |" % (n, t, t1 / t))
    open(a.out + ".md", "w").write("\n".join(lines) + "\n")
    svg(rows, a.out + ".svg")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
