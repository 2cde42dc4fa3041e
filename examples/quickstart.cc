// Quick start: a small prefill and a few decode steps quantized into a paged
// NVFP4 cache on the CPU, then dequantized and compared with the input.
//
//   quickstart [--heads 4] [--head_dim 128] [--page_size 16] [--prompt 37] [--decode 8]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fp4kv/format.h"
#include "fp4kv/geometry.h"
#include "fp4kv/ops.h"

namespace {

using fp4kv::DType;
using fp4kv::GlobalScale;
using fp4kv::TensorView;

int Flag(int argc, char** argv, const char* name, int def) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  }
  return def;
}

bool Check(const absl::Status& s, const char* what) {
  if (!s.ok()) std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  return s.ok();
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      std::printf(
          "usage: quickstart [--heads N] [--head_dim D] [--page_size S] [--prompt T] [--decode T]\n"
          "Appends a prompt and decode tokens into a paged NVFP4 cache on the CPU and\n"
          "dequantizes them back. Keys have 20x outlier channels (0..3 of every head),\n"
          "as real keys do, so their max abs error is about 20x that of the values.\n");
      return 0;
    }
  }
  const int heads = Flag(argc, argv, "--heads", 4);
  const int dim = Flag(argc, argv, "--head_dim", 128);
  const int page_size = Flag(argc, argv, "--page_size", 16);
  const int prompt = Flag(argc, argv, "--prompt", 37);
  const int decode = Flag(argc, argv, "--decode", 8);
  const int total = prompt + decode;
  const int pages = (total + page_size - 1) / page_size;

  // Caller-owned paged storage: K and V data [pages, page_size, heads, dim/2]
  // and scales [pages, page_size, heads, dim/16] (NHD).
  std::vector<uint8_t> k_data(int64_t{pages} * page_size * heads * dim / 2);
  std::vector<uint8_t> v_data(k_data.size());
  std::vector<uint8_t> k_scales(int64_t{pages} * page_size * heads * dim / 16);
  std::vector<uint8_t> v_scales(k_scales.size());
  const fp4kv::PagedCache cache = fp4kv::PagedCache::FromTuple(
      TensorView::Contiguous(k_data.data(), DType::kU8, {pages, page_size, heads, dim / 2}),
      TensorView::Contiguous(v_data.data(), DType::kU8, {pages, page_size, heads, dim / 2}),
      TensorView::Contiguous(k_scales.data(), DType::kE4M3, {pages, page_size, heads, dim / 16}),
      TensorView::Contiguous(v_scales.data(), DType::kE4M3, {pages, page_size, heads, dim / 16}),
      fp4kv::Layout::kNHD);

  // Random K/V for every token (bf16): standard normal values, and keys with
  // 20x outlier channels (the first 4 of each head), as real keys have.
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t row = int64_t{heads} * dim;
  std::vector<uint16_t> k(total * row), v(total * row);
  float k_amax = 0, v_amax = 0;
  for (int64_t i = 0; i < total * row; ++i) {
    const float boost = (i % dim) < 4 ? 20.0f : 1.0f;
    k[i] = fp4kv::FloatToBf16Bits(boost * normal(rng));
    v[i] = fp4kv::FloatToBf16Bits(normal(rng));
    k_amax = std::max(k_amax, std::fabs(fp4kv::Bf16BitsToFloat(k[i])));
    v_amax = std::max(v_amax, std::fabs(fp4kv::Bf16BitsToFloat(v[i])));
  }
  // Global decode scales: the tensor's amax maps to the top of E2M1 x E4M3.
  const GlobalScale gk = GlobalScale::Value(k_amax / (6.0f * 448.0f));
  const GlobalScale gv = GlobalScale::Value(v_amax / (6.0f * 448.0f));

  // One request whose pages are 0..pages-1 in a shuffled order.
  std::vector<int32_t> kv_indices(pages);
  std::iota(kv_indices.begin(), kv_indices.end(), 0);
  std::shuffle(kv_indices.begin(), kv_indices.end(), rng);
  std::vector<int32_t> kv_indptr = {0, pages};

  auto append = [&](int from, int count) {
    std::vector<int32_t> batch(count, 0), pos(count);
    std::iota(pos.begin(), pos.end(), from);
    std::vector<int32_t> last = {(from + count - 1) % page_size + 1};
    return fp4kv::QuantizeAppendPaged(
        TensorView::Contiguous(&k[from * row], DType::kBF16, {count, heads, dim}),
        TensorView::Contiguous(&v[from * row], DType::kBF16, {count, heads, dim}),
        TensorView::Contiguous(batch.data(), DType::kI32, {count}),
        TensorView::Contiguous(pos.data(), DType::kI32, {count}), cache,
        TensorView::Contiguous(kv_indices.data(), DType::kI32, {pages}),
        TensorView::Contiguous(kv_indptr.data(), DType::kI32, {2}),
        TensorView::Contiguous(last.data(), DType::kI32, {1}), gk, gv);
  };
  if (!Check(append(0, prompt), "prefill")) return 1;
  for (int t = prompt; t < total; ++t) {
    if (!Check(append(t, 1), "decode")) return 1;
  }

  // Dequantize through the block table into contiguous [1, total, heads, dim].
  std::vector<uint16_t> k_out(total * row), v_out(total * row);
  std::vector<int32_t> seq_lens = {total};
  if (!Check(fp4kv::DequantizePaged(
                 cache, TensorView::Contiguous(kv_indices.data(), DType::kI32, {1, pages}),
                 TensorView::Contiguous(seq_lens.data(), DType::kI32, {1}),
                 TensorView::Contiguous(k_out.data(), DType::kBF16, {1, total, heads, dim}),
                 TensorView::Contiguous(v_out.data(), DType::kBF16, {1, total, heads, dim}), gk, gv),
             "dequantize")) {
    return 1;
  }
  auto report = [&](const char* name, const std::vector<uint16_t>& in, const std::vector<uint16_t>& out) {
    double num = 0, den = 0, max_abs = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      const double x = fp4kv::Bf16BitsToFloat(in[i]), y = fp4kv::Bf16BitsToFloat(out[i]);
      num += (x - y) * (x - y);
      den += x * x;
      max_abs = std::max(max_abs, std::fabs(x - y));
    }
    std::printf("%s: relative RMS error %.4f, max abs error %.4f (input amax %.1f)\n", name,
                std::sqrt(num / den), max_abs, name[0] == 'K' ? k_amax : v_amax);
  };
  const int64_t bytes = static_cast<int64_t>(k_data.size() + v_data.size() + k_scales.size() + v_scales.size());
  std::printf("fp4kv quickstart (CPU reference): %d heads x %d dims, page_size %d\n", heads, dim, page_size);
  std::printf("prefill %d tokens + %d decode steps into %d pages (%lld bytes, %.2f bytes/value vs 2 for bf16)\n",
              prompt, decode, pages, static_cast<long long>(bytes),
              static_cast<double>(bytes) / (2.0 * pages * page_size * row));
  report("K", k, k_out);
  report("V", v, v_out);
  return 0;
}
