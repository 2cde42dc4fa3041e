// Quantization recipes: which block scale each 16-value block gets.
#ifndef FP4KV_RECIPE_H_
#define FP4KV_RECIPE_H_

#include "absl/status/status.h"
#include "fp4kv/format.h"

namespace fp4kv {

// OK for a usable recipe: kind standard or 4over6, e4m3_max 448 (or 256 for
// 4over6), metric MAE or MSE; fast_math only with 4over6.
absl::Status ValidateRecipe(const Recipe& recipe);

}  // namespace fp4kv

#endif  // FP4KV_RECIPE_H_
