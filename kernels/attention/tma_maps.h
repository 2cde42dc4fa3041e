// Internal: the tensor maps of decode attention's TMA copies (kernels/
// attention/tma.cuh), host-visible: a KVCache's bound attention encodes them
// once per layer when it is bound (src/kv_cache/bound_ops.cc), the launcher
// (kernels/attention/launch.cuh) copies them into the kernel parameters.
#ifndef FP4KV_KERNELS_ATTENTION_TMA_MAPS_H_
#define FP4KV_KERNELS_ATTENTION_TMA_MAPS_H_

#include <cuda.h>

#include <cstdint>

namespace fp4kv {
namespace kernels {

// The tensor maps of one launch (kernel parameter space, aligned as
// CUtensorMap demands; read through __grid_constant__).
struct AttnTmaMaps {
  CUtensorMap kc, vc;  // K codes (NVFP4 or FP8 rows), V codes
  // Bytes a tile's two boxes deliver (the mbarrier's transaction count); 0:
  // the maps could not describe the pools (the launch takes cp.async).
  uint32_t tile_bytes = 0;
};

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_TMA_MAPS_H_
