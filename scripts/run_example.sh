#!/usr/bin/env bash
# Builds fp4kv and runs an example (default: serving_loop). Extra arguments go to the example.
#   bash scripts/run_example.sh [name] [args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
source scripts/env.sh
name=${1:-serving_loop}
shift || true
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DFP4KV_BUILD_TESTS=ON -DFP4KV_BUILD_BENCHMARKS=ON -DFP4KV_BUILD_EXAMPLES=ON >/dev/null
cmake --build build -j"$(nproc)" --target "$name"
./build/"$name" "$@"
