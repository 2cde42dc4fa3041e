// Internal (KVCache): the copy engine. Copies between the pools and the host
// tiers (swap, prefix demotion and promotion) run on one copy stream, in
// order. A copy that someone must wait for is followed by an event from a
// pool; the event is referenced by its holders (sequences whose pages it
// fills, the latest promotion) and knows its place in copy-stream order, so
// a later event covers an earlier one. Nothing outside this class touches the
// stream or the events.
#ifndef FP4KV_SRC_KV_CACHE_COPY_ENGINE_H_
#define FP4KV_SRC_KV_CACHE_COPY_ENGINE_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "fp4kv/ops.h"

namespace fp4kv {
namespace internal {

// Tests only: the next `n`-th call (1: the next) of CopyEngine::After, which
// starts every copy batch on the copy stream, or of the step upload (`upload`
// true) fails with an Internal error before it enqueues anything, as a CUDA
// error there would (0: none, the default). Process-wide.
void FailCopyForTesting(int n, bool upload = false);
// Whether this call of the hooked site fails (counts the calls down).
bool CopyFailsForTesting(bool upload);

class CopyEngine {
 public:
  CopyEngine() = default;
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Creates the copy stream and its two ordering events on CUDA device
  // `ordinal` (the current device). A second call does nothing.
  absl::Status Init(int ordinal);
  // Whether Init ran (a CUDA cache with a host tier of either kind).
  bool active() const { return stream_ != nullptr; }
  // The copy stream as a Stream, for launches on it.
  Stream stream() const { return reinterpret_cast<Stream>(stream_); }

  // Makes the copy stream wait for the work enqueued on `stream` so far.
  absl::Status After(Stream stream);
  // Copies `bytes` of pageable host memory to the device on the copy stream
  // (staged before the call returns).
  absl::Status Upload(void* dst, const void* src, size_t bytes);
  // Makes `stream` wait for everything enqueued on the copy stream so far
  // (nothing when inactive).
  absl::Status OrderAfterAll(Stream stream);
  // Waits on the host for everything enqueued on the copy stream.
  absl::Status Synchronize() const;

  // --- events
  // A free event (no holders), created when none is free.
  absl::Status Take(int* e);
  // Records event e after the copies enqueued so far; it then comes later in
  // copy-stream order than every event recorded before.
  absl::Status Record(int e);
  // Gives back an event nobody holds (a failed copy, one a later covers).
  void Free(int e);
  // Holder references: an event goes back to the pool when its last holder
  // releases it (-1: none).
  void Hold(int e) { ++refs_[e]; }
  void Release(int e);
  // Whether event a was recorded after (or is) event b.
  bool NotBefore(int a, int b) const { return order_[a] >= order_[b]; }
  // Waits on the host for event e; makes `stream` wait for it; whether it
  // completed (cudaEventQuery: cudaSuccess, cudaErrorNotReady or an error).
  absl::Status Wait(int e) const;
  absl::Status StreamWait(Stream stream, int e) const;
  cudaError_t Query(int e) const;

 private:
  int ordinal_ = -1;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;    // recorded on a caller's stream, waited by the copy stream
  cudaEvent_t drained_ = nullptr;  // recorded on the copy stream, waited by a caller's
  std::vector<cudaEvent_t> events_;
  std::vector<int> free_;
  std::vector<int> refs_;
  // Per event: the copy-stream order of the copy it was last recorded after.
  std::vector<uint64_t> order_;
  uint64_t copies_ = 0;  // events recorded
};

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_KV_CACHE_COPY_ENGINE_H_
