// KVCache steps: the step builder (CheckStepEntries, PrepareStep, PlanStep)
// and the step staging.
#include <algorithm>
#include <cstring>

#include "src/kv_cache/state.h"

namespace fp4kv {

using internal::CeilDiv;
using internal::KVCacheState;

namespace internal {

absl::Status CheckStepEntries(KVCacheState& s, absl::Span<const StepEntry> entries,
                              int64_t* need_out) {
  const int S = s.options.max_seqs_per_step;
  const int M = s.options.max_pages_per_seq;
  const int ps = s.geometry.page_size;
  const int64_t max_len = static_cast<int64_t>(M) * ps;
  if (entries.size() > static_cast<size_t>(S)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "entries: expected at most max_seqs_per_step = ", S, " entries, got ", entries.size()));
  }
  const int n = static_cast<int>(entries.size());
  const uint64_t stamp = s.step.NewStamp();
  s.step.cow_src.clear();
  s.step.cow_entry.clear();
  int64_t tokens = 0;
  int64_t need = 0;
  for (int i = 0; i < n; ++i) {
    const StepEntry& e = entries[i];
    if (e.num_new_tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("entries[", i, "].num_new_tokens: expected >= 0, got ", e.num_new_tokens));
    }
    if (!e.token_ids.empty() && e.token_ids.size() != static_cast<size_t>(e.num_new_tokens)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "entries[", i, "].token_ids: expected none or num_new_tokens = ", e.num_new_tokens,
          " ids, got ", e.token_ids.size()));
    }
    KVCacheState::Sequence* q = s.Find(e.seq);
    if (q == nullptr) {
      return KVCacheState::Unknown(absl::StrCat("entries[", i, "].seq").c_str(), e.seq);
    }
    if (q->swapped) {
      return absl::FailedPreconditionError(
          absl::StrCat("entries[", i, "].seq: sequence ", e.seq,
                       " is swapped out to the host tier (SwapIn it first); nothing changed"));
    }
    if (q->mark == stamp) {
      return absl::InvalidArgumentError(absl::StrCat(
          "entries[", i, "].seq: expected each sequence at most once per step, got id ", e.seq,
          " again"));
    }
    q->mark = stamp;
    s.step.step_seqs[i] = q;
    tokens += e.num_new_tokens;
    const int64_t new_len = q->length + e.num_new_tokens;
    if (new_len > max_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("entries[", i, "].num_new_tokens: expected at most ", max_len - q->length,
                       " (max_pages_per_seq * page_size = ", max_len, " minus the length ",
                       q->length, " of sequence ", e.seq, "), got ", e.num_new_tokens));
    }
    need += CeilDiv(new_len, ps) - static_cast<int64_t>(q->pages.size());
    if (e.num_new_tokens > 0 && q->length % ps != 0) {
      const int32_t last = q->pages.back();
      if (s.allocator.RefCount(last) - s.step.claim[last] > 1) {  // still shared when we get to it
        ++s.step.claim[last];
        s.step.cow_src.push_back(last);
        s.step.cow_entry.push_back(i);
        ++need;
      }
    }
  }
  if (tokens > s.options.max_tokens_per_step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "entries: expected at most max_tokens_per_step = ", s.options.max_tokens_per_step,
        " new tokens in all, got ", tokens));
  }
  *need_out = need;
  return absl::OkStatus();
}

// Sequences of the step swapped back in, or holding pages whose promotion
// from the host tier of the prefix cache may be in flight (their own or
// shared): `stream` waits for their copies. Steps of other sequences do not.
absl::Status OrderStepAfterSwapIns(KVCacheState& s, int n, Stream stream) {
  for (int i = 0; i < n; ++i) {
    KVCacheState::Sequence& q = *s.step.step_seqs[i];
    if (q.swapin_event < 0) continue;
    FP4KV_RETURN_IF_ERROR(s.OrderAfterSwapIn(q, stream));
    s.DropSwapIn(q);
  }
  return absl::OkStatus();
}

namespace {

// Phase 1: what the previous steps leave. Waits for the step that last used
// slot k (two or more slots: it reads the buffers this call rewrites), then
// retires what is due (SwapOut copies; pages released while that step was
// the latest) and applies the late token ids due now.
absl::Status RetireBeforeStep(KVCacheState& s, StepSlot& slot) {
  const int N = static_cast<int>(s.step.slots.size());
  if (s.cuda) s.PollPromotions();  // no host wait: what is known complete now
  if (N > 1 && s.step.serial() > 0) {
    // The step in flight is complete once this event is (its kernels were
    // enqueued before this call).
    FP4KV_RETURN_IF_ERROR(s.RecordStepDone());
    if (s.cuda && slot.serial > 0) {
      FP4KV_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot.done));
      slot.upload_pending = false;
    }
  }
  s.PollSwaps(/*in_prepare=*/true);
  if (s.prefix.enabled && !s.prefix.pending_ids.empty()) s.ApplyPendingIds(s.step.serial() + 1);
  return absl::OkStatus();
}

// Phase 2 (pass 1): checks every entry and counts the pages the step needs
// (*need); waits for pages only SwapOut copies or steps in flight hold when
// they are needed; ResourceExhausted when they do not suffice. Changes
// nothing but scratch (the caller's ClaimReset undoes the claims).
absl::Status CheckStep(KVCacheState& s, absl::Span<const StepEntry> entries, int64_t* need) {
  FP4KV_RETURN_IF_ERROR(CheckStepEntries(s, entries, need));
  if (*need > s.allocator.available_count() && !s.retire.empty() && s.WouldBecomeAvailable(*need)) {
    // Pages still held by SwapOut copies or by the steps in flight: wait.
    FP4KV_RETURN_IF_ERROR(s.WaitSwapOuts());
    if (*need > s.allocator.available_count()) FP4KV_RETURN_IF_ERROR(s.WaitRetiring());
  }
  if (*need > s.allocator.available_count()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("PrepareStep: needs ", *need, " free pages (", s.step.cow_src.size(),
                     " of them copies of shared pages), the pool has ", s.allocator.free_count(),
                     " free and ", s.allocator.cached_count(), " evictable cached of ",
                     s.allocator.num_pages(), "; nothing changed"));
  }
  return absl::OkStatus();
}

// Phase 3 (CUDA): the slot's staging is free to rewrite, and `stream` is
// ordered after the previous step's work when that ran on another stream.
absl::Status OrderStepStream(KVCacheState& s, StepSlot& slot, Stream stream) {
  if (!s.cuda) return absl::OkStatus();
  // The slot's previous upload may still read its staging (one slot: the
  // previous step's upload, normally long done).
  if (slot.upload_pending) {
    FP4KV_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot.upload_done));
    slot.upload_pending = false;
  }
  // Steps on different streams: this step's work follows the previous
  // step's (its appends precede this step's reads).
  const StepSlot& prev = s.step.cur();
  if (s.step.slots.size() > 1 && s.step.serial() > 0 && prev.stream != stream) {
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), prev.done, 0));
  }
  return absl::OkStatus();
}

// Phase 4: demotions for the pages the step evicts, then the copies on
// write (into s.step.cow_dst); a copy that cannot be enqueued gives its new
// pages back.
absl::Status CopyOnWrite(KVCacheState& s, int64_t need, bool waits_after_upload, Stream stream) {
  // Cached pages the allocations below evict go to the host tier of the
  // prefix cache (copied before this step's work on `stream` rewrites them:
  // `stream` waits for the copies, here or after the upload).
  FP4KV_RETURN_IF_ERROR(
      s.DemoteForAllocation(need, stream, /*writes_on_copy_stream=*/waits_after_upload));
  s.step.cow_dst.clear();
  for (size_t c = 0; c < s.step.cow_src.size(); ++c) {
    const int32_t dst = s.allocator.Allocate();
    s.step.cow_dst.push_back(dst);
    // A page a promotion may still be writing: its copy goes first.
    absl::Status st = s.OrderAfterPromotion({&dst, 1}, stream);
    if (st.ok()) st = s.CopyPage(s.step.cow_src[c], dst, stream);
    if (!st.ok()) {
      for (int32_t p : s.step.cow_dst) s.allocator.Release(p);
      return st;
    }
    s.CopyPageTokens(s.step.cow_src[c], dst);  // the page's token ids travel with its bytes
  }
  return absl::OkStatus();
}

// What the commit leaves for the upload.
struct StagedStep {
  StepInfo info;
  int64_t slot_upload = 0;          // slots [0, slot_upload) of the staging to upload
  int dirty_lo = 0, dirty_hi = -1;  // block-table rows that changed
  bool reused_promoted = false;     // a new page a promotion may still be writing
};

// Phase 5 (pass 2): commits the step into the sequences, the allocator and
// slot k's staging. Nothing here fails.
StagedStep CommitStep(KVCacheState& s, absl::Span<const StepEntry> entries, int k) {
  const int S = s.options.max_seqs_per_step;
  const int M = s.options.max_pages_per_seq;
  const int ps = s.geometry.page_size;
  const int n = static_cast<int>(entries.size());
  StepSlot& slot = s.step.slots[k];
  StagedStep out;
  StepInfo& info = out.info;
  s.step.SetCurrent(k);
  info.slot = k;
  info.num_seqs = n;
  info.pages_copied = static_cast<int64_t>(s.step.cow_dst.size());
  const int32_t free_before =
      s.allocator.available_count() + static_cast<int32_t>(s.step.cow_dst.size());
  int64_t tok = 0;
  out.dirty_lo = S;
  size_t next_cow = 0;
  for (int i = 0; i < n; ++i) {
    KVCacheState::Sequence& q = *s.step.step_seqs[i];
    const SequenceId id = entries[i].seq;
    if (next_cow < s.step.cow_entry.size() && s.step.cow_entry[next_cow] == i) {
      s.allocator.Release(q.pages.back());  // stays >= 1: another sequence holds it
      q.pages.back() = s.step.cow_dst[next_cow++];
      ++q.epoch;
    }
    const int64_t old_len = q.length;
    const int64_t new_len = old_len + entries[i].num_new_tokens;
    // An indexed partial last page about to be written (after a truncation)
    // leaves the index: its cached content is being overwritten.
    if (q.chain.tail_maybe_indexed && new_len > old_len) {
      if (old_len % ps != 0) s.allocator.Unregister(q.pages.back());
      q.chain.tail_maybe_indexed = false;
    }
    const size_t pages_after = static_cast<size_t>(CeilDiv(new_len, ps));
    while (q.pages.size() < pages_after) {
      q.pages.push_back(s.allocator.Allocate());
      out.reused_promoted = out.reused_promoted || s.PromotionPending(q.pages.back());
    }
    int64_t j = old_len / ps;
    int64_t e = old_len % ps;
    for (int64_t pos = old_len; pos < new_len; ++pos) {
      slot.h_slots[tok++] = static_cast<int64_t>(q.pages[j]) * ps + e;
      if (++e == ps) {
        e = 0;
        ++j;
      }
    }
    q.length = new_len;
    if (s.prefix.enabled) s.CommitTokens(q, entries[i], tok - (new_len - old_len));
    const int32_t count = static_cast<int32_t>(q.pages.size());
    slot.h_seq_lens[i] = static_cast<int32_t>(new_len);
    slot.h_token_indptr[i + 1] = static_cast<int32_t>(tok);
    slot.h_kv_indptr[i + 1] = slot.h_kv_indptr[i] + count;
    info.max_seq_len = std::max(info.max_seq_len, static_cast<int32_t>(new_len));
    KVCacheState::Row& r = slot.rows[i];
    const int32_t from = (r.seq == id && r.epoch == q.epoch && r.count <= count) ? r.count : 0;
    if (from < count) {
      std::memcpy(slot.h_tables + static_cast<int64_t>(i) * M + from, q.pages.data() + from,
                  sizeof(int32_t) * (count - from));
      out.dirty_lo = std::min(out.dirty_lo, i);
      out.dirty_hi = i;
    }
    r = KVCacheState::Row{id, q.epoch, count};
  }
  // Padding: unused rows read nothing, unused slots write nothing.
  for (int i = n; i < slot.rows_used; ++i) slot.h_seq_lens[i] = 0;
  std::fill(slot.h_kv_indptr + n + 1, slot.h_kv_indptr + S + 1, slot.h_kv_indptr[n]);
  std::fill(slot.h_token_indptr + n + 1, slot.h_token_indptr + S + 1, slot.h_token_indptr[n]);
  out.slot_upload = std::max(tok, slot.slot_extent);
  if (tok < slot.slot_extent)
    std::fill(slot.h_slots + tok, slot.h_slots + slot.slot_extent, int64_t{-1});
  slot.slot_extent = tok;
  slot.rows_used = n;

  info.num_tokens = tok;
  info.num_pages = slot.h_kv_indptr[n];
  info.fp8_workspace_pages = 1 + info.num_pages;
  info.pages_allocated = free_before - s.allocator.available_count();
  slot.info = info;
  slot.serial = s.step.Advance();
  slot.done_recorded = false;
  return out;
}

// The upload of slot's staging on `stream` and its upload_done event.
absl::Status EnqueueUpload(KVCacheState& s, const StagedStep& staged, StepSlot& slot,
                           Stream stream) {
  if (CopyFailsForTesting(/*upload=*/true)) {
    return absl::InternalError("PrepareStep upload: injected failure");
  }
  const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
  const StepLayout& sl = s.mem.step_layout;
  const uint8_t* host = slot.h_base;
  FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.d_base, host, sl.slots + 8 * staged.slot_upload,
                                             cudaMemcpyHostToDevice, cs));
  if (staged.dirty_hi >= staged.dirty_lo) {
    const int64_t row_bytes = 4 * static_cast<int64_t>(s.options.max_pages_per_seq);
    const int64_t off = sl.tables + staged.dirty_lo * row_bytes;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.d_base + off, host + off,
                                               (staged.dirty_hi - staged.dirty_lo + 1) * row_bytes,
                                               cudaMemcpyHostToDevice, cs));
  }
  FP4KV_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.upload_done, cs));
  slot.upload_pending = true;
  return absl::OkStatus();
}

// Phase 6 (CUDA): uploads slot k's staging on `stream` and makes `stream`
// wait for the copies the step's pages need. After the commit: an error
// here is a CUDA error (docs/kv_cache.md, "CUDA errors after a commit").
absl::Status UploadStep(KVCacheState& s, const StagedStep& staged, int n, bool waits_after_upload,
                        bool demoted, Stream stream) {
  StepSlot& slot = s.step.cur();
  // Whatever fails below, the slot's device buffers may not hold this step:
  // the next PrepareStep on the slot uploads all of them (no row or slot is
  // taken as already there).
  auto forget_upload = [&slot] {
    for (KVCacheState::Row& r : slot.rows) r = KVCacheState::Row{};
    slot.slot_extent = static_cast<int64_t>(slot.views.slot_mapping.shape[0]);
  };
  absl::Status st = EnqueueUpload(s, staged, slot, stream);
  if (!st.ok()) {
    forget_upload();
    return st;
  }
  if (waits_after_upload) {
    FP4KV_RETURN_IF_ERROR(OrderStepAfterSwapIns(s, n, stream));
    if (demoted) FP4KV_RETURN_IF_ERROR(s.OrderAfterCopies(stream));
  }
  // The step's appends into a page a promotion may still be writing come
  // after that copy.
  if (staged.reused_promoted) {
    FP4KV_RETURN_IF_ERROR(s.copy.StreamWait(stream, s.prefix_host.latest_event));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace internal

// ------------------------------------------------------------------- steps
// The phases in order: retire what is due, check (pass 1), order the
// stream, demote and copy on write, commit (pass 2), upload.
absl::StatusOr<StepInfo> KVCache::PrepareStep(absl::Span<const StepEntry> entries, Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  const int n = static_cast<int>(entries.size());
  const int k = s.step.next();
  internal::StepSlot& slot = s.step.slots[k];
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));

  FP4KV_RETURN_IF_ERROR(internal::RetireBeforeStep(s, slot));
  internal::ClaimReset claim_reset{s};
  int64_t need = 0;
  FP4KV_RETURN_IF_ERROR(internal::CheckStep(s, entries, &need));
  FP4KV_RETURN_IF_ERROR(internal::OrderStepStream(s, slot, stream));
  // Waits of the step's stream for copies on the copy stream (sequences
  // swapped back in, pages promoted from or demoted to the host tier of the
  // prefix cache). The upload writes only the slot's step buffers, so
  // without copies on write (which read and write pages on `stream`) the
  // waits follow the upload: the upload then overlaps the copies, and
  // upload_done (which the next one-slot PrepareStep waits for on the host)
  // does not wait for them.
  const bool waits_after_upload = s.step.cow_src.empty();
  if (s.cuda && !waits_after_upload) {
    FP4KV_RETURN_IF_ERROR(internal::OrderStepAfterSwapIns(s, n, stream));
  }
  const int64_t evictions_before = s.allocator.evictions();
  const int64_t demotions_before = s.prefix_host.demotions;
  FP4KV_RETURN_IF_ERROR(internal::CopyOnWrite(s, need, waits_after_upload, stream));

  internal::StagedStep staged = internal::CommitStep(s, entries, k);
  staged.info.pages_evicted = s.allocator.evictions() - evictions_before;
  slot.info.pages_evicted = staged.info.pages_evicted;
  slot.stream = stream;
  if (s.cuda) {
    FP4KV_RETURN_IF_ERROR(internal::UploadStep(
        s, staged, n, waits_after_upload, s.prefix_host.demotions != demotions_before, stream));
  }
  return staged.info;
}

absl::StatusOr<StepPlan> KVCache::PlanStep(absl::Span<const StepEntry> entries) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;  // only scratch is written (and finished swaps)
  s.PollSwaps();
  internal::ClaimReset claim_reset{s};
  int64_t need = 0;
  FP4KV_RETURN_IF_ERROR(internal::CheckStepEntries(s, entries, &need));
  StepPlan p;
  p.pages_needed = need;
  p.pages_copied = static_cast<int64_t>(s.step.cow_src.size());
  p.pages_free = s.allocator.free_count();
  // Released pages PrepareStep retires before its check count as free or
  // cached now; the others wait for the steps in flight.
  int64_t due_free = 0, due_cached = 0, all_free = 0, all_cached = 0;
  s.RetiringReleases(/*due_only=*/true, &due_free, &due_cached);
  s.RetiringReleases(/*due_only=*/false, &all_free, &all_cached);
  p.pages_free = s.allocator.free_count() + due_free;
  p.pages_evictable = s.allocator.cached_count() + due_cached;
  p.pages_retiring = all_free + all_cached - due_free - due_cached;
  int64_t pending_free = 0, pending_cached = 0;
  s.PendingReleases(&pending_free, &pending_cached);
  p.pages_swap_pending = pending_free + pending_cached;
  const int64_t available = p.pages_free + p.pages_evictable;
  p.fits = need <= available + p.pages_swap_pending + p.pages_retiring;
  if (p.fits) {
    // PrepareStep waits for the copies, then for the steps, only when the
    // pages available before do not suffice.
    int64_t free = p.pages_free;
    if (need > available) free += pending_free;
    if (need > available + p.pages_swap_pending) free += all_free - due_free;
    p.pages_evicted = std::max<int64_t>(0, need - free);
    p.pages_left = available + p.pages_swap_pending + p.pages_retiring - need;
    p.tokens_left = p.pages_left * s.geometry.page_size;
  }
  return p;
}

namespace {
const StepInfo kNoStep{};
const StepViews kNoViews{};
}  // namespace

const StepInfo& KVCache::step() const { return state_ ? state_->step.cur().info : kNoStep; }
const StepViews& KVCache::step_views() const {
  return state_ ? state_->step.cur().views : kNoViews;
}
const StepInfo& KVCache::step(int slot) const {
  if (state_ == nullptr || slot < 0 || slot >= static_cast<int>(state_->step.slots.size()))
    return kNoStep;
  return state_->step.slots[slot].info;
}
const StepViews& KVCache::step_views(int slot) const {
  if (state_ == nullptr || slot < 0 || slot >= static_cast<int>(state_->step.slots.size()))
    return kNoViews;
  return state_->step.slots[slot].views;
}

absl::Span<const int64_t> KVCache::host_slot_mapping() const {
  if (state_ == nullptr) return {};
  return absl::Span<const int64_t>(state_->step.cur().h_slots, state_->step.cur().info.num_tokens);
}
absl::Span<const int32_t> KVCache::host_seq_lens() const {
  if (state_ == nullptr) return {};
  return absl::Span<const int32_t>(state_->step.cur().h_seq_lens, state_->step.cur().info.num_seqs);
}
absl::Span<const int32_t> KVCache::host_kv_page_indptr() const {
  if (state_ == nullptr) return {};
  return absl::Span<const int32_t>(state_->step.cur().h_kv_indptr,
                                   state_->step.cur().info.num_seqs + 1);
}
absl::Span<const int32_t> KVCache::host_token_indptr() const {
  if (state_ == nullptr) return {};
  return absl::Span<const int32_t>(state_->step.cur().h_token_indptr,
                                   state_->step.cur().info.num_seqs + 1);
}
absl::Span<const int32_t> KVCache::host_block_table(int row) const {
  if (state_ == nullptr || row < 0 || row >= state_->options.max_seqs_per_step) return {};
  const int M = state_->options.max_pages_per_seq;
  return absl::Span<const int32_t>(state_->step.cur().h_tables + static_cast<int64_t>(row) * M, M);
}

}  // namespace fp4kv
