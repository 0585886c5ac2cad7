# syntax=docker/dockerfile:1
# The KV memory node (kv_memory_server) as an image.
#
#   scripts/build_images.sh                  # both images, host's bazel build
#   docker build -f docker/kv_memory_server.Dockerfile -t kv-memory-server .
#   docker run --rm -p 7070:7070 -p 7071:7071 kv-memory-server
#
# Ports: 7070 gRPC (KvMemory, grpc.health.v1), 7071 the plain-socket fetch
# endpoint that tcp:// clients use (--fetch_port). The shm and RDMA data
# planes are off unless --shm_listen / --rdma_device are given (k8s/ does).
#
# Binaries: by default the `build` stage compiles kv_memory_server with
# Bazel inside the build (Debian 12, as on the dev machines; slow on a small
# machine). `--build-arg BINARIES=prebuilt` takes it from
# docker/prebuilt/bin/ in the build context instead: a binary built on a
# Debian 12 host (the same libraries), which scripts/build_images.sh puts
# there from the host's `bazel build`.
#
# The binary is built with .bazelrc's -march=x86-64-v3: it needs a CPU with
# AVX2 (Haswell or newer).

ARG BINARIES=build

# ---- build: Debian's Bazel and system libraries, as on the dev machines ----
FROM debian:bookworm AS build
WORKDIR /src
COPY scripts/install_deps.sh scripts/install_deps.sh
RUN ./scripts/install_deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
# The Bazel output tree lives in a cache mount, so the binary is copied out
# in the same step.
RUN --mount=type=cache,target=/root/.cache/bazel \
    bazel build --jobs="$(nproc)" //kv_memory_service:kv_memory_server && \
    install -D -m 0755 bazel-bin/kv_memory_service/kv_memory_server \
        /out/bin/kv_memory_server

# ---- prebuilt: the binary from the build context (docker/prebuilt/) --------
FROM debian:bookworm-slim AS prebuilt
COPY docker/prebuilt/bin/kv_memory_server /out/bin/kv_memory_server

FROM ${BINARIES} AS binaries

# ---- runtime: the shared libraries the binary links, nothing else ----------
FROM debian:bookworm-slim AS runtime
LABEL org.opencontainers.image.title="kv-memory-server" \
      org.opencontainers.image.description="InfiniGen KV memory node: holds the KV cache and answers index-based fetches"
# What `ldd kv_memory_server` lists, by Debian package (gRPC pulls
# libgrpc29, re2, c-ares; httplib and prometheus-cpp serve /metrics);
# libibverbs1 and its providers serve --rdma_device.
RUN apt-get update && \
    apt-get install -y --no-install-recommends \
        libgrpc++1.51 libprotobuf32 libabsl20220623 libatomic1 libssl3 \
        libcpp-httplib0.11 libprometheus-cpp-core1.0 libxxhash0 \
        libibverbs1 ibverbs-providers && \
    rm -rf /var/lib/apt/lists/*
# A fixed uid/gid (shared with the worker image) so that k8s/ can set
# runAsUser and share the shm socket directory between the two containers.
RUN groupadd --system --gid 10001 infinigen && \
    useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin infinigen
COPY --from=binaries /out/bin/kv_memory_server /opt/infinigen/bin/kv_memory_server
USER 10001:10001
EXPOSE 7070 7071 9091
STOPSIGNAL SIGTERM
# Docker-only health check. The binary has no health subcommand and the
# image carries no gRPC client, so this checks what it can: the server wrote
# --ready_file (it is listening) and the gRPC port accepts connections. It
# does not see a hung server. Kubernetes uses native gRPC probes on 7070
# (grpc.health.v1) instead; k8s/ sets command and args, so this CMD and
# its ready file do not apply there.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD test -s /tmp/kv_memory_server.ready && bash -c '</dev/tcp/127.0.0.1/7070'
ENTRYPOINT ["/opt/infinigen/bin/kv_memory_server"]
CMD ["--listen=0.0.0.0:7070", "--fetch_port=7071", \
     "--ready_file=/tmp/kv_memory_server.ready"]
