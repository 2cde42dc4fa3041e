// SequenceSender / SequenceReceiver between two real KVCaches: sequences
// filled by appends arrive with every stored byte and every dequantized K/V
// row equal; a refusal (out of pages, another geometry) or a cancellation
// leaves both caches exactly as they were (snapshots); release only after
// the confirmation. Runs on the CPU device over the loopback transport and,
// named Gpu..., on a GPU over the device loopback and over NCCL send/recv to
// self (skipped without a GPU or NCCL).
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fp4kv/kv_cache.h"
#include "fp4kv/transfer.h"
#include "gtest/gtest.h"
#include "testing/kv_cache_harness.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::DiffSnapshots;
using testing::TakeSnapshot;
using testing::Token;

enum class Path { kCpu, kGpuLoopback, kGpuNcclSelf };

KVCacheOptions Options(Device device, int64_t pages, int heads = 2) {
  KVCacheOptions o;
  o.num_layers = 3;
  o.geometry.num_kv_heads = heads;
  o.geometry.head_dim_k = 64;
  o.geometry.head_dim_v = 32;
  o.geometry.page_size = 16;
  o.geometry.layout = Layout::kNHD;
  o.geometry.num_pages = pages;
  o.device = device;
  for (int l = 0; l < o.num_layers; ++l) {
    o.k_global_scales.push_back(0.5f + l);
    o.v_global_scales.push_back(0.25f + l);
  }
  o.max_seqs_per_step = 4;
  o.max_tokens_per_step = 64;
  o.max_pages_per_seq = 8;
  return o;
}

// Appends random tokens and remembers them.
class Writer {
 public:
  Writer(KVCache* cache, Stream stream) : cache_(cache), stream_(stream), factory_(*cache) {
    absl::StatusOr<CacheAppender> a = cache->appender();
    EXPECT_TRUE(a.ok()) << a.status();
    if (a.ok()) appender_.emplace(*a);
  }
  SequenceId Add(int n) {
    const SequenceId id = cache_->CreateSequence().value();
    absl::StatusOr<StepInfo> info = cache_->PrepareStep({{id, n}}, stream_);
    EXPECT_TRUE(info.ok()) << info.status();
    std::vector<Token> toks;
    for (int i = 0; i < n; ++i) toks.push_back(factory_.Make(next_++));
    tokens_[id] = toks;
    absl::Status s = testing::FillStepInputs(*cache_, toks, &inputs_, stream_);
    if (s.ok()) s = testing::RunAppendAllLayers(*cache_, *appender_, &inputs_, stream_);
    EXPECT_TRUE(s.ok()) << s;
    return id;
  }
  const std::vector<Token>& tokens(SequenceId id) { return tokens_[id]; }

 private:
  KVCache* cache_;
  Stream stream_;
  testing::TokenFactory factory_;
  std::optional<CacheAppender> appender_;
  std::map<SequenceId, std::vector<Token>> tokens_;
  testing::StepInputs inputs_;
  uint64_t next_ = 77;
};

class KVCacheTransferTest : public ::testing::TestWithParam<Path> {
 protected:
  void SetUp() override {
    if (GetParam() != Path::kCpu) {
      FP4KV_SKIP_WITHOUT_GPU();
      device_ = Device::Cuda(0);
      ASSERT_EQ(cudaStreamCreateWithFlags(&cs_, cudaStreamNonBlocking), cudaSuccess);
    }
    if (GetParam() == Path::kGpuNcclSelf) {
      std::string why;
      if (!NcclAvailable(&why)) GTEST_SKIP() << "needs NCCL: " << why;
      auto id = NcclCreateUniqueId();
      ASSERT_TRUE(id.ok()) << id.status();
      auto comm = NcclCommunicator::Create(*id, 1, 0, device_);
      ASSERT_TRUE(comm.ok()) << comm.status();
      comm_ = std::move(*comm);
      auto pair = comm_->SelfPair();
      ASSERT_TRUE(pair.ok()) << pair.status();
      a_ = std::move(pair->first);
      b_ = std::move(pair->second);
    } else {
      auto pair = LoopbackTransport::CreatePair(device_);
      ASSERT_TRUE(pair.ok()) << pair.status();
      a_ = std::move(pair->first);
      b_ = std::move(pair->second);
    }
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
    comm_.reset();
    if (cs_ != nullptr) (void)cudaStreamDestroy(cs_);
  }
  Stream stream() const { return cs_; }
  void Sync() {
    if (cs_ != nullptr) {
      ASSERT_EQ(cudaStreamSynchronize(cs_), cudaSuccess);
    }
  }
  KVCache Make(int64_t pages, int heads = 2) {
    absl::StatusOr<KVCache> c = KVCache::Create(Options(device_, pages, heads));
    EXPECT_TRUE(c.ok()) << c.status();
    return *std::move(c);
  }
  TransferOptions Opts(int64_t slot_bytes) const {
    TransferOptions o;
    o.slot_bytes = slot_bytes;
    o.num_slots = 2;
    o.cache_stream = cs_;
    o.timeout_ms = 20000;
    return o;
  }
  // Runs both sides until the sender has nothing in flight.
  void Pump(SequenceSender& s, SequenceReceiver& r) {
    for (int i = 0; i < 10000000 && s.in_flight() > 0; ++i) {
      ASSERT_TRUE(s.Progress().ok());
      ASSERT_TRUE(r.Progress().ok());
    }
    Sync();
  }
  // Layer l's dequantized K and V rows of `seq` (bf16 bytes).
  std::vector<uint8_t> Dequantized(const KVCache& c, SequenceId seq) {
    const int64_t len = *c.SequenceLength(seq);
    const CacheGeometry& g = c.geometry();
    std::vector<uint8_t> out;
    for (int l = 0; l < c.num_layers(); ++l) {
      const size_t kb = static_cast<size_t>(len * g.num_kv_heads * g.head_dim_k * 2);
      const size_t vb = static_cast<size_t>(len * g.num_kv_heads * g.head_dim_v * 2);
      testing::Buffer k(device_, kb), v(device_, vb);
      EXPECT_TRUE(k.Fill(testing::kPoison) && v.Fill(testing::kPoison));
      absl::Status s = c.ReadSequence(l, seq,
                                      k.View(DType::kBF16, {len, g.num_kv_heads, g.head_dim_k}),
                                      v.View(DType::kBF16, {len, g.num_kv_heads, g.head_dim_v}),
                                      stream());
      EXPECT_TRUE(s.ok()) << s;
      Sync();
      std::vector<uint8_t> hk(kb), hv(vb);
      EXPECT_TRUE(k.Download(hk.data(), kb) && v.Download(hv.data(), vb));
      out.insert(out.end(), hk.begin(), hk.end());
      out.insert(out.end(), hv.begin(), hv.end());
    }
    return out;
  }

  Device device_ = Device::Cpu();
  cudaStream_t cs_ = nullptr;
  std::unique_ptr<NcclCommunicator> comm_;
  std::unique_ptr<Transport> a_, b_;
};

TEST_P(KVCacheTransferTest, SequencesArriveWithEqualBytesAndDequantizedRows) {
  KVCache src = Make(64), dst = Make(64);
  Writer w(&src, stream());
  std::vector<SequenceId> seqs;
  for (int n : {1, 16, 17, 40, 63}) seqs.push_back(w.Add(n));
  Sync();
  const testing::Snapshot src_before = TakeSnapshot(src);
  int64_t slot = 0;
  for (SequenceId s : seqs) slot = std::max(slot, *src.ExportedBytes(s));
  auto sender = SequenceSender::Create(&src, a_.get(), Opts(slot));
  auto receiver = SequenceReceiver::Create(&dst, b_.get(), Opts(slot));
  ASSERT_TRUE(sender.ok()) << sender.status();
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  for (SequenceId s : seqs) ASSERT_TRUE(sender->Send(s).ok());
  Pump(*sender, *receiver);
  std::vector<TransferResult> sent = sender->TakeResults(), got = receiver->TakeResults();
  ASSERT_EQ(got.size(), seqs.size());
  const testing::PoolCopy pools = testing::DownloadPools(dst);
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(sent[i].state, TransferState::kConfirmed) << sent[i].status;
    ASSERT_EQ(got[i].state, TransferState::kConfirmed) << got[i].status;
    EXPECT_EQ(*dst.SequenceLength(got[i].seq), *src.SequenceLength(seqs[i]));
    EXPECT_EQ(testing::CheckSequenceBytes(dst, pools, got[i].seq, w.tokens(seqs[i])), "");
    EXPECT_EQ(Dequantized(dst, got[i].seq), Dequantized(src, seqs[i])) << "sequence " << i;
  }
  EXPECT_EQ(DiffSnapshots(src_before, TakeSnapshot(src)), "");
  EXPECT_TRUE(src.CheckInvariants().ok());
  EXPECT_TRUE(dst.CheckInvariants().ok());
  EXPECT_EQ(dst.Stats().reservations, 0);
}

TEST_P(KVCacheTransferTest, OutOfPagesIsRefusedAndBothCachesAreUnchanged) {
  KVCache src = Make(64), dst = Make(3);
  Writer w(&src, stream());
  SequenceId big = w.Add(63);  // 4 pages; the receiver has 3
  Sync();
  const testing::Snapshot src_before = TakeSnapshot(src), dst_before = TakeSnapshot(dst);
  const int64_t slot = *src.ExportedBytes(big);
  auto sender = SequenceSender::Create(&src, a_.get(), Opts(slot));
  auto receiver = SequenceReceiver::Create(&dst, b_.get(), Opts(slot));
  ASSERT_TRUE(sender.ok() && receiver.ok());
  ASSERT_TRUE(sender->Send(big).ok());
  Pump(*sender, *receiver);
  std::vector<TransferResult> sent = sender->TakeResults();
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].state, TransferState::kRefused);
  EXPECT_EQ(sent[0].status.code(), absl::StatusCode::kResourceExhausted) << sent[0].status;
  EXPECT_EQ(DiffSnapshots(src_before, TakeSnapshot(src)), "");
  EXPECT_EQ(DiffSnapshots(dst_before, TakeSnapshot(dst)), "");
  EXPECT_TRUE(dst.CheckInvariants().ok());
}

TEST_P(KVCacheTransferTest, AnotherGeometryIsRefusedByName) {
  KVCache src = Make(64), dst = Make(64, /*heads=*/4);
  Writer w(&src, stream());
  SequenceId s = w.Add(20);
  Sync();
  const testing::Snapshot dst_before = TakeSnapshot(dst);
  const int64_t slot = *src.ExportedBytes(s);
  auto sender = SequenceSender::Create(&src, a_.get(), Opts(slot));
  auto receiver = SequenceReceiver::Create(&dst, b_.get(), Opts(slot));
  ASSERT_TRUE(sender.ok() && receiver.ok());
  ASSERT_TRUE(sender->Send(s).ok());
  Pump(*sender, *receiver);
  std::vector<TransferResult> sent = sender->TakeResults();
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].state, TransferState::kRefused);
  EXPECT_EQ(sent[0].status.code(), absl::StatusCode::kInvalidArgument) << sent[0].status;
  EXPECT_NE(sent[0].status.message().find("head"), absl::string_view::npos) << sent[0].status;
  EXPECT_EQ(DiffSnapshots(dst_before, TakeSnapshot(dst)), "");
  EXPECT_TRUE(*src.SequenceLength(s) == 20);
}

TEST_P(KVCacheTransferTest, CancelledOfferReleasesTheReservation) {
  KVCache src = Make(64), dst = Make(64);
  Writer w(&src, stream());
  SequenceId s = w.Add(33);
  Sync();
  const testing::Snapshot src_before = TakeSnapshot(src), dst_before = TakeSnapshot(dst);
  const int64_t slot = *src.ExportedBytes(s);
  auto sender = SequenceSender::Create(&src, a_.get(), Opts(slot));
  auto receiver = SequenceReceiver::Create(&dst, b_.get(), Opts(slot));
  ASSERT_TRUE(sender.ok() && receiver.ok());
  auto id = sender->Send(s);
  ASSERT_TRUE(id.ok());
  // Until the receiver holds the reservation.
  for (int i = 0; i < 1000000 && receiver->in_flight() == 0; ++i) {
    ASSERT_TRUE(sender->Progress().ok());
    ASSERT_TRUE(receiver->Progress().ok());
  }
  ASSERT_EQ(receiver->in_flight(), 1);
  EXPECT_EQ(dst.Stats().reservations, 1);
  ASSERT_TRUE(receiver->Cancel(*id).ok());
  Pump(*sender, *receiver);
  std::vector<TransferResult> sent = sender->TakeResults();
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].state, TransferState::kCancelled) << sent[0].status;
  EXPECT_EQ(DiffSnapshots(src_before, TakeSnapshot(src)), "");
  EXPECT_EQ(DiffSnapshots(dst_before, TakeSnapshot(dst)), "");
  EXPECT_TRUE(dst.CheckInvariants().ok());
}

TEST_P(KVCacheTransferTest, ReleaseOnConfirmFreesTheSendersPagesOnlyAfterTheAck) {
  KVCache src = Make(64), dst = Make(64);
  Writer w(&src, stream());
  SequenceId s = w.Add(50);
  Sync();
  const std::vector<uint8_t> before = Dequantized(src, s);
  TransferOptions o = Opts(*src.ExportedBytes(s));
  o.release_on_confirm = true;
  auto sender = SequenceSender::Create(&src, a_.get(), o);
  auto receiver = SequenceReceiver::Create(&dst, b_.get(), o);
  ASSERT_TRUE(sender.ok() && receiver.ok());
  ASSERT_TRUE(sender->Send(s).ok());
  for (int i = 0; i < 10000000 && sender->in_flight() > 0; ++i) {
    EXPECT_EQ(src.Stats().num_sequences, 1);  // still held while not confirmed
    ASSERT_TRUE(sender->Progress().ok());
    ASSERT_TRUE(receiver->Progress().ok());
  }
  Sync();
  EXPECT_EQ(src.Stats().num_sequences, 0);
  EXPECT_EQ(src.Stats().pages_used, 0);
  std::vector<TransferResult> got = receiver->TakeResults();
  ASSERT_EQ(got.size(), 1u);
  ASSERT_EQ(got[0].state, TransferState::kConfirmed);
  EXPECT_EQ(Dequantized(dst, got[0].seq), before);
  EXPECT_TRUE(src.CheckInvariants().ok());
  EXPECT_TRUE(dst.CheckInvariants().ok());
}

// Many sequences through every pipeline depth, the caches' pages reused as
// sequences come and go: each arrives with its stored bytes and dequantized
// rows equal, in send order, and nothing is left reserved.
TEST_P(KVCacheTransferTest, ManySequencesThroughEveryPipelineDepthAreExact) {
  for (int depth : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "pipeline_depth " << depth);
    KVCache src = Make(128), dst = Make(128);
    Writer w(&src, stream());
    std::vector<SequenceId> seqs;
    for (int i = 0; i < 11; ++i) seqs.push_back(w.Add(1 + (i * 23 + depth * 5) % 70));
    Sync();
    const testing::Snapshot src_before = TakeSnapshot(src);
    int64_t slot = 0;
    for (SequenceId s : seqs) slot = std::max(slot, *src.ExportedBytes(s));
    TransferOptions o = Opts(slot);
    o.num_slots = 3;
    o.pipeline_depth = depth;
    auto sender = SequenceSender::Create(&src, a_.get(), o);
    auto receiver = SequenceReceiver::Create(&dst, b_.get(), o);
    ASSERT_TRUE(sender.ok()) << sender.status();
    ASSERT_TRUE(receiver.ok()) << receiver.status();
    for (SequenceId s : seqs) ASSERT_TRUE(sender->Send(s).ok());
    Pump(*sender, *receiver);
    std::vector<TransferResult> sent = sender->TakeResults(), got = receiver->TakeResults();
    ASSERT_EQ(sent.size(), seqs.size());
    ASSERT_EQ(got.size(), seqs.size());
    const testing::PoolCopy pools = testing::DownloadPools(dst);
    for (size_t i = 0; i < seqs.size(); ++i) {
      EXPECT_EQ(sent[i].seq, seqs[i]);
      EXPECT_EQ(sent[i].state, TransferState::kConfirmed) << sent[i].status;
      EXPECT_EQ(got[i].id, sent[i].id);
      ASSERT_EQ(got[i].state, TransferState::kConfirmed) << got[i].status;
      EXPECT_EQ(testing::CheckSequenceBytes(dst, pools, got[i].seq, w.tokens(seqs[i])), "");
      EXPECT_EQ(Dequantized(dst, got[i].seq), Dequantized(src, seqs[i])) << "sequence " << i;
    }
    EXPECT_EQ(DiffSnapshots(src_before, TakeSnapshot(src)), "");
    EXPECT_TRUE(src.CheckInvariants().ok());
    EXPECT_TRUE(dst.CheckInvariants().ok());
    EXPECT_EQ(dst.Stats().reservations, 0);
    // End the link so the next depth starts a fresh pair on the same
    // endpoints.
    ASSERT_TRUE(sender->Close().ok());
    for (int i = 0; i < 10000000 && !receiver->closed(); ++i) {
      ASSERT_TRUE(receiver->Progress().ok());
    }
    EXPECT_TRUE(receiver->closed());
  }
}

INSTANTIATE_TEST_SUITE_P(, KVCacheTransferTest,
                         ::testing::Values(Path::kCpu, Path::kGpuLoopback, Path::kGpuNcclSelf),
                         [](const ::testing::TestParamInfo<Path>& p) {
                           return p.param == Path::kCpu           ? std::string("Cpu")
                                  : p.param == Path::kGpuLoopback ? std::string("GpuLoopback")
                                                                  : std::string("GpuNcclSelf");
                         });

}  // namespace
}  // namespace fp4kv
