#!/usr/bin/env bash
# Builds fp4kv and runs the whole test suite (GPU tests skip without a GPU).
#   bash scripts/test.sh              # Release build in build/; then installs the Python
#                                     # package fp4kv built on it and runs its tests
#                                     # (scripts/test_python.sh); then checks every number
#                                     # of README.md and bench/RESULTS.md against its saved
#                                     # run (scripts/check_results.py check)
#   bash scripts/test.sh --sanitize   # ASan + UBSan build of the C++ tests in build-asan/
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
source scripts/env.sh
jobs=$(nproc)
if [ "${1:-}" = "--sanitize" ]; then
  # Host code under the sanitizers; one CUDA architecture is enough here.
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFP4KV_SANITIZE=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DFP4KV_BUILD_BENCHMARKS=OFF -DFP4KV_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build build-asan -j"$jobs"
  # protect_shadow_gap=0 lets the CUDA runtime map memory under ASan;
  # allocator_may_return_null=1 lets an impossible allocation fail as it does
  # without ASan (KVCache::Create then returns ResourceExhausted).
  rm -rf build-asan/gtest-json
  ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 \
    GTEST_OUTPUT="json:$PWD/build-asan/gtest-json/" ctest --test-dir build-asan --output-on-failure -j"$jobs"
  python3 scripts/test_summary.py build-asan/gtest-json
else
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DFP4KV_BUILD_TESTS=ON -DFP4KV_BUILD_BENCHMARKS=ON -DFP4KV_BUILD_EXAMPLES=ON >/dev/null
  cmake --build build -j"$jobs"
  rm -rf build/gtest-json
  GTEST_OUTPUT="json:$PWD/build/gtest-json/" ctest --test-dir build --output-on-failure -j"$jobs"
  # Cases per binary, skipped ones counted (GPU cases skip without a GPU).
  python3 scripts/test_summary.py build/gtest-json
  bash scripts/test_python.sh build
  # The docs' numbers and pictures against the saved runs (bench/runs); the pictures of
  # the newest run drawn again (into build/, installing matplotlib), and the scripts' tests.
  python3 scripts/check_results.py check README.md bench/RESULTS.md
  bash scripts/plot_results.sh --out build/plots
  python3 -m pytest -q -p no:cacheprovider scripts/tests
fi
