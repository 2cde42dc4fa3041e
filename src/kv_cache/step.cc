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
  const uint64_t stamp = ++s.step.stamp;
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

}  // namespace internal

// ------------------------------------------------------------------- steps
absl::StatusOr<StepInfo> KVCache::PrepareStep(absl::Span<const StepEntry> entries, Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  const int S = s.options.max_seqs_per_step;
  const int M = s.options.max_pages_per_seq;
  const int ps = s.geometry.page_size;
  const int n = static_cast<int>(entries.size());

  // Pass 1: check everything and count the pages; change nothing (claims and
  // marks are scratch).
  s.PollSwaps();
  internal::ClaimReset claim_reset{s};
  int64_t need = 0;
  FP4KV_RETURN_IF_ERROR(internal::CheckStepEntries(s, entries, &need));
  if (need > s.allocator.available_count() && !s.host.outs.empty()) {
    // Pages still held by SwapOut copies in flight: wait for them.
    FP4KV_RETURN_IF_ERROR(s.WaitSwapOuts());
  }
  if (need > s.allocator.available_count()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("PrepareStep: needs ", need, " free pages (", s.step.cow_src.size(),
                     " of them copies of shared pages), the pool has ", s.allocator.free_count(),
                     " free and ", s.allocator.cached_count(), " evictable cached of ",
                     s.allocator.num_pages(), "; nothing changed"));
  }

  // The previous upload may still read the staging buffer.
  internal::ScopedDevice scoped;
  if (s.cuda) {
    FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
    if (s.step.upload_pending) {
      FP4KV_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(s.step.upload_done));
      s.step.upload_pending = false;
    }
    // Sequences swapped back in: the step's stream waits for their copies.
    for (int i = 0; i < n; ++i) {
      KVCacheState::Sequence& q = *s.step.step_seqs[i];
      if (q.swapin_event < 0) continue;
      FP4KV_RETURN_IF_ERROR(s.OrderAfterSwapIn(q, stream));
      s.DropSwapIn(q);
    }
  }

  // Copies on write first: undone if one cannot be enqueued.
  const int64_t evictions_before = s.allocator.evictions();
  s.step.cow_dst.clear();
  for (size_t k = 0; k < s.step.cow_src.size(); ++k) {
    const int32_t dst = s.allocator.Allocate();
    s.step.cow_dst.push_back(dst);
    if (absl::Status st = s.CopyPage(s.step.cow_src[k], dst, stream); !st.ok()) {
      for (int32_t p : s.step.cow_dst) s.allocator.Release(p);
      return st;
    }
    if (s.prefix.enabled) {  // the page's token ids travel with its bytes
      const absl::Span<const int32_t> ids = s.PageTokens(s.step.cow_src[k]);
      std::copy(ids.begin(), ids.end(), s.prefix.page_tokens.begin() + int64_t{dst} * ps);
    }
  }

  // Pass 2: commit. Nothing below fails until the upload.
  StepInfo info;
  info.num_seqs = n;
  info.pages_copied = static_cast<int64_t>(s.step.cow_dst.size());
  const int32_t free_before =
      s.allocator.available_count() + static_cast<int32_t>(s.step.cow_dst.size());
  int64_t tok = 0;
  int dirty_lo = S;
  int dirty_hi = -1;
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
    while (q.pages.size() < pages_after) q.pages.push_back(s.allocator.Allocate());
    int64_t j = old_len / ps;
    int64_t e = old_len % ps;
    for (int64_t pos = old_len; pos < new_len; ++pos) {
      s.step.h_slots[tok++] = static_cast<int64_t>(q.pages[j]) * ps + e;
      if (++e == ps) {
        e = 0;
        ++j;
      }
    }
    q.length = new_len;
    if (s.prefix.enabled) s.CommitTokens(q, entries[i], tok - (new_len - old_len));
    const int32_t count = static_cast<int32_t>(q.pages.size());
    s.step.h_seq_lens[i] = static_cast<int32_t>(new_len);
    s.step.h_token_indptr[i + 1] = static_cast<int32_t>(tok);
    s.step.h_kv_indptr[i + 1] = s.step.h_kv_indptr[i] + count;
    info.max_seq_len = std::max(info.max_seq_len, static_cast<int32_t>(new_len));
    KVCacheState::Row& r = s.step.rows[i];
    const int32_t from = (r.seq == id && r.epoch == q.epoch && r.count <= count) ? r.count : 0;
    if (from < count) {
      std::memcpy(s.step.h_tables + static_cast<int64_t>(i) * M + from, q.pages.data() + from,
                  sizeof(int32_t) * (count - from));
      dirty_lo = std::min(dirty_lo, i);
      dirty_hi = i;
    }
    r = KVCacheState::Row{id, q.epoch, count};
  }
  // Padding: unused rows read nothing, unused slots write nothing.
  for (int i = n; i < s.step.rows_used; ++i) s.step.h_seq_lens[i] = 0;
  std::fill(s.step.h_kv_indptr + n + 1, s.step.h_kv_indptr + S + 1, s.step.h_kv_indptr[n]);
  std::fill(s.step.h_token_indptr + n + 1, s.step.h_token_indptr + S + 1, s.step.h_token_indptr[n]);
  const int64_t slot_upload = std::max(tok, s.step.slot_extent);
  if (tok < s.step.slot_extent)
    std::fill(s.step.h_slots + tok, s.step.h_slots + s.step.slot_extent, int64_t{-1});
  s.step.slot_extent = tok;
  s.step.rows_used = n;

  info.num_tokens = tok;
  info.num_pages = s.step.h_kv_indptr[n];
  info.fp8_workspace_pages = 1 + info.num_pages;
  info.pages_allocated = free_before - s.allocator.available_count();
  info.pages_evicted = s.allocator.evictions() - evictions_before;
  s.step.info = info;
  ++s.step.step_serial;

  if (s.cuda) {
    const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
    const internal::StepLayout& sl = s.mem.step_layout;
    const uint8_t* host = s.mem.staging.get();
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.mem.d_step, host, sl.slots + 8 * slot_upload,
                                               cudaMemcpyHostToDevice, cs));
    if (dirty_hi >= dirty_lo) {
      const int64_t row_bytes = 4 * static_cast<int64_t>(M);
      const int64_t off = sl.tables + dirty_lo * row_bytes;
      FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.mem.d_step + off, host + off,
                                                 (dirty_hi - dirty_lo + 1) * row_bytes,
                                                 cudaMemcpyHostToDevice, cs));
    }
    FP4KV_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.step.upload_done, cs));
    s.step.upload_pending = true;
  }
  return info;
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
  p.pages_evictable = s.allocator.cached_count();
  int64_t pending_free = 0, pending_cached = 0;
  s.PendingReleases(&pending_free, &pending_cached);
  p.pages_swap_pending = pending_free + pending_cached;
  const int64_t available = s.allocator.available_count();
  p.fits = need <= available + p.pages_swap_pending;
  if (p.fits) {
    // PrepareStep waits for the copies only when the pages available now do not suffice.
    const int64_t free = need <= available ? p.pages_free : p.pages_free + pending_free;
    p.pages_evicted = std::max<int64_t>(0, need - free);
    p.pages_left = available + p.pages_swap_pending - need;
    p.tokens_left = p.pages_left * s.geometry.page_size;
  }
  return p;
}

namespace {
const StepInfo kNoStep{};
const StepViews kNoViews{};
}  // namespace

const StepInfo& KVCache::step() const { return state_ ? state_->step.info : kNoStep; }
const StepViews& KVCache::step_views() const { return state_ ? state_->step.views : kNoViews; }

absl::Span<const int64_t> KVCache::host_slot_mapping() const {
  if (state_ == nullptr) return {};
  return absl::Span<const int64_t>(state_->step.h_slots, state_->step.info.num_tokens);
}
absl::Span<const int32_t> KVCache::host_seq_lens() const {
  if (state_ == nullptr) return {};
  return absl::Span<const int32_t>(state_->step.h_seq_lens, state_->step.info.num_seqs);
}
absl::Span<const int32_t> KVCache::host_kv_page_indptr() const {
  if (state_ == nullptr) return {};
  return absl::Span<const int32_t>(state_->step.h_kv_indptr, state_->step.info.num_seqs + 1);
}
absl::Span<const int32_t> KVCache::host_token_indptr() const {
  if (state_ == nullptr) return {};
  return absl::Span<const int32_t>(state_->step.h_token_indptr, state_->step.info.num_seqs + 1);
}
absl::Span<const int32_t> KVCache::host_block_table(int row) const {
  if (state_ == nullptr || row < 0 || row >= state_->options.max_seqs_per_step) return {};
  const int M = state_->options.max_pages_per_seq;
  return absl::Span<const int32_t>(state_->step.h_tables + static_cast<int64_t>(row) * M, M);
}

}  // namespace fp4kv
