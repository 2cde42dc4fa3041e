// KVCache's copy engine: the copy stream, its ordering events and the pool
// of copy events (copy_engine.h).
#include "src/kv_cache/copy_engine.h"

#include <atomic>

#include "src/cuda_util.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {

namespace {
std::atomic<int> g_fail_after[2] = {0, 0};  // copy batches, step uploads
}  // namespace

void FailCopyForTesting(int n, bool upload) {
  g_fail_after[upload ? 1 : 0].store(n > 0 ? n : 0, std::memory_order_relaxed);
}

bool CopyFailsForTesting(bool upload) {
  std::atomic<int>& c = g_fail_after[upload ? 1 : 0];
  int v = c.load(std::memory_order_relaxed);
  while (v > 0) {
    if (c.compare_exchange_weak(v, v - 1, std::memory_order_relaxed)) return v == 1;
  }
  return false;
}

CopyEngine::~CopyEngine() {
  if (stream_ == nullptr) return;
  ScopedDevice d;
  (void)d.Set(Device::Cuda(ordinal_));
  (void)cudaStreamSynchronize(stream_);
  for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
  if (ready_ != nullptr) (void)cudaEventDestroy(ready_);
  if (drained_ != nullptr) (void)cudaEventDestroy(drained_);
  (void)cudaStreamDestroy(stream_);
}

absl::Status CopyEngine::Init(int ordinal) {
  if (stream_ != nullptr) return absl::OkStatus();
  ordinal_ = ordinal;
  // The events first: the destructor frees whatever was created.
  FP4KV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  FP4KV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&drained_, cudaEventDisableTiming));
  FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  return absl::OkStatus();
}

absl::Status CopyEngine::After(Stream stream) {
  if (CopyFailsForTesting(false)) return absl::InternalError("copy engine: injected failure");
  FP4KV_CUDA_RETURN_IF_ERROR(cudaEventRecord(ready_, reinterpret_cast<cudaStream_t>(stream)));
  return CudaStatus(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent(copy stream)");
}

absl::Status CopyEngine::Upload(void* dst, const void* src, size_t bytes) {
  return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_),
                    "cudaMemcpyAsync(copy stream)");
}

absl::Status CopyEngine::OrderAfterAll(Stream stream) {
  if (stream_ == nullptr) return absl::OkStatus();
  FP4KV_CUDA_RETURN_IF_ERROR(cudaEventRecord(drained_, stream_));
  return CudaStatus(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), drained_, 0),
                    "cudaStreamWaitEvent(copy stream)");
}

absl::Status CopyEngine::Synchronize() const {
  if (stream_ == nullptr) return absl::OkStatus();
  return CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize(copy stream)");
}

absl::Status CopyEngine::Take(int* e) {
  if (free_.empty()) {
    cudaEvent_t ev = nullptr;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    events_.push_back(ev);
    refs_.push_back(0);
    order_.push_back(0);
    free_.push_back(static_cast<int>(events_.size()) - 1);
  }
  *e = free_.back();
  free_.pop_back();
  return absl::OkStatus();
}

absl::Status CopyEngine::Record(int e) {
  FP4KV_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[e], stream_));
  order_[e] = ++copies_;
  return absl::OkStatus();
}

void CopyEngine::Free(int e) { free_.push_back(e); }

void CopyEngine::Release(int e) {
  if (e >= 0 && --refs_[e] == 0) free_.push_back(e);
}

absl::Status CopyEngine::Wait(int e) const {
  return CudaStatus(cudaEventSynchronize(events_[e]), "cudaEventSynchronize(copy)");
}

absl::Status CopyEngine::StreamWait(Stream stream, int e) const {
  return CudaStatus(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), events_[e], 0),
                    "cudaStreamWaitEvent(copy)");
}

cudaError_t CopyEngine::Query(int e) const { return cudaEventQuery(events_[e]); }

}  // namespace internal
}  // namespace fp4kv
