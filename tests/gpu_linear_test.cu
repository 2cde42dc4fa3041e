// Linear quantize and dequantize on the GPU against the CPU reference,
// eagerly and as a replayed CUDA graph, over the shared sweep.
#include "fp4kv/ops.h"
#include "gtest/gtest.h"
#include "testing/gpu_harness.h"
#include "testing/kernel_cases.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

class GpuLinearTest : public ::testing::TestWithParam<testing::LinearSpec> {};

TEST_P(GpuLinearTest, MatchesCpuEagerAndInGraphs) {
  FP4KV_SKIP_WITHOUT_GPU();
  testing::LinearCase c = testing::MakeLinearCase(GetParam(), 9);
  auto cpu_op = LinearQuantizer::Create({c.spec.dtype, c.spec.recipe, Device::Cpu()});
  auto gpu_op = LinearQuantizer::Create({c.spec.dtype, c.spec.recipe, Device::Cuda(0)});
  ASSERT_TRUE(cpu_op.ok()) << cpu_op.status();
  ASSERT_TRUE(gpu_op.ok()) << gpu_op.status();
  testing::ExpectGpuMatchesCpu(
      c,
      [&](uint8_t* in, uint8_t* out, Device d, Stream s) {
        const LinearQuantizer& op = d.is_cuda() ? *gpu_op : *cpu_op;
        absl::Status st = op.Quantize(c.input.At(in, d), c.packed.At(out, d), c.scales.At(out, d),
                                      c.scale.At(in), s);
        if (!st.ok()) return st;
        return op.Dequantize(c.in_packed.At(in, d), c.in_scales.At(in, d), c.output.At(out, d),
                             c.scale.At(in), s);
      },
      GetParam().Name());
}

INSTANTIATE_TEST_SUITE_P(Sweep, GpuLinearTest, ::testing::ValuesIn(testing::LinearSweep()),
                         [](const auto& info) { return info.param.Name(); });

}  // namespace
}  // namespace fp4kv
