// Decode attention straight from NVFP4 pages on the GPU, against a
// device-to-device copy measured in the same process (bench/kernels_bench.cu
// conventions: CUDA events on a dedicated stream, a few warm-up runs, the
// median of kTimedRuns timed runs).
//
// Shapes: 32 qo heads over 8 KV heads (group 4), head_dim 128, page size 16,
// bf16 q/out, NHD tuple pools of random bytes (finite block scales), every
// request's pages a random permutation of the pool. When one case's cache is
// smaller than 256 MB, several disjoint page sets (one block table each) are
// rotated through the timed runs so L2 (50 MB on H200) never holds a case.
// Counters per case:
//   bytes          NVFP4 K + V codes and scales of the attended tokens, plus
//                  q and out (the traffic a perfect kernel needs)
//   GBps           bytes / median time
//   pct_of_copy    GBps as a percentage of the copy's GBps
//   median_us      the median time of one Run() (attention + merge kernels)
//   partial_bytes  split-KV partials written and read back (not in bytes),
//                  from the same schedule the kernel derives on the device
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "fp4kv/attention.h"
#include "fp4kv/format.h"
#include "fp4kv/geometry.h"
#include "fp4kv/ops.h"
#include "fp4kv/tensor.h"
#include "kernels/attention.cuh"

namespace fp4kv {
namespace {

constexpr int kTimedRuns = 51;
constexpr int kWarmupRuns = 3;

bool HaveGpu(benchmark::State& state) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    state.SkipWithError("no CUDA device");
    return false;
  }
  return true;
}

#define BENCH_CHECK(state, cond, what) \
  do {                                 \
    if (!(cond)) {                     \
      (state).SkipWithError(what);     \
      return;                          \
    }                                  \
  } while (0)

#define BENCH_CUDA(state, call) BENCH_CHECK(state, (call) == cudaSuccess, #call " failed")

// Device memory owned for the length of one benchmark.
class DeviceMem {
 public:
  DeviceMem() = default;
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  ~DeviceMem() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  bool Alloc(size_t bytes) {
    bytes_ = bytes;
    return cudaMalloc(&ptr_, bytes == 0 ? 16 : bytes) == cudaSuccess;
  }
  template <typename T = uint8_t>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }
  template <typename T>
  bool Upload(const std::vector<T>& v) {
    return cudaMemcpy(ptr_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

__device__ uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// Random f16/bf16 values: magnitudes over 2^-8..2^4 per 16-value block, signs
// random, never zero.
__global__ void FillHalvesKernel(uint16_t* p, size_t n, uint64_t seed, bool bf16) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint64_t h = Mix(seed ^ (i * 0x9e3779b97f4a7c15ull));
    const int octave = static_cast<int>(Mix(seed + i / 16) % 13) - 8;
    const float m = 1.0f + static_cast<float>(h & 0xffff) / 65536.0f;
    float x = ldexpf(m, octave - static_cast<int>((h >> 16) & 3));
    if ((h >> 20) & 1) x = -x;
    p[i] = bf16 ? FloatToBf16Bits(x) : FloatToHalfBits(x);
  }
}

// Random bytes; with `scales` in [1, 0x7e] (finite, nonzero block scales).
__global__ void FillBytesKernel(uint8_t* p, size_t n, uint64_t seed, bool scales) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint64_t h = Mix(seed ^ (i * 0x9e3779b97f4a7c15ull));
    p[i] = scales ? static_cast<uint8_t>(1 + h % 0x7e) : static_cast<uint8_t>(h);
  }
}

bool FillHalves(DeviceMem& m, uint64_t seed, bool bf16) {
  FillHalvesKernel<<<1024, 256>>>(m.get<uint16_t>(), m.bytes() / 2, seed, bf16);
  return cudaDeviceSynchronize() == cudaSuccess;
}

bool FillBytes(DeviceMem& m, uint64_t seed, bool scales) {
  FillBytesKernel<<<1024, 256>>>(m.get(), m.bytes(), seed, scales);
  return cudaDeviceSynchronize() == cudaSuccess;
}

// Median milliseconds of one launch() on stream s.
template <typename F>
double MedianMs(cudaStream_t s, F&& launch) {
  cudaEvent_t start, stop;
  (void)cudaEventCreate(&start);
  (void)cudaEventCreate(&stop);
  for (int i = 0; i < kWarmupRuns; ++i) launch();
  std::vector<double> ms;
  for (int r = 0; r < kTimedRuns; ++r) {
    (void)cudaEventRecord(start, s);
    launch();
    (void)cudaEventRecord(stop, s);
    (void)cudaEventSynchronize(stop);
    float t = 0;
    (void)cudaEventElapsedTime(&t, start, stop);
    ms.push_back(static_cast<double>(t));
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// GB/s of a 2 GiB device-to-device copy (bytes = read + write), measured
// once per process; 0 when it could not be measured.
double CopyGBps() {
  static const double gbps = [] {
    constexpr size_t kBytes = size_t{2} << 30;
    DeviceMem a, b;
    if (!a.Alloc(kBytes) || !b.Alloc(kBytes)) return 0.0;
    (void)cudaMemset(a.get(), 0x5a, kBytes);
    cudaStream_t s;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return 0.0;
    const double ms = MedianMs(
        s, [&] { (void)cudaMemcpyAsync(b.get(), a.get(), kBytes, cudaMemcpyDeviceToDevice, s); });
    (void)cudaStreamDestroy(s);
    return 2.0 * kBytes / (ms * 1e-3) / 1e9;
  }();
  return gbps;
}

void Report(benchmark::State& state, double ms, double bytes) {
  state.SetIterationTime(ms * 1e-3);
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  state.counters["bytes"] = bytes;
  state.counters["GBps"] = gbps;
  state.counters["median_us"] = ms * 1e3;
  const double copy = CopyGBps();
  state.counters["pct_of_copy"] = copy > 0 ? 100.0 * gbps / copy : 0.0;
}

// A paged cache in device memory (tuple form), random content.
struct DeviceCache {
  CacheGeometry g;
  DeviceMem k_data, v_data, k_scales, v_scales;

  bool Init(const CacheGeometry& geometry, uint64_t seed) {
    g = geometry;
    const size_t rows = static_cast<size_t>(g.num_pages) * g.page_size * g.num_kv_heads;
    return k_data.Alloc(rows * g.head_dim_k / 2) && v_data.Alloc(rows * g.head_dim_v / 2) &&
           k_scales.Alloc(rows * g.head_dim_k / 16) && v_scales.Alloc(rows * g.head_dim_v / 16) &&
           FillBytes(k_data, seed, false) && FillBytes(v_data, seed + 1, false) &&
           FillBytes(k_scales, seed + 2, true) && FillBytes(v_scales, seed + 3, true);
  }
  PagedCache View() const {
    const Device d = Device::Cuda(0);
    const int64_t a = g.layout == Layout::kNHD ? g.page_size : g.num_kv_heads;
    const int64_t b = g.layout == Layout::kNHD ? g.num_kv_heads : g.page_size;
    return PagedCache::FromTuple(
        TensorView::Contiguous(k_data.get(), DType::kU8, {g.num_pages, a, b, g.head_dim_k / 2}, d),
        TensorView::Contiguous(v_data.get(), DType::kU8, {g.num_pages, a, b, g.head_dim_v / 2}, d),
        TensorView::Contiguous(k_scales.get(), DType::kE4M3, {g.num_pages, a, b, g.head_dim_k / 16},
                               d),
        TensorView::Contiguous(v_scales.get(), DType::kE4M3, {g.num_pages, a, b, g.head_dim_v / 16},
                               d),
        g.layout);
  }
};

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
// rounded to 16); head dim 128.
double PartialBytes(int num_sms, int batch, int len, int kv_heads, int rows, int d) {
  const int64_t ctas = static_cast<int64_t>(num_sms) * kernels::AttnConfig<128>::kCtasPerSm;
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

// args: batch, seq_len, q_len.
void BM_DecodeAttention(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const int batch = static_cast<int>(state.range(0));
  const int len = static_cast<int>(state.range(1));
  const int q_len = static_cast<int>(state.range(2));
  constexpr int kKvHeads = 8, kQoHeads = 32, kDim = 128, kPage = 16;
  const int pages_per_seq = (len + kPage - 1) / kPage;
  const int64_t pages_needed = static_cast<int64_t>(batch) * pages_per_seq;
  CacheGeometry g;
  g.num_kv_heads = kKvHeads;
  g.head_dim_k = g.head_dim_v = kDim;
  g.page_size = kPage;
  g.layout = Layout::kNHD;
  const double bytes_per_page = static_cast<double>(g.PageBytes());
  const int rotations = static_cast<int>(
      std::max(1.0, std::ceil(256e6 / (bytes_per_page * static_cast<double>(pages_needed)))));
  g.num_pages = pages_needed * rotations;
  DeviceCache cache;
  BENCH_CHECK(state, cache.Init(g, 7), "cache allocation");

  const int64_t total_q = static_cast<int64_t>(batch) * q_len;
  DeviceMem q, out, tables, lens, indptr, ws;
  BENCH_CHECK(state, q.Alloc(total_q * kQoHeads * kDim * 2) && FillHalves(q, 11, true),
              "q allocation");
  BENCH_CHECK(state, out.Alloc(total_q * kQoHeads * kDim * 2), "out allocation");
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
  o.num_qo_heads = kQoHeads;
  o.dtype = DType::kBF16;
  o.table_dtype = DType::kI32;
  o.max_batch = batch;
  o.max_pages_per_seq = pages_per_seq;
  o.max_q_len = q_len;
  o.device = d;
  auto op = DecodeAttention::Create(o);
  BENCH_CHECK(state, op.ok(), "DecodeAttention::Create");
  BENCH_CHECK(state, ws.Alloc(static_cast<size_t>(std::max<int64_t>(op->WorkspaceBytes(), 256))),
              "workspace");
  DecodeAttentionArgs a;
  a.q = TensorView::Contiguous(q.get(), DType::kBF16, {total_q, kQoHeads, kDim}, d);
  if (q_len > 1) a.q_indptr = TensorView::Contiguous(indptr.get(), DType::kI32, {batch + 1}, d);
  a.seq_lens = TensorView::Contiguous(lens.get(), DType::kI32, {batch}, d);
  a.out = TensorView::Contiguous(out.get(), DType::kBF16, {total_q, kQoHeads, kDim}, d);
  a.k_scale = GlobalScale::Value(0.01f);
  a.v_scale = GlobalScale::Value(0.01f);
  const PagedCache view = cache.View();
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
  const double bytes = kv_bytes + 2.0 * total_q * kQoHeads * kDim * 2;
  for (auto _ : state) Report(state, MedianMs(s, [&] { (void)run(); }), bytes);
  state.counters["partial_bytes"] =
      PartialBytes(num_sms, batch, len, kKvHeads, (kQoHeads / kKvHeads) * q_len, kDim);
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  BENCH_CUDA(state, cudaGetLastError());
  (void)cudaStreamDestroy(s);
}
BENCHMARK(BM_DecodeAttention)
    ->ArgNames({"batch", "seq_len", "q_len"})
    ->Args({64, 4096, 1})
    ->Args({256, 2048, 1})
    ->Args({8, 16384, 1})
    ->Args({128, 512, 1})
    ->Args({1, 32768, 1})
    ->Args({64, 4096, 4})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace fp4kv

BENCHMARK_MAIN();
