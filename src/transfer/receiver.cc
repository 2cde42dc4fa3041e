// The receiving side of the transfer protocol (protocol.cc has the overview):
// SequenceReceiver answers offers (admission, reservation), receives the
// images into slots, commits them in order and acks them on the next reply.
#include <cuda_runtime_api.h>

#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fp4kv/transfer.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"
#include "src/transfer/protocol_internal.h"
#include "src/transfer/transfer_internal.h"

namespace fp4kv {

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
  std::deque<Entry> entries;               // reserved, in reply order (= payload order)
  std::vector<internal::FrameEntry> acks;  // for the next reply
  size_t answers = 0;                      // entries of the reply being built
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
      results.push_back(
          {e.id, 0, TransferState::kFailed,
           absl::Status(why.code(), absl::StrCat("transfer ", e.id,
                                                 ": link broke (reservation "
                                                 "cancelled): ",
                                                 why.message(), c.ok() ? "" : c.ToString())),
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
        absl::Status why = absl::CancelledError(
            absl::StrCat("transfer ", e.id,
                         e.send ? ": cancelled by the receiver" : ": cancelled by the sender"));
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
          results.push_back(
              {e.id, *seq, TransferState::kConfirmed, absl::OkStatus(), e.image_bytes, e.length});
        } else {
          ae.code = internal::kCodeFailed;
          internal::SetMessage(ae, seq.status());
          results.push_back(
              {e.id, 0, TransferState::kFailed, seq.status(), e.image_bytes, e.length});
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
        return absl::DataLossError(
            absl::StrCat("transfer: bye with ", entries.size(), " transfers still reserved here"));
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
      return absl::DataLossError(
          absl::StrCat("transfer offer ", step, ": ", head->count, " entries, ", head->arg0,
                       " of them planned, headers of ", head->arg1, " bytes; expected ",
                       planned.size(), " planned and headers of ", hdr));
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
          return absl::DataLossError(
              absl::StrCat("transfer offer ", step, ": plan entry ", i, " names transfer ",
                           fe[i].id, " code ", fe[i].code, ", expected transfer ", planned[i]->id));
        }
      } else if (fe[i].code != internal::kCodeOffer || fe[i].id <= prev || fe[i].image_bytes <= 0 ||
                 fe[i].image_bytes > o.slot_bytes) {
        return absl::DataLossError(
            absl::StrCat("transfer offer ", step, ": entry ", i, " (transfer ", fe[i].id, ", ",
                         fe[i].image_bytes, " bytes, code ", fe[i].code,
                         "): expected an offer above ", prev, " of 1 .. ", o.slot_bytes, " bytes"));
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
          absl::StatusOr<Transport::OpId> r = t->RecvControl(hello_in, sizeof(internal::FrameHead));
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
          return absl::FailedPreconditionError(
              absl::StrCat("transfer hello: the sender has slot_bytes ", peer->arg0, " num_slots ",
                           peer->arg1, " pipeline_depth ", peer->flags, ", the receiver ",
                           o.slot_bytes, ", ", o.num_slots, " and ", depth, " (they must match)"));
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
      return absl::DeadlineExceededError(absl::StrCat(
          "transfer: the sender did not continue within ", o.timeout_ms, " ms (step ", step, ")"));
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
  // Small and bounded: num_slots <= 256 and pipeline_depth <= 4
  // (CheckOptions), hdr a constant of the image format; so are the per-slot
  // and per-step vectors below. Allocate checks the sizes against what is
  // available.
  const int64_t host_bytes = 2 * impl->frame_bytes + 2 * static_cast<int64_t>(sizeof(FrameHead));
  FP4KV_RETURN_IF_ERROR(impl->buf.Allocate("SequenceReceiver::Create", port->device(),
                                           options.slot_bytes, options.num_slots, host_bytes));
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
      return absl::FailedPreconditionError(
          absl::StrCat("transfer: the sender closed the link with ", impl_->results.size(), " of ",
                       count, " results here"));
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

}  // namespace fp4kv
