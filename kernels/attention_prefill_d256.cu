// Prefill attention kernels of head dim 256 (kernels/attention/prefill.cuh),
// one translation unit per head dim.
#include "kernels/attention/prefill_launch.cuh"

namespace fp4kv {
namespace internal {
FP4KV_INSTANTIATE_ATTENTION_PREFILL_DIM(256)
}  // namespace internal
}  // namespace fp4kv
