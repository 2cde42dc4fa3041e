// Accuracy of the quantization recipes, on the CPU: reconstruction error of
// standard NVFP4 vs 4over6 (MAE / MSE, exact / fast-math) with the global
// scale sized for e4m3_max 448 and 256, on Gaussian, heavy-tailed and
// key-like data. Prints a markdown table. Deterministic (fixed seeds).
//
//   accuracy_report [tokens]      (default 8192 tokens of 128 values)
//
// Each tensor is bf16 [tokens, 128]. Its amax is measured with a CPU
// Calibrator, which also yields the recipe's global scale; the tensor is
// quantized with QuantizeLinear and decoded in fp32 with DequantizeBlock.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "fp4kv/calibrate.h"
#include "fp4kv/format.h"
#include "fp4kv/ops.h"
#include "fp4kv/recipe.h"
#include "fp4kv/tensor.h"

namespace {

using fp4kv::DType;
using fp4kv::Recipe;

constexpr int64_t kDim = 128;

struct Dataset {
  std::string name;
  std::vector<uint16_t> bf16;  // [tokens, kDim]
};

uint16_t Bf16(float x) { return fp4kv::FloatToBf16Bits(x); }

Dataset Gaussian(int64_t tokens) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Dataset d{"Gaussian N(0, 1)", std::vector<uint16_t>(tokens * kDim)};
  for (auto& v : d.bf16) v = Bf16(n(rng));
  return d;
}

Dataset StudentT(int64_t tokens) {
  std::mt19937_64 rng(2);
  std::student_t_distribution<float> t(3.0f);
  Dataset d{"Student-t, 3 degrees of freedom", std::vector<uint16_t>(tokens * kDim)};
  for (auto& v : d.bf16) v = Bf16(t(rng));
  return d;
}

// Keys: N(0, 1) per channel, except 6 of the 128 channels (fixed per tensor,
// as in real keys) whose scale is drawn from [10, 50].
Dataset KeyLike(int64_t tokens) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> big(10.0f, 50.0f);
  std::vector<float> channel_scale(kDim, 1.0f);
  for (int64_t c : {5, 17, 40, 77, 100, 126}) channel_scale[c] = big(rng);
  Dataset d{"Key-like: 6 of 128 channels 10-50x larger", std::vector<uint16_t>(tokens * kDim)};
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < kDim; ++c) d.bf16[t * kDim + c] = Bf16(channel_scale[c] * n(rng));
  }
  return d;
}

struct Row {
  std::string label;
  int e4m3_max = 448;
  double rel_rms = 0.0;
  double max_abs = 0.0;
  double frac_amax4 = 0.0;  // fraction of blocks whose scale came from amax/4
};

// Quantizes `data` with `quantizer`, the global scale sized by `scale_recipe`.
Row Measure(const Dataset& data, const Recipe& quantizer, const Recipe& scale_recipe,
            const std::string& label) {
  const int64_t tokens = static_cast<int64_t>(data.bf16.size()) / kDim;
  const fp4kv::TensorView in =
      fp4kv::TensorView::Contiguous(data.bf16.data(), DType::kBF16, {tokens, kDim});

  absl::StatusOr<fp4kv::Calibrator> cal =
      fp4kv::Calibrator::Create({in.numel(), DType::kBF16, fp4kv::Device::Cpu(), scale_recipe});
  float amax = 0.0f, g = 0.0f;
  if (!cal.ok() || !cal->Run(in, &amax, &g).ok()) {
    std::fprintf(stderr, "calibration failed\n");
    std::exit(1);
  }

  std::vector<uint8_t> packed(tokens * kDim / 2), scales(tokens * kDim / fp4kv::kBlockSize);
  const absl::Status s = fp4kv::QuantizeLinear(
      in, fp4kv::TensorView::Contiguous(packed.data(), DType::kU8, {tokens, kDim / 2}),
      fp4kv::TensorView::Contiguous(scales.data(), DType::kU8, {tokens, kDim / 16}),
      fp4kv::GlobalScale::Value(g), quantizer);
  if (!s.ok()) {
    std::fprintf(stderr, "QuantizeLinear: %s\n", std::string(s.message()).c_str());
    std::exit(1);
  }

  double err2 = 0.0, ref2 = 0.0, max_abs = 0.0;
  int64_t amax4 = 0;
  const int64_t blocks = static_cast<int64_t>(scales.size());
  for (int64_t b = 0; b < blocks; ++b) {
    float x[fp4kv::kBlockSize];
    float block_amax = 0.0f;
    for (int i = 0; i < fp4kv::kBlockSize; ++i) {
      x[i] = fp4kv::Bf16BitsToFloat(data.bf16[b * fp4kv::kBlockSize + i]);
      block_amax = std::fmax(block_amax, std::fabs(x[i]));
    }
    uint32_t p[2] = {0, 0};
    for (int i = 0; i < fp4kv::kBlockBytes; ++i) {
      p[i / 4] |= static_cast<uint32_t>(packed[b * fp4kv::kBlockBytes + i]) << (8 * (i % 4));
    }
    float y[fp4kv::kBlockSize];
    fp4kv::DequantizeBlock(p, scales[b], g, y);
    for (int i = 0; i < fp4kv::kBlockSize; ++i) {
      const double e = static_cast<double>(x[i]) - y[i];
      err2 += e * e;
      ref2 += static_cast<double>(x[i]) * x[i];
      max_abs = std::fmax(max_abs, std::fabs(e));
    }
    const uint8_t b6 = fp4kv::E4m3Encode(fp4kv::DivRn(block_amax, fp4kv::MulRn(6.0f, g)));
    if (scales[b] != b6) ++amax4;
  }
  Row r;
  r.label = label;
  r.e4m3_max = scale_recipe.e4m3_max;
  r.rel_rms = std::sqrt(err2 / ref2);
  r.max_abs = max_abs;
  r.frac_amax4 = static_cast<double>(amax4) / static_cast<double>(blocks);
  return r;
}

void Report(const Dataset& data) {
  std::vector<Row> rows;
  const Recipe standard = Recipe::Standard();
  rows.push_back(Measure(data, standard, standard, "standard"));
  // Control, not a recipe: the standard quantizer under a g sized for 256,
  // to separate the cost of the headroom from the gain of the choice.
  rows.push_back(
      Measure(data, standard, Recipe::FourOverSix(256), "standard quantizer, g for 256 (control)"));
  for (int e : {448, 256}) {
    for (bool fast : {false, true}) {
      for (fp4kv::ErrorMetric m : {fp4kv::ErrorMetric::kMae, fp4kv::ErrorMetric::kMse}) {
        const Recipe r = Recipe::FourOverSix(e, m, fast);
        rows.push_back(Measure(data, r, r, fp4kv::RecipeName(r)));
      }
    }
  }
  const double base = rows[0].rel_rms;
  std::printf("\n### %s\n\n", data.name.c_str());
  std::printf(
      "| recipe | e4m3_max | relative RMS error | vs standard | max abs error | blocks on amax/4 "
      "|\n");
  std::printf("|---|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    std::printf("| %s | %d | %.5f | %+.1f%% | %.4f | %.1f%% |\n", r.label.c_str(), r.e4m3_max,
                r.rel_rms, 100.0 * (r.rel_rms / base - 1.0), r.max_abs, 100.0 * r.frac_amax4);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 8192;
  if (argc > 1) tokens = std::atoll(argv[1]);
  if (tokens <= 0) {
    std::fprintf(stderr, "usage: %s [tokens > 0]\n", argv[0]);
    return 2;
  }
  std::printf("## fp4kv recipe accuracy (bf16 [%lld, %lld] per dataset, CPU)\n",
              static_cast<long long>(tokens), static_cast<long long>(kDim));
  std::printf(
      "\nrelative RMS = sqrt(sum (x - dq)^2 / sum x^2); global scale = "
      "MakeGlobalScale(tensor amax, recipe).\n");
  Report(Gaussian(tokens));
  Report(StudentT(tokens));
  Report(KeyLike(tokens));
  return 0;
}
