// Internal: attention of requests with many new tokens (prefill chunks,
// extends over a cached prefix, whole prompts) reading NVFP4 (or FP8-key /
// NVFP4-value) pages. Device code plus its launch, instantiated per head dim
// by kernels/attention_prefill_d<D>.cu and dispatched by kernels/attention.cu
// beside the decode kernels of the same Run().
//
// Work: a persistent grid (num_sms * resident CTAs) of 4-warp CTAs derives
// the same schedule from seq_lens / q_indptr as the decode kernels do
// (GetAttnRequest, restricted by kernel_q_min / kernel_q_max to the long
// requests). An item is (request, KV head, query tile of kRows rows), rows
// being (query i, head in the group) pairs, row = i * group + g (the GQA
// heads of a query share the KV head's tiles); each warp owns kMT m-tiles
// of 16 rows (128 rows an item, 64 at head dim 256). CTA x takes items x,
// x + grid, ...; within a request the tiles nearest the end (most keys
// under the causal mask) come first.
//
// An item walks its key range [t_begin, t_end) -- the causal bound of its
// last query, the window of its first -- in tiles of kBN tokens. Each tile
// is read once per CTA: all 128 threads load its codes and scales from the
// pages into registers, decode them to f16 into one of two shared buffers
// in the layout ldmatrix reads (rows padded by 16 bytes: conflict-free),
// and every warp's rows reuse it: S = Q K^T and O += P V on mma.sync
// m16n8k16 (f16 in, fp32 accumulate; each K/V fragment feeds the warp's kMT
// m-tiles), online softmax in fp32 between them. Tile j + 1 is decoded and
// tile j + 2 loaded into registers right after tile j's multiplies, so the
// loads are in flight during tile j + 1's, with one barrier per tile.
// Warps own disjoint rows, so an item needs no combine: each warp finishes
// its rows (normalization, sinks, LSE) and writes them through its own
// shared-memory rows as 16-byte stores.
//
// Number formats, as in the decode kernels: NVFP4 tiles decode exactly to
// e2m1 * e4m3 * 2^-7 in f16 (page_reader.cuh), in the word order
// DecodeWordHalf2 returns (within every 8 values: 0,2,4,6,1,3,5,7); Q is
// staged in the same order for NVFP4 keys (the dot product does not care)
// and in natural order for FP8 keys; V's order permutes O's columns, undone
// when the output is written. bf16 queries are scaled per row by a power of
// two into f16 (exact: 8 significant bits), and the factor is taken out of
// the logits. P = 2^(s - m + kAttnPOffset) in f16 with a lazily raised
// running max m (schedule.cuh), the same as the decode kernels.
#ifndef FP4KV_KERNELS_ATTENTION_PREFILL_CUH_
#define FP4KV_KERNELS_ATTENTION_PREFILL_CUH_

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "fp4kv/device/page_reader.cuh"
#include "kernels/attention/ptx.cuh"
#include "kernels/attention/q_stage.cuh"
#include "kernels/attention/row_state.cuh"
#include "kernels/attention/schedule.cuh"
#include "src/attention_params.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace kernels {

template <int D>
struct PrefillConfig {
  // Query m-tiles of 16 rows per warp: two where the accumulators fit (each
  // K/V fragment then feeds two MMAs), one at D = 256.
  static constexpr int kMT = D == 256 ? 1 : 2;
  static constexpr int kWarpRows = 16 * kMT;
  static constexpr int kRows = kWarpRows * kAttnWarps;  // query rows per item
  static constexpr int kBN = D == 64 ? 64 : 32;         // tokens per K/V tile
  static constexpr int kStride = D + 8;                 // halves per shared row
  static constexpr int kChunks = D / 32;                // 32-value chunks per token row
  static constexpr int kTokPerPass = kAttnThreads / kChunks;
  static constexpr int kPasses = kBN / kTokPerPass;     // chunks per thread per tile
  static constexpr int kTileBytes = kBN * kStride * 2;  // one of K or V, f16
  static constexpr int kQOff = 0;                       // [kRows][kStride] f16
  static constexpr int kKOff = kQOff + kRows * kStride * 2;  // [2 buffers] K tiles
  static constexpr int kVOff = kKOff + 2 * kTileBytes;       // [2 buffers] V tiles
  static constexpr int kOkOff = kVOff + 2 * kTileBytes;      // [2][kBN] token valid bytes
  static constexpr int kBytes = kOkOff + 2 * kBN;
  static constexpr int kCtasPerSm = 2;  // launch bound
  static_assert(kBN % kTokPerPass == 0, "whole passes per tile");
  static_assert(kBN % 16 == 0, "whole k-steps of P V");
  static_assert(kBytes % 16 == 0, "16-byte aligned schedule arrays");
};

// The raw codes and scales of one thread's chunks (32 values of one token
// row, K and V) of a K/V tile, kPasses tokens.
template <int kPasses, bool kFp8K>
struct PrefillRaw {
  static constexpr int kKWords = kFp8K ? 8 : 4;  // 32 values of a key row
  uint32_t k[kPasses][kKWords];
  uint32_t v[kPasses][4];
  uint32_t ks[kPasses], vs[kPasses];  // two scale bytes each (low first)
  uint32_t ok;                        // bit i: chunk of pass i valid
};

// Where a thread's chunk of a (request, KV head) starts: pointers at page 0,
// entry 0, plus the request's block-table row.
struct PrefillChunkBase {
  const uint8_t* k;
  const uint8_t* v;
  const uint8_t* ks;  // null for FP8 keys
  const uint8_t* vs;
  int64_t table_row;
};

template <bool kFp8K>
__device__ __forceinline__ PrefillChunkBase MakePrefillChunkBase(const internal::AttentionParams& p,
                                                                 int b, int head, int chunk) {
  PrefillChunkBase c;
  c.table_row = static_cast<int64_t>(b) * p.table_row_stride;
  c.k = p.k.data + head * p.k.data_head + chunk * (kFp8K ? 32 : 16);
  c.v = p.v.data + head * p.v.data_head + chunk * 16;
  c.ks = kFp8K ? nullptr : p.k.scales + head * p.k.scale_head + chunk * 2;
  c.vs = p.v.scales + head * p.v.scale_head + chunk * 2;
  return c;
}

// Loads the chunk of tokens t + i * kTokStep (i < kPasses): zeros and a
// clear `ok` bit for tokens at or past t_end and for table entries outside
// [0, num_pages).
template <int kPasses, int kTokStep, bool kFp8K>
__device__ __forceinline__ void LoadPrefillRaw(const internal::AttentionParams& p,
                                               const PrefillChunkBase& cb, int t, int t_end,
                                               PrefillRaw<kPasses, kFp8K>& raw) {
  raw.ok = 0;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int ti = t + i * kTokStep;
    bool valid = ti < t_end;
    int64_t pg = -1;
    int pe = 0;
    if (valid) {
      const int pj = ti / p.page_size;
      pe = ti - pj * p.page_size;
      pg = internal::TableEntry(p.block_tables, p.tables_i64, cb.table_row + pj);
      valid = pg >= 0 && pg < p.num_pages;
    }
#pragma unroll
    for (int w = 0; w < PrefillRaw<kPasses, kFp8K>::kKWords; ++w) raw.k[i][w] = 0;
#pragma unroll
    for (int w = 0; w < 4; ++w) raw.v[i][w] = 0;
    raw.ks[i] = raw.vs[i] = 0;
    if (valid) {
      raw.ok |= 1u << i;
      const uint8_t* kr = cb.k + pg * p.k.data_page + pe * p.k.data_entry;
      const uint8_t* vr = cb.v + pg * p.v.data_page + pe * p.v.data_entry;
      if constexpr (kFp8K) {
        // FP8 key rows are 16-byte aligned (the cache contract).
        const uint4 a0 = __ldg(reinterpret_cast<const uint4*>(kr));
        const uint4 a1 = __ldg(reinterpret_cast<const uint4*>(kr + 16));
        raw.k[i][0] = a0.x, raw.k[i][1] = a0.y, raw.k[i][2] = a0.z, raw.k[i][3] = a0.w;
        raw.k[i][4] = a1.x, raw.k[i][5] = a1.y, raw.k[i][6] = a1.z, raw.k[i][7] = a1.w;
      } else {
        // Code rows are 8-byte aligned (the cache contract).
        const uint2 a0 = __ldg(reinterpret_cast<const uint2*>(kr));
        const uint2 a1 = __ldg(reinterpret_cast<const uint2*>(kr + 8));
        raw.k[i][0] = a0.x, raw.k[i][1] = a0.y, raw.k[i][2] = a1.x, raw.k[i][3] = a1.y;
        const uint8_t* ksr = cb.ks + pg * p.k.scale_page + pe * p.k.scale_entry;
        raw.ks[i] = __ldg(ksr) | (static_cast<uint32_t>(__ldg(ksr + 1)) << 8);
      }
      const uint2 b0 = __ldg(reinterpret_cast<const uint2*>(vr));
      const uint2 b1 = __ldg(reinterpret_cast<const uint2*>(vr + 8));
      raw.v[i][0] = b0.x, raw.v[i][1] = b0.y, raw.v[i][2] = b1.x, raw.v[i][3] = b1.y;
      const uint8_t* vsr = cb.vs + pg * p.v.scale_page + pe * p.v.scale_entry;
      raw.vs[i] = __ldg(vsr) | (static_cast<uint32_t>(__ldg(vsr + 1)) << 8);
    }
  }
}

// Decodes pass i of a thread's chunk to f16: kh[j] / vh[j] are the 16-byte
// pieces j = 0..3 (8 values each; NVFP4 in DecodeWordHalf2's order, FP8
// keys in natural order).
template <int kPasses, bool kFp8K>
__device__ __forceinline__ void DecodePrefillChunk(const PrefillRaw<kPasses, kFp8K>& raw, int i,
                                                   uint32_t (&kh)[4][4], uint32_t (&vh)[4][4]) {
  if constexpr (kFp8K) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      device::Fp8KeyWordToHalf2(raw.k[i][2 * j], &kh[j][0], &kh[j][1]);
      device::Fp8KeyWordToHalf2(raw.k[i][2 * j + 1], &kh[j][2], &kh[j][3]);
    }
  } else {
    const uint32_t m0 = device::ScalePairMultiplier((raw.ks[i] & 0xffu) * 0x0101u);
    const uint32_t m1 = device::ScalePairMultiplier((raw.ks[i] >> 8) * 0x0101u);
#pragma unroll
    for (int w = 0; w < 4; ++w) device::DecodeWordHalf2(raw.k[i][w], w < 2 ? m0 : m1, kh[w]);
  }
  const uint32_t m0 = device::ScalePairMultiplier((raw.vs[i] & 0xffu) * 0x0101u);
  const uint32_t m1 = device::ScalePairMultiplier((raw.vs[i] >> 8) * 0x0101u);
#pragma unroll
  for (int w = 0; w < 4; ++w) device::DecodeWordHalf2(raw.v[i][w], w < 2 ? m0 : m1, vh[w]);
}

template <int D, bool kBf16, bool kSoftCap, bool kFp8K>
__global__ void __launch_bounds__(kAttnThreads, PrefillConfig<D>::kCtasPerSm)
    PrefillAttentionKernel(const internal::AttentionParams p) {
  using Cfg = PrefillConfig<D>;
  constexpr int kBN = Cfg::kBN;
  constexpr int kNT = D / 8;     // O n-tiles
  constexpr int kSN = kBN / 8;   // S n-tiles
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  int* item_prefix = reinterpret_cast<int*>(smem + Cfg::kBytes);

  // ---- Schedule: items per request, prefix over requests.
  __shared__ int scan_tmp[kAttnWarps];
  const int total_items = PrefillSchedule<kAttnThreads>(p, Cfg::kRows, item_prefix, scan_tmp);

  uint16_t* qs = reinterpret_cast<uint16_t*>(smem + Cfg::kQOff);
  const uint32_t q_sm = SmemAddr(smem + Cfg::kQOff);
  const uint32_t k_sm = SmemAddr(smem + Cfg::kKOff);
  const uint32_t v_sm = SmemAddr(smem + Cfg::kVOff);
  uint8_t* tok_ok = smem + Cfg::kOkOff;
  const float gk = p.k_scale.Get();
  const float gv = p.v_scale.Get();

  for (int item = blockIdx.x; item < total_items; item += gridDim.x) {
    const PrefillItem it = ResolvePrefillItem(p, item_prefix, item, Cfg::kRows);
    const AttnRequest& r = it.r;
    const int b = it.b, head = it.head, n_rows = it.n_rows, pos_base = it.pos_base;
    const int t_begin = it.t_begin, t_end = it.t_end;
    const int wrow0 = it.row0 + Cfg::kWarpRows * warp;  // this warp's first row

    // ---- Q rows of this warp into shared memory (the warp's own rows):
    // lane 2 r + h stages half h of row r of each m-tile; bf16 rows scaled
    // by 2^kq.
    int kq[Cfg::kMT];
#pragma unroll
    for (int mt = 0; mt < Cfg::kMT; ++mt) {
      const int rl = 16 * mt + (lane >> 1), half = lane & 1;
      const int row = wrow0 + rl;
      const int qi = row / p.group, gi = row - qi * p.group;
      QHalfRow<D, kBf16> q;
      q.Init(row < n_rows ? QRowPtr(p, r.q_begin + qi, head * p.group + gi) + half * (D / 2)
                          : nullptr);
      kq[mt] = q.scale.kq;
      uint16_t* dst = qs + (Cfg::kWarpRows * warp + rl) * Cfg::kStride + half * (D / 2);
      q.ForEachGroup([&](int i, const uint16_t(&h)[8]) {
        *reinterpret_cast<uint4*>(dst + 8 * i) =
            PackHalf8(h, [](int j) { return kFp8K ? j : PermPos8(j); });
      });
    }

    // ---- This thread's rows g and g + 8 of each m-tile: logit factors and
    // the key bounds [lo, hi] of the rows that are written.
    float lf[Cfg::kMT][2];
    int row_lo[Cfg::kMT][2], row_hi[Cfg::kMT][2];
    int warp_lo_max = -(1 << 30), warp_hi_min = 1 << 30;  // over written rows
    int warp_lo_min = 1 << 30, warp_hi_max = -(1 << 30);
#pragma unroll
    for (int mt = 0; mt < Cfg::kMT; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int k = __shfl_sync(0xffffffffu, kq[mt], 2 * (g + 8 * i));
        lf[mt][i] = QLogitFactor<kSoftCap, kFp8K>(p, gk, k);
        const int row = wrow0 + 16 * mt + g + 8 * i;
        const int pos = pos_base + row / p.group;
        const bool stored = row < n_rows && pos >= 0;
        row_lo[mt][i] = -(1 << 30);
        row_hi[mt][i] = 1 << 30;
        if (stored) {
          row_hi[mt][i] = pos;
          if (p.window_left >= 0) row_lo[mt][i] = pos - p.window_left;
          warp_lo_min = min(warp_lo_min, row_lo[mt][i]);
          warp_hi_max = max(warp_hi_max, row_hi[mt][i]);
        }
        warp_lo_max = max(warp_lo_max, row_lo[mt][i]);
        warp_hi_min = min(warp_hi_min, row_hi[mt][i]);
      }
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      warp_lo_max = max(warp_lo_max, __shfl_xor_sync(0xffffffffu, warp_lo_max, o));
      warp_hi_min = min(warp_hi_min, __shfl_xor_sync(0xffffffffu, warp_hi_min, o));
      warp_lo_min = min(warp_lo_min, __shfl_xor_sync(0xffffffffu, warp_lo_min, o));
      warp_hi_max = max(warp_hi_max, __shfl_xor_sync(0xffffffffu, warp_hi_max, o));
    }

    // ---- Tile loads: thread tid takes chunk tid % kChunks of tokens
    // tid / kChunks + i * kTokPerPass.
    const int chunk = tid % Cfg::kChunks;
    using Raw = PrefillRaw<Cfg::kPasses, kFp8K>;
    const PrefillChunkBase cb = MakePrefillChunkBase<kFp8K>(p, b, head, chunk);
    const auto load_tile = [&](int t0, Raw& raw) {
      LoadPrefillRaw<Cfg::kPasses, Cfg::kTokPerPass>(p, cb, t0 + tid / Cfg::kChunks, t_end, raw);
    };
    // Decodes a thread's chunks into shared buffer `buf`; returns whether
    // all of its tokens were valid.
    const auto store_tile = [&](const Raw& raw, int buf) {
      const uint32_t kb = k_sm + buf * Cfg::kTileBytes;
      const uint32_t vb = v_sm + buf * Cfg::kTileBytes;
#pragma unroll
      for (int i = 0; i < Cfg::kPasses; ++i) {
        const int tt = tid / Cfg::kChunks + i * Cfg::kTokPerPass;
        const uint32_t kdst = kb + (tt * Cfg::kStride + chunk * 32) * 2;
        const uint32_t vdst = vb + (tt * Cfg::kStride + chunk * 32) * 2;
        uint32_t kh[4][4], vh[4][4];
        DecodePrefillChunk(raw, i, kh, vh);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          StShared16(kdst + 16 * j, kh[j][0], kh[j][1], kh[j][2], kh[j][3]);
          StShared16(vdst + 16 * j, vh[j][0], vh[j][1], vh[j][2], vh[j][3]);
        }
        if (chunk == 0) tok_ok[buf * kBN + tt] = static_cast<uint8_t>((raw.ok >> i) & 1u);
      }
      return raw.ok == (1u << Cfg::kPasses) - 1u;
    };

    float o[Cfg::kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < Cfg::kMT; ++mt) {
#pragma unroll
      for (int n = 0; n < kNT; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
    }
    float m_run[Cfg::kMT][2], l_run[Cfg::kMT][2];
#pragma unroll
    for (int mt = 0; mt < Cfg::kMT; ++mt) {
      m_run[mt][0] = m_run[mt][1] = -INFINITY;
      l_run[mt][0] = l_run[mt][1] = 0.0f;
    }

    // ldmatrix lane addresses: Q (A, this warp's rows), K (B, tokens x
    // dims), V (B via .trans, tokens x dims).
    const int ld_r = (lane & 7) + ((lane >> 3) & 1) * 8;  // 0..15
    const int ld_c = (lane >> 4) * 8;                     // 0 or 8
    const uint32_t q_lane = q_sm + ((Cfg::kWarpRows * warp + ld_r) * Cfg::kStride + ld_c) * 2;
    const int kt_r = (lane & 7) + (lane >> 4) * 8;  // token within 16
    const int kt_c = ((lane >> 3) & 1) * 8;         // dim within 16
    const uint32_t k_lane = k_sm + (kt_r * Cfg::kStride + kt_c) * 2;
    const uint32_t v_lane = v_sm + (ld_r * Cfg::kStride + ld_c) * 2;

    // Tiles: decoded into two shared buffers; tile j + 1 is decoded (and
    // tile j + 2 loaded into registers) after tile j's multiplies, with one
    // barrier per tile.
    const int n_tiles = t_begin < t_end ? (t_end - t_begin + kBN - 1) / kBN : 0;
    Raw raw;
    bool tile_ok = false;
    if (n_tiles > 0) {
      load_tile(t_begin, raw);
      const bool mine = store_tile(raw, 0);
      if (n_tiles > 1) load_tile(t_begin + kBN, raw);
      tile_ok = __syncthreads_and(mine) != 0;  // also: Q is staged
    }
    for (int j = 0; j < n_tiles; ++j) {
      const int t0 = t_begin + j * kBN;
      const int buf = j & 1;
      // Rows of this warp with a key in the tile.
      if (!(warp_hi_max < t0 || warp_lo_min > t0 + kBN - 1)) {
        const uint32_t kbuf = k_lane + buf * Cfg::kTileBytes;
        const uint32_t vbuf = v_lane + buf * Cfg::kTileBytes;
        const uint8_t* ok_buf = tok_ok + buf * kBN;
        // ---- S = Q K^T.
        float s[Cfg::kMT][kSN][4];
#pragma unroll
        for (int mt = 0; mt < Cfg::kMT; ++mt) {
#pragma unroll
          for (int n = 0; n < kSN; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t qa[Cfg::kMT][4];
#pragma unroll
          for (int mt = 0; mt < Cfg::kMT; ++mt) {
            LdMatrixX4(q_lane + (16 * mt * Cfg::kStride + kk * 16) * 2, qa[mt]);
          }
#pragma unroll
          for (int n2 = 0; n2 < kBN / 16; ++n2) {
            uint32_t kb[4];
            LdMatrixX4(kbuf + (n2 * 16 * Cfg::kStride + kk * 16) * 2, kb);
#pragma unroll
            for (int mt = 0; mt < Cfg::kMT; ++mt) {
              Mma16816(s[mt][2 * n2], qa[mt], kb[0], kb[1]);
              Mma16816(s[mt][2 * n2 + 1], qa[mt], kb[2], kb[3]);
            }
          }
        }

        // ---- Scale (soft cap), mask, online softmax (log2 units).
        const bool full = tile_ok && t0 >= warp_lo_max && t0 + kBN - 1 <= warp_hi_min;
#pragma unroll
        for (int mt = 0; mt < Cfg::kMT; ++mt) {
#pragma unroll
          for (int n = 0; n < kSN; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float x = s[mt][n][e] * lf[mt][e >> 1];
              if constexpr (kSoftCap) x = tanhf(x) * p.soft_cap * kLog2e;
              s[mt][n][e] = x;
            }
          }
          if (!full) {
#pragma unroll
            for (int n = 0; n < kSN; ++n) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int tt = 8 * n + 2 * c + (e & 1);
                const int t = t0 + tt;
                const bool ok = t < t_end && ok_buf[tt] != 0 && t >= row_lo[mt][e >> 1] &&
                                t <= row_hi[mt][e >> 1];
                if (!ok) s[mt][n][e] = -INFINITY;
              }
            }
          }
        }
        bool rescale = false;
        float alpha[Cfg::kMT][2];
#pragma unroll
        for (int mt = 0; mt < Cfg::kMT; ++mt) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            float mx = -INFINITY;
#pragma unroll
            for (int n = 0; n < kSN; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * i], s[mt][n][2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float m_use;
            alpha[mt][i] = OnlineMaxStep(&m_run[mt][i], mx, &m_use);
            rescale = rescale || alpha[mt][i] != 1.0f;
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < kSN; ++n) {
              s[mt][n][2 * i] = Ex2(s[mt][n][2 * i] - m_use);
              s[mt][n][2 * i + 1] = Ex2(s[mt][n][2 * i + 1] - m_use);
              sum += s[mt][n][2 * i] + s[mt][n][2 * i + 1];
            }
            l_run[mt][i] = l_run[mt][i] * alpha[mt][i] + sum;
          }
        }
        if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
          for (int mt = 0; mt < Cfg::kMT; ++mt) {
#pragma unroll
            for (int n = 0; n < kNT; ++n) {
              o[mt][n][0] *= alpha[mt][0];
              o[mt][n][1] *= alpha[mt][0];
              o[mt][n][2] *= alpha[mt][1];
              o[mt][n][3] *= alpha[mt][1];
            }
          }
        }

        // ---- O += P V.
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {
          uint32_t pa[Cfg::kMT][4];
#pragma unroll
          for (int mt = 0; mt < Cfg::kMT; ++mt) {
            pa[mt][0] = PackHalf2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
            pa[mt][1] = PackHalf2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
            pa[mt][2] = PackHalf2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
            pa[mt][3] = PackHalf2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
          }
#pragma unroll
          for (int n2 = 0; n2 < D / 16; ++n2) {
            uint32_t vb[4];
            LdMatrixX4Trans(vbuf + (kk * 16 * Cfg::kStride + n2 * 16) * 2, vb);
#pragma unroll
            for (int mt = 0; mt < Cfg::kMT; ++mt) {
              Mma16816(o[mt][2 * n2], pa[mt], vb[0], vb[1]);
              Mma16816(o[mt][2 * n2 + 1], pa[mt], vb[2], vb[3]);
            }
          }
        }
      }
      // ---- Decode tile j + 1 into the other buffer (its readers, tile
      // j - 1, passed the last barrier), load tile j + 2.
      if (j + 1 < n_tiles) {
        const bool mine = store_tile(raw, buf ^ 1);
        if (j + 2 < n_tiles) load_tile(t_begin + (j + 2) * kBN, raw);
        tile_ok = __syncthreads_and(mine) != 0;
      }
    }

    // ---- Finish this warp's rows: normalize (sinks, LSE), stage the
    // output rows in natural dim order over the warp's Q rows, then 16-byte
    // stores.
    __syncwarp();
    uint16_t* ostage = qs + Cfg::kWarpRows * warp * Cfg::kStride;
    const auto piece = [&](int rl, int n) { return ostage + rl * Cfg::kStride + 8 * n; };
#pragma unroll
    for (int mt = 0; mt < Cfg::kMT; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int rl = 16 * mt + g + 8 * i;
        FinishPrefillRow<D, kBf16>(p, it, wrow0 + rl, rl, m_run[mt][i], l_run[mt][i], o[mt], i, c,
                                   gv, piece);
      }
    }
    __syncwarp();
    StorePrefillRows<D, Cfg::kWarpRows>(p, it, wrow0, 0, lane, piece);
    __syncthreads();  // Q / staging rows and the tile buffers are rewritten by the next item
  }
}

}  // namespace kernels

}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_PREFILL_CUH_
