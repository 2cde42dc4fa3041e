// The transfer protocol: SequenceSender and SequenceReceiver state machines
// (docs/transfer.md). Both sides post mirrored operation sequences:
//
//   sender                        receiver
//   SendControl(hello)            RecvControl(hello)
//   RecvControl(hello)            SendControl(hello)
//   per round r:
//   SendControl(offer r)          RecvControl(offer r)      (bye ends the link)
//   RecvControl(reply r)          SendControl(reply r)
//   if any READY:
//   SendControl(plan r)           RecvControl(plan r)
//   Send(image) per planned       Recv(image) per planned
//   RecvControl(ack r)            SendControl(ack r)
//
// Which operations come next depends only on frames both sides have (the
// reply's READY set, the plan's send set), so the k-th operations always
// match.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "fp4kv/transfer.h"
#include "src/cuda_util.h"
#include "src/transfer/transfer_internal.h"
#include "xxhash.h"

#define FP4KV_RETURN_IF_ERROR_T(expr)        \
  do {                                        \
    if (absl::Status s_ = (expr); !s_.ok()) { \
      return s_;                              \
    }                                         \
  } while (0)

namespace fp4kv {
namespace internal {

void SealFrame(void* frame, int64_t bytes) {
  auto* head = static_cast<FrameHead*>(frame);
  head->checksum = 0;
  head->checksum = XXH3_64bits(frame, static_cast<size_t>(bytes));
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
  // Checksum over the frame with the checksum field zero.
  std::vector<unsigned char> copy(static_cast<const unsigned char*>(frame),
                                  static_cast<const unsigned char*>(frame) + bytes);
  reinterpret_cast<FrameHead*>(copy.data())->checksum = 0;
  const uint64_t sum = XXH3_64bits(copy.data(), copy.size());
  if (sum != head.checksum) {
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
  if (head.count > static_cast<uint32_t>(max_count)) {
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
  };
  enum class Phase { kHello, kIdle, kAwaitReply, kAwaitAck, kBroken };

  std::unique_ptr<internal::TransferCachePort> port;
  Transport* t = nullptr;
  TransferOptions o;
  internal::Buffers buf;
  int64_t hdr = 0;          // header bytes
  int64_t frame_bytes = 0;  // offer/reply/plan/ack frames
  unsigned char* out = nullptr;      // outgoing frame (host)
  unsigned char* in = nullptr;       // incoming frame (host)
  unsigned char* hello_in = nullptr;
  unsigned char* hello_out = nullptr;
  unsigned char* headers = nullptr;  // num_slots image headers (host)
  std::vector<int> free_slots;
  std::deque<Entry> entries;  // not final, in id order
  std::vector<TransferResult> results;
  TransferId next_id = 1;
  uint64_t round = 0;
  Phase phase = Phase::kHello;
  Transport::OpId wait_op = 0;
  int64_t deadline = 0;
  std::vector<TransferId> round_ids;  // offered this round, in order
  std::vector<TransferId> plan_ids;   // READY this round, in order
  absl::Status broken;

  unsigned char* slot_ptr(int s) const {
    return static_cast<unsigned char*>(buf.slots_) + static_cast<int64_t>(s) * internal::SlotStride(o.slot_bytes);
  }
  Entry* Find(TransferId id) {
    for (Entry& e : entries) {
      if (e.id == id) return &e;
    }
    return nullptr;
  }
  void Arm() { deadline = o.timeout_ms > 0 ? internal::NowMs() + o.timeout_ms : 0; }
  bool Expired() const { return deadline != 0 && internal::NowMs() > deadline; }

  void Finish(TransferId id, TransferState state, absl::Status status) {
    for (auto it = entries.begin(); it != entries.end(); ++it) {
      if (it->id != id) continue;
      if (state == TransferState::kConfirmed && o.release_on_confirm) {
        absl::Status r = port->Release(it->seq);
        if (!r.ok()) status = r;  // confirmed all the same: the receiver has it
      }
      if (it->slot >= 0) free_slots.push_back(it->slot);
      results.push_back({it->id, it->seq, state, std::move(status), it->image_bytes, it->length});
      entries.erase(it);
      return;
    }
  }

  absl::Status Break(absl::Status why) {
    if (phase == Phase::kBroken) return broken;
    phase = Phase::kBroken;
    broken = why;
    std::vector<TransferId> ids;
    for (const Entry& e : entries) ids.push_back(e.id);
    for (TransferId id : ids) {
      Finish(id, TransferState::kFailed,
             absl::Status(why.code(), absl::StrCat("transfer ", id, ": link broke (the sender "
                                                   "keeps the sequence): ", why.message())));
    }
    return why;
  }

  absl::StatusOr<bool> PollOp() {
    absl::StatusOr<bool> done = t->Poll(wait_op);
    if (!done.ok()) return done.status();
    if (!*done && Expired()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "transfer: the peer did not answer within ", o.timeout_ms, " ms (round ", round, ")"));
    }
    return *done;
  }

  absl::Status StartHello() {
    internal::FrameHead h;
    h.kind = static_cast<uint16_t>(internal::FrameKind::kHello);
    h.frame_bytes = sizeof(h);
    h.arg0 = o.slot_bytes;
    h.arg1 = o.num_slots;
    std::memcpy(hello_out, &h, sizeof(h));
    internal::SealFrame(hello_out, sizeof(h));
    absl::StatusOr<Transport::OpId> s = t->SendControl(hello_out, sizeof(h));
    if (!s.ok()) return s.status();
    absl::StatusOr<Transport::OpId> r = t->RecvControl(hello_in, sizeof(h));
    if (!r.ok()) return r.status();
    wait_op = *r;
    Arm();
    return absl::OkStatus();
  }

  absl::Status Exports() {
    for (Entry& e : entries) {
      if (e.state == TransferState::kQueued) {
        if (e.cancel || free_slots.empty()) continue;
        e.slot = free_slots.back();
        free_slots.pop_back();
        absl::Status s = port->Export(e.seq, slot_ptr(e.slot), o.slot_bytes, o.cache_stream);
        if (s.ok() && port->device().is_cuda()) {
          s = internal::CudaStatus(
              cudaMemcpyAsync(headers + e.slot * hdr, slot_ptr(e.slot), hdr,
                              cudaMemcpyDeviceToHost, o.cache_stream),
              "cudaMemcpyAsync(image header)");
          if (s.ok()) {
            s = internal::CudaStatus(cudaEventRecord(buf.events_[e.slot], o.cache_stream),
                                     "cudaEventRecord");
          }
        } else if (s.ok()) {
          std::memcpy(headers + e.slot * hdr, slot_ptr(e.slot), hdr);
        }
        if (!s.ok()) {
          e.cancel = true;  // finished below, outside the loop
          e.state = TransferState::kFailed;
          results.push_back({e.id, e.seq, TransferState::kFailed, s, e.image_bytes, e.length});
          continue;
        }
        e.state = TransferState::kExporting;
      }
      if (e.state == TransferState::kExporting) {
        absl::StatusOr<bool> done = internal::EventDone(
            port->device().is_cuda() ? buf.events_[e.slot] : nullptr);
        if (!done.ok()) return done.status();
        if (*done) e.state = TransferState::kReady;
      }
    }
    // Drop the entries whose export failed (already reported).
    for (auto it = entries.begin(); it != entries.end();) {
      if (it->state == TransferState::kFailed) {
        if (it->slot >= 0) free_slots.push_back(it->slot);
        it = entries.erase(it);
      } else {
        ++it;
      }
    }
    return absl::OkStatus();
  }

  absl::Status StartRound() {
    round_ids.clear();
    std::memset(out, 0, frame_bytes);
    auto* head = reinterpret_cast<internal::FrameHead*>(out);
    *head = internal::FrameHead();
    head->kind = static_cast<uint16_t>(internal::FrameKind::kOffer);
    head->frame_bytes = static_cast<uint32_t>(frame_bytes);
    head->round = round;
    head->arg1 = hdr;
    unsigned char* p = out + sizeof(internal::FrameHead);
    for (Entry& e : entries) {
      if (static_cast<int>(round_ids.size()) == o.num_slots) break;
      if (e.state != TransferState::kReady) continue;
      internal::FrameEntry fe;
      fe.id = e.id;
      fe.image_bytes = e.image_bytes;
      fe.length = e.length;
      std::memcpy(p, &fe, sizeof(fe));
      std::memcpy(p + sizeof(fe), headers + e.slot * hdr, hdr);
      p += sizeof(fe) + hdr;
      e.state = TransferState::kOffered;
      round_ids.push_back(e.id);
    }
    if (round_ids.empty()) return absl::OkStatus();
    head->count = static_cast<uint32_t>(round_ids.size());
    internal::SealFrame(out, frame_bytes);
    absl::StatusOr<Transport::OpId> s = t->SendControl(out, frame_bytes);
    if (!s.ok()) return s.status();
    absl::StatusOr<Transport::OpId> r = t->RecvControl(in, frame_bytes);
    if (!r.ok()) return r.status();
    wait_op = *r;
    phase = Phase::kAwaitReply;
    Arm();
    return absl::OkStatus();
  }

  absl::Status OnReply() {
    FP4KV_RETURN_IF_ERROR_T(internal::CheckFrame(in, frame_bytes, internal::FrameKind::kReply,
                                                 round, o.num_slots));
    const auto* head = reinterpret_cast<const internal::FrameHead*>(in);
    if (head->count != round_ids.size()) {
      return absl::DataLossError(absl::StrCat("transfer reply: expected ", round_ids.size(),
                                              " entries, got ", head->count));
    }
    plan_ids.clear();
    std::vector<std::pair<TransferId, absl::Status>> refused;
    std::vector<internal::FrameEntry> plan;
    for (size_t i = 0; i < round_ids.size(); ++i) {
      internal::FrameEntry fe;
      std::memcpy(&fe, in + sizeof(internal::FrameHead) + i * (sizeof(fe) + hdr), sizeof(fe));
      if (fe.id != round_ids[i] ||
          (fe.code != internal::kCodeReady && fe.code != internal::kCodeNack)) {
        return absl::DataLossError(absl::StrCat("transfer reply: entry ", i, " names transfer ",
                                                fe.id, " code ", fe.code, ", expected transfer ",
                                                round_ids[i]));
      }
      if (fe.code == internal::kCodeNack) {
        refused.push_back({fe.id, internal::EntryStatus(fe, "refused by the receiver")});
        continue;
      }
      Entry* e = Find(fe.id);
      internal::FrameEntry pe;
      pe.id = fe.id;
      pe.image_bytes = e->image_bytes;
      pe.code = e->cancel ? internal::kCodeSkip : internal::kCodeSend;
      plan.push_back(pe);
      plan_ids.push_back(fe.id);
      e->state = TransferState::kMoving;
    }
    for (auto& [id, st] : refused) Finish(id, TransferState::kRefused, st);
    if (plan.empty()) {  // round over: nothing READY
      ++round;
      phase = Phase::kIdle;
      return absl::OkStatus();
    }
    std::memset(out, 0, frame_bytes);
    auto* ph = reinterpret_cast<internal::FrameHead*>(out);
    *ph = internal::FrameHead();
    ph->kind = static_cast<uint16_t>(internal::FrameKind::kPlan);
    ph->frame_bytes = static_cast<uint32_t>(frame_bytes);
    ph->round = round;
    ph->arg1 = hdr;
    ph->count = static_cast<uint32_t>(plan.size());
    for (size_t i = 0; i < plan.size(); ++i) {
      std::memcpy(out + sizeof(internal::FrameHead) + i * (sizeof(plan[i]) + hdr), &plan[i],
                  sizeof(plan[i]));
    }
    internal::SealFrame(out, frame_bytes);
    absl::StatusOr<Transport::OpId> s = t->SendControl(out, frame_bytes);
    if (!s.ok()) return s.status();
    for (const internal::FrameEntry& pe : plan) {
      if (pe.code != internal::kCodeSend) continue;
      Entry* e = Find(pe.id);
      absl::StatusOr<Transport::OpId> d = t->Send(slot_ptr(e->slot), e->image_bytes);
      if (!d.ok()) return d.status();
    }
    absl::StatusOr<Transport::OpId> r = t->RecvControl(in, frame_bytes);
    if (!r.ok()) return r.status();
    wait_op = *r;
    phase = Phase::kAwaitAck;
    Arm();
    return absl::OkStatus();
  }

  absl::Status OnAck() {
    FP4KV_RETURN_IF_ERROR_T(internal::CheckFrame(in, frame_bytes, internal::FrameKind::kAck,
                                                 round, o.num_slots));
    const auto* head = reinterpret_cast<const internal::FrameHead*>(in);
    if (head->count != plan_ids.size()) {
      return absl::DataLossError(absl::StrCat("transfer ack: expected ", plan_ids.size(),
                                              " entries, got ", head->count));
    }
    std::vector<internal::FrameEntry> acks(plan_ids.size());
    for (size_t i = 0; i < plan_ids.size(); ++i) {
      std::memcpy(&acks[i], in + sizeof(internal::FrameHead) + i * (sizeof(acks[i]) + hdr),
                  sizeof(acks[i]));
      if (acks[i].id != plan_ids[i] ||
          (acks[i].code != internal::kCodeCommitted && acks[i].code != internal::kCodeCancelled &&
           acks[i].code != internal::kCodeFailed)) {
        return absl::DataLossError(absl::StrCat("transfer ack: entry ", i, " names transfer ",
                                                acks[i].id, " code ", acks[i].code,
                                                ", expected transfer ", plan_ids[i]));
      }
    }
    for (const internal::FrameEntry& a : acks) {
      Entry* e = Find(a.id);
      if (a.code == internal::kCodeCommitted) {
        Finish(a.id, TransferState::kConfirmed, absl::OkStatus());
      } else if (a.code == internal::kCodeCancelled || e->cancel) {
        Finish(a.id, TransferState::kCancelled,
               e->cancel ? absl::CancelledError(absl::StrCat("transfer ", a.id,
                                                             ": cancelled by the sender"))
                         : internal::EntryStatus(a, "cancelled by the receiver"));
      } else {
        Finish(a.id, TransferState::kFailed, internal::EntryStatus(a, "import failed"));
      }
    }
    ++round;
    phase = Phase::kIdle;
    return absl::OkStatus();
  }

  absl::Status Step() {
    if (phase == Phase::kBroken) return broken;
    FP4KV_RETURN_IF_ERROR_T(Exports());  // also while the handshake is on its way
    if (phase == Phase::kHello) {
      if (wait_op == 0) FP4KV_RETURN_IF_ERROR_T(StartHello());
      absl::StatusOr<bool> done = PollOp();
      if (!done.ok()) return done.status();
      if (!*done) return absl::OkStatus();
      absl::Status s = internal::CheckFrame(hello_in, sizeof(internal::FrameHead),
                                            internal::FrameKind::kHello, 0, 0);
      const auto* h = reinterpret_cast<const internal::FrameHead*>(hello_in);
      if (s.ok() && (h->arg0 != o.slot_bytes || h->arg1 != o.num_slots)) {
        s = absl::FailedPreconditionError(absl::StrCat(
            "transfer hello: the receiver has slot_bytes ", h->arg0, " num_slots ", h->arg1,
            ", the sender ", o.slot_bytes, " and ", o.num_slots, " (they must match)"));
      }
      if (!s.ok()) return s;
      phase = Phase::kIdle;
    }
    if (phase == Phase::kIdle) {
      // Transfers cancelled while not yet offered end here.
      std::vector<TransferId> cancelled;
      for (const Entry& e : entries) {
        if (e.cancel && (e.state == TransferState::kQueued || e.state == TransferState::kReady)) {
          cancelled.push_back(e.id);
        }
      }
      for (TransferId id : cancelled) {
        Finish(id, TransferState::kCancelled,
               absl::CancelledError(absl::StrCat("transfer ", id, ": cancelled by the sender")));
      }
      FP4KV_RETURN_IF_ERROR_T(StartRound());
      if (phase == Phase::kIdle) return absl::OkStatus();
    }
    absl::StatusOr<bool> done = PollOp();
    if (!done.ok()) return done.status();
    if (!*done) return absl::OkStatus();
    if (phase == Phase::kAwaitReply) return OnReply();
    return OnAck();
  }
};


absl::StatusOr<SequenceSender> internal::CreateSender(std::unique_ptr<TransferCachePort> port,
                                                      Transport* transport,
                                                      const TransferOptions& options) {
  FP4KV_RETURN_IF_ERROR_T(CheckOptions(options, transport, port.get()));
  auto impl = std::make_unique<SequenceSender::Impl>();
  impl->hdr = port->header_bytes();
  impl->frame_bytes = FrameBytes(options.num_slots, impl->hdr);
  const int64_t host_bytes =
      2 * impl->frame_bytes + 2 * static_cast<int64_t>(sizeof(FrameHead)) +
      options.num_slots * impl->hdr;
  FP4KV_RETURN_IF_ERROR_T(
      impl->buf.Allocate(port->device(), internal::SlotStride(options.slot_bytes), options.num_slots, host_bytes));
  auto* h = static_cast<unsigned char*>(impl->buf.host_);
  impl->out = h;
  impl->in = h + impl->frame_bytes;
  impl->hello_out = impl->in + impl->frame_bytes;
  impl->hello_in = impl->hello_out + sizeof(FrameHead);
  impl->headers = impl->hello_in + sizeof(FrameHead);
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
  for (const Impl::Entry& e : impl_->entries) {
    if (e.seq == seq) {
      return absl::InvalidArgumentError(
          absl::StrCat("seq: sequence ", seq, " is already being sent (transfer ", e.id, ")"));
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
  impl_->entries.push_back(e);
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
  e->cancel = true;
  return absl::OkStatus();
}

absl::Status SequenceSender::Progress() {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  internal::DeviceScope scope(impl_->port->device());
  // A few steps per call, so that a frame that is already there is answered
  // at once.
  for (int i = 0; i < 6; ++i) {
    const auto phase = impl_->phase;
    const uint64_t round = impl_->round;
    const size_t results = impl_->results.size();
    absl::Status s = impl_->Step();
    if (!s.ok()) return impl_->Break(s);
    if (phase == impl_->phase && round == impl_->round && results == impl_->results.size()) break;
  }
  return absl::OkStatus();
}

absl::Status SequenceSender::RunUntilIdle() {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  while (true) {
    FP4KV_RETURN_IF_ERROR_T(Progress());
    if (impl_->entries.empty() && impl_->phase != Impl::Phase::kHello) return absl::OkStatus();
    std::this_thread::yield();
  }
}

absl::Status SequenceSender::Close() {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  if (!impl_->entries.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("transfer: ", impl_->entries.size(), " transfers are still in flight"));
  }
  while (impl_->phase == Impl::Phase::kHello) {
    FP4KV_RETURN_IF_ERROR_T(Progress());
    std::this_thread::yield();
  }
  if (impl_->phase == Impl::Phase::kBroken) return impl_->broken;
  std::memset(impl_->out, 0, impl_->frame_bytes);
  auto* head = reinterpret_cast<internal::FrameHead*>(impl_->out);
  *head = internal::FrameHead();
  head->kind = static_cast<uint16_t>(internal::FrameKind::kBye);
  head->frame_bytes = static_cast<uint32_t>(impl_->frame_bytes);
  head->round = impl_->round;
  internal::SealFrame(impl_->out, impl_->frame_bytes);
  absl::StatusOr<Transport::OpId> op = impl_->t->SendControl(impl_->out, impl_->frame_bytes);
  if (!op.ok()) return impl_->Break(op.status());
  impl_->wait_op = *op;
  impl_->Arm();
  while (true) {
    absl::StatusOr<bool> done = impl_->PollOp();
    if (!done.ok()) return impl_->Break(done.status());
    if (*done) break;
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
  for (const Impl::Entry& e : impl_->entries) {
    if (e.id == id) return e.state;
  }
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
    bool send = false;  // the plan sends it
    bool cancel = false;
    TransferState state = TransferState::kOffered;
  };
  enum class Phase { kHello, kAwaitOffer, kAwaitPlan, kAwaitPayload, kClosed, kBroken };

  std::unique_ptr<internal::TransferCachePort> port;
  Transport* t = nullptr;
  TransferOptions o;
  internal::Buffers buf;
  int64_t hdr = 0;
  int64_t frame_bytes = 0;
  unsigned char* out = nullptr;
  unsigned char* in = nullptr;
  unsigned char* hello_in = nullptr;
  unsigned char* hello_out = nullptr;
  std::vector<bool> slot_used;  // a commit read it: the next receive waits for its event
  std::vector<Entry> entries;   // READY this round, in order
  std::vector<TransferResult> results;
  std::function<bool(const TransferOffer&)> admit;
  uint64_t round = 0;
  Phase phase = Phase::kHello;
  Transport::OpId wait_op = 0;
  bool have_wait = false;
  int64_t deadline = 0;
  TransferId last_id = 0;
  absl::Status broken;

  unsigned char* slot_ptr(int s) const {
    return static_cast<unsigned char*>(buf.slots_) + static_cast<int64_t>(s) * internal::SlotStride(o.slot_bytes);
  }
  void Arm() { deadline = o.timeout_ms > 0 ? internal::NowMs() + o.timeout_ms : 0; }

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

  absl::StatusOr<bool> PollOp(bool timed) {
    absl::StatusOr<bool> done = t->Poll(wait_op);
    if (!done.ok()) return done.status();
    if (!*done && timed && deadline != 0 && internal::NowMs() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "transfer: the peer did not continue within ", o.timeout_ms, " ms (round ", round, ")"));
    }
    return *done;
  }

  absl::Status PostOffer() {
    absl::StatusOr<Transport::OpId> r = t->RecvControl(in, frame_bytes);
    if (!r.ok()) return r.status();
    wait_op = *r;
    phase = Phase::kAwaitOffer;
    return absl::OkStatus();
  }

  void StartFrame(internal::FrameKind kind, size_t count) {
    std::memset(out, 0, frame_bytes);
    auto* h = reinterpret_cast<internal::FrameHead*>(out);
    *h = internal::FrameHead();
    h->kind = static_cast<uint16_t>(kind);
    h->frame_bytes = static_cast<uint32_t>(frame_bytes);
    h->round = round;
    h->arg1 = hdr;
    h->count = static_cast<uint32_t>(count);
  }
  void PutEntry(size_t i, const internal::FrameEntry& fe) {
    std::memcpy(out + sizeof(internal::FrameHead) + i * (sizeof(fe) + hdr), &fe, sizeof(fe));
  }
  internal::FrameEntry GetEntry(size_t i) const {
    internal::FrameEntry fe;
    std::memcpy(&fe, in + sizeof(internal::FrameHead) + i * (sizeof(fe) + hdr), sizeof(fe));
    return fe;
  }

  absl::Status OnOffer() {
    const auto* head = reinterpret_cast<const internal::FrameHead*>(in);
    if (head->kind == static_cast<uint16_t>(internal::FrameKind::kBye)) {
      FP4KV_RETURN_IF_ERROR_T(
          internal::CheckFrame(in, frame_bytes, internal::FrameKind::kBye, round, 0));
      phase = Phase::kClosed;
      return absl::OkStatus();
    }
    FP4KV_RETURN_IF_ERROR_T(internal::CheckFrame(in, frame_bytes, internal::FrameKind::kOffer,
                                                 round, o.num_slots));
    if (head->count == 0 || head->arg1 != hdr) {
      return absl::DataLossError(absl::StrCat("transfer offer: ", head->count,
                                              " entries with headers of ", head->arg1,
                                              " bytes, expected >= 1 and ", hdr));
    }
    // Validate every entry before reserving anything.
    std::vector<internal::FrameEntry> offers(head->count);
    for (size_t i = 0; i < offers.size(); ++i) {
      offers[i] = GetEntry(i);
      if (offers[i].id <= last_id || offers[i].image_bytes <= 0 ||
          offers[i].image_bytes > o.slot_bytes) {
        return absl::DataLossError(absl::StrCat(
            "transfer offer: entry ", i, " (transfer ", offers[i].id, ", ", offers[i].image_bytes,
            " bytes): expected an id above ", last_id, " and 1 .. ", o.slot_bytes, " bytes"));
      }
      last_id = offers[i].id;
    }
    entries.clear();
    StartFrame(internal::FrameKind::kReply, offers.size());
    int next_slot = 0;
    for (size_t i = 0; i < offers.size(); ++i) {
      const internal::FrameEntry& of = offers[i];
      internal::FrameEntry re;
      re.id = of.id;
      re.image_bytes = of.image_bytes;
      re.length = of.length;
      absl::Status why;
      const unsigned char* header =
          in + sizeof(internal::FrameHead) + i * (sizeof(of) + hdr) + sizeof(of);
      if (admit && !admit(TransferOffer{of.id, of.image_bytes, of.length})) {
        why = absl::ResourceExhaustedError("not admitted");
      } else {
        absl::StatusOr<internal::TransferCachePort::Reserved> r = port->Reserve(header, hdr);
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
          e.slot = next_slot++;
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
      PutEntry(i, re);
    }
    internal::SealFrame(out, frame_bytes);
    absl::StatusOr<Transport::OpId> s = t->SendControl(out, frame_bytes);
    if (!s.ok()) return s.status();
    if (entries.empty()) {
      ++round;
      return PostOffer();
    }
    absl::StatusOr<Transport::OpId> r = t->RecvControl(in, frame_bytes);
    if (!r.ok()) return r.status();
    wait_op = *r;
    phase = Phase::kAwaitPlan;
    Arm();
    return absl::OkStatus();
  }

  absl::Status OnPlan() {
    FP4KV_RETURN_IF_ERROR_T(internal::CheckFrame(in, frame_bytes, internal::FrameKind::kPlan,
                                                 round, o.num_slots));
    const auto* head = reinterpret_cast<const internal::FrameHead*>(in);
    if (head->count != entries.size()) {
      return absl::DataLossError(absl::StrCat("transfer plan: expected ", entries.size(),
                                              " entries, got ", head->count));
    }
    for (size_t i = 0; i < entries.size(); ++i) {
      internal::FrameEntry pe = GetEntry(i);
      if (pe.id != entries[i].id ||
          (pe.code != internal::kCodeSend && pe.code != internal::kCodeSkip) ||
          (pe.code == internal::kCodeSend && pe.image_bytes != entries[i].image_bytes)) {
        return absl::DataLossError(absl::StrCat("transfer plan: entry ", i, " names transfer ",
                                                pe.id, " code ", pe.code, ", expected transfer ",
                                                entries[i].id));
      }
      entries[i].send = pe.code == internal::kCodeSend;
    }
    bool any = false;
    for (Entry& e : entries) {
      e.state = TransferState::kMoving;
      if (!e.send) continue;
      if (port->device().is_cuda() && slot_used[e.slot]) {
        // The previous commit out of this slot must have read it.
        FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(t->stream(), buf.events_[e.slot], 0));
      }
      absl::StatusOr<Transport::OpId> d = t->Recv(slot_ptr(e.slot), e.image_bytes);
      if (!d.ok()) return d.status();
      wait_op = *d;
      any = true;
    }
    phase = Phase::kAwaitPayload;
    have_wait = any;
    Arm();
    return absl::OkStatus();
  }

  absl::Status OnPayload() {
    StartFrame(internal::FrameKind::kAck, entries.size());
    for (size_t i = 0; i < entries.size(); ++i) {
      Entry& e = entries[i];
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
          absl::Status s = internal::CudaStatus(cudaEventRecord(buf.events_[e.slot], o.cache_stream),
                                                "cudaEventRecord");
          if (!s.ok()) return s;
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
      PutEntry(i, ae);
    }
    entries.clear();
    internal::SealFrame(out, frame_bytes);
    absl::StatusOr<Transport::OpId> s = t->SendControl(out, frame_bytes);
    if (!s.ok()) return s.status();
    ++round;
    return PostOffer();
  }

  absl::Status Step() {
    switch (phase) {
      case Phase::kBroken:
        return broken;
      case Phase::kClosed:
        return absl::OkStatus();
      case Phase::kHello: {
        if (!have_wait) {
          absl::StatusOr<Transport::OpId> r =
              t->RecvControl(hello_in, sizeof(internal::FrameHead));
          if (!r.ok()) return r.status();
          wait_op = *r;
          have_wait = true;
        }
        absl::StatusOr<bool> done = PollOp(false);
        if (!done.ok()) return done.status();
        if (!*done) return absl::OkStatus();
        FP4KV_RETURN_IF_ERROR_T(internal::CheckFrame(hello_in, sizeof(internal::FrameHead),
                                                     internal::FrameKind::kHello, 0, 0));
        const auto* peer = reinterpret_cast<const internal::FrameHead*>(hello_in);
        internal::FrameHead h;
        h.kind = static_cast<uint16_t>(internal::FrameKind::kHello);
        h.frame_bytes = sizeof(h);
        h.arg0 = o.slot_bytes;
        h.arg1 = o.num_slots;
        std::memcpy(hello_out, &h, sizeof(h));
        internal::SealFrame(hello_out, sizeof(h));
        absl::StatusOr<Transport::OpId> s = t->SendControl(hello_out, sizeof(h));
        if (!s.ok()) return s.status();
        if (peer->arg0 != o.slot_bytes || peer->arg1 != o.num_slots) {
          return absl::FailedPreconditionError(absl::StrCat(
              "transfer hello: the sender has slot_bytes ", peer->arg0, " num_slots ",
              peer->arg1, ", the receiver ", o.slot_bytes, " and ", o.num_slots,
              " (they must match)"));
        }
        have_wait = false;
        return PostOffer();
      }
      case Phase::kAwaitOffer: {
        absl::StatusOr<bool> done = PollOp(false);
        if (!done.ok()) return done.status();
        return *done ? OnOffer() : absl::OkStatus();
      }
      case Phase::kAwaitPlan: {
        absl::StatusOr<bool> done = PollOp(true);
        if (!done.ok()) return done.status();
        return *done ? OnPlan() : absl::OkStatus();
      }
      case Phase::kAwaitPayload: {
        if (have_wait) {
          absl::StatusOr<bool> done = PollOp(true);
          if (!done.ok()) return done.status();
          if (!*done) return absl::OkStatus();
        }
        have_wait = false;
        return OnPayload();
      }
    }
    return absl::OkStatus();
  }
};

absl::StatusOr<SequenceReceiver> internal::CreateReceiver(std::unique_ptr<TransferCachePort> port,
                                                          Transport* transport,
                                                          const TransferOptions& options) {
  FP4KV_RETURN_IF_ERROR_T(CheckOptions(options, transport, port.get()));
  auto impl = std::make_unique<SequenceReceiver::Impl>();
  impl->hdr = port->header_bytes();
  impl->frame_bytes = FrameBytes(options.num_slots, impl->hdr);
  const int64_t host_bytes =
      2 * impl->frame_bytes + 2 * static_cast<int64_t>(sizeof(FrameHead));
  FP4KV_RETURN_IF_ERROR_T(
      impl->buf.Allocate(port->device(), internal::SlotStride(options.slot_bytes), options.num_slots, host_bytes));
  auto* h = static_cast<unsigned char*>(impl->buf.host_);
  impl->out = h;
  impl->in = h + impl->frame_bytes;
  impl->hello_out = impl->in + impl->frame_bytes;
  impl->hello_in = impl->hello_out + sizeof(FrameHead);
  impl->slot_used.assign(options.num_slots, false);
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
  // Reservations of an unfinished round go back to the cache.
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
  for (int i = 0; i < 6; ++i) {
    const auto phase = impl_->phase;
    const uint64_t round = impl_->round;
    absl::Status s = impl_->Step();
    if (!s.ok()) return impl_->Break(s);
    if (phase == impl_->phase && round == impl_->round) break;
  }
  return absl::OkStatus();
}

absl::Status SequenceReceiver::RunUntilResults(int64_t count) {
  FP4KV_TRANSFER_RETURN_IF_MOVED_FROM();
  while (static_cast<int64_t>(impl_->results.size()) < count) {
    FP4KV_RETURN_IF_ERROR_T(Progress());
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
