#include "testing/test_util.h"

#include <climits>
#include <cstdlib>

#include <cuda_runtime_api.h>

#include <cmath>

#include "fp4kv/format.h"

namespace fp4kv {
namespace testing {

bool HasCudaDevice(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(err);
    return false;
  }
  if (count == 0) {
    if (why) *why = "no CUDA devices present";
    return false;
  }
  return true;
}

std::vector<uint16_t> RandomHalfBits(DType dtype, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 99);
  std::uniform_int_distribution<int> octave(-12, 6);
  std::uniform_int_distribution<int> lane(0, 15);
  std::vector<uint16_t> out(n);
  auto enc = [&](float x) { return dtype == DType::kF16 ? FloatToHalfBits(x) : FloatToBf16Bits(x); };
  for (int64_t b = 0; b < n; b += 16) {
    const int k = kind(rng);
    const float mag = std::ldexp(1.0f, octave(rng));
    const int outlier = lane(rng);
    for (int64_t i = b; i < b + 16 && i < n; ++i) {
      float x;
      if (k < 3) {
        x = 0.0f;
      } else if (k < 5) {
        x = -0.0f;
      } else if (k < 10) {
        x = (i - b == outlier) ? 40.0f * mag : 0.01f * mag * normal(rng);
      } else if (k < 14) {
        x = 1e-5f * normal(rng);  // tiny block: subnormal block scale
      } else {
        x = mag * normal(rng);
      }
      out[i] = enc(x);
    }
  }
  return out;
}

std::vector<uint8_t> RandomBytes(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  ok_ = cudaMalloc(&ptr_, bytes == 0 ? 16 : bytes) == cudaSuccess;
  if (!ok_) ptr_ = nullptr;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) (void)cudaFree(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_), ok_(o.ok_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    ok_ = o.ok_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

bool DeviceBuffer::Upload(const void* host, size_t bytes) {
  return ok_ && bytes <= bytes_ && cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice) == cudaSuccess;
}

bool DeviceBuffer::Download(void* host, size_t bytes) const {
  return ok_ && bytes <= bytes_ && cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost) == cudaSuccess;
}

bool DeviceBuffer::Fill(uint8_t byte) {
  return ok_ && cudaMemset(ptr_, byte, bytes_) == cudaSuccess;
}

TensorView OnDevice(const TensorView& host_view, void* device_ptr) {
  TensorView v = host_view;
  v.data = device_ptr;
  v.device = Device::Cuda(0);
  return v;
}

int FuzzOps(int default_ops) {
  const char* v = std::getenv("FP4KV_FUZZ_OPS");
  if (v == nullptr || *v == '\0') return default_ops;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (*end != '\0' || n < 1 || n > INT32_MAX) {
    ADD_FAILURE() << "FP4KV_FUZZ_OPS: expected a positive integer, got " << v;
    return default_ops;
  }
  return static_cast<int>(n);
}

}  // namespace testing
}  // namespace fp4kv
