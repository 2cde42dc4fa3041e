// Op objects: Create() validates static options once; Run() checks the
// per-call views cheaply, fills the plain-pointer params and dispatches to
// the CPU reference or the CUDA launcher.
#include "fp4kv/ops.h"

#include <cmath>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "fp4kv/recipe.h"
#include "src/cuda_util.h"
#include "src/params.h"
#include "src/status_macros.h"
#include "src/validate.h"

namespace fp4kv {

using internal::CheckAligned;
using internal::CheckDevice;
using internal::CheckDType;
using internal::CheckExtentAtMost;
using internal::CheckGiven;
using internal::CheckGlobalScale;
using internal::CheckInnerContiguous;
using internal::CheckShape;
using internal::kAny;

namespace {

// A 1-D contiguous index tensor of `dtype` with `n` elements (kAny: any).
absl::Status CheckIndexVector(const TensorView& t, const char* name, DType dtype, int64_t n,
                              const Device& device) {
  FP4KV_RETURN_IF_ERROR(CheckGiven(t, name));
  FP4KV_RETURN_IF_ERROR(CheckDType(t, name, {dtype}));
  FP4KV_RETURN_IF_ERROR(CheckShape(t, name, {n}));
  FP4KV_RETURN_IF_ERROR(CheckInnerContiguous(t, name));
  return CheckDevice(t, name, device);
}

// A [rows, H, D] f16/bf16 tensor with contiguous, 16-byte aligned rows.
absl::Status CheckRows(const TensorView& t, const char* name, DType dtype, int64_t rows, int heads,
                       int dim, const Device& device) {
  FP4KV_RETURN_IF_ERROR(CheckGiven(t, name));
  FP4KV_RETURN_IF_ERROR(CheckDType(t, name, {dtype}));
  FP4KV_RETURN_IF_ERROR(CheckShape(t, name, {rows, heads, dim}));
  FP4KV_RETURN_IF_ERROR(CheckInnerContiguous(t, name));
  FP4KV_RETURN_IF_ERROR(CheckAligned(t, name, 16));
  return CheckDevice(t, name, device);
}

absl::Status NotCreated(const char* what) {
  return absl::FailedPreconditionError(
      absl::StrCat(what, ": expected an op from Create(), got a default-constructed one"));
}

absl::Status CheckCommonOptions(const CacheGeometry& g, const Device& device) {
  FP4KV_RETURN_IF_ERROR(g.Validate());
  return internal::CheckDeviceAvailable(device);
}

// Runs load (a Load*Kernels of src/params.h) on `device` when it is a CUDA
// device; the caller's current device is restored.
template <class Load>
absl::Status LoadOn(const Device& device, Load&& load) {
  if (!device.is_cuda()) return absl::OkStatus();
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(device));
  return load();
}

absl::Status CheckTableDType(DType t, const char* name) {
  if (t != DType::kI32 && t != DType::kI64) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected dtype i32 or i64, got ", DTypeName(t)));
  }
  return absl::OkStatus();
}

}  // namespace

// ----------------------------------------------------------------- Appender
absl::StatusOr<Appender> Appender::Create(const Options& o) {
  FP4KV_RETURN_IF_ERROR(internal::CheckFloatDType(o.input_dtype, "options.input_dtype"));
  if (o.indexing != AppendIndexing::kPaged && o.indexing != AppendIndexing::kSlot) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.indexing: expected kPaged or kSlot, got ", static_cast<int>(o.indexing)));
  }
  FP4KV_RETURN_IF_ERROR(ValidateRecipe(o.recipe));
  FP4KV_RETURN_IF_ERROR(CheckCommonOptions(o.geometry, o.device));
  // The kernels it may launch are loaded on the op's device, where the
  // code's PTX version says whether a launch may overlap its predecessor.
  bool overlap = false;
  FP4KV_RETURN_IF_ERROR(LoadOn(o.device, [&]() -> absl::Status {
    FP4KV_RETURN_IF_ERROR(
        internal::LoadAppendKernels(o.input_dtype, o.recipe, o.count_scale_events));
    return internal::AppendOverlapsLaunch(&overlap);
  }));
  return internal::AppendAccess::Make(o, overlap);
}

namespace internal {
absl::StatusOr<AppendParams> MakeAppendParams(const Appender::Options& o, const AppendArgs& a,
                                              const PagedCache& cache) {
  CachePools pools;
  FP4KV_RETURN_IF_ERROR(CheckCache(cache, o.geometry, o.device, &pools.k, &pools.v));
  return MakeAppendParams(o, a, pools);
}

absl::StatusOr<AppendParams> MakeAppendParams(const Appender::Options& o, const AppendArgs& a,
                                              const CachePools& pools) {
  const CacheGeometry& g = o.geometry;
  const Device& dev = o.device;
  internal::AppendParams p;
  p.k = pools.k;
  p.v = pools.v;
  FP4KV_RETURN_IF_ERROR(CheckGiven(a.key, "append_key"));
  FP4KV_RETURN_IF_ERROR(CheckShape(a.key, "append_key", {kAny, g.num_kv_heads, g.head_dim_k}));
  const int64_t rows = a.key.shape[0];
  FP4KV_RETURN_IF_ERROR(
      CheckRows(a.key, "append_key", o.input_dtype, rows, g.num_kv_heads, g.head_dim_k, dev));
  FP4KV_RETURN_IF_ERROR(
      CheckRows(a.value, "append_value", o.input_dtype, rows, g.num_kv_heads, g.head_dim_v, dev));
  FP4KV_RETURN_IF_ERROR(CheckGlobalScale(a.k_scale, "k_scale"));
  FP4KV_RETURN_IF_ERROR(CheckGlobalScale(a.v_scale, "v_scale"));
  if (o.count_scale_events) {
    if (a.scale_events == nullptr) {
      return absl::InvalidArgumentError(
          "scale_events: expected 4 uint64 counters (options.count_scale_events is on), got a "
          "null pointer");
    }
    if (reinterpret_cast<uintptr_t>(a.scale_events) % 8 != 0) {
      return absl::InvalidArgumentError(
          "scale_events: expected an 8-byte aligned pointer, got a misaligned one");
    }
    p.scale_events = a.scale_events;
  } else if (a.scale_events != nullptr) {
    return absl::InvalidArgumentError(
        "scale_events: expected a null pointer (options.count_scale_events is off), got a "
        "pointer");
  }
  p.indexing = o.indexing;
  if (o.indexing == AppendIndexing::kPaged) {
    FP4KV_RETURN_IF_ERROR(
        CheckIndexVector(a.batch_indices, "batch_indices", DType::kI32, rows, dev));
    FP4KV_RETURN_IF_ERROR(CheckIndexVector(a.positions, "positions", DType::kI32, rows, dev));
    FP4KV_RETURN_IF_ERROR(CheckIndexVector(a.kv_indptr, "kv_indptr", DType::kI32, kAny, dev));
    if (a.kv_indptr.shape[0] < 1) {
      return absl::InvalidArgumentError("kv_indptr: expected shape [B + 1] with B >= 0, got [0]");
    }
    FP4KV_RETURN_IF_ERROR(CheckExtentAtMost(a.kv_indptr, "kv_indptr", 0, INT32_MAX));
    const int64_t batch = a.kv_indptr.shape[0] - 1;
    FP4KV_RETURN_IF_ERROR(
        CheckIndexVector(a.kv_last_page_len, "kv_last_page_len", DType::kI32, batch, dev));
    FP4KV_RETURN_IF_ERROR(CheckIndexVector(a.kv_indices, "kv_indices", DType::kI32, kAny, dev));
    p.nnz = rows;
    p.batch_indices = a.batch_indices.ptr<const int32_t>();
    p.positions = a.positions.ptr<const int32_t>();
    p.kv_indices = a.kv_indices.ptr<const int32_t>();
    p.kv_indptr = a.kv_indptr.ptr<const int32_t>();
    p.num_kv_indices = a.kv_indices.shape[0];
    p.batch_size = static_cast<int>(batch);
  } else {
    FP4KV_RETURN_IF_ERROR(CheckIndexVector(a.slot_mapping, "slot_mapping", DType::kI64, kAny, dev));
    if (a.slot_mapping.shape[0] > rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("slot_mapping: expected at most append_key.shape[0] = ", rows,
                       " entries, got ", a.slot_mapping.shape[0]));
    }
    p.nnz = a.slot_mapping.shape[0];
    p.slot_mapping = a.slot_mapping.ptr<const int64_t>();
  }
  p.key = a.key.data;
  p.value = a.value.data;
  p.key_row_stride = a.key.strides[0];
  p.key_head_stride = a.key.strides[1];
  p.value_row_stride = a.value.strides[0];
  p.value_head_stride = a.value.strides[1];
  p.input_dtype = o.input_dtype;
  p.num_heads = g.num_kv_heads;
  p.page_size = g.page_size;
  p.num_pages = g.num_pages;
  p.k_scale = a.k_scale;
  p.v_scale = a.v_scale;
  p.recipe = o.recipe;
  p.fp8_keys = g.fp8_keys();
  return p;
}

absl::Status RunAppend(const Appender& op, const AppendParams& p, Stream stream) {
  if (p.nnz == 0) return absl::OkStatus();
  if (!op.options().device.is_cuda()) {
    ReferenceAppend(p);
    return absl::OkStatus();
  }
  if (AppendAccess::OverlapLaunch(op) == p.overlap_launch) return LaunchAppend(p, stream);
  AppendParams q = p;
  q.overlap_launch = AppendAccess::OverlapLaunch(op);
  return LaunchAppend(q, stream);
}
}  // namespace internal

absl::Status Appender::Run(const AppendArgs& a, const PagedCache& cache, Stream stream) const {
  if (!created_) return NotCreated("Appender");
  absl::StatusOr<internal::AppendParams> p = internal::MakeAppendParams(options_, a, cache);
  if (!p.ok()) return p.status();
  return internal::RunAppend(*this, *p, stream);
}

// -------------------------------------------------------------- Dequantizer
absl::StatusOr<Dequantizer> Dequantizer::Create(const Options& o) {
  FP4KV_RETURN_IF_ERROR(internal::CheckFloatDType(o.output_dtype, "options.output_dtype"));
  FP4KV_RETURN_IF_ERROR(CheckTableDType(o.table_dtype, "options.table_dtype"));
  FP4KV_RETURN_IF_ERROR(CheckCommonOptions(o.geometry, o.device));
  FP4KV_RETURN_IF_ERROR(
      LoadOn(o.device, [&] { return internal::LoadDequantizeKernels(o.output_dtype); }));
  return Dequantizer(o);
}

namespace internal {
absl::StatusOr<DequantParams> MakeDequantParams(const Dequantizer::Options& o, const DequantArgs& a,
                                                const PagedCache& cache) {
  CachePools pools;
  FP4KV_RETURN_IF_ERROR(CheckCache(cache, o.geometry, o.device, &pools.k, &pools.v));
  return MakeDequantParams(o, a, pools);
}

absl::StatusOr<DequantParams> MakeDequantParams(const Dequantizer::Options& o, const DequantArgs& a,
                                                const CachePools& pools) {
  const CacheGeometry& g = o.geometry;
  const Device& dev = o.device;
  internal::DequantParams p;
  p.k = pools.k;
  p.v = pools.v;
  FP4KV_RETURN_IF_ERROR(CheckGiven(a.block_tables, "block_tables"));
  FP4KV_RETURN_IF_ERROR(CheckTableDType(a.block_tables.dtype, "block_tables"));
  FP4KV_RETURN_IF_ERROR(CheckDType(a.block_tables, "block_tables", {o.table_dtype}));
  FP4KV_RETURN_IF_ERROR(CheckShape(a.block_tables, "block_tables", {kAny, kAny}));
  FP4KV_RETURN_IF_ERROR(CheckExtentAtMost(a.block_tables, "block_tables", 0, INT32_MAX));
  FP4KV_RETURN_IF_ERROR(CheckExtentAtMost(a.block_tables, "block_tables", 1, INT32_MAX));
  FP4KV_RETURN_IF_ERROR(CheckInnerContiguous(a.block_tables, "block_tables"));
  FP4KV_RETURN_IF_ERROR(CheckDevice(a.block_tables, "block_tables", dev));
  const int64_t batch = a.block_tables.shape[0];
  FP4KV_RETURN_IF_ERROR(CheckIndexVector(a.seq_lens, "seq_lens", DType::kI32, batch, dev));
  FP4KV_RETURN_IF_ERROR(CheckGiven(a.k_out, "k_out"));
  FP4KV_RETURN_IF_ERROR(CheckShape(a.k_out, "k_out", {batch, kAny, g.num_kv_heads, g.head_dim_k}));
  FP4KV_RETURN_IF_ERROR(CheckExtentAtMost(a.k_out, "k_out", 1, INT32_MAX));
  const int64_t max_len = a.k_out.shape[1];
  for (const auto& [t, name, dim] :
       {std::tuple<const TensorView&, const char*, int>{a.k_out, "k_out", g.head_dim_k},
        std::tuple<const TensorView&, const char*, int>{a.v_out, "v_out", g.head_dim_v}}) {
    FP4KV_RETURN_IF_ERROR(CheckGiven(t, name));
    FP4KV_RETURN_IF_ERROR(CheckDType(t, name, {o.output_dtype}));
    FP4KV_RETURN_IF_ERROR(CheckShape(t, name, {batch, max_len, g.num_kv_heads, dim}));
    FP4KV_RETURN_IF_ERROR(CheckInnerContiguous(t, name));
    FP4KV_RETURN_IF_ERROR(CheckAligned(t, name, 16));
    FP4KV_RETURN_IF_ERROR(CheckDevice(t, name, dev));
  }
  FP4KV_RETURN_IF_ERROR(CheckGlobalScale(a.k_scale, "k_scale"));
  FP4KV_RETURN_IF_ERROR(CheckGlobalScale(a.v_scale, "v_scale"));
  p.num_heads = g.num_kv_heads;
  p.page_size = g.page_size;
  p.num_pages = g.num_pages;
  p.block_tables = a.block_tables.data;
  p.tables_i64 = o.table_dtype == DType::kI64;
  p.table_row_stride = a.block_tables.strides[0];
  p.max_pages = static_cast<int>(a.block_tables.shape[1]);
  p.seq_lens = a.seq_lens.ptr<const int32_t>();
  p.batch_size = static_cast<int>(batch);
  p.max_seq_len = static_cast<int>(max_len);
  p.k_out = a.k_out.data;
  p.v_out = a.v_out.data;
  p.k_out_batch = a.k_out.strides[0];
  p.k_out_token = a.k_out.strides[1];
  p.k_out_head = a.k_out.strides[2];
  p.v_out_batch = a.v_out.strides[0];
  p.v_out_token = a.v_out.strides[1];
  p.v_out_head = a.v_out.strides[2];
  p.output_dtype = o.output_dtype;
  p.k_scale = a.k_scale;
  p.v_scale = a.v_scale;
  p.fp8_keys = g.fp8_keys();
  return p;
}

absl::Status RunDequantize(const Dequantizer& op, const DequantParams& p, Stream stream) {
  if (p.batch_size == 0 || p.max_seq_len == 0 || p.max_pages == 0) return absl::OkStatus();
  if (!op.options().device.is_cuda()) {
    ReferenceDequantize(p);
    return absl::OkStatus();
  }
  return LaunchDequantize(p, stream);
}
}  // namespace internal

absl::Status Dequantizer::Run(const DequantArgs& a, const PagedCache& cache, Stream stream) const {
  if (!created_) return NotCreated("Dequantizer");
  absl::StatusOr<internal::DequantParams> p = internal::MakeDequantParams(options_, a, cache);
  if (!p.ok()) return p.status();
  return internal::RunDequantize(*this, *p, stream);
}

// ------------------------------------------------------------- Materializer
absl::StatusOr<Materializer> Materializer::Create(const Options& o) {
  FP4KV_RETURN_IF_ERROR(CheckTableDType(o.table_dtype, "options.table_dtype"));
  FP4KV_RETURN_IF_ERROR(o.geometry.Validate());
  if (o.geometry.head_dim_k != o.geometry.head_dim_v) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.head_dim_v: expected equal to head_dim_k (", o.geometry.head_dim_k,
                     ") for FP8 materialization, got ", o.geometry.head_dim_v));
  }
  if (o.geometry.head_dim_k % 64 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.head_dim_k: expected a multiple of 64 for FP8 materialization, got ",
                     o.geometry.head_dim_k));
  }
  if (o.geometry.page_size % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.page_size: expected a multiple of 4 for FP8 materialization, got ",
                     o.geometry.page_size));
  }
  FP4KV_RETURN_IF_ERROR(internal::CheckDeviceAvailable(o.device));
  FP4KV_RETURN_IF_ERROR(LoadOn(
      o.device, [&] { return internal::LoadMaterializeKernels(o.geometry.fp8_keys()); }));
  return Materializer(o);
}

namespace internal {
absl::StatusOr<MaterializeParams> MakeMaterializeParams(const Materializer::Options& o,
                                                        const MaterializeArgs& a,
                                                        const PagedCache& cache) {
  CachePools pools;
  FP4KV_RETURN_IF_ERROR(CheckCache(cache, o.geometry, o.device, &pools.k, &pools.v));
  return MakeMaterializeParams(o, a, pools);
}

absl::StatusOr<MaterializeParams> MakeMaterializeParams(const Materializer::Options& o,
                                                        const MaterializeArgs& a,
                                                        const CachePools& pools) {
  const CacheGeometry& g = o.geometry;
  const Device& dev = o.device;
  internal::MaterializeParams p;
  p.k = pools.k;
  p.v = pools.v;
  FP4KV_RETURN_IF_ERROR(CheckGiven(a.block_tables, "block_tables"));
  FP4KV_RETURN_IF_ERROR(CheckTableDType(a.block_tables.dtype, "block_tables"));
  FP4KV_RETURN_IF_ERROR(CheckDType(a.block_tables, "block_tables", {o.table_dtype}));
  if (o.separate_kv_tables) {
    FP4KV_RETURN_IF_ERROR(CheckShape(a.block_tables, "block_tables", {kAny, 2, kAny}));
  } else {
    FP4KV_RETURN_IF_ERROR(CheckShape(a.block_tables, "block_tables", {kAny, kAny}));
  }
  FP4KV_RETURN_IF_ERROR(CheckExtentAtMost(a.block_tables, "block_tables", 0, INT32_MAX - 1));
  FP4KV_RETURN_IF_ERROR(
      CheckExtentAtMost(a.block_tables, "block_tables", a.block_tables.ndim - 1, INT32_MAX));
  FP4KV_RETURN_IF_ERROR(CheckInnerContiguous(a.block_tables, "block_tables"));
  FP4KV_RETURN_IF_ERROR(CheckDevice(a.block_tables, "block_tables", dev));
  const int64_t batch = a.block_tables.shape[0];
  const int64_t max_pages = a.block_tables.shape[a.block_tables.ndim - 1];
  FP4KV_RETURN_IF_ERROR(CheckIndexVector(a.seq_lens, "seq_lens", DType::kI32, batch, dev));
  FP4KV_RETURN_IF_ERROR(
      CheckIndexVector(a.kv_page_indptr, "kv_page_indptr", DType::kI32, batch + 1, dev));
  FP4KV_RETURN_IF_ERROR(CheckGiven(a.out, "out"));
  FP4KV_RETURN_IF_ERROR(CheckDType(a.out, "out", {DType::kE4M3, DType::kU8}));
  FP4KV_RETURN_IF_ERROR(
      CheckShape(a.out, "out", {kAny, 2, g.num_kv_heads, g.page_size, g.head_dim_k}));
  if (a.out.shape[0] < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("out: expected at least 1 page (page 0 is the zero page), got shape ",
                     a.out.ShapeString()));
  }
  FP4KV_RETURN_IF_ERROR(CheckInnerContiguous(a.out, "out"));
  FP4KV_RETURN_IF_ERROR(CheckAligned(a.out, "out", 16));
  FP4KV_RETURN_IF_ERROR(CheckDevice(a.out, "out", dev));
  FP4KV_RETURN_IF_ERROR(CheckGiven(a.fp8_block_tables, "fp8_block_tables"));
  FP4KV_RETURN_IF_ERROR(CheckDType(a.fp8_block_tables, "fp8_block_tables", {DType::kI32}));
  FP4KV_RETURN_IF_ERROR(CheckShape(a.fp8_block_tables, "fp8_block_tables", {batch, max_pages}));
  FP4KV_RETURN_IF_ERROR(CheckInnerContiguous(a.fp8_block_tables, "fp8_block_tables"));
  FP4KV_RETURN_IF_ERROR(CheckDevice(a.fp8_block_tables, "fp8_block_tables", dev));
  FP4KV_RETURN_IF_ERROR(CheckGlobalScale(a.k_scale, "k_scale"));
  FP4KV_RETURN_IF_ERROR(CheckGlobalScale(a.v_scale, "v_scale"));
  FP4KV_RETURN_IF_ERROR(CheckGlobalScale(a.k_fp8_scale, "k_fp8_scale"));
  FP4KV_RETURN_IF_ERROR(CheckGlobalScale(a.v_fp8_scale, "v_fp8_scale"));
  p.num_heads = g.num_kv_heads;
  p.head_dim = g.head_dim_k;
  p.page_size = g.page_size;
  p.num_pages = g.num_pages;
  p.block_tables = a.block_tables.data;
  p.tables_i64 = o.table_dtype == DType::kI64;
  p.table_row_stride = a.block_tables.strides[0];
  p.table_kv_stride = o.separate_kv_tables ? a.block_tables.strides[1] : 0;
  p.max_pages = static_cast<int>(max_pages);
  p.seq_lens = a.seq_lens.ptr<const int32_t>();
  p.kv_page_indptr = a.kv_page_indptr.ptr<const int32_t>();
  p.batch_size = static_cast<int>(batch);
  p.out = static_cast<uint8_t*>(a.out.data);
  p.num_out_pages = a.out.shape[0];
  p.out_page = a.out.strides[0];
  p.out_kv = a.out.strides[1];
  p.out_head = a.out.strides[2];
  p.out_entry = a.out.strides[3];
  p.fp8_block_tables = a.fp8_block_tables.ptr<int32_t>();
  p.fp8_table_row_stride = a.fp8_block_tables.strides[0];
  p.k_scale = a.k_scale;
  p.v_scale = a.v_scale;
  p.k_fp8_scale = a.k_fp8_scale;
  p.v_fp8_scale = a.v_fp8_scale;
  p.fp8_keys = g.fp8_keys();
  return p;
}

absl::Status RunMaterialize(const Materializer& op, const MaterializeParams& p, Stream stream) {
  if (!op.options().device.is_cuda()) {
    ReferenceMaterialize(p);
    return absl::OkStatus();
  }
  return LaunchMaterialize(p, stream);
}
}  // namespace internal

absl::Status Materializer::Run(const MaterializeArgs& a, const PagedCache& cache,
                               Stream stream) const {
  if (!created_) return NotCreated("Materializer");
  absl::StatusOr<internal::MaterializeParams> p =
      internal::MakeMaterializeParams(options_, a, cache);
  if (!p.ok()) return p.status();
  return internal::RunMaterialize(*this, *p, stream);
}

absl::StatusOr<float> MinFp8Scale(float g) {
  if (!IsValidGlobalScale(g)) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_scale: expected a value in (0, ", MaxGlobalScale(),
                     "] (positive, with 6 * 448 * g finite), got ", g));
  }
  return MinFp8ScaleFor(g);
}

// ---------------------------------------------------------- LinearQuantizer
absl::StatusOr<LinearQuantizer> LinearQuantizer::Create(const Options& o) {
  FP4KV_RETURN_IF_ERROR(internal::CheckFloatDType(o.dtype, "options.dtype"));
  FP4KV_RETURN_IF_ERROR(ValidateRecipe(o.recipe));
  FP4KV_RETURN_IF_ERROR(internal::CheckDeviceAvailable(o.device));
  FP4KV_RETURN_IF_ERROR(
      LoadOn(o.device, [&] { return internal::LoadLinearKernels(o.dtype, o.recipe); }));
  return LinearQuantizer(o);
}

namespace {

absl::Status CheckLinear(const TensorView& x, const char* x_name, DType dtype,
                         const TensorView& packed, const TensorView& scales, const Device& dev) {
  FP4KV_RETURN_IF_ERROR(CheckGiven(x, x_name));
  FP4KV_RETURN_IF_ERROR(CheckDType(x, x_name, {dtype}));
  FP4KV_RETURN_IF_ERROR(CheckShape(x, x_name, {kAny, kAny}));
  const int64_t m = x.shape[0], k = x.shape[1];
  if (k % kBlockSize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(x_name, ": expected shape[1] a multiple of 16, got ", x.ShapeString()));
  }
  FP4KV_RETURN_IF_ERROR(CheckInnerContiguous(x, x_name));
  FP4KV_RETURN_IF_ERROR(CheckAligned(x, x_name, 16));
  FP4KV_RETURN_IF_ERROR(CheckDevice(x, x_name, dev));
  FP4KV_RETURN_IF_ERROR(CheckGiven(packed, "packed"));
  FP4KV_RETURN_IF_ERROR(CheckDType(packed, "packed", {DType::kU8}));
  FP4KV_RETURN_IF_ERROR(CheckShape(packed, "packed", {m, k / 2}));
  FP4KV_RETURN_IF_ERROR(CheckInnerContiguous(packed, "packed"));
  FP4KV_RETURN_IF_ERROR(CheckAligned(packed, "packed", 8));
  FP4KV_RETURN_IF_ERROR(CheckDevice(packed, "packed", dev));
  FP4KV_RETURN_IF_ERROR(CheckGiven(scales, "scales"));
  FP4KV_RETURN_IF_ERROR(CheckDType(scales, "scales", {DType::kE4M3, DType::kU8}));
  FP4KV_RETURN_IF_ERROR(CheckShape(scales, "scales", {m, k / kBlockSize}));
  FP4KV_RETURN_IF_ERROR(CheckInnerContiguous(scales, "scales"));
  return CheckDevice(scales, "scales", dev);
}

}  // namespace

absl::Status LinearQuantizer::Quantize(const TensorView& input, const TensorView& packed,
                                       const TensorView& scales, GlobalScale global_scale,
                                       Stream stream) const {
  if (!created_) return NotCreated("LinearQuantizer");
  FP4KV_RETURN_IF_ERROR(
      CheckLinear(input, "input", options_.dtype, packed, scales, options_.device));
  FP4KV_RETURN_IF_ERROR(CheckGlobalScale(global_scale, "global_scale"));
  internal::LinearQuantParams p;
  p.input = input.data;
  p.input_row_stride = input.strides[0];
  p.dtype = options_.dtype;
  p.rows = input.shape[0];
  p.cols = input.shape[1];
  p.packed = static_cast<uint8_t*>(packed.data);
  p.packed_row_stride = packed.strides[0];
  p.scales = static_cast<uint8_t*>(scales.data);
  p.scale_row_stride = scales.strides[0];
  p.scale = global_scale;
  p.recipe = options_.recipe;
  if (p.rows == 0 || p.cols == 0) return absl::OkStatus();
  if (!options_.device.is_cuda()) {
    internal::ReferenceQuantizeLinear(p);
    return absl::OkStatus();
  }
  return internal::LaunchQuantizeLinear(p, stream);
}

absl::Status LinearQuantizer::Dequantize(const TensorView& packed, const TensorView& scales,
                                         const TensorView& output, GlobalScale global_scale,
                                         Stream stream) const {
  if (!created_) return NotCreated("LinearQuantizer");
  FP4KV_RETURN_IF_ERROR(
      CheckLinear(output, "output", options_.dtype, packed, scales, options_.device));
  FP4KV_RETURN_IF_ERROR(CheckGlobalScale(global_scale, "global_scale"));
  internal::LinearDequantParams p;
  p.packed = static_cast<const uint8_t*>(packed.data);
  p.packed_row_stride = packed.strides[0];
  p.scales = static_cast<const uint8_t*>(scales.data);
  p.scale_row_stride = scales.strides[0];
  p.rows = output.shape[0];
  p.cols = output.shape[1];
  p.output = output.data;
  p.output_row_stride = output.strides[0];
  p.dtype = options_.dtype;
  p.scale = global_scale;
  if (p.rows == 0 || p.cols == 0) return absl::OkStatus();
  if (!options_.device.is_cuda()) {
    internal::ReferenceDequantizeLinear(p);
    return absl::OkStatus();
  }
  return internal::LaunchDequantizeLinear(p, stream);
}

// ------------------------------------------------------ PagedCacheQuantizer
absl::StatusOr<HalfPagedCache> HalfPagedCache::FromStacked(const TensorView& kv, Layout layout) {
  FP4KV_RETURN_IF_ERROR(internal::CheckRank(kv, "source", 5));
  if (kv.shape[1] != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "source: expected 2 (K and V) on dimension 1 of the stacked form, got shape ",
        kv.ShapeString()));
  }
  return HalfPagedCache{kv.Select(1, 0), kv.Select(1, 1), layout};
}

absl::StatusOr<PagedCacheQuantizer> PagedCacheQuantizer::Create(const Options& o) {
  FP4KV_RETURN_IF_ERROR(internal::CheckFloatDType(o.input_dtype, "options.input_dtype"));
  if (o.source_layout != Layout::kNHD && o.source_layout != Layout::kHND) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.source_layout: expected kNHD or kHND, got ", static_cast<int>(o.source_layout)));
  }
  if (o.compute_scales && !(o.headroom >= 1.0f && std::isfinite(o.headroom))) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.headroom: expected finite and >= 1, got ", o.headroom));
  }
  FP4KV_RETURN_IF_ERROR(ValidateRecipe(o.recipe));
  FP4KV_RETURN_IF_ERROR(CheckCommonOptions(o.geometry, o.device));
  FP4KV_RETURN_IF_ERROR(LoadOn(
      o.device, [&] { return internal::LoadQuantizeCacheKernels(o.input_dtype, o.recipe); }));
  return PagedCacheQuantizer(o);
}

namespace internal {
absl::StatusOr<QuantizeCacheParams> MakeQuantizeCacheParams(const PagedCacheQuantizer::Options& o,
                                                            const QuantizeCacheArgs& a,
                                                            const PagedCache& cache) {
  const CacheGeometry& g = o.geometry;
  const Device& dev = o.device;
  QuantizeCacheParams p;
  FP4KV_RETURN_IF_ERROR(CheckCache(cache, g, dev, &p.k, &p.v));
  if (a.source.layout != o.source_layout) {
    return absl::InvalidArgumentError(absl::StrCat("source.layout: expected ",
                                                   LayoutName(o.source_layout), ", got ",
                                                   LayoutName(a.source.layout)));
  }
  const bool nhd = o.source_layout == Layout::kNHD;
  FP4KV_RETURN_IF_ERROR(CheckGiven(a.source.k, "source.k"));
  FP4KV_RETURN_IF_ERROR(internal::CheckRank(a.source.k, "source.k", 4));
  const int64_t src_pages = a.source.k.shape[0];
  const int64_t S = g.page_size, H = g.num_kv_heads;
  for (const auto& [t, name, dim] :
       {std::tuple<const TensorView&, const char*, int>{a.source.k, "source.k", g.head_dim_k},
        std::tuple<const TensorView&, const char*, int>{a.source.v, "source.v", g.head_dim_v}}) {
    FP4KV_RETURN_IF_ERROR(CheckGiven(t, name));
    FP4KV_RETURN_IF_ERROR(CheckDType(t, name, {o.input_dtype}));
    FP4KV_RETURN_IF_ERROR(CheckShape(t, name, {src_pages, nhd ? S : H, nhd ? H : S, dim}));
    FP4KV_RETURN_IF_ERROR(CheckInnerContiguous(t, name));
    FP4KV_RETURN_IF_ERROR(CheckAligned(t, name, 16));
    FP4KV_RETURN_IF_ERROR(CheckDevice(t, name, dev));
  }
  const bool lists = !a.src_pages.empty() || !a.dst_pages.empty();
  int64_t pages = src_pages;
  if (lists) {
    FP4KV_RETURN_IF_ERROR(CheckIndexVector(a.src_pages, "src_pages", DType::kI32, kAny, dev));
    pages = a.src_pages.shape[0];
    FP4KV_RETURN_IF_ERROR(CheckIndexVector(a.dst_pages, "dst_pages", DType::kI32, pages, dev));
    p.src_pages = a.src_pages.ptr<const int32_t>();
    p.dst_pages = a.dst_pages.ptr<const int32_t>();
  } else if (src_pages > g.num_pages) {
    return absl::InvalidArgumentError(absl::StrCat(
        "source.k: expected at most the cache's ", g.num_pages,
        " pages (without src_pages / dst_pages page p goes to cache page p), got shape ",
        a.source.k.ShapeString()));
  }
  const int64_t slots = pages * S;
  if (a.num_tokens < -1 || a.num_tokens > slots) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens: expected -1 or in [0, ", slots,
                                                   "] (pages * page_size), got ", a.num_tokens));
  }
  p.rows = a.num_tokens < 0 ? slots : a.num_tokens;
  if (o.compute_scales) {
    for (const auto& [ptr, name] : {std::pair<float*, const char*>{a.k_scale_out, "k_scale_out"},
                                    std::pair<float*, const char*>{a.v_scale_out, "v_scale_out"}}) {
      if (ptr == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": expected a pointer to one float (options.compute_scales is on), got null"));
      }
      if (reinterpret_cast<uintptr_t>(ptr) % 4 != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": expected a 4-byte aligned pointer, got a misaligned one"));
      }
    }
    if (a.k_scale_out == a.v_scale_out) {
      return absl::InvalidArgumentError(
          "v_scale_out: expected a pointer distinct from k_scale_out, got the same address");
    }
    p.compute_scales = true;
    p.zero_first = true;
    p.amax_bits[0] = reinterpret_cast<uint32_t*>(a.k_scale_out);
    p.amax_bits[1] = reinterpret_cast<uint32_t*>(a.v_scale_out);
    p.scale_out[0] = a.k_scale_out;
    p.scale_out[1] = a.v_scale_out;
    p.headroom = o.headroom;
    p.k_scale = GlobalScale::Pointer(a.k_scale_out);
    p.v_scale = GlobalScale::Pointer(a.v_scale_out);
  } else {
    if (a.k_scale_out != nullptr || a.v_scale_out != nullptr) {
      return absl::InvalidArgumentError(
          "k_scale_out: expected null pointers (options.compute_scales is off), got a pointer");
    }
    FP4KV_RETURN_IF_ERROR(CheckGlobalScale(a.k_scale, "k_scale"));
    FP4KV_RETURN_IF_ERROR(CheckGlobalScale(a.v_scale, "v_scale"));
    p.k_scale = a.k_scale;
    p.v_scale = a.v_scale;
  }
  const int ei = nhd ? 1 : 2, hi = nhd ? 2 : 1;
  p.k_src = a.source.k.data;
  p.v_src = a.source.v.data;
  p.k_src_page = a.source.k.strides[0];
  p.k_src_entry = a.source.k.strides[ei];
  p.k_src_head = a.source.k.strides[hi];
  p.v_src_page = a.source.v.strides[0];
  p.v_src_entry = a.source.v.strides[ei];
  p.v_src_head = a.source.v.strides[hi];
  p.dtype = o.input_dtype;
  p.src_num_pages = src_pages;
  p.num_heads = g.num_kv_heads;
  p.page_size = g.page_size;
  p.num_pages = g.num_pages;
  p.recipe = o.recipe;
  p.fp8_keys = g.fp8_keys();
  return p;
}
}  // namespace internal

absl::Status PagedCacheQuantizer::Run(const QuantizeCacheArgs& a, const PagedCache& cache,
                                      Stream stream) const {
  absl::StatusOr<internal::QuantizeCacheParams> p =
      internal::MakeQuantizeCacheParams(options_, a, cache);
  if (!p.ok()) return p.status();
  if (!options_.device.is_cuda()) {
    internal::ReferenceQuantizeCache(*p);
    return absl::OkStatus();
  }
  return internal::LaunchQuantizeCache(*p, stream);
}

// ------------------------------------------------------------ functional API
namespace {

// Create + Run of an Appender whose options come from the cache and the key.
absl::Status AppendOnce(AppendIndexing indexing, const AppendArgs& a, const PagedCache& cache,
                        const Recipe& recipe, Stream stream) {
  absl::StatusOr<CacheGeometry> g = cache.Geometry();
  if (!g.ok()) return g.status();
  FP4KV_RETURN_IF_ERROR(internal::CheckFloatDType(a.key.dtype, "append_key"));
  absl::StatusOr<Appender> op =
      Appender::Create({*g, a.key.dtype, indexing, recipe, cache.k_data.device});
  if (!op.ok()) return op.status();
  return op->Run(a, cache, stream);
}

}  // namespace

absl::Status QuantizeAppendPaged(const TensorView& append_key, const TensorView& append_value,
                                 const TensorView& batch_indices, const TensorView& positions,
                                 const PagedCache& cache, const TensorView& kv_indices,
                                 const TensorView& kv_indptr, const TensorView& kv_last_page_len,
                                 GlobalScale k_scale, GlobalScale v_scale, const Recipe& recipe,
                                 Stream stream) {
  AppendArgs a;
  a.key = append_key;
  a.value = append_value;
  a.batch_indices = batch_indices;
  a.positions = positions;
  a.kv_indices = kv_indices;
  a.kv_indptr = kv_indptr;
  a.kv_last_page_len = kv_last_page_len;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  return AppendOnce(AppendIndexing::kPaged, a, cache, recipe, stream);
}

absl::Status QuantizeAppendBySlot(const TensorView& append_key, const TensorView& append_value,
                                  const TensorView& slot_mapping, const PagedCache& cache,
                                  GlobalScale k_scale, GlobalScale v_scale, const Recipe& recipe,
                                  Stream stream) {
  AppendArgs a;
  a.key = append_key;
  a.value = append_value;
  a.slot_mapping = slot_mapping;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  return AppendOnce(AppendIndexing::kSlot, a, cache, recipe, stream);
}

absl::Status DequantizePaged(const PagedCache& cache, const TensorView& block_tables,
                             const TensorView& seq_lens, const TensorView& k_out,
                             const TensorView& v_out, GlobalScale k_scale, GlobalScale v_scale,
                             Stream stream) {
  absl::StatusOr<CacheGeometry> g = cache.Geometry();
  if (!g.ok()) return g.status();
  FP4KV_RETURN_IF_ERROR(internal::CheckFloatDType(k_out.dtype, "k_out"));
  FP4KV_RETURN_IF_ERROR(CheckTableDType(block_tables.dtype, "block_tables"));
  absl::StatusOr<Dequantizer> op =
      Dequantizer::Create({*g, k_out.dtype, block_tables.dtype, cache.k_data.device});
  if (!op.ok()) return op.status();
  return op->Run({block_tables, seq_lens, k_out, v_out, k_scale, v_scale}, cache, stream);
}

absl::Status MaterializeFp8(const PagedCache& cache, const TensorView& block_tables,
                            const TensorView& seq_lens, const TensorView& kv_page_indptr,
                            const TensorView& out, const TensorView& fp8_block_tables,
                            GlobalScale k_scale, GlobalScale v_scale, GlobalScale k_fp8_scale,
                            GlobalScale v_fp8_scale, Stream stream) {
  absl::StatusOr<CacheGeometry> g = cache.Geometry();
  if (!g.ok()) return g.status();
  FP4KV_RETURN_IF_ERROR(CheckTableDType(block_tables.dtype, "block_tables"));
  if (block_tables.ndim != 2 && block_tables.ndim != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block_tables: expected rank 2 ([B, max_pages]) or 3 ([B, 2, max_pages]), got rank ",
        block_tables.ndim));
  }
  absl::StatusOr<Materializer> op =
      Materializer::Create({*g, block_tables.dtype, block_tables.ndim == 3, cache.k_data.device});
  if (!op.ok()) return op.status();
  return op->Run({block_tables, seq_lens, kv_page_indptr, out, fp8_block_tables, k_scale, v_scale,
                  k_fp8_scale, v_fp8_scale},
                 cache, stream);
}

absl::Status QuantizePagedCache(const HalfPagedCache& source, const PagedCache& cache,
                                GlobalScale k_scale, GlobalScale v_scale, float* k_scale_out,
                                float* v_scale_out, const Recipe& recipe, Stream stream) {
  absl::StatusOr<CacheGeometry> g = cache.Geometry();
  if (!g.ok()) return g.status();
  FP4KV_RETURN_IF_ERROR(internal::CheckFloatDType(source.k.dtype, "source.k"));
  PagedCacheQuantizer::Options o;
  o.geometry = *g;
  o.source_layout = source.layout;
  o.input_dtype = source.k.dtype;
  o.recipe = recipe;
  o.device = cache.k_data.device;
  o.compute_scales = k_scale_out != nullptr || v_scale_out != nullptr;
  absl::StatusOr<PagedCacheQuantizer> op = PagedCacheQuantizer::Create(o);
  if (!op.ok()) return op.status();
  QuantizeCacheArgs a;
  a.source = source;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.k_scale_out = k_scale_out;
  a.v_scale_out = v_scale_out;
  return op->Run(a, cache, stream);
}

absl::Status QuantizeLinear(const TensorView& input, const TensorView& packed,
                            const TensorView& scales, GlobalScale global_scale,
                            const Recipe& recipe, Stream stream) {
  FP4KV_RETURN_IF_ERROR(internal::CheckFloatDType(input.dtype, "input"));
  absl::StatusOr<LinearQuantizer> op = LinearQuantizer::Create({input.dtype, recipe, input.device});
  if (!op.ok()) return op.status();
  return op->Quantize(input, packed, scales, global_scale, stream);
}

absl::Status DequantizeLinear(const TensorView& packed, const TensorView& scales,
                              const TensorView& output, GlobalScale global_scale, Stream stream) {
  FP4KV_RETURN_IF_ERROR(internal::CheckFloatDType(output.dtype, "output"));
  absl::StatusOr<LinearQuantizer> op =
      LinearQuantizer::Create({output.dtype, Recipe(), output.device});
  if (!op.ok()) return op.status();
  return op->Dequantize(packed, scales, output, global_scale, stream);
}

}  // namespace fp4kv
