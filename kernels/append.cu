// Quantize-append kernels and their launcher (see append.cuh for the shape).
#include "absl/status/status.h"
#include "kernels/append.cuh"
#include "kernels/attention/ptx.cuh"
#include "kernels/launch_util.cuh"
#include "src/cuda_util.h"
#include "src/params.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {
namespace {

using kernels::AppendLaunch;
using kernels::RecipeVariant;

// Launched as a programmatic dependent (AppendParams::overlap_launch), the
// kernel's CTAs may start while the kernel before it in the stream runs:
// they wait for that grid's completion (and its memory) before reading
// anything, then let the next dependent launch, so that its launch overlaps
// this kernel's work rather than following it. Both are no-ops in an
// ordinary launch.
template <bool kBf16, RecipeVariant kVariant, bool kCount, bool kPair>
__global__ void __launch_bounds__(kernels::kMaxTileThreads)
    QuantizeAppendKernel(const AppendLaunch a) {
  kernels::WaitForPrerequisiteGrids();
  kernels::LaunchDependentGrids();
  kernels::AppendThreadT<kBf16, kVariant, kCount, kPair>(a, blockIdx.x, blockIdx.y, threadIdx.x);
}

using AppendKernelFn = void (*)(AppendLaunch);

template <bool kBf16, bool kCount, bool kPair>
AppendKernelFn PickAppendKernel(RecipeVariant v) {
  switch (v) {
    case RecipeVariant::kStandard:
      return QuantizeAppendKernel<kBf16, RecipeVariant::kStandard, kCount, kPair>;
    case RecipeVariant::kMae:
      return QuantizeAppendKernel<kBf16, RecipeVariant::kMae, kCount, kPair>;
    case RecipeVariant::kMse:
      return QuantizeAppendKernel<kBf16, RecipeVariant::kMse, kCount, kPair>;
    case RecipeVariant::kMaeHalf:
      return QuantizeAppendKernel<kBf16, RecipeVariant::kMaeHalf, kCount, kPair>;
    case RecipeVariant::kMseHalf:
      return QuantizeAppendKernel<kBf16, RecipeVariant::kMseHalf, kCount, kPair>;
  }
  return nullptr;
}

template <bool kPair>
AppendKernelFn PickAppendKernelFor(bool bf16, bool count, RecipeVariant v) {
  return bf16 ? (count ? PickAppendKernel<true, true, kPair>(v)
                       : PickAppendKernel<true, false, kPair>(v))
              : (count ? PickAppendKernel<false, true, kPair>(v)
                       : PickAppendKernel<false, false, kPair>(v));
}

}  // namespace

absl::Status LaunchAppend(const AppendParams& p, Stream stream) {
  const RecipeVariant v = kernels::VariantOf(p.recipe);
  const bool bf16 = p.input_dtype == DType::kBF16;
  const bool count = p.scale_events != nullptr;
  cudaError_t err = cudaSuccess;
  const bool ok = kernels::ForEachAppendLaunch(p, [&](const AppendLaunch& a) {
    const AppendKernelFn fn = a.pair ? PickAppendKernelFor<true>(bf16, count, v)
                                     : PickAppendKernelFor<false>(bf16, count, v);
    if (!p.overlap_launch) {
      fn<<<dim3(a.shape.grid_x, a.shape.grid_y), a.shape.threads, 0, stream>>>(a);
      return;
    }
    const cudaError_t e = kernels::LaunchMaybeProgrammatic(
        fn, dim3(a.shape.grid_x, a.shape.grid_y), dim3(a.shape.threads), 0, stream, true, a);
    if (err == cudaSuccess) err = e;
  });
  if (!ok) {
    return absl::InvalidArgumentError(
        "append: expected num_kv_heads * (head_dim_k + head_dim_v) / 16 <= 2^24 blocks per row");
  }
  FP4KV_CUDA_RETURN_IF_ERROR(err);
  return CudaStatus(cudaGetLastError(), "QuantizeAppendKernel launch");
}

absl::Status LoadAppendKernels(DType input_dtype, const Recipe& recipe, bool count_events) {
  const RecipeVariant v = kernels::VariantOf(recipe);
  const bool bf16 = input_dtype == DType::kBF16;
  FP4KV_RETURN_IF_ERROR(
      LoadKernel(PickAppendKernelFor<true>(bf16, count_events, v), "QuantizeAppendKernel"));
  return LoadKernel(PickAppendKernelFor<false>(bf16, count_events, v), "QuantizeAppendKernel");
}

absl::Status AppendOverlapsLaunch(bool* out) {
  cudaFuncAttributes fa;
  FP4KV_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&fa, PickAppendKernelFor<false>(true, false, RecipeVariant::kStandard)));
  *out = fa.ptxVersion >= 90;
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace fp4kv
