// KVCache benchmarks.
//
//   BM_PrepareStepDecode/<cpu|cuda>/<order>: host time of PrepareStep for 256
//     decode sequences (1 new token each, contexts 2k-8k tokens, page size
//     16). order 0: the same order every step (the usual decode loop);
//     order 1: shuffled every step (every block-table row rewritten).
//     Counters: median_us / p99_us of the individual calls.
//   BM_PageAllocator/<n>: allocate n pages then free them (the page pool,
//     no prefix index); pages/s.
//   BM_CacheAllocateRelease/<n>: the same through the cache: a sequence, a
//     step reserving n pages, ReleaseSequence; pages/s.
//   BM_DecodeStepGraph/<seqs>/<attention>/<k8>: CUDA only. A model-shaped cache
//     (32 layers, 8 KV heads, head_dim 128, page 16); the decode step of
//     every layer captured once as a CUDA graph: append + materialize
//     (attention 0: what an FP8 attention kernel would then read) or append +
//     decode attention straight from the NVFP4 pages (attention 1; 32 query
//     heads, bf16). Reports the replay's device time (median of CUDA events)
//     next to the sum of the same kernels' times measured one by one, and the
//     PrepareStep host time. k8 1: the cache keeps FP8 keys (K8V4, NVFP4
//     values); skipped with the status when the attention op refuses them.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench/host_stats.h"
#include "benchmark/benchmark.h"
#include "fp4kv/kv_cache.h"
#include "src/page_pool.h"

namespace fp4kv {
namespace {

constexpr int kDecodeSeqs = 256;
constexpr int kPageSize = 16;
constexpr int kMinContext = 2048;
constexpr int kMaxContext = 8192;
// Step capacity in tokens: a decode step's K/V input buffer (the captured
// appender covers all of it; padding rows are skipped).
constexpr int kStepTokens = 512;

bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

using bench::Median;
using bench::Percentile;

// A cache whose `seqs` sequences hold random contexts in [kMinContext,
// kMaxContext] (prefilled in chunks through PrepareStep only: the pool bytes
// do not matter for the timings), with room for `growth` more tokens each.
struct DecodeSetup {
  absl::StatusOr<KVCache> cache = absl::UnknownError("unset");
  std::vector<StepEntry> entries;
};

DecodeSetup MakeDecodeSetup(const CacheGeometry& shape, int layers, int seqs, int growth,
                            Device device, Stream stream) {
  DecodeSetup s;
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> ctx(kMinContext, kMaxContext);
  std::vector<int> contexts(seqs);
  int64_t pages = 0;
  for (int& c : contexts) {
    c = ctx(rng);
    pages += (c + growth + kPageSize - 1) / kPageSize;
  }
  KVCacheOptions o;
  o.num_layers = layers;
  o.geometry = shape;
  o.geometry.page_size = kPageSize;
  o.geometry.num_pages = pages;
  o.max_pages_per_seq = (kMaxContext + growth + kPageSize - 1) / kPageSize;
  o.device = device;
  o.max_seqs_per_step = seqs;
  o.max_tokens_per_step = kStepTokens;
  s.cache = KVCache::Create(o);
  if (!s.cache.ok()) return s;
  for (int i = 0; i < seqs; ++i) {
    const SequenceId id = s.cache->CreateSequence().value();
    for (int done = 0; done < contexts[i]; done += kStepTokens) {  // chunked prefill
      const StepEntry prefill{id, std::min(kStepTokens, contexts[i] - done)};
      absl::StatusOr<StepInfo> info = s.cache->PrepareStep({&prefill, 1}, stream);
      if (!info.ok()) {
        s.cache = info.status();
        return s;
      }
    }
    s.entries.push_back({id, 1});
  }
  return s;
}

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
  DecodeSetup s =
      MakeDecodeSetup(g, 1, kDecodeSeqs, growth, cuda ? Device::Cuda(0) : Device::Cpu(), stream);
  if (!s.cache.ok()) {
    state.SkipWithError(s.cache.status().ToString().c_str());
    return;
  }
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
  internal::PagePool a(1 << 20);
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
    const SequenceId id = c->CreateSequence().value();
    const StepEntry e{id, pages * kPageSize};
    absl::StatusOr<StepInfo> info = c->PrepareStep({&e, 1});
    if (!info.ok() || !c->ReleaseSequence(id).ok()) {
      state.SkipWithError("step failed");
      break;
    }
  }
  state.counters["Mpages_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * pages / 1e6, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CacheAllocateRelease)->Arg(1)->Arg(16)->Arg(256);

// ----------------------------------------------------------------- GPU step
void BM_DecodeStepGraph(benchmark::State& state) {
  if (!HaveGpu()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  const int seqs = static_cast<int>(state.range(0));
  const bool attend = state.range(1) != 0;
  const bool fp8_keys = state.range(2) != 0;
  constexpr int kLayers = 32, kHeads = 8, kDim = 128, kQoHeads = 32;
  cudaStream_t cs;
  if (cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) != cudaSuccess) {
    state.SkipWithError("cudaStreamCreate failed");
    return;
  }
  const Stream stream = reinterpret_cast<Stream>(cs);
  CacheGeometry g;
  g.num_kv_heads = kHeads;
  g.head_dim_k = g.head_dim_v = kDim;
  g.key_format = fp8_keys ? KeyFormat::kFp8 : KeyFormat::kNvfp4;
  const int max_steps = 64 + static_cast<int>(state.max_iterations);
  DecodeSetup s = MakeDecodeSetup(g, kLayers, seqs, max_steps, Device::Cuda(0), stream);
  if (!s.cache.ok()) {
    state.SkipWithError(s.cache.status().ToString().c_str());
    return;
  }
  KVCache& c = *s.cache;
  absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
  absl::StatusOr<CacheMaterializer> mat = c.materializer();
  CacheAttentionOptions ao;
  ao.num_qo_heads = kQoHeads;
  absl::StatusOr<CacheAttention> att = c.attention(ao);
  if (!app.ok() || !mat.ok() || (attend && !att.ok())) {
    state.SkipWithError(
        (attend && !att.ok() ? att.status().ToString() : std::string("op objects")).c_str());
    (void)cudaStreamDestroy(cs);
    return;
  }
  const int64_t T = c.options().max_tokens_per_step;
  const int64_t W = c.Fp8WorkspacePagesAtCapacity();
  const int64_t ws_page = 2LL * kHeads * kPageSize * kDim;
  void *d_k = nullptr, *d_v = nullptr, *d_ws = nullptr, *d_q = nullptr, *d_out = nullptr;
  const int64_t q_bytes = int64_t{seqs} * kQoHeads * kDim * 2;
  const int64_t attn_ws_bytes = att.ok() ? att->WorkspaceBytes() : 0;
  bool ok = cudaMalloc(&d_k, T * kHeads * kDim * 2) == cudaSuccess &&
            cudaMalloc(&d_v, T * kHeads * kDim * 2) == cudaSuccess &&
            cudaMalloc(&d_ws, attend ? std::max<int64_t>(256, attn_ws_bytes) : W * ws_page) ==
                cudaSuccess &&
            cudaMalloc(&d_q, q_bytes) == cudaSuccess &&
            cudaMalloc(&d_out, q_bytes) == cudaSuccess &&
            cudaMemset(d_q, 0x3c, q_bytes) == cudaSuccess &&
            cudaMemset(d_k, 0x3c, T * kHeads * kDim * 2) == cudaSuccess &&
            cudaMemset(d_v, 0xbc, T * kHeads * kDim * 2) == cudaSuccess &&
            cudaDeviceSynchronize() == cudaSuccess;  // legacy-stream memsets before `cs` work
  const Device dev = Device::Cuda(0);
  const TensorView k = TensorView::Contiguous(d_k, DType::kBF16, {T, kHeads, kDim}, dev);
  const TensorView v = TensorView::Contiguous(d_v, DType::kBF16, {T, kHeads, kDim}, dev);
  const TensorView ws =
      TensorView::Contiguous(d_ws, DType::kE4M3, {W, 2, kHeads, kPageSize, kDim}, dev);
  const TensorView q = TensorView::Contiguous(d_q, DType::kBF16, {seqs, kQoHeads, kDim}, dev);
  const TensorView out = TensorView::Contiguous(d_out, DType::kBF16, {seqs, kQoHeads, kDim}, dev);
  auto layers = [&](cudaEvent_t* marks) -> absl::Status {
    for (int l = 0; l < kLayers; ++l) {
      if (marks) (void)cudaEventRecord(marks[2 * l], cs);
      absl::Status st = app->Run(l, k, v, stream);
      if (marks) (void)cudaEventRecord(marks[2 * l + 1], cs);
      if (st.ok()) {
        st = attend ? att->Run(l, q, out, d_ws, attn_ws_bytes, stream) : mat->Run(l, ws, stream);
      }
      if (!st.ok()) return st;
    }
    if (marks) (void)cudaEventRecord(marks[2 * kLayers], cs);
    return absl::OkStatus();
  };
  std::vector<cudaEvent_t> marks(2 * kLayers + 1, nullptr);
  for (cudaEvent_t& e : marks) ok = ok && cudaEventCreate(&e) == cudaSuccess;
  cudaEvent_t start = nullptr, stop = nullptr;
  ok = ok && cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess;
  absl::StatusOr<StepInfo> info = c.PrepareStep(s.entries, stream);
  ok = ok && info.ok();
  // Eager, one kernel at a time: the sum of the kernels' times.
  std::vector<double> kernel_sums;
  for (int rep = 0; ok && rep < 10; ++rep) {
    ok = layers(marks.data()).ok() && cudaStreamSynchronize(cs) == cudaSuccess;
    double sum = 0;
    for (int l = 0; ok && l < kLayers; ++l) {
      float a = 0, m = 0;
      ok = cudaEventElapsedTime(&a, marks[2 * l], marks[2 * l + 1]) == cudaSuccess &&
           cudaEventElapsedTime(&m, marks[2 * l + 1],
                                l + 1 < kLayers ? marks[2 * l + 2] : marks[2 * kLayers]) ==
               cudaSuccess;
      sum += a + m;
    }
    kernel_sums.push_back(sum * 1e3);
  }
  // Capture once.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (ok) {
    ok = cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    const absl::Status st = layers(nullptr);
    ok = cudaStreamEndCapture(cs, &graph) == cudaSuccess && ok && st.ok() &&
         cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  }
  if (!ok) {
    state.SkipWithError("CUDA setup, eager run or capture failed (kernels not built?)");
  }
  std::vector<double> graph_us, prep_us;
  for (auto _ : state) {
    if (!ok) break;
    const auto t0 = std::chrono::steady_clock::now();
    info = c.PrepareStep(s.entries, stream);
    const auto t1 = std::chrono::steady_clock::now();
    if (!info.ok()) {
      state.SkipWithError(info.status().ToString().c_str());
      break;
    }
    (void)cudaEventRecord(start, cs);
    (void)cudaGraphLaunch(exec, cs);
    (void)cudaEventRecord(stop, cs);
    (void)cudaEventSynchronize(stop);
    float ms = 0;
    (void)cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms / 1e3);
    graph_us.push_back(ms * 1e3);
    prep_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  state.counters["graph_us"] = Median(graph_us);
  state.counters["kernels_sum_us"] = Median(kernel_sums);
  state.counters["prepare_us"] = Median(prep_us);
  state.counters["layers"] = kLayers;
  state.counters["seqs"] = seqs;
  if (exec) (void)cudaGraphExecDestroy(exec);
  if (graph) (void)cudaGraphDestroy(graph);
  for (cudaEvent_t e : marks) (void)cudaEventDestroy(e);
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  (void)cudaFree(d_k);
  (void)cudaFree(d_v);
  (void)cudaFree(d_ws);
  (void)cudaFree(d_q);
  (void)cudaFree(d_out);
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

}  // namespace
}  // namespace fp4kv

BENCHMARK_MAIN();
