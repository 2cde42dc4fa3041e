// Internal: tensor-memory-accelerator (TMA) copies of decode attention's
// tiles on sm_90 -- the tensor maps of the K/V code pools and the PTX of the
// copies and of the mbarriers they complete on (the maps are encoded on the
// host by kernels/attention/launch.cuh).
//
// The 16-token tile of one KV head is one box of a 4-d map (row bytes,
// entry, head, page) with the pool's own strides, so NHD and HND pools use
// the same code. A page outside [0, num_pages) is a coordinate outside the
// map: the unit fills the box with zeros and still counts its bytes. Block
// scale rows (D / 16 bytes) are left to cp.async: the tensor unit's cost is
// per box row, and a row of 4-16 bytes would cost it as much as a code row.
#ifndef FP4KV_KERNELS_ATTENTION_TMA_CUH_
#define FP4KV_KERNELS_ATTENTION_TMA_CUH_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/attention/tma_maps.h"

namespace fp4kv {
namespace kernels {

// Byte offset of byte `x` of row t of a tile of `row_bytes`-byte rows that a
// map with swizzle `mode` (0, 2 = 64B, 3 = 128B) wrote to a region aligned
// to the swizzle's repeat (512 / 1024 bytes): the 16-byte chunk index is
// XORed with address bits [7, 9) (64B) or [7, 10) (128B).
template <int kRowBytes, int kMode>
__host__ __device__ __forceinline__ constexpr uint32_t TmaSwizzled(int t, int x) {
  const uint32_t off = static_cast<uint32_t>(t * kRowBytes + x);
  if constexpr (kMode == 2) return off ^ (((off >> 7) & 3u) << 4);
  if constexpr (kMode == 3) return off ^ (((off >> 7) & 7u) << 4);
  return off;
}

// The swizzle the code maps use for rows of `row_bytes`: 128-byte rows (FP8
// keys at d = 128, NVFP4 at d = 256) are read 16 bytes a lane from eight
// rows at once, which would all hit the same banks unswizzled. Shorter rows
// are left in place (measured on an H200: the 64-byte swizzle made NVFP4
// d = 128 slower, its loads being laid out for the plain rows).
__host__ __device__ constexpr int TmaCodeSwizzle(int row_bytes) { return row_bytes == 128 ? 3 : 0; }

// ---------------------------------------------------------------------------
// PTX (sm_90; elsewhere the bodies are empty and never reached: the host
// launches the kernels that use them only on compute capability 9.0 with
// sm_90a code). MbarInit and MbarWait serve the wgmma prefill kernel too.
// ---------------------------------------------------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FP4KV_TMA_ENABLED 1
#endif

__device__ __forceinline__ void MbarInit(uint32_t bar, int count) {
#if defined(FP4KV_TMA_ENABLED)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}

// Makes barrier initializations visible to the async proxy (the TMA unit).
__device__ __forceinline__ void TmaFenceBarrierInit() {
#if defined(FP4KV_TMA_ENABLED)
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Orders this thread's earlier shared-memory accesses (generic proxy)
// before later async-proxy accesses to the same bytes (TMA writes, wgmma
// operand reads). Compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S: it waits
// for the thread's outstanding memory operations.
__device__ __forceinline__ void FenceProxyAsyncShared() {
#if defined(FP4KV_TMA_ENABLED)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void TmaArriveExpectTx(uint32_t bar, uint32_t bytes) {
#if defined(FP4KV_TMA_ENABLED)
  asm volatile(
      "{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(
          bar),
      "r"(bytes)
      : "memory");
#endif
}

// Waits until the phase of parity `parity` of `bar` has completed.
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
#if defined(FP4KV_TMA_ENABLED)
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra MBAR_WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}

// An arrive on `bar` once this thread's earlier cp.async copies have landed
// (counted among the barrier's expected arrivals: .noinc).
__device__ __forceinline__ void CpAsyncMbarArrive(uint32_t bar) {
#if defined(FP4KV_TMA_ENABLED)
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
#endif
}

__device__ __forceinline__ void TmaLoad4d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                          int c2, int c3, uint32_t bar) {
#if defined(FP4KV_TMA_ENABLED)
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
#endif
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_TMA_CUH_
