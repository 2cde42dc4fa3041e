// Quantize-append on the GPU against the CPU reference: every case of the
// shared sweep eagerly and as a replayed CUDA graph (testing/gpu_harness.h).
#include "fp4kv/ops.h"
#include "gtest/gtest.h"
#include "testing/gpu_harness.h"
#include "testing/kernel_cases.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

class GpuAppendTest : public ::testing::TestWithParam<testing::AppendSpec> {};

TEST_P(GpuAppendTest, MatchesCpuEagerAndInGraphs) {
  FP4KV_SKIP_WITHOUT_GPU();
  testing::AppendCase c = testing::MakeAppendCase(GetParam(), 42);
  auto cpu_op = Appender::Create(c.Options(Device::Cpu()));
  auto gpu_op = Appender::Create(c.Options(Device::Cuda(0)));
  ASSERT_TRUE(cpu_op.ok()) << cpu_op.status();
  ASSERT_TRUE(gpu_op.ok()) << gpu_op.status();
  testing::ExpectGpuMatchesCpu(
      c,
      [&](uint8_t* in, uint8_t* out, Device d, Stream s) {
        const Appender& op = d.is_cuda() ? *gpu_op : *cpu_op;
        return op.Run(c.Args(in, d, out), c.Cache(out, d), s);
      },
      GetParam().Name());
}

INSTANTIATE_TEST_SUITE_P(Sweep, GpuAppendTest, ::testing::ValuesIn(testing::AppendSweep()),
                         [](const auto& info) { return info.param.Name(); });

// The functional API goes through the same objects; one case each.
TEST(GpuAppendFunctional, BySlotAndPagedMatchCpu) {
  FP4KV_SKIP_WITHOUT_GPU();
  for (AppendIndexing indexing : {AppendIndexing::kSlot, AppendIndexing::kPaged}) {
    testing::AppendSpec spec;
    spec.indexing = indexing;
    spec.recipe = Recipe::FourOverSix();
    testing::AppendCase c = testing::MakeAppendCase(spec, 3);
    testing::ExpectGpuMatchesCpu(
        c,
        [&](uint8_t* in, uint8_t* out, Device d, Stream s) {
          const AppendArgs a = c.Args(in, d);
          if (indexing == AppendIndexing::kSlot) {
            return QuantizeAppendBySlot(a.key, a.value, a.slot_mapping, c.Cache(out, d), a.k_scale,
                                        a.v_scale, spec.recipe, s);
          }
          return QuantizeAppendPaged(a.key, a.value, a.batch_indices, a.positions, c.Cache(out, d),
                                     a.kv_indices, a.kv_indptr, a.kv_last_page_len, a.k_scale,
                                     a.v_scale, spec.recipe, s);
        },
        spec.Name());
  }
}

}  // namespace
}  // namespace fp4kv
