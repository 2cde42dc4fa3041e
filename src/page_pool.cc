#include "src/page_pool.h"

#include "absl/strings/str_cat.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {

namespace {
constexpr char kCall[] = "KVCache::Create";
// Slots of the index table per page: twice the most entries it can hold, as
// erasures leave tombstones and the headroom keeps their cleanup amortized
// O(1) (no rehash on the step path).
constexpr int64_t kIndexSlotsPerPage = 2;
// Bytes of one slot of the index table (entry + control byte), rounded up.
constexpr int64_t kIndexSlotBytes = sizeof(std::pair<const BlockHash, int32_t>) + 1;
}  // namespace

int64_t PagePool::BookkeepingBytes(int64_t num_pages, bool prefix_index) {
  int64_t per_page = 2 * sizeof(int32_t);
  if (prefix_index) {
    per_page += 2 * sizeof(int32_t) + 3 * sizeof(uint8_t) + sizeof(BlockHash) +
                kIndexSlotsPerPage * kIndexSlotBytes;
  }
  int64_t bytes = 0;
  return ArrayBytes(num_pages, per_page, &bytes) ? bytes : INT64_MAX;
}

absl::Status PagePool::Init(int32_t num_pages, bool prefix_index) {
  *this = PagePool(events_);
  if (num_pages < 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_pages: expected >= 0, got ", num_pages));
  }
  const int64_t n = num_pages;
  absl::Status st = SizeHost(&free_, n, int32_t{0}, kCall, "the free page stack");
  if (st.ok()) st = SizeHost(&ref_, n, int32_t{0}, kCall, "the page reference counts");
  if (st.ok() && prefix_index) {
    st = lru_.Init(n, kCall, "the prefix cache's LRU lists");
    if (st.ok()) st = SizeHost(&in_lru_, n, uint8_t{0}, kCall, "the prefix cache's LRU flags");
    if (st.ok()) st = SizeHost(&indexed_, n, uint8_t{0}, kCall, "the prefix index flags");
    if (st.ok()) st = SizeHost(&hash_, n, BlockHash{}, kCall, "the page hashes");
    if (st.ok()) {
      st = TryHostAlloc(kCall, "the prefix index table", kIndexSlotsPerPage * n, kIndexSlotBytes,
                        [&] { index_.reserve(static_cast<size_t>(kIndexSlotsPerPage * n)); });
    }
  }
  if (!st.ok()) {
    *this = PagePool(events_);
    return st;
  }
  has_index_ = prefix_index;
  free_top_ = num_pages;
  // The top of the stack is the end: page 0 is handed out first.
  for (int32_t i = 0; i < num_pages; ++i) free_[i] = num_pages - 1 - i;
  return absl::OkStatus();
}

void PagePool::LruUnlink(int32_t p) {
  lru_.Unlink(p);
  in_lru_[p] = 0;
  --lru_count_;
}

void PagePool::LruPushBack(int32_t p) {
  lru_.PushBack(p);
  in_lru_[p] = 1;
  ++lru_count_;
}

int32_t PagePool::Allocate() {
  int32_t page;
  if (free_top_ > 0) {
    page = free_[--free_top_];
  } else {
    page = lru_.Victim();
    LruUnlink(page);
    index_.erase(hash_[page]);
    indexed_[page] = 0;
    lru_.set_priority(page, 0);
    ++evictions_;
    if (events_ != nullptr) events_->Removed(hash_[page]);
  }
  ref_[page] = 1;
  return page;
}

int32_t PagePool::EvictLru(BlockHash* hash, int* priority) {
  const int32_t page = lru_.Victim();
  LruUnlink(page);
  index_.erase(hash_[page]);
  indexed_[page] = 0;
  *priority = lru_.priority(page);
  lru_.set_priority(page, 0);
  ++evictions_;
  *hash = hash_[page];
  if (events_ != nullptr) events_->Removed(hash_[page]);
  free_[free_top_++] = page;
  return page;
}

void PagePool::Retain(int32_t page) {
  if (ref_[page] == 0) {  // a cached page revived
    LruUnlink(page);
    lru_.set_priority(page, 0);
  }
  ++ref_[page];
}

bool PagePool::Release(int32_t page) {
  if (--ref_[page] != 0) return false;
  if (Indexed(page)) {
    LruPushBack(page);
  } else {
    if (has_index_) lru_.set_priority(page, 0);
    free_[free_top_++] = page;
  }
  return true;
}

bool PagePool::Register(int32_t page, const BlockHash& hash) {
  if (!has_index_ || indexed_[page]) return false;
  if (!index_.try_emplace(hash, page).second) return false;
  indexed_[page] = 1;
  hash_[page] = hash;
  return true;
}

void PagePool::Unregister(int32_t page) {
  if (!Indexed(page)) return;
  index_.erase(hash_[page]);
  indexed_[page] = 0;
  if (events_ != nullptr) events_->Removed(hash_[page]);
}

void PagePool::ClearIndex() {
  for (int32_t p = lru_.Victim(); p >= 0; p = lru_.Victim()) {
    LruUnlink(p);
    lru_.set_priority(p, 0);
    free_[free_top_++] = p;
  }
  for (uint8_t& f : indexed_) f = 0;
  index_.clear();  // keeps the table's capacity
  if (events_ != nullptr) events_->AllCleared();
}

absl::Status PagePool::Validate() const {
  const int32_t n = num_pages();
  if (free_top_ < 0 || free_top_ > n) {
    return absl::InternalError(
        absl::StrCat("free stack size ", free_top_, " outside [0, ", n, "]"));
  }
  HostVector<char> on_stack;
  FP4KV_RETURN_IF_ERROR(SizeHost(&on_stack, static_cast<int64_t>(ref_.size()), char{0},
                                 "KVCache::CheckInvariants", "a flag per page"));
  if (!has_index_ && (lru_.Victim() != -1 || lru_count_ != 0 || !index_.empty())) {
    return absl::InternalError("a pool without a prefix index has cached or indexed pages");
  }
  for (int32_t i = 0; i < free_top_; ++i) {
    const int32_t p = free_[i];
    if (p < 0 || p >= n) {
      return absl::InternalError(absl::StrCat("free stack holds page ", p, " out of range"));
    }
    if (on_stack[p]) return absl::InternalError(absl::StrCat("page ", p, " is free twice"));
    on_stack[p] = 1;
    if (ref_[p] != 0 || Indexed(p) || InLru(p)) {
      return absl::InternalError(absl::StrCat("free page ", p, " has reference count ", ref_[p],
                                              ", indexed ", Indexed(p), ", in LRU ", InLru(p)));
    }
  }
  int32_t walked = 0;
  for (int k = 0; k < (has_index_ ? kPriorities : 0); ++k) {
    for (int32_t p = lru_.head(k), prev = -1; p >= 0; prev = p, p = lru_.next(p)) {
      if (p >= n || !in_lru_[p] || lru_.prev(p) != prev || lru_.priority(p) != k || ++walked > n) {
        return absl::InternalError(absl::StrCat("LRU list ", k, " broken at page ", p));
      }
      if (ref_[p] != 0 || !indexed_[p]) {
        return absl::InternalError(absl::StrCat("cached page ", p, " has reference count ", ref_[p],
                                                ", indexed ", int{indexed_[p]}));
      }
      if (lru_.next(p) < 0 && lru_.tail(k) != p) {
        return absl::InternalError("LRU tail is not the last page");
      }
    }
  }
  if (walked != lru_count_) {
    return absl::InternalError(
        absl::StrCat("LRU holds ", walked, " pages, its count says ", lru_count_));
  }
  int32_t indexed = 0;
  for (int32_t p = 0; p < n; ++p) {
    if (!on_stack[p] && !InLru(p) && ref_[p] <= 0) {
      return absl::InternalError(absl::StrCat("used page ", p, " has reference count ", ref_[p]));
    }
    if (InLru(p) && on_stack[p]) {
      return absl::InternalError(absl::StrCat("page ", p, " is both free and cached"));
    }
    if (Indexed(p)) {
      ++indexed;
      auto it = index_.find(hash_[p]);
      if (it == index_.end() || it->second != p) {
        return absl::InternalError(absl::StrCat("indexed page ", p, " is not found by its hash"));
      }
    }
  }
  if (indexed != static_cast<int32_t>(index_.size())) {
    return absl::InternalError(
        absl::StrCat("index holds ", index_.size(), " hashes, ", indexed, " pages are indexed"));
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace fp4kv
