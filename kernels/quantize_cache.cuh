// Internal: quantization of an unquantized paged cache, per thread. A row is
// one token slot (list position r / page_size, entry r % page_size); its work
// items are the 16-value blocks of K then V over all heads, as in the append
// (append.cuh): a thread owns one item (fixed head and block, offsets
// computed once), loops over its CTA's rows two at a time with both rows'
// loads issued first, and quantizes with the append's QuantizeBlockFast, so
// the bytes are the append's for the same row and scale. As in the append,
// an item is two adjacent blocks of one head row where the geometry allows
// it and the keys are NVFP4 (one row at a time then).
//
// The scale computation runs the same grid first: each thread takes the
// amax of its block over its rows (CacheAmaxThread); the kernel reduces a
// warp's values and adds them with one integer max per side.
//
// Thread bodies are FP4KV_HD so tests/kernels_host_test.cc can run whole
// grids on the CPU; quantize_cache.cu wraps them in kernels.
#ifndef FP4KV_KERNELS_QUANTIZE_CACHE_CUH_
#define FP4KV_KERNELS_QUANTIZE_CACHE_CUH_

#include <cstdint>

#include "kernels/append.cuh"
#include "kernels/device_util.cuh"
#include "kernels/fast_format.cuh"
#include "src/params.h"

namespace fp4kv {
namespace kernels {

using QuantizeCacheLaunch = BlockRowLaunch<internal::QuantizeCacheParams>;

// The launches covering p's rows; pairs of blocks an item under the
// append's policy (AppendPairPolicy: kAuto takes them for NVFP4 keys).
template <typename F>
bool ForEachQuantizeCacheLaunch(const internal::QuantizeCacheParams& p, F&& f,
                                uint32_t rows_per_cta = 0,
                                AppendPairPolicy pairs = AppendPairPolicy::kAuto) {
  return ForEachBlockRowLaunch(p, p.rows, rows_per_cta, static_cast<F&&>(f),
                               UseBlockPairs(p, pairs));
}

// internal::ResolveCacheRow for row r, with the division by page_size done
// by `page_div` below 2^31. Same result for every r.
FP4KV_HD bool ResolveCacheSlot(const internal::QuantizeCacheParams& p, const FastDivmod& page_div,
                               int64_t r, int64_t* src, int64_t* entry, int64_t* dst) {
  int64_t i, e;
  if (r <= 0x7fffffff) {
    uint32_t rem;
    i = page_div.DivMod(static_cast<uint32_t>(r), &rem);
    e = rem;
  } else {
    i = r / p.page_size;
    e = r % p.page_size;
  }
  *entry = e;
  return internal::ResolveCacheRow(p, i, src, dst);
}

// One thread's fixed part: which block it owns and where that block lives.
struct CacheItem {
  bool is_v = false;
  bool fp8 = false;  // an FP8 key block: 16 E4M3 bytes, no scale byte
  const uint16_t* src = nullptr;  // the block in source page 0, entry 0
  int64_t src_page = 0, src_entry = 0;  // elements
  internal::PoolPtrs pool;        // data / scales advanced to the block
};

// Item `item` of the launch: its first block (a.pair: blocks blk, blk + 1).
FP4KV_HD CacheItem MakeCacheItem(const QuantizeCacheLaunch& a, uint32_t item) {
  const internal::QuantizeCacheParams& p = a.p;
  CacheItem c;
  c.is_v = item >= a.k_blocks;
  uint32_t bi;
  const uint32_t head =
      c.is_v ? a.v_head_div.DivMod(item - a.k_blocks, &bi) : a.k_head_div.DivMod(item, &bi);
  const uint32_t blk = a.pair ? 2 * bi : bi;
  c.src = static_cast<const uint16_t*>(c.is_v ? p.v_src : p.k_src) +
          head * (c.is_v ? p.v_src_head : p.k_src_head) + static_cast<int64_t>(blk) * kBlockSize;
  c.src_page = c.is_v ? p.v_src_page : p.k_src_page;
  c.src_entry = c.is_v ? p.v_src_entry : p.k_src_entry;
  c.pool = SelectPool(p.k, p.v, c.is_v);
  c.fp8 = !c.is_v && p.fp8_keys;
  c.pool.data += head * c.pool.data_head + blk * (c.fp8 ? kBlockSize : kBlockBytes);
  if (!c.fp8) c.pool.scales += head * c.pool.scale_head + blk;
  return c;
}

FP4KV_HD void LoadBlock(const uint16_t* src, uint32_t (&w)[8]) {
  const U32x4 lo = LoadInput16(src);
  const U32x4 hi = LoadInput16(src + 8);
  w[0] = lo.x;
  w[1] = lo.y;
  w[2] = lo.z;
  w[3] = lo.w;
  w[4] = hi.x;
  w[5] = hi.y;
  w[6] = hi.z;
  w[7] = hi.w;
}

// Rows [first, first + n) of the launch that CTA x runs.
FP4KV_HD uint32_t CtaRows(const QuantizeCacheLaunch& a, uint32_t cta_x, int64_t* row0) {
  const uint32_t first = cta_x * a.shape.rows_per_cta;
  const uint32_t left = static_cast<uint32_t>(a.rows) - first;
  *row0 = a.row_begin + first;
  return left < a.shape.rows_per_cta ? left : a.shape.rows_per_cta;
}

// kPair (a.pair): the item is blocks blk and blk + 1 of its head row, one
// row a step (the bytes in flight of two single-block rows); the codes
// leave as one 16-byte store.
template <bool kBf16, RecipeVariant kVariant, bool kPair>
FP4KV_HD void QuantizeCacheThreadT(const QuantizeCacheLaunch& a, uint32_t cta_x, uint32_t cta_y,
                                   uint32_t tid) {
  constexpr int kB = kPair ? 2 : 1;              // blocks per item
  constexpr int kU = kPair ? 1 : kAppendUnroll;  // rows a step
  const internal::QuantizeCacheParams& p = a.p;
  const uint32_t item = cta_y * a.shape.threads + tid;
  if (item >= a.items) return;
  const CacheItem c = MakeCacheItem(a, item);
  // Global scale: read once per thread (a device pointer sees graph updates
  // and the scale computation that ran before).
  const float g = c.is_v ? p.v_scale.Get() : p.k_scale.Get();
  const QuantScale qs = MakeQuantScale(g);
  const float fp8_r = c.fp8 ? Fp8KeyEncodeMultiplier(g) : 0.0f;
  int64_t row0;
  const uint32_t n = CtaRows(a, cta_x, &row0);
  for (uint32_t r0 = 0; r0 < n; r0 += kU) {
    uint32_t w[kU][kB][8];
    int64_t dst[kU] = {}, entry[kU] = {};
    bool ok[kU];
    FP4KV_UNROLL
    for (int u = 0; u < kU; ++u) {
      int64_t src = 0;
      ok[u] = r0 + u < n && ResolveCacheSlot(p, a.page_div, row0 + r0 + u, &src, &entry[u], &dst[u]);
      if (!ok[u]) continue;
      FP4KV_UNROLL
      for (int k = 0; k < kB; ++k) {
        LoadBlock(c.src + src * c.src_page + entry[u] * c.src_entry + k * kBlockSize, w[u][k]);
      }
    }
    FP4KV_UNROLL
    for (int u = 0; u < kU; ++u) {
      if (!ok[u]) continue;
      uint8_t* const data = c.pool.data + dst[u] * c.pool.data_page + entry[u] * c.pool.data_entry;
      if (c.fp8) {
        FP4KV_UNROLL
        for (int k = 0; k < kB; ++k) {
          Store16(data + k * kBlockSize, QuantizeFp8KeyBlockFast<kBf16>(w[u][k], fp8_r));
        }
        continue;
      }
      uint32_t packed[kB][2];
      uint8_t sb[kB];
      FP4KV_UNROLL
      for (int k = 0; k < kB; ++k) {
        sb[k] = QuantizeBlockFast<kBf16, kVariant>(w[u][k], qs, p.recipe, packed[k]);
      }
      StoreNvfp4Item<kB>(data,
                         c.pool.scales + dst[u] * c.pool.scale_page + entry[u] * c.pool.scale_entry,
                         packed, sb);
    }
  }
}

template <bool kBf16, RecipeVariant kVariant>
FP4KV_HD void QuantizeCacheThread(const QuantizeCacheLaunch& a, uint32_t cta_x, uint32_t cta_y,
                                  uint32_t tid) {
  if (a.pair) {
    QuantizeCacheThreadT<kBf16, kVariant, true>(a, cta_x, cta_y, tid);
  } else {
    QuantizeCacheThreadT<kBf16, kVariant, false>(a, cta_x, cta_y, tid);
  }
}

// The amax (NaN ignored, +0 when none) of this thread's block over the rows
// of its CTA that write, into *k_amax or *v_amax (the other gets 0). One
// block an item always (launch with AppendPairPolicy::kNever): with pairs in
// both passes the computed-scales case of 2 GiB took 1.405 ms against 1.352
// on an H200 although its quantize pass gained 64 us (the amax pass: half
// the threads, each with a row's two loads in turn).
template <bool kBf16>
FP4KV_HD void CacheAmaxThread(const QuantizeCacheLaunch& a, uint32_t cta_x, uint32_t cta_y,
                              uint32_t tid, float* k_amax, float* v_amax) {
  *k_amax = 0.0f;
  *v_amax = 0.0f;
  const internal::QuantizeCacheParams& p = a.p;
  const uint32_t item = cta_y * a.shape.threads + tid;
  if (item >= a.items) return;
  const CacheItem c = MakeCacheItem(a, item);
  int64_t row0;
  const uint32_t n = CtaRows(a, cta_x, &row0);
  float amax = 0.0f;
  for (uint32_t r = 0; r < n; ++r) {
    int64_t src, entry, dst;
    if (!ResolveCacheSlot(p, a.page_div, row0 + r, &src, &entry, &dst)) continue;
    uint32_t w[8];
    LoadBlock(c.src + src * c.src_page + entry * c.src_entry, w);
    const float m = BlockAmaxOfWords<kBf16>(w);
    amax = m > amax ? m : amax;
  }
  *(c.is_v ? v_amax : k_amax) = amax;
}

// After the amax pass (one thread): reads the accumulated amax bits, clears
// them when they are scratch (not the scale outputs), and finishes the scales.
FP4KV_HD void FinishCacheScalesFromBits(const internal::QuantizeCacheParams& p) {
  float amax[2];
  for (int kv = 0; kv < 2; ++kv) {
    amax[kv] = BitsFloat(*p.amax_bits[kv]);
    if (static_cast<void*>(p.amax_bits[kv]) != static_cast<void*>(p.scale_out[kv])) {
      *p.amax_bits[kv] = 0;
    }
  }
  internal::FinishCacheScales(p, amax);
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_QUANTIZE_CACHE_CUH_
