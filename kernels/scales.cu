// Global-scale kernels of a cache layer: calibration from the rows of its
// first append, and in-place re-encoding of stored blocks (or FP8 key bytes)
// under a new scale.
// Both produce the bits of their CPU references (src/reference/reference.cc):
// the amax is an exact, order-free max and every conversion goes through
// format.h / recipe.h.
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "fp4kv/format.h"
#include "fp4kv/recipe.h"
#include "src/cuda_util.h"
#include "src/params.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {
namespace {

constexpr int kCalibrateThreads = 256;
constexpr int kCalibrateMaxCtas = 128;  // the reduction is one pass over the step's rows
constexpr int kReencodeThreads = 256;

// Largest magnitude (as fp32 bits) of 8 f16/bf16 values in a 16-byte vector;
// NaN halves count as 0.
template <bool kBf16>
__device__ __forceinline__ uint32_t MaxMagnitude8(const uint4 v) {
  const uint32_t nan_above = kBf16 ? 0x7f80u : 0x7c00u;
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t lo = w[j] & 0x7fffu;
    const uint32_t hi = (w[j] >> 16) & 0x7fffu;
    m = max(m, lo > nan_above ? 0u : lo);
    m = max(m, hi > nan_above ? 0u : hi);
  }
  const float f = kBf16 ? Bf16BitsToFloat(static_cast<uint16_t>(m))
                        : HalfBitsToFloat(static_cast<uint16_t>(m));
  return FloatBits(f);  // non-negative: bit order is value order
}

template <bool kBf16>
__global__ void __launch_bounds__(kCalibrateThreads)
    CalibrateRowsKernel(const RowCalibrationParams p) {
  __shared__ int skip[2];
  __shared__ uint32_t block_max[2];
  if (threadIdx.x == 0) {
    skip[0] = p.flags[0];
    skip[1] = p.flags[1];
    block_max[0] = 0;
    block_max[1] = 0;
  }
  __syncthreads();
  // Both sides calibrated (the usual case after the first append): nothing
  // to do, and no CTA of this launch takes a ticket, so the last-CTA
  // finalization below cannot run either.
  if (skip[0] != 0 && skip[1] != 0) return;
  uint32_t m[2] = {0, 0};
  const int vec_k = p.head_dim_k / 8;
  const int vec_v = p.head_dim_v / 8;
  const int per_row = p.num_heads * (vec_k + vec_v);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    if (p.slot_mapping[r] < 0) continue;  // uniform across the CTA
    for (int i = threadIdx.x; i < per_row; i += blockDim.x) {
      const bool is_v = i >= p.num_heads * vec_k;
      if (skip[is_v] != 0) continue;
      const int j = is_v ? i - p.num_heads * vec_k : i;
      const int vec = is_v ? vec_v : vec_k;
      const int h = j / vec;
      const int c = j % vec;
      const uint16_t* base = static_cast<const uint16_t*>(is_v ? p.value : p.key) +
                             r * (is_v ? p.value_row_stride : p.key_row_stride) +
                             h * (is_v ? p.value_head_stride : p.key_head_stride) + 8 * c;
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(base));
      m[is_v] = max(m[is_v], MaxMagnitude8<kBf16>(v));
    }
  }
#pragma unroll
  for (int kv = 0; kv < 2; ++kv) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m[kv] = max(m[kv], __shfl_xor_sync(0xffffffffu, m[kv], o));
    if ((threadIdx.x & 31) == 0 && m[kv] != 0) atomicMax(&block_max[kv], m[kv]);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (block_max[0] != 0) atomicMax(&p.scratch[0], block_max[0]);
  if (block_max[1] != 0) atomicMax(&p.scratch[1], block_max[1]);
  __threadfence();
  const uint32_t ticket = atomicAdd(&p.scratch[2], 1u);
  if (ticket != gridDim.x - 1) return;
  // Last CTA: every other CTA's maximum is visible (fence before the ticket).
  __threadfence();
  for (int kv = 0; kv < 2; ++kv) {
    const float amax = BitsFloat(atomicExch(&p.scratch[kv], 0u));
    if (skip[kv] != 0 || !(amax > 0.0f)) continue;
    const float a = MulRn(amax, p.headroom);
    const bool fp8 = kv == 0 && p.fp8_keys;
    const float g = fp8 ? MakeFp8KeyScale(a) : MakeGlobalScale(a, p.recipe);
    p.scales[kv] = g;
    p.scales[2 + kv] = fp8 ? MinFp8ScaleForFp8Keys(g) : MinFp8ScaleFor(g);
    __threadfence();
    p.flags[kv] = 1;
    if (p.host_flags != nullptr) {
      __threadfence_system();
      *reinterpret_cast<volatile int32_t*>(p.host_flags + kv) = 1;
    }
  }
  p.scratch[2] = 0;
}

__global__ void __launch_bounds__(kReencodeThreads) ReencodeKernel(const ReencodeParams p) {
  const float old_g = *p.old_scale;
  const float new_g = *p.new_scale;
  if (p.fp8_keys) {  // FP8 key bytes, 16 per block
    const float r = Fp8KeyEncodeMultiplier(new_g);
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
         i < p.blocks * kBlockSize; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      p.data[i] = QuantizeFp8Key(DequantFp8Key(p.data[i], old_g), r);
    }
    return;
  }
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.blocks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint2 w = *reinterpret_cast<const uint2*>(p.data + i * kBlockBytes);
    uint32_t packed[2] = {w.x, w.y};
    float x[kBlockSize];
    DequantizeBlock(packed, p.scales[i], old_g, x);
    p.scales[i] = QuantizeBlock(x, new_g, p.recipe, packed);
    *reinterpret_cast<uint2*>(p.data + i * kBlockBytes) = make_uint2(packed[0], packed[1]);
  }
}

}  // namespace

absl::Status LoadScaleKernels() {
  FP4KV_RETURN_IF_ERROR(LoadKernel(CalibrateRowsKernel<true>, "CalibrateRowsKernel"));
  FP4KV_RETURN_IF_ERROR(LoadKernel(CalibrateRowsKernel<false>, "CalibrateRowsKernel"));
  return LoadKernel(ReencodeKernel, "ReencodeKernel");
}

absl::Status LaunchCalibrateRows(const RowCalibrationParams& p, Stream stream) {
  if (p.rows <= 0) return absl::OkStatus();
  const int64_t ctas = p.rows < kCalibrateMaxCtas ? p.rows : kCalibrateMaxCtas;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (p.dtype == DType::kBF16) {
    CalibrateRowsKernel<true><<<static_cast<unsigned>(ctas), kCalibrateThreads, 0, s>>>(p);
  } else {
    CalibrateRowsKernel<false><<<static_cast<unsigned>(ctas), kCalibrateThreads, 0, s>>>(p);
  }
  return CudaStatus(cudaGetLastError(), "CalibrateRowsKernel launch");
}

absl::Status LaunchReencode(const ReencodeParams& p, Stream stream) {
  if (p.blocks <= 0) return absl::OkStatus();
  const int64_t items = p.fp8_keys ? p.blocks * kBlockSize : p.blocks;
  int64_t ctas = (items + kReencodeThreads - 1) / kReencodeThreads;
  if (ctas > 65536) ctas = 65536;
  ReencodeKernel<<<static_cast<unsigned>(ctas), kReencodeThreads, 0,
                   reinterpret_cast<cudaStream_t>(stream)>>>(p);
  return CudaStatus(cudaGetLastError(), "ReencodeKernel launch");
}

}  // namespace internal
}  // namespace fp4kv
