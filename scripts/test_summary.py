#!/usr/bin/env python3
"""Passed / failed / skipped gtest cases per test binary, from the JSON files
that GTEST_OUTPUT=json:DIR/ makes every binary write (scripts/test.sh sets it
for ctest). A binary whose cases all skipped is named as such: without a GPU
the GPU cases skip, and ctest alone would count such a binary as passed.

Usage: test_summary.py DIR [--suffix .gtest.json] [--json tests.json]
(scripts/gpu_check.sh writes a run's tests.json with it.) Standard library only."""

import glob
import json
import os
import sys


def counts(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for suite in data.get("testsuites", []):
        for t in suite.get("testsuite", []):
            if t.get("result") == "SKIPPED":
                c["skipped"] += 1
            elif t.get("failures"):
                c["failed"] += 1
            elif t.get("status", "RUN") == "RUN":
                c["passed"] += 1
    return c


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(description="gtest cases per binary")
    ap.add_argument("dir", help="folder of gtest JSON files")
    ap.add_argument("--suffix", default=".json",
                    help="file name ending of the gtest JSON files (default .json)")
    ap.add_argument("--json", metavar="FILE",
                    help="also write {binary: {passed, failed, skipped}} to FILE")
    args = ap.parse_args(argv)
    rows = []
    for path in sorted(glob.glob(os.path.join(args.dir, "*" + args.suffix))):
        try:
            rows.append((os.path.basename(path)[:-len(args.suffix)], counts(path)))
        except (OSError, ValueError) as e:
            print(f"test_summary: {path}: {e}", file=sys.stderr)
    if not rows:
        print(f"test_summary: no gtest JSON in {args.dir}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(rows), f, indent=1, sort_keys=True)
    print(f"{'binary':32} {'passed':>7} {'failed':>7} {'skipped':>8}  note")
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for name, c in rows:
        for k in total:
            total[k] += c[k]
        note = ""
        if c["passed"] == 0 and c["failed"] == 0 and c["skipped"] > 0:
            note = "every case skipped (needs a GPU)"
        elif c["skipped"] > 0:
            note = "some cases skipped"
        print(f"{name:32} {c['passed']:7} {c['failed']:7} {c['skipped']:8}  {note}")
    print(f"{'all binaries':32} {total['passed']:7} {total['failed']:7} {total['skipped']:8}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
