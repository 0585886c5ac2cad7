#!/usr/bin/env bash
# Builds the two images from docker/: kv-memory-server and the CPU worker
# (infinigen-worker, docker/infinigen.Dockerfile --target cpu), tagged as
# k8s/ names them (registry.example.com/infinigen/<name>:0.1.0).
#
#   scripts/build_images.sh [--from-source] [--cuda] [--engine docker|podman]
#                           [--registry REG] [--tag TAG]
#
# By default the binaries are the host's `bazel build` outputs (a Debian 12
# host: the images' libraries), copied to docker/prebuilt/bin/; with
# --from-source the images compile them with Bazel themselves (slow).
# --cuda also builds the CUDA worker (NVIDIA's base image; needs it pullable
# and, without --from-source, a host build with the CUDA toolkit), tagged
# <registry>/infinigen-worker:<tag>-cuda. The engine is docker where its
# daemon answers, podman otherwise (docker/containers.conf). Where the
# Debian base cannot be pulled it is made with mmdebstrap (cached in
# .cache/images/). podman and mmdebstrap: scripts/install_deps.sh --containers.
# $BAZEL_FLAGS is passed to the host's bazel build. Exit status 3: no base
# image could be had (neither pulled nor made).
set -euo pipefail
cd "$(dirname "$0")/.."

from_source=0 cuda=0 engine="" registry=registry.example.com/infinigen tag=0.1.0
while [ $# -gt 0 ]; do
  case "$1" in
    --from-source) from_source=1 ;;
    --cuda) cuda=1 ;;
    --engine) engine="${2:?--engine needs docker or podman}"; shift ;;
    --registry) registry="${2:?--registry needs a value}"; shift ;;
    --tag) tag="${2:?--tag needs a value}"; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build_images: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ -z "$engine" ]; then
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    engine=docker
  elif command -v podman >/dev/null 2>&1; then
    engine=podman
  else
    echo "build_images: neither a working docker nor podman (scripts/install_deps.sh --containers installs podman)" >&2
    exit 1
  fi
fi
case "$engine" in
  docker) build=(docker build) ; export DOCKER_BUILDKIT=1 ;;
  podman) export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/docker/containers.conf}"
          build=(podman build --format docker) ;;
  *) echo "build_images: --engine is docker or podman, not $engine" >&2; exit 2 ;;
esac
say() { echo "build_images: $*" >&2; }

# The Debian base: pulled, or made from Debian's packages.
if ! "$engine" image inspect docker.io/library/debian:bookworm >/dev/null 2>&1 &&
   ! "$engine" pull -q docker.io/library/debian:bookworm >/dev/null 2>&1; then
  command -v mmdebstrap >/dev/null ||
    { say "debian:bookworm cannot be pulled and mmdebstrap is missing (scripts/install_deps.sh --containers)"; exit 1; }
  mkdir -p .cache/images
  tar=.cache/images/bookworm.tar
  if [ ! -s "$tar" ]; then
    say "making debian:bookworm with mmdebstrap"
    if ! mmdebstrap --quiet --variant=minbase --format=tar bookworm "$tar.tmp"; then
      rm -rf "$tar.tmp"
      say "mmdebstrap could not make debian:bookworm (are Debian's mirrors reachable?)"
      exit 3
    fi
    mv "$tar.tmp" "$tar"
  fi
  "$engine" import --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    "$tar" docker.io/library/debian:bookworm >/dev/null
fi
if ! "$engine" image inspect docker.io/library/debian:bookworm-slim >/dev/null 2>&1 &&
   ! "$engine" pull -q docker.io/library/debian:bookworm-slim >/dev/null 2>&1; then
  "$engine" tag docker.io/library/debian:bookworm docker.io/library/debian:bookworm-slim
fi

args=()
rm -rf docker/prebuilt
mkdir -p docker/prebuilt/bin
if [ "$from_source" = 0 ]; then
  say "bazel build (host)"
  # shellcheck disable=SC2086
  bazel build ${BAZEL_FLAGS:-} //gpu_worker:infinigen //kv_memory_service:kv_memory_server
  install -m 0755 bazel-bin/gpu_worker/infinigen bazel-bin/kv_memory_service/kv_memory_server \
    docker/prebuilt/bin/
  if [ "$cuda" = 1 ]; then
    [ -f bazel-bin/gpu_worker/backend/cuda/libinfinigen_cuda.so ] ||
      { say "--cuda needs the host's CUDA backend (bazel-bin/gpu_worker/backend/cuda/libinfinigen_cuda.so: a host with the CUDA 13 toolkit), or --from-source"; exit 1; }
    install -m 0755 bazel-bin/gpu_worker/backend/cuda/libinfinigen_cuda.so docker/prebuilt/bin/
  fi
  args=(--build-arg BINARIES=prebuilt --build-arg CUDA_BINARIES=prebuilt)
fi

t0=$SECONDS
say "$registry/kv-memory-server:$tag"
"${build[@]}" "${args[@]}" -f docker/kv_memory_server.Dockerfile \
  -t "$registry/kv-memory-server:$tag" .
say "$registry/infinigen-worker:$tag (CPU)"
"${build[@]}" "${args[@]}" -f docker/infinigen.Dockerfile --target cpu \
  -t "$registry/infinigen-worker:$tag" .
if [ "$cuda" = 1 ]; then
  say "$registry/infinigen-worker:$tag-cuda"
  "${build[@]}" "${args[@]}" -f docker/infinigen.Dockerfile --target cuda \
    -t "$registry/infinigen-worker:$tag-cuda" .
fi
say "images built in $((SECONDS - t0)) s:"
"$engine" images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -F "$registry/" | grep -F ":$tag" >&2 || true
