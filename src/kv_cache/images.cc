// KVCache sequence images: export, two-phase import (reserve, commit).
#include <algorithm>
#include <cstring>

#include "src/kv_cache/state.h"
#include "src/prefix_hash.h"

namespace fp4kv {

using internal::CeilDiv;
using internal::KVCacheState;

namespace internal {
namespace {

enum class MemKind { kDevice, kPinned, kPageable };

// Where `p` lives for cache `s`, and the address a kernel uses (device and
// pinned memory). The CPU device: pageable host memory.
absl::Status ClassifyMemory(const KVCacheState& s, const void* p, const char* name, MemKind* kind,
                            const uint8_t** dev) {
  *kind = MemKind::kPageable;
  *dev = nullptr;
  if (!s.cuda) return absl::OkStatus();
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::OkStatus();
  }
  if (a.type == cudaMemoryTypeDevice) {
    if (a.device != s.options.device.ordinal) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": expected memory of the cache's device ", s.options.device.ToString(),
          " or host memory, got memory of cuda:", a.device));
    }
    *kind = MemKind::kDevice;
    *dev = static_cast<const uint8_t*>(p);
  } else if (a.type == cudaMemoryTypeManaged) {
    *kind = MemKind::kDevice;
    *dev = static_cast<const uint8_t*>(p);
  } else if (a.type == cudaMemoryTypeHost && a.devicePointer != nullptr) {
    *kind = MemKind::kPinned;
    *dev = static_cast<const uint8_t*>(a.devicePointer);
  }
  return absl::OkStatus();
}

// The header of q's image as this cache writes it.
absl::StatusOr<SequenceImageHeader> ImageHeaderOf(const KVCacheState& s,
                                                  const KVCacheState::Sequence& q) {
  uint64_t flags = 0, fingerprint = 0;
  int64_t key_bytes = 0;
  // Token ids travel only when all of them are known (SetTokenIds).
  if (s.prefix.enabled && q.chain.tracked && q.chain.ids_known == q.length) {
    flags |= kSequenceImageHasTokens;
    key_bytes = static_cast<int64_t>(q.chain.extra_key.size());
  }
  if (s.ScaleFingerprint(&fingerprint)) flags |= kSequenceImageScalesKnown;
  return MakeSequenceImageHeader(s.geometry, s.options.num_layers, s.options.recipe, q.length,
                                 flags, key_bytes, fingerprint);
}

// Offsets inside a tokens section.
int64_t TokenIdsOffset(const SequenceImageHeader& h) { return RoundUp(h.extra_key_bytes, 16); }
int64_t TokenHashesOffset(const SequenceImageHeader& h) {
  return TokenIdsOffset(h) + RoundUp(4 * h.length, 16);
}

// The tokens section of q's image (h.tokens_bytes bytes).
void WriteTokens(const KVCacheState& s, const KVCacheState::Sequence& q,
                 const SequenceImageHeader& h, uint8_t* out) {
  std::memset(out, 0, static_cast<size_t>(h.tokens_bytes));
  std::memcpy(out, q.chain.extra_key.data(), q.chain.extra_key.size());
  const int64_t ps = s.geometry.page_size;
  uint8_t* ids = out + TokenIdsOffset(h);
  for (int64_t t = 0; t < q.length; ++t) {
    const int32_t id = s.prefix.page_tokens[static_cast<int64_t>(q.pages[t / ps]) * ps + t % ps];
    std::memcpy(ids + 4 * t, &id, 4);
  }
  uint8_t* hashes = out + TokenHashesOffset(h);
  for (size_t j = 0; j < q.chain.hashes.size(); ++j) {
    std::memcpy(hashes + 16 * j, &q.chain.hashes[j].low, 8);
    std::memcpy(hashes + 16 * j + 8, &q.chain.hashes[j].high, 8);
  }
}

// Per-page copies between the pool and a pageable host image (the kernel
// cannot reach pageable memory); runs of consecutive page ids are merged.
absl::Status PageableCopy(const KVCacheState& s, const SequenceImageHeader& h, uint8_t* image,
                          absl::Span<const int32_t> pages, bool to_image, cudaStream_t cs) {
  const int64_t n = static_cast<int64_t>(pages.size());
  for (int l = 0; l < s.options.num_layers; ++l) {
    for (int r = 0; r < 4; ++r) {
      const int64_t pb = s.mem.pool.regions[r].page_bytes;
      if (pb == 0) continue;  // the K scales of FP8 keys
      uint8_t* pool = s.mem.pools.get() + l * s.mem.pool.layer_bytes + s.mem.pool.regions[r].offset;
      uint8_t* img = image + h.layers_offset + l * h.layer_bytes + h.region_offset[r];
      for (int64_t i = 0; i < n;) {
        int64_t j = i + 1;
        while (j < n && pages[j] == pages[j - 1] + 1) ++j;
        uint8_t* a = img + i * pb;
        uint8_t* b = pool + static_cast<int64_t>(pages[i]) * pb;
        FP4KV_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(to_image ? a : b, to_image ? b : a, static_cast<size_t>((j - i) * pb),
                            to_image ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, cs));
        i = j;
      }
    }
  }
  return absl::OkStatus();
}

PageCopyParams PoolToImage(const KVCacheState& s, const SequenceImageHeader& h, uint8_t* image,
                           const int32_t* ids, int64_t n) {
  PageCopyParams p;
  p.src = s.mem.pools.get();
  p.src_layer_stride = s.mem.pool.layer_bytes;
  p.dst = image + h.layers_offset;
  p.dst_layer_stride = h.layer_bytes;
  for (int r = 0; r < 4; ++r) {
    p.src_region[r] = s.mem.pool.regions[r].offset;
    p.dst_region[r] = h.region_offset[r];
    p.page_bytes[r] = s.mem.pool.regions[r].page_bytes;
  }
  p.src_ids = ids;
  p.num_pages = n;
  p.num_layers = s.options.num_layers;
  return p;
}

PageCopyParams ImageToPool(const KVCacheState& s, const SequenceImageHeader& h,
                           const uint8_t* image, const int32_t* ids, int64_t n) {
  PageCopyParams p;
  p.src = image + h.layers_offset;
  p.src_layer_stride = h.layer_bytes;
  p.dst = s.mem.pools.get();
  p.dst_layer_stride = s.mem.pool.layer_bytes;
  for (int r = 0; r < 4; ++r) {
    p.src_region[r] = h.region_offset[r];
    p.dst_region[r] = s.mem.pool.regions[r].offset;
    p.page_bytes[r] = s.mem.pool.regions[r].page_bytes;
  }
  p.dst_ids = ids;
  p.num_pages = n;
  p.num_layers = s.options.num_layers;
  return p;
}

absl::Status CheckImagePointer(const void* p, const char* name) {
  if (p == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected memory, got null"));
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name,
                                                   ": expected a 16-byte aligned address, got 0x",
                                                   absl::Hex(reinterpret_cast<uintptr_t>(p))));
  }
  return absl::OkStatus();
}

void CancelReservation(KVCacheState& s, uint64_t id) {
  const std::vector<int32_t> pages = s.images.Take(id);
  for (size_t j = pages.size(); j-- > 0;) s.allocator.Release(pages[j]);
}

}  // namespace
}  // namespace internal

namespace internal {
void ImageState::Init(KVCacheState* state) {
  book_ = std::make_shared<ReservationBook>();
  book_->state = state;
}

void ImageState::Detach() {
  if (book_ != nullptr) book_->state = nullptr;
}

uint64_t ImageState::Add(Reservation r) {
  const uint64_t id = next_reservation_++;
  reserved_pages_ += static_cast<int64_t>(r.pages.size());
  reservations_.emplace(id, std::move(r));
  return id;
}

ImageState::Reservation* ImageState::Find(uint64_t id) {
  auto it = reservations_.find(id);
  return it == reservations_.end() ? nullptr : &it->second;
}

std::vector<int32_t> ImageState::Take(uint64_t id) {
  auto it = reservations_.find(id);
  if (it == reservations_.end()) return {};
  std::vector<int32_t> pages = std::move(it->second.pages);
  reserved_pages_ -= static_cast<int64_t>(pages.size());
  reservations_.erase(it);
  return pages;
}
}  // namespace internal

void ImportReservation::Drop() {
  if (id_ != 0) {
    if (std::shared_ptr<internal::ReservationBook> b = book_.lock(); b && b->state != nullptr) {
      internal::CancelReservation(*b->state, id_);
    }
  }
  id_ = 0;
  book_.reset();
}

absl::StatusOr<int64_t> KVCache::ExportedBytes(SequenceId seq) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  const KVCacheState::Sequence* q = s.Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  absl::StatusOr<SequenceImageHeader> h = internal::ImageHeaderOf(s, *q);
  if (!h.ok()) return h.status();
  return h->image_bytes;
}

absl::Status KVCache::ExportSequence(SequenceId seq, void* dst, int64_t dst_bytes,
                                     Stream stream) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  absl::StatusOr<KVCacheState::Sequence*> found = s.FindResident(seq, "ExportSequence");
  if (!found.ok()) return found.status();
  KVCacheState::Sequence* q = *found;
  absl::StatusOr<SequenceImageHeader> hs = internal::ImageHeaderOf(s, *q);
  if (!hs.ok()) return hs.status();
  const SequenceImageHeader& h = *hs;
  FP4KV_RETURN_IF_ERROR(internal::CheckImagePointer(dst, "dst"));
  if (dst_bytes < h.image_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("dst_bytes: expected at least ", h.image_bytes,
                                                   " (ExportedBytes of sequence ", seq, "), got ",
                                                   dst_bytes));
  }
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  internal::MemKind kind;
  const uint8_t* dev = nullptr;
  FP4KV_RETURN_IF_ERROR(internal::ClassifyMemory(s, dst, "dst", &kind, &dev));
  uint8_t* out = static_cast<uint8_t*>(dst);
  uint8_t header[kSequenceImageHeaderBytes];
  SerializeSequenceImageHeader(h, header);
  internal::HostVector<uint8_t> tokens;
  if (h.has_tokens()) {
    FP4KV_RETURN_IF_ERROR(internal::SizeHost(&tokens, h.tokens_bytes, uint8_t{0}, "ExportSequence",
                                             "the image's token ids"));
    internal::WriteTokens(s, *q, h, tokens.data());
  }
  const int L = s.options.num_layers;
  const int64_t n = static_cast<int64_t>(q->pages.size());
  if (!s.cuda) {
    std::memcpy(out, header, sizeof(header));
    std::memcpy(out + h.scales_offset, s.scales.d_scales(), 16 * static_cast<size_t>(L));
    std::memcpy(out + h.scales_offset + 16 * L, s.scales.d_flags(), 8 * static_cast<size_t>(L));
    if (!tokens.empty()) std::memcpy(out + h.tokens_offset, tokens.data(), tokens.size());
    internal::ReferencePageCopy(internal::PoolToImage(s, h, out, q->pages.data(), n));
    s.images.AddExported(h.image_bytes);
    return absl::OkStatus();
  }
  const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
  FP4KV_RETURN_IF_ERROR(s.OrderAfterSwapIn(*q, stream));
  if (kind == internal::MemKind::kDevice) {
    // From pageable memory: staged before the calls return.
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(out, header, sizeof(header), cudaMemcpyHostToDevice, cs));
    if (!tokens.empty()) {
      FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out + h.tokens_offset, tokens.data(),
                                                 tokens.size(), cudaMemcpyHostToDevice, cs));
    }
  } else {
    std::memcpy(out, header, sizeof(header));
    if (!tokens.empty()) std::memcpy(out + h.tokens_offset, tokens.data(), tokens.size());
  }
  FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out + h.scales_offset, s.scales.d_scales(),
                                             16 * static_cast<size_t>(L), cudaMemcpyDefault, cs));
  FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out + h.scales_offset + 16 * L, s.scales.d_flags(),
                                             8 * static_cast<size_t>(L), cudaMemcpyDefault, cs));
  if (n > 0) {
    if (kind == internal::MemKind::kPageable) {
      FP4KV_RETURN_IF_ERROR(internal::PageableCopy(s, h, out, q->pages, true, cs));
    } else {
      int32_t* ids = reinterpret_cast<int32_t*>(s.mem.d_step + s.mem.step_layout.xfer_ids);
      FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ids, q->pages.data(), 4 * static_cast<size_t>(n),
                                                 cudaMemcpyHostToDevice, cs));
      internal::PageCopyParams p = internal::PoolToImage(s, h, const_cast<uint8_t*>(dev), ids, n);
      if (kind == internal::MemKind::kPinned) p.max_ctas = internal::kHostCopyCtas;
      FP4KV_RETURN_IF_ERROR(internal::LaunchPageCopy(p, stream));
    }
  }
  s.images.AddExported(h.image_bytes);
  return absl::OkStatus();
}

absl::StatusOr<ImportReservation> KVCache::ReserveImport(const SequenceImageHeader& header) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  s.PollSwaps();
  // The fields must be those of a well-formed image.
  uint8_t wire[kSequenceImageHeaderBytes];
  SerializeSequenceImageHeader(header, wire);
  absl::StatusOr<SequenceImageHeader> parsed = ParseSequenceImageHeader(wire, sizeof(wire));
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("header: ", parsed.status().message()));
  }
  const SequenceImageHeader& h = *parsed;
  const CacheGeometry& g = s.geometry;
  const CacheGeometry& ig = h.geometry;
  const struct {
    const char* name;
    int64_t want, got;
  } fields[] = {
      {"num_layers", s.options.num_layers, h.num_layers},
      {"geometry.num_kv_heads", g.num_kv_heads, ig.num_kv_heads},
      {"geometry.head_dim_k", g.head_dim_k, ig.head_dim_k},
      {"geometry.head_dim_v", g.head_dim_v, ig.head_dim_v},
      {"geometry.page_size", g.page_size, ig.page_size},
      {"geometry.layout", static_cast<int64_t>(g.layout), static_cast<int64_t>(ig.layout)},
  };
  for (const auto& f : fields) {
    if (f.want != f.got) {
      return absl::InvalidArgumentError(absl::StrCat("header.", f.name, ": expected this cache's ",
                                                     f.want, ", got ", f.got,
                                                     " (an image of another cache geometry)"));
    }
  }
  if (h.key_format != static_cast<uint8_t>(g.key_format)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.key_format: expected this cache's ", static_cast<int>(g.key_format), " (",
        KeyFormatName(g.key_format), " keys), got ", static_cast<int>(h.key_format), " (",
        KeyFormatName(ig.key_format), " keys); an image of another key format is not converted"));
  }
  if (!(h.recipe == s.options.recipe)) {
    return absl::InvalidArgumentError(absl::StrCat("header.recipe: expected this cache's ",
                                                   RecipeName(s.options.recipe), ", got ",
                                                   RecipeName(h.recipe)));
  }
  const int64_t n = h.num_pages;
  if (n > s.options.max_pages_per_seq) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.length: expected at most max_pages_per_seq * page_size = ",
        int64_t{s.options.max_pages_per_seq} * g.page_size, " tokens, got ", h.length));
  }
  FP4KV_RETURN_IF_ERROR(s.MakeAvailable(n, "ReserveImport"));
  internal::KVCacheState::Reservation r;
  r.header = h;
  r.pages.reserve(static_cast<size_t>(n));  // n: pages MakeAvailable found in the pool
  for (int64_t i = 0; i < n; ++i) r.pages.push_back(s.allocator.Allocate());
  const uint64_t id = s.images.Add(std::move(r));
  ImportReservation out;
  out.book_ = s.images.book();
  out.id_ = id;
  out.header_ = h;
  return out;
}

absl::Status KVCache::CancelImport(ImportReservation reservation) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  if (reservation.id_ == 0 || reservation.book_.lock() != s.images.book() ||
      s.images.Find(reservation.id_) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("reservation: expected an open reservation of this cache, got id ",
                     reservation.id_, reservation.id_ == 0 ? " (empty)" : ""));
  }
  internal::CancelReservation(s, reservation.id_);
  reservation.id_ = 0;
  return absl::OkStatus();
}

namespace internal {
namespace {

// CommitImport's view of the image, filled by CheckImportImage.
struct ImportSource {
  const uint8_t* in = nullptr;   // the image as given
  const uint8_t* dev = nullptr;  // its device address (device or pinned memory)
  MemKind kind = MemKind::kDevice;
  bool host_image = false;
};

// CommitImport phase 1: the image's pointer, size and (host images) header
// against the reservation's, and the options.
absl::Status CheckImportImage(const KVCacheState& s, const SequenceImageHeader& h,
                              const void* image, int64_t image_bytes, const ImportOptions& options,
                              ImportSource* src) {
  FP4KV_RETURN_IF_ERROR(CheckImagePointer(image, "image"));
  if (image_bytes < h.image_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("image_bytes: expected at least ", h.image_bytes,
                                                   " (the reserved image's size), got ",
                                                   image_bytes));
  }
  if (options.on_scale_mismatch != StoredTokens::kRefuse &&
      options.on_scale_mismatch != StoredTokens::kReencode) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.on_scale_mismatch: expected kRefuse (0) or kReencode (1), got ",
                     static_cast<int>(options.on_scale_mismatch)));
  }
  FP4KV_RETURN_IF_ERROR(ClassifyMemory(s, image, "image", &src->kind, &src->dev));
  src->in = static_cast<const uint8_t*>(image);
  src->host_image = src->kind != MemKind::kDevice;
  if (src->host_image) {
    uint8_t want[kSequenceImageHeaderBytes];
    SerializeSequenceImageHeader(h, want);
    if (std::memcmp(want, src->in, sizeof(want)) != 0) {
      absl::StatusOr<SequenceImageHeader> got = ParseSequenceImageHeader(src->in, sizeof(want));
      return absl::InvalidArgumentError(absl::StrCat(
          "image: expected the image whose header was reserved, got one whose header differs",
          got.ok() ? "" : absl::StrCat(" (", got.status().message(), ")")));
    }
  }
  return absl::OkStatus();
}

// What CommitImport does with the image's scales, per layer and side.
struct ImportScales {
  std::vector<uint8_t> adopt;  // [L, 2]: adopt the image's (a pending side holding no tokens)
  bool any_adopt = false;
  bool requantize = false;  // the kept sides differ (or may): requantize the pages
};

// CommitImport phase 2: adopt (a pending side holding no tokens), else equal
// (proven by the host-known fingerprints, or checked: a host sync) or
// requantized (StoredTokens::kReencode).
absl::Status PlanImportScales(const KVCacheState& s, const SequenceImageHeader& h,
                              const ImportSource& src, const ImportOptions& options,
                              cudaStream_t cs, ImportScales* out) {
  const int L = s.options.num_layers;
  const uint8_t* in = src.in;
  std::vector<uint8_t>& adopt = out->adopt;
  adopt.assign(2 * static_cast<size_t>(L), 0);
  bool any_kept = false;
  const bool swapped_tokens = s.SwappedTokens() > 0;
  for (int l = 0; l < L; ++l) {
    const bool empty = s.TokensHeld(l) == 0 && !swapped_tokens;
    for (int kv = 0; kv < 2; ++kv) {
      adopt[2 * l + kv] = empty && s.scales.h_flags()[2 * l + kv] == 0;
      out->any_adopt |= adopt[2 * l + kv] != 0;
      any_kept |= adopt[2 * l + kv] == 0;
    }
  }
  uint64_t fingerprint = 0;
  const bool proven = (h.flags & kSequenceImageScalesKnown) != 0 &&
                      s.ScaleFingerprint(&fingerprint) && fingerprint == h.scale_fingerprint;
  if (!any_kept || proven) return absl::OkStatus();
  if (options.on_scale_mismatch == StoredTokens::kReencode) {
    out->requantize = true;
    return absl::OkStatus();
  }
  // Read both tables: a host sync.
  std::vector<float> image_scales(4 * static_cast<size_t>(L)), target(4 * static_cast<size_t>(L));
  const size_t table = 16 * static_cast<size_t>(L);
  if (!s.cuda) {
    std::memcpy(image_scales.data(), in + h.scales_offset, table);
    std::memcpy(target.data(), s.scales.d_scales(), table);
  } else {
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(target.data(), s.scales.d_scales(), table, cudaMemcpyDeviceToHost, cs));
    if (!src.host_image) {
      FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(image_scales.data(), in + h.scales_offset, table,
                                                 cudaMemcpyDeviceToHost, cs));
    }
    FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cs));
    if (src.host_image) std::memcpy(image_scales.data(), in + h.scales_offset, table);
  }
  for (int l = 0; l < L; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const float a = image_scales[4 * l + kv], b = target[4 * l + kv];
      if (adopt[2 * l + kv] == 0 && FloatBits(a) != FloatBits(b)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "CommitImport: layer ", l, kv == 0 ? " K" : " V", ": the image's global scale ", a,
            " differs from this cache's ", b,
            " (pass ImportOptions{StoredTokens::kReencode} to requantize the pages); the "
            "reservation is cancelled, nothing else changed"));
      }
    }
  }
  return absl::OkStatus();
}

// CommitImport phase 3 (prefix caching, an image with tokens): the tokens
// section read into *tok and every full page's stored hash checked against
// its token ids.
absl::Status ReadImportTokens(KVCacheState& s, const SequenceImageHeader& h,
                              const ImportSource& src, cudaStream_t cs, HostVector<uint8_t>* tok) {
  const int64_t ps = s.geometry.page_size;
  FP4KV_RETURN_IF_ERROR(
      SizeHost(tok, h.tokens_bytes, uint8_t{0}, "CommitImport", "the image's token ids"));
  if (src.host_image) {
    std::memcpy(tok->data(), src.in + h.tokens_offset, tok->size());
  } else {
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tok->data(), src.in + h.tokens_offset, tok->size(),
                                               cudaMemcpyDeviceToHost, cs));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cs));
  }
  const absl::string_view key(reinterpret_cast<const char*>(tok->data()),
                              static_cast<size_t>(h.extra_key_bytes));
  const int32_t* ids = reinterpret_cast<const int32_t*>(tok->data() + TokenIdsOffset(h));
  const uint8_t* stored = tok->data() + TokenHashesOffset(h);
  std::vector<BlockHash> hashes;
  for (int64_t j = 0; j < h.length / ps; ++j) {
    const BlockHash hj = HashPage(j == 0 ? nullptr : &hashes.back(),
                                  absl::Span<const int32_t>(ids + j * ps, static_cast<size_t>(ps)),
                                  key, &s.prefix.hash_scratch);
    BlockHash want;
    std::memcpy(&want.low, stored + 16 * j, 8);
    std::memcpy(&want.high, stored + 16 * j + 8, 8);
    if (hj != want) {
      return absl::DataLossError(
          absl::StrCat("image: page ", j, " of the tokens section: stored hash ", want.ToHex(),
                       ", its token ids hash to ", hj.ToHex(), "; the reservation is cancelled"));
    }
    hashes.push_back(hj);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace internal

absl::StatusOr<SequenceId> KVCache::CommitImport(ImportReservation reservation, const void* image,
                                                 int64_t image_bytes, const ImportOptions& options,
                                                 Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  KVCacheState::Reservation* r = nullptr;
  if (reservation.id_ != 0 && reservation.book_.lock() == s.images.book()) {
    r = s.images.Find(reservation.id_);
  }
  if (r == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("reservation: expected an open reservation of this cache, got id ",
                     reservation.id_, reservation.id_ == 0 ? " (empty)" : ""));
  }
  const SequenceImageHeader h = r->header;
  const int L = s.options.num_layers;
  const int64_t n = h.num_pages;
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
  // Checks and reads, before anything changes.
  internal::ImportSource src;
  FP4KV_RETURN_IF_ERROR(internal::CheckImportImage(s, h, image, image_bytes, options, &src));
  internal::ImportScales plan;
  FP4KV_RETURN_IF_ERROR(internal::PlanImportScales(s, h, src, options, cs, &plan));
  const bool tokens = s.prefix.enabled && h.has_tokens();
  internal::HostVector<uint8_t> tok;
  if (tokens) FP4KV_RETURN_IF_ERROR(internal::ReadImportTokens(s, h, src, cs, &tok));
  const uint8_t* in = src.in;
  const uint8_t* dev = src.dev;
  const internal::MemKind kind = src.kind;
  const bool host_image = src.host_image;
  const std::vector<uint8_t>& adopt = plan.adopt;
  const bool any_adopt = plan.any_adopt;
  const bool requantize = plan.requantize;

  // Commit: the reserved pages become the sequence.
  std::vector<int32_t> pages = s.images.Take(reservation.id_);
  reservation.id_ = 0;
  const SequenceId id = s.NewSequence();
  KVCacheState::Sequence& q = *s.Find(id);
  q.pages = std::move(pages);
  q.length = h.length;
  q.chain.Reset(tokens, tokens ? absl::string_view(reinterpret_cast<const char*>(tok.data()),
                                                   static_cast<size_t>(h.extra_key_bytes))
                               : absl::string_view());
  if (tokens) {
    s.AdoptTokenIds(q, reinterpret_cast<const int32_t*>(tok.data() + internal::TokenIdsOffset(h)));
  }
  if (h.length > 0) s.SettleLayers(0, L);
  for (int l = 0; l < L; ++l) {
    if (adopt[2 * l] || adopt[2 * l + 1]) s.ForgetKnownScales(l);
  }

  float* d_import = reinterpret_cast<float*>(s.mem.d_step + s.mem.step_layout.import_scales);
  uint8_t* d_mask = s.mem.d_step + s.mem.step_layout.adopt_mask;
  int32_t* ids = reinterpret_cast<int32_t*>(s.mem.d_step + s.mem.step_layout.xfer_ids);
  internal::AdoptScalesParams ap;
  ap.image_scales = d_import;
  ap.image_flags = reinterpret_cast<const int32_t*>(d_import + 4 * L);
  ap.mask = d_mask;
  ap.scales = s.scales.d_scales();
  ap.flags = s.scales.d_flags();
  ap.host_flags = s.cuda ? s.scales.h_flags_dev() : nullptr;
  ap.num_layers = L;
  internal::RequantizePagesParams rp;
  rp.pool = s.mem.pools.get();
  rp.layer_stride = s.mem.pool.layer_bytes;
  for (int r = 0; r < 4; ++r) {
    rp.region[r] = s.mem.pool.regions[r].offset;
    rp.page_bytes[r] = s.mem.pool.regions[r].page_bytes;
  }
  rp.pages = s.cuda ? ids : q.pages.data();
  rp.num_pages = n;
  rp.num_layers = L;
  rp.src_scales = d_import;
  rp.dst_scales = s.scales.d_scales();
  rp.recipe = s.options.recipe;
  rp.fp8_keys = s.geometry.fp8_keys();
  if (!s.cuda) {
    if (any_adopt || requantize) {
      std::memcpy(d_import, in + h.scales_offset, 24 * static_cast<size_t>(L));
    }
    if (any_adopt) {
      std::memcpy(d_mask, adopt.data(), adopt.size());
      internal::ReferenceAdoptScales(ap);
    }
    internal::ReferencePageCopy(internal::ImageToPool(s, h, in, q.pages.data(), n));
    if (requantize) internal::ReferenceRequantizePages(rp);
    s.images.AddImported(h.image_bytes);
    return id;
  }
  absl::Status st = absl::OkStatus();
  auto run = [&](absl::Status x) {
    if (st.ok()) st = x;
  };
  if (any_adopt || requantize) {
    run(internal::CudaStatus(cudaMemcpyAsync(d_import, in + h.scales_offset,
                                             24 * static_cast<size_t>(L), cudaMemcpyDefault, cs),
                             "cudaMemcpyAsync(image scales)"));
  }
  if (any_adopt && st.ok()) {
    run(internal::CudaStatus(
        cudaMemcpyAsync(d_mask, adopt.data(), adopt.size(), cudaMemcpyHostToDevice, cs),
        "cudaMemcpyAsync(adopt mask)"));
    if (st.ok()) run(internal::LaunchAdoptScales(ap, stream));
  }
  if (n > 0 && st.ok()) {
    // Reserved pages a promotion may still be writing: its copy goes first.
    run(s.OrderAfterPromotion(q.pages, stream));
    if (st.ok()) {
      run(internal::CudaStatus(cudaMemcpyAsync(ids, q.pages.data(), 4 * static_cast<size_t>(n),
                                               cudaMemcpyHostToDevice, cs),
                               "cudaMemcpyAsync(import page ids)"));
    }
    if (st.ok()) {
      if (host_image && kind == internal::MemKind::kPageable) {
        run(internal::PageableCopy(s, h, const_cast<uint8_t*>(in), q.pages, false, cs));
      } else {
        internal::PageCopyParams p = internal::ImageToPool(s, h, dev, ids, n);
        if (kind == internal::MemKind::kPinned) p.max_ctas = internal::kHostCopyCtas;
        run(internal::LaunchPageCopy(p, stream));
      }
    }
    if (requantize && st.ok()) run(internal::LaunchRequantizePages(rp, stream));
  }
  if (!st.ok()) {
    (void)ReleaseSequence(id);
    return absl::InternalError(absl::StrCat("CommitImport: ", st.message()));
  }
  s.images.AddImported(h.image_bytes);
  return id;
}

absl::StatusOr<SequenceId> KVCache::ImportSequence(const void* image, int64_t image_bytes,
                                                   const ImportOptions& options, Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(internal::CheckImagePointer(image, "image"));
  if (image_bytes < kSequenceImageHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("image_bytes: expected at least ",
                                                   kSequenceImageHeaderBytes, " (a header), got ",
                                                   image_bytes));
  }
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  internal::MemKind kind;
  const uint8_t* dev = nullptr;
  FP4KV_RETURN_IF_ERROR(internal::ClassifyMemory(s, image, "image", &kind, &dev));
  uint8_t header[kSequenceImageHeaderBytes];
  if (kind == internal::MemKind::kDevice) {
    const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(header, image, sizeof(header), cudaMemcpyDeviceToHost, cs));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cs));
  } else {
    std::memcpy(header, image, sizeof(header));
  }
  absl::StatusOr<SequenceImageHeader> h = ParseSequenceImageHeader(header, sizeof(header));
  if (!h.ok()) return h.status();
  if (image_bytes < h->image_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("image_bytes: expected at least ", h->image_bytes,
                     " (the header's image_bytes), got ", image_bytes));
  }
  absl::StatusOr<ImportReservation> r = ReserveImport(*h);
  if (!r.ok()) return r.status();
  return CommitImport(*std::move(r), image, image_bytes, options, stream);
}

}  // namespace fp4kv
