// Internal: least-recently-used lists of the elements [0, n), one per
// retention priority (0 .. kPriorities - 1), doubly linked through per-element
// prev/next (-1 ends), each head the least recently used. An element's
// priority names the list it is on; it is set while the element is on none.
// The page pool keeps its cached device pages on one, the prefix cache's host
// tier its cached host pages: room is made from the least recently used
// element of the lowest priority.
#ifndef FP4KV_SRC_PRIORITY_LRU_H_
#define FP4KV_SRC_PRIORITY_LRU_H_

#include <cstdint>

#include "absl/status/status.h"
#include "src/host_alloc.h"

namespace fp4kv {
namespace internal {

class PriorityLru {
 public:
  static constexpr int kPriorities = 4;

  // n elements on no list, priority 0; `call` names the caller and `what`
  // the lists in an allocation error.
  absl::Status Init(int64_t n, const char* call, const char* what) {
    absl::Status st = SizeHost(&prev_, n, int32_t{-1}, call, what);
    if (st.ok()) st = SizeHost(&next_, n, int32_t{-1}, call, what);
    if (st.ok()) st = SizeHost(&prio_, n, uint8_t{0}, call, what);
    for (int k = 0; k < kPriorities; ++k) head_[k] = tail_[k] = -1;
    return st;
  }

  void Unlink(int32_t e) {
    const int k = prio_[e];
    const int32_t a = prev_[e], b = next_[e];
    (a >= 0 ? next_[a] : head_[k]) = b;
    (b >= 0 ? prev_[b] : tail_[k]) = a;
    prev_[e] = next_[e] = -1;
  }
  // Appends e (on no list) as the most recently used of its priority.
  void PushBack(int32_t e) {
    const int k = prio_[e];
    prev_[e] = tail_[k];
    next_[e] = -1;
    (tail_[k] >= 0 ? next_[tail_[k]] : head_[k]) = e;
    tail_[k] = e;
  }

  int priority(int32_t e) const { return prio_[e]; }
  void set_priority(int32_t e, int k) { prio_[e] = static_cast<uint8_t>(k); }
  int32_t head(int k) const { return head_[k]; }
  int32_t tail(int k) const { return tail_[k]; }
  int32_t prev(int32_t e) const { return prev_[e]; }
  int32_t next(int32_t e) const { return next_[e]; }
  // The least recently used element of the lowest priority, or -1.
  int32_t Victim() const {
    for (int k = 0; k < kPriorities; ++k) {
      if (head_[k] >= 0) return head_[k];
    }
    return -1;
  }

 private:
  HostVector<int32_t> prev_, next_;
  HostVector<uint8_t> prio_;
  int32_t head_[kPriorities] = {-1, -1, -1, -1};
  int32_t tail_[kPriorities] = {-1, -1, -1, -1};
};

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_PRIORITY_LRU_H_
