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

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "fp4kv/kv_events.h"
#include "src/host_alloc.h"

namespace fp4kv {
namespace internal {

class KVEventQueue {
 public:
  static constexpr size_t kMaxMergedHashes = 256;
  // The largest max_events KVCache::Create accepts
  // (prefix_cache.max_pending_events).
  static constexpr int64_t kMaxEvents = int64_t{1} << 24;
  // Host bytes Reserve() takes per page.
  static constexpr int64_t kReserveBytesPerPage = 64;

  explicit KVEventQueue(size_t max_events) : max_events_(max_events) {}

  // Capacity for min(max_events, pages) events of one page each (a step
  // stores or removes at most the pool's pages); ResourceExhausted naming
  // `call` when it cannot be had. A no-op when disabled.
  absl::Status Reserve(int64_t pages, const char* call);

  bool enabled() const { return max_events_ > 0; }
  size_t pending() const { return recs_.size(); }
  uint64_t dropped_total() const { return dropped_total_; }

  // One page entered the index: its hash, its parent's (null for a first
  // page) and its block_size token ids. `continues`: the page follows the
  // previous Stored page of the same sequence in this step (same event).
  void Stored(const BlockHash& hash, const BlockHash* parent, absl::Span<const int32_t> tokens,
              int32_t block_size, absl::string_view extra_key, bool continues,
              KVMedium medium = KVMedium::kGpu);
  // One page left the index of `medium`; consecutive removals of one medium
  // merge.
  void Removed(const BlockHash& hash, KVMedium medium = KVMedium::kGpu);
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
    KVMedium medium = KVMedium::kGpu;
  };
  bool Admit();  // room for one more event; counts a drop otherwise
  void Drop();   // counts one dropped event
  // Room in the arenas for one more record, `hashes` hashes and `tokens`
  // token ids (and a key when `key`), without throwing: false when the
  // memory cannot be had or an arena index would pass uint32.
  bool Room(bool rec, size_t hashes, size_t tokens, bool key);

  size_t max_events_;
  HostVector<Rec> recs_;
  HostVector<BlockHash> hashes_;
  HostVector<int32_t> tokens_;
  std::vector<std::string> keys_;     // one per run of events with the same extra key
  bool last_stored_dropped_ = false;  // a continuing page of a dropped event is dropped too
  uint64_t dropped_ = 0;              // since the last Take
  uint64_t dropped_total_ = 0;        // since creation
};

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_KV_EVENT_QUEUE_H_
