// Non-owning tensor views: pointer, dtype, shape, strides (in elements), device.
#ifndef FP4KV_TENSOR_H_
#define FP4KV_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include <dlpack/dlpack.h>

namespace fp4kv {

enum class DType : uint8_t { kF16, kBF16, kF32, kU8, kE4M3, kI32, kI64 };

// Size of one element in bytes.
constexpr int DTypeSize(DType t) {
  return t == DType::kF32 || t == DType::kI32 ? 4
         : t == DType::kI64                   ? 8
         : t == DType::kF16 || t == DType::kBF16 ? 2
                                                  : 1;
}
const char* DTypeName(DType t);

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int ordinal = 0;  // CUDA device ordinal; 0 for the CPU

  static constexpr Device Cpu() { return Device{DeviceType::kCPU, 0}; }
  static constexpr Device Cuda(int ordinal = 0) { return Device{DeviceType::kCUDA, ordinal}; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  friend bool operator==(const Device& a, const Device& b) {
    return a.type == b.type && (a.type == DeviceType::kCPU || a.ordinal == b.ordinal);
  }
  friend bool operator!=(const Device& a, const Device& b) { return !(a == b); }
  std::string ToString() const;
};

// A view of caller-owned memory. Copyable and cheap; it never frees.
// An empty view (data == nullptr, ndim == 0) means "not given".
//
// Building a view checks nothing; every op validates the views it is given
// (rank, non-negative extents and strides, element count and byte extent
// within int64, then what the op needs) and rejects a malformed one by name.
// A builder given more than kMaxDims extents, or a number of strides other
// than the number of extents, returns an invalid view (ndim == -1) that every
// op rejects.
struct TensorView {
  static constexpr int kMaxDims = 6;

  void* data = nullptr;
  DType dtype = DType::kU8;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements
  Device device;

  // A contiguous (row-major) view. The span overloads take any int64
  // sequence, e.g. the std::vector of KVCache::Fp8WorkspaceShape().
  static TensorView Contiguous(void* data, DType dtype, absl::Span<const int64_t> shape,
                               Device device = Device::Cpu());
  static TensorView Contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::Cpu()) {
    return Contiguous(data, dtype, absl::Span<const int64_t>(shape.begin(), shape.size()), device);
  }
  static TensorView Contiguous(const void* data, DType dtype, absl::Span<const int64_t> shape,
                               Device device = Device::Cpu()) {
    return Contiguous(const_cast<void*>(data), dtype, shape, device);
  }
  static TensorView Contiguous(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::Cpu()) {
    return Contiguous(const_cast<void*>(data), dtype, shape, device);
  }
  // A strided view; `strides` in elements, one per extent.
  static TensorView Strided(void* data, DType dtype, absl::Span<const int64_t> shape,
                            absl::Span<const int64_t> strides, Device device = Device::Cpu());
  static TensorView Strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> strides, Device device = Device::Cpu()) {
    return Strided(data, dtype, absl::Span<const int64_t>(shape.begin(), shape.size()),
                   absl::Span<const int64_t>(strides.begin(), strides.size()), device);
  }
  // Wraps a DLPack tensor (byte_offset applied; null strides mean contiguous).
  // InvalidArgument ("DLTensor: expected ...") for an unsupported dtype or
  // device, a null shape with ndim > 0, a byte_offset on a null pointer, or
  // extents and strides that fail the checks every op makes.
  // Supported: float16/bfloat16/float32, uint8, int32, int64 (and float8_e4m3fn
  // where the DLPack header defines it). FP8 scale tensors that arrive as uint8
  // may be retagged with WithDType(DType::kE4M3).
  static absl::StatusOr<TensorView> FromDLPack(const DLTensor& t);

  bool empty() const { return data == nullptr && ndim == 0; }
  // Product of the extents; -1 for an invalid view, a negative extent, or a
  // product past int64.
  int64_t numel() const;
  // Precondition: -ndim <= dim < ndim.
  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  int64_t stride(int dim) const { return strides[dim < 0 ? dim + ndim : dim]; }
  bool IsContiguous() const;
  TensorView WithDType(DType t) const {
    TensorView v = *this;
    v.dtype = t;
    return v;
  }
  // View of index `i` along dimension `dim` (that dimension removed). An
  // invalid view when dim or i is out of range.
  TensorView Select(int dim, int64_t i) const;
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  std::string ShapeString() const;
};

}  // namespace fp4kv

#endif  // FP4KV_TENSOR_H_
