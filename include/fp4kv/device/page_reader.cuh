// Device-side reader of NVFP4 pages, for kernels that consume the cache
// directly (fp4kv's decode attention uses exactly these functions).
//
// A (page, entry, head) row of K or V holds D/2 code bytes (value 2i in the
// low nibble of byte i) and D/16 E4M3 block scales (docs/format.md). The
// functions below locate rows through a pool's byte strides (NHD and HND,
// tuple and stacked pools alike) and turn code words into f16x2 / bf16x2 /
// f32 registers holding e2m1(code) * e4m3(scale) -- the global decode scale
// is left to the caller, who applies it once per dot product or output.
//
// The f16x2 decoders are the fast path. They return the tile scaled by
// 2^kHalfTileExponent (= 2^-7): e2m1 * e4m3 * 2^-7 is exact in f16 for every
// finite scale byte (at most 6 significant bits, magnitudes in
// [2^-17, 2688 * 2^-7]), and the factor lets sm_80 decode with bit placement
// only, while sm_89+ uses cvt.rn.f16x2.e4m3x2: an E2M1 nibble s|e1e0|m is the
// E4M3 byte s<<7 | e1e0<<3 | m<<2, whose value is exactly e2m1 * 2^-6.
// Multiply results by 2^7 (kHalfTileScale) once, outside the inner loop.
//
// Pairing: one 32-bit word of codes (8 values v0..v7) decodes into four
// f16x2 registers {v0,v2}, {v4,v6}, {v1,v3}, {v5,v7} (low half first). A
// matrix-multiply consumer permutes its other operand the same way; the
// scalar helpers (DecodeBlockFloat, DecodeBlockBf16x2) return natural order.
//
// FP8 key rows (E4M3 keys, NVFP4 values) have their own readers below
// (Fp8KeyWordToHalf2, LoadFp8KeyFloat).
//
// Requirements: compiled by nvcc for sm_80 or newer; code rows 8-byte
// aligned (the cache contract; FP8 key rows 16-byte), scale bytes any
// alignment.
#ifndef FP4KV_DEVICE_PAGE_READER_CUH_
#define FP4KV_DEVICE_PAGE_READER_CUH_

#include <cstdint>

#include "fp4kv/format.h"

namespace fp4kv {
namespace device {

inline constexpr int kHalfTileExponent = -7;
inline constexpr float kHalfTileScale = 128.0f;  // 2^-kHalfTileExponent

// One of K or V of a paged cache: base pointers and byte strides of the
// [page, entry, head] dimensions (NHD and HND differ only in the strides).
struct PagePool {
  const uint8_t* data = nullptr;    // codes, D/2 bytes per row
  const uint8_t* scales = nullptr;  // E4M3 scales, D/16 bytes per row
  int64_t data_page = 0, data_entry = 0, data_head = 0;     // bytes
  int64_t scale_page = 0, scale_entry = 0, scale_head = 0;  // bytes

  __device__ __forceinline__ const uint8_t* DataRow(int64_t page, int64_t entry,
                                                    int64_t head) const {
    return data + page * data_page + entry * data_entry + head * data_head;
  }
  __device__ __forceinline__ const uint8_t* ScaleRow(int64_t page, int64_t entry,
                                                     int64_t head) const {
    return scales + page * scale_page + entry * scale_entry + head * scale_head;
  }
};

// ---------------------------------------------------------------------------
// Code words to E4M3 bytes: the four low nibbles of `codes` (values 0,2,4,6)
// and the four high nibbles (values 1,3,5,7), each as an E4M3 byte worth
// e2m1 * 2^-6. Three to four integer instructions per word each.
// ---------------------------------------------------------------------------
// Low nibble n = s|mag per byte: n * 4 + (s << 3) * 12 = s << 7 | mag << 2
// (no carries between bytes); two masks and two multiply-adds, which run on
// the FMA pipe rather than the integer logic pipe that the rest of the
// decode keeps busy.
__device__ __forceinline__ uint32_t LowNibblesToE4m3(uint32_t codes) {
  return (codes & 0x0f0f0f0fu) * 4u + (codes & 0x08080808u) * 12u;
}
__device__ __forceinline__ uint32_t HighNibblesToE4m3(uint32_t codes) {
  return (codes & 0x80808080u) | ((codes >> 2) & 0x1c1c1c1cu);
}

// Two E4M3 bytes (in the low 16 bits, first value in the low byte) to f16x2
// scaled by 2^-8 (sm_80, pure bit placement: E4M3 bits s|eeee|mmm are the
// f16 bits s|0eeee|mmm0000000) or exactly (sm_89+, hardware conversion).
// E4M3NaN bytes are never produced by the nibble expansion.
__device__ __forceinline__ uint32_t E4m3x2ToHalf2Raw(uint32_t two_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h;
  asm("{\n .reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;\n}"
      : "=r"(h)
      : "r"(two_bytes));
  return h;
#else
  const uint32_t lo = ((two_bytes & 0x7fu) << 7) | ((two_bytes & 0x80u) << 8);
  const uint32_t hi = ((two_bytes & 0x7f00u) << 15) | ((two_bytes & 0x8000u) << 16);
  return lo | hi;
#endif
}

// Four E4M3 bytes to two f16x2 as E4m3x2ToHalf2Raw does: bytes 0, 1 into
// *lo, bytes 2, 3 into *hi (on sm_89+ the halves go to the conversions as
// 16-bit registers, with no masking or shifting).
__device__ __forceinline__ void E4m3x4ToHalf2x2Raw(uint32_t four_bytes, uint32_t* lo,
                                                   uint32_t* hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n"
      " cvt.rn.f16x2.e4m3x2 %1, b;\n}"
      : "=r"(*lo), "=r"(*hi)
      : "r"(four_bytes));
#else
  *lo = E4m3x2ToHalf2Raw(four_bytes & 0xffffu);
  *hi = E4m3x2ToHalf2Raw(four_bytes >> 16);
#endif
}

// Multiplier that turns E4m3x2ToHalf2Raw of an expanded code pair into the
// tile value e2m1 * s * 2^-7, from two scale bytes (low byte first): on
// sm_89+ (s * 2^-1), on sm_80 (s * 2^-8) * 2^15. Exact in f16.
__device__ __forceinline__ uint32_t ScalePairMultiplier(uint32_t two_scale_bytes) {
  const uint32_t s = E4m3x2ToHalf2Raw(two_scale_bytes & 0xffffu);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const uint32_t factor = 0x38003800u;  // 0.5, 0.5
#else
  const uint32_t factor = 0x78007800u;  // 32768, 32768
#endif
  uint32_t m;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(m) : "r"(s), "r"(factor));
  return m;
}

__device__ __forceinline__ uint32_t Half2Mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// One code word (8 values of one row, one block) under one block scale
// multiplier (ScalePairMultiplier of the scale byte twice): out = tile values
// {v0,v2}, {v4,v6}, {v1,v3}, {v5,v7} in f16x2, scaled by 2^-7.
__device__ __forceinline__ void DecodeWordHalf2(uint32_t codes, uint32_t scale_mul,
                                                uint32_t out[4]) {
  uint32_t h[4];
  E4m3x4ToHalf2x2Raw(LowNibblesToE4m3(codes), &h[0], &h[1]);
  E4m3x4ToHalf2x2Raw(HighNibblesToE4m3(codes), &h[2], &h[3]);
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = Half2Mul(h[i], scale_mul);
}

// The same 8 dims of two rows a and b (e.g. two tokens of V, whose values a
// matrix multiply over tokens pairs in one register): out[d] = f16x2 of
// {row a dim d, row b dim d} * 2^-7 for d = 0..7, natural dim order.
// `scale_mul` = ScalePairMultiplier(scale_a | scale_b << 8).
// The same from the two rows' bytes already interleaved: y0 = {a byte 0,
// b byte 0, a byte 1, b byte 1}, y1 = the same of bytes 2 and 3.
__device__ __forceinline__ void DecodeInterleavedPairHalf2(uint32_t y0, uint32_t y1,
                                                           uint32_t scale_mul, uint32_t out[8]) {
  const uint32_t y[2] = {y0, y1};
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // dims 4i .. 4i + 3
    uint32_t l0, l1, h0, h1;
    E4m3x4ToHalf2x2Raw(LowNibblesToE4m3(y[i]), &l0, &l1);   // {a d0, b d0}, {a d2, b d2}
    E4m3x4ToHalf2x2Raw(HighNibblesToE4m3(y[i]), &h0, &h1);  // {a d1, b d1}, {a d3, b d3}
    out[4 * i + 0] = Half2Mul(l0, scale_mul);
    out[4 * i + 1] = Half2Mul(h0, scale_mul);
    out[4 * i + 2] = Half2Mul(l1, scale_mul);
    out[4 * i + 3] = Half2Mul(h1, scale_mul);
  }
}

__device__ __forceinline__ void DecodeWordPairHalf2(uint32_t codes_a, uint32_t codes_b,
                                                    uint32_t scale_mul, uint32_t out[8]) {
  uint32_t y0, y1;
  asm("prmt.b32 %0, %1, %2, 0x5140;" : "=r"(y0) : "r"(codes_a), "r"(codes_b));
  asm("prmt.b32 %0, %1, %2, 0x7362;" : "=r"(y1) : "r"(codes_a), "r"(codes_b));
  DecodeInterleavedPairHalf2(y0, y1, scale_mul, out);
}

// ---------------------------------------------------------------------------
// FP8 key rows (KeyFormat::kFp8): Dk E4M3 bytes per (page, entry, head) row,
// byte d the code of value d, no block scales; a PagePool of such keys has
// scales == nullptr and its data strides locate the rows as above. Values
// are e4m3(code) * g_k (DequantFp8Key), g_k applied by the caller.
//
// Fp8KeyWordToHalf2 turns one 32-bit word of a row (values v0..v3, v0 in
// the low byte) into f16x2 {v0, v1} and {v2, v3}, scaled by
// 2^kFp8KeyHalfExponent(): exactly e4m3 on sm_89+ (cvt.rn.f16x2.e4m3x2),
// e4m3 * 2^-8 on sm_80 (bit placement: s|eeee|mmm becomes the f16 bits
// s|0eeee|mmm0000000, exact for every finite code, subnormals included).
// Multiply by Fp8KeyHalfScale() once, outside the inner loop. The NaN
// codes 0x7f / 0xff (the encoder makes them only from NaN input) decode to
// f16 NaN on sm_89+ and to the finite +-480 on sm_80: a consumer's result
// over a NaN key is unspecified.
// ---------------------------------------------------------------------------
__device__ __forceinline__ constexpr int Fp8KeyHalfExponent() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  return -8;
#else
  return 0;
#endif
}
__device__ __forceinline__ constexpr float Fp8KeyHalfScale() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  return 256.0f;
#else
  return 1.0f;
#endif
}

__device__ __forceinline__ void Fp8KeyWordToHalf2(uint32_t four_codes, uint32_t* lo, uint32_t* hi) {
  E4m3x4ToHalf2x2Raw(four_codes, lo, hi);
}

// Value d of an FP8 key row as f32, e4m3(code) exactly (NaN for 0x7f/0xff).
__device__ __forceinline__ float LoadFp8KeyFloat(const PagePool& pool, int64_t page, int64_t entry,
                                                 int64_t head, int d) {
  return E4m3Decode(__ldg(pool.DataRow(page, entry, head) + d));
}

// ---------------------------------------------------------------------------
// Whole blocks, natural order, unscaled (e2m1 * e4m3 exactly).
// ---------------------------------------------------------------------------
struct Fp4Block {
  uint32_t codes[2];  // 8 code bytes, value 2i in the low nibble of byte i
  uint8_t scale;      // E4M3 block scale byte
};

// Block `block` (values 16*block .. 16*block + 15) of row (page, entry, head).
__device__ __forceinline__ Fp4Block LoadBlock(const PagePool& pool, int64_t page, int64_t entry,
                                              int64_t head, int block) {
  Fp4Block b;
  const uint2 c = __ldg(reinterpret_cast<const uint2*>(pool.DataRow(page, entry, head) +
                                                       block * kBlockBytes));
  b.codes[0] = c.x;
  b.codes[1] = c.y;
  b.scale = __ldg(pool.ScaleRow(page, entry, head) + block);
  return b;
}

// out[i] = e2m1(code i) * e4m3(scale) as f32 (exact; NaN for a NaN scale).
__device__ __forceinline__ void DecodeBlockFloat(const Fp4Block& b, float out[16]) {
  const float s = E4m3Decode(b.scale);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const uint8_t code = static_cast<uint8_t>((b.codes[i / 8] >> (4 * (i % 8))) & 0xfu);
    out[i] = E2m1Decode(code) * s;
  }
}

// out[j] = bf16x2 {value 2j, value 2j + 1} (low half first), exact.
__device__ __forceinline__ void DecodeBlockBf16x2(const Fp4Block& b, uint32_t out[8]) {
  float v[16];
  DecodeBlockFloat(b, v);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    out[j] = static_cast<uint32_t>(FloatToBf16Bits(v[2 * j])) |
             (static_cast<uint32_t>(FloatToBf16Bits(v[2 * j + 1])) << 16);
  }
}

// out[j] = f16x2 {value 2j, value 2j + 1}, exact (unscaled; two f16
// multiplies per pair so that no intermediate overflows on sm_80).
__device__ __forceinline__ void DecodeBlockHalf2(const Fp4Block& b, uint32_t out[8]) {
  const uint32_t mul = ScalePairMultiplier(b.scale * 0x0101u);
  const uint32_t up = 0x58005800u;  // 128, 128
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    uint32_t t[4];  // {v0,v2}, {v4,v6}, {v1,v3}, {v5,v7} of this word
    DecodeWordHalf2(b.codes[w], mul, t);
#pragma unroll
    for (int i = 0; i < 4; ++i) t[i] = Half2Mul(t[i], up);
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(r) : "r"(t[0]), "r"(t[2]));  // v0, v1
    out[4 * w + 0] = r;
    asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(r) : "r"(t[0]), "r"(t[2]));  // v2, v3
    out[4 * w + 1] = r;
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(r) : "r"(t[1]), "r"(t[3]));  // v4, v5
    out[4 * w + 2] = r;
    asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(r) : "r"(t[1]), "r"(t[3]));  // v6, v7
    out[4 * w + 3] = r;
  }
}

}  // namespace device
}  // namespace fp4kv

#endif  // FP4KV_DEVICE_PAGE_READER_CUH_
