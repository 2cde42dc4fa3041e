"""examples/python/generate.py needs torch, a GPU and the model package to run;
here it must import (its top level needs numpy only) and hold together."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generate_imports_and_builds_prompts():
    g = load(ROOT / "examples" / "python" / "generate.py")
    for name in ("find_gguf", "load_gguf", "make_tokenizer", "Llama", "TorchCache",
                 "Fp4kvCache", "prefill", "perplexity", "generate", "main"):
        assert callable(getattr(g, name)), name
    p = g.chat_prompt("Why?")
    assert p.startswith("<|im_start|>system\n") and p.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhy?<|im_end|>" in p
    assert len(g.PPL_TEXT.split()) > 150
