// FP8 materialization on the GPU against the CPU reference, eagerly and as
// a replayed CUDA graph, over the shared sweep.
#include "fp4kv/ops.h"
#include "gtest/gtest.h"
#include "testing/gpu_harness.h"
#include "testing/kernel_cases.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

class GpuMaterializeTest : public ::testing::TestWithParam<testing::MaterializeSpec> {};

TEST_P(GpuMaterializeTest, MatchesCpuEagerAndInGraphs) {
  FP4KV_SKIP_WITHOUT_GPU();
  testing::MaterializeCase c = testing::MakeMaterializeCase(GetParam(), 23);
  auto cpu_op = Materializer::Create(c.Options(Device::Cpu()));
  auto gpu_op = Materializer::Create(c.Options(Device::Cuda(0)));
  ASSERT_TRUE(cpu_op.ok()) << cpu_op.status();
  ASSERT_TRUE(gpu_op.ok()) << gpu_op.status();
  testing::ExpectGpuMatchesCpu(
      c,
      [&](uint8_t* in, uint8_t* out, Device d, Stream s) {
        const Materializer& op = d.is_cuda() ? *gpu_op : *cpu_op;
        return op.Run(c.Args(in, out, d), c.Cache(in, d), s);
      },
      GetParam().Name());
}

INSTANTIATE_TEST_SUITE_P(Sweep, GpuMaterializeTest,
                         ::testing::ValuesIn(testing::MaterializeSweep()),
                         [](const auto& info) { return info.param.Name(); });

}  // namespace
}  // namespace fp4kv
