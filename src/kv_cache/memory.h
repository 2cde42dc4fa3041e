// Internal (KVCache): byte layouts of the pools and the step buffers, owned
// allocations, and the current-device scope.
#ifndef FP4KV_SRC_KV_CACHE_MEMORY_H_
#define FP4KV_SRC_KV_CACHE_MEMORY_H_

#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "fp4kv/geometry.h"
#include "absl/status/statusor.h"
#include "fp4kv/tensor.h"
#include "src/cuda_util.h"
#include "src/host_alloc.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {

constexpr int64_t kRegionAlign = 256;  // every pool region and step buffer
constexpr int64_t kHostAlign = 256;    // as cudaMalloc: regions stay 256-byte aligned
// Host allocations from this size on are anonymous mappings (lazily zeroed
// by the kernel); smaller ones come from calloc (and AddressSanitizer sees
// their bounds).
constexpr int64_t kHostMapBytes = int64_t{64} << 20;
// Longest sequence of the default max_pages_per_seq (KVCacheOptions).
constexpr int64_t kDefaultMaxSeqTokens = 32768;
// CTAs of a page copy to or from host memory (PCIe-bound; see PageCopyParams).
// Few: 24 CTAs of 256 threads keep enough bytes in flight to fill PCIe, and
// leave the SMs to the steps that run beside the copy. On an H200, one run
// for each count: a 64-sequence, 32-layer decode step beside a 4096-page
// promotion took 6.30 ms against 6.15 alone with 24 CTAs (6.21 with 16, 6.86
// with 32, 9.3 with 64, 52.1 with 512); the promotion itself 85.2% of a
// pinned cudaMemcpyAsync with 24 (70.7% with 16, 81.7% with 32), the
// demotion 94.9% with 16, 24 or 32.
constexpr int kHostCopyCtas = 24;
// A host copy of at most this many (layer, page) units runs one CTA a unit
// (one short wave): a 1-page promotion of 32 layers took 21.1 us against
// 22.8 us on 24 CTAs, 8 of them copying two units in turn (H200).
constexpr int64_t kHostCopyBurstUnits = 128;

inline int64_t RoundUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

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
bool ComputePoolLayout(const CacheGeometry& g, int num_layers, PoolLayout* out);

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
  // stream), of a swap [2, n <= max_pages_per_seq] i32 (the copy stream), and an
  // image's scale table [L, 4] f32 + [L, 2] i32.
  int64_t xfer_ids = 0, swap_ids = 0, import_scales = 0, adopt_mask = 0;  // mask [L, 2] u8
  int64_t device_bytes = 0;
};

// The offsets for the given capacities.
StepLayout ComputeStepLayout(int64_t seqs, int64_t tokens, int64_t pages_per_seq, int layers);

// One owned allocation: host (256-byte aligned), pinned host, or device.
class Memory {
 public:
  enum class Kind { kNone, kHost, kPinned, kPinnedMapped, kDevice };

  Memory() = default;
  ~Memory() { Reset(); }
  Memory(Memory&& o) noexcept
      : kind_(o.kind_), ptr_(o.ptr_), base_(o.base_), mapped_(o.mapped_) {
    o.kind_ = Kind::kNone;
    o.ptr_ = nullptr;
    o.base_ = nullptr;
    o.mapped_ = 0;
  }
  Memory& operator=(Memory&& o) noexcept {
    if (this != &o) {
      Reset();
      kind_ = o.kind_;
      ptr_ = o.ptr_;
      base_ = o.base_;
      mapped_ = o.mapped_;
      o.kind_ = Kind::kNone;
      o.ptr_ = nullptr;
      o.base_ = nullptr;
      o.mapped_ = 0;
    }
    return *this;
  }
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  // Allocates and zeroes `bytes` (> 0); ResourceExhausted naming `call`,
  // `what` and the size when it cannot. Device memory goes on the current
  // CUDA device.
  absl::Status Allocate(Kind kind, int64_t bytes, const char* what,
                        const char* call = "KVCache::Create") {
    Reset();
    if (bytes <= 0 || bytes > INT64_MAX - kHostAlign) {
      return absl::ResourceExhaustedError(
          absl::StrCat(call, ": cannot allocate ", bytes, " bytes for ", what));
    }
    void* p = nullptr;
    const size_t n = static_cast<size_t>(RoundUp(bytes, kHostAlign));
    cudaError_t err = cudaSuccess;
    switch (kind) {
      case Kind::kHost:
        if (n >= kHostMapBytes) {
          // Anonymous pages: zeroed by the kernel as they are first touched
          // (no up-front fill of a whole pool), page-aligned.
          void* m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
          if (m != MAP_FAILED) {
            p = base_ = m;
            mapped_ = n;
          }
        } else {
          base_ = std::calloc(1, n + kHostAlign);
          if (base_ != nullptr) {
            p = reinterpret_cast<void*>(static_cast<uintptr_t>(RoundUp(
                static_cast<int64_t>(reinterpret_cast<uintptr_t>(base_)), kHostAlign)));
          }
        }
        break;
      case Kind::kPinned:
      case Kind::kPinnedMapped:
        err = cudaHostAlloc(&p, n,
                            kind == Kind::kPinned ? cudaHostAllocDefault : cudaHostAllocMapped);
        if (err == cudaSuccess) std::memset(p, 0, n);  // pinned: resident anyway
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
          absl::StrCat(call, ": cannot allocate ", bytes, " bytes for ", what,
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
        if (mapped_ > 0) {
          (void)munmap(base_, mapped_);
        } else {
          std::free(base_);
        }
        base_ = nullptr;
        mapped_ = 0;
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
  void* base_ = nullptr;  // kHost: what calloc or mmap returned (ptr_ is aligned up from it)
  size_t mapped_ = 0;     // kHost: bytes of an mmap (0: calloc)
};

// The most pages (at most INT32_MAX; 0 if not even one) of geometry g whose
// pools for num_layers layers fit in budget bytes, with their layout.
int64_t MostPagesWithin(const CacheGeometry& g, int num_layers, int64_t budget,
                        internal::PoolLayout* layout);

// What Create sizes against the memory available (docs/kv_cache.md,
// "Allocation and budget rules").
struct CapacityInput {
  CacheGeometry geometry;  // num_pages: given, or derived from `budget`
  int num_layers = 0;
  Device device;
  bool prefix_cache = false;
  bool events = false;  // KV events kept (KVEventQueue::Reserve's bytes a page)
  int64_t max_seqs_per_step = 0, max_tokens_per_step = 0, max_pages_per_seq = 0;
  int64_t host_pages = 0;  // host tier
  // Host tier of the prefix cache (PrefixCacheOptions::host_bytes): its pool
  // and per-page bookkeeping (links, hash, token ids, index).
  int64_t prefix_host_pages = 0;
  int64_t step_slots = 1;  // KVCacheOptions::step_slots
  int64_t budget = 0;      // memory_budget_bytes (0: num_pages was given)
};

struct Capacity {
  int64_t num_pages = 0;  // the pages to allocate (below the budget's when clamped)
  int64_t available = 0;  // bytes the pools' device (CPU: host memory) had available
  bool clamped = false;   // the budget asked for more than was available
};

// Fraction of the available memory a budget may take: 1 - 1/kReserveDivisor
// (the rest stays with the process: CUDA context, workspaces, the server).
constexpr int64_t kReserveDivisor = 16;

// Checks that the pools, step buffers, staging, host tier and bookkeeping
// of `in` fit in the memory available now (cudaMemGetInfo on the current
// device; HostMemoryAvailable() for host memory), and clamps a budget to it:
// ResourceExhausted with the bytes asked and available when given pages (or
// a host tier) do not fit, or not even one page fits.
absl::StatusOr<Capacity> PlanCapacity(const CapacityInput& in);

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_KV_CACHE_MEMORY_H_
