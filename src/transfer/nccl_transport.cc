// The NCCL transport: ncclSend/ncclRecv between two ranks, or to self on a
// 1-rank communicator. libnccl is loaded with dlopen the first time it is
// needed, so fp4kv links no NCCL (it is a 200+ MB library that most users of
// the cache never load); only nccl.h is needed at build time. Without nccl.h
// (FP4KV_HAVE_NCCL unset) every entry point answers Unimplemented.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <type_traits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fp4kv/transfer.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"

#ifdef FP4KV_HAVE_NCCL
#include <dlfcn.h>
#include <nccl.h>
static_assert(NCCL_UNIQUE_ID_BYTES == fp4kv::kNcclUniqueIdBytes, "ncclUniqueId size");
#endif

namespace fp4kv {

#ifndef FP4KV_HAVE_NCCL

namespace {
absl::Status NoNccl() {
  return absl::UnimplementedError(
      "fp4kv was built without the NCCL transport (nccl.h was not found at configure time; "
      "see FP4KV_NCCL / NCCL_ROOT)");
}
}  // namespace

struct NcclCommunicator::Impl {};
bool NcclAvailable(std::string* why) {
  if (why != nullptr) *why = std::string(NoNccl().message());
  return false;
}
absl::StatusOr<NcclUniqueId> NcclCreateUniqueId() { return NoNccl(); }
absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(const NcclUniqueId&,
                                                                           int, int, Device) {
  return NoNccl();
}
absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Wrap(void*, Device) {
  return NoNccl();
}
NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclCommunicator::~NcclCommunicator() = default;
int NcclCommunicator::rank() const { return 0; }
int NcclCommunicator::num_ranks() const { return 0; }
Device NcclCommunicator::device() const { return Device::Cpu(); }
void* NcclCommunicator::comm() const { return nullptr; }
absl::StatusOr<std::unique_ptr<Transport>> NcclCommunicator::Connect(int, Stream) {
  return NoNccl();
}
absl::StatusOr<std::pair<std::unique_ptr<Transport>, std::unique_ptr<Transport>>>
NcclCommunicator::SelfPair(Stream) {
  return NoNccl();
}

#else  // FP4KV_HAVE_NCCL

namespace {

struct NcclApi {
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRank) CommInitRank = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclCommCount) CommCount = nullptr;
  decltype(&ncclCommUserRank) CommUserRank = nullptr;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&ncclSend) Send = nullptr;
  decltype(&ncclRecv) Recv = nullptr;
  decltype(&ncclGroupStart) GroupStart = nullptr;
  decltype(&ncclGroupEnd) GroupEnd = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
};

// Loads libnccl once; null (with the reason in *why) when it cannot.
const NcclApi* LoadNccl(std::string* why) {
  static std::once_flag once;
  static NcclApi api;
  static bool ok = false;
  static std::string error;
  std::call_once(once, [] {
    const char* path = std::getenv("FP4KV_NCCL_LIBRARY");
    if (path == nullptr || *path == '\0') path = "libnccl.so.2";
    void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      error = absl::StrCat("cannot load ", path, " (put the NCCL library folder, e.g. the "
                           "nvidia-nccl wheel's lib/, on LD_LIBRARY_PATH or set "
                           "FP4KV_NCCL_LIBRARY): ", e == nullptr ? "" : e);
      return;
    }
    bool all = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (fn == nullptr) {
        all = false;
        error = absl::StrCat(path, " has no ", name);
      }
    };
    sym(api.GetUniqueId, "ncclGetUniqueId");
    sym(api.CommInitRank, "ncclCommInitRank");
    sym(api.CommDestroy, "ncclCommDestroy");
    sym(api.CommAbort, "ncclCommAbort");
    sym(api.CommCount, "ncclCommCount");
    sym(api.CommUserRank, "ncclCommUserRank");
    sym(api.CommGetAsyncError, "ncclCommGetAsyncError");
    sym(api.Send, "ncclSend");
    sym(api.Recv, "ncclRecv");
    sym(api.GroupStart, "ncclGroupStart");
    sym(api.GroupEnd, "ncclGroupEnd");
    sym(api.GetErrorString, "ncclGetErrorString");
    ok = all;
  });
  if (!ok && why != nullptr) *why = error;
  return ok ? &api : nullptr;
}

absl::StatusOr<const NcclApi*> Api() {
  std::string why;
  const NcclApi* api = LoadNccl(&why);
  if (api == nullptr) return absl::FailedPreconditionError(absl::StrCat("NCCL: ", why));
  return api;
}

absl::Status NcclStatus(const NcclApi* api, ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", api->GetErrorString(r)));
}

// The NCCL counterpart of FP4KV_CUDA_RETURN_IF_ERROR (src/status_macros.h):
// an ncclResult_t is turned into a Status through the run-time loaded API's
// GetErrorString, which the generic helper cannot reach (libnccl is never
// linked), so this one stays here.
#define FP4KV_NCCL_RETURN_IF_ERROR(api, call)                                       \
  do {                                                                              \
    if (absl::Status fp4kv_status_ = NcclStatus((api), (call), #call); !fp4kv_status_.ok()) \
      return fp4kv_status_;                                                         \
  } while (0)

// Makes `ordinal` current for a scope.
class DeviceGuard {
 public:
  // Switches only when another device is current (the hot path: every
  // post and poll).
  explicit DeviceGuard(int ordinal) {
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != ordinal) {
      switched_ = cudaSetDevice(ordinal) == cudaSuccess;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool switched_ = false;
};

}  // namespace

struct NcclCommunicator::Impl {
  const NcclApi* api = nullptr;
  ncclComm_t comm = nullptr;
  bool owned = false;
  Device device;
  int rank = 0;
  int num_ranks = 0;
  bool broken = false;  // an endpoint failed: destroy by ncclCommAbort
};

bool NcclAvailable(std::string* why) { return LoadNccl(why) != nullptr; }

absl::StatusOr<NcclUniqueId> NcclCreateUniqueId() {
  absl::StatusOr<const NcclApi*> api = Api();
  if (!api.ok()) return api.status();
  ncclUniqueId id;
  FP4KV_NCCL_RETURN_IF_ERROR(*api, (*api)->GetUniqueId(&id));
  NcclUniqueId out;
  std::memcpy(out.bytes, id.internal, sizeof(out.bytes));
  return out;
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclCommunicator::~NcclCommunicator() {
  if (impl_ != nullptr && impl_->owned && impl_->comm != nullptr) {
    DeviceGuard g(impl_->device.ordinal);
    // After a failure an operation may wait forever for its peer: abort
    // instead of waiting for it.
    if (impl_->broken) {
      impl_->api->CommAbort(impl_->comm);
    } else {
      impl_->api->CommDestroy(impl_->comm);
    }
  }
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(const NcclUniqueId& id,
                                                                           int num_ranks,
                                                                           int rank,
                                                                           Device device) {
  if (!device.is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: expected a CUDA device, got ", device.ToString()));
  }
  if (num_ranks < 1 || rank < 0 || rank >= num_ranks) {
    return absl::InvalidArgumentError(absl::StrCat("rank: expected 0 <= rank < num_ranks, got ",
                                                   rank, " of ", num_ranks));
  }
  int count = 0;
  FP4KV_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (device.ordinal >= count) {
    return absl::FailedPreconditionError(absl::StrCat("device: expected an ordinal below ", count,
                                                      ", got ", device.ordinal));
  }
  absl::StatusOr<const NcclApi*> api = Api();
  if (!api.ok()) return api.status();
  auto impl = std::make_unique<Impl>();
  impl->api = *api;
  impl->device = device;
  impl->rank = rank;
  impl->num_ranks = num_ranks;
  impl->owned = true;
  ncclUniqueId nid;
  std::memcpy(nid.internal, id.bytes, sizeof(nid.internal));
  {
    DeviceGuard g(device.ordinal);
    FP4KV_NCCL_RETURN_IF_ERROR(*api, (*api)->CommInitRank(&impl->comm, num_ranks, nid, rank));
  }
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Wrap(void* nccl_comm,
                                                                         Device device) {
  if (nccl_comm == nullptr || !device.is_cuda()) {
    return absl::InvalidArgumentError("nccl_comm: expected a communicator on a CUDA device");
  }
  absl::StatusOr<const NcclApi*> api = Api();
  if (!api.ok()) return api.status();
  auto impl = std::make_unique<Impl>();
  impl->api = *api;
  impl->comm = static_cast<ncclComm_t>(nccl_comm);
  impl->device = device;
  FP4KV_NCCL_RETURN_IF_ERROR(*api, (*api)->CommCount(impl->comm, &impl->num_ranks));
  FP4KV_NCCL_RETURN_IF_ERROR(*api, (*api)->CommUserRank(impl->comm, &impl->rank));
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(impl)));
}

int NcclCommunicator::rank() const { return impl_->rank; }
int NcclCommunicator::num_ranks() const { return impl_->num_ranks; }
Device NcclCommunicator::device() const { return impl_->device; }
void* NcclCommunicator::comm() const { return impl_->comm; }

namespace {

// One posted operation.
struct NcclOp {
  Transport::OpId id = 0;
  bool send = false;
  bool control = false;
  void* buf = nullptr;  // device buffer, or host for control
  int64_t bytes = 0;
  void* staging = nullptr;  // control: the device copy
  cudaEvent_t done = nullptr;  // recorded after the op (null: not issued yet)
};

class NcclEndpoint;

// The two endpoints of a self pair: their k-th ops are issued together in
// one group (a send to self needs its receive in the same group).
struct SelfLink {
  NcclEndpoint* ends[2] = {nullptr, nullptr};
  Stream owned_stream = nullptr;  // destroyed with the link
  int ordinal = 0;
  ~SelfLink() {
    if (owned_stream != nullptr) {
      DeviceGuard g(ordinal);
      cudaStreamDestroy(owned_stream);
    }
  }
};

class NcclEndpoint : public Transport {
 public:
  NcclEndpoint(NcclCommunicator::Impl* comm, int peer, Stream stream, bool own_stream,
               std::shared_ptr<SelfLink> self, int self_side)
      : comm_(comm), peer_(peer), stream_(stream), own_stream_(own_stream),
        self_(std::move(self)), self_side_(self_side) {}
  ~NcclEndpoint() override {
    DeviceGuard g(comm_->device.ordinal);
    if (self_ != nullptr) self_->ends[self_side_] = nullptr;
    // Issued ops still pending (a peer that never answered): the
    // communicator must be aborted, not destroyed.
    for (size_t i = 0; i < unissued_ && i < ops_.size(); ++i) {
      if (cudaEventQuery(ops_[i].done) == cudaErrorNotReady) comm_->broken = true;
    }
    cudaGetLastError();
    // Ops still in flight (only after a failure: a clean protocol ends with
    // none) keep their staging: freeing it would wait for them.
    for (NcclOp& op : ops_) {
      if (op.done != nullptr) cudaEventDestroy(op.done);
    }
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    for (auto& [p, cap] : free_staging_) cudaFree(p);
    if (own_stream_) cudaStreamDestroy(stream_);
  }

  Device device() const override { return comm_->device; }
  Stream stream() const override { return stream_; }
  absl::StatusOr<OpId> Send(const void* buf, int64_t bytes) override {
    return Post(true, false, const_cast<void*>(buf), bytes);
  }
  absl::StatusOr<OpId> Recv(void* buf, int64_t bytes) override {
    return Post(false, false, buf, bytes);
  }
  absl::StatusOr<OpId> SendControl(const void* host, int64_t bytes) override {
    return Post(true, true, const_cast<void*>(host), bytes);
  }
  absl::StatusOr<OpId> RecvControl(void* host, int64_t bytes) override {
    return Post(false, true, host, bytes);
  }

  absl::StatusOr<bool> Poll(OpId op) override {
    if (!broken_.ok()) return broken_;
    if (op == 0 || op >= next_id_) {
      return absl::InvalidArgumentError(absl::StrCat("op: expected a posted op, got ", op));
    }
    if (completed_ >= op) return true;  // known complete: no driver call
    DeviceGuard g(comm_->device.ordinal);
    ncclResult_t async = ncclSuccess;
    comm_->api->CommGetAsyncError(comm_->comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      broken_ = NcclStatus(comm_->api, async, "NCCL (asynchronous error)");
      comm_->broken = true;
      return broken_;
    }
    while (!ops_.empty() && completed_ < op) {
      NcclOp& front = ops_.front();
      if (front.done == nullptr) break;  // not issued (self pair: partner missing)
      cudaError_t e = cudaEventQuery(front.done);
      if (e == cudaErrorNotReady) break;
      if (e != cudaSuccess) {
        cudaGetLastError();
        broken_ = internal::CudaStatus(e, "cudaEventQuery(NCCL op)");
        comm_->broken = true;
        return broken_;
      }
      completed_ = front.id;
      Recycle(front);
      ops_.pop_front();
    }
    return completed_ >= op;
  }

  // Issues op `i` of the pending ones: the pre-copy, the NCCL call (inside
  // the caller's group), then (after the group) the post-copy and event.
  absl::Status PreIssue(NcclOp& op) {
    if (op.control) {
      absl::StatusOr<void*> st = Staging(op.bytes);
      if (!st.ok()) return st.status();
      op.staging = *st;
      if (op.send) {
        FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(op.staging, op.buf, op.bytes,
                                                   cudaMemcpyHostToDevice, stream_));
      }
    }
    return absl::OkStatus();
  }
  absl::Status Issue(NcclOp& op) {
    void* dev = op.control ? op.staging : op.buf;
    const size_t n = static_cast<size_t>(op.bytes);
    if (op.send) {
      FP4KV_NCCL_RETURN_IF_ERROR(comm_->api,
                                 comm_->api->Send(dev, n, ncclUint8, peer_, comm_->comm, stream_));
    } else {
      FP4KV_NCCL_RETURN_IF_ERROR(comm_->api,
                                 comm_->api->Recv(dev, n, ncclUint8, peer_, comm_->comm, stream_));
    }
    return absl::OkStatus();
  }
  absl::Status PostIssue(NcclOp& op) {
    if (op.control && !op.send) {
      FP4KV_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(op.buf, op.staging, op.bytes, cudaMemcpyDeviceToHost, stream_));
    }
    absl::StatusOr<cudaEvent_t> ev = Event();
    if (!ev.ok()) return ev.status();
    FP4KV_CUDA_RETURN_IF_ERROR(cudaEventRecord(*ev, stream_));
    op.done = *ev;
    return absl::OkStatus();
  }

  std::deque<NcclOp> ops_;
  size_t unissued_ = 0;  // index of the first op not yet issued
  absl::Status broken_;

 private:
  absl::StatusOr<OpId> Post(bool send, bool control, void* buf, int64_t bytes) {
    if (!broken_.ok()) return broken_;
    if (bytes < 0 || (bytes > 0 && buf == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("NCCL transport: expected a buffer and bytes >= 0, got ", bytes));
    }
    DeviceGuard g(comm_->device.ordinal);
    NcclOp op;
    op.id = next_id_++;
    op.send = send;
    op.control = control;
    op.buf = buf;
    op.bytes = bytes;
    ops_.push_back(op);
    absl::Status s = self_ == nullptr ? IssueOwn() : IssueSelf();
    if (!s.ok()) {
      broken_ = s;
      comm_->broken = true;
      return s;
    }
    return op.id;
  }

  absl::Status IssueOwn() {
    NcclOp& op = ops_[unissued_++];
    FP4KV_RETURN_IF_ERROR(PreIssue(op));
    FP4KV_RETURN_IF_ERROR(Issue(op));
    return PostIssue(op);
  }

  absl::Status IssueSelf() {
    NcclEndpoint* a = self_->ends[0];
    NcclEndpoint* b = self_->ends[1];
    if (a == nullptr || b == nullptr) {
      return absl::FailedPreconditionError("NCCL self pair: the other endpoint is gone");
    }
    while (a->unissued_ < a->ops_.size() && b->unissued_ < b->ops_.size()) {
      NcclOp& x = a->ops_[a->unissued_];
      NcclOp& y = b->ops_[b->unissued_];
      if (x.send == y.send || x.bytes != y.bytes || x.control != y.control) {
        return absl::InternalError(
            "NCCL self pair: the two endpoints' operation sequences do not mirror");
      }
      FP4KV_RETURN_IF_ERROR(a->PreIssue(x));
      FP4KV_RETURN_IF_ERROR(b->PreIssue(y));
      FP4KV_NCCL_RETURN_IF_ERROR(comm_->api, comm_->api->GroupStart());
      absl::Status s = a->Issue(x);
      if (s.ok()) s = b->Issue(y);
      absl::Status e = NcclStatus(comm_->api, comm_->api->GroupEnd(), "ncclGroupEnd");
      if (!s.ok()) return s;
      if (!e.ok()) return e;
      FP4KV_RETURN_IF_ERROR(a->PostIssue(x));
      FP4KV_RETURN_IF_ERROR(b->PostIssue(y));
      ++a->unissued_;
      ++b->unissued_;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<cudaEvent_t> Event() {
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  absl::StatusOr<void*> Staging(int64_t bytes) {
    for (size_t i = 0; i < free_staging_.size(); ++i) {
      if (free_staging_[i].second >= bytes) {
        void* p = free_staging_[i].first;
        staging_cap_[p] = free_staging_[i].second;
        free_staging_.erase(free_staging_.begin() + static_cast<long>(i));
        return p;
      }
    }
    void* p = nullptr;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1))));
    staging_cap_[p] = bytes;
    return p;
  }
  void Recycle(NcclOp& op) {
    if (op.done != nullptr) free_events_.push_back(op.done);
    if (op.staging != nullptr) {
      free_staging_.push_back({op.staging, staging_cap_[op.staging]});
      staging_cap_.erase(op.staging);
    }
    op.done = nullptr;
    op.staging = nullptr;
    if (unissued_ > 0) --unissued_;
  }

  NcclCommunicator::Impl* comm_;
  int peer_;
  Stream stream_;
  bool own_stream_;
  std::shared_ptr<SelfLink> self_;
  int self_side_;
  OpId next_id_ = 1;
  OpId completed_ = 0;
  std::vector<cudaEvent_t> free_events_;
  std::vector<std::pair<void*, int64_t>> free_staging_;
  std::map<void*, int64_t> staging_cap_;
};

absl::StatusOr<Stream> MakeStream(Stream given, int ordinal, bool* own) {
  *own = false;
  if (given != nullptr) return given;
  DeviceGuard g(ordinal);
  Stream s = nullptr;
  FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  *own = true;
  return s;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> NcclCommunicator::Connect(int peer, Stream stream) {
  if (peer < 0 || peer >= impl_->num_ranks || peer == impl_->rank) {
    return absl::InvalidArgumentError(absl::StrCat("peer: expected another rank below ",
                                                   impl_->num_ranks, " than ", impl_->rank,
                                                   ", got ", peer));
  }
  bool own = false;
  absl::StatusOr<Stream> s = MakeStream(stream, impl_->device.ordinal, &own);
  if (!s.ok()) return s.status();
  return std::unique_ptr<Transport>(new NcclEndpoint(impl_.get(), peer, *s, own, nullptr, 0));
}

absl::StatusOr<std::pair<std::unique_ptr<Transport>, std::unique_ptr<Transport>>>
NcclCommunicator::SelfPair(Stream stream) {
  if (impl_->num_ranks != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "NCCL self pair: expected a 1-rank communicator, got ", impl_->num_ranks, " ranks"));
  }
  bool own = false;
  absl::StatusOr<Stream> s = MakeStream(stream, impl_->device.ordinal, &own);
  if (!s.ok()) return s.status();
  auto link = std::make_shared<SelfLink>();
  link->ordinal = impl_->device.ordinal;
  if (own) link->owned_stream = *s;
  auto a = std::make_unique<NcclEndpoint>(impl_.get(), 0, *s, false, link, 0);
  auto b = std::make_unique<NcclEndpoint>(impl_.get(), 0, *s, false, link, 1);
  link->ends[0] = a.get();
  link->ends[1] = b.get();
  return std::make_pair(std::unique_ptr<Transport>(std::move(a)),
                        std::unique_ptr<Transport>(std::move(b)));
}

#endif  // FP4KV_HAVE_NCCL

}  // namespace fp4kv
