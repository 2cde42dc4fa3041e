"""An independent numpy model of the NVFP4 format (docs/format.md) and of
attention in fp64 (include/fp4kv/attention.h), for checking the binding's
results. Standard recipe only; every step rounds in fp32 exactly as the
format's definition says, so quantized bytes must match the library's.
"""

import numpy as np

# E4M3 (OCP e4m3fn) magnitudes by code 0..126 (127 is NaN).
_E4M3 = np.array(
    [m * 2.0**-9 for m in range(8)]
    + [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)][:119],
    dtype=np.float64,
)
assert _E4M3[126] == 448.0 and len(_E4M3) == 127

# E2M1 magnitudes by code 0..7.
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def _round_to_table(mag, table):
    """Index of the nearest table entry, ties to the even index (RNE), saturating."""
    mag = np.asarray(mag, dtype=np.float64)
    hi = np.clip(np.searchsorted(table, mag, side="left"), 0, len(table) - 1)
    lo = np.clip(hi - 1, 0, len(table) - 1)
    d_lo = np.abs(mag - table[lo])
    d_hi = np.abs(table[hi] - mag)
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    idx = np.where(pick_hi, hi, lo)
    return np.where(mag >= table[-1], len(table) - 1, idx)


def e4m3_encode(x):
    x = np.asarray(x, dtype=np.float32)
    code = _round_to_table(np.abs(x), _E4M3).astype(np.uint8)
    return np.where(np.signbit(x), code | 0x80, code).astype(np.uint8)


def e4m3_decode(b):
    b = np.asarray(b, dtype=np.uint8)
    v = _E4M3[np.minimum(b & 0x7F, 126)]
    return np.where(b & 0x80, -v, v)


def e2m1_encode(x):
    x = np.asarray(x, dtype=np.float32)
    code = _round_to_table(np.abs(x), _E2M1).astype(np.uint8)
    return np.where(np.signbit(x), code | 0x8, code).astype(np.uint8)


def e2m1_decode(c):
    c = np.asarray(c, dtype=np.uint8)
    v = _E2M1[c & 0x7]
    return np.where(c & 0x8, -v, v)


def quantize_rows(x, g):
    """Rows x [N, D] (values exact in fp32) under global decode scale g ->
    (packed [N, D/2] u8, block scales [N, D/16] u8), standard recipe."""
    x = np.asarray(x, dtype=np.float32)
    n, d = x.shape
    blocks = x.reshape(n, d // 16, 16)
    g = np.float32(g)
    amax = np.abs(blocks).max(axis=-1)
    scale = e4m3_encode(amax / (np.float32(6.0) * g))
    scale[amax == 0] = 0
    s = e4m3_decode(scale).astype(np.float32)
    sg = s * g
    with np.errstate(divide="ignore"):
        r = np.where((s == 0) | (sg == 0), np.float32(0), np.float32(1) / sg).astype(np.float32)
    r[np.isinf(r)] = np.finfo(np.float32).max
    codes = e2m1_encode(blocks * r[..., None])
    codes[amax == 0] = 0
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.reshape(n, d // 2).astype(np.uint8), scale.reshape(n, d // 16)


def block_values(packed, scales):
    """e2m1(code) * e4m3(block scale) (no global scale), fp64 [N, D]."""
    packed = np.asarray(packed, dtype=np.uint8)
    n, half = packed.shape
    codes = np.empty((n, 2 * half), dtype=np.uint8)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    s = np.repeat(e4m3_decode(scales), 16, axis=1)
    return e2m1_decode(codes) * s


def dequantize_rows(packed, scales, g):
    """The library's dequantized value in fp32: (e2m1 * s) * g."""
    tile = block_values(packed, scales).astype(np.float32)
    return (tile * np.float32(g)).astype(np.float32)


def attention_ref(q, kq, vq, g_k, g_v, sm_scale, positions):
    """fp64 attention of query rows q [Q, Hq, D] against kq [T, H, D], vq
    [T, H, Dv] (block values, without global scales): query i attends the
    keys 0 .. positions[i]. Returns (out [Q, Hq, Dv], mag [Q, Hq, Dv])."""
    q = np.asarray(q, dtype=np.float64)
    g_k, g_v = float(np.float32(g_k)), float(np.float32(g_v))  # the scales are fp32
    nq, hq, _ = q.shape
    h = kq.shape[1]
    group = hq // h
    out = np.zeros((nq, hq, vq.shape[2]))
    mag = np.zeros_like(out)
    for i in range(nq):
        t = positions[i] + 1
        for head in range(hq):
            kv = head // group
            logits = sm_scale * g_k * (kq[:t, kv, :] @ q[i, head])
            w = np.exp(logits - logits.max())
            w /= w.sum()
            out[i, head] = g_v * (w @ vq[:t, kv, :])
            mag[i, head] = g_v * (w @ np.abs(vq[:t, kv, :]))
    return out, mag


def half_ulp_f16(x):
    a = np.abs(x)
    e = np.where(a > 0, np.maximum(np.floor(np.log2(np.where(a > 0, a, 1))), -14), -14)
    return np.ldexp(1.0, (e - 11).astype(int))


def assert_attention_close(got, want, mag):
    """The C++ tests' bound for the CPU reference: the fp64 result rounded
    once to f16 (half an ulp, with 1/128 slack) plus fp64 noise."""
    got = np.asarray(got, dtype=np.float64)
    tol = half_ulp_f16(want) * (1 + 1 / 128) + 1e-12 * mag
    bad = np.abs(got - want) > tol
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} outputs outside the bound; worst "
        f"{np.abs(got - want)[bad].max()} at {np.argwhere(bad)[0]}"
    )
