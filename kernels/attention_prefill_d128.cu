// Prefill attention kernels of head dim 128 (kernels/attention/prefill.cuh,
// kernels/attention/prefill_sm90.cuh),
// one translation unit per head dim.
#include "kernels/attention/prefill_launch.cuh"

namespace fp4kv {
namespace internal {
FP4KV_INSTANTIATE_ATTENTION_PREFILL_DIM(128)
}  // namespace internal
}  // namespace fp4kv
