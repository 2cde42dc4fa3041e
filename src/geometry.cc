#include "fp4kv/geometry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "src/validate.h"

namespace fp4kv {

const char* LayoutName(Layout l) { return l == Layout::kNHD ? "NHD" : "HND"; }

const char* KeyFormatName(KeyFormat f) {
  switch (f) {
    case KeyFormat::kNvfp4:
      return "NVFP4";
    case KeyFormat::kFp8:
      return "FP8";
  }
  return "unknown";
}

absl::Status CacheGeometry::Validate() const {
  if (num_kv_heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.num_kv_heads: expected > 0, got ", num_kv_heads));
  }
  if (head_dim_k <= 0 || head_dim_k % kBlockSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.head_dim_k: expected a positive multiple of 16, got ", head_dim_k));
  }
  if (head_dim_v <= 0 || head_dim_v % kBlockSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.head_dim_v: expected a positive multiple of 16, got ", head_dim_v));
  }
  if (page_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.page_size: expected > 0, got ", page_size));
  }
  if (num_pages <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.num_pages: expected > 0, got ", num_pages));
  }
  if (layout != Layout::kNHD && layout != Layout::kHND) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.layout: expected NHD or HND, got ", static_cast<int>(layout)));
  }
  if (key_format != KeyFormat::kNvfp4 && key_format != KeyFormat::kFp8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.key_format: expected NVFP4 or FP8, got ", static_cast<int>(key_format)));
  }
  return absl::OkStatus();
}

absl::StatusOr<PagedCache> PagedCache::FromStacked(const TensorView& data, const TensorView& scales,
                                                   Layout layout) {
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{data, "cache.data"},
                                std::pair<const TensorView&, const char*>{scales, "cache.scales"}}) {
    if (absl::Status s = internal::CheckRank(t, name, 5); !s.ok()) return s;
    if (t.shape[1] != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": expected 2 (K and V) on dimension 1 of the stacked form, got shape ",
          t.ShapeString()));
    }
  }
  return PagedCache{data.Select(1, 0), data.Select(1, 1), scales.Select(1, 0), scales.Select(1, 1),
                    layout};
}

absl::StatusOr<CacheGeometry> PagedCache::Geometry() const {
  const bool fp8_keys = key_format == KeyFormat::kFp8;
  if (key_format != KeyFormat::kNvfp4 && !fp8_keys) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cache.key_format: expected NVFP4 or FP8, got ", static_cast<int>(key_format)));
  }
  const struct {
    const TensorView& t;
    const char* name;
  } views[] = {{k_data, "cache.k_data"},
               {v_data, "cache.v_data"},
               {k_scales, "cache.k_scales"},
               {v_scales, "cache.v_scales"}};
  for (const auto& v : views) {
    if (fp8_keys && &v.t == &k_scales) continue;  // absent; CheckCache says so if given
    if (absl::Status s = internal::CheckGiven(v.t, v.name); !s.ok()) return s;
    if (absl::Status s = internal::CheckRank(v.t, v.name, 4); !s.ok()) return s;
  }
  CacheGeometry g;
  g.layout = layout;
  g.key_format = key_format;
  g.num_pages = k_data.shape[0];
  const int e = layout == Layout::kNHD ? 1 : 2;
  const int h = layout == Layout::kNHD ? 2 : 1;
  g.page_size = static_cast<int>(k_data.shape[e]);
  g.num_kv_heads = static_cast<int>(k_data.shape[h]);
  g.head_dim_k = static_cast<int>(fp8_keys ? k_data.shape[3] : k_data.shape[3] * 2);
  g.head_dim_v = static_cast<int>(v_data.shape[3] * 2);
  if (absl::Status s = g.Validate(); !s.ok()) return s;
  internal::PoolPtrs k, v;
  if (absl::Status s = internal::CheckCache(*this, g, k_data.device, &k, &v); !s.ok()) return s;
  return g;
}

}  // namespace fp4kv
