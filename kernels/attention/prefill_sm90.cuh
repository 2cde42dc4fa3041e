// Internal: the sm_90a family of the prefill kernel (requests with many new
// tokens), head dims 64 and 128. Same contract, schedule, items (128 query
// rows of one KV head), number formats and online softmax as
// PrefillAttentionKernel (kernels/attention/prefill.cuh); what differs is
// who does what:
//
// - A CTA is four warpgroups: two consumers of 64 query rows each and two
//   producers, one for K and one for V. A producer thread loads half a token
//   row of each 64-token tile from the pages (one page-table lookup a tile,
//   any page size, i32/i64 tables, oob entries masked), decodes it to f16
//   and stores it in the 128-byte-swizzled layout wgmma reads. setmaxnreg
//   moves registers from the producers (88) to the consumers (168).
// - Tiles pass through a ring of kStages shared buffers guarded by two
//   mbarriers each: `full` (the producers' 256 threads arrive after their
//   stores and an async-proxy fence) and `empty` (the consumers' 256 threads
//   arrive once their wgmmas on the buffer have completed). Producers and
//   consumers walk the same items and tiles, so one tile counter gives both
//   the buffer and the phase. A producer keeps two tiles of codes in
//   registers (the loads of tile j + 2 in flight while tile j is decoded).
// - A consumer computes S = Q K^T with wgmma m64n64k16 (Q and K from shared
//   memory, K-major), the softmax in registers (the accumulator layout is
//   the mma.sync one per warp), and O += P V with wgmma m64n{D}k16: P from
//   registers, V from shared memory N-major (its token rows as stored). S of
//   tile j is issued before P V of tile j - 1, so the softmax of tile j runs
//   while the tensor cores multiply; tile j - 1's buffer is released when
//   that product has completed.
// A consumer warpgroup multiplies only the run of tiles holding a key of
// one of its rows (causal / window bounds of its first and last rows); the
// others pass through its barriers.
#ifndef FP4KV_KERNELS_ATTENTION_PREFILL_SM90_CUH_
#define FP4KV_KERNELS_ATTENTION_PREFILL_SM90_CUH_

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "fp4kv/device/page_reader.cuh"
#include "kernels/attention/ptx.cuh"
#include "kernels/attention/q_stage.cuh"
#include "kernels/attention/row_state.cuh"
#include "kernels/attention/schedule.cuh"
#include "kernels/attention/tma.cuh"
#include "kernels/attention/wgmma.cuh"
#include "src/attention_params.h"

namespace fp4kv {
namespace kernels {

template <int D>
struct PrefillSm90Config {
  static_assert(D == 64 || D == 128, "the sm_90a prefill family covers head dims 64 and 128");
  static constexpr int kConsumers = 2;                     // warpgroups of 64 query rows
  static constexpr int kRows = 64 * kConsumers;            // query rows per item
  static constexpr int kProducers = 2;                     // warpgroups decoding K, V
  static constexpr int kThreads = 128 * (kConsumers + kProducers);
  // Registers a thread (setmaxnreg): the consumers hold S, P and O; the
  // producers give theirs up (all four warpgroups share 64 K registers).
  static constexpr int kConsumerRegs = 168;
  static constexpr int kProducerRegs = (65536 / 128 - kConsumers * kConsumerRegs) / kProducers;
  static constexpr int kBN = 64;                           // tokens per K/V tile
  static constexpr int kStages = 4;
  // A producer thread takes half a token row of K and V a tile: kCV values.
  static constexpr int kCV = D / 2;
  static constexpr int kQBytes = 64 * D * 2;     // one consumer's Q (and output staging)
  static constexpr int kTileBytes = kBN * D * 2;  // K or V of one tile, f16
  static constexpr int kQOff = 0;
  static constexpr int kKOff = kQOff + kConsumers * kQBytes;
  static constexpr int kVOff = kKOff + kStages * kTileBytes;
  static constexpr int kOkOff = kVOff + kStages * kTileBytes;  // [kStages][kBN] token valid
  static constexpr int kBadOff = kOkOff + kStages * kBN;  // [kStages][8]: a warp's invalid
  static constexpr int kBarOff = kBadOff + kStages * 8;    // full[], empty[]
  static constexpr int kBytes = kBarOff + 2 * kStages * 8;
  static constexpr int kAlign = 1024;  // swizzle atoms
  static_assert(kQBytes % kAlign == 0 && kTileBytes % kAlign == 0, "1024-byte aligned tiles");
  static_assert(kBN * 2 == 128, "one half row of each tile token a producer thread");
  static_assert(kProducerRegs % 8 == 0 && kProducerRegs >= 24, "setmaxnreg counts");
  static_assert(kOkOff % 8 == 0 && kBN % 8 == 0, "8-byte aligned flags");
};

// Division by a fixed divisor d in [1, 2^31) of numerators in [0, 2^30):
// q = (umulhi(n, mul) + n) >> shift (round-up reciprocal).
struct FastDiv {
  uint32_t mul = 0;
  int shift = 0;
  __device__ __forceinline__ void Init(int d) {
    int l = 0;
    while ((1u << l) < static_cast<uint32_t>(d)) ++l;
    shift = l;
    mul = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << l) - d)) / d + 1);
  }
  __device__ __forceinline__ int operator()(int n) const {
    return static_cast<int>((__umulhi(static_cast<uint32_t>(n), mul) + static_cast<uint32_t>(n)) >>
                            shift);
  }
};

// A producer thread's half row of one token of K or V: kCV values, NVFP4
// (kWords = kCV / 8 code words and kCV / 16 scale bytes) or FP8 keys
// (kWords = kCV / 4, no scales).
template <int kCV, bool kFp8>
struct PrefillSm90Half {
  static constexpr int kWords = kFp8 ? kCV / 4 : kCV / 8;
  uint32_t w[kWords];
  uint32_t scales;  // kCV / 16 scale bytes (low first)
  bool ok;
};

// Up to 4 consecutive bytes (n = 2 or 4) as one little-endian word.
template <int kN>
__device__ __forceinline__ uint32_t LoadScaleBytes(const uint8_t* s) {
  if constexpr (kN == 4) {
    if ((reinterpret_cast<uintptr_t>(s) & 3) == 0) return __ldg(reinterpret_cast<const uint32_t*>(s));
    return __ldg(s) | (static_cast<uint32_t>(__ldg(s + 1)) << 8) |
           (static_cast<uint32_t>(__ldg(s + 2)) << 16) | (static_cast<uint32_t>(__ldg(s + 3)) << 24);
  } else {
    if ((reinterpret_cast<uintptr_t>(s) & 1) == 0) {
      return __ldg(reinterpret_cast<const uint16_t*>(s));
    }
    return __ldg(s) | (static_cast<uint32_t>(__ldg(s + 1)) << 8);
  }
}

// Loads token t's half row of `pool` (zeros and !ok at or past t_end and
// for table entries outside [0, num_pages)); `data` and `scales` point at
// the half's bytes in page 0, entry 0 of the item's head.
template <int kCV, bool kFp8>
__device__ __forceinline__ void LoadPrefillSm90Half(const internal::AttentionParams& p,
                                                    const internal::PoolPtrs& pool,
                                                    const FastDiv& page_div, int64_t table_row,
                                                    const uint8_t* data, const uint8_t* scales,
                                                    int t, int t_end,
                                                    PrefillSm90Half<kCV, kFp8>& raw) {
  using Half = PrefillSm90Half<kCV, kFp8>;
  raw.ok = false;
  int64_t pg = -1;
  int pe = 0;
  if (t < t_end) {
    const int pj = page_div(t);
    pe = t - pj * p.page_size;
    pg = internal::TableEntry(p.block_tables, p.tables_i64, table_row + pj);
    raw.ok = pg >= 0 && pg < p.num_pages;
  }
#pragma unroll
  for (int w = 0; w < Half::kWords; ++w) raw.w[w] = 0;
  raw.scales = 0;
  if (!raw.ok) return;
  const uint8_t* row = data + pg * pool.data_page + pe * pool.data_entry;
  if constexpr (kFp8) {
    // FP8 key rows are 16-byte aligned (the cache contract).
#pragma unroll
    for (int w = 0; w < Half::kWords; w += 4) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(row + 4 * w));
      raw.w[w] = a.x, raw.w[w + 1] = a.y, raw.w[w + 2] = a.z, raw.w[w + 3] = a.w;
    }
  } else {
    // Code rows are 8-byte aligned (the cache contract).
#pragma unroll
    for (int w = 0; w < Half::kWords; w += 2) {
      const uint2 a = __ldg(reinterpret_cast<const uint2*>(row + 4 * w));
      raw.w[w] = a.x, raw.w[w + 1] = a.y;
    }
    raw.scales = LoadScaleBytes<kCV / 16>(scales + pg * pool.scale_page + pe * pool.scale_entry);
  }
}

// The SETMAXNREG of a warpgroup (all its warps run it).
template <int kRegs>
__device__ __forceinline__ void SetMaxRegs(bool increase) {
#if defined(FP4KV_WGMMA_ENABLED)
  if (increase) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
  }
#endif
}

template <int D, bool kBf16, bool kSoftCap, bool kFp8K>
__global__ void __launch_bounds__(PrefillSm90Config<D>::kThreads, 1)
    PrefillSm90Kernel(const internal::AttentionParams p) {
#if defined(FP4KV_WGMMA_ENABLED)
  using Cfg = PrefillSm90Config<D>;
  constexpr int kBN = Cfg::kBN;
  constexpr int kStages = Cfg::kStages;
  constexpr int kNT = D / 8;    // O n-tiles of a warp
  constexpr int kSN = kBN / 8;  // S n-tiles of a warp
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const uint32_t raw_sm = SmemAddr(smem_raw);
  uint8_t* smem = smem_raw + ((Cfg::kAlign - (raw_sm & (Cfg::kAlign - 1))) & (Cfg::kAlign - 1));
  const uint32_t sm = SmemAddr(smem);
  int* item_prefix = reinterpret_cast<int*>(smem + Cfg::kBytes);
  uint8_t* tok_ok = smem + Cfg::kOkOff;
  uint8_t* tile_bad = smem + Cfg::kBadOff;
  const uint32_t full_bar = sm + Cfg::kBarOff;
  const uint32_t empty_bar = full_bar + 8 * kStages;
  const int tid = threadIdx.x;
  LaunchDependentGrids();  // the decode launch of the same Run may start beside
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      MbarInit(full_bar + 8 * s, 128 * Cfg::kProducers);
      MbarInit(empty_bar + 8 * s, 128 * Cfg::kConsumers);
    }
  }
  __shared__ int scan_tmp[Cfg::kThreads / 32];
  // (its CTA barrier also publishes the barrier initialization)
  const int total_items = PrefillSchedule<Cfg::kThreads>(p, Cfg::kRows, item_prefix, scan_tmp);
  const int wg = tid >> 7;
  const int lane = tid & 31;
  uint32_t kcount = 0;  // tiles through the ring so far: buffer kcount % kStages

  if (wg >= Cfg::kConsumers) {
    // ================= Producers: load, decode, store tiles; warpgroup
    // kConsumers takes K, the next V. Thread ptid takes half h of token tt's
    // row: a quarter warp covers 8 tokens (distinct rows mod 8:
    // conflict-free swizzled stores).
    SetMaxRegs<Cfg::kProducerRegs>(false);
    const int kv = wg - Cfg::kConsumers;
    const int ptid = tid & 127;
    const int pwarp = ptid >> 5;
    const int tt = (ptid & 7) + 8 * (ptid >> 4);
    const int h = (ptid >> 3) & 1;
    constexpr int kPieces = Cfg::kCV / 8;  // 16-byte f16 pieces of a half row
    FastDiv page_div;
    page_div.Init(p.page_size);
    const auto produce = [&](auto fp8_tag, const internal::PoolPtrs& pool, uint32_t region) {
      constexpr bool kFp8 = decltype(fp8_tag)::value;
      using Half = PrefillSm90Half<Cfg::kCV, kFp8>;
      for (int item = blockIdx.x; item < total_items; item += gridDim.x) {
        const PrefillItem it = ResolvePrefillItem(p, item_prefix, item, Cfg::kRows);
        const int n_tiles = it.t_begin < it.t_end ? (it.t_end - it.t_begin + kBN - 1) / kBN : 0;
        const int64_t table_row = static_cast<int64_t>(it.b) * p.table_row_stride;
        const uint8_t* data = pool.data + it.head * pool.data_head + h * (kFp8 ? Cfg::kCV : Cfg::kCV / 2);
        const uint8_t* scales =
            kFp8 ? nullptr : pool.scales + it.head * pool.scale_head + h * (Cfg::kCV / 16);
        const auto load = [&](int j, Half& raw) {
          LoadPrefillSm90Half<Cfg::kCV, kFp8>(p, pool, page_div, table_row, data, scales,
                                              it.t_begin + j * kBN + tt, it.t_end, raw);
        };
        Half ra, rb;
        if (n_tiles > 0) load(0, ra);
        if (n_tiles > 1) load(1, rb);
        const auto put = [&](Half& raw, int j) {
          const int stage = static_cast<int>(kcount % kStages);
          MbarWait(empty_bar + 8 * stage, ((kcount / kStages) & 1u) ^ 1u);
          const uint32_t dst = region + stage * Cfg::kTileBytes;
#pragma unroll
          for (int w = 0; w < kPieces; ++w) {
            uint32_t o4[4];
            if constexpr (kFp8) {
              device::Fp8KeyWordToHalf2(raw.w[2 * w], &o4[0], &o4[1]);
              device::Fp8KeyWordToHalf2(raw.w[2 * w + 1], &o4[2], &o4[3]);
            } else {
              const uint32_t m =
                  device::ScalePairMultiplier(((raw.scales >> (8 * (w >> 1))) & 0xffu) * 0x0101u);
              device::DecodeWordHalf2(raw.w[w], m, o4);
            }
            StShared16(dst + Sw128Offset(kBN, tt, h * kPieces + w), o4[0], o4[1], o4[2], o4[3]);
          }
          if (kv == 0 && h == 0) tok_ok[stage * kBN + tt] = raw.ok ? 1 : 0;
          const unsigned bad = __ballot_sync(0xffffffffu, !raw.ok);
          if ((ptid & 31) == 0) tile_bad[stage * 8 + 4 * kv + pwarp] = bad != 0 ? 1 : 0;
          FenceProxyAsyncShared();
          MbarArrive(full_bar + 8 * stage);
          if (j + 2 < n_tiles) load(j + 2, raw);
          ++kcount;
        };
        for (int j = 0; j < n_tiles; j += 2) {
          put(ra, j);
          if (j + 1 < n_tiles) put(rb, j + 1);
        }
      }
    };
    if (kv == 0) {
      produce(std::integral_constant<bool, kFp8K>{}, p.k, sm + Cfg::kKOff);
    } else {
      produce(std::integral_constant<bool, false>{}, p.v, sm + Cfg::kVOff);
    }
    return;
  }
  SetMaxRegs<Cfg::kConsumerRegs>(true);

  // ================= Consumers: 64 query rows each.
  const int wtid = tid & 127, warp = wtid >> 5;
  const int g = lane >> 2, c = lane & 3;
  uint8_t* qreg = smem + Cfg::kQOff + wg * Cfg::kQBytes;
  const uint32_t q_sm = SmemAddr(qreg);
  const float gk = p.k_scale.Get();
  const float gv = p.v_scale.Get();
  // Descriptors: Q and K K-major (k-step kk at 32-byte steps inside a
  // 128-byte row, dims 64.. in the second region), V N-major (k-step kk =
  // 16 token rows; its dims 64.. in the region LBO bytes on).
  const uint64_t q_desc = SmemDescSw128(q_sm, 16, 1024);
  const uint64_t k_desc = SmemDescSw128(sm + Cfg::kKOff, 16, 1024);
  const uint64_t v_desc = SmemDescSw128(sm + Cfg::kVOff, kBN * 128, 1024);

  for (int item = blockIdx.x; item < total_items; item += gridDim.x) {
    const PrefillItem it = ResolvePrefillItem(p, item_prefix, item, Cfg::kRows);
    const AttnRequest& r = it.r;
    const int n_rows = it.n_rows, pos_base = it.pos_base, head = it.head;
    const int wg_row0 = it.row0 + 64 * wg;     // this warpgroup's first row
    const int wrow0 = wg_row0 + 16 * warp;     // this warp's first row

    // ---- Q rows into this warpgroup's swizzled buffer: thread 2 r + h
    // stages half h of row r (warp w stages its own rows 16 w ..); bf16
    // rows scaled by 2^kq.
    int kq = 0;
    {
      const int rq = wtid >> 1, half = lane & 1;
      const int row = wg_row0 + rq;
      const int qi = row / p.group, gi = row - qi * p.group;
      QHalfRow<D, kBf16> q;
      q.Init(row < n_rows ? QRowPtr(p, r.q_begin + qi, head * p.group + gi) + half * (D / 2)
                          : nullptr);
      kq = q.scale.kq;
      q.ForEachGroup([&](int i, const uint16_t(&h)[8]) {
        const uint4 v = PackHalf8(h, [](int j) { return kFp8K ? j : PermPos8(j); });
        StShared16(q_sm + Sw128Offset(64, rq, half * (D / 16) + i), v.x, v.y, v.z, v.w);
      });
    }
    FenceProxyAsyncShared();
    NamedBarrierSync(1 + wg, 128);

    // ---- This thread's rows g and g + 8: logit factors and key bounds.
    float lf[2];
    int row_lo[2], row_hi[2];
    int lo_max = -(1 << 30), hi_min = 1 << 30;  // over this thread's rows
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int k = __shfl_sync(0xffffffffu, kq, 2 * (g + 8 * i));
      lf[i] = QLogitFactor<kSoftCap, kFp8K>(p, gk, k);
      const int row = wrow0 + g + 8 * i;
      const int pos = pos_base + row / p.group;
      row_lo[i] = -(1 << 30);
      row_hi[i] = 1 << 30;
      if (row < n_rows && pos >= 0) {
        row_hi[i] = pos;
        if (p.window_left >= 0) row_lo[i] = pos - p.window_left;
      }
      lo_max = max(lo_max, row_lo[i]);
      hi_min = min(hi_min, row_hi[i]);
    }
    // The warpgroup's key bounds (uniform): its stored rows are
    // [first, last] (positions grow with the row).
    const int wg_last = min(wg_row0 + 63, n_rows - 1);
    int wg_first = wg_row0;
    if (pos_base < 0) wg_first = max(wg_first, -pos_base * p.group);
    const bool wg_any = wg_first <= wg_last;
    const int wg_hi = pos_base + wg_last / p.group;
    const int wg_lo = p.window_left >= 0 ? pos_base + wg_first / p.group - p.window_left : INT_MIN;

    float o[kNT][4];
#pragma unroll
    for (int n = 0; n < kNT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

    const int n_tiles = it.t_begin < it.t_end ? (it.t_end - it.t_begin + kBN - 1) / kBN : 0;
    // The warpgroup's tiles [j_lo, j_hi]: those holding a key of one of its
    // rows (a run, since both bounds grow with the row). The others only
    // pass through the ring.
    int j_lo = 0, j_hi = -1;
    if (wg_any && wg_hi >= it.t_begin) {
      j_hi = min(n_tiles - 1, (wg_hi - it.t_begin) / kBN);
      j_lo = wg_lo > it.t_begin ? (wg_lo - it.t_begin) / kBN : 0;
    }
    const auto pass_tile = [&]() {
      const int stage = static_cast<int>(kcount % kStages);
      MbarWait(full_bar + 8 * stage, (kcount / kStages) & 1u);
      MbarArrive(empty_bar + 8 * stage);
      ++kcount;
    };
    // S = Q K^T of the tile in `stage`, issued (one wgmma group).
    const auto issue_s = [&](float (&s)[kSN][4], int stage) {
      const uint64_t kd = k_desc + ((stage * Cfg::kTileBytes) >> 4);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t q_off = (kk >> 2) * (64 * 128) + (kk & 3) * 32;
        const uint32_t k_off = (kk >> 2) * (kBN * 128) + (kk & 3) * 32;
        WgmmaSS64(s, q_desc + (q_off >> 4), kd + (k_off >> 4), kk > 0 ? 1 : 0);
      }
      WgmmaCommit();
    };
    // O += P V of the tile in `stage`, issued (one wgmma group).
    const auto issue_pv = [&](const uint32_t (&pa)[kBN / 16][4], int stage) {
      const uint64_t vd = v_desc + ((stage * Cfg::kTileBytes) >> 4);
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        if constexpr (D == 128) {
          WgmmaRS128(o, pa[kk], vd + ((kk * 16 * 128) >> 4));
        } else {
          WgmmaRS64(o, pa[kk], vd + ((kk * 16 * 128) >> 4));
        }
      }
      WgmmaCommit();
    };
    // Scale (soft cap), mask and online softmax of tile j's logits (in
    // `stage`): s becomes P, alpha the factor O must be rescaled by.
    const auto softmax = [&](float (&s)[kSN][4], int j, int stage, float (&alpha)[2]) {
      const int t0 = it.t_begin + j * kBN;
      const uint64_t bad = *reinterpret_cast<const uint64_t*>(tile_bad + stage * 8);
      const bool full = bad == 0 && t0 >= lo_max && t0 + kBN - 1 <= hi_min;
      const uint8_t* ok_buf = tok_ok + stage * kBN;
#pragma unroll
      for (int n = 0; n < kSN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[n][e] * lf[e >> 1];
          if constexpr (kSoftCap) x = tanhf(x) * p.soft_cap * kLog2e;
          s[n][e] = x;
        }
      }
      if (!full) {
#pragma unroll
        for (int n = 0; n < kSN; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tt = 8 * n + 2 * c + (e & 1);
            const int t = t0 + tt;
            const bool ok = t < it.t_end && ok_buf[tt] != 0 && t >= row_lo[e >> 1] &&
                            t <= row_hi[e >> 1];
            if (!ok) s[n][e] = -INFINITY;
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < kSN; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * i], s[n][2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float m_use;
        alpha[i] = OnlineMaxStep(&m_run[i], mx, &m_use);
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < kSN; ++n) {
          s[n][2 * i] = Ex2(s[n][2 * i] - m_use);
          s[n][2 * i + 1] = Ex2(s[n][2 * i + 1] - m_use);
          sum += s[n][2 * i] + s[n][2 * i + 1];
        }
        l_run[i] = l_run[i] * alpha[i] + sum;
      }
    };
    const auto rescale = [&](const float (&alpha)[2]) {
      if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
        for (int n = 0; n < kNT; ++n) {
          o[n][0] *= alpha[0];
          o[n][1] *= alpha[0];
          o[n][2] *= alpha[1];
          o[n][3] *= alpha[1];
        }
      }
    };
    const auto pack = [&](const float (&s)[kSN][4], uint32_t (&pa)[kBN / 16][4]) {
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        pa[kk][0] = PackHalf2(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = PackHalf2(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = PackHalf2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = PackHalf2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      }
    };

    if (j_lo > j_hi) j_lo = n_tiles;  // nothing of ours: every tile passes
    for (int j = 0; j < j_lo; ++j) pass_tile();
    if (j_lo <= j_hi) {
      // Software pipeline over the warpgroup's tiles: S of tile j is issued
      // before P V of tile j - 1, so the softmax of tile j runs while the
      // tensor cores multiply P V of tile j - 1; tile j - 1's buffer is
      // released once that product has completed.
      float s[kSN][4];
      uint32_t pa[kBN / 16][4];
      float alpha[2];
      int prev = static_cast<int>(kcount % kStages);
      MbarWait(full_bar + 8 * prev, (kcount / kStages) & 1u);
      ++kcount;
      WgmmaFence();
      issue_s(s, prev);
      WgmmaWait<0>();
      RegFence(s);
      softmax(s, j_lo, prev, alpha);
      pack(s, pa);
      for (int j = j_lo + 1; j <= j_hi; ++j) {
        const int stage = static_cast<int>(kcount % kStages);
        MbarWait(full_bar + 8 * stage, (kcount / kStages) & 1u);
        ++kcount;
        RegFence(o);
        WgmmaFence();
        issue_s(s, stage);
        issue_pv(pa, prev);
        WgmmaWait<1>();  // S of tile j
        RegFence(s);
        softmax(s, j, stage, alpha);
        WgmmaWait<0>();  // P V of tile j - 1
        RegFence(o);
        MbarArrive(empty_bar + 8 * prev);
        rescale(alpha);
        pack(s, pa);
        prev = stage;
      }
      RegFence(o);
      WgmmaFence();
      issue_pv(pa, prev);
      WgmmaWait<0>();
      RegFence(o);
      MbarArrive(empty_bar + 8 * prev);
    }
    for (int j = j_hi + 1 > j_lo ? j_hi + 1 : j_lo; j < n_tiles; ++j) pass_tile();

    // Every wgmma of the warpgroup has completed (each warp waited for its
    // last group); the barrier keeps the staging below independent of how
    // the hardware splits a wgmma's reads of Q between the warps.
    NamedBarrierSync(1 + wg, 128);
    // ---- Finish the rows: normalize (sinks, LSE), stage the output rows in
    // natural dim order in the warp's own rows of the Q buffer (swizzled by
    // 16-byte pieces; every wgmma reading Q has completed), then 16-byte
    // stores.
    // (rl: the row within the warpgroup)
    const auto piece = [&](int rl, int n) { return qreg + Sw128Offset(64, rl, n); };
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int rl = 16 * warp + g + 8 * i;
      FinishPrefillRow<D, kBf16>(p, it, wg_row0 + rl, rl, m_run[i], l_run[i], o, i, c, gv, piece);
    }
    __syncwarp();
    StorePrefillRows<D, 16>(p, it, wg_row0, 16 * warp, lane, piece);
    __syncwarp();  // the warp's rows are Q rows again for the next item
  }
#else
  (void)p;
  __trap();  // never launched: the host chooses this family only for sm_90a code
#endif
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_PREFILL_SM90_CUH_
