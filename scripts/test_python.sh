#!/usr/bin/env bash
# Builds and installs the Python package fp4kv into the environment of
# ${PYTHON:-python3} (pip install . with the library that a build folder
# already compiled, so no CUDA code is compiled again), then runs its pytest
# suite on the CPU device (python/tests).
#   bash scripts/test_python.sh [BUILD_DIR]   # default: build (scripts/test.sh builds it)
# A missing or unconfigured BUILD_DIR is built library-only for sm_90.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh --python
source scripts/env.sh
python=${PYTHON:-python3}
build=${1:-build}
jobs=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DFP4KV_LIBRARY_ONLY=ON >/dev/null
fi
cmake --build "$build" -j"$jobs" --target fp4kv
# The library, headers and CMake package of that build, for find_package(fp4kv).
prefix="$PWD/$build/python-prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null
CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$python" -m pip install -q --disable-pip-version-check --root-user-action=ignore \
  --no-build-isolation -Cbuild-dir="$build/python" -Ccmake.define.fp4kv_ROOT="$prefix" .
# python/fp4kv is not on sys.path from the repository root: the installed package is tested.
"$python" -m pytest -q -p no:cacheprovider python/tests
