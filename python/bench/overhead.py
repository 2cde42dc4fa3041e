"""The cost of calling fp4kv from Python: an eager appender.run / attention.run
on the CPU device, the same calls and shapes as bench/binding_overhead_bench.cc
(1 new token; 1 query row, 4 qo heads over 2 KV heads, head_dim 64, a context
of 16 tokens; f16; given global scales). The op itself takes about a
microsecond, so Python's time minus the C++ benchmark's is the binding's cost.

    python python/bench/overhead.py [--calls N] [--repeats R]

Prints the median time per call over R repeats of N calls each.
"""

import argparse
import statistics
import time

import numpy as np

import fp4kv

H, HQ, D, CONTEXT = 2, 4, 64, 16


def make():
    o = fp4kv.KVCacheOptions()
    o.num_layers = 1
    o.geometry = fp4kv.CacheGeometry(num_kv_heads=H, head_dim_k=D, page_size=16, num_pages=64)
    o.k_global_scales = [0.01]
    o.v_global_scales = [0.01]
    o.max_seqs_per_step = 8
    o.max_tokens_per_step = 64
    cache = fp4kv.KVCache(o)
    seq = cache.create_sequence()
    cache.prepare_step([(seq, CONTEXT - 1)])
    cache.prepare_step([(seq, 1)])
    return cache


def median_ns(fn, calls, repeats):
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(per_call)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=31)
    args = ap.parse_args()

    cache = make()
    append = cache.appender(fp4kv.DType.f16)
    attend = cache.attention(num_qo_heads=HQ, dtype=fp4kv.DType.f16)
    k = np.full((1, H, D), 0.1, np.float16)
    v = np.full((1, H, D), 0.1, np.float16)
    q = np.full((8, HQ, D), 0.1, np.float16)
    out = np.zeros((8, HQ, D), np.float16)

    rows = [
        ("appender.run(layer, k, v)", lambda: append.run(0, k, v)),
        ("attention.run(layer, q, out)", lambda: attend.run(0, q, out)),
        ("attention.run(..., stream=0) (keywords)", lambda: attend.run(0, q, out, workspace=None, stream=0)),
        ("cache.step (a property: call floor)", lambda: cache.step),
    ]
    print(f"median of {args.repeats} x {args.calls} eager calls, CPU device")
    for name, fn in rows:
        fn()
        print(f"  {name:42s} {median_ns(fn, args.calls, args.repeats) / 1000:7.3f} us")


if __name__ == "__main__":
    main()
