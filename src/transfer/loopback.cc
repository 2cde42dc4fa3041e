// LoopbackTransport: two in-process endpoints that pair their k-th
// operations the way NCCL pairs sends and receives, so a protocol that runs
// here posts sequences that also match over NCCL.
#include <cuda_runtime_api.h>

#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "fp4kv/transfer.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace {

struct Event {
  cudaEvent_t ev = nullptr;
  ~Event() {
    if (ev != nullptr) cudaEventDestroy(ev);
  }
};

absl::StatusOr<std::shared_ptr<Event>> MakeEvent(Stream stream) {
  auto e = std::make_shared<Event>();
  FP4KV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e->ev, cudaEventDisableTiming));
  FP4KV_CUDA_RETURN_IF_ERROR(cudaEventRecord(e->ev, stream));
  return e;
}

}  // namespace

struct LoopbackTransport::Shared {
  struct Op {
    Transport::OpId id = 0;
    bool send = false;
    bool control = false;
    void* buf = nullptr;
    int64_t bytes = 0;
    int64_t send_index = -1;  // sends: the index faults are keyed by
    bool matched = false;
    bool dropped = false;
    int delay = 0;
    std::shared_ptr<Event> posted;  // CUDA sends: the sender's stream position
    std::shared_ptr<Event> done;    // CUDA: the copy
  };
  Device device;
  Stream streams[2] = {nullptr, nullptr};
  bool own_stream[2] = {false, false};
  std::deque<Op> ops[2];       // posted, not yet known complete
  size_t unmatched[2] = {0, 0};  // index into ops of the first unmatched op
  Transport::OpId next_id[2] = {1, 1};
  Transport::OpId completed[2] = {0, 0};
  int64_t sends[2] = {0, 0};
  std::map<int64_t, LoopbackFault> faults[2];
  absl::Status broken;

  ~Shared() {
    for (int s = 0; s < 2; ++s) {
      ops[s].clear();
      if (own_stream[s]) cudaStreamDestroy(streams[s]);
    }
  }

  absl::Status Match(int a) {
    const int b = 1 - a;
    while (broken.ok() && unmatched[a] < ops[a].size() && unmatched[b] < ops[b].size()) {
      Op& x = ops[a][unmatched[a]++];
      Op& y = ops[b][unmatched[b]++];
      x.matched = y.matched = true;
      if (x.send == y.send) {
        broken = absl::InternalError(absl::StrCat(
            "loopback: both endpoints posted a ", x.send ? "send" : "receive",
            " as the matching operation: their sequences do not mirror"));
        break;
      }
      Op& s = x.send ? x : y;
      Op& r = x.send ? y : x;
      const int sender = x.send ? a : b;
      LoopbackFault f;
      if (auto it = faults[sender].find(s.send_index); it != faults[sender].end()) f = it->second;
      if (s.control != r.control) {
        broken = absl::InternalError("loopback: a control message matched a data operation");
        break;
      }
      if (s.bytes != r.bytes) {
        broken = absl::InternalError(absl::StrCat("loopback: a send of ", s.bytes,
                                                  " bytes matched a receive of ", r.bytes,
                                                  " bytes: their sequences do not mirror"));
        break;
      }
      if (f.kind == LoopbackFault::Kind::kFail) {
        broken = absl::UnavailableError(
            absl::StrCat("loopback: injected failure of message ", s.send_index));
        break;
      }
      if (f.kind == LoopbackFault::Kind::kDrop) {
        r.dropped = true;
        continue;
      }
      int64_t n = s.bytes;
      if (f.kind == LoopbackFault::Kind::kTruncate) n = std::min<int64_t>(n, f.bytes);
      if (f.kind == LoopbackFault::Kind::kDelay) r.delay = f.polls;
      const bool corrupt = f.kind == LoopbackFault::Kind::kCorrupt && f.offset < n;
      if (!device.is_cuda() || s.control) {
        if (n > 0) std::memcpy(r.buf, s.buf, static_cast<size_t>(n));
        if (corrupt) static_cast<unsigned char*>(r.buf)[f.offset] ^= 0xFF;
        continue;
      }
      const Stream rs = streams[sender == 0 ? 1 : 0];
      if (s.posted != nullptr) {
        FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(rs, s.posted->ev, 0));
      }
      if (n > 0) {
        FP4KV_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(r.buf, s.buf, static_cast<size_t>(n), cudaMemcpyDeviceToDevice, rs));
      }
      if (corrupt) {
        FP4KV_CUDA_RETURN_IF_ERROR(
            cudaMemsetAsync(static_cast<unsigned char*>(r.buf) + f.offset, 0x5A, 1, rs));
      }
      absl::StatusOr<std::shared_ptr<Event>> done = MakeEvent(rs);
      if (!done.ok()) return done.status();
      s.done = r.done = *done;
    }
    return broken;
  }
};

absl::StatusOr<std::pair<std::unique_ptr<LoopbackTransport>, std::unique_ptr<LoopbackTransport>>>
LoopbackTransport::CreatePair(Device device, Stream stream_a, Stream stream_b) {
  auto shared = std::make_shared<Shared>();
  shared->device = device;
  if (device.is_cuda()) {
    int count = 0;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
    if (device.ordinal < 0 || device.ordinal >= count) {
      return absl::FailedPreconditionError(absl::StrCat(
          "device: expected a CUDA device ordinal below ", count, ", got ", device.ordinal));
    }
    Stream given[2] = {stream_a, stream_b};
    int prev = 0;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&prev));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaSetDevice(device.ordinal));
    for (int s = 0; s < 2; ++s) {
      shared->streams[s] = given[s];
      if (given[s] == nullptr) {
        cudaError_t e = cudaStreamCreateWithFlags(&shared->streams[s], cudaStreamNonBlocking);
        if (e != cudaSuccess) {
          cudaSetDevice(prev);
          return internal::CudaStatus(e, "cudaStreamCreateWithFlags");
        }
        shared->own_stream[s] = true;
      }
    }
    FP4KV_CUDA_RETURN_IF_ERROR(cudaSetDevice(prev));
  }
  return std::make_pair(std::unique_ptr<LoopbackTransport>(new LoopbackTransport(shared, 0)),
                        std::unique_ptr<LoopbackTransport>(new LoopbackTransport(shared, 1)));
}

LoopbackTransport::LoopbackTransport(std::shared_ptr<Shared> shared, int side)
    : shared_(std::move(shared)), side_(side) {}
LoopbackTransport::~LoopbackTransport() = default;

Device LoopbackTransport::device() const { return shared_->device; }
Stream LoopbackTransport::stream() const { return shared_->streams[side_]; }

absl::StatusOr<Transport::OpId> LoopbackTransport::Post(bool send, bool control, void* buf,
                                                        int64_t bytes) {
  Shared& sh = *shared_;
  if (!sh.broken.ok()) return sh.broken;
  if (bytes < 0 || (bytes > 0 && buf == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("loopback: expected a buffer and bytes >= 0, got ", bytes, " bytes at ",
                     buf == nullptr ? "null" : "a pointer"));
  }
  Shared::Op op;
  op.id = sh.next_id[side_]++;
  op.send = send;
  op.control = control;
  op.buf = buf;
  op.bytes = bytes;
  if (send) op.send_index = sh.sends[side_]++;
  if (send && !control && sh.device.is_cuda()) {
    absl::StatusOr<std::shared_ptr<Event>> e = MakeEvent(sh.streams[side_]);
    if (!e.ok()) return e.status();
    op.posted = *e;
  }
  sh.ops[side_].push_back(std::move(op));
  const Transport::OpId id = sh.ops[side_].back().id;
  absl::Status s = sh.Match(side_);
  if (!s.ok()) return s;
  return id;
}

absl::StatusOr<Transport::OpId> LoopbackTransport::Send(const void* buf, int64_t bytes) {
  return Post(true, false, const_cast<void*>(buf), bytes);
}
absl::StatusOr<Transport::OpId> LoopbackTransport::Recv(void* buf, int64_t bytes) {
  return Post(false, false, buf, bytes);
}
absl::StatusOr<Transport::OpId> LoopbackTransport::SendControl(const void* host, int64_t bytes) {
  return Post(true, true, const_cast<void*>(host), bytes);
}
absl::StatusOr<Transport::OpId> LoopbackTransport::RecvControl(void* host, int64_t bytes) {
  return Post(false, true, host, bytes);
}

absl::StatusOr<bool> LoopbackTransport::Poll(OpId op) {
  Shared& sh = *shared_;
  if (!sh.broken.ok()) return sh.broken;
  if (op == 0 || op >= sh.next_id[side_]) {
    return absl::InvalidArgumentError(absl::StrCat("op: expected a posted op, got ", op));
  }
  std::deque<Shared::Op>& q = sh.ops[side_];
  while (!q.empty() && sh.completed[side_] < op) {
    Shared::Op& front = q.front();
    if (!front.matched || front.dropped) break;
    if (front.delay > 0) {
      --front.delay;
      break;
    }
    if (front.done != nullptr) {
      cudaError_t e = cudaEventQuery(front.done->ev);
      if (e == cudaErrorNotReady) break;
      if (e != cudaSuccess) {
        cudaGetLastError();
        sh.broken = internal::CudaStatus(e, "cudaEventQuery(loopback copy)");
        return sh.broken;
      }
    }
    sh.completed[side_] = front.id;
    q.pop_front();
    --sh.unmatched[side_];
  }
  return sh.completed[side_] >= op;
}

void LoopbackTransport::InjectFault(int64_t index, const LoopbackFault& fault) {
  shared_->faults[side_][index] = fault;
}
int64_t LoopbackTransport::sends_posted() const { return shared_->sends[side_]; }
void LoopbackTransport::Break(absl::Status why) {
  if (shared_->broken.ok()) shared_->broken = std::move(why);
}

}  // namespace fp4kv
