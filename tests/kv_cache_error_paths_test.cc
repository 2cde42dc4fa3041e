// KVCache after a CUDA error past its checks (docs/kv_cache.md, "CUDA errors
// after a commit"), with the error injected where a real one would surface
// (internal::FailCopyForTesting):
//   - the step upload, PrepareStep's last phase, after the commit: the step
//     stays committed on the host, and the next PrepareStep on the slot
//     uploads the whole slot, so its device tables are the host's again (a
//     stale row would be read by every kernel of that step);
//   - a demotion copy to the host tier of the prefix cache: the evicted pages
//     stay evicted and none enters the host tier; nothing else changes.
// GPU only (the CPU device has neither an upload nor a copy stream).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
#include "src/kv_cache/copy_engine.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

constexpr int kPs = 4;

KVCacheOptions Options(int64_t prefix_host_pages) {
  KVCacheOptions o;
  o.num_layers = 2;
  o.geometry.num_kv_heads = 2;
  o.geometry.head_dim_k = o.geometry.head_dim_v = 32;
  o.geometry.page_size = kPs;
  o.geometry.num_pages = 16;
  o.device = Device::Cuda(0);
  o.k_global_scales = {0.5f, 1.5f};
  o.v_global_scales = {0.75f, 2.0f};
  o.max_seqs_per_step = 4;
  o.max_tokens_per_step = 64;
  o.max_pages_per_seq = 16;
  if (prefix_host_pages > 0) {
    o.prefix_cache.enabled = true;
    // Exactly prefix_host_pages (even): per layer, K and V data regions of
    // 128 bytes a page and scale regions of 16, each rounded up to 256.
    auto region = [&](int64_t b) { return (prefix_host_pages * b + 255) / 256 * 256; };
    o.prefix_cache.host_bytes = o.num_layers * 2 * (region(128) + region(16));
  }
  return o;
}

// Resets the injected failures on every exit.
struct NoInjectedFailures {
  ~NoInjectedFailures() {
    internal::FailCopyForTesting(0, false);
    internal::FailCopyForTesting(0, true);
  }
};

// The device copy of the latest step's tables equals the host's (rows
// [0, num_seqs), their first ceil(seq_len / page_size) entries).
void ExpectDeviceTablesMatchHost(const KVCache& c) {
  const StepInfo& info = c.step();
  const StepViews& v = c.step_views();
  const int S = c.options().max_seqs_per_step;
  const int M = c.options().max_pages_per_seq;
  std::vector<int32_t> tables(static_cast<size_t>(S) * M), lens(S);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(
      cudaMemcpy(tables.data(), v.block_tables.data, tables.size() * 4, cudaMemcpyDeviceToHost),
      cudaSuccess);
  ASSERT_EQ(cudaMemcpy(lens.data(), v.seq_lens.data, lens.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (int i = 0; i < info.num_seqs; ++i) {
    EXPECT_EQ(lens[i], c.host_seq_lens()[i]) << "row " << i;
    const absl::Span<const int32_t> row = c.host_block_table(i);
    const int pages = (c.host_seq_lens()[i] + kPs - 1) / kPs;
    for (int j = 0; j < pages; ++j) {
      EXPECT_EQ(tables[static_cast<size_t>(i) * M + j], row[j]) << "row " << i << " entry " << j;
    }
  }
}

TEST(KVCacheErrorPathsTest, UploadFailureLeavesTheStepCommittedAndTheNextUploadWhole) {
  FP4KV_SKIP_WITHOUT_GPU();
  NoInjectedFailures reset;
  absl::StatusOr<KVCache> c = KVCache::Create(Options(0));
  ASSERT_TRUE(c.ok()) << c.status();
  const SequenceId a = c->CreateSequence().value(), b = c->CreateSequence().value();
  ASSERT_TRUE(c->PrepareStep({{a, 6}, {b, 3}}).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectDeviceTablesMatchHost(*c));

  // Both rows gain a page in the failing step; the next step adds a token to
  // each without a new page, so a row taken as uploaded would stay stale.
  internal::FailCopyForTesting(1, /*upload=*/true);
  const absl::StatusOr<StepInfo> failed = c->PrepareStep({{a, 4}, {b, 2}});
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  // Committed on the host: the lengths, the pages and the step count.
  EXPECT_EQ(c->SequenceLength(a).value(), 10);
  EXPECT_EQ(c->SequenceLength(b).value(), 5);
  EXPECT_TRUE(c->CheckInvariants().ok()) << c->CheckInvariants();

  const absl::StatusOr<StepInfo> next = c->PrepareStep({{a, 1}, {b, 1}});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->num_tokens, 2);
  ASSERT_NO_FATAL_FAILURE(ExpectDeviceTablesMatchHost(*c));
  EXPECT_TRUE(c->CheckInvariants().ok());
}

TEST(KVCacheErrorPathsTest, DemotionCopyFailureKeepsEvictedPagesOffTheHostTier) {
  FP4KV_SKIP_WITHOUT_GPU();
  NoInjectedFailures reset;
  absl::StatusOr<KVCache> c = KVCache::Create(Options(/*prefix_host_pages=*/8));
  ASSERT_TRUE(c.ok()) << c.status();
  // A prompt of four full pages and one token, released: four cached pages.
  std::vector<int32_t> prompt(4 * kPs + 1);
  std::iota(prompt.begin(), prompt.end(), 1000);
  const SequenceId p = c->CreateSequence().value();
  ASSERT_TRUE(c->PrepareStep({{p, static_cast<int32_t>(prompt.size()), prompt}}).ok());
  ASSERT_TRUE(c->ReleaseSequence(p).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(c->MatchPrefix(prompt).tokens_gpu, 4 * kPs);
  const KVCacheStats before = c->Stats();
  ASSERT_EQ(before.pages_cached, 4);

  // A step that needs every page evicts the four; their demotion's copy
  // fails to enqueue.
  internal::FailCopyForTesting(1);
  const SequenceId hog = c->CreateSequence().value();
  const absl::StatusOr<StepInfo> failed = c->PrepareStep({{hog, 16 * kPs}});
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  EXPECT_TRUE(c->CheckInvariants().ok()) << c->CheckInvariants();
  const PrefixMatch m = c->MatchPrefix(prompt);
  EXPECT_EQ(m.tokens_host, 0) << "a page whose copy never ran entered the host tier";
  EXPECT_EQ(m.tokens_gpu, 0) << "the evicted pages stay evicted";
  const KVCacheStats after = c->Stats();
  EXPECT_EQ(after.host_prefix_pages_cached, 0);
  EXPECT_EQ(after.pages_free, before.pages_free + 4);
  EXPECT_EQ(c->SequenceLength(hog).value(), 0) << "the step itself did not commit";

  // The cache goes on: the same step now succeeds.
  ASSERT_TRUE(c->PrepareStep({{hog, 16 * kPs}}).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectDeviceTablesMatchHost(*c));
  EXPECT_TRUE(c->CheckInvariants().ok());
}

}  // namespace
}  // namespace fp4kv
