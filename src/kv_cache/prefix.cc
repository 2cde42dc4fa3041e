// KVCache prefix index: page hashing and indexing (deferred out of
// PrepareStep), matching, events.
#include <algorithm>

#include "src/kv_cache/state.h"

namespace fp4kv {

using internal::CeilDiv;
using internal::KVCacheState;

namespace internal {

void KVCacheState::MatchPages(absl::Span<const int32_t> prompt, absl::string_view key,
                              std::vector<BlockHash>* hashes, std::vector<int32_t>* pages,
                              std::vector<int32_t>* host) const {
  hashes->clear();
  pages->clear();
  host->clear();
  if (!prefix.enabled || prompt.empty()) return;
  const int ps = geometry.page_size;
  const int64_t max_pages =
      std::min<int64_t>(static_cast<int64_t>(prompt.size() - 1) / ps, options.max_pages_per_seq);
  for (int64_t i = 0; i < max_pages; ++i) {
    const BlockHash h =
        HashPage(hashes->empty() ? nullptr : &hashes->back(),
                 prompt.subspan(static_cast<size_t>(i) * ps, ps), key, &prefix.hash_scratch);
    const int32_t page = allocator.Lookup(h);
    const int32_t hp = page < 0 ? HostLookup(h) : -1;
    if (page < 0 && hp < 0) break;
    hashes->push_back(h);
    pages->push_back(page);
    host->push_back(hp);
  }
}

void KVCacheState::CommitTokens(Sequence& q, const StepEntry& e, int64_t tok0) {
  TokenChain& c = q.chain;
  if (!c.tracked || e.num_new_tokens == 0) return;
  const int64_t ps = geometry.page_size;
  const int64_t old_len = q.length - e.num_new_tokens;
  // A page completed while a layer is pending holds placeholder-scale bytes:
  // never indexed, whenever its ids arrive.
  if (old_len / ps < q.length / ps && !Calibrated()) {
    c.index_from = static_cast<size_t>(q.length / ps);
  }
  if (e.token_ids.empty()) {
    // Ids arrive later (SetTokenIds) or never: the slots' ids are unknown.
    for (int32_t k = 0; k < e.num_new_tokens; ++k) prefix.page_known[step.cur().h_slots[tok0 + k]] = 0;
    return;
  }
  for (int32_t k = 0; k < e.num_new_tokens; ++k) {
    const int64_t slot = step.cur().h_slots[tok0 + k];
    prefix.page_tokens[slot] = e.token_ids[k];
    prefix.page_known[slot] = 1;
  }
  if (c.ids_known == old_len) AdvanceKnownIds(q);
}

void KVCacheState::CopyPageTokens(int32_t from, int32_t to) {
  if (!prefix.enabled) return;
  const int64_t ps = geometry.page_size;
  const int64_t a = int64_t{from} * ps, b = int64_t{to} * ps;
  std::copy(prefix.page_tokens.begin() + a, prefix.page_tokens.begin() + a + ps,
            prefix.page_tokens.begin() + b);
  std::copy(prefix.page_known.begin() + a, prefix.page_known.begin() + a + ps,
            prefix.page_known.begin() + b);
}

void KVCacheState::AdoptTokenIds(Sequence& q, const int32_t* ids) {
  const int64_t ps = geometry.page_size;
  for (int64_t t = 0; t < q.length; ++t) {
    const int64_t slot = static_cast<int64_t>(q.pages[t / ps]) * ps + t % ps;
    prefix.page_tokens[slot] = ids[t];
    prefix.page_known[slot] = 1;
  }
  q.chain.ids_known = q.length;
  // Indexed by the next FlushIndex, like pages a step completed.
  if (!Calibrated()) q.chain.index_from = static_cast<size_t>(q.length / ps);
  if (q.length / ps > 0) {
    q.chain.queued = true;
    prefix.unhashed.push_back(sequences.SlotOf(q));
  }
}

void KVCacheState::AdvanceKnownIds(Sequence& q) {
  TokenChain& c = q.chain;
  const int64_t ps = geometry.page_size;
  const int64_t before = c.ids_known;
  while (c.ids_known < q.length &&
         prefix.page_known[static_cast<int64_t>(q.pages[c.ids_known / ps]) * ps +
                           c.ids_known % ps]) {
    ++c.ids_known;
  }
  if (c.ids_known / ps > before / ps && !c.queued) {
    c.queued = true;
    prefix.unhashed.push_back(sequences.SlotOf(q));
  }
}

absl::Status KVCacheState::ApplyTokenIds(Sequence& q, int64_t first, absl::Span<const int32_t> ids,
                                         const char* what) {
  const int64_t ps = geometry.page_size;
  auto slot_of = [&](int64_t pos) {
    return static_cast<int64_t>(q.pages[pos / ps]) * ps + pos % ps;
  };
  const int64_t n = static_cast<int64_t>(ids.size());
  for (int64_t k = 0; k < n; ++k) {
    const int64_t slot = slot_of(first + k);
    if (prefix.page_known[slot] && prefix.page_tokens[slot] != ids[k]) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "[", k, "]: position ", first + k, " of sequence ", q.id, " already has token id ",
          prefix.page_tokens[slot], ", got ", ids[k], "; nothing changed"));
    }
  }
  for (int64_t k = 0; k < n; ++k) {
    const int64_t slot = slot_of(first + k);
    prefix.page_tokens[slot] = ids[k];
    prefix.page_known[slot] = 1;
  }
  if (first <= q.chain.ids_known) AdvanceKnownIds(q);
  return absl::OkStatus();
}

void KVCacheState::ApplyPendingIds(uint64_t serial) {
  std::vector<PrefixState::PendingIds>& v = prefix.pending_ids;
  size_t k = 0;
  while (k < v.size() && v[k].ready <= serial) {
    PrefixState::PendingIds& p = v[k];
    if (p.event != nullptr) {
      if (cudaEventSynchronize(p.event) != cudaSuccess) (void)cudaGetLastError();
      prefix.free_id_events.push_back(p.event);
    }
    Sequence* q = Find(p.seq);
    const int32_t* ids = reinterpret_cast<const int32_t*>(prefix.ids_pinned.get()) + p.offset;
    bool applied = false;
    if (q != nullptr && !q->swapped && q->chain.tracked && q->truncations == p.truncations &&
        p.first + p.count <= q->length) {
      applied = ApplyTokenIds(*q, p.first, absl::Span<const int32_t>(ids, p.count), "ids").ok();
    }
    if (!applied) prefix.ids_dropped += p.count;
    ++k;
  }
  if (k > 0) v.erase(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k));
}

void KVCacheState::FlushIndex() {
  const int ps = geometry.page_size;
  for (uint32_t slot : prefix.unhashed) {
    Sequence& q = sequences.slots()[slot];
    TokenChain& c = q.chain;
    if (!c.queued) continue;
    c.queued = false;
    if (!q.live || !c.tracked) continue;
    const size_t first = c.hashes.size();
    const size_t full = static_cast<size_t>(c.ids_known / ps);
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
  ClearHostPrefix();  // before the clear event, which covers both tiers
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
  s.MatchPages(prompt, extra_key, &s.prefix.match_hashes, &s.prefix.match_pages,
               &s.prefix.match_host);
  s.FitMatch();
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  const SequenceId id = s.NewSequence();
  KVCacheState::Sequence& q = *s.Find(id);
  const int64_t tokens = static_cast<int64_t>(s.prefix.match_pages.size()) * s.geometry.page_size;
  const int64_t promoted_before = s.prefix_host.promotions;
  q.chain.Reset(true, extra_key);
  // Retains the device pages (reviving cached ones) and promotes the host
  // ones into new device pages.
  if (absl::Status st = s.PromoteInto(q, prompt); !st.ok()) {
    (void)ReleaseSequence(id);
    return st;
  }
  const int64_t host_tokens = (s.prefix_host.promotions - promoted_before) * s.geometry.page_size;
  q.pages.assign(s.prefix.match_pages.begin(), s.prefix.match_pages.end());
  q.length = tokens;
  q.chain.hashes.assign(s.prefix.match_hashes.begin(), s.prefix.match_hashes.end());
  q.chain.ids_known = tokens;
  ++s.prefix.queries;
  s.prefix.query_tokens += static_cast<int64_t>(prompt.size());
  s.prefix.hit_tokens += tokens;
  return PrefixSequence{id, tokens, host_tokens};
}

PrefixMatch KVCache::MatchPrefix(absl::Span<const int32_t> prompt,
                                 absl::string_view extra_key) const {
  if (state_ == nullptr) return PrefixMatch();
  KVCacheState& s = *state_;
  s.FlushIndex();  // logically part of the earlier steps
  s.MatchPages(prompt, extra_key, &s.prefix.match_hashes, &s.prefix.match_pages,
               &s.prefix.match_host);
  s.FitMatch();
  PrefixMatch m;
  m.pages = static_cast<int64_t>(s.prefix.match_pages.size());
  m.tokens = m.pages * s.geometry.page_size;
  for (int32_t page : s.prefix.match_pages) {
    if (page < 0) {
      ++m.pages_host;
    } else {
      m.pages_evictable += s.allocator.RefCount(page) == 0;
    }
  }
  m.tokens_host = m.pages_host * s.geometry.page_size;
  m.tokens_gpu = m.tokens - m.tokens_host;
  return m;
}

// ---------------------------------------------------------- late token ids
namespace {

// The sequence and range checks shared by both SetTokenIds.
absl::StatusOr<KVCacheState::Sequence*> CheckIdRange(KVCacheState& s, SequenceId seq,
                                                     int64_t first, int64_t count) {
  KVCacheState::Sequence* q = s.Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  if (first < 0 || count > q->length || first > q->length - count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "first_position: expected positions [first_position, first_position + ", count,
        ") inside the ", q->length, " appended tokens of sequence ", seq, ", got first_position ",
        first));
  }
  return q;
}

// Whether ids given for q are recorded at all (prefix caching on, q tracked).
bool Recorded(const KVCacheState& s, const KVCacheState::Sequence& q) {
  return s.prefix.enabled && q.chain.tracked && !q.swapped;
}

}  // namespace

absl::Status KVCache::SetTokenIds(SequenceId seq, int64_t first_position,
                                  absl::Span<const int32_t> ids) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  absl::StatusOr<KVCacheState::Sequence*> q =
      CheckIdRange(s, seq, first_position, static_cast<int64_t>(ids.size()));
  if (!q.ok()) return q.status();
  if (ids.empty() || !Recorded(s, **q)) return absl::OkStatus();
  return s.ApplyTokenIds(**q, first_position, ids, "ids");
}

absl::Status KVCache::SetTokenIds(SequenceId seq, int64_t first_position, const TensorView& ids,
                                  Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  if (ids.data == nullptr || ids.ndim != 1 || ids.dtype != DType::kI32 ||
      (ids.shape[0] > 1 && ids.strides[0] != 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ids: expected a contiguous 1-d i32 view, got ", ids.ndim, " dims of ",
        DTypeName(ids.dtype), ids.data == nullptr ? " at null" : "",
        ids.ndim == 1 ? absl::StrCat(" with stride ", ids.strides[0]) : std::string()));
  }
  if (ids.device != s.options.device) {
    return absl::InvalidArgumentError(absl::StrCat("ids: expected memory of ",
                                                   s.options.device.ToString(), ", got ",
                                                   ids.device.ToString()));
  }
  const int64_t n = ids.shape[0];
  absl::StatusOr<KVCacheState::Sequence*> q = CheckIdRange(s, seq, first_position, n);
  if (!q.ok()) return q.status();
  if (n == 0 || !Recorded(s, **q)) return absl::OkStatus();
  if (!s.cuda) {
    return s.ApplyTokenIds(**q, first_position,
                           absl::Span<const int32_t>(static_cast<const int32_t*>(ids.data),
                                                     static_cast<size_t>(n)),
                           "ids");
  }
  // A room in the pinned ring after the newest pending copy (or from 0).
  std::vector<internal::PrefixState::PendingIds>& pend = s.prefix.pending_ids;
  const int64_t cap = s.prefix.ids_capacity;
  int64_t off = -1;
  if (pend.empty()) {
    off = n <= cap ? 0 : -1;
  } else {
    const int64_t head = pend.front().offset;
    const int64_t tail = pend.back().offset + pend.back().count;
    if (tail > head) {  // [head, tail) used
      if (tail + n <= cap) {
        off = tail;
      } else if (n <= head) {
        off = 0;
      }
    } else if (tail + n <= head) {  // wrapped: [head, cap) and [0, tail) used
      off = tail;
    }
  }
  if (off < 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "ids: ", n, " ids do not fit beside the ", pend.size(),
        " device copies not yet applied (room for ", cap,
        " ids, 2 * max_tokens_per_step * (step_slots + 1)); nothing changed"));
  }
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  cudaEvent_t e = nullptr;
  if (s.prefix.free_id_events.empty()) {
    FP4KV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    s.prefix.all_id_events.push_back(e);
  } else {
    e = s.prefix.free_id_events.back();
    s.prefix.free_id_events.pop_back();
  }
  const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
  int32_t* dst = reinterpret_cast<int32_t*>(s.prefix.ids_pinned.get()) + off;
  cudaError_t err = cudaMemcpyAsync(dst, ids.data, sizeof(int32_t) * n, cudaMemcpyDeviceToHost, cs);
  if (err == cudaSuccess) err = cudaEventRecord(e, cs);
  if (err != cudaSuccess) {
    s.prefix.free_id_events.push_back(e);
    return internal::CudaStatus(err, "SetTokenIds (copy of the ids)");
  }
  internal::PrefixState::PendingIds p;
  p.seq = seq;
  p.first = first_position;
  p.count = n;
  p.offset = off;
  p.truncations = (*q)->truncations;
  // Applied by PrepareStep step_serial + max(2, step_slots): by then the
  // step that follows this call's stream work has completed (or its slot
  // was waited for), so the wait for the copy is normally no wait.
  p.ready = s.step.serial() + std::max(2, s.options.step_slots);
  p.event = e;
  pend.push_back(p);
  return absl::OkStatus();
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
