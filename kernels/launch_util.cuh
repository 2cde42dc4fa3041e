// Internal: kernel launches as programmatic dependents (PDL), shared by the
// attention and append launchers.
#ifndef FP4KV_KERNELS_LAUNCH_UTIL_CUH_
#define FP4KV_KERNELS_LAUNCH_UTIL_CUH_

#include <cuda_runtime.h>

#include <cstddef>

namespace fp4kv {
namespace kernels {

// Launches fn<<<grid, block, smem, stream>>>(args...) through
// cudaLaunchKernelEx. With `programmatic`, the launch may begin while the
// work before it in the stream runs (programmatic stream serialization):
// the kernel must then wait for its prerequisites itself
// (WaitForPrerequisiteGrids in kernels/attention/ptx.cuh), and the grid
// before it decides when this one may launch (LaunchDependentGrids). Without
// it, this is an ordinary launch. Returns the launch's error.
template <class... Params, class... Args>
cudaError_t LaunchMaybeProgrammatic(void (*fn)(Params...), dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t stream, bool programmatic, const Args&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, fn, args...);
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_LAUNCH_UTIL_CUH_
