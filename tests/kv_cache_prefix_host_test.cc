// KVCache: the host tier of the prefix cache (PrefixCacheOptions::host_bytes):
// demotion of evicted cached pages, the host LRU, promotion by
// CreateSequenceFromPrefix (byte-exact, all or nothing), MatchPrefix's split
// by tier, KV events with their medium, and scale changes clearing both
// tiers. The byte checks run on the CPU and (named Gpu/...) on GPU 0.
#include <cuda_runtime_api.h>

#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
#include "testing/kv_cache_harness.h"

namespace fp4kv {
namespace {

using testing::DownloadPools;
using testing::Token;
using testing::TokenFactory;

constexpr int kPs = 4;

// host_pages: 0 (no host tier of the prefix cache) or an even count.
KVCacheOptions HostPrefixOptions(Device device, int64_t pages, int64_t host_pages) {
  KVCacheOptions o;
  o.num_layers = 2;
  o.geometry.num_kv_heads = 2;
  o.geometry.head_dim_k = 32;
  o.geometry.head_dim_v = 32;
  o.geometry.page_size = kPs;
  o.geometry.num_pages = pages;
  o.device = device;
  o.k_global_scales = {0.5f, 1.5f};
  o.v_global_scales = {0.75f, 2.0f};
  o.max_seqs_per_step = 4;
  o.max_tokens_per_step = 64;
  o.max_pages_per_seq = 16;
  o.prefix_cache.enabled = true;
  o.prefix_cache.max_pending_events = 256;
  // Exactly host_pages (an even count): per layer, K and V data regions of
  // 128 bytes a page and scale regions of 16, each rounded up to 256 bytes.
  auto region = [&](int64_t page_bytes) { return (host_pages * page_bytes + 255) / 256 * 256; };
  o.prefix_cache.host_bytes = o.num_layers * 2 * (region(128) + region(16));
  return o;
}

std::vector<int32_t> Iota(int n, int32_t from) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

// Prompts prefilled through the bound appender with fresh tokens, and the
// tokens of every sequence.
class Model {
 public:
  Model(KVCache* cache, Stream stream) : cache_(cache), stream_(stream), factory_(*cache) {
    absl::StatusOr<CacheAppender> a = cache->appender();
    EXPECT_TRUE(a.ok()) << a.status();
    if (a.ok()) appender_.emplace(*a);
  }
  // CreateSequenceFromPrefix + one step of the rest of the prompt. The
  // reused tokens are those of the prompt's earlier prefill (by prompt id).
  absl::StatusOr<PrefixSequence> Prefill(const std::vector<int32_t>& prompt) {
    absl::StatusOr<PrefixSequence> p = cache_->CreateSequenceFromPrefix(prompt);
    if (!p.ok()) return p;
    std::vector<Token>& mine = tokens_[p->seq];
    for (int64_t i = 0; i < p->cached_tokens; ++i) mine.push_back(by_id_.at(prompt[i]));
    const int64_t rest = static_cast<int64_t>(prompt.size()) - p->cached_tokens;
    StepEntry e{p->seq, static_cast<int32_t>(rest),
                absl::Span<const int32_t>(prompt.data() + p->cached_tokens, rest)};
    absl::StatusOr<StepInfo> info = cache_->PrepareStep({e}, stream_);
    if (!info.ok()) return info.status();
    std::vector<Token> toks;
    for (int64_t i = p->cached_tokens; i < static_cast<int64_t>(prompt.size()); ++i) {
      auto it = by_id_.find(prompt[i]);
      Token t = it != by_id_.end() ? it->second : factory_.Make(next_++);
      by_id_[prompt[i]] = t;
      toks.push_back(t);
      mine.push_back(t);
    }
    absl::Status s = testing::FillStepInputs(*cache_, toks, &inputs_, stream_);
    if (s.ok()) s = testing::RunAppendAllLayers(*cache_, *appender_, &inputs_, stream_);
    if (!s.ok()) return s;
    return p;
  }
  absl::Status Release(SequenceId id) {
    tokens_.erase(id);
    return cache_->ReleaseSequence(id);
  }
  // "" when every live sequence holds its tokens' bytes.
  std::string CheckResident() {
    if (absl::Status s = cache_->SynchronizeSwaps(); !s.ok()) return std::string(s.message());
    if (cache_->device().is_cuda() &&
        cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream_)) != cudaSuccess) {
      return "sync failed";
    }
    const testing::PoolCopy pools = DownloadPools(*cache_);
    for (const auto& [id, toks] : tokens_) {
      std::string e = testing::CheckSequenceBytes(*cache_, pools, id, toks);
      if (!e.empty()) return e;
    }
    return "";
  }

 private:
  KVCache* cache_;
  Stream stream_;
  TokenFactory factory_;
  std::optional<CacheAppender> appender_;
  std::map<SequenceId, std::vector<Token>> tokens_;
  std::map<int32_t, Token> by_id_;  // prompt token id -> its K/V (the same id, the same rows)
  testing::StepInputs inputs_;
  uint64_t next_ = 7;
};

class PrefixHostTest : public testing::CpuOrGpuStreamTest {};

TEST_P(PrefixHostTest, EvictedPagesAreDemotedAndPromotedBackByteExact) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(device_, 8, 8));
  EXPECT_EQ(c.Stats().host_prefix_pages_total, 8);
  Model m(&c, stream_);
  const std::vector<int32_t> pa = Iota(17, 100);  // four full pages and one token
  absl::StatusOr<PrefixSequence> a = m.Prefill(pa);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(m.Release(a->seq).ok());
  EXPECT_EQ(c.Stats().pages_cached, 4);
  (void)c.TakeEvents();
  // Eight pages of another prompt evict a's four cached pages: demoted.
  const std::vector<int32_t> pb = Iota(32, 1000);
  absl::StatusOr<PrefixSequence> b = m.Prefill(pb);
  ASSERT_TRUE(b.ok()) << b.status();
  KVCacheStats st = c.Stats();
  EXPECT_EQ(st.evictions, 4);
  EXPECT_EQ(st.host_prefix_demotions, 4);
  EXPECT_EQ(st.host_prefix_pages_cached, 4);
  KVEventBatch ev = c.TakeEvents();
  int gpu_removed = 0, host_stored = 0;
  for (const KVEvent& e : ev.events) {
    if (e.type == KVEventType::kBlockRemoved && e.medium == KVMedium::kGpu)
      gpu_removed += static_cast<int>(e.block_hashes.size());
    if (e.type == KVEventType::kBlockStored && e.medium == KVMedium::kHost) {
      host_stored += static_cast<int>(e.block_hashes.size());
      EXPECT_EQ(e.token_ids.size(), e.block_hashes.size() * kPs);
    }
  }
  EXPECT_EQ(gpu_removed, 4);
  EXPECT_EQ(host_stored, 4);
  ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
  ASSERT_TRUE(m.Release(b->seq).ok());
  EXPECT_EQ(c.Stats().pages_cached, 8);

  // a's prompt hits on the host only.
  const PrefixMatch match = c.MatchPrefix(pa);
  EXPECT_EQ(match.tokens, 16);
  EXPECT_EQ(match.tokens_host, 16);
  EXPECT_EQ(match.pages_host, 4);
  EXPECT_EQ(match.tokens_gpu, 0);
  // Promotion: four new device pages (evicting, so demoting, b's four
  // least recently used: its deepest), the bytes as written; the step of
  // the prompt's last token takes one more (demoting b's fourth page).
  absl::StatusOr<PrefixSequence> a2 = m.Prefill(pa);
  ASSERT_TRUE(a2.ok()) << a2.status();
  EXPECT_EQ(a2->cached_tokens, 16);
  EXPECT_EQ(a2->host_tokens, 16);
  st = c.Stats();
  EXPECT_EQ(st.host_prefix_promotions, 4);
  EXPECT_EQ(st.prefix_hit_tokens_host, 16);
  EXPECT_EQ(st.host_prefix_demotions, 4 + 4 + 1);
  EXPECT_EQ(st.host_prefix_pages_cached, 5) << "promoted pages leave the host tier";
  EXPECT_EQ(m.CheckResident(), "");
  ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
  // The promoted pages are indexed on the device again: a later match hits
  // there, sharing them.
  const PrefixMatch again = c.MatchPrefix(pa);
  EXPECT_EQ(again.tokens_gpu, 16);
  EXPECT_EQ(again.tokens_host, 0);
  // b: its first three pages are cached on the device, the next four on
  // the host (its eighth page holds its last token: never matched). While
  // a2 holds five of the eight device pages, a promotion of four does not
  // fit: the match ends before the host pages.
  PrefixMatch mb = c.MatchPrefix(pb);
  EXPECT_EQ(mb.tokens, 12);
  EXPECT_EQ(mb.tokens_host, 0);
  ASSERT_TRUE(m.Release(a2->seq).ok());
  mb = c.MatchPrefix(pb);
  EXPECT_EQ(mb.tokens, 28);
  EXPECT_EQ(mb.tokens_host, 16);
  EXPECT_EQ(mb.tokens_gpu, 12);
  absl::StatusOr<PrefixSequence> b2 = m.Prefill(pb);
  ASSERT_TRUE(b2.ok()) << b2.status();
  EXPECT_EQ(b2->cached_tokens, 28);
  EXPECT_EQ(b2->host_tokens, 16);
  EXPECT_EQ(m.CheckResident(), "");
  ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST_P(PrefixHostTest, FullHostTierDropsItsLeastRecentlyUsedPage) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(device_, 4, 2));
  Model m(&c, stream_);
  const std::vector<int32_t> pa = Iota(13, 100);  // three full pages
  absl::StatusOr<PrefixSequence> a = m.Prefill(pa);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(m.Release(a->seq).ok());
  (void)c.TakeEvents();
  // Four new pages evict a's three: the host tier keeps the two most
  // recently used (a's deeper pages are evicted first: the first page is
  // the most recently released); the third takes the host page of the
  // first, whose copy is then never made.
  absl::StatusOr<PrefixSequence> b = m.Prefill(Iota(16, 500));
  ASSERT_TRUE(b.ok()) << b.status();
  KVCacheStats st = c.Stats();
  EXPECT_EQ(st.host_prefix_demotions, 2);
  EXPECT_EQ(st.host_prefix_pages_cached, 2);
  ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
  ASSERT_TRUE(m.Release(b->seq).ok());
  // The two kept pages are a's first two: a's prompt hits eight tokens.
  const PrefixMatch ma = c.MatchPrefix(pa);
  EXPECT_EQ(ma.tokens_host, 8);
  // b's four pages, demoted now, push a's two out of the host tier (its
  // LRU), and b's deeper two are pushed out by its first two in the same
  // batch (their copies cancelled): four more host evictions.
  absl::StatusOr<PrefixSequence> d = m.Prefill(Iota(16, 900));
  ASSERT_TRUE(d.ok()) << d.status();
  st = c.Stats();
  EXPECT_EQ(st.host_prefix_pages_cached, 2);
  EXPECT_EQ(st.host_prefix_evictions, 1 + 4);
  EXPECT_EQ(st.host_prefix_demotions, 2 + 2);
  EXPECT_EQ(c.MatchPrefix(pa).tokens, 0);
  int host_removed = 0;
  for (const KVEvent& e : c.TakeEvents().events) {
    if (e.type == KVEventType::kBlockRemoved && e.medium == KVMedium::kHost)
      host_removed += static_cast<int>(e.block_hashes.size());
  }
  EXPECT_EQ(host_removed, 1 + 4) << "every host eviction since b's first step";
  EXPECT_EQ(m.CheckResident(), "");
  ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST_P(PrefixHostTest, PromotionThatDoesNotFitEndsTheMatchBeforeTheHostPages) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(device_, 6, 8));
  Model m(&c, stream_);
  const std::vector<int32_t> pa = Iota(9, 100);  // two full pages
  absl::StatusOr<PrefixSequence> a = m.Prefill(pa);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(m.Release(a->seq).ok());
  // Six live pages (no token ids: nothing cached) evict a's two.
  const SequenceId hog = c.CreateSequence().value();
  ASSERT_TRUE(c.PrepareStep({{hog, 24}}, stream_).ok());
  EXPECT_EQ(c.Stats().host_prefix_pages_cached, 2);
  EXPECT_EQ(c.Stats().pages_free + c.Stats().pages_cached, 0);
  const PrefixMatch none = c.MatchPrefix(pa);
  EXPECT_EQ(none.tokens, 0) << "no device page for a promotion";
  EXPECT_EQ(none.tokens_host, 0);
  absl::StatusOr<PrefixSequence> p = c.CreateSequenceFromPrefix(pa);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->cached_tokens, 0);
  EXPECT_EQ(c.Stats().host_prefix_pages_cached, 2) << "the host pages stay";
  ASSERT_TRUE(c.ReleaseSequence(p->seq).ok());
  ASSERT_TRUE(c.ReleaseSequence(hog).ok());
  EXPECT_EQ(c.MatchPrefix(pa).tokens_host, 8);
  ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST_P(PrefixHostTest, ScaleChangeClearsBothTiers) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(device_, 4, 4));
  Model m(&c, stream_);
  const std::vector<int32_t> pa = Iota(9, 100);
  absl::StatusOr<PrefixSequence> a = m.Prefill(pa);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(m.Release(a->seq).ok());
  absl::StatusOr<PrefixSequence> b = m.Prefill(Iota(13, 500));
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(m.Release(b->seq).ok());
  ASSERT_GT(c.Stats().host_prefix_pages_cached, 0);
  ASSERT_GT(c.Stats().pages_cached, 0);
  (void)c.TakeEvents();
  ASSERT_TRUE(c.UpdateGlobalScales(0, 0.25f, 0.25f, stream_).ok());
  const KVCacheStats st = c.Stats();
  EXPECT_EQ(st.host_prefix_pages_cached, 0);
  EXPECT_EQ(st.pages_cached, 0);
  EXPECT_EQ(c.MatchPrefix(pa).tokens, 0);
  const KVEventBatch ev = c.TakeEvents();
  ASSERT_EQ(ev.events.size(), 1u);
  EXPECT_EQ(ev.events[0].type, KVEventType::kAllBlocksCleared);
  ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST_P(PrefixHostTest, EvictionTakesTheLowestPriorityFirstInBothTiers) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(device_, 6, 2));
  Model m(&c, stream_);
  // A system prompt (priority 2) released before a one-off document
  // (priority 0): plain LRU would evict the system prompt first.
  const std::vector<int32_t> sys = Iota(9, 100);  // two full pages
  const std::vector<int32_t> doc = Iota(9, 300);
  absl::StatusOr<PrefixSequence> a = m.Prefill(sys);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(c.SetRetentionPriority(a->seq, 2).ok());
  absl::StatusOr<PrefixSequence> b = m.Prefill(doc);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(m.Release(a->seq).ok());
  ASSERT_TRUE(m.Release(b->seq).ok());
  EXPECT_EQ(c.Stats().pages_cached, 4);
  // Four new pages: two free ones, then two evictions: the document's.
  const SequenceId x = c.CreateSequence().value();
  ASSERT_TRUE(c.PrepareStep({{x, 16}}, stream_).ok());
  EXPECT_EQ(c.MatchPrefix(sys).tokens_gpu, 8) << "the system prompt stays on the device";
  EXPECT_EQ(c.MatchPrefix(doc).tokens_host, 8) << "the document was demoted";
  // Two more pages evict the system prompt: demoted with its priority, it
  // displaces nothing of a higher priority and pushes the document (0) out.
  const SequenceId y = c.CreateSequence().value();
  ASSERT_TRUE(c.PrepareStep({{y, 8}}, stream_).ok());
  EXPECT_EQ(c.MatchPrefix(sys).tokens_host, 0) << "no device page for a promotion now";
  ASSERT_TRUE(c.ReleaseSequence(y).ok());
  EXPECT_EQ(c.MatchPrefix(sys).tokens_host, 8);
  EXPECT_EQ(c.MatchPrefix(doc).tokens, 0);
  // A page of priority 0 finds only priority-2 pages on the full host tier:
  // it is dropped, they stay.
  absl::StatusOr<PrefixSequence> d = m.Prefill(Iota(5, 700));  // one full page
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(m.Release(d->seq).ok());
  const SequenceId z = c.CreateSequence().value();
  ASSERT_TRUE(c.PrepareStep({{z, 2 * kPs}}, stream_).ok());  // a free page, then the new one
  EXPECT_EQ(c.MatchPrefix(Iota(5, 700)).tokens, 0);
  ASSERT_TRUE(c.ReleaseSequence(z).ok());
  EXPECT_EQ(c.MatchPrefix(sys).tokens_host, 8);
  EXPECT_EQ(m.CheckResident(), "");
  ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST_P(PrefixHostTest, TwoStepSlotsDemoteRetiredPagesAndPromoteByteExact) {
  KVCacheOptions o = HostPrefixOptions(device_, 8, 8);
  o.step_slots = 2;
  KVCache c = testing::CreateCacheOrAbort(o);
  Model m(&c, stream_);
  const std::vector<int32_t> pa = Iota(17, 100);
  absl::StatusOr<PrefixSequence> a = m.Prefill(pa);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(m.Release(a->seq).ok());
  EXPECT_EQ(c.Stats().pages_retiring, 5) << "released while its step may be in flight";
  // Empty steps retire a's pages (cached once no step in flight can use
  // them); then eight pages of another prompt demote a's four.
  ASSERT_TRUE(c.PrepareStep({}, stream_).ok());
  ASSERT_TRUE(c.PrepareStep({}, stream_).ok());
  EXPECT_EQ(c.Stats().pages_cached, 4);
  absl::StatusOr<PrefixSequence> b = m.Prefill(Iota(32, 1000));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(c.Stats().host_prefix_demotions, 4);
  ASSERT_TRUE(m.Release(b->seq).ok());
  ASSERT_TRUE(c.PrepareStep({}, stream_).ok());
  ASSERT_TRUE(c.PrepareStep({}, stream_).ok());
  EXPECT_EQ(c.MatchPrefix(pa).tokens_host, 16);
  absl::StatusOr<PrefixSequence> a2 = m.Prefill(pa);
  ASSERT_TRUE(a2.ok()) << a2.status();
  EXPECT_EQ(a2->host_tokens, 16);
  EXPECT_EQ(m.CheckResident(), "");
  ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

INSTANTIATE_TEST_SUITE_P(Cpu, PrefixHostTest, ::testing::Values(false));
INSTANTIATE_TEST_SUITE_P(Gpu, PrefixHostTest, ::testing::Values(true));

TEST(PrefixHostOptions, BadHostBytesAreRefusedNamingTheOption) {
  KVCacheOptions o = HostPrefixOptions(Device::Cpu(), 8, 0);
  o.prefix_cache.host_bytes = -1;
  absl::StatusOr<KVCache> c = KVCache::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("prefix_cache.host_bytes"), std::string::npos)
      << c.status();
  o.prefix_cache.host_bytes = 1;  // less than one page
  c = KVCache::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("one page"), std::string::npos) << c.status();
  o = HostPrefixOptions(Device::Cpu(), 8, 4);
  o.prefix_cache.enabled = false;
  c = KVCache::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("without prefix caching"), std::string::npos)
      << c.status();
}

TEST(PrefixHostOptions, BadRetentionPriorityIsRefusedAndChangesNothing) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(Device::Cpu(), 4, 0));
  const SequenceId s = c.CreateSequence().value();
  for (int bad : {-1, kMaxRetentionPriority + 1}) {
    const absl::Status st = c.SetRetentionPriority(s, bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("priority"), std::string::npos) << st;
    EXPECT_NE(st.message().find(std::to_string(bad)), std::string::npos) << st;
  }
  EXPECT_EQ(c.SetRetentionPriority(s + 100, 1).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(c.SetRetentionPriority(s, kMaxRetentionPriority).ok());
}

TEST(PrefixHostOptions, PrioritiesWithoutAHostTierOrderTheDevicesEvictions) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(Device::Cpu(), 4, 0));
  const std::vector<int32_t> hi = Iota(5, 100), lo = Iota(5, 200);  // one full page each
  absl::StatusOr<PrefixSequence> a = c.CreateSequenceFromPrefix(hi);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(c.PrepareStep({{a->seq, 5, hi}}).ok());
  ASSERT_TRUE(c.SetRetentionPriority(a->seq, 1).ok());
  absl::StatusOr<PrefixSequence> b = c.CreateSequenceFromPrefix(lo);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(c.PrepareStep({{b->seq, 5, lo}}).ok());
  // A fork keeps the parent's priority: its drop raises the page too.
  absl::StatusOr<SequenceId> f = c.ForkSequence(a->seq);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(c.ReleaseSequence(a->seq).ok());
  ASSERT_TRUE(c.ReleaseSequence(*f).ok());
  ASSERT_TRUE(c.ReleaseSequence(b->seq).ok());
  const SequenceId x = c.CreateSequence().value();
  ASSERT_TRUE(c.PrepareStep({{x, 3 * kPs}}).ok());  // two free pages, one eviction
  EXPECT_EQ(c.MatchPrefix(hi).tokens, 4) << "the priority-1 page stays";
  EXPECT_EQ(c.MatchPrefix(lo).tokens, 0) << "the priority-0 page went first";
  // Revived and released again by a priority-0 holder: priority 0 again.
  absl::StatusOr<PrefixSequence> a2 = c.CreateSequenceFromPrefix(hi);
  ASSERT_TRUE(a2.ok());
  ASSERT_EQ(a2->cached_tokens, 4);
  ASSERT_TRUE(c.ReleaseSequence(a2->seq).ok());
  ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST(PrefixHostOptions, MatchPrefixOfHostPagesChangesNothing) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(Device::Cpu(), 4, 4));
  const std::vector<int32_t> pa = Iota(9, 100);
  absl::StatusOr<PrefixSequence> a = c.CreateSequenceFromPrefix(pa);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(c.PrepareStep({{a->seq, 9, pa}}).ok());
  ASSERT_TRUE(c.ReleaseSequence(a->seq).ok());
  const SequenceId b = c.CreateSequence().value();
  ASSERT_TRUE(c.PrepareStep({{b, 16}}).ok());  // demotes a's two pages
  ASSERT_TRUE(c.ReleaseSequence(b).ok());
  const testing::Snapshot before = testing::TakeSnapshot(c);
  const KVCacheStats st = c.Stats();
  const PrefixMatch m = c.MatchPrefix(pa);
  EXPECT_EQ(m.tokens_host, 8);
  EXPECT_EQ(testing::DiffSnapshots(before, testing::TakeSnapshot(c)), "");
  const KVCacheStats st2 = c.Stats();
  EXPECT_EQ(st2.host_prefix_pages_cached, st.host_prefix_pages_cached);
  EXPECT_EQ(st2.host_prefix_promotions, 0);
  EXPECT_EQ(st2.prefix_queries, st.prefix_queries);
  ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST(PrefixHostOptions, ZeroKeepsDroppingEvictedPages) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(Device::Cpu(), 4, 0));
  const std::vector<int32_t> pa = Iota(9, 100);
  absl::StatusOr<PrefixSequence> a = c.CreateSequenceFromPrefix(pa);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(c.PrepareStep({{a->seq, 9, pa}}).ok());
  ASSERT_TRUE(c.ReleaseSequence(a->seq).ok());
  const SequenceId b = c.CreateSequence().value();
  ASSERT_TRUE(c.PrepareStep({{b, 16}}).ok());
  const KVCacheStats st = c.Stats();
  EXPECT_EQ(st.evictions, 2);
  EXPECT_EQ(st.host_prefix_pages_total, 0);
  EXPECT_EQ(st.host_prefix_demotions, 0);
  EXPECT_EQ(c.MatchPrefix(pa).tokens, 0);
  for (const KVEvent& e : c.TakeEvents().events) EXPECT_EQ(e.medium, KVMedium::kGpu);
  ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

}  // namespace
}  // namespace fp4kv
