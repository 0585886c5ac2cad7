#!/usr/bin/env python3
"""The infinigen command line as a user meets it: output on stdout only,
--help everywhere, one clear line and a non-zero exit for bad input.

Usage: cli_test.py INFINIGEN STORIES260K.bin TOK512.bin TEXT KV_MEMORY_SERVER
"""
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import unittest

BIN, MODEL, TOK, TEXT, SERVER = sys.argv[1:6]
STORY = ("Once upon a time, there was a little girl named Lily. She loved to "
         "play outside in the park. One day, she saw a big, red ball.")


def run(*args, timeout=120):
    return subprocess.run([BIN, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout)


class Cli(unittest.TestCase):
    def test_generate_greedy_prints_the_known_story_and_nothing_else(self):
        r = run("generate", f"--model={MODEL}", f"--tokenizer={TOK}",
                "--prompt=Once upon a time", "--max_new_tokens=60",
                "--temperature=0", "--backend=cpu")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(r.stdout.startswith(STORY), r.stdout)
        self.assertNotIn("INFO", r.stdout)

    def test_generate_json_carries_the_continuation_and_the_fetch(self):
        r = run("generate", f"--model={MODEL}", f"--tokenizer={TOK}",
                "--prompt=Once upon a time", "--max_new_tokens=60",
                "--temperature=0", "--backend=cpu", "--json",
                "--policy=oracle", "--target_fetch=1.0")
        self.assertEqual(r.returncode, 0, r.stderr)
        out = r.stdout.strip().splitlines()
        j = json.loads(out[-1])
        # Every row fetched: the text is the ideal run's, in the JSON too.
        self.assertEqual("Once upon a time" + j["text"],
                         "\n".join(out[:-1]))
        self.assertTrue(("Once upon a time" + j["text"]).startswith(STORY))
        self.assertEqual(j["policy"], "oracle")
        self.assertEqual(j["fetch_fraction_mean"], 1.0)
        self.assertEqual(j["generated_tokens"], 60)

    def test_generate_watches_the_rows_of_a_string_of_the_prompt(self):
        prompt = "The key is 7491. Once upon a time, there was a dog."
        base = ["generate", f"--model={MODEL}", f"--tokenizer={TOK}",
                f"--prompt={prompt}", "--max_new_tokens=20",
                "--temperature=0", "--backend=cpu", "--json"]
        full = run(*base, "--policy=full", "--watch_text=7491,dog")
        self.assertEqual(full.returncode, 0, full.stderr)
        j = json.loads(full.stdout.strip().splitlines()[-1])
        self.assertGreater(j["watched_tokens"], 1)
        self.assertEqual(j["watched_recall"], 1.0)  # full reads every row
        self.assertTrue(j["watched_recall_per_layer"])
        self.assertTrue(all(r == 1.0 for r in j["watched_recall_per_layer"]))
        some = run(*base, "--policy=oracle", "--target_fetch=0.5",
                   "--watch_text=7491,dog")
        self.assertEqual(some.returncode, 0, some.stderr)
        k = json.loads(some.stdout.strip().splitlines()[-1])
        self.assertEqual(k["watched_tokens"], j["watched_tokens"])
        self.assertLess(k["watched_recall"], 1.0)
        bad = run(*base, "--policy=full", "--watch_text=elephant")
        self.assertEqual(bad.returncode, 2)
        self.assertIn("--watch_text 'elephant' does not occur", bad.stderr)
        self.assertEqual(bad.stdout, "")

    def test_help_on_every_command(self):
        for cmd in ["generate", "perplexity", "skew", "bench-decode", "serve"]:
            r = run(cmd, "--help")
            self.assertEqual(r.returncode, 0, cmd)
            self.assertIn(cmd, r.stdout + r.stderr)
            self.assertIn("--model", r.stdout + r.stderr, cmd)
        for cmd, flag in (("kv-check", "--kv_service"),
                          ("health", "--address")):
            r = run(cmd, "--help")
            self.assertEqual(r.returncode, 0, cmd)
            self.assertIn(flag, r.stdout, cmd)
        r = run("--help")
        self.assertEqual(r.returncode, 0)
        for cmd in ("generate", "kv-check", "health"):
            self.assertIn(cmd, r.stdout + r.stderr)

    def test_help_lists_the_policies_with_their_flags(self):
        r = run("generate", "--help")
        self.assertEqual(r.returncode, 0)
        policies = r.stdout[r.stdout.index("Policies (--policy):"):]
        for name in ["ideal", "full", "infinigen", "h2o", "int4", "oracle",
                     "quest"]:
            self.assertRegex(policies, rf"\n  {name} +\S", name)
        quest = policies[policies.index("  quest "):]
        self.assertIn("flags: --budget --target_fetch", quest)
        self.assertIn("--page_tokens", quest)
        # A command without --policy lists none.
        self.assertNotIn("Policies (--policy):", run("skew", "--help").stdout)

    def test_flags_the_policy_ignores_are_warned_about(self):
        base = ["generate", f"--model={MODEL}", f"--tokenizer={TOK}",
                "--prompt=Once upon a time", "--max_new_tokens=4",
                "--temperature=0", "--backend=cpu"]
        r = run(*base, "--policy=h2o", "--page_tokens=8", "--budget=0.5")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("--page_tokens has no effect on h2o: it sets options "
                      "of quest", r.stderr)
        self.assertNotIn("--budget has no effect", r.stderr)
        r = run(*base, "--kv_service=tcp://127.0.0.1:1", "--alpha=2")
        self.assertEqual(r.returncode, 0, r.stderr)  # ideal: nothing to reach
        self.assertIn("--kv_service has no effect on ideal", r.stderr)
        self.assertIn("--alpha has no effect on ideal: it sets options of "
                      "infinigen", r.stderr)
        r = run("bench-decode", f"--model={MODEL}", "--ctx=16",
                "--decode_tokens=2", "--policy=full,quest", "--page_tokens=8",
                "--backend=cpu")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("has no effect", r.stderr)  # quest reads it

    def test_dummy_weights_need_no_model_file(self):
        tiny = os.path.join(os.path.dirname(TEXT), "hf_tiny_llama")
        r = run("bench-decode", "--load_format=dummy", f"--model_config={tiny}",
                "--ctx=32", "--decode_tokens=4", "--policy=ideal,full",
                "--backend=cpu", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        runs = [json.loads(l) for l in r.stdout.splitlines()
                if l.startswith("{")]
        self.assertEqual([j["policy"] for j in runs], ["ideal", "full"])
        for j in runs:
            self.assertEqual(j["model"], f"dummy:{tiny}")
            self.assertGreater(j["tokens_per_s"], 0)
            self.assertGreater(j["prefill_tokens_per_s"], 0)
        self.assertGreater(runs[1]["fetch_gbps"], 0)
        for args, words in [
                (["generate", "--load_format=dummy",
                  "--model_config=llama-2-7b", "--prompt=x"],
                 ["dummy has no tokenizer"]),
                (["bench-decode", "--load_format=dummy", "--ctx=8"],
                 ["needs --model_config", "llama-2-7b, llama-3-8b, opt-13b"]),
                (["bench-decode", "--load_format=dummy",
                  "--model_config=llama-9b", "--ctx=8"],
                 ["'llama-9b' is neither a known model"]),
                (["bench-decode", f"--model={MODEL}",
                  "--model_config=llama-2-7b", "--ctx=8"],
                 ["--model_config applies to --load_format=dummy"]),
                (["bench-decode", "--load_format=gguf", f"--model={MODEL}"],
                 ["--load_format must be auto or dummy"])]:
            self.assert_one_line_failure(run(*args), 2, words)

    def test_a_taken_port_is_one_line_with_the_reason(self):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            base = ["serve", f"--model={MODEL}", f"--tokenizer={TOK}",
                    "--backend=cpu"]
            for flags in ([f"--listen=127.0.0.1:{port}"],
                          ["--listen=127.0.0.1:0",
                           f"--http_listen=127.0.0.1:{port}"]):
                r = run(*base, *flags, timeout=60)
                self.assert_one_line_failure(
                    r, 1, [f"127.0.0.1:{port}", "Address already in use"])
            # The metrics port of both binaries, and the memory node's own.
            for args in ([SERVER, f"--listen=127.0.0.1:{port}"],
                         [SERVER, "--listen=127.0.0.1:0",
                          f"--metrics_listen=127.0.0.1:{port}"],
                         [BIN, *base, "--listen=127.0.0.1:0",
                          f"--metrics_listen=127.0.0.1:{port}"]):
                r = subprocess.run(args, capture_output=True, text=True,
                                   timeout=60)
                self.assert_one_line_failure(
                    r, 1, [f"127.0.0.1:{port}", "Address already in use"])

    def test_a_refused_connection_fails_at_once_naming_the_node(self):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))  # two ports nobody listens on
            b.bind(("127.0.0.1", 0))
            port, other = a.getsockname()[1], b.getsockname()[1]
        missing = os.path.join(tempfile.gettempdir(),
                               f"cli_test_no_node_{os.getpid()}.sock")
        for address, words in (
                (f"tcp://127.0.0.1:{port}", ["refused"]),
                (f"unix:{missing}", ["No such file"]),
                (f"shm:unix:{missing}", ["shm data plane", "No such file"]),
                (f"tcp://127.0.0.1:{port},tcp://127.0.0.1:{other}",
                 ["memory node", "refused"])):
            start = time.monotonic()
            r = run("generate", f"--model={MODEL}", f"--tokenizer={TOK}",
                    "--prompt=Once", "--policy=full", "--backend=cpu",
                    f"--kv_service={address}", "--max_new_tokens=3")
            elapsed = time.monotonic() - start
            node = address.split(",")[0].replace("shm:unix:", "")
            self.assert_one_line_failure(r, 1, [node, *words])
            # No connect timeout waited out (the process itself takes
            # tens of milliseconds).
            self.assertLess(elapsed, 1.0, address)

    def test_infinigen_needs_no_skew_and_calibrates_once_per_model(self):
        """--policy=infinigen alone, on a one-word prompt: calibrated on
        the text the binary carries, kept in --skew_cache_dir and read from
        there the next time, with the same continuation."""
        d = tempfile.mkdtemp(prefix="cli_skew_cache_")
        try:
            args = ["generate", f"--model={MODEL}", f"--tokenizer={TOK}",
                    "--prompt=Once", "--policy=infinigen", "--backend=cpu",
                    "--max_new_tokens=12", "--temperature=0",
                    f"--skew_cache_dir={d}"]
            first = run(*args)
            self.assertEqual(first.returncode, 0, first.stderr)
            self.assertIn("calibrating InfiniGen on", first.stderr)
            self.assertIn("calibrating InfiniGen 100% 15/15 steps (", first.stderr)
            self.assertIn("--target_fetch=0.1", first.stderr)
            kept = [f for f in os.listdir(d) if f.endswith(".skew")]
            self.assertEqual(len(kept), 1, os.listdir(d))
            again = run(*args)
            self.assertEqual(again.returncode, 0, again.stderr)
            self.assertIn("calibration from " + os.path.join(d, kept[0]),
                          again.stderr)
            self.assertEqual(again.stdout, first.stdout)
            self.assertTrue(first.stdout.startswith("Once"), first.stdout)
            # Other speculation settings are another calibration.
            run(*args, "--partial_ratio=0.5")
            self.assertEqual(
                len([f for f in os.listdir(d) if f.endswith(".skew")]), 2)
            # Too little calibration text says what to do.
            r = run(*args, "--calibration_tokens=4")
            self.assert_one_line_failure(
                r, 2, ["too few to calibrate", "--calibration_tokens",
                       "--skew="])
            # A cache directory that cannot be written: calibrated anyway.
            blocked = os.path.join(d, "file")
            open(blocked, "w").close()
            r = run(*args[:-1], f"--skew_cache_dir={blocked}/sub")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("could not keep the calibration", r.stderr)
            self.assertEqual(r.stdout, first.stdout)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def assert_one_line_failure(self, r, code, words):
        self.assertEqual(r.returncode, code, r.stderr)
        self.assertEqual(r.stdout, "")
        # Informational log lines ("I file:line] ...") may come first; the
        # failure itself is one line.
        lines = [l for l in r.stderr.splitlines()
                 if l.strip() and not l.startswith("I ")]
        self.assertEqual(len(lines), 1, r.stderr)
        for w in words:
            self.assertIn(w, lines[0])

    def test_prompt_file_is_the_prompt_and_errors_are_one_line(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "prompt.txt")
            with open(path, "w") as f:
                f.write("Once upon a time")
            common = [f"--model={MODEL}", f"--tokenizer={TOK}",
                      "--max_new_tokens=30", "--temperature=0",
                      "--backend=cpu"]
            a = run("generate", *common, "--prompt=Once upon a time")
            b = run("generate", *common, f"--prompt_file={path}")
            self.assertEqual(b.returncode, 0, b.stderr)
            self.assertEqual(a.stdout, b.stdout)
            for bad, want in [
                    ([f"--prompt_file={path}", "--prompt=x"],
                     "give --prompt or --prompt_file, not both"),
                    ([f"--prompt_file={os.path.join(d, 'none.txt')}"],
                     "none.txt")]:
                r = run("generate", *common, *bad)
                self.assertEqual(r.returncode, 2, r.stderr)
                last = r.stderr.strip().splitlines()[-1]
                self.assertIn(want, last)
                self.assertEqual(r.stdout, "")

    def test_openblas_runs_the_kernels_of_this_cpu(self):
        # OpenBLAS 0.3.21 gives CPUs newer than itself its SSE3 kernels; the
        # binary runs again with the kernels of the CPU's features, keeping
        # a user's own OPENBLAS_CORETYPE.
        flags = set()
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
        level = 0
        if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
            level = 3
        elif {"avx2", "fma"} <= flags:
            level = 2
        elif "avx" in flags:
            level = 1
        levels = {"prescott": 0, "sandybridge": 1, "haswell": 2, "zen": 2,
                  "skylakex": 3, "cooperlake": 3, "sapphirerapids": 3}

        def core(extra_env):
            env = dict(os.environ, INFINIGEN_LOG_LEVEL="debug")
            env.pop("OPENBLAS_CORETYPE", None)
            env.update(extra_env)
            r = subprocess.run(
                [BIN, "generate", f"--model={MODEL}", f"--tokenizer={TOK}",
                 "--max_new_tokens=4", "--temperature=0", "--backend=cpu"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=env, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertTrue(r.stdout.startswith("Once upon a time, there"),
                            r.stdout)
            for line in r.stderr.splitlines():
                if "OpenBLAS kernels: " in line:
                    return line.split("OpenBLAS kernels: ")[1].strip()
            self.fail(r.stderr)

        chosen = core({})
        self.assertGreaterEqual(levels.get(chosen.lower(), 0), level, chosen)
        self.assertEqual(core({"OPENBLAS_CORETYPE": "Prescott"}), "Prescott")

    def test_unknown_flag_and_command(self):
        r = run("generate", "--no_such_flag=1")
        self.assert_one_line_failure(r, 2, ["unknown flag --no_such_flag"])
        r = run("frobnicate")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("frobnicate", r.stderr)

    def test_flag_typos_and_bad_values_are_one_line_usage_errors(self):
        # Both binaries: exit 2, one line, the nearest flag for a typo.
        r = run("generate", f"--model={MODEL}", "--max_new_tokns=3")
        self.assert_one_line_failure(
            r, 2, ["infinigen generate:", "unknown flag --max_new_tokns",
                   "did you mean --max_new_tokens?"])
        r = run("perplexity", "--ctx=abc")
        self.assert_one_line_failure(r, 2, ["--ctx", "abc"])
        r = run("generate", "--max_new_tokens")
        self.assert_one_line_failure(r, 2, ["--max_new_tokens needs a value"])
        for args, words in ((["--listn=127.0.0.1:0"],
                             ["kv_memory_server:", "unknown flag --listn",
                              "did you mean --listen?"]),
                            (["--capacity_bytes=xyz"],
                             ["--capacity_bytes", "xyz"])):
            r = subprocess.run([SERVER, *args], capture_output=True,
                               text=True, timeout=60)
            self.assert_one_line_failure(r, 2, words)
        # The forms that stay valid: --flag value, --noflag for a boolean.
        r = run("generate", "--model", MODEL, f"--tokenizer={TOK}",
                "--prompt=Once upon a time", "--max_new_tokens", "3",
                "--nojson")
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_missing_model_file(self):
        r = run("generate", "--model=/nonexistent/model.bin",
                f"--tokenizer={TOK}", "--max_new_tokens=2")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("/nonexistent/model.bin", r.stderr)
        self.assertEqual(r.stdout, "")

    def test_truncated_model_file_names_the_file(self):
        with tempfile.TemporaryDirectory() as d:
            bad = os.path.join(d, "truncated.bin")
            with open(MODEL, "rb") as f, open(bad, "wb") as g:
                g.write(f.read(1000))
            r = run("generate", f"--model={bad}", f"--tokenizer={TOK}",
                    "--max_new_tokens=2")
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("truncated.bin", r.stderr)

    def test_backend_flag(self):
        r = run("generate", f"--model={MODEL}", f"--tokenizer={TOK}",
                "--max_new_tokens=2", "--backend=tpu")
        self.assert_one_line_failure(r, 2, ["--backend", "tpu"])
        # cuda: works where a device answers, else one clear line.
        r = run("generate", f"--model={MODEL}", f"--tokenizer={TOK}",
                "--prompt=Once upon a time", "--max_new_tokens=60",
                "--temperature=0", "--backend=cuda")
        if r.returncode == 0:
            self.assertTrue(r.stdout.startswith("Once upon a time"))
        else:
            self.assert_one_line_failure(r, 1, ["CUDA"])
        # auto never fails for want of a GPU.
        r = run("generate", f"--model={MODEL}", f"--tokenizer={TOK}",
                "--prompt=Once upon a time", "--max_new_tokens=60",
                "--temperature=0", "--backend=auto")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(r.stdout.startswith("Once upon a time"))

    def test_perplexity_json_is_the_last_line(self):
        r = run("perplexity", f"--model={MODEL}", f"--tokenizer={TOK}",
                f"--text={TEXT}", "--ctx=128", "--max_windows=2", "--json",
                "--backend=cpu")
        self.assertEqual(r.returncode, 0, r.stderr)
        last = json.loads(r.stdout.strip().splitlines()[-1])
        self.assertEqual(last["tokens"], 2 * 127)
        self.assertGreater(last["ppl"], 1.0)
        self.assertAlmostEqual(last["ppl"], 2.718281828 ** last["nll"],
                               delta=1e-3 * last["ppl"])
        # Progress over the tokens scored (plain lines: stderr is a pipe),
        # and each window's running perplexity.
        self.assertIn("perplexity 100% 254/254 tokens (", r.stderr)
        self.assertNotIn("\r", r.stderr)
        self.assertIn("perplexity: window 2/2  tokens 254  ppl ", r.stderr)
        # Teacher-forced: only the tokens after the dense prefix count.
        r = run("perplexity", f"--model={MODEL}", f"--tokenizer={TOK}",
                f"--text={TEXT}", "--ctx=128", "--max_windows=1",
                "--prompt_tokens=28", "--policy=full", "--backend=cpu")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("perplexity 100% 100/100 tokens (", r.stderr)

    def test_target_fetch_sets_the_budget_or_says_why_not(self):
        base = ["perplexity", f"--model={MODEL}", f"--tokenizer={TOK}",
                f"--text={TEXT}", "--ctx=128", "--max_windows=1",
                "--prompt_tokens=16", "--json", "--backend=cpu"]
        # stories260K has 5 layers: layers 0 and 1 fetch 40%, the other three
        # half their rows for a mean of 70%.
        r = run(*base, "--policy=oracle", "--target_fetch=0.7")
        self.assertEqual(r.returncode, 0, r.stderr)
        last = json.loads(r.stdout.strip().splitlines()[-1])
        self.assertAlmostEqual(last["budget"], 0.5, places=5)
        self.assertAlmostEqual(last["fetch_fraction_mean"], 0.7, delta=0.05)
        r = run(*base, "--policy=oracle", "--target_fetch=0.3")
        self.assert_one_line_failure(r, 2, ["--target_fetch", "0.4"])
        r = run(*base, "--policy=full", "--target_fetch=0.5")
        self.assert_one_line_failure(r, 2, ["not full"])
        # ideal is the local cache, not a policy: it fetches nothing.
        r = run(*base, "--policy=ideal", "--target_fetch=0.5")
        self.assert_one_line_failure(r, 2, ["ideal fetches nothing",
                                            "infinigen, h2o, oracle, quest"])

    def test_head_budgets_come_from_the_skew_files_profile(self):
        base = ["perplexity", f"--model={MODEL}", f"--tokenizer={TOK}",
                f"--text={TEXT}", "--ctx=128", "--max_windows=1",
                "--prompt_tokens=16", "--json", "--backend=cpu",
                "--target_fetch=0.7"]
        r = run(*base, "--policy=oracle", "--head_budgets=some")
        self.assert_one_line_failure(r, 2, ["--head_budgets", "some"])
        with tempfile.TemporaryDirectory() as d:
            skew = os.path.join(d, "s.skew")
            r = run("skew", f"--model={MODEL}", f"--tokenizer={TOK}",
                    f"--text={TEXT}", "--calibration_tokens=128",
                    f"--out={skew}")
            self.assertEqual(r.returncode, 0, r.stderr)
            # The profile (for adaptive budgets) comes with the matrices.
            data = open(skew, "rb").read()
            layers, kv, d_head = struct.unpack("<3i", data[8:20])
            matrices = 20 + 4 * layers * kv * d_head * d_head
            self.assertEqual(data[matrices:matrices + 8], b"IGPROF01")
            # By default infinigen under --target_fetch allocates from it;
            # uniform budgets give another result at the same fetch.
            ppl = {}
            for budgets in ["auto", "uniform"]:
                r = run(*base, "--policy=infinigen", f"--skew={skew}",
                        f"--head_budgets={budgets}")
                self.assertEqual(r.returncode, 0, r.stderr)
                last = json.loads(r.stdout.strip().splitlines()[-1])
                self.assertAlmostEqual(last["fetch_fraction_mean"], 0.7,
                                       delta=0.05)
                ppl[budgets] = last["ppl"]
            self.assertNotEqual(ppl["auto"], ppl["uniform"])
            # A file written before the profile existed: auto falls back to
            # uniform budgets and says so; adaptive is refused.
            old = os.path.join(d, "old.skew")
            with open(old, "wb") as f:
                f.write(data[:matrices])
            r = run(*base, "--policy=infinigen", f"--skew={old}")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("no head profile", r.stderr)
            last = json.loads(r.stdout.strip().splitlines()[-1])
            self.assertEqual(last["ppl"], ppl["uniform"])
            r = run(*base, "--policy=infinigen", f"--skew={old}",
                    "--head_budgets=adaptive")
            self.assert_one_line_failure(r, 2, ["head profile", old])

    def test_speculation_flags_resolve_auto_and_reject_bad_values(self):
        base = ["perplexity", f"--model={MODEL}", f"--tokenizer={TOK}",
                f"--text={TEXT}", "--ctx=128", "--max_windows=1",
                "--prompt_tokens=16", "--json", "--backend=cpu",
                "--policy=infinigen"]
        for flag, value in [("--partial_ratio", "1.5"),
                            ("--partial_ratio", "most"),
                            ("--speculate_from", "nowhere"),
                            ("--partial_key_bits", "8"),
                            ("--dense_layers", "-1"),
                            ("--dense_layers", "some")]:
            r = run(*base, f"{flag}={value}")
            self.assert_one_line_failure(r, 2, [flag, value])
            r = run("skew", f"--model={MODEL}", f"--tokenizer={TOK}",
                    f"--text={TEXT}", "--out=/dev/null", f"{flag}={value}")
            self.assert_one_line_failure(r, 2, [flag, value])
        # auto: under a fetch target (infinigen's default, 0.1) all columns
        # from after the attention and no dense layer, else the paper's
        # speculation with layers 0 and 1 whole; 4-bit partial keys either
        # way.
        want = {(): (1.0, "post_attention", 4, 0),
                ("--target_fetch=0",): (0.3, "layer_input", 4, 2),
                ("--budget=0.3",): (0.3, "layer_input", 4, 2),
                ("--target_fetch=0.7",): (1.0, "post_attention", 4, 0),
                ("--target_fetch=0.7", "--partial_ratio=0.5",
                 "--speculate_from=layer_input", "--partial_key_bits=32"):
                    (0.5, "layer_input", 32, 2),
                ("--target_fetch=0.7", "--dense_layers=1"):
                    (1.0, "post_attention", 4, 1)}
        for extra, (ratio, source, bits, dense) in want.items():
            r = run(*base, *extra)
            self.assertEqual(r.returncode, 0, r.stderr)
            last = json.loads(r.stdout.strip().splitlines()[-1])
            self.assertEqual((last["partial_ratio"], last["speculate_from"],
                              last["partial_key_bits"], last["dense_layers"]),
                             (ratio, source, bits, dense), extra)
        # With no dense layer a target below what layers 0 and 1 fetch
        # alone (40% of stories260K's 5) lands; more dense layers than the
        # model has are refused.
        r = run(*base, "--target_fetch=0.3")
        self.assertEqual(r.returncode, 0, r.stderr)
        last = json.loads(r.stdout.strip().splitlines()[-1])
        self.assertAlmostEqual(last["fetch_fraction_mean"], 0.3, delta=0.05)
        r = run(*base, "--dense_layers=6")
        self.assert_one_line_failure(r, 2, ["--dense_layers", "6", "5 layers"])

    def test_bench_decode_rejects_a_context_beyond_the_model(self):
        r = run("bench-decode", f"--model={MODEL}", "--ctx=100000",
                "--decode_tokens=4", "--policy=ideal")
        self.assert_one_line_failure(r, 2, ["context"])

    def test_bench_decode_reports_json_per_policy(self):
        r = run("bench-decode", f"--model={MODEL}", "--ctx=64",
                "--decode_tokens=4", "--batch=2", "--policy=ideal,full",
                "--json", "--backend=cpu")
        self.assertEqual(r.returncode, 0, r.stderr)
        rows = [json.loads(l) for l in r.stdout.splitlines()
                if l.startswith("{")]
        self.assertEqual([x["policy"] for x in rows], ["ideal", "full"])
        self.assertEqual(rows[0]["backend"], "cpu")
        self.assertEqual(rows[0]["bytes_fetched_per_token"], 0)
        self.assertGreater(rows[1]["bytes_fetched_per_token"], 0)

    def test_bench_decode_reports_the_row_caches_hits(self):
        common = [f"--model={MODEL}", f"--tokenizer={TOK}", f"--text={TEXT}",
                  "--ctx=120", "--decode_tokens=6", "--json", "--backend=cpu",
                  "--policy=infinigen"]
        rows = {}
        for cache in ("0", "0.5"):
            r = run("bench-decode", *common, f"--row_cache={cache}")
            self.assertEqual(r.returncode, 0, r.stderr)
            rows[cache] = json.loads(r.stdout.strip().splitlines()[-1])
        on, off = rows["0.5"], rows["0"]
        self.assertEqual(off["row_cache_hit_rate"], 0)
        self.assertEqual(off["row_cache_step_hit_rate"], [])
        self.assertEqual(off["row_cache_bytes"], 0)
        self.assertGreater(on["row_cache_hit_rate"], 0)
        self.assertLessEqual(on["row_cache_hit_rate"], 1)
        # Every step looks rows up; the first holds none yet.
        self.assertEqual(len(on["row_cache_step_hit_rate"]), 6)
        self.assertEqual(on["row_cache_step_hit_rate"][0], 0)
        self.assertEqual(len(on["row_cache_layer_hit_rate"]), 5)
        self.assertGreater(on["row_cache_bytes"], 0)
        # From the second step, each layer's share selected again.
        overlap = on["selection_overlap_step_layer"]
        self.assertEqual(len(overlap), 5)
        self.assertTrue(all(len(s) == 5 for s in overlap))
        self.assertTrue(all(0 <= x <= 1 for s in overlap for x in s))
        self.assertGreater(max(x for s in overlap for x in s), 0)
        self.assertEqual(off["selection_overlap_step_layer"], [])
        self.assertEqual(on["row_cache_replacement"], "recency")
        # By frequency: the same selection, held and replaced otherwise.
        r = run("bench-decode", *common, "--row_cache=0.05",
                "--row_cache_replacement=frequency")
        self.assertEqual(r.returncode, 0, r.stderr)
        freq = json.loads(r.stdout.strip().splitlines()[-1])
        self.assertEqual(freq["row_cache_replacement"], "frequency")
        self.assertEqual(freq["fetch_fraction_mean"], on["fetch_fraction_mean"])
        self.assertGreater(freq["row_cache_hit_rate"], 0)
        r = run("bench-decode", *common, "--row_cache_replacement=lfu")
        self.assert_one_line_failure(r, 2, ["--row_cache_replacement", "lfu"])
        # The same selection; fewer rows and bytes move.
        self.assertEqual(on["fetch_fraction_mean"], off["fetch_fraction_mean"])
        self.assertLess(on["rows_fetched_per_token"],
                        off["rows_fetched_per_token"])
        self.assertAlmostEqual(
            on["bytes_fetched_per_token"] / off["bytes_fetched_per_token"],
            on["rows_fetched_per_token"] / off["rows_fetched_per_token"])
        r = run("bench-decode", *common, "--row_cache=2")
        self.assert_one_line_failure(r, 2, ["--row_cache", "2"])

    def test_worker_kv_limit_refuses_ideal_and_serves_full_and_infinigen(self):
        common = [f"--model={MODEL}", f"--tokenizer={TOK}", f"--text={TEXT}",
                  "--ctx=200", "--decode_tokens=4", "--batch=4", "--json",
                  "--backend=cpu"]
        # Without the row cache, which keeps fetched rows on the worker by
        # choice (--row_cache; under a limit it takes what is left).
        r = run("bench-decode", *common, "--policy=ideal,full,infinigen",
                "--row_cache=0")
        self.assertEqual(r.returncode, 0, r.stderr)
        # Progress with the time left: every prefilled sequence, and the
        # decode steps (at least their end).
        self.assertIn("bench-decode full: prefilled sequence 4/4 (", r.stderr)
        self.assertIn("bench-decode infinigen 100% 4/4 steps (", r.stderr)
        self.assertIn("s left)", r.stderr)
        rows = {x["policy"]: x for x in
                (json.loads(l) for l in r.stdout.splitlines()
                 if l.startswith("{"))}
        ideal = rows["ideal"]["worker_kv_bytes"]
        # 4 sequences x 5 layers x 4 KV heads x 204 positions x 8, K and V.
        self.assertEqual(ideal, 4 * 5 * 4 * 204 * 8 * 2 * 4)
        self.assertEqual(rows["ideal"]["memory_node_bytes"], 0)
        for policy in ["full", "infinigen"]:
            self.assertLess(rows[policy]["worker_kv_bytes"], ideal)
            # The node holds every sequence's fp16 rows.
            self.assertEqual(rows[policy]["memory_node_bytes"],
                             4 * 5 * 4 * 204 * 8 * 2 * 2)
            self.assertGreater(rows[policy]["peak_rss_bytes"], 0)
        limit = f"--max_worker_kv_bytes={ideal - 1}"
        r = run("bench-decode", *common, "--policy=ideal", limit)
        self.assert_one_line_failure(
            r, 1, ["policy ideal needs", "--max_worker_kv_bytes"])
        # infinigen with the paper's partial keys (30% of the columns):
        # under the default fetch target it keeps every column's 4-bit
        # partial key, which on this 8-dimension model is about ideal's
        # size.
        r = run("bench-decode", *common, "--policy=full,infinigen", limit,
                "--target_fetch=0")
        self.assertEqual(r.returncode, 0, r.stderr)
        served = [json.loads(l) for l in r.stdout.splitlines()
                  if l.startswith("{")]
        self.assertEqual([x["policy"] for x in served], ["full", "infinigen"])
        # infinigen's row cache took what the limit left, if anything.
        for x in served:
            self.assertLess(x["worker_kv_bytes"], ideal)
        r = run("bench-decode", *common, "--policy=full",
                "--max_worker_kv_bytes=-5")
        self.assert_one_line_failure(r, 2, ["--max_worker_kv_bytes"])

    def test_memory_server_gather_threads_flag(self):
        r = subprocess.run([SERVER, "--help"], capture_output=True, text=True,
                           timeout=60)
        self.assertIn("--gather_threads", r.stdout + r.stderr)
        for bad in ("-1", "65", "many"):
            r = subprocess.run([SERVER, "--listen=127.0.0.1:0",
                                f"--gather_threads={bad}"],
                               capture_output=True, text=True, timeout=60)
            self.assertNotEqual(r.returncode, 0, bad)
            self.assertIn("gather_threads", r.stderr, bad)

    def test_kv_auth_token_reaches_the_memory_server(self):
        with tempfile.TemporaryDirectory() as d:
            token = os.path.join(d, "token")
            with open(token, "w") as f:
                f.write("s3cret-token\n")
            ready = os.path.join(d, "ready")
            server = subprocess.Popen(
                [SERVER, "--listen=127.0.0.1:0", f"--ready_file={ready}",
                 f"--auth_token_file={token}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                for _ in range(400):
                    if os.path.exists(ready):
                        with open(ready) as f:
                            if f.read().strip():
                                break
                    self.assertIsNone(server.poll(), "server exited")
                    time.sleep(0.025)
                with open(ready) as f:
                    address = f.read().strip()
                base = ["generate", f"--model={MODEL}", f"--tokenizer={TOK}",
                        "--prompt=Once upon a time", "--max_new_tokens=60",
                        "--temperature=0", "--policy=full", "--backend=cpu",
                        f"--kv_service={address}"]
                r = run(*base, f"--kv_auth_token_file={token}")
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertTrue(r.stdout.startswith(STORY), r.stdout)
                r = run(*base)
                self.assertNotEqual(r.returncode, 0)
                self.assertIn("token", r.stderr.splitlines()[-1])
                r = run(*base, "--kv_auth_token_file=/nonexistent/token")
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("--kv_auth_token_file", r.stderr)
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=30)

    def test_kv_check_and_health_probe_a_memory_server(self):
        with tempfile.TemporaryDirectory() as d:
            token = os.path.join(d, "token")
            with open(token, "w") as f:
                f.write("probe-token\n")
            ready = os.path.join(d, "ready")
            server = subprocess.Popen(
                [SERVER, "--listen=127.0.0.1:0", f"--ready_file={ready}",
                 f"--auth_token_file={token}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                for _ in range(400):
                    if os.path.exists(ready):
                        with open(ready) as f:
                            if f.read().strip():
                                break
                    self.assertIsNone(server.poll(), "server exited")
                    time.sleep(0.025)
                with open(ready) as f:
                    address = f.read().strip()
                hostport = address[len("tcp://"):]
                r = run("health", f"--address={hostport}")
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                self.assertEqual(r.stdout, f"{hostport}: SERVING\n")
                r = run("health", f"--address={hostport}", "--service=nope")
                self.assertEqual(r.returncode, 1)
                self.assertIn("service nope", r.stdout)
                # One OK line per node, every fetched row compared.
                r = run("kv-check", f"--kv_service={address}",
                        f"--kv_auth_token_file={token}", "--check_fetches=3")
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                lines = r.stdout.splitlines()
                self.assertEqual(len(lines), 1, r.stdout)
                for line in lines:
                    self.assertTrue(line.startswith(
                        f"memory node {address}: OK, data plane tcp: "), line)
                    self.assertIn("384 rows equal to those appended", line)
                # Without the token: FAILED with the node's refusal, exit 1.
                r = run("kv-check", f"--kv_service={address}")
                self.assertEqual(r.returncode, 1)
                self.assertIn("FAILED, UNAUTHENTICATED: open: ", r.stdout)
                r = run("kv-check", f"--kv_service={address}",
                        "--check_rows=1000")
                self.assert_one_line_failure(r, 2, ["--check_rows"])
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=30)
            # The node gone: no answer, exit 1.
            r = run("health", f"--address={hostport}", "--timeout_s=2")
            self.assertEqual(r.returncode, 1)
            self.assertIn("no answer", r.stdout)
            r = run("kv-check", f"--kv_service={address}",
                    f"--kv_auth_token_file={token}")
            self.assertEqual(r.returncode, 1)
            self.assertIn("FAILED, UNAVAILABLE", r.stdout)
        r = run("health")
        self.assert_one_line_failure(r, 2, ["--address"])


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
