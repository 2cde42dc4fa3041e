// The transfer protocol on a GPU: the loopback transport on device memory,
// the NCCL transport's send/recv to self on a 1-rank communicator (one GPU),
// and two ranks on two GPUs (skipped with fewer). Each runs the protocol
// against the scripted image cache on the device and compares the images
// byte for byte; the KVCache round trips live in gpu_kv_transfer_test.
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fp4kv/transfer.h"
#include "gtest/gtest.h"
#include "src/transfer/transfer_internal.h"
#include "testing/fake_image_cache.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::FakeImageCache;

#define FP4KV_SKIP_WITHOUT_NCCL()                                  \
  do {                                                             \
    std::string why_;                                              \
    if (!NcclAvailable(&why_)) GTEST_SKIP() << "needs NCCL: " << why_; \
  } while (0)

TransferOptions Opts(int64_t slot_bytes, int slots, Stream cache_stream) {
  TransferOptions o;
  o.slot_bytes = slot_bytes;
  o.num_slots = slots;
  o.cache_stream = cache_stream;
  o.timeout_ms = 20000;
  return o;
}

// Sends `lengths` from a fake device cache to another over (a, b) and checks
// every image arrives byte for byte, in order, with nothing left reserved.
void RoundTrip(Transport* a, Transport* b, Device device, const std::vector<int64_t>& lengths,
               int slots) {
  cudaStream_t cs = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  FakeImageCache src(device, 100000, 40), dst(device, 100000, 40);
  std::vector<SequenceId> seqs;
  int64_t biggest = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    seqs.push_back(src.Add(lengths[i], 1000 + i));
    biggest = std::max(biggest, src.ImageBytes(lengths[i]));
  }
  auto s = internal::CreateSender(src.Port(), a, Opts(biggest, slots, cs));
  auto r = internal::CreateReceiver(dst.Port(), b, Opts(biggest, slots, cs));
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(r.ok()) << r.status();
  for (SequenceId q : seqs) ASSERT_TRUE(s->Send(q).ok());
  std::vector<TransferResult> sent, received;
  for (int i = 0; i < 10000000 && s->in_flight() > 0; ++i) {
    ASSERT_TRUE(s->Progress().ok());
    ASSERT_TRUE(r->Progress().ok());
  }
  sent = s->TakeResults();
  received = r->TakeResults();
  FP4KV_ASSERT_CUDA(cudaStreamSynchronize(cs));
  ASSERT_EQ(sent.size(), seqs.size());
  ASSERT_EQ(received.size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(sent[i].state, TransferState::kConfirmed) << sent[i].status;
    ASSERT_EQ(received[i].state, TransferState::kConfirmed) << received[i].status;
    EXPECT_EQ(received[i].id, sent[i].id);
    std::vector<uint8_t> want = src.Image(seqs[i]);
    ASSERT_FALSE(want.empty());
    EXPECT_EQ(dst.Image(received[i].seq), want) << "sequence " << i;
  }
  EXPECT_EQ(dst.reservations(), 0);
  cudaStreamDestroy(cs);
}

TEST(GpuTransferTest, LoopbackOnDeviceMemoryIsByteExact) {
  FP4KV_SKIP_WITHOUT_GPU();
  auto pair = LoopbackTransport::CreatePair(Device::Cuda(0));
  ASSERT_TRUE(pair.ok()) << pair.status();
  RoundTrip(pair->first.get(), pair->second.get(), Device::Cuda(0),
            {1, 33, 4096, 17, 700, 2048, 5, 1500, 3000}, 3);
}

TEST(GpuTransferTest, SlotsBeyondTheDeviceAreResourceExhaustedAndAllocateNothing) {
  FP4KV_SKIP_WITHOUT_GPU();
  auto pair = LoopbackTransport::CreatePair(Device::Cuda(0));
  ASSERT_TRUE(pair.ok()) << pair.status();
  FakeImageCache cache(Device::Cuda(0), 100);
  size_t free_before = 0, free_after = 0, total = 0;
  FP4KV_ASSERT_CUDA(cudaMemGetInfo(&free_before, &total));
  // 2x the device's memory in two slots, and a slot count whose bytes
  // overflow int64.
  const int64_t over = static_cast<int64_t>(total);
  for (const auto& [slot_bytes, slots] :
       {std::pair<int64_t, int>{over, 2}, std::pair<int64_t, int>{INT64_MAX / 64, 256}}) {
    auto s = internal::CreateSender(cache.Port(), pair->first.get(), Opts(slot_bytes, slots, 0));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
    EXPECT_NE(s.status().message().find("SequenceSender::Create"), std::string::npos);
    auto r = internal::CreateReceiver(cache.Port(), pair->second.get(), Opts(slot_bytes, slots, 0));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
    EXPECT_NE(r.status().message().find("SequenceReceiver::Create"), std::string::npos);
  }
  FP4KV_ASSERT_CUDA(cudaMemGetInfo(&free_after, &total));
  EXPECT_EQ(free_after, free_before);
}

TEST(GpuTransferTest, LoopbackFaultsOnDeviceLeaveBothCachesUnchanged) {
  FP4KV_SKIP_WITHOUT_GPU();
  auto pair = LoopbackTransport::CreatePair(Device::Cuda(0));
  ASSERT_TRUE(pair.ok()) << pair.status();
  cudaStream_t cs = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  FakeImageCache src(Device::Cuda(0), 1000), dst(Device::Cuda(0), 1000);
  SequenceId a = src.Add(100, 1), b = src.Add(200, 2);
  // Sender messages: hello, offers 0, 1, 2 (the plan), then a's payload.
  pair->first->InjectFault(4, {LoopbackFault::Kind::kFail});
  const auto src_before = src.Snap(), dst_before = dst.Snap();
  auto s = internal::CreateSender(src.Port(), pair->first.get(), Opts(1 << 16, 4, cs));
  auto r = internal::CreateReceiver(dst.Port(), pair->second.get(), Opts(1 << 16, 4, cs));
  ASSERT_TRUE(s.ok() && r.ok());
  ASSERT_TRUE(s->Send(a).ok());
  ASSERT_TRUE(s->Send(b).ok());
  absl::Status ss, rs;
  for (int i = 0; i < 100000 && (ss.ok() || rs.ok()); ++i) {
    ss = s->Progress();
    rs = r->Progress();
  }
  EXPECT_EQ(ss.code(), absl::StatusCode::kUnavailable) << ss;
  for (const TransferResult& t : s->TakeResults()) EXPECT_EQ(t.state, TransferState::kFailed);
  FP4KV_ASSERT_CUDA(cudaStreamSynchronize(cs));
  EXPECT_EQ(FakeImageCache::Diff(src_before, src.Snap()), "");
  EXPECT_EQ(FakeImageCache::Diff(dst_before, dst.Snap()), "");
  cudaStreamDestroy(cs);
}

struct SelfNccl {
  std::unique_ptr<NcclCommunicator> comm;
  std::unique_ptr<Transport> a, b;
};

SelfNccl MakeSelf() {
  SelfNccl n;
  auto id = NcclCreateUniqueId();
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return n;
  auto comm = NcclCommunicator::Create(*id, 1, 0, Device::Cuda(0));
  EXPECT_TRUE(comm.ok()) << comm.status();
  if (!comm.ok()) return n;
  n.comm = std::move(*comm);
  auto pair = n.comm->SelfPair();
  EXPECT_TRUE(pair.ok()) << pair.status();
  if (!pair.ok()) return n;
  n.a = std::move(pair->first);
  n.b = std::move(pair->second);
  return n;
}

TEST(GpuNcclTransportTest, SelfSendRecvMovesDeviceAndControlBytes) {
  FP4KV_SKIP_WITHOUT_GPU();
  FP4KV_SKIP_WITHOUT_NCCL();
  SelfNccl n = MakeSelf();
  ASSERT_NE(n.a, nullptr);
  const int64_t bytes = (3 << 20) + 17;
  std::vector<uint8_t> host = testing::RandomBytes(bytes, 5);
  testing::DeviceBuffer src(bytes), dst(bytes);
  ASSERT_TRUE(src.ok() && dst.ok());
  FP4KV_ASSERT_CUDA(cudaMemcpy(src.get(), host.data(), bytes, cudaMemcpyHostToDevice));
  FP4KV_ASSERT_CUDA(cudaMemset(dst.get(), testing::kPoison, bytes));
  // A control message each way, then the data, posted in mirrored order;
  // the receive is posted first: nothing is issued until its send exists.
  char* hello = nullptr;
  char* got = nullptr;
  FP4KV_ASSERT_CUDA(cudaMallocHost(reinterpret_cast<void**>(&hello), 64));
  FP4KV_ASSERT_CUDA(cudaMallocHost(reinterpret_cast<void**>(&got), 64));
  std::memset(got, 0, 64);
  std::snprintf(hello, 32, "control bytes through NCCL");
  std::snprintf(hello + 32, 16, "second message");
  auto rc = n.b->RecvControl(got, 64);
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_FALSE(*n.b->Poll(*rc));
  ASSERT_TRUE(n.a->SendControl(hello, 64).ok());
  ASSERT_TRUE(n.b->Recv(dst.get(), bytes).ok());
  auto sd = n.a->Send(src.get(), bytes);
  ASSERT_TRUE(sd.ok()) << sd.status();
  auto rd = n.b->RecvControl(got + 32, 16);  // and a control message after the data
  ASSERT_TRUE(n.a->SendControl(hello + 32, 16).ok());
  ASSERT_TRUE(rd.ok());
  while (true) {
    auto done = n.b->Poll(*rd);
    ASSERT_TRUE(done.ok()) << done.status();
    if (*done) break;
  }
  while (!*n.a->Poll(*sd)) {
  }
  EXPECT_STREQ(got, hello);
  EXPECT_STREQ(got + 32, hello + 32);
  std::vector<uint8_t> back(bytes);
  FP4KV_ASSERT_CUDA(cudaMemcpy(back.data(), dst.get(), bytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(back, host);
  cudaFreeHost(hello);
  cudaFreeHost(got);
}

TEST(GpuNcclTransportTest, SelfPairRefusesUnmirroredSequences) {
  FP4KV_SKIP_WITHOUT_GPU();
  FP4KV_SKIP_WITHOUT_NCCL();
  SelfNccl n = MakeSelf();
  ASSERT_NE(n.a, nullptr);
  testing::DeviceBuffer buf(256);
  ASSERT_TRUE(n.a->Send(buf.get(), 256).ok());
  EXPECT_EQ(n.b->Send(buf.get(), 256).status().code(), absl::StatusCode::kInternal);
}

TEST(GpuNcclTransportTest, ProtocolOverSelfSendRecvIsByteExact) {
  FP4KV_SKIP_WITHOUT_GPU();
  FP4KV_SKIP_WITHOUT_NCCL();
  SelfNccl n = MakeSelf();
  ASSERT_NE(n.a, nullptr);
  RoundTrip(n.a.get(), n.b.get(), Device::Cuda(0), {4096, 1, 2049, 8191, 16, 300, 1024}, 4);
}

TEST(GpuNcclTransportTest, TwoGpusTwoRanksAreByteExact) {
  FP4KV_SKIP_WITHOUT_GPU();
  FP4KV_SKIP_WITHOUT_NCCL();
  int count = 0;
  FP4KV_ASSERT_CUDA(cudaGetDeviceCount(&count));
  if (count < 2) GTEST_SKIP() << "needs 2 GPUs, " << count << " visible";
  auto id = NcclCreateUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  // One rank per GPU, each on its own thread (ncclCommInitRank blocks
  // until both joined); the protocol then runs rank 0 -> rank 1.
  std::unique_ptr<NcclCommunicator> comms[2];
  absl::Status init[2];
  std::thread t1([&] {
    auto c = NcclCommunicator::Create(*id, 2, 1, Device::Cuda(1));
    init[1] = c.status();
    if (c.ok()) comms[1] = std::move(*c);
  });
  {
    auto c = NcclCommunicator::Create(*id, 2, 0, Device::Cuda(0));
    init[0] = c.status();
    if (c.ok()) comms[0] = std::move(*c);
  }
  t1.join();
  ASSERT_TRUE(init[0].ok()) << init[0];
  ASSERT_TRUE(init[1].ok()) << init[1];
  auto e0 = comms[0]->Connect(1);
  auto e1 = comms[1]->Connect(0);
  ASSERT_TRUE(e0.ok() && e1.ok());
  cudaStream_t s0 = nullptr, s1 = nullptr;
  FP4KV_ASSERT_CUDA(cudaSetDevice(0));
  FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  FP4KV_ASSERT_CUDA(cudaSetDevice(1));
  FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  FP4KV_ASSERT_CUDA(cudaSetDevice(0));
  FakeImageCache src(Device::Cuda(0), 100000);
  std::vector<SequenceId> seqs;
  for (int64_t len : {2048, 4096, 1, 333}) seqs.push_back(src.Add(len, len));
  const int64_t slot = src.ImageBytes(4096);
  FP4KV_ASSERT_CUDA(cudaSetDevice(1));
  FakeImageCache dst(Device::Cuda(1), 100000);
  FP4KV_ASSERT_CUDA(cudaSetDevice(0));
  auto s = internal::CreateSender(src.Port(), e0->get(), Opts(slot, 2, s0));
  auto r = internal::CreateReceiver(dst.Port(), e1->get(), Opts(slot, 2, s1));
  ASSERT_TRUE(s.ok() && r.ok());
  for (SequenceId q : seqs) ASSERT_TRUE(s->Send(q).ok());
  // One thread per rank, as two processes would be (NCCL sets up a
  // peer connection with both sides taking part).
  absl::Status rs;
  std::thread receiver([&] {
    cudaSetDevice(1);
    rs = r->RunUntilResults(static_cast<int64_t>(seqs.size()));
  });
  absl::Status ss = s->RunUntilIdle();
  receiver.join();
  ASSERT_TRUE(ss.ok()) << ss;
  ASSERT_TRUE(rs.ok()) << rs;
  auto sent = s->TakeResults();
  auto received = r->TakeResults();
  ASSERT_EQ(received.size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(sent[i].state, TransferState::kConfirmed);
    FP4KV_ASSERT_CUDA(cudaSetDevice(0));
    std::vector<uint8_t> want = src.Image(seqs[i]);
    FP4KV_ASSERT_CUDA(cudaSetDevice(1));
    EXPECT_EQ(dst.Image(received[i].seq), want);
  }
  FP4KV_ASSERT_CUDA(cudaSetDevice(0));
  ASSERT_TRUE(s->Close().ok());
}

}  // namespace
}  // namespace fp4kv
