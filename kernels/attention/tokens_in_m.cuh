// Internal: the "tokens in M" decode attention kernel (device code), the
// family chosen on sm_80 and newer when a work item has at most 16 query
// rows (group * q_len) and its accumulators fit (see attention.cu).
//
// Decode has few query rows per KV head (group x q_len, often 4), so the
// rows-in-M kernel pads its 16-row MMA tile with idle rows. Here the
// operands are swapped: the keys' tokens fill M and the query rows fill N
// (kN n-tiles of 8 rows: rows 8 nt + n), so
//   S^T = K Q^T : A = the decoded K tile (16 tokens x 16 dims per k-step),
//     B = Q, loaded once per item into registers (no shared-memory Q and
//     no per-tile Q loads). Lane (g, c) decodes bytes [c D/8, (c+1) D/8)
//     of tokens g and g + 8 (NVFP4: one code word is the A fragment of two
//     k-steps; FP8 keys: one word per k-step), and Q's B fragments are
//     permuted to the same dims.
//   online softmax on S^T: a lane holds 2 tokens x 2 rows per n-tile; a
//     row's max and sum run over the 8 lanes of the same c.
//   O^T += V^T P^T : A = the decoded V tile (16 output dims x 16 tokens),
//     B = P^T, which movmatrix transposes out of the S^T accumulator. Lane
//     (g, c) decodes dims [g D/8, (g+1) D/8) ("segment" g) of tokens 2c,
//     2c+1, 2c+8, 2c+9 (the V layout of tile_copy.cuh); code word w of the
//     segment (dims 8w..8w+7) feeds m-tiles 4w..4w+3: m-tile 4w + d has row
//     g = dim 8w + d and row g + 8 = dim 8w + d + 4.
// Per value this halves the MMAs of both products and the softmax work of
// the rows-in-M kernel and drops its Q reloads. Tile copy, work schedule,
// CTA combine and split merge are shared with it (tile_copy.cuh,
// schedule.cuh, merge.cuh); the scaling conventions are the same: the
// dequantized tile is e2m1 * e4m3 * 2^-7 (NVFP4), the 2^7, g_k and sm_scale
// enter the logit scale once, g_v * 2^7 the output once.
#ifndef FP4KV_KERNELS_ATTENTION_TOKENS_IN_M_CUH_
#define FP4KV_KERNELS_ATTENTION_TOKENS_IN_M_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "fp4kv/device/page_reader.cuh"
#include "kernels/attention/merge.cuh"
#include "kernels/attention/ptx.cuh"
#include "kernels/attention/q_stage.cuh"
#include "kernels/attention/row_state.cuh"
#include "kernels/attention/schedule.cuh"
#include "kernels/attention/stage_layout.cuh"
#include "kernels/attention/tile_copy.cuh"
#include "kernels/attention/tma.cuh"
#include "src/attention_params.h"

namespace fp4kv {
namespace kernels {

// Whether the tokens-in-M kernel takes items of `rows` query rows
// (group * max_q_len, capped at 16) at head dim d: one n-tile (rows <= 8).
// The kernel is written for kN = 2 n-tiles too, but measured on the H200 it
// loses to the rows-in-M kernel there (twice the Q and O registers: three
// CTAs an SM with spills; 64 x 4096 at q_len 4, 187 us against 150 us), so
// launch.cuh never instantiates it.
inline bool TokensInMTakes(int /*d*/, int rows) { return rows <= internal::kTokensInMMaxRows; }

// The warp's shared memory: a ring of kStages 16-token stages
// (AttnStageLayout, unpadded: tile_copy.cuh), consumed two at a time (a
// pair: 32 tokens per softmax step, while the next pair is in flight), and
// no Q region. FP8 key rows are unpadded, their 16-byte chunks swizzled
// instead (chunk k of token t at k ^ (t & 1)): the fragment loads of tokens
// g and g + 1 then hit different banks.
template <int D, bool kFp8K>
struct TokensInMConfig : AttnStageLayout<D, kFp8K, false> {
  using Stage = AttnStageLayout<D, kFp8K, false>;
  static constexpr int kStages = 4;
  static constexpr int kRingBytes = kStages * Stage::kStageBytes;
  static constexpr int kRedBytes = kAttnTile * Stage::kRedStride * 4;
  static constexpr int kWarpBytes = kRingBytes > kRedBytes ? kRingBytes : kRedBytes;
  static_assert(kWarpBytes % 16 == 0, "alignment");
  __host__ __device__ static constexpr int KChunk(int t, int k) { return kFp8K ? k ^ (t & 1) : k; }
};

// Dynamic shared memory of the tokens-in-M kernel (the schedule's arrays
// follow the warps' regions).
template <int D, bool kFp8K>
inline constexpr int kTokensInMWarpBytes = TokensInMConfig<D, kFp8K>::kWarpBytes;

// CTAs per SM (the persistent grid and the register bound): two n-tiles at
// d = 128 hold twice the Q and O registers and run three CTAs an SM.
template <int D, int kN, bool kFp8K>
inline constexpr int kTokensInMCtasPerSm =
    kN == 2 && D == 128 ? 3 : AttnConfig<D, kFp8K>::kCtasPerSm;

// ---------------------------------------------------------------------------
// The TMA variant (kTma, sm_90): lane 0 of each warp copies a tile's codes
// with one tensor copy each for K and V into an mbarrier ring (kernels/
// attention/tma.cuh), instead of every lane issuing cp.async with its own
// addresses; the block scales follow by cp.async on the same barrier
// (TmaTileCopier). The regions of the kStages stages lie one after another
// per kind (codes in the swizzled rows the maps write, scales token-major),
// so that every code region starts on its swizzle repeat.
// ---------------------------------------------------------------------------
template <int D, bool kFp8K>
struct TokensInMTmaConfig : AttnTileRows<D, kFp8K> {
  using Rows = AttnTileRows<D, kFp8K>;
  static constexpr int kStages = 4;
  static constexpr int kKSwizzle = TmaCodeSwizzle(Rows::kKRowBytes);
  static constexpr int kVSwizzle = TmaCodeSwizzle(Rows::kRowBytes);
  static constexpr int kKcBytes = kAttnTile * Rows::kKRowBytes;
  static constexpr int kVcBytes = kAttnTile * Rows::kRowBytes;
  static constexpr int kSBytes = kAttnTile * Rows::kScaleBytes;  // [16][D / 16], token-major
  static constexpr int kKcOff = 0;
  static constexpr int kVcOff = kKcOff + kStages * kKcBytes;
  static constexpr int kKsOff = kVcOff + kStages * kVcBytes;
  static constexpr int kVsOff = kKsOff + (kFp8K ? 0 : kStages * kSBytes);
  static constexpr int kRingBytes = kVsOff + kStages * kSBytes;
  static constexpr int kRedBytes = kAttnTile * Rows::kRedStride * 4;
  static constexpr int kAlign = kKSwizzle == 3 || kVSwizzle == 3
                                    ? 1024
                                    : (kKSwizzle == 2 || kVSwizzle == 2 ? 512 : 128);
  static constexpr int kUsed = kRingBytes > kRedBytes ? kRingBytes : kRedBytes;
  static constexpr int kWarpBytes = (kUsed + kAlign - 1) / kAlign * kAlign;
  static_assert(kKcBytes % kAlign == 0 && kVcBytes % kAlign == 0 && kVcOff % kAlign == 0,
                "code regions on their swizzle repeat");
  static_assert(kKsOff % 128 == 0 && kVsOff % 128 == 0, "128-byte aligned TMA destinations");
  __device__ static uint32_t KOff(int t, int x) {
    return TmaSwizzled<Rows::kKRowBytes, kKSwizzle>(t, x);
  }
  __device__ static uint32_t VOff(int t, int x) {
    return TmaSwizzled<Rows::kRowBytes, kVSwizzle>(t, x);
  }
};

// PRMT selectors for DecodeWordPairHalf2Sel of lane c's V words (the TMA
// branch of the kernel's tile_values): the bytes of {a, b} interleaved as
// {a0, b0, a1, b1} and {a2, b2, a3, b3}, with a and b swapped for odd c.
struct VPairSelectors {
  uint32_t lo, hi;
};
__device__ __forceinline__ VPairSelectors VPairSelectorsFor(int c) {
  return (c & 1) ? VPairSelectors{0x1504u, 0x3726u} : VPairSelectors{0x5140u, 0x7362u};
}

// device::DecodeWordPairHalf2 with the byte interleave's selectors given.
__device__ __forceinline__ void DecodeWordPairHalf2Sel(uint32_t codes_a, uint32_t codes_b,
                                                       VPairSelectors sel, uint32_t scale_mul,
                                                       uint32_t out[8]) {
  uint32_t y0, y1;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(y0) : "r"(codes_a), "r"(codes_b), "r"(sel.lo));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(y1) : "r"(codes_a), "r"(codes_b), "r"(sel.hi));
  device::DecodeInterleavedPairHalf2(y0, y1, scale_mul, out);
}

// The copy state of one warp of the TMA variant for its range of an item.
// Per tile, lane 0 issues one tensor copy for the K codes and one for the V
// codes (16 rows of one head, one page); the 32 block-scale rows (8 bytes
// each at d = 128: too short for the tensor unit, which would spend as much
// time on them as on the codes) go by cp.async, one lane a row (K scales in
// lanes 0-15, V scales in lanes 16-31), zero-filled for tokens outside the
// range or on an out-of-range page, and arrive on the same mbarrier
// (cp.async.mbarrier.arrive.noinc: 32 arrivals besides lane 0's
// arrive.expect_tx). Every lane keeps the page-table read-ahead of the
// cp.async fast path (32 entries a load, one per lane, 32 columns ahead).
template <int D, bool kFp8K, class Cfg>
struct TmaTileCopier {
  static constexpr int kBarArrivals = 33;
  uint8_t* ring;
  uint32_t bars;     // the warp's kStages mbarriers (8 bytes apart)
  uint32_t* masks;   // the warp's kStages valid masks (bit 2t and 2t + 1: token t)
  int pj, pe;        // page-table column and entry of the next tile's first token
  int lo, hi;        // the valid tokens of the warp's range
  int b, head;
  int col0, ent, ent_next;

  __device__ __forceinline__ int LoadEntries(const internal::AttentionParams& p, int col) const {
    const int cc = col + static_cast<int>(threadIdx.x & 31);
    if (cc * p.page_size >= hi) return -1;
    const int64_t pg = internal::TableEntry(p.block_tables, p.tables_i64,
                                            static_cast<int64_t>(b) * p.table_row_stride + cc);
    return pg >= 0 && pg < p.num_pages ? static_cast<int>(pg) : -1;
  }

  // tile0: the first tile's first token (a multiple of 16); [lo_, hi_): the
  // tokens the warp attends.
  __device__ __forceinline__ void Init(const AttnLaunch& a, const AttnItem& it, uint8_t* ring_,
                                       uint32_t bars_, uint32_t* masks_, int tile0, int lo_,
                                       int hi_) {
    const internal::AttentionParams& p = a.p;
    ring = ring_;
    bars = bars_;
    masks = masks_;
    lo = lo_;
    hi = hi_;
    b = it.b;
    head = it.head;
    pj = tile0 / p.page_size;
    pe = tile0 - pj * p.page_size;
    col0 = pj;
    ent = LoadEntries(p, col0);
    ent_next = LoadEntries(p, col0 + 32);
  }

  // Copies the tile starting at token tile_start into stage `stage`.
  __device__ __forceinline__ void Issue(const AttnLaunch& a, int stage, int tile_start) {
    const internal::AttentionParams& p = a.p;
    const int lane = static_cast<int>(threadIdx.x & 31);
    if (pj >= col0 + 32) {  // warp-uniform
      col0 += 32;
      ent = ent_next;
      ent_next = LoadEntries(p, col0 + 32);
    }
    const int pg = __shfl_sync(0xffffffffu, ent, pj - col0);
    const uint32_t bar = bars + 8 * stage;
    const uint32_t base = SmemAddr(ring);
    {
      // Block scales: token t = lane % 16 of K (lanes 0-15) or V (16-31).
      const int t = lane & (kAttnTile - 1);
      const bool v = lane >= kAttnTile;
      const bool ok = pg >= 0 && tile_start + t >= lo && tile_start + t < hi;
      const internal::PoolPtrs& q = v ? p.v : p.k;
      const uint8_t* src = q.scales + static_cast<int64_t>(ok ? pg : 0) * q.scale_page +
                           static_cast<int64_t>(ok ? pe + t : 0) * q.scale_entry +
                           static_cast<int64_t>(head) * q.scale_head;
      const uint32_t dst = base + (v ? Cfg::kVsOff : Cfg::kKsOff) + stage * Cfg::kSBytes +
                           t * Cfg::kScaleBytes;
      if (!kFp8K || v) CpAsync<Cfg::kScaleBytes>(dst, src, ok);
      CpAsyncMbarArrive(bar);
    }
    if (lane == 0) {
      const int a0 = max(lo - tile_start, 0), a1 = min(hi - tile_start, kAttnTile);
      uint32_t m = 0;
      if (pg >= 0 && a1 > a0) {
        m = (a1 >= kAttnTile ? 0xffffffffu : (1u << (2 * a1)) - 1u) & ~((1u << (2 * a0)) - 1u);
      }
      masks[stage] = m;
      // No proxy fence here: the stage's last readers (this warp's shared
      // loads, complete before the caller's __syncwarp) only read it; the
      // generic writes into a ring (the combine's rows, the odd tile's
      // zeroed scales) are fenced where they are made. (The fence costs a
      // MEMBAR that would wait for this lane's scale copy just issued.)
      TmaArriveExpectTx(bar, a.tma.tile_bytes);
      TmaLoad4d(base + Cfg::kKcOff + stage * Cfg::kKcBytes, &a.tma.kc, 0, pe, head, pg, bar);
      TmaLoad4d(base + Cfg::kVcOff + stage * Cfg::kVcBytes, &a.tma.vc, 0, pe, head, pg, bar);
    }
    pe += kAttnTile;
    if (pe >= p.page_size) {
      pe -= p.page_size;
      ++pj;
    }
  }
};

// Two f16 of each of a and b: {a.lo, b.lo} and {a.hi, b.hi}.
__device__ __forceinline__ uint32_t PairLow(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t PairHigh(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The 8x8 f16 matrix whose row r, columns 2c, 2c+1 lane 4r + c holds, as
// the same fragment of its transpose.
__device__ __forceinline__ uint32_t MovMatrixTrans(uint32_t x) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(x));
  return d;
}

template <int D, int kN, bool kBf16, bool kSoftCap, bool kFp8K, bool kTma>
__global__ void __launch_bounds__(kAttnThreads, (kTokensInMCtasPerSm<D, kN, kFp8K>))
    DecodeTokensInMKernel(const __grid_constant__ AttnLaunch a) {
  static_assert(kN == 1 || kN == 2, "one or two n-tiles of 8 query rows");
  using Cfg = std::conditional_t<kTma, TokensInMTmaConfig<D, kFp8K>, TokensInMConfig<D, kFp8K>>;
  static_assert(Cfg::kStages == 4, "two pairs of stages");
#if !defined(FP4KV_TMA_ENABLED)
  if constexpr (kTma) {
    __trap();  // never launched off sm_90 (kernels/attention/launch.cuh)
    return;
  }
#endif
  constexpr int kKSteps = D / 16;  // k-steps of S^T (and m-tiles of O^T)
  constexpr int kMT = D / 16;
  constexpr int kKWords = D / 32;  // NVFP4 code words per lane and K token
  constexpr int kVWords = D / 64;  // code words per lane and V token
  constexpr int kSeg = D / 8;      // output dims per lane segment
  constexpr int kQDims = D / 4;    // Q dims per lane
  extern __shared__ __align__(16) uint8_t smem_raw[];
  // TMA rings start on their swizzle repeat (the launch adds kAlign bytes).
  uint8_t* smem = smem_raw;
  if constexpr (kTma) {
    constexpr uint32_t kAlign = TokensInMTmaConfig<D, kFp8K>::kAlign;
    smem += (kAlign - (SmemAddr(smem_raw) & (kAlign - 1))) & (kAlign - 1);
  }
  const internal::AttentionParams& p = a.p;
  LaunchDependentGrids();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int* item_prefix = reinterpret_cast<int*>(smem + kAttnWarps * Cfg::kWarpBytes);
  int* slot_prefix = item_prefix + p.max_batch + 1;
  const int chunk_bound = BuildAttnSchedule(a, item_prefix, slot_prefix);
  const int total_items = item_prefix[p.batch_size];

  uint8_t* wsm = smem + warp * Cfg::kWarpBytes;
  uint8_t* stages = wsm;
  const int g = lane >> 2, c = lane & 3;
  const float gk = p.k_scale.Get();

  __shared__ float2 ml_sm[kAttnWarps][kAttnTile];
  __shared__ AttnCopyBase copy_base[2];  // per item, lanes of half 0 and 1
  // TMA: the warps' full barriers and valid masks, one per stage, and the
  // tiles this warp has issued so far (stage and phase of its next tile).
  __shared__ __align__(8) uint64_t tma_bars[kAttnWarps][Cfg::kStages];
  __shared__ uint32_t tma_masks[kAttnWarps][Cfg::kStages];
  uint32_t ring_count = 0;
  const VPairSelectors vsel = VPairSelectorsFor(c);
  if constexpr (kTma) {
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < Cfg::kStages; ++s) {
        MbarInit(SmemAddr(&tma_bars[warp][s]), TmaTileCopier<D, kFp8K, Cfg>::kBarArrivals);
      }
      TmaFenceBarrierInit();
    }
    __syncwarp();
  }
  for (int item = blockIdx.x; item < total_items; item += gridDim.x) {
    const AttnItem it = ResolveAttnItem(a, item, chunk_bound, item_prefix, slot_prefix);
    // This warp's tiles: a quarter of the item's, contiguous. The TMA
    // variant puts its tiles on the 16-token grid (a tile is one box of one
    // page) and masks the tokens before it.t0.
    const int grid0 = kTma ? it.t0 - (it.t0 & (kAttnTile - 1)) : it.t0;
    const int item_tiles = (it.t1 - grid0 + kAttnTile - 1) / kAttnTile;
    const int warp_tiles = (item_tiles + kAttnWarps - 1) / kAttnWarps;
    const int w_t0 = grid0 + warp * warp_tiles * kAttnTile;
    const int w_t1 = min(it.t1, w_t0 + warp_tiles * kAttnTile);
    const int n_tiles = w_t0 < w_t1 ? (w_t1 - w_t0 + kAttnTile - 1) / kAttnTile : 0;

    // ---- Q: lane (g, c) loads dims [c D/4, (c+1) D/4) of row 8 nt + g
    // (bf16 rows scaled by 2^kq into f16 range) and keeps the B fragments of
    // every k-step in registers.
    uint32_t qb[kN][kKSteps][2];
    int kq[kN];
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
      const AttnRow row = GetAttnRow(p, it, 8 * nt + g);
      uint32_t w[kQDims / 2];  // natural pairs: w[i] = dims 2i, 2i + 1
#pragma unroll
      for (int i = 0; i < kQDims / 2; ++i) w[i] = 0;
      if (row.valid) {
        const uint16_t* src =
            QRowPtr(p, it.r.q_begin + row.qi, it.head * p.group + row.gi) + c * kQDims;
#pragma unroll
        for (int i = 0; i < kQDims / 8; ++i) {
          const uint4 v = *reinterpret_cast<const uint4*>(src + 8 * i);
          w[4 * i + 0] = v.x;
          w[4 * i + 1] = v.y;
          w[4 * i + 2] = v.z;
          w[4 * i + 3] = v.w;
        }
      }
      kq[nt] = 0;
      if constexpr (kBf16) {
        uint32_t amax = 0;
#pragma unroll
        for (int i = 0; i < kQDims / 2; ++i) amax = Bf16PairAbsMax(amax, w[i]);
        amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const QScale scale = QScaleFor(amax);
        kq[nt] = scale.kq;
#pragma unroll
        for (int i = 0; i < kQDims / 2; ++i) w[i] = Bf16PairToHalf2(w[i], scale.mul);
      }
      if constexpr (kFp8K) {
        // k-step j: dims 4j, 4j+1 (k = 2c, 2c+1) and 4j+2, 4j+3 (2c+8, 2c+9).
#pragma unroll
        for (int j = 0; j < kKSteps; ++j) {
          qb[nt][j][0] = w[2 * j];
          qb[nt][j][1] = w[2 * j + 1];
        }
      } else {
        // Code word u (dims 8u..8u+7) decodes to {v0,v2}, {v4,v6}, {v1,v3},
        // {v5,v7}: k-step 2u takes dims 0, 2 | 4, 6, k-step 2u+1 dims 1, 3 | 5, 7.
#pragma unroll
        for (int u = 0; u < kKWords; ++u) {
          qb[nt][2 * u][0] = PairLow(w[4 * u], w[4 * u + 1]);
          qb[nt][2 * u][1] = PairLow(w[4 * u + 2], w[4 * u + 3]);
          qb[nt][2 * u + 1][0] = PairHigh(w[4 * u], w[4 * u + 1]);
          qb[nt][2 * u + 1][1] = PairHigh(w[4 * u + 2], w[4 * u + 3]);
        }
      }
    }

    // ---- This lane's S^T columns: rows 8 nt + 2c + i.
    float lf[kN][2];  // logit factor: to log2 units, or to x / cap with a soft cap
    // Keys [*lo, *hi] that row 8 nt + 2c + i may attend (recomputed on the
    // rare tiles that need a mask rather than kept in registers).
    const auto row_bounds = [&](int nt, int i, int* lo, int* hi) {
      const AttnRow row = GetAttnRow(p, it, 8 * nt + 2 * c + i);
      *lo = -(1 << 30);
      *hi = 1 << 30;
      if (row.stored) {
        *hi = row.pos;
        if (p.window_left >= 0) *lo = row.pos - p.window_left;
      }
    };
    int lo_max = -(1 << 30), hi_min = 1 << 30;
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int k = __shfl_sync(0xffffffffu, kq[nt], 4 * (2 * c + i));
        lf[nt][i] = QLogitFactor<kSoftCap, kFp8K>(p, gk, k);
        int lo, hi;
        row_bounds(nt, i, &lo, &hi);
        lo_max = max(lo_max, lo);
        hi_min = min(hi_min, hi);
      }
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      lo_max = max(lo_max, __shfl_xor_sync(0xffffffffu, lo_max, o));
      hi_min = min(hi_min, __shfl_xor_sync(0xffffffffu, hi_min, o));
    }

    // ---- Copy pipeline of this warp.
    using Copier = std::conditional_t<kTma, TmaTileCopier<D, kFp8K, Cfg>,
                                      AttnTileCopier<D, kFp8K, Cfg>>;
    Copier copier;
    if constexpr (kTma) {
      copier.Init(a, it, stages, SmemAddr(&tma_bars[warp][0]), &tma_masks[warp][0], w_t0,
                  max(w_t0, it.t0), w_t1);
    } else {
      copier.Init(a, it, stages, w_t0, w_t1, copy_base);
    }
    // Stage of the warp's local tile j.
    const auto stage_of = [&](int j) {
      return kTma ? static_cast<int>((ring_count + j) % Cfg::kStages) : j % Cfg::kStages;
    };

    // O^T: o[nt][j] = m-tile j (see the header), columns 2c, 2c+1 of n-tile nt.
    float o[kN][kMT][4];
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
      for (int j = 0; j < kMT; ++j) o[nt][j][0] = o[nt][j][1] = o[nt][j][2] = o[nt][j][3] = 0.0f;
    }
    float m_run[kN][2], l_run[kN][2];
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
      m_run[nt][0] = m_run[nt][1] = -INFINITY;
      l_run[nt][0] = l_run[nt][1] = 0.0f;
    }

    // Pairs of tiles: stages 0, 1 hold pair 0, stages 2, 3 pair 1, ...; the
    // tiles of pair p + 2 are issued once pair p has been consumed, so a pair
    // is in flight while another is computed. One cp.async group per tile
    // (empty past the range): the pair's first tile is computed while its
    // second may still arrive.
#pragma unroll
    for (int s = 0; s < Cfg::kStages; ++s) {
      if (s < n_tiles) copier.Issue(a, stage_of(s), w_t0 + kAttnTile * s);
      if constexpr (!kTma) CpAsyncCommit();
    }

    // S^T of the tile in stage st: s[nt] = tokens g (0, 1) and g + 8 (2, 3),
    // rows 8 nt + 2c (0, 2) and 8 nt + 2c + 1 (1, 3).
    const auto tile_scores = [&](int stage, float(&s)[kN][4]) {
      const uint8_t* st = stages + stage * (kTma ? 0 : TokensInMConfig<D, kFp8K>::kStageBytes);
    // ---- S^T = K Q^T: s[nt] = tokens g (0, 1) and g + 8 (2, 3), rows
    // 8 nt + 2c (0, 2) and 8 nt + 2c + 1 (1, 3).
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      if constexpr (kFp8K) {
#pragma unroll
        for (int w4 = 0; w4 < D / 64; ++w4) {
          uint32_t kw[2][4];
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            uint4 v;
            if constexpr (kTma) {
              const uint8_t* kc = stages + Cfg::kKcOff + stage * Cfg::kKcBytes;
              v = *reinterpret_cast<const uint4*>(
                  kc + TokensInMTmaConfig<D, kFp8K>::KOff(g + 8 * t, ((D / 64) * c + w4) * 16));
            } else {
              const uint8_t* krow = st + TokensInMConfig<D, kFp8K>::kKcOff +
                                    g * TokensInMConfig<D, kFp8K>::kKRowStride;
              v = *reinterpret_cast<const uint4*>(
                  krow + 8 * t * TokensInMConfig<D, kFp8K>::kKRowStride +
                  TokensInMConfig<D, kFp8K>::KChunk(g, (D / 64) * c + w4) * 16);
            }
            kw[t][0] = v.x;
            kw[t][1] = v.y;
            kw[t][2] = v.z;
            kw[t][3] = v.w;
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t ka[4];
            device::Fp8KeyWordToHalf2(kw[0][j], &ka[0], &ka[2]);
            device::Fp8KeyWordToHalf2(kw[1][j], &ka[1], &ka[3]);
#pragma unroll
            for (int nt = 0; nt < kN; ++nt) {
              Mma16816(s[nt], ka, qb[nt][4 * w4 + j][0], qb[nt][4 * w4 + j][1]);
            }
          }
        }
      } else {
        KTileWords<D, Cfg> kt;
        if constexpr (kTma) {
          // 16-byte loads: a warp's 512 bytes then take the minimum of four
          // wavefronts (8-byte loads take eight: tokens g and g + 2 share
          // banks); the 128B swizzle moves each 16-byte chunk on its own.
          const uint8_t* kc = stages + Cfg::kKcOff + stage * Cfg::kKcBytes;
          const uint8_t* ks = stages + Cfg::kKsOff + stage * Cfg::kSBytes;
          kt.template LoadWith<true>(
              [&](int t, int x) { return kc + Cfg::KOff(g + 8 * t, c * (D / 8) + x); },
              [&](int t) { return ks + (g + 8 * t) * Cfg::kScaleBytes + c * (D / 64); });
        } else {
          kt.Load(st, g, c);
        }
#pragma unroll
        for (int w = 0; w < kKWords; ++w) {
          uint32_t dec[2][4];
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            device::DecodeWordHalf2(kt.w[t][w], kt.WordMul(t, w), dec[t]);
          }
          const uint32_t a0[4] = {dec[0][0], dec[1][0], dec[0][1], dec[1][1]};
          const uint32_t a1[4] = {dec[0][2], dec[1][2], dec[0][3], dec[1][3]};
#pragma unroll
          for (int nt = 0; nt < kN; ++nt) {
            Mma16816(s[nt], a0, qb[nt][2 * w][0], qb[nt][2 * w][1]);
            Mma16816(s[nt], a1, qb[nt][2 * w + 1][0], qb[nt][2 * w + 1][1]);
          }
        }
      }
    };
    // O^T += V^T P^T of the tile in stage st (pb: its P^T B fragments).
    const auto tile_values = [&](int stage, const uint32_t(&pb)[kN][2]) {
      VTileWords<D, Cfg> vt;
      if constexpr (kTma) {
        // Tokens in natural order: w[k] holds token 2c + ((k & 1) ^ (c & 1))
        // + 8 (k >> 1), i.e. lanes of odd c load the pair's tokens in the
        // other order, so that each load covers both halves of the banks
        // (a tile's rows alternate between them); vsel's PRMT selectors
        // undo it in the decode.
        const uint8_t* vc = stages + Cfg::kVcOff + stage * Cfg::kVcBytes;
        const uint8_t* vs = stages + Cfg::kVsOff + stage * Cfg::kSBytes;
        vt.LoadWith(
            [&](int k, int x) {
              const int tt = 2 * c + ((k & 1) ^ (c & 1)) + 8 * (k >> 1);
              return vc + Cfg::VOff(tt, g * (D / 16) + x);
            },
            [&](int i) { return vs + (2 * c + (i & 1) + 8 * (i >> 1)) * Cfg::kScaleBytes; }, g);
      } else {
        vt.Load(stages + stage * TokensInMConfig<D, kFp8K>::kStageBytes, g, c);
      }
#pragma unroll
      for (int w = 0; w < kVWords; ++w) {
        uint32_t b0[8], b1[8];  // dims 8w + d of tokens {2c, 2c+1}, {2c+8, 2c+9}
        if constexpr (kTma) {
          DecodeWordPairHalf2Sel(vt.w[0][w], vt.w[1][w], vsel, vt.WordMul(0, w), b0);
          DecodeWordPairHalf2Sel(vt.w[2][w], vt.w[3][w], vsel, vt.WordMul(1, w), b1);
        } else {
          device::DecodeWordPairHalf2(vt.w[0][w], vt.w[1][w], vt.WordMul(0, w), b0);
          device::DecodeWordPairHalf2(vt.w[2][w], vt.w[3][w], vt.WordMul(1, w), b1);
        }
#pragma unroll
        for (int d = 0; d < 4; ++d) {
          const uint32_t va[4] = {b0[d], b0[d + 4], b1[d], b1[d + 4]};
#pragma unroll
          for (int nt = 0; nt < kN; ++nt) Mma16816(o[nt][4 * w + d], va, pb[nt][0], pb[nt][1]);
        }
      }
    };

    for (int i = 0; i < n_tiles; i += 2) {
      const int stage0 = stage_of(i), stage1 = stage_of(i + 1);
      const int tile_start = w_t0 + kAttnTile * i;
      uint32_t ballot[2];
      float s[2][kN][4];
      if constexpr (kTma) {
        // Tokens outside the range have zero block scales (the copy
        // zero-fills them), so that their P V adds exact zeros. The odd
        // last tile's stage has no copy in flight and holds an older tile:
        // mask 0, and its V scales are zeroed here (P is 0 there; an old
        // NaN scale would not be).
        const auto arrive = [&](int j, int stage) -> uint32_t {
          uint32_t m = 0;
          if (j < n_tiles) {
            const uint32_t n = ring_count + j;
            MbarWait(SmemAddr(&tma_bars[warp][stage]), (n / Cfg::kStages) & 1u);
            m = tma_masks[warp][stage];
          } else {
            if (lane < kAttnTile && ((m >> (2 * lane)) & 1u) == 0) {
              uint8_t* vsr = stages + Cfg::kVsOff + stage * Cfg::kSBytes + lane * Cfg::kScaleBytes;
              if constexpr (Cfg::kScaleBytes == 16) {
                *reinterpret_cast<uint4*>(vsr) = make_uint4(0u, 0u, 0u, 0u);
              } else if constexpr (Cfg::kScaleBytes == 8) {
                *reinterpret_cast<uint2*>(vsr) = make_uint2(0u, 0u);
              } else {
                *reinterpret_cast<uint32_t*>(vsr) = 0u;
              }
              FenceProxyAsyncShared();  // before a later tensor copy into the stage
            }
            __syncwarp();
          }
          return m;
        };
        ballot[0] = arrive(i, stage0);
        tile_scores(stage0, s[0]);
        ballot[1] = arrive(i + 1, stage1);
        tile_scores(stage1, s[1]);
      } else {
        uint8_t* st1 = stages + stage1 * TokensInMConfig<D, kFp8K>::kStageBytes;
        constexpr int kMaskOff = TokensInMConfig<D, kFp8K>::kMaskOff;
        CpAsyncWait<Cfg::kStages - 1>();  // tile i
        __syncwarp();
        ballot[0] = *reinterpret_cast<const uint32_t*>(
            stages + stage0 * TokensInMConfig<D, kFp8K>::kStageBytes + kMaskOff);
        tile_scores(stage0, s[0]);
        CpAsyncWait<Cfg::kStages - 2>();  // tile i + 1
        if (i + 1 >= n_tiles) {
          // An odd last tile: the pair's second stage (no copy in flight)
          // reads as fully masked (ballot 0) with zero V scales, so its P V
          // adds exact zeros.
          for (int k = lane; k < kAttnTile * Cfg::kScaleBytes / 4; k += 32) {
            reinterpret_cast<uint32_t*>(st1 + TokensInMConfig<D, kFp8K>::kVsOff)[k] = 0u;
          }
          if (lane == 0) *reinterpret_cast<uint32_t*>(st1 + kMaskOff) = 0u;
        }
        __syncwarp();
        ballot[1] = *reinterpret_cast<const uint32_t*>(st1 + kMaskOff);
        tile_scores(stage1, s[1]);
      }

      // ---- Online softmax (log2 units) over the pair, per column (row
      // 8 nt + 2c + i).
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = s[h][nt][e] * lf[nt][e & 1];
            if constexpr (kSoftCap) x = tanhf(x) * p.soft_cap * kLog2e;
            s[h][nt][e] = x;
          }
        }
      }
      const bool full = (ballot[0] & ballot[1]) == 0xffffffffu && tile_start >= lo_max &&
                        tile_start + 2 * kAttnTile - 1 <= hi_min;
      if (!full) {
#pragma unroll
        for (int nt = 0; nt < kN; ++nt) {
          int row_lo[2], row_hi[2];
          row_bounds(nt, 0, &row_lo[0], &row_hi[0]);
          row_bounds(nt, 1, &row_lo[1], &row_hi[1]);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int tt = g + 8 * (e >> 1);
              const int t = tile_start + kAttnTile * h + tt;
              const bool ok =
                  ((ballot[h] >> (2 * tt)) & 1u) && t >= row_lo[e & 1] && t <= row_hi[e & 1];
              if (!ok) s[h][nt][e] = -INFINITY;
            }
          }
        }
      }
      float alpha[kN][2];
      bool rescale = false;
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx =
              fmaxf(fmaxf(s[0][nt][r], s[0][nt][2 + r]), fmaxf(s[1][nt][r], s[1][nt][2 + r]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
          // Lazy rescale (OnlineMaxStep): O is rescaled on few steps.
          float m_use;
          alpha[nt][r] = OnlineMaxStep(&m_run[nt][r], mx, &m_use);
          rescale = rescale || alpha[nt][r] != 1.0f;
          float sum = 0.0f;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            s[h][nt][r] = Ex2(s[h][nt][r] - m_use);
            s[h][nt][2 + r] = Ex2(s[h][nt][2 + r] - m_use);
            sum += s[h][nt][r] + s[h][nt][2 + r];
          }
          l_run[nt][r] = l_run[nt][r] * alpha[nt][r] + sum;
        }
      }
      if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
        for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
          for (int j = 0; j < kMT; ++j) {
            o[nt][j][0] *= alpha[nt][0];
            o[nt][j][1] *= alpha[nt][1];
            o[nt][j][2] *= alpha[nt][0];
            o[nt][j][3] *= alpha[nt][1];
          }
        }
      }
      // P^T as the B fragments of O^T += V^T P^T: lane (g, c) gets row
      // 8 nt + g, tokens 2c, 2c+1 (pb[h][nt][0]) and 2c+8, 2c+9 (pb[h][nt][1]).
      uint32_t pb[2][kN][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int nt = 0; nt < kN; ++nt) {
          pb[h][nt][0] = MovMatrixTrans(PackHalf2(s[h][nt][0], s[h][nt][1]));
          pb[h][nt][1] = MovMatrixTrans(PackHalf2(s[h][nt][2], s[h][nt][3]));
        }
      }
      tile_values(stage0, pb[0]);
      tile_values(stage1, pb[1]);
      __syncwarp();
      {
        const int nx = i + Cfg::kStages;
        if (nx < n_tiles) copier.Issue(a, stage_of(nx), w_t0 + kAttnTile * nx);
        if constexpr (!kTma) CpAsyncCommit();
        if (nx + 1 < n_tiles) copier.Issue(a, stage_of(nx + 1), w_t0 + kAttnTile * (nx + 1));
        if constexpr (!kTma) CpAsyncCommit();
      }
    }
    if constexpr (kTma) {
      ring_count += static_cast<uint32_t>(n_tiles);
    } else {
      CpAsyncWait<0>();
    }
    __syncwarp();
    // (m, l) as handed on (l carries the factor 2^kAttnPOffset), the row
    // sums across the 8 lanes of a column.
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        m_run[nt][r] = HandedOnMax(m_run[nt][r]);
        l_run[nt][r] = RowLaneSum<4, 16>(l_run[nt][r]);
      }
    }

    // ---- Combine the warps (merge.cuh's StoreItemRows): each stores its O
    // rescaled to the CTA's row max into its own (now idle) shared memory.
    if (g == 0) {
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
        ml_sm[warp][8 * nt + 2 * c] = make_float2(m_run[nt][0], l_run[nt][0]);
        ml_sm[warp][8 * nt + 2 * c + 1] = make_float2(m_run[nt][1], l_run[nt][1]);
      }
    }
    if (kN == 1 && g == 1) {  // rows 8..15 hold nothing
      ml_sm[warp][8 + 2 * c] = make_float2(-INFINITY, 0.0f);
      ml_sm[warp][8 + 2 * c + 1] = make_float2(-INFINITY, 0.0f);
    }
    __syncthreads();
    float* red = reinterpret_cast<float*>(wsm);
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 8 * nt + 2 * c + r;
        const float f = ToCtaRowMax(ml_sm, row, m_run[nt][r]);
        float* seg = red + row * Cfg::kRedStride + g * kSeg;
        // Dims 8u + d (d < 4) are m-tile 4u + d's row g, dims 8u + 4 + d its
        // row g + 8.
#pragma unroll
        for (int k = 0; k < kSeg / 4; ++k) {
          const int j0 = 4 * (k / 2), reg = (k % 2) * 2 + r;
          *reinterpret_cast<float4*>(seg + 4 * k) =
              make_float4(o[nt][j0][reg] * f, o[nt][j0 + 1][reg] * f, o[nt][j0 + 2][reg] * f,
                          o[nt][j0 + 3][reg] * f);
        }
      }
    }
    __syncthreads();
    StoreItemRows<D, kBf16>(a, it, smem, Cfg::kWarpBytes, Cfg::kRedStride, ml_sm);
    __syncthreads();
    // The ring held the combine's rows (generic writes and reads): ordered
    // before the next item's tensor copies into it.
    if constexpr (kTma) FenceProxyAsyncShared();
  }
  // Launched beside the prefill kernel of the same Run (programmatic
  // dependent launch): this grid completes only after that one, so what
  // follows in the stream still finds every row written. A no-op otherwise.
  WaitForPrerequisiteGrids();
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_TOKENS_IN_M_CUH_
