#!/usr/bin/env python3
"""Serving benchmark through the OpenAI-compatible HTTP API, in the spirit
of vLLM's benchmark_serving: for each concurrency N, N clients (threads,
the official `openai` package) each send --requests streaming completions
one after another to one `infinigen serve --http_listen`, which this script
starts (and stops by PID) unless --url names a running one.

Per request: time to first token (TTFT: send to the first chunk with text)
and time per output token (TPOT: first to last chunk over the tokens after
the first, counted by the server's usage). Per N: output tokens/s over the
wall time, TTFT and TPOT p50 / p99. Writes OUT.csv (one row per request),
OUT.md (the table, the command and the machine) and OUT.svg.

  bazel build //gpu_worker:infinigen
  bench/serve_bench.py [--model=models/stories260K/stories260K.bin
      --tokenizer=models/stories260K/tok512.bin] [--concurrency=1,4,8]
      [--requests=8] [--max_tokens=128] [--out=bench/results/serve_stories260K]
"""

import argparse
import csv
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import benchutil

import openai

WORKER = benchutil.repo_path("bazel-bin/gpu_worker/infinigen")
PROMPTS = ["Once upon a time", "The little dog", "Tom and his friend",
           "One day, a girl named Sue", "The sun was hot and"]


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def start_server(args):
    port = benchutil.free_port()
    cmd = [WORKER, "serve", f"--model={args.model}", "--listen=127.0.0.1:0",
           f"--http_listen=127.0.0.1:{port}", f"--max_batch={args.max_batch}",
           f"--threads={args.threads}", "--backend=" + args.backend]
    if args.tokenizer:
        cmd.append(f"--tokenizer={args.tokenizer}")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited ({proc.returncode}): {cmd}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                break
        except OSError:
            if time.time() > deadline:
                raise RuntimeError("serve not healthy after 300 s")
            time.sleep(0.1)
    return proc, url, " ".join(cmd)


def one_request(client, model, prompt, max_tokens, seed):
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=1.0,
        top_p=0.95, seed=seed, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            if first is None:
                first = now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None:
        return None
    tpot = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return {"ttft_s": first - t0, "tpot_s": tpot, "tokens": tokens,
            "latency_s": last - t0}


def run_level(url, model, n, args):
    rows, lock = [], threading.Lock()

    def client_loop(i):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused",
                               max_retries=0, timeout=600)
        for r in range(args.requests):
            res = one_request(client, model, PROMPTS[(i + r) % len(PROMPTS)],
                              args.max_tokens, seed=1000 * i + r)
            if res is not None:
                res.update(concurrency=n, client=i, request=r)
                with lock:
                    rows.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(i,))
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return rows, wall


def main():
    p = benchutil.parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/stories260K/stories260K.bin",
                   help="relative paths: from here, else from the repository")
    p.add_argument("--tokenizer", default="models/stories260K/tok512.bin")
    p.add_argument("--url", default="", help="a running serve's HTTP API")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--requests", type=int, default=8,
                   help="requests per client at each concurrency")
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--max_batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--out", default=None,
                   help="output path without suffix (default: a new "
                   "directory under ./bench_out)")
    args = p.parse_args()
    args.model = benchutil.repo_path(args.model)
    args.tokenizer = benchutil.repo_path(args.tokenizer)
    if args.out is None:
        args.out = benchutil.fresh_out("serve")

    proc, command = None, "(--url " + args.url + ")"
    url = args.url
    if not url:
        proc, url, command = start_server(args)
    try:
        model = openai.OpenAI(base_url=url + "/v1", api_key="unused")\
            .models.list().data[0].id
        levels = []
        all_rows = []
        for n in [int(x) for x in args.concurrency.split(",")]:
            rows, wall = run_level(url, model, n, args)
            all_rows += rows
            tokens = sum(r["tokens"] for r in rows)
            levels.append({
                "concurrency": n, "requests": len(rows),
                "tokens_per_s": tokens / wall,
                "requests_per_s": len(rows) / wall,
                "ttft_p50_ms": 1e3 * percentile([r["ttft_s"] for r in rows], .5),
                "ttft_p99_ms": 1e3 * percentile([r["ttft_s"] for r in rows], .99),
                "tpot_p50_ms": 1e3 * percentile(
                    [r["tpot_s"] for r in rows if r["tpot_s"] == r["tpot_s"]], .5),
                "tpot_p99_ms": 1e3 * percentile(
                    [r["tpot_s"] for r in rows if r["tpot_s"] == r["tpot_s"]], .99),
            })
            print("concurrency %d: %.1f tokens/s" % (n, levels[-1]["tokens_per_s"]),
                  file=sys.stderr)
    finally:
        if proc is not None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["concurrency", "client", "request",
                                          "tokens", "ttft_s", "tpot_s",
                                          "latency_s"])
        w.writeheader()
        for r in all_rows:
            w.writerow(r)
    header = ["concurrency", "requests", "tokens/s", "requests/s",
              "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"]
    lines = [
        f"# serve_bench: {model}",
        "",
        f"`{' '.join(sys.argv)}`; server: `{command}`; "
        f"{args.requests} streaming completions per client, max_tokens "
        f"{args.max_tokens}, temperature 1.0; machine: {platform.node()} "
        f"({platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for lv in levels:
        lines.append("| %d | %d | %.1f | %.2f | %.1f | %.1f | %.2f | %.2f |" % (
            lv["concurrency"], lv["requests"], lv["tokens_per_s"],
            lv["requests_per_s"], lv["ttft_p50_ms"], lv["ttft_p99_ms"],
            lv["tpot_p50_ms"], lv["tpot_p99_ms"]))
    md = "\n".join(lines) + "\n"
    with open(args.out + ".md", "w") as f:
        f.write(md)
    print(md)

    plt = benchutil.pyplot("serve_bench.py")
    if plt is None:
        return 0
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [lv["concurrency"] for lv in levels]
    a.plot(xs, [lv["tokens_per_s"] for lv in levels], marker="o")
    a.set_xlabel("concurrent streaming clients")
    a.set_ylabel("output tokens/s")
    b.plot(xs, [lv["ttft_p50_ms"] for lv in levels], marker="o", label="TTFT p50")
    b.plot(xs, [lv["ttft_p99_ms"] for lv in levels], marker="o", label="TTFT p99")
    b.plot(xs, [lv["tpot_p50_ms"] for lv in levels], marker="s", label="TPOT p50")
    b.plot(xs, [lv["tpot_p99_ms"] for lv in levels], marker="s", label="TPOT p99")
    b.set_xlabel("concurrent streaming clients")
    b.set_ylabel("ms")
    b.legend()
    fig.suptitle(f"serve_bench: {model}, max_batch {args.max_batch}")
    fig.tight_layout()
    fig.savefig(args.out + ".svg")


if __name__ == "__main__":
    main()
