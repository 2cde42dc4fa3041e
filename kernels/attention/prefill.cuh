// Internal: attention of requests with many new tokens (prefill chunks,
// extends over a cached prefix, whole prompts) reading NVFP4 (or FP8-key /
// NVFP4-value) pages. Device code plus its launch, instantiated per head dim
// by kernels/attention_prefill_d<D>.cu and dispatched by kernels/attention.cu
// beside the decode kernels of the same Run().
//
// Work: a persistent grid (num_sms * resident CTAs) of 4-warp CTAs derives
// the same schedule from seq_lens / q_indptr as the decode kernels do
// (GetAttnRequest, restricted by kernel_q_min / kernel_q_max to the long
// requests). An item is (request, KV head, 64-row query tile), rows being
// (query i, head in the group) pairs, row = i * group + g (the GQA heads of
// a query share the KV head's tiles). CTA x takes items x, x + grid, ...;
// within a request the tiles nearest the end (most keys under the causal
// mask) come first.
//
// An item walks its key range [t_begin, t_end) -- the causal bound of its
// last query, the window of its first -- in tiles of kBN tokens. Each tile
// is read once per CTA: all 128 threads load its codes and scales from the
// pages into registers (the next tile's loads are in flight while the
// current tile is multiplied), decode them to f16 in shared memory in the
// layout ldmatrix reads (rows padded by 16 bytes: conflict-free), and every
// warp's 16 query rows reuse it: S = Q K^T and O += P V on mma.sync
// m16n8k16 (f16 in, fp32 accumulate), online softmax in fp32 between them.
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
#include "kernels/attention/merge.cuh"
#include "kernels/attention/ptx.cuh"
#include "kernels/attention/schedule.cuh"
#include "src/attention_params.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace kernels {

template <int D>
struct PrefillConfig {
  static constexpr int kRows = 16 * kAttnWarps;         // query rows per item
  static constexpr int kBN = D == 256 ? 32 : 64;        // tokens per K/V tile
  static constexpr int kStride = D + 8;                 // halves per shared row
  static constexpr int kChunks = D / 32;                // 32-value chunks per token row
  static constexpr int kTokPerPass = kAttnThreads / kChunks;
  static constexpr int kPasses = kBN / kTokPerPass;     // chunks per thread per tile
  static constexpr int kQOff = 0;                       // [kRows][kStride] f16
  static constexpr int kKOff = kQOff + kRows * kStride * 2;
  static constexpr int kVOff = kKOff + kBN * kStride * 2;
  static constexpr int kOkOff = kVOff + kBN * kStride * 2;  // [kBN] token valid bytes
  static constexpr int kBytes = kOkOff + kBN;
  static constexpr int kCtasPerSm = D == 256 ? 2 : (D == 128 ? 3 : 4);  // launch bound
  static_assert(kBN % kTokPerPass == 0, "whole passes per tile");
  static_assert(kBN % 16 == 0, "whole k-steps of P V");
  static_assert(kBytes % 16 == 0, "16-byte aligned schedule arrays");
};

// Position in shared memory of natural value x (0..7) of an 8-value group
// in DecodeWordHalf2's order {0,2,4,6,1,3,5,7}, and the inverse.
__device__ __forceinline__ int PermPos8(int x) { return (x & 1) * 4 + (x >> 1); }
__device__ __forceinline__ int PermVal8(int pos) { return (pos & 3) * 2 + (pos >> 2); }

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t addr, uint32_t r[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void StShared16(uint32_t addr, uint32_t a, uint32_t b, uint32_t c,
                                           uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c),
               "r"(d));
}

// Items of request b: its 64-row tiles times the KV heads (0 when the
// request is not this kernel's or attends nothing).
__device__ __forceinline__ int PrefillItems(const internal::AttentionParams& p,
                                            const AttnRequest& r, int rows) {
  if (r.span <= 0) return 0;
  const int tiles = static_cast<int>((static_cast<int64_t>(p.group) * r.q_len + rows - 1) / rows);
  return tiles * p.num_kv_heads;
}

// The raw codes and scales of one thread's chunks of a K/V tile.
template <int D, bool kFp8K>
struct PrefillRaw {
  using Cfg = PrefillConfig<D>;
  static constexpr int kKWords = kFp8K ? 8 : 4;  // 32 values of a key row
  uint32_t k[Cfg::kPasses][kKWords];
  uint32_t v[Cfg::kPasses][4];
  uint32_t ks[Cfg::kPasses], vs[Cfg::kPasses];  // two scale bytes each (low first)
  uint32_t ok;                                   // bit i: chunk of pass i valid
};

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
  const int B = p.batch_size;
  {
    const int per = (B + kAttnThreads - 1) / kAttnThreads;
    const int b0 = tid * per, b1 = b0 + per < B ? b0 + per : B;
    int mine = 0;
    for (int b = b0; b < b1; ++b) {
      const int n = PrefillItems(p, GetAttnRequest(p, b), Cfg::kRows);
      item_prefix[b] = n;
      mine += n;
    }
    int total;
    int base = BlockExclusiveScan(mine, scan_tmp, &total);
    for (int b = b0; b < b1; ++b) {
      const int n = item_prefix[b];
      item_prefix[b] = base;
      base += n;
    }
    if (tid == 0) item_prefix[B] = total;
    __syncthreads();
  }
  const int total_items = item_prefix[B];

  uint16_t* qs = reinterpret_cast<uint16_t*>(smem + Cfg::kQOff);
  const uint32_t q_sm = SmemAddr(smem + Cfg::kQOff);
  const uint32_t k_sm = SmemAddr(smem + Cfg::kKOff);
  const uint32_t v_sm = SmemAddr(smem + Cfg::kVOff);
  uint8_t* tok_ok = smem + Cfg::kOkOff;
  const float gk = p.k_scale.Get();
  const float gv = p.v_scale.Get();

  for (int item = blockIdx.x; item < total_items; item += gridDim.x) {
    // ---- Resolve the item.
    int b;
    {
      int lo = 0, hi = B;
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (item_prefix[mid] <= item) {
          lo = mid;
        } else {
          hi = mid;
        }
      }
      b = lo;
    }
    const AttnRequest r = GetAttnRequest(p, b);
    const int local = item - item_prefix[b];
    const int n_rows = p.group * r.q_len;
    const int tiles = (n_rows + Cfg::kRows - 1) / Cfg::kRows;
    const int head = local % p.num_kv_heads;
    const int mt = tiles - 1 - local / p.num_kv_heads;
    const int row0 = mt * Cfg::kRows;
    const int pos_base = r.len - r.q_len;  // position of query 0
    const int qi_first = row0 / p.group;
    const int qi_last = min(r.q_len - 1, (row0 + Cfg::kRows - 1) / p.group);
    const int t_end = min(r.len, pos_base + qi_last + 1);
    int t_begin = r.lo;
    if (p.window_left >= 0) t_begin = max(t_begin, pos_base + qi_first - p.window_left);
    t_begin = max(t_begin, 0);

    // ---- Q rows of this warp into shared memory (the warp's own 16 rows):
    // lane 2 r + h stages half h of row r; bf16 rows scaled by 2^kq.
    int kq = 0;
    {
      const int rl = lane >> 1, half = lane & 1;
      const int row = row0 + 16 * warp + rl;
      const int qi = row / p.group, gi = row - qi * p.group;
      const bool valid = row < n_rows;
      const uint16_t* src = nullptr;
      if (valid) {
        src = static_cast<const uint16_t*>(p.q) + (r.q_begin + qi) * p.q_row_stride +
              static_cast<int64_t>(head * p.group + gi) * p.q_head_stride + half * (D / 2);
      }
      float mul = 1.0f;
      if constexpr (kBf16) {
        uint32_t amax = 0;
        if (src != nullptr) {
#pragma unroll 4
          for (int i = 0; i < D / 16; ++i) {
            const uint4 v = *reinterpret_cast<const uint4*>(src + 8 * i);
            const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const uint32_t lo = (w[j] << 16) & 0x7fff0000u, hi = w[j] & 0x7fff0000u;
              amax = max(amax, max(lo, hi));
            }
          }
        }
        amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        if (amax != 0 && amax < 0x7f800000u) {
          const int e = static_cast<int>(amax >> 23) - 127;
          kq = 14 - e;
          kq = kq < -126 ? -126 : (kq > 127 ? 127 : kq);
          mul = __uint_as_float(static_cast<uint32_t>(kq + 127) << 23);
        }
      }
      uint16_t* dst = qs + (16 * warp + rl) * Cfg::kStride + half * (D / 2);
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
            h[j] =
                static_cast<uint16_t>(PackHalf2(__uint_as_float(bits << 16) * mul, 0.0f) & 0xffffu);
          } else {
            h[j] = static_cast<uint16_t>(bits);
          }
        }
        uint16_t o8[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) o8[kFp8K ? j : PermPos8(j)] = h[j];
        *reinterpret_cast<uint4*>(dst + 8 * i) = make_uint4(
            o8[0] | (static_cast<uint32_t>(o8[1]) << 16), o8[2] | (static_cast<uint32_t>(o8[3]) << 16),
            o8[4] | (static_cast<uint32_t>(o8[5]) << 16), o8[6] | (static_cast<uint32_t>(o8[7]) << 16));
      }
    }

    // ---- This thread's rows g and g + 8 of the warp: logit factors and
    // the key bounds [lo, hi] of the rows that are written.
    float lf[2];
    int row_lo[2], row_hi[2];
    int warp_lo_max = -(1 << 30), warp_hi_min = 1 << 30;  // over written rows
    int warp_lo_min = 1 << 30, warp_hi_max = -(1 << 30);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int k = __shfl_sync(0xffffffffu, kq, 2 * (g + 8 * i));
      const float tile_scale = kFp8K ? device::Fp8KeyHalfScale() : device::kHalfTileScale;
      const float f =
          p.sm_scale * gk * tile_scale * __uint_as_float(static_cast<uint32_t>(127 - k) << 23);
      lf[i] = kSoftCap ? f / p.soft_cap : f * kLog2e;
      const int row = row0 + 16 * warp + g + 8 * i;
      const int qi = row / p.group;
      const int pos = pos_base + qi;
      const bool stored = row < n_rows && pos >= 0;
      row_lo[i] = -(1 << 30);
      row_hi[i] = 1 << 30;
      if (stored) {
        row_hi[i] = pos;
        if (p.window_left >= 0) row_lo[i] = pos - p.window_left;
        warp_lo_min = min(warp_lo_min, row_lo[i]);
        warp_hi_max = max(warp_hi_max, row_hi[i]);
      }
      warp_lo_max = max(warp_lo_max, row_lo[i]);
      warp_hi_min = min(warp_hi_min, row_hi[i]);
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
    const int64_t table_row = static_cast<int64_t>(b) * p.table_row_stride;
    const uint8_t* kbase = p.k.data + head * p.k.data_head + chunk * (kFp8K ? 32 : 16);
    const uint8_t* vbase = p.v.data + head * p.v.data_head + chunk * 16;
    const uint8_t* ksbase = kFp8K ? nullptr : p.k.scales + head * p.k.scale_head + chunk * 2;
    const uint8_t* vsbase = p.v.scales + head * p.v.scale_head + chunk * 2;
    const auto load_tile = [&](int t0, PrefillRaw<D, kFp8K>& raw) {
      raw.ok = 0;
#pragma unroll
      for (int i = 0; i < Cfg::kPasses; ++i) {
        const int t = t0 + tid / Cfg::kChunks + i * Cfg::kTokPerPass;
        bool valid = t < t_end;
        int64_t pg = -1;
        int pe = 0;
        if (valid) {
          const int pj = t / p.page_size;
          pe = t - pj * p.page_size;
          pg = internal::TableEntry(p.block_tables, p.tables_i64, table_row + pj);
          valid = pg >= 0 && pg < p.num_pages;
        }
#pragma unroll
        for (int w = 0; w < PrefillRaw<D, kFp8K>::kKWords; ++w) raw.k[i][w] = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w) raw.v[i][w] = 0;
        raw.ks[i] = raw.vs[i] = 0;
        if (valid) {
          raw.ok |= 1u << i;
          const uint8_t* kr = kbase + pg * p.k.data_page + pe * p.k.data_entry;
          const uint8_t* vr = vbase + pg * p.v.data_page + pe * p.v.data_entry;
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
            const uint8_t* ksr = ksbase + pg * p.k.scale_page + pe * p.k.scale_entry;
            raw.ks[i] = __ldg(ksr) | (static_cast<uint32_t>(__ldg(ksr + 1)) << 8);
          }
          const uint2 b0 = __ldg(reinterpret_cast<const uint2*>(vr));
          const uint2 b1 = __ldg(reinterpret_cast<const uint2*>(vr + 8));
          raw.v[i][0] = b0.x, raw.v[i][1] = b0.y, raw.v[i][2] = b1.x, raw.v[i][3] = b1.y;
          const uint8_t* vsr = vsbase + pg * p.v.scale_page + pe * p.v.scale_entry;
          raw.vs[i] = __ldg(vsr) | (static_cast<uint32_t>(__ldg(vsr + 1)) << 8);
        }
      }
    };
    // Decodes a thread's chunks into the shared tiles; returns whether all
    // of its tokens were valid.
    const auto store_tile = [&](const PrefillRaw<D, kFp8K>& raw) {
#pragma unroll
      for (int i = 0; i < Cfg::kPasses; ++i) {
        const int tt = tid / Cfg::kChunks + i * Cfg::kTokPerPass;
        const uint32_t kdst = k_sm + (tt * Cfg::kStride + chunk * 32) * 2;
        const uint32_t vdst = v_sm + (tt * Cfg::kStride + chunk * 32) * 2;
        if constexpr (kFp8K) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t h[4];
            device::Fp8KeyWordToHalf2(raw.k[i][2 * j], &h[0], &h[1]);
            device::Fp8KeyWordToHalf2(raw.k[i][2 * j + 1], &h[2], &h[3]);
            StShared16(kdst + 16 * j, h[0], h[1], h[2], h[3]);
          }
        } else {
          const uint32_t m0 = device::ScalePairMultiplier((raw.ks[i] & 0xffu) * 0x0101u);
          const uint32_t m1 = device::ScalePairMultiplier((raw.ks[i] >> 8) * 0x0101u);
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            uint32_t h[4];
            device::DecodeWordHalf2(raw.k[i][w], w < 2 ? m0 : m1, h);
            StShared16(kdst + 16 * w, h[0], h[1], h[2], h[3]);
          }
        }
        const uint32_t m0 = device::ScalePairMultiplier((raw.vs[i] & 0xffu) * 0x0101u);
        const uint32_t m1 = device::ScalePairMultiplier((raw.vs[i] >> 8) * 0x0101u);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          uint32_t h[4];
          device::DecodeWordHalf2(raw.v[i][w], w < 2 ? m0 : m1, h);
          StShared16(vdst + 16 * w, h[0], h[1], h[2], h[3]);
        }
        if (chunk == 0) tok_ok[tt] = static_cast<uint8_t>((raw.ok >> i) & 1u);
      }
      return raw.ok == (1u << Cfg::kPasses) - 1u;
    };

    float o[kNT][4];
#pragma unroll
    for (int n = 0; n < kNT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

    // ldmatrix lane addresses: Q (A, rows of this warp), K (B, tokens x
    // dims), V (B via .trans, tokens x dims).
    const int ld_r = (lane & 7) + ((lane >> 3) & 1) * 8;  // 0..15
    const int ld_c = (lane >> 4) * 8;                     // 0 or 8
    const uint32_t q_lane = q_sm + ((16 * warp + ld_r) * Cfg::kStride + ld_c) * 2;
    const int kt_r = (lane & 7) + (lane >> 4) * 8;  // token within 16
    const int kt_c = ((lane >> 3) & 1) * 8;         // dim within 16
    const uint32_t k_lane = k_sm + (kt_r * Cfg::kStride + kt_c) * 2;
    const uint32_t v_lane = v_sm + (ld_r * Cfg::kStride + ld_c) * 2;

    PrefillRaw<D, kFp8K> raw;
    if (t_begin < t_end) load_tile(t_begin, raw);
    for (int t0 = t_begin; t0 < t_end; t0 += kBN) {
      __syncthreads();  // the previous tile's readers are done (and Q is staged)
      const bool mine_ok = store_tile(raw);
      const bool tile_ok = __syncthreads_and(mine_ok) != 0;
      if (t0 + kBN < t_end) load_tile(t0 + kBN, raw);
      // Rows of this warp with a key in the tile.
      if (warp_hi_max < t0 || warp_lo_min > t0 + kBN - 1) continue;

      // ---- S = Q K^T.
      float s[kSN][4];
#pragma unroll
      for (int n = 0; n < kSN; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t qa[4];
        LdMatrixX4(q_lane + kk * 32, qa);
#pragma unroll
        for (int n2 = 0; n2 < kBN / 16; ++n2) {
          uint32_t kb[4];
          LdMatrixX4(k_lane + (n2 * 16 * Cfg::kStride + kk * 16) * 2, kb);
          Mma16816(s[2 * n2], qa, kb[0], kb[1]);
          Mma16816(s[2 * n2 + 1], qa, kb[2], kb[3]);
        }
      }

      // ---- Scale (soft cap), mask, online softmax (log2 units).
#pragma unroll
      for (int n = 0; n < kSN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[n][e] * lf[e >> 1];
          if constexpr (kSoftCap) x = tanhf(x) * p.soft_cap * kLog2e;
          s[n][e] = x;
        }
      }
      const bool full = tile_ok && t0 >= warp_lo_max && t0 + kBN - 1 <= warp_hi_min;
      if (!full) {
#pragma unroll
        for (int n = 0; n < kSN; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tt = 8 * n + 2 * c + (e & 1);
            const int t = t0 + tt;
            const bool ok = t < t_end && tok_ok[tt] != 0 && t >= row_lo[e >> 1] &&
                            t <= row_hi[e >> 1];
            if (!ok) s[n][e] = -INFINITY;
          }
        }
      }
      float alpha[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < kSN; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * i], s[n][2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = mx - m_run[i] > kAttnRescaleSlack ? fmaxf(m_run[i], mx) : m_run[i];
        const float m_use = m_new == -INFINITY ? 0.0f : m_new - kAttnPOffset;
        alpha[i] = m_new == m_run[i] ? 1.0f : Ex2(m_run[i] - m_new);
        m_run[i] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < kSN; ++n) {
          s[n][2 * i] = Ex2(s[n][2 * i] - m_use);
          s[n][2 * i + 1] = Ex2(s[n][2 * i + 1] - m_use);
          sum += s[n][2 * i] + s[n][2 * i + 1];
        }
        l_run[i] = l_run[i] * alpha[i] + sum;
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

      // ---- O += P V.
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        uint32_t pa[4];
        pa[0] = PackHalf2(s[2 * kk][0], s[2 * kk][1]);
        pa[1] = PackHalf2(s[2 * kk][2], s[2 * kk][3]);
        pa[2] = PackHalf2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[3] = PackHalf2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int n2 = 0; n2 < D / 16; ++n2) {
          uint32_t vb[4];
          LdMatrixX4Trans(v_lane + (kk * 16 * Cfg::kStride + n2 * 16) * 2, vb);
          Mma16816(o[2 * n2], pa, vb[0], vb[1]);
          Mma16816(o[2 * n2 + 1], pa, vb[2], vb[3]);
        }
      }
    }

    // ---- Finish this warp's rows: normalize (sinks, LSE), stage the
    // output rows in natural dim order over the warp's Q rows, then 16-byte
    // stores.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
      l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
    }
    __syncwarp();
    uint16_t* ostage = qs + 16 * warp * Cfg::kStride;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int rl = g + 8 * i;
      const int row = row0 + 16 * warp + rl;
      const int qi = row / p.group, gi = row - qi * p.group;
      const int qo_head = head * p.group + gi;
      const float m = m_run[i] == -INFINITY ? m_run[i] : m_run[i] - kAttnPOffset;
      float inv = 0.0f, lse = -INFINITY;
      if (row < n_rows) FinishRow(m, l_run[i], p.sinks, qo_head, &inv, &lse);
      const float f = inv * gv * device::kHalfTileScale;
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int pos = 2 * c + e;  // within the 8 columns of n-tile n
          ostage[rl * Cfg::kStride + 8 * n + PermVal8(pos)] = PackOut1<kBf16>(o[n][2 * i + e] * f);
        }
      }
      if (c == 0 && p.lse != nullptr && row < n_rows && pos_base + qi >= 0) {
        p.lse[(r.q_begin + qi) * p.lse_row_stride + qo_head] = lse;
      }
    }
    __syncwarp();
    {
      constexpr int kVecs = D / 8;  // 16-byte pieces of a row
      for (int idx = lane; idx < 16 * kVecs; idx += 32) {
        const int rl = idx / kVecs, vi = idx - rl * kVecs;
        const int row = row0 + 16 * warp + rl;
        const int qi = row / p.group, gi = row - qi * p.group;
        if (row < n_rows && pos_base + qi >= 0) {
          uint16_t* dst = static_cast<uint16_t*>(p.out) + (r.q_begin + qi) * p.out_row_stride +
                          static_cast<int64_t>(head * p.group + gi) * p.out_head_stride + 8 * vi;
          *reinterpret_cast<uint4*>(dst) =
              *reinterpret_cast<const uint4*>(ostage + rl * Cfg::kStride + 8 * vi);
        }
      }
    }
    __syncthreads();  // Q / staging rows are rewritten by the next item
  }
}

}  // namespace kernels

namespace internal {

using PrefillKernelFn = void (*)(AttentionParams);

template <int D, bool kBf16, bool kFp8K>
PrefillKernelFn SelectPrefillKernel(bool soft_cap) {
  return soft_cap ? &kernels::PrefillAttentionKernel<D, kBf16, true, kFp8K>
                  : &kernels::PrefillAttentionKernel<D, kBf16, false, kFp8K>;
}

inline size_t PrefillSmemBytes(int bytes, int max_batch) {
  return static_cast<size_t>(bytes) + (static_cast<size_t>(max_batch) + 1) * sizeof(int);
}

// Create()-time setup: raises the kernel's dynamic shared memory limit and
// finds how many of its CTAs an SM holds (the persistent grid per SM).
template <int D, bool kBf16, bool kFp8K>
absl::Status PreparePrefillFor(const DecodeAttention::Options& o, int* ctas_per_sm) {
  const PrefillKernelFn fn = SelectPrefillKernel<D, kBf16, kFp8K>(o.logits_soft_cap > 0.0f);
  const size_t smem = PrefillSmemBytes(kernels::PrefillConfig<D>::kBytes, o.max_batch);
  FP4KV_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int resident = 0;
  FP4KV_CUDA_RETURN_IF_ERROR(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, fn, kernels::kAttnThreads, smem));
  if (resident < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.max_batch: the prefill attention kernel's schedule of ", o.max_batch,
        " requests does not fit an SM's shared memory beside its tiles (",
        kernels::PrefillConfig<D>::kBytes, " bytes)"));
  }
  *ctas_per_sm = resident;
  return absl::OkStatus();
}

template <int D, bool kBf16, bool kFp8K>
absl::Status LaunchPrefillFor(const AttentionParams& p, Stream stream) {
  const PrefillKernelFn fn = SelectPrefillKernel<D, kBf16, kFp8K>(p.soft_cap > 0.0f);
  const size_t smem = PrefillSmemBytes(kernels::PrefillConfig<D>::kBytes, p.max_batch);
  const int grid = p.num_sms * (p.prefill_ctas_per_sm > 0 ? p.prefill_ctas_per_sm : 1);
  fn<<<grid, kernels::kAttnThreads, smem, stream>>>(p);
  return CudaStatus(cudaGetLastError(), "PrefillAttentionKernel launch");
}

template <int D>
absl::Status PrepareAttentionPrefillDim(const DecodeAttention::Options& o, int* ctas_per_sm) {
  const bool bf16 = o.dtype == DType::kBF16;
  if (o.geometry.fp8_keys()) {
    return bf16 ? PreparePrefillFor<D, true, true>(o, ctas_per_sm)
                : PreparePrefillFor<D, false, true>(o, ctas_per_sm);
  }
  return bf16 ? PreparePrefillFor<D, true, false>(o, ctas_per_sm)
              : PreparePrefillFor<D, false, false>(o, ctas_per_sm);
}

template <int D>
absl::Status LaunchAttentionPrefillDim(const AttentionParams& p, Stream stream) {
  if (p.fp8_keys) {
    return p.dtype == DType::kBF16 ? LaunchPrefillFor<D, true, true>(p, stream)
                                   : LaunchPrefillFor<D, false, true>(p, stream);
  }
  return p.dtype == DType::kBF16 ? LaunchPrefillFor<D, true, false>(p, stream)
                                 : LaunchPrefillFor<D, false, false>(p, stream);
}

#define FP4KV_INSTANTIATE_ATTENTION_PREFILL_DIM(D)                                     \
  template absl::Status PrepareAttentionPrefillDim<D>(const DecodeAttention::Options&, \
                                                      int*);                           \
  template absl::Status LaunchAttentionPrefillDim<D>(const AttentionParams&, Stream);

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_PREFILL_CUH_
