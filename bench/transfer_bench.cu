// Moving sequences between two KVCaches through NCCL: the transfer protocol
// (export into a staging slot, offer, reserve, device-to-device payload,
// commit, ack) against NCCL's own send/recv of the same bytes, in the same
// process.
//
// Mode: with two or more GPUs (and FP4KV_TRANSFER_BENCH_GPUS unset or 2),
// rank 0 on GPU 0 sends to rank 1 on GPU 1, both driven from one thread.
// With one GPU the same code runs over NCCL send/recv to self on a 1-rank
// communicator (both caches on GPU 0): every case's label then says
// "1 GPU self send/recv: not the 2-GPU number", because the payload moves
// inside one GPU's memory, not over NVLink.
//
// Cases (each time is a median of several host-timed runs, from the first
// Send to the last confirmation with the receiver's commit copies done):
//   BM_DeviceCopy          2 GiB device-to-device copy (the house reference)
//   BM_NcclSendRecv/L      raw ncclSend/ncclRecv of the images of 1 GiB of
//                          L-token sequences (8 layers, 8 KV heads, head dim
//                          128, page 16), one message per image
//   BM_Transfer/L          the same sequences through SequenceSender /
//                          SequenceReceiver (pipeline_depth 2, enough slots
//                          for several images per step); pct_of_nccl = its
//                          GB/s as a percentage of BM_NcclSendRecv/L's
//   BM_Latency4k32Layers/D one 4096-token sequence of a 32-layer model at
//                          pipeline_depth D (1: the fewest control messages
//                          before the payload)
// GBps counts the image bytes moved once (one direction).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "bench/bench_util.cuh"
#include "fp4kv/kv_cache.h"
#include "fp4kv/transfer.h"

namespace fp4kv {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int kRuns = 5;

double NowMs() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The link: two endpoints, their devices, what the numbers mean.
struct Link {
  bool ok = false;
  std::string error;
  bool two_gpus = false;
  int dev[2] = {0, 0};
  std::unique_ptr<NcclCommunicator> comm[2];
  std::unique_ptr<Transport> end[2];
  std::string label;
};

Link& TheLink() {
  static Link* link = [] {
    auto* l = new Link;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      l->error = "no CUDA device";
      return l;
    }
    std::string why;
    if (!NcclAvailable(&why)) {
      l->error = "no NCCL: " + why;
      return l;
    }
    const char* want = std::getenv("FP4KV_TRANSFER_BENCH_GPUS");
    l->two_gpus = count >= 2 && (want == nullptr || std::string(want) != "1");
    absl::StatusOr<NcclUniqueId> id = NcclCreateUniqueId();
    if (!id.ok()) {
      l->error = std::string(id.status().message());
      return l;
    }
    if (l->two_gpus) {
      l->dev[1] = 1;
      absl::Status st1;
      std::thread t([&] {
        auto c = NcclCommunicator::Create(*id, 2, 1, Device::Cuda(1));
        st1 = c.status();
        if (c.ok()) l->comm[1] = std::move(*c);
      });
      auto c = NcclCommunicator::Create(*id, 2, 0, Device::Cuda(0));
      t.join();
      if (!c.ok() || !st1.ok()) {
        l->error = c.ok() ? std::string(st1.message()) : std::string(c.status().message());
        return l;
      }
      l->comm[0] = std::move(*c);
      auto e0 = l->comm[0]->Connect(1);
      auto e1 = l->comm[1]->Connect(0);
      if (!e0.ok() || !e1.ok()) {
        l->error = "Connect failed";
        return l;
      }
      l->end[0] = std::move(*e0);
      l->end[1] = std::move(*e1);
      l->label = "2 GPUs: rank 0 GPU 0 -> rank 1 GPU 1";
    } else {
      auto c = NcclCommunicator::Create(*id, 1, 0, Device::Cuda(0));
      if (!c.ok()) {
        l->error = std::string(c.status().message());
        return l;
      }
      l->comm[0] = std::move(*c);
      auto pair = l->comm[0]->SelfPair();
      if (!pair.ok()) {
        l->error = std::string(pair.status().message());
        return l;
      }
      l->end[0] = std::move(pair->first);
      l->end[1] = std::move(pair->second);
      l->label = "1 GPU self send/recv: not the 2-GPU number";
    }
    l->ok = true;
    return l;
  }();
  return *link;
}

KVCacheOptions ModelOptions(int layers, int64_t pages, int device) {
  KVCacheOptions o;
  o.num_layers = layers;
  o.geometry.num_kv_heads = 8;
  o.geometry.head_dim_k = o.geometry.head_dim_v = 128;
  o.geometry.page_size = 16;
  o.geometry.layout = Layout::kNHD;
  o.geometry.num_pages = pages;
  o.device = Device::Cuda(device);
  o.k_global_scales.assign(layers, 0.05f);
  o.v_global_scales.assign(layers, 0.05f);
  o.max_seqs_per_step = 64;
  o.max_tokens_per_step = 32768;
  o.max_pages_per_seq = 2048;
  return o;
}

// Both caches, their streams, and `n` sequences of `len` tokens on the
// sender (pages taken by steps; their bytes are whatever the pool holds:
// the bench moves bytes, the tests check them).
struct Setup {
  std::unique_ptr<KVCache> cache[2];
  cudaStream_t stream[2] = {nullptr, nullptr};
  std::vector<SequenceId> seqs;
  int64_t image_bytes = 0;
  std::string error;

  Setup(int layers, int64_t pages, int64_t len, int64_t n) {
    Link& l = TheLink();
    for (int s = 0; s < 2; ++s) {
      cudaSetDevice(l.dev[s]);
      cudaStreamCreateWithFlags(&stream[s], cudaStreamNonBlocking);
      auto c = KVCache::Create(ModelOptions(layers, pages, l.dev[s]));
      if (!c.ok()) {
        error = std::string(c.status().message());
        return;
      }
      cache[s] = std::make_unique<KVCache>(std::move(*c));
    }
    cudaSetDevice(l.dev[0]);
    for (int64_t i = 0; i < n; ++i) {
      SequenceId q = cache[0]->CreateSequence().value();
      auto step = cache[0]->PrepareStep({{q, static_cast<int32_t>(len)}}, stream[0]);
      if (!step.ok()) {
        error = std::string(step.status().message());
        return;
      }
      seqs.push_back(q);
    }
    if (!seqs.empty()) {
      auto b = cache[0]->ExportedBytes(seqs[0]);
      if (!b.ok()) {
        error = std::string(b.status().message());
        return;
      }
      image_bytes = *b;
    }
    cudaStreamSynchronize(stream[0]);
  }
  ~Setup() {
    Link& l = TheLink();
    for (int s = 0; s < 2; ++s) {
      cudaSetDevice(l.dev[s]);
      cache[s].reset();
      if (stream[s] != nullptr) cudaStreamDestroy(stream[s]);
    }
    cudaSetDevice(l.dev[0]);
  }
};

// Sends every sequence of `setup` through a fresh sender/receiver pair,
// kRuns times (plus one warm-up); the median ms of one run, or < 0.
double TimeTransfer(Setup& setup, int slots, int depth, std::string* error) {
  Link& l = TheLink();
  TransferOptions o[2];
  for (int s = 0; s < 2; ++s) {
    o[s].slot_bytes = setup.image_bytes;
    o[s].num_slots = slots;
    o[s].pipeline_depth = depth;
    o[s].cache_stream = setup.stream[s];
    o[s].timeout_ms = 60000;
  }
  cudaSetDevice(l.dev[0]);
  auto sender = SequenceSender::Create(setup.cache[0].get(), l.end[0].get(), o[0]);
  cudaSetDevice(l.dev[1]);
  auto receiver = SequenceReceiver::Create(setup.cache[1].get(), l.end[1].get(), o[1]);
  if (!sender.ok() || !receiver.ok()) {
    *error = std::string(sender.ok() ? receiver.status().message() : sender.status().message());
    return -1;
  }
  std::vector<double> ms;
  const int64_t n = static_cast<int64_t>(setup.seqs.size());
  for (int run = 0; run <= kRuns; ++run) {
    const double t0 = NowMs();
    std::string err[2];
    // The receiver: until it has every sequence, its commits done.
    auto receive = [&](bool alone) -> bool {
      cudaSetDevice(l.dev[1]);
      absl::Status b = alone ? receiver->RunUntilResults(n) : receiver->Progress();
      if (!b.ok()) err[1] = std::string(b.message());
      return b.ok();
    };
    auto send_all = [&]() -> bool {
      cudaSetDevice(l.dev[0]);
      for (SequenceId q : setup.seqs) {
        if (auto id = sender->Send(q); !id.ok()) {
          err[0] = std::string(id.status().message());
          return false;
        }
      }
      return true;
    };
    if (l.two_gpus) {
      // One thread per rank, as two processes would be.
      std::thread rt([&] { receive(true); });
      if (send_all()) {
        absl::Status a = sender->RunUntilIdle();
        if (!a.ok()) err[0] = std::string(a.message());
      }
      rt.join();
    } else {
      // The self pair is one object pair: one thread drives both.
      if (send_all()) {
        while (sender->in_flight() > 0 && err[1].empty()) {
          absl::Status a = sender->Progress();
          if (!a.ok()) {
            err[0] = std::string(a.message());
            break;
          }
          receive(false);
        }
      }
    }
    if (!err[0].empty() || !err[1].empty()) {
      *error = err[0].empty() ? err[1] : err[0];
      return -1;
    }
    cudaSetDevice(l.dev[1]);
    cudaStreamSynchronize(setup.stream[1]);
    const double t1 = NowMs();
    for (const TransferResult& r : sender->TakeResults()) {
      if (r.state != TransferState::kConfirmed) {
        *error = "transfer " + std::to_string(r.id) + " " + TransferStateName(r.state) + ": " +
                 std::string(r.status.message());
        return -1;
      }
    }
    cudaSetDevice(l.dev[1]);
    for (const TransferResult& r : receiver->TakeResults()) {
      (void)setup.cache[1]->ReleaseSequence(r.seq);
    }
    if (run > 0) ms.push_back(t1 - t0);
  }
  // End the link cleanly (the receiver stops listening) so the next case
  // starts a new pair on the same endpoints.
  cudaSetDevice(l.dev[0]);
  if (absl::Status c = sender->Close(); !c.ok()) {
    *error = std::string(c.message());
    return -1;
  }
  cudaSetDevice(l.dev[1]);
  (void)receiver->Progress();
  cudaSetDevice(l.dev[0]);
  return Median(ms);
}

int64_t SequencesPerGiB(int64_t image_bytes) { return (kGiB + image_bytes - 1) / image_bytes; }

// Image bytes of one L-token sequence of the 8-layer bench model.
constexpr int64_t kBytesPerToken8 = 8 * 2 * 8 * (64 + 8);  // layers * K/V * heads * (data + scales)

std::map<int64_t, double>& NcclGBps() {
  static std::map<int64_t, double> m;
  return m;
}

void BM_DeviceCopy(benchmark::State& state) {
  if (!bench::HaveGpu(state)) return;
  for (auto _ : state) {
    const double gbps = bench::CopyGBps();
    BENCH_CHECK(state, gbps > 0, "copy failed");
    bench::Report(state, 2.0 * (size_t{2} << 30) / (gbps * 1e9) * 1e3, 2.0 * (size_t{2} << 30));
  }
}

void BM_NcclSendRecv(benchmark::State& state) {
  if (!bench::HaveGpu(state)) return;
  Link& l = TheLink();
  BENCH_CHECK(state, l.ok, l.error.c_str());
  const int64_t len = state.range(0);
  const int64_t approx = len * kBytesPerToken8 + (1 << 16);
  const int64_t n = SequencesPerGiB(approx);
  // The exact image size, from a cache.
  Setup probe(8, (len + 15) / 16 + 8, len, 1);
  BENCH_CHECK(state, probe.error.empty(), probe.error.c_str());
  const int64_t bytes = probe.image_bytes;
  bench::DeviceMem src, dst;
  cudaSetDevice(l.dev[0]);
  BENCH_CHECK(state, src.Alloc(bytes), "cudaMalloc");
  cudaSetDevice(l.dev[1]);
  BENCH_CHECK(state, dst.Alloc(bytes), "cudaMalloc");
  cudaSetDevice(l.dev[0]);
  for (auto _ : state) {
    std::vector<double> ms;
    for (int run = 0; run <= kRuns; ++run) {
      const double t0 = NowMs();
      bool ok[2] = {true, true};
      // Side s posts its n operations and polls the last one.
      auto side = [&](int s) {
        cudaSetDevice(l.dev[s]);
        Transport::OpId last = 0;
        for (int64_t i = 0; i < n && ok[s]; ++i) {
          auto op = s == 0 ? l.end[0]->Send(src.get(), bytes) : l.end[1]->Recv(dst.get(), bytes);
          ok[s] = op.ok();
          if (ok[s]) last = *op;
        }
        while (ok[s]) {
          auto done = l.end[s]->Poll(last);
          ok[s] = done.ok();
          if (ok[s] && *done) break;
        }
      };
      if (l.two_gpus) {
        std::thread rt([&] { side(1); });
        side(0);
        rt.join();
      } else {
        // Self pair: interleave so each send finds its receive.
        Transport::OpId last = 0;
        for (int64_t i = 0; i < n && ok[0]; ++i) {
          auto s = l.end[0]->Send(src.get(), bytes);
          auto r = l.end[1]->Recv(dst.get(), bytes);
          ok[0] = s.ok() && r.ok();
          if (ok[0]) last = *r;
        }
        while (ok[0]) {
          auto done = l.end[1]->Poll(last);
          ok[0] = done.ok();
          if (ok[0] && *done) break;
        }
      }
      BENCH_CHECK(state, ok[0] && ok[1], "NCCL send/recv failed");
      const double t1 = NowMs();
      if (run > 0) ms.push_back(t1 - t0);
    }
    const double med = Median(ms);
    bench::Report(state, med, static_cast<double>(n * bytes));
    NcclGBps()[len] = n * bytes / (med * 1e-3) / 1e9;
    state.counters["sequences"] = static_cast<double>(n);
    state.counters["image_bytes"] = static_cast<double>(bytes);
  }
  state.SetLabel(l.label);
}

void BM_Transfer(benchmark::State& state) {
  if (!bench::HaveGpu(state)) return;
  Link& l = TheLink();
  BENCH_CHECK(state, l.ok, l.error.c_str());
  const int64_t len = state.range(0);
  const int64_t approx = len * kBytesPerToken8 + (1 << 16);
  const int64_t n = SequencesPerGiB(approx);
  const int64_t pages = n * ((len + 15) / 16) + 64;
  Setup setup(8, pages, len, n);
  BENCH_CHECK(state, setup.error.empty(), setup.error.c_str());
  // Staging for the pipeline: a transfer holds a slot for about depth + 2
  // steps, so enough slots that each step carries several images: 1 GiB of
  // slots per side, 8 .. 128 of them, no more than there are sequences.
  const int slots = static_cast<int>(std::min<int64_t>(
      n, std::min<int64_t>(128, std::max<int64_t>(8, kGiB / setup.image_bytes))));
  const int depth = 2;
  for (auto _ : state) {
    std::string error;
    const double med = TimeTransfer(setup, slots, depth, &error);
    BENCH_CHECK(state, med > 0, error.c_str());
    const double bytes = static_cast<double>(n * setup.image_bytes);
    bench::Report(state, med, bytes);
    const double gbps = bytes / (med * 1e-3) / 1e9;
    auto it = NcclGBps().find(len);
    state.counters["pct_of_nccl"] =
        it != NcclGBps().end() && it->second > 0 ? 100.0 * gbps / it->second : 0.0;
    state.counters["sequences"] = static_cast<double>(n);
    state.counters["image_bytes"] = static_cast<double>(setup.image_bytes);
    state.counters["slots"] = slots;
    state.counters["pipeline_depth"] = depth;
  }
  state.SetLabel(l.label);
}

void BM_Latency4k32Layers(benchmark::State& state) {
  if (!bench::HaveGpu(state)) return;
  Link& l = TheLink();
  BENCH_CHECK(state, l.ok, l.error.c_str());
  Setup setup(32, 4096 / 16 + 16, 4096, 1);
  BENCH_CHECK(state, setup.error.empty(), setup.error.c_str());
  for (auto _ : state) {
    std::string error;
    const int depth = static_cast<int>(state.range(0));
    const double med = TimeTransfer(setup, 1, depth, &error);
    BENCH_CHECK(state, med > 0, error.c_str());
    bench::Report(state, med, static_cast<double>(setup.image_bytes));
    state.counters["image_bytes"] = static_cast<double>(setup.image_bytes);
    state.counters["pipeline_depth"] = depth;
  }
  state.SetLabel(l.label);
}

BENCHMARK(BM_DeviceCopy)->UseManualTime()->Iterations(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_NcclSendRecv)
    ->Arg(2048)->Arg(4096)->Arg(8192)->Arg(16384)->Arg(32768)
    ->UseManualTime()->Iterations(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Transfer)
    ->Arg(2048)->Arg(4096)->Arg(8192)->Arg(16384)->Arg(32768)
    ->UseManualTime()->Iterations(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Latency4k32Layers)->Arg(1)->Arg(2)->UseManualTime()->Iterations(1)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace fp4kv

BENCHMARK_MAIN();
