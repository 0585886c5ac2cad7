#!/usr/bin/env python3
"""Prefix reuse and recovery as a user meets them: separate `infinigen
generate` processes sharing one kv_memory_server (TCP and shm), and a node
killed and restarted in the middle of a generation.

Usage: kv_reuse_test.py INFINIGEN KV_MEMORY_SERVER STORIES260K.bin TOK512.bin
Reads SmolLM2 from $INFINIGEN_ROOT/models_cache (skipped when absent) and
shared/data beside the repository (skipped when absent).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

BIN, SERVER, MODEL, TOK = sys.argv[1:5]
ROOT = os.environ.get("INFINIGEN_ROOT", ".")
SMOL = os.path.join(ROOT, "models_cache", "smollm2-135m",
                    "SmolLM2-135M-Instruct.Q4_1.gguf")
BOOK = os.path.join(ROOT, "..", "shared", "data", "pride_and_prejudice.txt")
STORY = ("Once upon a time, there was a little girl named Lily. She loved to "
         "play outside in the park. One day, she saw a big, red ball. She "
         "wanted to play with it, so she ran to her mom and asked")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """A kv_memory_server on a fixed TCP port and shm socket, so that a
    restarted one is found where the old one was."""

    def __init__(self, tmp, port):
        self.tmp, self.port = tmp, port
        self.shm = os.path.join(tmp, "node.sock")
        self.proc = None
        self.start()

    def start(self):
        ready = os.path.join(self.tmp, "ready")
        if os.path.exists(ready):
            os.remove(ready)
        self.proc = subprocess.Popen(
            [SERVER, f"--listen=127.0.0.1:{self.port}",
             f"--shm_listen=unix:{self.shm}", f"--ready_file={ready}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(800):
            if os.path.exists(ready):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"kv_memory_server exited {self.proc.returncode}")
            time.sleep(0.025)
        raise RuntimeError("kv_memory_server did not become ready")

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)

    def address(self, plane):
        return (f"tcp://127.0.0.1:{self.port}" if plane == "tcp"
                else f"shm:unix:{self.shm}")


def generate(model_args, prompt, kv, *extra, tokens=40, timeout=300):
    r = subprocess.run(
        [BIN, "generate", *model_args, f"--prompt={prompt}",
         f"--max_new_tokens={tokens}", "--temperature=0", "--backend=cpu",
         f"--kv_service={kv}", "--json", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"generate failed ({r.returncode}): {r.stderr}")
    text, _, last = r.stdout.rstrip("\n").rpartition("\n")
    return text, json.loads(last), r.stderr


class KvReuse(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="kv_reuse_test.")
        self.node = Node(self.tmp, free_port())
        self.stories = [f"--model={MODEL}", f"--tokenizer={TOK}"]

    def tearDown(self):
        self.node.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_a_second_process_reuses_the_prefix_with_the_same_output(self):
        for plane in ("tcp", "shm"):
            with self.subTest(plane=plane):
                kv = self.node.address(plane)
                shared = f"({plane}) " + STORY
                _, first, _ = generate(self.stories, shared + " Then", kv,
                                       "--policy=full")
                self.assertEqual(first["cached_tokens"], 0)
                text, second, log = generate(self.stories, shared + " Later",
                                             kv, "--policy=full")
                # 16-token blocks of the shared part, at most prompt - 1.
                self.assertGreaterEqual(second["cached_tokens"], 32, log)
                self.assertEqual(second["cached_tokens"] % 16, 0)
                self.assertLess(second["cached_tokens"], second["prompt_tokens"])
                plain, none, _ = generate(self.stories, shared + " Later", kv,
                                          "--policy=full",
                                          "--prefix_block_tokens=0")
                self.assertEqual(none["cached_tokens"], 0)
                self.assertEqual(text, plain)
                # Another policy's rows are not this one's: no reuse.
                _, int4, _ = generate(self.stories, shared + " Later", kv,
                                      "--policy=int4")
                self.assertEqual(int4["cached_tokens"], 0)

    def test_reuse_never_changes_the_text_of_any_policy(self):
        kv = self.node.address("tcp")
        for policy, extra in [("full", ()), ("quest", ()), ("oracle", ()),
                              # skew calibrated on the carried text
                              ("infinigen", ()),
                              ("infinigen", ("--target_fetch=0.5",)),
                              ("int4", ()), ("h2o", ())]:
            with self.subTest(policy=policy, extra=extra):
                prompt = f"({policy} {' '.join(extra)}) " + STORY
                first, j1, _ = generate(self.stories, prompt, kv,
                                        f"--policy={policy}", *extra)
                self.assertEqual(j1["cached_tokens"], 0)
                again, j2, log = generate(self.stories, prompt, kv,
                                          f"--policy={policy}", *extra)
                plain, j3, _ = generate(self.stories, prompt, kv,
                                        f"--policy={policy}", *extra,
                                        "--prefix_block_tokens=0")
                if policy in ("int4", "h2o"):
                    self.assertEqual(j2["cached_tokens"], 0, log)
                else:
                    self.assertGreaterEqual(j2["cached_tokens"], 32, log)
                self.assertEqual(again, plain)
                self.assertEqual(first, plain)

    def restart_mid_generation(self, *extra):
        """Runs a long generation, freezes it after its first tokens, kills
        and restarts the node, lets it go on; returns (returncode, stdout,
        stderr)."""
        args = [BIN, "generate", *self.stories, f"--prompt={STORY}",
                "--max_new_tokens=300", "--temperature=0", "--backend=cpu",
                "--policy=full", f"--kv_service={self.node.address('shm')}",
                "--json", *extra]
        worker = subprocess.Popen(args, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        try:
            seen = b""
            while len(seen) < len(STORY) + 40:
                chunk = os.read(worker.stdout.fileno(), 4096)
                self.assertTrue(chunk, "generation ended before the restart")
                seen += chunk
            worker.send_signal(signal.SIGSTOP)
            self.node.kill()
            self.node.start()
            worker.send_signal(signal.SIGCONT)
            out, err = worker.communicate(timeout=300)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        return worker.returncode, (seen + out).decode(), err.decode()

    def test_a_node_restart_mid_generation_is_recomputed(self):
        want, clean, _ = generate(self.stories, STORY, self.node.address("shm"),
                                  "--policy=full", "--prefix_block_tokens=0",
                                  tokens=300)
        self.assertGreater(clean["generated_tokens"], 100)
        code, out, err = self.restart_mid_generation()
        self.assertEqual(code, 0, err)
        text, _, last = out.rstrip("\n").rpartition("\n")
        self.assertEqual(text, want)
        self.assertEqual(json.loads(last)["kv_recoveries"], 1, err)
        self.assertEqual(err.count("recomputing"), 1, err)

    def test_with_on_kv_loss_fail_a_restart_is_one_clear_error(self):
        code, _, err = self.restart_mid_generation("--on_kv_loss=fail")
        self.assertEqual(code, 1, err)
        last = err.strip().splitlines()[-1]
        self.assertTrue(last.startswith("infinigen: "), last)
        self.assertNotIn("recomputing", err)

    def lose_node_mid_generation(self, plane, sig):
        """A long generation with --on_kv_loss=fail; `sig` to the node once
        tokens flow. Returns (exit status, seconds from the signal to the
        worker's last line, to its exit, that line)."""
        args = [BIN, "generate", *self.stories, "--prompt=Once upon a time",
                "--max_new_tokens=100000", "--max_seq_len=512",
                "--temperature=0", "--backend=cpu", "--policy=full",
                f"--kv_service={self.node.address(plane)}",
                "--on_kv_loss=fail"]
        worker = subprocess.Popen(args, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        try:
            self.assertTrue(os.read(worker.stdout.fileno(), 64))
            start = time.monotonic()
            self.node.proc.send_signal(sig)
            last, last_at = "", None
            for line in worker.stderr:
                last, last_at = line.decode().strip(), time.monotonic()
            worker.wait(timeout=60)
            return (worker.returncode, last_at - start,
                    time.monotonic() - start, last)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
            if sig == signal.SIGSTOP:
                self.node.proc.send_signal(signal.SIGCONT)

    def test_a_lost_node_is_named_in_the_last_line(self):
        for plane in ("tcp", "shm"):
            with self.subTest(plane=plane, node="hung"):
                code, line_s, exit_s, last = self.lose_node_mid_generation(
                    plane, signal.SIGSTOP)
                self.assertEqual(code, 1, last)
                # Declared lost within the fetch timeout (5 s).
                self.assertLess(line_s, 6.5, last)
                self.assertLess(exit_s, 8.0, last)
                self.assertTrue(last.startswith(
                    f"infinigen: memory node {self.node.address(plane)}: "),
                    last)
                self.assertIn("within 5s", last)
            self.node.kill()
            self.node.start()
            with self.subTest(plane=plane, node="killed"):
                code, line_s, _, last = self.lose_node_mid_generation(
                    plane, signal.SIGKILL)
                self.assertEqual(code, 1, last)
                # An opening sequence waits connect_timeout (5 s) for a
                # restarting node; any other call fails at once.
                self.assertLess(line_s, 6.5, last)
                self.assertTrue(last.startswith(
                    f"infinigen: memory node {self.node.address(plane)}: "),
                    last)
                self.assertRegex(last, "connection closed|closed the shm|"
                                 "not come back|connection refused")
            self.node.proc.wait(timeout=30)
            self.node.start()

    def test_bad_reuse_flags_are_usage_errors(self):
        for flag in ("--on_kv_loss=sometimes", "--prefix_block_tokens=-1",
                     "--prefix_cache_bytes=-5"):
            r = subprocess.run(
                [BIN, "generate", *self.stories, "--prompt=Hi",
                 "--policy=full", flag], stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, timeout=60)
            self.assertEqual(r.returncode, 2, (flag, r.stderr))
            self.assertIn(flag.split("=")[0], r.stderr)

    @unittest.skipUnless(os.path.exists(SMOL) and os.path.exists(BOOK),
                         "SmolLM2 (scripts/fetch_smollm2.sh) or shared/data absent")
    def test_smollm2_reuses_a_2000_token_prefix_over_shm(self):
        with open(BOOK, encoding="utf-8") as f:
            doc = f.read()[20000:28000]
        smol = [f"--model={SMOL}"]
        kv = self.node.address("shm")
        _, first, _ = generate(smol, doc + "\n\nQuestion: Who speaks first?",
                               kv, "--policy=full", tokens=24)
        self.assertGreaterEqual(first["prompt_tokens"], 2000)
        question = doc + "\n\nQuestion: What happens next?"
        text, second, log = generate(smol, question, kv, "--policy=full",
                                     tokens=24)
        self.assertGreaterEqual(second["cached_tokens"], 1984, log)
        plain, _, _ = generate(smol, question, kv, "--policy=full",
                               "--prefix_block_tokens=0", tokens=24)
        self.assertEqual(text, plain)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
