// KVCache global scales: first-append calibration (the default), the rule
// that refuses a scale change while a layer holds tokens, re-encoding of the
// stored pages, scale-event counters, and ReadScales. Every case runs on the
// CPU device; the KVCacheScalesGpu cases run the same checks on a GPU.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fp4kv/calibrate.h"
#include "fp4kv/format.h"
#include "fp4kv/kv_cache.h"
#include "fp4kv/recipe.h"
#include "gtest/gtest.h"
#include "testing/attention_case.h"
#include "testing/kv_cache_harness.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::Buffer;
using testing::DiffSnapshots;
using testing::TakeSnapshot;

constexpr int kHeads = 2;
constexpr int kDim = 64;

KVCacheOptions DefaultOptions(Device device) {
  KVCacheOptions o;  // no global scales: calibrated from the first rows
  o.num_layers = 2;
  o.geometry.num_kv_heads = kHeads;
  o.geometry.head_dim_k = kDim;
  o.geometry.head_dim_v = kDim;
  o.geometry.page_size = 16;
  o.geometry.num_pages = 64;
  o.device = device;
  o.max_seqs_per_step = 4;
  o.max_tokens_per_step = 256;
  o.max_pages_per_seq = 32;
  return o;
}

KVCache MustCreate(const KVCacheOptions& o) {
  absl::StatusOr<KVCache> c = KVCache::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(c).value();
}

// n rows of [kHeads, kDim] Gaussian values with standard deviation sigma, as
// bf16 bits (never all zero for sigma > 0).
std::vector<uint16_t> GaussianRows(int64_t n, double sigma, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, sigma);
  std::vector<uint16_t> out(n * kHeads * kDim);
  for (uint16_t& x : out) x = FloatToBf16Bits(static_cast<float>(dist(rng)));
  return out;
}

float Amax(const std::vector<uint16_t>& rows) {
  float m = 0.0f;
  for (uint16_t b : rows) m = std::max(m, std::fabs(Bf16BitsToFloat(b)));
  return m;
}

// One sequence of the cache and host copies of everything appended to it,
// per layer (the same rows go to every layer unless given per layer).
class Sequence {
 public:
  explicit Sequence(KVCache* cache) : cache_(cache), id_(cache->CreateSequence().value()) {
    absl::StatusOr<CacheAppender> a = cache->appender(DType::kBF16);
    EXPECT_TRUE(a.ok()) << a.status();
    if (a.ok()) appender_.emplace(*a);
    k_.resize(cache->num_layers());
    v_.resize(cache->num_layers());
  }
  SequenceId id() const { return id_; }

  // PrepareStep for n new tokens, without appending.
  absl::Status Prepare(int64_t n) {
    absl::StatusOr<StepInfo> info =
        cache_->PrepareStep({{id_, static_cast<int32_t>(n)}}, nullptr);
    pending_ = n;
    return info.status();
  }
  // Appends the prepared rows to one layer.
  absl::Status AppendLayer(int layer, const std::vector<uint16_t>& k,
                           const std::vector<uint16_t>& v) {
    const Device dev = cache_->device();
    Buffer kb(dev, k.size() * 2), vb(dev, v.size() * 2);
    if (!kb.Upload(k.data(), k.size() * 2) || !vb.Upload(v.data(), v.size() * 2)) {
      return absl::InternalError("upload");
    }
    absl::Status s = appender_->Run(layer, kb.View(DType::kBF16, {pending_, kHeads, kDim}),
                                    vb.View(DType::kBF16, {pending_, kHeads, kDim}));
    if (dev.is_cuda() && cudaDeviceSynchronize() != cudaSuccess) {
      return absl::InternalError("sync");
    }
    if (s.ok()) {
      k_[layer].insert(k_[layer].end(), k.begin(), k.end());
      v_[layer].insert(v_[layer].end(), v.begin(), v.end());
    }
    return s;
  }
  // One step appending the same rows to every layer.
  absl::Status Append(const std::vector<uint16_t>& k, const std::vector<uint16_t>& v) {
    const int64_t n = static_cast<int64_t>(k.size()) / (kHeads * kDim);
    if (absl::Status s = Prepare(n); !s.ok()) return s;
    for (int l = 0; l < cache_->num_layers(); ++l) {
      if (absl::Status s = AppendLayer(l, k, v); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // Relative RMS error of the dequantized layer against what was appended
  // (a step with no new tokens selects the sequence for the dequantizer).
  void Errors(int layer, double* k_err, double* v_err) {
    ASSERT_TRUE(Prepare(0).ok());
    const int64_t n = static_cast<int64_t>(k_[layer].size()) / (kHeads * kDim);
    const Device dev = cache_->device();
    Buffer ko(dev, n * kHeads * kDim * 2), vo(dev, n * kHeads * kDim * 2);
    absl::StatusOr<CacheDequantizer> dq = cache_->dequantizer(DType::kBF16);
    ASSERT_TRUE(dq.ok()) << dq.status();
    ASSERT_TRUE(dq->Run(layer, ko.View(DType::kBF16, {1, n, kHeads, kDim}),
                        vo.View(DType::kBF16, {1, n, kHeads, kDim}))
                    .ok());
    if (dev.is_cuda()) {
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    const std::vector<uint16_t> kd = ko.DownloadAs<uint16_t>(k_[layer].size());
    const std::vector<uint16_t> vd = vo.DownloadAs<uint16_t>(v_[layer].size());
    *k_err = RelRms(k_[layer], kd);
    *v_err = RelRms(v_[layer], vd);
  }

 private:
  static double RelRms(const std::vector<uint16_t>& want, const std::vector<uint16_t>& got) {
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const double w = Bf16BitsToFloat(want[i]);
      const double d = Bf16BitsToFloat(got[i]) - w;
      num += d * d;
      den += w * w;
    }
    return den > 0 ? std::sqrt(num / den) : (num > 0 ? 1.0 : 0.0);
  }

  KVCache* cache_;
  SequenceId id_;
  std::optional<CacheAppender> appender_;
  int64_t pending_ = 0;
  std::vector<std::vector<uint16_t>> k_, v_;
};

LayerScales MustRead(const KVCache& c, int layer) {
  absl::StatusOr<LayerScales> s = c.ReadScales(layer);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : LayerScales{};
}

class ScalesTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (GetParam()) FP4KV_SKIP_WITHOUT_GPU();
  }
  Device device() const { return GetParam() ? Device::Cuda(0) : Device::Cpu(); }
};

// The reproduction of the old default (every scale 1.0): V rows of standard
// deviation 0.001 came back as zeros. With no scales given they now come
// back with the ordinary NVFP4 error, in K and V, at every magnitude.
TEST_P(ScalesTest, DefaultOptionsKeepSmallValues) {
  for (double sigma : {1.0, 0.01, 0.001}) {
    KVCache c = MustCreate(DefaultOptions(device()));
    Sequence s(&c);
    const std::vector<uint16_t> k = GaussianRows(200, 1.0, 1);
    const std::vector<uint16_t> v = GaussianRows(200, sigma, 2);
    ASSERT_TRUE(s.Append(k, v).ok());
    for (int layer = 0; layer < 2; ++layer) {
      double ke = 0, ve = 0;
      s.Errors(layer, &ke, &ve);
      EXPECT_LT(ke, 0.12) << "sigma " << sigma << " layer " << layer;
      EXPECT_LT(ve, 0.12) << "sigma " << sigma << " layer " << layer;
      EXPECT_GT(ve, 0.05) << "an NVFP4 error this small means nothing was quantized";
      const LayerScales sc = MustRead(c, layer);
      EXPECT_TRUE(sc.k_calibrated && sc.v_calibrated);
      const Recipe r = c.options().recipe;
      EXPECT_EQ(sc.k, MakeGlobalScale(4.0f * Amax(k), r));
      EXPECT_EQ(sc.v, MakeGlobalScale(4.0f * Amax(v), r));
      EXPECT_EQ(sc.k_fp8, *MinFp8Scale(sc.k));
      EXPECT_EQ(sc.v_fp8, *MinFp8Scale(sc.v));
    }
  }
  // What the default avoids: an explicit scale of 1.0 flushes such rows.
  KVCacheOptions o = DefaultOptions(device());
  o.k_global_scales = {1.0f, 1.0f};
  o.v_global_scales = {1.0f, 1.0f};
  KVCache c = MustCreate(o);
  Sequence s(&c);
  ASSERT_TRUE(s.Append(GaussianRows(200, 1.0, 1), GaussianRows(200, 0.001, 2)).ok());
  double ke = 0, ve = 0;
  s.Errors(0, &ke, &ve);
  EXPECT_GT(ve, 0.9);
}

TEST_P(ScalesTest, AllZeroRowsLeaveTheLayerPendingUntilNonzeroRowsCome) {
  KVCache c = MustCreate(DefaultOptions(device()));
  Sequence s(&c);
  const std::vector<uint16_t> zeros(3 * kHeads * kDim, 0);
  ASSERT_TRUE(s.Append(zeros, zeros).ok());
  EXPECT_FALSE(MustRead(c, 0).k_calibrated);
  EXPECT_FALSE(MustRead(c, 0).v_calibrated);
  // K nonzero, V still zero: only K calibrates.
  const std::vector<uint16_t> k = GaussianRows(5, 0.5, 3);
  ASSERT_TRUE(s.Append(k, std::vector<uint16_t>(5 * kHeads * kDim, 0)).ok());
  LayerScales sc = MustRead(c, 1);
  EXPECT_TRUE(sc.k_calibrated);
  EXPECT_FALSE(sc.v_calibrated);
  EXPECT_EQ(sc.k, MakeGlobalScale(4.0f * Amax(k), c.options().recipe));
  const std::vector<uint16_t> v = GaussianRows(7, 0.02, 4);
  ASSERT_TRUE(s.Append(GaussianRows(7, 50.0, 5), v).ok());
  sc = MustRead(c, 1);
  EXPECT_TRUE(sc.v_calibrated);
  EXPECT_EQ(sc.k, MakeGlobalScale(4.0f * Amax(k), c.options().recipe)) << "recalibrated";
  EXPECT_EQ(sc.v, MakeGlobalScale(4.0f * Amax(v), c.options().recipe));
  double ke = 0, ve = 0;
  s.Errors(1, &ke, &ve);  // zeros stay zeros under the later scale
  EXPECT_LT(ve, 0.12);
}

TEST_P(ScalesTest, HeadroomAbsorbsLargerLaterTokensAndCountersShowSaturation) {
  KVCacheOptions o = DefaultOptions(device());
  o.count_scale_events = true;
  o.recipe = Recipe::FourOverSix();  // e4m3_max 256
  KVCache c = MustCreate(o);
  Sequence s(&c);
  const std::vector<uint16_t> first = GaussianRows(32, 1.0, 6);
  ASSERT_TRUE(s.Append(first, first).ok());
  const float g = MustRead(c, 0).k;
  // 3x the first rows' largest value still fits under the headroom of 4.
  std::vector<uint16_t> bigger = GaussianRows(32, 1.0, 7);
  const float factor = 3.0f * Amax(first) / Amax(bigger);  // once: the loop rescales bigger
  for (uint16_t& b : bigger) b = FloatToBf16Bits(Bf16BitsToFloat(b) * factor);
  ASSERT_LE(Amax(bigger), 3.05f * Amax(first));
  ASSERT_TRUE(s.Append(bigger, bigger).ok());
  absl::StatusOr<ScaleEventCounts> ev = c.ReadScaleEvents(0);
  ASSERT_TRUE(ev.ok()) << ev.status();
  EXPECT_EQ(ev->k_saturated, 0u);
  EXPECT_EQ(ev->v_saturated, 0u);
  // 30x does not: the counters equal a host count of the clipped blocks.
  std::vector<uint16_t> huge = bigger;
  for (uint16_t& b : huge) b = FloatToBf16Bits(Bf16BitsToFloat(b) * 10.0f);
  ASSERT_TRUE(s.Append(huge, huge).ok());
  uint64_t want = 0;
  for (size_t blk = 0; blk < huge.size() / kBlockSize; ++blk) {
    float x[kBlockSize];
    for (int i = 0; i < kBlockSize; ++i) x[i] = Bf16BitsToFloat(huge[blk * kBlockSize + i]);
    want += ClassifyBlockScale(BlockAmax(x), g, 0x7e) == ScaleEvent::kSaturated;
  }
  ASSERT_GT(want, 0u);
  ev = c.ReadScaleEvents(0);
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(ev->k_saturated, want);
  EXPECT_EQ(ev->v_saturated, want);
  EXPECT_EQ(ev->k_underflow, 0u);
  EXPECT_EQ(c.ReadScaleEvents(1)->k_saturated, want);  // per layer
  ASSERT_TRUE(c.ResetScaleEvents().ok());
  ev = c.ReadScaleEvents(0);
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(ev->k_saturated + ev->v_saturated + ev->k_underflow + ev->v_underflow, 0u);
}

TEST_P(ScalesTest, CountersShowUnderflowUnderATooLargeScale) {
  KVCacheOptions o = DefaultOptions(device());
  o.count_scale_events = true;
  o.k_global_scales = {1.0f, 1.0f};  // far too large for values ~1e-4
  o.v_global_scales = {1e-5f, 1e-5f};
  KVCache c = MustCreate(o);
  Sequence s(&c);
  const std::vector<uint16_t> tiny = GaussianRows(10, 1e-4, 8);
  ASSERT_TRUE(s.Append(tiny, tiny).ok());
  absl::StatusOr<ScaleEventCounts> ev = c.ReadScaleEvents(0);
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(ev->k_underflow, tiny.size() / kBlockSize);  // every block
  EXPECT_EQ(ev->v_underflow, 0u);
  EXPECT_EQ(ev->k_saturated + ev->v_saturated, 0u);
}

TEST_P(ScalesTest, ChangesAreRefusedWhileTheLayerHoldsTokensAndChangeNothing) {
  KVCache c = MustCreate(DefaultOptions(device()));
  Sequence s(&c);
  ASSERT_TRUE(s.Append(GaussianRows(5, 1.0, 9), GaussianRows(5, 1.0, 10)).ok());
  EXPECT_EQ(*c.LayerTokens(1), 5);
  absl::StatusOr<Calibrator> cal =
      Calibrator::Create({64, DType::kBF16, device(), c.options().recipe});
  ASSERT_TRUE(cal.ok()) << cal.status();
  Buffer kb(device(), 128);
  ASSERT_TRUE(kb.Upload(GaussianRows(1, 1.0, 11).data(), 128));
  const TensorView t = kb.View(DType::kBF16, {64});
  const testing::Snapshot before = TakeSnapshot(c);
  std::vector<std::pair<std::string, absl::Status>> calls;
  calls.emplace_back("one layer", c.UpdateGlobalScales(1, 2.0f, 3.0f));
  calls.emplace_back("all layers", c.UpdateGlobalScales({2.0f, 2.0f}, {3.0f, 3.0f}));
  calls.emplace_back("calibrate", c.CalibrateGlobalScales(1, t, t, *cal));
  for (const auto& [name, st] : calls) {
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << name << ": " << st;
    EXPECT_NE(st.message().find("holds 5 tokens"), std::string::npos) << st;
    EXPECT_NE(st.message().find("layer "), std::string::npos) << st;
    EXPECT_NE(st.message().find("kReencode"), std::string::npos) << st;
  }
  EXPECT_NE(calls[0].second.message().find("layer 1:"), std::string::npos);
  EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(c)), "");
  // Released tokens no longer hold the layer.
  ASSERT_TRUE(c.ReleaseSequence(s.id()).ok());
  EXPECT_EQ(*c.LayerTokens(1), 0);
  EXPECT_TRUE(c.UpdateGlobalScales(1, 2.0f, 3.0f).ok());
  EXPECT_EQ(MustRead(c, 1).k, 2.0f);
  EXPECT_EQ(c.LayerTokens(2).status().code(), absl::StatusCode::kInvalidArgument);
}

// A server may calibrate a layer from its own first-prefill rows between
// PrepareStep and that layer's append; after the append it may not.
TEST_P(ScalesTest, ExplicitCalibrationBeforeTheLayersFirstAppendIsAllowed) {
  KVCache c = MustCreate(DefaultOptions(device()));
  Sequence s(&c);
  const std::vector<uint16_t> k = GaussianRows(6, 2.0, 12), v = GaussianRows(6, 0.1, 13);
  absl::StatusOr<Calibrator> cal =
      Calibrator::Create({6 * kHeads * kDim, DType::kBF16, device(), c.options().recipe});
  ASSERT_TRUE(cal.ok()) << cal.status();
  Buffer kb(device(), k.size() * 2), vb(device(), v.size() * 2);
  ASSERT_TRUE(kb.Upload(k.data(), k.size() * 2) && vb.Upload(v.data(), v.size() * 2));
  const TensorView kt = kb.View(DType::kBF16, {6, kHeads, kDim});
  const TensorView vt = vb.View(DType::kBF16, {6, kHeads, kDim});
  ASSERT_TRUE(s.Prepare(6).ok());
  EXPECT_EQ(*c.LayerTokens(0), 0);
  ASSERT_TRUE(c.CalibrateGlobalScales(0, kt, vt, *cal).ok());
  ASSERT_TRUE(s.AppendLayer(0, k, v).ok());
  EXPECT_EQ(*c.LayerTokens(0), 6);
  EXPECT_EQ(*c.LayerTokens(1), 0);
  EXPECT_EQ(c.CalibrateGlobalScales(0, kt, vt, *cal).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c.CalibrateGlobalScales(1, kt, vt, *cal).ok());
  ASSERT_TRUE(s.AppendLayer(1, k, v).ok());
  for (int layer = 0; layer < 2; ++layer) {
    const LayerScales sc = MustRead(c, layer);  // explicit: no headroom
    EXPECT_EQ(sc.k, MakeGlobalScale(Amax(k), c.options().recipe));
    EXPECT_EQ(sc.v, MakeGlobalScale(Amax(v), c.options().recipe));
    double ke = 0, ve = 0;
    s.Errors(layer, &ke, &ve);
    EXPECT_LT(ke, 0.12);
    EXPECT_LT(ve, 0.12);
  }
}

// Re-encoding rewrites every block of the layer as QuantizeBlock(
// DequantizeBlock(old), new): the pool equals that transform of the pool
// before, the other layer is untouched, and the tokens stay accurate.
TEST_P(ScalesTest, ReencodeRequantizesTheLayersPagesInOneCall) {
  KVCache c = MustCreate(DefaultOptions(device()));
  Sequence s(&c);
  ASSERT_TRUE(s.Append(GaussianRows(40, 1.0, 14), GaussianRows(40, 0.3, 15)).ok());
  const LayerScales old = MustRead(c, 1);
  const testing::PoolCopy before = testing::DownloadPools(c);
  const float nk = old.k * 2.5f, nv = old.v * 0.75f;
  ASSERT_TRUE(c.UpdateGlobalScales(1, nk, nv, nullptr, StoredTokens::kReencode).ok());
  if (device().is_cuda()) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  const testing::PoolCopy after = testing::DownloadPools(c);
  for (int kind = 0; kind < 4; ++kind) EXPECT_EQ(after.regions[kind], before.regions[kind]);
  for (int kv = 0; kv < 2; ++kv) {
    std::vector<uint8_t> data = before.regions[4 + 2 * kv];    // layer 1 data (kind 0 / 2)
    std::vector<uint8_t> scales = before.regions[4 + 2 * kv + 1];
    const float og = kv ? old.v : old.k, ng = kv ? nv : nk;
    for (size_t i = 0; i < scales.size(); ++i) {
      uint32_t packed[2];
      std::memcpy(packed, data.data() + i * kBlockBytes, kBlockBytes);
      float x[kBlockSize];
      DequantizeBlock(packed, scales[i], og, x);
      scales[i] = QuantizeBlock(x, ng, c.options().recipe, packed);
      std::memcpy(data.data() + i * kBlockBytes, packed, kBlockBytes);
    }
    EXPECT_EQ(after.regions[4 + 2 * kv], data) << "kv " << kv;
    EXPECT_EQ(after.regions[4 + 2 * kv + 1], scales) << "kv " << kv;
  }
  const LayerScales sc = MustRead(c, 1);
  EXPECT_EQ(sc.k, nk);
  EXPECT_EQ(sc.v, nv);
  EXPECT_EQ(sc.k_fp8, *MinFp8Scale(nk));
  double ke0 = 0, ve0 = 0, ke1 = 0, ve1 = 0;
  s.Errors(0, &ke0, &ve0);
  s.Errors(1, &ke1, &ve1);
  EXPECT_LT(ke1, 1.3 * ke0) << "re-encoding error";
  EXPECT_LT(ve1, 1.3 * ve0) << "re-encoding error";
  // All layers at once.
  ASSERT_TRUE(
      c.UpdateGlobalScales({nk, nk}, {nv, nv}, nullptr, StoredTokens::kReencode).ok());
  s.Errors(0, &ke0, &ve0);
  EXPECT_LT(ke0, 0.2);
  EXPECT_LT(ve0, 0.2);
}

// FP8 keys (K8V4): the first append sizes g_k = MakeFp8KeyScale(headroom *
// amax) with the key FP8 scale g_k (copied pages), values as usual; the
// counters count clipped 16-value key groups; a re-encode rewrites the key
// bytes by the FP8 key rule (CalibrateGlobalScales: Fp8KeysCalibrateGlobalScales).
TEST_P(ScalesTest, Fp8KeysCalibrateCountAndReencode) {
  KVCacheOptions o = DefaultOptions(device());
  o.geometry.key_format = KeyFormat::kFp8;
  o.count_scale_events = true;
  KVCache c = MustCreate(o);
  Sequence s(&c);
  const std::vector<uint16_t> k1 = GaussianRows(40, 1.0, 31), v1 = GaussianRows(40, 0.3, 32);
  ASSERT_TRUE(s.Append(k1, v1).ok());
  LayerScales sc = MustRead(c, 0);
  EXPECT_TRUE(sc.k_calibrated && sc.v_calibrated);
  EXPECT_EQ(sc.k, MakeFp8KeyScale(MulRn(Amax(k1), 4.0f)));
  EXPECT_EQ(sc.k_fp8, sc.k);
  EXPECT_EQ(sc.v, MakeGlobalScale(MulRn(Amax(v1), 4.0f), o.recipe));
  EXPECT_EQ(sc.v_fp8, MinFp8ScaleFor(sc.v));
  double ke = 0, ve = 0;
  s.Errors(0, &ke, &ve);
  EXPECT_LT(ke, 0.04) << "FP8 keys";
  EXPECT_GT(ke, 0.0);
  EXPECT_LT(ve, 0.15) << "NVFP4 values";
  absl::StatusOr<ScaleEventCounts> ev = c.ReadScaleEvents(0);
  ASSERT_TRUE(ev.ok()) << ev.status();
  EXPECT_EQ(ev->k_saturated + ev->k_underflow, 0u);
  // Keys 10x the first amax: groups of 16 with a value past 448 * g_k count.
  std::vector<uint16_t> huge = GaussianRows(24, 1.0, 33);
  const float factor = 10.0f * Amax(k1) / Amax(huge);
  for (uint16_t& b : huge) b = FloatToBf16Bits(Bf16BitsToFloat(b) * factor);
  ASSERT_TRUE(s.Append(huge, std::vector<uint16_t>(v1.begin(), v1.begin() + huge.size())).ok());
  const float r = Fp8KeyEncodeMultiplier(sc.k);
  uint64_t want = 0;
  for (size_t blk = 0; blk < huge.size() / kBlockSize; ++blk) {
    float x[kBlockSize];
    for (int i = 0; i < kBlockSize; ++i) x[i] = Bf16BitsToFloat(huge[blk * kBlockSize + i]);
    want += ClassifyFp8KeyBlock(BlockAmax(x), r) == ScaleEvent::kSaturated;
  }
  ASSERT_GT(want, 0u);
  ev = c.ReadScaleEvents(0);
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(ev->k_saturated, want);
  EXPECT_EQ(ev->k_underflow, 0u);
  // Re-encode layer 1 under a new key scale.
  const LayerScales old = MustRead(c, 1);
  const testing::PoolCopy before = testing::DownloadPools(c);
  ASSERT_TRUE(before.regions[5].empty());  // layer 1 has no key scales
  const float nk = old.k * 2.5f;
  ASSERT_TRUE(c.UpdateGlobalScales(1, nk, old.v, nullptr, StoredTokens::kReencode).ok());
  if (device().is_cuda()) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  const testing::PoolCopy after = testing::DownloadPools(c);
  for (int kind = 0; kind < 4; ++kind) EXPECT_EQ(after.regions[kind], before.regions[kind]);
  std::vector<uint8_t> keys = before.regions[4];
  const float nr = Fp8KeyEncodeMultiplier(nk);
  for (uint8_t& b : keys) b = QuantizeFp8Key(DequantFp8Key(b, old.k), nr);
  EXPECT_EQ(after.regions[4], keys);
  EXPECT_EQ(after.regions[6], before.regions[6]);  // V data: same scale, same blocks
  sc = MustRead(c, 1);
  EXPECT_EQ(sc.k, nk);
  EXPECT_EQ(sc.k_fp8, nk);
}

// The key bytes of `n` tokens of sequence `id` in layer `layer` (FP8 keys),
// token-major, [n, kHeads, kDim].
std::vector<uint8_t> Fp8KeyBytes(const KVCache& c, SequenceId id, int layer, int64_t n) {
  const testing::PoolCopy pools = testing::DownloadPools(c);
  const std::vector<uint8_t>& region = pools.regions[4 * layer];
  const CacheGeometry& g = c.geometry();
  absl::StatusOr<absl::Span<const int32_t>> pages = c.SequencePages(id);
  EXPECT_TRUE(pages.ok()) << pages.status();
  std::vector<uint8_t> out;
  if (!pages.ok()) return out;
  for (int64_t t = 0; t < n; ++t) {
    for (int h = 0; h < kHeads; ++h) {
      const int64_t off = g.DataOffset((*pages)[t / g.page_size], t % g.page_size, h, false);
      out.insert(out.end(), region.begin() + off, region.begin() + off + kDim);
    }
  }
  return out;
}

// CalibrateGlobalScales with FP8 keys: g_k = MakeFp8KeyScale(amax) and its
// FP8 scale g_k (Calibrator::RunFp8Key, no headroom), values as for NVFP4;
// the appended key bytes are the host's QuantizeFp8Key under that scale;
// refused while the layer holds tokens (nothing changed) unless kReencode,
// which rewrites the layer's key bytes by the FP8 key rule.
TEST_P(ScalesTest, Fp8KeysCalibrateGlobalScales) {
  KVCacheOptions o = DefaultOptions(device());
  o.geometry.key_format = KeyFormat::kFp8;
  KVCache c = MustCreate(o);
  Sequence s(&c);
  const int64_t n = 20;  // two pages, the second partial
  const std::vector<uint16_t> k = GaussianRows(n, 2.0, 41), v = GaussianRows(n, 0.1, 42);
  absl::StatusOr<Calibrator> cal =
      Calibrator::Create({n * kHeads * kDim, DType::kBF16, device(), c.options().recipe});
  ASSERT_TRUE(cal.ok()) << cal.status();
  Buffer kb(device(), k.size() * 2), vb(device(), v.size() * 2);
  ASSERT_TRUE(kb.Upload(k.data(), k.size() * 2) && vb.Upload(v.data(), v.size() * 2));
  const TensorView kt = kb.View(DType::kBF16, {n, kHeads, kDim});
  const TensorView vt = vb.View(DType::kBF16, {n, kHeads, kDim});
  ASSERT_TRUE(s.Prepare(n).ok());
  for (int layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(c.CalibrateGlobalScales(layer, kt, vt, *cal).ok());
    ASSERT_TRUE(s.AppendLayer(layer, k, v).ok());
  }
  const float gk = MakeFp8KeyScale(Amax(k));
  ASSERT_GT(gk, 0.0f);
  EXPECT_NE(gk, MakeGlobalScale(Amax(k), c.options().recipe));
  for (int layer = 0; layer < 2; ++layer) {
    const LayerScales sc = MustRead(c, layer);
    EXPECT_TRUE(sc.k_calibrated && sc.v_calibrated);
    EXPECT_EQ(sc.k, gk);
    EXPECT_EQ(sc.k_fp8, gk);  // key pages are copied when materialized
    EXPECT_EQ(sc.v, MakeGlobalScale(Amax(v), c.options().recipe));
    EXPECT_EQ(sc.v_fp8, MinFp8ScaleFor(sc.v));
    // The stored key bytes: QuantizeFp8Key under g_k, computed here.
    std::vector<uint8_t> want(k.size());
    const float r = Fp8KeyEncodeMultiplier(gk);
    for (size_t i = 0; i < k.size(); ++i) want[i] = QuantizeFp8Key(Bf16BitsToFloat(k[i]), r);
    EXPECT_EQ(Fp8KeyBytes(c, s.id(), layer, n), want) << "layer " << layer;
    double ke = 0, ve = 0;
    s.Errors(layer, &ke, &ve);
    EXPECT_LT(ke, 0.04);
    EXPECT_GT(ke, 0.0);
    EXPECT_LT(ve, 0.15);
  }
  // Holding tokens: refused, nothing changed.
  const std::vector<uint16_t> k2 = GaussianRows(n, 6.0, 43), v2 = GaussianRows(n, 0.5, 44);
  ASSERT_TRUE(kb.Upload(k2.data(), k2.size() * 2) && vb.Upload(v2.data(), v2.size() * 2));
  const testing::Snapshot before = TakeSnapshot(c);
  const absl::Status refused = c.CalibrateGlobalScales(1, kt, vt, *cal);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("kReencode"), std::string::npos) << refused;
  EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(c)), "");
  // kReencode: new scales from k2 / v2, layer 1's key bytes rewritten.
  const testing::PoolCopy pools = testing::DownloadPools(c);
  ASSERT_TRUE(c.CalibrateGlobalScales(1, kt, vt, *cal, nullptr, StoredTokens::kReencode).ok());
  if (device().is_cuda()) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  const float gk2 = MakeFp8KeyScale(Amax(k2));
  const LayerScales sc = MustRead(c, 1);
  EXPECT_EQ(sc.k, gk2);
  EXPECT_EQ(sc.k_fp8, gk2);
  EXPECT_EQ(sc.v, MakeGlobalScale(Amax(v2), c.options().recipe));
  const testing::PoolCopy after = testing::DownloadPools(c);
  for (int kind = 0; kind < 4; ++kind) EXPECT_EQ(after.regions[kind], pools.regions[kind]);
  std::vector<uint8_t> keys = pools.regions[4];
  const float nr = Fp8KeyEncodeMultiplier(gk2);
  for (uint8_t& b : keys) b = QuantizeFp8Key(DequantFp8Key(b, gk), nr);
  EXPECT_EQ(after.regions[4], keys);
  EXPECT_NE(keys, pools.regions[4]);
  double ke = 0, ve = 0;
  s.Errors(1, &ke, &ve);
  EXPECT_LT(ke, 0.06) << "re-encoded FP8 keys";
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants();
}

// Real post-RoPE keys (tests/data/realkv): stored as FP8 (K8V4), the
// attention output of every 32nd query position is at least 1.8x closer to
// fp64 attention on the bf16 inputs than with NVFP4 keys, in every layer;
// the reconstructed keys are within E4M3's relative step. CPU, first-append
// calibration (headroom 4).
TEST(KVCacheScalesRealKv, Fp8KeysBeatNvfp4KeysInAttention) {
  FP4KV_SKIP_WITHOUT_REALKV();
  constexpr int T = testing::kRealKvTokens, QH = 9, H = 3, D = 64;
  auto round_trip = [&](KeyFormat kf, const std::vector<uint16_t>& k,
                        const std::vector<uint16_t>& v, std::vector<uint16_t>* k_out,
                        std::vector<uint16_t>* v_out) {
    KVCacheOptions o;
    o.num_layers = 1;
    o.geometry = CacheGeometry{H, D, D, 16, (T + 15) / 16, Layout::kNHD};
    o.geometry.key_format = kf;
    o.max_seqs_per_step = 1;
    o.max_tokens_per_step = T;
    KVCache c = MustCreate(o);
    const SequenceId seq = c.CreateSequence().value();
    ASSERT_TRUE(c.PrepareStep({{seq, T}}).ok());
    absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
    ASSERT_TRUE(app.ok());
    ASSERT_TRUE(app->Run(0, TensorView::Contiguous(k.data(), DType::kBF16, {T, H, D}),
                         TensorView::Contiguous(v.data(), DType::kBF16, {T, H, D}))
                    .ok());
    k_out->assign(k.size(), 0);
    v_out->assign(v.size(), 0);
    ASSERT_TRUE(c.ReadSequence(0, seq,
                               TensorView::Contiguous(k_out->data(), DType::kF16, {T, H, D}),
                               TensorView::Contiguous(v_out->data(), DType::kF16, {T, H, D}))
                    .ok());
  };
  // Causal attention (fp64) of query positions 0, 32, 64, ...: [n, QH, D].
  auto attend = [&](const std::vector<uint16_t>& q, const std::vector<uint16_t>& k,
                    const std::vector<uint16_t>& v, bool kv_f16) {
    auto val = [](uint16_t b, bool f16) {
      return static_cast<double>(f16 ? HalfBitsToFloat(b) : Bf16BitsToFloat(b));
    };
    std::vector<double> out, p(T);
    for (int t = 0; t < T; t += 32) {
      for (int h = 0; h < QH; ++h) {
        const int kvh = h / 3;
        double m = -1e300, sum = 0.0;
        for (int s = 0; s <= t; ++s) {
          double dot = 0.0;
          for (int d = 0; d < D; ++d) {
            dot += val(q[(t * QH + h) * D + d], false) * val(k[(s * H + kvh) * D + d], kv_f16);
          }
          p[s] = dot / 8;
          m = std::max(m, p[s]);
        }
        for (int s = 0; s <= t; ++s) sum += (p[s] = std::exp(p[s] - m));
        for (int d = 0; d < D; ++d) {
          double o = 0.0;
          for (int s = 0; s <= t; ++s) o += p[s] / sum * val(v[(s * H + kvh) * D + d], kv_f16);
          out.push_back(o);
        }
      }
    }
    return out;
  };
  auto rel = [](const std::vector<double>& want, const std::vector<double>& got) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < want.size(); ++i) {
      num += (got[i] - want[i]) * (got[i] - want[i]);
      den += want[i] * want[i];
    }
    return std::sqrt(num / den);
  };
  for (int layer : testing::kRealKvLayers) {
    SCOPED_TRACE(layer);
    const testing::RealKvLayer* r = testing::LoadRealKvLayer(layer);
    ASSERT_NE(r, nullptr);
    std::vector<uint16_t> k4, v4, k8, v8;
    round_trip(KeyFormat::kNvfp4, r->k, r->v, &k4, &v4);
    round_trip(KeyFormat::kFp8, r->k, r->v, &k8, &v8);
    ASSERT_EQ(v8, v4) << "values are stored alike";
    for (size_t i = 0; i < k8.size(); ++i) {
      const float x = Bf16BitsToFloat(r->k[i]), y = HalfBitsToFloat(k8[i]);
      ASSERT_LE(std::fabs(x - y), std::fabs(x) / 15 + 1e-3f) << i;
    }
    // Keys only quantized (values exact): the key format's own effect.
    const std::vector<double> ref = attend(r->q, r->k, r->v, false);
    std::vector<uint16_t> v_f16(r->v.size());
    for (size_t i = 0; i < v_f16.size(); ++i) v_f16[i] = FloatToHalfBits(Bf16BitsToFloat(r->v[i]));
    const double e4 = rel(ref, attend(r->q, k4, v_f16, true));
    const double e8 = rel(ref, attend(r->q, k8, v_f16, true));
    EXPECT_LT(e8 * 1.8, e4) << "FP8 keys " << e8 << ", NVFP4 keys " << e4;
    EXPECT_LT(e8, 0.08);
  }
}

TEST_P(ScalesTest, BadHeadroomAndCountersOffAreRejected) {
  for (float h : {0.5f, 0.0f, -2.0f, std::nanf(""), INFINITY}) {
    KVCacheOptions o = DefaultOptions(device());
    o.calibration_headroom = h;
    absl::StatusOr<KVCache> c = KVCache::Create(o);
    ASSERT_FALSE(c.ok()) << h;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("calibration_headroom: expected"), std::string::npos);
  }
  KVCache c = MustCreate(DefaultOptions(device()));
  EXPECT_EQ(c.ReadScaleEvents(0).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c.ResetScaleEvents().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c.ReadScales(5).status().code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Cpu, ScalesTest, ::testing::Values(false));
INSTANTIATE_TEST_SUITE_P(KVCacheScalesGpu, ScalesTest, ::testing::Values(true));

// A graph captured while a layer is pending carries the calibration: the
// first replay calibrates from its rows, later replays leave the scale alone.
TEST(KVCacheScalesGpu, CaptureWhilePendingCalibratesOnFirstReplayOnly) {
  FP4KV_SKIP_WITHOUT_GPU();
  KVCache c = MustCreate(DefaultOptions(Device::Cuda(0)));
  absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
  ASSERT_TRUE(app.ok());
  const SequenceId id = c.CreateSequence().value();
  const int64_t R = c.options().max_tokens_per_step;
  Buffer kb(c.device(), R * kHeads * kDim * 2), vb(c.device(), R * kHeads * kDim * 2);
  const TensorView kt = kb.View(DType::kBF16, {R, kHeads, kDim});
  const TensorView vt = vb.View(DType::kBF16, {R, kHeads, kDim});
  cudaStream_t stream = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Stream st = reinterpret_cast<Stream>(stream);
  ASSERT_TRUE(c.PrepareStep({{id, 4}}, st).ok());
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status captured = app->Run(0, kt, vt, st);
  FP4KV_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(captured.ok()) << captured;
  FP4KV_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  EXPECT_FALSE(MustRead(c, 0).k_calibrated) << "capturing ran nothing";
  const std::vector<uint16_t> first = GaussianRows(R, 0.01, 16);
  ASSERT_TRUE(kb.Upload(first.data(), first.size() * 2) && vb.Upload(first.data(), first.size() * 2));
  FP4KV_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  FP4KV_ASSERT_CUDA(cudaStreamSynchronize(stream));
  // Only the step's 4 rows count.
  const std::vector<uint16_t> four(first.begin(), first.begin() + 4 * kHeads * kDim);
  const float g = MakeGlobalScale(4.0f * Amax(four), c.options().recipe);
  EXPECT_EQ(MustRead(c, 0).k, g);
  EXPECT_EQ(MustRead(c, 0).v, g);
  EXPECT_GE(*c.LayerTokens(0), 4) << "a captured append counts as run";
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(c.PrepareStep({{id, 4}}, st).ok());
    const std::vector<uint16_t> next = GaussianRows(R, 5.0, 17 + step);
    ASSERT_TRUE(kb.Upload(next.data(), next.size() * 2) && vb.Upload(next.data(), next.size() * 2));
    FP4KV_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    FP4KV_ASSERT_CUDA(cudaStreamSynchronize(stream));
    EXPECT_EQ(MustRead(c, 0).k, g) << "step " << step;
  }
  FP4KV_ASSERT_CUDA(cudaGraphExecDestroy(exec));
  FP4KV_ASSERT_CUDA(cudaGraphDestroy(graph));
  FP4KV_ASSERT_CUDA(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace fp4kv
