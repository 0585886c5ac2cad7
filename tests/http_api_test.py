#!/usr/bin/env python3
"""`infinigen serve --http_listen` as an OpenAI user meets it: the official
`openai` client and curl against the real binary, on stories260K (always)
and SmolLM2-135M-Instruct (when $INFINIGEN_ROOT/models_cache has it).

Usage: http_api_test.py INFINIGEN STORIES260K.bin TOK512.bin KV_MEMORY_SERVER
                        [GRAFANA_DASHBOARD.json]
"""
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

BIN, MODEL, TOK, KV_SERVER = sys.argv[1:5]
DASHBOARD = sys.argv[5] if len(sys.argv) > 5 else None
SMOLLM2 = os.path.join(os.environ.get("INFINIGEN_ROOT", ""), "models_cache",
                       "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf")
# A request that runs to max_tokens=500 (about 0.2 s on one core): this seed
# at temperature 2 never draws the end token.
LONG = {"prompt": "Once", "max_tokens": 500, "temperature": 2.0, "seed": 3}
# stories260K's greedy continuation of "Once upon a time".
STORY = (", there was a little girl named Lily. She loved to play outside in "
         "the park. One day, she saw a big, red ball.")
KEY = "sk-test-0123456789"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `infinigen serve` with the HTTP API; stopped by PID."""

    def __init__(self, *flags, model=MODEL, tokenizer=TOK):
        self.dir = tempfile.mkdtemp(prefix="http_api_test_")
        self.port = free_port()
        self.log_path = os.path.join(self.dir, "serve.log")
        args = [BIN, "serve", f"--model={model}", "--listen=127.0.0.1:0",
                f"--http_listen=127.0.0.1:{self.port}", "--backend=cpu",
                "--threads=1", *flags]
        if tokenizer:
            args.append(f"--tokenizer={tokenizer}")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                     stderr=self.log)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("serve exited:\n" + self.read_log())
            try:
                with urllib.request.urlopen(self.base + "/health",
                                            timeout=1) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.time() > deadline:
                raise RuntimeError("serve never became healthy")
            time.sleep(0.05)

    def client(self, key=KEY):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key,
                             max_retries=0, timeout=120)

    def read_log(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        """SIGTERM, wait, and return the log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        log = self.read_log()
        shutil.rmtree(self.dir, ignore_errors=True)
        return log


def curl(*args):
    """Returns (HTTP status, body) of a curl run."""
    r = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", *args],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=120)
    body, _, code = r.stdout.rpartition("\n")
    return int(code), body


def post(url, body, key=KEY):
    """Raw POST with urllib: (status, parsed JSON body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def start_kv_node(port, ready, *flags):
    """A kv_memory_server on 127.0.0.1:`port` (and `flags`), ready when it
    wrote `ready`; stopped by the caller."""
    if os.path.exists(ready):
        os.remove(ready)
    p = subprocess.Popen(
        [KV_SERVER, f"--listen=127.0.0.1:{port}", f"--ready_file={ready}",
         *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while not (os.path.exists(ready) and read(ready).strip()):
        if p.poll() is not None:
            raise RuntimeError("kv_memory_server exited")
        if time.time() > deadline:
            p.kill()
            raise RuntimeError("kv_memory_server never became ready")
        time.sleep(0.025)
    return p


class Stories260K(unittest.TestCase):
    """One server with a key and the chatml template for most tests."""

    @classmethod
    def setUpClass(cls):
        cls.keydir = tempfile.mkdtemp(prefix="http_api_key_")
        cls.keyfile = os.path.join(cls.keydir, "key")
        with open(cls.keyfile, "w") as f:
            f.write(KEY + "\n")
        cls.server = Server(f"--api_key_file={cls.keyfile}",
                            "--chat_template=chatml", "--max_batch=2")
        cls.client = cls.server.client()

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        shutil.rmtree(cls.keydir, ignore_errors=True)

    def test_completion_greedy_with_usage(self):
        r = self.client.completions.create(
            model="stories260K", prompt="Once upon a time", max_tokens=20,
            temperature=0)
        self.assertEqual(len(r.choices), 1)
        self.assertGreater(len(r.choices[0].text), 40)
        self.assertTrue(STORY.startswith(r.choices[0].text), r.choices[0].text)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 20)
        # The same prompt as token ids counts exactly those.
        ids = self.client.completions.create(
            model="stories260K", prompt=[1, 403, 407], max_tokens=3,
            temperature=0)
        self.assertEqual(ids.usage.prompt_tokens, 3)
        self.assertEqual(ids.usage.completion_tokens, 3)
        self.assertEqual(ids.usage.total_tokens, 6)
        self.assertGreater(r.usage.prompt_tokens, 3)
        self.assertEqual(r.usage.total_tokens,
                         r.usage.prompt_tokens + r.usage.completion_tokens)

    def test_completion_ends_at_the_end_token_with_stop(self):
        r = self.client.completions.create(
            model="stories260K", prompt="Once upon a time", max_tokens=500,
            temperature=0)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertLess(r.usage.completion_tokens, 500)
        self.assertTrue(r.choices[0].text.startswith(STORY), r.choices[0].text)

    def test_streaming_gives_the_same_text_and_usage(self):
        whole = self.client.completions.create(
            model="stories260K", prompt="Once upon a time", max_tokens=40,
            temperature=0)
        chunks = list(self.client.completions.create(
            model="stories260K", prompt="Once upon a time", max_tokens=40,
            temperature=0, stream=True,
            stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        self.assertEqual(text, whole.choices[0].text)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        self.assertEqual(finishes[-1], "length")
        self.assertTrue(all(f is None for f in finishes[:-1]))
        self.assertGreater(len(chunks), 10)  # token by token, not one piece
        self.assertEqual(chunks[-1].usage.completion_tokens, 40)
        self.assertEqual(chunks[-1].usage.prompt_tokens,
                         whole.usage.prompt_tokens)

    def test_stop_sequences_end_the_text_before_them(self):
        for stream in (False, True):
            r = self.client.completions.create(
                model="stories260K", prompt="Once upon a time",
                max_tokens=100, temperature=0, stop=["Lily", "zzz"],
                stream=stream)
            if stream:
                chunks = list(r)
                text = "".join(c.choices[0].text for c in chunks)
                finish = chunks[-1].choices[0].finish_reason
            else:
                text, finish = r.choices[0].text, r.choices[0].finish_reason
            self.assertEqual(text, ", there was a little girl named ", stream)
            self.assertEqual(finish, "stop")
        r = self.client.completions.create(
            model="stories260K", prompt="Once upon a time", max_tokens=100,
            temperature=0, stop=". ")
        self.assertEqual(r.choices[0].text,
                         ", there was a little girl named Lily")

    def test_chat_applies_the_template(self):
        messages = [{"role": "system", "content": "You tell stories."},
                    {"role": "user", "content": "Tell me about a cat."}]
        r = self.client.chat.completions.create(
            model="stories260K", messages=messages, max_tokens=12,
            temperature=0)
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertEqual(r.usage.completion_tokens, 12)
        # The chat is the completion of the ChatML text.
        chatml = ("<|im_start|>system\nYou tell stories.<|im_end|>\n"
                  "<|im_start|>user\nTell me about a cat.<|im_end|>\n"
                  "<|im_start|>assistant\n")
        c = self.client.completions.create(
            model="stories260K", prompt=chatml, max_tokens=12, temperature=0)
        self.assertEqual(r.choices[0].message.content, c.choices[0].text)
        self.assertEqual(r.usage.prompt_tokens, c.usage.prompt_tokens)
        chunks = list(self.client.chat.completions.create(
            model="stories260K", messages=messages, max_tokens=12,
            temperature=0, stream=True))
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        self.assertEqual(
            "".join(c.choices[0].delta.content or "" for c in chunks),
            r.choices[0].message.content)
        self.assertEqual(chunks[-1].choices[0].finish_reason, "length")

    def test_sampling_is_repeatable_with_a_seed(self):
        kw = dict(model="stories260K", prompt="Once upon a time",
                  max_tokens=30, temperature=1.0, top_p=0.9, seed=7)
        a = self.client.completions.create(**kw).choices[0].text
        b = self.client.completions.create(**kw).choices[0].text
        self.assertEqual(a, b)

    def test_models_and_health(self):
        models = self.client.models.list()
        self.assertEqual([m.id for m in models.data], ["stories260K"])
        code, body = curl(self.server.base + "/health")  # no key needed
        self.assertEqual(code, 200, body)
        self.assertEqual(json.loads(body)["status"], "ok")

    def test_curl_streams_server_sent_events(self):
        code, body = curl(
            "-N", self.server.base + "/v1/chat/completions",
            "-H", f"Authorization: Bearer {KEY}",
            "-H", "Content-Type: application/json",
            "-d", json.dumps({"model": "stories260K", "stream": True,
                              "max_tokens": 5,
                              "messages": [{"role": "user",
                                            "content": "Hi"}]}))
        self.assertEqual(code, 200, body)
        events = [l for l in body.split("\n\n") if l.strip()]
        self.assertTrue(all(e.startswith("data: ") for e in events), body)
        self.assertEqual(events[-1], "data: [DONE]")
        last = json.loads(events[-2][len("data: "):])
        self.assertEqual(last["object"], "chat.completion.chunk")
        self.assertEqual(last["choices"][0]["finish_reason"], "length")

    def assert_error(self, code, body, status, words=()):
        self.assertEqual(code, status, body)
        self.assertIn("error", body)
        self.assertIsInstance(body["error"]["message"], str)
        self.assertIn("type", body["error"])
        for w in words:
            self.assertIn(w, body["error"]["message"])

    def test_bad_requests_are_400_with_the_openai_error_shape(self):
        url = self.server.base + "/v1/completions"
        code, body = post(url, b"{not json")
        self.assert_error(code, body, 400, ["JSON"])
        for bad, param in [
                ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
                ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
                ({"prompt": "x", "temperature": -1}, "temperature"),
                ({"prompt": "x", "top_p": 0}, "top_p"),
                ({"prompt": "x", "n": 2}, "n"),
                ({"prompt": "x", "logprobs": 21}, "logprobs"),
                ({"prompt": "x", "logprobs": True}, "logprobs"),
                ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
                ({"prompt": "x", "echo": "yes"}, "echo"),
                ({"prompt": "x", "frequency_penalty": 2.5},
                 "frequency_penalty"),
                ({"prompt": "x", "presence_penalty": -3}, "presence_penalty"),
                ({"prompt": "x", "best_of": 3}, "best_of"),
                ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
                ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
                ({"prompt": "x", "stream": "yes"}, "stream"),
                ({}, "prompt"),
                ({"prompt": [1, 99999]}, None)]:
            code, body = post(url, {"model": "stories260K", **bad})
            self.assert_error(code, body, 400)
            if param:
                self.assertEqual(body["error"]["param"], param, bad)
        code, body = post(self.server.base + "/v1/chat/completions",
                          {"messages": [{"role": "wizard", "content": "x"}]})
        self.assert_error(code, body, 400, ["wizard"])
        code, body = post(self.server.base + "/v1/chat/completions",
                          {"messages": []})
        self.assert_error(code, body, 400, ["messages"])
        hello = [{"role": "user", "content": "hi"}]
        for bad, param, words in [
                ({"top_logprobs": 3}, "top_logprobs", ["'logprobs': true"]),
                ({"logprobs": True, "top_logprobs": 21}, "top_logprobs",
                 ["[0, 20]"]),
                ({"echo": True}, "echo", ["completions"])]:
            code, body = post(self.server.base + "/v1/chat/completions",
                              {"messages": hello, "max_tokens": 2, **bad})
            self.assert_error(code, body, 400, words)
            self.assertEqual(body["error"]["param"], param, bad)
        for bad, param in [({"tools": [{"type": "function"}]}, "tools"),
                           ({"response_format": {"type": "json_object"}},
                            "response_format")]:
            code, body = post(self.server.base + "/v1/chat/completions",
                              {"messages": hello, "max_tokens": 2, **bad})
            self.assert_error(code, body, 400, ["not supported", param])
            self.assertEqual(body["error"]["param"], param, bad)
        # Their "off" values are what every client sends by default.
        for off in [{"logprobs": False, "top_logprobs": 0},
                    {"frequency_penalty": 0, "presence_penalty": 0.0,
                     "logit_bias": {}, "tools": [], "tool_choice": "none"}]:
            code, body = post(self.server.base + "/v1/chat/completions",
                              {"messages": hello, "max_tokens": 2, **off})
            self.assertEqual(code, 200, (off, body))
        code, body = post(url, {"prompt": "x", "max_tokens": 2,
                                "logprobs": None, "echo": False,
                                "best_of": 1, "suffix": ""})
        self.assertEqual(code, 200, body)
        with self.assertRaises(openai.BadRequestError):
            self.client.completions.create(model="stories260K", prompt="x",
                                           max_tokens=5, n=3)
        # The server keeps serving.
        self.assertEqual(post(url, {"prompt": "Once", "max_tokens": 2})[0],
                         200)

    def test_echo_logprobs_equal_the_perplexity_commands(self):
        # The same text scored by `infinigen perplexity` (BOS, then the
        # text's tokens, densely) and by an echo with logprobs.
        text = ("Once upon a time, there was a little girl named Lily. She "
                "liked to play with her red ball in the park.")
        with tempfile.TemporaryDirectory(prefix="http_api_ppl_") as d:
            path = os.path.join(d, "text.txt")
            scores = os.path.join(d, "tokens.jsonl")
            with open(path, "w") as f:
                f.write(text)
            r = subprocess.run(
                [BIN, "perplexity", f"--model={MODEL}", f"--tokenizer={TOK}",
                 f"--text={path}", "--ctx=256", "--backend=cpu",
                 f"--token_logprobs={scores}"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(scores) as f:
                expected = [json.loads(line) for line in f]
        r = self.client.completions.create(
            model="stories260K", prompt=text, max_tokens=1, temperature=0,
            echo=True, logprobs=2)
        lp = r.choices[0].logprobs
        self.assertTrue(r.choices[0].text.startswith(text))
        # BOS (unscored), the text's tokens, the generated token.
        self.assertEqual(len(lp.token_logprobs), len(expected) + 2)
        self.assertIsNone(lp.token_logprobs[0])
        self.assertIsNone(lp.top_logprobs[0])
        for got, want in zip(lp.token_logprobs[1:-1], expected):
            self.assertAlmostEqual(got, want["logprob"], places=5)
        self.assertEqual("".join(lp.tokens), r.choices[0].text)
        self.assertEqual(lp.text_offset[1:],
                         [sum(len(t) for t in lp.tokens[:i])
                          for i in range(1, len(lp.tokens))])
        for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:],
                                     lp.top_logprobs[1:]):
            self.assertEqual(top[token], value)
            self.assertLessEqual(len(top), 3)
            self.assertGreaterEqual(max(top.values()), value)

    def test_logprobs_of_generated_tokens_chat_and_streams(self):
        r = self.client.completions.create(
            model="stories260K", prompt="Once upon a time", max_tokens=12,
            temperature=0, logprobs=3)
        lp = r.choices[0].logprobs
        self.assertEqual("".join(lp.tokens), r.choices[0].text)
        self.assertEqual(len(lp.tokens), r.usage.completion_tokens)
        for value, top in zip(lp.token_logprobs, lp.top_logprobs):
            # Greedy: each token is its row's most likely one.
            self.assertEqual(value, max(top.values()))
            self.assertLess(value, 0)
        chunks = list(self.client.completions.create(
            model="stories260K", prompt="Once upon a time", max_tokens=12,
            temperature=0, logprobs=3, stream=True))
        streamed = [(t, v) for c in chunks if c.choices[0].logprobs
                    for t, v in zip(c.choices[0].logprobs.tokens,
                                    c.choices[0].logprobs.token_logprobs)]
        self.assertEqual(streamed, list(zip(lp.tokens, lp.token_logprobs)))
        hello = [{"role": "user", "content": "Tell me a story"}]
        c = self.client.chat.completions.create(
            model="stories260K", messages=hello, max_tokens=8, temperature=0,
            logprobs=True, top_logprobs=2)
        content = c.choices[0].logprobs.content
        self.assertEqual(len(content), c.usage.completion_tokens)
        self.assertEqual("".join(e.token for e in content),
                         c.choices[0].message.content)
        for e in content:
            self.assertEqual(len(e.top_logprobs), 2)
            self.assertEqual(e.logprob, e.top_logprobs[0].logprob)
            self.assertEqual(bytes(e.bytes).decode(errors="replace"), e.token)
        plain = self.client.chat.completions.create(
            model="stories260K", messages=hello, max_tokens=8, temperature=0)
        self.assertIsNone(plain.choices[0].logprobs)

    def test_penalties_change_what_repeats(self):
        def tokens(**penalty):
            r = self.client.completions.create(
                model="stories260K", prompt="Once upon a time",
                max_tokens=60, temperature=0, logprobs=0, **penalty)
            return r.choices[0].logprobs.tokens
        plain = tokens()
        for penalty in ({"presence_penalty": 2.0},
                        {"frequency_penalty": 2.0}):
            penalized = tokens(**penalty)
            self.assertNotEqual(penalized, plain, penalty)
            # Fewer repeats: more distinct tokens in as many.
            self.assertGreater(len(set(penalized)), len(set(plain)), penalty)
        # A negative penalty favours what was said.
        self.assertLess(len(set(tokens(presence_penalty=-2.0))),
                        len(set(plain)))

    def test_the_requests_of_an_evaluation_harness(self):
        # lm-evaluation-harness's local-completions with the server's
        # tokenizer: /tokenize, then a batch of one token-id prompt with
        # echo, logprobs 1 and max_tokens 1; it reads token_logprobs[ctxlen:-1].
        base = self.server.base
        code, info = curl("-H", f"Authorization: Bearer {KEY}",
                          base + "/tokenizer_info")
        self.assertEqual(code, 200)
        info = json.loads(info)
        self.assertIn("eos_token", info)
        self.assertEqual(info["eos_token_id"], 2)
        context, continuation = "Once upon a time, there was a", " little"
        code, ctx = post(base + "/tokenize",
                         {"prompt": context, "add_special_tokens": False})
        self.assertEqual(code, 200, ctx)
        code, whole = post(base + "/tokenize",
                           {"prompt": context + continuation,
                            "add_special_tokens": False})
        self.assertEqual(whole["count"], len(whole["tokens"]))
        self.assertEqual(whole["tokens"][:len(ctx["tokens"])], ctx["tokens"])
        self.assertNotEqual(whole["tokens"][0], 1)  # no BOS
        code, bos = post(base + "/tokenize", {"prompt": "Once"})
        self.assertEqual(bos["tokens"][0], 1)
        code, text = post(base + "/detokenize", {"tokens": whole["tokens"]})
        self.assertEqual(code, 200)
        self.assertEqual(text["prompt"].strip(),
                         (context + continuation).strip())
        for route, bad, param in [("/tokenize", {"prompt": 5}, "prompt"),
                                  ("/detokenize", {"tokens": [1, 99999]},
                                   "tokens"),
                                  ("/detokenize", {"tokens": "abc"},
                                   "tokens")]:
            code, body = post(base + route, bad)
            self.assert_error(code, body, 400)
            self.assertEqual(body["error"]["param"], param)
        code, body = post(base + "/v1/completions",
                          {"model": "stories260K", "prompt": [whole["tokens"]],
                           "temperature": 0, "max_tokens": 1, "logprobs": 1,
                           "echo": True, "seed": 1234})
        self.assertEqual(code, 200, body)
        lp = body["choices"][0]["logprobs"]
        n = len(whole["tokens"])
        self.assertEqual(len(lp["token_logprobs"]), n + 1)
        self.assertIsNone(lp["token_logprobs"][0])
        scored = lp["token_logprobs"][len(ctx["tokens"]):-1]
        self.assertEqual(len(scored), n - len(ctx["tokens"]))
        # " little" is stories260K's greedy choice here.
        for value, top in zip(scored,
                              lp["top_logprobs"][len(ctx["tokens"]):-1]):
            self.assertEqual(value, max(top.values()))

    @unittest.skipUnless(shutil.which("python3") and
                         subprocess.run(["python3", "-c", "import lm_eval"],
                                        stderr=subprocess.DEVNULL).returncode
                         == 0, "lm_eval is not installed")
    def test_lm_evaluation_harness_scores_a_local_task(self):
        # The real harness, offline, with the server's own tokenizer, on a
        # two-item multiple-choice task where stories260K knows the answer.
        items = [
            {"context": "Once upon a time, there was a little",
             "choices": [" girl", " table", " seven"], "gold": 0},
            {"context": "Lily went to the park. She saw a big",
             "choices": [" dog", " was", " the"], "gold": 0}]
        with tempfile.TemporaryDirectory(prefix="http_api_lm_eval_") as d:
            with open(os.path.join(d, "items.jsonl"), "w") as f:
                for item in items:
                    f.write(json.dumps(item) + "\n")
            with open(os.path.join(d, "infinigen_local.yaml"), "w") as f:
                f.write(
                    "task: infinigen_local\n"
                    "dataset_path: json\n"
                    "dataset_kwargs:\n"
                    "  data_files:\n"
                    f"    test: {d}/items.jsonl\n"
                    "test_split: test\n"
                    "output_type: multiple_choice\n"
                    "doc_to_text: '{{context}}'\n"
                    "doc_to_choice: '{{choices}}'\n"
                    "doc_to_target: gold\n"
                    "target_delimiter: ''\n"
                    "metric_list:\n"
                    "  - metric: acc\n"
                    "    aggregation: mean\n"
                    "    higher_is_better: true\n")
            env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                       HF_HOME=os.path.join(d, "hf"), OPENAI_API_KEY=KEY)
            r = subprocess.run(
                ["python3", "-m", "lm_eval", "--model", "local-completions",
                 "--model_args",
                 f"base_url={self.server.base}/v1/completions,"
                 "model=stories260K,tokenizer_backend=remote,"
                 f"auth_token={KEY},num_concurrent=1,max_retries=1",
                 "--tasks", "infinigen_local", "--include_path", d,
                 "--output_path", os.path.join(d, "out"), "--log_samples"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env=env, timeout=300)
            self.assertEqual(r.returncode, 0, r.stdout[-3000:])
            results = samples = None
            for root, _, files in os.walk(os.path.join(d, "out")):
                for name in files:
                    path = os.path.join(root, name)
                    if name.startswith("results"):
                        with open(path) as f:
                            results = json.load(f)
                    elif name.startswith("samples"):
                        with open(path) as f:
                            samples = [json.loads(line) for line in f]
        self.assertIsNotNone(results, r.stdout[-3000:])
        self.assertEqual(
            results["results"]["infinigen_local"]["acc,none"], 1.0)
        # Each choice's log-likelihood is what the server gives for it.
        self.assertEqual(len(samples), len(items))
        for sample in samples:
            item = sample["doc"]
            for choice, resp in zip(item["choices"], sample["resps"]):
                _, ctx = post(self.server.base + "/tokenize",
                              {"prompt": item["context"],
                               "add_special_tokens": False})
                _, whole = post(self.server.base + "/tokenize",
                                {"prompt": item["context"] + choice,
                                 "add_special_tokens": False})
                _, body = post(self.server.base + "/v1/completions",
                               {"prompt": whole["tokens"], "max_tokens": 1,
                                "logprobs": 1, "echo": True,
                                "temperature": 0})
                lp = body["choices"][0]["logprobs"]["token_logprobs"]
                self.assertAlmostEqual(float(resp[0][0]),
                                       sum(lp[len(ctx["tokens"]):-1]),
                                       places=6)

    def test_unknown_model_and_route_are_404(self):
        with self.assertRaises(openai.NotFoundError) as e:
            self.client.completions.create(model="gpt-4", prompt="x",
                                           max_tokens=2)
        self.assertIn("gpt-4", str(e.exception))
        code, body = post(self.server.base + "/v1/chat/completions",
                          {"model": "nope", "messages": [
                              {"role": "user", "content": "x"}]})
        self.assert_error(code, body, 404, ["nope"])
        self.assertEqual(body["error"]["code"], "model_not_found")
        code, body = curl(self.server.base + "/v1/nothing",
                          "-H", f"Authorization: Bearer {KEY}")
        self.assert_error(code, json.loads(body), 404)

    def test_a_body_too_large_is_413(self):
        big = json.dumps({"prompt": "a" * (2 << 20)}).encode()
        code, body = post(self.server.base + "/v1/completions", big)
        self.assert_error(code, body, 413)

    def test_the_key_is_required(self):
        for key in ("", "sk-wrong", KEY + "x", KEY[:-1]):
            code, body = post(self.server.base + "/v1/completions",
                              {"prompt": "x", "max_tokens": 2}, key=key)
            self.assert_error(code, body, 401)
            self.assertEqual(body["error"]["type"], "authentication_error")
        with self.assertRaises(openai.AuthenticationError):
            self.server.client(key="sk-wrong").models.list()
        code, _ = curl(self.server.base + "/v1/models")
        self.assertEqual(code, 401)


class Scheduling(unittest.TestCase):
    """Servers with one slot: queue full, disconnects, draining."""

    def test_a_full_queue_is_429(self):
        server = Server("--max_batch=1", "--max_queue=1")
        try:
            def one(_):
                return post(server.base + "/v1/completions", LONG)
            codes = []
            for _ in range(5):  # rounds, in case one round was too slow
                with concurrent.futures.ThreadPoolExecutor(12) as pool:
                    results = list(pool.map(one, range(12)))
                codes = [c for c, _ in results]
                if 429 in codes:
                    break
            self.assertIn(429, codes)
            self.assertIn(200, codes)
            self.assertEqual(set(codes), {200, 429})
            for code, body in results:
                if code == 429:
                    self.assertEqual(body["error"]["code"], "queue_full")
            with self.assertRaises(openai.RateLimitError):
                with concurrent.futures.ThreadPoolExecutor(12) as pool:
                    list(pool.map(
                        lambda _: server.client().completions.create(
                            model="stories260K", **LONG),
                        range(12)))
        finally:
            server.stop()

    def test_a_client_that_disconnects_mid_stream_frees_its_slot(self):
        server = Server("--max_batch=1", "--max_seq_len=512")
        try:
            # Open a stream, read its first event, hang up.
            with socket.create_connection(("127.0.0.1", server.port)) as s:
                body = json.dumps({**LONG, "stream": True}).encode()
                s.sendall(b"POST /v1/completions HTTP/1.1\r\n"
                          b"Host: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(body)).encode() +
                          b"\r\n\r\n" + body)
                got = b""
                while b"data: " not in got:
                    more = s.recv(4096)
                    self.assertTrue(more, got)
                    got += more
            # The one slot serves the next request.
            code, body = post(server.base + "/v1/completions",
                              {"prompt": "Once upon a time", "max_tokens": 5,
                               "temperature": 0})
            self.assertEqual(code, 200, body)
        finally:
            log = server.stop()
        self.assertIn(" 1 cancelled", log)

    def test_draining_is_503(self):
        server = Server("--max_batch=1", "--max_queue=200")
        try:
            # A backlog that takes a while to drain.
            backlog = []
            pool = concurrent.futures.ThreadPoolExecutor(20)
            for _ in range(20):
                backlog.append(pool.submit(
                    post, server.base + "/v1/completions", LONG))
            # Signalled once the backlog is in (a loaded machine sends the
            # requests slowly): queued or decoding.
            deadline = time.time() + 60
            while time.time() < deadline:
                m = scrape(server.base + "/metrics")
                held = (m.get(("infinigen_worker_queue_depth", ()), 0) +
                        m.get(("infinigen_worker_running_sequences", ()), 0))
                if held >= 10:
                    break
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            code, body = post(server.base + "/v1/completions",
                              {"prompt": "Once", "max_tokens": 2})
            self.assertEqual(code, 503, body)
            self.assertEqual(body["error"]["type"], "server_error")
            health, _ = curl(server.base + "/health")
            self.assertEqual(health, 503)
            # What was accepted before the signal finishes.
            codes = [f.result()[0] for f in backlog]
            pool.shutdown()
            self.assertEqual(set(codes) - {503}, {200})
        finally:
            server.stop()


def read(path):
    with open(path) as f:
        return f.read()


def scrape(url):
    """{(sample name, labels as a sorted tuple): value} of a /metrics page."""
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class Metrics(unittest.TestCase):
    def test_worker_series_move_after_a_request(self):
        mport = free_port()
        server = Server("--policy=full", f"--metrics_listen=127.0.0.1:{mport}")
        try:
            urls = [f"http://127.0.0.1:{mport}/metrics",
                    server.base + "/metrics"]
            before = [scrape(u) for u in urls]
            code, body = post(server.base + "/v1/completions",
                              {"prompt": "Once upon a time",
                               "max_tokens": 20, "temperature": 0})
            self.assertEqual(code, 200, body)
            # The scheduler refuses a token outside the vocabulary.
            self.assertEqual(post(server.base + "/v1/completions",
                                  {"prompt": [1, 99999]})[0], 400)
            for url, b in zip(urls, before):
                a = scrape(url)

                def delta(name, **labels):
                    key = (name, tuple(sorted(labels.items())))
                    self.assertIn(key, a, url)
                    return a[key] - b.get(key, 0)
                self.assertEqual(delta("infinigen_worker_requests_total",
                                       outcome="completed"), 1, url)
                self.assertEqual(delta("infinigen_worker_generated_tokens_total"),
                                 20)
                self.assertEqual(delta("infinigen_worker_prompt_tokens_total"),
                                 body["usage"]["prompt_tokens"])
                self.assertEqual(delta(
                    "infinigen_worker_time_to_first_token_seconds_count"), 1)
                self.assertGreater(delta(
                    "infinigen_worker_time_to_first_token_seconds_sum"), 0)
                self.assertEqual(delta(
                    "infinigen_worker_time_per_output_token_seconds_count"), 1)
                self.assertGreater(
                    delta("infinigen_worker_kv_bytes_fetched_total"), 0)
                self.assertEqual(
                    delta("infinigen_worker_kv_fetch_fraction_count"), 1)
                self.assertEqual(delta(
                    "infinigen_worker_kv_fetch_wait_seconds_per_step_count"), 1)
                self.assertEqual(delta("infinigen_worker_requests_total",
                                       outcome="rejected"), 1)
                self.assertEqual(a[("infinigen_worker_queue_depth", ())], 0)
                self.assertEqual(a[("infinigen_worker_running_sequences", ())],
                                 0)
                self.assertEqual(a[("infinigen_worker_sequence_slots", ())], 8)
        finally:
            server.stop()


    def test_row_cache_series_count_a_selecting_policys_lookups(self):
        mport = free_port()
        server = Server("--policy=infinigen", "--row_cache=0.5",
                        f"--metrics_listen=127.0.0.1:{mport}")
        try:
            url = f"http://127.0.0.1:{mport}/metrics"
            before = scrape(url)
            code, body = post(server.base + "/v1/completions",
                              {"prompt": "Once upon a time",
                               "max_tokens": 20, "temperature": 0})
            self.assertEqual(code, 200, body)
            after = scrape(url)

            def delta(name):
                self.assertIn((name, ()), after)
                return after[(name, ())] - before.get((name, ()), 0)
            lookups = delta("infinigen_worker_kv_row_cache_lookups_total")
            hits = delta("infinigen_worker_kv_row_cache_hits_total")
            self.assertGreater(lookups, 0)
            self.assertGreater(hits, 0)
            self.assertLessEqual(hits, lookups)
            self.assertGreaterEqual(
                after[("infinigen_worker_kv_row_cache_bytes", ())], 0)
        finally:
            server.stop()

    def test_serve_logs_its_throughput_while_busy_and_each_request(self):
        server = Server("--policy=full", "--log_interval=100ms",
                        "--log_requests")
        try:
            code, body = post(server.base + "/v1/completions", LONG)
            self.assertEqual(code, 200, body)
            code, body = post(server.base + "/v1/completions",
                              {"prompt": "Once upon a time", "max_tokens": 4})
            self.assertEqual(code, 200, body)
            time.sleep(0.3)  # a period after the last request
        finally:
            log = server.stop()
        busy = [l for l in log.splitlines()
                if "infinigen serve: generation" in l]
        self.assertTrue(busy, log)
        self.assertRegex(busy[-1], r"generation [0-9.]+ tokens/s, prompt "
                         r"[0-9.]+ tokens/s, \d+ running, \d+ waiting, "
                         r"\d+ finished, KV [0-9.]+ KiB fetched per token")
        self.assertTrue(any(float(l.split("generation ")[1].split(" ")[0]) > 0
                            for l in busy), busy)
        done = [l for l in log.splitlines() if "request done:" in l]
        self.assertEqual(len(done), 2, log)
        self.assertIn("prompt 5 tokens", done[1])
        self.assertIn("4 generated", done[1])
        self.assertIn("ms per token", done[1])
        # Idle: no line once the requests are done.
        quiet = Server("--policy=full", "--log_interval=100ms")
        time.sleep(0.5)
        self.assertNotIn("infinigen serve: generation", quiet.stop())

    @unittest.skipUnless(DASHBOARD, "no dashboard given")
    def test_the_dashboard_reads_only_series_the_servers_export(self):
        """Every series k8s/grafana/infinigen.json queries is on the
        worker's or the memory node's /metrics after one request, with the
        labels its `by (...)` groups by."""
        import re
        with open(DASHBOARD) as f:
            dash = json.load(f)
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets",
                                                                   [])]
        self.assertGreater(len(exprs), 20)
        for p in dash["panels"]:
            if p["type"] != "row":
                self.assertEqual(p["datasource"]["uid"], "${datasource}",
                                 p["title"])
        d = tempfile.mkdtemp(prefix="http_api_dash_")
        ready = os.path.join(d, "ready")
        nport, wport, fport = free_port(), free_port(), free_port()
        node = start_kv_node(0, ready, f"--metrics_listen=127.0.0.1:{nport}",
                             f"--fetch_port={fport}",
                             "--capacity_bytes=100000000")
        server = None
        try:
            server = Server("--policy=full",
                            f"--kv_service={read(ready).strip()}",
                            f"--metrics_listen=127.0.0.1:{wport}")
            code, body = post(server.base + "/v1/completions",
                              {"prompt": "Once upon a time", "max_tokens": 8})
            self.assertEqual(code, 200, body)
            # A refused handshake, for the refused-requests series.
            with socket.create_connection(("127.0.0.1", fport),
                                          timeout=10) as sock:
                sock.sendall(b"\0" * 256)
                sock.recv(4096)
            samples = {}
            for port in (wport, nport):
                for (name, labels), _ in scrape(
                        f"http://127.0.0.1:{port}/metrics").items():
                    samples.setdefault(name, set()).update(
                        k for k, _ in labels)
            for expr in exprs:
                names = re.findall(r"\b(infinigen_[a-z_]+)", expr)
                self.assertTrue(names, expr)
                grouped = set()
                for g in re.findall(r"by \(([^)]*)\)", expr):
                    grouped |= {x.strip() for x in g.split(",")} - {"le"}
                for name in names:
                    self.assertIn(name, samples,
                                  f"{name} (in {expr}) is on neither /metrics")
                    self.assertLessEqual(grouped, samples[name],
                                         f"{expr}: {name} has labels "
                                         f"{samples[name]}")
        finally:
            if server is not None:
                server.stop()
            node.send_signal(signal.SIGTERM)
            node.wait(timeout=30)
            shutil.rmtree(d, ignore_errors=True)

    def test_memory_node_series_move_after_a_request(self):
        d = tempfile.mkdtemp(prefix="http_api_kv_")
        ready = os.path.join(d, "ready")
        mport = free_port()
        fport = free_port()
        shm = os.path.join(d, "node.sock")
        node = subprocess.Popen(
            [KV_SERVER, "--listen=127.0.0.1:0", f"--ready_file={ready}",
             f"--metrics_listen=127.0.0.1:{mport}", f"--fetch_port={fport}",
             f"--shm_listen=unix:{shm}",
             "--capacity_bytes=100000000", "--eviction=lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server = None
        try:
            deadline = time.time() + 30
            while not (os.path.exists(ready) and read(ready).strip()):
                self.assertIsNone(node.poll(), "kv_memory_server exited")
                self.assertLess(time.time(), deadline)
                time.sleep(0.025)
            address = read(ready).strip()
            url = f"http://127.0.0.1:{mport}/metrics"
            before = scrape(url)
            self.assertEqual(before[("infinigen_kv_pool_capacity_bytes", ())],
                             100000000)
            server = Server("--policy=full", f"--kv_service={address}")
            code, body = post(server.base + "/v1/completions",
                              {"prompt": "Once upon a time",
                               "max_tokens": 20, "temperature": 0})
            self.assertEqual(code, 200, body)
            after = scrape(url)
            for name in ("infinigen_kv_appended_rows_total",
                         "infinigen_kv_fetches_total",
                         "infinigen_kv_fetched_rows_total"):
                self.assertGreater(after[(name, ())], before[(name, ())],
                                   name)
            self.assertIn(("infinigen_kv_evicted_rows_total",
                           (("policy", "lru"),)), after)
            self.assertIn(("infinigen_kv_pool_bytes_used", ()), after)
            self.assertEqual(after[("infinigen_kv_sessions", ())], 1)

            # Per data plane: the worker's appends and fetches came over
            # the TCP fetch socket.
            def plane(name, plane, op):
                key = (name, (("op", op), ("plane", plane)))
                return after.get(key, 0) - before.get(key, 0)
            self.assertGreater(plane("infinigen_kv_request_seconds_count",
                                     "tcp", "append"), 0)
            self.assertGreater(plane("infinigen_kv_served_bytes_total",
                                     "tcp", "append"), 0)
            tcp_fetches = plane("infinigen_kv_request_seconds_count", "tcp",
                                "fetch")
            self.assertGreater(tcp_fetches, 0)
            self.assertGreater(plane("infinigen_kv_served_bytes_total", "tcp",
                                     "fetch"), 0)
            # One generation over shm moves the shm plane's series.
            r = subprocess.run(
                [BIN, "generate", f"--model={MODEL}", f"--tokenizer={TOK}",
                 "--prompt=Once upon a time", "--max_new_tokens=8",
                 "--temperature=0", "--backend=cpu", "--policy=full",
                 f"--kv_service=shm:unix:{shm}"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            # Garbage where a fetch socket Hello belongs is refused and
            # counted by status.
            with socket.create_connection(("127.0.0.1", fport),
                                          timeout=10) as sock:
                sock.sendall(b"\0" * 256)
                sock.recv(4096)
            after = scrape(url)
            self.assertGreater(plane("infinigen_kv_request_seconds_count",
                                     "shm", "fetch"), 0)
            self.assertGreater(plane("infinigen_kv_served_bytes_total", "shm",
                                     "fetch"), 0)
            self.assertEqual(after[("infinigen_kv_rejected_requests_total",
                                    (("code", "INVALID_ARGUMENT"),
                                     ("plane", "tcp")))], 1)
        finally:
            if server is not None:
                server.stop()
            node.send_signal(signal.SIGTERM)
            node.wait(timeout=60)
            shutil.rmtree(d, ignore_errors=True)


LONG_PROMPT = ("Once upon a time, there was a little girl named Lily. She "
               "loved to play outside in the park. One day, she saw a big, red "
               "ball. She wanted to play with it, so she ran to her mom and "
               "asked")


class Reuse(unittest.TestCase):
    """Prefix reuse and recovery as the HTTP API and /metrics report them."""

    def test_a_repeated_prompt_reports_its_cached_tokens(self):
        mport = free_port()
        server = Server("--policy=full", "--prefix_block_tokens=4",
                        f"--metrics_listen=127.0.0.1:{mport}")
        try:
            url = f"http://127.0.0.1:{mport}/metrics"
            body = {"prompt": LONG_PROMPT, "max_tokens": 12, "temperature": 0}
            code, first = post(server.base + "/v1/completions", body)
            self.assertEqual(code, 200, first)
            usage = first["usage"]
            self.assertEqual(usage["prompt_tokens_details"]["cached_tokens"], 0)
            before = scrape(url)
            code, second = post(server.base + "/v1/completions", body)
            self.assertEqual(code, 200, second)
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            prompt = second["usage"]["prompt_tokens"]
            # Whole 4-token blocks, and the last prompt token is computed.
            self.assertEqual(cached % 4, 0)
            self.assertLess(cached, prompt)
            self.assertGreaterEqual(cached, prompt - 4)
            self.assertEqual(second["choices"][0]["text"],
                             first["choices"][0]["text"])
            after = scrape(url)
            key = ("infinigen_worker_prompt_tokens_cached_total", ())
            self.assertEqual(after[key] - before.get(key, 0), cached)
            # The streamed usage chunk carries it too.
            chunks = list(server.client().completions.create(
                model="stories260K", prompt=LONG_PROMPT, max_tokens=4,
                temperature=0, stream=True,
                stream_options={"include_usage": True}))
            self.assertEqual(
                chunks[-1].usage.prompt_tokens_details.cached_tokens, cached)
        finally:
            server.stop()

    def test_a_node_restart_mid_stream_is_recomputed_and_counted(self):
        d = tempfile.mkdtemp(prefix="http_api_restart_")
        port = free_port()
        ready = os.path.join(d, "ready")
        node = None

        def start_node():
            return start_kv_node(port, ready)

        node = start_node()
        mport = free_port()
        server = None
        try:
            server = Server("--policy=full", "--prefix_block_tokens=0",
                            f"--kv_service=tcp://127.0.0.1:{port}",
                            f"--metrics_listen=127.0.0.1:{mport}")
            body = {"prompt": LONG_PROMPT, "max_tokens": 200,
                    "temperature": 0}
            code, want = post(server.base + "/v1/completions", body)
            self.assertEqual(code, 200, want)
            self.assertGreater(want["usage"]["completion_tokens"], 60)
            restarted = False
            stream = server.client().completions.create(
                model="stories260K", stream=True, **body)
            text = ""
            for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
                if len(text) > 40 and not restarted:
                    # Freeze the worker, replace the node, go on.
                    server.proc.send_signal(signal.SIGSTOP)
                    node.kill()
                    node.wait(timeout=30)
                    node = None
                    node = start_node()
                    server.proc.send_signal(signal.SIGCONT)
                    restarted = True
            self.assertTrue(restarted)
            self.assertEqual(text, want["choices"][0]["text"])
            metrics = scrape(f"http://127.0.0.1:{mport}/metrics")
            self.assertEqual(
                metrics[("infinigen_worker_kv_recoveries_total", ())], 1)
            log = server.stop()
            server = None
            self.assertEqual(log.count("recomputing"), 1, log)
        finally:
            if server is not None:
                server.proc.send_signal(signal.SIGCONT)
                server.stop()
            if node is not None:
                node.send_signal(signal.SIGTERM)
                node.wait(timeout=60)
            shutil.rmtree(d, ignore_errors=True)


    def test_requests_after_an_idle_node_restart_all_succeed(self):
        """The node restarts between requests (same TCP port and shm
        socket): the worker reconnects before it answers, so no request
        fails, over TCP and over shm."""
        for plane in ("tcp", "shm"):
            with self.subTest(plane=plane):
                d = tempfile.mkdtemp(prefix="http_api_idle_restart_")
                port = free_port()
                sock = os.path.join(d, "node.sock")
                ready = os.path.join(d, "ready")

                def start_node():
                    return start_kv_node(port, ready,
                                         f"--shm_listen=unix:{sock}")

                node = start_node()
                server = None
                kv = (f"tcp://127.0.0.1:{port}" if plane == "tcp"
                      else f"shm:unix:{sock}")
                try:
                    server = Server("--policy=full", f"--kv_service={kv}")
                    body = {"prompt": "Once upon a time", "max_tokens": 30,
                            "temperature": 0}
                    code, want = post(server.base + "/v1/completions", body)
                    self.assertEqual(code, 200, want)
                    node.kill()
                    node.wait(timeout=30)
                    node = start_node()
                    for i in range(3):
                        code, got = post(server.base + "/v1/completions",
                                         body)
                        self.assertEqual(code, 200, (i, got))
                        self.assertEqual(got["choices"][0]["text"],
                                         want["choices"][0]["text"])
                finally:
                    if server is not None:
                        server.stop()
                    if node is not None:
                        node.send_signal(signal.SIGTERM)
                        node.wait(timeout=60)
                    shutil.rmtree(d, ignore_errors=True)

    def test_a_thousand_idle_connections_cost_a_request_nothing(self):
        """1,000 connections that never send a request: each waits on its
        own thread until the keep-alive timeout (5 s) closes it, so a normal
        completion meanwhile is answered at once (it took 30 s with a
        fixed pool of threads the idle peers held)."""
        server = Server()
        idle = []
        try:
            body = {"prompt": "Once upon a time", "max_tokens": 8,
                    "temperature": 0}
            code, want = post(server.base + "/v1/completions", body)
            self.assertEqual(code, 200, want)
            for _ in range(1000):
                idle.append(socket.create_connection(
                    ("127.0.0.1", server.port), timeout=10))
            time.sleep(0.5)  # all accepted
            start = time.monotonic()
            code, got = post(server.base + "/v1/completions", body)
            took = time.monotonic() - start
            self.assertEqual(code, 200, got)
            self.assertEqual(got["choices"][0]["text"],
                             want["choices"][0]["text"])
            self.assertLess(took, 2.0)
            # The idle ones are closed at the keep-alive timeout.
            idle[0].settimeout(15)
            self.assertEqual(idle[0].recv(1), b"")
        finally:
            for s in idle:
                s.close()
            server.stop()

    def test_a_dead_node_fails_the_queue_together_and_serving_resumes(self):
        """The node dies and four requests arrive at a one-slot worker: the
        first fails in its prefill, the three queued ones together once the
        node has been down --kv_down_wait (1 s), not one timeout after
        another (5 s apiece); new requests then get 503 at once, naming the
        node, until it is back."""
        d = tempfile.mkdtemp(prefix="http_api_dead_node_")
        port = free_port()
        ready = os.path.join(d, "ready")

        def start_node():
            return start_kv_node(port, ready)

        node = start_node()
        server = None
        kv = f"tcp://127.0.0.1:{port}"
        try:
            server = Server("--policy=full", "--max_batch=1",
                            "--kv_down_wait=1s", f"--kv_service={kv}")
            url = server.base + "/v1/completions"
            body = {"prompt": "Once upon a time", "max_tokens": 40,
                    "temperature": 0}
            code, want = post(url, body)
            self.assertEqual(code, 200, want)
            node.kill()
            node.wait(timeout=30)
            node = None
            killed = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                codes = list(pool.map(lambda _: post(url, body), range(4)))
            took = time.monotonic() - killed
            for code, answer in codes:
                self.assertEqual(code, 503, answer)
                self.assertIn(f"memory node {kv}",
                              answer["error"]["message"])
            # Together: before, 5 s apiece, one after another.
            self.assertLess(took, 8.0)
            start = time.monotonic()
            code, body = post(url, {"prompt": "Hi", "max_tokens": 2})
            self.assertEqual(code, 503, body)
            self.assertLess(time.monotonic() - start, 1.0)
            self.assertIn(f"memory node {kv}", body["error"]["message"])
            node = start_node()
            deadline = time.monotonic() + 20
            while True:
                code, body = post(url, {"prompt": "Once upon a time",
                                        "max_tokens": 8, "temperature": 0})
                if code == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            self.assertEqual(code, 200, body)
        finally:
            if server is not None:
                server.stop()
            if node is not None:
                node.send_signal(signal.SIGTERM)
                node.wait(timeout=60)
            shutil.rmtree(d, ignore_errors=True)

@unittest.skipUnless(os.path.exists(SMOLLM2), f"no {SMOLLM2}")
class SmolLM2(unittest.TestCase):
    """The instruct model with the template from its own GGUF."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server("--max_batch=2", "--max_seq_len=256",
                            model=SMOLLM2, tokenizer="")
        cls.client = cls.server.client(key="unused")

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def test_chat_answers_with_its_template(self):
        model = self.client.models.list().data[0].id
        self.assertEqual(model, "SmolLM2-135M-Instruct.Q4_1")
        messages = [{"role": "user",
                     "content": "What is the capital of France?"}]
        r = self.client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0)
        self.assertIn("Paris", r.choices[0].message.content)
        self.assertGreater(r.usage.prompt_tokens, 8)
        chunks = list(self.client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0,
            stream=True))
        self.assertEqual(
            "".join(c.choices[0].delta.content or "" for c in chunks),
            r.choices[0].message.content)
        self.assertIsNotNone(chunks[-1].choices[0].finish_reason)
        s = self.client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0,
            stop=["Paris"])
        self.assertNotIn("Paris", s.choices[0].message.content)
        self.assertEqual(s.choices[0].finish_reason, "stop")

    def test_generate_chat_uses_the_same_template(self):
        r = subprocess.run(
            [BIN, "generate", f"--model={SMOLLM2}", "--chat",
             "--prompt=What is the capital of France?", "--max_new_tokens=12",
             "--temperature=0", "--backend=cpu", "--threads=1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            timeout=300)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("Paris", r.stdout)
        self.assertNotIn("im_start", r.stdout)


class Cli(unittest.TestCase):
    def test_flags_in_help_and_bad_values(self):
        r = subprocess.run([BIN, "serve", "--help"], stdout=subprocess.PIPE,
                           text=True)
        for flag in ("--http_listen", "--api_key_file", "--chat_template",
                     "--served_model_name"):
            self.assertIn(flag, r.stdout)
        r = subprocess.run([BIN, "generate", "--help"], stdout=subprocess.PIPE,
                           text=True)
        self.assertIn("--chat", r.stdout)
        # No template in a llama2.c model: generate --chat says what to do.
        r = subprocess.run([BIN, "generate", f"--model={MODEL}",
                            f"--tokenizer={TOK}", "--chat", "--prompt=hi",
                            "--backend=cpu"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--chat_template", r.stderr)
        for flags, word in [(["--chat_template=vicuna"], "vicuna"),
                            (["--api_key_file=/nonexistent/key"],
                             "--api_key_file"),
                            ([], "HOST:PORT")]:
            args = [BIN, "serve", f"--model={MODEL}", f"--tokenizer={TOK}",
                    "--listen=127.0.0.1:0", "--backend=cpu", *flags]
            args.append("--http_listen=nohost" if not flags else
                        f"--http_listen=127.0.0.1:{free_port()}")
            r = subprocess.run(args, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, timeout=60)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(word, r.stderr)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
