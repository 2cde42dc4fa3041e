// Internal: host allocations that can be large (per-page and per-slot
// bookkeeping, capacity-sized scratch), made without letting an exception or
// an abort out of the library.
//
// Containers whose size follows a caller's numbers are HostVector<T>: a
// std::vector whose allocator takes memory from malloc (never from operator
// new, which under AddressSanitizer aborts instead of throwing) and reports a
// failure as std::bad_alloc. That exception never leaves this header's
// helpers: SizeHost / ReserveHost size a container and return
// ResourceExhausted naming what could not be had and how many bytes were
// asked, with the byte count computed overflow-checked before anything is
// allocated. After a successful SizeHost / ReserveHost a container is used
// within that capacity (no allocation on the hot path).
#ifndef FP4KV_SRC_HOST_ALLOC_H_
#define FP4KV_SRC_HOST_ALLOC_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace fp4kv {
namespace internal {

// malloc-based allocator: a failed allocation is std::bad_alloc thrown here
// (caught by the helpers below), never an abort.
template <typename T>
struct HostAllocator {
  using value_type = T;
  HostAllocator() = default;
  template <typename U>
  HostAllocator(const HostAllocator<U>&) noexcept {}  // NOLINT(runtime/explicit)
  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_alloc();
    void* p = std::malloc(n * sizeof(T) == 0 ? 1 : n * sizeof(T));
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) noexcept { std::free(p); }
  template <typename U>
  bool operator==(const HostAllocator<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const HostAllocator<U>&) const noexcept {
    return false;
  }
};

template <typename T>
using HostVector = std::vector<T, HostAllocator<T>>;

// `count` elements of `elem_bytes` bytes: false when count < 0 or the
// product does not fit in int64 (nothing that large can be allocated).
inline bool ArrayBytes(int64_t count, int64_t elem_bytes, int64_t* bytes) {
  return count >= 0 && !__builtin_mul_overflow(count, elem_bytes, bytes);
}

// ResourceExhausted: "<call>: cannot allocate <bytes> bytes of host memory
// for <what>".
inline absl::Status HostAllocError(const char* call, const char* what, int64_t count,
                                   int64_t elem_bytes) {
  int64_t bytes = 0;
  const std::string size =
      ArrayBytes(count, elem_bytes, &bytes)
          ? absl::StrCat(bytes, " bytes")
          : absl::StrCat(count, " x ", elem_bytes, " bytes (beyond int64)");
  return absl::ResourceExhaustedError(
      absl::StrCat(call, ": cannot allocate ", size, " of host memory for ", what));
}

// Host memory the process can still take now, in bytes: the least of
// MemAvailable (/proc/meminfo), the cgroup's memory limit less its usage and
// the address-space limit (RLIMIT_AS) less the address space in use.
// INT64_MAX when none of these is known.
int64_t HostMemoryAvailable();

// Requests of at least this many bytes are checked against
// HostMemoryAvailable() before they are made (smaller ones skip the read).
inline constexpr int64_t kHostCheckBytes = int64_t{64} << 20;

// Runs `allocate` (allocations of HostAllocator containers only) for `count`
// elements of `elem_bytes`; a failure becomes HostAllocError. The size is
// checked first, so an impossible one allocates nothing.
template <typename F>
absl::Status TryHostAlloc(const char* call, const char* what, int64_t count, int64_t elem_bytes,
                          F&& allocate) {
  int64_t bytes = 0;
  if (!ArrayBytes(count, elem_bytes, &bytes) || static_cast<uint64_t>(bytes) > PTRDIFF_MAX) {
    return HostAllocError(call, what, count, elem_bytes);
  }
  // Where the kernel overcommits (vm.overcommit_memory=1), malloc grants any
  // size and the process is killed when the pages are touched: a large
  // request is checked against the memory the process can take first.
  if (bytes >= kHostCheckBytes) {
    const int64_t available = HostMemoryAvailable();
    if (bytes > available) {
      return absl::ResourceExhaustedError(
          absl::StrCat(HostAllocError(call, what, count, elem_bytes).message(), " (",
                       available, " bytes available)"));
    }
  }
  try {
    allocate();
  } catch (const std::bad_alloc&) {
    return HostAllocError(call, what, count, elem_bytes);
  } catch (const std::length_error&) {
    return HostAllocError(call, what, count, elem_bytes);
  }
  return absl::OkStatus();
}

// *v becomes `count` copies of `value` (its old content is dropped).
template <typename T>
absl::Status SizeHost(HostVector<T>* v, int64_t count, const T& value, const char* call,
                      const char* what) {
  return TryHostAlloc(call, what, count, sizeof(T),
                      [&] { v->assign(static_cast<size_t>(count), value); });
}

// Capacity for `count` elements in *v.
template <typename T>
absl::Status ReserveHost(HostVector<T>* v, int64_t count, const char* call, const char* what) {
  return TryHostAlloc(call, what, count, sizeof(T),
                      [&] { v->reserve(static_cast<size_t>(count)); });
}

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_HOST_ALLOC_H_
