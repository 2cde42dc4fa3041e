#include "src/kv_event_queue.h"

namespace fp4kv {
namespace internal {

bool KVEventQueue::Admit() {
  if (recs_.size() < max_events_) return true;
  ++dropped_;
  ++dropped_total_;
  return false;
}

void KVEventQueue::Stored(const BlockHash& hash, const BlockHash* parent,
                          absl::Span<const int32_t> tokens, int32_t block_size,
                          absl::string_view extra_key, bool continues) {
  if (!enabled()) return;
  if (continues && last_stored_dropped_) return;
  if (!(continues && !recs_.empty() && recs_.back().type == KVEventType::kBlockStored)) {
    last_stored_dropped_ = !Admit();
    if (last_stored_dropped_) return;
    Rec r;
    r.type = KVEventType::kBlockStored;
    r.has_parent = parent != nullptr;
    if (parent != nullptr) r.parent = *parent;
    r.hash_begin = static_cast<uint32_t>(hashes_.size());
    r.token_begin = static_cast<uint32_t>(tokens_.size());
    r.block_size = block_size;
    if (keys_.empty() || keys_.back() != extra_key) keys_.emplace_back(extra_key);
    r.key = static_cast<uint32_t>(keys_.size() - 1);
    recs_.push_back(r);
  }
  hashes_.push_back(hash);
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  ++recs_.back().hash_count;
}

void KVEventQueue::Removed(const BlockHash& hash) {
  if (!enabled()) return;
  if (recs_.empty() || recs_.back().type != KVEventType::kBlockRemoved ||
      recs_.back().hash_count >= kMaxMergedHashes) {
    if (!Admit()) return;
    Rec r;
    r.type = KVEventType::kBlockRemoved;
    r.hash_begin = static_cast<uint32_t>(hashes_.size());
    recs_.push_back(r);
  }
  hashes_.push_back(hash);
  ++recs_.back().hash_count;
}

void KVEventQueue::AllCleared() {
  if (!enabled()) return;
  // Everything queued before is superseded: a router starts over from here.
  recs_.clear();
  hashes_.clear();
  tokens_.clear();
  keys_.clear();
  Rec r;
  r.type = KVEventType::kAllBlocksCleared;
  recs_.push_back(r);
}

KVEventBatch KVEventQueue::Take() {
  KVEventBatch b;
  b.events.resize(recs_.size());
  for (size_t i = 0; i < recs_.size(); ++i) {
    const Rec& r = recs_[i];
    KVEvent& e = b.events[i];
    e.type = r.type;
    e.block_hashes.assign(hashes_.begin() + r.hash_begin,
                          hashes_.begin() + r.hash_begin + r.hash_count);
    if (r.type != KVEventType::kBlockStored) continue;
    e.has_parent = r.has_parent;
    e.parent_block_hash = r.parent;
    e.block_size = r.block_size;
    const size_t n = static_cast<size_t>(r.hash_count) * r.block_size;
    e.token_ids.assign(tokens_.begin() + r.token_begin, tokens_.begin() + r.token_begin + n);
    e.extra_key = keys_[r.key];
  }
  recs_.clear();
  hashes_.clear();
  tokens_.clear();
  keys_.clear();
  last_stored_dropped_ = false;
  b.dropped = dropped_;
  dropped_ = 0;
  return b;
}

}  // namespace internal
}  // namespace fp4kv
