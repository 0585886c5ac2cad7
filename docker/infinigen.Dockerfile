# syntax=docker/dockerfile:1
# The worker (`infinigen serve`) as an image, with the stories260K model.
# Two images from this file, sharing their stages:
#
#   --target cpu    Debian 12, the CPU backend (no GPU needed)
#   (default) cuda  NVIDIA's CUDA 13.0 runtime image, the CUDA backend
#
#   scripts/build_images.sh      # kv-memory-server and the CPU worker
#   docker build -f docker/infinigen.Dockerfile --target cpu -t infinigen-worker:cpu .
#   docker build -f docker/infinigen.Dockerfile -t infinigen-worker .
#   docker run --rm --gpus all -p 8000:8000 -p 8080:8080 infinigen-worker
#
# Port 8080: gRPC Worker.Generate (proto/worker.proto) and grpc.health.v1;
# 8000 the OpenAI API when --http_listen is given (k8s/ does). With no
# --kv_service the KV cache stays in the process; k8s/ points --kv_service
# at a kv_memory_server (shm:, tcp:// or rdma://).
#
# Binaries: by default the `build` (CPU) and `build-cuda` stages compile
# the worker with Bazel inside the build (slow on a small machine).
# `--build-arg BINARIES=prebuilt` (CPU image) or `--build-arg
# CUDA_BINARIES=prebuilt` (CUDA image) take them from docker/prebuilt/bin/
# in the build context instead: binaries built on a Debian 12 host (the
# same libraries; the CUDA image also needs libinfinigen_cuda.so from a host
# with the CUDA 13 toolkit). scripts/build_images.sh puts the host's
# `bazel build` outputs there.
#
# Models. The image carries stories260K (models/stories260K, MIT) at
# /opt/infinigen/models/stories260K with a skew file for --policy=infinigen
# computed at build time. A bigger model is mounted, not baked in:
#
#   scripts/fetch_smollm2.sh        # -> models_cache/<SmolLM2 GGUF>
#   docker run --rm --gpus all -p 8080:8080 -v "$PWD/models_cache:/models:ro" \
#       infinigen-worker serve --listen=0.0.0.0:8080 \
#       --model=/models/<file>.gguf          # GGUF carries its tokenizer
#
# (k8s/README.md shows the same with a volume.) For --policy=infinigen a
# model needs its own skew file: `infinigen skew --model=... --text=...
# --out=...`, mounted beside it.
#
# CUDA: the build compiles the CUDA kernels with nvcc 13.0 (the toolkit the
# project is developed against) and the runtime stage is NVIDIA's CUDA 13.0
# runtime image, which brings cudart and cuBLAS; the host needs a driver
# for CUDA 13 (580 or newer) and the NVIDIA container toolkit. The binary is
# built with .bazelrc's -march=x86-64-v3: it needs a CPU with AVX2.

ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
ARG BINARIES=build
ARG CUDA_BINARIES=build-cuda

# ---- build-base: Debian's Bazel and libraries, as on the dev machines ------
FROM debian:bookworm AS build-base
WORKDIR /src
COPY scripts/install_deps.sh scripts/install_deps.sh
RUN ./scripts/install_deps.sh && rm -rf /var/lib/apt/lists/*

# ---- build: the worker without CUDA (the CPU image) ------------------------
FROM build-base AS build
COPY . .
# The Bazel output tree lives in a cache mount, so the binary is copied out
# in the same step.
RUN --mount=type=cache,target=/root/.cache/bazel \
    bazel build --jobs="$(nproc)" //gpu_worker:infinigen && \
    install -D -m 0755 bazel-bin/gpu_worker/infinigen /out/bin/infinigen

# ---- build-cuda: plus NVIDIA's nvcc, and the CUDA backend plugin -----------
FROM build-base AS build-cuda
# CUDA 13.0 compiler, runtime and cuBLAS headers from NVIDIA's Debian 12
# repository; bazel/cuda_configure.bzl finds them through $CUDA_PATH.
ARG CUDA_APT_VERSION=13-0
ENV CUDA_PATH=/usr/local/cuda-13.0
RUN apt-get update && \
    apt-get install -y --no-install-recommends ca-certificates curl && \
    curl -fsSL -o /tmp/cuda-keyring.deb \
        https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb && \
    dpkg -i /tmp/cuda-keyring.deb && rm /tmp/cuda-keyring.deb && \
    apt-get update && \
    apt-get install -y --no-install-recommends \
        cuda-nvcc-${CUDA_APT_VERSION} cuda-cudart-dev-${CUDA_APT_VERSION} \
        cuda-cccl-${CUDA_APT_VERSION} libcublas-dev-${CUDA_APT_VERSION} && \
    rm -rf /var/lib/apt/lists/* && \
    test -x "$CUDA_PATH/bin/nvcc"
COPY . .
# The binary with its CUDA backend plugin beside it (loaded when --backend
# picks CUDA).
RUN --mount=type=cache,target=/root/.cache/bazel \
    bazel build --jobs="$(nproc)" //gpu_worker:infinigen && \
    install -D -m 0755 bazel-bin/gpu_worker/infinigen /out/bin/infinigen && \
    install -m 0755 bazel-bin/gpu_worker/backend/cuda/libinfinigen_cuda.so \
        /out/bin/libinfinigen_cuda.so

# ---- prebuilt: binaries from the build context (docker/prebuilt/bin/) ------
FROM debian:bookworm-slim AS prebuilt
COPY docker/prebuilt/bin/ /out/bin/

FROM ${BINARIES} AS binaries
FROM ${CUDA_BINARIES} AS cuda-binaries

# ---- cpu-base: Debian 12 with the libraries the worker links ---------------
FROM debian:bookworm-slim AS cpu-base
# What `ldd infinigen` lists, by Debian package: gRPC (libgrpc29, re2,
# c-ares), OpenBLAS and LAPACKE, httplib and prometheus-cpp (HTTP API,
# /metrics), OpenSSL, xxhash; libibverbs1 and its providers for rdma://.
RUN apt-get update && \
    apt-get install -y --no-install-recommends \
        libgrpc++1.51 libprotobuf32 libabsl20220623 libatomic1 libssl3 \
        libcpp-httplib0.11 libprometheus-cpp-core1.0 libxxhash0 \
        libopenblas0-pthread liblapacke \
        libibverbs1 ibverbs-providers && \
    rm -rf /var/lib/apt/lists/*
# The same fixed uid/gid as the kv-memory-server image (k8s/ runAsUser).
RUN groupadd --system --gid 10001 infinigen && \
    useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin infinigen

# ---- models: stories260K, its skew file made by the worker itself ----------
FROM cpu-base AS models-base
COPY models/stories260K/stories260K.bin models/stories260K/tok512.bin \
     models/stories260K/LICENSE /opt/infinigen/models/stories260K/
COPY tests/testdata/tiny_text.txt /tmp/calibration.txt

FROM models-base AS cpu-files
COPY --from=binaries /out/bin/infinigen /opt/infinigen/bin/infinigen
RUN /opt/infinigen/bin/infinigen skew \
        --model=/opt/infinigen/models/stories260K/stories260K.bin \
        --tokenizer=/opt/infinigen/models/stories260K/tok512.bin \
        --text=/tmp/calibration.txt --calibration_tokens=1024 \
        --out=/opt/infinigen/models/stories260K/stories260K.skew

# The CUDA image runs on Ubuntu: the Debian 12 builds of gRPC, protobuf,
# Abseil, OpenBLAS, ... that the binary was linked against travel in
# /opt/infinigen/lib (all it links but glibc, libstdc++, CUDA and ibverbs,
# which the runtime image provides).
FROM models-base AS cuda-files
COPY --from=cuda-binaries /out/bin/ /opt/infinigen/bin/
RUN /opt/infinigen/bin/infinigen skew \
        --model=/opt/infinigen/models/stories260K/stories260K.bin \
        --tokenizer=/opt/infinigen/models/stories260K/tok512.bin \
        --text=/tmp/calibration.txt --calibration_tokens=1024 \
        --out=/opt/infinigen/models/stories260K/stories260K.skew && \
    test -f /opt/infinigen/bin/libinfinigen_cuda.so && \
    mkdir -p /opt/infinigen/lib && \
    ldd /opt/infinigen/bin/infinigen /opt/infinigen/bin/libinfinigen_cuda.so | \
        awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u | \
        grep -vE '/(libc|libm|libmvec|libpthread|libdl|librt|ld-linux-x86-64|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libibverbs|libnl-3|libnl-route-3)\.so' | \
        xargs -r cp -L -t /opt/infinigen/lib/

# ---- cpu: the worker on Debian 12, CPU backend ------------------------------
FROM cpu-base AS cpu
LABEL org.opencontainers.image.title="infinigen-worker" \
      org.opencontainers.image.description="InfiniGen worker (CPU): infinigen serve (gRPC Worker.Generate, OpenAI API) with stories260K"
COPY --from=cpu-files /opt/infinigen/ /opt/infinigen/
USER 10001:10001
EXPOSE 8000 8080 9090
STOPSIGNAL SIGTERM
# Docker-only health check: the image carries no gRPC client, so this only
# checks that the gRPC port accepts connections (it opens after the model
# is loaded). Kubernetes uses native gRPC probes on 8080 instead.
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD bash -c '</dev/tcp/127.0.0.1/8080'
ENTRYPOINT ["/opt/infinigen/bin/infinigen"]
CMD ["serve", "--listen=0.0.0.0:8080", "--http_listen=0.0.0.0:8000", \
     "--model=/opt/infinigen/models/stories260K/stories260K.bin", \
     "--tokenizer=/opt/infinigen/models/stories260K/tok512.bin"]

# ---- cuda: NVIDIA's CUDA runtime (cudart, cuBLAS) and the copied libs ------
FROM ${CUDA_RUNTIME_IMAGE} AS cuda
LABEL org.opencontainers.image.title="infinigen-worker" \
      org.opencontainers.image.description="InfiniGen GPU worker: infinigen serve (gRPC Worker.Generate, OpenAI API) with stories260K"
# libibverbs and its providers come from this image's distribution: they
# load the NIC drivers (rdma://).
RUN apt-get update && \
    apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers && \
    rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 infinigen && \
    useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin infinigen
COPY --from=cuda-files /opt/infinigen/ /opt/infinigen/
# Last, so that no build step runs Ubuntu's tools on Debian's libraries;
# keeps the base image's /usr/local/nvidia paths (driver libraries).
ENV LD_LIBRARY_PATH=/opt/infinigen/lib:${LD_LIBRARY_PATH}
USER 10001:10001
EXPOSE 8000 8080 9090
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD bash -c '</dev/tcp/127.0.0.1/8080'
ENTRYPOINT ["/opt/infinigen/bin/infinigen"]
CMD ["serve", "--listen=0.0.0.0:8080", "--http_listen=0.0.0.0:8000", \
     "--model=/opt/infinigen/models/stories260K/stories260K.bin", \
     "--tokenizer=/opt/infinigen/models/stories260K/tok512.bin"]
