#!/usr/bin/env python3
"""Tables from saved runs, and a check that every published number matches its run.

Usage:
  check_results.py tables RUN_DIR_OR_JSON...   markdown tables of Google Benchmark JSON
  check_results.py RUN/a.json RUN/b.json       the same (the form gpu_check.sh calls)
  check_results.py check [--runs DIR] FILE...  every measured number of FILE against its run
  check_results.py value [--runs DIR] RUN FILE SELECTOR KEY [--decimals N]
                                               one saved value (to write a reference)
  check_results.py fill [--runs DIR] FILE...   replaces {{EXPR|FORMAT UNIT}} placeholders
                                               with the value and its reference comment

A run is a folder bench/runs/<id>/ written by scripts/gpu_check.sh: run.json (the header:
commit, GPU, driver, clocks, date), one Google Benchmark JSON per bench (NAME.json),
tests.json (passed / failed / skipped per test binary), and the logs.

How a document quotes a number (the "check" command):

  <!-- runs: A=2026-12-07-h100-6cc970d -->       declares a run alias (one or more pairs)
  122.2 us<!--@ A attention_bench BM_X/batch:64 median_us -->

A reference comment follows the number it proves (the unit, if any, may stand between).
Inside it: REF [OP REF ...], where REF is four words, ALIAS FILE SELECTOR KEY (parentheses,
as separate words, group): FILE is a
JSON file of the run without ".json"; for Google Benchmark JSON the SELECTOR is the case
name (as the tables print it: no /manual_time, /real_time or /iterations) and KEY a counter
or real_time (a name with spaces is written with "_" for each run of spaces); for any
other JSON, data[SELECTOR][KEY]. OP is one of + - * / and a REF may
be a plain number, so a ratio reads "REF / REF" and a percentage "REF / REF * 100". The
written number must equal the value rounded to the decimals written (integers too; "1,234"
reads 1234); a value of a `*_us` key quoted in ms or s is converted by the unit written.
A range "49.3-55.2%" is two numbers, each with its comment.

A number that is not a measurement (a target, a shape, a constant of the format) takes
<!--spec--> after it, or stands in a region <!-- spec --> ... <!-- /spec -->. Every other
number that looks measured (a number followed by us, µs, ms, s, %, GB/s, TB/s, TFLOP/s or
x, or a number with a decimal point in a table row) must carry a reference, unless it
follows a comparison sign (≥ ≤ > < ~), stands in code, or is a commit hash. The check fails
(exit status 1) on: an unreferenced measured number, a reference whose run, file, case or
key does not exist, a value that does not match, an undeclared alias, and a run alias that
no visible text of the document names (each declared run must be named as `<id>`
somewhere in the file, so a reader can find it), and a PNG picture the document shows
(![..](x.png)) that is missing or whose "Source" field names no saved run.

Standard library only.
"""

import argparse
import ast
import json
import math
import operator
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
DEFAULT_RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "runs")


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


# ----------------------------------------------------------------- runs


class RunError(Exception):
    pass


class Runs:
    """Lazy access to bench/runs/<id>/<file>.json."""

    def __init__(self, root):
        self.root = root
        self.cache = {}

    def has_run(self, run_id):
        return os.path.isfile(os.path.join(self.root, run_id, "run.json"))

    def load(self, run_id, name):
        key = (run_id, name)
        if key not in self.cache:
            path = os.path.join(self.root, run_id, name + ".json")
            if not os.path.isfile(path):
                raise RunError(f"run {run_id} has no {name}.json")
            with open(path, encoding="utf-8") as f:
                self.cache[key] = json.load(f)
        return self.cache[key]

    def value(self, run_id, name, selector, key):
        if not self.has_run(run_id):
            raise RunError(f"no run {run_id} (no {run_id}/run.json under {self.root})")
        data = self.load(run_id, name)
        if isinstance(data, dict) and "benchmarks" in data:
            for b in runs(data):
                # A case name with spaces is referred to with "_" for each run of spaces.
                name = clean_name(b.get("name", ""))
                if name == selector or re.sub(r"\s+", "_", name) == selector:
                    if b.get("error_occurred"):
                        raise RunError(f"{run_id}/{name}: {selector} ended in an error")
                    if key not in b:
                        raise RunError(f"{run_id}/{name}: {selector} has no counter {key}")
                    v = b[key]
                    if isinstance(v, bool) or not isinstance(v, (int, float)):
                        raise RunError(f"{run_id}/{name}: {selector} {key} is not a number")
                    return float(v)
            raise RunError(f"{run_id}/{name}: no case {selector}")
        if not isinstance(data, dict) or selector not in data:
            raise RunError(f"{run_id}/{name}: no entry {selector}")
        entry = data[selector]
        if not isinstance(entry, dict) or key not in entry:
            raise RunError(f"{run_id}/{name}: {selector} has no key {key}")
        v = entry[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RunError(f"{run_id}/{name}: {selector} {key} is not a number")
        return float(v)


# ------------------------------------------------------------- documents

RUNS_DECL = re.compile(r"<!--\s*runs:\s*(.*?)-->", re.S)
REF_COMMENT = re.compile(r"<!--@(.*?)-->", re.S)
SPEC_COMMENT = re.compile(r"<!--\s*spec\s*-->")
ANY_COMMENT = re.compile(r"<!--.*?-->", re.S)
# A number: digits with optional thousands separators and decimals.
NUMBER = re.compile(r"(?<![\w.,/#])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?!\d|\.\d|,\d{3})")
# The first end of a range ("49.3-55.2%") takes the unit of the second.
RANGE_AFTER = re.compile(r"^[-–]\d[\d.,]*(?:\s?(us|µs|ms|s|%|GB/s|TB/s|TFLOP/s)|x)(?![\w/])")
UNITS = r"(us|µs|ms|s|%|GB/s|TB/s|TFLOP/s|x)"
# "x" only when attached ("1.57x"): "64 x 4096" is a shape.
UNIT_AFTER = re.compile(r"^(?:\s?(us|µs|ms|s|%|GB/s|TB/s|TFLOP/s)|x)(?![\w/])")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}


class Problem:
    def __init__(self, path, lineno, text, why):
        self.path, self.lineno, self.text, self.why = path, lineno, text, why

    def __str__(self):
        return f"{self.path}:{self.lineno}: {self.text}: {self.why}"


def evaluate(expr, aliases, store):
    """Value of a reference comment's expression and the key of its first REF.
    Words: REF (ALIAS FILE SELECTOR KEY), numbers, + - * / and parentheses."""
    words = expr.split()
    if not words:
        raise RunError("empty reference")
    values, text, first_key = [], [], None
    i = 0
    while i < len(words):
        w = words[i]
        if w in OPS or w in ("(", ")") or re.fullmatch(r"\d+(\.\d+)?", w):
            text.append(w)
            i += 1
            continue
        if i + 4 > len(words):
            raise RunError(f"a reference needs ALIAS FILE SELECTOR KEY, got {' '.join(words[i:])!r}")
        alias, name, selector, key = words[i:i + 4]
        if alias not in aliases:
            raise RunError(f"alias {alias} is not declared (<!-- runs: {alias}=<id> -->)")
        values.append(store.value(aliases[alias], name, selector, key))
        if first_key is None:
            first_key = key
        text.append(f"v{len(values) - 1}")
        i += 4
    try:
        tree = ast.parse(" ".join(text), mode="eval")
    except SyntaxError:
        raise RunError(f"not an expression: {expr.strip()!r}")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in AST_OPS:
            right = ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise RunError("division by zero")
            return AST_OPS[type(node.op)](ev(node.left), right)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name) and re.fullmatch(r"v\d+", node.id):
            return values[int(node.id[1:])]
        raise RunError(f"not an expression: {expr.strip()!r}")

    return ev(tree), first_key


def unit_scale(key, unit):
    """Factor from a counter's unit to the unit written after the number."""
    if key is None:
        return 1.0
    if key.endswith("_us") or key == "real_time":
        return {"ms": 1e-3, "s": 1e-6}.get(unit, 1.0)
    return 1.0


def matches(written, decimals, value):
    return abs(round(value, decimals) - written) < 0.5 * 10 ** -decimals + 1e-9 * max(1.0, abs(written))


def strip_code(line):
    """The line with inline code spans blanked (same length)."""
    return re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line)


def check_text(path, text, store):
    problems = []
    aliases = {}
    for m in RUNS_DECL.finditer(text):
        for pair in m.group(1).split():
            if "=" not in pair:
                problems.append(Problem(path, text.count("\n", 0, m.start()) + 1, pair,
                                        "expected ALIAS=RUN in a runs declaration"))
                continue
            alias, run_id = pair.split("=", 1)
            aliases[alias] = run_id
    visible = ANY_COMMENT.sub("", text)
    for alias, run_id in aliases.items():
        lineno = next((n for n, l in enumerate(text.split("\n"), 1) if f"{alias}={run_id}" in l), 1)
        if not store.has_run(run_id):
            problems.append(Problem(path, lineno, alias, f"run {run_id} is not saved under {store.root}"))
        if run_id not in visible:
            problems.append(Problem(path, lineno, alias,
                                    f"run {run_id} is declared but never named in the text"))
    in_fence = False
    in_spec = False
    checked = 0
    for lineno, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if re.fullmatch(r"\s*<!--\s*spec\s*-->\s*", line):
            in_spec = True
            continue
        if re.fullmatch(r"\s*<!--\s*/spec\s*-->\s*", line):
            in_spec = False
            continue
        # Comments are replaced by markers at their place: the number before a
        # marker is the one it speaks for.
        plain = strip_code(line)
        refs = []  # (start, end, kind, body)
        for m in ANY_COMMENT.finditer(plain):
            body = m.group(0)
            if body.startswith("<!--@"):
                refs.append((m.start(), m.end(), "ref", body[5:-3]))
            elif SPEC_COMMENT.fullmatch(body):
                refs.append((m.start(), m.end(), "spec", ""))
            else:
                refs.append((m.start(), m.end(), "other", ""))
        in_table = plain.lstrip().startswith("|")
        claimed = set()
        for start, end, kind, body in refs:
            if kind == "other":
                continue
            # The number right before the comment (a unit may stand between).
            before = plain[:start]
            m = re.search(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(\s?" + UNITS + r")?\s?$", before)
            if m is None:
                problems.append(Problem(path, lineno, body.strip()[:40] or "spec",
                                        "a reference comment that follows no number"))
                continue
            claimed.add(m.start())
            if kind == "spec":
                # A spec after a range ("10–50x<!--spec-->") speaks for both ends.
                r = re.search(r"(?<![\w.])(\d+(?:\.\d+)?)[-–]$", plain[:m.start()])
                if r is not None:
                    claimed.add(r.start())
                continue
            written = float((m.group(1) + (m.group(2) or "")).replace(",", ""))
            decimals = len(m.group(2)) - 1 if m.group(2) else 0
            unit = (m.group(4) or "").strip()
            try:
                value, key = evaluate(body, aliases, store)
            except RunError as e:
                problems.append(Problem(path, lineno, m.group(0).strip(), str(e)))
                continue
            checked += 1
            value *= unit_scale(key, unit)
            if not matches(written, decimals, value):
                problems.append(Problem(path, lineno, m.group(0).strip(),
                                        f"the run says {value:.6g} ({body.strip()})"))
        if in_spec:
            continue
        # Unreferenced numbers that look measured.
        masked = plain
        for start, end, kind, body in refs:
            masked = masked[:start] + " " * (end - start) + masked[end:]
        for m in NUMBER.finditer(masked):
            if m.start() in claimed:
                continue
            after = masked[m.end():]
            # A reference separated from its number only by a unit claims it.
            has_unit = UNIT_AFTER.match(after) is not None or RANGE_AFTER.match(after) is not None
            decimal = m.group(2) is not None
            if not (has_unit or (in_table and decimal)):
                continue
            prefix = masked[:m.start()].rstrip()
            if prefix.endswith(("≥", "≤", ">", "<", "~", "=", "±")) or prefix.endswith((">=", "<=")):
                continue
            if re.search(r"\b(floor|goal|target)\s*$", prefix, re.I):
                continue
            word = m.group(0)
            problems.append(Problem(path, lineno, word + (UNIT_AFTER.match(after).group(0) if UNIT_AFTER.match(after) else ""),
                                    "a measured-looking number with no reference "
                                    "(<!--@ ALIAS FILE SELECTOR KEY --> or <!--spec-->)"))
    return problems, checked


IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")


def png_text(path):
    """The tEXt fields of a PNG file (keyword -> text)."""
    import struct
    out = {}
    with open(path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            raise RunError(f"{path} is not a PNG file")
        while True:
            head = f.read(8)
            if len(head) < 8:
                break
            length, kind = struct.unpack(">I4s", head)
            data = f.read(length)
            f.read(4)  # CRC
            if kind == b"tEXt" and b"\0" in data:
                key, _, text = data.partition(b"\0")
                out[key.decode("latin-1")] = text.decode("latin-1")
            if kind == b"IEND":
                break
    return out


def check_images(path, text, store):
    """Every PNG a document shows exists and names a saved run in its Source field
    (scripts/plot_results.py writes it)."""
    problems = []
    base = os.path.dirname(os.path.abspath(path))
    for lineno, line in enumerate(text.split("\n"), 1):
        for m in IMAGE.finditer(line):
            img = os.path.join(base, m.group(1))
            if not os.path.isfile(img):
                problems.append(Problem(path, lineno, m.group(1), "the picture does not exist"))
                continue
            try:
                source = png_text(img).get("Source", "")
            except (OSError, RunError) as e:
                problems.append(Problem(path, lineno, m.group(1), str(e)))
                continue
            run_id = os.path.basename(source.rstrip("/"))
            if not source.startswith("bench/runs/") or not store.has_run(run_id):
                problems.append(Problem(path, lineno, m.group(1),
                                        f"the picture names no saved run (Source {source!r})"))
    return problems


def check_files(paths, root):
    store = Runs(root)
    all_problems = []
    total = 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        problems, checked = check_text(path, text, store)
        problems += check_images(path, text, store)
        total += checked
        print(f"{path}: {checked} number(s) checked against their runs, {len(problems)} problem(s)")
        all_problems.extend(problems)
    for p in all_problems:
        print(p)
    return all_problems, total


# ------------------------------------------------------------------ fill

PLACEHOLDER = re.compile(r"\{\{(.*?)\|\s*([^}]*?)\s*\}\}")


def fill_text(text, store):
    """Replaces every {{EXPR|FORMAT [UNIT]}} with the value and its reference:
    "{{A attention_bench BM_X median_us|.1f us}}" -> "122.2 us<!--@ A ... -->".
    FORMAT is a Python format spec (".1f", ",.0f"); UNIT, if given, is written
    after the number (a *_us value is converted to ms or s as the check does)."""
    aliases = {}
    for m in RUNS_DECL.finditer(text):
        for pair in m.group(1).split():
            if "=" in pair:
                a, r = pair.split("=", 1)
                aliases[a] = r

    def one(m):
        expr, spec = m.group(1).strip(), m.group(2).split()
        fmt_spec = spec[0] if spec else ".1f"
        unit = " ".join(spec[1:])
        value, key = evaluate(expr, aliases, store)
        value *= unit_scale(key, unit)
        number = format(value, fmt_spec)
        sep = "" if unit in ("", "%", "x") else " "
        return f"{number}{sep}{unit}<!--@ {expr} -->"

    return PLACEHOLDER.sub(one, text)


# ------------------------------------------------------------------ main


def load_jsons(paths):
    out = []
    for path in paths:
        files = [path]
        if os.path.isdir(path):
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".json"))
        for p in files:
            try:
                with open(p, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError) as e:
                print(f"check_results: {p}: {e}", file=sys.stderr)
                continue
            if isinstance(data, dict) and "benchmarks" in data:
                out.append((p, data))
    return out


def main(argv):
    if argv and argv[0] not in ("tables", "check", "value", "fill", "-h", "--help"):
        argv = ["tables"] + argv  # the older form: JSON files only
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tables", help="markdown tables of benchmark JSON")
    t.add_argument("paths", nargs="+")
    c = sub.add_parser("check", help="check the numbers of documents against their runs")
    c.add_argument("--runs", default=DEFAULT_RUNS, help="folder of runs (default bench/runs)")
    c.add_argument("files", nargs="+")
    fl = sub.add_parser("fill", help="replace {{EXPR|FORMAT UNIT}} placeholders in place")
    fl.add_argument("--runs", default=DEFAULT_RUNS)
    fl.add_argument("files", nargs="+")
    v = sub.add_parser("value", help="print one saved value")
    v.add_argument("--runs", default=DEFAULT_RUNS)
    v.add_argument("--decimals", type=int, default=None)
    v.add_argument("run")
    v.add_argument("file")
    v.add_argument("selector")
    v.add_argument("key")
    args = ap.parse_args(argv)
    if args.cmd == "tables":
        for p, data in load_jsons(args.paths):
            print(table(p, data))
        return 0
    if args.cmd == "fill":
        store = Runs(args.runs)
        for path in args.files:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            try:
                filled = fill_text(text, store)
            except RunError as e:
                print(f"check_results: {path}: {e}", file=sys.stderr)
                return 1
            with open(path, "w", encoding="utf-8") as f:
                f.write(filled)
        return 0
    if args.cmd == "value":
        try:
            x = Runs(args.runs).value(args.run, args.file, args.selector, args.key)
        except RunError as e:
            print(f"check_results: {e}", file=sys.stderr)
            return 1
        print(fmt(x) if args.decimals is None else f"{x:.{args.decimals}f}")
        return 0
    problems, _ = check_files(args.files, args.runs)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
