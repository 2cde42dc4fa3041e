// Decode attention that reads NVFP4 pages directly (keys NVFP4 or, with
// geometry.key_format kFp8, FP8 E4M3; values NVFP4).
//
// For each request b of a batch and each query head h, with query rows
// q_indptr[b] .. q_indptr[b+1] (qlen_b of them, 1 .. max_q_len; one row per
// request when max_q_len == 1 and q_indptr is not given):
//
//   query i of request b sits at position p = seq_lens[b] - qlen_b + i and
//   attends the keys at positions t with
//       0 <= t <= p                            (causal among the new tokens)
//       t >= p - window_left                   (only when window_left >= 0)
//   logit_t = sm_scale * g_k * (q . kq_t)     kq_t = e2m1(code) * e4m3(block scale)
//                                             (FP8 keys: kq_t = e4m3(code))
//   logit_t = cap * tanh(logit_t / cap)       (only when logits_soft_cap > 0)
//   out     = g_v * sum_t w_t vq_t,  w_t = exp(logit_t - m) / Z,
//   Z       = sum_t exp(logit_t - m) (+ exp(sink_h - m) with sinks),
//   lse     = m + log(Z)                        natural log, sink included
//
// where h's KV head is h / (num_qo_heads / num_kv_heads). The global decode
// scales g_k, g_v enter once per logit and once per output (the dequantized
// tile e2m1 * e4m3, and an FP8 key e4m3(code), is exact in f16). An FP8 key
// code 0x7f / 0xff (E4M3 NaN; the encoder makes it only from NaN input)
// gives unspecified outputs for the rows that attend it. Softmax and accumulation are
// fp32 in the CUDA kernel and fp64 in the CPU reference, so the two agree to
// rounding, not bit for bit.
//
// Defined behaviour for values the host cannot check:
//   - seq_lens[b] <= 0: request b writes nothing (padding rows of a step).
//   - seq_lens[b] is clamped to max_pages * page_size of the block table.
//   - a query whose position p is negative (qlen_b > seq_lens[b]) writes
//     nothing; qlen_b is clamped to [0, max_q_len], and to the rows of q: a
//     request whose q_indptr[b] is outside [0, total_q) has no rows, one
//     running past total_q keeps the rows that fit.
//   - a block-table entry outside [0, num_pages): the tokens of that page are
//     masked out (zero weight, never read). A query that attends no token
//     writes out = 0 and lse = -inf (with sinks too).
//
// Any number of new tokens per request (1 .. max_q_len, a capacity up to
// kMaxAttentionQLen): decode rows, speculative rows, prefill chunks over a
// cached prefix and whole prompts, mixed in one call. On CUDA, requests of
// at most kDecodeRowsQLen new tokens run on the decode kernels (split over
// the keys); longer ones on the prefill kernel (tiles of 128 query rows, 64
// at head dim 256, each K/V tile decoded once per CTA into shared memory), in
// the same Run().
//
// Thread safety: immutable after Create(); Run() may be called concurrently
// on different workspaces and outputs.
#ifndef FP4KV_ATTENTION_H_
#define FP4KV_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp4kv/geometry.h"
#include "fp4kv/ops.h"
#include "fp4kv/tensor.h"

namespace fp4kv {

// Largest options.max_q_len.
inline constexpr int kMaxAttentionQLen = 1 << 20;
// On CUDA, requests with at most this many new tokens take the decode
// kernels; longer ones the prefill kernel.
inline constexpr int kDecodeRowsQLen = 16;

struct DecodeAttentionArgs {
  TensorView q;             // [total_q, Hq, Dk] f16/bf16, inner dim contiguous, 16-byte rows
  TensorView q_indptr;      // [B + 1] i32; required when max_q_len > 1, else optional
                            // (without it q and out have B rows, request b is row b)
  TensorView block_tables;  // [B, max_pages] i32/i64 (K and V share pages)
  TensorView seq_lens;      // [B] i32, lengths including the step's new tokens
  TensorView out;           // [total_q, Hq, Dv], dtype of q
  TensorView lse;           // [total_q, Hq] f32; required iff options.write_lse (else empty)
  TensorView sinks;         // [Hq] f32 logits; required iff options.has_sinks (else empty)
  GlobalScale k_scale;
  GlobalScale v_scale;
};

namespace internal {
struct DecodeAttentionRunner;  // src/attention_params.h
}  // namespace internal

class DecodeAttention {
 public:
  DecodeAttention() = default;  // Run() fails until assigned from Create()
  struct Options {
    CacheGeometry geometry;  // head_dim_k and head_dim_v in {64, 128, 256}; equal on CUDA;
                             // key_format NVFP4 or FP8 (the cache given to Run must match)
    int num_qo_heads = 0;    // a positive multiple of geometry.num_kv_heads
    DType dtype = DType::kBF16;        // of q and out: f16 or bf16
    DType table_dtype = DType::kI32;   // of block_tables
    int max_batch = 0;                 // largest B
    int max_pages_per_seq = 0;         // largest block-table width
    int max_q_len = 1;                 // 1 .. kMaxAttentionQLen: new tokens per request
    float sm_scale = 0.0f;             // 0: 1 / sqrt(head_dim_k)
    float logits_soft_cap = 0.0f;      // 0: off
    int window_left = -1;              // -1: off; else keys at p - window_left .. p
    bool has_sinks = false;            // per-qo-head sink logits (args.sinks)
    bool write_lse = false;            // args.lse is written
    Device device;
  };

  // Validates the options and picks the launch shape. On CUDA it reads the
  // device's SM count and sets the selected kernel's attributes once, here,
  // so Run() makes no device query or attribute call.
  static absl::StatusOr<DecodeAttention> Create(const Options& options);

  // Scratch bytes Run() needs for split-KV partials (0 on the CPU): any
  // memory of at least this size on the op's device, 256-byte aligned.
  int64_t WorkspaceBytes() const { return workspace_bytes_; }

  // Enqueues on `stream` (CUDA) or runs synchronously (CPU). Checks the views
  // against the options (cheap, no device access); allocates nothing, never
  // synchronizes, launch shapes depend only on the options: graph-safe, and a
  // graph captured once replays for any lengths, tables and scales within the
  // capacities. Nothing of `out` or `lse` but the rows described above is
  // written.
  absl::Status Run(const DecodeAttentionArgs& args, const PagedCache& cache, void* workspace,
                   int64_t workspace_bytes, Stream stream = nullptr) const;

  const Options& options() const { return options_; }

  // The kernel families Create() chose, for logs, benchmarks and tests.
  // Decode: "rows_in_m", "tokens_in_m" (cp.async copies), "tokens_in_m_tma"
  // (TMA copies where they measured faster, cp.async elsewhere) or
  // "tokens_in_m_tma_all" (FP4KV_ATTENTION_KERNEL=tokens_in_m_tma). Prefill
  // (requests of more than kDecodeRowsQLen new tokens): "mma" or "wgmma";
  // "none" when max_q_len <= kDecodeRowsQLen. "cpu" for both on the CPU.
  const char* decode_family() const;
  const char* prefill_family() const;

 private:
  friend struct internal::DecodeAttentionRunner;
  DecodeAttention(const Options& o, int num_sms, int64_t workspace_bytes, bool merge_overlaps,
                  int family, int ctas_per_sm, int prefill_ctas_per_sm, int ctas_per_sm_rows,
                  int prefill_family)
      : options_(o),
        num_sms_(num_sms),
        workspace_bytes_(workspace_bytes),
        merge_overlaps_(merge_overlaps),
        family_(family),
        ctas_per_sm_(ctas_per_sm),
        prefill_ctas_per_sm_(prefill_ctas_per_sm),
        ctas_per_sm_rows_(ctas_per_sm_rows),
        prefill_family_(prefill_family) {}
  Options options_;
  int num_sms_ = 0;
  int64_t workspace_bytes_ = 0;
  bool merge_overlaps_ = false;  // found at Create() (CUDA)
  int family_ = 0;               // kernel family chosen at Create() (CUDA; src/attention_params.h)
  int ctas_per_sm_ = 0;          // resident CTAs an SM, found at Create() (CUDA)
  int prefill_ctas_per_sm_ = 0;  // the same for the prefill kernel (max_q_len > kDecodeRowsQLen)
  int ctas_per_sm_rows_ = 0;     // and for the rows-in-M decode launch beside it
  int prefill_family_ = 0;       // prefill kernel family chosen at Create() (CUDA)
};

// Create + Run with a caller-given workspace (WorkspaceBytes() of the same
// options).
absl::Status DecodeAttentionPaged(const DecodeAttention::Options& options,
                                  const DecodeAttentionArgs& args, const PagedCache& cache,
                                  void* workspace, int64_t workspace_bytes,
                                  Stream stream = nullptr);

}  // namespace fp4kv

#endif  // FP4KV_ATTENTION_H_
