"""Views and ops keep their cache alive; nothing a script does with them crashes."""

import gc
import subprocess
import sys
import textwrap
import weakref

import numpy as np

import fp4kv
from conftest import halves, make_cache


def test_view_outlives_cache(rng):
    c = make_cache(num_layers=1, k_global_scales=[0.01], v_global_scales=[0.01])
    s = c.create_sequence()
    c.prepare_step([(s, 4)])
    c.appender(fp4kv.DType.f16).run(0, halves(rng, 4, 2, 64), halves(rng, 4, 2, 64))
    view = c.layer_cache(0).k_data
    slots = c.step_views()["slot_mapping"]
    ref = weakref.ref(c)
    snapshot = np.from_dlpack(view).copy()
    del c
    gc.collect()
    assert ref() is not None  # kept alive by the views
    np.testing.assert_array_equal(np.from_dlpack(view), snapshot)
    assert list(np.from_dlpack(slots)[:4]) == [0, 1, 2, 3]
    del view, slots
    gc.collect()
    assert ref() is None  # and freed once they are gone


def test_numpy_array_of_a_view_keeps_the_cache(rng):
    c = make_cache(num_layers=1)
    ref = weakref.ref(c)
    arr = np.from_dlpack(c.layer_cache(0).v_scales)
    del c
    gc.collect()
    assert ref() is not None
    assert arr.sum() == 0
    del arr
    gc.collect()
    assert ref() is None


def test_bound_ops_keep_the_cache(rng):
    c = make_cache(num_layers=1, k_global_scales=[0.01], v_global_scales=[0.01])
    s = c.create_sequence()
    c.prepare_step([(s, 2)])
    app = c.appender(fp4kv.DType.f16)
    att = c.attention(num_qo_heads=2, dtype=fp4kv.DType.f16)
    del c
    gc.collect()
    app.run(0, halves(rng, 2, 2, 64), halves(rng, 2, 2, 64))
    out = np.zeros((8, 2, 64), np.float16)
    att.run(0, halves(rng, 8, 2, 64), out)
    assert out[0].any() and not out[1:].any()


def test_paged_cache_keeps_its_arrays(rng):
    pc = fp4kv.PagedCache(np.zeros((2, 16, 1, 32), np.uint8), np.zeros((2, 16, 1, 32), np.uint8),
                          np.zeros((2, 16, 1, 4), np.uint8), np.zeros((2, 16, 1, 4), np.uint8))
    gc.collect()
    k = halves(rng, 1, 1, 64)
    fp4kv.quantize_append_by_slot(k, k, np.array([17], np.int64), pc, 0.01, 0.01)
    assert pc.k_data[1, 1].any()
    assert pc.geometry.num_pages == 2 and not pc.read_only


def test_interpreter_exit_with_live_views():
    # Views, ops and caches alive at exit, in cycles too: the process exits cleanly.
    code = textwrap.dedent("""
        import numpy as np, fp4kv
        o = fp4kv.KVCacheOptions()
        o.num_layers = 1
        o.geometry = fp4kv.CacheGeometry(num_kv_heads=1, head_dim_k=64, page_size=16, num_pages=4)
        o.max_seqs_per_step = 2
        o.max_tokens_per_step = 16
        c = fp4kv.KVCache(o)
        v = c.layer_cache(0)
        arr = np.from_dlpack(v.k_data)
        app = c.appender()
        cycle = [c, v]
        cycle.append(cycle)
        del c
        print("ok", arr.shape)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok (4, 16, 1, 32)"
