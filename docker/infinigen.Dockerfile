# syntax=docker/dockerfile:1
# The GPU worker (`infinigen serve`) as an image, with the stories260K model.
#
#   docker build -f docker/infinigen.Dockerfile -t infinigen-worker .
#   docker run --rm --gpus all -p 8080:8080 infinigen-worker
#
# Port 8080: gRPC Worker.Generate (proto/worker.proto) and grpc.health.v1.
# With no --kv_service the KV cache stays in the process; k8s/ points
# --kv_service at a kv_memory_server (shm:, tcp:// or rdma://).
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

# ---- build: Debian's Bazel and libraries plus NVIDIA's nvcc ------------------
FROM debian:bookworm AS build
WORKDIR /src
COPY scripts/install_deps.sh scripts/install_deps.sh
RUN ./scripts/install_deps.sh && rm -rf /var/lib/apt/lists/*
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
# The Bazel output tree lives in a cache mount, so everything the runtime
# stage needs is copied to /out in the same step: the binary with its CUDA
# backend plugin beside it (loaded when --backend picks CUDA), the shared
# libraries they link (except glibc, libstdc++, CUDA and ibverbs, which the
# runtime image provides), and the model with its skew file.
RUN --mount=type=cache,target=/root/.cache/bazel \
    bazel build --jobs="$(nproc)" //gpu_worker:infinigen && \
    install -D -m 0755 bazel-bin/gpu_worker/infinigen /out/bin/infinigen && \
    install -m 0755 bazel-bin/gpu_worker/backend/cuda/libinfinigen_cuda.so \
        /out/bin/libinfinigen_cuda.so && \
    mkdir -p /out/lib /out/models/stories260K && \
    ldd /out/bin/infinigen /out/bin/libinfinigen_cuda.so | \
        awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u | \
        grep -vE '/(libc|libm|libmvec|libpthread|libdl|librt|ld-linux-x86-64|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libibverbs|libnl-3|libnl-route-3)\.so' | \
        xargs -r cp -L -t /out/lib/ && \
    cp models/stories260K/stories260K.bin models/stories260K/tok512.bin \
        models/stories260K/LICENSE /out/models/stories260K/ && \
    /out/bin/infinigen skew --model=/out/models/stories260K/stories260K.bin \
        --tokenizer=/out/models/stories260K/tok512.bin \
        --text=tests/testdata/tiny_text.txt --calibration_tokens=1024 \
        --out=/out/models/stories260K/stories260K.skew

# ---- runtime: NVIDIA's CUDA runtime (cudart, cuBLAS) and the copied libs ----
FROM ${CUDA_RUNTIME_IMAGE}
LABEL org.opencontainers.image.title="infinigen-worker" \
      org.opencontainers.image.description="InfiniGen GPU worker: infinigen serve (gRPC Worker.Generate) with stories260K"
# The gRPC, protobuf, Abseil and OpenBLAS builds the binary was linked
# against (Debian 12's) travel in /opt/infinigen/lib rather than mixing in
# Ubuntu's builds of the same versions. libibverbs and its providers come
# from this image's distribution: they load the NIC drivers (rdma://).
RUN apt-get update && \
    apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers && \
    rm -rf /var/lib/apt/lists/*
# The same fixed uid/gid as the kv-memory-server image (k8s/ runAsUser).
RUN groupadd --system --gid 10001 infinigen && \
    useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin infinigen
COPY --from=build /out/lib/ /opt/infinigen/lib/
COPY --from=build /out/bin/infinigen /opt/infinigen/bin/infinigen
COPY --from=build /out/models/ /opt/infinigen/models/
# Last, so that no build step runs Ubuntu's tools on Debian's libraries;
# keeps the base image's /usr/local/nvidia paths (driver libraries).
ENV LD_LIBRARY_PATH=/opt/infinigen/lib:${LD_LIBRARY_PATH}
USER 10001:10001
EXPOSE 8000 8080 9090
STOPSIGNAL SIGTERM
# Docker-only health check: the worker has no health subcommand or ready
# file and the image carries no gRPC client, so this only checks that the
# gRPC port accepts connections (it opens after the model is loaded).
# Kubernetes uses native gRPC probes on 8080 (grpc.health.v1) instead.
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD bash -c '</dev/tcp/127.0.0.1/8080'
ENTRYPOINT ["/opt/infinigen/bin/infinigen"]
CMD ["serve", "--listen=0.0.0.0:8080", \
     "--model=/opt/infinigen/models/stories260K/stories260K.bin", \
     "--tokenizer=/opt/infinigen/models/stories260K/tok512.bin"]
