// The sequence image header: layout, wire form and validation
// (include/fp4kv/sequence_image.h, docs/format.md "Sequence images").
#include "fp4kv/sequence_image.h"

#include <xxhash.h>

#include <climits>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "fp4kv/recipe.h"

namespace fp4kv {
namespace {

// Wire offsets of the header fields (little-endian).
constexpr int kOffMagic = 0;
constexpr int kOffVersion = 8;
constexpr int kOffHeaderBytes = 12;
constexpr int kOffImageBytes = 16;
constexpr int kOffHeads = 24;
constexpr int kOffHeadDimK = 28;
constexpr int kOffHeadDimV = 32;
constexpr int kOffPageSize = 36;
constexpr int kOffLayout = 40;
constexpr int kOffKeyFormat = 41;
constexpr int kOffReserved16 = 42;
constexpr int kOffLayers = 44;
constexpr int kOffRecipe = 48;
constexpr int kOffLength = 56;
constexpr int kOffPages = 64;
constexpr int kOffFlags = 72;
constexpr int kOffScalesOffset = 80;
constexpr int kOffScalesBytes = 88;
constexpr int kOffLayersOffset = 96;
constexpr int kOffLayerBytes = 104;
constexpr int kOffRegionPageBytes = 112;  // 4 x i64
constexpr int kOffTokensOffset = 144;
constexpr int kOffTokensBytes = 152;
constexpr int kOffFingerprint = 160;
constexpr int kOffExtraKeyBytes = 168;
constexpr int kOffReserved = 176;  // zero up to the checksum
constexpr int kOffChecksum = 248;
static_assert(kOffChecksum + 8 == kSequenceImageHeaderBytes, "header size");

template <typename T>
void Put(uint8_t* p, int off, T v) {
  std::memcpy(p + off, &v, sizeof(T));  // the library targets little-endian hosts
}
template <typename T>
T Get(const uint8_t* p, int off) {
  T v;
  std::memcpy(&v, p + off, sizeof(T));
  return v;
}

// a * b + c, false on overflow.
bool MulAdd(int64_t a, int64_t b, int64_t c, int64_t* out) {
  int64_t m = 0;
  return !__builtin_mul_overflow(a, b, &m) && !__builtin_add_overflow(m, c, out);
}
bool AlignUp(int64_t x, int64_t a, int64_t* out) {
  if (x > INT64_MAX - (a - 1)) return false;
  *out = (x + a - 1) / a * a;
  return true;
}

absl::Status Bad(absl::string_view field, absl::string_view expected, int64_t got) {
  return absl::InvalidArgumentError(
      absl::StrCat("sequence image header: ", field, ": expected ", expected, ", got ", got));
}

}  // namespace

absl::StatusOr<SequenceImageHeader> MakeSequenceImageHeader(const CacheGeometry& geometry,
                                                            int num_layers, const Recipe& recipe,
                                                            int64_t length, uint64_t flags,
                                                            int64_t extra_key_bytes,
                                                            uint64_t scale_fingerprint) {
  CacheGeometry g = geometry;
  g.num_pages = 1;
  if (absl::Status s = g.Validate(); !s.ok()) return s;
  if (g.layout != Layout::kNHD && g.layout != Layout::kHND) {
    return Bad("layout", "0 (NHD) or 1 (HND)", static_cast<int>(g.layout));
  }
  if (num_layers < 1) return Bad("num_layers", ">= 1", num_layers);
  if (length < 0) return Bad("length", ">= 0", length);
  if ((flags & ~kSequenceImageKnownFlags) != 0) {
    return Bad("flags", "only bits 0 and 1", static_cast<int64_t>(flags));
  }
  const bool tokens = (flags & kSequenceImageHasTokens) != 0;
  if (extra_key_bytes < 0 || (!tokens && extra_key_bytes != 0) || extra_key_bytes > INT32_MAX) {
    return Bad("extra_key_bytes", tokens ? "in [0, 2^31)" : "0 without a tokens section",
               extra_key_bytes);
  }
  absl::StatusOr<int64_t> code = RecipeToCode(recipe);
  if (!code.ok()) return code.status();
  SequenceImageHeader h;
  h.version = kSequenceImageVersion;
  h.length = length;
  h.num_layers = num_layers;
  h.recipe = recipe;
  h.recipe_code = *code;
  h.key_format = static_cast<uint8_t>(g.key_format);
  h.num_pages = length / g.page_size + (length % g.page_size != 0 ? 1 : 0);
  g.num_pages = h.num_pages;
  h.geometry = g;
  h.flags = flags;
  h.extra_key_bytes = extra_key_bytes;
  h.scale_fingerprint = (flags & kSequenceImageScalesKnown) != 0 ? scale_fingerprint : 0;
  const int64_t rows = static_cast<int64_t>(g.page_size) * g.num_kv_heads;
  const int64_t row_bytes[4] = {g.DataRowBytes(false), g.DataRowBytes(true),
                                g.ScaleRowBytes(false), g.ScaleRowBytes(true)};
  const absl::Status too_big = absl::InvalidArgumentError(absl::StrCat(
      "sequence image: expected an image size within int64, got ", num_layers, " layers of ",
      h.num_pages, " pages"));
  int64_t off = 0;
  for (int r = 0; r < 4; ++r) {
    int64_t page = 0, region = 0;
    if (!MulAdd(rows, row_bytes[r], 0, &page) || !MulAdd(page, h.num_pages, 0, &region) ||
        !AlignUp(region, kSequenceImageAlign, &region)) {
      return too_big;
    }
    h.region_page_bytes[r] = page;
    h.region_offset[r] = off;
    if (__builtin_add_overflow(off, region, &off)) return too_big;
  }
  h.layer_bytes = off;
  h.scales_offset = kSequenceImageHeaderBytes;
  if (!AlignUp(24 * static_cast<int64_t>(num_layers), kSequenceImageAlign, &h.scales_bytes)) {
    return too_big;
  }
  h.layers_offset = h.scales_offset + h.scales_bytes;
  int64_t end = 0;
  if (!MulAdd(h.layer_bytes, num_layers, h.layers_offset, &end)) return too_big;
  if (tokens) {
    int64_t key = 0, ids = 0, hashes = 0, total = 0;
    if (!AlignUp(extra_key_bytes, 16, &key) || !MulAdd(length, 4, 0, &ids) ||
        !AlignUp(ids, 16, &ids) || !MulAdd(length / g.page_size, 16, 0, &hashes) ||
        __builtin_add_overflow(key, ids, &total) ||
        __builtin_add_overflow(total, hashes, &total) ||
        !AlignUp(total, kSequenceImageAlign, &total)) {
      return too_big;
    }
    h.tokens_offset = end;
    h.tokens_bytes = total;
    if (__builtin_add_overflow(end, total, &end)) return too_big;
  }
  h.image_bytes = end;
  return h;
}

uint64_t SequenceImageHeaderChecksum(const void* header_bytes) {
  return XXH3_64bits(header_bytes, kOffChecksum);
}

void SerializeSequenceImageHeader(const SequenceImageHeader& h, void* out) {
  uint8_t* p = static_cast<uint8_t*>(out);
  std::memset(p, 0, kSequenceImageHeaderBytes);
  std::memcpy(p + kOffMagic, kSequenceImageMagic, 8);
  Put<uint32_t>(p, kOffVersion, h.version);
  Put<uint32_t>(p, kOffHeaderBytes, static_cast<uint32_t>(kSequenceImageHeaderBytes));
  Put<int64_t>(p, kOffImageBytes, h.image_bytes);
  Put<int32_t>(p, kOffHeads, h.geometry.num_kv_heads);
  Put<int32_t>(p, kOffHeadDimK, h.geometry.head_dim_k);
  Put<int32_t>(p, kOffHeadDimV, h.geometry.head_dim_v);
  Put<int32_t>(p, kOffPageSize, h.geometry.page_size);
  Put<uint8_t>(p, kOffLayout, static_cast<uint8_t>(h.geometry.layout));
  Put<uint8_t>(p, kOffKeyFormat, h.key_format);
  Put<int32_t>(p, kOffLayers, h.num_layers);
  Put<int64_t>(p, kOffRecipe, h.recipe_code);
  Put<int64_t>(p, kOffLength, h.length);
  Put<int64_t>(p, kOffPages, h.num_pages);
  Put<uint64_t>(p, kOffFlags, h.flags);
  Put<int64_t>(p, kOffScalesOffset, h.scales_offset);
  Put<int64_t>(p, kOffScalesBytes, h.scales_bytes);
  Put<int64_t>(p, kOffLayersOffset, h.layers_offset);
  Put<int64_t>(p, kOffLayerBytes, h.layer_bytes);
  for (int r = 0; r < 4; ++r) Put<int64_t>(p, kOffRegionPageBytes + 8 * r, h.region_page_bytes[r]);
  Put<int64_t>(p, kOffTokensOffset, h.tokens_offset);
  Put<int64_t>(p, kOffTokensBytes, h.tokens_bytes);
  Put<uint64_t>(p, kOffFingerprint, h.scale_fingerprint);
  Put<int64_t>(p, kOffExtraKeyBytes, h.extra_key_bytes);
  Put<uint64_t>(p, kOffChecksum, SequenceImageHeaderChecksum(p));
}

absl::StatusOr<SequenceImageHeader> ParseSequenceImageHeader(const void* host_bytes,
                                                             int64_t bytes) {
  if (host_bytes == nullptr) {
    return absl::InvalidArgumentError("sequence image header: expected host bytes, got null");
  }
  if (bytes < kSequenceImageHeaderBytes) {
    return Bad("bytes", absl::StrCat(">= ", kSequenceImageHeaderBytes, " (truncated header)"),
               bytes);
  }
  const uint8_t* p = static_cast<const uint8_t*>(host_bytes);
  if (std::memcmp(p + kOffMagic, kSequenceImageMagic, 8) != 0) {
    return absl::InvalidArgumentError(
        "sequence image header: magic: expected \"FP4KVSEQ\", got other bytes (not an image)");
  }
  const uint32_t version = Get<uint32_t>(p, kOffVersion);
  if (version != kSequenceImageVersion) {
    return Bad("version", absl::StrCat(kSequenceImageVersion), version);
  }
  if (Get<uint32_t>(p, kOffHeaderBytes) != kSequenceImageHeaderBytes) {
    return Bad("header_bytes", absl::StrCat(kSequenceImageHeaderBytes),
               Get<uint32_t>(p, kOffHeaderBytes));
  }
  const uint64_t sum = Get<uint64_t>(p, kOffChecksum);
  if (sum != SequenceImageHeaderChecksum(p)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence image header: checksum: expected ", SequenceImageHeaderChecksum(p),
        " (XXH3-64 of bytes [0, 248)), got ", sum, " (corrupted header)"));
  }
  if (Get<uint16_t>(p, kOffReserved16) != 0) return Bad("reserved (byte 42)", "0", 1);
  for (int o = kOffReserved; o < kOffChecksum; ++o) {
    if (p[o] != 0) return Bad(absl::StrCat("reserved (byte ", o, ")"), "0", p[o]);
  }
  const uint8_t key_format = Get<uint8_t>(p, kOffKeyFormat);
  if (key_format != kKeyFormatNvfp4 && key_format != kKeyFormatFp8) {
    return Bad("key_format", "0 (NVFP4 keys) or 1 (FP8 keys)", key_format);
  }
  const uint8_t layout = Get<uint8_t>(p, kOffLayout);
  if (layout > 1) return Bad("layout", "0 (NHD) or 1 (HND)", layout);
  CacheGeometry g;
  g.num_kv_heads = Get<int32_t>(p, kOffHeads);
  g.head_dim_k = Get<int32_t>(p, kOffHeadDimK);
  g.head_dim_v = Get<int32_t>(p, kOffHeadDimV);
  g.page_size = Get<int32_t>(p, kOffPageSize);
  g.layout = static_cast<Layout>(layout);
  g.key_format = static_cast<KeyFormat>(key_format);
  g.num_pages = 1;
  if (absl::Status s = g.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence image header: geometry: ", s.message()));
  }
  const int64_t code = Get<int64_t>(p, kOffRecipe);
  absl::StatusOr<Recipe> recipe = RecipeFromCode(code);
  if (!recipe.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence image header: recipe_code: ", recipe.status().message()));
  }
  const int32_t layers = Get<int32_t>(p, kOffLayers);
  if (layers < 1) return Bad("num_layers", ">= 1", layers);
  const int64_t length = Get<int64_t>(p, kOffLength);
  if (length < 0) return Bad("length", ">= 0", length);
  const uint64_t flags = Get<uint64_t>(p, kOffFlags);
  if ((flags & ~kSequenceImageKnownFlags) != 0) {
    return Bad("flags", "only bits 0 (tokens) and 1 (scales known)", static_cast<int64_t>(flags));
  }
  const int64_t key_bytes = Get<int64_t>(p, kOffExtraKeyBytes);
  const bool tokens = (flags & kSequenceImageHasTokens) != 0;
  if (key_bytes < 0 || key_bytes > INT32_MAX || (!tokens && key_bytes != 0)) {
    return Bad("extra_key_bytes", tokens ? "in [0, 2^31)" : "0 without a tokens section",
               key_bytes);
  }
  absl::StatusOr<SequenceImageHeader> want = MakeSequenceImageHeader(
      g, layers, *recipe, length, flags, key_bytes, Get<uint64_t>(p, kOffFingerprint));
  if (!want.ok()) return want.status();
  const SequenceImageHeader& w = *want;
  if (w.recipe_code != code) {
    return Bad("recipe_code", absl::StrCat(w.recipe_code, " (the canonical code of its recipe)"),
               code);
  }
  if ((flags & kSequenceImageScalesKnown) == 0 && Get<uint64_t>(p, kOffFingerprint) != 0) {
    return Bad("scale_fingerprint", "0 without the scales-known flag", 1);
  }
  struct Field {
    const char* name;
    int off;
    int64_t want;
  };
  const Field fields[] = {
      {"num_pages", kOffPages, w.num_pages},
      {"scales_offset", kOffScalesOffset, w.scales_offset},
      {"scales_bytes", kOffScalesBytes, w.scales_bytes},
      {"layers_offset", kOffLayersOffset, w.layers_offset},
      {"region_page_bytes[0] (K data)", kOffRegionPageBytes + 0, w.region_page_bytes[0]},
      {"region_page_bytes[1] (V data)", kOffRegionPageBytes + 8, w.region_page_bytes[1]},
      {"region_page_bytes[2] (K scales)", kOffRegionPageBytes + 16, w.region_page_bytes[2]},
      {"region_page_bytes[3] (V scales)", kOffRegionPageBytes + 24, w.region_page_bytes[3]},
      {"layer_bytes", kOffLayerBytes, w.layer_bytes},
      {"tokens_offset", kOffTokensOffset, w.tokens_offset},
      {"tokens_bytes", kOffTokensBytes, w.tokens_bytes},
      {"image_bytes", kOffImageBytes, w.image_bytes},
  };
  for (const Field& f : fields) {
    const int64_t got = Get<int64_t>(p, f.off);
    if (got != f.want) {
      return Bad(f.name,
                 absl::StrCat(f.want, " (from the geometry, key format ",
                              static_cast<int>(key_format), ", layers and length)"),
                 got);
    }
  }
  return w;
}

// ------------------------------------------------------- ImportReservation
ImportReservation::ImportReservation(ImportReservation&& o) noexcept
    : book_(std::move(o.book_)), id_(o.id_), header_(o.header_) {
  o.id_ = 0;
  o.book_.reset();
}

ImportReservation& ImportReservation::operator=(ImportReservation&& o) noexcept {
  if (this != &o) {
    Drop();
    book_ = std::move(o.book_);
    id_ = o.id_;
    header_ = o.header_;
    o.id_ = 0;
    o.book_.reset();
  }
  return *this;
}

ImportReservation::~ImportReservation() { Drop(); }

}  // namespace fp4kv
