#!/usr/bin/env python3
"""Turns the runs of scripts/gpu_bench.sh into OUT_DIR/gpu_bench.json and
OUT_DIR/gpu_bench.md: one row per system, policy and shape, and the goals
(ratios within the one call) met or not.

    python3 bench/gpu_bench_report.py OUT_DIR [--model_config=llama-2-7b]

Reads OUT_DIR/device.csv (nvidia-smi: name, driver, MiB), commit.txt and
runs/NAME.{cmd,out,err,meta.json}. Needs only the Python standard library.
"""
import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_baseline  # noqa: E402  (the model presets)


def read(path, default=""):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default


def json_lines(text):
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def flag(cmd, name, default=None):
    for arg in cmd:
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return default


def kv_bytes(config, ctx, batch):
    """fp16 K and V of every layer for batch x ctx tokens."""
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] //
                          config["num_attention_heads"])
    return 2 * config["num_hidden_layers"] * ctx * batch * heads * head_dim * 2


def collect(out_dir, config, gpu_bytes):
    runs = []
    metas = sorted(glob.glob(os.path.join(out_dir, "runs", "*.meta.json")),
                   key=os.path.getmtime)
    for meta_path in metas:
        meta = json.loads(read(meta_path, "{}"))
        name = meta.get("name", "")
        base = meta_path[: -len(".meta.json")]
        cmd = read(base + ".cmd").splitlines()
        if name in ("h2d", "skew", "gather", "flash"):
            continue
        system = "hf-transformers" if "hf_baseline.py" in " ".join(cmd) \
            else "infinigen"
        ctx = int(flag(cmd, "ctx", 0))
        batch = int(flag(cmd, "batch", 1))
        policies = ([flag(cmd, "cache", "dynamic")]
                    if system == "hf-transformers"
                    else flag(cmd, "policy", "").split(","))
        found = {}
        for j in json_lines(read(base + ".out")):
            found[j.get("policy")] = j
        err_lines = [l for l in read(base + ".err").splitlines() if l.strip()]
        reason = err_lines[-1] if err_lines else ""
        for policy in policies:
            j = found.get(policy)
            row = {"system": system, "policy": policy, "ctx": ctx,
                   "batch": batch,
                   "decode_tokens_per_s": None, "prefill_tokens_per_s": None,
                   "fetch_gbps": None, "decode_fetch_gbps": None,
                   "fetch_fraction": None, "p50_ms": None,
                   "first_step_ms": None, "ttft_s": None,
                   "prefill_open_seconds": None,
                   "prefill_append_wait_seconds": None,
                   "prefill_policy_seconds": None,
                   "bytes_per_step": None, "row_cache_hit_rate": None,
                   "direct_reads": flag(cmd, "kv_direct_reads", "false")
                   in ("true", "1"),
                   "kv_exceeds_gpu": bool(gpu_bytes) and
                   kv_bytes(config, ctx, batch) > gpu_bytes,
                   "refused": False}
            if j is not None and "error" not in j:
                if system == "infinigen":
                    row["decode_tokens_per_s"] = j.get("tokens_per_s")
                    row["p50_ms"] = j.get("p50_ms")
                    steps = j.get("step_ms") or []
                    row["first_step_ms"] = steps[0] if steps else None
                    if policy != "ideal":
                        for k in ("prefill_open_seconds",
                                  "prefill_append_wait_seconds",
                                  "prefill_policy_seconds",
                                  "row_cache_hit_rate"):
                            row[k] = j.get(k)
                        # K and V bytes a decode step fetched per sequence.
                        row["bytes_per_step"] = j.get(
                            "bytes_fetched_per_token")
                    if policy != "ideal":  # nothing fetched
                        row["fetch_gbps"] = j.get("fetch_gbps")
                        row["decode_fetch_gbps"] = j.get("decode_fetch_gbps")
                        row["fetch_fraction"] = j.get("fetch_fraction_mean")
                else:
                    row["decode_tokens_per_s"] = j.get("decode_tokens_per_s")
                row["prefill_tokens_per_s"] = j.get("prefill_tokens_per_s")
                # A prompt alone: the seconds to its first token.
                if batch == 1 and row["prefill_tokens_per_s"]:
                    row["ttft_s"] = ctx / row["prefill_tokens_per_s"]
            elif meta.get("skipped"):
                row["skipped"] = "no budget left"
            elif meta.get("timed_out"):
                row["timed_out"] = True
            else:
                row["refused"] = True
                row["reason"] = (j or {}).get("error") or reason
            runs.append(row)
    return runs


def find(runs, system, policy, ctx, batch):
    """The run of that shape, the fastest decode where there are several
    (one-sided reads on and off)."""
    match = [r for r in runs
             if (r["system"], r["policy"], r["ctx"], r["batch"]) ==
             (system, policy, ctx, batch)]
    match.sort(key=lambda r: r["decode_tokens_per_s"] or 0, reverse=True)
    return match[0] if match else None


def ratio(a, b):
    return a / b if a and b else None


def goals(runs, h2d):
    ig = lambda p, c, b: find(runs, "infinigen", p, c, b) or {}
    hf = lambda p, c, b: find(runs, "hf-transformers", p, c, b) or {}
    dec = "decode_tokens_per_s"
    pre = "prefill_tokens_per_s"
    big = max([r["batch"] for r in runs if r["ctx"] == 32768] or [0])
    g = [
        ("full's fetch >= 0.8x pinned host-to-device (ctx 32768, batch 1; "
         "bytes fetched per second of decoding)",
         ratio(ig("full", 32768, 1).get("decode_fetch_gbps"), h2d), 0.8),
        ("infinigen >= 3x full (ctx 32768, batch 1)",
         ratio(ig("infinigen", 32768, 1).get(dec),
               ig("full", 32768, 1).get(dec)), 3.0),
        ("infinigen >= 3x Transformers' offloaded cache (ctx 32768, batch 1)",
         ratio(ig("infinigen", 32768, 1).get(dec),
               hf("offloaded", 32768, 1).get(dec)), 3.0),
        ("infinigen >= 3x full (ctx 8192, batch 8)",
         ratio(ig("infinigen", 8192, 8).get(dec),
               ig("full", 8192, 8).get(dec)), 3.0),
        ("prefill >= 0.5x Transformers' (ideal, ctx 4096, batch 1)",
         ratio(ig("ideal", 4096, 1).get(pre),
               hf("dynamic", 4096, 1).get(pre)), 0.5),
        ("ideal decode >= Transformers' DynamicCache (ctx 4096, batch 1)",
         ratio(ig("ideal", 4096, 1).get(dec),
               hf("dynamic", 4096, 1).get(dec)), 1.0),
    ]
    out = [{"goal": name, "ratio": r, "target": t,
            "met": None if r is None else r >= t} for name, r, t in g]
    served = [p for p in ("full", "infinigen")
              if ig(p, 32768, big).get(dec)]
    out.append({"goal": "KV larger than the GPU (ctx 32768" +
                        (f", batch {big})" if big else ")") +
                        " "
                        "served by full and infinigen",
                "ratio": None, "target": None,
                "met": None if big <= 1 else len(served) == 2})
    return out


def fmt(x, digits=1):
    return "" if x is None else f"{x:.{digits}f}"


def mb(x):
    return "" if x is None else f"{x / 1e6:.1f}"


def pct(x):
    return "" if not x else f"{100 * x:.1f}%"


def markdown(report):
    lines = [f"# GPU benchmark: {report['device']}", "",
             f"Model shape {report['model']} (dummy weights), commit "
             f"{report['commit'] or 'unknown'}, driver {report['driver']}; "
             "pinned host-to-device " +
             (f"{fmt(report['h2d_pinned_gbps'])} GB/s."
              if report["h2d_pinned_gbps"] else "not measured."),
             ] + [
        f"One-sided gather from mapped host memory "
        f"({g.get('memory', 'host_alloc')}, {g['fraction']:g} of "
        f"the rows): {fmt(g['gather_gbps'])} GB/s against a pinned copy's "
        f"{fmt(g['pinned_copy_gbps'])} GB/s" +
        ("." if g.get("first_read_gbps") is None or g["fraction"] != 1 else
         f"; its first read of every row {fmt(g['first_read_gbps'])} GB/s" +
         ("" if g.get("first_copy_gbps") is None else
          f" (the copy engine's {fmt(g['first_copy_gbps'])} GB/s)") +
         f", after {fmt(g.get('make_ms'), 0)} ms to allocate, register" +
         (", touch" if g.get("memory") == "registered_touched" else "") +
         f" and write the rows ({g.get('huge_page_bytes', 0) >> 20} MiB in "
         "huge pages).")
        for g in report.get("gather", [])] + [
        f"Prefill attention ({f['heads']} heads x {f['head_dim']} dims, "
        f"{f['chunk']} queries after {f['prefix']} rows, fp16 K and V): "
        f"{fmt(f['tflops'])} TFLOP/s on tensor cores with the scores in "
        f"registers, {fmt(f['wmma_tflops'])} through shared memory (WMMA)."
        for f in report.get("flash", [])] + [
             "", "Decode tok/s is the mean over every step, the first after "
             "the prompt included; TTFT the seconds a prompt alone waits for "
             "its first token (batch 1).",
             "", "| system | policy | reads | ctx | batch | decode tok/s | "
             "p50 ms/step | first step ms | TTFT s | "
             "prefill tok/s | fetch GB/s (wait) | fetch GB/s (decode) | "
             "fetched | MB/step | row cache hits | KV > GPU | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
             "---|---|"]
    for r in report["runs"]:
        status = ("refused: " + r.get("reason", "") if r["refused"] else
                  "timed out" if r.get("timed_out") else
                  "skipped" if r.get("skipped") else "ok")
        frac = r["fetch_fraction"]
        reads = ("" if r["system"] != "infinigen" or r["policy"] == "ideal"
                 else "one-sided" if r.get("direct_reads") else "gather")
        lines.append(
            f"| {r['system']} | {r['policy']} | {reads} | {r['ctx']} | "
            f"{r['batch']} | {fmt(r['decode_tokens_per_s'], 2)} | "
            f"{fmt(r.get('p50_ms'))} | {fmt(r.get('first_step_ms'))} | "
            f"{fmt(r.get('ttft_s'), 2)} | "
            f"{fmt(r['prefill_tokens_per_s'], 0)} | "
            f"{'' if r.get('direct_reads') else fmt(r['fetch_gbps'], 2)} | "
            f"{fmt(r.get('decode_fetch_gbps'), 2)} "
            f"| {'' if frac is None else f'{100 * frac:.1f}%'} | "
            f"{mb(r.get('bytes_per_step'))} | {pct(r.get('row_cache_hit_rate'))}"
            f" | {'yes' if r['kv_exceeds_gpu'] else 'no'} | {status} |")
    lines += ["", "| goal | ratio | met |", "|---|---|---|"]
    for g in report["goals"]:
        met = "not measured" if g["met"] is None else \
            ("yes" if g["met"] else "no")
        lines.append(f"| {g['goal']} | {fmt(g['ratio'], 2)} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("out_dir", help="gpu_bench.sh's OUT_DIR")
    ap.add_argument("--model_config", default="llama-2-7b",
                    help="the model shape the runs used")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.out_dir):
        ap.error(f"{args.out_dir} is not a directory")
    config = hf_baseline.load_config(args.model_config)
    device = (read(os.path.join(args.out_dir, "device.csv")).strip()
              or "none,none,0").split(",")
    name, driver = device[0].strip(), device[1].strip()
    gpu_bytes = int(float(device[2] or 0)) * 2**20 if len(device) > 2 else 0
    h2d = [j.get("pinned_gbps") for j in
           json_lines(read(os.path.join(args.out_dir, "runs", "h2d.out")))]
    runs = collect(args.out_dir, config, gpu_bytes)
    report = {"device": name, "driver": driver,
              "commit": read(os.path.join(args.out_dir, "commit.txt")).strip(),
              "model": args.model_config,
              "h2d_pinned_gbps": max([x for x in h2d if x] or [0]) or None,
              "gather": json_lines(read(os.path.join(args.out_dir, "runs",
                                                     "gather.out"))),
              "flash": json_lines(read(os.path.join(args.out_dir, "runs",
                                                    "flash.out"))),
              "runs": runs}
    report["goals"] = goals(runs, report["h2d_pinned_gbps"])
    with open(os.path.join(args.out_dir, "gpu_bench.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(os.path.join(args.out_dir, "gpu_bench.md"), "w") as f:
        f.write(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
