// Internal: the bounded queue of KV events of a KVCache (KVCache::TakeEvents).
//
// At most max_events events are queued; an event that does not fit is
// dropped and counted. Consecutive pages of one sequence stored in one step
// form one kBlockStored event; consecutive removals merge into one
// kBlockRemoved event of up to kMaxMergedHashes hashes. A clear supersedes
// everything queued before it. Events are kept in flat arenas that keep
// their capacity, so queueing does not allocate in steady state; KVEvent
// objects are built only by Take(). Disabled (max_events == 0): every call
// is a no-op.
#ifndef FP4KV_SRC_KV_EVENT_QUEUE_H_
#define FP4KV_SRC_KV_EVENT_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

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
  size_t pending() const { return recs_.size(); }
  uint64_t dropped_total() const { return dropped_total_; }

  // One page entered the index: its hash, its parent's (null for a first
  // page) and its block_size token ids. `continues`: the page follows the
  // previous Stored page of the same sequence in this step (same event).
  void Stored(const BlockHash& hash, const BlockHash* parent, absl::Span<const int32_t> tokens,
              int32_t block_size, absl::string_view extra_key, bool continues);
  void Removed(const BlockHash& hash);
  void AllCleared();
  // Everything queued, and the number dropped since the previous call.
  KVEventBatch Take();

 private:
  struct Rec {
    KVEventType type;
    bool has_parent = false;
    BlockHash parent;
    uint32_t hash_begin = 0, hash_count = 0;  // into hashes_
    uint32_t token_begin = 0;                 // into tokens_ (hash_count * block_size ids)
    int32_t block_size = 0;
    uint32_t key = 0;  // into keys_
  };
  bool Admit();  // room for one more event; counts a drop otherwise

  size_t max_events_;
  std::vector<Rec> recs_;
  std::vector<BlockHash> hashes_;
  std::vector<int32_t> tokens_;
  std::vector<std::string> keys_;
  bool last_stored_dropped_ = false;  // a continuing page of a dropped event is dropped too
  uint64_t dropped_ = 0;              // since the last Take
  uint64_t dropped_total_ = 0;        // since creation
};

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_KV_EVENT_QUEUE_H_
