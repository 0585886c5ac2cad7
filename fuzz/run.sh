#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan + libFuzzer) and runs
# each for SECONDS (default 10) on its seed corpus, then prints one line per
# target with its executions.
#
#   fuzz/run.sh [SECONDS] [TARGET ...]     # default: every target
#
# Targets, one per parser of untrusted bytes:
#   fetch_socket_fuzzer        the TCP fetch plane (a live FetchSocketServer)
#   shm_protocol_fuzzer        shm data-plane setup packets
#   gguf_fuzzer                GGUF files, and the BPE tokenizer they carry
#   llama2c_tokenizer_fuzzer   llama2.c tokenizer.bin files
#   safetensors_fuzzer         .safetensors files and Hugging Face config.json
#   rdma_wire_fuzzer           RDMA fetch request/response packets, the
#                              queue-pair endpoint message, rdma:// addresses
#   kv_service_fuzzer          the memory node's gRPC handlers and the proto
#                              conversions under them
#   skew_file_fuzzer           skew files with their head profile, and the
#                              head budgets allocated from it
# Seeds live in fuzz/corpus/TARGET (small, in git); what a run discovers goes
# to fuzz/out/corpus/TARGET, crashes to fuzz/out/crashes/ (copy a fixed
# crash into fuzz/corpus/TARGET to keep it as a regression input: every run
# replays the seeds first). Builds outside Bazel: clang's libFuzzer runtime
# is not in Bazel's default toolchain. Exit status 1 when a target crashed.
set -uo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-10}"
shift || true
all=(fetch_socket_fuzzer shm_protocol_fuzzer gguf_fuzzer
     llama2c_tokenizer_fuzzer safetensors_fuzzer rdma_wire_fuzzer
     kv_service_fuzzer skew_file_fuzzer)
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=("${all[@]}")

CXX="${CXX:-clang++-14}"
if ! command -v "$CXX" >/dev/null; then
  echo "fuzz/run.sh: $CXX not found (scripts/install_deps.sh installs it)" >&2
  exit 2
fi

store_srcs=(kv_memory_service/store/kv_store.cc
            kv_memory_service/store/stored_sequence.cc
            kv_memory_service/store/stored_sequence_gather.cc
            kv_memory_service/store/stored_sequence_fetch_log.cc
            kv_memory_service/store/row_memory.cc
            kv_memory_service/store/pinned_rows.cc
            kv_memory_service/store/spare_rows.cc
            kv_memory_service/store/head_slots.cc
            kv_memory_service/client/kv_types.cc common/thread_pool.cc
            kv_memory_service/store/prefix_cache.cc
            kv_memory_service/client/prefix_keys.cc
            kv_memory_service/serving/credentials.cc)
model_srcs=(common/file.cc common/log.cc common/utf8.cc model/gguf.cc
            model/ggml_quants.cc model/gguf_llama.cc model/bpe_tokenizer.cc
            model/spm_tokenizer.cc model/tokenizer.cc model/config.cc
            model/weights.cc model/llama2c.cc model/safetensors.cc
            model/hf_config.cc model/safetensors_llama.cc)
sources_of() {
  case "$1" in
    fetch_socket_fuzzer)
      echo common/log.cc "${store_srcs[@]}" \
        kv_memory_service/serving/request_metrics.cc \
        kv_memory_service/tcp/fetch_wire.cc kv_memory_service/tcp/fetch_tls.cc \
        common/acceptor.cc kv_memory_service/tcp/fetch_socket_server.cc \
        kv_memory_service/tcp/fetch_socket_loop.cc \
        kv_memory_service/tcp/fetch_socket_protocol.cc ;;
    shm_protocol_fuzzer) echo kv_memory_service/shm/shm_protocol.cc ;;
    rdma_wire_fuzzer)
      echo common/log.cc common/address.cc "${store_srcs[@]}" \
        kv_memory_service/rdma/rdma_wire.cc \
        fuzz/out/gen/proto/kv_rdma.pb.cc ;;
    kv_service_fuzzer)
      echo common/log.cc "${store_srcs[@]}" kv_memory_service/control/proto_convert.cc \
        kv_memory_service/serving/request_metrics.cc \
        kv_memory_service/server/kv_service.cc \
        fuzz/out/gen/proto/kv_memory.pb.cc \
        fuzz/out/gen/proto/kv_memory.grpc.pb.cc ;;
    gguf_fuzzer | llama2c_tokenizer_fuzzer | safetensors_fuzzer)
      echo "${model_srcs[@]}" ;;
    skew_file_fuzzer)
      echo common/file.cc common/log.cc common/thread_pool.cc \
        $(ls speculator/*.cc | grep -v '_test\.cc$') ;;
    *) return 1 ;;
  esac
}

# System libraries beyond Abseil, as //third_party wraps them.
libs_of() {
  case "$1" in
    fetch_socket_fuzzer) echo -lxxhash -lprometheus-cpp-core -lssl -lcrypto ;;
    rdma_wire_fuzzer) echo -lxxhash -lprotobuf ;;
    skew_file_fuzzer)
      echo -llapacke -L/usr/lib/x86_64-linux-gnu/openblas-pthread -lopenblas ;;
    kv_service_fuzzer)
      echo -lxxhash -lprometheus-cpp-core -lgrpc++ -lgrpc -lgpr -lprotobuf ;;
  esac
}

# The system Abseil libraries, as //third_party:absl links them.
mapfile -t absl_libs < <(grep -o -- '-labsl_[a-z0-9_]*' third_party/BUILD.bazel |
                         sort -u)
flags=(-std=c++17 -O1 -g -I. -Ifuzz/out/gen -fno-omit-frame-pointer
       -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
       -Wno-deprecated-declarations)
out=fuzz/out
mkdir -p "$out/obj" "$out/bin" "$out/crashes"

# The protobuf and gRPC code of the wire messages, as //proto generates it.
generate_protos() {
  local p
  mkdir -p "$out/gen"
  for p in kv_memory kv_rdma; do
    if [ ! -e "$out/gen/proto/$p.grpc.pb.cc" ] ||
       [ "proto/$p.proto" -nt "$out/gen/proto/$p.grpc.pb.cc" ]; then
      protoc -I. --cpp_out="$out/gen" --grpc_out="$out/gen" \
        --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" \
        "proto/$p.proto" || return 1
    fi
  done
}

build() {  # target
  local target="$1" objs=() src obj
  generate_protos || return 1
  for src in $(sources_of "$target") "fuzz/$target.cc"; do
    obj="$out/obj/${src//\//_}.o"
    if [ ! -e "$obj" ] || [ "$src" -nt "$obj" ] ||
       [ -n "$(find "$(dirname "$src")" -maxdepth 1 -name '*.h' -newer "$obj")" ]; then
      "$CXX" "${flags[@]}" -c "$src" -o "$obj" || return 1
    fi
    objs+=("$obj")
  done
  "$CXX" "${flags[@]}" "${objs[@]}" -o "$out/bin/$target" \
    "${absl_libs[@]}" $(libs_of "$target") -lpthread -ldl
}

status=0
printf '%-26s %8s %12s %10s  %s\n' target seconds executions "exec/s" result
for t in "${targets[@]}"; do
  if ! sources_of "$t" >/dev/null; then
    echo "fuzz/run.sh: unknown target $t" >&2
    status=1
    continue
  fi
  if ! build "$t" >"$out/$t.build.log" 2>&1; then
    printf '%-26s %8s %12s %10s  %s\n' "$t" - - - "BUILD FAILED ($out/$t.build.log)"
    status=1
    continue
  fi
  mkdir -p "$out/corpus/$t"
  log="$out/$t.log"
  "$out/bin/$t" -max_total_time="$seconds" -print_final_stats=1 \
    -timeout=20 -rss_limit_mb=4096 -artifact_prefix="$out/crashes/$t-" \
    "$out/corpus/$t" "fuzz/corpus/$t" >"$log" 2>&1
  rc=$?
  execs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | awk '{print $2}')
  result="ok"
  if [ "$rc" -ne 0 ]; then
    result="CRASH (rc $rc, $log)"
    status=1
  fi
  rate=$(( ${execs:-0} / (seconds > 0 ? seconds : 1) ))
  printf '%-26s %8s %12s %10s  %s\n' "$t" "$seconds" "${execs:-?}" "$rate" "$result"
done
exit "$status"
