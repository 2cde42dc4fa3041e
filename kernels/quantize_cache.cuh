// Internal: quantization of an unquantized paged cache, per thread. A row is
// one token slot (list position r / page_size, entry r % page_size); its work
// items are the 16-value blocks of K then V over all heads, as in the append
// (append.cuh): a thread owns one item (fixed head and block, offsets
// computed once), loops over its CTA's rows two at a time with both rows'
// loads issued first, and quantizes with the append's QuantizeBlockFast, so
// the bytes are the append's for the same row and scale.
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

// The launches covering p's rows.
template <typename F>
bool ForEachQuantizeCacheLaunch(const internal::QuantizeCacheParams& p, F&& f,
                                uint32_t rows_per_cta = 0) {
  return ForEachBlockRowLaunch(p, p.rows, rows_per_cta, static_cast<F&&>(f));
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

FP4KV_HD CacheItem MakeCacheItem(const QuantizeCacheLaunch& a, uint32_t item) {
  const internal::QuantizeCacheParams& p = a.p;
  CacheItem c;
  c.is_v = item >= a.k_blocks;
  uint32_t blk;
  const uint32_t head =
      c.is_v ? a.v_head_div.DivMod(item - a.k_blocks, &blk) : a.k_head_div.DivMod(item, &blk);
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

template <bool kBf16, RecipeVariant kVariant>
FP4KV_HD void QuantizeCacheThread(const QuantizeCacheLaunch& a, uint32_t cta_x, uint32_t cta_y,
                                  uint32_t tid) {
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
  for (uint32_t r0 = 0; r0 < n; r0 += kAppendUnroll) {
    uint32_t w[kAppendUnroll][8];
    int64_t dst[kAppendUnroll] = {}, entry[kAppendUnroll] = {};
    bool ok[kAppendUnroll];
    FP4KV_UNROLL
    for (int u = 0; u < kAppendUnroll; ++u) {
      int64_t src = 0;
      ok[u] = r0 + u < n && ResolveCacheSlot(p, a.page_div, row0 + r0 + u, &src, &entry[u], &dst[u]);
      if (ok[u]) LoadBlock(c.src + src * c.src_page + entry[u] * c.src_entry, w[u]);
    }
    FP4KV_UNROLL
    for (int u = 0; u < kAppendUnroll; ++u) {
      if (!ok[u]) continue;
      if (c.fp8) {
        Store16(c.pool.data + dst[u] * c.pool.data_page + entry[u] * c.pool.data_entry,
                QuantizeFp8KeyBlockFast<kBf16>(w[u], fp8_r));
        continue;
      }
      uint32_t packed[2];
      const uint8_t sb = QuantizeBlockFast<kBf16, kVariant>(w[u], qs, p.recipe, packed);
      Store8(c.pool.data + dst[u] * c.pool.data_page + entry[u] * c.pool.data_entry,
             U32x2{packed[0], packed[1]});
      c.pool.scales[dst[u] * c.pool.scale_page + entry[u] * c.pool.scale_entry] = sb;
    }
  }
}

// The amax (NaN ignored, +0 when none) of this thread's block over the rows
// of its CTA that write, into *k_amax or *v_amax (the other gets 0).
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
