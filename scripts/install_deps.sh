#!/usr/bin/env bash
# Installs every Debian package the build and the tests need. Idempotent:
# quiet and quick when everything is already there.
set -euo pipefail

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
  nlohmann-json3-dev
  libcpp-httplib-dev
  prometheus-cpp-dev
  curl
  python3
  python3-yaml
)
# //k8s:manifests_test renders the manifests with `kubectl kustomize`. Any
# kubectl will do; Debian's (1.20) only where there is none, so a newer one
# already installed is never replaced.
if ! command -v kubectl >/dev/null 2>&1; then
  PKGS+=(kubernetes-client)
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
# and read /metrics with Prometheus's own parser.
if ! python3 -c 'import openai' >/dev/null 2>&1; then
  echo "install_deps: installing openai for $(command -v python3)" >&2
  python3 -m pip install -q openai >/dev/null
fi
if ! python3 -c 'import prometheus_client' >/dev/null 2>&1; then
  echo "install_deps: installing prometheus_client for $(command -v python3)" >&2
  python3 -m pip install -q prometheus_client >/dev/null
fi
