#include "src/validate.h"

#include <cmath>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fp4kv {
namespace internal {

absl::Status CheckExtents(const TensorView& t, const char* name) {
  if (t.ndim < 0 || t.ndim > TensorView::kMaxDims) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": expected rank in [0, ", TensorView::kMaxDims, "], got ",
        t.ndim == -1 ? std::string("an invalid view (too many extents, or strides not matching "
                                   "the extents)")
                     : absl::StrCat("rank ", t.ndim)));
  }
  bool any_zero = false;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected non-negative extents, got shape ", t.ShapeString()));
    }
    if (t.shape[d] == 0) any_zero = true;
  }
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] > 1 && t.strides[d] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected non-negative strides, got ",
                                                     t.strides[d], " on dimension ", d,
                                                     " (shape ", t.ShapeString(), ")"));
    }
  }
  if (t.numel() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": expected an element count within int64, got shape ", t.ShapeString()));
  }
  if (any_zero) return absl::OkStatus();
  // Offset of the last element, then the bytes up to its end.
  int64_t last = 0;
  bool overflow = false;
  for (int d = 0; d < t.ndim && !overflow; ++d) {
    int64_t step = 0;
    overflow = __builtin_mul_overflow(t.shape[d] - 1, t.strides[d], &step) ||
               __builtin_add_overflow(last, step, &last);
  }
  int64_t bytes = 0;
  overflow = overflow || __builtin_add_overflow(last, int64_t{1}, &bytes) ||
             __builtin_mul_overflow(bytes, int64_t{DTypeSize(t.dtype)}, &bytes);
  if (overflow) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected a byte extent within int64, got shape ", t.ShapeString(),
                     " with strides [", absl::StrJoin(t.strides, t.strides + t.ndim, ", "), "]"));
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.data);
  if (base + static_cast<uint64_t>(bytes) < base) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": expected the view's ", bytes, " bytes inside the address space, got address ",
        base));
  }
  return absl::OkStatus();
}

absl::Status CheckGiven(const TensorView& t, const char* name) {
  if (absl::Status s = CheckExtents(t, name); !s.ok()) return s;
  if (t.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected a tensor, got a null pointer"));
  }
  const auto addr = reinterpret_cast<uintptr_t>(t.data);
  if (addr % DTypeSize(t.dtype) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected a pointer aligned to its ",
                                                   DTypeName(t.dtype), " elements (",
                                                   DTypeSize(t.dtype), " bytes), got address ",
                                                   addr));
  }
  return absl::OkStatus();
}

absl::Status CheckDType(const TensorView& t, const char* name, std::initializer_list<DType> allowed) {
  for (DType d : allowed) {
    if (t.dtype == d) return absl::OkStatus();
  }
  std::string names;
  for (DType d : allowed) absl::StrAppend(&names, names.empty() ? "" : " or ", DTypeName(d));
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": expected dtype ", names, ", got ", DTypeName(t.dtype)));
}

absl::Status CheckRank(const TensorView& t, const char* name, int rank) {
  if (absl::Status s = CheckExtents(t, name); !s.ok()) return s;
  if (t.ndim != rank) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected rank ", rank, ", got rank ",
                                                   t.ndim, " (shape ", t.ShapeString(), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckShape(const TensorView& t, const char* name, std::initializer_list<int64_t> shape) {
  const int rank = static_cast<int>(shape.size());
  if (absl::Status s = CheckRank(t, name, rank); !s.ok()) return s;
  int d = 0;
  bool ok = true;
  for (int64_t e : shape) {
    if (e != kAny && t.shape[d] != e) ok = false;
    ++d;
  }
  if (!ok) {
    std::string want = "[";
    d = 0;
    for (int64_t e : shape) {
      absl::StrAppend(&want, d++ ? ", " : "", e == kAny ? std::string("*") : absl::StrCat(e));
    }
    want += "]";
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected shape ", want, ", got ", t.ShapeString()));
  }
  return absl::OkStatus();
}

absl::Status CheckExtentAtMost(const TensorView& t, const char* name, int dim, int64_t max) {
  if (t.shape[dim] > max) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected dimension ", dim,
                                                   " at most ", max, ", got shape ",
                                                   t.ShapeString()));
  }
  return absl::OkStatus();
}

absl::Status CheckInnerContiguous(const TensorView& t, const char* name) {
  if (t.ndim > 0 && t.shape[t.ndim - 1] > 1 && t.strides[t.ndim - 1] != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": expected a contiguous last dimension (stride 1), got stride ", t.strides[t.ndim - 1]));
  }
  return absl::OkStatus();
}

absl::Status CheckAligned(const TensorView& t, const char* name, int bytes) {
  const auto addr = reinterpret_cast<uintptr_t>(t.data);
  if (addr % bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected a ", bytes,
                                                   "-byte aligned pointer, got address ", addr,
                                                   " (", addr % bytes, " past alignment)"));
  }
  const int es = DTypeSize(t.dtype);
  for (int d = 0; d + 1 < t.ndim; ++d) {
    if (t.shape[d] > 1 && (t.strides[d] * es) % bytes != 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected the stride of dimension ", d,
                                                     " to be a multiple of ", bytes, " bytes, got ",
                                                     t.strides[d] * es, " bytes"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDevice(const TensorView& t, const char* name, const Device& device) {
  if (t.device != device) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected device ", device.ToString(),
                                                   ", got ", t.device.ToString()));
  }
  return absl::OkStatus();
}

absl::Status CheckGlobalScale(const GlobalScale& s, const char* name) {
  if (s.ptr != nullptr) return absl::OkStatus();
  if (!IsValidGlobalScale(s.value)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": expected a global scale in (0, ", MaxGlobalScale(),
        "] (positive, with 6 * 448 * g finite), got ", s.value));
  }
  return absl::OkStatus();
}

absl::Status CheckFloatDType(DType t, const char* name) {
  if (t != DType::kF16 && t != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected dtype f16 or bf16, got ", DTypeName(t)));
  }
  return absl::OkStatus();
}

namespace {

// fp8: a pool of FP8 key rows (head_dim bytes, E4M3 or u8) with no scales;
// `scales` must then be absent (an empty view).
absl::Status CheckPool(const TensorView& data, const TensorView& scales, const char* data_name,
                       const char* scale_name, const CacheGeometry& g, int head_dim, bool fp8,
                       const Device& device, PoolPtrs* out) {
  const int64_t rows_a = g.layout == Layout::kNHD ? g.page_size : g.num_kv_heads;
  const int64_t rows_b = g.layout == Layout::kNHD ? g.num_kv_heads : g.page_size;
  const int64_t data_inner = fp8 ? head_dim : head_dim / 2;
  if (fp8 && (scales.data != nullptr || scales.ndim != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        scale_name, ": expected no view (FP8 keys have no block scales), got shape ",
        scales.ShapeString()));
  }
  for (const auto& [t, name, inner] :
       {std::tuple<const TensorView&, const char*, int64_t>{data, data_name, data_inner},
        std::tuple<const TensorView&, const char*, int64_t>{scales, scale_name, head_dim / kBlockSize}}) {
    if (fp8 && &t == &scales) continue;
    if (absl::Status s = CheckGiven(t, name); !s.ok()) return s;
    if (absl::Status s = CheckShape(t, name, {g.num_pages, rows_a, rows_b, inner}); !s.ok()) return s;
    if (absl::Status s = CheckInnerContiguous(t, name); !s.ok()) return s;
    if (absl::Status s = CheckDevice(t, name, device); !s.ok()) return s;
  }
  if (fp8) {
    if (absl::Status s = CheckDType(data, data_name, {DType::kE4M3, DType::kU8}); !s.ok()) return s;
  } else {
    if (absl::Status s = CheckDType(data, data_name, {DType::kU8}); !s.ok()) return s;
    if (absl::Status s = CheckDType(scales, scale_name, {DType::kE4M3, DType::kU8}); !s.ok()) return s;
  }
  if (absl::Status s = CheckAligned(data, data_name, fp8 ? 16 : 8); !s.ok()) return s;
  const int a = g.layout == Layout::kNHD ? 1 : 2;  // entry dim
  const int h = g.layout == Layout::kNHD ? 2 : 1;  // head dim
  out->data = static_cast<uint8_t*>(data.data);
  out->scales = fp8 ? nullptr : static_cast<uint8_t*>(scales.data);
  out->data_page = data.strides[0];
  out->data_entry = data.strides[a];
  out->data_head = data.strides[h];
  out->scale_page = fp8 ? 0 : scales.strides[0];
  out->scale_entry = fp8 ? 0 : scales.strides[a];
  out->scale_head = fp8 ? 0 : scales.strides[h];
  out->head_dim = head_dim;
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckCache(const PagedCache& cache, const CacheGeometry& g, const Device& device,
                        PoolPtrs* k, PoolPtrs* v) {
  if (cache.layout != g.layout) {
    return absl::InvalidArgumentError(absl::StrCat("cache.layout: expected ", LayoutName(g.layout),
                                                   ", got ", LayoutName(cache.layout)));
  }
  if (cache.key_format != g.key_format) {
    return absl::InvalidArgumentError(absl::StrCat("cache.key_format: expected ",
                                                   KeyFormatName(g.key_format), ", got ",
                                                   KeyFormatName(cache.key_format)));
  }
  if (absl::Status s = CheckPool(cache.k_data, cache.k_scales, "cache.k_data", "cache.k_scales", g,
                                 g.head_dim_k, g.fp8_keys(), device, k);
      !s.ok()) {
    return s;
  }
  return CheckPool(cache.v_data, cache.v_scales, "cache.v_data", "cache.v_scales", g, g.head_dim_v,
                   /*fp8=*/false, device, v);
}

}  // namespace internal
}  // namespace fp4kv
