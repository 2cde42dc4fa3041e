// The memory of one side of a link: device slots for the images, pinned host
// memory for frames and headers, an event per slot.
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"
#include "src/transfer/protocol_internal.h"

namespace fp4kv {
namespace internal {

absl::Status Buffers::Allocate(Device device, int64_t slot_bytes, int num_slots,
                               int64_t host_bytes) {
  device_ = device;
  if (device.is_cuda()) {
    int prev = 0;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&prev));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaSetDevice(device.ordinal));
    cudaError_t e = cudaMalloc(&slots_, static_cast<size_t>(slot_bytes) * num_slots);
    if (e == cudaSuccess) e = cudaMallocHost(&host_, static_cast<size_t>(host_bytes));
    events_.assign(num_slots, nullptr);
    for (int i = 0; i < num_slots && e == cudaSuccess; ++i) {
      e = cudaEventCreateWithFlags(&events_[i], cudaEventDisableTiming);
    }
    cudaSetDevice(prev);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat("transfer: allocating ", num_slots,
                                                       " slots of ", slot_bytes,
                                                       " bytes: ", cudaGetErrorString(e)));
    }
  } else {
    slots_ = std::malloc(static_cast<size_t>(slot_bytes) * num_slots);
    host_ = std::malloc(static_cast<size_t>(host_bytes));
    if (slots_ == nullptr || host_ == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("transfer: allocating ", num_slots, " slots of ", slot_bytes, " bytes"));
    }
  }
  std::memset(host_, 0, static_cast<size_t>(host_bytes));
  // The CPU slots come from malloc (16-byte aligned); every slot is at a
  // multiple of 256 from there.
  return absl::OkStatus();
}

Buffers::~Buffers() {
  if (device_.is_cuda()) {
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (slots_ != nullptr) cudaFree(slots_);
    if (host_ != nullptr) cudaFreeHost(host_);
  } else {
    std::free(slots_);
    std::free(host_);
  }
}

absl::StatusOr<bool> EventDone(cudaEvent_t ev) {
  if (ev == nullptr) return true;
  cudaError_t e = cudaEventQuery(ev);
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) return false;
  cudaGetLastError();
  return CudaStatus(e, "cudaEventQuery");
}

}  // namespace internal
}  // namespace fp4kv
