// Internal: linear (non-paged) quantize and dequantize, per thread. One work
// item is one 16-value block of one row.
#ifndef FP4KV_KERNELS_LINEAR_CUH_
#define FP4KV_KERNELS_LINEAR_CUH_

#include <cstdint>

#include "kernels/device_util.cuh"
#include "kernels/fast_format.cuh"
#include "src/params.h"

namespace fp4kv {
namespace kernels {

inline constexpr int kLinearThreads = 128;
inline constexpr int kLinearItems = 2;
inline constexpr uint32_t kLinearItemsPerCta = kLinearThreads * kLinearItems;

// One launch: rows [row_begin, row_begin + num_items / blocks per row).
struct LinearRange {
  int64_t row_begin = 0;
  uint32_t num_items = 0;
  FastDivmod row_div;  // items per row
};

// Calls f(range, grid) for each launch over `rows` rows of `cols` values,
// with `item_values` values per work item and `items_per_cta` items per CTA.
template <typename F>
bool ForEachLinearLaunch(int64_t rows, int64_t cols, int item_values, uint32_t items_per_cta,
                         F&& f) {
  const int64_t per_row = cols / item_values;
  if (per_row <= 0 || per_row > kMaxLaunchItems) return false;
  LinearRange r;
  r.row_div = FastDivmod::Make(static_cast<uint32_t>(per_row));
  const int64_t rows_per_launch = kMaxLaunchItems / per_row;
  for (int64_t begin = 0; begin < rows; begin += rows_per_launch) {
    const int64_t n = rows - begin < rows_per_launch ? rows - begin : rows_per_launch;
    r.row_begin = begin;
    r.num_items = static_cast<uint32_t>(n * per_row);
    f(r, (r.num_items + items_per_cta - 1) / items_per_cta);
  }
  return true;
}

template <bool kBf16, RecipeVariant kVariant>
FP4KV_HD void QuantizeLinearThread(const internal::LinearQuantParams& p, const LinearRange& range,
                                   uint32_t cta, uint32_t tid) {
  uint32_t w[kLinearItems][8];
  int64_t row[kLinearItems] = {};
  uint32_t blk[kLinearItems] = {};
  bool valid[kLinearItems] = {};
  FP4KV_UNROLL
  for (int it = 0; it < kLinearItems; ++it) {
    const uint32_t q = cta * kLinearItemsPerCta + it * kLinearThreads + tid;
    valid[it] = q < range.num_items;
    if (!valid[it]) continue;
    row[it] = range.row_begin + range.row_div.DivMod(q, &blk[it]);
    const uint16_t* src = static_cast<const uint16_t*>(p.input) + row[it] * p.input_row_stride +
                          static_cast<int64_t>(blk[it]) * kBlockSize;
    const U32x4 lo = LoadInput16(src);
    const U32x4 hi = LoadInput16(src + 8);
    w[it][0] = lo.x;
    w[it][1] = lo.y;
    w[it][2] = lo.z;
    w[it][3] = lo.w;
    w[it][4] = hi.x;
    w[it][5] = hi.y;
    w[it][6] = hi.z;
    w[it][7] = hi.w;
  }
  const QuantScale qs = MakeQuantScale(p.scale.Get());
  FP4KV_UNROLL
  for (int it = 0; it < kLinearItems; ++it) {
    if (!valid[it]) continue;
    uint32_t packed[2];
    const uint8_t sb = QuantizeBlockFast<kBf16, kVariant>(w[it], qs, p.recipe, packed);
    Store8(p.packed + row[it] * p.packed_row_stride + blk[it] * kBlockBytes,
           U32x2{packed[0], packed[1]});
    p.scales[row[it] * p.scale_row_stride + blk[it]] = sb;
  }
}

// Dequantize: one work item is one block (16 values), decoded through the
// block's table of rounded magnitudes (DequantizeBlockFast: the products are
// rounded once per magnitude, not once per value); the block's 32 output
// bytes leave through WarpStagedStore16, so that each store instruction of a
// warp writes 512 contiguous bytes.
inline constexpr int kLinearDequantItems = 4;
inline constexpr int kLinearDequantItemValues = kBlockSize;
inline constexpr uint32_t kLinearDequantItemsPerCta = kLinearThreads * kLinearDequantItems;

template <bool kBf16>
FP4KV_HD void DequantizeLinearThread(const internal::LinearDequantParams& p,
                                     const LinearRange& range, uint32_t cta, uint32_t tid) {
  U32x2 codes[kLinearDequantItems] = {};
  uint8_t sb[kLinearDequantItems] = {};
  int64_t row[kLinearDequantItems] = {};
  uint32_t blk[kLinearDequantItems] = {};
  bool valid[kLinearDequantItems] = {};
  FP4KV_UNROLL
  for (int it = 0; it < kLinearDequantItems; ++it) {
    const uint32_t q = cta * kLinearDequantItemsPerCta + it * kLinearThreads + tid;
    valid[it] = q < range.num_items;
    if (!valid[it]) continue;
    row[it] = range.row_begin + range.row_div.DivMod(q, &blk[it]);
    codes[it] = LoadReadOnly8(p.packed + row[it] * p.packed_row_stride + blk[it] * kBlockBytes);
    sb[it] = LoadReadOnly1(p.scales + row[it] * p.scale_row_stride + blk[it]);
  }
  const float g = p.scale.Get();
  const bool g_finite = IsFiniteBits(FloatBits(g));
  // Every lane reaches every store (the staging is warp-wide).
  FP4KV_UNROLL
  for (int it = 0; it < kLinearDequantItems; ++it) {
    U32x4 out[2] = {};
    if (valid[it]) {
      const Words8Out v = DequantizeBlockFast<kBf16>(codes[it], sb[it], g, g_finite);
      out[0] = v.lo;
      out[1] = v.hi;
    }
    uint16_t* const dst = static_cast<uint16_t*>(p.output) + row[it] * p.output_row_stride +
                          static_cast<int64_t>(blk[it]) * kBlockSize;
    WarpStagedStore16<2>(reinterpret_cast<uint8_t*>(dst), valid[it], out);
  }
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_LINEAR_CUH_
