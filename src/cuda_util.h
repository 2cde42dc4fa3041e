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

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_CUDA_UTIL_H_
