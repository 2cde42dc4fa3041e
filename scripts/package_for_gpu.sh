#!/usr/bin/env bash
# Builds the project for sm_90 (Release) into build-gpu and packs what a bare
# CUDA machine needs to run the tests and benchmarks into .carry/ (ignored by
# git): .carry/bin holds the stripped executables that use a GPU (gpu_*_test,
# the KV cache tests, the benchmarks, the serving loop; the CPU-only tests run
# in CI and would push the folder past what a device call carries),
# .carry/lib every shared library they load from the build folder (fp4kv is
# built shared here, so its kernels are carried once), the CUDA toolkit
# (the shared CUDA runtime) or the system's x86_64-linux-gnu folder, except
# the C library itself (libc, libm, libpthread, libdl, librt, ld-linux):
# libfp4kv, libcudart, Abseil, Google Benchmark, libstdc++, libgcc_s.
# The real-model K/V of tests/data/realkv travel with the working tree
# (scripts/gpu_check.sh points FP4KV_REALKV_DIR at them). scripts/gpu_check.sh
# puts .carry/lib on LD_LIBRARY_PATH.
#
# libnccl is never packed (200+ MB; the transfer module loads it with dlopen):
# scripts/gpu_check.sh finds the GPU machine's own copy (the nvidia-nccl
# wheel) and puts it on LD_LIBRARY_PATH.
#
# .carry/BUILD_INFO records the commit (and whether the tree had changes), the
# compiler and the build type for the run header; .carry/mutants holds the
# libraries of scripts/build_mutants.sh (MUTANTS=0 skips them).
#
# Usage: scripts/package_for_gpu.sh        (JOBS=n to change -j, default 2)
#        TARGETS="gpu_transfer_test transfer_bench" scripts/package_for_gpu.sh
#          builds and packs only those executables
# Then on the GPU machine: scripts/gpu_check.sh .carry/bin
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=build-gpu
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DFP4KV_BUILD_TESTS=ON -DFP4KV_BUILD_BENCHMARKS=ON -DFP4KV_BUILD_EXAMPLES=ON -DBUILD_SHARED_LIBS=ON \
  "${launcher[@]}"
if [ -n "${TARGETS:-}" ]; then
  # shellcheck disable=SC2086
  cmake --build "$BUILD" -j"${JOBS:-2}" --target $TARGETS
else
  cmake --build "$BUILD" -j"${JOBS:-2}"
fi

rm -rf .carry
mkdir -p .carry/bin .carry/lib
# What was built, for the run header (scripts/gpu_check.sh writes run.json).
python3 - "$BUILD" > .carry/BUILD_INFO <<'PY'
import datetime, json, re, subprocess, sys
build = sys.argv[1]
def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return ""
cache = {}
for line in open(f"{build}/CMakeCache.txt"):
    m = re.match(r"(CMAKE_BUILD_TYPE|CMAKE_CUDA_ARCHITECTURES|BUILD_SHARED_LIBS|CMAKE_CUDA_COMPILER_VERSION)[^=]*=(.*)", line)
    if m:
        cache[m.group(1)] = m.group(2).strip()
nvcc = re.search(r"release ([0-9.]+)", sh("nvcc", "--version") or sh("/usr/local/cuda/bin/nvcc", "--version"))
print(json.dumps({
    "commit": sh("git", "rev-parse", "--short=7", "HEAD") or "unknown",
    "dirty": bool(sh("git", "status", "--porcelain", "--untracked-files=no")),
    "built_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "nvcc": nvcc.group(1) if nvcc else "",
    "build_type": cache.get("CMAKE_BUILD_TYPE", ""),
    "cuda_architectures": cache.get("CMAKE_CUDA_ARCHITECTURES", ""),
    "shared": cache.get("BUILD_SHARED_LIBS", ""),
}, indent=2))
PY
if [ -n "${TARGETS:-}" ]; then
  exes=()
  for t in $TARGETS; do exes+=("$BUILD/$t"); done
else
  mapfile -t exes < <(find "$BUILD" -maxdepth 1 -type f -perm -u+x \( -name 'gpu_*_test' -o -name 'kv_cache*_test' -o -name '*_bench' -o -name serving_loop -o -name disagg_prefill_decode \) | sort)
fi
for exe in "${exes[@]}"; do
  cp "$exe" .carry/bin/
  strip --strip-unneeded ".carry/bin/$(basename "$exe")"
done

declare -A seen=()
for exe in "${exes[@]}"; do
  while read -r lib path; do
    case "$lib" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libnccl*) continue ;;
    esac
    [ -n "${seen[$lib]:-}" ] && continue
    seen[$lib]=1
    cp -L "$path" ".carry/lib/$lib"
    chmod u+w ".carry/lib/$lib"
    strip --strip-unneeded ".carry/lib/$lib" || true
  done < <(ldd "$exe" | awk -v build="$(cd "$BUILD" && pwd)/" '$2 == "=>" &&
      ($3 ~ /^(\/usr)?\/lib\/x86_64-linux-gnu\// || $3 ~ /^\/usr\/local\/cuda/ ||
       index($3, build) == 1) {print $1, $3}')
done

# The sm_80 code path on a Hopper GPU: the GPU test executables built again
# with compute_80 PTX only (no SASS), so the driver JIT-compiles the sm_80
# kernels (__CUDA_ARCH__ == 800) for the GPU at hand. They go to
# .carry/sm80/bin with their own libfp4kv in .carry/sm80/lib; gpu_check.sh
# runs them. SM80=0 skips this build.
if [ "${SM80:-1}" = 1 ] && [ -z "${TARGETS:-}" ]; then
  B80=build-sm80
  cmake -S . -B "$B80" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=80-virtual \
    -DFP4KV_BUILD_TESTS=ON -DFP4KV_BUILD_BENCHMARKS=OFF -DFP4KV_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=ON "${launcher[@]}" >/dev/null
  mapfile -t t80 < <(cd tests && ls gpu_*_test.cu | sed 's/\.cu$//' | grep -v transfer)
  cmake --build "$B80" -j"${JOBS:-2}" --target "${t80[@]}"
  mkdir -p .carry/sm80/bin .carry/sm80/lib
  for t in "${t80[@]}"; do
    cp "$B80/$t" .carry/sm80/bin/
    strip --strip-unneeded ".carry/sm80/bin/$t"
  done
  cp -L "$B80/libfp4kv.so" .carry/sm80/lib/libfp4kv.so
  lib=$(ldd "$B80/${t80[0]}" | awk '$1 ~ /^libfp4kv/ {print $1}')
  [ -n "$lib" ] && [ "$lib" != libfp4kv.so ] && mv .carry/sm80/lib/libfp4kv.so ".carry/sm80/lib/$lib"
  chmod u+w .carry/sm80/lib/*
  strip --strip-unneeded .carry/sm80/lib/* || true
fi

# Libraries with one wait taken out each (scripts/build_mutants.sh); gpu_check.sh
# shows that the tests for those waits fail against them. MUTANTS=0 skips them.
if [ "${MUTANTS:-1}" = 1 ] && [ -z "${TARGETS:-}" ]; then
  bash scripts/build_mutants.sh
fi

du -sh .carry .carry/bin .carry/lib .carry/sm80 .carry/mutants 2>/dev/null || true
size_kb=$(du -sk .carry | cut -f1)
if [ "$size_kb" -gt $((60 * 1024)) ]; then
  echo "package_for_gpu: warning: .carry is ${size_kb} KiB (> 60 MiB)" >&2
fi
ls .carry/bin
