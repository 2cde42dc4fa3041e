// Operations on caller-owned memory: validate-once op objects and the
// functional API built on them.
//
// Every op runs on the device of its tensors: CPU tensors go through the CPU
// reference (src/reference/), CUDA tensors through the kernels (kernels/).
// Both produce identical bytes.
//
// Thread safety: op objects are immutable after Create(); Run() may be called
// concurrently from several threads (on different output memory).
#ifndef FP4KV_OPS_H_
#define FP4KV_OPS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp4kv/format.h"
#include "fp4kv/geometry.h"
#include "fp4kv/tensor.h"

struct CUstream_st;

namespace fp4kv {

// Same type as cudaStream_t; nullptr is the legacy default stream. Ignored for
// CPU tensors.
using Stream = CUstream_st*;

// A global decode scale: a value fixed at the call, or a pointer to an fp32
// in memory on the op's device read when the op runs (so a captured CUDA graph
// sees updates). Values must satisfy IsValidGlobalScale (format.h: positive,
// at most MaxGlobalScale(), about 1.266e35); a fixed value is validated, a
// pointed-to value cannot be and gives defined but meaningless bytes when it
// is not.
struct GlobalScale {
  float value = 1.0f;
  const float* ptr = nullptr;

  static constexpr GlobalScale Value(float v) { return GlobalScale{v, nullptr}; }
  static constexpr GlobalScale Pointer(const float* p) { return GlobalScale{1.0f, p}; }
  FP4KV_HD float Get() const { return ptr != nullptr ? *ptr : value; }
};

// ---------------------------------------------------------------------------
// Appender: quantize f16/bf16 rows and scatter them into a paged cache.
// ---------------------------------------------------------------------------
enum class AppendIndexing : uint8_t {
  // Row i goes to position positions[i] of request batch_indices[i]:
  // page kv_indices[kv_indptr[b] + pos / page_size], entry pos % page_size.
  kPaged = 0,
  // Row i goes to slot slot_mapping[i] = page * page_size + entry; a negative
  // slot is padding and is skipped.
  kSlot = 1,
};

struct AppendArgs {
  TensorView key;    // [nnz, H, Dk] f16/bf16, inner dim contiguous (rows may be padded past nnz in kSlot)
  TensorView value;  // [nnz, H, Dv], same dtype as key
  // kPaged
  TensorView batch_indices;     // [nnz] i32
  TensorView positions;         // [nnz] i32
  TensorView kv_indices;        // [total_pages] i32
  TensorView kv_indptr;         // [B + 1] i32
  TensorView kv_last_page_len;  // [B] i32 (checked for shape only)
  // kSlot
  TensorView slot_mapping;  // [n] i64; only the first n rows of key/value are read
  GlobalScale k_scale;
  GlobalScale v_scale;
  // Scale-event counters, required iff Options::count_scale_events (null
  // otherwise): 4 uint64 on the op's device, 8-byte aligned, to which the
  // append adds the blocks it stored with a saturated / underflowed scale
  // (format.h ClassifyBlockScale): [K saturated, K underflow, V saturated,
  // V underflow]. Rows that write nothing count nothing.
  uint64_t* scale_events = nullptr;
};

namespace internal {
struct AppendAccess;  // src/params.h
}  // namespace internal

class Appender {
 public:
  // Not usable: every Run() returns FailedPrecondition until assigned from
  // Create(). (Lets an op object be a member; the same holds for every op
  // class below.)
  Appender() = default;
  struct Options {
    CacheGeometry geometry;
    DType input_dtype = DType::kBF16;  // kF16 or kBF16
    AppendIndexing indexing = AppendIndexing::kPaged;
    Recipe recipe;
    Device device;
    // Count saturated and underflowed block scales into args.scale_events.
    // Off, the kernels carry no counting code at all.
    bool count_scale_events = false;
  };

  // Validates the options once.
  static absl::StatusOr<Appender> Create(const Options& options);

  // Appends on `stream` (CUDA) or synchronously (CPU). Checks shapes and
  // alignment against the options (cheap, no device access); allocates
  // nothing and never synchronizes, so a CUDA Run() can be graph-captured.
  // Device-side behaviour for values that the host cannot check: rows whose
  // batch index, position, page index or slot is out of range write nothing.
  absl::Status Run(const AppendArgs& args, const PagedCache& cache, Stream stream = nullptr) const;

  const Options& options() const { return options_; }

 private:
  friend struct internal::AppendAccess;
  Appender(const Options& o, bool overlap_launch)
      : options_(o), created_(true), overlap_launch_(overlap_launch) {}
  Options options_;
  bool created_ = false;
  bool overlap_launch_ = false;  // found at Create() (CUDA; see AppendParams)
};

// ---------------------------------------------------------------------------
// Dequantizer: gather a paged cache through block tables into contiguous
// [B, max_seq_len, H, D] f16/bf16 tensors.
// ---------------------------------------------------------------------------
struct DequantArgs {
  TensorView block_tables;  // [B, max_pages] i32 or i64
  TensorView seq_lens;      // [B] i32
  TensorView k_out;         // [B, max_seq_len, H, Dk] f16/bf16
  TensorView v_out;         // [B, max_seq_len, H, Dv]
  GlobalScale k_scale;
  GlobalScale v_scale;
};

class Dequantizer {
 public:
  Dequantizer() = default;  // not usable until assigned from Create()
  struct Options {
    CacheGeometry geometry;
    DType output_dtype = DType::kBF16;
    DType table_dtype = DType::kI32;
    Device device;
  };
  static absl::StatusOr<Dequantizer> Create(const Options& options);
  // Positions >= seq_lens[b] (and >= max_seq_len) are left unchanged; a table
  // entry outside [0, num_pages) writes nothing for that page. Graph-safe.
  absl::Status Run(const DequantArgs& args, const PagedCache& cache, Stream stream = nullptr) const;
  const Options& options() const { return options_; }

 private:
  explicit Dequantizer(const Options& o) : options_(o), created_(true) {}
  Options options_;
  bool created_ = false;
};

// ---------------------------------------------------------------------------
// Materializer: write the active pages as FP8 E4M3 pages for FP8 attention.
//
// out is [num_out_pages, 2, H, page_size, D] e4m3 (K at index 0, V at 1).
// Request b's page j goes to out page kv_page_indptr[b] + j + 1 and
// fp8_block_tables[b][j] is set to that index; out page 0 is zeroed; pages
// past kv_page_indptr[B] are neither written nor read; only the first
// ceil(seq_lens[b] / page_size) entries of each fp8_block_tables row are
// written; entries of a last partial page at or past seq_lens[b] are written
// as zero. An out page index >= num_out_pages or a source page outside
// [0, num_pages) writes nothing for that page.
//
// FP8 value: e4m3((e2m1 * block_scale) * (g / fp8_scale)), the multiplier
// g / fp8_scale computed once in fp32 per tensor. See MinFp8Scale().
// ---------------------------------------------------------------------------
struct MaterializeArgs {
  TensorView block_tables;      // [B, max_pages] (K and V share pages) or [B, 2, max_pages]; i32/i64
  TensorView seq_lens;          // [B] i32
  TensorView kv_page_indptr;    // [B + 1] i32
  TensorView out;               // [num_out_pages, 2, H, page_size, D] e4m3 (u8 accepted)
  TensorView fp8_block_tables;  // [B, max_pages] i32
  GlobalScale k_scale;
  GlobalScale v_scale;
  GlobalScale k_fp8_scale;  // per-tensor decode scale of the FP8 K pages
  GlobalScale v_fp8_scale;
};

class Materializer {
 public:
  Materializer() = default;  // not usable until assigned from Create()
  struct Options {
    CacheGeometry geometry;  // head_dim_k == head_dim_v, multiple of 64; page_size % 4 == 0
    DType table_dtype = DType::kI32;
    bool separate_kv_tables = false;  // block_tables is [B, 2, max_pages]
    Device device;
  };
  static absl::StatusOr<Materializer> Create(const Options& options);
  absl::Status Run(const MaterializeArgs& args, const PagedCache& cache,
                   Stream stream = nullptr) const;
  const Options& options() const { return options_; }

 private:
  explicit Materializer(const Options& o) : options_(o), created_(true) {}
  Options options_;
  bool created_ = false;
};

// The smallest FP8 decode scale under which no value a cache with global
// decode scale g can hold (|e2m1| <= 6, block scale <= 448) exceeds the FP8
// range: about 6 * g, adjusted so that (6 * 448) * (g / fp8_scale) <= 448 in
// fp32. InvalidArgument unless IsValidGlobalScale(g).
absl::StatusOr<float> MinFp8Scale(float global_scale);

// ---------------------------------------------------------------------------
// PagedCacheQuantizer: quantize a whole f16/bf16 paged cache (or listed
// pages of one) into a paged NVFP4 cache, optionally choosing the global
// scales from the data on the device.
//
// Row (page p, entry e, head h) of the source becomes row (p', e, h) of the
// cache with exactly the bytes QuantizeAppendBySlot writes for that row at
// slot p' * page_size + e under the same global scales and recipe. Source
// and cache layouts may differ; page_size, heads and head dims must match.
// ---------------------------------------------------------------------------

// An unquantized paged cache: the input of PagedCacheQuantizer.
//   NHD: k [P, S, H, Dk], v [P, S, H, Dv]    HND: k [P, H, S, Dk], v [P, H, S, Dv]
// f16 or bf16, last dimension contiguous, 16-byte aligned pointers and strides.
struct HalfPagedCache {
  TensorView k;
  TensorView v;
  Layout layout = Layout::kNHD;

  static HalfPagedCache FromTuple(const TensorView& k, const TensorView& v, Layout layout) {
    return HalfPagedCache{k, v, layout};
  }
  // Stacked 5-D form: [P, 2, S, H, D] (NHD) or [P, 2, H, S, D] (HND); index 0
  // on dimension 1 is K, 1 is V.
  static absl::StatusOr<HalfPagedCache> FromStacked(const TensorView& kv, Layout layout);
};

struct QuantizeCacheArgs {
  HalfPagedCache source;
  // Page lists, both or neither: [N] i32 on the op's device. Given, list
  // position i quantizes source page src_pages[i] into cache page
  // dst_pages[i]; a position whose source page is outside [0, P_src) or whose
  // cache page is outside [0, num_pages) writes nothing (checked on the
  // device). Not given, source page p goes to cache page p (P_src <=
  // num_pages; cache pages past P_src are not written).
  TensorView src_pages;
  TensorView dst_pages;
  // Token slots to quantize: entry e of list position i (or page i) is
  // quantized iff i * page_size + e < num_tokens. -1: all of them (N or
  // P_src pages). Otherwise in [0, pages * page_size]; e.g. a sequence of
  // length n stored in N = ceil(n / page_size) listed pages.
  int64_t num_tokens = -1;
  // Global decode scales the quantization uses, when !options.compute_scales.
  GlobalScale k_scale;
  GlobalScale v_scale;
  // options.compute_scales: required, distinct, 4-byte aligned fp32 on the
  // op's device; each gets MakeGlobalScale(headroom * amax, recipe) of the
  // quantized rows of its side (NaN ignored), which the quantization then
  // reads (GlobalScale::Pointer of them is what a reader passes). Must be
  // null otherwise.
  float* k_scale_out = nullptr;
  float* v_scale_out = nullptr;
};

class PagedCacheQuantizer {
 public:
  struct Options {
    CacheGeometry geometry;  // of the NVFP4 cache (num_pages: its pages)
    Layout source_layout = Layout::kNHD;
    DType input_dtype = DType::kBF16;  // kF16 or kBF16
    Recipe recipe;
    Device device;
    // Choose the global scales from the data (two more kernels before the
    // quantization: an amax pass over the rows and a one-thread conversion).
    bool compute_scales = false;
    float headroom = 1.0f;  // compute_scales: finite, >= 1
  };

  // Validates the options once.
  static absl::StatusOr<PagedCacheQuantizer> Create(const Options& options);

  // Quantizes on `stream` (CUDA) or synchronously (CPU). Checks the views
  // against the options (cheap, no device access); allocates nothing, never
  // synchronizes; graph-capturable (a replay re-reads the lists, the data and,
  // with compute_scales, recomputes the scales). On InvalidArgument nothing
  // is enqueued or written.
  absl::Status Run(const QuantizeCacheArgs& args, const PagedCache& cache,
                   Stream stream = nullptr) const;

  const Options& options() const { return options_; }

 private:
  explicit PagedCacheQuantizer(const Options& o) : options_(o) {}
  Options options_;
};

// ---------------------------------------------------------------------------
// Linear (non-paged) tensors: [M, K] f16/bf16 <-> packed [M, K/2] u8 +
// scales [M, K/16] e4m3.
// ---------------------------------------------------------------------------
class LinearQuantizer {
 public:
  LinearQuantizer() = default;  // not usable until assigned from Create()
  struct Options {
    DType dtype = DType::kBF16;  // of the unquantized side
    Recipe recipe;
    Device device;
  };
  static absl::StatusOr<LinearQuantizer> Create(const Options& options);
  absl::Status Quantize(const TensorView& input, const TensorView& packed, const TensorView& scales,
                        GlobalScale global_scale, Stream stream = nullptr) const;
  absl::Status Dequantize(const TensorView& packed, const TensorView& scales, const TensorView& output,
                          GlobalScale global_scale, Stream stream = nullptr) const;
  const Options& options() const { return options_; }

 private:
  explicit LinearQuantizer(const Options& o) : options_(o), created_(true) {}
  Options options_;
  bool created_ = false;
};

// ---------------------------------------------------------------------------
// Functional API: Create + Run on the objects above.
// ---------------------------------------------------------------------------
absl::Status QuantizeAppendPaged(const TensorView& append_key, const TensorView& append_value,
                                 const TensorView& batch_indices, const TensorView& positions,
                                 const PagedCache& cache, const TensorView& kv_indices,
                                 const TensorView& kv_indptr, const TensorView& kv_last_page_len,
                                 GlobalScale k_scale, GlobalScale v_scale,
                                 const Recipe& recipe = Recipe(), Stream stream = nullptr);

absl::Status QuantizeAppendBySlot(const TensorView& append_key, const TensorView& append_value,
                                  const TensorView& slot_mapping, const PagedCache& cache,
                                  GlobalScale k_scale, GlobalScale v_scale,
                                  const Recipe& recipe = Recipe(), Stream stream = nullptr);

absl::Status DequantizePaged(const PagedCache& cache, const TensorView& block_tables,
                             const TensorView& seq_lens, const TensorView& k_out,
                             const TensorView& v_out, GlobalScale k_scale, GlobalScale v_scale,
                             Stream stream = nullptr);

absl::Status MaterializeFp8(const PagedCache& cache, const TensorView& block_tables,
                            const TensorView& seq_lens, const TensorView& kv_page_indptr,
                            const TensorView& out, const TensorView& fp8_block_tables,
                            GlobalScale k_scale, GlobalScale v_scale, GlobalScale k_fp8_scale,
                            GlobalScale v_fp8_scale, Stream stream = nullptr);

// Quantizes every page of `source` into the same pages of `cache`.
// k_scale_out / v_scale_out null: with the given scales. Both non-null: the
// scales are computed from the data (no headroom) into those device floats
// first, and k_scale / v_scale are ignored.
absl::Status QuantizePagedCache(const HalfPagedCache& source, const PagedCache& cache,
                                GlobalScale k_scale, GlobalScale v_scale,
                                float* k_scale_out = nullptr, float* v_scale_out = nullptr,
                                const Recipe& recipe = Recipe(), Stream stream = nullptr);

absl::Status QuantizeLinear(const TensorView& input, const TensorView& packed,
                            const TensorView& scales, GlobalScale global_scale,
                            const Recipe& recipe = Recipe(), Stream stream = nullptr);

absl::Status DequantizeLinear(const TensorView& packed, const TensorView& scales,
                              const TensorView& output, GlobalScale global_scale,
                              Stream stream = nullptr);

}  // namespace fp4kv

#endif  // FP4KV_OPS_H_
