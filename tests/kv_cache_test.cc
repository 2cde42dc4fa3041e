// KVCache unit tests: options, views, step buffers, fork / copy on write,
// truncation, exhaustion, stats, scales, the bound ops, every error path
// (with a snapshot showing nothing changed), and on a GPU the graph-captured
// decode step against eager execution and the CPU reference.
#include "fp4kv/kv_cache.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fp4kv/calibrate.h"
#include "fp4kv/recipe.h"
#include "gtest/gtest.h"
#include "testing/kv_cache_harness.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::Buffer;
using testing::CheckDequantized;
using testing::CheckMaterialized;
using testing::CheckSequenceBytes;
using testing::DiffSnapshots;
using testing::DownloadPools;
using testing::DownloadView;
using testing::StepInputs;
using testing::StepRows;
using testing::TakeSnapshot;
using testing::Token;
using testing::TokenFactory;

KVCacheOptions SmallOptions(Device device = Device::Cpu()) {
  KVCacheOptions o;
  o.num_layers = 2;
  o.geometry.num_kv_heads = 2;
  o.geometry.head_dim_k = 64;
  o.geometry.head_dim_v = 64;
  o.geometry.page_size = 4;
  o.geometry.layout = Layout::kNHD;
  o.geometry.num_pages = 16;
  o.device = device;
  o.k_global_scales = {4.0f, 5.0f};
  o.v_global_scales = {3.0f, 6.0f};
  o.max_seqs_per_step = 4;
  o.max_tokens_per_step = 16;
  o.max_pages_per_seq = 8;
  return o;
}

// Drives a cache: steps with fresh tokens appended through the bound
// appender, and a model of every sequence's tokens.
class Driver {
 public:
  explicit Driver(KVCache* cache, Stream stream = nullptr)
      : cache_(cache), stream_(stream), factory_(*cache) {
    absl::StatusOr<CacheAppender> a = cache->appender();
    EXPECT_TRUE(a.ok()) << a.status();
    if (a.ok()) appender_.emplace(*a);
  }
  SequenceId Create() {
    const SequenceId id = cache_->CreateSequence().value();
    tokens_[id];
    return id;
  }
  SequenceId Fork(SequenceId parent) {
    absl::StatusOr<SequenceId> c = cache_->ForkSequence(parent);
    EXPECT_TRUE(c.ok()) << c.status();
    tokens_[*c] = tokens_[parent];
    return *c;
  }
  void Truncate(SequenceId id, int64_t n) {
    ASSERT_TRUE(cache_->Truncate(id, n).ok());
    tokens_[id].resize(n);
  }
  void Release(SequenceId id) {
    ASSERT_TRUE(cache_->ReleaseSequence(id).ok());
    tokens_.erase(id);
  }
  // PrepareStep + append of every layer. Returns the PrepareStep status.
  absl::StatusOr<StepInfo> Step(const std::vector<StepEntry>& entries) {
    absl::StatusOr<StepInfo> info = cache_->PrepareStep(entries, stream_);
    if (!info.ok()) return info;
    std::vector<Token> toks;
    rows_.clear();
    for (const StepEntry& e : entries) {
      for (int i = 0; i < e.num_new_tokens; ++i) {
        toks.push_back(factory_.Make(next_++));
        tokens_[e.seq].push_back(toks.back());
      }
      rows_.push_back(tokens_[e.seq]);
    }
    absl::Status s = testing::FillStepInputs(*cache_, toks, &inputs_, stream_);
    if (s.ok()) s = testing::RunAppendAllLayers(*cache_, *appender_, &inputs_, stream_);
    if (s.ok() && cache_->device().is_cuda()) {
      if (cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream_)) != cudaSuccess) {
        s = absl::InternalError("sync");
      }
    }
    if (!s.ok()) return s;
    return info;
  }
  // "" when every sequence holds its tokens' reference bytes.
  std::string CheckAll() const {
    const testing::PoolCopy pools = DownloadPools(*cache_);
    for (const auto& [id, toks] : tokens_) {
      std::string e = CheckSequenceBytes(*cache_, pools, id, toks);
      if (!e.empty()) return e;
    }
    return "";
  }
  const std::vector<Token>& tokens(SequenceId id) { return tokens_[id]; }
  const StepRows& rows() const { return rows_; }
  StepInputs& inputs() { return inputs_; }
  const CacheAppender& appender() const { return *appender_; }

 private:
  KVCache* cache_;
  Stream stream_;
  TokenFactory factory_;
  std::optional<CacheAppender> appender_;
  std::map<SequenceId, std::vector<Token>> tokens_;
  StepRows rows_;
  StepInputs inputs_;
  uint64_t next_ = 1;
};

std::vector<int32_t> Pages(const KVCache& c, SequenceId id) {
  absl::StatusOr<absl::Span<const int32_t>> p = c.SequencePages(id);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::vector<int32_t>(p->begin(), p->end()) : std::vector<int32_t>{};
}

// ------------------------------------------------------------------ Create
TEST(KVCacheCreate, RejectsBadOptionsNamingThem) {
  struct Case {
    std::function<void(KVCacheOptions&)> edit;
    absl::StatusCode code;
    const char* names;
  };
  const Case cases[] = {
      {[](KVCacheOptions& o) { o.num_layers = 0; }, absl::StatusCode::kInvalidArgument,
       "num_layers"},
      {[](KVCacheOptions& o) { o.geometry.num_pages = 0; }, absl::StatusCode::kInvalidArgument,
       "memory_budget_bytes"},
      {[](KVCacheOptions& o) { o.memory_budget_bytes = 1 << 20; },
       absl::StatusCode::kInvalidArgument, "memory_budget_bytes"},
      {[](KVCacheOptions& o) { o.geometry.num_pages = -3; }, absl::StatusCode::kInvalidArgument,
       "geometry.num_pages"},
      {[](KVCacheOptions& o) {
         o.geometry.num_pages = 0;
         o.memory_budget_bytes = 100;
       },
       absl::StatusCode::kInvalidArgument, "memory_budget_bytes: expected at least"},
      {[](KVCacheOptions& o) { o.geometry.head_dim_k = 24; }, absl::StatusCode::kInvalidArgument,
       "geometry.head_dim_k"},
      {[](KVCacheOptions& o) { o.geometry.page_size = 0; }, absl::StatusCode::kInvalidArgument,
       "geometry.page_size"},
      {[](KVCacheOptions& o) { o.geometry.num_kv_heads = 0; }, absl::StatusCode::kInvalidArgument,
       "geometry.num_kv_heads"},
      {[](KVCacheOptions& o) { o.geometry.num_pages = int64_t{1} << 32; },
       absl::StatusCode::kInvalidArgument, "geometry.num_pages"},
      {[](KVCacheOptions& o) { o.k_global_scales = {1.0f}; }, absl::StatusCode::kInvalidArgument,
       "k_global_scales"},
      {[](KVCacheOptions& o) { o.v_global_scales[1] = -1.0f; }, absl::StatusCode::kInvalidArgument,
       "v_global_scales[1]"},
      {[](KVCacheOptions& o) { o.k_global_scales[0] = std::nanf(""); },
       absl::StatusCode::kInvalidArgument, "k_global_scales[0]"},
      {[](KVCacheOptions& o) { o.k_global_scales[0] = INFINITY; },
       absl::StatusCode::kInvalidArgument, "k_global_scales[0]"},
      {[](KVCacheOptions& o) { o.max_seqs_per_step = 0; }, absl::StatusCode::kInvalidArgument,
       "max_seqs_per_step"},
      {[](KVCacheOptions& o) { o.max_tokens_per_step = -1; }, absl::StatusCode::kInvalidArgument,
       "max_tokens_per_step"},
      {[](KVCacheOptions& o) { o.max_pages_per_seq = -1; }, absl::StatusCode::kInvalidArgument,
       "max_pages_per_seq"},
      {[](KVCacheOptions& o) { o.max_pages_per_seq = 1 << 30; }, absl::StatusCode::kInvalidArgument,
       "max_pages_per_seq"},
      {[](KVCacheOptions& o) { o.recipe.e4m3_max = 100; }, absl::StatusCode::kInvalidArgument,
       "e4m3_max"},
  };
  for (const Case& c : cases) {
    KVCacheOptions o = SmallOptions();
    c.edit(o);
    absl::StatusOr<KVCache> r = KVCache::Create(o);
    ASSERT_FALSE(r.ok()) << c.names;
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    EXPECT_NE(r.status().message().find(c.names), std::string::npos) << r.status();
  }
}

TEST(KVCacheCreate, MissingGpuIsFailedPrecondition) {
  std::string why;
  if (testing::HasCudaDevice(&why)) GTEST_SKIP() << "a GPU is present";
  absl::StatusOr<KVCache> r = KVCache::Create(SmallOptions(Device::Cuda(0)));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
}

TEST(KVCacheCreate, BudgetDerivesThePageCount) {
  KVCacheOptions o = SmallOptions();
  const int64_t pages = o.geometry.num_pages;
  const int64_t exact = testing::CreateCacheOrAbort(o).Stats().pool_bytes;
  o.geometry.num_pages = 0;
  o.memory_budget_bytes = exact;
  KVCache c = testing::CreateCacheOrAbort(o);
  EXPECT_EQ(c.geometry().num_pages, pages);
  EXPECT_EQ(c.options().geometry.num_pages, pages);
  EXPECT_EQ(c.Stats().pool_bytes, exact);
  o.memory_budget_bytes = exact - 1;
  KVCache d = testing::CreateCacheOrAbort(o);
  EXPECT_LT(d.geometry().num_pages, pages);
  EXPECT_LE(d.Stats().pool_bytes, exact - 1);
  o.memory_budget_bytes = 40 * exact;  // roughly 40x the pages
  KVCache e = testing::CreateCacheOrAbort(o);
  EXPECT_GE(e.geometry().num_pages, 39 * pages);
  EXPECT_LE(e.Stats().pool_bytes, 40 * exact);
  // bytes per token: 2 layers * 2 heads * (32 + 32 + 4 + 4) bytes.
  EXPECT_EQ(e.Stats().bytes_per_token, 2.0 * 2 * 72);
}

// FP8 keys: Dk-byte key rows and no key scale pool; the page count a budget
// buys, the pool bytes and bytes per token follow.
TEST(KVCacheCreate, Fp8KeysSizePoolsWithoutKeyScales) {
  KVCacheOptions o = SmallOptions();
  o.geometry.key_format = KeyFormat::kFp8;
  KVCache c = testing::CreateCacheOrAbort(o);
  // 2 layers * 2 heads * (64 + 32 + 4) bytes.
  EXPECT_EQ(c.Stats().bytes_per_token, 2.0 * 2 * 100);
  EXPECT_EQ(c.Stats().pool_bytes, 2 * 16 * 4 * 2 * 100);  // regions 256-byte multiples here
  for (Layout layout : {Layout::kNHD, Layout::kHND}) {
    o.geometry.layout = layout;
    o.geometry.num_pages = 0;
    o.memory_budget_bytes = 40 * 2 * 4 * 2 * 100 * 2;  // 80 pages of K8V4
    KVCache b = testing::CreateCacheOrAbort(o);
    EXPECT_EQ(b.geometry().num_pages, 80);
    EXPECT_EQ(b.geometry().key_format, KeyFormat::kFp8);
    KVCacheOptions n = o;
    n.geometry.key_format = KeyFormat::kNvfp4;
    EXPECT_EQ(testing::CreateCacheOrAbort(n).geometry().num_pages, 80 * 100 / 72);  // NVFP4 K+V: 72 B per head
    const PagedCache v = b.LayerCache(1);
    EXPECT_EQ(v.key_format, KeyFormat::kFp8);
    EXPECT_EQ(v.k_scales.data, nullptr);
    EXPECT_EQ(v.k_data.dtype, DType::kE4M3);
    EXPECT_EQ(v.k_data.shape[3], 64);
    absl::StatusOr<CacheGeometry> g = v.Geometry();
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->key_format, KeyFormat::kFp8);
    EXPECT_EQ(g->head_dim_k, 64);
    EXPECT_EQ(g->layout, layout);
    EXPECT_EQ(c.ReadScales(0)->k_fp8, 4.0f);  // explicit g_k: the key FP8 scale is g_k
    EXPECT_EQ(c.ReadScales(1)->k_fp8, 5.0f);
    EXPECT_TRUE(b.CheckInvariants().ok());
  }
}

TEST(KVCacheCreate, LayerViewsDescribeDisjointAlignedPools) {
  for (Layout layout : {Layout::kNHD, Layout::kHND}) {
    KVCacheOptions o = SmallOptions();
    o.geometry.layout = layout;
    o.geometry.head_dim_v = 32;
    o.num_layers = 3;
    o.k_global_scales.clear();
    o.v_global_scales.clear();
    KVCache c = testing::CreateCacheOrAbort(o);
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
    for (int l = 0; l < 3; ++l) {
      const PagedCache v = c.LayerCache(l);
      absl::StatusOr<CacheGeometry> g = v.Geometry();
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ(g->num_pages, o.geometry.num_pages);
      EXPECT_EQ(g->page_size, o.geometry.page_size);
      EXPECT_EQ(g->num_kv_heads, o.geometry.num_kv_heads);
      EXPECT_EQ(g->head_dim_k, 64);
      EXPECT_EQ(g->head_dim_v, 32);
      EXPECT_EQ(g->layout, layout);
      EXPECT_EQ(v.k_scales.dtype, DType::kE4M3);
      for (const TensorView* t : {&v.k_data, &v.v_data, &v.k_scales, &v.v_scales}) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % 256, 0u);
        EXPECT_TRUE(t->IsContiguous());
        const uintptr_t b = reinterpret_cast<uintptr_t>(t->data);
        ranges.emplace_back(b, b + t->numel() * DTypeSize(t->dtype));
      }
      absl::StatusOr<LayerScales> sc = c.ReadScales(l);  // no scales given: pending
      ASSERT_TRUE(sc.ok()) << sc.status();
      EXPECT_FALSE(sc->k_calibrated);
      EXPECT_FALSE(sc->v_calibrated);
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i) EXPECT_LE(ranges[i - 1].second, ranges[i].first);
  }
}

// ------------------------------------------------------------------- steps
TEST(KVCacheStep, FillsSlotsTablesLengthsAndPadding) {
  KVCache c = testing::CreateCacheOrAbort(SmallOptions());
  Driver d(&c);
  const SequenceId a = d.Create();
  const SequenceId b = d.Create();
  const testing::Snapshot empty = TakeSnapshot(c);
  absl::StatusOr<StepInfo> info = d.Step({{a, 6}, {b, 3}});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->num_seqs, 2);
  EXPECT_EQ(info->num_tokens, 9);
  EXPECT_EQ(info->max_seq_len, 6);
  EXPECT_EQ(info->num_pages, 3);
  EXPECT_EQ(info->fp8_workspace_pages, 4);
  EXPECT_EQ(info->pages_allocated, 3);
  EXPECT_EQ(info->pages_copied, 0);
  const std::vector<int32_t> pa = Pages(c, a), pb = Pages(c, b);
  ASSERT_EQ(pa.size(), 2u);
  ASSERT_EQ(pb.size(), 1u);
  const std::vector<int64_t> want_slots = {pa[0] * 4 + 0, pa[0] * 4 + 1, pa[0] * 4 + 2,
                                           pa[0] * 4 + 3, pa[1] * 4 + 0, pa[1] * 4 + 1,
                                           pb[0] * 4 + 0, pb[0] * 4 + 1, pb[0] * 4 + 2};
  EXPECT_EQ(std::vector<int64_t>(c.host_slot_mapping().begin(), c.host_slot_mapping().end()),
            want_slots);
  const StepViews& v = c.step_views();
  const int64_t* slots = v.slot_mapping.ptr<const int64_t>();
  for (int i = 0; i < 16; ++i) EXPECT_EQ(slots[i], i < 9 ? want_slots[i] : -1) << i;
  const int32_t* lens = v.seq_lens.ptr<const int32_t>();
  const int32_t* kvp = v.kv_page_indptr.ptr<const int32_t>();
  const int32_t* tok = v.token_indptr.ptr<const int32_t>();
  const int32_t* tables = v.block_tables.ptr<const int32_t>();
  EXPECT_EQ(std::vector<int32_t>(lens, lens + 4), (std::vector<int32_t>{6, 3, 0, 0}));
  EXPECT_EQ(std::vector<int32_t>(kvp, kvp + 5), (std::vector<int32_t>{0, 2, 3, 3, 3}));
  EXPECT_EQ(std::vector<int32_t>(tok, tok + 5), (std::vector<int32_t>{0, 6, 9, 9, 9}));
  EXPECT_EQ(tables[0], pa[0]);
  EXPECT_EQ(tables[1], pa[1]);
  EXPECT_EQ(tables[8], pb[0]);
  EXPECT_EQ(d.CheckAll(), "");
  // Padding rows of the K/V input were poison; nothing outside the step's
  // slots changed in any pool.
  const testing::PoolCopy pools = DownloadPools(c);
  const CacheGeometry& g = c.geometry();
  for (int l = 0; l < 2; ++l) {
    for (int kind = 0; kind < 4; ++kind) {
      const int64_t rb = kind % 2 == 0 ? 32 : 4;
      for (int64_t p = 0; p < g.num_pages; ++p) {
        for (int e = 0; e < 4; ++e) {
          const int64_t slot = p * 4 + e;
          if (std::find(want_slots.begin(), want_slots.end(), slot) != want_slots.end()) continue;
          for (int h = 0; h < 2; ++h) {
            const uint8_t* now = testing::PoolRow(pools, g, l, kind, p, e, h);
            const uint8_t* was = testing::PoolRow(empty.pools, g, l, kind, p, e, h);
            ASSERT_EQ(std::memcmp(now, was, rb), 0) << "slot " << slot << " was written";
          }
        }
      }
    }
  }
  // A smaller next step: rows and slots past it are padding again.
  ASSERT_TRUE(d.Step({{b, 1}}).ok());
  EXPECT_EQ(std::vector<int32_t>(lens, lens + 4), (std::vector<int32_t>{4, 0, 0, 0}));
  EXPECT_EQ(std::vector<int32_t>(kvp, kvp + 5), (std::vector<int32_t>{0, 1, 1, 1, 1}));
  EXPECT_EQ(slots[0], pb[0] * 4 + 3);
  for (int i = 1; i < 16; ++i) EXPECT_EQ(slots[i], -1) << i;
  EXPECT_EQ(tables[0], pb[0]);
  EXPECT_EQ(d.CheckAll(), "");
}

TEST(KVCacheStep, BlockTablesFollowSequencesAcrossReorderedSteps) {
  KVCacheOptions o = SmallOptions();
  o.geometry.num_pages = 64;
  o.max_pages_per_seq = 16;
  KVCache c = testing::CreateCacheOrAbort(o);
  Driver d(&c);
  std::vector<SequenceId> live = {d.Create(), d.Create(), d.Create()};
  std::mt19937 rng(11);
  for (int step = 0; step < 300; ++step) {
    switch (rng() % 8) {
      case 0:
        if (live.size() < 6) live.push_back(d.Create());
        break;
      case 1:
        if (live.size() < 6) live.push_back(d.Fork(live[rng() % live.size()]));
        break;
      case 2: {
        const SequenceId id = live[rng() % live.size()];
        d.Truncate(id, static_cast<int64_t>(rng() % (d.tokens(id).size() + 1)));
        break;
      }
      case 3:
        if (live.size() > 1) {
          const size_t i = rng() % live.size();
          d.Release(live[i]);
          live.erase(live.begin() + i);
        }
        break;
      default:
        break;
    }
    std::vector<SequenceId> order = live;
    std::shuffle(order.begin(), order.end(), rng);
    order.resize(std::min<size_t>(order.size(), 1 + rng() % 4));
    std::vector<StepEntry> entries;
    for (SequenceId id : order) {
      const int64_t room = 64 - static_cast<int64_t>(d.tokens(id).size());
      entries.push_back({id, static_cast<int32_t>(std::min<int64_t>(room, rng() % 4))});
    }
    absl::StatusOr<StepInfo> info = d.Step(entries);
    if (!info.ok()) {
      ASSERT_EQ(info.status().code(), absl::StatusCode::kResourceExhausted) << info.status();
      d.Release(live.back());
      live.pop_back();
      if (live.empty()) live.push_back(d.Create());
      continue;
    }
    const int32_t* tables = c.step_views().block_tables.ptr<const int32_t>();
    for (size_t b = 0; b < entries.size(); ++b) {
      const std::vector<int32_t> want = Pages(c, entries[b].seq);
      ASSERT_EQ(std::vector<int32_t>(tables + b * 16, tables + b * 16 + want.size()), want)
          << "step " << step << " row " << b;
    }
  }
  EXPECT_EQ(d.CheckAll(), "");
}

// ------------------------------------------------------------ fork and COW
TEST(KVCacheFork, SharesFullPagesAndCopiesAPartialPageOnWrite) {
  KVCache c = testing::CreateCacheOrAbort(SmallOptions());
  Driver d(&c);
  const SequenceId parent = d.Create();
  ASSERT_TRUE(d.Step({{parent, 6}}).ok());  // pages: full, half
  const std::vector<int32_t> pp = Pages(c, parent);
  const SequenceId child = d.Fork(parent);
  EXPECT_EQ(Pages(c, child), pp);
  EXPECT_EQ(*c.PageRefCount(pp[0]), 2);
  EXPECT_EQ(*c.PageRefCount(pp[1]), 2);
  EXPECT_EQ(c.Stats().pages_used, 2);
  EXPECT_EQ(c.Stats().pages_shared, 2);
  EXPECT_EQ(*c.SequenceLength(child), 6);

  // The child appends: it gets a copy of the shared partial page.
  absl::StatusOr<StepInfo> info = d.Step({{child, 1}});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->pages_copied, 1);
  EXPECT_EQ(info->pages_allocated, 1);
  const std::vector<int32_t> pc = Pages(c, child);
  EXPECT_EQ(pc[0], pp[0]);
  EXPECT_NE(pc[1], pp[1]);
  EXPECT_EQ(Pages(c, parent), pp);
  EXPECT_EQ(*c.PageRefCount(pp[0]), 2);
  EXPECT_EQ(*c.PageRefCount(pp[1]), 1);
  EXPECT_EQ(*c.PageRefCount(pc[1]), 1);
  EXPECT_EQ(d.CheckAll(), "");  // the parent's tokens 4, 5 intact; the child's copied

  // The parent appends in place now (sole owner), no copy.
  info = d.Step({{parent, 3}});
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pages_copied, 0);
  EXPECT_EQ(info->pages_allocated, 1);
  EXPECT_EQ(Pages(c, parent)[1], pp[1]);
  EXPECT_EQ(d.CheckAll(), "");
}

TEST(KVCacheFork, FullPagesAreNeverCopied) {
  KVCache c = testing::CreateCacheOrAbort(SmallOptions());
  Driver d(&c);
  const SequenceId p = d.Create();
  ASSERT_TRUE(d.Step({{p, 8}}).ok());
  const SequenceId q = d.Fork(p);
  absl::StatusOr<StepInfo> info = d.Step({{p, 1}, {q, 2}});
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pages_copied, 0);
  EXPECT_EQ(info->pages_allocated, 2);
  EXPECT_EQ(d.CheckAll(), "");
}

TEST(KVCacheFork, ThreeHoldersAppendingInOneStepCopyOnlyWhileShared) {
  KVCache c = testing::CreateCacheOrAbort(SmallOptions());
  Driver d(&c);
  const SequenceId a = d.Create();
  ASSERT_TRUE(d.Step({{a, 2}}).ok());
  const int32_t shared = Pages(c, a)[0];
  const SequenceId b = d.Fork(a);
  const SequenceId e = d.Fork(b);
  EXPECT_EQ(*c.PageRefCount(shared), 3);
  // All three append: the first two copy, the last writes the original.
  absl::StatusOr<StepInfo> info = d.Step({{b, 1}, {a, 1}, {e, 2}});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->pages_copied, 2);
  EXPECT_EQ(info->pages_allocated, 2);
  EXPECT_NE(Pages(c, b)[0], shared);
  EXPECT_NE(Pages(c, a)[0], shared);
  EXPECT_EQ(Pages(c, e)[0], shared);
  EXPECT_EQ(*c.PageRefCount(shared), 1);
  EXPECT_EQ(d.CheckAll(), "");
}

TEST(KVCacheFork, ZeroTokenEntryDoesNotCopy) {
  KVCache c = testing::CreateCacheOrAbort(SmallOptions());
  Driver d(&c);
  const SequenceId a = d.Create();
  ASSERT_TRUE(d.Step({{a, 3}}).ok());
  const SequenceId b = d.Fork(a);
  absl::StatusOr<StepInfo> info = d.Step({{a, 0}, {b, 0}});
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pages_copied, 0);
  EXPECT_EQ(info->num_tokens, 0);
  EXPECT_EQ(info->max_seq_len, 3);
  EXPECT_EQ(Pages(c, a), Pages(c, b));
}

// --------------------------------------------------------------- truncate
TEST(KVCacheTruncate, RollsBackSpeculativeTokensAndFreesPages) {
  KVCache c = testing::CreateCacheOrAbort(SmallOptions());
  Driver d(&c);
  const SequenceId s = d.Create();
  ASSERT_TRUE(d.Step({{s, 7}}).ok());
  EXPECT_EQ(c.Stats().pages_used, 2);
  // 5 speculative tokens: 12 -> 3 pages; 3 rejected.
  ASSERT_TRUE(d.Step({{s, 5}}).ok());
  EXPECT_EQ(c.Stats().pages_used, 3);
  const int32_t third = Pages(c, s)[2];
  d.Truncate(s, 9);
  EXPECT_EQ(*c.SequenceLength(s), 9);
  EXPECT_EQ(Pages(c, s).size(), 3u);
  d.Truncate(s, 8);
  EXPECT_EQ(Pages(c, s).size(), 2u);
  EXPECT_EQ(*c.PageRefCount(third), 0);
  EXPECT_EQ(c.Stats().pages_used, 2);
  ASSERT_TRUE(d.Step({{s, 2}}).ok());  // replaces the rejected ones
  EXPECT_EQ(d.CheckAll(), "");
  d.Truncate(s, 0);
  EXPECT_EQ(c.Stats().pages_used, 0);
  ASSERT_TRUE(d.Step({{s, 1}}).ok());
  EXPECT_EQ(d.CheckAll(), "");
}

TEST(KVCacheTruncate, IntoASharedPageCopiesOnTheNextAppend) {
  KVCache c = testing::CreateCacheOrAbort(SmallOptions());
  Driver d(&c);
  const SequenceId p = d.Create();
  ASSERT_TRUE(d.Step({{p, 8}}).ok());
  const SequenceId q = d.Fork(p);
  d.Truncate(q, 5);  // q's page 1 is shared, full for p, partial for q
  const int32_t shared = Pages(c, p)[1];
  EXPECT_EQ(*c.PageRefCount(shared), 2);
  KVCacheStats st = c.Stats();
  EXPECT_EQ(st.tokens_stored, 13);
  EXPECT_EQ(st.tokens_resident, 8);
  EXPECT_EQ(st.wasted_slots, 0);
  absl::StatusOr<StepInfo> info = d.Step({{q, 1}});
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pages_copied, 1);
  EXPECT_EQ(Pages(c, p)[1], shared);  // p's tokens 5..7 survive q's overwrite
  EXPECT_EQ(d.CheckAll(), "");
}

// ------------------------------------------------------------------ stats
TEST(KVCacheStats, CountPagesTokensAndWaste) {
  KVCache c = testing::CreateCacheOrAbort(SmallOptions());
  Driver d(&c);
  const SequenceId a = d.Create();
  const SequenceId b = d.Create();
  ASSERT_TRUE(d.Step({{a, 5}, {b, 4}}).ok());
  KVCacheStats st = c.Stats();
  EXPECT_EQ(st.pages_total, 16);
  EXPECT_EQ(st.pages_used, 3);
  EXPECT_EQ(st.pages_free, 13);
  EXPECT_EQ(st.tokens_stored, 9);
  EXPECT_EQ(st.tokens_resident, 9);
  EXPECT_EQ(st.wasted_slots, 3);
  EXPECT_EQ(st.num_sequences, 2);
  EXPECT_EQ(st.sequence_lengths, (std::vector<std::pair<SequenceId, int64_t>>{{a, 5}, {b, 4}}));
  const SequenceId f = d.Fork(a);
  st = c.Stats();
  EXPECT_EQ(st.pages_used, 3);
  EXPECT_EQ(st.pages_shared, 2);
  EXPECT_EQ(st.tokens_stored, 14);
  EXPECT_EQ(st.tokens_resident, 9);
  EXPECT_EQ(st.wasted_slots, 3);
  d.Truncate(f, 2);
  st = c.Stats();
  EXPECT_EQ(st.pages_shared, 1);
  EXPECT_EQ(st.tokens_resident, 9);  // f's partial page is a's full page 0
  EXPECT_EQ(st.wasted_slots, 3);
  EXPECT_EQ(st.bytes_per_token, 2.0 * 2 * 72);
}

// -------------------------------------------------------------- exhaustion
TEST(KVCacheExhaustion, FullPoolRejectsTheStepThenRecovers) {
  KVCache c = testing::CreateCacheOrAbort(SmallOptions());  // 16 pages of 4
  Driver d(&c);
  std::vector<SequenceId> s;
  for (int i = 0; i < 4; ++i) s.push_back(d.Create());
  ASSERT_TRUE(d.Step({{s[0], 16}}).ok());
  ASSERT_TRUE(d.Step({{s[1], 16}}).ok());
  ASSERT_TRUE(d.Step({{s[2], 16}}).ok());
  ASSERT_TRUE(d.Step({{s[3], 14}}).ok());  // 4 + 4 + 4 + 4 pages, 2 free slots
  EXPECT_EQ(c.Stats().pages_free, 0);
  ASSERT_TRUE(d.Step({{s[3], 1}, {s[0], 0}}).ok());  // fits in the last page
  const testing::Snapshot before = TakeSnapshot(c);
  // Each sequence asks for a token: s[3] fits, the others need pages.
  absl::StatusOr<StepInfo> r = c.PrepareStep({{s[3], 1}, {s[0], 1}, {s[1], 1}});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("2 free pages"), std::string::npos) << r.status();
  EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(c)), "");
  d.Release(s[2]);
  EXPECT_EQ(c.Stats().pages_free, 4);
  absl::StatusOr<StepInfo> ok = d.Step({{s[3], 1}, {s[0], 1}, {s[1], 1}});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->pages_allocated, 2);
  EXPECT_EQ(c.Stats().pages_free, 2);
  EXPECT_EQ(d.CheckAll(), "");
}

TEST(KVCacheExhaustion, CopyOnWriteCountsTowardTheReservation) {
  KVCacheOptions o = SmallOptions();
  o.geometry.num_pages = 3;
  KVCache c = testing::CreateCacheOrAbort(o);
  Driver d(&c);
  const SequenceId a = d.Create();
  ASSERT_TRUE(d.Step({{a, 6}}).ok());  // 2 pages, 1 free
  const SequenceId b = d.Fork(a);
  // Both append into the shared half page: one copy + nothing else = 1 page.
  ASSERT_TRUE(d.Step({{a, 1}, {b, 1}}).ok());
  EXPECT_EQ(c.Stats().pages_free, 0);
  const SequenceId e = d.Fork(a);  // shares a's partial page (7 tokens)
  const testing::Snapshot before = TakeSnapshot(c);
  absl::StatusOr<StepInfo> r = c.PrepareStep({{e, 1}});  // needs a copy, no page free
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("1 of them copies"), std::string::npos) << r.status();
  EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(c)), "");
  d.Release(b);
  ASSERT_TRUE(d.Step({{e, 1}}).ok());
  EXPECT_EQ(d.CheckAll(), "");
}

// ------------------------------------------------------------- error paths
TEST(KVCacheErrors, EveryErrorPathLeavesTheStateUnchanged) {
  KVCacheOptions o = SmallOptions();
  o.geometry.num_pages = 6;
  KVCache c = testing::CreateCacheOrAbort(o);
  Driver d(&c);
  const SequenceId a = d.Create();
  const SequenceId b = d.Create();
  ASSERT_TRUE(d.Step({{a, 5}, {b, 2}}).ok());
  const SequenceId f = d.Fork(a);
  const SequenceId gone = d.Create();
  d.Release(gone);
  const testing::Snapshot before = TakeSnapshot(c);
  const SequenceId never = 0x123456789ull;
  struct Case {
    const char* what;
    std::function<absl::Status()> call;
    absl::StatusCode code;
    const char* names;
  };
  const Case cases[] = {
      {"fork unknown", [&] { return c.ForkSequence(never).status(); }, absl::StatusCode::kNotFound,
       "parent"},
      {"fork released", [&] { return c.ForkSequence(gone).status(); }, absl::StatusCode::kNotFound,
       "parent"},
      {"fork id 0", [&] { return c.ForkSequence(0).status(); }, absl::StatusCode::kNotFound,
       "parent"},
      {"truncate unknown", [&] { return c.Truncate(never, 0); }, absl::StatusCode::kNotFound,
       "seq"},
      {"truncate past end", [&] { return c.Truncate(a, 6); }, absl::StatusCode::kInvalidArgument,
       "new_len"},
      {"truncate negative", [&] { return c.Truncate(a, -1); }, absl::StatusCode::kInvalidArgument,
       "new_len"},
      {"double release", [&] { return c.ReleaseSequence(gone); }, absl::StatusCode::kNotFound,
       "seq"},
      {"release unknown", [&] { return c.ReleaseSequence(never); }, absl::StatusCode::kNotFound,
       "seq"},
      {"length unknown", [&] { return c.SequenceLength(gone).status(); },
       absl::StatusCode::kNotFound, "seq"},
      {"pages unknown", [&] { return c.SequencePages(gone).status(); }, absl::StatusCode::kNotFound,
       "seq"},
      {"refcount range", [&] { return c.PageRefCount(6).status(); },
       absl::StatusCode::kInvalidArgument, "page"},
      {"refcount negative", [&] { return c.PageRefCount(-1).status(); },
       absl::StatusCode::kInvalidArgument, "page"},
      {"step too many entries",
       [&] {
         return c.PrepareStep({{a, 1}, {b, 1}, {f, 1}, {never, 1}, {gone, 1}}).status();
       },
       absl::StatusCode::kInvalidArgument, "max_seqs_per_step"},
      {"step negative",
       [&] {
         return c.PrepareStep({{a, 1}, {b, -1}}).status();
       },
       absl::StatusCode::kInvalidArgument, "entries[1].num_new_tokens"},
      {"step unknown",
       [&] {
         return c.PrepareStep({{a, 1}, {gone, 1}}).status();
       },
       absl::StatusCode::kNotFound, "entries[1].seq"},
      {"step duplicate",
       [&] {
         return c.PrepareStep({{a, 1}, {b, 1}, {a, 1}}).status();
       },
       absl::StatusCode::kInvalidArgument, "entries[2].seq"},
      {"step too many tokens",
       [&] {
         return c.PrepareStep({{a, 10}, {b, 7}}).status();
       },
       absl::StatusCode::kInvalidArgument, "max_tokens_per_step"},
      {"step past max_pages_per_seq",
       [&] {
         return c.PrepareStep({{b, 1}, {a, 28}}).status();
       },
       absl::StatusCode::kInvalidArgument, "entries[1].num_new_tokens"},
      {"step exhausts (with a copy)",
       [&] {
         return c.PrepareStep({{f, 4}, {a, 4}, {b, 7}}).status();
       },
       absl::StatusCode::kResourceExhausted, "free pages"},
      {"scale layer", [&] { return c.UpdateGlobalScales(2, 1.0f, 1.0f); },
       absl::StatusCode::kInvalidArgument, "layer"},
      {"scale zero", [&] { return c.UpdateGlobalScales(0, 0.0f, 1.0f); },
       absl::StatusCode::kInvalidArgument, "k_scale"},
      {"scale inf", [&] { return c.UpdateGlobalScales(1, 1.0f, INFINITY); },
       absl::StatusCode::kInvalidArgument, "v_scale"},
      {"scales size",
       [&] {
         return c.UpdateGlobalScales({1.0f}, {1.0f, 1.0f});
       },
       absl::StatusCode::kInvalidArgument, "k_scales"},
      {"scales value",
       [&] {
         return c.UpdateGlobalScales({1.0f, 2.0f}, {1.0f, -1.0f});
       },
       absl::StatusCode::kInvalidArgument, "v_scales[1]"},
  };
  for (const Case& k : cases) {
    const absl::Status s = k.call();
    EXPECT_EQ(s.code(), k.code) << k.what << ": " << s;
    EXPECT_NE(s.message().find(k.names), std::string::npos) << k.what << ": " << s;
    EXPECT_EQ(DiffSnapshots(before, TakeSnapshot(c)), "") << k.what << " changed the cache";
  }
  // And the cache still works.
  ASSERT_TRUE(d.Step({{f, 1}, {a, 1}, {b, 1}}).ok());
  EXPECT_EQ(d.CheckAll(), "");
}

// ----------------------------------------------------------------- scales
TEST(KVCacheScales, UpdatesBeforeStoringAreSeenByLaterRunsThroughTheDeviceArray) {
  KVCache c = testing::CreateCacheOrAbort(SmallOptions());
  ASSERT_TRUE(c.UpdateGlobalScales(1, 9.0f, 0.5f).ok());  // nothing stored yet
  absl::StatusOr<LayerScales> sc = c.ReadScales(1);
  ASSERT_TRUE(sc.ok()) << sc.status();
  EXPECT_EQ(sc->k, 9.0f);
  EXPECT_EQ(sc->v, 0.5f);
  EXPECT_EQ(sc->k_fp8, *MinFp8Scale(9.0f));
  EXPECT_EQ(sc->v_fp8, *MinFp8Scale(0.5f));
  EXPECT_TRUE(sc->k_calibrated && sc->v_calibrated);
  EXPECT_EQ(*c.global_scale_ptr(1, 0), 9.0f);  // CPU: host memory
  EXPECT_EQ(*c.fp8_scale_ptr(1, 1), *MinFp8Scale(0.5f));
  // The driver's tokens are made with the new scales.
  Driver d(&c);
  const SequenceId s = d.Create();
  ASSERT_TRUE(d.Step({{s, 3}}).ok());
  ASSERT_TRUE(d.Step({{s, 2}}).ok());
  EXPECT_EQ(d.CheckAll(), "");
  // Stored tokens: a plain change is refused (kv_cache_scales_test.cc covers
  // the rule and re-encoding).
  EXPECT_EQ(c.UpdateGlobalScales({2.0f, 3.0f}, {4.0f, 5.0f}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*c.global_scale_ptr(0, 1), 3.0f);
}

// Calibration writes the layer's global and FP8 scales into the device
// array from the tensors' amax, under the cache's recipe; a mismatched
// calibrator or a bad tensor changes nothing.
void CheckCalibration(Device device) {
  KVCacheOptions o = SmallOptions(device);
  o.recipe = Recipe::FourOverSix(256, ErrorMetric::kMse);
  KVCache c = testing::CreateCacheOrAbort(o);
  const int64_t n = 5 * 2 * 64;
  std::vector<uint16_t> k = testing::RandomHalfBits(DType::kBF16, n, 41);
  std::vector<uint16_t> v = testing::RandomHalfBits(DType::kBF16, n, 42);
  float k_amax = 0, v_amax = 0;
  for (int64_t i = 0; i < n; ++i) {
    k_amax = std::max(k_amax, std::fabs(Bf16BitsToFloat(k[i])));
    v_amax = std::max(v_amax, std::fabs(Bf16BitsToFloat(v[i])));
  }
  Buffer kb(device, n * 2), vb(device, n * 2);
  ASSERT_TRUE(kb.Upload(k.data(), n * 2) && vb.Upload(v.data(), n * 2));
  const TensorView kt = kb.View(DType::kBF16, {5, 2, 64});
  const TensorView vt = vb.View(DType::kBF16, {5, 2, 64});
  absl::StatusOr<Calibrator> other = Calibrator::Create({n, DType::kBF16, device, Recipe()});
  ASSERT_TRUE(other.ok()) << other.status();
  absl::StatusOr<Calibrator> cal = Calibrator::Create({n, DType::kBF16, device, o.recipe});
  ASSERT_TRUE(cal.ok()) << cal.status();
  auto device_scales = [&]() {
    std::vector<float> out(4);
    for (int kv = 0; kv < 2; ++kv) {
      if (device.is_cuda()) {
        EXPECT_EQ(cudaMemcpy(&out[kv], c.global_scale_ptr(1, kv), 4, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(cudaMemcpy(&out[2 + kv], c.fp8_scale_ptr(1, kv), 4, cudaMemcpyDeviceToHost), cudaSuccess);
      } else {
        out[kv] = *c.global_scale_ptr(1, kv);
        out[2 + kv] = *c.fp8_scale_ptr(1, kv);
      }
    }
    return out;
  };
  const std::vector<float> before = device_scales();
  absl::Status bad = c.CalibrateGlobalScales(1, kt, vt, *other);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.message().find("calibrator"), std::string::npos) << bad;
  TensorView v_wrong = vt;
  v_wrong.dtype = DType::kF16;
  bad = c.CalibrateGlobalScales(1, kt, v_wrong, *cal);
  EXPECT_NE(bad.message().find("v: expected dtype bf16"), std::string::npos) << bad;
  EXPECT_EQ(device_scales(), before) << "a rejected calibration changed the scales";

  ASSERT_TRUE(c.CalibrateGlobalScales(1, kt, vt, *cal).ok());
  if (device.is_cuda()) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  const float gk = MakeGlobalScale(k_amax, o.recipe), gv = MakeGlobalScale(v_amax, o.recipe);
  EXPECT_EQ(device_scales(), (std::vector<float>{gk, gv, *MinFp8Scale(gk), *MinFp8Scale(gv)}));
  EXPECT_EQ(gk, k_amax / (6.0f * 256.0f));
}

TEST(KVCacheScales, CalibrationSetsGlobalAndFp8ScalesOnTheDevice) { CheckCalibration(Device::Cpu()); }

TEST(KVCacheGpu, CalibrationSetsGlobalAndFp8ScalesOnTheDevice) {
  FP4KV_SKIP_WITHOUT_GPU();
  CheckCalibration(Device::Cuda(0));
}

// ------------------------------------------------------------- bound ops
TEST(KVCacheOps, BoundOpsCheckTheirArguments) {
  KVCache c = testing::CreateCacheOrAbort(SmallOptions());
  Driver d(&c);
  const SequenceId s = d.Create();
  ASSERT_TRUE(d.Step({{s, 6}}).ok());
  const CacheGeometry& g = c.geometry();
  Buffer k(c.device(), 16 * 2 * 64 * 2), v(c.device(), 16 * 2 * 64 * 2);
  EXPECT_EQ(d.appender()
                .Run(2, k.View(DType::kBF16, {16, 2, 64}), v.View(DType::kBF16, {16, 2, 64}))
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(d.appender()
                .Run(-1, k.View(DType::kBF16, {16, 2, 64}), v.View(DType::kBF16, {16, 2, 64}))
                .code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status few =
      d.appender().Run(0, k.View(DType::kBF16, {5, 2, 64}), v.View(DType::kBF16, {5, 2, 64}));
  EXPECT_EQ(few.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(few.message().find("append_key"), std::string::npos) << few;
  EXPECT_EQ(d.appender()
                .Run(0, k.View(DType::kF16, {16, 2, 64}), v.View(DType::kF16, {16, 2, 64}))
                .code(),
            absl::StatusCode::kInvalidArgument);  // the appender was made for bf16
  EXPECT_EQ(c.appender(DType::kF32).status().code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<CacheMaterializer> m = c.materializer();
  ASSERT_TRUE(m.ok()) << m.status();
  const int64_t w = c.step().fp8_workspace_pages;
  EXPECT_EQ(w, 3);
  Buffer out(c.device(), static_cast<size_t>(w * 2 * 2 * 4 * 64));
  auto ws = [&](int64_t pages) {
    return TensorView::Contiguous(out.get(), DType::kE4M3, {pages, 2, 2, 4, 64}, c.device());
  };
  const absl::Status small = m->Run(0, ws(w - 1));
  EXPECT_EQ(small.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(small.message().find("fp8_workspace_pages"), std::string::npos) << small;
  EXPECT_EQ(m->Run(5, ws(w)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(m->Run(1, ws(w)).ok());

  absl::StatusOr<CacheDequantizer> dq = c.dequantizer(DType::kF16);
  ASSERT_TRUE(dq.ok());
  Buffer ko(c.device(), 4 * 8 * 2 * 64 * 2), vo(c.device(), 4 * 8 * 2 * 64 * 2);
  auto out4 = [&](Buffer& b, int64_t batch, int64_t len) {
    return b.View(DType::kF16, {batch, len, g.num_kv_heads, 64});
  };
  EXPECT_EQ(dq->Run(0, out4(ko, 1, 5), out4(vo, 1, 5)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dq->Run(0, out4(ko, 5, 6), out4(vo, 5, 6)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dq->Run(0, out4(ko, 0, 6), out4(vo, 0, 6)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(dq->Run(0, out4(ko, 1, 6), out4(vo, 1, 6)).ok());
  EXPECT_TRUE(dq->Run(1, out4(ko, 4, 8), out4(vo, 4, 8)).ok());
  EXPECT_EQ(c.dequantizer(DType::kU8).status().code(), absl::StatusCode::kInvalidArgument);

  // A geometry that cannot be materialized.
  KVCacheOptions o = SmallOptions();
  o.geometry.page_size = 3;
  KVCache c3 = testing::CreateCacheOrAbort(o);
  EXPECT_EQ(c3.materializer().status().code(), absl::StatusCode::kFailedPrecondition);
  o = SmallOptions();
  o.geometry.head_dim_v = 32;
  EXPECT_EQ(testing::CreateCacheOrAbort(o).materializer().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c.Fp8WorkspacePagesAtCapacity(), 1 + 4 * 8);
  EXPECT_EQ(c.Fp8WorkspaceShape(7), (std::vector<int64_t>{7, 2, 2, 4, 64}));
}

TEST(KVCacheOps, BoundOpsMatchTheFunctionalApiOnExplicitMetadata) {
  for (const KeyFormat kf : {KeyFormat::kNvfp4, KeyFormat::kFp8}) {
    SCOPED_TRACE(KeyFormatName(kf));
    KVCacheOptions o = SmallOptions();
    o.geometry.key_format = kf;
    KVCache c = testing::CreateCacheOrAbort(o);
    Driver d(&c);
    const SequenceId a = d.Create(), b = d.Create(), e = d.Create();
    ASSERT_TRUE(d.Step({{a, 9}, {b, 4}, {e, 1}}).ok());
    ASSERT_TRUE(d.Step({{e, 2}, {a, 1}}).ok());  // rows: e, a
    const CacheGeometry& g = c.geometry();
    // Explicit metadata for the same two sequences.
    const std::vector<SequenceId> rows = {e, a};
    std::vector<int32_t> tables(2 * 8, 0), lens, indptr = {0};
    for (int r = 0; r < 2; ++r) {
      const std::vector<int32_t> p = Pages(c, rows[r]);
      std::copy(p.begin(), p.end(), tables.begin() + r * 8);
      lens.push_back(static_cast<int32_t>(*c.SequenceLength(rows[r])));
      indptr.push_back(indptr.back() + static_cast<int32_t>(p.size()));
    }
    const TensorView tv = TensorView::Contiguous(tables.data(), DType::kI32, {2, 8});
    const TensorView lv = TensorView::Contiguous(lens.data(), DType::kI32, {2});
    const TensorView iv = TensorView::Contiguous(indptr.data(), DType::kI32, {3});
    for (int layer = 0; layer < 2; ++layer) {
      const PagedCache pc = c.LayerCache(layer);
      absl::StatusOr<LayerScales> sc = c.ReadScales(layer);
      ASSERT_TRUE(sc.ok()) << sc.status();
      const GlobalScale gk = GlobalScale::Value(sc->k);
      const GlobalScale gv = GlobalScale::Value(sc->v);
      // Materialize.
      const int64_t w = c.step().fp8_workspace_pages;
      std::vector<uint8_t> want(w * 2 * 2 * 4 * 64, 0xA5), got(want.size(), 0xA5);
      std::vector<int32_t> want_t(2 * 8, -7);
      ASSERT_TRUE(
          MaterializeFp8(pc, tv, lv, iv,
                         TensorView::Contiguous(want.data(), DType::kE4M3, {w, 2, 2, 4, 64}),
                         TensorView::Contiguous(want_t.data(), DType::kI32, {2, 8}), gk, gv,
                         GlobalScale::Value(sc->k_fp8), GlobalScale::Value(sc->v_fp8))
              .ok());
      absl::StatusOr<CacheMaterializer> m = c.materializer();
      ASSERT_TRUE(m.ok());
      ASSERT_TRUE(
          m->Run(layer, TensorView::Contiguous(got.data(), DType::kE4M3, {w, 2, 2, 4, 64})).ok());
      EXPECT_EQ(got, want) << "layer " << layer;
      const int32_t* ft = c.step_views().fp8_block_tables.ptr<const int32_t>();
      for (int r = 0; r < 2; ++r) {
        for (int j = 0; j < indptr[r + 1] - indptr[r]; ++j)
          EXPECT_EQ(ft[r * 8 + j], want_t[r * 8 + j]);
      }
      ASSERT_EQ(CheckMaterialized(c, layer, got, std::vector<int32_t>(ft, ft + 4 * 8), d.rows()),
                "");
      // Dequantize.
      const int64_t n = 2 * 12 * g.num_kv_heads * 64;
      std::vector<uint16_t> wk(n, 0xA5A5), wv(n, 0xA5A5), gk_out(n, 0xA5A5), gv_out(n, 0xA5A5);
      ASSERT_TRUE(DequantizePaged(
                      pc, tv, lv, TensorView::Contiguous(wk.data(), DType::kBF16, {2, 12, 2, 64}),
                      TensorView::Contiguous(wv.data(), DType::kBF16, {2, 12, 2, 64}), gk, gv)
                      .ok());
      absl::StatusOr<CacheDequantizer> dq = c.dequantizer();
      ASSERT_TRUE(dq.ok());
      ASSERT_TRUE(dq->Run(layer,
                          TensorView::Contiguous(gk_out.data(), DType::kBF16, {2, 12, 2, 64}),
                          TensorView::Contiguous(gv_out.data(), DType::kBF16, {2, 12, 2, 64}))
                      .ok());
      EXPECT_EQ(gk_out, wk);
      EXPECT_EQ(gv_out, wv);
      ASSERT_EQ(CheckDequantized(c, layer, gk_out, gv_out, 2, 12, d.rows(), 0xA5A5), "");
      // ReadSequence: the same rows as the dequantizer's.
      std::vector<uint16_t> rk(12 * 2 * 64, 0xA5A5), rv(rk.size(), 0xA5A5);
      ASSERT_TRUE(c.ReadSequence(layer, a,
                                 TensorView::Contiguous(rk.data(), DType::kBF16, {12, 2, 64}),
                                 TensorView::Contiguous(rv.data(), DType::kBF16, {12, 2, 64}))
                      .ok());
      const int64_t row_a = int64_t{12} * 2 * 64;  // request a is row 1
      EXPECT_TRUE(std::equal(rk.begin(), rk.begin() + 10 * 128, gk_out.begin() + row_a));
      EXPECT_TRUE(std::equal(rv.begin(), rv.begin() + 10 * 128, gv_out.begin() + row_a));
    }
    EXPECT_TRUE(c.CheckInvariants().ok());
  }
}

TEST(KVCacheOps, BoundOpsSurviveMovingTheCache) {
  KVCache c = testing::CreateCacheOrAbort(SmallOptions());
  absl::StatusOr<CacheAppender> app = c.appender();
  ASSERT_TRUE(app.ok());
  KVCache moved = std::move(c);
  const SequenceId s = moved.CreateSequence().value();
  ASSERT_TRUE(moved.PrepareStep({{s, 2}}).ok());
  TokenFactory f(moved);
  StepInputs in;
  const std::vector<Token> toks = {f.Make(1), f.Make(2)};
  ASSERT_TRUE(testing::FillStepInputs(moved, toks, &in, nullptr).ok());
  ASSERT_TRUE(testing::RunAppendAllLayers(moved, *app, &in, nullptr).ok());
  EXPECT_EQ(CheckSequenceBytes(moved, DownloadPools(moved), s, toks), "");
  KVCache other = testing::CreateCacheOrAbort(SmallOptions());
  other = std::move(moved);  // move-assign frees `other`'s pools
  EXPECT_EQ(CheckSequenceBytes(other, DownloadPools(other), s, toks), "");
}

// A bound op holds no ownership of its cache: once the cache is destroyed,
// Run() refuses instead of touching freed memory; copies of the op too.
TEST(KVCacheOps, BoundOpsOfADestroyedCacheAreFailedPrecondition) {
  CacheAppender app;
  CacheDequantizer deq;
  CacheAttention att;
  EXPECT_EQ(app.Run(0, TensorView(), TensorView()).code(),
            absl::StatusCode::kFailedPrecondition);  // never bound
  {
    KVCache c = testing::CreateCacheOrAbort(SmallOptions());
    app = *c.appender();
    deq = *c.dequantizer();
    absl::StatusOr<CacheAttention> a = c.attention({/*num_qo_heads=*/2});
    ASSERT_TRUE(a.ok()) << a.status();
    att = *a;
    const SequenceId s = c.CreateSequence().value();
    ASSERT_TRUE(c.PrepareStep({{s, 0}}).ok());
    KVCache moved = std::move(c);  // the ops follow the state, not the object
    EXPECT_NE(app.Run(0, TensorView(), TensorView()).code(),
              absl::StatusCode::kFailedPrecondition);
  }
  const CacheAppender copy = app;
  for (const absl::Status& st :
       {app.Run(0, TensorView(), TensorView()), copy.Run(0, TensorView(), TensorView()),
        deq.Run(0, TensorView(), TensorView()),
        att.Run(0, TensorView(), TensorView(), nullptr, 0)}) {
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("cache was destroyed"), std::string::npos) << st;
  }
}

// -------------------------------------------------------------------- GPU
// The decode step of every layer (append, materialize, dequantize) captured
// once as a CUDA graph replays like eager execution and like the CPU
// reference over steps with other sequences, lengths, forks (copy on write),
// truncation, releases and a scale update.
void CapturedStepReplaysLikeEagerAndCpu(KeyFormat key_format) {
  FP4KV_SKIP_WITHOUT_GPU();
  // A blocking stream: the harness's synchronous cudaMemset/cudaMemcpy (legacy
  // stream) are ordered with it.
  cudaStream_t cs;
  FP4KV_ASSERT_CUDA(cudaStreamCreate(&cs));
  const Stream stream = reinterpret_cast<Stream>(cs);
  KVCacheOptions o = SmallOptions();
  o.geometry.key_format = key_format;
  o.num_layers = 3;
  o.k_global_scales = {4.0f, 5.0f, 6.0f};
  o.v_global_scales = {3.0f, 6.0f, 2.0f};
  o.geometry.num_pages = 40;
  o.max_seqs_per_step = 5;
  o.max_tokens_per_step = 24;
  o.max_pages_per_seq = 10;
  KVCache cpu = testing::CreateCacheOrAbort(o);
  o.device = Device::Cuda(0);
  KVCache eager = testing::CreateCacheOrAbort(o);
  KVCache graph = testing::CreateCacheOrAbort(o);
  KVCache* caches[3] = {&cpu, &eager, &graph};
  const int L = o.num_layers;
  const int S = o.max_seqs_per_step;
  const int T = o.max_tokens_per_step;
  const int64_t max_len = int64_t{o.max_pages_per_seq} * o.geometry.page_size;
  const int64_t W = cpu.Fp8WorkspacePagesAtCapacity();
  const int64_t page_bytes = 2 * 2 * 4 * 64;
  // Per cache: inputs, per-layer FP8 workspaces and dequantized outputs.
  struct Outputs {
    StepInputs in;
    std::vector<Buffer> ws, k, v;
  } outs[3];
  for (int i = 0; i < 3; ++i) {
    for (int l = 0; l < L; ++l) {
      outs[i].ws.emplace_back(caches[i]->device(), static_cast<size_t>(W * page_bytes));
      outs[i].k.emplace_back(caches[i]->device(), static_cast<size_t>(S * max_len * 2 * 64 * 2));
      outs[i].v.emplace_back(caches[i]->device(), static_cast<size_t>(S * max_len * 2 * 64 * 2));
    }
  }
  // Op objects are made before any capture (Create may query the device).
  std::vector<CacheAppender> apps;
  std::vector<CacheMaterializer> mats;
  std::vector<CacheDequantizer> deqs;
  for (KVCache* c : caches) {
    absl::StatusOr<CacheAppender> app = c->appender();
    absl::StatusOr<CacheMaterializer> mat = c->materializer();
    absl::StatusOr<CacheDequantizer> deq = c->dequantizer();
    ASSERT_TRUE(app.ok() && mat.ok() && deq.ok());
    apps.push_back(*app);
    mats.push_back(*mat);
    deqs.push_back(*deq);
  }
  auto run_layers = [&](int i, Stream st) -> absl::Status {
    const CacheAppender* app = &apps[i];
    const CacheMaterializer* mat = &mats[i];
    const CacheDequantizer* deq = &deqs[i];
    for (int l = 0; l < L; ++l) {
      absl::Status s = app->Run(l, outs[i].in.k[l].View(DType::kBF16, {T, 2, 64}),
                                outs[i].in.v[l].View(DType::kBF16, {T, 2, 64}), st);
      if (s.ok()) s = mat->Run(l, outs[i].ws[l].View(DType::kE4M3, {W, 2, 2, 4, 64}), st);
      if (s.ok()) {
        s = deq->Run(l, outs[i].k[l].View(DType::kBF16, {S, max_len, 2, 64}),
                     outs[i].v[l].View(DType::kBF16, {S, max_len, 2, 64}), st);
      }
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  };

  TokenFactory factory(cpu);
  std::map<SequenceId, std::vector<Token>> model;  // ids agree across caches
  cudaGraphExec_t exec = nullptr;
  uint64_t next = 1;
  int64_t copies = 0;
  std::mt19937 rng(3);
  std::vector<SequenceId> live;
  auto all = [&](const std::function<void(KVCache&)>& f) {
    for (KVCache* c : caches) f(*c);
  };
  for (int step = 0; step < 40; ++step) {
    // Sequence management, identical on the three caches.
    if (live.size() < 3 || rng() % 4 == 0) {
      SequenceId id = 0;
      all([&](KVCache& c) { id = c.CreateSequence().value(); });
      model[id];
      live.push_back(id);
    }
    if ((step == 2 || rng() % 5 == 0) && live.size() < 5) {  // step 2: a fork for sure
      const SequenceId p = live[rng() % live.size()];
      SequenceId id = 0;
      all([&](KVCache& c) { id = *c.ForkSequence(p); });
      model[id] = model[p];
      live.push_back(id);
    }
    if (rng() % 6 == 0) {
      const SequenceId id = live[rng() % live.size()];
      const int64_t n = model[id].size() - std::min<size_t>(model[id].size(), rng() % 4);
      all([&](KVCache& c) { ASSERT_TRUE(c.Truncate(id, n).ok()); });
      model[id].resize(n);
    }
    if (rng() % 7 == 0 && live.size() > 2) {
      const size_t i = rng() % live.size();
      all([&](KVCache& c) { ASSERT_TRUE(c.ReleaseSequence(live[i]).ok()); });
      model.erase(live[i]);
      live.erase(live.begin() + i);
    }
    if (step == 20) {
      // New scales (which the replayed graph must read from the device array)
      // apply to tokens stored from now on; stored tokens would dequantize
      // with them too, so start from an empty cache.
      for (SequenceId id : live) {
        all([&](KVCache& c) { ASSERT_TRUE(c.ReleaseSequence(id).ok()); });
        model.erase(id);
      }
      live.clear();
      all([&](KVCache& c) { ASSERT_TRUE(c.UpdateGlobalScales(1, 7.0f, 1.5f, stream).ok()); });
      for (int i = 0; i < 3; ++i) {
        SequenceId id = 0;
        all([&](KVCache& c) { id = c.CreateSequence().value(); });
        model[id];
        live.push_back(id);
      }
    }
    std::vector<SequenceId> order = live;
    std::shuffle(order.begin(), order.end(), rng);
    order.resize(std::min<size_t>(order.size(), S));
    std::vector<StepEntry> entries;
    std::vector<Token> toks;
    StepRows rows;
    int64_t budget = step % 5 == 0 ? T : static_cast<int64_t>(order.size());  // prefill or decode
    for (SequenceId id : order) {
      int64_t n = step % 5 == 0 ? 1 + rng() % 6 : 1;
      n = std::min<int64_t>({n, budget, max_len - static_cast<int64_t>(model[id].size())});
      budget -= n;
      entries.push_back({id, static_cast<int32_t>(n)});
      for (int64_t t = 0; t < n; ++t) {
        toks.push_back(factory.Make(next++));
        model[id].push_back(toks.back());
      }
      rows.push_back(model[id]);
    }
    StepInfo infos[3];
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<StepInfo> info = caches[i]->PrepareStep(entries, stream);
      ASSERT_TRUE(info.ok()) << "step " << step << ": " << info.status();
      infos[i] = *info;
      ASSERT_TRUE(testing::FillStepInputs(*caches[i], toks, &outs[i].in, stream).ok());
      for (int l = 0; l < L; ++l) {
        ASSERT_TRUE(outs[i].k[l].Fill(0xA5) && outs[i].v[l].Fill(0xA5) && outs[i].ws[l].Fill(0x5A));
      }
    }
    EXPECT_EQ(infos[1].pages_copied, infos[0].pages_copied);
    EXPECT_EQ(infos[2].pages_copied, infos[0].pages_copied);
    copies += infos[0].pages_copied;
    ASSERT_TRUE(run_layers(0, nullptr).ok());
    ASSERT_TRUE(run_layers(1, stream).ok());
    if (exec == nullptr) {  // capture once, on the first step
      cudaGraph_t g;
      FP4KV_ASSERT_CUDA(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
      const absl::Status s = run_layers(2, stream);
      FP4KV_ASSERT_CUDA(cudaStreamEndCapture(cs, &g));
      ASSERT_TRUE(s.ok()) << s;
      FP4KV_ASSERT_CUDA(cudaGraphInstantiate(&exec, g, 0));
      FP4KV_ASSERT_CUDA(cudaGraphDestroy(g));
    }
    FP4KV_ASSERT_CUDA(cudaGraphLaunch(exec, cs));
    FP4KV_ASSERT_CUDA(cudaStreamSynchronize(cs));

    // The CPU cache holds the reference bytes; the GPU caches match it.
    const testing::PoolCopy ref = DownloadPools(cpu);
    for (SequenceId id : live) ASSERT_EQ(CheckSequenceBytes(cpu, ref, id, model[id]), "");
    for (int i = 1; i < 3; ++i) {
      ASSERT_TRUE(DownloadPools(*caches[i]).regions == ref.regions)
          << "cache " << i << " step " << step;
    }
    const int64_t used = infos[0].fp8_workspace_pages * page_bytes;
    for (int l = 0; l < L; ++l) {
      const std::vector<uint8_t> ws = outs[0].ws[l].DownloadAs<uint8_t>(static_cast<size_t>(used));
      const std::vector<uint8_t> ft = DownloadView(cpu.step_views().fp8_block_tables);
      std::vector<int32_t> tables(ft.size() / 4);
      std::memcpy(tables.data(), ft.data(), ft.size());
      ASSERT_EQ(CheckMaterialized(cpu, l, ws, tables, rows), "") << "layer " << l;
      const size_t n = static_cast<size_t>(S * max_len * 2 * 64);
      const std::vector<uint16_t> k0 = outs[0].k[l].DownloadAs<uint16_t>(n);
      const std::vector<uint16_t> v0 = outs[0].v[l].DownloadAs<uint16_t>(n);
      ASSERT_EQ(CheckDequantized(cpu, l, k0, v0, S, max_len, rows, 0xA5A5), "") << "layer " << l;
      for (int i = 1; i < 3; ++i) {
        EXPECT_EQ(outs[i].ws[l].DownloadAs<uint8_t>(static_cast<size_t>(used)), ws)
            << "cache " << i << " layer " << l << " step " << step;
        EXPECT_EQ(DownloadView(caches[i]->step_views().fp8_block_tables), ft);
        EXPECT_EQ(outs[i].k[l].DownloadAs<uint16_t>(n), k0);
        EXPECT_EQ(outs[i].v[l].DownloadAs<uint16_t>(n), v0);
      }
    }
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GT(copies, 0) << "the scenario never copied a shared page";
  if (exec != nullptr) FP4KV_ASSERT_CUDA(cudaGraphExecDestroy(exec));
  FP4KV_ASSERT_CUDA(cudaStreamDestroy(cs));
}

TEST(KVCacheGpu, CapturedStepReplaysLikeEagerAndCpu) {
  CapturedStepReplaysLikeEagerAndCpu(KeyFormat::kNvfp4);
}

// The same with FP8 keys (K8V4).
TEST(KVCacheGpu, CapturedStepReplaysLikeEagerAndCpuFp8Keys) {
  CapturedStepReplaysLikeEagerAndCpu(KeyFormat::kFp8);
}

TEST(KVCacheApi, MovedFromCacheReturnsErrorsAndEmptyValues) {
  absl::StatusOr<KVCache> made = KVCache::Create(SmallOptions());
  ASSERT_TRUE(made.ok()) << made.status();
  KVCache live = *std::move(made);
  const SequenceId seq = live.CreateSequence().value();
  KVCache moved = std::move(live);
  // `live` is moved from: defined behaviour everywhere.
  auto precondition = [](const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("KVCache: expected a live cache"), std::string::npos) << s;
  };
  precondition(live.CreateSequence().status());
  precondition(live.ForkSequence(seq).status());
  precondition(live.Truncate(seq, 0));
  precondition(live.ReleaseSequence(seq));
  precondition(live.SequenceLength(seq).status());
  precondition(live.SequencePages(seq).status());
  precondition(live.PageRefCount(0).status());
  precondition(live.PrepareStep({{seq, 1}}).status());
  precondition(live.appender().status());
  precondition(live.materializer().status());
  precondition(live.dequantizer().status());
  precondition(live.attention({}).status());
  precondition(live.UpdateGlobalScales(0, 1.0f, 1.0f));
  precondition(live.UpdateGlobalScales(std::vector<float>{1, 1}, std::vector<float>{1, 1}));
  precondition(live.ReadScales(0).status());
  precondition(live.LayerTokens(0).status());
  precondition(live.ReadScaleEvents(0).status());
  precondition(live.ResetScaleEvents());
  precondition(live.ReadSequence(0, seq, TensorView(), TensorView()));
  EXPECT_EQ(live.step().num_seqs, 0);
  EXPECT_TRUE(live.step_views().slot_mapping.empty());
  EXPECT_TRUE(live.host_slot_mapping().empty());
  EXPECT_TRUE(live.host_seq_lens().empty());
  EXPECT_TRUE(live.host_kv_page_indptr().empty());
  EXPECT_TRUE(live.host_token_indptr().empty());
  EXPECT_TRUE(live.host_block_table(0).empty());
  EXPECT_EQ(live.global_scale_ptr(0, 0), nullptr);
  EXPECT_EQ(live.fp8_scale_ptr(0, 1), nullptr);
  EXPECT_TRUE(live.LayerCache(0).k_data.empty());
  EXPECT_EQ(live.num_layers(), 0);
  EXPECT_EQ(live.Fp8WorkspacePagesAtCapacity(), 0);
  EXPECT_TRUE(live.Fp8WorkspaceShape(3).empty());
  EXPECT_EQ(live.Stats().pages_total, 0);
  EXPECT_EQ(live.options().num_layers, 0);
  // The cache it moved into works, and a moved-from cache can be reassigned.
  EXPECT_TRUE(moved.SequenceLength(seq).ok());
  live = std::move(moved);
  EXPECT_TRUE(live.SequenceLength(seq).ok());
  // Out-of-range accessors of a live cache are defined too.
  EXPECT_TRUE(live.host_block_table(-1).empty());
  EXPECT_TRUE(live.host_block_table(4).empty());
  EXPECT_EQ(live.global_scale_ptr(2, 0), nullptr);
  EXPECT_TRUE(live.LayerCache(-1).k_data.empty());
}

TEST(KVCacheApi, BoundOpsAreDefaultConstructibleMembers) {
  struct Server {
    CacheAppender append;
    CacheMaterializer materialize;
    CacheDequantizer dequantize;
    CacheAttention attend;
    Appender raw;
  } server;
  EXPECT_EQ(server.append.Run(0, TensorView(), TensorView()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(server.materialize.Run(0, TensorView()).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(server.dequantize.Run(0, TensorView(), TensorView()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(server.attend.Run(0, TensorView(), TensorView(), nullptr, 0).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(server.raw.Run(AppendArgs(), PagedCache()).code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<KVCache> cache = KVCache::Create(SmallOptions());
  ASSERT_TRUE(cache.ok());
  absl::StatusOr<CacheAppender> a = cache->appender();
  ASSERT_TRUE(a.ok());
  server.append = *a;  // assignable
  EXPECT_EQ(server.append.Run(0, TensorView(), TensorView()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KVCacheApi, SequenceIdsCountUpAndAreNeverReused) {
  absl::StatusOr<KVCache> cache = KVCache::Create(SmallOptions());
  ASSERT_TRUE(cache.ok());
  const SequenceId a = cache->CreateSequence().value();
  const SequenceId b = cache->CreateSequence().value();
  EXPECT_EQ(a, 1u);
  EXPECT_EQ(b, 2u);
  ASSERT_TRUE(cache->ReleaseSequence(a).ok());
  const SequenceId c = cache->CreateSequence().value();  // reuses a's slot, not its id
  EXPECT_EQ(c, 3u);
  EXPECT_EQ(cache->SequenceLength(a).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(cache->SequenceLength(c).ok());
  EXPECT_EQ(cache->Stats().sequence_lengths.size(), 2u);
}

TEST(KVCacheApi, DefaultMaxPagesPerSeqIsValidAndReported) {
  KVCacheOptions o = SmallOptions();
  o.max_pages_per_seq = 0;
  absl::StatusOr<KVCache> cache = KVCache::Create(o);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->options().max_pages_per_seq, 16);  // min(num_pages, 32768 / 4)
  o.geometry.num_pages = 100000;
  o.geometry.page_size = 16;
  cache = KVCache::Create(o);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->options().max_pages_per_seq, 2048);  // 32768 tokens
}

TEST(KVCacheApi, HugeBudgetOrPagesOverflowingThePoolAreRejected) {
  KVCacheOptions o = SmallOptions();
  o.geometry.num_kv_heads = 1 << 30;
  o.geometry.head_dim_k = o.geometry.head_dim_v = 1 << 30;
  absl::StatusOr<KVCache> cache = KVCache::Create(o);
  ASSERT_FALSE(cache.ok());
  EXPECT_EQ(cache.status().code(), absl::StatusCode::kInvalidArgument) << cache.status();
  EXPECT_NE(cache.status().message().find("geometry"), std::string::npos) << cache.status();
  o = SmallOptions();
  o.geometry.num_kv_heads = 1 << 20;
  o.geometry.head_dim_k = o.geometry.head_dim_v = 1 << 16;
  o.geometry.num_pages = INT32_MAX;
  cache = KVCache::Create(o);
  ASSERT_FALSE(cache.ok());
  EXPECT_NE(cache.status().message().find("geometry.num_pages"), std::string::npos)
      << cache.status();
  o.geometry.num_pages = 0;
  o.memory_budget_bytes = INT64_MAX;
  o.geometry.page_size = 1 << 20;
  cache = KVCache::Create(o);
  ASSERT_FALSE(cache.ok());  // a budget near INT64_MAX: computed without overflow, not allocatable
  EXPECT_TRUE(cache.status().code() == absl::StatusCode::kInvalidArgument ||
              cache.status().code() == absl::StatusCode::kResourceExhausted)
      << cache.status();
}

TEST(KVCacheApi, ReadSequenceDequantizesOneSequenceWithoutAStep) {
  KVCacheOptions o = SmallOptions();
  absl::StatusOr<KVCache> cache = KVCache::Create(o);
  ASSERT_TRUE(cache.ok());
  const CacheGeometry& g = cache->geometry();
  const SequenceId a = cache->CreateSequence().value();
  const SequenceId b = cache->CreateSequence().value();
  const int n = 7;
  ASSERT_TRUE(cache->PrepareStep({{a, n}, {b, 2}}).ok());
  const int64_t row = int64_t{g.num_kv_heads} * g.head_dim_k;
  std::vector<uint16_t> k = testing::RandomHalfBits(DType::kBF16, 9 * row, 3);
  std::vector<uint16_t> v = testing::RandomHalfBits(DType::kBF16, 9 * row, 4);
  absl::StatusOr<CacheAppender> app = cache->appender();
  ASSERT_TRUE(app.ok());
  for (int layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(app->Run(layer,
                         TensorView::Contiguous(k.data(), DType::kBF16, {9, g.num_kv_heads, g.head_dim_k}),
                         TensorView::Contiguous(v.data(), DType::kBF16, {9, g.num_kv_heads, g.head_dim_v}))
                    .ok());
  }
  // The step dequantizer's rows for sequence a are the reference.
  const int64_t T = 8;
  std::vector<uint16_t> step_k(4 * T * row, 0xA5A5), step_v(4 * T * row, 0xA5A5);
  absl::StatusOr<CacheDequantizer> dq = cache->dequantizer();
  ASSERT_TRUE(dq.ok());
  ASSERT_TRUE(dq->Run(1, TensorView::Contiguous(step_k.data(), DType::kBF16, {4, T, g.num_kv_heads, g.head_dim_k}),
                      TensorView::Contiguous(step_v.data(), DType::kBF16, {4, T, g.num_kv_heads, g.head_dim_v}))
                  .ok());
  std::vector<uint16_t> out_k(T * row, 0xA5A5), out_v(T * row, 0xA5A5);
  const TensorView ko = TensorView::Contiguous(out_k.data(), DType::kBF16, {T, g.num_kv_heads, g.head_dim_k});
  const TensorView vo = TensorView::Contiguous(out_v.data(), DType::kBF16, {T, g.num_kv_heads, g.head_dim_v});
  ASSERT_TRUE(cache->ReadSequence(1, a, ko, vo).ok());
  EXPECT_EQ(0, std::memcmp(out_k.data(), step_k.data(), n * row * 2));
  EXPECT_EQ(0, std::memcmp(out_v.data(), step_v.data(), n * row * 2));
  EXPECT_EQ(out_k[n * row], 0xA5A5);  // past the length: unchanged
  // Errors name the argument and write nothing.
  std::vector<uint16_t> before = out_k;
  const TensorView short_k = TensorView::Contiguous(out_k.data(), DType::kBF16, {n - 1, g.num_kv_heads, g.head_dim_k});
  absl::Status s = cache->ReadSequence(1, a, short_k, vo);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("k_out"), std::string::npos) << s;
  EXPECT_EQ(cache->ReadSequence(1, 999, ko, vo).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache->ReadSequence(2, a, ko, vo).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out_k, before);
}

TEST(KVCacheApi, Fp8WorkspaceShapeBuildsAView) {
  absl::StatusOr<KVCache> cache = KVCache::Create(SmallOptions());
  ASSERT_TRUE(cache.ok());
  const std::vector<int64_t> shape = cache->Fp8WorkspaceShape(3);
  const TensorView w = TensorView::Contiguous(static_cast<void*>(nullptr), DType::kE4M3, shape);
  EXPECT_EQ(w.ndim, 5);
  EXPECT_EQ(w.ShapeString(), "[3, 2, 2, 4, 64]");
}

}  // namespace
}  // namespace fp4kv
