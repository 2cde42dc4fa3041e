// Internal: launch and Create()-time setup of decode attention for one head
// dim (device-side templates; kernels/attention_d{64,128,256}.cu instantiate
// them, kernels/attention.cu dispatches).
#ifndef FP4KV_KERNELS_ATTENTION_LAUNCH_CUH_
#define FP4KV_KERNELS_ATTENTION_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "absl/status/status.h"
#include "kernels/launch_util.cuh"
#include "kernels/attention/merge.cuh"
#include "kernels/attention/rows_in_m.cuh"
#include "kernels/attention/schedule.cuh"
#include "kernels/attention/stage_layout.cuh"
#include "kernels/attention/tma.cuh"
#include "kernels/attention/tokens_in_m.cuh"
#include "src/attention_params.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {

using AttnKernelFn = void (*)(kernels::AttnLaunch);

struct AttnKernelChoice {
  AttnKernelFn fn;
  int ctas_per_sm;  // its persistent grid is num_sms * ctas_per_sm
  int warp_bytes;   // dynamic shared memory per warp (the schedule's arrays follow)
  int align_bytes;  // slack for aligning the warps' regions (TMA rings)
  size_t SmemBytes(int max_batch) const {
    return static_cast<size_t>(kernels::kAttnWarps) * warp_bytes + align_bytes +
           kernels::AttnScheduleBytes(max_batch);
  }
};

// The attention kernel of one configuration. `rows`: query rows per item
// (AttnRowsPerSlot), which sets the tokens-in-M kernel's n-tiles; `tma`:
// the TMA variant (a TMA family, and the pools have tensor maps).
template <int D, bool kBf16, bool kFp8K>
AttnKernelChoice SelectAttentionKernel(AttentionFamily family, bool soft_cap, int rows, bool tma) {
  if (IsTokensInM(family) && kernels::TokensInMTakes(D, rows)) {
    if (tma && IsTokensInMTma(family)) {
      using Tc = kernels::TokensInMTmaConfig<D, kFp8K>;
      return {soft_cap ? &kernels::DecodeTokensInMKernel<D, 1, kBf16, true, kFp8K, true>
                       : &kernels::DecodeTokensInMKernel<D, 1, kBf16, false, kFp8K, true>,
              kernels::kTokensInMCtasPerSm<D, 1, kFp8K>, Tc::kWarpBytes, Tc::kAlign};
    }
    return {soft_cap ? &kernels::DecodeTokensInMKernel<D, 1, kBf16, true, kFp8K, false>
                     : &kernels::DecodeTokensInMKernel<D, 1, kBf16, false, kFp8K, false>,
            kernels::kTokensInMCtasPerSm<D, 1, kFp8K>, kernels::kTokensInMWarpBytes<D, kFp8K>, 0};
  }
  return {soft_cap ? &kernels::DecodeRowsInMKernel<D, kBf16, true, kFp8K>
                   : &kernels::DecodeRowsInMKernel<D, kBf16, false, kFp8K>,
          kernels::AttnConfig<D, kFp8K>::kCtasPerSm, kernels::AttnConfig<D, kFp8K>::kWarpBytes, 0};
}

// Whether `family` copies the tiles of this configuration with TMA when the
// pools allow it: where that measured faster on an H200 (FP8 keys at head
// dim 128, kTokensInMTma: bench/RESULTS.md), or for every shape when forced
// (kTokensInMTmaAll, tests and comparisons).
template <int D, bool kFp8K>
constexpr bool TmaCopiesFor(AttentionFamily family) {
  return family == AttentionFamily::kTokensInMTmaAll ||
         (family == AttentionFamily::kTokensInMTma && kFp8K && D == 128);
}

// cuTensorMapEncodeTiled from the driver the runtime loaded (no link
// against libcuda); null when the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// The tensor maps of p's pools for the TMA variant (kernels/attention/
// tma.cuh); false when the pools break a rule of the variant (16-byte
// aligned code bases and strides, a page size that is a multiple of 16,
// scale rows aligned to their size for the cp.async that copies them, pages
// indexable in 32 bits) or the driver cannot encode the maps: the launch
// then takes the cp.async kernel. Host only, no device work.
template <int D, bool kFp8K>
bool EncodeAttnTmaMaps(const AttentionParams& p, kernels::AttnTmaMaps* m) {
  using Tc = kernels::TokensInMTmaConfig<D, kFp8K>;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  if (p.page_size % kernels::kAttnTile != 0 || p.num_pages <= 0 || p.num_pages > INT32_MAX ||
      p.num_kv_heads <= 0) {
    return false;
  }
  const auto s16 = [](int64_t st) { return st > 0 && st % 16 == 0 && st < (int64_t{1} << 40); };
  const auto codes = [&](const PoolPtrs& q, int row_bytes, int swizzle, CUtensorMap* map) {
    if (reinterpret_cast<uintptr_t>(q.data) % 16 != 0 || !s16(q.data_entry) ||
        !s16(q.data_head) || !s16(q.data_page)) {
      return false;
    }
    const cuuint64_t dims[4] = {static_cast<cuuint64_t>(row_bytes),
                                static_cast<cuuint64_t>(p.page_size),
                                static_cast<cuuint64_t>(p.num_kv_heads),
                                static_cast<cuuint64_t>(p.num_pages)};
    const cuuint64_t strides[3] = {static_cast<cuuint64_t>(q.data_entry),
                                   static_cast<cuuint64_t>(q.data_head),
                                   static_cast<cuuint64_t>(q.data_page)};
    const cuuint32_t box[4] = {static_cast<cuuint32_t>(row_bytes), kernels::kAttnTile, 1, 1};
    const cuuint32_t es[4] = {1, 1, 1, 1};
    const CUtensorMapSwizzle sw = swizzle == 3   ? CU_TENSOR_MAP_SWIZZLE_128B
                                  : swizzle == 2 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                 : CU_TENSOR_MAP_SWIZZLE_NONE;
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<uint8_t*>(q.data), dims,
                  strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  // Scale rows: one cp.async of D / 16 bytes each (FP8 keys have none).
  constexpr int kSr = D / 16;
  const auto scales_ok = [&](const PoolPtrs& q) {
    return reinterpret_cast<uintptr_t>(q.scales) % kSr == 0 && q.scale_page >= 0 &&
           q.scale_entry >= 0 && q.scale_head >= 0 && q.scale_page % kSr == 0 &&
           q.scale_entry % kSr == 0 && q.scale_head % kSr == 0;
  };
  if ((!kFp8K && !scales_ok(p.k)) || !scales_ok(p.v)) return false;
  if (!codes(p.k, Tc::kKRowBytes, Tc::kKSwizzle, &m->kc)) return false;
  if (!codes(p.v, Tc::kRowBytes, Tc::kVSwizzle, &m->vc)) return false;
  m->tile_bytes = static_cast<uint32_t>(Tc::kKcBytes + Tc::kVcBytes);
  CountTmaMapEncode();
  return true;
}

template <int D, bool kBf16, bool kFp8K>
absl::Status LaunchFor(const AttentionParams& p, Stream stream) {
  using Cfg = kernels::AttnConfig<D, kFp8K>;
  kernels::AttnLaunch a;
  a.p = p;
  // Rows of an item: this launch's requests have at most
  // min(max_q_len, kernel_q_max) queries.
  a.rows_per_slot = kernels::AttnRowsPerSlot(
      p.group, p.max_q_len < p.kernel_q_max ? p.max_q_len : p.kernel_q_max);
  // Host only: the maps come encoded with the params (a KVCache's bound
  // attention encodes each layer's once, at bind) or are encoded here (the
  // functional op's pools come with the Run); a captured graph keeps them in
  // its kernel parameters.
  bool tma = TmaCopiesFor<D, kFp8K>(p.family) && kernels::TokensInMTakes(D, a.rows_per_slot);
  if (tma && p.tma_maps != nullptr) {
    tma = p.tma_maps->tile_bytes != 0;
    if (tma) a.tma = *p.tma_maps;
  } else if (tma) {
    tma = EncodeAttnTmaMaps<D, kFp8K>(p, &a.tma);
  }
  const AttnKernelChoice kernel =
      SelectAttentionKernel<D, kBf16, kFp8K>(p.family, p.soft_cap > 0.0f, a.rows_per_slot, tma);
  // At most AttnConfig<D>::kCtasPerSm per SM, which sized the workspace; fewer
  // when max_batch's schedule arrays leave room for fewer (found at Create()).
  const int ctas_per_sm =
      p.ctas_per_sm > 0 && p.ctas_per_sm < kernel.ctas_per_sm ? p.ctas_per_sm : kernel.ctas_per_sm;
  a.num_ctas = p.num_sms * ctas_per_sm;
  a.page_q16 = kernels::kAttnTile / p.page_size;
  a.page_r16 = kernels::kAttnTile % p.page_size;
  {
    const auto al = [](const void* ptr, int64_t stride, int64_t m) {
      return reinterpret_cast<uintptr_t>(ptr) % m == 0 && stride % m == 0;
    };
    const PoolPtrs* pools[2] = {&p.k, &p.v};
    bool ok = p.page_size % kernels::kAttnTile == 0 && p.num_pages <= INT32_MAX;
    for (const PoolPtrs* q : pools) {
      // FP8 keys have no scale pool (null pointer, zero strides).
      ok = ok && al(q->data, q->data_page, 16) && q->data_entry % 16 == 0 &&
           q->data_head % 16 == 0 && al(q->scales, q->scale_page, Cfg::kScaleBytes) &&
           q->scale_entry % Cfg::kScaleBytes == 0 && q->scale_head % Cfg::kScaleBytes == 0 &&
           q->data_entry >= 0 && q->scale_entry >= 0 && q->data_page >= 0 && q->scale_page >= 0 &&
           q->data_page <= UINT32_MAX && q->scale_page <= UINT32_MAX &&
           (p.page_size - 1) * q->data_entry < INT32_MAX &&
           (p.page_size - 1) * q->scale_entry < INT32_MAX;
    }
    a.fast_copy = ok;
  }
  const int64_t slots = kernels::AttnSlots(a.num_ctas);
  a.ws_o = static_cast<float*>(p.workspace);
  a.ws_ml = a.ws_o + slots * a.rows_per_slot * D;
  const int grid = a.num_ctas;
  const size_t sched_bytes = kernels::AttnScheduleBytes(p.max_batch);
  const size_t smem = kernel.SmemBytes(p.max_batch);
  // The dynamic shared memory limit was raised at Create() (PrepareFor).
  if (p.beside_prefill && p.merge_overlaps) {
    // A programmatic dependent of the prefill kernel just enqueued: its CTAs
    // take the SMs that kernel's last items leave idle (the prefill kernel
    // lets dependents launch at its start; this one waits for it at its end).
    FP4KV_CUDA_RETURN_IF_ERROR(kernels::LaunchMaybeProgrammatic(
        kernel.fn, dim3(grid), dim3(kernels::kAttnThreads), smem, stream, true, a));
  } else {
    kernel.fn<<<grid, kernels::kAttnThreads, smem, stream>>>(a);
  }
  FP4KV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // The merge kernel may launch while the attention kernel runs (it derives
  // its schedule, then waits in griddepcontrol.wait): only when its loaded
  // code was built for sm_90+, where that wait exists (found at Create()).
  return CudaStatus(
      kernels::LaunchMaybeProgrammatic(&kernels::MergeAttentionKernel<D, kBf16>, dim3(grid),
                                       dim3(kernels::kAttnThreads), sched_bytes, stream,
                                       p.merge_overlaps, a),
      "MergeAttentionKernel launch");
}

// Create()-time setup of one decode kernel instance (family, rows per
// item): raises its dynamic shared memory limit to what max_batch needs and
// finds its resident CTAs per SM when fewer than its launch bound (*ctas;
// 0: the bound). On the current device.
// A configuration that copies with TMA prepares its cp.async fallback too
// (a Run whose pools have no tensor maps) and keeps the fewer resident CTAs
// of the two.
template <int D, bool kBf16, bool kFp8K>
absl::Status PrepareKernel(const DecodeAttention::Options& o, AttentionFamily family, int rows,
                           int* ctas) {
  const int variants = TmaCopiesFor<D, kFp8K>(family) ? 2 : 1;
  int best = 0;
  for (int i = 0; i < variants; ++i) {
    // Variant 0 of two is the TMA kernel; a single variant is the one a
    // launch without tensor maps takes (the cp.async kernel under a TMA
    // family whose TmaCopiesFor() is false for this shape).
    const bool tma = variants == 2 && i == 0;
    const AttnKernelChoice kernel =
        SelectAttentionKernel<D, kBf16, kFp8K>(family, o.logits_soft_cap > 0.0f, rows, tma);
    const size_t smem = kernel.SmemBytes(o.max_batch);
    FP4KV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        kernel.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    int resident = 0;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &resident, kernel.fn, kernels::kAttnThreads, smem));
    // 0 (nothing fits) leaves the kernel's own bound: the launch reports it.
    const int c = resident >= 1 && resident < kernel.ctas_per_sm ? resident : 0;
    if (c > 0 && (best == 0 || c < best)) best = c;
  }
  *ctas = best;
  return absl::OkStatus();
}

// Create()-time setup of the decode kernels `o` and `out->family` select
// (kernels/attention.cu's dispatch: one launch up to kDecodeRowsQLen rows,
// or, for max_q_len > kDecodeRowsQLen with the tokens-in-M family, one for
// the requests it takes and a rows-in-M one for the others), and whether the
// merge kernel's loaded code can overlap (PTX 9.0+).
template <int D, bool kBf16, bool kFp8K>
absl::Status PrepareFor(const DecodeAttention::Options& o, AttentionKernelSetup* out) {
  const int group = o.num_qo_heads / o.geometry.num_kv_heads;
  if (o.max_q_len > kDecodeRowsQLen) {
    const int q_tokens = DecodeTokensInMQLen(out->family, group);
    if (q_tokens >= 1) {
      FP4KV_RETURN_IF_ERROR((PrepareKernel<D, kBf16, kFp8K>(
          o, out->family, kernels::AttnRowsPerSlot(group, q_tokens), &out->ctas_per_sm)));
    }
    if (q_tokens < kDecodeRowsQLen) {
      FP4KV_RETURN_IF_ERROR((PrepareKernel<D, kBf16, kFp8K>(
          o, AttentionFamily::kRowsInM, kernels::AttnRowsPerSlot(group, kDecodeRowsQLen),
          q_tokens >= 1 ? &out->ctas_per_sm_rows : &out->ctas_per_sm)));
    }
  } else {
    FP4KV_RETURN_IF_ERROR((PrepareKernel<D, kBf16, kFp8K>(
        o, out->family, kernels::AttnRowsPerSlot(group, o.max_q_len), &out->ctas_per_sm)));
  }
  cudaFuncAttributes fa;
  FP4KV_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&fa, &kernels::MergeAttentionKernel<D, kBf16>));
  out->merge_overlaps = fa.ptxVersion >= 90;
  return absl::OkStatus();
}

// The two entry points of one head dim (kernels/attention_d<D>.cu).
template <int D>
absl::Status PrepareDecodeAttentionDim(const DecodeAttention::Options& o,
                                       AttentionKernelSetup* out) {
  const bool bf16 = o.dtype == DType::kBF16;
  if (o.geometry.fp8_keys()) {
    return bf16 ? PrepareFor<D, true, true>(o, out) : PrepareFor<D, false, true>(o, out);
  }
  return bf16 ? PrepareFor<D, true, false>(o, out) : PrepareFor<D, false, false>(o, out);
}

template <int D>
bool EncodeDecodeTmaMapsDim(const AttentionParams& p, kernels::AttnTmaMaps* m) {
  m->tile_bytes = 0;
  const bool ok = p.fp8_keys
                      ? TmaCopiesFor<D, true>(p.family) && EncodeAttnTmaMaps<D, true>(p, m)
                      : TmaCopiesFor<D, false>(p.family) && EncodeAttnTmaMaps<D, false>(p, m);
  if (!ok) m->tile_bytes = 0;
  return ok;
}

template <int D>
absl::Status LaunchDecodeAttentionDim(const AttentionParams& p, Stream stream) {
  if (p.fp8_keys) {
    return p.dtype == DType::kBF16 ? LaunchFor<D, true, true>(p, stream)
                                   : LaunchFor<D, false, true>(p, stream);
  }
  return p.dtype == DType::kBF16 ? LaunchFor<D, true, false>(p, stream)
                                 : LaunchFor<D, false, false>(p, stream);
}

#define FP4KV_INSTANTIATE_ATTENTION_DIM(D)                                            \
  template absl::Status PrepareDecodeAttentionDim<D>(const DecodeAttention::Options&, \
                                                     AttentionKernelSetup*);          \
  template absl::Status LaunchDecodeAttentionDim<D>(const AttentionParams&, Stream);  \
  template bool EncodeDecodeTmaMapsDim<D>(const AttentionParams&, kernels::AttnTmaMaps*);

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_LAUNCH_CUH_
