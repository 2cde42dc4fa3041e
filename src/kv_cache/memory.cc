// KVCache memory: pool and step layouts, page copies inside the pool, the
// layer views.
#include "src/kv_cache/memory.h"

#include <algorithm>

#include "src/kv_cache/state.h"

namespace fp4kv {
namespace internal {

bool ComputePoolLayout(const CacheGeometry& g, int num_layers, PoolLayout* out) {
  int64_t rows = 0;
  if (__builtin_mul_overflow(static_cast<int64_t>(g.page_size), int64_t{g.num_kv_heads}, &rows)) {
    return false;
  }
  const int64_t row_bytes[4] = {g.DataRowBytes(false), g.DataRowBytes(true), g.ScaleRowBytes(false),
                                g.ScaleRowBytes(true)};
  PoolLayout l;
  int64_t off = 0;
  for (int r = 0; r < 4; ++r) {
    int64_t page = 0, region = 0;
    if (__builtin_mul_overflow(rows, row_bytes[r], &page) ||
        __builtin_mul_overflow(page, g.num_pages, &region) || region > INT64_MAX - kRegionAlign) {
      return false;
    }
    l.regions[r] = Region{off, page};
    if (__builtin_add_overflow(off, RoundUp(region, kRegionAlign), &off)) return false;
  }
  l.layer_bytes = off;
  if (__builtin_mul_overflow(off, int64_t{num_layers}, &l.total_bytes)) return false;
  *out = l;
  return true;
}

StepLayout ComputeStepLayout(int64_t seqs, int64_t tokens, int64_t pages_per_seq, int layers) {
  StepLayout s;
  s.seq_lens = 0;
  s.kv_indptr = s.seq_lens + 4 * seqs;
  s.token_indptr = s.kv_indptr + 4 * (seqs + 1);
  s.slots = RoundUp(s.token_indptr + 4 * (seqs + 1), 16);
  s.tables = RoundUp(s.slots + 8 * tokens, kRegionAlign);
  s.staging_bytes = s.tables + 4 * seqs * pages_per_seq;
  s.fp8_tables = RoundUp(s.staging_bytes, kRegionAlign);
  s.scales = RoundUp(s.fp8_tables + 4 * seqs * pages_per_seq, kRegionAlign);
  const int64_t L = layers;
  s.flags = RoundUp(s.scales + 4 * 4 * L, 16);
  s.calib = RoundUp(s.flags + 4 * 2 * L, 16);
  s.events = RoundUp(s.calib + 4 * 4 * L, 16);
  s.old_scales = RoundUp(s.events + 8 * 4 * L, 16);
  s.readback = RoundUp(s.old_scales + 4 * 2 * L, 16);
  s.xfer_ids = RoundUp(s.readback + 4 * (pages_per_seq + 1), 16);
  s.swap_ids = RoundUp(s.xfer_ids + 4 * pages_per_seq, 16);
  s.import_scales = RoundUp(s.swap_ids + 4 * 2 * pages_per_seq, 16);
  s.adopt_mask = RoundUp(s.import_scales + 24 * L, 16);
  s.device_bytes = s.adopt_mask + 2 * L;
  return s;
}

int64_t MostPagesWithin(const CacheGeometry& g, int num_layers, int64_t budget,
                        internal::PoolLayout* layout) {
  int64_t per_page = 0;
  if (__builtin_mul_overflow(g.PageBytes(), int64_t{num_layers}, &per_page)) per_page = INT64_MAX;
  int64_t p = std::min<int64_t>(budget / per_page, INT32_MAX);
  for (; p >= 1; --p) {
    CacheGeometry t = g;
    t.num_pages = p;
    if (internal::ComputePoolLayout(t, num_layers, layout) && layout->total_bytes <= budget) break;
  }
  return std::max<int64_t>(p, 0);
}

PagedCache KVCacheState::LayerCache(int layer) const {
  const CacheGeometry& g = geometry;
  uint8_t* base = mem.pools.get() + layer * mem.pool.layer_bytes;
  const bool nhd = g.layout == Layout::kNHD;
  const int64_t a = nhd ? g.page_size : g.num_kv_heads;
  const int64_t b = nhd ? g.num_kv_heads : g.page_size;
  auto view = [&](int r, DType t, int64_t inner) {
    return TensorView::Contiguous(base + mem.pool.regions[r].offset, t, {g.num_pages, a, b, inner},
                                  options.device);
  };
  if (g.fp8_keys()) {
    return PagedCache::Fp8Keys(view(0, DType::kE4M3, g.head_dim_k),
                               view(1, DType::kU8, g.head_dim_v / 2),
                               view(3, DType::kE4M3, g.head_dim_v / kBlockSize), g.layout);
  }
  return PagedCache::FromTuple(view(0, DType::kU8, g.head_dim_k / 2),
                               view(1, DType::kU8, g.head_dim_v / 2),
                               view(2, DType::kE4M3, g.head_dim_k / kBlockSize),
                               view(3, DType::kE4M3, g.head_dim_v / kBlockSize), g.layout);
}

absl::Status KVCacheState::CopyPage(int32_t src, int32_t dst, Stream stream) {
  for (const Region& r : mem.pool.regions) {
    if (r.page_bytes == 0) continue;  // no key scales (FP8 keys)
    uint8_t* from = mem.pools.get() + r.offset + src * r.page_bytes;
    uint8_t* to = mem.pools.get() + r.offset + dst * r.page_bytes;
    if (!cuda) {
      for (int l = 0; l < options.num_layers; ++l) {
        std::memcpy(to + l * mem.pool.layer_bytes, from + l * mem.pool.layer_bytes, r.page_bytes);
      }
    } else if (mem.pool.layer_bytes <= INT32_MAX) {
      FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
          to, mem.pool.layer_bytes, from, mem.pool.layer_bytes, r.page_bytes, options.num_layers,
          cudaMemcpyDeviceToDevice, reinterpret_cast<cudaStream_t>(stream)));
    } else {  // pitch beyond what a 2-D copy accepts
      for (int l = 0; l < options.num_layers; ++l) {
        FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
            to + l * mem.pool.layer_bytes, from + l * mem.pool.layer_bytes, r.page_bytes,
            cudaMemcpyDeviceToDevice, reinterpret_cast<cudaStream_t>(stream)));
      }
    }
  }
  return absl::OkStatus();
}

int64_t KVCacheState::PageBytesAllLayers() const {
  return geometry.PageBytes() * options.num_layers;
}
}  // namespace internal
}  // namespace fp4kv
