#include "src/kv_event_queue.h"

#include <algorithm>
#include <new>
#include <stdexcept>

#include "src/status_macros.h"

namespace fp4kv {
namespace internal {

absl::Status KVEventQueue::Reserve(int64_t pages, const char* call) {
  static_assert(sizeof(Rec) + sizeof(BlockHash) <= kReserveBytesPerPage,
                "PlanCapacity counts kReserveBytesPerPage a page");
  if (!enabled()) return absl::OkStatus();
  const int64_t n =
      static_cast<int64_t>(std::min<uint64_t>(max_events_, std::max<int64_t>(pages, 0)));
  FP4KV_RETURN_IF_ERROR(ReserveHost(&recs_, n, call, "the KV event queue"));
  return ReserveHost(&hashes_, n, call, "the KV event queue's hashes");
}

bool KVEventQueue::Admit() {
  if (recs_.size() < max_events_) return true;
  Drop();
  return false;
}

void KVEventQueue::Drop() {
  ++dropped_;
  ++dropped_total_;
}

bool KVEventQueue::Room(bool rec, size_t hashes, size_t tokens, bool key) {
  if (hashes > UINT32_MAX - hashes_.size() || tokens > UINT32_MAX - tokens_.size() ||
      keys_.size() >= UINT32_MAX) {
    return false;
  }
  try {
    if (rec && recs_.size() == recs_.capacity()) recs_.reserve(2 * recs_.size() + 16);
    if (hashes_.size() + hashes > hashes_.capacity()) {
      hashes_.reserve(std::max(2 * hashes_.size(), hashes_.size() + hashes) + 16);
    }
    if (tokens_.size() + tokens > tokens_.capacity()) {
      tokens_.reserve(std::max(2 * tokens_.size(), tokens_.size() + tokens) + 256);
    }
    if (key && keys_.size() == keys_.capacity()) keys_.reserve(2 * keys_.size() + 4);
  } catch (const std::bad_alloc&) {
    return false;
  } catch (const std::length_error&) {
    return false;
  }
  return true;
}

void KVEventQueue::Stored(const BlockHash& hash, const BlockHash* parent,
                          absl::Span<const int32_t> tokens, int32_t block_size,
                          absl::string_view extra_key, bool continues, KVMedium medium) {
  if (!enabled()) return;
  if (continues && last_stored_dropped_) return;
  const bool new_event =
      !(continues && !recs_.empty() && recs_.back().type == KVEventType::kBlockStored &&
        recs_.back().medium == medium);
  const bool new_key = new_event && (keys_.empty() || keys_.back() != extra_key);
  if (new_event) {
    last_stored_dropped_ = !Admit();
    if (last_stored_dropped_) return;
  }
  if (!Room(new_event, 1, tokens.size(), new_key)) {
    // Dropped as an event that did not fit (a continuing page ends its
    // event: it and the pages after it in this step count as one drop).
    Drop();
    last_stored_dropped_ = true;
    return;
  }
  if (new_event) {
    Rec r;
    r.type = KVEventType::kBlockStored;
    r.has_parent = parent != nullptr;
    if (parent != nullptr) r.parent = *parent;
    r.hash_begin = static_cast<uint32_t>(hashes_.size());
    r.token_begin = static_cast<uint32_t>(tokens_.size());
    r.block_size = block_size;
    r.medium = medium;
    if (new_key) {
      try {
        keys_.emplace_back(extra_key);
      } catch (const std::bad_alloc&) {
        Drop();
        last_stored_dropped_ = true;
        return;
      }
    }
    r.key = static_cast<uint32_t>(keys_.size() - 1);
    recs_.push_back(r);
  }
  hashes_.push_back(hash);
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  ++recs_.back().hash_count;
}

void KVEventQueue::Removed(const BlockHash& hash, KVMedium medium) {
  if (!enabled()) return;
  if (recs_.empty() || recs_.back().type != KVEventType::kBlockRemoved ||
      recs_.back().medium != medium || recs_.back().hash_count >= kMaxMergedHashes) {
    if (!Admit()) return;
    if (!Room(true, 1, 0, false)) {
      Drop();
      return;
    }
    Rec r;
    r.type = KVEventType::kBlockRemoved;
    r.medium = medium;
    r.hash_begin = static_cast<uint32_t>(hashes_.size());
    recs_.push_back(r);
  } else if (!Room(false, 1, 0, false)) {
    Drop();
    return;
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
  if (!Room(true, 0, 0, false)) {
    Drop();
    return;
  }
  recs_.push_back(r);
}

KVEventBatch KVEventQueue::Take() {
  KVEventBatch b;
  b.events.resize(recs_.size());
  for (size_t i = 0; i < recs_.size(); ++i) {
    const Rec& r = recs_[i];
    KVEvent& e = b.events[i];
    e.type = r.type;
    e.medium = r.medium;
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
