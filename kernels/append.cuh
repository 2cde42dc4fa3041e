// Internal: quantize-append, per thread. One work item is one 16-value block
// of one (row, K or V, head); each thread takes kItems items kThreads apart,
// so a warp reads 32 consecutive blocks (1 KiB) and writes 256 contiguous
// packed bytes when the heads of a row are contiguous.
//
// The thread body is FP4KV_HD so tests/kernels_host_test.cc can run the whole
// grid on the CPU; append.cu wraps it in the kernel.
#ifndef FP4KV_KERNELS_APPEND_CUH_
#define FP4KV_KERNELS_APPEND_CUH_

#include <cstdint>

#include "kernels/device_util.cuh"
#include "kernels/fast_format.cuh"
#include "src/params.h"

namespace fp4kv {
namespace kernels {

inline constexpr int kAppendThreads = 128;
inline constexpr int kAppendItems = 2;
inline constexpr uint32_t kAppendItemsPerCta = kAppendThreads * kAppendItems;

struct AppendLaunch {
  internal::AppendParams p;
  int64_t row_begin = 0;   // first row of this launch
  uint32_t num_items = 0;  // rows of this launch * blocks per row
  uint32_t k_blocks = 0;   // blocks of K per row: H * Dk / 16
  FastDivmod row_div;      // blocks per row: H * (Dk + Dv) / 16
  FastDivmod k_head_div;   // Dk / 16
  FastDivmod v_head_div;   // Dv / 16
  FastDivmod page_div;     // page_size
};

// Calls f(launch, grid) for each launch that covers p's rows (one unless
// nnz * blocks per row >= 2^30). Returns false when a single row has too many
// blocks for 32-bit item indices.
template <typename F>
bool ForEachAppendLaunch(const internal::AppendParams& p, F&& f) {
  const int64_t kb = static_cast<int64_t>(p.num_heads) * (p.k.head_dim / kBlockSize);
  const int64_t vb = static_cast<int64_t>(p.num_heads) * (p.v.head_dim / kBlockSize);
  const int64_t per_row = kb + vb;
  if (per_row <= 0 || per_row > kMaxLaunchItems) return false;
  AppendLaunch a;
  a.p = p;
  a.k_blocks = static_cast<uint32_t>(kb);
  a.row_div = FastDivmod::Make(static_cast<uint32_t>(per_row));
  a.k_head_div = FastDivmod::Make(static_cast<uint32_t>(p.k.head_dim / kBlockSize));
  a.v_head_div = FastDivmod::Make(static_cast<uint32_t>(p.v.head_dim / kBlockSize));
  a.page_div = FastDivmod::Make(static_cast<uint32_t>(p.page_size));
  const int64_t rows_per_launch = kMaxLaunchItems / per_row;
  for (int64_t r = 0; r < p.nnz; r += rows_per_launch) {
    const int64_t rows = p.nnz - r < rows_per_launch ? p.nnz - r : rows_per_launch;
    a.row_begin = r;
    a.num_items = static_cast<uint32_t>(rows * per_row);
    f(a, (a.num_items + kAppendItemsPerCta - 1) / kAppendItemsPerCta);
  }
  return true;
}

// internal::ResolveAppendRow with the division by page_size done by
// `page_div` when the slot or position is below 2^31 (always, in practice);
// larger values take the shared helper itself. Same result for every input.
FP4KV_HD bool ResolveRow(const internal::AppendParams& p, const FastDivmod& page_div, int64_t i,
                         int64_t* page, int* entry) {
  int64_t idx_or_slot;
  if (p.indexing == AppendIndexing::kSlot) {
    idx_or_slot = p.slot_mapping[i];
    if (idx_or_slot < 0) return false;
    if (idx_or_slot > 0x7fffffff) return internal::ResolveAppendRow(p, i, page, entry);
    uint32_t e;
    const int64_t pg = page_div.DivMod(static_cast<uint32_t>(idx_or_slot), &e);
    if (pg >= p.num_pages) return false;
    *page = pg;
    *entry = static_cast<int>(e);
    return true;
  }
  const int32_t b = p.batch_indices[i];
  const int32_t pos = p.positions[i];
  if (b < 0 || b >= p.batch_size || pos < 0) return false;
  const int64_t begin = p.kv_indptr[b];
  const int64_t end = p.kv_indptr[b + 1];
  uint32_t e;
  const int64_t idx = begin + page_div.DivMod(static_cast<uint32_t>(pos), &e);
  if (idx < begin || idx >= end || idx < 0 || idx >= p.num_kv_indices) return false;
  const int64_t pg = p.kv_indices[idx];
  if (pg < 0 || pg >= p.num_pages) return false;
  *page = pg;
  *entry = static_cast<int>(e);
  return true;
}

template <bool kBf16, RecipeVariant kVariant>
FP4KV_HD void AppendThread(const AppendLaunch& a, uint32_t cta, uint32_t tid) {
  const internal::AppendParams& p = a.p;
  uint32_t w[kAppendItems][8];
  int64_t row[kAppendItems] = {};
  uint32_t head[kAppendItems] = {}, blk[kAppendItems] = {};
  bool is_v[kAppendItems] = {}, valid[kAppendItems] = {};
  // Issue every input load first: they do not depend on the row's index chain.
  FP4KV_UNROLL
  for (int it = 0; it < kAppendItems; ++it) {
    const uint32_t q = cta * kAppendItemsPerCta + it * kAppendThreads + tid;
    valid[it] = q < a.num_items;
    if (!valid[it]) continue;
    uint32_t rem;
    row[it] = a.row_begin + a.row_div.DivMod(q, &rem);
    is_v[it] = rem >= a.k_blocks;
    const uint32_t r = is_v[it] ? rem - a.k_blocks : rem;
    head[it] = is_v[it] ? a.v_head_div.DivMod(r, &blk[it]) : a.k_head_div.DivMod(r, &blk[it]);
    const uint16_t* base = static_cast<const uint16_t*>(is_v[it] ? p.value : p.key);
    const int64_t offset = row[it] * (is_v[it] ? p.value_row_stride : p.key_row_stride) +
                           head[it] * (is_v[it] ? p.value_head_stride : p.key_head_stride) +
                           static_cast<int64_t>(blk[it]) * kBlockSize;
    const U32x4 lo = LoadInput16(base + offset);
    const U32x4 hi = LoadInput16(base + offset + 8);
    w[it][0] = lo.x;
    w[it][1] = lo.y;
    w[it][2] = lo.z;
    w[it][3] = lo.w;
    w[it][4] = hi.x;
    w[it][5] = hi.y;
    w[it][6] = hi.z;
    w[it][7] = hi.w;
  }
  // Global scales: read once per thread (a device pointer sees graph updates).
  const QuantScale qk = MakeQuantScale(p.k_scale.Get());
  const QuantScale qv = MakeQuantScale(p.v_scale.Get());
  FP4KV_UNROLL
  for (int it = 0; it < kAppendItems; ++it) {
    if (!valid[it]) continue;
    int64_t page;
    int entry;
    if (!ResolveRow(p, a.page_div, row[it], &page, &entry)) continue;
    const internal::PoolPtrs pool = SelectPool(p.k, p.v, is_v[it] != 0);
    uint32_t packed[2];
    const QuantScale qs = is_v[it] ? qv : qk;
    const uint8_t sb = QuantizeBlockFast<kBf16, kVariant>(w[it], qs, p.recipe, packed);
    Store8(pool.data + pool.DataOffset(page, entry, head[it]) + blk[it] * kBlockBytes,
           U32x2{packed[0], packed[1]});
    pool.scales[pool.ScaleOffset(page, entry, head[it]) + blk[it]] = sb;
  }
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_APPEND_CUH_
