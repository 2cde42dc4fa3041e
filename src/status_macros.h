// Internal: the library's one return-if-error helper, for a Status and for a
// CUDA runtime call.
#ifndef FP4KV_SRC_STATUS_MACROS_H_
#define FP4KV_SRC_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "src/cuda_util.h"

// Returns the status of `expr` (an absl::Status) from the enclosing function
// when it is not OK.
#define FP4KV_RETURN_IF_ERROR(expr)                                 \
  do {                                                              \
    if (absl::Status fp4kv_status_ = (expr); !fp4kv_status_.ok()) { \
      return fp4kv_status_;                                         \
    }                                                               \
  } while (0)

// Returns Internal naming the call (its source text) and the CUDA error
// when the CUDA runtime call `call` does not return cudaSuccess
// (internal::CudaStatus).
#define FP4KV_CUDA_RETURN_IF_ERROR(call)                                                 \
  do {                                                                                   \
    if (absl::Status fp4kv_status_ = ::fp4kv::internal::CudaStatus((call), #call);       \
        !fp4kv_status_.ok()) {                                                           \
      return fp4kv_status_;                                                              \
    }                                                                                    \
  } while (0)

#endif  // FP4KV_SRC_STATUS_MACROS_H_
