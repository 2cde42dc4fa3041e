// Paged-cache quantization kernels and their launcher (quantize_cache.cuh).
#include "absl/status/status.h"
#include "kernels/quantize_cache.cuh"
#include "src/cuda_util.h"
#include "src/params.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {
namespace {

using kernels::QuantizeCacheLaunch;
using kernels::RecipeVariant;

template <bool kBf16, RecipeVariant kVariant, bool kPair>
__global__ void __launch_bounds__(kernels::kMaxTileThreads)
    QuantizeCacheKernel(const QuantizeCacheLaunch a) {
  kernels::QuantizeCacheThreadT<kBf16, kVariant, kPair>(a, blockIdx.x, blockIdx.y, threadIdx.x);
}

// Warp maxima of the per-thread amax, added with one integer max per side
// (the bits of non-negative floats order like their values).
template <bool kBf16>
__global__ void __launch_bounds__(kernels::kMaxTileThreads)
    CacheAmaxKernel(const QuantizeCacheLaunch a) {
  float k, v;
  kernels::CacheAmaxThread<kBf16>(a, blockIdx.x, blockIdx.y, threadIdx.x, &k, &v);
  for (int off = 16; off > 0; off >>= 1) {
    k = fmaxf(k, __shfl_xor_sync(0xffffffffu, k, off));
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  }
  if ((threadIdx.x & 31) != 0) return;
  if (k > 0.0f) atomicMax(a.p.amax_bits[0], __float_as_uint(k));
  if (v > 0.0f) atomicMax(a.p.amax_bits[1], __float_as_uint(v));
}

__global__ void CacheAmaxZeroKernel(uint32_t* __restrict__ d_k,   // [1]
                                    uint32_t* __restrict__ d_v) {  // [1]
  *d_k = 0;
  *d_v = 0;
}

__global__ void CacheScalesFinishKernel(const QuantizeCacheParams p) {
  kernels::FinishCacheScalesFromBits(p);
}

using QuantizeCacheFn = void (*)(QuantizeCacheLaunch);

template <bool kBf16, bool kPair>
QuantizeCacheFn PickQuantizeCacheKernel(RecipeVariant v) {
  switch (v) {
    case RecipeVariant::kStandard:
      return QuantizeCacheKernel<kBf16, RecipeVariant::kStandard, kPair>;
    case RecipeVariant::kMae:
      return QuantizeCacheKernel<kBf16, RecipeVariant::kMae, kPair>;
    case RecipeVariant::kMse:
      return QuantizeCacheKernel<kBf16, RecipeVariant::kMse, kPair>;
    case RecipeVariant::kMaeHalf:
      return QuantizeCacheKernel<kBf16, RecipeVariant::kMaeHalf, kPair>;
    case RecipeVariant::kMseHalf:
      return QuantizeCacheKernel<kBf16, RecipeVariant::kMseHalf, kPair>;
  }
  return nullptr;
}

}  // namespace

// Rows per CTA: a whole cache has many rows, so each thread keeps its block
// for 32 rows and its setup (block, pointers, scale) is paid less often.
uint32_t QuantizeCacheRowsPerCta(int64_t rows) { return rows >= (1 << 17) ? 32 : 0; }

absl::Status LoadQuantizeCacheKernels(DType input_dtype, const Recipe& recipe) {
  const RecipeVariant v = kernels::VariantOf(recipe);
  const bool bf16 = input_dtype == DType::kBF16;
  FP4KV_RETURN_IF_ERROR(LoadKernel(CacheAmaxZeroKernel, "CacheAmaxZeroKernel"));
  FP4KV_RETURN_IF_ERROR(LoadKernel(CacheScalesFinishKernel, "CacheScalesFinishKernel"));
  FP4KV_RETURN_IF_ERROR(
      LoadKernel(bf16 ? CacheAmaxKernel<true> : CacheAmaxKernel<false>, "CacheAmaxKernel"));
  FP4KV_RETURN_IF_ERROR(LoadKernel(
      bf16 ? PickQuantizeCacheKernel<true, true>(v) : PickQuantizeCacheKernel<false, true>(v),
      "QuantizeCacheKernel"));
  return LoadKernel(
      bf16 ? PickQuantizeCacheKernel<true, false>(v) : PickQuantizeCacheKernel<false, false>(v),
      "QuantizeCacheKernel");
}

absl::Status LaunchQuantizeCache(const QuantizeCacheParams& p, Stream stream) {
  const bool bf16 = p.dtype == DType::kBF16;
  const uint32_t per_cta = QuantizeCacheRowsPerCta(p.rows);
  if (!kernels::ForEachQuantizeCacheLaunch(p, [](const QuantizeCacheLaunch&) {})) {
    return absl::InvalidArgumentError(
        "quantize cache: expected num_kv_heads * (head_dim_k + head_dim_v) / 16 <= 2^24 blocks "
        "per row");
  }
  if (p.compute_scales) {
    if (p.zero_first) {
      CacheAmaxZeroKernel<<<1, 1, 0, stream>>>(p.amax_bits[0], p.amax_bits[1]);
    }
    const auto amax_fn = bf16 ? CacheAmaxKernel<true> : CacheAmaxKernel<false>;
    kernels::ForEachQuantizeCacheLaunch(
        p,
        [&](const QuantizeCacheLaunch& a) {
          amax_fn<<<dim3(a.shape.grid_x, a.shape.grid_y), a.shape.threads, 0, stream>>>(a);
        },
        per_cta, kernels::AppendPairPolicy::kNever);
    CacheScalesFinishKernel<<<1, 1, 0, stream>>>(p);
  }
  const RecipeVariant v = kernels::VariantOf(p.recipe);
  kernels::ForEachQuantizeCacheLaunch(
      p,
      [&](const QuantizeCacheLaunch& a) {
        const QuantizeCacheFn fn =
            a.pair ? (bf16 ? PickQuantizeCacheKernel<true, true>(v)
                           : PickQuantizeCacheKernel<false, true>(v))
                   : (bf16 ? PickQuantizeCacheKernel<true, false>(v)
                           : PickQuantizeCacheKernel<false, false>(v));
        fn<<<dim3(a.shape.grid_x, a.shape.grid_y), a.shape.threads, 0, stream>>>(a);
      },
      per_cta);
  return CudaStatus(cudaGetLastError(), "QuantizeCacheKernel launch");
}

}  // namespace internal
}  // namespace fp4kv
