// Internal: the "query rows in M" decode attention kernel (device code; the
// family every GPU ran before tokens_in_m.cuh, kept as the fallback for
// shapes the newer family does not take and selectable for tests).
//
// One warp, its tiles: query rows r = qi * group + gi (padded to 16) in the
// M dimension of mma.m16n8k16 (f16 in, f32 accumulate). Per 16-token tile
// (tile_copy.cuh brings K and V into the warp's stage ring):
//   S = Q K^T : B fragments from page_reader's DecodeWordHalf2. The reduction
//     index is permuted so that lane (g, c) decodes token g's bytes
//     [c D/8, (c+1) D/8) (contiguous); Q is stored permuted the same way.
//   online softmax in fp32 on the S fragment (log2 domain; a row's running
//     max moves only when a tile exceeds it by kAttnRescaleSlack);
//   O += P V   : the S accumulator, rounded to f16, is the A fragment; V's B
//     fragment for lane (g, c) is "segment" g (dims [g D/8, (g+1) D/8)) of
//     tokens 2c, 2c+1, 2c+8, 2c+9 (page_reader's DecodeWordPairHalf2), so
//     output n-tile l holds dims seg * D/8 + l; lane (g, c) owns segments
//     2c, 2c+1.
// The dequantized tile is e2m1 * e4m3 * 2^-7, exact in f16; the 2^7, g_k
// and sm_scale enter the logit scale once, g_v * 2^7 the output once.
#ifndef FP4KV_KERNELS_ATTENTION_ROWS_IN_M_CUH_
#define FP4KV_KERNELS_ATTENTION_ROWS_IN_M_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "fp4kv/device/page_reader.cuh"
#include "kernels/attention/merge.cuh"
#include "kernels/attention/ptx.cuh"
#include "kernels/attention/q_stage.cuh"
#include "kernels/attention/row_state.cuh"
#include "kernels/attention/schedule.cuh"
#include "kernels/attention/stage_layout.cuh"
#include "kernels/attention/tile_copy.cuh"
#include "src/attention_params.h"

namespace fp4kv {
namespace kernels {

// Position of dim d of a Q row in the permuted shared-memory row (k-step s
// at halves [16 s, 16 s + 16)); see the header comment.
template <int D>
__device__ __forceinline__ int QPermutedIndex(int d) {
  const int c = d / (D / 4);
  const int rem = d % (D / 4);
  const int s = 2 * (rem / 8) + (rem % 8) / 4;
  const int lb = (rem % 4) / 2;
  const int hi = rem % 2;
  return s * 16 + hi * 8 + 2 * c + lb;
}

// The same for FP8 keys: lane (g, c) holds bytes [c D/4, (c+1) D/4) of token
// g, one 32-bit word (4 values) per k-step; word s gives the B registers
// {v0, v1} (k = 2c, 2c+1) and {v2, v3} (k = 2c+8, 2c+9) of k-step s.
template <int D>
__device__ __forceinline__ int QPermutedIndexFp8(int d) {
  const int c = d / (D / 4);
  const int rem = d % (D / 4);
  const int s = rem / 4, j = rem % 4;
  return s * 16 + (j < 2 ? 2 * c + j : 8 + 2 * c + (j - 2));
}

// kSoftCap: options.logits_soft_cap > 0 (a separate instantiation keeps the
// tanh path out of the common kernel's registers). kFp8K: FP8 E4M3 keys.
template <int D, bool kBf16, bool kSoftCap, bool kFp8K>
__global__ void __launch_bounds__(kAttnThreads, AttnConfig<D, kFp8K>::kCtasPerSm)
    DecodeRowsInMKernel(const AttnLaunch a) {
  using Cfg = AttnConfig<D, kFp8K>;
  constexpr int kStages = Cfg::kStages;
  constexpr int kNT = D / 8;       // PV n-tiles (dims per lane segment)
  constexpr int kKWords = D / 32;  // code words per lane and K token
  constexpr int kVWords = D / 64;  // code words per lane and V token
  extern __shared__ __align__(16) uint8_t smem[];
  const internal::AttentionParams& p = a.p;
  LaunchDependentGrids();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int* item_prefix = reinterpret_cast<int*>(smem + kAttnWarps * Cfg::kWarpBytes);
  int* slot_prefix = item_prefix + p.max_batch + 1;
  const int chunk_bound = BuildAttnSchedule(a, item_prefix, slot_prefix);
  const int total_items = item_prefix[p.batch_size];

  uint8_t* wsm = smem + warp * Cfg::kWarpBytes;
  uint16_t* qs = reinterpret_cast<uint16_t*>(wsm);
  uint8_t* stages = wsm + Cfg::kQBytes;
  const int g = lane >> 2, c = lane & 3;
  const float gk = p.k_scale.Get();

  __shared__ float2 ml_sm[kAttnWarps][kAttnTile];
  __shared__ AttnCopyBase copy_base[2];  // per item, lanes of half 0 and 1
  for (int item = blockIdx.x; item < total_items; item += gridDim.x) {
    const AttnItem it = ResolveAttnItem(a, item, chunk_bound, item_prefix, slot_prefix);
    // This warp's tiles: a quarter of the item's, contiguous.
    const int item_tiles = (it.t1 - it.t0 + kAttnTile - 1) / kAttnTile;
    const int warp_tiles = (item_tiles + kAttnWarps - 1) / kAttnWarps;
    const int w_t0 = it.t0 + warp * warp_tiles * kAttnTile;
    const int w_t1 = min(it.t1, w_t0 + warp_tiles * kAttnTile);
    const int n_tiles = w_t0 < w_t1 ? (w_t1 - w_t0 + kAttnTile - 1) / kAttnTile : 0;

    // ---- Q tile into shared memory (permuted; bf16 rows scaled by 2^kq).
    int kq = 0;
    {
      const int r = lane >> 1, half = lane & 1;
      const AttnRow row = GetAttnRow(p, it, r);
      QHalfRow<D, kBf16> q;
      q.Init(row.valid ? QRowPtr(p, it.r.q_begin + row.qi, it.head * p.group + row.gi) +
                             half * (D / 2)
                       : nullptr);
      kq = q.scale.kq;
      uint16_t* dst = qs + r * Cfg::kQStride;
      q.ForEachGroup([&](int i, const uint16_t(&h)[8]) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int d = half * (D / 2) + 8 * i + j;
          dst[kFp8K ? QPermutedIndexFp8<D>(d) : QPermutedIndex<D>(d)] = h[j];
        }
      });
    }

    // ---- Per-thread rows g and g + 8.
    float lf[2];  // logit factor: to log2 units, or to x / cap with a soft cap
    // Keys [*lo, *hi] that row g + 8 i may attend (recomputed on the rare
    // tiles that need a mask rather than kept in registers).
    const auto row_bounds = [&](int i, int* lo, int* hi) {
      const AttnRow row = GetAttnRow(p, it, g + 8 * i);
      *lo = -(1 << 30);
      *hi = 1 << 30;
      if (row.stored) {
        *hi = row.pos;
        if (p.window_left >= 0) *lo = row.pos - p.window_left;
      }
    };
    int lo_max = -(1 << 30), hi_min = 1 << 30;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int k = __shfl_sync(0xffffffffu, kq, 2 * (g + 8 * i));
      lf[i] = QLogitFactor<kSoftCap, kFp8K>(p, gk, k);
      int lo, hi;
      row_bounds(i, &lo, &hi);
      lo_max = max(lo_max, lo);
      hi_min = min(hi_min, hi);
    }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      lo_max = max(lo_max, __shfl_xor_sync(0xffffffffu, lo_max, o));
      hi_min = min(hi_min, __shfl_xor_sync(0xffffffffu, hi_min, o));
    }
    __syncwarp();

    // ---- Copy pipeline of this warp.
    AttnTileCopier<D, kFp8K, Cfg> copier;
    copier.Init(a, it, stages, w_t0, w_t1, copy_base);

    float o[kNT][4];
#pragma unroll
    for (int n = 0; n < kNT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_tiles) copier.Issue(a, s, w_t0 + kAttnTile * s);
      CpAsyncCommit();
    }
    const uint32_t q_base = SmemAddr(qs);
    const int ld_row = (lane & 7) + ((lane >> 3) & 1) * 8;
    const int ld_col = (lane >> 4) * 8;
    const uint32_t q_lane = q_base + (ld_row * Cfg::kQStride + ld_col) * 2;

    for (int i = 0; i < n_tiles; ++i) {
      CpAsyncWait<kStages - 2>();
      __syncwarp();
      {
        const int nx = i + kStages - 1;
        if (nx < n_tiles) copier.Issue(a, nx % kStages, w_t0 + kAttnTile * nx);
        CpAsyncCommit();
      }
      const uint8_t* st = stages + (i % kStages) * Cfg::kStageBytes;
      const int tile_start = w_t0 + kAttnTile * i;
      const uint32_t ballot = *reinterpret_cast<const uint32_t*>(st + Cfg::kMaskOff);

      // ---- S = Q K^T.
      float s[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      if constexpr (kFp8K) {
        // FP8 keys: lane (g, c) reads bytes [c D/4, (c+1) D/4) of tokens g
        // and g + 8, 16 bytes (four k-steps) at a time; word w is k-step
        // w's B fragment.
        const uint8_t* krow = st + Cfg::kKcOff + g * Cfg::kKRowStride + c * (D / 4);
#pragma unroll
        for (int w4 = 0; w4 < D / 64; ++w4) {
          uint32_t kw[2][4];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const uint4 v =
                *reinterpret_cast<const uint4*>(krow + 8 * nt * Cfg::kKRowStride + 16 * w4);
            kw[nt][0] = v.x;
            kw[nt][1] = v.y;
            kw[nt][2] = v.z;
            kw[nt][3] = v.w;
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t qa[4];
            LdMatrixX4(q_lane + (4 * w4 + j) * 32, qa);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              uint32_t b0, b1;
              device::Fp8KeyWordToHalf2(kw[nt][j], &b0, &b1);
              Mma16816(s[nt], qa, b0, b1);
            }
          }
        }
      } else {
        KTileWords<D, Cfg> kt;
        kt.Load(st, g, c);
#pragma unroll
        for (int w = 0; w < kKWords; ++w) {
          uint32_t qa[2][4];
          LdMatrixX4(q_lane + (2 * w) * 32, qa[0]);
          LdMatrixX4(q_lane + (2 * w + 1) * 32, qa[1]);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            uint32_t b[4];
            device::DecodeWordHalf2(kt.w[nt][w], kt.WordMul(nt, w), b);
            Mma16816(s[nt], qa[0], b[0], b[2]);
            Mma16816(s[nt], qa[1], b[1], b[3]);
          }
        }
      }

      // ---- Online softmax (log2 units).
      const bool full =
          ballot == 0xffffffffu && tile_start >= lo_max && tile_start + kAttnTile - 1 <= hi_min;
      // Scale and soft cap (its own instantiation), then the mask: one
      // warp-uniform branch per tile.
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[nt][e] * lf[e >> 1];
          if constexpr (kSoftCap) x = tanhf(x) * p.soft_cap * kLog2e;
          s[nt][e] = x;
        }
      }
      if (!full) {
        int row_lo[2], row_hi[2];
        row_bounds(0, &row_lo[0], &row_hi[0]);
        row_bounds(1, &row_lo[1], &row_hi[1]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tt = 8 * nt + 2 * c + (e & 1);
            const int t = tile_start + tt;
            const bool ok =
                ((ballot >> (2 * tt)) & 1u) && t >= row_lo[e >> 1] && t <= row_hi[e >> 1];
            if (!ok) s[nt][e] = -INFINITY;
          }
        }
      }
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // Lazy rescale (OnlineMaxStep): O is rescaled on few tiles.
        float m_use;
        alpha[r] = OnlineMaxStep(&m_run[r], mx, &m_use);
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          s[nt][2 * r] = Ex2(s[nt][2 * r] - m_use);
          s[nt][2 * r + 1] = Ex2(s[nt][2 * r + 1] - m_use);
          sum += s[nt][2 * r] + s[nt][2 * r + 1];
        }
        l_run[r] = l_run[r] * alpha[r] + sum;
      }
      if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
        for (int n = 0; n < kNT; ++n) {
          o[n][0] *= alpha[0];
          o[n][1] *= alpha[0];
          o[n][2] *= alpha[1];
          o[n][3] *= alpha[1];
        }
      }
      // P as f16 (the A fragment of P V).
      uint32_t pa[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        pa[k] = PackHalf2(s[k >> 1][2 * (k & 1)], s[k >> 1][2 * (k & 1) + 1]);
      }

      // ---- O += P V.
      VTileWords<D, Cfg> vt;
      vt.Load(st, g, c);
#pragma unroll
      for (int w = 0; w < kVWords; ++w) {
        uint32_t b0[8], b1[8];
        device::DecodeWordPairHalf2(vt.w[0][w], vt.w[1][w], vt.WordMul(0, w), b0);
        device::DecodeWordPairHalf2(vt.w[2][w], vt.w[3][w], vt.WordMul(1, w), b1);
#pragma unroll
        for (int d = 0; d < 8; ++d) {
          Mma16816(o[8 * w + d], pa, b0[d], b1[d]);
        }
      }
      __syncwarp();
    }
    CpAsyncWait<0>();
    __syncwarp();
    // (m, l) as handed on (l carries the factor 2^kAttnPOffset), the row
    // sums across the quad.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m_run[r] = HandedOnMax(m_run[r]);
      l_run[r] = RowLaneSum<1, 2>(l_run[r]);
    }

    // ---- Combine the warps: each stores its O rescaled to the CTA's row
    // max into its own (now idle) shared memory as [16][D + 4] floats, in
    // natural dim order; then 8 threads per row sum the warps and write the
    // output or the partial.
    if (c == 0) {
      ml_sm[warp][g] = make_float2(m_run[0], l_run[0]);
      ml_sm[warp][g + 8] = make_float2(m_run[1], l_run[1]);
    }
    __syncthreads();
    float* red = reinterpret_cast<float*>(wsm);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = g + 8 * r;
      const float f = ToCtaRowMax(ml_sm, row, m_run[r]);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float* seg = red + row * Cfg::kRedStride + (2 * c + half) * kNT;
#pragma unroll
        for (int n = 0; n < kNT; n += 4) {
          *reinterpret_cast<float4*>(seg + n) =
              make_float4(o[n][2 * r + half] * f, o[n + 1][2 * r + half] * f,
                          o[n + 2][2 * r + half] * f, o[n + 3][2 * r + half] * f);
        }
      }
    }
    __syncthreads();
    StoreItemRows<D, kBf16>(a, it, smem, Cfg::kWarpBytes, Cfg::kRedStride, ml_sm);
    __syncthreads();
  }
  // Launched beside the prefill kernel of the same Run (programmatic
  // dependent launch): this grid completes only after that one, so what
  // follows in the stream still finds every row written. A no-op otherwise.
  WaitForPrerequisiteGrids();
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_ROWS_IN_M_CUH_
