// Internal: FP8 materialization, per thread. A row is one output page: the
// zero page, then page j of request b for every (b, j < max_pages); its work
// items are the 16-value blocks of (K or V, head, entry). A thread owns one
// item (offsets computed once) and handles it for the pages of its CTA, two
// at a time; pages a request does not use are skipped. A warp writes 512
// contiguous FP8 bytes.
#ifndef FP4KV_KERNELS_MATERIALIZE_CUH_
#define FP4KV_KERNELS_MATERIALIZE_CUH_

#include <cstdint>

#include "kernels/device_util.cuh"
#include "kernels/fast_format.cuh"
#include "src/params.h"

namespace fp4kv {
namespace kernels {

inline constexpr int kMaterializeUnroll = 2;

struct MaterializeLaunch {
  internal::MaterializeParams p;
  bool zero_page = false;  // row 0 of this launch is out page 0 (zeroed)
  int batch_begin = 0;     // first request of this launch
  int64_t rows = 0;        // (zero_page ? 1 : 0) + requests * max_pages
  TileShape shape;
  uint32_t items = 0;    // blocks per page: 2 * H * S * D / 16
  FastDivmod pages_div;  // max_pages
  FastDivmod kv_div;     // H * S * D / 16
  FastDivmod head_div;   // S * D / 16
  FastDivmod entry_div;  // D / 16
};

template <typename F>
bool ForEachMaterializeLaunch(const internal::MaterializeParams& p, F&& f,
                              uint32_t rows_per_cta = 0) {
  const int64_t nb = p.head_dim / kBlockSize;
  const int64_t per_head = static_cast<int64_t>(p.page_size) * nb;
  const int64_t per_kv = per_head * p.num_heads;
  MaterializeLaunch a;
  a.p = p;
  a.items = static_cast<uint32_t>(2 * per_kv);
  a.pages_div = FastDivmod::Make(static_cast<uint32_t>(p.max_pages > 0 ? p.max_pages : 1));
  a.kv_div = FastDivmod::Make(static_cast<uint32_t>(per_kv));
  a.head_div = FastDivmod::Make(static_cast<uint32_t>(per_head));
  a.entry_div = FastDivmod::Make(static_cast<uint32_t>(nb));
  const int64_t max_pages = p.max_pages > 0 ? p.max_pages : 1;
  const int64_t per_launch = (kMaxLaunchItems - 1) / max_pages;  // requests
  const uint32_t per_cta = rows_per_cta > 0
                               ? rows_per_cta
                               : RowsPerCta(1 + static_cast<int64_t>(p.batch_size) * p.max_pages);
  int64_t b = 0;
  do {
    const int64_t n = p.batch_size - b < per_launch ? p.batch_size - b : per_launch;
    a.zero_page = b == 0;
    a.batch_begin = static_cast<int>(b);
    a.rows = (a.zero_page ? 1 : 0) + n * p.max_pages;
    if (!MakeTileShape(2 * per_kv, a.rows, per_cta, &a.shape)) return false;
    f(a);
    b += n;
  } while (b < p.batch_size);
  return true;
}

FP4KV_HD void MaterializeThread(const MaterializeLaunch& a, uint32_t cta_x, uint32_t cta_y,
                                uint32_t tid) {
  const internal::MaterializeParams& p = a.p;
  const uint32_t item = cta_y * a.shape.threads + tid;
  if (item >= a.items) return;
  // This thread's block: K or V, head, entry, block within the row.
  uint32_t r, entry, blk;
  const uint32_t kv = a.kv_div.DivMod(item, &r);
  const uint32_t head = a.head_div.DivMod(r, &r);
  entry = a.entry_div.DivMod(r, &blk);
  uint8_t* const out =
      p.out + kv * p.out_kv + head * p.out_head + entry * p.out_entry + blk * kBlockSize;
  const internal::PoolPtrs pool = SelectPool(p.k, p.v, kv != 0);
  const uint8_t* const data =
      pool.data + entry * pool.data_entry + head * pool.data_head + blk * kBlockBytes;
  const uint8_t* const scales =
      pool.scales + entry * pool.scale_entry + head * pool.scale_head + blk;
  // Multiplier g / fp8_scale, once per thread.
  const float m = kv ? Fp8MaterializeMultiplier(p.v_scale.Get(), p.v_fp8_scale.Get())
                     : Fp8MaterializeMultiplier(p.k_scale.Get(), p.k_fp8_scale.Get());
  const uint32_t skip = a.zero_page ? 1 : 0;
  const uint32_t first = cta_x * a.shape.rows_per_cta;
  const uint32_t end = static_cast<uint32_t>(
      first + a.shape.rows_per_cta < a.rows ? first + a.shape.rows_per_cta : a.rows);
  for (uint32_t r0 = first; r0 < end; r0 += kMaterializeUnroll) {
    bool active[kMaterializeUnroll] = {}, zero[kMaterializeUnroll] = {};
    int64_t out_page[kMaterializeUnroll] = {}, src[kMaterializeUnroll] = {};
    // Level 1: request metadata and source page (independent loads).
    FP4KV_UNROLL
    for (int u = 0; u < kMaterializeUnroll; ++u) {
      const uint32_t row = r0 + u;
      if (row >= end) break;
      active[u] = true;
      if (row < skip) {  // out page 0
        zero[u] = true;
        continue;
      }
      uint32_t j;
      const int b = a.batch_begin + static_cast<int>(a.pages_div.DivMod(row - skip, &j));
      const int32_t seq_len = p.seq_lens[b];
      const int64_t pages = internal::MaterializePages(p, b);
      src[u] = internal::TableEntry(p.block_tables, p.tables_i64,
                                    b * p.table_row_stride + kv * p.table_kv_stride + j);
      const int64_t o = static_cast<int64_t>(p.kv_page_indptr[b]) + j + 1;
      if (j >= pages || o < 1 || o >= p.num_out_pages) {
        active[u] = false;
        continue;
      }
      out_page[u] = o;
      if (item == 0) {
        p.fp8_block_tables[b * p.fp8_table_row_stride + j] = static_cast<int32_t>(o);
      }
      if (src[u] < 0 || src[u] >= p.num_pages) {
        active[u] = false;
        continue;
      }
      const int64_t len = seq_len < 0 ? 0 : seq_len;
      zero[u] = static_cast<int64_t>(j) * p.page_size + entry >= len;
    }
    // Level 2: packed codes and scale bytes.
    U32x2 codes[kMaterializeUnroll];
    uint8_t sb[kMaterializeUnroll] = {};
    FP4KV_UNROLL
    for (int u = 0; u < kMaterializeUnroll; ++u) {
      codes[u] = U32x2{0, 0};
      if (!active[u] || zero[u]) continue;
      codes[u] = LoadReadOnly8(data + src[u] * pool.data_page);
      sb[u] = LoadReadOnly1(scales + src[u] * pool.scale_page);
    }
    FP4KV_UNROLL
    for (int u = 0; u < kMaterializeUnroll; ++u) {
      if (!active[u]) continue;
      Store16(out + out_page[u] * p.out_page,
              zero[u] ? U32x4{0, 0, 0, 0} : MaterializeBlockFast(codes[u], sb[u], m));
    }
  }
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_MATERIALIZE_CUH_
