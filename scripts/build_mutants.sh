#!/usr/bin/env bash
# Builds "mutant" copies of libfp4kv: each with one cross-stream wait (or the
# kernel load at KVCache::Create) taken out, so that a GPU run can show that
# the test written for it fails without it (a timing-only test would pass). For each mutant below:
#   1. the one source line is deleted from a copy of its file (the line must
#      occur exactly once),
#   2. libfp4kv is rebuilt in build-gpu (only that file recompiles),
#   3. the library is packed xz-compressed into .carry/mutants/NAME/, with a
#      file `tests` naming the test binary and gtest filter that must fail,
# and the original file is put back (also on error) and the library rebuilt.
# scripts/gpu_check.sh runs each mutant's tests against its library and
# reports "caught" (the tests failed) or "MISSED".
#
# Usage: scripts/build_mutants.sh        (after scripts/package_for_gpu.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build-gpu
[ -f "$BUILD/CMakeCache.txt" ] || { echo "build_mutants: run scripts/package_for_gpu.sh first" >&2; exit 2; }

# name | file | exact line to delete | test binary | gtest filter
MUTANTS=(
  "reencode_no_copy_wait|src/kv_cache/scales.cc|    FP4KV_RETURN_IF_ERROR(s.OrderAfterCopies(stream));|kv_cache_swap_test|Gpu/SwapTest.ReencodeAfterSwapInWaitsForItsCopy/*"
  "calibrate_no_copy_wait|src/kv_cache/scales.cc|  if (reencode) FP4KV_RETURN_IF_ERROR(s.OrderAfterCopies(stream));|kv_cache_swap_test|Gpu/SwapTest.CalibrateAfterSwapInWaitsForItsCopy/*"
  "cache_kernels_not_loaded|src/kv_cache/create.cc|  if (s->cuda) FP4KV_RETURN_IF_ERROR(internal::LoadCacheKernels(o.recipe));|kv_cache_lazy_load_test|KVCacheLazyLoadTest.*"
)

backup=$(mktemp)
restore_file=""
restore() {
  if [ -n "$restore_file" ]; then
    cp "$backup" "$restore_file"
    restore_file=""
  fi
}
trap restore EXIT

rm -rf .carry/mutants
mkdir -p .carry/mutants
for m in "${MUTANTS[@]}"; do
  IFS='|' read -r name file line exe filter <<< "$m"
  count=$(grep -cxF -- "$line" "$file" || true)
  if [ "$count" != 1 ]; then
    echo "build_mutants: $name: the line occurs $count times in $file (expected once): $line" >&2
    exit 1
  fi
  cp "$file" "$backup"
  restore_file=$file
  grep -vxF -- "$line" "$backup" > "$file"
  cmake --build "$BUILD" -j"${JOBS:-2}" --target fp4kv > /dev/null
  mkdir -p ".carry/mutants/$name"
  # Under the name the test binary loads it by (its soname).
  soname=$(ldd "$BUILD/$exe" | awk '$1 ~ /^libfp4kv/ {print $1}')
  cp -L "$BUILD/libfp4kv.so" ".carry/mutants/$name/${soname:-libfp4kv.so}"
  for f in ".carry/mutants/$name"/libfp4kv*; do
    chmod u+w "$f"
    strip --strip-unneeded "$f" || true
    xz -T"${JOBS:-2}" -6 "$f"
  done
  printf '%s %s\n' "$exe" "$filter" > ".carry/mutants/$name/tests"
  printf 'deleted from %s: %s\n' "$file" "$line" > ".carry/mutants/$name/what"
  restore
done
cmake --build "$BUILD" -j"${JOBS:-2}" --target fp4kv > /dev/null
du -sh .carry/mutants
