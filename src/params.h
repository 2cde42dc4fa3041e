// Internal: the plain-pointer form of each op, filled by validation and read
// by both the CPU reference (src/reference/) and the CUDA kernels (kernels/).
// Every pointer here points to memory on the op's device. Strides are in
// bytes for pools and in elements for f16/bf16 tensors and tables.
#ifndef FP4KV_SRC_PARAMS_H_
#define FP4KV_SRC_PARAMS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "fp4kv/format.h"
#include "fp4kv/ops.h"
#include "fp4kv/recipe.h"
#include "fp4kv/tensor.h"

namespace fp4kv {
namespace internal {

// One of K or V of one cache: packed data and scales with byte strides.
// For FP8 keys (KeyFormat::kFp8) the K pool's data rows hold head_dim E4M3
// bytes and `scales` is null (each op's params say fp8_keys).
struct PoolPtrs {
  uint8_t* data = nullptr;
  uint8_t* scales = nullptr;
  int64_t data_page = 0, data_entry = 0, data_head = 0;     // bytes
  int64_t scale_page = 0, scale_entry = 0, scale_head = 0;  // bytes
  int head_dim = 0;

  FP4KV_HD int64_t DataOffset(int64_t page, int64_t entry, int64_t head) const {
    return page * data_page + entry * data_entry + head * data_head;
  }
  FP4KV_HD int64_t ScaleOffset(int64_t page, int64_t entry, int64_t head) const {
    return page * scale_page + entry * scale_entry + head * scale_head;
  }
};

struct AppendParams {
  const void* key = nullptr;  // [nnz, H, Dk]
  const void* value = nullptr;
  int64_t key_row_stride = 0, key_head_stride = 0;  // elements
  int64_t value_row_stride = 0, value_head_stride = 0;
  DType input_dtype = DType::kBF16;
  int64_t nnz = 0;  // rows to process
  int num_heads = 0;
  int page_size = 0;
  int64_t num_pages = 0;
  PoolPtrs k, v;
  AppendIndexing indexing = AppendIndexing::kPaged;
  // kPaged
  const int32_t* batch_indices = nullptr;  // [nnz]
  const int32_t* positions = nullptr;      // [nnz]
  const int32_t* kv_indices = nullptr;     // [num_kv_indices]
  const int32_t* kv_indptr = nullptr;      // [batch_size + 1]
  int64_t num_kv_indices = 0;
  int batch_size = 0;
  // kSlot
  const int64_t* slot_mapping = nullptr;  // [nnz]
  GlobalScale k_scale, v_scale;
  Recipe recipe;
  // [4] K saturated, K underflow, V saturated, V underflow; null: not counted.
  // FP8 keys count 16-value groups (ClassifyFp8KeyBlock).
  uint64_t* scale_events = nullptr;
  bool fp8_keys = false;  // K rows are E4M3 bytes under k_scale (no block scales)
  // CUDA: launched as a programmatic dependent of the kernel before it in
  // the stream (its CTAs may become resident while that kernel finishes and
  // wait in griddepcontrol.wait before reading anything). Set by RunAppend
  // when the append kernels' loaded code has that wait (sm_90+).
  bool overlap_launch = false;
};

struct DequantParams {
  PoolPtrs k, v;  // read only
  int num_heads = 0;
  int page_size = 0;
  int64_t num_pages = 0;
  const void* block_tables = nullptr;  // [B, max_pages] i32 or i64
  bool tables_i64 = false;
  int64_t table_row_stride = 0;  // elements
  int max_pages = 0;
  const int32_t* seq_lens = nullptr;  // [B]
  int batch_size = 0;
  int max_seq_len = 0;
  void* k_out = nullptr;  // [B, max_seq_len, H, Dk]
  void* v_out = nullptr;
  int64_t k_out_batch = 0, k_out_token = 0, k_out_head = 0;  // elements
  int64_t v_out_batch = 0, v_out_token = 0, v_out_head = 0;
  DType output_dtype = DType::kBF16;
  GlobalScale k_scale, v_scale;
  bool fp8_keys = false;
};

struct MaterializeParams {
  PoolPtrs k, v;  // read only
  int num_heads = 0;
  int head_dim = 0;
  int page_size = 0;
  int64_t num_pages = 0;
  const void* block_tables = nullptr;  // [B, max_pages] or [B, 2, max_pages]
  bool tables_i64 = false;
  int64_t table_row_stride = 0;  // elements, between requests
  int64_t table_kv_stride = 0;   // elements, K -> V (0 when shared)
  int max_pages = 0;
  const int32_t* seq_lens = nullptr;        // [B]
  const int32_t* kv_page_indptr = nullptr;  // [B + 1]
  int batch_size = 0;
  uint8_t* out = nullptr;  // [num_out_pages, 2, H, page_size, D]
  int64_t num_out_pages = 0;
  int64_t out_page = 0, out_kv = 0, out_head = 0, out_entry = 0;  // bytes
  int32_t* fp8_block_tables = nullptr;  // [B, max_pages]
  int64_t fp8_table_row_stride = 0;     // elements
  GlobalScale k_scale, v_scale, k_fp8_scale, v_fp8_scale;
  // FP8 keys: K bytes become MaterializeFp8KeyValue(code, k_scale / k_fp8_scale).
  bool fp8_keys = false;
};

struct LinearQuantParams {
  const void* input = nullptr;  // [rows, cols]
  int64_t input_row_stride = 0;  // elements
  DType dtype = DType::kBF16;
  int64_t rows = 0, cols = 0;
  uint8_t* packed = nullptr;  // [rows, cols/2]
  int64_t packed_row_stride = 0;  // bytes
  uint8_t* scales = nullptr;  // [rows, cols/16]
  int64_t scale_row_stride = 0;  // bytes
  GlobalScale scale;
  Recipe recipe;
};

struct LinearDequantParams {
  const uint8_t* packed = nullptr;
  int64_t packed_row_stride = 0;
  const uint8_t* scales = nullptr;
  int64_t scale_row_stride = 0;
  int64_t rows = 0, cols = 0;
  void* output = nullptr;
  int64_t output_row_stride = 0;  // elements
  DType dtype = DType::kBF16;
  GlobalScale scale;
};

// Calibration of a cache layer from the rows of its first append: amax over
// the rows whose slot is >= 0, per K and V, NaN ignored; a side whose flag is
// 0 and whose amax is > 0 gets g = MakeGlobalScale(amax * headroom, recipe)
// and FP8 scale MinFp8ScaleFor(g), and its flag set to 1. A side with flag 1,
// or with amax 0 (nothing but zeros so far), is left as it is.
struct RowCalibrationParams {
  const void* key = nullptr;    // [rows, H, Dk] f16/bf16
  const void* value = nullptr;  // [rows, H, Dv]
  int64_t key_row_stride = 0, key_head_stride = 0;  // elements
  int64_t value_row_stride = 0, value_head_stride = 0;
  DType dtype = DType::kBF16;
  int64_t rows = 0;
  int num_heads = 0;
  int head_dim_k = 0, head_dim_v = 0;
  const int64_t* slot_mapping = nullptr;  // [rows]; negative: padding, not read
  float* scales = nullptr;      // [4] of the layer: K, V, K fp8, V fp8
  int32_t* flags = nullptr;     // [2] K, V calibrated
  int32_t* host_flags = nullptr;  // [2] host-visible mirror (mapped pinned), or null
  uint32_t* scratch = nullptr;  // [3] amax K bits, amax V bits, CTA ticket; 0 between launches
  float headroom = 1.0f;
  Recipe recipe;
  // FP8 keys: K gets g = MakeFp8KeyScale(amax * headroom) and FP8 scale
  // MinFp8ScaleForFp8Keys(g) instead.
  bool fp8_keys = false;
};

// Requantizes NVFP4 blocks in place from one global scale to another:
// x = DequantizeBlock(old), then QuantizeBlock(x, new, recipe). The blocks are
// dense: block i has bytes data[8i, 8i+8) and scale byte scales[i].
struct ReencodeParams {
  uint8_t* data = nullptr;
  uint8_t* scales = nullptr;
  int64_t blocks = 0;
  const float* old_scale = nullptr;  // read when the op runs
  const float* new_scale = nullptr;
  Recipe recipe;
  // FP8 key bytes instead: data holds 16 * blocks E4M3 bytes, scales unused;
  // byte c becomes QuantizeFp8Key(DequantFp8Key(c, old), Fp8KeyEncodeMultiplier(new)).
  bool fp8_keys = false;
};

// Copies whole pages between two page stores of the same geometry (pools,
// sequence images, the host tier). A store holds, per layer l and region r
// (K data, V data, K scales, V scales), pages of page_bytes[r] at
//   base + l * layer_stride + region[r] + id * page_bytes[r].
// List position i copies page src_ids[i] of src to page dst_ids[i] of dst
// (a null list: id = i), for every layer and region; or, with inline_ids
// set, pages ids[i] and ids[kInlineIds + i] (a short list that travels in
// the launch itself, so that the copy needs no upload of its ids before it).
// The stores must not overlap. Either side may be mapped pinned host memory
// (device addresses).
struct PageCopyParams {
  static constexpr int kInlineIds = 64;
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  int64_t src_layer_stride = 0, dst_layer_stride = 0;
  int64_t src_region[4] = {0, 0, 0, 0};
  int64_t dst_region[4] = {0, 0, 0, 0};
  int64_t page_bytes[4] = {0, 0, 0, 0};
  const int32_t* src_ids = nullptr;
  const int32_t* dst_ids = nullptr;
  int64_t num_pages = 0;  // list positions
  int num_layers = 0;
  // CUDA: at most this many CTAs (0: the default); copies that cross PCIe
  // need far fewer in flight than device copies and leave the SMs to
  // concurrent kernels.
  int max_ctas = 0;
  bool inline_ids = false;  // num_pages <= kInlineIds
  int32_t ids[2 * kInlineIds] = {};

  FP4KV_HD int64_t SrcPage(int64_t i) const {
    return inline_ids ? ids[i] : src_ids != nullptr ? src_ids[i] : i;
  }
  FP4KV_HD int64_t DstPage(int64_t i) const {
    return inline_ids ? ids[kInlineIds + i] : dst_ids != nullptr ? dst_ids[i] : i;
  }
};

// Requantizes the blocks of listed pages of a pool, per layer and side, from
// the global scale src_scales[4 l + kv] to the pool's dst_scales[4 l + kv]
// (bit-equal scales: untouched). Blocks as in ReencodeParams: page p of a
// side holds blocks_per_page[kv] blocks, data at region[kv] + p *
// page_bytes[kv] + 8 b, scale byte at region[2 + kv] + p * page_bytes[2 + kv] + b.
struct RequantizePagesParams {
  uint8_t* pool = nullptr;
  int64_t layer_stride = 0;
  int64_t region[4] = {0, 0, 0, 0};
  int64_t page_bytes[4] = {0, 0, 0, 0};
  const int32_t* pages = nullptr;  // [num_pages]
  int64_t num_pages = 0;
  int num_layers = 0;
  const float* src_scales = nullptr;  // [L, 4], read when the op runs
  const float* dst_scales = nullptr;  // [L, 4]
  Recipe recipe;
  // FP8 keys: the K side has no block scales (page_bytes[2] == 0); every key
  // byte c of a page (page_bytes[0] of them at region[0] + p * page_bytes[0])
  // becomes QuantizeFp8Key(DequantFp8Key(c, src), Fp8KeyEncodeMultiplier(dst)).
  bool fp8_keys = false;
};

// An import's adoption of an image's scales by pending layers: for every
// (l, kv) with mask[2 l + kv] set, the global and FP8 scales
// (scales[4 l + kv], scales[4 l + 2 + kv]), the calibrated flag and its host
// mirror take the image's values (image_scales [L, 4] f32, image_flags [L, 2]).
struct AdoptScalesParams {
  const float* image_scales = nullptr;
  const int32_t* image_flags = nullptr;
  const uint8_t* mask = nullptr;  // [L, 2]
  float* scales = nullptr;        // [L, 4]
  int32_t* flags = nullptr;       // [L, 2]
  int32_t* host_flags = nullptr;  // [L, 2] mapped mirror, or null
  int num_layers = 0;
};

// Quantization of an unquantized (f16/bf16) paged cache into a paged NVFP4
// cache. Row r (a token slot) is entry r % page_size of list position
// r / page_size: source page src_pages[i] (i itself without lists) goes to
// cache page dst_pages[i] (i). Rows [0, rows) are processed.
struct QuantizeCacheParams {
  const void* k_src = nullptr;  // NHD [P_src, S, H, Dk] / HND [P_src, H, S, Dk]
  const void* v_src = nullptr;
  int64_t k_src_page = 0, k_src_entry = 0, k_src_head = 0;  // elements
  int64_t v_src_page = 0, v_src_entry = 0, v_src_head = 0;
  DType dtype = DType::kBF16;
  int64_t src_num_pages = 0;
  int num_heads = 0;
  int page_size = 0;
  int64_t num_pages = 0;  // of the NVFP4 cache
  PoolPtrs k, v;
  const int32_t* src_pages = nullptr;  // [num_listed] or null (identity)
  const int32_t* dst_pages = nullptr;  // [num_listed], given iff src_pages
  int64_t rows = 0;
  GlobalScale k_scale, v_scale;  // what the quantize reads
  Recipe recipe;
  // Scale computation (compute_scales): amax of each side over the rows that
  // write, accumulated as fp32 bits with an integer max into amax_bits[kv]
  // (zeroed first when zero_first), then FinishCacheScales.
  bool compute_scales = false;
  bool zero_first = false;
  uint32_t* amax_bits[2] = {nullptr, nullptr};
  float* scale_out[2] = {nullptr, nullptr};  // may alias amax_bits
  float* fp8_out[2] = {nullptr, nullptr};    // MinFp8ScaleFor(g), or null
  // Conditional mode (a cache's pending layers): a side whose flag is set,
  // or whose amax is 0, keeps its scales; otherwise its flag (and host flag)
  // become 1. Null: every side gets the computed scale.
  int32_t* flags = nullptr;       // [2]
  int32_t* host_flags = nullptr;  // [2] or null
  float headroom = 1.0f;
  // FP8 keys: K rows are E4M3 bytes; K's computed scale is
  // MakeFp8KeyScale(amax * headroom), its FP8 scale MinFp8ScaleForFp8Keys.
  bool fp8_keys = false;
};

// Resolves row r of a cache quantization: false when it writes nothing (a
// listed page outside [0, src_num_pages) or [0, num_pages)).
FP4KV_HD bool ResolveCacheRow(const QuantizeCacheParams& p, int64_t list_index, int64_t* src,
                              int64_t* dst) {
  int64_t s = list_index, d = list_index;
  if (p.src_pages != nullptr) {
    s = p.src_pages[list_index];
    d = p.dst_pages[list_index];
  }
  if (s < 0 || s >= p.src_num_pages || d < 0 || d >= p.num_pages) return false;
  *src = s;
  *dst = d;
  return true;
}

// The end of a scale computation, given each side's amax (one thread).
FP4KV_HD void FinishCacheScales(const QuantizeCacheParams& p, const float (&amax)[2]) {
  for (int kv = 0; kv < 2; ++kv) {
    if (p.flags != nullptr && (p.flags[kv] != 0 || !(amax[kv] > 0.0f))) continue;
    const bool fp8 = kv == 0 && p.fp8_keys;
    const float a = MulRn(amax[kv], p.headroom);
    const float g = fp8 ? MakeFp8KeyScale(a) : MakeGlobalScale(a, p.recipe);
    *p.scale_out[kv] = g;
    if (p.fp8_out[kv] != nullptr)
      *p.fp8_out[kv] = fp8 ? MinFp8ScaleForFp8Keys(g) : MinFp8ScaleFor(g);
    if (p.flags != nullptr) {
      p.flags[kv] = 1;
      if (p.host_flags != nullptr) p.host_flags[kv] = 1;
    }
  }
}

// Where row i of an append goes. Returns false for a row that writes nothing:
// padding (negative slot), or a batch index, position, kv_indices entry or
// page outside its range. Shared by the reference and the kernels.
FP4KV_HD bool ResolveAppendRow(const AppendParams& p, int64_t i, int64_t* page, int* entry) {
  int64_t pg;
  int64_t e;
  if (p.indexing == AppendIndexing::kSlot) {
    const int64_t slot = p.slot_mapping[i];
    if (slot < 0) return false;
    pg = slot / p.page_size;
    e = slot % p.page_size;
  } else {
    const int32_t b = p.batch_indices[i];
    const int32_t pos = p.positions[i];
    if (b < 0 || b >= p.batch_size || pos < 0) return false;
    const int64_t begin = p.kv_indptr[b];
    const int64_t end = p.kv_indptr[b + 1];
    const int64_t idx = begin + pos / p.page_size;
    if (idx < begin || idx >= end || idx < 0 || idx >= p.num_kv_indices) return false;
    pg = p.kv_indices[idx];
    e = pos % p.page_size;
  }
  if (pg < 0 || pg >= p.num_pages) return false;
  *page = pg;
  *entry = static_cast<int>(e);
  return true;
}

// Reads entry j of row b of a block table (i32 or i64).
FP4KV_HD int64_t TableEntry(const void* table, bool i64, int64_t offset) {
  return i64 ? static_cast<const int64_t*>(table)[offset]
             : static_cast<int64_t>(static_cast<const int32_t*>(table)[offset]);
}

// Tokens of request b that a dequantize reads: seq_lens[b] clamped to
// [0, min(max_seq_len, max_pages * page_size)].
FP4KV_HD int64_t DequantTokens(const DequantParams& p, int b) {
  int64_t n = p.seq_lens[b];
  if (n < 0) n = 0;
  if (n > p.max_seq_len) n = p.max_seq_len;
  const int64_t cap = static_cast<int64_t>(p.max_pages) * p.page_size;
  return n < cap ? n : cap;
}

// Pages of request b that a materialize writes: ceil(seq_lens[b] / page_size)
// clamped to the pages reserved in kv_page_indptr and to max_pages.
FP4KV_HD int64_t MaterializePages(const MaterializeParams& p, int b) {
  int64_t len = p.seq_lens[b];
  if (len < 0) len = 0;
  int64_t n = (len + p.page_size - 1) / p.page_size;
  const int64_t reserved = static_cast<int64_t>(p.kv_page_indptr[b + 1]) - p.kv_page_indptr[b];
  if (n > reserved) n = reserved < 0 ? 0 : reserved;
  if (n > p.max_pages) n = p.max_pages;
  return n;
}

// A cache's K and V pools as CheckCache (src/validate.h) fills them from its
// views: what an op reads of a cache once the views are known to be valid.
struct CachePools {
  PoolPtrs k, v;
};

// Checks an op's per-call views against its (validated) options and fills
// the params its reference and kernel read (src/ops.cc). Cheap: no device
// access. Errors are InvalidArgument naming the argument.
absl::StatusOr<AppendParams> MakeAppendParams(const Appender::Options& o, const AppendArgs& a,
                                              const PagedCache& cache);
absl::StatusOr<DequantParams> MakeDequantParams(const Dequantizer::Options& o,
                                                const DequantArgs& a, const PagedCache& cache);
absl::StatusOr<MaterializeParams> MakeMaterializeParams(const Materializer::Options& o,
                                                        const MaterializeArgs& a,
                                                        const PagedCache& cache);
absl::StatusOr<QuantizeCacheParams> MakeQuantizeCacheParams(const PagedCacheQuantizer::Options& o,
                                                            const QuantizeCacheArgs& a,
                                                            const PagedCache& cache);

// The same for a cache whose views were checked once already (CheckCache
// against the op's geometry and device, e.g. when a KVCache binds an op):
// only the call's own views are checked here.
absl::StatusOr<AppendParams> MakeAppendParams(const Appender::Options& o, const AppendArgs& a,
                                              const CachePools& pools);
absl::StatusOr<DequantParams> MakeDequantParams(const Dequantizer::Options& o,
                                                const DequantArgs& a, const CachePools& pools);
absl::StatusOr<MaterializeParams> MakeMaterializeParams(const Materializer::Options& o,
                                                        const MaterializeArgs& a,
                                                        const CachePools& pools);

// The second half of an op's Run(): dispatches filled params to the CPU
// reference (synchronous) or the CUDA launcher on `stream`, after the op's
// own early outs (nothing to do). `op` comes from Create(); `p` from the
// Make*Params of its options.
absl::Status RunAppend(const Appender& op, const AppendParams& p, Stream stream);

// What Create() found about an Appender's device (RunAppend's business).
struct AppendAccess {
  static bool OverlapLaunch(const Appender& op) { return op.overlap_launch_; }
  static Appender Make(const Appender::Options& o, bool overlap_launch) {
    return Appender(o, overlap_launch);
  }
};
absl::Status RunDequantize(const Dequantizer& op, const DequantParams& p, Stream stream);
absl::Status RunMaterialize(const Materializer& op, const MaterializeParams& p, Stream stream);

// CPU reference (src/reference/). Synchronous, host memory.
void ReferenceAppend(const AppendParams& p);
void ReferenceDequantize(const DequantParams& p);
void ReferenceMaterialize(const MaterializeParams& p);
void ReferenceQuantizeLinear(const LinearQuantParams& p);
void ReferenceDequantizeLinear(const LinearDequantParams& p);
void ReferenceCalibrateRows(const RowCalibrationParams& p);
void ReferenceReencode(const ReencodeParams& p);
void ReferencePageCopy(const PageCopyParams& p);
void ReferenceAdoptScales(const AdoptScalesParams& p);
void ReferenceRequantizePages(const RequantizePagesParams& p);
void ReferenceQuantizeCache(const QuantizeCacheParams& p);

// CUDA launchers (kernels/). Enqueue on `stream`, allocate nothing, never
// synchronize; return the launch status (cudaGetLastError) as a Status.
//
// Each Load*Kernels loads, on the current device, every kernel its launcher
// may launch for the given fixed options (LoadKernel, src/cuda_util.h): an
// op's Create() calls it, so that no Run() pays a lazy module load.
absl::Status LoadAppendKernels(DType input_dtype, const Recipe& recipe, bool count_events);
absl::Status LoadDequantizeKernels(DType output_dtype);
absl::Status LoadMaterializeKernels(bool fp8_keys);
absl::Status LoadLinearKernels(DType dtype, const Recipe& recipe);
absl::Status LoadQuantizeCacheKernels(DType input_dtype, const Recipe& recipe);
// The kernels a KVCache launches itself: row calibration (both dtypes) and
// re-encode (kernels/scales.cu); page copies, the import's scale adoption and
// requantization (kernels/page_copy.cu).
absl::Status LoadScaleKernels();
absl::Status LoadPageCopyKernels();
absl::Status LaunchAppend(const AppendParams& p, Stream stream);
// Whether the append kernels' code loaded on the current device waits in
// griddepcontrol.wait (PTX 9.0+), so that AppendParams::overlap_launch is safe.
absl::Status AppendOverlapsLaunch(bool* out);
absl::Status LaunchDequantize(const DequantParams& p, Stream stream);
absl::Status LaunchMaterialize(const MaterializeParams& p, Stream stream);
absl::Status LaunchQuantizeLinear(const LinearQuantParams& p, Stream stream);
absl::Status LaunchDequantizeLinear(const LinearDequantParams& p, Stream stream);
absl::Status LaunchCalibrateRows(const RowCalibrationParams& p, Stream stream);
absl::Status LaunchReencode(const ReencodeParams& p, Stream stream);
absl::Status LaunchPageCopy(const PageCopyParams& p, Stream stream);
// Tests only: every later LaunchPageCopy first holds its stream for this many
// microseconds (0, the default: no hold), so that a page read or reused
// before its copy completes shows as wrong bytes instead of a rare race.
void SetPageCopyDelayForTesting(int64_t microseconds);
absl::Status LaunchAdoptScales(const AdoptScalesParams& p, Stream stream);
absl::Status LaunchRequantizePages(const RequantizePagesParams& p, Stream stream);
// Scale computation (when p.compute_scales) and quantization, in order.
absl::Status LaunchQuantizeCache(const QuantizeCacheParams& p, Stream stream);

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_PARAMS_H_
