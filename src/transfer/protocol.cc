// The transfer protocol: SequenceSender and SequenceReceiver state machines
// (docs/transfer.md). Both sides post mirrored operation sequences, a
// pipeline of steps k = 0, 1, ... with D = pipeline_depth:
//
//   sender                        receiver
//   SendControl(hello)            RecvControl(hello)
//   RecvControl(hello)            SendControl(hello)
//   step k:
//   SendControl(offer k)          RecvControl(offer k)      (bye ends the link)
//   Send(image) per READY of      Recv(image) per READY of
//     reply k - D                   reply k - D
//   RecvControl(reply k)          SendControl(reply k)
//
// Offer k carries new offers and the plan (send / skip) of the payloads
// that follow it; reply k answers offer k's offers and acks the payloads
// committed so far. The sender posts step k once it has reply k - D, so up
// to D steps are in flight. Which operations come next depends only on
// frames both sides hold (reply k - D's READY set), so the k-th operations
// always match.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "fp4kv/transfer.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"
#include "src/transfer/transfer_internal.h"
#include "xxhash.h"

namespace fp4kv {
namespace internal {

namespace {
// XXH3-64 of the head with the checksum field zero seeds the XXH3-64 of the
// rest: no copy of the frame.
uint64_t FrameChecksum(const void* frame, int64_t bytes) {
  FrameHead h;
  std::memcpy(&h, frame, sizeof(h));
  h.checksum = 0;
  const uint64_t seed = XXH3_64bits(&h, sizeof(h));
  return XXH3_64bits_withSeed(static_cast<const unsigned char*>(frame) + sizeof(h),
                              static_cast<size_t>(bytes) - sizeof(h), seed);
}
}  // namespace

void SealFrame(void* frame, int64_t bytes) {
  auto* head = static_cast<FrameHead*>(frame);
  head->checksum = FrameChecksum(frame, bytes);
}

absl::Status CheckFrame(const void* frame, int64_t bytes, FrameKind kind, uint64_t round,
                        int max_count) {
  if (bytes < static_cast<int64_t>(sizeof(FrameHead))) {
    return absl::DataLossError(absl::StrCat("transfer frame: expected at least ",
                                            sizeof(FrameHead), " bytes, got ", bytes));
  }
  FrameHead head;
  std::memcpy(&head, frame, sizeof(head));
  if (head.magic != kFrameMagic) {
    return absl::DataLossError(absl::StrCat("transfer frame: bad magic 0x", absl::Hex(head.magic)));
  }
  if (head.version != kFrameVersion) {
    return absl::DataLossError(absl::StrCat("transfer frame: expected version ", kFrameVersion,
                                            ", got ", head.version));
  }
  if (head.frame_bytes != bytes) {
    return absl::DataLossError(absl::StrCat("transfer frame: expected ", bytes,
                                            " bytes, the frame says ", head.frame_bytes));
  }
  if (FrameChecksum(frame, bytes) != head.checksum) {
    return absl::DataLossError("transfer frame: checksum mismatch (corrupted or truncated)");
  }
  if (head.kind != static_cast<uint16_t>(kind)) {
    return absl::DataLossError(absl::StrCat("transfer frame: expected kind ",
                                            static_cast<int>(kind), ", got ", head.kind));
  }
  if (head.round != round) {
    return absl::DataLossError(
        absl::StrCat("transfer frame: expected round ", round, ", got ", head.round));
  }
  if (head.count > max_count) {
    return absl::DataLossError(absl::StrCat("transfer frame: expected at most ", max_count,
                                            " entries, got ", head.count));
  }
  return absl::OkStatus();
}

namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void SetMessage(FrameEntry& e, const absl::Status& s) {
  e.status_code = static_cast<int32_t>(s.code());
  std::string m(s.message());
  std::snprintf(e.message, sizeof(e.message), "%s", m.c_str());
}

absl::Status EntryStatus(const FrameEntry& e, const char* what) {
  std::string m(e.message, strnlen(e.message, sizeof(e.message)));
  return absl::Status(static_cast<absl::StatusCode>(e.status_code),
                      absl::StrCat(what, ": ", m));
}

absl::Status CheckOptions(const TransferOptions& o, const Transport* t,
                          const TransferCachePort* port) {
  if (t == nullptr) return absl::InvalidArgumentError("transport: expected an endpoint, got null");
  if (o.slot_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.slot_bytes: expected > 0, got ", o.slot_bytes));
  }
  if (o.slot_bytes < port->header_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("options.slot_bytes: expected >= ",
                                                   port->header_bytes(),
                                                   " (an image header), got ", o.slot_bytes));
  }
  if (o.num_slots < 1 || o.num_slots > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.num_slots: expected 1 .. 256, got ", o.num_slots));
  }
  if (o.pipeline_depth < 1 || o.pipeline_depth > 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.pipeline_depth: expected 1 .. 4, got ", o.pipeline_depth));
  }
  if (t->device() != port->device()) {
    return absl::InvalidArgumentError(absl::StrCat("transport: expected the cache's device ",
                                                   port->device().ToString(), ", got ",
                                                   t->device().ToString()));
  }
  return absl::OkStatus();
}

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

// Device memory for the slots, pinned host memory for frames and headers.
class Buffers {
 public:
  absl::Status Allocate(Device device, int64_t slot_bytes, int num_slots, int64_t host_bytes) {
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
        return absl::ResourceExhaustedError(
            absl::StrCat("transfer: allocating ", num_slots, " slots of ", slot_bytes,
                         " bytes: ", cudaGetErrorString(e)));
      }
    } else {
      slots_ = std::malloc(static_cast<size_t>(slot_bytes) * num_slots);
      host_ = std::malloc(static_cast<size_t>(host_bytes));
      if (slots_ == nullptr || host_ == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "transfer: allocating ", num_slots, " slots of ", slot_bytes, " bytes"));
      }
    }
    std::memset(host_, 0, static_cast<size_t>(host_bytes));
    // The CPU slots come from malloc (16-byte aligned); every slot is at a
    // multiple of 256 from there.
    return absl::OkStatus();
  }
  ~Buffers() {
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
  void* slots_ = nullptr;
  void* host_ = nullptr;
  std::vector<cudaEvent_t> events_;  // per slot (CUDA)
  Device device_;
};

// True once `ev` completed (CPU: always).
absl::StatusOr<bool> EventDone(cudaEvent_t ev) {
  if (ev == nullptr) return true;
  cudaError_t e = cudaEventQuery(ev);
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) return false;
  cudaGetLastError();
  return CudaStatus(e, "cudaEventQuery");
}

}  // namespace
}  // namespace internal

// ================================================================ sender

struct SequenceSender::Impl {
  struct Entry {
    TransferId id = 0;
    SequenceId seq = 0;
    TransferState state = TransferState::kQueued;
    int slot = -1;
    int64_t image_bytes = 0;
    int64_t length = 0;
    bool cancel = false;
    bool skip = false;      // READY but cancelled before the reply was seen
    int64_t ack_step = -1;  // payload sent: the reply that acks it at the latest
  };
  enum class Phase { kHello, kRun, kBroken };

  std::unique_ptr<internal::TransferCachePort> port;
  Transport* t = nullptr;
  TransferOptions o;
  internal::Buffers buf;
  int64_t hdr = 0;          // header bytes
  int64_t frame_bytes = 0;  // offer / reply / bye frames
  int depth = 1;
  int ring = 2;             // depth + 1 frames each way
  int max_offers = 1;       // new offers per step: max(1, num_slots / (depth + 2))
  std::vector<unsigned char*> out_frames, in_frames;  // [step % ring] (host)
  unsigned char* hello_in = nullptr;
  unsigned char* hello_out = nullptr;
  unsigned char* headers = nullptr;  // num_slots image headers (host), by slot
  std::vector<int> free_slots;
  std::map<TransferId, Entry> entries;  // not final, by id (= send order)
  absl::flat_hash_set<SequenceId> sending;
  std::deque<TransferId> queued, exporting, ready;  // by state, in id order
  int64_t pending_cancels = 0;  // queued / exporting / ready ones with cancel set
  std::vector<TransferResult> results;
  TransferId next_id = 1;
  Phase phase = Phase::kHello;
  Transport::OpId hello_op = 0;
  int64_t next_step = 0;   // the next step to post
  int64_t next_reply = 0;  // the oldest posted step whose reply is not processed
  std::vector<Transport::OpId> reply_ops;         // [step % ring]
  std::vector<std::vector<TransferId>> offered;   // [step % ring]: offered in that step
  std::map<int64_t, std::vector<TransferId>> ready_at;  // reply step -> READY ids (payload pending)
  std::deque<TransferId> unacked;  // payload sent, in send order
  int64_t last_heard = 0;          // ms: the last reply (timeouts)
  absl::Status broken;

  unsigned char* slot_ptr(int s) const {
    return static_cast<unsigned char*>(buf.slots_) +
           static_cast<int64_t>(s) * internal::SlotStride(o.slot_bytes);
  }
  Entry* Find(TransferId id) {
    auto it = entries.find(id);
    return it == entries.end() ? nullptr : &it->second;
  }
  bool Expired() const {
    return o.timeout_ms > 0 && internal::NowMs() - last_heard > o.timeout_ms;
  }
  bool Idle() const { return entries.empty() && next_reply == next_step; }

  void Finish(TransferId id, TransferState state, absl::Status status) {
    auto it = entries.find(id);
    if (it == entries.end()) return;
    Entry& e = it->second;
    if (state == TransferState::kConfirmed && o.release_on_confirm) {
      absl::Status r = port->Release(e.seq);
      if (!r.ok()) status = r;  // confirmed all the same: the receiver has it
    }
    if (e.slot >= 0) free_slots.push_back(e.slot);
    results.push_back({e.id, e.seq, state, std::move(status), e.image_bytes, e.length});
    sending.erase(e.seq);
    entries.erase(it);
  }

  absl::Status Break(absl::Status why) {
    if (phase == Phase::kBroken) return broken;
    phase = Phase::kBroken;
    broken = why;
    std::vector<TransferId> ids;
    for (const auto& [id, e] : entries) ids.push_back(id);
    for (TransferId id : ids) {
      Finish(id, TransferState::kFailed,
             absl::Status(why.code(), absl::StrCat("transfer ", id, ": link broke (the sender "
                                                   "keeps the sequence): ", why.message())));
    }
    queued.clear();
    exporting.clear();
    ready.clear();
    ready_at.clear();
    unacked.clear();
    pending_cancels = 0;
    return why;
  }

  absl::Status StartHello() {
    internal::FrameHead h;
    h.kind = static_cast<uint16_t>(internal::FrameKind::kHello);
    h.frame_bytes = sizeof(h);
    h.arg0 = o.slot_bytes;
    h.arg1 = o.num_slots;
    h.flags = static_cast<uint16_t>(depth);
    std::memcpy(hello_out, &h, sizeof(h));
    internal::SealFrame(hello_out, sizeof(h));
    absl::StatusOr<Transport::OpId> s = t->SendControl(hello_out, sizeof(h));
    if (!s.ok()) return s.status();
    absl::StatusOr<Transport::OpId> r = t->RecvControl(hello_in, sizeof(h));
    if (!r.ok()) return r.status();
    hello_op = *r;
    last_heard = internal::NowMs();
    return absl::OkStatus();
  }

  absl::Status CheckHello() {
    absl::Status s = internal::CheckFrame(hello_in, sizeof(internal::FrameHead),
                                          internal::FrameKind::kHello, 0, 0);
    const auto* h = reinterpret_cast<const internal::FrameHead*>(hello_in);
    if (s.ok() && (h->arg0 != o.slot_bytes || h->arg1 != o.num_slots || h->flags != depth)) {
      s = absl::FailedPreconditionError(absl::StrCat(
          "transfer hello: the receiver has slot_bytes ", h->arg0, " num_slots ", h->arg1,
          " pipeline_depth ", h->flags, ", the sender ", o.slot_bytes, ", ", o.num_slots, " and ",
          depth, " (they must match)"));
    }
    return s;
  }

  // Cancelled transfers that hold no offer end here; queued ones take free
  // slots and are exported; finished exports (the cache stream is in order:
  // only the oldest is queried) become ready.
  absl::Status Exports(bool* changed) {
    if (pending_cancels > 0) {
      for (std::deque<TransferId>* q : {&queued, &ready}) {
        for (auto it = q->begin(); it != q->end();) {
          Entry* e = Find(*it);
          if (e != nullptr && e->cancel) {
            const TransferId id = *it;
            it = q->erase(it);
            --pending_cancels;
            Finish(id, TransferState::kCancelled,
                   absl::CancelledError(absl::StrCat("transfer ", id, ": cancelled by the sender")));
            *changed = true;
          } else {
            ++it;
          }
        }
      }
    }
    while (!queued.empty() && !free_slots.empty()) {
      Entry& e = *Find(queued.front());
      queued.pop_front();
      e.slot = free_slots.back();
      free_slots.pop_back();
      absl::Status s = port->Export(e.seq, slot_ptr(e.slot), o.slot_bytes, o.cache_stream);
      if (s.ok() && port->device().is_cuda()) {
        s = internal::CudaStatus(cudaMemcpyAsync(headers + e.slot * hdr, slot_ptr(e.slot), hdr,
                                                 cudaMemcpyDeviceToHost, o.cache_stream),
                                 "cudaMemcpyAsync(image header)");
        if (s.ok()) {
          s = internal::CudaStatus(cudaEventRecord(buf.events_[e.slot], o.cache_stream),
                                   "cudaEventRecord");
        }
      } else if (s.ok()) {
        std::memcpy(headers + e.slot * hdr, slot_ptr(e.slot), hdr);
      }
      *changed = true;
      if (!s.ok()) {
        if (e.cancel) --pending_cancels;
        Finish(e.id, TransferState::kFailed, s);
        continue;
      }
      e.state = TransferState::kExporting;
      exporting.push_back(e.id);
    }
    while (!exporting.empty()) {
      Entry& e = *Find(exporting.front());
      absl::StatusOr<bool> done =
          internal::EventDone(port->device().is_cuda() ? buf.events_[e.slot] : nullptr);
      if (!done.ok()) return done.status();
      if (!*done) break;
      exporting.pop_front();
      e.state = TransferState::kReady;
      ready.push_back(e.id);
      *changed = true;
    }
    return absl::OkStatus();
  }

  // Whether step k is worth posting: something to offer, a payload to
  // send, or an ack that only a later step can bring.
  bool HaveWork(int64_t k) const {
    if (!ready.empty()) return true;
    for (const auto& [step, ids] : ready_at) {
      if (!ids.empty()) return true;
    }
    return !unacked.empty() && entries.at(unacked.back()).ack_step >= k;
  }

  absl::Status PostStep() {
    const int64_t k = next_step;
    unsigned char* out = out_frames[k % ring];
    std::memset(out, 0, frame_bytes);
    auto* head = reinterpret_cast<internal::FrameHead*>(out);
    *head = internal::FrameHead();
    head->kind = static_cast<uint16_t>(internal::FrameKind::kOffer);
    head->frame_bytes = static_cast<uint32_t>(frame_bytes);
    head->round = static_cast<uint64_t>(k);
    head->arg1 = hdr;
    // The plan: every READY of reply k - D, in order.
    std::vector<TransferId> plan;
    if (auto it = ready_at.find(k - depth); it != ready_at.end()) {
      plan = std::move(it->second);
      ready_at.erase(it);
    }
    unsigned char* p = out + sizeof(internal::FrameHead);
    for (TransferId id : plan) {
      const Entry& e = entries.at(id);
      internal::FrameEntry fe;
      fe.id = id;
      fe.image_bytes = e.image_bytes;
      fe.length = e.length;
      fe.code = e.skip ? internal::kCodeSkip : internal::kCodeSend;
      std::memcpy(p, &fe, sizeof(fe));
      p += sizeof(fe);
    }
    // New offers: the oldest exported ones, at most max_offers: a transfer
    // holds its slot for about depth + 2 steps, so spreading the slots over
    // the steps frees them a few at a time, and their next exports overlap
    // other steps' payloads instead of all waiting for one big ack.
    std::vector<TransferId>& offers = offered[k % ring];
    offers.clear();
    unsigned char* h = out + internal::FrameHeadersOffset(o.num_slots);
    while (!ready.empty() && static_cast<int>(offers.size()) < max_offers) {
      Entry& e = entries.at(ready.front());
      ready.pop_front();
      internal::FrameEntry fe;
      fe.id = e.id;
      fe.image_bytes = e.image_bytes;
      fe.length = e.length;
      fe.code = internal::kCodeOffer;
      std::memcpy(p, &fe, sizeof(fe));
      p += sizeof(fe);
      std::memcpy(h, headers + e.slot * hdr, hdr);
      h += hdr;
      e.state = TransferState::kOffered;
      offers.push_back(e.id);
    }
    const bool late = offers.empty() && queued.empty() && exporting.empty() && ready.empty();
    head->count = static_cast<uint16_t>(plan.size() + offers.size());
    head->arg0 = static_cast<int64_t>(plan.size());
    head->flags = late ? internal::kFlagLateReply : 0;
    internal::SealFrame(out, frame_bytes);
    absl::StatusOr<Transport::OpId> s = t->SendControl(out, frame_bytes);
    if (!s.ok()) return s.status();
    for (TransferId id : plan) {
      Entry& e = entries.at(id);
      absl::StatusOr<Transport::OpId> d = t->Send(slot_ptr(e.slot), e.image_bytes);
      if (!d.ok()) return d.status();
      e.ack_step = late ? k : k + 1;
      unacked.push_back(id);
    }
    absl::StatusOr<Transport::OpId> r = t->RecvControl(in_frames[k % ring], frame_bytes);
    if (!r.ok()) return r.status();
    reply_ops[k % ring] = *r;
    if (next_reply == next_step) last_heard = internal::NowMs();
    ++next_step;
    return absl::OkStatus();
  }

  absl::Status OnReply(int64_t j) {
    const unsigned char* in = in_frames[j % ring];
    FP4KV_RETURN_IF_ERROR(internal::CheckFrame(in, frame_bytes, internal::FrameKind::kReply,
                                                 static_cast<uint64_t>(j),
                                                 static_cast<int>(internal::FrameEntryCapacity(o.num_slots))));
    const auto* head = reinterpret_cast<const internal::FrameHead*>(in);
    const std::vector<TransferId>& offers = offered[j % ring];
    if (head->arg0 != static_cast<int64_t>(offers.size()) || head->count < head->arg0 ||
        head->count - head->arg0 > static_cast<int64_t>(unacked.size())) {
      return absl::DataLossError(absl::StrCat(
          "transfer reply ", j, ": ", head->arg0, " answers and ", head->count - head->arg0,
          " acks, expected ", offers.size(), " answers and at most ", unacked.size(), " acks"));
    }
    // Check everything before acting on anything.
    std::vector<internal::FrameEntry> fe(head->count);
    for (size_t i = 0; i < fe.size(); ++i) {
      std::memcpy(&fe[i], in + sizeof(internal::FrameHead) + i * sizeof(internal::FrameEntry),
                  sizeof(internal::FrameEntry));
      const bool answer = i < offers.size();
      const TransferId want = answer ? offers[i] : unacked[i - offers.size()];
      const bool code_ok =
          answer ? (fe[i].code == internal::kCodeReady || fe[i].code == internal::kCodeNack)
                 : (fe[i].code == internal::kCodeCommitted ||
                    fe[i].code == internal::kCodeCancelled || fe[i].code == internal::kCodeFailed);
      if (fe[i].id != want || !code_ok) {
        return absl::DataLossError(absl::StrCat("transfer reply ", j, ": entry ", i,
                                                " names transfer ", fe[i].id, " code ",
                                                fe[i].code, ", expected transfer ", want));
      }
    }
    const size_t acks = fe.size() - offers.size();
    if (acks < unacked.size() && entries.at(unacked[acks]).ack_step <= j) {
      return absl::DataLossError(absl::StrCat("transfer reply ", j, ": expected the ack of transfer ",
                                              unacked[acks]));
    }
    std::vector<TransferId>& now_ready = ready_at[j];
    for (size_t i = 0; i < offers.size(); ++i) {
      Entry& e = entries.at(offers[i]);
      if (fe[i].code == internal::kCodeNack) {
        Finish(e.id, TransferState::kRefused, internal::EntryStatus(fe[i], "refused by the receiver"));
        continue;
      }
      e.state = TransferState::kMoving;
      e.skip = e.cancel;
      now_ready.push_back(e.id);
    }
    if (now_ready.empty()) ready_at.erase(j);
    for (size_t i = offers.size(); i < fe.size(); ++i) {
      const internal::FrameEntry& a = fe[i];
      unacked.pop_front();
      const Entry& e = entries.at(a.id);
      if (a.code == internal::kCodeCommitted) {
        Finish(a.id, TransferState::kConfirmed, absl::OkStatus());
      } else if (a.code == internal::kCodeCancelled || e.skip) {
        Finish(a.id, TransferState::kCancelled,
               e.skip ? absl::CancelledError(absl::StrCat("transfer ", a.id,
                                                          ": cancelled by the sender"))
                      : internal::EntryStatus(a, "cancelled by the receiver"));
      } else {
        Finish(a.id, TransferState::kFailed, internal::EntryStatus(a, "import failed"));
      }
    }
    last_heard = internal::NowMs();
    return absl::OkStatus();
  }

  absl::Status Step(bool* changed) {
    if (phase == Phase::kBroken) return broken;
    FP4KV_RETURN_IF_ERROR(Exports(changed));  // also while the handshake is on its way
    if (phase == Phase::kHello) {
      if (hello_op == 0) FP4KV_RETURN_IF_ERROR(StartHello());
      absl::StatusOr<bool> done = t->Poll(hello_op);
      if (!done.ok()) return done.status();
      if (!*done) {
        if (Expired()) {
          return absl::DeadlineExceededError(absl::StrCat(
              "transfer: the receiver did not answer the hello within ", o.timeout_ms, " ms"));
        }
        return absl::OkStatus();
      }
      FP4KV_RETURN_IF_ERROR(CheckHello());
      phase = Phase::kRun;
      *changed = true;
    }
    // Replies, oldest first.
    while (next_reply < next_step) {
      absl::StatusOr<bool> done = t->Poll(reply_ops[next_reply % ring]);
      if (!done.ok()) return done.status();
      if (!*done) {
        if (Expired()) {
          return absl::DeadlineExceededError(
              absl::StrCat("transfer: the receiver did not answer within ", o.timeout_ms,
                           " ms (step ", next_reply, ")"));
        }
        break;
      }
      FP4KV_RETURN_IF_ERROR(OnReply(next_reply));
      ++next_reply;
      *changed = true;
    }
    // The next steps, as far as the window and the work go.
    while (next_step < next_reply + depth && HaveWork(next_step)) {
      FP4KV_RETURN_IF_ERROR(PostStep());
      *changed = true;
    }
    return absl::OkStatus();
  }
};

absl::StatusOr<SequenceSender> internal::CreateSender(std::unique_ptr<TransferCachePort> port,
                                                      Transport* transport,
                                                      const TransferOptions& options) {
  FP4KV_RETURN_IF_ERROR(CheckOptions(options, transport, port.get()));
  auto impl = std::make_unique<SequenceSender::Impl>();
  impl->hdr = port->header_bytes();
  impl->frame_bytes = FrameBytes(options.num_slots, impl->hdr);
  impl->depth = options.pipeline_depth;
  impl->ring = options.pipeline_depth + 1;
  impl->max_offers = std::max(1, options.num_slots / (options.pipeline_depth + 2));
  const int64_t host_bytes = 2 * impl->ring * impl->frame_bytes +
                             2 * static_cast<int64_t>(sizeof(FrameHead)) +
                             options.num_slots * impl->hdr;
  FP4KV_RETURN_IF_ERROR(impl->buf.Allocate(
      port->device(), internal::SlotStride(options.slot_bytes), options.num_slots, host_bytes));
  auto* h = static_cast<unsigned char*>(impl->buf.host_);
  for (int i = 0; i < impl->ring; ++i) {
    impl->out_frames.push_back(h);
    h += impl->frame_bytes;
    impl->in_frames.push_back(h);
    h += impl->frame_bytes;
  }
  impl->hello_out = h;
  impl->hello_in = h + sizeof(FrameHead);
  impl->headers = impl->hello_in + sizeof(FrameHead);
  impl->reply_ops.assign(impl->ring, 0);
  impl->offered.resize(impl->ring);
  for (int s = options.num_slots - 1; s >= 0; --s) impl->free_slots.push_back(s);
  impl->port = std::move(port);
  impl->t = transport;
  impl->o = options;
  return SequenceSender(std::move(impl));
}

absl::StatusOr<SequenceSender> SequenceSender::Create(KVCache* cache, Transport* transport,
                                                      const TransferOptions& options) {
  if (cache == nullptr) return absl::InvalidArgumentError("cache: expected a cache, got null");
  return internal::CreateSender(internal::MakeKVCachePort(cache), transport, options);
}

SequenceSender::SequenceSender(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SequenceSender::SequenceSender(SequenceSender&&) noexcept = default;
SequenceSender& SequenceSender::operator=(SequenceSender&&) noexcept = default;
SequenceSender::~SequenceSender() = default;

#define FP4KV_TRANSFER_RETURN_IF_MOVED_FROM()                                            \
  do {                                                                                   \
    if (impl_ == nullptr) {                                                              \
      return absl::FailedPreconditionError("transfer: expected a live object, got one " \
                                           "that was moved from");                       \
    }                                                                                    \
  } while (0)

absl::StatusOr<TransferId> SequenceSender::Send(SequenceId seq) {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  if (impl_->phase == Impl::Phase::kBroken) {
    return absl::FailedPreconditionError(
        absl::StrCat("transfer: the link is broken: ", impl_->broken.message()));
  }
  if (impl_->sending.contains(seq)) {
    for (const auto& [id, e] : impl_->entries) {
      if (e.seq == seq) {
        return absl::InvalidArgumentError(
            absl::StrCat("seq: sequence ", seq, " is already being sent (transfer ", id, ")"));
      }
    }
  }
  absl::StatusOr<int64_t> bytes = impl_->port->ExportedBytes(seq);
  if (!bytes.ok()) return bytes.status();
  if (*bytes > impl_->o.slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("seq: sequence ", seq, "'s image has ", *bytes,
                                                   " bytes, expected at most slot_bytes ",
                                                   impl_->o.slot_bytes));
  }
  absl::StatusOr<int64_t> length = impl_->port->Length(seq);
  if (!length.ok()) return length.status();
  Impl::Entry e;
  e.id = impl_->next_id++;
  e.seq = seq;
  e.image_bytes = *bytes;
  e.length = *length;
  impl_->entries.emplace(e.id, e);
  impl_->sending.insert(seq);
  impl_->queued.push_back(e.id);
  return e.id;
}

absl::Status SequenceSender::Cancel(TransferId id) {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  Impl::Entry* e = impl_->Find(id);
  if (e == nullptr) {
    return absl::NotFoundError(absl::StrCat("id: transfer ", id, " is not in flight"));
  }
  if (e->state == TransferState::kMoving) {
    return absl::FailedPreconditionError(absl::StrCat(
        "id: transfer ", id, "'s image is moving; it ends confirmed or failed as a whole"));
  }
  if (!e->cancel && e->state != TransferState::kOffered) ++impl_->pending_cancels;
  e->cancel = true;
  return absl::OkStatus();
}

absl::Status SequenceSender::Progress() {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  internal::DeviceScope scope(impl_->port->device());
  // A few passes per call, so that what one pass made possible (a reply
  // that freed slots, an export that finished) is acted on at once.
  for (int i = 0; i < 4; ++i) {
    bool changed = false;
    absl::Status s = impl_->Step(&changed);
    if (!s.ok()) return impl_->Break(s);
    if (!changed) break;
  }
  return absl::OkStatus();
}

absl::Status SequenceSender::RunUntilIdle() {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  while (true) {
    FP4KV_RETURN_IF_ERROR(Progress());
    if (impl_->Idle() && impl_->phase != Impl::Phase::kHello) return absl::OkStatus();
    std::this_thread::yield();
  }
}

absl::Status SequenceSender::Close() {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  if (!impl_->entries.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("transfer: ", impl_->entries.size(), " transfers are still in flight"));
  }
  // The handshake, and the replies of steps still in flight.
  while (impl_->phase == Impl::Phase::kHello || impl_->next_reply < impl_->next_step) {
    FP4KV_RETURN_IF_ERROR(Progress());
    std::this_thread::yield();
  }
  if (impl_->phase == Impl::Phase::kBroken) return impl_->broken;
  unsigned char* out = impl_->out_frames[impl_->next_step % impl_->ring];
  std::memset(out, 0, impl_->frame_bytes);
  auto* head = reinterpret_cast<internal::FrameHead*>(out);
  *head = internal::FrameHead();
  head->kind = static_cast<uint16_t>(internal::FrameKind::kBye);
  head->frame_bytes = static_cast<uint32_t>(impl_->frame_bytes);
  head->round = static_cast<uint64_t>(impl_->next_step);
  internal::SealFrame(out, impl_->frame_bytes);
  absl::StatusOr<Transport::OpId> op = impl_->t->SendControl(out, impl_->frame_bytes);
  if (!op.ok()) return impl_->Break(op.status());
  impl_->last_heard = internal::NowMs();
  while (true) {
    absl::StatusOr<bool> done = impl_->t->Poll(*op);
    if (!done.ok()) return impl_->Break(done.status());
    if (*done) break;
    if (impl_->Expired()) {
      return impl_->Break(absl::DeadlineExceededError(
          absl::StrCat("transfer: the receiver did not take the bye within ",
                       impl_->o.timeout_ms, " ms")));
    }
    std::this_thread::yield();
  }
  impl_->Break(absl::FailedPreconditionError("transfer: the link was closed")).IgnoreError();
  return absl::OkStatus();
}

std::vector<TransferResult> SequenceSender::TakeResults() {
  if (impl_ == nullptr) return {};
  return std::exchange(impl_->results, {});
}

absl::StatusOr<TransferState> SequenceSender::State(TransferId id) const {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  auto it = impl_->entries.find(id);
  if (it != impl_->entries.end()) return it->second.state;
  return absl::NotFoundError(absl::StrCat("id: transfer ", id, " is not in flight"));
}

int64_t SequenceSender::in_flight() const {
  return impl_ == nullptr ? 0 : static_cast<int64_t>(impl_->entries.size());
}

// ============================================================== receiver

struct SequenceReceiver::Impl {
  struct Entry {
    TransferId id = 0;
    uint64_t handle = 0;
    int64_t image_bytes = 0;
    int64_t length = 0;
    int slot = -1;
    int64_t reply_step = 0;  // answered READY in this step; the payload comes in step + D
    bool plan_known = false;
    bool send = false;  // the plan sends it (else skipped by the sender)
    bool cancel = false;
    Transport::OpId op = 0;  // the payload's receive, once posted
  };
  enum class Phase { kHello, kRun, kLate, kClosed, kBroken };

  std::unique_ptr<internal::TransferCachePort> port;
  Transport* t = nullptr;
  TransferOptions o;
  internal::Buffers buf;
  int64_t hdr = 0;
  int64_t frame_bytes = 0;
  int depth = 1;
  unsigned char* out = nullptr;
  unsigned char* in = nullptr;
  unsigned char* hello_in = nullptr;
  unsigned char* hello_out = nullptr;
  std::vector<bool> slot_used;  // a commit read it: the next receive may wait for its event
  std::vector<int> free_slots;
  std::deque<Entry> entries;    // reserved, in reply order (= payload order)
  std::vector<internal::FrameEntry> acks;  // for the next reply
  size_t answers = 0;           // entries of the reply being built
  std::vector<TransferResult> results;
  std::function<bool(const TransferOffer&)> admit;
  int64_t step = 0;  // the offer expected (or being answered)
  Phase phase = Phase::kHello;
  Transport::OpId wait_op = 0;
  int64_t last_heard = 0;
  TransferId last_id = 0;
  absl::Status broken;

  unsigned char* slot_ptr(int s) const {
    return static_cast<unsigned char*>(buf.slots_) +
           static_cast<int64_t>(s) * internal::SlotStride(o.slot_bytes);
  }
  // Timed only while something is in flight: a sender may stay idle.
  bool Expired() const {
    return (!entries.empty() || phase == Phase::kLate) && o.timeout_ms > 0 &&
           internal::NowMs() - last_heard > o.timeout_ms;
  }

  absl::Status Break(absl::Status why) {
    if (phase == Phase::kBroken) return broken;
    phase = Phase::kBroken;
    broken = why;
    for (Entry& e : entries) {
      absl::Status c = port->Cancel(e.handle);
      results.push_back({e.id, 0, TransferState::kFailed,
                         absl::Status(why.code(), absl::StrCat("transfer ", e.id,
                                                               ": link broke (reservation "
                                                               "cancelled): ",
                                                               why.message(),
                                                               c.ok() ? "" : c.ToString())),
                         e.image_bytes, e.length});
    }
    entries.clear();
    return why;
  }

  void StartReply() {
    std::memset(out, 0, frame_bytes);
    auto* h = reinterpret_cast<internal::FrameHead*>(out);
    *h = internal::FrameHead();
    h->kind = static_cast<uint16_t>(internal::FrameKind::kReply);
    h->frame_bytes = static_cast<uint32_t>(frame_bytes);
    h->round = static_cast<uint64_t>(step);
    h->arg1 = hdr;
    answers = 0;
  }
  void PutEntry(size_t i, const internal::FrameEntry& fe) {
    std::memcpy(out + sizeof(internal::FrameHead) + i * sizeof(fe), &fe, sizeof(fe));
  }
  internal::FrameEntry GetEntry(size_t i) const {
    internal::FrameEntry fe;
    std::memcpy(&fe, in + sizeof(internal::FrameHead) + i * sizeof(fe), sizeof(fe));
    return fe;
  }

  // Posts the receive of offer `step` and of the payloads that follow it.
  absl::Status PostStep() {
    absl::StatusOr<Transport::OpId> r = t->RecvControl(in, frame_bytes);
    if (!r.ok()) return r.status();
    wait_op = *r;
    for (Entry& e : entries) {
      if (e.reply_step != step - depth) continue;
      if (port->device().is_cuda() && slot_used[e.slot]) {
        // The last commit out of this slot must have read it.
        absl::StatusOr<bool> read = internal::EventDone(buf.events_[e.slot]);
        if (!read.ok()) return read.status();
        if (!*read) {
          FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(t->stream(), buf.events_[e.slot], 0));
        }
      }
      absl::StatusOr<Transport::OpId> d = t->Recv(slot_ptr(e.slot), e.image_bytes);
      if (!d.ok()) return d.status();
      e.op = *d;
    }
    phase = Phase::kRun;
    return absl::OkStatus();
  }

  // Commits (or cancels) every payload that arrived, in order.
  absl::Status Payloads(bool* changed) {
    while (!entries.empty()) {
      Entry& e = entries.front();
      if (e.op == 0 || !e.plan_known) break;
      absl::StatusOr<bool> done = t->Poll(e.op);
      if (!done.ok()) return done.status();
      if (!*done) break;
      internal::FrameEntry ae;
      ae.id = e.id;
      ae.image_bytes = e.image_bytes;
      ae.length = e.length;
      if (!e.send || e.cancel) {
        absl::Status c = port->Cancel(e.handle);
        absl::Status why = absl::CancelledError(absl::StrCat(
            "transfer ", e.id, e.send ? ": cancelled by the receiver" : ": cancelled by the sender"));
        if (!c.ok()) why = c;
        ae.code = internal::kCodeCancelled;
        internal::SetMessage(ae, why);
        results.push_back({e.id, 0, TransferState::kCancelled, why, e.image_bytes, e.length});
      } else {
        absl::StatusOr<SequenceId> seq =
            port->Commit(e.handle, slot_ptr(e.slot), e.image_bytes, o.cache_stream);
        if (seq.ok() && port->device().is_cuda()) {
          slot_used[e.slot] = true;
          FP4KV_RETURN_IF_ERROR(internal::CudaStatus(
              cudaEventRecord(buf.events_[e.slot], o.cache_stream), "cudaEventRecord"));
        }
        if (seq.ok()) {
          ae.code = internal::kCodeCommitted;
          results.push_back({e.id, *seq, TransferState::kConfirmed, absl::OkStatus(),
                             e.image_bytes, e.length});
        } else {
          ae.code = internal::kCodeFailed;
          internal::SetMessage(ae, seq.status());
          results.push_back({e.id, 0, TransferState::kFailed, seq.status(), e.image_bytes,
                             e.length});
        }
      }
      acks.push_back(ae);
      free_slots.push_back(e.slot);
      entries.pop_front();
      last_heard = internal::NowMs();
      *changed = true;
    }
    return absl::OkStatus();
  }

  absl::Status OnOffer(bool* changed) {
    const auto* head = reinterpret_cast<const internal::FrameHead*>(in);
    const int cap = static_cast<int>(internal::FrameEntryCapacity(o.num_slots));
    if (head->kind == static_cast<uint16_t>(internal::FrameKind::kBye)) {
      FP4KV_RETURN_IF_ERROR(internal::CheckFrame(in, frame_bytes, internal::FrameKind::kBye,
                                                   static_cast<uint64_t>(step), 0));
      if (!entries.empty()) {
        return absl::DataLossError(absl::StrCat("transfer: bye with ", entries.size(),
                                                " transfers still reserved here"));
      }
      phase = Phase::kClosed;
      return absl::OkStatus();
    }
    FP4KV_RETURN_IF_ERROR(internal::CheckFrame(in, frame_bytes, internal::FrameKind::kOffer,
                                                 static_cast<uint64_t>(step), cap));
    // The plan names every READY of reply step - D, in order.
    std::vector<Entry*> planned;
    for (Entry& e : entries) {
      if (e.reply_step == step - depth) planned.push_back(&e);
    }
    if (head->arg1 != hdr || head->arg0 != static_cast<int64_t>(planned.size()) ||
        head->count < head->arg0) {
      return absl::DataLossError(absl::StrCat(
          "transfer offer ", step, ": ", head->count, " entries, ", head->arg0,
          " of them planned, headers of ", head->arg1, " bytes; expected ", planned.size(),
          " planned and headers of ", hdr));
    }
    const size_t num_plan = planned.size();
    const size_t num_offers = head->count - num_plan;
    if (num_offers > free_slots.size()) {
      return absl::DataLossError(absl::StrCat("transfer offer ", step, ": ", num_offers,
                                              " offers, but only ", free_slots.size(),
                                              " slots are free"));
    }
    // Validate every entry before acting on any.
    std::vector<internal::FrameEntry> fe(head->count);
    TransferId prev = last_id;
    for (size_t i = 0; i < fe.size(); ++i) {
      fe[i] = GetEntry(i);
      if (i < num_plan) {
        if (fe[i].id != planned[i]->id ||
            (fe[i].code != internal::kCodeSend && fe[i].code != internal::kCodeSkip) ||
            fe[i].image_bytes != planned[i]->image_bytes) {
          return absl::DataLossError(absl::StrCat(
              "transfer offer ", step, ": plan entry ", i, " names transfer ", fe[i].id, " code ",
              fe[i].code, ", expected transfer ", planned[i]->id));
        }
      } else if (fe[i].code != internal::kCodeOffer || fe[i].id <= prev ||
                 fe[i].image_bytes <= 0 || fe[i].image_bytes > o.slot_bytes) {
        return absl::DataLossError(absl::StrCat(
            "transfer offer ", step, ": entry ", i, " (transfer ", fe[i].id, ", ",
            fe[i].image_bytes, " bytes, code ", fe[i].code, "): expected an offer above ", prev,
            " of 1 .. ", o.slot_bytes, " bytes"));
      } else {
        prev = fe[i].id;
      }
    }
    last_id = prev;
    last_heard = internal::NowMs();
    *changed = true;
    for (size_t i = 0; i < num_plan; ++i) {
      planned[i]->plan_known = true;
      planned[i]->send = fe[i].code == internal::kCodeSend;
    }
    // Payloads already in (those before this offer) commit first, so that
    // their acks ride on this reply.
    FP4KV_RETURN_IF_ERROR(Payloads(changed));
    StartReply();
    const unsigned char* headers = in + internal::FrameHeadersOffset(o.num_slots);
    for (size_t i = 0; i < num_offers; ++i) {
      const internal::FrameEntry& of = fe[num_plan + i];
      internal::FrameEntry re;
      re.id = of.id;
      re.image_bytes = of.image_bytes;
      re.length = of.length;
      absl::Status why;
      if (admit && !admit(TransferOffer{of.id, of.image_bytes, of.length})) {
        why = absl::ResourceExhaustedError("not admitted");
      } else {
        absl::StatusOr<internal::TransferCachePort::Reserved> r =
            port->Reserve(headers + i * hdr, hdr);
        if (r.ok() && r->image_bytes != of.image_bytes) {
          port->Cancel(r->handle).IgnoreError();
          r = absl::DataLossError(absl::StrCat("the header says ", r->image_bytes,
                                               " bytes, the offer ", of.image_bytes));
        }
        if (r.ok()) {
          Entry e;
          e.id = of.id;
          e.handle = r->handle;
          e.image_bytes = of.image_bytes;
          e.length = r->length;
          e.slot = free_slots.back();
          free_slots.pop_back();
          e.reply_step = step;
          entries.push_back(e);
          re.code = internal::kCodeReady;
        } else {
          why = r.status();
        }
      }
      if (!why.ok()) {
        re.code = internal::kCodeNack;
        internal::SetMessage(re, why);
        results.push_back({of.id, 0, TransferState::kRefused, why, of.image_bytes, of.length});
      }
      PutEntry(answers++, re);
    }
    if ((head->flags & internal::kFlagLateReply) != 0) {
      phase = Phase::kLate;  // the reply waits for this step's payloads
      return absl::OkStatus();
    }
    return SendReply();
  }

  bool LatePayloadsIn() const {
    for (const Entry& e : entries) {
      if (e.reply_step <= step - depth) return false;
    }
    return true;
  }

  absl::Status SendReply() {
    auto* h = reinterpret_cast<internal::FrameHead*>(out);
    h->arg0 = static_cast<int64_t>(answers);  // the rest are acks
    for (const internal::FrameEntry& a : acks) PutEntry(answers++, a);
    acks.clear();
    h->count = static_cast<uint16_t>(answers);
    internal::SealFrame(out, frame_bytes);
    absl::StatusOr<Transport::OpId> s = t->SendControl(out, frame_bytes);
    if (!s.ok()) return s.status();
    ++step;
    return PostStep();
  }

  absl::Status Step(bool* changed) {
    switch (phase) {
      case Phase::kBroken:
        return broken;
      case Phase::kClosed:
        return absl::OkStatus();
      case Phase::kHello: {
        if (wait_op == 0) {
          absl::StatusOr<Transport::OpId> r =
              t->RecvControl(hello_in, sizeof(internal::FrameHead));
          if (!r.ok()) return r.status();
          wait_op = *r;
        }
        absl::StatusOr<bool> done = t->Poll(wait_op);
        if (!done.ok()) return done.status();
        if (!*done) return absl::OkStatus();
        FP4KV_RETURN_IF_ERROR(internal::CheckFrame(hello_in, sizeof(internal::FrameHead),
                                                     internal::FrameKind::kHello, 0, 0));
        const auto* peer = reinterpret_cast<const internal::FrameHead*>(hello_in);
        internal::FrameHead h;
        h.kind = static_cast<uint16_t>(internal::FrameKind::kHello);
        h.frame_bytes = sizeof(h);
        h.arg0 = o.slot_bytes;
        h.arg1 = o.num_slots;
        h.flags = static_cast<uint16_t>(depth);
        std::memcpy(hello_out, &h, sizeof(h));
        internal::SealFrame(hello_out, sizeof(h));
        absl::StatusOr<Transport::OpId> s = t->SendControl(hello_out, sizeof(h));
        if (!s.ok()) return s.status();
        if (peer->arg0 != o.slot_bytes || peer->arg1 != o.num_slots || peer->flags != depth) {
          return absl::FailedPreconditionError(absl::StrCat(
              "transfer hello: the sender has slot_bytes ", peer->arg0, " num_slots ",
              peer->arg1, " pipeline_depth ", peer->flags, ", the receiver ", o.slot_bytes, ", ",
              o.num_slots, " and ", depth, " (they must match)"));
        }
        *changed = true;
        return PostStep();
      }
      case Phase::kRun: {
        absl::StatusOr<bool> done = t->Poll(wait_op);
        if (!done.ok()) return done.status();
        if (*done) return OnOffer(changed);
        FP4KV_RETURN_IF_ERROR(Payloads(changed));
        break;
      }
      case Phase::kLate: {
        FP4KV_RETURN_IF_ERROR(Payloads(changed));
        if (LatePayloadsIn()) {
          *changed = true;
          return SendReply();
        }
        break;
      }
    }
    if (Expired()) {
      return absl::DeadlineExceededError(absl::StrCat("transfer: the sender did not continue within ",
                                                      o.timeout_ms, " ms (step ", step, ")"));
    }
    return absl::OkStatus();
  }
};

absl::StatusOr<SequenceReceiver> internal::CreateReceiver(std::unique_ptr<TransferCachePort> port,
                                                          Transport* transport,
                                                          const TransferOptions& options) {
  FP4KV_RETURN_IF_ERROR(CheckOptions(options, transport, port.get()));
  auto impl = std::make_unique<SequenceReceiver::Impl>();
  impl->hdr = port->header_bytes();
  impl->frame_bytes = FrameBytes(options.num_slots, impl->hdr);
  impl->depth = options.pipeline_depth;
  const int64_t host_bytes =
      2 * impl->frame_bytes + 2 * static_cast<int64_t>(sizeof(FrameHead));
  FP4KV_RETURN_IF_ERROR(impl->buf.Allocate(
      port->device(), internal::SlotStride(options.slot_bytes), options.num_slots, host_bytes));
  auto* h = static_cast<unsigned char*>(impl->buf.host_);
  impl->out = h;
  impl->in = h + impl->frame_bytes;
  impl->hello_out = impl->in + impl->frame_bytes;
  impl->hello_in = impl->hello_out + sizeof(FrameHead);
  impl->slot_used.assign(options.num_slots, false);
  for (int s = options.num_slots - 1; s >= 0; --s) impl->free_slots.push_back(s);
  impl->port = std::move(port);
  impl->t = transport;
  impl->o = options;
  return SequenceReceiver(std::move(impl));
}

absl::StatusOr<SequenceReceiver> SequenceReceiver::Create(KVCache* cache, Transport* transport,
                                                          const TransferOptions& options) {
  if (cache == nullptr) return absl::InvalidArgumentError("cache: expected a cache, got null");
  return internal::CreateReceiver(internal::MakeKVCachePort(cache), transport, options);
}

SequenceReceiver::SequenceReceiver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SequenceReceiver::SequenceReceiver(SequenceReceiver&&) noexcept = default;
SequenceReceiver& SequenceReceiver::operator=(SequenceReceiver&&) noexcept = default;
SequenceReceiver::~SequenceReceiver() {
  // Reservations still in flight go back to the cache.
  if (impl_ != nullptr) {
    for (Impl::Entry& e : impl_->entries) impl_->port->Cancel(e.handle).IgnoreError();
  }
}

void SequenceReceiver::SetAdmission(std::function<bool(const TransferOffer&)> admit) {
  if (impl_ != nullptr) impl_->admit = std::move(admit);
}

absl::Status SequenceReceiver::Cancel(TransferId id) {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  for (Impl::Entry& e : impl_->entries) {
    if (e.id == id) {
      e.cancel = true;
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(absl::StrCat("id: transfer ", id, " is not in flight here"));
}

absl::Status SequenceReceiver::Progress() {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  internal::DeviceScope scope(impl_->port->device());
  for (int i = 0; i < 4; ++i) {
    bool changed = false;
    absl::Status s = impl_->Step(&changed);
    if (!s.ok()) return impl_->Break(s);
    if (!changed) break;
  }
  return absl::OkStatus();
}

absl::Status SequenceReceiver::RunUntilResults(int64_t count) {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  // Also until the acks of what committed here are on their way: the
  // sender's last confirmations must not wait for a later call.
  while (static_cast<int64_t>(impl_->results.size()) < count || !impl_->acks.empty() ||
         impl_->phase == Impl::Phase::kLate) {
    FP4KV_RETURN_IF_ERROR(Progress());
    if (impl_->phase == Impl::Phase::kClosed) {
      return absl::FailedPreconditionError(absl::StrCat(
          "transfer: the sender closed the link with ", impl_->results.size(), " of ", count,
          " results here"));
    }
    std::this_thread::yield();
  }
  return absl::OkStatus();
}

bool SequenceReceiver::closed() const {
  return impl_ != nullptr && impl_->phase == Impl::Phase::kClosed;
}

std::vector<TransferResult> SequenceReceiver::TakeResults() {
  if (impl_ == nullptr) return {};
  return std::exchange(impl_->results, {});
}

int64_t SequenceReceiver::in_flight() const {
  return impl_ == nullptr ? 0 : static_cast<int64_t>(impl_->entries.size());
}

const char* TransferStateName(TransferState s) {
  switch (s) {
    case TransferState::kQueued: return "queued";
    case TransferState::kExporting: return "exporting";
    case TransferState::kReady: return "ready";
    case TransferState::kOffered: return "offered";
    case TransferState::kMoving: return "moving";
    case TransferState::kConfirmed: return "confirmed";
    case TransferState::kRefused: return "refused";
    case TransferState::kCancelled: return "cancelled";
    case TransferState::kFailed: return "failed";
  }
  return "?";
}

}  // namespace fp4kv
