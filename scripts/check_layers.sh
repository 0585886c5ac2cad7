#!/usr/bin/env bash
# The source tree's structural rules: prints one line per violation and
# exits 1 if there is any (0 when the tree keeps them all).
#
#   a. size: no non-test source (.cc, .h) in gpu_worker/, kv_memory_service/,
#      model/ or speculator/ over 700 lines. Test code is excused: *_test.cc
#      and everything under a testing/ directory (test fakes and helpers);
#      so are CUDA kernel files (.cu).
#   b. the offloaded cache: the files under gpu_worker/kv/ that define
#      OffloadedKvCache's methods (those containing "OffloadedKvCache::")
#      hold at most 600 lines together, and no header under gpu_worker/kv/
#      declares a two-element array (`name[2]`; one per stage or buffer
#      belongs in a type that says what the two are).
#   c. the policy interface: class KvPolicy (gpu_worker/kv/kv_policy.h) has
#      at most 10 virtual methods, its destructor included.
#   d. layers: no library source in kv_memory_service/{tcp,shm,rdma}/
#      includes kv_memory_service/server/ (a plane's tests may start the
#      server that hosts it), and nothing in gpu_worker/kv/, tests
#      included, includes a header of the memory node's store
#      (kv_memory_service/store/): the worker reaches the node through
#      kv_memory_service/client/.
#   e. no cycles of two: a unit is a directory's x.h and x.cc; no two units
#      include each other's headers (project includes, "path/from/root.h").
#
# Run from anywhere: bash scripts/check_layers.sh
set -euo pipefail
for arg in "$@"; do
  case "$arg" in
  -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "check_layers.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import os
import re
import sys

MAX_LINES = 700
MAX_OFFLOADED_LINES = 600
MAX_POLICY_VIRTUALS = 10
SIZED_DIRS = ("gpu_worker/", "kv_memory_service/", "model/", "speculator/")
SOURCE_EXT = (".cc", ".h", ".cu", ".cuh")


def sources():
    """Every C++ or CUDA source under the root, as a sorted list of paths."""
    found = []
    for root, dirs, files in os.walk("."):
        dirs[:] = sorted(d for d in dirs
                         if not d.startswith(".") and not d.startswith("bazel-"))
        for f in files:
            if f.endswith(SOURCE_EXT):
                found.append(os.path.normpath(os.path.join(root, f)))
    return sorted(found)


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def line_count(text):
    return text.count("\n") + (0 if text.endswith("\n") or not text else 1)


def without_comments(text):
    """The text with // and /* */ comments blanked (string literals kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or c == "'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def includes(text):
    return INCLUDE.findall(text)


def is_test_code(path):
    return path.endswith("_test.cc") or "/testing/" in "/" + path


violations = []
files = sources()
text = {p: read(p) for p in files}

# a. size.
for p in files:
    if not p.startswith(SIZED_DIRS) or not p.endswith((".cc", ".h")):
        continue
    if is_test_code(p):
        continue
    n = line_count(text[p])
    if n > MAX_LINES:
        violations.append(f"a size: {p}: {n} lines (at most {MAX_LINES})")

# b. the offloaded cache.
kv = [p for p in files if p.startswith("gpu_worker/kv/")]
defining = [p for p in kv if not is_test_code(p) and
            "OffloadedKvCache::" in without_comments(text[p])]
total = sum(line_count(text[p]) for p in defining)
if total > MAX_OFFLOADED_LINES:
    parts = ", ".join(f"{p} {line_count(text[p])}" for p in defining)
    violations.append(
        f"b offloaded: OffloadedKvCache's methods span {total} lines "
        f"(at most {MAX_OFFLOADED_LINES}): {parts}")
PAIR = re.compile(r"\b\w+\s*\[\s*2\s*\]")
for p in kv:
    if not p.endswith(".h"):
        continue
    for number, line in enumerate(without_comments(text[p]).split("\n"), 1):
        m = PAIR.search(line)
        if m:
            violations.append(
                f"b offloaded: {p}:{number}: a two-element array "
                f"'{m.group(0)}'")

# c. the policy interface.
POLICY_HEADER = "gpu_worker/kv/kv_policy.h"
if POLICY_HEADER in text:
    code = without_comments(text[POLICY_HEADER])
    m = re.search(r"\bclass\s+KvPolicy\b[^;{]*\{", code)
    if m:
        depth, i = 1, m.end()
        while i < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        virtuals = len(re.findall(r"\bvirtual\b", code[m.end():i]))
        if virtuals > MAX_POLICY_VIRTUALS:
            violations.append(
                f"c policy: class KvPolicy ({POLICY_HEADER}) has {virtuals} "
                f"virtual methods (at most {MAX_POLICY_VIRTUALS})")

# d. layers.
PLANES = ("kv_memory_service/tcp/", "kv_memory_service/shm/",
          "kv_memory_service/rdma/")
for p in files:
    for inc in includes(text[p]):
        if (p.startswith(PLANES) and not is_test_code(p) and
                inc.startswith("kv_memory_service/server/")):
            violations.append(f"d layers: {p} includes {inc} (a plane below "
                              "the server)")
        if (p.startswith("gpu_worker/kv/") and
                inc.startswith("kv_memory_service/store/")):
            violations.append(f"d layers: {p} includes {inc} (the store's "
                              "internals; use kv_memory_service/client/)")

# e. cycles of two.
def unit(path):
    stem, ext = os.path.splitext(path)
    return stem if ext in (".h", ".cc") else None


local = set(files)
uses = {}  # unit -> {unit whose header it includes: including file}
for p in files:
    a = unit(p)
    if a is None:
        continue
    for inc in includes(text[p]):
        b = unit(inc)
        if inc in local and inc.endswith(".h") and b is not None and b != a:
            uses.setdefault(a, {}).setdefault(b, p)
for a in sorted(uses):
    for b in sorted(uses[a]):
        if a < b and a in uses.get(b, {}):
            violations.append(
                f"e cycle: {a} and {b} include each other's headers "
                f"({uses[a][b]} includes {b}.h, {uses[b][a]} includes {a}.h)")

for v in violations:
    print(v)
sys.exit(1 if violations else 0)
PY
