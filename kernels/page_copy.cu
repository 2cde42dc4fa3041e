// Whole-page copies between page stores (pools, sequence images, the host
// tier) and the requantization of imported pages; CPU references in
// src/reference/page_copy_reference.cc produce the same bytes.
#include <cuda_runtime_api.h>

#include <atomic>

#include "absl/status/status.h"
#include "fp4kv/format.h"
#include "fp4kv/recipe.h"
#include "src/cuda_util.h"
#include "src/params.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {
namespace {

constexpr int kCopyThreads = 256;
constexpr int64_t kMaxCtas = 4096;
constexpr int kRequantThreads = 256;

// 16-byte words each thread has in flight: 8 x 256 threads cover a whole
// (layer, page) unit of the usual shapes (18 KiB at 8 KV heads, head_dim
// 128, page 16) in one round, so a unit read over PCIe (a promotion from
// the host tier) costs one round trip rather than two.
constexpr int kUnroll = 8;
// At most 64 registers a thread: a copy CTA then takes at most a quarter of
// an SM's register file, so that a decode attention CTA beside it (128
// threads x 128 registers, four to an SM) loses one slot, not two.
constexpr int kCopyCtasPerSm = 4;

// The usual case (every region's page size and base a multiple of 16
// bytes): one CTA copies all four regions of one (layer, page) at a time, as
// one run of 16-byte words with kUnroll loads in flight per thread before
// the stores (scale pages alone are too small to keep a CTA busy).
__global__ void __launch_bounds__(kCopyThreads, kCopyCtasPerSm)
    PageCopyVecKernel(const PageCopyParams p) {
  __shared__ const uint4* src[4];
  __shared__ uint4* dst[4];
  const int64_t w1 = p.page_bytes[0] / 16, w2 = w1 + p.page_bytes[1] / 16,
                w3 = w2 + p.page_bytes[2] / 16, words = w3 + p.page_bytes[3] / 16;
  const int64_t units = p.num_pages * p.num_layers;
  // Region and offset of word k of a unit (recomputed for the stores rather
  // than kept in registers across the loads).
  const auto locate = [&](int64_t k, int* r, int64_t* off) {
    *r = (k >= w1) + (k >= w2) + (k >= w3);
    *off = k - (*r == 0 ? 0 : *r == 1 ? w1 : *r == 2 ? w2 : w3);
  };
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t i = u % p.num_pages;
    const int64_t l = u / p.num_pages;
    if (threadIdx.x < 4) {
      const int r = threadIdx.x;
      const int64_t s = p.SrcPage(i);
      const int64_t d = p.DstPage(i);
      src[r] = reinterpret_cast<const uint4*>(p.src + l * p.src_layer_stride + p.src_region[r] +
                                              s * p.page_bytes[r]);
      dst[r] = reinterpret_cast<uint4*>(p.dst + l * p.dst_layer_stride + p.dst_region[r] +
                                        d * p.page_bytes[r]);
    }
    __syncthreads();
    for (int64_t k0 = threadIdx.x; k0 < words; k0 += kUnroll * blockDim.x) {
      uint4 v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t k = k0 + j * static_cast<int64_t>(blockDim.x);
        int r;
        int64_t off;
        locate(k, &r, &off);
        if (k < words) v[j] = src[r][off];
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t k = k0 + j * static_cast<int64_t>(blockDim.x);
        int r;
        int64_t off;
        locate(k, &r, &off);
        if (k < words) dst[r][off] = v[j];
      }
    }
    __syncthreads();  // before the next unit's pointers
  }
}

// Any other sizes: one CTA copies one (layer, region, page) unit at a time:
// 16-byte words when both addresses and the size allow, else 4-byte words,
// else bytes.
__global__ void __launch_bounds__(kCopyThreads) PageCopyKernel(const PageCopyParams p) {
  const int64_t units = p.num_pages * 4 * p.num_layers;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t i = u % p.num_pages;
    const int r = static_cast<int>((u / p.num_pages) % 4);
    const int64_t l = u / (p.num_pages * 4);
    const int64_t bytes = p.page_bytes[r];
    if (bytes == 0) continue;
    const int64_t s = p.SrcPage(i);
    const int64_t d = p.DstPage(i);
    const uint8_t* from = p.src + l * p.src_layer_stride + p.src_region[r] + s * bytes;
    uint8_t* to = p.dst + l * p.dst_layer_stride + p.dst_region[r] + d * bytes;
    const uintptr_t a = reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to) |
                        static_cast<uintptr_t>(bytes);
    if ((a & 15) == 0) {
      const uint4* f = reinterpret_cast<const uint4*>(from);
      uint4* t = reinterpret_cast<uint4*>(to);
      const int64_t n = bytes / 16;
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x) t[k] = f[k];
    } else if ((a & 3) == 0) {
      const uint32_t* f = reinterpret_cast<const uint32_t*>(from);
      uint32_t* t = reinterpret_cast<uint32_t*>(to);
      const int64_t n = bytes / 4;
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x) t[k] = f[k];
    } else {
      for (int64_t k = threadIdx.x; k < bytes; k += blockDim.x) to[k] = from[k];
    }
  }
}

// SetPageCopyDelayForTesting: one thread spins on the global timer.
__global__ void HoldStreamKernel(int64_t ns) {
  int64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

std::atomic<int64_t> g_copy_delay_us{0};

// Items of one side's page: NVFP4 blocks (one scale byte each) or FP8 key
// bytes.
FP4KV_HD int64_t RequantItemsPerPage(const RequantizePagesParams& p, int kv) {
  return kv == 0 && p.fp8_keys ? p.page_bytes[0] : p.page_bytes[2 + kv];
}

// Thread per item (NVFP4 block, or FP8 key byte) of one side (kv) of every
// listed page of every layer.
__global__ void __launch_bounds__(kRequantThreads)
    RequantizePagesKernel(const RequantizePagesParams p, int kv) {
  const int64_t per_page = RequantItemsPerPage(p, kv);
  const bool fp8 = kv == 0 && p.fp8_keys;
  const int64_t total = p.num_layers * p.num_pages * per_page;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = t % per_page;
    const int64_t i = (t / per_page) % p.num_pages;
    const int64_t l = t / (per_page * p.num_pages);
    const float old_g = p.src_scales[4 * l + kv];
    const float new_g = p.dst_scales[4 * l + kv];
    if (FloatBits(old_g) == FloatBits(new_g)) continue;
    const int64_t page = p.pages[i];
    uint8_t* base = p.pool + l * p.layer_stride;
    if (fp8) {
      uint8_t* c = base + p.region[0] + page * p.page_bytes[0] + b;
      *c = QuantizeFp8Key(DequantFp8Key(*c, old_g), Fp8KeyEncodeMultiplier(new_g));
      continue;
    }
    uint8_t* data = base + p.region[kv] + page * p.page_bytes[kv] + b * kBlockBytes;
    uint8_t* scale = base + p.region[2 + kv] + page * per_page + b;
    const uint2 w = *reinterpret_cast<const uint2*>(data);
    uint32_t packed[2] = {w.x, w.y};
    float x[kBlockSize];
    DequantizeBlock(packed, *scale, old_g, x);
    *scale = QuantizeBlock(x, new_g, p.recipe, packed);
    *reinterpret_cast<uint2*>(data) = make_uint2(packed[0], packed[1]);
  }
}

__global__ void AdoptScalesKernel(const AdoptScalesParams p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // 2 l + kv
  if (i >= 2 * p.num_layers || p.mask[i] == 0) return;
  const int l = i / 2, kv = i % 2;
  p.scales[4 * l + kv] = p.image_scales[4 * l + kv];
  p.scales[4 * l + 2 + kv] = p.image_scales[4 * l + 2 + kv];
  __threadfence();
  p.flags[i] = p.image_flags[i];
  if (p.host_flags != nullptr) {
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(p.host_flags + i) = p.image_flags[i];
  }
}

}  // namespace

absl::Status LoadPageCopyKernels() {
  FP4KV_RETURN_IF_ERROR(LoadKernel(PageCopyVecKernel, "PageCopyVecKernel"));
  FP4KV_RETURN_IF_ERROR(LoadKernel(PageCopyKernel, "PageCopyKernel"));
  FP4KV_RETURN_IF_ERROR(LoadKernel(HoldStreamKernel, "HoldStreamKernel"));
  FP4KV_RETURN_IF_ERROR(LoadKernel(RequantizePagesKernel, "RequantizePagesKernel"));
  return LoadKernel(AdoptScalesKernel, "AdoptScalesKernel");
}

absl::Status LaunchAdoptScales(const AdoptScalesParams& p, Stream stream) {
  if (p.num_layers <= 0) return absl::OkStatus();
  const int threads = 128;
  const int ctas = (2 * p.num_layers + threads - 1) / threads;
  AdoptScalesKernel<<<ctas, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  return CudaStatus(cudaGetLastError(), "AdoptScalesKernel launch");
}

void SetPageCopyDelayForTesting(int64_t microseconds) {
  g_copy_delay_us.store(microseconds > 0 ? microseconds : 0, std::memory_order_relaxed);
}

absl::Status LaunchPageCopy(const PageCopyParams& p, Stream stream) {
  const int64_t units = p.num_pages * 4 * p.num_layers;
  if (units <= 0) return absl::OkStatus();
  if (const int64_t us = g_copy_delay_us.load(std::memory_order_relaxed); us > 0) {
    HoldStreamKernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(us * 1000);
    FP4KV_RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), "HoldStreamKernel launch"));
  }
  const int64_t cap = p.max_ctas > 0 ? p.max_ctas : kMaxCtas;
  bool vec = (reinterpret_cast<uintptr_t>(p.src) | reinterpret_cast<uintptr_t>(p.dst) |
              static_cast<uintptr_t>(p.src_layer_stride) |
              static_cast<uintptr_t>(p.dst_layer_stride)) % 16 == 0;
  for (int r = 0; r < 4; ++r) {
    vec = vec && (p.src_region[r] | p.dst_region[r] | p.page_bytes[r]) % 16 == 0;
  }
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (vec) {
    const int64_t pages = p.num_pages * p.num_layers;
    const int64_t ctas = pages < cap ? pages : cap;
    PageCopyVecKernel<<<static_cast<unsigned>(ctas), kCopyThreads, 0, s>>>(p);
    return CudaStatus(cudaGetLastError(), "PageCopyVecKernel launch");
  }
  const int64_t ctas = units < cap ? units : cap;
  PageCopyKernel<<<static_cast<unsigned>(ctas), kCopyThreads, 0, s>>>(p);
  return CudaStatus(cudaGetLastError(), "PageCopyKernel launch");
}

absl::Status LaunchRequantizePages(const RequantizePagesParams& p, Stream stream) {
  for (int kv = 0; kv < 2; ++kv) {
    const int64_t total = p.num_layers * p.num_pages * RequantItemsPerPage(p, kv);
    if (total <= 0) continue;
    int64_t ctas = (total + kRequantThreads - 1) / kRequantThreads;
    if (ctas > 65536) ctas = 65536;
    RequantizePagesKernel<<<static_cast<unsigned>(ctas), kRequantThreads, 0,
                            reinterpret_cast<cudaStream_t>(stream)>>>(p, kv);
    FP4KV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace fp4kv
