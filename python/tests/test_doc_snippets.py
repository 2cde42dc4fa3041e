"""The Python snippets of README.md and docs/python.md run as written (those
that need torch and a GPU are skipped)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def snippets():
    out = []
    doc = (ROOT / "docs" / "python.md").read_text()
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc, re.S)):
        out.append(pytest.param(block, id=f"docs/python.md#{i}",
                                marks=[pytest.mark.skip("needs torch and a GPU")] if "torch" in block else []))
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"\n((?:    .*\n|\n)*?    import numpy as np, fp4kv\n(?:    .*\n|\n)*)", readme)
    assert m, "README.md: the Python example was not found"
    out.append(pytest.param("\n".join(l[4:] for l in m.group(1).splitlines()), id="README.md"))
    return out


@pytest.mark.parametrize("code", snippets())
def test_snippet_runs(code):
    exec(compile(code, "<snippet>", "exec"), {})
