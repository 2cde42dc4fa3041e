// Internal: quantize-append, per thread. A row is one appended token; its
// work items are the 16-value blocks of K then V over all heads. A thread
// owns one item (fixed head and block: offsets computed once) and quantizes
// it for the rows of its CTA, two rows at a time with both rows' loads issued
// first. Consecutive threads take consecutive blocks, so a warp reads 1 KiB
// and writes 256 contiguous packed bytes per row when heads are contiguous.
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

inline constexpr int kAppendUnroll = 2;

// One launch of a grid whose rows are token slots and whose items are the
// 16-value blocks of K then V over all heads (the append, the whole-cache
// quantize).
template <typename Params>
struct BlockRowLaunch {
  Params p;
  int64_t row_begin = 0;  // first row of this launch
  int64_t rows = 0;       // rows of this launch
  TileShape shape;
  uint32_t items = 0;     // blocks per row: H * (Dk + Dv) / 16
  uint32_t k_blocks = 0;  // H * Dk / 16
  FastDivmod k_head_div;  // Dk / 16
  FastDivmod v_head_div;  // Dv / 16
  FastDivmod page_div;    // page_size
};

// Calls f(launch) for each launch that covers `rows` rows of p (one unless
// rows >= 2^30). Returns false when a row has too many blocks for one grid.
template <typename Params, typename F>
bool ForEachBlockRowLaunch(const Params& p, int64_t rows, uint32_t rows_per_cta, F&& f) {
  const int64_t kb = static_cast<int64_t>(p.num_heads) * (p.k.head_dim / kBlockSize);
  const int64_t vb = static_cast<int64_t>(p.num_heads) * (p.v.head_dim / kBlockSize);
  BlockRowLaunch<Params> a;
  a.p = p;
  a.items = static_cast<uint32_t>(kb + vb);
  a.k_blocks = static_cast<uint32_t>(kb);
  a.k_head_div = FastDivmod::Make(static_cast<uint32_t>(p.k.head_dim / kBlockSize));
  a.v_head_div = FastDivmod::Make(static_cast<uint32_t>(p.v.head_dim / kBlockSize));
  a.page_div = FastDivmod::Make(static_cast<uint32_t>(p.page_size));
  const uint32_t per_cta = rows_per_cta > 0 ? rows_per_cta : RowsPerCta(rows);
  for (int64_t r = 0; r < rows; r += kMaxLaunchItems) {
    a.row_begin = r;
    a.rows = rows - r < kMaxLaunchItems ? rows - r : kMaxLaunchItems;
    if (!MakeTileShape(kb + vb, a.rows, per_cta, &a.shape)) return false;
    f(a);
  }
  return true;
}

using AppendLaunch = BlockRowLaunch<internal::AppendParams>;

// The launches covering p's nnz rows.
template <typename F>
bool ForEachAppendLaunch(const internal::AppendParams& p, F&& f, uint32_t rows_per_cta = 0) {
  return ForEachBlockRowLaunch(p, p.nnz, rows_per_cta, static_cast<F&&>(f));
}

// internal::ResolveAppendRow with the division by page_size done by
// `page_div` when the slot or position is below 2^31 (always, in practice);
// larger values take the shared helper itself. Same result for every input.
FP4KV_HD bool ResolveRow(const internal::AppendParams& p, const FastDivmod& page_div, int64_t i,
                         int64_t* page, int* entry) {
  if (p.indexing == AppendIndexing::kSlot) {
    const int64_t slot = p.slot_mapping[i];
    if (slot < 0) return false;
    if (slot > 0x7fffffff) return internal::ResolveAppendRow(p, i, page, entry);
    uint32_t e;
    const int64_t pg = page_div.DivMod(static_cast<uint32_t>(slot), &e);
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

// Adds n to a 64-bit scale-event counter (atomically on the device).
FP4KV_HD void AddScaleEvents(uint64_t* counter, uint32_t n) {
#if defined(__CUDA_ARCH__)
  atomicAdd(reinterpret_cast<unsigned long long*>(counter), static_cast<unsigned long long>(n));
#else
  *counter += n;
#endif
}

// BlockAmax of the 16 f16/bf16 values in w (NaN ignored), as fp32.
template <bool kBf16>
FP4KV_HD float BlockAmaxOfWords(const uint32_t (&w)[8]) {
  float amax = 0.0f;
  FP4KV_UNROLL
  for (int j = 0; j < 8; ++j) {
    float lo, hi;
    Unpack2<kBf16>(w[j], &lo, &hi);
    lo = Abs(lo);
    hi = Abs(hi);
    amax = lo > amax ? lo : amax;
    amax = hi > amax ? hi : amax;
  }
  return amax;
}

// kCount: the thread adds its saturated / underflowed blocks to
// p.scale_events once, at its end (format.h ClassifyBlockScale; for FP8 keys
// ClassifyFp8KeyBlock of the same 16 values).
// FP8 keys (p.fp8_keys): a K item quantizes its 16 values to 16 E4M3 bytes
// (QuantizeFp8KeyBlockFast, one 16-byte store) with r = fl(1 / g_k).
template <bool kBf16, RecipeVariant kVariant, bool kCount = false>
FP4KV_HD void AppendThread(const AppendLaunch& a, uint32_t cta_x, uint32_t cta_y, uint32_t tid) {
  const internal::AppendParams& p = a.p;
  const uint32_t item = cta_y * a.shape.threads + tid;
  if (item >= a.items) return;
  // This thread's block: K or V, head, block within the head row.
  const bool is_v = item >= a.k_blocks;
  uint32_t blk;
  const uint32_t head =
      is_v ? a.v_head_div.DivMod(item - a.k_blocks, &blk) : a.k_head_div.DivMod(item, &blk);
  const uint16_t* in = static_cast<const uint16_t*>(is_v ? p.value : p.key) +
                       head * (is_v ? p.value_head_stride : p.key_head_stride) +
                       static_cast<int64_t>(blk) * kBlockSize;
  const int64_t in_row = is_v ? p.value_row_stride : p.key_row_stride;
  const internal::PoolPtrs pool = SelectPool(p.k, p.v, is_v);
  // FP8 keys: this block's 16 values are 16 E4M3 bytes, no scale byte.
  const bool fp8 = !is_v && p.fp8_keys;
  uint8_t* const data = pool.data + head * pool.data_head + blk * (fp8 ? kBlockSize : kBlockBytes);
  uint8_t* const scales = fp8 ? nullptr : pool.scales + head * pool.scale_head + blk;
  // Global scale: read once per thread (a device pointer sees graph updates).
  const float g = is_v ? p.v_scale.Get() : p.k_scale.Get();
  const QuantScale qs = MakeQuantScale(g);
  const float fp8_r = fp8 ? Fp8KeyEncodeMultiplier(g) : 0.0f;
  // Rows of this CTA: [first, first + n) of the launch (32-bit: a launch has
  // fewer than 2^30 rows); pointers advance by a row per step.
  const uint32_t first = cta_x * a.shape.rows_per_cta;
  const uint32_t left = static_cast<uint32_t>(a.rows) - first;
  const uint32_t n = left < a.shape.rows_per_cta ? left : a.shape.rows_per_cta;
  const int64_t row0 = a.row_begin + first;
  const uint16_t* src = in + row0 * in_row;
  uint32_t saturated = 0, underflow = 0;
  for (uint32_t r0 = 0; r0 < n; r0 += kAppendUnroll) {
    uint32_t w[kAppendUnroll][8];
    // Input loads first: they do not depend on the rows' index chains.
    FP4KV_UNROLL
    for (int u = 0; u < kAppendUnroll; ++u) {
      if (r0 + u >= n) break;
      const U32x4 lo = LoadInput16(src);
      const U32x4 hi = LoadInput16(src + 8);
      src += in_row;
      w[u][0] = lo.x;
      w[u][1] = lo.y;
      w[u][2] = lo.z;
      w[u][3] = lo.w;
      w[u][4] = hi.x;
      w[u][5] = hi.y;
      w[u][6] = hi.z;
      w[u][7] = hi.w;
    }
    FP4KV_UNROLL
    for (int u = 0; u < kAppendUnroll; ++u) {
      if (r0 + u >= n) break;
      int64_t page;
      int entry;
      if (!ResolveRow(p, a.page_div, row0 + r0 + u, &page, &entry)) continue;
      if (fp8) {
        Store16(data + page * pool.data_page + entry * pool.data_entry,
                QuantizeFp8KeyBlockFast<kBf16>(w[u], fp8_r));
        if constexpr (kCount) {
          const ScaleEvent e = ClassifyFp8KeyBlock(BlockAmaxOfWords<kBf16>(w[u]), fp8_r);
          saturated += e == ScaleEvent::kSaturated ? 1u : 0u;
          underflow += e == ScaleEvent::kUnderflow ? 1u : 0u;
        }
        continue;
      }
      uint32_t packed[2];
      const uint8_t sb = QuantizeBlockFast<kBf16, kVariant>(w[u], qs, p.recipe, packed);
      Store8(data + page * pool.data_page + entry * pool.data_entry, U32x2{packed[0], packed[1]});
      scales[page * pool.scale_page + entry * pool.scale_entry] = sb;
      if constexpr (kCount) {
        const ScaleEvent e = ClassifyBlockScale(BlockAmaxOfWords<kBf16>(w[u]), qs.g, sb);
        saturated += e == ScaleEvent::kSaturated ? 1u : 0u;
        underflow += e == ScaleEvent::kUnderflow ? 1u : 0u;
      }
    }
  }
  if constexpr (kCount) {
    uint64_t* counters = p.scale_events + (is_v ? 2 : 0);
    if (saturated != 0) AddScaleEvents(counters, saturated);
    if (underflow != 0) AddScaleEvents(counters + 1, underflow);
  }
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_APPEND_CUH_
