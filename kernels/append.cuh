// Internal: quantize-append, per thread. A row is one appended token; its
// work items are the 16-value blocks of K then V over all heads, or (the
// append, AppendLaunch::pair) pairs of adjacent blocks of one head row when
// every head row has an even number of blocks and the pools' code rows are
// 16-byte aligned: the row's index chain (slot, page, entry, addresses) then
// serves 32 values and the codes leave as one 16-byte store. A thread owns
// one item (fixed head and block: offsets computed once) and quantizes it
// for the rows of its CTA, two rows at a time with both rows' loads issued
// first (pairs: one row at a time, the same bytes in flight). Consecutive
// threads take consecutive items, so a warp reads 1 KiB (pairs: 2 KiB) and
// writes 256 (512) contiguous packed bytes per row when heads are contiguous.
//
// The thread body is FP4KV_HD so tests/kernels_host_test.cc can run the whole
// grid on the CPU; append.cu wraps it in the kernel.
#ifndef FP4KV_KERNELS_APPEND_CUH_
#define FP4KV_KERNELS_APPEND_CUH_

#include <cstdint>
#include <cstring>

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
  bool pair = false;      // an item is two adjacent blocks of one head row
  uint32_t items = 0;     // items per row: H * (Dk + Dv) / 16 / (pair ? 2 : 1)
  uint32_t k_blocks = 0;  // the K items: H * Dk / 16 / (pair ? 2 : 1)
  FastDivmod k_head_div;  // K items per head
  FastDivmod v_head_div;  // V items per head
  FastDivmod page_div;    // page_size
};

// Calls f(launch) for each launch that covers `rows` rows of p (one unless
// rows >= 2^30). Returns false when a row has too many blocks for one grid.
template <typename Params, typename F>
bool ForEachBlockRowLaunch(const Params& p, int64_t rows, uint32_t rows_per_cta, F&& f,
                           bool pair = false) {
  const int per = pair ? 2 : 1;
  const int64_t k_per_head = p.k.head_dim / kBlockSize / per;
  const int64_t v_per_head = p.v.head_dim / kBlockSize / per;
  const int64_t kb = static_cast<int64_t>(p.num_heads) * k_per_head;
  const int64_t vb = static_cast<int64_t>(p.num_heads) * v_per_head;
  BlockRowLaunch<Params> a;
  a.p = p;
  a.pair = pair;
  a.items = static_cast<uint32_t>(kb + vb);
  a.k_blocks = static_cast<uint32_t>(kb);
  a.k_head_div = FastDivmod::Make(static_cast<uint32_t>(k_per_head));
  a.v_head_div = FastDivmod::Make(static_cast<uint32_t>(v_per_head));
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

// Whether a pool's code rows start on 16-byte boundaries (base and the
// page, entry and head strides).
FP4KV_HD bool CodeRows16(const internal::PoolPtrs& pool) {
  return ((reinterpret_cast<uintptr_t>(pool.data) | static_cast<uint64_t>(pool.data_page) |
           static_cast<uint64_t>(pool.data_entry) | static_cast<uint64_t>(pool.data_head)) &
          15u) == 0;
}

// Whether a pool's scale rows start on even bytes (a pair's two scale bytes
// then leave as one 16-bit store). A pool without scales (FP8 keys) passes.
FP4KV_HD bool ScaleRows2(const internal::PoolPtrs& pool) {
  return ((reinterpret_cast<uintptr_t>(pool.scales) | static_cast<uint64_t>(pool.scale_page) |
           static_cast<uint64_t>(pool.scale_entry) | static_cast<uint64_t>(pool.scale_head)) &
          1u) == 0;
}

// A pair's two scale bytes (the first block's at the lower address), as one
// 16-bit store; ScaleRows2 holds and the first block's index is even.
FP4KV_HD void StoreScalePair(uint8_t* dst, const uint8_t (&sb)[2]) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(sb[0] | (sb[1] << 8));
#else
  std::memcpy(dst, sb, 2);
#endif
}

// Whether p's geometry lets items be pairs of adjacent blocks (the append's
// and the whole-cache quantize's params alike): every head row an even
// number of blocks, code rows 16-byte aligned, scale rows 2-byte aligned.
template <typename Params>
bool BlockPairsFit(const Params& p) {
  return (p.k.head_dim / kBlockSize) % 2 == 0 && (p.v.head_dim / kBlockSize) % 2 == 0 &&
         CodeRows16(p.k) && CodeRows16(p.v) && ScaleRows2(p.k) && ScaleRows2(p.v);
}

// kAuto: pairs where the geometry allows them and the keys are NVFP4. On an
// H200 (65536 rows, 8 heads, d128) pairs took NVFP4 appends from 78% to 86%
// of copy (NHD slots; paged 73% to 84%) but FP8-key appends from 91% to 88%:
// an FP8 key block is already one 16-byte store, and a pair halves the rows
// a thread has in flight. kNever / kWherePossible: the tests run both forms
// for every case.
enum class AppendPairPolicy { kAuto, kNever, kWherePossible };

template <typename Params>
bool UseBlockPairs(const Params& p, AppendPairPolicy pairs) {
  return pairs != AppendPairPolicy::kNever && BlockPairsFit(p) &&
         (pairs == AppendPairPolicy::kWherePossible || !p.fp8_keys);
}

// The launches covering p's nnz rows.
template <typename F>
bool ForEachAppendLaunch(const internal::AppendParams& p, F&& f, uint32_t rows_per_cta = 0,
                         AppendPairPolicy pairs = AppendPairPolicy::kAuto) {
  return ForEachBlockRowLaunch(p, p.nnz, rows_per_cta, static_cast<F&&>(f),
                               UseBlockPairs(p, pairs));
}

// Stores one NVFP4 item's codes and scale bytes at its row: one block (8
// code bytes, one scale byte) or a pair (16 code bytes in one store, the two
// scale bytes in one 16-bit store).
template <int kB>
FP4KV_HD void StoreNvfp4Item(uint8_t* data, uint8_t* scales, const uint32_t (&packed)[kB][2],
                             const uint8_t (&sb)[kB]) {
  static_assert(kB == 1 || kB == 2, "one block or a pair");
  if constexpr (kB == 2) {
    Store16(data, U32x4{packed[0][0], packed[0][1], packed[1][0], packed[1][1]});
    StoreScalePair(scales, sb);
  } else {
    Store8(data, U32x2{packed[0][0], packed[0][1]});
    scales[0] = sb[0];
  }
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
// FP8 keys (p.fp8_keys): a K block quantizes its 16 values to 16 E4M3 bytes
// (QuantizeFp8KeyBlockFast, one 16-byte store) with r = fl(1 / g_k).
// kPair: the item is blocks blk and blk + 1 of its head row (a.pair).
template <bool kBf16, RecipeVariant kVariant, bool kCount, bool kPair>
FP4KV_HD void AppendThreadT(const AppendLaunch& a, uint32_t cta_x, uint32_t cta_y, uint32_t tid) {
  constexpr int kB = kPair ? 2 : 1;  // blocks per item
  // Rows a step: pairs hold two blocks of input a row, so one row a step
  // keeps the registers (and the bytes in flight) of two single-block rows.
  constexpr int kU = kPair ? 1 : kAppendUnroll;
  const internal::AppendParams& p = a.p;
  const uint32_t item = cta_y * a.shape.threads + tid;
  if (item >= a.items) return;
  // This thread's block(s): K or V, head, first block within the head row.
  const bool is_v = item >= a.k_blocks;
  uint32_t bi;
  const uint32_t head =
      is_v ? a.v_head_div.DivMod(item - a.k_blocks, &bi) : a.k_head_div.DivMod(item, &bi);
  const uint32_t blk = bi * kB;
  const uint16_t* in = static_cast<const uint16_t*>(is_v ? p.value : p.key) +
                       head * (is_v ? p.value_head_stride : p.key_head_stride) +
                       static_cast<int64_t>(blk) * kBlockSize;
  const int64_t in_row = is_v ? p.value_row_stride : p.key_row_stride;
  const internal::PoolPtrs pool = SelectPool(p.k, p.v, is_v);
  // FP8 keys: a block's 16 values are 16 E4M3 bytes, no scale byte.
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
  for (uint32_t r0 = 0; r0 < n; r0 += kU) {
    uint32_t w[kU][kB][8];
    // Input loads first: they do not depend on the rows' index chains.
    FP4KV_UNROLL
    for (int u = 0; u < kU; ++u) {
      if (r0 + u >= n) break;
      FP4KV_UNROLL
      for (int k = 0; k < kB; ++k) {
        const U32x4 lo = LoadInput16(src + k * kBlockSize);
        const U32x4 hi = LoadInput16(src + k * kBlockSize + 8);
        w[u][k][0] = lo.x;
        w[u][k][1] = lo.y;
        w[u][k][2] = lo.z;
        w[u][k][3] = lo.w;
        w[u][k][4] = hi.x;
        w[u][k][5] = hi.y;
        w[u][k][6] = hi.z;
        w[u][k][7] = hi.w;
      }
      src += in_row;
    }
    FP4KV_UNROLL
    for (int u = 0; u < kU; ++u) {
      if (r0 + u >= n) break;
      int64_t page;
      int entry;
      if (!ResolveRow(p, a.page_div, row0 + r0 + u, &page, &entry)) continue;
      uint8_t* const dst = data + page * pool.data_page + entry * pool.data_entry;
      if (fp8) {
        FP4KV_UNROLL
        for (int k = 0; k < kB; ++k) {
          Store16(dst + k * kBlockSize, QuantizeFp8KeyBlockFast<kBf16>(w[u][k], fp8_r));
          if constexpr (kCount) {
            const ScaleEvent e = ClassifyFp8KeyBlock(BlockAmaxOfWords<kBf16>(w[u][k]), fp8_r);
            saturated += e == ScaleEvent::kSaturated ? 1u : 0u;
            underflow += e == ScaleEvent::kUnderflow ? 1u : 0u;
          }
        }
        continue;
      }
      uint32_t packed[kB][2];
      uint8_t sb[kB];
      FP4KV_UNROLL
      for (int k = 0; k < kB; ++k) {
        sb[k] = QuantizeBlockFast<kBf16, kVariant>(w[u][k], qs, p.recipe, packed[k]);
        if constexpr (kCount) {
          const ScaleEvent e = ClassifyBlockScale(BlockAmaxOfWords<kBf16>(w[u][k]), qs.g, sb[k]);
          saturated += e == ScaleEvent::kSaturated ? 1u : 0u;
          underflow += e == ScaleEvent::kUnderflow ? 1u : 0u;
        }
      }
      StoreNvfp4Item<kB>(dst, scales + page * pool.scale_page + entry * pool.scale_entry, packed,
                         sb);
    }
  }
  if constexpr (kCount) {
    uint64_t* counters = p.scale_events + (is_v ? 2 : 0);
    if (saturated != 0) AddScaleEvents(counters, saturated);
    if (underflow != 0) AddScaleEvents(counters + 1, underflow);
  }
}

template <bool kBf16, RecipeVariant kVariant, bool kCount = false>
FP4KV_HD void AppendThread(const AppendLaunch& a, uint32_t cta_x, uint32_t cta_y, uint32_t tid) {
  if (a.pair) {
    AppendThreadT<kBf16, kVariant, kCount, true>(a, cta_x, cta_y, tid);
  } else {
    AppendThreadT<kBf16, kVariant, kCount, false>(a, cta_x, cta_y, tid);
  }
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_APPEND_CUH_
