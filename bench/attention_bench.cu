// Decode attention straight from NVFP4 pages on the GPU (keys NVFP4 or FP8
// E4M3, "K8V4"; values NVFP4), against a
// device-to-device copy measured in the same process (bench/kernels_bench.cu
// conventions: CUDA events on a dedicated stream, a few warm-up runs, the
// median of kTimedRuns timed runs).
//
// Shapes: 8 KV heads, 32 qo heads (group 4; group 8: 64) and head_dim 128
// unless the case's args say otherwise, page size 16,
// bf16 q/out, NHD tuple pools whose every slot holds random bf16 rows
// appended through the Appender (bench::AppendRandomRows; FP8 keys too),
// every request's pages a random permutation of the pool, q random. When one
// case's cache is smaller than 256 MB, several disjoint page sets (one block
// table each) are rotated through the timed runs so L2 (60 MB on H200) never
// holds a case. Timed region: one Run() (attention + merge kernels), CUDA
// events around it.
// Counters per case:
//   bytes          K + V codes and scales of the attended tokens (NVFP4 keys:
//                  Dk/2 + Dk/16 bytes per token and head, FP8 keys: Dk; values
//                  Dv/2 + Dv/16), plus q and out (the traffic a perfect kernel
//                  needs)
//   GBps           bytes / median time
//   pct_of_copy    GBps as a percentage of the copy's GBps
//   median_us      the median time of one Run() (attention + merge kernels)
//   partial_bytes  split-KV partials written and read back (not in bytes),
//                  from the same schedule the kernel derives on the device
// Arg family (FP4KV_ATTENTION_KERNEL set around Create()): 0 the default
// choice, 1 rows in M forced, 2 tokens in M with cp.async copies forced, 3
// tokens in M with TMA copies forced (sm_90a builds on an H200). The label
// of every case names the family Create() chose (DecodeAttention::
// decode_family, prefill_family).
//
// BM_PrefillAttention: prefill and extend chunks (more than kDecodeRowsQLen
// new tokens a request, causal), alone and mixed with decode rows in one
// Run(), same cache set-up and timing; 32 qo / 8 KV heads, head_dim 128.
// Besides the counters above:
//   flops             4 * head_dim per (query, qo head, attended key): only
//                     the keys the causal mask leaves (p + 1 for the query
//                     at position p)
//   TFLOPs            flops / median time
//   fraction_of_gemm  TFLOPs against BM_DenseGemmBf16's, measured once in
//                     the same process (0 when cuBLAS is not found)
//   materialize_us    the median time to materialize the same sequences'
//                     pages as FP8 E4M3 pages (Materializer::Run, what an FP8
//                     attention kernel of the server would read instead)
// BM_DenseGemmBf16: a dense 8192^3 bf16 GEMM (fp32 accumulation, bf16 out)
// through cuBLAS, loaded at run time (dlopen: no link dependency;
// FP4KV_CUBLAS_LIBRARY names the library, else libcublas.so.13 or
// libcublas.so on the loader's path); skipped when it is not found.
#include <cublas_api.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "bench/bench_util.cuh"
#include "fp4kv/attention.h"
#include "fp4kv/format.h"
#include "fp4kv/geometry.h"
#include "fp4kv/ops.h"
#include "fp4kv/tensor.h"
#include "kernels/attention.cuh"

namespace fp4kv {
namespace {

constexpr int kTimedRuns = 51;

using bench::CopyGBps;
using bench::DeviceCache;
using bench::DeviceMem;
using bench::FillBytes;
using bench::FillHalves;
using bench::HaveGpu;
using bench::MedianMs;
using bench::Report;

// ------------------------------------------------------------------ copy
void BM_DeviceCopy(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const double gbps = CopyGBps();
  BENCH_CHECK(state, gbps > 0, "copy could not be measured");
  const double bytes = 2.0 * (size_t{2} << 30);
  for (auto _ : state) Report(state, bytes / (gbps * 1e9) * 1e3, bytes);
}
BENCHMARK(BM_DeviceCopy)->UseManualTime()->Iterations(1)->Unit(benchmark::kMicrosecond);


// Partial bytes (written + read) of the split-KV schedule the kernel derives
// for equal lengths: mirrors kernels/attention.cuh (target chunk count
// max(0.8 ctas + 1, ctas - groups), at least 64 tokens a chunk, chunks
// rounded to 16); `ctas_per_sm` of the kernel that runs.
double PartialBytes(int num_sms, int ctas_per_sm, int batch, int len, int kv_heads, int rows,
                    int d) {
  const int64_t ctas = static_cast<int64_t>(num_sms) * ctas_per_sm;
  const int mtiles = (rows + 15) / 16;
  const int64_t total = static_cast<int64_t>(batch) * len * kv_heads * mtiles;
  const int64_t groups = static_cast<int64_t>(batch) * kv_heads * mtiles;
  const int64_t target = std::max<int64_t>(ctas * 4 / 5 + 1, ctas - groups);
  int64_t c = std::max<int64_t>(64, (total + target - 1) / target);
  const int64_t s0 = (len + c - 1) / c;
  int64_t ch = (len + s0 - 1) / s0;
  ch = (ch + 15) / 16 * 16;
  const int64_t splits = (len + ch - 1) / ch;
  if (splits <= 1) return 0.0;
  const int64_t slot_rows = std::min(16, rows);
  return 2.0 * batch * kv_heads * mtiles * splits * slot_rows * (d + 2) * 4.0;
}

// CTAs per SM of the kernel Create() picks for these args (mirrors
// kernels/attention/launch.cuh).
int CtasPerSm(bool rows_in_m, int dim, bool fp8_keys, int rows) {
  const int base = dim == 256 ? 2 : 4;
  if (rows_in_m || !kernels::TokensInMTakes(dim, rows)) return base;
  (void)fp8_keys;
  return rows > 8 && dim == 128 ? 3 : base;
}

// args: batch, seq_len, q_len, fp8_keys (0: NVFP4 keys, 1: FP8 E4M3 keys),
// group (qo heads per KV head), head_dim, family (0: Create()'s choice; 1:
// rows in M forced; 2: tokens in M with cp.async copies forced, the sm_80
// kernel and the choice for NVFP4 keys; 3: tokens in M with TMA copies
// forced, the choice for FP8 keys at head dim 128 on an H200).
void BM_DecodeAttention(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const int batch = static_cast<int>(state.range(0));
  const int len = static_cast<int>(state.range(1));
  const int q_len = static_cast<int>(state.range(2));
  const bool fp8_keys = state.range(3) != 0;
  const int group = static_cast<int>(state.range(4));
  const int dim = static_cast<int>(state.range(5));
  const int family = static_cast<int>(state.range(6));
  const bool rows_in_m = family == 1;
  constexpr int kKvHeads = 8, kPage = 16;
  const int qo_heads = kKvHeads * group;
  const int pages_per_seq = (len + kPage - 1) / kPage;
  const int64_t pages_needed = static_cast<int64_t>(batch) * pages_per_seq;
  CacheGeometry g;
  g.num_kv_heads = kKvHeads;
  g.head_dim_k = g.head_dim_v = dim;
  g.page_size = kPage;
  g.layout = Layout::kNHD;
  g.key_format = fp8_keys ? KeyFormat::kFp8 : KeyFormat::kNvfp4;
  const double bytes_per_page = static_cast<double>(g.PageBytes());
  const int rotations = static_cast<int>(
      std::max(1.0, std::ceil(256e6 / (bytes_per_page * static_cast<double>(pages_needed)))));
  g.num_pages = pages_needed * rotations;
  // NVFP4 pools (their V halves serve the FP8-key cache too) and, for FP8
  // keys, K rows of Dk E4M3 codes (finite: bytes 1 .. 0x7e).
  CacheGeometry g4 = g;
  g4.key_format = KeyFormat::kNvfp4;
  DeviceCache cache;
  BENCH_CHECK(state, cache.Init(g4, 7), "cache allocation");
  DeviceMem k8;
  if (fp8_keys) {
    BENCH_CHECK(state,
                k8.Alloc(static_cast<size_t>(g.num_pages) * kPage * kKvHeads * dim) &&
                    FillBytes(k8, 17, true),
                "FP8 key allocation");
  }

  const int64_t total_q = static_cast<int64_t>(batch) * q_len;
  DeviceMem q, out, tables, lens, indptr, ws;
  BENCH_CHECK(state, q.Alloc(total_q * qo_heads * dim * 2) && FillHalves(q, 11, true),
              "q allocation");
  BENCH_CHECK(state, out.Alloc(total_q * qo_heads * dim * 2), "out allocation");
  std::vector<int32_t> perm(g.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(3);
  std::shuffle(perm.begin(), perm.end(), rng);
  BENCH_CHECK(state, tables.Alloc(perm.size() * sizeof(int32_t)) && tables.Upload(perm),
              "tables");
  const std::vector<int32_t> seq(batch, len);
  BENCH_CHECK(state, lens.Alloc(seq.size() * 4) && lens.Upload(seq), "seq_lens");
  std::vector<int32_t> ip(batch + 1);
  for (int b = 0; b <= batch; ++b) ip[b] = b * q_len;
  BENCH_CHECK(state, indptr.Alloc(ip.size() * 4) && indptr.Upload(ip), "q_indptr");

  const Device d = Device::Cuda(0);
  DecodeAttention::Options o;
  o.geometry = g;
  o.num_qo_heads = qo_heads;
  o.dtype = DType::kBF16;
  o.table_dtype = DType::kI32;
  o.max_batch = batch;
  o.max_pages_per_seq = pages_per_seq;
  o.max_q_len = q_len;
  o.device = d;
  if (family != 0) {
    setenv("FP4KV_ATTENTION_KERNEL",
           family == 1 ? "rows_in_m" : (family == 2 ? "tokens_in_m" : "tokens_in_m_tma"), 1);
  } else {
    unsetenv("FP4KV_ATTENTION_KERNEL");
  }
  auto op = DecodeAttention::Create(o);
  unsetenv("FP4KV_ATTENTION_KERNEL");
  BENCH_CHECK(state, op.ok(), "DecodeAttention::Create");
  // The family that ran, in the JSON beside the numbers.
  state.SetLabel(std::string("decode ") + op->decode_family());
  BENCH_CHECK(state, ws.Alloc(static_cast<size_t>(std::max<int64_t>(op->WorkspaceBytes(), 256))),
              "workspace");
  DecodeAttentionArgs a;
  a.q = TensorView::Contiguous(q.get(), DType::kBF16, {total_q, qo_heads, dim}, d);
  if (q_len > 1) a.q_indptr = TensorView::Contiguous(indptr.get(), DType::kI32, {batch + 1}, d);
  a.seq_lens = TensorView::Contiguous(lens.get(), DType::kI32, {batch}, d);
  a.out = TensorView::Contiguous(out.get(), DType::kBF16, {total_q, qo_heads, dim}, d);
  a.k_scale = GlobalScale::Value(0.01f);
  a.v_scale = GlobalScale::Value(0.01f);
  PagedCache view = cache.View();
  if (fp8_keys) {
    view = PagedCache::Fp8Keys(
        TensorView::Contiguous(k8.get(), DType::kU8, {g.num_pages, kPage, kKvHeads, dim}, d),
        view.v_data, view.v_scales, Layout::kNHD);
    // FP8 key rows (and the values again) written through the Appender.
    const PagedCache append_view = PagedCache::Fp8Keys(
        TensorView::Contiguous(k8.get(), DType::kE4M3, {g.num_pages, kPage, kKvHeads, dim}, d),
        view.v_data, view.v_scales, Layout::kNHD);
    BENCH_CHECK(state, bench::AppendRandomRows(g, append_view, 19), "FP8 key append");
  }
  cudaStream_t s;
  BENCH_CUDA(state, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int rot = 0;
  auto run = [&] {
    a.block_tables =
        TensorView::Contiguous(tables.get<int32_t>() + static_cast<int64_t>(rot) * pages_needed,
                               DType::kI32, {batch, pages_per_seq}, d);
    rot = (rot + 1) % rotations;
    return op->Run(a, view, ws.get(), op->WorkspaceBytes(), s);
  };
  {
    const absl::Status st = run();
    BENCH_CHECK(state, st.ok(), "DecodeAttention::Run");
  }
  int num_sms = 0;
  BENCH_CUDA(state, cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  const double kv_bytes = static_cast<double>(batch) * len * kKvHeads * (bytes_per_page / kPage /
                                                                         kKvHeads);
  const double bytes = kv_bytes + 2.0 * total_q * qo_heads * dim * 2;
  for (auto _ : state) Report(state, MedianMs(s, [&] { (void)run(); }, kTimedRuns), bytes);
  const int rows = std::min(16, group * q_len);
  state.counters["partial_bytes"] =
      PartialBytes(num_sms, CtasPerSm(rows_in_m, dim, fp8_keys, rows), batch, len, kKvHeads,
                   group * q_len, dim);
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  BENCH_CUDA(state, cudaGetLastError());
  (void)cudaStreamDestroy(s);
}
// The issue's table for the default choice and each kernel forced (tokens
// in M with TMA copies, with cp.async copies, rows in M) and both key
// formats, then group 8 and head_dim 64 at 64 x 4096.
void DecodeAttentionCases(benchmark::internal::Benchmark* b) {
  for (int family : {0, 3, 2, 1}) {
    for (int fp8 = 0; fp8 < 2; ++fp8) {
      for (const auto& s : {std::pair<int, int>{64, 4096}, {256, 2048}, {8, 16384}, {128, 512},
                            {1, 32768}}) {
        b->Args({s.first, s.second, 1, fp8, 4, 128, family});
      }
      b->Args({64, 4096, 4, fp8, 4, 128, family});
      b->Args({64, 4096, 1, fp8, 8, 128, family});
      b->Args({64, 4096, 1, fp8, 4, 64, family});
    }
  }
}
BENCHMARK(BM_DecodeAttention)
    ->ArgNames({"batch", "seq_len", "q_len", "fp8_keys", "group", "head_dim", "family"})
    ->Apply(DecodeAttentionCases)
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);

// ------------------------------------------------------------------ GEMM
// The cuBLAS entry points the GEMM needs, loaded once; `error` says why not.
struct Cublas {
  using CreateFn = cublasStatus_t (*)(cublasHandle_t*);
  using DestroyFn = cublasStatus_t (*)(cublasHandle_t);
  using SetStreamFn = cublasStatus_t (*)(cublasHandle_t, cudaStream_t);
  using GemmExFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int,
                                      int, int, const void*, const void*, cudaDataType, int,
                                      const void*, cudaDataType, int, const void*, void*,
                                      cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
  CreateFn create = nullptr;
  DestroyFn destroy = nullptr;
  SetStreamFn set_stream = nullptr;
  GemmExFn gemm_ex = nullptr;
  std::string error;
};

const Cublas& LoadCublas() {
  static const Cublas* cublas = [] {
    auto* c = new Cublas();
    std::vector<std::string> names;
    if (const char* env = std::getenv("FP4KV_CUBLAS_LIBRARY"); env != nullptr && *env != '\0') {
      names.push_back(env);
    }
    names.push_back("libcublas.so.13");
    names.push_back("libcublas.so");
    void* lib = nullptr;
    for (const std::string& n : names) {
      lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) {
      c->error = "cuBLAS not found (set FP4KV_CUBLAS_LIBRARY or LD_LIBRARY_PATH)";
      return c;
    }
    c->create = reinterpret_cast<Cublas::CreateFn>(dlsym(lib, "cublasCreate_v2"));
    c->destroy = reinterpret_cast<Cublas::DestroyFn>(dlsym(lib, "cublasDestroy_v2"));
    c->set_stream = reinterpret_cast<Cublas::SetStreamFn>(dlsym(lib, "cublasSetStream_v2"));
    c->gemm_ex = reinterpret_cast<Cublas::GemmExFn>(dlsym(lib, "cublasGemmEx"));
    if (c->create == nullptr || c->destroy == nullptr || c->set_stream == nullptr ||
        c->gemm_ex == nullptr) {
      c->error =
          "cuBLAS lacks cublasCreate_v2 / cublasDestroy_v2 / cublasSetStream_v2 / "
          "cublasGemmEx";
    }
    return c;
  }();
  return *cublas;
}

constexpr int kGemmN = 8192;

// Median milliseconds of one 8192^3 bf16 GEMM (C = A * B, fp32 accumulation,
// bf16 C) on random inputs, measured once per process; 0 when it could not
// be measured.
double GemmMs() {
  static const double ms = [] {
    const Cublas& cb = LoadCublas();
    if (!cb.error.empty()) return 0.0;
    const size_t bytes = size_t{kGemmN} * kGemmN * 2;
    DeviceMem a, b, c;
    if (!a.Alloc(bytes) || !b.Alloc(bytes) || !c.Alloc(bytes) || !FillHalves(a, 31, true) ||
        !FillHalves(b, 32, true)) {
      return 0.0;
    }
    cudaStream_t s;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return 0.0;
    cublasHandle_t h = nullptr;
    if (cb.create(&h) != CUBLAS_STATUS_SUCCESS) {
      (void)cudaStreamDestroy(s);
      return 0.0;
    }
    bool ok = cb.set_stream(h, s) == CUBLAS_STATUS_SUCCESS;
    const float alpha = 1.0f, beta = 0.0f;
    const double t = MedianMs(s, [&] {
      ok = ok && cb.gemm_ex(h, CUBLAS_OP_N, CUBLAS_OP_N, kGemmN, kGemmN, kGemmN, &alpha, a.get(),
                            CUDA_R_16BF, kGemmN, b.get(), CUDA_R_16BF, kGemmN, &beta, c.get(),
                            CUDA_R_16BF, kGemmN, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
    });
    ok = cudaStreamSynchronize(s) == cudaSuccess && ok;
    (void)cb.destroy(h);
    (void)cudaStreamDestroy(s);
    return ok ? t : 0.0;
  }();
  return ms;
}

double GemmTflops() {
  const double ms = GemmMs();
  return ms > 0 ? 2.0 * kGemmN * kGemmN * kGemmN / (ms * 1e-3) / 1e12 : 0.0;
}

void BM_DenseGemmBf16(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  BENCH_CHECK(state, LoadCublas().error.empty(), LoadCublas().error.c_str());
  const double ms = GemmMs();
  BENCH_CHECK(state, ms > 0, "cuBLAS GEMM could not be measured");
  for (auto _ : state) state.SetIterationTime(ms * 1e-3);
  state.counters["flops"] = 2.0 * kGemmN * kGemmN * kGemmN;
  state.counters["TFLOPs"] = GemmTflops();
  state.counters["median_us"] = ms * 1e3;
}
BENCHMARK(BM_DenseGemmBf16)->UseManualTime()->Iterations(1)->Unit(benchmark::kMicrosecond);

// --------------------------------------------------------------- prefill
constexpr int kPrefillTimedRuns = 21;

// args: batch (prefill requests), new_tokens and cached (each prefill
// request's new tokens and cached prefix), decode_rows (requests of one new
// token) and decode_cached (each one's cached prefix), fp8_keys. Prefill
// requests come first in the batch, then the decode rows. With prefill
// requests the op's max_q_len is new_tokens and q_indptr is given; decode
// rows alone run on a plain decode op (max_q_len 1, no q_indptr), as a
// server would run a decode-only step.
void BM_PrefillAttention(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const int batch = static_cast<int>(state.range(0));
  const int new_tokens = static_cast<int>(state.range(1));
  const int cached = static_cast<int>(state.range(2));
  const int decode_rows = static_cast<int>(state.range(3));
  const int decode_cached = static_cast<int>(state.range(4));
  const bool fp8_keys = state.range(5) != 0;
  constexpr int kKvHeads = 8, kQoHeads = 32, kDim = 128, kPage = 16;
  const int requests = batch + decode_rows;
  BENCH_CHECK(state, requests > 0 && (batch == 0 || new_tokens > 0), "no requests");

  // Lengths, query rows and pages of each request.
  std::vector<int32_t> lens(requests), indptr(requests + 1, 0), kv_indptr(requests + 1, 0);
  int max_pages = 1;
  for (int b = 0; b < requests; ++b) {
    const bool prefill = b < batch;
    lens[b] = prefill ? cached + new_tokens : decode_cached + 1;
    indptr[b + 1] = indptr[b] + (prefill ? new_tokens : 1);
    const int pages = (lens[b] + kPage - 1) / kPage;
    kv_indptr[b + 1] = kv_indptr[b] + pages;
    max_pages = std::max(max_pages, pages);
  }
  const int64_t total_q = indptr[requests];
  const int64_t pages_per_set = kv_indptr[requests];

  CacheGeometry g;
  g.num_kv_heads = kKvHeads;
  g.head_dim_k = g.head_dim_v = kDim;
  g.page_size = kPage;
  g.layout = Layout::kNHD;
  g.key_format = fp8_keys ? KeyFormat::kFp8 : KeyFormat::kNvfp4;
  const double bytes_per_page = static_cast<double>(g.PageBytes());
  const int rotations = static_cast<int>(
      std::max(1.0, std::ceil(256e6 / (bytes_per_page * static_cast<double>(pages_per_set)))));
  g.num_pages = pages_per_set * rotations;
  // NVFP4 pools (their V halves serve the FP8-key cache too) and, for FP8
  // keys, K rows of Dk E4M3 codes written through the Appender.
  CacheGeometry g4 = g;
  g4.key_format = KeyFormat::kNvfp4;
  DeviceCache cache;
  BENCH_CHECK(state, cache.Init(g4, 7), "cache allocation");
  DeviceMem k8;
  if (fp8_keys) {
    BENCH_CHECK(state,
                k8.Alloc(static_cast<size_t>(g.num_pages) * kPage * kKvHeads * kDim) &&
                    FillBytes(k8, 17, true),
                "FP8 key allocation");
  }
  const Device d = Device::Cuda(0);
  PagedCache view = cache.View();
  if (fp8_keys) {
    view = PagedCache::Fp8Keys(
        TensorView::Contiguous(k8.get(), DType::kE4M3, {g.num_pages, kPage, kKvHeads, kDim}, d),
        view.v_data, view.v_scales, Layout::kNHD);
    BENCH_CHECK(state, bench::AppendRandomRows(g, view, 19), "FP8 key append");
  }

  // Block tables: one [requests, max_pages] table a rotation, each request
  // its own pages of a random permutation of the pool (entries past a
  // request's pages are never read).
  std::vector<int32_t> perm(g.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(3);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(static_cast<size_t>(rotations) * requests * max_pages, 0);
  for (int r = 0; r < rotations; ++r) {
    for (int b = 0; b < requests; ++b) {
      for (int j = 0; j < kv_indptr[b + 1] - kv_indptr[b]; ++j) {
        table[(static_cast<size_t>(r) * requests + b) * max_pages + j] =
            perm[r * pages_per_set + kv_indptr[b] + j];
      }
    }
  }
  DeviceMem q, out, tables, seq, qptr, kvptr, ws, fp8_pages, fp8_tables;
  BENCH_CHECK(state, q.Alloc(total_q * kQoHeads * kDim * 2) && FillHalves(q, 11, true),
              "q allocation");
  BENCH_CHECK(state, out.Alloc(total_q * kQoHeads * kDim * 2), "out allocation");
  BENCH_CHECK(state, tables.Alloc(table.size() * 4) && tables.Upload(table), "tables");
  BENCH_CHECK(state, seq.Alloc(lens.size() * 4) && seq.Upload(lens), "seq_lens");
  BENCH_CHECK(state, qptr.Alloc(indptr.size() * 4) && qptr.Upload(indptr), "q_indptr");
  BENCH_CHECK(state, kvptr.Alloc(kv_indptr.size() * 4) && kvptr.Upload(kv_indptr),
              "kv_page_indptr");

  DecodeAttention::Options o;
  o.geometry = g;
  o.num_qo_heads = kQoHeads;
  o.dtype = DType::kBF16;
  o.table_dtype = DType::kI32;
  o.max_batch = requests;
  o.max_pages_per_seq = max_pages;
  o.max_q_len = batch > 0 ? new_tokens : 1;
  o.device = d;
  unsetenv("FP4KV_ATTENTION_KERNEL");
  auto op = DecodeAttention::Create(o);
  BENCH_CHECK(state, op.ok(), ("DecodeAttention::Create: " + op.status().ToString()).c_str());
  state.SetLabel(std::string("decode ") + op->decode_family() + ", prefill " +
                 op->prefill_family());
  BENCH_CHECK(state, ws.Alloc(static_cast<size_t>(std::max<int64_t>(op->WorkspaceBytes(), 256))),
              "workspace");
  DecodeAttentionArgs a;
  a.q = TensorView::Contiguous(q.get(), DType::kBF16, {total_q, kQoHeads, kDim}, d);
  if (o.max_q_len > 1) {
    a.q_indptr = TensorView::Contiguous(qptr.get(), DType::kI32, {requests + 1}, d);
  }
  a.seq_lens = TensorView::Contiguous(seq.get(), DType::kI32, {requests}, d);
  a.out = TensorView::Contiguous(out.get(), DType::kBF16, {total_q, kQoHeads, kDim}, d);
  a.k_scale = GlobalScale::Value(0.01f);
  a.v_scale = GlobalScale::Value(0.01f);
  cudaStream_t s;
  BENCH_CUDA(state, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto table_view = [&](int r) {
    return TensorView::Contiguous(
        tables.get<int32_t>() + static_cast<int64_t>(r) * requests * max_pages, DType::kI32,
        {requests, max_pages}, d);
  };
  int rot = 0;
  auto run = [&] {
    a.block_tables = table_view(rot);
    rot = (rot + 1) % rotations;
    return op->Run(a, view, ws.get(), op->WorkspaceBytes(), s);
  };
  {
    const absl::Status st = run();
    BENCH_CHECK(state, st.ok(), ("DecodeAttention::Run: " + st.ToString()).c_str());
    BENCH_CUDA(state, cudaStreamSynchronize(s));
  }

  // Exact causal FLOPs: the query at position p attends p + 1 keys.
  double pairs = 0.0;
  for (int b = 0; b < requests; ++b) {
    const double n = indptr[b + 1] - indptr[b];
    const double before = lens[b] - n;  // the cached prefix
    pairs += n * before + n * (n + 1) / 2;
  }
  const double flops = 4.0 * kDim * kQoHeads * pairs;
  double kv_tokens = 0.0;
  for (int b = 0; b < requests; ++b) kv_tokens += lens[b];
  const double bytes = kv_tokens * bytes_per_page / kPage + 2.0 * total_q * kQoHeads * kDim * 2;
  const double ms = MedianMs(
      s, [&] { (void)run(); }, kPrefillTimedRuns);
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  BENCH_CUDA(state, cudaGetLastError());

  // The same sequences' pages materialized as FP8 pages (rotating the same
  // tables): out page kv_page_indptr[b] + j + 1 holds request b's page j.
  const int64_t out_pages = pages_per_set + 1;
  BENCH_CHECK(state,
              fp8_pages.Alloc(static_cast<size_t>(out_pages) * 2 * kKvHeads * kPage * kDim) &&
                  fp8_tables.Alloc(static_cast<size_t>(requests) * max_pages * 4),
              "FP8 page allocation");
  auto mat = Materializer::Create({g, DType::kI32, false, d});
  BENCH_CHECK(state, mat.ok(), "Materializer::Create");
  const float fp8_scale = MinFp8Scale(0.01f).value();
  MaterializeArgs m{table_view(0), a.seq_lens,
                    TensorView::Contiguous(kvptr.get(), DType::kI32, {requests + 1}, d),
                    TensorView::Contiguous(fp8_pages.get(), DType::kE4M3,
                                           {out_pages, 2, kKvHeads, kPage, kDim}, d),
                    TensorView::Contiguous(fp8_tables.get(), DType::kI32, {requests, max_pages}, d),
                    a.k_scale, a.v_scale,
                    // FP8 keys are copied as they are: their FP8 scale is g_k.
                    fp8_keys ? a.k_scale : GlobalScale::Value(fp8_scale),
                    GlobalScale::Value(fp8_scale)};
  int mrot = 0;
  auto materialize = [&] {
    m.block_tables = table_view(mrot);
    mrot = (mrot + 1) % rotations;
    return mat->Run(m, view, s);
  };
  {
    const absl::Status st = materialize();
    BENCH_CHECK(state, st.ok(), ("Materializer::Run: " + st.ToString()).c_str());
    BENCH_CUDA(state, cudaStreamSynchronize(s));
  }
  const double materialize_ms = MedianMs(
      s, [&] { (void)materialize(); }, kPrefillTimedRuns);
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  BENCH_CUDA(state, cudaGetLastError());

  for (auto _ : state) Report(state, ms, bytes);
  const double tflops = flops / (ms * 1e-3) / 1e12;
  const double gemm = GemmTflops();
  state.counters["flops"] = flops;
  state.counters["TFLOPs"] = tflops;
  state.counters["fraction_of_gemm"] = gemm > 0 ? tflops / gemm : 0.0;
  state.counters["materialize_us"] = materialize_ms * 1e3;
  (void)cudaStreamDestroy(s);
}
// The target shapes, NVFP4 and FP8 keys: a prompt from nothing (4 x 8192),
// extend (8 x 2048 over 6144), a chunk over a long prefix (1 x 8192 over
// 24576), and a mixed step (2 chunks of 2048 over 4096 plus 128 decode rows
// over 4096), then its prefill part and its decode part alone.
void PrefillAttentionArgs(benchmark::internal::Benchmark* b) {
  for (int fp8 = 0; fp8 < 2; ++fp8) {
    b->Args({4, 8192, 0, 0, 0, fp8});
    b->Args({8, 2048, 6144, 0, 0, fp8});
    b->Args({1, 8192, 24576, 0, 0, fp8});
    b->Args({2, 2048, 4096, 128, 4096, fp8});
    b->Args({2, 2048, 4096, 0, 0, fp8});
    b->Args({0, 0, 0, 128, 4096, fp8});
  }
}
BENCHMARK(BM_PrefillAttention)
    ->ArgNames({"batch", "new", "cached", "decode_rows", "decode_cached", "fp8_keys"})
    ->Apply(PrefillAttentionArgs)
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);
}  // namespace
}  // namespace fp4kv

BENCHMARK_MAIN();
