// Host-memory paged caches and inputs for CPU tests of the ops.
#ifndef FP4KV_TESTS_TESTING_HOST_CACHE_H_
#define FP4KV_TESTS_TESTING_HOST_CACHE_H_

#include <cstdint>
#include <vector>

#include "fp4kv/geometry.h"
#include "fp4kv/tensor.h"

namespace fp4kv {
namespace testing {

// Owns the bytes of one paged cache in host memory, in tuple or stacked form
// (FP8 keys, g.fp8_keys(): tuple form, E4M3 key rows and no key scales).
// Every byte starts as `fill`.
class HostCache {
 public:
  HostCache(const CacheGeometry& g, bool stacked, uint8_t fill);
  HostCache(const HostCache&) = delete;
  HostCache& operator=(const HostCache&) = delete;

  const PagedCache& cache() const { return cache_; }
  const CacheGeometry& geometry() const { return g_; }
  // All bytes (data then scales), for whole-state comparisons.
  std::vector<uint8_t> Snapshot() const;
  // Bytes of one row (K or V) at (page, entry, head): data then scales (FP8
  // key rows: data only).
  std::vector<uint8_t> Row(bool is_v, int64_t page, int64_t entry, int64_t head) const;

 private:
  CacheGeometry g_;
  std::vector<uint8_t> data_[2];    // K, V (or one stacked buffer in data_[0])
  std::vector<uint8_t> scales_[2];
  PagedCache cache_;
};

}  // namespace testing
}  // namespace fp4kv

#endif  // FP4KV_TESTS_TESTING_HOST_CACHE_H_
