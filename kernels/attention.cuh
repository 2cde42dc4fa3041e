// Internal: decode attention kernels (device code; launched by
// kernels/attention.cu).
//
// Launch: a persistent grid of num_sms * kCtasPerSm CTAs of 4 warps. Every
// CTA derives the same schedule from seq_lens / q_indptr: request b's
// attended key range [lo_b, L_b) is cut into splits_b chunks of at most C
// tokens, C chosen so that all chunks of all requests number at most
// max(0.8 ctas + 1, ctas - groups) + groups (one round of the grid when
// there are few (request, head, query tile) groups). A work item is
// (request, KV head, 16-row query tile, chunk) and runs on one CTA; CTA x
// takes items x, x + grid, ... Each warp of the CTA takes a contiguous
// quarter of the chunk's 16-token tiles, and the four (O, max, sum) are
// combined through shared memory at the end. A request with one chunk
// writes its output directly; otherwise each chunk writes an fp32 partial
// (unnormalized O, running max, sum) and MergeAttentionKernel (same grid,
// same schedule; on sm_90 launched early with programmatic dependent launch,
// waiting for the attention grid before it reads partials) combines them.
// The grid depends only on the options, so one captured graph serves every
// length. A soft cap selects a separate instantiation (kSoftCap).
//
// One warp, its tiles: query rows r = qi * group + gi (padded to 16) in the
// M dimension of mma.m16n8k16 (f16 in, f32 accumulate). Per 16-token tile,
// 32 lanes copy the tile's K and V rows (codes and scales) with cp.async
// into a 3-stage shared-memory ring (lane 2t + h: token t, half h; one
// page-table entry per tile when page_size % 16 == 0 and the pools allow
// 16-byte copies, else one lookup per lane and tile; FP8 keys on that fast
// path copy token-major instead, whole K and V rows per instruction). Then
//   S = Q K^T : B fragments from page_reader's DecodeWordHalf2. The reduction
//     index is permuted so that lane (g, c) decodes token g's bytes
//     [c D/8, (c+1) D/8) (contiguous); Q is stored permuted the same way.
//   online softmax in fp32 on the S fragment (log2 domain; a row's running
//     max moves only when a tile exceeds it by kAttnRescaleSlack);
//   O += P V   : the S accumulator, rounded to f16, is the A fragment; V's B
//     fragment for lane (g, c) is "segment" g (dims [g D/8, (g+1) D/8)) of
//     tokens 2c, 2c+1, 2c+8, 2c+9 (page_reader's DecodeWordPairHalf2), so
//     output n-tile l holds dims seg * D/8 + l; lane (g, c) owns segments
//     2c, 2c+1.
// The dequantized tile is e2m1 * e4m3 * 2^-7, exact in f16; the 2^7, g_k
// and sm_scale enter the logit scale once, g_v * 2^7 the output once.
#ifndef FP4KV_KERNELS_ATTENTION_CUH_
#define FP4KV_KERNELS_ATTENTION_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "fp4kv/device/page_reader.cuh"
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

// kFp8K: FP8 E4M3 keys (D bytes per K row, no K block scales). Their K rows
// are padded to D + 16 bytes at D = 128 (the 16-byte fragment loads of two
// tokens then hit different banks), and D = 128 keeps two stages so that
// four CTAs still fit an SM's shared memory.
template <int D, bool kFp8K = false>
struct AttnConfig {
  static constexpr int kStages = D <= 128 ? (kFp8K && D == 128 ? 2 : 3) : 2;
  static constexpr int kCtasPerSm = D == 64 ? 4 : (D == 128 ? 4 : 2);
  static constexpr int kQStride = D + 8;  // halves per Q row in shared memory
  static constexpr int kRowBytes = D / 2;  // V code row (and NVFP4 K)
  static constexpr int kKRowBytes = kFp8K ? D : D / 2;  // K data bytes per token
  static constexpr int kKRowStride = kFp8K && D == 128 ? D + 16 : kKRowBytes;
  static constexpr int kScaleBytes = D / 16;
  static constexpr int kKScaleBytes = kFp8K ? 0 : kScaleBytes;
  static constexpr int kKcOff = 0;
  static constexpr int kVcOff = kAttnTile * kKRowStride;
  static constexpr int kKsOff = kVcOff + kAttnTile * kRowBytes;
  static constexpr int kVsOff = kKsOff + kAttnTile * kKScaleBytes;
  static constexpr int kMaskOff = kVsOff + kAttnTile * kScaleBytes;
  static constexpr int kStageBytes = kMaskOff + 16;
  static constexpr int kQBytes = kAttnTile * kQStride * 2;
  static constexpr int kWarpBytes = kQBytes + kStages * kStageBytes;
  static constexpr int kRedStride = D + 4;  // floats per row of the warp combine
  static_assert(kAttnTile * kRedStride * 4 <= kWarpBytes, "combine fits a warp's shared memory");
  static_assert(kWarpBytes % 16 == 0, "16-byte aligned warp regions");
  static_assert(kStageBytes % 16 == 0 && kVsOff % 8 == 0, "aligned stage regions");
};

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
  r.span = (r.len > 0 && r.q_len > 0) ? r.len - r.lo : 0;
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

// Block-wide exclusive scan of one int per thread (kAttnThreads threads).
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
  for (int w = 0; w < kAttnWarps; ++w) {
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
    item_prefix[b] = n;  // items of request b
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

// Copy sources of one item for the lanes of one half (fast copy path), kept
// in shared memory and read back every tile: cheaper than the registers to
// keep them or the instructions to recompute them.
struct AttnCopyBase {
  const uint8_t* k;  // K codes at (page 0, entry 0, the item's head) + the half's bytes
  const uint8_t* v;  // V codes, likewise
  const uint8_t* s;  // block scales: K for half 0, V for half 1
  uint32_t s_page, s_entry;  // that scale pool's strides (bytes)
};

// Reloads an AttnCopyBase at a shared address on every call (volatile: the
// compiler may neither keep it in registers nor hoist it out of a loop).
__device__ __forceinline__ AttnCopyBase LoadCopyBase(uint32_t addr) {
  unsigned long long k, v, s;
  uint32_t sp, se;
  asm volatile("ld.shared.v2.u64 {%0, %1}, [%2];\n" : "=l"(k), "=l"(v) : "r"(addr));
  asm volatile("ld.shared.u64 %0, [%3 + 16];\n ld.shared.v2.u32 {%1, %2}, [%3 + 24];\n"
               : "=l"(s), "=r"(sp), "=r"(se)
               : "r"(addr));
  AttnCopyBase b;
  b.k = reinterpret_cast<const uint8_t*>(k);
  b.v = reinterpret_cast<const uint8_t*>(v);
  b.s = reinterpret_cast<const uint8_t*>(s);
  b.s_page = sp;
  b.s_entry = se;
  return b;
}

// One work item, resolved.
struct AttnItem {
  int b, head, mt, t0, t1, splits, chunk_index;
  int slot;  // first partial slot of this chunk, -1 when unsplit
  int slot0;  // slot of chunk 0 of the same (b, head, mt)
  AttnRequest r;
};

__device__ __forceinline__ AttnItem ResolveAttnItem(const AttnLaunch& a, int item,
                                                    int chunk_bound, const int* item_prefix,
                                                    const int* slot_prefix) {
  const internal::AttentionParams& p = a.p;
  int lo = 0, hi = p.batch_size;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (item_prefix[mid] <= item) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
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
// Small PTX wrappers.
// ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// .L2::128B: a miss brings the whole 128-byte line into L2 (the rest of a
// key row, or the neighbouring heads' rows and scales that other CTAs read
// at about the same time), in one request.
template <int kBytes>
__device__ __forceinline__ void CpAsync(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? kBytes : 0;
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(n));
  } else {
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src),
                 "n"(kBytes), "r"(n));
  }
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n"); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t r[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void Mma16816(float d[4], const uint32_t a[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Programmatic dependent launch (sm_90+; no-ops before): the attention
// kernel lets the merge kernel launch early, and the merge kernel waits for
// the attention grid's completion (and its memory) before it reads partials.
__device__ __forceinline__ void LaunchDependentGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void WaitForPrerequisiteGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// {lo, lo} and {hi, hi} of an f16x2 (usually folded into the consumer's
// operand selection).
__device__ __forceinline__ uint32_t DupLowHalf(uint32_t x) {
  uint32_t d;
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n mov.b32 %0, {l, l};\n}" : "=r"(d) : "r"(x));
  return d;
}
__device__ __forceinline__ uint32_t DupHighHalf(uint32_t x) {
  uint32_t d;
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n mov.b32 %0, {h, h};\n}" : "=r"(d) : "r"(x));
  return d;
}

__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t PackHalf2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

template <bool kBf16>
__device__ __forceinline__ uint32_t PackOut2(float lo, float hi) {
  uint32_t d;
  if constexpr (kBf16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  }
  return d;
}

template <bool kBf16>
__device__ __forceinline__ uint16_t PackOut1(float x) {
  return static_cast<uint16_t>(PackOut2<kBf16>(x, 0.0f) & 0xffffu);
}

__device__ __forceinline__ int VSlot(int t) { return (t & 1) * 4 + ((t >> 1) & 3) + (t >> 3) * 8; }

// Position of dim d of a Q row in the permuted shared-memory row (k-step s
// at halves [16 s, 16 s + 16)); see the header comment.
template <int D>
__device__ __forceinline__ int QPermutedIndex(int d) {
  const int c = d / (D / 4);
  const int rem = d % (D / 4);
  const int s = 2 * (rem / 8) + (rem % 8) / 4;
  const int lb = (rem % 4) / 2;
  const int hi = rem % 2;
  return s * 16 + hi * 8 + 2 * c + lb;
}

// The same for FP8 keys: lane (g, c) holds bytes [c D/4, (c+1) D/4) of token
// g, one 32-bit word (4 values) per k-step; word s gives the B registers
// {v0, v1} (k = 2c, 2c+1) and {v2, v3} (k = 2c+8, 2c+9) of k-step s.
template <int D>
__device__ __forceinline__ int QPermutedIndexFp8(int d) {
  const int c = d / (D / 4);
  const int rem = d % (D / 4);
  const int s = rem / 4, j = rem % 4;
  return s * 16 + (j < 2 ? 2 * c + j : 8 + 2 * c + (j - 2));
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Final normalization of one row: out scale and lse from (m, l) in log2
// units and the optional sink logit. Returns false for a row that attended
// nothing (out 0, lse -inf).
__device__ __forceinline__ bool FinishRow(float m, float l, const float* sinks, int qo_head,
                                          float* inv, float* lse) {
  if (!(l > 0.0f)) {
    *inv = 0.0f;
    *lse = -INFINITY;
    return false;
  }
  float big = m, z = l;
  if (sinks != nullptr) {
    const float sk = sinks[qo_head] * kLog2e;
    big = m > sk ? m : sk;
    const float f = Ex2(m - big);
    z = l * f + Ex2(sk - big);
    *inv = f / z;
  } else {
    *inv = 1.0f / l;
  }
  *lse = (big + __log2f(z)) * kLn2;
  return true;
}

// ---------------------------------------------------------------------------
// The attention kernel.
// ---------------------------------------------------------------------------
// kSoftCap: options.logits_soft_cap > 0 (a separate instantiation keeps the
// tanh path out of the common kernel's registers). kFp8K: FP8 E4M3 keys.
template <int D, bool kBf16, bool kSoftCap, bool kFp8K>
__global__ void __launch_bounds__(kAttnThreads, AttnConfig<D, kFp8K>::kCtasPerSm)
    DecodeAttentionKernel(const AttnLaunch a) {
  using Cfg = AttnConfig<D, kFp8K>;
  constexpr int kStages = Cfg::kStages;
  constexpr int kNT = D / 8;          // PV n-tiles (dims per lane segment)
  constexpr int kKWords = D / 32;     // code words per lane and K token
  constexpr int kVWords = D / 64;     // code words per lane and V token
  extern __shared__ __align__(16) uint8_t smem[];
  const internal::AttentionParams& p = a.p;
  LaunchDependentGrids();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int* item_prefix = reinterpret_cast<int*>(smem + kAttnWarps * Cfg::kWarpBytes);
  int* slot_prefix = item_prefix + p.max_batch + 1;
  const int chunk_bound = BuildAttnSchedule(a, item_prefix, slot_prefix);
  const int total_items = item_prefix[p.batch_size];

  uint8_t* wsm = smem + warp * Cfg::kWarpBytes;
  uint16_t* qs = reinterpret_cast<uint16_t*>(wsm);
  uint8_t* stages = wsm + Cfg::kQBytes;
  const int g = lane >> 2, c = lane & 3;
  const float gk = p.k_scale.Get();
  const float gv = p.v_scale.Get();

  __shared__ float2 ml_sm[kAttnWarps][kAttnTile];
  __shared__ AttnCopyBase copy_base[2];  // per item, lanes of half 0 and 1
  for (int item = blockIdx.x; item < total_items; item += gridDim.x) {
    const AttnItem it = ResolveAttnItem(a, item, chunk_bound, item_prefix, slot_prefix);
    // This warp's tiles: a quarter of the item's, contiguous.
    const int item_tiles = (it.t1 - it.t0 + kAttnTile - 1) / kAttnTile;
    const int warp_tiles = (item_tiles + kAttnWarps - 1) / kAttnWarps;
    const int w_t0 = it.t0 + warp * warp_tiles * kAttnTile;
    const int w_t1 = min(it.t1, w_t0 + warp_tiles * kAttnTile);
    const int n_tiles = w_t0 < w_t1 ? (w_t1 - w_t0 + kAttnTile - 1) / kAttnTile : 0;

    // ---- Q tile into shared memory (permuted; bf16 rows scaled by 2^kq).
    int kq = 0;
    {
      const int r = lane >> 1, half = lane & 1;
      const AttnRow row = GetAttnRow(p, it, r);
      const uint16_t* src = nullptr;
      if (row.valid) {
        src = static_cast<const uint16_t*>(p.q) + (it.r.q_begin + row.qi) * p.q_row_stride +
              static_cast<int64_t>(it.head * p.group + row.gi) * p.q_head_stride + half * (D / 2);
      }
      float mul = 1.0f;
      if constexpr (kBf16) {
        uint32_t amax = 0;
        if (src != nullptr) {
#pragma unroll 4
          for (int i = 0; i < D / 16; ++i) {
            const uint4 v = *reinterpret_cast<const uint4*>(src + 8 * i);
            const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const uint32_t lo = (w[j] << 16) & 0x7fff0000u, hi = w[j] & 0x7fff0000u;
              amax = max(amax, max(lo, hi));
            }
          }
        }
        amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        if (amax != 0 && amax < 0x7f800000u) {
          const int e = static_cast<int>(amax >> 23) - 127;
          kq = 14 - e;
          kq = kq < -126 ? -126 : (kq > 127 ? 127 : kq);
          mul = __uint_as_float(static_cast<uint32_t>(kq + 127) << 23);
        }
      }
      uint16_t* dst = qs + r * Cfg::kQStride;
#pragma unroll 2
      for (int i = 0; i < D / 16; ++i) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (src != nullptr) v = *reinterpret_cast<const uint4*>(src + 8 * i);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint32_t bits = (w[j / 2] >> (16 * (j % 2))) & 0xffffu;
          uint16_t h;
          if constexpr (kBf16) {
            h = static_cast<uint16_t>(PackHalf2(__uint_as_float(bits << 16) * mul, 0.0f) &
                                      0xffffu);
          } else {
            h = static_cast<uint16_t>(bits);
          }
          const int d = half * (D / 2) + 8 * i + j;
          dst[kFp8K ? QPermutedIndexFp8<D>(d) : QPermutedIndex<D>(d)] = h;
        }
      }
    }

    // ---- Per-thread rows g and g + 8.
    float lf[2];  // logit factor: to log2 units, or to x / cap with a soft cap
    // Keys [*lo, *hi] that row g + 8 i may attend (recomputed on the rare
    // tiles that need a mask rather than kept in registers).
    const auto row_bounds = [&](int i, int* lo, int* hi) {
      const AttnRow row = GetAttnRow(p, it, g + 8 * i);
      *lo = -(1 << 30);
      *hi = 1 << 30;
      if (row.stored) {
        *hi = row.pos;
        if (p.window_left >= 0) *lo = row.pos - p.window_left;
      }
    };
    int lo_max = -(1 << 30), hi_min = 1 << 30;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int k = __shfl_sync(0xffffffffu, kq, 2 * (g + 8 * i));
      // The K tile's own factor: 2^7 (NVFP4), 1 or 2^8 (FP8, by arch).
      const float tile_scale = kFp8K ? device::Fp8KeyHalfScale() : device::kHalfTileScale;
      const float f = p.sm_scale * gk * tile_scale *
                      __uint_as_float(static_cast<uint32_t>(127 - k) << 23);
      lf[i] = kSoftCap ? f / p.soft_cap : f * kLog2e;
      int lo, hi;
      row_bounds(i, &lo, &hi);
      lo_max = max(lo_max, lo);
      hi_min = min(hi_min, hi);
    }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      lo_max = max(lo_max, __shfl_xor_sync(0xffffffffu, lo_max, o));
      hi_min = min(hi_min, __shfl_xor_sync(0xffffffffu, hi_min, o));
    }
    __syncwarp();

    // ---- Copy pipeline state of this lane: token tau of every tile.
    const int tau = lane >> 1, hf = lane & 1;
    int pj = (w_t0 + tau) / p.page_size;
    int pe = (w_t0 + tau) - pj * p.page_size;
    const int64_t table_row = static_cast<int64_t>(it.b) * p.table_row_stride;
    const uint8_t* kd = p.k.data + it.head * p.k.data_head + hf * (Cfg::kKRowBytes / 2);
    const uint8_t* vd = p.v.data + it.head * p.v.data_head + hf * (D / 4);
    // Block scales: K for half 0, V for half 1 (FP8 keys have none: half 0
    // copies no scales).
    const bool k_half = hf == 0 && !kFp8K;
    const uint8_t* sd = (k_half ? p.k.scales : p.v.scales) +
                        it.head * (k_half ? p.k.scale_head : p.v.scale_head);
    const int64_t s_page = k_half ? p.k.scale_page : p.v.scale_page;
    const int64_t s_entry = k_half ? p.k.scale_entry : p.v.scale_entry;
    const bool copies_scales = !kFp8K || hf == 1;

    // Fast path (a.fast_copy, tiles aligned to 16): one table entry per tile
    // (all lanes' tokens lie in page pj), 32-bit page index and entry offsets.
    const bool fast = a.fast_copy && (w_t0 % kAttnTile) == 0;
    // 32-bit page strides (a.fast_copy guarantees that they fit): one wide
    // multiply-add per pool and tile.
    const uint32_t k_entry = static_cast<uint32_t>(p.k.data_entry);
    const uint32_t v_entry = static_cast<uint32_t>(p.v.data_entry);
    const uint32_t s_entry32 = static_cast<uint32_t>(s_entry);
    const uint32_t k_page32 = static_cast<uint32_t>(p.k.data_page);
    const uint32_t v_page32 = static_cast<uint32_t>(p.v.data_page);
    const uint32_t s_page32 = static_cast<uint32_t>(s_page);
    if (threadIdx.x < 2) {
      copy_base[threadIdx.x] = AttnCopyBase{kd, vd, sd, s_page32, s_entry32};
    }
    __syncthreads();
    const uint32_t copy_base_addr = SmemAddr(&copy_base[hf]);
    auto issue_fast = [&](int stage, int tile_start) {
      uint8_t* st = stages + stage * Cfg::kStageBytes;
      const AttnCopyBase cb = LoadCopyBase(copy_base_addr);
      const int64_t pg = internal::TableEntry(p.block_tables, p.tables_i64, table_row + pj);
      const bool valid = tile_start + tau < w_t1 && pg >= 0 && pg < p.num_pages;
      const uint32_t page = valid ? static_cast<uint32_t>(pg) : 0u;
      const uint32_t e = static_cast<uint32_t>(pe);
      const uint8_t* ksrc = cb.k + (static_cast<uint64_t>(page) * k_page32 + e * k_entry);
      const uint8_t* vsrc = cb.v + (static_cast<uint64_t>(page) * v_page32 + e * v_entry);
      const uint8_t* ssrc = cb.s + (static_cast<uint64_t>(page) * cb.s_page + e * cb.s_entry);
      const uint32_t kdst = SmemAddr(st + Cfg::kKcOff + tau * Cfg::kKRowStride +
                                     hf * (Cfg::kKRowBytes / 2));
      const uint32_t vdst =
          SmemAddr(st + Cfg::kVcOff + VSlot(tau) * Cfg::kRowBytes + hf * (D / 4));
      if constexpr (kFp8K) {
        // Token-major: kKP lanes copy one whole K row (kVP lanes one V row)
        // per instruction, so that each instruction covers whole sectors and
        // lines. All tokens of the tile lie in page pg (fast path).
        constexpr int kKP = Cfg::kKRowBytes / 16;
        constexpr int kVP = D / 32;
        const bool page_ok = pg >= 0 && pg < p.num_pages;
        const uint32_t pgk = page_ok ? static_cast<uint32_t>(pg) : 0u;
        const uint32_t e0 = e - static_cast<uint32_t>(tau);
        const uint8_t* kb = cb.k - hf * (Cfg::kKRowBytes / 2) +
                            static_cast<uint64_t>(pgk) * k_page32 + (lane % kKP) * 16;
        const uint8_t* vb = cb.v - hf * (D / 4) + static_cast<uint64_t>(pgk) * v_page32 +
                            (lane % kVP) * 16;
#pragma unroll
        for (int i = 0; i < kKP / 2; ++i) {
          const int t = i * (32 / kKP) + lane / kKP;
          const bool ok = page_ok && tile_start + t < w_t1;
          CpAsync<16>(SmemAddr(st + Cfg::kKcOff + t * Cfg::kKRowStride + (lane % kKP) * 16),
                      kb + (e0 + t) * k_entry, ok);
        }
#pragma unroll
        for (int i = 0; i < kVP / 2; ++i) {
          const int t = i * (32 / kVP) + lane / kVP;
          const bool ok = page_ok && tile_start + t < w_t1;
          CpAsync<16>(SmemAddr(st + Cfg::kVcOff + VSlot(t) * Cfg::kRowBytes + (lane % kVP) * 16),
                      vb + (e0 + t) * v_entry, ok);
        }
        (void)ksrc;
        (void)vsrc;
        (void)kdst;
        (void)vdst;
      } else {
#pragma unroll
        for (int i = 0; i < D / 64; ++i) {
          CpAsync<16>(kdst + 16 * i, ksrc + 16 * i, valid);
          CpAsync<16>(vdst + 16 * i, vsrc + 16 * i, valid);
        }
      }
      uint8_t* sdst = st + (k_half ? Cfg::kKsOff + tau * Cfg::kScaleBytes
                                   : Cfg::kVsOff + VSlot(tau) * Cfg::kScaleBytes);
      if (copies_scales) CpAsync<Cfg::kScaleBytes>(SmemAddr(sdst), ssrc, valid);
      const uint32_t ballot = __ballot_sync(0xffffffffu, valid);
      if (lane == 0) *reinterpret_cast<uint32_t*>(st + Cfg::kMaskOff) = ballot;
      pe += kAttnTile;
      if (pe >= p.page_size) {
        pe -= p.page_size;
        ++pj;
      }
    };
    auto issue = [&](int stage, int tile_start) {
      if (fast) {
        issue_fast(stage, tile_start);
        return;
      }
      uint8_t* st = stages + stage * Cfg::kStageBytes;
      const int t = tile_start + tau;
      bool valid = t < w_t1;
      int64_t page = 0;
      if (valid) {
        page = internal::TableEntry(p.block_tables, p.tables_i64, table_row + pj);
        valid = page >= 0 && page < p.num_pages;
      }
      if (!valid) page = 0;
      const int e = valid ? pe : 0;
      const uint8_t* ksrc = kd + page * p.k.data_page + e * p.k.data_entry;
      const uint8_t* vsrc = vd + page * p.v.data_page + e * p.v.data_entry;
      const uint32_t kdst = SmemAddr(st + Cfg::kKcOff + tau * Cfg::kKRowStride +
                                     hf * (Cfg::kKRowBytes / 2));
      const uint32_t vdst =
          SmemAddr(st + Cfg::kVcOff + VSlot(tau) * Cfg::kRowBytes + hf * (D / 4));
      const bool a16 = ((reinterpret_cast<uintptr_t>(ksrc) | reinterpret_cast<uintptr_t>(vsrc)) &
                        15u) == 0;
      if (a16 && kFp8K) {
#pragma unroll
        for (int i = 0; i < Cfg::kKRowBytes / 32; ++i) {
          CpAsync<16>(kdst + 16 * i, ksrc + 16 * i, valid);
        }
#pragma unroll
        for (int i = 0; i < D / 64; ++i) CpAsync<16>(vdst + 16 * i, vsrc + 16 * i, valid);
      } else if (kFp8K) {
#pragma unroll
        for (int i = 0; i < Cfg::kKRowBytes / 16; ++i) {
          CpAsync<8>(kdst + 8 * i, ksrc + 8 * i, valid);
        }
#pragma unroll
        for (int i = 0; i < D / 32; ++i) CpAsync<8>(vdst + 8 * i, vsrc + 8 * i, valid);
      } else if (a16) {
#pragma unroll
        for (int i = 0; i < D / 64; ++i) {
          CpAsync<16>(kdst + 16 * i, ksrc + 16 * i, valid);
          CpAsync<16>(vdst + 16 * i, vsrc + 16 * i, valid);
        }
      } else {
#pragma unroll
        for (int i = 0; i < D / 32; ++i) {
          CpAsync<8>(kdst + 8 * i, ksrc + 8 * i, valid);
          CpAsync<8>(vdst + 8 * i, vsrc + 8 * i, valid);
        }
      }
      const uint8_t* ssrc = sd + page * s_page + e * s_entry;
      uint8_t* sdst = st + (k_half ? Cfg::kKsOff + tau * Cfg::kScaleBytes
                                   : Cfg::kVsOff + VSlot(tau) * Cfg::kScaleBytes);
      if (!copies_scales) {
        // FP8 keys: half 0 has no scales to copy.
      } else if ((reinterpret_cast<uintptr_t>(ssrc) & (Cfg::kScaleBytes - 1)) == 0) {
        CpAsync<Cfg::kScaleBytes>(SmemAddr(sdst), ssrc, valid);
      } else {
#pragma unroll
        for (int i = 0; i < Cfg::kScaleBytes; ++i) sdst[i] = valid ? __ldg(ssrc + i) : 0;
      }
      const uint32_t ballot = __ballot_sync(0xffffffffu, valid);
      if (lane == 0) *reinterpret_cast<uint32_t*>(st + Cfg::kMaskOff) = ballot;
      pe += a.page_r16;
      pj += a.page_q16;
      if (pe >= p.page_size) {
        pe -= p.page_size;
        ++pj;
      }
    };

    float o[kNT][4];
#pragma unroll
    for (int n = 0; n < kNT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_tiles) issue(s, w_t0 + kAttnTile * s);
      CpAsyncCommit();
    }
    const uint32_t q_base = SmemAddr(qs);
    const int ld_row = (lane & 7) + ((lane >> 3) & 1) * 8;
    const int ld_col = (lane >> 4) * 8;
    const uint32_t q_lane = q_base + (ld_row * Cfg::kQStride + ld_col) * 2;

    for (int i = 0; i < n_tiles; ++i) {
      CpAsyncWait<kStages - 2>();
      __syncwarp();
      {
        const int nx = i + kStages - 1;
        if (nx < n_tiles) issue(nx % kStages, w_t0 + kAttnTile * nx);
        CpAsyncCommit();
      }
      const uint8_t* st = stages + (i % kStages) * Cfg::kStageBytes;
      const int tile_start = w_t0 + kAttnTile * i;
      const uint32_t ballot = *reinterpret_cast<const uint32_t*>(st + Cfg::kMaskOff);

      // ---- S = Q K^T.
      float s[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      if constexpr (kFp8K) {
        // FP8 keys: lane (g, c) reads bytes [c D/4, (c+1) D/4) of tokens g
        // and g + 8, 16 bytes (four k-steps) at a time; word w is k-step
        // w's B fragment.
        const uint8_t* krow = st + Cfg::kKcOff + g * Cfg::kKRowStride + c * (D / 4);
#pragma unroll
        for (int w4 = 0; w4 < D / 64; ++w4) {
          uint32_t kw[2][4];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const uint4 v =
                *reinterpret_cast<const uint4*>(krow + 8 * nt * Cfg::kKRowStride + 16 * w4);
            kw[nt][0] = v.x;
            kw[nt][1] = v.y;
            kw[nt][2] = v.z;
            kw[nt][3] = v.w;
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t qa[4];
            LdMatrixX4(q_lane + (4 * w4 + j) * 32, qa);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              uint32_t b0, b1;
              device::Fp8KeyWordToHalf2(kw[nt][j], &b0, &b1);
              Mma16816(s[nt], qa, b0, b1);
            }
          }
        }
      } else {
        uint32_t kw[2][kKWords];
        uint32_t ksb[2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint8_t* row = st + Cfg::kKcOff + (g + 8 * nt) * Cfg::kKRowStride + c * (D / 8);
#pragma unroll
          for (int w = 0; w < kKWords; w += 2) {
            const uint2 v = *reinterpret_cast<const uint2*>(row + 4 * w);
            kw[nt][w] = v.x;
            kw[nt][w + 1] = v.y;
          }
          const uint8_t* srow = st + Cfg::kKsOff + (g + 8 * nt) * Cfg::kScaleBytes + c * (D / 64);
          if constexpr (D == 64) {
            ksb[nt] = srow[0];
          } else if constexpr (D == 128) {
            ksb[nt] = *reinterpret_cast<const uint16_t*>(srow);
          } else {
            ksb[nt] = *reinterpret_cast<const uint32_t*>(srow);
          }
        }
        // Block scale multipliers, two blocks per conversion: kmul[nt][q] holds
        // blocks 2q and 2q + 1 (one block for D = 64: twice).
        constexpr int kScalePairs = D >= 128 ? D / 128 : 1;
        uint32_t kmul[2][kScalePairs];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int q = 0; q < kScalePairs; ++q) {
            const uint32_t two = D >= 128 ? (ksb[nt] >> (16 * q)) & 0xffffu : ksb[nt] * 0x0101u;
            kmul[nt][q] = device::ScalePairMultiplier(two);
          }
        }
#pragma unroll
        for (int w = 0; w < kKWords; ++w) {
          uint32_t qa[2][4];
          LdMatrixX4(q_lane + (2 * w) * 32, qa[0]);
          LdMatrixX4(q_lane + (2 * w + 1) * 32, qa[1]);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const uint32_t pair = kmul[nt][w / 4 < kScalePairs ? w / 4 : 0];
            const uint32_t mul = (w / 2) % 2 == 0 ? DupLowHalf(pair) : DupHighHalf(pair);
            uint32_t b[4];
            device::DecodeWordHalf2(kw[nt][w], mul, b);
            Mma16816(s[nt], qa[0], b[0], b[2]);
            Mma16816(s[nt], qa[1], b[1], b[3]);
          }
        }
      }

      // ---- Online softmax (log2 units).
      const bool full = ballot == 0xffffffffu && tile_start >= lo_max &&
                        tile_start + kAttnTile - 1 <= hi_min;
      // Scale and soft cap (its own instantiation), then the mask: one
      // warp-uniform branch per tile.
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[nt][e] * lf[e >> 1];
          if constexpr (kSoftCap) x = tanhf(x) * p.soft_cap * kLog2e;
          s[nt][e] = x;
        }
      }
      if (!full) {
        int row_lo[2], row_hi[2];
        row_bounds(0, &row_lo[0], &row_hi[0]);
        row_bounds(1, &row_lo[1], &row_hi[1]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tt = 8 * nt + 2 * c + (e & 1);
            const int t = tile_start + tt;
            const bool ok = ((ballot >> (2 * tt)) & 1u) && t >= row_lo[e >> 1] &&
                            t <= row_hi[e >> 1];
            if (!ok) s[nt][e] = -INFINITY;
          }
        }
      }
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // Lazy rescale: the running max moves only when the tile's max
        // exceeds it by more than kAttnRescaleSlack (log2 units), so P stays
        // below 2^kAttnRescaleSlack (exact range in f16, no fp32 overflow)
        // and O is rescaled on few tiles.
        const float m_new =
            mx - m_run[r] > kAttnRescaleSlack ? fmaxf(m_run[r], mx) : m_run[r];
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        alpha[r] = m_new == m_run[r] ? 1.0f : Ex2(m_run[r] - m_use);
        m_run[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          s[nt][2 * r] = Ex2(s[nt][2 * r] - m_use);
          s[nt][2 * r + 1] = Ex2(s[nt][2 * r + 1] - m_use);
          sum += s[nt][2 * r] + s[nt][2 * r + 1];
        }
        l_run[r] = l_run[r] * alpha[r] + sum;
      }
      if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
        for (int n = 0; n < kNT; ++n) {
          o[n][0] *= alpha[0];
          o[n][1] *= alpha[0];
          o[n][2] *= alpha[1];
          o[n][3] *= alpha[1];
        }
      }
      // P as f16 (the A fragment of P V).
      uint32_t pa[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        pa[k] = PackHalf2(s[k >> 1][2 * (k & 1)], s[k >> 1][2 * (k & 1) + 1]);
      }

      // ---- O += P V.
      uint32_t vw[4][kVWords];  // tokens 2c, 2c+1, 2c+8, 2c+9
      uint32_t vsb[2][kVWords > 1 ? 2 : 1];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int tt = 2 * c + (k & 1) + 8 * (k >> 1);
        const uint8_t* row = st + Cfg::kVcOff + VSlot(tt) * Cfg::kRowBytes + g * (D / 16);
        if constexpr (kVWords == 1) {
          vw[k][0] = *reinterpret_cast<const uint32_t*>(row);
        } else {
#pragma unroll
          for (int w = 0; w < kVWords; w += 2) {
            const uint2 v = *reinterpret_cast<const uint2*>(row + 4 * w);
            vw[k][w] = v.x;
            vw[k][w + 1] = v.y;
          }
        }
      }
#pragma unroll
      for (int pr = 0; pr < 2; ++pr) {
        const int t0 = 2 * c + 8 * pr;
        const uint8_t* s0 = st + Cfg::kVsOff + VSlot(t0) * Cfg::kScaleBytes;
        const uint8_t* s1 = st + Cfg::kVsOff + VSlot(t0 + 1) * Cfg::kScaleBytes;
        constexpr int kBlocksPerSeg = kVWords > 1 ? kVWords / 2 : 1;
#pragma unroll
        for (int q = 0; q < kBlocksPerSeg; ++q) {
          const int blk = (g * (D / 8)) / 16 + q;
          vsb[pr][q] = device::ScalePairMultiplier(static_cast<uint32_t>(s0[blk]) |
                                                   (static_cast<uint32_t>(s1[blk]) << 8));
        }
      }
#pragma unroll
      for (int w = 0; w < kVWords; ++w) {
        uint32_t b0[8], b1[8];
        const int q = kVWords > 1 ? w / 2 : 0;
        device::DecodeWordPairHalf2(vw[0][w], vw[1][w], vsb[0][q], b0);
        device::DecodeWordPairHalf2(vw[2][w], vw[3][w], vsb[1][q], b1);
#pragma unroll
        for (int d = 0; d < 8; ++d) {
          Mma16816(o[8 * w + d], pa, b0[d], b1[d]);
        }
      }
      __syncwarp();
    }
    CpAsyncWait<0>();
    __syncwarp();

    // ---- Row sums across the quad.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    }

    // ---- Combine the warps: each stores its O rescaled to the CTA's row
    // max into its own (now idle) shared memory as [16][D + 4] floats, in
    // natural dim order; then 8 threads per row sum the warps and write the
    // output or the partial.
    if (c == 0) {
      ml_sm[warp][g] = make_float2(m_run[0], l_run[0]);
      ml_sm[warp][g + 8] = make_float2(m_run[1], l_run[1]);
    }
    __syncthreads();
    float* red = reinterpret_cast<float*>(wsm);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = g + 8 * r;
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, ml_sm[w][row].x);
      const float f = Ex2(m_run[r] - (mx == -INFINITY ? 0.0f : mx));
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float* seg = red + row * Cfg::kRedStride + (2 * c + half) * kNT;
#pragma unroll
        for (int n = 0; n < kNT; n += 4) {
          *reinterpret_cast<float4*>(seg + n) =
              make_float4(o[n][2 * r + half] * f, o[n + 1][2 * r + half] * f,
                          o[n + 2][2 * r + half] * f, o[n + 3][2 * r + half] * f);
        }
      }
    }
    __syncthreads();
    {
      const int row = threadIdx.x >> 3, part = threadIdx.x & 7;
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, ml_sm[w][row].x);
      const float m_use = mx == -INFINITY ? 0.0f : mx;
      float l = 0.0f;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) {
        const float2 ml = ml_sm[w][row];
        l += ml.y * Ex2(ml.x - m_use);
      }
      const AttnRow rw = GetAttnRow(p, it, row);
      if (rw.stored) {
        float4 acc[D / 32];
#pragma unroll
        for (int j = 0; j < D / 32; ++j) {
          const int col = 4 * part + 32 * j;
          acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
          for (int w = 0; w < kAttnWarps; ++w) {
            const float4 v = *reinterpret_cast<const float4*>(
                reinterpret_cast<const float*>(smem + w * Cfg::kWarpBytes) +
                row * Cfg::kRedStride + col);
            acc[j].x += v.x;
            acc[j].y += v.y;
            acc[j].z += v.z;
            acc[j].w += v.w;
          }
        }
        const int head = it.head * p.group + rw.gi;
        if (it.splits > 1) {
          const int64_t base = static_cast<int64_t>(it.slot) * a.rows_per_slot + row;
          float* dst = a.ws_o + base * D;
#pragma unroll
          for (int j = 0; j < D / 32; ++j) {
            *reinterpret_cast<float4*>(dst + 4 * part + 32 * j) = acc[j];
          }
          if (part == 0) *reinterpret_cast<float2*>(a.ws_ml + base * 2) = make_float2(mx, l);
        } else {
          float inv, lse;
          FinishRow(m_use, l, p.sinks, head, &inv, &lse);
          const float f = inv * gv * device::kHalfTileScale;
          const int64_t qrow = it.r.q_begin + rw.qi;
          uint16_t* out = static_cast<uint16_t*>(p.out) + qrow * p.out_row_stride +
                          static_cast<int64_t>(head) * p.out_head_stride;
#pragma unroll
          for (int j = 0; j < D / 32; ++j) {
            uint2 v;
            v.x = PackOut2<kBf16>(acc[j].x * f, acc[j].y * f);
            v.y = PackOut2<kBf16>(acc[j].z * f, acc[j].w * f);
            *reinterpret_cast<uint2*>(out + 4 * part + 32 * j) = v;
          }
          if (part == 0 && p.lse != nullptr) p.lse[qrow * p.lse_row_stride + head] = lse;
        }
      }
    }
    __syncthreads();
  }
}

// Combines the partials of the split items. A CTA takes split items
// blockIdx.x, blockIdx.x + grid, ...; the item with chunk index k merges the
// tile rows r with r % splits == k (so a group of many splits spreads its
// rows over as many CTAs as it has rows). One row: thread t owns float4
// t % (D/4) of the splits t / (D/4), t / (D/4) + kLanes, ..., merged online
// four at a time (loads of (m, l) and O together), then the split lanes are
// combined through shared memory.
template <int D, bool kBf16>
__global__ void __launch_bounds__(kAttnThreads) MergeAttentionKernel(const AttnLaunch a) {
  constexpr int kVecs = D / 4;                  // float4 per row
  constexpr int kLanes = kAttnThreads / kVecs;  // splits read at once
  constexpr int kUnroll = 4;
  static_assert(kAttnThreads % kVecs == 0, "head dim");
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float4 red[kAttnThreads];
  __shared__ float2 red_ml[kLanes];
  const internal::AttentionParams& p = a.p;
  int* item_prefix = reinterpret_cast<int*>(smem);
  int* slot_prefix = item_prefix + p.max_batch + 1;
  const int chunk_bound = BuildAttnSchedule(a, item_prefix, slot_prefix);
  // Launched early (programmatic dependent launch): the schedule above reads
  // only inputs; everything below waits for the attention grid. Every CTA
  // waits, so the merge grid never completes before the attention grid.
  WaitForPrerequisiteGrids();
  if (slot_prefix[p.batch_size] == 0) return;  // no request was split
  const int total_items = item_prefix[p.batch_size];
  const int tid = threadIdx.x;
  const int vec = tid % kVecs, sl = tid / kVecs;
  const float gv = p.v_scale.Get();
  for (int item = blockIdx.x; item < total_items; item += gridDim.x) {
    const AttnItem it = ResolveAttnItem(a, item, chunk_bound, item_prefix, slot_prefix);
    if (it.splits <= 1 || it.chunk_index >= kAttnTile) continue;
    for (int r = it.chunk_index; r < kAttnTile; r += it.splits) {
      const AttnRow row = GetAttnRow(p, it, r);
      if (!row.stored) continue;
      const int64_t base = static_cast<int64_t>(it.slot0) * a.rows_per_slot + r;
      const float2* ml = reinterpret_cast<const float2*>(a.ws_ml) + base;
      const float4* src = reinterpret_cast<const float4*>(a.ws_o) + base * kVecs + vec;
      const int64_t step = static_cast<int64_t>(a.rows_per_slot) * kVecs;
      float m_t = -INFINITY, l_t = 0.0f;
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int k = sl; k < it.splits; k += kUnroll * kLanes) {
        float2 mlv[kUnroll];
        float4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int kk = k + u * kLanes;
          mlv[u] = make_float2(-INFINITY, 0.0f);
          v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          if (kk < it.splits) {
            mlv[u] = ml[kk * a.rows_per_slot];
            v[u] = src[kk * step];
          }
        }
        float mx = m_t;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) mx = fmaxf(mx, mlv[u].x);
        const float mu = mx == -INFINITY ? 0.0f : mx;
        const float sc = Ex2(m_t - mu);
        l_t *= sc;
        acc.x *= sc;
        acc.y *= sc;
        acc.z *= sc;
        acc.w *= sc;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const float e = Ex2(mlv[u].x - mu);
          l_t += e * mlv[u].y;
          acc.x += e * v[u].x;
          acc.y += e * v[u].y;
          acc.z += e * v[u].z;
          acc.w += e * v[u].w;
        }
        m_t = mx;
      }
      red[tid] = acc;
      if (vec == 0) red_ml[sl] = make_float2(m_t, l_t);
      __syncthreads();
      if (sl == 0) {
        float m = -INFINITY;
#pragma unroll
        for (int j = 0; j < kLanes; ++j) m = fmaxf(m, red_ml[j].x);
        const float m_use = m == -INFINITY ? 0.0f : m;
        float l = 0.0f;
        acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int j = 0; j < kLanes; ++j) {
          const float e = Ex2(red_ml[j].x - m_use);
          const float4 v = red[j * kVecs + vec];
          l += e * red_ml[j].y;
          acc.x += e * v.x;
          acc.y += e * v.y;
          acc.z += e * v.z;
          acc.w += e * v.w;
        }
        const int head = it.head * p.group + row.gi;
        float inv, lse;
        FinishRow(m_use, l, p.sinks, head, &inv, &lse);
        const float f = inv * gv * device::kHalfTileScale;
        const int64_t qrow = it.r.q_begin + row.qi;
        uint16_t* out = static_cast<uint16_t*>(p.out) + qrow * p.out_row_stride +
                        static_cast<int64_t>(head) * p.out_head_stride;
        uint2 packed;
        packed.x = PackOut2<kBf16>(acc.x * f, acc.y * f);
        packed.y = PackOut2<kBf16>(acc.z * f, acc.w * f);
        *reinterpret_cast<uint2*>(out + 4 * vec) = packed;
        if (vec == 0 && p.lse != nullptr) p.lse[qrow * p.lse_row_stride + head] = lse;
      }
      __syncthreads();
    }
  }
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_CUH_
