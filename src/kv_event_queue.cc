#include "src/kv_event_queue.h"

#include <utility>

namespace fp4kv {
namespace internal {

bool KVEventQueue::Admit() {
  if (events_.size() < max_events_) return true;
  ++dropped_;
  ++dropped_total_;
  return false;
}

void KVEventQueue::Stored(absl::Span<const BlockHash> hashes, const BlockHash* parent,
                          absl::Span<const int32_t> tokens, int32_t block_size,
                          absl::string_view extra_key) {
  if (!enabled() || hashes.empty() || !Admit()) return;
  KVEvent e;
  e.type = KVEventType::kBlockStored;
  e.block_hashes.assign(hashes.begin(), hashes.end());
  e.has_parent = parent != nullptr;
  if (parent != nullptr) e.parent_block_hash = *parent;
  e.token_ids.assign(tokens.begin(), tokens.end());
  e.block_size = block_size;
  e.extra_key.assign(extra_key.data(), extra_key.size());
  events_.push_back(std::move(e));
}

void KVEventQueue::Removed(const BlockHash& hash) {
  if (!enabled()) return;
  if (!events_.empty() && events_.back().type == KVEventType::kBlockRemoved &&
      events_.back().block_hashes.size() < kMaxMergedHashes) {
    events_.back().block_hashes.push_back(hash);
    return;
  }
  if (!Admit()) return;
  KVEvent e;
  e.type = KVEventType::kBlockRemoved;
  e.block_hashes.push_back(hash);
  events_.push_back(std::move(e));
}

void KVEventQueue::AllCleared() {
  if (!enabled()) return;
  // Everything queued before is superseded: a router starts over from here.
  events_.clear();
  KVEvent e;
  e.type = KVEventType::kAllBlocksCleared;
  events_.push_back(std::move(e));
}

KVEventBatch KVEventQueue::Take() {
  KVEventBatch b;
  b.events.assign(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  b.dropped = dropped_;
  dropped_ = 0;
  return b;
}

}  // namespace internal
}  // namespace fp4kv
