// Internal: paged dequantize, per thread. A row is one output position
// (request b, position t < max_seq_len); its work items are the blocks
// (16 values) of K then V over all heads. A thread owns one item (offsets
// computed once) and handles it for the positions of its CTA, two at a time;
// positions past the request's length are skipped, so the grid depends only
// on B, max_seq_len and the geometry. A warp reads 256 contiguous bytes of
// codes and writes 1 KiB contiguous bytes of f16/bf16 (two 16-byte stores per
// thread) when the output heads are contiguous.
#ifndef FP4KV_KERNELS_DEQUANTIZE_CUH_
#define FP4KV_KERNELS_DEQUANTIZE_CUH_

#include <cstdint>

#include "kernels/device_util.cuh"
#include "kernels/fast_format.cuh"
#include "src/params.h"

namespace fp4kv {
namespace kernels {

inline constexpr int kDequantUnroll = 2;

struct DequantLaunch {
  internal::DequantParams p;
  int batch_begin = 0;  // first request of this launch
  int64_t rows = 0;     // positions of this launch: requests * max_seq_len
  TileShape shape;
  uint32_t items = 0;     // blocks per position: H * (Dk + Dv) / 16
  uint32_t k_blocks = 0;  // H * Dk / 16
  FastDivmod seq_div;     // max_seq_len
  FastDivmod page_div;    // page_size
  FastDivmod k_head_div;  // Dk / 16
  FastDivmod v_head_div;  // Dv / 16
};

// Calls f(launch) for each launch covering p's requests. Returns false when
// a position has too many blocks for one grid.
template <typename F>
bool ForEachDequantLaunch(const internal::DequantParams& p, F&& f, uint32_t rows_per_cta = 0) {
  const int64_t kh = static_cast<int64_t>(p.num_heads) * (p.k.head_dim / kBlockSize);
  const int64_t vh = static_cast<int64_t>(p.num_heads) * (p.v.head_dim / kBlockSize);
  DequantLaunch a;
  a.p = p;
  a.items = static_cast<uint32_t>(kh + vh);
  a.k_blocks = static_cast<uint32_t>(kh);
  a.seq_div = FastDivmod::Make(static_cast<uint32_t>(p.max_seq_len));
  a.page_div = FastDivmod::Make(static_cast<uint32_t>(p.page_size));
  a.k_head_div = FastDivmod::Make(static_cast<uint32_t>(p.k.head_dim / kBlockSize));
  a.v_head_div = FastDivmod::Make(static_cast<uint32_t>(p.v.head_dim / kBlockSize));
  const int64_t per_launch = kMaxLaunchItems / p.max_seq_len;  // requests
  const uint32_t per_cta = rows_per_cta > 0
                               ? rows_per_cta
                               : RowsPerCta(static_cast<int64_t>(p.batch_size) * p.max_seq_len);
  for (int64_t b = 0; b < p.batch_size; b += per_launch) {
    const int64_t n = p.batch_size - b < per_launch ? p.batch_size - b : per_launch;
    a.batch_begin = static_cast<int>(b);
    a.rows = n * p.max_seq_len;
    if (!MakeTileShape(kh + vh, a.rows, per_cta, &a.shape)) return false;
    f(a);
  }
  return true;
}

template <bool kBf16>
FP4KV_HD void DequantThread(const DequantLaunch& a, uint32_t cta_x, uint32_t cta_y, uint32_t tid) {
  const internal::DequantParams& p = a.p;
  const uint32_t item = cta_y * a.shape.threads + tid;
  if (item >= a.items) return;
  // This thread's block: K or V, head, block within the head row.
  const bool is_v = item >= a.k_blocks;
  uint32_t blk;
  const uint32_t head =
      is_v ? a.v_head_div.DivMod(item - a.k_blocks, &blk) : a.k_head_div.DivMod(item, &blk);
  const internal::PoolPtrs pool = SelectPool(p.k, p.v, is_v);
  // FP8 keys: this block is 16 E4M3 bytes with no scale byte.
  const bool fp8 = !is_v && p.fp8_keys;
  const uint8_t* const data =
      pool.data + head * pool.data_head + blk * (fp8 ? kBlockSize : kBlockBytes);
  const uint8_t* const scales = fp8 ? nullptr : pool.scales + head * pool.scale_head + blk;
  uint16_t* const out = static_cast<uint16_t*>(is_v ? p.v_out : p.k_out) +
                        head * (is_v ? p.v_out_head : p.k_out_head) +
                        static_cast<int64_t>(blk) * kBlockSize;
  const int64_t out_batch = is_v ? p.v_out_batch : p.k_out_batch;
  const int64_t out_token = is_v ? p.v_out_token : p.k_out_token;
  const float g = is_v ? p.v_scale.Get() : p.k_scale.Get();
  const bool g_finite = IsFiniteBits(FloatBits(g));
  const int64_t cap = static_cast<int64_t>(p.max_pages) * p.page_size;
  const uint32_t first = cta_x * a.shape.rows_per_cta;
  const uint32_t end = static_cast<uint32_t>(
      first + a.shape.rows_per_cta < a.rows ? first + a.shape.rows_per_cta : a.rows);
  for (uint32_t r0 = first; r0 < end; r0 += kDequantUnroll) {
    int b[kDequantUnroll] = {};
    uint32_t t[kDequantUnroll] = {};
    bool valid[kDequantUnroll] = {};
    int64_t page[kDequantUnroll] = {};
    uint32_t entry[kDequantUnroll] = {};
    // Level 1: request length and table entry (independent loads).
    FP4KV_UNROLL
    for (int u = 0; u < kDequantUnroll; ++u) {
      if (r0 + u >= end) break;
      b[u] = a.batch_begin + static_cast<int>(a.seq_div.DivMod(r0 + u, &t[u]));
      if (t[u] >= cap) continue;
      const uint32_t j = a.page_div.DivMod(t[u], &entry[u]);
      page[u] = internal::TableEntry(p.block_tables, p.tables_i64, b[u] * p.table_row_stride + j);
      valid[u] = t[u] < internal::DequantTokens(p, b[u]) && page[u] >= 0 && page[u] < p.num_pages;
    }
    if (fp8) {
      U32x4 bytes[kDequantUnroll] = {};
      FP4KV_UNROLL
      for (int u = 0; u < kDequantUnroll; ++u) {
        if (valid[u]) bytes[u] = LoadInput16(data + page[u] * pool.data_page + entry[u] * pool.data_entry);
      }
      FP4KV_UNROLL
      for (int u = 0; u < kDequantUnroll; ++u) {
        if (!valid[u]) continue;
        uint16_t* const dst = out + b[u] * out_batch + static_cast<int64_t>(t[u]) * out_token;
        const Words8Out v = DequantFp8KeyBlockFast<kBf16>(bytes[u], g, g_finite);
        Store16(dst, v.lo);
        Store16(dst + 8, v.hi);
      }
      continue;
    }
    // Level 2: packed codes and scale bytes.
    U32x2 codes[kDequantUnroll] = {};
    uint8_t sb[kDequantUnroll] = {};
    FP4KV_UNROLL
    for (int u = 0; u < kDequantUnroll; ++u) {
      if (!valid[u]) continue;
      codes[u] = LoadReadOnly8(data + page[u] * pool.data_page + entry[u] * pool.data_entry);
      sb[u] = LoadReadOnly1(scales + page[u] * pool.scale_page + entry[u] * pool.scale_entry);
    }
    FP4KV_UNROLL
    for (int u = 0; u < kDequantUnroll; ++u) {
      if (!valid[u]) continue;
      uint16_t* const dst = out + b[u] * out_batch + static_cast<int64_t>(t[u]) * out_token;
      const Words8Out v = DequantizeBlockFast<kBf16>(codes[u], sb[u], g, g_finite);
      Store16(dst, v.lo);
      Store16(dst + 8, v.hi);
    }
  }
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_DEQUANTIZE_CUH_
