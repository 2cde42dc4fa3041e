// Attention-output accuracy of the cache formats on real attention inputs:
// the post-RoPE Q, K and V of four layers of a small Llama-architecture model
// (tests/data/realkv, README there). For every layer and key/value treatment
// the K and V of all 1025 positions go through a KVCache on the CPU (one
// prefill append: the first-append calibration sizes the global scales with
// the cache's calibration_headroom), are read back with ReadSequence (f16),
// and causal attention (GQA 9 query heads on 3 KV heads, sm_scale 1/8) is
// evaluated in fp64 at every query position, against the same attention on
// the unquantized bf16 inputs. Prints markdown tables. Deterministic.
//
//   realkv_accuracy [dir]     (default: $FP4KV_REALKV_DIR, else tests/data/realkv
//                              next to this source file)
//
// Error of a layer: rel RMS = sqrt(sum (o - o_ref)^2 / sum o_ref^2) over every
// position, head and channel; worst head = the largest of the same ratio
// taken per query head.
// Treatments:
//   NVFP4 K+V   standard recipe, and 4over6 (e4m3_max 256) MAE / MSE
//   K8V4        KeyFormat::kFp8 keys, standard NVFP4 values
//   FP8 K+V     keys and values both through the FP8 key quantizer (values
//               are appended as the keys of a second K8V4 cache)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "fp4kv/format.h"
#include "fp4kv/geometry.h"
#include "fp4kv/kv_cache.h"
#include "fp4kv/recipe.h"
#include "fp4kv/tensor.h"

namespace {

using fp4kv::DType;
using fp4kv::TensorView;

constexpr int kTokens = 1025, kQHeads = 9, kKvHeads = 3, kDim = 64;
constexpr int kLayers[] = {0, 11, 23, 28};
constexpr double kSmScale = 0.125;

struct Layer {
  std::vector<uint16_t> q, k, v;  // bf16 [T, 9, 64], [T, 3, 64], [T, 3, 64]
};

bool ReadFile(const std::string& path, size_t count, std::vector<uint16_t>* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  out->resize(count);
  f.read(reinterpret_cast<char*>(out->data()), static_cast<std::streamsize>(count * 2));
  return f.gcount() == static_cast<std::streamsize>(count * 2);
}

bool LoadLayer(const std::string& dir, int layer, Layer* l) {
  char name[32];
  const auto file = [&](const char* what) {
    std::snprintf(name, sizeof(name), "/layer%02d_%s.bf16", layer, what);
    return dir + name;
  };
  return ReadFile(file("q"), size_t{kTokens} * kQHeads * kDim, &l->q) &&
         ReadFile(file("k"), size_t{kTokens} * kKvHeads * kDim, &l->k) &&
         ReadFile(file("v"), size_t{kTokens} * kKvHeads * kDim, &l->v);
}

std::vector<double> ToDouble(const std::vector<uint16_t>& bits, bool bf16) {
  std::vector<double> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    out[i] = bf16 ? fp4kv::Bf16BitsToFloat(bits[i]) : fp4kv::HalfBitsToFloat(bits[i]);
  }
  return out;
}

// Causal GQA attention in fp64: out [T, 9, 64].
std::vector<double> Attention(const std::vector<double>& q, const std::vector<double>& k,
                              const std::vector<double>& v) {
  std::vector<double> out(size_t{kTokens} * kQHeads * kDim, 0.0);
  std::vector<double> p(kTokens);
  for (int h = 0; h < kQHeads; ++h) {
    const int kvh = h / (kQHeads / kKvHeads);
    for (int t = 0; t < kTokens; ++t) {
      const double* qr = &q[(static_cast<size_t>(t) * kQHeads + h) * kDim];
      double m = -INFINITY;
      for (int s = 0; s <= t; ++s) {
        const double* kr = &k[(static_cast<size_t>(s) * kKvHeads + kvh) * kDim];
        double dot = 0.0;
        for (int d = 0; d < kDim; ++d) dot += qr[d] * kr[d];
        p[s] = dot * kSmScale;
        m = std::max(m, p[s]);
      }
      double sum = 0.0;
      for (int s = 0; s <= t; ++s) {
        p[s] = std::exp(p[s] - m);
        sum += p[s];
      }
      double* o = &out[(static_cast<size_t>(t) * kQHeads + h) * kDim];
      for (int s = 0; s <= t; ++s) {
        const double* vr = &v[(static_cast<size_t>(s) * kKvHeads + kvh) * kDim];
        const double w = p[s] / sum;
        for (int d = 0; d < kDim; ++d) o[d] += w * vr[d];
      }
    }
  }
  return out;
}

struct Error {
  double rel_rms = 0.0;
  double worst_head = 0.0;
};

Error Compare(const std::vector<double>& ref, const std::vector<double>& got) {
  double num = 0.0, den = 0.0;
  std::vector<double> hn(kQHeads, 0.0), hd(kQHeads, 0.0);
  for (size_t i = 0; i < ref.size(); ++i) {
    const int h = static_cast<int>((i / kDim) % kQHeads);
    const double e = got[i] - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
    hn[h] += e * e;
    hd[h] += ref[i] * ref[i];
  }
  Error r;
  r.rel_rms = std::sqrt(num / den);
  for (int h = 0; h < kQHeads; ++h) r.worst_head = std::max(r.worst_head, std::sqrt(hn[h] / hd[h]));
  return r;
}

// Appends K and V (bf16 [T, 3, 64]) as one prefill into a fresh one-layer
// KVCache on the CPU and reads them back as f16. False (with a message) on
// any error.
bool RoundTrip(fp4kv::KeyFormat key_format, const fp4kv::Recipe& recipe, float headroom,
               const std::vector<uint16_t>& k, const std::vector<uint16_t>& v,
               std::vector<uint16_t>* k_out, std::vector<uint16_t>* v_out) {
  fp4kv::KVCacheOptions o;
  o.num_layers = 1;
  o.geometry.num_kv_heads = kKvHeads;
  o.geometry.head_dim_k = kDim;
  o.geometry.head_dim_v = kDim;
  o.geometry.page_size = 16;
  o.geometry.num_pages = (kTokens + 15) / 16;
  o.geometry.key_format = key_format;
  o.recipe = recipe;
  o.calibration_headroom = headroom;
  o.max_seqs_per_step = 1;
  o.max_tokens_per_step = kTokens;
  absl::StatusOr<fp4kv::KVCache> cache = fp4kv::KVCache::Create(o);
  if (!cache.ok()) {
    std::fprintf(stderr, "KVCache::Create: %s\n", cache.status().ToString().c_str());
    return false;
  }
  absl::StatusOr<fp4kv::SequenceId> seq = cache->CreateSequence();
  if (!seq.ok()) {
    std::fprintf(stderr, "CreateSequence: %s\n", seq.status().ToString().c_str());
    return false;
  }
  const fp4kv::StepEntry entry{*seq, kTokens};
  absl::StatusOr<fp4kv::StepInfo> info = cache->PrepareStep({&entry, 1});
  absl::StatusOr<fp4kv::CacheAppender> app = cache->appender(DType::kBF16);
  if (!info.ok() || !app.ok()) {
    std::fprintf(stderr, "PrepareStep / appender failed\n");
    return false;
  }
  const std::vector<int64_t> shape = {kTokens, kKvHeads, kDim};
  absl::Status s =
      app->Run(0, TensorView::Contiguous(const_cast<uint16_t*>(k.data()), DType::kBF16, shape),
               TensorView::Contiguous(const_cast<uint16_t*>(v.data()), DType::kBF16, shape));
  k_out->assign(k.size(), 0);
  v_out->assign(v.size(), 0);
  if (s.ok()) {
    s = cache->ReadSequence(0, *seq, TensorView::Contiguous(k_out->data(), DType::kF16, shape),
                            TensorView::Contiguous(v_out->data(), DType::kF16, shape));
  }
  if (!s.ok()) std::fprintf(stderr, "append / read: %s\n", s.ToString().c_str());
  return s.ok();
}

struct Treatment {
  const char* name;
  fp4kv::KeyFormat key_format;
  fp4kv::Recipe recipe;
  bool fp8_values;  // values through the FP8 key quantizer too
};

std::string DefaultDir() {
  if (const char* env = std::getenv("FP4KV_REALKV_DIR"); env != nullptr && *env != '\0') return env;
  std::string src = __FILE__;
  const size_t slash = src.find_last_of('/');
  src = slash == std::string::npos ? std::string(".") : src.substr(0, slash);
  return src + "/../tests/data/realkv";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::printf("usage: realkv_accuracy [dir]\n");
    return 0;
  }
  const std::string dir = argc > 1 ? argv[1] : DefaultDir();
  const fp4kv::Recipe std_recipe = fp4kv::Recipe::Standard();
  const Treatment treatments[] = {
      {"NVFP4 K+V, standard", fp4kv::KeyFormat::kNvfp4, std_recipe, false},
      {"NVFP4 K+V, 4over6 MAE (256)", fp4kv::KeyFormat::kNvfp4,
       fp4kv::Recipe::FourOverSix(256, fp4kv::ErrorMetric::kMae, false), false},
      {"NVFP4 K+V, 4over6 MSE (256)", fp4kv::KeyFormat::kNvfp4,
       fp4kv::Recipe::FourOverSix(256, fp4kv::ErrorMetric::kMse, false), false},
      {"K8V4 (FP8 K, standard NVFP4 V)", fp4kv::KeyFormat::kFp8, std_recipe, false},
      {"FP8 K+V", fp4kv::KeyFormat::kFp8, std_recipe, true},
  };
  std::vector<Layer> layers(4);
  for (int i = 0; i < 4; ++i) {
    if (!LoadLayer(dir, kLayers[i], &layers[i])) {
      std::fprintf(stderr, "realkv_accuracy: cannot read layer %d from %s\n", kLayers[i],
                   dir.c_str());
      return 1;
    }
  }
  std::printf("Attention-output error against fp64 attention on the bf16 inputs\n");
  std::printf("(rel RMS over all 1025 positions x 9 heads; in parentheses the worst head)\n");
  for (const float headroom : {4.0f, 1.0f}) {
    std::printf("\ncalibration_headroom %.0f\n\n| treatment | bytes/value |", headroom);
    for (int l : kLayers) std::printf(" layer %d |", l);
    std::printf("\n| --- | ---: |");
    for (size_t i = 0; i < 4; ++i) std::printf(" ---: |");
    std::printf("\n");
    std::vector<std::vector<double>> refs;
    for (const Layer& l : layers) {
      refs.push_back(Attention(ToDouble(l.q, true), ToDouble(l.k, true), ToDouble(l.v, true)));
    }
    for (const Treatment& t : treatments) {
      const double bytes = t.fp8_values                             ? 1.0
                           : t.key_format == fp4kv::KeyFormat::kFp8 ? 0.78125
                                                                    : 0.5625;
      std::printf("| %s | %.4g |", t.name, bytes);
      for (size_t i = 0; i < layers.size(); ++i) {
        const Layer& l = layers[i];
        std::vector<uint16_t> k, v, vk, unused;
        if (!RoundTrip(t.key_format, t.recipe, headroom, l.k, l.v, &k, &v)) return 1;
        if (t.fp8_values && !RoundTrip(t.key_format, t.recipe, headroom, l.v, l.v, &vk, &unused))
          return 1;
        const std::vector<double> o = Attention(ToDouble(l.q, true), ToDouble(k, false),
                                                ToDouble(t.fp8_values ? vk : v, false));
        const Error e = Compare(refs[i], o);
        std::printf(" %.4f (%.4f) |", e.rel_rms, e.worst_head);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  return 0;
}
