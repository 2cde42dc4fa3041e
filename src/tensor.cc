#include "fp4kv/tensor.h"

#include <dlpack/dlpack.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/validate.h"

namespace fp4kv {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kF32: return "f32";
    case DType::kU8: return "u8";
    case DType::kE4M3: return "e4m3";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
  }
  return "?";
}

std::string Device::ToString() const {
  return type == DeviceType::kCPU ? std::string("cpu") : absl::StrCat("cuda:", ordinal);
}

namespace {

// Row-major strides; the products wrap instead of overflowing (a view whose
// extents overflow is rejected by validation through its byte extent).
void FillContiguousStrides(TensorView& v) {
  uint64_t s = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = static_cast<int64_t>(s);
    s *= static_cast<uint64_t>(v.shape[d]);
  }
}

TensorView InvalidView(void* data, DType dtype, Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = -1;
  return v;
}

}  // namespace

TensorView TensorView::Contiguous(void* data, DType dtype, absl::Span<const int64_t> shape,
                                  Device device) {
  if (shape.size() > static_cast<size_t>(kMaxDims)) return InvalidView(data, dtype, device);
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  for (int64_t s : shape) v.shape[v.ndim++] = s;
  FillContiguousStrides(v);
  return v;
}

TensorView TensorView::Strided(void* data, DType dtype, absl::Span<const int64_t> shape,
                               absl::Span<const int64_t> strides, Device device) {
  if (strides.size() != shape.size()) return InvalidView(data, dtype, device);
  TensorView v = Contiguous(data, dtype, shape, device);
  if (v.ndim < 0) return v;
  for (int d = 0; d < v.ndim; ++d) v.strides[d] = strides[d];
  return v;
}

absl::StatusOr<TensorView> TensorView::FromDLPack(const DLTensor& t) {
  TensorView v;
  if (t.ndim < 0 || t.ndim > kMaxDims) {
    return absl::InvalidArgumentError(
        absl::StrCat("DLTensor: expected ndim in [0, ", kMaxDims, "], got ", t.ndim));
  }
  if (t.dtype.lanes != 1) {
    return absl::InvalidArgumentError(absl::StrCat("DLTensor: expected lanes 1, got ", t.dtype.lanes));
  }
  const int code = t.dtype.code, bits = t.dtype.bits;
  if (code == kDLFloat && bits == 16) v.dtype = DType::kF16;
  else if (code == kDLBfloat && bits == 16) v.dtype = DType::kBF16;
  else if (code == kDLFloat && bits == 32) v.dtype = DType::kF32;
  else if (code == kDLUInt && bits == 8) v.dtype = DType::kU8;
  else if (code == kDLInt && bits == 32) v.dtype = DType::kI32;
  else if (code == kDLInt && bits == 64) v.dtype = DType::kI64;
#if defined(DLPACK_MAJOR_VERSION) && DLPACK_MAJOR_VERSION >= 1
  else if (code == kDLFloat8_e4m3fn && bits == 8) v.dtype = DType::kE4M3;
#endif
  else {
    return absl::InvalidArgumentError(absl::StrCat(
        "DLTensor: expected dtype f16, bf16, f32, u8, e4m3, i32 or i64, got code ", code,
        " with ", bits, " bits"));
  }
  if (t.device.device_type == kDLCPU || t.device.device_type == kDLCUDAHost) {
    v.device = Device::Cpu();
  } else if (t.device.device_type == kDLCUDA) {
    v.device = Device::Cuda(t.device.device_id);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "DLTensor: expected device type CPU, CUDA host or CUDA, got ",
        static_cast<int>(t.device.device_type)));
  }
  if (t.ndim > 0 && t.shape == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("DLTensor: expected a shape array for ndim ", t.ndim, ", got a null pointer"));
  }
  if (t.data == nullptr && t.byte_offset != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DLTensor: expected byte_offset 0 with a null data pointer, got ", t.byte_offset));
  }
  if (t.byte_offset > static_cast<uint64_t>(INT64_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("DLTensor: expected byte_offset within int64, got ", t.byte_offset));
  }
  v.ndim = t.ndim;
  for (int d = 0; d < t.ndim; ++d) v.shape[d] = t.shape[d];
  if (t.strides != nullptr) {
    for (int d = 0; d < t.ndim; ++d) v.strides[d] = t.strides[d];
  } else {
    FillContiguousStrides(v);
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.data);
  if (base + t.byte_offset < base) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DLTensor: expected data + byte_offset inside the address space, got byte_offset ",
        t.byte_offset));
  }
  v.data = t.data == nullptr ? nullptr : static_cast<char*>(t.data) + t.byte_offset;
  if (absl::Status s = internal::CheckExtents(v, "DLTensor"); !s.ok()) return s;
  return v;
}

int64_t TensorView::numel() const {
  if (ndim < 0 || ndim > kMaxDims) return -1;
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] < 0 || __builtin_mul_overflow(n, shape[d], &n)) return -1;
  }
  return n;
}

bool TensorView::IsContiguous() const {
  if (numel() < 0) return false;
  uint64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && static_cast<uint64_t>(strides[d]) != s) return false;
    s *= static_cast<uint64_t>(shape[d]);
  }
  return true;
}

TensorView TensorView::Select(int dim, int64_t i) const {
  if (ndim < 1 || ndim > kMaxDims || dim < 0 || dim >= ndim || i < 0 || i >= shape[dim]) {
    return InvalidView(data, dtype, device);
  }
  TensorView v = *this;
  // Address arithmetic wraps (never UB); validation of the result rejects a
  // view whose byte extent does not fit.
  v.data = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(data) +
                                   static_cast<uint64_t>(i) * static_cast<uint64_t>(strides[dim]) *
                                       static_cast<uint64_t>(DTypeSize(dtype)));
  for (int d = dim; d + 1 < ndim; ++d) {
    v.shape[d] = shape[d + 1];
    v.strides[d] = strides[d + 1];
  }
  v.ndim = ndim - 1;
  v.shape[v.ndim] = 0;
  v.strides[v.ndim] = 0;
  return v;
}

std::string TensorView::ShapeString() const {
  if (ndim < 0 || ndim > kMaxDims) return "[invalid view]";
  return absl::StrCat("[", absl::StrJoin(shape, shape + ndim, ", "), "]");
}

}  // namespace fp4kv
