// Placeholder launchers until the CUDA kernels land: CUDA tensors get a clear
// Unimplemented status instead of a crash or a silent no-op.
#include "src/params.h"

namespace fp4kv {
namespace internal {
namespace {
absl::Status NotYet(const char* op) {
  return absl::UnimplementedError(
      std::string(op) + ": CUDA tensors are not supported yet; pass CPU tensors");
}
}  // namespace
absl::Status LaunchAppend(const AppendParams&, Stream) { return NotYet("append"); }
absl::Status LaunchDequantize(const DequantParams&, Stream) { return NotYet("dequantize"); }
absl::Status LaunchMaterialize(const MaterializeParams&, Stream) { return NotYet("materialize"); }
absl::Status LaunchQuantizeLinear(const LinearQuantParams&, Stream) { return NotYet("quantize_linear"); }
absl::Status LaunchDequantizeLinear(const LinearDequantParams&, Stream) { return NotYet("dequantize_linear"); }
}  // namespace internal
}  // namespace fp4kv
