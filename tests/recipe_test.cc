// Recipes: validation, codes, names, global scales, and the 4over6 block
// choice, on the CPU.
#include "fp4kv/recipe.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fp4kv/format.h"
#include "fp4kv/ops.h"
#include "fp4kv/tensor.h"
#include "gtest/gtest.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

constexpr ErrorMetric kMae = ErrorMetric::kMae;
constexpr ErrorMetric kMse = ErrorMetric::kMse;

Recipe MakeRecipe(int kind, int e4m3_max, int metric, bool fast_math) {
  Recipe r;
  r.kind = static_cast<RecipeKind>(kind);
  r.e4m3_max = e4m3_max;
  r.metric = static_cast<ErrorMetric>(metric);
  r.fast_math = fast_math;
  return r;
}

std::vector<Recipe> FourOverSixRecipes() {
  std::vector<Recipe> out;
  for (const Recipe& r : AllRecipes()) {
    if (r.kind == RecipeKind::kFourOverSix) out.push_back(r);
  }
  return out;
}

void ExpectInvalid(const absl::Status& s, const std::string& field) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(field), std::string::npos) << s;
}

// ------------------------------------------------------------- validation

TEST(RecipeValidate, AllRecipesAreTheNineValidOnes) {
  const auto all = AllRecipes();
  ASSERT_EQ(all.size(), 9u);
  EXPECT_EQ(all[0], Recipe::Standard());
  std::set<std::string> names;
  for (const Recipe& r : all) {
    EXPECT_TRUE(ValidateRecipe(r).ok()) << RecipeName(r);
    names.insert(RecipeName(r));
  }
  EXPECT_EQ(names.size(), all.size());
  // Exhaustive over a box of field values: exactly the nine are valid.
  int valid = 0;
  for (int kind = 0; kind < 3; ++kind) {
    for (int e : {0, 255, 256, 384, 448, 449}) {
      for (int metric = 0; metric < 3; ++metric) {
        for (bool fast : {false, true}) {
          const Recipe r = MakeRecipe(kind, e, metric, fast);
          const bool listed = std::find(all.begin(), all.end(), r) != all.end();
          EXPECT_EQ(ValidateRecipe(r).ok(), listed) << RecipeName(r);
          valid += listed ? 1 : 0;
        }
      }
    }
  }
  EXPECT_EQ(valid, 9);
}

TEST(RecipeValidate, NamesTheBadField) {
  ExpectInvalid(ValidateRecipe(MakeRecipe(7, 448, 0, false)), "recipe.kind");
  ExpectInvalid(ValidateRecipe(MakeRecipe(1, 448, 5, false)), "recipe.metric");
  ExpectInvalid(ValidateRecipe(MakeRecipe(1, 300, 0, false)), "recipe.e4m3_max");
  ExpectInvalid(ValidateRecipe(MakeRecipe(0, 256, 0, false)), "recipe.e4m3_max");
  ExpectInvalid(ValidateRecipe(MakeRecipe(0, 448, 0, true)), "recipe.fast_math");
  ExpectInvalid(ValidateRecipe(MakeRecipe(0, 448, 1, false)), "recipe.metric");
  // The ops reject an invalid recipe at Create.
  LinearQuantizer::Options lo;
  lo.recipe = MakeRecipe(1, 300, 0, false);
  ExpectInvalid(LinearQuantizer::Create(lo).status(), "recipe.e4m3_max");
  Appender::Options ao;
  ao.geometry = CacheGeometry{1, 16, 16, 1, 1, Layout::kNHD};
  ao.recipe = MakeRecipe(0, 448, 0, true);
  ExpectInvalid(Appender::Create(ao).status(), "recipe.fast_math");
}

TEST(RecipeName, StableNames) {
  EXPECT_EQ(RecipeName(Recipe::Standard()), "standard");
  EXPECT_EQ(RecipeName(Recipe::FourOverSix(256, kMae, false)), "4over6-mae-256");
  EXPECT_EQ(RecipeName(Recipe::FourOverSix(448, kMse, true)), "4over6-mse-448-fast");
  EXPECT_EQ(RecipeName(MakeRecipe(1, 300, 0, false)),
            "invalid(kind=1,e4m3_max=300,metric=0,fast_math=0)");
}

// ------------------------------------------------------------------- codes

TEST(RecipeCode, RoundTripsEveryValidRecipe) {
  std::set<int64_t> codes;
  for (const Recipe& r : AllRecipes()) {
    absl::StatusOr<int64_t> code = RecipeToCode(r);
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_GE(*code, 0);
    EXPECT_EQ(*code & 0xff, kRecipeCodeVersion);
    absl::StatusOr<Recipe> back = RecipeFromCode(*code);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, r) << RecipeName(r);
    codes.insert(*code);
  }
  EXPECT_EQ(codes.size(), static_cast<size_t>(kNumRecipes));
}

TEST(RecipeCode, DocumentedLayout) {
  EXPECT_EQ(*RecipeToCode(Recipe::Standard()), 0x000001C000000001);
  EXPECT_EQ(*RecipeToCode(Recipe::FourOverSix(256, kMse, true)), 0x0000010001010101);
  EXPECT_EQ(*RecipeToCode(Recipe::FourOverSix(448, kMae, false)), 0x000001C000000101);
  EXPECT_EQ(*RecipeToCode(Recipe::FourOverSix(256, kMse, false)), 0x0000010000010101);
}

TEST(RecipeCode, RejectsInvalidRecipesAndCodes) {
  ExpectInvalid(RecipeToCode(MakeRecipe(1, 300, 0, false)).status(), "recipe.e4m3_max");
  ExpectInvalid(RecipeToCode(MakeRecipe(0, 448, 0, true)).status(), "recipe.fast_math");

  const int64_t good = *RecipeToCode(Recipe::FourOverSix(256, kMae, false));
  struct Case {
    int64_t code;
    const char* what;
  } cases[] = {
      {0, "version"},
      {good & ~int64_t{0xff}, "version"},
      {(good & ~int64_t{0xff}) | 2, "version"},
      {-1, "version"},
      {good | (int64_t{1} << 48), "reserved"},
      {good | (int64_t{1} << 62), "reserved"},
      {static_cast<int64_t>(static_cast<uint64_t>(good) | (uint64_t{1} << 63)), "reserved"},
      {good | (int64_t{2} << 8), "kind"},
      {good | (int64_t{2} << 16), "metric"},
      {good | (int64_t{2} << 24), "flags"},
      {good | (int64_t{0x80} << 24), "flags"},
      {(good & ~(int64_t{0xffff} << 32)) | (int64_t{300} << 32), "recipe.e4m3_max"},
      {(good & ~(int64_t{0xffff} << 32)), "recipe.e4m3_max"},
      // standard with 256 / MSE / fast_math
      {(int64_t{256} << 32) | 1, "recipe.e4m3_max"},
      {(int64_t{448} << 32) | (int64_t{1} << 16) | 1, "recipe.metric"},
      {(int64_t{448} << 32) | (int64_t{1} << 24) | 1, "recipe.fast_math"},
  };
  for (const Case& c : cases) {
    absl::Status s = RecipeFromCode(c.code).status();
    ExpectInvalid(s, "recipe_code");
    ExpectInvalid(s, c.what);
  }
}

// ------------------------------------------------------------ global scale

TEST(GlobalScale, E4m3Max) {
  EXPECT_EQ(E4m3Max(Recipe::Standard()), 448.0f);
  EXPECT_EQ(E4m3Max(Recipe::FourOverSix(256)), 256.0f);
  EXPECT_EQ(E4m3Max(Recipe::FourOverSix(448)), 448.0f);
}

TEST(GlobalScale, ExactValuesAndSpecialAmax) {
  const Recipe s448 = Recipe::Standard();
  const Recipe f256 = Recipe::FourOverSix(256);
  EXPECT_EQ(MakeGlobalScale(2688.0f, s448), 1.0f);
  EXPECT_EQ(MakeGlobalScale(1536.0f, f256), 1.0f);
  EXPECT_EQ(MakeGlobalScale(3.0f, f256), 3.0f / 1536.0f);
  // amax 0 (and -0, negative, NaN): as if amax were 1.
  for (const Recipe& r : {s448, f256}) {
    const float unit = MakeGlobalScale(1.0f, r);
    EXPECT_EQ(unit, 1.0f / (6.0f * E4m3Max(r)));
    EXPECT_EQ(MakeGlobalScale(0.0f, r), unit);
    EXPECT_EQ(MakeGlobalScale(-0.0f, r), unit);
    EXPECT_EQ(MakeGlobalScale(-5.0f, r), unit);
    EXPECT_EQ(MakeGlobalScale(std::nanf(""), r), unit);
    // +inf: from FLT_MAX, clamped to the largest valid global scale.
    const float big = MakeGlobalScale(INFINITY, r);
    EXPECT_TRUE(std::isfinite(big));
    EXPECT_EQ(big, std::min(FLT_MAX / (6.0f * E4m3Max(r)), MaxGlobalScale()));
    EXPECT_TRUE(IsValidGlobalScale(big));
    // Tiny amax: never zero or subnormal.
    EXPECT_EQ(MakeGlobalScale(1e-45f, r), FLT_MIN);
    EXPECT_EQ(MakeGlobalScale(FLT_MIN, r), FLT_MIN);
  }
}

// Under g = MakeGlobalScale(amax, recipe), the block holding amax gets block
// scale E4m3Max(recipe) from amax / 6, and (for 256) 384 from amax / 4.
TEST(GlobalScale, TopBlockScaleIsE4m3Max) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> expo(-30.0f, 30.0f);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  for (int i = 0; i < 20000; ++i) {
    const float amax = std::ldexp(mant(rng), static_cast<int>(expo(rng)));
    for (const Recipe& r : AllRecipes()) {
      const float g = MakeGlobalScale(amax, r);
      const uint8_t b6 = E4m3Encode(DivRn(amax, MulRn(6.0f, g)));
      EXPECT_EQ(E4m3Decode(b6), E4m3Max(r)) << amax << " " << RecipeName(r);
      if (r.e4m3_max == 256) {
        const uint8_t b4 = E4m3Encode(DivRn(amax, MulRn(4.0f, g)));
        EXPECT_EQ(E4m3Decode(b4), 384.0f) << amax;
      }
    }
  }
}

// ------------------------------------------------------ 4over6 block choice

struct Candidates {
  uint8_t b6, b4;
  uint32_t p6[2], p4[2];
};

Candidates MakeCandidates(const float (&x)[kBlockSize], float g) {
  float amax = 0.0f;
  for (float v : x) amax = std::fmax(amax, std::fabs(v));
  Candidates c;
  c.b6 = E4m3Encode(DivRn(amax, MulRn(6.0f, g)));
  c.b4 = E4m3Encode(DivRn(amax, MulRn(4.0f, g)));
  EncodeBlockWithScale(x, g, c.b6, c.p6);
  EncodeBlockWithScale(x, g, c.b4, c.p4);
  return c;
}

void Fill(float (&x)[kBlockSize], std::initializer_list<float> head, float rest = 0.0f) {
  int i = 0;
  for (float v : head) x[i++] = v;
  while (i < kBlockSize) x[i++] = rest;
}

// All 16 values 4, g = 1: amax/6 gives scale e4m3(0.667) = 0.6875 and codes 6
// (decoding to 4.125, error 0.125 each); amax/4 gives scale 1 and exact codes 4.
TEST(FourOverSix, AmaxOver4WinsOnUniformBlock) {
  float x[kBlockSize];
  Fill(x, {}, 4.0f);
  const Candidates c = MakeCandidates(x, 1.0f);
  EXPECT_EQ(E4m3Decode(c.b6), 0.6875f);
  EXPECT_EQ(E4m3Decode(c.b4), 1.0f);
  EXPECT_EQ(c.p6[0], 0x77777777u);
  EXPECT_EQ(c.p4[0], 0x66666666u);
  EXPECT_EQ(CandidateError(x, c.p6, c.b6, 1.0f, Recipe::FourOverSix(256, kMae)), 2.0f);
  EXPECT_EQ(CandidateError(x, c.p6, c.b6, 1.0f, Recipe::FourOverSix(256, kMse)), 0.25f);
  EXPECT_EQ(CandidateError(x, c.p4, c.b4, 1.0f, Recipe::FourOverSix(256, kMae)), 0.0f);

  uint32_t p[2];
  EXPECT_EQ(QuantizeBlock(x, 1.0f, Recipe::Standard(), p), c.b6);
  EXPECT_EQ(p[0], 0x77777777u);
  for (const Recipe& r : FourOverSixRecipes()) {
    EXPECT_EQ(QuantizeBlock(x, 1.0f, r, p), 0x38) << RecipeName(r);  // 1.0
    EXPECT_EQ(p[0], 0x66666666u);
    EXPECT_EQ(p[1], 0x66666666u);
  }
}

// {6, 3, 1.5, 1, 0.5, 0...}, g = 1: all on the amax/6 grid (scale 1, error 0);
// under scale 1.5, 1 -> 0.75 and 0.5 -> 0.75 (error 0.25 each).
TEST(FourOverSix, AmaxOver6WinsOnGridBlock) {
  float x[kBlockSize];
  Fill(x, {6.0f, 3.0f, 1.5f, 1.0f, 0.5f});
  const Candidates c = MakeCandidates(x, 1.0f);
  EXPECT_EQ(c.b6, 0x38);  // 1.0
  EXPECT_EQ(c.b4, 0x3c);  // 1.5
  EXPECT_EQ(CandidateError(x, c.p6, c.b6, 1.0f, Recipe::FourOverSix(256, kMae)), 0.0f);
  EXPECT_EQ(CandidateError(x, c.p4, c.b4, 1.0f, Recipe::FourOverSix(256, kMae)), 0.5f);
  EXPECT_EQ(CandidateError(x, c.p4, c.b4, 1.0f, Recipe::FourOverSix(256, kMse)), 0.125f);
  for (const Recipe& r : FourOverSixRecipes()) {
    uint32_t p[2];
    EXPECT_EQ(QuantizeBlock(x, 1.0f, r, p), 0x38) << RecipeName(r);
    EXPECT_EQ(p[0], c.p6[0]);
    EXPECT_EQ(p[1], c.p6[1]);
  }
}

// {6, 3, 0.25, 0...}, g = 1: 0.25 rounds to 0 under both scales (0.25 and
// 0.1667 -> 0), error 0.25 each; 6 and 3 are exact under both. Equal errors
// keep amax/6.
TEST(FourOverSix, TieKeepsAmaxOver6) {
  float x[kBlockSize];
  Fill(x, {6.0f, 3.0f, 0.25f});
  const Candidates c = MakeCandidates(x, 1.0f);
  ASSERT_NE(c.b6, c.b4);
  for (const Recipe& r : FourOverSixRecipes()) {
    const float e6 = CandidateError(x, c.p6, c.b6, 1.0f, r);
    const float e4 = CandidateError(x, c.p4, c.b4, 1.0f, r);
    EXPECT_EQ(e6, r.metric == kMae ? 0.25f : 0.0625f) << RecipeName(r);
    EXPECT_EQ(e4, e6) << RecipeName(r);
    uint32_t p[2];
    EXPECT_EQ(QuantizeBlock(x, 1.0f, r, p), c.b6) << RecipeName(r);
    EXPECT_EQ(p[0], c.p6[0]);
  }
}

// A near-tie that fp16 arithmetic cannot resolve. g = 1, scales 1 and 1.5:
//   6              -> exact under both
//   3.501953125    -> amax/6: 4 (err 0.498046875)  amax/4: 3 (err 0.501953125)
//   4.25390625     -> amax/6: 4 (err 0.25390625)   amax/4: 4.5 (err 0.24609375)
//   3.5 (x7)       -> 4 or 3, err 0.5 under both
// MAE: e6 = 4.251953125, e4 = 4.248046875, so the exact recipe keeps amax/4.
// In fp16 the running sums are exact until the last 3.5, where both land
// half an ulp (2^-9) from 4.25 and round to it: a tie, so fast-math keeps
// amax/6.
TEST(FourOverSix, FastMathDiffersOnNearTie) {
  float x[kBlockSize];
  Fill(x, {6.0f, 3.501953125f, 4.25390625f, 3.5f, 3.5f, 3.5f, 3.5f, 3.5f, 3.5f, 3.5f});
  for (float v : x) ASSERT_EQ(RoundToHalf(v), v);  // valid fp16 input
  const Candidates c = MakeCandidates(x, 1.0f);
  const Recipe exact = Recipe::FourOverSix(256, kMae, false);
  const Recipe fast = Recipe::FourOverSix(256, kMae, true);
  EXPECT_EQ(CandidateError(x, c.p6, c.b6, 1.0f, exact), 4.251953125f);
  EXPECT_EQ(CandidateError(x, c.p4, c.b4, 1.0f, exact), 4.248046875f);
  EXPECT_EQ(CandidateError(x, c.p6, c.b6, 1.0f, fast), 4.25f);
  EXPECT_EQ(CandidateError(x, c.p4, c.b4, 1.0f, fast), 4.25f);
  uint32_t p[2];
  EXPECT_EQ(QuantizeBlock(x, 1.0f, exact, p), c.b4);
  EXPECT_EQ(QuantizeBlock(x, 1.0f, fast, p), c.b6);
  // The e4m3_max field does not enter the quantizer.
  EXPECT_EQ(QuantizeBlock(x, 1.0f, Recipe::FourOverSix(448, kMae, false), p), c.b4);
  EXPECT_EQ(QuantizeBlock(x, 1.0f, Recipe::FourOverSix(448, kMae, true), p), c.b6);
}

// Random fp16 data: the fast-math recipes pick differently on some blocks,
// for both metrics, and agree on the vast majority.
TEST(FourOverSix, FastMathDiffersRarelyOnRandomData) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (ErrorMetric m : {kMae, kMse}) {
    int differ = 0;
    const int blocks = 20000;
    for (int b = 0; b < blocks; ++b) {
      float x[kBlockSize];
      for (float& v : x) v = RoundToHalf(normal(rng));
      uint32_t p[2];
      const uint8_t e = QuantizeBlock(x, 1.0f, Recipe::FourOverSix(256, m, false), p);
      const uint8_t f = QuantizeBlock(x, 1.0f, Recipe::FourOverSix(256, m, true), p);
      differ += e != f ? 1 : 0;
    }
    EXPECT_GT(differ, 0);
    EXPECT_LT(differ, blocks / 100);
  }
}

// The largest block under each recipe's own g. Block {amax, 0.75 amax, 0...}:
// with e4m3_max 256 (g = 1 for amax 1536) scale 384 represents it exactly
// (codes 4 and 3) and wins; with 448 (g = 1 for amax 2688) amax/4 would be 672
// and saturates to 448, the same as amax/6, so the block keeps 448 and 0.75
// amax (4.5 units) rounds to 4 units.
TEST(FourOverSix, HeadroomOf256KeepsTheAmaxOver4Option) {
  float x[kBlockSize];
  Fill(x, {1536.0f, 1152.0f});
  const Recipe r256 = Recipe::FourOverSix(256, kMae);
  ASSERT_EQ(MakeGlobalScale(1536.0f, r256), 1.0f);
  uint32_t p[2];
  EXPECT_EQ(QuantizeBlock(x, 1.0f, r256, p), 0x7c);  // 384
  float y[kBlockSize];
  DequantizeBlock(p, 0x7c, 1.0f, y);
  EXPECT_EQ(y[0], 1536.0f);
  EXPECT_EQ(y[1], 1152.0f);

  Fill(x, {2688.0f, 2016.0f});
  const Recipe r448 = Recipe::FourOverSix(448, kMae);
  ASSERT_EQ(MakeGlobalScale(2688.0f, r448), 1.0f);
  const Candidates c = MakeCandidates(x, 1.0f);
  EXPECT_EQ(c.b6, 0x7e);  // 448
  EXPECT_EQ(c.b4, 0x7e);  // 672 saturates
  EXPECT_EQ(QuantizeBlock(x, 1.0f, r448, p), 0x7e);
  DequantizeBlock(p, 0x7e, 1.0f, y);
  EXPECT_EQ(y[1], 1792.0f);
}

// NaN in a block makes both errors NaN: the comparison is false and the
// block keeps amax/6 (here amax/4 would otherwise win, see the uniform block).
TEST(FourOverSix, NanAndInfInBlock) {
  float x[kBlockSize];
  Fill(x, {std::nanf("")}, 4.0f);
  for (const Recipe& r : FourOverSixRecipes()) {
    uint32_t p[2];
    EXPECT_EQ(QuantizeBlock(x, 1.0f, r, p), 0x33) << RecipeName(r);  // 0.6875
  }
  // An infinite input: amax is infinite and both candidates saturate to 448.
  Fill(x, {-INFINITY}, 4.0f);
  const Candidates c = MakeCandidates(x, 1.0f);
  EXPECT_EQ(c.b6, 0x7e);
  EXPECT_EQ(c.b4, 0x7e);
  for (const Recipe& r : AllRecipes()) {
    uint32_t p[2];
    EXPECT_EQ(QuantizeBlock(x, 1.0f, r, p), 0x7e) << RecipeName(r);
    EXPECT_EQ(p[0] & 0xfu, 0xfu);  // -6
  }
}

// Fast-math caveat: values beyond the fp16 range make its errors inf/NaN, so
// such blocks keep amax/6 where the exact recipe picks amax/4.
TEST(FourOverSix, FastMathBeyondHalfRangeKeepsAmaxOver6) {
  float x[kBlockSize];
  const float g = 65536.0f;
  Fill(x, {}, 4.0f * g);  // the uniform block, scaled past 65504
  uint32_t p[2];
  EXPECT_EQ(QuantizeBlock(x, g, Recipe::FourOverSix(256, kMae, false), p), 0x38);
  EXPECT_EQ(QuantizeBlock(x, g, Recipe::FourOverSix(256, kMae, true), p), 0x33);
}

// Random blocks over many magnitudes, every 4over6 recipe:
//  - the result is one of the two candidates, bytes and scale;
//  - amax/4 is chosen iff its error (under the recipe) is strictly lower;
//  - for exact recipes the chosen block's error is never above the standard
//    one, also measured independently in double (up to fp32 summation
//    rounding) when both candidates are representable;
//  - the chosen bytes decode with the ordinary DequantizeBlock to the values
//    whose error was evaluated.
TEST(FourOverSix, ChoiceIsTheLowerErrorCandidate) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::student_t_distribution<float> heavy(2.0f);
  std::uniform_int_distribution<int> octave(-20, 20);
  std::uniform_int_distribution<int> kind(0, 2);
  const std::vector<Recipe> recipes = FourOverSixRecipes();
  int chose4 = 0, chose6 = 0;
  for (int b = 0; b < 4000; ++b) {
    float x[kBlockSize];
    const float mag = std::ldexp(1.0f, octave(rng));
    const int k = kind(rng);
    for (float& v : x) {
      const float z = k == 0 ? normal(rng) : (k == 1 ? heavy(rng) : normal(rng) * 0.05f);
      v = Bf16BitsToFloat(FloatToBf16Bits(mag * z));
    }
    if (k == 2) x[b % kBlockSize] = Bf16BitsToFloat(FloatToBf16Bits(30.0f * mag));
    const float g = std::ldexp(1.0f, octave(rng) / 2) * 1.3f;
    const Candidates c = MakeCandidates(x, g);
    float amax = 0.0f;
    for (float v : x) amax = std::fmax(amax, std::fabs(v));
    for (const Recipe& r : recipes) {
      uint32_t p[2];
      const uint8_t s = QuantizeBlock(x, g, r, p);
      const float e6 = CandidateError(x, c.p6, c.b6, g, r);
      const float e4 = CandidateError(x, c.p4, c.b4, g, r);
      if (e4 < e6) {
        ASSERT_EQ(s, c.b4) << RecipeName(r);
        ASSERT_EQ(p[0], c.p4[0]);
        ASSERT_EQ(p[1], c.p4[1]);
        ++chose4;
      } else {
        ASSERT_EQ(s, c.b6) << RecipeName(r);
        ASSERT_EQ(p[0], c.p6[0]);
        ASSERT_EQ(p[1], c.p6[1]);
        ++chose6;
      }
      float y[kBlockSize];
      DequantizeBlock(p, s, g, y);
      if (!r.fast_math) {
        // The evaluated error is the error of the ordinary decode.
        float e = 0.0f;
        for (int i = 0; i < kBlockSize; ++i) {
          const float d = x[i] - y[i];
          e += r.metric == kMae ? std::fabs(d) : d * d;
        }
        EXPECT_EQ(e, s == c.b4 && s != c.b6 ? e4 : e6);
        EXPECT_LE(e, e6);
        const bool both_representable = DivRn(amax, MulRn(4.0f, g)) <= kE4m3Max;
        if (both_representable) {
          float y6[kBlockSize];
          DequantizeBlock(c.p6, c.b6, g, y6);
          double ed = 0.0, e6d = 0.0;
          for (int i = 0; i < kBlockSize; ++i) {
            const double d = static_cast<double>(x[i]) - y[i];
            const double d6 = static_cast<double>(x[i]) - y6[i];
            ed += r.metric == kMae ? std::fabs(d) : d * d;
            e6d += r.metric == kMae ? std::fabs(d6) : d6 * d6;
          }
          EXPECT_LE(ed, e6d * (1.0 + 1e-5)) << RecipeName(r);
        }
      }
    }
  }
  // The data exercises both outcomes.
  EXPECT_GT(chose4, 1000);
  EXPECT_GT(chose6, 1000);
}

// Two recipes that differ only in e4m3_max write the same bytes for the same
// g: e4m3_max sizes the global scale, not the quantizer.
TEST(FourOverSix, E4m3MaxDoesNotEnterTheQuantizer) {
  const std::vector<uint16_t> bits = testing::RandomHalfBits(DType::kBF16, 16 * 2000, 5);
  for (ErrorMetric m : {kMae, kMse}) {
    for (bool fast : {false, true}) {
      for (size_t b = 0; b < bits.size(); b += kBlockSize) {
        float x[kBlockSize];
        for (int i = 0; i < kBlockSize; ++i) x[i] = Bf16BitsToFloat(bits[b + i]);
        uint32_t p1[2], p2[2];
        ASSERT_EQ(QuantizeBlock(x, 0.01f, Recipe::FourOverSix(256, m, fast), p1),
                  QuantizeBlock(x, 0.01f, Recipe::FourOverSix(448, m, fast), p2));
        ASSERT_EQ(p1[0], p2[0]);
        ASSERT_EQ(p1[1], p2[1]);
      }
    }
  }
}

// Through the op layer on CPU views: QuantizeLinear writes, per 16-value
// block, exactly QuantizeBlock's bytes for every recipe, and DequantizeLinear
// (which knows no recipe) decodes them.
TEST(FourOverSix, LinearOpsOnCpuForEveryRecipe) {
  const int64_t rows = 37, cols = 128;
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    const std::vector<uint16_t> in = testing::RandomHalfBits(dtype, rows * cols, 21);
    for (const Recipe& r : AllRecipes()) {
      const float g = MakeGlobalScale(40.0f, r);
      std::vector<uint8_t> packed(rows * cols / 2, testing::kPoison);
      std::vector<uint8_t> scales(rows * cols / kBlockSize, testing::kPoison);
      std::vector<uint16_t> out(rows * cols, 0xffff);
      const TensorView vin = TensorView::Contiguous(in.data(), dtype, {rows, cols});
      const TensorView vp = TensorView::Contiguous(packed.data(), DType::kU8, {rows, cols / 2});
      const TensorView vs = TensorView::Contiguous(scales.data(), DType::kU8, {rows, cols / 16});
      const TensorView vo = TensorView::Contiguous(out.data(), dtype, {rows, cols});
      ASSERT_TRUE(QuantizeLinear(vin, vp, vs, GlobalScale::Value(g), r).ok()) << RecipeName(r);
      ASSERT_TRUE(DequantizeLinear(vp, vs, vo, GlobalScale::Value(g)).ok());
      for (int64_t blk = 0; blk < rows * cols / kBlockSize; ++blk) {
        float x[kBlockSize];
        for (int i = 0; i < kBlockSize; ++i) {
          const uint16_t h = in[blk * kBlockSize + i];
          x[i] = dtype == DType::kF16 ? HalfBitsToFloat(h) : Bf16BitsToFloat(h);
        }
        uint32_t p[2];
        const uint8_t s = QuantizeBlock(x, g, r, p);
        ASSERT_EQ(scales[blk], s) << RecipeName(r) << " block " << blk;
        for (int i = 0; i < kBlockBytes; ++i) {
          ASSERT_EQ(packed[blk * kBlockBytes + i], static_cast<uint8_t>(p[i / 4] >> (8 * (i % 4))));
        }
        float y[kBlockSize];
        DequantizeBlock(p, s, g, y);
        for (int i = 0; i < kBlockSize; ++i) {
          const uint16_t want =
              dtype == DType::kF16 ? FloatToHalfBits(y[i]) : FloatToBf16Bits(y[i]);
          ASSERT_EQ(out[blk * kBlockSize + i], want);
        }
      }
    }
  }
}

}  // namespace
}  // namespace fp4kv
