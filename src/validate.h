// Internal: argument checks shared by every op. Each returns InvalidArgument
// naming the argument, what was expected and what came.
#ifndef FP4KV_SRC_VALIDATE_H_
#define FP4KV_SRC_VALIDATE_H_

#include <cstdint>
#include <initializer_list>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp4kv/geometry.h"
#include "fp4kv/ops.h"
#include "fp4kv/tensor.h"
#include "src/params.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {

// Wildcard for CheckShape.
inline constexpr int64_t kAny = -1;

// A well-formed view: rank in [0, kMaxDims], non-negative extents, a
// non-negative stride on every dimension of extent > 1, an element count and
// a byte extent (1 + sum (shape - 1) * stride elements) within int64, and
// data + byte extent inside the address space. Null data is allowed here.
absl::Status CheckExtents(const TensorView& t, const char* name);
// CheckExtents and a non-null pointer aligned to the element size.
absl::Status CheckGiven(const TensorView& t, const char* name);
absl::Status CheckDType(const TensorView& t, const char* name, std::initializer_list<DType> allowed);
// CheckExtents and the rank.
absl::Status CheckRank(const TensorView& t, const char* name, int rank);
// Extent `dim` of an already shape-checked view is at most `max` (for the
// int fields the kernels index with).
absl::Status CheckExtentAtMost(const TensorView& t, const char* name, int dim, int64_t max);
// Rank and every extent (kAny matches anything).
absl::Status CheckShape(const TensorView& t, const char* name, std::initializer_list<int64_t> shape);
absl::Status CheckInnerContiguous(const TensorView& t, const char* name);
// Pointer and every stride but the last, in bytes, are multiples of `bytes`.
absl::Status CheckAligned(const TensorView& t, const char* name, int bytes);
absl::Status CheckDevice(const TensorView& t, const char* name, const Device& device);
absl::Status CheckGlobalScale(const GlobalScale& s, const char* name);
absl::Status CheckFloatDType(DType t, const char* name);  // f16 or bf16

// Checks a cache's four views against `g` (shape, dtype, contiguous rows,
// 8-byte aligned data rows, device) and fills the pool pointers.
absl::Status CheckCache(const PagedCache& cache, const CacheGeometry& g, const Device& device,
                        PoolPtrs* k, PoolPtrs* v);

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_VALIDATE_H_
