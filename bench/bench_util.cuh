// Shared pieces of the GPU benchmarks: GPU presence, checked CUDA calls,
// owned device memory with random fills, the median time of a launch by CUDA
// events, the device-to-device copy every case is compared with, counters,
// and a paged NVFP4 cache on the device whose every slot holds random bf16
// rows written through the Appender (the real append path).
#ifndef FP4KV_BENCH_BENCH_UTIL_CUH_
#define FP4KV_BENCH_BENCH_UTIL_CUH_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "fp4kv/format.h"
#include "fp4kv/geometry.h"
#include "fp4kv/ops.h"
#include "fp4kv/tensor.h"

namespace fp4kv {
namespace bench {

inline constexpr int kDefaultTimedRuns = 25;
// Warm-up before a case's timed runs: at least kWarmupRuns launches and at
// least kWarmupMs of the case's own work, after a process-wide warm-up
// (WarmUpGpuOnce), so that the first case of a process meets a GPU whose
// clocks have ramped up like every later case.
inline constexpr int kWarmupRuns = 3;
inline constexpr double kWarmupMs = 25.0;
inline constexpr double kProcessWarmupMs = 300.0;

inline bool HaveGpu(benchmark::State& state) {
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

inline bool FillHalves(DeviceMem& m, uint64_t seed, bool bf16) {
  FillHalvesKernel<<<1024, 256>>>(m.get<uint16_t>(), m.bytes() / 2, seed, bf16);
  return cudaDeviceSynchronize() == cudaSuccess;
}

inline bool FillBytes(DeviceMem& m, uint64_t seed, bool scales) {
  FillBytesKernel<<<1024, 256>>>(m.get(), m.bytes(), seed, scales);
  return cudaDeviceSynchronize() == cudaSuccess;
}

// Spins one thread for about `cycles` SM clocks (the stream blocker of
// MedianGpuMs).
__global__ void SpinKernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// Once a process: keeps every SM busy for about kProcessWarmupMs (spinning
// kernels on a stream of their own), so that the clocks of an idle GPU have
// ramped up before the first timed case.
inline void WarmUpGpuOnce() {
  static const bool done = [] {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    cudaStream_t w;
    if (cudaStreamCreateWithFlags(&w, cudaStreamNonBlocking) != cudaSuccess) return false;
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
               .count() < kProcessWarmupMs) {
      SpinKernel<<<4 * sms, 32, 0, w>>>(40000000);  // about 20 ms at 2 GHz
      if (cudaStreamSynchronize(w) != cudaSuccess) break;
    }
    (void)cudaStreamDestroy(w);
    return true;
  }();
  (void)done;
}

// At least kWarmupRuns launches and kWarmupMs of wall time on stream s.
template <typename F>
void WarmUp(cudaStream_t s, F&& launch) {
  WarmUpGpuOnce();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 100000; ++i) {
    launch();
    if (i + 1 < kWarmupRuns) continue;
    if (cudaStreamSynchronize(s) != cudaSuccess) return;
    if (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() >=
        kWarmupMs) {
      return;
    }
  }
}

// Median milliseconds of one launch() on stream s, timed by events around
// it, after WarmUp; with `block` each timed run first queues a spinning
// kernel (about 100 us) so that the start event and launch()'s kernels are
// already queued on a busy stream when the GPU reaches them (MedianGpuMs).
template <typename F>
double MedianEventMs(cudaStream_t s, F&& launch, int timed_runs, bool block) {
  cudaEvent_t start, stop;
  (void)cudaEventCreate(&start);
  (void)cudaEventCreate(&stop);
  WarmUp(s, launch);
  std::vector<double> ms;
  for (int r = 0; r < timed_runs; ++r) {
    if (block) SpinKernel<<<1, 1, 0, s>>>(200000);
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

// Median milliseconds of one launch() on stream s (host validation and
// launch latency inside the timed region when the stream is idle).
template <typename F>
double MedianMs(cudaStream_t s, F&& launch, int timed_runs = kDefaultTimedRuns) {
  return MedianEventMs(s, launch, timed_runs, false);
}

// The same with the host's share taken out: what is timed is the GPU's own
// time for the op, launch gaps between its kernels included (what a captured
// graph or a busy stream sees), without the host's validation and launch
// latency. Valid when launch() enqueues in well under 100 us (the op benches
// do).
template <typename F>
double MedianGpuMs(cudaStream_t s, F&& launch, int timed_runs = kDefaultTimedRuns) {
  return MedianEventMs(s, launch, timed_runs, true);
}

// GB/s of a 2 GiB device-to-device copy (bytes = read + write), measured
// once per process; 0 when it could not be measured.
inline double CopyGBps() {
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

inline void Report(benchmark::State& state, double ms, double bytes) {
  state.SetIterationTime(ms * 1e-3);
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  state.counters["bytes"] = bytes;
  state.counters["GBps"] = gbps;
  state.counters["median_us"] = ms * 1e3;
  const double copy = CopyGBps();
  state.counters["pct_of_copy"] = copy > 0 ? 100.0 * gbps / copy : 0.0;
}

// Report plus the GPU-only time of the same op (MedianGpuMs): counters
// gpu_us, gpu_GBps, gpu_pct_of_copy beside the eager ones.
template <typename F>
void ReportWithGpu(benchmark::State& state, cudaStream_t s, F&& launch, double bytes) {
  Report(state, MedianMs(s, launch), bytes);
  const double gpu_ms = MedianGpuMs(s, launch);
  const double gbps = bytes / (gpu_ms * 1e-3) / 1e9;
  state.counters["gpu_us"] = gpu_ms * 1e3;
  state.counters["gpu_GBps"] = gbps;
  const double copy = CopyGBps();
  state.counters["gpu_pct_of_copy"] = copy > 0 ? 100.0 * gbps / copy : 0.0;
}

// Writes every slot of `view` (g.num_pages * g.page_size tokens) with random
// bf16 K/V rows through an Appender (slot indexing), in chunks; the global
// scales (0.1) hold the rows' magnitudes (up to 32) for NVFP4 and FP8 keys.
inline bool AppendRandomRows(const CacheGeometry& g, const PagedCache& view, uint64_t seed) {
  constexpr int64_t kChunk = 32768;
  const int64_t total = g.num_pages * g.page_size;
  const int64_t chunk = std::min(kChunk, total);
  const Device d = Device::Cuda(0);
  auto op = Appender::Create({g, DType::kBF16, AppendIndexing::kSlot, Recipe(), d});
  if (!op.ok()) return false;
  DeviceMem k, v, slots;
  if (!k.Alloc(chunk * g.num_kv_heads * g.head_dim_k * 2) ||
      !v.Alloc(chunk * g.num_kv_heads * g.head_dim_v * 2) || !slots.Alloc(chunk * 8) ||
      !FillHalves(k, seed, true) || !FillHalves(v, seed + 1, true)) {
    return false;
  }
  std::vector<int64_t> slot(chunk);
  for (int64_t at = 0; at < total; at += chunk) {
    const int64_t n = std::min(chunk, total - at);
    for (int64_t i = 0; i < chunk; ++i) slot[i] = i < n ? at + i : -1;
    if (!slots.Upload(slot)) return false;
    AppendArgs a;
    a.key = TensorView::Contiguous(k.get(), DType::kBF16, {chunk, g.num_kv_heads, g.head_dim_k}, d);
    a.value =
        TensorView::Contiguous(v.get(), DType::kBF16, {chunk, g.num_kv_heads, g.head_dim_v}, d);
    a.slot_mapping = TensorView::Contiguous(slots.get(), DType::kI64, {chunk}, d);
    a.k_scale = GlobalScale::Value(0.1f);
    a.v_scale = GlobalScale::Value(0.1f);
    if (!op->Run(a, view, nullptr).ok() || cudaDeviceSynchronize() != cudaSuccess) return false;
    // The next chunk's rows differ: refill from another seed.
    if (at + chunk < total &&
        (!FillHalves(k, seed + 2 + 2 * (at / chunk), true) ||
         !FillHalves(v, seed + 3 + 2 * (at / chunk), true))) {
      return false;
    }
  }
  return true;
}

// A paged cache in device memory (tuple form): random bytes, then every
// slot written with random rows through the Appender (AppendRandomRows).
struct DeviceCache {
  CacheGeometry g;
  DeviceMem k_data, v_data, k_scales, v_scales;

  bool Init(const CacheGeometry& geometry, uint64_t seed) {
    g = geometry;
    const size_t rows = static_cast<size_t>(g.num_pages) * g.page_size * g.num_kv_heads;
    return k_data.Alloc(rows * g.head_dim_k / 2) && v_data.Alloc(rows * g.head_dim_v / 2) &&
           k_scales.Alloc(rows * g.head_dim_k / 16) && v_scales.Alloc(rows * g.head_dim_v / 16) &&
           FillBytes(k_data, seed, false) && FillBytes(v_data, seed + 1, false) &&
           FillBytes(k_scales, seed + 2, true) && FillBytes(v_scales, seed + 3, true) &&
           AppendRandomRows(g, View(), seed + 4);
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
  double Bytes(int64_t tokens) const {
    return static_cast<double>(tokens) * g.num_kv_heads * (g.head_dim_k + g.head_dim_v) *
           (0.5 + 1.0 / 16);
  }
};

}  // namespace bench
}  // namespace fp4kv

#endif  // FP4KV_BENCH_BENCH_UTIL_CUH_
