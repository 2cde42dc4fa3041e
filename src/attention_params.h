// Internal: the plain-pointer form of DecodeAttention, filled by validation
// (src/attention.cc) and read by the CPU reference (src/reference/) and the
// CUDA kernel (kernels/attention.cu). Fields are only ever added, never
// changed in meaning.
#ifndef FP4KV_SRC_ATTENTION_PARAMS_H_
#define FP4KV_SRC_ATTENTION_PARAMS_H_

#include <climits>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp4kv/attention.h"
#include "fp4kv/format.h"
#include "fp4kv/ops.h"
#include "src/params.h"

namespace fp4kv {
namespace kernels {
struct AttnTmaMaps;  // kernels/attention/tma_maps.h
}  // namespace kernels
namespace internal {

// The CUDA kernel families of decode attention (kernels/attention/): query
// rows in the MMA's M dimension (rows_in_m.cuh) or the keys' tokens
// (tokens_in_m.cuh), whose tiles are copied by every lane with cp.async
// (kTokensInM, sm_80 and up) or by one lane with TMA tensor copies (sm_90a
// builds on compute capability 9.0): kTokensInMTma uses them where they
// measured faster (FP8 keys at head dim 128), kTokensInMTmaAll wherever the
// tensor maps describe the pools (tests and comparisons); a Run whose pools
// they cannot describe falls back to cp.async. Create() picks kTokensInMTma
// where it can run, kTokensInM elsewhere, wherever the family takes the
// shape; FP4KV_ATTENTION_KERNEL (read at Create()) forces a family
// (kernels/attention.cu).
enum class AttentionFamily : int {
  kRowsInM = 0,
  kTokensInM = 1,
  kTokensInMTma = 2,
  kTokensInMTmaAll = 3
};

inline bool IsTokensInMTma(AttentionFamily f) {
  return f == AttentionFamily::kTokensInMTma || f == AttentionFamily::kTokensInMTmaAll;
}
inline bool IsTokensInM(AttentionFamily f) {
  return f == AttentionFamily::kTokensInM || IsTokensInMTma(f);
}

// The prefill kernel family (kernels/attention/prefill_launch.cuh): mma.sync
// (sm_80 and up) or wgmma (sm_90a builds on compute capability 9.0).
enum class PrefillFamily : int { kMma = 0, kWgmma = 1 };

// Query rows (group * q_len) of the largest item the tokens-in-M kernel takes.
inline constexpr int kTokensInMMaxRows = 8;

// For an op of max_q_len > kDecodeRowsQLen, whose decode launches take the
// requests of at most kDecodeRowsQLen queries: the longest of them (q_len)
// the tokens-in-M family takes; 0 when the family is rows-in-M or the group
// is too large. Longer decode requests run on the rows-in-M kernel in a
// launch of their own.
inline int DecodeTokensInMQLen(AttentionFamily family, int group) {
  if (!IsTokensInM(family) || group <= 0 || group > kTokensInMMaxRows) return 0;
  return kTokensInMMaxRows / group;
}

struct AttentionParams {
  PoolPtrs k, v;  // read only; k.head_dim = Dk, v.head_dim = Dv
  // Keys in FP8 E4M3 (geometry.key_format kFp8): k rows are Dk bytes,
  // k.scales is null; values stay NVFP4.
  bool fp8_keys = false;
  int num_kv_heads = 0;
  int num_qo_heads = 0;
  int group = 0;  // num_qo_heads / num_kv_heads
  int page_size = 0;
  int64_t num_pages = 0;

  DType dtype = DType::kBF16;  // of q and out
  const void* q = nullptr;     // [total_q, Hq, Dk]
  int64_t q_row_stride = 0, q_head_stride = 0;  // elements
  int64_t total_q = 0;                          // q.shape[0]
  const int32_t* q_indptr = nullptr;            // [B + 1]; null: request b is q row b
  int max_q_len = 1;

  const void* block_tables = nullptr;  // [B, max_pages] i32 or i64
  bool tables_i64 = false;
  int64_t table_row_stride = 0;  // elements
  int max_pages = 0;
  const int32_t* seq_lens = nullptr;  // [B]
  int batch_size = 0;                 // B (<= max_batch)

  void* out = nullptr;  // [total_q, Hq, Dv]
  int64_t out_row_stride = 0, out_head_stride = 0;  // elements
  float* lse = nullptr;  // [total_q, Hq] f32 or null
  int64_t lse_row_stride = 0;  // elements
  const float* sinks = nullptr;  // [Hq] or null

  float sm_scale = 0.0f;  // resolved (never 0)
  float soft_cap = 0.0f;  // 0: off
  int window_left = -1;   // -1: off
  GlobalScale k_scale, v_scale;

  void* workspace = nullptr;  // WorkspaceBytes() bytes on the device (null on the CPU)
  int64_t workspace_bytes = 0;
  // Launch-shape inputs fixed at Create (options, not per-call values).
  int max_batch = 0;
  int num_sms = 0;
  bool merge_overlaps = false;  // see AttentionKernelSetup
  AttentionFamily family = AttentionFamily::kRowsInM;  // see AttentionKernelSetup
  int ctas_per_sm = 0;  // see AttentionKernelSetup; 0: the kernel's own bound
  // Set by the CUDA launcher per kernel (the CPU reference ignores them): a
  // kernel takes only the requests whose clamped q_len lies in
  // [kernel_q_min, kernel_q_max]; the others belong to the other kernel of
  // the same Run (decode: q_len <= kDecodeRowsQLen, prefill: longer).
  int kernel_q_min = 0, kernel_q_max = INT_MAX;
  // Set by the CUDA launcher on the first decode launch after the wgmma
  // prefill kernel of the same Run: launched as its programmatic dependent
  // (its CTAs take the SMs the prefill kernel's last items free; the decode
  // grid waits for the prefill grid before it completes). Not after the
  // mma.sync prefill kernel, beside whose CTAs waiting decode CTAs would sit
  // for the whole prefill.
  bool beside_prefill = false;
  // Resident CTAs of the prefill kernel per SM (found at Create() when
  // max_q_len > kDecodeRowsQLen; its persistent grid is num_sms times this).
  int prefill_ctas_per_sm = 0;
  PrefillFamily prefill_family = PrefillFamily::kMma;  // see AttentionKernelSetup
  int ctas_per_sm_rows = 0;  // see AttentionKernelSetup
  // The TMA tensor maps of these pools, encoded before the Run
  // (EncodeDecodeTmaMaps: a KVCache's bound attention, once per layer at
  // bind); null: the launcher encodes them when the kernel it picks copies
  // with TMA (the functional op, whose pools come with each Run).
  const kernels::AttnTmaMaps* tma_maps = nullptr;

  // Reference only (tests): when set, the CPU reference also stores every
  // output element unrounded here, [total_q, Hq, Dv] with out's strides.
  double* ref_out_f64 = nullptr;
};

// Request b's query rows: [*q_begin, *q_begin + *q_len). Shared by the
// reference and the kernel.
FP4KV_HD void AttentionQueryRows(const AttentionParams& p, int b, int64_t* q_begin, int* q_len) {
  if (p.q_indptr == nullptr) {
    *q_begin = b;
    *q_len = 1;
    return;
  }
  const int64_t begin = p.q_indptr[b];
  int64_t n = static_cast<int64_t>(p.q_indptr[b + 1]) - begin;
  if (n < 0) n = 0;
  if (n > p.max_q_len) n = p.max_q_len;
  if (begin < 0 || begin >= p.total_q) n = 0;
  if (begin + n > p.total_q) n = p.total_q - begin;
  *q_begin = begin;
  *q_len = static_cast<int>(n);
}

// Tokens of request b that attention may read: seq_lens[b] clamped to
// [0, max_pages * page_size].
FP4KV_HD int64_t AttentionTokens(const AttentionParams& p, int b) {
  int64_t n = p.seq_lens[b];
  if (n < 0) n = 0;
  const int64_t cap = static_cast<int64_t>(p.max_pages) * p.page_size;
  return n < cap ? n : cap;
}

// Checks the per-call views of a Run against (validated) options and fills
// the params (src/attention.cc). Cheap: no device access. `num_sms` is the SM
// count Create() read (0 on the CPU); on CUDA it sizes the workspace the
// kernel needs (AttentionWorkspaceBytes), which `workspace` must provide.
// Errors are InvalidArgument naming the argument.
absl::StatusOr<AttentionParams> MakeAttentionParams(const DecodeAttention::Options& o,
                                                    const DecodeAttentionArgs& a,
                                                    const PagedCache& cache, void* workspace,
                                                    int64_t workspace_bytes, int num_sms = 0);

// The same for a cache whose views were checked once already (CheckCache
// against the options' geometry and device): only the call's own views are
// checked here.
absl::StatusOr<AttentionParams> MakeAttentionParams(const DecodeAttention::Options& o,
                                                    const DecodeAttentionArgs& a,
                                                    const CachePools& pools, void* workspace,
                                                    int64_t workspace_bytes, int num_sms = 0);

// The request tables of a Run (seq_lens, block_tables, q_indptr) as the
// kernels read them: checked on every call of the functional op and of
// DecodeAttention::Run, once at bind time for a KVCache's bound attention
// (its step buffers are its own and never move).
struct AttentionTables {
  const void* block_tables = nullptr;
  int64_t table_row_stride = 0;  // elements
  int max_pages = 0;
  const int32_t* seq_lens = nullptr;
  const int32_t* q_indptr = nullptr;  // null: request b is q row b
  int batch = 0;
};

// Checks a's seq_lens, block_tables and q_indptr against the options and
// fills *t. InvalidArgument naming the argument.
absl::Status CheckAttentionTables(const DecodeAttention::Options& o, const DecodeAttentionArgs& a,
                                  AttentionTables* t);

// The params of a call whose tables were checked (t) and whose workspace
// need is known (`need`, 0 on the CPU): checks only the call's q, out, lse,
// sinks, scales and workspace.
absl::StatusOr<AttentionParams> MakeAttentionParams(const DecodeAttention::Options& o,
                                                    const DecodeAttentionArgs& a,
                                                    const CachePools& pools,
                                                    const AttentionTables& t, void* workspace,
                                                    int64_t workspace_bytes, int num_sms,
                                                    int64_t need);

// DecodeAttention::Run on a cache whose views were checked once already (a
// KVCache's bound attention): checks the call's views (with `t`: all but the
// tables), fills the params and dispatches them to the CPU reference or the
// CUDA launcher. A friend of DecodeAttention: it reads the launch shape and
// workspace size Create() settled.
struct DecodeAttentionRunner {
  static absl::Status Run(const DecodeAttention& op, const DecodeAttentionArgs& a,
                          const CachePools& pools, void* workspace, int64_t workspace_bytes,
                          Stream stream);
  // tma_maps: the pools' maps as EncodeTmaMaps made them (null: the
  // launcher encodes them when it needs them).
  static absl::Status Run(const DecodeAttention& op, const DecodeAttentionArgs& a,
                          const CachePools& pools, const AttentionTables& t, void* workspace,
                          int64_t workspace_bytes, Stream stream,
                          const kernels::AttnTmaMaps* tma_maps = nullptr);
  // The TMA tensor maps of these (checked) pools for op's kernel family
  // (EncodeDecodeTmaMaps); false on the CPU and where the family does not
  // copy with TMA or the maps cannot describe the pools.
  static bool EncodeTmaMaps(const DecodeAttention& op, const CachePools& pools,
                            kernels::AttnTmaMaps* m);
};

// Scratch bytes of the CUDA kernel for these options (kernels/attention.cu).
int64_t AttentionWorkspaceBytes(const DecodeAttention::Options& o, int num_sms);

// CPU reference (src/reference/attention_reference.cc): fp64 accumulation over
// the values format.h decodes. Synchronous, host memory.
void ReferenceDecodeAttention(const AttentionParams& p);

// What Create() settles once for the CUDA launch (kernels/attention.cu).
struct AttentionKernelSetup {
  bool merge_overlaps = false;  // the merge kernel's code waits in griddepcontrol (PTX 9.0+)
  AttentionFamily family = AttentionFamily::kRowsInM;  // the kernel family Run() launches
  // CTAs of the selected kernel that fit an SM with max_batch's shared memory
  // when fewer than its launch bound (0: the bound): the persistent grid is
  // num_sms times this, so a large max_batch shrinks the grid instead of
  // leaving a tail wave.
  int ctas_per_sm = 0;
  // Resident CTAs per SM of the prefill kernel (0: not prepared, max_q_len
  // <= kDecodeRowsQLen).
  int prefill_ctas_per_sm = 0;
  // The prefill kernel family Run() launches (max_q_len > kDecodeRowsQLen).
  PrefillFamily prefill_family = PrefillFamily::kMma;
  // max_q_len > kDecodeRowsQLen with the tokens-in-M family: the decode
  // requests too long for it (group * q_len > 8) run on the rows-in-M kernel
  // in a launch of their own; its resident CTAs per SM (0: its bound).
  int ctas_per_sm_rows = 0;
};

// Create()-time setup on options.device: raises the selected kernel's dynamic
// shared memory limit and fills *out. Leaves the current device as it was.
absl::Status PrepareDecodeAttention(const DecodeAttention::Options& o, AttentionKernelSetup* out);

// CUDA launcher (kernels/attention.cu): enqueues on `stream`, allocates
// nothing, never synchronizes; returns the launch status.
absl::Status LaunchDecodeAttention(const AttentionParams& p, Stream stream);

// Encodes the TMA tensor maps of p's pools (reads k, v, fp8_keys,
// num_kv_heads, page_size, num_pages and family only) for the decode kernels
// that copy tiles with TMA (kernels/attention.cu). False, with
// m->tile_bytes 0, where the family copies with cp.async at this shape or
// the maps cannot describe the pools; the launcher then takes cp.async as it
// would have. Host only.
bool EncodeDecodeTmaMaps(const AttentionParams& p, kernels::AttnTmaMaps* m);

// Tests: how many TMA map pairs the host has encoded so far in this process
// (successful encodes only; the launcher's per-Run encodes and
// EncodeDecodeTmaMaps alike).
int64_t TmaMapEncodesForTesting();
// Counts one (kernels/attention/launch.cuh).
void CountTmaMapEncode();

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_ATTENTION_PARAMS_H_
