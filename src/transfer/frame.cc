// Control frames (docs/transfer.md, "Frames"): the checksum that seals a
// frame, the checks of a received one, and the status message an entry
// carries.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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
    return absl::DataLossError(absl::StrCat("transfer frame: expected at least ", sizeof(FrameHead),
                                            " bytes, got ", bytes));
  }
  FrameHead head;
  std::memcpy(&head, frame, sizeof(head));
  if (head.magic != kFrameMagic) {
    return absl::DataLossError(absl::StrCat("transfer frame: bad magic 0x", absl::Hex(head.magic)));
  }
  if (head.version != kFrameVersion) {
    return absl::DataLossError(
        absl::StrCat("transfer frame: expected version ", kFrameVersion, ", got ", head.version));
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
    return absl::DataLossError(
        absl::StrCat("transfer frame: expected at most ", max_count, " entries, got ", head.count));
  }
  return absl::OkStatus();
}

void SetMessage(FrameEntry& e, const absl::Status& s) {
  e.status_code = static_cast<int32_t>(s.code());
  std::string m(s.message());
  std::snprintf(e.message, sizeof(e.message), "%s", m.c_str());
}

absl::Status EntryStatus(const FrameEntry& e, const char* what) {
  std::string m(e.message, strnlen(e.message, sizeof(e.message)));
  return absl::Status(static_cast<absl::StatusCode>(e.status_code), absl::StrCat(what, ": ", m));
}

}  // namespace internal
}  // namespace fp4kv
