"""Linear quantize / dequantize against the numpy model of the format, byte for byte."""

import numpy as np
import pytest

import fp4kv
import nvfp4_ref as ref
from conftest import halves


def test_global_scale_helpers():
    std = fp4kv.Recipe.standard()
    # g = amax / (6 * 448), one fp32 division.
    assert fp4kv.make_global_scale(2688.0, std) == 1.0
    assert fp4kv.make_global_scale(6.0, std) == np.float32(6.0) / np.float32(2688.0)
    assert fp4kv.make_global_scale(0.0, std) == np.float32(1.0) / np.float32(2688.0)
    assert fp4kv.max_global_scale() == pytest.approx(1.266e35, rel=1e-3)
    assert fp4kv.is_valid_global_scale(1.0) and not fp4kv.is_valid_global_scale(0.0)
    assert fp4kv.min_fp8_scale(1.0) >= 6.0


def test_recipes():
    names = [r.name for r in fp4kv.all_recipes()]
    assert len(names) == 9 and names[0] == "standard"
    assert "4over6-mse-256-fast" in names
    r = fp4kv.Recipe.four_over_six(256, fp4kv.ErrorMetric.mse, True)
    assert r.name == "4over6-mse-256-fast"
    assert fp4kv.Recipe.from_code(r.code) == r
    assert fp4kv.Recipe.standard().code == 0x000001C000000001


@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_quantize_linear_matches_reference(rng, scale):
    x = halves(rng, 96, 128, scale=scale)
    x[3, :16] = 0  # an all-zero block
    x[5, 16:32] = -0.0
    g = fp4kv.make_global_scale(float(np.abs(x).max()), fp4kv.Recipe.standard())
    packed = np.zeros((96, 64), np.uint8)
    scales = np.zeros((96, 8), np.uint8)
    fp4kv.quantize_linear(x, packed, scales, g)
    want_packed, want_scales = ref.quantize_rows(x.astype(np.float32), g)
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(packed, want_packed)

    out = np.full((96, 128), np.nan, np.float16)
    fp4kv.dequantize_linear(packed, scales, out, g)
    want = ref.dequantize_rows(packed, scales, g).astype(np.float16)
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
    # The NVFP4 error stays where the format puts it (about 10% RMS).
    err = np.sqrt(np.mean((out.astype(np.float64) - x) ** 2) / np.mean(x.astype(np.float64) ** 2))
    assert 0.02 < err < 0.2


def test_linear_quantizer_object_and_scale_pointer(rng):
    x = halves(rng, 8, 64)
    q = fp4kv.LinearQuantizer(dtype=fp4kv.DType.f16)
    g = np.array([0.01], np.float32)  # read when the op runs
    p1, s1 = np.zeros((8, 32), np.uint8), np.zeros((8, 4), np.uint8)
    q.quantize(x, p1, s1, g)
    p2, s2 = np.zeros_like(p1), np.zeros_like(s1)
    fp4kv.quantize_linear(x, p2, s2, 0.01)
    np.testing.assert_array_equal(p1, p2)
    np.testing.assert_array_equal(s1, s2)
    want_p, want_s = ref.quantize_rows(x.astype(np.float32), np.float32(0.01))
    np.testing.assert_array_equal(p1, want_p)
    np.testing.assert_array_equal(s1, want_s)


def test_four_over_six_is_never_worse_per_block(rng):
    x = halves(rng, 64, 128)
    g = fp4kv.make_global_scale(float(np.abs(x).max()), fp4kv.Recipe.four_over_six())
    outs = {}
    for name, recipe in [("std", fp4kv.Recipe.standard()), ("46", fp4kv.Recipe.four_over_six())]:
        p, s = np.zeros((64, 64), np.uint8), np.zeros((64, 8), np.uint8)
        fp4kv.quantize_linear(x, p, s, g, recipe=recipe)
        o = np.zeros((64, 128), np.float16)
        fp4kv.dequantize_linear(p, s, o, g)
        outs[name] = np.abs(o.astype(np.float32) - x.astype(np.float32)).reshape(64, 8, 16).sum(-1)
    assert (outs["46"] <= outs["std"] + 1e-3).all()
    assert outs["46"].sum() < outs["std"].sum()
