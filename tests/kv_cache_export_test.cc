// KVCache::ExportSequence / ReserveImport / CommitImport / ImportSequence and
// the sequence image header: byte-exact round trips of a sequence's pages
// over geometries, layouts, recipes, key formats (NVFP4 and FP8 keys),
// partial last pages, forked and prefix-cached pages, host and device
// images; the scale policy (adopt, refuse, requantize, FP8 key layers
// included); reservations; every bad argument (another key format too)
// refused with nothing changed; and a fuzz of the header parser. Cases run on the CPU
// device and, named Gpu/..., on a GPU (skipped without one).
#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fp4kv/kv_cache.h"
#include "fp4kv/recipe.h"
#include "fp4kv/sequence_image.h"
#include "gtest/gtest.h"
#include "testing/kv_cache_harness.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::DiffSnapshots;
using testing::DownloadPools;
using testing::TakeSnapshot;
using testing::Token;
using testing::TokenFactory;

struct Config {
  int layers, heads, dk, dv, page_size;
  Layout layout;
  Recipe recipe;
  KeyFormat key_format = KeyFormat::kNvfp4;
};

KVCacheOptions Options(const Config& c, Device device, bool prefix = false, int64_t pages = 48) {
  KVCacheOptions o;
  o.num_layers = c.layers;
  o.geometry.num_kv_heads = c.heads;
  o.geometry.head_dim_k = c.dk;
  o.geometry.head_dim_v = c.dv;
  o.geometry.page_size = c.page_size;
  o.geometry.layout = c.layout;
  o.geometry.key_format = c.key_format;
  o.geometry.num_pages = pages;
  o.device = device;
  o.recipe = c.recipe;
  for (int l = 0; l < c.layers; ++l) {
    o.k_global_scales.push_back(0.5f + l);
    o.v_global_scales.push_back(0.75f + 2 * l);
  }
  o.max_seqs_per_step = 4;
  o.max_tokens_per_step = 64;
  o.max_pages_per_seq = 16;
  o.prefix_cache.enabled = prefix;
  o.prefix_cache.max_pending_events = prefix ? 64 : 0;
  return o;
}

// true: the GPU
class ExportTest : public testing::CpuOrGpuStreamTest {};

// Appends tokens to sequences (with token ids when `ids` is set) and keeps
// every sequence's expected tokens.
class Writer {
 public:
  Writer(KVCache* cache, Stream stream, uint64_t seed = 1)
      : cache_(cache), stream_(stream), factory_(*cache), next_(seed * 100000 + 1) {
    absl::StatusOr<CacheAppender> a = cache->appender();
    EXPECT_TRUE(a.ok()) << a.status();
    if (a.ok()) appender_.emplace(*a);
  }
  absl::Status Append(SequenceId id, int n, const std::vector<int32_t>* ids = nullptr) {
    StepEntry e{id, n};
    if (ids != nullptr) e.token_ids = *ids;
    absl::StatusOr<StepInfo> info = cache_->PrepareStep({e}, stream_);
    if (!info.ok()) return info.status();
    std::vector<Token> toks;
    for (int i = 0; i < n; ++i) {
      toks.push_back(factory_.Make(next_++));
      tokens_[id].push_back(toks.back());
    }
    absl::Status s = testing::FillStepInputs(*cache_, toks, &inputs_, stream_);
    if (s.ok()) s = testing::RunAppendAllLayers(*cache_, *appender_, &inputs_, stream_);
    return s;
  }
  std::vector<Token>& tokens(SequenceId id) { return tokens_[id]; }

 private:
  KVCache* cache_;
  Stream stream_;
  TokenFactory factory_;
  std::optional<CacheAppender> appender_;
  std::map<SequenceId, std::vector<Token>> tokens_;
  testing::StepInputs inputs_;
  uint64_t next_;
};

// The bytes of a sequence's pages, every layer and region (K data, V data, K
// scales, V scales, as in an image), in block-table order (whole pages).
std::vector<uint8_t> SequencePageBytes(const KVCache& c, SequenceId id) {
  const testing::PoolCopy pools = DownloadPools(c);
  absl::StatusOr<absl::Span<const int32_t>> pages = c.SequencePages(id);
  EXPECT_TRUE(pages.ok()) << pages.status();
  std::vector<uint8_t> out;
  if (!pages.ok()) return out;
  const CacheGeometry& g = c.geometry();
  const int64_t rows = static_cast<int64_t>(g.page_size) * g.num_kv_heads;
  const int64_t row_bytes[4] = {g.DataRowBytes(false), g.DataRowBytes(true),
                                g.ScaleRowBytes(false), g.ScaleRowBytes(true)};
  for (int l = 0; l < c.num_layers(); ++l) {
    for (int r = 0; r < 4; ++r) {
      static constexpr int kKind[4] = {0, 2, 1, 3};  // PoolCopy: K data, K scales, V data, V scales
      const std::vector<uint8_t>& region = pools.regions[l * 4 + kKind[r]];
      const int64_t pb = rows * row_bytes[r];
      for (int32_t p : *pages) {
        out.insert(out.end(), region.begin() + p * pb, region.begin() + (p + 1) * pb);
      }
    }
  }
  return out;
}

// Host memory for an image on the test's device kind: host vector, pinned,
// or device.
enum class ImageMemory { kPageable, kPinned, kDevice };

class Image {
 public:
  Image(ImageMemory kind, int64_t bytes) : kind_(kind), bytes_(bytes) {
    if (kind == ImageMemory::kPageable) {
      host_.assign(static_cast<size_t>(bytes + 15) / 16 + 1, {});
      ptr_ = host_.data();
    } else if (kind == ImageMemory::kPinned) {
      EXPECT_EQ(cudaHostAlloc(&ptr_, static_cast<size_t>(bytes), cudaHostAllocDefault),
                cudaSuccess);
    } else {
      EXPECT_EQ(cudaMalloc(&ptr_, static_cast<size_t>(bytes)), cudaSuccess);
    }
  }
  ~Image() {
    if (kind_ == ImageMemory::kPinned) (void)cudaFreeHost(ptr_);
    if (kind_ == ImageMemory::kDevice) (void)cudaFree(ptr_);
  }
  void* get() const { return ptr_; }
  int64_t bytes() const { return bytes_; }
  std::vector<uint8_t> Host() const {
    std::vector<uint8_t> h(static_cast<size_t>(bytes_));
    if (kind_ == ImageMemory::kDevice) {
      EXPECT_EQ(cudaMemcpy(h.data(), ptr_, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    } else {
      std::memcpy(h.data(), ptr_, h.size());
    }
    return h;
  }

 private:
  struct alignas(16) Chunk {
    uint8_t b[16];
  };
  ImageMemory kind_;
  int64_t bytes_;
  std::vector<Chunk> host_;
  void* ptr_ = nullptr;
};

std::vector<Config> RoundTripConfigs() {
  return {
      {2, 2, 64, 64, 4, Layout::kNHD, Recipe()},
      {2, 2, 64, 64, 4, Layout::kHND, Recipe()},
      {1, 1, 128, 64, 16, Layout::kNHD, Recipe::FourOverSix()},
      {3, 2, 16, 32, 5, Layout::kHND, Recipe::FourOverSix()},
      {2, 3, 32, 16, 1, Layout::kNHD, Recipe()},
      // FP8 keys: no key scale sections.
      {2, 2, 64, 64, 4, Layout::kNHD, Recipe(), KeyFormat::kFp8},
      {3, 2, 16, 32, 5, Layout::kHND, Recipe::FourOverSix(), KeyFormat::kFp8},
      {1, 1, 128, 64, 1, Layout::kHND, Recipe(), KeyFormat::kFp8},
  };
}

TEST_P(ExportTest, RoundTripIsByteExactOverGeometriesLayoutsRecipes) {
  std::vector<ImageMemory> kinds = {ImageMemory::kPageable};
  if (GetParam()) kinds = {ImageMemory::kPageable, ImageMemory::kPinned, ImageMemory::kDevice};
  int cases = 0;
  for (const Config& c : RoundTripConfigs()) {
    for (ImageMemory kind : kinds) {
      for (int len : {0, 1, c.page_size, 3 * c.page_size + 1, 7}) {
        SCOPED_TRACE(::testing::Message()
                     << "page " << c.page_size << " layout " << LayoutName(c.layout) << " dk "
                     << c.dk << " dv " << c.dv << " keys " << KeyFormatName(c.key_format)
                     << " kind " << static_cast<int>(kind) << " len " << len);
        KVCache src = testing::CreateCacheOrAbort(Options(c, device_));
        KVCache dst = testing::CreateCacheOrAbort(Options(c, device_));
        Writer w(&src, stream_);
        // A sequence allocated first so that the exported pages are not 0..n-1.
        const SequenceId other = src.CreateSequence().value();
        ASSERT_TRUE(w.Append(other, c.page_size + 1).ok());
        const SequenceId id = src.CreateSequence().value();
        if (len > 0) {
          ASSERT_TRUE(w.Append(id, len).ok());
        }
        Sync();
        absl::StatusOr<int64_t> bytes = src.ExportedBytes(id);
        ASSERT_TRUE(bytes.ok()) << bytes.status();
        Image img(kind, *bytes);
        ASSERT_TRUE(src.ExportSequence(id, img.get(), img.bytes(), stream_).ok());
        Sync();
        // Host-parseable header with the geometry and length.
        const std::vector<uint8_t> host = img.Host();
        absl::StatusOr<SequenceImageHeader> h = ParseSequenceImageHeader(host.data(), host.size());
        ASSERT_TRUE(h.ok()) << h.status();
        EXPECT_EQ(h->length, len);
        EXPECT_EQ(h->num_layers, c.layers);
        EXPECT_EQ(h->geometry.layout, c.layout);
        EXPECT_EQ(h->image_bytes, *bytes);
        EXPECT_TRUE(h->recipe == c.recipe);
        EXPECT_NE(h->flags & kSequenceImageScalesKnown, 0u);
        // The key format byte is the cache's; FP8 keys: Dk-byte key rows and
        // a 0-byte key scale region.
        EXPECT_EQ(h->key_format, static_cast<uint8_t>(c.key_format));
        EXPECT_EQ(h->geometry.key_format, c.key_format);
        EXPECT_EQ(host[41], static_cast<uint8_t>(c.key_format));
        const int64_t rows = int64_t{c.page_size} * c.heads;
        const bool fp8 = c.key_format == KeyFormat::kFp8;
        EXPECT_EQ(h->region_page_bytes[0], rows * (fp8 ? c.dk : c.dk / 2));
        EXPECT_EQ(h->region_page_bytes[2], fp8 ? 0 : rows * c.dk / 16);
        EXPECT_EQ(h->region_page_bytes[3], rows * c.dv / 16);
        // The scale table holds the source's scales and flags.
        for (int l = 0; l < c.layers; ++l) {
          float k, v;
          int32_t kf;
          std::memcpy(&k, host.data() + h->scales_offset + 16 * l, 4);
          std::memcpy(&v, host.data() + h->scales_offset + 16 * l + 4, 4);
          std::memcpy(&kf, host.data() + h->scales_offset + 16 * c.layers + 8 * l, 4);
          EXPECT_EQ(k, 0.5f + l);
          EXPECT_EQ(v, 0.75f + 2 * l);
          EXPECT_EQ(kf, 1);
        }
        const bool dev_image = kind == ImageMemory::kDevice;
        absl::StatusOr<SequenceId> got =
            dev_image ? dst.ImportSequence(img.get(), img.bytes(), {}, stream_)
                      : [&]() -> absl::StatusOr<SequenceId> {
          absl::StatusOr<ImportReservation> r = dst.ReserveImport(*h);
          if (!r.ok()) return r.status();
          EXPECT_EQ(dst.Stats().pages_reserved, h->num_pages);
          return dst.CommitImport(*std::move(r), img.get(), img.bytes(), {}, stream_);
        }();
        ASSERT_TRUE(got.ok()) << got.status();
        Sync();
        EXPECT_EQ(*dst.SequenceLength(*got), len);
        {
          const std::vector<uint8_t> a = SequencePageBytes(dst, *got), b = SequencePageBytes(src, id);
          ASSERT_EQ(a.size(), b.size());
          size_t i = 0;
          while (i < a.size() && a[i] == b[i]) ++i;
          EXPECT_EQ(i, a.size()) << "first difference at byte " << i << " of " << a.size();
        }
        EXPECT_EQ(testing::CheckSequenceBytes(dst, DownloadPools(dst), *got, w.tokens(id)), "");
        EXPECT_TRUE(dst.CheckInvariants().ok()) << dst.CheckInvariants();
        const KVCacheStats st = dst.Stats();
        EXPECT_EQ(st.pages_reserved, 0);
        EXPECT_EQ(st.num_sequences, 1);
        EXPECT_EQ(st.bytes_imported, *bytes);
        EXPECT_EQ(src.Stats().bytes_exported, *bytes);
        // The imported sequence keeps working: append and check.
        Writer w2(&dst, stream_, 7);
        w2.tokens(*got) = w.tokens(id);
        ASSERT_TRUE(w2.Append(*got, 3).ok());
        Sync();
        EXPECT_EQ(testing::CheckSequenceBytes(dst, DownloadPools(dst), *got, w2.tokens(*got)), "");
        ++cases;
      }
    }
  }
  EXPECT_GE(cases, 40);
}

TEST_P(ExportTest, ForkedAndSharedPagesExportWithTheirBytes) {
  const Config c{2, 2, 64, 64, 4, Layout::kNHD, Recipe()};
  KVCache src = testing::CreateCacheOrAbort(Options(c, device_));
  KVCache dst = testing::CreateCacheOrAbort(Options(c, device_));
  Writer w(&src, stream_);
  const SequenceId parent = src.CreateSequence().value();
  ASSERT_TRUE(w.Append(parent, 10).ok());  // partial last page, shared by the fork
  absl::StatusOr<SequenceId> child = src.ForkSequence(parent);
  ASSERT_TRUE(child.ok());
  w.tokens(*child) = w.tokens(parent);
  ASSERT_TRUE(w.Append(*child, 3).ok());  // copy on write of the shared last page
  Sync();
  EXPECT_GT(src.Stats().pages_shared, 0);
  for (SequenceId id : {parent, *child}) {
    const int64_t bytes = *src.ExportedBytes(id);
    Image img(ImageMemory::kPageable, bytes);
    ASSERT_TRUE(src.ExportSequence(id, img.get(), bytes, stream_).ok());
    Sync();
    absl::StatusOr<SequenceId> got = dst.ImportSequence(img.get(), bytes, {}, stream_);
    ASSERT_TRUE(got.ok()) << got.status();
    Sync();
    EXPECT_EQ(SequencePageBytes(dst, *got), SequencePageBytes(src, id));
    EXPECT_EQ(testing::CheckSequenceBytes(dst, DownloadPools(dst), *got, w.tokens(id)), "");
  }
  // The source is unchanged by the exports.
  EXPECT_EQ(testing::CheckSequenceBytes(src, DownloadPools(src), parent, w.tokens(parent)), "");
  EXPECT_TRUE(src.CheckInvariants().ok());
  EXPECT_TRUE(dst.CheckInvariants().ok());
}

TEST_P(ExportTest, PrefixCachedSequenceCarriesTokensAndIsIndexedInTheTarget) {
  const Config c{2, 2, 64, 64, 4, Layout::kHND, Recipe()};
  KVCache src = testing::CreateCacheOrAbort(Options(c, device_, /*prefix=*/true));
  KVCache dst = testing::CreateCacheOrAbort(Options(c, device_, /*prefix=*/true));
  Writer w(&src, stream_);
  std::vector<int32_t> prompt(14);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(100 + 7 * i);
  const SequenceId a = src.CreateSequence().value();
  ASSERT_TRUE(w.Append(a, 14, &prompt).ok());
  Sync();
  // A second sequence shares a's cached pages.
  absl::StatusOr<PrefixSequence> b = src.CreateSequenceFromPrefix(prompt);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->cached_tokens, 12);
  const int64_t bytes = *src.ExportedBytes(a);
  Image img(ImageMemory::kPageable, bytes);
  ASSERT_TRUE(src.ExportSequence(a, img.get(), bytes, stream_).ok());
  Sync();
  absl::StatusOr<SequenceImageHeader> h = ParseSequenceImageHeader(img.get(), bytes);
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(h->has_tokens());
  absl::StatusOr<SequenceId> got = dst.ImportSequence(img.get(), bytes, {}, stream_);
  ASSERT_TRUE(got.ok()) << got.status();
  Sync();
  EXPECT_EQ(SequencePageBytes(dst, *got), SequencePageBytes(src, a));
  // Its full pages are indexed in the target: a new prompt reuses them.
  const PrefixMatch m = dst.MatchPrefix(prompt);
  EXPECT_EQ(m.tokens, 12);
  EXPECT_TRUE(dst.CheckInvariants().ok()) << dst.CheckInvariants();
  // The shared-page sequence of the source exports too (its 3 pages).
  const int64_t bbytes = *src.ExportedBytes(b->seq);
  Image bimg(ImageMemory::kPageable, bbytes);
  ASSERT_TRUE(src.ExportSequence(b->seq, bimg.get(), bbytes, stream_).ok());
  Sync();
  absl::StatusOr<SequenceId> got_b = dst.ImportSequence(bimg.get(), bbytes, {}, stream_);
  ASSERT_TRUE(got_b.ok()) << got_b.status();
  Sync();
  EXPECT_EQ(SequencePageBytes(dst, *got_b), SequencePageBytes(src, b->seq));
  // A corrupted token id is caught by the page hashes: DataLoss, nothing changed.
  std::vector<uint8_t> bad(static_cast<const uint8_t*>(img.get()),
                           static_cast<const uint8_t*>(img.get()) + bytes);
  bad[h->tokens_offset + 4 * 5] ^= 1;  // no extra key: the ids start the section; token 5
  Image bad_img(ImageMemory::kPageable, bytes);
  std::memcpy(bad_img.get(), bad.data(), bad.size());
  const testing::Snapshot before = TakeSnapshot(dst);
  absl::StatusOr<SequenceId> corrupt = dst.ImportSequence(bad_img.get(), bytes, {}, stream_);
  if (corrupt.ok()) {
    ADD_FAILURE() << "a corrupted token id was accepted";
  } else {
    EXPECT_EQ(corrupt.status().code(), absl::StatusCode::kDataLoss) << corrupt.status();
    EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(dst)), "");
  }
}

TEST_P(ExportTest, IncompatibleCachesAreRefusedAndNothingChanges) {
  const Config c{2, 2, 64, 64, 4, Layout::kNHD, Recipe()};
  KVCache src = testing::CreateCacheOrAbort(Options(c, device_));
  Writer w(&src, stream_);
  const SequenceId id = src.CreateSequence().value();
  ASSERT_TRUE(w.Append(id, 9).ok());
  Sync();
  const int64_t bytes = *src.ExportedBytes(id);
  Image img(ImageMemory::kPageable, bytes);
  ASSERT_TRUE(src.ExportSequence(id, img.get(), bytes, stream_).ok());
  Sync();
  const SequenceImageHeader h = *ParseSequenceImageHeader(img.get(), bytes);
  struct Bad {
    const char* field;
    Config config;
  };
  const Bad bads[] = {
      {"num_layers", {3, 2, 64, 64, 4, Layout::kNHD, Recipe()}},
      {"num_kv_heads", {2, 1, 64, 64, 4, Layout::kNHD, Recipe()}},
      {"head_dim_k", {2, 2, 128, 64, 4, Layout::kNHD, Recipe()}},
      {"head_dim_v", {2, 2, 64, 32, 4, Layout::kNHD, Recipe()}},
      {"page_size", {2, 2, 64, 64, 8, Layout::kNHD, Recipe()}},
      {"layout", {2, 2, 64, 64, 4, Layout::kHND, Recipe()}},
      {"recipe", {2, 2, 64, 64, 4, Layout::kNHD, Recipe::FourOverSix()}},
      {"key_format", {2, 2, 64, 64, 4, Layout::kNHD, Recipe(), KeyFormat::kFp8}},
  };
  for (const Bad& b : bads) {
    SCOPED_TRACE(b.field);
    KVCache dst = testing::CreateCacheOrAbort(Options(b.config, device_));
    const testing::Snapshot before = TakeSnapshot(dst);
    absl::StatusOr<SequenceId> got = dst.ImportSequence(img.get(), bytes, {}, stream_);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(got.status().message().find(b.field), absl::string_view::npos) << got.status();
    absl::StatusOr<ImportReservation> r = dst.ReserveImport(h);
    EXPECT_FALSE(r.ok());
    EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(dst)), "");
    EXPECT_EQ(dst.Stats().pages_reserved, 0);
  }
  // Too long for the target's max_pages_per_seq, and too few pages.
  {
    KVCacheOptions o = Options(c, device_);
    o.max_pages_per_seq = 2;
    KVCache dst = testing::CreateCacheOrAbort(o);
    const testing::Snapshot before = TakeSnapshot(dst);
    absl::StatusOr<ImportReservation> r = dst.ReserveImport(h);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(dst)), "");
  }
  {
    KVCache dst = testing::CreateCacheOrAbort(Options(c, device_, false, /*pages=*/2));
    const testing::Snapshot before = TakeSnapshot(dst);
    absl::StatusOr<ImportReservation> r = dst.ReserveImport(h);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
    EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(dst)), "");
  }
  // Bad arguments of a compatible cache.
  KVCache dst = testing::CreateCacheOrAbort(Options(c, device_));
  const testing::Snapshot before = TakeSnapshot(dst);
  EXPECT_EQ(dst.ImportSequence(nullptr, bytes).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dst.ImportSequence(img.get(), bytes - 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dst.ImportSequence(img.get(), 100).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dst.ImportSequence(static_cast<uint8_t*>(img.get()) + 4, bytes).status().code(),
            absl::StatusCode::kInvalidArgument);
  {
    absl::StatusOr<ImportReservation> r = dst.ReserveImport(h);
    ASSERT_TRUE(r.ok());
    ImportOptions bad_opt;
    bad_opt.on_scale_mismatch = static_cast<StoredTokens>(7);
    EXPECT_EQ(dst.CommitImport(*std::move(r), img.get(), bytes, bad_opt).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    // A host image whose header differs from the reserved one.
    SequenceImageHeader other = h;
    absl::StatusOr<SequenceImageHeader> shorter =
        MakeSequenceImageHeader(h.geometry, h.num_layers, h.recipe, h.length - 1, h.flags, 0,
                                h.scale_fingerprint);
    ASSERT_TRUE(shorter.ok());
    other = *shorter;
    absl::StatusOr<ImportReservation> r = dst.ReserveImport(other);
    ASSERT_TRUE(r.ok()) << r.status();
    absl::StatusOr<SequenceId> got = dst.CommitImport(*std::move(r), img.get(), bytes);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  }
  int64_t junk = 0;
  EXPECT_FALSE(src.ExportSequence(id, nullptr, bytes).ok());
  EXPECT_FALSE(src.ExportSequence(id, img.get(), bytes - 1).ok());
  EXPECT_EQ(src.ExportSequence(12345, img.get(), bytes).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(src.ExportedBytes(12345).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(src.ExportSequence(id, &junk, sizeof(junk)).ok());
  EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(dst)), "");
  EXPECT_TRUE(dst.CheckInvariants().ok());
}

TEST_P(ExportTest, ScalesRefuseByDefaultRequantizeOnRequestAdoptWhenPending) {
  const Config c{2, 2, 64, 64, 4, Layout::kNHD, Recipe()};
  KVCache src = testing::CreateCacheOrAbort(Options(c, device_));
  Writer w(&src, stream_);
  const SequenceId id = src.CreateSequence().value();
  ASSERT_TRUE(w.Append(id, 11).ok());
  Sync();
  const int64_t bytes = *src.ExportedBytes(id);
  Image img(ImageMemory::kPageable, bytes);
  ASSERT_TRUE(src.ExportSequence(id, img.get(), bytes, stream_).ok());
  Sync();
  const std::vector<uint8_t> src_bytes = SequencePageBytes(src, id);

  // Other scales in layer 1 (the host knows both sides: no sync needed to tell).
  KVCacheOptions o = Options(c, device_);
  o.k_global_scales[1] = 2.0f;
  {
    KVCache dst = testing::CreateCacheOrAbort(o);
    const testing::Snapshot before = TakeSnapshot(dst);
    absl::StatusOr<SequenceId> got = dst.ImportSequence(img.get(), bytes, {}, stream_);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(got.status().message().find("layer 1 K"), absl::string_view::npos) << got.status();
    EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(dst)), "");
    EXPECT_EQ(dst.Stats().pages_reserved, 0);
  }
  {
    KVCache dst = testing::CreateCacheOrAbort(o);
    ImportOptions req;
    req.on_scale_mismatch = StoredTokens::kReencode;
    absl::StatusOr<SequenceId> got = dst.ImportSequence(img.get(), bytes, req, stream_);
    ASSERT_TRUE(got.ok()) << got.status();
    Sync();
    // Layer 0 and layer 1's V: bytes as they were; layer 1's K: each block
    // requantized from g = 1.5 to 2.0 (computed here from the source bytes).
    std::vector<uint8_t> want = src_bytes;
    const CacheGeometry& g = dst.geometry();
    const int64_t n = 3;  // pages of 11 tokens
    const int64_t rows = int64_t{g.page_size} * g.num_kv_heads;
    const int64_t region[4] = {rows * g.DataRowBytes(false) * n, rows * g.DataRowBytes(true) * n,
                               rows * g.ScaleRowBytes(false) * n, rows * g.ScaleRowBytes(true) * n};
    const int64_t layer_bytes = region[0] + region[1] + region[2] + region[3];
    uint8_t* kd = want.data() + layer_bytes;
    uint8_t* ks = kd + region[0] + region[1];
    for (int64_t b = 0; b < region[2]; ++b) {
      uint32_t packed[2];
      std::memcpy(packed, kd + 8 * b, 8);
      float x[kBlockSize];
      DequantizeBlock(packed, ks[b], 1.5f, x);
      ks[b] = QuantizeBlock(x, 2.0f, Recipe(), packed);
      std::memcpy(kd + 8 * b, packed, 8);
    }
    EXPECT_EQ(SequencePageBytes(dst, *got), want);
    EXPECT_NE(want, src_bytes);
    absl::StatusOr<LayerScales> s1 = dst.ReadScales(1, stream_);
    EXPECT_EQ(s1->k, 2.0f);  // the target keeps its scales
  }
  // Scales set again from the host to the same values: still host-known,
  // equal fingerprints, bytes copied.
  {
    KVCache dst = testing::CreateCacheOrAbort(Options(c, device_));
    ASSERT_TRUE(dst.UpdateGlobalScales(0, 0.5f, 0.75f, stream_).ok());
    absl::StatusOr<SequenceId> got = dst.ImportSequence(img.get(), bytes, {}, stream_);
    ASSERT_TRUE(got.ok()) << got.status();
    Sync();
    EXPECT_EQ(SequencePageBytes(dst, *got), src_bytes);
  }
  // A target that calibrated its scales on the device from its own first
  // rows (not host-known, holding tokens): the default refusal reads both
  // tables back (a host sync) and refuses; kReencode requantizes.
  {
    KVCacheOptions p = Options(c, device_);
    p.k_global_scales.clear();
    p.v_global_scales.clear();
    KVCache dst = testing::CreateCacheOrAbort(p);
    Writer w2(&dst, stream_, 9);
    const SequenceId own = dst.CreateSequence().value();
    ASSERT_TRUE(w2.Append(own, 2).ok());
    Sync();
    const testing::Snapshot before = TakeSnapshot(dst);
    absl::StatusOr<SequenceId> got = dst.ImportSequence(img.get(), bytes, {}, stream_);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
    EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(dst)), "");
    ImportOptions req;
    req.on_scale_mismatch = StoredTokens::kReencode;
    got = dst.ImportSequence(img.get(), bytes, req, stream_);
    ASSERT_TRUE(got.ok()) << got.status();
    Sync();
    EXPECT_NE(SequencePageBytes(dst, *got), src_bytes);
    EXPECT_TRUE(dst.CheckInvariants().ok());
  }
  // Pending target (no scales given, nothing stored): adopts the image's
  // scales and calibrated flags, bytes identical.
  {
    KVCacheOptions p = Options(c, device_);
    p.k_global_scales.clear();
    p.v_global_scales.clear();
    KVCache dst = testing::CreateCacheOrAbort(p);
    absl::StatusOr<SequenceId> got = dst.ImportSequence(img.get(), bytes, {}, stream_);
    ASSERT_TRUE(got.ok()) << got.status();
    Sync();
    EXPECT_EQ(SequencePageBytes(dst, *got), src_bytes);
    for (int l = 0; l < 2; ++l) {
      absl::StatusOr<LayerScales> a = src.ReadScales(l, stream_);
      absl::StatusOr<LayerScales> b = dst.ReadScales(l, stream_);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(a->k, b->k);
      EXPECT_EQ(a->v, b->v);
      EXPECT_EQ(a->k_fp8, b->k_fp8);
      EXPECT_EQ(a->v_fp8, b->v_fp8);
      EXPECT_TRUE(b->k_calibrated && b->v_calibrated);
    }
    // Appends after the adoption use the adopted scales (no calibration).
    Writer w2(&dst, stream_, 5);
    w2.tokens(*got) = w.tokens(id);
    ASSERT_TRUE(w2.Append(*got, 2).ok());
    Sync();
    EXPECT_EQ(testing::CheckSequenceBytes(dst, DownloadPools(dst), *got, w2.tokens(*got)), "");
    EXPECT_EQ(dst.ReadScales(0, stream_)->k, 0.5f);
  }
}

// An FP8-key image does not import into an NVFP4-key cache (nor the other
// way, above): InvalidArgument naming key_format, nothing changed; the same
// image imports into an FP8-key cache.
TEST_P(ExportTest, Fp8KeyImageIntoNvfp4KeyCacheIsRefused) {
  const Config c{2, 2, 64, 64, 4, Layout::kHND, Recipe(), KeyFormat::kFp8};
  KVCache src = testing::CreateCacheOrAbort(Options(c, device_));
  Writer w(&src, stream_);
  const SequenceId id = src.CreateSequence().value();
  ASSERT_TRUE(w.Append(id, 9).ok());
  Sync();
  const int64_t bytes = *src.ExportedBytes(id);
  Image img(ImageMemory::kPageable, bytes);
  ASSERT_TRUE(src.ExportSequence(id, img.get(), bytes, stream_).ok());
  Sync();
  const SequenceImageHeader h = *ParseSequenceImageHeader(img.get(), bytes);
  EXPECT_EQ(h.key_format, kKeyFormatFp8);
  Config nv = c;
  nv.key_format = KeyFormat::kNvfp4;
  KVCache dst = testing::CreateCacheOrAbort(Options(nv, device_));
  const testing::Snapshot before = TakeSnapshot(dst);
  for (ImportOptions opt : {ImportOptions{}, ImportOptions{StoredTokens::kReencode}}) {
    absl::StatusOr<SequenceId> got = dst.ImportSequence(img.get(), bytes, opt, stream_);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(got.status().message().find("key_format"), absl::string_view::npos) << got.status();
  }
  absl::StatusOr<ImportReservation> r = dst.ReserveImport(h);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("key_format"), absl::string_view::npos) << r.status();
  Sync();
  EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(dst)), "");
  EXPECT_EQ(dst.Stats().pages_reserved, 0);
  EXPECT_TRUE(dst.CheckInvariants().ok());
  KVCache same = testing::CreateCacheOrAbort(Options(c, device_));
  absl::StatusOr<SequenceId> got = same.ImportSequence(img.get(), bytes, {}, stream_);
  ASSERT_TRUE(got.ok()) << got.status();
  Sync();
  EXPECT_EQ(SequencePageBytes(same, *got), SequencePageBytes(src, id));
  EXPECT_EQ(testing::CheckSequenceBytes(same, DownloadPools(same), *got, w.tokens(id)), "");
}

// The scale policy with FP8 keys: differing key (and value) scales are
// refused by default, requantized on request (key bytes
// QuantizeFp8Key(DequantFp8Key(c, g_src), Fp8KeyEncodeMultiplier(g_dst)),
// value blocks as for NVFP4; computed here from the source bytes), and a
// pending target adopts the image's scales, the key FP8 scale (g_k itself)
// included.
TEST_P(ExportTest, Fp8KeyScalesRefuseRequantizeAndAdopt) {
  const Config c{2, 2, 64, 32, 4, Layout::kNHD, Recipe(), KeyFormat::kFp8};
  KVCache src = testing::CreateCacheOrAbort(Options(c, device_));
  Writer w(&src, stream_);
  const SequenceId id = src.CreateSequence().value();
  ASSERT_TRUE(w.Append(id, 11).ok());
  Sync();
  const int64_t bytes = *src.ExportedBytes(id);
  Image img(ImageMemory::kPageable, bytes);
  ASSERT_TRUE(src.ExportSequence(id, img.get(), bytes, stream_).ok());
  Sync();
  const std::vector<uint8_t> src_bytes = SequencePageBytes(src, id);

  // Layer 1's K scale 1.5 -> 0.375 (key codes about 4x larger), layer 0's
  // V scale 0.75 -> 1.25.
  KVCacheOptions o = Options(c, device_);
  o.k_global_scales[1] = 0.375f;
  o.v_global_scales[0] = 1.25f;
  {
    KVCache dst = testing::CreateCacheOrAbort(o);
    const testing::Snapshot before = TakeSnapshot(dst);
    absl::StatusOr<SequenceId> got = dst.ImportSequence(img.get(), bytes, {}, stream_);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(got.status().message().find("layer 0 V"), absl::string_view::npos) << got.status();
    EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(dst)), "");
  }
  {
    KVCache dst = testing::CreateCacheOrAbort(o);
    ImportOptions req;
    req.on_scale_mismatch = StoredTokens::kReencode;
    absl::StatusOr<SequenceId> got = dst.ImportSequence(img.get(), bytes, req, stream_);
    ASSERT_TRUE(got.ok()) << got.status();
    Sync();
    std::vector<uint8_t> want = src_bytes;
    const CacheGeometry& g = dst.geometry();
    const int64_t n = 3;  // pages of 11 tokens
    const int64_t rows = int64_t{g.page_size} * g.num_kv_heads;
    const int64_t region[4] = {rows * g.DataRowBytes(false) * n, rows * g.DataRowBytes(true) * n,
                               rows * g.ScaleRowBytes(false) * n, rows * g.ScaleRowBytes(true) * n};
    ASSERT_EQ(region[2], 0);
    const int64_t layer_bytes = region[0] + region[1] + region[2] + region[3];
    // Layer 1's key bytes.
    uint8_t* k1 = want.data() + layer_bytes;
    const float r = Fp8KeyEncodeMultiplier(0.375f);
    int changed = 0;
    for (int64_t i = 0; i < region[0]; ++i) {
      const uint8_t q = QuantizeFp8Key(DequantFp8Key(k1[i], 1.5f), r);
      changed += q != k1[i];
      k1[i] = q;
    }
    EXPECT_GT(changed, region[0] / 2);
    // Layer 0's value blocks.
    uint8_t* vd = want.data() + region[0];
    uint8_t* vs = want.data() + region[0] + region[1] + region[2];
    for (int64_t b = 0; b < region[3]; ++b) {
      uint32_t packed[2];
      std::memcpy(packed, vd + 8 * b, 8);
      float x[kBlockSize];
      DequantizeBlock(packed, vs[b], 0.75f, x);
      vs[b] = QuantizeBlock(x, 1.25f, Recipe(), packed);
      std::memcpy(vd + 8 * b, packed, 8);
    }
    const std::vector<uint8_t> got_bytes = SequencePageBytes(dst, *got);
    ASSERT_EQ(got_bytes.size(), want.size());
    size_t i = 0;
    while (i < want.size() && got_bytes[i] == want[i]) ++i;
    EXPECT_EQ(i, want.size()) << "first difference at byte " << i << " of " << want.size();
    EXPECT_NE(want, src_bytes);
    absl::StatusOr<LayerScales> s1 = dst.ReadScales(1, stream_);
    ASSERT_TRUE(s1.ok());
    EXPECT_EQ(s1->k, 0.375f);  // the target keeps its scales
    EXPECT_EQ(s1->k_fp8, 0.375f);
    EXPECT_TRUE(dst.CheckInvariants().ok());
  }
  // A pending FP8-key target adopts the scales of a source that calibrated
  // them on the device from its first append (g_k = MakeFp8KeyScale(4 amax),
  // k_fp8 = g_k).
  {
    KVCacheOptions p = Options(c, device_);
    p.k_global_scales.clear();
    p.v_global_scales.clear();
    KVCache calibrated = testing::CreateCacheOrAbort(p);
    Writer wc(&calibrated, stream_, 3);
    const SequenceId cid = calibrated.CreateSequence().value();
    ASSERT_TRUE(wc.Append(cid, 7).ok());
    Sync();
    const int64_t cbytes = *calibrated.ExportedBytes(cid);
    Image cimg(ImageMemory::kPageable, cbytes);
    ASSERT_TRUE(calibrated.ExportSequence(cid, cimg.get(), cbytes, stream_).ok());
    Sync();
    KVCache dst = testing::CreateCacheOrAbort(p);
    absl::StatusOr<SequenceId> got = dst.ImportSequence(cimg.get(), cbytes, {}, stream_);
    ASSERT_TRUE(got.ok()) << got.status();
    Sync();
    EXPECT_EQ(SequencePageBytes(dst, *got), SequencePageBytes(calibrated, cid));
    for (int l = 0; l < 2; ++l) {
      absl::StatusOr<LayerScales> a = calibrated.ReadScales(l, stream_);
      absl::StatusOr<LayerScales> b = dst.ReadScales(l, stream_);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_TRUE(a->k_calibrated && a->v_calibrated);
      EXPECT_EQ(b->k, a->k);
      EXPECT_EQ(b->v, a->v);
      EXPECT_EQ(b->k_fp8, a->k_fp8);
      EXPECT_EQ(b->k_fp8, b->k);  // FP8 keys: the materialize scale is g_k
      EXPECT_EQ(b->v_fp8, a->v_fp8);
      EXPECT_TRUE(b->k_calibrated && b->v_calibrated);
    }
    // Appends after the adoption use the adopted scales (no calibration).
    Writer w2(&dst, stream_, 5);
    const SequenceId fresh = dst.CreateSequence().value();
    ASSERT_TRUE(w2.Append(fresh, 6).ok());
    ASSERT_TRUE(w2.Append(*got, 2).ok());
    Sync();
    EXPECT_EQ(testing::CheckSequenceBytes(dst, DownloadPools(dst), fresh, w2.tokens(fresh)), "");
    EXPECT_EQ(dst.ReadScales(0, stream_)->k, calibrated.ReadScales(0, stream_)->k);
    EXPECT_EQ(dst.ReadScales(1, stream_)->v, calibrated.ReadScales(1, stream_)->v);
    EXPECT_TRUE(dst.CheckInvariants().ok());
  }
}

TEST_P(ExportTest, ReservationsCancelCommitOnceAndNeverLeak) {
  const Config c{2, 2, 64, 64, 4, Layout::kNHD, Recipe()};
  KVCache src = testing::CreateCacheOrAbort(Options(c, device_));
  Writer w(&src, stream_);
  const SequenceId id = src.CreateSequence().value();
  ASSERT_TRUE(w.Append(id, 9).ok());
  Sync();
  const int64_t bytes = *src.ExportedBytes(id);
  Image img(ImageMemory::kPageable, bytes);
  ASSERT_TRUE(src.ExportSequence(id, img.get(), bytes, stream_).ok());
  Sync();
  const SequenceImageHeader h = *ParseSequenceImageHeader(img.get(), bytes);
  KVCache dst = testing::CreateCacheOrAbort(Options(c, device_));
  const int64_t total = dst.Stats().pages_total;
  {
    absl::StatusOr<ImportReservation> r = dst.ReserveImport(h);
    ASSERT_TRUE(r.ok());
    EXPECT_NE(r->id(), 0u);
    KVCacheStats st = dst.Stats();
    EXPECT_EQ(st.pages_reserved, 3);
    EXPECT_EQ(st.pages_used, 3);
    EXPECT_EQ(st.num_sequences, 0);  // not visible yet
    EXPECT_TRUE(st.sequence_lengths.empty());
    EXPECT_TRUE(dst.CheckInvariants().ok()) << dst.CheckInvariants();
    ASSERT_TRUE(dst.CancelImport(*std::move(r)).ok());
    EXPECT_EQ(dst.Stats().pages_free, total);
    EXPECT_EQ(dst.Stats().pages_reserved, 0);
  }
  {
    // Dropped without commit: the pages come back.
    absl::StatusOr<ImportReservation> r = dst.ReserveImport(h);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(dst.Stats().pages_free, total - 3);
  }
  EXPECT_EQ(dst.Stats().pages_free, total);
  {
    // Moved: one owner.
    absl::StatusOr<ImportReservation> r = dst.ReserveImport(h);
    ImportReservation moved = *std::move(r);
    ImportReservation again;
    again = std::move(moved);
    EXPECT_EQ(moved.id(), 0u);
    EXPECT_EQ(dst.Stats().pages_reserved, 3);
    // Empty and foreign reservations are refused.
    EXPECT_EQ(dst.CancelImport(ImportReservation()).code(), absl::StatusCode::kInvalidArgument);
    KVCache other = testing::CreateCacheOrAbort(Options(c, device_));
    absl::StatusOr<ImportReservation> foreign = other.ReserveImport(h);
    ASSERT_TRUE(foreign.ok());
    EXPECT_EQ(dst.CommitImport(*std::move(foreign), img.get(), bytes).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(other.Stats().pages_reserved, 0);  // cancelled in its own cache
    absl::StatusOr<SequenceId> got = dst.CommitImport(std::move(again), img.get(), bytes, {}, stream_);
    ASSERT_TRUE(got.ok()) << got.status();
    Sync();
    EXPECT_EQ(SequencePageBytes(dst, *got), SequencePageBytes(src, id));
    EXPECT_EQ(dst.Stats().pages_reserved, 0);
  }
  // A reservation that outlives its cache is harmless.
  std::optional<ImportReservation> late;
  {
    KVCache tmp = testing::CreateCacheOrAbort(Options(c, device_));
    absl::StatusOr<ImportReservation> r = tmp.ReserveImport(h);
    ASSERT_TRUE(r.ok());
    late.emplace(*std::move(r));
  }
  late.reset();
  EXPECT_TRUE(dst.CheckInvariants().ok());
}

TEST_P(ExportTest, FailedExportsWriteNothingAndMovedFromCachesRefuse) {
  const Config c{2, 2, 64, 64, 4, Layout::kNHD, Recipe()};
  KVCache src = testing::CreateCacheOrAbort(Options(c, device_));
  Writer w(&src, stream_);
  const SequenceId id = src.CreateSequence().value();
  ASSERT_TRUE(w.Append(id, 6).ok());
  Sync();
  const int64_t bytes = *src.ExportedBytes(id);
  std::vector<uint8_t> poison(static_cast<size_t>(bytes), testing::kPoison);
  Image img(ImageMemory::kPageable, bytes);
  std::memcpy(img.get(), poison.data(), poison.size());
  EXPECT_EQ(src.ExportSequence(id, img.get(), bytes - 16, stream_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(src.ExportSequence(id + 100, img.get(), bytes, stream_).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(src.ExportSequence(id, static_cast<uint8_t*>(img.get()) + 8, bytes - 16, stream_)
                .code(),
            absl::StatusCode::kInvalidArgument);
  Sync();
  EXPECT_EQ(std::memcmp(img.get(), poison.data(), poison.size()), 0);
  EXPECT_EQ(src.Stats().bytes_exported, 0);
  // A moved-from cache refuses every new call.
  KVCache moved = std::move(src);
  const SequenceImageHeader h = *MakeSequenceImageHeader(moved.geometry(), 2, Recipe(), 6);
  EXPECT_EQ(src.ExportedBytes(id).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(src.ExportSequence(id, img.get(), bytes).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(src.ReserveImport(h).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(src.CommitImport(ImportReservation(), img.get(), bytes).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(src.CancelImport(ImportReservation()).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(src.ImportSequence(img.get(), bytes).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(src.SwapOut(id).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(src.SwapIn(id).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(src.IsSwappedOut(id).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(src.SynchronizeSwaps().code(), absl::StatusCode::kFailedPrecondition);
  // The moved-to cache still exports, and its reservations survive the move.
  absl::StatusOr<ImportReservation> r = moved.ReserveImport(h);
  ASSERT_TRUE(r.ok()) << r.status();
  KVCache moved_again = std::move(moved);
  EXPECT_EQ(moved_again.Stats().pages_reserved, 2);
  ASSERT_TRUE(moved_again.CancelImport(*std::move(r)).ok());
  EXPECT_EQ(moved_again.Stats().pages_reserved, 0);
  ASSERT_TRUE(moved_again.ExportSequence(id, img.get(), bytes, stream_).ok());
  Sync();
  EXPECT_TRUE(ParseSequenceImageHeader(img.get(), bytes).ok());
}

INSTANTIATE_TEST_SUITE_P(Cpu, ExportTest, ::testing::Values(false));
INSTANTIATE_TEST_SUITE_P(Gpu, ExportTest, ::testing::Values(true));

// ----------------------------------------------------------- header parser
SequenceImageHeader ValidHeader(bool tokens, KeyFormat keys = KeyFormat::kNvfp4) {
  CacheGeometry g;
  g.num_kv_heads = 4;
  g.head_dim_k = 128;
  g.head_dim_v = 64;
  g.page_size = 16;
  g.layout = Layout::kHND;
  g.key_format = keys;
  absl::StatusOr<SequenceImageHeader> h = MakeSequenceImageHeader(
      g, 3, Recipe::FourOverSix(), 37,
      tokens ? kSequenceImageHasTokens | kSequenceImageScalesKnown : kSequenceImageScalesKnown,
      tokens ? 5 : 0, 0x1234);
  EXPECT_TRUE(h.ok()) << h.status();
  return *h;
}

TEST(SequenceImageHeaderTest, RoundTripsAndDerivesEverySize) {
  for (int it = 0; it < 4; ++it) {
    const bool tokens = it % 2 != 0;
    const bool fp8 = it >= 2;
    const SequenceImageHeader h = ValidHeader(tokens, fp8 ? KeyFormat::kFp8 : KeyFormat::kNvfp4);
    EXPECT_EQ(h.num_pages, 3);
    EXPECT_EQ(h.key_format, fp8 ? kKeyFormatFp8 : kKeyFormatNvfp4);
    EXPECT_EQ(h.region_page_bytes[0], fp8 ? 16 * 4 * 128 : 16 * 4 * 64);
    EXPECT_EQ(h.region_page_bytes[1], 16 * 4 * 32);
    EXPECT_EQ(h.region_page_bytes[2], fp8 ? 0 : 16 * 4 * 8);
    EXPECT_EQ(h.region_page_bytes[3], 16 * 4 * 4);
    EXPECT_EQ(h.region_offset[3], h.region_offset[2] + (fp8 ? 0 : 3 * 16 * 4 * 8));
    EXPECT_EQ(h.scales_offset, kSequenceImageHeaderBytes);
    EXPECT_EQ(h.layers_offset % kSequenceImageAlign, 0);
    EXPECT_EQ(h.image_bytes, tokens ? h.tokens_offset + h.tokens_bytes
                                    : h.layers_offset + 3 * h.layer_bytes);
    uint8_t wire[kSequenceImageHeaderBytes];
    SerializeSequenceImageHeader(h, wire);
    EXPECT_EQ(std::memcmp(wire, "FP4KVSEQ", 8), 0);
    absl::StatusOr<SequenceImageHeader> p = ParseSequenceImageHeader(wire, sizeof(wire));
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->image_bytes, h.image_bytes);
    EXPECT_EQ(p->length, 37);
    EXPECT_EQ(p->tokens_bytes, h.tokens_bytes);
    EXPECT_EQ(p->scale_fingerprint, 0x1234u);
    EXPECT_TRUE(p->recipe == Recipe::FourOverSix());
    EXPECT_EQ(p->key_format, h.key_format);
    EXPECT_EQ(p->geometry.key_format, h.geometry.key_format);
    EXPECT_EQ(p->layer_bytes, h.layer_bytes);
  }
}

TEST(SequenceImageHeaderTest, RejectsBadMagicVersionChecksumTruncationAndSizes) {
  const SequenceImageHeader h = ValidHeader(true);
  uint8_t wire[kSequenceImageHeaderBytes];
  auto expect_bad = [&](const char* field) {
    absl::StatusOr<SequenceImageHeader> p = ParseSequenceImageHeader(wire, sizeof(wire));
    ASSERT_FALSE(p.ok()) << field;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(field), absl::string_view::npos) << p.status();
  };
  SerializeSequenceImageHeader(h, wire);
  EXPECT_FALSE(ParseSequenceImageHeader(wire, kSequenceImageHeaderBytes - 1).ok());
  EXPECT_FALSE(ParseSequenceImageHeader(nullptr, kSequenceImageHeaderBytes).ok());
  wire[0] = 'X';
  expect_bad("magic");
  SerializeSequenceImageHeader(h, wire);
  wire[100] ^= 1;  // without restamping the checksum
  expect_bad("checksum");
  auto with = [&](auto mutate, const char* field) {
    SequenceImageHeader m = h;
    mutate(m);
    SerializeSequenceImageHeader(m, wire);
    expect_bad(field);
  };
  with([](SequenceImageHeader& m) { m.version = 2; }, "version");
  with([](SequenceImageHeader& m) { m.image_bytes += 256; }, "image_bytes");
  with([](SequenceImageHeader& m) { m.num_pages = 2; }, "num_pages");
  with([](SequenceImageHeader& m) { m.layer_bytes -= 256; }, "layer_bytes");
  with([](SequenceImageHeader& m) { m.tokens_offset = 0; }, "tokens_offset");
  with([](SequenceImageHeader& m) { m.region_page_bytes[2] *= 2; }, "region_page_bytes[2]");
  with([](SequenceImageHeader& m) { m.key_format = 2; }, "key_format");
  // The key format byte flipped alone: the sizes no longer match it.
  with([](SequenceImageHeader& m) { m.key_format = kKeyFormatFp8; }, "region_page_bytes[0]");
  {
    const SequenceImageHeader f = ValidHeader(false, KeyFormat::kFp8);
    SequenceImageHeader m = f;
    m.key_format = kKeyFormatNvfp4;
    SerializeSequenceImageHeader(m, wire);
    expect_bad("region_page_bytes[0]");
    m = f;
    m.region_page_bytes[2] = 16 * 4 * 8;  // key scales that FP8 keys do not have
    SerializeSequenceImageHeader(m, wire);
    expect_bad("region_page_bytes[2]");
  }
  with([](SequenceImageHeader& m) { m.length = -1; }, "length");
  with([](SequenceImageHeader& m) { m.geometry.head_dim_k = 24; }, "geometry");
  with([](SequenceImageHeader& m) { m.recipe_code = 999999; }, "recipe_code");
  with([](SequenceImageHeader& m) { m.flags = 8; }, "flags");
  with([](SequenceImageHeader& m) { m.length = int64_t{1} << 61; }, "");
}

// Random corruptions of valid headers, checksum restamped so the
// consistency checks are reached: never a crash, and anything accepted is
// exactly the header MakeSequenceImageHeader derives from its own fields.
TEST(SequenceImageHeaderTest, FuzzedHeadersNeverAcceptInconsistentSizes) {
  std::mt19937_64 rng(42);
  int accepted = 0, rejected = 0;
  int accepted_fp8 = 0;
  for (int it = 0; it < 20000; ++it) {
    const SequenceImageHeader h =
        ValidHeader(it % 2 == 0, it % 4 < 2 ? KeyFormat::kNvfp4 : KeyFormat::kFp8);
    uint8_t wire[kSequenceImageHeaderBytes];
    SerializeSequenceImageHeader(h, wire);
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      const size_t at = rng() % 248;
      if (rng() % 2) {
        wire[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
      } else {
        wire[at] = static_cast<uint8_t>(rng());
      }
    }
    if (rng() % 8 != 0) {
      const uint64_t sum = SequenceImageHeaderChecksum(wire);
      std::memcpy(wire + 248, &sum, 8);
    }
    absl::StatusOr<SequenceImageHeader> p = ParseSequenceImageHeader(wire, sizeof(wire));
    if (!p.ok()) {
      EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
      ++rejected;
      continue;
    }
    ++accepted;
    accepted_fp8 += p->key_format == kKeyFormatFp8;
    EXPECT_TRUE(p->key_format == kKeyFormatNvfp4 || p->key_format == kKeyFormatFp8);
    EXPECT_EQ(p->key_format, static_cast<uint8_t>(p->geometry.key_format));
    absl::StatusOr<SequenceImageHeader> want =
        MakeSequenceImageHeader(p->geometry, p->num_layers, p->recipe, p->length, p->flags,
                                p->extra_key_bytes, p->scale_fingerprint);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(p->image_bytes, want->image_bytes);
    EXPECT_EQ(p->layer_bytes, want->layer_bytes);
    EXPECT_EQ(p->tokens_bytes, want->tokens_bytes);
    EXPECT_EQ(p->num_pages, want->num_pages);
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(p->region_page_bytes[r], want->region_page_bytes[r]);
      EXPECT_EQ(p->region_offset[r], want->region_offset[r]);
    }
    uint8_t again[kSequenceImageHeaderBytes];
    SerializeSequenceImageHeader(*p, again);
    EXPECT_EQ(std::memcmp(again, wire, sizeof(wire)), 0);
  }
  EXPECT_GT(rejected, 10000);
  EXPECT_GT(accepted, 0);  // e.g. a changed fingerprint, or consistent changes
  EXPECT_GT(accepted_fp8, 0);
}

}  // namespace
}  // namespace fp4kv
