#include "testing/host_cache.h"

#include <cstring>

namespace fp4kv {
namespace testing {

HostCache::HostCache(const CacheGeometry& g, bool stacked, uint8_t fill) : g_(g) {
  const int64_t rows = g.num_pages * g.page_size * g.num_kv_heads;
  const int64_t a = g.layout == Layout::kNHD ? g.page_size : g.num_kv_heads;
  const int64_t b = g.layout == Layout::kNHD ? g.num_kv_heads : g.page_size;
  if (stacked) {
    // [P, 2, a, b, D/2]; stacked requires equal head dims.
    const int64_t d2 = g.head_dim_k / 2, d16 = g.head_dim_k / 16;
    data_[0].assign(2 * rows * d2, fill);
    scales_[0].assign(2 * rows * d16, fill);
    TensorView data = TensorView::Contiguous(data_[0].data(), DType::kU8, {g.num_pages, 2, a, b, d2});
    TensorView scales =
        TensorView::Contiguous(scales_[0].data(), DType::kE4M3, {g.num_pages, 2, a, b, d16});
    cache_ = *PagedCache::FromStacked(data, scales, g.layout);
    return;
  }
  if (g.fp8_keys()) {  // E4M3 key rows of Dk bytes, no key scales
    data_[0].assign(rows * g.head_dim_k, fill);
    data_[1].assign(rows * g.head_dim_v / 2, fill);
    scales_[1].assign(rows * g.head_dim_v / 16, fill);
    cache_ = PagedCache::Fp8Keys(
        TensorView::Contiguous(data_[0].data(), DType::kE4M3, {g.num_pages, a, b, g.head_dim_k}),
        TensorView::Contiguous(data_[1].data(), DType::kU8, {g.num_pages, a, b, g.head_dim_v / 2}),
        TensorView::Contiguous(scales_[1].data(), DType::kE4M3,
                               {g.num_pages, a, b, g.head_dim_v / 16}),
        g.layout);
    return;
  }
  for (int kv = 0; kv < 2; ++kv) {
    const int64_t d = kv == 0 ? g.head_dim_k : g.head_dim_v;
    data_[kv].assign(rows * d / 2, fill);
    scales_[kv].assign(rows * d / 16, fill);
  }
  cache_ = PagedCache::FromTuple(
      TensorView::Contiguous(data_[0].data(), DType::kU8, {g.num_pages, a, b, g.head_dim_k / 2}),
      TensorView::Contiguous(data_[1].data(), DType::kU8, {g.num_pages, a, b, g.head_dim_v / 2}),
      TensorView::Contiguous(scales_[0].data(), DType::kE4M3, {g.num_pages, a, b, g.head_dim_k / 16}),
      TensorView::Contiguous(scales_[1].data(), DType::kE4M3, {g.num_pages, a, b, g.head_dim_v / 16}),
      g.layout);
}

std::vector<uint8_t> HostCache::Snapshot() const {
  std::vector<uint8_t> out;
  for (int kv = 0; kv < 2; ++kv) {
    out.insert(out.end(), data_[kv].begin(), data_[kv].end());
    out.insert(out.end(), scales_[kv].begin(), scales_[kv].end());
  }
  return out;
}

std::vector<uint8_t> HostCache::Row(bool is_v, int64_t page, int64_t entry, int64_t head) const {
  const TensorView& d = is_v ? cache_.v_data : cache_.k_data;
  const TensorView& s = is_v ? cache_.v_scales : cache_.k_scales;
  const int e = g_.layout == Layout::kNHD ? 1 : 2;
  const int h = g_.layout == Layout::kNHD ? 2 : 1;
  const uint8_t* dp = static_cast<const uint8_t*>(d.data) + page * d.strides[0] +
                      entry * d.strides[e] + head * d.strides[h];
  std::vector<uint8_t> out(dp, dp + d.shape[3]);
  if (s.data == nullptr) return out;  // FP8 keys: no scales
  const uint8_t* sp = static_cast<const uint8_t*>(s.data) + page * s.strides[0] +
                      entry * s.strides[e] + head * s.strides[h];
  out.insert(out.end(), sp, sp + s.shape[3]);
  return out;
}

}  // namespace testing
}  // namespace fp4kv
