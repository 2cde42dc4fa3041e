// Random decode-attention test cases, shared by the CPU reference tests and
// the GPU tests, in the style of kernel_cases.h: all inputs in one byte blob
// (`in`), all outputs in another (`out`, kPoison with gaps), tensors described
// by offsets so the same case is viewed at host or device bases.
//
// The pools hold real NVFP4 data (keys in FP8 E4M3 with fp8_keys): f16/bf16
// rows (RandomHalfBits rescaled to comparable row norms, or the real model
// rows of /work/shared/data/realkv) quantized with QuantizeBlock (FP8 keys:
// QuantizeFp8Key) under a global scale derived from the rows' amax. Block
// tables give every request its own pages, drawn from a random permutation
// of the pool.
#ifndef FP4KV_TESTS_TESTING_ATTENTION_CASE_H_
#define FP4KV_TESTS_TESTING_ATTENTION_CASE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "fp4kv/attention.h"
#include "fp4kv/geometry.h"
#include "fp4kv/tensor.h"
#include "testing/kernel_cases.h"

namespace fp4kv {
namespace testing {

struct AttentionSpec {
  int batch = 3;  // requests with tokens (padding rows come on top)
  int num_kv_heads = 2;
  int group = 1;      // qo heads per KV head
  int head_dim = 64;  // Dk == Dv
  int page_size = 16;
  Layout layout = Layout::kNHD;
  bool stacked = false;
  DType dtype = DType::kBF16;
  DType table_dtype = DType::kI32;
  // Per-request lengths random in [min, max], plus two padding rows (seq_len 0
  // and -3, at random places in the batch) when padding_rows.
  int min_seq_len = 1, max_seq_len = 40;
  bool padding_rows = true;
  // Queries per request; > 1 uses q_indptr (max_q_len = q_len; some requests
  // get fewer, a query past the start of a short request has a negative
  // position, and q has two spare rows past the last request's).
  int q_len = 1;
  // Every request gets exactly q_len rows (padding rows q_len or none): with
  // min_seq_len == max_seq_len each request's cached prefix is exactly
  // max_seq_len - q_len.
  bool full_q = false;
  // Mixed steps: about half of the requests (at least one of each kind when
  // batch > 1) get 1 .. kDecodeRowsQLen rows (decode rows, the decode
  // kernels' share on CUDA), the others rows as q_len and full_q say.
  bool mixed_q = false;
  float soft_cap = 0;
  int window_left = -1;
  bool sinks = false;
  bool lse = false;
  bool pointer_scales = false;
  // Some block-table entries within the requests' lengths outside
  // [0, num_pages): one request has only such entries, others one in six.
  bool oob_pages = false;
  // K/V/Q rows from /work/shared/data/realkv (forces num_kv_heads 3, group 3,
  // head_dim 64 and max_seq_len <= 1025). Without the data the rows are
  // random: check RealKvAvailable() first.
  bool realkv = false;
  int extra_pages = 0;  // pool pages beyond what the tables can reference
  // q, out and lse with padded row and head strides (16-byte multiples).
  bool padded = false;
  // FP8 E4M3 keys (KeyFormat::kFp8; tuple pools only, so `stacked` is
  // ignored): K rows encoded with QuantizeFp8Key under MakeFp8KeyScale of
  // the rows' amax; values NVFP4 as always.
  bool fp8_keys = false;
  // Pool entries a request never attends get NaN codes (0x7f: E4M3 NaN) in
  // every block scale and FP8 key byte: those past its length in its last
  // page and, with a window and q_len 1, those before the window in its
  // pages. A kernel that reads a tile of a page whole must keep them out of
  // the output (P = 0 times a NaN value is NaN).
  bool nan_unattended = false;
  std::string Name() const;  // unique per sweep entry, a valid test name
};

struct AttentionCase {
  AttentionSpec spec;
  CacheGeometry geometry;
  std::vector<uint8_t> in;   // pools, q, q_indptr, block_tables, seq_lens, sinks, scales
  std::vector<uint8_t> out;  // out_view, lse; all kPoison
  PoolSpec pool;
  // q [total_q, Hq, D]; q_indptr [B + 1] i32 (q_len > 1); block_tables [B, M]
  // (row stride padded); seq_lens [B] i32; out_view [total_q, Hq, D];
  // lse [total_q, Hq] f32 (spec.lse); sinks [Hq] f32 (spec.sinks). B counts
  // the padding rows; M = ceil(max_seq_len / page_size).
  ViewSpec q, q_indptr, block_tables, seq_lens, out_view, lse, sinks;
  ScaleSpec k_scale, v_scale;

  // max_batch = B + 1, max_pages_per_seq = M, sm_scale 0 (1/sqrt(D)).
  DecodeAttention::Options Options(Device device) const;
  DecodeAttentionArgs Args(uint8_t* in_base, uint8_t* out_base, Device device) const;
  // The pool's views (PagedCache::Fp8Keys for FP8 keys, pool.k_scales unset).
  PagedCache Cache(uint8_t* in_base, Device device) const;
  // New data, lengths (within capacity), padding rows, tables, q_indptr,
  // sinks and pointer-scale values in place, same shapes and offsets (fixed
  // scale values stay, as a captured graph keeps them).
  void Rewrite(uint64_t seed);
};
AttentionCase MakeAttentionCase(const AttentionSpec& spec, uint64_t seed);

// A query row the contract writes (all qo heads), from the case's metadata.
struct AttentionQuery {
  int request = 0;
  int index = 0;         // i within the request's rows
  int64_t row = 0;       // row of q / out / lse
  int64_t position = 0;  // p >= 0
  int64_t tokens = 0;    // the request's length, clamped to the table
};
std::vector<AttentionQuery> AttentionQueries(const AttentionCase& c);

// The CPU reference's output blob for the case's current inputs (out
// rounded to the case's dtype, as Run writes it) and, when `exact` is set,
// the same outputs before rounding: fp64, indexed like out_view's elements
// (NaN where the contract writes nothing).
std::vector<uint8_t> ReferenceAttentionOutputs(const AttentionCase& c,
                                               std::vector<double>* exact = nullptr);

// Compares an output blob with the reference's: per (query row, qo head)
// written by the contract, ||got - ref|| <= rel_tol * ||ref|| + a floor of
// two subnormal ulps of the dtype per element (so a zero reference row needs
// a zero row, up to f16 subnormal noise), lse within lse_tol absolute (both
// -inf allowed), and every byte the contract leaves alone still kPoison. ref
// is the unrounded `exact` output when given (ReferenceAttentionOutputs),
// else want's out. Returns "" or a description of the first failure
// (request, query, row, position, head, norms and the first values).
std::string CompareAttentionOutputs(const AttentionCase& c, const std::vector<uint8_t>& want,
                                    const std::vector<uint8_t>& got, double rel_tol,
                                    double lse_tol, const std::vector<double>* exact = nullptr);

// A representative mixed sweep (batch 1..64, lengths 1..33000, groups 1..8,
// q_len 1..8, head dims 64/128/256, both layouts, page sizes 1/16/17, both
// table dtypes, soft cap, window, sinks, lse, padding, out-of-range pages,
// f16/bf16), sized so the CPU reference of all of it takes seconds.
std::vector<AttentionSpec> AttentionSweep();
// Specs over the real model rows (skip when !RealKvAvailable()).
std::vector<AttentionSpec> RealKvSweep();
// Prefill and extend chunks (q_len 17 .. 4096, more than kDecodeRowsQLen new
// tokens per request) over cached prefixes of 0 .. 3000 tokens, alone and
// mixed with decode rows in one call: q_len 17/127/128/129/1000/4096, cached
// prefixes 0/1/15/16/17/3000, batches 1/3/8, groups 1/4/7/8, head dims
// 64/128/256, both layouts, page sizes 1/16/17, window, soft cap, sinks, lse,
// f16/bf16, i32/i64 tables, out-of-range pages, padding rows, queries before
// a short request's first token. The long ones keep to one or two requests
// and few heads, so the CPU reference of all of it takes seconds.
std::vector<AttentionSpec> PrefillSweep();
// Prefill chunks over the real model rows (skip when !RealKvAvailable()):
// 1000 new tokens over 25 cached, mixed steps, a window.
std::vector<AttentionSpec> PrefillRealKvSweep();
// The same specs with FP8 keys (fp8_keys set; stacked ones become tuples).
std::vector<AttentionSpec> WithFp8Keys(const std::vector<AttentionSpec>& specs);
// FP8-key specs at head dim 128, page 16 (the 16-byte copy path the serving
// shapes take, which the mixed sweep reaches only in its long case): GQA
// groups 1..8, q_len 1..8, both layouts, f16/bf16, i32/i64 tables, window,
// soft cap, sinks, lse, out-of-range pages, padded views, splits.
std::vector<AttentionSpec> Fp8KeyPage16Sweep();

// Real attention rows: 1025 positions of 9 query heads and 3 KV heads, head
// dim 64, bf16 bits, for the layers in kRealKvLayers.
inline constexpr int kRealKvTokens = 1025;
inline constexpr int kRealKvLayers[] = {0, 11, 23, 28};
// True when the files are found: $FP4KV_REALKV_DIR, else shared/data/realkv
// under an ancestor of this source file or of the working directory, else the
// project's copy in tests/data/realkv.
bool RealKvAvailable(std::string* why = nullptr);
struct RealKvLayer {
  std::vector<uint16_t> q;  // [1025, 9, 64]
  std::vector<uint16_t> k;  // [1025, 3, 64]
  std::vector<uint16_t> v;  // [1025, 3, 64]
};
// Loaded once and cached; nullptr when unavailable.
const RealKvLayer* LoadRealKvLayer(int layer);

// Skips the current test with a reason when the real rows are absent.
#define FP4KV_SKIP_WITHOUT_REALKV()                            \
  do {                                                         \
    std::string fp4kv_why_;                                    \
    if (!::fp4kv::testing::RealKvAvailable(&fp4kv_why_)) {     \
      GTEST_SKIP() << "needs the realkv data: " << fp4kv_why_; \
    }                                                          \
  } while (0)

}  // namespace testing
}  // namespace fp4kv

#endif  // FP4KV_TESTS_TESTING_ATTENTION_CASE_H_
