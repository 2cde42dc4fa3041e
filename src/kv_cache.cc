// KVCache: pools, page allocator, sequences and step buffers (see
// include/fp4kv/kv_cache.h for the contracts).
#include "fp4kv/kv_cache.h"

#include <cuda_runtime_api.h>
#include <xxhash.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fp4kv/calibrate.h"
#include "fp4kv/recipe.h"
#include "src/cuda_util.h"
#include "src/kv_event_queue.h"
#include "src/page_pool.h"
#include "src/params.h"
#include "src/prefix_hash.h"
#include "src/status_macros.h"
#include "src/validate.h"

namespace fp4kv {
namespace internal {
namespace {

constexpr int64_t kRegionAlign = 256;  // every pool region and step buffer
constexpr int64_t kHostAlign = 256;    // as cudaMalloc: regions stay 256-byte aligned
// Longest sequence of the default max_pages_per_seq (KVCacheOptions).
constexpr int64_t kDefaultMaxSeqTokens = 32768;
// CTAs of a page copy to or from host memory (PCIe-bound; see PageCopyParams).
constexpr int kHostCopyCtas = 512;

int64_t RoundUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Where one kind of bytes lives in a layer of the pool.
struct Region {
  int64_t offset = 0;      // bytes from the start of the layer
  int64_t page_bytes = 0;  // bytes of one page of this kind
};

// Byte layout of the pools: layer l's region r is at l * layer_bytes +
// regions[r].offset, pages contiguous inside it ([P, ...] row-major).
struct PoolLayout {
  Region regions[4];  // K data, V data, K scales, V scales
  int64_t layer_bytes = 0;
  int64_t total_bytes = 0;
};

// False when a size does not fit in int64 (nothing that large can be
// allocated anyway).
bool ComputePoolLayout(const CacheGeometry& g, int num_layers, PoolLayout* out) {
  int64_t rows = 0;
  if (__builtin_mul_overflow(static_cast<int64_t>(g.page_size), int64_t{g.num_kv_heads}, &rows)) {
    return false;
  }
  const int64_t row_bytes[4] = {g.DataRowBytes(false), g.DataRowBytes(true),
                                g.ScaleRowBytes(false), g.ScaleRowBytes(true)};
  PoolLayout l;
  int64_t off = 0;
  for (int r = 0; r < 4; ++r) {
    int64_t page = 0, region = 0;
    if (__builtin_mul_overflow(rows, row_bytes[r], &page) ||
        __builtin_mul_overflow(page, g.num_pages, &region) || region > INT64_MAX - kRegionAlign) {
      return false;
    }
    l.regions[r] = Region{off, page};
    if (__builtin_add_overflow(off, RoundUp(region, kRegionAlign), &off)) return false;
  }
  l.layer_bytes = off;
  if (__builtin_mul_overflow(off, int64_t{num_layers}, &l.total_bytes)) return false;
  *out = l;
  return true;
}

// Byte offsets of the step buffers. The staging (host) copy holds
// [0, staging_bytes); the device copy also holds the FP8 block tables (written
// by the materializer) and the scales.
struct StepLayout {
  int64_t seq_lens = 0, kv_indptr = 0, token_indptr = 0, slots = 0, tables = 0;
  int64_t staging_bytes = 0;
  int64_t fp8_tables = 0, scales = 0;
  // Scale state: calibrated flags [L, 2] i32, calibration scratch [L, 4] u32,
  // scale-event counters [L, 4] u64, old scales of a re-encode [L, 2] f32.
  int64_t flags = 0, calib = 0, events = 0, old_scales = 0;
  // ReadSequence's block table [max_pages_per_seq] i32 and length [1] i32.
  int64_t readback = 0;
  // Page ids of an export or import [max_pages_per_seq] i32 (the caller's
  // stream), of a swap [2, max_pages_per_seq] i32 (the copy stream), and an
  // image's scale table [L, 4] f32 + [L, 2] i32.
  int64_t xfer_ids = 0, swap_ids = 0, import_scales = 0, adopt_mask = 0;  // mask [L, 2] u8
  int64_t device_bytes = 0;
};

StepLayout ComputeStepLayout(int64_t seqs, int64_t tokens, int64_t pages_per_seq, int layers) {
  StepLayout s;
  s.seq_lens = 0;
  s.kv_indptr = s.seq_lens + 4 * seqs;
  s.token_indptr = s.kv_indptr + 4 * (seqs + 1);
  s.slots = RoundUp(s.token_indptr + 4 * (seqs + 1), 16);
  s.tables = RoundUp(s.slots + 8 * tokens, kRegionAlign);
  s.staging_bytes = s.tables + 4 * seqs * pages_per_seq;
  s.fp8_tables = RoundUp(s.staging_bytes, kRegionAlign);
  s.scales = RoundUp(s.fp8_tables + 4 * seqs * pages_per_seq, kRegionAlign);
  const int64_t L = layers;
  s.flags = RoundUp(s.scales + 4 * 4 * L, 16);
  s.calib = RoundUp(s.flags + 4 * 2 * L, 16);
  s.events = RoundUp(s.calib + 4 * 4 * L, 16);
  s.old_scales = RoundUp(s.events + 8 * 4 * L, 16);
  s.readback = RoundUp(s.old_scales + 4 * 2 * L, 16);
  s.xfer_ids = RoundUp(s.readback + 4 * (pages_per_seq + 1), 16);
  s.swap_ids = RoundUp(s.xfer_ids + 4 * pages_per_seq, 16);
  s.import_scales = RoundUp(s.swap_ids + 4 * 2 * pages_per_seq, 16);
  s.adopt_mask = RoundUp(s.import_scales + 24 * L, 16);
  s.device_bytes = s.adopt_mask + 2 * L;
  return s;
}

// One owned allocation: host (256-byte aligned), pinned host, or device.
class Memory {
 public:
  enum class Kind { kNone, kHost, kPinned, kPinnedMapped, kDevice };

  Memory() = default;
  ~Memory() { Reset(); }
  Memory(Memory&& o) noexcept : kind_(o.kind_), ptr_(o.ptr_) {
    o.kind_ = Kind::kNone;
    o.ptr_ = nullptr;
  }
  Memory& operator=(Memory&& o) noexcept {
    if (this != &o) {
      Reset();
      kind_ = o.kind_;
      ptr_ = o.ptr_;
      o.kind_ = Kind::kNone;
      o.ptr_ = nullptr;
    }
    return *this;
  }
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  // Allocates and zeroes `bytes` (> 0). Device memory goes on the current
  // CUDA device.
  absl::Status Allocate(Kind kind, int64_t bytes, const char* what) {
    Reset();
    void* p = nullptr;
    const size_t n = static_cast<size_t>(RoundUp(bytes, kHostAlign));
    cudaError_t err = cudaSuccess;
    switch (kind) {
      case Kind::kHost:
        p = std::aligned_alloc(kHostAlign, n);
        if (p != nullptr) std::memset(p, 0, n);
        break;
      case Kind::kPinned:
      case Kind::kPinnedMapped:
        err = cudaHostAlloc(&p, n,
                            kind == Kind::kPinned ? cudaHostAllocDefault : cudaHostAllocMapped);
        if (err == cudaSuccess) std::memset(p, 0, n);
        break;
      case Kind::kDevice:
        err = cudaMalloc(&p, n);
        if (err == cudaSuccess) {
          err = cudaMemset(p, 0, n);
          if (err != cudaSuccess) {
            (void)cudaFree(p);
            return CudaStatus(err, "cudaMemset");
          }
        }
        break;
      case Kind::kNone:
        break;
    }
    if (err != cudaSuccess) (void)cudaGetLastError();
    if (p == nullptr || err != cudaSuccess) {
      return absl::ResourceExhaustedError(
          absl::StrCat("KVCache::Create: cannot allocate ", bytes, " bytes for ", what,
                       err != cudaSuccess ? absl::StrCat(" (", cudaGetErrorName(err), ")") : ""));
    }
    kind_ = kind;
    ptr_ = static_cast<uint8_t*>(p);
    return absl::OkStatus();
  }

  uint8_t* get() const { return ptr_; }

 private:
  void Reset() {
    if (ptr_ == nullptr) return;
    switch (kind_) {
      case Kind::kHost:
        std::free(ptr_);
        break;
      case Kind::kPinned:
      case Kind::kPinnedMapped:
        (void)cudaFreeHost(ptr_);
        break;
      case Kind::kDevice:
        (void)cudaFree(ptr_);
        break;
      case Kind::kNone:
        break;
    }
    ptr_ = nullptr;
    kind_ = Kind::kNone;
  }

  Kind kind_ = Kind::kNone;
  uint8_t* ptr_ = nullptr;
};

// Makes `device` current for a scope (CUDA only) and restores the previous
// device at exit.
class ScopedDevice {
 public:
  ScopedDevice() = default;
  absl::Status Set(const Device& device) {
    if (!device.is_cuda()) return absl::OkStatus();
    FP4KV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous_));
    if (previous_ != device.ordinal) {
      FP4KV_CUDA_RETURN_IF_ERROR(cudaSetDevice(device.ordinal));
      changed_ = true;
    }
    return absl::OkStatus();
  }
  ~ScopedDevice() {
    if (changed_) (void)cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

absl::Status CheckScale(float v, const char* name, int layer) {
  if (!IsValidGlobalScale(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "[", layer, "]: expected a global scale in (0, ", MaxGlobalScale(),
                     "] (positive, with 6 * 448 * g finite), got ", v));
  }
  return absl::OkStatus();
}

// The most pages (at most INT32_MAX; 0 if not even one) of geometry g whose
// pools for num_layers layers fit in budget bytes, with their layout.
int64_t MostPagesWithin(const CacheGeometry& g, int num_layers, int64_t budget,
                        internal::PoolLayout* layout) {
  int64_t per_page = 0;
  if (__builtin_mul_overflow(g.PageBytes(), int64_t{num_layers}, &per_page)) per_page = INT64_MAX;
  int64_t p = std::min<int64_t>(budget / per_page, INT32_MAX);
  for (; p >= 1; --p) {
    CacheGeometry t = g;
    t.num_pages = p;
    if (internal::ComputePoolLayout(t, num_layers, layout) && layout->total_bytes <= budget) break;
  }
  return std::max<int64_t>(p, 0);
}

}  // namespace

class KVCacheState;

// What an ImportReservation handle points at: alive exactly as long as the
// cache state (handles hold weak references).
struct ReservationBook {
  KVCacheState* state = nullptr;
};

// The whole state of a KVCache; heap-allocated so that its address (held by
// the bound op objects) survives moves of the KVCache.
class KVCacheState {
 public:
  struct Sequence {
    SequenceId id = 0;  // of the live sequence in this slot
    bool live = false;
    int64_t length = 0;
    std::vector<int32_t> pages;  // ceil(length / page_size) entries
    // Bumped whenever an existing block-table entry changes or pages are
    // removed (copy on write, truncation); appends only push.
    uint64_t epoch = 0;
    uint64_t mark = 0;  // step stamp: duplicate detection
    TokenChain chain;   // page hashes (prefix caching)
    // Host tier: swapped out (pages empty once the copy is seen done;
    // host_pages holds ceil(length / page_size) host pages).
    bool swapped = false;
    std::vector<int32_t> host_pages;
    int swapin_event = -1;  // copy of a SwapIn not yet waited for by a stream
  };
  struct Reservation {
    SequenceImageHeader header;
    std::vector<int32_t> pages;
  };
  // What row b of the staging block tables holds: the first `count` pages of
  // sequence `seq` as of `epoch`.
  struct Row {
    SequenceId seq = 0;
    uint64_t epoch = 0;
    int32_t count = 0;
  };

  KVCacheState(int32_t num_pages, size_t max_events)
      : events(max_events), allocator(num_pages, &events) {}
  ~KVCacheState() {
    if (book != nullptr) book->state = nullptr;
    if (copy_stream != nullptr) {
      ScopedDevice d;
      (void)d.Set(options.device);
      (void)cudaStreamSynchronize(copy_stream);  // copies read the pools and the host tier
      for (cudaEvent_t e : swap_events) (void)cudaEventDestroy(e);
      if (copy_ready != nullptr) (void)cudaEventDestroy(copy_ready);
      if (copy_drained != nullptr) (void)cudaEventDestroy(copy_drained);
      (void)cudaStreamDestroy(copy_stream);
    }
    if (upload_done != nullptr) {
      ScopedDevice d;
      (void)d.Set(options.device);
      // The pinned staging must outlive the last upload that reads it.
      if (upload_pending) (void)cudaEventSynchronize(upload_done);
      (void)cudaEventDestroy(upload_done);
    }
  }

  absl::Status CheckLayer(int layer) const {
    if (layer < 0 || layer >= options.num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer: expected in [0, ", options.num_layers, "), got ", layer));
    }
    return absl::OkStatus();
  }

  Sequence* Find(SequenceId id) {
    auto it = slot_of.find(id);
    if (it == slot_of.end()) return nullptr;
    Sequence& s = seqs[it->second];
    return s.live && s.id == id ? &s : nullptr;
  }
  const Sequence* Find(SequenceId id) const { return const_cast<KVCacheState*>(this)->Find(id); }
  static absl::Status Unknown(const char* name, SequenceId id) {
    return absl::NotFoundError(
        absl::StrCat(name, ": unknown sequence id ", id, " (never created or already released)"));
  }
  // The live sequence `id` whose pages are on the device: NotFound naming
  // `name` when unknown, FailedPrecondition naming `call` when swapped out.
  absl::StatusOr<Sequence*> FindResident(SequenceId id, const char* call,
                                         const char* name = "seq") {
    Sequence* q = Find(id);
    if (q == nullptr) return Unknown(name, id);
    if (q->swapped) {
      return absl::FailedPreconditionError(absl::StrCat(
          call, ": sequence ", id, " is swapped out to the host tier (SwapIn it first)"));
    }
    return q;
  }
  absl::StatusOr<const Sequence*> FindResident(SequenceId id, const char* call,
                                               const char* name = "seq") const {
    absl::StatusOr<Sequence*> q = const_cast<KVCacheState*>(this)->FindResident(id, call, name);
    if (!q.ok()) return q.status();
    return *q;
  }

  PagedCache LayerCache(int layer) const {
    const CacheGeometry& g = geometry;
    uint8_t* base = pools.get() + layer * pool.layer_bytes;
    const bool nhd = g.layout == Layout::kNHD;
    const int64_t a = nhd ? g.page_size : g.num_kv_heads;
    const int64_t b = nhd ? g.num_kv_heads : g.page_size;
    auto view = [&](int r, DType t, int64_t inner) {
      return TensorView::Contiguous(base + pool.regions[r].offset, t, {g.num_pages, a, b, inner},
                                    options.device);
    };
    if (g.fp8_keys()) {
      return PagedCache::Fp8Keys(view(0, DType::kE4M3, g.head_dim_k),
                                 view(1, DType::kU8, g.head_dim_v / 2),
                                 view(3, DType::kE4M3, g.head_dim_v / kBlockSize), g.layout);
    }
    return PagedCache::FromTuple(view(0, DType::kU8, g.head_dim_k / 2),
                                 view(1, DType::kU8, g.head_dim_v / 2),
                                 view(2, DType::kE4M3, g.head_dim_k / kBlockSize),
                                 view(3, DType::kE4M3, g.head_dim_v / kBlockSize), g.layout);
  }

  // Copies page `src` to page `dst` in every layer, K and V, data and scales:
  // on `stream` for CUDA, now for the CPU.
  absl::Status CopyPage(int32_t src, int32_t dst, Stream stream) {
    for (const Region& r : pool.regions) {
      if (r.page_bytes == 0) continue;  // no key scales (FP8 keys)
      uint8_t* from = pools.get() + r.offset + src * r.page_bytes;
      uint8_t* to = pools.get() + r.offset + dst * r.page_bytes;
      if (!cuda) {
        for (int l = 0; l < options.num_layers; ++l) {
          std::memcpy(to + l * pool.layer_bytes, from + l * pool.layer_bytes, r.page_bytes);
        }
      } else if (pool.layer_bytes <= INT32_MAX) {
        FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
            to, pool.layer_bytes, from, pool.layer_bytes, r.page_bytes, options.num_layers,
            cudaMemcpyDeviceToDevice, reinterpret_cast<cudaStream_t>(stream)));
      } else {  // pitch beyond what a 2-D copy accepts
        for (int l = 0; l < options.num_layers; ++l) {
          FP4KV_CUDA_RETURN_IF_ERROR(
              cudaMemcpyAsync(to + l * pool.layer_bytes, from + l * pool.layer_bytes, r.page_bytes,
                              cudaMemcpyDeviceToDevice, reinterpret_cast<cudaStream_t>(stream)));
        }
      }
    }
    return absl::OkStatus();
  }

  // Token slots holding data (shared pages counted once); see Stats().
  int64_t TokensResident() const {
    const int ps = geometry.page_size;
    struct Partial {
      int32_t owners = 0;
      int64_t fill = 0;
    };
    std::unordered_map<int32_t, Partial> partial;
    for (const Sequence& q : seqs) {
      if (!q.live || q.length % ps == 0 || q.pages.empty()) continue;
      Partial& p = partial[q.pages.back()];
      ++p.owners;
      p.fill = std::max<int64_t>(p.fill, q.length % ps);
    }
    int64_t n =
        (allocator.used_count() - reserved_pages - static_cast<int64_t>(partial.size())) * ps;
    for (const auto& [page, p] : partial) n += p.owners < allocator.RefCount(page) ? ps : p.fill;
    return n;
  }

  // Tokens whose bytes in `layer` were written (or enqueued) under its
  // current scales: the resident ones, less the current step's new tokens
  // while this layer's appender has not run for the step (and never ran in
  // a capture, whose replays the host cannot see).
  int64_t TokensHeld(int layer) const {
    int64_t n = TokensResident();
    if (layer_append_serial[layer] != step_serial && !layer_captured[layer]) n -= step.num_tokens;
    return n < 0 ? 0 : n;
  }

  // True while the host has not seen both of the layer's scales calibrated.
  bool LayerPending(int layer) const {
    const volatile int32_t* f = h_flags + 2 * layer;
    return f[0] == 0 || f[1] == 0;
  }

  absl::Status CheckScaleChange(int layer, StoredTokens stored, bool* reencode) const {
    SequenceId swapped = 0;
    if (const int64_t t = SwappedTokens(&swapped); t > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer ", layer, ": sequence ", swapped, " (and ", t,
          " swapped-out tokens in all) is swapped out to the host tier under the current "
          "scales, which a scale change cannot re-encode there (SwapIn or release it first); "
          "nothing changed"));
    }
    const int64_t held = TokensHeld(layer);
    *reencode = held > 0;
    if (held > 0 && stored != StoredTokens::kReencode) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer ", layer, ": holds ", held,
          " tokens quantized under its current global scales; changing the scales would "
          "silently re-scale them (pass StoredTokens::kReencode to requantize the stored pages, "
          "or change scales before storing tokens); nothing changed"));
    }
    return absl::OkStatus();
  }

  // Enqueues a copy of the layer's current K and V global scales into
  // d_old_scales (the source of a re-encode).
  absl::Status SaveOldScales(int layer, Stream stream) {
    if (!cuda) {
      std::memcpy(d_old_scales + 2 * layer, d_scales + 4 * layer, 2 * sizeof(float));
      return absl::OkStatus();
    }
    return CudaStatus(cudaMemcpyAsync(d_old_scales + 2 * layer, d_scales + 4 * layer,
                                      2 * sizeof(float), cudaMemcpyDeviceToDevice,
                                      reinterpret_cast<cudaStream_t>(stream)),
                      "cudaMemcpyAsync(old scales)");
  }

  // Requantizes every block of the layer's K and V pools from d_old_scales
  // to d_scales.
  absl::Status Reencode(int layer, Stream stream) const {
    uint8_t* base = pools.get() + layer * pool.layer_bytes;
    for (int kv = 0; kv < 2; ++kv) {
      ReencodeParams p;
      p.data = base + pool.regions[kv].offset;
      if (kv == 0 && geometry.fp8_keys()) {  // 16 FP8 key bytes a "block"
        p.fp8_keys = true;
        p.blocks = pool.regions[0].page_bytes * geometry.num_pages / kBlockSize;
      } else {
        p.scales = base + pool.regions[2 + kv].offset;
        p.blocks = pool.regions[2 + kv].page_bytes * geometry.num_pages;  // one scale byte a block
      }
      p.old_scale = d_old_scales + 2 * layer + kv;
      p.new_scale = d_scales + 4 * layer + kv;
      p.recipe = options.recipe;
      if (!cuda) {
        ReferenceReencode(p);
      } else {
        FP4KV_RETURN_IF_ERROR(LaunchReencode(p, stream));
      }
    }
    return absl::OkStatus();
  }

  // Marks layers [first, first + count) calibrated on the device (enqueued
  // on `stream`) and in the host mirror.
  absl::Status MarkCalibrated(int first, int count, Stream stream) {
    std::vector<int32_t> ones(2 * static_cast<size_t>(count), 1);
    if (cuda) {
      FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_flags + 2 * first, ones.data(),
                                                 ones.size() * sizeof(int32_t),
                                                 cudaMemcpyHostToDevice,
                                                 reinterpret_cast<cudaStream_t>(stream)));
    }
    for (size_t i = 0; i < ones.size(); ++i) h_flags[2 * first + i] = 1;
    return absl::OkStatus();
  }

  KVCacheOptions options;
  CacheGeometry geometry;
  PoolLayout pool;
  StepLayout step_layout;
  bool cuda = false;
  Memory pools;
  Memory device_step;  // CPU: also the staging
  Memory staging;      // CUDA only (pinned)
  cudaEvent_t upload_done = nullptr;
  bool upload_pending = false;

  // Staging (host) pointers.
  int32_t* h_seq_lens = nullptr;
  int32_t* h_kv_indptr = nullptr;
  int32_t* h_token_indptr = nullptr;
  int64_t* h_slots = nullptr;
  int32_t* h_tables = nullptr;
  // Device pointers.
  uint8_t* d_step = nullptr;
  float* d_scales = nullptr;       // [L, 4]: K global, V global, K fp8, V fp8
  int32_t* d_flags = nullptr;      // [L, 2]: K, V calibrated
  uint32_t* d_calib = nullptr;     // [L, 4]: calibration scratch (zero between launches)
  uint64_t* d_events = nullptr;    // [L, 4]: scale-event counters
  float* d_old_scales = nullptr;   // [L, 2]: scales before a re-encode
  Memory mapped_flags;             // CUDA: [L, 2] host-visible mirror of d_flags
  int32_t* h_flags = nullptr;      // the mirror (CPU: d_flags itself)
  int32_t* h_flags_dev = nullptr;  // its device address (CUDA), for the kernel

  // Scale-change bookkeeping (see KVCache::LayerTokens). Mutable: the bound
  // appender records its launches.
  uint64_t step_serial = 0;                             // committed PrepareSteps
  mutable std::vector<uint64_t> layer_append_serial;    // [L] step of the last append
  mutable std::vector<uint8_t> layer_captured;          // [L] an append was captured

  StepViews views;
  StepInfo step;
  KVEventQueue events;
  PagePool allocator;
  std::vector<Sequence> seqs;
  std::vector<uint32_t> free_slots;
  // Ids count up from 1 and are never reused; slot_of maps a live id to its
  // slot in seqs.
  SequenceId next_id = 1;
  std::unordered_map<SequenceId, uint32_t> slot_of;
  int64_t live_sequences = 0;
  std::vector<Row> rows;
  int64_t slot_extent = 0;  // staging slots [0, slot_extent) may be >= 0
  int rows_used = 0;
  uint64_t stamp = 0;
  // PrepareStep scratch (sized once).
  std::vector<int32_t> claim;        // [num_pages]
  std::vector<Sequence*> step_seqs;  // [max_seqs_per_step]
  std::vector<int32_t> cow_src;      // pages to copy, in entry order
  std::vector<int> cow_entry;        // entry index of each copy
  std::vector<int32_t> cow_dst;

  // Prefix caching (options.prefix_cache).
  bool prefix = false;
  bool all_calibrated = false;  // sticky: a layer never goes back to pending
  int64_t prefix_queries = 0, prefix_query_tokens = 0, prefix_hit_tokens = 0;
  mutable std::vector<uint8_t> hash_scratch;
  mutable std::vector<BlockHash> match_hashes;
  mutable std::vector<int32_t> match_pages;
  // Token id of every slot (page * page_size + entry) written by a tracked
  // sequence: a page's ids travel with it (forks, matches, truncations).
  std::vector<int32_t> page_tokens;
  std::vector<uint32_t> unhashed;  // sequence slots with completed, unhashed pages

  // Export and import.
  std::shared_ptr<ReservationBook> book;
  std::unordered_map<uint64_t, Reservation> reservations;
  uint64_t next_reservation = 1;
  int64_t reserved_pages = 0;
  mutable int64_t bytes_exported = 0;
  int64_t bytes_imported = 0;
  // Scales the host knows ([L, 4] as d_scales; known[l]: given at Create or
  // by UpdateGlobalScales, not computed on the device since).
  std::vector<float> known_scales;
  std::vector<uint8_t> known;

  // Host tier (options.host_tier): pinned host pages laid out like the
  // pools ([L][K data, V data, K scales, V scales][host pages]).
  int64_t host_pages_total = 0;
  PoolLayout host_layout;
  Memory host_pool;
  uint8_t* host_pool_dev = nullptr;  // its device address (CUDA) or itself
  std::vector<int32_t> host_free;    // stack of free host pages
  cudaStream_t copy_stream = nullptr;
  cudaEvent_t copy_ready = nullptr;  // recorded on the caller's stream, waited by the copy stream
  cudaEvent_t copy_drained = nullptr;  // recorded on the copy stream, waited by the caller's
  std::vector<cudaEvent_t> swap_events;
  std::vector<int> free_events;
  std::vector<int> event_refs;  // sequences waiting on a SwapIn event
  // SwapOut copies in flight, in copy-stream order. seq 0: the sequence was
  // swapped back in (keeping its pages) or released (orphan: its pages,
  // dropped when the copy is done).
  struct SwapOutCopy {
    int event = -1;
    SequenceId seq = 0;
    std::vector<int32_t> orphan;
  };
  std::vector<SwapOutCopy> outs;
  int64_t bytes_swapped_out = 0, bytes_swapped_in = 0;

  int64_t PageBytesAllLayers() const { return geometry.PageBytes() * options.num_layers; }

  PageCopyParams HostCopy(const int32_t* src, const int32_t* dst, int64_t n, bool to_host) const {
    PageCopyParams p;
    const PoolLayout& a = to_host ? pool : host_layout;
    const PoolLayout& b = to_host ? host_layout : pool;
    p.src = to_host ? pools.get() : host_pool_dev;
    p.dst = to_host ? host_pool_dev : pools.get();
    p.src_layer_stride = a.layer_bytes;
    p.dst_layer_stride = b.layer_bytes;
    for (int r = 0; r < 4; ++r) {
      p.src_region[r] = a.regions[r].offset;
      p.dst_region[r] = b.regions[r].offset;
      p.page_bytes[r] = pool.regions[r].page_bytes;
    }
    p.src_ids = src;
    p.dst_ids = dst;
    p.num_pages = n;
    p.num_layers = options.num_layers;
    p.max_ctas = kHostCopyCtas;
    return p;
  }
  PageCopyParams PoolToHost(const int32_t* pages, const int32_t* host, int64_t n) const {
    return HostCopy(pages, host, n, true);
  }
  PageCopyParams HostToPool(const int32_t* host, const int32_t* pages, int64_t n) const {
    return HostCopy(host, pages, n, false);
  }

  absl::Status TakeEvent(int* out) {
    if (free_events.empty()) {
      cudaEvent_t e = nullptr;
      FP4KV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      swap_events.push_back(e);
      event_refs.push_back(0);
      free_events.push_back(static_cast<int>(swap_events.size()) - 1);
    }
    *out = free_events.back();
    free_events.pop_back();
    return absl::OkStatus();
  }

  // Copies pages between the pool and the host tier on the copy stream,
  // after the work on `stream` so far; *event is recorded after the copy.
  absl::Status EnqueueSwapCopy(const std::vector<int32_t>& pages,
                               const std::vector<int32_t>& host, bool to_host, Stream stream,
                               int* event) {
    int e = -1;
    FP4KV_RETURN_IF_ERROR(TakeEvent(&e));
    absl::Status st = [&]() -> absl::Status {
      const int64_t n = static_cast<int64_t>(pages.size());
      FP4KV_CUDA_RETURN_IF_ERROR(
          cudaEventRecord(copy_ready, reinterpret_cast<cudaStream_t>(stream)));
      FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_stream, copy_ready, 0));
      const int M = options.max_pages_per_seq;
      int32_t* d_ids = reinterpret_cast<int32_t*>(d_step + step_layout.swap_ids);
      std::vector<int32_t> ids(2 * static_cast<size_t>(M));
      std::copy(pages.begin(), pages.end(), ids.begin());
      std::copy(host.begin(), host.end(), ids.begin() + M);
      // From pageable memory: staged before the call returns.
      FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_ids, ids.data(), ids.size() * sizeof(int32_t),
                                                 cudaMemcpyHostToDevice, copy_stream));
      const Stream side = reinterpret_cast<Stream>(copy_stream);
      FP4KV_RETURN_IF_ERROR(LaunchPageCopy(
          to_host ? PoolToHost(d_ids, d_ids + M, n) : HostToPool(d_ids + M, d_ids, n), side));
      FP4KV_CUDA_RETURN_IF_ERROR(cudaEventRecord(swap_events[e], copy_stream));
      return absl::OkStatus();
    }();
    if (!st.ok()) {
      free_events.push_back(e);
      return st;
    }
    *event = e;
    return absl::OkStatus();
  }

  // Drops the sequence's device page references.
  void ReleasePages(Sequence& q) {
    for (size_t j = q.pages.size(); j-- > 0;) allocator.Release(q.pages[j]);
    q.pages.clear();
    ++q.epoch;
  }

  void FinishOut(SwapOutCopy& c) {
    if (c.seq != 0) {
      Sequence* q = Find(c.seq);
      if (q != nullptr && q->swapped) ReleasePages(*q);
    }
    for (size_t j = c.orphan.size(); j-- > 0;) allocator.Release(c.orphan[j]);
    c.orphan.clear();
    free_events.push_back(c.event);
  }

  // Drops the device pages of the SwapOut copies that are done (event
  // queries, no sync).
  void PollSwaps() {
    size_t k = 0;
    while (k < outs.size()) {
      const cudaError_t e = cudaEventQuery(swap_events[outs[k].event]);
      if (e == cudaErrorNotReady) break;
      if (e != cudaSuccess) (void)cudaGetLastError();
      FinishOut(outs[k]);
      ++k;
    }
    if (k > 0) outs.erase(outs.begin(), outs.begin() + static_cast<std::ptrdiff_t>(k));
  }

  absl::Status WaitSwapOuts() {
    if (outs.empty()) return absl::OkStatus();
    ScopedDevice d;
    FP4KV_RETURN_IF_ERROR(d.Set(options.device));
    for (SwapOutCopy& c : outs) {
      FP4KV_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(swap_events[c.event]));
    }
    for (SwapOutCopy& c : outs) FinishOut(c);
    outs.clear();
    return absl::OkStatus();
  }

  // The device pages unfinished SwapOut copies will release that become
  // free (*to_free) or cached (*to_cached, indexed): those held only there.
  void PendingReleases(int64_t* to_free, int64_t* to_cached) const {
    *to_free = *to_cached = 0;
    auto count = [&](const std::vector<int32_t>& pages) {
      for (int32_t page : pages) {
        if (allocator.RefCount(page) != 1) continue;
        ++*(allocator.Indexed(page) ? to_cached : to_free);
      }
    };
    for (const SwapOutCopy& c : outs) {
      count(c.orphan);
      if (c.seq != 0) {
        const Sequence* q = Find(c.seq);
        if (q != nullptr && q->swapped) count(q->pages);
      }
    }
  }

  int64_t PagesSwapPending() const {
    int64_t n = 0;
    for (const SwapOutCopy& c : outs) {
      n += static_cast<int64_t>(c.orphan.size());
      if (c.seq != 0) {
        const Sequence* q = Find(c.seq);
        if (q != nullptr && q->swapped) n += static_cast<int64_t>(q->pages.size());
      }
    }
    return n;
  }

  void DropSwapIn(Sequence& q) {
    if (q.swapin_event < 0) return;
    if (--event_refs[q.swapin_event] == 0) free_events.push_back(q.swapin_event);
    q.swapin_event = -1;
  }

  // Makes `stream` wait for everything enqueued on the copy stream so far
  // (before a kernel that rewrites the whole pool: a re-encode).
  absl::Status OrderAfterCopies(Stream stream) {
    if (copy_stream == nullptr) return absl::OkStatus();
    FP4KV_CUDA_RETURN_IF_ERROR(cudaEventRecord(copy_drained, copy_stream));
    return CudaStatus(
        cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), copy_drained, 0),
        "cudaStreamWaitEvent(copy stream)");
  }

  // Makes `stream` wait for the SwapIn copy that filled q's pages, if any.
  absl::Status OrderAfterSwapIn(const Sequence& q, Stream stream) const {
    if (q.swapin_event < 0) return absl::OkStatus();
    return CudaStatus(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream),
                                          swap_events[q.swapin_event], 0),
                      "cudaStreamWaitEvent(swap in)");
  }

  // Tokens of swapped-out sequences, and one of them.
  int64_t SwappedTokens(SequenceId* any = nullptr) const {
    int64_t n = 0;
    for (const Sequence& q : seqs) {
      if (q.live && q.swapped && q.length > 0) {
        n += q.length;
        if (any != nullptr) *any = q.id;
      }
    }
    return n;
  }

  // Frees pages held by finished SwapOut copies, waits for unfinished ones
  // when they are needed; ResourceExhausted when n pages are not there.
  absl::Status MakeAvailable(int64_t n, const char* what) {
    PollSwaps();
    if (n > allocator.available_count() && !outs.empty()) {
      FP4KV_RETURN_IF_ERROR(WaitSwapOuts());
    }
    if (n > allocator.available_count()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": needs ", n, " free pages, the pool has ", allocator.free_count(), " free and ",
          allocator.cached_count(), " evictable cached of ", allocator.num_pages(),
          "; nothing changed"));
    }
    return absl::OkStatus();
  }

  // XXH3-64 of every layer's scales when the host knows them all.
  bool ScaleFingerprint(uint64_t* out) const {
    for (uint8_t k : known) {
      if (k == 0) return false;
    }
    *out = XXH3_64bits(known_scales.data(), known_scales.size() * sizeof(float));
    return true;
  }

  // True once the host has seen every layer's scales calibrated: only then
  // are pages indexed (bytes written under a pending layer's placeholder
  // scale must not be shared).
  bool Calibrated() {
    if (all_calibrated) return true;
    for (int l = 0; l < options.num_layers; ++l) {
      if (LayerPending(l)) return false;
    }
    all_calibrated = true;
    return true;
  }

  // The longest indexed prefix of `prompt` in whole pages, leaving at least
  // one token: their hashes and pages (into the given vectors).
  void MatchPages(absl::Span<const int32_t> prompt, absl::string_view key,
                  std::vector<BlockHash>* hashes, std::vector<int32_t>* pages) const {
    hashes->clear();
    pages->clear();
    if (!prefix || prompt.empty()) return;
    const int ps = geometry.page_size;
    const int64_t max_pages = std::min<int64_t>(static_cast<int64_t>(prompt.size() - 1) / ps,
                                                options.max_pages_per_seq);
    for (int64_t i = 0; i < max_pages; ++i) {
      const BlockHash h = HashPage(hashes->empty() ? nullptr : &hashes->back(),
                                   prompt.subspan(static_cast<size_t>(i) * ps, ps), key,
                                   &hash_scratch);
      const int32_t page = allocator.Lookup(h);
      if (page < 0) break;
      hashes->push_back(h);
      pages->push_back(page);
    }
  }

  // After a committed append of entry `e` to `q` (its slots at h_slots[tok0
  // ..]): records the token ids with the pages and queues the sequence when
  // pages were completed (FlushIndex hashes and indexes them).
  void CommitTokens(Sequence& q, const StepEntry& e, int64_t tok0) {
    TokenChain& c = q.chain;
    if (!c.tracked || e.num_new_tokens == 0) return;
    if (e.token_ids.empty()) {
      if (c.queued) {  // pages completed while tracked (before this append) are still indexed
        const int64_t len = q.length;
        q.length -= e.num_new_tokens;
        FlushIndex();
        q.length = len;
      }
      c.Untrack();
      return;
    }
    for (int32_t k = 0; k < e.num_new_tokens; ++k) page_tokens[h_slots[tok0 + k]] = e.token_ids[k];
    const int64_t ps = geometry.page_size;
    if (static_cast<int64_t>(c.hashes.size() + 1) * ps > q.length) return;  // no page completed
    const size_t full = static_cast<size_t>(q.length / ps);
    if (!Calibrated()) c.index_from = full;  // written under a pending layer's placeholder
    if (!c.queued) {
      c.queued = true;
      unhashed.push_back(static_cast<uint32_t>(&q - seqs.data()));
    }
  }

  // Hashes the completed pages of the queued sequences and indexes them (one
  // kBlockStored event per run of consecutive newly indexed pages). Called
  // before anything reads the index or frees pages, so the index is as if
  // PrepareStep had done it.
  void FlushIndex() {
    const int ps = geometry.page_size;
    for (uint32_t slot : unhashed) {
      Sequence& q = seqs[slot];
      TokenChain& c = q.chain;
      if (!c.queued) continue;
      c.queued = false;
      if (!q.live || !c.tracked) continue;
      const size_t first = c.hashes.size();
      const size_t full = static_cast<size_t>(q.length / ps);
      for (size_t j = first; j < full; ++j) {
        c.hashes.push_back(HashPage(j == 0 ? nullptr : &c.hashes[j - 1], PageTokens(q.pages[j]),
                                    c.extra_key, &hash_scratch));
      }
      size_t run = full;  // start of the current run of indexed pages; full: none
      for (size_t j = std::max(first, c.index_from); j <= full; ++j) {
        if (j < full && allocator.Register(q.pages[j], c.hashes[j])) {
          if (run == full) run = j;
          continue;
        }
        for (size_t k = run; k < j; ++k) {
          events.Stored(c.hashes[k], k > 0 ? &c.hashes[k - 1] : nullptr, PageTokens(q.pages[k]),
                        ps, c.extra_key, /*continues=*/k > run);
        }
        run = full;
      }
    }
    unhashed.clear();
  }

  // The token ids recorded for a page (page_size of them).
  absl::Span<const int32_t> PageTokens(int32_t page) const {
    const int ps = geometry.page_size;
    return absl::Span<const int32_t>(page_tokens.data() + static_cast<int64_t>(page) * ps, ps);
  }

  void ClearPrefixIndex() {
    if (!prefix) return;
    FlushIndex();  // their hashes are still needed; their index entries go now
    allocator.ClearIndex();
  }
};

// Undoes the copy-on-write claims of a step check on every exit.
struct ClaimReset {
  KVCacheState& s;
  ~ClaimReset() {
    for (int32_t p : s.cow_src) s.claim[p] = 0;
  }
};

// Pass 1 of a step: checks the entries and counts the pages they need
// (copies included); changes nothing but scratch (marks, claims, cow_src,
// cow_entry, step_seqs). The caller holds a ClaimReset.
absl::Status CheckStepEntries(KVCacheState& s, absl::Span<const StepEntry> entries,
                              int64_t* need_out) {
  const int S = s.options.max_seqs_per_step;
  const int M = s.options.max_pages_per_seq;
  const int ps = s.geometry.page_size;
  const int64_t max_len = static_cast<int64_t>(M) * ps;
  if (entries.size() > static_cast<size_t>(S)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "entries: expected at most max_seqs_per_step = ", S, " entries, got ", entries.size()));
  }
  const int n = static_cast<int>(entries.size());
  const uint64_t stamp = ++s.stamp;
  s.cow_src.clear();
  s.cow_entry.clear();
  int64_t tokens = 0;
  int64_t need = 0;
  for (int i = 0; i < n; ++i) {
    const StepEntry& e = entries[i];
    if (e.num_new_tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("entries[", i, "].num_new_tokens: expected >= 0, got ", e.num_new_tokens));
    }
    if (!e.token_ids.empty() && e.token_ids.size() != static_cast<size_t>(e.num_new_tokens)) {
      return absl::InvalidArgumentError(
          absl::StrCat("entries[", i, "].token_ids: expected none or num_new_tokens = ",
                       e.num_new_tokens, " ids, got ", e.token_ids.size()));
    }
    KVCacheState::Sequence* q = s.Find(e.seq);
    if (q == nullptr) {
      return KVCacheState::Unknown(absl::StrCat("entries[", i, "].seq").c_str(), e.seq);
    }
    if (q->swapped) {
      return absl::FailedPreconditionError(
          absl::StrCat("entries[", i, "].seq: sequence ", e.seq,
                       " is swapped out to the host tier (SwapIn it first); nothing changed"));
    }
    if (q->mark == stamp) {
      return absl::InvalidArgumentError(absl::StrCat(
          "entries[", i, "].seq: expected each sequence at most once per step, got id ", e.seq,
          " again"));
    }
    q->mark = stamp;
    s.step_seqs[i] = q;
    tokens += e.num_new_tokens;
    const int64_t new_len = q->length + e.num_new_tokens;
    if (new_len > max_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("entries[", i, "].num_new_tokens: expected at most ", max_len - q->length,
                       " (max_pages_per_seq * page_size = ", max_len, " minus the length ",
                       q->length, " of sequence ", e.seq, "), got ", e.num_new_tokens));
    }
    need += CeilDiv(new_len, ps) - static_cast<int64_t>(q->pages.size());
    if (e.num_new_tokens > 0 && q->length % ps != 0) {
      const int32_t last = q->pages.back();
      if (s.allocator.RefCount(last) - s.claim[last] > 1) {  // still shared when we get to it
        ++s.claim[last];
        s.cow_src.push_back(last);
        s.cow_entry.push_back(i);
        ++need;
      }
    }
  }
  if (tokens > s.options.max_tokens_per_step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "entries: expected at most max_tokens_per_step = ", s.options.max_tokens_per_step,
        " new tokens in all, got ", tokens));
  }
  *need_out = need;
  return absl::OkStatus();
}

}  // namespace internal

using internal::CeilDiv;
using internal::KVCacheState;

// ------------------------------------------------------------------ Create
absl::StatusOr<KVCache> KVCache::Create(const KVCacheOptions& o) {
  if (o.num_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers: expected >= 1, got ", o.num_layers));
  }
  CacheGeometry g = o.geometry;
  if (g.num_pages < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.num_pages: expected >= 0 (0: from memory_budget_bytes), got ", g.num_pages));
  }
  if (o.memory_budget_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory_budget_bytes: expected >= 0, got ", o.memory_budget_bytes));
  }
  if ((g.num_pages > 0) == (o.memory_budget_bytes > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.num_pages, memory_budget_bytes: expected exactly one of them positive, got ",
        g.num_pages, " and ", o.memory_budget_bytes));
  }
  {
    CacheGeometry probe = g;
    probe.num_pages = 1;
    FP4KV_RETURN_IF_ERROR(probe.Validate());
  }
  internal::PoolLayout one_page;
  {
    CacheGeometry t = g;
    t.num_pages = 1;
    if (!internal::ComputePoolLayout(t, o.num_layers, &one_page)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "geometry: expected a page size in bytes (all layers) within int64, got page_size ",
          g.page_size, ", num_kv_heads ", g.num_kv_heads, ", head_dim_k ", g.head_dim_k,
          ", head_dim_v ", g.head_dim_v, " and ", o.num_layers, " layers"));
    }
  }
  if (g.num_pages == 0) {
    internal::PoolLayout unused;
    const int64_t p = MostPagesWithin(g, o.num_layers, o.memory_budget_bytes, &unused);
    if (p < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "memory_budget_bytes: expected at least ", one_page.total_bytes,
          " bytes (one page of every layer), got ", o.memory_budget_bytes));
    }
    g.num_pages = p;
  }
  if (g.num_pages > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("geometry.num_pages: expected at most ",
                                                   INT32_MAX, " (i32 block tables), got ",
                                                   g.num_pages));
  }
  internal::PoolLayout pool_layout;
  if (!internal::ComputePoolLayout(g, o.num_layers, &pool_layout)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.num_pages: expected pools (", o.num_layers, " layers of ", g.num_pages,
        " pages) whose size in bytes fits in int64, got ", g.num_pages));
  }
  int max_pages_per_seq = o.max_pages_per_seq;
  if (max_pages_per_seq == 0) {
    max_pages_per_seq = static_cast<int>(std::min<int64_t>(
        g.num_pages, CeilDiv(internal::kDefaultMaxSeqTokens, g.page_size)));
  }
  FP4KV_RETURN_IF_ERROR(ValidateRecipe(o.recipe));
  for (const auto& [v, name] :
       {std::pair<const std::vector<float>&, const char*>{o.k_global_scales, "k_global_scales"},
        std::pair<const std::vector<float>&, const char*>{o.v_global_scales, "v_global_scales"}}) {
    if (!v.empty() && static_cast<int64_t>(v.size()) != o.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": expected ", o.num_layers, " values (one per layer) or none, got ", v.size()));
    }
    for (size_t l = 0; l < v.size(); ++l) {
      FP4KV_RETURN_IF_ERROR(internal::CheckScale(v[l], name, static_cast<int>(l)));
    }
  }
  for (const auto& [v, name] :
       {std::pair<int, const char*>{o.max_seqs_per_step, "max_seqs_per_step"},
        std::pair<int, const char*>{o.max_tokens_per_step, "max_tokens_per_step"},
        std::pair<int, const char*>{max_pages_per_seq, "max_pages_per_seq"}}) {
    if (v < 1) return absl::InvalidArgumentError(absl::StrCat(name, ": expected >= 1, got ", v));
  }
  if (static_cast<int64_t>(max_pages_per_seq) * g.page_size > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_pages_per_seq: expected max_pages_per_seq * page_size <= ", INT32_MAX,
                     " (i32 lengths), got ", max_pages_per_seq, " * ", g.page_size));
  }
  if (static_cast<int64_t>(max_pages_per_seq) * o.max_seqs_per_step >= INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_seqs_per_step, max_pages_per_seq: expected a product below ", INT32_MAX,
        " (i32 kv_page_indptr), got ", o.max_seqs_per_step, " * ", max_pages_per_seq));
  }
  if (!(o.calibration_headroom >= 1.0f) || !std::isfinite(o.calibration_headroom)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "calibration_headroom: expected a finite value >= 1, got ", o.calibration_headroom));
  }
  FP4KV_RETURN_IF_ERROR(internal::CheckDeviceAvailable(o.device));

  const HostTierOptions& ht = o.host_tier;
  if (ht.host_pages < 0 || ht.host_bytes < 0 || (ht.host_pages > 0 && ht.host_bytes > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_tier: expected host_pages >= 0 and host_bytes >= 0, at most one of them positive, "
        "got host_pages ", ht.host_pages, " and host_bytes ", ht.host_bytes));
  }
  int64_t host_pages = ht.host_pages;
  internal::PoolLayout host_layout;
  if (ht.host_bytes > 0) {
    host_pages = MostPagesWithin(g, o.num_layers, ht.host_bytes, &host_layout);
    if (host_pages < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "host_tier.host_bytes: expected at least ", one_page.total_bytes,
          " bytes (one page of every layer), got ", ht.host_bytes));
    }
  }
  if (host_pages > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("host_tier.host_pages: expected at most ",
                                                   INT32_MAX, ", got ", host_pages));
  }
  if (host_pages > 0) {
    CacheGeometry t = g;
    t.num_pages = host_pages;
    if (!internal::ComputePoolLayout(t, o.num_layers, &host_layout)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "host_tier.host_pages: expected a host pool whose size in bytes fits in int64, got ",
          host_pages));
    }
  }
  if (o.prefix_cache.max_pending_events < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix_cache.max_pending_events: expected >= 0, got ", o.prefix_cache.max_pending_events));
  }
  auto s = std::make_unique<KVCacheState>(
      static_cast<int32_t>(g.num_pages),
      o.prefix_cache.enabled ? static_cast<size_t>(o.prefix_cache.max_pending_events) : 0);
  s->prefix = o.prefix_cache.enabled;
  if (s->prefix) s->page_tokens.assign(static_cast<size_t>(g.num_pages) * g.page_size, 0);
  s->options = o;
  s->options.geometry = g;
  s->options.memory_budget_bytes = o.memory_budget_bytes;
  s->options.max_pages_per_seq = max_pages_per_seq;
  s->geometry = g;
  s->cuda = o.device.is_cuda();
  s->pool = pool_layout;
  const int S = o.max_seqs_per_step;
  const int T = o.max_tokens_per_step;
  const int M = max_pages_per_seq;
  s->step_layout = internal::ComputeStepLayout(S, T, M, o.num_layers);
  const internal::StepLayout& sl = s->step_layout;

  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(o.device));
  using Kind = internal::Memory::Kind;
  FP4KV_RETURN_IF_ERROR(
      s->pools.Allocate(s->cuda ? Kind::kDevice : Kind::kHost, s->pool.total_bytes, "the pools"));
  FP4KV_RETURN_IF_ERROR(s->device_step.Allocate(s->cuda ? Kind::kDevice : Kind::kHost,
                                                   sl.device_bytes, "the step buffers"));
  if (host_pages > 0) {
    s->host_pages_total = host_pages;
    s->host_layout = host_layout;
    FP4KV_RETURN_IF_ERROR(s->host_pool.Allocate(s->cuda ? Kind::kPinnedMapped : Kind::kHost,
                                                   host_layout.total_bytes, "the host tier"));
    s->host_pool_dev = s->host_pool.get();
    if (s->cuda) {
      void* dev_ptr = nullptr;
      FP4KV_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&dev_ptr, s->host_pool.get(), 0));
      s->host_pool_dev = static_cast<uint8_t*>(dev_ptr);
      FP4KV_CUDA_RETURN_IF_ERROR(
          cudaStreamCreateWithFlags(&s->copy_stream, cudaStreamNonBlocking));
      FP4KV_CUDA_RETURN_IF_ERROR(
          cudaEventCreateWithFlags(&s->copy_ready, cudaEventDisableTiming));
      FP4KV_CUDA_RETURN_IF_ERROR(
          cudaEventCreateWithFlags(&s->copy_drained, cudaEventDisableTiming));
    }
    s->host_free.resize(static_cast<size_t>(host_pages));
    // Popped from the back: host pages are handed out in increasing order.
    for (int64_t i = 0; i < host_pages; ++i) {
      s->host_free[i] = static_cast<int32_t>(host_pages - 1 - i);
    }
  }
  uint8_t* host = s->device_step.get();
  if (s->cuda) {
    FP4KV_RETURN_IF_ERROR(
        s->staging.Allocate(Kind::kPinned, sl.staging_bytes, "the pinned step staging"));
    host = s->staging.get();
    FP4KV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s->upload_done, cudaEventDisableTiming));
  }
  s->d_step = s->device_step.get();
  s->d_scales = reinterpret_cast<float*>(s->d_step + sl.scales);
  s->d_flags = reinterpret_cast<int32_t*>(s->d_step + sl.flags);
  s->d_calib = reinterpret_cast<uint32_t*>(s->d_step + sl.calib);
  s->d_events = reinterpret_cast<uint64_t*>(s->d_step + sl.events);
  s->d_old_scales = reinterpret_cast<float*>(s->d_step + sl.old_scales);
  s->h_seq_lens = reinterpret_cast<int32_t*>(host + sl.seq_lens);
  s->h_kv_indptr = reinterpret_cast<int32_t*>(host + sl.kv_indptr);
  s->h_token_indptr = reinterpret_cast<int32_t*>(host + sl.token_indptr);
  s->h_slots = reinterpret_cast<int64_t*>(host + sl.slots);
  s->h_tables = reinterpret_cast<int32_t*>(host + sl.tables);
  // Zeroed memory is already a valid empty step but for the padding slots.
  std::fill(s->h_slots, s->h_slots + T, int64_t{-1});

  // Scales: explicit ones are calibrated; a missing side starts pending with
  // a placeholder (1.0) that only all-zero rows are ever stored under.
  const int L = o.num_layers;
  std::vector<float> scales(4 * static_cast<size_t>(L));
  std::vector<int32_t> flags(2 * static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    const float k = o.k_global_scales.empty() ? 1.0f : o.k_global_scales[l];
    const float v = o.v_global_scales.empty() ? 1.0f : o.v_global_scales[l];
    absl::StatusOr<float> kf =
        g.fp8_keys() ? absl::StatusOr<float>(MinFp8ScaleForFp8Keys(k)) : MinFp8Scale(k);
    absl::StatusOr<float> vf = MinFp8Scale(v);
    if (!kf.ok()) return kf.status();
    if (!vf.ok()) return vf.status();
    scales[4 * l + 0] = k;
    scales[4 * l + 1] = v;
    scales[4 * l + 2] = *kf;
    scales[4 * l + 3] = *vf;
    flags[2 * l + 0] = o.k_global_scales.empty() ? 0 : 1;
    flags[2 * l + 1] = o.v_global_scales.empty() ? 0 : 1;
  }
  if (s->cuda) {
    FP4KV_RETURN_IF_ERROR(s->mapped_flags.Allocate(Kind::kPinnedMapped, 4 * 2 * L,
                                                      "the mapped calibration flags"));
    s->h_flags = reinterpret_cast<int32_t*>(s->mapped_flags.get());
    void* dev_ptr = nullptr;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&dev_ptr, s->h_flags, 0));
    s->h_flags_dev = static_cast<int32_t*>(dev_ptr);
    std::memcpy(s->h_flags, flags.data(), flags.size() * sizeof(int32_t));
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(s->d_step, host, sl.staging_bytes, cudaMemcpyHostToDevice));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpy(s->d_scales, scales.data(),
                                          scales.size() * sizeof(float), cudaMemcpyHostToDevice));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpy(s->d_flags, flags.data(),
                                          flags.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  } else {
    std::memcpy(s->d_scales, scales.data(), scales.size() * sizeof(float));
    std::memcpy(s->d_flags, flags.data(), flags.size() * sizeof(int32_t));
    s->h_flags = s->d_flags;
  }
  s->layer_append_serial.assign(L, 0);
  s->layer_captured.assign(L, 0);
  s->known_scales = scales;
  s->known.assign(L, 0);
  for (int l = 0; l < L; ++l) s->known[l] = flags[2 * l] != 0 && flags[2 * l + 1] != 0;
  s->book = std::make_shared<internal::ReservationBook>();
  s->book->state = s.get();

  const Device dev = o.device;
  uint8_t* d = s->d_step;
  StepViews& v = s->views;
  v.slot_mapping = TensorView::Contiguous(d + sl.slots, DType::kI64, {T}, dev);
  v.block_tables = TensorView::Contiguous(d + sl.tables, DType::kI32, {S, M}, dev);
  v.seq_lens = TensorView::Contiguous(d + sl.seq_lens, DType::kI32, {S}, dev);
  v.kv_page_indptr = TensorView::Contiguous(d + sl.kv_indptr, DType::kI32, {S + 1}, dev);
  v.token_indptr = TensorView::Contiguous(d + sl.token_indptr, DType::kI32, {S + 1}, dev);
  v.fp8_block_tables = TensorView::Contiguous(d + sl.fp8_tables, DType::kI32, {S, M}, dev);

  s->rows.assign(S, KVCacheState::Row{});
  s->claim.assign(g.num_pages, 0);
  s->step_seqs.assign(S, nullptr);
  s->cow_src.reserve(S);
  s->cow_entry.reserve(S);
  s->cow_dst.reserve(S);
  return KVCache(std::move(s));
}

KVCache::KVCache(std::unique_ptr<KVCacheState> state) : state_(std::move(state)) {}

namespace {
absl::Status NotBound(const char* what) {
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": expected an op from a KVCache accessor, got a default-constructed one"));
}
absl::Status MovedFrom() {
  return absl::FailedPreconditionError(
      "KVCache: expected a live cache, got one that was moved from");
}
}  // namespace

#define FP4KV_KV_RETURN_IF_MOVED_FROM() \
  do {                                  \
    if (state_ == nullptr) return MovedFrom(); \
  } while (0)
KVCache::KVCache(KVCache&&) noexcept = default;
KVCache& KVCache::operator=(KVCache&&) noexcept = default;
KVCache::~KVCache() = default;

// --------------------------------------------------------------- sequences
SequenceId KVCache::CreateSequence() {
  if (state_ == nullptr) return 0;
  KVCacheState& s = *state_;
  uint32_t slot;
  if (!s.free_slots.empty()) {
    slot = s.free_slots.back();
    s.free_slots.pop_back();
  } else {
    slot = static_cast<uint32_t>(s.seqs.size());
    s.seqs.emplace_back();
  }
  KVCacheState::Sequence& q = s.seqs[slot];
  q.live = true;
  q.length = 0;
  q.pages.clear();
  q.chain.Reset(s.prefix, {});
  ++q.epoch;
  ++s.live_sequences;
  q.id = s.next_id++;
  s.slot_of.emplace(q.id, slot);
  return q.id;
}

absl::StatusOr<SequenceId> KVCache::ForkSequence(SequenceId parent) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  FP4KV_RETURN_IF_ERROR(s.FindResident(parent, "ForkSequence", "parent").status());
  const SequenceId child = CreateSequence();  // may move s.seqs: look the parent up again
  const KVCacheState::Sequence& p = *s.Find(parent);
  KVCacheState::Sequence& c = *s.Find(child);
  c.length = p.length;
  c.pages = p.pages;
  c.chain = p.chain;
  for (int32_t page : c.pages) s.allocator.Retain(page);
  c.swapin_event = p.swapin_event;  // its pages arrive with the parent's copy
  if (c.swapin_event >= 0) ++s.event_refs[c.swapin_event];
  return child;
}

absl::Status KVCache::Truncate(SequenceId seq, int64_t new_len) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  absl::StatusOr<KVCacheState::Sequence*> found = s.FindResident(seq, "Truncate");
  if (!found.ok()) return found.status();
  KVCacheState::Sequence* q = *found;
  if (new_len < 0 || new_len > q->length) {
    return absl::InvalidArgumentError(absl::StrCat("new_len: expected in [0, ", q->length,
                                                   "] (the sequence's length), got ", new_len));
  }
  const size_t keep = static_cast<size_t>(CeilDiv(new_len, s.geometry.page_size));
  if (keep < q->pages.size()) {
    // Last page first: of pages that become cached, the deepest is evicted first.
    for (size_t j = q->pages.size(); j-- > keep;) s.allocator.Release(q->pages[j]);
    q->pages.resize(keep);
    ++q->epoch;
  }
  q->length = new_len;
  q->chain.Truncate(new_len, s.geometry.page_size);
  return absl::OkStatus();
}

absl::Status KVCache::ReleaseSequence(SequenceId seq) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  KVCacheState::Sequence* q = s.Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  if (q->swapped) {
    // Host pages are only rewritten by later copies on the copy stream.
    for (int32_t h : q->host_pages) s.host_free.push_back(h);
    q->host_pages.clear();
    q->swapped = false;
    if (!q->pages.empty()) {  // its copy is in flight: the pages go when it is done
      for (KVCacheState::SwapOutCopy& c : s.outs) {
        if (c.seq == seq) {
          c.seq = 0;
          c.orphan = std::move(q->pages);
        }
      }
      q->pages.clear();
    }
  }
  s.DropSwapIn(*q);
  // Last page first: of pages that become cached, the deepest is evicted first.
  for (size_t j = q->pages.size(); j-- > 0;) s.allocator.Release(q->pages[j]);
  q->pages.clear();  // keeps the capacity for the next sequence in this slot
  q->chain.Reset(false, {});
  q->length = 0;
  q->live = false;
  q->id = 0;
  s.free_slots.push_back(s.slot_of[seq]);
  s.slot_of.erase(seq);
  --s.live_sequences;
  return absl::OkStatus();
}

absl::StatusOr<SequenceId> KVCache::ImportSequence(absl::Span<const HalfPagedCache> layers,
                                                   absl::Span<const int32_t> src_pages,
                                                   int64_t length, Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.PollSwaps();
  const int L = s.options.num_layers;
  const int64_t ps = s.geometry.page_size;
  if (static_cast<int64_t>(layers.size()) != L) {
    return absl::InvalidArgumentError(absl::StrCat("layers: expected ", L,
                                                   " (one per layer), got ", layers.size()));
  }
  if (length < 0) {
    return absl::InvalidArgumentError(absl::StrCat("length: expected >= 0, got ", length));
  }
  const int64_t n = CeilDiv(length, ps);
  if (n > static_cast<int64_t>(src_pages.size())) {
    return absl::InvalidArgumentError(absl::StrCat("src_pages: expected at least ", n,
                                                   " pages for ", length, " tokens, got ",
                                                   src_pages.size()));
  }
  if (n > s.options.max_pages_per_seq) {
    return absl::InvalidArgumentError(absl::StrCat("length: expected at most max_pages_per_seq * "
                                                   "page_size = ",
                                                   s.options.max_pages_per_seq * ps, ", got ",
                                                   length));
  }
  // Validate every layer's quantization before anything changes; the lists'
  // device memory does not exist yet, so a stand-in address is checked (the
  // checks never read through it).
  PagedCacheQuantizer::Options o;
  o.geometry = s.geometry;
  o.input_dtype = L > 0 ? layers[0].k.dtype : DType::kBF16;
  o.recipe = s.options.recipe;
  o.device = s.options.device;
  std::vector<internal::QuantizeCacheParams> params(L);
  std::vector<int32_t> lists(2 * static_cast<size_t>(n));
  int32_t* const stand_in = reinterpret_cast<int32_t*>(s.pools.get());
  for (int l = 0; l < L; ++l) {
    o.source_layout = layers[l].layout;
    o.compute_scales = s.LayerPending(l);
    o.headroom = s.options.calibration_headroom;
    absl::StatusOr<PagedCacheQuantizer> op = PagedCacheQuantizer::Create(o);
    if (!op.ok()) return op.status();
    QuantizeCacheArgs a;
    a.source = layers[l];
    a.src_pages = TensorView::Contiguous(stand_in, DType::kI32, {n}, s.options.device);
    a.dst_pages = TensorView::Contiguous(stand_in + n, DType::kI32, {n}, s.options.device);
    a.num_tokens = length;
    float* scales = s.d_scales + 4 * l;
    if (o.compute_scales) {
      a.k_scale_out = scales + 0;
      a.v_scale_out = scales + 1;
    } else {
      a.k_scale = GlobalScale::Pointer(scales + 0);
      a.v_scale = GlobalScale::Pointer(scales + 1);
    }
    absl::StatusOr<internal::QuantizeCacheParams> p =
        internal::MakeQuantizeCacheParams(o, a, s.LayerCache(l));
    if (!p.ok()) {
      return absl::Status(p.status().code(),
                          absl::StrCat("layers[", l, "].", p.status().message()));
    }
    for (int64_t i = 0; i < n; ++i) {
      if (src_pages[i] < 0 || src_pages[i] >= p->src_num_pages) {
        return absl::InvalidArgumentError(absl::StrCat(
            "src_pages: expected ids in [0, ", p->src_num_pages, ") (pages of layers[", l,
            "]), got ", src_pages[i], " at ", i));
      }
    }
    if (o.compute_scales) {  // a pending layer: calibrate like a first append
      p->zero_first = false;
      p->amax_bits[0] = s.d_calib + 4 * l + 0;
      p->amax_bits[1] = s.d_calib + 4 * l + 1;
      p->fp8_out[0] = scales + 2;
      p->fp8_out[1] = scales + 3;
      p->flags = s.d_flags + 2 * l;
      p->host_flags = s.cuda ? s.h_flags_dev + 2 * l : nullptr;
    }
    params[l] = *p;
  }
  if (n > s.allocator.available_count() && !s.outs.empty()) {
    FP4KV_RETURN_IF_ERROR(s.WaitSwapOuts());
  }
  if (n > s.allocator.available_count()) {
    return absl::ResourceExhaustedError(absl::StrCat("ImportSequence: needs ", n,
                                                     " free pages, the pool has ",
                                                     s.allocator.available_count()));
  }
  internal::ScopedDevice scoped;
  int32_t* d_lists = lists.data();
  if (s.cuda) {
    FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
    if (n > 0) {
      void* mem = nullptr;
      FP4KV_CUDA_RETURN_IF_ERROR(
          cudaMallocAsync(&mem, lists.size() * sizeof(int32_t), reinterpret_cast<cudaStream_t>(stream)));
      d_lists = static_cast<int32_t*>(mem);
    }
  }
  // Commit: the sequence and its pages.
  const SequenceId id = CreateSequence();
  KVCacheState::Sequence& q = *s.Find(id);
  // The rows' token ids are unknown: the sequence is never prefix-tracked, so
  // its pages are not indexed (nor are those of later steps).
  if (q.chain.tracked) q.chain.Untrack();
  for (int64_t i = 0; i < n; ++i) {
    q.pages.push_back(s.allocator.Allocate());
    lists[i] = src_pages[i];
    lists[n + i] = q.pages.back();
  }
  q.length = length;
  if (n == 0) return id;
  absl::Status status = absl::OkStatus();
  const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
  if (s.cuda) {
    status = internal::CudaStatus(cudaMemcpyAsync(d_lists, lists.data(), lists.size() * sizeof(int32_t),
                                        cudaMemcpyHostToDevice, cs),
                        "cudaMemcpyAsync(import page lists)");
  }
  for (int l = 0; l < L && status.ok(); ++l) {
    params[l].src_pages = d_lists;
    params[l].dst_pages = d_lists + n;
    if (!s.cuda) {
      internal::ReferenceQuantizeCache(params[l]);
    } else {
      status = internal::LaunchQuantizeCache(params[l], stream);
    }
  }
  if (s.cuda) {
    const absl::Status freed = internal::CudaStatus(cudaFreeAsync(d_lists, cs), "cudaFreeAsync");
    if (status.ok()) status = freed;
  }
  if (!status.ok()) {
    (void)ReleaseSequence(id);
    return absl::InternalError(absl::StrCat("ImportSequence: ", status.message()));
  }
  return id;
}

absl::StatusOr<PrefixSequence> KVCache::CreateSequenceFromPrefix(absl::Span<const int32_t> prompt,
                                                                absl::string_view extra_key) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  if (!s.prefix) {
    return absl::FailedPreconditionError(
        "CreateSequenceFromPrefix: expected a cache with prefix_cache.enabled, got one without");
  }
  s.FlushIndex();
  s.PollSwaps();
  s.MatchPages(prompt, extra_key, &s.match_hashes, &s.match_pages);
  const SequenceId id = CreateSequence();
  KVCacheState::Sequence& q = *s.Find(id);
  const int64_t tokens = static_cast<int64_t>(s.match_pages.size()) * s.geometry.page_size;
  for (int32_t page : s.match_pages) s.allocator.Retain(page);  // revives cached ones
  q.pages.assign(s.match_pages.begin(), s.match_pages.end());
  q.length = tokens;
  q.chain.Reset(true, extra_key);
  q.chain.hashes.assign(s.match_hashes.begin(), s.match_hashes.end());
  ++s.prefix_queries;
  s.prefix_query_tokens += static_cast<int64_t>(prompt.size());
  s.prefix_hit_tokens += tokens;
  return PrefixSequence{id, tokens};
}

PrefixMatch KVCache::MatchPrefix(absl::Span<const int32_t> prompt,
                                 absl::string_view extra_key) const {
  if (state_ == nullptr) return PrefixMatch();
  KVCacheState& s = *state_;
  s.FlushIndex();  // logically part of the earlier steps
  s.MatchPages(prompt, extra_key, &s.match_hashes, &s.match_pages);
  PrefixMatch m;
  m.pages = static_cast<int64_t>(s.match_pages.size());
  m.tokens = m.pages * s.geometry.page_size;
  for (int32_t page : s.match_pages) m.pages_evictable += s.allocator.RefCount(page) == 0;
  return m;
}

absl::StatusOr<int64_t> KVCache::SequenceLength(SequenceId seq) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState::Sequence* q = state_->Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  return q->length;
}

absl::StatusOr<absl::Span<const int32_t>> KVCache::SequencePages(SequenceId seq) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState::Sequence* q = state_->Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  return absl::Span<const int32_t>(q->pages);
}

absl::StatusOr<int32_t> KVCache::PageRefCount(int64_t page) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  if (page < 0 || page >= state_->geometry.num_pages) {
    return absl::InvalidArgumentError(
        absl::StrCat("page: expected in [0, ", state_->geometry.num_pages, "), got ", page));
  }
  return state_->allocator.RefCount(static_cast<int32_t>(page));
}

absl::Status KVCache::ReadSequence(int layer, SequenceId seq, const TensorView& k_out,
                                  const TensorView& v_out, Stream stream) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  absl::StatusOr<const KVCacheState::Sequence*> found = s.FindResident(seq, "ReadSequence");
  if (!found.ok()) return found.status();
  const KVCacheState::Sequence* q = *found;
  const CacheGeometry& g = s.geometry;
  // Shapes here; dtype, alignment and device through the Dequantizer below.
  for (const auto& [t, name, dim] :
       {std::tuple<const TensorView&, const char*, int>{k_out, "k_out", g.head_dim_k},
        std::tuple<const TensorView&, const char*, int>{v_out, "v_out", g.head_dim_v}}) {
    FP4KV_RETURN_IF_ERROR(internal::CheckGiven(t, name));
    FP4KV_RETURN_IF_ERROR(internal::CheckShape(t, name, {k_out.shape[0], g.num_kv_heads, dim}));
    if (t.shape[0] < q->length || t.shape[0] > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected dimension 0 in [", q->length, ", ", INT32_MAX,
                       "] (the sequence's length ..), got shape ", t.ShapeString()));
    }
  }
  FP4KV_RETURN_IF_ERROR(internal::CheckFloatDType(k_out.dtype, "k_out"));
  absl::StatusOr<Dequantizer> op =
      Dequantizer::Create({g, k_out.dtype, DType::kI32, s.options.device});
  if (!op.ok()) return op.status();
  // One request: [1, T, H, D] views of the outputs.
  auto batched = [](const TensorView& t) {
    TensorView b = TensorView::Strided(t.data, t.dtype, {1, t.shape[0], t.shape[1], t.shape[2]},
                                       {0, t.strides[0], t.strides[1], t.strides[2]}, t.device);
    return b;
  };
  const int64_t pages = static_cast<int64_t>(q->pages.size());
  const int32_t len = static_cast<int32_t>(q->length);
  DequantArgs a;
  a.k_out = batched(k_out);
  a.v_out = batched(v_out);
  a.k_scale = GlobalScale::Pointer(s.d_scales + 4 * layer + 0);
  a.v_scale = GlobalScale::Pointer(s.d_scales + 4 * layer + 1);
  const Device dev = s.options.device;
  int32_t* d_table = reinterpret_cast<int32_t*>(s.d_step + s.step_layout.readback);
  int32_t* d_len = d_table + s.options.max_pages_per_seq;
  const int64_t width = std::max<int64_t>(pages, 1);
  a.block_tables = TensorView::Contiguous(d_table, DType::kI32, {1, width}, dev);
  a.seq_lens = TensorView::Contiguous(d_len, DType::kI32, {1}, dev);
  if (len == 0) {
    // Nothing to write; still check every argument.
    int32_t zero_table = 0, zero_len = 0;
    a.block_tables = TensorView::Contiguous(&zero_table, DType::kI32, {1, 1}, dev);
    a.seq_lens = TensorView::Contiguous(&zero_len, DType::kI32, {1}, dev);
    absl::StatusOr<internal::DequantParams> p =
        internal::MakeDequantParams(op->options(), a, s.LayerCache(layer));
    return p.status();
  }
  if (!s.cuda) {
    std::memcpy(d_table, q->pages.data(), sizeof(int32_t) * pages);
    *d_len = len;
    return op->Run(a, s.LayerCache(layer), stream);
  }
  // Check everything before the upload, then upload and launch.
  absl::StatusOr<internal::DequantParams> p =
      internal::MakeDequantParams(op->options(), a, s.LayerCache(layer));
  if (!p.ok()) return p.status();
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(dev));
  FP4KV_RETURN_IF_ERROR(s.OrderAfterSwapIn(*q, stream));
  std::vector<int32_t> host(q->pages.begin(), q->pages.end());
  host.resize(s.options.max_pages_per_seq + 1, 0);
  host.back() = len;
  // From pageable memory: the copy has taken the bytes when it returns.
  FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_table, host.data(), sizeof(int32_t) * host.size(),
                                             cudaMemcpyHostToDevice,
                                             reinterpret_cast<cudaStream_t>(stream)));
  return internal::LaunchDequantize(*p, stream);
}

// ------------------------------------------------------------------- steps
absl::StatusOr<StepInfo> KVCache::PrepareStep(absl::Span<const StepEntry> entries, Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  const int S = s.options.max_seqs_per_step;
  const int M = s.options.max_pages_per_seq;
  const int ps = s.geometry.page_size;
  const int n = static_cast<int>(entries.size());

  // Pass 1: check everything and count the pages; change nothing (claims and
  // marks are scratch).
  s.PollSwaps();
  internal::ClaimReset claim_reset{s};
  int64_t need = 0;
  FP4KV_RETURN_IF_ERROR(internal::CheckStepEntries(s, entries, &need));
  if (need > s.allocator.available_count() && !s.outs.empty()) {
    // Pages still held by SwapOut copies in flight: wait for them.
    FP4KV_RETURN_IF_ERROR(s.WaitSwapOuts());
  }
  if (need > s.allocator.available_count()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "PrepareStep: needs ", need, " free pages (", s.cow_src.size(),
        " of them copies of shared pages), the pool has ", s.allocator.free_count(), " free and ",
        s.allocator.cached_count(), " evictable cached of ", s.allocator.num_pages(),
        "; nothing changed"));
  }

  // The previous upload may still read the staging buffer.
  internal::ScopedDevice scoped;
  if (s.cuda) {
    FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
    if (s.upload_pending) {
      FP4KV_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(s.upload_done));
      s.upload_pending = false;
    }
    // Sequences swapped back in: the step's stream waits for their copies.
    for (int i = 0; i < n; ++i) {
      KVCacheState::Sequence& q = *s.step_seqs[i];
      if (q.swapin_event < 0) continue;
      FP4KV_RETURN_IF_ERROR(s.OrderAfterSwapIn(q, stream));
      s.DropSwapIn(q);
    }
  }

  // Copies on write first: undone if one cannot be enqueued.
  const int64_t evictions_before = s.allocator.evictions();
  s.cow_dst.clear();
  for (size_t k = 0; k < s.cow_src.size(); ++k) {
    const int32_t dst = s.allocator.Allocate();
    s.cow_dst.push_back(dst);
    if (absl::Status st = s.CopyPage(s.cow_src[k], dst, stream); !st.ok()) {
      for (int32_t p : s.cow_dst) s.allocator.Release(p);
      return st;
    }
    if (s.prefix) {  // the page's token ids travel with its bytes
      const absl::Span<const int32_t> ids = s.PageTokens(s.cow_src[k]);
      std::copy(ids.begin(), ids.end(), s.page_tokens.begin() + int64_t{dst} * ps);
    }
  }

  // Pass 2: commit. Nothing below fails until the upload.
  StepInfo info;
  info.num_seqs = n;
  info.pages_copied = static_cast<int64_t>(s.cow_dst.size());
  const int32_t free_before =
      s.allocator.available_count() + static_cast<int32_t>(s.cow_dst.size());
  int64_t tok = 0;
  int dirty_lo = S;
  int dirty_hi = -1;
  size_t next_cow = 0;
  for (int i = 0; i < n; ++i) {
    KVCacheState::Sequence& q = *s.step_seqs[i];
    const SequenceId id = entries[i].seq;
    if (next_cow < s.cow_entry.size() && s.cow_entry[next_cow] == i) {
      s.allocator.Release(q.pages.back());  // stays >= 1: another sequence holds it
      q.pages.back() = s.cow_dst[next_cow++];
      ++q.epoch;
    }
    const int64_t old_len = q.length;
    const int64_t new_len = old_len + entries[i].num_new_tokens;
    // An indexed partial last page about to be written (after a truncation)
    // leaves the index: its cached content is being overwritten.
    if (q.chain.tail_maybe_indexed && new_len > old_len) {
      if (old_len % ps != 0) s.allocator.Unregister(q.pages.back());
      q.chain.tail_maybe_indexed = false;
    }
    const size_t pages_after = static_cast<size_t>(CeilDiv(new_len, ps));
    while (q.pages.size() < pages_after) q.pages.push_back(s.allocator.Allocate());
    int64_t j = old_len / ps;
    int64_t e = old_len % ps;
    for (int64_t pos = old_len; pos < new_len; ++pos) {
      s.h_slots[tok++] = static_cast<int64_t>(q.pages[j]) * ps + e;
      if (++e == ps) {
        e = 0;
        ++j;
      }
    }
    q.length = new_len;
    if (s.prefix) s.CommitTokens(q, entries[i], tok - (new_len - old_len));
    const int32_t count = static_cast<int32_t>(q.pages.size());
    s.h_seq_lens[i] = static_cast<int32_t>(new_len);
    s.h_token_indptr[i + 1] = static_cast<int32_t>(tok);
    s.h_kv_indptr[i + 1] = s.h_kv_indptr[i] + count;
    info.max_seq_len = std::max(info.max_seq_len, static_cast<int32_t>(new_len));
    KVCacheState::Row& r = s.rows[i];
    const int32_t from = (r.seq == id && r.epoch == q.epoch && r.count <= count) ? r.count : 0;
    if (from < count) {
      std::memcpy(s.h_tables + static_cast<int64_t>(i) * M + from, q.pages.data() + from,
                  sizeof(int32_t) * (count - from));
      dirty_lo = std::min(dirty_lo, i);
      dirty_hi = i;
    }
    r = KVCacheState::Row{id, q.epoch, count};
  }
  // Padding: unused rows read nothing, unused slots write nothing.
  for (int i = n; i < s.rows_used; ++i) s.h_seq_lens[i] = 0;
  std::fill(s.h_kv_indptr + n + 1, s.h_kv_indptr + S + 1, s.h_kv_indptr[n]);
  std::fill(s.h_token_indptr + n + 1, s.h_token_indptr + S + 1, s.h_token_indptr[n]);
  const int64_t slot_upload = std::max(tok, s.slot_extent);
  if (tok < s.slot_extent) std::fill(s.h_slots + tok, s.h_slots + s.slot_extent, int64_t{-1});
  s.slot_extent = tok;
  s.rows_used = n;

  info.num_tokens = tok;
  info.num_pages = s.h_kv_indptr[n];
  info.fp8_workspace_pages = 1 + info.num_pages;
  info.pages_allocated = free_before - s.allocator.available_count();
  info.pages_evicted = s.allocator.evictions() - evictions_before;
  s.step = info;
  ++s.step_serial;

  if (s.cuda) {
    const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
    const internal::StepLayout& sl = s.step_layout;
    const uint8_t* host = s.staging.get();
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(s.d_step, host, sl.slots + 8 * slot_upload, cudaMemcpyHostToDevice, cs));
    if (dirty_hi >= dirty_lo) {
      const int64_t row_bytes = 4 * static_cast<int64_t>(M);
      const int64_t off = sl.tables + dirty_lo * row_bytes;
      FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.d_step + off, host + off,
                                                 (dirty_hi - dirty_lo + 1) * row_bytes,
                                                 cudaMemcpyHostToDevice, cs));
    }
    FP4KV_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.upload_done, cs));
    s.upload_pending = true;
  }
  return info;
}

absl::StatusOr<StepPlan> KVCache::PlanStep(absl::Span<const StepEntry> entries) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;  // only scratch is written (and finished swaps)
  s.PollSwaps();
  internal::ClaimReset claim_reset{s};
  int64_t need = 0;
  FP4KV_RETURN_IF_ERROR(internal::CheckStepEntries(s, entries, &need));
  StepPlan p;
  p.pages_needed = need;
  p.pages_copied = static_cast<int64_t>(s.cow_src.size());
  p.pages_free = s.allocator.free_count();
  p.pages_evictable = s.allocator.cached_count();
  int64_t pending_free = 0, pending_cached = 0;
  s.PendingReleases(&pending_free, &pending_cached);
  p.pages_swap_pending = pending_free + pending_cached;
  const int64_t available = s.allocator.available_count();
  p.fits = need <= available + p.pages_swap_pending;
  if (p.fits) {
    // PrepareStep waits for the copies only when the pages available now do not suffice.
    const int64_t free = need <= available ? p.pages_free : p.pages_free + pending_free;
    p.pages_evicted = std::max<int64_t>(0, need - free);
    p.pages_left = available + p.pages_swap_pending - need;
    p.tokens_left = p.pages_left * s.geometry.page_size;
  }
  return p;
}


namespace {
// What the accessors of a moved-from cache return.
const StepInfo kNoStep{};
const StepViews kNoViews{};
const KVCacheOptions kNoOptions{};
}  // namespace

const StepInfo& KVCache::step() const { return state_ ? state_->step : kNoStep; }
const StepViews& KVCache::step_views() const { return state_ ? state_->views : kNoViews; }

absl::Span<const int64_t> KVCache::host_slot_mapping() const {
  if (state_ == nullptr) return {};
  return absl::Span<const int64_t>(state_->h_slots, state_->step.num_tokens);
}
absl::Span<const int32_t> KVCache::host_seq_lens() const {
  if (state_ == nullptr) return {};
  return absl::Span<const int32_t>(state_->h_seq_lens, state_->step.num_seqs);
}
absl::Span<const int32_t> KVCache::host_kv_page_indptr() const {
  if (state_ == nullptr) return {};
  return absl::Span<const int32_t>(state_->h_kv_indptr, state_->step.num_seqs + 1);
}
absl::Span<const int32_t> KVCache::host_token_indptr() const {
  if (state_ == nullptr) return {};
  return absl::Span<const int32_t>(state_->h_token_indptr, state_->step.num_seqs + 1);
}
absl::Span<const int32_t> KVCache::host_block_table(int row) const {
  if (state_ == nullptr || row < 0 || row >= state_->options.max_seqs_per_step) return {};
  const int M = state_->options.max_pages_per_seq;
  return absl::Span<const int32_t>(state_->h_tables + static_cast<int64_t>(row) * M, M);
}

// --------------------------------------------------------------------- ops
absl::StatusOr<CacheAppender> KVCache::appender(DType input_dtype) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  absl::StatusOr<Appender> op =
      Appender::Create({s.geometry, input_dtype, AppendIndexing::kSlot, s.options.recipe,
                        s.options.device, s.options.count_scale_events});
  if (!op.ok()) return op.status();
  return CacheAppender(&s, *std::move(op));
}

absl::StatusOr<CacheMaterializer> KVCache::materializer() const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  const CacheGeometry& g = s.geometry;
  if (g.head_dim_k != g.head_dim_v || g.head_dim_k % 64 != 0 || g.page_size % 4 != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "materializer: FP8 materialization needs head_dim_k == head_dim_v, a multiple of 64, and "
        "page_size % 4 == 0; this cache has head_dim_k ",
        g.head_dim_k, ", head_dim_v ", g.head_dim_v, ", page_size ", g.page_size));
  }
  absl::StatusOr<Materializer> op = Materializer::Create({g, DType::kI32, false, s.options.device});
  if (!op.ok()) return op.status();
  return CacheMaterializer(&s, *std::move(op));
}

absl::StatusOr<CacheDequantizer> KVCache::dequantizer(DType output_dtype) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  absl::StatusOr<Dequantizer> op =
      Dequantizer::Create({s.geometry, output_dtype, DType::kI32, s.options.device});
  if (!op.ok()) return op.status();
  return CacheDequantizer(&s, *std::move(op));
}

absl::StatusOr<CacheAttention> KVCache::attention(const CacheAttentionOptions& co) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  DecodeAttention::Options o;
  o.geometry = s.geometry;
  o.num_qo_heads = co.num_qo_heads;
  o.dtype = co.dtype;
  o.table_dtype = DType::kI32;
  o.max_batch = s.options.max_seqs_per_step;
  o.max_pages_per_seq = s.options.max_pages_per_seq;
  o.max_q_len = co.max_q_len;
  o.sm_scale = co.sm_scale;
  o.logits_soft_cap = co.logits_soft_cap;
  o.window_left = co.window_left;
  o.has_sinks = co.has_sinks;
  o.write_lse = co.write_lse;
  o.device = s.options.device;
  absl::StatusOr<DecodeAttention> op = DecodeAttention::Create(o);
  if (!op.ok()) return op.status();
  return CacheAttention(&s, *std::move(op));
}

int64_t KVCache::Fp8WorkspacePagesAtCapacity() const {
  if (state_ == nullptr) return 0;
  return 1 + static_cast<int64_t>(state_->options.max_seqs_per_step) *
                 state_->options.max_pages_per_seq;
}

std::vector<int64_t> KVCache::Fp8WorkspaceShape(int64_t pages) const {
  if (state_ == nullptr) return {};
  const CacheGeometry& g = state_->geometry;
  return {pages, 2, g.num_kv_heads, g.page_size, g.head_dim_k};
}

absl::Status CacheAppender::Run(int layer, const TensorView& key, const TensorView& value,
                                Stream stream) const {
  if (state_ == nullptr) return NotBound("CacheAppender");
  const KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  int64_t rows = s.options.max_tokens_per_step;
  if (key.ndim >= 1) {
    if (key.shape[0] < s.step.num_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("append_key: expected at least ", s.step.num_tokens,
                       " rows (the step's new tokens), got shape ", key.ShapeString()));
    }
    rows = std::min<int64_t>(rows, key.shape[0]);
  }
  AppendArgs a;
  a.key = key;
  a.value = value;
  a.slot_mapping = s.views.slot_mapping;
  a.slot_mapping.shape[0] = rows;
  a.k_scale = GlobalScale::Pointer(s.d_scales + 4 * layer + 0);
  a.v_scale = GlobalScale::Pointer(s.d_scales + 4 * layer + 1);
  if (s.options.count_scale_events) a.scale_events = s.d_events + 4 * layer;
  absl::StatusOr<internal::AppendParams> p =
      internal::MakeAppendParams(op_.options(), a, s.LayerCache(layer));
  if (!p.ok()) return p.status();
  internal::ScopedDevice scoped;
  if (s.cuda) {
    FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &capture));
    if (capture != cudaStreamCaptureStatusNone) s.layer_captured[layer] = 1;
  }
  if (s.step.num_tokens > 0) s.layer_append_serial[layer] = s.step_serial;
  if (p->nnz == 0) return absl::OkStatus();
  if (s.LayerPending(layer)) {
    internal::RowCalibrationParams c;
    c.key = p->key;
    c.value = p->value;
    c.key_row_stride = p->key_row_stride;
    c.key_head_stride = p->key_head_stride;
    c.value_row_stride = p->value_row_stride;
    c.value_head_stride = p->value_head_stride;
    c.dtype = p->input_dtype;
    c.rows = p->nnz;
    c.num_heads = p->num_heads;
    c.head_dim_k = p->k.head_dim;
    c.head_dim_v = p->v.head_dim;
    c.slot_mapping = p->slot_mapping;
    c.scales = s.d_scales + 4 * layer;
    c.flags = s.d_flags + 2 * layer;
    c.host_flags = s.cuda ? s.h_flags_dev + 2 * layer : nullptr;
    c.scratch = s.d_calib + 4 * layer;
    c.headroom = s.options.calibration_headroom;
    c.recipe = s.options.recipe;
    c.fp8_keys = s.geometry.fp8_keys();
    if (!s.cuda) {
      internal::ReferenceCalibrateRows(c);  // h_flags is d_flags here
    } else {
      FP4KV_RETURN_IF_ERROR(internal::LaunchCalibrateRows(c, stream));
    }
  }
  if (!s.cuda) {
    internal::ReferenceAppend(*p);
    return absl::OkStatus();
  }
  return internal::LaunchAppend(*p, stream);
}

absl::Status CacheMaterializer::Run(int layer, const TensorView& out, Stream stream) const {
  if (state_ == nullptr) return NotBound("CacheMaterializer");
  const KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  if (out.ndim >= 1 && out.shape[0] < s.step.fp8_workspace_pages) {
    return absl::InvalidArgumentError(
        absl::StrCat("out: expected at least ", s.step.fp8_workspace_pages,
                     " pages (the step's fp8_workspace_pages), got shape ", out.ShapeString()));
  }
  MaterializeArgs a;
  a.block_tables = s.views.block_tables;
  a.seq_lens = s.views.seq_lens;
  a.kv_page_indptr = s.views.kv_page_indptr;
  a.out = out;
  a.fp8_block_tables = s.views.fp8_block_tables;
  a.k_scale = GlobalScale::Pointer(s.d_scales + 4 * layer + 0);
  a.v_scale = GlobalScale::Pointer(s.d_scales + 4 * layer + 1);
  a.k_fp8_scale = GlobalScale::Pointer(s.d_scales + 4 * layer + 2);
  a.v_fp8_scale = GlobalScale::Pointer(s.d_scales + 4 * layer + 3);
  return op_.Run(a, s.LayerCache(layer), stream);
}

absl::Status CacheDequantizer::Run(int layer, const TensorView& k_out, const TensorView& v_out,
                                   Stream stream) const {
  if (state_ == nullptr) return NotBound("CacheDequantizer");
  const KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  const int S = s.options.max_seqs_per_step;
  int64_t batch = S;
  if (k_out.ndim >= 2) {
    batch = k_out.shape[0];
    if (batch < s.step.num_seqs || batch > S) {
      return absl::InvalidArgumentError(absl::StrCat(
          "k_out: expected dimension 0 in [", s.step.num_seqs, ", ", S,
          "] (the step's sequences .. max_seqs_per_step), got shape ", k_out.ShapeString()));
    }
    if (k_out.shape[1] < s.step.max_seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("k_out: expected dimension 1 >= ", s.step.max_seq_len,
                       " (the step's longest sequence), got shape ", k_out.ShapeString()));
    }
  }
  DequantArgs a;
  a.block_tables = s.views.block_tables;
  a.block_tables.shape[0] = batch;
  a.seq_lens = s.views.seq_lens;
  a.seq_lens.shape[0] = batch;
  a.k_out = k_out;
  a.v_out = v_out;
  a.k_scale = GlobalScale::Pointer(s.d_scales + 4 * layer + 0);
  a.v_scale = GlobalScale::Pointer(s.d_scales + 4 * layer + 1);
  return op_.Run(a, s.LayerCache(layer), stream);
}

absl::Status CacheAttention::Run(int layer, const TensorView& q, const TensorView& out,
                                 void* workspace, int64_t workspace_bytes, Stream stream,
                                 const TensorView& lse, const TensorView& sinks) const {
  if (state_ == nullptr) return NotBound("CacheAttention");
  const KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  const int S = s.options.max_seqs_per_step;
  const int max_q_len = op_.options().max_q_len;
  int64_t batch = S;
  DecodeAttentionArgs a;
  a.q = q;
  a.out = out;
  a.lse = lse;
  a.sinks = sinks;
  if (max_q_len == 1) {
    if (q.ndim >= 1) {
      batch = q.shape[0];
      if (batch < s.step.num_seqs || batch > S) {
        return absl::InvalidArgumentError(absl::StrCat(
            "q: expected dimension 0 in [", s.step.num_seqs, ", ", S,
            "] (one row per step entry, up to max_seqs_per_step), got shape ", q.ShapeString()));
      }
    }
  } else {
    if (q.ndim >= 1 && q.shape[0] < s.step.num_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("q: expected at least ", s.step.num_tokens,
                       " rows (the step's new tokens), got shape ", q.ShapeString()));
    }
    for (int i = 0; i < s.step.num_seqs; ++i) {
      const int32_t n = s.h_token_indptr[i + 1] - s.h_token_indptr[i];
      if (n > max_q_len) {
        return absl::InvalidArgumentError(absl::StrCat(
            "step: expected at most max_q_len = ", max_q_len, " new tokens per entry, got ", n,
            " for entry ", i, " (prefill chunks need a prefill attention)"));
      }
    }
    a.q_indptr = s.views.token_indptr;
  }
  a.block_tables = s.views.block_tables;
  a.block_tables.shape[0] = batch;
  a.seq_lens = s.views.seq_lens;
  a.seq_lens.shape[0] = batch;
  if (max_q_len > 1) a.q_indptr.shape[0] = batch + 1;
  a.k_scale = GlobalScale::Pointer(s.d_scales + 4 * layer + 0);
  a.v_scale = GlobalScale::Pointer(s.d_scales + 4 * layer + 1);
  return op_.Run(a, s.LayerCache(layer), workspace, workspace_bytes, stream);
}

// ------------------------------------------------------------ prefix cache
KVEventBatch KVCache::TakeEvents() {
  if (state_ == nullptr) return KVEventBatch();
  state_->FlushIndex();
  return state_->events.Take();
}

void KVCache::ResetPrefixCache() {
  if (state_ != nullptr) state_->ClearPrefixIndex();
}

absl::Status KVCache::CheckInvariants() const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  state_->FlushIndex();  // logically part of the earlier steps
  state_->PollSwaps();
  const KVCacheState& s = *state_;
  const int ps = s.geometry.page_size;
  FP4KV_RETURN_IF_ERROR(s.allocator.Validate());
  std::vector<int32_t> refs(s.allocator.num_pages(), 0);
  std::vector<uint8_t> scratch;
  std::vector<uint8_t> host_owner(static_cast<size_t>(s.host_pages_total), 0);
  for (int32_t h : s.host_free) {
    if (h < 0 || h >= s.host_pages_total || host_owner[h]++ != 0) {
      return absl::InternalError(absl::StrCat("host page ", h, ": free twice or out of range"));
    }
  }
  for (const auto& [rid, r] : s.reservations) {
    if (static_cast<int64_t>(r.pages.size()) != r.header.num_pages) {
      return absl::InternalError(absl::StrCat("reservation ", rid, ": holds ", r.pages.size(),
                                              " pages for an image of ", r.header.num_pages));
    }
    for (int32_t page : r.pages) ++refs[page];
  }
  for (const KVCacheState::SwapOutCopy& c : s.outs) {
    for (int32_t page : c.orphan) ++refs[page];
  }
  for (size_t slot = 0; slot < s.seqs.size(); ++slot) {
    const KVCacheState::Sequence& q = s.seqs[slot];
    if (!q.live) continue;
    const SequenceId id = q.id;
    const int64_t want = CeilDiv(q.length, ps);
    if (q.swapped) {
      if (static_cast<int64_t>(q.host_pages.size()) != want ||
          (!q.pages.empty() && static_cast<int64_t>(q.pages.size()) != want)) {
        return absl::InternalError(absl::StrCat("swapped sequence ", id, ": length ", q.length,
                                                " holds ", q.host_pages.size(), " host pages and ",
                                                q.pages.size(), " device pages"));
      }
      for (int32_t h : q.host_pages) {
        if (h < 0 || h >= s.host_pages_total || host_owner[h]++ != 0) {
          return absl::InternalError(
              absl::StrCat("swapped sequence ", id, ": host page ", h, " is not its own"));
        }
      }
    } else if (static_cast<int64_t>(q.pages.size()) != want || !q.host_pages.empty()) {
      return absl::InternalError(absl::StrCat("sequence ", id, ": length ", q.length, " holds ",
                                              q.pages.size(), " pages"));
    }
    for (int32_t page : q.pages) ++refs[page];
    const internal::TokenChain& c = q.chain;
    if (!c.tracked) continue;
    if (static_cast<int64_t>(c.hashes.size()) != q.length / ps) {
      return absl::InternalError(absl::StrCat("sequence ", id, ": length ", q.length, " tracks ",
                                              c.hashes.size(), " page hashes"));
    }
    for (size_t j = 0; j < c.hashes.size(); ++j) {
      const BlockHash h = internal::HashPage(
          j == 0 ? nullptr : &c.hashes[j - 1], s.PageTokens(q.pages[j]), c.extra_key, &scratch);
      if (h != c.hashes[j]) {
        return absl::InternalError(absl::StrCat("sequence ", id, " page ", j, ": hash ",
                                                c.hashes[j].ToHex(), ", its tokens hash to ",
                                                h.ToHex()));
      }
      if (s.allocator.Indexed(q.pages[j]) && s.allocator.HashOf(q.pages[j]) != h) {
        return absl::InternalError(absl::StrCat("sequence ", id, " page ", j, " (page ",
                                                q.pages[j], ") is indexed under another hash"));
      }
    }
  }
  for (int64_t h = 0; h < s.host_pages_total; ++h) {
    if (host_owner[h] != 1) {
      return absl::InternalError(absl::StrCat("host page ", h, ": neither free nor held"));
    }
  }
  for (int32_t p = 0; p < s.allocator.num_pages(); ++p) {
    if (refs[p] != s.allocator.RefCount(p)) {
      return absl::InternalError(absl::StrCat("page ", p, ": reference count ",
                                              s.allocator.RefCount(p), ", held by ", refs[p],
                                              " sequences"));
    }
  }
  return absl::OkStatus();
}

// ------------------------------------------------------- scales and views
absl::Status KVCache::UpdateGlobalScales(int layer, float k_scale, float v_scale, Stream stream,
                                         StoredTokens stored) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  return UpdateGlobalScalesRange(layer, 1, &k_scale, &v_scale, stream, stored);
}

absl::Status KVCache::UpdateGlobalScales(absl::Span<const float> k_scales,
                                         absl::Span<const float> v_scales, Stream stream,
                                         StoredTokens stored) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const int L = state_->options.num_layers;
  for (const auto& [v, name] :
       {std::pair<absl::Span<const float>, const char*>{k_scales, "k_scales"},
        std::pair<absl::Span<const float>, const char*>{v_scales, "v_scales"}}) {
    if (static_cast<int64_t>(v.size()) != L) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected ", L, " values (one per layer), got ", v.size()));
    }
  }
  return UpdateGlobalScalesRange(0, L, k_scales.data(), v_scales.data(), stream, stored);
}

absl::Status KVCache::UpdateGlobalScalesRange(int first, int count, const float* k_scales,
                                              const float* v_scales, Stream stream,
                                              StoredTokens stored) {
  KVCacheState& s = *state_;
  const bool one = count == 1;
  if (one) FP4KV_RETURN_IF_ERROR(s.CheckLayer(first));
  std::vector<float> vals(4 * static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    const int l = first + i;
    FP4KV_RETURN_IF_ERROR(internal::CheckScale(k_scales[i], one ? "k_scale" : "k_scales", l));
    FP4KV_RETURN_IF_ERROR(internal::CheckScale(v_scales[i], one ? "v_scale" : "v_scales", l));
    absl::StatusOr<float> kf = s.geometry.fp8_keys()
                                   ? absl::StatusOr<float>(MinFp8ScaleForFp8Keys(k_scales[i]))
                                   : MinFp8Scale(k_scales[i]);
    if (!kf.ok()) return kf.status();
    absl::StatusOr<float> vf = MinFp8Scale(v_scales[i]);
    if (!vf.ok()) return vf.status();
    vals[4 * i + 0] = k_scales[i];
    vals[4 * i + 1] = v_scales[i];
    vals[4 * i + 2] = *kf;
    vals[4 * i + 3] = *vf;
  }
  std::vector<uint8_t> reencode(count, 0);
  for (int i = 0; i < count; ++i) {
    bool r = false;
    FP4KV_RETURN_IF_ERROR(s.CheckScaleChange(first + i, stored, &r));
    reencode[i] = r;
  }
  internal::ScopedDevice scoped;
  if (s.cuda) FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  s.ClearPrefixIndex();  // cached bytes are only valid under the old scales
  for (int i = 0; i < count; ++i) {
    if (reencode[i]) FP4KV_RETURN_IF_ERROR(s.SaveOldScales(first + i, stream));
  }
  if (s.cuda) {
    // From pageable memory: staged before the call returns.
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.d_scales + 4 * first, vals.data(),
                                               vals.size() * sizeof(float), cudaMemcpyHostToDevice,
                                               reinterpret_cast<cudaStream_t>(stream)));
  } else {
    std::memcpy(s.d_scales + 4 * first, vals.data(), vals.size() * sizeof(float));
  }
  if (std::find(reencode.begin(), reencode.end(), 1) != reencode.end()) {
    // SwapIn copies still filling pages come first.
    FP4KV_RETURN_IF_ERROR(s.OrderAfterCopies(stream));
  }
  for (int i = 0; i < count; ++i) {
    if (reencode[i]) FP4KV_RETURN_IF_ERROR(s.Reencode(first + i, stream));
  }
  std::copy(vals.begin(), vals.end(), s.known_scales.begin() + 4 * first);
  std::fill(s.known.begin() + first, s.known.begin() + first + count, 1);
  return s.MarkCalibrated(first, count, stream);
}

absl::Status KVCache::CalibrateGlobalScales(int layer, const TensorView& k, const TensorView& v,
                                            Calibrator& calibrator, Stream stream,
                                            StoredTokens stored) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  const Calibrator::Options& co = calibrator.options();
  if (!(co.recipe == s.options.recipe)) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibrator: expected the cache's recipe (", RecipeName(s.options.recipe),
                     "), got ", RecipeName(co.recipe)));
  }
  if (co.device != s.options.device) {
    return absl::InvalidArgumentError(absl::StrCat("calibrator: expected device ",
                                                   s.options.device.ToString(), ", got ",
                                                   co.device.ToString()));
  }
  // Check both tensors first so a bad V cannot leave K's scales half-updated.
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{k, "k"},
                                std::pair<const TensorView&, const char*>{v, "v"}}) {
    FP4KV_RETURN_IF_ERROR(internal::CheckExtents(t, name));
    if (t.numel() > co.max_elements) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected at most ", co.max_elements,
                                                     " elements (calibrator.max_elements), got ",
                                                     t.numel()));
    }
    if (t.numel() > 0 && t.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected a tensor, got a null pointer"));
    }
    if (t.dtype != co.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected dtype ", DTypeName(co.dtype),
                                                     ", got ", DTypeName(t.dtype)));
    }
    if (t.device != co.device) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected device ",
                                                     co.device.ToString(), ", got ",
                                                     t.device.ToString()));
    }
    if (reinterpret_cast<uintptr_t>(t.data) % DTypeSize(t.dtype) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected a ", DTypeSize(t.dtype),
                                                     "-byte aligned pointer"));
    }
  }
  bool reencode = false;
  FP4KV_RETURN_IF_ERROR(s.CheckScaleChange(layer, stored, &reencode));
  internal::ScopedDevice scoped;
  if (s.cuda) FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  s.ClearPrefixIndex();  // cached bytes are only valid under the old scales
  if (reencode) FP4KV_RETURN_IF_ERROR(s.SaveOldScales(layer, stream));
  float* scales = s.d_scales + 4 * layer;
  s.known[layer] = 0;  // computed on the device
  // FP8 keys: g_k = MakeFp8KeyScale(amax), k_fp8 = g_k (the same reduction).
  FP4KV_RETURN_IF_ERROR(s.geometry.fp8_keys()
                               ? calibrator.RunFp8Key(k, nullptr, scales + 0, stream, scales + 2)
                               : calibrator.Run(k, nullptr, scales + 0, stream, scales + 2));
  FP4KV_RETURN_IF_ERROR(calibrator.Run(v, nullptr, scales + 1, stream, scales + 3));
  if (reencode) FP4KV_RETURN_IF_ERROR(s.OrderAfterCopies(stream));
  if (reencode) FP4KV_RETURN_IF_ERROR(s.Reencode(layer, stream));
  return s.MarkCalibrated(layer, 1, stream);
}

absl::StatusOr<LayerScales> KVCache::ReadScales(int layer, Stream stream) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  float vals[4];
  int32_t flags[2];
  if (s.cuda) {
    internal::ScopedDevice scoped;
    FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
    const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(vals, s.d_scales + 4 * layer, sizeof(vals),
                                               cudaMemcpyDeviceToHost, cs));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(flags, s.d_flags + 2 * layer, sizeof(flags),
                                               cudaMemcpyDeviceToHost, cs));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cs));
  } else {
    std::memcpy(vals, s.d_scales + 4 * layer, sizeof(vals));
    std::memcpy(flags, s.d_flags + 2 * layer, sizeof(flags));
  }
  LayerScales r;
  r.k = vals[0];
  r.v = vals[1];
  r.k_fp8 = vals[2];
  r.v_fp8 = vals[3];
  r.k_calibrated = flags[0] != 0;
  r.v_calibrated = flags[1] != 0;
  return r;
}

absl::StatusOr<int64_t> KVCache::LayerTokens(int layer) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  FP4KV_RETURN_IF_ERROR(state_->CheckLayer(layer));
  return state_->TokensHeld(layer);
}

absl::StatusOr<ScaleEventCounts> KVCache::ReadScaleEvents(int layer, Stream stream) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  if (!s.options.count_scale_events) {
    return absl::FailedPreconditionError(
        "ReadScaleEvents: expected a cache created with count_scale_events, got one without");
  }
  uint64_t c[4];
  if (s.cuda) {
    internal::ScopedDevice scoped;
    FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
    const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(c, s.d_events + 4 * layer, sizeof(c), cudaMemcpyDeviceToHost, cs));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cs));
  } else {
    std::memcpy(c, s.d_events + 4 * layer, sizeof(c));
  }
  return ScaleEventCounts{c[0], c[1], c[2], c[3]};
}

absl::Status KVCache::ResetScaleEvents(Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  if (!s.options.count_scale_events) {
    return absl::FailedPreconditionError(
        "ResetScaleEvents: expected a cache created with count_scale_events, got one without");
  }
  const size_t bytes = 4 * sizeof(uint64_t) * static_cast<size_t>(s.options.num_layers);
  if (!s.cuda) {
    std::memset(s.d_events, 0, bytes);
    return absl::OkStatus();
  }
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  return internal::CudaStatus(cudaMemsetAsync(s.d_events, 0, bytes, reinterpret_cast<cudaStream_t>(stream)),
                    "cudaMemsetAsync(scale events)");
}

const float* KVCache::global_scale_ptr(int layer, int kv) const {
  if (state_ == nullptr || !state_->CheckLayer(layer).ok()) return nullptr;
  return state_->d_scales + 4 * layer + (kv != 0 ? 1 : 0);
}
const float* KVCache::fp8_scale_ptr(int layer, int kv) const {
  if (state_ == nullptr || !state_->CheckLayer(layer).ok()) return nullptr;
  return state_->d_scales + 4 * layer + 2 + (kv != 0 ? 1 : 0);
}

PagedCache KVCache::LayerCache(int layer) const {
  if (state_ == nullptr || !state_->CheckLayer(layer).ok()) return PagedCache();
  return state_->LayerCache(layer);
}
const KVCacheOptions& KVCache::options() const { return state_ ? state_->options : kNoOptions; }
const CacheGeometry& KVCache::geometry() const {
  return state_ ? state_->geometry : kNoOptions.geometry;
}
int KVCache::num_layers() const { return state_ ? state_->options.num_layers : 0; }
Device KVCache::device() const { return state_ ? state_->options.device : Device::Cpu(); }

KVCacheStats KVCache::Stats() const {
  if (state_ == nullptr) return KVCacheStats();
  state_->FlushIndex();  // logically part of the earlier steps
  state_->PollSwaps();
  const KVCacheState& s = *state_;
  const int ps = s.geometry.page_size;
  KVCacheStats st;
  st.pages_reserved = s.reserved_pages;
  st.reservations = static_cast<int64_t>(s.reservations.size());
  st.bytes_exported = s.bytes_exported;
  st.bytes_imported = s.bytes_imported;
  st.host_pages_total = s.host_pages_total;
  st.host_pages_free = static_cast<int64_t>(s.host_free.size());
  st.host_pages_used = st.host_pages_total - st.host_pages_free;
  st.host_bytes = s.host_pages_total > 0 ? s.host_layout.total_bytes : 0;
  st.swaps_in_flight = static_cast<int64_t>(s.outs.size());
  st.pages_swap_pending = s.PagesSwapPending();
  st.bytes_swapped_out = s.bytes_swapped_out;
  st.bytes_swapped_in = s.bytes_swapped_in;
  st.pages_total = s.allocator.num_pages();
  st.pages_free = s.allocator.free_count();
  st.pages_used = s.allocator.used_count();
  st.pages_cached = s.allocator.cached_count();
  st.evictions = s.allocator.evictions();
  st.prefix_queries = s.prefix_queries;
  st.prefix_query_tokens = s.prefix_query_tokens;
  st.prefix_hit_tokens = s.prefix_hit_tokens;
  st.prefix_hit_rate = s.prefix_query_tokens > 0 ? static_cast<double>(s.prefix_hit_tokens) /
                                                       static_cast<double>(s.prefix_query_tokens)
                                                 : 0.0;
  st.events_pending = static_cast<int64_t>(s.events.pending());
  st.events_dropped = static_cast<int64_t>(s.events.dropped_total());
  st.num_sequences = s.live_sequences;
  st.pool_bytes = s.pool.total_bytes;
  st.bytes_per_token = s.geometry.BytesPerToken() * s.options.num_layers;
  for (size_t slot = 0; slot < s.seqs.size(); ++slot) {
    const KVCacheState::Sequence& q = s.seqs[slot];
    if (!q.live) continue;
    st.tokens_stored += q.length;
    st.sequences_swapped += q.swapped ? 1 : 0;
    st.sequence_lengths.emplace_back(q.id, q.length);
  }
  std::sort(st.sequence_lengths.begin(), st.sequence_lengths.end());
  for (int32_t p = 0; p < s.allocator.num_pages(); ++p) {
    if (s.allocator.RefCount(p) > 1) ++st.pages_shared;
    if (s.allocator.Indexed(p)) ++st.pages_indexed;
  }
  // Partially filled last pages count their fill level, unless another
  // holder has the page full.
  st.tokens_resident = s.TokensResident();
  st.wasted_slots = st.pages_used * ps - st.tokens_resident;
  return st;
}


// ------------------------------------------------------- export and import
namespace internal {
namespace {

enum class MemKind { kDevice, kPinned, kPageable };

// Where `p` lives for cache `s`, and the address a kernel uses (device and
// pinned memory). The CPU device: pageable host memory.
absl::Status ClassifyMemory(const KVCacheState& s, const void* p, const char* name,
                            MemKind* kind, const uint8_t** dev) {
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
  if (s.prefix && q.chain.tracked) {
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
    const int32_t id = s.page_tokens[static_cast<int64_t>(q.pages[t / ps]) * ps + t % ps];
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
      const int64_t pb = s.pool.regions[r].page_bytes;
      if (pb == 0) continue;  // the K scales of FP8 keys
      uint8_t* pool = s.pools.get() + l * s.pool.layer_bytes + s.pool.regions[r].offset;
      uint8_t* img = image + h.layers_offset + l * h.layer_bytes + h.region_offset[r];
      for (int64_t i = 0; i < n;) {
        int64_t j = i + 1;
        while (j < n && pages[j] == pages[j - 1] + 1) ++j;
        uint8_t* a = img + i * pb;
        uint8_t* b = pool + static_cast<int64_t>(pages[i]) * pb;
        FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
            to_image ? a : b, to_image ? b : a, static_cast<size_t>((j - i) * pb),
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
  p.src = s.pools.get();
  p.src_layer_stride = s.pool.layer_bytes;
  p.dst = image + h.layers_offset;
  p.dst_layer_stride = h.layer_bytes;
  for (int r = 0; r < 4; ++r) {
    p.src_region[r] = s.pool.regions[r].offset;
    p.dst_region[r] = h.region_offset[r];
    p.page_bytes[r] = s.pool.regions[r].page_bytes;
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
  p.dst = s.pools.get();
  p.dst_layer_stride = s.pool.layer_bytes;
  for (int r = 0; r < 4; ++r) {
    p.src_region[r] = h.region_offset[r];
    p.dst_region[r] = s.pool.regions[r].offset;
    p.page_bytes[r] = s.pool.regions[r].page_bytes;
  }
  p.dst_ids = ids;
  p.num_pages = n;
  p.num_layers = s.options.num_layers;
  return p;
}

absl::Status CheckImagePointer(const void* p, const char* name) {
  if (p == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, ": expected memory, got null"));
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected a 16-byte aligned address, got 0x",
                     absl::Hex(reinterpret_cast<uintptr_t>(p))));
  }
  return absl::OkStatus();
}

void CancelReservation(KVCacheState& s, uint64_t id) {
  auto it = s.reservations.find(id);
  if (it == s.reservations.end()) return;
  for (size_t j = it->second.pages.size(); j-- > 0;) s.allocator.Release(it->second.pages[j]);
  s.reserved_pages -= static_cast<int64_t>(it->second.pages.size());
  s.reservations.erase(it);
}

}  // namespace
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
  std::vector<uint8_t> tokens;
  if (h.has_tokens()) {
    tokens.resize(static_cast<size_t>(h.tokens_bytes));
    internal::WriteTokens(s, *q, h, tokens.data());
  }
  const int L = s.options.num_layers;
  const int64_t n = static_cast<int64_t>(q->pages.size());
  if (!s.cuda) {
    std::memcpy(out, header, sizeof(header));
    std::memcpy(out + h.scales_offset, s.d_scales, 16 * static_cast<size_t>(L));
    std::memcpy(out + h.scales_offset + 16 * L, s.d_flags, 8 * static_cast<size_t>(L));
    if (!tokens.empty()) std::memcpy(out + h.tokens_offset, tokens.data(), tokens.size());
    internal::ReferencePageCopy(internal::PoolToImage(s, h, out, q->pages.data(), n));
    s.bytes_exported += h.image_bytes;
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
  FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out + h.scales_offset, s.d_scales,
                                             16 * static_cast<size_t>(L), cudaMemcpyDefault, cs));
  FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out + h.scales_offset + 16 * L, s.d_flags,
                                             8 * static_cast<size_t>(L), cudaMemcpyDefault, cs));
  if (n > 0) {
    if (kind == internal::MemKind::kPageable) {
      FP4KV_RETURN_IF_ERROR(internal::PageableCopy(s, h, out, q->pages, true, cs));
    } else {
      int32_t* ids = reinterpret_cast<int32_t*>(s.d_step + s.step_layout.xfer_ids);
      FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ids, q->pages.data(), 4 * static_cast<size_t>(n),
                                                 cudaMemcpyHostToDevice, cs));
      internal::PageCopyParams p = internal::PoolToImage(s, h, const_cast<uint8_t*>(dev), ids, n);
      if (kind == internal::MemKind::kPinned) p.max_ctas = internal::kHostCopyCtas;
      FP4KV_RETURN_IF_ERROR(internal::LaunchPageCopy(p, stream));
    }
  }
  s.bytes_exported += h.image_bytes;
  return absl::OkStatus();
}

absl::StatusOr<ImportReservation> KVCache::ReserveImport(const SequenceImageHeader& header) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
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
    return absl::InvalidArgumentError(
        absl::StrCat("header.length: expected at most max_pages_per_seq * page_size = ",
                     int64_t{s.options.max_pages_per_seq} * g.page_size, " tokens, got ", h.length));
  }
  FP4KV_RETURN_IF_ERROR(s.MakeAvailable(n, "ReserveImport"));
  internal::KVCacheState::Reservation r;
  r.header = h;
  r.pages.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) r.pages.push_back(s.allocator.Allocate());
  const uint64_t id = s.next_reservation++;
  s.reserved_pages += n;
  s.reservations.emplace(id, std::move(r));
  ImportReservation out;
  out.book_ = s.book;
  out.id_ = id;
  out.header_ = h;
  return out;
}

absl::Status KVCache::CancelImport(ImportReservation reservation) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  if (reservation.id_ == 0 || reservation.book_.lock() != s.book ||
      s.reservations.count(reservation.id_) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reservation: expected an open reservation of this cache, got id ", reservation.id_,
        reservation.id_ == 0 ? " (empty)" : ""));
  }
  internal::CancelReservation(s, reservation.id_);
  reservation.id_ = 0;
  return absl::OkStatus();
}

absl::StatusOr<SequenceId> KVCache::CommitImport(ImportReservation reservation, const void* image,
                                                 int64_t image_bytes,
                                                 const ImportOptions& options, Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  auto it = s.reservations.end();
  if (reservation.id_ != 0 && reservation.book_.lock() == s.book) {
    it = s.reservations.find(reservation.id_);
  }
  if (it == s.reservations.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reservation: expected an open reservation of this cache, got id ", reservation.id_,
        reservation.id_ == 0 ? " (empty)" : ""));
  }
  const SequenceImageHeader h = it->second.header;
  const int L = s.options.num_layers;
  const int64_t n = h.num_pages;
  const int64_t ps = s.geometry.page_size;
  FP4KV_RETURN_IF_ERROR(internal::CheckImagePointer(image, "image"));
  if (image_bytes < h.image_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("image_bytes: expected at least ",
                                                   h.image_bytes, " (the reserved image's size), got ",
                                                   image_bytes));
  }
  if (options.on_scale_mismatch != ScaleMismatch::kRefuse &&
      options.on_scale_mismatch != ScaleMismatch::kRequantize) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.on_scale_mismatch: expected kRefuse (0) or kRequantize (1), got ",
                     static_cast<int>(options.on_scale_mismatch)));
  }
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  internal::MemKind kind;
  const uint8_t* dev = nullptr;
  FP4KV_RETURN_IF_ERROR(internal::ClassifyMemory(s, image, "image", &kind, &dev));
  const uint8_t* in = static_cast<const uint8_t*>(image);
  const bool host_image = kind != internal::MemKind::kDevice;
  const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
  if (host_image) {
    uint8_t want[kSequenceImageHeaderBytes];
    SerializeSequenceImageHeader(h, want);
    if (std::memcmp(want, in, sizeof(want)) != 0) {
      absl::StatusOr<SequenceImageHeader> got = ParseSequenceImageHeader(in, sizeof(want));
      return absl::InvalidArgumentError(absl::StrCat(
          "image: expected the image whose header was reserved, got one whose header differs",
          got.ok() ? "" : absl::StrCat(" (", got.status().message(), ")")));
    }
  }

  // Scales, per layer and side: adopt (a pending side holding no tokens),
  // else equal (proven by the host-known fingerprints, or checked) or
  // requantized.
  std::vector<uint8_t> adopt(2 * static_cast<size_t>(L), 0);
  bool any_adopt = false, any_kept = false;
  const bool swapped_tokens = s.SwappedTokens() > 0;
  for (int l = 0; l < L; ++l) {
    const bool empty = s.TokensHeld(l) == 0 && !swapped_tokens;
    for (int kv = 0; kv < 2; ++kv) {
      adopt[2 * l + kv] = empty && s.h_flags[2 * l + kv] == 0;
      any_adopt |= adopt[2 * l + kv] != 0;
      any_kept |= adopt[2 * l + kv] == 0;
    }
  }
  uint64_t fingerprint = 0;
  const bool proven = (h.flags & kSequenceImageScalesKnown) != 0 && s.ScaleFingerprint(&fingerprint) &&
                      fingerprint == h.scale_fingerprint;
  bool requantize = false;
  if (any_kept && !proven) {
    if (options.on_scale_mismatch == ScaleMismatch::kRequantize) {
      requantize = true;
    } else {
      // Read both tables: a host sync.
      std::vector<float> image_scales(4 * static_cast<size_t>(L)), target(4 * static_cast<size_t>(L));
      const size_t table = 16 * static_cast<size_t>(L);
      if (!s.cuda) {
        std::memcpy(image_scales.data(), in + h.scales_offset, table);
        std::memcpy(target.data(), s.d_scales, table);
      } else {
        FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(target.data(), s.d_scales, table,
                                                   cudaMemcpyDeviceToHost, cs));
        if (!host_image) {
          FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(image_scales.data(), in + h.scales_offset,
                                                     table, cudaMemcpyDeviceToHost, cs));
        }
        FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cs));
        if (host_image) std::memcpy(image_scales.data(), in + h.scales_offset, table);
      }
      for (int l = 0; l < L; ++l) {
        for (int kv = 0; kv < 2; ++kv) {
          const float a = image_scales[4 * l + kv], b = target[4 * l + kv];
          if (adopt[2 * l + kv] == 0 && FloatBits(a) != FloatBits(b)) {
            return absl::FailedPreconditionError(absl::StrCat(
                "CommitImport: layer ", l, kv == 0 ? " K" : " V", ": the image's global scale ", a,
                " differs from this cache's ", b,
                " (pass ImportOptions{ScaleMismatch::kRequantize} to requantize the pages); the "
                "reservation is cancelled, nothing else changed"));
          }
        }
      }
    }
  }

  // Tokens (prefix caching): read and checked before anything changes.
  const bool tokens = s.prefix && h.has_tokens();
  std::vector<uint8_t> tok;
  std::vector<BlockHash> hashes;
  if (tokens) {
    tok.resize(static_cast<size_t>(h.tokens_bytes));
    if (host_image) {
      std::memcpy(tok.data(), in + h.tokens_offset, tok.size());
    } else {
      FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tok.data(), in + h.tokens_offset, tok.size(),
                                                 cudaMemcpyDeviceToHost, cs));
      FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cs));
    }
    const absl::string_view key(reinterpret_cast<const char*>(tok.data()),
                                static_cast<size_t>(h.extra_key_bytes));
    const int32_t* ids = reinterpret_cast<const int32_t*>(tok.data() + internal::TokenIdsOffset(h));
    const uint8_t* stored = tok.data() + internal::TokenHashesOffset(h);
    for (int64_t j = 0; j < h.length / ps; ++j) {
      const BlockHash hj = internal::HashPage(
          j == 0 ? nullptr : &hashes.back(),
          absl::Span<const int32_t>(ids + j * ps, static_cast<size_t>(ps)), key, &s.hash_scratch);
      BlockHash want;
      std::memcpy(&want.low, stored + 16 * j, 8);
      std::memcpy(&want.high, stored + 16 * j + 8, 8);
      if (hj != want) {
        return absl::DataLossError(absl::StrCat(
            "image: page ", j, " of the tokens section: stored hash ", want.ToHex(),
            ", its token ids hash to ", hj.ToHex(), "; the reservation is cancelled"));
      }
      hashes.push_back(hj);
    }
  }

  // Commit: the reserved pages become the sequence.
  std::vector<int32_t> pages = std::move(it->second.pages);
  s.reservations.erase(it);
  s.reserved_pages -= n;
  reservation.id_ = 0;
  const SequenceId id = CreateSequence();
  KVCacheState::Sequence& q = *s.Find(id);
  q.pages = std::move(pages);
  q.length = h.length;
  q.chain.Reset(tokens, tokens ? absl::string_view(reinterpret_cast<const char*>(tok.data()),
                                                   static_cast<size_t>(h.extra_key_bytes))
                               : absl::string_view());
  if (tokens) {
    const int32_t* ids = reinterpret_cast<const int32_t*>(tok.data() + internal::TokenIdsOffset(h));
    for (int64_t t = 0; t < h.length; ++t) {
      s.page_tokens[static_cast<int64_t>(q.pages[t / ps]) * ps + t % ps] = ids[t];
    }
    // Indexed by the next FlushIndex, like pages a step completed.
    if (!s.Calibrated()) q.chain.index_from = static_cast<size_t>(h.length / ps);
    if (h.length / ps > 0) {
      q.chain.queued = true;
      s.unhashed.push_back(s.slot_of[id]);
    }
  }
  for (int l = 0; l < L; ++l) {
    if (adopt[2 * l] || adopt[2 * l + 1]) s.known[l] = 0;
  }

  float* d_import = reinterpret_cast<float*>(s.d_step + s.step_layout.import_scales);
  uint8_t* d_mask = s.d_step + s.step_layout.adopt_mask;
  int32_t* ids = reinterpret_cast<int32_t*>(s.d_step + s.step_layout.xfer_ids);
  internal::AdoptScalesParams ap;
  ap.image_scales = d_import;
  ap.image_flags = reinterpret_cast<const int32_t*>(d_import + 4 * L);
  ap.mask = d_mask;
  ap.scales = s.d_scales;
  ap.flags = s.d_flags;
  ap.host_flags = s.cuda ? s.h_flags_dev : nullptr;
  ap.num_layers = L;
  internal::RequantizePagesParams rp;
  rp.pool = s.pools.get();
  rp.layer_stride = s.pool.layer_bytes;
  for (int r = 0; r < 4; ++r) {
    rp.region[r] = s.pool.regions[r].offset;
    rp.page_bytes[r] = s.pool.regions[r].page_bytes;
  }
  rp.pages = s.cuda ? ids : q.pages.data();
  rp.num_pages = n;
  rp.num_layers = L;
  rp.src_scales = d_import;
  rp.dst_scales = s.d_scales;
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
    s.bytes_imported += h.image_bytes;
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
    run(internal::CudaStatus(cudaMemcpyAsync(ids, q.pages.data(), 4 * static_cast<size_t>(n),
                                             cudaMemcpyHostToDevice, cs),
                             "cudaMemcpyAsync(import page ids)"));
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
  s.bytes_imported += h.image_bytes;
  return id;
}

absl::StatusOr<SequenceId> KVCache::ImportSequence(const void* image, int64_t image_bytes,
                                                   const ImportOptions& options, Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(internal::CheckImagePointer(image, "image"));
  if (image_bytes < kSequenceImageHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("image_bytes: expected at least ",
                                                   kSequenceImageHeaderBytes,
                                                   " (a header), got ", image_bytes));
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
    return absl::InvalidArgumentError(absl::StrCat("image_bytes: expected at least ",
                                                   h->image_bytes, " (the header's image_bytes), got ",
                                                   image_bytes));
  }
  absl::StatusOr<ImportReservation> r = ReserveImport(*h);
  if (!r.ok()) return r.status();
  return CommitImport(*std::move(r), image, image_bytes, options, stream);
}

// ---------------------------------------------------------------- host tier
absl::StatusOr<bool> KVCache::IsSwappedOut(SequenceId seq) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState::Sequence* q = state_->Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  return q->swapped;
}

absl::Status KVCache::SynchronizeSwaps() {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  if (s.copy_stream != nullptr) {
    internal::ScopedDevice scoped;
    FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s.copy_stream));
  }
  return s.WaitSwapOuts();
}

absl::Status KVCache::SwapOut(SequenceId seq, Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  s.PollSwaps();
  KVCacheState::Sequence* q = s.Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  if (s.host_pages_total == 0) {
    return absl::FailedPreconditionError(
        "SwapOut: expected a cache with a host tier (KVCacheOptions::host_tier), got one without");
  }
  if (q->swapped) {
    return absl::FailedPreconditionError(
        absl::StrCat("SwapOut: sequence ", seq, " is already swapped out"));
  }
  const int64_t n = static_cast<int64_t>(q->pages.size());
  if (n > static_cast<int64_t>(s.host_free.size())) {
    return absl::ResourceExhaustedError(absl::StrCat("SwapOut: sequence ", seq, " needs ", n,
                                                     " host pages, the host tier has ",
                                                     s.host_free.size(), " free of ",
                                                     s.host_pages_total, "; nothing changed"));
  }
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  std::vector<int32_t> host(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) host[i] = s.host_free[s.host_free.size() - 1 - i];
  int event = -1;
  if (s.cuda && n > 0) {
    FP4KV_RETURN_IF_ERROR(s.EnqueueSwapCopy(q->pages, host, /*to_host=*/true, stream, &event));
  } else if (n > 0) {
    internal::ReferencePageCopy(s.PoolToHost(q->pages.data(), host.data(), n));
  }
  // Committed.
  s.host_free.resize(s.host_free.size() - static_cast<size_t>(n));
  s.DropSwapIn(*q);
  q->swapped = true;
  q->host_pages = std::move(host);
  if (q->chain.tracked) q->chain.Untrack();
  s.bytes_swapped_out += n * s.PageBytesAllLayers();
  if (event >= 0) {
    s.outs.push_back(KVCacheState::SwapOutCopy{event, seq, {}});  // pages dropped when it is done
  } else {
    s.ReleasePages(*q);
  }
  return absl::OkStatus();
}

absl::Status KVCache::SwapIn(SequenceId seq, Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.FlushIndex();
  s.PollSwaps();
  KVCacheState::Sequence* q = s.Find(seq);
  if (q == nullptr) return KVCacheState::Unknown("seq", seq);
  if (!q->swapped) {
    return absl::FailedPreconditionError(
        absl::StrCat("SwapIn: sequence ", seq, " is not swapped out"));
  }
  if (!q->pages.empty()) {
    // Its copy to the host is still in flight: the device pages still hold
    // the data, so keep them; the host pages are only ever rewritten by
    // later copies on the copy stream, which come after this one.
    for (KVCacheState::SwapOutCopy& c : s.outs) {
      if (c.seq == seq) c.seq = 0;
    }
    for (int32_t h : q->host_pages) s.host_free.push_back(h);
    q->host_pages.clear();
    q->swapped = false;
    return absl::OkStatus();
  }
  const int64_t n = static_cast<int64_t>(q->host_pages.size());
  FP4KV_RETURN_IF_ERROR(s.MakeAvailable(n, "SwapIn"));
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  std::vector<int32_t> pages;
  pages.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pages.push_back(s.allocator.Allocate());
  int event = -1;
  if (s.cuda && n > 0) {
    if (absl::Status st = s.EnqueueSwapCopy(pages, q->host_pages, /*to_host=*/false, stream, &event);
        !st.ok()) {
      for (size_t j = pages.size(); j-- > 0;) s.allocator.Release(pages[j]);
      return st;
    }
  } else if (n > 0) {
    internal::ReferencePageCopy(s.HostToPool(q->host_pages.data(), pages.data(), n));
  }
  for (int32_t h : q->host_pages) s.host_free.push_back(h);
  q->host_pages.clear();
  q->pages = std::move(pages);
  ++q->epoch;
  q->swapped = false;
  q->swapin_event = event;
  if (event >= 0) s.event_refs[event] = 1;
  s.bytes_swapped_in += n * s.PageBytesAllLayers();
  return absl::OkStatus();
}

}  // namespace fp4kv
