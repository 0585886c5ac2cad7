#!/usr/bin/env bash
# CPU decode speed of stories260K and SmolLM2-135M against this machine's
# memcpy bandwidth, in one run. Writes bench/results/decode_cpu.{md,jsonl}.
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build //bench:decode_bench >&2
mkdir -p bench/results
md=bench/results/decode_cpu.md
jsonl=bench/results/decode_cpu.jsonl
: > "$jsonl"
{
  echo "# CPU decode speed"
  echo
  echo "Command: \`bench/run_decode_bench.sh\`  "
  echo "Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/{print $2}') GiB"
  echo
  echo "| model | threads | tokens/s | weight MB/token | memcpy GB/s (1 thread) | memcpy GB/s (all) | bound tokens/s | of bound |"
  echo "|---|---|---|---|---|---|---|---|"
  ./bazel-bin/bench/decode_bench --model=models/stories260K/stories260K.bin \
    --tokens=400 --threads=1 --out="$jsonl"
  smol=$(./scripts/fetch_smollm2.sh)
  ./bazel-bin/bench/decode_bench --model="$smol" --tokens=64 --out="$jsonl"
} | tee "$md"
