#include "fp4kv/tensor.h"

#include <dlpack/dlpack.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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
void FillContiguousStrides(TensorView& v) {
  int64_t s = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = s;
    s *= v.shape[d];
  }
}
}  // namespace

TensorView TensorView::Contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  for (int64_t s : shape) {
    if (v.ndim == kMaxDims) break;
    v.shape[v.ndim++] = s;
  }
  FillContiguousStrides(v);
  return v;
}

TensorView TensorView::Strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides, Device device) {
  TensorView v = Contiguous(data, dtype, shape, device);
  int d = 0;
  for (int64_t s : strides) {
    if (d == v.ndim) break;
    v.strides[d++] = s;
  }
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
        "DLTensor: unsupported dtype (code ", code, ", bits ", bits,
        "); expected f16, bf16, f32, u8, e4m3, i32 or i64"));
  }
  if (t.device.device_type == kDLCPU || t.device.device_type == kDLCUDAHost) {
    v.device = Device::Cpu();
  } else if (t.device.device_type == kDLCUDA) {
    v.device = Device::Cuda(t.device.device_id);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "DLTensor: unsupported device type ", static_cast<int>(t.device.device_type),
        "; expected CPU, CUDA host or CUDA"));
  }
  v.ndim = t.ndim;
  for (int d = 0; d < t.ndim; ++d) v.shape[d] = t.shape[d];
  if (t.strides != nullptr) {
    for (int d = 0; d < t.ndim; ++d) v.strides[d] = t.strides[d];
  } else {
    FillContiguousStrides(v);
  }
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  return v;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::IsContiguous() const {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != s) return false;
    s *= shape[d];
  }
  return true;
}

TensorView TensorView::Select(int dim, int64_t i) const {
  TensorView v = *this;
  v.data = static_cast<char*>(data) + i * strides[dim] * DTypeSize(dtype);
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
  return absl::StrCat("[", absl::StrJoin(shape, shape + ndim, ", "), "]");
}

}  // namespace fp4kv
