// KVCache sequences: create, fork, truncate, release, read back.
#include <algorithm>
#include <cstring>
#include <tuple>
#include <unordered_map>

#include "src/kv_cache/state.h"
#include "src/validate.h"

namespace fp4kv {

using internal::CeilDiv;
using internal::KVCacheState;

namespace internal {

absl::Status KVCacheState::CheckLayer(int layer) const {
  if (layer < 0 || layer >= options.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: expected in [0, ", options.num_layers, "), got ", layer));
  }
  return absl::OkStatus();
}

Sequence* SequenceTable::Find(SequenceId id) {
  auto it = slot_of_.find(id);
  if (it == slot_of_.end()) return nullptr;
  Sequence& s = all_[it->second];
  return s.live && s.id == id ? &s : nullptr;
}

const Sequence* SequenceTable::Find(SequenceId id) const {
  return const_cast<SequenceTable*>(this)->Find(id);
}

Sequence& SequenceTable::Add() {
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<uint32_t>(all_.size());
    all_.emplace_back();
  }
  Sequence& q = all_[slot];
  q.live = true;
  q.length = 0;
  q.pages.clear();
  q.priority = 0;
  ++q.epoch;
  ++live_;
  q.id = next_id_++;
  slot_of_.emplace(q.id, slot);
  return q;
}

void SequenceTable::Remove(Sequence& q) {
  q.pages.clear();  // keeps the capacity for the next sequence in this slot
  q.chain.Reset(false, {});
  q.length = 0;
  q.live = false;
  free_slots_.push_back(SlotOf(q));
  slot_of_.erase(q.id);
  q.id = 0;
  --live_;
}

absl::Status SequenceTable::Validate() const {
  int64_t live = 0;
  for (size_t slot = 0; slot < all_.size(); ++slot) {
    const Sequence& q = all_[slot];
    if (!q.live) continue;
    ++live;
    auto it = slot_of_.find(q.id);
    if (q.id <= 0 || q.id >= next_id_ || it == slot_of_.end() || it->second != slot) {
      return absl::InternalError(
          absl::StrCat("sequence slot ", slot, ": live id ", q.id, " is not mapped to it"));
    }
  }
  if (live != live_ || static_cast<int64_t>(slot_of_.size()) != live ||
      all_.size() != static_cast<size_t>(live) + free_slots_.size()) {
    return absl::InternalError(
        absl::StrCat("sequences: ", live, " live records, count ", live_, ", ", slot_of_.size(),
                     " ids mapped, ", free_slots_.size(), " free of ", all_.size(), " slots"));
  }
  for (uint32_t slot : free_slots_) {
    if (slot >= all_.size() || all_[slot].live) {
      return absl::InternalError(absl::StrCat("sequences: free slot ", slot, " is live"));
    }
  }
  return absl::OkStatus();
}

Sequence* KVCacheState::Find(SequenceId id) { return sequences.Find(id); }

const Sequence* KVCacheState::Find(SequenceId id) const { return sequences.Find(id); }

absl::Status KVCacheState::Unknown(const char* name, SequenceId id) {
  return absl::NotFoundError(
      absl::StrCat(name, ": unknown sequence id ", id, " (never created or already released)"));
}

absl::StatusOr<Sequence*> KVCacheState::FindResident(SequenceId id, const char* call,
                                                     const char* name) {
  Sequence* q = Find(id);
  if (q == nullptr) return Unknown(name, id);
  if (q->swapped) {
    return absl::FailedPreconditionError(absl::StrCat(
        call, ": sequence ", id, " is swapped out to the host tier (SwapIn it first)"));
  }
  return q;
}

absl::StatusOr<const Sequence*> KVCacheState::FindResident(SequenceId id, const char* call,
                                                           const char* name) const {
  absl::StatusOr<Sequence*> q = const_cast<KVCacheState*>(this)->FindResident(id, call, name);
  if (!q.ok()) return q.status();
  return *q;
}

int64_t KVCacheState::TokensResident() const {
  const int ps = geometry.page_size;
  struct Partial {
    int32_t owners = 0;
    int64_t fill = 0;
  };
  std::unordered_map<int32_t, Partial> partial;
  for (const Sequence& q : sequences.slots()) {
    if (!q.live || q.length % ps == 0 || q.pages.empty()) continue;
    Partial& p = partial[q.pages.back()];
    ++p.owners;
    p.fill = std::max<int64_t>(p.fill, q.length % ps);
  }
  // Retiring pages (two or more step slots) hold no tokens of anyone.
  int64_t n = (allocator.used_count() - images.reserved_pages() - PagesRetiring() -
               static_cast<int64_t>(partial.size())) *
              ps;
  for (const auto& [page, p] : partial) n += p.owners < allocator.RefCount(page) ? ps : p.fill;
  return n;
}

void KVCacheState::ReleasePages(Sequence& q) {
  DropPages(q.pages.data(), q.pages.size(), q.priority);
  q.pages.clear();
  ++q.epoch;
}

}  // namespace internal

namespace internal {

SequenceId KVCacheState::NewSequence() {
  Sequence& q = sequences.Add();
  q.chain.Reset(prefix.enabled, {});
  return q.id;
}

}  // namespace internal

// --------------------------------------------------------------- sequences
absl::StatusOr<SequenceId> KVCache::CreateSequence() {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  return state_->NewSequence();
}

absl::StatusOr<SequenceId> KVCache::ForkSequence(SequenceId parent) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  FP4KV_RETURN_IF_ERROR(s.FindResident(parent, "ForkSequence", "parent").status());
  const SequenceId child = s.NewSequence();  // may move s.seqs: look the parent up again
  const KVCacheState::Sequence& p = *s.Find(parent);
  KVCacheState::Sequence& c = *s.Find(child);
  c.length = p.length;
  c.pages = p.pages;
  c.chain = p.chain;
  c.priority = p.priority;
  for (int32_t page : c.pages) s.allocator.Retain(page);
  c.swapin_event = p.swapin_event;  // its pages arrive with the parent's copy
  if (c.swapin_event >= 0) s.copy.Hold(c.swapin_event);
  s.InheritPromotion(c, c.pages);  // or with a promotion still in flight
  return child;
}

absl::Status KVCache::Truncate(SequenceId seq, int64_t new_len) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  absl::StatusOr<KVCacheState::Sequence*> found = s.FindResident(seq, "Truncate");
  if (!found.ok()) return found.status();
  KVCacheState::Sequence* q = *found;
  if (new_len < 0 || new_len > q->length) {
    return absl::InvalidArgumentError(absl::StrCat("new_len: expected in [0, ", q->length,
                                                   "] (the sequence's length), got ", new_len));
  }
  const size_t keep = static_cast<size_t>(CeilDiv(new_len, s.geometry.page_size));
  if (keep < q->pages.size()) {
    // Last page first (DropPages): of pages that become cached, the deepest
    // is evicted first.
    s.DropPages(q->pages.data() + keep, q->pages.size() - keep, q->priority);
    q->pages.resize(keep);
    ++q->epoch;
  }
  q->length = new_len;
  ++q->truncations;
  q->chain.Truncate(new_len, s.geometry.page_size);
  return absl::OkStatus();
}

absl::Status KVCache::ReleaseSequence(SequenceId seq) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  KVCacheState::Sequence* q = s.Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  if (q->swapped) s.ReleaseSwapped(*q);
  s.DropSwapIn(*q);
  // Last page first (DropPages): of pages that become cached, the deepest
  // is evicted first.
  s.DropPages(q->pages.data(), q->pages.size(), q->priority);
  s.sequences.Remove(*q);
  return absl::OkStatus();
}

absl::Status KVCache::SetRetentionPriority(SequenceId seq, int priority) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState::Sequence* q = state_->Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  if (priority < 0 || priority > kMaxRetentionPriority) {
    return absl::InvalidArgumentError(absl::StrCat("priority: expected 0 .. ",
                                                   kMaxRetentionPriority, ", got ", priority));
  }
  q->priority = priority;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> KVCache::SequenceLength(SequenceId seq) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState::Sequence* q = state_->Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  return q->length;
}

absl::StatusOr<absl::Span<const int32_t>> KVCache::SequencePages(SequenceId seq) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState::Sequence* q = state_->Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  return absl::Span<const int32_t>(q->pages);
}

absl::StatusOr<int32_t> KVCache::PageRefCount(int64_t page) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  if (page < 0 || page >= state_->geometry.num_pages) {
    return absl::InvalidArgumentError(
        absl::StrCat("page: expected in [0, ", state_->geometry.num_pages, "), got ", page));
  }
  return state_->allocator.RefCount(static_cast<int32_t>(page));
}

absl::Status KVCache::ReadSequence(int layer, SequenceId seq, const TensorView& k_out,
                                   const TensorView& v_out, Stream stream) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  absl::StatusOr<const KVCacheState::Sequence*> found = s.FindResident(seq, "ReadSequence");
  if (!found.ok()) return found.status();
  const KVCacheState::Sequence* q = *found;
  const CacheGeometry& g = s.geometry;
  // Shapes here; dtype, alignment and device through the Dequantizer below.
  for (const auto& [t, name, dim] :
       {std::tuple<const TensorView&, const char*, int>{k_out, "k_out", g.head_dim_k},
        std::tuple<const TensorView&, const char*, int>{v_out, "v_out", g.head_dim_v}}) {
    FP4KV_RETURN_IF_ERROR(internal::CheckGiven(t, name));
    FP4KV_RETURN_IF_ERROR(internal::CheckShape(t, name, {k_out.shape[0], g.num_kv_heads, dim}));
    if (t.shape[0] < q->length || t.shape[0] > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected dimension 0 in [", q->length, ", ", INT32_MAX,
                       "] (the sequence's length ..), got shape ", t.ShapeString()));
    }
  }
  FP4KV_RETURN_IF_ERROR(internal::CheckFloatDType(k_out.dtype, "k_out"));
  absl::StatusOr<Dequantizer> op =
      Dequantizer::Create({g, k_out.dtype, DType::kI32, s.options.device});
  if (!op.ok()) return op.status();
  // One request: [1, T, H, D] views of the outputs.
  auto batched = [](const TensorView& t) {
    TensorView b = TensorView::Strided(t.data, t.dtype, {1, t.shape[0], t.shape[1], t.shape[2]},
                                       {0, t.strides[0], t.strides[1], t.strides[2]}, t.device);
    return b;
  };
  const int64_t pages = static_cast<int64_t>(q->pages.size());
  const int32_t len = static_cast<int32_t>(q->length);
  DequantArgs a;
  a.k_out = batched(k_out);
  a.v_out = batched(v_out);
  a.k_scale = GlobalScale::Pointer(s.scales.d_scales() + 4 * layer + 0);
  a.v_scale = GlobalScale::Pointer(s.scales.d_scales() + 4 * layer + 1);
  const Device dev = s.options.device;
  int32_t* d_table = reinterpret_cast<int32_t*>(s.mem.d_step + s.mem.step_layout.readback);
  int32_t* d_len = d_table + s.options.max_pages_per_seq;
  const int64_t width = std::max<int64_t>(pages, 1);
  a.block_tables = TensorView::Contiguous(d_table, DType::kI32, {1, width}, dev);
  a.seq_lens = TensorView::Contiguous(d_len, DType::kI32, {1}, dev);
  if (len == 0) {
    // Nothing to write; still check every argument.
    int32_t zero_table = 0, zero_len = 0;
    a.block_tables = TensorView::Contiguous(&zero_table, DType::kI32, {1, 1}, dev);
    a.seq_lens = TensorView::Contiguous(&zero_len, DType::kI32, {1}, dev);
    absl::StatusOr<internal::DequantParams> p =
        internal::MakeDequantParams(op->options(), a, s.LayerCache(layer));
    return p.status();
  }
  if (!s.cuda) {
    std::memcpy(d_table, q->pages.data(), sizeof(int32_t) * pages);
    *d_len = len;
    return op->Run(a, s.LayerCache(layer), stream);
  }
  // Check everything before the upload, then upload and launch.
  absl::StatusOr<internal::DequantParams> p =
      internal::MakeDequantParams(op->options(), a, s.LayerCache(layer));
  if (!p.ok()) return p.status();
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(dev));
  FP4KV_RETURN_IF_ERROR(s.OrderAfterSwapIn(*q, stream));
  std::vector<int32_t> host(q->pages.begin(), q->pages.end());
  host.resize(s.options.max_pages_per_seq + 1, 0);
  host.back() = len;
  // From pageable memory: the copy has taken the bytes when it returns.
  FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_table, host.data(), sizeof(int32_t) * host.size(),
                                             cudaMemcpyHostToDevice,
                                             reinterpret_cast<cudaStream_t>(stream)));
  return internal::LaunchDequantize(*p, stream);
}

}  // namespace fp4kv
