// Decode attention over NVFP4 pages with NVFP4 or FP8 E4M3 keys
// (kernels/attention.cuh documents the design; docs/attention.md the math
// and the launch strategy). This file holds the dispatch; the kernels of each
// head dim are compiled in kernels/attention_d<D>.cu.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/attention/schedule.cuh"
#include "kernels/attention/stage_layout.cuh"
#include "kernels/attention/tma_maps.h"
#include "src/attention_params.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {

// kernels/attention_d{64,128,256}.cu (kernels/attention/launch.cuh).
template <int D>
absl::Status PrepareDecodeAttentionDim(const DecodeAttention::Options& o,
                                       AttentionKernelSetup* out);
template <int D>
absl::Status LaunchDecodeAttentionDim(const AttentionParams& p, Stream stream);
template <int D>
bool EncodeDecodeTmaMapsDim(const AttentionParams& p, kernels::AttnTmaMaps* m);
// kernels/attention_prefill_d{64,128,256}.cu (kernels/attention/prefill_launch.cuh).
template <int D>
absl::Status PrepareAttentionPrefillDim(const DecodeAttention::Options& o,
                                        AttentionKernelSetup* out);
template <int D>
absl::Status LaunchAttentionPrefillDim(const AttentionParams& p, Stream stream);

namespace {

// FP4KV_ATTENTION_KERNEL: unset or "auto" (tokens in M; with TMA copies
// where they measured faster, on a library with sm_90a code and a compute
// capability 9.0 device), "tokens_in_m_tma" (tokens in M with TMA copies for
// every shape whose pools they can describe: an error where they cannot
// run), "tokens_in_m" (force cp.async copies), "rows_in_m" (force the older
// family); anything else is an error.
absl::Status ChooseFamily(int device, AttentionFamily* family) {
  bool tma = false;
  FP4KV_RETURN_IF_ERROR(Sm90aKernelsRun(device, &tma));
  const char* env = std::getenv("FP4KV_ATTENTION_KERNEL");
  *family = tma ? AttentionFamily::kTokensInMTma : AttentionFamily::kTokensInM;
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "auto") == 0) {
    return absl::OkStatus();
  }
  if (std::strcmp(env, "tokens_in_m_tma") == 0) {
    *family = AttentionFamily::kTokensInMTmaAll;
    if (!tma) {
      return absl::FailedPreconditionError(
          "FP4KV_ATTENTION_KERNEL=tokens_in_m_tma: the TMA decode kernel needs a library built "
          "for sm_90a and a compute capability 9.0 device");
    }
    return absl::OkStatus();
  }
  if (std::strcmp(env, "tokens_in_m") == 0) {
    *family = AttentionFamily::kTokensInM;
    return absl::OkStatus();
  }
  if (std::strcmp(env, "rows_in_m") == 0) {
    *family = AttentionFamily::kRowsInM;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "FP4KV_ATTENTION_KERNEL: expected auto, tokens_in_m_tma, tokens_in_m or rows_in_m, got \"",
      env, "\""));
}

// Calls fn(std::integral_constant<int, D>{}) for head dim d in {64, 128, 256}.
template <class Fn>
absl::Status ForHeadDim(int d, Fn&& fn) {
  switch (d) {
    case 64:
      return fn(std::integral_constant<int, 64>{});
    case 128:
      return fn(std::integral_constant<int, 128>{});
    case 256:
      return fn(std::integral_constant<int, 256>{});
    default:
      return absl::UnimplementedError(
          absl::StrCat("DecodeAttention on CUDA: head_dim ", d, " (64, 128, 256)"));
  }
}

absl::Status LaunchDecode(const AttentionParams& p, Stream stream) {
  return ForHeadDim(p.v.head_dim, [&](auto d) {
    return LaunchDecodeAttentionDim<decltype(d)::value>(p, stream);
  });
}

absl::Status LaunchPrefill(const AttentionParams& p, Stream stream) {
  return ForHeadDim(p.v.head_dim, [&](auto d) {
    return LaunchAttentionPrefillDim<decltype(d)::value>(p, stream);
  });
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
    FP4KV_RETURN_IF_ERROR(ChooseFamily(o.device.ordinal, &out->family));
    const bool prefill = o.max_q_len > kDecodeRowsQLen;
    return ForHeadDim(o.geometry.head_dim_v, [&](auto d) -> absl::Status {
      constexpr int kD = decltype(d)::value;
      FP4KV_RETURN_IF_ERROR(PrepareDecodeAttentionDim<kD>(o, out));
      return prefill ? PrepareAttentionPrefillDim<kD>(o, out) : absl::OkStatus();
    });
  }();
  if (previous != o.device.ordinal) {
    const cudaError_t err = cudaSetDevice(previous);
    if (st.ok() && err != cudaSuccess) return CudaStatus(err, "cudaSetDevice(restore)");
  }
  return st;
}

namespace {
std::atomic<int64_t> tma_map_encodes{0};
}  // namespace

int64_t TmaMapEncodesForTesting() { return tma_map_encodes.load(std::memory_order_relaxed); }
void CountTmaMapEncode() { tma_map_encodes.fetch_add(1, std::memory_order_relaxed); }

bool EncodeDecodeTmaMaps(const AttentionParams& p, kernels::AttnTmaMaps* m) {
  m->tile_bytes = 0;
  if (p.k.head_dim != p.v.head_dim) return false;
  bool ok = false;
  const absl::Status st = ForHeadDim(p.v.head_dim, [&](auto d) {
    ok = EncodeDecodeTmaMapsDim<decltype(d)::value>(p, m);
    return absl::OkStatus();
  });
  return st.ok() && ok;
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
  // The workspace was checked against the size Create() computed
  // (MakeAttentionParams).
  if (p.max_q_len > kDecodeRowsQLen) {
    // Long requests on the prefill kernel, then the rest on the decode
    // kernels (each skips the other's requests), in stream order.
    if (p.prefill_ctas_per_sm <= 0) {
      return absl::InvalidArgumentError(
          "DecodeAttention: the prefill kernel was not prepared (max_q_len > 16 needs an op "
          "from Create() with that max_q_len)");
    }
    AttentionParams pp = p;
    pp.kernel_q_min = kDecodeRowsQLen + 1;
    FP4KV_RETURN_IF_ERROR(LaunchPrefill(pp, stream));
    // The decode requests: those the tokens-in-M family takes on it, the
    // longer ones (up to kDecodeRowsQLen queries) on the rows-in-M kernel,
    // two launches in stream order sharing the workspace.
    const int q_tokens = DecodeTokensInMQLen(p.family, p.group);
    if (q_tokens >= 1) {
      AttentionParams dp = p;
      dp.kernel_q_max = q_tokens;
      dp.beside_prefill = p.prefill_family == PrefillFamily::kWgmma;
      FP4KV_RETURN_IF_ERROR(LaunchDecode(dp, stream));
    }
    if (q_tokens >= kDecodeRowsQLen) return absl::OkStatus();
    AttentionParams dp = p;
    dp.kernel_q_min = q_tokens + 1;
    dp.kernel_q_max = kDecodeRowsQLen;
    dp.family = AttentionFamily::kRowsInM;
    if (q_tokens >= 1) dp.ctas_per_sm = p.ctas_per_sm_rows;
    dp.beside_prefill = q_tokens < 1 && p.prefill_family == PrefillFamily::kWgmma;
    return LaunchDecode(dp, stream);
  }
  return LaunchDecode(p, stream);
}

}  // namespace internal
}  // namespace fp4kv
