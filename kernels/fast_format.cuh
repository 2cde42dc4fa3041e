// Internal: faster formulations of the format.h block operations for the
// kernels. Every function here returns exactly the bits of its format.h
// counterpart (tests/fast_format_test.cc checks the scalar encoders over every
// input bit pattern and the block functions on random and special blocks);
// blocks the fast forms do not cover (NaN or infinite inputs, a global scale
// that is not positive and finite, NaN block scales) fall back to format.h.
//
// All FP4KV_HD: the kernels call them on the device, the tests on the host.
#ifndef FP4KV_KERNELS_FAST_FORMAT_CUH_
#define FP4KV_KERNELS_FAST_FORMAT_CUH_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "fp4kv/format.h"
#include "kernels/device_util.cuh"

namespace fp4kv {
namespace kernels {

// Rare fallbacks are outlined so they cost neither code size nor registers in
// the kernels' fast paths.
#if defined(__CUDA_ARCH__)
#define FP4KV_NO_UNROLL _Pragma("unroll 1")
#else
#define FP4KV_NO_UNROLL
#endif
#if defined(__CUDACC__)
#define FP4KV_COLD_HD __host__ __device__ __noinline__ inline
#else
#define FP4KV_COLD_HD inline
#endif

inline constexpr float kTwo23 = 8388608.0f;  // 2^23: its ulp is 1
inline constexpr uint32_t kTwo23Bits = 0x4b000000u;

// ---------------------------------------------------------------------------
// Scalar helpers. Device forms are single IEEE instructions.
// ---------------------------------------------------------------------------
// a * p + c rounded once (to nearest even), for p a power of two. The host
// form adds in double: a * p is exact there and has at most 24 significant
// bits, and rounding a sum of two such values to double and then to float
// gives the correctly rounded float sum (53 >= 2 * 24 + 1).
FP4KV_HD float FmaPow2Rn(float a, float p, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, p, c);
#else
  return static_cast<float>(static_cast<double>(a) * p + static_cast<double>(c));
#endif
}

// min/max for operands that are not NaN.
FP4KV_HD float MinF(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fminf(a, b);
#else
  return a < b ? a : b;
#endif
}

FP4KV_HD uint32_t MaxU32(uint32_t a, uint32_t b) { return a > b ? a : b; }
FP4KV_HD uint32_t MinU32(uint32_t a, uint32_t b) { return a < b ? a : b; }

FP4KV_HD float Abs(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);
#else
  return AbsF(x);
#endif
}

FP4KV_HD bool IsFiniteBits(uint32_t bits) { return (bits & 0x7fffffffu) < 0x7f800000u; }
FP4KV_HD bool IsNanF(float x) { return (FloatBits(x) & 0x7fffffffu) > 0x7f800000u; }

// Correctly rounded 1 / x.
FP4KV_HD float RcpRn(float x) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(x);
#else
  return DivRn(1.0f, x);
#endif
}

// ---------------------------------------------------------------------------
// E2M1
// ---------------------------------------------------------------------------

// E2M1 magnitude code of a >= 0 (not NaN; +inf allowed) as the bits of the
// float 2^23 + code. Each line rounds a once, to nearest even, on the integer grid
// of [2^23, 2^24): rint(2a) is the code below 2 (step 0.5), 2 + rint(a) in
// [2, 4) (step 1), 4 + rint(a/2) from 4 (step 2); the code is the smallest of
// the three, capped at 7. Adding an even offset keeps ties-to-even, and each
// line is the smallest exactly on its own range.
// The minimum is taken on the bit patterns (equal order for non-negative
// floats, +inf included), which the device does with one 3-input integer min
// and one 2-input min.
// kCap = false drops the cap for a < 6.5 (then 4 + rint(a/2) <= 7 already).
template <bool kCap = true>
FP4KV_HD uint32_t E2m1MagnitudeT(float a) {
  const uint32_t t1 = FloatBits(FmaPow2Rn(a, 2.0f, kTwo23));
  const uint32_t t2 = FloatBits(AddRn(a, kTwo23 + 2.0f));
  const uint32_t t3 = FloatBits(FmaPow2Rn(a, 0.5f, kTwo23 + 4.0f));
  if constexpr (!kCap) return MinU32(MinU32(t1, t2), t3);
  return MinU32(MinU32(t1, t2), MinU32(t3, kTwo23Bits + 7));
}

FP4KV_HD uint32_t E2m1MagnitudeCode(float a) { return E2m1MagnitudeT(a) - kTwo23Bits; }

// Same bits as E2m1Encode(y) for every y.
FP4KV_HD uint8_t FastE2m1Encode(float y) {
  const uint32_t bits = FloatBits(y);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7;
  return static_cast<uint8_t>(((bits >> 28) & 0x8u) | E2m1MagnitudeCode(Abs(y)));
}

// |E2m1Decode(E2m1Encode(a))| for a >= 0 (not NaN; +inf allowed): a is
// clamped to 6 and added to 2^(22+e), e = clamp(floor(log2 a), 0, 2), whose
// ulp is the E2M1 step at a; the sum rounds to nearest even.
// kClamp = false drops the clamp for a < 6.5 (a in [4, 6.5) rounds to 4 or
// 6 on the step-2 grid already).
template <bool kClamp = true>
FP4KV_HD float E2m1RoundMagnitude(float a) {
  const float a6 = kClamp ? MinF(a, 6.0f) : a;
  const uint32_t e = FloatBits(a6) & 0x7f800000u;
  const float magic = BitsFloat(MaxU32(e + (22u << 23), 0x4a800000u));
  return SubRn(AddRn(a6, magic), magic);
}

// The code of an E2M1 magnitude value v in {0, 0.5, 1, 1.5, 2, 3, 4, 6}:
// v * 2^-126 has the code in bits 22..24 (fp32 exponent = E2M1 exponent).
FP4KV_HD uint32_t E2m1CodeOfValue(float v) {
  return FloatBits(MulRn(v, BitsFloat(0x00800000u))) >> 22;
}

// E2m1CodeOfValue(v) << (4 * k) for k in [0, 7]: the bits of v * 2^-126 lie in
// 22..24 only, so one shift moves the code to nibble k.
FP4KV_HD uint32_t E2m1CodeOfValueAt(float v, int k) {
  const uint32_t b = FloatBits(MulRn(v, BitsFloat(0x00800000u)));
  return 4 * k <= 22 ? b >> (22 - 4 * k) : b << (4 * k - 22);
}

// E2m1Decode(c) for a code c in [0, 15]: the code's bits placed in an fp32
// (exponent = E2M1 exponent, subnormal when 0) times 2^126.
FP4KV_HD float FastE2m1Decode(uint32_t c) {
  return MulRn(BitsFloat(((c & 0x7u) << 22) | ((c & 0x8u) << 28)), BitsFloat(0x7e800000u));
}

// ---------------------------------------------------------------------------
// E4M3
// ---------------------------------------------------------------------------

// E4m3Encode(q) for q >= +0 (sign bit clear), not NaN; +inf allowed.
FP4KV_HD uint8_t FastE4m3EncodeNonNeg(float q) {
  const float qc = MinF(q, 448.0f);
  const uint32_t bits = FloatBits(qc);
  // Below 2^-6: subnormal codes, rint(q * 2^9) (8 is the smallest normal).
  const uint32_t sub = FloatBits(FmaPow2Rn(qc, 512.0f, kTwo23)) - kTwo23Bits;
  // Normal: drop 20 mantissa bits with ties to even, rebias 127 -> 7.
  const uint32_t nor = ((bits + 0x7ffffu + ((bits >> 20) & 1u)) >> 20) - (120u << 3);
  return static_cast<uint8_t>(bits < 0x3c800000u ? sub : nor);
}

// E4m3Decode(b) for b in [0, 0x7e]: b's bits placed in an fp32 times 2^120.
FP4KV_HD float FastE4m3DecodeNonNeg(uint32_t b) {
  return MulRn(BitsFloat(b << 20), BitsFloat(0x7b800000u));
}

// ---------------------------------------------------------------------------
// E4M3 encode of two floats into one 16-bit pair (lo in byte 0).
// ---------------------------------------------------------------------------
// E4m3Encode for every input: sm_89+ has it as one instruction (round to
// nearest even, saturating, NaN -> 0x7f; tests/gpu_fast_format_test.cu checks
// it over every pattern).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define FP4KV_HW_E4M3 1
#endif
FP4KV_HD uint32_t E4m3Encode2(float lo, float hi) {
#if defined(FP4KV_HW_E4M3)
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return E4m3Encode(lo) | (static_cast<uint32_t>(E4m3Encode(hi)) << 8);
#endif
}

// The same for lo, hi >= +0, not NaN (+inf allowed): the software form uses
// the fast non-negative encoder.
FP4KV_HD uint32_t E4m3Encode2NonNeg(float lo, float hi) {
#if defined(FP4KV_HW_E4M3)
  return E4m3Encode2(lo, hi);
#else
  return FastE4m3EncodeNonNeg(lo) | (static_cast<uint32_t>(FastE4m3EncodeNonNeg(hi)) << 8);
#endif
}

// E4m3Encode(q) for a block scale q >= +0, not NaN (+inf allowed); the
// result is below 256.
FP4KV_HD uint32_t E4m3EncodeScale(float q) {
#if defined(FP4KV_HW_E4M3)
  return E4m3Encode2(q, 0.0f);
#else
  return FastE4m3EncodeNonNeg(q);
#endif
}

// ---------------------------------------------------------------------------
// f16 / bf16 pairs in one 32-bit word (element 0 in the low half).
// ---------------------------------------------------------------------------
#if defined(__CUDA_ARCH__)
FP4KV_HD __half2 AsHalf2(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, sizeof(h));
  return h;
}
FP4KV_HD uint32_t Half2Bits(__half2 h) {
  uint32_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}
#endif

// Exact conversion of a pair to fp32.
template <bool kBf16>
FP4KV_HD void Unpack2(uint32_t w, float* lo, float* hi) {
  if constexpr (kBf16) {
    *lo = BitsFloat(w << 16);
    *hi = BitsFloat(w & 0xffff0000u);
  } else {
#if defined(__CUDA_ARCH__)
    const float2 f = __half22float2(AsHalf2(w));
    *lo = f.x;
    *hi = f.y;
#else
    *lo = HalfBitsToFloat(static_cast<uint16_t>(w & 0xffffu));
    *hi = HalfBitsToFloat(static_cast<uint16_t>(w >> 16));
#endif
  }
}

// Round-to-nearest-even of a pair to f16 / bf16: FloatToHalfBits /
// FloatToBf16Bits. The device form is the cvt.rn instruction, equal for every
// non-NaN input; callers pass no NaN.
template <bool kBf16>
FP4KV_HD uint32_t Pack2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  if constexpr (kBf16) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &b, sizeof(u));
    return u;
  } else {
    return Half2Bits(__floats2half2_rn(lo, hi));
  }
#else
  if constexpr (kBf16) {
    return FloatToBf16Bits(lo) | (static_cast<uint32_t>(FloatToBf16Bits(hi)) << 16);
  } else {
    return FloatToHalfBits(lo) | (static_cast<uint32_t>(FloatToHalfBits(hi)) << 16);
  }
#endif
}

// Exact fp16 arithmetic on pairs (raw f16 bits). The host forms are the
// reference's emulation (fp32 op, then RoundToHalf); the device forms are the
// IEEE f16x2 instructions, which give the same values.
FP4KV_HD uint32_t H2Pack(float lo, float hi) { return Pack2<false>(lo, hi); }
FP4KV_HD uint32_t H2Abs(uint32_t a) { return a & 0x7fff7fffu; }

#if !defined(__CUDA_ARCH__)
template <typename Op>
uint32_t H2Apply(uint32_t a, uint32_t b, Op op) {
  uint32_t out = 0;
  for (int k = 0; k < 2; ++k) {
    const float x = HalfBitsToFloat(static_cast<uint16_t>(a >> (16 * k)));
    const float y = HalfBitsToFloat(static_cast<uint16_t>(b >> (16 * k)));
    out |= static_cast<uint32_t>(FloatToHalfBits(op(x, y))) << (16 * k);
  }
  return out;
}
#endif

FP4KV_HD uint32_t H2Sub(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return Half2Bits(__hsub2(AsHalf2(a), AsHalf2(b)));
#else
  return H2Apply(a, b, [](float x, float y) { return SubRn(x, y); });
#endif
}

FP4KV_HD uint32_t H2Add(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return Half2Bits(__hadd2(AsHalf2(a), AsHalf2(b)));
#else
  return H2Apply(a, b, [](float x, float y) { return AddRn(x, y); });
#endif
}

FP4KV_HD uint32_t H2Mul(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return Half2Bits(__hmul2(AsHalf2(a), AsHalf2(b)));
#else
  return H2Apply(a, b, [](float x, float y) { return MulRn(x, y); });
#endif
}

FP4KV_HD float HalfToFloat(uint32_t h) {
#if defined(__CUDA_ARCH__)
  __half_raw r;
  r.x = static_cast<unsigned short>(h);
  return __half2float(__half(r));
#else
  return HalfBitsToFloat(static_cast<uint16_t>(h));
#endif
}

// ---------------------------------------------------------------------------
// Quantize one block (QuantizeBlock).
// ---------------------------------------------------------------------------

// Which QuantizeBlock recipe a kernel instance implements (a template
// argument, so the error metric costs no branch per value).
enum class RecipeVariant : int {
  kStandard = 0,
  kMae = 1,      // 4over6, fp32 MAE
  kMse = 2,      // 4over6, fp32 MSE
  kMaeHalf = 3,  // 4over6, fast_math MAE
  kMseHalf = 4,  // 4over6, fast_math MSE
};

inline RecipeVariant VariantOf(const Recipe& r) {
  if (r.kind != RecipeKind::kFourOverSix) return RecipeVariant::kStandard;
  if (r.metric == ErrorMetric::kMae)
    return r.fast_math ? RecipeVariant::kMaeHalf : RecipeVariant::kMae;
  return r.fast_math ? RecipeVariant::kMseHalf : RecipeVariant::kMse;
}

// Per global scale, computed once per thread.
struct QuantScale {
  float g = 1.0f;
  float g6 = 6.0f;    // MulRn(6, g)
  float g4 = 4.0f;    // MulRn(4, g)
  bool fast = true;   // g positive and finite
  bool tight = true;  // g in [2^-100, 2^100]: see TightScale
};

FP4KV_HD QuantScale MakeQuantScale(float g) {
  QuantScale q;
  q.g = g;
  q.g6 = MulRn(6.0f, g);
  q.g4 = MulRn(4.0f, g);
  q.fast = g > 0.0f && IsFiniteBits(FloatBits(g));
  q.tight = FloatBits(g) - 0x0d800000u <= 0x71800000u - 0x0d800000u;  // 2^-100 .. 2^100
  return q;
}

// For g with QuantScale::tight and a block scale byte b = E4m3(rn(amax / rn(k g)))
// (k = 6 or 4) that is normal and not the largest code (0x08..0x7d): no
// saturation, and E4M3's relative rounding error is at most 2^-4, so with the
// fp32 roundings of rn(k g), rn(s g), 1 / (s g) and |x| r (2^-24 each, all
// results normal) every a = |x| r <= k * 17/16 * (1 + 2^-24)^5 < 6.5.
// Then the E2M1 cap / clamp at 6 changes nothing.
FP4KV_HD bool TightScale(uint32_t b) { return b - 0x08u <= 0x7du - 0x08u; }

// r = 1 / (s g) as EncodeBlockWithScale computes it (s >= 0, g > 0).
FP4KV_HD float BlockReciprocal(float s, float g) {
  const float sg = MulRn(s, g);
  float r = (s == 0.0f || sg == 0.0f) ? 0.0f : RcpRn(sg);
  if (FloatBits(r) == 0x7f800000u) r = BitsFloat(0x7f7fffffu);
  return r;
}

// Sign bits of the 8 values in w0..w3 (value 2j in the low half of wj) at
// bit 4i + 3, i.e. where the packed E2M1 codes keep them.
FP4KV_HD uint32_t SignNibbles(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  const uint32_t p01 = Prmt(w0, w1, 0x7351u);  // w0.b1 w1.b1 w0.b3 w1.b3
  const uint32_t p23 = Prmt(w2, w3, 0x7351u);
  const uint32_t even = Prmt(p01, p23, 0x5410u);  // high bytes of values 0, 2, 4, 6
  const uint32_t odd = Prmt(p01, p23, 0x7632u);   // high bytes of values 1, 3, 5, 7
  return ((even >> 4) & 0x08080808u) | (odd & 0x80808080u);
}

// Magnitude codes of the 8 values in w0..w3 times r (r >= 0), packed.
template <bool kBf16, bool kCap = true>
FP4KV_HD uint32_t EncodeMagnitudes8(const uint32_t* w, float r) {
  uint32_t acc = 0;
  FP4KV_UNROLL
  for (int j = 0; j < 4; ++j) {
    float lo, hi;
    Unpack2<kBf16>(w[j], &lo, &hi);
    // Each term carries 2^23's bits (0x4b000000) shifted by 4k; their sum
    // mod 2^32 is 0xfb000000, removed once below.
    acc += E2m1MagnitudeT<kCap>(MulRn(Abs(lo), r)) << (8 * j);
    acc += E2m1MagnitudeT<kCap>(MulRn(Abs(hi), r)) << (8 * j + 4);
  }
  return acc - 0xfb000000u;
}

// QuantizeBlock on the 16 f16/bf16 values in w, written with rolled loops
// over the format.h scalar functions so the outlined fallback stays small:
// the same operations in the same order as QuantizeBlock,
// EncodeBlockWithScale and CandidateError (the CPU tests compare the two).
FP4KV_HD float GenericX(const uint32_t (&w)[8], bool bf16, int i) {
  const uint16_t h = static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2)));
  return bf16 ? Bf16BitsToFloat(h) : HalfBitsToFloat(h);
}

FP4KV_HD void GenericEncode(const uint32_t (&w)[8], bool bf16, float g, uint8_t scale_byte,
                            uint32_t (&packed)[2]) {
  const float s = E4m3Decode(scale_byte);
  const float sg = MulRn(s, g);
  float r = (s == 0.0f || sg == 0.0f) ? 0.0f : DivRn(1.0f, sg);
  if (FloatBits(r) == 0x7f800000u) r = BitsFloat(0x7f7fffffu);
  packed[0] = 0;
  packed[1] = 0;
  FP4KV_NO_UNROLL
  for (int i = 0; i < kBlockSize; ++i) {
    const uint32_t c = E2m1Encode(MulRn(GenericX(w, bf16, i), r));
    packed[i / 8] |= c << (4 * (i % 8));
  }
}

FP4KV_HD float GenericError(const uint32_t (&w)[8], bool bf16, const uint32_t (&packed)[2],
                            uint8_t scale_byte, float g, const Recipe& recipe) {
  const float s = E4m3Decode(scale_byte);
  float err = 0.0f;
  FP4KV_NO_UNROLL
  for (int i = 0; i < kBlockSize; ++i) {
    const float x = GenericX(w, bf16, i);
    const uint8_t c = static_cast<uint8_t>((packed[i / 8] >> (4 * (i % 8))) & 0xfu);
    const float dq = DequantValue(c, s, g);
    if (!recipe.fast_math) {
      const float d = SubRn(x, dq);
      err = AddRn(err, recipe.metric == ErrorMetric::kMae ? AbsF(d) : MulRn(d, d));
    } else {
      const float d = RoundToHalf(SubRn(RoundToHalf(x), RoundToHalf(dq)));
      const float e = recipe.metric == ErrorMetric::kMae ? AbsF(d) : RoundToHalf(MulRn(d, d));
      err = RoundToHalf(AddRn(err, e));
    }
  }
  return err;
}

FP4KV_HD uint8_t GenericQuantize(const uint32_t (&w)[8], bool bf16, float g, const Recipe& recipe,
                                 uint32_t (&packed)[2]) {
  float amax = 0.0f;
  FP4KV_NO_UNROLL
  for (int i = 0; i < kBlockSize; ++i) {
    const float a = AbsF(GenericX(w, bf16, i));
    amax = a > amax ? a : amax;
  }
  if (amax == 0.0f) {
    packed[0] = 0;
    packed[1] = 0;
    return 0;
  }
  const uint8_t b6 = E4m3Encode(DivRn(amax, MulRn(6.0f, g)));
  GenericEncode(w, bf16, g, b6, packed);
  if (recipe.kind != RecipeKind::kFourOverSix) return b6;
  uint32_t packed4[2];
  const uint8_t b4 = E4m3Encode(DivRn(amax, MulRn(4.0f, g)));
  GenericEncode(w, bf16, g, b4, packed4);
  const float e6 = GenericError(w, bf16, packed, b6, g, recipe);
  const float e4 = GenericError(w, bf16, packed4, b4, g, recipe);
  if (e4 < e6) {
    packed[0] = packed4[0];
    packed[1] = packed4[1];
    return b4;
  }
  return b6;
}

struct Words8 {
  uint32_t w[8];
};
struct QuantizedBlock {
  uint32_t packed[2];
  uint32_t scale;
};

// Arguments and result by value: the call stays in registers on the caller's
// side (no addressable copies of kernel parameters).
FP4KV_COLD_HD QuantizedBlock QuantizeBlockGeneric(Words8 words, bool bf16, float g, Recipe recipe) {
  const uint32_t(&w)[8] = words.w;
  QuantizedBlock out;
  uint32_t(&packed)[2] = out.packed;
  out.scale = GenericQuantize(w, bf16, g, recipe, packed);
  return out;
}

// Same scale byte and packed words as QuantizeBlock(x, qs.g, recipe, packed)
// where x are the 16 f16/bf16 values in w (value 2j in the low half of w[j]).
// `kVariant` must be VariantOf(recipe).
template <bool kBf16, RecipeVariant kVariant>
FP4KV_HD uint8_t QuantizeBlockFast(const uint32_t (&w)[8], const QuantScale& qs,
                                   const Recipe& recipe, uint32_t (&packed)[2]) {
  uint32_t m = 0;
  FP4KV_UNROLL
  for (int j = 0; j < 8; ++j) m = MaxU16x2(m, w[j] & 0x7fff7fffu);
  const uint32_t amax16 = MaxU32(m & 0xffffu, m >> 16);
  if (!qs.fast || amax16 >= (kBf16 ? 0x7f80u : 0x7c00u)) {
    // Rare: NaN or infinite inputs, or a global scale outside the contract.
    Words8 words;
    FP4KV_UNROLL
    for (int j = 0; j < 8; ++j) words.w[j] = w[j];
    const QuantizedBlock q = QuantizeBlockGeneric(words, kBf16, qs.g, recipe);
    packed[0] = q.packed[0];
    packed[1] = q.packed[1];
    return static_cast<uint8_t>(q.scale);
  }
  if (amax16 == 0) {
    packed[0] = 0;
    packed[1] = 0;
    return 0;
  }
  const float amax = kBf16 ? BitsFloat(amax16 << 16) : HalfToFloat(amax16);
  const uint32_t sign0 = SignNibbles(w[0], w[1], w[2], w[3]);
  const uint32_t sign1 = SignNibbles(w[4], w[5], w[6], w[7]);
  const uint32_t b6 = E4m3EncodeScale(DivRn(amax, qs.g6));
  const float s6 = FastE4m3DecodeNonNeg(b6);
  const float r6 = BlockReciprocal(s6, qs.g);
  if constexpr (kVariant == RecipeVariant::kStandard) {
    if (qs.tight && TightScale(b6)) {
      packed[0] = EncodeMagnitudes8<kBf16, false>(&w[0], r6) | sign0;
      packed[1] = EncodeMagnitudes8<kBf16, false>(&w[4], r6) | sign1;
    } else {
      packed[0] = EncodeMagnitudes8<kBf16, true>(&w[0], r6) | sign0;
      packed[1] = EncodeMagnitudes8<kBf16, true>(&w[4], r6) | sign1;
    }
    return static_cast<uint8_t>(b6);
  } else {
    constexpr bool kHalf =
        kVariant == RecipeVariant::kMaeHalf || kVariant == RecipeVariant::kMseHalf;
    constexpr bool kMse = kVariant == RecipeVariant::kMse || kVariant == RecipeVariant::kMseHalf;
    const uint32_t b4 = E4m3EncodeScale(DivRn(amax, qs.g4));
    const float s4 = FastE4m3DecodeNonNeg(b4);
    const float r4 = BlockReciprocal(s4, qs.g);
    uint32_t p6[2] = {0, 0};
    uint32_t p4[2] = {0, 0};
    float e6 = 0.0f, e4 = 0.0f;  // fp32 errors
    uint32_t eh = 0;             // fp16 errors: candidate 6 low, 4 high
    // Candidates are compared on magnitudes: the code's sign is x's, so
    // x - dq has the magnitude |x| - |dq| and both metrics are even.
    auto candidates = [&](auto clamp) {
    constexpr bool kClamp = decltype(clamp)::value;
    FP4KV_UNROLL
    for (int i = 0; i < kBlockSize; ++i) {
      float lo, hi;
      Unpack2<kBf16>(w[i / 2], &lo, &hi);
      const float ax = Abs(i % 2 == 0 ? lo : hi);
      const float v6 = E2m1RoundMagnitude<kClamp>(MulRn(ax, r6));
      const float v4 = E2m1RoundMagnitude<kClamp>(MulRn(ax, r4));
      const float dq6 = MulRn(MulRn(v6, s6), qs.g);
      const float dq4 = MulRn(MulRn(v4, s4), qs.g);
      if constexpr (!kHalf) {
        const float d6 = SubRn(ax, dq6);
        const float d4 = SubRn(ax, dq4);
        e6 = AddRn(e6, kMse ? MulRn(d6, d6) : Abs(d6));
        e4 = AddRn(e4, kMse ? MulRn(d4, d4) : Abs(d4));
      } else {
        uint32_t xh;
        if constexpr (kBf16) {
          xh = H2Pack(ax, ax);
        } else {
          xh = ((w[i / 2] >> (16 * (i % 2))) & 0x7fffu) * 0x00010001u;
        }
        const uint32_t d = H2Sub(xh, H2Pack(dq6, dq4));
        eh = H2Add(eh, kMse ? H2Mul(d, d) : H2Abs(d));
      }
      p6[i / 8] += E2m1CodeOfValueAt(v6, i % 8);  // disjoint nibbles: + is |
      p4[i / 8] += E2m1CodeOfValueAt(v4, i % 8);
    }
    };
    if (qs.tight && TightScale(b6) && TightScale(b4)) {
      candidates(std::false_type{});
    } else {
      candidates(std::true_type{});
    }
    if constexpr (kHalf) {
      e6 = HalfToFloat(eh & 0xffffu);
      e4 = HalfToFloat(eh >> 16);
    }
    const bool four = e4 < e6;
    packed[0] = (four ? p4[0] : p6[0]) | sign0;
    packed[1] = (four ? p4[1] : p6[1]) | sign1;
    return static_cast<uint8_t>(four ? b4 : b6);
  }
}

// ---------------------------------------------------------------------------
// Dequantize one block (16 values) to f16/bf16: DequantValue then
// FloatToHalfBits / FloatToBf16Bits. `codes` holds the 8 packed bytes (value 0
// in the low nibble of byte 0); out.w[j] holds values 2j (low half) and 2j + 1.
// ---------------------------------------------------------------------------
struct Words8Out {
  U32x4 lo, hi;  // values 0..7, 8..15
};

// Results may be NaN; the software conversions map every NaN to 0x7fff.
FP4KV_COLD_HD Words8Out DequantizeBlockGeneric(U32x2 codes, uint8_t scale_byte, float g,
                                               bool bf16) {
  const float s = E4m3Decode(scale_byte);
  uint32_t out[8];
  FP4KV_NO_UNROLL
  for (int j = 0; j < 8; ++j) {
    const uint32_t byte = ((j < 4 ? codes.x : codes.y) >> (8 * (j % 4))) & 0xffu;
    const float lo = DequantValue(static_cast<uint8_t>(byte & 0xfu), s, g);
    const float hi = DequantValue(static_cast<uint8_t>(byte >> 4), s, g);
    out[j] = bf16 ? (FloatToBf16Bits(lo) | (static_cast<uint32_t>(FloatToBf16Bits(hi)) << 16))
                  : (FloatToHalfBits(lo) | (static_cast<uint32_t>(FloatToHalfBits(hi)) << 16));
  }
  return Words8Out{U32x4{out[0], out[1], out[2], out[3]}, U32x4{out[4], out[5], out[6], out[7]}};
}

// Per block, the 8 magnitudes (|e2m1| * |s|) * |g| are rounded to f16/bf16
// once and split into a table of low bytes and one of high bytes; each code
// picks its two bytes with prmt. The sign of (e2m1 * s) * g is the xor of the
// three signs (IEEE multiplication and round-to-nearest are symmetric, and
// no product is NaN when s and g are finite), set with one more prmt.
template <bool kBf16>
FP4KV_HD Words8Out DequantizeBlockFast(U32x2 codes, uint8_t scale_byte, float g, bool g_finite) {
  if (!g_finite || (scale_byte & 0x7fu) == 0x7fu) {
    return DequantizeBlockGeneric(codes, scale_byte, g, kBf16);
  }
  const float as = FastE4m3DecodeNonNeg(scale_byte & 0x7fu);
  const float ag = Abs(g);
  const uint32_t e01 = Pack2<kBf16>(0.0f, MulRn(MulRn(0.5f, as), ag));
  const uint32_t e23 = Pack2<kBf16>(MulRn(as, ag), MulRn(MulRn(1.5f, as), ag));
  const uint32_t e45 = Pack2<kBf16>(MulRn(MulRn(2.0f, as), ag), MulRn(MulRn(3.0f, as), ag));
  const uint32_t e67 = Pack2<kBf16>(MulRn(MulRn(4.0f, as), ag), MulRn(MulRn(6.0f, as), ag));
  const uint32_t lo0 = Prmt(e01, e23, 0x6420u), lo1 = Prmt(e45, e67, 0x6420u);
  const uint32_t hi0 = Prmt(e01, e23, 0x7531u), hi1 = Prmt(e45, e67, 0x7531u);
  const bool neg = ((scale_byte >> 7) ^ (FloatBits(g) >> 31)) & 1u;
  const uint32_t flip = neg ? 0x88888888u : 0u;
  const uint32_t mags[2] = {codes.x & 0x77777777u, codes.y & 0x77777777u};
  const uint32_t sgns[2] = {codes.x ^ flip, codes.y ^ flip};
  uint32_t out[8];
  FP4KV_UNROLL
  for (int h = 0; h < 4; ++h) {  // values 4h .. 4h + 3
    const uint32_t m = mags[h / 2] >> (16 * (h % 2));
    const uint32_t sg = sgns[h / 2] >> (16 * (h % 2));
    const uint32_t a = Prmt(lo0, lo1, m);
    // Byte 0x80 where the value is positive, 0xff where negative: bit 0 is
    // the sign.
    const uint32_t neg = Prmt(0x80808080u, 0x80808080u, sg);
    const uint32_t b = Prmt(hi0, hi1, m) | ((neg << 7) & 0x80808080u);
    out[2 * h] = Prmt(a, b, 0x5140u);
    out[2 * h + 1] = Prmt(a, b, 0x7362u);
  }
  return Words8Out{U32x4{out[0], out[1], out[2], out[3]}, U32x4{out[4], out[5], out[6], out[7]}};
}

// ---------------------------------------------------------------------------
// Materialize one block as FP8 (MaterializeFp8Value for each of 16 codes).
// Per block, the 8 magnitudes (|e2m1| * |s|) * m are encoded once into a
// byte table; each code then picks its byte with prmt, and a second prmt
// gives the sign (code sign xor scale sign: m > 0 and no product is NaN).
// A NaN block scale or a multiplier that is infinite or has its sign bit set
// (outside the contract m >= 0) takes the rolled loop over format.h.
// ---------------------------------------------------------------------------
FP4KV_COLD_HD U32x4 MaterializeBlockGeneric(U32x2 codes, uint8_t scale_byte, float m) {
  const float s = E4m3Decode(scale_byte);
  uint32_t out[4] = {0, 0, 0, 0};
  FP4KV_NO_UNROLL
  for (int i = 0; i < kBlockSize; ++i) {
    const uint32_t c = ((i < 8 ? codes.x : codes.y) >> (4 * (i % 8))) & 0xfu;
    out[i / 4] |= static_cast<uint32_t>(MaterializeFp8Value(static_cast<uint8_t>(c), s, m))
                  << (8 * (i % 4));
  }
  return U32x4{out[0], out[1], out[2], out[3]};
}

// True when MaterializeBlockFast may use its table for multiplier m.
FP4KV_HD bool MaterializeMultiplierFast(float m) { return FloatBits(m) < 0x7f800000u; }

FP4KV_HD U32x4 MaterializeBlockFast(const U32x2& codes, uint8_t scale_byte, float m,
                                    bool m_fast) {
  if (!m_fast || (scale_byte & 0x7fu) == 0x7fu) {
    return MaterializeBlockGeneric(codes, scale_byte, m);
  }
  const float as = FastE4m3DecodeNonNeg(scale_byte & 0x7fu);
  const uint32_t mag0 = E4m3Encode2NonNeg(0.0f, MulRn(MulRn(0.5f, as), m)) |
                        (E4m3Encode2NonNeg(MulRn(as, m), MulRn(MulRn(1.5f, as), m)) << 16);
  const uint32_t mag1 =
      E4m3Encode2NonNeg(MulRn(MulRn(2.0f, as), m), MulRn(MulRn(3.0f, as), m)) |
      (E4m3Encode2NonNeg(MulRn(MulRn(4.0f, as), m), MulRn(MulRn(6.0f, as), m)) << 16);
  const uint32_t flip = (scale_byte & 0x80u) ? 0x88888888u : 0u;
  const uint32_t mags[2] = {codes.x & 0x77777777u, codes.y & 0x77777777u};
  const uint32_t sgns[2] = {codes.x ^ flip, codes.y ^ flip};
  uint32_t out[4];
  FP4KV_UNROLL
  for (int h = 0; h < 4; ++h) {
    const uint32_t bytes = Prmt(mag0, mag1, mags[h / 2] >> (16 * (h % 2)));
    // Byte 0x80 where the product is positive, 0xff where negative.
    const uint32_t neg = Prmt(0x80808080u, 0x80808080u, sgns[h / 2] >> (16 * (h % 2)));
    out[h] = bytes | ((neg << 7) & 0x80808080u);
  }
  return U32x4{out[0], out[1], out[2], out[3]};
}

// ---------------------------------------------------------------------------
// FP8 keys (KeyFormat::kFp8): 16 key values per call, the 16 E4M3 bytes in
// one U32x4 (value i in byte i % 4 of word i / 4).
// ---------------------------------------------------------------------------

// QuantizeFp8Key(x_i, r) of the 16 f16/bf16 values in w. E4m3Encode2 is the
// hardware convert on sm_89+ (same bits for every input, NaN and inf
// included), so there is no fallback.
template <bool kBf16>
FP4KV_HD U32x4 QuantizeFp8KeyBlockFast(const uint32_t (&w)[8], float r) {
  uint32_t out[4];
  FP4KV_UNROLL
  for (int j = 0; j < 4; ++j) {
    float a, b, c, d;
    Unpack2<kBf16>(w[2 * j], &a, &b);
    Unpack2<kBf16>(w[2 * j + 1], &c, &d);
    out[j] = E4m3Encode2(MulRn(a, r), MulRn(b, r)) | (E4m3Encode2(MulRn(c, r), MulRn(d, r)) << 16);
  }
  return U32x4{out[0], out[1], out[2], out[3]};
}

FP4KV_HD uint8_t ByteOf(const U32x4& v, int i) {
  const uint32_t w = i < 4 ? v.x : i < 8 ? v.y : i < 12 ? v.z : v.w;
  return static_cast<uint8_t>(w >> (8 * (i % 4)));
}

// Software conversions for NaN codes or a non-finite g.
FP4KV_COLD_HD Words8Out DequantFp8KeyBlockGeneric(U32x4 codes, float g, bool bf16) {
  uint32_t out[8];
  for (int j = 0; j < 8; ++j) {
    uint16_t h[2];
    for (int k = 0; k < 2; ++k) {
      const float y = DequantFp8Key(ByteOf(codes, 2 * j + k), g);
      h[k] = bf16 ? FloatToBf16Bits(y) : FloatToHalfBits(y);
    }
    out[j] = static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
  }
  return Words8Out{U32x4{out[0], out[1], out[2], out[3]}, U32x4{out[4], out[5], out[6], out[7]}};
}

// DequantFp8Key(code_i, g) rounded to f16/bf16 for 16 FP8 key bytes.
template <bool kBf16>
FP4KV_HD Words8Out DequantFp8KeyBlockFast(const U32x4& codes, float g, bool g_finite) {
  const uint32_t c[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t nan = 0;  // bytes whose low 7 bits are 0x7f (the NaN codes)
  FP4KV_UNROLL
  for (int j = 0; j < 4; ++j) nan |= ((c[j] & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
  if (!g_finite || nan != 0) return DequantFp8KeyBlockGeneric(codes, g, kBf16);
  uint32_t out[8];
  FP4KV_UNROLL
  for (int j = 0; j < 8; ++j) {
    const uint32_t pair = c[j / 2] >> (16 * (j % 2));
    float v0 = FastE4m3DecodeNonNeg(pair & 0x7fu);
    float v1 = FastE4m3DecodeNonNeg((pair >> 8) & 0x7fu);
    v0 = (pair & 0x80u) ? -v0 : v0;
    v1 = (pair & 0x8000u) ? -v1 : v1;
    out[j] = Pack2<kBf16>(MulRn(v0, g), MulRn(v1, g));
  }
  return Words8Out{U32x4{out[0], out[1], out[2], out[3]}, U32x4{out[4], out[5], out[6], out[7]}};
}

// MaterializeFp8KeyValue(code_i, m) for 16 FP8 key bytes: a copy when m == 1.
FP4KV_HD U32x4 MaterializeFp8KeyBlockFast(const U32x4& codes, float m) {
  if (m == 1.0f) return codes;
  const uint32_t c[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t out[4];
  FP4KV_UNROLL
  for (int j = 0; j < 4; ++j) {
    uint32_t w = 0;
    FP4KV_UNROLL
    for (int k = 0; k < 2; ++k) {
      const uint32_t pair = c[j] >> (16 * k);
      w |= E4m3Encode2(MulRn(E4m3Decode(static_cast<uint8_t>(pair)), m),
                       MulRn(E4m3Decode(static_cast<uint8_t>(pair >> 8)), m))
           << (16 * k);
    }
    out[j] = w;
  }
  return U32x4{out[0], out[1], out[2], out[3]};
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_FAST_FORMAT_CUH_
