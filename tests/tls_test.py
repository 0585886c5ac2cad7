#!/usr/bin/env python3
"""TLS between the binaries as a user deploys it: `infinigen`
reaching a kv_memory_server that serves gRPC over mutual TLS (--kv_tls_*),
and `infinigen serve` answering over TLS itself (--tls_*): gRPC on --listen,
HTTPS on --http_listen.

  * generate over TLS gives the text it gives over plaintext: one node, a
    comma-separated tier, dns+tcp:// (whose name the certificate is checked
    against), and --kv_tls_server_name for an IP the certificate does not
    list; the fetches go over the node's fetch socket, which speaks TLS
    too (its /metrics: fetches served on the "tcp" plane, none on "grpc");
  * a worker with the wrong CA, no client certificate, a certificate from
    another CA, or no TLS at all fails with one line and exit status 1;
  * unreadable files and half a configuration: one line, exit status 2, on
    every engine command;
  * serve over mutual TLS answers a gRPC client and an HTTPS client that
    have the CA and a client certificate, and refuses plaintext and clients
    without a certificate.

Certificates: kv_memory_service/testing/tls (a CA, a server certificate for
localhost and 127.0.0.1, a client certificate, a stranger's self-signed
one), and one made here with the openssl CLI in a temporary directory (a
server certificate naming only localhost, from its own CA). Every process
is stopped by its PID and the temporary directory removed.

Usage: tls_test.py INFINIGEN KV_MEMORY_SERVER WORKER_GRPC_CLIENT
       STORIES260K.bin TOK512.bin TLS_DIR
"""
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

BIN, SERVER, GRPC_CLIENT, MODEL, TOK, TLS_DIR = sys.argv[1:7]
STORY = ("Once upon a time, there was a little girl named Lily. She loved to "
         "play outside in the park.")


def pem(name):
    return os.path.join(TLS_DIR, name)


CA, CLIENT_CERT, CLIENT_KEY = pem("ca.pem"), pem("client.pem"), pem("client.key")
SERVER_CERT, SERVER_KEY = pem("server.pem"), pem("server.key")
OTHER_CERT, OTHER_KEY = pem("other.pem"), pem("other.key")
CLIENT_FLAGS = [f"--kv_tls_ca={CA}", f"--kv_tls_cert={CLIENT_CERT}",
                f"--kv_tls_key={CLIENT_KEY}"]


def openssl(*args):
    subprocess.run(["openssl", *args], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=60)


def make_localhost_only_certificate(d):
    """A CA and a server certificate whose only name is DNS:localhost."""
    ca_key, ca = os.path.join(d, "ca2.key"), os.path.join(d, "ca2.pem")
    key, csr = os.path.join(d, "lh.key"), os.path.join(d, "lh.csr")
    cert, ext = os.path.join(d, "lh.pem"), os.path.join(d, "lh.ext")
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt",
            "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", ca_key,
            "-out", ca, "-days", "2", "-subj", "/CN=tls_test CA")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=localhost")
    with open(ext, "w") as f:
        f.write("subjectAltName=DNS:localhost\n")
    openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key,
            "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", ext)
    return ca, cert, key


def one_line_failure(test, r, code, words):
    """Exit status `code`, nothing on stdout, and besides informational
    log lines ("I file:line] ...") exactly one line, holding `words`."""
    test.assertEqual(r.returncode, code, r.stderr)
    test.assertEqual(r.stdout, "")
    lines = [l for l in r.stderr.splitlines()
             if l.strip() and not l.startswith("I ")]
    test.assertEqual(len(lines), 1, r.stderr)
    for w in words:
        test.assertIn(w, lines[0])
    return lines[0]


class Node:
    """A kv_memory_server on 127.0.0.1 with `flags`; stop() by its PID."""

    def __init__(self, tmp, name, *flags):
        ready = os.path.join(tmp, name + ".ready")
        self.proc = subprocess.Popen(
            [SERVER, "--listen=127.0.0.1:0", f"--ready_file={ready}", *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(2400):
            if os.path.exists(ready):
                with open(ready) as f:
                    self.address = f.read().strip()
                if self.address:
                    self.port = int(self.address.rsplit(":", 1)[1])
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"kv_memory_server exited "
                                   f"{self.proc.returncode}")
            time.sleep(0.025)
        self.stop()
        raise RuntimeError("kv_memory_server did not become ready")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run(*args, timeout=300):
    return subprocess.run([BIN, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout)


def generate_args(kv, *extra, tokens=40):
    return ["generate", f"--model={MODEL}", f"--tokenizer={TOK}",
            "--prompt=Once upon a time", f"--max_new_tokens={tokens}",
            "--temperature=0", "--policy=full", "--backend=cpu",
            "--threads=1", f"--kv_service={kv}", *extra]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localhost_is_only_ipv4():
    try:
        found = {a[4][0] for a in socket.getaddrinfo("localhost", None,
                                                     type=socket.SOCK_STREAM)}
    except OSError:
        return False
    return found == {"127.0.0.1"}


class TlsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="tls_test_")
        cls.nodes = []
        try:
            cls.plain = cls.node("plain")
            cls.metrics_port = free_port()
            cls.tls = cls.node("tls", f"--tls_cert={SERVER_CERT}",
                               f"--tls_key={SERVER_KEY}",
                               f"--tls_client_ca={CA}",
                               f"--metrics_listen=127.0.0.1:{cls.metrics_port}")
            cls.lh_ca, lh_cert, lh_key = make_localhost_only_certificate(
                cls.tmp)
            cls.lh = cls.node("lh", f"--tls_cert={lh_cert}",
                              f"--tls_key={lh_key}", f"--tls_client_ca={CA}")
        except Exception:
            cls.tearDownClass()
            raise

    @classmethod
    def node(cls, name, *flags):
        n = Node(cls.tmp, name, *flags)
        cls.nodes.append(n)
        return n

    @classmethod
    def tearDownClass(cls):
        for n in cls.nodes:
            n.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def generate(self, kv, *extra):
        r = run(*generate_args(kv, *extra))
        self.assertEqual(r.returncode, 0, r.stderr)
        return r.stdout

    def fetches_served(self):
        """The TLS node's fetches served so far, by plane."""
        with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/metrics",
                timeout=30) as resp:
            text = resp.read().decode()
        counts = {}
        for plane in ("tcp", "grpc"):
            m = re.search(r'^infinigen_kv_request_seconds_count\{op="fetch",'
                          r'plane="%s"\} (\d+)' % plane, text, re.M)
            self.assertIsNotNone(m, text)
            counts[plane] = int(m.group(1))
        return counts

    def test_generate_over_tls_gives_the_plaintext_text(self):
        plain = self.generate(self.plain.address)
        self.assertTrue(plain.startswith(STORY), plain)
        before = self.fetches_served()
        self.assertEqual(self.generate(self.tls.address, *CLIENT_FLAGS), plain)
        # Over the TLS fetch socket, not the gRPC stream.
        after = self.fetches_served()
        self.assertGreater(after["tcp"], before["tcp"])
        self.assertEqual(after["grpc"], 0)
        # A tier of two nodes (the same server under two names: two
        # sessions, each holding half of every sequence's KV heads).
        tier = f"{self.tls.address},tcp://localhost:{self.tls.port}"
        self.assertEqual(self.generate(tier, *CLIENT_FLAGS), plain)
        self.assertEqual(self.fetches_served()["grpc"], 0)
        # A certificate that names only localhost: the IP address fails the
        # name check unless --kv_tls_server_name says what to check.
        lh_flags = [f"--kv_tls_ca={self.lh_ca}", f"--kv_tls_cert={CLIENT_CERT}",
                    f"--kv_tls_key={CLIENT_KEY}"]
        r = run(*generate_args(self.lh.address, *lh_flags))
        one_line_failure(self, r, 1, ["cannot connect", self.lh.address,
                                      "over TLS"])
        self.assertEqual(
            self.generate(self.lh.address, *lh_flags,
                          "--kv_tls_server_name=localhost"), plain)
        if localhost_is_only_ipv4():
            # dns+tcp:// dials the addresses NAME resolves to and checks the
            # certificate against NAME.
            self.assertEqual(
                self.generate(f"dns+tcp://localhost:{self.lh.port}",
                              *lh_flags), plain)

    def test_refused_workers_fail_with_one_line(self):
        cases = {
            "wrong CA": [f"--kv_tls_ca={OTHER_CERT}",
                         f"--kv_tls_cert={CLIENT_CERT}",
                         f"--kv_tls_key={CLIENT_KEY}"],
            "no client certificate": [f"--kv_tls_ca={CA}"],
            "another CA's client certificate": [
                f"--kv_tls_ca={CA}", f"--kv_tls_cert={OTHER_CERT}",
                f"--kv_tls_key={OTHER_KEY}"],
            "plaintext": [],
        }
        # Each waits out the connect timeout: run them side by side.
        procs = {name: subprocess.Popen(
            [BIN, *generate_args(self.tls.address, *flags)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, flags in cases.items()}
        for name, p in procs.items():
            out, err = p.communicate(timeout=300)
            r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
            with self.subTest(name):
                line = one_line_failure(
                    self, r, 1, ["infinigen: cannot connect to the KV memory "
                                 "server", self.tls.address])
                if name == "wrong CA":
                    self.assertIn("certificate verify failed", line)
        # The node still serves a worker with the right certificates.
        self.assertTrue(self.generate(self.tls.address,
                                      *CLIENT_FLAGS).startswith(STORY))

    def test_bad_tls_flags_are_usage_errors_on_every_engine_command(self):
        missing = os.path.join(self.tmp, "missing.pem")
        engine = {
            "generate": [f"--model={MODEL}", f"--tokenizer={TOK}"],
            "perplexity": [f"--model={MODEL}", f"--tokenizer={TOK}",
                           f"--text={CA}", "--ctx=16"],
            "bench-decode": [f"--model={MODEL}", "--ctx=16",
                             "--decode_tokens=2"],
            "serve": [f"--model={MODEL}", f"--tokenizer={TOK}",
                      "--listen=127.0.0.1:0"],
        }
        kv = f"--kv_service={self.tls.address}"
        for command, base in engine.items():
            with self.subTest(command):
                help_text = run(command, "--help").stdout
                for flag in ("kv_tls_ca", "kv_tls_cert", "kv_tls_key",
                             "kv_tls_server_name"):
                    self.assertIn(f"--{flag} ", help_text)
                r = run(command, *base, kv, f"--kv_tls_ca={missing}")
                one_line_failure(self, r, 2, ["--kv_tls_ca", "missing.pem"])
                r = run(command, *base, kv, f"--kv_tls_ca={CA}",
                        f"--kv_tls_cert={CLIENT_CERT}")
                one_line_failure(self, r, 2, ["--kv_tls_cert",
                                              "--kv_tls_key"])
                r = run(command, *base, kv, f"--kv_tls_cert={CLIENT_CERT}",
                        f"--kv_tls_key={CLIENT_KEY}")
                one_line_failure(self, r, 2, ["--kv_tls_ca"])
                r = run(command, *base, kv, f"--kv_tls_ca={CLIENT_KEY}")
                one_line_failure(self, r, 2, ["--kv_tls_ca",
                                              "no PEM certificate"])
                r = run(command, *base, kv, f"--kv_tls_ca={CA}",
                        f"--kv_tls_cert={CLIENT_CERT}",
                        f"--kv_tls_key={OTHER_KEY}")
                one_line_failure(self, r, 2, ["--kv_tls_key",
                                              "not the private key"])
                r = run(command, *base, "--kv_service=inproc:",
                        f"--kv_tls_ca={CA}")
                one_line_failure(self, r, 2, ["--kv_tls_ca", "inproc:"])
        serve = ["serve", *engine["serve"]]
        self.assertIn("--tls_client_ca ", run("serve", "--help").stdout)
        one_line_failure(self, run(*serve, f"--tls_cert={SERVER_CERT}"), 2,
                         ["--tls_cert", "--tls_key"])
        one_line_failure(self, run(*serve, f"--tls_client_ca={CA}"), 2,
                         ["--tls_client_ca"])
        one_line_failure(self, run(*serve, f"--tls_cert={missing}",
                                   f"--tls_key={SERVER_KEY}"), 2,
                         ["--tls_cert", "missing.pem"])
        garbage = os.path.join(self.tmp, "garbage.pem")
        with open(garbage, "w") as f:
            f.write("not a certificate\n")
        one_line_failure(self, run(*serve, f"--tls_cert={garbage}",
                                   f"--tls_key={SERVER_KEY}"), 2,
                         ["--tls_cert", "no PEM certificate"])
        one_line_failure(self, run(*serve, f"--tls_cert={SERVER_CERT}",
                                   f"--tls_key={CLIENT_KEY}"), 2,
                         ["--tls_key is not the private key of --tls_cert"])
        r = subprocess.run([SERVER, "--listen=127.0.0.1:0",
                            f"--tls_cert={garbage}", f"--tls_key={SERVER_KEY}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--tls_cert: holds no PEM certificate", r.stderr)

    def test_serve_over_mutual_tls(self):
        err_path = os.path.join(self.tmp, "serve.err")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            http_port = s.getsockname()[1]
        with open(err_path, "w") as err:
            serve = subprocess.Popen(
                [BIN, "serve", f"--model={MODEL}", f"--tokenizer={TOK}",
                 "--listen=127.0.0.1:0", f"--http_listen=127.0.0.1:{http_port}",
                 "--backend=cpu", "--threads=1", "--policy=full",
                 f"--kv_service={self.tls.address}", *CLIENT_FLAGS,
                 f"--tls_cert={SERVER_CERT}", f"--tls_key={SERVER_KEY}",
                 f"--tls_client_ca={CA}"],
                stdout=subprocess.DEVNULL, stderr=err)
        try:
            port = None
            for _ in range(2400):
                with open(err_path) as f:
                    log = f.read()
                m = re.search(r"listening on 127\.0\.0\.1:(\d+) over TLS "
                              r"\(mutual\)", log)
                if m and "HTTP API on port" in log:
                    port = int(m.group(1))
                    break
                self.assertIsNone(serve.poll(), log)
                time.sleep(0.025)
            self.assertIsNotNone(port, "serve did not start")
            want = self.generate(self.plain.address)[len("Once upon a time"):]

            def client(*flags):
                return subprocess.run(
                    [GRPC_CLIENT, f"--target=127.0.0.1:{port}",
                     "--max_new_tokens=40", "--deadline_s=20", *flags],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    timeout=120)

            r = client(f"--tls_ca={CA}", f"--tls_cert={CLIENT_CERT}",
                       f"--tls_key={CLIENT_KEY}")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout, want.rstrip("\n"))
            for name, flags in {
                    "plaintext": [],
                    "no client certificate": [f"--tls_ca={CA}"],
                    "another CA's certificate": [
                        f"--tls_ca={CA}", f"--tls_cert={OTHER_CERT}",
                        f"--tls_key={OTHER_KEY}"]}.items():
                with self.subTest(name):
                    r = client(*flags)
                    self.assertEqual(r.returncode, 1, r.stderr)
                    self.assertEqual(r.stdout, "")

            # HTTPS: the same text to a client with the certificates.
            ctx = ssl.create_default_context(cafile=CA)
            ctx.load_cert_chain(CLIENT_CERT, CLIENT_KEY)
            body = json.dumps({"model": "stories260K",
                               "prompt": "Once upon a time",
                               "max_tokens": 40, "temperature": 0}).encode()
            url = f"https://127.0.0.1:{http_port}/v1/completions"
            request = urllib.request.Request(
                url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, context=ctx,
                                        timeout=60) as resp:
                text = json.loads(resp.read())["choices"][0]["text"]
            self.assertEqual(text, want.rstrip("\n"))
            no_cert = ssl.create_default_context(cafile=CA)
            with self.assertRaises((ssl.SSLError, urllib.error.URLError,
                                    ConnectionError)):
                with urllib.request.urlopen(
                        f"https://127.0.0.1:{http_port}/health",
                        context=no_cert, timeout=30) as resp:
                    resp.read()
            with self.assertRaises((urllib.error.URLError, ConnectionError,
                                    http_client_errors())):
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{http_port}/health",
                        timeout=30) as resp:
                    resp.read()
        finally:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait()
        self.assertEqual(serve.returncode, 0)


def http_client_errors():
    import http.client
    return http.client.HTTPException


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
