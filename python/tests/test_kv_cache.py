"""KVCache from Python: steps, bound ops, prefix caching, export/import, swap."""

import numpy as np
import pytest

import fp4kv
import nvfp4_ref as ref
from conftest import halves, make_cache

H, D, S = 2, 64, 16


def pool_rows(cache, layer, slots):
    """K data / K scales / V data / V scales of the given slots ([n, H, ...])."""
    pc = cache.layer_cache(layer)
    arrs = [np.from_dlpack(a) for a in (pc.k_data, pc.k_scales, pc.v_data, pc.v_scales)]
    return [a.reshape(-1, *a.shape[2:])[slots] for a in arrs]


def test_append_writes_the_reference_bytes(rng):
    c = make_cache(k_global_scales=[0.01, 0.02], v_global_scales=[0.03, 0.04])
    a, b = c.create_sequence(), c.create_sequence()
    info = c.prepare_step([(a, 19), (b, 4)])
    assert (info.num_seqs, info.num_tokens, info.max_seq_len) == (2, 23, 19)
    assert c.host_token_indptr == [0, 19, 23]
    slots = np.array(c.host_slot_mapping, np.int64)
    app = c.appender(fp4kv.DType.f16)
    for layer, (gk, gv) in enumerate([(0.01, 0.03), (0.02, 0.04)]):
        k, v = halves(rng, 256, H, D), halves(rng, 256, H, D)  # capacity rows; past 23 ignored
        app.run(layer, k, v)
        kd, ks, vd, vs = pool_rows(c, layer, slots)
        wk, wks = ref.quantize_rows(k[:23].reshape(-1, D).astype(np.float32), gk)
        wv, wvs = ref.quantize_rows(v[:23].reshape(-1, D).astype(np.float32), gv)
        np.testing.assert_array_equal(kd.reshape(-1, D // 2), wk)
        np.testing.assert_array_equal(ks.reshape(-1, D // 16), wks)
        np.testing.assert_array_equal(vd.reshape(-1, D // 2), wv)
        np.testing.assert_array_equal(vs.reshape(-1, D // 16), wvs)
        # read_sequence dequantizes what was stored.
        k_out = np.zeros((19, H, D), np.float16)
        v_out = np.zeros((19, H, D), np.float16)
        c.read_sequence(layer, a, k_out, v_out)
        want = ref.dequantize_rows(wk, wks, gk).astype(np.float16).reshape(23, H, D)[:19]
        np.testing.assert_array_equal(k_out, want)
    c.check_invariants()


def test_first_append_calibrates(rng):
    c = make_cache(num_layers=1)
    s = c.create_sequence()
    assert not c.read_scales(0).k_calibrated
    c.prepare_step([(s, 8)])
    k, v = halves(rng, 8, H, D), halves(rng, 8, H, D)
    c.appender(fp4kv.DType.f16).run(0, k, v)
    sc = c.read_scales(0)
    assert sc.k_calibrated and sc.v_calibrated
    # headroom 4: g = MakeGlobalScale(4 * amax)
    assert sc.k == fp4kv.make_global_scale(4 * float(np.abs(k).max()))
    assert c.layer_tokens(0) == 8


def test_cache_attention_decode_and_prefill_match_fp64(rng):
    hq = 4
    c = make_cache(num_layers=1, k_global_scales=[0.005], v_global_scales=[0.006])
    app = c.appender(fp4kv.DType.f16)
    prefill = c.attention(num_qo_heads=hq, dtype=fp4kv.DType.f16, max_q_len=64)
    decode = c.attention(num_qo_heads=hq, dtype=fp4kv.DType.f16)
    assert prefill.workspace_bytes == 0  # CPU
    seqs = [c.create_sequence() for _ in range(3)]
    hist = {s: ([], []) for s in seqs}

    def step(entries, att, rows_per_entry):
        c.prepare_step(entries)
        n = sum(e[1] for e in entries)
        k, v = halves(rng, n, H, D), halves(rng, n, H, D)
        app.run(0, k, v)
        off = 0
        for s, cnt in entries:
            hist[s][0].append(k[off:off + cnt])
            hist[s][1].append(v[off:off + cnt])
            off += cnt
        nq = n if rows_per_entry is None else len(entries)
        q = halves(rng, nq, hq, D)
        out = np.zeros((8 if rows_per_entry else 256, hq, D), np.float16)
        qq = np.zeros((out.shape[0], hq, D), np.float16)
        qq[:nq] = q
        att.run(0, qq, out)
        off = 0
        for b, (s, cnt) in enumerate(entries):
            kk = np.concatenate(hist[s][0]).reshape(-1, D).astype(np.float32)
            vv = np.concatenate(hist[s][1]).reshape(-1, D).astype(np.float32)
            kp, ks = ref.quantize_rows(kk, 0.005)
            vp, vs = ref.quantize_rows(vv, 0.006)
            kq = ref.block_values(kp, ks).reshape(-1, H, D)
            vq = ref.block_values(vp, vs).reshape(-1, H, D)
            t = kq.shape[0]
            if rows_per_entry is None:
                rows, pos = slice(off, off + cnt), [t - cnt + i for i in range(cnt)]
                off += cnt
            else:
                rows, pos = slice(b, b + 1), [t - 1]
            want, mag = ref.attention_ref(qq[rows], kq, vq, 0.005, 0.006, 0.125, pos)
            ref.assert_attention_close(out[rows], want, mag)

    step([(seqs[0], 40), (seqs[1], 3), (seqs[2], 17)], prefill, None)  # prompts
    step([(seqs[0], 1), (seqs[1], 1), (seqs[2], 1)], decode, 1)         # decode rows
    step([(seqs[0], 1), (seqs[1], 21), (seqs[2], 2)], prefill, None)    # mixed


def test_fork_truncate_release_and_stats(rng):
    c = make_cache(num_layers=1, k_global_scales=[0.01], v_global_scales=[0.01],
                   max_tokens_per_step=1024)
    s = c.create_sequence()
    c.prepare_step([(s, 20)])
    c.appender(fp4kv.DType.f16).run(0, halves(rng, 20, H, D), halves(rng, 20, H, D))
    child = c.fork_sequence(s)
    assert c.sequence_length(child) == 20
    assert c.sequence_pages(child) == c.sequence_pages(s)
    st = c.stats()
    assert st.num_sequences == 2 and st.pages_shared == 2 and st.tokens_stored == 40
    assert st.bytes_per_token == 1 * H * (D + D) * 9 / 16
    info = c.prepare_step([(child, 1)])  # writes the shared partial page: copied
    assert info.pages_copied == 1
    c.truncate(s, 5)
    assert c.sequence_length(s) == 5
    c.release_sequence(child)
    assert dict(c.stats().sequence_lengths) == {s: 5}
    assert c.page_ref_count(c.sequence_pages(s)[0]) == 1
    t = c.create_sequence()
    plan = c.plan_step([(s, 500), (t, 100)])  # 32 + 7 pages of 32
    assert not plan.fits and plan.pages_needed == 31 + 7
    with pytest.raises(fp4kv.ResourceExhaustedError):
        c.prepare_step([(s, 500), (t, 100)])
    assert c.sequence_length(s) == 5  # all or nothing
    c.check_invariants()


def test_prefix_caching_and_events(rng):
    o = dict(num_layers=1, k_global_scales=[0.01], v_global_scales=[0.01])
    c = make_cache(**o)
    opts = c.options
    assert not opts.prefix_cache.enabled
    pc = fp4kv.PrefixCacheOptions()
    pc.enabled = True
    pc.max_pending_events = 64
    c = make_cache(prefix_cache=pc, **o)
    prompt = list(range(100, 140))  # 40 tokens: 2 full pages
    s = c.create_sequence()
    c.prepare_step([(s, 40, np.array(prompt, np.int32))])
    c.appender(fp4kv.DType.f16).run(0, halves(rng, 40, H, D), halves(rng, 40, H, D))
    m = c.match_prefix(prompt + [1, 2])
    assert (m.tokens, m.pages) == (32, 2)
    hit = c.create_sequence_from_prefix(prompt + [7])
    assert hit.cached_tokens == 32
    assert c.sequence_pages(hit.seq) == c.sequence_pages(s)[:2]
    batch = c.take_events()
    stored = [e for e in batch.events if e.type == fp4kv.KVEventType.block_stored]
    assert batch.dropped == 0 and len(stored) >= 1
    assert sum(len(e.block_hashes) for e in stored) == 2
    assert stored[0].token_ids == prompt[:32] and stored[0].block_size == S
    assert len(stored[0].block_hashes[0].hex()) == 32
    st = c.stats()
    assert st.prefix_queries == 1 and st.prefix_hit_tokens == 32
    c.reset_prefix_cache()
    assert any(e.type == fp4kv.KVEventType.all_blocks_cleared for e in c.take_events().events)


def test_export_import_round_trip(rng):
    o = dict(num_layers=2, k_global_scales=[0.01, 0.02], v_global_scales=[0.03, 0.04])
    src = make_cache(**o)
    s = src.create_sequence()
    src.prepare_step([(s, 27)])
    app = src.appender(fp4kv.DType.f16)
    for layer in range(2):
        app.run(layer, halves(rng, 27, H, D), halves(rng, 27, H, D))
    image = np.zeros(src.exported_bytes(s), np.uint8)
    src.export_sequence(s, image)
    header = fp4kv.parse_sequence_image_header(image)
    assert (header.length, header.num_layers, header.num_pages) == (27, 2, 2)
    assert header.geometry.head_dim_k == D

    dst = make_cache(**o)
    dst.create_sequence()  # so page ids differ
    dst.prepare_step([(dst.create_sequence(), 5)])
    t = dst.import_sequence(image)
    for layer in range(2):
        a = [np.zeros((27, H, D), np.float16) for _ in range(4)]
        src.read_sequence(layer, s, a[0], a[1])
        dst.read_sequence(layer, t, a[2], a[3])
        np.testing.assert_array_equal(a[0], a[2])
        np.testing.assert_array_equal(a[1], a[3])
    # Two-phase: reserve, then cancel.
    r = dst.reserve_import(header)
    assert r.id != 0 and dst.stats().reservations == 1
    dst.cancel_import(r)
    assert dst.stats().reservations == 0
    # Different scales are refused by default, re-encoded on request.
    other = make_cache(num_layers=2, k_global_scales=[0.5, 0.5], v_global_scales=[0.5, 0.5])
    with pytest.raises(fp4kv.FailedPreconditionError):
        other.import_sequence(image)
    assert other.sequence_length(other.import_sequence(image, fp4kv.StoredTokens.reencode)) == 27


def test_swap_out_and_in(rng):
    tier = fp4kv.HostTierOptions()
    tier.host_pages = 8
    c = make_cache(num_layers=1, host_tier=tier, k_global_scales=[0.01], v_global_scales=[0.01])
    s = c.create_sequence()
    c.prepare_step([(s, 30)])
    c.appender(fp4kv.DType.f16).run(0, halves(rng, 30, H, D), halves(rng, 30, H, D))
    before = [np.zeros((30, H, D), np.float16) for _ in range(2)]
    c.read_sequence(0, s, *before)
    c.swap_out(s)
    assert c.is_swapped_out(s)
    with pytest.raises(fp4kv.FailedPreconditionError, match="swapped out"):
        c.read_sequence(0, s, *before)
    c.synchronize_swaps()
    c.swap_in(s)
    after = [np.zeros((30, H, D), np.float16) for _ in range(2)]
    c.read_sequence(0, s, *after)
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])


def test_scale_change_under_tokens(rng):
    c = make_cache(num_layers=1, k_global_scales=[0.01], v_global_scales=[0.01])
    s = c.create_sequence()
    c.prepare_step([(s, 4)])
    c.appender(fp4kv.DType.f16).run(0, halves(rng, 4, H, D), halves(rng, 4, H, D))
    with pytest.raises(fp4kv.FailedPreconditionError, match="layer 0"):
        c.update_global_scales(0, 0.02, 0.02)
    assert c.read_scales(0).k == np.float32(0.01)
    c.update_global_scales(0, 0.02, 0.02, stored=fp4kv.StoredTokens.reencode)
    assert c.read_scales(0).k == np.float32(0.02)


def test_bound_dequantizer_and_materializer(rng):
    c = make_cache(num_layers=1, k_global_scales=[0.01], v_global_scales=[0.01])
    s = c.create_sequence()
    c.prepare_step([(s, 20)])
    c.appender(fp4kv.DType.f16).run(0, halves(rng, 20, H, D), halves(rng, 20, H, D))
    k1, v1 = np.zeros((1, 20, H, D), np.float16), np.zeros((1, 20, H, D), np.float16)
    c.dequantizer(fp4kv.DType.f16).run(0, k1, v1)
    k2, v2 = np.zeros((20, H, D), np.float16), np.zeros((20, H, D), np.float16)
    c.read_sequence(0, s, k2, v2)
    np.testing.assert_array_equal(k1[0], k2)
    out = np.zeros(c.fp8_workspace_shape(c.step.fp8_workspace_pages), np.uint8)
    c.materializer().run(0, out)
    fp8_tables = np.from_dlpack(c.step_views()["fp8_block_tables"])
    assert list(fp8_tables[0, :2]) == [1, 2]
    assert out[1].any() and not out[0].any()


def test_import_half_pages(rng):
    c = make_cache(num_layers=2, k_global_scales=[0.01, 0.02], v_global_scales=[0.03, 0.04])
    layers, src = [], []
    for _ in range(2):
        k, v = halves(rng, 3, S, H, D), halves(rng, 3, S, H, D)
        layers.append(fp4kv.HalfPagedCache(k, v))
        src.append((k, v))
    s = c.import_half_pages(layers, [2, 0], 20)  # tokens in source pages 2 then 0
    assert c.sequence_length(s) == 20
    for layer, (gk, _) in enumerate([(0.01, 0.03), (0.02, 0.04)]):
        k_out, v_out = np.zeros((20, H, D), np.float16), np.zeros((20, H, D), np.float16)
        c.read_sequence(layer, s, k_out, v_out)
        rows = np.concatenate([src[layer][0][2], src[layer][0][0]])[:20]
        kp, ks = ref.quantize_rows(rows.reshape(-1, D).astype(np.float32), gk)
        np.testing.assert_array_equal(k_out, ref.dequantize_rows(kp, ks, gk).astype(np.float16).reshape(20, H, D))


def test_late_token_ids_make_pages_shareable(rng):
    pc = fp4kv.PrefixCacheOptions()
    pc.enabled = True
    c = make_cache(num_layers=1, prefix_cache=pc, k_global_scales=[0.01], v_global_scales=[0.01])
    s = c.create_sequence()
    c.prepare_step([(s, 33)])  # ids not known yet
    c.appender(fp4kv.DType.f16).run(0, halves(rng, 33, H, D), halves(rng, 33, H, D))
    prompt = np.arange(500, 533, dtype=np.int32)
    assert c.match_prefix(prompt).tokens == 0
    c.set_token_ids(s, 0, prompt)
    assert c.match_prefix(prompt).tokens == 32
    with pytest.raises(fp4kv.InvalidArgumentError, match="ids"):
        c.set_token_ids(s, 0, [1, 2, 3])  # differs from the known ids


def test_calibrate_global_scales(rng):
    c = make_cache(num_layers=1)
    k, v = halves(rng, 40, H, D, scale=2.0), halves(rng, 40, H, D)
    cal = fp4kv.Calibrator(max_elements=k.size, dtype=fp4kv.DType.f16)
    c.calibrate_global_scales(0, k, v, cal)
    sc = c.read_scales(0)
    assert sc.k_calibrated and sc.k == fp4kv.make_global_scale(float(np.abs(k).max()))
    assert sc.v == fp4kv.make_global_scale(float(np.abs(v).max()))
    g, amax = np.zeros(1, np.float32), np.zeros(1, np.float32)
    cal.run(k, g, amax=amax)
    assert amax[0] == np.abs(k).max() and g[0] == sc.k


def test_two_step_slots(rng):
    c = make_cache(num_layers=1, step_slots=2, k_global_scales=[0.01], v_global_scales=[0.01])
    s = c.create_sequence()
    app = c.appender(fp4kv.DType.f16)
    per_slot = [app.for_slot(0), app.for_slot(1)]
    assert [a.slot for a in per_slot] == [0, 1]
    with pytest.raises(fp4kv.InvalidArgumentError, match="slot"):
        app.for_slot(2)
    for step in range(4):
        info = c.prepare_step([(s, 3)])
        assert info.slot == step % 2
        per_slot[info.slot].run(0, halves(rng, 3, H, D), halves(rng, 3, H, D))
    assert c.sequence_length(s) == 12 and c.layer_tokens(0) == 12
    assert np.from_dlpack(c.step_views(0)["seq_lens"])[0] == 9
    assert np.from_dlpack(c.step_views(1)["seq_lens"])[0] == 12


def test_cuda_device_without_a_gpu_is_an_error_not_a_crash():
    o = fp4kv.KVCacheOptions()
    o.num_layers = 1
    o.geometry = fp4kv.CacheGeometry(num_kv_heads=1, head_dim_k=64, page_size=16, num_pages=4)
    o.device = fp4kv.Device("cuda:0")
    assert o.device == fp4kv.Device.cuda(0) and o.device.is_cuda
    try:
        c = fp4kv.KVCache(o)
    except fp4kv.FailedPreconditionError as e:
        assert "CUDA" in str(e) or "cuda" in str(e)
    else:  # a machine with a GPU: the views are CUDA tensors
        assert c.layer_cache(0).k_data.__dlpack_device__() == (2, 0)
    with pytest.raises(fp4kv.InvalidArgumentError, match="device"):
        fp4kv.Device("tpu")
