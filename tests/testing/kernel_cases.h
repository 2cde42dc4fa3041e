// Random test cases for the kernel ops, shared by the CPU emulation tests
// (tests/kernels_host_test.cc) and the GPU tests (tests/gpu_*_test.cu).
//
// A case keeps all its inputs in one byte blob and all its outputs in
// another; tensors are described by offsets into them, so the same case can
// be viewed at host copies (CPU reference, emulated kernels) or at device
// copies with the same layout. Output blobs start as kPoison with gaps
// between tensors, so comparing whole blobs also checks that nothing outside
// the contract was written.
#ifndef FP4KV_TESTS_TESTING_KERNEL_CASES_H_
#define FP4KV_TESTS_TESTING_KERNEL_CASES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "fp4kv/format.h"
#include "fp4kv/geometry.h"
#include "fp4kv/ops.h"
#include "fp4kv/tensor.h"

namespace fp4kv {
namespace testing {

// A tensor at `offset` bytes into a blob.
struct ViewSpec {
  int64_t offset = -1;  // -1: not given
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // elements
  int64_t bytes = 0;             // extent in the blob

  TensorView At(uint8_t* base, Device device) const;
};

// Lays tensors out in a blob: 16-byte aligned, with a poison gap after each.
class BlobLayout {
 public:
  // A tensor of `shape` whose strides are dense but for `pad` extra elements
  // on every stride of dimension < ndim - 1 that is > 1 (pad * element
  // size must keep 16-byte alignment where the op needs it).
  ViewSpec Add(DType dtype, std::vector<int64_t> shape, int64_t pad = 0);
  ViewSpec AddStrided(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides);
  int64_t size() const { return size_; }

 private:
  int64_t size_ = 0;
};

// Storage of one paged cache in a blob (tuple or stacked form).
struct PoolSpec {
  CacheGeometry geometry;
  bool stacked = false;
  ViewSpec k_data, v_data, k_scales, v_scales;  // tuple form
  ViewSpec data, scales;                        // stacked form
  PagedCache At(uint8_t* base, Device device) const;
};
PoolSpec AddPool(BlobLayout& layout, const CacheGeometry& g, bool stacked);

// With g.fp8_keys() the K pool is [P, a, b, Dk] E4M3 bytes and has no scales
// (stacked must be false).
// Fills a pool's code and scale bytes with random content: every code byte
// random, scale bytes mostly in [0, 0x7e], `wild_percent` of them any byte
// (negative and NaN scales included).
void FillPoolRandom(const PoolSpec& pool, std::vector<uint8_t>& blob, int wild_percent,
                    uint64_t seed);

// Global scales: fixed values, or device pointers into the input blob (only
// those change on Rewrite()).
struct ScaleSpec {
  float value = 1.0f;
  int64_t offset = -1;  // in the input blob when a pointer
  GlobalScale At(uint8_t* base) const;
};

// ---------------------------------------------------------------------------
struct AppendSpec {
  KeyFormat key_format = KeyFormat::kNvfp4;  // kFp8: tuple pools only
  int num_heads = 2;
  int head_dim_k = 64;
  int head_dim_v = 64;
  int page_size = 16;
  Layout layout = Layout::kNHD;
  bool stacked = false;  // needs head_dim_k == head_dim_v
  DType dtype = DType::kBF16;
  AppendIndexing indexing = AppendIndexing::kSlot;
  Recipe recipe;
  int batch = 3;           // requests (kPaged) / sequences (kSlot)
  int max_new_tokens = 5;  // per request
  bool pointer_scales = false;
  bool padded_input = false;  // key/value rows and heads with extra stride
  bool invalid_rows = true;   // padding and out-of-range rows
  bool count_events = false;  // scale-event counters (in the output blob)
  std::string Name() const;
};

struct AppendCase {
  AppendSpec spec;
  CacheGeometry geometry;
  int64_t rows = 0;  // rows of key/value
  std::vector<uint8_t> in;
  std::vector<uint8_t> out;  // the pools, poisoned
  ViewSpec key, value, batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len,
      slot_mapping;
  ViewSpec scale_events;  // [4] u64 in the output blob when spec.count_events
  PoolSpec pool;
  ScaleSpec k_scale, v_scale;

  // out_base: where scale_events lives (may be null without count_events).
  AppendArgs Args(uint8_t* in_base, Device device, uint8_t* out_base = nullptr) const;
  PagedCache Cache(uint8_t* out_base, Device device) const { return pool.At(out_base, device); }
  Appender::Options Options(Device device) const;
  // New data, indices and scale values in place (same shapes), as the host
  // does between two replays of a captured step.
  void Rewrite(uint64_t seed);
};
AppendCase MakeAppendCase(const AppendSpec& spec, uint64_t seed);

// ---------------------------------------------------------------------------
struct DequantSpec {
  KeyFormat key_format = KeyFormat::kNvfp4;  // kFp8: tuple pools only
  int num_heads = 2;
  int head_dim_k = 64;
  int head_dim_v = 64;
  int page_size = 16;
  Layout layout = Layout::kNHD;
  bool stacked = false;
  DType dtype = DType::kBF16;
  DType table_dtype = DType::kI32;
  int batch = 3;
  int max_seq_len = 40;
  int max_pages = 4;  // may cover less than max_seq_len
  bool pointer_scales = false;
  bool padded_output = false;
  std::string Name() const;
};

struct DequantCase {
  DequantSpec spec;
  CacheGeometry geometry;
  std::vector<uint8_t> in;   // pools, tables, lengths, scales
  std::vector<uint8_t> out;  // k_out, v_out, poisoned
  PoolSpec pool;
  ViewSpec block_tables, seq_lens, k_out, v_out;
  ScaleSpec k_scale, v_scale;

  DequantArgs Args(uint8_t* in_base, uint8_t* out_base, Device device) const;
  PagedCache Cache(uint8_t* in_base, Device device) const { return pool.At(in_base, device); }
  Dequantizer::Options Options(Device device) const;
  void Rewrite(uint64_t seed);
};
DequantCase MakeDequantCase(const DequantSpec& spec, uint64_t seed);

// ---------------------------------------------------------------------------
struct MaterializeSpec {
  KeyFormat key_format = KeyFormat::kNvfp4;  // kFp8: tuple pools only
  int num_heads = 2;
  int head_dim = 64;
  int page_size = 16;  // multiple of 4
  Layout layout = Layout::kNHD;
  bool stacked = false;
  DType table_dtype = DType::kI32;
  bool separate_kv_tables = false;
  int batch = 3;
  int max_pages = 4;
  bool pointer_scales = false;
  bool short_out = false;  // fewer out pages than kv_page_indptr asks for
  std::string Name() const;
};

struct MaterializeCase {
  MaterializeSpec spec;
  CacheGeometry geometry;
  std::vector<uint8_t> in;
  std::vector<uint8_t> out;  // out pages and fp8_block_tables, poisoned
  PoolSpec pool;
  ViewSpec block_tables, seq_lens, kv_page_indptr, out_pages, fp8_block_tables;
  ScaleSpec k_scale, v_scale, k_fp8_scale, v_fp8_scale;

  MaterializeArgs Args(uint8_t* in_base, uint8_t* out_base, Device device) const;
  PagedCache Cache(uint8_t* in_base, Device device) const { return pool.At(in_base, device); }
  Materializer::Options Options(Device device) const;
  void Rewrite(uint64_t seed);
};
MaterializeCase MakeMaterializeCase(const MaterializeSpec& spec, uint64_t seed);

// ---------------------------------------------------------------------------
struct LinearSpec {
  int64_t rows = 5;
  int64_t cols = 64;
  DType dtype = DType::kBF16;
  Recipe recipe;
  bool pointer_scale = false;
  bool padded = false;  // row strides larger than dense
  std::string Name() const;
};

struct LinearCase {
  LinearSpec spec;
  std::vector<uint8_t> in;               // input, packed', scales' (for dequantize), scale
  std::vector<uint8_t> out;              // packed, scales, output; poisoned
  ViewSpec input, in_packed, in_scales;  // quantize input; dequantize inputs
  ViewSpec packed, scales, output;       // outputs
  ScaleSpec scale;
  void Rewrite(uint64_t seed);
};
LinearCase MakeLinearCase(const LinearSpec& spec, uint64_t seed);

// ---------------------------------------------------------------------------
struct QuantizeCacheSpec {
  KeyFormat key_format = KeyFormat::kNvfp4;  // kFp8: tuple pools only
  int num_heads = 2;
  int head_dim_k = 64;
  int head_dim_v = 64;
  int page_size = 16;
  Layout source_layout = Layout::kNHD;
  Layout cache_layout = Layout::kNHD;
  bool source_stacked = false;  // need head_dim_k == head_dim_v
  bool cache_stacked = false;
  DType dtype = DType::kBF16;
  Recipe recipe;
  int source_pages = 5;
  bool lists = false;  // src/dst page lists (with out-of-range entries) and a partial num_tokens
  bool compute_scales = false;
  bool pointer_scales = false;
  bool padded_source = false;  // extra stride on every source dimension but the last
  std::string Name() const;
};

struct QuantizeCacheCase {
  QuantizeCacheSpec spec;
  CacheGeometry geometry;  // of the NVFP4 cache
  int64_t num_tokens = -1;
  std::vector<uint8_t> in;   // source, lists, scales
  std::vector<uint8_t> out;  // the pool and the computed scales, poisoned
  ViewSpec k_src, v_src, kv_src, src_pages, dst_pages;
  ViewSpec k_scale_out, v_scale_out;  // [1] f32 in the output blob (compute_scales)
  PoolSpec pool;
  ScaleSpec k_scale, v_scale;

  QuantizeCacheArgs Args(uint8_t* in_base, uint8_t* out_base, Device device) const;
  PagedCache Cache(uint8_t* out_base, Device device) const { return pool.At(out_base, device); }
  PagedCacheQuantizer::Options Options(Device device) const;
  void Rewrite(uint64_t seed);
};
QuantizeCacheCase MakeQuantizeCacheCase(const QuantizeCacheSpec& spec, uint64_t seed);
std::vector<QuantizeCacheSpec> QuantizeCacheSweep();

// Representative sweeps (a mixed cross product of page sizes 1..64, batch
// sizes 1..128, head dims 64/128/256 and K != V, both layouts, tuple and
// stacked pools, both dtypes and table dtypes, every recipe, scales as values
// and as pointers, padded strides) kept small enough for a fast suite.
std::vector<AppendSpec> AppendSweep();
std::vector<DequantSpec> DequantSweep();
std::vector<MaterializeSpec> MaterializeSweep();
std::vector<LinearSpec> LinearSweep();
std::vector<Recipe> AllRecipes();

// First differing byte of two blobs, as text ("" when equal).
std::string FirstDifference(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got);

}  // namespace testing
}  // namespace fp4kv

#endif  // FP4KV_TESTS_TESTING_KERNEL_CASES_H_
