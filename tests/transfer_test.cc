// The transfer protocol on the CPU: framing, ordering and failure handling
// over the loopback transport, between scripted image caches
// (testing/fake_image_cache.h: images, reservations and every fault on
// demand), byte-exact for the images they hold. No KVCache is involved
// here; tests/kv_cache_transfer_test.cc moves sequences between real
// KVCaches.
#include "fp4kv/transfer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/host_alloc.h"
#include "src/transfer/transfer_internal.h"
#include "testing/fake_image_cache.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FP4KV_TRANSFER_TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(FP4KV_TRANSFER_TEST_ASAN)
// From <sanitizer/allocator_interface.h> (not installed with every compiler).
extern "C" size_t __sanitizer_get_current_allocated_bytes();
#else
#include <malloc.h>
#endif

namespace fp4kv {
namespace {

using testing::FakeImageCache;
using Kind = LoopbackFault::Kind;

struct Link {
  std::unique_ptr<LoopbackTransport> a, b;  // a: sender side, b: receiver side
};

Link MakeLink(Device device = Device::Cpu()) {
  auto pair = LoopbackTransport::CreatePair(device);
  EXPECT_TRUE(pair.ok()) << pair.status();
  return Link{std::move(pair->first), std::move(pair->second)};
}

TransferOptions Opts(int64_t slot_bytes, int slots = 4) {
  TransferOptions o;
  o.slot_bytes = slot_bytes;
  o.num_slots = slots;
  o.timeout_ms = 2000;
  return o;
}

// A sender and a receiver on two fake caches over one loopback link.
struct Pair {
  FakeImageCache src{Device::Cpu(), 1000};
  FakeImageCache dst;
  Link link;
  std::unique_ptr<SequenceSender> sender;
  std::unique_ptr<SequenceReceiver> receiver;
  std::vector<TransferResult> sent, received;

  explicit Pair(int64_t dst_pages = 1000, TransferOptions o = Opts(1 << 16),
                int64_t dst_tag = 7)
      : dst(Device::Cpu(), dst_pages, 40, dst_tag), link(MakeLink()) {
    auto s = internal::CreateSender(src.Port(), link.a.get(), o);
    auto r = internal::CreateReceiver(dst.Port(), link.b.get(), o);
    EXPECT_TRUE(s.ok()) << s.status();
    EXPECT_TRUE(r.ok()) << r.status();
    sender = std::make_unique<SequenceSender>(std::move(*s));
    receiver = std::make_unique<SequenceReceiver>(std::move(*r));
  }
  // Both sides' Progress until the sender has nothing in flight.
  void Pump(int max_iters = 10000) {
    for (int i = 0; i < max_iters; ++i) {
      absl::Status a = sender->Progress();
      absl::Status b = receiver->Progress();
      Collect();
      if (!a.ok() || (sender->in_flight() == 0 && receiver->in_flight() == 0)) break;
      (void)b;
    }
    Collect();
  }
  void Collect() {
    for (auto& r : sender->TakeResults()) sent.push_back(r);
    for (auto& r : receiver->TakeResults()) received.push_back(r);
  }
};

// Results come in the order transfers finished (refusals before the
// confirmations of the same round); by id for checks.
void SortById(std::vector<TransferResult>& v) {
  std::sort(v.begin(), v.end(),
            [](const TransferResult& a, const TransferResult& b) { return a.id < b.id; });
}

TEST(TransferFrameTest, SealedFramesCheckAndDamagedOnesAreDataLoss) {
  std::vector<unsigned char> f(internal::FrameBytes(3, 256), 0);
  auto* h = reinterpret_cast<internal::FrameHead*>(f.data());
  *h = internal::FrameHead();
  h->kind = static_cast<uint16_t>(internal::FrameKind::kOffer);
  h->frame_bytes = static_cast<uint32_t>(f.size());
  h->round = 5;
  h->count = 2;
  f[200] = 0x42;
  internal::SealFrame(f.data(), f.size());
  const int64_t n = static_cast<int64_t>(f.size());
  EXPECT_TRUE(internal::CheckFrame(f.data(), n, internal::FrameKind::kOffer, 5, 3).ok());
  // Wrong expectations.
  EXPECT_EQ(internal::CheckFrame(f.data(), n, internal::FrameKind::kReply, 5, 3).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(internal::CheckFrame(f.data(), n, internal::FrameKind::kOffer, 6, 3).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(internal::CheckFrame(f.data(), n, internal::FrameKind::kOffer, 5, 1).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(internal::CheckFrame(f.data(), n - 1, internal::FrameKind::kOffer, 5, 3).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(internal::CheckFrame(f.data(), 10, internal::FrameKind::kOffer, 5, 3).code(),
            absl::StatusCode::kDataLoss);
  // Any flipped byte, header or body, is caught.
  for (size_t i : {size_t{0}, size_t{4}, size_t{9}, size_t{20}, size_t{200}, f.size() - 1}) {
    std::vector<unsigned char> g = f;
    g[i] ^= 0x10;
    EXPECT_EQ(internal::CheckFrame(g.data(), n, internal::FrameKind::kOffer, 5, 3).code(),
              absl::StatusCode::kDataLoss)
        << "byte " << i;
  }
  // Another version.
  std::vector<unsigned char> g = f;
  reinterpret_cast<internal::FrameHead*>(g.data())->version = internal::kFrameVersion + 1;
  internal::SealFrame(g.data(), g.size());
  absl::Status s = internal::CheckFrame(g.data(), n, internal::FrameKind::kOffer, 5, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("version"), absl::string_view::npos) << s;
}

TEST(LoopbackTransportTest, PairsKthOperationsAndRefusesUnmirroredOnes) {
  Link l = MakeLink();
  std::vector<uint8_t> src = {1, 2, 3, 4, 5}, dst(5, 0), dst2(3, 0);
  auto r = l.b->Recv(dst.data(), 5);  // posted first: waits for the send
  ASSERT_TRUE(r.ok());
  auto polled = l.b->Poll(*r);
  ASSERT_TRUE(polled.ok());
  EXPECT_FALSE(*polled);
  auto s = l.a->Send(src.data(), 5);
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(*l.b->Poll(*r));
  EXPECT_TRUE(*l.a->Poll(*s));
  EXPECT_EQ(dst, src);
  // Sizes differ: the link breaks on both sides.
  ASSERT_TRUE(l.a->Send(src.data(), 5).ok());
  auto bad = l.b->Recv(dst2.data(), 3);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(l.a->Poll(1).ok());
  // Two sends matching each other.
  Link m = MakeLink();
  ASSERT_TRUE(m.a->Send(src.data(), 5).ok());
  EXPECT_EQ(m.b->Send(src.data(), 5).status().code(), absl::StatusCode::kInternal);
}

TEST(LoopbackTransportTest, FaultsTruncateCorruptDelayAndDrop) {
  Link l = MakeLink();
  std::vector<uint8_t> src(8), dst(8, 0);
  for (int i = 0; i < 8; ++i) src[i] = static_cast<uint8_t>(10 + i);
  l.a->InjectFault(0, {Kind::kTruncate, 3});
  l.a->InjectFault(1, {Kind::kCorrupt, 0, 5});
  l.a->InjectFault(2, {Kind::kDelay, 0, 0, 3});
  l.a->InjectFault(3, {Kind::kDrop});
  ASSERT_TRUE(l.a->Send(src.data(), 8).ok());
  auto r0 = l.b->Recv(dst.data(), 8);
  ASSERT_TRUE(*l.b->Poll(*r0));
  EXPECT_EQ(std::vector<uint8_t>(dst.begin(), dst.begin() + 3),
            std::vector<uint8_t>(src.begin(), src.begin() + 3));
  EXPECT_EQ(dst[3], 0);
  ASSERT_TRUE(l.a->Send(src.data(), 8).ok());
  auto r1 = l.b->Recv(dst.data(), 8);
  ASSERT_TRUE(*l.b->Poll(*r1));
  EXPECT_EQ(dst[5], src[5] ^ 0xFF);
  EXPECT_EQ(dst[4], src[4]);
  ASSERT_TRUE(l.a->Send(src.data(), 8).ok());
  auto r2 = l.b->Recv(dst.data(), 8);
  int polls = 0;
  while (!*l.b->Poll(*r2)) ++polls;
  EXPECT_EQ(polls, 3);
  ASSERT_TRUE(l.a->Send(src.data(), 8).ok());
  auto r3 = l.b->Recv(dst.data(), 8);
  for (int i = 0; i < 10; ++i) EXPECT_FALSE(*l.b->Poll(*r3));
  EXPECT_EQ(l.a->sends_posted(), 4);
}

TEST(TransferTest, RoundTripsAreByteExactAndConfirmedInOrder) {
  Pair p;
  std::vector<SequenceId> seqs;
  for (int64_t len : {1, 17, 300, 5, 64, 1000}) seqs.push_back(p.src.Add(len, 100 + len));
  const FakeImageCache::State before = p.src.Snap();
  std::vector<TransferId> ids;
  for (SequenceId s : seqs) {
    auto id = p.sender->Send(s);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  p.Pump();
  ASSERT_EQ(p.sent.size(), seqs.size());
  ASSERT_EQ(p.received.size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(p.sent[i].id, ids[i]);
    EXPECT_EQ(p.sent[i].state, TransferState::kConfirmed) << p.sent[i].status;
    EXPECT_EQ(p.sent[i].seq, seqs[i]);
    EXPECT_EQ(p.received[i].id, ids[i]);
    ASSERT_EQ(p.received[i].state, TransferState::kConfirmed) << p.received[i].status;
    EXPECT_EQ(p.received[i].length, p.sent[i].length);
    EXPECT_EQ(p.dst.Image(p.received[i].seq), p.src.Image(seqs[i])) << "transfer " << ids[i];
  }
  // The sender kept everything (release_on_confirm is off).
  EXPECT_EQ(FakeImageCache::Diff(before, p.src.Snap()), "");
  EXPECT_EQ(p.dst.reservations(), 0);
}

TEST(TransferTest, ManyInFlightAcrossRoundsInterleavedWithSends) {
  Pair p(1000, Opts(1 << 16, 3));
  std::vector<SequenceId> seqs;
  for (int i = 0; i < 17; ++i) seqs.push_back(p.src.Add(1 + (i * 37) % 200, i));
  size_t next = 0;
  std::vector<TransferId> ids;
  // Send a few, progress a little, send more, ... .
  for (int iter = 0; iter < 100000 && (next < seqs.size() || p.sender->in_flight() > 0); ++iter) {
    if (next < seqs.size() && iter % 3 == 0) {
      auto id = p.sender->Send(seqs[next++]);
      ASSERT_TRUE(id.ok()) << id.status();
      ids.push_back(*id);
    }
    ASSERT_TRUE(p.sender->Progress().ok());
    ASSERT_TRUE(p.receiver->Progress().ok());
    EXPECT_LE(p.receiver->in_flight(), 3);
    p.Collect();
  }
  ASSERT_EQ(p.sent.size(), seqs.size());
  ASSERT_EQ(p.received.size(), seqs.size());
  std::set<SequenceId> made;
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(p.sent[i].id, ids[i]);  // ids and results in send order
    EXPECT_EQ(p.sent[i].state, TransferState::kConfirmed);
    EXPECT_EQ(p.received[i].id, ids[i]);
    EXPECT_EQ(p.dst.Image(p.received[i].seq), p.src.Image(seqs[i]));
    made.insert(p.received[i].seq);
  }
  EXPECT_EQ(made.size(), seqs.size());
}

TEST(TransferTest, ReceiverOutOfPagesNacksAndBothCachesKeepTheirState) {
  // 10 pages on the receiver: the 100-token sequence (7 pages) fits, the
  // next one (7 pages) does not, a 16-token one (1 page) does.
  Pair p(10);
  SequenceId a = p.src.Add(100, 1), b = p.src.Add(100, 2), c = p.src.Add(16, 3);
  const FakeImageCache::State src_before = p.src.Snap();
  for (SequenceId s : {a, b, c}) ASSERT_TRUE(p.sender->Send(s).ok());
  p.Pump();
  SortById(p.sent);
  SortById(p.received);
  ASSERT_EQ(p.sent.size(), 3u);
  EXPECT_EQ(p.sent[0].state, TransferState::kConfirmed);
  EXPECT_EQ(p.sent[1].state, TransferState::kRefused);
  EXPECT_EQ(p.sent[1].status.code(), absl::StatusCode::kResourceExhausted) << p.sent[1].status;
  EXPECT_EQ(p.sent[2].state, TransferState::kConfirmed);
  EXPECT_EQ(FakeImageCache::Diff(src_before, p.src.Snap()), "");  // the sender keeps all three
  EXPECT_EQ(p.dst.pages_used(), 8);  // a and c only: b's pages were never taken
  EXPECT_EQ(p.dst.reservations(), 0);
  ASSERT_EQ(p.received.size(), 3u);
  EXPECT_EQ(p.received[1].state, TransferState::kRefused);
}

TEST(TransferTest, IncompatibleImagesAreRefusedWithTheReceiversReason) {
  Pair p(1000, Opts(1 << 16), /*dst_tag=*/8);
  SequenceId s = p.src.Add(20, 1);
  const FakeImageCache::State dst_before = p.dst.Snap();
  ASSERT_TRUE(p.sender->Send(s).ok());
  p.Pump();
  ASSERT_EQ(p.sent.size(), 1u);
  EXPECT_EQ(p.sent[0].state, TransferState::kRefused);
  EXPECT_EQ(p.sent[0].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.sent[0].status.message().find("geometry"), absl::string_view::npos)
      << p.sent[0].status;
  EXPECT_TRUE(p.src.Has(s));
  EXPECT_EQ(FakeImageCache::Diff(dst_before, p.dst.Snap()), "");
}

TEST(TransferTest, AdmissionControlRefusesBeforeReserving) {
  Pair p;
  SequenceId a = p.src.Add(20, 1), b = p.src.Add(40, 2);
  int asked = 0;
  p.receiver->SetAdmission([&](const TransferOffer& o) {
    ++asked;
    return o.length < 30;
  });
  ASSERT_TRUE(p.sender->Send(a).ok());
  ASSERT_TRUE(p.sender->Send(b).ok());
  p.Pump();
  SortById(p.sent);
  EXPECT_EQ(asked, 2);
  ASSERT_EQ(p.sent.size(), 2u);
  EXPECT_EQ(p.sent[0].state, TransferState::kConfirmed);
  EXPECT_EQ(p.sent[1].state, TransferState::kRefused);
  EXPECT_EQ(p.dst.pages_used(), 2);
}

TEST(TransferTest, SenderReleasesOnlyAfterTheAck) {
  TransferOptions o = Opts(1 << 16);
  o.release_on_confirm = true;
  Pair p(1000, o);
  SequenceId s = p.src.Add(50, 1);
  auto id = p.sender->Send(s);
  ASSERT_TRUE(id.ok());
  bool saw_moving = false;
  for (int i = 0; i < 1000 && p.sender->in_flight() > 0; ++i) {
    ASSERT_TRUE(p.sender->Progress().ok());
    auto st = p.sender->State(*id);
    if (st.ok() && *st == TransferState::kMoving) {
      saw_moving = true;
      EXPECT_TRUE(p.src.Has(s)) << "released before the receiver confirmed";
    }
    if (p.sender->in_flight() > 0) {
      EXPECT_TRUE(p.src.Has(s));
    }
    ASSERT_TRUE(p.receiver->Progress().ok());
  }
  EXPECT_TRUE(saw_moving);
  EXPECT_FALSE(p.src.Has(s));
  p.Collect();
  ASSERT_EQ(p.sent.size(), 1u);
  EXPECT_EQ(p.sent[0].state, TransferState::kConfirmed);
}

// Progresses the sender alone until transfer `id` reaches `state`.
bool SenderUntil(Pair& p, TransferId id, TransferState state) {
  for (int i = 0; i < 100; ++i) {
    auto st = p.sender->State(id);
    if (st.ok() && *st == state) return true;
    if (!p.sender->Progress().ok()) return false;
  }
  return false;
}

TEST(TransferTest, SenderCancelsWhileQueuedExportedOrOfferedAndBothCachesAreUnchanged) {
  for (TransferState stage : {TransferState::kQueued, TransferState::kReady,
                              TransferState::kOffered}) {
    SCOPED_TRACE(TransferStateName(stage));
    Pair p;
    SequenceId keep = p.src.Add(30, 1), drop = p.src.Add(30, 2);
    const FakeImageCache::State src_before = p.src.Snap();
    auto k = p.sender->Send(keep);
    auto d = p.sender->Send(drop);
    ASSERT_TRUE(k.ok() && d.ok());
    if (stage != TransferState::kQueued) {
      // Handshake first: the receiver must answer the hello.
      for (int i = 0; i < 10; ++i) {
        ASSERT_TRUE(p.sender->Progress().ok());
        if (stage == TransferState::kOffered) {
          ASSERT_TRUE(p.receiver->Progress().ok());
        }
        auto st = p.sender->State(*d);
        if (st.ok() && *st == stage) break;
      }
      if (stage == TransferState::kOffered) {
        // The receiver took the offer and reserved both, but the sender
        // has not seen the reply.
        ASSERT_TRUE(SenderUntil(p, *d, TransferState::kOffered));
      }
      ASSERT_EQ(*p.sender->State(*d), stage);
    }
    ASSERT_TRUE(p.sender->Cancel(*d).ok());
    p.Pump();
    ASSERT_EQ(p.sent.size(), 2u);
    const TransferResult& rd = p.sent[0].id == *d ? p.sent[0] : p.sent[1];
    const TransferResult& rk = p.sent[0].id == *d ? p.sent[1] : p.sent[0];
    EXPECT_EQ(rd.state, TransferState::kCancelled) << rd.status;
    EXPECT_EQ(rk.state, TransferState::kConfirmed) << rk.status;
    EXPECT_EQ(FakeImageCache::Diff(src_before, p.src.Snap()), "");
    EXPECT_EQ(p.dst.pages_used(), 2);  // only `keep` (30 tokens, 2 pages)
    EXPECT_EQ(p.dst.reservations(), 0);
    EXPECT_EQ(p.sender->Cancel(*d).code(), absl::StatusCode::kNotFound);
  }
}

TEST(TransferTest, SenderCannotCancelAMovingTransfer) {
  Pair p;
  SequenceId s = p.src.Add(30, 1);
  auto id = p.sender->Send(s);
  ASSERT_TRUE(id.ok());
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(p.sender->Progress().ok());
    auto st = p.sender->State(*id);
    if (st.ok() && *st == TransferState::kMoving) break;
    ASSERT_TRUE(p.receiver->Progress().ok());
  }
  ASSERT_EQ(*p.sender->State(*id), TransferState::kMoving);
  EXPECT_EQ(p.sender->Cancel(*id).code(), absl::StatusCode::kFailedPrecondition);
  p.Pump();
  ASSERT_EQ(p.sent.size(), 1u);
  EXPECT_EQ(p.sent[0].state, TransferState::kConfirmed);
}

TEST(TransferTest, ReceiverCancelsBeforeCommitAndReleasesTheReservation) {
  Pair p;
  SequenceId a = p.src.Add(30, 1), b = p.src.Add(30, 2);
  auto ia = p.sender->Send(a);
  auto ib = p.sender->Send(b);
  ASSERT_TRUE(ia.ok() && ib.ok());
  // Until the receiver holds the reservations (the offer arrived).
  for (int i = 0; i < 100 && p.receiver->in_flight() == 0; ++i) {
    ASSERT_TRUE(p.sender->Progress().ok());
    ASSERT_TRUE(p.receiver->Progress().ok());
  }
  ASSERT_EQ(p.receiver->in_flight(), 2);
  EXPECT_EQ(p.dst.reservations(), 2);
  ASSERT_TRUE(p.receiver->Cancel(*ib).ok());
  EXPECT_EQ(p.receiver->Cancel(12345).code(), absl::StatusCode::kNotFound);
  p.Pump();
  ASSERT_EQ(p.sent.size(), 2u);
  EXPECT_EQ(p.sent[0].state, TransferState::kConfirmed);
  EXPECT_EQ(p.sent[1].state, TransferState::kCancelled) << p.sent[1].status;
  EXPECT_TRUE(p.src.Has(b));
  EXPECT_EQ(p.dst.pages_used(), 2);
  EXPECT_EQ(p.dst.reservations(), 0);
}

TEST(TransferTest, FailedCommitIsReportedToBothAndChangesNothing) {
  Pair p;
  SequenceId a = p.src.Add(30, 1);
  p.dst.FailCommits(1);
  const FakeImageCache::State dst_before = p.dst.Snap();
  ASSERT_TRUE(p.sender->Send(a).ok());
  p.Pump();
  ASSERT_EQ(p.sent.size(), 1u);
  EXPECT_EQ(p.sent[0].state, TransferState::kFailed);
  EXPECT_EQ(p.sent[0].status.code(), absl::StatusCode::kDataLoss) << p.sent[0].status;
  EXPECT_TRUE(p.src.Has(a));
  EXPECT_EQ(FakeImageCache::Diff(dst_before, p.dst.Snap()), "");
  // The link still works.
  ASSERT_TRUE(p.sender->Send(a).ok());
  p.Pump();
  ASSERT_EQ(p.sent.size(), 2u);
  EXPECT_EQ(p.sent[1].state, TransferState::kConfirmed);
}

// Message indices on the loopback link (4 slots, pipeline_depth 2: one new
// offer per step): sender side a sends hello (0), offer 0 = a (1), offer 1
// = b (2), offer 2 = the plan of reply 0 (3), a's payload (4), offer 3 =
// the plan of reply 1 (5), b's payload (6); receiver side b sends hello
// (0), reply 0 (1), reply 1 (2), reply 2 = the late reply that acks a (3),
// reply 3 (4).
TEST(TransferTest, CorruptedOrTruncatedControlFramesBreakTheLinkAndChangeNothing) {
  struct Case {
    bool on_sender;
    int64_t index;
    LoopbackFault fault;
    const char* name;
  };
  const Case cases[] = {
      {true, 1, {Kind::kCorrupt, 0, 300}, "offer corrupted"},
      {true, 1, {Kind::kTruncate, 60}, "offer truncated"},
      {true, 0, {Kind::kCorrupt, 0, 2}, "hello corrupted"},
      {false, 1, {Kind::kCorrupt, 0, 49}, "reply corrupted"},
      {true, 2, {Kind::kCorrupt, 0, 20}, "offer 1 corrupted"},
      {true, 3, {Kind::kCorrupt, 0, 20}, "plan (offer 2) corrupted"},
      {false, 1, {Kind::kTruncate, 60}, "reply 0 truncated inside its entry"},
      {false, 1, {Kind::kTruncate, 8}, "reply truncated"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TransferOptions o = Opts(1 << 16);
    o.timeout_ms = 100;
    Pair p(1000, o);
    SequenceId a = p.src.Add(30, 1), b = p.src.Add(45, 2);
    (c.on_sender ? p.link.a : p.link.b)->InjectFault(c.index, c.fault);
    const FakeImageCache::State src_before = p.src.Snap(), dst_before = p.dst.Snap();
    ASSERT_TRUE(p.sender->Send(a).ok());
    ASSERT_TRUE(p.sender->Send(b).ok());
    absl::Status ss, rs;
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    // Until both sides gave up (the one that did not see the damage times
    // out and cancels what it holds).
    while ((p.sender->in_flight() > 0 || p.receiver->in_flight() > 0) &&
           std::chrono::steady_clock::now() < end) {
      if (ss.ok()) ss = p.sender->Progress();
      if (rs.ok()) rs = p.receiver->Progress();
      p.Collect();
    }
    EXPECT_FALSE(ss.ok() && rs.ok());
    const absl::Status& first = !rs.ok() && c.on_sender ? rs : ss;
    EXPECT_TRUE(first.code() == absl::StatusCode::kDataLoss ||
                first.code() == absl::StatusCode::kDeadlineExceeded)
        << first;
    ASSERT_EQ(p.sent.size(), 2u);
    for (const TransferResult& r : p.sent) EXPECT_EQ(r.state, TransferState::kFailed);
    EXPECT_EQ(FakeImageCache::Diff(src_before, p.src.Snap()), "");
    EXPECT_EQ(FakeImageCache::Diff(dst_before, p.dst.Snap()), "");
    EXPECT_EQ(p.sender->Send(a).status().code(), absl::StatusCode::kFailedPrecondition);
  }
}

TEST(TransferTest, DroppedOfferTimesOutOnTheSenderAndChangesNothing) {
  TransferOptions o = Opts(1 << 16);
  o.timeout_ms = 50;
  Pair p(1000, o);
  SequenceId a = p.src.Add(30, 1);
  p.link.a->InjectFault(1, {Kind::kDrop});
  const FakeImageCache::State dst_before = p.dst.Snap();
  ASSERT_TRUE(p.sender->Send(a).ok());
  absl::Status s;
  for (int i = 0; i < 10000000 && s.ok(); ++i) {
    s = p.sender->Progress();
    ASSERT_TRUE(p.receiver->Progress().ok());
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  p.Collect();
  ASSERT_EQ(p.sent.size(), 1u);
  EXPECT_EQ(p.sent[0].state, TransferState::kFailed);
  EXPECT_TRUE(p.src.Has(a));
  EXPECT_EQ(FakeImageCache::Diff(dst_before, p.dst.Snap()), "");
}

TEST(TransferTest, LostAckLeavesTheSequenceOnBothSidesNeverOnNeither) {
  TransferOptions o = Opts(1 << 16);
  o.timeout_ms = 50;
  Pair p(1000, o);
  SequenceId a = p.src.Add(30, 1);
  // Receiver messages: hello (0), reply 0 (1), reply 1 (2), reply 2 (3):
  // the late reply that acks the payload of step 2.
  p.link.b->InjectFault(3, {Kind::kDrop});
  ASSERT_TRUE(p.sender->Send(a).ok());
  absl::Status s;
  for (int i = 0; i < 10000000 && s.ok(); ++i) {
    s = p.sender->Progress();
    ASSERT_TRUE(p.receiver->Progress().ok());
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  p.Collect();
  ASSERT_EQ(p.sent.size(), 1u);
  EXPECT_EQ(p.sent[0].state, TransferState::kFailed);
  ASSERT_EQ(p.received.size(), 1u);
  EXPECT_EQ(p.received[0].state, TransferState::kConfirmed);
  EXPECT_TRUE(p.src.Has(a));
  EXPECT_EQ(p.dst.Image(p.received[0].seq), p.src.Image(a));
}

TEST(TransferTest, DelayedMessagesStillCompleteInOrder) {
  Pair p;
  std::vector<SequenceId> seqs;
  for (int i = 0; i < 6; ++i) seqs.push_back(p.src.Add(10 + i, i));
  for (int64_t k = 0; k < 12; ++k) {
    p.link.a->InjectFault(k, {Kind::kDelay, 0, 0, static_cast<int>(k % 4)});
    p.link.b->InjectFault(k, {Kind::kDelay, 0, 0, static_cast<int>((k + 2) % 5)});
  }
  for (SequenceId s : seqs) ASSERT_TRUE(p.sender->Send(s).ok());
  p.Pump();
  ASSERT_EQ(p.received.size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(p.sent[i].state, TransferState::kConfirmed);
    EXPECT_EQ(p.dst.Image(p.received[i].seq), p.src.Image(seqs[i]));
  }
}

TEST(TransferTest, LinkFailureMidPayloadFailsTheRoundAndCancelsReservations) {
  Pair p;
  SequenceId a = p.src.Add(30, 1), b = p.src.Add(30, 2);
  p.link.a->InjectFault(4, {Kind::kFail});  // the first payload (step 2)
  const FakeImageCache::State src_before = p.src.Snap(), dst_before = p.dst.Snap();
  ASSERT_TRUE(p.sender->Send(a).ok());
  ASSERT_TRUE(p.sender->Send(b).ok());
  absl::Status ss, rs;
  for (int i = 0; i < 1000 && (ss.ok() || rs.ok()); ++i) {
    ss = p.sender->Progress();
    rs = p.receiver->Progress();
  }
  EXPECT_EQ(ss.code(), absl::StatusCode::kUnavailable) << ss;
  EXPECT_EQ(rs.code(), absl::StatusCode::kUnavailable) << rs;
  p.Collect();
  ASSERT_EQ(p.sent.size(), 2u);
  ASSERT_EQ(p.received.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(p.sent[i].state, TransferState::kFailed);
    EXPECT_EQ(p.received[i].state, TransferState::kFailed);
  }
  EXPECT_EQ(FakeImageCache::Diff(src_before, p.src.Snap()), "");
  EXPECT_EQ(FakeImageCache::Diff(dst_before, p.dst.Snap()), "");
}

TEST(TransferTest, MismatchedOptionsFailTheHandshake) {
  FakeImageCache src(Device::Cpu(), 100), dst(Device::Cpu(), 100);
  Link l = MakeLink();
  auto s = internal::CreateSender(src.Port(), l.a.get(), Opts(1 << 16, 4));
  auto r = internal::CreateReceiver(dst.Port(), l.b.get(), Opts(1 << 16, 5));
  ASSERT_TRUE(s.ok() && r.ok());
  ASSERT_TRUE(s->Send(src.Add(10, 1)).ok());
  absl::Status a, b;
  for (int i = 0; i < 10 && a.ok(); ++i) {
    a = s->Progress();
    b = r->Progress();
  }
  EXPECT_EQ(a.code(), absl::StatusCode::kFailedPrecondition) << a;
  EXPECT_EQ(b.code(), absl::StatusCode::kFailedPrecondition) << b;
  EXPECT_NE(a.message().find("num_slots"), absl::string_view::npos);
}

TEST(TransferTest, BadArgumentsAreRefusedByName) {
  FakeImageCache src(Device::Cpu(), 100);
  Link l = MakeLink();
  TransferOptions o = Opts(0);
  auto s = internal::CreateSender(src.Port(), l.a.get(), o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("slot_bytes"), absl::string_view::npos);
  o = Opts(100);  // below a header
  EXPECT_NE(internal::CreateSender(src.Port(), l.a.get(), o).status().message().find("slot_bytes"),
            absl::string_view::npos);
  o = Opts(1 << 16, 0);
  EXPECT_NE(internal::CreateSender(src.Port(), l.a.get(), o).status().message().find("num_slots"),
            absl::string_view::npos);
  EXPECT_EQ(internal::CreateSender(src.Port(), nullptr, Opts(1 << 16)).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto ok = internal::CreateSender(src.Port(), l.a.get(), Opts(1024));
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->Send(999).status().code(), absl::StatusCode::kNotFound);
  SequenceId big = src.Add(100, 1);  // 4256 bytes > 1024
  absl::StatusOr<TransferId> t = ok->Send(big);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("slot_bytes"), absl::string_view::npos);
  SequenceId small = src.Add(10, 2);
  ASSERT_TRUE(ok->Send(small).ok());
  EXPECT_EQ(ok->Send(small).status().code(), absl::StatusCode::kInvalidArgument);  // twice
  EXPECT_EQ(ok->Close().code(), absl::StatusCode::kFailedPrecondition);  // in flight
  EXPECT_EQ(ok->in_flight(), 1);
  // A moved-from sender refuses.
  SequenceSender moved = std::move(*ok);
  EXPECT_EQ(ok->Send(small).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(moved.in_flight(), 1);
}

// Bytes of the heap in use (malloc'ed, including its large mappings).
int64_t HeapBytesInUse() {
#if defined(__SANITIZE_ADDRESS__) || defined(FP4KV_TRANSFER_TEST_ASAN)
  return static_cast<int64_t>(__sanitizer_get_current_allocated_bytes());
#else
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
#endif
}

TEST(TransferTest, SlotsBeyondTheMachineAreResourceExhaustedAndAllocateNothing) {
  FakeImageCache cache(Device::Cpu(), 100);
  Link l = MakeLink();
  const int64_t available = internal::HostMemoryAvailable();
  struct Case {
    int64_t slot_bytes;
    int slots;
    const char* why;
  };
  const Case cases[] = {
      {INT64_MAX, 1, "the slot stride overflows"},
      {INT64_MAX - 300, 4, "the slot stride fits, not four of them"},
      {INT64_MAX / 64, 256, "the slots' bytes overflow"},
      {int64_t{1} << 46, 256, "2^54 bytes: valid int64, beyond any machine"},
      {available == INT64_MAX ? int64_t{1} << 50 : available, 2, "twice what is available"},
  };
  auto create = [&](const Case& c, int side) {
    return side == 0
               ? internal::CreateSender(cache.Port(), l.a.get(), Opts(c.slot_bytes, c.slots))
                     .status()
               : internal::CreateReceiver(cache.Port(), l.b.get(), Opts(c.slot_bytes, c.slots))
                     .status();
  };
  // Every case once first, so that first-use initialization is done; then
  // no call may leave a buffer behind. The smallest (a receiver's frames of
  // one slot) is over 1 KiB; malloc's own caches move by a few dozen bytes.
  for (const Case& c : cases) {
    for (int side = 0; side < 2; ++side) (void)create(c, side);
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.why << ": " << c.slots << " x " << c.slot_bytes);
    for (int side = 0; side < 2; ++side) {
      const std::string call = side == 0 ? "SequenceSender::Create" : "SequenceReceiver::Create";
      const std::string slots = "slots of " + std::to_string(c.slot_bytes);
      const int64_t before = HeapBytesInUse();
      absl::StatusCode code = absl::StatusCode::kOk;
      bool named = false;
      {
        absl::Status s = create(c, side);
        code = s.code();
        named = s.message().find(call) != absl::string_view::npos &&
                s.message().find(slots) != absl::string_view::npos;
      }
      const int64_t after = HeapBytesInUse();
      EXPECT_EQ(code, absl::StatusCode::kResourceExhausted) << call;
      EXPECT_TRUE(named) << create(c, side);
      EXPECT_LT(after - before, 1024) << call;
    }
  }
  // A link that fits still comes up afterwards.
  Pair p;
  SequenceId a = p.src.Add(30, 1);
  ASSERT_TRUE(p.sender->Send(a).ok());
  p.Pump();
  ASSERT_EQ(p.received.size(), 1u);
  EXPECT_EQ(p.received[0].state, TransferState::kConfirmed) << p.received[0].status;
}

TEST(TransferTest, CloseEndsTheLinkOnBothSides) {
  Pair p;
  SequenceId a = p.src.Add(30, 1);
  ASSERT_TRUE(p.sender->Send(a).ok());
  p.Pump();
  ASSERT_EQ(p.received.size(), 1u);
  // Close blocks until the receiver took the bye: a receiver on another
  // thread would be polling; here a loopback match completes it at once.
  ASSERT_TRUE(p.sender->Close().ok());
  ASSERT_TRUE(p.receiver->Progress().ok());
  EXPECT_TRUE(p.receiver->closed());
  EXPECT_EQ(p.receiver->RunUntilResults(1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.sender->Send(a).status().code(), absl::StatusCode::kFailedPrecondition);
}

// ----------------------------------------------------- the pipeline

// Forwards to a loopback endpoint and records what the protocol posts (the
// bytes of every control frame it sends, as posted) and how far its ops
// completed, so tests can read the wire.
class Recorder : public Transport {
 public:
  struct Op {
    bool send = false;
    bool control = false;
    int64_t bytes = 0;
    std::vector<unsigned char> frame;  // control sends
    int64_t completed_before = 0;      // ops of this endpoint known complete when it was posted
  };
  explicit Recorder(LoopbackTransport* inner) : inner_(inner) {}
  Device device() const override { return inner_->device(); }
  Stream stream() const override { return inner_->stream(); }
  absl::StatusOr<OpId> Send(const void* b, int64_t n) override { return Log(true, false, b, n); }
  absl::StatusOr<OpId> Recv(void* b, int64_t n) override { return Log(false, false, b, n); }
  absl::StatusOr<OpId> SendControl(const void* b, int64_t n) override {
    return Log(true, true, b, n);
  }
  absl::StatusOr<OpId> RecvControl(void* b, int64_t n) override { return Log(false, true, b, n); }
  absl::StatusOr<bool> Poll(OpId op) override {
    absl::StatusOr<bool> r = inner_->Poll(op);
    if (r.ok() && *r) completed_ = std::max<int64_t>(completed_, static_cast<int64_t>(op));
    return r;
  }
  const std::vector<Op>& ops() const { return ops_; }

 private:
  absl::StatusOr<OpId> Log(bool send, bool control, const void* b, int64_t n) {
    Op op;
    op.send = send;
    op.control = control;
    op.bytes = n;
    op.completed_before = completed_;
    if (send && control) {
      op.frame.assign(static_cast<const unsigned char*>(b), static_cast<const unsigned char*>(b) + n);
    }
    absl::StatusOr<OpId> id;
    if (control) {
      id = send ? inner_->SendControl(b, n) : inner_->RecvControl(const_cast<void*>(b), n);
    } else {
      id = send ? inner_->Send(b, n) : inner_->Recv(const_cast<void*>(b), n);
    }
    if (id.ok()) {
      EXPECT_EQ(*id, ops_.size() + 1) << "op ids count up from 1";
      ops_.push_back(std::move(op));
    }
    return id;
  }
  LoopbackTransport* inner_;
  std::vector<Op> ops_;
  int64_t completed_ = 0;
};

internal::FrameHead HeadOf(const std::vector<unsigned char>& f) {
  internal::FrameHead h;
  std::memcpy(&h, f.data(), sizeof(h));
  return h;
}
internal::FrameEntry EntryOf(const std::vector<unsigned char>& f, size_t i) {
  internal::FrameEntry e;
  std::memcpy(&e, f.data() + sizeof(internal::FrameHead) + i * sizeof(e), sizeof(e));
  return e;
}

// A sender and a receiver on fake caches, each behind a Recorder.
struct RecordedPair {
  FakeImageCache src{Device::Cpu(), 100000};
  FakeImageCache dst{Device::Cpu(), 100000};
  Link link = MakeLink();
  Recorder ra{link.a.get()}, rb{link.b.get()};
  std::unique_ptr<SequenceSender> sender;
  std::unique_ptr<SequenceReceiver> receiver;
  std::vector<TransferResult> sent, received;

  explicit RecordedPair(const TransferOptions& o) {
    auto s = internal::CreateSender(src.Port(), &ra, o);
    auto r = internal::CreateReceiver(dst.Port(), &rb, o);
    EXPECT_TRUE(s.ok()) << s.status();
    EXPECT_TRUE(r.ok()) << r.status();
    sender = std::make_unique<SequenceSender>(std::move(*s));
    receiver = std::make_unique<SequenceReceiver>(std::move(*r));
  }
  void Collect() {
    for (auto& r : sender->TakeResults()) sent.push_back(r);
    for (auto& r : receiver->TakeResults()) received.push_back(r);
  }
};

TransferOptions PipeOpts(int slots, int depth, int64_t timeout_ms = 2000) {
  TransferOptions o = Opts(1 << 16, slots);
  o.pipeline_depth = depth;
  o.timeout_ms = timeout_ms;
  return o;
}

class TransferPipelineTest : public ::testing::TestWithParam<int> {};

// Many transfers through every depth, sends interleaved with progress and
// messages delayed at random on both sides: all arrive byte for byte, are
// confirmed in send order, and up to `depth` steps are in flight (never
// more).
TEST_P(TransferPipelineTest, ManyStepsInFlightStayOrderedAndByteExact) {
  const int depth = GetParam();
  RecordedPair p(PipeOpts(8, depth));
  for (int64_t k = 0; k < 400; ++k) {
    p.link.a->InjectFault(k, {Kind::kDelay, 0, 0, static_cast<int>((k * 7) % 5)});
    p.link.b->InjectFault(k, {Kind::kDelay, 0, 0, static_cast<int>((k * 3) % 4)});
  }
  std::vector<SequenceId> seqs;
  for (int i = 0; i < 60; ++i) seqs.push_back(p.src.Add(1 + (i * 53) % 300, 500 + i));
  std::vector<TransferId> ids;
  size_t next = 0;
  for (int iter = 0; iter < 1000000 && (next < seqs.size() || p.sender->in_flight() > 0);
       ++iter) {
    if (next < seqs.size() && iter % 2 == 0) {
      auto id = p.sender->Send(seqs[next++]);
      ASSERT_TRUE(id.ok()) << id.status();
      ids.push_back(*id);
    }
    ASSERT_TRUE(p.sender->Progress().ok());
    ASSERT_TRUE(p.receiver->Progress().ok());
    EXPECT_LE(p.receiver->in_flight(), 8);
    p.Collect();
  }
  ASSERT_EQ(p.sent.size(), seqs.size());
  ASSERT_EQ(p.received.size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(p.sent[i].id, ids[i]);
    EXPECT_EQ(p.sent[i].state, TransferState::kConfirmed) << p.sent[i].status;
    EXPECT_EQ(p.received[i].id, ids[i]);
    ASSERT_EQ(p.received[i].state, TransferState::kConfirmed) << p.received[i].status;
    EXPECT_EQ(p.dst.Image(p.received[i].seq), p.src.Image(seqs[i])) << "transfer " << ids[i];
  }
  EXPECT_EQ(p.dst.reservations(), 0);
  // Steps in flight when the sender posted an offer: offers posted before
  // it whose reply had not completed, plus itself.
  const std::vector<Recorder::Op>& ops = p.ra.ops();
  int max_in_flight = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!ops[i].send || !ops[i].control || i == 0) continue;  // op 0 is the hello
    int in_flight = 0;
    for (size_t j = 0; j <= i; ++j) {
      if (ops[j].send && ops[j].control && j > 0) ++in_flight;
      if (!ops[j].send && ops[j].control && j > 1 &&
          static_cast<int64_t>(j + 1) <= ops[i].completed_before) {
        --in_flight;  // a reply that had completed
      }
    }
    max_in_flight = std::max(max_in_flight, in_flight);
  }
  EXPECT_EQ(max_in_flight, depth);
}

// The wire, step by step: offer k, then exactly the payloads its plan
// names, then the receive of reply k; the plan of offer k is the READY set
// of reply k - depth in order; every transfer's payload moves depth steps
// after its offer; its ack comes in the reply of the step that moved it or
// the next one.
TEST_P(TransferPipelineTest, StepsFollowTheDocumentedLayout) {
  const int depth = GetParam();
  const int slots = 12;
  RecordedPair p(PipeOpts(slots, depth));
  std::vector<SequenceId> seqs;
  for (int i = 0; i < 25; ++i) seqs.push_back(p.src.Add(5 + (i * 29) % 200, 900 + i));
  for (SequenceId s : seqs) ASSERT_TRUE(p.sender->Send(s).ok());
  for (int i = 0; i < 100000 && p.sender->in_flight() > 0; ++i) {
    ASSERT_TRUE(p.sender->Progress().ok());
    ASSERT_TRUE(p.receiver->Progress().ok());
  }
  p.Collect();
  ASSERT_EQ(p.sent.size(), seqs.size());
  // Replies as the receiver sent them, by step.
  std::map<uint64_t, std::vector<unsigned char>> replies;
  for (const Recorder::Op& op : p.rb.ops()) {
    if (op.send && op.control && HeadOf(op.frame).kind ==
                                     static_cast<uint16_t>(internal::FrameKind::kReply)) {
      replies[HeadOf(op.frame).round] = op.frame;
    }
  }
  const std::vector<Recorder::Op>& ops = p.ra.ops();
  ASSERT_GE(ops.size(), 2u);
  EXPECT_TRUE(ops[0].send && ops[0].control);    // hello
  EXPECT_TRUE(!ops[1].send && ops[1].control);   // the receiver's hello
  std::map<TransferId, uint64_t> offered_in, moved_in, acked_in;
  uint64_t expect_step = 0;
  for (size_t i = 2; i < ops.size();) {
    ASSERT_TRUE(ops[i].send && ops[i].control) << "op " << i << ": expected an offer";
    const internal::FrameHead h = HeadOf(ops[i].frame);
    ASSERT_EQ(h.kind, static_cast<uint16_t>(internal::FrameKind::kOffer));
    ASSERT_EQ(h.round, expect_step);
    const uint64_t k = h.round;
    // The plan: reply k - depth's READY entries, in order.
    std::vector<TransferId> want;
    if (k >= static_cast<uint64_t>(depth)) {
      ASSERT_TRUE(replies.count(k - depth));
      const std::vector<unsigned char>& r = replies[k - depth];
      const internal::FrameHead rh = HeadOf(r);
      for (int64_t e = 0; e < rh.arg0; ++e) {
        if (EntryOf(r, e).code == internal::kCodeReady) want.push_back(EntryOf(r, e).id);
      }
    }
    ASSERT_EQ(h.arg0, static_cast<int64_t>(want.size())) << "step " << k;
    for (int64_t e = 0; e < h.count; ++e) {
      const internal::FrameEntry fe = EntryOf(ops[i].frame, e);
      if (e < h.arg0) {
        EXPECT_EQ(fe.id, want[e]);
        EXPECT_EQ(fe.code, internal::kCodeSend);
        moved_in[fe.id] = k;
      } else {
        EXPECT_EQ(fe.code, internal::kCodeOffer);
        offered_in[fe.id] = k;
      }
    }
    // New offers per step are spread: at most max(1, slots / (depth + 2)).
    EXPECT_LE(h.count - h.arg0, std::max(1, slots / (depth + 2))) << "step " << k;
    // Exactly the planned payloads, then the reply's receive.
    for (int64_t e = 0; e < h.arg0; ++e) {
      ASSERT_LT(i + 1 + e, ops.size());
      EXPECT_TRUE(ops[i + 1 + e].send && !ops[i + 1 + e].control) << "step " << k;
    }
    const size_t r = i + 1 + static_cast<size_t>(h.arg0);
    ASSERT_LT(r, ops.size());
    EXPECT_TRUE(!ops[r].send && ops[r].control) << "step " << k << ": expected the reply";
    ASSERT_TRUE(replies.count(k));
    const internal::FrameHead rh = HeadOf(replies[k]);
    for (int64_t e = rh.arg0; e < rh.count; ++e) {
      const internal::FrameEntry a = EntryOf(replies[k], e);
      EXPECT_EQ(a.code, internal::kCodeCommitted);
      acked_in[a.id] = k;
    }
    i = r + 1;
    ++expect_step;
  }
  ASSERT_EQ(offered_in.size(), seqs.size());
  ASSERT_EQ(moved_in.size(), seqs.size());
  ASSERT_EQ(acked_in.size(), seqs.size());
  uint64_t prev_offer = 0;
  for (const auto& [id, k] : offered_in) {
    EXPECT_GE(k, prev_offer) << "offers in id order";
    prev_offer = k;
    EXPECT_EQ(moved_in[id], k + depth) << "transfer " << id;
    EXPECT_GE(acked_in[id], moved_in[id]) << "transfer " << id;
    EXPECT_LE(acked_in[id], moved_in[id] + 1) << "transfer " << id;
  }
  // Several transfers per step: the pipeline carried more than one at once.
  EXPECT_LT(expect_step, seqs.size());
}

// Faults at every message of a pipelined run, on either side: a broken
// control frame, a lost message, a failed link. Whatever the point, both
// sides stop with nothing in flight; every sequence is in at least one cache
// (the sender releases only what the receiver confirmed; a lost ack leaves
// it on both), the receiver holds exactly what it confirmed, byte for byte,
// and no reservation or page is left behind.
TEST_P(TransferPipelineTest, FaultsAtEveryMessageLeaveConsistentCaches) {
  const int depth = GetParam();
  const int kSeqs = 9;
  auto lengths = [](int i) { return int64_t{3} + (i * 41) % 90; };
  // A clean run first: which messages each side sends (control or data).
  std::vector<bool> control[2];
  {
    RecordedPair p(PipeOpts(3, depth));
    for (int i = 0; i < kSeqs; ++i) ASSERT_TRUE(p.sender->Send(p.src.Add(lengths(i), i)).ok());
    for (int i = 0; i < 100000 && p.sender->in_flight() > 0; ++i) {
      ASSERT_TRUE(p.sender->Progress().ok());
      ASSERT_TRUE(p.receiver->Progress().ok());
    }
    for (int side = 0; side < 2; ++side) {
      for (const Recorder::Op& op : (side == 0 ? p.ra : p.rb).ops()) {
        if (op.send) control[side].push_back(op.control);
      }
    }
  }
  ASSERT_GT(control[0].size(), 10u);
  int cases = 0;
  for (int side = 0; side < 2; ++side) {
    for (size_t index = 0; index < control[side].size(); ++index) {
      std::vector<LoopbackFault> faults = {{Kind::kFail}};
      if (control[side][index]) faults.push_back({Kind::kCorrupt, 0, 60 + 7 * int64_t(index)});
      // Lost messages (every one a timeout) at depth 2 only.
      if (depth == 2) faults.push_back({Kind::kDrop});
      for (const LoopbackFault& f : faults) {
        SCOPED_TRACE(::testing::Message() << (side == 0 ? "sender" : "receiver") << " message "
                                          << index << " fault " << static_cast<int>(f.kind));
        ++cases;
        TransferOptions o = PipeOpts(3, depth, /*timeout_ms=*/30);
        o.release_on_confirm = true;
        Pair p(100000, o);
        std::map<SequenceId, std::vector<uint8_t>> images;
        for (int i = 0; i < kSeqs; ++i) {
          SequenceId s = p.src.Add(lengths(i), i);
          images[s] = p.src.Image(s);
        }
        (side == 0 ? p.link.a : p.link.b)->InjectFault(static_cast<int64_t>(index), f);
        for (const auto& [s, img] : images) ASSERT_TRUE(p.sender->Send(s).ok());
        absl::Status ss, rs;
        const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (std::chrono::steady_clock::now() < end) {
          if (ss.ok()) ss = p.sender->Progress();
          if (rs.ok()) rs = p.receiver->Progress();
          p.Collect();
          if (p.sender->in_flight() == 0 && p.receiver->in_flight() == 0) break;
        }
        ASSERT_EQ(p.sender->in_flight(), 0);
        ASSERT_EQ(p.receiver->in_flight(), 0);
        ASSERT_EQ(p.sent.size(), images.size());
        std::map<TransferId, SequenceId> got;  // receiver-confirmed: id -> new sequence
        for (const TransferResult& r : p.received) {
          if (r.state == TransferState::kConfirmed) {
            EXPECT_TRUE(got.emplace(r.id, r.seq).second) << "transfer " << r.id << " twice";
          }
        }
        int64_t pages = 0;
        for (const TransferResult& r : p.sent) {
          EXPECT_TRUE(r.state == TransferState::kConfirmed || r.state == TransferState::kFailed)
              << TransferStateName(r.state) << " " << r.status;
          const bool on_receiver = got.count(r.id) != 0;
          if (r.state == TransferState::kConfirmed) {
            EXPECT_TRUE(on_receiver) << "confirmed to the sender, unknown to the receiver";
            EXPECT_FALSE(p.src.Has(r.seq));
          } else {
            EXPECT_TRUE(p.src.Has(r.seq)) << "the sender let go of a failed transfer";
            if (p.src.Has(r.seq)) {
              EXPECT_EQ(p.src.Image(r.seq), images[r.seq]);
            }
          }
          if (on_receiver) {
            EXPECT_EQ(p.dst.Image(got[r.id]), images[r.seq]) << "transfer " << r.id;
            pages += (r.length + 15) / 16;
          }
        }
        EXPECT_EQ(p.dst.reservations(), 0);
        EXPECT_EQ(p.dst.pages_used(), pages);
      }
    }
  }
  EXPECT_GT(cases, 20);
}

// Cancels from the sender at every stage while other transfers flow: a
// cancelled one ends kCancelled (or, when its image was already moving,
// the cancel is refused and it ends confirmed); nothing else is disturbed.
TEST_P(TransferPipelineTest, CancelsMidPipelineLeaveTheRestFlowing) {
  const int depth = GetParam();
  Pair p(100000, PipeOpts(4, depth));
  std::vector<SequenceId> seqs;
  for (int i = 0; i < 30; ++i) seqs.push_back(p.src.Add(4 + (i * 31) % 120, 300 + i));
  const FakeImageCache::State before = p.src.Snap();
  std::vector<TransferId> ids;
  for (SequenceId s : seqs) ids.push_back(*p.sender->Send(s));
  std::set<TransferId> cancelled, refused;
  std::set<TransferState> stages;
  for (int iter = 0; iter < 100000 && p.sender->in_flight() > 0; ++iter) {
    for (size_t i = iter % 5; i < ids.size(); i += 7) {
      auto st = p.sender->State(ids[i]);
      if (!st.ok() || cancelled.count(ids[i]) || refused.count(ids[i])) continue;
      absl::Status c = p.sender->Cancel(ids[i]);
      if (c.ok()) {
        cancelled.insert(ids[i]);
        stages.insert(*st);
      } else {
        EXPECT_EQ(c.code(), absl::StatusCode::kFailedPrecondition) << c;
        EXPECT_EQ(*st, TransferState::kMoving);
        refused.insert(ids[i]);
      }
    }
    ASSERT_TRUE(p.sender->Progress().ok());
    ASSERT_TRUE(p.receiver->Progress().ok());
    p.Collect();
  }
  p.Collect();
  ASSERT_EQ(p.sent.size(), ids.size());
  EXPECT_GE(stages.size(), 2u) << "cancels hit more than one stage";
  EXPECT_TRUE(stages.count(TransferState::kQueued));
  std::map<TransferId, SequenceId> got;
  for (const TransferResult& r : p.received) {
    if (r.state == TransferState::kConfirmed) got[r.id] = r.seq;
  }
  int64_t pages = 0;
  for (const TransferResult& r : p.sent) {
    if (cancelled.count(r.id)) {
      EXPECT_EQ(r.state, TransferState::kCancelled) << "transfer " << r.id << " " << r.status;
      EXPECT_EQ(got.count(r.id), 0u);
    } else {
      EXPECT_EQ(r.state, TransferState::kConfirmed) << "transfer " << r.id << " " << r.status;
      ASSERT_EQ(got.count(r.id), 1u);
      EXPECT_EQ(p.dst.Image(got[r.id]), p.src.Image(r.seq));
      pages += (r.length + 15) / 16;
    }
  }
  EXPECT_EQ(FakeImageCache::Diff(before, p.src.Snap()), "");
  EXPECT_EQ(p.dst.reservations(), 0);
  EXPECT_EQ(p.dst.pages_used(), pages);
}

INSTANTIATE_TEST_SUITE_P(Depth, TransferPipelineTest, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return "Depth" + std::to_string(p.param);
                         });

TEST(TransferTest, PipelineDepthMustBeValidAndMatch) {
  FakeImageCache src(Device::Cpu(), 100), dst(Device::Cpu(), 100);
  Link l = MakeLink();
  for (int bad : {0, 5, -1}) {
    auto s = internal::CreateSender(src.Port(), l.a.get(), PipeOpts(4, bad));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("pipeline_depth"), absl::string_view::npos) << s.status();
  }
  auto s = internal::CreateSender(src.Port(), l.a.get(), PipeOpts(4, 1));
  auto r = internal::CreateReceiver(dst.Port(), l.b.get(), PipeOpts(4, 3));
  ASSERT_TRUE(s.ok() && r.ok());
  ASSERT_TRUE(s->Send(src.Add(10, 1)).ok());
  absl::Status a, b;
  for (int i = 0; i < 10 && a.ok(); ++i) {
    a = s->Progress();
    b = r->Progress();
  }
  EXPECT_EQ(a.code(), absl::StatusCode::kFailedPrecondition) << a;
  EXPECT_EQ(b.code(), absl::StatusCode::kFailedPrecondition) << b;
  EXPECT_NE(a.message().find("pipeline_depth"), absl::string_view::npos) << a;
  EXPECT_EQ(dst.reservations(), 0);
}

// A damaged plan (the offer of step depth, which plans step 0's payloads)
// is caught before any payload is committed: both caches unchanged.
TEST(TransferTest, CorruptedPlanBreaksTheLinkBeforeAnyCommit) {
  TransferOptions o = PipeOpts(4, 2, 100);
  Pair p(1000, o);
  SequenceId a = p.src.Add(30, 1), b = p.src.Add(45, 2);
  // Sender messages: hello (0), offer 0 (1), offer 1 (2), offer 2 = plan of
  // reply 0 (3).
  p.link.a->InjectFault(3, {Kind::kCorrupt, 0, 100});
  const FakeImageCache::State src_before = p.src.Snap(), dst_before = p.dst.Snap();
  ASSERT_TRUE(p.sender->Send(a).ok());
  ASSERT_TRUE(p.sender->Send(b).ok());
  absl::Status ss, rs;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((p.sender->in_flight() > 0 || p.receiver->in_flight() > 0) &&
         std::chrono::steady_clock::now() < end) {
    if (ss.ok()) ss = p.sender->Progress();
    if (rs.ok()) rs = p.receiver->Progress();
    p.Collect();
  }
  EXPECT_EQ(rs.code(), absl::StatusCode::kDataLoss) << rs;
  EXPECT_EQ(ss.code(), absl::StatusCode::kDeadlineExceeded) << ss;
  ASSERT_EQ(p.received.size(), 2u);
  for (const TransferResult& r : p.received) EXPECT_EQ(r.state, TransferState::kFailed);
  EXPECT_EQ(FakeImageCache::Diff(src_before, p.src.Snap()), "");
  EXPECT_EQ(FakeImageCache::Diff(dst_before, p.dst.Snap()), "");
}

}  // namespace
}  // namespace fp4kv
