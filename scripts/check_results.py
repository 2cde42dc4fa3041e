#!/usr/bin/env python3
"""Markdown tables from Google Benchmark JSON, and a check of quoted numbers.

Usage:
  scripts/check_results.py OUT/kernels_bench.json OUT/attention_bench.json ...
  scripts/check_results.py OUT/*.json --check README.md --check bench/RESULTS.md

For every JSON file (written by a bench with --benchmark_out=FILE
--benchmark_out_format=json, as scripts/gpu_check.sh does) it prints one
markdown table: case name, median, % of copy and every other counter. The
median is the case's `median_us` counter (CUDA events, median of the timed
runs), else `graph_us` (one graph replay, BM_DecodeStepGraph), else Google
Benchmark's own time per iteration. "% of copy" is the `pct_of_copy` counter:
the case's bytes per second against the device-to-device cudaMemcpy of the
same process (bench/RESULTS.md states which bytes count).

--check FILE (repeatable): lists every measured-looking number in FILE (a
number with a decimal point in a table row, or followed by us, ms, %, GB/s
or x) that no value of the given JSON files gives when rounded to the same
number of decimals (us values are also tried as ms). Exit status 1 when
something is listed, so a stale README is noticed; numbers that are not
measurements (targets, shapes) may be listed too and are judged by eye.

Standard library only.
"""

import argparse
import json
import math
import os
import re
import sys

# Keys of a Google Benchmark run that are not user counters.
STANDARD_KEYS = {
    "name", "run_name", "run_type", "repetitions", "repetition_index", "threads",
    "iterations", "real_time", "cpu_time", "time_unit", "family_index",
    "per_family_instance_index", "aggregate_name", "aggregate_unit", "error_occurred",
    "error_message", "label", "bytes_per_second", "items_per_second", "skipped",
}
MEDIAN_KEYS = ("median_us", "graph_us")


def clean_name(name):
    for tail in ("/manual_time", "/real_time"):
        name = name.replace(tail, "")
    return re.sub(r"/iterations:\d+", "", name)


def fmt(v):
    """Four significant digits, no exponent for ordinary magnitudes."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if v == 0:
        return "0"
    if abs(v) >= 1e6 or abs(v) < 1e-3:
        return f"{v:.4g}"
    digits = max(0, 3 - int(math.floor(math.log10(abs(v)))))
    return f"{v:.{digits}f}"


def runs(data):
    """The rows to show: plain iterations, or the 'median' aggregate when a
    case was repeated (Google Benchmark's --benchmark_repetitions)."""
    out = []
    repeated = {b.get("run_name") for b in data.get("benchmarks", [])
                if b.get("run_type") == "aggregate"}
    for b in data.get("benchmarks", []):
        if b.get("run_name") in repeated:
            if b.get("run_type") == "aggregate" and b.get("aggregate_name") == "median":
                out.append(b)
        else:
            out.append(b)
    return out


def median_text(b):
    for k in MEDIAN_KEYS:
        if k in b:
            return f"{fmt(b[k])} us", k
    if "real_time" in b:
        return f"{fmt(b['real_time'])} {b.get('time_unit', 'ns')}", None
    return "", None


def table(path, data):
    lines = []
    ctx = data.get("context", {})
    title = os.path.basename(path)
    lines.append(f"### {title}")
    lines.append("")
    info = [ctx.get(k) for k in ("date", "host_name") if ctx.get(k)]
    copy = [b.get("GBps") for b in data.get("benchmarks", [])
            if clean_name(b.get("name", "")).startswith("BM_DeviceCopy") and "GBps" in b]
    if copy:
        info.append(f"device-to-device copy {fmt(copy[0])} GB/s (read + write)")
    if info:
        lines.append("Run: " + ", ".join(str(i) for i in info) + ".")
        lines.append("")
    lines.append("| case | median | % of copy | counters |")
    lines.append("| --- | ---: | ---: | --- |")
    for b in runs(data):
        name = clean_name(b.get("name", "?"))
        if b.get("error_occurred"):
            lines.append(f"| {name} | error: {b.get('error_message', '')} | | |")
            continue
        med, used = median_text(b)
        pct = fmt(b["pct_of_copy"]) if "pct_of_copy" in b else ""
        counters = []
        for k in sorted(b):
            if k in STANDARD_KEYS or k in ("pct_of_copy", used):
                continue
            counters.append(f"{k}={fmt(b[k])}")
        if b.get("label"):
            counters.append(f"label: {b['label']}")
        lines.append(f"| {name} | {med} | {pct} | {', '.join(counters)} |")
    lines.append("")
    return "\n".join(lines)


def json_values(datas):
    """Every number the runs hold (counters and times), us also as ms."""
    vals = []
    for data in datas:
        for b in data.get("benchmarks", []):
            for k, v in b.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                vals.append(v)
                if k.endswith("_us") or (k in ("real_time", "cpu_time")
                                         and b.get("time_unit") == "us"):
                    vals.append(v / 1e3)  # as ms
                if k.endswith("bytes") or k == "bytes":
                    vals.extend((v / 1e6, v / 1e9))  # MB, GB
    return vals


NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+)(?![\w.])")
UNIT_AFTER = re.compile(r"^\s*(us|ms|µs|%|GB/s|x\b)")


def check(path, vals):
    flagged = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            in_table = line.lstrip().startswith("|")
            for m in NUMBER.finditer(line):
                text = m.group(1)
                if not in_table and not UNIT_AFTER.match(line[m.end():]):
                    continue
                decimals = len(text.split(".")[1])
                x = float(text)
                if any(abs(round(v, decimals) - x) < 0.5 * 10 ** -decimals + 1e-12 for v in vals):
                    continue
                flagged.append((lineno, text, line.strip()))
    return flagged


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+", help="Google Benchmark JSON files")
    ap.add_argument("--check", action="append", default=[], metavar="FILE",
                    help="flag numbers in FILE that no JSON value gives (repeatable)")
    args = ap.parse_args()
    datas = []
    for path in args.json:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"check_results: {path}: {e}", file=sys.stderr)
            continue
        datas.append(data)
        print(table(path, data))
    status = 0
    if args.check:
        vals = json_values(datas)
        for path in args.check:
            flagged = check(path, vals)
            print(f"## {path}: {len(flagged)} number(s) not found in the JSON")
            for lineno, text, line in flagged:
                print(f"{path}:{lineno}: {text}: {line[:120]}")
            if flagged:
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
