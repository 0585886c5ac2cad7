#!/usr/bin/env python3
"""The drain of kv_memory_server as an operator meets it: SIGTERM of an idle
node ends it at once with exit status 0, every time, whatever its clients
keep open (a session, a sequence, a fetch connection or stream, shared
memory slots, a health Watch stream, a metrics keep-alive connection).

Each try starts a node, has tests/kv_memory_service/idle_client append
about 4 MiB of rows, fetch them back on one data plane and stay connected,
then sends SIGTERM and times the exit. The planes: "grpc" (a unix socket:
fetches on the gRPC FetchStream), "tcp" (the fetch socket) and "shm"
(shared memory). The node used to wait for idle gRPC clients to read its
GOAWAY (up to a heartbeat, a second), for idle streams (the whole drain),
for a scraper's keep-alive connection (5 s), and, after a fetch stream had
filled its socket, for gRPC's executor threads at exit (up to 10 s: killed
by its own watchdog, exit 1, 'calls still running 6s after the signal').

Usage: drain_test.py KV_MEMORY_SERVER IDLE_CLIENT
"""
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

SERVER, CLIENT = sys.argv[1:3]
# Well above an idle node's exit (tens of milliseconds), well below the
# drain (5 s) and the watchdog (6 s).
EXIT_WITHIN_S = 3.0
TRIES = 6
PLANES = ("grpc", "tcp", "shm")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_file(path, proc, what, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.path.exists(path):
            with open(path) as f:
                return f.read().strip()
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited {proc.returncode} before ready")
        time.sleep(0.02)
    raise AssertionError(f"{what} not ready within {timeout} s")


class Node:
    """A kv_memory_server serving one plane from a private directory."""

    def __init__(self, tmp, plane, extra=()):
        self.tmp, self.plane = tmp, plane
        self.shm = os.path.join(tmp, "shm.sock")
        self.log_path = os.path.join(tmp, "node.log")
        ready = os.path.join(tmp, "node.ready")
        args = [SERVER, f"--ready_file={ready}", "--log_interval=0",
                "--drain_timeout=5s", *extra]
        if plane == "grpc":
            args.append("--listen=unix:" + os.path.join(tmp, "node.sock"))
        else:
            args.append("--listen=127.0.0.1:0")
        if plane == "shm":
            args.append(f"--shm_listen=unix:{self.shm}")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log,
                                         stderr=subprocess.STDOUT)
        self.address = wait_for_file(ready, self.proc, "kv_memory_server")

    def client_address(self):
        return f"shm:unix:{self.shm}" if self.plane == "shm" else self.address

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def terminate(self):
        """SIGTERM; (exit status, seconds until the process was gone)."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        return code, time.monotonic() - start

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Client:
    """An idle_client that has used the node and stays as `then` says."""

    def __init__(self, tmp, address, then="stay", extra=()):
        ready = os.path.join(tmp, "client.ready")
        self.proc = subprocess.Popen(
            [CLIENT, f"--kv_service={address}", f"--ready_file={ready}",
             "--append_bytes=4194304", "--fetch_rounds=2", f"--then={then}",
             *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_for_file(ready, self.proc, "idle_client")
        except AssertionError as e:
            self.stop()
            raise AssertionError(f"{e}: {self.proc.stderr.read()}") from None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stderr.close()


class IdleNodeDrain(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="drain_test.")
        self.procs = []

    def tearDown(self):
        for p in reversed(self.procs):
            p.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def try_dir(self, name):
        d = os.path.join(self.tmp, name)
        os.mkdir(d)
        return d

    def node(self, d, plane, extra=()):
        n = Node(d, plane, extra)
        self.procs.append(n)
        return n

    def client(self, d, address, then="stay", extra=()):
        c = Client(d, address, then, extra)
        self.procs.append(c)
        return c

    def assert_exits_at_once(self, node, what):
        code, took = node.terminate()
        self.assertEqual(code, 0, f"{what}: exit {code} after {took:.2f} s\n"
                                  f"{node.log()}")
        self.assertLess(took, EXIT_WITHIN_S, f"{what}\n{node.log()}")
        # Nothing left behind: the sockets are gone with the node.
        for name in ("node.sock", "shm.sock", "shm.sock.lock"):
            self.assertFalse(os.path.exists(os.path.join(node.tmp, name)),
                             f"{what}: {name} left behind")
        return took

    def test_idle_node_with_a_connected_client_exits_zero_at_once(self):
        for plane in PLANES:
            took = []
            for attempt in range(TRIES):
                with self.subTest(plane=plane, attempt=attempt):
                    d = self.try_dir(f"{plane}.{attempt}")
                    node = self.node(d, plane)
                    self.client(d, node.client_address())
                    time.sleep(0.3)  # idle: no call in flight
                    took.append(self.assert_exits_at_once(
                        node, f"{plane} try {attempt}"))
            print(f"{plane}: {len(took)} idle exits, slowest "
                  f"{max(took, default=0):.2f} s", file=sys.stderr)

    def test_closed_sequence_disconnected_or_exited_client(self):
        for plane in PLANES:
            for then in ("close_sequence", "disconnect", "exited"):
                with self.subTest(plane=plane, then=then):
                    d = self.try_dir(f"{plane}.{then}")
                    node = self.node(d, plane)
                    client = self.client(
                        d, node.client_address(),
                        "disconnect" if then == "exited" else then)
                    if then == "exited":
                        client.stop()
                    time.sleep(0.3)
                    self.assert_exits_at_once(node, f"{plane}, {then}")

    def test_open_health_watch_stream_is_ended_not_waited_for(self):
        for plane in PLANES:
            for attempt in range(2):
                with self.subTest(plane=plane, attempt=attempt):
                    d = self.try_dir(f"{plane}.watch.{attempt}")
                    node = self.node(d, plane)
                    self.client(d, node.client_address(),
                                extra=[f"--watch_health={node.address}"])
                    time.sleep(0.3)
                    self.assert_exits_at_once(
                        node, f"{plane} with a Watch stream, try {attempt}")

    def test_idle_metrics_connection_does_not_hold_the_exit(self):
        d = self.try_dir("metrics")
        port = free_port()
        node = self.node(d, "tcp", [f"--metrics_listen=127.0.0.1:{port}"])
        self.client(d, node.client_address())
        scraper = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            scraper.request("GET", "/metrics")
            reply = scraper.getresponse()
            self.assertEqual(reply.status, 200)
            reply.read()
            # The connection stays open, idle (HTTP keep-alive).
            time.sleep(0.3)
            self.assert_exits_at_once(node, "with an idle /metrics connection")
        finally:
            scraper.close()


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
