// Prefix-caching benchmarks: host work (the pool bytes do not matter), and
// the host tier of the prefix cache on a GPU.
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
//   BM_PrefixHostDemote/<pages>, BM_PrefixHostPromote/<pages>: CUDA only.
//     The host tier of the prefix cache (PrefixCacheOptions::host_bytes)
//     moving 1 / 64 / 4096 pages in one batch, against a pinned
//     cudaMemcpyAsync of the same bytes in the same direction, measured in
//     the same process. Cache: 32 layers, 8 KV heads, head_dim 128 (K and V),
//     page 16, NVFP4 keys and values, NHD, given scales: 576 KiB a page
//     (every layer's K/V data and block scales; 4096 pages are 2.25 GiB).
//     Demote: a pool of `pages` pages, all cached; a step of a fresh prompt
//     of `pages` pages evicts them all, so demotes them (device -> pinned
//     host). Promote: a prompt's `pages` pages on the host tier and every
//     device page free; CreateSequenceFromPrefix of the prompt promotes them
//     (pinned host -> device) and the next PrepareStep waits for them.
//     Timed region: CUDA events on the caller's stream, held (a host
//     function spinning on a flag) until the calls have returned: device
//     work only, i.e. the batch on the cache's copy stream (its page ids'
//     upload and the page-copy kernel), which the stream waits for, and the
//     step's own small upload (the slot mapping of a demoting step, the
//     promoted sequence's block-table row). The pinned copy is timed the
//     same way, as many times, back to back after the case's runs. Median
//     of 15 runs after 2 warm-up runs; batches of at most 64 pages, whose
//     runs last microseconds: 105 runs (7 an iteration) after 14. Counters:
//       median_us, GBps          the copy (page bytes / median time)
//       pinned_copy_us, pinned_GBps  the pinned cudaMemcpyAsync
//       fraction_of_pinned_copy  GBps / pinned_GBps (pct_of_copy: x 100)
//       call_us                  host time of the calls (eviction, the host
//                                tier's LRU and index, matching, enqueueing)
//       wall_us                  not held: from the calls until the stream
//                                is done (median of 5 runs)
//   BM_DecodeStepPromotion/<seqs>/<pages>/<promotion>: CUDA only. One decode
//     step of 64 sequences (contexts 2k-8k, pages scattered; 1 new token
//     each; append + NVFP4 decode attention, 32 query heads, bf16, in all 32
//     layers of the shape above; given scales, no rows appended before, one
//     input set), captured once as a CUDA graph, beside a promotion of a
//     prompt's 4096 pages (2.25 GiB) on the cache's copy stream. Each run
//     demotes the prompt's pages first (not timed), then runs step a and
//     step b. promotion 0: none (the step alone). 1: CreateSequenceFromPrefix
//     between step b's PrepareStep and its graph launch, so the copy runs
//     during step b. 2: CreateSequenceFromPrefix after step a's launch (a
//     serving loop admitting a request while a step runs): the copy runs
//     beside step b, whose sequences do not use the promoted pages (its
//     PrepareStep does not wait for it). Counters (medians
//     of 20 runs after 2 warm-up runs, CUDA events on the step's stream):
//       graph_us   step b's graph replay (events around its launch)
//       period_us  from the end of step a's graph to the end of step b's:
//                  what the promotion adds to the step's latency
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/decode_setup.h"
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

#define FP4KV_BENCH_RETURN_IF_ERROR(expr) \
  do {                                    \
    const absl::Status st_ = (expr);      \
    if (!st_.ok()) return st_;            \
  } while (0)

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

// ------------------------------------------------ host tier of the prefix cache
// GPU cases. The serving shape of the other GPU benches: 32 layers, 8 KV
// heads, head_dim 128 (K and V), page 16, NVFP4 keys and values, NHD: a page
// of every layer's K/V data and block scales is 576 KiB.
constexpr int kTierLayers = 32, kTierHeads = 8, kTierDim = 128, kTierQoHeads = 32;
constexpr int kTierWarmupRuns = 2;
constexpr int kTierRuns = 15;  // timed iterations
// Batches of at most kTierShortPages pages: kTierShortReps timed runs an
// iteration (the medians are over every run).
constexpr int kTierShortPages = 64;
constexpr int kTierShortReps = 7;
constexpr int kTierWallRuns = 5;
// A gate that is not opened within this time lets its stream go: the call
// under measurement waited for the device (the case reports an error).
constexpr auto kGateTimeout = std::chrono::seconds(20);

// Holds a stream until Open(): a host function enqueued on it (Close) spins
// until the flag is set. Work enqueued behind it starts only once the calls
// that enqueue it have returned, so CUDA events around that work time the
// device work alone, not the host work of the calls (a plain
// cudaMemcpyAsync's enqueue included).
class StreamGate {
 public:
  bool Close(cudaStream_t s) {
    open_.store(false, std::memory_order_relaxed);
    timed_out_.store(false, std::memory_order_relaxed);
    return cudaLaunchHostFunc(s, &Hold, this) == cudaSuccess;
  }
  void Open() { open_.store(true, std::memory_order_release); }
  bool timed_out() const { return timed_out_.load(std::memory_order_acquire); }

 private:
  static void CUDART_CB Hold(void* p) {
    StreamGate* g = static_cast<StreamGate*>(p);
    const auto until = std::chrono::steady_clock::now() + kGateTimeout;
    while (!g->open_.load(std::memory_order_acquire)) {
      if (std::chrono::steady_clock::now() > until) {
        g->timed_out_.store(true, std::memory_order_release);
        return;
      }
    }
  }
  std::atomic<bool> open_{true};
  std::atomic<bool> timed_out_{false};
};

// Pinned host memory owned for the length of one benchmark.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (ptr_ != nullptr) (void)cudaFreeHost(ptr_);
  }
  bool Alloc(int64_t bytes) {
    return cudaHostAlloc(&ptr_, static_cast<size_t>(bytes), cudaHostAllocDefault) == cudaSuccess;
  }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

// A stream, two timing events and a gate: the device time of the work that
// one call enqueues.
class GatedTimer {
 public:
  GatedTimer() = default;
  GatedTimer(const GatedTimer&) = delete;
  GatedTimer& operator=(const GatedTimer&) = delete;
  ~GatedTimer() {
    if (stream_ != nullptr) {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaStreamDestroy(stream_);
    }
    if (start_ != nullptr) (void)cudaEventDestroy(start_);
    if (stop_ != nullptr) (void)cudaEventDestroy(stop_);
  }
  absl::Status Init() {
    if (cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreate(&start_) != cudaSuccess || cudaEventCreate(&stop_) != cudaSuccess) {
      return absl::InternalError("stream or event creation failed");
    }
    return absl::OkStatus();
  }
  cudaStream_t stream() const { return stream_; }
  Stream fp4kv_stream() const { return reinterpret_cast<Stream>(stream_); }

  // Gated: the stream is held, `enqueue` runs (host_us: its host time), an
  // event pair brackets what it enqueued on the stream (and what other
  // streams do that the stream is made to wait for), then the gate opens.
  // device_ms: from the first event to the second. Work enqueued before the
  // call is finished first.
  absl::Status Time(const std::function<absl::Status()>& enqueue, double* device_ms,
                    double* host_us) {
    if (cudaStreamSynchronize(stream_) != cudaSuccess) {
      return absl::InternalError("cudaStreamSynchronize failed");
    }
    if (!gate_.Close(stream_) || cudaEventRecord(start_, stream_) != cudaSuccess) {
      gate_.Open();
      return absl::InternalError("gate or cudaEventRecord failed");
    }
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = enqueue();
    const auto t1 = std::chrono::steady_clock::now();
    const bool recorded = cudaEventRecord(stop_, stream_) == cudaSuccess;
    gate_.Open();
    const bool done = cudaEventSynchronize(stop_) == cudaSuccess;
    if (!st.ok()) return st;
    if (!recorded || !done) return absl::InternalError("cudaEventRecord/Synchronize failed");
    if (gate_.timed_out()) {
      return absl::InternalError("the call waited for the device while its stream was held");
    }
    float ms = 0;
    if (cudaEventElapsedTime(&ms, start_, stop_) != cudaSuccess) {
      return absl::InternalError("cudaEventElapsedTime failed");
    }
    *device_ms = ms;
    *host_us = std::chrono::duration<double, std::micro>(t1 - t0).count();
    return absl::OkStatus();
  }
  // Not gated: host time from before `enqueue` until what it enqueued on the
  // stream is complete (the caller's view: host work, then the copy).
  absl::Status Wall(const std::function<absl::Status()>& enqueue, double* wall_us) {
    if (cudaStreamSynchronize(stream_) != cudaSuccess) {
      return absl::InternalError("cudaStreamSynchronize failed");
    }
    const auto t0 = std::chrono::steady_clock::now();
    FP4KV_BENCH_RETURN_IF_ERROR(enqueue());
    if (cudaEventRecord(stop_, stream_) != cudaSuccess ||
        cudaEventSynchronize(stop_) != cudaSuccess) {
      return absl::InternalError("cudaEventRecord/Synchronize failed");
    }
    *wall_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    return absl::OkStatus();
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  StreamGate gate_;
};

// The bytes of one page, every layer's K/V data and scales.
int64_t TierPageBytes() {
  CacheGeometry g;
  g.num_kv_heads = kTierHeads;
  g.head_dim_k = g.head_dim_v = kTierDim;
  g.page_size = kPageSize;
  return g.PageBytes() * kTierLayers;
}

// A CUDA cache of the serving shape with prefix caching (no events kept)
// and a host tier of `host_pages` pages; given scales (pages are cached
// without any append; their bytes are whatever the pool held: a copy's
// time does not depend on them).
KVCacheOptions TierOptions(int64_t device_pages, int64_t host_pages, int max_pages_per_seq,
                           int max_tokens) {
  KVCacheOptions o;
  o.num_layers = kTierLayers;
  o.geometry.num_kv_heads = kTierHeads;
  o.geometry.head_dim_k = o.geometry.head_dim_v = kTierDim;
  o.geometry.page_size = kPageSize;
  o.geometry.layout = Layout::kNHD;
  o.geometry.num_pages = device_pages;
  o.device = Device::Cuda(0);
  o.k_global_scales.assign(kTierLayers, 0.05f);
  o.v_global_scales.assign(kTierLayers, 0.05f);
  o.max_seqs_per_step = 4;
  o.max_tokens_per_step = max_tokens;
  o.max_pages_per_seq = max_pages_per_seq;
  o.prefix_cache.enabled = true;
  o.prefix_cache.host_bytes = host_pages * TierPageBytes();
  return o;
}

// Token ids never used before in the process: a prompt made of them shares
// no page with an earlier one.
std::vector<int32_t> FreshTokens(int64_t n) {
  static int32_t next = 1;
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = next++;
  return t;
}

// One step of `n` new tokens (with their ids, or none: such pages are never
// cached) for a new sequence, in chunks of max_tokens_per_step.
absl::StatusOr<SequenceId> StepNew(KVCache& c, int64_t n, const std::vector<int32_t>* ids,
                                   Stream stream) {
  absl::StatusOr<SequenceId> id = bench::NewSequence(c);
  if (!id.ok()) return id.status();
  const int64_t chunk = c.options().max_tokens_per_step;
  for (int64_t done = 0; done < n; done += chunk) {
    const int32_t k = static_cast<int32_t>(std::min(chunk, n - done));
    StepEntry e{*id, k};
    if (ids != nullptr) e.token_ids = absl::Span<const int32_t>(ids->data() + done, k);
    absl::StatusOr<StepInfo> info = c.PrepareStep({&e, 1}, stream);
    if (!info.ok()) return info.status();
  }
  return *id;
}

// Demotes every cached page: sequences without token ids (their pages are
// never cached), of at most max_pages_per_seq pages each, take every free
// and cached page (evicting, so demoting, the cached ones), then are
// released (their pages go back free).
absl::Status DemoteAllCached(KVCache& c, Stream stream) {
  const KVCacheStats st = c.Stats();
  const int ps = c.options().geometry.page_size;
  std::vector<SequenceId> fillers;
  for (int64_t left = st.pages_free + st.pages_cached; left > 0;) {
    const int64_t n = std::min<int64_t>(left, c.options().max_pages_per_seq);
    absl::StatusOr<SequenceId> filler = StepNew(c, n * ps, nullptr, stream);
    if (!filler.ok()) return filler.status();
    fillers.push_back(*filler);
    left -= n;
  }
  for (SequenceId id : fillers) FP4KV_BENCH_RETURN_IF_ERROR(c.ReleaseSequence(id));
  return absl::OkStatus();
}

// A pinned cudaMemcpyAsync of `bytes`, device -> host or host -> device: the
// baseline of a tier case, timed (gated) like the case's runs.
class PinnedCopy {
 public:
  absl::Status Init(int64_t bytes, bool to_host) {
    bytes_ = bytes;
    to_host_ = to_host;
    dev_ = dev_buffers_.Alloc(bytes);
    if (dev_ == nullptr || !host_.Alloc(bytes)) {
      return absl::ResourceExhaustedError("baseline buffers: allocation failed");
    }
    if (cudaMemset(dev_, 0x5a, static_cast<size_t>(bytes)) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) {
      return absl::InternalError("cudaMemset failed");
    }
    return absl::OkStatus();
  }
  // One gated copy on the timer's stream: its device time in *ms.
  absl::Status Time(GatedTimer& timer, double* ms) {
    const cudaStream_t s = timer.stream();
    auto copy = [&]() -> absl::Status {
      const size_t n = static_cast<size_t>(bytes_);
      const cudaError_t e = to_host_
                                ? cudaMemcpyAsync(host_.get(), dev_, n, cudaMemcpyDeviceToHost, s)
                                : cudaMemcpyAsync(dev_, host_.get(), n, cudaMemcpyHostToDevice, s);
      return e == cudaSuccess ? absl::OkStatus() : absl::InternalError("cudaMemcpyAsync failed");
    };
    double host_us = 0;
    return timer.Time(copy, ms, &host_us);
  }

 private:
  bench::DeviceBuffers dev_buffers_;
  PinnedBuffer host_;
  void* dev_ = nullptr;
  int64_t bytes_ = 0;
  bool to_host_ = false;
};

// The common counters of the two bandwidth cases.
void ReportTier(benchmark::State& state, int64_t pages, const std::vector<double>& ms,
                const std::vector<double>& host_us, const std::vector<double>& wall_us,
                double copy_ms) {
  const double bytes = static_cast<double>(pages * TierPageBytes());
  const double med = Median(ms);
  const double gbps = med > 0 ? bytes / (med * 1e-3) / 1e9 : 0;
  const double copy_gbps = copy_ms > 0 ? bytes / (copy_ms * 1e-3) / 1e9 : 0;
  state.counters["pages"] = static_cast<double>(pages);
  state.counters["page_bytes"] = static_cast<double>(TierPageBytes());
  state.counters["bytes"] = bytes;
  state.counters["median_us"] = med * 1e3;
  state.counters["GBps"] = gbps;
  state.counters["pinned_copy_us"] = copy_ms * 1e3;
  state.counters["pinned_GBps"] = copy_gbps;
  state.counters["fraction_of_pinned_copy"] = copy_gbps > 0 ? gbps / copy_gbps : 0;
  state.counters["pct_of_copy"] = copy_gbps > 0 ? 100.0 * gbps / copy_gbps : 0;
  state.counters["call_us"] = Median(host_us);
  state.counters["wall_us"] = Median(wall_us);
}

// The runs of a bandwidth case: warm-up runs, one gated run per iteration
// (device time, the call's host time), wall-time runs, the cache's
// invariants, the counters. run(gated, out, host_us) as in the cases; `st`:
// the set-up's status (a failure skips the case).
void RunTierCase(benchmark::State& state, KVCache& c, int64_t pages, GatedTimer& timer,
                 PinnedCopy& baseline, absl::Status st,
                 const std::function<absl::Status(bool, double*, double*)>& run) {
  std::vector<double> ms, host_us, wall_us, copy_ms;
  // Warm-up runs not gated: first-use work (lazily created events and
  // buffers) may wait for the device, which a held stream would turn into
  // the gate's time-out rather than a measurement.
  // Short batches (tens of microseconds, where one run's jitter is a few
  // percent) take kTierShortReps runs an iteration, after as many warm-up
  // runs as one iteration has.
  const int reps = pages <= kTierShortPages ? kTierShortReps : 1;
  for (int r = 0; st.ok() && r < kTierWarmupRuns * reps; ++r) {
    double w = 0;
    st = run(false, &w, nullptr);
  }
  for (auto _ : state) {
    double sum = 0;
    for (int k = 0; k < reps && st.ok(); ++k) {
      double t = 0, h = 0;
      st = run(true, &t, &h);
      sum += t;
      ms.push_back(t);
      host_us.push_back(h);
    }
    if (!st.ok()) break;
    state.SetIterationTime(sum / reps * 1e-3);
  }
  // The baseline: as many copies, back to back after warm-up copies (the
  // copy engine at its best; a copy timed right after each run measured 4-5
  // us slower at 1 page on the H200, which would flatter the cases).
  for (int r = 0; st.ok() && r < kTierWarmupRuns * reps + static_cast<int>(ms.size()); ++r) {
    double b = 0;
    st = baseline.Time(timer, &b);
    if (r >= kTierWarmupRuns * reps) copy_ms.push_back(b);
  }
  for (int r = 0; st.ok() && r < kTierWallRuns; ++r) {
    double w = 0;
    st = run(false, &w, nullptr);
    wall_us.push_back(w);
  }
  if (st.ok()) st = c.CheckInvariants();
  if (!st.ok()) {
    state.SkipWithError(st.ToString().c_str());
    return;
  }
  ReportTier(state, pages, ms, host_us, wall_us, Median(copy_ms));
}


void BM_PrefixHostDemote(benchmark::State& state) {
  if (!bench::HaveGpu()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const int pages = static_cast<int>(state.range(0));
  const int64_t tokens = int64_t{pages} * kPageSize;
  GatedTimer timer;
  absl::Status st = timer.Init();
  PinnedCopy baseline;
  if (st.ok()) st = baseline.Init(pages * TierPageBytes(), /*to_host=*/true);
  // The pool holds exactly `pages` pages, all cached (a prompt's, released);
  // every run's step of a fresh prompt of `pages` pages evicts them all.
  absl::StatusOr<KVCache> made =
      st.ok() ? KVCache::Create(TierOptions(pages, pages, pages, static_cast<int>(tokens)))
              : absl::StatusOr<KVCache>(st);
  if (made.ok() && made->Stats().host_prefix_pages_total < pages) {
    made = absl::InternalError("the host tier holds fewer pages than asked");
  }
  if (!made.ok()) {
    state.SkipWithError(made.status().ToString().c_str());
    return;
  }
  KVCache& c = *made;
  const Stream stream = timer.fp4kv_stream();
  {
    const std::vector<int32_t> ids = FreshTokens(tokens);
    absl::StatusOr<SequenceId> first = StepNew(c, tokens, &ids, stream);
    st = first.ok() ? c.ReleaseSequence(*first) : first.status();
  }
  // One run: the step that evicts (so demotes) every cached page. Timed
  // (gated): the demotion batch's device work on the copy stream (the
  // page-copy kernel into the pinned host tier, after an upload of its page
  // ids when the batch has more than 64 pages) and the
  // step's own upload after it (its slot mapping, tokens * 8 bytes), which
  // the stream orders after the copies. Not timed: PrepareStep's host work
  // (eviction, the host tier's LRU and index, the token ids of the demoted
  // pages, enqueueing the copy: call_us), and releasing the sequence after
  // the run (hashing and indexing its pages: they are the next run's cached
  // pages). wall_us: the same step, not gated, from the call until its
  // stream is done.
  // gated: out is the device time (ms) and host_us the call's host time;
  // not gated: out is the wall time (us).
  auto run = [&](bool gated, double* out, double* host_us) -> absl::Status {
    const std::vector<int32_t> ids = FreshTokens(tokens);
    const int64_t before = c.Stats().host_prefix_demotions;
    absl::StatusOr<SequenceId> seq = absl::UnknownError("not run");
    auto step = [&]() -> absl::Status {
      seq = bench::NewSequence(c);
      if (!seq.ok()) return seq.status();
      const StepEntry e{*seq, static_cast<int32_t>(tokens), absl::Span<const int32_t>(ids)};
      return c.PrepareStep({&e, 1}, stream).status();
    };
    FP4KV_BENCH_RETURN_IF_ERROR(gated ? timer.Time(step, out, host_us) : timer.Wall(step, out));
    const int64_t demoted = c.Stats().host_prefix_demotions - before;
    if (demoted != pages) {
      return absl::InternalError(
          absl::StrCat("expected ", pages, " pages demoted by the step, got ", demoted));
    }
    return c.ReleaseSequence(*seq);
  };
  RunTierCase(state, c, pages, timer, baseline, st, run);
}
BENCHMARK(BM_PrefixHostDemote)
    ->ArgName("pages")
    ->Arg(1)
    ->Arg(4)
    ->Arg(16)
    ->Arg(64)
    ->Arg(4096)
    ->Iterations(kTierRuns)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

void BM_PrefixHostPromote(benchmark::State& state) {
  if (!bench::HaveGpu()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const int pages = static_cast<int>(state.range(0));
  const int64_t tokens = int64_t{pages} * kPageSize;
  GatedTimer timer;
  absl::Status st = timer.Init();
  PinnedCopy baseline;
  if (st.ok()) st = baseline.Init(pages * TierPageBytes(), /*to_host=*/false);
  // The pool: the prompt's `pages` full pages and its last token's page.
  const int dev_pages = pages + 1;
  absl::StatusOr<KVCache> made =
      st.ok() ? KVCache::Create(TierOptions(dev_pages, pages, dev_pages, dev_pages * kPageSize))
              : absl::StatusOr<KVCache>(st);
  if (made.ok() && made->Stats().host_prefix_pages_total < pages) {
    made = absl::InternalError("the host tier holds fewer pages than asked");
  }
  if (!made.ok()) {
    state.SkipWithError(made.status().ToString().c_str());
    return;
  }
  KVCache& c = *made;
  const Stream stream = timer.fp4kv_stream();
  // The prompt: `pages` full pages and one more token (a prompt never
  // matches in full).
  const std::vector<int32_t> prompt = FreshTokens(tokens + 1);
  {
    absl::StatusOr<SequenceId> first = StepNew(c, tokens + 1, &prompt, stream);
    st = first.ok() ? c.ReleaseSequence(*first) : first.status();
  }
  // One run. Not timed: the prompt's pages are demoted (DemoteAllCached:
  // every device page then free, so the promotion evicts nothing) and the
  // stream synchronized. Timed (gated): what CreateSequenceFromPrefix of the
  // prompt enqueues (the page-copy kernel from the pinned host tier into
  // `pages` device pages, on the copy stream, after an upload of its page
  // ids when there are more than 64) and the
  // next PrepareStep (the new sequence, no new tokens), whose stream waits
  // for the promotion before its own small upload (the sequence's
  // block-table row, pages * 4 bytes). Not timed: the host work of both
  // calls (matching the prompt's hashes in both tiers, allocation, the host
  // tier's LRU and index, indexing the promoted pages: call_us), and
  // releasing the sequence after the run (its pages stay cached on the
  // device until the next run demotes them). wall_us: the same calls, not
  // gated, until the stream is done.
  // gated: out is the device time (ms) and host_us the calls' host time;
  // not gated: out is the wall time (us).
  auto run = [&](bool gated, double* out, double* host_us) -> absl::Status {
    FP4KV_BENCH_RETURN_IF_ERROR(DemoteAllCached(c, stream));
    if (cudaStreamSynchronize(timer.stream()) != cudaSuccess) {
      return absl::InternalError("cudaStreamSynchronize failed");
    }
    const PrefixMatch m = c.MatchPrefix(prompt);
    if (m.pages_host != pages || m.tokens_gpu != 0) {
      return absl::InternalError(absl::StrCat("expected ", pages, " pages on the host, matched ",
                                              m.pages_host, " there and ", m.tokens_gpu,
                                              " tokens on the device"));
    }
    const KVCacheStats before = c.Stats();
    absl::StatusOr<PrefixSequence> seq = absl::UnknownError("not run");
    auto promote = [&]() -> absl::Status {
      seq = c.CreateSequenceFromPrefix(prompt);
      if (!seq.ok()) return seq.status();
      const StepEntry e{seq->seq, 0};
      return c.PrepareStep({&e, 1}, stream).status();
    };
    FP4KV_BENCH_RETURN_IF_ERROR(gated ? timer.Time(promote, out, host_us)
                                      : timer.Wall(promote, out));
    const KVCacheStats after = c.Stats();
    if (seq->host_tokens != tokens ||
        after.host_prefix_promotions - before.host_prefix_promotions != pages ||
        after.host_prefix_demotions != before.host_prefix_demotions) {
      return absl::InternalError(
          absl::StrCat("expected ", pages, " pages promoted and none demoted, got ",
                       after.host_prefix_promotions - before.host_prefix_promotions, " and ",
                       after.host_prefix_demotions - before.host_prefix_demotions));
    }
    return c.ReleaseSequence(seq->seq);
  };
  RunTierCase(state, c, pages, timer, baseline, st, run);
}
BENCHMARK(BM_PrefixHostPromote)
    ->ArgName("pages")
    ->Arg(1)
    ->Arg(4)
    ->Arg(16)
    ->Arg(64)
    ->Arg(4096)
    ->Iterations(kTierRuns)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

// One graph-replayed decode step (append + NVFP4 decode attention in every
// layer) beside a promotion; see the header comment.
void BM_DecodeStepPromotion(benchmark::State& state) {
  if (!bench::HaveGpu()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const int seqs = static_cast<int>(state.range(0));
  const int pages = static_cast<int>(state.range(1));
  const int mode = static_cast<int>(state.range(2));  // 0 alone, 1 in flight, 2 before the step
  const int64_t tokens = int64_t{pages} * kPageSize;
  constexpr int kWarmupRuns = 2;
  const int runs = kWarmupRuns + static_cast<int>(state.max_iterations);
  cudaStream_t cs = nullptr;
  if (cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) != cudaSuccess) {
    state.SkipWithError("cudaStreamCreate failed");
    return;
  }
  const Stream stream = reinterpret_cast<Stream>(cs);
  const Device dev = Device::Cuda(0);
  CacheGeometry g;
  g.num_kv_heads = kTierHeads;
  g.head_dim_k = g.head_dim_v = kTierDim;
  // The decode cache of BM_DecodeStepGraph (kv_cache_bench.cc; prefill
  // steps of 4096 tokens) with given scales and no rows appended, as in
  // BM_OverlapDecodeLoop, room for the prompt's pages (and its last
  // token's) and a host tier for them.
  const bench::OptionsTweak tweak = [&](KVCacheOptions& o) {
    o.k_global_scales.assign(kTierLayers, 0.05f);
    o.v_global_scales.assign(kTierLayers, 0.05f);
    o.geometry.num_pages += pages + 1;
    o.max_pages_per_seq = std::max(o.max_pages_per_seq, pages + 1);
    o.prefix_cache.enabled = true;
    o.prefix_cache.host_bytes = int64_t{pages} * TierPageBytes();
  };
  // Two steps a run, one to capture the graph.
  bench::DecodeSetup s = bench::MakeDecodeSetup(g, kTierLayers, seqs, 2 * runs + 8,
                                                /*step_tokens=*/4096, dev, stream, nullptr, tweak);
  if (!s.cache.ok()) {
    state.SkipWithError(s.cache.status().ToString().c_str());
    (void)cudaStreamDestroy(cs);
    return;
  }
  KVCache& c = *s.cache;
  std::string error;  // the first failure; the case is skipped with it
  auto check = [&error](bool ok, const std::string& what) {
    if (!ok && error.empty()) error = what;
    return error.empty();
  };
#define PROMO_CUDA(call) check((call) == cudaSuccess, #call " failed")
  absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
  CacheAttentionOptions ao;
  ao.num_qo_heads = kTierQoHeads;
  absl::StatusOr<CacheAttention> att = c.attention(ao);
  check(app.ok(), app.status().ToString());
  check(att.ok(), att.status().ToString());
  // One input set: per layer K, V [seqs, H, D] and q [seqs, Hq, D], bf16.
  const int64_t kv_halves = int64_t{seqs} * kTierHeads * kTierDim;
  const int64_t q_halves = int64_t{seqs} * kTierQoHeads * kTierDim;
  const int64_t in_halves = kTierLayers * (2 * kv_halves + q_halves);
  const int64_t ws_bytes = att.ok() ? att->WorkspaceBytes() : 0;
  bench::DeviceBuffers mem;
  void* d_in = mem.Alloc(in_halves * 2);
  void* d_out = mem.Alloc(q_halves * 2);
  void* d_ws = mem.Alloc(ws_bytes);
  check(d_in != nullptr && d_out != nullptr && d_ws != nullptr, "allocation failed");
  if (error.empty()) check(bench::UploadRandomBf16(d_in, in_halves, 5), "input upload failed");
  auto input = [&](int l, int which) {
    uint16_t* base = static_cast<uint16_t*>(d_in) + l * (2 * kv_halves + q_halves);
    if (which < 2) {
      return TensorView::Contiguous(base + which * kv_halves, DType::kBF16,
                                    {seqs, kTierHeads, kTierDim}, dev);
    }
    return TensorView::Contiguous(base + 2 * kv_halves, DType::kBF16,
                                  {seqs, kTierQoHeads, kTierDim}, dev);
  };
  const TensorView out =
      TensorView::Contiguous(d_out, DType::kBF16, {seqs, kTierQoHeads, kTierDim}, dev);
  // The prompt whose `pages` pages are promoted: prefilled once (token ids
  // given, so its full pages are cached when it is released).
  const std::vector<int32_t> prompt = FreshTokens(tokens + 1);
  if (error.empty()) {
    absl::StatusOr<SequenceId> p = StepNew(c, tokens + 1, &prompt, stream);
    const absl::Status st = p.ok() ? c.ReleaseSequence(*p) : p.status();
    check(st.ok(), st.ToString());
  }
  // The step's graph, captured once after a PrepareStep.
  cudaGraphExec_t exec = nullptr;
  auto prepare = [&]() {
    absl::StatusOr<StepInfo> info = c.PrepareStep(s.entries, stream);
    return check(info.ok(), info.status().ToString());
  };
  if (error.empty() && prepare()) {
    cudaGraph_t graph = nullptr;
    if (PROMO_CUDA(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal))) {
      absl::Status st;
      for (int l = 0; l < kTierLayers && st.ok(); ++l) {
        st = app->Run(l, input(l, 0), input(l, 1), stream);
        if (st.ok()) st = att->Run(l, input(l, 2), out, d_ws, ws_bytes, stream);
      }
      const bool ended = PROMO_CUDA(cudaStreamEndCapture(cs, &graph));
      if (ended && check(st.ok(), st.ToString())) {
        PROMO_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      }
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
    }
    if (error.empty()) PROMO_CUDA(cudaGraphLaunch(exec, cs));
    PROMO_CUDA(cudaStreamSynchronize(cs));
  }
  cudaEvent_t end_a = nullptr, start_b = nullptr, end_b = nullptr;
  PROMO_CUDA(cudaEventCreate(&end_a));
  PROMO_CUDA(cudaEventCreate(&start_b));
  PROMO_CUDA(cudaEventCreate(&end_b));
  // The promotion: CreateSequenceFromPrefix of the prompt, whose pages are
  // all on the host tier.
  absl::StatusOr<PrefixSequence> promoted = absl::UnknownError("none");
  auto promote = [&]() {
    promoted = c.CreateSequenceFromPrefix(prompt);
    if (!check(promoted.ok(), promoted.status().ToString())) return false;
    return check(
        promoted->host_tokens == tokens,
        absl::StrCat("expected ", tokens, " tokens promoted, got ", promoted->host_tokens));
  };
  // One run: the prompt's pages demoted (not timed), then steps a and b;
  // graph_ms: step b's replay, period_ms: from the end of a to the end of b.
  auto run = [&](double* graph_ms, double* period_ms) {
    absl::Status st = DemoteAllCached(c, stream);
    if (!check(st.ok(), st.ToString()) || !PROMO_CUDA(cudaStreamSynchronize(cs))) return;
    if (mode != 0) {
      const PrefixMatch m = c.MatchPrefix(prompt);
      if (!check(m.pages_host == pages, "the prompt's pages are not all on the host tier")) return;
    }
    if (!prepare() || !PROMO_CUDA(cudaGraphLaunch(exec, cs)) ||
        !PROMO_CUDA(cudaEventRecord(end_a, cs))) {
      return;
    }
    if (mode == 2 && !promote()) return;  // in flight during step b (which does not wait)
    if (!prepare()) return;
    if (mode == 1 && !promote()) return;  // after the step's upload: beside the step
    if (!PROMO_CUDA(cudaEventRecord(start_b, cs)) || !PROMO_CUDA(cudaGraphLaunch(exec, cs)) ||
        !PROMO_CUDA(cudaEventRecord(end_b, cs)) || !PROMO_CUDA(cudaEventSynchronize(end_b))) {
      return;
    }
    float g_ms = 0, p_ms = 0;
    if (!PROMO_CUDA(cudaEventElapsedTime(&g_ms, start_b, end_b)) ||
        !PROMO_CUDA(cudaEventElapsedTime(&p_ms, end_a, end_b))) {
      return;
    }
    *graph_ms = g_ms;
    *period_ms = p_ms;
    if (mode != 0) {
      st = c.SynchronizeSwaps();  // the promotion is done
      if (st.ok()) st = c.ReleaseSequence(promoted->seq);
      check(st.ok(), st.ToString());
    }
  };
  std::vector<double> graph_us, period_us;
  for (int r = 0; r < kWarmupRuns && error.empty(); ++r) {
    double gm = 0, pm = 0;
    run(&gm, &pm);
  }
  for (auto _ : state) {
    if (!error.empty()) break;
    double gm = 0, pm = 0;
    run(&gm, &pm);
    state.SetIterationTime(gm * 1e-3);
    graph_us.push_back(gm * 1e3);
    period_us.push_back(pm * 1e3);
  }
  if (error.empty()) {
    const absl::Status st = c.CheckInvariants();
    check(st.ok(), st.ToString());
  }
#undef PROMO_CUDA
  if (!error.empty()) state.SkipWithError(error.c_str());
  (void)cudaStreamSynchronize(cs);
  state.counters["graph_us"] = Median(graph_us);
  state.counters["period_us"] = Median(period_us);
  state.counters["seqs"] = seqs;
  state.counters["pages"] = pages;
  state.counters["promoted_MB"] =
      mode == 0 ? 0.0 : static_cast<double>(pages) * static_cast<double>(TierPageBytes()) / 1e6;
  state.counters["layers"] = kTierLayers;
  if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
  for (cudaEvent_t e : {end_a, start_b, end_b}) {
    if (e != nullptr) (void)cudaEventDestroy(e);
  }
  (void)cudaStreamDestroy(cs);
}
BENCHMARK(BM_DecodeStepPromotion)
    ->ArgNames({"seqs", "pages", "promotion"})
    ->Args({64, 4096, 0})
    ->Args({64, 4096, 1})
    ->Args({64, 4096, 2})
    ->Iterations(20)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace fp4kv

BENCHMARK_MAIN();
