// Paged dequantize kernels and their launcher (see dequantize.cuh).
#include "absl/status/status.h"
#include "kernels/dequantize.cuh"
#include "src/cuda_util.h"
#include "src/params.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {
namespace {

using kernels::DequantLaunch;

template <bool kBf16>
__global__ void __launch_bounds__(kernels::kMaxTileThreads)
    DequantizePagedKernel(const DequantLaunch a) {
  kernels::DequantThread<kBf16>(a, blockIdx.x, blockIdx.y, threadIdx.x);
}

}  // namespace

absl::Status LoadDequantizeKernels(DType output_dtype) {
  return output_dtype == DType::kBF16
             ? LoadKernel(DequantizePagedKernel<true>, "DequantizePagedKernel")
             : LoadKernel(DequantizePagedKernel<false>, "DequantizePagedKernel");
}

absl::Status LaunchDequantize(const DequantParams& p, Stream stream) {
  const bool bf16 = p.output_dtype == DType::kBF16;
  const bool ok = kernels::ForEachDequantLaunch(p, [&](const DequantLaunch& a) {
    const dim3 grid(a.shape.grid_x, a.shape.grid_y);
    if (bf16) {
      DequantizePagedKernel<true><<<grid, a.shape.threads, 0, stream>>>(a);
    } else {
      DequantizePagedKernel<false><<<grid, a.shape.threads, 0, stream>>>(a);
    }
  });
  if (!ok) {
    return absl::InvalidArgumentError(
        "dequantize: expected num_kv_heads * (head_dim_k + head_dim_v) / 16 <= 2^24");
  }
  return CudaStatus(cudaGetLastError(), "DequantizePagedKernel launch");
}

}  // namespace internal
}  // namespace fp4kv
