// Internal: the (m, l, O) state of a query row and its end, shared by every
// attention family (rows_in_m.cuh, tokens_in_m.cuh, the CTA combine and the
// split merge in merge.cuh, prefill.cuh, prefill_sm90.cuh).
//
// A row's state is its running max m (log2 units), its sum l of
// 2^(s - m) over the keys so far, and its unnormalized output O. Partial
// states (warps of a CTA, split chunks) merge onto their common max; a
// finished row is normalized once (FinishRow: 1 / l, the optional sink
// logit, the LSE) and written in the output dtype.
#ifndef FP4KV_KERNELS_ATTENTION_ROW_STATE_CUH_
#define FP4KV_KERNELS_ATTENTION_ROW_STATE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "fp4kv/device/page_reader.cuh"
#include "kernels/attention/ptx.cuh"
#include "kernels/attention/q_stage.cuh"
#include "kernels/attention/schedule.cuh"
#include "src/attention_params.h"

namespace fp4kv {
namespace kernels {

// A max as the offset of exponents 2^(x - m): a row that attended nothing
// (m = -inf) offsets by 0, so that its terms stay 0 rather than NaN.
__device__ __forceinline__ float MaxOffset(float m) { return m == -INFINITY ? 0.0f : m; }

// The running max of the online softmax as handed on: the kernels take P =
// 2^(s - m + kAttnPOffset) (schedule.cuh), so l carries 2^kAttnPOffset and
// the max handed to the combine, the merge and FinishRow is m - kAttnPOffset.
__device__ __forceinline__ float HandedOnMax(float m) {
  return m == -INFINITY ? m : m - kAttnPOffset;
}

// One online-softmax step of a row, the same in every family: the tile's
// max mx moves the running max *m only when it exceeds it by more than
// kAttnRescaleSlack (log2 units), so P = 2^(s - *m_use) stays below
// 2^(kAttnRescaleSlack + kAttnPOffset) (within f16, no fp32 overflow) and O
// is rescaled on few tiles. Updates *m, sets *m_use (the offset of the
// tile's exponents; 0 for a row that has attended nothing) and returns the
// factor the row's l and O are rescaled by (exactly 1 when *m did not move).
__device__ __forceinline__ float OnlineMaxStep(float* m, float mx, float* m_use) {
  const float m_old = *m;
  const float m_new = mx - m_old > kAttnRescaleSlack ? fmaxf(m_old, mx) : m_old;
  *m_use = m_new == -INFINITY ? 0.0f : m_new - kAttnPOffset;
  *m = m_new;
  return m_new == m_old ? 1.0f : Ex2(m_old - m_new);
}

// x summed over the lanes lane ^ o for o = kFirst, 2 kFirst, ..., kLast
// (the lanes that hold the other columns of a row).
template <int kFirst, int kLast>
__device__ __forceinline__ float RowLaneSum(float x) {
#pragma unroll
  for (int o = kFirst; o <= kLast; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The max of m and the maxima ml(j).x of kN partial rows.
template <int kN, class Ml>
__device__ __forceinline__ float PartialsMax(float m, Ml ml) {
#pragma unroll
  for (int j = 0; j < kN; ++j) m = fmaxf(m, ml(j).x);
  return m;
}

// l plus the sums ml(j).y of kN partial rows rescaled to the offset m_use:
// e_j = 2^(ml(j).x - m_use); add(j, e_j) adds partial j's O likewise.
template <int kN, class Ml, class Add>
__device__ __forceinline__ float SumPartials(float l, float m_use, Ml ml, Add add) {
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const float2 v = ml(j);
    const float e = Ex2(v.x - m_use);
    l += v.y * e;
    add(j, e);
  }
  return l;
}

// The factor that rescales a warp's O of CTA row `row` (its max m, handed
// on) to the CTA's max of the row; ml_sm[w][row]: warp w's (max, sum).
__device__ __forceinline__ float ToCtaRowMax(const float2 (*ml_sm)[kAttnTile], int row, float m) {
  const float mx = PartialsMax<kAttnWarps>(-INFINITY, [&](int w) { return ml_sm[w][row]; });
  return Ex2(m - MaxOffset(mx));
}

// acc += e * v, per component.
__device__ __forceinline__ void AddScaled(float4* acc, float e, float4 v) {
  acc->x += e * v.x;
  acc->y += e * v.y;
  acc->z += e * v.z;
  acc->w += e * v.w;
}

// Final normalization of one row: out scale and lse from (m, l) in log2
// units and the optional sink logit. Returns false for a row that attended
// nothing (out 0, lse -inf).
__device__ __forceinline__ bool FinishRow(float m, float l, const float* sinks, int qo_head,
                                          float* inv, float* lse) {
  if (!(l > 0.0f)) {
    *inv = 0.0f;
    *lse = -INFINITY;
    return false;
  }
  float big = m, z = l;
  if (sinks != nullptr) {
    const float sk = sinks[qo_head] * kLog2e;
    big = m > sk ? m : sk;
    const float f = Ex2(m - big);
    z = l * f + Ex2(sk - big);
    *inv = f / z;
  } else {
    *inv = 1.0f / l;
  }
  *lse = (big + __log2f(z)) * kLn2;
  return true;
}

// The end of a row of head qo_head with handed-on (m, l): f multiplies its
// unnormalized O into the output (normalization, g_v and the V tile's 2^7),
// lse is its LSE. A row that is not `written` gets f = 0 and lse = -inf
// without reading its state.
struct RowTail {
  float f;
  float lse;
};
__device__ __forceinline__ RowTail FinishRowTail(const internal::AttentionParams& p, float m,
                                                 float l, int qo_head, float gv,
                                                 bool written = true) {
  float inv = 0.0f, lse = -INFINITY;
  if (written) FinishRow(m, l, p.sinks, qo_head, &inv, &lse);
  return RowTail{inv * gv * device::kHalfTileScale, lse};
}

// The output row of query row q_row (counted from the batch's first query)
// and head qo_head, and the store of its LSE (when the caller asked for it).
__device__ __forceinline__ uint16_t* OutRowPtr(const internal::AttentionParams& p, int64_t q_row,
                                               int qo_head) {
  return static_cast<uint16_t*>(p.out) + q_row * p.out_row_stride +
         static_cast<int64_t>(qo_head) * p.out_head_stride;
}
__device__ __forceinline__ void StoreRowLse(const internal::AttentionParams& p, int64_t q_row,
                                            int qo_head, float lse) {
  if (p.lse != nullptr) p.lse[q_row * p.lse_row_stride + qo_head] = lse;
}

// ---------------------------------------------------------------------------
// The row tail of the prefill families, whose warps own whole rows: a
// warp's output rows are staged in shared memory in natural dim order, then
// copied out with 16-byte stores. piece(rl, n) is the address of 16-byte
// piece n (dims 8n..8n+7) of staging row rl.
// ---------------------------------------------------------------------------

// Finishes item row `row` (staging row rl) held in mma.sync accumulator
// layout: this lane has its columns 2c, 2c+1 of every n-tile in o[n][2i],
// o[n][2i + 1] (dims in DecodeWordHalf2's order within each n-tile) and
// its (m, l) partial over the 4 lanes of the quad.
template <int D, bool kBf16, class Piece>
__device__ __forceinline__ void FinishPrefillRow(const internal::AttentionParams& p,
                                                 const PrefillItem& it, int row, int rl,
                                                 float m_run, float l_run,
                                                 const float (&o)[D / 8][4], int i, int c,
                                                 float gv, Piece piece) {
  const float l = RowLaneSum<1, 2>(l_run);
  const int qi = row / p.group, gi = row - qi * p.group;
  const int qo_head = it.head * p.group + gi;
  const RowTail t = FinishRowTail(p, HandedOnMax(m_run), l, qo_head, gv, row < it.n_rows);
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      // Column 2c + e of n-tile n is natural dim PermVal8(2c + e) of its 8.
      reinterpret_cast<uint16_t*>(piece(rl, n))[PermVal8(2 * c + e)] =
          PackOut1<kBf16>(o[n][2 * i + e] * t.f);
    }
  }
  if (c == 0 && p.lse != nullptr && row < it.n_rows && it.pos_base + qi >= 0) {
    p.lse[(it.r.q_begin + qi) * p.lse_row_stride + qo_head] = t.lse;
  }
}

// Copies staging rows rl0 .. rl0 + kRows - 1 (item rows row0 + rl) to the
// output, the rows that are written (a query at a negative position is
// not): one warp, 16 bytes a lane and store.
template <int D, int kRows, class Piece>
__device__ __forceinline__ void StorePrefillRows(const internal::AttentionParams& p,
                                                 const PrefillItem& it, int row0, int rl0,
                                                 int lane, Piece piece) {
  constexpr int kVecs = D / 8;  // 16-byte pieces of a row
  for (int idx = lane; idx < kRows * kVecs; idx += 32) {
    const int rl = rl0 + idx / kVecs, vi = idx % kVecs;
    const int row = row0 + rl;
    const int qi = row / p.group, gi = row - qi * p.group;
    if (row < it.n_rows && it.pos_base + qi >= 0) {
      uint16_t* dst = OutRowPtr(p, it.r.q_begin + qi, it.head * p.group + gi) + 8 * vi;
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(piece(rl, vi));
    }
  }
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_ROW_STATE_CUH_
