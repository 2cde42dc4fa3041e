#include "fp4kv/recipe.h"

#include "absl/strings/str_cat.h"

namespace fp4kv {
namespace {

const char* MetricName(ErrorMetric m) { return m == ErrorMetric::kMse ? "mse" : "mae"; }

// Field positions of code version 1 (see recipe.h).
constexpr int kVersionShift = 0;
constexpr int kKindShift = 8;
constexpr int kMetricShift = 16;
constexpr int kFlagsShift = 24;
constexpr int kE4m3MaxShift = 32;
constexpr int kReservedShift = 48;
constexpr uint64_t kByte = 0xffu;
constexpr uint64_t kFastMathFlag = 0x1u;

}  // namespace

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
      return absl::InvalidArgumentError(
          absl::StrCat("recipe.e4m3_max: expected 448 for the standard recipe, got ", r.e4m3_max));
    }
    if (r.metric != ErrorMetric::kMae) {
      return absl::InvalidArgumentError(
          "recipe.metric: expected MAE (the default) for the standard recipe, which evaluates no "
          "error, got MSE");
    }
    if (r.fast_math) {
      return absl::InvalidArgumentError(
          "recipe.fast_math: expected false for the standard recipe (it has no error evaluation), "
          "got true");
    }
  } else if (r.e4m3_max != 256 && r.e4m3_max != 448) {
    return absl::InvalidArgumentError(
        absl::StrCat("recipe.e4m3_max: expected 256 or 448 for 4over6, got ", r.e4m3_max));
  }
  return absl::OkStatus();
}

std::array<Recipe, kNumRecipes> AllRecipes() {
  std::array<Recipe, kNumRecipes> all;
  int n = 0;
  all[n++] = Recipe::Standard();
  for (int e4m3_max : {256, 448}) {
    for (ErrorMetric metric : {ErrorMetric::kMae, ErrorMetric::kMse}) {
      for (bool fast_math : {false, true}) {
        all[n++] = Recipe::FourOverSix(e4m3_max, metric, fast_math);
      }
    }
  }
  return all;
}

std::string RecipeName(const Recipe& r) {
  if (!ValidateRecipe(r).ok()) {
    return absl::StrCat("invalid(kind=", static_cast<int>(r.kind), ",e4m3_max=", r.e4m3_max,
                        ",metric=", static_cast<int>(r.metric), ",fast_math=", r.fast_math ? 1 : 0,
                        ")");
  }
  if (r.kind == RecipeKind::kStandard) return "standard";
  return absl::StrCat("4over6-", MetricName(r.metric), "-", r.e4m3_max, r.fast_math ? "-fast" : "");
}

absl::StatusOr<int64_t> RecipeToCode(const Recipe& r) {
  if (absl::Status s = ValidateRecipe(r); !s.ok()) return s;
  const uint64_t code = (static_cast<uint64_t>(kRecipeCodeVersion) << kVersionShift) |
                        (static_cast<uint64_t>(r.kind) << kKindShift) |
                        (static_cast<uint64_t>(r.metric) << kMetricShift) |
                        ((r.fast_math ? kFastMathFlag : 0u) << kFlagsShift) |
                        (static_cast<uint64_t>(r.e4m3_max) << kE4m3MaxShift);
  return static_cast<int64_t>(code);
}

absl::StatusOr<Recipe> RecipeFromCode(int64_t code) {
  const uint64_t u = static_cast<uint64_t>(code);
  const uint64_t version = (u >> kVersionShift) & kByte;
  if (version != kRecipeCodeVersion) {
    return absl::InvalidArgumentError(absl::StrCat("recipe_code: expected version ",
                                                   kRecipeCodeVersion, " in bits 0..7, got ",
                                                   version, " (code ", code, ")"));
  }
  const uint64_t reserved = u >> kReservedShift;
  if (reserved != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("recipe_code: expected zero reserved bits 48..63, got 0x", absl::Hex(reserved),
                     " (code ", code, ")"));
  }
  const uint64_t kind = (u >> kKindShift) & kByte;
  const uint64_t metric = (u >> kMetricShift) & kByte;
  const uint64_t flags = (u >> kFlagsShift) & kByte;
  const uint64_t e4m3_max = (u >> kE4m3MaxShift) & 0xffffu;
  if (kind > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("recipe_code: expected kind 0 (standard) or 1 (4over6) in bits 8..15, got ",
                     kind, " (code ", code, ")"));
  }
  if (metric > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("recipe_code: expected metric 0 (MAE) or 1 (MSE) in bits 16..23, got ", metric,
                     " (code ", code, ")"));
  }
  if ((flags & ~kFastMathFlag) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "recipe_code: expected only the fast_math flag (bit 24) in bits 24..31, got flags 0x",
        absl::Hex(flags), " (code ", code, ")"));
  }
  Recipe r;
  r.kind = static_cast<RecipeKind>(kind);
  r.metric = static_cast<ErrorMetric>(metric);
  r.fast_math = (flags & kFastMathFlag) != 0;
  r.e4m3_max = static_cast<int>(e4m3_max);
  if (absl::Status s = ValidateRecipe(r); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("recipe_code: ", s.message(), " (code ", code, ")"));
  }
  return r;
}

}  // namespace fp4kv
