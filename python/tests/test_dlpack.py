"""The DLPack contract: zero-copy in both directions, read-only views stay read-only."""

import numpy as np
import pytest

import fp4kv
from conftest import halves, make_cache


def ptr(a):
    return np.asarray(a).__array_interface__["data"][0]


def test_outputs_are_written_in_place(rng):
    x = halves(rng, 8, 64)
    packed = np.zeros((8, 32), np.uint8)
    scales = np.zeros((8, 4), np.uint8)
    before = ptr(packed)
    fp4kv.quantize_linear(x, packed, scales, 0.01)
    assert ptr(packed) == before and packed.any() and scales.any()
    # A strided view of a bigger buffer: written where it points.
    big = np.zeros((8, 64), np.uint8)
    fp4kv.quantize_linear(x, big[:, :32], np.zeros((8, 4), np.uint8), 0.01)
    np.testing.assert_array_equal(big[:, :32], packed)
    assert not big[:, 32:].any()


def test_inputs_are_not_copied(rng):
    # A non-contiguous inner dimension cannot be a view of the data: the op
    # refuses it rather than reading a copy.
    x = halves(rng, 8, 128)[:, ::2]
    with pytest.raises(fp4kv.InvalidArgumentError, match="input"):
        fp4kv.quantize_linear(x, np.zeros((8, 32), np.uint8), np.zeros((8, 4), np.uint8), 0.01)


def test_views_are_the_cache_memory(rng):
    c = make_cache(num_layers=2, k_global_scales=[0.01, 0.01], v_global_scales=[0.01, 0.01])
    pc = c.layer_cache(1)
    k_data = np.from_dlpack(pc.k_data)
    assert k_data.shape == (32, 16, 2, 32) and k_data.dtype == np.uint8
    assert np.from_dlpack(pc.k_scales).shape == (32, 16, 2, 4)
    assert pc.k_data.__dlpack_device__() == (1, 0)  # kDLCPU
    # Same memory every time (fixed addresses), and what the appender writes shows up.
    assert ptr(np.from_dlpack(c.layer_cache(1).k_data)) == ptr(k_data)
    assert ptr(np.from_dlpack(c.layer_cache(0).k_data)) != ptr(k_data)
    s = c.create_sequence()
    c.prepare_step([(s, 3)])
    assert not k_data.any()
    c.appender(fp4kv.DType.f16).run(1, halves(rng, 3, 2, 64), halves(rng, 3, 2, 64))
    page = c.sequence_pages(s)[0]
    assert k_data[page, :3].any() and not k_data[page, 3:].any()


def test_views_are_read_only(rng):
    c = make_cache(num_layers=1)
    s = c.create_sequence()
    c.prepare_step([(s, 5)])
    views = c.step_views()
    assert set(views) == {"slot_mapping", "block_tables", "seq_lens", "kv_page_indptr",
                          "token_indptr", "fp8_block_tables"}
    for name, v in views.items():
        for a in (np.from_dlpack(v), np.asarray(v)):
            assert not a.flags.writeable, name
            with pytest.raises(ValueError):
                a[...] = 0
    for v in (c.layer_cache(0).k_data, c.layer_cache(0).v_scales):
        a = np.from_dlpack(v)
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[0] = 1
        with pytest.raises(ValueError):
            a.flags.writeable = True


def test_step_views_follow_the_steps(rng):
    c = make_cache(num_layers=1)
    a, b = c.create_sequence(), c.create_sequence()
    v = c.step_views()
    seq_lens = np.from_dlpack(v["seq_lens"])
    slots = np.from_dlpack(v["slot_mapping"])
    assert seq_lens.shape == (8,) and seq_lens.dtype == np.int32
    c.prepare_step([(a, 5), (b, 2)])
    assert list(seq_lens[:3]) == [5, 2, 0]
    assert list(slots[:7]) == c.host_slot_mapping and slots[7] == -1
    c.prepare_step([(b, 1)])  # the same memory, rewritten
    assert list(seq_lens[:2]) == [3, 0]
    tables = np.from_dlpack(c.step_views()["block_tables"])
    assert tables[0, 0] == c.sequence_pages(b)[0]


def test_numpy_scalars_and_arrays_as_scales(rng):
    x = halves(rng, 4, 64)
    outs = []
    for g in (0.01, np.float32(0.01), np.float64(np.float32(0.01)), np.array([0.01], np.float32)):
        p = np.zeros((4, 32), np.uint8)
        fp4kv.quantize_linear(x, p, np.zeros((4, 4), np.uint8), g)
        outs.append(p)
    for p in outs[1:]:
        np.testing.assert_array_equal(p, outs[0])
