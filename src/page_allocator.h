// Internal: reference-counted page allocator of a KVCache.
//
// Invariants: a page is either on the free stack with reference count 0, or
// off it with a count >= 1; free_count() + used pages == num_pages(). Every
// operation is O(1) and allocates nothing after construction. Not
// thread-safe.
#ifndef FP4KV_SRC_PAGE_ALLOCATOR_H_
#define FP4KV_SRC_PAGE_ALLOCATOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace fp4kv {
namespace internal {

class PageAllocator {
 public:
  // Pages 0 .. num_pages-1, all free; Allocate() hands them out in increasing
  // order first, then most recently freed first.
  explicit PageAllocator(int32_t num_pages);

  int32_t num_pages() const { return static_cast<int32_t>(ref_.size()); }
  int32_t free_count() const { return free_top_; }
  int32_t used_count() const { return num_pages() - free_top_; }

  // Takes a free page and gives it reference count 1. Precondition:
  // free_count() > 0 (callers reserve first: all-or-nothing steps).
  int32_t Allocate() {
    const int32_t page = free_[--free_top_];
    ref_[page] = 1;
    return page;
  }
  // Adds a reference to a used page.
  void Retain(int32_t page) { ++ref_[page]; }
  // Drops a reference; a page whose count reaches 0 goes back on the free
  // stack. Returns true when it did. Precondition: the page is used.
  bool Release(int32_t page) {
    if (--ref_[page] != 0) return false;
    free_[free_top_++] = page;
    return true;
  }
  int32_t RefCount(int32_t page) const { return ref_[page]; }

  // Checks the invariants in O(num_pages) (for tests): every page exactly
  // once either free with count 0 or used with count > 0.
  absl::Status Validate() const;

 private:
  std::vector<int32_t> free_;  // stack; entries [0, free_top_) are free pages
  std::vector<int32_t> ref_;   // reference count per page
  int32_t free_top_ = 0;
};

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_PAGE_ALLOCATOR_H_
