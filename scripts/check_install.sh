#!/usr/bin/env bash
# Installs fp4kv into a temporary prefix and builds a small consumer project
# against it with find_package(fp4kv), then runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
prefix=$(mktemp -d)
trap 'rm -rf "$prefix" build-consumer' EXIT
cmake -S . -B build-install -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DFP4KV_BUILD_TESTS=OFF -DFP4KV_BUILD_BENCHMARKS=OFF -DFP4KV_BUILD_EXAMPLES=OFF >/dev/null
cmake --build build-install -j"$(nproc)"
cmake --install build-install --prefix "$prefix" >/dev/null
cmake -S tests/consumer -B build-consumer -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build-consumer -j"$(nproc)"
./build-consumer/consumer
