// KVCache: the host tier of the prefix cache (PrefixCacheOptions::host_bytes):
// demotion of evicted cached pages, the host LRU, promotion by
// CreateSequenceFromPrefix (byte-exact, all or nothing), MatchPrefix's split
// by tier, KV events with their medium, and scale changes clearing both
// tiers. The byte checks run on the CPU and (named Gpu/...) on GPU 0.
// PromotionInFlight (GPU): who waits for a promotion's copy (sharers and
// reusers of its pages, a copy on write or an import of either kind into
// one) and who does not (steps of other sequences).
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
#include "testing/kv_cache_harness.h"
#include "testing/test_util.h"

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
  // The K/V of a prompt token id prefilled before.
  Token TokenOf(int32_t id) const { return by_id_.at(id); }
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

// A demotion batch whose copies fail to enqueue (a CUDA error) takes its
// pages out of the host tier again and queues none of their kHost events
// (docs/kv_cache.md, "Demotion"). No test injects that failure: nothing in
// the library can make a CUDA call fail on demand, and the CPU device copies
// at once. The success path below shows the deferred events unchanged:
// every host eviction since b's first step, cancelled copies included.
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

// Short host-tier copies (page ids in the launch): demotions and
// promotions of 1, 2 and 3 pages, each back on the device byte for byte.
TEST_P(PrefixHostTest, ShortDemotionsAndPromotionsAreByteExact) {
  for (int pages : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << pages << " pages");
    KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(device_, 8, 8));
    Model m(&c, stream_);
    const std::vector<int32_t> pa = Iota(pages * kPs + 1, 100 * pages);
    absl::StatusOr<PrefixSequence> a = m.Prefill(pa);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(m.Release(a->seq).ok());
    // A step of eight pages without token ids evicts (demotes) a's pages.
    const SequenceId hog = c.CreateSequence().value();
    ASSERT_TRUE(c.PrepareStep({{hog, 8 * kPs}}, stream_).ok());
    ASSERT_TRUE(c.ReleaseSequence(hog).ok());
    EXPECT_EQ(c.Stats().host_prefix_demotions, pages);
    ASSERT_EQ(c.MatchPrefix(pa).tokens_host, pages * kPs);
    absl::StatusOr<PrefixSequence> a2 = m.Prefill(pa);
    ASSERT_TRUE(a2.ok()) << a2.status();
    EXPECT_EQ(a2->host_tokens, pages * kPs);
    EXPECT_EQ(c.Stats().host_prefix_promotions, pages);
    EXPECT_EQ(m.CheckResident(), "");
    ASSERT_TRUE(m.Release(a2->seq).ok());
    ASSERT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
  }
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

// ------------------------------------------------------ promotions in flight
// A stream held at a host function until Release() (or 30 s, so that a
// missing ordering fails the test instead of hanging it). A promotion's
// copy follows the work on the latest step's stream: holding that stream
// keeps the promotion in flight for as long as the test needs.
class StreamHold {
 public:
  explicit StreamHold(cudaStream_t s) : released_(std::make_shared<std::atomic<bool>>(false)) {
    auto* held = new std::shared_ptr<std::atomic<bool>>(released_);
    ok_ = cudaLaunchHostFunc(s, &Wait, held) == cudaSuccess;
    if (!ok_) delete held;
  }
  StreamHold(const StreamHold&) = delete;
  StreamHold& operator=(const StreamHold&) = delete;
  ~StreamHold() { Release(); }
  bool ok() const { return ok_; }
  void Release() { released_->store(true); }

 private:
  static void CUDART_CB Wait(void* p) {
    std::unique_ptr<std::shared_ptr<std::atomic<bool>>> held(
        static_cast<std::shared_ptr<std::atomic<bool>>*>(p));
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!(*held)->load() && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  std::shared_ptr<std::atomic<bool>> released_;
  bool ok_ = false;
};

// Whether all work on `s` completes within `seconds` (polled: no host wait
// that could hang).
bool CompletesWithin(cudaStream_t s, double seconds) {
  const auto end = std::chrono::steady_clock::now() +
                   std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                       std::chrono::duration<double>(seconds));
  for (;;) {
    const cudaError_t r = cudaStreamQuery(s);
    if (r == cudaSuccess) return true;
    if (r != cudaErrorNotReady) return false;
    (void)cudaGetLastError();
    if (std::chrono::steady_clock::now() >= end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Two non-blocking streams (the held one must not stall the test's own
// synchronous copies on the default stream): `a_` runs the setup steps and
// is held while a promotion is in flight; `b_` runs the step under test.
// The cache: 12 device pages, 8 host pages, one step slot.
class PromotionInFlight : public ::testing::Test {
 protected:
  void SetUp() override {
    FP4KV_SKIP_WITHOUT_GPU();
    ASSERT_EQ(cudaStreamCreateWithFlags(&a_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&b_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (a_ != nullptr) (void)cudaStreamDestroy(a_);
    if (b_ != nullptr) (void)cudaStreamDestroy(b_);
  }
  Stream A() const { return reinterpret_cast<Stream>(a_); }
  Stream B() const { return reinterpret_cast<Stream>(b_); }

  // Prefills pa (four full pages and one token) on A, releases it, and
  // demotes its four cached pages with a 12-page step of a sequence without
  // token ids (released: every device page free again).
  void DemotePrompt(KVCache& c, Model& m, const std::vector<int32_t>& pa) {
    absl::StatusOr<PrefixSequence> a = m.Prefill(pa);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(m.Release(a->seq).ok());
    const SequenceId hog = c.CreateSequence().value();
    ASSERT_TRUE(c.PrepareStep({{hog, 12 * kPs}}, A()).ok());
    ASSERT_TRUE(c.ReleaseSequence(hog).ok());
    ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
    const PrefixMatch match = c.MatchPrefix(pa);
    ASSERT_EQ(match.tokens_host, 16);
    ASSERT_EQ(c.Stats().pages_free, 12);
  }

  // Promotes pa's four host pages (after DemotePrompt): with A held by the
  // caller's StreamHold, the copy stays in flight until the hold is released.
  void PromoteHeld(KVCache& c, const std::vector<int32_t>& pa, PrefixSequence* out) {
    absl::StatusOr<PrefixSequence> p = c.CreateSequenceFromPrefix(pa);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_EQ(p->host_tokens, 16);
    *out = *p;
  }

  // PromoteHeld, then the promoter released and the index cleared: the
  // promoted pages, their copy still held back, are free pages again (the
  // pool then has `free` free pages; no eviction, so no demotion orders later
  // work after the copies).
  void PromoteHeldThenFree(KVCache& c, const std::vector<int32_t>& pa, int64_t free) {
    PrefixSequence p;
    ASSERT_NO_FATAL_FAILURE(PromoteHeld(c, pa, &p));
    ASSERT_TRUE(c.ReleaseSequence(p.seq).ok());
    c.ResetPrefixCache();
    ASSERT_EQ(c.Stats().pages_free, free);
  }

  // Lets the held promotion go and waits for A, B and every copy.
  void ReleaseAndDrain(StreamHold& hold, KVCache& c) {
    hold.Release();
    ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(b_), cudaSuccess);
    ASSERT_TRUE(c.SynchronizeSwaps().ok());
  }

  cudaStream_t a_ = nullptr;
  cudaStream_t b_ = nullptr;
};

TEST_F(PromotionInFlight, StepOfOtherSequencesDoesNotWaitForIt) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(Device::Cuda(0), 12, 8));
  Model m(&c, A());
  const std::vector<int32_t> pa = Iota(17, 100);
  ASSERT_NO_FATAL_FAILURE(DemotePrompt(c, m, pa));
  absl::StatusOr<CacheAppender> app = c.appender();
  ASSERT_TRUE(app.ok()) << app.status();
  TokenFactory f(c);
  std::vector<Token> ut;
  for (int i = 0; i < kPs; ++i) ut.push_back(f.Make(5000 + i));
  testing::StepInputs in;
  ASSERT_TRUE(testing::FillStepInputs(c, ut, &in, B()).ok());
  const SequenceId u = c.CreateSequence().value();

  StreamHold hold(a_);
  ASSERT_TRUE(hold.ok());
  PrefixSequence p;
  ASSERT_NO_FATAL_FAILURE(PromoteHeld(c, pa, &p));  // in flight behind A
  ASSERT_TRUE(c.PrepareStep({{u, kPs}}, B()).ok());
  ASSERT_TRUE(testing::RunAppendAllLayers(c, *app, &in, B()).ok());
  EXPECT_TRUE(CompletesWithin(b_, 10.0)) << "a step of another sequence waited for the promotion";
  EXPECT_EQ(cudaStreamQuery(a_), cudaErrorNotReady) << "the promotion was not held";
  (void)cudaGetLastError();
  hold.Release();
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  ASSERT_TRUE(c.SynchronizeSwaps().ok());
  ASSERT_EQ(cudaStreamSynchronize(b_), cudaSuccess);
  const testing::PoolCopy pools = DownloadPools(c);
  std::vector<Token> pt;
  for (int i = 0; i < 16; ++i) pt.push_back(m.TokenOf(pa[i]));
  EXPECT_EQ(testing::CheckSequenceBytes(c, pools, p.seq, pt), "");
  EXPECT_EQ(testing::CheckSequenceBytes(c, pools, u, ut), "");
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST_F(PromotionInFlight, SequenceSharingThePromotedPagesWaitsForIt) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(Device::Cuda(0), 12, 8));
  Model m(&c, A());
  const std::vector<int32_t> pa = Iota(17, 100);
  const CacheGeometry& g = c.geometry();
  const int64_t rows = 17, row = int64_t{g.num_kv_heads} * g.head_dim_k;
  // The reference: layer 0 of pa's sequence read before it is demoted.
  absl::StatusOr<PrefixSequence> a = m.Prefill(pa);
  ASSERT_TRUE(a.ok()) << a.status();
  testing::Buffer rk(c.device(), rows * row * 2), rv(c.device(), rows * row * 2);
  testing::Buffer out_k(c.device(), rows * row * 2), out_v(c.device(), rows * row * 2);
  ASSERT_TRUE(out_k.Fill(0xA5) && out_v.Fill(0xA5));
  ASSERT_TRUE(c.ReadSequence(0, a->seq, rk.View(DType::kBF16, {rows, g.num_kv_heads, g.head_dim_k}),
                             rv.View(DType::kBF16, {rows, g.num_kv_heads, g.head_dim_v}), A())
                  .ok());
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  const std::vector<uint16_t> want_k = rk.DownloadAs<uint16_t>(rows * row);
  const std::vector<uint16_t> want_v = rv.DownloadAs<uint16_t>(rows * row);
  ASSERT_TRUE(m.Release(a->seq).ok());
  const SequenceId hog = c.CreateSequence().value();
  ASSERT_TRUE(c.PrepareStep({{hog, 12 * kPs}}, A()).ok());
  ASSERT_TRUE(c.ReleaseSequence(hog).ok());
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  ASSERT_EQ(c.MatchPrefix(pa).tokens_host, 16);
  absl::StatusOr<CacheAppender> app = c.appender();
  ASSERT_TRUE(app.ok()) << app.status();
  testing::StepInputs in;
  const std::vector<Token> last = {m.TokenOf(pa[16])};
  ASSERT_TRUE(testing::FillStepInputs(c, last, &in, B()).ok());

  StreamHold hold(a_);
  ASSERT_TRUE(hold.ok());
  PrefixSequence p;
  ASSERT_NO_FATAL_FAILURE(PromoteHeld(c, pa, &p));  // the promoter
  // Another sequence of the same prompt shares the promoted pages (device
  // hits); its step and read on B come after the copy.
  absl::StatusOr<PrefixSequence> s2 = c.CreateSequenceFromPrefix(pa);
  ASSERT_TRUE(s2.ok()) << s2.status();
  ASSERT_EQ(s2->cached_tokens, 16);
  ASSERT_EQ(s2->host_tokens, 0);
  ASSERT_TRUE(
      c.PrepareStep({{s2->seq, 1, absl::Span<const int32_t>(pa.data() + 16, 1)}}, B()).ok());
  ASSERT_TRUE(testing::RunAppendAllLayers(c, *app, &in, B()).ok());
  EXPECT_FALSE(CompletesWithin(b_, 0.25)) << "the sharer's step did not wait for the promotion";
  ASSERT_TRUE(c.ReadSequence(0, s2->seq,
                             out_k.View(DType::kBF16, {rows, g.num_kv_heads, g.head_dim_k}),
                             out_v.View(DType::kBF16, {rows, g.num_kv_heads, g.head_dim_v}), B())
                  .ok());
  ASSERT_NO_FATAL_FAILURE(ReleaseAndDrain(hold, c));
  // Read on B while the copy was held back: equal only if B waited for it.
  EXPECT_EQ(out_k.DownloadAs<uint16_t>(rows * row), want_k);
  EXPECT_EQ(out_v.DownloadAs<uint16_t>(rows * row), want_v);
  const testing::PoolCopy pools = DownloadPools(c);
  std::vector<Token> st;
  for (int32_t id : pa) st.push_back(m.TokenOf(id));
  EXPECT_EQ(testing::CheckSequenceBytes(c, pools, s2->seq, st), "");
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

TEST_F(PromotionInFlight, StepReusingAPromotedPageWaitsForIt) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(Device::Cuda(0), 12, 8));
  Model m(&c, A());
  const std::vector<int32_t> pa = Iota(17, 100);
  ASSERT_NO_FATAL_FAILURE(DemotePrompt(c, m, pa));
  absl::StatusOr<CacheAppender> app = c.appender();
  ASSERT_TRUE(app.ok()) << app.status();
  TokenFactory f(c);
  std::vector<Token> ut;
  for (int i = 0; i < 12 * kPs; ++i) ut.push_back(f.Make(7000 + i));
  testing::StepInputs in;
  ASSERT_TRUE(testing::FillStepInputs(c, ut, &in, B()).ok());
  const SequenceId u = c.CreateSequence().value();

  StreamHold hold(a_);
  ASSERT_TRUE(hold.ok());
  ASSERT_NO_FATAL_FAILURE(PromoteHeldThenFree(c, pa, 12));
  // u takes every page of the pool, the four promoted ones among them.
  ASSERT_TRUE(c.PrepareStep({{u, 12 * kPs}}, B()).ok());
  ASSERT_TRUE(testing::RunAppendAllLayers(c, *app, &in, B()).ok());
  EXPECT_FALSE(CompletesWithin(b_, 0.25)) << "the step wrote pages the promotion still writes";
  ASSERT_NO_FATAL_FAILURE(ReleaseAndDrain(hold, c));
  // Had the step not waited, the copy (held back until now) would have
  // overwritten four of u's pages after its appends.
  const testing::PoolCopy pools = DownloadPools(c);
  EXPECT_EQ(testing::CheckSequenceBytes(c, pools, u, ut), "");
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

// Copy on write into a page a promotion still writes: a fork's first step
// copies the shared partial last page into a fresh page, and when the only
// free pages are the promoted ones (released, out of the index) that copy,
// enqueued before the step's upload, must come after the promotion's copy.
TEST_F(PromotionInFlight, CopyOnWriteIntoAPromotedPageWaitsForIt) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(Device::Cuda(0), 12, 8));
  Model m(&c, A());
  const std::vector<int32_t> pa = Iota(17, 100);
  ASSERT_NO_FATAL_FAILURE(DemotePrompt(c, m, pa));
  // x: 5 tokens (its second page partial); a sequence without token ids takes
  // 6 more pages, so the 4 left free are the ones the promotion takes.
  const std::vector<int32_t> px = Iota(5, 300);
  absl::StatusOr<PrefixSequence> x = m.Prefill(px);
  ASSERT_TRUE(x.ok()) << x.status();
  const SequenceId hog = c.CreateSequence().value();
  ASSERT_TRUE(c.PrepareStep({{hog, 6 * kPs}}, A()).ok());
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  ASSERT_EQ(c.Stats().pages_free, 4);
  absl::StatusOr<CacheAppender> app = c.appender();
  ASSERT_TRUE(app.ok()) << app.status();
  TokenFactory f(c);
  const std::vector<Token> yt = {f.Make(9000)};
  testing::StepInputs in;
  ASSERT_TRUE(testing::FillStepInputs(c, yt, &in, B()).ok());

  StreamHold hold(a_);
  ASSERT_TRUE(hold.ok());
  ASSERT_NO_FATAL_FAILURE(PromoteHeldThenFree(c, pa, 4));
  absl::StatusOr<SequenceId> y = c.ForkSequence(x->seq);
  ASSERT_TRUE(y.ok()) << y.status();
  absl::StatusOr<StepInfo> info = c.PrepareStep({{*y, 1}}, B());
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->pages_allocated, 1) << "the step did not copy the shared page on write";
  ASSERT_TRUE(testing::RunAppendAllLayers(c, *app, &in, B()).ok());
  EXPECT_FALSE(CompletesWithin(b_, 0.25)) << "the copy on write did not wait for the promotion";
  ASSERT_NO_FATAL_FAILURE(ReleaseAndDrain(hold, c));
  // Had the copy on write not waited, the promotion's copy (held back until
  // now) would have overwritten y's last page after the copy and the append.
  const testing::PoolCopy pools = DownloadPools(c);
  std::vector<Token> xt;
  for (int32_t id : px) xt.push_back(m.TokenOf(id));
  std::vector<Token> all = xt;
  all.push_back(yt[0]);
  EXPECT_EQ(testing::CheckSequenceBytes(c, pools, x->seq, xt), "");
  EXPECT_EQ(testing::CheckSequenceBytes(c, pools, *y, all), "");
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

// An import whose reserved pages are ones a promotion still writes: its
// copies into them come after the promotion's copy.
TEST_F(PromotionInFlight, ImportIntoAPromotedPageWaitsForIt) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(Device::Cuda(0), 12, 8));
  Model m(&c, A());
  const std::vector<int32_t> pa = Iota(17, 100);
  ASSERT_NO_FATAL_FAILURE(DemotePrompt(c, m, pa));
  // z: 9 tokens (3 pages), exported to pinned memory on B; a sequence without
  // token ids takes 5 more pages, so the 4 left free are the promotion's.
  const std::vector<int32_t> pz = Iota(9, 400);
  absl::StatusOr<PrefixSequence> z = m.Prefill(pz);
  ASSERT_TRUE(z.ok()) << z.status();
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  const int64_t bytes = c.ExportedBytes(z->seq).value();
  void* image = nullptr;
  ASSERT_EQ(cudaMallocHost(&image, static_cast<size_t>(bytes)), cudaSuccess);
  std::unique_ptr<void, void (*)(void*)> free_image(image, [](void* q) { (void)cudaFreeHost(q); });
  ASSERT_TRUE(c.ExportSequence(z->seq, image, bytes, B()).ok());
  ASSERT_EQ(cudaStreamSynchronize(b_), cudaSuccess);
  const SequenceId hog = c.CreateSequence().value();
  ASSERT_TRUE(c.PrepareStep({{hog, 5 * kPs}}, A()).ok());
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  ASSERT_EQ(c.Stats().pages_free, 4);

  StreamHold hold(a_);
  ASSERT_TRUE(hold.ok());
  ASSERT_NO_FATAL_FAILURE(PromoteHeldThenFree(c, pa, 4));
  absl::StatusOr<SequenceId> got = c.ImportSequence(image, bytes, {}, B());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE(CompletesWithin(b_, 0.25)) << "the import did not wait for the promotion";
  ASSERT_NO_FATAL_FAILURE(ReleaseAndDrain(hold, c));
  // Had the import not waited, the promotion's copy (held back until now)
  // would have overwritten three of the imported pages.
  const testing::PoolCopy pools = DownloadPools(c);
  std::vector<Token> zt;
  for (int32_t id : pz) zt.push_back(m.TokenOf(id));
  EXPECT_EQ(testing::CheckSequenceBytes(c, pools, z->seq, zt), "");
  EXPECT_EQ(testing::CheckSequenceBytes(c, pools, *got, zt), "");
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

// ImportHalfPages into pages a promotion still writes: its quantization
// into them comes after the promotion's copy. Checked against an import of
// the same rows made first, with nothing in flight (same scales, so the same
// bytes); that import also loads the quantization kernel, whose first
// (lazy) load could otherwise wait for the held stream on the host.
TEST_F(PromotionInFlight, HalfPageImportIntoAPromotedPageWaitsForIt) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(Device::Cuda(0), 12, 8));
  Model m(&c, A());
  const std::vector<int32_t> pa = Iota(17, 100);
  ASSERT_NO_FATAL_FAILURE(DemotePrompt(c, m, pa));
  const CacheGeometry& g = c.geometry();
  // Per layer a stacked HND bf16 cache of 3 pages of random rows.
  constexpr int kSrcPages = 3;
  const int64_t elems = int64_t{kSrcPages} * 2 * g.num_kv_heads * kPs * g.head_dim_k;
  std::vector<testing::Buffer> src;
  std::vector<HalfPagedCache> layers;
  src.reserve(static_cast<size_t>(c.num_layers()));
  for (int l = 0; l < c.num_layers(); ++l) {
    src.emplace_back(c.device(), static_cast<size_t>(elems) * 2);
    const std::vector<uint16_t> rows = testing::RandomHalfBits(DType::kBF16, elems, 31 + l);
    ASSERT_TRUE(src.back().Upload(rows.data(), rows.size() * 2));
  }
  for (int l = 0; l < c.num_layers(); ++l) {
    absl::StatusOr<HalfPagedCache> v = HalfPagedCache::FromStacked(
        src[l].View(DType::kBF16, {kSrcPages, 2, g.num_kv_heads, kPs, g.head_dim_k}),
        Layout::kHND);
    ASSERT_TRUE(v.ok()) << v.status();
    layers.push_back(*v);
  }
  const std::vector<int32_t> src_pages = {2, 0, 1};
  const int64_t length = 3 * kPs - 1;
  // The reference: imported, exported, released (its pages free again).
  absl::StatusOr<SequenceId> ref = c.ImportHalfPages(layers, src_pages, length, B());
  ASSERT_TRUE(ref.ok()) << ref.status();
  const int64_t bytes = c.ExportedBytes(*ref).value();
  std::vector<uint64_t> want(static_cast<size_t>(bytes / 8 + 2)), got(want.size());
  ASSERT_TRUE(c.ExportSequence(*ref, want.data(), bytes, B()).ok());
  ASSERT_EQ(cudaStreamSynchronize(b_), cudaSuccess);
  ASSERT_TRUE(c.ReleaseSequence(*ref).ok());
  const SequenceId hog = c.CreateSequence().value();
  ASSERT_TRUE(c.PrepareStep({{hog, 8 * kPs}}, A()).ok());
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  ASSERT_EQ(c.Stats().pages_free, 4);

  StreamHold hold(a_);
  ASSERT_TRUE(hold.ok());
  ASSERT_NO_FATAL_FAILURE(PromoteHeldThenFree(c, pa, 4));
  absl::StatusOr<SequenceId> under = c.ImportHalfPages(layers, src_pages, length, B());
  ASSERT_TRUE(under.ok()) << under.status();
  EXPECT_FALSE(CompletesWithin(b_, 0.25)) << "the import did not wait for the promotion";
  ASSERT_NO_FATAL_FAILURE(ReleaseAndDrain(hold, c));
  // Had the import not waited, the promotion's copy (held back until then)
  // would have overwritten three of its pages.
  ASSERT_EQ(c.ExportedBytes(*under).value(), bytes);
  ASSERT_TRUE(c.ExportSequence(*under, got.data(), bytes, B()).ok());
  ASSERT_EQ(cudaStreamSynchronize(b_), cudaSuccess);
  EXPECT_TRUE(got == want) << "the import under the promotion holds other bytes";
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

// A step whose stream waits for a promotion uploads its step buffers before
// that wait: the upload overlaps the copy, and the next one-slot
// PrepareStep (which waits on the host for the previous upload) does not wait
// for the promotion.
TEST_F(PromotionInFlight, StepUploadDoesNotWaitForIt) {
  KVCache c = testing::CreateCacheOrAbort(HostPrefixOptions(Device::Cuda(0), 12, 8));
  Model m(&c, A());
  const std::vector<int32_t> pa = Iota(17, 100);
  ASSERT_NO_FATAL_FAILURE(DemotePrompt(c, m, pa));
  const SequenceId u = c.CreateSequence().value();

  StreamHold hold(a_);
  ASSERT_TRUE(hold.ok());
  PrefixSequence p;
  ASSERT_NO_FATAL_FAILURE(PromoteHeld(c, pa, &p));  // in flight behind A
  // The promoted sequence's own step (no copy on write: its new token opens
  // a page): B waits for the copy after the step's upload.
  ASSERT_TRUE(c.PrepareStep({{p.seq, 1, absl::Span<const int32_t>(pa.data() + 16, 1)}}, B()).ok());
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(c.PrepareStep({{u, 1}}, B()).ok());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 5.0) << "the next PrepareStep waited for the promotion on the host";
  EXPECT_EQ(cudaStreamQuery(a_), cudaErrorNotReady) << "the promotion was not held";
  (void)cudaGetLastError();
  EXPECT_EQ(cudaStreamQuery(b_), cudaErrorNotReady) << "B did not wait for the promotion";
  (void)cudaGetLastError();
  hold.Release();
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  ASSERT_TRUE(c.SynchronizeSwaps().ok());
  ASSERT_EQ(cudaStreamSynchronize(b_), cudaSuccess);
  EXPECT_EQ(c.SequenceLength(p.seq).value(), 17);
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

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
