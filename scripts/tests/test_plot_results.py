"""scripts/plot_results.py draws every picture from a saved run on the CPU machine."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(HERE, ".."))
import check_results  # noqa: E402

matplotlib = pytest.importorskip("matplotlib", reason="matplotlib: bash scripts/plot_results.sh "
                                 "installs it (scripts/test.sh does)")


def test_draws_every_picture_of_the_saved_run(tmp_path):
    runs = os.path.join(ROOT, "bench", "runs")
    gpu_runs = sorted(d for d in os.listdir(runs) if "-cpu-" not in d
                      and os.path.isfile(os.path.join(runs, d, "run.json")))
    assert gpu_runs, "no saved GPU run"
    out = subprocess.run([sys.executable, os.path.join(HERE, "..", "plot_results.py"),
                          "--out", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    names = sorted(os.listdir(tmp_path))
    assert names == ["decode_attention.png", "decode_step.png", "prefill.png", "write_path.png"]
    for n in names:
        fields = check_results.png_text(str(tmp_path / n))
        source = fields["Source"]
        assert source.startswith("bench/runs/") and source[len("bench/runs/"):] in gpu_runs, n
        assert source[len("bench/runs/"):] in fields["Title"], n
        assert os.path.getsize(tmp_path / n) > 10000, n


def test_a_missing_run_is_an_error(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(HERE, "..", "plot_results.py"),
                          "--run", "2025-01-01-h200-0000000", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert "no run 2025-01-01-h200-0000000" in out.stderr


def test_decode_step_split_when_the_run_has_it(tmp_path):
    """A run whose BM_DecodeStepGraph cases carry append_sum_us / read_sum_us gets the
    step drawn as append + read (runs before those counters get the totals)."""
    import json
    run = tmp_path / "runs" / "2030-01-01-h100-abcdef0"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"id": run.name, "gpu": {"name": "NVIDIA H100"},
                                              "build": {"commit": "abcdef0"}}))
    cases = []
    for seqs in (64, 256):
        for k8 in (0, 1):
            for attention in (0, 1):
                read = (2.0 if attention else 6.0) * seqs * (1.2 if k8 else 1.0)
                cases.append({"name": f"BM_DecodeStepGraph/seqs:{seqs}/attention:{attention}/k8:{k8}"
                                      "/iterations:1/manual_time",
                              "graph_us": 1000 * (read + 0.2), "append_sum_us": 200.0,
                              "read_sum_us": 1000 * read})
    (run / "kv_cache_bench.json").write_text(json.dumps({"benchmarks": cases}))
    out = subprocess.run([sys.executable, os.path.join(HERE, "..", "plot_results.py"),
                          "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "img")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # Only the step's bench is in this run: the other pictures are left out, and said so.
    assert sorted(os.listdir(tmp_path / "img")) == ["decode_step.png"]
    assert "decode_attention: no run has its bench" in out.stderr
    fields = check_results.png_text(str(tmp_path / "img" / "decode_step.png"))
    assert fields["Source"] == f"bench/runs/{run.name}"
