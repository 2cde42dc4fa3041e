#include "src/page_allocator.h"

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace fp4kv {
namespace internal {
namespace {

TEST(PageAllocator, HandsOutEveryPageOnceThenReusesFreedOnes) {
  PageAllocator a(5);
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

TEST(PageAllocator, ReferenceCountsKeepSharedPagesUntilTheLastRelease) {
  PageAllocator a(3);
  const int32_t p = a.Allocate();
  a.Retain(p);
  a.Retain(p);
  EXPECT_EQ(a.RefCount(p), 3);
  EXPECT_FALSE(a.Release(p));
  EXPECT_FALSE(a.Release(p));
  EXPECT_EQ(a.free_count(), 2);
  EXPECT_TRUE(a.Release(p));
  EXPECT_EQ(a.free_count(), 3);
  EXPECT_TRUE(a.Validate().ok());
}

TEST(PageAllocator, RandomTrafficKeepsTheInvariants) {
  PageAllocator a(64);
  std::mt19937 rng(5);
  std::vector<int32_t> refs;  // one entry per held reference
  for (int i = 0; i < 20000; ++i) {
    const int r = static_cast<int>(rng() % 3);
    if (r == 0 && a.free_count() > 0) {
      refs.push_back(a.Allocate());
    } else if (r == 1 && !refs.empty()) {
      const int32_t p = refs[rng() % refs.size()];
      a.Retain(p);
      refs.push_back(p);
    } else if (!refs.empty()) {
      const size_t k = rng() % refs.size();
      const int32_t p = refs[k];
      refs[k] = refs.back();
      refs.pop_back();
      const bool freed = a.Release(p);
      EXPECT_EQ(freed, std::count(refs.begin(), refs.end(), p) == 0);
    }
    if (i % 1000 == 0) {
      ASSERT_TRUE(a.Validate().ok()) << a.Validate();
      const std::set<int32_t> used(refs.begin(), refs.end());
      ASSERT_EQ(a.used_count(), static_cast<int32_t>(used.size()));
      for (int32_t p : used) {
        ASSERT_EQ(a.RefCount(p), std::count(refs.begin(), refs.end(), p));
      }
    }
  }
}

}  // namespace
}  // namespace internal
}  // namespace fp4kv
