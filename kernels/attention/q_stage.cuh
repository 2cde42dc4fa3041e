// Internal: query rows into f16 for the Q operand of every attention family
// (rows_in_m.cuh, tokens_in_m.cuh, prefill.cuh, prefill_sm90.cuh).
//
// The tensor cores take f16 operands. f16 queries pass as they are; a bf16
// row is scaled by a power of two 2^kq that brings its largest magnitude to
// [2^14, 2^15) and then rounded to f16: exact for every value the scaled
// row keeps in f16's normal range (bf16 has 8 significant bits), and the
// factor is taken out of the row's logits (QLogitFactor), not out of Q.
#ifndef FP4KV_KERNELS_ATTENTION_Q_STAGE_CUH_
#define FP4KV_KERNELS_ATTENTION_Q_STAGE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "fp4kv/device/page_reader.cuh"
#include "kernels/attention/ptx.cuh"
#include "src/attention_params.h"

namespace fp4kv {
namespace kernels {

// Position of natural value x (0..7) of an 8-value group in
// DecodeWordHalf2's order {0,2,4,6,1,3,5,7}, and the inverse. The prefill
// families stage Q in this order for NVFP4 keys (the dot product does not
// care) and undo it on O's columns (V decodes in the same order).
__device__ __forceinline__ int PermPos8(int x) { return (x & 1) * 4 + (x >> 1); }
__device__ __forceinline__ int PermVal8(int pos) { return (pos & 3) * 2 + (pos >> 2); }

// Query row q_row (counted from the first query of the batch) of head qo_head.
__device__ __forceinline__ const uint16_t* QRowPtr(const internal::AttentionParams& p,
                                                   int64_t q_row, int qo_head) {
  return static_cast<const uint16_t*>(p.q) + q_row * p.q_row_stride +
         static_cast<int64_t>(qo_head) * p.q_head_stride;
}

// amax raised to the larger magnitude of the two bf16 values of w, both as
// f32 bit patterns (integer compares order non-negative floats).
__device__ __forceinline__ uint32_t Bf16PairAbsMax(uint32_t amax, uint32_t w) {
  const uint32_t lo = (w << 16) & 0x7fff0000u, hi = w & 0x7fff0000u;
  return max(amax, max(lo, hi));
}

// The scale of a bf16 row whose largest magnitude has the f32 bits amax:
// 2^kq (mul) with kq = 14 - exponent, clamped to normal f32 factors; 2^0 for
// a zero row or one holding an infinity or NaN.
struct QScale {
  int kq;
  float mul;
};
__device__ __forceinline__ QScale QScaleFor(uint32_t amax) {
  QScale s{0, 1.0f};
  if (amax != 0 && amax < 0x7f800000u) {
    const int e = static_cast<int>(amax >> 23) - 127;
    int k = 14 - e;
    k = k < -126 ? -126 : (k > 127 ? 127 : k);
    s.kq = k;
    s.mul = __uint_as_float(static_cast<uint32_t>(k + 127) << 23);
  }
  return s;
}

// The bf16 pair of w times mul as an f16 pair (the tokens-in-M family keeps
// Q in registers as pairs).
__device__ __forceinline__ uint32_t Bf16PairToHalf2(uint32_t w, float mul) {
  return PackHalf2(__uint_as_float(w << 16) * mul, __uint_as_float(w & 0xffff0000u) * mul);
}

// The factor of a row's raw logits (Q staged times 2^kq against the K
// tile's dequantized values): to log2 units, or to x / cap with a soft cap.
template <bool kSoftCap, bool kFp8K>
__device__ __forceinline__ float QLogitFactor(const internal::AttentionParams& p, float gk,
                                              int kq) {
  // The K tile's own factor: 2^7 (NVFP4), 1 or 2^8 (FP8, by arch).
  const float tile_scale = kFp8K ? device::Fp8KeyHalfScale() : device::kHalfTileScale;
  const float f =
      p.sm_scale * gk * tile_scale * __uint_as_float(static_cast<uint32_t>(127 - kq) << 23);
  return kSoftCap ? f / p.soft_cap : f * kLog2e;
}

// Half of a query row (D / 2 values) staged into shared memory by one lane
// of a pair: lanes 2r and 2r + 1 hold the two halves of the same row, and a
// bf16 row's scale covers both (Init is called by all 32 lanes).
template <int D, bool kBf16>
struct QHalfRow {
  const uint16_t* src;  // the half's first value; null: a padding row (zeros)
  QScale scale;

  __device__ __forceinline__ void Init(const uint16_t* half_src) {
    src = half_src;
    scale = QScale{0, 1.0f};
    if constexpr (kBf16) {
      uint32_t amax = 0;
      if (src != nullptr) {
#pragma unroll 4
        for (int i = 0; i < D / 16; ++i) {
          const uint4 v = *reinterpret_cast<const uint4*>(src + 8 * i);
          const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) amax = Bf16PairAbsMax(amax, w[j]);
        }
      }
      amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      scale = QScaleFor(amax);
    }
  }

  // store(i, h) for the half's 8-value groups i: h[j] = value 8i + j as f16
  // (a bf16 value times the row's scale).
  template <class Store>
  __device__ __forceinline__ void ForEachGroup(Store store) const {
#pragma unroll 2
    for (int i = 0; i < D / 16; ++i) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (src != nullptr) v = *reinterpret_cast<const uint4*>(src + 8 * i);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
      uint16_t h[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t bits = (w[j / 2] >> (16 * (j % 2))) & 0xffffu;
        if constexpr (kBf16) {
          h[j] = static_cast<uint16_t>(PackHalf2(__uint_as_float(bits << 16) * scale.mul, 0.0f) &
                                       0xffffu);
        } else {
          h[j] = static_cast<uint16_t>(bits);
        }
      }
      store(i, h);
    }
  }
};

// Eight f16 values as one 16-byte word in the given order: value j at
// position pos(j).
template <class Pos>
__device__ __forceinline__ uint4 PackHalf8(const uint16_t (&h)[8], Pos pos) {
  uint16_t o8[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) o8[pos(j)] = h[j];
  return make_uint4(o8[0] | (static_cast<uint32_t>(o8[1]) << 16),
                    o8[2] | (static_cast<uint32_t>(o8[3]) << 16),
                    o8[4] | (static_cast<uint32_t>(o8[5]) << 16),
                    o8[6] | (static_cast<uint32_t>(o8[7]) << 16));
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_Q_STAGE_CUH_
