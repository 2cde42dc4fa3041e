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
//
// This file: the option checks both sides share and the names of the
// states. The frames are in frame.cc, the slot memory in buffers.cc, the
// sides in sender.cc and receiver.cc.
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "fp4kv/transfer.h"
#include "src/transfer/protocol_internal.h"
#include "src/transfer/transfer_internal.h"

namespace fp4kv {
namespace internal {

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

}  // namespace internal

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
