// FP8 materialization kernel and its launcher (see materialize.cuh).
#include "absl/status/status.h"
#include "kernels/materialize.cuh"
#include "src/cuda_util.h"
#include "src/params.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {
namespace {

using kernels::MaterializeLaunch;

template <typename Index, bool kFp8Keys>
__global__ void __launch_bounds__(kernels::kMaxTileThreads)
    MaterializeFp8Kernel(const MaterializeLaunch a) {
  kernels::MaterializeThreadT<Index, kFp8Keys>(a, blockIdx.x, blockIdx.y, threadIdx.x);
}

template <bool kFp8Keys>
void LaunchOne(const MaterializeLaunch& a, cudaStream_t stream) {
  const dim3 grid(a.shape.grid_x, a.shape.grid_y);
  if (a.wide_index) {
    MaterializeFp8Kernel<int64_t, kFp8Keys><<<grid, a.shape.threads, 0, stream>>>(a);
  } else {
    MaterializeFp8Kernel<uint32_t, kFp8Keys><<<grid, a.shape.threads, 0, stream>>>(a);
  }
}

}  // namespace

absl::Status LoadMaterializeKernels(bool fp8_keys) {
  // Both index widths: a launch takes the wide one when its tables need it.
  const auto load = [](auto k64, auto k32) -> absl::Status {
    FP4KV_RETURN_IF_ERROR(LoadKernel(k64, "MaterializeFp8Kernel"));
    return LoadKernel(k32, "MaterializeFp8Kernel");
  };
  return fp8_keys ? load(MaterializeFp8Kernel<int64_t, true>, MaterializeFp8Kernel<uint32_t, true>)
                  : load(MaterializeFp8Kernel<int64_t, false>,
                         MaterializeFp8Kernel<uint32_t, false>);
}

absl::Status LaunchMaterialize(const MaterializeParams& p, Stream stream) {
  const bool ok = kernels::ForEachMaterializeLaunch(p, [&](const MaterializeLaunch& a) {
    if (p.fp8_keys) {
      LaunchOne<true>(a, stream);
    } else {
      LaunchOne<false>(a, stream);
    }
  });
  if (!ok) {
    return absl::InvalidArgumentError(
        "materialize: expected num_kv_heads * page_size * head_dim / 16 <= 2^24");
  }
  return CudaStatus(cudaGetLastError(), "MaterializeFp8Kernel launch");
}

}  // namespace internal
}  // namespace fp4kv
