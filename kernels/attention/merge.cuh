// Internal: the end of a decode item (StoreItemRows: the combine of the
// CTA's warps) and the merge of split chunks (MergeAttentionKernel), shared
// by both decode families; the row state they merge is row_state.cuh's.
#ifndef FP4KV_KERNELS_ATTENTION_MERGE_CUH_
#define FP4KV_KERNELS_ATTENTION_MERGE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "fp4kv/device/page_reader.cuh"
#include "kernels/attention/ptx.cuh"
#include "kernels/attention/row_state.cuh"
#include "kernels/attention/schedule.cuh"
#include "src/attention_params.h"

namespace fp4kv {
namespace kernels {

// The end of an item: combines the kAttnWarps warps' (O, max, sum) of each
// of the 16 query rows and writes the output row (unsplit item) or the
// partial (split item). On entry warp w's shared region (smem + w *
// warp_bytes) holds its O rescaled to the CTA's row max, [16][red_stride]
// floats in natural dim order, and ml_sm[w][row] its (max, sum); rows that
// are not stored are never read. 128 threads: 8 per row.
template <int D, bool kBf16>
__device__ __forceinline__ void StoreItemRows(const AttnLaunch& a, const AttnItem& it,
                                              const uint8_t* smem, int warp_bytes, int red_stride,
                                              const float2 (*ml_sm)[kAttnTile]) {
  static_assert(kAttnThreads == 8 * kAttnTile, "8 threads per row");
  const internal::AttentionParams& p = a.p;
  const float gv = p.v_scale.Get();
  const int row = threadIdx.x >> 3, part = threadIdx.x & 7;
  // The warps' O are rescaled to the CTA's max already: only l merges.
  const auto ml = [&](int w) { return ml_sm[w][row]; };
  const float mx = PartialsMax<kAttnWarps>(-INFINITY, ml);
  const float m_use = MaxOffset(mx);
  const float l = SumPartials<kAttnWarps>(0.0f, m_use, ml, [](int, float) {});
  const AttnRow rw = GetAttnRow(p, it, row);
  if (rw.stored) {
    float4 acc[D / 32];
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      const int col = 4 * part + 32 * j;
      acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) {
        const float4 v = *reinterpret_cast<const float4*>(
            reinterpret_cast<const float*>(smem + w * warp_bytes) + row * red_stride + col);
        acc[j].x += v.x;
        acc[j].y += v.y;
        acc[j].z += v.z;
        acc[j].w += v.w;
      }
    }
    const int head = it.head * p.group + rw.gi;
    if (it.splits > 1) {
      const int64_t base = static_cast<int64_t>(it.slot) * a.rows_per_slot + row;
      float* dst = a.ws_o + base * D;
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {
        *reinterpret_cast<float4*>(dst + 4 * part + 32 * j) = acc[j];
      }
      if (part == 0) *reinterpret_cast<float2*>(a.ws_ml + base * 2) = make_float2(mx, l);
    } else {
      const RowTail t = FinishRowTail(p, m_use, l, head, gv);
      const int64_t qrow = it.r.q_begin + rw.qi;
      uint16_t* out = OutRowPtr(p, qrow, head);
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {
        uint2 v;
        v.x = PackOut2<kBf16>(acc[j].x * t.f, acc[j].y * t.f);
        v.y = PackOut2<kBf16>(acc[j].z * t.f, acc[j].w * t.f);
        *reinterpret_cast<uint2*>(out + 4 * part + 32 * j) = v;
      }
      if (part == 0) StoreRowLse(p, qrow, head, t.lse);
    }
  }
}

// Combines the partials of the split items. A CTA takes split items
// blockIdx.x, blockIdx.x + grid, ...; the item with chunk index k merges the
// tile rows r with r % splits == k (so a group of many splits spreads its
// rows over as many CTAs as it has rows). One row: thread t owns float4
// t % (D/4) of the splits t / (D/4), t / (D/4) + kLanes, ..., merged online
// four at a time (loads of (m, l) and O together), then the split lanes are
// combined through shared memory.
template <int D, bool kBf16>
__global__ void __launch_bounds__(kAttnThreads) MergeAttentionKernel(const AttnLaunch a) {
  constexpr int kVecs = D / 4;                  // float4 per row
  constexpr int kLanes = kAttnThreads / kVecs;  // splits read at once
  constexpr int kUnroll = 4;
  static_assert(kAttnThreads % kVecs == 0, "head dim");
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float4 red[kAttnThreads];
  __shared__ float2 red_ml[kLanes];
  const internal::AttentionParams& p = a.p;
  int* item_prefix = reinterpret_cast<int*>(smem);
  int* slot_prefix = item_prefix + p.max_batch + 1;
  const int chunk_bound = BuildAttnSchedule(a, item_prefix, slot_prefix);
  // Launched early (programmatic dependent launch): the schedule above reads
  // only inputs; everything below waits for the attention grid. Every CTA
  // waits, so the merge grid never completes before the attention grid.
  WaitForPrerequisiteGrids();
  if (slot_prefix[p.batch_size] == 0) return;  // no request was split
  const int total_items = item_prefix[p.batch_size];
  const int tid = threadIdx.x;
  const int vec = tid % kVecs, sl = tid / kVecs;
  const float gv = p.v_scale.Get();
  for (int item = blockIdx.x; item < total_items; item += gridDim.x) {
    const AttnItem it = ResolveAttnItem(a, item, chunk_bound, item_prefix, slot_prefix);
    if (it.splits <= 1 || it.chunk_index >= kAttnTile) continue;
    for (int r = it.chunk_index; r < kAttnTile; r += it.splits) {
      const AttnRow row = GetAttnRow(p, it, r);
      if (!row.stored) continue;
      const int64_t base = static_cast<int64_t>(it.slot0) * a.rows_per_slot + r;
      const float2* ml = reinterpret_cast<const float2*>(a.ws_ml) + base;
      const float4* src = reinterpret_cast<const float4*>(a.ws_o) + base * kVecs + vec;
      const int64_t step = static_cast<int64_t>(a.rows_per_slot) * kVecs;
      float m_t = -INFINITY, l_t = 0.0f;
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int k = sl; k < it.splits; k += kUnroll * kLanes) {
        float2 mlv[kUnroll];
        float4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int kk = k + u * kLanes;
          mlv[u] = make_float2(-INFINITY, 0.0f);
          v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          if (kk < it.splits) {
            mlv[u] = ml[kk * a.rows_per_slot];
            v[u] = src[kk * step];
          }
        }
        const float mx = PartialsMax<kUnroll>(m_t, [&](int u) { return mlv[u]; });
        const float mu = MaxOffset(mx);
        const float sc = Ex2(m_t - mu);
        l_t *= sc;
        acc.x *= sc;
        acc.y *= sc;
        acc.z *= sc;
        acc.w *= sc;
        l_t = SumPartials<kUnroll>(l_t, mu, [&](int u) { return mlv[u]; },
                                   [&](int u, float e) { AddScaled(&acc, e, v[u]); });
        m_t = mx;
      }
      red[tid] = acc;
      if (vec == 0) red_ml[sl] = make_float2(m_t, l_t);
      __syncthreads();
      if (sl == 0) {
        const auto ml = [&](int j) { return red_ml[j]; };
        const float m_use = MaxOffset(PartialsMax<kLanes>(-INFINITY, ml));
        acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float l = SumPartials<kLanes>(
            0.0f, m_use, ml, [&](int j, float e) { AddScaled(&acc, e, red[j * kVecs + vec]); });
        const int head = it.head * p.group + row.gi;
        const RowTail t = FinishRowTail(p, m_use, l, head, gv);
        const int64_t qrow = it.r.q_begin + row.qi;
        uint2 packed;
        packed.x = PackOut2<kBf16>(acc.x * t.f, acc.y * t.f);
        packed.y = PackOut2<kBf16>(acc.z * t.f, acc.w * t.f);
        *reinterpret_cast<uint2*>(OutRowPtr(p, qrow, head) + 4 * vec) = packed;
        if (vec == 0) StoreRowLse(p, qrow, head, t.lse);
      }
      __syncthreads();
    }
  }
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_MERGE_CUH_
