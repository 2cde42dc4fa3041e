// Internal device helpers shared by the kernels: 8/16-byte vector accesses,
// byte permutes, packed 16-bit max, fast division by a launch constant.
//
// Everything here is FP4KV_HD: on the device it maps to one or a few
// instructions; on the host it is a plain C++ emulation with the same result,
// so the kernels' per-thread bodies can run on the CPU in tests
// (tests/kernels_host_test.cc) against the CPU reference.
#ifndef FP4KV_KERNELS_DEVICE_UTIL_CUH_
#define FP4KV_KERNELS_DEVICE_UTIL_CUH_

#include <cstdint>
#include <cstring>

#include "fp4kv/format.h"
#include "src/params.h"

namespace fp4kv {
namespace kernels {

// Work items of one launch stay below 2^30, so 32-bit item arithmetic in the
// kernels never wraps (cta * items_per_cta + item < 2^31).
inline constexpr uint32_t kMaxLaunchItems = 1u << 30;

// Launch shape of the row-tiled kernels (append, dequantize, materialize):
// every row (token, page) has the same `items` work items; CTA (x, y) runs
// items [y * threads, (y + 1) * threads) of rows [x * rows_per_cta, ...).
// A thread computes its item's fixed offsets once and loops over the rows.
struct TileShape {
  uint32_t threads = 32;
  uint32_t rows_per_cta = 1;
  uint32_t grid_x = 0;
  uint32_t grid_y = 0;
};

inline constexpr uint32_t kMaxTileThreads = 256;

// False when the items of one row need more than 65535 CTAs.
inline bool MakeTileShape(int64_t items, int64_t rows, uint32_t rows_per_cta, TileShape* t) {
  if (items <= 0 || rows < 0) return false;
  const int64_t threads = items >= kMaxTileThreads ? kMaxTileThreads : (items + 31) / 32 * 32;
  const int64_t grid_y = (items + threads - 1) / threads;
  if (grid_y > 65535) return false;
  t->threads = static_cast<uint32_t>(threads);
  t->rows_per_cta = rows_per_cta;
  t->grid_y = static_cast<uint32_t>(grid_y);
  t->grid_x = static_cast<uint32_t>((rows + rows_per_cta - 1) / rows_per_cta);
  return true;
}

// Rows per CTA (the ForEach*Launch functions take an override for tests): a
// few for large launches (fixed offsets computed once per
// thread serve several rows), one for small ones (latency: spread the rows).
inline uint32_t RowsPerCta(int64_t rows) { return rows >= 8192 ? 8 : rows >= 1024 ? 2 : 1; }

struct alignas(16) U32x4 {
  uint32_t x, y, z, w;
};
struct alignas(8) U32x2 {
  uint32_t x, y;
};

// 16-byte read-only load that allocates in L1: a thread reading two halves
// of a 32-byte sector with two such loads fetches the sector from L2 once.
FP4KV_HD U32x4 LoadInput16(const void* p) {
#if defined(__CUDA_ARCH__)
  const uint4 v = __ldg(static_cast<const uint4*>(p));
  return U32x4{v.x, v.y, v.z, v.w};
#else
  U32x4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#endif
}

// 4-byte read-only load; `p` must be 4-byte aligned.
FP4KV_HD uint32_t LoadReadOnly4(const void* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(static_cast<const unsigned int*>(p));
#else
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#endif
}

// 8-byte read-only load; `p` must be 8-byte aligned.
FP4KV_HD U32x2 LoadReadOnly8(const void* p) {
#if defined(__CUDA_ARCH__)
  U32x2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
#else
  U32x2 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#endif
}

FP4KV_HD uint8_t LoadReadOnly1(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

// Loads that may see data written earlier in the same stream (index tensors,
// scales) use plain loads.
template <typename T>
FP4KV_HD T LoadPlain(const T* p) {
  return *p;
}

// 16-byte store; `p` must be 16-byte aligned. Explicit vector instruction:
// the compiler may otherwise split it into four 4-byte stores. Outputs are
// never read back by the thread that writes them, so no memory clobber.
FP4KV_HD void Store16(void* p, const U32x4& v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w));
#else
  std::memcpy(p, &v, sizeof(v));
#endif
}

// 8-byte store; `p` must be 8-byte aligned.
FP4KV_HD void Store8(void* p, const U32x2& v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y));
#else
  std::memcpy(p, &v, sizeof(v));
#endif
}

// Warp-staged 16-byte stores. A lane holding kC consecutive 16-byte chunks
// of output (chunk j for dst + 16 j) that stored them itself would make each
// store instruction of the warp write 32 sectors by halves (kC = 2) or
// quarters (kC = 4), and the L2 would take every sector kC times (measured on
// the H200: the linear dequantize written that way, kC = 2, took 66 us where
// the kernel before it took 51 us, with the L2 at 85% of its throughput and
// DRAM at 49%; staged it takes 49-51 us). Staged, the warp passes its 32 kC chunks
// through shared memory and store instruction i writes chunks 32 i .. 32 i +
// 31 of the warp's order (lane l: chunk (32 i + l) % kC of lane (32 i + l) /
// kC), so that lanes whose destinations follow each other write whole
// sectors. `write`: whether this lane's chunks are stored at all. Every lane
// of the warp must call it at the same point (no lane may have left). On the
// host (the tests' grid emulation) each lane stores its own chunks.
template <int kC>
FP4KV_HD void WarpStagedStore16(uint8_t* dst, bool write, const U32x4 (&chunks)[kC]) {
  static_assert(kC >= 2, "one chunk a lane is already a contiguous warp store");
#if defined(__CUDA_ARCH__)
  __shared__ U32x4 stage[kMaxTileThreads / 32][32 * kC];
  const uint32_t lane = threadIdx.x & 31u;
  U32x4* const w = stage[threadIdx.x >> 5];
  const uint32_t writers = __ballot_sync(0xffffffffu, write);
  if (writers == 0) return;
  FP4KV_UNROLL
  for (int j = 0; j < kC; ++j) w[lane * kC + j] = chunks[j];
  __syncwarp();
  const unsigned long long d = reinterpret_cast<unsigned long long>(dst);
  FP4KV_UNROLL
  for (int i = 0; i < kC; ++i) {
    const uint32_t c = 32u * i + lane;
    const uint32_t src = c / kC;
    const unsigned long long ds = __shfl_sync(0xffffffffu, d, static_cast<int>(src));
    if ((writers >> src) & 1u) Store16(reinterpret_cast<uint8_t*>(ds) + 16 * (c % kC), w[c]);
  }
  __syncwarp();
#else
  if (!write) return;
  for (int j = 0; j < kC; ++j) Store16(dst + 16 * j, chunks[j]);
#endif
}

// Byte permute with PTX prmt.b32 default-mode semantics: bytes 0..3 of `a`
// and 4..7 of `b`; output byte n is chosen by selector nibble n: its low 3
// bits pick the source byte, its bit 3 asks for the source byte's sign bit
// replicated over all 8 bits. Only the low 16 bits of `sel` are used.
FP4KV_HD uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#else
  const uint64_t src = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t d = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t nib = (sel >> (4 * n)) & 0xfu;
    uint32_t byte = static_cast<uint32_t>(src >> (8 * (nib & 7u))) & 0xffu;
    if (nib & 8u) byte = (byte & 0x80u) ? 0xffu : 0x00u;
    d |= byte << (8 * n);
  }
  return d;
#endif
}

// Unsigned max of each 16-bit half.
FP4KV_HD uint32_t MaxU16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#elif defined(__CUDA_ARCH__)
  return __vmaxu2(a, b);
#else
  const uint32_t lo = (a & 0xffffu) > (b & 0xffffu) ? (a & 0xffffu) : (b & 0xffffu);
  const uint32_t hi = (a >> 16) > (b >> 16) ? (a >> 16) : (b >> 16);
  return lo | (hi << 16);
#endif
}

FP4KV_HD uint32_t MulHiU32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// Division of n < 2^31 by a divisor 1 <= d < 2^31 fixed at launch:
// q = (mulhi(n, m) + n) >> s with s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1.
struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  static FastDivmod Make(uint32_t d) {
    FastDivmod f;
    f.divisor = d;
    uint32_t s = 0;
    while ((uint64_t{1} << s) < d) ++s;
    f.shift = s;
    f.multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << s) - d)) / d + 1);
    return f;
  }
  FP4KV_HD uint32_t Div(uint32_t n) const { return (MulHiU32(n, multiplier) + n) >> shift; }
  // Returns n / d and sets *rem = n % d.
  FP4KV_HD uint32_t DivMod(uint32_t n, uint32_t* rem) const {
    const uint32_t q = Div(n);
    *rem = n - q * divisor;
    return q;
  }
};

// Field-wise choice of K's or V's pool (a reference chosen at run time would
// force the kernel parameters into local memory).
FP4KV_HD internal::PoolPtrs SelectPool(const internal::PoolPtrs& k, const internal::PoolPtrs& v,
                                       bool is_v) {
  internal::PoolPtrs r;
  r.data = is_v ? v.data : k.data;
  r.scales = is_v ? v.scales : k.scales;
  r.data_page = is_v ? v.data_page : k.data_page;
  r.data_entry = is_v ? v.data_entry : k.data_entry;
  r.data_head = is_v ? v.data_head : k.data_head;
  r.scale_page = is_v ? v.scale_page : k.scale_page;
  r.scale_entry = is_v ? v.scale_entry : k.scale_entry;
  r.scale_head = is_v ? v.scale_head : k.scale_head;
  r.head_dim = is_v ? v.head_dim : k.head_dim;
  return r;
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_DEVICE_UTIL_CUH_
