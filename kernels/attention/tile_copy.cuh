// Internal: the per-warp tile copy of decode attention (device code),
// shared by both kernel families (rows_in_m.cuh, tokens_in_m.cuh).
//
// A warp copies its 16-token tiles of K and V (codes and block scales) into
// a ring of kStages shared-memory stages with cp.async, one tile per Issue():
// lane 2t + h copies half h of token t (one page-table entry per tile when
// AttnLaunch::fast_copy holds and the warp's range starts 16-aligned, else
// one lookup per lane and tile; FP8 keys on the fast path copy token-major,
// whole K and V rows per instruction). On the fast path the table entries
// are read 32 at a time (one per lane) and 32 columns ahead of their use,
// so that a tile's copy never waits on a table read (it did: about 7% of
// the NVFP4 kernel's stall samples and the largest share of the K8V4
// kernel's). Each stage also holds the ballot of the lanes whose token was
// valid (bit 2t: token t of the tile).
//
// Stage layout (AttnStageLayout, stage_layout.cuh): K codes [16][kKRowStride]
// token-major; V codes [16][D/2] in VSlot order (tokens 2c, 2c+1, 2c+8,
// 2c+9 of a quad are adjacent rows); K scales [16][D/16]; V scales [16][D/16]
// in VSlot order; the 32-bit valid mask.
#ifndef FP4KV_KERNELS_ATTENTION_TILE_COPY_CUH_
#define FP4KV_KERNELS_ATTENTION_TILE_COPY_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "fp4kv/device/page_reader.cuh"
#include "kernels/attention/ptx.cuh"
#include "kernels/attention/schedule.cuh"
#include "src/attention_params.h"

namespace fp4kv {
namespace kernels {

// Shared-memory row of token t of a tile in the V regions.
__device__ __forceinline__ int VSlot(int t) { return (t & 1) * 4 + ((t >> 1) & 3) + (t >> 3) * 8; }

// Copy sources of one item for the lanes of one half (fast copy path), kept
// in shared memory and read back every tile: cheaper than the registers to
// keep them or the instructions to recompute them.
struct AttnCopyBase {
  const uint8_t* k;          // K codes at (page 0, entry 0, the item's head) + the half's bytes
  const uint8_t* v;          // V codes, likewise
  const uint8_t* s;          // block scales: K for half 0, V for half 1
  uint32_t s_page, s_entry;  // that scale pool's strides (bytes)
};

// Reloads an AttnCopyBase at a shared address on every call (volatile: the
// compiler may neither keep it in registers nor hoist it out of a loop).
__device__ __forceinline__ AttnCopyBase LoadCopyBase(uint32_t addr) {
  unsigned long long k, v, s;
  uint32_t sp, se;
  asm volatile("ld.shared.v2.u64 {%0, %1}, [%2];\n" : "=l"(k), "=l"(v) : "r"(addr));
  asm volatile("ld.shared.u64 %0, [%3 + 16];\n ld.shared.v2.u32 {%1, %2}, [%3 + 24];\n"
               : "=l"(s), "=r"(sp), "=r"(se)
               : "r"(addr));
  AttnCopyBase b;
  b.k = reinterpret_cast<const uint8_t*>(k);
  b.v = reinterpret_cast<const uint8_t*>(v);
  b.s = reinterpret_cast<const uint8_t*>(s);
  b.s_page = sp;
  b.s_entry = se;
  return b;
}

// The copy state of one lane for one warp's range [w_t0, w_t1) of an item.
// Cfg: a layout with AttnStageLayout's stages (AttnConfig, TokensInMConfig).
template <int D, bool kFp8K, class Cfg>
struct AttnTileCopier {
  // Few registers live across the caller's loop: everything else (lane
  // roles, source pointers and strides) is recomputed per tile from these,
  // the launch parameters and threadIdx (cheap next to the copy, and the
  // fast path reloads its bases from shared memory anyway).
  uint8_t* stages;
  int pj, pe;  // page-table column and entry of token tau of the next tile
  int w_t1;
  int b, head;  // the item's request and KV head
  bool fast;
  uint32_t copy_base_addr;
  // Fast path: the pages of table columns [col0, col0 + 32) (ent) and
  // [col0 + 32, col0 + 64) (ent_next), column col0 + lane in this lane; -1
  // for a column past the range or an entry outside [0, num_pages).
  int col0;
  int ent, ent_next;

  // Lane roles: lane 2 tau + hf copies half hf of token tau; the scale row
  // it copies is K's for half 0 and V's for half 1 (FP8 keys have no K
  // scales: half 0 copies none).
  __device__ __forceinline__ static int Lane() { return threadIdx.x & 31; }
  __device__ __forceinline__ static int Tau() { return Lane() >> 1; }
  __device__ __forceinline__ static int Half() { return Lane() & 1; }
  __device__ __forceinline__ static bool KHalf() { return Half() == 0 && !kFp8K; }
  __device__ __forceinline__ static bool CopiesScales() { return !kFp8K || Half() == 1; }

  // This lane's sources at (page 0, entry 0) of the item's head.
  struct Sources {
    const uint8_t* kd;
    const uint8_t* vd;
    const uint8_t* sd;
    int64_t s_page, s_entry;
  };
  __device__ __forceinline__ static Sources LaneSources(const internal::AttentionParams& p,
                                                        int head) {
    const int hf = Half();
    const bool k_half = KHalf();
    Sources s;
    s.kd = p.k.data + head * p.k.data_head + hf * (Cfg::kKRowBytes / 2);
    s.vd = p.v.data + head * p.v.data_head + hf * (D / 4);
    s.sd = (k_half ? p.k.scales : p.v.scales) + head * (k_half ? p.k.scale_head : p.v.scale_head);
    s.s_page = k_half ? p.k.scale_page : p.v.scale_page;
    s.s_entry = k_half ? p.k.scale_entry : p.v.scale_entry;
    return s;
  }

  // Page of table column col + lane of the item's request, as Init and
  // IssueFast keep them (-1: past the warp's range or out of bounds).
  __device__ __forceinline__ int LoadEntries(const internal::AttentionParams& p, int col) const {
    const int c = col + Lane();
    if (c * p.page_size >= w_t1) return -1;
    const int64_t pg = internal::TableEntry(p.block_tables, p.tables_i64,
                                            static_cast<int64_t>(b) * p.table_row_stride + c);
    return pg >= 0 && pg < p.num_pages ? static_cast<int>(pg) : -1;
  }

  // Every thread of the CTA calls Init for the same item (it synchronizes the
  // CTA: threads 0 and 1 publish the item's copy bases in `copy_base`).
  __device__ __forceinline__ void Init(const AttnLaunch& a, const AttnItem& it,
                                       uint8_t* warp_stages, int w_t0, int w_t1_,
                                       AttnCopyBase* copy_base) {
    const internal::AttentionParams& p = a.p;
    stages = warp_stages;
    w_t1 = w_t1_;
    b = it.b;
    head = it.head;
    pj = (w_t0 + Tau()) / p.page_size;
    pe = (w_t0 + Tau()) - pj * p.page_size;
    // Fast path (a.fast_copy, tiles aligned to 16): one table entry per tile
    // (all lanes' tokens lie in page pj), 32-bit page index and entry offsets.
    fast = a.fast_copy && (w_t0 % kAttnTile) == 0;
    if (fast) {  // (pj is the same in every lane: the tile lies in one page)
      col0 = pj;
      ent = LoadEntries(p, col0);
      ent_next = LoadEntries(p, col0 + 32);
    }
    if (threadIdx.x < 2) {
      const Sources s = LaneSources(p, head);
      copy_base[threadIdx.x] = AttnCopyBase{s.kd, s.vd, s.sd, static_cast<uint32_t>(s.s_page),
                                            static_cast<uint32_t>(s.s_entry)};
    }
    __syncthreads();
    copy_base_addr = SmemAddr(&copy_base[Half()]);
  }

  // Copies the tile starting at token tile_start into `stage` (one
  // cp.async group is committed by the caller).
  __device__ __forceinline__ void Issue(const AttnLaunch& a, int stage, int tile_start) {
    if (fast) {
      IssueFast(a, stage, tile_start);
    } else {
      IssueAny(a, stage, tile_start);
    }
  }

  __device__ __forceinline__ void IssueFast(const AttnLaunch& a, int stage, int tile_start) {
    const internal::AttentionParams& p = a.p;
    const int lane = Lane(), tau = Tau(), hf = Half();
    const bool k_half = KHalf(), copies_scales = CopiesScales();
    // 32-bit page strides (a.fast_copy guarantees that they fit): one wide
    // multiply-add per pool and tile.
    const uint32_t k_entry = static_cast<uint32_t>(p.k.data_entry);
    const uint32_t v_entry = static_cast<uint32_t>(p.v.data_entry);
    const uint32_t k_page32 = static_cast<uint32_t>(p.k.data_page);
    const uint32_t v_page32 = static_cast<uint32_t>(p.v.data_page);
    uint8_t* st = stages + stage * Cfg::kStageBytes;
    const AttnCopyBase cb = LoadCopyBase(copy_base_addr);
    if (pj >= col0 + 32) {  // warp-uniform: the next 32 columns, and read the 32 after
      col0 += 32;
      ent = ent_next;
      ent_next = LoadEntries(p, col0 + 32);
    }
    const int pg = __shfl_sync(0xffffffffu, ent, pj - col0);
    const bool valid = tile_start + tau < w_t1 && pg >= 0;
    const uint32_t page = valid ? static_cast<uint32_t>(pg) : 0u;
    const uint32_t e = static_cast<uint32_t>(pe);
    const uint8_t* ksrc = cb.k + (static_cast<uint64_t>(page) * k_page32 + e * k_entry);
    const uint8_t* vsrc = cb.v + (static_cast<uint64_t>(page) * v_page32 + e * v_entry);
    const uint8_t* ssrc = cb.s + (static_cast<uint64_t>(page) * cb.s_page + e * cb.s_entry);
    const uint32_t kdst =
        SmemAddr(st + Cfg::kKcOff + tau * Cfg::kKRowStride + hf * (Cfg::kKRowBytes / 2));
    const uint32_t vdst = SmemAddr(st + Cfg::kVcOff + VSlot(tau) * Cfg::kRowBytes + hf * (D / 4));
    if constexpr (kFp8K) {
      // Token-major: kKP lanes copy one whole K row (kVP lanes one V row)
      // per instruction, so that each instruction covers whole sectors and
      // lines. All tokens of the tile lie in page pg (fast path).
      constexpr int kKP = Cfg::kKRowBytes / 16;
      constexpr int kVP = D / 32;
      const bool page_ok = pg >= 0;
      const uint32_t pgk = page_ok ? static_cast<uint32_t>(pg) : 0u;
      const uint32_t e0 = e - static_cast<uint32_t>(tau);
      const uint8_t* kb = cb.k - hf * (Cfg::kKRowBytes / 2) +
                          static_cast<uint64_t>(pgk) * k_page32 + (lane % kKP) * 16;
      const uint8_t* vb =
          cb.v - hf * (D / 4) + static_cast<uint64_t>(pgk) * v_page32 + (lane % kVP) * 16;
#pragma unroll
      for (int i = 0; i < kKP / 2; ++i) {
        const int t = i * (32 / kKP) + lane / kKP;
        const bool ok = page_ok && tile_start + t < w_t1;
        CpAsync<16>(
            SmemAddr(st + Cfg::kKcOff + t * Cfg::kKRowStride + Cfg::KChunk(t, lane % kKP) * 16),
            kb + (e0 + t) * k_entry, ok);
      }
#pragma unroll
      for (int i = 0; i < kVP / 2; ++i) {
        const int t = i * (32 / kVP) + lane / kVP;
        const bool ok = page_ok && tile_start + t < w_t1;
        CpAsync<16>(SmemAddr(st + Cfg::kVcOff + VSlot(t) * Cfg::kRowBytes + (lane % kVP) * 16),
                    vb + (e0 + t) * v_entry, ok);
      }
      (void)ksrc;
      (void)vsrc;
      (void)kdst;
      (void)vdst;
    } else {
#pragma unroll
      for (int i = 0; i < D / 64; ++i) {
        CpAsync<16>(kdst + 16 * i, ksrc + 16 * i, valid);
        CpAsync<16>(vdst + 16 * i, vsrc + 16 * i, valid);
      }
    }
    uint8_t* sdst = st + (k_half ? Cfg::kKsOff + tau * Cfg::kScaleBytes
                                 : Cfg::kVsOff + VSlot(tau) * Cfg::kScaleBytes);
    if (copies_scales) CpAsync<Cfg::kScaleBytes>(SmemAddr(sdst), ssrc, valid);
    const uint32_t ballot = __ballot_sync(0xffffffffu, valid);
    if (lane == 0) *reinterpret_cast<uint32_t*>(st + Cfg::kMaskOff) = ballot;
    pe += kAttnTile;
    if (pe >= p.page_size) {
      pe -= p.page_size;
      ++pj;
    }
  }

  __device__ __forceinline__ void IssueAny(const AttnLaunch& a, int stage, int tile_start) {
    const internal::AttentionParams& p = a.p;
    const int lane = Lane(), tau = Tau(), hf = Half();
    const bool k_half = KHalf(), copies_scales = CopiesScales();
    const int64_t table_row = static_cast<int64_t>(b) * p.table_row_stride;
    const Sources src = LaneSources(p, head);
    const uint8_t* kd = src.kd;
    const uint8_t* vd = src.vd;
    const uint8_t* sd = src.sd;
    const int64_t s_page = src.s_page, s_entry = src.s_entry;
    uint8_t* st = stages + stage * Cfg::kStageBytes;
    const int t = tile_start + tau;
    bool valid = t < w_t1;
    int64_t page = 0;
    if (valid) {
      page = internal::TableEntry(p.block_tables, p.tables_i64, table_row + pj);
      valid = page >= 0 && page < p.num_pages;
    }
    if (!valid) page = 0;
    const int e = valid ? pe : 0;
    const uint8_t* ksrc = kd + page * p.k.data_page + e * p.k.data_entry;
    const uint8_t* vsrc = vd + page * p.v.data_page + e * p.v.data_entry;
    const uint32_t kdst =
        SmemAddr(st + Cfg::kKcOff + tau * Cfg::kKRowStride + hf * (Cfg::kKRowBytes / 2));
    const uint32_t vdst = SmemAddr(st + Cfg::kVcOff + VSlot(tau) * Cfg::kRowBytes + hf * (D / 4));
    const bool a16 =
        ((reinterpret_cast<uintptr_t>(ksrc) | reinterpret_cast<uintptr_t>(vsrc)) & 15u) == 0;
    // FP8 key rows: 16-byte chunk k of token tau at Cfg::KChunk(tau, k).
    const uint32_t krow = SmemAddr(st + Cfg::kKcOff + tau * Cfg::kKRowStride);
    const int kc0 = hf * (Cfg::kKRowBytes / 32);
    if (a16 && kFp8K) {
#pragma unroll
      for (int i = 0; i < Cfg::kKRowBytes / 32; ++i) {
        CpAsync<16>(krow + Cfg::KChunk(tau, kc0 + i) * 16, ksrc + 16 * i, valid);
      }
#pragma unroll
      for (int i = 0; i < D / 64; ++i) CpAsync<16>(vdst + 16 * i, vsrc + 16 * i, valid);
    } else if (kFp8K) {
#pragma unroll
      for (int i = 0; i < Cfg::kKRowBytes / 16; ++i) {
        CpAsync<8>(krow + Cfg::KChunk(tau, kc0 + i / 2) * 16 + (i % 2) * 8, ksrc + 8 * i, valid);
      }
#pragma unroll
      for (int i = 0; i < D / 32; ++i) CpAsync<8>(vdst + 8 * i, vsrc + 8 * i, valid);
    } else if (a16) {
#pragma unroll
      for (int i = 0; i < D / 64; ++i) {
        CpAsync<16>(kdst + 16 * i, ksrc + 16 * i, valid);
        CpAsync<16>(vdst + 16 * i, vsrc + 16 * i, valid);
      }
    } else {
#pragma unroll
      for (int i = 0; i < D / 32; ++i) {
        CpAsync<8>(kdst + 8 * i, ksrc + 8 * i, valid);
        CpAsync<8>(vdst + 8 * i, vsrc + 8 * i, valid);
      }
    }
    const uint8_t* ssrc = sd + page * s_page + e * s_entry;
    uint8_t* sdst = st + (k_half ? Cfg::kKsOff + tau * Cfg::kScaleBytes
                                 : Cfg::kVsOff + VSlot(tau) * Cfg::kScaleBytes);
    if (!copies_scales) {
      // FP8 keys: half 0 has no scales to copy.
    } else if ((reinterpret_cast<uintptr_t>(ssrc) & (Cfg::kScaleBytes - 1)) == 0) {
      CpAsync<Cfg::kScaleBytes>(SmemAddr(sdst), ssrc, valid);
    } else {
#pragma unroll
      for (int i = 0; i < Cfg::kScaleBytes; ++i) sdst[i] = valid ? __ldg(ssrc + i) : 0;
    }
    const uint32_t ballot = __ballot_sync(0xffffffffu, valid);
    if (lane == 0) *reinterpret_cast<uint32_t*>(st + Cfg::kMaskOff) = ballot;
    pe += a.page_r16;
    pj += a.page_q16;
    if (pe >= p.page_size) {
      pe -= p.page_size;
      ++pj;
    }
  }
};

// ---------------------------------------------------------------------------
// What lane (g, c) of a warp reads back from a stage (both kernel families).
// ---------------------------------------------------------------------------
// NVFP4 K: the code words of tokens g (t = 0) and g + 8 (t = 1), bytes
// [c D/8, (c+1) D/8) of their rows, and their block-scale multipliers
// (ScalePairMultiplier, two blocks a conversion; D = 64: one block, twice).
// Load reads this file's stage layout; LoadWith any layout, through
// code(t, x) (byte x of the lane's bytes of token half t; kWide: 16-byte
// loads, each within one 16-byte chunk) and scales(t) (the lane's D / 64
// scale bytes of token half t).
template <int D, class Cfg>
struct KTileWords {
  static constexpr int kWords = D / 32;
  static constexpr int kScalePairs = D >= 128 ? D / 128 : 1;
  uint32_t w[2][kWords];
  uint32_t mul[2][kScalePairs];

  template <bool kWide, class Code, class Scales>
  __device__ __forceinline__ void LoadWith(Code code, Scales scales) {
    uint32_t sb[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      if constexpr (kWide && kWords % 4 == 0) {
#pragma unroll
        for (int k = 0; k < kWords; k += 4) {
          const uint4 v = *reinterpret_cast<const uint4*>(code(t, 4 * k));
          w[t][k] = v.x;
          w[t][k + 1] = v.y;
          w[t][k + 2] = v.z;
          w[t][k + 3] = v.w;
        }
      } else {
#pragma unroll
        for (int k = 0; k < kWords; k += 2) {
          const uint2 v = *reinterpret_cast<const uint2*>(code(t, 4 * k));
          w[t][k] = v.x;
          w[t][k + 1] = v.y;
        }
      }
      const uint8_t* srow = scales(t);
      if constexpr (D == 64) {
        sb[t] = srow[0];
      } else if constexpr (D == 128) {
        sb[t] = *reinterpret_cast<const uint16_t*>(srow);
      } else {
        sb[t] = *reinterpret_cast<const uint32_t*>(srow);
      }
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int q = 0; q < kScalePairs; ++q) {
        const uint32_t two = D >= 128 ? (sb[t] >> (16 * q)) & 0xffffu : sb[t] * 0x0101u;
        mul[t][q] = device::ScalePairMultiplier(two);
      }
    }
  }

  __device__ __forceinline__ void Load(const uint8_t* st, int g, int c) {
    LoadWith<false>(
        [&](int t, int x) {
          return st + Cfg::kKcOff + (g + 8 * t) * Cfg::kKRowStride + c * (D / 8) + x;
        },
        [&](int t) { return st + Cfg::kKsOff + (g + 8 * t) * Cfg::kScaleBytes + c * (D / 64); });
  }

  // The multiplier of word k of token half t (both halves of the f16x2 hold
  // its block's scale).
  __device__ __forceinline__ uint32_t WordMul(int t, int k) const {
    const uint32_t pair = mul[t][k / 4 < kScalePairs ? k / 4 : 0];
    return (k / 2) % 2 == 0 ? DupLowHalf(pair) : DupHighHalf(pair);
  }
};

// V: segment g (dims [g D/8, (g+1) D/8)) of tokens 2c, 2c+1, 2c+8, 2c+9
// (w[0..3]) and the scale-pair multipliers of tokens {2c, 2c+1} (mul[0])
// and {2c+8, 2c+9} (mul[1]), one per 16-dim block of the segment. Load
// reads this file's stage layout (VSlot order); LoadWith any layout, through
// code(k, x) (byte x of the segment of the token w[k] is to hold) and
// scales(i) (the scale row of token 2c + (i & 1) + 8 (i >> 1)).
template <int D, class Cfg>
struct VTileWords {
  static constexpr int kWords = D / 64;
  static constexpr int kBlocks = kWords > 1 ? kWords / 2 : 1;
  uint32_t w[4][kWords];
  uint32_t mul[2][kBlocks];

  template <class Code, class Scales>
  __device__ __forceinline__ void LoadWith(Code code, Scales scales, int g) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (kWords == 1) {
        w[k][0] = *reinterpret_cast<const uint32_t*>(code(k, 0));
      } else {
#pragma unroll
        for (int j = 0; j < kWords; j += 2) {
          const uint2 v = *reinterpret_cast<const uint2*>(code(k, 4 * j));
          w[k][j] = v.x;
          w[k][j + 1] = v.y;
        }
      }
    }
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
      const uint8_t* s0 = scales(2 * pr);
      const uint8_t* s1 = scales(2 * pr + 1);
#pragma unroll
      for (int q = 0; q < kBlocks; ++q) {
        const int blk = (g * (D / 8)) / 16 + q;
        mul[pr][q] = device::ScalePairMultiplier(static_cast<uint32_t>(s0[blk]) |
                                                 (static_cast<uint32_t>(s1[blk]) << 8));
      }
    }
  }

  __device__ __forceinline__ void Load(const uint8_t* st, int g, int c) {
    LoadWith(
        [&](int k, int x) {
          const int tt = 2 * c + (k & 1) + 8 * (k >> 1);
          return st + Cfg::kVcOff + VSlot(tt) * Cfg::kRowBytes + g * (D / 16) + x;
        },
        [&](int i) {
          return st + Cfg::kVsOff + VSlot(2 * c + (i & 1) + 8 * (i >> 1)) * Cfg::kScaleBytes;
        },
        g);
  }

  // The multiplier of word j (both token pairs use block j / 2).
  __device__ __forceinline__ uint32_t WordMul(int pr, int j) const {
    return mul[pr][kWords > 1 ? j / 2 : 0];
  }
};

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_TILE_COPY_CUH_
