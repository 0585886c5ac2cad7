"""Checks the Kubernetes manifests in k8s/ against the binaries and images.

Renders k8s/base and every overlay with `kubectl kustomize` and checks what a
cluster would accept without a word but run wrongly: flags the binaries do
not know (the container exits at start), ports and probes that do not match
what the binaries listen on, Services that select nothing, a worker whose
--kv_service names no memory server in the manifests, a Secret mounted
where --auth_token_file does not look, a worker that does not send (from the
same Secret) the token its memory server requires, TLS files not on the
Secret volumes their flags name or a worker that does not speak the TLS its
memory server speaks, gRPC probes against a TLS port, Secrets that neither
the manifests nor k8s/README.md create, a grace period shorter than the
drain, image names and users that do not match docker/*.Dockerfile.

The binaries' flags come from their own --help. The negative tests at the
end feed deliberately broken manifests to each check and assert that it
reports them, so that no check can pass vacuously.

  bazel test //k8s:manifests_test
  python3 k8s/test/manifests_test.py --infinigen=bazel-bin/gpu_worker/infinigen \\
      --kv_memory_server=bazel-bin/kv_memory_service/kv_memory_server

kubectl comes from $KUBECTL, else PATH: kubectl 1.20 (Debian's
kubernetes-client, kustomize v2) and newer (kustomize v5) must both work.
"""

import argparse
import copy
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import xml.etree.ElementTree as ET

try:
    import yaml
except ImportError:  # pragma: no cover
    sys.exit("manifests_test: PyYAML is missing: install python3-yaml "
             "(scripts/install_deps.sh does)")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# What each kustomization must deploy: the worker's data plane.
EXPECTED_PLANE = {
    "base": "inproc",
    "overlays/single-node": "shm",
    "overlays/disaggregated": "tcp",
    "overlays/disaggregated-rdma": "rdma",
    "overlays/disaggregated-tls": "tcp",
}
# Where k8s/ mounts the token Secret in the memory server and the worker
# (k8s/base/kustomization.yaml, KV_AUTH_TOKEN_FILE): auth is on by default.
AUTH_TOKEN_PATH = "/var/run/secrets/infinigen/kv-auth/token"
AUTH_SECRET = "infinigen-kv-auth"
WORKER, SERVER = "infinigen", "kv_memory_server"
# The flags naming the token file: the server requires it, the worker sends it.
SERVER_TOKEN_FLAG, WORKER_TOKEN_FLAG = "auth_token_file", "kv_auth_token_file"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet")
# The worker's grpc.health.v1 service that stays SERVING while its memory
# node is down (`infinigen serve --help`); the server-wide status ("") does
# not. Liveness and startup must read the first, readiness the second.
WORKER_LIVENESS_SERVICE = "infinigen.worker.Liveness"
# The flags naming TLS files (PEM), per binary: the memory server's and
# serve's own certificate, key and client CA; the worker's view of its
# memory node. Each must be a key of a Secret mounted at its directory.
TLS_FILE_FLAGS = {
    SERVER: ("tls_cert", "tls_key", "tls_client_ca"),
    WORKER: ("tls_cert", "tls_key", "tls_client_ca", "kv_tls_ca",
             "kv_tls_cert", "kv_tls_key"),
}
# Secrets the user creates (k8s/README.md names each): a Secret volume must
# name one of them or a Secret in the manifests.
README = os.path.join(ROOT, "k8s", "README.md")
# Time a binary gets after its drain to log and exit before SIGKILL.
EXIT_MARGIN_S = 5
# The pool must leave the process this much of its memory limit.
POOL_FRACTION_OF_LIMIT = 0.9

ARGS = None  # parsed command line: binary paths


# ---------------------------------------------------------------- inputs ---

def parse_help(text):
    """Flags and defaults from `--help` output ('  --name (default: "x")')."""
    flags = {}
    for m in re.finditer(r'^\s+--([A-Za-z0-9_]+) \(default: "(.*)"\)\s*$',
                         text, re.M):
        flags[m.group(1)] = m.group(2)
    return flags


def binary_flags(path, *args):
    out = subprocess.run([path] + list(args) + ["--help"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         universal_newlines=True, timeout=60)
    flags = parse_help(out.stdout)
    if out.returncode != 0 or not flags:
        raise RuntimeError("%s %s --help gave no flags (rc %d):\n%s"
                           % (path, " ".join(args), out.returncode, out.stdout))
    return flags


class Dockerfile:
    """What k8s/ must agree with in one docker/*.Dockerfile (final stage)."""

    def __init__(self, path):
        self.path = path
        text = open(path).read().replace("\\\n", " ")
        stages = re.split(r"^FROM\s", text, flags=re.M)
        final = stages[-1]
        self.title = None
        m = re.search(r'org\.opencontainers\.image\.title="([^"]+)"', final)
        if m:
            self.title = m.group(1)
        m = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", final, re.M)
        self.entrypoint = yaml.safe_load(m.group(1)) if m else []
        m = re.search(r"^USER\s+(\d+)(?::(\d+))?\s*$", final, re.M)
        self.uid = int(m.group(1)) if m else None
        self.exposed = set()
        for m in re.finditer(r"^EXPOSE\s+(.+)$", final, re.M):
            for p in m.group(1).split():
                self.exposed.add(int(p.split("/")[0]))
        # Directories the final stage fills: a path under one is in the image.
        self.copied_dirs = []
        for m in re.finditer(r"^COPY\s+(?:--\S+\s+)*(.+)$", final, re.M):
            dest = m.group(1).split()[-1]
            self.copied_dirs.append(dest.rstrip("/") + "/")


def load_dockerfiles(root):
    d = os.path.join(root, "docker")
    return [Dockerfile(os.path.join(d, f)) for f in sorted(os.listdir(d))
            if f.endswith(".Dockerfile")]


def kubectl_path():
    path = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not path:
        raise RuntimeError(
            "kubectl not found: the manifests are rendered with `kubectl "
            "kustomize`. Install it (scripts/install_deps.sh installs Debian's "
            "kubernetes-client when kubectl is missing) or set KUBECTL=PATH.")
    return path


def render(kubectl, directory):
    out = subprocess.run([kubectl, "kustomize", directory],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         universal_newlines=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError("kubectl kustomize %s failed:\n%s"
                           % (directory, out.stderr))
    return [d for d in yaml.safe_load_all(out.stdout) if d]


# ----------------------------------------------------------- the model ---

def parse_duration(s):
    """Seconds in an absl duration ("30s", "1m30s", "500ms"); None if bad."""
    s = s.strip()
    if s in ("0", ""):
        return 0.0
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", s)
    if not parts or "".join(a + b for a, b in parts) != s:
        return None
    return sum(float(a) * units[b] for a, b in parts)


def parse_quantity(q):
    """A Kubernetes quantity as a float (cpu cores or bytes)."""
    q = str(q)
    suffixes = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
                "Pi": 2**50, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
                "P": 1e15, "m": 1e-3}
    for suf in sorted(suffixes, key=len, reverse=True):
        if q.endswith(suf):
            return float(q[:-len(suf)]) * suffixes[suf]
    return float(q)


def expand(value, env):
    """Kubernetes' $(VAR) expansion; returns (text, unresolved names)."""
    missing = []

    def sub(m):
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        if name in env:
            return env[name]
        missing.append(name)
        return m.group(0)

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value), missing


class Container:
    """One container of a pod template, with its flags resolved."""

    def __init__(self, manifest, workload, spec, init=False):
        self.workload = workload
        self.spec = spec
        self.name = spec.get("name", "?")
        self.init = init
        self.sidecar = init and spec.get("restartPolicy") == "Always"
        self.errors = []
        command = spec.get("command") or []
        self.binary = os.path.basename(command[0]) if command else None
        self.env = self._env(manifest)
        self.args = []
        for a in spec.get("args") or []:
            text, missing = expand(str(a), self.env)
            for name in missing:
                self.errors.append("%s: $(%s) in args is not defined in the "
                                   "container's env: passed to the binary "
                                   "literally" % (self.where(), name))
            self.args.append(text)
        self.flags = {}
        self.positional = []
        self.repeated = []
        for a in self.args:
            if a.startswith("--"):
                name, _, value = a[2:].partition("=")
                if name in self.flags:
                    self.repeated.append(name)
                self.flags[name] = value if "=" in a else None
            else:
                self.positional.append(a)

    def where(self):
        return "%s/%s container %s" % (self.workload.kind, self.workload.name,
                                        self.name)

    def _env(self, manifest):
        env = {}
        for src in self.spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            ref = src.get("configMapRef")
            if ref:
                data = manifest.configmaps.get(ref.get("name"))
                if data is None:
                    if not ref.get("optional"):
                        self.errors.append("%s: envFrom ConfigMap %s is not in "
                                           "the manifests" % (self.where(),
                                                              ref.get("name")))
                    continue
                for k, v in data.items():
                    env[prefix + k] = str(v)
        for e in self.spec.get("env") or []:
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env)[0]
            elif "valueFrom" in e:
                ref = e["valueFrom"].get("configMapKeyRef")
                if ref:
                    data = manifest.configmaps.get(ref.get("name"), {})
                    if ref.get("key") in data:
                        env[e["name"]] = str(data[ref["key"]])
                    elif not ref.get("optional"):
                        self.errors.append("%s: env %s refers to a missing "
                                           "ConfigMap key" % (self.where(),
                                                              e["name"]))
                else:
                    env[e["name"]] = "<set at run time>"
        return env

    def flag(self, name, defaults):
        v = self.flags.get(name)
        return defaults.get(name, "") if v is None else v

    def ports(self):
        return {p.get("containerPort"): p.get("name")
                for p in self.spec.get("ports") or []}

    def limits(self):
        return (self.spec.get("resources") or {}).get("limits") or {}

    def mount_for(self, path):
        """(volume name, path inside the volume) holding `path`, or None."""
        best = None
        for m in self.spec.get("volumeMounts") or []:
            mp = m.get("mountPath", "").rstrip("/")
            if path == mp or path.startswith(mp + "/"):
                if best is None or len(mp) > len(best[2]):
                    rel = os.path.join(m.get("subPath", ""), path[len(mp):].lstrip("/"))
                    best = (m.get("name"), rel, mp)
        return best and best[:2]

    def capabilities(self):
        sc = self.spec.get("securityContext") or {}
        return set((sc.get("capabilities") or {}).get("add") or [])


class Workload:
    def __init__(self, manifest, obj):
        self.manifest = manifest
        self.obj = obj
        self.kind = obj["kind"]
        self.name = obj["metadata"]["name"]
        self.namespace = obj["metadata"].get("namespace")
        self.template = (obj.get("spec") or {}).get("template") or {}
        self.pod = self.template.get("spec") or {}
        self.labels = (self.template.get("metadata") or {}).get("labels") or {}
        self.annotations = ((self.template.get("metadata") or {})
                            .get("annotations") or {})
        self.containers = [Container(manifest, self, c)
                           for c in self.pod.get("containers") or []]
        self.containers += [Container(manifest, self, c, init=True)
                            for c in self.pod.get("initContainers") or []]
        self.volumes = {v.get("name"): v for v in self.pod.get("volumes") or []}

    def replicas(self):
        return (self.obj.get("spec") or {}).get("replicas", 1)


class Manifest:
    """A rendered kustomization, indexed for the checks."""

    def __init__(self, docs, name="?"):
        self.name = name
        self.docs = docs
        self.configmaps = {d["metadata"]["name"]: d.get("data") or {}
                           for d in docs if d.get("kind") == "ConfigMap"}
        self.secrets = {d["metadata"]["name"]: d for d in docs
                        if d.get("kind") == "Secret"}
        self.services = [d for d in docs if d.get("kind") == "Service"]
        self.pdbs = [d for d in docs if d.get("kind") == "PodDisruptionBudget"]
        self.netpols = [d for d in docs if d.get("kind") == "NetworkPolicy"]
        self.nads = {d["metadata"]["name"] for d in docs
                     if d.get("kind") == "NetworkAttachmentDefinition"}
        self.workloads = [Workload(self, d) for d in docs
                          if d.get("kind") in WORKLOAD_KINDS]

    def containers(self, binary=None):
        return [c for w in self.workloads for c in w.containers
                if binary is None or c.binary == binary]

    def selected(self, selector):
        """Workloads whose pods carry every label of `selector`."""
        if not selector:
            return []
        return [w for w in self.workloads
                if all(w.labels.get(k) == v for k, v in selector.items())]


class Context:
    """The binaries' flags and the Dockerfiles."""

    def __init__(self, flags, dockerfiles):
        self.flags = flags  # binary name -> {flag: default}
        self.dockerfiles = dockerfiles


def listen_port(c, ctx):
    listen = c.flag("listen", ctx.flags[c.binary])
    if listen.startswith("unix:") or ":" not in listen:
        return None
    try:
        return int(listen.rsplit(":", 1)[1])
    except ValueError:
        return None


def http_port(c, ctx):
    """The worker's --http_listen port (the OpenAI API), or None (not a
    flag of the binary, not set, not HOST:PORT, or 0)."""
    defaults = ctx.flags[c.binary]
    if "http_listen" not in defaults:
        return None
    listen = c.flag("http_listen", defaults)
    if ":" not in listen:
        return None
    try:
        return int(listen.rsplit(":", 1)[1]) or None
    except ValueError:
        return None


def metrics_port(c, ctx):
    """The --metrics_listen port, or None (not set, not HOST:PORT, or 0)."""
    listen = c.flag("metrics_listen", ctx.flags[c.binary])
    if ":" not in listen:
        return None
    try:
        return int(listen.rsplit(":", 1)[1]) or None
    except ValueError:
        return None


# ------------------------------------------------------------ the checks ---
# Each returns a list of messages, empty when all is well.

def check_structure(m, ctx):
    """Shapes a cluster rejects only at apply time (kustomize v2 once
    turned volumeClaimTemplates into a map), and containers without an
    explicit command, whose flags could not be checked."""
    errors = []
    for w in m.workloads:
        spec = w.obj.get("spec") or {}
        for field in ("volumeClaimTemplates",):
            if field in spec and not isinstance(spec[field], list):
                errors.append("%s/%s: spec.%s is not a list"
                              % (w.kind, w.name, field))
        for field in ("containers", "initContainers", "volumes"):
            if field in w.pod and not isinstance(w.pod[field], list):
                errors.append("%s/%s: %s is not a list" % (w.kind, w.name, field))
        for c in w.containers:
            if c.binary not in ctx.flags:
                errors.append("%s: command %r is not one of the binaries %s"
                              % (c.where(), c.spec.get("command"),
                                 sorted(ctx.flags)))
    return errors


def check_flags(m, ctx):
    """Every --flag is one the binary lists in --help, once; no stray
    positional arguments; every $(VAR) resolves."""
    errors = []
    for c in m.containers():
        errors += c.errors
        if c.binary not in ctx.flags:
            continue
        known = ctx.flags[c.binary]
        positional = list(c.positional)
        if c.binary == WORKER:
            if not positional or positional[0] != "serve":
                errors.append("%s: infinigen needs the command 'serve' first, "
                              "got %r" % (c.where(), c.args[:1]))
            positional = positional[1:]
        for p in positional:
            errors.append("%s: unexpected positional argument %r (the binary "
                          "exits 2)" % (c.where(), p))
        for name in c.flags:
            if name not in known:
                errors.append("%s: --%s is not a flag of %s (its --help lists "
                              "%s)" % (c.where(), name, c.binary,
                                       ", ".join(sorted(known))))
        for name in c.repeated:
            errors.append("%s: --%s given twice (the last one wins silently)"
                          % (c.where(), name))
    return errors


def check_resources(m, ctx):
    """Requests and limits for cpu and memory on every container; extended
    resources (GPUs, RDMA devices) equal in both."""
    errors = []
    for c in m.containers():
        res = c.spec.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        for kind, d in (("requests", req), ("limits", lim)):
            for r in ("cpu", "memory"):
                if r not in d:
                    errors.append("%s: no %s.%s" % (c.where(), kind, r))
        for r in ("cpu", "memory"):
            if r in req and r in lim and \
                    parse_quantity(req[r]) > parse_quantity(lim[r]):
                errors.append("%s: %s request above its limit" % (c.where(), r))
        for r in set(req) | set(lim):
            if "/" in r and str(req.get(r)) != str(lim.get(r)):
                errors.append("%s: extended resource %s must have equal "
                              "request and limit" % (c.where(), r))
    return errors


def check_ports_and_probes(m, ctx):
    """Container ports are the ports the binary listens on (--listen, the
    server's --fetch_port), and the readiness, liveness and startup probes
    are gRPC health checks on the --listen port."""
    errors = []
    for c in m.containers():
        if c.binary not in ctx.flags:
            continue
        defaults = ctx.flags[c.binary]
        port = listen_port(c, ctx)
        if port is None or port == 0:
            errors.append("%s: --listen=%s is not a fixed TCP port: nothing "
                          "to probe or to reach" % (c.where(),
                                                    c.flag("listen", defaults)))
            continue
        declared = c.ports()
        wanted = {port: "--listen"}
        tls = bool(c.flag("tls_cert", defaults))
        if c.binary == SERVER:
            # Under --tls_cert the fetch socket speaks TLS: the same port.
            try:
                fetch = int(c.flag("fetch_port", defaults))
            except ValueError:
                fetch = None
            if fetch == 0:
                errors.append("%s: --fetch_port=0 opens a random port that no "
                              "containerPort, Service or NetworkPolicy names; "
                              "set it (or -1 for none)" % c.where())
            elif fetch and fetch > 0:
                wanted[fetch] = "--fetch_port"
        http = c.flag("http_listen", defaults) if "http_listen" in defaults \
            else ""
        hport = http_port(c, ctx)
        if http:
            if not hport:
                errors.append("%s: --http_listen=%s is not a fixed TCP port: "
                              "nothing to probe or to reach" % (c.where(), http))
            else:
                wanted[hport] = "--http_listen"
        metrics = c.flag("metrics_listen", defaults)
        if metrics:
            mport = metrics_port(c, ctx)
            if not mport:
                errors.append("%s: --metrics_listen=%s is not a fixed TCP "
                              "port: nothing to scrape" % (c.where(), metrics))
            else:
                wanted[mport] = "--metrics_listen"
        for p, what in wanted.items():
            if p not in declared:
                errors.append("%s: %s port %d is not a containerPort "
                              "(declared: %s)" % (c.where(), what, p,
                                                  sorted(declared)))
        for p in declared:
            if p not in wanted:
                errors.append("%s: containerPort %s is not a port the binary "
                              "listens on (%s)" % (c.where(), p, wanted))
        for probe in ("readinessProbe", "livenessProbe"):
            if probe not in c.spec:
                errors.append("%s: no %s" % (c.where(), probe))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = c.spec.get(probe)
            if spec is None:
                continue
            grpc = spec.get("grpc")
            get = spec.get("httpGet")
            if get is not None and c.binary == WORKER and \
                    probe == "readinessProbe":
                # The OpenAI API's /health: 503 while the memory node is
                # down, like gRPC's server-wide status.
                names = {n: p for p, n in declared.items()}
                target = names.get(get.get("port"), get.get("port"))
                scheme = (get.get("scheme") or "HTTP").upper()
                if not hport:
                    errors.append("%s: readinessProbe is an HTTP probe but "
                                  "the worker has no --http_listen"
                                  % c.where())
                elif target != hport:
                    errors.append("%s: readinessProbe checks HTTP port %r, "
                                  "--http_listen is %d"
                                  % (c.where(), get.get("port"), hport))
                elif get.get("path") != "/health":
                    errors.append("%s: readinessProbe reads %r; the API's "
                                  "health is /health (503 while the memory "
                                  "node is down)" % (c.where(), get.get("path")))
                elif tls and scheme != "HTTPS":
                    errors.append("%s: readinessProbe speaks HTTP to an API "
                                  "that serves HTTPS under --tls_cert"
                                  % c.where())
                elif not tls and scheme != "HTTP":
                    errors.append("%s: readinessProbe speaks %s to a "
                                  "plaintext API" % (c.where(), scheme))
                continue
            if tls:
                # The kubelet's gRPC probes do not speak TLS: each would
                # fail its handshake and restart the pod forever.
                tcp = spec.get("tcpSocket")
                if grpc is not None or tcp is None:
                    errors.append("%s: %s under --tls_cert must be a "
                                  "tcpSocket probe: the kubelet's gRPC probes "
                                  "do not speak TLS" % (c.where(), probe))
                elif tcp.get("port") != port:
                    errors.append("%s: %s checks port %r, --listen is %d"
                                  % (c.where(), probe, tcp.get("port"), port))
            elif grpc is None:
                errors.append("%s: %s is not a grpc probe; the binary answers "
                              "grpc.health.v1 on its --listen port"
                              % (c.where(), probe))
            elif grpc.get("port") != port:
                errors.append("%s: %s checks port %r, --listen is %d"
                              % (c.where(), probe, grpc.get("port"), port))
            elif c.binary == WORKER:
                service = grpc.get("service") or ""
                if probe == "readinessProbe" and service:
                    errors.append(
                        "%s: readinessProbe reads service %r, which does not "
                        "follow the memory node; read the server-wide status "
                        "(no service), NOT_SERVING while the memory node is "
                        "down" % (c.where(), service))
                elif probe != "readinessProbe" and \
                        service != WORKER_LIVENESS_SERVICE:
                    errors.append(
                        "%s: %s reads service %r, which is NOT_SERVING while "
                        "the memory node is down: the kubelet would restart "
                        "every worker during its outage; read service %r"
                        % (c.where(), probe, service, WORKER_LIVENESS_SERVICE))
    return errors


def _target_ports(w, target):
    """The container ports of workload `w` that a Service targetPort names."""
    found = []
    for c in w.containers:
        for p, name in c.ports().items():
            if target == p or (isinstance(target, str) and target == name):
                found.append(p)
    return found


def check_services(m, ctx):
    """Service selectors select pods, their targetPorts exist on those pods;
    a StatefulSet's serviceName is a headless Service selecting it; a PDB
    covers each memory server; NetworkPolicies let workers reach the
    memory server and clients reach the workers."""
    errors = []
    for s in m.services:
        name = s["metadata"]["name"]
        spec = s.get("spec") or {}
        pods = m.selected(spec.get("selector") or {})
        if not pods:
            errors.append("Service/%s: selector %s matches no pod template"
                          % (name, spec.get("selector")))
            continue
        for port in spec.get("ports") or []:
            target = port.get("targetPort", port.get("port"))
            for w in pods:
                if not _target_ports(w, target):
                    errors.append("Service/%s: targetPort %r is not a port of "
                                  "%s/%s" % (name, target, w.kind, w.name))
    for w in m.workloads:
        if w.kind != "StatefulSet":
            continue
        svc_name = (w.obj.get("spec") or {}).get("serviceName")
        svc = [s for s in m.services if s["metadata"]["name"] == svc_name]
        if not svc:
            errors.append("StatefulSet/%s: serviceName %r is not a Service in "
                          "the manifests (no pod DNS names)" % (w.name, svc_name))
            continue
        spec = svc[0].get("spec") or {}
        if spec.get("clusterIP") != "None":
            errors.append("StatefulSet/%s: Service %s is not headless "
                          "(clusterIP: None): pods get no DNS names"
                          % (w.name, svc_name))
        if w not in m.selected(spec.get("selector") or {}):
            errors.append("StatefulSet/%s: Service %s does not select its pods"
                          % (w.name, svc_name))
    for pdb in m.pdbs:
        sel = ((pdb.get("spec") or {}).get("selector") or {}).get("matchLabels")
        if not m.selected(sel or {}):
            errors.append("PodDisruptionBudget/%s selects no pods"
                          % pdb["metadata"]["name"])
    for w in m.workloads:
        if any(c.binary == SERVER for c in w.containers) and \
                not any(c.binary == WORKER for c in w.containers):
            covered = [p for p in m.pdbs if w in m.selected(
                ((p.get("spec") or {}).get("selector") or {})
                .get("matchLabels") or {})]
            if not covered:
                errors.append("%s/%s: no PodDisruptionBudget covers the memory "
                              "server" % (w.kind, w.name))
    for c in m.containers(WORKER):
        hport = http_port(c, ctx)
        if not hport:
            continue
        exposed = False
        for svc in m.services:
            spec = svc.get("spec") or {}
            if c.workload not in m.selected(spec.get("selector") or {}):
                continue
            for port in spec.get("ports") or []:
                target = port.get("targetPort", port.get("port"))
                if hport in _target_ports(c.workload, target):
                    exposed = True
        if not exposed:
            errors.append("%s: no Service exposes the OpenAI API's port %d "
                          "(--http_listen)" % (c.where(), hport))
    errors += _check_network_policies(m, ctx)
    return errors


def _allows(m, target, source, port):
    """Whether the NetworkPolicies let pods of `source` (None: any client)
    reach `port` on pods of `target`."""
    policies = [p for p in m.netpols
                if target in m.selected(((p.get("spec") or {})
                                         .get("podSelector") or {})
                                        .get("matchLabels") or {})
                and "Ingress" in ((p.get("spec") or {})
                                  .get("policyTypes") or ["Ingress"])]
    if not policies:
        return True
    names = {p: n for c in target.containers for p, n in c.ports().items()}
    for p in policies:
        for rule in (p.get("spec") or {}).get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(q.get("port") in (port, names.get(port))
                                 for q in ports):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            if source is None:
                continue
            for peer in peers:
                sel = (peer.get("podSelector") or {}).get("matchLabels")
                if sel is not None and "namespaceSelector" not in peer and \
                        source in m.selected(sel):
                    return True
                if sel == {} and "namespaceSelector" not in peer:
                    return True
    return False


def _check_network_policies(m, ctx):
    errors = []
    for p in m.netpols:
        sel = ((p.get("spec") or {}).get("podSelector") or {}).get("matchLabels")
        if sel and not m.selected(sel):
            errors.append("NetworkPolicy/%s selects no pods"
                          % p["metadata"]["name"])
    for c in m.containers(WORKER):
        port = listen_port(c, ctx)
        if port and not _allows(m, c.workload, None, port):
            errors.append("%s: NetworkPolicy lets no client reach the worker's "
                          "port %d" % (c.where(), port))
        hport = http_port(c, ctx)
        if hport and not _allows(m, c.workload, None, hport):
            errors.append("%s: NetworkPolicy lets no client reach the OpenAI "
                          "API's port %d" % (c.where(), hport))
        server = _resolve_server(m, c, ctx)[0]
        if server is None or server.workload is c.workload:
            continue
        for p in _server_ports_used(server, ctx, _plane(c, ctx)):
            if not _allows(m, server.workload, c.workload, p):
                errors.append("%s: NetworkPolicy blocks it from the memory "
                              "server's port %d (%s/%s)"
                              % (c.where(), p, server.workload.kind,
                                 server.workload.name))
    return errors


def _plane(c, ctx):
    return _plane_of(c.flag("kv_service", ctx.flags[WORKER]).split(",")[0])


def _plane_of(kv):
    for prefix, plane in (("inproc:", "inproc"), ("shm:", "shm"),
                          ("tcp://", "tcp"), ("rdma://", "rdma"),
                          ("unix:", "unix")):
        if kv.startswith(prefix):
            return plane
    return "unknown"


def _server_ports_used(server, ctx, plane):
    ports = [listen_port(server, ctx)]
    if plane == "tcp" and not server.flag("tls_cert", ctx.flags[SERVER]):
        try:
            fetch = int(server.flag("fetch_port", ctx.flags[SERVER]))
        except ValueError:
            fetch = -1
        if fetch > 0:
            ports.append(fetch)
    return [p for p in ports if p]


def _resolve_server(m, c, ctx):
    """The memory server container a worker's --kv_service reaches, and the
    errors met on the way: (container or None, errors). A memory tier
    (a comma-separated list) must reach one memory server workload, list
    each of its StatefulSet pods once and every one of them: a pod left out
    holds nothing."""
    kv = c.flag("kv_service", ctx.flags[WORKER])
    parts = kv.split(",")
    if _plane(c, ctx) not in ("tcp", "rdma"):
        return _resolve_one(m, c, ctx, kv)
    errors = []
    found = []
    for part in parts:
        if _plane_of(part) != _plane(c, ctx):
            errors.append("%s: --kv_service=%s mixes data planes"
                          % (c.where(), kv))
        srv, errs = _resolve_one(m, c, ctx, part)
        errors += errs
        if srv is not None:
            found.append(srv)
    if errors:
        return None, errors
    if any(s is not found[0] for s in found):
        return None, ["%s: --kv_service=%s reaches several memory server "
                      "workloads: a tier is the pods of one StatefulSet"
                      % (c.where(), kv)]
    w = found[0].workload
    hosts = [p.split("://", 1)[-1].split("?", 1)[0].rpartition(":")[0]
             for p in parts]
    ordinals = []
    for h in hosts:
        mo = re.match(r"^%s-(\d+)$" % re.escape(w.name), h.split(".")[0])
        if not mo and len(parts) == 1:
            return found[0], []  # one Service name
        if not mo:
            return None, ["%s: --kv_service=%s: %s is not a pod of StatefulSet "
                          "%s (<name>-<n>.<headless service>): a Service "
                          "would spread one node's rows over every pod"
                          % (c.where(), kv, h, w.name)]
        ordinals.append(int(mo.group(1)))
    if sorted(ordinals) != list(range(w.replicas())):
        return None, ["%s: --kv_service lists pods %s of StatefulSet %s, which "
                      "has %d replicas: list each pod once, all of them"
                      % (c.where(), sorted(ordinals), w.name, w.replicas())]
    return found[0], []


def _resolve_one(m, c, ctx, kv):
    plane = _plane_of(kv)
    if plane in ("inproc", "unknown", "unix"):
        return None, []
    if plane == "shm":
        path = kv[len("shm:"):]
        if not path.startswith("unix:"):
            return None, ["%s: --kv_service=%s: want shm:unix:PATH"
                          % (c.where(), kv)]
        path = path[len("unix:"):]
        mine = c.mount_for(path)
        if mine is None:
            return None, ["%s: the shm socket %s is on no volume mounted in the "
                          "worker: the memory server cannot share it"
                          % (c.where(), path)]
        for s in c.workload.containers:
            if s.binary != SERVER:
                continue
            shm = s.flag("shm_listen", ctx.flags[SERVER])
            if not shm.startswith("unix:"):
                continue
            theirs = s.mount_for(shm[len("unix:"):])
            if theirs == mine:
                return s, []
        return None, ["%s: no memory server in the same pod serves "
                      "--shm_listen on volume %s at %s"
                      % (c.where(), mine[0], mine[1])]
    # tcp:// and rdma://: a Service name or a StatefulSet pod's DNS name.
    rest = kv.split("://", 1)[1].split("?", 1)[0]
    host, _, port_s = rest.rpartition(":")
    try:
        port = int(port_s)
    except ValueError:
        return None, ["%s: --kv_service=%s has no port" % (c.where(), kv)]
    labels = host.split(".")
    suffix = labels[1:]
    errors = []

    def namespace_ok(obj, rest_labels):
        ns = rest_labels[0] if rest_labels else None
        want = obj["metadata"].get("namespace")
        return ns is None or want is None or ns == want

    # <svc>[.<ns>[.svc[.cluster.local]]]
    for s in m.services:
        if labels[0] == s["metadata"]["name"] and namespace_ok(s, suffix):
            spec = s.get("spec") or {}
            sp = [p for p in spec.get("ports") or [] if p.get("port") == port]
            if not sp:
                return None, ["%s: Service %s has no port %d"
                              % (c.where(), labels[0], port)]
            for w in m.selected(spec.get("selector") or {}):
                target = sp[0].get("targetPort", port)
                for srv in w.containers:
                    if srv.binary == SERVER and \
                            listen_port(srv, ctx) in _target_ports(w, target):
                        return srv, []
            return None, ["%s: Service %s port %d leads to no memory server's "
                          "--listen port" % (c.where(), labels[0], port)]
    # <statefulset>-<ordinal>.<svc>[.<ns>...]
    if suffix:
        for w in m.workloads:
            if w.kind != "StatefulSet":
                continue
            svc = (w.obj.get("spec") or {}).get("serviceName")
            mo = re.match(r"^(.*)-(\d+)$", labels[0])
            if not mo or mo.group(1) != w.name or suffix[0] != svc or \
                    not namespace_ok(w.obj, suffix[1:]):
                continue
            if int(mo.group(2)) >= w.replicas():
                return None, ["%s: %s: the StatefulSet has %d replicas"
                              % (c.where(), labels[0], w.replicas())]
            for srv in w.containers:
                if srv.binary == SERVER:
                    if listen_port(srv, ctx) != port:
                        return None, ["%s: --kv_service port %d is not the "
                                      "memory server's --listen port %s"
                                      % (c.where(), port,
                                         listen_port(srv, ctx))]
                    return srv, []
    errors.append("%s: --kv_service=%s: %s is neither a Service nor a "
                  "StatefulSet pod (<name>-<n>.<headless service>) in the "
                  "manifests" % (c.where(), kv, host))
    return None, errors


def check_kv_service(m, ctx, expected_plane=None):
    """The worker's --kv_service reaches a memory server of these manifests
    on its real port (shm: the same socket in a shared Memory emptyDir;
    tcp/rdma: Service or StatefulSet pod DNS), with a policy that uses it;
    RDMA has its devices and IPC_LOCK on both sides."""
    errors = []
    servers = m.containers(SERVER)
    for c in m.containers(WORKER):
        plane = _plane(c, ctx)
        kv = c.flag("kv_service", ctx.flags[WORKER])
        if expected_plane and plane != expected_plane:
            errors.append("%s: --kv_service=%s is the %s plane, this "
                          "kustomization is meant for %s"
                          % (c.where(), kv, plane, expected_plane))
        if plane == "inproc":
            if servers:
                errors.append("%s: --kv_service=inproc: while a memory server "
                              "is deployed: it is never used" % c.where())
            continue
        if c.flag("policy", ctx.flags[WORKER]) == "ideal":
            errors.append("%s: --policy=ideal keeps the whole cache local: "
                          "the memory server at %s is never used"
                          % (c.where(), kv))
        server, errs = _resolve_server(m, c, ctx)
        errors += errs
        if server is None:
            if not errs:
                errors.append("%s: --kv_service=%s reaches no memory server in "
                              "the manifests" % (c.where(), kv))
            continue
        if plane == "shm":
            volume = c.workload.volumes.get(c.mount_for(kv[len("shm:unix:"):])[0])
            if ((volume or {}).get("emptyDir") or {}).get("medium") != "Memory":
                errors.append("%s: the shm socket's volume is not an emptyDir "
                              "of medium Memory" % c.where())
        # tcp:// fetches want the fetch socket (a TLS one under --tls_cert).
        if plane == "tcp":
            try:
                fetch = int(server.flag("fetch_port", ctx.flags[SERVER]))
            except ValueError:
                fetch = 0
            if fetch <= 0:
                errors.append("%s: the memory server has no fixed --fetch_port: "
                              "tcp:// fetches fall back to the slower gRPC "
                              "stream" % server.where())
        if plane == "rdma":
            if not server.flag("rdma_device", ctx.flags[SERVER]):
                errors.append("%s: rdma:// worker but the memory server has no "
                              "--rdma_device" % server.where())
            for side in (c, server):
                if "IPC_LOCK" not in side.capabilities():
                    errors.append("%s: RDMA needs the IPC_LOCK capability to "
                                  "register memory" % side.where())
                if not any("rdma" in r or "sriov" in r for r in side.limits()):
                    errors.append("%s: no RDMA device resource (e.g. "
                                  "rdma/hca_shared_devices_a) in its limits"
                                  % side.where())
                nets = side.workload.annotations.get(
                    "k8s.v1.cni.cncf.io/networks")
                for net in (nets or "").split(","):
                    net = net.strip().split("@")[0].split("/")[-1]
                    if net and m.nads and net not in m.nads:
                        errors.append("%s: network %s is not a "
                                      "NetworkAttachmentDefinition here"
                                      % (side.where(), net))
    return errors


def check_single_node(m, ctx):
    """A pod holding both a worker and a memory server shares an emptyDir of
    medium Memory between them."""
    errors = []
    for w in m.workloads:
        kinds = {c.binary: c for c in w.containers}
        if WORKER not in kinds or SERVER not in kinds:
            continue
        shared = []
        for name, v in w.volumes.items():
            if ((v.get("emptyDir") or {}).get("medium")) != "Memory":
                continue
            mounted = [c for c in (kinds[WORKER], kinds[SERVER])
                       if any(vm.get("name") == name
                              for vm in c.spec.get("volumeMounts") or [])]
            if len(mounted) == 2:
                shared.append(name)
        if not shared:
            errors.append("%s/%s: worker and memory server share no emptyDir of "
                          "medium Memory" % (w.kind, w.name))
    return errors


def _token_source(c, flag, ctx):
    """Where a container's token flag (--auth_token_file of the server,
    --kv_auth_token_file of the worker) reads: (path, Secret name, key,
    errors); path "" when the flag is unset or empty."""
    path = c.flag(flag, ctx.flags[c.binary])
    if not path:
        return "", None, None, []
    mount = c.mount_for(path)
    volume = c.workload.volumes.get(mount[0]) if mount else None
    if mount is None or mount[1] != os.path.basename(path):
        return path, None, None, [
            "%s: --%s=%s: no volume is mounted at %s"
            % (c.where(), flag, path, os.path.dirname(path))]
    secret = (volume or {}).get("secret")
    if not secret:
        return path, None, None, [
            "%s: --%s=%s is on volume %s, which is not a Secret"
            % (c.where(), flag, path, mount[0])]
    errors = []
    name = secret.get("secretName")
    if secret.get("optional"):
        errors.append("%s: --%s=%s: Secret volume %s is optional: without "
                      "Secret %s the pod starts anyway and the binary exits "
                      "with '--%s: ...'" % (c.where(), flag, path, mount[0],
                                            name, flag))
    key = mount[1]
    items = secret.get("items")
    if items:
        keys = [i.get("key") for i in items if i.get("path") == mount[1]]
        if not keys:
            errors.append("%s: Secret volume %s does not project %s"
                          % (c.where(), mount[0], mount[1]))
        key = keys[0] if keys else None
    rendered = c.workload.manifest.secrets.get(name)
    if rendered and key and key not in \
            set(rendered.get("data") or {}) | set(rendered.get("stringData") or {}):
        errors.append("%s: Secret %s has no key %s" % (c.where(), name, key))
    return path, name, key, errors


def check_auth(m, ctx):
    """Token files are on Secret volumes (not optional) mounted at their
    directory, in the memory server (--auth_token_file) and in the worker
    (--kv_auth_token_file); every worker reaching a server that requires a
    token sends one, read from the same path of the same Secret key; and no
    worker sends a token to a server that checks none."""
    errors = []
    sources = {}
    for c in m.containers(SERVER) + m.containers(WORKER):
        flag = SERVER_TOKEN_FLAG if c.binary == SERVER else WORKER_TOKEN_FLAG
        if flag not in ctx.flags[c.binary]:
            sources[id(c)] = ("", None, None)
            continue
        path, name, key, errs = _token_source(c, flag, ctx)
        sources[id(c)] = (path, name, key)
        errors += errs
    for c in m.containers(WORKER):
        server = _resolve_server(m, c, ctx)[0]
        if server is None:
            continue
        s_path, s_name, s_key = sources[id(server)]
        w_path, w_name, w_key = sources[id(c)]
        if s_path and WORKER_TOKEN_FLAG not in ctx.flags[WORKER]:
            errors.append("%s: the memory server requires a token but "
                          "`infinigen serve` has no --%s to send one: every "
                          "KV call would fail UNAUTHENTICATED"
                          % (c.where(), WORKER_TOKEN_FLAG))
        elif s_path and not w_path:
            errors.append("%s: does not pass --%s to the memory server %s, "
                          "which requires a token (--%s=%s): every KV call "
                          "fails UNAUTHENTICATED" % (
                              c.where(), WORKER_TOKEN_FLAG, server.where(),
                              SERVER_TOKEN_FLAG, s_path))
        elif w_path and not s_path:
            errors.append("%s: sends the token in --%s=%s, but the memory "
                          "server %s has no --%s: it checks none (auth off)"
                          % (c.where(), WORKER_TOKEN_FLAG, w_path,
                             server.where(), SERVER_TOKEN_FLAG))
        elif s_path and w_path:
            if w_path != s_path:
                errors.append("%s: --%s=%s is not the memory server's --%s=%s"
                              % (c.where(), WORKER_TOKEN_FLAG, w_path,
                                 SERVER_TOKEN_FLAG, s_path))
            if s_name and w_name and (w_name, w_key) != (s_name, s_key):
                errors.append("%s: --%s reads Secret %s key %s, the memory "
                              "server %s reads Secret %s key %s: the tokens "
                              "can differ" % (c.where(), WORKER_TOKEN_FLAG,
                                              w_name, w_key, server.where(),
                                              s_name, s_key))
    return errors


def check_api_key(m, ctx):
    """A worker serving the OpenAI API (--http_listen) reads its key
    (--api_key_file) from a Secret volume that is not optional: without a
    key, anyone who reaches the port generates."""
    errors = []
    for c in m.containers(WORKER):
        if "api_key_file" not in ctx.flags[WORKER]:
            continue
        hport = http_port(c, ctx)
        path, name, key, errs = _token_source(c, "api_key_file", ctx)
        errors += errs
        if hport and not path:
            errors.append("%s: the OpenAI API on port %d has no "
                          "--api_key_file: it answers anyone who reaches it"
                          % (c.where(), hport))
    return errors


def _documented_secrets():
    """Secret names k8s/README.md tells the user to create."""
    with open(README) as f:
        text = f.read()
    return set(re.findall(r"kubectl create secret generic ([a-z0-9-]+)", text))


def check_secrets(m, ctx):
    """Every Secret a pod mounts is in the manifests or is one the user is
    told to create in k8s/README.md (`kubectl create secret generic NAME`):
    otherwise the pod never starts."""
    errors = []
    documented = _documented_secrets()
    for w in m.workloads:
        for v in w.volumes.values():
            name = (v.get("secret") or {}).get("secretName")
            if name and name not in m.secrets and name not in documented:
                errors.append("%s/%s: volume %s mounts Secret %s, which is "
                              "neither in the manifests nor created in "
                              "k8s/README.md" % (w.kind, w.name,
                                                 v.get("name"), name))
    return errors


def check_tls(m, ctx):
    """TLS files (the servers' --tls_cert/--tls_key/--tls_client_ca, the
    worker's --kv_tls_ca/--kv_tls_cert/--kv_tls_key) are keys of Secret
    volumes (not optional) mounted at their directory; certificates come
    with their keys; and each worker speaks what its memory server speaks:
    TLS (--kv_tls_ca) to a server with --tls_cert, a client certificate
    (--kv_tls_cert) to one with --tls_client_ca, and plaintext otherwise."""
    errors = []
    for c in m.containers(SERVER) + m.containers(WORKER):
        defaults = ctx.flags[c.binary]
        for flag in TLS_FILE_FLAGS[c.binary]:
            if flag not in defaults:
                if c.flags.get(flag):
                    errors.append("%s: the binary has no --%s"
                                  % (c.where(), flag))
                continue
            errors += _token_source(c, flag, ctx)[3]
        for cert, key in (("tls_cert", "tls_key"),
                          ("kv_tls_cert", "kv_tls_key")):
            if cert in defaults and \
                    bool(c.flag(cert, defaults)) != bool(c.flag(key, defaults)):
                errors.append("%s: --%s and --%s go together (the binary "
                              "exits 2)" % (c.where(), cert, key))
        if c.flag("tls_client_ca", defaults) and \
                not c.flag("tls_cert", defaults):
            errors.append("%s: --tls_client_ca without --tls_cert (the "
                          "binary exits 2)" % c.where())
        if c.binary == WORKER and not c.flag("kv_tls_ca", defaults) and (
                c.flag("kv_tls_cert", defaults) or
                c.flag("kv_tls_server_name", defaults)):
            errors.append("%s: --kv_tls_cert and --kv_tls_server_name need "
                          "--kv_tls_ca (the binary exits 2)" % c.where())
    for c in m.containers(WORKER):
        server = _resolve_server(m, c, ctx)[0]
        if server is None:
            continue
        w = lambda f: c.flag(f, ctx.flags[WORKER])
        srv = lambda f: server.flag(f, ctx.flags[SERVER])
        if srv("tls_cert") and not w("kv_tls_ca"):
            errors.append("%s: the memory server %s serves TLS (--tls_cert) "
                          "but the worker has no --kv_tls_ca: it cannot "
                          "connect" % (c.where(), server.where()))
        if w("kv_tls_ca") and not srv("tls_cert"):
            errors.append("%s: --kv_tls_ca, but the memory server %s serves "
                          "plaintext (no --tls_cert): the handshake fails"
                          % (c.where(), server.where()))
        if srv("tls_client_ca") and not w("kv_tls_cert"):
            errors.append("%s: the memory server %s requires a client "
                          "certificate (--tls_client_ca) but the worker has "
                          "no --kv_tls_cert: it is refused"
                          % (c.where(), server.where()))
    return errors


def check_grace(m, ctx):
    """terminationGracePeriodSeconds covers the preStop sleep and the
    --drain_timeout of each container (sidecars drain after the others)."""
    errors = []
    for w in m.workloads:
        grace = w.pod.get("terminationGracePeriodSeconds", 30)
        main_need, sidecar_need = 0.0, 0.0
        for c in w.containers:
            if c.binary not in ctx.flags:
                continue
            drain = parse_duration(c.flag("drain_timeout", ctx.flags[c.binary]))
            if drain is None:
                errors.append("%s: --drain_timeout=%s is not a duration"
                              % (c.where(), c.flags.get("drain_timeout")))
                continue
            pre = ((c.spec.get("lifecycle") or {}).get("preStop") or {})
            cmd = (pre.get("exec") or {}).get("command") or []
            sleep = 0.0
            words = shlex.split(" ".join(cmd))
            if "sleep" in words and words.index("sleep") + 1 < len(words):
                sleep = float(words[words.index("sleep") + 1])
            need = sleep + drain
            if c.sidecar:
                sidecar_need = max(sidecar_need, need)
            else:
                main_need = max(main_need, need)
        need = main_need + sidecar_need
        if need and grace < need + EXIT_MARGIN_S:
            errors.append("%s/%s: terminationGracePeriodSeconds %s is less than "
                          "preStop + drain (%gs) + %ds to exit: SIGKILL cuts "
                          "the drain short" % (w.kind, w.name, grace, need,
                                               EXIT_MARGIN_S))
    return errors


def check_images(m, ctx, need_tag=True):
    """Each container's image is the Dockerfile whose ENTRYPOINT is its
    command (same title, a tag), runs as that image's uid, and uses only
    ports the image EXPOSEs."""
    errors = []
    for c in m.containers():
        command = (c.spec.get("command") or [None])[0]
        df = [d for d in ctx.dockerfiles if d.entrypoint[:1] == [command]]
        if not df:
            errors.append("%s: no docker/*.Dockerfile has ENTRYPOINT %s"
                          % (c.where(), command))
            continue
        df = df[0]
        image = c.spec.get("image", "")
        ref = image.split("@")[0]
        last = ref.rsplit("/", 1)[-1]
        name, _, tag = last.partition(":")
        if name != df.title:
            errors.append("%s: image %s is not %s (the title of %s)"
                          % (c.where(), image, df.title,
                             os.path.basename(df.path)))
        if need_tag and not tag and "@" not in image:
            errors.append("%s: image %s has no tag" % (c.where(), image))
        # The container's runAsUser wins over the pod's.
        uid = (c.workload.pod.get("securityContext") or {}).get("runAsUser")
        uid = (c.spec.get("securityContext") or {}).get("runAsUser", uid)
        if uid is not None and df.uid is not None and uid != df.uid:
            errors.append("%s: runAsUser %s, the image's USER is %s"
                          % (c.where(), uid, df.uid))
        for p in c.ports():
            if p not in df.exposed:
                errors.append("%s: containerPort %s is not EXPOSEd by %s"
                              % (c.where(), p, os.path.basename(df.path)))
    return errors


def check_worker_paths(m, ctx):
    """The worker's model, tokenizer and skew files are in the image or on a
    mounted volume."""
    errors = []
    df = [d for d in ctx.dockerfiles
          if d.entrypoint[:1] and os.path.basename(d.entrypoint[0]) == WORKER]
    baked = df[0].copied_dirs if df else []
    for c in m.containers(WORKER):
        for flag in ("model", "tokenizer", "skew"):
            path = c.flag(flag, ctx.flags[WORKER])
            if not path:
                continue
            if not path.startswith("/"):
                errors.append("%s: --%s=%s is not absolute" % (c.where(), flag,
                                                               path))
            elif c.mount_for(path) is None and \
                    not any(path.startswith(d) for d in baked):
                errors.append("%s: --%s=%s is neither in the image (%s) nor on "
                              "a mounted volume" % (c.where(), flag, path,
                                                    ", ".join(baked)))
        if c.flag("policy", ctx.flags[WORKER]) == "infinigen" and \
                not c.flag("skew", ctx.flags[WORKER]):
            errors.append("%s: serve --policy=infinigen needs --skew (it exits "
                          "2 without one)" % c.where())
    return errors


def check_sizes(m, ctx):
    """The memory pool fits the container (--capacity_bytes 0 is unlimited:
    the pod would be OOM-killed instead of refusing sequences), it takes as
    many sequences as its workers open, and the worker's --threads fits its
    CPU limit (0 starts a thread per host core)."""
    errors = []
    for s in m.containers(SERVER):
        try:
            cap = int(s.flag("capacity_bytes", ctx.flags[SERVER]))
        except ValueError:
            errors.append("%s: --capacity_bytes is not a number" % s.where())
            continue
        limit = s.limits().get("memory")
        try:
            prefix = int(s.flag("prefix_cache_bytes", ctx.flags[SERVER]) or 0)
        except ValueError:
            errors.append("%s: --prefix_cache_bytes is not a number" % s.where())
            continue
        if cap <= 0:
            errors.append("%s: --capacity_bytes=%d is unlimited: the pool grows "
                          "until the memory limit kills the pod" % (s.where(), cap))
        elif limit and cap + prefix > POOL_FRACTION_OF_LIMIT * parse_quantity(limit):
            errors.append("%s: --capacity_bytes=%d plus --prefix_cache_bytes=%d "
                          "leave too little of the memory limit %s"
                          % (s.where(), cap, prefix, limit))
    for s in m.containers(SERVER):
        # Each worker opens up to --max_batch sequences at once.
        workers = [c for c in m.containers(WORKER)
                   if _resolve_server(m, c, ctx)[0] is s]
        try:
            limit = int(s.flag("max_sequences", ctx.flags[SERVER]))
            wanted = sum(c.workload.replicas() *
                         int(c.flag("max_batch", ctx.flags[WORKER]))
                         for c in workers)
        except ValueError:
            errors.append("%s: --max_sequences or a worker's --max_batch is "
                          "not a number" % s.where())
            continue
        if wanted > limit:
            errors.append("%s: --max_sequences=%d is below the %d sequences "
                          "its workers open at once (replicas x --max_batch): "
                          "the rest fail RESOURCE_EXHAUSTED"
                          % (s.where(), limit, wanted))
    for c in m.containers(WORKER):
        cpu = c.limits().get("cpu")
        try:
            threads = int(c.flag("threads", ctx.flags[WORKER]))
        except ValueError:
            errors.append("%s: --threads is not a number" % c.where())
            continue
        if cpu and threads <= 0:
            errors.append("%s: --threads=0 uses every host core under a CPU "
                          "limit of %s" % (c.where(), cpu))
        elif cpu and threads > math.ceil(parse_quantity(cpu)):
            errors.append("%s: --threads=%d exceeds the CPU limit %s"
                          % (c.where(), threads, cpu))
    return errors


def check_metrics(m, ctx):
    """Every pod whose main container is a worker or a memory server is
    scraped: the binary serves --metrics_listen on a fixed port, the pod's
    prometheus.io annotations name that port and /metrics, and no
    NetworkPolicy keeps Prometheus from it."""
    errors = []
    for w in m.workloads:
        mains = [c for c in w.containers
                 if not c.init and c.binary in (WORKER, SERVER)
                 and c.binary in ctx.flags]
        for c in mains:
            port = metrics_port(c, ctx)
            if port is None:
                errors.append("%s: no --metrics_listen with a fixed port: "
                              "Prometheus cannot scrape it" % c.where())
                continue
            a = w.annotations
            if str(a.get("prometheus.io/scrape")) != "true":
                errors.append("%s/%s: no prometheus.io/scrape: \"true\" "
                              "annotation on its pods" % (w.kind, w.name))
            if str(a.get("prometheus.io/port")) != str(port):
                errors.append("%s/%s: prometheus.io/port is %r, "
                              "--metrics_listen port is %d"
                              % (w.kind, w.name, a.get("prometheus.io/port"),
                                 port))
            if a.get("prometheus.io/path", "/metrics") != "/metrics":
                errors.append("%s/%s: prometheus.io/path is %r; the binary "
                              "serves /metrics" % (w.kind, w.name,
                                                   a.get("prometheus.io/path")))
            if not _allows(m, w, None, port):
                errors.append("%s: NetworkPolicy blocks Prometheus from the "
                              "metrics port %d" % (c.where(), port))
    return errors


ALL_CHECKS = (check_structure, check_flags, check_resources,
              check_ports_and_probes, check_services, check_kv_service,
              check_single_node, check_auth, check_api_key, check_secrets,
              check_tls,
              check_grace, check_images,
              check_worker_paths, check_sizes, check_metrics)


# --------------------------------------------------------------- fixtures ---

_RENDERED = {}
_CONTEXT = None


def context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = Context(
            {WORKER: binary_flags(ARGS.infinigen, "serve"),
             SERVER: binary_flags(ARGS.kv_memory_server)},
            load_dockerfiles(ROOT))
    return _CONTEXT


def rendered():
    """{kustomization dir relative to k8s/: Manifest}, rendered once."""
    if not _RENDERED:
        kubectl = kubectl_path()
        version = subprocess.run([kubectl, "version", "--client"],
                                 stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT,
                                 universal_newlines=True).stdout
        print("manifests_test: rendering with %s: %s"
              % (kubectl, " ".join(version.split())[:200]), file=sys.stderr)
        # kustomize refuses files that resolve outside the kustomization
        # root, and Bazel's runfiles are symlinks: render a real copy.
        tmp = tempfile.mkdtemp(prefix="k8s-", dir=os.environ.get("TEST_TMPDIR"))
        k8s = os.path.join(tmp, "k8s")
        shutil.copytree(os.path.join(ROOT, "k8s"), k8s, symlinks=False)
        for dirpath, _, files in os.walk(k8s):
            if "kustomization.yaml" in files:
                rel = os.path.relpath(dirpath, k8s)
                _RENDERED[rel] = Manifest(render(kubectl, dirpath), rel)
    return _RENDERED


def run_checks(m, ctx, expected_plane=None, need_tag=True):
    errors = []
    for check in ALL_CHECKS:
        if check is check_kv_service:
            errors += check(m, ctx, expected_plane)
        elif check is check_images:
            errors += check(m, ctx, need_tag)
        else:
            errors += check(m, ctx)
    return errors


# ------------------------------------------------------------------ tests ---

class RenderedManifestsTest(unittest.TestCase):
    """Every kustomization renders and passes every check."""

    def test_every_expected_kustomization_renders(self):
        self.assertEqual(sorted(EXPECTED_PLANE), sorted(rendered()))

    def _check(self, rel):
        m = rendered()[rel]
        errors = run_checks(m, context(), EXPECTED_PLANE.get(rel),
                            need_tag=rel != "base")
        self.assertEqual([], errors, "\n".join(["k8s/%s:" % rel] + errors))
        # Guard against vacuous passes: each has a worker, and each overlay
        # a memory server.
        self.assertTrue(m.containers(WORKER), rel)
        if rel != "base":
            self.assertTrue(m.containers(SERVER), rel)

    def test_base(self):
        self._check("base")

    def test_the_liveness_service_is_the_workers(self):
        out = subprocess.run([ARGS.infinigen, "serve", "--help"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             universal_newlines=True, timeout=60)
        self.assertIn(WORKER_LIVENESS_SERVICE, out.stdout)

    def test_single_node(self):
        self._check("overlays/single-node")
        m = rendered()["overlays/single-node"]
        (server,) = m.containers(SERVER)
        self.assertTrue(server.sidecar, "the memory server is a native sidecar")

    def test_disaggregated(self):
        self._check("overlays/disaggregated")
        m = rendered()["overlays/disaggregated"]
        (server,) = m.containers(SERVER)
        self.assertEqual("StatefulSet", server.workload.kind)
        (worker,) = m.containers(WORKER)
        self.assertEqual("Deployment", worker.workload.kind)
        self.assertEqual("1", str(worker.limits().get("nvidia.com/gpu")))
        # A memory tier: several pods, every one of them in the worker's list.
        self.assertGreater(server.workload.replicas(), 1)
        kv = worker.flag("kv_service", context().flags[WORKER])
        self.assertEqual(server.workload.replicas(), len(kv.split(",")))

    def test_disaggregated_rdma(self):
        self._check("overlays/disaggregated-rdma")

    def test_disaggregated_tls(self):
        self._check("overlays/disaggregated-tls")
        m = rendered()["overlays/disaggregated-tls"]
        (server,) = m.containers(SERVER)
        (worker,) = m.containers(WORKER)
        sf, wf = context().flags[SERVER], context().flags[WORKER]
        # Mutual TLS on the memory tier; its fetch socket (TLS too) open.
        self.assertEqual("7071", server.flag("fetch_port", sf))
        documented = _documented_secrets()
        for c, flags, secret in (
                (server, ("tls_cert", "tls_key", "tls_client_ca"),
                 "infinigen-kv-memory-tls"),
                (worker, ("kv_tls_ca", "kv_tls_cert", "kv_tls_key"),
                 "infinigen-worker-tls")):
            for flag in flags:
                path = c.flag(flag, sf if c is server else wf)
                self.assertTrue(path, "%s --%s" % (c.where(), flag))
                # The path the flag names is a key of the Secret, mounted
                # read-only at its directory.
                volume, key = c.mount_for(path)
                self.assertEqual(os.path.basename(path), key)
                self.assertEqual(secret, c.workload.volumes[volume]["secret"]
                                 ["secretName"])
                mount = [vm for vm in c.spec["volumeMounts"]
                         if vm["name"] == volume]
                self.assertTrue(mount[0].get("readOnly"))
            # User-provided: k8s/README.md tells how to create it.
            self.assertIn(secret, documented)
        self.assertEqual("infinigen-kv-memory",
                         worker.flag("kv_tls_server_name", wf))
        self.assertIn(7071, server.ports())  # the TLS fetch socket

    def test_images_are_the_same_in_every_overlay(self):
        images = {}
        for rel, m in rendered().items():
            if rel == "base":
                continue
            for c in m.containers():
                images.setdefault(c.binary, set()).add(c.spec["image"])
        for binary, refs in images.items():
            self.assertEqual(1, len(refs), "%s: %s" % (binary, sorted(refs)))

    def test_auth_is_on_by_default(self):
        # Every memory server requires the token and every worker sends it,
        # both from AUTH_TOKEN_PATH on a required infinigen-kv-auth volume.
        for rel, m in rendered().items():
            sides = [(c, WORKER_TOKEN_FLAG) for c in m.containers(WORKER)]
            sides += [(c, SERVER_TOKEN_FLAG) for c in m.containers(SERVER)]
            self.assertTrue(sides, rel)
            for c, flag in sides:
                self.assertEqual(AUTH_TOKEN_PATH, c.flags.get(flag),
                                 "%s: %s --%s" % (rel, c.where(), flag))
                volume = c.workload.volumes[c.mount_for(AUTH_TOKEN_PATH)[0]]
                self.assertEqual(AUTH_SECRET, volume["secret"]["secretName"],
                                 "%s: %s" % (rel, c.where()))
                self.assertFalse(volume["secret"].get("optional", False),
                                 "%s: %s" % (rel, c.where()))
                mount = [vm for vm in c.spec["volumeMounts"]
                         if vm["name"] == volume["name"]]
                self.assertTrue(mount[0].get("readOnly"),
                                "%s: %s" % (rel, c.where()))


def mutate(rel, fn):
    """A copy of a rendered kustomization, changed by fn(docs)."""
    docs = copy.deepcopy(rendered()[rel].docs)
    fn(docs)
    return Manifest(docs, rel + " (broken)")


def find(docs, kind, name=None):
    return [d for d in docs if d["kind"] == kind and
            (name is None or d["metadata"]["name"] == name)][0]


def pod_containers(docs, kind, init=False):
    return find(docs, kind)["spec"]["template"]["spec"][
        "initContainers" if init else "containers"]


def set_config(docs, key, value):
    for d in docs:
        if d["kind"] == "ConfigMap" and key in (d.get("data") or {}):
            d["data"][key] = value


class BrokenManifestsTest(unittest.TestCase):
    """Each check reports a deliberately broken manifest."""

    DG = "overlays/disaggregated"
    SN = "overlays/single-node"
    RDMA = "overlays/disaggregated-rdma"
    TLS = "overlays/disaggregated-tls"

    def assertReports(self, check, m, needle, **kw):
        ctx = context()
        errors = check(m, ctx, **kw)
        self.assertTrue(any(needle in e for e in errors),
                        "%s did not report %r; it said %s"
                        % (check.__name__, needle, errors))

    def test_the_unbroken_copies_pass(self):
        for rel in (self.DG, self.SN, self.RDMA, self.TLS):
            m = mutate(rel, lambda docs: None)
            self.assertEqual([], run_checks(m, context(), EXPECTED_PLANE[rel]))

    def test_unknown_flag(self):
        m = mutate(self.DG, lambda d: pod_containers(d, "StatefulSet")[0][
            "args"].append("--capacity=1G"))
        self.assertReports(check_flags, m, "--capacity is not a flag")

    def test_worker_flag_typo(self):
        m = mutate(self.DG, lambda d: pod_containers(d, "Deployment")[0][
            "args"].append("--kvservice=tcp://x:1"))
        self.assertReports(check_flags, m, "--kvservice is not a flag")

    def test_repeated_flag(self):
        m = mutate(self.DG, lambda d: pod_containers(d, "StatefulSet")[0][
            "args"].append("--eviction=fifo"))
        self.assertReports(check_flags, m, "--eviction given twice")

    def test_undefined_env_var(self):
        m = mutate(self.DG, lambda d: pod_containers(d, "StatefulSet")[0][
            "args"].append("--max_sequences=$(KV_MAX_SEQS)"))
        self.assertReports(check_flags, m, "$(KV_MAX_SEQS)")

    def test_missing_serve(self):
        def fn(docs):
            pod_containers(docs, "Deployment")[0]["args"].pop(0)
        self.assertReports(check_flags, mutate(self.DG, fn), "'serve' first")

    def test_wrong_probe_port(self):
        def fn(docs):
            pod_containers(docs, "StatefulSet")[0]["readinessProbe"][
                "grpc"]["port"] = 7071
        self.assertReports(check_ports_and_probes, mutate(self.DG, fn),
                           "readinessProbe checks port 7071")

    def test_http_probe(self):
        def fn(docs):
            pod_containers(docs, "Deployment")[0]["livenessProbe"] = {
                "tcpSocket": {"port": 8080}}
        self.assertReports(check_ports_and_probes, mutate(self.DG, fn),
                           "livenessProbe is not a grpc probe")

    def test_worker_liveness_follows_the_memory_node(self):
        def fn(docs):
            del pod_containers(docs, "Deployment")[0]["livenessProbe"][
                "grpc"]["service"]
        self.assertReports(check_ports_and_probes, mutate(self.DG, fn),
                           "the kubelet would restart every worker")

    def test_worker_readiness_ignores_the_memory_node(self):
        def fn(docs):
            pod_containers(docs, "Deployment")[0]["readinessProbe"] = {
                "grpc": {"port": 8080, "service": WORKER_LIVENESS_SERVICE}}
        self.assertReports(check_ports_and_probes, mutate(self.DG, fn),
                           "readinessProbe reads service")

    def test_readiness_on_another_http_path(self):
        def fn(docs):
            pod_containers(docs, "Deployment")[0]["readinessProbe"][
                "httpGet"]["path"] = "/v1/models"
        self.assertReports(check_ports_and_probes, mutate(self.DG, fn),
                           "the API's health is /health")

    def test_readiness_on_another_http_port(self):
        def fn(docs):
            pod_containers(docs, "Deployment")[0]["readinessProbe"][
                "httpGet"]["port"] = 8080
        self.assertReports(check_ports_and_probes, mutate(self.DG, fn),
                           "readinessProbe checks HTTP port 8080")

    def test_http_port_not_declared(self):
        def fn(docs):
            c = pod_containers(docs, "Deployment")[0]
            c["ports"] = [p for p in c["ports"] if p["name"] != "http"]
        m = mutate(self.DG, fn)
        self.assertReports(check_ports_and_probes, m,
                           "--http_listen port 8000 is not a containerPort")

    def test_service_without_the_api_port(self):
        def fn(docs):
            svc = find(docs, "Service", "infinigen-worker")
            svc["spec"]["ports"] = [p for p in svc["spec"]["ports"]
                                    if p["name"] != "http"]
        self.assertReports(check_services, mutate(self.DG, fn),
                           "no Service exposes the OpenAI API's port 8000")

    def test_network_policy_blocks_the_api(self):
        def fn(docs):
            pol = find(docs, "NetworkPolicy", "infinigen-worker")
            for rule in pol["spec"]["ingress"]:
                rule["ports"] = [p for p in rule["ports"] if p["port"] != 8000]
        self.assertReports(check_services, mutate(self.DG, fn),
                           "lets no client reach the OpenAI API's port 8000")

    def test_api_without_a_key(self):
        def fn(docs):
            args = pod_containers(docs, "Deployment")[0]["args"]
            args.remove("--api_key_file=$(WORKER_API_KEY_FILE)")
        self.assertReports(check_api_key, mutate(self.DG, fn),
                           "has no --api_key_file")

    def test_api_key_optional(self):
        def fn(docs):
            for v in find(docs, "Deployment")["spec"]["template"]["spec"][
                    "volumes"]:
                if v["name"] == "api-key":
                    v["secret"]["optional"] = True
        self.assertReports(check_api_key, mutate(self.DG, fn),
                           "Secret volume api-key is optional")

    def test_api_key_on_a_non_secret_volume(self):
        def fn(docs):
            args = pod_containers(docs, "Deployment")[0]["args"]
            i = args.index("--api_key_file=$(WORKER_API_KEY_FILE)")
            args[i] = "--api_key_file=/tmp/key"
        self.assertReports(check_api_key, mutate(self.DG, fn),
                           "--api_key_file=/tmp/key is on volume tmp, which is "
                           "not a Secret")

    def test_listen_port_not_declared(self):
        def fn(docs):
            args = pod_containers(docs, "StatefulSet")[0]["args"]
            args[args.index("--listen=0.0.0.0:7070")] = "--listen=0.0.0.0:7080"
        m = mutate(self.DG, fn)
        self.assertReports(check_ports_and_probes, m,
                           "--listen port 7080 is not a containerPort")
        self.assertReports(check_kv_service, m, "not the memory server's "
                           "--listen port")

    def test_metrics_port_not_declared(self):
        def fn(docs):
            args = pod_containers(docs, "StatefulSet")[0]["args"]
            args[args.index("--metrics_listen=0.0.0.0:9091")] = \
                "--metrics_listen=0.0.0.0:9099"
        m = mutate(self.DG, fn)
        self.assertReports(check_ports_and_probes, m,
                           "--metrics_listen port 9099 is not a containerPort")
        self.assertReports(check_metrics, m, "prometheus.io/port is '9091', "
                           "--metrics_listen port is 9099")

    def test_no_metrics_listen(self):
        def fn(docs):
            args = pod_containers(docs, "Deployment")[0]["args"]
            args.remove("--metrics_listen=0.0.0.0:9090")
        self.assertReports(check_metrics, mutate(self.DG, fn),
                           "no --metrics_listen with a fixed port")

    def test_pods_not_annotated_for_scraping(self):
        def fn(docs):
            del find(docs, "StatefulSet")["spec"]["template"]["metadata"][
                "annotations"]["prometheus.io/scrape"]
        self.assertReports(check_metrics, mutate(self.DG, fn),
                           "no prometheus.io/scrape")

    def test_network_policy_blocks_prometheus(self):
        def fn(docs):
            pol = find(docs, "NetworkPolicy", "infinigen-kv-memory")
            pol["spec"]["ingress"] = pol["spec"]["ingress"][:1]
        self.assertReports(check_metrics, mutate(self.DG, fn),
                           "NetworkPolicy blocks Prometheus from the metrics "
                           "port 9091")

    def test_random_fetch_port(self):
        def fn(docs):
            args = pod_containers(docs, "StatefulSet")[0]["args"]
            args[args.index("--fetch_port=7071")] = "--fetch_port=0"
        self.assertReports(check_ports_and_probes, mutate(self.DG, fn),
                           "--fetch_port=0 opens a random port")

    def test_service_selects_nothing(self):
        def fn(docs):
            find(docs, "Service", "infinigen-worker")["spec"]["selector"][
                "app.kubernetes.io/component"] = "workers"
        self.assertReports(check_services, mutate(self.DG, fn),
                           "matches no pod template")

    def test_service_target_port_missing(self):
        def fn(docs):
            find(docs, "Service", "infinigen-kv-memory")["spec"]["ports"][1][
                "targetPort"] = "fetch-socket"
        self.assertReports(check_services, mutate(self.DG, fn),
                           "targetPort 'fetch-socket' is not a port")

    def test_a_tier_pod_left_out(self):
        m = mutate(self.DG, lambda d: set_config(
            d, "WORKER_KV_SERVICE",
            "tcp://infinigen-kv-memory-1.infinigen-kv-memory:7070"))
        self.assertReports(check_kv_service, m, "which has 2 replicas")

    def test_a_tier_pod_out_of_range(self):
        def fn(docs):
            find(docs, "StatefulSet", "infinigen-kv-memory")["spec"][
                "replicas"] = 1
        self.assertReports(check_kv_service, mutate(self.DG, fn),
                           "the StatefulSet has 1 replicas")

    def test_a_tier_through_a_service(self):
        m = mutate(self.DG, lambda d: set_config(
            d, "WORKER_KV_SERVICE",
            "tcp://infinigen-kv-memory-0.infinigen-kv-memory:7070,"
            "tcp://infinigen-kv-memory:7070"))
        self.assertReports(check_kv_service, m, "is not a pod of StatefulSet")

    def test_statefulset_service_not_headless(self):
        def fn(docs):
            del find(docs, "Service", "infinigen-kv-memory")["spec"]["clusterIP"]
        self.assertReports(check_services, mutate(self.DG, fn), "not headless")

    def test_network_policy_blocks_the_worker(self):
        def fn(docs):
            pol = find(docs, "NetworkPolicy", "infinigen-kv-memory")
            pol["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
                "app.kubernetes.io/component"] = "client"
        self.assertReports(check_services, mutate(self.DG, fn),
                           "NetworkPolicy blocks it")

    def test_missing_pdb(self):
        def fn(docs):
            docs.remove(find(docs, "PodDisruptionBudget", "infinigen-kv-memory"))
        self.assertReports(check_services, mutate(self.DG, fn),
                           "no PodDisruptionBudget covers")

    def test_missing_limits(self):
        def fn(docs):
            del pod_containers(docs, "Deployment")[0]["resources"]["limits"]
        self.assertReports(check_resources, mutate(self.DG, fn),
                           "no limits.memory")

    def test_sidecar_without_requests(self):
        def fn(docs):
            del pod_containers(docs, "Deployment", init=True)[0]["resources"][
                "requests"]
        self.assertReports(check_resources, mutate(self.SN, fn),
                           "no requests.cpu")

    def test_kv_service_host_typo(self):
        set_host = "tcp://infinigen-kv-memroy-0.infinigen-kv-memory:7070"
        m = mutate(self.DG, lambda d: set_config(d, "WORKER_KV_SERVICE",
                                                 set_host))
        self.assertReports(check_kv_service, m, "is neither a Service nor")

    def test_kv_service_ordinal_out_of_range(self):
        m = mutate(self.DG, lambda d: set_config(
            d, "WORKER_KV_SERVICE",
            "tcp://infinigen-kv-memory-2.infinigen-kv-memory:7070"))
        self.assertReports(check_kv_service, m, "has 2 replicas")

    def test_kv_service_wrong_port(self):
        m = mutate(self.DG, lambda d: set_config(
            d, "WORKER_KV_SERVICE",
            "tcp://infinigen-kv-memory-0.infinigen-kv-memory:7071"))
        self.assertReports(check_kv_service, m, "--kv_service port 7071")

    def test_kv_service_through_a_service_port_it_lacks(self):
        m = mutate(self.DG, lambda d: set_config(
            d, "WORKER_KV_SERVICE", "tcp://infinigen-kv-memory:7000"))
        self.assertReports(check_kv_service, m, "has no port 7000")

    def test_inproc_beside_a_memory_server(self):
        m = mutate(self.DG, lambda d: set_config(d, "WORKER_KV_SERVICE",
                                                 "inproc:"))
        self.assertReports(check_kv_service, m, "is never used")

    def test_policy_that_never_fetches(self):
        m = mutate(self.DG, lambda d: set_config(d, "WORKER_POLICY", "ideal"))
        self.assertReports(check_kv_service, m, "--policy=ideal")

    def test_wrong_plane_for_the_overlay(self):
        m = mutate(self.RDMA, lambda d: set_config(
            d, "WORKER_KV_SERVICE",
            "tcp://infinigen-kv-memory-0.infinigen-kv-memory:7070"))
        self.assertReports(check_kv_service, m, "meant for rdma",
                           expected_plane="rdma")

    def test_rdma_without_ipc_lock(self):
        def fn(docs):
            del pod_containers(docs, "StatefulSet")[0]["securityContext"][
                "capabilities"]["add"]
        self.assertReports(check_kv_service, mutate(self.RDMA, fn), "IPC_LOCK")

    def test_rdma_without_device_resource(self):
        def fn(docs):
            res = pod_containers(docs, "Deployment")[0]["resources"]
            del res["limits"]["rdma/hca_shared_devices_a"]
            del res["requests"]["rdma/hca_shared_devices_a"]
        self.assertReports(check_kv_service, mutate(self.RDMA, fn),
                           "no RDMA device resource")

    def test_rdma_server_without_device_flag(self):
        m = mutate(self.RDMA, lambda d: set_config(d, "KV_RDMA_DEVICE", ""))
        self.assertReports(check_kv_service, m, "no --rdma_device")

    def test_shm_socket_on_different_volumes(self):
        def fn(docs):
            side = pod_containers(docs, "Deployment", init=True)[0]
            side["volumeMounts"] = [v for v in side["volumeMounts"]
                                    if v["name"] != "kv-shm"]
        m = mutate(self.SN, fn)
        self.assertReports(check_kv_service, m, "no memory server in the same "
                           "pod serves --shm_listen")
        self.assertReports(check_single_node, m, "share no emptyDir")

    def test_shm_volume_not_in_memory(self):
        def fn(docs):
            spec = find(docs, "Deployment")["spec"]["template"]["spec"]
            for v in spec["volumes"]:
                if v["name"] == "kv-shm":
                    del v["emptyDir"]["medium"]
        m = mutate(self.SN, fn)
        self.assertReports(check_single_node, m, "share no emptyDir")
        self.assertReports(check_kv_service, m, "not an emptyDir of medium "
                           "Memory")

    def test_auth_secret_mounted_elsewhere(self):
        # One value moves both sides (the worker reads the server's key).
        m = mutate(self.DG, lambda d: set_config(d, "KV_AUTH_TOKEN_FILE",
                                                 "/etc/kv-auth/token"))
        self.assertReports(check_auth, m, "--auth_token_file=/etc/kv-auth/"
                           "token: no volume is mounted at /etc/kv-auth")
        self.assertReports(check_auth, m, "--kv_auth_token_file=/etc/kv-auth/"
                           "token: no volume is mounted at /etc/kv-auth")

    def test_auth_token_on_a_non_secret_volume(self):
        m = mutate(self.SN, lambda d: set_config(d, "KV_AUTH_TOKEN_FILE",
                                                 "/run/infinigen/kv/token"))
        self.assertReports(check_auth, m, "--auth_token_file=/run/infinigen/"
                           "kv/token is on volume kv-shm, which is not a Secret")
        self.assertReports(check_auth, m, "--kv_auth_token_file=/run/"
                           "infinigen/kv/token is on volume kv-shm, which is "
                           "not a Secret")

    def test_auth_off_on_both_sides_is_consistent(self):
        # Switching auth off in the one place is not an auth error.
        m = mutate(self.DG, lambda d: set_config(d, "KV_AUTH_TOKEN_FILE", ""))
        self.assertEqual([], check_auth(m, context()))

    def test_server_with_token_worker_without(self):
        for rel in (self.DG, self.SN, self.RDMA):
            def fn(docs):
                c = pod_containers(docs, "Deployment")[0]
                c["args"] = [a for a in c["args"]
                             if not a.startswith("--kv_auth_token_file=")]
            m = mutate(rel, fn)
            self.assertReports(check_auth, m, "does not pass "
                               "--kv_auth_token_file to the memory server")
            # ... and nothing else is wrong with it.
            self.assertEqual(1, len(run_checks(m, context(),
                                               EXPECTED_PLANE[rel])), rel)

    def test_worker_with_token_server_without(self):
        def fn(docs):
            c = pod_containers(docs, "StatefulSet")[0]
            c["args"] = [a for a in c["args"]
                         if not a.startswith("--auth_token_file=")]
        self.assertReports(check_auth, mutate(self.DG, fn),
                           "it checks none (auth off)")

    def test_worker_token_at_another_path(self):
        def fn(docs):
            c = pod_containers(docs, "Deployment")[0]
            c["env"] = [{"name": "KV_AUTH_TOKEN_FILE",
                         "value": "/var/run/secrets/infinigen/kv-auth/token2"}]
        m = mutate(self.DG, fn)
        self.assertReports(check_auth, m, "--kv_auth_token_file=/var/run/"
                           "secrets/infinigen/kv-auth/token2 is not the memory "
                           "server's --auth_token_file=" + AUTH_TOKEN_PATH)
        self.assertReports(check_auth, m, "reads Secret infinigen-kv-auth key "
                           "token2")

    def test_worker_token_from_another_secret(self):
        def fn(docs):
            for v in find(docs, "Deployment")["spec"]["template"]["spec"][
                    "volumes"]:
                if v["name"] == "kv-auth":
                    v["secret"]["secretName"] = "infinigen-kv-auth-old"
        self.assertReports(check_auth, mutate(self.DG, fn),
                           "reads Secret infinigen-kv-auth-old key token, the "
                           "memory server")

    def test_auth_secret_optional(self):
        def fn(docs):
            for v in find(docs, "StatefulSet")["spec"]["template"]["spec"][
                    "volumes"]:
                if v["name"] == "kv-auth":
                    v["secret"]["optional"] = True
        self.assertReports(check_auth, mutate(self.DG, fn),
                           "Secret volume kv-auth is optional")

    def test_tls_cert_mounted_elsewhere(self):
        m = mutate(self.TLS, lambda d: set_config(
            d, "KV_TLS_CERT", "/etc/infinigen/tls/tls.crt"))
        self.assertReports(check_tls, m, "no volume is mounted at "
                           "/etc/infinigen/tls")

    def test_tls_key_not_in_the_secret_projection(self):
        def fn(docs):
            for v in find(docs, "StatefulSet")["spec"]["template"]["spec"][
                    "volumes"]:
                if v["name"] == "kv-memory-tls":
                    v["secret"]["items"] = [{"key": "tls.crt",
                                             "path": "tls.crt"}]
        self.assertReports(check_tls, mutate(self.TLS, fn),
                           "does not project tls.key")

    def test_worker_without_tls_to_a_tls_server(self):
        def fn(docs):
            c = pod_containers(docs, "Deployment")[0]
            c["args"] = [a for a in c["args"] if not a.startswith("--kv_tls")]
        self.assertReports(check_tls, mutate(self.TLS, fn),
                           "has no --kv_tls_ca")

    def test_worker_without_client_certificate(self):
        def fn(docs):
            c = pod_containers(docs, "Deployment")[0]
            c["args"] = [a for a in c["args"]
                         if not a.startswith(("--kv_tls_cert", "--kv_tls_key"))]
        self.assertReports(check_tls, mutate(self.TLS, fn),
                           "no --kv_tls_cert")

    def test_worker_tls_to_a_plaintext_server(self):
        def fn(docs):
            c = pod_containers(docs, "StatefulSet")[0]
            c["args"] = [a for a in c["args"] if not a.startswith("--tls_")]
        self.assertReports(check_tls, mutate(self.TLS, fn),
                           "serves plaintext")

    def test_tls_certificate_without_key(self):
        def fn(docs):
            c = pod_containers(docs, "StatefulSet")[0]
            c["args"] = [a for a in c["args"] if not a.startswith("--tls_key")]
        self.assertReports(check_tls, mutate(self.TLS, fn), "go together")

    def test_grpc_probe_under_tls(self):
        def fn(docs):
            c = pod_containers(docs, "StatefulSet")[0]
            c["readinessProbe"] = {"grpc": {"port": 7070}}
        self.assertReports(check_ports_and_probes, mutate(self.TLS, fn),
                           "gRPC probes do not speak TLS")

    def test_fetch_port_under_tls(self):
        # The TLS fetch socket's port must be declared like the plain one.
        def fn(docs):
            c = pod_containers(docs, "StatefulSet")[0]
            c["ports"] = [p for p in c["ports"] if p["containerPort"] != 7071]
        self.assertReports(check_ports_and_probes, mutate(self.TLS, fn),
                           "--fetch_port port 7071 is not a containerPort")

    def test_secret_nobody_creates(self):
        def fn(docs):
            for v in find(docs, "Deployment")["spec"]["template"]["spec"][
                    "volumes"]:
                if v["name"] == "worker-tls":
                    v["secret"]["secretName"] = "infinigen-wroker-tls"
        self.assertReports(check_secrets, mutate(self.TLS, fn),
                           "infinigen-wroker-tls")

    def test_grace_shorter_than_drain(self):
        def fn(docs):
            find(docs, "StatefulSet")["spec"]["template"]["spec"][
                "terminationGracePeriodSeconds"] = 10
        self.assertReports(check_grace, mutate(self.DG, fn),
                           "terminationGracePeriodSeconds 10")

    def test_grace_ignores_sidecar_drain(self):
        def fn(docs):
            find(docs, "Deployment")["spec"]["template"]["spec"][
                "terminationGracePeriodSeconds"] = 40
        self.assertReports(check_grace, mutate(self.SN, fn),
                           "terminationGracePeriodSeconds 40")

    def test_longer_drain_in_config(self):
        m = mutate(self.DG, lambda d: set_config(d, "WORKER_DRAIN_TIMEOUT",
                                                 "2m"))
        self.assertReports(check_grace, m, "preStop + drain (125s)")

    def test_image_name_mismatch(self):
        def fn(docs):
            pod_containers(docs, "StatefulSet")[0]["image"] = \
                "registry.example.com/infinigen/kv-memory:0.1.0"
        self.assertReports(check_images, mutate(self.DG, fn),
                           "is not kv-memory-server")

    def test_image_without_tag(self):
        def fn(docs):
            pod_containers(docs, "Deployment")[0]["image"] = "infinigen-worker"
        self.assertReports(check_images, mutate(self.DG, fn), "has no tag")

    def test_run_as_other_user(self):
        def fn(docs):
            find(docs, "StatefulSet")["spec"]["template"]["spec"][
                "securityContext"]["runAsUser"] = 1000
        self.assertReports(check_images, mutate(self.DG, fn), "runAsUser 1000")

    def test_model_outside_image_and_volumes(self):
        m = mutate(self.DG, lambda d: set_config(d, "WORKER_MODEL",
                                                 "/models/smollm2.gguf"))
        self.assertReports(check_worker_paths, m, "--model=/models/smollm2.gguf")

    def test_unlimited_pool(self):
        m = mutate(self.DG, lambda d: set_config(d, "KV_CAPACITY_BYTES", "0"))
        self.assertReports(check_sizes, m, "is unlimited")

    def test_pool_above_memory_limit(self):
        m = mutate(self.SN, lambda d: set_config(d, "KV_CAPACITY_BYTES",
                                                 str(8 * 2**30)))
        self.assertReports(check_sizes, m, "leave too little")

    def test_prefix_cache_pushes_the_node_past_its_memory_limit(self):
        # 6 GiB of pool fits the sidecar's 8 GiB; 1.5 GiB of prefix blocks
        # on top does not.
        m = mutate(self.SN, lambda d: set_config(d, "KV_PREFIX_CACHE_BYTES",
                                                 str(3 * 2**29)))
        self.assertReports(check_sizes, m, "--prefix_cache_bytes=1610612736")

    def test_more_worker_sequences_than_the_pool_takes(self):
        def fn(docs):
            find(docs, "Deployment")["spec"]["replicas"] = 200
        self.assertReports(check_sizes, mutate(self.DG, fn),
                           "below the 1600 sequences")

    def test_threads_above_cpu_limit(self):
        m = mutate(self.DG, lambda d: set_config(d, "WORKER_THREADS", "64"))
        self.assertReports(check_sizes, m, "--threads=64 exceeds")

    def test_volume_claim_templates_map(self):
        def fn(docs):
            find(docs, "StatefulSet")["spec"]["volumeClaimTemplates"] = {
                "metadata": {"labels": {"a": "b"}}}
        self.assertReports(check_structure, mutate(self.DG, fn),
                           "volumeClaimTemplates is not a list")


class HelpersTest(unittest.TestCase):

    def test_parse_duration(self):
        self.assertEqual(30, parse_duration("30s"))
        self.assertEqual(90, parse_duration("1m30s"))
        self.assertEqual(0.5, parse_duration("500ms"))
        self.assertIsNone(parse_duration("30"))
        self.assertIsNone(parse_duration("soon"))

    def test_parse_quantity(self):
        self.assertEqual(16 * 2**30, parse_quantity("16Gi"))
        self.assertEqual(0.5, parse_quantity("500m"))
        self.assertEqual(8, parse_quantity("8"))

    def test_expand(self):
        self.assertEqual(("a=1 $(B)", ["B"]),
                         expand("a=$(A) $(B)", {"A": "1"}))
        self.assertEqual(("$(A)", []), expand("$$(A)", {"A": "1"}))

    def test_parse_help(self):
        flags = parse_help('Flags:\n  --listen (default: "127.0.0.1:7070")\n'
                           '      HOST:PORT\n  --x_y (default: "")\n')
        self.assertEqual({"listen": "127.0.0.1:7070", "x_y": ""}, flags)


# ----------------------------------------------------------------- runner ---

class _Recorder(unittest.TextTestResult):
    """Keeps each test's outcome and time for the JUnit XML Bazel reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cases = []

    def startTest(self, test):
        self._t0 = time.time()
        super().startTest(test)

    def _record(self, test, kind, text=""):
        self.cases.append((test, kind, text, time.time() - self._t0))

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failure", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)


def write_junit(path, result):
    suite = ET.Element("testsuite", name="manifests_test",
                       tests=str(len(result.cases)),
                       failures=str(len(result.failures)),
                       errors=str(len(result.errors)))
    for test, kind, text, secs in result.cases:
        case = ET.SubElement(suite, "testcase", classname=type(test).__name__,
                             name=test._testMethodName, time="%.3f" % secs)
        if kind != "pass":
            ET.SubElement(case, kind, message=text.splitlines()[-1]
                          if text else kind).text = text
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--infinigen", required=True)
    parser.add_argument("--kv_memory_server", required=True)
    ARGS, rest = parser.parse_known_args()
    try:
        kubectl_path()
    except RuntimeError as e:
        # One clear failure rather than one per test.
        print("manifests_test: FAILED: %s" % e, file=sys.stderr)
        xml_path = os.environ.get("XML_OUTPUT_FILE")
        if xml_path:
            root = ET.Element("testsuites")
            suite = ET.SubElement(root, "testsuite", name="manifests_test",
                                  tests="1", failures="1", errors="0")
            case = ET.SubElement(suite, "testcase", classname="Setup",
                                 name="kubectl_available")
            ET.SubElement(case, "failure", message=str(e)).text = str(e)
            ET.ElementTree(root).write(xml_path, encoding="utf-8",
                                       xml_declaration=True)
        sys.exit(1)
    program = unittest.main(argv=[sys.argv[0]] + rest, exit=False,
                            testRunner=unittest.TextTestRunner(
                                resultclass=_Recorder, verbosity=2))
    xml_path = os.environ.get("XML_OUTPUT_FILE")
    if xml_path:
        write_junit(xml_path, program.result)
    sys.exit(0 if program.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
