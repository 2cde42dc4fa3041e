// DecodeAttention: Create() validates the options once and reads the SM
// count; Run() checks the per-call views cheaply, fills AttentionParams and
// dispatches to the CPU reference or the CUDA launcher.
#include "fp4kv/attention.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "src/attention_params.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"
#include "src/validate.h"

namespace fp4kv {

using internal::CheckAligned;
using internal::CheckDevice;
using internal::CheckDType;
using internal::CheckGiven;
using internal::CheckGlobalScale;
using internal::CheckInnerContiguous;
using internal::CheckShape;
using internal::kAny;

namespace {

// Workspace alignment Run() requires on CUDA.
constexpr uintptr_t kWorkspaceAlignment = 256;

absl::Status CheckAttentionHeadDim(int d, const char* name) {
  if (d != 64 && d != 128 && d != 256) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected 64, 128 or 256 for decode attention, got ", d));
  }
  return absl::OkStatus();
}

// A finite value >= 0.
absl::Status CheckNonNegative(float x, const char* name, const char* zero_means) {
  if (!std::isfinite(x) || !(x >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected a finite value >= 0 (0: ", zero_means, "), got ", x));
  }
  return absl::OkStatus();
}

absl::Status CheckAtLeast(int64_t x, int64_t lo, const char* name) {
  if (x < lo) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected >= ", lo, ", got ", x));
  }
  return absl::OkStatus();
}

// A tensor of `dtype` and `shape` with a contiguous last dimension on `device`.
absl::Status CheckTensor(const TensorView& t, const char* name, DType dtype,
                         std::initializer_list<int64_t> shape, const Device& device) {
  FP4KV_RETURN_IF_ERROR(CheckGiven(t, name));
  FP4KV_RETURN_IF_ERROR(CheckDType(t, name, {dtype}));
  FP4KV_RETURN_IF_ERROR(CheckShape(t, name, shape));
  FP4KV_RETURN_IF_ERROR(CheckInnerContiguous(t, name));
  return CheckDevice(t, name, device);
}

// A view given where the options say there is none.
absl::Status CheckAbsent(const TensorView& t, const char* name, const char* why) {
  if (t.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": expected no tensor (", why, "), got one of shape ", t.ShapeString()));
}

}  // namespace

absl::StatusOr<DecodeAttention> DecodeAttention::Create(const Options& o) {
  const CacheGeometry& g = o.geometry;
  FP4KV_RETURN_IF_ERROR(g.Validate());
  FP4KV_RETURN_IF_ERROR(CheckAttentionHeadDim(g.head_dim_k, "geometry.head_dim_k"));
  FP4KV_RETURN_IF_ERROR(CheckAttentionHeadDim(g.head_dim_v, "geometry.head_dim_v"));
  if (o.num_qo_heads <= 0 || o.num_qo_heads % g.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.num_qo_heads: expected a positive multiple of geometry.num_kv_heads (",
        g.num_kv_heads, "), got ", o.num_qo_heads));
  }
  FP4KV_RETURN_IF_ERROR(internal::CheckFloatDType(o.dtype, "options.dtype"));
  if (o.table_dtype != DType::kI32 && o.table_dtype != DType::kI64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.table_dtype: expected dtype i32 or i64, got ", DTypeName(o.table_dtype)));
  }
  FP4KV_RETURN_IF_ERROR(CheckAtLeast(o.max_batch, 1, "options.max_batch"));
  FP4KV_RETURN_IF_ERROR(CheckAtLeast(o.max_pages_per_seq, 1, "options.max_pages_per_seq"));
  if (o.max_q_len < 1 || o.max_q_len > kMaxAttentionQLen) {
    return absl::InvalidArgumentError(absl::StrCat("options.max_q_len: expected 1 .. ",
                                                   kMaxAttentionQLen, ", got ", o.max_q_len));
  }
  FP4KV_RETURN_IF_ERROR(CheckNonNegative(o.sm_scale, "options.sm_scale", "1 / sqrt(head_dim_k)"));
  FP4KV_RETURN_IF_ERROR(CheckNonNegative(o.logits_soft_cap, "options.logits_soft_cap", "off"));
  FP4KV_RETURN_IF_ERROR(CheckAtLeast(o.window_left, -1, "options.window_left"));
  FP4KV_RETURN_IF_ERROR(internal::CheckDeviceAvailable(o.device));
  int num_sms = 0;
  int64_t workspace_bytes = 0;
  internal::AttentionKernelSetup setup;
  if (o.device.is_cuda() && g.head_dim_k != g.head_dim_v) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.head_dim_v: expected head_dim_k (", g.head_dim_k,
        ") for decode attention on a CUDA device (the CPU reference takes any pair), got ",
        g.head_dim_v));
  }
  if (o.device.is_cuda()) {
    // Queried for the given ordinal; the calling thread's current device is
    // left as it is.
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, o.device.ordinal));
    workspace_bytes = internal::AttentionWorkspaceBytes(o, num_sms);
    if (workspace_bytes < 0) {
      return absl::InternalError(absl::StrCat(
          "DecodeAttention: the kernel asked for a negative workspace (", workspace_bytes, ")"));
    }
    FP4KV_RETURN_IF_ERROR(internal::PrepareDecodeAttention(o, &setup));
  }
  return DecodeAttention(o, num_sms, workspace_bytes, setup.merge_overlaps,
                         static_cast<int>(setup.family), setup.ctas_per_sm,
                         setup.prefill_ctas_per_sm, setup.ctas_per_sm_rows,
                         static_cast<int>(setup.prefill_family));
}

const char* DecodeAttention::decode_family() const {
  if (!options_.device.is_cuda()) return "cpu";
  switch (static_cast<internal::AttentionFamily>(family_)) {
    case internal::AttentionFamily::kRowsInM:
      return "rows_in_m";
    case internal::AttentionFamily::kTokensInM:
      return "tokens_in_m";
    case internal::AttentionFamily::kTokensInMTma:
      return "tokens_in_m_tma";
    case internal::AttentionFamily::kTokensInMTmaAll:
      return "tokens_in_m_tma_all";
  }
  return "unknown";
}

const char* DecodeAttention::prefill_family() const {
  if (!options_.device.is_cuda()) return "cpu";
  if (options_.max_q_len <= kDecodeRowsQLen) return "none";
  return static_cast<internal::PrefillFamily>(prefill_family_) == internal::PrefillFamily::kWgmma
             ? "wgmma"
             : "mma";
}

namespace internal {
absl::StatusOr<AttentionParams> MakeAttentionParams(const DecodeAttention::Options& o,
                                                    const DecodeAttentionArgs& a,
                                                    const PagedCache& cache, void* workspace,
                                                    int64_t workspace_bytes, int num_sms) {
  CachePools pools;
  FP4KV_RETURN_IF_ERROR(CheckCache(cache, o.geometry, o.device, &pools.k, &pools.v));
  return MakeAttentionParams(o, a, pools, workspace, workspace_bytes, num_sms);
}

absl::StatusOr<AttentionParams> MakeAttentionParams(const DecodeAttention::Options& o,
                                                    const DecodeAttentionArgs& a,
                                                    const CachePools& pools, void* workspace,
                                                    int64_t workspace_bytes, int num_sms) {
  AttentionTables t;
  FP4KV_RETURN_IF_ERROR(CheckAttentionTables(o, a, &t));
  const int64_t need = o.device.is_cuda() ? AttentionWorkspaceBytes(o, num_sms) : 0;
  return MakeAttentionParams(o, a, pools, t, workspace, workspace_bytes, num_sms, need);
}

absl::Status CheckAttentionTables(const DecodeAttention::Options& o, const DecodeAttentionArgs& a,
                                  AttentionTables* t) {
  const Device& dev = o.device;
  // Requests: seq_lens decides B, the block tables follow it.
  FP4KV_RETURN_IF_ERROR(CheckTensor(a.seq_lens, "seq_lens", DType::kI32, {kAny}, dev));
  const int64_t batch = a.seq_lens.shape[0];
  if (batch < 1 || batch > o.max_batch) {
    return absl::InvalidArgumentError(absl::StrCat("seq_lens: expected 1 .. options.max_batch (",
                                                   o.max_batch, ") requests, got shape ",
                                                   a.seq_lens.ShapeString()));
  }
  FP4KV_RETURN_IF_ERROR(
      CheckTensor(a.block_tables, "block_tables", o.table_dtype, {batch, kAny}, dev));
  const int64_t max_pages = a.block_tables.shape[1];
  if (max_pages < 1 || max_pages > o.max_pages_per_seq) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_tables: expected 1 .. options.max_pages_per_seq (", o.max_pages_per_seq,
                     ") pages per request, got shape ", a.block_tables.ShapeString()));
  }
  const bool has_indptr = o.max_q_len > 1 || !a.q_indptr.empty();
  if (has_indptr) {
    FP4KV_RETURN_IF_ERROR(CheckTensor(a.q_indptr, "q_indptr", DType::kI32, {batch + 1}, dev));
  }
  t->block_tables = a.block_tables.data;
  t->table_row_stride = a.block_tables.strides[0];
  t->max_pages = static_cast<int>(max_pages);
  t->seq_lens = a.seq_lens.ptr<const int32_t>();
  t->q_indptr = has_indptr ? a.q_indptr.ptr<const int32_t>() : nullptr;
  t->batch = static_cast<int>(batch);
  return absl::OkStatus();
}

absl::StatusOr<AttentionParams> MakeAttentionParams(const DecodeAttention::Options& o,
                                                    const DecodeAttentionArgs& a,
                                                    const CachePools& pools,
                                                    const AttentionTables& t, void* workspace,
                                                    int64_t workspace_bytes, int num_sms,
                                                    int64_t need) {
  const CacheGeometry& g = o.geometry;
  const Device& dev = o.device;
  const int hq = o.num_qo_heads;
  AttentionParams p;
  p.k = pools.k;
  p.v = pools.v;
  const int64_t batch = t.batch;

  // Queries.
  FP4KV_RETURN_IF_ERROR(CheckTensor(a.q, "q", o.dtype, {kAny, hq, g.head_dim_k}, dev));
  FP4KV_RETURN_IF_ERROR(CheckAligned(a.q, "q", 16));
  const int64_t total_q = a.q.shape[0];
  if (t.q_indptr == nullptr && total_q != batch) {
    // Without q_indptr, request b is q row b.
    return absl::InvalidArgumentError(absl::StrCat("q: expected one row per request (", batch,
                                                   ", as seq_lens) without q_indptr, got shape ",
                                                   a.q.ShapeString()));
  }

  // Outputs.
  FP4KV_RETURN_IF_ERROR(CheckTensor(a.out, "out", o.dtype, {total_q, hq, g.head_dim_v}, dev));
  FP4KV_RETURN_IF_ERROR(CheckAligned(a.out, "out", 16));
  if (o.write_lse) {
    FP4KV_RETURN_IF_ERROR(CheckTensor(a.lse, "lse", DType::kF32, {total_q, hq}, dev));
    FP4KV_RETURN_IF_ERROR(CheckAligned(a.lse, "lse", 4));
  } else {
    FP4KV_RETURN_IF_ERROR(CheckAbsent(a.lse, "lse", "options.write_lse is false"));
  }
  if (o.has_sinks) {
    FP4KV_RETURN_IF_ERROR(CheckTensor(a.sinks, "sinks", DType::kF32, {hq}, dev));
    FP4KV_RETURN_IF_ERROR(CheckAligned(a.sinks, "sinks", 4));
  } else {
    FP4KV_RETURN_IF_ERROR(CheckAbsent(a.sinks, "sinks", "options.has_sinks is false"));
  }
  FP4KV_RETURN_IF_ERROR(CheckGlobalScale(a.k_scale, "k_scale"));
  FP4KV_RETURN_IF_ERROR(CheckGlobalScale(a.v_scale, "v_scale"));

  // Workspace: the kernel's split-KV scratch (none on the CPU).
  if (workspace_bytes < need) {
    return absl::InvalidArgumentError(absl::StrCat(
        "workspace_bytes: expected at least WorkspaceBytes() = ", need, ", got ", workspace_bytes));
  }
  if (need > 0 && workspace == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("workspace: expected a pointer to ", need,
                                                   " bytes on ", dev.ToString(),
                                                   ", got a null pointer"));
  }
  const auto addr = reinterpret_cast<uintptr_t>(workspace);
  if (dev.is_cuda() && addr % kWorkspaceAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "workspace: expected a ", kWorkspaceAlignment, "-byte aligned pointer, got address ", addr,
        " (", addr % kWorkspaceAlignment, " past alignment)"));
  }

  p.fp8_keys = g.fp8_keys();
  p.num_kv_heads = g.num_kv_heads;
  p.num_qo_heads = hq;
  p.group = hq / g.num_kv_heads;
  p.page_size = g.page_size;
  p.num_pages = g.num_pages;
  p.dtype = o.dtype;
  p.q = a.q.data;
  p.q_row_stride = a.q.strides[0];
  p.q_head_stride = a.q.strides[1];
  p.total_q = total_q;
  p.q_indptr = t.q_indptr;
  p.max_q_len = o.max_q_len;
  p.block_tables = t.block_tables;
  p.tables_i64 = o.table_dtype == DType::kI64;
  p.table_row_stride = t.table_row_stride;
  p.max_pages = t.max_pages;
  p.seq_lens = t.seq_lens;
  p.batch_size = t.batch;
  p.out = a.out.data;
  p.out_row_stride = a.out.strides[0];
  p.out_head_stride = a.out.strides[1];
  if (o.write_lse) {
    p.lse = a.lse.ptr<float>();
    p.lse_row_stride = a.lse.strides[0];
  }
  if (o.has_sinks) p.sinks = a.sinks.ptr<const float>();
  p.sm_scale = o.sm_scale > 0.0f ? o.sm_scale : 1.0f / std::sqrt(static_cast<float>(g.head_dim_k));
  p.soft_cap = o.logits_soft_cap;
  p.window_left = o.window_left;
  p.k_scale = a.k_scale;
  p.v_scale = a.v_scale;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  p.max_batch = o.max_batch;
  p.num_sms = num_sms;
  return p;
}

absl::Status DecodeAttentionRunner::Run(const DecodeAttention& op, const DecodeAttentionArgs& a,
                                        const CachePools& pools, void* workspace,
                                        int64_t workspace_bytes, Stream stream) {
  AttentionTables t;
  FP4KV_RETURN_IF_ERROR(CheckAttentionTables(op.options_, a, &t));
  return Run(op, a, pools, t, workspace, workspace_bytes, stream);
}

absl::Status DecodeAttentionRunner::Run(const DecodeAttention& op, const DecodeAttentionArgs& a,
                                        const CachePools& pools, const AttentionTables& t,
                                        void* workspace, int64_t workspace_bytes, Stream stream,
                                        const kernels::AttnTmaMaps* tma_maps) {
  // Create() sized the workspace (AttentionWorkspaceBytes) once.
  absl::StatusOr<AttentionParams> p = MakeAttentionParams(
      op.options_, a, pools, t, workspace, workspace_bytes, op.num_sms_, op.workspace_bytes_);
  if (!p.ok()) return p.status();
  if (p->total_q == 0) return absl::OkStatus();
  p->merge_overlaps = op.merge_overlaps_;
  p->family = static_cast<AttentionFamily>(op.family_);
  p->ctas_per_sm = op.ctas_per_sm_;
  p->prefill_ctas_per_sm = op.prefill_ctas_per_sm_;
  p->ctas_per_sm_rows = op.ctas_per_sm_rows_;
  p->prefill_family = static_cast<PrefillFamily>(op.prefill_family_);
  p->tma_maps = tma_maps;
  if (!op.options_.device.is_cuda()) {
    ReferenceDecodeAttention(*p);
    return absl::OkStatus();
  }
  return LaunchDecodeAttention(*p, stream);
}
bool DecodeAttentionRunner::EncodeTmaMaps(const DecodeAttention& op, const CachePools& pools,
                                          kernels::AttnTmaMaps* m) {
  const DecodeAttention::Options& o = op.options_;
  if (!o.device.is_cuda()) return false;
  AttentionParams p;
  p.k = pools.k;
  p.v = pools.v;
  p.fp8_keys = o.geometry.fp8_keys();
  p.num_kv_heads = o.geometry.num_kv_heads;
  p.page_size = o.geometry.page_size;
  p.num_pages = o.geometry.num_pages;
  p.family = static_cast<AttentionFamily>(op.family_);
  return EncodeDecodeTmaMaps(p, m);
}
}  // namespace internal

absl::Status DecodeAttention::Run(const DecodeAttentionArgs& args, const PagedCache& cache,
                                  void* workspace, int64_t workspace_bytes, Stream stream) const {
  if (options_.num_qo_heads <= 0) {
    return absl::FailedPreconditionError(
        "DecodeAttention: expected an op from Create(), got a default-constructed one");
  }
  internal::CachePools pools;
  FP4KV_RETURN_IF_ERROR(
      internal::CheckCache(cache, options_.geometry, options_.device, &pools.k, &pools.v));
  return internal::DecodeAttentionRunner::Run(*this, args, pools, workspace, workspace_bytes,
                                              stream);
}

absl::Status DecodeAttentionPaged(const DecodeAttention::Options& options,
                                  const DecodeAttentionArgs& args, const PagedCache& cache,
                                  void* workspace, int64_t workspace_bytes, Stream stream) {
  absl::StatusOr<DecodeAttention> op = DecodeAttention::Create(options);
  if (!op.ok()) return op.status();
  return op->Run(args, cache, workspace, workspace_bytes, stream);
}

}  // namespace fp4kv
