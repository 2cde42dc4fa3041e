#!/usr/bin/env bash
# Runs the whole GPU check and writes logs and JSON into an output folder:
#   1. every test executable (*_test) in BUILD_DIR,
#   2. compute-sanitizer --tool memcheck and --tool racecheck over the GPU
#      test executables (gpu_*_test),
#   3. every benchmark executable (*_bench) with --benchmark_out=OUT/NAME.json,
# then prints a summary: passed/failed/skipped per test binary, sanitizer
# error counts, and per benchmark case the median time, GB/s and % of copy.
#
# Usage: scripts/gpu_check.sh [BUILD_DIR] [OUT_DIR]
#   BUILD_DIR  folder with the executables (default build-gpu; .carry/bin
#              after scripts/package_for_gpu.sh)
#   OUT_DIR    default $OUT, else ./gpu-out
# Environment: SANITIZER_TIMEOUT (seconds per sanitizer run, default 900),
#   SKIP_SANITIZER=1, SKIP_BENCH=1, SKIP_TESTS=1, SKIP_EXAMPLES=1, SKIP_SM80=1;
#   SM80_DIR (default: BUILD_DIR/../sm80, i.e. .carry/sm80).
# Exit status: 0 when every test passed and the sanitizers found nothing.
set -u -o pipefail

BUILD_DIR=${1:-build-gpu}
OUT_DIR=${2:-${OUT:-./gpu-out}}
SANITIZER_TIMEOUT=${SANITIZER_TIMEOUT:-900}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

if [ -d ./.carry/lib ]; then
  export LD_LIBRARY_PATH="$(cd ./.carry/lib && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# The real-model K/V/Q the attention tests read (packed by package_for_gpu.sh).
if [ -z "${FP4KV_REALKV_DIR:-}" ] && [ -d ./.carry/data/realkv ]; then
  export FP4KV_REALKV_DIR="$(cd ./.carry/data/realkv && pwd)"
fi
# NCCL (the transfer module dlopens libnccl.so.2): the machine's own copy,
# from the nvidia-nccl wheel or the CUDA toolkit; NVLink multicast off.
source "$(dirname "$0")/nccl_env.sh"
if [ ! -d "$BUILD_DIR" ]; then
  echo "gpu_check: no build folder $BUILD_DIR" >&2
  exit 2
fi

executables() {  # $1: name pattern
  find "$BUILD_DIR" -maxdepth 1 -type f -name "$1" -perm -u+x | sort
}

status=0
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true

# ----------------------------------------------------------------- tests
note "== tests"
printf '%-28s %7s %7s %7s %5s %8s\n' binary passed failed skipped rc seconds | tee -a "$SUMMARY"
for exe in $( [ "${SKIP_TESTS:-0}" = 1 ] || executables '*_test'); do
  name=$(basename "$exe")
  start=$(date +%s)
  "$exe" --gtest_output="json:$OUT_DIR/$name.gtest.json" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  passed=$(grep -c '^\[       OK \]' "$OUT_DIR/$name.log")
  failed=$(grep -c '^\[  FAILED  \] .*(' "$OUT_DIR/$name.log")
  skipped=$(grep -c '^\[  SKIPPED \] .*(' "$OUT_DIR/$name.log")
  printf '%-28s %7s %7s %7s %5s %8s\n' "$name" "$passed" "$failed" "$skipped" "$rc" "$secs" \
    | tee -a "$SUMMARY"
  [ "$rc" -ne 0 ] && status=1
done

# ------------------------------------------- sm_80 code through PTX JIT
# package_for_gpu.sh builds the GPU tests a second time with compute_80 PTX
# only; the driver compiles those kernels for this GPU, so the sm_80 paths
# (__CUDA_ARCH__ == 800) run here. SKIP_SM80=1 skips them.
SM80_DIR=${SM80_DIR:-$(dirname "$BUILD_DIR")/sm80}
if [ "${SKIP_TESTS:-0}" != 1 ] && [ "${SKIP_SM80:-0}" != 1 ] && [ -d "$SM80_DIR/bin" ]; then
  note "== tests, sm_80 code (compute_80 PTX, JIT-compiled by the driver)"
  if command -v cuobjdump > /dev/null || [ -x /usr/local/cuda/bin/cuobjdump ]; then
    objdump=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
    lib=$(ls "$SM80_DIR"/lib/libfp4kv.so* | head -1)
    note "libfp4kv (sm80): $("$objdump" --list-ptx "$lib" 2>/dev/null | grep -c 'sm_80') PTX files for sm_80, $("$objdump" --list-elf "$lib" 2>/dev/null | grep -c 'cubin') cubins"
  fi
  printf '%-28s %7s %7s %7s %5s %8s\n' binary passed failed skipped rc seconds | tee -a "$SUMMARY"
  for exe in $(find "$SM80_DIR/bin" -maxdepth 1 -type f -perm -u+x -name '*_test' | sort); do
    name=$(basename "$exe")
    start=$(date +%s)
    LD_LIBRARY_PATH="$(cd "$SM80_DIR/lib" && pwd):${LD_LIBRARY_PATH:-}" \
      "$exe" --gtest_output="json:$OUT_DIR/sm80_$name.gtest.json" > "$OUT_DIR/sm80_$name.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    passed=$(grep -c '^\[       OK \]' "$OUT_DIR/sm80_$name.log")
    failed=$(grep -c '^\[  FAILED  \] .*(' "$OUT_DIR/sm80_$name.log")
    skipped=$(grep -c '^\[  SKIPPED \] .*(' "$OUT_DIR/sm80_$name.log")
    printf '%-28s %7s %7s %7s %5s %8s\n' "sm80/$name" "$passed" "$failed" "$skipped" "$rc" "$secs" \
      | tee -a "$SUMMARY"
    [ "$rc" -ne 0 ] && status=1
  done
fi

# ------------------------------------------------------------ sanitizers
SANITIZER=$(command -v compute-sanitizer || true)
[ -z "$SANITIZER" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && \
  SANITIZER=/usr/local/cuda/bin/compute-sanitizer
if [ "${SKIP_SANITIZER:-0}" = 1 ]; then
  note "== sanitizers skipped (SKIP_SANITIZER=1)"
elif [ -z "$SANITIZER" ]; then
  note "== sanitizers: compute-sanitizer not found"
  status=1
else
  note "== compute-sanitizer"
  printf '%-28s %-10s %8s %5s %8s\n' binary tool errors rc seconds | tee -a "$SUMMARY"
  # GPU test binaries in full; the KV cache suites only for their GPU cases.
  for exe in $(executables 'gpu_*_test') $(executables 'kv_cache*_test'); do
    name=$(basename "$exe")
    filter="*"
    case "$name" in gpu_*) ;; *) filter="*Gpu*" ;; esac
    # libnccl returns CUDA API errors internally while it probes (in
    # ncclCommInitRank); for the transfer binaries only memory errors count.
    api=()
    case "$name" in *transfer*) api=(--report-api-errors no) ;; esac
    for tool in memcheck racecheck; do
      log="$OUT_DIR/$name.$tool.log"
      start=$(date +%s)
      FP4KV_PATTERN_STEP=4099 timeout "$SANITIZER_TIMEOUT" "$SANITIZER" --tool "$tool" "${api[@]}" \
        --error-exitcode 99 "$exe" --gtest_filter="$filter" > "$log" 2>&1
      rc=$?
      secs=$(( $(date +%s) - start ))
      errors=$(grep -oE "(ERROR SUMMARY: [0-9]+|RACECHECK SUMMARY: [0-9]+ hazards displayed \([0-9]+)" "$log" | tail -1 | grep -oE "[0-9]+$" || true)
      [ -z "$errors" ] && errors="?"
      printf '%-28s %-10s %8s %5s %8s\n' "$name" "$tool" "$errors" "$rc" "$secs" | tee -a "$SUMMARY"
      if [ "$rc" -ne 0 ] || [ "$errors" != 0 ]; then status=1; fi
    done
  done
fi

# ------------------------------------------------------------ benchmarks
if [ "${SKIP_BENCH:-0}" = 1 ]; then
  note "== benchmarks skipped (SKIP_BENCH=1)"
else
  note "== benchmarks"
  for exe in $(executables '*_bench'); do
    name=$(basename "$exe")
    "$exe" --benchmark_out="$OUT_DIR/$name.json" --benchmark_out_format=json 2>&1 \
      | tee "$OUT_DIR/$name.log"
    if command -v python3 > /dev/null; then
      python3 - "$OUT_DIR/$name.json" <<'PY' | tee -a "$SUMMARY"
import json, sys
data = json.load(open(sys.argv[1]))
print(f"{'case':<72} {'median_us':>10} {'GBps':>8} {'pct_copy':>8}")
for b in data.get("benchmarks", []):
    name = b.get("name", "?").replace("/iterations:1", "").replace("/manual_time", "")
    if b.get("error_occurred"):
        print(f"{name:<72} error: {b.get('error_message', '')}")
        continue
    if "median_us" in b:
        print(f"{name:<72} {b['median_us']:>10.2f} {b.get('GBps', 0):>8.1f} "
              f"{b.get('pct_of_copy', 0):>8.1f}"
              + (f"   eager {b['eager_us']:.2f} us" if "eager_us" in b else ""))
    else:  # plain timing (host cost): real and cpu time per call
        unit = b.get("time_unit", "ns")
        print(f"{name:<72} real {b.get('real_time', 0):.3f} {unit}, cpu {b.get('cpu_time', 0):.3f} {unit}")
PY
    else
      note "(python3 not found: see $OUT_DIR/$name.json)"
    fi
  done
fi

# -------------------------------------------------------------- examples
if [ "${SKIP_EXAMPLES:-0}" != 1 ] && [ -x "$BUILD_DIR/serving_loop" ]; then
  note "== serving_loop"
  "$BUILD_DIR/serving_loop" > "$OUT_DIR/serving_loop.log" 2>&1
  rc=$?
  tail -n 12 "$OUT_DIR/serving_loop.log" | tee -a "$SUMMARY"
  [ "$rc" -ne 0 ] && { note "serving_loop: exit $rc"; status=1; }
fi

note "== overall: $([ $status -eq 0 ] && echo OK || echo FAILED) (logs in $OUT_DIR)"
exit $status
