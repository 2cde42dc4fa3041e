// The sending side of the transfer protocol (protocol.cc has the overview):
// SequenceSender exports sequences into slots, offers them, sends the images
// the receiver answered READY, and finishes each transfer on its ack.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "fp4kv/transfer.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"
#include "src/transfer/protocol_internal.h"
#include "src/transfer/transfer_internal.h"

namespace fp4kv {

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
  int ring = 2;        // depth + 1 frames each way
  int max_offers = 1;  // new offers per step: max(1, num_slots / (depth + 2))
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
  int64_t next_step = 0;                   // the next step to post
  int64_t next_reply = 0;                  // the oldest posted step whose reply is not processed
  std::vector<Transport::OpId> reply_ops;  // [step % ring]
  std::vector<std::vector<TransferId>> offered;         // [step % ring]: offered in that step
  std::map<int64_t, std::vector<TransferId>> ready_at;  // reply step -> READY ids (payload pending)
  std::deque<TransferId> unacked;                       // payload sent, in send order
  int64_t last_heard = 0;                               // ms: the last reply (timeouts)
  absl::Status broken;

  unsigned char* slot_ptr(int s) const {
    return static_cast<unsigned char*>(buf.slots_) +
           static_cast<int64_t>(s) * internal::SlotStride(o.slot_bytes);
  }
  Entry* Find(TransferId id) {
    auto it = entries.find(id);
    return it == entries.end() ? nullptr : &it->second;
  }
  bool Expired() const { return o.timeout_ms > 0 && internal::NowMs() - last_heard > o.timeout_ms; }
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
             absl::Status(why.code(), absl::StrCat("transfer ", id,
                                                   ": link broke (the sender "
                                                   "keeps the sequence): ",
                                                   why.message())));
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
      s = absl::FailedPreconditionError(
          absl::StrCat("transfer hello: the receiver has slot_bytes ", h->arg0, " num_slots ",
                       h->arg1, " pipeline_depth ", h->flags, ", the sender ", o.slot_bytes, ", ",
                       o.num_slots, " and ", depth, " (they must match)"));
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
            Finish(
                id, TransferState::kCancelled,
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
    FP4KV_RETURN_IF_ERROR(
        internal::CheckFrame(in, frame_bytes, internal::FrameKind::kReply, static_cast<uint64_t>(j),
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
                                                " names transfer ", fe[i].id, " code ", fe[i].code,
                                                ", expected transfer ", want));
      }
    }
    const size_t acks = fe.size() - offers.size();
    if (acks < unacked.size() && entries.at(unacked[acks]).ack_step <= j) {
      return absl::DataLossError(
          absl::StrCat("transfer reply ", j, ": expected the ack of transfer ", unacked[acks]));
    }
    std::vector<TransferId>& now_ready = ready_at[j];
    for (size_t i = 0; i < offers.size(); ++i) {
      Entry& e = entries.at(offers[i]);
      if (fe[i].code == internal::kCodeNack) {
        Finish(e.id, TransferState::kRefused,
               internal::EntryStatus(fe[i], "refused by the receiver"));
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
               e.skip ? absl::CancelledError(
                            absl::StrCat("transfer ", a.id, ": cancelled by the sender"))
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
  // Small and bounded: num_slots <= 256 and pipeline_depth <= 4
  // (CheckOptions), hdr a constant of the image format; so are the per-slot
  // and per-step vectors below. Allocate checks the sizes against what is
  // available.
  const int64_t host_bytes = 2 * impl->ring * impl->frame_bytes +
                             2 * static_cast<int64_t>(sizeof(FrameHead)) +
                             options.num_slots * impl->hdr;
  FP4KV_RETURN_IF_ERROR(impl->buf.Allocate("SequenceSender::Create", port->device(),
                                           options.slot_bytes, options.num_slots, host_bytes));
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
      return impl_->Break(absl::DeadlineExceededError(absl::StrCat(
          "transfer: the receiver did not take the bye within ", impl_->o.timeout_ms, " ms")));
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

}  // namespace fp4kv
