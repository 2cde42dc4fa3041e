#include "fp4kv/recipe.h"

#include "absl/strings/str_cat.h"

namespace fp4kv {

absl::Status ValidateRecipe(const Recipe& r) {
  if (r.kind != RecipeKind::kStandard && r.kind != RecipeKind::kFourOverSix) {
    return absl::InvalidArgumentError(
        absl::StrCat("recipe.kind: expected standard or 4over6, got ", static_cast<int>(r.kind)));
  }
  if (r.metric != ErrorMetric::kMae && r.metric != ErrorMetric::kMse) {
    return absl::InvalidArgumentError(
        absl::StrCat("recipe.metric: expected MAE or MSE, got ", static_cast<int>(r.metric)));
  }
  if (r.kind == RecipeKind::kStandard) {
    if (r.e4m3_max != 448) {
      return absl::InvalidArgumentError(absl::StrCat(
          "recipe.e4m3_max: expected 448 for the standard recipe, got ", r.e4m3_max));
    }
    if (r.fast_math) {
      return absl::InvalidArgumentError(
          "recipe.fast_math: expected false for the standard recipe (it has no error evaluation), got true");
    }
  } else if (r.e4m3_max != 256 && r.e4m3_max != 448) {
    return absl::InvalidArgumentError(
        absl::StrCat("recipe.e4m3_max: expected 256 or 448 for 4over6, got ", r.e4m3_max));
  }
  return absl::OkStatus();
}

}  // namespace fp4kv
