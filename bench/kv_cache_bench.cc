// KVCache benchmarks.
//
// Every cache below is made the same way (MakeDecodeSetup,
// bench/decode_setup.h): its free pages are first scattered
// (bench/scatter_pages.h), so every sequence's pages are a random subset of
// the pool in random order, then `seqs` sequences get random contexts of
// 2k-8k tokens by chunked prefill steps that pack several sequences each.
//
//   BM_PrepareStepDecode/<cpu|cuda>/<order>: host time of PrepareStep for 256
//     decode sequences (1 new token each, contexts 2k-8k tokens, page size
//     16). order 0: the same order every step (the usual decode loop);
//     order 1: shuffled every step (every block-table row rewritten).
//     Counters: median_us / p99_us of the individual calls. The pool bytes
//     do not matter here (nothing is appended).
//   BM_PageAllocator/<n>: allocate n pages then free them (the page pool,
//     no prefix index); pages/s.
//   BM_CacheAllocateRelease/<n>: the same through the cache: a sequence, a
//     step reserving n pages, ReleaseSequence; pages/s.
//   BM_DecodeStepGraph/<seqs>/<attention>/<k8>: CUDA only. A model-shaped cache
//     (32 layers, 8 KV heads, head_dim 128, page 16) whose contexts were
//     written through the cache's appender in every layer (random bf16 K/V
//     rows, 4096 rows a call; the first rows calibrate each layer's scales).
//     The decode step of every layer (1 new token per sequence) is captured
//     as a CUDA graph: append + materialize (attention 0: what an FP8
//     attention kernel would then read) or append + decode attention straight
//     from the NVFP4 pages (attention 1; 32 query heads, bf16). Every layer
//     has its own random q/K/V inputs; several such input sets, together
//     more than twice the L2 size, are each captured in a graph of their own
//     and replayed in turn, so no step finds its inputs in L2.
//     Timed region: exactly one graph replay (CUDA events around
//     cudaGraphLaunch), after PrepareStep and its upload were enqueued;
//     graph_us is the median over the timed steps. Not in it: PrepareStep
//     (prepare_us: its host time), the upload. kernels_sum_us: the same
//     kernels launched eagerly, the sum of their event-timed durations
//     (median of 10 steps), and split: append_sum_us (every layer's append)
//     and read_sum_us (every layer's attention or materialize). k8 1: the
//     cache keeps FP8 keys (K8V4, NVFP4
//     values); skipped with the status when the attention op refuses them.
//   BM_OverlapDecodeLoop/<cuda>/<seqs>/<host_us>/<slots>: a decode loop (1
//     new token per sequence and step, append + decode attention in every
//     layer) with host_us of busy host work per step standing for the
//     scheduler. slots 1: the serial loop (host work, PrepareStep, launch,
//     wait for the step: the sampled ids are needed). slots 2
//     (KVCacheOptions::step_slots): the host work and PrepareStep of step
//     N+1 run while step N runs, each slot with its own captured graph; the
//     loop waits for step N only after launching N+1. CUDA: the model shape
//     of BM_DecodeStepGraph (32 layers, 8 KV heads, head_dim 128, 32 query
//     heads), contexts 2k-8k, given global scales, pages left as zeros (the
//     bytes do not change the time), one input set. CPU (cuda 0): 2 layers,
//     2 KV heads, head_dim 64, contexts 16-64, the ops running inside their
//     calls (nothing can overlap; the case checks the loop). Counters:
//     step_us (mean wall time of a step), device_us (mean event-timed
//     device time of a step's graph; CPU: the ops' time), prepare_us
//     (median host time of PrepareStep), hidden_frac: the fraction of the
//     injected host work hidden, (host_us + prepare_us + device_us -
//     step_us) / host_us clamped to [0, 1] (host_us 0: hidden_us instead).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/decode_setup.h"
#include "bench/host_stats.h"
#include "bench/scatter_pages.h"
#include "benchmark/benchmark.h"
#include "fp4kv/kv_cache.h"
#include "src/page_pool.h"

namespace fp4kv {
namespace {

constexpr int kDecodeSeqs = 256;
constexpr int kPageSize = bench::kDecodePageSize;
constexpr int kMinContext = bench::kMinDecodeContext;
constexpr int kMaxContext = bench::kMaxDecodeContext;
// Step capacity in tokens: a decode step's K/V input buffer (the captured
// appender covers all of it; padding rows are skipped).
constexpr int kStepTokens = 512;

using bench::AdjacentPageFraction;
using bench::DecodeSetup;
using bench::DeviceBuffers;
using bench::HaveGpu;
using bench::MakeDecodeSetup;
using bench::Median;
using bench::OptionsTweak;
using bench::Percentile;
using bench::PrefillAppend;
using bench::RandomBf16Pool;
using bench::UploadRandomBf16;

#define FP4KV_BENCH_RETURN_IF_ERROR(expr)   \
  do {                                      \
    const absl::Status st_ = (expr);        \
    if (!st_.ok()) return st_;              \
  } while (0)

void BM_PrepareStepDecode(benchmark::State& state) {
  const bool cuda = state.range(0) == 1;
  const bool shuffle = state.range(1) == 1;
  if (cuda && !HaveGpu()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  cudaStream_t cs = nullptr;
  if (cuda && cudaStreamCreate(&cs) != cudaSuccess) {
    state.SkipWithError("cudaStreamCreate failed");
    return;
  }
  const Stream stream = reinterpret_cast<Stream>(cs);
  CacheGeometry g;
  g.num_kv_heads = 1;  // host time does not depend on the row shape
  g.head_dim_k = g.head_dim_v = 16;
  const int growth = static_cast<int>(state.max_iterations) + 16;
  DecodeSetup s = MakeDecodeSetup(g, 1, kDecodeSeqs, growth, kStepTokens,
                                  cuda ? Device::Cuda(0) : Device::Cpu(), stream);
  if (!s.cache.ok()) {
    state.SkipWithError(s.cache.status().ToString().c_str());
    return;
  }
  const double adjacent = AdjacentPageFraction(*s.cache, s.entries);
  std::mt19937 rng(7);
  std::vector<double> us;
  us.reserve(state.max_iterations);
  for (auto _ : state) {
    state.PauseTiming();
    if (shuffle) std::shuffle(s.entries.begin(), s.entries.end(), rng);
    // In a serving loop the previous step's layers run between two
    // PrepareSteps, so its upload has long finished; wait for it here, outside
    // the measured region, so the number is PrepareStep's own host work and
    // not the GPU latency of the upload just enqueued.
    if (cuda) (void)cudaStreamSynchronize(cs);
    state.ResumeTiming();
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<StepInfo> info = s.cache->PrepareStep(s.entries, stream);
    const auto t1 = std::chrono::steady_clock::now();
    if (!info.ok()) {
      state.SkipWithError(info.status().ToString().c_str());
      break;
    }
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  state.counters["median_us"] = Median(us);
  state.counters["p99_us"] = Percentile(us, 0.99);
  state.counters["seqs"] = kDecodeSeqs;
  state.counters["adjacent_pages"] = adjacent;
  if (cuda) {
    (void)cudaStreamSynchronize(cs);
    (void)cudaStreamDestroy(cs);
  }
}
BENCHMARK(BM_PrepareStepDecode)
    ->ArgNames({"cuda", "shuffled"})
    ->Args({0, 0})
    ->Args({0, 1})
    ->Args({1, 0})
    ->Args({1, 1})
    ->Iterations(2000)
    ->Unit(benchmark::kMicrosecond);

void BM_PageAllocator(benchmark::State& state) {
  const int32_t n = static_cast<int32_t>(state.range(0));
  internal::PagePool a;
  if (absl::Status st = a.Init(1 << 20, /*prefix_index=*/false); !st.ok()) {
    state.SkipWithError(st.ToString().c_str());
    return;
  }
  std::vector<int32_t> pages(n);
  for (auto _ : state) {
    for (int32_t i = 0; i < n; ++i) pages[i] = a.Allocate();
    benchmark::DoNotOptimize(pages.data());
    for (int32_t i = 0; i < n; ++i) a.Release(pages[i]);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);  // pages allocated and freed
  state.counters["Mpages_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * n / 1e6, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_PageAllocator)->Arg(1)->Arg(16)->Arg(256)->Arg(4096)->Arg(65536);

void BM_CacheAllocateRelease(benchmark::State& state) {
  const int pages = static_cast<int>(state.range(0));
  KVCacheOptions o;
  o.num_layers = 1;
  o.geometry.num_kv_heads = 1;
  o.geometry.head_dim_k = o.geometry.head_dim_v = 16;
  o.geometry.page_size = kPageSize;
  o.geometry.num_pages = 4 * pages;
  o.max_seqs_per_step = 1;
  o.max_tokens_per_step = pages * kPageSize;
  o.max_pages_per_seq = pages;
  absl::StatusOr<KVCache> c = KVCache::Create(o);
  if (!c.ok()) {
    state.SkipWithError(c.status().ToString().c_str());
    return;
  }
  for (auto _ : state) {
    absl::StatusOr<SequenceId> id = bench::NewSequence(*c);
    if (!id.ok()) {
      state.SkipWithError(id.status().ToString().c_str());
      break;
    }
    const StepEntry e{*id, pages * kPageSize};
    absl::StatusOr<StepInfo> info = c->PrepareStep({&e, 1});
    if (!info.ok() || !c->ReleaseSequence(*id).ok()) {
      state.SkipWithError("step failed");
      break;
    }
  }
  state.counters["Mpages_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * pages / 1e6, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CacheAllocateRelease)->Arg(1)->Arg(16)->Arg(256);

// ----------------------------------------------------------------- GPU step
constexpr int kPrefillTokens = 4096;     // rows per prefill append call
constexpr int64_t kPrefillSrcRows = 16384;  // random K/V rows the prefill draws from

void BM_DecodeStepGraph(benchmark::State& state) {
  if (!HaveGpu()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const int seqs = static_cast<int>(state.range(0));
  const bool attend = state.range(1) != 0;
  const bool fp8_keys = state.range(2) != 0;
  constexpr int kLayers = 32, kHeads = 8, kDim = 128, kQoHeads = 32;
  constexpr int kEagerSteps = 10;
  const Device dev = Device::Cuda(0);
  int l2_bytes = 0;
  if (cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, 0) != cudaSuccess) {
    state.SkipWithError("cudaDeviceGetAttribute(L2) failed");
    return;
  }
  cudaStream_t cs;
  if (cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) != cudaSuccess) {
    state.SkipWithError("cudaStreamCreate failed");
    return;
  }
  const Stream stream = reinterpret_cast<Stream>(cs);
  DeviceBuffers mem;
  // The step's inputs: per layer K and V [seqs, H, D] (and q [seqs, Hq, D]
  // with attention), bf16; as many sets as make more than 2x L2.
  const int64_t kv_halves = int64_t{seqs} * kHeads * kDim;
  const int64_t q_halves = attend ? int64_t{seqs} * kQoHeads * kDim : 0;
  const int64_t set_bytes = kLayers * (2 * kv_halves + q_halves) * 2;
  const int sets =
      static_cast<int>(std::max<int64_t>(2, (2 * int64_t{l2_bytes}) / set_bytes + 1));
  // Random prefill rows.
  const int64_t src_halves = kPrefillSrcRows * kHeads * kDim;
  void* d_src_k = mem.Alloc(src_halves * 2);
  void* d_src_v = mem.Alloc(src_halves * 2);
  if (d_src_k == nullptr || d_src_v == nullptr || !UploadRandomBf16(d_src_k, src_halves, 1) ||
      !UploadRandomBf16(d_src_v, src_halves, 2)) {
    state.SkipWithError("prefill source allocation or upload failed");
    (void)cudaStreamDestroy(cs);
    return;
  }

  CacheGeometry g;
  g.num_kv_heads = kHeads;
  g.head_dim_k = g.head_dim_v = kDim;
  g.key_format = fp8_keys ? KeyFormat::kFp8 : KeyFormat::kNvfp4;
  const int timed_steps = static_cast<int>(state.max_iterations);
  const int max_steps = 16 + sets + timed_steps;  // eager, warm-up and timed steps
  // Prefill: every step's rows appended in every layer through the cache's
  // appender (bound at the first step), from windows of the random rows.
  absl::StatusOr<CacheAppender> app = absl::UnknownError("unbound");
  const PrefillAppend prefill = [&](KVCache& c, const StepInfo&, int step) -> absl::Status {
    if (!app.ok()) app = c.appender(DType::kBF16);
    if (!app.ok()) return app.status();
    for (int l = 0; l < kLayers; ++l) {
      const int64_t off = static_cast<int64_t>((uint64_t{static_cast<uint64_t>(step)} * kLayers +
                                                static_cast<uint64_t>(l)) *
                                               2654435761u % (kPrefillSrcRows - kPrefillTokens + 1));
      const int64_t at = off * kHeads * kDim;
      const TensorView k = TensorView::Contiguous(static_cast<uint16_t*>(d_src_k) + at,
                                                  DType::kBF16, {kPrefillTokens, kHeads, kDim}, dev);
      const TensorView v = TensorView::Contiguous(static_cast<uint16_t*>(d_src_v) + at,
                                                  DType::kBF16, {kPrefillTokens, kHeads, kDim}, dev);
      if (absl::Status st = app->Run(l, k, v, stream); !st.ok()) return st;
    }
    return absl::OkStatus();
  };
  DecodeSetup s = MakeDecodeSetup(g, kLayers, seqs, max_steps, kPrefillTokens, dev, stream, prefill);
  if (!s.cache.ok()) {
    state.SkipWithError(s.cache.status().ToString().c_str());
    (void)cudaStreamDestroy(cs);
    return;
  }
  KVCache& c = *s.cache;
  const double adjacent = AdjacentPageFraction(c, s.entries);
  std::string error;  // the first failure; the case is skipped with it
  auto check = [&error](bool ok, const std::string& what) {
    if (!ok && error.empty()) error = what;
    return error.empty();
  };
#define STEP_CUDA(call) check((call) == cudaSuccess, #call " failed")
  // The prefill's appends (and the layers' first-row calibrations) are done
  // and their calibrated flags seen before anything is captured.
  STEP_CUDA(cudaStreamSynchronize(cs));
  absl::StatusOr<CacheMaterializer> mat = c.materializer();
  CacheAttentionOptions ao;
  ao.num_qo_heads = kQoHeads;
  absl::StatusOr<CacheAttention> att = c.attention(ao);
  check(app.ok(), app.status().ToString());
  check(mat.ok(), mat.status().ToString());
  if (attend) check(att.ok(), att.status().ToString());
  if (attend && att.ok()) state.SetLabel(std::string("decode ") + att->op().decode_family());
  const int64_t W = c.Fp8WorkspacePagesAtCapacity();
  const int64_t attn_ws_bytes = attend && att.ok() ? att->WorkspaceBytes() : 0;
  void* d_ws = nullptr;
  void* d_out = nullptr;
  std::vector<void*> d_sets(sets, nullptr);  // per set: K, V (, q) of every layer
  if (error.empty()) {
    d_ws = mem.Alloc(attend ? attn_ws_bytes : W * 2LL * kHeads * kPageSize * kDim);
    d_out = mem.Alloc(q_halves * 2);
    check(d_ws != nullptr && d_out != nullptr, "workspace allocation failed");
    for (int i = 0; i < sets && error.empty(); ++i) {
      d_sets[i] = mem.Alloc(set_bytes);
      if (check(d_sets[i] != nullptr, "input set allocation failed")) {
        check(UploadRandomBf16(d_sets[i], set_bytes / 2, 100 + i), "input set upload failed");
      }
    }
  }
  const TensorView ws =
      TensorView::Contiguous(d_ws, DType::kE4M3, {W, 2, kHeads, kPageSize, kDim}, dev);
  const TensorView out = TensorView::Contiguous(d_out, DType::kBF16, {seqs, kQoHeads, kDim}, dev);
  // Layer l of input set i: K (which 0), V (1), q (2).
  auto input = [&](int i, int l, int which) {
    uint16_t* base = static_cast<uint16_t*>(d_sets[i]) + l * (2 * kv_halves + q_halves);
    if (which < 2) {
      return TensorView::Contiguous(base + which * kv_halves, DType::kBF16, {seqs, kHeads, kDim},
                                    dev);
    }
    return TensorView::Contiguous(base + 2 * kv_halves, DType::kBF16, {seqs, kQoHeads, kDim}, dev);
  };
  // Every layer's append then read, on input set i; marks (eager runs only):
  // an event before each append and each read, and one at the end.
  auto record = [&](cudaEvent_t* marks, int at) {
    return marks == nullptr || cudaEventRecord(marks[at], cs) == cudaSuccess;
  };
  auto layers = [&](int i, cudaEvent_t* marks) -> absl::Status {
    for (int l = 0; l < kLayers; ++l) {
      if (!record(marks, 2 * l)) return absl::InternalError("cudaEventRecord failed");
      absl::Status st = app->Run(l, input(i, l, 0), input(i, l, 1), stream);
      if (!record(marks, 2 * l + 1)) return absl::InternalError("cudaEventRecord failed");
      if (st.ok()) {
        st = attend ? att->Run(l, input(i, l, 2), out, d_ws, attn_ws_bytes, stream)
                    : mat->Run(l, ws, stream);
      }
      if (!st.ok()) return st;
    }
    if (!record(marks, 2 * kLayers)) return absl::InternalError("cudaEventRecord failed");
    return absl::OkStatus();
  };
  std::vector<cudaEvent_t> marks(2 * kLayers + 1, nullptr);
  for (cudaEvent_t& e : marks) STEP_CUDA(cudaEventCreate(&e));
  cudaEvent_t start = nullptr, stop = nullptr;
  STEP_CUDA(cudaEventCreate(&start));
  STEP_CUDA(cudaEventCreate(&stop));
  auto prepare = [&]() {
    absl::StatusOr<StepInfo> info = c.PrepareStep(s.entries, stream);
    return check(info.ok(), info.status().ToString());
  };
  // Eager, one kernel at a time: the sum of the kernels' times, one step
  // (one PrepareStep) per run.
  std::vector<double> kernel_sums, append_sums, read_sums;
  for (int rep = 0; error.empty() && rep < kEagerSteps; ++rep) {
    if (!prepare()) break;
    const absl::Status st = layers(rep % sets, marks.data());
    if (!check(st.ok(), st.ToString()) || !STEP_CUDA(cudaStreamSynchronize(cs))) break;
    double append = 0, read = 0;
    for (int l = 0; l < kLayers; ++l) {
      float a = 0, m = 0;
      STEP_CUDA(cudaEventElapsedTime(&a, marks[2 * l], marks[2 * l + 1]));
      STEP_CUDA(cudaEventElapsedTime(&m, marks[2 * l + 1], marks[2 * l + 2]));
      append += a;
      read += m;
    }
    kernel_sums.push_back((append + read) * 1e3);
    append_sums.push_back(append * 1e3);
    read_sums.push_back(read * 1e3);
  }
  // One graph per input set, each captured once.
  std::vector<cudaGraph_t> graphs(sets, nullptr);
  std::vector<cudaGraphExec_t> execs(sets, nullptr);
  for (int i = 0; i < sets && error.empty(); ++i) {
    if (!STEP_CUDA(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal))) break;
    const absl::Status st = layers(i, nullptr);
    const bool ended = STEP_CUDA(cudaStreamEndCapture(cs, &graphs[i]));
    if (ended && check(st.ok(), st.ToString())) {
      STEP_CUDA(cudaGraphInstantiate(&execs[i], graphs[i], 0));
    }
  }
  // Warm-up: every graph replayed once (one step each).
  for (int i = 0; i < sets && error.empty(); ++i) {
    if (prepare()) STEP_CUDA(cudaGraphLaunch(execs[i], cs));
  }
  if (error.empty()) STEP_CUDA(cudaStreamSynchronize(cs));
  std::vector<double> graph_us, prep_us;
  int step = 0;
  for (auto _ : state) {
    if (!error.empty()) break;
    const auto t0 = std::chrono::steady_clock::now();
    if (!prepare()) break;
    const auto t1 = std::chrono::steady_clock::now();
    // Timed region: one graph replay.
    float ms = 0;
    if (!STEP_CUDA(cudaEventRecord(start, cs)) ||
        !STEP_CUDA(cudaGraphLaunch(execs[step % sets], cs)) ||
        !STEP_CUDA(cudaEventRecord(stop, cs)) || !STEP_CUDA(cudaEventSynchronize(stop)) ||
        !STEP_CUDA(cudaEventElapsedTime(&ms, start, stop))) {
      break;
    }
    ++step;
    state.SetIterationTime(ms / 1e3);
    graph_us.push_back(ms * 1e3);
    prep_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
#undef STEP_CUDA
  if (!error.empty()) state.SkipWithError(error.c_str());
  (void)cudaStreamSynchronize(cs);
  state.counters["graph_us"] = Median(graph_us);
  state.counters["kernels_sum_us"] = Median(kernel_sums);
  // The same eager steps split: every layer's append, and its read (attention or
  // materialize), summed over the layers.
  state.counters["append_sum_us"] = Median(append_sums);
  state.counters["read_sum_us"] = Median(read_sums);
  state.counters["prepare_us"] = Median(prep_us);
  state.counters["layers"] = kLayers;
  state.counters["seqs"] = seqs;
  state.counters["input_sets"] = sets;
  state.counters["input_MB"] = static_cast<double>(sets) * static_cast<double>(set_bytes) / 1e6;
  state.counters["adjacent_pages"] = adjacent;
  state.counters["pool_GB"] = static_cast<double>(c.Stats().pool_bytes) / 1e9;
  for (cudaGraphExec_t e : execs) {
    if (e != nullptr) (void)cudaGraphExecDestroy(e);
  }
  for (cudaGraph_t gr : graphs) {
    if (gr != nullptr) (void)cudaGraphDestroy(gr);
  }
  for (cudaEvent_t e : marks) {
    if (e != nullptr) (void)cudaEventDestroy(e);
  }
  if (start != nullptr) (void)cudaEventDestroy(start);
  if (stop != nullptr) (void)cudaEventDestroy(stop);
  (void)cudaStreamDestroy(cs);
}
BENCHMARK(BM_DecodeStepGraph)
    ->ArgNames({"seqs", "attention", "k8"})
    ->Args({64, 0, 0})
    ->Args({64, 1, 0})
    ->Args({256, 0, 0})
    ->Args({256, 1, 0})
    ->Args({64, 0, 1})
    ->Args({64, 1, 1})
    ->Args({256, 0, 1})
    ->Args({256, 1, 1})
    ->Iterations(200)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

// Busy host work of `us` microseconds (the scheduler of a serving loop).
void BusyHostWork(int us) {
  if (us <= 0) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  volatile uint64_t x = 0;
  while (std::chrono::steady_clock::now() < until) x = x + 1;
}

void BM_OverlapDecodeLoop(benchmark::State& state) {
  const bool cuda = state.range(0) == 1;
  const int seqs = static_cast<int>(state.range(1));
  const int host_us = static_cast<int>(state.range(2));
  const int slots = static_cast<int>(state.range(3));
  if (cuda && !HaveGpu()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const int layers = cuda ? 32 : 2, heads = cuda ? 8 : 2, dim = cuda ? 128 : 64;
  const int qo_heads = 4 * heads;
  const Device dev = cuda ? Device::Cuda(0) : Device::Cpu();
  cudaStream_t cs = nullptr;
  if (cuda && cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) != cudaSuccess) {
    state.SkipWithError("cudaStreamCreate failed");
    return;
  }
  const Stream stream = reinterpret_cast<Stream>(cs);
  CacheGeometry g;
  g.num_kv_heads = heads;
  g.head_dim_k = g.head_dim_v = dim;
  const int warmup = 4;
  const int growth = static_cast<int>(state.max_iterations) + warmup + 4;
  const OptionsTweak tweak = [&](KVCacheOptions& o) {
    o.step_slots = slots;
    o.k_global_scales.assign(layers, 0.05f);
    o.v_global_scales.assign(layers, 0.05f);
  };
  DecodeSetup s = MakeDecodeSetup(g, layers, seqs, growth, std::max(seqs, 64), dev, stream,
                                  nullptr, tweak, cuda ? kMinContext : 16,
                                  cuda ? kMaxContext : 64);
  if (!s.cache.ok()) {
    state.SkipWithError(s.cache.status().ToString().c_str());
    if (cs != nullptr) (void)cudaStreamDestroy(cs);
    return;
  }
  KVCache& c = *s.cache;
  std::string error;
  auto check = [&error](bool ok, const std::string& what) {
    if (!ok && error.empty()) error = what;
    return error.empty();
  };
#define LOOP_CUDA(call) check(!cuda || (call) == cudaSuccess, #call " failed")
  absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
  CacheAttentionOptions ao;
  ao.num_qo_heads = qo_heads;
  absl::StatusOr<CacheAttention> att = c.attention(ao);
  check(app.ok(), app.status().ToString());
  check(att.ok(), att.status().ToString());
  // Inputs: per layer K, V [seqs, H, D] and q [seqs, Hq, D]; one output.
  const int64_t kv_halves = int64_t{seqs} * heads * dim;
  const int64_t q_halves = int64_t{seqs} * qo_heads * dim;
  const int64_t in_halves = layers * (2 * kv_halves + q_halves);
  const int64_t ws_bytes = att.ok() ? att->WorkspaceBytes() : 0;
  DeviceBuffers mem;
  std::vector<uint16_t> host_in, host_out;
  std::vector<uint8_t> host_ws;
  void *d_in = nullptr, *d_out = nullptr, *d_ws = nullptr;
  if (error.empty()) {
    if (cuda) {
      d_in = mem.Alloc(in_halves * 2);
      d_out = mem.Alloc(q_halves * 2);
      d_ws = mem.Alloc(ws_bytes);
      check(d_in != nullptr && d_out != nullptr && d_ws != nullptr, "allocation failed");
      if (error.empty()) check(UploadRandomBf16(d_in, in_halves, 5), "input upload failed");
    } else {
      const std::vector<uint16_t>& pool = RandomBf16Pool();
      host_in.resize(static_cast<size_t>(in_halves));
      for (size_t i = 0; i < host_in.size(); ++i) host_in[i] = pool[i % pool.size()];
      host_out.resize(static_cast<size_t>(q_halves));
      host_ws.resize(static_cast<size_t>(std::max<int64_t>(ws_bytes, 256)));
      d_in = host_in.data();
      d_out = host_out.data();
      d_ws = host_ws.data();
    }
  }
  auto input = [&](int l, int which) {
    uint16_t* base = static_cast<uint16_t*>(d_in) + l * (2 * kv_halves + q_halves);
    if (which < 2) {
      return TensorView::Contiguous(base + which * kv_halves, DType::kBF16, {seqs, heads, dim}, dev);
    }
    return TensorView::Contiguous(base + 2 * kv_halves, DType::kBF16, {seqs, qo_heads, dim}, dev);
  };
  const TensorView out = TensorView::Contiguous(d_out, DType::kBF16, {seqs, qo_heads, dim}, dev);
  // The ops of every layer on step slot `slot`.
  std::vector<CacheAppender> apps;
  std::vector<CacheAttention> atts;
  for (int k = 0; k < slots && error.empty(); ++k) {
    absl::StatusOr<CacheAppender> a = app->ForSlot(k);
    absl::StatusOr<CacheAttention> t = att->ForSlot(k);
    if (check(a.ok(), a.status().ToString()) && check(t.ok(), t.status().ToString())) {
      apps.push_back(*a);
      atts.push_back(*t);
    }
  }
  auto layers_on = [&](int slot) -> absl::Status {
    for (int l = 0; l < layers; ++l) {
      FP4KV_BENCH_RETURN_IF_ERROR(apps[slot].Run(l, input(l, 0), input(l, 1), stream));
      FP4KV_BENCH_RETURN_IF_ERROR(
          atts[slot].Run(l, input(l, 2), out, d_ws, ws_bytes, stream));
    }
    return absl::OkStatus();
  };
  // CUDA: one graph per slot, captured at the slot's first step.
  std::vector<cudaGraphExec_t> execs(slots, nullptr);
  std::vector<cudaEvent_t> start(slots, nullptr), stop(slots, nullptr);
  for (int k = 0; k < slots; ++k) {
    LOOP_CUDA(cudaEventCreate(&start[k]));
    LOOP_CUDA(cudaEventCreate(&stop[k]));
  }
  std::vector<double> device_ms_per_slot(slots, 0.0);
  auto launch = [&](int slot) {
    if (!cuda) {
      const auto t0 = std::chrono::steady_clock::now();
      const absl::Status st = layers_on(slot);
      device_ms_per_slot[slot] =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      return check(st.ok(), st.ToString());
    }
    if (execs[slot] == nullptr) {
      cudaGraph_t graph = nullptr;
      if (!LOOP_CUDA(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal))) return false;
      const absl::Status st = layers_on(slot);
      const bool ended = LOOP_CUDA(cudaStreamEndCapture(cs, &graph));
      if (!ended || !check(st.ok(), st.ToString())) return false;
      LOOP_CUDA(cudaGraphInstantiate(&execs[slot], graph, 0));
      (void)cudaGraphDestroy(graph);
      if (!error.empty()) return false;
    }
    return LOOP_CUDA(cudaEventRecord(start[slot], cs)) &&
           LOOP_CUDA(cudaGraphLaunch(execs[slot], cs)) && LOOP_CUDA(cudaEventRecord(stop[slot], cs));
  };
  // Waits for the step last launched on `slot` and returns its device time.
  auto finish = [&](int slot) -> double {
    if (!cuda) return device_ms_per_slot[slot];
    float ms = 0;
    if (!LOOP_CUDA(cudaEventSynchronize(stop[slot])) ||
        !LOOP_CUDA(cudaEventElapsedTime(&ms, start[slot], stop[slot]))) {
      return 0;
    }
    return ms;
  };
  std::vector<double> step_us, device_us, prep_us;
  int in_flight = -1;  // the slot of the step still running (two slots)
  auto one_step = [&](bool timed) {
    const auto t0 = std::chrono::steady_clock::now();
    BusyHostWork(host_us);
    const auto p0 = std::chrono::steady_clock::now();
    absl::StatusOr<StepInfo> info = c.PrepareStep(s.entries, stream);
    const auto p1 = std::chrono::steady_clock::now();
    if (!check(info.ok(), info.status().ToString())) return;
    if (!launch(info->slot)) return;
    double dev_ms = -1;
    if (slots == 1) {
      dev_ms = finish(info->slot);  // the serial loop waits for its step
    } else {
      if (in_flight >= 0) dev_ms = finish(in_flight);  // at most two steps in flight
      in_flight = info->slot;
    }
    const auto t1 = std::chrono::steady_clock::now();
    if (!timed) return;
    step_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    prep_us.push_back(std::chrono::duration<double, std::micro>(p1 - p0).count());
    if (dev_ms >= 0) device_us.push_back(1e3 * dev_ms);
  };
  for (int i = 0; i < warmup && error.empty(); ++i) one_step(false);
  for (auto _ : state) {
    if (!error.empty()) break;
    one_step(true);
  }
  if (in_flight >= 0) (void)finish(in_flight);
#undef LOOP_CUDA
  if (!error.empty()) state.SkipWithError(error.c_str());
  if (cuda) (void)cudaStreamSynchronize(cs);
  auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
  };
  const double step = mean(step_us), device = mean(device_us), prep = Median(prep_us);
  const double hidden = host_us + prep + device - step;
  state.counters["step_us"] = step;
  state.counters["device_us"] = device;
  state.counters["prepare_us"] = prep;
  state.counters["host_us"] = host_us;
  state.counters["slots"] = slots;
  state.counters["seqs"] = seqs;
  if (host_us > 0) {
    state.counters["hidden_frac"] = std::min(1.0, std::max(0.0, hidden / host_us));
  } else {
    state.counters["hidden_us"] = hidden;
  }
  for (cudaGraphExec_t e : execs) {
    if (e != nullptr) (void)cudaGraphExecDestroy(e);
  }
  for (int k = 0; k < slots; ++k) {
    if (start[k] != nullptr) (void)cudaEventDestroy(start[k]);
    if (stop[k] != nullptr) (void)cudaEventDestroy(stop[k]);
  }
  if (cs != nullptr) (void)cudaStreamDestroy(cs);
}
void OverlapArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"cuda", "seqs", "host_us", "slots"});
  for (int cuda : {0, 1}) {
    for (int seqs : {64, 256}) {
      for (int host : {0, 50, 200, 1000}) {
        for (int slots : {1, 2}) b->Args({cuda, seqs, host, slots});
      }
    }
  }
}
BENCHMARK(BM_OverlapDecodeLoop)
    ->Apply(OverlapArgs)
    ->Iterations(100)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace fp4kv

BENCHMARK_MAIN();
