#include "src/page_pool.h"

#include <algorithm>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace fp4kv {
namespace internal {
namespace {

BlockHash H(uint64_t i) { return BlockHash{i * 0x9e3779b97f4a7c15ull, ~i}; }

PagePool Pool(int32_t n, KVEventQueue* q = nullptr, bool prefix_index = true) {
  PagePool a(q);
  absl::Status st = a.Init(n, prefix_index);
  EXPECT_TRUE(st.ok()) << st;
  return a;
}

TEST(PagePool, HandsOutEveryPageOnceThenReusesFreedOnes) {
  PagePool a = Pool(5);
  EXPECT_EQ(a.num_pages(), 5);
  EXPECT_EQ(a.free_count(), 5);
  std::vector<int32_t> got;
  for (int i = 0; i < 5; ++i) got.push_back(a.Allocate());
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(a.free_count(), 0);
  EXPECT_EQ(a.used_count(), 5);
  for (int32_t p : got) EXPECT_EQ(a.RefCount(p), 1);
  EXPECT_TRUE(a.Release(3));
  EXPECT_TRUE(a.Release(1));
  EXPECT_EQ(a.free_count(), 2);
  EXPECT_EQ(a.RefCount(3), 0);
  EXPECT_EQ(a.Allocate(), 1);  // most recently freed first
  EXPECT_EQ(a.Allocate(), 3);
  EXPECT_TRUE(a.Validate().ok());
}

TEST(PagePool, WithoutAPrefixIndexNothingIsCachedOrIndexed) {
  PagePool a = Pool(3, nullptr, /*prefix_index=*/false);
  EXPECT_FALSE(a.has_index());
  const int32_t p = a.Allocate();
  EXPECT_FALSE(a.Register(p, H(0)));
  EXPECT_FALSE(a.Indexed(p));
  EXPECT_EQ(a.Lookup(H(0)), -1);
  a.Unregister(p);
  EXPECT_TRUE(a.Release(p));
  EXPECT_EQ(a.free_count(), 3);
  EXPECT_EQ(a.cached_count(), 0);
  a.ClearIndex();
  EXPECT_TRUE(a.Validate().ok());
  EXPECT_LT(PagePool::BookkeepingBytes(1000, false), PagePool::BookkeepingBytes(1000, true) / 8);
}

TEST(PagePool, InitReplacesThePool) {
  PagePool a;
  EXPECT_EQ(a.num_pages(), 0);
  EXPECT_EQ(a.Init(-1, true).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(a.Init(4, true).ok());
  EXPECT_EQ(a.Allocate(), 0);
  ASSERT_TRUE(a.Init(2, false).ok());
  EXPECT_EQ(a.free_count(), 2);
  EXPECT_TRUE(a.Validate().ok());
}

TEST(PagePool, ReferenceCountsKeepSharedPagesUntilTheLastRelease) {
  PagePool a = Pool(3);
  const int32_t p = a.Allocate();
  a.Retain(p);
  a.Retain(p);
  EXPECT_EQ(a.RefCount(p), 3);
  EXPECT_FALSE(a.Release(p));
  EXPECT_FALSE(a.Release(p));
  EXPECT_TRUE(a.Release(p));
  EXPECT_EQ(a.free_count(), 3);
  EXPECT_TRUE(a.Validate().ok());
}

TEST(PagePool, ReleasedIndexedPagesAreCachedAndEvictedLeastRecentlyUsedFirst) {
  KVEventQueue q(64);
  PagePool a = Pool(4, &q);
  std::vector<int32_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(a.Allocate());
  ASSERT_TRUE(a.Register(p[0], H(0)));
  ASSERT_TRUE(a.Register(p[1], H(1)));
  ASSERT_TRUE(a.Register(p[2], H(2)));
  EXPECT_FALSE(a.Register(p[3], H(1))) << "a hash maps to one page";
  EXPECT_FALSE(a.Indexed(p[3]));
  // Released in the order 1, 0, 2: cached (not free), LRU head is 1.
  EXPECT_TRUE(a.Release(p[1]));
  EXPECT_TRUE(a.Release(p[0]));
  EXPECT_TRUE(a.Release(p[2]));
  EXPECT_TRUE(a.Release(p[3]));  // unindexed: free
  EXPECT_EQ(a.free_count(), 1);
  EXPECT_EQ(a.cached_count(), 3);
  EXPECT_EQ(a.used_count(), 0);
  EXPECT_EQ(a.available_count(), 4);
  ASSERT_TRUE(a.Validate().ok()) << a.Validate();
  // A cached page matched again is revived: off the LRU, count 1, still indexed.
  EXPECT_EQ(a.Lookup(H(0)), p[0]);
  a.Retain(p[0]);
  EXPECT_EQ(a.RefCount(p[0]), 1);
  EXPECT_EQ(a.cached_count(), 2);
  EXPECT_TRUE(a.Indexed(p[0]));
  // Free pages go first, then the LRU from its head: 1, then 2.
  EXPECT_EQ(a.Allocate(), p[3]);
  EXPECT_EQ(a.evictions(), 0);
  EXPECT_EQ(a.Allocate(), p[1]);
  EXPECT_EQ(a.Lookup(H(1)), -1);
  EXPECT_FALSE(a.Indexed(p[1]));
  EXPECT_EQ(a.Allocate(), p[2]);
  EXPECT_EQ(a.evictions(), 2);
  EXPECT_EQ(a.available_count(), 0);
  ASSERT_TRUE(a.Validate().ok()) << a.Validate();
  KVEventBatch b = q.Take();
  ASSERT_EQ(b.events.size(), 1u) << "consecutive removals merge";
  EXPECT_EQ(b.events[0].type, KVEventType::kBlockRemoved);
  EXPECT_EQ(b.events[0].block_hashes, (std::vector<BlockHash>{H(1), H(2)}));
  EXPECT_EQ(b.dropped, 0u);
}

TEST(PagePool, UnregisterAndClearIndex) {
  KVEventQueue q(64);
  PagePool a = Pool(3, &q);
  const int32_t x = a.Allocate(), y = a.Allocate();
  ASSERT_TRUE(a.Register(x, H(7)));
  ASSERT_TRUE(a.Register(y, H(8)));
  a.Unregister(x);
  EXPECT_FALSE(a.Indexed(x));
  EXPECT_EQ(a.Lookup(H(7)), -1);
  a.Unregister(x);  // no-op
  EXPECT_TRUE(a.Release(x));
  EXPECT_EQ(a.free_count(), 2);
  EXPECT_TRUE(a.Release(y));
  EXPECT_EQ(a.cached_count(), 1);
  const int32_t z = a.Allocate();
  ASSERT_TRUE(a.Register(z, H(9)));  // used and indexed
  a.ClearIndex();
  EXPECT_EQ(a.cached_count(), 0);
  EXPECT_EQ(a.free_count(), 2);
  EXPECT_FALSE(a.Indexed(z));
  EXPECT_EQ(a.RefCount(z), 1);
  EXPECT_EQ(a.Lookup(H(8)), -1);
  EXPECT_TRUE(a.Validate().ok()) << a.Validate();
  const KVEventBatch b = q.Take();
  ASSERT_EQ(b.events.size(), 1u) << "a clear supersedes what was queued before it";
  EXPECT_EQ(b.events[0].type, KVEventType::kAllBlocksCleared);
}

TEST(KVEventQueue, BoundedWithDropsCountedAndContinuingPagesMerged) {
  KVEventQueue q(2);
  const int32_t tok[4] = {5, 6, 7, 8};
  q.Stored(H(1), nullptr, {tok, 2}, 2, "a", false);
  q.Stored(H(2), nullptr, {tok + 2, 2}, 2, "a", true);  // same event
  q.Stored(H(3), nullptr, {tok, 2}, 2, "b", false);
  q.Stored(H(4), nullptr, {tok, 2}, 2, "c", false);  // dropped
  q.Stored(H(5), nullptr, {tok, 2}, 2, "c", true);   // part of the dropped event
  q.Removed(H(3));                                   // dropped: the last event is not a removal
  EXPECT_EQ(q.pending(), 2u);
  KVEventBatch b = q.Take();
  EXPECT_EQ(b.dropped, 2u);
  ASSERT_EQ(b.events.size(), 2u);
  EXPECT_EQ(b.events[0].type, KVEventType::kBlockStored);
  EXPECT_EQ(b.events[0].block_hashes, (std::vector<BlockHash>{H(1), H(2)}));
  EXPECT_EQ(b.events[0].token_ids, (std::vector<int32_t>{5, 6, 7, 8}));
  EXPECT_EQ(b.events[0].extra_key, "a");
  EXPECT_FALSE(b.events[0].has_parent);
  EXPECT_EQ(b.events[1].extra_key, "b");
  EXPECT_EQ(b.events[1].block_size, 2);
  EXPECT_EQ(q.Take().dropped, 0u) << "counted once";
  EXPECT_EQ(q.dropped_total(), 2u);
  const BlockHash parent = H(9);
  q.Stored(H(10), &parent, {tok, 2}, 2, "", false);
  b = q.Take();
  ASSERT_EQ(b.events.size(), 1u);
  EXPECT_TRUE(b.events[0].has_parent);
  EXPECT_EQ(b.events[0].parent_block_hash, parent);
  KVEventQueue off(0);
  off.Stored(H(1), nullptr, {tok, 2}, 2, "", false);
  off.Removed(H(1));
  off.AllCleared();
  EXPECT_EQ(off.pending(), 0u);
  EXPECT_EQ(off.Take().dropped, 0u);
}

// Random operations against a model of the three states and the LRU order.
TEST(PagePool, RandomOperationsMatchAModel) {
  constexpr int32_t kPages = 23;
  std::mt19937_64 rng(42);
  KVEventQueue q(1 << 20);
  PagePool a = Pool(kPages, &q);
  std::vector<int32_t> ref(kPages, 0);
  std::map<int32_t, BlockHash> indexed;  // page -> hash
  std::deque<int32_t> lru;              // front: least recently used
  std::vector<int32_t> free_stack;
  for (int32_t i = kPages - 1; i >= 0; --i) free_stack.push_back(i);
  uint64_t next_hash = 1;
  int64_t evictions = 0;
  for (int op = 0; op < 20000; ++op) {
    const int r = static_cast<int>(rng() % 100);
    std::vector<int32_t> used;
    for (int32_t p = 0; p < kPages; ++p) {
      if (ref[p] > 0) used.push_back(p);
    }
    if (r < 30 && a.available_count() > 0) {
      int32_t want;
      if (!free_stack.empty()) {
        want = free_stack.back();
        free_stack.pop_back();
      } else {
        want = lru.front();
        lru.pop_front();
        indexed.erase(want);
        ++evictions;
      }
      ASSERT_EQ(a.Allocate(), want) << "op " << op;
      ref[want] = 1;
    } else if (r < 45 && !used.empty()) {
      const int32_t p = used[rng() % used.size()];
      a.Retain(p);
      ++ref[p];
    } else if (r < 55 && !lru.empty()) {  // revive
      const int32_t p = lru[rng() % lru.size()];
      ASSERT_EQ(a.Lookup(indexed[p]), p);
      a.Retain(p);
      lru.erase(std::find(lru.begin(), lru.end(), p));
      ref[p] = 1;
    } else if (r < 80 && !used.empty()) {
      const int32_t p = used[rng() % used.size()];
      const bool zero = --ref[p] == 0;
      ASSERT_EQ(a.Release(p), zero);
      if (zero) {
        if (indexed.count(p)) {
          lru.push_back(p);
        } else {
          free_stack.push_back(p);
        }
      }
    } else if (r < 92 && !used.empty()) {
      const int32_t p = used[rng() % used.size()];
      const bool dup = rng() % 4 == 0 && !indexed.empty();
      const BlockHash h = dup ? indexed.begin()->second : H(next_hash++);
      const bool ok = !indexed.count(p) && !dup;
      ASSERT_EQ(a.Register(p, h), ok);
      if (ok) indexed[p] = h;
    } else if (r < 97 && !used.empty()) {
      const int32_t p = used[rng() % used.size()];
      a.Unregister(p);
      indexed.erase(p);
    } else if (r < 98) {
      a.ClearIndex();
      for (int32_t p : lru) free_stack.push_back(p);
      lru.clear();
      indexed.clear();
    }
    ASSERT_EQ(a.cached_count(), static_cast<int32_t>(lru.size()));
    ASSERT_EQ(a.free_count(), static_cast<int32_t>(free_stack.size()));
    ASSERT_EQ(a.free_count() + a.cached_count() + a.used_count(), kPages);
    ASSERT_EQ(a.evictions(), evictions);
    for (int32_t p = 0; p < kPages; ++p) {
      ASSERT_EQ(a.RefCount(p), ref[p]);
      ASSERT_EQ(a.Indexed(p), indexed.count(p) == 1);
    }
    if (op % 64 == 0) {
      ASSERT_TRUE(a.Validate().ok()) << a.Validate();
    }
  }
  EXPECT_GT(evictions, 10) << "the model rarely evicted: coverage too low";
  EXPECT_TRUE(a.Validate().ok()) << a.Validate();
}

}  // namespace
}  // namespace internal
}  // namespace fp4kv
