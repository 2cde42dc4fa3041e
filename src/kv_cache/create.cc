// KVCache::Create as a composition: the options are checked and every size
// planned (pools, host tiers, capacity against what the devices have now)
// before anything is allocated; then each unit is created in turn. A failure
// at any phase returns with nothing left allocated (the partly built state
// frees what it holds).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "fp4kv/recipe.h"
#include "src/kv_cache/state.h"

namespace fp4kv {

using internal::CeilDiv;
using internal::KVCacheState;

namespace internal {
namespace {

constexpr char kCall[] = "KVCache::Create";
using Kind = Memory::Kind;

// What Create settles before allocating anything.
struct CreatePlan {
  CacheGeometry g;         // num_pages settled (from the budget, clamped)
  PoolLayout one_page;     // one page of every layer
  PoolLayout pool_layout;  // the pools
  int max_pages_per_seq = 0;
  int64_t host_pages = 0;  // the swap host tier
  PoolLayout host_layout;
  int64_t prefix_host_pages = 0;  // the host tier of the prefix cache
  PoolLayout prefix_host_layout;
  Capacity cap;
};

// The geometry, page count, per-step capacities, recipe and scales.
absl::Status CheckCacheOptions(const KVCacheOptions& o, CreatePlan* p) {
  if (o.num_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers: expected >= 1, got ", o.num_layers));
  }
  CacheGeometry& g = p->g;
  g = o.geometry;
  if (g.num_pages < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.num_pages: expected >= 0 (0: from memory_budget_bytes), got ", g.num_pages));
  }
  if (o.memory_budget_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory_budget_bytes: expected >= 0, got ", o.memory_budget_bytes));
  }
  if ((g.num_pages > 0) == (o.memory_budget_bytes > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.num_pages, memory_budget_bytes: expected exactly one of them positive, got ",
        g.num_pages, " and ", o.memory_budget_bytes));
  }
  {
    CacheGeometry probe = g;
    probe.num_pages = 1;
    FP4KV_RETURN_IF_ERROR(probe.Validate());
  }
  PoolLayout& one_page = p->one_page;
  {
    CacheGeometry t = g;
    t.num_pages = 1;
    if (!ComputePoolLayout(t, o.num_layers, &one_page)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "geometry: expected a page size in bytes (all layers) within int64, got page_size ",
          g.page_size, ", num_kv_heads ", g.num_kv_heads, ", head_dim_k ", g.head_dim_k,
          ", head_dim_v ", g.head_dim_v, " and ", o.num_layers, " layers"));
    }
  }
  if (g.num_pages == 0) {
    PoolLayout unused;
    const int64_t p = MostPagesWithin(g, o.num_layers, o.memory_budget_bytes, &unused);
    if (p < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("memory_budget_bytes: expected at least ", one_page.total_bytes,
                       " bytes (one page of every layer), got ", o.memory_budget_bytes));
    }
    g.num_pages = p;
  }
  if (g.num_pages > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("geometry.num_pages: expected at most ",
                                                   INT32_MAX, " (i32 block tables), got ",
                                                   g.num_pages));
  }
  if (!ComputePoolLayout(g, o.num_layers, &p->pool_layout)) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.num_pages: expected pools (", o.num_layers, " layers of ",
                     g.num_pages, " pages) whose size in bytes fits in int64, got ", g.num_pages));
  }
  int& max_pages_per_seq = p->max_pages_per_seq;
  max_pages_per_seq = o.max_pages_per_seq;
  if (max_pages_per_seq == 0) {
    max_pages_per_seq = static_cast<int>(
        std::min<int64_t>(g.num_pages, CeilDiv(kDefaultMaxSeqTokens, g.page_size)));
  }
  FP4KV_RETURN_IF_ERROR(ValidateRecipe(o.recipe));
  for (const auto& [v, name] :
       {std::pair<const std::vector<float>&, const char*>{o.k_global_scales, "k_global_scales"},
        std::pair<const std::vector<float>&, const char*>{o.v_global_scales, "v_global_scales"}}) {
    if (!v.empty() && static_cast<int64_t>(v.size()) != o.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": expected ", o.num_layers, " values (one per layer) or none, got ", v.size()));
    }
    for (size_t l = 0; l < v.size(); ++l) {
      FP4KV_RETURN_IF_ERROR(CheckScale(v[l], name, static_cast<int>(l)));
    }
  }
  if (o.step_slots < 1 || o.step_slots > 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("step_slots: expected 1 .. 8, got ", o.step_slots));
  }
  for (const auto& [v, name] :
       {std::pair<int, const char*>{o.max_seqs_per_step, "max_seqs_per_step"},
        std::pair<int, const char*>{o.max_tokens_per_step, "max_tokens_per_step"},
        std::pair<int, const char*>{max_pages_per_seq, "max_pages_per_seq"}}) {
    if (v < 1) return absl::InvalidArgumentError(absl::StrCat(name, ": expected >= 1, got ", v));
  }
  if (static_cast<int64_t>(max_pages_per_seq) * g.page_size > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_pages_per_seq: expected max_pages_per_seq * page_size <= ", INT32_MAX,
                     " (i32 lengths), got ", max_pages_per_seq, " * ", g.page_size));
  }
  if (static_cast<int64_t>(max_pages_per_seq) * o.max_seqs_per_step >= INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_seqs_per_step, max_pages_per_seq: expected a product below ", INT32_MAX,
                     " (i32 kv_page_indptr), got ", o.max_seqs_per_step, " * ", max_pages_per_seq));
  }
  if (!(o.calibration_headroom >= 1.0f) || !std::isfinite(o.calibration_headroom)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "calibration_headroom: expected a finite value >= 1, got ", o.calibration_headroom));
  }
  FP4KV_RETURN_IF_ERROR(CheckDeviceAvailable(o.device));

  return absl::OkStatus();
}

// The host tiers' sizes (swap, prefix demotion) and the prefix events.
absl::Status PlanHostTiers(const KVCacheOptions& o, CreatePlan* p) {
  const CacheGeometry& g = p->g;
  const PoolLayout& one_page = p->one_page;
  const HostTierOptions& ht = o.host_tier;
  if (ht.host_pages < 0 || ht.host_bytes < 0 || (ht.host_pages > 0 && ht.host_bytes > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_tier: expected host_pages >= 0 and host_bytes >= 0, at most one of them positive, "
        "got host_pages ",
        ht.host_pages, " and host_bytes ", ht.host_bytes));
  }
  int64_t& host_pages = p->host_pages;
  PoolLayout& host_layout = p->host_layout;
  host_pages = ht.host_pages;
  if (ht.host_bytes > 0) {
    host_pages = MostPagesWithin(g, o.num_layers, ht.host_bytes, &host_layout);
    if (host_pages < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("host_tier.host_bytes: expected at least ", one_page.total_bytes,
                       " bytes (one page of every layer), got ", ht.host_bytes));
    }
  }
  if (host_pages > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("host_tier.host_pages: expected at most ", INT32_MAX, ", got ", host_pages));
  }
  if (host_pages > 0) {
    CacheGeometry t = g;
    t.num_pages = host_pages;
    if (!ComputePoolLayout(t, o.num_layers, &host_layout)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "host_tier.host_pages: expected a host pool whose size in bytes fits in int64, got ",
          host_pages));
    }
  }
  if (o.prefix_cache.max_pending_events < 0 ||
      o.prefix_cache.max_pending_events > KVEventQueue::kMaxEvents) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_cache.max_pending_events: expected 0 .. ", KVEventQueue::kMaxEvents,
                     ", got ", o.prefix_cache.max_pending_events));
  }
  const int64_t hp_bytes = o.prefix_cache.host_bytes;
  int64_t& prefix_host_pages = p->prefix_host_pages;
  PoolLayout& prefix_host_layout = p->prefix_host_layout;
  if (hp_bytes < 0 || (hp_bytes > 0 && !o.prefix_cache.enabled)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix_cache.host_bytes: expected 0, or a positive size with prefix_cache.enabled, got ",
        hp_bytes, o.prefix_cache.enabled ? "" : " without prefix caching"));
  }
  if (hp_bytes > 0) {
    prefix_host_pages = MostPagesWithin(g, o.num_layers, hp_bytes, &prefix_host_layout);
    if (prefix_host_pages < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefix_cache.host_bytes: expected at least ", one_page.total_bytes,
                       " bytes (one page of every layer), got ", hp_bytes));
    }
  }
  return absl::OkStatus();
}

// Everything sized against what the devices have now (on the cache's
// device, current).
absl::Status PlanDeviceCapacity(const KVCacheOptions& o, CreatePlan* p) {
  // Capacity: everything below is sized against what the devices have now,
  // before anything is allocated (docs/kv_cache.md, "Allocation and budget
  // rules").
  Capacity& cap = p->cap;
  CacheGeometry& g = p->g;
  {
    CapacityInput in;
    in.geometry = g;
    in.num_layers = o.num_layers;
    in.device = o.device;
    in.prefix_cache = o.prefix_cache.enabled;
    in.events = o.prefix_cache.enabled && o.prefix_cache.max_pending_events > 0;
    in.max_seqs_per_step = o.max_seqs_per_step;
    in.max_tokens_per_step = o.max_tokens_per_step;
    in.max_pages_per_seq =
        o.max_pages_per_seq > 0 ? o.max_pages_per_seq : CeilDiv(kDefaultMaxSeqTokens, g.page_size);
    in.host_pages = p->host_pages;
    in.prefix_host_pages = p->prefix_host_pages;
    in.step_slots = o.step_slots;
    in.budget = o.memory_budget_bytes;
    absl::StatusOr<Capacity> c = PlanCapacity(in);
    if (!c.ok()) return c.status();
    cap = *c;
  }
  if (cap.num_pages != g.num_pages) {  // a budget clamped to what is available
    g.num_pages = cap.num_pages;
    if (!ComputePoolLayout(g, o.num_layers, &p->pool_layout)) {
      return absl::InternalError("KVCache::Create: the clamped pools do not fit in int64");
    }
    if (o.max_pages_per_seq == 0) {
      p->max_pages_per_seq = static_cast<int>(
          std::min<int64_t>(g.num_pages, CeilDiv(kDefaultMaxSeqTokens, g.page_size)));
    }
  }

  return absl::OkStatus();
}

// The fixed facts, the page allocator, the prefix index, the pools and the
// step buffers.
absl::Status InitMemory(const KVCacheOptions& o, const CreatePlan& p, KVCacheState* s) {
  const CacheGeometry& g = p.g;
  FP4KV_RETURN_IF_ERROR(
      s->allocator.Init(static_cast<int32_t>(g.num_pages), o.prefix_cache.enabled));
  s->prefix.enabled = o.prefix_cache.enabled;
  FP4KV_RETURN_IF_ERROR(s->prefix.events.Reserve(g.num_pages, kCall));
  if (s->prefix.enabled) {
    FP4KV_RETURN_IF_ERROR(SizeHost(&s->prefix.page_tokens, g.num_pages * g.page_size, int32_t{0},
                                   kCall, "the token ids of every page slot (prefix caching)"));
    FP4KV_RETURN_IF_ERROR(SizeHost(&s->prefix.page_known, g.num_pages * g.page_size, uint8_t{0},
                                   kCall, "the known-id flags of every page slot"));
  }
  s->mem.available_at_create = p.cap.available;
  s->mem.budget_clamped = p.cap.clamped;
  s->options = o;
  s->options.geometry = g;
  s->options.memory_budget_bytes = o.memory_budget_bytes;
  s->options.max_pages_per_seq = p.max_pages_per_seq;
  s->geometry = g;
  s->cuda = o.device.is_cuda();
  s->mem.pool = p.pool_layout;
  const int S = o.max_seqs_per_step;
  const int T = o.max_tokens_per_step;
  const int M = p.max_pages_per_seq;
  s->mem.step_layout = ComputeStepLayout(S, T, M, o.num_layers);
  const StepLayout& sl = s->mem.step_layout;

  FP4KV_RETURN_IF_ERROR(s->mem.pools.Allocate(s->cuda ? Kind::kDevice : Kind::kHost,
                                              s->mem.pool.total_bytes, "the pools"));
  FP4KV_RETURN_IF_ERROR(s->mem.device_step.Allocate(s->cuda ? Kind::kDevice : Kind::kHost,
                                                    sl.device_bytes, "the step buffers"));
  return absl::OkStatus();
}

// The swap host tier (pinned, mapped) and the copy engine.
absl::Status InitHostTier(const KVCacheOptions& o, const CreatePlan& p, KVCacheState* s) {
  if (p.host_pages > 0) {
    FP4KV_RETURN_IF_ERROR(
        s->host.pages.Init(p.host_layout, p.host_pages, s->cuda, "the host tier"));
    if (s->cuda) FP4KV_RETURN_IF_ERROR(s->copy.Init(o.device.ordinal));
  }
  return absl::OkStatus();
}

// The host tier of the prefix cache, sharing the copy engine.
absl::Status InitPrefixHostTier(const KVCacheOptions& o, const CreatePlan& p, KVCacheState* s) {
  const CacheGeometry& g = p.g;
  if (p.prefix_host_pages > 0) {
    PrefixHostState& t = s->prefix_host;
    FP4KV_RETURN_IF_ERROR(t.pages.Init(p.prefix_host_layout, p.prefix_host_pages, s->cuda,
                                       "the host tier of the prefix cache"));
    if (s->cuda) FP4KV_RETURN_IF_ERROR(s->copy.Init(o.device.ordinal));
    const char* what = "the host tier of the prefix cache's bookkeeping";
    FP4KV_RETURN_IF_ERROR(t.lru.Init(p.prefix_host_pages, kCall, what));
    FP4KV_RETURN_IF_ERROR(SizeHost(&t.cached, p.prefix_host_pages, uint8_t{0}, kCall, what));
    FP4KV_RETURN_IF_ERROR(SizeHost(&t.hash, p.prefix_host_pages, BlockHash{}, kCall, what));
    FP4KV_RETURN_IF_ERROR(SizeHost(&t.batch, p.prefix_host_pages, uint64_t{0}, kCall, what));
    FP4KV_RETURN_IF_ERROR(SizeHost(&t.batch_pos, p.prefix_host_pages, int32_t{0}, kCall, what));
    FP4KV_RETURN_IF_ERROR(
        SizeHost(&t.tokens, p.prefix_host_pages * g.page_size, int32_t{0}, kCall, what));
    if (s->cuda) {  // promotions in flight: per device page
      FP4KV_RETURN_IF_ERROR(SizeHost(&t.promoted_by, g.num_pages, uint64_t{0}, kCall, what));
    }
    try {
      // Twice the most entries it holds, as the pool's index: erasures leave
      // tombstones, and the headroom keeps inserts from growing the table.
      t.index.reserve(static_cast<size_t>(2 * p.prefix_host_pages));
    } catch (const std::bad_alloc&) {
      return HostAllocError(kCall, "the host tier of the prefix cache's index", p.prefix_host_pages,
                            sizeof(BlockHash) + sizeof(int32_t));
    }
  }
  return absl::OkStatus();
}

// The step slots: their device buffers, pinned staging, events and views.
absl::Status InitStepSlots(const KVCacheOptions& o, const CreatePlan& p, KVCacheState* s) {
  const CacheGeometry& g = p.g;
  const int S = o.max_seqs_per_step;
  const int T = o.max_tokens_per_step;
  const int M = p.max_pages_per_seq;
  const StepLayout& sl = s->mem.step_layout;
  const int N = o.step_slots;
  FP4KV_RETURN_IF_ERROR(s->retire.Init(N > 1, g.num_pages));
  s->step.slots.resize(N);
  s->mem.slot_device.resize(N);
  s->mem.slot_staging.resize(N);
  for (int k = 0; k < N; ++k) {
    StepSlot& slot = s->step.slots[k];
    if (k == 0) {
      slot.d_base = s->mem.device_step.get();
    } else {
      FP4KV_RETURN_IF_ERROR(s->mem.slot_device[k].Allocate(
          s->cuda ? Kind::kDevice : Kind::kHost, sl.scales, "the step buffers of a step slot"));
      slot.d_base = s->mem.slot_device[k].get();
    }
    slot.h_base = slot.d_base;
    if (s->cuda) {
      Memory& m = k == 0 ? s->mem.staging : s->mem.slot_staging[k];
      FP4KV_RETURN_IF_ERROR(m.Allocate(Kind::kPinned, sl.staging_bytes, "the pinned step staging"));
      slot.h_base = m.get();
      FP4KV_CUDA_RETURN_IF_ERROR(
          cudaEventCreateWithFlags(&slot.upload_done, cudaEventDisableTiming));
      if (N > 1) {
        FP4KV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
      }
    }
    uint8_t* h = slot.h_base;
    slot.h_seq_lens = reinterpret_cast<int32_t*>(h + sl.seq_lens);
    slot.h_kv_indptr = reinterpret_cast<int32_t*>(h + sl.kv_indptr);
    slot.h_token_indptr = reinterpret_cast<int32_t*>(h + sl.token_indptr);
    slot.h_slots = reinterpret_cast<int64_t*>(h + sl.slots);
    slot.h_tables = reinterpret_cast<int32_t*>(h + sl.tables);
    // Zeroed memory is already a valid empty step but for the padding slots.
    std::fill(slot.h_slots, slot.h_slots + T, int64_t{-1});
    if (s->cuda) {
      FP4KV_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(slot.d_base, slot.h_base, sl.staging_bytes, cudaMemcpyHostToDevice));
    }
    FP4KV_RETURN_IF_ERROR(
        SizeHost(&slot.rows, S, KVCacheState::Row{}, kCall, "the step's row table"));
    const Device dev = o.device;
    uint8_t* d = slot.d_base;
    StepViews& v = slot.views;
    v.slot_mapping = TensorView::Contiguous(d + sl.slots, DType::kI64, {T}, dev);
    v.block_tables = TensorView::Contiguous(d + sl.tables, DType::kI32, {S, M}, dev);
    v.seq_lens = TensorView::Contiguous(d + sl.seq_lens, DType::kI32, {S}, dev);
    v.kv_page_indptr = TensorView::Contiguous(d + sl.kv_indptr, DType::kI32, {S + 1}, dev);
    v.token_indptr = TensorView::Contiguous(d + sl.token_indptr, DType::kI32, {S + 1}, dev);
    v.fp8_block_tables = TensorView::Contiguous(d + sl.fp8_tables, DType::kI32, {S, M}, dev);
    slot.info.slot = k;
  }
  if (s->cuda && s->prefix.enabled) {
    s->prefix.ids_capacity = 2 * int64_t{T} * (N + 1);
    FP4KV_RETURN_IF_ERROR(s->prefix.ids_pinned.Allocate(Kind::kPinned, 4 * s->prefix.ids_capacity,
                                                        "the pinned ring of late token ids"));
  }
  return absl::OkStatus();
}

// The global scales, flags and their host mirrors.
absl::Status InitScales(const KVCacheOptions& o, const CreatePlan& p, KVCacheState* s) {
  s->mem.d_step = s->mem.device_step.get();
  return s->scales.Init(o, p.g, s->mem.d_step, s->mem.step_layout, s->cuda);
}

// Images' reservation book and the step builder's scratch.
absl::Status InitStepScratch(const KVCacheOptions& o, const CreatePlan& p, KVCacheState* s) {
  const CacheGeometry& g = p.g;
  const int S = o.max_seqs_per_step;
  s->images.Init(s);

  FP4KV_RETURN_IF_ERROR(SizeHost(&s->step.claim, g.num_pages, int32_t{0}, kCall,
                                 "the copy-on-write claims (one per page)"));
  FP4KV_RETURN_IF_ERROR(SizeHost(&s->step.step_seqs, S,
                                 static_cast<KVCacheState::Sequence*>(nullptr), kCall,
                                 "the step's sequences"));
  FP4KV_RETURN_IF_ERROR(ReserveHost(&s->step.cow_src, S, kCall, "the step's copies"));
  FP4KV_RETURN_IF_ERROR(ReserveHost(&s->step.cow_entry, S, kCall, "the step's copies"));
  FP4KV_RETURN_IF_ERROR(ReserveHost(&s->step.cow_dst, S, kCall, "the step's copies"));
  return absl::OkStatus();
}

}  // namespace

// Every kernel the cache launches itself (its appender, attention and other
// bound ops load theirs when bound), on the current device: under CUDA's
// lazy module loading a first launch that loads its kernel can wait on the
// host for the device's other streams (a held copy, a long step).
absl::Status LoadCacheKernels(const Recipe& recipe) {
  FP4KV_RETURN_IF_ERROR(LoadScaleKernels());
  FP4KV_RETURN_IF_ERROR(LoadPageCopyKernels());
  // ImportHalfPages quantizes f16 or bf16 pages.
  FP4KV_RETURN_IF_ERROR(LoadQuantizeCacheKernels(DType::kF16, recipe));
  return LoadQuantizeCacheKernels(DType::kBF16, recipe);
}

}  // namespace internal

absl::StatusOr<KVCache> KVCache::Create(const KVCacheOptions& o) {
  internal::CreatePlan plan;
  FP4KV_RETURN_IF_ERROR(internal::CheckCacheOptions(o, &plan));
  FP4KV_RETURN_IF_ERROR(internal::PlanHostTiers(o, &plan));
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(o.device));
  FP4KV_RETURN_IF_ERROR(internal::PlanDeviceCapacity(o, &plan));

  const size_t max_events =
      o.prefix_cache.enabled ? static_cast<size_t>(o.prefix_cache.max_pending_events) : 0;
  std::unique_ptr<KVCacheState> s(new (std::nothrow) KVCacheState(max_events));
  if (s == nullptr) {
    return internal::HostAllocError("KVCache::Create", "the cache state", 1, sizeof(KVCacheState));
  }
  FP4KV_RETURN_IF_ERROR(internal::InitMemory(o, plan, s.get()));
  FP4KV_RETURN_IF_ERROR(internal::InitHostTier(o, plan, s.get()));
  FP4KV_RETURN_IF_ERROR(internal::InitPrefixHostTier(o, plan, s.get()));
  FP4KV_RETURN_IF_ERROR(internal::InitStepSlots(o, plan, s.get()));
  FP4KV_RETURN_IF_ERROR(internal::InitScales(o, plan, s.get()));
  FP4KV_RETURN_IF_ERROR(internal::InitStepScratch(o, plan, s.get()));
  if (s->cuda) FP4KV_RETURN_IF_ERROR(internal::LoadCacheKernels(o.recipe));
  return KVCache(std::move(s));
}

}  // namespace fp4kv
