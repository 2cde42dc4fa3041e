// Sequence export/import and host-tier swap bandwidth, and a decode loop
// with a swap in flight (CUDA only). Prints markdown tables; with
// --benchmark_out=PATH also writes the rows as Google Benchmark-style JSON
// ({"benchmarks": [{"name", "median_us", "GBps", "pct_of_copy"}]}, what
// scripts/gpu_check.sh reads; other arguments are ignored).
//
// Cache: 32 layers, 8 KV heads, head_dim 128 (K and V), page 16, NHD. One
// sequence of 1 GiB of pages (1820 pages of 576 KiB: every layer's K/V data
// and scales), its pages interleaved with another sequence's (every other
// page), random pool bytes. Every case moves the same bytes and is compared
// with a plain cudaMemcpyAsync of that many contiguous bytes between device
// memory and pinned host memory (D2H and H2D) measured in the same process,
// and with a device-to-device copy (read + write) for the device images.
//
//   export -> device image, import <- device image (ReserveImport +
//     CommitImport), export -> pinned host image, import <- pinned host image:
//     CUDA events around the call on the stream, median of 7 runs.
//   SwapOut, SwapIn: host wall time of the call plus SynchronizeSwaps (the
//     copies run on the cache's copy stream), median of 7 runs.
//   page-copy CTA sweep: the page-copy kernel alone, pool -> pinned host,
//     with 132 / 512 / 4096 CTAs (the cache uses 512 for host copies).
//   decode loop: 64 sequences of 2048 tokens, one token each per step,
//     append + NVFP4 decode attention (32 query heads, bf16) on 4 layers;
//     median step time (events) of 40 steps alone, then with a SwapOut of
//     the 1 GiB sequence in flight, then with its SwapIn in flight.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/bench_util.cuh"
#include "fp4kv/kv_cache.h"
#include "src/params.h"

namespace fp4kv {
namespace {

constexpr int kLayers = 32, kHeads = 8, kDim = 128, kPage = 16, kQoHeads = 32;
constexpr int kDecodeSeqs = 64, kDecodeContext = 2048, kDecodeLayers = 4, kDecodeSteps = 40;
constexpr int kRuns = 7;

#define CHECK_OK(expr)                                                        \
  do {                                                                        \
    if (absl::Status s_ = (expr); !s_.ok()) {                                 \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)
#define CHECK_CUDA(call)                                                        \
  do {                                                                          \
    if (cudaError_t e_ = (call); e_ != cudaSuccess) {                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,        \
                   cudaGetErrorString(e_));                                     \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

template <typename F>
double MedianEventMs(cudaStream_t s, F&& f) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int r = 0; r < kRuns + 2; ++r) {
    CHECK_CUDA(cudaEventRecord(a, s));
    f();
    CHECK_CUDA(cudaEventRecord(b, s));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    if (r >= 2) ms.push_back(t);  // two warm-up runs
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct JsonRow {
  std::string name;
  double us, gbps, pct;
};
std::vector<JsonRow>& JsonRows() {
  static std::vector<JsonRow> rows;
  return rows;
}

void Row(const char* name, double bytes, double ms, double base_gbps, const char* base) {
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  JsonRows().push_back({name, ms * 1e3, gbps, 100.0 * gbps / base_gbps});
  std::printf("| %-44s | %8.3f | %7.2f | %6.1f%% of %s |\n", name, ms, gbps,
              100.0 * gbps / base_gbps, base);
}

void WriteJson(const char* path) {
  FILE* f = std::fopen(path, "w");
  if (f == nullptr) return;
  std::fprintf(f, "{\"benchmarks\": [");
  for (size_t i = 0; i < JsonRows().size(); ++i) {
    const JsonRow& r = JsonRows()[i];
    std::fprintf(f, "%s\n  {\"name\": \"%s\", \"median_us\": %.3f, \"GBps\": %.3f, "
                 "\"pct_of_copy\": %.2f}",
                 i == 0 ? "" : ",", r.name.c_str(), r.us, r.gbps, r.pct);
  }
  std::fprintf(f, "\n]}\n");
  std::fclose(f);
}

int Main(const char* json_out) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("kv_cache_swap_bench: no CUDA device, nothing measured\n");
    if (json_out != nullptr) WriteJson(json_out);
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t cs;
  CHECK_CUDA(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  const Stream stream = reinterpret_cast<Stream>(cs);

  CacheGeometry g;
  g.num_kv_heads = kHeads;
  g.head_dim_k = g.head_dim_v = kDim;
  g.page_size = kPage;
  g.layout = Layout::kNHD;
  const int64_t page_bytes = g.PageBytes() * kLayers;          // all layers
  const int64_t big_pages = (int64_t{1} << 30) / page_bytes;   // 1 GiB of pages
  const int64_t decode_pages = int64_t{kDecodeSeqs} * (kDecodeContext / kPage + 4);
  g.num_pages = 3 * big_pages + decode_pages + 64;
  KVCacheOptions o;
  o.num_layers = kLayers;
  o.geometry = g;
  o.device = Device::Cuda(0);
  o.k_global_scales.assign(kLayers, 0.05f);
  o.v_global_scales.assign(kLayers, 0.04f);
  o.max_seqs_per_step = kDecodeSeqs;
  o.max_tokens_per_step = 4096;
  o.max_pages_per_seq = static_cast<int>(big_pages + 8);
  o.host_tier.host_pages = big_pages + 8;
  absl::StatusOr<KVCache> made = KVCache::Create(o);
  CHECK_OK(made.status());
  KVCache& cache = *made;
  {
    // Random pool bytes (scale bytes stay finite: 1..0x7e).
    const PagedCache l0 = cache.LayerCache(0);
    uint8_t* base = static_cast<uint8_t*>(l0.k_data.data);
    bench::FillBytesKernel<<<4096, 256>>>(base, static_cast<size_t>(cache.Stats().pool_bytes), 7,
                                          true);
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  // The 1 GiB sequence, its pages interleaved with a filler's.
  const SequenceId big = cache.CreateSequence().value();
  const SequenceId filler = cache.CreateSequence().value();
  for (int64_t p = 0; p < big_pages; ++p) {
    CHECK_OK(cache.PrepareStep({{big, kPage}}, stream).status());
    CHECK_OK(cache.PrepareStep({{filler, kPage}}, stream).status());
  }
  CHECK_CUDA(cudaStreamSynchronize(cs));
  const double bytes = static_cast<double>(big_pages * page_bytes);
  const int64_t image_bytes = *cache.ExportedBytes(big);

  void* pinned = nullptr;
  void* device_image = nullptr;
  CHECK_CUDA(cudaHostAlloc(&pinned, static_cast<size_t>(image_bytes), cudaHostAllocDefault));
  CHECK_CUDA(cudaMalloc(&device_image, static_cast<size_t>(image_bytes)));
  const size_t nbytes = static_cast<size_t>(big_pages * page_bytes);
  // Baselines: contiguous copies of the same bytes.
  const double d2h_ms = MedianEventMs(cs, [&] {
    CHECK_CUDA(cudaMemcpyAsync(pinned, device_image, nbytes, cudaMemcpyDeviceToHost, cs));
  });
  const double h2d_ms = MedianEventMs(cs, [&] {
    CHECK_CUDA(cudaMemcpyAsync(device_image, pinned, nbytes, cudaMemcpyHostToDevice, cs));
  });
  const double d2h = bytes / (d2h_ms * 1e-3) / 1e9;
  const double h2d = bytes / (h2d_ms * 1e-3) / 1e9;
  const double d2d = bench::CopyGBps() / 2;  // one direction's bytes: what an image copy moves

  std::printf("GPU: %s (%d SMs). Sequence: %lld pages of %lld bytes = %.3f GiB (32 layers, 8 KV "
              "heads, head_dim 128, page 16), pages interleaved.\n",
              prop.name, prop.multiProcessorCount, static_cast<long long>(big_pages),
              static_cast<long long>(page_bytes), bytes / (1 << 30));
  std::printf("| case | median ms | GB/s | vs copy |\n| --- | ---: | ---: | --- |\n");
  Row("cudaMemcpyAsync D2H pinned (baseline)", bytes, d2h_ms, d2h, "D2H");
  Row("cudaMemcpyAsync H2D pinned (baseline)", bytes, h2d_ms, h2d, "H2D");
  std::printf("| %-44s | %8s | %7.2f | (read + write %.0f GB/s) |\n",
              "cudaMemcpyAsync D2D, 2 GiB (baseline)", "-", d2d, 2 * d2d);

  // Export / import, device image.
  const double exp_dev = MedianEventMs(
      cs, [&] { CHECK_OK(cache.ExportSequence(big, device_image, image_bytes, stream)); });
  Row("ExportSequence -> device image", bytes, exp_dev, d2d, "D2D");
  CHECK_CUDA(cudaStreamSynchronize(cs));
  std::vector<uint8_t> header(kSequenceImageHeaderBytes);
  CHECK_CUDA(cudaMemcpy(header.data(), device_image, header.size(), cudaMemcpyDeviceToHost));
  absl::StatusOr<SequenceImageHeader> h = ParseSequenceImageHeader(header.data(), header.size());
  CHECK_OK(h.status());
  const double imp_dev = MedianEventMs(cs, [&] {
    absl::StatusOr<ImportReservation> r = cache.ReserveImport(*h);
    CHECK_OK(r.status());
    absl::StatusOr<SequenceId> id =
        cache.CommitImport(*std::move(r), device_image, image_bytes, {}, stream);
    CHECK_OK(id.status());
    CHECK_OK(cache.ReleaseSequence(*id));  // host bookkeeping; the pages are reused in stream order
  });
  Row("ReserveImport + CommitImport <- device image", bytes, imp_dev, d2d, "D2D");
  // Export / import, pinned host image.
  const double exp_host = MedianEventMs(
      cs, [&] { CHECK_OK(cache.ExportSequence(big, pinned, image_bytes, stream)); });
  Row("ExportSequence -> pinned host image", bytes, exp_host, d2h, "D2H");
  const double imp_host = MedianEventMs(cs, [&] {
    absl::StatusOr<SequenceId> id = cache.ImportSequence(pinned, image_bytes, {}, stream);
    CHECK_OK(id.status());
    CHECK_OK(cache.ReleaseSequence(*id));
  });
  Row("ImportSequence <- pinned host image", bytes, imp_host, h2d, "H2D");
  // Swap out / in (the cache's copy stream).
  std::vector<double> out_ms, in_ms;
  for (int r = 0; r < kRuns + 1; ++r) {
    CHECK_CUDA(cudaStreamSynchronize(cs));
    auto t0 = std::chrono::steady_clock::now();
    CHECK_OK(cache.SwapOut(big, stream));
    CHECK_OK(cache.SynchronizeSwaps());
    auto t1 = std::chrono::steady_clock::now();
    CHECK_OK(cache.SwapIn(big, stream));
    CHECK_OK(cache.SynchronizeSwaps());
    auto t2 = std::chrono::steady_clock::now();
    if (r == 0) continue;  // warm-up
    out_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    in_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  Row("SwapOut + SynchronizeSwaps (host time)", bytes, Median(out_ms), d2h, "D2H");
  Row("SwapIn + SynchronizeSwaps (host time)", bytes, Median(in_ms), h2d, "H2D");
  // The page-copy kernel alone with other CTA counts (pool -> pinned).
  {
    absl::StatusOr<absl::Span<const int32_t>> pages = cache.SequencePages(big);
    CHECK_OK(pages.status());
    void* d_ids = nullptr;
    CHECK_CUDA(cudaMalloc(&d_ids, pages->size() * 4));
    CHECK_CUDA(cudaMemcpy(d_ids, pages->data(), pages->size() * 4, cudaMemcpyHostToDevice));
    void* mapped = nullptr;
    CHECK_CUDA(cudaHostGetDevicePointer(&mapped, pinned, 0));
    for (int ctas : {prop.multiProcessorCount, 512, 4096}) {
      internal::PageCopyParams p;
      const PagedCache l0 = cache.LayerCache(0), l1 = cache.LayerCache(1);
      p.src = static_cast<const uint8_t*>(l0.k_data.data);
      p.src_layer_stride = static_cast<const uint8_t*>(l1.k_data.data) - p.src;
      const TensorView* views[4] = {&l0.k_data, &l0.v_data, &l0.k_scales, &l0.v_scales};
      for (int r = 0; r < 4; ++r) {
        p.src_region[r] = static_cast<const uint8_t*>(views[r]->data) - p.src;
        p.page_bytes[r] = views[r]->strides[0];  // contiguous: bytes per page (u8 / e4m3)
        p.dst_region[r] = r == 0 ? 0 : p.dst_region[r - 1] + p.page_bytes[r - 1] * big_pages;
      }
      p.dst = static_cast<uint8_t*>(mapped);
      p.dst_layer_stride = p.dst_region[3] + p.page_bytes[3] * big_pages;
      p.src_ids = static_cast<const int32_t*>(d_ids);
      p.num_pages = big_pages;
      p.num_layers = kLayers;
      p.max_ctas = ctas;
      const double ms = MedianEventMs(cs, [&] { CHECK_OK(internal::LaunchPageCopy(p, stream)); });
      char name[96];
      std::snprintf(name, sizeof(name), "page-copy kernel -> pinned, %d CTAs", ctas);
      Row(name, bytes, ms, d2h, "D2H");
    }
    CHECK_CUDA(cudaFree(d_ids));
  }

  // Decode loop, with and without a swap in flight.
  std::vector<StepEntry> entries;
  for (int i = 0; i < kDecodeSeqs; ++i) {
    const SequenceId id = cache.CreateSequence().value();
    CHECK_OK(cache.PrepareStep({{id, kDecodeContext}}, stream).status());
    entries.push_back({id, 1});
  }
  absl::StatusOr<CacheAppender> app = cache.appender(DType::kBF16);
  CacheAttentionOptions ao;
  ao.num_qo_heads = kQoHeads;
  absl::StatusOr<CacheAttention> att = cache.attention(ao);
  CHECK_OK(app.status());
  CHECK_OK(att.status());
  const int64_t T = o.max_tokens_per_step;
  void *d_k, *d_v, *d_q, *d_out, *d_ws;
  const int64_t q_bytes = int64_t{kDecodeSeqs} * kQoHeads * kDim * 2;
  const int64_t ws_bytes = std::max<int64_t>(256, att->WorkspaceBytes());
  CHECK_CUDA(cudaMalloc(&d_k, T * kHeads * kDim * 2));
  CHECK_CUDA(cudaMalloc(&d_v, T * kHeads * kDim * 2));
  CHECK_CUDA(cudaMalloc(&d_q, q_bytes));
  CHECK_CUDA(cudaMalloc(&d_out, q_bytes));
  CHECK_CUDA(cudaMalloc(&d_ws, ws_bytes));
  CHECK_CUDA(cudaMemset(d_k, 0x3c, T * kHeads * kDim * 2));
  CHECK_CUDA(cudaMemset(d_v, 0xbc, T * kHeads * kDim * 2));
  CHECK_CUDA(cudaMemset(d_q, 0x3c, q_bytes));
  CHECK_CUDA(cudaDeviceSynchronize());
  const Device dev = Device::Cuda(0);
  const TensorView k = TensorView::Contiguous(d_k, DType::kBF16, {T, kHeads, kDim}, dev);
  const TensorView v = TensorView::Contiguous(d_v, DType::kBF16, {T, kHeads, kDim}, dev);
  const TensorView q = TensorView::Contiguous(d_q, DType::kBF16, {kDecodeSeqs, kQoHeads, kDim}, dev);
  const TensorView out =
      TensorView::Contiguous(d_out, DType::kBF16, {kDecodeSeqs, kQoHeads, kDim}, dev);
  std::vector<cudaEvent_t> marks(kDecodeSteps + 1);
  for (cudaEvent_t& e : marks) CHECK_CUDA(cudaEventCreate(&e));
  // 0: alone; 1: SwapOut of the big sequence issued before the loop; 2: its SwapIn.
  auto loop = [&](int mode, double* swap_ms) {
    CHECK_CUDA(cudaStreamSynchronize(cs));
    auto t0 = std::chrono::steady_clock::now();
    if (mode == 1) CHECK_OK(cache.SwapOut(big, stream));
    if (mode == 2) CHECK_OK(cache.SwapIn(big, stream));
    for (int st = 0; st < kDecodeSteps; ++st) {
      CHECK_CUDA(cudaEventRecord(marks[st], cs));
      CHECK_OK(cache.PrepareStep(entries, stream).status());
      for (int l = 0; l < kDecodeLayers; ++l) {
        CHECK_OK(app->Run(l, k, v, stream));
        CHECK_OK(att->Run(l, q, out, d_ws, ws_bytes, stream));
      }
    }
    CHECK_CUDA(cudaEventRecord(marks[kDecodeSteps], cs));
    CHECK_CUDA(cudaStreamSynchronize(cs));
    auto t1 = std::chrono::steady_clock::now();
    CHECK_OK(cache.SynchronizeSwaps());
    auto t2 = std::chrono::steady_clock::now();
    *swap_ms = std::chrono::duration<double, std::milli>(t2 - t0).count();
    std::vector<double> step;
    for (int st = 0; st < kDecodeSteps; ++st) {
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, marks[st], marks[st + 1]));
      step.push_back(ms);
    }
    (void)t1;
    return Median(step);
  };
  double dummy = 0, out_total = 0, in_total = 0;
  (void)loop(0, &dummy);  // warm-up
  const double alone = loop(0, &dummy);
  const double with_out = loop(1, &out_total);
  const double with_in = loop(2, &in_total);
  const double alone2 = loop(0, &dummy);
  std::printf("\nDecode loop: %d sequences x %d tokens, %d layers of append + NVFP4 attention, "
              "%d steps; median step time (CUDA events on the compute stream).\n",
              kDecodeSeqs, kDecodeContext, kDecodeLayers, kDecodeSteps);
  std::printf("| loop | median step ms | vs alone | swap done after (ms, host) |\n"
              "| --- | ---: | ---: | ---: |\n");
  std::printf("| alone | %.4f | 100.0%% | - |\n", alone);
  std::printf("| SwapOut of 1 GiB in flight | %.4f | %.1f%% | %.2f |\n", with_out,
              100.0 * with_out / alone, out_total);
  std::printf("| SwapIn of 1 GiB in flight | %.4f | %.1f%% | %.2f |\n", with_in,
              100.0 * with_in / alone, in_total);
  std::printf("| alone (again) | %.4f | %.1f%% | - |\n", alone2, 100.0 * alone2 / alone);
  JsonRows().push_back({"decode step alone", alone * 1e3, 0, 0});
  JsonRows().push_back({"decode step, SwapOut in flight", with_out * 1e3, 0, 0});
  JsonRows().push_back({"decode step, SwapIn in flight", with_in * 1e3, 0, 0});
  if (json_out != nullptr) WriteJson(json_out);
  const KVCacheStats st = cache.Stats();
  std::printf("\nStats: host_pages_total %lld, bytes_swapped_out %lld, bytes_swapped_in %lld, "
              "bytes_exported %lld, bytes_imported %lld\n",
              static_cast<long long>(st.host_pages_total),
              static_cast<long long>(st.bytes_swapped_out),
              static_cast<long long>(st.bytes_swapped_in),
              static_cast<long long>(st.bytes_exported),
              static_cast<long long>(st.bytes_imported));
  CHECK_OK(cache.CheckInvariants());
  for (cudaEvent_t e : marks) CHECK_CUDA(cudaEventDestroy(e));
  CHECK_CUDA(cudaFree(d_k));
  CHECK_CUDA(cudaFree(d_v));
  CHECK_CUDA(cudaFree(d_q));
  CHECK_CUDA(cudaFree(d_out));
  CHECK_CUDA(cudaFree(d_ws));
  CHECK_CUDA(cudaFree(device_image));
  CHECK_CUDA(cudaFreeHost(pinned));
  CHECK_CUDA(cudaStreamDestroy(cs));
  return 0;
}

}  // namespace
}  // namespace fp4kv

int main(int argc, char** argv) {
  const char* json_out = nullptr;
  const std::string flag = "--benchmark_out=";
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]).rfind(flag, 0) == 0) json_out = argv[i] + flag.size();
  }
  return fp4kv::Main(json_out);
}
