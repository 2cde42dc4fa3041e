#include "src/cuda_util.h"

#include "absl/strings/str_cat.h"

namespace fp4kv {
namespace internal {

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

absl::Status CheckDeviceAvailable(const Device& device) {
  if (device.type == DeviceType::kCPU) return absl::OkStatus();
  if (device.ordinal < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: expected a CUDA ordinal >= 0, got ", device.ordinal));
  }
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return absl::FailedPreconditionError(absl::StrCat("device ", device.ToString(),
                                                      ": no usable CUDA device (cudaGetDeviceCount: ",
                                                      cudaGetErrorName(err), ")"));
  }
  if (device.ordinal >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device ", device.ToString(), ": expected an ordinal < ", count, " (CUDA devices present)"));
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace fp4kv
