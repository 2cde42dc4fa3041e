// KVCache::attention: the bound decode attention over a step's sequences
// equals DecodeAttention run on host copies of the layer's pools and the
// step's tables (the CPU reference), for decode steps (one query per entry)
// and speculative steps (q rows = the step's new tokens); on a GPU also when
// the whole step (append + attention of every layer) is captured once and
// replayed for later steps.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "fp4kv/attention.h"
#include "fp4kv/format.h"
#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
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

// bf16 queries [rows, Hq, D], deterministic.
std::vector<uint16_t> Queries(int64_t rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint16_t> q(rows * kQoHeads * kDim);
  for (uint16_t& x : q) x = FloatToBf16Bits(d(rng));
  return q;
}

// The reference: DecodeAttentionPaged on the CPU over host copies of the
// layer's pools and of the step's host tables. Returns bf16 [rows, Hq, D]
// (poison where nothing is written) and lse.
void ReferenceAttention(const KVCache& c, int layer, const std::vector<uint16_t>& q, int64_t rows,
                        int max_q_len, std::vector<uint16_t>* out, std::vector<float>* lse) {
  const testing::PoolCopy pools = testing::DownloadPools(c);
  PagedCache host = pools.views[layer];
  TensorView* parts[4] = {&host.k_data, &host.k_scales, &host.v_data, &host.v_scales};
  std::vector<std::vector<uint8_t>> copies(4);
  for (int kind = 0; kind < 4; ++kind) {
    copies[kind] = pools.regions[layer * 4 + kind];
    parts[kind]->data = copies[kind].data();
    parts[kind]->device = Device::Cpu();
  }
  const int S = c.options().max_seqs_per_step, M = c.options().max_pages_per_seq;
  const int n = c.step().num_seqs;
  std::vector<int32_t> tables(static_cast<size_t>(S) * M, 0), lens(S, 0), indptr(S + 1, 0);
  for (int b = 0; b < n; ++b) {
    const absl::Span<const int32_t> row = c.host_block_table(b);
    std::copy(row.begin(), row.end(), tables.begin() + static_cast<int64_t>(b) * M);
    lens[b] = c.host_seq_lens()[b];
  }
  for (int b = 0; b <= S; ++b) indptr[b] = c.host_token_indptr()[std::min(b, n)];
  DecodeAttention::Options o;
  o.geometry = c.geometry();
  o.num_qo_heads = kQoHeads;
  o.dtype = DType::kBF16;
  o.max_batch = S;
  o.max_pages_per_seq = M;
  o.max_q_len = max_q_len;
  o.write_lse = true;
  o.device = Device::Cpu();
  std::vector<uint16_t> qh = q;
  out->assign(rows * kQoHeads * kDim, 0xA5A5);
  lse->assign(rows * kQoHeads, -7.0f);
  DecodeAttentionArgs a;
  a.q = TensorView::Contiguous(qh.data(), DType::kBF16, {rows, kQoHeads, kDim});
  if (max_q_len > 1) a.q_indptr = TensorView::Contiguous(indptr.data(), DType::kI32, {S + 1});
  a.block_tables = TensorView::Contiguous(tables.data(), DType::kI32, {S, M});
  a.seq_lens = TensorView::Contiguous(lens.data(), DType::kI32, {S});
  a.out = TensorView::Contiguous(out->data(), DType::kBF16, {rows, kQoHeads, kDim});
  a.lse = TensorView::Contiguous(lse->data(), DType::kF32, {rows, kQoHeads});
  const LayerScales sc = *c.ReadScales(layer);
  a.k_scale = GlobalScale::Value(sc.k);
  a.v_scale = GlobalScale::Value(sc.v);
  const absl::Status s = DecodeAttentionPaged(o, a, host, nullptr, 0);
  ASSERT_TRUE(s.ok()) << s;
}

// "" when equal (CPU) or within the GPU tolerance (rel L2 per row and head
// <= 4e-3 for bf16, lse within 1e-3), poison where the reference is poison.
std::string Compare(const std::vector<uint16_t>& want, const std::vector<float>& want_lse,
                    const std::vector<uint16_t>& got, const std::vector<float>& got_lse,
                    bool exact) {
  if (exact) {
    if (want != got) return "outputs differ";
    if (std::memcmp(want_lse.data(), got_lse.data(), want_lse.size() * 4) != 0) return "lse differ";
    return "";
  }
  const size_t rows = want.size() / kDim;
  for (size_t r = 0; r < rows; ++r) {
    double num = 0, den = 0;
    bool poison = true;
    for (int d = 0; d < kDim; ++d) {
      const uint16_t w = want[r * kDim + d], g = got[r * kDim + d];
      poison = poison && w == 0xA5A5;
      const double e = Bf16BitsToFloat(g) - Bf16BitsToFloat(w);
      num += e * e;
      den += static_cast<double>(Bf16BitsToFloat(w)) * Bf16BitsToFloat(w);
    }
    if (poison) {
      for (int d = 0; d < kDim; ++d) {
        if (got[r * kDim + d] != 0xA5A5) return "row/head " + std::to_string(r) + " written";
      }
      continue;
    }
    if (std::sqrt(num) > 4e-3 * std::sqrt(den) + 1e-6) {
      return "row/head " + std::to_string(r) + ": rel err " + std::to_string(std::sqrt(num / den));
    }
    if (std::fabs(want_lse[r] - got_lse[r]) > 1e-3) {
      return "row/head " + std::to_string(r) + ": lse " + std::to_string(got_lse[r]) + " want " +
             std::to_string(want_lse[r]);
    }
  }
  return "";
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
  const int64_t ws_bytes = std::max(decode->WorkspaceBytes(), spec->WorkspaceBytes());
  Buffer ws(device(), std::max<int64_t>(ws_bytes, 256));
  StepInputs inputs;
  TokenFactory f(c);
  std::vector<SequenceId> seqs;
  for (int i = 0; i < 4; ++i) seqs.push_back(c.CreateSequence().value());
  uint64_t seed = 1;
  auto step = [&](const std::vector<StepEntry>& entries) {
    ASSERT_TRUE(c.PrepareStep(entries).ok());
    std::vector<Token> toks;
    for (int64_t i = 0; i < c.step().num_tokens; ++i) toks.push_back(f.Make(seed++));
    ASSERT_TRUE(testing::FillStepInputs(c, toks, &inputs, nullptr).ok());
    ASSERT_TRUE(testing::RunAppendAllLayers(c, *app, &inputs, nullptr).ok());
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
    const CacheAttention& op = speculative ? *spec : *decode;
    const int64_t rows = speculative ? c.options().max_tokens_per_step : S;
    const int mq = speculative ? 4 : 1;
    for (int layer = 0; layer < kLayers; ++layer) {
      const std::vector<uint16_t> q = Queries(rows, 100 * round + layer);
      Buffer qb(device(), q.size() * 2), ob(device(), q.size() * 2), lb(device(), rows * kQoHeads * 4);
      ASSERT_TRUE(qb.Upload(q.data(), q.size() * 2) && ob.Fill(0xA5) && lb.Fill(0xA5));
      std::vector<float> lse_poison(rows * kQoHeads);
      for (float& x : lse_poison) x = -7.0f;
      ASSERT_TRUE(lb.Upload(lse_poison.data(), lse_poison.size() * 4));
      const absl::Status s =
          op.Run(layer, qb.View(DType::kBF16, {rows, kQoHeads, kDim}),
                 ob.View(DType::kBF16, {rows, kQoHeads, kDim}), ws.get(), ws.size(), nullptr,
                 lb.View(DType::kF32, {rows, kQoHeads}));
      ASSERT_TRUE(s.ok()) << s;
      if (device().is_cuda()) {
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      }
      std::vector<uint16_t> want;
      std::vector<float> want_lse;
      ReferenceAttention(c, layer, q, rows, mq, &want, &want_lse);
      const std::vector<uint16_t> got = ob.DownloadAs<uint16_t>(want.size());
      const std::vector<float> got_lse = lb.DownloadAs<float>(want_lse.size());
      int written = 0;
      for (size_t i = 0; i < want.size(); i += kDim) written += want[i] != 0xA5A5;
      EXPECT_GT(written, 0) << "the reference wrote nothing";
      EXPECT_EQ(Compare(want, want_lse, got, got_lse, !device().is_cuda()), "")
          << "round " << round << " layer " << layer;
    }
  }
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
  const SequenceId a = c.CreateSequence().value(), b = c.CreateSequence().value();
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
  for (int i = 0; i < 4; ++i) seqs.push_back(c.CreateSequence().value());
  auto prepare = [&](const std::vector<StepEntry>& e) {
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
      ASSERT_TRUE(qb[l].Upload(qs[l].data(), qs[l].size() * 2) && ob[l].Fill(0xA5));
      std::vector<float> lp(S * kQoHeads, -7.0f);
      ASSERT_TRUE(lb[l].Upload(lp.data(), lp.size() * 4));
    }
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
      std::vector<uint16_t> want;
      std::vector<float> want_lse;
      ReferenceAttention(c, l, qs[l], S, 1, &want, &want_lse);
      EXPECT_EQ(Compare(want, want_lse, ob[l].DownloadAs<uint16_t>(want.size()),
                        lb[l].DownloadAs<float>(want_lse.size()), false),
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
