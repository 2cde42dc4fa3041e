// Internal: what the transfer protocol needs from a cache, so the protocol is
// tested against a scripted cache (failures on demand) as well as KVCache.
#ifndef FP4KV_SRC_TRANSFER_TRANSFER_INTERNAL_H_
#define FP4KV_SRC_TRANSFER_TRANSFER_INTERNAL_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp4kv/kv_cache.h"
#include "fp4kv/transfer.h"

namespace fp4kv {
namespace internal {

class TransferCachePort {
 public:
  struct Reserved {
    uint64_t handle = 0;
    int64_t image_bytes = 0;
    int64_t length = 0;
  };
  virtual ~TransferCachePort() = default;
  virtual Device device() const = 0;
  // Bytes of the host-parseable prefix of an image (the offer carries it).
  virtual int64_t header_bytes() const = 0;
  virtual absl::StatusOr<int64_t> ExportedBytes(SequenceId seq) const = 0;
  virtual absl::StatusOr<int64_t> Length(SequenceId seq) const = 0;
  // Async on `stream` into device (or host, CPU) memory.
  virtual absl::Status Export(SequenceId seq, void* dst, int64_t dst_bytes,
                              Stream stream) const = 0;
  virtual absl::Status Release(SequenceId seq) = 0;
  // Parses an image header (host bytes) and reserves its pages all or
  // nothing.
  virtual absl::StatusOr<Reserved> Reserve(const void* header, int64_t bytes) = 0;
  // Imports the image into the reserved pages (async on `stream`); the
  // reservation is gone afterwards whatever the result.
  virtual absl::StatusOr<SequenceId> Commit(uint64_t handle, const void* image, int64_t bytes,
                                            Stream stream) = 0;
  virtual absl::Status Cancel(uint64_t handle) = 0;
};

std::unique_ptr<TransferCachePort> MakeKVCachePort(KVCache* cache);

absl::StatusOr<SequenceSender> CreateSender(std::unique_ptr<TransferCachePort> port,
                                            Transport* transport, const TransferOptions& options);
absl::StatusOr<SequenceReceiver> CreateReceiver(std::unique_ptr<TransferCachePort> port,
                                                Transport* transport,
                                                const TransferOptions& options);

// Control frames (docs/transfer.md, "Frames").
inline constexpr uint32_t kFrameMagic = 0x58344b46;  // "FK4X" little-endian
inline constexpr uint16_t kFrameVersion = 2;
enum class FrameKind : uint16_t { kHello = 1, kOffer = 2, kReply = 3, kBye = 6 };

// FrameHead::flags of an offer: the receiver answers it only after this
// step's payloads arrived and were committed (so the reply acks them). The
// sender sets it when it has nothing more to offer: the pipeline drains.
inline constexpr uint16_t kFlagLateReply = 1;

struct FrameHead {
  uint32_t magic = kFrameMagic;
  uint16_t version = kFrameVersion;
  uint16_t kind = 0;
  uint32_t frame_bytes = 0;  // the whole frame
  uint16_t count = 0;        // entries used
  uint16_t flags = 0;        // offer: kFlagLateReply; hello: pipeline depth
  uint64_t round = 0;        // the step
  uint64_t checksum = 0;  // XXH3-64 (docs/transfer.md, "Frames")
  int64_t arg0 = 0;       // hello: slot_bytes; offer: plan entries; reply: reply entries
  int64_t arg1 = 0;       // hello: num_slots; others: header bytes per offer
};
static_assert(sizeof(FrameHead) == 48, "frame head layout");

// Entry codes.
enum : int32_t {
  kCodeReady = 1,      // reply: reserved, send the payload
  kCodeNack = 2,       // reply: refused (reason in the entry)
  kCodeSend = 3,       // offer's plan: this step's payload of the transfer is its image
  kCodeSkip = 4,       // offer's plan: cancelled by the sender (the bytes still move)
  kCodeCommitted = 5,  // reply's ack
  kCodeCancelled = 6,  // reply's ack: cancelled by the receiver (or skipped)
  kCodeFailed = 7,     // reply's ack: the import failed
  kCodeOffer = 8,      // offer: a new transfer (its image header follows the entries)
};

inline constexpr int kEntryMessageBytes = 80;
struct FrameEntry {
  uint64_t id = 0;
  int64_t image_bytes = 0;
  int64_t length = 0;
  int32_t code = 0;
  int32_t status_code = 0;  // absl::StatusCode of a refusal or failure
  char message[kEntryMessageBytes] = {};
};
static_assert(sizeof(FrameEntry) == 112, "frame entry layout");

// A frame of a link with `num_slots` slots: the head, 2 * num_slots entries
// (an offer holds a plan and new offers, a reply answers and acks; each at
// most num_slots), then num_slots image headers (the i-th belongs to the
// i-th kCodeOffer entry).
inline int64_t FrameEntryCapacity(int num_slots) { return 2 * static_cast<int64_t>(num_slots); }
inline int64_t FrameHeadersOffset(int num_slots) {
  return static_cast<int64_t>(sizeof(FrameHead)) +
         FrameEntryCapacity(num_slots) * static_cast<int64_t>(sizeof(FrameEntry));
}
inline int64_t FrameBytes(int num_slots, int64_t header_bytes) {
  return FrameHeadersOffset(num_slots) + num_slots * header_bytes;
}

// Writes the checksum into a complete frame.
void SealFrame(void* frame, int64_t bytes);
// Checks magic, version, size, checksum, kind, round and count bounds:
// DataLoss naming what is wrong.
absl::Status CheckFrame(const void* frame, int64_t bytes, FrameKind kind, uint64_t round,
                        int max_count);
// An entry's status: the code and the message (cut to kEntryMessageBytes - 1
// bytes) of `s`, and back, the message prefixed by `what`.
void SetMessage(FrameEntry& e, const absl::Status& s);
absl::Status EntryStatus(const FrameEntry& e, const char* what);

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_TRANSFER_TRANSFER_INTERNAL_H_
