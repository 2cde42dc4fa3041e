// Quantization recipes: which block scale each 16-value block gets, and the
// global decode scale that goes with them.
//
// The valid recipes (nine in all, see AllRecipes()):
//   standard            block scale e4m3(amax / (6 g)); e4m3_max 448.
//   4over6-{mae,mse}-{256,448}[-fast]
//                       also forms e4m3(amax / (4 g)), quantizes the block with
//                       both, and keeps the one whose summed error (|diff| or
//                       diff^2) is strictly lower; a tie keeps amax / 6. "fast"
//                       evaluates the errors in IEEE fp16 arithmetic and may
//                       choose differently on near-ties: a recipe of its own.
// Either way the bytes are ordinary NVFP4; nothing that reads a cache depends
// on the recipe that wrote it.
//
// What e4m3_max means. It is the top of the block-scale range the *global
// scale* is sized for: g = amax / (6 * e4m3_max) (MakeGlobalScale). With 256,
// the block holding the tensor's amax gets block scale 256 from amax / 6 and
// 384 from amax / 4, both representable; with 448 the amax / 4 candidate of
// the largest blocks saturates at 448. The quantizer (QuantizeBlock in
// format.h) does not read e4m3_max: both candidates are encoded with the
// format's own saturation at 448. Clamping the amax / 6 candidate at 256 would
// change nothing under a global scale from MakeGlobalScale (it never exceeds
// 256 there) and would only clip values the format can hold when the data
// outgrows a stale calibration. So two recipes that differ only in e4m3_max
// write identical bytes for the same g; they differ in the g they derive.
//
// Why a cache's global scales and its quantizer must come from one recipe.
// The decode scale a reader multiplies by must be the g the writer divided by.
// If a cache derived the g it publishes to readers from one recipe
// (MakeGlobalScale) while its appends derived theirs from another, every value
// would decode multiplied by E4m3Max(a) / E4m3Max(b) = 1.75 or 1/1.75: the
// whole tensor rescaled, with every byte still well-formed and nothing to flag
// it. And a g sized for 448 under a 4over6 quantizer silently loses the
// amax / 4 option on the largest blocks (it saturates), while a g sized for 256
// under the standard quantizer wastes the top of the scale range. Hence one
// Recipe per cache, used for both.
#ifndef FP4KV_RECIPE_H_
#define FP4KV_RECIPE_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp4kv/format.h"

namespace fp4kv {

// OK for one of the nine valid recipes:
//   kind kStandard: e4m3_max 448, metric kMae (it evaluates no error, so the
//     field must keep its default), fast_math false;
//   kind kFourOverSix: e4m3_max 256 or 448, metric kMae or kMse, fast_math
//     either.
// Otherwise InvalidArgument naming the field ("recipe.e4m3_max: ...").
absl::Status ValidateRecipe(const Recipe& recipe);

// Every valid recipe, standard first, then 4over6 ordered by e4m3_max (256,
// 448), metric (MAE, MSE), fast_math (off, on).
inline constexpr int kNumRecipes = 9;
std::array<Recipe, kNumRecipes> AllRecipes();

// Short stable name for logs and tables: "standard", "4over6-mae-256",
// "4over6-mse-448-fast". An invalid recipe gets
// "invalid(kind=K,e4m3_max=E,metric=M,fast_math=F)".
std::string RecipeName(const Recipe& recipe);

// ---------------------------------------------------------------------------
// Global scale.
// ---------------------------------------------------------------------------

// Top of the block-scale range a recipe's global scale is sized for: 256.0f
// when recipe.e4m3_max == 256, else 448.0f. (Defined for any input; only
// meaningful for a valid recipe.)
FP4KV_HD float E4m3Max(const Recipe& recipe) { return recipe.e4m3_max == 256 ? 256.0f : 448.0f; }

// The global decode scale for data whose largest magnitude is `amax`:
//   g = amax / (6 * E4m3Max(recipe))        (one fp32 division; 6 * 448 and
//                                             6 * 256 are exact)
// so that the block holding amax gets block scale E4m3Max(recipe) under the
// amax / 6 candidate. Defined for every float, on host and device alike:
//   amax == 0, negative or NaN  -> computed as if amax were 1 (an all-zero
//       tensor quantizes to zeros under any g; a g for unit-scale data keeps
//       later data of ordinary size representable, where g = 1 would flush
//       every block with amax below about 0.01 to zero);
//   amax == +inf                -> computed from FLT_MAX (stays finite);
//   a result below FLT_MIN (amax < ~3e-35) -> FLT_MIN;
//   a result above MaxGlobalScale() (amax > ~1.9e38 with e4m3_max 256)
//       -> MaxGlobalScale().
// The result is always positive, finite and normal, hence a valid GlobalScale
// (IsValidGlobalScale).
FP4KV_HD float MakeGlobalScale(float amax, const Recipe& recipe) {
  const float kFltMax = BitsFloat(0x7f7fffffu);
  const float kFltMin = BitsFloat(0x00800000u);
  float a = amax;
  if (!(a > 0.0f)) a = 1.0f;  // zero, negative, NaN
  if (a > kFltMax) a = kFltMax;
  const float g = DivRn(a, MulRn(6.0f, E4m3Max(recipe)));
  if (g > MaxGlobalScale()) return MaxGlobalScale();
  return g < kFltMin ? kFltMin : g;
}

// ---------------------------------------------------------------------------
// Recipe codes: one int64 per recipe, for logs and repro tooling.
//
// Layout, version 1 (bit 0 = least significant):
//   bits  0..7   version, = 1
//   bits  8..15  kind: 0 standard, 1 4over6
//   bits 16..23  metric: 0 MAE, 1 MSE
//   bits 24..31  flags: bit 24 = fast_math; bits 25..31 zero
//   bits 32..47  e4m3_max (448 or 256)
//   bits 48..63  zero (reserved; codes are non-negative)
// e.g. standard = 0x000001C000000001, 4over6-mse-256-fast = 0x0000010001010101.
// A later layout changes the version; RecipeFromCode rejects versions it does
// not know rather than guess.
// ---------------------------------------------------------------------------
inline constexpr int kRecipeCodeVersion = 1;

// The code of a valid recipe; InvalidArgument (from ValidateRecipe) otherwise.
absl::StatusOr<int64_t> RecipeToCode(const Recipe& recipe);

// The recipe of a code; InvalidArgument naming "recipe_code" and the bad
// field for an unknown version, non-zero reserved bits, an out-of-range field,
// or a combination ValidateRecipe rejects.
absl::StatusOr<Recipe> RecipeFromCode(int64_t code);

}  // namespace fp4kv

#endif  // FP4KV_RECIPE_H_
