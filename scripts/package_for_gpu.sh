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
# .carry/data holds a copy of tests/data/realkv (point FP4KV_REALKV_DIR at
# it on the device machine). scripts/gpu_check.sh puts .carry/lib on
# LD_LIBRARY_PATH.
#
# libnccl is never packed (200+ MB; the transfer module loads it with dlopen):
# scripts/gpu_check.sh finds the GPU machine's own copy (the nvidia-nccl
# wheel) and puts it on LD_LIBRARY_PATH.
#
# Usage: scripts/package_for_gpu.sh        (JOBS=n to change -j, default 2)
#        TARGETS="gpu_transfer_test transfer_bench" scripts/package_for_gpu.sh
#          builds and packs only those executables
# Then on the GPU machine: scripts/gpu_check.sh .carry/bin
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=build-gpu
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DFP4KV_BUILD_TESTS=ON -DFP4KV_BUILD_BENCHMARKS=ON -DFP4KV_BUILD_EXAMPLES=ON -DBUILD_SHARED_LIBS=ON
if [ -n "${TARGETS:-}" ]; then
  # shellcheck disable=SC2086
  cmake --build "$BUILD" -j"${JOBS:-2}" --target $TARGETS
else
  cmake --build "$BUILD" -j"${JOBS:-2}"
fi

rm -rf .carry
mkdir -p .carry/bin .carry/lib
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
mkdir -p .carry/data
cp -r tests/data/realkv .carry/data/

du -sh .carry .carry/bin .carry/lib
size_kb=$(du -sk .carry | cut -f1)
if [ "$size_kb" -gt $((60 * 1024)) ]; then
  echo "package_for_gpu: warning: .carry is ${size_kb} KiB (> 60 MiB)" >&2
fi
ls .carry/bin
