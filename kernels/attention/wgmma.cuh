// Internal: PTX wrappers of the sm_90a attention kernels: wgmma (warpgroup
// matrix multiply-accumulate from shared memory and registers), its shared
// memory descriptors, mbarriers and the async-proxy fence. The instructions
// exist only in code built for sm_90a (`90a` in CMAKE_CUDA_ARCHITECTURES);
// elsewhere these bodies trap, and the host never launches a kernel that
// reaches them (kernels/attention/prefill_sm90.cuh, SelectPrefillFamily).
#ifndef FP4KV_KERNELS_ATTENTION_WGMMA_CUH_
#define FP4KV_KERNELS_ATTENTION_WGMMA_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/attention/tma.cuh"  // MbarInit, MbarWait, FenceProxyAsyncShared

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FP4KV_WGMMA_ENABLED 1
#endif

namespace fp4kv {
namespace kernels {

// Shared-memory matrix descriptor of a 128-byte-swizzled operand: rows of
// 128 bytes (64 f16), 8-row groups `sbo` bytes apart, 64-element atoms along
// the contiguous dimension `lbo` bytes apart (used by N-major operands only;
// K-major ones keep a wgmma's 16 elements inside one atom). The atom base
// must be 1024-byte aligned; `addr` may point 32-byte steps into a row
// (the k-steps of a K-major operand).
__device__ __forceinline__ uint64_t SmemDescSw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) |
         (static_cast<uint64_t>((lbo >> 4) & 0x3fffu) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3fffu) << 32) | (uint64_t{1} << 62);
}

// Byte offset of 16-byte piece `piece` (0 .. dims / 8 - 1) of row `row` in a
// 128-byte-swizzled tile of `rows` rows: the tile is stored as dims / 64
// regions of rows x 128 bytes, and within a row the piece index (mod 8) is
// XORed with the row index (mod 8) -- the layout both SmemDescSw128 forms
// read.
__device__ __forceinline__ uint32_t Sw128Offset(int rows, int row, int piece) {
  return static_cast<uint32_t>((piece >> 3) * rows * 128 + row * 128 +
                               (((piece & 7) ^ (row & 7)) << 4));
}

__device__ __forceinline__ void WgmmaFence() {
#if defined(FP4KV_WGMMA_ENABLED)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void WgmmaCommit() {
#if defined(FP4KV_WGMMA_ENABLED)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
#if defined(FP4KV_WGMMA_ENABLED)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Keeps the compiler from moving reads or writes of accumulator registers
// across a wgmma that is still in flight (call after WgmmaWait and before
// the wgmma that writes them).
template <int kN>
__device__ __forceinline__ void RegFence(float (&r)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(r[i][e])::"memory");
  }
}


// Named barrier `id` (1..15) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile(
      "{\n"
      ".reg .b64 st;\n"
      "mbarrier.arrive.shared::cta.b64 st, [%0];\n"
      "}\n" ::"r"(bar)
      : "memory");
}

// D (64 x 64, f32) = (scale_d ? D : 0) + A B: A (64 x 16) and B (64 x 16,
// K-major) f16 in shared memory, both through 128-byte-swizzle descriptors.
__device__ __forceinline__ void WgmmaSS64(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b,
                                          int scale_d) {
#if defined(FP4KV_WGMMA_ENABLED)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}"
      ", %32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
  __trap();
#endif
}

// D (64 x 128, f32) = (scale_d ? D : 0) + A B: A (64 x 16) and B (128 x 16,
// K-major) f16 in shared memory, both through 128-byte-swizzle descriptors.
__device__ __forceinline__ void WgmmaSS128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b,
                                          int scale_d) {
#if defined(FP4KV_WGMMA_ENABLED)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}"
      ", %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
  __trap();
#endif
}

// D (64 x 64, f32) += A B: A (64 x 16) f16 in registers (each warp's 16
// rows as the mma.sync m16n8k16 A fragment), B (16 x 64) f16 in shared
// memory with its rows contiguous (N-major: imm-trans-b 1) through a
// 128-byte-swizzle descriptor.
__device__ __forceinline__ void WgmmaRS64(float (&d)[8][4], const uint32_t (&a)[4],
                                          uint64_t desc_b) {
#if defined(FP4KV_WGMMA_ENABLED)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}"
      ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
#else
  (void)d, (void)a, (void)desc_b;
  __trap();
#endif
}

// D (64 x 128, f32) += A B: A (64 x 16) f16 in registers (each warp's 16
// rows as the mma.sync m16n8k16 A fragment), B (16 x 128) f16 in shared
// memory with its rows contiguous (N-major: imm-trans-b 1) through a
// 128-byte-swizzle descriptor.
__device__ __forceinline__ void WgmmaRS128(float (&d)[16][4], const uint32_t (&a)[4],
                                          uint64_t desc_b) {
#if defined(FP4KV_WGMMA_ENABLED)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}"
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
#else
  (void)d, (void)a, (void)desc_b;
  __trap();
#endif
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_WGMMA_CUH_
