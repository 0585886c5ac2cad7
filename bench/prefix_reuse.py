#!/usr/bin/env python3
"""Time to first token with and without prefix reuse: N requests (1..16)
sharing a long prompt prefix, sent together to two `infinigen serve`
worker processes that share one kv_memory_server, over shm and over TCP.

For each data plane and mode (reuse: --prefix_block_tokens=16; none: 0):
starts one node and two workers (SmolLM2-135M by default, policy full,
one thread each), then for each N sends N requests at once (request i to
worker i % 2; each N with a prefix of its own, so its first requests find
nothing cached) with bench/ttft_client, and stops everything by PID.
Writes OUT.csv (one row per request), OUT.md (mean / p50 / max TTFT per N
and mode, the reuse/none ratio, the command and the machine) and OUT.svg.

  bazel build //gpu_worker:infinigen //kv_memory_service:kv_memory_server \
      //bench:ttft_client
  bench/prefix_reuse.py [--counts=1,2,4,8,16] [--planes=shm,tcp]
"""

import argparse
import csv
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import benchutil

BIN = benchutil.repo_path("bazel-bin")
SERVER = BIN + "/kv_memory_service/kv_memory_server"
WORKER = BIN + "/gpu_worker/infinigen"
CLIENT = BIN + "/bench/ttft_client"


def wait_for(pred, what, procs, timeout=180):
    deadline = time.time() + timeout
    while not pred():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited ({p.returncode})")
        if time.time() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout} s")
        time.sleep(0.1)


def stop(procs):
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def start(a, plane, block, tmp):
    """A node and two workers; returns (processes, worker addresses)."""
    ready = os.path.join(tmp, "ready")
    shm = os.path.join(tmp, "node.sock")
    node = subprocess.Popen(
        [a.server, "--listen=127.0.0.1:0", f"--shm_listen=unix:{shm}",
         f"--ready_file={ready}", "--lease_timeout=60s"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [node]
    try:
        wait_for(lambda: os.path.exists(ready), "kv_memory_server", procs)
        with open(ready) as f:
            tcp = f.read().strip()
        kv = f"shm:unix:{shm}" if plane == "shm" else tcp
        addrs = []
        for i in range(2):
            port = benchutil.free_port()
            log = open(os.path.join(tmp, f"worker{i}.log"), "w")
            procs.append(subprocess.Popen(
                [a.binary, "serve", f"--model={a.model}",
                 f"--listen=127.0.0.1:{port}", "--policy=full",
                 f"--kv_service={kv}", f"--prefix_block_tokens={block}",
                 "--threads=1", "--max_batch=8", "--max_queue=64",
                 f"--max_seq_len={a.max_seq_len}"],
                stdout=subprocess.DEVNULL, stderr=log))
            path = log.name
            wait_for(lambda: "listening on" in open(path).read(),
                     f"worker {i}", procs)
            addrs.append(f"127.0.0.1:{port}")
        return procs, addrs
    except BaseException:
        stop(procs)
        raise


def run_requests(a, addrs, prefix, n, tmp, first=0):
    path = os.path.join(tmp, "prefix.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(prefix)
    questions = [f"\n\nQuestion {i + 1}: what does the passage say about "
                 f"{w}? Answer:" for i, w in
                 enumerate(["money", "marriage", "the ball", "the letter",
                            "the sisters", "the weather", "the house",
                            "the mother", "the father", "the visit", "pride",
                            "the estate", "the officers", "the walk",
                            "the dinner", "the end"][first:first + n])]
    r = subprocess.run(
        [a.client, f"--workers={','.join(addrs)}", f"--prompt_file={path}",
         "--suffixes=" + "|".join(questions), "--max_new_tokens=4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=3600)
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode != 0 or len(rows) != n:
        raise RuntimeError(f"ttft_client failed: {r.stderr}\n{r.stdout}")
    return rows


def svg(summary, path):
    """Mean TTFT against N, one line per plane and mode."""
    w, h, left, bottom = 640, 360, 60, 40
    counts = sorted({s["requests"] for s in summary})
    top = max(s["ttft_mean"] for s in summary) * 1.1
    def x(n):
        return left + (w - left - 20) * counts.index(n) / max(1, len(counts) - 1)
    def y(v):
        return h - bottom - (h - bottom - 20) * v / top
    colors = {("shm", "reuse"): "#1f77b4", ("shm", "none"): "#aec7e8",
              ("tcp", "reuse"): "#d62728", ("tcp", "none"): "#ff9896"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - 10}" y2="{h - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="10" x2="{left}" y2="{h - bottom}" stroke="black"/>',
           f'<text x="{w / 2}" y="{h - 5}" text-anchor="middle">requests sent together</text>',
           f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" text-anchor="middle">mean TTFT (s)</text>']
    for n in counts:
        out.append(f'<text x="{x(n)}" y="{h - bottom + 15}" text-anchor="middle">{n}</text>')
    for v in (0, top / 2, top):
        out.append(f'<text x="{left - 5}" y="{y(v)}" text-anchor="end">{v:.1f}</text>')
    legend = 20
    for key, color in colors.items():
        pts = [(s["requests"], s["ttft_mean"]) for s in summary
               if (s["plane"], s["mode"]) == key]
        if not pts:
            continue
        out.append('<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>'
                   % (color, " ".join(f"{x(n)},{y(v)}" for n, v in sorted(pts))))
        out.append(f'<text x="{left + 10}" y="{legend}" fill="{color}">{key[0]} {key[1]}</text>')
        legend += 16
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main():
    ap = benchutil.parser(__doc__, raw=True)
    ap.add_argument("--counts", default="1,2,4,8,16")
    ap.add_argument("--planes", default="shm,tcp")
    ap.add_argument("--model",
                    default="models_cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--text", default="../shared/data/pride_and_prejudice.txt",
                    help="where the shared prefixes come from")
    ap.add_argument("--prefix_chars", type=int, default=8400,
                    help="characters per shared prefix (~2,050 SmolLM2 tokens)")
    ap.add_argument("--max_seq_len", type=int, default=2304)
    ap.add_argument("--binary", default=WORKER)
    ap.add_argument("--server", default=SERVER)
    ap.add_argument("--client", default=CLIENT)
    ap.add_argument("--out", default=None,
                    help="output path without suffix (default: a new "
                    "directory under ./bench_out)")
    a = ap.parse_args()
    a.binary = benchutil.repo_path(a.binary)
    a.server = benchutil.repo_path(a.server)
    if a.out is None:
        a.out = benchutil.fresh_out("prefix_reuse")
    counts = [int(c) for c in a.counts.split(",")]
    planes = a.planes.split(",")
    with open(a.text, encoding="utf-8") as f:
        text = f.read()
    rows, summary, pairs = [], [], []
    for plane in planes:
        for mode, block in (("reuse", 16), ("none", 0)):
            tmp = tempfile.mkdtemp(prefix="prefix_reuse.")
            procs, addrs = start(a, plane, block, tmp)
            try:
                # One request, then (once it is done) a second with the same
                # prefix on the other worker process.
                prefix = text[2000:2000 + a.prefix_chars]
                one = run_requests(a, addrs[:1], prefix, 1, tmp)[0]
                two = run_requests(a, addrs[1:], prefix, 1, tmp, first=1)[0]
                pairs.append(dict(plane=plane, mode=mode, first=one, second=two))
                print(f"prefix_reuse: {plane} {mode}: second request's prefill "
                      f"{two['prefill_seconds']:.3f} s vs the first's "
                      f"{one['prefill_seconds']:.3f} s, cached "
                      f"{two['cached_tokens']} of {two['prompt_tokens']}",
                      file=sys.stderr)
                for k, n in enumerate(counts):
                    # A prefix of its own per N: the first requests are cold.
                    begin = 12000 + k * a.prefix_chars
                    prefix = text[begin:begin + a.prefix_chars]
                    t0 = time.time()
                    got = run_requests(a, addrs, prefix, n, tmp)
                    for r in got:
                        r.update(plane=plane, mode=mode, requests=n)
                        rows.append(r)
                    ttft = [r["ttft_seconds"] for r in got]
                    summary.append(dict(
                        plane=plane, mode=mode, requests=n,
                        ttft_mean=statistics.mean(ttft),
                        ttft_p50=statistics.median(ttft), ttft_max=max(ttft),
                        cached_mean=statistics.mean(r["cached_tokens"] for r in got),
                        prompt_tokens=got[0]["prompt_tokens"]))
                    print(f"prefix_reuse: {plane} {mode} N={n}: mean TTFT "
                          f"{summary[-1]['ttft_mean']:.2f} s, cached "
                          f"{summary[-1]['cached_mean']:.0f} of "
                          f"{got[0]['prompt_tokens']} ({time.time() - t0:.0f} s)",
                          file=sys.stderr)
            finally:
                stop(procs)
                shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    fields = ["plane", "mode", "requests", "request", "worker", "ok",
              "prompt_tokens", "cached_tokens", "ttft_seconds",
              "queue_seconds", "prefill_seconds", "total_seconds"]
    with open(a.out + ".csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        wr.writeheader()
        wr.writerows(rows)
    by = {(s["plane"], s["mode"], s["requests"]): s for s in summary}
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    md = ["# Time to first token with prefix reuse",
          "",
          f"Machine: {cpu}, {os.cpu_count()} cores, {platform.system()} "
          f"{platform.release()}. Model {a.model}, policy full, two "
          "`infinigen serve` workers (one thread each) sharing one "
          "kv_memory_server; N requests sent together, alternating between "
          "the workers, each a shared prefix of about "
          f"{summary[0]['prompt_tokens'] if summary else '?'} tokens plus its "
          "own question; each N uses a prefix of its own (its first requests "
          "are cold). TTFT is measured by the client (request sent to first "
          "token received), so it includes queueing behind other requests.",
          "",
          "Command: `bench/prefix_reuse.py " + " ".join(sys.argv[1:]) + "`",
          "",
          "Second request, sent after the first finished, to the other worker "
          "process (server-side prefill seconds):",
          "",
          "| plane | mode | prompt tokens | first: cached | first: prefill s | "
          "second: cached | second: prefill s | second / first |",
          "|---|---|---|---|---|---|---|---|"]
    for p in pairs:
        one, two = p["first"], p["second"]
        md.append(f"| {p['plane']} | {p['mode']} | {two['prompt_tokens']} | "
                  f"{one['cached_tokens']} | {one['prefill_seconds']:.3f} | "
                  f"{two['cached_tokens']} | {two['prefill_seconds']:.3f} | "
                  f"{two['prefill_seconds'] / one['prefill_seconds']:.3f}x |")
    md += ["",
          "N requests sent together:",
          "",
          "| plane | N | TTFT mean s (reuse) | TTFT mean s (none) | reuse / none | "
          "p50 reuse | p50 none | max reuse | max none | cached tokens (reuse, mean) |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for plane in planes:
        for n in counts:
            r, z = by.get((plane, "reuse", n)), by.get((plane, "none", n))
            if not r or not z:
                continue
            md.append(f"| {plane} | {n} | {r['ttft_mean']:.2f} | {z['ttft_mean']:.2f} | "
                      f"{r['ttft_mean'] / z['ttft_mean']:.2f}x | {r['ttft_p50']:.2f} | "
                      f"{z['ttft_p50']:.2f} | {r['ttft_max']:.2f} | {z['ttft_max']:.2f} | "
                      f"{r['cached_mean']:.0f} |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    svg(summary, a.out + ".svg")
    print("\n".join(md))


if __name__ == "__main__":
    main()
