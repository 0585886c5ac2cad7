#!/usr/bin/env python3
"""Runs the images as Kubernetes would and checks that they serve.

    scripts/container_test.py [--no-build] [--no-install]

Builds both images (scripts/build_images.sh, podman), then:

  1. ldd inside each image: no library "not found"; both binaries' --help.
  2. From the rendered overlays (`kubectl kustomize`), each container run with
     its manifest's command, args (the $(VAR)s from its ConfigMaps), user,
     read-only root, secrets and volumes, on the host's network:
     - disaggregated: the two memory-node pods of the StatefulSet and the
       worker against them over TCP (tcp://...:7070 and the fetch sockets);
     - single-node: the memory node and the worker sharing a tmpfs volume
       (the emptyDir of medium Memory) for the shm socket.
     Each memory node answers grpc.health.v1 and an append plus fetch from
     outside its container (`infinigen health`, `infinigen kv-check` with
     the node's token, over TCP and over shm through the shared volume; a
     wrong token is refused). Each worker answers its gRPC health (and
     infinigen.worker.Liveness), /health, the OpenAI API (/v1/completions,
     /v1/chat/completions) with the API key, and greedy text identical to
     the same image serving with the KV cache in its process.
  3. Operator failures: the memory node killed -> /health 503, gRPC health
     NOT_SERVING (liveness still SERVING) and requests fail with the KV
     error; the node restarted -> serving resumes with the
     same text; SIGTERM to each container -> exit 0 within the manifest's
     terminationGracePeriodSeconds.
  4. Both overlays played with `podman kube play` (converted as KUBE_CHANGES
     says): every pod ready by its own startup and readiness probes, and the
     OpenAI API answering through the worker's port with the same text.

What differs from a cluster, stated: the pods share the host's network
namespace, so the names of the memory pods (<sts>-<n>.<service>) are /etc/hosts
entries for 127.0.0.1 and pod n>0 of the StatefulSet listens on 7070+2n
(fetch 7071+2n), the worker's address rewritten to match; no resource limits
or probes run (the test calls the same endpoints); Secrets are files of random
content mounted read-only.

The last line is `//k8s:container_test PASSED`, `FAILED` or `SKIPPED` (with
the reason) for scripts/test.sh's count. It skips only where containers cannot
run here: not root and no podman, the packages cannot be installed, or the
runtime refuses to start a container; everything else is a failure.
"""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "//k8s:container_test"
PREFIX = "infinigen-ct-"
# The host's build of the worker binary (what the images carry): its
# `health` and `kv-check` commands probe the containers from outside.
INFINIGEN = os.path.join(ROOT, "bazel-bin", "gpu_worker", "infinigen")
PROMPT = "Once upon a time"
MAX_TOKENS = 24


class Skip(Exception):
    pass


class Fail(Exception):
    pass


def log(msg):
    print("container_test: " + msg, flush=True)


def sh(cmd, check=True, timeout=600, **kw):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise Fail("%s: exit %d\n%s" % (" ".join(cmd), r.returncode,
                                        r.stdout[-3000:]))
    return r


def podman(*args, check=True, timeout=600):
    return sh(["podman"] + list(args), check=check, timeout=timeout)


# ---- the manifests ---------------------------------------------------------

def render(overlay):
    out = sh(["kubectl", "kustomize",
              os.path.join(ROOT, "k8s", "overlays", overlay)]).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def configmaps(docs):
    return {d["metadata"]["name"]: d.get("data", {})
            for d in docs if d["kind"] == "ConfigMap"}


def workload(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def container_env(c, cms):
    env = {}
    for ef in c.get("envFrom", []):
        env.update(cms[ef["configMapRef"]["name"]])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = cms[ref["name"]][ref["key"]]
    return env


def expand(arg, env):
    def sub(m):
        if m.group(1) not in env:
            raise Fail("$(%s) is not defined" % m.group(1))
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


class Spec:
    """One container of a rendered pod, as `podman run` arguments."""

    def __init__(self, pod_spec, c, cms, secrets_dir, volumes):
        self.name = c["name"]
        self.image = c["image"]
        env = container_env(c, cms)
        self.argv = [expand(a, env) for a in c.get("command", []) +
                     c.get("args", [])]
        sc = dict(pod_spec.get("securityContext") or {})
        sc.update(c.get("securityContext") or {})
        self.run = ["--user", "%s:%s" % (sc.get("runAsUser", 0),
                                         sc.get("runAsGroup", 0)),
                    "--no-healthcheck", "--security-opt=no-new-privileges"]
        if pod_spec.get("securityContext", {}).get("fsGroup"):
            self.run += ["--group-add", str(sc.get("fsGroup",
                         pod_spec["securityContext"]["fsGroup"]))]
        if sc.get("readOnlyRootFilesystem"):
            self.run.append("--read-only")
        if "ALL" in (sc.get("capabilities") or {}).get("drop", []):
            self.run.append("--cap-drop=ALL")
        vols = {v["name"]: v for v in pod_spec.get("volumes", [])}
        self.mounts = [(m["name"], m["mountPath"])
                       for m in c.get("volumeMounts", [])]
        for m in c.get("volumeMounts", []):
            v = vols[m["name"]]
            path = m["mountPath"]
            if "secret" in v:
                src = os.path.join(secrets_dir, v["secret"]["secretName"])
                self.run += ["-v", "%s:%s:ro" % (src, path)]
            elif "emptyDir" in v and m["name"] in volumes:
                # One tmpfs volume per pod, shared by its containers.
                self.run += ["-v", "%s:%s" % (volumes[m["name"]], path)]
            elif "emptyDir" in v:
                self.run += ["--tmpfs", "%s:rw,mode=1777" % path]
            else:
                raise Fail("volume %s: no conversion for %s" % (m["name"], v))
        self.grace = pod_spec.get("terminationGracePeriodSeconds", 30)


def flag(argv, name):
    for a in argv:
        if a.startswith("--%s=" % name):
            return a.split("=", 1)[1]
    return None


def set_flag(argv, name, value):
    return [("--%s=%s" % (name, value)) if a.startswith("--%s=" % name)
            else a for a in argv]


# ---- running ---------------------------------------------------------------

class Containers:
    def __init__(self):
        self.names = []
        self.volumes = []

    def start(self, name, spec, argv=None, hosts=()):
        name = PREFIX + name
        podman("rm", "-f", "-t", "0", name, check=False)
        argv = argv if argv is not None else spec.argv
        cmd = ["run", "-d", "--name", name] + spec.run
        for h in hosts:
            cmd += ["--add-host", "%s:127.0.0.1" % h]
        cmd += ["--entrypoint", argv[0], spec.image] + argv[1:]
        podman(*cmd)
        if name not in self.names:
            self.names.append(name)
        return name

    def volume(self, name):
        name = PREFIX + name
        podman("volume", "rm", "-f", name, check=False)
        podman("volume", "create", "--opt", "type=tmpfs", "--opt",
               "device=tmpfs", "--opt", "o=uid=10001,gid=10001,mode=0770",
               name)
        self.volumes.append(name)
        return name

    def logs(self, name):
        return podman("logs", name, check=False).stdout

    def stop_all(self):
        for n in reversed(self.names):
            podman("rm", "-f", "-t", "0", n, check=False)
        for v in self.volumes:
            podman("volume", "rm", "-f", v, check=False)
        self.names, self.volumes = [], []


def http(method, url, key=None, body=None, timeout=60):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if key:
        req.add_header("Authorization", "Bearer " + key)
    if data:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        return 0, str(e)


def wait_health(base, want=200, timeout=90, ct=None, name=None):
    deadline = time.time() + timeout
    status, body = 0, ""
    while time.time() < deadline:
        status, body = http("GET", base + "/health", timeout=5)
        if status == want:
            return
        if ct and name:
            st = podman("inspect", "-f", "{{.State.Status}}", name,
                        check=False).stdout.strip()
            if st in ("exited", "stopped"):
                raise Fail("%s exited:\n%s" % (name, ct.logs(name)[-3000:]))
        time.sleep(0.5)
    raise Fail("%s/health: want %d, last %d %s%s" % (
        base, want, status, body[:200],
        ("\n" + ct.logs(name)[-3000:]) if ct and name else ""))


def completions(base, key):
    s, b = http("POST", base + "/v1/completions", key,
                {"model": "stories260K", "prompt": PROMPT,
                 "max_tokens": MAX_TOKENS, "temperature": 0})
    if s != 200:
        raise Fail("/v1/completions: %d %s" % (s, b[:300]))
    return json.loads(b)["choices"][0]["text"]


def chat(base, key, show=False):
    body = {"model": "stories260K", "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}]}
    s, b = http("POST", base + "/v1/chat/completions", key, body)
    if show:
        log("POST %s/v1/chat/completions %s -> %d %s" % (
            base, json.dumps(body), s, b))
    if s != 200:
        raise Fail("/v1/chat/completions: %d %s" % (s, b[:300]))
    return json.loads(b)["choices"][0]["message"]["content"]


def plane(ct, name, want):
    m = re.search(r"policy \S+ over (\S+)", ct.logs(name))
    if not m or m.group(1) != want:
        raise Fail("%s: the worker's log does not say 'over %s':\n%s"
                   % (name, want, ct.logs(name)[-2000:]))
    log("%s: %s" % (name, m.group(0)))


def grpc_health(port, service="", want="SERVING", timeout=60):
    """grpc.health.v1 Check of 127.0.0.1:port until it answers `want`."""
    deadline = time.time() + timeout
    while True:
        r = sh([INFINIGEN, "health", "--address=127.0.0.1:%d" % port,
                "--service=" + service, "--timeout_s=3"], check=False)
        line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        if line.endswith(": " + want):
            log("grpc.health.v1 %s" % line)
            return
        if time.time() > deadline:
            raise Fail("grpc.health.v1 of 127.0.0.1:%d%s: want %s, last %r"
                       % (port, " service " + service if service else "",
                          want, r.stdout.strip()))
        time.sleep(0.5)


def kv_check(address, token_file):
    """An append and fetch through the memory node, from outside, with the
    node's token; and refused with another one."""
    r = sh([INFINIGEN, "kv-check", "--kv_service=" + address,
            "--kv_auth_token_file=" + token_file], check=False, timeout=120)
    if r.returncode != 0 or "OK" not in r.stdout:
        raise Fail("infinigen kv-check --kv_service=%s: exit %d\n%s"
                   % (address, r.returncode, r.stdout[-2000:]))
    log("kv-check: %s" % "\n".join(
        l for l in r.stdout.strip().splitlines() if not l.startswith("I ")))
    wrong = tempfile.NamedTemporaryFile("w", suffix=".token", delete=False)
    try:
        wrong.write(os.urandom(16).hex() + "\n")
        wrong.close()
        r = sh([INFINIGEN, "kv-check", "--kv_service=" + address,
                "--kv_auth_token_file=" + wrong.name], check=False,
               timeout=120)
    finally:
        os.unlink(wrong.name)
    if r.returncode != 1 or "UNAUTHENTICATED" not in r.stdout:
        raise Fail("kv-check with a wrong token: exit %d, want 1 and "
                   "UNAUTHENTICATED:\n%s" % (r.returncode, r.stdout[-2000:]))
    log("kv-check with a wrong token: %s" % r.stdout.strip())


def sigterm(ct, name, grace):
    t0 = time.time()
    podman("kill", "--signal", "TERM", name)
    r = podman("wait", name, timeout=grace + 30)
    took = time.time() - t0
    code = r.stdout.strip().splitlines()[-1]
    if code != "0" or took > grace:
        raise Fail("%s: SIGTERM -> exit %s after %.1f s (grace %d s)\n%s" % (
            name, code, took, grace, ct.logs(name)[-2000:]))
    log("%s: SIGTERM -> exit 0 after %.1f s (grace %d s)" % (name, took, grace))


# ---- the checks ------------------------------------------------------------

def check_images(images):
    for image, binary in images:
        out = podman("run", "--rm", "--no-healthcheck", "--entrypoint", "sh",
                     image, "-c", "ldd %s; %s --help >/dev/null 2>&1; "
                     "echo help=$?" % (binary, binary)).stdout
        missing = [l.strip() for l in out.splitlines() if "not found" in l]
        if missing:
            raise Fail("%s: %s lacks %s" % (image, binary, ", ".join(missing)))
        if "help=0" not in out:
            raise Fail("%s: %s --help failed:\n%s" % (image, binary, out))
        size = podman("image", "inspect", "-f", "{{.Size}}", image).stdout
        log("%s: every library found, --help runs, %d MB" % (
            image, int(size.strip()) // 1000000))


def worker_spec(docs, secrets, volumes):
    cms = configmaps(docs)
    dep = [d for d in workload(docs, "Deployment")
           if d["metadata"]["name"] == "infinigen-worker"][0]
    pod = dep["spec"]["template"]["spec"]
    worker = Spec(pod, pod["containers"][0], cms, secrets, volumes)
    sidecars = [Spec(pod, c, cms, secrets, volumes)
                for c in pod.get("initContainers", [])]
    return worker, sidecars, pod


def inproc_reference(ct, worker, key):
    """The same image and flags with the KV cache in the worker's process."""
    argv = set_flag(worker.argv, "kv_service", "inproc:")
    argv = [a for a in argv if not a.startswith("--kv_auth_token_file=")]
    name = ct.start("inproc", worker, argv)
    base = "http://127.0.0.1:8000"
    wait_health(base, ct=ct, name=name)
    ref = (completions(base, key), chat(base, key))
    log("in-process reference: completion %r, chat %r" % ref)
    ct.stop_all()
    return ref


def serve_checks(base, key, ref, label):
    s, b = http("GET", base + "/v1/models", key)
    if s != 200 or "stories260K" not in b:
        raise Fail("/v1/models: %d %s" % (s, b[:200]))
    s, _ = http("POST", base + "/v1/completions", None,
                {"model": "stories260K", "prompt": PROMPT, "max_tokens": 4})
    if s != 401:
        raise Fail("/v1/completions without the API key: %d, want 401" % s)
    text = completions(base, key)
    reply = chat(base, key, show=True)
    if (text, reply) != ref:
        raise Fail("%s: greedy text differs from the in-process run:\n"
                   "  completion %r vs %r\n  chat %r vs %r"
                   % (label, text, ref[0], reply, ref[1]))
    log("%s: /v1/completions and /v1/chat/completions equal the in-process "
        "text" % label)


def check_disaggregated(ct, secrets, key, ref):
    docs = render("disaggregated")
    cms = configmaps(docs)
    sts = workload(docs, "StatefulSet")[0]
    pod = sts["spec"]["template"]["spec"]
    node = Spec(pod, pod["containers"][0], cms, secrets, {})
    service = sts["spec"]["serviceName"]
    worker, _, wpod = worker_spec(docs, secrets, {})
    hosts, addrs, nodes = [], [], []
    for n in range(sts["spec"]["replicas"]):
        host = "%s-%d.%s" % (sts["metadata"]["name"], n, service)
        argv = node.argv
        port = 7070 + 2 * n
        if n:
            argv = set_flag(set_flag(argv, "listen", "0.0.0.0:%d" % port),
                            "fetch_port", str(port + 1))
            argv = [a for a in argv if not a.startswith("--metrics_listen=")]
        nodes.append(ct.start("kv-%d" % n, node, argv))
        hosts.append(host)
        addrs.append("tcp://%s:%d" % (host, port))
    want = flag(worker.argv, "kv_service")
    got = ",".join(re.sub(r":\d+$", ":7070", a) for a in addrs)
    if want != got:
        raise Fail("the worker's --kv_service %s is not the StatefulSet's pods "
                   "(%s)" % (want, got))
    token = os.path.join(secrets, "infinigen-kv-auth", "token")
    for n in range(len(nodes)):
        grpc_health(7070 + 2 * n)
        kv_check("tcp://127.0.0.1:%d" % (7070 + 2 * n), token)
    argv = set_flag(worker.argv, "kv_service", ",".join(addrs))
    log("disaggregated: %d memory pods, worker --kv_service=%s"
        % (len(nodes), ",".join(addrs)))
    w = ct.start("worker-tcp", worker, argv, hosts)
    base = "http://127.0.0.1:8000"
    wait_health(base, ct=ct, name=w)
    plane(ct, w, "tcp")
    grpc_health(8080)
    grpc_health(8080, "infinigen.worker.Liveness")
    serve_checks(base, key, ref, "tcp")

    # The memory node killed: health says so, requests fail with the KV error.
    podman("kill", "--signal", "KILL", nodes[0])
    wait_health(base, want=503, timeout=30)
    # gRPC readiness follows the memory tier; liveness does not.
    grpc_health(8080, want="NOT_SERVING", timeout=30)
    grpc_health(8080, "infinigen.worker.Liveness")
    s, b = http("POST", base + "/v1/completions", key,
                {"model": "stories260K", "prompt": PROMPT, "max_tokens": 8})
    if s < 500:
        raise Fail("with a memory node killed /v1/completions gave %d %s, "
                   "want a 5xx error" % (s, b[:300]))
    log("memory node killed: /health 503, /v1/completions %d %s" % (s, b[:200]))
    # Restarted (empty): serving resumes, the text recomputed is the same.
    podman("start", nodes[0])
    wait_health(base, timeout=60)
    grpc_health(8080)
    deadline = time.time() + 30
    while True:
        try:
            serve_checks(base, key, ref, "tcp after the node's restart")
            break
        except Fail:
            if time.time() > deadline:
                raise
            time.sleep(1)
    sigterm(ct, w, wpod.get("terminationGracePeriodSeconds", 30))
    for n in nodes:
        sigterm(ct, n, node.grace)
    ct.stop_all()


def check_single_node(ct, secrets, key, ref):
    docs = render("single-node")
    volumes = {}
    pod = workload(docs, "Deployment")[0]["spec"]["template"]["spec"]
    for v in pod.get("volumes", []):
        if v.get("emptyDir", {}).get("medium") == "Memory":
            volumes[v["name"]] = ct.volume(v["name"])
    worker, sidecars, wpod = worker_spec(docs, secrets, volumes)
    if len(sidecars) != 1 or not flag(sidecars[0].argv, "shm_listen"):
        raise Fail("single-node: want one memory-node sidecar with --shm_listen")
    node = ct.start("kv-sidecar", sidecars[0])
    grpc_health(7070)
    mount = [m for m in (sidecars[0].mounts or []) if m[0] in volumes]
    shm = flag(sidecars[0].argv, "shm_listen")[len("unix:"):]
    for vol, path in mount:
        if shm.startswith(path.rstrip("/") + "/"):
            host = podman("volume", "inspect", "-f", "{{.Mountpoint}}",
                          volumes[vol]).stdout.strip()
            kv_check("shm:unix:" + host + shm[len(path.rstrip("/")):],
                     os.path.join(secrets, "infinigen-kv-auth", "token"))
            break
    else:
        raise Fail("single-node: --shm_listen %s is on no shared volume" % shm)
    log("single-node: worker --kv_service=%s" % flag(worker.argv, "kv_service"))
    w = ct.start("worker-shm", worker)
    base = "http://127.0.0.1:8000"
    wait_health(base, ct=ct, name=w)
    plane(ct, w, "shm")
    grpc_health(8080)
    serve_checks(base, key, ref, "shm")
    # The pod's grace covers the worker, then the sidecar.
    t0 = time.time()
    sigterm(ct, w, wpod["terminationGracePeriodSeconds"])
    sigterm(ct, node, wpod["terminationGracePeriodSeconds"] -
            int(time.time() - t0))
    ct.stop_all()


# ---- podman kube play ------------------------------------------------------

# What podman 4.3's `kube play` lacks, and what the test changes for it.
KUBE_CHANGES = [
    "Service, PodDisruptionBudget, NetworkPolicy: dropped (podman has none; "
    "the pods share the host's network)",
    "StatefulSet: one Pod per replica, <name>-<n> with hostname and "
    "subdomain; pod n>0 listens on 7070+2n (fetch 7071+2n); the worker's "
    "--kv_service names the pods as tcp://127.0.0.1:<port> (no cluster DNS, "
    "and podman ignores hostAliases on the host network)",
    "native sidecar (initContainer with restartPolicy Always): a regular "
    "container, listed first",
    "hostNetwork: true and containerPorts dropped (podman allows no port "
    "mappings on the host network)",
    "$(VAR) in args expanded from the ConfigMaps (podman passes them "
    "literally)",
    "resources dropped (the limits exceed this machine; nvidia.com/gpu)",
    "secret volumes: optional: false written out (podman 4.3 crashes on the "
    "field's absence); the Secrets made of random values, their data not "
    "base64-encoded (podman 4.3 writes it into the volume undecoded)",
    "probes: podman 4.3 runs no gRPC or readiness probes, so the test runs "
    "each container's startupProbe and readinessProbe itself as the kubelet "
    "would, from the host whose network the pods share (grpc: `infinigen "
    "health`, httpGet, tcpSocket), within the probe's failureThreshold x "
    "periodSeconds; the probes of pod n>0 of the StatefulSet on its port "
    "7070+2n",
]


def kube_convert(docs):
    cms = configmaps(docs)
    out, addrs = [], []
    sts = workload(docs, "StatefulSet")
    for st in sts:
        for n in range(st["spec"]["replicas"]):
            name = "%s-%d" % (st["metadata"]["name"], n)
            spec = json.loads(json.dumps(st["spec"]["template"]["spec"]))
            spec["hostname"] = name
            spec["subdomain"] = st["spec"]["serviceName"]
            if n:
                c = spec["containers"][0]
                c["args"] = set_flag(set_flag(c["args"], "listen",
                                              "0.0.0.0:%d" % (7070 + 2 * n)),
                                     "fetch_port", str(7071 + 2 * n))
                c["args"] = [a for a in c["args"]
                             if not a.startswith("--metrics_listen=")]
                for kind in ("startupProbe", "readinessProbe",
                             "livenessProbe"):
                    for how in ("grpc", "tcpSocket"):
                        if c.get(kind, {}).get(how, {}).get("port") == 7070:
                            c[kind][how]["port"] = 7070 + 2 * n
            addrs.append("tcp://127.0.0.1:%d" % (7070 + 2 * n))
            out.append({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": name,
                                     "labels": st["spec"]["template"]
                                     ["metadata"]["labels"]},
                        "spec": spec})
    for d in workload(docs, "Deployment"):
        spec = json.loads(json.dumps(d["spec"]["template"]["spec"]))
        side = [c for c in spec.get("initContainers", [])
                if c.get("restartPolicy") == "Always"]
        rest = [c for c in spec.get("initContainers", []) if c not in side]
        spec.pop("initContainers", None)
        if rest:
            spec["initContainers"] = rest
        for c in side:
            del c["restartPolicy"]
        spec["containers"] = side + spec["containers"]
        out.append({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": d["metadata"]["name"],
                                 "labels": d["spec"]["template"]["metadata"]
                                 ["labels"]},
                    "spec": spec})
    for pod in out:
        spec = pod["spec"]
        spec["hostNetwork"] = True
        for c in spec["containers"] + spec.get("initContainers", []):
            env = container_env(c, cms)
            c["args"] = [expand(a, env) for a in c.get("args", [])]
            if addrs and flag(c["args"], "kv_service"):
                c["args"] = set_flag(c["args"], "kv_service", ",".join(addrs))
            c.pop("ports", None)
            c.pop("resources", None)
        for v in spec.get("volumes", []):
            if "secret" in v:
                v["secret"].setdefault("optional", False)
    return [d for d in docs if d["kind"] == "ConfigMap"] + out


def probe_once(probe):
    """One try of a Kubernetes probe against 127.0.0.1; (passed, what)."""
    timeout = probe.get("timeoutSeconds", 1)
    if "grpc" in probe:
        g = probe["grpc"]
        r = sh([INFINIGEN, "health", "--address=127.0.0.1:%d" % g["port"],
                "--service=" + g.get("service", ""),
                "--timeout_s=%d" % timeout], check=False)
        return r.returncode == 0, "grpc %d%s" % (
            g["port"], " " + g["service"] if g.get("service") else "")
    if "httpGet" in probe:
        h = probe["httpGet"]
        status, _ = http("GET", "http://127.0.0.1:%d%s" % (h["port"],
                                                          h.get("path", "/")),
                         timeout=timeout)
        return 200 <= status < 400, "httpGet %d%s" % (h["port"],
                                                      h.get("path", "/"))
    if "tcpSocket" in probe:
        port = probe["tcpSocket"]["port"]
        try:
            socket.create_connection(("127.0.0.1", port), timeout).close()
            return True, "tcpSocket %d" % port
        except OSError:
            return False, "tcpSocket %d" % port
    raise Fail("a probe of no kind the test runs: %s" % probe)


def run_probe(probe, t0):
    """Runs `probe` every periodSeconds (at most 1 s apart here) until it
    passes or its failureThreshold x periodSeconds have gone by since t0."""
    period = probe.get("periodSeconds", 10)
    limit = probe.get("failureThreshold", 3) * period + probe.get(
        "initialDelaySeconds", 0)
    while True:
        ok, what = probe_once(probe)
        if ok:
            return what
        if time.time() - t0 > limit:
            raise Fail("%s: not passed within %d s" % (what, limit))
        time.sleep(min(period, 1))


def pods_ready(pods, t0):
    """Each container's startupProbe, then its readinessProbe."""
    for pod in pods:
        if pod["kind"] != "Pod":
            continue
        for c in pod["spec"]["containers"]:
            passed = []
            for kind in ("startupProbe", "readinessProbe"):
                if kind in c:
                    passed.append("%s %s" % (kind, run_probe(c[kind], t0)))
            log("pod %s container %s ready after %.1f s: %s" % (
                pod["metadata"]["name"], c["name"], time.time() - t0,
                ", ".join(passed) or "(no probes)"))


def kube_play(ct, overlay, secrets, key, ref):
    docs = render(overlay)
    pods = kube_convert(docs)
    tmp = tempfile.mkdtemp(prefix="infinigen-kube-")
    sfile, pfile = os.path.join(tmp, "secrets.yaml"), os.path.join(tmp,
                                                                   "pods.yaml")
    # podman 4.3 writes a Secret's data into the volume as given, without
    # base64-decoding it: the values go in as they are.
    secret_docs = [{"apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": name}, "data": {k: value + "\n"}}
                   for name, (k, value) in secrets.items()]
    with open(sfile, "w") as f:
        yaml.safe_dump_all(secret_docs, f)
    with open(pfile, "w") as f:
        yaml.safe_dump_all(pods, f)
    try:
        for name in secrets:
            podman("secret", "rm", name, check=False)
            podman("volume", "rm", "-f", name, check=False)
        podman("kube", "play", sfile)
        t0 = time.time()
        podman("kube", "play", pfile)
        base = "http://127.0.0.1:8000"
        try:
            pods_ready(pods, t0)
        except Fail as e:
            ps = podman("ps", "-a", "--format", "{{.Names}}").stdout.split()
            raise Fail("%s\n%s" % (e, "\n".join(
                "--- %s\n%s" % (n, podman("logs", n, check=False).stdout[-1500:])
                for n in ps if not n.endswith("-infra"))))
        log("%s: kube play, every pod ready by its own probes after %.1f s"
            % (overlay, time.time() - t0))
        ps = podman("ps", "-a", "--format", "{{.Names}} {{.Status}}").stdout
        for line in ps.splitlines():
            if "-infra " not in line and not line.split(" ", 1)[1].startswith(
                    "Up"):
                raise Fail("%s: a container is not running: %s" % (overlay,
                                                                   line))
        log("%s: containers:\n  %s" % (overlay, "\n  ".join(
            l for l in ps.splitlines() if "-infra" not in l)))
        serve_checks(base, key, ref, "kube play " + overlay)
    finally:
        podman("kube", "down", pfile, check=False, timeout=180)
        for name in secrets:
            podman("secret", "rm", name, check=False)
            podman("volume", "rm", "-f", name, check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def environment(install):
    if shutil.which("podman") is None:
        if not install:
            raise Skip("no podman (scripts/install_deps.sh --containers)")
        if os.geteuid() != 0 and shutil.which("sudo") is None:
            raise Skip("no podman, and not root to install it")
        r = sh([os.path.join(ROOT, "scripts", "install_deps.sh"),
                "--containers"], check=False)
        if r.returncode != 0 or shutil.which("podman") is None:
            raise Skip("podman could not be installed:\n" + r.stdout[-1500:])
    if shutil.which("kubectl") is None:
        raise Skip("no kubectl (scripts/install_deps.sh)")
    os.environ.setdefault("CONTAINERS_CONF",
                          os.path.join(ROOT, "docker", "containers.conf"))


def runtime_works():
    """A container starts here (needs an image: the base, made if need be)."""
    base = "docker.io/library/debian:bookworm-slim"
    if podman("image", "exists", base, check=False).returncode != 0:
        return  # no image to try it with: the build's failure stands
    r = podman("run", "--rm", "--no-healthcheck", "--pull=never", base,
               "true", check=False, timeout=120)
    if r.returncode != 0:
        raise Skip("the container runtime refuses to start a container:\n"
                   + r.stdout[-1500:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--no-build", action="store_true",
                    help="use the images already built")
    ap.add_argument("--no-install", action="store_true",
                    help="skip rather than install podman where it is missing")
    args = ap.parse_args()
    t0 = time.time()
    ct = Containers()
    tmp = tempfile.mkdtemp(prefix="infinigen-ct-")
    status = "FAILED"
    try:
        environment(not args.no_install)
        if not args.no_build:
            t = time.time()
            r = sh([os.path.join(ROOT, "scripts", "build_images.sh"),
                    "--engine", "podman"], check=False, timeout=3600)
            if r.returncode == 3:
                raise Skip("no base image can be had here:\n" + r.stdout[-1500:])
            if r.returncode != 0:
                runtime_works()  # a runtime that refuses containers: a skip
                raise Fail("scripts/build_images.sh: exit %d\n%s"
                           % (r.returncode, r.stdout[-3000:]))
            log("images built in %.0f s" % (time.time() - t))
        runtime_works()
        reg = "registry.example.com/infinigen"
        check_images([(reg + "/kv-memory-server:0.1.0",
                       "/opt/infinigen/bin/kv_memory_server"),
                      (reg + "/infinigen-worker:0.1.0",
                       "/opt/infinigen/bin/infinigen")])
        # The Secrets the overlays need, as files (group-readable: fsGroup).
        key = None
        values = {}
        for secret, k in (("infinigen-kv-auth", "token"),
                          ("infinigen-api-key", "key")):
            d = os.path.join(tmp, secret)
            os.makedirs(d)
            os.chmod(d, 0o755)
            value = os.urandom(24).hex()
            with open(os.path.join(d, k), "w") as f:
                f.write(value + "\n")
            os.chmod(os.path.join(d, k), 0o444)
            values[secret] = (k, value)
            if k == "key":
                key = value
        worker, _, _ = worker_spec(render("single-node"), tmp, {})
        ref = inproc_reference(ct, worker, key)
        check_disaggregated(ct, tmp, key, ref)
        check_single_node(ct, tmp, key, ref)
        log("podman kube play: what the test changes in the renders:\n  - "
            + "\n  - ".join(KUBE_CHANGES))
        kube_play(ct, "single-node", values, key, ref)
        kube_play(ct, "disaggregated", values, key, ref)
        status = "PASSED"
    except Skip as e:
        status = "SKIPPED"
        log("skipped: %s" % e)
    except Fail as e:
        log("FAILED: %s" % e)
    except subprocess.TimeoutExpired as e:
        log("FAILED: timed out: %s" % e)
    finally:
        if shutil.which("podman"):
            ct.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    log("took %.0f s" % (time.time() - t0))
    print("%s %s" % (NAME, status))
    return 1 if status == "FAILED" else 0


if __name__ == "__main__":
    sys.exit(main())
