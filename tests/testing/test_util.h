// Shared test helpers: random data with the blocks that break quantizers,
// poison patterns, GPU availability and device buffers.
#ifndef FP4KV_TESTS_TESTING_TEST_UTIL_H_
#define FP4KV_TESTS_TESTING_TEST_UTIL_H_

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fp4kv/tensor.h"
#include "gtest/gtest.h"

namespace fp4kv {
namespace testing {

// True when a CUDA device is present and usable. `why` gets the reason when not.
bool HasCudaDevice(std::string* why = nullptr);

// Skips the current test with a reason when no GPU is present.
#define FP4KV_SKIP_WITHOUT_GPU()                                      \
  do {                                                                \
    std::string fp4kv_why_;                                           \
    if (!::fp4kv::testing::HasCudaDevice(&fp4kv_why_)) {              \
      GTEST_SKIP() << "needs a CUDA GPU: " << fp4kv_why_;             \
    }                                                                 \
  } while (0)

// Operations of one fuzz run: FP4KV_FUZZ_OPS from the environment (a
// positive integer; e.g. 1000000 for a long run) or `default_ops` (what CI
// runs).
int FuzzOps(int default_ops);

// Fails the test (ASSERT) when a CUDA call does not return cudaSuccess.
#define FP4KV_ASSERT_CUDA(call)                                                    \
  do {                                                                             \
    const auto fp4kv_err_ = (call);                                                \
    ASSERT_EQ(static_cast<int>(fp4kv_err_), 0) << #call << ": " << static_cast<int>(fp4kv_err_); \
  } while (0)

// Fills `n` f16 or bf16 values (as raw bits) with normal random data whose
// 16-value blocks vary in magnitude over many octaves, and where some blocks
// are all zero, all negative zero, hold one large outlier, or are tiny
// (subnormal block scales). Deterministic for a seed.
std::vector<uint16_t> RandomHalfBits(DType dtype, int64_t n, uint64_t seed);

// Random raw bytes (for packed codes and scale bytes).
std::vector<uint8_t> RandomBytes(int64_t n, uint64_t seed);

// A byte pattern that quantization never produces by chance over a whole row.
inline constexpr uint8_t kPoison = 0xA5;

// Owns device memory; test failures on CUDA errors are reported by the caller
// through ok(). Copy helpers return false on a CUDA error.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  bool ok() const { return ok_; }
  void* get() const { return ptr_; }
  size_t size() const { return bytes_; }
  bool Upload(const void* host, size_t bytes);
  bool Download(void* host, size_t bytes) const;
  bool Fill(uint8_t byte);
  template <typename T>
  bool Upload(const std::vector<T>& v) {
    return Upload(v.data(), v.size() * sizeof(T));
  }
  template <typename T>
  std::vector<T> DownloadAs(size_t count) const {
    std::vector<T> v(count);
    if (!Download(v.data(), count * sizeof(T))) v.clear();
    return v;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  bool ok_ = true;
};

// Same view pointing at `device_ptr` on CUDA device 0.
TensorView OnDevice(const TensorView& host_view, void* device_ptr);

}  // namespace testing
}  // namespace fp4kv

#endif  // FP4KV_TESTS_TESTING_TEST_UTIL_H_
