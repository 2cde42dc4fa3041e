// Decode attention kernel over NVFP4 pages (placeholder until the kernel
// lands: the CUDA path reports Unimplemented).
#include "absl/status/status.h"
#include "src/attention_params.h"

namespace fp4kv {
namespace internal {

int64_t AttentionWorkspaceBytes(const DecodeAttention::Options&, int) { return 0; }

absl::Status LaunchDecodeAttention(const AttentionParams&, Stream) {
  return absl::UnimplementedError("DecodeAttention: the CUDA kernel is not built yet");
}

}  // namespace internal
}  // namespace fp4kv
