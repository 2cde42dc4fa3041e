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
    // No driver or no device: say so in plain words, the CUDA error after.
    const bool no_gpu = err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver;
    return absl::FailedPreconditionError(absl::StrCat(
        "device: expected a usable CUDA device for ", device.ToString(), ", got ",
        no_gpu ? "no GPU on this machine" : "a CUDA runtime error", " (cudaGetDeviceCount: ",
        cudaGetErrorName(err), ")"));
  }
  if (device.ordinal >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device: expected a CUDA ordinal < ", count, " (the devices present), got ",
        device.ToString()));
  }
  return absl::OkStatus();
}

absl::Status Sm90aKernelsRun(int ordinal, bool* yes) {
  *yes = false;
#if defined(FP4KV_HAVE_SM90A)
  int major = 0, minor = 0;
  if (const cudaError_t err =
          cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal);
      err != cudaSuccess) {
    return CudaStatus(err, "cudaDeviceGetAttribute(major)");
  }
  if (const cudaError_t err =
          cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal);
      err != cudaSuccess) {
    return CudaStatus(err, "cudaDeviceGetAttribute(minor)");
  }
  *yes = major == 9 && minor == 0;
#else
  (void)ordinal;
#endif
  return absl::OkStatus();
}

absl::Status LoadKernel(const void* fn, const char* what) {
  cudaFuncAttributes attributes;
  const cudaError_t err = cudaFuncGetAttributes(&attributes, fn);
  return CudaStatus(err, what);
}

}  // namespace internal
}  // namespace fp4kv
