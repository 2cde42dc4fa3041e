// Internal: the work schedule of attention (device code), shared by every
// kernel family and the merge: launch constants, the per-request chunk
// split, decode work items (request, KV head, 16-row query tile, chunk) and
// the query rows of an item, and the prefill kernels' items (request, KV
// head, query tile). kernels/attention.cuh describes the schedule.
#ifndef FP4KV_KERNELS_ATTENTION_SCHEDULE_CUH_
#define FP4KV_KERNELS_ATTENTION_SCHEDULE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/attention/tma.cuh"
#include "src/attention_params.h"
#include "src/params.h"

namespace fp4kv {
namespace kernels {

inline constexpr int kAttnWarps = 4;
inline constexpr int kAttnThreads = 32 * kAttnWarps;
inline constexpr int kAttnTile = 16;  // tokens per tile; query rows per item
inline constexpr int kAttnMinChunk = 64;
// Online softmax: the running max of a row is raised only when a tile's
// max exceeds it by more than this (log2 units); see the softmax step.
inline constexpr float kAttnRescaleSlack = 8.0f;
// P = 2^(s - m + kAttnPOffset) for the running max m (log2 units): at most
// 2^(kAttnRescaleSlack + kAttnPOffset) = 2^15, within f16, and P of a key
// up to 14 + 7 below the max is still a normal f16 (a subnormal P would
// carry an absolute error of 2^-25, large against a row whose output comes
// from such keys). The (max, sum) a warp hands on is (m - kAttnPOffset, l),
// so the combine, the merge, the sinks and the LSE need no change.
inline constexpr float kAttnPOffset = 7.0f;

// Query rows kept per partial slot.
inline int AttnRowsPerSlot(int group, int max_q_len) {
  const int64_t r = static_cast<int64_t>(group) * max_q_len;
  return r < kAttnTile ? static_cast<int>(r) : kAttnTile;
}

// Partial slots the schedule can use: fewer than 2 * ctas.
inline int64_t AttnSlots(int num_ctas) { return 2 * (static_cast<int64_t>(num_ctas) + 1); }

inline size_t AttnScheduleBytes(int max_batch) {
  return (2 * static_cast<size_t>(max_batch) + 2) * sizeof(int);
}

struct AttnLaunch {
  // The tensor maps of the TMA variant of the tokens-in-M kernel (set by the
  // launch when it uses it; kernels/attention/tma.cuh).
  AttnTmaMaps tma;
  internal::AttentionParams p;
  int num_ctas = 0;  // the grid of both kernels (the schedule's workers)
  int rows_per_slot = 0;
  int page_q16 = 0, page_r16 = 0;  // 16 = q16 * page_size + r16
  // Set when a 16-aligned tile always lies in one page (page_size % 16 == 0)
  // and the pools allow 16-byte code copies, scale rows of kScaleBytes
  // aligned, 32-bit page indices, page strides and entry offsets within a
  // page.
  bool fast_copy = false;
  float* ws_o = nullptr;   // [AttnSlots(num_ctas), rows_per_slot, D] unnormalized partial outputs
  float* ws_ml = nullptr;  // [AttnSlots(num_ctas), rows_per_slot, 2] running max (log2), sum
};

struct AttnRequest {
  int len;  // L: attended tokens are [lo, len)
  int lo;
  int span;  // len - lo, 0 when the request writes nothing
  int q_len;
  int64_t q_begin;
  int mtiles;  // 16-row query tiles
};

__device__ __forceinline__ AttnRequest GetAttnRequest(const internal::AttentionParams& p, int b) {
  AttnRequest r;
  r.len = static_cast<int>(internal::AttentionTokens(p, b));
  internal::AttentionQueryRows(p, b, &r.q_begin, &r.q_len);
  r.lo = 0;
  if (p.window_left >= 0) {
    const int first = r.len - r.q_len - p.window_left;
    r.lo = first > 0 ? first : 0;
  }
  r.span = (r.len > 0 && r.q_len > 0 && r.q_len >= p.kernel_q_min && r.q_len <= p.kernel_q_max)
               ? r.len - r.lo
               : 0;
  r.mtiles = (p.group * r.q_len + kAttnTile - 1) / kAttnTile;
  return r;
}

// Splits of a span under chunk bound c: balanced chunks, multiples of 16.
__device__ __forceinline__ void AttnSplit(int span, int c, int* splits, int* chunk) {
  if (span <= 0) {
    *splits = 0;
    *chunk = kAttnTile;
    return;
  }
  const int s0 = (span + c - 1) / c;
  int ch = (span + s0 - 1) / s0;
  ch = (ch + kAttnTile - 1) / kAttnTile * kAttnTile;
  *chunk = ch;
  *splits = (span + ch - 1) / ch;
}

// Block-wide exclusive scan of one int per thread (kWarps warps; tmp holds
// kWarps ints).
template <int kWarps = kAttnWarps>
__device__ __forceinline__ int BlockExclusiveScan(int v, int* tmp, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) tmp[warp] = x;
  __syncthreads();
  int base = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int t = tmp[w];
    if (w < warp) base += t;
    all += t;
  }
  __syncthreads();
  *total = all;
  return base + x - v;
}

// Every CTA computes the same schedule: chunk bound c and, per request, the
// first item and the first partial slot (prefix arrays of B + 1 ints).
// Request metadata is read from global memory once: between the passes each
// thread keeps its requests' values in its own entries of the two arrays.
__device__ __forceinline__ int BuildAttnSchedule(const AttnLaunch& a, int* item_prefix,
                                                 int* slot_prefix) {
  __shared__ int tmp[kAttnWarps];
  __shared__ long long wsum[kAttnWarps][2];
  const internal::AttentionParams& p = a.p;
  const int B = p.batch_size;
  const int per = (B + kAttnThreads - 1) / kAttnThreads;
  const int b0 = threadIdx.x * per;
  const int b1 = b0 + per < B ? b0 + per : B;
  long long work = 0, groups = 0;
  for (int b = b0; b < b1; ++b) {
    const AttnRequest r = GetAttnRequest(p, b);
    work += static_cast<long long>(r.span) * r.mtiles;
    groups += r.span > 0 ? r.mtiles : 0;
    item_prefix[b] = r.span;
    slot_prefix[b] = r.mtiles;
  }
  work *= p.num_kv_heads;
  groups *= p.num_kv_heads;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    work += __shfl_xor_sync(0xffffffffu, work, o);
    groups += __shfl_xor_sync(0xffffffffu, groups, o);
  }
  if ((threadIdx.x & 31) == 0) {
    wsum[threadIdx.x >> 5][0] = work;
    wsum[threadIdx.x >> 5][1] = groups;
  }
  __syncthreads();
  long long total = 0, total_groups = 0;
#pragma unroll
  for (int w = 0; w < kAttnWarps; ++w) {
    total += wsum[w][0];
    total_groups += wsum[w][1];
  }
  // Target chunk count: chunks of all groups number at most
  // work / c + groups, so target = ctas - groups keeps them within one round
  // of the grid; at least 0.8 ctas (many groups: few or no splits anyway).
  // Partial slots stay below 2 * target <= 2 * ctas (AttnSlots).
  long long target = (static_cast<long long>(a.num_ctas) * 4) / 5 + 1;
  if (a.num_ctas - total_groups > target) target = a.num_ctas - total_groups;
  long long c = (total + target - 1) / target;
  if (c < kAttnMinChunk) c = kAttnMinChunk;
  if (c > (1 << 30)) c = 1 << 30;
  const int chunk_bound = static_cast<int>(c);
  int items = 0, slots = 0;
  for (int b = b0; b < b1; ++b) {
    int splits, chunk;
    AttnSplit(item_prefix[b], chunk_bound, &splits, &chunk);
    const int n = splits * p.num_kv_heads * slot_prefix[b];
    items += n;
    slots += splits > 1 ? n : 0;
    item_prefix[b] = n;                   // items of request b
    slot_prefix[b] = splits > 1 ? n : 0;  // its partial slots
  }
  int total_items, total_slots;
  int ib = BlockExclusiveScan(items, tmp, &total_items);
  int sb = BlockExclusiveScan(slots, tmp, &total_slots);
  for (int b = b0; b < b1; ++b) {
    const int n = item_prefix[b], ns = slot_prefix[b];
    item_prefix[b] = ib;
    slot_prefix[b] = sb;
    ib += n;
    sb += ns;
  }
  if (threadIdx.x == 0) {
    item_prefix[B] = total_items;
    slot_prefix[B] = total_slots;
  }
  __syncthreads();
  return chunk_bound;
}

// The request of work item `item`: the last b < batch_size with
// item_prefix[b] <= item (a binary search: the prefix does not decrease).
__device__ __forceinline__ int FindItemRequest(const int* item_prefix, int batch_size, int item) {
  int lo = 0, hi = batch_size;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (item_prefix[mid] <= item) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// One work item, resolved.
struct AttnItem {
  int b, head, mt, t0, t1, splits, chunk_index;
  int slot;   // first partial slot of this chunk, -1 when unsplit
  int slot0;  // slot of chunk 0 of the same (b, head, mt)
  AttnRequest r;
};

__device__ __forceinline__ AttnItem ResolveAttnItem(const AttnLaunch& a, int item, int chunk_bound,
                                                    const int* item_prefix,
                                                    const int* slot_prefix) {
  const internal::AttentionParams& p = a.p;
  const int lo = FindItemRequest(item_prefix, p.batch_size, item);
  AttnItem it;
  it.b = lo;
  it.r = GetAttnRequest(p, lo);
  int chunk;
  AttnSplit(it.r.span, chunk_bound, &it.splits, &chunk);
  const int local = item - item_prefix[lo];
  it.chunk_index = local % it.splits;
  const int rest = local / it.splits;
  it.mt = rest % it.r.mtiles;
  it.head = rest / it.r.mtiles;
  it.t0 = it.r.lo + it.chunk_index * chunk;
  it.t1 = it.t0 + chunk < it.r.len ? it.t0 + chunk : it.r.len;
  it.slot = it.splits > 1 ? slot_prefix[lo] + local : -1;
  it.slot0 = it.splits > 1 ? slot_prefix[lo] + local - it.chunk_index : -1;
  return it;
}

// Query row r (0..15) of an item's tile: which query and head it is, and
// whether it is written (a query at a negative position is not).
struct AttnRow {
  int qi, gi;
  bool valid;   // a real query row
  bool stored;  // written (valid and position >= 0)
  int pos;
};

__device__ __forceinline__ AttnRow GetAttnRow(const internal::AttentionParams& p,
                                              const AttnItem& it, int r) {
  AttnRow row;
  const int ridx = it.mt * kAttnTile + r;
  row.qi = ridx / p.group;
  row.gi = ridx - row.qi * p.group;
  row.valid = row.qi < it.r.q_len;
  row.pos = it.r.len - it.r.q_len + row.qi;
  row.stored = row.valid && row.pos >= 0;
  return row;
}

// ---------------------------------------------------------------------------
// The prefill kernels' schedule (prefill.cuh, prefill_sm90.cuh): the same
// requests (GetAttnRequest, restricted by kernel_q_min / kernel_q_max to
// the long ones), items of `rows` query rows of one KV head, no splits.
// ---------------------------------------------------------------------------

// Items of request b: its 64-row tiles times the KV heads (0 when the
// request is not this kernel's or attends nothing).
__device__ __forceinline__ int PrefillItems(const internal::AttentionParams& p,
                                            const AttnRequest& r, int rows) {
  if (r.span <= 0) return 0;
  const int tiles = static_cast<int>((static_cast<int64_t>(p.group) * r.q_len + rows - 1) / rows);
  return tiles * p.num_kv_heads;
}

// Every CTA of a prefill kernel of kThreads threads computes the same
// schedule: item_prefix[b] = first item of request b, item_prefix[B] = all
// items. Ends with a CTA barrier.
template <int kThreads>
__device__ __forceinline__ int PrefillSchedule(const internal::AttentionParams& p, int rows,
                                               int* item_prefix, int* scan_tmp) {
  const int B = p.batch_size, tid = threadIdx.x;
  const int per = (B + kThreads - 1) / kThreads;
  const int b0 = tid * per, b1 = b0 + per < B ? b0 + per : B;
  int mine = 0;
  for (int b = b0; b < b1; ++b) {
    const int n = PrefillItems(p, GetAttnRequest(p, b), rows);
    item_prefix[b] = n;
    mine += n;
  }
  int total;
  int base = BlockExclusiveScan<kThreads / 32>(mine, scan_tmp, &total);
  for (int b = b0; b < b1; ++b) {
    const int n = item_prefix[b];
    item_prefix[b] = base;
    base += n;
  }
  if (tid == 0) item_prefix[B] = total;
  __syncthreads();
  return item_prefix[B];
}

// One item of a prefill kernel: request b's query rows [row0, row0 + rows)
// (of n_rows = group * q_len) on KV head `head`, and the key range
// [t_begin, t_end) they attend (the causal bound of the last query, the
// window of the first). Within a request the row tiles nearest the end
// (most keys under the causal mask) come first.
struct PrefillItem {
  AttnRequest r;
  int b, head, row0, n_rows, pos_base, t_begin, t_end;
};

__device__ __forceinline__ PrefillItem ResolvePrefillItem(const internal::AttentionParams& p,
                                                          const int* item_prefix, int item,
                                                          int rows) {
  PrefillItem it;
  it.b = FindItemRequest(item_prefix, p.batch_size, item);
  it.r = GetAttnRequest(p, it.b);
  const int local = item - item_prefix[it.b];
  it.n_rows = p.group * it.r.q_len;
  const int tiles = (it.n_rows + rows - 1) / rows;
  it.head = local % p.num_kv_heads;
  it.row0 = (tiles - 1 - local / p.num_kv_heads) * rows;
  it.pos_base = it.r.len - it.r.q_len;  // position of query 0
  const int qi_first = it.row0 / p.group;
  const int qi_last = min(it.r.q_len - 1, (it.row0 + rows - 1) / p.group);
  it.t_end = min(it.r.len, it.pos_base + qi_last + 1);
  int t_begin = it.r.lo;
  if (p.window_left >= 0) t_begin = max(t_begin, it.pos_base + qi_first - p.window_left);
  it.t_begin = max(t_begin, 0);
  return it;
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_SCHEDULE_CUH_
