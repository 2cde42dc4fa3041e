// PagedCacheQuantizer on the GPU against the CPU reference: every case of the
// shared sweep eagerly and as a replayed CUDA graph (testing/gpu_harness.h),
// computed scales included; plus the functional form.
#include "fp4kv/ops.h"
#include "gtest/gtest.h"
#include "testing/gpu_harness.h"
#include "testing/kernel_cases.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

class GpuQuantizeCacheTest : public ::testing::TestWithParam<testing::QuantizeCacheSpec> {};

TEST_P(GpuQuantizeCacheTest, MatchesCpuEagerAndInGraphs) {
  FP4KV_SKIP_WITHOUT_GPU();
  testing::QuantizeCacheCase c = testing::MakeQuantizeCacheCase(GetParam(), 42);
  auto cpu_op = PagedCacheQuantizer::Create(c.Options(Device::Cpu()));
  auto gpu_op = PagedCacheQuantizer::Create(c.Options(Device::Cuda(0)));
  ASSERT_TRUE(cpu_op.ok()) << cpu_op.status();
  ASSERT_TRUE(gpu_op.ok()) << gpu_op.status();
  testing::ExpectGpuMatchesCpu(
      c,
      [&](uint8_t* in, uint8_t* out, Device d, Stream s) {
        const PagedCacheQuantizer& op = d.is_cuda() ? *gpu_op : *cpu_op;
        return op.Run(c.Args(in, out, d), c.Cache(out, d), s);
      },
      GetParam().Name());
}

INSTANTIATE_TEST_SUITE_P(Sweep, GpuQuantizeCacheTest,
                         ::testing::ValuesIn(testing::QuantizeCacheSweep()),
                         [](const auto& info) { return info.param.Name(); });

TEST(GpuQuantizeCacheFunctional, ComputedAndGivenScalesMatchCpu) {
  FP4KV_SKIP_WITHOUT_GPU();
  for (bool compute : {false, true}) {
    testing::QuantizeCacheSpec spec;
    spec.source_stacked = true;
    spec.source_layout = spec.cache_layout = Layout::kHND;
    spec.compute_scales = compute;
    testing::QuantizeCacheCase c = testing::MakeQuantizeCacheCase(spec, 5);
    testing::ExpectGpuMatchesCpu(
        c,
        [&](uint8_t* in, uint8_t* out, Device d, Stream s) {
          const QuantizeCacheArgs a = c.Args(in, out, d);
          return QuantizePagedCache(a.source, c.Cache(out, d), a.k_scale, a.v_scale,
                                    a.k_scale_out, a.v_scale_out, spec.recipe, s);
        },
        spec.Name());
  }
}

}  // namespace
}  // namespace fp4kv
