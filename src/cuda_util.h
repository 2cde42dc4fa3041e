// Internal: CUDA errors become a Status once, at the boundary, naming the call.
#ifndef FP4KV_SRC_CUDA_UTIL_H_
#define FP4KV_SRC_CUDA_UTIL_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "fp4kv/tensor.h"

namespace fp4kv {
namespace internal {

// OK for cudaSuccess; otherwise Internal naming `what` and the CUDA error.
absl::Status CudaStatus(cudaError_t err, const char* what);

// FailedPrecondition unless `device` is the CPU or a CUDA ordinal that exists.
absl::Status CheckDeviceAvailable(const Device& device);

// Whether this library's sm_90a kernels (wgmma, TMA) can run on CUDA device
// `ordinal`: the build has sm_90a code (FP4KV_HAVE_SM90A) and the device is
// compute capability 9.0. An error only when the attribute query fails.
absl::Status Sm90aKernelsRun(int ordinal, bool* yes);

// Loads kernel `fn` (a __global__ function's address) on the current device,
// so that no later launch of it pays CUDA's lazy module loading: a first
// launch that loads its kernel can wait on the host for the device's other
// streams (docs/kv_cache.md, "Kernels are loaded at Create"). The query that
// loads it, cudaFuncGetAttributes, is a host call: no device work, no sync.
// `what` names the kernel in the error.
absl::Status LoadKernel(const void* fn, const char* what);
template <class Kernel>
absl::Status LoadKernel(Kernel* fn, const char* what) {
  return LoadKernel(reinterpret_cast<const void*>(fn), what);
}

// Makes `device` current for a scope (CUDA only) and restores the previous
// device at exit.
class ScopedDevice {
 public:
  ScopedDevice() = default;
  absl::Status Set(const Device& device) {
    if (!device.is_cuda()) return absl::OkStatus();
    if (const cudaError_t err = cudaGetDevice(&previous_); err != cudaSuccess) {
      return CudaStatus(err, "cudaGetDevice");
    }
    if (previous_ != device.ordinal) {
      if (const cudaError_t err = cudaSetDevice(device.ordinal); err != cudaSuccess) {
        return CudaStatus(err, "cudaSetDevice");
      }
      changed_ = true;
    }
    return absl::OkStatus();
  }
  ~ScopedDevice() {
    if (changed_) (void)cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};


}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_CUDA_UTIL_H_
