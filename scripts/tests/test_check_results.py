"""Tests of scripts/check_results.py: the docs check passes on numbers that match
their saved run and fails on every kind of mismatch."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "check_results.py")
sys.path.insert(0, os.path.join(HERE, ".."))
import check_results  # noqa: E402

RUN = "2026-01-01-h100-abcdef0"


@pytest.fixture
def runs(tmp_path):
    run = tmp_path / RUN
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"commit": "abcdef0", "gpu": "NVIDIA H100"}))
    bench = {
        "context": {"date": "2026-01-01"},
        "benchmarks": [
            {"name": "BM_A/batch:64/manual_time", "run_type": "iteration", "median_us": 122.24,
             "pct_of_copy": 58.31, "GBps": 2480.0, "real_time": 122.2, "time_unit": "us"},
            {"name": "BM_B/batch:8/iterations:1/manual_time", "run_type": "iteration",
             "median_us": 6605.4, "pct_of_copy": 49.26, "GBps": 240439.0},
        ],
    }
    (run / "attention_bench.json").write_text(json.dumps(bench))
    (run / "tests.json").write_text(json.dumps({"gpu_attention_test": {"passed": 169, "failed": 0,
                                                                       "skipped": 0}}))
    return tmp_path


def check(runs, text):
    problems, checked = check_results.check_text("doc.md", text, check_results.Runs(str(runs)))
    return [str(p) for p in problems], checked


HEAD = f"<!-- runs: A={RUN} -->\nNumbers from run `{RUN}`.\n"
REF_A = "<!--@ A attention_bench BM_A/batch:64 median_us -->"
PCT_A = "<!--@ A attention_bench BM_A/batch:64 pct_of_copy -->"
REF_B = "<!--@ A attention_bench BM_B/batch:8 median_us -->"


def test_matching_numbers_pass(runs):
    text = HEAD + (
        f"Decode takes 122.2 us{REF_A} (58.3%{PCT_A}).\n"
        f"| case | time |\n| --- | ---: |\n| a | 122.24{REF_A} |\n"
        f"The step takes 6.605 ms{REF_B}, 6.6 ms{REF_B} rounded, 7 ms{REF_B} as an integer.\n"
        "Range 49.3<!--@ A attention_bench BM_B/batch:8 pct_of_copy -->-58.3%" + PCT_A + ".\n"
        "Ratio 54.04x<!--@ A attention_bench BM_B/batch:8 median_us / "
        "A attention_bench BM_A/batch:64 median_us -->.\n"
        "Integers with separators: 240,439 GB/s<!--@ A attention_bench BM_B/batch:8 GBps -->.\n"
        "169<!--@ A tests gpu_attention_test passed --> tests passed.\n"
        "A floor of ≥ 72% and a target 80% are not measurements; 4.5 bits, 3.56x<!--spec-->.\n"
        "Shapes 64 x 4096 are no ratio; code `12.5 us` is not checked.\n")
    problems, checked = check(runs, text)
    assert problems == []
    assert checked == 11


@pytest.mark.parametrize("bad,why", [
    (f"Decode takes 122.3 us{REF_A}.", "the run says 122.24"),
    ("Share 0.97<!--@ A attention_bench BM_A/batch:64 median_us / ( A attention_bench "
     "BM_A/batch:64 median_us + 2.5 ) -->.", "the run says 0.979958"),
    ("Bad 1.0<!--@ A attention_bench BM_A/batch:64 median_us ) -->.", "not an expression"),
    (f"Decode takes 123 us{REF_A}.", "the run says 122.24"),
    (f"The step takes 6.62 ms{REF_B}.", "the run says 6.6054"),
    (f"Range 49.3-58.3%{PCT_A}.", "no reference"),
    ("Decode takes 122.2 us.", "no reference"),
    ("| a | 122.2 |", "no reference"),
    ("Decode is 2.65x faster.", "no reference"),
    ("<!--@ A attention_bench BM_A/batch:64 median_us --> alone", "follows no number"),
    ("Decode 122.2 us<!--@ B attention_bench BM_A/batch:64 median_us -->.", "not declared"),
    ("Decode 122.2 us<!--@ A attention_bench BM_C median_us -->.", "no case BM_C"),
    ("Decode 122.2 us<!--@ A attention_bench BM_A/batch:64 p99_us -->.", "no counter p99_us"),
    ("Decode 122.2 us<!--@ A kernels_bench BM_A/batch:64 median_us -->.", "no kernels_bench.json"),
    ("Decode 122.2 us<!--@ A attention_bench BM_A/batch:64 -->.", "ALIAS FILE SELECTOR KEY"),
    ("169<!--@ A tests gpu_attention_test failed --> tests.", "the run says 0"),
])
def test_every_mismatch_fails(runs, bad, why):
    problems, _ = check(runs, HEAD + bad + "\n")
    assert len(problems) == 1, problems
    assert why in problems[0]


def test_runs_must_exist_and_be_named(runs):
    problems, _ = check(runs, "<!-- runs: A=2026-02-02-h200-0000000 -->\nno number\n")
    assert any("is not saved" in p for p in problems)
    assert any("never named" in p for p in problems)


def test_spec_regions_and_code_fences_are_not_checked(runs):
    text = HEAD + "<!-- spec -->\nThe floor is 72% and 1.5 us.\n<!-- /spec -->\n```\n12.5 us\n```\n"
    assert check(runs, text)[0] == []
    assert check(runs, HEAD + "after the region 1.5 us\n")[0] != []


def test_command_line_fails_on_a_changed_number(runs, tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(HEAD + f"Decode takes 122.2 us{REF_A}.\n")
    ok = subprocess.run([sys.executable, SCRIPT, "check", "--runs", str(runs), str(doc)],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    doc.write_text(HEAD + f"Decode takes 121.2 us{REF_A}.\n")
    bad = subprocess.run([sys.executable, SCRIPT, "check", "--runs", str(runs), str(doc)],
                         capture_output=True, text=True)
    assert bad.returncode == 1
    assert "121.2 us" in bad.stdout


def test_value_and_tables(runs):
    out = subprocess.run([sys.executable, SCRIPT, "value", "--runs", str(runs), RUN,
                          "attention_bench", "BM_A/batch:64", "pct_of_copy", "--decimals", "1"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "58.3"
    tables = subprocess.run([sys.executable, SCRIPT, str(runs / RUN / "attention_bench.json")],
                            capture_output=True, text=True, check=True)
    assert "| BM_A/batch:64 | 122.2 us | 58.31 |" in tables.stdout


def test_repository_docs_pass():
    """README.md and bench/RESULTS.md against bench/runs (what CI runs)."""
    root = os.path.join(HERE, "..", "..")
    docs = [os.path.join(root, "README.md"), os.path.join(root, "bench", "RESULTS.md")]
    problems, checked = check_results.check_files(docs, os.path.join(root, "bench", "runs"))
    assert [str(p) for p in problems] == []
    assert checked > 0


def test_fill_writes_numbers_the_check_accepts(runs):
    text = HEAD + ("Decode {{A attention_bench BM_A/batch:64 median_us|.1f us}}, "
                   "{{A attention_bench BM_A/batch:64 pct_of_copy|.1f %}} of copy; the step "
                   "{{A attention_bench BM_B/batch:8 median_us|.2f ms}}, ratio "
                   "{{A attention_bench BM_B/batch:8 median_us / A attention_bench BM_A/batch:64 median_us|.1f x}}.\n")
    filled = check_results.fill_text(text, check_results.Runs(str(runs)))
    assert "122.2 us<!--@" in filled and "58.3%<!--@" in filled and "6.61 ms<!--@" in filled
    assert "54.0x<!--@" in filled
    problems, checked = check(runs, filled)
    assert problems == [] and checked == 4


def _png(path, fields):
    """A 1x1 PNG with the given tEXt fields (no matplotlib needed)."""
    import struct
    import zlib

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff))
    body = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
    for k, v in fields.items():
        body += chunk(b"tEXt", k.encode("latin-1") + b"\0" + v.encode("latin-1"))
    body += chunk(b"IDAT", zlib.compress(b"\0\0")) + chunk(b"IEND", b"")
    path.write_bytes(body)


def test_pictures_must_name_a_saved_run(runs, tmp_path):
    store = check_results.Runs(str(runs))
    doc = tmp_path / "doc.md"
    _png(tmp_path / "good.png", {"Source": f"bench/runs/{RUN}"})
    _png(tmp_path / "stale.png", {"Source": "bench/runs/2025-01-01-h200-0000000"})
    _png(tmp_path / "bare.png", {})
    text = "![a](good.png)\n![b](stale.png)\n![c](bare.png)\n![d](missing.png)\n"
    problems = [str(p) for p in check_results.check_images(str(doc), text, store)]
    assert len(problems) == 3, problems
    assert "stale.png" in problems[0] and "names no saved run" in problems[0]
    assert "bare.png" in problems[1]
    assert "missing.png" in problems[2] and "does not exist" in problems[2]
