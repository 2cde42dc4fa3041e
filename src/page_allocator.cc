#include "src/page_allocator.h"

#include "absl/strings/str_cat.h"

namespace fp4kv {
namespace internal {

PageAllocator::PageAllocator(int32_t num_pages)
    : free_(num_pages), ref_(num_pages, 0), free_top_(num_pages) {
  // The top of the stack is the end: page 0 is handed out first.
  for (int32_t i = 0; i < num_pages; ++i) free_[i] = num_pages - 1 - i;
}

absl::Status PageAllocator::Validate() const {
  if (free_top_ < 0 || free_top_ > num_pages()) {
    return absl::InternalError(
        absl::StrCat("free stack size ", free_top_, " outside [0, ", num_pages(), "]"));
  }
  std::vector<char> on_stack(ref_.size(), 0);
  for (int32_t i = 0; i < free_top_; ++i) {
    const int32_t p = free_[i];
    if (p < 0 || p >= num_pages()) {
      return absl::InternalError(absl::StrCat("free stack holds page ", p, " out of range"));
    }
    if (on_stack[p]) return absl::InternalError(absl::StrCat("page ", p, " is free twice"));
    on_stack[p] = 1;
    if (ref_[p] != 0) {
      return absl::InternalError(absl::StrCat("free page ", p, " has reference count ", ref_[p]));
    }
  }
  for (int32_t p = 0; p < num_pages(); ++p) {
    if (!on_stack[p] && ref_[p] <= 0) {
      return absl::InternalError(absl::StrCat("used page ", p, " has reference count ", ref_[p]));
    }
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace fp4kv
