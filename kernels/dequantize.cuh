// Internal: paged dequantize, per thread. One work item is half a 16-value
// block (8 values) of one output (request b, position t, K or V, head): a
// warp reads 128 contiguous bytes of packed codes and writes 512 contiguous
// bytes of f16/bf16 with one 16-byte store per thread. Positions past the
// request's length exit, so the grid depends only on B, max_seq_len and the
// geometry.
#ifndef FP4KV_KERNELS_DEQUANTIZE_CUH_
#define FP4KV_KERNELS_DEQUANTIZE_CUH_

#include <cstdint>

#include "kernels/device_util.cuh"
#include "kernels/fast_format.cuh"
#include "src/params.h"

namespace fp4kv {
namespace kernels {

inline constexpr int kDequantThreads = 128;
inline constexpr int kDequantItems = 4;
inline constexpr uint32_t kDequantItemsPerCta = kDequantThreads * kDequantItems;

struct DequantLaunch {
  internal::DequantParams p;
  int batch_begin = 0;     // first request of this launch
  uint32_t num_items = 0;  // requests of this launch * max_seq_len * half blocks per token
  uint32_t k_blocks = 0;   // H * Dk / 16
  FastDivmod token_div;    // half blocks per token: H * (Dk + Dv) / 8
  FastDivmod seq_div;      // max_seq_len
  FastDivmod page_div;     // page_size
  FastDivmod k_head_div;   // Dk / 16
  FastDivmod v_head_div;   // Dv / 16
};

// Calls f(launch, grid) for each launch covering p's requests. Returns false
// when one request has too many blocks for 32-bit item indices.
template <typename F>
bool ForEachDequantLaunch(const internal::DequantParams& p, F&& f) {
  const int64_t kb = static_cast<int64_t>(p.num_heads) * (p.k.head_dim / kBlockSize);
  const int64_t vb = static_cast<int64_t>(p.num_heads) * (p.v.head_dim / kBlockSize);
  const int64_t per_request = 2 * (kb + vb) * p.max_seq_len;
  if (per_request <= 0 || per_request > kMaxLaunchItems) return false;
  DequantLaunch a;
  a.p = p;
  a.k_blocks = static_cast<uint32_t>(kb);
  a.token_div = FastDivmod::Make(static_cast<uint32_t>(2 * (kb + vb)));
  a.seq_div = FastDivmod::Make(static_cast<uint32_t>(p.max_seq_len));
  a.page_div = FastDivmod::Make(static_cast<uint32_t>(p.page_size));
  a.k_head_div = FastDivmod::Make(static_cast<uint32_t>(p.k.head_dim / kBlockSize));
  a.v_head_div = FastDivmod::Make(static_cast<uint32_t>(p.v.head_dim / kBlockSize));
  const int64_t per_launch = kMaxLaunchItems / per_request;
  for (int64_t b = 0; b < p.batch_size; b += per_launch) {
    const int64_t n = p.batch_size - b < per_launch ? p.batch_size - b : per_launch;
    a.batch_begin = static_cast<int>(b);
    a.num_items = static_cast<uint32_t>(n * per_request);
    f(a, (a.num_items + kDequantItemsPerCta - 1) / kDequantItemsPerCta);
  }
  return true;
}

template <bool kBf16>
FP4KV_HD void DequantThread(const DequantLaunch& a, uint32_t cta, uint32_t tid) {
  const internal::DequantParams& p = a.p;
  const int64_t cap = static_cast<int64_t>(p.max_pages) * p.page_size;
  int b[kDequantItems] = {};
  uint32_t t[kDequantItems] = {}, head[kDequantItems] = {}, blk[kDequantItems] = {};
  uint32_t half[kDequantItems] = {};
  bool is_v[kDequantItems] = {}, valid[kDequantItems] = {};
  int64_t page[kDequantItems] = {};
  uint32_t entry[kDequantItems] = {};
  // Level 1: request length and table entry (independent loads).
  FP4KV_UNROLL
  for (int it = 0; it < kDequantItems; ++it) {
    const uint32_t q = cta * kDequantItemsPerCta + it * kDequantThreads + tid;
    if (q >= a.num_items) continue;
    uint32_t rem;
    const uint32_t token = a.token_div.DivMod(q, &rem);
    b[it] = a.batch_begin + static_cast<int>(a.seq_div.DivMod(token, &t[it]));
    half[it] = rem & 1u;
    rem >>= 1;
    is_v[it] = rem >= a.k_blocks;
    const uint32_t r = is_v[it] ? rem - a.k_blocks : rem;
    head[it] = is_v[it] ? a.v_head_div.DivMod(r, &blk[it]) : a.k_head_div.DivMod(r, &blk[it]);
    if (t[it] >= cap) continue;
    const uint32_t j = a.page_div.DivMod(t[it], &entry[it]);
    page[it] = internal::TableEntry(p.block_tables, p.tables_i64, b[it] * p.table_row_stride + j);
    valid[it] =
        t[it] < internal::DequantTokens(p, b[it]) && page[it] >= 0 && page[it] < p.num_pages;
  }
  // Level 2: packed codes and scale bytes.
  uint32_t codes[kDequantItems] = {};
  uint8_t sb[kDequantItems] = {};
  FP4KV_UNROLL
  for (int it = 0; it < kDequantItems; ++it) {
    if (!valid[it]) continue;
    const internal::PoolPtrs pool = SelectPool(p.k, p.v, is_v[it]);
    codes[it] = LoadReadOnly4(pool.data + pool.DataOffset(page[it], entry[it], head[it]) +
                              blk[it] * kBlockBytes + half[it] * 4);
    sb[it] = LoadReadOnly1(pool.scales + pool.ScaleOffset(page[it], entry[it], head[it]) + blk[it]);
  }
  const float gk = p.k_scale.Get();
  const float gv = p.v_scale.Get();
  FP4KV_UNROLL
  for (int it = 0; it < kDequantItems; ++it) {
    if (!valid[it]) continue;
    const float g = is_v[it] ? gv : gk;
    const U32x4 out = DequantizeHalfFast<kBf16>(codes[it], sb[it], g, IsFiniteBits(FloatBits(g)));
    uint16_t* base = static_cast<uint16_t*>(is_v[it] ? p.v_out : p.k_out);
    const int64_t offset =
        b[it] * (is_v[it] ? p.v_out_batch : p.k_out_batch) +
        static_cast<int64_t>(t[it]) * (is_v[it] ? p.v_out_token : p.k_out_token) +
        static_cast<int64_t>(head[it]) * (is_v[it] ? p.v_out_head : p.k_out_head) +
        static_cast<int64_t>(blk[it]) * kBlockSize + half[it] * 8;
    Store16(base + offset, out);
  }
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_DEQUANTIZE_CUH_
