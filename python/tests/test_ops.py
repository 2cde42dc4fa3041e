"""The functional ops on caller-owned numpy pools, against the numpy model."""

import numpy as np
import pytest

import fp4kv
import nvfp4_ref as ref
from conftest import halves

H, D, S, P = 2, 64, 16, 12


def pools(layout=fp4kv.Layout.NHD):
    shape = (P, S, H) if layout == fp4kv.Layout.NHD else (P, H, S)
    return fp4kv.PagedCache(
        np.zeros(shape + (D // 2,), np.uint8),
        np.zeros(shape + (D // 2,), np.uint8),
        np.zeros(shape + (D // 16,), np.uint8),
        np.zeros(shape + (D // 16,), np.uint8),
        layout,
    )


def row_of(cache, page, entry):
    """K/V data and scales of (page, entry) as [H, ...] arrays."""
    out = []
    for a in (cache.k_data, cache.v_data, cache.k_scales, cache.v_scales):
        out.append(a[page, entry] if cache.layout == fp4kv.Layout.NHD else a[page, :, entry])
    return out


@pytest.mark.parametrize("layout", [fp4kv.Layout.NHD, fp4kv.Layout.HND])
def test_append_by_slot_matches_reference(rng, layout):
    n = 37
    k, v = halves(rng, n, H, D), halves(rng, n, H, D, scale=3.0)
    slots = rng.permutation(P * S)[:n].astype(np.int64)
    slots[4] = -1  # padding: skipped
    cache = pools(layout)
    gk, gv = 0.002, 0.007
    fp4kv.quantize_append_by_slot(k, v, slots, cache, gk, gv)
    kp, ks = ref.quantize_rows(k.reshape(n * H, D).astype(np.float32), gk)
    vp, vs = ref.quantize_rows(v.reshape(n * H, D).astype(np.float32), gv)
    written = 0
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        kd, vd, ksc, vsc = row_of(cache, slot // S, slot % S)
        np.testing.assert_array_equal(kd, kp[i * H:(i + 1) * H])
        np.testing.assert_array_equal(vd, vp[i * H:(i + 1) * H])
        np.testing.assert_array_equal(ksc, ks[i * H:(i + 1) * H])
        np.testing.assert_array_equal(vsc, vs[i * H:(i + 1) * H])
        written += 1
    assert written == n - 1
    # Nothing but the given slots was written.
    total = sum(int(np.count_nonzero(a)) for a in (cache.k_scales, cache.v_scales))
    assert total <= 2 * written * H * D // 16


def test_appender_paged_equals_by_slot(rng):
    # Request 0: pages [3, 7], request 1: pages [1]; rows at positions 0.. of each.
    k, v = halves(rng, 20, H, D), halves(rng, 20, H, D)
    batch = np.array([0] * 17 + [1] * 3, np.int32)
    pos = np.array(list(range(17)) + list(range(3)), np.int32)
    kv_indices = np.array([3, 7, 1], np.int32)
    kv_indptr = np.array([0, 2, 3], np.int32)
    last = np.array([1, 3], np.int32)
    a = pools()
    app = fp4kv.Appender(fp4kv.CacheGeometry(H, D, D, S, P), input_dtype=fp4kv.DType.f16)
    app.run(a, k, v, batch_indices=batch, positions=pos, kv_indices=kv_indices,
            kv_indptr=kv_indptr, kv_last_page_len=last, k_scale=0.01, v_scale=0.02)
    slots = np.array([3 * S + p for p in range(16)] + [7 * S] + [1 * S + p for p in range(3)], np.int64)
    b = pools()
    fp4kv.quantize_append_by_slot(k, v, slots, b, 0.01, 0.02)
    for x, y in zip((a.k_data, a.v_data, a.k_scales, a.v_scales), (b.k_data, b.v_data, b.k_scales, b.v_scales)):
        np.testing.assert_array_equal(x, y)


def test_dequantize_paged_round_trip(rng):
    n = 40
    k, v = halves(rng, n, H, D), halves(rng, n, H, D)
    cache = pools()
    slots = np.arange(2 * S, 2 * S + n, dtype=np.int64)  # pages 2, 3, 4
    fp4kv.quantize_append_by_slot(k, v, slots, cache, 0.003, 0.004)
    tables = np.array([[2, 3, 4]], np.int32)
    lens = np.array([n], np.int32)
    k_out = np.full((1, 48, H, D), 7, np.float16)
    v_out = np.full((1, 48, H, D), 7, np.float16)
    deq = fp4kv.Dequantizer(fp4kv.CacheGeometry(H, D, D, S, P), output_dtype=fp4kv.DType.f16)
    deq.run(cache, tables, lens, k_out, v_out, k_scale=0.003, v_scale=0.004)
    kp, ks = ref.quantize_rows(k.reshape(-1, D).astype(np.float32), 0.003)
    want = ref.dequantize_rows(kp, ks, 0.003).astype(np.float16).reshape(n, H, D)
    np.testing.assert_array_equal(k_out[0, :n], want)
    assert (k_out[0, n:] == 7).all()  # past the length: unchanged
    # The functional form gives the same.
    k2, v2 = np.zeros_like(k_out), np.zeros_like(v_out)
    fp4kv.dequantize_paged(cache, tables, lens, k2, v2, 0.003, 0.004)
    np.testing.assert_array_equal(k2[0, :n], k_out[0, :n])
    np.testing.assert_array_equal(v2[0, :n], v_out[0, :n])


def test_paged_cache_quantizer_equals_append(rng):
    src_k, src_v = halves(rng, 4, S, H, D), halves(rng, 4, S, H, D)
    source = fp4kv.HalfPagedCache(src_k, src_v)
    a = pools()
    q = fp4kv.PagedCacheQuantizer(fp4kv.CacheGeometry(H, D, D, S, P), input_dtype=fp4kv.DType.f16)
    q.run(source, a, k_scale=0.01, v_scale=0.02)
    b = pools()
    fp4kv.quantize_append_by_slot(src_k.reshape(-1, H, D), src_v.reshape(-1, H, D),
                                  np.arange(4 * S, dtype=np.int64), b, 0.01, 0.02)
    np.testing.assert_array_equal(a.k_data, b.k_data)
    np.testing.assert_array_equal(a.v_scales, b.v_scales)
    # Scales computed from the data: MakeGlobalScale(amax) written into the given floats.
    c = pools()
    ks, vs = np.zeros(1, np.float32), np.zeros(1, np.float32)
    fp4kv.quantize_paged_cache(source, c, k_scale_out=ks, v_scale_out=vs)
    assert ks[0] == fp4kv.make_global_scale(float(np.abs(src_k).max()))
    assert vs[0] == fp4kv.make_global_scale(float(np.abs(src_v).max()))


def test_materialize_fp8(rng):
    n = 20
    k, v = halves(rng, n, H, D), halves(rng, n, H, D)
    cache = pools()
    fp4kv.quantize_append_by_slot(k, v, np.arange(5 * S, 5 * S + n, dtype=np.int64), cache, 0.01, 0.01)
    fp8 = fp4kv.min_fp8_scale(0.01)
    out = np.full((4, 2, H, S, D), 0xAA, np.uint8)
    fp8_tables = np.full((1, 2), -5, np.int32)
    fp4kv.materialize_fp8(cache, np.array([[5, 6]], np.int32), np.array([n], np.int32),
                          np.array([0, 2], np.int32), out, fp8_tables, 0.01, 0.01, fp8, fp8)
    np.testing.assert_array_equal(fp8_tables, [[1, 2]])
    assert (out[0] == 0).all()  # out page 0 is zeroed
    kp, ks = ref.quantize_rows(k.reshape(-1, D).astype(np.float32), 0.01)
    mult = np.float32(0.01) / np.float32(fp8)
    tile = ref.block_values(kp, ks).astype(np.float32).reshape(n, H, D)
    want = ref.e4m3_encode(tile * mult)  # [n, H, D]
    got = np.concatenate([out[1, 0], out[2, 0]], axis=1)  # [H, 2S, D]
    np.testing.assert_array_equal(got[:, :n].transpose(1, 0, 2), want)
    assert (got[:, n:] == 0).all()  # past the length in the last page: zero


@pytest.mark.parametrize("qlen", [1, 5])
def test_decode_attention_matches_fp64(rng, qlen):
    lens = [33, 7, 16]
    hq = 4
    tables = np.array([[0, 1, 2], [3, -1, -1], [4, 5, -1]], np.int32)
    cache = pools()
    gk, gv = 0.004, 0.006
    kvs = []
    for b, n in enumerate(lens):
        k, v = halves(rng, n, H, D), halves(rng, n, H, D)
        slots = np.array([tables[b, t // S] * S + t % S for t in range(n)], np.int64)
        fp4kv.quantize_append_by_slot(k, v, slots, cache, gk, gv)
        kp, ks = ref.quantize_rows(k.reshape(-1, D).astype(np.float32), gk)
        vp, vs = ref.quantize_rows(v.reshape(-1, D).astype(np.float32), gv)
        kvs.append((ref.block_values(kp, ks).reshape(n, H, D), ref.block_values(vp, vs).reshape(n, H, D)))
    q = halves(rng, qlen * len(lens), hq, D)
    out = np.zeros((qlen * len(lens), hq, D), np.float16)
    att = fp4kv.DecodeAttention(fp4kv.CacheGeometry(H, D, D, S, P), num_qo_heads=hq,
                                dtype=fp4kv.DType.f16, max_batch=3, max_pages_per_seq=3,
                                max_q_len=qlen)
    q_indptr = np.arange(0, qlen * len(lens) + 1, qlen, dtype=np.int32) if qlen > 1 else None
    att.run(cache, q, tables, np.array(lens, np.int32), out, q_indptr=q_indptr,
            k_scale=gk, v_scale=gv)
    for b, n in enumerate(lens):
        rows = slice(b * qlen, (b + 1) * qlen)
        want, mag = ref.attention_ref(q[rows], kvs[b][0], kvs[b][1], gk, gv, 0.125,
                                      [n - qlen + i for i in range(qlen)])
        ref.assert_attention_close(out[rows], want, mag)
