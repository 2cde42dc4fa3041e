// Calibrator on CPU views: amax semantics (NaN ignored, signs, -0, inf),
// strided views, the global scale, and argument checks that write nothing.
#include "fp4kv/calibrate.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "fp4kv/format.h"
#include "fp4kv/recipe.h"
#include "gtest/gtest.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

constexpr float kPoisonFloat = -12345.0f;

void ExpectInvalid(const absl::Status& s, const std::string& field) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(field), std::string::npos) << s;
}

Calibrator MakeCpu(int64_t max_elements, DType dtype, const Recipe& recipe = Recipe::Standard()) {
  absl::StatusOr<Calibrator> c = Calibrator::Create({max_elements, dtype, Device::Cpu(), recipe});
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(*c);
}

uint16_t Enc(DType t, float x) {
  return t == DType::kF16 ? FloatToHalfBits(x) : FloatToBf16Bits(x);
}

TEST(CalibratorCpu, AmaxIgnoresNanAndSign) {
  for (DType t : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> x = {Enc(t, 0.5f),     Enc(t, -3.0f),     Enc(t, -0.0f), Enc(t, 2.0f),
                               0x7fff /* NaN */, 0xffff /* -NaN */, Enc(t, 1.0f)};
    Calibrator c = MakeCpu(64, t);
    float amax = kPoisonFloat, g = kPoisonFloat;
    ASSERT_TRUE(c.Run(TensorView::Contiguous(x.data(), t, {7}), &amax, &g).ok());
    EXPECT_EQ(amax, 3.0f);
    EXPECT_EQ(g, MakeGlobalScale(3.0f, Recipe::Standard()));
  }
}

TEST(CalibratorCpu, SpecialInputs) {
  Calibrator c = MakeCpu(16, DType::kF32, Recipe::FourOverSix(256));
  float amax = kPoisonFloat, g = kPoisonFloat;
  // All -0 and NaN: amax +0, g as for amax 1.
  std::vector<float> z = {-0.0f, std::nanf(""), -0.0f};
  ASSERT_TRUE(c.Run(TensorView::Contiguous(z.data(), DType::kF32, {3}), &amax, &g).ok());
  EXPECT_EQ(FloatBits(amax), 0u);
  EXPECT_EQ(g, 1.0f / 1536.0f);
  // -inf: amax inf, g finite.
  std::vector<float> inf = {1.0f, -INFINITY};
  ASSERT_TRUE(c.Run(TensorView::Contiguous(inf.data(), DType::kF32, {2}), &amax, &g).ok());
  EXPECT_EQ(amax, INFINITY);
  EXPECT_TRUE(std::isfinite(g));
  // Empty view, data may be null.
  amax = g = kPoisonFloat;
  ASSERT_TRUE(
      c.Run(TensorView::Contiguous(static_cast<void*>(nullptr), DType::kF32, {0, 4}), &amax, &g)
          .ok());
  EXPECT_EQ(amax, 0.0f);
  EXPECT_EQ(g, 1.0f / 1536.0f);
  // amax may be omitted.
  std::vector<float> v = {-768.0f, 3.0f};
  g = kPoisonFloat;
  ASSERT_TRUE(c.Run(TensorView::Contiguous(v.data(), DType::kF32, {2}), nullptr, &g).ok());
  EXPECT_EQ(g, 0.5f);
}

// A strided view (the K half of a stacked tensor, padded rows) reduces over
// exactly its elements.
TEST(CalibratorCpu, StridedViewsReduceOnlyTheirElements) {
  // [2 (K/V), 5 rows, 3 heads, 16 (+8 padding)] bf16; V and padding hold 100.
  const int64_t rows = 5, heads = 3, dim = 16, pad = 8;
  std::vector<uint16_t> buf(2 * rows * heads * (dim + pad), Enc(DType::kBF16, 100.0f));
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  float want = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t d = 0; d < dim; ++d) {
        const uint16_t b = Enc(DType::kBF16, n(rng));
        buf[(r * heads + h) * (dim + pad) + d] = b;
        want = std::fmax(want, std::fabs(Bf16BitsToFloat(b)));
      }
    }
  }
  const TensorView k = TensorView::Strided(buf.data(), DType::kBF16, {rows, heads, dim},
                                           {heads * (dim + pad), dim + pad, 1});
  Calibrator c = MakeCpu(1000, DType::kBF16);
  float amax = kPoisonFloat, g = kPoisonFloat;
  ASSERT_TRUE(c.Run(k, &amax, &g).ok());
  EXPECT_EQ(amax, want);
  EXPECT_LT(amax, 100.0f);
  // Transposed view of the same rows (non-collapsible strides), same result.
  const TensorView kt = TensorView::Strided(buf.data(), DType::kBF16, {heads, dim, rows},
                                            {dim + pad, 1, heads * (dim + pad)});
  amax = kPoisonFloat;
  ASSERT_TRUE(c.Run(kt, &amax, &g).ok());
  EXPECT_EQ(amax, want);
}

TEST(CalibratorCpu, MatchesAPlainLoopOnRandomData) {
  for (DType t : {DType::kF16, DType::kBF16}) {
    for (const Recipe& r : AllRecipes()) {
      std::vector<uint16_t> x = testing::RandomHalfBits(t, 4099, 17);
      x[5] = 0xfe00;  // -NaN
      float want = 0.0f;
      for (uint16_t b : x) {
        const float v = t == DType::kF16 ? HalfBitsToFloat(b) : Bf16BitsToFloat(b);
        if (!std::isnan(v)) want = std::fmax(want, std::fabs(v));
      }
      Calibrator c = MakeCpu(4099, t, r);
      float amax = kPoisonFloat, g = kPoisonFloat;
      ASSERT_TRUE(c.Run(TensorView::Contiguous(x.data(), t, {4099}), &amax, &g).ok());
      EXPECT_EQ(amax, want);
      EXPECT_EQ(g, MakeGlobalScale(want, r));
    }
  }
}

// RunFp8Key: the same amax, g = MakeFp8KeyScale(amax) (amax / 448 whatever
// the recipe), fp8_scale = g; the same edge rules and argument checks.
TEST(CalibratorCpu, RunFp8KeyGivesTheFp8KeyScale) {
  for (DType t : {DType::kF16, DType::kBF16}) {
    for (const Recipe& r : AllRecipes()) {
      std::vector<uint16_t> x = testing::RandomHalfBits(t, 1031, 23);
      x[7] = 0x7fff;  // NaN
      float want = 0.0f;
      for (uint16_t b : x) {
        const float v = t == DType::kF16 ? HalfBitsToFloat(b) : Bf16BitsToFloat(b);
        if (!std::isnan(v)) want = std::fmax(want, std::fabs(v));
      }
      Calibrator c = MakeCpu(1031, t, r);
      float amax = kPoisonFloat, g = kPoisonFloat, f = kPoisonFloat;
      const TensorView v = TensorView::Contiguous(x.data(), t, {1031});
      ASSERT_TRUE(c.RunFp8Key(v, &amax, &g, nullptr, &f).ok());
      EXPECT_EQ(amax, want);
      EXPECT_EQ(g, MakeFp8KeyScale(want));
      EXPECT_EQ(f, MinFp8ScaleForFp8Keys(g));
      EXPECT_EQ(f, g);
      float g4 = kPoisonFloat, f4 = kPoisonFloat;
      ASSERT_TRUE(c.Run(v, nullptr, &g4, nullptr, &f4).ok());
      EXPECT_EQ(g4, MakeGlobalScale(want, r));
      EXPECT_EQ(f4, MinFp8ScaleFor(g4));
    }
  }
  Calibrator c = MakeCpu(16, DType::kF32);
  float amax = kPoisonFloat, g = kPoisonFloat;
  ASSERT_TRUE(
      c.RunFp8Key(TensorView::Contiguous(static_cast<void*>(nullptr), DType::kF32, {0}), &amax, &g)
          .ok());
  EXPECT_EQ(amax, 0.0f);
  EXPECT_EQ(g, MakeFp8KeyScale(0.0f));
  std::vector<float> x = {1.0f, -2.0f};
  amax = g = kPoisonFloat;
  ExpectInvalid(c.RunFp8Key(TensorView::Contiguous(x.data(), DType::kF32, {2}), &g, &g), "amax");
  ExpectInvalid(c.RunFp8Key(TensorView::Contiguous(x.data(), DType::kF32, {32}), &amax, &g),
                "input");
  EXPECT_EQ(amax, kPoisonFloat);
  EXPECT_EQ(g, kPoisonFloat);
}

TEST(CalibratorCpu, InvalidOptions) {
  ExpectInvalid(Calibrator::Create({-1, DType::kBF16, Device::Cpu(), Recipe()}).status(),
                "options.max_elements");
  ExpectInvalid(Calibrator::Create({8, DType::kU8, Device::Cpu(), Recipe()}).status(),
                "options.dtype");
  ExpectInvalid(
      Calibrator::Create({8, DType::kBF16, Device::Cpu(), Recipe::FourOverSix(300)}).status(),
      "recipe.e4m3_max");
  EXPECT_FALSE(Calibrator::Create({8, DType::kBF16, Device::Cuda(-1), Recipe()}).ok());
  std::string why;
  if (!testing::HasCudaDevice(&why)) {
    EXPECT_EQ(Calibrator::Create({8, DType::kBF16, Device::Cuda(0), Recipe()}).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

TEST(CalibratorCpu, InvalidRunWritesNothing) {
  std::vector<uint16_t> x(32, Enc(DType::kBF16, 1.0f));
  Calibrator c = MakeCpu(16, DType::kBF16);
  float amax = kPoisonFloat, g = kPoisonFloat;
  auto expect_untouched = [&] {
    EXPECT_EQ(amax, kPoisonFloat);
    EXPECT_EQ(g, kPoisonFloat);
  };
  ExpectInvalid(c.Run(TensorView::Contiguous(x.data(), DType::kBF16, {32}), &amax, &g),
                "options.max_elements");
  expect_untouched();
  ExpectInvalid(c.Run(TensorView::Contiguous(x.data(), DType::kF16, {8}), &amax, &g), "input");
  expect_untouched();
  ExpectInvalid(
      c.Run(TensorView::Contiguous(static_cast<void*>(nullptr), DType::kBF16, {8}), &amax, &g),
      "input");
  expect_untouched();
  ExpectInvalid(
      c.Run(TensorView::Contiguous(x.data(), DType::kBF16, {8}, Device::Cuda(0)), &amax, &g),
      "input: expected device cpu");
  expect_untouched();
  ExpectInvalid(c.Run(TensorView::Contiguous(x.data(), DType::kBF16, {-2, 4}), &amax, &g),
                "non-negative");
  expect_untouched();
  ExpectInvalid(
      c.Run(TensorView::Contiguous(reinterpret_cast<char*>(x.data()) + 1, DType::kBF16, {4}), &amax,
            &g),
      "aligned");
  expect_untouched();
  ExpectInvalid(c.Run(TensorView::Contiguous(x.data(), DType::kBF16, {8}), &amax, nullptr),
                "global_scale");
  expect_untouched();
  ExpectInvalid(c.Run(TensorView::Contiguous(x.data(), DType::kBF16, {8}), &g, &g), "amax");
  expect_untouched();
}

TEST(CalibratorCpu, MovesKeepTheOptions) {
  Calibrator a = MakeCpu(10, DType::kF16, Recipe::FourOverSix(256));
  Calibrator b = std::move(a);
  EXPECT_EQ(b.options().max_elements, 10);
  EXPECT_EQ(b.options().recipe, Recipe::FourOverSix(256));
  EXPECT_EQ(b.scratch_bytes(), 0u);
  Calibrator c = MakeCpu(1, DType::kF32);
  c = std::move(b);
  EXPECT_EQ(c.options().dtype, DType::kF16);
}

}  // namespace
}  // namespace fp4kv
