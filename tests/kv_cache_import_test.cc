// KVCache::ImportSequence: the imported sequence holds exactly the bytes and
// scales that appending the same rows through a step gives (pending layers
// calibrate from the imported rows, calibrated ones keep their scales), and a
// refused import changes nothing. On the CPU; KVCacheImportGpu repeats the
// equality on a GPU.
#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
#include "testing/kv_cache_harness.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

constexpr int kLayers = 2, kHeads = 2, kDim = 64, kPage = 16;

KVCacheOptions Options(bool given_scales, Device device = Device::Cpu(),
                       KeyFormat key_format = KeyFormat::kNvfp4) {
  KVCacheOptions o;
  o.device = device;
  o.num_layers = kLayers;
  o.geometry = CacheGeometry{kHeads, kDim, kDim, kPage, 32, Layout::kNHD};
  o.geometry.key_format = key_format;
  o.max_pages_per_seq = 8;
  o.max_tokens_per_step = 128;
  if (given_scales) {
    o.k_global_scales = {0.01f, 0.02f};
    o.v_global_scales = {0.005f, 0.004f};
  }
  return o;
}

// Source: per layer a bf16 stacked HND cache of 6 pages.
struct Source {
  std::vector<std::vector<uint16_t>> kv;
  std::vector<HalfPagedCache> views;
  explicit Source(uint64_t seed) {
    for (int l = 0; l < kLayers; ++l) {
      kv.push_back(testing::RandomHalfBits(DType::kBF16, 6 * 2 * kHeads * kPage * kDim, seed + l));
    }
    for (int l = 0; l < kLayers; ++l) {
      views.push_back(HalfPagedCache::FromStacked(
                          TensorView::Contiguous(kv[l].data(), DType::kBF16,
                                                 {6, 2, kHeads, kPage, kDim}),
                          Layout::kHND)
                          .value());
    }
  }
  // [tokens, H, D] rows of K (kv = 0) or V of layer l for a sequence in pages.
  std::vector<uint16_t> Rows(int l, int kv_index, const std::vector<int32_t>& pages,
                             int64_t tokens) const {
    std::vector<uint16_t> out;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int h = 0; h < kHeads; ++h) {
        const int64_t off = (((pages[t / kPage] * 2 + kv_index) * kHeads + h) * kPage + t % kPage) * kDim;
        out.insert(out.end(), kv[l].begin() + off, kv[l].begin() + off + kDim);
      }
    }
    return out;
  }
};

// Bytes of token t of a sequence in layer l: K data, V data, K scales, V scales.
std::vector<uint8_t> TokenBytes(const KVCache& c, SequenceId seq, int l, int64_t t) {
  const PagedCache pc = c.LayerCache(l);
  const int32_t page = (*c.SequencePages(seq))[t / kPage];
  std::vector<uint8_t> out;
  for (const TensorView* v : {&pc.k_data, &pc.v_data, &pc.k_scales, &pc.v_scales}) {
    const int64_t row_bytes = v->shape[3] * kHeads;
    const uint8_t* p = static_cast<const uint8_t*>(v->data) + (page * kPage + t % kPage) * row_bytes;
    out.insert(out.end(), p, p + row_bytes);
  }
  return out;
}

TEST(KVCacheImport, EqualsAppendingTheSameRows) {
  for (const KeyFormat kf : {KeyFormat::kNvfp4, KeyFormat::kFp8})
    for (bool given : {false, true}) {
      const Source src(11);
      const std::vector<int32_t> pages = {4, 1, 5, 0};
      const int64_t length = 3 * kPage + 5;
      auto imported = KVCache::Create(Options(given, Device::Cpu(), kf));
      auto appended = KVCache::Create(Options(given, Device::Cpu(), kf));
      ASSERT_TRUE(imported.ok() && appended.ok());
      // A sequence first, so the imported pages are not the first ones.
      (void)imported->CreateSequence().value();
      ASSERT_TRUE(imported->PrepareStep({{imported->CreateSequence().value(), 3}}).ok());
      auto id = imported->ImportHalfPages(src.views, pages, length);
      ASSERT_TRUE(id.ok()) << id.status();
      EXPECT_EQ(*imported->SequenceLength(*id), length);
      EXPECT_EQ(imported->SequencePages(*id)->size(), 4u);

      const SequenceId seq = appended->CreateSequence().value();
      ASSERT_TRUE(appended->PrepareStep({{seq, static_cast<int32_t>(length)}}).ok());
      auto app = appended->appender(DType::kBF16);
      ASSERT_TRUE(app.ok());
      for (int l = 0; l < kLayers; ++l) {
        std::vector<uint16_t> k = src.Rows(l, 0, pages, length), v = src.Rows(l, 1, pages, length);
        ASSERT_TRUE(app->Run(l,
                             TensorView::Contiguous(k.data(), DType::kBF16, {length, kHeads, kDim}),
                             TensorView::Contiguous(v.data(), DType::kBF16, {length, kHeads, kDim}))
                        .ok());
        const LayerScales a = *imported->ReadScales(l), b = *appended->ReadScales(l);
        EXPECT_EQ(FloatBits(a.k), FloatBits(b.k)) << "layer " << l;
        EXPECT_EQ(FloatBits(a.v), FloatBits(b.v));
        EXPECT_EQ(FloatBits(a.k_fp8), FloatBits(b.k_fp8));
        EXPECT_TRUE(a.k_calibrated && a.v_calibrated);
        if (given) {
          EXPECT_EQ(a.k, Options(true).k_global_scales[l]);
        }
        for (int64_t t = 0; t < length; ++t) {
          ASSERT_EQ(TokenBytes(*imported, *id, l, t), TokenBytes(*appended, seq, l, t))
              << "layer " << l << " token " << t << " given " << given << " " << KeyFormatName(kf);
        }
        // The other sequence's step tokens count once its append ran (it did not).
        EXPECT_EQ(*imported->LayerTokens(l), length);
      }
      // The layer's scales are now held: changing them is refused.
      EXPECT_EQ(imported->UpdateGlobalScales(0, 1.0f, 1.0f).code(),
                absl::StatusCode::kFailedPrecondition);
    }
}

// With prefix caching on, an imported sequence's token ids are unknown: it is
// not prefix-tracked, so its pages are never indexed (later steps with token
// ids included) and no later prompt can match them; the cache stays consistent.
TEST(KVCacheImport, ImportedSequencesAreNotPrefixTracked) {
  const Source src(5);
  KVCacheOptions o = Options(true);
  o.prefix_cache.enabled = true;
  o.prefix_cache.max_pending_events = 64;
  auto c = KVCache::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  const int64_t length = 2 * kPage + 3;
  auto id = c->ImportHalfPages(src.views, {2, 3, 4}, length);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(c->CheckInvariants().ok()) << c->CheckInvariants();
  std::vector<int32_t> ids(kPage);
  for (int i = 0; i < kPage; ++i) ids[i] = 1000 + i;
  StepEntry e{*id, kPage};
  e.token_ids = ids;
  ASSERT_TRUE(c->PrepareStep({e}).ok());
  ASSERT_TRUE(c->CheckInvariants().ok()) << c->CheckInvariants();
  EXPECT_EQ(c->Stats().pages_indexed, 0);
  ASSERT_TRUE(c->ReleaseSequence(*id).ok());
  ASSERT_TRUE(c->CheckInvariants().ok()) << c->CheckInvariants();
  EXPECT_EQ(c->Stats().pages_cached, 0);
  EXPECT_EQ(c->Stats().pages_free, 32);
  std::vector<int32_t> prompt(length + kPage);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i);
  EXPECT_EQ(c->MatchPrefix(prompt).tokens, 0);
}

TEST(KVCacheImport, ZeroRowsLeaveAPendingLayerPending) {
  std::vector<uint16_t> zeros(2 * 2 * kHeads * kPage * kDim, 0);
  const HalfPagedCache z = HalfPagedCache::FromStacked(
      TensorView::Contiguous(zeros.data(), DType::kBF16, {2, 2, kPage, kHeads, kDim}), Layout::kNHD)
                               .value();
  auto c = KVCache::Create(Options(false));
  ASSERT_TRUE(c.ok());
  const std::vector<HalfPagedCache> layers(kLayers, z);
  ASSERT_TRUE(c->ImportHalfPages(layers, {1, 0}, 20).ok());
  EXPECT_FALSE(c->ReadScales(0)->k_calibrated);
  EXPECT_FALSE(c->ReadScales(1)->v_calibrated);
}

TEST(KVCacheImport, RefusedImportChangesNothing) {
  const Source src(3);
  auto c = KVCache::Create(Options(false));
  ASSERT_TRUE(c.ok());
  const KVCacheStats before = c->Stats();
  std::vector<HalfPagedCache> bad_dtype = src.views;
  bad_dtype[1].v.dtype = DType::kF16;
  std::vector<HalfPagedCache> one(src.views.begin(), src.views.begin() + 1);
  struct Case {
    absl::StatusOr<SequenceId> result;
    absl::StatusCode code;
    const char* names;
  } cases[] = {
      {c->ImportHalfPages(one, {0}, 4), absl::StatusCode::kInvalidArgument, "layers"},
      {c->ImportHalfPages(src.views, {0}, 40), absl::StatusCode::kInvalidArgument, "src_pages"},
      {c->ImportHalfPages(src.views, {0, 9}, 20), absl::StatusCode::kInvalidArgument, "src_pages"},
      {c->ImportHalfPages(src.views, {0}, -1), absl::StatusCode::kInvalidArgument, "length"},
      {c->ImportHalfPages(bad_dtype, {0}, 4), absl::StatusCode::kInvalidArgument, "layers[1]"},
      {c->ImportHalfPages(src.views, std::vector<int32_t>(9, 0), 9 * kPage),
       absl::StatusCode::kInvalidArgument, "length"},
  };
  for (const Case& k : cases) {
    ASSERT_FALSE(k.result.ok());
    EXPECT_EQ(k.result.status().code(), k.code) << k.result.status();
    EXPECT_TRUE(absl::StrContains(k.result.status().message(), k.names)) << k.result.status();
  }
  // Not enough pages: 4 sequences of 8 pages fill the pool, a fifth is refused.
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(c->ImportHalfPages(src.views, {0, 1, 2, 3, 4, 5, 0, 1}, 8 * kPage).ok());
  }
  const KVCacheStats full = c->Stats();
  auto more = c->ImportHalfPages(src.views, {0}, 1);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(c->Stats().pages_free, full.pages_free);
  EXPECT_EQ(c->Stats().num_sequences, full.num_sequences);
  EXPECT_EQ(before.pages_free, 32);
  EXPECT_EQ(before.num_sequences, 0);
}

// The same equality with both caches, the source pages and the rows on a GPU
// (the device calibration of pending layers included).
TEST(KVCacheImportGpu, EqualsAppendingTheSameRows) {
  FP4KV_SKIP_WITHOUT_GPU();
  const Device dev = Device::Cuda(0);
  for (const KeyFormat kf : {KeyFormat::kNvfp4, KeyFormat::kFp8})
    for (bool given : {false, true}) {
      const Source src(23);
      std::vector<testing::Buffer> dsrc;
      std::vector<HalfPagedCache> views;
      for (int l = 0; l < kLayers; ++l) {
        dsrc.emplace_back(dev, src.kv[l].size() * 2);
        ASSERT_TRUE(dsrc.back().Upload(src.kv[l].data(), src.kv[l].size() * 2));
      }
      for (int l = 0; l < kLayers; ++l) {
        views.push_back(HalfPagedCache::FromStacked(
                            dsrc[l].View(DType::kBF16, {6, 2, kHeads, kPage, kDim}), Layout::kHND)
                            .value());
      }
      const std::vector<int32_t> pages = {2, 5, 0};
      const int64_t length = 2 * kPage + 9;
      auto imported = KVCache::Create(Options(given, dev, kf));
      auto appended = KVCache::Create(Options(given, dev, kf));
      ASSERT_TRUE(imported.ok() && appended.ok());
      (void)imported->CreateSequence().value();
      auto id = imported->ImportHalfPages(views, pages, length);
      ASSERT_TRUE(id.ok()) << id.status();
      const SequenceId seq = appended->CreateSequence().value();
      ASSERT_TRUE(appended->PrepareStep({{seq, static_cast<int32_t>(length)}}).ok());
      auto app = appended->appender(DType::kBF16);
      ASSERT_TRUE(app.ok());
      for (int l = 0; l < kLayers; ++l) {
        const std::vector<uint16_t> k = src.Rows(l, 0, pages, length),
                                    v = src.Rows(l, 1, pages, length);
        testing::Buffer kb(dev, k.size() * 2), vb(dev, v.size() * 2);
        ASSERT_TRUE(kb.Upload(k.data(), k.size() * 2) && vb.Upload(v.data(), v.size() * 2));
        ASSERT_TRUE(app->Run(l, kb.View(DType::kBF16, {length, kHeads, kDim}),
                             vb.View(DType::kBF16, {length, kHeads, kDim}))
                        .ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      }
      const testing::PoolCopy a = testing::DownloadPools(*imported),
                              b = testing::DownloadPools(*appended);
      const CacheGeometry& g = imported->geometry();
      for (int l = 0; l < kLayers; ++l) {
        const LayerScales sa = *imported->ReadScales(l), sb = *appended->ReadScales(l);
        EXPECT_EQ(FloatBits(sa.k), FloatBits(sb.k)) << "layer " << l << " given " << given;
        EXPECT_EQ(FloatBits(sa.v), FloatBits(sb.v)) << "layer " << l << " given " << given;
        EXPECT_TRUE(sa.k_calibrated && sa.v_calibrated);
        for (int64_t t = 0; t < length; ++t) {
          const int32_t pa = (*imported->SequencePages(*id))[t / kPage];
          const int32_t pb = (*appended->SequencePages(seq))[t / kPage];
          for (int kind = 0; kind < 4; ++kind) {
            const int64_t n = kind == 0   ? g.DataRowBytes(false)
                              : kind == 1 ? g.ScaleRowBytes(false)
                              : kind == 2 ? g.DataRowBytes(true)
                                          : g.ScaleRowBytes(true);
            if (n == 0) continue;  // FP8 keys: no key scales
            for (int h = 0; h < kHeads; ++h) {
              const uint8_t* ra = testing::PoolRow(a, g, l, kind, pa, t % kPage, h);
              const uint8_t* rb = testing::PoolRow(b, g, l, kind, pb, t % kPage, h);
              ASSERT_EQ(std::memcmp(ra, rb, n), 0)
                  << "layer " << l << " token " << t << " kind " << kind << " given " << given;
            }
          }
        }
      }
    }
}

}  // namespace
}  // namespace fp4kv
