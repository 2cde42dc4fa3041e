// The decode-step setup of the KVCache benchmarks: a cache whose free pages
// are scattered (scatter_pages.h) and whose sequences get random contexts by
// chunked prefill steps (MakeDecodeSetup), random bf16 inputs, and owned
// device buffers. CUDA runtime calls only (no kernels): usable from .cc
// benchmarks.
#ifndef FP4KV_BENCH_DECODE_SETUP_H_
#define FP4KV_BENCH_DECODE_SETUP_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/scatter_pages.h"
#include "fp4kv/format.h"
#include "fp4kv/kv_cache.h"

namespace fp4kv {
namespace bench {

inline constexpr int kDecodePageSize = 16;
inline constexpr int kMinDecodeContext = 2048;
inline constexpr int kMaxDecodeContext = 8192;

// Whether a CUDA device is present (clears the error when not).
inline bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

// Appends the rows of one prefill step in every layer (GPU cases); null:
// nothing is appended (host cases, where the pool bytes do not matter).
using PrefillAppend = std::function<absl::Status(KVCache&, const StepInfo&, int step)>;

// A cache whose `seqs` sequences hold random contexts in [kMinDecodeContext,
// kMaxDecodeContext], with room for `growth` more tokens each; pages scattered
// first. Prefill steps carry up to `step_tokens` tokens of several
// sequences (max_tokens_per_step).
struct DecodeSetup {
  absl::StatusOr<KVCache> cache = absl::UnknownError("unset");
  std::vector<StepEntry> entries;
};

// Options the caller adjusts before Create (step slots, scales); contexts
// in [min_context, max_context].
using OptionsTweak = std::function<void(KVCacheOptions&)>;

inline DecodeSetup MakeDecodeSetup(const CacheGeometry& shape, int layers, int seqs, int growth,
                                   int step_tokens, Device device, Stream stream,
                                   const PrefillAppend& append = nullptr,
                                   const OptionsTweak& tweak = nullptr,
                                   int min_context = kMinDecodeContext,
                                   int max_context = kMaxDecodeContext) {
  DecodeSetup s;
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> ctx(min_context, max_context);
  std::vector<int> contexts(seqs);
  int64_t pages = 0;
  for (int& c : contexts) {
    c = ctx(rng);
    pages += (c + growth + kDecodePageSize - 1) / kDecodePageSize;
  }
  KVCacheOptions o;
  o.num_layers = layers;
  o.geometry = shape;
  o.geometry.page_size = kDecodePageSize;
  o.geometry.num_pages = pages;
  o.max_pages_per_seq = (max_context + growth + kDecodePageSize - 1) / kDecodePageSize;
  o.device = device;
  o.max_seqs_per_step = seqs;
  o.max_tokens_per_step = step_tokens;
  if (tweak) tweak(o);
  s.cache = KVCache::Create(o);
  if (!s.cache.ok()) return s;
  if (absl::Status st = bench::ScatterFreePages(*s.cache, 1234, stream); !st.ok()) {
    s.cache = st;
    return s;
  }
  std::vector<SequenceId> ids(seqs);
  for (int i = 0; i < seqs; ++i) {
    absl::StatusOr<SequenceId> id = bench::NewSequence(*s.cache);
    if (!id.ok()) {
      s.cache = id.status();
      return s;
    }
    ids[i] = *id;
    s.entries.push_back({*id, 1});
  }
  // Chunked prefill: each step takes the next tokens of the sequences in
  // order until step_tokens are used.
  std::vector<int> left = contexts;
  std::vector<StepEntry> step;
  std::vector<int> rows;  // step entry -> sequence index
  int next = 0;
  for (int n_step = 0; next < seqs; ++n_step) {
    step.clear();
    rows.clear();
    int budget = step_tokens;
    for (int i = next; i < seqs && budget > 0; ++i) {
      const int n = std::min(budget, left[i]);
      step.push_back({ids[i], n});
      rows.push_back(i);
      budget -= n;
    }
    absl::StatusOr<StepInfo> info = s.cache->PrepareStep(step, stream);
    absl::Status st = info.status();
    if (st.ok() && append) st = append(*s.cache, *info, n_step);
    if (!st.ok()) {
      s.cache = st;
      return s;
    }
    for (size_t j = 0; j < step.size(); ++j) left[rows[j]] -= step[j].num_new_tokens;
    while (next < seqs && left[next] == 0) ++next;
  }
  for (int i = 0; i < seqs; ++i) {
    absl::StatusOr<int64_t> len = s.cache->SequenceLength(ids[i]);
    if (!len.ok() || *len != contexts[i]) {
      s.cache = absl::InternalError("prefill: a sequence did not get its context length");
      return s;
    }
  }
  return s;
}

// The fraction of consecutive block-table entries that are consecutive
// pages (page j + 1 == page j + 1): about 0 for a scattered pool, 1 for
// pages handed out in ascending order.
inline double AdjacentPageFraction(const KVCache& c, const std::vector<StepEntry>& entries) {
  int64_t pairs = 0, adjacent = 0;
  for (const StepEntry& e : entries) {
    absl::StatusOr<absl::Span<const int32_t>> pages = c.SequencePages(e.seq);
    if (!pages.ok()) continue;
    for (size_t j = 1; j < pages->size(); ++j) {
      ++pairs;
      adjacent += (*pages)[j] == (*pages)[j - 1] + 1;
    }
  }
  return pairs == 0 ? 0.0 : static_cast<double>(adjacent) / static_cast<double>(pairs);
}

// Random bf16 bits like bench_util.cuh's FillHalvesKernel: magnitudes over
// 2^-8..2^4 per 16-value block, random signs, never zero. One host pool,
// made once; device buffers are filled with windows of it at varying
// offsets.
inline const std::vector<uint16_t>& RandomBf16Pool() {
  static const std::vector<uint16_t> pool = [] {
    std::vector<uint16_t> p(size_t{1} << 24);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    auto next = [&x] {  // splitmix64
      uint64_t z = (x += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      return z ^ (z >> 31);
    };
    int octave = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      const uint64_t h = next();
      if (i % 16 == 0) octave = static_cast<int>(h >> 40) % 13 - 8;
      const float m = 1.0f + static_cast<float>(h & 0xffff) / 65536.0f;
      float v = std::ldexp(m, octave - static_cast<int>((h >> 16) & 3));
      if ((h >> 20) & 1) v = -v;
      p[i] = FloatToBf16Bits(v);
    }
    return p;
  }();
  return pool;
}

// Fills `halves` bf16 values at d with the pool from a seed-dependent
// offset (wrapping).
inline bool UploadRandomBf16(void* d, int64_t halves, uint64_t seed) {
  const std::vector<uint16_t>& pool = RandomBf16Pool();
  const int64_t n = static_cast<int64_t>(pool.size());
  int64_t from = static_cast<int64_t>((seed * 0x9e3779b97f4a7c15ull) >> 40) % n;
  int64_t done = 0;
  while (done < halves) {
    const int64_t len = std::min(halves - done, n - from);
    if (cudaMemcpy(static_cast<uint16_t*>(d) + done, pool.data() + from, len * 2,
                   cudaMemcpyHostToDevice) != cudaSuccess) {
      return false;
    }
    done += len;
    from = (from + len) % n;
  }
  return true;
}

// Device allocations of one benchmark case, freed at its end.
class DeviceBuffers {
 public:
  DeviceBuffers() = default;
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  ~DeviceBuffers() {
    for (void* p : ptrs_) (void)cudaFree(p);
  }
  void* Alloc(int64_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 256))) != cudaSuccess) {
      return nullptr;
    }
    ptrs_.push_back(p);
    return p;
  }

 private:
  std::vector<void*> ptrs_;
};

}  // namespace bench
}  // namespace fp4kv

#endif  // FP4KV_BENCH_DECODE_SETUP_H_
