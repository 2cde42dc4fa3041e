// Quantizes and dequantizes through the installed library, and checks that
// format.h inlined here (with this project's flags) writes the library's
// bytes, for the recipes whose arithmetic could be contracted into FMAs.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "fp4kv/format.h"
#include "fp4kv/ops.h"

namespace {

using fp4kv::DType;
using fp4kv::TensorView;

// Bytes of QuantizeLinear (compiled inside the library) against QuantizeBlock
// compiled here. Returns the number of blocks that differ.
int CompareWithLibrary(const fp4kv::Recipe& recipe, const std::vector<uint16_t>& in, int64_t m,
                       int64_t k, float g) {
  std::vector<uint8_t> packed(m * k / 2), scales(m * k / 16);
  const absl::Status s = fp4kv::QuantizeLinear(
      TensorView::Contiguous(in.data(), DType::kBF16, {m, k}),
      TensorView::Contiguous(packed.data(), DType::kU8, {m, k / 2}),
      TensorView::Contiguous(scales.data(), DType::kE4M3, {m, k / 16}),
      fp4kv::GlobalScale::Value(g), recipe);
  if (!s.ok()) {
    std::printf("consumer: %s\n", s.ToString().c_str());
    return -1;
  }
  int differ = 0;
  for (int64_t b = 0; b < m * k / 16; ++b) {
    float x[fp4kv::kBlockSize];
    for (int i = 0; i < fp4kv::kBlockSize; ++i) x[i] = fp4kv::Bf16BitsToFloat(in[16 * b + i]);
    uint32_t words[2];
    const uint8_t scale = fp4kv::QuantizeBlock(x, g, recipe, words);
    uint8_t bytes[8];
    std::memcpy(bytes, words, 8);
    if (scale != scales[b] || std::memcmp(bytes, &packed[8 * b], 8) != 0) ++differ;
  }
  return differ;
}

}  // namespace

int main() {
  const int64_t m = 64, k = 128;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> in(m * k), out(m * k);
  for (auto& v : in) v = fp4kv::FloatToBf16Bits(normal(rng) * std::exp2(normal(rng) * 3));
  const float g = 1.0f / 256.0f;
  int differ = 0;
  for (const fp4kv::Recipe& r :
       {fp4kv::Recipe::Standard(), fp4kv::Recipe::FourOverSix(256, fp4kv::ErrorMetric::kMse),
        fp4kv::Recipe::FourOverSix(256, fp4kv::ErrorMetric::kMae),
        fp4kv::Recipe::FourOverSix(256, fp4kv::ErrorMetric::kMse, true)}) {
    const int d = CompareWithLibrary(r, in, m, k, g);
    if (d != 0) {
      std::printf("consumer: %d blocks differ from the library's bytes\n", d);
      differ += d < 0 ? 1 : d;
    }
  }
  // Round trip of one row.
  std::vector<uint8_t> packed(k / 2), scales(k / 16);
  absl::Status s = fp4kv::QuantizeLinear(TensorView::Contiguous(in.data(), DType::kBF16, {1, k}),
                                         TensorView::Contiguous(packed.data(), DType::kU8, {1, k / 2}),
                                         TensorView::Contiguous(scales.data(), DType::kE4M3, {1, k / 16}),
                                         fp4kv::GlobalScale::Value(g));
  if (s.ok()) {
    s = fp4kv::DequantizeLinear(TensorView::Contiguous(packed.data(), DType::kU8, {1, k / 2}),
                                TensorView::Contiguous(scales.data(), DType::kE4M3, {1, k / 16}),
                                TensorView::Contiguous(out.data(), DType::kBF16, {1, k}),
                                fp4kv::GlobalScale::Value(g));
  }
  if (!s.ok()) {
    std::printf("consumer: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("consumer: linked fp4kv; format.h inlined here matches the library's bytes: %s\n",
              differ == 0 ? "yes" : "NO");
  return differ == 0 ? 0 : 1;
}
