// KVCache's retire list: page references whose release waits until no step
// (or copy) in flight can still use the pages. One list, one rule (state.h,
// RetireEntry): released pages go at PrepareStep step_serial + step_slots,
// a SwapOut's pages once its copy is done, after max(2, step_slots)
// PrepareSteps; the rule depends only on the calls, so every rank of a
// tensor-parallel group frees the same pages at the same call.
#include <algorithm>

#include "src/kv_cache/state.h"

namespace fp4kv {
namespace internal {

absl::Status RetireState::Init(bool per_page, int64_t num_pages) {
  if (!per_page) return absl::OkStatus();
  return SizeHost(&ready_, num_pages, uint64_t{0}, "KVCache::Create",
                  "the retire serial of every page");
}

RetireEntry& RetireState::Hold(uint64_t ready, uint64_t serial) {
  if (entries_.empty() || !entries_.back().step_pages() || entries_.back().ready != ready) {
    RetireEntry r;
    r.serial = serial;
    r.ready = ready;
    entries_.push_back(std::move(r));
  }
  return entries_.back();
}

void RetireState::AddSwapOut(int event, SequenceId seq, uint64_t serial, uint64_t ready) {
  RetireEntry c;  // see KVCacheState::PollSwaps
  c.event = event;
  c.seq = seq;
  c.serial = serial;
  c.ready = ready;
  entries_.push_back(std::move(c));
}

void RetireState::DetachSwapOut(SequenceId seq, const std::vector<int32_t>* orphan) {
  for (RetireEntry& c : entries_) {
    if (c.seq != seq) continue;
    c.seq = 0;
    if (orphan != nullptr) c.orphan = *orphan;
  }
}

void KVCacheState::FinishOut(SwapOutCopy& c) {
  if (c.seq != 0) {
    Sequence* q = Find(c.seq);
    if (q != nullptr && q->swapped) {
      for (size_t j = q->pages.size(); j-- > 0;) allocator.Release(q->pages[j]);
      q->pages.clear();
      ++q->epoch;
    }
  }
  for (int32_t page : c.orphan) allocator.Release(page);  // in the order dropped
  c.orphan.clear();
  if (c.event >= 0) copy.Free(c.event);
}

void KVCacheState::DropPages(const int32_t* pages, size_t n, int priority) {
  const int slots = options.step_slots;
  RetireEntry* e = nullptr;
  // Last page first: of pages that become cached, the deepest is evicted first.
  const uint64_t ready = step.serial() + static_cast<uint64_t>(slots);
  for (size_t j = n; j-- > 0;) {
    const int32_t page = pages[j];
    allocator.RaisePriority(page, priority);
    if (slots > 1) retire.SetReady(page, ready);  // extends an entry that holds it
    if (slots == 1 || allocator.RefCount(page) > 1) {
      allocator.Release(page);
      continue;
    }
    if (e == nullptr) {
      e = &HoldEntry(ready);
    }
    e->orphan.push_back(page);
  }
}

RetireEntry& KVCacheState::HoldEntry(uint64_t ready) { return retire.Hold(ready, step.serial()); }

void KVCacheState::PollSwaps(bool in_prepare) {
  std::vector<int32_t> later;  // pages dropped again since their entry was made
  retire.Sweep([&](SwapOutCopy& c) {
    const uint64_t now = step.serial() + (in_prepare && c.step_pages() ? 1 : 0);
    if (c.ready > now) return false;
    if (c.event >= 0 && !copy.Wait(c.event).ok()) (void)cudaGetLastError();
    if (c.step_pages()) {
      size_t w = 0;
      for (int32_t page : c.orphan) {
        if (retire.ready(page) > now) {
          later.push_back(page);
        } else {
          c.orphan[w++] = page;
        }
      }
      c.orphan.resize(w);
    }
    FinishOut(c);
    return true;
  });
  for (int32_t page : later) HoldEntry(retire.ready(page)).orphan.push_back(page);
}

absl::Status KVCacheState::WaitSwapOuts() {
  bool any = false;
  for (const SwapOutCopy& c : retire.entries()) any = any || c.event >= 0;
  if (!any) return absl::OkStatus();
  ScopedDevice d;
  FP4KV_RETURN_IF_ERROR(d.Set(options.device));
  for (const SwapOutCopy& c : retire.entries()) {
    if (c.event >= 0) FP4KV_RETURN_IF_ERROR(copy.Wait(c.event));
  }
  retire.Sweep([&](SwapOutCopy& c) {
    if (c.event < 0) return false;
    FinishOut(c);
    return true;
  });
  return absl::OkStatus();
}

absl::Status KVCacheState::RecordStepDone() {
  if (!cuda || step.serial() == 0) return absl::OkStatus();
  StepSlot& last = step.cur();
  if (last.done == nullptr || last.done_recorded) return absl::OkStatus();
  FP4KV_CUDA_RETURN_IF_ERROR(
      cudaEventRecord(last.done, reinterpret_cast<cudaStream_t>(last.stream)));
  last.done_recorded = true;
  return absl::OkStatus();
}

absl::Status KVCacheState::WaitRetiring() {
  FP4KV_RETURN_IF_ERROR(WaitSwapOuts());
  if (retire.empty()) return absl::OkStatus();
  if (cuda) {
    // Steps run in stream order: the latest one done means all of them.
    // Recorded now, but not marked: the next PrepareStep records it again
    // after the rest of the latest step's work.
    ScopedDevice d;
    FP4KV_RETURN_IF_ERROR(d.Set(options.device));
    StepSlot& last = step.cur();
    if (step.serial() > 0 && last.done != nullptr) {
      FP4KV_CUDA_RETURN_IF_ERROR(
          cudaEventRecord(last.done, reinterpret_cast<cudaStream_t>(last.stream)));
      FP4KV_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(last.done));
    }
  }
  retire.Sweep([&](SwapOutCopy& c) {
    FinishOut(c);
    return true;
  });
  return absl::OkStatus();
}

void KVCacheState::RetiringReleases(bool due_only, int64_t* to_free, int64_t* to_cached) const {
  *to_free = *to_cached = 0;
  // A page may be held by several entries: it goes when the last one does.
  std::unordered_map<int32_t, int32_t> held;
  for (const SwapOutCopy& c : retire.entries()) {
    if (!c.step_pages()) continue;
    for (int32_t page : c.orphan) {
      const bool due = retire.ready(page) <= step.serial() + 1;
      held[page] += (!due_only || due) ? 1 : 0x10000;
    }
  }
  for (const auto& [page, n] : held) {
    if (n >= 0x10000 || allocator.RefCount(page) != n) continue;
    ++*(allocator.Indexed(page) ? to_cached : to_free);
  }
}

int64_t KVCacheState::PagesRetiring() const {
  int64_t to_free = 0, to_cached = 0;
  RetiringReleases(false, &to_free, &to_cached);
  return to_free + to_cached;
}

void KVCacheState::PendingReleases(int64_t* to_free, int64_t* to_cached) const {
  *to_free = *to_cached = 0;
  auto count = [&](const std::vector<int32_t>& pages) {
    for (int32_t page : pages) {
      if (allocator.RefCount(page) != 1) continue;
      ++*(allocator.Indexed(page) ? to_cached : to_free);
    }
  };
  for (const SwapOutCopy& c : retire.entries()) {
    if (c.event < 0) continue;
    count(c.orphan);
    if (c.seq != 0) {
      const Sequence* q = Find(c.seq);
      if (q != nullptr && q->swapped) count(q->pages);
    }
  }
}

int64_t KVCacheState::PagesSwapPending() const {
  int64_t n = 0;
  for (const SwapOutCopy& c : retire.entries()) {
    if (c.event < 0) continue;
    n += static_cast<int64_t>(c.orphan.size());
    if (c.seq != 0) {
      const Sequence* q = Find(c.seq);
      if (q != nullptr && q->swapped) n += static_cast<int64_t>(q->pages.size());
    }
  }
  return n;
}

bool KVCacheState::WouldBecomeAvailable(int64_t n) const {
  if (n <= allocator.available_count()) return true;
  int64_t swap_free = 0, swap_cached = 0, retire_free = 0, retire_cached = 0;
  PendingReleases(&swap_free, &swap_cached);
  RetiringReleases(false, &retire_free, &retire_cached);
  return n <= allocator.available_count() + swap_free + swap_cached + retire_free + retire_cached;
}

absl::Status KVCacheState::MakeAvailable(int64_t n, const char* what) {
  if (n > allocator.available_count() && !retire.empty() && WouldBecomeAvailable(n)) {
    FP4KV_RETURN_IF_ERROR(WaitSwapOuts());
    if (n > allocator.available_count()) FP4KV_RETURN_IF_ERROR(WaitRetiring());
  }
  if (n > allocator.available_count()) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": needs ", n, " free pages, the mem.pool has ", allocator.free_count(),
                     " free and ", allocator.cached_count(), " evictable cached of ",
                     allocator.num_pages(), "; nothing changed"));
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace fp4kv
