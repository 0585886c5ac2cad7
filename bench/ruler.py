#!/usr/bin/env python3
"""RULER-style long-context accuracy through an OpenAI-compatible endpoint.

RULER's synthetic tasks (bench/ruler_tasks.py: retrieval NIAH in eight
variants, variable tracking, common and frequent words extraction) and an
extraction into JSON, at --lengths tokens counted by the model's own
tokenizer, sent as raw prompts (the task's template and answer prefix) to
/v1/completions, greedy, with the task's max_tokens (RULER's: niah 128, vt
30, cwe 120, fwe 50; json_kv 160). Every line sees the same samples: they
depend only on --seed, the task, the length, the sample's index and
--haystack. A length counts the prompt and the tokens to generate, as
RULER's max_seq_length does.

Two ways to get lines:
  * --model_file (and --tokenizer_file): one `infinigen serve` per
    --policies item, started here on a free port, stopped by PID at the
    end; POLICY@F is --policy=POLICY --target_fetch=F (bench/passkey.py's
    and bench/long_context.py's meaning). Flags after `--` go to every
    server (--skew=..., --threads=..., --kv_service=..., --backend=...).
  * --base_url: any OpenAI-compatible endpoint, one line (--label).
--add=A.csv,... puts the rows of earlier runs (their OUT.csv) in the same
report, so that one endpoint's line can be set beside another's; the
samples must be the same ones.

Tokens are counted by the endpoint's /tokenize (infinigen's and vLLM's
route) where it has one, else by --tokenizer_json (a Hugging Face
tokenizer.json, read with the `tokenizers` package), else estimated at
--chars_per_token (with a warning: the lengths are then approximate).

Score: RULER's string_match_all, the fraction of the expected strings the
output holds (case-insensitive); json_kv: the fraction of pairs returned
exactly. OUT.md: per length a table of task x line (mean x100 and a 95%
bootstrap interval over the samples), the average over the tasks that
count (a task counts at a length where the --reference line, full, scores
at least --count_threshold there; every task is shown), and the cost:
seconds per sample and to the first token (the prefill) per length and
line. OUT.csv: one row per sample; OUT.png (with matplotlib): score by
length, a panel per task. --json: the rows as JSON lines on stdout.

Example (SmolLM2-135M, three policies at 10% fetched, Pride and
Prejudice as the text haystack):
  bench/ruler.py --model_file=$(scripts/fetch_smollm2.sh) \\
    --policies=full,infinigen@0.1,quest@0.1 --lengths=1024,2048,4096 \\
    --samples=10 --out=bench/results/ruler_smollm2 -- \\
    --skew=smol.skew   # infinigen skew --model=... --out=smol.skew
  bench/ruler.py --base_url=http://localhost:8000/v1 --label=vllm \\
    --lengths=1024,2048,4096 --samples=10 --out=/tmp/ruler_vllm \\
    --tokenizer_json=tokenizer.json
"""
import concurrent.futures
import csv
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import benchutil
import ruler_tasks

SCRIPT = "ruler.py"


class Fail(Exception):
    """An error that ends the run with its one line."""


class HttpError(Fail):
    """An HTTP error status, with the endpoint's message."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


# Local servers are reached directly, whatever proxy the environment names.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _opener(url):
    host = urllib.parse.urlsplit(url).hostname or ""
    return _DIRECT if host in ("127.0.0.1", "localhost", "::1") else \
        urllib.request.build_opener()


# ---- the endpoint ----------------------------------------------------------

class Endpoint:
    """An OpenAI-compatible HTTP API: BASE/v1/completions, /v1/models, and
    where it has them /tokenize and /health at its root."""

    def __init__(self, base_url, api_key="", model="", timeout=600):
        base = base_url.rstrip("/")
        self.root = base[:-3] if base.endswith("/v1") else base
        self.api_key, self.model, self.timeout = api_key, model, timeout
        self.usage_in_stream = True
        self.max_model_len = None
        self._open = _opener(self.root).open

    def _request(self, method, path, body=None, timeout=None):
        req = urllib.request.Request(
            self.root + path, method=method,
            data=None if body is None else json.dumps(body).encode())
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            return self._open(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", "replace")
            try:
                text = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                text = text.strip()[:300]
            raise HttpError(e.code, f"{self.root}{path}: HTTP {e.code}: "
                            f"{text}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise Fail(f"cannot reach {self.root}{path}: {reason}") from None

    def _json(self, method, path, body=None):
        with self._request(method, path, body) as r:
            return json.loads(r.read())

    def connect(self):
        """Checks the endpoint answers; the model is --model or the first
        it lists."""
        try:
            models = [m["id"] for m in self._json("GET", "/v1/models")["data"]]
        except HttpError as e:
            if self.model:
                return
            raise Fail(f"{e}; name the model with --model") from None
        if not self.model:
            if not models:
                raise Fail(f"{self.root}/v1/models lists no model")
            self.model = models[0]
        elif models and self.model not in models:
            raise Fail(f"--model: {self.root} serves no {self.model!r}; it "
                       f"serves {', '.join(models)}")

    def _lines(self, resp):
        try:
            yield from resp
        except OSError as e:
            raise Fail(f"{self.root}/v1/completions: the stream broke: "
                       f"{e}") from None

    def tokenize(self, text):
        """The prompt's token count, as the completion will count it."""
        j = self._json("POST", "/tokenize", {"model": self.model,
                                             "prompt": text})
        if j.get("max_model_len"):
            self.max_model_len = int(j["max_model_len"])
        return int(j["count"])

    def complete(self, prompt, max_tokens):
        """Streams one greedy completion: its text, finish reason, token
        counts (the server's usage where it sends it), seconds in all and
        to the first text (to the end where there is none)."""
        body = {"model": self.model, "prompt": prompt,
                "max_tokens": max_tokens, "temperature": 0, "stream": True}
        if self.usage_in_stream:
            body["stream_options"] = {"include_usage": True}
        t0 = time.perf_counter()
        try:
            resp = self._request("POST", "/v1/completions", body)
        except HttpError as e:
            if e.code == 400 and "stream_options" in str(e) \
                    and self.usage_in_stream:
                self.usage_in_stream = False
                return self.complete(prompt, max_tokens)
            raise Fail(str(e)) from None
        text, finish, usage, first = [], None, {}, None
        with resp:
            for raw in self._lines(resp):
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise Fail(f"{self.root}/v1/completions: not an event "
                               f"stream: {data[:100]!r}") from None
                if "error" in chunk:
                    raise Fail(f"{self.root}/v1/completions: "
                               f"{chunk['error'].get('message', chunk)}")
                for c in chunk.get("choices") or []:
                    # The first text, as vLLM's benchmarks time it (a
                    # server may send empty chunks before).
                    if first is None and c.get("text"):
                        first = time.perf_counter()
                    text.append(c.get("text") or "")
                    finish = c.get("finish_reason") or finish
                if chunk.get("usage"):
                    usage = chunk["usage"]
        end = time.perf_counter()
        return {"text": "".join(text), "finish_reason": finish,
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "seconds": end - t0,
                "ttft_seconds": (first or end) - t0}


def token_counter(a, ep):
    """(count(text) -> int, how the counts are made)."""
    if a.tokenizer_json:
        try:
            import tokenizers
        except ImportError:
            raise Fail("--tokenizer_json needs the tokenizers package "
                       "(pip install tokenizers)") from None
        try:
            tok = tokenizers.Tokenizer.from_file(a.tokenizer_json)
        except Exception as e:  # the package's own error types
            raise Fail(f"--tokenizer_json: {a.tokenizer_json}: {e}") from None
        return (lambda t: len(tok.encode(t).ids),
                f"`{os.path.basename(a.tokenizer_json)}`")
    try:
        ep.tokenize("Hello")
        return ep.tokenize, "the endpoint's /tokenize"
    except HttpError as e:
        if e.code not in (404, 405, 501):
            raise
    print(f"{SCRIPT}: warning: {ep.root} has no /tokenize and no "
          "--tokenizer_json was given: tokens are estimated at "
          f"{a.chars_per_token:g} characters each, so the lengths are "
          "approximate", file=sys.stderr)
    return (lambda t: math.ceil(len(t) / a.chars_per_token),
            f"an estimate of {a.chars_per_token:g} characters per token")


# ---- infinigen serve, one per policy -----------------------------------

class Server:
    """One `infinigen serve --http_listen` on a free port, for one line;
    its log in `tmp`. stop() ends it by PID (SIGTERM, then SIGKILL)."""

    def __init__(self, a, label, flags, log):
        self.a, self.label, self.flags, self.log = a, label, flags, log
        self.proc, self.url, self.command = None, None, ""

    def start(self):
        a = self.a
        for attempt in range(3):
            port = benchutil.free_port()
            cmd = [a.binary, "serve", f"--model={a.model_file}",
                   "--listen=127.0.0.1:0",
                   f"--http_listen=127.0.0.1:{port}",
                   f"--max_batch={max(1, a.jobs)}"]
            if a.tokenizer_file:
                cmd.append(f"--tokenizer={a.tokenizer_file}")
            cmd += self.flags + a.extra
            self.command = " ".join(
                ["infinigen", "serve"] + [c for c in cmd[2:] if not c.startswith(
                    ("--listen=", "--http_listen="))])
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen(cmd, stdout=log,
                                             stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)
            self.url = f"http://127.0.0.1:{port}"
            deadline = time.time() + a.start_timeout
            while True:
                if self.proc.poll() is not None:
                    tail = self._last_line()
                    self.proc = None
                    if "bind" in tail.lower() and attempt < 2:
                        break  # the port was taken meanwhile: another
                    raise Fail(f"infinigen serve for {self.label!r} exited: "
                               f"{tail}")
                try:
                    with _DIRECT.open(self.url + "/health", timeout=2):
                        return
                except (urllib.error.URLError, OSError):
                    pass
                if time.time() > deadline:
                    self.stop()
                    raise Fail(f"infinigen serve for {self.label!r} not "
                               f"healthy after {a.start_timeout} s: "
                               f"{self._last_line()}")
                time.sleep(0.2)
        raise Fail(f"infinigen serve for {self.label!r} found no free port")

    def died(self):
        """Why the server ended, where it has; else None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return (f"infinigen serve for {self.label!r} exited "
                f"({self.proc.returncode}): {self._last_line()}")

    def _last_line(self):
        try:
            with open(self.log, errors="replace") as f:
                lines = [l.strip() for l in f if l.strip()]
        except OSError:
            lines = []
        return lines[-1] if lines else "(no output)"

    def stop(self):
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        os.kill(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()


def known_policies(binary):
    """The policy names `infinigen serve --help` lists, or None where it
    lists none that can be read (then the server's start is the check)."""
    try:
        out = subprocess.run([binary, "serve", "--help"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = out.stdout + out.stderr
    _, _, listed = text.partition("Policies (--policy):")
    names = re.findall(r"^  ([a-z0-9_]+)  ", listed, re.M)
    return set(names) or None


# ---- running ---------------------------------------------------------------

def _sha1(text):
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def build_samples(a, hay, count):
    """Every (task, length, index) sample, in that order."""
    todo = [(t, L, i) for L in a.lengths for t in a.tasks
            for i in range(a.samples)]
    made, t0 = [], time.time()
    for k, (t, L, i) in enumerate(todo, 1):
        try:
            s = ruler_tasks.make_sample(t, L, i, a.seed, hay, count)
        except ruler_tasks.TaskError as e:
            raise Fail(str(e)) from None
        s.update(task=t, length=L, sample=i, prompt_sha1=_sha1(s["prompt"]))
        made.append(s)
        if k % 20 == 0 or k == len(todo):
            print(f"{SCRIPT}: built {k}/{len(todo)} samples "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return made


def _clock(s):
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 \
        else f"{s // 60}:{s % 60:02d}"


def run_line(a, ep, label, samples, progress):
    """Every sample through `ep`, --jobs at a time; each row to
    progress() as it finishes."""
    def one(s):
        r = ep.complete(s["prompt"], ruler_tasks.TASKS[s["task"]].max_tokens)
        return {"task": s["task"], "length": s["length"], "line": label,
                "sample": s["sample"],
                "score": round(ruler_tasks.score(s["task"], r["text"],
                                                 s["expected"]), 6),
                "prompt_tokens": (r["prompt_tokens"]
                                  if r["prompt_tokens"] is not None
                                  else s["prompt_tokens"]),
                "counted_tokens": s["prompt_tokens"],
                "completion_tokens": r["completion_tokens"],
                "seconds": round(r["seconds"], 4),
                "ttft_seconds": round(r["ttft_seconds"], 4),
                "finish_reason": r["finish_reason"],
                "seed": a.seed, "haystack": os.path.basename(a.haystack),
                "prompt_sha1": s["prompt_sha1"],
                "expected": s["expected"], "output": r["text"]}

    pool = concurrent.futures.ThreadPoolExecutor(a.jobs)
    try:
        for f in concurrent.futures.as_completed(
                [pool.submit(one, s) for s in samples]):
            progress(f.result())
    finally:
        # On an error or Ctrl-C the requests still out end with their
        # server, which the caller stops next.
        pool.shutdown(wait=False, cancel_futures=True)


# ---- the report ------------------------------------------------------------

def mean_of_means(groups):
    return sum(sum(g) / len(g) for g in groups) / len(groups)


def bootstrap(groups, reps=1000):
    """The mean of the groups' means, and a 95% percentile bootstrap
    interval of it (each group resampled on its own; a fixed seed)."""
    mean = mean_of_means(groups)
    if all(len(g) < 2 for g in groups):
        return mean, mean, mean
    rng = random.Random(0)
    stats = sorted(
        sum(sum(rng.choices(g, k=len(g))) / len(g) for g in groups)
        / len(groups) for _ in range(reps))
    return mean, stats[int(0.025 * reps)], stats[int(0.975 * reps) - 1]


def _cell(m, lo, hi, n=None):
    s = f"{100 * m:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"
    return s if n is None else f"{s} ({n})"


def summarize(a, rows, lines, tasks, lengths):
    """{(line, task, length): scores}, {(task, length): counts?} and the
    reference's line (None: every task counts)."""
    by = {}
    for r in rows:
        by.setdefault((r["line"], r["task"], r["length"]), []).append(
            float(r["score"]))
    ref = a.reference if a.reference in lines else None
    counts = {}
    for t in tasks:
        for L in lengths:
            s = by.get((ref, t, L))
            counts[(t, L)] = (True if ref is None else
                              bool(s) and sum(s) / len(s) >= a.count_threshold)
    return by, counts, ref


def write_report(a, state, stopped):
    rows, lines = state.rows, state.lines
    # What the rows hold, those of --add included.
    tasks = [t for t in ruler_tasks.TASKS if any(r["task"] == t for r in rows)]
    lengths = sorted({r["length"] for r in rows})
    by, counts, ref = summarize(a, rows, lines, tasks, lengths)
    n = max(len(v) for v in by.values())

    def distinct(key):
        return ", ".join(f"`{v}`" for v in dict.fromkeys(
            str(r.get(key) or "?") for r in rows))
    with open(a.out + ".md", "w") as fh:
        w = fh.write
        w("# RULER-style long-context accuracy\n\n")
        w(f"Command: `{benchutil.command_line()}`  \n")
        w(f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
          f"{platform.system()}; {time.time() - state.started:.0f} s"
          + (f" (stopped: {stopped}; the samples done so far)" if stopped
             else "") + "  \n")
        for label, how in state.how:
            w(f"Line `{label}`: {how}  \n")
        w(f"Haystack: {distinct('haystack')}; seed {distinct('seed')}; "
          f"{n} samples per task and length; tokens counted by "
          f"{state.counter}; a "
          "length is the prompt and the tokens to generate.\n\n")
        w("Scores x100, mean and 95% bootstrap interval over the samples: "
          "the fraction of the expected strings in the output (RULER's "
          "string_match_all; json_kv: the pairs returned exactly). ")
        if ref is None:
            w("Every task counts in the averages (no line "
              f"`{a.reference}`).\n")
        else:
            w(f"The averages count a task at a length where `{ref}` "
              f"scores at least {100 * a.count_threshold:g} there; a task "
              "that does not count is marked *.\n")

        w("\n## Average over the tasks that count\n\n")
        w("| line | " + " | ".join(f"{L}" for L in lengths) + " |\n")
        w("|---" * (len(lengths) + 1) + "|\n")
        for line in lines:
            cells = []
            for L in lengths:
                groups = [by[(line, t, L)] for t in tasks
                          if counts[(t, L)] and (line, t, L) in by]
                if groups:
                    cells.append(_cell(*bootstrap(groups), f"{len(groups)}/"
                                       f"{len(tasks)} tasks"))
                else:
                    cells.append("no task counts" if not any(
                        counts[(t, L)] for t in tasks) else "—")
            w(f"| {line} | " + " | ".join(cells) + " |\n")

        for L in lengths:
            toks = [int(r["prompt_tokens"]) for r in rows
                    if r["length"] == L and r["prompt_tokens"] not in ("",
                                                                      None)]
            span = (f"prompts {min(toks)}-{max(toks)} tokens" if toks
                    else "no samples")
            w(f"\n## Length {L} ({span})\n\n")
            w("| task | " + " | ".join(lines) + " |\n")
            w("|---" * (len(lines) + 1) + "|\n")
            for t in tasks:
                mark = "" if counts[(t, L)] else " *"
                cells = [_cell(*bootstrap([by[(line, t, L)]]))
                         if (line, t, L) in by else "—" for line in lines]
                w(f"| {t}{mark} | " + " | ".join(cells) + " |\n")
            cells = []
            for line in lines:
                groups = [by[(line, t, L)] for t in tasks
                          if counts[(t, L)] and (line, t, L) in by]
                cells.append(_cell(*bootstrap(groups)) if groups else "—")
            w("| **average** | " + " | ".join(cells) + " |\n")

        w("\n## Cost\n\nMeans per sample: seconds from sending the request "
          "to the last token, and to the first text (the prefill, with "
          "whatever the server reused of earlier prompts); prompt and "
          f"output tokens. Requests {a.jobs} at a time.\n\n")
        w("| length | line | prompt tokens | output tokens | s / sample | "
          "s to first text |\n|---|---|---|---|---|---|\n")
        for L in lengths:
            for line in lines:
                rs = [r for r in rows if r["length"] == L
                      and r["line"] == line]
                if not rs:
                    continue

                def mean(key, fmt):
                    v = [float(r[key]) for r in rs
                         if r[key] not in ("", None)]
                    return format(sum(v) / len(v), fmt) if v else "—"
                w(f"| {L} | {line} | {mean('prompt_tokens', '.0f')} | "
                  f"{mean('completion_tokens', '.1f')} | "
                  f"{mean('seconds', '.3f')} | "
                  f"{mean('ttft_seconds', '.3f')} |\n")

    fields = ["task", "length", "line", "sample", "score", "prompt_tokens",
              "counted_tokens", "completion_tokens", "seconds",
              "ttft_seconds", "finish_reason", "seed", "haystack",
              "prompt_sha1", "expected", "output"]
    with open(a.out + ".csv", "w", newline="") as fh:
        cw = csv.DictWriter(fh, fieldnames=fields)
        cw.writeheader()
        order = {t: i for i, t in enumerate(tasks)}
        for r in sorted(rows, key=lambda r: (lines.index(r["line"]),
                                             r["length"], order[r["task"]],
                                             r["sample"])):
            r = dict(r)
            if not isinstance(r["expected"], str):
                r["expected"] = json.dumps(r["expected"])
            cw.writerow(r)
    plot(a, by, counts, lines, tasks, lengths)


def plot(a, by, counts, lines, tasks, lengths):
    plt = benchutil.pyplot(SCRIPT)
    if plt is None:
        return
    panels = tasks + ["average"]
    cols = 4
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.2 * cols, 2.5 * rows_n),
                             squeeze=False)
    for ax, name in zip(axes.flat, panels):
        empty = True
        for i, line in enumerate(lines):
            xs, ys = [], []
            for L in lengths:
                if name == "average":
                    g = [by[(line, t, L)] for t in tasks
                         if counts[(t, L)] and (line, t, L) in by]
                else:
                    g = [by[(line, name, L)]] if (line, name, L) in by else []
                if g:
                    xs.append(L)
                    ys.append(100 * mean_of_means(g))
            ax.plot(xs, ys, marker="o", color=f"C{i}", label=line)
            empty = empty and not xs
        if empty:
            ax.text(0.5, 0.5, "no task counts", ha="center", fontsize=8,
                    transform=ax.transAxes)
        ax.set_title(name, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(lengths) / 1.15, max(lengths) * 1.15)
        ax.set_xticks(lengths)
        ax.set_xticklabels([str(L) for L in lengths], fontsize=7)
        ax.set_ylim(-5, 105)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.supxlabel("length (tokens)")
    fig.supylabel("score x100")
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=110)


# ---- main ------------------------------------------------------------------

def read_added(path):
    """The rows of an earlier run's OUT.csv."""
    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as e:
        raise Fail(f"--add: {path}: {e.strerror}") from None
    for r in rows:
        try:
            r["length"], r["sample"] = int(r["length"]), int(r["sample"])
            r["expected"] = json.loads(r["expected"])
        except (KeyError, ValueError):
            raise Fail(f"--add: {path} is not a {SCRIPT} CSV") from None
    return rows


def parse_args():
    ap = benchutil.parser(__doc__, raw=True)
    ap.add_argument("--base_url", default="",
                    help="an OpenAI-compatible endpoint, e.g. "
                    "http://HOST:PORT/v1 (one line)")
    ap.add_argument("--api_key", default="",
                    help="its bearer key; empty: $OPENAI_API_KEY")
    ap.add_argument("--model", default="",
                    help="the model's name at the endpoint; empty: the "
                    "first /v1/models lists")
    ap.add_argument("--label", default="",
                    help="the endpoint's line; empty: the model's name")
    ap.add_argument("--binary", default="bazel-bin/gpu_worker/infinigen")
    ap.add_argument("--model_file", default="",
                    help="start `infinigen serve` on this model, one per "
                    "--policies item")
    ap.add_argument("--tokenizer_file", default="")
    ap.add_argument("--policies",
                    default="full,infinigen@0.1,oracle@0.1,quest@0.1,h2o@0.1",
                    help="POLICY or POLICY@FRACTION, comma-separated")
    ap.add_argument("--start_timeout", type=int, default=600,
                    help="seconds a server may take to become healthy")
    ap.add_argument("--tasks", default=",".join(ruler_tasks.TASKS))
    ap.add_argument("--lengths", default="4096,8192",
                    help="comma-separated lengths in tokens (prompt and "
                    "tokens to generate)")
    ap.add_argument("--samples", type=int, default=10,
                    help="samples per task and length")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--haystack",
                    default="../shared/data/pride_and_prejudice.txt",
                    help="the text of the text-haystack tasks and cwe's words")
    ap.add_argument("--tokenizer_json", default="",
                    help="count tokens with this tokenizer.json instead of "
                    "the endpoint's /tokenize")
    ap.add_argument("--chars_per_token", type=float, default=4.0,
                    help="the estimate where neither counts")
    ap.add_argument("--jobs", type=int, default=1,
                    help="requests at once (the server's --max_batch)")
    ap.add_argument("--timeout", type=int, default=600,
                    help="seconds one request may take")
    ap.add_argument("--reference", default="full",
                    help="the line whose scores decide which tasks count")
    ap.add_argument("--count_threshold", type=float, default=0.3)
    ap.add_argument("--add", default="",
                    help="earlier runs' OUT.csv files, comma-separated: "
                    "their lines join the report")
    ap.add_argument("--json", action="store_true",
                    help="print each sample's row as a JSON line on stdout")
    ap.add_argument("--out", help="output path without suffix (default: a "
                    "new directory under ./bench_out)")
    ap.add_argument("extra", nargs="*",
                    help="more `infinigen serve` flags, after --")
    a = ap.parse_args()

    a.tasks = [t for t in a.tasks.split(",") if t]
    bad = [t for t in a.tasks if t not in ruler_tasks.TASKS]
    if bad or not a.tasks:
        raise Fail(f"--tasks: unknown {', '.join(bad) or '(none given)'}; "
                   f"the tasks: {', '.join(ruler_tasks.TASKS)}")
    try:
        a.lengths = sorted({int(x) for x in a.lengths.split(",") if x})
    except ValueError:
        raise Fail(f"--lengths: not numbers: {a.lengths}") from None
    if not a.lengths or min(a.lengths) < 1:
        raise Fail("--lengths: give positive lengths")
    if a.samples < 1:
        raise Fail("--samples must be at least 1")
    if a.jobs < 1 or a.chars_per_token <= 0:
        raise Fail("--jobs and --chars_per_token must be positive")
    if a.model_file and a.base_url:
        raise Fail("give --model_file (servers started here) or --base_url "
                   "(an endpoint), not both")
    if a.extra and not a.model_file:
        raise Fail("flags after -- go to `infinigen serve`: they need "
                   "--model_file")
    a.add = [p for p in a.add.split(",") if p]
    if not (a.model_file or a.base_url or a.add):
        raise Fail("give --model_file, --base_url or --add")
    a.haystack = benchutil.repo_path(a.haystack)
    if (a.model_file or a.base_url) and not os.path.isfile(a.haystack):
        raise Fail(f"--haystack: no file {a.haystack} (name a long text "
                   f"file: a book, say)")
    if a.model_file:
        a.binary = benchutil.repo_path(a.binary)
        for flag, path in (("--binary", a.binary),
                           ("--model_file", a.model_file),
                           ("--tokenizer_file", a.tokenizer_file)):
            if path and not os.path.exists(path):
                raise Fail(f"{flag}: no file {path}")
        a.runs = benchutil.parse_runs(a.policies, f"{SCRIPT}: --policies")
        known = known_policies(a.binary)
        bad = [p for p, _ in a.runs if known and p not in known]
        if bad:
            raise Fail(f"--policies: no policy {', '.join(bad)}; "
                       f"{os.path.basename(a.binary)} has "
                       f"{', '.join(sorted(known))}")
    if a.tokenizer_json and not os.path.exists(a.tokenizer_json):
        raise Fail(f"--tokenizer_json: no file {a.tokenizer_json}")
    a.api_key = a.api_key or os.environ.get("OPENAI_API_KEY", "")
    return a


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt


class Run:
    """What the report needs, filled in as the run goes: the rows, the
    lines in order, how each line was served, how tokens were counted."""

    def __init__(self):
        self.rows, self.lines, self.how = [], [], []
        self.added = 0  # rows from --add, first in rows
        self.counter = "the earlier runs (--add)"
        self.started = time.time()


def run(a, state, servers, tmp):
    """Every line's samples; `state` holds what is done at any moment."""
    added = []
    for path in a.add:
        rows = read_added(path)
        for line in dict.fromkeys(r["line"] for r in rows):
            if line in state.lines:
                raise Fail(f"--add: the line {line!r} is there twice")
            state.lines.append(line)
            state.how.append((line, f"the rows of `{path}`"))
        added += rows
    state.rows += added
    state.added = len(added)
    if a.model_file:
        plan = [(f"{p}@{f:g}" if f is not None else p,
                 benchutil.policy_flags(p, f)) for p, f in a.runs]
    elif a.base_url:
        plan = [(a.label, None)]
    else:
        return
    try:
        hay = ruler_tasks.Haystack.from_file(a.haystack)
    except ruler_tasks.TaskError as e:
        raise Fail(f"--haystack: {e}") from None
    samples = None
    total = len(plan) * len(a.tasks) * len(a.lengths) * a.samples
    done, t_run = [0], time.time()

    def progress(row):
        state.rows.append(row)
        done[0] += 1
        el = time.time() - t_run
        eta = el / done[0] * (total - done[0])
        print(f"[{done[0]}/{total}] {row['line']} {row['task']} "
              f"L{row['length']} #{row['sample']}: {row['score']:.2f} "
              f"({row['prompt_tokens']} tok, {row['seconds']:.1f} s; "
              f"elapsed {_clock(el)}, ETA {_clock(eta)})",
              file=sys.stderr, flush=True)
        if a.json:
            print(json.dumps(row), flush=True)

    for i, (label, flags) in enumerate(plan):
        server = None
        if flags is not None:
            server = Server(a, label, flags, os.path.join(tmp, f"serve{i}.log"))
            servers.append(server)
            server.start()
            ep = Endpoint(server.url, timeout=a.timeout)
            how = f"`{server.command}`"
        else:
            ep = Endpoint(a.base_url, a.api_key, a.model, a.timeout)
            how = a.base_url
        ep.connect()
        if flags is None:
            label = label or ep.model
            how += f", model `{ep.model}`"
        if label in state.lines:
            raise Fail(f"the line {label!r} is there twice")
        if samples is None:
            count, state.counter = token_counter(a, ep)
            if ep.max_model_len and max(a.lengths) > ep.max_model_len:
                raise Fail(f"--lengths: {max(a.lengths)} is past the "
                           f"model's context ({ep.max_model_len} tokens at "
                           f"{ep.root})")
            samples = build_samples(a, hay, count)
            check_added(added, samples)
        state.lines.append(label)
        state.how.append((label, how))
        try:
            run_line(a, ep, label, samples, progress)
        except Fail:
            if server is not None and server.died():
                raise Fail(server.died()) from None
            raise
        if server is not None:
            server.stop()


def check_added(added, samples):
    """Rows from --add must be of the same samples."""
    want = {(s["task"], s["length"], s["sample"]): s["prompt_sha1"]
            for s in samples}
    for r in added:
        k = (r["task"], r["length"], r["sample"])
        if k in want and r.get("prompt_sha1") != want[k]:
            raise Fail(f"--add: line {r['line']!r} ran other samples "
                       f"({r['task']} at {r['length']} #{r['sample']}): "
                       "another seed, haystack or tokenizer")


def report(a, state, stopped):
    """OUT.md, OUT.csv and OUT.png of the rows there are; `stopped` says
    why they are not all (None: they are)."""
    if a.out is None:
        a.out = benchutil.fresh_out("ruler")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    write_report(a, state, stopped)


def main():
    servers, tmp, stopped = [], None, None
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        a = parse_args()
        tmp = tempfile.mkdtemp(prefix="ruler_")
        state = Run()
        try:
            run(a, state, servers, tmp)
        except KeyboardInterrupt:
            stopped = "interrupted"
        except Fail as e:
            # The rows done so far are kept; the error is the last line.
            stopped = str(e)
        finally:
            for s in servers:
                s.stop()
        if state.rows and (stopped is None or len(state.rows) > state.added):
            report(a, state, stopped)
            if stopped is None and not a.json:
                print(open(a.out + ".md").read())
        if stopped:
            done = len(state.rows) - state.added
            kept = f" (the {done} samples done: {a.out}.md)" if done else ""
            sys.exit(f"{SCRIPT}: {stopped}{kept}")
    except Fail as e:
        sys.exit(f"{SCRIPT}: {e}")
    finally:
        for s in servers:
            s.stop()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
