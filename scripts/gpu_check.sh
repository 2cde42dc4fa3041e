#!/usr/bin/env bash
# Runs the whole GPU check and writes logs and JSON into an output folder:
#   1. every test executable (*_test) in BUILD_DIR,
#   2. compute-sanitizer --tool memcheck and --tool racecheck over the GPU
#      test executables (gpu_*_test),
#   3. every benchmark executable (*_bench) with --benchmark_out=OUT/NAME.json,
# then prints a summary: passed/failed/skipped per test binary, sanitizer
# error counts, and per benchmark case the median time, % of copy and counters
# (scripts/check_results.py; also written to OUT/bench_tables.md).
#
# Usage: scripts/gpu_check.sh [BUILD_DIR] [OUT_DIR]
#   BUILD_DIR  folder with the executables (default build-gpu; .carry/bin
#              after scripts/package_for_gpu.sh)
#   OUT_DIR    default $OUT, else ./gpu-out
# Environment: SANITIZER_TIMEOUT (seconds per sanitizer run, default 900),
#   SKIP_SANITIZER=1, SKIP_BENCH=1, SKIP_TESTS=1, SKIP_EXAMPLES=1, SKIP_SM80=1;
#   BENCHES="a_bench b_bench" (only those), BENCH_ARGS (extra arguments for
#   every bench), BENCH_TIMEOUT (seconds per bench, default 300);
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
# The real-model K/V/Q the attention tests read (in the working tree).
if [ -z "${FP4KV_REALKV_DIR:-}" ] && [ -d ./tests/data/realkv ]; then
  export FP4KV_REALKV_DIR="$(cd ./tests/data/realkv && pwd)"
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
nvidia-smi -q -d CLOCK,PERFORMANCE,POWER > "$OUT_DIR/nvidia-smi-clocks.txt" 2>&1 || true

# ------------------------------------------------------------ run header
# run.json: what a reader needs to trust the numbers (commit and build from
# .carry/BUILD_INFO, written by package_for_gpu.sh; the GPU, driver, clocks
# as found, date) and the run's id, <date>-<gpu>-<commit>, the folder name
# it is saved under in bench/runs/ (scripts/save_run.sh).
BUILD_INFO=""
for f in "$BUILD_DIR/../BUILD_INFO" "$BUILD_DIR/BUILD_INFO"; do
  [ -f "$f" ] && BUILD_INFO=$f && break
done
python3 - "$OUT_DIR/run.json" "$BUILD_INFO" <<'PY' || echo "gpu_check: run.json not written" >&2
import datetime, json, re, subprocess, sys
out, info_path = sys.argv[1], sys.argv[2]
def smi(fields):
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=" + fields, "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        return [x.strip() for x in r.stdout.strip().split("\n")[0].split(",")]
    except Exception:
        return []
keys = ["name", "driver_version", "memory.total", "clocks.sm", "clocks.mem", "clocks.max.sm",
        "clocks.max.mem", "power.limit", "pcie.link.gen.current", "pcie.link.width.current",
        "temperature.gpu"]
vals = smi(",".join(keys))
gpu = dict(zip(keys, vals)) if len(vals) == len(keys) else {}
build = {}
if info_path:
    with open(info_path) as f:
        build = json.load(f)
try:
    cuda = re.search(r"CUDA Version: *([0-9.]+)", subprocess.run(["nvidia-smi"], capture_output=True,
                     text=True).stdout).group(1)
except Exception:
    cuda = ""
now = datetime.datetime.now(datetime.timezone.utc)
m = re.search(r"([HAB]\d{2,3}|GB\d{3}|L40S?)", gpu.get("name", ""))
short = m.group(1).lower() if m else "gpu"
commit = build.get("commit", "unknown")
run = {
    "id": f"{now:%Y-%m-%d}-{short}-{commit}" + ("-dirty" if build.get("dirty") else ""),
    "date_utc": now.isoformat(timespec="seconds"),
    "gpu": gpu, "driver_cuda_version": cuda, "build": build,
    "clocks_note": "as found: the run never changes clocks or power limits",
}
with open(out, "w") as f:
    json.dump(run, f, indent=2)
print("run", run["id"], "|", gpu.get("name", "?"), "| driver", gpu.get("driver_version", "?"),
      "| SM clock", gpu.get("clocks.sm", "?"), "of", gpu.get("clocks.max.sm", "?"), "MHz")
PY
[ -f "$OUT_DIR/run.json" ] && note "$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('run', r['id'])" "$OUT_DIR/run.json")"

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

# tests.json: passed / failed / skipped per binary (from the gtest JSON), so
# a published test count names its run like any other number.
python3 "$(dirname "$0")/test_summary.py" "$OUT_DIR" --suffix .gtest.json \
  --json "$OUT_DIR/tests.json" > /dev/null || true

# ------------------------------------------------------- mutant libraries
# scripts/build_mutants.sh packs libraries with one cross-stream wait taken
# out (.carry/mutants/NAME/: the library, xz-compressed, and `tests`: binary
# and gtest filter). Each named test must FAIL against its mutant: a test
# that passes without the wait it was written for checks nothing.
MUTANT_DIR=${MUTANT_DIR:-$(dirname "$BUILD_DIR")/mutants}
if [ "${SKIP_TESTS:-0}" != 1 ] && [ "${SKIP_MUTANTS:-0}" != 1 ] && [ -d "$MUTANT_DIR" ]; then
  note "== mutants (each test must fail against a library without its wait)"
  printf '%-28s %-28s %5s %s\n' mutant binary rc verdict | tee -a "$SUMMARY"
  for dir in "$MUTANT_DIR"/*/; do
    name=$(basename "$dir")
    read -r exe filter < "$dir/tests"
    lib=$(mktemp -d)
    for f in "$dir"/*.xz; do
      python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" \
        "$f" "$lib/$(basename "$f" .xz)"
    done
    LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}" timeout 600 "$BUILD_DIR/$exe" \
      --gtest_filter="$filter" > "$OUT_DIR/mutant_$name.log" 2>&1
    rc=$?
    # Result lines end in "(N ms)"; the closing list of failures does not.
    ran=$(grep -cE '^\[ +(OK|FAILED) +\] .*\([0-9]+ ms\)$' "$OUT_DIR/mutant_$name.log")
    failed=$(grep -cE '^\[  FAILED  \] .*\([0-9]+ ms\)$' "$OUT_DIR/mutant_$name.log")
    if [ "$ran" -eq 0 ]; then
      verdict="MISSED (no test ran; see the log)"; status=1
    elif [ "$failed" -gt 0 ]; then
      verdict="caught ($failed of $ran failed)"
    else
      verdict="MISSED (passed without the wait)"; status=1
    fi
    printf '%-28s %-28s %5s %s\n' "$name" "$exe" "$rc" "$verdict" | tee -a "$SUMMARY"
    rm -rf "$lib"
  done
fi

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
    # A binary with no GPU case has nothing for the sanitizer to check.
    if [ -z "$("$exe" --gtest_list_tests --gtest_filter="$filter" 2>/dev/null | grep '^  ')" ]; then
      printf '%-28s %-10s %8s %5s %8s\n' "$name" "-" "no GPU cases" "-" "-" | tee -a "$SUMMARY"
      continue
    fi
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
# Each bench writes its Google Benchmark JSON to OUT_DIR/NAME.json (the
# source of every number in bench/RESULTS.md and README.md) and its console
# output to OUT_DIR/NAME.log; scripts/check_results.py turns all of them into
# the markdown tables of OUT_DIR/bench_tables.md. A bench that runs past
# BENCH_TIMEOUT seconds (default 300) is stopped and reported, so one stuck
# case cannot use up a device call; on an H200 the whole section takes a few
# minutes (each case takes its own medians; no --benchmark_repetitions).
if [ "${SKIP_BENCH:-0}" = 1 ]; then
  note "== benchmarks skipped (SKIP_BENCH=1)"
else
  note "== benchmarks"
  # attention_bench's GEMM reference loads cuBLAS at run time (never packed):
  # the machine's own copy, from the nvidia-cublas wheel or the CUDA toolkit,
  # unless FP4KV_CUBLAS_LIBRARY names one or the loader finds it already.
  if [ -z "${FP4KV_CUBLAS_LIBRARY:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libcublas\.so'; then
    for d in $(python3 -c "import nvidia.cublas, os; p = os.path.dirname(nvidia.cublas.__file__); print(os.path.join(p, 'lib'))" 2>/dev/null) \
             $(python3 -c "import nvidia, os; [print(os.path.join(p, 'cu13', 'lib')) for p in nvidia.__path__]" 2>/dev/null) \
             /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
      if [ -e "$d/libcublas.so.13" ]; then
        # After the carried libraries: libcublasLt is found there, nothing else moves.
        export FP4KV_CUBLAS_LIBRARY="$d/libcublas.so.13"
        export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
        break
      fi
    done
  fi
  bench_jsons=()
  for exe in $(executables '*_bench'); do
    name=$(basename "$exe")
    # BENCHES="kernels_bench kv_cache_bench" runs only those.
    if [ -n "${BENCHES:-}" ] && ! [[ " $BENCHES " == *" $name "* ]]; then continue; fi
    start=$(date +%s)
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-300}" "$exe" --benchmark_out="$OUT_DIR/$name.json" \
      --benchmark_out_format=json ${BENCH_ARGS:-} > "$OUT_DIR/$name.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    note "$name: exit $rc, ${secs} s$([ "$rc" = 124 ] && echo " (timed out after ${BENCH_TIMEOUT:-300} s)")"
    [ -s "$OUT_DIR/$name.json" ] && bench_jsons+=("$OUT_DIR/$name.json")
  done
  if command -v python3 > /dev/null && [ ${#bench_jsons[@]} -gt 0 ]; then
    python3 "$(dirname "$0")/check_results.py" "${bench_jsons[@]}" > "$OUT_DIR/bench_tables.md"
    tee -a "$SUMMARY" < "$OUT_DIR/bench_tables.md"
  else
    note "(python3 or JSON missing: see $OUT_DIR/*_bench.json)"
  fi
fi

# -------------------------------------------------------------- examples
if [ "${SKIP_EXAMPLES:-0}" != 1 ] && [ -x "$BUILD_DIR/serving_loop" ]; then
  note "== serving_loop"
  "$BUILD_DIR/serving_loop" > "$OUT_DIR/serving_loop.log" 2>&1
  rc=$?
  tail -n 12 "$OUT_DIR/serving_loop.log" | tee -a "$SUMMARY"
  [ "$rc" -ne 0 ] && { note "serving_loop: exit $rc"; status=1; }
  # Two tensor-parallel ranks (half the KV heads each) on this GPU: every
  # host decision must agree across the ranks, step by step.
  note "== serving_loop --tp=2"
  "$BUILD_DIR/serving_loop" --tp=2 > "$OUT_DIR/serving_loop_tp2.log" 2>&1
  rc=$?
  tail -n 2 "$OUT_DIR/serving_loop_tp2.log" | tee -a "$SUMMARY"
  [ "$rc" -ne 0 ] && { note "serving_loop --tp=2: exit $rc"; status=1; }
  # Two step slots: step N+1 prepared while step N runs, decode ids given
  # late; prints the host time the device work hid.
  note "== serving_loop --overlap=1"
  "$BUILD_DIR/serving_loop" --overlap=1 > "$OUT_DIR/serving_loop_overlap.log" 2>&1
  rc=$?
  grep -E "^(overlap|done|time|decode step|prefill steps|prefix cache|dequantized)" "$OUT_DIR/serving_loop_overlap.log" | tee -a "$SUMMARY"
  [ "$rc" -ne 0 ] && { note "serving_loop --overlap=1: exit $rc"; status=1; }
  note "== serving_loop --overlap=1 --tp=2"
  "$BUILD_DIR/serving_loop" --overlap=1 --tp=2 > "$OUT_DIR/serving_loop_overlap_tp2.log" 2>&1
  rc=$?
  tail -n 2 "$OUT_DIR/serving_loop_overlap_tp2.log" | tee -a "$SUMMARY"
  [ "$rc" -ne 0 ] && { note "serving_loop --overlap=1 --tp=2: exit $rc"; status=1; }
fi

note "== overall: $([ $status -eq 0 ] && echo OK || echo FAILED) (logs in $OUT_DIR)"
exit $status
