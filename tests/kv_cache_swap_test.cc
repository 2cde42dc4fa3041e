// KVCache's host tier: SwapOut / SwapIn round trips byte for byte (NVFP4
// and FP8 keys), shared pages staying valid for the other holders, swapped
// sequences refused by steps and reads (FailedPrecondition naming them),
// all-or-nothing allocation, scale changes refused while tokens are swapped
// out, Stats, and a fuzz of swaps interleaved with steps, forks,
// truncations, releases and export/import against a model of every
// sequence's tokens (one seed with FP8 keys), also with every page copy
// held back (GPU). Cases run on the CPU device and, named Gpu/..., on a GPU
// (skipped without one).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fp4kv/calibrate.h"
#include "fp4kv/format.h"
#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
#include "testing/kv_cache_harness.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::DiffSnapshots;
using testing::DownloadPools;
using testing::TakeSnapshot;
using testing::Token;
using testing::TokenFactory;

KVCacheOptions SwapOptions(Device device, int64_t pages, int64_t host_pages,
                           Layout layout = Layout::kNHD, int page_size = 4,
                           KeyFormat keys = KeyFormat::kNvfp4) {
  KVCacheOptions o;
  o.num_layers = 2;
  o.geometry.num_kv_heads = 2;
  o.geometry.head_dim_k = 64;
  o.geometry.head_dim_v = 32;
  o.geometry.page_size = page_size;
  o.geometry.layout = layout;
  o.geometry.key_format = keys;
  o.geometry.num_pages = pages;
  o.device = device;
  o.k_global_scales = {0.5f, 1.5f};
  o.v_global_scales = {0.75f, 2.0f};
  o.max_seqs_per_step = 6;
  o.max_tokens_per_step = 48;
  o.max_pages_per_seq = 16;
  o.host_tier.host_pages = host_pages;
  return o;
}

// true: the GPU
class SwapTest : public testing::CpuOrGpuStreamTest {
 protected:
  // The swap fuzz (FuzzSwapsInterleavedWithSteps), on this case's device,
  // checking every resident sequence's bytes after every check_every-th
  // operation (the checks wait for every copy; the operations between them
  // are ordered by the cache alone).
  void RunSwapFuzz(int check_every);
};

// Steps of fresh tokens through the bound appender, and the model of every
// sequence's tokens.
class Model {
 public:
  Model(KVCache* cache, Stream stream, uint64_t seed)
      : cache_(cache), stream_(stream), factory_(*cache), next_(seed * 1000003 + 1) {
    absl::StatusOr<CacheAppender> a = cache->appender();
    EXPECT_TRUE(a.ok()) << a.status();
    if (a.ok()) appender_.emplace(*a);
  }
  SequenceId Create() {
    const SequenceId id = cache_->CreateSequence().value();
    tokens_[id];
    return id;
  }
  absl::Status Step(const std::vector<StepEntry>& entries) {
    absl::StatusOr<StepInfo> info = cache_->PrepareStep(entries, stream_);
    if (!info.ok()) return info.status();
    std::vector<Token> toks;
    for (const StepEntry& e : entries) {
      for (int i = 0; i < e.num_new_tokens; ++i) {
        toks.push_back(factory_.Make(next_++));
        tokens_[e.seq].push_back(toks.back());
      }
    }
    absl::Status s = testing::FillStepInputs(*cache_, toks, &inputs_, stream_);
    if (s.ok()) s = testing::RunAppendAllLayers(*cache_, *appender_, &inputs_, stream_);
    return s;
  }
  std::map<SequenceId, std::vector<Token>>& tokens() { return tokens_; }
  // "" when every resident sequence holds its tokens' bytes.
  std::string CheckResident() {
    if (absl::Status s = cache_->SynchronizeSwaps(); !s.ok()) return std::string(s.message());
    if (cache_->device().is_cuda() &&
        cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream_)) != cudaSuccess) {
      return "sync failed";
    }
    const testing::PoolCopy pools = DownloadPools(*cache_);
    for (const auto& [id, toks] : tokens_) {
      absl::StatusOr<bool> sw = cache_->IsSwappedOut(id);
      if (!sw.ok()) return std::string(sw.status().message());
      if (*sw) continue;
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
  testing::StepInputs inputs_;
  uint64_t next_;
};

TEST_P(SwapTest, SwapOutInRoundTripIsByteExact) {
  for (KeyFormat keys : {KeyFormat::kNvfp4, KeyFormat::kFp8}) {
    for (Layout layout : {Layout::kNHD, Layout::kHND}) {
      for (int page_size : {1, 4, 5, 8, 16}) {  // 13, 4, 3, 2, 1 pages for a
        SCOPED_TRACE(::testing::Message() << LayoutName(layout) << " page " << page_size << " keys "
                                          << KeyFormatName(keys));
        KVCache cache = testing::CreateCacheOrAbort(SwapOptions(device_, 40, 40, layout, page_size, keys));
        // FP8 keys: Dk key bytes per row, no key scales (2 heads, Dk 64, Dv 32).
        EXPECT_EQ(
            cache.geometry().PageBytes(),
            int64_t{page_size} * 2 * (keys == KeyFormat::kFp8 ? 64 + 16 + 2 : 32 + 4 + 16 + 2));
        Model m(&cache, stream_, 3);
        const SequenceId a = m.Create();
        const SequenceId b = m.Create();
        ASSERT_TRUE(m.Step({{a, 13}, {b, 2 * page_size}}).ok()) << page_size;
        const int64_t a_pages = (13 + page_size - 1) / page_size;
        ASSERT_TRUE(cache.SwapOut(a, stream_).ok());
        EXPECT_TRUE(*cache.IsSwappedOut(a));
        // b keeps stepping while a is out (its copy may still be in flight).
        ASSERT_TRUE(m.Step({{b, 3}}).ok());
        ASSERT_TRUE(cache.SynchronizeSwaps().ok());
        KVCacheStats st = cache.Stats();
        EXPECT_EQ(st.sequences_swapped, 1);
        EXPECT_EQ(st.host_pages_used, a_pages);
        EXPECT_EQ(st.host_pages_total, 40);
        EXPECT_EQ(st.swaps_in_flight, 0);
        EXPECT_EQ(st.pages_used, (2 * page_size + 3 + page_size - 1) / page_size);
        EXPECT_EQ(st.bytes_swapped_out, a_pages * cache.geometry().PageBytes() * 2);
        EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
        // Pages freed by the swap are reused by another sequence, overwritten.
        const SequenceId c = m.Create();
        ASSERT_TRUE(m.Step({{c, 13}}).ok());
        ASSERT_TRUE(cache.SwapIn(a, stream_).ok());
        EXPECT_FALSE(*cache.IsSwappedOut(a));
        EXPECT_EQ(cache.Stats().host_pages_used, 0);
        EXPECT_EQ(cache.Stats().bytes_swapped_in, a_pages * cache.geometry().PageBytes() * 2);
        // a joins a step right away (its stream waits for the copy).
        ASSERT_TRUE(m.Step({{a, 2}, {b, 1}, {c, 1}}).ok());
        EXPECT_EQ(m.CheckResident(), "");
        EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
      }
    }
  }
}

// Host copies of up to PageCopyParams::kInlineIds (64) pages carry their
// page ids in the launch; longer ones upload them first. A 100-page
// sequence (page size 1) goes out and back byte for byte, with its freed
// pages overwritten meanwhile (150 device pages: the 128 of another
// sequence's step take at least 78 of them).
TEST_P(SwapTest, SwapOfMorePagesThanTheLaunchCarriesIsByteExact) {
  for (KeyFormat keys : {KeyFormat::kNvfp4, KeyFormat::kFp8}) {
    SCOPED_TRACE(KeyFormatName(keys));
    KVCacheOptions o = SwapOptions(device_, 150, 120, Layout::kNHD, 1, keys);
    o.max_pages_per_seq = 128;
    o.max_tokens_per_step = 128;
    KVCache cache = testing::CreateCacheOrAbort(o);
    Model m(&cache, stream_, 5);
    const SequenceId a = m.Create();
    ASSERT_TRUE(m.Step({{a, 100}}).ok());
    ASSERT_TRUE(cache.SwapOut(a, stream_).ok());
    const SequenceId b = m.Create();
    ASSERT_TRUE(m.Step({{b, 128}}).ok());  // reuses pages a freed
    ASSERT_TRUE(cache.SynchronizeSwaps().ok());
    EXPECT_EQ(cache.Stats().host_pages_used, 100);
    ASSERT_TRUE(cache.ReleaseSequence(b).ok());
    m.tokens().erase(b);
    ASSERT_TRUE(cache.SwapIn(a, stream_).ok());
    ASSERT_TRUE(m.Step({{a, 1}}).ok());
    EXPECT_EQ(m.CheckResident(), "");
    EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
  }
}

// The host tier holds a sequence's bytes exactly: the pages a swap-in
// brings back are byte for byte those swapped out (whole pages, every layer
// and region; FP8 keys without key scales), also when the freed device
// pages were overwritten meanwhile.
TEST_P(SwapTest, SwappedBackPagesHoldTheSameBytes) {
  for (KeyFormat keys : {KeyFormat::kNvfp4, KeyFormat::kFp8}) {
    SCOPED_TRACE(KeyFormatName(keys));
    KVCache cache = testing::CreateCacheOrAbort(SwapOptions(device_, 12, 12, Layout::kHND, 4, keys));
    Model m(&cache, stream_, 21);
    const SequenceId a = m.Create();
    ASSERT_TRUE(m.Step({{a, 15}}).ok());  // 4 pages, the last partial
    auto page_bytes = [&](SequenceId id) {
      const testing::PoolCopy pools = DownloadPools(cache);
      std::vector<uint8_t> out;
      absl::StatusOr<absl::Span<const int32_t>> pages = cache.SequencePages(id);
      EXPECT_TRUE(pages.ok()) << pages.status();
      if (!pages.ok()) return out;
      for (const std::vector<uint8_t>& region : pools.regions) {
        const int64_t pb = static_cast<int64_t>(region.size()) / cache.geometry().num_pages;
        for (int32_t p : *pages) {
          out.insert(out.end(), region.begin() + p * pb, region.begin() + (p + 1) * pb);
        }
      }
      return out;
    };
    ASSERT_TRUE(cache.SynchronizeSwaps().ok());
    Sync();
    const std::vector<uint8_t> before = page_bytes(a);
    ASSERT_TRUE(cache.SwapOut(a, stream_).ok());
    const SequenceId b = m.Create();
    ASSERT_TRUE(m.Step({{b, 30}}).ok());  // reuses the freed pages
    ASSERT_TRUE(cache.SwapIn(a, stream_).ok());
    ASSERT_TRUE(cache.SynchronizeSwaps().ok());
    ASSERT_TRUE(m.Step({{b, 1}}).ok());  // a step after the swap-in orders the copy
    Sync();
    EXPECT_EQ(page_bytes(a), before);
    EXPECT_EQ(m.CheckResident(), "");
    EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
  }
}

TEST_P(SwapTest, SharedPagesStayValidForTheOtherSequence) {
  KVCache cache = testing::CreateCacheOrAbort(SwapOptions(device_, 24, 24));
  Model m(&cache, stream_, 5);
  const SequenceId parent = m.Create();
  ASSERT_TRUE(m.Step({{parent, 10}}).ok());  // 2 full pages + a partial one
  absl::StatusOr<SequenceId> child = cache.ForkSequence(parent);
  ASSERT_TRUE(child.ok());
  m.tokens()[*child] = m.tokens()[parent];
  ASSERT_TRUE(cache.SwapOut(parent, stream_).ok());
  // The child appends to the shared partial last page (copy on write while
  // the swap may still read it) and stays intact.
  ASSERT_TRUE(m.Step({{*child, 5}}).ok());
  EXPECT_EQ(m.CheckResident(), "");
  ASSERT_TRUE(cache.SynchronizeSwaps().ok());
  EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
  const std::vector<int32_t> child_pages(cache.SequencePages(*child)->begin(),
                                         cache.SequencePages(*child)->end());
  for (int32_t p : child_pages) EXPECT_EQ(*cache.PageRefCount(p), 1);
  ASSERT_TRUE(cache.SwapIn(parent, stream_).ok());  // fresh pages: sharing is not restored
  ASSERT_TRUE(m.Step({{parent, 1}, {*child, 1}}).ok());
  EXPECT_EQ(m.CheckResident(), "");
  EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
  // A swap-out then swap-in before the copy is seen done keeps the pages.
  ASSERT_TRUE(cache.SwapOut(*child, stream_).ok());
  ASSERT_TRUE(cache.SwapIn(*child, stream_).ok());
  ASSERT_TRUE(m.Step({{*child, 2}}).ok());
  EXPECT_EQ(m.CheckResident(), "");
  EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
}

TEST_P(SwapTest, SwappedSequencesAreRefusedAndFailuresChangeNothing) {
  KVCache cache = testing::CreateCacheOrAbort(SwapOptions(device_, 12, 4));
  Model m(&cache, stream_, 7);
  const SequenceId a = m.Create();
  const SequenceId b = m.Create();
  ASSERT_TRUE(m.Step({{a, 9}, {b, 20}}).ok());  // 3 and 5 pages
  ASSERT_TRUE(cache.SwapOut(a, stream_).ok());
  ASSERT_TRUE(cache.SynchronizeSwaps().ok());
  const testing::Snapshot before = TakeSnapshot(cache);
  const KVCacheStats st0 = cache.Stats();
  auto expect_names = [&](const absl::Status& s, absl::StatusCode code) {
    EXPECT_EQ(s.code(), code) << s;
    if (code == absl::StatusCode::kFailedPrecondition) {
      EXPECT_NE(s.message().find(std::to_string(a)), absl::string_view::npos) << s;
    }
  };
  expect_names(cache.PrepareStep({{b, 1}, {a, 1}}, stream_).status(),
               absl::StatusCode::kFailedPrecondition);
  expect_names(cache.PlanStep({{a, 0}}).status(), absl::StatusCode::kFailedPrecondition);
  expect_names(cache.ForkSequence(a).status(), absl::StatusCode::kFailedPrecondition);
  expect_names(cache.Truncate(a, 1), absl::StatusCode::kFailedPrecondition);
  expect_names(cache.SwapOut(a, stream_), absl::StatusCode::kFailedPrecondition);
  expect_names(cache.ExportSequence(a, nullptr, 0), absl::StatusCode::kFailedPrecondition);
  expect_names(cache.UpdateGlobalScales(0, 1.0f, 1.0f, stream_, StoredTokens::kReencode),
               absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.SwapIn(b, stream_).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.SwapOut(999, stream_).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache.SwapIn(999, stream_).code(), absl::StatusCode::kNotFound);
  // b needs 5 host pages, 1 is free.
  EXPECT_EQ(cache.SwapOut(b, stream_).code(), absl::StatusCode::kResourceExhausted);
  // Fill the device pool so that a cannot come back (3 pages needed).
  EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(cache)), "");
  const SequenceId c = m.Create();
  ASSERT_TRUE(m.Step({{c, 4 * 4}}).ok());  // 4 pages: 12 - 5 - 4 = 3 free
  const SequenceId d = m.Create();
  ASSERT_TRUE(m.Step({{d, 1}}).ok());  // 2 free
  const testing::Snapshot full = TakeSnapshot(cache);
  EXPECT_EQ(cache.SwapIn(a, stream_).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(DiffSnapshots(full, TakeSnapshot(cache)), "");
  EXPECT_TRUE(*cache.IsSwappedOut(a));
  ASSERT_TRUE(cache.ReleaseSequence(d).ok());
  m.tokens().erase(d);
  ASSERT_TRUE(cache.SwapIn(a, stream_).ok());
  EXPECT_EQ(m.CheckResident(), "");
  // Right after a SwapOut (its copy possibly in flight), a step needing its
  // pages is planned to fit and runs (PrepareStep waits for the copy).
  {
    const SequenceId e = m.Create();
    ASSERT_TRUE(cache.SwapOut(a, stream_).ok());
    absl::StatusOr<StepPlan> plan = cache.PlanStep({{e, 3 * 4}});  // 3 pages; 0 free before
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->fits);
    EXPECT_EQ(plan->pages_left, 0);
    ASSERT_TRUE(m.Step({{e, 3 * 4}}).ok());
    ASSERT_TRUE(cache.ReleaseSequence(e).ok());
    m.tokens().erase(e);
    ASSERT_TRUE(cache.SwapIn(a, stream_).ok());
    EXPECT_EQ(m.CheckResident(), "");
  }
  // Releasing a swapped-out sequence frees its host pages.
  ASSERT_TRUE(cache.SwapOut(c, stream_).ok());
  EXPECT_EQ(cache.Stats().host_pages_used, 4);
  ASSERT_TRUE(cache.ReleaseSequence(c).ok());
  m.tokens().erase(c);
  EXPECT_EQ(cache.Stats().host_pages_used, 0);
  ASSERT_TRUE(cache.SynchronizeSwaps().ok());
  EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
  EXPECT_EQ(st0.host_pages_used, 3);
  // Without a host tier.
  KVCache plain = testing::CreateCacheOrAbort(SwapOptions(device_, 8, 0));
  const SequenceId p = plain.CreateSequence().value();
  EXPECT_EQ(plain.SwapOut(p, stream_).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(plain.Stats().host_pages_total, 0);
}

// Prefix caching: a swapped-out sequence's indexed pages stay cached (its
// references dropped), are reused by a new sequence with the same prompt,
// and the swapped sequence comes back intact (untracked).
TEST_P(SwapTest, PrefixCachedPagesStayIndexedWhileTheirSequenceIsOut) {
  KVCacheOptions o = SwapOptions(device_, 24, 24);
  o.prefix_cache.enabled = true;
  KVCache cache = testing::CreateCacheOrAbort(o);
  Model m(&cache, stream_, 9);
  std::vector<int32_t> prompt(13);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 * i + 1);
  const SequenceId a = cache.CreateSequence().value();
  m.tokens()[a];
  {
    StepEntry e{a, 13};
    e.token_ids = prompt;
    ASSERT_TRUE(m.Step({e}).ok());
  }
  EXPECT_EQ(cache.MatchPrefix(prompt).tokens, 12);
  ASSERT_TRUE(cache.SwapOut(a, stream_).ok());
  ASSERT_TRUE(cache.SynchronizeSwaps().ok());
  KVCacheStats st = cache.Stats();
  EXPECT_EQ(st.pages_cached, 3);  // the 3 full pages: indexed, held by nobody
  EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
  absl::StatusOr<PrefixSequence> b = cache.CreateSequenceFromPrefix(prompt);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->cached_tokens, 12);
  m.tokens()[b->seq] =
      std::vector<Token>(m.tokens()[a].begin(), m.tokens()[a].begin() + 12);
  ASSERT_TRUE(cache.SwapIn(a, stream_).ok());
  ASSERT_TRUE(m.Step({{a, 1}, {b->seq, 1}}).ok());
  EXPECT_EQ(m.CheckResident(), "");
  EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
}

TEST_P(SwapTest, HostTierOptionsAreValidated) {
  KVCacheOptions o = SwapOptions(device_, 8, 0);
  o.host_tier.host_pages = -1;
  EXPECT_EQ(KVCache::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.host_tier.host_pages = 2;
  o.host_tier.host_bytes = 1 << 20;
  EXPECT_EQ(KVCache::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.host_tier.host_pages = 0;
  o.host_tier.host_bytes = 10;
  EXPECT_EQ(KVCache::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.host_tier.host_bytes = 5 * 2 * o.geometry.PageBytes() + 4096;  // 5 pages and change
  absl::StatusOr<KVCache> c = KVCache::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_GE(c->Stats().host_pages_total, 4);
  EXPECT_LE(c->Stats().host_bytes, o.host_tier.host_bytes);
}

// Random swap-outs, swap-ins, steps, forks, truncations, releases and
// export/import round trips; after every operation the invariants hold, and
// after every check_every-th one every resident sequence holds its tokens'
// bytes.
void SwapTest::RunSwapFuzz(int check_every) {
  for (uint64_t seed : {11u, 12u, 13u, 14u}) {
    SCOPED_TRACE(seed);
    KVCache cache = testing::CreateCacheOrAbort(SwapOptions(device_, 30, 20, seed % 2 ? Layout::kHND : Layout::kNHD,
                                          seed % 3 == 0 ? 5 : 4,
                                          seed == 14 ? KeyFormat::kFp8 : KeyFormat::kNvfp4));
    Model m(&cache, stream_, seed);
    std::mt19937_64 rng(seed);
    auto pick = [&](bool swapped) -> SequenceId {
      std::vector<SequenceId> ids;
      for (const auto& [id, t] : m.tokens()) {
        if (*cache.IsSwappedOut(id) == swapped) ids.push_back(id);
      }
      return ids.empty() ? 0 : ids[rng() % ids.size()];
    };
    int swaps = 0, swap_ins = 0, steps = 0, refused = 0, exports = 0;
    for (int op = 0; op < 600; ++op) {
      const int r = static_cast<int>(rng() % 100);
      if (r < 35) {
        std::vector<StepEntry> entries;
        for (const auto& [id, t] : m.tokens()) {
          const int64_t room = 16 * cache.geometry().page_size - static_cast<int64_t>(t.size());
          if (!*cache.IsSwappedOut(id) && entries.size() < 4 && rng() % 2) {
            entries.push_back({id, static_cast<int32_t>(std::min<int64_t>(rng() % 6, room))});
          }
        }
        const absl::Status s = m.Step(entries);
        if (s.ok()) {
          ++steps;
        } else {
          ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
          ++refused;
        }
      } else if (r < 45) {
        if (m.tokens().size() < 8) m.Create();
      } else if (r < 60) {
        const SequenceId id = pick(false);
        if (id == 0) continue;
        const absl::Status s = cache.SwapOut(id, stream_);
        if (s.ok()) {
          ++swaps;
        } else {
          ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
        }
      } else if (r < 72) {
        const SequenceId id = pick(true);
        if (id == 0) continue;
        const absl::Status s = cache.SwapIn(id, stream_);
        if (s.ok()) {
          ++swap_ins;
        } else {
          ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
        }
      } else if (r < 78) {
        const SequenceId id = pick(false);
        if (id == 0) continue;
        absl::StatusOr<SequenceId> c = cache.ForkSequence(id);
        ASSERT_TRUE(c.ok());
        m.tokens()[*c] = m.tokens()[id];
      } else if (r < 84) {
        const SequenceId id = pick(false);
        if (id == 0) continue;
        const int64_t len = static_cast<int64_t>(m.tokens()[id].size());
        const int64_t n = len == 0 ? 0 : static_cast<int64_t>(rng() % (len + 1));
        ASSERT_TRUE(cache.Truncate(id, n).ok());
        m.tokens()[id].resize(n);
      } else if (r < 93) {
        const SequenceId id = pick(rng() % 2 == 0);
        if (id == 0) continue;
        ASSERT_TRUE(cache.ReleaseSequence(id).ok());
        m.tokens().erase(id);
      } else {
        // Export a resident sequence and import it back as a new one.
        const SequenceId id = pick(false);
        if (id == 0) continue;
        const int64_t bytes = *cache.ExportedBytes(id);
        std::vector<uint64_t> host(static_cast<size_t>(bytes / 8 + 2));
        ASSERT_TRUE(cache.ExportSequence(id, host.data(), bytes, stream_).ok());
        absl::StatusOr<SequenceId> got = cache.ImportSequence(host.data(), bytes, {}, stream_);
        if (got.ok()) {
          m.tokens()[*got] = m.tokens()[id];
          ++exports;
        } else {
          ASSERT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
        }
      }
      ASSERT_TRUE(cache.CheckInvariants().ok()) << "op " << op << ": " << cache.CheckInvariants();
      if ((op + 1) % check_every == 0) {
        ASSERT_EQ(m.CheckResident(), "") << "op " << op;
      }
      const KVCacheStats st = cache.Stats();
      ASSERT_EQ(st.num_sequences, static_cast<int64_t>(m.tokens().size()));
      int64_t swapped = 0;
      for (const auto& [id, t] : m.tokens()) {
        swapped += *cache.IsSwappedOut(id) ? 1 : 0;
        ASSERT_EQ(*cache.SequenceLength(id), static_cast<int64_t>(t.size()));
      }
      ASSERT_EQ(st.sequences_swapped, swapped);
    }
    // Everything back in and checked, then released: both pools whole.
    ASSERT_TRUE(cache.SynchronizeSwaps().ok());
    for (auto& [id, t] : m.tokens()) {
      if (*cache.IsSwappedOut(id)) {
        const absl::Status s = cache.SwapIn(id, stream_);
        if (!s.ok()) {
          ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
        }
      }
    }
    EXPECT_EQ(m.CheckResident(), "");
    for (auto it = m.tokens().begin(); it != m.tokens().end();) {
      ASSERT_TRUE(cache.ReleaseSequence(it->first).ok());
      it = m.tokens().erase(it);
    }
    ASSERT_TRUE(cache.SynchronizeSwaps().ok());
    const KVCacheStats st = cache.Stats();
    EXPECT_EQ(st.pages_free, st.pages_total);
    EXPECT_EQ(st.host_pages_free, st.host_pages_total);
    EXPECT_GT(swaps, 10);
    EXPECT_GT(swap_ins, 5);
    EXPECT_GT(steps, 30);
    EXPECT_GT(exports, 1);
    (void)refused;
  }
}

// A scale change with re-encoding right after a SwapIn: the re-encode must
// come after the copy that fills the swapped-in pages (GPU: the copy is held
// back 20 ms, so a re-encode that did not wait would be overwritten by the
// old bytes). The swapped sequence's fork kept the shared pages on the device
// and is re-encoded in place: both must end up with the same image.
// `change` makes the re-encoding scale change; the caller has made one
// already with nothing in flight, so that the kernels it launches are loaded
// (a first, lazy kernel load waits for the whole device, the held copy
// included, and would hide a missing wait).
void ExpectScaleChangeAfterSwapInWaitsForItsCopy(KVCache& cache, Model& m, SequenceId x,
                                                 const std::function<absl::Status()>& change,
                                                 const Device& device, Stream stream,
                                                 const std::function<void()>& sync) {
  const SequenceId y = cache.ForkSequence(x).value();
  ASSERT_TRUE(cache.SwapOut(x, stream).ok());
  // Two steps of another sequence retire the swap-out (its device pages are
  // let go), so the SwapIn below copies back into fresh pages.
  const SequenceId z = m.Create();
  ASSERT_TRUE(m.Step({{z, 1}}).ok());
  ASSERT_TRUE(m.Step({{z, 1}}).ok());
  ASSERT_TRUE(cache.SynchronizeSwaps().ok());
  ASSERT_EQ(cache.Stats().swaps_in_flight, 0);
  const int64_t bytes = cache.ExportedBytes(y).value();
  std::vector<uint64_t> before(static_cast<size_t>(bytes / 8 + 2)), img_x(before.size()),
      img_y(before.size());
  ASSERT_TRUE(cache.ExportSequence(y, before.data(), bytes, stream).ok());
  sync();
  const int64_t swapped_in = cache.Stats().bytes_swapped_in;
  {
    const testing::ScopedPageCopyDelay delay(device.is_cuda() ? 20000 : 0);
    ASSERT_TRUE(cache.SwapIn(x, stream).ok());
  }
  ASSERT_GT(cache.Stats().bytes_swapped_in, swapped_in) << "the SwapIn copied nothing";
  ASSERT_TRUE(change().ok());
  ASSERT_TRUE(cache.SynchronizeSwaps().ok());
  sync();
  ASSERT_EQ(cache.ExportedBytes(x).value(), bytes);
  ASSERT_TRUE(cache.ExportSequence(x, img_x.data(), bytes, stream).ok());
  ASSERT_TRUE(cache.ExportSequence(y, img_y.data(), bytes, stream).ok());
  sync();
  EXPECT_FALSE(img_y == before) << "the scale change re-encoded nothing";
  EXPECT_TRUE(img_x == img_y) << "the swapped-in pages were not re-encoded after their copy";
  EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
}

TEST_P(SwapTest, ReencodeAfterSwapInWaitsForItsCopy) {
  KVCache cache = testing::CreateCacheOrAbort(SwapOptions(device_, 30, 20));
  Model m(&cache, stream_, 5);
  const SequenceId x = m.Create();
  ASSERT_TRUE(m.Step({{x, 10}}).ok());
  ASSERT_TRUE(cache.UpdateGlobalScales({0.4f, 1.25f}, {0.625f, 2.5f}, stream_,
                                       StoredTokens::kReencode)
                  .ok());
  Sync();
  ExpectScaleChangeAfterSwapInWaitsForItsCopy(
      cache, m, x,
      [&] {
        return cache.UpdateGlobalScales({0.25f, 1.0f}, {0.5f, 3.0f}, stream_,
                                        StoredTokens::kReencode);
      },
      device_, stream_, [&] { Sync(); });
}

// The same for a re-encoding calibration (CalibrateGlobalScales with
// StoredTokens::kReencode): its re-encode must wait for the SwapIn's copy
// too (the OrderAfterCopies of the calibrate path).
TEST_P(SwapTest, CalibrateAfterSwapInWaitsForItsCopy) {
  KVCache cache = testing::CreateCacheOrAbort(SwapOptions(device_, 30, 20));
  Model m(&cache, stream_, 6);
  const SequenceId x = m.Create();
  ASSERT_TRUE(m.Step({{x, 10}}).ok());
  constexpr int kRows = 8;
  const KVCacheOptions& o = cache.options();
  const int hk = o.geometry.num_kv_heads, dk = o.geometry.head_dim_k, dv = o.geometry.head_dim_v;
  absl::StatusOr<Calibrator> cal =
      Calibrator::Create({kRows * hk * dk, DType::kBF16, device_, o.recipe});
  ASSERT_TRUE(cal.ok()) << cal.status();
  // Rows of two magnitudes: the second calibration changes the scales again.
  auto rows = [&](int dim, float scale, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, scale);
    std::vector<uint16_t> r(static_cast<size_t>(kRows) * hk * dim);
    for (uint16_t& x : r) x = FloatToBf16Bits(normal(rng));
    return r;
  };
  testing::Buffer k1(device_, kRows * hk * dk * 2), v1(device_, kRows * hk * dv * 2),
      k2(device_, kRows * hk * dk * 2), v2(device_, kRows * hk * dv * 2);
  const std::vector<uint16_t> k1h = rows(dk, 3.0f, 1), v1h = rows(dv, 0.5f, 2),
                              k2h = rows(dk, 9.0f, 3), v2h = rows(dv, 2.0f, 4);
  ASSERT_TRUE(k1.Upload(k1h.data(), k1h.size() * 2) && v1.Upload(v1h.data(), v1h.size() * 2) &&
              k2.Upload(k2h.data(), k2h.size() * 2) && v2.Upload(v2h.data(), v2h.size() * 2));
  auto calibrate = [&](testing::Buffer& k, testing::Buffer& v) {
    return cache.CalibrateGlobalScales(0, k.View(DType::kBF16, {kRows, hk, dk}),
                                       v.View(DType::kBF16, {kRows, hk, dv}), *cal, stream_,
                                       StoredTokens::kReencode);
  };
  ASSERT_TRUE(calibrate(k1, v1).ok());
  Sync();
  ExpectScaleChangeAfterSwapInWaitsForItsCopy(
      cache, m, x, [&] { return calibrate(k2, v2); }, device_, stream_, [&] { Sync(); });
}

TEST_P(SwapTest, FuzzSwapsInterleavedWithSteps) { RunSwapFuzz(1); }

INSTANTIATE_TEST_SUITE_P(Cpu, SwapTest, ::testing::Values(false));
INSTANTIATE_TEST_SUITE_P(Gpu, SwapTest, ::testing::Values(true));

// The fuzz with every page copy held back 300 us on its stream first and the
// bytes checked every 6th operation: a page swapped in and written or read,
// or swapped out and reused, before its copy completes then holds wrong bytes
// at the next check instead of losing a race now and then.
class SwapSlowCopiesTest : public SwapTest {
 protected:
  const testing::ScopedPageCopyDelay delay_{300};
};

TEST_P(SwapSlowCopiesTest, FuzzSwapsInterleavedWithSteps) { RunSwapFuzz(6); }

INSTANTIATE_TEST_SUITE_P(Gpu, SwapSlowCopiesTest, ::testing::Values(true));

}  // namespace
}  // namespace fp4kv
