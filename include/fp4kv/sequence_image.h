// The sequence image: one sequence of a KVCache packed into a flat buffer
// (docs/format.md, "Sequence images"), for moving it to another cache
// (disaggregated prefill, another GPU) or to host memory. KVCache::
// ExportSequence writes one, KVCache::ReserveImport / CommitImport /
// ImportSequence read one.
//
// Layout (every section starts at a multiple of 256 bytes from the image
// start):
//   header   kSequenceImageHeaderBytes, written by the host: magic, version,
//            geometry, recipe code, key format, length, section offsets, a
//            checksum of the header (host-known fields only)
//   scales   [L, 4] f32 (K, V global scales, K, V FP8 decode scales) then
//            [L, 2] i32 (K, V calibrated flags), written by the device
//   layers   L sections of layer_bytes: K data, V data, K scales, V scales of
//            the sequence's pages in block-table order (whole pages)
//   tokens   only with kSequenceImageHasTokens: the extra key, the token ids
//            and the page hashes of a prefix-cached sequence
#ifndef FP4KV_SEQUENCE_IMAGE_H_
#define FP4KV_SEQUENCE_IMAGE_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "fp4kv/format.h"
#include "fp4kv/geometry.h"

namespace fp4kv {

inline constexpr char kSequenceImageMagic[8] = {'F', 'P', '4', 'K', 'V', 'S', 'E', 'Q'};
inline constexpr uint32_t kSequenceImageVersion = 1;
inline constexpr int64_t kSequenceImageHeaderBytes = 256;
inline constexpr int64_t kSequenceImageAlign = 256;  // section alignment

// Header flags.
inline constexpr uint64_t kSequenceImageHasTokens = 1;       // a tokens section follows
inline constexpr uint64_t kSequenceImageScalesKnown = 2;     // scale_fingerprint is valid
inline constexpr uint64_t kSequenceImageKnownFlags = 3;

// How the keys are stored: the source cache's KeyFormat. 0: NVFP4 (packed
// E2M1 + E4M3 block scales); 1: FP8 (one E4M3 byte per value, no key block
// scales: the K scales region of every layer section is 0 bytes). Every size
// is derived from CacheGeometry::DataRowBytes and ScaleRowBytes.
inline constexpr uint8_t kKeyFormatNvfp4 = static_cast<uint8_t>(KeyFormat::kNvfp4);
inline constexpr uint8_t kKeyFormatFp8 = static_cast<uint8_t>(KeyFormat::kFp8);

// The parsed header. Sizes are in bytes, offsets from the image start.
struct SequenceImageHeader {
  uint32_t version = kSequenceImageVersion;
  int64_t image_bytes = 0;      // the whole image
  int64_t length = 0;           // tokens
  int num_layers = 0;
  CacheGeometry geometry;       // the source cache's; num_pages = the image's pages
  Recipe recipe;
  int64_t recipe_code = 0;      // RecipeToCode(recipe)
  uint8_t key_format = kKeyFormatNvfp4;  // == geometry.key_format
  int64_t num_pages = 0;        // ceil(length / page_size)
  uint64_t flags = 0;           // kSequenceImage* bits
  int64_t scales_offset = 0, scales_bytes = 0;
  int64_t layers_offset = 0;
  int64_t layer_bytes = 0;      // layer l's section: layers_offset + l * layer_bytes
  // Inside a layer section: K data, V data, K scales, V scales; each region
  // holds num_pages pages of region_page_bytes[r].
  int64_t region_offset[4] = {0, 0, 0, 0};
  int64_t region_page_bytes[4] = {0, 0, 0, 0};
  int64_t tokens_offset = 0, tokens_bytes = 0;  // 0 without kSequenceImageHasTokens
  int64_t extra_key_bytes = 0;                  // of the tokens section
  // XXH3-64 of the source's [L, 4] scales when the host knew them all
  // (given at Create or by UpdateGlobalScales); valid with
  // kSequenceImageScalesKnown.
  uint64_t scale_fingerprint = 0;

  bool has_tokens() const { return (flags & kSequenceImageHasTokens) != 0; }
};

// The header of an image of `length` tokens of a cache with this geometry
// (its key_format included), layer count and recipe, with every size and offset filled in (flags as
// given; extra_key_bytes counts with kSequenceImageHasTokens). InvalidArgument
// when a size does not fit in int64 or a field is out of range.
absl::StatusOr<SequenceImageHeader> MakeSequenceImageHeader(const CacheGeometry& geometry,
                                                            int num_layers, const Recipe& recipe,
                                                            int64_t length, uint64_t flags = 0,
                                                            int64_t extra_key_bytes = 0,
                                                            uint64_t scale_fingerprint = 0);

// Writes `header` in the wire form (kSequenceImageHeaderBytes, little-endian,
// checksum last) to `out`; writes whatever the fields hold (no checks).
void SerializeSequenceImageHeader(const SequenceImageHeader& header, void* out);

// XXH3-64 of the first 248 bytes of a wire header (the checksum field).
uint64_t SequenceImageHeaderChecksum(const void* header_bytes);

// Parses and validates a wire header: `bytes` >= kSequenceImageHeaderBytes
// readable host bytes (the start of an image). InvalidArgument naming the
// field (magic, version, checksum, geometry, recipe, key format, sizes and
// offsets, which must be exactly what MakeSequenceImageHeader gives).
absl::StatusOr<SequenceImageHeader> ParseSequenceImageHeader(const void* host_bytes, int64_t bytes);

// What to do with bytes stored under one global scale when another scale
// takes over: a scale change of a layer that holds tokens
// (KVCache::UpdateGlobalScales, CalibrateGlobalScales) and an import whose
// image scales differ from those of a target layer that already has scales
// of its own (ImportOptions; docs/kv_cache.md, "Export and import").
enum class StoredTokens : uint8_t {
  // FailedPrecondition naming the layer, nothing changed. An import that
  // cannot prove the scales equal (both caches' scales all host-known and
  // equal) reads both scale tables back: a host sync of the stream.
  kRefuse = 0,
  // Re-encode the stored (or imported) blocks under the new scales on the
  // device (QuantizeBlock(DequantizeBlock(b, g_old), g_new); FP8 key bytes:
  // QuantizeFp8Key(DequantFp8Key(c, g_old), Fp8KeyEncodeMultiplier(g_new))):
  // no host sync, extra rounding error (docs/recipes.md) on the layers whose
  // scales differ.
  kReencode = 1,
};

struct ImportOptions {
  StoredTokens on_scale_mismatch = StoredTokens::kRefuse;
};

namespace internal {
struct ReservationBook;
}  // namespace internal

// Pages of a KVCache set aside for one image (KVCache::ReserveImport). Move
// only. Destroying a reservation that was neither committed nor cancelled
// frees its pages (while its cache lives; a destroyed cache took them with
// it).
class ImportReservation {
 public:
  ImportReservation() = default;
  ImportReservation(ImportReservation&& o) noexcept;
  ImportReservation& operator=(ImportReservation&& o) noexcept;
  ImportReservation(const ImportReservation&) = delete;
  ImportReservation& operator=(const ImportReservation&) = delete;
  ~ImportReservation();

  // 0 for an empty (default, moved-from, committed or cancelled) handle.
  uint64_t id() const { return id_; }
  const SequenceImageHeader& header() const { return header_; }

 private:
  friend class KVCache;
  void Drop();
  std::weak_ptr<internal::ReservationBook> book_;
  uint64_t id_ = 0;
  SequenceImageHeader header_;
};

}  // namespace fp4kv

#endif  // FP4KV_SEQUENCE_IMAGE_H_
