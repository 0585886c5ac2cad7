#!/usr/bin/env bash
# Installs every Debian package the build and the tests need. Idempotent:
# quiet and quick when everything is already there.
#
#   scripts/install_deps.sh               # the build's and the tests' packages
#   scripts/install_deps.sh --containers  # plus podman, runc, catatonit and
#                                         # mmdebstrap (scripts/build_images.sh,
#                                         # scripts/container_test.sh)
set -euo pipefail

containers=0
for arg in "$@"; do
  case "$arg" in
    --containers) containers=1 ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install_deps: unknown option $arg (try --help)" >&2; exit 2 ;;
  esac
done

PKGS=(
  bazel-bootstrap
  g++
  protobuf-compiler
  protobuf-compiler-grpc
  libprotobuf-dev
  libgrpc++-dev
  libabsl-dev
  libopenblas-dev
  liblapacke-dev
  libgtest-dev
  libgmock-dev
  libbenchmark-dev
  libibverbs-dev
  libxxhash-dev
  nlohmann-json3-dev
  libcpp-httplib-dev
  # OpenSSL: the HTTPS API and the memory node's TLS fetch socket.
  libssl-dev
  prometheus-cpp-dev
  curl
  python3
  python3-yaml
  python3-prometheus-client
  python3-pip
  # Sanitizer runtimes (--config=asan / --config=tsan; g++ usually brings
  # them) and clang's libFuzzer for fuzz/run.sh.
  libasan8
  libubsan1
  libtsan2
  clang-14
  libclang-rt-14-dev
)
# //k8s:manifests_test renders the manifests with `kubectl kustomize`. Any
# kubectl will do; Debian's (1.20) only where there is none, so a newer one
# already installed is never replaced.
if ! command -v kubectl >/dev/null 2>&1; then
  PKGS+=(kubernetes-client)
fi
# Containers without a Docker daemon: Debian's podman with runc (crun
# refuses hybrid cgroups), catatonit for pods' infra containers, mmdebstrap
# to make a Debian base image where no registry serves one.
if [ "$containers" = 1 ]; then
  PKGS+=(podman runc catatonit mmdebstrap)
fi

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}" >&2
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The python3 on PATH may not be Debian's (pyenv, venv): give it PyYAML too.
if ! python3 -c 'import yaml' >/dev/null 2>&1; then
  echo "install_deps: installing PyYAML for $(command -v python3)" >&2
  python3 -m pip install -q pyyaml >/dev/null
fi

# The HTTP API's tests drive `infinigen serve` with the official OpenAI client
# (not packaged by Debian 12) and read /metrics with Prometheus's own parser.
# Debian's python3 is externally managed (PEP 668): pip needs
# --break-system-packages there, and an older pip elsewhere lacks the flag.
pip_install() {
  echo "install_deps: installing $1 for $(command -v python3)" >&2
  python3 -m pip install -q "$1" >/dev/null 2>&1 ||
    python3 -m pip install -q --break-system-packages "$1" >/dev/null
}
if ! python3 -c 'import openai' >/dev/null 2>&1; then
  pip_install openai
fi
if ! python3 -c 'import prometheus_client' >/dev/null 2>&1; then
  pip_install prometheus_client
fi
# lm-evaluation-harness (its API models only: no torch) scores a local task
# through the HTTP API's logprobs and tokenizer routes.
if ! python3 -c 'import lm_eval' >/dev/null 2>&1; then
  pip_install 'lm_eval[api]==0.4.13'
fi
