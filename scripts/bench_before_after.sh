#!/usr/bin/env bash
# Runs benchmarks of two builds of the library in one process tree, turn
# about (before, after, before, after), so that a change's cost or gain is
# read from one run on one machine, with drift shared by both sides:
#   BEFORE_DIR/bin/NAME with BEFORE_DIR/lib first on LD_LIBRARY_PATH,
#   AFTER_BIN/NAME with .carry/lib (the library under test).
# Writes OUT/NAME.before.K.json and OUT/NAME.after.K.json (K = 1 .. ROUNDS, default 2) and a
# table of medians per case and side (OUT/before_after.md).
#
# Usage: scripts/bench_before_after.sh BEFORE_DIR AFTER_BIN OUT "NAME[:FILTER] ..."
#   e.g. scripts/bench_before_after.sh .carry/before .carry/bin out \
#          "kv_cache_bench:PrepareStep|CacheAllocate binding_overhead_bench"
# BENCH_ARGS: extra arguments for every run (e.g. --benchmark_min_time=0.1s).
# Package BEFORE_DIR with scripts/package_for_gpu.sh at the earlier commit
# (its bin/ and lib/ moved under one folder).
set -u -o pipefail
BEFORE=$1
AFTER_BIN=$2
OUT=$3
BENCHES=$4
mkdir -p "$OUT"
after_lib=""
[ -d ./.carry/lib ] && after_lib="$(cd ./.carry/lib && pwd)"
before_lib="$(cd "$BEFORE/lib" && pwd)"
for spec in $BENCHES; do
  name=${spec%%:*}
  filter=""
  [ "$spec" != "$name" ] && filter=${spec#*:}
  for k in $(seq "${ROUNDS:-2}"); do
    for side in before after; do
      if [ "$side" = before ]; then
        exe="$BEFORE/bin/$name"
        lib="$before_lib${after_lib:+:$after_lib}"
      else
        exe="$AFTER_BIN/$name"
        lib="$after_lib"
      fi
      [ -x "$exe" ] || { echo "bench_before_after: no $exe" >&2; continue; }
      LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 300 "$exe" \
        ${filter:+--benchmark_filter="$filter"} ${BENCH_ARGS:-} --benchmark_out="$OUT/$name.$side.$k.json" \
        --benchmark_out_format=json > "$OUT/$name.$side.$k.log" 2>&1 ||
        echo "bench_before_after: $name ($side, $k) exited $?" >&2
    done
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/before_after.md"
import glob, json, os, re, statistics, sys
out = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    m = re.match(r"(.+)\.(before|after)\.(\d)\.json$", os.path.basename(path))
    if not m:
        continue
    name, side = m.group(1), m.group(2)
    try:
        data = json.load(open(path))
    except Exception:
        continue
    for b in data.get("benchmarks", []):
        if b.get("error_occurred"):
            continue
        agg = b.get("aggregate_name")
        if agg not in (None, "median"):
            continue
        case = b.get("run_name", b["name"])
        t = b.get("real_time") if "real_time" in b else None
        unit = b.get("time_unit", "ns")
        rows.setdefault((name, case, unit), {}).setdefault(side, []).append(t)
print("| bench | case | unit | before (median of runs) | after | after / before |")
print("|---|---|---|---:|---:|---:|")
for (name, case, unit), v in sorted(rows.items()):
    b = statistics.median(v["before"]) if v.get("before") else None
    a = statistics.median(v["after"]) if v.get("after") else None
    r = f"{a / b:.3f}" if a and b else ""
    fb = f"{b:.4g}" if b is not None else ""
    fa = f"{a:.4g}" if a is not None else ""
    print(f"| {name} | {case} | {unit} | {fb} | {fa} | {r} |")
PY
