#!/usr/bin/env bash
# A saved CPU run: the accuracy reports the README and docs quote, computed on
# this machine's CPU (deterministic: fixed seeds, the CPU reference), saved like
# a GPU run under bench/runs/<date>-cpu-<commit>/: run.json (commit, CPU,
# compiler), each report's output (NAME.log) and its markdown tables as JSON
# (NAME.json: {"<section>/<row>": {"<column>": value}}, names lower-cased with
# runs of other characters as "_"; scripts/check_results.py reads them).
#
# Usage: scripts/cpu_run.sh [BUILD_DIR]   (default build; the examples must be built)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
commit=$(git rev-parse --short=7 HEAD)
id="$(date -u +%Y-%m-%d)-cpu-$commit"
[ -z "$(git status --porcelain --untracked-files=no)" ] || id="$id-dirty"
out=bench/runs/$id
mkdir -p "$out"
"$build/accuracy_report" > "$out/accuracy_report.log"
FP4KV_REALKV_DIR=${FP4KV_REALKV_DIR:-tests/data/realkv} "$build/realkv_accuracy" > "$out/realkv_accuracy.log"
python3 - "$out" "$id" "$commit" <<'PY'
import json, os, platform, re, subprocess, sys
out, run_id, commit = sys.argv[1:]
def slug(s):
    return re.sub(r"[^a-z0-9]+", "_", s.lower()).strip("_")
def number(cell):
    m = re.match(r"^\s*([-+]?\d+(?:\.\d+)?)\s*(%?)\s*(?:\(([-+]?\d+(?:\.\d+)?)\))?\s*$", cell)
    if not m:
        return None
    return float(m.group(1)), (float(m.group(3)) if m.group(3) else None)
for name in ("accuracy_report", "realkv_accuracy"):
    data, section, header = {}, "", None
    for line in open(os.path.join(out, name + ".log")):
        line = line.rstrip("\n")
        if line.startswith("#"):
            section = slug(line.lstrip("#"))
            header = None
        elif re.match(r"^[a-z_]+ [0-9.]+$", line):          # "calibration_headroom 4"
            section = slug(line)
            header = None
        elif line.startswith("|") and header is None:
            header = [slug(c) for c in line.strip("|").split("|")]
        elif line.startswith("|") and not re.match(r"^\|[-: |]+\|$", line):
            cells = [c.strip() for c in line.strip("|").split("|")]
            row = {}
            for col, cell in zip(header[1:], cells[1:]):
                v = number(cell)
                if v is None:
                    continue
                row[col] = v[0]
                if v[1] is not None:
                    row[col + "_paren"] = v[1]
            data[f"{section}/{slug(cells[0])}"] = row
    json.dump(data, open(os.path.join(out, name + ".json"), "w"), indent=1)
cpu = ""
try:
    cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
except Exception:
    pass
cxx = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
json.dump({"id": run_id, "commit": commit, "device": "cpu", "cpu": cpu, "cores": os.cpu_count(),
           "compiler": cxx, "platform": platform.platform()},
          open(os.path.join(out, "run.json"), "w"), indent=2)
print(out)
PY
