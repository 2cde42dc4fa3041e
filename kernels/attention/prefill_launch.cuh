// Internal: host side of the prefill kernels -- the choice between the
// mma.sync family (kernels/attention/prefill.cuh, sm_80 and up) and the
// wgmma family (kernels/attention/prefill_sm90.cuh, sm_90a builds on compute
// capability 9.0, head dims 64 and 128), their Create()-time setup and their
// launch. Instantiated per head dim by kernels/attention_prefill_d<D>.cu.
#ifndef FP4KV_KERNELS_ATTENTION_PREFILL_LAUNCH_CUH_
#define FP4KV_KERNELS_ATTENTION_PREFILL_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/attention/prefill.cuh"
#include "kernels/attention/prefill_sm90.cuh"
#include "src/attention_params.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {

using PrefillKernelFn = void (*)(AttentionParams);

inline size_t PrefillSmemBytes(int bytes, int max_batch) {
  return static_cast<size_t>(bytes) + (static_cast<size_t>(max_batch) + 1) * sizeof(int);
}

// The prefill family for head dim `d` on `device`: the wgmma one where this
// library was built for sm_90a and the device is compute capability 9.0,
// the mma.sync one otherwise. FP4KV_PREFILL_KERNEL: unset or "auto" (that
// choice), "mma" (force the mma.sync family), "wgmma" (require the wgmma
// family: an error where it cannot run); anything else is an error.
inline absl::Status ChoosePrefillFamily(int d, int device, PrefillFamily* family) {
  bool wgmma = false;
  if (d == 64 || d == 128) FP4KV_RETURN_IF_ERROR(Sm90aKernelsRun(device, &wgmma));
  const char* env = std::getenv("FP4KV_PREFILL_KERNEL");
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "auto") == 0) {
  } else if (std::strcmp(env, "mma") == 0) {
    wgmma = false;
  } else if (std::strcmp(env, "wgmma") == 0) {
    if (!wgmma) {
      return absl::FailedPreconditionError(absl::StrCat(
          "FP4KV_PREFILL_KERNEL=wgmma: the wgmma prefill kernel needs a library built for sm_90a, "
          "a compute capability 9.0 device and head dim 64 or 128 (head dim ",
          d, ")"));
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("FP4KV_PREFILL_KERNEL: expected auto, mma or wgmma, got \"", env, "\""));
  }
  *family = wgmma ? PrefillFamily::kWgmma : PrefillFamily::kMma;
  return absl::OkStatus();
}

template <int D, bool kBf16, bool kFp8K>
PrefillKernelFn SelectPrefillKernel(PrefillFamily family, bool soft_cap) {
  if constexpr (D != 256) {
    if (family == PrefillFamily::kWgmma) {
      return soft_cap ? &kernels::PrefillSm90Kernel<D, kBf16, true, kFp8K>
                      : &kernels::PrefillSm90Kernel<D, kBf16, false, kFp8K>;
    }
  }
  return soft_cap ? &kernels::PrefillAttentionKernel<D, kBf16, true, kFp8K>
                  : &kernels::PrefillAttentionKernel<D, kBf16, false, kFp8K>;
}

// Dynamic shared memory and threads of a family's CTA.
template <int D>
size_t PrefillSmem(PrefillFamily family, int max_batch) {
  if constexpr (D != 256) {
    if (family == PrefillFamily::kWgmma) {
      using Cfg = kernels::PrefillSm90Config<D>;
      return PrefillSmemBytes(Cfg::kBytes + Cfg::kAlign, max_batch);
    }
  }
  return PrefillSmemBytes(kernels::PrefillConfig<D>::kBytes, max_batch);
}

template <int D>
int PrefillThreads(PrefillFamily family) {
  if constexpr (D != 256) {
    if (family == PrefillFamily::kWgmma) return kernels::PrefillSm90Config<D>::kThreads;
  }
  return kernels::kAttnThreads;
}

// Create()-time setup: raises the kernel's dynamic shared memory limit and
// finds how many of its CTAs an SM holds (the persistent grid per SM).
template <int D, bool kBf16, bool kFp8K>
absl::Status PreparePrefillFor(const DecodeAttention::Options& o, PrefillFamily family,
                               int* ctas_per_sm) {
  const PrefillKernelFn fn =
      SelectPrefillKernel<D, kBf16, kFp8K>(family, o.logits_soft_cap > 0.0f);
  const size_t smem = PrefillSmem<D>(family, o.max_batch);
  FP4KV_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int resident = 0;
  FP4KV_CUDA_RETURN_IF_ERROR(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, fn, PrefillThreads<D>(family), smem));
  if (resident < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.max_batch: the prefill attention kernel's schedule of ", o.max_batch,
        " requests does not fit an SM's shared memory beside its tiles (", smem, " bytes in all)"));
  }
  *ctas_per_sm = resident;
  return absl::OkStatus();
}

template <int D, bool kBf16, bool kFp8K>
absl::Status LaunchPrefillFor(const AttentionParams& p, Stream stream) {
  const PrefillKernelFn fn = SelectPrefillKernel<D, kBf16, kFp8K>(p.prefill_family, p.soft_cap > 0.0f);
  const size_t smem = PrefillSmem<D>(p.prefill_family, p.max_batch);
  const int grid = p.num_sms * (p.prefill_ctas_per_sm > 0 ? p.prefill_ctas_per_sm : 1);
  fn<<<grid, PrefillThreads<D>(p.prefill_family), smem, stream>>>(p);
  return CudaStatus(cudaGetLastError(), p.prefill_family == PrefillFamily::kWgmma
                                            ? "PrefillSm90Kernel launch"
                                            : "PrefillAttentionKernel launch");
}

// The wgmma kernel's setmaxnreg budget (two consumer warpgroups at
// kConsumerRegs, two producers at kProducerRegs) assumes its CTA starts with
// 65536 / kThreads registers a thread; with fewer the consumers' increase
// would never be granted. False when the compiled kernel says otherwise.
template <int D, bool kBf16, bool kFp8K>
absl::StatusOr<bool> WgmmaRegistersAsPlanned(bool soft_cap) {
  if constexpr (D == 256) {
    return false;
  } else {
    cudaFuncAttributes fa;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(
        &fa, SelectPrefillKernel<D, kBf16, kFp8K>(PrefillFamily::kWgmma, soft_cap)));
    return fa.numRegs == 65536 / kernels::PrefillSm90Config<D>::kThreads;
  }
}

template <int D>
absl::Status PrepareAttentionPrefillDim(const DecodeAttention::Options& o,
                                        AttentionKernelSetup* out) {
  FP4KV_RETURN_IF_ERROR(ChoosePrefillFamily(D, o.device.ordinal, &out->prefill_family));
  if (out->prefill_family == PrefillFamily::kWgmma) {
    const bool bf16 = o.dtype == DType::kBF16, cap = o.logits_soft_cap > 0.0f;
    const absl::StatusOr<bool> planned =
        o.geometry.fp8_keys()
            ? (bf16 ? WgmmaRegistersAsPlanned<D, true, true>(cap)
                    : WgmmaRegistersAsPlanned<D, false, true>(cap))
            : (bf16 ? WgmmaRegistersAsPlanned<D, true, false>(cap)
                    : WgmmaRegistersAsPlanned<D, false, false>(cap));
    if (!planned.ok()) return planned.status();
    if (!*planned) {
      const char* env = std::getenv("FP4KV_PREFILL_KERNEL");
      if (env != nullptr && std::strcmp(env, "wgmma") == 0) {
        return absl::FailedPreconditionError(
            "FP4KV_PREFILL_KERNEL=wgmma: the wgmma prefill kernel was not compiled with the "
            "registers its warpgroups share out");
      }
      out->prefill_family = PrefillFamily::kMma;
    }
  }
  const PrefillFamily f = out->prefill_family;
  int* ctas = &out->prefill_ctas_per_sm;
  const bool bf16 = o.dtype == DType::kBF16;
  if (o.geometry.fp8_keys()) {
    return bf16 ? PreparePrefillFor<D, true, true>(o, f, ctas)
                : PreparePrefillFor<D, false, true>(o, f, ctas);
  }
  return bf16 ? PreparePrefillFor<D, true, false>(o, f, ctas)
              : PreparePrefillFor<D, false, false>(o, f, ctas);
}

template <int D>
absl::Status LaunchAttentionPrefillDim(const AttentionParams& p, Stream stream) {
  if (p.fp8_keys) {
    return p.dtype == DType::kBF16 ? LaunchPrefillFor<D, true, true>(p, stream)
                                   : LaunchPrefillFor<D, false, true>(p, stream);
  }
  return p.dtype == DType::kBF16 ? LaunchPrefillFor<D, true, false>(p, stream)
                                 : LaunchPrefillFor<D, false, false>(p, stream);
}

#define FP4KV_INSTANTIATE_ATTENTION_PREFILL_DIM(D)                                     \
  template absl::Status PrepareAttentionPrefillDim<D>(const DecodeAttention::Options&, \
                                                      AttentionKernelSetup*);          \
  template absl::Status LaunchAttentionPrefillDim<D>(const AttentionParams&, Stream);

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_PREFILL_LAUNCH_CUH_
