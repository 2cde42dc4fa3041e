// KVCache: the host tier of the prefix cache. Cached pages that allocations
// evict are demoted into host pages; CreateSequenceFromPrefix promotes them
// back. Every decision here is a function of the calls alone (LRU order,
// counts), never of when a copy finishes.
#include <algorithm>

#include "src/kv_cache/state.h"

namespace fp4kv {
namespace internal {

int32_t KVCacheState::HostLookup(const BlockHash& hash) const {
  if (prefix_host.pages.pages_total() == 0) return -1;
  auto it = prefix_host.index.find(hash);
  return it == prefix_host.index.end() ? -1 : it->second;
}

void KVCacheState::ClearHostPrefix() {
  PrefixHostState& t = prefix_host;
  if (t.pages.pages_total() == 0) return;
  for (int k = 0; k < PagePool::kPriorities; ++k) {
    while (t.lru.head(k) >= 0) {
      const int32_t h = t.lru.head(k);
      t.lru.Unlink(h);
      t.cached[h] = 0;
      t.pages.Give(h);
    }
  }
  t.cached_count = 0;
  t.index.clear();
}

absl::Status KVCacheState::DemoteForAllocation(int64_t n, Stream stream,
                                               bool writes_on_copy_stream) {
  PrefixHostState& t = prefix_host;
  if (t.pages.pages_total() == 0 || !prefix.enabled) return absl::OkStatus();
  const int64_t evict =
      std::min<int64_t>(std::max<int64_t>(0, n - allocator.free_count()), allocator.cached_count());
  if (evict == 0) return absl::OkStatus();
  // Pages evicted in order: lowest priority first, least recently used
  // within one. Each takes a free host page, else the host tier's least
  // recently used page of the lowest priority up to its own, else it is
  // dropped. A host page taken from a page of this same batch cancels that
  // page's copy: only the last page a batch gives a host page is copied.
  const uint64_t batch = ++t.batches;
  std::vector<int32_t> dev, hosts;
  // The batch's kHost events in order, queued once its copies are enqueued
  // (entry: the batch entry of a page demoted by this batch, -1: a page of
  // an earlier one).
  struct HostEvent {
    bool stored;
    BlockHash hash;
    int32_t page;  // Stored: the device page (its token ids)
    int32_t entry;
  };
  std::vector<HostEvent> events;
  const int ps = geometry.page_size;
  for (int64_t i = 0; i < evict; ++i) {
    BlockHash h;
    int prio = 0;
    const int32_t page = allocator.EvictLru(&h, &prio);
    const int32_t have = HostLookup(h);
    if (have >= 0) {  // already on the host: now its most recently used page
      t.lru.Unlink(have);
      t.lru.set_priority(have, std::max<int>(t.lru.priority(have), prio));
      t.lru.PushBack(have);
      continue;
    }
    int32_t hp = -1;
    if (t.pages.free_count() > 0) {
      hp = t.pages.Take();
    } else {
      for (int k = 0; k <= prio && hp < 0; ++k) hp = t.lru.head(k);
      if (hp < 0) continue;  // dropped: no room at or below its priority
      const bool same = t.batch[hp] == batch;
      if (same) dev[t.batch_pos[hp]] = -1;  // its copy is cancelled
      t.lru.Unlink(hp);
      t.index.erase(t.hash[hp]);
      events.push_back({false, t.hash[hp], -1, same ? t.batch_pos[hp] : -1});
      t.cached[hp] = 0;
      --t.cached_count;
      ++t.evictions;
    }
    t.hash[hp] = h;
    t.lru.set_priority(hp, prio);
    t.batch[hp] = batch;
    t.batch_pos[hp] = static_cast<int32_t>(dev.size());
    t.cached[hp] = 1;
    ++t.cached_count;
    t.index[h] = hp;
    t.lru.PushBack(hp);
    const absl::Span<const int32_t> ids = PageTokens(page);
    std::copy(ids.begin(), ids.end(), t.tokens.begin() + static_cast<int64_t>(hp) * ps);
    events.push_back({true, h, page, static_cast<int32_t>(dev.size())});
    dev.push_back(page);
    hosts.push_back(hp);
  }
  // copied[entry]: whether the entry's copy is made (cancelled ones never).
  std::vector<uint8_t> copied(dev.size(), 0);
  size_t kept = 0;
  std::vector<size_t> entry_of;  // batch entry of each kept page
  for (size_t i = 0; i < dev.size(); ++i) {
    if (dev[i] < 0) continue;
    entry_of.push_back(i);
    dev[kept] = dev[i];
    hosts[kept++] = hosts[i];
  }
  dev.resize(kept);
  hosts.resize(kept);
  // The copies: all of them (CPU: done now), or on a failure to enqueue
  // (CUDA error) those of the batches enqueued before it.
  size_t enqueued = dev.size();
  absl::Status st = absl::OkStatus();
  if (!dev.empty() && !cuda) {
    ReferencePageCopy(HostCopy(dev.data(), hosts.data(), static_cast<int64_t>(dev.size()), true,
                               /*prefix_tier=*/true));
  } else if (!dev.empty()) {
    // Batches of at most max_pages_per_seq pages (the room of the swap ids),
    // all on the copy stream after the work on `stream` (which may have
    // written the pages). No host wait.
    const size_t chunk = static_cast<size_t>(options.max_pages_per_seq);
    for (size_t b = 0; b < dev.size(); b += chunk) {
      const size_t e = std::min(dev.size(), b + chunk);
      std::vector<int32_t> d(dev.begin() + b, dev.begin() + e),
          h(hosts.begin() + b, hosts.begin() + e);
      // No event: stream order carries the batch (`stream` waits for the
      // copy stream as a whole, OrderAfterCopies), and an event recorded
      // behind the copy would only lengthen that wait.
      st = EnqueueSwapCopy(d, h, /*to_host=*/true, stream, /*event=*/nullptr,
                           /*prefix_tier=*/true);
      if (!st.ok()) {
        enqueued = b;
        break;
      }
    }
  }
  for (size_t k = 0; k < enqueued; ++k) copied[entry_of[k]] = 1;
  // Pages whose copies were never enqueued leave the host tier again: no
  // index entry for bytes never copied (their device pages stay evicted, as
  // without a host tier). Their kHost events are never queued, nor are a
  // cancelled entry's (stored, then removed by this batch: nothing to tell).
  for (size_t k = enqueued; k < dev.size(); ++k) {
    const int32_t hp = hosts[k];
    t.lru.Unlink(hp);
    t.index.erase(t.hash[hp]);
    t.cached[hp] = 0;
    --t.cached_count;
    t.pages.Give(hp);
  }
  for (const HostEvent& e : events) {
    if (!st.ok() && e.entry >= 0 && !copied[e.entry]) continue;
    if (e.stored) {
      prefix.events.Stored(e.hash, nullptr, PageTokens(e.page), ps, {}, /*continues=*/false,
                           KVMedium::kHost);
    } else {
      prefix.events.Removed(e.hash, KVMedium::kHost);
    }
  }
  t.demotions += static_cast<int64_t>(enqueued);
  if (!cuda || enqueued == 0) return st;
  if (!st.ok()) {
    // The enqueued copies read device pages that are free now, and the
    // caller gives up: let them finish (a host wait, on a CUDA error only).
    (void)copy.Synchronize();
    return st;
  }
  // The evicted pages are free now: when n pages are allocated, they are
  // among them (n minus the free pages were evicted). Written on the copy
  // stream, they come after the copies in stream order; otherwise `stream`
  // waits for the copies.
  return writes_on_copy_stream ? absl::OkStatus() : OrderAfterCopies(stream);
}

void KVCacheState::FitMatch() {
  std::vector<int32_t>& pages = prefix.match_pages;
  int64_t host_pages = 0, revived = 0;
  size_t first_host = pages.size();
  for (size_t i = 0; i < pages.size(); ++i) {
    if (pages[i] < 0) {
      ++host_pages;
      first_host = std::min(first_host, i);
    } else if (allocator.RefCount(pages[i]) == 0) {
      ++revived;
    }
  }
  if (host_pages == 0) return;
  if (host_pages <= allocator.available_count() - revived) return;
  pages.resize(first_host);
  prefix.match_hashes.resize(first_host);
  prefix.match_host.resize(first_host);
}

absl::Status KVCacheState::PromoteInto(Sequence& q, absl::Span<const int32_t> prompt) {
  PrefixHostState& t = prefix_host;
  std::vector<int32_t>& pages = prefix.match_pages;
  const std::vector<int32_t>& hostm = prefix.match_host;
  const int ps = geometry.page_size;
  PollPromotions();
  for (int32_t page : pages) {
    if (page >= 0) allocator.Retain(page);  // revives cached ones: off the LRU
  }
  // The host pages to promote leave the host LRU first, so that demotions
  // for their device pages cannot take them.
  std::vector<int32_t> src, dst;
  for (size_t i = 0; i < pages.size(); ++i) {
    if (pages[i] >= 0) continue;
    const int32_t h = hostm[i];
    t.lru.Unlink(h);
    t.index.erase(t.hash[h]);
    prefix.events.Removed(t.hash[h], KVMedium::kHost);
    t.cached[h] = 0;
    --t.cached_count;
    src.push_back(h);
  }
  if (src.empty()) {
    InheritPromotion(q, pages);  // device hits whose promotion may be in flight
    return absl::OkStatus();
  }
  const int64_t n = static_cast<int64_t>(src.size());
  const Stream stream = step.serial() > 0 ? step.cur().stream : nullptr;
  absl::Status st = DemoteForAllocation(n, stream, /*writes_on_copy_stream=*/cuda);
  for (int64_t i = 0; i < n; ++i) dst.push_back(allocator.Allocate());
  int event = -1;  // of the latest batch enqueued: it covers the earlier ones
  if (st.ok() && cuda) {
    const size_t chunk = static_cast<size_t>(options.max_pages_per_seq);
    for (size_t b = 0; b < src.size(); b += chunk) {
      const size_t e = std::min(src.size(), b + chunk);
      std::vector<int32_t> d(dst.begin() + b, dst.begin() + e), h(src.begin() + b, src.begin() + e);
      int next = -1;
      st = EnqueueSwapCopy(d, h, /*to_host=*/false, stream, &next, /*prefix_tier=*/true);
      if (!st.ok()) break;
      if (event >= 0) copy.Free(event);  // a later one covers it
      event = next;
    }
  } else if (st.ok()) {
    ReferencePageCopy(HostCopy(src.data(), dst.data(), n, false, /*prefix_tier=*/true));
  }
  if (event >= 0) {
    // The promotion in flight: its pages are ordered after `event` wherever
    // they go (even when dropped below after a later batch failed).
    const uint64_t serial = ++t.promotion_serial;
    for (int32_t p : dst) t.promoted_by[p] = serial;
    ReleaseEvent(t.latest_event);
    t.latest_event = event;
    copy.Hold(event);
  }
  // The host pages go back (their copies are ordered before any later copy
  // that rewrites them: the copy stream runs in order).
  for (int32_t h : src) t.pages.Give(h);
  if (!st.ok()) {
    // A CUDA error enqueueing the copies: the promoted pages are dropped
    // (they left the host index above, with their kHost Removed events).
    // Demotion copies may still read the device pages that go back: wait
    // (an error path only).
    if (cuda) (void)copy.Synchronize();
    for (int32_t p : dst) allocator.Release(p);
    for (int32_t page : pages) {
      if (page >= 0) allocator.Release(page);
    }
    return st;
  }
  size_t k = 0;
  for (size_t i = 0; i < pages.size(); ++i) {
    if (pages[i] >= 0) continue;
    const int32_t page = dst[k++];
    pages[i] = page;
    const int64_t base = static_cast<int64_t>(page) * ps;
    std::copy(prompt.begin() + i * ps, prompt.begin() + (i + 1) * ps,
              prefix.page_tokens.begin() + base);
    std::fill(prefix.page_known.begin() + base, prefix.page_known.begin() + base + ps, uint8_t{1});
    if (allocator.Register(page, prefix.match_hashes[i])) {
      prefix.events.Stored(prefix.match_hashes[i], i > 0 ? &prefix.match_hashes[i - 1] : nullptr,
                           PageTokens(page), ps, q.chain.extra_key, /*continues=*/false);
    }
  }
  t.promotions += n;
  t.hit_tokens += n * ps;
  InheritPromotion(q, pages);  // the new pages: this promotion's event
  return absl::OkStatus();
}

bool KVCacheState::PromotionPending(int32_t page) const {
  const PrefixHostState& t = prefix_host;
  return t.latest_event >= 0 && t.promoted_by[page] > t.promotions_done;
}

void KVCacheState::PollPromotions() {
  PrefixHostState& t = prefix_host;
  if (t.latest_event < 0) return;
  const cudaError_t r = copy.Query(t.latest_event);
  if (r != cudaSuccess) {
    if (r == cudaErrorNotReady) (void)cudaGetLastError();  // not an error: still in flight
    return;
  }
  t.promotions_done = t.promotion_serial;
  ReleaseEvent(t.latest_event);
  t.latest_event = -1;
}

void KVCacheState::InheritPromotion(Sequence& q, absl::Span<const int32_t> pages) {
  if (prefix_host.latest_event < 0) return;
  for (int32_t page : pages) {
    if (page >= 0 && PromotionPending(page)) {
      HoldCopyEvent(q, prefix_host.latest_event);
      return;
    }
  }
}

absl::Status KVCacheState::OrderAfterPromotion(absl::Span<const int32_t> pages, Stream stream) {
  if (prefix_host.latest_event < 0) return absl::OkStatus();
  for (int32_t page : pages) {
    if (!PromotionPending(page)) continue;
    return copy.StreamWait(stream, prefix_host.latest_event);
  }
  return absl::OkStatus();
}

absl::Status KVCacheState::CheckHostPrefix() const {
  const PrefixHostState& t = prefix_host;
  if (t.pages.pages_total() == 0) return absl::OkStatus();
  int64_t cached = 0, linked = 0;
  for (int64_t h = 0; h < t.pages.pages_total(); ++h) cached += t.cached[h];
  for (int k = 0; k < PagePool::kPriorities; ++k) {
    for (int32_t h = t.lru.head(k), prev = -1; h >= 0; prev = h, h = t.lru.next(h)) {
      if (!t.cached[h] || t.lru.prev(h) != prev || t.lru.priority(h) != k ||
          ++linked > t.pages.pages_total()) {
        return absl::InternalError(absl::StrCat("host prefix page ", h, ": LRU list ", k,
                                                " broken (cached ", int{t.cached[h]}, ", priority ",
                                                t.lru.priority(h), ")"));
      }
      auto it = t.index.find(t.hash[h]);
      if (it == t.index.end() || it->second != h) {
        return absl::InternalError(absl::StrCat("host prefix page ", h, ": its hash ",
                                                t.hash[h].ToHex(), " does not map to it"));
      }
    }
  }
  for (int32_t h : t.pages.free_pages()) {
    if (h < 0 || h >= t.pages.pages_total() || t.cached[h]) {
      return absl::InternalError(absl::StrCat("host prefix page ", h, ": free but cached"));
    }
  }
  if (cached != t.cached_count || linked != cached ||
      static_cast<int64_t>(t.index.size()) != cached ||
      cached + t.pages.free_count() != t.pages.pages_total()) {
    return absl::InternalError(absl::StrCat("host prefix tier: ", cached, " cached pages (counted ",
                                            t.cached_count, ", ", linked, " on the LRU, ",
                                            t.index.size(), " indexed) and ", t.pages.free_count(),
                                            " free of ", t.pages.pages_total()));
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace fp4kv
