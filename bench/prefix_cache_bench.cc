// Prefix-caching benchmarks (host work; the pool bytes do not matter).
//
//   BM_HashPages/<page_size>: the page-hash chain of a 32k-token prompt
//     (XXH3-128 over parent hash, token ids and extra key); GB/s of token ids.
//   BM_MatchPrefix/<hit>: MatchPrefix of a 32k-token prompt (page 16) whose
//     pages are all cached (hit 1) or whose first page is not (hit 0).
//   BM_CreateSequenceFromPrefix: matching and sharing the 2047 cached pages
//     of a 32k-token prompt, then releasing the sequence (they go back to the
//     LRU).
//   BM_AllocateWithEviction: a pool whose every page is cached: each page
//     allocated evicts the least recently used one, is indexed under a new
//     hash and released back to the LRU; pages/s.
//   BM_PrepareStepPrefix/<prefix>: one decode step's host work for 256
//     sequences (1 new token each with its id, contexts 2k-8k, page 16, pages
//     scattered) with prefix caching off (0) or on (1: token ids recorded, a
//     page hashed and completed every 16 steps per sequence). PrepareStep
//     defers hashing and indexing the pages a step completes to the next
//     call that reads the index; here that is a TakeEvents right after it
//     (which also builds the pages' events), so both are timed, apart.
//     Counters (medians of the individual calls, host steady_clock):
//       median_us    PrepareStep alone (p99_us: its 99th percentile)
//       deferred_us  the TakeEvents after it: the deferred hashing, indexing
//                    and events
//       step_us      PrepareStep + TakeEvents of the same step: what prefix
//                    caching costs a step in total (compare with prefix 0's)
//     The benchmark's own time (real_time) covers both calls.
#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "bench/host_stats.h"
#include "bench/scatter_pages.h"
#include "benchmark/benchmark.h"
#include "fp4kv/kv_cache.h"
#include "src/page_pool.h"
#include "src/prefix_hash.h"

namespace fp4kv {
namespace {

constexpr int kPromptTokens = 32768;
constexpr int kPageSize = 16;

std::vector<int32_t> RandomTokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, 151935);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = tok(rng);
  return t;
}

using bench::Median;
using bench::Percentile;

absl::StatusOr<KVCache> MakeCache(int64_t pages, int max_pages_per_seq, int max_seqs,
                                  int max_tokens, bool prefix) {
  KVCacheOptions o;
  o.num_layers = 1;
  o.geometry.num_kv_heads = 1;
  o.geometry.head_dim_k = o.geometry.head_dim_v = 16;
  o.geometry.page_size = kPageSize;
  o.geometry.num_pages = pages;
  o.k_global_scales = o.v_global_scales = {0.01f};  // calibrated: pages are cached
  o.max_pages_per_seq = max_pages_per_seq;
  o.max_seqs_per_step = max_seqs;
  o.max_tokens_per_step = max_tokens;
  o.prefix_cache.enabled = prefix;
  o.prefix_cache.max_pending_events = prefix ? 1 << 16 : 0;
  return KVCache::Create(o);
}

// Prefills `tokens` (chunks of `chunk`) into a new sequence; returns it.
absl::StatusOr<SequenceId> Prefill(KVCache& c, const std::vector<int32_t>& tokens, int chunk) {
  absl::StatusOr<SequenceId> made = bench::NewSequence(c);
  if (!made.ok()) return made.status();
  const SequenceId id = *made;
  for (size_t done = 0; done < tokens.size(); done += chunk) {
    const int n = static_cast<int>(std::min<size_t>(chunk, tokens.size() - done));
    const StepEntry e{id, n, absl::Span<const int32_t>(tokens.data() + done, n)};
    absl::StatusOr<StepInfo> info = c.PrepareStep({&e, 1});
    if (!info.ok()) return info.status();
  }
  return id;
}

void BM_HashPages(benchmark::State& state) {
  const int ps = static_cast<int>(state.range(0));
  const std::vector<int32_t> prompt = RandomTokens(kPromptTokens, 1);
  std::vector<uint8_t> scratch;
  for (auto _ : state) {
    BlockHash h;
    const BlockHash* parent = nullptr;
    for (int i = 0; i + ps <= kPromptTokens; i += ps) {
      h = internal::HashPage(parent, absl::Span<const int32_t>(prompt.data() + i, ps), "",
                             &scratch);
      parent = &h;
    }
    benchmark::DoNotOptimize(h);
  }
  const double bytes = 4.0 * (kPromptTokens / ps) * ps;
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["GB_per_s"] =
      benchmark::Counter(state.iterations() * bytes / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_HashPages)->Arg(16)->Arg(32)->Arg(64)->Arg(128)->Unit(benchmark::kMicrosecond);

void BM_MatchPrefix(benchmark::State& state) {
  const bool hit = state.range(0) == 1;
  const int pages = kPromptTokens / kPageSize;
  absl::StatusOr<KVCache> c = MakeCache(pages + 8, pages + 1, 4, 4096, true);
  std::vector<int32_t> prompt = RandomTokens(kPromptTokens, 2);
  absl::StatusOr<SequenceId> s = c.ok() ? Prefill(*c, prompt, 4096) : c.status();
  if (!s.ok()) {
    state.SkipWithError(s.status().ToString().c_str());
    return;
  }
  (void)c->ReleaseSequence(*s);
  if (!hit) prompt[0] ^= 1;
  int64_t matched = 0;
  for (auto _ : state) {
    const PrefixMatch m = c->MatchPrefix(prompt);
    matched = m.tokens;
    benchmark::DoNotOptimize(matched);
  }
  state.counters["matched_tokens"] = static_cast<double>(matched);
  state.counters["Mtokens_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * kPromptTokens / 1e6, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_MatchPrefix)->Arg(1)->Arg(0)->Unit(benchmark::kMicrosecond);

void BM_CreateSequenceFromPrefix(benchmark::State& state) {
  const int pages = kPromptTokens / kPageSize;
  absl::StatusOr<KVCache> c = MakeCache(pages + 8, pages + 1, 4, 4096, true);
  const std::vector<int32_t> prompt = RandomTokens(kPromptTokens, 3);
  absl::StatusOr<SequenceId> s = c.ok() ? Prefill(*c, prompt, 4096) : c.status();
  if (!s.ok()) {
    state.SkipWithError(s.status().ToString().c_str());
    return;
  }
  (void)c->ReleaseSequence(*s);
  for (auto _ : state) {
    absl::StatusOr<PrefixSequence> r = c->CreateSequenceFromPrefix(prompt);
    benchmark::DoNotOptimize(r);
    (void)c->ReleaseSequence(r->seq);
  }
  state.counters["cached_tokens"] = static_cast<double>(c->Stats().prefix_hit_tokens) /
                                    static_cast<double>(c->Stats().prefix_queries);
}
BENCHMARK(BM_CreateSequenceFromPrefix)->Unit(benchmark::kMicrosecond);

void BM_AllocateWithEviction(benchmark::State& state) {
  constexpr int32_t kPages = 1 << 18;
  internal::PagePool pool;
  if (absl::Status st = pool.Init(kPages, /*prefix_index=*/true); !st.ok()) {
    state.SkipWithError(st.ToString().c_str());
    return;
  }
  uint64_t next = 1;
  for (int32_t i = 0; i < kPages; ++i) {
    const int32_t p = pool.Allocate();
    pool.Register(p, BlockHash{next * 0x9e3779b97f4a7c15ull, next * 0xc2b2ae3d27d4eb4full});
    ++next;
  }
  for (int32_t p = 0; p < kPages; ++p) pool.Release(p);
  constexpr int kBatch = 256;
  int32_t got[kBatch];
  for (auto _ : state) {
    for (int i = 0; i < kBatch; ++i) {
      got[i] = pool.Allocate();
      pool.Register(got[i], BlockHash{next * 0x9e3779b97f4a7c15ull, next * 0xc2b2ae3d27d4eb4full});
      ++next;
    }
    for (int i = 0; i < kBatch; ++i) pool.Release(got[i]);
    benchmark::DoNotOptimize(got);
  }
  state.counters["evictions"] = static_cast<double>(pool.evictions());
  state.counters["Mpages_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * kBatch / 1e6, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AllocateWithEviction);

void BM_PrepareStepPrefix(benchmark::State& state) {
  const bool prefix = state.range(0) == 1;
  constexpr int kSeqs = 256;
  const int growth = static_cast<int>(state.max_iterations) + 16;
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> ctx(2048, 8192);
  std::vector<int> contexts(kSeqs);
  int64_t pages = 0;
  for (int& n : contexts) {
    n = ctx(rng);
    pages += (n + growth + kPageSize - 1) / kPageSize;
  }
  absl::StatusOr<KVCache> c =
      MakeCache(pages, (8192 + growth + kPageSize - 1) / kPageSize, kSeqs, 512, prefix);
  if (!c.ok()) {
    state.SkipWithError(c.status().ToString().c_str());
    return;
  }
  if (absl::Status st = bench::ScatterFreePages(*c, 1234); !st.ok()) {
    state.SkipWithError(st.ToString().c_str());
    return;
  }
  std::vector<StepEntry> entries;
  std::vector<int32_t> next_ids(kSeqs);
  for (int i = 0; i < kSeqs; ++i) {
    absl::StatusOr<SequenceId> s = Prefill(*c, RandomTokens(contexts[i], 100 + i), 512);
    if (!s.ok()) {
      state.SkipWithError(s.status().ToString().c_str());
      return;
    }
    entries.push_back(StepEntry{*s, 1, absl::Span<const int32_t>(&next_ids[i], 1)});
  }
  (void)c->TakeEvents();
  std::vector<double> us, deferred_us, step_us;
  us.reserve(state.max_iterations);
  deferred_us.reserve(state.max_iterations);
  step_us.reserve(state.max_iterations);
  int32_t step = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (int i = 0; i < kSeqs; ++i) next_ids[i] = (step * 7919 + i) % 151936;
    ++step;
    state.ResumeTiming();
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<StepInfo> info = c->PrepareStep(entries);
    const auto t1 = std::chrono::steady_clock::now();
    // The first call that reads the index: hashes and indexes the pages
    // this step completed and builds their events.
    benchmark::DoNotOptimize(c->TakeEvents());
    const auto t2 = std::chrono::steady_clock::now();
    if (!info.ok()) {
      state.SkipWithError(info.status().ToString().c_str());
      break;
    }
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    deferred_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
    step_us.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
  }
  state.counters["median_us"] = Median(us);
  state.counters["p99_us"] = Percentile(us, 0.99);
  state.counters["deferred_us"] = Median(deferred_us);
  state.counters["step_us"] = Median(step_us);
  state.counters["pages_indexed"] = static_cast<double>(c->Stats().pages_indexed);
}
BENCHMARK(BM_PrepareStepPrefix)
    ->ArgName("prefix")
    ->Arg(0)
    ->Arg(1)
    ->Iterations(4000)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace fp4kv

BENCHMARK_MAIN();
