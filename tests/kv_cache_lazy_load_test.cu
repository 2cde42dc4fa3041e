// Kernels are loaded when a KVCache (or an op) is created, never by a launch.
//
// Under CUDA's lazy module loading (forced on here, before CUDA starts) the
// first launch of a kernel in a process loads it, and a load can wait on the
// host until the device's other streams are idle. So the cache's first
// re-encode (UpdateGlobalScales with kReencode) and its first ImportHalfPages,
// each the first launch of its kernels in this process, are made while
// another stream is held by a kernel that spins until the host lets it go: a
// call that loads a kernel then waits for the hold, which a watchdog ends
// after kHoldSeconds; a call whose kernels were loaded at Create returns at
// once. scripts/build_mutants.sh builds the library without the load
// (cache_kernels_not_loaded), which this test must catch.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

// Before main, so before any CUDA call of this process.
const bool kLazyLoading = [] { return setenv("CUDA_MODULE_LOADING", "LAZY", 1) == 0; }();

constexpr double kHoldSeconds = 8.0;

__global__ void SpinUntilReleased(const volatile int32_t* released) {
  while (*released == 0) __nanosleep(10000);
}

// A stream held by SpinUntilReleased until Release() (or the watchdog).
class HeldStream {
 public:
  HeldStream() {
    ok_ = cudaHostAlloc(&flag_, sizeof(int32_t), cudaHostAllocMapped) == cudaSuccess &&
          cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) == cudaSuccess;
    if (!ok_) return;
    *flag_ = 0;
    int32_t* dev = nullptr;
    ok_ = cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), flag_, 0) == cudaSuccess;
    if (!ok_) return;
    SpinUntilReleased<<<1, 1, 0, stream_>>>(dev);
    ok_ = cudaGetLastError() == cudaSuccess;
    watchdog_ = std::thread([this] {
      const auto end =
          std::chrono::steady_clock::now() + std::chrono::duration<double>(kHoldSeconds);
      while (!released_.load() && std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      Release();
    });
  }
  ~HeldStream() {
    Release();
    if (watchdog_.joinable()) watchdog_.join();
    if (stream_ != nullptr) {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaStreamDestroy(stream_);
    }
    if (flag_ != nullptr) (void)cudaFreeHost(flag_);
  }
  bool ok() const { return ok_; }
  // Whether the hold was ended (by Release or the watchdog).
  bool released() const { return released_.load(); }
  void Release() {
    if (released_.exchange(true)) return;
    if (flag_ != nullptr) *reinterpret_cast<volatile int32_t*>(flag_) = 1;
  }

 private:
  bool ok_ = false;
  int32_t* flag_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::atomic<bool> released_{false};
  std::thread watchdog_;
};

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(KVCacheLazyLoadTest, FirstReencodeAndImportDoNotWaitForOtherStreams) {
  FP4KV_SKIP_WITHOUT_GPU();
  ASSERT_TRUE(kLazyLoading);
  constexpr int kHeads = 2, kDim = 64, kPs = 16, kTokens = 40;
  KVCacheOptions o;
  o.num_layers = 1;
  o.geometry.num_kv_heads = kHeads;
  o.geometry.head_dim_k = o.geometry.head_dim_v = kDim;
  o.geometry.page_size = kPs;
  o.geometry.num_pages = 32;
  o.k_global_scales = {0.02f};
  o.v_global_scales = {0.02f};
  o.max_seqs_per_step = 4;
  o.max_tokens_per_step = 64;
  o.device = Device::Cuda(0);
  absl::StatusOr<KVCache> c = KVCache::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  cudaStream_t s = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const Stream stream = reinterpret_cast<Stream>(s);

  // Tokens in the layer (so the scale change re-encodes), appended on s.
  const SequenceId seq = c->CreateSequence().value();
  ASSERT_TRUE(c->PrepareStep({{seq, kTokens}}, stream).ok());
  absl::StatusOr<CacheAppender> append = c->appender(DType::kF16);
  ASSERT_TRUE(append.ok()) << append.status();
  std::vector<uint16_t> rows =
      testing::RandomHalfBits(DType::kF16, int64_t{kTokens} * kHeads * kDim, 7);
  void* d_rows = nullptr;
  FP4KV_ASSERT_CUDA(cudaMalloc(&d_rows, rows.size() * 2));
  FP4KV_ASSERT_CUDA(cudaMemcpy(d_rows, rows.data(), rows.size() * 2, cudaMemcpyHostToDevice));
  const TensorView kv =
      TensorView::Contiguous(d_rows, DType::kF16, {kTokens, kHeads, kDim}, Device::Cuda(0));
  ASSERT_TRUE(append->Run(0, kv, kv, stream).ok());
  // The source of the import: two f16 pages in NHD.
  void* d_pages = nullptr;
  const int64_t page_values = int64_t{kPs} * kHeads * kDim;
  FP4KV_ASSERT_CUDA(cudaMalloc(&d_pages, 2 * 2 * page_values * 2));
  FP4KV_ASSERT_CUDA(cudaMemcpy(d_pages, rows.data(), 2 * page_values * 2, cudaMemcpyHostToDevice));
  FP4KV_ASSERT_CUDA(cudaMemcpy(static_cast<uint8_t*>(d_pages) + 2 * page_values * 2, rows.data(),
                               2 * page_values * 2, cudaMemcpyHostToDevice));
  FP4KV_ASSERT_CUDA(cudaStreamSynchronize(s));
  HalfPagedCache half;
  half.k = TensorView::Contiguous(d_pages, DType::kF16, {2, kPs, kHeads, kDim}, Device::Cuda(0));
  half.v = TensorView::Contiguous(static_cast<uint8_t*>(d_pages) + 2 * page_values * 2, DType::kF16,
                                  {2, kPs, kHeads, kDim}, Device::Cuda(0));
  half.layout = Layout::kNHD;

  double reencode_s = 0, import_s = 0;
  bool released_before_return = false;
  {
    HeldStream held;
    ASSERT_TRUE(held.ok());
    // Let the spinning kernel start.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto t0 = std::chrono::steady_clock::now();
    const absl::Status st = c->UpdateGlobalScales(0, 0.03f, 0.03f, stream, StoredTokens::kReencode);
    reencode_s = SecondsSince(t0);
    released_before_return = held.released();
    ASSERT_TRUE(st.ok()) << st;
    t0 = std::chrono::steady_clock::now();
    const int32_t src[2] = {0, 1};
    absl::StatusOr<SequenceId> imported = c->ImportHalfPages({&half, 1}, src, 2 * kPs - 3, stream);
    import_s = SecondsSince(t0);
    released_before_return = released_before_return || held.released();
    ASSERT_TRUE(imported.ok()) << imported.status();
    held.Release();
  }
  FP4KV_ASSERT_CUDA(cudaStreamSynchronize(s));
  std::printf("first re-encode: %.3f s, first ImportHalfPages: %.3f s (another stream held)\n",
              reencode_s, import_s);
  EXPECT_FALSE(released_before_return)
      << "a call waited for the held stream (re-encode " << reencode_s << " s, import " << import_s
      << " s): a kernel was loaded at its first launch";
  EXPECT_LT(reencode_s + import_s, kHoldSeconds / 2);
  FP4KV_ASSERT_CUDA(cudaFree(d_rows));
  FP4KV_ASSERT_CUDA(cudaFree(d_pages));
  FP4KV_ASSERT_CUDA(cudaStreamDestroy(s));
}

}  // namespace
}  // namespace fp4kv
