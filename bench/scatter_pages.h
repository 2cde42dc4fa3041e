// Fragments a fresh KVCache's page pool, so that the pages later steps take
// come out in random order (block tables a random permutation of the pool),
// as in a cache that has served requests for a while.
//
// The pool hands out free pages most recently freed first. ScatterFreePages
// takes every free page into one-page sequences, then releases them in a
// random order: the next allocations return them in the reverse of that
// order. Host work only (PrepareStep on `stream` enqueues the usual step
// uploads, no kernels); pages keep whatever bytes they held.
#ifndef FP4KV_BENCH_SCATTER_PAGES_H_
#define FP4KV_BENCH_SCATTER_PAGES_H_

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp4kv/kv_cache.h"

namespace fp4kv {
namespace bench {

// The one place these benchmarks create a sequence.
inline absl::StatusOr<SequenceId> NewSequence(KVCache& cache) { return cache.CreateSequence(); }

inline absl::Status ScatterFreePages(KVCache& cache, uint64_t seed, Stream stream = nullptr) {
  const KVCacheOptions& o = cache.options();
  const int32_t page = o.geometry.page_size;
  const int per_step = std::max(1, std::min(o.max_seqs_per_step, o.max_tokens_per_step / page));
  std::vector<SequenceId> held;
  std::vector<StepEntry> entries;
  int64_t free = cache.Stats().pages_free;
  while (free > 0) {
    entries.clear();
    const int n = static_cast<int>(std::min<int64_t>(free, per_step));
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<SequenceId> id = NewSequence(cache);
      if (!id.ok()) return id.status();
      held.push_back(*id);
      entries.push_back(StepEntry{*id, page});
    }
    absl::StatusOr<StepInfo> info = cache.PrepareStep(entries, stream);
    if (!info.ok()) return info.status();
    free -= n;
  }
  std::shuffle(held.begin(), held.end(), std::mt19937_64(seed));
  for (SequenceId id : held) {
    if (absl::Status st = cache.ReleaseSequence(id); !st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace bench
}  // namespace fp4kv

#endif  // FP4KV_BENCH_SCATTER_PAGES_H_
