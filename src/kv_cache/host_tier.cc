// KVCache host tier: swapping sequences to pinned host pages and back.
#include <algorithm>
#include <utility>

#include "src/kv_cache/state.h"

namespace fp4kv {

using internal::CeilDiv;
using internal::KVCacheState;

namespace internal {

PageCopyParams KVCacheState::HostCopy(const int32_t* src, const int32_t* dst, int64_t n,
                                      bool to_host, bool prefix_tier) const {
  PageCopyParams p;
  const HostPagePool& pool = prefix_tier ? prefix_host.pages : host.pages;
  const PoolLayout& hl = pool.layout();
  uint8_t* const hp = pool.device_base();
  const PoolLayout& a = to_host ? mem.pool : hl;
  const PoolLayout& b = to_host ? hl : mem.pool;
  p.src = to_host ? mem.pools.get() : hp;
  p.dst = to_host ? hp : mem.pools.get();
  p.src_layer_stride = a.layer_bytes;
  p.dst_layer_stride = b.layer_bytes;
  for (int r = 0; r < 4; ++r) {
    p.src_region[r] = a.regions[r].offset;
    p.dst_region[r] = b.regions[r].offset;
    p.page_bytes[r] = mem.pool.regions[r].page_bytes;
  }
  p.src_ids = src;
  p.dst_ids = dst;
  p.num_pages = n;
  p.num_layers = options.num_layers;
  // A copy of at most kHostCopyBurstUnits (layer, page) units takes one CTA
  // a unit (one wave, microseconds long): its time is the PCIe round trips
  // of a unit, not of several units in turn. Longer copies keep to
  // kHostCopyCtas.
  p.max_ctas = n * options.num_layers <= kHostCopyBurstUnits ? 0 : kHostCopyCtas;
  return p;
}

PageCopyParams KVCacheState::PoolToHost(const int32_t* pages, const int32_t* host,
                                        int64_t n) const {
  return HostCopy(pages, host, n, true);
}

PageCopyParams KVCacheState::HostToPool(const int32_t* host, const int32_t* pages,
                                        int64_t n) const {
  return HostCopy(host, pages, n, false);
}

absl::Status KVCacheState::EnqueueSwapCopy(const std::vector<int32_t>& pages,
                                           const std::vector<int32_t>& host_ids, bool to_host,
                                           Stream stream, int* event, bool prefix_tier) {
  int e = -1;
  if (event != nullptr) FP4KV_RETURN_IF_ERROR(copy.Take(&e));
  absl::Status st = [&]() -> absl::Status {
    const int64_t n = static_cast<int64_t>(pages.size());
    FP4KV_RETURN_IF_ERROR(copy.After(stream));
    const Stream side = copy.stream();
    if (n <= PageCopyParams::kInlineIds) {
      // A short list travels in the launch: no upload ahead of the copy.
      PageCopyParams p = HostCopy(nullptr, nullptr, n, to_host, prefix_tier);
      p.inline_ids = true;
      const std::vector<int32_t>& src = to_host ? pages : host_ids;
      const std::vector<int32_t>& dst = to_host ? host_ids : pages;
      std::copy(src.begin(), src.end(), p.ids);
      std::copy(dst.begin(), dst.end(), p.ids + PageCopyParams::kInlineIds);
      FP4KV_RETURN_IF_ERROR(LaunchPageCopy(p, side));
    } else {
      // [2, n] ids (device pages, then host pages) in the swap ids' room for
      // [2, max_pages_per_seq]; the host copy sized by n, not the capacity.
      int32_t* d_ids = reinterpret_cast<int32_t*>(mem.d_step + mem.step_layout.swap_ids);
      internal::HostVector<int32_t> ids;
      FP4KV_RETURN_IF_ERROR(internal::SizeHost(
          &ids, 2 * n, int32_t{0}, to_host ? "SwapOut" : "SwapIn", "the swap's page ids"));
      std::copy(pages.begin(), pages.end(), ids.begin());
      std::copy(host_ids.begin(), host_ids.end(), ids.begin() + n);
      // From pageable memory: staged before the call returns.
      FP4KV_RETURN_IF_ERROR(copy.Upload(d_ids, ids.data(), ids.size() * sizeof(int32_t)));
      FP4KV_RETURN_IF_ERROR(LaunchPageCopy(to_host
                                               ? HostCopy(d_ids, d_ids + n, n, true, prefix_tier)
                                               : HostCopy(d_ids + n, d_ids, n, false, prefix_tier),
                                           side));
    }
    if (e >= 0) FP4KV_RETURN_IF_ERROR(copy.Record(e));
    return absl::OkStatus();
  }();
  if (e < 0) return st;
  if (!st.ok()) {
    copy.Free(e);
    return st;
  }
  *event = e;
  return absl::OkStatus();
}

void KVCacheState::ReleaseEvent(int e) { copy.Release(e); }

void KVCacheState::ReleaseSwapped(Sequence& q) {
  // Host pages are only rewritten by later copies on the copy stream.
  for (int32_t h : q.host_pages) host.pages.Give(h);
  q.host_pages.clear();
  q.swapped = false;
  if (q.pages.empty()) return;
  // Its copy is in flight: the pages go when it is done.
  const std::vector<int32_t> orphan(q.pages.rbegin(), q.pages.rend());  // dropped last page first
  retire.DetachSwapOut(q.id, &orphan);
  q.pages.clear();
}

void KVCacheState::DropSwapIn(Sequence& q) {
  ReleaseEvent(q.swapin_event);
  q.swapin_event = -1;
}

void KVCacheState::HoldCopyEvent(Sequence& q, int e) {
  if (e < 0 || q.swapin_event == e) return;
  if (q.swapin_event >= 0 && copy.NotBefore(q.swapin_event, e)) return;
  DropSwapIn(q);
  q.swapin_event = e;
  copy.Hold(e);
}

absl::Status KVCacheState::OrderAfterCopies(Stream stream) { return copy.OrderAfterAll(stream); }

absl::Status KVCacheState::OrderAfterSwapIn(const Sequence& q, Stream stream) const {
  if (q.swapin_event < 0) return absl::OkStatus();
  return copy.StreamWait(stream, q.swapin_event);
}

int64_t KVCacheState::SwappedTokens(SequenceId* any) const {
  int64_t n = 0;
  for (const Sequence& q : sequences.slots()) {
    if (q.live && q.swapped && q.length > 0) {
      n += q.length;
      if (any != nullptr) *any = q.id;
    }
  }
  return n;
}

}  // namespace internal

absl::StatusOr<bool> KVCache::IsSwappedOut(SequenceId seq) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState::Sequence* q = state_->Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  return q->swapped;
}

absl::Status KVCache::SynchronizeSwaps() {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  if (s.copy.active()) {
    internal::ScopedDevice scoped;
    FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
    FP4KV_RETURN_IF_ERROR(s.copy.Synchronize());
  }
  return s.WaitSwapOuts();
}

absl::Status KVCache::SwapOut(SequenceId seq, Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  s.PollSwaps();
  KVCacheState::Sequence* q = s.Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  if (s.host.pages.pages_total() == 0) {
    return absl::FailedPreconditionError(
        "SwapOut: expected a cache with a host tier (KVCacheOptions::host_tier), got one without");
  }
  if (q->swapped) {
    return absl::FailedPreconditionError(
        absl::StrCat("SwapOut: sequence ", seq, " is already swapped out"));
  }
  const int64_t n = static_cast<int64_t>(q->pages.size());
  if (n > s.host.pages.free_count()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "SwapOut: sequence ", seq, " needs ", n, " host pages, the host tier has ",
        s.host.pages.free_count(), " free of ", s.host.pages.pages_total(), "; nothing changed"));
  }
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  // n: the sequence's pages, at most the host tier's free pages (checked
  // above); becomes the sequence's host page list.
  std::vector<int32_t> host(static_cast<size_t>(n));
  s.host.pages.Peek(n, host.data());
  int event = -1;
  if (s.cuda && n > 0) {
    FP4KV_RETURN_IF_ERROR(s.EnqueueSwapCopy(q->pages, host, /*to_host=*/true, stream, &event));
  } else if (n > 0) {
    internal::ReferencePageCopy(s.PoolToHost(q->pages.data(), host.data(), n));
  }
  // Committed.
  s.host.pages.Drop(n);
  s.DropSwapIn(*q);
  q->swapped = true;
  q->host_pages = std::move(host);
  if (q->chain.tracked) q->chain.Untrack();
  s.host.bytes_swapped_out += n * s.PageBytesAllLayers();
  if (event >= 0) {
    s.retire.AddSwapOut(event, seq, s.step.serial(),
                        s.step.serial() + static_cast<uint64_t>(std::max(2, s.options.step_slots)));
  } else {
    s.ReleasePages(*q);
  }
  return absl::OkStatus();
}

absl::Status KVCache::SwapIn(SequenceId seq, Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  s.PollSwaps();
  KVCacheState::Sequence* q = s.Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  if (!q->swapped) {
    return absl::FailedPreconditionError(
        absl::StrCat("SwapIn: sequence ", seq, " is not swapped out"));
  }
  if (!q->pages.empty()) {
    // Its copy to the host is still in flight: the device pages still hold
    // the data, so keep them; the host pages are only ever rewritten by
    // later copies on the copy stream, which come after this one.
    s.retire.DetachSwapOut(seq, nullptr);
    for (int32_t h : q->host_pages) s.host.pages.Give(h);
    q->host_pages.clear();
    q->swapped = false;
    return absl::OkStatus();
  }
  const int64_t n = static_cast<int64_t>(q->host_pages.size());
  FP4KV_RETURN_IF_ERROR(s.MakeAvailable(n, "SwapIn"));
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  // The pages this evicts are among the n below, written on the copy stream.
  FP4KV_RETURN_IF_ERROR(s.DemoteForAllocation(n, stream, /*writes_on_copy_stream=*/s.cuda));
  std::vector<int32_t> pages;  // n: at most the pool's free pages (MakeAvailable)
  pages.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pages.push_back(s.allocator.Allocate());
  int event = -1;
  if (s.cuda && n > 0) {
    if (absl::Status st =
            s.EnqueueSwapCopy(pages, q->host_pages, /*to_host=*/false, stream, &event);
        !st.ok()) {
      // Demotion copies may still read the pages that go back: a CUDA error
      // only, so a host wait.
      (void)s.copy.Synchronize();
      for (size_t j = pages.size(); j-- > 0;) s.allocator.Release(pages[j]);
      return st;
    }
  } else if (n > 0) {
    internal::ReferencePageCopy(s.HostToPool(q->host_pages.data(), pages.data(), n));
  }
  for (int32_t h : q->host_pages) s.host.pages.Give(h);
  q->host_pages.clear();
  q->pages = std::move(pages);
  ++q->epoch;
  q->swapped = false;
  q->swapin_event = event;
  if (event >= 0) s.copy.Hold(event);
  s.host.bytes_swapped_in += n * s.PageBytesAllLayers();
  return absl::OkStatus();
}

}  // namespace fp4kv
