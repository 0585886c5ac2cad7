"""scripts/gpu_bench.sh and its report, on the CPU: the same commands the GPU
host runs, at a tiny shape, end to end; the report's rows and goals from
made-up runs; the Transformers baseline's model presets against infinigen's.

Usage: gpu_bench_test.py GPU_BENCH_SH INFINIGEN TINY_CONFIG_DIR DUMMY_CC
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

SCRIPT, INFINIGEN, TINY, DUMMY_CC = [os.path.abspath(a) for a in sys.argv[1:5]]
BENCH = os.path.join(os.path.dirname(os.path.dirname(SCRIPT)), "bench")
sys.path.insert(0, BENCH)
import gpu_bench_report  # noqa: E402
import hf_baseline  # noqa: E402


class GpuBench(unittest.TestCase):
    def setUp(self):
        self.out = tempfile.mkdtemp(prefix="gpu_bench_test_")

    def tearDown(self):
        shutil.rmtree(self.out, ignore_errors=True)

    def load(self, name):
        with open(os.path.join(self.out, name)) as f:
            return json.load(f) if name.endswith(".json") else f.read()

    @staticmethod
    def write(path, text):
        with open(path, "w") as f:
            f.write(text)

    def test_the_presets_are_infinigens(self):
        with open(DUMMY_CC) as f:
            text = f.read()
        presets = dict(re.findall(r'\{"([a-z0-9.-]+)",\s*R"\((\{.*?\})\)"\}',
                                  text, re.S))
        self.assertEqual(set(presets), {"llama-2-7b", "llama-3-8b",
                                        "opt-13b"})
        for name, config in hf_baseline.PRESETS.items():
            self.assertEqual(json.loads(presets[name]), config, name)

    def test_cpu_run_of_every_command(self):
        r = subprocess.run(
            [SCRIPT, self.out, "--backend=cpu", f"--infinigen={INFINIGEN}",
             f"--model_config={TINY}", "--shapes=32x1,16x2", "--big=48x2",
             "--decode_tokens=4", "--budget_s=300"],
            capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stderr)
        report = self.load("gpu_bench.json")
        self.assertTrue(os.path.exists(os.path.join(self.out,
                                                    "gpu_bench.md")))
        rows = {(x["system"], x["policy"], x["ctx"], x["batch"]): x
                for x in report["runs"]}
        for ctx, batch in [(32, 1), (16, 2)]:
            for policy in ["ideal", "full", "h2o", "int4", "infinigen"]:
                row = rows[("infinigen", policy, ctx, batch)]
                self.assertFalse(row["refused"], row)
                self.assertGreater(row["decode_tokens_per_s"], 0)
                self.assertGreater(row["prefill_tokens_per_s"], 0)
                self.assertGreater(row["p50_ms"], 0)
                self.assertGreater(row["first_step_ms"], 0)
            self.assertIsNone(rows[("infinigen", "ideal", ctx, batch)]
                              ["fetch_gbps"])
            self.assertEqual(rows[("infinigen", "full", ctx, batch)]
                             ["fetch_fraction"], 1.0)
            # --target_fetch=0.1 with the skew the script calibrated once.
            self.assertLess(rows[("infinigen", "infinigen", ctx, batch)]
                            ["fetch_fraction"], 0.5)
            for cache in ["dynamic", "offloaded"]:
                row = rows[("hf-transformers", cache, ctx, batch)]
                # Without torch, or without a device for it, the run says
                # so; with both, it ran.
                if row["refused"]:
                    self.assertRegex(row["reason"],
                                     "needs torch and transformers|"
                                     "no CUDA device")
                else:
                    self.assertGreater(row["decode_tokens_per_s"], 0)
        for policy in ["ideal", "full", "infinigen"]:
            self.assertIn(("infinigen", policy, 48, 2), rows)
        self.assertEqual(len(report["goals"]), 7)

    def test_a_skew_kept_by_one_call_is_reused_by_the_next(self):
        skew = os.path.join(self.out, "kept", "dummy.skew")
        common = ["--backend=cpu", f"--infinigen={INFINIGEN}",
                  f"--model_config={TINY}", "--shapes=16x1", "--big=none",
                  "--decode_tokens=2", "--budget_s=300", f"--skew={skew}"]
        for call in ["first", "second"]:
            out = os.path.join(self.out, call)
            r = subprocess.run([SCRIPT, out, *common], capture_output=True,
                               text=True, timeout=600)
            self.assertEqual(r.returncode, 0, r.stderr)
            made = os.path.exists(os.path.join(out, "runs", "skew.cmd"))
            # The first call calibrates it; the second reads it.
            self.assertEqual(made, call == "first", r.stderr)
            self.assertEqual("reusing the skew" in r.stderr,
                             call == "second", r.stderr)
            self.assertGreater(os.path.getsize(skew), 0)
            with open(os.path.join(out, "gpu_bench.json")) as f:
                rows = {(x["system"], x["policy"]): x
                        for x in json.load(f)["runs"]}
            self.assertLess(rows[("infinigen", "infinigen")]
                            ["fetch_fraction"], 0.5)

    def test_the_host_runs_usage(self):
        # The bundle's run.sh (scripts/gpu_host_run.sh), beside gpu_bench.sh.
        run_sh = os.path.join(os.path.dirname(SCRIPT), "gpu_host_run.sh")
        r = subprocess.run(["bash", run_sh, "--help"], capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("run.sh OUT_DIR [--quick] [--sanitize]", r.stdout)
        self.assertIn("compute-sanitizer", r.stdout)
        for args in [[], [os.path.join(self.out, "r"), "--bogus"]]:
            r = subprocess.run(["bash", run_sh, *args], capture_output=True,
                               text=True, timeout=60)
            self.assertEqual(r.returncode, 2, args)
        self.assertIn("unknown flag '--bogus'", r.stderr)
        # A bad flag leaves nothing behind.
        self.assertFalse(os.path.exists(os.path.join(self.out, "r")))

    def test_bad_arguments_are_usage_errors(self):
        for args in [[], ["--budget_s=ten", self.out],
                     ["--shapes=4096", self.out], ["--bogus", self.out],
                     [self.out, self.out + "2"]]:
            r = subprocess.run([SCRIPT, *args], capture_output=True,
                               text=True, timeout=60)
            self.assertEqual(r.returncode, 2, args)
            self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
            self.assertIn("gpu_bench.sh:", r.stderr)

    def test_report_rows_and_goals(self):
        runs = os.path.join(self.out, "runs")
        os.makedirs(runs)
        self.write(os.path.join(self.out, "device.csv"),
                   "NVIDIA H100 80GB HBM3, 570.1, 81559\n")

        def put(name, cmd, out="", err="", rc=0, timed_out=False):
            base = os.path.join(runs, name)
            self.write(base + ".cmd", "\n".join(cmd) + "\n")
            self.write(base + ".out", out)
            self.write(base + ".err", err)
            self.write(base + ".meta.json", json.dumps(
                {"name": name, "rc": rc, "timed_out": timed_out,
                 "skipped": False, "seconds": 1.0}))

        def ig(policy, ctx, batch, tps, gbps=0, frac=1.0, prefill=100.0,
               decode_gbps=0, steps=(500.0, 200.0, 210.0)):
            return json.dumps({"policy": policy, "tokens_per_s": tps,
                               "prefill_tokens_per_s": prefill,
                               "fetch_gbps": gbps,
                               "decode_fetch_gbps": decode_gbps,
                               "fetch_fraction_mean": frac,
                               "p50_ms": sorted(steps)[len(steps) // 2],
                               "step_ms": list(steps),
                               "prefill_open_seconds": 2.5,
                               "prefill_append_wait_seconds": 4.0,
                               "prefill_policy_seconds": 1.5,
                               "bytes_fetched_per_token": 160e6 * frac,
                               "row_cache_hit_rate":
                                   0.8 if policy == "infinigen" else 0.0})

        put("h2d", ["h2d_bandwidth"],
            '{"pinned_gbps": 50.0}\n{"pinned_gbps": 55.0}\n')
        put("gather", ["gather_bandwidth"],
            '{"fraction": 1, "gather_gbps": 40.0, '
            '"pinned_copy_gbps": 50.0}\n'
            '{"memory": "registered_huge", "fraction": 1, '
            '"gather_gbps": 45.0, "pinned_copy_gbps": 50.0, '
            '"first_read_gbps": 20.0, "make_ms": 300.0, '
            '"huge_page_bytes": 2097152}\n'
            '{"memory": "registered_touched", "fraction": 1, '
            '"gather_gbps": 46.0, "pinned_copy_gbps": 50.0, '
            '"first_read_gbps": 44.0, "first_copy_gbps": 48.0, '
            '"make_ms": 350.0, "huge_page_bytes": 0}\n'
            '{"memory": "registered_huge", "fraction": 0.1, '
            '"gather_gbps": 44.0, "pinned_copy_gbps": 50.0, '
            '"first_read_gbps": 20.0, "make_ms": 300.0, '
            '"huge_page_bytes": 2097152}\n')
        put("flash", ["flash_attention_bench"],
            '{"heads": 32, "head_dim": 128, "chunk": 2048, "prefix": 30720, '
            '"tflops": 150.0, "wmma_tflops": 40.0}\n')
        put("ig_full", ["infinigen", "--ctx=32768", "--batch=1",
                        "--policy=full,h2o"],
            ig("full", 32768, 1, 1.0, gbps=45.0, decode_gbps=20.0) + "\n" +
            ig("h2o", 32768, 1, 3.0, frac=0.1) + "\n")
        # One-sided reads: the faster of the two full runs counts.
        put("ig_full_direct", ["infinigen", "--ctx=32768", "--batch=1",
                               "--policy=full", "--kv_direct_reads=true"],
            ig("full", 32768, 1, 2.0, gbps=900.0, decode_gbps=45.0) + "\n")
        put("ig_inf", ["infinigen", "--ctx=32768", "--batch=1",
                       "--policy=infinigen"],
            ig("infinigen", 32768, 1, 7.0, frac=0.1) + "\n")
        put("ig_ideal", ["infinigen", "--ctx=32768", "--batch=6",
                         "--policy=ideal"], "",
            "I loaded\ninfinigen: policy ideal needs 96.0 GiB\n", rc=1)
        put("hf_off", ["python3", "hf_baseline.py", "--ctx=32768",
                       "--batch=1", "--cache=offloaded"],
            json.dumps({"system": "hf-transformers", "policy": "offloaded",
                        "decode_tokens_per_s": 1.0,
                        "prefill_tokens_per_s": 10.0}) + "\n")
        put("hf_dyn", ["python3", "hf_baseline.py", "--ctx=4096",
                       "--batch=1", "--cache=dynamic"], "", "", rc=124,
            timed_out=True)
        r = subprocess.run([sys.executable,
                            os.path.join(BENCH, "gpu_bench_report.py"),
                            self.out], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        report = self.load("gpu_bench.json")
        self.assertEqual(report["device"], "NVIDIA H100 80GB HBM3")
        self.assertEqual(report["driver"], "570.1")
        self.assertEqual(report["h2d_pinned_gbps"], 55.0)
        rows = {(x["system"], x["policy"], x["ctx"], x["batch"],
                 x["direct_reads"]): x for x in report["runs"]}
        self.assertEqual(rows[("infinigen", "full", 32768, 1, True)]
                         ["decode_fetch_gbps"], 45.0)
        rows = {k[:4]: v for k, v in rows.items()}
        ideal = rows[("infinigen", "ideal", 32768, 6)]
        self.assertTrue(ideal["refused"])
        self.assertEqual(ideal["reason"],
                         "infinigen: policy ideal needs 96.0 GiB")
        # llama-2-7b at 32768 x 6: 96 GiB of fp16 KV > 80 GB.
        self.assertTrue(ideal["kv_exceeds_gpu"])
        self.assertFalse(rows[("infinigen", "full", 32768, 1)]
                         ["kv_exceeds_gpu"])
        self.assertTrue(rows[("hf-transformers", "dynamic", 4096, 1)]
                        ["timed_out"])
        goals = {g["goal"]: g for g in report["goals"]}
        fetch = goals["full's fetch >= 0.8x pinned host-to-device "
                      "(ctx 32768, batch 1; bytes fetched per second of "
                      "decoding)"]
        self.assertAlmostEqual(fetch["ratio"], 45.0 / 55.0)
        self.assertTrue(fetch["met"])
        vs_full = goals["infinigen >= 3x full (ctx 32768, batch 1)"]
        self.assertAlmostEqual(vs_full["ratio"], 3.5)
        self.assertTrue(vs_full["met"])
        vs_hf = goals["infinigen >= 3x Transformers' offloaded cache "
                      "(ctx 32768, batch 1)"]
        self.assertAlmostEqual(vs_hf["ratio"], 7.0)
        self.assertIsNone(goals["infinigen >= 3x full (ctx 8192, batch 8)"]
                          ["met"])
        md = self.load("gpu_bench.md")
        # Steady steps and the first one after the prompt apart.
        self.assertIn("| infinigen | full | one-sided | 32768 | 1 | 2.00 | "
                      "210.0 | 500.0 |", md)
        self.assertEqual(rows[("infinigen", "full", 32768, 1)]
                         ["first_step_ms"], 500.0)
        # Time to first token: a 32768-token prompt alone at 100 tokens/s.
        self.assertAlmostEqual(rows[("infinigen", "full", 32768, 1)]
                               ["ttft_s"], 327.68)
        self.assertIn("| 210.0 | 500.0 | 327.68 |", md)
        self.assertIsNone(rows[("infinigen", "ideal", 32768, 6)]["ttft_s"])
        # Where an offloaded prefill waited.
        self.assertEqual(rows[("infinigen", "full", 32768, 1)]
                         ["prefill_open_seconds"], 2.5)
        self.assertEqual(rows[("infinigen", "full", 32768, 1)]
                         ["prefill_append_wait_seconds"], 4.0)
        self.assertIn("| infinigen | full | gather | 32768 | 1 | 1.00 |", md)
        # What a step moved, and the row cache's share held.
        self.assertEqual(rows[("infinigen", "full", 32768, 1)]
                         ["prefill_policy_seconds"], 1.5)
        self.assertEqual(rows[("infinigen", "full", 32768, 1)]
                         ["row_cache_hit_rate"], 0.0)
        self.assertIn("MB/step | row cache hits |", md)
        self.assertRegex(md, r"\| infinigen \| infinigen \|[^\n]*\| 80\.0% \|")
        self.assertIn("One-sided gather from mapped host memory (host_alloc, "
                      "1 of the rows): 40.0 GB/s against a pinned copy's "
                      "50.0 GB/s.", md)
        self.assertIn("One-sided gather from mapped host memory "
                      "(registered_huge, 1 of the rows): 45.0 GB/s against a "
                      "pinned copy's 50.0 GB/s; its first read of every row "
                      "20.0 GB/s, after 300 ms to allocate, register and "
                      "write the rows (2 MiB in huge pages).", md)
        self.assertIn("(registered_touched, 1 of the rows): 46.0 GB/s against "
                      "a pinned copy's 50.0 GB/s; its first read of every row "
                      "44.0 GB/s (the copy engine's 48.0 GB/s), after 350 ms "
                      "to allocate, register, touch and write the rows (0 MiB "
                      "in huge pages).", md)
        self.assertIn("(registered_huge, 0.1 of the rows): 44.0 GB/s against "
                      "a pinned copy's 50.0 GB/s.", md)
        self.assertIn("refused: infinigen: policy ideal needs 96.0 GiB", md)
        self.assertEqual(report["flash"][0]["tflops"], 150.0)
        self.assertIn("Prefill attention (32 heads x 128 dims, 2048 queries "
                      "after 30720 rows, fp16 K and V): 150.0 TFLOP/s on "
                      "tensor cores with the scores in registers, 40.0 "
                      "through shared memory (WMMA).", md)

    def test_kv_bytes_of_the_presets(self):
        cfg = hf_baseline.PRESETS["llama-2-7b"]
        self.assertEqual(gpu_bench_report.kv_bytes(cfg, 32768, 6),
                         96 * 2**30)
        self.assertEqual(gpu_bench_report.kv_bytes(
            hf_baseline.PRESETS["llama-3-8b"], 8192, 1), 2**30)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
