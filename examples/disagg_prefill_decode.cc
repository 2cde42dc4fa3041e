// Disaggregated prefill -> decode on two GPUs, one process each.
//
// Rank 0 (prefill, GPU 0) fills sequences with real appends (random bf16
// K/V through the cache's appender), hashes each sequence's dequantized K/V
// (ReadSequence) and sends the sequences through NCCL (SequenceSender). Rank
// 1 (decode, GPU 1) imports them (SequenceReceiver), checks that its
// dequantized K/V hash to exactly the prefill side's (the dequantized bytes
// are equal byte for byte), then runs decode steps on them (append one token
// per sequence, decode attention from the NVFP4 pages). Rank 0 prints the
// transfer bandwidth.
//
//   disagg_prefill_decode                      forks: parent rank 0, child rank 1
//   disagg_prefill_decode --rank=R --id-file=F two processes started apart; rank 0
//                                              writes the NCCL unique id to F
// Other flags: --seqs=N (8) --min-len=T (512) --max-len=T (4096) --layers=L (8)
//              --steps=S (16). Needs two GPUs (exit 2 otherwise) and NCCL
// (libnccl.so.2 on LD_LIBRARY_PATH); scripts/run_disagg.sh sets that up.
#include <cuda_runtime_api.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fp4kv/format.h"
#include "fp4kv/kv_cache.h"
#include "fp4kv/transfer.h"

namespace {

using fp4kv::DType;
using fp4kv::KVCache;
using fp4kv::SequenceId;
using fp4kv::TensorView;

#define CHECK_OK(expr)                                                                \
  do {                                                                                \
    absl::Status s_ = (expr);                                                         \
    if (!s_.ok()) {                                                                   \
      std::fprintf(stderr, "rank %d: %s:%d: %s\n", g_rank, __FILE__, __LINE__,       \
                   s_.ToString().c_str());                                            \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)
#define CHECK_CUDA(call)                                                              \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "rank %d: %s: %s\n", g_rank, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

int g_rank = 0;

struct Flags {
  int rank = -1;  // -1: fork
  std::string id_file;
  int seqs = 8;
  int64_t min_len = 512, max_len = 4096;
  int layers = 8;
  int steps = 16;
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&](const char* name) -> const char* {
      const size_t n = std::strlen(name);
      return a.compare(0, n, name) == 0 ? a.c_str() + n : nullptr;
    };
    if (const char* v = val("--rank=")) f.rank = std::atoi(v);
    else if (const char* v = val("--id-file=")) f.id_file = v;
    else if (const char* v = val("--seqs=")) f.seqs = std::atoi(v);
    else if (const char* v = val("--min-len=")) f.min_len = std::atoll(v);
    else if (const char* v = val("--max-len=")) f.max_len = std::atoll(v);
    else if (const char* v = val("--layers=")) f.layers = std::atoi(v);
    else if (const char* v = val("--steps=")) f.steps = std::atoi(v);
    else {
      std::fprintf(stderr, "unknown flag %s (see the comment at the top of the source)\n",
                   a.c_str());
      std::exit(2);
    }
  }
  if (f.seqs < 1 || f.min_len < 1 || f.max_len < f.min_len || f.max_len > 32768 ||
      f.layers < 1 || f.steps < 0 || (f.rank != -1 && (f.rank < 0 || f.rank > 1)) ||
      (f.rank != -1 && f.id_file.empty())) {
    std::fprintf(stderr, "bad flags: need seqs >= 1, 1 <= min-len <= max-len <= 32768, "
                         "layers >= 1, steps >= 0, rank 0 or 1 with --id-file\n");
    std::exit(2);
  }
  return f;
}

fp4kv::KVCacheOptions CacheOptions(const Flags& f, int device) {
  fp4kv::KVCacheOptions o;
  o.num_layers = f.layers;
  o.geometry.num_kv_heads = 8;
  o.geometry.head_dim_k = o.geometry.head_dim_v = 128;
  o.geometry.page_size = 16;
  o.geometry.layout = fp4kv::Layout::kNHD;
  o.geometry.num_pages = f.seqs * ((f.max_len + f.steps + 15) / 16) + 64;
  o.device = fp4kv::Device::Cuda(device);
  // Scales a checkpoint's calibration would give; the same on both sides.
  o.k_global_scales.assign(f.layers, 4.0f / 448.0f / 6.0f * 8.0f);
  o.v_global_scales.assign(f.layers, 4.0f / 448.0f / 6.0f * 8.0f);
  o.max_seqs_per_step = f.seqs;
  o.max_tokens_per_step = static_cast<int>(f.max_len);
  o.max_pages_per_seq = static_cast<int>((f.max_len + f.steps + 15) / 16);
  return o;
}

// FNV-1a 64 over bytes.
uint64_t Hash(const std::vector<uint8_t>& v, uint64_t h = 1469598103934665603ull) {
  for (uint8_t b : v) h = (h ^ b) * 1099511628211ull;
  return h;
}

// The hash of a sequence's dequantized K/V over every layer (ReadSequence
// into bf16 rows, downloaded).
uint64_t HashSequence(const KVCache& cache, SequenceId seq, cudaStream_t stream) {
  const int64_t len = *cache.SequenceLength(seq);
  const int64_t H = cache.geometry().num_kv_heads, D = cache.geometry().head_dim_k;
  const size_t bytes = static_cast<size_t>(len * H * D * 2);
  void* k = nullptr;
  void* v = nullptr;
  CHECK_CUDA(cudaMalloc(&k, bytes));
  CHECK_CUDA(cudaMalloc(&v, bytes));
  std::vector<uint8_t> host(bytes);
  uint64_t h = 1469598103934665603ull;
  for (int l = 0; l < cache.num_layers(); ++l) {
    CHECK_OK(cache.ReadSequence(l, seq,
                                TensorView::Contiguous(k, DType::kBF16, {len, H, D}, cache.device()),
                                TensorView::Contiguous(v, DType::kBF16, {len, H, D}, cache.device()),
                                stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    CHECK_CUDA(cudaMemcpy(host.data(), k, bytes, cudaMemcpyDeviceToHost));
    h = Hash(host, h);
    CHECK_CUDA(cudaMemcpy(host.data(), v, bytes, cudaMemcpyDeviceToHost));
    h = Hash(host, h);
  }
  cudaFree(k);
  cudaFree(v);
  return h;
}

// What rank 0 tells rank 1 after the sequences: per transfer, its hash.
struct Check {
  uint64_t transfer = 0;
  int64_t length = 0;
  uint64_t hash = 0;
};
constexpr int kMaxSeqs = 256;

void WriteId(const std::string& path, const fp4kv::NcclUniqueId& id) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out.write(id.bytes, sizeof(id.bytes));
  }
  std::rename(tmp.c_str(), path.c_str());
}

fp4kv::NcclUniqueId ReadId(const std::string& path) {
  fp4kv::NcclUniqueId id;
  for (int i = 0; i < 600; ++i) {
    std::ifstream in(path, std::ios::binary);
    if (in.read(id.bytes, sizeof(id.bytes))) return id;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::fprintf(stderr, "rank 1: no NCCL id in %s after 60 s\n", path.c_str());
  std::exit(1);
}

int Prefill(const Flags& f, const fp4kv::NcclUniqueId& id) {
  CHECK_CUDA(cudaSetDevice(0));
  absl::StatusOr<std::unique_ptr<fp4kv::NcclCommunicator>> comm =
      fp4kv::NcclCommunicator::Create(id, 2, 0, fp4kv::Device::Cuda(0));
  CHECK_OK(comm.status());
  absl::StatusOr<std::unique_ptr<fp4kv::Transport>> link = (*comm)->Connect(1);
  CHECK_OK(link.status());
  absl::StatusOr<KVCache> created = KVCache::Create(CacheOptions(f, 0));
  CHECK_OK(created.status());
  KVCache& cache = *created;
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  absl::StatusOr<fp4kv::CacheAppender> appender = cache.appender(DType::kBF16);
  CHECK_OK(appender.status());

  // Prefill: one step per sequence with all its prompt tokens.
  const int64_t H = 8, D = 128;
  std::mt19937_64 rng(1234);
  std::normal_distribution<float> normal;
  const size_t max_elems = static_cast<size_t>(f.max_len * H * D);
  std::vector<uint16_t> host(max_elems);
  void* kin = nullptr;
  void* vin = nullptr;
  CHECK_CUDA(cudaMalloc(&kin, max_elems * 2));
  CHECK_CUDA(cudaMalloc(&vin, max_elems * 2));
  std::vector<SequenceId> seqs;
  int64_t tokens = 0;
  for (int s = 0; s < f.seqs; ++s) {
    const int64_t len = f.min_len + static_cast<int64_t>(rng() % (f.max_len - f.min_len + 1));
    absl::StatusOr<SequenceId> created = cache.CreateSequence();
    CHECK_OK(created.status());
    const SequenceId seq = *created;
    CHECK_OK(cache.PrepareStep({{seq, static_cast<int32_t>(len)}}, stream).status());
    for (int l = 0; l < f.layers; ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int64_t i = 0; i < len * H * D; ++i) host[i] = fp4kv::FloatToBf16Bits(normal(rng));
        CHECK_CUDA(cudaMemcpyAsync(kv == 0 ? kin : vin, host.data(), len * H * D * 2,
                                   cudaMemcpyHostToDevice, stream));
      }
      CHECK_OK(appender->Run(l, TensorView::Contiguous(kin, DType::kBF16, {len, H, D}, cache.device()),
                             TensorView::Contiguous(vin, DType::kBF16, {len, H, D}, cache.device()),
                             stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));  // host buffer reuse
    }
    seqs.push_back(seq);
    tokens += len;
  }
  std::vector<uint64_t> hashes;
  int64_t biggest = 0, total = 0;
  for (SequenceId s : seqs) {
    hashes.push_back(HashSequence(cache, s, stream));
    const int64_t b = *cache.ExportedBytes(s);
    biggest = std::max(biggest, b);
    total += b;
  }
  std::printf("prefill (GPU 0): %d sequences, %lld tokens, %d layers, %.1f MB of images\n",
              f.seqs, static_cast<long long>(tokens), f.layers, total / 1e6);

  fp4kv::TransferOptions o;
  o.slot_bytes = biggest;
  // A transfer holds its slot for about pipeline_depth + 2 protocol steps:
  // 8 slots keep about two images per step on the link.
  o.num_slots = 8;
  o.cache_stream = stream;
  o.release_on_confirm = true;
  // The slot size must match on both sides: tell rank 1 first.
  int64_t hello[2] = {biggest, f.seqs};
  int64_t* pinned = nullptr;
  CHECK_CUDA(cudaMallocHost(reinterpret_cast<void**>(&pinned), sizeof(hello)));
  std::memcpy(pinned, hello, sizeof(hello));
  absl::StatusOr<fp4kv::Transport::OpId> op = (*link)->SendControl(pinned, sizeof(hello));
  CHECK_OK(op.status());
  while (!*(*link)->Poll(*op)) {
  }
  absl::StatusOr<fp4kv::SequenceSender> sender = fp4kv::SequenceSender::Create(&cache, link->get(), o);
  CHECK_OK(sender.status());
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<fp4kv::TransferId> ids;
  for (SequenceId s : seqs) {
    absl::StatusOr<fp4kv::TransferId> t = sender->Send(s);
    CHECK_OK(t.status());
    ids.push_back(*t);
  }
  CHECK_OK(sender->RunUntilIdle());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int confirmed = 0;
  for (const fp4kv::TransferResult& r : sender->TakeResults()) {
    if (r.state == fp4kv::TransferState::kConfirmed) {
      ++confirmed;
    } else {
      std::printf("transfer %llu: %s (%s)\n", static_cast<unsigned long long>(r.id),
                  fp4kv::TransferStateName(r.state), r.status.ToString().c_str());
    }
  }
  std::printf("transfer: %d of %d sequences confirmed, %.1f MB in %.3f ms: %.1f GB/s "
              "(GPU 0 -> GPU 1, including export, offer/ack round trips and commit)\n",
              confirmed, f.seqs, total / 1e6, secs * 1e3, total / secs / 1e9);
  CHECK_OK(sender->Close());
  // The check table, as one more control message.
  Check* table = nullptr;
  CHECK_CUDA(cudaMallocHost(reinterpret_cast<void**>(&table), sizeof(Check) * kMaxSeqs));
  for (int i = 0; i < kMaxSeqs; ++i) table[i] = Check();
  for (size_t i = 0; i < seqs.size(); ++i) {
    table[i] = {ids[i], 0, hashes[i]};
  }
  op = (*link)->SendControl(table, sizeof(Check) * kMaxSeqs);
  CHECK_OK(op.status());
  while (!*(*link)->Poll(*op)) {
  }
  std::printf("prefill: released %lld of %d sequences after their confirmations\n",
              static_cast<long long>(f.seqs - cache.Stats().num_sequences), f.seqs);
  return confirmed == f.seqs ? 0 : 1;
}

int Decode(const Flags& f, const fp4kv::NcclUniqueId& id) {
  CHECK_CUDA(cudaSetDevice(1));
  absl::StatusOr<std::unique_ptr<fp4kv::NcclCommunicator>> comm =
      fp4kv::NcclCommunicator::Create(id, 2, 1, fp4kv::Device::Cuda(1));
  CHECK_OK(comm.status());
  absl::StatusOr<std::unique_ptr<fp4kv::Transport>> link = (*comm)->Connect(0);
  CHECK_OK(link.status());
  absl::StatusOr<KVCache> created = KVCache::Create(CacheOptions(f, 1));
  CHECK_OK(created.status());
  KVCache& cache = *created;
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int64_t* hello = nullptr;
  CHECK_CUDA(cudaMallocHost(reinterpret_cast<void**>(&hello), 2 * sizeof(int64_t)));
  absl::StatusOr<fp4kv::Transport::OpId> op = (*link)->RecvControl(hello, 2 * sizeof(int64_t));
  CHECK_OK(op.status());
  while (!*(*link)->Poll(*op)) {
  }
  fp4kv::TransferOptions o;
  o.slot_bytes = hello[0];
  o.num_slots = 8;  // as the prefill side
  o.cache_stream = stream;
  absl::StatusOr<fp4kv::SequenceReceiver> receiver =
      fp4kv::SequenceReceiver::Create(&cache, link->get(), o);
  CHECK_OK(receiver.status());
  CHECK_OK(receiver->RunUntilResults(hello[1]));
  std::vector<fp4kv::TransferResult> got = receiver->TakeResults();
  while (!receiver->closed()) CHECK_OK(receiver->Progress());
  Check* table = nullptr;
  CHECK_CUDA(cudaMallocHost(reinterpret_cast<void**>(&table), sizeof(Check) * kMaxSeqs));
  op = (*link)->RecvControl(table, sizeof(Check) * kMaxSeqs);
  CHECK_OK(op.status());
  while (!*(*link)->Poll(*op)) {
  }
  // Dequantized K/V equal to the prefill side's, sequence by sequence.
  int equal = 0;
  std::vector<SequenceId> seqs;
  for (const fp4kv::TransferResult& r : got) {
    if (r.state != fp4kv::TransferState::kConfirmed) continue;
    const uint64_t h = HashSequence(cache, r.seq, stream);
    for (int i = 0; i < kMaxSeqs; ++i) {
      if (table[i].transfer == r.id) {
        equal += table[i].hash == h;
        if (table[i].hash != h) {
          std::printf("decode: transfer %llu: dequantized K/V differ from the prefill side's\n",
                      static_cast<unsigned long long>(r.id));
        }
      }
    }
    seqs.push_back(r.seq);
  }
  std::printf("decode (GPU 1): %zu sequences imported; dequantized K/V equal to the prefill "
              "side's byte for byte: %d of %zu\n",
              seqs.size(), equal, got.size());

  // Decode steps: one new token per sequence, attention from the pages.
  absl::StatusOr<fp4kv::CacheAppender> appender = cache.appender(DType::kBF16);
  CHECK_OK(appender.status());
  fp4kv::CacheAttentionOptions ao;
  ao.num_qo_heads = 32;
  absl::StatusOr<fp4kv::CacheAttention> attention = cache.attention(ao);
  CHECK_OK(attention.status());
  const int64_t S = static_cast<int64_t>(seqs.size()), H = 8, HQ = 32, D = 128;
  void *kin, *vin, *q, *out, *ws;
  const int64_t ws_bytes = attention->WorkspaceBytes();
  CHECK_CUDA(cudaMalloc(&kin, S * H * D * 2));
  CHECK_CUDA(cudaMalloc(&vin, S * H * D * 2));
  CHECK_CUDA(cudaMalloc(&q, f.seqs * HQ * D * 2));
  CHECK_CUDA(cudaMalloc(&out, f.seqs * HQ * D * 2));
  CHECK_CUDA(cudaMalloc(&ws, std::max<int64_t>(ws_bytes, 256)));
  std::vector<uint16_t> host(f.seqs * HQ * D);
  std::mt19937_64 rng(99);
  std::normal_distribution<float> normal;
  for (uint16_t& x : host) x = fp4kv::FloatToBf16Bits(normal(rng));
  CHECK_CUDA(cudaMemcpy(q, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(kin, host.data(), S * H * D * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(vin, host.data() + S * H * D, S * H * D * 2, cudaMemcpyHostToDevice));
  std::vector<fp4kv::StepEntry> entries;
  for (SequenceId s : seqs) entries.push_back({s, 1});
  const auto t0 = std::chrono::steady_clock::now();
  for (int step = 0; step < f.steps && S > 0; ++step) {
    CHECK_OK(cache.PrepareStep(entries, stream).status());
    for (int l = 0; l < f.layers; ++l) {
      CHECK_OK(appender->Run(l, TensorView::Contiguous(kin, DType::kBF16, {S, H, D}, cache.device()),
                             TensorView::Contiguous(vin, DType::kBF16, {S, H, D}, cache.device()),
                             stream));
      CHECK_OK(attention->Run(
          l, TensorView::Contiguous(q, DType::kBF16, {f.seqs, HQ, D}, cache.device()),
          TensorView::Contiguous(out, DType::kBF16, {f.seqs, HQ, D}, cache.device()), ws, ws_bytes,
          stream));
    }
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("decode: %d steps over %lld sequences in %.2f ms (eager launches)\n", f.steps,
              static_cast<long long>(S), ms);
  CHECK_OK(cache.CheckInvariants());
  return equal == f.seqs ? 0 : 1;
}

}  // namespace

// Exit 2 unless this process sees two GPUs.
void NeedTwoGpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    std::fprintf(stderr, "disagg_prefill_decode: needs 2 GPUs (one per process), %d visible\n",
                 count);
    std::exit(2);
  }
}

int main(int argc, char** argv) {
  const Flags f = ParseFlags(argc, argv);
  std::string why;
  if (!fp4kv::NcclAvailable(&why)) {
    std::fprintf(stderr, "disagg_prefill_decode: %s\n", why.c_str());
    return 2;
  }
  if (f.rank >= 0) {
    g_rank = f.rank;
    NeedTwoGpus();
    if (f.rank == 0) {
      absl::StatusOr<fp4kv::NcclUniqueId> id = fp4kv::NcclCreateUniqueId();
      CHECK_OK(id.status());
      WriteId(f.id_file, *id);
      return Prefill(f, *id);
    }
    return Decode(f, ReadId(f.id_file));
  }
  // Fork before anything touches CUDA (a CUDA context does not survive a
  // fork); the parent makes the NCCL id and hands it over through a pipe.
  int fds[2];
  if (pipe(fds) != 0) {
    std::perror("pipe");
    return 1;
  }
  std::fflush(stdout);
  const pid_t child = fork();
  if (child < 0) {
    std::perror("fork");
    return 1;
  }
  if (child == 0) {
    g_rank = 1;
    close(fds[1]);
    fp4kv::NcclUniqueId id;
    size_t got = 0;
    while (got < sizeof(id.bytes)) {
      const ssize_t n = read(fds[0], id.bytes + got, sizeof(id.bytes) - got);
      if (n <= 0) std::_Exit(1);  // the parent gave up
      got += static_cast<size_t>(n);
    }
    NeedTwoGpus();
    const int rc = Decode(f, id);
    std::fflush(stdout);
    std::_Exit(rc);
  }
  close(fds[0]);
  NeedTwoGpus();
  absl::StatusOr<fp4kv::NcclUniqueId> id = fp4kv::NcclCreateUniqueId();
  CHECK_OK(id.status());
  if (write(fds[1], id->bytes, sizeof(id->bytes)) != static_cast<ssize_t>(sizeof(id->bytes))) {
    std::perror("write");
    return 1;
  }
  close(fds[1]);
  const int rc = Prefill(f, *id);
  int status = 0;
  waitpid(child, &status, 0);
  const int child_rc = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
  std::printf("prefill exit %d, decode exit %d\n", rc, child_rc);
  return rc != 0 ? rc : child_rc;
}
