// Two steps in flight (KVCacheOptions::step_slots) and late token ids
// (KVCache::SetTokenIds): the slots, the ordering and page-reuse rules, the
// late-id rules and their errors, and a two-slot fuzz model.
//
// The fuzz model keeps up to step_slots prepared steps "in flight": on the
// CPU their kernels run late (just before the PrepareStep that waits for
// their slot, or before a call that must wait for every step), as a device
// that lags behind the host would run them; on the GPU they run at once
// behind a random device delay. Pages a step takes from the pool are
// poisoned as soon as PrepareStep hands them out (on the GPU by a copy on
// another stream, not ordered with the steps in flight), so a page handed
// out while a step in flight still reads or writes it shows up as a wrong
// byte in that step's output, which is checked against the model.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
#include "testing/kv_cache_harness.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::Buffer;
using testing::StepInputs;
using testing::StepRows;
using testing::Token;
using testing::TokenFactory;

constexpr int kPageSize = 4;
constexpr uint16_t kOutPoison = 0xA5A5;

KVCacheOptions SmallOptions(Device device, int slots, int64_t pages, bool prefix) {
  KVCacheOptions o;
  o.num_layers = 2;
  o.geometry.num_kv_heads = 2;
  o.geometry.head_dim_k = 64;
  o.geometry.head_dim_v = 64;
  o.geometry.page_size = kPageSize;
  o.geometry.num_pages = pages;
  o.device = device;
  o.k_global_scales = {1.0f, 1.25f};
  o.v_global_scales = {2.5f, 2.0f};
  o.max_seqs_per_step = 6;
  o.max_tokens_per_step = 24;
  o.max_pages_per_seq = 12;
  o.step_slots = slots;
  o.prefix_cache.enabled = prefix;
  return o;
}

StepEntry Entry(SequenceId seq, int n, absl::Span<const int32_t> ids = {}) {
  StepEntry e;
  e.seq = seq;
  e.num_new_tokens = n;
  e.token_ids = ids;
  return e;
}

std::vector<int32_t> Pages(const KVCache& cache, SequenceId seq) {
  absl::StatusOr<absl::Span<const int32_t>> p = cache.SequencePages(seq);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::vector<int32_t>(p->begin(), p->end()) : std::vector<int32_t>();
}

// Prepares a step of one sequence appending n tokens (with ids when given).
void Step(KVCache& cache, SequenceId seq, int n, absl::Span<const int32_t> ids = {}) {
  const std::vector<StepEntry> e = {Entry(seq, n, ids)};
  absl::StatusOr<StepInfo> info = cache.PrepareStep(e);
  ASSERT_TRUE(info.ok()) << info.status();
}

void EmptyStep(KVCache& cache) {
  absl::StatusOr<StepInfo> info = cache.PrepareStep({});
  ASSERT_TRUE(info.ok()) << info.status();
}

std::vector<int32_t> Iota(int n, int32_t from) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[i] = from + i;
  return v;
}

// ------------------------------------------------------------------ slots
TEST(KVCacheOverlap, StepSlotsIsValidated) {
  for (int slots : {0, -1, 9}) {
    absl::StatusOr<KVCache> c = KVCache::Create(SmallOptions(Device::Cpu(), slots, 16, false));
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("step_slots"), absl::string_view::npos) << c.status();
  }
  for (int slots : {1, 2, 8}) {
    absl::StatusOr<KVCache> c = KVCache::Create(SmallOptions(Device::Cpu(), slots, 16, false));
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->options().step_slots, slots);
  }
}

TEST(KVCacheOverlap, OneSlotReusesReleasedPagesAtOnce) {
  KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), 1, 16, false));
  const SequenceId a = *cache.CreateSequence();
  Step(cache, a, 9);
  EXPECT_EQ(cache.step().slot, 0);
  const std::vector<int32_t> pages = Pages(cache, a);
  ASSERT_TRUE(cache.ReleaseSequence(a).ok());
  KVCacheStats st = cache.Stats();
  EXPECT_EQ(st.pages_free, 16);
  EXPECT_EQ(st.pages_retiring, 0);
  // The next step takes the same pages back (LIFO free list), as always.
  const SequenceId b = *cache.CreateSequence();
  Step(cache, b, 9);
  EXPECT_EQ(cache.step().slot, 0);
  std::vector<int32_t> got = Pages(cache, b);
  std::sort(got.begin(), got.end());
  std::vector<int32_t> want = pages;
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
}

TEST(KVCacheOverlap, StepsFillSlotsRoundRobinWithTheirOwnBuffers) {
  KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), 3, 32, false));
  EXPECT_NE(cache.step_views(0).block_tables.data, cache.step_views(1).block_tables.data);
  EXPECT_NE(cache.step_views(1).slot_mapping.data, cache.step_views(2).slot_mapping.data);
  EXPECT_EQ(cache.step_views(3).block_tables.data, nullptr);
  EXPECT_EQ(cache.step_views(-1).block_tables.data, nullptr);
  const SequenceId a = *cache.CreateSequence();
  const SequenceId b = *cache.CreateSequence();
  for (int s = 0; s < 7; ++s) {
    const std::vector<StepEntry> e = {Entry(a, 1 + s % 3), Entry(b, 2)};
    absl::StatusOr<StepInfo> info = cache.PrepareStep(absl::MakeConstSpan(e).subspan(0, 1 + s % 2));
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->slot, s % 3);
    EXPECT_EQ(cache.step().slot, s % 3);
    EXPECT_EQ(cache.step_views().block_tables.data, cache.step_views(s % 3).block_tables.data);
    EXPECT_EQ(cache.step(s % 3).num_tokens, info->num_tokens);
    // The other slots still hold their steps: their staging is untouched.
    if (s >= 1) {
      const StepInfo& prev = cache.step((s + 2) % 3);
      EXPECT_EQ(prev.slot, (s + 2) % 3);
      EXPECT_EQ(prev.num_seqs, 1 + (s - 1) % 2);
      const int32_t* lens = static_cast<const int32_t*>(cache.step_views((s + 2) % 3).seq_lens.data);
      EXPECT_GT(lens[0], 0);
      if (prev.num_seqs == 1) {
        EXPECT_EQ(lens[1], 0);
      }
    }
  }
}

// Pages released while step s is the latest come back at PrepareStep
// s + step_slots, not before, and never to the steps in between.
TEST(KVCacheOverlap, ReleasedPagesRetireAtPrepareStepPlusSlots) {
  for (int slots : {2, 3}) {
    SCOPED_TRACE(slots);
    KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), slots, 32, false));
    const SequenceId a = *cache.CreateSequence();
    const SequenceId b = *cache.CreateSequence();
    Step(cache, a, 9);  // step 1: 3 pages
    const std::vector<int32_t> a_pages = Pages(cache, a);
    ASSERT_TRUE(cache.ReleaseSequence(a).ok());
    EXPECT_EQ(cache.Stats().pages_retiring, 3);
    EXPECT_EQ(cache.Stats().tokens_resident, 0);  // retiring pages hold nobody's tokens
    EXPECT_EQ(cache.Stats().pages_free, 29);
    EXPECT_EQ(cache.Stats().pages_used, 3);
    ASSERT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
    for (int s = 2; s < 1 + slots; ++s) {
      Step(cache, b, 4);  // one new page each, never one of a's
      for (int32_t p : Pages(cache, b)) {
        EXPECT_EQ(std::count(a_pages.begin(), a_pages.end(), p), 0) << "page " << p;
      }
      EXPECT_EQ(cache.Stats().pages_retiring, 3) << "after step " << s;
    }
    EmptyStep(cache);  // step 1 + slots: the slot of step 1 again
    const KVCacheStats st = cache.Stats();
    EXPECT_EQ(st.pages_retiring, 0);
    EXPECT_EQ(st.pages_free, 32 - (slots - 1));
    ASSERT_TRUE(cache.CheckInvariants().ok());
  }
}

TEST(KVCacheOverlap, TruncatedAndCachedPagesRetireToo) {
  KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), 2, 32, true));
  const SequenceId a = *cache.CreateSequence();
  const std::vector<int32_t> ids = Iota(12, 100);
  Step(cache, a, 12, ids);  // 3 full pages, indexed
  ASSERT_TRUE(cache.Truncate(a, 5).ok());  // keeps 2 pages; the third retires
  KVCacheStats st = cache.Stats();
  EXPECT_EQ(st.pages_retiring, 1);
  EXPECT_EQ(st.pages_cached, 0);
  // Still in the index: a prefix match may share it while it retires.
  std::vector<int32_t> prompt = ids;
  prompt.push_back(7);
  EXPECT_EQ(cache.MatchPrefix(prompt).pages, 3);
  EmptyStep(cache);
  EXPECT_EQ(cache.Stats().pages_retiring, 1);
  EmptyStep(cache);  // step 3: retired, cached (indexed, no holder)
  st = cache.Stats();
  EXPECT_EQ(st.pages_retiring, 0);
  EXPECT_EQ(st.pages_cached, 1);
  ASSERT_TRUE(cache.CheckInvariants().ok());
  // A retiring page a new sequence shares is held by it, not retiring.
  ASSERT_TRUE(cache.ReleaseSequence(a).ok());
  EXPECT_EQ(cache.Stats().pages_retiring, 2);
  absl::StatusOr<PrefixSequence> p = cache.CreateSequenceFromPrefix(prompt);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->cached_tokens, 12);
  st = cache.Stats();
  EXPECT_EQ(st.pages_retiring, 0);
  EXPECT_EQ(st.pages_used, 3);
  ASSERT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
  ASSERT_TRUE(cache.ReleaseSequence(p->seq).ok());  // dropped at once: the entries still hold them
  EXPECT_EQ(cache.Stats().pages_retiring, 3);
  ASSERT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
  EmptyStep(cache);
  EmptyStep(cache);
  st = cache.Stats();
  EXPECT_EQ(st.pages_retiring, 0);
  EXPECT_EQ(st.pages_cached, 3);
  EXPECT_EQ(st.pages_used, 0);
}

// A retiring page that a later step reads again (a prefix match shares it)
// retires only after that step too.
TEST(KVCacheOverlap, ARetiringPageReadAgainRetiresAfterThatStep) {
  KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), 2, 32, true));
  const SequenceId a = *cache.CreateSequence();
  const std::vector<int32_t> ids = Iota(8, 70);
  std::vector<int32_t> prompt = ids;
  prompt.push_back(1);
  Step(cache, a, 8, ids);                      // step 1
  ASSERT_TRUE(cache.ReleaseSequence(a).ok());  // retiring until step 3
  absl::StatusOr<PrefixSequence> c = cache.CreateSequenceFromPrefix(prompt);
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c->cached_tokens, 8);
  Step(cache, c->seq, 0);  // step 2 reads the pages
  ASSERT_TRUE(cache.ReleaseSequence(c->seq).ok());
  EXPECT_EQ(cache.Stats().pages_retiring, 2);
  EmptyStep(cache);  // step 3: a's time, but step 2 may still read them
  EXPECT_EQ(cache.Stats().pages_retiring, 2);
  EXPECT_EQ(cache.Stats().pages_cached, 0);
  EmptyStep(cache);  // step 4
  EXPECT_EQ(cache.Stats().pages_retiring, 0);
  EXPECT_EQ(cache.Stats().pages_cached, 2);
  ASSERT_TRUE(cache.CheckInvariants().ok());
}

TEST(KVCacheOverlap, PagesHeldByALiveSequenceAreDroppedAtOnce) {
  KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), 2, 16, false));
  const SequenceId a = *cache.CreateSequence();
  Step(cache, a, 6);
  const SequenceId c = *cache.ForkSequence(a);
  ASSERT_TRUE(cache.ReleaseSequence(a).ok());
  EXPECT_EQ(cache.Stats().pages_retiring, 0);
  EXPECT_EQ(*cache.PageRefCount(Pages(cache, c)[1]), 1);
  // The child appends into its partial page without a copy: it is its own.
  const std::vector<StepEntry> e = {Entry(c, 1)};
  absl::StatusOr<StepInfo> info = cache.PrepareStep(e);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pages_copied, 0);
  ASSERT_TRUE(cache.ReleaseSequence(c).ok());
  EXPECT_EQ(cache.Stats().pages_retiring, 2);
}

// When the free and evictable pages do not suffice, a step takes the
// retiring pages at once (a wait for the steps in flight on a GPU), and
// PlanStep says so beforehand.
TEST(KVCacheOverlap, AShortPoolTakesRetiringPagesAndPlanStepSaysSo) {
  KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), 2, 8, false));
  const SequenceId d = *cache.CreateSequence();
  const SequenceId a = *cache.CreateSequence();
  const SequenceId b = *cache.CreateSequence();
  Step(cache, d, 8);   // step 1: 2 pages
  Step(cache, a, 24);  // step 2: 6 pages, none free after
  ASSERT_TRUE(cache.ReleaseSequence(a).ok());  // retiring until step 4
  const std::vector<StepEntry> e = {Entry(b, 24)};  // 6 pages: all retiring
  absl::StatusOr<StepPlan> plan = cache.PlanStep(e);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->fits);
  EXPECT_EQ(plan->pages_free, 0);
  EXPECT_EQ(plan->pages_retiring, 6);
  EXPECT_EQ(plan->pages_left, 0);
  // One page more than there is: refused, nothing waited for or retired.
  const std::vector<StepEntry> too_many = {Entry(b, 20), Entry(d, 1)};
  const std::vector<StepEntry> too_many2 = {Entry(b, 21), Entry(d, 1)};
  absl::StatusOr<StepPlan> ok6 = cache.PlanStep(too_many);
  ASSERT_TRUE(ok6.ok());
  EXPECT_TRUE(ok6->fits);
  absl::StatusOr<StepPlan> no = cache.PlanStep(too_many2);
  ASSERT_TRUE(no.ok());
  EXPECT_FALSE(no->fits);
  absl::StatusOr<StepInfo> fail = cache.PrepareStep(too_many2);
  ASSERT_FALSE(fail.ok());
  EXPECT_EQ(fail.status().code(), absl::StatusCode::kResourceExhausted) << fail.status();
  EXPECT_EQ(cache.Stats().pages_retiring, 6);
  absl::StatusOr<StepInfo> info = cache.PrepareStep(e);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->pages_allocated, 6);
  const KVCacheStats st = cache.Stats();
  EXPECT_EQ(st.pages_retiring, 0);
  EXPECT_EQ(st.pages_free, 0);
  ASSERT_TRUE(cache.CheckInvariants().ok());
}

TEST(KVCacheOverlap, ForSlotValidatesAndRunsOnItsSlot) {
  KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), 2, 32, false));
  absl::StatusOr<CacheAppender> app = cache.appender(DType::kBF16);
  ASSERT_TRUE(app.ok());
  EXPECT_EQ(app->slot(), -1);
  for (int bad : {-1, 2}) {
    absl::StatusOr<CacheAppender> x = app->ForSlot(bad);
    ASSERT_FALSE(x.ok());
    EXPECT_EQ(x.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(x.status().message().find("slot"), absl::string_view::npos) << x.status();
  }
  EXPECT_EQ(CacheAppender().ForSlot(0).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CacheDequantizer().ForSlot(0).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CacheMaterializer().ForSlot(0).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CacheAttention().ForSlot(0).status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<CacheAppender> app0 = app->ForSlot(0);
  absl::StatusOr<CacheAppender> app1 = app->ForSlot(1);
  ASSERT_TRUE(app0.ok() && app1.ok());
  EXPECT_EQ(app1->slot(), 1);
  absl::StatusOr<CacheDequantizer> deq = cache.dequantizer(DType::kBF16);
  ASSERT_TRUE(deq.ok());
  ASSERT_TRUE(deq->ForSlot(1).ok());
  ASSERT_TRUE(cache.materializer().ok() && cache.materializer()->ForSlot(1).ok());

  // Step 1 (slot 0) appends 3 tokens of a, step 2 (slot 1) 5 of b; slot 0's
  // appends run after step 2 was prepared, as they would on a lagging GPU.
  TokenFactory f(cache);
  const SequenceId a = *cache.CreateSequence();
  const SequenceId b = *cache.CreateSequence();
  std::vector<Token> ta, tb;
  for (int i = 0; i < 3; ++i) ta.push_back(f.Make(10 + i));
  for (int i = 0; i < 5; ++i) tb.push_back(f.Make(20 + i));
  Step(cache, a, 3);
  Step(cache, b, 5);
  StepInputs in0, in1;
  ASSERT_TRUE(testing::FillStepInputs(cache, ta, &in0, nullptr).ok());
  ASSERT_TRUE(testing::FillStepInputs(cache, tb, &in1, nullptr).ok());
  // Rows are checked against the slot's step: 2 rows are too few for step
  // 1 of slot 0 (3 tokens), and 4 for the latest step (5 tokens).
  const CacheGeometry& g = cache.geometry();
  const TensorView k2 = in0.k[0].View(DType::kBF16, {2, g.num_kv_heads, g.head_dim_k});
  const TensorView v2 = in0.v[0].View(DType::kBF16, {2, g.num_kv_heads, g.head_dim_v});
  EXPECT_EQ(app0->Run(0, k2, v2).code(), absl::StatusCode::kInvalidArgument);
  const TensorView k4 = in0.k[0].View(DType::kBF16, {4, g.num_kv_heads, g.head_dim_k});
  const TensorView v4 = in0.v[0].View(DType::kBF16, {4, g.num_kv_heads, g.head_dim_v});
  EXPECT_EQ(app->Run(0, k4, v4).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(testing::RunAppendAllLayers(cache, *app1, &in1, nullptr).ok());
  ASSERT_TRUE(testing::RunAppendAllLayers(cache, *app0, &in0, nullptr).ok());
  const testing::PoolCopy pools = testing::DownloadPools(cache);
  EXPECT_EQ(testing::CheckSequenceBytes(cache, pools, a, ta), "");
  EXPECT_EQ(testing::CheckSequenceBytes(cache, pools, b, tb), "");
  // The dequantizer of slot 0 reads step 1's tables: a's 3 tokens in row 0.
  const int64_t len = 3;
  Buffer k(cache.device(), static_cast<size_t>(len * g.num_kv_heads * g.head_dim_k * 2));
  Buffer v(cache.device(), static_cast<size_t>(len * g.num_kv_heads * g.head_dim_v * 2));
  ASSERT_TRUE(k.Fill(0xA5) && v.Fill(0xA5));
  absl::StatusOr<CacheDequantizer> deq0 = deq->ForSlot(0);
  ASSERT_TRUE(deq0.ok());
  ASSERT_TRUE(deq0->Run(1, k.View(DType::kBF16, {1, len, g.num_kv_heads, g.head_dim_k}),
                        v.View(DType::kBF16, {1, len, g.num_kv_heads, g.head_dim_v}))
                  .ok());
  EXPECT_EQ(testing::CheckDequantized(cache, 1, k.DownloadAs<uint16_t>(k.size() / 2),
                                      v.DownloadAs<uint16_t>(v.size() / 2), 1, len, {ta},
                                      kOutPoison),
            "");
  // The latest step's dequantizer refuses a T below step 2's longest (5).
  EXPECT_EQ(deq->Run(1, k.View(DType::kBF16, {1, len, g.num_kv_heads, g.head_dim_k}),
                     v.View(DType::kBF16, {1, len, g.num_kv_heads, g.head_dim_v}))
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------- late ids
TEST(KVCacheLateIds, PagesAreIndexedOnceTheirIdsArrive) {
  for (int slots : {1, 2}) {
    SCOPED_TRACE(slots);
    KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), slots, 32, true));
    const SequenceId a = *cache.CreateSequence();
    const std::vector<int32_t> ids = Iota(10, 500);
    std::vector<int32_t> prompt = ids;
    prompt.push_back(1);
    Step(cache, a, 3, absl::MakeConstSpan(ids).subspan(0, 3));  // with ids
    Step(cache, a, 1);                                          // position 3 late
    Step(cache, a, 6);                                          // positions 4..9 late
    EXPECT_EQ(cache.MatchPrefix(prompt).pages, 0);
    ASSERT_TRUE(cache.SetTokenIds(a, 3, absl::MakeConstSpan(ids).subspan(3, 1)).ok());
    EXPECT_EQ(cache.MatchPrefix(prompt).pages, 1);
    // Out of order: page 2 (positions 8..9 are partial) waits for page 1's.
    ASSERT_TRUE(cache.SetTokenIds(a, 6, absl::MakeConstSpan(ids).subspan(6, 4)).ok());
    EXPECT_EQ(cache.MatchPrefix(prompt).pages, 1);
    ASSERT_TRUE(cache.SetTokenIds(a, 4, absl::MakeConstSpan(ids).subspan(4, 2)).ok());
    EXPECT_EQ(cache.MatchPrefix(prompt).pages, 2);
    // Giving a known id again changes nothing.
    ASSERT_TRUE(cache.SetTokenIds(a, 0, absl::MakeConstSpan(ids).subspan(0, 10)).ok());
    ASSERT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
    const KVEventBatch ev = cache.TakeEvents();
    EXPECT_EQ(ev.dropped, 0u);
    // A sequence whose ids never arrive is not cached, but the cache keeps
    // working and later sequences with ids are.
    const SequenceId b = *cache.CreateSequence();
    Step(cache, b, 8);
    ASSERT_TRUE(cache.ReleaseSequence(b).ok());
    ASSERT_TRUE(cache.ReleaseSequence(a).ok());
    EmptyStep(cache);
    EmptyStep(cache);
    const KVCacheStats st = cache.Stats();
    EXPECT_EQ(st.pages_cached, 2);  // a's two full pages
    EXPECT_EQ(st.pages_indexed, 2);
  }
}

TEST(KVCacheLateIds, AGapDelaysLaterPagesButDoesNotStopTracking) {
  KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), 1, 32, true));
  const SequenceId a = *cache.CreateSequence();
  const std::vector<int32_t> ids = Iota(16, 900);
  std::vector<int32_t> prompt = ids;
  prompt.push_back(1);
  Step(cache, a, 4, absl::MakeConstSpan(ids).subspan(0, 4));
  Step(cache, a, 1);  // position 4: never given for a while
  Step(cache, a, 11, absl::MakeConstSpan(ids).subspan(5, 11));
  EXPECT_EQ(cache.MatchPrefix(prompt).pages, 1);
  ASSERT_TRUE(cache.SetTokenIds(a, 4, absl::MakeConstSpan(ids).subspan(4, 1)).ok());
  EXPECT_EQ(cache.MatchPrefix(prompt).pages, 4);
  // A fork shares the known ids; the child's own late ids are its own.
  const SequenceId c = *cache.ForkSequence(a);
  Step(cache, c, 4);
  std::vector<int32_t> child = ids;
  for (int32_t x : {7, 8, 9, 10}) child.push_back(x);
  child.push_back(1);
  EXPECT_EQ(cache.MatchPrefix(child).pages, 4);
  ASSERT_TRUE(cache.SetTokenIds(c, 16, {7, 8, 9, 10}).ok());
  EXPECT_EQ(cache.MatchPrefix(child).pages, 5);
  // Truncation forgets ids past the new end: new ids may differ there.
  ASSERT_TRUE(cache.Truncate(c, 14).ok());
  Step(cache, c, 2);
  ASSERT_TRUE(cache.SetTokenIds(c, 14, {42, 43}).ok());
  ASSERT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
}

TEST(KVCacheLateIds, BadInputIsRefusedAndChangesNothing) {
  KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), 2, 32, true));
  const SequenceId a = *cache.CreateSequence();
  const std::vector<int32_t> ids = Iota(8, 300);
  std::vector<int32_t> prompt = ids;
  prompt.push_back(1);
  Step(cache, a, 4, absl::MakeConstSpan(ids).subspan(0, 4));
  Step(cache, a, 4);
  const testing::Snapshot before = testing::TakeSnapshot(cache);
  auto expect = [&](const absl::Status& st, absl::StatusCode code, const char* names) {
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_NE(st.message().find(names), absl::string_view::npos) << st;
    EXPECT_EQ(testing::DiffSnapshots(before, testing::TakeSnapshot(cache)), "");
    EXPECT_EQ(cache.MatchPrefix(prompt).pages, 1);
  };
  expect(cache.SetTokenIds(a + 100, 4, {1}), absl::StatusCode::kNotFound, "seq");
  expect(cache.SetTokenIds(a, -1, {1}), absl::StatusCode::kInvalidArgument, "first_position");
  expect(cache.SetTokenIds(a, 8, {1}), absl::StatusCode::kInvalidArgument, "first_position");
  expect(cache.SetTokenIds(a, 6, {1, 2, 3}), absl::StatusCode::kInvalidArgument, "first_position");
  // Positions 4..7 are unknown, 3 is known as 303: the whole call is refused
  // and position 4's id is not written either.
  expect(cache.SetTokenIds(a, 3, {999, 304, 305, 306, 307}), absl::StatusCode::kInvalidArgument,
         "ids[0]");
  ASSERT_TRUE(cache.SetTokenIds(a, 4, absl::MakeConstSpan(ids).subspan(4, 4)).ok());
  EXPECT_EQ(cache.MatchPrefix(prompt).pages, 2);
  EXPECT_EQ(cache.SetTokenIds(a, 5, {1}).code(), absl::StatusCode::kInvalidArgument);
  // Device-view variant: the view is checked first.
  int32_t host_ids[2] = {1, 2};
  const TensorView good = TensorView::Contiguous(host_ids, DType::kI32, {2}, Device::Cpu());
  TensorView wrong_dtype = good;
  wrong_dtype.dtype = DType::kF32;
  EXPECT_EQ(cache.SetTokenIds(a, 6, wrong_dtype).code(), absl::StatusCode::kInvalidArgument);
  const TensorView two_d = TensorView::Contiguous(host_ids, DType::kI32, {1, 2}, Device::Cpu());
  EXPECT_EQ(cache.SetTokenIds(a, 6, two_d).code(), absl::StatusCode::kInvalidArgument);
  const TensorView cuda = TensorView::Contiguous(host_ids, DType::kI32, {2}, Device::Cuda(0));
  absl::Status st = cache.SetTokenIds(a, 6, cuda);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("ids"), absl::string_view::npos) << st;
  EXPECT_EQ(cache.SetTokenIds(a, 7, good).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.SetTokenIds(a, 6, good).code(), absl::StatusCode::kInvalidArgument);  // conflict
  // Moved-from cache.
  KVCache moved = std::move(cache);
  EXPECT_EQ(cache.SetTokenIds(a, 0, {1}).code(), absl::StatusCode::kFailedPrecondition);
  // Without prefix caching the ids are checked and ignored.
  KVCache plain = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), 1, 8, false));
  const SequenceId p = *plain.CreateSequence();
  Step(plain, p, 2);
  EXPECT_TRUE(plain.SetTokenIds(p, 0, {1, 2}).ok());
  EXPECT_EQ(plain.SetTokenIds(p, 1, {1, 2}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(KVCacheLateIds, DeviceViewIdsApplyAtOnceOnTheCpu) {
  KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), 2, 32, true));
  const SequenceId a = *cache.CreateSequence();
  Step(cache, a, 5);
  std::vector<int32_t> ids = Iota(5, 40);
  const TensorView view = TensorView::Contiguous(ids.data(), DType::kI32, {5}, Device::Cpu());
  ASSERT_TRUE(cache.SetTokenIds(a, 0, view).ok());
  EXPECT_EQ(cache.Stats().token_ids_pending, 0);
  std::vector<int32_t> prompt = ids;
  EXPECT_EQ(cache.MatchPrefix(prompt).pages, 1);
}

// On a GPU, device ids apply at PrepareStep step_serial + max(2, slots)
// counted from the call, whatever the timing: ranks agree.
TEST(KVCacheLateIds, GpuDeviceIdsApplyAtAFixedStep) {
  FP4KV_SKIP_WITHOUT_GPU();
  for (int slots : {1, 2, 3}) {
    SCOPED_TRACE(slots);
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    const Stream s = reinterpret_cast<Stream>(stream);
    KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cuda(0), slots, 32, true));
    const SequenceId a = *cache.CreateSequence();
    const std::vector<StepEntry> e = {Entry(a, 5)};
    ASSERT_TRUE(cache.PrepareStep(e, s).ok());
    std::vector<int32_t> ids = Iota(5, 40);
    Buffer dev(Device::Cuda(0), ids.size() * 4);
    ASSERT_TRUE(dev.Upload(ids.data(), ids.size() * 4));
    ASSERT_TRUE(cache.SetTokenIds(a, 0, dev.View(DType::kI32, {5}), s).ok());
    EXPECT_EQ(cache.Stats().token_ids_pending, 5);
    const int wait = std::max(2, slots);
    for (int k = 1; k < wait; ++k) {
      ASSERT_TRUE(cache.PrepareStep({}, s).ok());
      EXPECT_EQ(cache.MatchPrefix(ids).pages, 0) << "after " << k << " steps";
    }
    ASSERT_TRUE(cache.PrepareStep({}, s).ok());
    EXPECT_EQ(cache.Stats().token_ids_pending, 0);
    EXPECT_EQ(cache.MatchPrefix(ids).pages, 1);
    // Ids of truncated positions are dropped when they come due.
    ASSERT_TRUE(cache.SetTokenIds(a, 4, dev.View(DType::kI32, {1}), s).ok());
    ASSERT_TRUE(cache.Truncate(a, 4).ok());
    for (int k = 0; k < wait; ++k) ASSERT_TRUE(cache.PrepareStep({}, s).ok());
    EXPECT_EQ(cache.Stats().token_ids_dropped, 1);
    ASSERT_TRUE(cache.CheckInvariants().ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  }
}

// ------------------------------------------------------------ fuzz model
void SleepFor(void* micros) {
  std::this_thread::sleep_for(std::chrono::microseconds(reinterpret_cast<uintptr_t>(micros)));
}

class OverlapFuzzer {
 public:
  OverlapFuzzer(KVCache* cache, uint64_t seed, cudaStream_t stream)
      : cache_(cache),
        rng_(seed),
        stream_(stream),
        s_(reinterpret_cast<Stream>(stream)),
        factory_(*cache),
        gpu_(cache->device().is_cuda()),
        slots_(cache->options().step_slots),
        ps_(cache->geometry().page_size),
        prefix_(cache->options().prefix_cache.enabled) {}

  void Run(int ops) {
    absl::StatusOr<CacheAppender> app = cache_->appender(DType::kBF16);
    absl::StatusOr<CacheDequantizer> deq = cache_->dequantizer(DType::kBF16);
    ASSERT_TRUE(app.ok() && deq.ok());
    for (int k = 0; k < slots_; ++k) {
      absl::StatusOr<CacheAppender> a = app->ForSlot(k);
      absl::StatusOr<CacheDequantizer> d = deq->ForSlot(k);
      ASSERT_TRUE(a.ok() && d.ok());
      appenders_.push_back(*a);
      dequantizers_.push_back(*d);
      inputs_.emplace_back();
    }
    if (gpu_) {
      ASSERT_EQ(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), cudaSuccess);
    }
    if (gpu_) {
      ASSERT_EQ(cudaEventCreateWithFlags(&poisoned_, cudaEventDisableTiming), cudaSuccess);
    }
    for (int i = 0; i < ops && !::testing::Test::HasFatalFailure(); ++i) {
      const int op = Uniform(0, 99);
      if (op < 12 || seqs_.empty()) {
        Create();
      } else if (op < 50) {
        Step();
      } else if (op < 58) {
        Release();
      } else if (op < 64) {
        TruncateOne();
      } else if (op < 69) {
        Fork();
      } else if (op < 80) {
        LateIds();
      } else if (op < 86) {
        FromPrefix();
      } else if (op < 90) {
        Drain();
        CheckAllBytes();
      } else {
        Step();
      }
      if (::testing::Test::HasFatalFailure()) break;
      CheckCounts();
    }
    Drain();
    CheckAllBytes();
    if (gpu_) {
      (void)cudaStreamSynchronize(side_);
      (void)cudaStreamDestroy(side_);
      (void)cudaEventDestroy(poisoned_);
    }
  }

  int steps() const { return steps_; }
  int checked() const { return checked_; }
  int forced() const { return forced_; }
  int late_ids() const { return late_ids_; }

 private:
  struct ModelSeq {
    SequenceId id = 0;
    std::vector<Token> tokens;
    std::vector<int32_t> ids;     // true token ids
    std::vector<uint8_t> given;   // whether the cache was told
    std::vector<int32_t> pages;   // as the cache reports them
  };
  // A prepared step whose kernels (appends of every layer, then a
  // dequantize of one layer) have not run (CPU) or not been checked (GPU).
  struct InFlight {
    uint64_t serial = 0;
    int slot = 0;
    std::vector<Token> tokens;
    StepRows rows;
    int num_seqs = 0, max_len = 0, layer = 0;
    std::set<int32_t> pages;  // every page it reads or writes
    bool launched = false;
    std::unique_ptr<Buffer> k, v;
    cudaEvent_t done = nullptr;  // GPU: after its kernels
  };

  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  int64_t PagesFor(int64_t len) const { return (len + ps_ - 1) / ps_; }

  ModelSeq* Find(SequenceId id) {
    for (ModelSeq& q : seqs_) {
      if (q.id == id) return &q;
    }
    return nullptr;
  }
  ModelSeq& Pick() { return seqs_[static_cast<size_t>(Uniform(0, static_cast<int>(seqs_.size()) - 1))]; }

  std::map<int32_t, int> SeqRefs() const {
    std::map<int32_t, int> r;
    for (const ModelSeq& q : seqs_) {
      for (int32_t p : q.pages) ++r[p];
    }
    return r;
  }
  int HoldsOf(int32_t page) const { return holds_.count(page) ? 1 : 0; }
  // A sequence drops `pages` (last first). With two or more slots a page's
  // last reference becomes a hold until PrepareStep serial + slots, and a
  // drop of a page that a hold keeps pushes the hold out to that step.
  void Drop(const std::vector<int32_t>& pages, std::map<int32_t, int>* refs) {
    for (size_t j = pages.size(); j-- > 0;) {
      const int32_t p = pages[j];
      const int total = (*refs)[p] + HoldsOf(p);
      --(*refs)[p];
      if (slots_ > 1 && (total == 1 || holds_.count(p))) holds_[p] = serial_ + slots_;
    }
  }
  static std::map<int32_t, uint64_t> Due(std::map<int32_t, uint64_t> holds, uint64_t now) {
    for (auto it = holds.begin(); it != holds.end();) {
      it = it->second <= now ? holds.erase(it) : std::next(it);
    }
    return holds;
  }
  int64_t RetiringOnly() const {
    const std::map<int32_t, int> refs = SeqRefs();
    int64_t n = 0;
    for (const auto& [page, ready] : holds_) {
      auto it = refs.find(page);
      n += it == refs.end() || it->second == 0;
    }
    return n;
  }
  int64_t Held() const {
    std::set<int32_t> held;
    for (const ModelSeq& q : seqs_) held.insert(q.pages.begin(), q.pages.end());
    for (const auto& [page, ready] : holds_) held.insert(page);
    return static_cast<int64_t>(held.size());
  }

  void Create() {
    absl::StatusOr<SequenceId> id = cache_->CreateSequence();
    ASSERT_TRUE(id.ok());
    ModelSeq q;
    q.id = *id;
    seqs_.push_back(q);
  }

  void Fork() {
    ModelSeq& p = Pick();
    absl::StatusOr<SequenceId> id = cache_->ForkSequence(p.id);
    ASSERT_TRUE(id.ok()) << id.status();
    ModelSeq c = p;
    c.id = *id;
    seqs_.push_back(c);
  }

  void Release() {
    const size_t i = static_cast<size_t>(Uniform(0, static_cast<int>(seqs_.size()) - 1));
    ASSERT_TRUE(cache_->ReleaseSequence(seqs_[i].id).ok());
    ghosts_.push_back(seqs_[i]);  // its cached prefix may be matched again
    if (ghosts_.size() > 4) ghosts_.erase(ghosts_.begin());
    std::map<int32_t, int> refs = SeqRefs();
    const std::vector<int32_t> pages = seqs_[i].pages;
    Drop(pages, &refs);
    seqs_.erase(seqs_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  void TruncateOne() {
    ModelSeq& q = Pick();
    const int64_t len = static_cast<int64_t>(q.tokens.size());
    const int64_t new_len = Uniform(0, static_cast<int>(len));
    ASSERT_TRUE(cache_->Truncate(q.id, new_len).ok());
    const size_t keep = static_cast<size_t>(PagesFor(new_len));
    std::map<int32_t, int> refs = SeqRefs();
    const std::vector<int32_t> dropped(q.pages.begin() + static_cast<std::ptrdiff_t>(keep),
                                       q.pages.end());
    Drop(dropped, &refs);
    q.pages.resize(keep);
    q.tokens.resize(static_cast<size_t>(new_len));
    q.ids.resize(static_cast<size_t>(new_len));
    q.given.resize(static_cast<size_t>(new_len));
  }

  // Gives some missing ids of a sequence (in a random order), and now and
  // then a wrong one for a known position, which must be refused.
  void LateIds() {
    ModelSeq& q = Pick();
    std::vector<int> missing;
    for (size_t t = 0; t < q.given.size(); ++t) {
      if (!q.given[t]) missing.push_back(static_cast<int>(t));
    }
    if (!missing.empty()) {
      const int t0 = missing[static_cast<size_t>(Uniform(0, static_cast<int>(missing.size()) - 1))];
      int t1 = t0;
      while (t1 + 1 < static_cast<int>(q.given.size()) && !q.given[t1 + 1] && Uniform(0, 3) > 0) ++t1;
      const absl::Span<const int32_t> ids = absl::MakeConstSpan(q.ids).subspan(t0, t1 - t0 + 1);
      absl::Status st;
      if (gpu_ && Uniform(0, 1) == 0) {
        // Device ids: they apply at a later PrepareStep; the model marks
        // them given now (MatchPrefix is only checked as a lower bound).
        auto buf = std::make_unique<Buffer>(cache_->device(), ids.size() * 4);
        ASSERT_TRUE(buf->Upload(ids.data(), ids.size() * 4));
        st = cache_->SetTokenIds(q.id, t0, buf->View(DType::kI32, {static_cast<int64_t>(ids.size())}),
                                 s_);
        id_buffers_.push_back(std::move(buf));
        pending_device_ids_ = true;
      } else {
        st = cache_->SetTokenIds(q.id, t0, ids);
      }
      ASSERT_TRUE(st.ok()) << st;
      for (int t = t0; t <= t1; ++t) q.given[t] = 1;
      ++late_ids_;
    }
    if (prefix_ && !pending_device_ids_ && !q.given.empty()) {
      const int t = Uniform(0, static_cast<int>(q.given.size()) - 1);
      if (q.given[t]) {
        const int32_t wrong = q.ids[t] + 1;
        const absl::Status st = cache_->SetTokenIds(q.id, t, {wrong});
        EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      }
    }
  }

  // A new sequence from the longest cached prefix of a live sequence's ids.
  void FromPrefix() {
    if (!prefix_) return;
    const bool ghost = !ghosts_.empty() && Uniform(0, 1) == 0;
    ModelSeq& q = ghost ? ghosts_[static_cast<size_t>(Uniform(0, static_cast<int>(ghosts_.size()) - 1))]
                        : Pick();
    size_t known = 0;
    while (known < q.given.size() && q.given[known]) ++known;
    std::vector<int32_t> prompt(q.ids.begin(), q.ids.begin() + static_cast<std::ptrdiff_t>(known));
    prompt.push_back(1);
    const std::vector<Token> tokens = q.tokens;
    const std::vector<int32_t> ids = q.ids;
    const PrefixMatch m = cache_->MatchPrefix(prompt);
    if (!pending_device_ids_ && !ghost) {
      EXPECT_EQ(m.pages, static_cast<int64_t>(known) / ps_) << "sequence " << q.id;
    }
    EXPECT_LE(m.pages, static_cast<int64_t>(known) / ps_);
    absl::StatusOr<PrefixSequence> p = cache_->CreateSequenceFromPrefix(prompt);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->cached_tokens, m.tokens);
    ModelSeq c;
    c.id = p->seq;
    c.tokens.assign(tokens.begin(), tokens.begin() + p->cached_tokens);
    c.ids.assign(ids.begin(), ids.begin() + p->cached_tokens);
    c.given.assign(static_cast<size_t>(p->cached_tokens), 1);
    c.pages = Pages(*cache_, c.id);
    seqs_.push_back(c);
  }

  // Runs (CPU) or checks (GPU) the steps in flight up to `serial`.
  void Settle(uint64_t serial) {
    while (!inflight_.empty() && inflight_.front().serial <= serial) {
      InFlight& f = inflight_.front();
      if (!f.launched) Launch(f);
      if (::testing::Test::HasFatalFailure()) return;
      if (gpu_ && f.done != nullptr) {
        // A test-side wait for this step only (not for the steps after it).
        ASSERT_EQ(cudaEventSynchronize(f.done), cudaSuccess);
        ASSERT_EQ(cudaEventDestroy(f.done), cudaSuccess);
        f.done = nullptr;
      }
      if (f.num_seqs > 0 && f.max_len > 0) {
        const CacheGeometry& g = cache_->geometry();
        ASSERT_EQ(testing::CheckDequantized(*cache_, f.layer, f.k->DownloadAs<uint16_t>(f.k->size() / 2),
                                            f.v->DownloadAs<uint16_t>(f.v->size() / 2), f.num_seqs,
                                            f.max_len, f.rows, kOutPoison),
                  "")
            << "step " << f.serial << " (slot " << f.slot << ") of " << g.page_size
            << "-token pages: a page it used was handed out while it was in flight";
        ++checked_;
      }
      inflight_.pop_front();
    }
  }
  void Drain() { Settle(UINT64_MAX); }

  // The step's kernels: appends of every layer, then one layer dequantized
  // (on the GPU behind a random delay, so that the next PrepareStep and its
  // poison run while this step is in flight).
  void Launch(InFlight& f) {
    f.launched = true;
    const CacheGeometry& g = cache_->geometry();
    if (f.num_seqs > 0 && f.max_len > 0) {
      f.k = std::make_unique<Buffer>(cache_->device(), static_cast<size_t>(f.num_seqs) * f.max_len *
                                                           g.num_kv_heads * g.head_dim_k * 2);
      f.v = std::make_unique<Buffer>(cache_->device(), static_cast<size_t>(f.num_seqs) * f.max_len *
                                                           g.num_kv_heads * g.head_dim_v * 2);
      ASSERT_TRUE(f.k->Fill(0xA5) && f.v->Fill(0xA5));
    }
    StepInputs& in = inputs_[static_cast<size_t>(f.slot)];
    // Synchronizes the stream on the GPU before it rewrites the slot's inputs.
    ASSERT_TRUE(testing::FillStepInputs(*cache_, f.tokens, &in, s_).ok());
    if (gpu_) {
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the output fills
      const uintptr_t us = static_cast<uintptr_t>(Uniform(0, 3) > 0 ? Uniform(500, 20000) : 0);
      ASSERT_EQ(cudaLaunchHostFunc(stream_, SleepFor, reinterpret_cast<void*>(us)), cudaSuccess);
    }
    const absl::Status st =
        testing::RunAppendAllLayers(*cache_, appenders_[static_cast<size_t>(f.slot)], &in, s_);
    ASSERT_TRUE(st.ok()) << st;
    if (f.k == nullptr) return;
    const absl::Status d = dequantizers_[static_cast<size_t>(f.slot)].Run(
        f.layer, f.k->View(DType::kBF16, {f.num_seqs, f.max_len, g.num_kv_heads, g.head_dim_k}),
        f.v->View(DType::kBF16, {f.num_seqs, f.max_len, g.num_kv_heads, g.head_dim_v}), s_);
    ASSERT_TRUE(d.ok()) << d;
    if (gpu_) {
      ASSERT_EQ(cudaEventCreateWithFlags(&f.done, cudaEventDisableTiming), cudaSuccess);
      ASSERT_EQ(cudaEventRecord(f.done, stream_), cudaSuccess);
    }
  }

  // Poisons the data bytes of `pages` in every layer: at once on the CPU, on
  // a side stream not ordered with the steps in flight on the GPU (the step
  // about to run waits for it).
  void Poison(const std::vector<int32_t>& pages) {
    if (pages.empty()) return;
    for (int l = 0; l < cache_->num_layers(); ++l) {
      const PagedCache pc = cache_->LayerCache(l);
      for (const TensorView* t : {&pc.k_data, &pc.v_data}) {
        const int64_t page_bytes = t->strides[0] * DTypeSize(t->dtype);
        for (int32_t p : pages) {
          uint8_t* at = static_cast<uint8_t*>(t->data) + p * page_bytes;
          if (gpu_) {
            ASSERT_EQ(cudaMemsetAsync(at, 0x77, static_cast<size_t>(page_bytes), side_), cudaSuccess);
          } else {
            std::memset(at, 0x77, static_cast<size_t>(page_bytes));
          }
        }
      }
    }
    if (gpu_) {
      ASSERT_EQ(cudaEventRecord(poisoned_, side_), cudaSuccess);
      ASSERT_EQ(cudaStreamWaitEvent(stream_, poisoned_, 0), cudaSuccess);
    }
  }

  void Step() {
    // Entries: distinct random sequences, random counts, ids mostly given.
    std::vector<StepEntry> entries;
    std::vector<std::vector<int32_t>> new_ids;
    std::vector<size_t> order(seqs_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng_);
    const KVCacheOptions& o = cache_->options();
    const int n = std::min<int>(Uniform(0, o.max_seqs_per_step), static_cast<int>(order.size()));
    int tokens = 0;
    std::vector<bool> with_ids;
    for (int i = 0; i < n; ++i) {
      ModelSeq& q = seqs_[order[static_cast<size_t>(i)]];
      const int room = static_cast<int>(int64_t{o.max_pages_per_seq} * ps_ - static_cast<int64_t>(q.tokens.size()));
      int add = std::min({Uniform(0, 6), room, o.max_tokens_per_step - tokens});
      if (add < 0) add = 0;
      tokens += add;
      StepEntry e;
      e.seq = q.id;
      e.num_new_tokens = add;
      entries.push_back(e);
      std::vector<int32_t> ids;
      for (int t = 0; t < add; ++t) ids.push_back(static_cast<int32_t>(next_id_++));
      new_ids.push_back(ids);
      with_ids.push_back(Uniform(0, 3) > 0);
    }
    for (size_t i = 0; i < entries.size(); ++i) {
      if (with_ids[i]) entries[i].token_ids = new_ids[i];
    }
    // Model: the slot's previous step is done before the call; the holds
    // due at this step go first. Pages the step needs.
    const uint64_t serial = serial_ + 1;
    std::map<int32_t, int> refs = SeqRefs();
    int64_t need = 0;
    bool cow = false;
    std::map<int32_t, int> claims;
    for (const StepEntry& e : entries) {
      const ModelSeq& q = *Find(e.seq);
      const int64_t len = static_cast<int64_t>(q.tokens.size());
      need += PagesFor(len + e.num_new_tokens) - PagesFor(len);
      if (e.num_new_tokens > 0 && len % ps_ != 0) {
        const int32_t last = q.pages.back();
        if (refs[last] + HoldsOf(last) - claims[last] > 1) {
          ++claims[last];
          ++need;
          cow = true;
        }
      }
    }
    const std::map<int32_t, uint64_t> holds_after = Due(holds_, serial);
    std::set<int32_t> held;
    for (const auto& [p, c] : refs) {
      if (c > 0) held.insert(p);
    }
    const int64_t total = cache_->geometry().num_pages;
    const int64_t held_by_seqs = static_cast<int64_t>(held.size());
    for (const auto& [page, ready] : holds_after) held.insert(page);
    const int64_t available_now = total - static_cast<int64_t>(held.size());
    const bool exhausted = need > total - held_by_seqs;
    const bool force = !exhausted && need > available_now;
    // What the GPU would have waited for: the slot's previous step, and
    // every step when forced (the cache then waits for the latest step, so
    // none is in flight after the call: the model drains on both devices);
    // copy-on-write copies on the CPU read pages at once, so every step in
    // flight runs first there.
    if (force || (!gpu_ && cow)) {
      Drain();
    } else {
      Settle(serial > static_cast<uint64_t>(slots_) ? serial - slots_ : 0);
    }
    if (::testing::Test::HasFatalFailure()) return;
    absl::StatusOr<StepPlan> plan = cache_->PlanStep(entries);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->fits, !exhausted);
    absl::StatusOr<StepInfo> info = cache_->PrepareStep(entries, s_);
    if (exhausted) {
      ASSERT_FALSE(info.ok());
      EXPECT_EQ(info.status().code(), absl::StatusCode::kResourceExhausted) << info.status();
      holds_ = holds_after;  // the failed call still retired the holds due at it
      return;
    }
    ASSERT_TRUE(info.ok()) << info.status() << " (model: need " << need << ", available "
                           << available_now << ")";
    serial_ = serial;
    holds_ = force ? std::map<int32_t, uint64_t>() : holds_after;
    if (force) ++forced_;
    ++steps_;
    EXPECT_EQ(info->slot, static_cast<int>((serial - 1) % static_cast<uint64_t>(slots_)));
    EXPECT_EQ(info->pages_allocated, need);

    // New pages: never one a live sequence, a hold or a step in flight has.
    std::set<int32_t> busy;
    for (const ModelSeq& q : seqs_) busy.insert(q.pages.begin(), q.pages.end());
    for (const auto& [page, ready] : holds_) busy.insert(page);
    for (const InFlight& f : inflight_) busy.insert(f.pages.begin(), f.pages.end());
    InFlight f;
    f.serial = serial;
    f.slot = info->slot;
    f.num_seqs = static_cast<int>(entries.size());
    f.layer = Uniform(0, cache_->num_layers() - 1);
    std::vector<int32_t> appended;
    for (size_t i = 0; i < entries.size(); ++i) {
      ModelSeq& q = *Find(entries[i].seq);
      const std::vector<int32_t> old = q.pages;
      q.pages = Pages(*cache_, q.id);
      for (size_t j = 0; j < q.pages.size(); ++j) {
        if (j < old.size() && q.pages[j] == old[j]) continue;
        EXPECT_EQ(busy.count(q.pages[j]), 0u)
            << "page " << q.pages[j] << " handed out while still in use (step " << serial << ")";
        if (j >= old.size()) appended.push_back(q.pages[j]);
      }
      for (int t = 0; t < entries[i].num_new_tokens; ++t) {
        f.tokens.push_back(factory_.Make(next_token_++));
        q.tokens.push_back(f.tokens.back());
        q.ids.push_back(new_ids[i][static_cast<size_t>(t)]);
        q.given.push_back(with_ids[i] ? 1 : 0);
      }
      f.rows.push_back(q.tokens);
      f.max_len = std::max<int>(f.max_len, static_cast<int>(q.tokens.size()));
      f.pages.insert(q.pages.begin(), q.pages.end());
    }
    Poison(appended);
    if (::testing::Test::HasFatalFailure()) return;
    inflight_.push_back(std::move(f));
    if (gpu_) Launch(inflight_.back());
    if (!gpu_ && Uniform(0, 4) == 0) Settle(serial);  // sometimes the device keeps up
  }

  void CheckCounts() {
    const KVCacheStats st = cache_->Stats();
    EXPECT_EQ(st.pages_retiring, RetiringOnly());
    EXPECT_EQ(st.pages_free + st.pages_cached, cache_->geometry().num_pages - Held());
    EXPECT_EQ(st.num_sequences, static_cast<int64_t>(seqs_.size()));
    const absl::Status inv = cache_->CheckInvariants();
    ASSERT_TRUE(inv.ok()) << inv;
    for (const ModelSeq& q : seqs_) {
      ASSERT_EQ(Pages(*cache_, q.id), q.pages) << "sequence " << q.id;
    }
  }

  void CheckAllBytes() {
    if (gpu_) {
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    }
    const testing::PoolCopy pools = testing::DownloadPools(*cache_);
    for (const ModelSeq& q : seqs_) {
      ASSERT_EQ(testing::CheckSequenceBytes(*cache_, pools, q.id, q.tokens), "")
          << "sequence " << q.id;
    }
  }

  KVCache* cache_;
  std::mt19937_64 rng_;
  cudaStream_t stream_;
  Stream s_;
  TokenFactory factory_;
  bool gpu_;
  int slots_;
  int ps_;
  bool prefix_;
  cudaStream_t side_ = nullptr;
  cudaEvent_t poisoned_ = nullptr;
  std::vector<CacheAppender> appenders_;
  std::vector<CacheDequantizer> dequantizers_;
  std::vector<StepInputs> inputs_;
  std::vector<ModelSeq> seqs_;
  std::vector<ModelSeq> ghosts_;  // released sequences (their tokens and ids)
  std::map<int32_t, uint64_t> holds_;  // page -> the PrepareStep that frees it
  std::deque<InFlight> inflight_;
  std::vector<std::unique_ptr<Buffer>> id_buffers_;
  bool pending_device_ids_ = false;
  uint64_t serial_ = 0;
  uint64_t next_token_ = 1;
  uint64_t next_id_ = 1000;
  int steps_ = 0, checked_ = 0, forced_ = 0, late_ids_ = 0;
};

struct FuzzCase {
  int slots;
  int64_t pages;
  bool prefix;
};

class KVCacheOverlapFuzz : public ::testing::TestWithParam<FuzzCase> {};

TEST_P(KVCacheOverlapFuzz, CpuTwoStepsInFlightMatchTheModel) {
  const FuzzCase c = GetParam();
  for (uint64_t seed : {11u, 12u}) {
    KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cpu(), c.slots, c.pages, c.prefix));
    OverlapFuzzer f(&cache, seed * 31 + static_cast<uint64_t>(c.slots), nullptr);
    f.Run(testing::FuzzOps(400));
    std::cout << "slots " << c.slots << " pages " << c.pages << " seed " << seed << ": "
              << f.steps() << " steps, " << f.checked() << " checked in flight, " << f.forced()
              << " forced retirements, " << f.late_ids() << " late id calls" << std::endl;
    EXPECT_GT(f.steps(), 0);
    EXPECT_GT(f.checked(), 0);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST_P(KVCacheOverlapFuzz, GpuTwoStepsInFlightMatchTheModel) {
  FP4KV_SKIP_WITHOUT_GPU();
  const FuzzCase c = GetParam();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (uint64_t seed : {13u, 14u}) {
    KVCache cache =
        testing::CreateCacheOrAbort(SmallOptions(Device::Cuda(0), c.slots, c.pages, c.prefix));
    OverlapFuzzer f(&cache, seed * 31 + static_cast<uint64_t>(c.slots), stream);
    f.Run(testing::FuzzOps(300));
    std::cout << "slots " << c.slots << " pages " << c.pages << " seed " << seed << ": "
              << f.steps() << " steps, " << f.checked() << " checked in flight, " << f.forced()
              << " forced retirements" << std::endl;
    EXPECT_GT(f.checked(), 0);
    if (::testing::Test::HasFailure()) break;
  }
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

INSTANTIATE_TEST_SUITE_P(Slots, KVCacheOverlapFuzz,
                         ::testing::Values(FuzzCase{2, 40, true}, FuzzCase{2, 20, false},
                                           FuzzCase{3, 48, true}, FuzzCase{1, 40, true}),
                         [](const ::testing::TestParamInfo<FuzzCase>& i) {
                           return "Slots" + std::to_string(i.param.slots) + "Pages" +
                                  std::to_string(i.param.pages) +
                                  (i.param.prefix ? "Prefix" : "");
                         });

// ------------------------------------------------------------ GPU poison
// Step 1 reads sequence a behind a long device delay; a is released and the
// next step's new pages are poisoned on another stream at once. With two
// slots, a's pages must not be among them, so step 1's output is intact;
// when the pool is too short to avoid them, PrepareStep waits for step 1
// first, and the output is intact too.
TEST(KVCacheOverlapGpu, GpuPageReuseNeverRacesTheStepInFlight) {
  FP4KV_SKIP_WITHOUT_GPU();
  for (int64_t pages : {int64_t{32}, int64_t{8}}) {
    SCOPED_TRACE(pages);
    cudaStream_t stream, side;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
    const Stream s = reinterpret_cast<Stream>(stream);
    KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cuda(0), 2, pages, false));
    const CacheGeometry& g = cache.geometry();
    TokenFactory f(cache);
    const SequenceId a = *cache.CreateSequence();
    std::vector<Token> ta;
    for (int i = 0; i < 16; ++i) ta.push_back(f.Make(i + 1));
    const std::vector<StepEntry> e0 = {Entry(a, 16)};
    ASSERT_TRUE(cache.PrepareStep(e0, s).ok());
    absl::StatusOr<CacheAppender> app = cache.appender(DType::kBF16);
    absl::StatusOr<CacheDequantizer> deq = cache.dequantizer(DType::kBF16);
    ASSERT_TRUE(app.ok() && deq.ok());
    StepInputs in;
    ASSERT_TRUE(testing::FillStepInputs(cache, ta, &in, s).ok());
    ASSERT_TRUE(testing::RunAppendAllLayers(cache, *app, &in, s).ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    // Step 1 (slot 1): a is read behind a 200 ms delay.
    const std::vector<StepEntry> e1 = {Entry(a, 0)};
    ASSERT_TRUE(cache.PrepareStep(e1, s).ok());
    Buffer k(Device::Cuda(0), static_cast<size_t>(16 * g.num_kv_heads * g.head_dim_k * 2));
    Buffer v(Device::Cuda(0), static_cast<size_t>(16 * g.num_kv_heads * g.head_dim_v * 2));
    ASSERT_TRUE(k.Fill(0xA5) && v.Fill(0xA5));
    ASSERT_EQ(cudaLaunchHostFunc(stream, SleepFor, reinterpret_cast<void*>(uintptr_t{200000})),
              cudaSuccess);
    ASSERT_TRUE(deq->Run(0, k.View(DType::kBF16, {1, 16, g.num_kv_heads, g.head_dim_k}),
                         v.View(DType::kBF16, {1, 16, g.num_kv_heads, g.head_dim_v}), s)
                    .ok());
    const std::vector<int32_t> a_pages = Pages(cache, a);
    ASSERT_TRUE(cache.ReleaseSequence(a).ok());
    // Step 2 (slot 0) takes as many pages as the pool has.
    const SequenceId b = *cache.CreateSequence();
    const std::vector<StepEntry> e2 = {Entry(b, 24)};  // 6 pages: 28 free, or 4 free + 4 retiring
    absl::StatusOr<StepInfo> info = cache.PrepareStep(e2, s);
    ASSERT_TRUE(info.ok()) << info.status();
    const std::vector<int32_t> b_pages = Pages(cache, b);
    bool overlap = false;
    for (int32_t p : b_pages) {
      overlap = overlap || std::count(a_pages.begin(), a_pages.end(), p) > 0;
    }
    EXPECT_EQ(overlap, pages == 8) << "a short pool takes the retiring pages (after a wait)";
    for (int l = 0; l < cache.num_layers(); ++l) {
      const PagedCache pc = cache.LayerCache(l);
      for (const TensorView* t : {&pc.k_data, &pc.v_data}) {
        const int64_t page_bytes = t->strides[0] * DTypeSize(t->dtype);
        for (int32_t p : b_pages) {
          ASSERT_EQ(cudaMemsetAsync(static_cast<uint8_t*>(t->data) + p * page_bytes, 0x77,
                                    static_cast<size_t>(page_bytes), side),
                    cudaSuccess);
        }
      }
    }
    ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(testing::CheckDequantized(cache, 0, k.DownloadAs<uint16_t>(k.size() / 2),
                                        v.DownloadAs<uint16_t>(v.size() / 2), 1, 16, {ta},
                                        kOutPoison),
              "");
    ASSERT_EQ(cudaStreamDestroy(side), cudaSuccess);
    ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  }
}

// Two slots with steps on two streams: PrepareStep orders each step after
// the previous one, so step 2's reads (on another stream) see step 1's
// appends even behind a device delay.
TEST(KVCacheOverlapGpu, GpuStepsOnTwoStreamsStayInOrder) {
  FP4KV_SKIP_WITHOUT_GPU();
  cudaStream_t s1, s2;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), cudaSuccess);
  KVCache cache = testing::CreateCacheOrAbort(SmallOptions(Device::Cuda(0), 2, 32, false));
  const CacheGeometry& g = cache.geometry();
  TokenFactory f(cache);
  const SequenceId a = *cache.CreateSequence();
  std::vector<Token> ta;
  for (int i = 0; i < 7; ++i) ta.push_back(f.Make(i + 100));
  Buffer k(Device::Cuda(0), static_cast<size_t>(7 * g.num_kv_heads * g.head_dim_k * 2));
  Buffer v(Device::Cuda(0), static_cast<size_t>(7 * g.num_kv_heads * g.head_dim_v * 2));
  ASSERT_TRUE(k.Fill(0xA5) && v.Fill(0xA5));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<StepEntry> e0 = {Entry(a, 7)};
  ASSERT_TRUE(cache.PrepareStep(e0, reinterpret_cast<Stream>(s1)).ok());
  absl::StatusOr<CacheAppender> app = cache.appender(DType::kBF16);
  absl::StatusOr<CacheDequantizer> deq = cache.dequantizer(DType::kBF16);
  ASSERT_TRUE(app.ok() && deq.ok());
  StepInputs in;
  ASSERT_TRUE(testing::FillStepInputs(cache, ta, &in, reinterpret_cast<Stream>(s1)).ok());
  ASSERT_EQ(cudaLaunchHostFunc(s1, SleepFor, reinterpret_cast<void*>(uintptr_t{200000})),
            cudaSuccess);
  ASSERT_TRUE(testing::RunAppendAllLayers(cache, *app, &in, reinterpret_cast<Stream>(s1)).ok());
  const std::vector<StepEntry> e1 = {Entry(a, 0)};
  ASSERT_TRUE(cache.PrepareStep(e1, reinterpret_cast<Stream>(s2)).ok());
  EXPECT_EQ(cudaStreamQuery(s1), cudaErrorNotReady) << "the delay must still be running";
  ASSERT_TRUE(deq->Run(1, k.View(DType::kBF16, {1, 7, g.num_kv_heads, g.head_dim_k}),
                       v.View(DType::kBF16, {1, 7, g.num_kv_heads, g.head_dim_v}),
                       reinterpret_cast<Stream>(s2))
                  .ok());
  ASSERT_EQ(cudaStreamSynchronize(s2), cudaSuccess);
  EXPECT_EQ(testing::CheckDequantized(cache, 1, k.DownloadAs<uint16_t>(k.size() / 2),
                                      v.DownloadAs<uint16_t>(v.size() / 2), 1, 7, {ta},
                                      kOutPoison),
            "");
  ASSERT_EQ(cudaStreamSynchronize(s1), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(s1), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(s2), cudaSuccess);
}

}  // namespace
}  // namespace fp4kv
