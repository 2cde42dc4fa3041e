// Internal: FP8 materialization, per thread. One work item is one 16-value
// block of one output page (K or V, head, entry); the grid covers the zero
// page plus B * max_pages request pages, and items of pages a request does
// not use exit. A warp writes 512 contiguous FP8 bytes.
#ifndef FP4KV_KERNELS_MATERIALIZE_CUH_
#define FP4KV_KERNELS_MATERIALIZE_CUH_

#include <cstdint>

#include "kernels/device_util.cuh"
#include "kernels/fast_format.cuh"
#include "src/params.h"

namespace fp4kv {
namespace kernels {

inline constexpr int kMaterializeThreads = 128;
inline constexpr int kMaterializeItems = 2;
inline constexpr uint32_t kMaterializeItemsPerCta = kMaterializeThreads * kMaterializeItems;

struct MaterializeLaunch {
  internal::MaterializeParams p;
  bool zero_page = false;  // items [0, page_items) of this launch zero out page 0
  int batch_begin = 0;     // first request of this launch
  uint32_t num_items = 0;
  FastDivmod page_div;   // items per page: 2 * H * S * D / 16
  FastDivmod pages_div;  // max_pages
  FastDivmod kv_div;     // H * S * D / 16
  FastDivmod head_div;   // S * D / 16
  FastDivmod entry_div;  // D / 16
};

template <typename F>
bool ForEachMaterializeLaunch(const internal::MaterializeParams& p, F&& f) {
  const int64_t nb = p.head_dim / kBlockSize;
  const int64_t per_head = static_cast<int64_t>(p.page_size) * nb;
  const int64_t per_kv = per_head * p.num_heads;
  const int64_t per_page = 2 * per_kv;
  const int64_t per_request = per_page * p.max_pages;
  if (per_page <= 0 || per_page > kMaxLaunchItems / 2 || per_request > kMaxLaunchItems / 2) {
    return false;
  }
  MaterializeLaunch a;
  a.p = p;
  a.page_div = FastDivmod::Make(static_cast<uint32_t>(per_page));
  a.pages_div = FastDivmod::Make(static_cast<uint32_t>(p.max_pages > 0 ? p.max_pages : 1));
  a.kv_div = FastDivmod::Make(static_cast<uint32_t>(per_kv));
  a.head_div = FastDivmod::Make(static_cast<uint32_t>(per_head));
  a.entry_div = FastDivmod::Make(static_cast<uint32_t>(nb));
  const int64_t per_launch = per_request > 0 ? (kMaxLaunchItems / 2) / per_request : p.batch_size;
  int64_t b = 0;
  do {
    const int64_t n = p.batch_size - b < per_launch ? p.batch_size - b : per_launch;
    a.zero_page = b == 0;
    a.batch_begin = static_cast<int>(b);
    a.num_items = static_cast<uint32_t>((a.zero_page ? per_page : 0) + n * per_request);
    f(a, (a.num_items + kMaterializeItemsPerCta - 1) / kMaterializeItemsPerCta);
    b += n;
  } while (b < p.batch_size);
  return true;
}

FP4KV_HD void MaterializeThread(const MaterializeLaunch& a, uint32_t cta, uint32_t tid) {
  const internal::MaterializeParams& p = a.p;
  const uint32_t per_page = a.page_div.divisor;
  bool active[kMaterializeItems] = {}, zero[kMaterializeItems] = {};
  int b[kMaterializeItems] = {};
  uint32_t j[kMaterializeItems] = {}, kv[kMaterializeItems] = {}, head[kMaterializeItems] = {};
  uint32_t entry[kMaterializeItems] = {}, blk[kMaterializeItems] = {};
  int64_t out_page[kMaterializeItems] = {}, src[kMaterializeItems] = {};
  // Level 1: request metadata and source page (independent loads).
  FP4KV_UNROLL
  for (int it = 0; it < kMaterializeItems; ++it) {
    uint32_t q = cta * kMaterializeItemsPerCta + it * kMaterializeThreads + tid;
    if (q >= a.num_items) continue;
    bool zero_page = false;
    if (a.zero_page) {
      if (q < per_page) {
        zero_page = true;
      } else {
        q -= per_page;
      }
    }
    uint32_t rem = q;
    if (!zero_page) {
      const uint32_t vp = a.page_div.DivMod(q, &rem);
      b[it] = a.batch_begin + static_cast<int>(a.pages_div.DivMod(vp, &j[it]));
    }
    uint32_t r;
    kv[it] = a.kv_div.DivMod(rem, &r);
    head[it] = a.head_div.DivMod(r, &r);
    entry[it] = a.entry_div.DivMod(r, &blk[it]);
    active[it] = true;
    if (zero_page) {
      zero[it] = true;
      out_page[it] = 0;
      continue;
    }
    const int32_t seq_len = p.seq_lens[b[it]];
    const int64_t pages = internal::MaterializePages(p, b[it]);
    src[it] = internal::TableEntry(p.block_tables, p.tables_i64,
                                   b[it] * p.table_row_stride + kv[it] * p.table_kv_stride + j[it]);
    const int64_t o = static_cast<int64_t>(p.kv_page_indptr[b[it]]) + j[it] + 1;
    if (j[it] >= pages || o < 1 || o >= p.num_out_pages) {
      active[it] = false;
      continue;
    }
    out_page[it] = o;
    if (rem == 0) {
      p.fp8_block_tables[b[it] * p.fp8_table_row_stride + j[it]] = static_cast<int32_t>(o);
    }
    if (src[it] < 0 || src[it] >= p.num_pages) {
      active[it] = false;
      continue;
    }
    const int64_t len = seq_len < 0 ? 0 : seq_len;
    zero[it] = static_cast<int64_t>(j[it]) * p.page_size + entry[it] >= len;
  }
  // Level 2: packed codes and scale bytes.
  U32x2 codes[kMaterializeItems];
  uint8_t sb[kMaterializeItems] = {};
  FP4KV_UNROLL
  for (int it = 0; it < kMaterializeItems; ++it) {
    codes[it] = U32x2{0, 0};
    if (!active[it] || zero[it]) continue;
    const internal::PoolPtrs pool = SelectPool(p.k, p.v, kv[it] != 0);
    codes[it] = LoadReadOnly8(pool.data + pool.DataOffset(src[it], entry[it], head[it]) +
                              blk[it] * kBlockBytes);
    sb[it] = LoadReadOnly1(pool.scales + pool.ScaleOffset(src[it], entry[it], head[it]) + blk[it]);
  }
  // Multipliers g / fp8_scale, once per thread.
  const float mk = Fp8MaterializeMultiplier(p.k_scale.Get(), p.k_fp8_scale.Get());
  const float mv = Fp8MaterializeMultiplier(p.v_scale.Get(), p.v_fp8_scale.Get());
  FP4KV_UNROLL
  for (int it = 0; it < kMaterializeItems; ++it) {
    if (!active[it]) continue;
    const U32x4 v =
        zero[it] ? U32x4{0, 0, 0, 0} : MaterializeBlockFast(codes[it], sb[it], kv[it] ? mv : mk);
    Store16(p.out + out_page[it] * p.out_page + kv[it] * p.out_kv + head[it] * p.out_head +
                entry[it] * p.out_entry + blk[it] * kBlockSize,
            v);
  }
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_MATERIALIZE_CUH_
