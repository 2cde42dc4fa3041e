// Linear quantize / dequantize kernels and their launchers (see linear.cuh).
#include "absl/status/status.h"
#include "kernels/linear.cuh"
#include "src/cuda_util.h"
#include "src/params.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {
namespace {

using kernels::LinearRange;
using kernels::RecipeVariant;

template <bool kBf16, RecipeVariant kVariant>
__global__ void __launch_bounds__(kernels::kLinearThreads)
    QuantizeLinearKernel(const LinearQuantParams p, const LinearRange range) {
  kernels::QuantizeLinearThread<kBf16, kVariant>(p, range, blockIdx.x, threadIdx.x);
}

template <bool kBf16>
__global__ void __launch_bounds__(kernels::kLinearThreads)
    DequantizeLinearKernel(const LinearDequantParams p, const LinearRange range) {
  kernels::DequantizeLinearThread<kBf16>(p, range, blockIdx.x, threadIdx.x);
}

using QuantKernelFn = void (*)(LinearQuantParams, LinearRange);

template <bool kBf16>
QuantKernelFn PickQuantKernel(RecipeVariant v) {
  switch (v) {
    case RecipeVariant::kStandard:
      return QuantizeLinearKernel<kBf16, RecipeVariant::kStandard>;
    case RecipeVariant::kMae:
      return QuantizeLinearKernel<kBf16, RecipeVariant::kMae>;
    case RecipeVariant::kMse:
      return QuantizeLinearKernel<kBf16, RecipeVariant::kMse>;
    case RecipeVariant::kMaeHalf:
      return QuantizeLinearKernel<kBf16, RecipeVariant::kMaeHalf>;
    case RecipeVariant::kMseHalf:
      return QuantizeLinearKernel<kBf16, RecipeVariant::kMseHalf>;
  }
  return nullptr;
}

absl::Status TooWide() {
  return absl::InvalidArgumentError("linear: expected cols / 16 < 2^30 blocks per row");
}

}  // namespace

absl::Status LoadLinearKernels(DType dtype, const Recipe& recipe) {
  const RecipeVariant v = kernels::VariantOf(recipe);
  const bool bf16 = dtype == DType::kBF16;
  FP4KV_RETURN_IF_ERROR(LoadKernel(bf16 ? PickQuantKernel<true>(v) : PickQuantKernel<false>(v),
                                   "QuantizeLinearKernel"));
  return bf16 ? LoadKernel(DequantizeLinearKernel<true>, "DequantizeLinearKernel")
              : LoadKernel(DequantizeLinearKernel<false>, "DequantizeLinearKernel");
}

absl::Status LaunchQuantizeLinear(const LinearQuantParams& p, Stream stream) {
  const RecipeVariant v = kernels::VariantOf(p.recipe);
  const QuantKernelFn fn =
      p.dtype == DType::kBF16 ? PickQuantKernel<true>(v) : PickQuantKernel<false>(v);
  const bool ok =
      kernels::ForEachLinearLaunch(p.rows, p.cols, kBlockSize, kernels::kLinearItemsPerCta,
                                   [&](const LinearRange& r, uint32_t grid) {
                                     fn<<<grid, kernels::kLinearThreads, 0, stream>>>(p, r);
                                   });
  if (!ok) return TooWide();
  return CudaStatus(cudaGetLastError(), "QuantizeLinearKernel launch");
}

absl::Status LaunchDequantizeLinear(const LinearDequantParams& p, Stream stream) {
  const bool bf16 = p.dtype == DType::kBF16;
  const bool ok = kernels::ForEachLinearLaunch(
      p.rows, p.cols, kernels::kLinearDequantItemValues, kernels::kLinearDequantItemsPerCta,
      [&](const LinearRange& r, uint32_t grid) {
        if (bf16) {
          DequantizeLinearKernel<true><<<grid, kernels::kLinearThreads, 0, stream>>>(p, r);
        } else {
          DequantizeLinearKernel<false><<<grid, kernels::kLinearThreads, 0, stream>>>(p, r);
        }
      });
  if (!ok) return TooWide();
  return CudaStatus(cudaGetLastError(), "DequantizeLinearKernel launch");
}

}  // namespace internal
}  // namespace fp4kv
