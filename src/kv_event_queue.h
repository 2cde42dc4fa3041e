// Internal: the bounded queue of KV events of a KVCache (KVCache::TakeEvents).
//
// At most max_events events are queued; an event that does not fit is
// dropped and counted. Consecutive removals merge into one kBlockRemoved
// event of up to kMaxMergedHashes hashes, so an eviction burst costs one
// queue entry. Disabled (max_events == 0): every call is a no-op.
#ifndef FP4KV_SRC_KV_EVENT_QUEUE_H_
#define FP4KV_SRC_KV_EVENT_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <deque>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "fp4kv/kv_events.h"

namespace fp4kv {
namespace internal {

class KVEventQueue {
 public:
  static constexpr size_t kMaxMergedHashes = 256;

  explicit KVEventQueue(size_t max_events) : max_events_(max_events) {}

  bool enabled() const { return max_events_ > 0; }
  size_t pending() const { return events_.size(); }
  uint64_t dropped_total() const { return dropped_total_; }

  // Pages [0, hashes.size()) of one sequence, consecutive; `tokens` holds
  // block_size ids per page.
  void Stored(absl::Span<const BlockHash> hashes, const BlockHash* parent,
              absl::Span<const int32_t> tokens, int32_t block_size, absl::string_view extra_key);
  void Removed(const BlockHash& hash);
  void AllCleared();
  // Everything queued, and the number dropped since the previous call.
  KVEventBatch Take();

 private:
  bool Admit();  // room for one more event; counts a drop otherwise

  size_t max_events_;
  std::deque<KVEvent> events_;
  uint64_t dropped_ = 0;        // since the last Take
  uint64_t dropped_total_ = 0;  // since creation
};

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_KV_EVENT_QUEUE_H_
