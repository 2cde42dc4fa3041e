// PagedCacheQuantizer on the GPU against the CPU reference: every case of the
// shared sweep eagerly and as a replayed CUDA graph (testing/gpu_harness.h),
// computed scales included; plus the functional form, and whole caches of
// at least 2^17 rows, where the kernel switches to 32 rows per CTA.
#include <cstdint>
#include <vector>

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

// kernels/quantize_cache.cu (QuantizeCacheRowsPerCta): from this many rows
// (token slots) on, each thread keeps its block for 32 rows.
constexpr int64_t kRowsFor32PerCta = int64_t{1} << 17;

int64_t RowsOf(const testing::QuantizeCacheCase& c) {
  return c.num_tokens >= 0 ? c.num_tokens
                           : static_cast<int64_t>(c.spec.source_pages) * c.spec.page_size;
}

// Whole caches around and past the 32-rows-per-CTA threshold: exactly 2^17
// rows, a page size of 17 (rows not a multiple of 32: a partial last CTA),
// page lists with a partial last page, FP8 keys, both layouts and dtypes,
// computed and pointer scales, another recipe; and 2^17 - 1 rows (one row
// short of the switch) on the other side.
std::vector<testing::QuantizeCacheSpec> LargeSpecs() {
  std::vector<testing::QuantizeCacheSpec> out;
  testing::QuantizeCacheSpec s;
  s.num_heads = 1;
  s.page_size = 16;
  s.source_pages = 8192;  // 2^17 rows
  s.compute_scales = true;
  out.push_back(s);
  s = testing::QuantizeCacheSpec();
  s.num_heads = 2;
  s.head_dim_k = 128;
  s.head_dim_v = 64;
  s.page_size = 17;
  s.source_pages = 7711;  // 131087 rows
  s.source_layout = Layout::kHND;
  s.cache_layout = Layout::kNHD;
  s.dtype = DType::kF16;
  s.recipe = Recipe::FourOverSix();
  s.pointer_scales = true;
  s.padded_source = true;
  out.push_back(s);
  s = testing::QuantizeCacheSpec();
  s.num_heads = 1;
  s.page_size = 16;
  s.source_pages = 8192;  // lists: (8192 + 2) * 16 - 8 = 131096 rows
  s.source_layout = s.cache_layout = Layout::kHND;
  s.source_stacked = true;
  s.cache_stacked = true;
  s.lists = true;
  out.push_back(s);
  s.key_format = KeyFormat::kFp8;
  s.cache_stacked = false;
  s.compute_scales = true;
  out.push_back(s);
  s = testing::QuantizeCacheSpec();
  s.num_heads = 1;
  s.page_size = 1;
  s.source_pages = (1 << 17) - 1;  // one row short: the default rows per CTA
  out.push_back(s);
  return out;
}

class GpuQuantizeCacheLargeTest : public ::testing::TestWithParam<testing::QuantizeCacheSpec> {};

TEST_P(GpuQuantizeCacheLargeTest, MatchesCpuEagerAndInGraphs) {
  FP4KV_SKIP_WITHOUT_GPU();
  testing::QuantizeCacheCase c = testing::MakeQuantizeCacheCase(GetParam(), 77);
  const int64_t rows = RowsOf(c);
  if (GetParam().page_size == 1) {
    ASSERT_LT(rows, kRowsFor32PerCta);
  } else {
    ASSERT_GE(rows, kRowsFor32PerCta) << "the case does not reach the 32-rows-per-CTA path";
  }
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

INSTANTIATE_TEST_SUITE_P(Rows2Pow17, GpuQuantizeCacheLargeTest, ::testing::ValuesIn(LargeSpecs()),
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
