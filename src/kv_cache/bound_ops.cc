// KVCache bound ops: the op objects of a cache and their per-layer Run().
// A bound op owns the op object it was bound with. The cache's pools are
// checked against it once, at bind time; Run() checks only what depends on
// the call (layer, the caller's views) and on the step, picks the layer's
// pools and the step's tables, and hands them to the op.
#include <algorithm>
#include <vector>

#include "kernels/attention/tma_maps.h"
#include "src/attention_params.h"
#include "src/kv_cache/state.h"
#include "src/validate.h"

namespace fp4kv {
namespace internal {
// What a bound attention settles at bind time, per layer: the TMA tensor
// maps of the layer's pools (the cache's pools never move), so that Run()
// hands them to the launcher instead of encoding them. Empty where the op's
// kernel family copies with cp.async (or on the CPU).
struct CacheAttentionPlan {
  std::vector<kernels::AttnTmaMaps> tma;  // [L] or empty
};
}  // namespace internal

using internal::CeilDiv;
using internal::KVCacheState;

namespace {
// A default-constructed op, or one whose cache was destroyed.
absl::Status NotBound(const char* what, bool bound) {
  if (bound) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": expected an op of a live KVCache, got one whose cache was destroyed"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": expected an op from a KVCache accessor, got a default-constructed one"));
}

// Layer `layer`'s pools as CheckCache fills them from s.LayerCache(layer):
// the same pointers and byte strides, computed without looking at views.
internal::CachePools LayerPools(const KVCacheState& s, int layer) {
  const CacheGeometry& g = s.geometry;
  const internal::PoolLayout& pool = s.mem.pool;
  uint8_t* base = s.mem.pools.get() + layer * pool.layer_bytes;
  const bool nhd = g.layout == Layout::kNHD;
  auto side = [&](bool is_v) {
    internal::PoolPtrs p;
    const internal::Region& data = pool.regions[is_v ? 1 : 0];
    const int64_t data_row = g.DataRowBytes(is_v);
    p.data = base + data.offset;
    p.data_page = data.page_bytes;
    p.data_entry = nhd ? g.num_kv_heads * data_row : data_row;
    p.data_head = nhd ? data_row : g.page_size * data_row;
    if (const int64_t scale_row = g.ScaleRowBytes(is_v); scale_row > 0) {
      const internal::Region& scales = pool.regions[is_v ? 3 : 2];
      p.scales = base + scales.offset;
      p.scale_page = scales.page_bytes;
      p.scale_entry = nhd ? g.num_kv_heads * scale_row : scale_row;
      p.scale_head = nhd ? scale_row : g.page_size * scale_row;
    }
    p.head_dim = is_v ? g.head_dim_v : g.head_dim_k;
    return p;
  };
  return {side(false), side(true)};
}

// The step slot a bound op runs on (-1: the latest step's).
const internal::StepSlot& SlotOf(const KVCacheState& s, int slot) {
  return slot < 0 ? s.step.cur() : s.step.slots[slot];
}

// Whether `slot` is a step slot of the op's live cache.
absl::Status CheckSlot(const std::weak_ptr<const KVCacheState>& state, bool bound, int slot,
                       const char* what) {
  const std::shared_ptr<const KVCacheState> live = state.lock();
  if (live == nullptr) return NotBound(what, bound);
  const int n = static_cast<int>(live->step.slots.size());
  if (slot < 0 || slot >= n) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, "::ForSlot: slot: expected in [0, ", n, ") (step_slots), got ", slot));
  }
  return absl::OkStatus();
}

// The step slot's tables for `batch` requests as attention args (q_indptr
// when max_q_len > 1).
DecodeAttentionArgs StepTablesArgs(const internal::StepSlot& st, int64_t batch, int max_q_len) {
  DecodeAttentionArgs a;
  a.block_tables = st.views.block_tables;
  a.block_tables.shape[0] = batch;
  a.seq_lens = st.views.seq_lens;
  a.seq_lens.shape[0] = batch;
  if (max_q_len > 1) {
    a.q_indptr = st.views.token_indptr;
    a.q_indptr.shape[0] = batch + 1;
  }
  return a;
}

bool SamePools(const internal::PoolPtrs& a, const internal::PoolPtrs& b) {
  return a.data == b.data && a.scales == b.scales && a.data_page == b.data_page &&
         a.data_entry == b.data_entry && a.data_head == b.data_head &&
         a.scale_page == b.scale_page && a.scale_entry == b.scale_entry &&
         a.scale_head == b.scale_head && a.head_dim == b.head_dim;
}

// The bind-time check of a cache's own views against an op's geometry and
// device: every layer's pools pass CheckCache (what the op's Run() would
// check on every call), and LayerPools gives what CheckCache fills. Run()
// then uses LayerPools unchecked: the pools never change after Create.
absl::Status CheckLayerPools(const KVCacheState& s, const CacheGeometry& g, const Device& device) {
  for (int layer = 0; layer < s.options.num_layers; ++layer) {
    internal::CachePools checked;
    FP4KV_RETURN_IF_ERROR(
        internal::CheckCache(s.LayerCache(layer), g, device, &checked.k, &checked.v));
    const internal::CachePools computed = LayerPools(s, layer);
    if (!SamePools(checked.k, computed.k) || !SamePools(checked.v, computed.v)) {
      return absl::InternalError(
          absl::StrCat("KVCache: the pool pointers of layer ", layer, " disagree with its views"));
    }
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<CacheAppender> KVCache::appender(DType input_dtype) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  absl::StatusOr<Appender> op =
      Appender::Create({s.geometry, input_dtype, AppendIndexing::kSlot, s.options.recipe,
                        s.options.device, s.options.count_scale_events});
  if (!op.ok()) return op.status();
  FP4KV_RETURN_IF_ERROR(CheckLayerPools(s, op->options().geometry, op->options().device));
  return CacheAppender(state_, *std::move(op));
}

absl::StatusOr<CacheMaterializer> KVCache::materializer() const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  const CacheGeometry& g = s.geometry;
  if (g.head_dim_k != g.head_dim_v || g.head_dim_k % 64 != 0 || g.page_size % 4 != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "materializer: FP8 materialization needs head_dim_k == head_dim_v, a multiple of 64, and "
        "page_size % 4 == 0; this cache has head_dim_k ",
        g.head_dim_k, ", head_dim_v ", g.head_dim_v, ", page_size ", g.page_size));
  }
  absl::StatusOr<Materializer> op = Materializer::Create({g, DType::kI32, false, s.options.device});
  if (!op.ok()) return op.status();
  FP4KV_RETURN_IF_ERROR(CheckLayerPools(s, op->options().geometry, op->options().device));
  return CacheMaterializer(state_, *std::move(op));
}

absl::StatusOr<CacheDequantizer> KVCache::dequantizer(DType output_dtype) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  absl::StatusOr<Dequantizer> op =
      Dequantizer::Create({s.geometry, output_dtype, DType::kI32, s.options.device});
  if (!op.ok()) return op.status();
  FP4KV_RETURN_IF_ERROR(CheckLayerPools(s, op->options().geometry, op->options().device));
  return CacheDequantizer(state_, *std::move(op));
}

absl::StatusOr<CacheAttention> KVCache::attention(const CacheAttentionOptions& co) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  DecodeAttention::Options o;
  o.geometry = s.geometry;
  o.num_qo_heads = co.num_qo_heads;
  o.dtype = co.dtype;
  o.table_dtype = DType::kI32;
  o.max_batch = s.options.max_seqs_per_step;
  o.max_pages_per_seq = s.options.max_pages_per_seq;
  o.max_q_len = co.max_q_len;
  o.sm_scale = co.sm_scale;
  o.logits_soft_cap = co.logits_soft_cap;
  o.window_left = co.window_left;
  o.has_sinks = co.has_sinks;
  o.write_lse = co.write_lse;
  o.device = s.options.device;
  absl::StatusOr<DecodeAttention> op = DecodeAttention::Create(o);
  if (!op.ok()) return op.status();
  FP4KV_RETURN_IF_ERROR(CheckLayerPools(s, op->options().geometry, op->options().device));
  // The step tables of every slot, at their widest (max_seqs_per_step
  // requests), checked once: Run() hands them to the op unchecked.
  for (const internal::StepSlot& slot : s.step.slots) {
    internal::AttentionTables unused;
    const absl::Status st =
        internal::CheckAttentionTables(op->options(), StepTablesArgs(slot, o.max_batch, o.max_q_len),
                                       &unused);
    if (!st.ok()) {
      return absl::InternalError(
          absl::StrCat("KVCache::attention: the step tables disagree with the op: ", st.message()));
    }
  }
  // The tensor maps of every layer's pools, encoded once (the launcher
  // checks that the kernel it picks per Run copies with TMA before using them).
  auto plan = std::make_shared<internal::CacheAttentionPlan>();
  kernels::AttnTmaMaps maps;
  if (internal::DecodeAttentionRunner::EncodeTmaMaps(*op, LayerPools(s, 0), &maps)) {
    plan->tma.resize(s.options.num_layers);
    plan->tma[0] = maps;
    for (int l = 1; l < s.options.num_layers; ++l) {
      internal::DecodeAttentionRunner::EncodeTmaMaps(*op, LayerPools(s, l), &plan->tma[l]);
    }
  }
  return CacheAttention(state_, *std::move(op), std::move(plan));
}

int64_t KVCache::Fp8WorkspacePagesAtCapacity() const {
  if (state_ == nullptr) return 0;
  return 1 + static_cast<int64_t>(state_->options.max_seqs_per_step) *
                 state_->options.max_pages_per_seq;
}

std::vector<int64_t> KVCache::Fp8WorkspaceShape(int64_t pages) const {
  if (state_ == nullptr) return {};
  const CacheGeometry& g = state_->geometry;
  return {pages, 2, g.num_kv_heads, g.page_size, g.head_dim_k};
}

absl::Status CacheAppender::Run(int layer, const TensorView& key, const TensorView& value,
                                Stream stream) const {
  const std::shared_ptr<KVCacheState> live = state_.lock();
  if (live == nullptr) return NotBound("CacheAppender", bound_);
  KVCacheState& s = *live;
  const internal::StepSlot& st = SlotOf(s, slot_);
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  int64_t rows = s.options.max_tokens_per_step;
  if (key.ndim >= 1) {
    if (key.shape[0] < st.info.num_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("append_key: expected at least ", st.info.num_tokens,
                       " rows (the step's new tokens), got shape ", key.ShapeString()));
    }
    rows = std::min<int64_t>(rows, key.shape[0]);
  }
  AppendArgs a;
  a.key = key;
  a.value = value;
  a.slot_mapping = st.views.slot_mapping;
  a.slot_mapping.shape[0] = rows;
  a.k_scale = GlobalScale::Pointer(s.scales.d_scales() + 4 * layer + 0);
  a.v_scale = GlobalScale::Pointer(s.scales.d_scales() + 4 * layer + 1);
  if (s.options.count_scale_events) a.scale_events = s.scales.d_events() + 4 * layer;
  absl::StatusOr<internal::AppendParams> p =
      internal::MakeAppendParams(op_.options(), a, LayerPools(s, layer));
  if (!p.ok()) return p.status();
  internal::ScopedDevice scoped;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (s.cuda) {
    FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &capture));
  }
  s.RecordAppend(layer, st.serial, capture != cudaStreamCaptureStatusNone,
                 st.info.num_tokens > 0);
  if (p->nnz == 0) return absl::OkStatus();
  if (s.LayerPending(layer)) {
    internal::RowCalibrationParams c;
    c.key = p->key;
    c.value = p->value;
    c.key_row_stride = p->key_row_stride;
    c.key_head_stride = p->key_head_stride;
    c.value_row_stride = p->value_row_stride;
    c.value_head_stride = p->value_head_stride;
    c.dtype = p->input_dtype;
    c.rows = p->nnz;
    c.num_heads = p->num_heads;
    c.head_dim_k = p->k.head_dim;
    c.head_dim_v = p->v.head_dim;
    c.slot_mapping = p->slot_mapping;
    c.scales = s.scales.d_scales() + 4 * layer;
    c.flags = s.scales.d_flags() + 2 * layer;
    c.host_flags = s.cuda ? s.scales.h_flags_dev() + 2 * layer : nullptr;
    c.scratch = s.scales.d_calib() + 4 * layer;
    c.headroom = s.options.calibration_headroom;
    c.recipe = s.options.recipe;
    c.fp8_keys = s.geometry.fp8_keys();
    if (!s.cuda) {
      internal::ReferenceCalibrateRows(c);  // h_flags is d_flags here
    } else {
      FP4KV_RETURN_IF_ERROR(internal::LaunchCalibrateRows(c, stream));
    }
  }
  return internal::RunAppend(op_, *p, stream);
}

absl::Status CacheMaterializer::Run(int layer, const TensorView& out, Stream stream) const {
  const std::shared_ptr<const KVCacheState> live = state_.lock();
  if (live == nullptr) return NotBound("CacheMaterializer", bound_);
  const KVCacheState& s = *live;
  const internal::StepSlot& st = SlotOf(s, slot_);
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  if (out.ndim >= 1 && out.shape[0] < st.info.fp8_workspace_pages) {
    return absl::InvalidArgumentError(
        absl::StrCat("out: expected at least ", st.info.fp8_workspace_pages,
                     " pages (the step's fp8_workspace_pages), got shape ", out.ShapeString()));
  }
  MaterializeArgs a;
  a.block_tables = st.views.block_tables;
  a.seq_lens = st.views.seq_lens;
  a.kv_page_indptr = st.views.kv_page_indptr;
  a.out = out;
  a.fp8_block_tables = st.views.fp8_block_tables;
  a.k_scale = GlobalScale::Pointer(s.scales.d_scales() + 4 * layer + 0);
  a.v_scale = GlobalScale::Pointer(s.scales.d_scales() + 4 * layer + 1);
  a.k_fp8_scale = GlobalScale::Pointer(s.scales.d_scales() + 4 * layer + 2);
  a.v_fp8_scale = GlobalScale::Pointer(s.scales.d_scales() + 4 * layer + 3);
  absl::StatusOr<internal::MaterializeParams> p =
      internal::MakeMaterializeParams(op_.options(), a, LayerPools(s, layer));
  if (!p.ok()) return p.status();
  return internal::RunMaterialize(op_, *p, stream);
}

absl::Status CacheDequantizer::Run(int layer, const TensorView& k_out, const TensorView& v_out,
                                   Stream stream) const {
  const std::shared_ptr<const KVCacheState> live = state_.lock();
  if (live == nullptr) return NotBound("CacheDequantizer", bound_);
  const KVCacheState& s = *live;
  const internal::StepSlot& st = SlotOf(s, slot_);
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  const int S = s.options.max_seqs_per_step;
  int64_t batch = S;
  if (k_out.ndim >= 2) {
    batch = k_out.shape[0];
    if (batch < st.info.num_seqs || batch > S) {
      return absl::InvalidArgumentError(absl::StrCat(
          "k_out: expected dimension 0 in [", st.info.num_seqs, ", ", S,
          "] (the step's sequences .. max_seqs_per_step), got shape ", k_out.ShapeString()));
    }
    if (k_out.shape[1] < st.info.max_seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("k_out: expected dimension 1 >= ", st.info.max_seq_len,
                       " (the step's longest sequence), got shape ", k_out.ShapeString()));
    }
  }
  DequantArgs a;
  a.block_tables = st.views.block_tables;
  a.block_tables.shape[0] = batch;
  a.seq_lens = st.views.seq_lens;
  a.seq_lens.shape[0] = batch;
  a.k_out = k_out;
  a.v_out = v_out;
  a.k_scale = GlobalScale::Pointer(s.scales.d_scales() + 4 * layer + 0);
  a.v_scale = GlobalScale::Pointer(s.scales.d_scales() + 4 * layer + 1);
  absl::StatusOr<internal::DequantParams> p =
      internal::MakeDequantParams(op_.options(), a, LayerPools(s, layer));
  if (!p.ok()) return p.status();
  return internal::RunDequantize(op_, *p, stream);
}

absl::Status CacheAttention::Run(int layer, const TensorView& q, const TensorView& out,
                                 void* workspace, int64_t workspace_bytes, Stream stream,
                                 const TensorView& lse, const TensorView& sinks) const {
  const std::shared_ptr<const KVCacheState> live = state_.lock();
  if (live == nullptr) return NotBound("CacheAttention", bound_);
  const KVCacheState& s = *live;
  const internal::StepSlot& st = SlotOf(s, slot_);
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  const int S = s.options.max_seqs_per_step;
  const int max_q_len = op_.options().max_q_len;
  int64_t batch = S;
  DecodeAttentionArgs a;
  a.q = q;
  a.out = out;
  a.lse = lse;
  a.sinks = sinks;
  if (max_q_len == 1) {
    if (q.ndim >= 1) {
      batch = q.shape[0];
      if (batch < st.info.num_seqs || batch > S) {
        return absl::InvalidArgumentError(absl::StrCat(
            "q: expected dimension 0 in [", st.info.num_seqs, ", ", S,
            "] (one row per step entry, up to max_seqs_per_step), got shape ", q.ShapeString()));
      }
    }
  } else {
    if (q.ndim >= 1 && q.shape[0] < st.info.num_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("q: expected at least ", st.info.num_tokens,
                       " rows (the step's new tokens), got shape ", q.ShapeString()));
    }
    for (int i = 0; i < st.info.num_seqs; ++i) {
      const int32_t n = st.h_token_indptr[i + 1] - st.h_token_indptr[i];
      if (n > max_q_len) {
        return absl::InvalidArgumentError(absl::StrCat(
            "step: expected at most max_q_len = ", max_q_len, " new tokens per entry, got ", n,
            " for entry ", i, " (prefill chunks need a prefill attention)"));
      }
    }
  }
  // The step's tables were checked at bind time (KVCache::attention); the
  // first `batch` rows of them are this call's.
  internal::AttentionTables t;
  t.block_tables = st.views.block_tables.data;
  t.table_row_stride = st.views.block_tables.strides[0];
  t.max_pages = static_cast<int>(st.views.block_tables.shape[1]);
  t.seq_lens = st.views.seq_lens.ptr<const int32_t>();
  t.q_indptr = max_q_len > 1 ? st.views.token_indptr.ptr<const int32_t>() : nullptr;
  t.batch = static_cast<int>(batch);
  a.k_scale = GlobalScale::Pointer(s.scales.d_scales() + 4 * layer + 0);
  a.v_scale = GlobalScale::Pointer(s.scales.d_scales() + 4 * layer + 1);
  const kernels::AttnTmaMaps* maps =
      plan_ != nullptr && !plan_->tma.empty() ? &plan_->tma[layer] : nullptr;
  return internal::DecodeAttentionRunner::Run(op_, a, LayerPools(s, layer), t, workspace,
                                              workspace_bytes, stream, maps);
}


absl::StatusOr<CacheAppender> CacheAppender::ForSlot(int slot) const {
  FP4KV_RETURN_IF_ERROR(CheckSlot(state_, bound_, slot, "CacheAppender"));
  CacheAppender c = *this;
  c.slot_ = slot;
  return c;
}

absl::StatusOr<CacheMaterializer> CacheMaterializer::ForSlot(int slot) const {
  FP4KV_RETURN_IF_ERROR(CheckSlot(state_, bound_, slot, "CacheMaterializer"));
  CacheMaterializer c = *this;
  c.slot_ = slot;
  return c;
}

absl::StatusOr<CacheDequantizer> CacheDequantizer::ForSlot(int slot) const {
  FP4KV_RETURN_IF_ERROR(CheckSlot(state_, bound_, slot, "CacheDequantizer"));
  CacheDequantizer c = *this;
  c.slot_ = slot;
  return c;
}

absl::StatusOr<CacheAttention> CacheAttention::ForSlot(int slot) const {
  FP4KV_RETURN_IF_ERROR(CheckSlot(state_, bound_, slot, "CacheAttention"));
  CacheAttention c = *this;
  c.slot_ = slot;
  return c;
}

}  // namespace fp4kv
