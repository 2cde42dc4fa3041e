// Internal: the page pool of a KVCache — reference counts, the free stack,
// the prefix index of content-hashed full pages, and the LRU of evictable
// cached pages.
//
// Every page is in exactly one state:
//   free    reference count 0, on the free stack, not indexed;
//   cached  reference count 0, indexed, on the LRU list (evictable);
//   used    reference count >= 1 (indexed or not), on neither.
// free_count() + cached_count() + used_count() == num_pages(). An indexed
// page's hash maps to it in the index and no two pages share a hash.
// Allocate() takes a free page first, else evicts a cached page: the least
// recently released one of the lowest retention priority (it leaves the
// index: a kBlockRemoved event). A page's priority is the highest that a
// holder dropping it gave (RaisePriority) since it was last free or cached;
// it goes back to 0 when the page is revived, freed or evicted. With every
// priority 0 there is one LRU, as before priorities existed. Every
// operation but ClearIndex and Validate is O(1) amortized, and the index is
// sized once so steps do not allocate. Not thread-safe.
//
// The LRU and the index exist only in a pool made with a prefix index
// (Init(n, true)); without one no page is ever cached or indexed, and a page
// costs 8 bytes of bookkeeping (its reference count and a free-stack entry)
// instead of about 90.
#ifndef FP4KV_SRC_PAGE_POOL_H_
#define FP4KV_SRC_PAGE_POOL_H_

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "fp4kv/kv_events.h"
#include "src/host_alloc.h"
#include "src/kv_event_queue.h"
#include "src/prefix_hash.h"
#include "src/priority_lru.h"

namespace fp4kv {
namespace internal {

class PagePool {
 public:
  // An empty pool (no pages) until Init. `events` (may be null) receives the
  // removals and clears; it must outlive the pool.
  explicit PagePool(KVEventQueue* events = nullptr) : events_(events) {}

  // Pages 0 .. num_pages-1, all free; Allocate() hands them out in
  // increasing order first, then most recently freed first. With
  // `prefix_index` false, Register() indexes nothing. ResourceExhausted
  // (naming the bookkeeping and its bytes) when the host memory is not
  // there; the pool is then empty. Sizes are checked before allocating.
  absl::Status Init(int32_t num_pages, bool prefix_index);

  // Host bytes Init(num_pages, prefix_index) allocates (an estimate of the
  // index's table, exact for the arrays).
  static int64_t BookkeepingBytes(int64_t num_pages, bool prefix_index);

  int32_t num_pages() const { return static_cast<int32_t>(ref_.size()); }
  int32_t free_count() const { return free_top_; }
  int32_t cached_count() const { return lru_count_; }
  int32_t used_count() const { return num_pages() - free_top_ - lru_count_; }
  // Pages Allocate() can hand out now: free and cached.
  int32_t available_count() const { return free_top_ + lru_count_; }
  int64_t evictions() const { return evictions_; }

  // Takes a free page, else evicts the least recently used cached page, and
  // gives it reference count 1. Precondition: available_count() > 0 (callers
  // count first: all-or-nothing steps).
  int32_t Allocate();
  // Evicts the least recently used cached page onto the free stack (it
  // leaves the index: a kBlockRemoved event) and returns it, so that the
  // next Allocate() hands it out; *hash gets the hash it was indexed under.
  // Precondition: cached_count() > 0.
  // *priority gets its retention priority.
  int32_t EvictLru(BlockHash* hash, int* priority);
  // Raises a used page's retention priority to at least `priority` (0 ..
  // kPriorities - 1), which it keeps while cached. No-op without an index.
  void RaisePriority(int32_t page, int priority) {
    if (has_index_ && lru_.priority(page) < priority) lru_.set_priority(page, priority);
  }
  int Priority(int32_t page) const { return has_index_ ? lru_.priority(page) : 0; }
  static constexpr int kPriorities = PriorityLru::kPriorities;
  // Adds a reference to a used page, or revives a cached one (it leaves the
  // LRU with count 1). Precondition: the page is not free.
  void Retain(int32_t page);
  // Drops a reference. At 0 an indexed page becomes cached (most recently
  // used end of the LRU) and any other goes back on the free stack. Returns
  // true when the count reached 0. Precondition: the page is used.
  bool Release(int32_t page);
  int32_t RefCount(int32_t page) const { return ref_[page]; }

  // --- prefix index
  bool has_index() const { return has_index_; }
  bool Indexed(int32_t page) const { return has_index_ && indexed_[page] != 0; }
  const BlockHash& HashOf(int32_t page) const { return hash_[page]; }
  // The page holding `hash`, or -1.
  int32_t Lookup(const BlockHash& hash) const {
    auto it = index_.find(hash);
    return it == index_.end() ? -1 : it->second;
  }
  // Indexes a used, unindexed page under `hash`; false (nothing changes)
  // when another page already holds that hash, or the pool has no index.
  bool Register(int32_t page, const BlockHash& hash);
  // Takes a used page out of the index (it is about to be overwritten): a
  // kBlockRemoved event. No-op for an unindexed page.
  void Unregister(int32_t page);
  // Empties the index: cached pages become free, used pages stay used but
  // unindexed. One kAllBlocksCleared event. O(num_pages).
  void ClearIndex();

  // Checks the invariants above in O(num_pages) (for tests).
  absl::Status Validate() const;

 private:
  void LruUnlink(int32_t page);
  void LruPushBack(int32_t page);

  bool InLru(int32_t page) const { return has_index_ && in_lru_[page] != 0; }

  KVEventQueue* events_;
  HostVector<int32_t> free_;  // stack; entries [0, free_top_) are free pages
  HostVector<int32_t> ref_;   // reference count per page
  int32_t free_top_ = 0;
  // Prefix index only (empty without): the cached pages on one LRU per
  // retention priority (a page's priority names its list); the index and
  // each page's hash.
  bool has_index_ = false;
  PriorityLru lru_;
  HostVector<uint8_t> in_lru_;
  int32_t lru_count_ = 0;
  HostVector<uint8_t> indexed_;
  HostVector<BlockHash> hash_;
  using IndexEntry = std::pair<const BlockHash, int32_t>;
  absl::flat_hash_map<BlockHash, int32_t, BlockHashHasher, std::equal_to<BlockHash>,
                      HostAllocator<IndexEntry>>
      index_;
  int64_t evictions_ = 0;
};

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_PAGE_POOL_H_
