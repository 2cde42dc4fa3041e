#include "testing/kernel_cases.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace testing {
namespace {

constexpr int64_t kGap = 32;  // poison bytes after every tensor

int64_t Extent(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, DType t) {
  int64_t last = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) return 0;
    last += (shape[d] - 1) * strides[d];
  }
  return (last + 1) * DTypeSize(t);
}

template <typename T>
T* Ptr(std::vector<uint8_t>& blob, const ViewSpec& v) {
  return reinterpret_cast<T*>(blob.data() + v.offset);
}

template <typename T>
void Put(std::vector<uint8_t>& blob, const ViewSpec& v, int64_t i, T value) {
  std::memcpy(blob.data() + v.offset + i * static_cast<int64_t>(sizeof(T)), &value, sizeof(T));
}

// Writes a table entry (i32 or i64) at element offset i.
void PutIndex(std::vector<uint8_t>& blob, const ViewSpec& v, int64_t i, int64_t value) {
  if (v.dtype == DType::kI64) {
    Put<int64_t>(blob, v, i, value);
  } else {
    Put<int32_t>(blob, v, i, static_cast<int32_t>(value));
  }
}

void FillHalves(std::vector<uint8_t>& blob, const ViewSpec& v, uint64_t seed) {
  const std::vector<uint16_t> bits = RandomHalfBits(v.dtype, v.bytes / 2, seed);
  std::memcpy(blob.data() + v.offset, bits.data(), bits.size() * 2);
}

ScaleSpec MakeScale(BlobLayout& layout, bool pointer, float value) {
  ScaleSpec s;
  s.value = value;
  if (pointer) s.offset = layout.Add(DType::kF32, {1}).offset;
  return s;
}

// Rewrites a pointer scale's value in the blob; a fixed value stays as made
// (a captured graph keeps the value it was captured with).
void StoreScale(std::vector<uint8_t>& blob, ScaleSpec& s, float value) {
  if (s.offset < 0) return;
  s.value = value;
  std::memcpy(blob.data() + s.offset, &value, sizeof(value));
}

const char* LayoutTag(Layout l) { return l == Layout::kNHD ? "nhd" : "hnd"; }

std::string RecipeTag(const Recipe& r) {
  if (r.kind == RecipeKind::kStandard) return "std";
  return absl::StrCat("46_", r.e4m3_max, r.metric == ErrorMetric::kMae ? "_mae" : "_mse",
                      r.fast_math ? "_fast" : "");
}

}  // namespace

TensorView ViewSpec::At(uint8_t* base, Device device) const {
  TensorView v;
  if (offset < 0) return v;
  v.data = base + offset;
  v.dtype = dtype;
  v.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = shape[d];
    v.strides[d] = strides[d];
  }
  v.device = device;
  return v;
}

ViewSpec BlobLayout::Add(DType dtype, std::vector<int64_t> shape, int64_t pad) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * shape[d + 1] + pad;
  }
  return AddStrided(dtype, std::move(shape), std::move(strides));
}

ViewSpec BlobLayout::AddStrided(DType dtype, std::vector<int64_t> shape,
                                std::vector<int64_t> strides) {
  ViewSpec v;
  v.dtype = dtype;
  v.bytes = Extent(shape, strides, dtype);
  v.shape = std::move(shape);
  v.strides = std::move(strides);
  v.offset = (size_ + 15) / 16 * 16;
  size_ = v.offset + v.bytes + kGap;
  return v;
}

PoolSpec AddPool(BlobLayout& layout, const CacheGeometry& g, bool stacked) {
  PoolSpec p;
  p.geometry = g;
  p.stacked = stacked;
  const int64_t a = g.layout == Layout::kNHD ? g.page_size : g.num_kv_heads;
  const int64_t b = g.layout == Layout::kNHD ? g.num_kv_heads : g.page_size;
  if (stacked) {
    p.data = layout.Add(DType::kU8, {g.num_pages, 2, a, b, g.head_dim_k / 2});
    p.scales = layout.Add(DType::kE4M3, {g.num_pages, 2, a, b, g.head_dim_k / kBlockSize});
  } else if (g.fp8_keys()) {
    p.k_data = layout.Add(DType::kE4M3, {g.num_pages, a, b, g.head_dim_k});
    p.v_data = layout.Add(DType::kU8, {g.num_pages, a, b, g.head_dim_v / 2});
    p.v_scales = layout.Add(DType::kU8, {g.num_pages, a, b, g.head_dim_v / kBlockSize});
  } else {
    p.k_data = layout.Add(DType::kU8, {g.num_pages, a, b, g.head_dim_k / 2});
    p.v_data = layout.Add(DType::kU8, {g.num_pages, a, b, g.head_dim_v / 2});
    p.k_scales = layout.Add(DType::kE4M3, {g.num_pages, a, b, g.head_dim_k / kBlockSize});
    p.v_scales = layout.Add(DType::kU8, {g.num_pages, a, b, g.head_dim_v / kBlockSize});
  }
  return p;
}

PagedCache PoolSpec::At(uint8_t* base, Device device) const {
  if (stacked) {
    return PagedCache::FromStacked(data.At(base, device), scales.At(base, device), geometry.layout)
        .value();
  }
  if (geometry.fp8_keys()) {
    return PagedCache::Fp8Keys(k_data.At(base, device), v_data.At(base, device),
                               v_scales.At(base, device), geometry.layout);
  }
  return PagedCache::FromTuple(k_data.At(base, device), v_data.At(base, device),
                               k_scales.At(base, device), v_scales.At(base, device),
                               geometry.layout);
}

void FillPoolRandom(const PoolSpec& pool, std::vector<uint8_t>& blob, int wild_percent,
                    uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto fill_codes = [&](const ViewSpec& v) {
    for (int64_t i = 0; i < v.bytes; ++i) blob[v.offset + i] = static_cast<uint8_t>(rng());
  };
  auto fill_scales = [&](const ViewSpec& v) {
    if (v.offset < 0) return;  // FP8 keys: no key scales
    for (int64_t i = 0; i < v.bytes; ++i) {
      const uint8_t r = static_cast<uint8_t>(rng());
      blob[v.offset + i] = static_cast<int>(rng() % 100) < wild_percent ? r : r % 0x7f;
    }
  };
  if (pool.stacked) {
    fill_codes(pool.data);
    fill_scales(pool.scales);
  } else {
    fill_codes(pool.k_data);
    fill_codes(pool.v_data);
    fill_scales(pool.k_scales);
    fill_scales(pool.v_scales);
  }
}

GlobalScale ScaleSpec::At(uint8_t* base) const {
  if (offset >= 0) return GlobalScale::Pointer(reinterpret_cast<const float*>(base + offset));
  return GlobalScale::Value(value);
}

std::string FirstDifference(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got) {
  if (want.size() != got.size()) {
    return absl::StrCat("sizes differ: ", want.size(), " vs ", got.size());
  }
  int64_t first = -1, count = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] != got[i]) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++count;
    }
  }
  if (first < 0) return "";
  return absl::StrCat(count, " bytes differ; first at byte ", first, ": want 0x",
                      absl::Hex(want[first]), ", got 0x", absl::Hex(got[first]));
}

// ------------------------------------------------------------------ append
std::string AppendSpec::Name() const {
  return absl::StrCat(
      "h", num_heads, "_k", head_dim_k, "_v", head_dim_v, "_s", page_size, "_", LayoutTag(layout),
      stacked ? "_stacked" : "_tuple", dtype == DType::kBF16 ? "_bf16" : "_f16",
      indexing == AppendIndexing::kSlot ? "_slot" : "_paged", "_", RecipeTag(recipe), "_b", batch,
      "x", max_new_tokens, pointer_scales ? "_ptr" : "", padded_input ? "_pad" : "",
      count_events ? "_events" : "", key_format == KeyFormat::kFp8 ? "_k8" : "");
}

AppendCase MakeAppendCase(const AppendSpec& spec, uint64_t seed) {
  AppendCase c;
  c.spec = spec;
  const int64_t S = spec.page_size;
  // Pages per request: a start offset below 2 pages plus the new tokens.
  const int64_t per_request = (2 * S + spec.max_new_tokens + S - 1) / S;
  c.geometry = CacheGeometry{spec.num_heads,
                             spec.head_dim_k,
                             spec.head_dim_v,
                             spec.page_size,
                             spec.batch * per_request + 3,
                             spec.layout};
  c.geometry.key_format = spec.key_format;
  const int64_t invalid = spec.invalid_rows ? 6 : 0;
  const int64_t n = int64_t{spec.batch} * spec.max_new_tokens + invalid;
  const int64_t H = spec.num_heads;
  c.rows = spec.indexing == AppendIndexing::kSlot ? n + 2 : n;
  BlobLayout in;
  const int64_t pad = spec.padded_input ? 8 : 0;
  c.key = in.Add(spec.dtype, {c.rows, H, spec.head_dim_k}, pad);
  c.value = in.Add(spec.dtype, {c.rows, H, spec.head_dim_v}, pad);
  if (spec.indexing == AppendIndexing::kPaged) {
    c.batch_indices = in.Add(DType::kI32, {n});
    c.positions = in.Add(DType::kI32, {n});
    c.kv_indices = in.Add(DType::kI32, {c.geometry.num_pages});
    c.kv_indptr = in.Add(DType::kI32, {spec.batch + 1});
    c.kv_last_page_len = in.Add(DType::kI32, {spec.batch});
  } else {
    c.slot_mapping = in.Add(DType::kI64, {n});
  }
  c.k_scale = MakeScale(in, spec.pointer_scales, 1.0f);
  c.v_scale = MakeScale(in, spec.pointer_scales, 0.37f);
  c.in.assign(in.size(), kPoison);
  BlobLayout out;
  c.pool = AddPool(out, c.geometry, spec.stacked);
  if (spec.count_events) c.scale_events = out.Add(DType::kI64, {4});
  c.out.assign(out.size(), kPoison);
  c.Rewrite(seed);
  return c;
}

void AppendCase::Rewrite(uint64_t seed) {
  std::mt19937_64 rng(seed);
  FillHalves(in, key, seed + 1);
  FillHalves(in, value, seed + 2);
  StoreScale(in, k_scale, std::ldexp(1.0f, static_cast<int>(rng() % 5) - 2) * 1.1f);
  StoreScale(in, v_scale, std::ldexp(0.37f, static_cast<int>(rng() % 5) - 2));
  const int64_t S = spec.page_size, P = geometry.num_pages, B = spec.batch;
  const int64_t n = (spec.indexing == AppendIndexing::kSlot ? slot_mapping : positions).shape[0];
  std::vector<int64_t> pages(P);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  // Each request: `len` new tokens from position `start`, over pages taken
  // from the shuffled list.
  std::vector<int64_t> rows_b, rows_pos;
  std::vector<int64_t> indptr(B + 1, 0), last(B, 1);
  std::vector<int64_t> page_of_slot;
  int64_t used = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = 1 + static_cast<int64_t>(rng() % spec.max_new_tokens);
    const int64_t start = static_cast<int64_t>(rng() % (2 * S));
    const int64_t npages = (start + len + S - 1) / S;
    indptr[b + 1] = indptr[b] + npages;
    last[b] = (start + len - 1) % S + 1;
    for (int64_t t = start; t < start + len; ++t) {
      rows_b.push_back(b);
      rows_pos.push_back(t);
      page_of_slot.push_back(pages[used + t / S] * S + t % S);
    }
    used += npages;
  }
  if (spec.indexing == AppendIndexing::kPaged) {
    for (int64_t i = 0; i < P; ++i) {
      PutIndex(in, kv_indices, i, i < used ? pages[i] : static_cast<int64_t>(rng() % (2 * P)));
    }
    // One request's first page is out of range: its rows there write nothing.
    if (spec.invalid_rows && B > 1) PutIndex(in, kv_indices, indptr[1], P + 7);
    for (int64_t b = 0; b <= B; ++b) PutIndex(in, kv_indptr, b, indptr[b]);
    for (int64_t b = 0; b < B; ++b) PutIndex(in, kv_last_page_len, b, last[b]);
    const int64_t valid = static_cast<int64_t>(rows_b.size());
    // Invalid rows: padding, batch index out of range, position past the
    // request's pages; rows past the valid ones are padding too.
    const int64_t bad_b[] = {-1, B, 0, B - 1, -5, 1};
    const int64_t bad_pos[] = {0, 0, (indptr[1] - indptr[0]) * S, 1 << 20, 3, -2};
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t r = 0; r < n; ++r) {
      int64_t b, pos;
      if (r < valid) {
        b = rows_b[r];
        pos = rows_pos[r];
      } else if (spec.invalid_rows && r - valid < 6) {
        b = bad_b[r - valid];
        pos = bad_pos[r - valid];
      } else {
        b = -1;
        pos = 0;
      }
      PutIndex(in, batch_indices, order[r], b);
      PutIndex(in, positions, order[r], pos);
    }
  } else {
    const int64_t valid = static_cast<int64_t>(page_of_slot.size());
    const int64_t bad[] = {-1, P * S, int64_t{1} << 40, -7, P * S + 3, -1};
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t r = 0; r < n; ++r) {
      int64_t slot = -1;
      if (r < valid) {
        slot = page_of_slot[r];
      } else if (spec.invalid_rows && r - valid < 6) {
        slot = bad[r - valid];
      }
      Put<int64_t>(in, slot_mapping, order[r], slot);
    }
  }
}

AppendArgs AppendCase::Args(uint8_t* base, Device device, uint8_t* out_base) const {
  AppendArgs a;
  if (spec.count_events) {
    a.scale_events = reinterpret_cast<uint64_t*>(out_base + scale_events.offset);
  }
  a.key = key.At(base, device);
  a.value = value.At(base, device);
  a.batch_indices = batch_indices.At(base, device);
  a.positions = positions.At(base, device);
  a.kv_indices = kv_indices.At(base, device);
  a.kv_indptr = kv_indptr.At(base, device);
  a.kv_last_page_len = kv_last_page_len.At(base, device);
  a.slot_mapping = slot_mapping.At(base, device);
  a.k_scale = k_scale.At(base);
  a.v_scale = v_scale.At(base);
  return a;
}

Appender::Options AppendCase::Options(Device device) const {
  return Appender::Options{geometry, spec.dtype, spec.indexing, spec.recipe, device,
                           spec.count_events};
}

// ----------------------------------------------------------------- dequant
std::string DequantSpec::Name() const {
  return absl::StrCat("h", num_heads, "_k", head_dim_k, "_v", head_dim_v, "_s", page_size, "_",
                      LayoutTag(layout), stacked ? "_stacked" : "_tuple",
                      dtype == DType::kBF16 ? "_bf16" : "_f16",
                      table_dtype == DType::kI64 ? "_i64" : "_i32", "_b", batch, "_len",
                      max_seq_len, "_mp", max_pages, pointer_scales ? "_ptr" : "",
                      padded_output ? "_pad" : "", key_format == KeyFormat::kFp8 ? "_k8" : "");
}

DequantCase MakeDequantCase(const DequantSpec& spec, uint64_t seed) {
  DequantCase c;
  c.spec = spec;
  c.geometry = CacheGeometry{spec.num_heads,
                             spec.head_dim_k,
                             spec.head_dim_v,
                             spec.page_size,
                             spec.batch * spec.max_pages / 2 + 2,
                             spec.layout};
  c.geometry.key_format = spec.key_format;
  BlobLayout in;
  c.pool = AddPool(in, c.geometry, spec.stacked);
  c.block_tables = in.Add(spec.table_dtype, {spec.batch, spec.max_pages}, 3);
  c.seq_lens = in.Add(DType::kI32, {spec.batch});
  c.k_scale = MakeScale(in, spec.pointer_scales, 1.0f);
  c.v_scale = MakeScale(in, spec.pointer_scales, 0.37f);
  c.in.assign(in.size(), kPoison);
  BlobLayout out;
  const int64_t pad = spec.padded_output ? 8 : 0;
  c.k_out =
      out.Add(spec.dtype, {spec.batch, spec.max_seq_len, spec.num_heads, spec.head_dim_k}, pad);
  c.v_out =
      out.Add(spec.dtype, {spec.batch, spec.max_seq_len, spec.num_heads, spec.head_dim_v}, pad);
  c.out.assign(out.size(), kPoison);
  c.Rewrite(seed);
  return c;
}

void DequantCase::Rewrite(uint64_t seed) {
  std::mt19937_64 rng(seed);
  FillPoolRandom(pool, in, 3, seed + 1);
  StoreScale(in, k_scale, std::ldexp(1.0f, static_cast<int>(rng() % 7) - 3));
  StoreScale(in, v_scale, std::ldexp(0.37f, static_cast<int>(rng() % 7) - 3));
  const int64_t P = geometry.num_pages, B = spec.batch, L = spec.max_seq_len;
  for (int64_t b = 0; b < B; ++b) {
    int64_t len = static_cast<int64_t>(rng() % (L + 1));
    if (b == 0) len = L + 9;  // clamped to max_seq_len and the table's pages
    if (b == 1 && B > 2) len = -4;
    if (b == 2 && B > 3) len = 0;
    Put<int32_t>(in, seq_lens, b, static_cast<int32_t>(len));
    for (int64_t j = 0; j < spec.max_pages; ++j) {
      int64_t page = static_cast<int64_t>(rng() % P);
      const int k = static_cast<int>(rng() % 16);
      if (k == 0) page = -1;
      if (k == 1) page = P;
      if (k == 2) page = int64_t{1} << 33;  // i32 tables wrap it to 0
      PutIndex(in, block_tables, b * block_tables.strides[0] + j, page);
    }
  }
}

DequantArgs DequantCase::Args(uint8_t* in_base, uint8_t* out_base, Device device) const {
  return DequantArgs{
      block_tables.At(in_base, device), seq_lens.At(in_base, device), k_out.At(out_base, device),
      v_out.At(out_base, device),       k_scale.At(in_base),          v_scale.At(in_base)};
}

Dequantizer::Options DequantCase::Options(Device device) const {
  return Dequantizer::Options{geometry, spec.dtype, spec.table_dtype, device};
}

// ------------------------------------------------------------- materialize
std::string MaterializeSpec::Name() const {
  return absl::StrCat("h", num_heads, "_d", head_dim, "_s", page_size, "_", LayoutTag(layout),
                      stacked ? "_stacked" : "_tuple", table_dtype == DType::kI64 ? "_i64" : "_i32",
                      separate_kv_tables ? "_kvtables" : "", "_b", batch, "_mp", max_pages,
                      pointer_scales ? "_ptr" : "", short_out ? "_short" : "",
                      key_format == KeyFormat::kFp8 ? "_k8" : "");
}

MaterializeCase MakeMaterializeCase(const MaterializeSpec& spec, uint64_t seed) {
  MaterializeCase c;
  c.spec = spec;
  c.geometry = CacheGeometry{spec.num_heads,
                             spec.head_dim,
                             spec.head_dim,
                             spec.page_size,
                             spec.batch * spec.max_pages / 2 + 2,
                             spec.layout};
  c.geometry.key_format = spec.key_format;
  BlobLayout in;
  c.pool = AddPool(in, c.geometry, spec.stacked);
  if (spec.separate_kv_tables) {
    c.block_tables = in.Add(spec.table_dtype, {spec.batch, 2, spec.max_pages}, 2);
  } else {
    c.block_tables = in.Add(spec.table_dtype, {spec.batch, spec.max_pages}, 3);
  }
  c.seq_lens = in.Add(DType::kI32, {spec.batch});
  c.kv_page_indptr = in.Add(DType::kI32, {spec.batch + 1});
  c.k_scale = MakeScale(in, spec.pointer_scales, 1.0f);
  c.v_scale = MakeScale(in, spec.pointer_scales, 0.37f);
  c.k_fp8_scale = MakeScale(in, spec.pointer_scales, 6.0f);
  c.v_fp8_scale = MakeScale(in, spec.pointer_scales, 2.22f);
  c.in.assign(in.size(), kPoison);
  BlobLayout out;
  const int64_t out_pages =
      spec.short_out ? 1 + spec.batch * spec.max_pages / 2 : 1 + spec.batch * spec.max_pages;
  c.out_pages =
      out.Add(DType::kE4M3, {out_pages, 2, spec.num_heads, spec.page_size, spec.head_dim});
  c.fp8_block_tables = out.Add(DType::kI32, {spec.batch, spec.max_pages}, 2);
  c.out.assign(out.size(), kPoison);
  c.Rewrite(seed);
  return c;
}

void MaterializeCase::Rewrite(uint64_t seed) {
  std::mt19937_64 rng(seed);
  FillPoolRandom(pool, in, 3, seed + 1);
  const float gk = std::ldexp(1.0f, static_cast<int>(rng() % 5) - 2);
  const float gv = std::ldexp(0.37f, static_cast<int>(rng() % 5) - 2);
  StoreScale(in, k_scale, gk);
  StoreScale(in, v_scale, gv);
  if (geometry.fp8_keys()) {
    // Around g_k: a copy (factor 1) or a re-scale either way.
    StoreScale(in, k_fp8_scale, gk * (0.5f + static_cast<float>(rng() % 8) / 4));
  } else {
    StoreScale(in, k_fp8_scale,
               MinFp8Scale(gk).value() * (1.0f + static_cast<float>(rng() % 8) / 8));
  }
  StoreScale(in, v_fp8_scale, MinFp8Scale(gv).value());
  const int64_t P = geometry.num_pages, B = spec.batch, S = spec.page_size, M = spec.max_pages;
  int64_t indptr = static_cast<int64_t>(rng() % 2);  // may start past 0
  Put<int32_t>(in, kv_page_indptr, 0, static_cast<int32_t>(indptr));
  for (int64_t b = 0; b < B; ++b) {
    int64_t len = static_cast<int64_t>(rng() % (M * S + 1));
    if (b == 1 && B > 2) len = -3;
    if (b == 2 && B > 3) len = M * S + 5;  // more than the table holds
    Put<int32_t>(in, seq_lens, b, static_cast<int32_t>(len));
    int64_t reserved = (std::max<int64_t>(len, 0) + S - 1) / S;
    if (b == 0) reserved = std::max<int64_t>(reserved - 1, 0);  // fewer pages reserved
    if (b == 3) reserved += 1;
    indptr += reserved;
    Put<int32_t>(in, kv_page_indptr, b + 1, static_cast<int32_t>(indptr));
    for (int kv = 0; kv < (spec.separate_kv_tables ? 2 : 1); ++kv) {
      for (int64_t j = 0; j < M; ++j) {
        int64_t page = static_cast<int64_t>(rng() % P);
        const int k = static_cast<int>(rng() % 20);
        if (k == 0) page = -1;
        if (k == 1) page = P + 2;
        const int64_t off = b * block_tables.strides[0] +
                            (spec.separate_kv_tables ? kv * block_tables.strides[1] : 0) + j;
        PutIndex(in, block_tables, off, page);
      }
    }
  }
}

MaterializeArgs MaterializeCase::Args(uint8_t* in_base, uint8_t* out_base, Device device) const {
  return MaterializeArgs{block_tables.At(in_base, device),
                         seq_lens.At(in_base, device),
                         kv_page_indptr.At(in_base, device),
                         out_pages.At(out_base, device),
                         fp8_block_tables.At(out_base, device),
                         k_scale.At(in_base),
                         v_scale.At(in_base),
                         k_fp8_scale.At(in_base),
                         v_fp8_scale.At(in_base)};
}

Materializer::Options MaterializeCase::Options(Device device) const {
  return Materializer::Options{geometry, spec.table_dtype, spec.separate_kv_tables, device};
}

// ------------------------------------------------------------------ linear
std::string LinearSpec::Name() const {
  return absl::StrCat(rows, "x", cols, dtype == DType::kBF16 ? "_bf16_" : "_f16_",
                      RecipeTag(recipe), pointer_scale ? "_ptr" : "", padded ? "_pad" : "");
}

LinearCase MakeLinearCase(const LinearSpec& spec, uint64_t seed) {
  LinearCase c;
  c.spec = spec;
  const int64_t pad = spec.padded ? 8 : 0;
  BlobLayout in;
  c.input = in.Add(spec.dtype, {spec.rows, spec.cols}, pad);
  c.in_packed = in.Add(DType::kU8, {spec.rows, spec.cols / 2}, pad);
  c.in_scales = in.Add(DType::kE4M3, {spec.rows, spec.cols / kBlockSize}, spec.padded ? 3 : 0);
  c.scale = MakeScale(in, spec.pointer_scale, 1.0f);
  c.in.assign(in.size(), kPoison);
  BlobLayout out;
  c.packed = out.Add(DType::kU8, {spec.rows, spec.cols / 2}, pad);
  c.scales = out.Add(DType::kU8, {spec.rows, spec.cols / kBlockSize}, spec.padded ? 5 : 0);
  c.output = out.Add(spec.dtype, {spec.rows, spec.cols}, pad);
  c.out.assign(out.size(), kPoison);
  c.Rewrite(seed);
  return c;
}

void LinearCase::Rewrite(uint64_t seed) {
  std::mt19937_64 rng(seed);
  FillHalves(in, input, seed + 1);
  for (int64_t i = 0; i < in_packed.bytes; ++i)
    in[in_packed.offset + i] = static_cast<uint8_t>(rng());
  for (int64_t i = 0; i < in_scales.bytes; ++i) {
    const uint8_t r = static_cast<uint8_t>(rng());
    in[in_scales.offset + i] = rng() % 100 < 3 ? r : r % 0x7f;
  }
  StoreScale(in, scale, std::ldexp(1.0f, static_cast<int>(rng() % 7) - 3));
}

// ------------------------------------------------------------------ sweeps
std::vector<Recipe> AllRecipes() {
  return {Recipe::Standard(), Recipe::FourOverSix(256, ErrorMetric::kMae, false),
          Recipe::FourOverSix(448, ErrorMetric::kMse, false),
          Recipe::FourOverSix(256, ErrorMetric::kMae, true),
          Recipe::FourOverSix(448, ErrorMetric::kMse, true)};
}

namespace {
constexpr int kPageSizes[] = {1, 3, 4, 16, 17, 64};
constexpr int kBatches[] = {1, 7, 31, 128};
constexpr int kDims[][2] = {{64, 64}, {128, 128}, {256, 256}, {64, 128}, {128, 64}};
}  // namespace

std::vector<AppendSpec> AppendSweep() {
  const std::vector<Recipe> recipes = AllRecipes();
  std::vector<AppendSpec> out;
  for (int i = 0; i < 40; ++i) {
    AppendSpec s;
    s.page_size = kPageSizes[i % 6];
    s.batch = kBatches[(i / 2) % 4];
    s.head_dim_k = kDims[(i / 3) % 5][0];
    s.head_dim_v = kDims[(i / 3) % 5][1];
    s.layout = (i / 5) % 2 ? Layout::kHND : Layout::kNHD;
    s.stacked = (i % 7 == 3 || i % 7 == 5) && s.head_dim_k == s.head_dim_v;
    s.dtype = (i / 7) % 2 ? DType::kF16 : DType::kBF16;
    s.indexing = (i / 4) % 2 ? AppendIndexing::kPaged : AppendIndexing::kSlot;
    s.recipe = recipes[i % 5];
    s.pointer_scales = i % 3 == 1;
    s.padded_input = i % 4 == 2;
    s.num_heads = s.batch >= 31 ? 2 : (i % 2 ? 8 : 3);
    s.max_new_tokens = s.batch >= 31 ? 2 : (s.page_size >= 16 ? 70 : 9);
    s.count_events = i % 5 == 2;
    out.push_back(s);
  }
  // FP8 keys: a slice of the sweep again (tuple pools).
  for (int i = 0; i < 40; i += 4) {
    AppendSpec s = out[i];
    s.key_format = KeyFormat::kFp8;
    s.stacked = false;
    s.count_events = s.count_events || i % 8 == 0;
    out.push_back(s);
  }
  // A launch with many rows per CTA (>= 8192 rows).
  AppendSpec big;
  big.num_heads = 1;
  big.batch = 128;
  big.max_new_tokens = 70;
  big.page_size = 16;
  big.indexing = AppendIndexing::kSlot;
  out.push_back(big);
  big.indexing = AppendIndexing::kPaged;
  big.layout = Layout::kHND;
  big.dtype = DType::kF16;
  out.push_back(big);
  return out;
}

std::vector<DequantSpec> DequantSweep() {
  std::vector<DequantSpec> out;
  for (int i = 0; i < 24; ++i) {
    DequantSpec s;
    s.page_size = kPageSizes[i % 6];
    s.batch = kBatches[(i / 2) % 4];
    s.head_dim_k = kDims[(i / 3) % 5][0];
    s.head_dim_v = kDims[(i / 3) % 5][1];
    s.layout = (i / 5) % 2 ? Layout::kHND : Layout::kNHD;
    s.stacked = (i % 7 == 2 || i % 7 == 6) && s.head_dim_k == s.head_dim_v;
    s.dtype = (i / 4) % 2 ? DType::kF16 : DType::kBF16;
    s.table_dtype = (i / 3) % 2 ? DType::kI64 : DType::kI32;
    s.num_heads = s.batch >= 31 ? 2 : 4;
    s.max_seq_len = s.batch >= 31 ? 24 : 70;
    const int need = (s.max_seq_len + s.page_size - 1) / s.page_size;
    s.max_pages = i % 4 == 1 ? std::max(1, need - 1) : need;  // fewer pages than max_seq_len
    s.pointer_scales = i % 3 == 2;
    s.padded_output = i % 5 == 1;
    out.push_back(s);
  }
  for (int i = 0; i < 24; i += 4) {  // FP8 keys
    DequantSpec s = out[i + i / 4 % 2];
    s.key_format = KeyFormat::kFp8;
    s.stacked = false;
    out.push_back(s);
  }
  for (const auto& dims : {std::array<int, 2>{48, 80}, std::array<int, 2>{96, 48}}) {
    // Head dims of an odd number of blocks (3, 5) beside even ones.
    DequantSpec s = out[dims[0] == 48 ? 3 : 10];
    s.head_dim_k = dims[0];
    s.head_dim_v = dims[1];
    s.stacked = false;
    out.push_back(s);
    s.key_format = KeyFormat::kFp8;
    out.push_back(s);
  }
  DequantSpec big;  // >= 8192 positions
  big.num_heads = 1;
  big.batch = 128;
  big.max_seq_len = 70;
  big.page_size = 16;
  big.max_pages = 5;
  out.push_back(big);
  return out;
}

std::vector<MaterializeSpec> MaterializeSweep() {
  constexpr int kPages4[] = {4, 16, 64, 12};
  constexpr int kHeadDims[] = {64, 128, 256};
  std::vector<MaterializeSpec> out;
  for (int i = 0; i < 20; ++i) {
    MaterializeSpec s;
    s.page_size = kPages4[i % 4];
    s.batch = kBatches[(i / 2) % 4];
    s.head_dim = kHeadDims[(i / 3) % 3];
    s.layout = (i / 5) % 2 ? Layout::kHND : Layout::kNHD;
    s.stacked = i % 3 == 1;
    s.table_dtype = (i / 4) % 2 ? DType::kI64 : DType::kI32;
    s.separate_kv_tables = i % 5 == 2 || i % 5 == 4;
    s.num_heads = s.batch >= 31 ? 1 : 3;
    s.max_pages = s.batch >= 31 ? 2 : 5;
    s.pointer_scales = i % 4 == 3;
    s.short_out = i % 6 == 5;
    out.push_back(s);
  }
  for (int i = 0; i < 20; i += 3) {  // FP8 keys
    MaterializeSpec s = out[i];
    s.key_format = KeyFormat::kFp8;
    s.stacked = false;
    out.push_back(s);
  }
  MaterializeSpec big;  // >= 8192 pages
  big.num_heads = 1;
  big.batch = 128;
  big.max_pages = 65;
  big.page_size = 4;
  out.push_back(big);
  return out;
}

std::vector<LinearSpec> LinearSweep() {
  const std::vector<Recipe> recipes = AllRecipes();
  constexpr int64_t kRows[] = {1, 5, 33, 300};
  constexpr int64_t kCols[] = {16, 64, 128, 1040};
  std::vector<LinearSpec> out;
  for (int i = 0; i < 20; ++i) {
    LinearSpec s;
    s.rows = kRows[i % 4];
    s.cols = kCols[(i / 2) % 4];
    s.dtype = (i / 5) % 2 ? DType::kF16 : DType::kBF16;
    s.recipe = recipes[i % 5];
    s.pointer_scale = i % 3 == 0;
    s.padded = i % 4 == 1;
    out.push_back(s);
  }
  return out;
}

// --------------------------------------------------------- quantize cache
std::string QuantizeCacheSpec::Name() const {
  return absl::StrCat("h", num_heads, "_k", head_dim_k, "_v", head_dim_v, "_s", page_size, "_",
                      LayoutTag(source_layout), source_stacked ? "_stacked" : "_tuple", "_to_",
                      LayoutTag(cache_layout), cache_stacked ? "_stacked" : "_tuple",
                      dtype == DType::kBF16 ? "_bf16" : "_f16", "_", RecipeTag(recipe), "_p",
                      source_pages, lists ? "_lists" : "", compute_scales ? "_computed" : "",
                      pointer_scales ? "_ptr" : "", padded_source ? "_pad" : "",
                      key_format == KeyFormat::kFp8 ? "_k8" : "");
}

QuantizeCacheCase MakeQuantizeCacheCase(const QuantizeCacheSpec& spec, uint64_t seed) {
  QuantizeCacheCase c;
  c.spec = spec;
  const int64_t P = spec.source_pages, S = spec.page_size, H = spec.num_heads;
  c.geometry = CacheGeometry{spec.num_heads, spec.head_dim_k, spec.head_dim_v,
                             spec.page_size, P + 3,           spec.cache_layout};
  c.geometry.key_format = spec.key_format;
  BlobLayout in;
  const bool nhd = spec.source_layout == Layout::kNHD;
  const int64_t a = nhd ? S : H, b = nhd ? H : S;
  const int64_t pad = spec.padded_source ? 8 : 0;
  if (spec.source_stacked) {
    c.kv_src = in.Add(spec.dtype, {P, 2, a, b, spec.head_dim_k}, pad);
  } else {
    c.k_src = in.Add(spec.dtype, {P, a, b, spec.head_dim_k}, pad);
    c.v_src = in.Add(spec.dtype, {P, a, b, spec.head_dim_v}, pad);
  }
  if (spec.lists) {
    c.src_pages = in.Add(DType::kI32, {P + 2});
    c.dst_pages = in.Add(DType::kI32, {P + 2});
    c.num_tokens = (P + 2) * S - S / 2;  // a partial last page
  }
  c.k_scale = MakeScale(in, spec.pointer_scales, 0.01f);
  c.v_scale = MakeScale(in, spec.pointer_scales, 0.0037f);
  c.in.assign(in.size(), kPoison);
  BlobLayout out;
  c.pool = AddPool(out, c.geometry, spec.cache_stacked);
  if (spec.compute_scales) {
    c.k_scale_out = out.Add(DType::kF32, {1});
    c.v_scale_out = out.Add(DType::kF32, {1});
  }
  c.out.assign(out.size(), kPoison);
  c.Rewrite(seed);
  return c;
}

void QuantizeCacheCase::Rewrite(uint64_t seed) {
  std::mt19937_64 rng(seed);
  if (spec.source_stacked) {
    FillHalves(in, kv_src, seed + 1);
  } else {
    FillHalves(in, k_src, seed + 1);
    FillHalves(in, v_src, seed + 2);
  }
  StoreScale(in, k_scale, std::ldexp(0.01f, static_cast<int>(rng() % 5) - 2));
  StoreScale(in, v_scale, std::ldexp(0.0037f, static_cast<int>(rng() % 5) - 2));
  if (spec.lists) {
    const int64_t P = spec.source_pages, N = P + 2, C = geometry.num_pages;
    std::vector<int64_t> dst(C);
    std::iota(dst.begin(), dst.end(), 0);
    std::shuffle(dst.begin(), dst.end(), rng);
    for (int64_t i = 0; i < N; ++i) {
      int64_t s = static_cast<int64_t>(rng() % P);  // repeats allowed
      int64_t d = dst[i];                           // distinct
      if (i == 1) s = -1;                           // out of range: nothing written
      if (i == 2 && N > 3) d = C + 5;
      if (i == 3 && N > 4) s = P;
      Put<int32_t>(in, src_pages, i, static_cast<int32_t>(s));
      Put<int32_t>(in, dst_pages, i, static_cast<int32_t>(d));
    }
  }
}

QuantizeCacheArgs QuantizeCacheCase::Args(uint8_t* in_base, uint8_t* out_base,
                                          Device device) const {
  QuantizeCacheArgs a;
  if (spec.source_stacked) {
    a.source = HalfPagedCache::FromStacked(kv_src.At(in_base, device), spec.source_layout).value();
  } else {
    a.source = HalfPagedCache::FromTuple(k_src.At(in_base, device), v_src.At(in_base, device),
                                         spec.source_layout);
  }
  a.src_pages = src_pages.At(in_base, device);
  a.dst_pages = dst_pages.At(in_base, device);
  a.num_tokens = num_tokens;
  if (spec.compute_scales) {
    a.k_scale_out = reinterpret_cast<float*>(out_base + k_scale_out.offset);
    a.v_scale_out = reinterpret_cast<float*>(out_base + v_scale_out.offset);
  } else {
    a.k_scale = k_scale.At(in_base);
    a.v_scale = v_scale.At(in_base);
  }
  return a;
}

PagedCacheQuantizer::Options QuantizeCacheCase::Options(Device device) const {
  PagedCacheQuantizer::Options o;
  o.geometry = geometry;
  o.source_layout = spec.source_layout;
  o.input_dtype = spec.dtype;
  o.recipe = spec.recipe;
  o.device = device;
  o.compute_scales = spec.compute_scales;
  o.headroom = spec.compute_scales && spec.lists ? 2.0f : 1.0f;
  return o;
}

std::vector<QuantizeCacheSpec> QuantizeCacheSweep() {
  const std::vector<Recipe> recipes = AllRecipes();
  std::vector<QuantizeCacheSpec> out;
  for (int i = 0; i < 32; ++i) {
    QuantizeCacheSpec s;
    s.page_size = kPageSizes[i % 6];
    s.head_dim_k = kDims[(i / 3) % 5][0];
    s.head_dim_v = kDims[(i / 3) % 5][1];
    s.source_layout = (i / 2) % 2 ? Layout::kHND : Layout::kNHD;
    s.cache_layout = i % 5 == 3 ? (s.source_layout == Layout::kNHD ? Layout::kHND : Layout::kNHD)
                                : s.source_layout;
    const bool same = s.head_dim_k == s.head_dim_v;
    s.source_stacked = same && (i % 4 == 1 || i % 4 == 2);
    s.cache_stacked = same && i % 3 == 0;
    s.dtype = (i / 4) % 2 ? DType::kF16 : DType::kBF16;
    s.recipe = recipes[i % 5];
    s.num_heads = i % 2 ? 3 : 8;
    s.source_pages = s.page_size >= 16 ? 3 : 7;
    s.lists = (i / 3) % 2 == 1;
    s.compute_scales = i % 4 == 0 || i % 7 == 2;
    s.pointer_scales = !s.compute_scales && i % 3 == 1;
    s.padded_source = i % 5 == 1;
    out.push_back(s);
  }
  for (int i = 0; i < 32; i += 4) {  // FP8 keys
    QuantizeCacheSpec s = out[i + i / 4 % 3];
    s.key_format = KeyFormat::kFp8;
    s.cache_stacked = false;
    out.push_back(s);
  }
  QuantizeCacheSpec big;  // >= 8192 rows: 8 rows per CTA
  big.num_heads = 1;
  big.page_size = 16;
  big.source_pages = 520;
  big.compute_scales = true;
  out.push_back(big);
  big.source_layout = Layout::kHND;
  big.cache_layout = Layout::kHND;
  big.lists = true;
  big.dtype = DType::kF16;
  big.compute_scales = false;
  out.push_back(big);
  return out;
}

}  // namespace testing
}  // namespace fp4kv
