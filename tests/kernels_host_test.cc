// Runs every kernel's whole grid on the CPU (the per-thread bodies in
// kernels/*.cuh are host+device functions) and compares the bytes with the
// CPU reference of the public ops, over the shared sweeps. Outputs start
// poisoned, so anything written outside the contract shows; the emulated
// loads and stores go through memcpy on exactly-sized host blobs, so an
// out-of-bounds access shows under the sanitizer build.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/append.cuh"
#include "kernels/dequantize.cuh"
#include "kernels/linear.cuh"
#include "kernels/materialize.cuh"
#include "kernels/quantize_cache.cuh"
#include "src/params.h"
#include "src/validate.h"
#include "testing/kernel_cases.h"

namespace fp4kv {
namespace {

using kernels::RecipeVariant;
using testing::FirstDifference;

// Rows per CTA to emulate: the launch's own choice, then odd and large
// overrides (partial unroll groups, long row loops).
constexpr uint32_t kRowsPerCta[] = {0, 3, 8, 32};

// Calls f(cta_x, cta_y, tid) for every thread of a tiled grid.
template <typename F>
void ForEachThread(const kernels::TileShape& s, F&& f) {
  for (uint32_t x = 0; x < s.grid_x; ++x) {
    for (uint32_t y = 0; y < s.grid_y; ++y) {
      for (uint32_t t = 0; t < s.threads; ++t) f(x, y, t);
    }
  }
}

// ------------------------------------------------------------------ append
template <bool kBf16, RecipeVariant kV>
void EmulateAppend(const internal::AppendParams& p, uint32_t rows_per_cta, bool pairs) {
  ASSERT_TRUE(kernels::ForEachAppendLaunch(
      p,
      [&](const kernels::AppendLaunch& a) {
        EXPECT_EQ(a.pair, pairs && kernels::BlockPairsFit(p));
        ForEachThread(a.shape, [&](uint32_t x, uint32_t y, uint32_t t) {
          if (p.scale_events != nullptr) {
            kernels::AppendThread<kBf16, kV, true>(a, x, y, t);
          } else {
            kernels::AppendThread<kBf16, kV, false>(a, x, y, t);
          }
        });
      },
      rows_per_cta,
      pairs ? kernels::AppendPairPolicy::kWherePossible : kernels::AppendPairPolicy::kNever));
}

template <bool kBf16>
void EmulateAppendAny(const internal::AppendParams& p, uint32_t r, bool pairs) {
  switch (kernels::VariantOf(p.recipe)) {
    case RecipeVariant::kStandard:
      return EmulateAppend<kBf16, RecipeVariant::kStandard>(p, r, pairs);
    case RecipeVariant::kMae:
      return EmulateAppend<kBf16, RecipeVariant::kMae>(p, r, pairs);
    case RecipeVariant::kMse:
      return EmulateAppend<kBf16, RecipeVariant::kMse>(p, r, pairs);
    case RecipeVariant::kMaeHalf:
      return EmulateAppend<kBf16, RecipeVariant::kMaeHalf>(p, r, pairs);
    case RecipeVariant::kMseHalf:
      return EmulateAppend<kBf16, RecipeVariant::kMseHalf>(p, r, pairs);
  }
}

// The same views -> params step as Appender::Run (src/ops.cc).
internal::AppendParams AppendParamsFor(const testing::AppendCase& c, uint8_t* in, uint8_t* out) {
  absl::StatusOr<internal::AppendParams> p = internal::MakeAppendParams(
      c.Options(Device::Cpu()), c.Args(in, Device::Cpu(), out), c.Cache(out, Device::Cpu()));
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : internal::AppendParams();
}

class AppendHostTest : public ::testing::TestWithParam<testing::AppendSpec> {};

TEST_P(AppendHostTest, GridMatchesReference) {
  testing::AppendCase c = testing::MakeAppendCase(GetParam(), 1234);
  for (int round = 0; round < 2; ++round) {
    if (round == 1) c.Rewrite(99);
    std::vector<uint8_t> in = c.in;
    std::vector<uint8_t> want = c.out;
    auto op = Appender::Create(c.Options(Device::Cpu()));
    ASSERT_TRUE(op.ok()) << op.status();
    ASSERT_TRUE(
        op->Run(c.Args(in.data(), Device::Cpu(), want.data()), c.Cache(want.data(), Device::Cpu()))
            .ok());
    ASSERT_NE(want, c.out) << "the case wrote nothing";
    // Items of one block, and of two adjacent blocks where the geometry
    // allows it.
    for (const bool pairs : {false, true}) {
      for (uint32_t rows_per_cta : kRowsPerCta) {
        std::vector<uint8_t> got = c.out;
        const internal::AppendParams p = AppendParamsFor(c, in.data(), got.data());
        if (c.spec.dtype == DType::kBF16) {
          EmulateAppendAny<true>(p, rows_per_cta, pairs);
        } else {
          EmulateAppendAny<false>(p, rows_per_cta, pairs);
        }
        ASSERT_EQ(FirstDifference(want, got), "") << c.spec.Name() << " round " << round
                                                  << " rows_per_cta " << rows_per_cta
                                                  << " pairs " << pairs;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, AppendHostTest, ::testing::ValuesIn(testing::AppendSweep()),
                         [](const auto& info) { return info.param.Name(); });

// The launch's own choice (AppendPairPolicy::kAuto): pairs exactly where the
// geometry allows them and the keys are NVFP4; the sweep holds cases of
// both kinds, and FP8-key cases whose geometry would allow pairs.
TEST(AppendPairPolicyTest, PairsForNvfp4KeysOnly) {
  int paired = 0, fp8_eligible = 0, single = 0;
  for (const testing::AppendSpec& spec : testing::AppendSweep()) {
    testing::AppendCase c = testing::MakeAppendCase(spec, 7);
    std::vector<uint8_t> in = c.in, out = c.out;
    const internal::AppendParams p = AppendParamsFor(c, in.data(), out.data());
    const bool want = kernels::BlockPairsFit(p) && !p.fp8_keys;
    int launches = 0;
    ASSERT_TRUE(kernels::ForEachAppendLaunch(p, [&](const kernels::AppendLaunch& a) {
      EXPECT_EQ(a.pair, want) << spec.Name();
      ++launches;
    }));
    EXPECT_GT(launches, 0) << spec.Name();
    paired += want ? 1 : 0;
    fp8_eligible += p.fp8_keys && kernels::BlockPairsFit(p) ? 1 : 0;
    single += want ? 0 : 1;
  }
  EXPECT_GT(paired, 0);
  EXPECT_GT(fp8_eligible, 0);
  EXPECT_GT(single, 0);
}

// ----------------------------------------------------------------- dequant
internal::DequantParams DequantParamsFor(const testing::DequantCase& c, uint8_t* in, uint8_t* out) {
  absl::StatusOr<internal::DequantParams> p = internal::MakeDequantParams(
      c.Options(Device::Cpu()), c.Args(in, out, Device::Cpu()), c.Cache(in, Device::Cpu()));
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : internal::DequantParams();
}

class DequantHostTest : public ::testing::TestWithParam<testing::DequantSpec> {};

TEST_P(DequantHostTest, GridMatchesReference) {
  testing::DequantCase c = testing::MakeDequantCase(GetParam(), 77);
  for (int round = 0; round < 2; ++round) {
    if (round == 1) c.Rewrite(5);
    std::vector<uint8_t> in = c.in;
    std::vector<uint8_t> want = c.out;
    auto op = Dequantizer::Create(c.Options(Device::Cpu()));
    ASSERT_TRUE(op.ok()) << op.status();
    ASSERT_TRUE(
        op->Run(c.Args(in.data(), want.data(), Device::Cpu()), c.Cache(in.data(), Device::Cpu()))
            .ok());
    ASSERT_NE(want, c.out) << "the case wrote nothing";
    for (uint32_t rows_per_cta : kRowsPerCta) {
      std::vector<uint8_t> got = c.out;
      const internal::DequantParams p = DequantParamsFor(c, in.data(), got.data());
      ASSERT_TRUE(kernels::ForEachDequantLaunch(
          p,
          [&](const kernels::DequantLaunch& l) {
            ForEachThread(l.shape, [&](uint32_t x, uint32_t y, uint32_t t) {
              if (c.spec.dtype == DType::kBF16) {
                kernels::DequantThread<true>(l, x, y, t);
              } else {
                kernels::DequantThread<false>(l, x, y, t);
              }
            });
          },
          rows_per_cta));
      ASSERT_EQ(FirstDifference(want, got), "")
          << c.spec.Name() << " round " << round << " rows_per_cta " << rows_per_cta;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, DequantHostTest, ::testing::ValuesIn(testing::DequantSweep()),
                         [](const auto& info) { return info.param.Name(); });

// ------------------------------------------------------------- materialize
internal::MaterializeParams MaterializeParamsFor(const testing::MaterializeCase& c, uint8_t* in,
                                                 uint8_t* out) {
  absl::StatusOr<internal::MaterializeParams> p = internal::MakeMaterializeParams(
      c.Options(Device::Cpu()), c.Args(in, out, Device::Cpu()), c.Cache(in, Device::Cpu()));
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : internal::MaterializeParams();
}

class MaterializeHostTest : public ::testing::TestWithParam<testing::MaterializeSpec> {};

TEST_P(MaterializeHostTest, GridMatchesReference) {
  testing::MaterializeCase c = testing::MakeMaterializeCase(GetParam(), 31);
  for (int round = 0; round < 2; ++round) {
    if (round == 1) c.Rewrite(8);
    std::vector<uint8_t> in = c.in;
    std::vector<uint8_t> want = c.out;
    auto op = Materializer::Create(c.Options(Device::Cpu()));
    ASSERT_TRUE(op.ok()) << op.status();
    ASSERT_TRUE(
        op->Run(c.Args(in.data(), want.data(), Device::Cpu()), c.Cache(in.data(), Device::Cpu()))
            .ok());
    // Both index widths: 32-bit page indices (the normal case) and the
    // 64-bit form that pools of more than 2^32 pages take.
    for (const bool wide : {false, true}) {
      for (uint32_t rows_per_cta : kRowsPerCta) {
        std::vector<uint8_t> got = c.out;
        const internal::MaterializeParams p = MaterializeParamsFor(c, in.data(), got.data());
        ASSERT_TRUE(kernels::ForEachMaterializeLaunch(
            p,
            [&](const kernels::MaterializeLaunch& launch) {
              EXPECT_FALSE(launch.wide_index);
              kernels::MaterializeLaunch l = launch;
              l.wide_index = wide;
              ForEachThread(l.shape, [&](uint32_t x, uint32_t y, uint32_t t) {
                kernels::MaterializeThread(l, x, y, t);
              });
            },
            rows_per_cta));
        ASSERT_EQ(FirstDifference(want, got), "")
            << c.spec.Name() << " round " << round << " rows_per_cta " << rows_per_cta << " wide "
            << wide;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, MaterializeHostTest,
                         ::testing::ValuesIn(testing::MaterializeSweep()),
                         [](const auto& info) { return info.param.Name(); });

// ------------------------------------------------------------------ linear
template <bool kBf16, RecipeVariant kV>
void EmulateQuantizeLinear(const internal::LinearQuantParams& p) {
  ASSERT_TRUE(kernels::ForEachLinearLaunch(
      p.rows, p.cols, kBlockSize, kernels::kLinearItemsPerCta,
      [&](const kernels::LinearRange& r, uint32_t grid) {
        for (uint32_t cta = 0; cta < grid; ++cta) {
          for (uint32_t tid = 0; tid < kernels::kLinearThreads; ++tid) {
            kernels::QuantizeLinearThread<kBf16, kV>(p, r, cta, tid);
          }
        }
      }));
}

template <bool kBf16>
void EmulateQuantizeLinearAny(const internal::LinearQuantParams& p) {
  switch (kernels::VariantOf(p.recipe)) {
    case RecipeVariant::kStandard:
      return EmulateQuantizeLinear<kBf16, RecipeVariant::kStandard>(p);
    case RecipeVariant::kMae:
      return EmulateQuantizeLinear<kBf16, RecipeVariant::kMae>(p);
    case RecipeVariant::kMse:
      return EmulateQuantizeLinear<kBf16, RecipeVariant::kMse>(p);
    case RecipeVariant::kMaeHalf:
      return EmulateQuantizeLinear<kBf16, RecipeVariant::kMaeHalf>(p);
    case RecipeVariant::kMseHalf:
      return EmulateQuantizeLinear<kBf16, RecipeVariant::kMseHalf>(p);
  }
}

class LinearHostTest : public ::testing::TestWithParam<testing::LinearSpec> {};

TEST_P(LinearHostTest, GridMatchesReference) {
  testing::LinearCase c = testing::MakeLinearCase(GetParam(), 4);
  const bool bf = c.spec.dtype == DType::kBF16;
  const Device cpu = Device::Cpu();
  for (int round = 0; round < 2; ++round) {
    if (round == 1) c.Rewrite(6);
    std::vector<uint8_t> in = c.in;
    std::vector<uint8_t> want = c.out, got = c.out;
    auto op = LinearQuantizer::Create({c.spec.dtype, c.spec.recipe, cpu});
    ASSERT_TRUE(op.ok()) << op.status();
    ASSERT_TRUE(op->Quantize(c.input.At(in.data(), cpu), c.packed.At(want.data(), cpu),
                             c.scales.At(want.data(), cpu), c.scale.At(in.data()))
                    .ok());
    ASSERT_TRUE(op->Dequantize(c.in_packed.At(in.data(), cpu), c.in_scales.At(in.data(), cpu),
                               c.output.At(want.data(), cpu), c.scale.At(in.data()))
                    .ok());
    internal::LinearQuantParams q;
    q.input = in.data() + c.input.offset;
    q.input_row_stride = c.input.strides[0];
    q.dtype = c.spec.dtype;
    q.rows = c.spec.rows;
    q.cols = c.spec.cols;
    q.packed = got.data() + c.packed.offset;
    q.packed_row_stride = c.packed.strides[0];
    q.scales = got.data() + c.scales.offset;
    q.scale_row_stride = c.scales.strides[0];
    q.scale = c.scale.At(in.data());
    q.recipe = c.spec.recipe;
    if (bf) {
      EmulateQuantizeLinearAny<true>(q);
    } else {
      EmulateQuantizeLinearAny<false>(q);
    }
    internal::LinearDequantParams d;
    d.packed = in.data() + c.in_packed.offset;
    d.packed_row_stride = c.in_packed.strides[0];
    d.scales = in.data() + c.in_scales.offset;
    d.scale_row_stride = c.in_scales.strides[0];
    d.rows = c.spec.rows;
    d.cols = c.spec.cols;
    d.output = got.data() + c.output.offset;
    d.output_row_stride = c.output.strides[0];
    d.dtype = c.spec.dtype;
    d.scale = c.scale.At(in.data());
    ASSERT_TRUE(kernels::ForEachLinearLaunch(
        d.rows, d.cols, kernels::kLinearDequantItemValues, kernels::kLinearDequantItemsPerCta,
        [&](const kernels::LinearRange& r, uint32_t grid) {
          for (uint32_t cta = 0; cta < grid; ++cta) {
            for (uint32_t tid = 0; tid < kernels::kLinearThreads; ++tid) {
              if (bf) {
                kernels::DequantizeLinearThread<true>(d, r, cta, tid);
              } else {
                kernels::DequantizeLinearThread<false>(d, r, cta, tid);
              }
            }
          }
        }));
    ASSERT_EQ(FirstDifference(want, got), "") << c.spec.Name() << " round " << round;
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, LinearHostTest, ::testing::ValuesIn(testing::LinearSweep()),
                         [](const auto& info) { return info.param.Name(); });

// ---------------------------------------------------------- quantize cache
template <bool kBf16, RecipeVariant kV>
void EmulateQuantizeCache(const internal::QuantizeCacheParams& p, uint32_t rows_per_cta,
                          bool pairs) {
  const kernels::AppendPairPolicy policy =
      pairs ? kernels::AppendPairPolicy::kWherePossible : kernels::AppendPairPolicy::kNever;
  if (p.compute_scales) {
    // The amax pass: the kernel's warp and integer maxima are exact and
    // order-free, so a plain max over every thread's result is the same.
    if (p.zero_first) *p.amax_bits[0] = *p.amax_bits[1] = 0;
    ASSERT_TRUE(kernels::ForEachQuantizeCacheLaunch(
        p,
        [&](const kernels::QuantizeCacheLaunch& a) {
          ForEachThread(a.shape, [&](uint32_t x, uint32_t y, uint32_t t) {
            float k, v;
            kernels::CacheAmaxThread<kBf16>(a, x, y, t, &k, &v);
            *p.amax_bits[0] = std::max(*p.amax_bits[0], FloatBits(k));
            *p.amax_bits[1] = std::max(*p.amax_bits[1], FloatBits(v));
          });
        },
        rows_per_cta, kernels::AppendPairPolicy::kNever));  // as the launcher
    kernels::FinishCacheScalesFromBits(p);
  }
  ASSERT_TRUE(kernels::ForEachQuantizeCacheLaunch(
      p,
      [&](const kernels::QuantizeCacheLaunch& a) {
        EXPECT_EQ(a.pair, pairs && kernels::BlockPairsFit(p));
        ForEachThread(a.shape, [&](uint32_t x, uint32_t y, uint32_t t) {
          kernels::QuantizeCacheThread<kBf16, kV>(a, x, y, t);
        });
      },
      rows_per_cta, policy));
}

template <bool kBf16>
void EmulateQuantizeCacheAny(const internal::QuantizeCacheParams& p, uint32_t r, bool pairs) {
  switch (kernels::VariantOf(p.recipe)) {
    case RecipeVariant::kStandard:
      return EmulateQuantizeCache<kBf16, RecipeVariant::kStandard>(p, r, pairs);
    case RecipeVariant::kMae:
      return EmulateQuantizeCache<kBf16, RecipeVariant::kMae>(p, r, pairs);
    case RecipeVariant::kMse:
      return EmulateQuantizeCache<kBf16, RecipeVariant::kMse>(p, r, pairs);
    case RecipeVariant::kMaeHalf:
      return EmulateQuantizeCache<kBf16, RecipeVariant::kMaeHalf>(p, r, pairs);
    case RecipeVariant::kMseHalf:
      return EmulateQuantizeCache<kBf16, RecipeVariant::kMseHalf>(p, r, pairs);
  }
}

class QuantizeCacheHostTest : public ::testing::TestWithParam<testing::QuantizeCacheSpec> {};

TEST_P(QuantizeCacheHostTest, GridMatchesReference) {
  testing::QuantizeCacheCase c = testing::MakeQuantizeCacheCase(GetParam(), 4321);
  for (int round = 0; round < 2; ++round) {
    if (round == 1) c.Rewrite(17);
    std::vector<uint8_t> in = c.in;
    std::vector<uint8_t> want = c.out;
    auto op = PagedCacheQuantizer::Create(c.Options(Device::Cpu()));
    ASSERT_TRUE(op.ok()) << op.status();
    ASSERT_TRUE(
        op->Run(c.Args(in.data(), want.data(), Device::Cpu()), c.Cache(want.data(), Device::Cpu()))
            .ok());
    ASSERT_NE(want, c.out) << "the case wrote nothing";
    // Items of one block, and of two adjacent blocks where the geometry
    // allows it (both passes).
    for (const bool pairs : {false, true}) {
      for (uint32_t rows_per_cta : kRowsPerCta) {
        std::vector<uint8_t> got = c.out;
        absl::StatusOr<internal::QuantizeCacheParams> p = internal::MakeQuantizeCacheParams(
            c.Options(Device::Cpu()), c.Args(in.data(), got.data(), Device::Cpu()),
            c.Cache(got.data(), Device::Cpu()));
        ASSERT_TRUE(p.ok()) << p.status();
        if (c.spec.dtype == DType::kBF16) {
          EmulateQuantizeCacheAny<true>(*p, rows_per_cta, pairs);
        } else {
          EmulateQuantizeCacheAny<false>(*p, rows_per_cta, pairs);
        }
        ASSERT_EQ(FirstDifference(want, got), "") << c.spec.Name() << " round " << round
                                                  << " rows_per_cta " << rows_per_cta
                                                  << " pairs " << pairs;
      }
    }
  }
}

// The launch's own choice for the whole-cache quantize: pairs exactly where
// the geometry allows them and the keys are NVFP4, as for the append.
TEST(QuantizeCachePairPolicyTest, PairsForNvfp4KeysOnly) {
  int paired = 0, single = 0;
  for (const testing::QuantizeCacheSpec& spec : testing::QuantizeCacheSweep()) {
    testing::QuantizeCacheCase c = testing::MakeQuantizeCacheCase(spec, 5);
    std::vector<uint8_t> in = c.in, out = c.out;
    absl::StatusOr<internal::QuantizeCacheParams> p = internal::MakeQuantizeCacheParams(
        c.Options(Device::Cpu()), c.Args(in.data(), out.data(), Device::Cpu()),
        c.Cache(out.data(), Device::Cpu()));
    ASSERT_TRUE(p.ok()) << p.status();
    const bool want = kernels::BlockPairsFit(*p) && !p->fp8_keys;
    ASSERT_TRUE(kernels::ForEachQuantizeCacheLaunch(*p, [&](const kernels::QuantizeCacheLaunch& a) {
      EXPECT_EQ(a.pair, want) << spec.Name();
    }));
    paired += want ? 1 : 0;
    single += want ? 0 : 1;
  }
  EXPECT_GT(paired, 0);
  EXPECT_GT(single, 0);
}

INSTANTIATE_TEST_SUITE_P(Sweep, QuantizeCacheHostTest,
                         ::testing::ValuesIn(testing::QuantizeCacheSweep()),
                         [](const auto& info) { return info.param.Name(); });

// ------------------------------------------------------------- page copy
// A short page list given in the launch itself (inline ids, what the host
// tier's small promotions and demotions use) copies the same pages as the
// same list given by pointers, and nothing else.
TEST(PageCopyHostTest, InlineIdsCopyWhatListedIdsCopy) {
  const int layers = 3;
  const int64_t page_bytes[4] = {48, 48, 0, 16};  // K, V data; no K scales (FP8 keys), V scales
  const int64_t src_pages = 7, dst_pages = 9;
  const auto layout = [&](int64_t pages, int64_t region[4]) {
    int64_t off = 0;
    for (int r = 0; r < 4; ++r) {
      region[r] = off;
      off += pages * page_bytes[r];
    }
    return off;  // bytes per layer
  };
  internal::PageCopyParams p;
  p.src_layer_stride = layout(src_pages, p.src_region);
  p.dst_layer_stride = layout(dst_pages, p.dst_region);
  for (int r = 0; r < 4; ++r) p.page_bytes[r] = page_bytes[r];
  p.num_layers = layers;
  std::vector<uint8_t> src(static_cast<size_t>(layers * p.src_layer_stride));
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  const std::vector<int32_t> from = {4, 0, 6, 2};
  const std::vector<int32_t> to = {8, 3, 0, 5};
  p.src = src.data();
  p.num_pages = static_cast<int64_t>(from.size());

  std::vector<uint8_t> want(static_cast<size_t>(layers * p.dst_layer_stride), 0xA5);
  std::vector<uint8_t> got = want;
  internal::PageCopyParams listed = p;
  listed.dst = want.data();
  listed.src_ids = from.data();
  listed.dst_ids = to.data();
  internal::ReferencePageCopy(listed);

  internal::PageCopyParams inlined = p;
  inlined.dst = got.data();
  inlined.inline_ids = true;
  std::copy(from.begin(), from.end(), inlined.ids);
  std::copy(to.begin(), to.end(), inlined.ids + internal::PageCopyParams::kInlineIds);
  internal::ReferencePageCopy(inlined);
  EXPECT_EQ(FirstDifference(want, got), "");

  // The listed copy moved exactly the four pages of every layer and region.
  int64_t changed = 0;
  for (uint8_t b : want) changed += b != 0xA5;
  int64_t copied = 0;
  for (int r = 0; r < 4; ++r) copied += layers * 4 * page_bytes[r];
  EXPECT_LE(changed, copied);
  EXPECT_GT(changed, copied * 9 / 10);
  for (size_t j = 0; j < from.size(); ++j) {
    EXPECT_EQ(inlined.SrcPage(static_cast<int64_t>(j)), from[j]);
    EXPECT_EQ(inlined.DstPage(static_cast<int64_t>(j)), to[j]);
  }
}

}  // namespace
}  // namespace fp4kv
