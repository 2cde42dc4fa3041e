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

namespace {

// a + b, a * b saturating at INT64_MAX (sizes that large never fit anyway).
int64_t SatAdd(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? INT64_MAX : r;
}
int64_t SatMul(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}

}  // namespace

absl::StatusOr<Capacity> PlanCapacity(const CapacityInput& in) {
  const CacheGeometry& g = in.geometry;
  const bool cuda = in.device.is_cuda();
  const int64_t L = in.num_layers;
  const int64_t S = in.max_seqs_per_step;
  // Per page: the pools of every layer (device), the bookkeeping (host:
  // PagePool, copy-on-write claims, with prefix caching the token ids).
  const int64_t pool_per_page = SatMul(g.PageBytes(), L);
  int64_t book_per_page = PagePool::BookkeepingBytes(1, in.prefix_cache) + 4;
  if (in.prefix_cache) book_per_page = SatAdd(book_per_page, SatMul(4, g.page_size));
  if (in.events) book_per_page = SatAdd(book_per_page, KVEventQueue::kReserveBytesPerPage);
  // The promotion serial of every page (CUDA, host tier of the prefix cache).
  if (cuda && in.prefix_host_pages > 0) book_per_page = SatAdd(book_per_page, 8);
  // Fixed: region alignment, the step buffers (device), the host tables of a
  // step and of the layers, the pinned staging (CUDA), the host tier.
  const StepLayout sl = ComputeStepLayout(S, in.max_tokens_per_step, in.max_pages_per_seq,
                                          in.num_layers);
  // Step slots past the first: their step buffers and staging each.
  const int64_t extra_slots = in.step_slots - 1;
  const int64_t dev_fixed =
      SatAdd(SatAdd(SatMul(4 * kRegionAlign, L), sl.device_bytes + kHostAlign),
             SatMul(extra_slots, sl.scales + kHostAlign));
  int64_t host_fixed = SatAdd(SatAdd(SatMul(SatMul(S, in.step_slots), sizeof(StepState::Row) + 4),
                                     SatMul(S, sizeof(void*) + 8)),
                              SatMul(L, 64));
  if (cuda) host_fixed = SatAdd(host_fixed, SatMul(in.step_slots, sl.staging_bytes + kHostAlign));
  // The pinned ring of late token ids (prefix caching on CUDA).
  if (cuda && in.prefix_cache) {
    host_fixed = SatAdd(host_fixed, SatMul(8 * (in.step_slots + 1), in.max_tokens_per_step));
  }
  if (in.prefix_host_pages > 0) {
    const int64_t per_page = SatAdd(SatAdd(pool_per_page, 128), SatMul(4, g.page_size));
    host_fixed = SatAdd(host_fixed, SatAdd(SatMul(in.prefix_host_pages, per_page),
                                           SatMul(4 * kRegionAlign, L)));
  }
  if (in.host_pages > 0) {
    host_fixed = SatAdd(host_fixed, SatAdd(SatMul(in.host_pages, SatAdd(pool_per_page, 4)),
                                           SatMul(4 * kRegionAlign, L)));
  }

  int64_t dev_avail = 0;
  const int64_t host_avail = HostMemoryAvailable();
  if (cuda) {
    size_t free_bytes = 0, total_bytes = 0;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    dev_avail = free_bytes > static_cast<size_t>(INT64_MAX) ? INT64_MAX
                                                            : static_cast<int64_t>(free_bytes);
  } else {
    dev_avail = host_avail;
  }
  const std::string where = cuda ? in.device.ToString() : std::string("host");

  Capacity c;
  c.available = dev_avail;
  c.num_pages = g.num_pages;
  if (in.budget > 0) {
    // The pages the budget buys, limited to what fits in all but
    // 1/kReserveDivisor of the available memory after the fixed parts.
    int64_t room = dev_avail - dev_avail / kReserveDivisor - dev_fixed;
    int64_t per_page = pool_per_page;
    if (!cuda) {
      room -= host_fixed;
      per_page = SatAdd(per_page, book_per_page);
    }
    int64_t fit = room > 0 ? room / per_page : 0;
    if (cuda) {
      const int64_t host_room = host_avail - host_avail / kReserveDivisor - host_fixed;
      fit = std::min(fit, host_room > 0 ? host_room / book_per_page : 0);
    }
    if (fit < c.num_pages) {
      c.num_pages = fit;
      c.clamped = true;
    }
    if (c.num_pages < 1) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "KVCache::Create: memory_budget_bytes ", in.budget, " buys not even one page: ", where,
          " has ", dev_avail, " bytes available, of which a budget may take all but 1/",
          kReserveDivisor, " less ", SatAdd(dev_fixed, cuda ? 0 : host_fixed),
          " bytes of step buffers and tables; a page of every layer takes ",
          SatAdd(pool_per_page, cuda ? 0 : book_per_page), " bytes"));
    }
  }
  // Everything, at the final page count, within what is available.
  const int64_t pool_bytes = SatMul(c.num_pages, pool_per_page);
  const int64_t book_bytes = SatMul(c.num_pages, book_per_page);
  const int64_t dev_need =
      SatAdd(SatAdd(pool_bytes, dev_fixed), cuda ? 0 : SatAdd(book_bytes, host_fixed));
  if (dev_need > dev_avail) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KVCache::Create: needs ", dev_need, " bytes of ", where, " memory (pools ", pool_bytes,
        " for ", c.num_pages, " pages, step buffers ", sl.device_bytes,
        cuda ? "" : absl::StrCat(", bookkeeping ", book_bytes, ", tables, staging and host tier ",
                                 host_fixed),
        "), ", dev_avail, " available"));
  }
  if (cuda) {
    const int64_t host_need = SatAdd(book_bytes, host_fixed);
    if (host_need > host_avail) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "KVCache::Create: needs ", host_need, " bytes of host memory (bookkeeping ", book_bytes,
          " for ", c.num_pages, " pages, tables, pinned staging and host tier ", host_fixed,
          "), ", host_avail, " available"));
    }
  }
  return c;
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
