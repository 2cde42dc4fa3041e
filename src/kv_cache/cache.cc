// KVCache: Create, the facade's accessors, Stats and CheckInvariants.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "fp4kv/recipe.h"
#include "src/kv_cache/state.h"

namespace fp4kv {

using internal::CeilDiv;
using internal::KVCacheState;

namespace internal {

KVCacheState::~KVCacheState() {
  images.Detach();
  // The copy engine, destroyed first of the members, waits for its copies.
  if (cuda) {
    ScopedDevice d;
    (void)d.Set(options.device);
    for (StepSlot& slot : step.slots) {
      // The pinned staging must outlive the last upload that reads it.
      if (slot.upload_done != nullptr) {
        if (slot.upload_pending) (void)cudaEventSynchronize(slot.upload_done);
        (void)cudaEventDestroy(slot.upload_done);
      }
      if (slot.done != nullptr) (void)cudaEventDestroy(slot.done);
    }
    // Copies of late token ids write into the pinned ring.
    for (const PrefixState::PendingIds& p : prefix.pending_ids) {
      (void)cudaEventSynchronize(p.event);
    }
    for (cudaEvent_t e : prefix.all_id_events) (void)cudaEventDestroy(e);
  }
}

absl::Status MovedFrom() {
  return absl::FailedPreconditionError(
      "KVCache: expected a live cache, got one that was moved from");
}

}  // namespace internal

KVCache::KVCache(std::unique_ptr<KVCacheState> state) : state_(std::move(state)) {}

KVCache::KVCache(KVCache&&) noexcept = default;
KVCache& KVCache::operator=(KVCache&&) noexcept = default;
KVCache::~KVCache() = default;

namespace {
const KVCacheOptions kNoOptions{};
}  // namespace

PagedCache KVCache::LayerCache(int layer) const {
  if (state_ == nullptr || !state_->CheckLayer(layer).ok()) return PagedCache();
  return state_->LayerCache(layer);
}
const KVCacheOptions& KVCache::options() const { return state_ ? state_->options : kNoOptions; }
const CacheGeometry& KVCache::geometry() const {
  return state_ ? state_->geometry : kNoOptions.geometry;
}
int KVCache::num_layers() const { return state_ ? state_->options.num_layers : 0; }
Device KVCache::device() const { return state_ ? state_->options.device : Device::Cpu(); }

KVCacheStats KVCache::Stats() const {
  if (state_ == nullptr) return KVCacheStats();
  state_->FlushIndex();  // logically part of the earlier steps
  state_->PollSwaps();
  const KVCacheState& s = *state_;
  const int ps = s.geometry.page_size;
  KVCacheStats st;
  st.pages_reserved = s.images.reserved_pages();
  st.reservations = static_cast<int64_t>(s.images.reservations().size());
  st.bytes_exported = s.images.bytes_exported();
  st.bytes_imported = s.images.bytes_imported();
  st.host_pages_total = s.host.pages.pages_total();
  st.host_pages_free = s.host.pages.free_count();
  st.host_pages_used = st.host_pages_total - st.host_pages_free;
  st.host_bytes = s.host.pages.pages_total() > 0 ? s.host.pages.layout().total_bytes : 0;
  for (const KVCacheState::SwapOutCopy& c : s.retire.entries()) st.swaps_in_flight += c.event >= 0;
  st.pages_retiring = s.PagesRetiring();
  for (const auto& p : s.prefix.pending_ids) st.token_ids_pending += p.count;
  st.token_ids_dropped = s.prefix.ids_dropped;
  st.pages_swap_pending = s.PagesSwapPending();
  st.bytes_swapped_out = s.host.bytes_swapped_out;
  st.bytes_swapped_in = s.host.bytes_swapped_in;
  st.pages_total = s.allocator.num_pages();
  st.pages_free = s.allocator.free_count();
  st.pages_used = s.allocator.used_count();
  st.pages_cached = s.allocator.cached_count();
  st.evictions = s.allocator.evictions();
  st.prefix_queries = s.prefix.queries;
  st.prefix_query_tokens = s.prefix.query_tokens;
  st.prefix_hit_tokens = s.prefix.hit_tokens;
  st.prefix_hit_rate = s.prefix.query_tokens > 0 ? static_cast<double>(s.prefix.hit_tokens) /
                                                       static_cast<double>(s.prefix.query_tokens)
                                                 : 0.0;
  st.host_prefix_pages_total = s.prefix_host.pages.pages_total();
  st.host_prefix_pages_cached = s.prefix_host.cached_count;
  st.host_prefix_bytes =
      s.prefix_host.pages.pages_total() > 0 ? s.prefix_host.pages.layout().total_bytes : 0;
  st.host_prefix_demotions = s.prefix_host.demotions;
  st.host_prefix_promotions = s.prefix_host.promotions;
  st.host_prefix_evictions = s.prefix_host.evictions;
  st.prefix_hit_tokens_host = s.prefix_host.hit_tokens;
  st.events_pending = static_cast<int64_t>(s.prefix.events.pending());
  st.events_dropped = static_cast<int64_t>(s.prefix.events.dropped_total());
  st.num_sequences = s.sequences.live();
  st.pool_bytes = s.mem.pool.total_bytes;
  st.memory_available_at_create = s.mem.available_at_create;
  st.memory_budget_clamped = s.mem.budget_clamped;
  st.bytes_per_token = s.geometry.BytesPerToken() * s.options.num_layers;
  for (const KVCacheState::Sequence& q : s.sequences.slots()) {
    if (!q.live) continue;
    st.tokens_stored += q.length;
    st.sequences_swapped += q.swapped ? 1 : 0;
    st.sequence_lengths.emplace_back(q.id, q.length);
  }
  std::sort(st.sequence_lengths.begin(), st.sequence_lengths.end());
  for (int32_t p = 0; p < s.allocator.num_pages(); ++p) {
    if (s.allocator.RefCount(p) > 1) ++st.pages_shared;
    if (s.allocator.Indexed(p)) ++st.pages_indexed;
  }
  // Partially filled last pages count their fill level, unless another
  // holder has the page full.
  st.tokens_resident = s.TokensResident();
  st.wasted_slots = st.pages_used * ps - st.tokens_resident;
  return st;
}

absl::Status KVCache::CheckInvariants() const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  state_->FlushIndex();  // logically part of the earlier steps
  state_->PollSwaps();
  const KVCacheState& s = *state_;
  const int ps = s.geometry.page_size;
  FP4KV_RETURN_IF_ERROR(s.allocator.Validate());
  FP4KV_RETURN_IF_ERROR(s.sequences.Validate());
  FP4KV_RETURN_IF_ERROR(s.CheckHostPrefix());
  constexpr char kCall[] = "KVCache::CheckInvariants";
  internal::HostVector<int32_t> refs;
  FP4KV_RETURN_IF_ERROR(internal::SizeHost(&refs, s.allocator.num_pages(), int32_t{0}, kCall,
                                           "a reference count per page"));
  std::vector<uint8_t> scratch;
  internal::HostVector<uint8_t> host_owner;
  FP4KV_RETURN_IF_ERROR(internal::SizeHost(&host_owner, s.host.pages.pages_total(), uint8_t{0}, kCall,
                                           "an owner per host page"));
  for (int32_t h : s.host.pages.free_pages()) {
    if (h < 0 || h >= s.host.pages.pages_total() || host_owner[h]++ != 0) {
      return absl::InternalError(absl::StrCat("host page ", h, ": free twice or out of range"));
    }
  }
  for (const auto& [rid, r] : s.images.reservations()) {
    if (static_cast<int64_t>(r.pages.size()) != r.header.num_pages) {
      return absl::InternalError(absl::StrCat("reservation ", rid, ": holds ", r.pages.size(),
                                              " pages for an image of ", r.header.num_pages));
    }
    for (int32_t page : r.pages) ++refs[page];
  }
  for (const KVCacheState::SwapOutCopy& c : s.retire.entries()) {
    for (int32_t page : c.orphan) ++refs[page];
  }
  for (const KVCacheState::Sequence& q : s.sequences.slots()) {
    if (!q.live) continue;
    const SequenceId id = q.id;
    const int64_t want = CeilDiv(q.length, ps);
    if (q.swapped) {
      if (static_cast<int64_t>(q.host_pages.size()) != want ||
          (!q.pages.empty() && static_cast<int64_t>(q.pages.size()) != want)) {
        return absl::InternalError(absl::StrCat("swapped sequence ", id, ": length ", q.length,
                                                " holds ", q.host_pages.size(), " host pages and ",
                                                q.pages.size(), " device pages"));
      }
      for (int32_t h : q.host_pages) {
        if (h < 0 || h >= s.host.pages.pages_total() || host_owner[h]++ != 0) {
          return absl::InternalError(
              absl::StrCat("swapped sequence ", id, ": host page ", h, " is not its own"));
        }
      }
    } else if (static_cast<int64_t>(q.pages.size()) != want || !q.host_pages.empty()) {
      return absl::InternalError(absl::StrCat("sequence ", id, ": length ", q.length, " holds ",
                                              q.pages.size(), " pages"));
    }
    for (int32_t page : q.pages) ++refs[page];
    const internal::TokenChain& c = q.chain;
    if (!c.tracked) continue;
    if (c.ids_known < 0 || c.ids_known > q.length ||
        static_cast<int64_t>(c.hashes.size()) != c.ids_known / ps) {
      return absl::InternalError(absl::StrCat("sequence ", id, ": length ", q.length,
                                              ", token ids known for ", c.ids_known,
                                              ", tracks ", c.hashes.size(), " page hashes"));
    }
    for (int64_t t = 0; t < c.ids_known; ++t) {
      if (!s.prefix.page_known[static_cast<int64_t>(q.pages[t / ps]) * ps + t % ps]) {
        return absl::InternalError(absl::StrCat("sequence ", id, ": position ", t,
                                                " counts as known but its id is not"));
      }
    }
    for (size_t j = 0; j < c.hashes.size(); ++j) {
      const BlockHash h = internal::HashPage(j == 0 ? nullptr : &c.hashes[j - 1],
                                             s.PageTokens(q.pages[j]), c.extra_key, &scratch);
      if (h != c.hashes[j]) {
        return absl::InternalError(absl::StrCat("sequence ", id, " page ", j, ": hash ",
                                                c.hashes[j].ToHex(), ", its tokens hash to ",
                                                h.ToHex()));
      }
      if (s.allocator.Indexed(q.pages[j]) && s.allocator.HashOf(q.pages[j]) != h) {
        return absl::InternalError(absl::StrCat("sequence ", id, " page ", j, " (page ", q.pages[j],
                                                ") is indexed under another hash"));
      }
    }
  }
  for (int64_t h = 0; h < s.host.pages.pages_total(); ++h) {
    if (host_owner[h] != 1) {
      return absl::InternalError(absl::StrCat("host page ", h, ": neither free nor held"));
    }
  }
  for (int32_t p = 0; p < s.allocator.num_pages(); ++p) {
    if (refs[p] != s.allocator.RefCount(p)) {
      return absl::InternalError(absl::StrCat("page ", p, ": reference count ",
                                              s.allocator.RefCount(p), ", held by ", refs[p],
                                              " sequences"));
    }
  }
  return absl::OkStatus();
}

}  // namespace fp4kv
