// The memory of one side of a link: device slots for the images, pinned host
// memory for frames and headers, an event per slot. Sized and checked against
// the memory available before anything is allocated (docs/kv_cache.md,
// "Allocation and budget rules").
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "src/cuda_util.h"
#include "src/host_alloc.h"
#include "src/status_macros.h"
#include "src/transfer/protocol_internal.h"

namespace fp4kv {
namespace internal {

absl::Status Buffers::Allocate(const char* call, Device device, int64_t slot_bytes, int num_slots,
                               int64_t host_bytes) {
  // Sized first (overflow-checked), then compared with what is available
  // now: nothing is allocated for a request that cannot be had.
  int64_t slots_total = 0;
  if (slot_bytes <= 0 || slot_bytes > INT64_MAX - 255 || num_slots < 1 ||
      __builtin_mul_overflow(SlotStride(slot_bytes), static_cast<int64_t>(num_slots),
                             &slots_total)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        call, ": cannot allocate ", num_slots, " slots of ", slot_bytes, " bytes (beyond int64)"));
  }
  if (host_bytes <= 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat(call, ": cannot allocate ", host_bytes, " bytes of host memory for frames"));
  }
  const int64_t host_avail = HostMemoryAvailable();
  if (device.is_cuda()) {
    DeviceScope scope(device);
    size_t free_bytes = 0, total_bytes = 0;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    const int64_t dev_avail =
        free_bytes > static_cast<size_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(free_bytes);
    if (slots_total > dev_avail) {
      return absl::ResourceExhaustedError(absl::StrCat(
          call, ": cannot allocate ", slots_total, " bytes of ", device.ToString(), " memory for ",
          num_slots, " slots of ", slot_bytes, " bytes (", dev_avail, " bytes available)"));
    }
    if (host_bytes > host_avail) {
      return absl::ResourceExhaustedError(absl::StrCat(call, ": cannot allocate ", host_bytes,
                                                       " bytes of pinned host memory for frames (",
                                                       host_avail, " bytes available)"));
    }
  } else if (slots_total > host_avail || host_bytes > host_avail - slots_total) {
    return absl::ResourceExhaustedError(
        absl::StrCat(call, ": cannot allocate ", slots_total, " bytes of host memory for ",
                     num_slots, " slots of ", slot_bytes, " bytes and ", host_bytes,
                     " bytes for frames (", host_avail, " bytes available)"));
  }

  device_ = device;
  if (device.is_cuda()) {
    DeviceScope scope(device);
    // At most 256 slots (CheckOptions): a small vector.
    events_.assign(num_slots, nullptr);
    const char* what = "slots";
    cudaError_t e = cudaMalloc(&slots_, static_cast<size_t>(slots_total));
    if (e == cudaSuccess) {
      what = "frames (pinned)";
      e = cudaMallocHost(&host_, static_cast<size_t>(host_bytes));
    }
    for (int i = 0; i < num_slots && e == cudaSuccess; ++i) {
      what = "slot events";
      e = cudaEventCreateWithFlags(&events_[i], cudaEventDisableTiming);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      Free();
      return absl::ResourceExhaustedError(
          absl::StrCat(call, ": allocating ", what, " (", num_slots, " slots of ", slot_bytes,
                       " bytes, ", host_bytes, " bytes of frames): ", cudaGetErrorString(e)));
    }
  } else {
    slots_ = std::malloc(static_cast<size_t>(slots_total));
    host_ = std::malloc(static_cast<size_t>(host_bytes));
    if (slots_ == nullptr || host_ == nullptr) {
      Free();
      return absl::ResourceExhaustedError(absl::StrCat(
          call, ": cannot allocate ", slots_total, " bytes of host memory for ", num_slots,
          " slots of ", slot_bytes, " bytes and ", host_bytes, " bytes for frames"));
    }
  }
  std::memset(host_, 0, static_cast<size_t>(host_bytes));
  // The CPU slots come from malloc (16-byte aligned); every slot is at a
  // multiple of 256 from there.
  return absl::OkStatus();
}

void Buffers::Free() {
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
  events_.clear();
  slots_ = host_ = nullptr;
}

Buffers::~Buffers() { Free(); }

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
