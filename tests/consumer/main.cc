// Quantizes and dequantizes one row through the installed library.
#include <cmath>
#include <cstdio>
#include <vector>

#include "fp4kv/format.h"
#include "fp4kv/ops.h"

int main() {
  const int64_t k = 32;
  std::vector<uint16_t> in(k), out(k);
  for (int i = 0; i < k; ++i) in[i] = fp4kv::FloatToBf16Bits(std::sin(0.3f * i));
  std::vector<uint8_t> packed(k / 2), scales(k / 16);
  const fp4kv::GlobalScale g = fp4kv::GlobalScale::Value(1.0f / 448.0f / 6.0f);
  using fp4kv::DType;
  using fp4kv::TensorView;
  absl::Status s = fp4kv::QuantizeLinear(TensorView::Contiguous(in.data(), DType::kBF16, {1, k}),
                                         TensorView::Contiguous(packed.data(), DType::kU8, {1, k / 2}),
                                         TensorView::Contiguous(scales.data(), DType::kE4M3, {1, k / 16}), g);
  if (s.ok()) {
    s = fp4kv::DequantizeLinear(TensorView::Contiguous(packed.data(), DType::kU8, {1, k / 2}),
                                TensorView::Contiguous(scales.data(), DType::kE4M3, {1, k / 16}),
                                TensorView::Contiguous(out.data(), DType::kBF16, {1, k}), g);
  }
  if (!s.ok()) {
    std::printf("consumer: %s\n", s.ToString().c_str());
    return 1;
  }
  float err = 0;
  for (int i = 0; i < k; ++i) {
    err = std::fmax(err, std::fabs(fp4kv::Bf16BitsToFloat(in[i]) - fp4kv::Bf16BitsToFloat(out[i])));
  }
  std::printf("consumer: linked fp4kv, max abs error %.4f over %lld values\n", err, static_cast<long long>(k));
  return err < 0.2f ? 0 : 1;
}
