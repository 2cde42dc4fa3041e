// Geometry of one paged NVFP4 cache, and the caller-owned storage views.
#ifndef FP4KV_GEOMETRY_H_
#define FP4KV_GEOMETRY_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "fp4kv/format.h"
#include "fp4kv/tensor.h"

namespace fp4kv {

// Where a page keeps its rows.
//   kNHD: [num_pages, page_size, num_kv_heads, dim]
//   kHND: [num_pages, num_kv_heads, page_size, dim]
enum class Layout : uint8_t { kNHD = 0, kHND = 1 };
const char* LayoutName(Layout l);

// How a cache stores its keys; values are always NVFP4 (docs/format.md,
// "FP8 key pages").
//   kNvfp4: packed E2M1 rows of head_dim_k/2 bytes plus E4M3 block-scale rows
//           of head_dim_k/16 bytes, decoded e2m1 * s * g_k (the default).
//   kFp8:   one E4M3 byte per value (rows of head_dim_k bytes), no block
//           scales, decoded e4m3(code) * g_k with the layer's key global
//           scale g_k (DequantFp8Key in format.h). 0.78 B per cached value
//           with NVFP4 values at equal head dims, against 0.5625 for NVFP4
//           K+V and 1.0 for FP8 K+V.
enum class KeyFormat : uint8_t { kNvfp4 = 0, kFp8 = 1 };
const char* KeyFormatName(KeyFormat f);

// Describes one cache (one layer's K and V). NVFP4 data rows have head_dim/2
// bytes (u8), scale rows head_dim/16 bytes (e4m3); FP8 key rows (key_format
// kFp8) have head_dim_k bytes and no scale rows. Plain value type.
struct CacheGeometry {
  int num_kv_heads = 0;
  int head_dim_k = 0;  // multiple of 16
  int head_dim_v = 0;  // multiple of 16; may differ from head_dim_k
  int page_size = 0;
  int64_t num_pages = 0;
  Layout layout = Layout::kNHD;
  KeyFormat key_format = KeyFormat::kNvfp4;

  // Checks the fields (positive, head dims multiples of 16, a known layout
  // and key format).
  absl::Status Validate() const;

  FP4KV_HD bool fp8_keys() const { return key_format == KeyFormat::kFp8; }
  // Bytes of one K (or V) row of data / of block scales (0 for FP8 keys).
  FP4KV_HD int64_t DataRowBytes(bool is_v) const {
    return is_v ? head_dim_v / 2 : (fp8_keys() ? head_dim_k : head_dim_k / 2);
  }
  FP4KV_HD int64_t ScaleRowBytes(bool is_v) const {
    return is_v ? head_dim_v / kBlockSize : (fp8_keys() ? 0 : head_dim_k / kBlockSize);
  }
  // Index of row (page, entry, head) in units of rows of a contiguous pool.
  FP4KV_HD int64_t RowIndex(int64_t page, int64_t entry, int64_t head) const {
    return layout == Layout::kNHD ? (page * page_size + entry) * num_kv_heads + head
                                  : (page * num_kv_heads + head) * page_size + entry;
  }
  FP4KV_HD int64_t DataOffset(int64_t page, int64_t entry, int64_t head, bool is_v) const {
    return RowIndex(page, entry, head) * DataRowBytes(is_v);
  }
  FP4KV_HD int64_t ScaleOffset(int64_t page, int64_t entry, int64_t head, bool is_v) const {
    return RowIndex(page, entry, head) * ScaleRowBytes(is_v);
  }
  // Bytes of one page of K plus V, data and scales.
  int64_t PageBytes() const {
    return static_cast<int64_t>(page_size) * num_kv_heads *
           (DataRowBytes(false) + DataRowBytes(true) + ScaleRowBytes(false) + ScaleRowBytes(true));
  }
  // Bytes of storage per token of this cache (one layer): K and V, data and
  // scales, PageBytes() / page_size.
  double BytesPerToken() const {
    return static_cast<double>(PageBytes()) / static_cast<double>(page_size);
  }
};

// Caller-owned paged storage for one cache: four 4-D views (tuple form).
//   data:   NHD [P, S, H, D/2] u8   HND [P, H, S, D/2] u8
//   scales: NHD [P, S, H, D/16] e4m3 (u8 accepted)   HND [P, H, S, D/16]
// Strides may be anything with a contiguous last dimension, e.g. the halves of
// a stacked tensor.
// FP8 keys (key_format kFp8, made by Fp8Keys): k_data is [P, S, H, Dk] (NHD)
// or [P, H, S, Dk] (HND) of E4M3 bytes (u8 or e4m3 dtype) and k_scales is
// not given (an empty view); values as above. The stacked form holds NVFP4
// keys only (K and V rows differ in size otherwise).
struct PagedCache {
  TensorView k_data;
  TensorView v_data;
  TensorView k_scales;
  TensorView v_scales;
  Layout layout = Layout::kNHD;
  KeyFormat key_format = KeyFormat::kNvfp4;

  static PagedCache FromTuple(const TensorView& k_data, const TensorView& v_data,
                              const TensorView& k_scales, const TensorView& v_scales,
                              Layout layout) {
    return PagedCache{k_data, v_data, k_scales, v_scales, layout, KeyFormat::kNvfp4};
  }
  // FP8 keys, NVFP4 values.
  static PagedCache Fp8Keys(const TensorView& k_data, const TensorView& v_data,
                            const TensorView& v_scales, Layout layout) {
    return PagedCache{k_data, v_data, TensorView{}, v_scales, layout, KeyFormat::kFp8};
  }
  // Stacked 5-D form: data [P, 2, S, H, D/2] (NHD) or [P, 2, H, S, D/2] (HND),
  // scales [P, 2, ..., D/16]; index 0 on dimension 1 is K, 1 is V.
  static absl::StatusOr<PagedCache> FromStacked(const TensorView& data, const TensorView& scales,
                                                Layout layout);

  // Validates the four views against each other (dtypes, ranks, shapes,
  // contiguous last dimension, one device) and derives the geometry.
  absl::StatusOr<CacheGeometry> Geometry() const;
};

}  // namespace fp4kv

#endif  // FP4KV_GEOMETRY_H_
