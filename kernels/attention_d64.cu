// Decode attention kernels of head dim 64 (one translation unit per head dim
// keeps the builds of the kernel families parallel).
#include "kernels/attention/launch.cuh"

namespace fp4kv {
namespace internal {
FP4KV_INSTANTIATE_ATTENTION_DIM(64)
}  // namespace internal
}  // namespace fp4kv
