// Bandwidth of every kernel op on the GPU, against a device-to-device copy
// measured in the same process.
//
// Each case times its Run() with CUDA events on a dedicated stream: a few
// warm-up runs, then 25 timed runs; the reported time is the median.
// Timed region: one Run() (for the decode-sized appends, one launch of a
// graph of many appends, divided by their count; see BM_Append). Inputs are
// random bf16 (never zero); NVFP4/FP8 pages and linear codes hold what the
// real path (Appender, LinearQuantizer::Quantize) wrote from random rows;
// page tables are random permutations; every case moves (reads + writes)
// more than twice the L2 size (60 MB on H200) between two uses of the same
// bytes (large inputs, or input sets rotated). Counters per case:
//   bytes        every input read once plus every output written once
//   GBps         bytes / median time
//   pct_of_copy  GBps as a percentage of the copy's GBps
//   median_us    the median time of one Run()
// The copy reads and writes 2 GiB (bytes = 4 GiB, read + write). Without a
// GPU every case is skipped with an error message.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "bench/bench_util.cuh"
#include "fp4kv/format.h"
#include "fp4kv/geometry.h"
#include "fp4kv/ops.h"
#include "fp4kv/tensor.h"

namespace fp4kv {
namespace {

using bench::CopyGBps;
using bench::DeviceCache;
using bench::DeviceMem;
using bench::FillBytes;
using bench::FillHalves;
using bench::HaveGpu;
using bench::MedianMs;
using bench::Report;
using bench::ReportWithGpu;

std::vector<int64_t> Permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> p(n);
  std::iota(p.begin(), p.end(), 0);
  std::shuffle(p.begin(), p.end(), std::mt19937_64(seed));
  return p;
}

// ------------------------------------------------------------------ copy
void BM_DeviceCopy(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const double gbps = CopyGBps();
  BENCH_CHECK(state, gbps > 0, "copy could not be measured");
  const double bytes = 2.0 * (size_t{2} << 30);
  for (auto _ : state) Report(state, bytes / (gbps * 1e9) * 1e3, bytes);
}
BENCHMARK(BM_DeviceCopy)->UseManualTime()->Iterations(1)->Unit(benchmark::kMicrosecond);

// A device cache of either key format: DeviceCache (bench_util.cuh) for
// NVFP4 keys; FP8 keys (K8V4) get Dk-byte E4M3 key rows, no key scales.
// Every slot holds random rows appended through the Appender
// (bench::AppendRandomRows), so the pages carry what the real path writes.
struct BenchCache {
  CacheGeometry g;
  DeviceCache nvfp4;
  DeviceMem k_bytes;

  bool Init(const CacheGeometry& geometry, bool fp8_keys, uint64_t seed) {
    g = geometry;
    g.key_format = fp8_keys ? KeyFormat::kFp8 : KeyFormat::kNvfp4;
    nvfp4.g = g;
    if (!fp8_keys) return nvfp4.Init(g, seed);
    const size_t rows = static_cast<size_t>(g.num_pages) * g.page_size * g.num_kv_heads;
    return k_bytes.Alloc(rows * g.head_dim_k) && FillBytes(k_bytes, seed + 4, true) &&
           nvfp4.v_data.Alloc(rows * g.head_dim_v / 2) &&
           nvfp4.v_scales.Alloc(rows * g.head_dim_v / 16) &&
           FillBytes(nvfp4.v_data, seed + 1, false) && FillBytes(nvfp4.v_scales, seed + 3, true) &&
           bench::AppendRandomRows(g, View(), seed + 5);
  }
  PagedCache View() const {
    if (!g.fp8_keys()) return nvfp4.View();
    const Device d = Device::Cuda(0);
    const int64_t a = g.layout == Layout::kNHD ? g.page_size : g.num_kv_heads;
    const int64_t b = g.layout == Layout::kNHD ? g.num_kv_heads : g.page_size;
    return PagedCache::Fp8Keys(
        TensorView::Contiguous(k_bytes.get(), DType::kE4M3, {g.num_pages, a, b, g.head_dim_k}, d),
        TensorView::Contiguous(nvfp4.v_data.get(), DType::kU8,
                               {g.num_pages, a, b, g.head_dim_v / 2}, d),
        TensorView::Contiguous(nvfp4.v_scales.get(), DType::kE4M3,
                               {g.num_pages, a, b, g.head_dim_v / 16}, d),
        g.layout);
  }
  // Cache bytes of `tokens` tokens (K and V, data and scales).
  double Bytes(int64_t tokens) const {
    return static_cast<double>(tokens) * static_cast<double>(g.PageBytes()) / g.page_size;
  }
};

// ---------------------------------------------------------------- append
// args: rows, layout (0 NHD, 1 HND), recipe (0 standard, 1 4over6 MAE,
// 2 4over6 MSE, 3 4over6 MAE fast_math; all e4m3_max 256), indexing (0 slot,
// 1 paged), scattered (1: rows land on random pages, one per row; 0:
// consecutive tokens of shuffled pages), k8 (1: FP8 keys, NVFP4 values).
//
// Prefill sizes (rows > 4096): one Run() per timed run; its 256 MB of input
// rows are more than 4x L2, so each run reads them from memory.
// Decode sizes (rows <= 4096): `sets` input sets (K/V rows and destination
// slots, every set on pages of its own), together more than twice the L2
// size, are appended by one CUDA graph of `sets` launches (launch j reads
// set j), as a captured decode step replays them; median_us is the graph's
// median time divided by `sets`. Counters: eager_us, one eager Run() (launch
// latency included), rotating through the sets; l2_warm_us, labelled apart
// and not the result: the same graph of launches all on set 0, whose inputs
// and destination lines stay in L2.
void BM_Append(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const int64_t rows = state.range(0);
  const Layout layout = state.range(1) ? Layout::kHND : Layout::kNHD;
  const Recipe recipe = state.range(2) == 0   ? Recipe::Standard()
                        : state.range(2) == 1 ? Recipe::FourOverSix(256, ErrorMetric::kMae, false)
                        : state.range(2) == 2 ? Recipe::FourOverSix(256, ErrorMetric::kMse, false)
                                              : Recipe::FourOverSix(256, ErrorMetric::kMae, true);
  const bool paged = state.range(3) == 1;
  const bool scattered = state.range(4) == 1;
  const bool decode = rows <= 4096;
  constexpr int H = 8, D = 128, S = 16;
  int l2 = 0;
  BENCH_CUDA(state, cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  CacheGeometry geometry{H, D, D, S, 1, layout};
  geometry.key_format = state.range(5) == 1 ? KeyFormat::kFp8 : KeyFormat::kNvfp4;
  const double input_bytes = rows * H * 2.0 * D * 2;
  const double dest_bytes =
      static_cast<double>(rows) * static_cast<double>(geometry.PageBytes()) / S;
  const int64_t sets =
      decode ? std::max<int64_t>(2, static_cast<int64_t>(2.0 * l2 / (input_bytes + dest_bytes)) + 1)
             : 1;
  const int64_t pages_used = scattered ? sets * rows : sets * ((rows + S - 1) / S);
  const int64_t pages = std::max<int64_t>(scattered ? 32768 : 0, pages_used + 64);
  BenchCache cache;
  BENCH_CHECK(state, cache.Init(CacheGeometry{H, D, D, S, pages, layout}, state.range(5) == 1, 1),
              "cache");
  DeviceMem key, value, slots, bidx, pos, kv_indices, kv_indptr, last;
  BENCH_CHECK(state, key.Alloc(sets * rows * H * D * 2) && value.Alloc(sets * rows * H * D * 2),
              "alloc");
  BENCH_CHECK(state, FillHalves(key, 2, true) && FillHalves(value, 3, true), "fill");
  const std::vector<int64_t> perm = Permutation(pages, 4);
  // Set j's rows are rows j * rows .. (j + 1) * rows - 1 of every array.
  const int64_t per_req = scattered ? 1 : std::min<int64_t>(rows, 1024);
  const int64_t batch = (rows + per_req - 1) / per_req;
  const int64_t pages_per_set = scattered ? rows : (rows + S - 1) / S;
  std::vector<int64_t> slot(sets * rows);
  std::vector<int32_t> b(rows), p(rows), indices, indptr(batch + 1, 0), lastlen(batch, 1);
  for (int64_t j = 0; j < sets; ++j) {
    const int64_t* set_pages = perm.data() + j * pages_per_set;
    for (int64_t i = 0; i < rows; ++i) {
      slot[j * rows + i] = scattered ? set_pages[i] * S + i % S : set_pages[i / S] * S + i % S;
    }
    // Paged: one request per 1024 rows (prefill) or per row (scattered).
    for (int64_t r = 0; r < batch; ++r) {
      const int64_t n = std::min(per_req, rows - r * per_req);
      for (int64_t t = 0; t < n; ++t) {
        b[r * per_req + t] = static_cast<int32_t>(r);
        p[r * per_req + t] = static_cast<int32_t>(t);
      }
      for (int64_t q = 0; q < (n + S - 1) / S; ++q) {
        indices.push_back(static_cast<int32_t>(slot[j * rows + r * per_req + q * S] / S));
      }
      if (j == 0) indptr[r + 1] = static_cast<int32_t>(indices.size());
    }
  }
  const int64_t indices_per_set = static_cast<int64_t>(indices.size()) / sets;
  BENCH_CHECK(state,
              slots.Alloc(slot.size() * 8) && slots.Upload(slot) && bidx.Alloc(rows * 4) &&
                  bidx.Upload(b) && pos.Alloc(rows * 4) && pos.Upload(p) &&
                  kv_indices.Alloc(indices.size() * 4) && kv_indices.Upload(indices) &&
                  kv_indptr.Alloc(indptr.size() * 4) && kv_indptr.Upload(indptr) &&
                  last.Alloc(batch * 4) && last.Upload(lastlen),
              "upload");
  const Device d = Device::Cuda(0);
  auto op = Appender::Create(
      {cache.g, DType::kBF16, paged ? AppendIndexing::kPaged : AppendIndexing::kSlot, recipe, d});
  BENCH_CHECK(state, op.ok(), "Appender::Create");
  // The arguments of set j.
  auto args = [&](int64_t j) {
    AppendArgs a;
    a.key = TensorView::Contiguous(key.get<uint16_t>() + j * rows * H * D, DType::kBF16,
                                   {rows, H, D}, d);
    a.value = TensorView::Contiguous(value.get<uint16_t>() + j * rows * H * D, DType::kBF16,
                                     {rows, H, D}, d);
    a.slot_mapping =
        TensorView::Contiguous(slots.get<int64_t>() + j * rows, DType::kI64, {rows}, d);
    a.batch_indices = TensorView::Contiguous(bidx.get(), DType::kI32, {rows}, d);
    a.positions = TensorView::Contiguous(pos.get(), DType::kI32, {rows}, d);
    a.kv_indices = TensorView::Contiguous(kv_indices.get<int32_t>() + j * indices_per_set,
                                          DType::kI32, {indices_per_set}, d);
    a.kv_indptr = TensorView::Contiguous(kv_indptr.get(), DType::kI32, {batch + 1}, d);
    a.kv_last_page_len = TensorView::Contiguous(last.get(), DType::kI32, {batch}, d);
    a.k_scale = GlobalScale::Value(0.05f);
    a.v_scale = GlobalScale::Value(0.03f);
    return a;
  };
  std::vector<AppendArgs> set_args;
  for (int64_t j = 0; j < sets; ++j) set_args.push_back(args(j));
  const PagedCache view = cache.View();
  cudaStream_t s;
  BENCH_CUDA(state, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (const AppendArgs& a : set_args) BENCH_CHECK(state, op->Run(a, view, s).ok(), "Appender::Run");
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  const double index_bytes =
      paged ? rows * 8.0 + indices_per_set * 4.0 + (batch + 1) * 4.0 : rows * 8.0;
  const double bytes = input_bytes + cache.Bytes(rows) + index_bytes;
  state.counters["input_sets"] = static_cast<double>(sets);
  if (!decode) {
    for (auto _ : state) {
      ReportWithGpu(state, s, [&] { (void)op->Run(set_args[0], view, s); }, bytes);
    }
  } else {
    // One graph of `sets` launches over the sets in turn, and one of as
    // many launches on set 0 (L2-warm, reported apart).
    cudaGraph_t graphs[2] = {nullptr, nullptr};
    cudaGraphExec_t execs[2] = {nullptr, nullptr};
    bool ok = true;
    for (int w = 0; w < 2 && ok; ++w) {
      ok = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
      bool runs = ok;
      for (int64_t j = 0; ok && runs && j < sets; ++j) {
        runs = op->Run(set_args[w == 0 ? j : 0], view, s).ok();
      }
      ok = ok && cudaStreamEndCapture(s, &graphs[w]) == cudaSuccess && runs &&
           cudaGraphInstantiate(&execs[w], graphs[w], 0) == cudaSuccess;
    }
    if (!ok) {
      for (int w = 0; w < 2; ++w) {
        if (execs[w] != nullptr) (void)cudaGraphExecDestroy(execs[w]);
        if (graphs[w] != nullptr) (void)cudaGraphDestroy(graphs[w]);
      }
      (void)cudaStreamDestroy(s);
      state.SkipWithError("graph capture of the appends failed");
      return;
    }
    int64_t next = 0;
    for (auto _ : state) {
      const double ms = MedianMs(s, [&] { (void)cudaGraphLaunch(execs[0], s); }) / sets;
      Report(state, ms, bytes);
      state.counters["l2_warm_us"] =
          MedianMs(s, [&] { (void)cudaGraphLaunch(execs[1], s); }) / sets * 1e3;
      state.counters["eager_us"] = MedianMs(s, [&] {
                                     (void)op->Run(set_args[next], view, s);
                                     next = (next + 1) % sets;
                                   }) *
                                   1e3;
    }
    for (int w = 0; w < 2; ++w) {
      if (execs[w] != nullptr) (void)cudaGraphExecDestroy(execs[w]);
      if (graphs[w] != nullptr) (void)cudaGraphDestroy(graphs[w]);
    }
  }
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  BENCH_CUDA(state, cudaGetLastError());
  (void)cudaStreamDestroy(s);
}
BENCHMARK(BM_Append)
    ->ArgNames({"rows", "hnd", "recipe", "paged", "scattered", "k8"})
    ->Args({65536, 0, 0, 0, 0, 0})
    ->Args({65536, 1, 0, 0, 0, 0})
    ->Args({65536, 0, 0, 1, 0, 0})
    ->Args({65536, 1, 0, 1, 0, 0})
    ->Args({65536, 0, 1, 0, 0, 0})
    ->Args({65536, 0, 2, 0, 0, 0})
    ->Args({65536, 0, 3, 0, 0, 0})
    ->Args({128, 0, 0, 0, 1, 0})
    ->Args({128, 0, 0, 1, 1, 0})
    ->Args({65536, 0, 0, 0, 0, 1})
    ->Args({65536, 1, 0, 0, 0, 1})
    ->Args({65536, 0, 0, 1, 0, 1})
    ->Args({128, 0, 0, 0, 1, 1})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);

// Host cost of one Appender::Run on a CUDA stream (decode shape), without
// synchronizing; the queue is drained every 256 calls outside the timing.
void BM_AppendHostCost(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  constexpr int H = 8, D = 128, S = 16;
  constexpr int64_t rows = 128, pages = 4096;
  DeviceCache cache;
  BENCH_CHECK(state, cache.Init(CacheGeometry{H, D, D, S, pages, Layout::kNHD}, 5), "cache");
  DeviceMem key, value, slots;
  BENCH_CHECK(state, key.Alloc(rows * H * D * 2) && value.Alloc(rows * H * D * 2), "alloc");
  BENCH_CHECK(state, FillHalves(key, 6, true) && FillHalves(value, 7, true), "fill");
  const std::vector<int64_t> perm = Permutation(pages, 8);
  std::vector<int64_t> slot(rows);
  for (int64_t i = 0; i < rows; ++i) slot[i] = perm[i] * S + i % S;
  BENCH_CHECK(state, slots.Alloc(rows * 8) && slots.Upload(slot), "upload");
  const Device d = Device::Cuda(0);
  auto op = Appender::Create({cache.g, DType::kBF16, AppendIndexing::kSlot, Recipe(), d});
  BENCH_CHECK(state, op.ok(), "Appender::Create");
  AppendArgs a;
  a.key = TensorView::Contiguous(key.get(), DType::kBF16, {rows, H, D}, d);
  a.value = TensorView::Contiguous(value.get(), DType::kBF16, {rows, H, D}, d);
  a.slot_mapping = TensorView::Contiguous(slots.get(), DType::kI64, {rows}, d);
  a.k_scale = GlobalScale::Value(0.05f);
  a.v_scale = GlobalScale::Value(0.03f);
  const PagedCache view = cache.View();
  cudaStream_t s;
  BENCH_CUDA(state, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int64_t n = 0;
  for (auto _ : state) {
    if (!op->Run(a, view, s).ok()) {
      state.SkipWithError("Appender::Run");
      break;
    }
    if (++n % 256 == 0) {
      state.PauseTiming();
      (void)cudaStreamSynchronize(s);
      state.ResumeTiming();
    }
  }
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  (void)cudaStreamDestroy(s);
}
BENCHMARK(BM_AppendHostCost)
    ->Unit(benchmark::kMicrosecond)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

// Baseline for BM_AppendHostCost: the host cost of launching an empty kernel
// whose parameter is `kBytes` bytes (416 = the append kernel's parameter
// struct), with the same queue draining. The difference to
// BM_AppendHostCost is what Run() adds around cudaLaunchKernel.
template <int kBytes>
struct ParamBlob {
  unsigned char bytes[kBytes];
};

template <int kBytes>
__global__ void EmptyKernel(const ParamBlob<kBytes> blob) {
  if (blob.bytes[0] == 0xff && threadIdx.x == 1024) asm volatile("trap;");
}

template <int kBytes>
void BM_LaunchHostCost(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  cudaStream_t s;
  BENCH_CUDA(state, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  ParamBlob<kBytes> blob{};
  int64_t n = 0;
  for (auto _ : state) {
    EmptyKernel<kBytes><<<dim3(128, 1), 128, 0, s>>>(blob);
    if (cudaGetLastError() != cudaSuccess) {
      state.SkipWithError("launch");
      break;
    }
    if (++n % 256 == 0) {
      state.PauseTiming();
      (void)cudaStreamSynchronize(s);
      state.ResumeTiming();
    }
  }
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  (void)cudaStreamDestroy(s);
}
BENCHMARK(BM_LaunchHostCost<16>)
    ->Unit(benchmark::kMicrosecond)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);
BENCHMARK(BM_LaunchHostCost<416>)
    ->Unit(benchmark::kMicrosecond)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

// ------------------------------------------------------------ dequantize
// args: batch, tokens per request, k8 (1: FP8 keys)
void BM_Dequantize(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const int64_t batch = state.range(0), len = state.range(1);
  constexpr int H = 8, D = 128, S = 16;
  const int64_t per_req = len / S, pages = batch * per_req;
  BenchCache cache;
  BENCH_CHECK(state,
              cache.Init(CacheGeometry{H, D, D, S, pages, Layout::kNHD}, state.range(2) == 1, 9),
              "cache");
  const std::vector<int64_t> perm = Permutation(pages, 10);
  std::vector<int32_t> table(perm.begin(), perm.end()), lens(batch, static_cast<int32_t>(len));
  DeviceMem tables, seq, k_out, v_out;
  BENCH_CHECK(state,
              tables.Alloc(table.size() * 4) && tables.Upload(table) && seq.Alloc(batch * 4) &&
                  seq.Upload(lens) && k_out.Alloc(batch * len * H * D * 2) &&
                  v_out.Alloc(batch * len * H * D * 2),
              "alloc");
  const Device d = Device::Cuda(0);
  auto op = Dequantizer::Create({cache.g, DType::kBF16, DType::kI32, d});
  BENCH_CHECK(state, op.ok(), "Dequantizer::Create");
  const DequantArgs a{TensorView::Contiguous(tables.get(), DType::kI32, {batch, per_req}, d),
                      TensorView::Contiguous(seq.get(), DType::kI32, {batch}, d),
                      TensorView::Contiguous(k_out.get(), DType::kBF16, {batch, len, H, D}, d),
                      TensorView::Contiguous(v_out.get(), DType::kBF16, {batch, len, H, D}, d),
                      GlobalScale::Value(0.05f),
                      GlobalScale::Value(0.03f)};
  const PagedCache view = cache.View();
  cudaStream_t s;
  BENCH_CUDA(state, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  BENCH_CHECK(state, op->Run(a, view, s).ok(), "Dequantizer::Run");
  const double bytes =
      cache.Bytes(batch * len) + batch * len * H * 2.0 * D * 2 + table.size() * 4.0 + batch * 4.0;
  for (auto _ : state) ReportWithGpu(state, s, [&] { (void)op->Run(a, view, s); }, bytes);
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  BENCH_CUDA(state, cudaGetLastError());
  (void)cudaStreamDestroy(s);
}
BENCHMARK(BM_Dequantize)
    ->ArgNames({"batch", "len", "k8"})
    ->Args({16, 4096, 0})
    ->Args({128, 1024, 0})
    ->Args({16, 4096, 1})
    ->Args({128, 1024, 1})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);

// ----------------------------------------------------------- materialize
// args: batch, tokens per request, k8 (1: FP8 keys, key pages copied: the
// key FP8 scale is g_k; 2: FP8 keys re-scaled to twice g_k)
void BM_Materialize(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const int64_t batch = state.range(0), len = state.range(1);
  constexpr int H = 8, D = 128, S = 16;
  const int64_t per_req = len / S, pages = batch * per_req;
  BenchCache cache;
  BENCH_CHECK(state,
              cache.Init(CacheGeometry{H, D, D, S, pages, Layout::kNHD}, state.range(2) != 0, 11),
              "cache");
  const std::vector<int64_t> perm = Permutation(pages, 12);
  std::vector<int32_t> table(perm.begin(), perm.end()), lens(batch, static_cast<int32_t>(len));
  std::vector<int32_t> indptr(batch + 1);
  for (int64_t b = 0; b <= batch; ++b) indptr[b] = static_cast<int32_t>(b * per_req);
  DeviceMem tables, seq, ind, out, fp8_tables;
  const int64_t out_pages = pages + 1;
  BENCH_CHECK(state,
              tables.Alloc(table.size() * 4) && tables.Upload(table) && seq.Alloc(batch * 4) &&
                  seq.Upload(lens) && ind.Alloc(indptr.size() * 4) && ind.Upload(indptr) &&
                  out.Alloc(static_cast<size_t>(out_pages) * 2 * H * S * D) &&
                  fp8_tables.Alloc(table.size() * 4),
              "alloc");
  const Device d = Device::Cuda(0);
  auto op = Materializer::Create({cache.g, DType::kI32, false, d});
  BENCH_CHECK(state, op.ok(), "Materializer::Create");
  const float g = 0.05f;
  const float fp8 = MinFp8Scale(g).value();
  const float k_fp8 = state.range(2) == 0 ? fp8 : state.range(2) == 1 ? g : 2 * g;
  const MaterializeArgs a{
      TensorView::Contiguous(tables.get(), DType::kI32, {batch, per_req}, d),
      TensorView::Contiguous(seq.get(), DType::kI32, {batch}, d),
      TensorView::Contiguous(ind.get(), DType::kI32, {batch + 1}, d),
      TensorView::Contiguous(out.get(), DType::kE4M3, {out_pages, 2, H, S, D}, d),
      TensorView::Contiguous(fp8_tables.get(), DType::kI32, {batch, per_req}, d),
      GlobalScale::Value(g),
      GlobalScale::Value(g),
      GlobalScale::Value(k_fp8),
      GlobalScale::Value(fp8)};
  const PagedCache view = cache.View();
  cudaStream_t s;
  BENCH_CUDA(state, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  BENCH_CHECK(state, op->Run(a, view, s).ok(), "Materializer::Run");
  const double bytes = cache.Bytes(batch * len) + out_pages * 2.0 * H * S * D + table.size() * 8.0 +
                       (2 * batch + 1) * 4.0;
  for (auto _ : state) ReportWithGpu(state, s, [&] { (void)op->Run(a, view, s); }, bytes);
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  BENCH_CUDA(state, cudaGetLastError());
  (void)cudaStreamDestroy(s);
}
BENCHMARK(BM_Materialize)
    ->ArgNames({"batch", "len", "k8"})
    ->Args({16, 4096, 0})
    ->Args({256, 2048, 0})
    ->Args({16, 4096, 1})
    ->Args({16, 4096, 2})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);

// ---------------------------------------------------------------- linear
// args: rows, cols, direction (0 quantize, 1 dequantize)
void BM_Linear(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const int64_t rows = state.range(0), cols = state.range(1);
  const bool dequant = state.range(2) == 1;
  DeviceMem x, packed, scales;
  BENCH_CHECK(
      state,
      x.Alloc(rows * cols * 2) && packed.Alloc(rows * cols / 2) && scales.Alloc(rows * cols / 16),
      "alloc");
  BENCH_CHECK(
      state, FillHalves(x, 13, true) && FillBytes(packed, 14, false) && FillBytes(scales, 15, true),
      "fill");
  const Device d = Device::Cuda(0);
  auto op = LinearQuantizer::Create({DType::kBF16, Recipe(), d});
  BENCH_CHECK(state, op.ok(), "LinearQuantizer::Create");
  const TensorView xv = TensorView::Contiguous(x.get(), DType::kBF16, {rows, cols}, d);
  const TensorView pv = TensorView::Contiguous(packed.get(), DType::kU8, {rows, cols / 2}, d);
  const TensorView sv = TensorView::Contiguous(scales.get(), DType::kE4M3, {rows, cols / 16}, d);
  cudaStream_t s;
  BENCH_CUDA(state, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto run = [&] {
    return dequant ? op->Dequantize(pv, sv, xv, GlobalScale::Value(0.02f), s)
                   : op->Quantize(xv, pv, sv, GlobalScale::Value(0.02f), s);
  };
  // The dequantize case reads codes and scales the quantizer wrote from the
  // random rows (the real path), not random bytes.
  BENCH_CHECK(state, op->Quantize(xv, pv, sv, GlobalScale::Value(0.02f), s).ok(), "Quantize");
  BENCH_CHECK(state, run().ok(), "LinearQuantizer run");
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  const double bytes = rows * cols * (2.0 + 0.5 + 1.0 / 16);
  for (auto _ : state) ReportWithGpu(state, s, [&] { (void)run(); }, bytes);
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  BENCH_CUDA(state, cudaGetLastError());
  (void)cudaStreamDestroy(s);
}
BENCHMARK(BM_Linear)
    ->ArgNames({"rows", "cols", "dequant"})
    ->Args({524288, 128, 0})
    ->Args({524288, 128, 1})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);

// ------------------------------------------------------- quantize cache
// A bf16 paged cache of 2 GiB (32768 pages of 16 tokens, 8 heads, d128, K and
// V) into NVFP4 pages of the same layout. args: layout (0 NHD, 1 HND),
// compute (1: global scales computed from the data first, which reads the
// input twice; bytes still count it once), lists (1: src/dst page lists, the
// destination a random permutation).
void BM_QuantizePagedCache(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const Layout layout = state.range(0) ? Layout::kHND : Layout::kNHD;
  const bool compute = state.range(1) == 1;
  const bool lists = state.range(2) == 1;
  constexpr int H = 8, D = 128, S = 16;
  constexpr int64_t kPages = 32768;
  DeviceCache cache;
  BENCH_CHECK(state, cache.Init(CacheGeometry{H, D, D, S, kPages, layout}, 1), "cache");
  DeviceMem k, v, src, dst, scales;
  const size_t half_bytes = static_cast<size_t>(kPages) * S * H * D * 2;
  BENCH_CHECK(state, k.Alloc(half_bytes) && v.Alloc(half_bytes) && scales.Alloc(8), "alloc");
  BENCH_CHECK(state, FillHalves(k, 5, true) && FillHalves(v, 6, true), "fill");
  std::vector<int32_t> src_pages(kPages), dst_pages(kPages);
  const std::vector<int64_t> perm = Permutation(kPages, 7);
  for (int64_t i = 0; i < kPages; ++i) {
    src_pages[i] = static_cast<int32_t>(i);
    dst_pages[i] = static_cast<int32_t>(perm[i]);
  }
  BENCH_CHECK(state,
              src.Alloc(kPages * 4) && src.Upload(src_pages) && dst.Alloc(kPages * 4) &&
                  dst.Upload(dst_pages),
              "upload");
  const Device d = Device::Cuda(0);
  PagedCacheQuantizer::Options o;
  o.geometry = cache.g;
  o.source_layout = layout;
  o.input_dtype = DType::kBF16;
  o.device = d;
  o.compute_scales = compute;
  auto op = PagedCacheQuantizer::Create(o);
  BENCH_CHECK(state, op.ok(), "PagedCacheQuantizer::Create");
  const int64_t a = layout == Layout::kNHD ? S : H, b = layout == Layout::kNHD ? H : S;
  QuantizeCacheArgs args;
  args.source = HalfPagedCache::FromTuple(
      TensorView::Contiguous(k.get(), DType::kBF16, {kPages, a, b, D}, d),
      TensorView::Contiguous(v.get(), DType::kBF16, {kPages, a, b, D}, d), layout);
  if (lists) {
    args.src_pages = TensorView::Contiguous(src.get(), DType::kI32, {kPages}, d);
    args.dst_pages = TensorView::Contiguous(dst.get(), DType::kI32, {kPages}, d);
  }
  if (compute) {
    args.k_scale_out = scales.get<float>();
    args.v_scale_out = scales.get<float>() + 1;
  } else {
    args.k_scale = GlobalScale::Value(0.005f);
    args.v_scale = GlobalScale::Value(0.003f);
  }
  const PagedCache view = cache.View();
  cudaStream_t s;
  BENCH_CUDA(state, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  BENCH_CHECK(state, op->Run(args, view, s).ok(), "PagedCacheQuantizer::Run");
  const double bytes =
      2.0 * half_bytes + cache.Bytes(kPages * S) + (lists ? kPages * 8.0 : 0.0);
  for (auto _ : state) ReportWithGpu(state, s, [&] { (void)op->Run(args, view, s); }, bytes);
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  BENCH_CUDA(state, cudaGetLastError());
  (void)cudaStreamDestroy(s);
}
BENCHMARK(BM_QuantizePagedCache)
    ->ArgNames({"hnd", "compute", "lists"})
    ->Args({0, 0, 0})
    ->Args({1, 0, 0})
    ->Args({0, 0, 1})
    ->Args({0, 1, 0})
    ->Args({1, 1, 1})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace fp4kv

BENCHMARK_MAIN();
