// fp4kv number format: E2M1 values, E4M3 block scales, one 16-value block.
//
// Every function here is __host__ __device__ and uses only IEEE fp32
// operations in a fixed order, so the CPU reference and the CUDA kernels that
// call them produce the same bits. Nothing here allocates or holds state.
//
// value = e2m1(code) * e4m3(block_scale) * global_scale      (see docs/format.md)
#ifndef FP4KV_FORMAT_H_
#define FP4KV_FORMAT_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FP4KV_HD __host__ __device__ __forceinline__
#else
#define FP4KV_HD inline
#endif
#if defined(__CUDA_ARCH__)
#define FP4KV_UNROLL _Pragma("unroll")
#else
#define FP4KV_UNROLL
#endif

namespace fp4kv {

// Values per block scale, and packed bytes per block.
inline constexpr int kBlockSize = 16;
inline constexpr int kBlockBytes = kBlockSize / 2;
inline constexpr float kE2m1Max = 6.0f;
inline constexpr float kE4m3Max = 448.0f;

// ---------------------------------------------------------------------------
// Bit casts and IEEE-exact arithmetic helpers. On the device the _rn
// intrinsics keep the compiler from contracting a*b+c into an FMA, which would
// round differently from the host.
// ---------------------------------------------------------------------------
FP4KV_HD uint32_t FloatBits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

FP4KV_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

FP4KV_HD float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

FP4KV_HD float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

FP4KV_HD float SubRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

FP4KV_HD float DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

FP4KV_HD float AbsF(float x) { return BitsFloat(FloatBits(x) & 0x7fffffffu); }

// Global decode scales. A valid g is positive, finite, and small enough that
// the largest value a cache can hold, 6 * 448 * g, is finite: g <=
// kMaxGlobalScale = 0x79C30C30 (about 1.266e35, FLT_MAX / 2688). Every
// product the quantizer and the readers form is then finite, so block scale
// bytes stay in 0x00..0x7E. Ops reject other fixed values; a scale read
// from memory when an op runs cannot be checked and, outside this range,
// gives defined but meaningless bytes.
FP4KV_HD float MaxGlobalScale() { return BitsFloat(0x79c30c30u); }
FP4KV_HD bool IsValidGlobalScale(float g) { return g > 0.0f && g <= MaxGlobalScale(); }

// Rounds the integer `mag` (a magnitude scaled so the target's unit is bit
// `shift`) to nearest, ties to even, and returns mag >> shift rounded.
FP4KV_HD uint32_t ShiftRoundNearestEven(uint32_t mag, uint32_t shift) {
  if (shift == 0) return mag;
  if (shift >= 32) return 0;
  const uint32_t q = mag >> shift;
  const uint32_t rem = mag & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// Rounds |x| (given as fp32 bits without sign, finite) to a float format with
// `mbits` mantissa bits, exponent bias `bias`, subnormals, and no
// inf/NaN handling. Returns the target's magnitude bits, possibly one past the
// largest finite code (the caller saturates).
FP4KV_HD uint32_t RoundMagnitude(uint32_t abs_bits, int mbits, int bias) {
  const int exp = static_cast<int>(abs_bits >> 23);  // biased fp32 exponent
  const int min_normal_exp = 127 - bias + 1;          // fp32 exp of target's 1.0*2^(1-bias)
  if (exp >= min_normal_exp) {
    // Normal in the target: drop 23-mbits mantissa bits with RNE; a carry
    // into the exponent is the correct result.
    const uint32_t shift = static_cast<uint32_t>(23 - mbits);
    const uint32_t rounded = ShiftRoundNearestEven(abs_bits, shift);
    return rounded - (static_cast<uint32_t>(127 - bias) << mbits);
  }
  // Subnormal in the target: value / 2^(1-bias-mbits) rounded to an integer.
  uint32_t mant = abs_bits & 0x7fffffu;
  int e = exp;
  if (exp != 0) {
    mant |= 0x800000u;
  } else {
    e = 1;  // fp32 subnormal
  }
  // value = mant * 2^(e-150); unit = 2^(1-bias-mbits); shift = unit_exp - (e-150)
  const int shift = (1 - bias - mbits) - (e - 150);
  return ShiftRoundNearestEven(mant, static_cast<uint32_t>(shift));
}

// ---------------------------------------------------------------------------
// E2M1 (FP4): sign, 2 exponent bits (bias 1), 1 mantissa bit.
// Magnitudes by code 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
// Encode: round to nearest, ties to even, saturating to +-6; the sign is kept
// (so -0 and negative values that round to zero give code 0x8); NaN gives +6
// (code 0x7), as the CUDA toolkit's host conversion does.
// ---------------------------------------------------------------------------
FP4KV_HD uint8_t E2m1Encode(float x) {
  const uint32_t bits = FloatBits(x);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return 0x7;  // NaN
  const uint8_t sign = static_cast<uint8_t>((bits >> 28) & 0x8u);
  if (abs_bits >= 0x40c00000u) return sign | 0x7;  // >= 6 or inf
  uint32_t m = RoundMagnitude(abs_bits, 1, 1);
  if (m > 7u) m = 7u;
  return static_cast<uint8_t>(sign | m);
}

FP4KV_HD float E2m1Decode(uint8_t code) {
  // Index by the 3 magnitude bits; the sign is bit 3.
  const uint32_t mag = code & 0x7u;
  // value*2 for codes 0..7 is 0,1,2,3,4,6,8,12
  const uint32_t twice = mag < 4u ? mag : (mag == 4u ? 4u : (mag == 5u ? 6u : (mag == 6u ? 8u : 12u)));
  const float v = static_cast<float>(twice) * 0.5f;
  return (code & 0x8u) ? -v : v;
}

// ---------------------------------------------------------------------------
// E4M3 (OCP e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits, no
// infinity, NaN = S.1111.111. Encode: round to nearest, ties to even,
// saturating to +-448 (inf too); NaN of either sign gives 0x7f, as the CUDA
// toolkit's conversion and the cvt.rn.satfinite.e4m3x2 instruction do.
// Decode keeps the sign of both NaN codes (0x7f, 0xff).
// ---------------------------------------------------------------------------
FP4KV_HD uint8_t E4m3Encode(float x) {
  const uint32_t bits = FloatBits(x);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (abs_bits > 0x7f800000u) return 0x7f;  // NaN, sign dropped
  if (abs_bits >= 0x43e00000u) return sign | 0x7e;  // >= 448 or inf
  uint32_t m = RoundMagnitude(abs_bits, 3, 7);
  if (m > 0x7eu) m = 0x7eu;
  return static_cast<uint8_t>(sign | m);
}

FP4KV_HD float E4m3Decode(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xfu;
  const uint32_t man = b & 0x7u;
  if (exp == 0xfu && man == 0x7u) return BitsFloat(sign | 0x7fc00000u);
  if (exp == 0) {
    // subnormal: man * 2^-9, exact in fp32
    const float v = static_cast<float>(man) * 0.001953125f;
    return BitsFloat(sign | FloatBits(v));
  }
  return BitsFloat(sign | ((exp + 120u) << 23) | (man << 20));
}

// ---------------------------------------------------------------------------
// fp32 -> fp16 / bf16, round to nearest even (the results of __float2half_rn
// and __float2bfloat16_rn for every non-NaN input); NaN gives 0x7fff.
// ---------------------------------------------------------------------------
FP4KV_HD uint16_t FloatToBf16Bits(float x) {
  const uint32_t bits = FloatBits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

FP4KV_HD float Bf16BitsToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

FP4KV_HD uint16_t FloatToHalfBits(float x) {
  const uint32_t bits = FloatBits(x);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  if (abs_bits > 0x7f800000u) return 0x7fffu;
  if (abs_bits >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65536 or inf
  return static_cast<uint16_t>(sign | RoundMagnitude(abs_bits, 10, 15));
}

FP4KV_HD float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return BitsFloat(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;  // 2^-24
    return BitsFloat(sign | FloatBits(v));
  }
  return BitsFloat(sign | ((exp + 112u) << 23) | (man << 13));
}

// Rounds a float to the nearest fp16 value (as a float).
FP4KV_HD float RoundToHalf(float x) { return HalfBitsToFloat(FloatToHalfBits(x)); }

// ---------------------------------------------------------------------------
// Quantization recipe (see recipe.h for the public helpers around it).
// ---------------------------------------------------------------------------
enum class RecipeKind : uint8_t {
  kStandard = 0,    // block scale from amax / 6
  kFourOverSix = 1, // also try amax / 4, keep the candidate with lower error
};

enum class ErrorMetric : uint8_t {
  kMae = 0,  // sum |x - dq|
  kMse = 1,  // sum (x - dq)^2
};

struct Recipe {
  RecipeKind kind = RecipeKind::kStandard;
  // Top of the block-scale range used to derive global scales: 448, or 256
  // for 4over6 so that the amax/4 candidate (1.5x larger) stays below 448.
  int e4m3_max = 448;
  ErrorMetric metric = ErrorMetric::kMae;
  // 4over6 only: evaluate the candidates' errors in fp16 arithmetic.
  bool fast_math = false;

  static constexpr Recipe Standard() { return Recipe{}; }
  static constexpr Recipe FourOverSix(int e4m3_max = 256, ErrorMetric metric = ErrorMetric::kMae,
                                      bool fast_math = false) {
    return Recipe{RecipeKind::kFourOverSix, e4m3_max, metric, fast_math};
  }
};

FP4KV_HD bool operator==(const Recipe& a, const Recipe& b) {
  return a.kind == b.kind && a.e4m3_max == b.e4m3_max && a.metric == b.metric &&
         a.fast_math == b.fast_math;
}

// ---------------------------------------------------------------------------
// One block of 16 values.
// ---------------------------------------------------------------------------

// Quantizes 16 values with block scale byte `scale_byte` already chosen:
// codes_i = e2m1(x_i * r), r = 1 / (s * g) (0 when s == 0). Element 2i goes to
// the low nibble of packed[i], element 2i+1 to the high nibble. Returns the
// packed codes as two 32-bit words (bytes 0..3, 4..7 little-endian).
FP4KV_HD void EncodeBlockWithScale(const float (&x)[kBlockSize], float global_scale,
                                   uint8_t scale_byte, uint32_t (&packed)[2]) {
  const float s = E4m3Decode(scale_byte);
  const float sg = MulRn(s, global_scale);
  float r = (s == 0.0f || sg == 0.0f) ? 0.0f : DivRn(1.0f, sg);
  // A subnormal s*g would make r infinite and 0 * r NaN; clamp to the largest
  // finite float so zeros stay zero and everything else saturates.
  if (FloatBits(r) == 0x7f800000u) r = BitsFloat(0x7f7fffffu);
  packed[0] = 0;
  packed[1] = 0;
FP4KV_UNROLL
  for (int i = 0; i < kBlockSize; ++i) {
    const uint32_t c = E2m1Encode(MulRn(x[i], r));
    packed[i / 8] |= c << (4 * (i % 8));
  }
}

// Dequantizes one code under block scale s and global scale g: (e2m1 * s) * g.
FP4KV_HD float DequantValue(uint8_t code, float s, float g) {
  return MulRn(MulRn(E2m1Decode(code), s), g);
}

// Summed error of a candidate against the input under `recipe`'s metric.
FP4KV_HD float CandidateError(const float (&x)[kBlockSize], const uint32_t (&packed)[2],
                              uint8_t scale_byte, float g, const Recipe& recipe) {
  const float s = E4m3Decode(scale_byte);
  float err = 0.0f;
FP4KV_UNROLL
  for (int i = 0; i < kBlockSize; ++i) {
    const uint8_t c = static_cast<uint8_t>((packed[i / 8] >> (4 * (i % 8))) & 0xfu);
    const float dq = DequantValue(c, s, g);
    if (!recipe.fast_math) {
      const float d = SubRn(x[i], dq);
      const float e = recipe.metric == ErrorMetric::kMae ? AbsF(d) : MulRn(d, d);
      err = AddRn(err, e);
    } else {
      // fp16 arithmetic: every operation rounded to fp16 (exact emulation of
      // IEEE half add/sub/mul, since fp32 holds their exact-rounding).
      const float d = RoundToHalf(SubRn(RoundToHalf(x[i]), RoundToHalf(dq)));
      const float e = recipe.metric == ErrorMetric::kMae ? AbsF(d) : RoundToHalf(MulRn(d, d));
      err = RoundToHalf(AddRn(err, e));
    }
  }
  return err;
}

// Quantizes one 16-value block under global decode scale g (positive, finite)
// and `recipe`. Writes 8 packed bytes as two words and returns the scale byte.
//   amax = max|x|; b = e4m3(amax / (6 g)); s = decode(b);
//   r = 1 / (s g) (0 when amax or s is 0); code_i = e2m1(x_i r).
// 4over6 also forms b' = e4m3(amax / (4 g)), and keeps it only when its summed
// error is strictly lower. NaN inputs are ignored by amax.
FP4KV_HD uint8_t QuantizeBlock(const float (&x)[kBlockSize], float g, const Recipe& recipe,
                               uint32_t (&packed)[2]) {
  float amax = 0.0f;
FP4KV_UNROLL
  for (int i = 0; i < kBlockSize; ++i) {
    const float a = AbsF(x[i]);
    amax = a > amax ? a : amax;
  }
  if (amax == 0.0f) {
    packed[0] = 0;
    packed[1] = 0;
    return 0;
  }
  const uint8_t b6 = E4m3Encode(DivRn(amax, MulRn(6.0f, g)));
  EncodeBlockWithScale(x, g, b6, packed);
  if (recipe.kind != RecipeKind::kFourOverSix) return b6;

  uint32_t packed4[2];
  const uint8_t b4 = E4m3Encode(DivRn(amax, MulRn(4.0f, g)));
  EncodeBlockWithScale(x, g, b4, packed4);
  const float e6 = CandidateError(x, packed, b6, g, recipe);
  const float e4 = CandidateError(x, packed4, b4, g, recipe);
  if (e4 < e6) {
    packed[0] = packed4[0];
    packed[1] = packed4[1];
    return b4;
  }
  return b6;
}

// Largest |x_i| of a block, NaN ignored (0 for a block of zeros and NaNs).
FP4KV_HD float BlockAmax(const float (&x)[kBlockSize]) {
  float amax = 0.0f;
FP4KV_UNROLL
  for (int i = 0; i < kBlockSize; ++i) {
    const float a = AbsF(x[i]);
    amax = a > amax ? a : amax;  // false for NaN
  }
  return amax;
}

// What a block's stored scale says about the global scale g it was
// quantized under (the appender's optional scale-event counters):
//   kSaturated: amax / (6 g) > 448, so the block scale is clamped at the E4M3
//               maximum and the block's largest values were clipped;
//   kUnderflow: the block is nonzero but its scale byte decodes to 0, so it
//               is stored as all zeros.
// amax is BlockAmax of the input; scale_byte the byte stored.
enum class ScaleEvent : uint8_t { kNone = 0, kSaturated = 1, kUnderflow = 2 };

FP4KV_HD ScaleEvent ClassifyBlockScale(float amax, float g, uint8_t scale_byte) {
  if (!(amax > 0.0f)) return ScaleEvent::kNone;
  if (DivRn(amax, MulRn(6.0f, g)) > kE4m3Max) return ScaleEvent::kSaturated;
  if ((scale_byte & 0x7fu) == 0) return ScaleEvent::kUnderflow;
  return ScaleEvent::kNone;
}

// Dequantizes one block to fp32: out_i = (e2m1(code_i) * s) * g.
FP4KV_HD void DequantizeBlock(const uint32_t (&packed)[2], uint8_t scale_byte, float g,
                              float (&out)[kBlockSize]) {
  const float s = E4m3Decode(scale_byte);
FP4KV_UNROLL
  for (int i = 0; i < kBlockSize; ++i) {
    out[i] = DequantValue(static_cast<uint8_t>((packed[i / 8] >> (4 * (i % 8))) & 0xfu), s, g);
  }
}

// FP8 materialization of one value: e4m3((e2m1 * s) * m), m = g / fp8_scale
// computed once per tensor in fp32 (see Fp8MaterializeMultiplier).
FP4KV_HD float Fp8MaterializeMultiplier(float global_scale, float fp8_scale) {
  return DivRn(global_scale, fp8_scale);
}

// The smallest fp32 FP8 decode scale f with (6 * 448) * (g / f) <= 448, so
// that no value a cache with global decode scale g can hold saturates the FP8
// range. Precondition: IsValidGlobalScale(g) (MinFp8Scale in
// ops.h validates; here any other g returns 6 * g unchanged).
FP4KV_HD float MinFp8ScaleFor(float g) {
  float f = MulRn(6.0f, g);
  if (!(g > 0.0f) || FloatBits(AbsF(f)) >= 0x7f800000u) return f;
  const float top = MulRn(6.0f, kE4m3Max);
  // Positive floats are ordered like their bits: +1 / -1 is the next float up / down.
  while (MulRn(top, DivRn(g, f)) > kE4m3Max) f = BitsFloat(FloatBits(f) + 1u);
  for (;;) {
    const float lower = BitsFloat(FloatBits(f) - 1u);
    if (!(lower > 0.0f) || MulRn(top, DivRn(g, lower)) > kE4m3Max) break;
    f = lower;
  }
  return f;
}

FP4KV_HD uint8_t MaterializeFp8Value(uint8_t code, float s, float multiplier) {
  return E4m3Encode(MulRn(MulRn(E2m1Decode(code), s), multiplier));
}

// ---------------------------------------------------------------------------
// FP8 keys (KeyFormat::kFp8, docs/format.md "FP8 key pages"): one E4M3 byte
// per key value under the layer's key global scale g_k.
//   decode:  value = fl(e4m3(code) * g_k)
//   encode:  code  = E4m3Encode(fl(x * r)),  r = fl(1 / g_k) computed once
//            per layer (Fp8KeyEncodeMultiplier); saturates at +-448, NaN ->
//            0x7f, like every E4M3 encode here.
// A key global scale is sized so that amax lands on the top of the E4M3
// range: g_k = amax / 448 (MakeFp8KeyScale), with the same edge rules as
// MakeGlobalScale. Valid key scales are the valid global scales
// (IsValidGlobalScale), so 448 * g_k is finite.
// ---------------------------------------------------------------------------
FP4KV_HD float Fp8KeyEncodeMultiplier(float g_k) {
  float r = DivRn(1.0f, g_k);
  // A subnormal g_k would make r infinite and 0 * r NaN: clamp so that zeros
  // stay zero and everything else saturates.
  if (FloatBits(r) == 0x7f800000u) r = BitsFloat(0x7f7fffffu);
  return r;
}

FP4KV_HD uint8_t QuantizeFp8Key(float x, float encode_multiplier) {
  return E4m3Encode(MulRn(x, encode_multiplier));
}

FP4KV_HD float DequantFp8Key(uint8_t code, float g_k) { return MulRn(E4m3Decode(code), g_k); }

FP4KV_HD float MakeFp8KeyScale(float amax) {
  const float kFltMax = BitsFloat(0x7f7fffffu);
  const float kFltMin = BitsFloat(0x00800000u);
  float a = amax;
  if (!(a > 0.0f)) a = 1.0f;  // zero, negative, NaN: as MakeGlobalScale
  if (a > kFltMax) a = kFltMax;
  const float g = DivRn(a, kE4m3Max);
  if (g > MaxGlobalScale()) return MaxGlobalScale();
  return g < kFltMin ? kFltMin : g;
}

// FP8 materialization of an FP8 key byte to output decode scale f:
// multiplier m = fl(g_k / f) (Fp8MaterializeMultiplier); m == 1 copies the
// byte unchanged (NaN codes included), any other m re-encodes
// E4m3Encode(fl(e4m3(code) * m)). The smallest f that cannot saturate is g_k
// itself (MinFp8ScaleForFp8Keys), so by default key pages are copied.
FP4KV_HD uint8_t MaterializeFp8KeyValue(uint8_t code, float multiplier) {
  return multiplier == 1.0f ? code : E4m3Encode(MulRn(E4m3Decode(code), multiplier));
}

FP4KV_HD float MinFp8ScaleForFp8Keys(float g_k) { return g_k; }

// Scale events of 16 consecutive FP8 key values (one NVFP4 block's worth, so
// the counters keep the unit "blocks"), given their amax (NaN ignored) and the
// encode multiplier r: saturated when fl(amax * r) > 448 (a value is clipped
// to +-448), underflow when amax > 0 but fl(amax * r) encodes to a zero code
// (every value of the 16 became zero).
FP4KV_HD ScaleEvent ClassifyFp8KeyBlock(float amax, float encode_multiplier) {
  if (!(amax > 0.0f)) return ScaleEvent::kNone;
  const float q = MulRn(amax, encode_multiplier);
  if (q > kE4m3Max) return ScaleEvent::kSaturated;
  if ((E4m3Encode(q) & 0x7fu) == 0) return ScaleEvent::kUnderflow;
  return ScaleEvent::kNone;
}

}  // namespace fp4kv

#endif  // FP4KV_FORMAT_H_
