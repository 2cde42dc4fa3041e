// PagedCacheQuantizer on the CPU: its bytes are those of appending the same
// rows by slot with the same scales (checked directly, by running the
// Appender), computed scales are the Calibrator's, and bad arguments are
// refused naming the argument with nothing written.
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "fp4kv/calibrate.h"
#include "fp4kv/ops.h"
#include "fp4kv/recipe.h"
#include "gtest/gtest.h"
#include "testing/kernel_cases.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::FirstDifference;

// The rows the quantizer writes, gathered as append input ([n, H, D] with
// slot dst * page_size + entry), from the case's lists and num_tokens.
struct AppendRows {
  std::vector<uint16_t> k, v;
  std::vector<int64_t> slots;
};

AppendRows GatherRows(const testing::QuantizeCacheCase& c, uint8_t* in) {
  const QuantizeCacheArgs a = c.Args(in, nullptr, Device::Cpu());
  const CacheGeometry& g = c.geometry;
  const int64_t S = g.page_size, H = g.num_kv_heads;
  const int64_t P = a.source.k.shape[0];
  const bool nhd = c.spec.source_layout == Layout::kNHD;
  const int64_t pages = a.src_pages.empty() ? P : a.src_pages.shape[0];
  const int64_t rows = a.num_tokens < 0 ? pages * S : a.num_tokens;
  AppendRows out;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / S, e = r % S;
    int64_t src = i, dst = i;
    if (!a.src_pages.empty()) {
      src = a.src_pages.ptr<const int32_t>()[i];
      dst = a.dst_pages.ptr<const int32_t>()[i];
    }
    if (src < 0 || src >= P || dst < 0 || dst >= g.num_pages) continue;
    out.slots.push_back(dst * S + e);
    for (const auto& [t, dim, vec] :
         {std::tuple<const TensorView&, int, std::vector<uint16_t>*>{a.source.k, g.head_dim_k, &out.k},
          std::tuple<const TensorView&, int, std::vector<uint16_t>*>{a.source.v, g.head_dim_v,
                                                                     &out.v}}) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t off = src * t.strides[0] + (nhd ? e * t.strides[1] + h * t.strides[2]
                                                      : h * t.strides[1] + e * t.strides[2]);
        const uint16_t* row = t.ptr<const uint16_t>() + off;
        vec->insert(vec->end(), row, row + dim);
      }
    }
  }
  return out;
}

float ReadFloat(const std::vector<uint8_t>& blob, const testing::ViewSpec& v) {
  float f;
  std::memcpy(&f, blob.data() + v.offset, sizeof(f));
  return f;
}

class QuantizeCacheTest : public ::testing::TestWithParam<testing::QuantizeCacheSpec> {};

TEST_P(QuantizeCacheTest, BytesEqualAppendingTheSameRowsWithTheSameScales) {
  testing::QuantizeCacheCase c = testing::MakeQuantizeCacheCase(GetParam(), 2024);
  std::vector<uint8_t> in = c.in;
  std::vector<uint8_t> got = c.out;
  auto op = PagedCacheQuantizer::Create(c.Options(Device::Cpu()));
  ASSERT_TRUE(op.ok()) << op.status();
  ASSERT_TRUE(op->Run(c.Args(in.data(), got.data(), Device::Cpu()),
                      c.Cache(got.data(), Device::Cpu()))
                  .ok());
  // The scales the quantizer used.
  const QuantizeCacheArgs qa = c.Args(in.data(), got.data(), Device::Cpu());
  float gk = qa.k_scale.Get(), gv = qa.v_scale.Get();
  if (c.spec.compute_scales) {
    gk = ReadFloat(got, c.k_scale_out);
    gv = ReadFloat(got, c.v_scale_out);
  }
  // The same rows appended by slot into a fresh poisoned pool.
  const AppendRows rows = GatherRows(c, in.data());
  ASSERT_FALSE(rows.slots.empty());
  std::vector<uint8_t> want = c.out;
  const CacheGeometry& g = c.geometry;
  const int64_t n = static_cast<int64_t>(rows.slots.size());
  const TensorView key = TensorView::Contiguous(rows.k.data(), c.spec.dtype,
                                                {n, g.num_kv_heads, g.head_dim_k});
  const TensorView value = TensorView::Contiguous(rows.v.data(), c.spec.dtype,
                                                  {n, g.num_kv_heads, g.head_dim_v});
  const TensorView slots = TensorView::Contiguous(rows.slots.data(), DType::kI64, {n});
  ASSERT_TRUE(QuantizeAppendBySlot(key, value, slots, c.Cache(want.data(), Device::Cpu()),
                                   GlobalScale::Value(gk), GlobalScale::Value(gv), c.spec.recipe)
                  .ok());
  if (c.spec.compute_scales) {  // the scale outputs are not part of the append
    std::memcpy(want.data() + c.k_scale_out.offset, &gk, 4);
    std::memcpy(want.data() + c.v_scale_out.offset, &gv, 4);
  }
  EXPECT_EQ(FirstDifference(want, got), "") << c.spec.Name();
}

INSTANTIATE_TEST_SUITE_P(Sweep, QuantizeCacheTest,
                         ::testing::ValuesIn(testing::QuantizeCacheSweep()),
                         [](const auto& info) { return info.param.Name(); });

// Whole-cache computed scales are the Calibrator's for the K and V views
// (same reduction, same MakeGlobalScale), and the functional form writes
// the same bytes as the op object.
TEST(QuantizeCache, ComputedScalesAreTheCalibratorsAndFunctionalFormMatches) {
  for (bool stacked : {false, true}) {
    for (Layout layout : {Layout::kNHD, Layout::kHND}) {
      testing::QuantizeCacheSpec spec;
      spec.source_stacked = stacked;
      spec.source_layout = spec.cache_layout = layout;
      spec.compute_scales = true;
      spec.recipe = Recipe::FourOverSix(256, ErrorMetric::kMse);
      testing::QuantizeCacheCase c = testing::MakeQuantizeCacheCase(spec, 7);
      std::vector<uint8_t> in = c.in, got = c.out, fn = c.out;
      auto op = PagedCacheQuantizer::Create(c.Options(Device::Cpu()));
      ASSERT_TRUE(op.ok()) << op.status();
      const QuantizeCacheArgs a = c.Args(in.data(), got.data(), Device::Cpu());
      ASSERT_TRUE(op->Run(a, c.Cache(got.data(), Device::Cpu())).ok());
      auto cal = Calibrator::Create(
          {a.source.k.numel(), spec.dtype, Device::Cpu(), spec.recipe});
      ASSERT_TRUE(cal.ok()) << cal.status();
      float amax = 0, gk = 0, gv = 0;
      ASSERT_TRUE(cal->Run(a.source.k, &amax, &gk).ok());
      ASSERT_TRUE(cal->Run(a.source.v, &amax, &gv).ok());
      EXPECT_EQ(FloatBits(ReadFloat(got, c.k_scale_out)), FloatBits(gk)) << spec.Name();
      EXPECT_EQ(FloatBits(ReadFloat(got, c.v_scale_out)), FloatBits(gv)) << spec.Name();
      const QuantizeCacheArgs b = c.Args(in.data(), fn.data(), Device::Cpu());
      ASSERT_TRUE(QuantizePagedCache(b.source, c.Cache(fn.data(), Device::Cpu()), GlobalScale(),
                                     GlobalScale(), b.k_scale_out, b.v_scale_out, spec.recipe)
                      .ok());
      EXPECT_EQ(FirstDifference(got, fn), "") << spec.Name();
    }
  }
}

// Given scales through the functional form equal the op with the same
// scales; all-zero data computes the scale for unit data.
TEST(QuantizeCache, FunctionalGivenScalesAndZeroData) {
  testing::QuantizeCacheSpec spec;
  spec.source_layout = spec.cache_layout = Layout::kHND;
  testing::QuantizeCacheCase c = testing::MakeQuantizeCacheCase(spec, 9);
  std::vector<uint8_t> in = c.in, got = c.out, fn = c.out;
  auto op = PagedCacheQuantizer::Create(c.Options(Device::Cpu()));
  ASSERT_TRUE(op.ok());
  const QuantizeCacheArgs a = c.Args(in.data(), got.data(), Device::Cpu());
  ASSERT_TRUE(op->Run(a, c.Cache(got.data(), Device::Cpu())).ok());
  ASSERT_TRUE(QuantizePagedCache(a.source, c.Cache(fn.data(), Device::Cpu()), a.k_scale, a.v_scale)
                  .ok());
  EXPECT_EQ(FirstDifference(got, fn), "");
  EXPECT_NE(got, c.out);

  std::vector<uint16_t> zeros(2 * 16 * 2 * 64, 0);
  const TensorView kv = TensorView::Contiguous(zeros.data(), DType::kBF16, {1, 2, 2, 16, 64});
  std::vector<uint8_t> data(2 * 16 * 2 * 32, 0xA5), scales(2 * 16 * 2 * 4, 0xA5);
  const PagedCache cache =
      PagedCache::FromStacked(TensorView::Contiguous(data.data(), DType::kU8, {1, 2, 2, 16, 32}),
                              TensorView::Contiguous(scales.data(), DType::kE4M3, {1, 2, 2, 16, 4}),
                              Layout::kHND)
          .value();
  float gk = 0, gv = 0;
  ASSERT_TRUE(QuantizePagedCache(HalfPagedCache::FromStacked(kv, Layout::kHND).value(), cache,
                                 GlobalScale(), GlobalScale(), &gk, &gv)
                  .ok());
  EXPECT_EQ(gk, MakeGlobalScale(0.0f, Recipe()));
  EXPECT_EQ(gv, MakeGlobalScale(0.0f, Recipe()));
  for (uint8_t b : data) ASSERT_EQ(b, 0);
  for (uint8_t b : scales) ASSERT_EQ(b, 0);
}

// ----------------------------------------------------------- validation
struct Bad {
  const char* name;
  void (*mutate)(PagedCacheQuantizer::Options&, QuantizeCacheArgs&);
  const char* argument;
};

TEST(QuantizeCacheValidation, RefusedNamingTheArgumentAndNothingWritten) {
  static float scale_a = 0, scale_b = 0;
  const Bad cases[] = {
      {"wrong dtype", [](auto& o, auto&) { o.input_dtype = DType::kF16; }, "source.k"},
      {"wrong layout", [](auto& o, auto&) { o.source_layout = Layout::kHND; }, "source.layout"},
      {"short v", [](auto&, auto& a) { a.source.v.shape[0] -= 1; }, "source.v"},
      {"bad head dim", [](auto&, auto& a) { a.source.k.shape[3] = 32; }, "source.k"},
      {"strided inner", [](auto&, auto& a) { a.source.v.strides[3] = 2; }, "source.v"},
      {"misaligned", [](auto&, auto& a) {
         a.source.k.data = static_cast<uint8_t*>(a.source.k.data) + 2;
       }, "source.k"},
      {"one list", [](auto&, auto& a) { a.dst_pages = TensorView(); }, "dst_pages"},
      {"too many tokens", [](auto&, auto& a) { a.num_tokens = 1 << 20; }, "num_tokens"},
      {"bad tokens", [](auto&, auto& a) { a.num_tokens = -2; }, "num_tokens"},
      {"bad k scale", [](auto&, auto& a) { a.k_scale = GlobalScale::Value(-1.0f); }, "k_scale"},
      {"nan v scale", [](auto&, auto& a) { a.v_scale = GlobalScale::Value(NAN); }, "v_scale"},
      {"out without compute", [](auto&, auto& a) { a.k_scale_out = &scale_a; }, "k_scale_out"},
      {"compute without out", [](auto& o, auto& a) {
         o.compute_scales = true;
         a.k_scale_out = &scale_a;
       }, "v_scale_out"},
      {"compute same out", [](auto& o, auto& a) {
         o.compute_scales = true;
         a.k_scale_out = a.v_scale_out = &scale_b;
       }, "v_scale_out"},
      {"device", [](auto&, auto& a) { a.source.k.device = Device::Cuda(0); }, "source.k"},
  };
  for (const Bad& bad : cases) {
    testing::QuantizeCacheSpec spec;
    spec.lists = true;
    testing::QuantizeCacheCase c = testing::MakeQuantizeCacheCase(spec, 3);
    std::vector<uint8_t> in = c.in, out = c.out;
    PagedCacheQuantizer::Options o = c.Options(Device::Cpu());
    QuantizeCacheArgs a = c.Args(in.data(), out.data(), Device::Cpu());
    scale_a = scale_b = 0;
    bad.mutate(o, a);
    auto op = PagedCacheQuantizer::Create(o);
    ASSERT_TRUE(op.ok()) << bad.name << ": " << op.status();
    const absl::Status s = op->Run(a, c.Cache(out.data(), Device::Cpu()));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.name << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), bad.argument)) << bad.name << ": " << s;
    EXPECT_EQ(out, c.out) << bad.name << ": wrote something";
    EXPECT_EQ(scale_a, 0.0f) << bad.name;
    EXPECT_EQ(scale_b, 0.0f) << bad.name;
  }
  // Options.
  PagedCacheQuantizer::Options o;
  o.geometry = CacheGeometry{2, 64, 64, 16, 4, Layout::kNHD};
  o.compute_scales = true;
  o.headroom = 0.5f;
  EXPECT_TRUE(absl::StrContains(PagedCacheQuantizer::Create(o).status().message(),
                                "options.headroom"));
  o.headroom = 1.0f;
  o.input_dtype = DType::kF32;
  EXPECT_TRUE(absl::StrContains(PagedCacheQuantizer::Create(o).status().message(),
                                "options.input_dtype"));
  // Without lists the source may not have more pages than the cache.
  testing::QuantizeCacheSpec spec;
  testing::QuantizeCacheCase c = testing::MakeQuantizeCacheCase(spec, 4);
  std::vector<uint8_t> in = c.in, out = c.out;
  PagedCacheQuantizer::Options small = c.Options(Device::Cpu());
  QuantizeCacheArgs a = c.Args(in.data(), out.data(), Device::Cpu());
  PagedCache cache = c.Cache(out.data(), Device::Cpu());
  small.geometry.num_pages = a.source.k.shape[0] - 1;
  for (TensorView* t : {&cache.k_data, &cache.v_data, &cache.k_scales, &cache.v_scales}) {
    t->shape[0] = small.geometry.num_pages;
  }
  const absl::Status s = PagedCacheQuantizer::Create(small)->Run(a, cache);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "source.k")) << s;
  EXPECT_EQ(out, c.out);
  EXPECT_EQ(HalfPagedCache::FromStacked(a.source.k, Layout::kNHD).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fp4kv
