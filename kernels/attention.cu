// Decode attention over NVFP4 pages with NVFP4 or FP8 E4M3 keys
// (kernels/attention.cuh documents the design; docs/attention.md the math
// and the launch strategy).
#include <cuda_runtime.h>

#include <cstdint>
#include <climits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/attention.cuh"
#include "src/attention_params.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {

namespace {

template <int D, bool kBf16, bool kFp8K>
absl::Status LaunchFor(const AttentionParams& p, Stream stream) {
  using Cfg = kernels::AttnConfig<D, kFp8K>;
  kernels::AttnLaunch a;
  a.p = p;
  a.num_ctas = p.num_sms * Cfg::kCtasPerSm;
  a.rows_per_slot = kernels::AttnRowsPerSlot(p.group, p.max_q_len);
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
           q->data_entry >= 0 && q->scale_entry >= 0 && q->data_page >= 0 &&
           q->scale_page >= 0 && q->data_page <= UINT32_MAX && q->scale_page <= UINT32_MAX &&
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
  const size_t smem = static_cast<size_t>(kernels::kAttnWarps) * Cfg::kWarpBytes + sched_bytes;
  auto* kernel = p.soft_cap > 0.0f ? &kernels::DecodeAttentionKernel<D, kBf16, true, kFp8K>
                                    : &kernels::DecodeAttentionKernel<D, kBf16, false, kFp8K>;
  // The dynamic shared memory limit was raised at Create() (PrepareFor).
  kernel<<<grid, kernels::kAttnThreads, smem, stream>>>(a);
  FP4KV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // The merge kernel may launch while the attention kernel runs (it derives
  // its schedule, then waits in griddepcontrol.wait): only when its loaded
  // code was built for sm_90+, where that wait exists (found at Create()).
  auto* merge = &kernels::MergeAttentionKernel<D, kBf16>;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kernels::kAttnThreads);
  cfg.dynamicSmemBytes = sched_bytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = p.merge_overlaps ? 1 : 0;
  return CudaStatus(cudaLaunchKernelEx(&cfg, merge, a), "MergeAttentionKernel launch");
}

// Create()-time setup of the one kernel instance `o` selects: raises its
// dynamic shared memory limit to what max_batch needs and tells whether the
// merge kernel's loaded code can overlap (PTX 9.0+). On the current device.
template <int D, bool kBf16, bool kFp8K>
absl::Status PrepareFor(const DecodeAttention::Options& o, AttentionKernelSetup* out) {
  using Cfg = kernels::AttnConfig<D, kFp8K>;
  const size_t smem = static_cast<size_t>(kernels::kAttnWarps) * Cfg::kWarpBytes +
                      kernels::AttnScheduleBytes(o.max_batch);
  auto* kernel = o.logits_soft_cap > 0.0f ? &kernels::DecodeAttentionKernel<D, kBf16, true, kFp8K>
                                          : &kernels::DecodeAttentionKernel<D, kBf16, false, kFp8K>;
  FP4KV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  cudaFuncAttributes fa;
  FP4KV_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&fa, &kernels::MergeAttentionKernel<D, kBf16>));
  out->merge_overlaps = fa.ptxVersion >= 90;
  return absl::OkStatus();
}

template <int D>
absl::Status PrepareForDim(const DecodeAttention::Options& o, AttentionKernelSetup* out) {
  const bool bf16 = o.dtype == DType::kBF16;
  if (o.geometry.fp8_keys()) {
    return bf16 ? PrepareFor<D, true, true>(o, out) : PrepareFor<D, false, true>(o, out);
  }
  return bf16 ? PrepareFor<D, true, false>(o, out) : PrepareFor<D, false, false>(o, out);
}

template <int D, bool kFp8K>
absl::Status LaunchForKeys(const AttentionParams& p, Stream stream) {
  return p.dtype == DType::kBF16 ? LaunchFor<D, true, kFp8K>(p, stream)
                                 : LaunchFor<D, false, kFp8K>(p, stream);
}

template <int D>
absl::Status LaunchForDim(const AttentionParams& p, Stream stream) {
  return p.fp8_keys ? LaunchForKeys<D, true>(p, stream) : LaunchForKeys<D, false>(p, stream);
}

}  // namespace

int64_t AttentionWorkspaceBytes(const DecodeAttention::Options& o, int num_sms) {
  const int d = o.geometry.head_dim_v;
  if (o.geometry.num_kv_heads <= 0 || o.num_qo_heads <= 0 || num_sms <= 0) return 0;
  if (d != 64 && d != 128 && d != 256) return 0;
  const int ctas = d == 64    ? kernels::AttnConfig<64>::kCtasPerSm
                   : d == 128 ? kernels::AttnConfig<128>::kCtasPerSm
                              : kernels::AttnConfig<256>::kCtasPerSm;
  const int group = o.num_qo_heads / o.geometry.num_kv_heads;
  const int64_t slots = kernels::AttnSlots(num_sms * ctas);
  const int64_t rows = kernels::AttnRowsPerSlot(group, o.max_q_len);
  const int64_t bytes = slots * rows * (d + 2) * static_cast<int64_t>(sizeof(float));
  return (bytes + 255) / 256 * 256;
}

absl::Status PrepareDecodeAttention(const DecodeAttention::Options& o,
                                    AttentionKernelSetup* out) {
  int previous = 0;
  FP4KV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  if (previous != o.device.ordinal) FP4KV_CUDA_RETURN_IF_ERROR(cudaSetDevice(o.device.ordinal));
  // Initialized from a lambda: nvcc warns (#2810) on assigning to a Status.
  absl::Status st = [&]() -> absl::Status {
    switch (o.geometry.head_dim_v) {
      case 64:
        return PrepareForDim<64>(o, out);
      case 128:
        return PrepareForDim<128>(o, out);
      case 256:
        return PrepareForDim<256>(o, out);
      default:
        return absl::UnimplementedError(absl::StrCat("DecodeAttention on CUDA: head_dim ",
                                                     o.geometry.head_dim_v, " (64, 128, 256)"));
    }
  }();
  if (previous != o.device.ordinal) {
    const cudaError_t err = cudaSetDevice(previous);
    if (st.ok() && err != cudaSuccess) return CudaStatus(err, "cudaSetDevice(restore)");
  }
  return st;
}

absl::Status LaunchDecodeAttention(const AttentionParams& p, Stream stream) {
  if (p.k.head_dim != p.v.head_dim) {
    return absl::UnimplementedError(absl::StrCat(
        "DecodeAttention on CUDA needs head_dim_k == head_dim_v, got ", p.k.head_dim, " and ",
        p.v.head_dim));
  }
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16) {
    return absl::InvalidArgumentError("DecodeAttention: q/out dtype must be f16 or bf16");
  }
  if (p.num_sms <= 0 || p.page_size <= 0 || p.group <= 0) {
    return absl::InvalidArgumentError("DecodeAttention: launch shape not set (num_sms, page_size)");
  }
  if (static_cast<int64_t>(p.max_pages) * p.page_size >= (int64_t{1} << 30)) {
    return absl::InvalidArgumentError("DecodeAttention: max_pages * page_size must be below 2^30");
  }
  if (p.batch_size <= 0) return absl::OkStatus();
  if (p.batch_size > p.max_batch) {
    return absl::InvalidArgumentError("DecodeAttention: batch larger than max_batch");
  }
  DecodeAttention::Options o;
  o.geometry.num_kv_heads = p.num_kv_heads;
  o.geometry.head_dim_k = p.k.head_dim;
  o.geometry.head_dim_v = p.v.head_dim;
  o.num_qo_heads = p.num_qo_heads;
  o.max_q_len = p.max_q_len;
  const int64_t need = AttentionWorkspaceBytes(o, p.num_sms);
  if (p.workspace_bytes < need || (need > 0 && p.workspace == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeAttention: workspace of ", p.workspace_bytes, " bytes, needs ", need));
  }
  switch (p.v.head_dim) {
    case 64:
      return LaunchForDim<64>(p, stream);
    case 128:
      return LaunchForDim<128>(p, stream);
    case 256:
      return LaunchForDim<256>(p, stream);
    default:
      return absl::UnimplementedError(
          absl::StrCat("DecodeAttention on CUDA: head_dim ", p.v.head_dim, " (64, 128, 256)"));
  }
}

}  // namespace internal
}  // namespace fp4kv
