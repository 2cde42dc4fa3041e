// A pool of host pages with a free stack (host_pool.h).
#include "src/kv_cache/host_pool.h"

#include <cuda_runtime_api.h>

#include "src/status_macros.h"

namespace fp4kv {
namespace internal {

absl::Status HostPagePool::Init(const PoolLayout& layout, int64_t pages, bool cuda,
                                const char* what) {
  pages_total_ = pages;
  layout_ = layout;
  FP4KV_RETURN_IF_ERROR(pool_.Allocate(cuda ? Memory::Kind::kPinnedMapped : Memory::Kind::kHost,
                                       layout.total_bytes, what));
  pool_dev_ = pool_.get();
  if (cuda) {
    void* dev_ptr = nullptr;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&dev_ptr, pool_.get(), 0));
    pool_dev_ = static_cast<uint8_t*>(dev_ptr);
  }
  FP4KV_RETURN_IF_ERROR(
      SizeHost(&free_, pages, int32_t{0}, "KVCache::Create", "a host pool's free page stack"));
  // Popped from the back: pages are handed out in increasing order.
  for (int64_t i = 0; i < pages; ++i) free_[i] = static_cast<int32_t>(pages - 1 - i);
  return absl::OkStatus();
}

int32_t HostPagePool::Take() {
  const int32_t h = free_.back();
  free_.pop_back();
  return h;
}

void HostPagePool::Peek(int64_t n, int32_t* out) const {
  for (int64_t i = 0; i < n; ++i) out[i] = free_[free_.size() - 1 - static_cast<size_t>(i)];
}

void HostPagePool::Drop(int64_t n) { free_.resize(free_.size() - static_cast<size_t>(n)); }

}  // namespace internal
}  // namespace fp4kv
