// KVCache prefix index: page hashing and indexing (deferred out of
// PrepareStep), matching, events.
#include <algorithm>

#include "src/kv_cache/state.h"

namespace fp4kv {

using internal::CeilDiv;
using internal::KVCacheState;

namespace internal {

void KVCacheState::MatchPages(absl::Span<const int32_t> prompt, absl::string_view key,
                              std::vector<BlockHash>* hashes, std::vector<int32_t>* pages) const {
  hashes->clear();
  pages->clear();
  if (!prefix.enabled || prompt.empty()) return;
  const int ps = geometry.page_size;
  const int64_t max_pages =
      std::min<int64_t>(static_cast<int64_t>(prompt.size() - 1) / ps, options.max_pages_per_seq);
  for (int64_t i = 0; i < max_pages; ++i) {
    const BlockHash h =
        HashPage(hashes->empty() ? nullptr : &hashes->back(),
                 prompt.subspan(static_cast<size_t>(i) * ps, ps), key, &prefix.hash_scratch);
    const int32_t page = allocator.Lookup(h);
    if (page < 0) break;
    hashes->push_back(h);
    pages->push_back(page);
  }
}

void KVCacheState::CommitTokens(Sequence& q, const StepEntry& e, int64_t tok0) {
  TokenChain& c = q.chain;
  if (!c.tracked || e.num_new_tokens == 0) return;
  if (e.token_ids.empty()) {
    if (c.queued) {  // pages completed while tracked (before this append) are still indexed
      const int64_t len = q.length;
      q.length -= e.num_new_tokens;
      FlushIndex();
      q.length = len;
    }
    c.Untrack();
    return;
  }
  for (int32_t k = 0; k < e.num_new_tokens; ++k)
    prefix.page_tokens[step.h_slots[tok0 + k]] = e.token_ids[k];
  const int64_t ps = geometry.page_size;
  if (static_cast<int64_t>(c.hashes.size() + 1) * ps > q.length) return;  // no page completed
  const size_t full = static_cast<size_t>(q.length / ps);
  if (!Calibrated()) c.index_from = full;  // written under a pending layer's placeholder
  if (!c.queued) {
    c.queued = true;
    prefix.unhashed.push_back(static_cast<uint32_t>(&q - sequences.all.data()));
  }
}

void KVCacheState::FlushIndex() {
  const int ps = geometry.page_size;
  for (uint32_t slot : prefix.unhashed) {
    Sequence& q = sequences.all[slot];
    TokenChain& c = q.chain;
    if (!c.queued) continue;
    c.queued = false;
    if (!q.live || !c.tracked) continue;
    const size_t first = c.hashes.size();
    const size_t full = static_cast<size_t>(q.length / ps);
    for (size_t j = first; j < full; ++j) {
      c.hashes.push_back(HashPage(j == 0 ? nullptr : &c.hashes[j - 1], PageTokens(q.pages[j]),
                                  c.extra_key, &prefix.hash_scratch));
    }
    size_t run = full;  // start of the current run of indexed pages; full: none
    for (size_t j = std::max(first, c.index_from); j <= full; ++j) {
      if (j < full && allocator.Register(q.pages[j], c.hashes[j])) {
        if (run == full) run = j;
        continue;
      }
      for (size_t k = run; k < j; ++k) {
        prefix.events.Stored(c.hashes[k], k > 0 ? &c.hashes[k - 1] : nullptr,
                             PageTokens(q.pages[k]), ps, c.extra_key, /*continues=*/k > run);
      }
      run = full;
    }
  }
  prefix.unhashed.clear();
}

absl::Span<const int32_t> KVCacheState::PageTokens(int32_t page) const {
  const int ps = geometry.page_size;
  return absl::Span<const int32_t>(prefix.page_tokens.data() + static_cast<int64_t>(page) * ps, ps);
}

void KVCacheState::ClearPrefixIndex() {
  if (!prefix.enabled) return;
  FlushIndex();  // their hashes are still needed; their index entries go now
  allocator.ClearIndex();
}

}  // namespace internal

absl::StatusOr<PrefixSequence> KVCache::CreateSequenceFromPrefix(absl::Span<const int32_t> prompt,
                                                                 absl::string_view extra_key) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  if (!s.prefix.enabled) {
    return absl::FailedPreconditionError(
        "CreateSequenceFromPrefix: expected a cache with prefix_cache.enabled, got one without");
  }
  s.FlushIndex();
  s.PollSwaps();
  s.MatchPages(prompt, extra_key, &s.prefix.match_hashes, &s.prefix.match_pages);
  const SequenceId id = s.NewSequence();
  KVCacheState::Sequence& q = *s.Find(id);
  const int64_t tokens = static_cast<int64_t>(s.prefix.match_pages.size()) * s.geometry.page_size;
  for (int32_t page : s.prefix.match_pages) s.allocator.Retain(page);  // revives cached ones
  q.pages.assign(s.prefix.match_pages.begin(), s.prefix.match_pages.end());
  q.length = tokens;
  q.chain.Reset(true, extra_key);
  q.chain.hashes.assign(s.prefix.match_hashes.begin(), s.prefix.match_hashes.end());
  ++s.prefix.queries;
  s.prefix.query_tokens += static_cast<int64_t>(prompt.size());
  s.prefix.hit_tokens += tokens;
  return PrefixSequence{id, tokens};
}

PrefixMatch KVCache::MatchPrefix(absl::Span<const int32_t> prompt,
                                 absl::string_view extra_key) const {
  if (state_ == nullptr) return PrefixMatch();
  KVCacheState& s = *state_;
  s.FlushIndex();  // logically part of the earlier steps
  s.MatchPages(prompt, extra_key, &s.prefix.match_hashes, &s.prefix.match_pages);
  PrefixMatch m;
  m.pages = static_cast<int64_t>(s.prefix.match_pages.size());
  m.tokens = m.pages * s.geometry.page_size;
  for (int32_t page : s.prefix.match_pages) m.pages_evictable += s.allocator.RefCount(page) == 0;
  return m;
}

// ------------------------------------------------------------ prefix cache
KVEventBatch KVCache::TakeEvents() {
  if (state_ == nullptr) return KVEventBatch();
  state_->FlushIndex();
  return state_->prefix.events.Take();
}

void KVCache::ResetPrefixCache() {
  if (state_ != nullptr) state_->ClearPrefixIndex();
}

}  // namespace fp4kv
