// KVCache::attention against an fp64 attention computed independently over
// the cache's own pages (testing/cache_attention_reference.h: the pools'
// bytes decoded from the format's definition, the sequences' block tables
// and lengths, no code shared with the op): decode steps (one query per
// entry), verification steps (q rows = the step's new tokens) and prefill
// chunks of up to 300 tokens mixed with decode entries, NVFP4 and
// FP8 keys, GQA groups 1 to 8, lengths on and around page boundaries,
// several sequences of different lengths, real model rows; on a GPU also
// when the whole step (append + attention of every layer) is captured once
// and replayed for later steps (decode steps, and steps mixing prefill
// chunks with decode entries). Outputs and lse are poisoned first; rows the
// step does not own must stay poison.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "fp4kv/attention.h"
#include "fp4kv/format.h"
#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
#include "src/attention_params.h"
#include "testing/attention_case.h"
#include "testing/cache_attention_reference.h"
#include "testing/kv_cache_harness.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::Buffer;
using testing::StepInputs;
using testing::Token;
using testing::TokenFactory;

constexpr int kLayers = 2;
constexpr int kKvHeads = 2;
constexpr int kGroup = 3;
constexpr int kQoHeads = kKvHeads * kGroup;
constexpr int kDim = 64;

// key_format kFp8: an FP8-key cache (K8V4); its key scales leave room for
// the factory's keys under E4M3's top of 448.
KVCacheOptions Options(Device device, KeyFormat key_format = KeyFormat::kNvfp4) {
  KVCacheOptions o;
  o.num_layers = kLayers;
  o.geometry.num_kv_heads = kKvHeads;
  o.geometry.head_dim_k = kDim;
  o.geometry.head_dim_v = kDim;
  o.geometry.page_size = 16;
  o.geometry.layout = Layout::kHND;
  o.geometry.num_pages = 96;
  o.device = device;
  o.geometry.key_format = key_format;
  o.k_global_scales = {0.004f, 0.006f};  // explicit: CPU and GPU caches hold the same bytes
  if (key_format == KeyFormat::kFp8) o.k_global_scales = {0.024f, 0.036f};
  o.v_global_scales = {0.003f, 0.002f};
  o.max_seqs_per_step = 5;
  o.max_tokens_per_step = 160;
  o.max_pages_per_seq = 16;
  return o;
}

// bf16 queries [rows, qo_heads, dim], deterministic.
std::vector<uint16_t> Queries(int64_t rows, uint64_t seed, int qo_heads = kQoHeads,
                              int dim = kDim) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint16_t> q(rows * qo_heads * dim);
  for (uint16_t& x : q) x = FloatToBf16Bits(d(rng));
  return q;
}

// Every sequence of this file is made here.
SequenceId NewSequence(KVCache& c) {
  absl::StatusOr<SequenceId> id = c.CreateSequence();
  EXPECT_TRUE(id.ok()) << id.status();
  return id.ok() ? *id : SequenceId{0};
}

constexpr uint8_t kPoisonByte = testing::kCacheAttentionPoison;
constexpr uint16_t kOutPoison = 0xA5A5;

float LsePoison() { return testing::CacheAttentionLsePoison(); }

// One step of generated tokens: PrepareStep(entries), then a token of `f`
// (seeds counting up from *seed) for every new token, appended in every layer
// through `app`.
void AppendStep(KVCache& c, const CacheAppender& app, TokenFactory& f, StepInputs* inputs,
                uint64_t* seed, const std::vector<StepEntry>& entries) {
  ASSERT_TRUE(c.PrepareStep(entries).ok());
  std::vector<Token> toks;
  for (int64_t i = 0; i < c.step().num_tokens; ++i) toks.push_back(f.Make((*seed)++));
  ASSERT_TRUE(testing::FillStepInputs(c, toks, inputs, nullptr).ok());
  ASSERT_TRUE(testing::RunAppendAllLayers(c, app, inputs, nullptr).ok());
}

std::string RunAndCheck(const KVCache& c, const CacheAttention& op, int layer,
                        const std::vector<StepEntry>& entries, const std::vector<uint16_t>& q,
                        int64_t rows, int num_qo_heads) {
  return testing::RunAndCheckCacheAttention(c, op, layer, entries, q, rows, num_qo_heads);
}

// (on the GPU, key format)
class CacheAttentionTest : public ::testing::TestWithParam<std::tuple<bool, KeyFormat>> {
 protected:
  void SetUp() override {
    if (std::get<0>(GetParam())) FP4KV_SKIP_WITHOUT_GPU();
  }
  Device device() const { return std::get<0>(GetParam()) ? Device::Cuda(0) : Device::Cpu(); }
  KVCacheOptions options() const { return Options(device(), std::get<1>(GetParam())); }
};

// Steps of decode (max_q_len 1) and of speculative verification
// (max_q_len 4, entries adding 1..4 tokens), each checked layer by layer.
TEST_P(CacheAttentionTest, MatchesTheReferenceOnDecodeAndSpeculativeSteps) {
  KVCache c = *KVCache::Create(options());
  absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
  ASSERT_TRUE(app.ok()) << app.status();
  CacheAttentionOptions ao;
  ao.num_qo_heads = kQoHeads;
  ao.write_lse = true;
  absl::StatusOr<CacheAttention> decode = c.attention(ao);
  ASSERT_TRUE(decode.ok()) << decode.status();
  ao.max_q_len = 4;
  absl::StatusOr<CacheAttention> spec = c.attention(ao);
  ASSERT_TRUE(spec.ok()) << spec.status();
  StepInputs inputs;
  TokenFactory f(c);
  std::vector<SequenceId> seqs;
  for (int i = 0; i < 4; ++i) seqs.push_back(NewSequence(c));
  uint64_t seed = 1;
  auto step = [&](const std::vector<StepEntry>& entries) {
    AppendStep(c, *app, f, &inputs, &seed, entries);
  };
  // Prefill: prompts of 37, 5, 100 and 16 tokens (two steps).
  step({{seqs[0], 37}, {seqs[1], 5}, {seqs[2], 100}});
  step({{seqs[3], 16}});
  const int S = c.options().max_seqs_per_step;
  for (int round = 0; round < 4; ++round) {
    const bool speculative = round % 2 == 1;
    std::vector<StepEntry> entries;
    for (int i = 0; i < 4; ++i) {
      if (round == 2 && i == 1) continue;  // a sequence sitting out a step
      entries.push_back({seqs[i], speculative ? 1 + (i + round) % 4 : 1});
    }
    step(entries);
    if (HasFatalFailure()) return;
    const CacheAttention& op = speculative ? *spec : *decode;
    const int64_t rows = speculative ? c.options().max_tokens_per_step : S;
    for (int layer = 0; layer < kLayers; ++layer) {
      EXPECT_EQ(RunAndCheck(c, op, layer, entries, Queries(rows, 100 * round + layer), rows,
                            kQoHeads),
                "")
          << "round " << round << " layer " << layer;
    }
  }
}

// Lengths on and around page boundaries (page 16: prompts of 1, 15, 16, 17,
// 31, 32, 33 and 47 tokens, then steps adding one to four tokens each, so
// lengths cross 16, 32 and 48), eight sequences of different lengths in one
// step, GQA groups 1, 4 and 8, head dims 64 and 128, both layouts.
TEST_P(CacheAttentionTest, PageBoundaryLengthsGqaGroupsAndLayouts) {
  struct Shape {
    int group, dim;
    Layout layout;
  };
  for (const Shape& sh : {Shape{1, 128, Layout::kNHD}, Shape{4, 64, Layout::kHND},
                          Shape{8, 64, Layout::kNHD}}) {
    SCOPED_TRACE(::testing::Message() << "group " << sh.group << " dim " << sh.dim
                                      << (sh.layout == Layout::kNHD ? " NHD" : " HND"));
    KVCacheOptions o = options();
    o.geometry.head_dim_k = o.geometry.head_dim_v = sh.dim;
    o.geometry.layout = sh.layout;
    o.geometry.num_pages = 64;
    o.max_seqs_per_step = 8;
    o.max_tokens_per_step = 256;
    o.max_pages_per_seq = 8;
    const int qo_heads = kKvHeads * sh.group;
    absl::StatusOr<KVCache> made = KVCache::Create(o);
    ASSERT_TRUE(made.ok()) << made.status();
    KVCache& c = *made;
    absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
    ASSERT_TRUE(app.ok()) << app.status();
    CacheAttentionOptions ao;
    ao.num_qo_heads = qo_heads;
    ao.write_lse = true;
    absl::StatusOr<CacheAttention> decode = c.attention(ao);
    ASSERT_TRUE(decode.ok()) << decode.status();
    ao.max_q_len = 4;
    absl::StatusOr<CacheAttention> spec = c.attention(ao);
    ASSERT_TRUE(spec.ok()) << spec.status();
    StepInputs inputs;
    TokenFactory f(c);
    uint64_t seed = 11;
    auto step = [&](const std::vector<StepEntry>& entries) {
      AppendStep(c, *app, f, &inputs, &seed, entries);
    };
    const int prompts[8] = {1, 15, 16, 17, 31, 32, 33, 47};
    std::vector<SequenceId> seqs;
    std::vector<StepEntry> entries;
    for (int p : prompts) {
      seqs.push_back(NewSequence(c));
      entries.push_back({seqs.back(), p});
    }
    step(entries);
    if (HasFatalFailure()) return;
    // The prefill step's last rows through the decode op.
    for (int layer = 0; layer < kLayers; ++layer) {
      EXPECT_EQ(RunAndCheck(c, *decode, layer, entries, Queries(8, 50 + layer, qo_heads, sh.dim),
                            8, qo_heads),
                "")
          << "prefill, layer " << layer;
    }
    for (int round = 0; round < 4; ++round) {
      const bool speculative = round % 2 == 0;
      entries.clear();
      for (int i = 0; i < 8; ++i) {
        entries.push_back({seqs[i], speculative ? 1 + (i + round) % 4 : 1});
      }
      step(entries);
      if (HasFatalFailure()) return;
      const int64_t rows = speculative ? o.max_tokens_per_step : o.max_seqs_per_step;
      for (int layer = 0; layer < kLayers; ++layer) {
        EXPECT_EQ(RunAndCheck(c, speculative ? *spec : *decode, layer, entries,
                              Queries(rows, 300 + 10 * round + layer, qo_heads, sh.dim), rows,
                              qo_heads),
                  "")
            << "round " << round << " layer " << layer;
      }
    }
  }
}

// Real model rows (/work/shared/data/realkv: SmolLM2-135M, 3 KV heads and 9
// query heads of dim 64, keys with outlier channels and a large key at
// position 0): two sequences, the prompt of 1020 and 296 tokens appended in
// chunks with the scales calibrated by the first append, then a decode step
// and a verification step whose queries are the model's own queries at those
// positions.
TEST_P(CacheAttentionTest, RealModelRows) {
  FP4KV_SKIP_WITHOUT_REALKV();
  constexpr int kH = 3, kHq = 9, kD = 64;
  const int realkv_layers[2] = {11, 23};
  KVCacheOptions o;
  o.num_layers = 2;
  o.geometry.num_kv_heads = kH;
  o.geometry.head_dim_k = o.geometry.head_dim_v = kD;
  o.geometry.page_size = 16;
  o.geometry.layout = Layout::kNHD;
  o.geometry.num_pages = 96;
  o.geometry.key_format = std::get<1>(GetParam());
  o.device = device();
  o.max_seqs_per_step = 2;
  o.max_tokens_per_step = 300;
  o.max_pages_per_seq = 65;
  absl::StatusOr<KVCache> made = KVCache::Create(o);
  ASSERT_TRUE(made.ok()) << made.status();
  KVCache& c = *made;
  const testing::RealKvLayer* rk[2];
  for (int l = 0; l < 2; ++l) {
    rk[l] = testing::LoadRealKvLayer(realkv_layers[l]);
    ASSERT_NE(rk[l], nullptr);
  }
  absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
  ASSERT_TRUE(app.ok()) << app.status();
  CacheAttentionOptions ao;
  ao.num_qo_heads = kHq;
  ao.write_lse = true;
  absl::StatusOr<CacheAttention> decode = c.attention(ao);
  ASSERT_TRUE(decode.ok()) << decode.status();
  ao.max_q_len = 4;
  absl::StatusOr<CacheAttention> spec = c.attention(ao);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const SequenceId a = NewSequence(c), b = NewSequence(c);
  std::map<SequenceId, int64_t> len;
  const int64_t T = o.max_tokens_per_step;
  std::vector<Buffer> kb, vb;
  for (int l = 0; l < 2; ++l) {
    kb.emplace_back(c.device(), T * kH * kD * 2);
    vb.emplace_back(c.device(), T * kH * kD * 2);
  }
  // Appends the model's rows at the entries' next positions, every layer.
  auto step = [&](const std::vector<StepEntry>& entries) {
    ASSERT_TRUE(c.PrepareStep(entries).ok());
    for (int l = 0; l < 2; ++l) {
      std::vector<uint16_t> k(T * kH * kD, 0), v(T * kH * kD, 0);
      int64_t row = 0;
      for (const StepEntry& e : entries) {
        for (int i = 0; i < e.num_new_tokens; ++i, ++row) {
          const int64_t pos = len[e.seq] + i;
          std::copy_n(rk[l]->k.begin() + pos * kH * kD, kH * kD, k.begin() + row * kH * kD);
          std::copy_n(rk[l]->v.begin() + pos * kH * kD, kH * kD, v.begin() + row * kH * kD);
        }
      }
      ASSERT_TRUE(kb[l].Upload(k.data(), k.size() * 2) && vb[l].Upload(v.data(), v.size() * 2));
      const absl::Status s = app->Run(l, kb[l].View(DType::kBF16, {T, kH, kD}),
                                      vb[l].View(DType::kBF16, {T, kH, kD}));
      ASSERT_TRUE(s.ok()) << s;
    }
    for (const StepEntry& e : entries) len[e.seq] += e.num_new_tokens;
  };
  // The model's queries of the step's rows: decode row b is entry b's last
  // position, verification rows are the new tokens' positions.
  auto queries = [&](int l, const std::vector<StepEntry>& entries, int64_t rows, bool verify) {
    std::vector<uint16_t> q(rows * kHq * kD, 0);
    int64_t row = 0;
    for (const StepEntry& e : entries) {
      const int n = verify ? e.num_new_tokens : 1;
      for (int i = 0; i < n; ++i, ++row) {
        const int64_t pos = len[e.seq] - n + i;
        std::copy_n(rk[l]->q.begin() + pos * kHq * kD, kHq * kD, q.begin() + row * kHq * kD);
      }
    }
    return q;
  };
  for (int chunk = 0; chunk < 4; ++chunk) {
    step({{a, 255}});  // 1020
    if (HasFatalFailure()) return;
  }
  step({{b, 296}});
  if (HasFatalFailure()) return;
  std::vector<StepEntry> entries = {{a, 1}, {b, 1}};
  step(entries);
  if (HasFatalFailure()) return;
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(RunAndCheck(c, *decode, l, entries, queries(l, entries, 2, false), 2, kHq), "")
        << "decode, layer " << realkv_layers[l];
  }
  entries = {{a, 4}, {b, 3}};
  step(entries);
  if (HasFatalFailure()) return;
  ASSERT_EQ(len[a], testing::kRealKvTokens);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(RunAndCheck(c, *spec, l, entries, queries(l, entries, T, true), T, kHq), "")
        << "verification, layer " << realkv_layers[l];
  }
}

// Prefill chunks through one op whose max_q_len is a capacity (4096): a
// prompt of 300 tokens from nothing next to shorter ones, then steps whose
// entries mix chunks of more than kDecodeRowsQLen tokens over cached
// prefixes (200 over 40, 17 over 17, 129 over 300) with decode entries (one
// token) and short ones (16 tokens, a new prompt of 5), and a step of decode
// entries only; every layer of every step against the reference over the
// cache's own pages (rows = the step's new tokens).
TEST_P(CacheAttentionTest, PrefillChunksMixedWithDecodeEntries) {
  KVCacheOptions o = options();
  o.max_seqs_per_step = 6;
  o.max_tokens_per_step = 512;
  o.max_pages_per_seq = 32;
  absl::StatusOr<KVCache> made = KVCache::Create(o);
  ASSERT_TRUE(made.ok()) << made.status();
  KVCache& c = *made;
  absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
  ASSERT_TRUE(app.ok()) << app.status();
  CacheAttentionOptions ao;
  ao.num_qo_heads = kQoHeads;
  ao.write_lse = true;
  ao.max_q_len = 4096;
  absl::StatusOr<CacheAttention> op = c.attention(ao);
  ASSERT_TRUE(op.ok()) << op.status();
  StepInputs inputs;
  TokenFactory f(c);
  std::vector<SequenceId> seqs;
  for (int i = 0; i < 5; ++i) seqs.push_back(NewSequence(c));
  uint64_t seed = 21;
  const int64_t rows = o.max_tokens_per_step;
  int step_index = 0;
  auto step = [&](const std::vector<StepEntry>& entries) {
    AppendStep(c, *app, f, &inputs, &seed, entries);
    if (::testing::Test::HasFatalFailure()) return;
    for (int layer = 0; layer < kLayers; ++layer) {
      EXPECT_EQ(RunAndCheck(c, *op, layer, entries, Queries(rows, 700 + 10 * step_index + layer),
                            rows, kQoHeads),
                "")
          << "step " << step_index << " layer " << layer;
    }
    ++step_index;
  };
  const SequenceId a = seqs[0], b = seqs[1], cc = seqs[2], d = seqs[3], e = seqs[4];
  step({{a, 300}, {b, 40}, {cc, 17}});
  if (HasFatalFailure()) return;
  step({{a, 1}, {b, 200}, {cc, 17}, {d, 5}});
  if (HasFatalFailure()) return;
  step({{a, 129}, {b, 1}, {cc, 16}, {d, 1}, {e, 33}});
  if (HasFatalFailure()) return;
  step({{a, 1}, {b, 1}, {cc, 1}, {d, 1}, {e, 1}});
}

TEST_P(CacheAttentionTest, RejectsBadRowsAndPrefillChunksAndChangesNothing) {
  KVCache c = *KVCache::Create(options());
  CacheAttentionOptions ao;
  ao.num_qo_heads = 5;  // not a multiple of 2 KV heads
  EXPECT_EQ(c.attention(ao).status().code(), absl::StatusCode::kInvalidArgument);
  ao.num_qo_heads = kQoHeads;
  absl::StatusOr<CacheAttention> decode = c.attention(ao);
  ASSERT_TRUE(decode.ok());
  ao.max_q_len = 4;
  absl::StatusOr<CacheAttention> spec = c.attention(ao);
  ASSERT_TRUE(spec.ok());
  const SequenceId a = NewSequence(c), b = NewSequence(c);
  ASSERT_TRUE(c.PrepareStep({{a, 9}, {b, 1}}).ok());
  Buffer qb(device(), 160 * kQoHeads * kDim * 2), ob(device(), 160 * kQoHeads * kDim * 2);
  Buffer ws(device(), std::max<int64_t>(256, std::max(decode->WorkspaceBytes(), spec->WorkspaceBytes())));
  ASSERT_TRUE(ob.Fill(0x5A));
  const std::vector<uint8_t> before = ob.DownloadAs<uint8_t>(ob.size());
  // One row for two entries.
  absl::Status s = decode->Run(0, qb.View(DType::kBF16, {1, kQoHeads, kDim}),
                               ob.View(DType::kBF16, {1, kQoHeads, kDim}), ws.get(), ws.size());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("q: expected dimension 0 in [2, 5]"), std::string::npos) << s;
  // An entry adding 9 tokens is a prefill chunk, not a verification.
  s = spec->Run(0, qb.View(DType::kBF16, {160, kQoHeads, kDim}),
                ob.View(DType::kBF16, {160, kQoHeads, kDim}), ws.get(), ws.size());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("max_q_len = 4"), std::string::npos) << s;
  s = decode->Run(2, qb.View(DType::kBF16, {5, kQoHeads, kDim}),
                  ob.View(DType::kBF16, {5, kQoHeads, kDim}), ws.get(), ws.size());
  EXPECT_NE(s.message().find("layer: expected"), std::string::npos) << s;
  if (device().is_cuda()) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  EXPECT_EQ(ob.DownloadAs<uint8_t>(ob.size()), before);
}

// The TMA decode kernel forced (FP4KV_ATTENTION_KERNEL=tokens_in_m_tma,
// read when the op is bound): the tensor maps of each layer's pools are
// encoded once at bind time (the process's encode count grows by the layer
// count there) and handed to every Run of that layer (no Run encodes).
// Three layers holding different tokens, both layouts: a map of the wrong
// layer, or of a wrong stride, reads the wrong pages and fails the
// reference. Skips where the TMA kernel cannot run (no sm_90a code or no
// compute capability 9.0 device).
TEST_P(CacheAttentionTest, TmaMapsEncodedAtBindReadEachLayersPools) {
  if (!device().is_cuda()) GTEST_SKIP() << "the TMA decode kernel is CUDA only";
  for (const Layout layout : {Layout::kHND, Layout::kNHD}) {
    SCOPED_TRACE(layout == Layout::kNHD ? "NHD" : "HND");
    KVCacheOptions o = options();
    o.num_layers = 3;
    o.geometry.layout = layout;
    o.k_global_scales.push_back(o.k_global_scales[0]);
    o.v_global_scales.push_back(o.v_global_scales[0]);
    absl::StatusOr<KVCache> made = KVCache::Create(o);
    ASSERT_TRUE(made.ok()) << made.status();
    KVCache& c = *made;
    absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
    ASSERT_TRUE(app.ok()) << app.status();
    CacheAttentionOptions ao;
    ao.num_qo_heads = kQoHeads;
    ao.write_lse = true;
    absl::StatusOr<CacheAttention> decode;
    int64_t encodes_before_bind = 0;
    {
      const char* old = std::getenv("FP4KV_ATTENTION_KERNEL");
      const std::string saved = old != nullptr ? old : "";
      setenv("FP4KV_ATTENTION_KERNEL", "tokens_in_m_tma", 1);
      encodes_before_bind = internal::TmaMapEncodesForTesting();
      decode = c.attention(ao);
      if (old != nullptr) {
        setenv("FP4KV_ATTENTION_KERNEL", saved.c_str(), 1);
      } else {
        unsetenv("FP4KV_ATTENTION_KERNEL");
      }
    }
    if (decode.status().code() == absl::StatusCode::kFailedPrecondition) {
      GTEST_SKIP() << "the TMA decode kernel cannot run here: " << decode.status();
    }
    ASSERT_TRUE(decode.ok()) << decode.status();
    ASSERT_STREQ(decode->op().decode_family(), "tokens_in_m_tma_all");
    const int64_t encodes_after_bind = internal::TmaMapEncodesForTesting();
    EXPECT_EQ(encodes_after_bind - encodes_before_bind, o.num_layers)
        << "every layer's maps encoded once, at bind";
    StepInputs inputs;
    TokenFactory f(c);
    uint64_t seed = 900;
    auto step = [&](const std::vector<StepEntry>& entries) {
      AppendStep(c, *app, f, &inputs, &seed, entries);
    };
    std::vector<SequenceId> seqs;
    std::vector<StepEntry> entries;
    for (int p : {40, 3, 77}) {
      seqs.push_back(NewSequence(c));
      entries.push_back({seqs.back(), p});
    }
    step(entries);
    if (HasFatalFailure()) return;
    for (int round = 0; round < 2; ++round) {
      entries.clear();
      for (SequenceId id : seqs) entries.push_back({id, 1});
      step(entries);
      if (HasFatalFailure()) return;
      const int64_t rows = o.max_seqs_per_step;
      for (int layer = 0; layer < o.num_layers; ++layer) {
        EXPECT_EQ(RunAndCheck(c, *decode, layer, entries, Queries(rows, 700 + 10 * round + layer),
                              rows, kQoHeads),
                  "")
            << "round " << round << " layer " << layer;
      }
    }
    EXPECT_EQ(internal::TmaMapEncodesForTesting(), encodes_after_bind)
        << "a bound Run encoded tensor maps";
  }
}

std::string KeyFormatParamName(const ::testing::TestParamInfo<std::tuple<bool, KeyFormat>>& i) {
  return std::get<1>(i.param) == KeyFormat::kFp8 ? "Fp8Keys" : "Nvfp4Keys";
}
INSTANTIATE_TEST_SUITE_P(Cpu, CacheAttentionTest,
                         ::testing::Combine(::testing::Values(false),
                                            ::testing::Values(KeyFormat::kNvfp4, KeyFormat::kFp8)),
                         KeyFormatParamName);
INSTANTIATE_TEST_SUITE_P(KVCacheAttentionGpu, CacheAttentionTest,
                         ::testing::Combine(::testing::Values(true),
                                            ::testing::Values(KeyFormat::kNvfp4, KeyFormat::kFp8)),
                         KeyFormatParamName);

// A whole decode step — append + attention of every layer — captured once on
// a stream and replayed for later steps whose lengths, tables and sequence
// set change: equal to the reference each time.
class CapturedStepTest : public ::testing::TestWithParam<KeyFormat> {};

TEST_P(CapturedStepTest, CapturedStepReplaysForLaterSteps) {
  FP4KV_SKIP_WITHOUT_GPU();
  KVCache c = *KVCache::Create(Options(Device::Cuda(0), GetParam()));
  absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
  CacheAttentionOptions ao;
  ao.num_qo_heads = kQoHeads;
  ao.write_lse = true;
  absl::StatusOr<CacheAttention> att = c.attention(ao);
  ASSERT_TRUE(app.ok() && att.ok());
  const int S = c.options().max_seqs_per_step;
  Buffer ws(c.device(), std::max<int64_t>(256, att->WorkspaceBytes()));
  std::vector<Buffer> qb, ob, lb;
  for (int l = 0; l < kLayers; ++l) {
    qb.emplace_back(c.device(), S * kQoHeads * kDim * 2);
    ob.emplace_back(c.device(), S * kQoHeads * kDim * 2);
    lb.emplace_back(c.device(), S * kQoHeads * 4);
  }
  cudaStream_t stream = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Stream st = reinterpret_cast<Stream>(stream);
  StepInputs inputs;
  TokenFactory f(c);
  uint64_t seed = 7;
  std::vector<SequenceId> seqs;
  for (int i = 0; i < 4; ++i) seqs.push_back(NewSequence(c));
  std::vector<StepEntry> entries;
  auto prepare = [&](const std::vector<StepEntry>& e) {
    entries = e;
    ASSERT_TRUE(c.PrepareStep(e, st).ok());
    std::vector<Token> toks;
    for (int64_t i = 0; i < c.step().num_tokens; ++i) toks.push_back(f.Make(seed++));
    ASSERT_TRUE(testing::FillStepInputs(c, toks, &inputs, st).ok());
  };
  prepare({{seqs[0], 20}, {seqs[1], 3}, {seqs[2], 50}, {seqs[3], 33}});
  ASSERT_TRUE(testing::RunAppendAllLayers(c, *app, &inputs, st).ok());
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  for (int step = 0; step < 5; ++step) {
    std::vector<StepEntry> e;
    for (int i = 0; i < 4; ++i) {
      if (step == 3 && i == 2) continue;
      e.push_back({seqs[i], 1});
    }
    prepare(e);
    std::vector<std::vector<uint16_t>> qs;
    for (int l = 0; l < kLayers; ++l) {
      qs.push_back(Queries(S, 1000 * step + l));
      ASSERT_TRUE(qb[l].Upload(qs[l].data(), qs[l].size() * 2) && ob[l].Fill(kPoisonByte) &&
                  lb[l].Fill(kPoisonByte));
    }
    FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
    if (step == 0) {
      FP4KV_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      absl::Status s = testing::RunAppendAllLayers(c, *app, &inputs, st);
      for (int l = 0; l < kLayers && s.ok(); ++l) {
        s = att->Run(l, qb[l].View(DType::kBF16, {S, kQoHeads, kDim}),
                     ob[l].View(DType::kBF16, {S, kQoHeads, kDim}), ws.get(), ws.size(), st,
                     lb[l].View(DType::kF32, {S, kQoHeads}));
      }
      FP4KV_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
      ASSERT_TRUE(s.ok()) << s;
      FP4KV_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    }
    FP4KV_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    FP4KV_ASSERT_CUDA(cudaStreamSynchronize(stream));
    for (int l = 0; l < kLayers; ++l) {
      absl::StatusOr<testing::CacheAttentionWant> want = testing::CacheAttentionReference(
          c, l, qs[l], S, kQoHeads, testing::StepRequests(entries, 1));
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_GT(want->queries, 0);
      const std::vector<uint16_t> got = ob[l].DownloadAs<uint16_t>(qs[l].size());
      const std::vector<float> got_lse = lb[l].DownloadAs<float>(S * kQoHeads);
      EXPECT_EQ(testing::CompareCacheAttention(*want, got, got_lse, DType::kBF16, kOutPoison,
                                               LsePoison()),
                "")
          << "step " << step << " layer " << l;
    }
  }
  FP4KV_ASSERT_CUDA(cudaGraphExecDestroy(exec));
  FP4KV_ASSERT_CUDA(cudaGraphDestroy(graph));
  FP4KV_ASSERT_CUDA(cudaStreamDestroy(stream));
}

// The same with prefill chunks: one op with max_q_len 4096 (rows = the
// step's new tokens) captured with its append on a step mixing a chunk of 40
// tokens with decode entries, replayed for steps with other mixes (chunks of
// 17 .. 129 tokens over cached prefixes, decode entries only, a sequence
// sitting out).
TEST_P(CapturedStepTest, CapturedMixedStepReplaysForLaterSteps) {
  FP4KV_SKIP_WITHOUT_GPU();
  KVCacheOptions o = Options(Device::Cuda(0), GetParam());
  o.max_tokens_per_step = 256;
  o.max_pages_per_seq = 32;
  absl::StatusOr<KVCache> made = KVCache::Create(o);
  ASSERT_TRUE(made.ok()) << made.status();
  KVCache& c = *made;
  absl::StatusOr<CacheAppender> app = c.appender(DType::kBF16);
  CacheAttentionOptions ao;
  ao.num_qo_heads = kQoHeads;
  ao.write_lse = true;
  ao.max_q_len = 4096;
  absl::StatusOr<CacheAttention> att = c.attention(ao);
  ASSERT_TRUE(app.ok() && att.ok());
  const int64_t T = o.max_tokens_per_step;
  Buffer ws(c.device(), std::max<int64_t>(256, att->WorkspaceBytes()));
  std::vector<Buffer> qb, ob, lb;
  for (int l = 0; l < kLayers; ++l) {
    qb.emplace_back(c.device(), T * kQoHeads * kDim * 2);
    ob.emplace_back(c.device(), T * kQoHeads * kDim * 2);
    lb.emplace_back(c.device(), T * kQoHeads * 4);
  }
  cudaStream_t stream = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Stream st = reinterpret_cast<Stream>(stream);
  StepInputs inputs;
  TokenFactory f(c);
  uint64_t seed = 9;
  std::vector<SequenceId> s;
  for (int i = 0; i < 4; ++i) s.push_back(NewSequence(c));
  std::vector<StepEntry> entries;
  auto prepare = [&](const std::vector<StepEntry>& e) {
    entries = e;
    ASSERT_TRUE(c.PrepareStep(e, st).ok());
    std::vector<Token> toks;
    for (int64_t i = 0; i < c.step().num_tokens; ++i) toks.push_back(f.Make(seed++));
    ASSERT_TRUE(testing::FillStepInputs(c, toks, &inputs, st).ok());
  };
  prepare({{s[0], 20}, {s[1], 3}, {s[2], 50}, {s[3], 33}});
  if (HasFatalFailure()) return;
  ASSERT_TRUE(testing::RunAppendAllLayers(c, *app, &inputs, st).ok());
  const std::vector<std::vector<StepEntry>> steps = {
      {{s[0], 40}, {s[1], 1}, {s[2], 1}, {s[3], 1}},
      {{s[0], 1}, {s[1], 100}, {s[2], 17}, {s[3], 1}},
      {{s[0], 1}, {s[1], 1}, {s[2], 1}, {s[3], 1}},
      {{s[0], 1}, {s[1], 16}, {s[3], 64}},
      {{s[0], 17}, {s[1], 1}, {s[2], 129}, {s[3], 1}},
  };
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  for (size_t step = 0; step < steps.size(); ++step) {
    prepare(steps[step]);
    if (HasFatalFailure()) return;
    std::vector<std::vector<uint16_t>> qs;
    for (int l = 0; l < kLayers; ++l) {
      qs.push_back(Queries(T, 2000 * step + l));
      ASSERT_TRUE(qb[l].Upload(qs[l].data(), qs[l].size() * 2) && ob[l].Fill(kPoisonByte) &&
                  lb[l].Fill(kPoisonByte));
    }
    FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
    if (step == 0) {
      FP4KV_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      absl::Status r = testing::RunAppendAllLayers(c, *app, &inputs, st);
      for (int l = 0; l < kLayers && r.ok(); ++l) {
        r = att->Run(l, qb[l].View(DType::kBF16, {T, kQoHeads, kDim}),
                     ob[l].View(DType::kBF16, {T, kQoHeads, kDim}), ws.get(), ws.size(), st,
                     lb[l].View(DType::kF32, {T, kQoHeads}));
      }
      FP4KV_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
      ASSERT_TRUE(r.ok()) << r;
      FP4KV_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    }
    FP4KV_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    FP4KV_ASSERT_CUDA(cudaStreamSynchronize(stream));
    for (int l = 0; l < kLayers; ++l) {
      absl::StatusOr<testing::CacheAttentionWant> want = testing::CacheAttentionReference(
          c, l, qs[l], T, kQoHeads, testing::StepRequests(entries, ao.max_q_len));
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_GT(want->queries, 0);
      const std::vector<uint16_t> got = ob[l].DownloadAs<uint16_t>(qs[l].size());
      const std::vector<float> got_lse = lb[l].DownloadAs<float>(T * kQoHeads);
      EXPECT_EQ(testing::CompareCacheAttention(*want, got, got_lse, DType::kBF16, kOutPoison,
                                               LsePoison()),
                "")
          << "step " << step << " layer " << l;
    }
  }
  FP4KV_ASSERT_CUDA(cudaGraphExecDestroy(exec));
  FP4KV_ASSERT_CUDA(cudaGraphDestroy(graph));
  FP4KV_ASSERT_CUDA(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(KVCacheAttentionGpu, CapturedStepTest,
                         ::testing::Values(KeyFormat::kNvfp4, KeyFormat::kFp8),
                         [](const ::testing::TestParamInfo<KeyFormat>& i) {
                           return i.param == KeyFormat::kFp8 ? "Fp8Keys" : "Nvfp4Keys";
                         });

}  // namespace
}  // namespace fp4kv
