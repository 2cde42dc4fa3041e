// Internal: what the two sides of the transfer protocol share (sender.cc,
// receiver.cc): the option checks, the clock of the timeouts, the current
// device, the slot and frame memory of one side, and the moved-from check.
#ifndef FP4KV_SRC_TRANSFER_PROTOCOL_INTERNAL_H_
#define FP4KV_SRC_TRANSFER_PROTOCOL_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp4kv/transfer.h"
#include "src/transfer/transfer_internal.h"

namespace fp4kv {
namespace internal {

inline int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The options, the transport and the cache agree (InvalidArgument naming the
// option otherwise).
absl::Status CheckOptions(const TransferOptions& o, const Transport* t,
                          const TransferCachePort* port);

// Makes a CUDA device current for a scope (the protocol's calls may come
// with another device current, e.g. one thread driving both ranks).
class DeviceScope {
 public:
  explicit DeviceScope(Device d) : active_(d.is_cuda()) {
    if (active_ && cudaGetDevice(&prev_) == cudaSuccess && prev_ != d.ordinal) {
      cudaSetDevice(d.ordinal);
    } else {
      active_ = false;
    }
  }
  ~DeviceScope() {
    if (active_) cudaSetDevice(prev_);
  }

 private:
  bool active_;
  int prev_ = 0;
};

// Slots start 256-byte aligned (images are written with 16-byte accesses).
inline int64_t SlotStride(int64_t slot_bytes) { return (slot_bytes + 255) / 256 * 256; }

// Device memory for the slots, pinned host memory for frames and headers
// (CPU device: both host memory).
class Buffers {
 public:
  // num_slots slots of SlotStride(slot_bytes) bytes and host_bytes of frames.
  // The sizes are overflow-checked and compared with the memory available
  // now (cudaMemGetInfo for the slots of a CUDA link, HostMemoryAvailable()
  // for host memory) first: ResourceExhausted naming `call`, the buffer and
  // the bytes asked and available, with nothing left allocated.
  absl::Status Allocate(const char* call, Device device, int64_t slot_bytes, int num_slots,
                        int64_t host_bytes);
  ~Buffers();
  void Free();
  void* slots_ = nullptr;
  void* host_ = nullptr;
  std::vector<cudaEvent_t> events_;  // per slot (CUDA)
  Device device_;
};

// True once `ev` completed (CPU: always).
absl::StatusOr<bool> EventDone(cudaEvent_t ev);

}  // namespace internal
}  // namespace fp4kv

// The public calls of a moved-from SequenceSender / SequenceReceiver.
#define FP4KV_TRANSFER_RETURN_IF_MOVED_FROM()          \
  do {                                                 \
    if (impl_ == nullptr) {                            \
      return absl::FailedPreconditionError(            \
          "transfer: expected a live object, got one " \
          "that was moved from");                      \
    }                                                  \
  } while (0)

#endif  // FP4KV_SRC_TRANSFER_PROTOCOL_INTERNAL_H_
