// Internal (KVCache): a pool of host pages, pinned and mapped on CUDA, laid
// out like the device pools ([L][K data, V data, K scales, V scales][host
// page]), with a stack of free pages. The swap tier and the host tier of the
// prefix cache each hold one; what they cache in it is theirs, which page is
// free is the pool's.
#ifndef FP4KV_SRC_KV_CACHE_HOST_POOL_H_
#define FP4KV_SRC_KV_CACHE_HOST_POOL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "src/host_alloc.h"
#include "src/kv_cache/memory.h"

namespace fp4kv {
namespace internal {

class HostPagePool {
 public:
  // Allocates `pages` pages of `layout` (pinned and mapped when `cuda`, on
  // the current device), all free; `what` names the pool in errors.
  absl::Status Init(const PoolLayout& layout, int64_t pages, bool cuda, const char* what);

  int64_t pages_total() const { return pages_total_; }
  int64_t free_count() const { return static_cast<int64_t>(free_.size()); }
  const PoolLayout& layout() const { return layout_; }
  // The pool's address as the device sees it (CUDA) or the pool itself.
  uint8_t* device_base() const { return pool_dev_; }
  // The free pages, the next one taken last.
  absl::Span<const int32_t> free_pages() const { return {free_.data(), free_.size()}; }

  // The next free page (free_count() > 0), in increasing order from a full
  // pool; Take removes it.
  int32_t Next() const { return free_.back(); }
  int32_t Take();
  // The next n free pages in the order Take would give them (n <=
  // free_count()), and removing them.
  void Peek(int64_t n, int32_t* out) const;
  void Drop(int64_t n);
  void Give(int32_t page) { free_.push_back(page); }

 private:
  int64_t pages_total_ = 0;
  PoolLayout layout_;
  Memory pool_;
  uint8_t* pool_dev_ = nullptr;
  HostVector<int32_t> free_;  // stack
};

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_KV_CACHE_HOST_POOL_H_
