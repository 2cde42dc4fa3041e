#!/usr/bin/env python3
"""Pictures of a saved run (bench/runs/<id>/): what the tables of bench/RESULTS.md say,
drawn from the same JSON so they cannot go stale by hand.

Usage:
  plot_results.py [--run ID] [--runs DIR] [--out DIR]

  --run   the run to draw (default: for each picture, the newest GPU run under --runs that
          holds its bench; ids begin with the date)
  --runs  the folder of runs (default bench/runs)
  --out   where the PNGs go (default docs/img)

Writes, each with the run's id, GPU and commit in its title and the run's folder in the
PNG's "Source" text field (scripts/check_results.py check verifies that every picture a
checked document shows names a saved run):
  decode_attention.png  decode attention, % of a device-to-device copy per shape and key
                        format (the default kernel family)
  prefill.png           attention over many new tokens, % of a dense bf16 GEMM per shape
  write_path.png        the write-path kernels (append, dequantize, materialize, linear,
                        whole-cache quantize), % of copy
  decode_step.png       one captured 32-layer decode step: its append and its read
                        (attention from the cache, or materialize to FP8) per batch and
                        key format
A bench missing from the run leaves its picture out (said on stderr).

Needs matplotlib (a docs-only dependency: scripts/plot_results.sh installs it).
"""

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_RUNS = os.path.join(HERE, "..", "bench", "runs")
DEFAULT_OUT = os.path.join(HERE, "..", "docs", "img")

NVFP4_COLOR = "#3b6ea8"
K8V4_COLOR = "#d9822b"


def clean(name):
    for tail in ("/manual_time", "/real_time"):
        name = name.replace(tail, "")
    return re.sub(r"/iterations:\d+", "", name)


def load_bench(run_dir, bench):
    path = os.path.join(run_dir, bench + ".json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return {clean(b["name"]): b for b in data.get("benchmarks", []) if not b.get("error_occurred")}


def gpu_runs(runs_dir):
    """Saved GPU runs, newest first (ids begin with the date)."""
    ids = [d for d in os.listdir(runs_dir)
           if os.path.isfile(os.path.join(runs_dir, d, "run.json")) and "-cpu-" not in d]
    return sorted(ids, reverse=True)


def header(run_dir, run_id):
    with open(os.path.join(run_dir, "run.json"), encoding="utf-8") as f:
        run = json.load(f)
    gpu = run.get("gpu", {}).get("name", "?")
    commit = run.get("build", {}).get("commit", "?")
    return f"run {run_id} · {gpu} · commit {commit}"


def save(fig, out_dir, name, title, caption, run_id):
    """Title, then the run line (run id, GPU, commit) and the wrapped caption below."""
    import textwrap
    run_line, _, rest = caption.partition(". ")
    fig.suptitle(f"{title}\n{run_line}", fontsize=10, fontweight="bold")
    text = "\n".join(textwrap.wrap(rest, 120))
    fig.text(0.5, 0.01, text, ha="center", va="bottom", fontsize=7.5, color="#444")
    fig.tight_layout(rect=(0, 0.03 + 0.025 * text.count("\n"), 1, 0.93))
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110, metadata={"Title": f"{title}; {run_line}",
                                         "Source": f"bench/runs/{run_id}",
                                         "Software": "scripts/plot_results.py"})
    return path


def bars(ax, labels, series, ylabel, ref=None):
    """Grouped bars: series = [(name, values, color)]; values may hold None."""
    n = len(series)
    width = 0.8 / n
    for i, (name, values, color) in enumerate(series):
        xs = [x + (i - (n - 1) / 2) * width for x in range(len(labels))]
        ys = [v if v is not None else 0 for v in values]
        rects = ax.bar(xs, ys, width, label=name, color=color)
        for r, v in zip(rects, values):
            if v is not None:
                ax.annotate(f"{v:.0f}", (r.get_x() + r.get_width() / 2, r.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(ylabel)
    if ref is not None:
        ax.axhline(ref, color="#888", linestyle="--", linewidth=0.8)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=n, frameon=False)
    ax.grid(axis="y", alpha=0.3)


def decode_attention(plt, run_dir, out_dir, run_id, title_tail):
    b = load_bench(run_dir, "attention_bench")
    if b is None:
        return None
    shapes = [((64, 4096, 1, 4, 128), "64 x 4096"), ((256, 2048, 1, 4, 128), "256 x 2048"),
              ((8, 16384, 1, 4, 128), "8 x 16384"), ((128, 512, 1, 4, 128), "128 x 512"),
              ((1, 32768, 1, 4, 128), "1 x 32768"), ((64, 4096, 4, 4, 128), "64 x 4096\nq_len 4"),
              ((64, 4096, 1, 4, 64), "64 x 4096\nd64")]

    def pct(shape, fp8):
        bt, ln, q, g, d = shape
        case = (f"BM_DecodeAttention/batch:{bt}/seq_len:{ln}/q_len:{q}/fp8_keys:{fp8}/group:{g}"
                f"/head_dim:{d}/family:0")
        return b[case]["pct_of_copy"] if case in b else None

    fig, ax = plt.subplots(figsize=(9, 4.2))
    bars(ax, [s[1] for s in shapes],
         [("NVFP4 keys", [pct(s[0], 0) for s in shapes], NVFP4_COLOR),
          ("K8V4 (FP8 keys)", [pct(s[0], 1) for s in shapes], K8V4_COLOR)],
         "% of a device-to-device copy", ref=100)
    ax.set_ylim(0, 110)
    return save(fig, out_dir, "decode_attention.png", "Decode attention from the cache's pages",
                f"{title_tail}. 32 query / 8 KV heads, page 16, bf16 q/out, default kernel family; "
                "bytes: the attended tokens' cache bytes + q + out", run_id)


def prefill(plt, run_dir, out_dir, run_id, title_tail):
    b = load_bench(run_dir, "attention_bench")
    if b is None:
        return None
    shapes = [((4, 8192, 0), "prefill\n4 x 8192"), ((8, 2048, 6144), "extend\n8 x 2048 over 6144"),
              ((1, 8192, 24576), "chunked\n1 x 8192 over 24576"),
              ((2, 2048, 4096), "2 x 2048\nover 4096")]

    def frac(shape, fp8):
        bt, n, c = shape
        case = (f"BM_PrefillAttention/batch:{bt}/new:{n}/cached:{c}/decode_rows:0/decode_cached:0"
                f"/fp8_keys:{fp8}")
        return 100 * b[case]["fraction_of_gemm"] if case in b else None

    gemm = b.get("BM_DenseGemmBf16", {}).get("TFLOPs")
    fig, ax = plt.subplots(figsize=(8, 4.2))
    bars(ax, [s[1] for s in shapes],
         [("NVFP4 keys", [frac(s[0], 0) for s in shapes], NVFP4_COLOR),
          ("K8V4 (FP8 keys)", [frac(s[0], 1) for s in shapes], K8V4_COLOR)],
         "% of a dense bf16 GEMM's FLOP rate", ref=100)
    ax.set_ylim(0, 110)
    gemm_text = f"GEMM 8192^3 in the same process: {gemm:.0f} TFLOP/s" if gemm else "no GEMM"
    return save(fig, out_dir, "prefill.png", "Attention over many new tokens (causal)",
                f"{title_tail}. 32 / 8 heads, d128; FLOPs per attended pair; {gemm_text}", run_id)


def write_path(plt, run_dir, out_dir, run_id, title_tail):
    b = load_bench(run_dir, "kernels_bench")
    if b is None:
        return None
    rows = [
        ("append prefill, NVFP4", "BM_Append/rows:65536/hnd:0/recipe:0/paged:0/scattered:0/k8:0"),
        ("append prefill, K8V4", "BM_Append/rows:65536/hnd:0/recipe:0/paged:0/scattered:0/k8:1"),
        ("append prefill, paged", "BM_Append/rows:65536/hnd:0/recipe:0/paged:1/scattered:0/k8:0"),
        ("append, 4over6 MAE", "BM_Append/rows:65536/hnd:0/recipe:1/paged:0/scattered:0/k8:0"),
        ("dequantize 16 x 4096", "BM_Dequantize/batch:16/len:4096/k8:0"),
        ("dequantize 128 x 1024", "BM_Dequantize/batch:128/len:1024/k8:0"),
        ("materialize FP8 16 x 4096", "BM_Materialize/batch:16/len:4096/k8:0"),
        ("materialize FP8 256 x 2048", "BM_Materialize/batch:256/len:2048/k8:0"),
        ("linear quantize", "BM_Linear/rows:524288/cols:128/dequant:0"),
        ("linear dequantize", "BM_Linear/rows:524288/cols:128/dequant:1"),
        ("quantize whole cache", "BM_QuantizePagedCache/hnd:0/compute:0/lists:0"),
    ]
    rows = [(label, b[case]) for label, case in rows if case in b]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    labels = [r[0] for r in rows][::-1]
    eager = [r[1].get("pct_of_copy", 0) for r in rows][::-1]
    gpu = [r[1].get("gpu_pct_of_copy") for r in rows][::-1]
    ys = range(len(labels))
    ax.barh([y + 0.2 for y in ys], eager, 0.4, color=NVFP4_COLOR, label="one Run() (eager)")
    ax.barh([y - 0.2 for y in ys], [g or 0 for g in gpu], 0.4, color="#7fa7d6",
            label="GPU-only time")
    for y, v in zip(ys, eager):
        ax.annotate(f"{v:.0f}", (v, y + 0.2), va="center", fontsize=7, xytext=(2, 0),
                    textcoords="offset points")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("% of a device-to-device copy")
    ax.axvline(100, color="#888", linestyle="--", linewidth=0.8)
    ax.set_xlim(0, 110)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return save(fig, out_dir, "write_path.png", "Write-path kernels",
                f"{title_tail}. 8 KV heads, d128, page 16, bf16; inputs past L2", run_id)


def decode_step(plt, run_dir, out_dir, run_id, title_tail):
    b = load_bench(run_dir, "kv_cache_bench")
    if b is None:
        return None
    groups = []
    for seqs in (64, 256):
        for k8, name in ((0, "NVFP4"), (1, "K8V4")):
            for attention, what in ((1, "attention"), (0, "materialize FP8")):
                case = f"BM_DecodeStepGraph/seqs:{seqs}/attention:{attention}/k8:{k8}"
                if case in b:
                    groups.append((f"{seqs} seqs\n{name}\n{what}", b[case]))
    if not groups:
        return None
    split = all("append_sum_us" in g[1] and "read_sum_us" in g[1] for g in groups)
    fig, ax = plt.subplots(figsize=(9, 4.4))
    xs = range(len(groups))
    if split:
        append = [g[1]["append_sum_us"] / 1e3 for g in groups]
        read = [g[1]["read_sum_us"] / 1e3 for g in groups]
        ax.bar(xs, append, 0.6, color="#6a9f58", label="append (32 layers, kernels one by one)")
        ax.bar(xs, read, 0.6, bottom=append, color=NVFP4_COLOR,
               label="read: attention or materialize (32 layers)")
    graph = [g[1]["graph_us"] / 1e3 for g in groups]
    if split:
        ax.scatter(xs, graph, color="black", marker="_", s=300, zorder=3,
                   label="the step as one graph replay")
    else:
        ax.bar(xs, graph, 0.6, color=NVFP4_COLOR, label="the step as one graph replay "
               "(append + read; this run has no split)")
    for x, v in zip(xs, graph):
        ax.annotate(f"{v:.1f}", (x, v), ha="center", va="bottom", fontsize=7,
                    xytext=(0, 3), textcoords="offset points")
    ax.set_ylim(0, 1.12 * max(graph))
    ax.set_xticks(list(xs))
    ax.set_xticklabels([g[0] for g in groups], fontsize=7)
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return save(fig, out_dir, "decode_step.png", "One decode step of a 32-layer model",
                f"{title_tail}. 8 KV heads, d128, page 16, contexts 2k-8k, 1 new token a "
                "sequence; materialize leaves the FP8 attention still to run", run_id)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run")
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_results: matplotlib is missing (bash scripts/plot_results.sh installs it)",
              file=sys.stderr)
        return 2
    if args.run:
        if not os.path.isfile(os.path.join(args.runs, args.run, "run.json")):
            print(f"plot_results: no run {args.run} under {args.runs}", file=sys.stderr)
            return 1
        candidates = [args.run]
    else:
        candidates = gpu_runs(args.runs)
        if not candidates:
            print(f"plot_results: no GPU run under {args.runs}", file=sys.stderr)
            return 1
    os.makedirs(args.out, exist_ok=True)
    made = 0
    for draw in (decode_attention, prefill, write_path, decode_step):
        # Each picture from the newest run that has its bench (a run may hold only
        # some benches); the picture names the run it was drawn from.
        path = None
        for run_id in candidates:
            run_dir = os.path.join(args.runs, run_id)
            path = draw(plt, run_dir, args.out, run_id, header(run_dir, run_id))
            plt.close("all")
            if path is not None:
                break
        if path is None:
            print(f"plot_results: {draw.__name__}: no run has its bench", file=sys.stderr)
        else:
            print(path)
            made += 1
    return 0 if made else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
