// The C++ side of the Python binding's overhead (python/bench/overhead.py
// runs the same calls from Python; docs/python.md).
//
//   BM_CppAppenderRun: CacheAppender::Run of one step of 1 new token.
//   BM_CppAttentionRun: CacheAttention::Run of that step: 1 query row, 4 qo
//     heads over 2 KV heads, head_dim 64, a context of 16 tokens.
// CPU device, f16, given global scales (no calibration path), one layer,
// page size 16: the op itself takes about a microsecond, so the difference
// from the Python timings is the cost of the binding (argument parsing,
// DLPack import of each tensor, the exception check, the GIL release).
// Eager calls, median of the repetitions.
//
//   BM_CppAttentionRunCuda/<q_len>/<k8>: host time of one bound
//     CacheAttention::Run on a CUDA cache (bf16, 32 qo / 8 KV heads, head_dim
//     128, page size 16, 8 sequences of 512 tokens prefilled in steps of up to
//     max_tokens_per_step; q_len 1: decode rows, 64: the prefill path; k8 1:
//     FP8 keys, whose decode kernel on an sm_90a build copies with TMA, so its
//     tensor maps are part of the cost): the checks, the parameter fill and
//     the kernel launches it enqueues (two for decode, three with the prefill
//     kernel). The stream is synchronized every 64 calls outside the timing,
//     so the launch queue never fills.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "benchmark/benchmark.h"
#include "fp4kv/kv_cache.h"

namespace {

constexpr int kHeads = 2, kQoHeads = 4, kDim = 64, kContext = 16;

struct Setup {
  fp4kv::KVCache cache;
  fp4kv::CacheAppender append;
  fp4kv::CacheAttention attend;
};

Setup Make() {
  fp4kv::KVCacheOptions o;
  o.num_layers = 1;
  o.geometry.num_kv_heads = kHeads;
  o.geometry.head_dim_k = o.geometry.head_dim_v = kDim;
  o.geometry.page_size = 16;
  o.geometry.num_pages = 64;
  o.k_global_scales = {0.01f};
  o.v_global_scales = {0.01f};
  o.max_seqs_per_step = 8;
  o.max_tokens_per_step = 64;
  fp4kv::KVCache cache = *fp4kv::KVCache::Create(o);
  const fp4kv::SequenceId seq = *cache.CreateSequence();
  (void)*cache.PrepareStep({{seq, kContext - 1}});
  (void)*cache.PrepareStep({{seq, 1}});
  fp4kv::CacheAppender append = *cache.appender(fp4kv::DType::kF16);
  fp4kv::CacheAttentionOptions a;
  a.num_qo_heads = kQoHeads;
  a.dtype = fp4kv::DType::kF16;
  fp4kv::CacheAttention attend = *cache.attention(a);
  return Setup{std::move(cache), append, attend};
}

// f16 rows of small values (0x2e66 ~ 0.1).
std::vector<uint16_t> Rows(int64_t n) { return std::vector<uint16_t>(n, 0x2e66); }

void BM_CppAppenderRun(benchmark::State& state) {
  Setup s = Make();
  std::vector<uint16_t> k = Rows(kHeads * kDim), v = Rows(kHeads * kDim);
  const fp4kv::TensorView kv =
      fp4kv::TensorView::Contiguous(k.data(), fp4kv::DType::kF16, {1, kHeads, kDim});
  const fp4kv::TensorView vv =
      fp4kv::TensorView::Contiguous(v.data(), fp4kv::DType::kF16, {1, kHeads, kDim});
  for (auto _ : state) {
    absl::Status st = s.append.Run(0, kv, vv);
    if (!st.ok()) state.SkipWithError(st.ToString().c_str());
    benchmark::DoNotOptimize(st);
  }
}
BENCHMARK(BM_CppAppenderRun)->Repetitions(15)->ReportAggregatesOnly(true);

void BM_CppAttentionRun(benchmark::State& state) {
  Setup s = Make();
  std::vector<uint16_t> q = Rows(8 * kQoHeads * kDim), out(8 * kQoHeads * kDim);
  const fp4kv::TensorView qv =
      fp4kv::TensorView::Contiguous(q.data(), fp4kv::DType::kF16, {8, kQoHeads, kDim});
  const fp4kv::TensorView ov =
      fp4kv::TensorView::Contiguous(out.data(), fp4kv::DType::kF16, {8, kQoHeads, kDim});
  for (auto _ : state) {
    absl::Status st = s.attend.Run(0, qv, ov, nullptr, 0);
    if (!st.ok()) state.SkipWithError(st.ToString().c_str());
    benchmark::DoNotOptimize(st);
  }
}
BENCHMARK(BM_CppAttentionRun)->Repetitions(15)->ReportAggregatesOnly(true);

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

void BM_CppAttentionRunCuda(benchmark::State& state) {
  if (!HaveGpu()) {
    state.SkipWithError("no CUDA GPU");
    return;
  }
  constexpr int kSeqs = 8, kLen = 512, kQo = 32, kKv = 8, kD = 128;
  const int q_len = static_cast<int>(state.range(0));
  const bool k8 = state.range(1) != 0;
  fp4kv::KVCacheOptions o;
  o.num_layers = 2;
  if (k8) o.geometry.key_format = fp4kv::KeyFormat::kFp8;
  o.geometry.num_kv_heads = kKv;
  o.geometry.head_dim_k = o.geometry.head_dim_v = kD;
  o.geometry.page_size = 16;
  o.geometry.num_pages = 1024;
  o.k_global_scales = {0.01f, 0.01f};
  o.v_global_scales = {0.01f, 0.01f};
  o.max_seqs_per_step = kSeqs;
  o.max_tokens_per_step = kSeqs * 64;
  o.device = fp4kv::Device::Cuda(0);
  absl::StatusOr<fp4kv::KVCache> cache = fp4kv::KVCache::Create(o);
  if (!cache.ok()) {
    state.SkipWithError(cache.status().ToString().c_str());
    return;
  }
  // Prefill in steps of 64 tokens a sequence (max_tokens_per_step in all),
  // then the measured step of q_len tokens a sequence.
  std::vector<fp4kv::StepEntry> entries;
  for (int i = 0; i < kSeqs; ++i) entries.push_back({*cache->CreateSequence(), 0});
  for (int done = 0; done <= kLen - q_len;) {
    const int n = done == kLen - q_len ? q_len : std::min(64, kLen - q_len - done);
    for (fp4kv::StepEntry& e : entries) e.num_new_tokens = n;
    const absl::StatusOr<fp4kv::StepInfo> step = cache->PrepareStep(entries);
    if (!step.ok()) {
      state.SkipWithError(step.status().ToString().c_str());
      return;
    }
    if (done == kLen - q_len) break;
    done += n;
  }
  fp4kv::CacheAttentionOptions a;
  a.num_qo_heads = kQo;
  a.dtype = fp4kv::DType::kBF16;
  a.max_q_len = q_len;
  absl::StatusOr<fp4kv::CacheAttention> attend = cache->attention(a);
  if (!attend.ok()) {
    state.SkipWithError(attend.status().ToString().c_str());
    return;
  }
  const int64_t rows = int64_t{kSeqs} * q_len;
  void *q = nullptr, *out = nullptr, *ws = nullptr;
  const int64_t ws_bytes = attend->WorkspaceBytes();
  if (cudaMalloc(&q, rows * kQo * kD * 2) != cudaSuccess ||
      cudaMalloc(&out, rows * kQo * kD * 2) != cudaSuccess ||
      cudaMalloc(&ws, ws_bytes > 0 ? ws_bytes : 256) != cudaSuccess ||
      cudaMemset(q, 0, rows * kQo * kD * 2) != cudaSuccess) {
    state.SkipWithError("cudaMalloc failed");
    return;
  }
  const fp4kv::Device dev = fp4kv::Device::Cuda(0);
  const fp4kv::TensorView qv =
      fp4kv::TensorView::Contiguous(q, fp4kv::DType::kBF16, {rows, kQo, kD}, dev);
  const fp4kv::TensorView ov =
      fp4kv::TensorView::Contiguous(out, fp4kv::DType::kBF16, {rows, kQo, kD}, dev);
  cudaStream_t stream = nullptr;
  (void)cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  int64_t calls = 0;
  for (auto _ : state) {
    absl::Status st = attend->Run(static_cast<int>(calls & 1), qv, ov, ws, ws_bytes, stream);
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      break;
    }
    if (++calls % 64 == 0) {
      state.PauseTiming();
      (void)cudaStreamSynchronize(stream);
      state.ResumeTiming();
    }
  }
  (void)cudaStreamSynchronize(stream);
  (void)cudaStreamDestroy(stream);
  (void)cudaFree(q);
  (void)cudaFree(out);
  (void)cudaFree(ws);
}
BENCHMARK(BM_CppAttentionRunCuda)
    ->ArgNames({"q_len", "k8"})
    ->Args({1, 0})
    ->Args({64, 0})
    ->Args({1, 1})
    ->Repetitions(15)
    ->ReportAggregatesOnly(true)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
