// Decode attention straight from NVFP4 pages on the GPU (keys NVFP4 or FP8
// E4M3, "K8V4"; values NVFP4), against a
// device-to-device copy measured in the same process (bench/kernels_bench.cu
// conventions: CUDA events on a dedicated stream, a few warm-up runs, the
// median of kTimedRuns timed runs).
//
// Shapes: 8 KV heads, 32 qo heads (group 4; group 8: 64) and head_dim 128
// unless the case's args say otherwise, page size 16,
// bf16 q/out, NHD tuple pools whose every slot holds random bf16 rows
// appended through the Appender (bench::AppendRandomRows; FP8 keys too),
// every request's pages a random permutation of the pool, q random. When one
// case's cache is smaller than 256 MB, several disjoint page sets (one block
// table each) are rotated through the timed runs so L2 (60 MB on H200) never
// holds a case. Timed region: one Run() (attention + merge kernels), CUDA
// events around it.
// Counters per case:
//   bytes          K + V codes and scales of the attended tokens (NVFP4 keys:
//                  Dk/2 + Dk/16 bytes per token and head, FP8 keys: Dk; values
//                  Dv/2 + Dv/16), plus q and out (the traffic a perfect kernel
//                  needs)
//   GBps           bytes / median time
//   pct_of_copy    GBps as a percentage of the copy's GBps
//   median_us      the median time of one Run() (attention + merge kernels)
//   partial_bytes  split-KV partials written and read back (not in bytes),
//                  from the same schedule the kernel derives on the device
// Arg rows_in_m:1 forces the rows-in-M kernel family (FP4KV_ATTENTION_KERNEL
// set around Create()); 0 is the default choice (tokens in M).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "bench/bench_util.cuh"
#include "fp4kv/attention.h"
#include "fp4kv/format.h"
#include "fp4kv/geometry.h"
#include "fp4kv/ops.h"
#include "fp4kv/tensor.h"
#include "kernels/attention.cuh"

namespace fp4kv {
namespace {

constexpr int kTimedRuns = 51;

using bench::CopyGBps;
using bench::DeviceCache;
using bench::DeviceMem;
using bench::FillBytes;
using bench::FillHalves;
using bench::HaveGpu;
using bench::MedianMs;
using bench::Report;

// ------------------------------------------------------------------ copy
void BM_DeviceCopy(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const double gbps = CopyGBps();
  BENCH_CHECK(state, gbps > 0, "copy could not be measured");
  const double bytes = 2.0 * (size_t{2} << 30);
  for (auto _ : state) Report(state, bytes / (gbps * 1e9) * 1e3, bytes);
}
BENCHMARK(BM_DeviceCopy)->UseManualTime()->Iterations(1)->Unit(benchmark::kMicrosecond);


// Partial bytes (written + read) of the split-KV schedule the kernel derives
// for equal lengths: mirrors kernels/attention.cuh (target chunk count
// max(0.8 ctas + 1, ctas - groups), at least 64 tokens a chunk, chunks
// rounded to 16); `ctas_per_sm` of the kernel that runs.
double PartialBytes(int num_sms, int ctas_per_sm, int batch, int len, int kv_heads, int rows,
                    int d) {
  const int64_t ctas = static_cast<int64_t>(num_sms) * ctas_per_sm;
  const int mtiles = (rows + 15) / 16;
  const int64_t total = static_cast<int64_t>(batch) * len * kv_heads * mtiles;
  const int64_t groups = static_cast<int64_t>(batch) * kv_heads * mtiles;
  const int64_t target = std::max<int64_t>(ctas * 4 / 5 + 1, ctas - groups);
  int64_t c = std::max<int64_t>(64, (total + target - 1) / target);
  const int64_t s0 = (len + c - 1) / c;
  int64_t ch = (len + s0 - 1) / s0;
  ch = (ch + 15) / 16 * 16;
  const int64_t splits = (len + ch - 1) / ch;
  if (splits <= 1) return 0.0;
  const int64_t slot_rows = std::min(16, rows);
  return 2.0 * batch * kv_heads * mtiles * splits * slot_rows * (d + 2) * 4.0;
}

// CTAs per SM of the kernel Create() picks for these args (mirrors
// kernels/attention/launch.cuh).
int CtasPerSm(bool rows_in_m, int dim, bool fp8_keys, int rows) {
  const int base = dim == 256 ? 2 : 4;
  if (rows_in_m || !kernels::TokensInMTakes(dim, rows)) return base;
  (void)fp8_keys;
  return rows > 8 && dim == 128 ? 3 : base;
}

// args: batch, seq_len, q_len, fp8_keys (0: NVFP4 keys, 1: FP8 E4M3 keys),
// group (qo heads per KV head), head_dim, rows_in_m (1: that family forced).
void BM_DecodeAttention(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const int batch = static_cast<int>(state.range(0));
  const int len = static_cast<int>(state.range(1));
  const int q_len = static_cast<int>(state.range(2));
  const bool fp8_keys = state.range(3) != 0;
  const int group = static_cast<int>(state.range(4));
  const int dim = static_cast<int>(state.range(5));
  const bool rows_in_m = state.range(6) != 0;
  constexpr int kKvHeads = 8, kPage = 16;
  const int qo_heads = kKvHeads * group;
  const int pages_per_seq = (len + kPage - 1) / kPage;
  const int64_t pages_needed = static_cast<int64_t>(batch) * pages_per_seq;
  CacheGeometry g;
  g.num_kv_heads = kKvHeads;
  g.head_dim_k = g.head_dim_v = dim;
  g.page_size = kPage;
  g.layout = Layout::kNHD;
  g.key_format = fp8_keys ? KeyFormat::kFp8 : KeyFormat::kNvfp4;
  const double bytes_per_page = static_cast<double>(g.PageBytes());
  const int rotations = static_cast<int>(
      std::max(1.0, std::ceil(256e6 / (bytes_per_page * static_cast<double>(pages_needed)))));
  g.num_pages = pages_needed * rotations;
  // NVFP4 pools (their V halves serve the FP8-key cache too) and, for FP8
  // keys, K rows of Dk E4M3 codes (finite: bytes 1 .. 0x7e).
  CacheGeometry g4 = g;
  g4.key_format = KeyFormat::kNvfp4;
  DeviceCache cache;
  BENCH_CHECK(state, cache.Init(g4, 7), "cache allocation");
  DeviceMem k8;
  if (fp8_keys) {
    BENCH_CHECK(state,
                k8.Alloc(static_cast<size_t>(g.num_pages) * kPage * kKvHeads * dim) &&
                    FillBytes(k8, 17, true),
                "FP8 key allocation");
  }

  const int64_t total_q = static_cast<int64_t>(batch) * q_len;
  DeviceMem q, out, tables, lens, indptr, ws;
  BENCH_CHECK(state, q.Alloc(total_q * qo_heads * dim * 2) && FillHalves(q, 11, true),
              "q allocation");
  BENCH_CHECK(state, out.Alloc(total_q * qo_heads * dim * 2), "out allocation");
  std::vector<int32_t> perm(g.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(3);
  std::shuffle(perm.begin(), perm.end(), rng);
  BENCH_CHECK(state, tables.Alloc(perm.size() * sizeof(int32_t)) && tables.Upload(perm),
              "tables");
  const std::vector<int32_t> seq(batch, len);
  BENCH_CHECK(state, lens.Alloc(seq.size() * 4) && lens.Upload(seq), "seq_lens");
  std::vector<int32_t> ip(batch + 1);
  for (int b = 0; b <= batch; ++b) ip[b] = b * q_len;
  BENCH_CHECK(state, indptr.Alloc(ip.size() * 4) && indptr.Upload(ip), "q_indptr");

  const Device d = Device::Cuda(0);
  DecodeAttention::Options o;
  o.geometry = g;
  o.num_qo_heads = qo_heads;
  o.dtype = DType::kBF16;
  o.table_dtype = DType::kI32;
  o.max_batch = batch;
  o.max_pages_per_seq = pages_per_seq;
  o.max_q_len = q_len;
  o.device = d;
  if (rows_in_m) {
    setenv("FP4KV_ATTENTION_KERNEL", "rows_in_m", 1);
  } else {
    unsetenv("FP4KV_ATTENTION_KERNEL");
  }
  auto op = DecodeAttention::Create(o);
  unsetenv("FP4KV_ATTENTION_KERNEL");
  BENCH_CHECK(state, op.ok(), "DecodeAttention::Create");
  BENCH_CHECK(state, ws.Alloc(static_cast<size_t>(std::max<int64_t>(op->WorkspaceBytes(), 256))),
              "workspace");
  DecodeAttentionArgs a;
  a.q = TensorView::Contiguous(q.get(), DType::kBF16, {total_q, qo_heads, dim}, d);
  if (q_len > 1) a.q_indptr = TensorView::Contiguous(indptr.get(), DType::kI32, {batch + 1}, d);
  a.seq_lens = TensorView::Contiguous(lens.get(), DType::kI32, {batch}, d);
  a.out = TensorView::Contiguous(out.get(), DType::kBF16, {total_q, qo_heads, dim}, d);
  a.k_scale = GlobalScale::Value(0.01f);
  a.v_scale = GlobalScale::Value(0.01f);
  PagedCache view = cache.View();
  if (fp8_keys) {
    view = PagedCache::Fp8Keys(
        TensorView::Contiguous(k8.get(), DType::kU8, {g.num_pages, kPage, kKvHeads, dim}, d),
        view.v_data, view.v_scales, Layout::kNHD);
    // FP8 key rows (and the values again) written through the Appender.
    const PagedCache append_view = PagedCache::Fp8Keys(
        TensorView::Contiguous(k8.get(), DType::kE4M3, {g.num_pages, kPage, kKvHeads, dim}, d),
        view.v_data, view.v_scales, Layout::kNHD);
    BENCH_CHECK(state, bench::AppendRandomRows(g, append_view, 19), "FP8 key append");
  }
  cudaStream_t s;
  BENCH_CUDA(state, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int rot = 0;
  auto run = [&] {
    a.block_tables =
        TensorView::Contiguous(tables.get<int32_t>() + static_cast<int64_t>(rot) * pages_needed,
                               DType::kI32, {batch, pages_per_seq}, d);
    rot = (rot + 1) % rotations;
    return op->Run(a, view, ws.get(), op->WorkspaceBytes(), s);
  };
  {
    const absl::Status st = run();
    BENCH_CHECK(state, st.ok(), "DecodeAttention::Run");
  }
  int num_sms = 0;
  BENCH_CUDA(state, cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  const double kv_bytes = static_cast<double>(batch) * len * kKvHeads * (bytes_per_page / kPage /
                                                                         kKvHeads);
  const double bytes = kv_bytes + 2.0 * total_q * qo_heads * dim * 2;
  for (auto _ : state) Report(state, MedianMs(s, [&] { (void)run(); }, kTimedRuns), bytes);
  const int rows = std::min(16, group * q_len);
  state.counters["partial_bytes"] =
      PartialBytes(num_sms, CtasPerSm(rows_in_m, dim, fp8_keys, rows), batch, len, kKvHeads,
                   group * q_len, dim);
  BENCH_CUDA(state, cudaStreamSynchronize(s));
  BENCH_CUDA(state, cudaGetLastError());
  (void)cudaStreamDestroy(s);
}
// The issue's table for both families and both key formats, then group 8
// and head_dim 64 at 64 x 4096.
void DecodeAttentionArgs(benchmark::internal::Benchmark* b) {
  for (int rows_in_m = 0; rows_in_m < 2; ++rows_in_m) {
    for (int fp8 = 0; fp8 < 2; ++fp8) {
      for (const auto& s : {std::pair<int, int>{64, 4096}, {256, 2048}, {8, 16384}, {128, 512},
                            {1, 32768}}) {
        b->Args({s.first, s.second, 1, fp8, 4, 128, rows_in_m});
      }
      b->Args({64, 4096, 4, fp8, 4, 128, rows_in_m});
      b->Args({64, 4096, 1, fp8, 8, 128, rows_in_m});
      b->Args({64, 4096, 1, fp8, 4, 64, rows_in_m});
    }
  }
}
BENCHMARK(BM_DecodeAttention)
    ->ArgNames({"batch", "seq_len", "q_len", "fp8_keys", "group", "head_dim", "rows_in_m"})
    ->Apply(DecodeAttentionArgs)
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);
}  // namespace
}  // namespace fp4kv

BENCHMARK_MAIN();
