// An fp64 attention reference over a KVCache's own pages, for checking the
// cache's bound attention (KVCache::attention) with something other than the
// code it runs.
//
// It shares no code with src/reference or the kernels: the pages are the
// host copies of the cache's pools (KVCache::LayerCache, read with the views'
// strides), each sequence's pages and length come from SequencePages /
// SequenceLength (not from the step buffers the op reads), the global scales
// from ReadScales, and E2M1 / E4M3 are decoded here from the definitions in
// docs/format.md (sections 1.1, 1.2, 3 and 3.0). Softmax, lse and the
// weighted sum are computed in double, without rounding the output.
#ifndef FP4KV_TESTS_TESTING_CACHE_ATTENTION_REFERENCE_H_
#define FP4KV_TESTS_TESTING_CACHE_ATTENTION_REFERENCE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "fp4kv/kv_cache.h"

namespace fp4kv {
namespace testing {

// The values of one E2M1 nibble and one E4M3 byte (NaN for 0x7f / 0xff),
// written from docs/format.md.
double E2m1Value(uint8_t nibble);
double E4m3Value(uint8_t byte);

// One request of a step as the bound attention sees it: the queries of
// sequence `seq` are q rows first_row .. first_row + q_len - 1; query i sits
// at position SequenceLength(seq) - q_len + i and attends positions 0 .. p.
struct CacheAttentionRequest {
  SequenceId seq = 0;
  int64_t first_row = 0;
  int q_len = 1;
};

// The requests of a step made of `entries` (in order) for a CacheAttention
// with `max_q_len`: 1 gives row b to entry b (one query at the sequence's
// last position); > 1 gives entry b the rows of its new tokens, in the
// order the appender read them (an entry adding no token has no query).
std::vector<CacheAttentionRequest> StepRequests(absl::Span<const StepEntry> entries,
                                                int max_q_len);

// The reference's outputs: out [rows, Hq, Dv] and lse [rows, Hq] (natural
// log), NaN in the rows no request owns (which the op must leave alone).
struct CacheAttentionWant {
  int64_t rows = 0;
  int num_qo_heads = 0;
  int head_dim_v = 0;
  std::vector<double> out;
  std::vector<double> lse;
  // Per (row, head): ||sum_t p_t |v_t| ||_2 with p the normalized weights,
  // the scale of the error that rounding the weights (p to 16 bits for the
  // tensor-core product) can cause. Equal to ||out|| when the values do not
  // cancel; far larger when they do (values of thousands that average out).
  std::vector<double> magnitude;
  int64_t queries = 0;  // (row, head) pairs written
};

// Attention of layer `layer` as the cache holds it after the work enqueued
// so far (CUDA: synchronizes the device first). q: host copy of the queries,
// [rows, num_qo_heads, head_dim_k] f16 or bf16 bits (`dtype`). sm_scale 0:
// 1 / sqrt(head_dim_k). No soft cap, window or sinks.
absl::StatusOr<CacheAttentionWant> CacheAttentionReference(
    const KVCache& cache, int layer, const std::vector<uint16_t>& q, int64_t rows,
    int num_qo_heads, absl::Span<const CacheAttentionRequest> requests,
    DType dtype = DType::kBF16, double sm_scale = 0.0);

// Compares the op's outputs (host copies: out [rows, Hq, Dv] f16/bf16 bits,
// lse [rows, Hq] f32, empty when not written) with the reference, the way
// tests/gpu_attention_test.cu does: per (row, head) ||got - want||_2 <=
// rel_tol * ||want||_2 + two subnormal ulps of the dtype per element, lse
// within lse_tol; a written row must not still be all poison; rows the
// reference leaves alone must hold exactly the poison (out_poison in every
// element, lse_poison's bits). With `cancellation_tol` > 0 the output bound is
// max(rel_tol * ||want||, cancellation_tol * magnitude) instead (for data
// whose values cancel, see CacheAttentionWant::magnitude). "" or the first
// failure. With `worst_ratio`, the largest ||got - want|| / bound over the
// rows compared is stored there (at most 1 when "" is returned).
std::string CompareCacheAttention(const CacheAttentionWant& want,
                                  const std::vector<uint16_t>& out,
                                  const std::vector<float>& lse, DType dtype,
                                  uint16_t out_poison, float lse_poison,
                                  double rel_tol = 4e-3, double lse_tol = 1e-3,
                                  double cancellation_tol = 0.0, double* worst_ratio = nullptr);

// The byte out and lse are filled with before a checked run, and lse's
// poison as a float.
inline constexpr uint8_t kCacheAttentionPoison = 0xA5;
float CacheAttentionLsePoison();

// Runs `op` (bound to `cache`) for `layer` on the current step, whose
// entries were `entries`, with queries q ([rows, Hq, Dk] bf16 bits; lse
// written), out, lse and the workspace poisoned first, on `stream` (then
// the device is synchronized), and compares with CacheAttentionReference.
// "" or the first difference; a step without any query fails (the check
// would check nothing). cancellation_tol, worst_ratio: as in
// CompareCacheAttention (0: the plain bound of the attention suites).
std::string RunAndCheckCacheAttention(const KVCache& cache, const CacheAttention& op, int layer,
                                      absl::Span<const StepEntry> entries,
                                      const std::vector<uint16_t>& q, int64_t rows,
                                      int num_qo_heads, Stream stream = nullptr,
                                      double cancellation_tol = 0.0,
                                      double* worst_ratio = nullptr);

}  // namespace testing
}  // namespace fp4kv

#endif  // FP4KV_TESTS_TESTING_CACHE_ATTENTION_REFERENCE_H_
