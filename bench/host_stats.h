// Order statistics of host timings, shared by the host-side benchmarks.
#ifndef FP4KV_BENCH_HOST_STATS_H_
#define FP4KV_BENCH_HOST_STATS_H_

#include <algorithm>
#include <cstddef>
#include <vector>

namespace fp4kv {
namespace bench {

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The q-quantile (0 <= q < 1) of v, by rank.
inline double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

}  // namespace bench
}  // namespace fp4kv

#endif  // FP4KV_BENCH_HOST_STATS_H_
