// Tensor parallelism: ranks agree by construction. 2 and 4 simulated ranks
// (one KVCache each, holding num_kv_heads / tp of the heads) are driven by one
// random call sequence: prefix admissions, steps (prompt chunks and decode
// tokens) with their appends, forks, truncations, releases, swaps, prefix
// resets, evictions under pool pressure. After every call each rank must have
// made the same host decisions: the call's status, StepPlan, StepInfo, the
// step's slots, lengths and block tables, MatchPrefix / CreateSequenceFromPrefix
// results, every sequence's pages, the KV events and the Stats() counts that
// are decisions (docs/kv_cache.md, "Tensor parallelism"). Each rank appends the
// rows of its own heads, and rank 0's first append is all zeros in every
// layer, so that calibration differs between ranks.
//
// The GPU variant runs the same on CUDA device 0 with a stream per rank and
// random delays (a stream-ordered host function that sleeps) before each
// rank's appends and swaps, so that the device reaches each rank's work at
// different times. A second GPU case checks that ranks with explicit scales
// compute attention equal to the matching heads of a one-rank cache.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fp4kv/format.h"
#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
#include "testing/cache_attention_reference.h"
#include "testing/kv_cache_harness.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::Buffer;

constexpr int kLayers = 2;
constexpr int kHeads = 4;  // all ranks together
constexpr int kDim = 16;
constexpr int kPageSize = 4;
constexpr int kMaxSeqs = 4;
constexpr int kMaxTokens = 24;
constexpr int kMaxPagesPerSeq = 10;

// host_prefix_pages: a host tier of the prefix cache of that many pages on
// every rank (its bytes computed from the rank's geometry: per layer, K and
// V data and scale regions, each rounded up to 256 bytes).
KVCacheOptions RankOptions(int tp, const Device& device, int step_slots = 1,
                           int64_t host_prefix_pages = 0) {
  KVCacheOptions o;
  o.step_slots = step_slots;
  o.num_layers = kLayers;
  o.geometry.num_kv_heads = kHeads / tp;
  o.geometry.head_dim_k = o.geometry.head_dim_v = kDim;
  o.geometry.page_size = kPageSize;
  o.geometry.num_pages = 36;  // explicit: the same on every rank
  o.device = device;
  o.max_seqs_per_step = kMaxSeqs;
  o.max_tokens_per_step = kMaxTokens;
  o.max_pages_per_seq = kMaxPagesPerSeq;
  o.prefix_cache.enabled = true;
  o.prefix_cache.max_pending_events = 64;
  o.host_tier.host_pages = 24;
  const int64_t n = host_prefix_pages, h = kHeads / tp;
  auto region = [&](int64_t page_bytes) { return (n * page_bytes + 255) / 256 * 256; };
  o.prefix_cache.host_bytes =
      kLayers * 2 * (region(kPageSize * h * kDim / 2) + region(kPageSize * h * kDim / 16));
  return o;
}

// The host decisions of a cache as text (ranks compare equal strings).
std::string Decisions(const KVCache& c, const std::vector<SequenceId>& ids) {
  const KVCacheStats s = c.Stats();
  std::string out = absl::StrCat(
      "pages total/free/used/shared/cached/indexed ", s.pages_total, "/", s.pages_free, "/",
      s.pages_used, "/", s.pages_shared, "/", s.pages_cached, "/", s.pages_indexed,
      "; seqs ", s.num_sequences, " tokens stored/resident ", s.tokens_stored, "/",
      s.tokens_resident, " wasted ", s.wasted_slots, "; evictions ", s.evictions,
      "; prefix ", s.prefix_queries, "/", s.prefix_query_tokens, "/", s.prefix_hit_tokens,
      "; events ", s.events_pending, "/", s.events_dropped, "; reserved ", s.pages_reserved,
      "/", s.reservations, "; host ", s.host_pages_total, "/", s.host_pages_free, "/",
      s.host_pages_used, "; swapped ", s.sequences_swapped, " in flight ", s.swaps_in_flight,
      "/", s.pages_swap_pending, "; retiring ", s.pages_retiring, "; late ids ",
      s.token_ids_pending, "/", s.token_ids_dropped, "; clamped ", s.memory_budget_clamped,
      "; host prefix ", s.host_prefix_pages_total, "/", s.host_prefix_pages_cached, "/",
      s.host_prefix_demotions, "/", s.host_prefix_promotions, "/", s.host_prefix_evictions, "/",
      s.prefix_hit_tokens_host, "\n");
  for (const auto& [id, len] : s.sequence_lengths) absl::StrAppend(&out, id, ":", len, " ");
  out += "\n";
  for (SequenceId id : ids) {
    absl::StatusOr<absl::Span<const int32_t>> p = c.SequencePages(id);
    absl::StatusOr<bool> swapped = c.IsSwappedOut(id);
    absl::StrAppend(&out, "seq ", id, swapped.ok() && *swapped ? " (swapped)" : "", ": ",
                    p.ok() ? absl::StrJoin(*p, ",") : std::string(p.status().message()), "\n");
  }
  return out;
}

std::string Describe(const StepPlan& p) {
  return absl::StrCat("plan fits ", p.fits, " needed ", p.pages_needed, " copied ", p.pages_copied,
                      " free ", p.pages_free, " evictable ", p.pages_evictable, " evicted ",
                      p.pages_evicted, " swap pending ", p.pages_swap_pending, " left ",
                      p.pages_left, "/", p.tokens_left);
}

std::string DescribeStep(const KVCache& c, const StepInfo& i) {
  std::string out = absl::StrCat("step seqs ", i.num_seqs, " tokens ", i.num_tokens, " max len ",
                                 i.max_seq_len, " pages ", i.num_pages, " fp8 ",
                                 i.fp8_workspace_pages, " allocated ", i.pages_allocated,
                                 " copied ", i.pages_copied, " evicted ", i.pages_evicted, "\n");
  absl::StrAppend(&out, "slots ", absl::StrJoin(c.host_slot_mapping(), ","), "\nlens ",
                  absl::StrJoin(c.host_seq_lens(), ","), "\nkv indptr ",
                  absl::StrJoin(c.host_kv_page_indptr(), ","), "\ntoken indptr ",
                  absl::StrJoin(c.host_token_indptr(), ","), "\n");
  const absl::Span<const int32_t> indptr = c.host_kv_page_indptr();
  for (int r = 0; r < i.num_seqs; ++r) {
    absl::StrAppend(&out, "table ", r, ": ",
                    absl::StrJoin(c.host_block_table(r).subspan(0, indptr[r + 1] - indptr[r]), ","),
                    "\n");
  }
  return out;
}

std::string Describe(const KVEventBatch& b) {
  std::string out = absl::StrCat("dropped ", b.dropped, "\n");
  for (const KVEvent& e : b.events) {
    absl::StrAppend(&out, static_cast<int>(e.type), " [");
    for (const BlockHash& h : e.block_hashes) absl::StrAppend(&out, h.ToHex(), " ");
    absl::StrAppend(&out, "] parent ", e.has_parent ? e.parent_block_hash.ToHex() : "-", " ids ",
                    absl::StrJoin(e.token_ids, ","), " size ", e.block_size, " key '",
                    e.extra_key, "' medium ", static_cast<int>(e.medium), "\n");
  }
  return out;
}

std::string Describe(const absl::Status& s) {
  return s.ok() ? "OK" : absl::StatusCodeToString(s.code());
}

void SleepFor(void* micros) {
  std::this_thread::sleep_for(std::chrono::microseconds(reinterpret_cast<uintptr_t>(micros)));
}

// One random call sequence on `tp` ranks.
class TpDriver {
 public:
  // slots > 1: two (or more) step slots, and decode tokens whose ids come
  // after their step (SetTokenIds; from device memory on a GPU).
  TpDriver(int tp, const Device& device, bool delays, uint64_t seed, int slots = 1,
           int64_t host_prefix_pages = 0)
      : tp_(tp),
        device_(device),
        delays_(delays),
        slots_(slots),
        host_prefix_pages_(host_prefix_pages),
        rng_(seed),
        delay_rng_(seed ^ 0x5eed) {
    for (int len : {5, 9, 14}) {
      std::vector<int32_t> p(len);
      for (int32_t& t : p) t = Uniform(0, 3);
      system_.push_back(p);
    }
  }
  ~TpDriver() {
    for (Rank& r : ranks_) {
      if (r.stream != nullptr) {
        (void)cudaStreamSynchronize(r.stream);
        (void)cudaStreamDestroy(r.stream);
      }
    }
  }

  void Run(int ops) {
    for (int r = 0; r < tp_; ++r) {
      Rank rank;
      if (device_.is_cuda()) {
        FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&rank.stream, cudaStreamNonBlocking));
      }
      absl::StatusOr<KVCache> c = KVCache::Create(RankOptions(tp_, device_, slots_, host_prefix_pages_));
      ASSERT_TRUE(c.ok()) << c.status();
      rank.cache = std::make_unique<KVCache>(std::move(*c));
      absl::StatusOr<CacheAppender> app = rank.cache->appender(DType::kBF16);
      ASSERT_TRUE(app.ok()) << app.status();
      rank.appender = *app;
      const int heads = kHeads / tp_;
      rank.k = Buffer(device_, sizeof(uint16_t) * kMaxTokens * heads * kDim);
      rank.v = Buffer(device_, sizeof(uint16_t) * kMaxTokens * heads * kDim);
      ranks_.push_back(std::move(rank));
    }
    for (op_ = 0; op_ < ops; ++op_) {
      const int r = Uniform(0, 99);
      if (r < 18) {
        Admit();
      } else if (r < 55) {
        Step();
      } else if (r < 62) {
        Fork();
      } else if (r < 68) {
        Truncate();
      } else if (r < 78) {
        Release();
      } else if (r < 85) {
        Swap(/*out=*/true);
      } else if (r < 92) {
        Swap(/*out=*/false);
      } else if (r < 97) {
        Match(RandomPrompt());
      } else {
        for (Rank& rank : ranks_) rank.cache->ResetPrefixCache();
      }
      if (::testing::Test::HasFatalFailure()) return;
      CompareState();
      if (::testing::Test::HasFatalFailure()) return;
    }
    for (Rank& rank : ranks_) {
      if (rank.stream != nullptr) FP4KV_ASSERT_CUDA(cudaStreamSynchronize(rank.stream));
    }
    EXPECT_GT(steps_, 0);
  }

  int64_t prefix_hits() const { return hits_; }
  int64_t evictions() const { return ranks_[0].cache->Stats().evictions; }
  int64_t host_demotions() const { return ranks_[0].cache->Stats().host_prefix_demotions; }

 private:
  struct Rank {
    std::unique_ptr<KVCache> cache;
    CacheAppender appender;
    cudaStream_t stream = nullptr;
    Buffer k, v;
  };
  struct Seq {
    SequenceId id = 0;
    std::vector<int32_t> pending;  // prompt tokens not yet appended
    int64_t length = 0;
    bool swapped = false;
  };

  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  Stream StreamOf(const Rank& r) const { return reinterpret_cast<Stream>(r.stream); }

  void Delay(const Rank& r) {
    if (!delays_ || r.stream == nullptr) return;
    const uintptr_t us = std::uniform_int_distribution<int>(0, 1500)(delay_rng_);
    ASSERT_EQ(cudaLaunchHostFunc(r.stream, SleepFor, reinterpret_cast<void*>(us)), cudaSuccess);
  }

  // Fails unless every rank produced the same text.
  void Same(const std::vector<std::string>& got, const char* what) {
    for (size_t r = 1; r < got.size(); ++r) {
      ASSERT_EQ(got[0], got[r]) << what << ": rank " << r << " differs from rank 0 at op " << op_;
    }
  }

  std::vector<int32_t> RandomPrompt() {
    std::vector<int32_t> p = system_[Uniform(0, 2)];
    const int extra = Uniform(1, 12);
    for (int i = 0; i < extra; ++i) p.push_back(Uniform(0, 3));
    return p;
  }

  void Match(const std::vector<int32_t>& prompt) {
    std::vector<std::string> got;
    for (Rank& rank : ranks_) {
      const PrefixMatch m = rank.cache->MatchPrefix(prompt);
      got.push_back(absl::StrCat("match ", m.tokens, "/", m.pages, "/", m.pages_evictable, "/",
                                 m.tokens_host));
    }
    Same(got, "MatchPrefix");
  }

  void Admit() {
    const std::vector<int32_t> prompt = RandomPrompt();
    Match(prompt);
    std::vector<std::string> got;
    PrefixSequence ps;
    for (Rank& rank : ranks_) {
      absl::StatusOr<PrefixSequence> s = rank.cache->CreateSequenceFromPrefix(prompt);
      got.push_back(s.ok() ? absl::StrCat(s->seq, "/", s->cached_tokens, "/", s->host_tokens)
                           : std::string(s.status().ToString()));
      if (s.ok()) ps = *s;
    }
    Same(got, "CreateSequenceFromPrefix");
    if (ps.seq == 0) return;
    hits_ += ps.cached_tokens;
    Seq q;
    q.id = ps.seq;
    q.length = ps.cached_tokens;
    q.pending.assign(prompt.begin() + ps.cached_tokens, prompt.end());
    seqs_.push_back(q);
  }

  void Step() {
    std::vector<size_t> order(seqs_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng_);
    std::vector<StepEntry> entries;
    std::vector<std::vector<int32_t>> ids;
    ids.reserve(kMaxSeqs);
    std::vector<size_t> which;
    struct Late {
      SequenceId seq;
      int64_t position;
      int32_t id;
    };
    std::vector<Late> late;
    int64_t tokens = 0;
    for (size_t i : order) {
      Seq& q = seqs_[i];
      if (q.swapped || entries.size() == kMaxSeqs) continue;
      const int64_t room = int64_t{kMaxPagesPerSeq} * kPageSize - q.length;
      int64_t n = q.pending.empty() ? 1 : std::min<int64_t>(q.pending.size(), Uniform(1, 8));
      n = std::min({n, room, kMaxTokens - tokens});
      if (n <= 0) continue;
      std::vector<int32_t> t;
      for (int64_t k = 0; k < n; ++k)
        t.push_back(q.pending.empty() ? Uniform(0, 3) : q.pending[static_cast<size_t>(k)]);
      ids.push_back(std::move(t));
      entries.push_back(StepEntry{q.id, static_cast<int32_t>(n), ids.back()});
      if (slots_ > 1 && q.pending.empty() && Uniform(0, 2) > 0) {
        late.push_back(Late{q.id, q.length, ids.back()[0]});
        entries.back().token_ids = {};
      }
      which.push_back(i);
      tokens += n;
    }
    std::vector<std::string> plans, steps;
    bool ok = false;
    for (Rank& rank : ranks_) {
      absl::StatusOr<StepPlan> plan = rank.cache->PlanStep(entries);
      ASSERT_TRUE(plan.ok()) << plan.status();
      absl::StatusOr<StepInfo> info = rank.cache->PrepareStep(entries, StreamOf(rank));
      plans.push_back(Describe(*plan));
      steps.push_back(info.ok() ? DescribeStep(*rank.cache, *info) : Describe(info.status()));
      ok = info.ok();
      ASSERT_EQ(plan->fits, info.ok()) << info.status();
    }
    Same(plans, "PlanStep");
    Same(steps, "PrepareStep");
    if (!ok) return;
    ++steps_;
    for (size_t e = 0; e < entries.size(); ++e) {
      Seq& q = seqs_[which[e]];
      q.length += entries[e].num_new_tokens;
      if (!q.pending.empty())
        q.pending.erase(q.pending.begin(), q.pending.begin() + entries[e].num_new_tokens);
    }
    // Each rank appends its heads' rows: the same tokens, different values;
    // rank 0's first append is all zeros (its layers stay uncalibrated).
    const int heads = kHeads / tp_;
    for (int r = 0; r < tp_; ++r) {
      Rank& rank = ranks_[r];
      Delay(rank);
      for (int l = 0; l < kLayers; ++l) {
        std::vector<uint16_t> k(static_cast<size_t>(tokens) * heads * kDim);
        std::vector<uint16_t> v(k.size());
        for (size_t i = 0; i < k.size(); ++i) {
          const bool zero = r == 0 && steps_ == 1;
          const int h = r * heads + static_cast<int>(i / kDim) % heads;
          k[i] = FloatToBf16Bits(zero ? 0.0f : 0.25f * ((op_ * 7 + h * 3 + l + i) % 13) - 1.5f);
          v[i] = FloatToBf16Bits(zero ? 0.0f : 0.5f * ((op_ * 5 + h + 2 * l + i) % 11) - 2.5f);
        }
        ASSERT_TRUE(Upload(rank, rank.k, k));
        ASSERT_TRUE(Upload(rank, rank.v, v));
        const absl::Status st =
            rank.appender.Run(l, rank.k.View(DType::kBF16, {tokens, heads, kDim}),
                              rank.v.View(DType::kBF16, {tokens, heads, kDim}), StreamOf(rank));
        ASSERT_TRUE(st.ok()) << st;
      }
    }
    // The ids of the decode tokens appended without them, given now.
    for (const Late& x : late) {
      std::vector<std::string> got;
      for (Rank& rank : ranks_) {
        absl::Status st;
        if (rank.stream == nullptr) {
          st = rank.cache->SetTokenIds(x.seq, x.position, {x.id});
        } else {
          id_buffers_.push_back(std::make_unique<Buffer>(device_, sizeof(int32_t)));
          Buffer& b = *id_buffers_.back();
          ASSERT_EQ(cudaMemcpyAsync(b.get(), &x.id, sizeof(int32_t), cudaMemcpyHostToDevice,
                                    rank.stream),
                    cudaSuccess);
          ASSERT_EQ(cudaStreamSynchronize(rank.stream), cudaSuccess);  // &x.id is on the stack
          Delay(rank);
          st = rank.cache->SetTokenIds(x.seq, x.position, b.View(DType::kI32, {1}),
                                       StreamOf(rank));
        }
        got.push_back(Describe(st));
      }
      Same(got, "SetTokenIds");
    }
  }

  // Stream-ordered on CUDA (pageable memory is staged before the call
  // returns), so an append still queued reads the rows it was given.
  bool Upload(const Rank& rank, Buffer& b, const std::vector<uint16_t>& v) {
    if (v.empty()) return true;
    if (rank.stream == nullptr) return b.Upload(v.data(), v.size() * sizeof(uint16_t));
    return cudaMemcpyAsync(b.get(), v.data(), v.size() * sizeof(uint16_t), cudaMemcpyHostToDevice,
                           rank.stream) == cudaSuccess;
  }

  Seq* Pick() { return seqs_.empty() ? nullptr : &seqs_[Uniform(0, seqs_.size() - 1)]; }

  void Fork() {
    Seq* q = Pick();
    if (q == nullptr) return;
    std::vector<std::string> got;
    SequenceId child = 0;
    for (Rank& rank : ranks_) {
      absl::StatusOr<SequenceId> c = rank.cache->ForkSequence(q->id);
      got.push_back(c.ok() ? absl::StrCat(*c) : Describe(c.status()));
      if (c.ok()) child = *c;
    }
    Same(got, "ForkSequence");
    if (child == 0) return;
    Seq f = *q;
    f.id = child;
    seqs_.push_back(f);
  }

  void Truncate() {
    Seq* q = Pick();
    if (q == nullptr) return;
    const int64_t len = Uniform(0, static_cast<int>(q->length));
    std::vector<std::string> got;
    for (Rank& rank : ranks_) got.push_back(Describe(rank.cache->Truncate(q->id, len)));
    Same(got, "Truncate");
    if (got[0] == "OK") {
      q->length = len;
      q->pending.clear();
    }
  }

  void Release() {
    if (seqs_.empty()) return;
    const size_t i = Uniform(0, seqs_.size() - 1);
    std::vector<std::string> got;
    for (Rank& rank : ranks_) got.push_back(Describe(rank.cache->ReleaseSequence(seqs_[i].id)));
    Same(got, "ReleaseSequence");
    seqs_.erase(seqs_.begin() + i);
  }

  void Swap(bool out) {
    Seq* q = Pick();
    if (q == nullptr) return;
    std::vector<std::string> got;
    for (Rank& rank : ranks_) {
      Delay(rank);
      got.push_back(Describe(out ? rank.cache->SwapOut(q->id, StreamOf(rank))
                                 : rank.cache->SwapIn(q->id, StreamOf(rank))));
    }
    Same(got, out ? "SwapOut" : "SwapIn");
    if (got[0] == "OK") q->swapped = out;
  }

  void CompareState() {
    std::vector<SequenceId> ids;
    for (const Seq& q : seqs_) ids.push_back(q.id);
    std::vector<std::string> state, events;
    const bool take = Uniform(0, 3) == 0 || op_ % 16 == 0;
    for (Rank& rank : ranks_) {
      const absl::Status inv = rank.cache->CheckInvariants();
      ASSERT_TRUE(inv.ok()) << inv;
      state.push_back(Decisions(*rank.cache, ids));
      if (take) events.push_back(Describe(rank.cache->TakeEvents()));
    }
    Same(state, "state");
    Same(events, "TakeEvents");
  }

  const int tp_;
  const Device device_;
  const bool delays_;
  const int slots_;
  const int64_t host_prefix_pages_;
  std::vector<std::unique_ptr<Buffer>> id_buffers_;  // late ids in device memory
  std::mt19937_64 rng_;
  std::mt19937_64 delay_rng_;  // differs between ranks' draws: not part of the calls
  std::vector<std::vector<int32_t>> system_;
  std::vector<Rank> ranks_;
  std::vector<Seq> seqs_;
  int op_ = 0;
  int steps_ = 0;
  int64_t hits_ = 0;
};

class KVCacheTpTest : public ::testing::TestWithParam<int> {};

TEST_P(KVCacheTpTest, RanksMakeTheSameDecisionsOnTheCpu) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    TpDriver d(GetParam(), Device::Cpu(), /*delays=*/false, seed);
    d.Run(testing::FuzzOps(400));
    if (HasFatalFailure()) return;
    EXPECT_GT(d.prefix_hits(), 0);
    EXPECT_GT(d.evictions(), 0);
  }
}

// Two step slots (retiring pages, one retire list with the swaps) and ids
// given after their step: still a function of the calls.
TEST_P(KVCacheTpTest, RanksMakeTheSameDecisionsWithTwoStepSlotsOnTheCpu) {
  for (uint64_t seed : {4u, 5u}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    TpDriver d(GetParam(), Device::Cpu(), /*delays=*/false, seed, /*slots=*/2);
    d.Run(testing::FuzzOps(400));
    if (HasFatalFailure()) return;
    EXPECT_GT(d.prefix_hits(), 0);
  }
}

// A host tier of the prefix cache: demotions and host evictions (their
// pages, events and counts) are a function of the calls too. (This workload
// seldom comes back to a demoted prefix; kv_cache_prefix_fuzz_test promotes.)
TEST_P(KVCacheTpTest, RanksMakeTheSameDecisionsWithAHostPrefixTierOnTheCpu) {
  for (int slots : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("slots ", slots));
    TpDriver d(GetParam(), Device::Cpu(), /*delays=*/false, 6, slots, /*host_prefix_pages=*/8);
    d.Run(testing::FuzzOps(400));
    if (HasFatalFailure()) return;
    EXPECT_GT(d.host_demotions(), 0);
  }
}

TEST_P(KVCacheTpTest, GpuRanksMakeTheSameDecisionsWithAHostPrefixTierUnderDeviceDelays) {
  FP4KV_SKIP_WITHOUT_GPU();
  for (int slots : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("slots ", slots));
    TpDriver d(GetParam(), Device::Cuda(0), /*delays=*/true, 6, slots, /*host_prefix_pages=*/8);
    d.Run(testing::FuzzOps(250));
    if (HasFatalFailure()) return;
    EXPECT_GT(d.host_demotions(), 0);
  }
}

TEST_P(KVCacheTpTest, GpuRanksMakeTheSameDecisionsWithTwoStepSlotsUnderDeviceDelays) {
  FP4KV_SKIP_WITHOUT_GPU();
  for (uint64_t seed : {4u, 5u}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    TpDriver d(GetParam(), Device::Cuda(0), /*delays=*/true, seed, /*slots=*/2);
    d.Run(testing::FuzzOps(250));
    if (HasFatalFailure()) return;
    EXPECT_GT(d.prefix_hits(), 0);
  }
}

TEST_P(KVCacheTpTest, GpuRanksMakeTheSameDecisionsUnderDeviceDelays) {
  FP4KV_SKIP_WITHOUT_GPU();
  for (uint64_t seed : {1u, 2u}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    TpDriver d(GetParam(), Device::Cuda(0), /*delays=*/true, seed);
    d.Run(testing::FuzzOps(250));
    if (HasFatalFailure()) return;
    EXPECT_GT(d.prefix_hits(), 0);
  }
}

// With explicit scales a rank stores the bytes of its heads exactly as a
// one-rank cache does, so its attention output is that cache's output for
// the matching heads (within the attention tolerance: the work split may
// differ with the head count).
TEST_P(KVCacheTpTest, GpuExplicitScalesGiveTheOneRankAttention) {
  FP4KV_SKIP_WITHOUT_GPU();
  const int tp = GetParam();
  constexpr int kGroup = 2;  // query heads per KV head
  constexpr int kSeqs = 3;
  constexpr int kAttnDim = 64;  // a head_dim the attention kernels have
  const int64_t prompt[kSeqs] = {9, 17, 5};
  auto make = [&](int heads) {
    KVCacheOptions o = RankOptions(1, Device::Cuda(0));
    o.geometry.num_kv_heads = heads;
    o.geometry.head_dim_k = o.geometry.head_dim_v = kAttnDim;
    o.geometry.page_size = 16;
    o.geometry.num_pages = 64;
    o.max_tokens_per_step = 64;
    o.prefix_cache.enabled = false;
    o.host_tier.host_pages = 0;
    o.k_global_scales.assign(kLayers, 0.004f);
    o.v_global_scales.assign(kLayers, 0.005f);
    return testing::CreateCacheOrAbort(o);
  };
  // One value per (token, head, d) of all heads; rank r sees heads
  // [r * kHeads / tp, (r + 1) * kHeads / tp).
  auto value = [](int step, int64_t t, int h, int d, int which) {
    return 0.125f * static_cast<float>((step * 31 + t * 17 + h * 7 + d * 3 + which * 5) % 41) -
           2.5f;
  };
  // Runs prefill (step 0) and one decode step (step 1) on a cache holding
  // `heads` heads from `h0`; returns the decode attention output of every
  // layer, [layer][seq][q head][d] as floats.
  auto run = [&](int heads, int h0) -> std::vector<float> {
    KVCache c = make(heads);
    const int hq = heads * kGroup;
    std::vector<float> outs;
    std::vector<SequenceId> ids;
    for (int i = 0; i < kSeqs; ++i) ids.push_back(*c.CreateSequence());
    absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
    CacheAttentionOptions ao;
    ao.num_qo_heads = hq;
    absl::StatusOr<CacheAttention> att = c.attention(ao);
    EXPECT_TRUE(app.ok() && att.ok());
    if (!app.ok() || !att.ok()) return outs;
    Buffer work(c.device(), static_cast<size_t>(att->WorkspaceBytes()));
    for (int step = 0; step < 2; ++step) {
      std::vector<StepEntry> entries;
      int64_t tokens = 0;
      for (int i = 0; i < kSeqs; ++i) {
        const int32_t n = step == 0 ? static_cast<int32_t>(prompt[i]) : 1;
        entries.push_back(StepEntry{ids[i], n, {}});
        tokens += n;
      }
      absl::StatusOr<StepInfo> info = c.PrepareStep(entries);
      EXPECT_TRUE(info.ok()) << info.status();
      if (!info.ok()) return {};
      for (int l = 0; l < kLayers; ++l) {
        std::vector<uint16_t> k(static_cast<size_t>(tokens) * heads * kAttnDim), v(k.size());
        for (int64_t t = 0; t < tokens; ++t) {
          for (int h = 0; h < heads; ++h) {
            for (int d = 0; d < kAttnDim; ++d) {
              const size_t i = (static_cast<size_t>(t) * heads + h) * kAttnDim + d;
              k[i] = FloatToBf16Bits(value(step * 2 + l, t, h0 + h, d, 0));
              v[i] = FloatToBf16Bits(value(step * 2 + l, t, h0 + h, d, 1));
            }
          }
        }
        Buffer kb(c.device(), k.size() * 2), vb(c.device(), v.size() * 2);
        EXPECT_TRUE(kb.Upload(k.data(), k.size() * 2) && vb.Upload(v.data(), v.size() * 2));
        absl::Status st = app->Run(l, kb.View(DType::kBF16, {tokens, heads, kAttnDim}),
                                   vb.View(DType::kBF16, {tokens, heads, kAttnDim}));
        EXPECT_TRUE(st.ok()) << st;
        if (step == 0) continue;
        std::vector<uint16_t> q(static_cast<size_t>(kSeqs) * hq * kAttnDim);
        for (int b = 0; b < kSeqs; ++b) {
          for (int h = 0; h < hq; ++h) {
            for (int d = 0; d < kAttnDim; ++d) {
              q[(static_cast<size_t>(b) * hq + h) * kAttnDim + d] =
                  FloatToBf16Bits(value(9 + l, b, h0 * kGroup + h, d, 2));
            }
          }
        }
        Buffer qb(c.device(), q.size() * 2), ob(c.device(), q.size() * 2);
        EXPECT_TRUE(qb.Upload(q.data(), q.size() * 2));
        st = att->Run(l, qb.View(DType::kBF16, {kSeqs, hq, kAttnDim}),
                      ob.View(DType::kBF16, {kSeqs, hq, kAttnDim}), work.get(),
                      att->WorkspaceBytes());
        EXPECT_TRUE(st.ok()) << st;
        for (uint16_t bits : ob.DownloadAs<uint16_t>(q.size())) outs.push_back(Bf16BitsToFloat(bits));
      }
    }
    return outs;
  };
  const std::vector<float> full = run(kHeads, 0);
  ASSERT_EQ(full.size(), static_cast<size_t>(kLayers) * kSeqs * kHeads * kGroup * kAttnDim);
  const int heads = kHeads / tp;
  int rows = 0, bitwise = 0;
  for (int r = 0; r < tp; ++r) {
    const std::vector<float> got = run(heads, r * heads);
    ASSERT_EQ(got.size(), full.size() / tp);
    for (int l = 0; l < kLayers; ++l) {
      for (int b = 0; b < kSeqs; ++b) {
        for (int h = 0; h < heads * kGroup; ++h) {
          double err = 0, norm = 0;
          for (int d = 0; d < kAttnDim; ++d) {
            const float g = got[((static_cast<size_t>(l) * kSeqs + b) * heads * kGroup + h) * kAttnDim + d];
            const float w = full[((static_cast<size_t>(l) * kSeqs + b) * kHeads * kGroup +
                                  r * heads * kGroup + h) * kAttnDim + d];
            err += (g - w) * double(g - w);
            norm += double(w) * w;
          }
          // The plain attention bound (relative L2 4e-3 per row, as
          // CompareCacheAttention: two bf16 subnormal ulps per element).
          EXPECT_LE(std::sqrt(err), 4e-3 * std::sqrt(norm) + 2.0 * std::sqrt(double{kAttnDim}) *
                                                                  std::ldexp(1.0, -133))
              << "rank " << r << " layer " << l << " seq " << b << " q head " << h;
          ++rows;
          if (err == 0.0) ++bitwise;
        }
      }
    }
  }
  // Where a rank's work split matches the one-rank cache's, the rows are
  // equal bit for bit; the log says how many were.
  std::printf("[ tp ] %d of %d rows equal bit for bit to the one-rank cache's\n", bitwise, rows);
}

INSTANTIATE_TEST_SUITE_P(Ranks, KVCacheTpTest, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return absl::StrCat("Tp", i.param);
                         });

}  // namespace
}  // namespace fp4kv
