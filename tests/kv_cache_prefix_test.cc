// KVCache prefix caching: matching and sharing whole pages, the LRU of
// cached pages, KV events, the scale rule, PlanStep, and that everything is
// off (and free) without token ids.
#include <numeric>
#include <string>
#include <vector>

#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
#include "testing/kv_cache_harness.h"

namespace fp4kv {
namespace {

using testing::DiffSnapshots;
using testing::TakeSnapshot;

constexpr int kPs = 4;

KVCache MakeCache(int64_t pages = 16, bool prefix = true, bool explicit_scales = true) {
  KVCacheOptions o;
  o.num_layers = 2;
  o.geometry.num_kv_heads = 1;
  o.geometry.head_dim_k = o.geometry.head_dim_v = 16;
  o.geometry.page_size = kPs;
  o.geometry.num_pages = pages;
  if (explicit_scales) o.k_global_scales = o.v_global_scales = {0.01f, 0.02f};
  o.max_seqs_per_step = 8;
  o.max_tokens_per_step = 64;
  o.max_pages_per_seq = 8;
  o.prefix_cache.enabled = prefix;
  o.prefix_cache.max_pending_events = 64;
  absl::StatusOr<KVCache> c = KVCache::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return *std::move(c);
}

std::vector<int32_t> Iota(int n, int32_t from = 100) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

// Prefills `tokens` into a new sequence (metadata only) and returns it.
SequenceId Prefill(KVCache& c, const std::vector<int32_t>& tokens, absl::string_view key = {}) {
  absl::StatusOr<PrefixSequence> s = c.CreateSequenceFromPrefix(tokens, key);
  EXPECT_TRUE(s.ok()) << s.status();
  const int64_t rest = static_cast<int64_t>(tokens.size()) - s->cached_tokens;
  StepEntry e{s->seq, static_cast<int32_t>(rest),
              absl::Span<const int32_t>(tokens.data() + s->cached_tokens, rest)};
  absl::StatusOr<StepInfo> info = c.PrepareStep({e});
  EXPECT_TRUE(info.ok()) << info.status();
  return s->seq;
}

std::vector<int32_t> Pages(const KVCache& c, SequenceId s) {
  absl::StatusOr<absl::Span<const int32_t>> p = c.SequencePages(s);
  EXPECT_TRUE(p.ok());
  return std::vector<int32_t>(p->begin(), p->end());
}

TEST(KVCachePrefix, OffByDefaultAndTokenIdsAreIgnored) {
  KVCache c = MakeCache(16, /*prefix=*/false);
  EXPECT_EQ(c.CreateSequenceFromPrefix(Iota(9)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const SequenceId s = c.CreateSequence().value();
  const std::vector<int32_t> ids = Iota(9);
  ASSERT_TRUE(c.PrepareStep({{s, 9, ids}}).ok());
  ASSERT_TRUE(c.ReleaseSequence(s).ok());
  EXPECT_EQ(c.MatchPrefix(ids).tokens, 0);
  const KVCacheStats st = c.Stats();
  EXPECT_EQ(st.pages_free, st.pages_total) << "released pages are free, not cached";
  EXPECT_EQ(st.pages_cached, 0);
  EXPECT_EQ(st.pages_indexed, 0);
  EXPECT_TRUE(c.TakeEvents().events.empty());
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST(KVCachePrefix, ReleasedFullPagesAreCachedMatchedAndShared) {
  KVCache c = MakeCache();
  const std::vector<int32_t> prompt = Iota(10);  // two full pages and a partial one
  const SequenceId a = Prefill(c, prompt);
  const std::vector<int32_t> pa = Pages(c, a);
  ASSERT_EQ(pa.size(), 3u);
  EXPECT_EQ(c.Stats().pages_indexed, 2);
  EXPECT_EQ(c.MatchPrefix(prompt).tokens, 8);
  // A second request with the same prefix shares the pages while `a` lives.
  absl::StatusOr<PrefixSequence> b = c.CreateSequenceFromPrefix(Iota(12));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->cached_tokens, 8);
  EXPECT_EQ(*c.SequenceLength(b->seq), 8);
  EXPECT_EQ(Pages(c, b->seq), (std::vector<int32_t>{pa[0], pa[1]}));
  EXPECT_EQ(*c.PageRefCount(pa[0]), 2);
  ASSERT_TRUE(c.ReleaseSequence(a).ok());
  ASSERT_TRUE(c.ReleaseSequence(b->seq).ok());
  KVCacheStats st = c.Stats();
  EXPECT_EQ(st.pages_cached, 2) << "full hashed pages stay cached; the partial one is free";
  EXPECT_EQ(st.pages_free, st.pages_total - 2);
  EXPECT_EQ(st.pages_used, 0);
  EXPECT_EQ(*c.PageRefCount(pa[0]), 0);
  // Matched again: revived from the LRU.
  const PrefixMatch m = c.MatchPrefix(prompt);
  EXPECT_EQ(m.tokens, 8);
  EXPECT_EQ(m.pages_evictable, 2);
  absl::StatusOr<PrefixSequence> d = c.CreateSequenceFromPrefix(prompt);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(Pages(c, d->seq), (std::vector<int32_t>{pa[0], pa[1]}));
  st = c.Stats();
  EXPECT_EQ(st.pages_cached, 0);
  EXPECT_EQ(st.pages_used, 2);
  EXPECT_EQ(st.prefix_queries, 3);
  EXPECT_EQ(st.prefix_query_tokens, 10 + 12 + 10);
  EXPECT_EQ(st.prefix_hit_tokens, 16);
  EXPECT_DOUBLE_EQ(st.prefix_hit_rate, 16.0 / 32.0);
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST(KVCachePrefix, AlwaysLeavesOnePromptTokenToCompute) {
  KVCache c = MakeCache();
  const std::vector<int32_t> prompt = Iota(8);  // exactly two pages
  ASSERT_TRUE(c.ReleaseSequence(Prefill(c, prompt)).ok());
  EXPECT_EQ(c.Stats().pages_cached, 2);
  EXPECT_EQ(c.MatchPrefix(prompt).tokens, 4) << "the last token's logits must be computed";
  EXPECT_EQ(c.MatchPrefix(Iota(9)).tokens, 8);
  EXPECT_EQ(c.MatchPrefix(Iota(1)).tokens, 0);
  EXPECT_EQ(c.MatchPrefix({}).tokens, 0);
  EXPECT_EQ(c.MatchPrefix(Iota(9, 101)).tokens, 0) << "other tokens";
}

TEST(KVCachePrefix, ExtraKeyIsolates) {
  KVCache c = MakeCache();
  const std::vector<int32_t> prompt = Iota(9);
  ASSERT_TRUE(c.ReleaseSequence(Prefill(c, prompt, "tenant-a")).ok());
  EXPECT_EQ(c.MatchPrefix(prompt, "tenant-a").tokens, 8);
  EXPECT_EQ(c.MatchPrefix(prompt, "tenant-b").tokens, 0);
  EXPECT_EQ(c.MatchPrefix(prompt).tokens, 0);
}

TEST(KVCachePrefix, EvictsLeastRecentlyReleasedFirstAndEmitsEvents) {
  KVCache c = MakeCache(/*pages=*/6);
  const std::vector<int32_t> p1 = Iota(9, 0), p2 = Iota(9, 1000);
  const SequenceId a = Prefill(c, p1);  // 3 pages, 2 indexed
  const SequenceId b = Prefill(c, p2);  // 3 pages, 2 indexed
  KVEventBatch ev = c.TakeEvents();
  ASSERT_EQ(ev.events.size(), 2u);
  const KVEvent e0 = ev.events[0];
  EXPECT_EQ(e0.type, KVEventType::kBlockStored);
  ASSERT_EQ(e0.block_hashes.size(), 2u);
  EXPECT_FALSE(e0.has_parent);
  EXPECT_EQ(e0.token_ids, Iota(8, 0));
  EXPECT_EQ(e0.block_size, kPs);
  ASSERT_TRUE(c.ReleaseSequence(a).ok());  // a's pages are older in the LRU
  ASSERT_TRUE(c.ReleaseSequence(b).ok());
  EXPECT_EQ(c.Stats().pages_cached, 4);
  // 5 pages: 2 free, then 3 evicted: a's last page, a's first, then b's last.
  const SequenceId d = c.CreateSequence().value();
  const std::vector<int32_t> ids = Iota(20, 5000);
  absl::StatusOr<StepInfo> info = c.PrepareStep({{d, 20, ids}});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->pages_allocated, 5);
  EXPECT_EQ(info->pages_evicted, 3);
  EXPECT_EQ(c.Stats().evictions, 3);
  EXPECT_EQ(c.MatchPrefix(p1).tokens, 0);
  EXPECT_EQ(c.MatchPrefix(p2).tokens, 4) << "b's first page survives";
  ev = c.TakeEvents();
  ASSERT_GE(ev.events.size(), 1u);
  EXPECT_EQ(ev.events[0].type, KVEventType::kBlockRemoved);
  ASSERT_EQ(ev.events[0].block_hashes.size(), 3u);
  EXPECT_EQ(ev.events[0].block_hashes[0], e0.block_hashes[1]);
  EXPECT_EQ(ev.events[0].block_hashes[1], e0.block_hashes[0]);
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST(KVCachePrefix, AStepBeyondFreeAndEvictablePagesChangesNothing) {
  KVCache c = MakeCache(/*pages=*/6);
  ASSERT_TRUE(c.ReleaseSequence(Prefill(c, Iota(9))).ok());  // 2 cached, 4 free
  const SequenceId d = c.CreateSequence().value();
  const std::vector<int32_t> ids = Iota(28, 7);
  absl::StatusOr<StepPlan> plan = c.PlanStep({{d, 28, ids}});
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->fits);
  EXPECT_EQ(plan->pages_needed, 7);
  EXPECT_EQ(plan->pages_free, 4);
  EXPECT_EQ(plan->pages_evictable, 2);
  const testing::Snapshot before = TakeSnapshot(c);
  absl::StatusOr<StepInfo> info = c.PrepareStep({{d, 28, ids}});
  EXPECT_EQ(info.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(c)), "");
  EXPECT_EQ(c.MatchPrefix(Iota(9)).tokens, 8) << "no eviction on a refused step";
  plan = c.PlanStep({{d, 24, absl::Span<const int32_t>(ids.data(), 24)}});
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->fits);
  EXPECT_EQ(plan->pages_evicted, 2);
  EXPECT_EQ(plan->pages_left, 0);
  EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(c)), "") << "PlanStep changes nothing";
  EXPECT_EQ(c.PlanStep({{d, 3, ids}}).status().code(), absl::StatusCode::kInvalidArgument)
      << "token_ids must match num_new_tokens";
  EXPECT_EQ(c.PrepareStep({{d, 3, ids}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(c)), "");
}

TEST(KVCachePrefix, PlanStepCountsCopiesOfSharedPartialPages) {
  KVCache c = MakeCache();
  const SequenceId a = Prefill(c, Iota(6));
  absl::StatusOr<SequenceId> b = c.ForkSequence(a);
  ASSERT_TRUE(b.ok());
  const std::vector<int32_t> t = {1, 2};
  absl::StatusOr<StepPlan> plan = c.PlanStep({{a, 1, {t.data(), 1}}, {*b, 2, t}});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->pages_copied, 1);
  EXPECT_EQ(plan->pages_needed, 1);
  EXPECT_TRUE(plan->fits);
  EXPECT_EQ(plan->tokens_left, (16 - 2 - 1) * kPs);
  absl::StatusOr<StepInfo> info = c.PrepareStep({{a, 1, {t.data(), 1}}, {*b, 2, t}});
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pages_copied, 1);
  EXPECT_EQ(info->pages_allocated, 1);
}

TEST(KVCachePrefix, TruncatedIndexedPageLeavesTheIndexBeforeItIsOverwritten) {
  KVCache c = MakeCache();
  const std::vector<int32_t> prompt = Iota(9);
  const SequenceId a = Prefill(c, prompt);
  const std::vector<int32_t> pa = Pages(c, a);
  ASSERT_TRUE(c.Truncate(a, 6).ok());  // page 1 is now a's partial last page, still indexed
  EXPECT_EQ(c.Stats().pages_cached, 0) << "page 2 was not indexed: it is free";
  EXPECT_EQ(c.MatchPrefix(prompt).tokens, 8);
  c.TakeEvents();
  const std::vector<int32_t> other = {7, 7};
  ASSERT_TRUE(c.PrepareStep({{a, 2, other}}).ok());
  EXPECT_EQ(Pages(c, a)[1], pa[1]) << "sole owner: written in place";
  EXPECT_EQ(c.MatchPrefix(prompt).tokens, 4) << "the overwritten page is no longer matched";
  const KVEventBatch ev = c.TakeEvents();
  ASSERT_EQ(ev.events.size(), 2u);
  EXPECT_EQ(ev.events[0].type, KVEventType::kBlockRemoved);
  EXPECT_EQ(ev.events[1].type, KVEventType::kBlockStored) << "the page, full again, re-indexed";
  EXPECT_TRUE(ev.events[1].has_parent);
  EXPECT_EQ(ev.events[1].token_ids, (std::vector<int32_t>{104, 105, 7, 7}));
  // Shared: the other holder keeps the indexed page; the writer copies it.
  absl::StatusOr<SequenceId> b = c.ForkSequence(a);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(c.Truncate(*b, 5).ok());
  const std::vector<int32_t> x = {9};
  absl::StatusOr<StepInfo> info = c.PrepareStep({{*b, 1, x}});
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pages_copied, 1);
  EXPECT_NE(Pages(c, *b)[1], pa[1]);
  std::vector<int32_t> again = {100, 101, 102, 103, 104, 105, 7, 7, 0};
  EXPECT_EQ(c.MatchPrefix(again).tokens, 8);
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST(KVCachePrefix, StepsWithoutTokenIdsStopTracking) {
  KVCache c = MakeCache();
  const SequenceId s = c.CreateSequence().value();
  const std::vector<int32_t> ids = Iota(4);
  ASSERT_TRUE(c.PrepareStep({{s, 4, ids}}).ok());
  ASSERT_TRUE(c.PrepareStep({{s, 4}}).ok());  // no ids
  const std::vector<int32_t> more = Iota(4, 200);
  ASSERT_TRUE(c.PrepareStep({{s, 4, more}}).ok());
  EXPECT_EQ(c.Stats().pages_indexed, 1) << "only the page filled while tracked";
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST(KVCachePrefix, ScaleChangesClearTheIndex) {
  KVCache c = MakeCache();
  const std::vector<int32_t> prompt = Iota(9);
  ASSERT_TRUE(c.ReleaseSequence(Prefill(c, prompt)).ok());
  ASSERT_EQ(c.Stats().pages_cached, 2);
  c.TakeEvents();
  // Only cached pages: no tokens held, so the change is allowed, and clears.
  ASSERT_TRUE(c.UpdateGlobalScales(0, 0.5f, 0.5f).ok());
  KVCacheStats st = c.Stats();
  EXPECT_EQ(st.pages_cached, 0);
  EXPECT_EQ(st.pages_free, st.pages_total);
  EXPECT_EQ(c.MatchPrefix(prompt).tokens, 0);
  KVEventBatch ev = c.TakeEvents();
  ASSERT_EQ(ev.events.size(), 1u);
  EXPECT_EQ(ev.events[0].type, KVEventType::kAllBlocksCleared);
  // A live sequence: refused without re-encode (nothing changes), cleared with it.
  const SequenceId a = Prefill(c, prompt);
  ASSERT_TRUE(c.PrepareStep({}).ok());  // the prefill's tokens now count as held
  c.TakeEvents();
  const testing::Snapshot before = TakeSnapshot(c);
  EXPECT_EQ(c.UpdateGlobalScales(1, 0.25f, 0.25f).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(c)), "");
  EXPECT_EQ(c.MatchPrefix(prompt).tokens, 8);
  ASSERT_TRUE(c.UpdateGlobalScales(1, 0.25f, 0.25f, nullptr, StoredTokens::kReencode).ok());
  EXPECT_EQ(c.MatchPrefix(prompt).tokens, 0);
  EXPECT_EQ(c.Stats().pages_indexed, 0) << "re-encoded pages are never re-indexed";
  ASSERT_TRUE(c.ReleaseSequence(a).ok());
  st = c.Stats();
  EXPECT_EQ(st.pages_free, st.pages_total);
  ev = c.TakeEvents();
  ASSERT_EQ(ev.events.size(), 1u);
  EXPECT_EQ(ev.events[0].type, KVEventType::kAllBlocksCleared);
  // ResetPrefixCache does the same on demand.
  ASSERT_TRUE(c.ReleaseSequence(Prefill(c, prompt)).ok());
  EXPECT_EQ(c.Stats().pages_cached, 2);
  c.ResetPrefixCache();
  EXPECT_EQ(c.Stats().pages_cached, 0);
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST(KVCachePrefix, PagesAreCachedOnlyOnceEveryLayerIsCalibrated) {
  KVCache c = MakeCache(16, true, /*explicit_scales=*/false);
  testing::TokenFactory f(c);
  absl::StatusOr<CacheAppender> app = c.appender();
  ASSERT_TRUE(app.ok());
  testing::StepInputs in;
  const SequenceId s = c.CreateSequence().value();
  const std::vector<int32_t> ids = Iota(8);
  std::vector<testing::Token> toks;
  for (int i = 0; i < 8; ++i) toks.push_back(f.Make(i + 1));
  ASSERT_TRUE(c.PrepareStep({{s, 8, ids}}).ok());
  EXPECT_EQ(c.Stats().pages_indexed, 0) << "pending layers: not cached";
  ASSERT_TRUE(testing::FillStepInputs(c, toks, &in, nullptr).ok());
  ASSERT_TRUE(testing::RunAppendAllLayers(c, *app, &in, nullptr).ok());
  ASSERT_TRUE(c.ReadScales(1)->k_calibrated);
  const std::vector<int32_t> more = Iota(4, 108);
  ASSERT_TRUE(c.PrepareStep({{s, 4, more}}).ok());
  EXPECT_EQ(c.Stats().pages_indexed, 1) << "calibrated now: the third page is cached";
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST(KVCachePrefix, EventQueueOverflowIsCounted) {
  KVCacheOptions o;
  o.num_layers = 1;
  o.geometry.num_kv_heads = 1;
  o.geometry.head_dim_k = o.geometry.head_dim_v = 16;
  o.geometry.page_size = kPs;
  o.geometry.num_pages = 32;
  o.k_global_scales = o.v_global_scales = {0.01f};
  o.max_pages_per_seq = 8;
  o.prefix_cache.enabled = true;
  o.prefix_cache.max_pending_events = 2;
  absl::StatusOr<KVCache> c = KVCache::Create(o);
  ASSERT_TRUE(c.ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(c->ReleaseSequence(Prefill(*c, Iota(5, 10 * i))).ok());
  EXPECT_EQ(c->Stats().events_dropped, 3);
  const KVEventBatch b = c->TakeEvents();
  EXPECT_EQ(b.events.size(), 2u);
  EXPECT_EQ(b.dropped, 3u);
  o.prefix_cache.max_pending_events = -1;
  EXPECT_EQ(KVCache::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  // Beyond 2^24 events (docs/kv_cache.md, "Allocation and budget rules"):
  // refused by name rather than left to grow without bound.
  for (int64_t bad : {(int64_t{1} << 24) + 1, INT64_MAX}) {
    o.prefix_cache.max_pending_events = bad;
    absl::Status st = KVCache::Create(o).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("prefix_cache.max_pending_events"), absl::string_view::npos);
  }
  o.prefix_cache.max_pending_events = int64_t{1} << 24;
  EXPECT_TRUE(KVCache::Create(o).ok());
}

}  // namespace
}  // namespace fp4kv
