// Property test of KVCache: thousands of random create / fork / truncate /
// release / step operations (and invalid ones) against a small model of the
// expected state. After every operation: lengths and block tables match the
// model, reference counts equal the number of sequences holding each page,
// free + used == total, a page is held by two sequences only when the model
// shared it through a fork, and failed calls changed nothing. Stored tokens
// are compared byte for byte with the reference quantizer's bytes (the
// step's sequences after every step, all sequences periodically), and the
// bound materializer and dequantizer are checked on every step. On every
// third successful step (where the head dims allow attention) the bound
// attention runs on a random layer, as decode (one query per entry) or as
// verification (the step's new tokens as queries), and is compared with the
// fp64 reference over the cache's own pages.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fp4kv/format.h"
#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
#include "testing/cache_attention_reference.h"
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

struct FuzzConfig {
  const char* name;
  int layers, heads, dk, dv, page_size;
  Layout layout;
  int64_t pages;
  Recipe recipe;
  int max_seqs, max_tokens, max_pages_per_seq;
  float gk, gv;
  KeyFormat key_format = KeyFormat::kNvfp4;
};

constexpr uint16_t kOutPoison = 0xA5A5;

// Whether the bound attention supports the geometry's head dims (equal, 64,
// 128 or 256: what the CUDA kernel needs; the CPU accepts the same).
bool AttentionHeadDims(const CacheGeometry& g) {
  return g.head_dim_k == g.head_dim_v &&
         (g.head_dim_k == 64 || g.head_dim_k == 128 || g.head_dim_k == 256);
}

class Fuzzer {
 public:
  Fuzzer(KVCache* cache, uint64_t seed, Stream stream)
      : cache_(cache), rng_(seed), stream_(stream), factory_(*cache), seed_(seed) {}

  void Run(int ops) {
    absl::StatusOr<CacheAppender> app = cache_->appender(DType::kBF16);
    ASSERT_TRUE(app.ok()) << app.status();
    appender_.emplace(*app);
    absl::StatusOr<CacheDequantizer> deq = cache_->dequantizer(DType::kBF16);
    ASSERT_TRUE(deq.ok()) << deq.status();
    dequantizer_.emplace(*deq);
    absl::StatusOr<CacheMaterializer> mat = cache_->materializer();
    if (mat.ok()) materializer_.emplace(*mat);
    CacheAttentionOptions ao;
    ao.num_qo_heads = 2 * cache_->geometry().num_kv_heads;
    ao.write_lse = true;
    absl::StatusOr<CacheAttention> decode = cache_->attention(ao);
    ao.max_q_len = 16;  // RandomEntries adds at most 9 tokens an entry
    absl::StatusOr<CacheAttention> verify = cache_->attention(ao);
    const bool attention = AttentionHeadDims(cache_->geometry());
    ASSERT_EQ(decode.ok(), attention) << decode.status();
    ASSERT_EQ(verify.ok(), attention) << verify.status();
    if (attention) {
      decode_.emplace(*decode);
      verify_.emplace(*verify);
    }
    for (op_ = 0; op_ < ops; ++op_) {
      const int r = Uniform(0, 99);
      if (r < 40) {
        Step();
      } else if (r < 52) {
        Create();
      } else if (r < 61) {
        Fork();
      } else if (r < 72) {
        TruncateOne();
      } else if (r < 84) {
        Release();
      } else {
        InvalidOp();
      }
      if (::testing::Test::HasFatalFailure() || ::testing::Test::HasNonfatalFailure()) {
        ADD_FAILURE() << "stopped at operation " << op_ << " (seed " << seed_ << ")";
        return;
      }
      CheckState();
      if (op_ % 8 == 7) CheckAllData();
    }
    CheckAllData();
    // Drain: release everything; the pool is whole again.
    while (!seqs_.empty()) Release();
    const KVCacheStats st = cache_->Stats();
    EXPECT_EQ(st.pages_free, st.pages_total);
    EXPECT_EQ(st.num_sequences, 0);
    EXPECT_GT(steps_ok_, ops / 5);
    EXPECT_GT(exhausted_, 0) << "the pool never ran out: the test did not reach exhaustion";
    EXPECT_GT(cows_, 0) << "no copy on write happened";
    if (decode_) {
      EXPECT_GT(attention_checks_[0], 3) << "decode attention was checked too rarely";
      EXPECT_GT(attention_checks_[1], 3) << "verification attention was checked too rarely";
      // How close the worst row came to its bound (1: at the bound).
      std::printf("[ attention ] %s: %d decode and %d verification checks, worst ||err|| / bound "
                  "%.3f (%s)\n",
                  cache_->device().is_cuda() ? "CUDA" : "CPU", attention_checks_[0],
                  attention_checks_[1], worst_ratio_,
                  cache_->device().is_cuda() ? "bound max(4e-3 ||want||, 2^-9 ||sum p|v|||)"
                                             : "bound 4e-3 ||want||");
      ::testing::Test::RecordProperty("attention_worst_ratio", std::to_string(worst_ratio_));
    }
  }
  int attention_checks(int kind) const { return attention_checks_[kind]; }

 private:
  struct ModelSeq {
    SequenceId id;
    std::vector<Token> tokens;
    std::vector<int32_t> pages;  // as the cache reported, checked structurally
  };

  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  int64_t PagesFor(int64_t len) const {
    const int ps = cache_->geometry().page_size;
    return (len + ps - 1) / ps;
  }
  void Sync() {
    if (cache_->device().is_cuda()) {
      ASSERT_EQ(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream_)), cudaSuccess);
    }
  }
  std::map<int32_t, int> ModelShares() const {
    std::map<int32_t, int> n;
    for (const ModelSeq& s : seqs_) {
      for (int32_t p : s.pages) ++n[p];
    }
    return n;
  }

  // Expects `st` to be an error of `code` and the cache unchanged.
  void ExpectRejected(const absl::Status& st, absl::StatusCode code,
                      const testing::Snapshot& before, const char* what) {
    EXPECT_EQ(st.code(), code) << what << ": " << st;
    EXPECT_FALSE(st.message().empty()) << what;
    Sync();
    const std::string diff = DiffSnapshots(before, TakeSnapshot(*cache_));
    EXPECT_EQ(diff, "") << what << " changed the cache: " << st;
  }

  void Create() {
    if (seqs_.size() >= 14) return;
    seqs_.push_back(ModelSeq{cache_->CreateSequence().value(), {}, {}});
  }

  void Fork() {
    if (seqs_.empty() || seqs_.size() >= 14) return;
    const ModelSeq parent = seqs_[Uniform(0, static_cast<int>(seqs_.size()) - 1)];
    absl::StatusOr<SequenceId> child = cache_->ForkSequence(parent.id);
    ASSERT_TRUE(child.ok()) << child.status();
    seqs_.push_back(ModelSeq{*child, parent.tokens, parent.pages});
  }

  void TruncateOne() {
    if (seqs_.empty()) return;
    ModelSeq& s = seqs_[Uniform(0, static_cast<int>(seqs_.size()) - 1)];
    const int64_t len = static_cast<int64_t>(s.tokens.size());
    // Mostly small rollbacks (speculative tokens), sometimes to anywhere.
    const int64_t new_len = Uniform(0, 3) == 0 ? Uniform(0, static_cast<int>(len))
                                               : std::max<int64_t>(0, len - Uniform(0, 3));
    ASSERT_TRUE(cache_->Truncate(s.id, new_len).ok());
    s.tokens.resize(new_len);
    s.pages.resize(PagesFor(new_len));
  }

  void Release() {
    if (seqs_.empty()) return;
    const int i = Uniform(0, static_cast<int>(seqs_.size()) - 1);
    ASSERT_TRUE(cache_->ReleaseSequence(seqs_[i].id).ok());
    released_.push_back(seqs_[i].id);
    seqs_.erase(seqs_.begin() + i);
  }

  // A random step over distinct live sequences.
  std::vector<StepEntry> RandomEntries() {
    std::vector<int> idx(seqs_.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int>(i);
    std::shuffle(idx.begin(), idx.end(), rng_);
    const KVCacheOptions& o = cache_->options();
    const int k = Uniform(1, std::min<int>(o.max_seqs_per_step, static_cast<int>(idx.size())));
    const int64_t cap = static_cast<int64_t>(o.max_pages_per_seq) * o.geometry.page_size;
    std::vector<StepEntry> e;
    int64_t tokens = 0;
    for (int i = 0; i < k; ++i) {
      const ModelSeq& s = seqs_[idx[i]];
      const int r = Uniform(0, 99);
      int64_t n = r < 65 ? 1 : r < 80 ? 0 : Uniform(2, 9);
      n = std::min<int64_t>(
          {n, cap - static_cast<int64_t>(s.tokens.size()), o.max_tokens_per_step - tokens});
      tokens += n;
      e.push_back(StepEntry{s.id, static_cast<int32_t>(n)});
    }
    return e;
  }

  ModelSeq* FindModel(SequenceId id) {
    for (ModelSeq& s : seqs_) {
      if (s.id == id) return &s;
    }
    return nullptr;
  }

  void Step() {
    if (seqs_.empty()) return;
    const std::vector<StepEntry> entries = RandomEntries();
    const int ps = cache_->geometry().page_size;
    // The model's prediction of the pages the step needs.
    std::map<int32_t, int> shares = ModelShares();
    const int64_t free_pages = cache_->geometry().num_pages - static_cast<int64_t>(shares.size());
    int64_t need = 0, cows = 0;
    std::vector<bool> cow(entries.size(), false);
    for (size_t i = 0; i < entries.size(); ++i) {
      const ModelSeq& s = *FindModel(entries[i].seq);
      const int64_t len = static_cast<int64_t>(s.tokens.size());
      need += PagesFor(len + entries[i].num_new_tokens) - PagesFor(len);
      if (entries[i].num_new_tokens > 0 && len % ps != 0 && shares[s.pages.back()] > 1) {
        --shares[s.pages.back()];
        cow[i] = true;
        ++cows;
        ++need;
      }
    }
    const testing::Snapshot before = TakeSnapshot(*cache_);
    absl::StatusOr<StepInfo> info = cache_->PrepareStep(entries, stream_);
    if (need > free_pages) {
      ExpectRejected(info.status(), absl::StatusCode::kResourceExhausted, before,
                     "PrepareStep beyond the free pages");
      ++exhausted_;
      return;
    }
    ASSERT_TRUE(info.ok()) << info.status() << " (model: need " << need << ", free " << free_pages
                           << ")";
    ++steps_ok_;
    cows_ += cows;
    EXPECT_EQ(info->pages_allocated, need);
    EXPECT_EQ(info->pages_copied, cows);
    EXPECT_EQ(info->num_seqs, static_cast<int>(entries.size()));

    // Structure of the new block tables: kept pages unchanged, new and
    // copied pages were free before and are distinct.
    std::set<int32_t> used_before;
    for (const ModelSeq& s : seqs_) used_before.insert(s.pages.begin(), s.pages.end());
    std::set<int32_t> fresh;
    std::vector<Token> step_tokens;
    StepRows rows;
    for (size_t i = 0; i < entries.size(); ++i) {
      ModelSeq& s = *FindModel(entries[i].seq);
      const std::vector<int32_t> old = s.pages;
      absl::StatusOr<absl::Span<const int32_t>> now = cache_->SequencePages(s.id);
      ASSERT_TRUE(now.ok());
      const int64_t new_len = static_cast<int64_t>(s.tokens.size()) + entries[i].num_new_tokens;
      ASSERT_EQ(static_cast<int64_t>(now->size()), PagesFor(new_len));
      for (size_t j = 0; j < now->size(); ++j) {
        const bool replaced = j + 1 == old.size() && cow[i];
        if (j < old.size() && !replaced) {
          ASSERT_EQ((*now)[j], old[j])
              << "kept page " << j << " of sequence " << s.id << " changed";
        } else {
          ASSERT_EQ(used_before.count((*now)[j]), 0u) << "new page " << (*now)[j] << " was in use";
          ASSERT_TRUE(fresh.insert((*now)[j]).second)
              << "page " << (*now)[j] << " handed out twice";
        }
      }
      s.pages.assign(now->begin(), now->end());
      for (int t = 0; t < entries[i].num_new_tokens; ++t) {
        step_tokens.push_back(factory_.Make(next_token_++));
        s.tokens.push_back(step_tokens.back());
      }
      rows.push_back(s.tokens);
    }
    EXPECT_EQ(static_cast<int64_t>(fresh.size()), need);
    CheckStepBuffers(entries);
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_TRUE(testing::FillStepInputs(*cache_, step_tokens, &inputs_, stream_).ok());
    const absl::Status st = testing::RunAppendAllLayers(*cache_, *appender_, &inputs_, stream_);
    ASSERT_TRUE(st.ok()) << st;
    Sync();
    const testing::PoolCopy pools = DownloadPools(*cache_);
    for (const StepEntry& e : entries) {
      const ModelSeq& s = *FindModel(e.seq);
      ASSERT_EQ(CheckSequenceBytes(*cache_, pools, s.id, s.tokens), "");
    }
    const int layer = Uniform(0, cache_->num_layers() - 1);
    if (materializer_) CheckMaterialize(layer, rows);
    CheckDequantize(layer, rows);
    if (decode_ && steps_ok_ % 3 == 0) CheckAttention(entries);
  }

  // The bound attention of a random layer on this step against the fp64
  // reference over the cache's pages, as decode or as verification.
  void CheckAttention(const std::vector<StepEntry>& entries) {
    const int kind = Uniform(0, 1);  // 0 decode, 1 verification
    bool any = false;
    for (const StepEntry& e : entries) {
      any = any || (kind == 0 ? !FindModel(e.seq)->tokens.empty() : e.num_new_tokens > 0);
    }
    if (!any) return;  // no query would be written
    const KVCacheOptions& o = cache_->options();
    const int layer = Uniform(0, cache_->num_layers() - 1);
    const int qo_heads = 2 * o.geometry.num_kv_heads;
    const int64_t rows = kind == 0 ? Uniform(static_cast<int>(entries.size()), o.max_seqs_per_step)
                                   : Uniform(cache_->step().num_tokens, o.max_tokens_per_step);
    // Small queries: the factory's keys reach thousands, and logits of
    // that size would leave fp32 (the kernel) too little room for the lse
    // tolerance and every weight on one token.
    std::normal_distribution<float> normal(0.0f, 1.0f / 64);
    std::vector<uint16_t> q(static_cast<size_t>(rows * qo_heads * o.geometry.head_dim_k));
    for (uint16_t& x : q) x = FloatToBf16Bits(normal(rng_));
    // The factory's values reach thousands with mixed signs, so a row's
    // output can be a small average of large values. The CUDA kernels round
    // the softmax weights to 16 bits (bf16 here: a relative error of at most
    // 2^-9 each) before the P*V product, which costs up to 2^-9 of
    // ||sum p|v||| (not of ||sum p v||): on CUDA the bound is the larger of
    // 4e-3 ||want|| and 2^-9 ||sum p|v||| (cancellation_tol). The CPU op
    // computes in double and gets the plain bound, as do the attention
    // suites on Gaussian and real-model data.
    const double cancellation_tol = cache_->device().is_cuda() ? std::ldexp(1.0, -9) : 0.0;
    ASSERT_EQ(testing::RunAndCheckCacheAttention(*cache_, kind == 0 ? *decode_ : *verify_, layer,
                                                 entries, q, rows, qo_heads, stream_,
                                                 cancellation_tol, &worst_ratio_),
              "")
        << (kind == 0 ? "decode" : "verification") << " attention, layer " << layer;
    ++attention_checks_[kind];
  }

  // The device step buffers hold exactly what the model says.
  void CheckStepBuffers(const std::vector<StepEntry>& entries) {
    Sync();
    const StepViews& v = cache_->step_views();
    const KVCacheOptions& o = cache_->options();
    const int ps = o.geometry.page_size;
    const std::vector<uint8_t> slots_b = DownloadView(v.slot_mapping);
    const std::vector<uint8_t> tables_b = DownloadView(v.block_tables);
    const std::vector<uint8_t> lens_b = DownloadView(v.seq_lens);
    const std::vector<uint8_t> kvp_b = DownloadView(v.kv_page_indptr);
    const std::vector<uint8_t> tok_b = DownloadView(v.token_indptr);
    const int64_t* slots = reinterpret_cast<const int64_t*>(slots_b.data());
    const int32_t* tables = reinterpret_cast<const int32_t*>(tables_b.data());
    const int32_t* lens = reinterpret_cast<const int32_t*>(lens_b.data());
    const int32_t* kvp = reinterpret_cast<const int32_t*>(kvp_b.data());
    const int32_t* tok = reinterpret_cast<const int32_t*>(tok_b.data());
    int64_t t = 0;
    int32_t pages = 0;
    ASSERT_EQ(kvp[0], 0);
    ASSERT_EQ(tok[0], 0);
    for (size_t b = 0; b < entries.size(); ++b) {
      const ModelSeq& s = *FindModel(entries[b].seq);
      const int64_t len = static_cast<int64_t>(s.tokens.size());  // the model has the step's tokens
      ASSERT_EQ(lens[b], len) << "row " << b;
      for (size_t j = 0; j < s.pages.size(); ++j) {
        ASSERT_EQ(tables[b * o.max_pages_per_seq + j], s.pages[j]) << "row " << b << " page " << j;
      }
      for (int64_t pos = len - entries[b].num_new_tokens; pos < len; ++pos, ++t) {
        ASSERT_EQ(slots[t], int64_t{s.pages[pos / ps]} * ps + pos % ps) << "slot " << t;
      }
      pages += static_cast<int32_t>(s.pages.size());
      ASSERT_EQ(kvp[b + 1], pages);
      ASSERT_EQ(tok[b + 1], t);
    }
    for (int64_t i = t; i < o.max_tokens_per_step; ++i)
      ASSERT_EQ(slots[i], -1) << "padding slot " << i;
    for (int b = static_cast<int>(entries.size()); b < o.max_seqs_per_step; ++b) {
      ASSERT_EQ(lens[b], 0) << "unused row " << b;
      ASSERT_EQ(kvp[b + 1], pages) << "unused row " << b;
      ASSERT_EQ(tok[b + 1], t) << "unused row " << b;
    }
  }

  void CheckMaterialize(int layer, const StepRows& rows) {
    const CacheGeometry& g = cache_->geometry();
    const int64_t w =
        Uniform(0, 1) ? cache_->step().fp8_workspace_pages : cache_->Fp8WorkspacePagesAtCapacity();
    const int64_t page_bytes = 2LL * g.num_kv_heads * g.page_size * g.head_dim_k;
    Buffer out(cache_->device(), static_cast<size_t>(w * page_bytes));
    ASSERT_TRUE(out.Fill(testing::kPoison));
    const std::vector<int64_t> shape = cache_->Fp8WorkspaceShape(w);
    const TensorView view = TensorView::Contiguous(
        out.get(), DType::kE4M3, {shape[0], shape[1], shape[2], shape[3], shape[4]},
        cache_->device());
    // One page short of the step's need: rejected.
    if (cache_->step().fp8_workspace_pages > 1) {
      TensorView small = view;
      small.shape[0] = cache_->step().fp8_workspace_pages - 1;
      EXPECT_EQ(materializer_->Run(layer, small, stream_).code(),
                absl::StatusCode::kInvalidArgument);
    }
    const absl::Status st = materializer_->Run(layer, view, stream_);
    ASSERT_TRUE(st.ok()) << st;
    Sync();
    const std::vector<uint8_t> host = out.DownloadAs<uint8_t>(out.size());
    const std::vector<uint8_t> tb = DownloadView(cache_->step_views().fp8_block_tables);
    std::vector<int32_t> tables(tb.size() / 4);
    std::memcpy(tables.data(), tb.data(), tb.size());
    ASSERT_EQ(CheckMaterialized(*cache_, layer, host, tables, rows), "");
  }

  void CheckDequantize(int layer, const StepRows& rows) {
    const CacheGeometry& g = cache_->geometry();
    const int64_t batch = Uniform(cache_->step().num_seqs, cache_->options().max_seqs_per_step);
    const int64_t len = cache_->step().max_seq_len + Uniform(0, 2);
    if (batch == 0 || len == 0) return;
    Buffer k(cache_->device(),
             static_cast<size_t>(batch * len * g.num_kv_heads * g.head_dim_k * 2));
    Buffer v(cache_->device(),
             static_cast<size_t>(batch * len * g.num_kv_heads * g.head_dim_v * 2));
    ASSERT_TRUE(k.Fill(0xA5) && v.Fill(0xA5));
    const TensorView kv = k.View(DType::kBF16, {batch, len, g.num_kv_heads, g.head_dim_k});
    const TensorView vv = v.View(DType::kBF16, {batch, len, g.num_kv_heads, g.head_dim_v});
    const absl::Status st = dequantizer_->Run(layer, kv, vv, stream_);
    ASSERT_TRUE(st.ok()) << st;
    Sync();
    const std::vector<uint16_t> kh = k.DownloadAs<uint16_t>(k.size() / 2);
    const std::vector<uint16_t> vh = v.DownloadAs<uint16_t>(v.size() / 2);
    ASSERT_EQ(CheckDequantized(*cache_, layer, kh, vh, batch, len, rows, kOutPoison), "");
  }

  // One of the API's error paths, chosen at random; each must change nothing.
  void InvalidOp() {
    const testing::Snapshot before = TakeSnapshot(*cache_);
    const KVCacheOptions& o = cache_->options();
    const SequenceId unknown = released_.empty()
                                   ? SequenceId{0xdead00000001ull}
                                   : released_[Uniform(0, static_cast<int>(released_.size()) - 1)];
    switch (Uniform(0, 10)) {
      case 0:
        ExpectRejected(cache_->ForkSequence(unknown).status(), absl::StatusCode::kNotFound, before,
                       "ForkSequence(unknown)");
        break;
      case 1:
        ExpectRejected(cache_->Truncate(unknown, 0), absl::StatusCode::kNotFound, before,
                       "Truncate(unknown)");
        break;
      case 2:
        ExpectRejected(cache_->ReleaseSequence(unknown), absl::StatusCode::kNotFound, before,
                       "ReleaseSequence(released or unknown)");
        break;
      case 3:
        if (seqs_.empty()) break;
        {
          const ModelSeq& s = seqs_[Uniform(0, static_cast<int>(seqs_.size()) - 1)];
          ExpectRejected(
              cache_->Truncate(s.id, static_cast<int64_t>(s.tokens.size()) + Uniform(1, 5)),
              absl::StatusCode::kInvalidArgument, before, "Truncate past the end");
          ExpectRejected(cache_->Truncate(s.id, -1), absl::StatusCode::kInvalidArgument, before,
                         "Truncate(-1)");
        }
        break;
      case 4: {  // duplicate sequence
        if (seqs_.empty()) break;
        std::vector<StepEntry> e = RandomEntries();
        e.push_back(e[Uniform(0, static_cast<int>(e.size()) - 1)]);
        if (static_cast<int>(e.size()) > o.max_seqs_per_step) break;
        ExpectRejected(cache_->PrepareStep(e, stream_).status(), absl::StatusCode::kInvalidArgument,
                       before, "PrepareStep(duplicate)");
        break;
      }
      case 5: {  // negative count
        if (seqs_.empty()) break;
        std::vector<StepEntry> e = RandomEntries();
        e.back().num_new_tokens = -Uniform(1, 3);
        ExpectRejected(cache_->PrepareStep(e, stream_).status(), absl::StatusCode::kInvalidArgument,
                       before, "PrepareStep(negative)");
        break;
      }
      case 6: {  // unknown sequence among valid ones
        std::vector<StepEntry> e = seqs_.empty() ? std::vector<StepEntry>{} : RandomEntries();
        if (static_cast<int>(e.size()) >= o.max_seqs_per_step) e.pop_back();
        e.insert(e.begin() + Uniform(0, static_cast<int>(e.size())), StepEntry{unknown, 1});
        ExpectRejected(cache_->PrepareStep(e, stream_).status(), absl::StatusCode::kNotFound,
                       before, "PrepareStep(unknown)");
        break;
      }
      case 7: {  // too many tokens
        if (seqs_.empty()) break;
        std::vector<StepEntry> e = RandomEntries();
        e.back().num_new_tokens = o.max_tokens_per_step + 1;
        ExpectRejected(cache_->PrepareStep(e, stream_).status(), absl::StatusCode::kInvalidArgument,
                       before, "PrepareStep(too many tokens)");
        break;
      }
      case 8: {  // too many entries
        std::vector<StepEntry> e(o.max_seqs_per_step + 1,
                                 StepEntry{seqs_.empty() ? unknown : seqs_[0].id, 0});
        ExpectRejected(cache_->PrepareStep(e, stream_).status(), absl::StatusCode::kInvalidArgument,
                       before, "PrepareStep(too many entries)");
        break;
      }
      case 9: {  // past max_pages_per_seq
        if (seqs_.empty()) break;
        const ModelSeq& s = seqs_[Uniform(0, static_cast<int>(seqs_.size()) - 1)];
        const int64_t cap = static_cast<int64_t>(o.max_pages_per_seq) * o.geometry.page_size;
        const int64_t n = cap - static_cast<int64_t>(s.tokens.size()) + 1;
        if (n > o.max_tokens_per_step) break;
        ExpectRejected(
            cache_->PrepareStep({StepEntry{s.id, static_cast<int32_t>(n)}}, stream_).status(),
            absl::StatusCode::kInvalidArgument, before, "PrepareStep(past max_pages_per_seq)");
        break;
      }
      default: {  // bad scales
        ExpectRejected(cache_->UpdateGlobalScales(cache_->num_layers(), 1.0f, 1.0f, stream_),
                       absl::StatusCode::kInvalidArgument, before, "UpdateGlobalScales(bad layer)");
        ExpectRejected(cache_->UpdateGlobalScales(0, std::nanf(""), 1.0f, stream_),
                       absl::StatusCode::kInvalidArgument, before, "UpdateGlobalScales(NaN)");
        ExpectRejected(cache_->UpdateGlobalScales(0, 1.0f, -2.0f, stream_),
                       absl::StatusCode::kInvalidArgument, before, "UpdateGlobalScales(negative)");
        break;
      }
    }
  }

  // Cheap invariants, after every operation.
  void CheckState() {
    const KVCacheStats st = cache_->Stats();
    const std::map<int32_t, int> shares = ModelShares();
    ASSERT_EQ(st.num_sequences, static_cast<int64_t>(seqs_.size()));
    ASSERT_EQ(st.pages_free + st.pages_used, st.pages_total);
    ASSERT_EQ(st.pages_used, static_cast<int64_t>(shares.size()));
    int64_t tokens = 0;
    for (const ModelSeq& s : seqs_) {
      tokens += static_cast<int64_t>(s.tokens.size());
      absl::StatusOr<int64_t> len = cache_->SequenceLength(s.id);
      ASSERT_TRUE(len.ok());
      ASSERT_EQ(*len, static_cast<int64_t>(s.tokens.size()));
      absl::StatusOr<absl::Span<const int32_t>> pages = cache_->SequencePages(s.id);
      ASSERT_TRUE(pages.ok());
      ASSERT_EQ(std::vector<int32_t>(pages->begin(), pages->end()), s.pages)
          << "block table of " << s.id << " differs from the model";
    }
    ASSERT_EQ(st.tokens_stored, tokens);
    int64_t shared = 0;
    for (int64_t p = 0; p < st.pages_total; ++p) {
      const auto it = shares.find(static_cast<int32_t>(p));
      const int want = it == shares.end() ? 0 : it->second;
      ASSERT_EQ(*cache_->PageRefCount(p), want) << "page " << p;
      shared += want > 1;
    }
    ASSERT_EQ(st.pages_shared, shared);
    for (SequenceId id : released_) {
      ASSERT_EQ(cache_->SequenceLength(id).status().code(), absl::StatusCode::kNotFound);
    }
  }

  void CheckAllData() {
    Sync();
    const testing::PoolCopy pools = DownloadPools(*cache_);
    for (const ModelSeq& s : seqs_)
      ASSERT_EQ(CheckSequenceBytes(*cache_, pools, s.id, s.tokens), "");
  }

  KVCache* cache_;
  std::mt19937_64 rng_;
  Stream stream_;
  TokenFactory factory_;
  uint64_t seed_;
  std::optional<CacheAppender> appender_;
  std::optional<CacheDequantizer> dequantizer_;
  std::optional<CacheMaterializer> materializer_;
  std::optional<CacheAttention> decode_, verify_;
  int attention_checks_[2] = {0, 0};
  double worst_ratio_ = 0.0;  // largest ||got - want|| / bound of the attention checks
  std::vector<ModelSeq> seqs_;
  std::vector<SequenceId> released_;
  StepInputs inputs_;
  uint64_t next_token_ = 1;
  int op_ = 0;
  int steps_ok_ = 0, exhausted_ = 0;
  int64_t cows_ = 0;
};

const FuzzConfig kConfigs[] = {
    // Materializable: Dk == Dv, % 64; page_size % 4.
    {"nhd_ps4_d64", 2, 2, 64, 64, 4, Layout::kNHD, 40, Recipe::Standard(), 6, 24, 12, 4.0f, 2.5f},
    // Odd shapes: Dk != Dv, page_size 3, HND, three layers, 4over6.
    {"hnd_ps3_dk32_dv16", 3, 3, 32, 16, 3, Layout::kHND, 36, Recipe::FourOverSix(), 5, 16, 14, 8.0f,
     6.0f},
    // FP8 keys (K8V4), materializable, HND.
    {"hnd_ps4_d64_k8", 2, 2, 64, 64, 4, Layout::kHND, 40, Recipe::Standard(), 6, 24, 12, 1.0f, 2.5f,
     KeyFormat::kFp8},
};

KVCache MakeCache(const FuzzConfig& c, Device device) {
  KVCacheOptions o;
  o.num_layers = c.layers;
  o.geometry.num_kv_heads = c.heads;
  o.geometry.head_dim_k = c.dk;
  o.geometry.head_dim_v = c.dv;
  o.geometry.page_size = c.page_size;
  o.geometry.layout = c.layout;
  o.geometry.num_pages = c.pages;
  o.geometry.key_format = c.key_format;
  o.device = device;
  o.recipe = c.recipe;
  for (int l = 0; l < c.layers; ++l) {
    o.k_global_scales.push_back(c.gk * (1.0f + 0.25f * l));
    o.v_global_scales.push_back(c.gv * (1.0f + 0.5f * l));
  }
  o.max_seqs_per_step = c.max_seqs;
  o.max_tokens_per_step = c.max_tokens;
  o.max_pages_per_seq = c.max_pages_per_seq;
  absl::StatusOr<KVCache> cache = KVCache::Create(o);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return *std::move(cache);
}

class KVCacheFuzz : public ::testing::TestWithParam<int> {};

TEST_P(KVCacheFuzz, CpuRandomOperationsKeepInvariants) {
  const FuzzConfig& c = kConfigs[GetParam()];
  for (uint64_t seed : {1u, 2u}) {
    KVCache cache = MakeCache(c, Device::Cpu());
    const uint64_t run_seed = seed * 7919 + GetParam();
    const int ops = testing::FuzzOps(900);
    Fuzzer f(&cache, run_seed, nullptr);
    f.Run(ops);
    std::cout << c.name << " seed " << run_seed << ": " << ops << " ops; attention checked on " << f.attention_checks(0)
              << " decode and " << f.attention_checks(1) << " verification steps" << std::endl;
    if (HasFailure()) return;
  }
}

TEST_P(KVCacheFuzz, GpuRandomOperationsKeepInvariants) {
  FP4KV_SKIP_WITHOUT_GPU();
  const FuzzConfig& c = kConfigs[GetParam()];
  cudaStream_t stream;
  FP4KV_ASSERT_CUDA(cudaStreamCreate(&stream));
  for (uint64_t seed : {3u, 4u}) {
    KVCache cache = MakeCache(c, Device::Cuda(0));
    const uint64_t run_seed = seed * 7919 + GetParam();
    const int ops = testing::FuzzOps(900);
    Fuzzer f(&cache, run_seed, reinterpret_cast<Stream>(stream));
    f.Run(ops);
    std::cout << c.name << " seed " << run_seed << ": " << ops << " ops; attention checked on " << f.attention_checks(0)
              << " decode and " << f.attention_checks(1) << " verification steps" << std::endl;
    if (HasFailure()) break;
  }
  FP4KV_ASSERT_CUDA(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(Configs, KVCacheFuzz, ::testing::Values(0, 1, 2),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::string(kConfigs[i.param].name);
                         });

}  // namespace
}  // namespace fp4kv
