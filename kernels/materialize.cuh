// Internal: FP8 materialization, per thread. A row is one output page: the
// zero page, then page j of request b for every (b, j < max_pages); its work
// items are the 16-value blocks of (head, entry), each for K and for V. A
// thread owns one item (offsets computed once) and handles its K and V blocks
// for the pages of its CTA, two pages at a time, so the page's index chain
// (request, length, reserved pages, output page) serves 32 values; the next
// two pages' index chain is loaded while the current two are converted; pages
// a request does not use are skipped. A warp writes 512 contiguous FP8 bytes of
// K and 512 of V.
#ifndef FP4KV_KERNELS_MATERIALIZE_CUH_
#define FP4KV_KERNELS_MATERIALIZE_CUH_

#include <cstdint>

#include "kernels/device_util.cuh"
#include "kernels/fast_format.cuh"
#include "src/params.h"

namespace fp4kv {
namespace kernels {

inline constexpr int kMaterializeUnroll = 2;
inline constexpr uint32_t kActive = 1, kZero = 2, kSrcK = 4, kSrcV = 8;  // MaterializeGroup

// Index chain of one group of kMaterializeUnroll pages (see MaterializeThread).
// Index holds a checked source page (< num_pages) and an output page
// (< num_out_pages): uint32_t when both counts are at most 2^32 (fewer
// registers), int64_t otherwise.
template <typename Index>
struct MaterializeGroup {
  // Per page u, bits of 4 * u: written at all, zero (entry past the length),
  // K source in range, V source in range.
  uint32_t flags;
  Index out_page[kMaterializeUnroll];
  Index src[kMaterializeUnroll][2];
};

// Packed codes and scale bytes of one group, K and V; with FP8 keys the K
// block's 16 bytes are in key_bytes instead.
template <bool kFp8Keys>
struct MaterializeData {
  U32x2 codes[kMaterializeUnroll][2];
  uint8_t sb[kMaterializeUnroll][2];
  U32x4 key_bytes[kFp8Keys ? kMaterializeUnroll : 1];
};

struct MaterializeLaunch {
  internal::MaterializeParams p;
  bool zero_page = false;  // row 0 of this launch is out page 0 (zeroed)
  int batch_begin = 0;     // first request of this launch
  int64_t rows = 0;        // (zero_page ? 1 : 0) + requests * max_pages
  TileShape shape;
  uint32_t items = 0;       // blocks per page of K (and of V): H * S * D / 16
  FastDivmod pages_div;     // max_pages
  FastDivmod head_div;      // S * D / 16
  FastDivmod entry_div;     // D / 16
  bool wide_index = false;  // num_pages or num_out_pages above 2^32
};

// Rows per CTA: a thread pipelines its pages in groups of kMaterializeUnroll
// (a group costs about one memory latency, plus one for the first), so large
// launches give it four groups; small ones spread their pages for latency.
inline uint32_t MaterializeRowsPerCta(int64_t rows) {
  return rows >= 2048 ? 8 : rows >= 512 ? 4 : 1;
}

template <typename F>
bool ForEachMaterializeLaunch(const internal::MaterializeParams& p, F&& f,
                              uint32_t rows_per_cta = 0) {
  const int64_t nb = p.head_dim / kBlockSize;
  const int64_t per_head = static_cast<int64_t>(p.page_size) * nb;
  const int64_t per_kv = per_head * p.num_heads;
  MaterializeLaunch a;
  a.p = p;
  a.items = static_cast<uint32_t>(per_kv);
  a.pages_div = FastDivmod::Make(static_cast<uint32_t>(p.max_pages > 0 ? p.max_pages : 1));
  a.head_div = FastDivmod::Make(static_cast<uint32_t>(per_head));
  a.entry_div = FastDivmod::Make(static_cast<uint32_t>(nb));
  a.wide_index = p.num_pages > (int64_t{1} << 32) || p.num_out_pages > (int64_t{1} << 32);
  const int64_t max_pages = p.max_pages > 0 ? p.max_pages : 1;
  const int64_t per_launch = (kMaxLaunchItems - 1) / max_pages;  // requests
  const uint32_t per_cta =
      rows_per_cta > 0
          ? rows_per_cta
          : MaterializeRowsPerCta(1 + static_cast<int64_t>(p.batch_size) * p.max_pages);
  int64_t b = 0;
  do {
    const int64_t n = p.batch_size - b < per_launch ? p.batch_size - b : per_launch;
    a.zero_page = b == 0;
    a.batch_begin = static_cast<int>(b);
    a.rows = (a.zero_page ? 1 : 0) + n * p.max_pages;
    if (!MakeTileShape(per_kv, a.rows, per_cta, &a.shape)) return false;
    f(a);
    b += n;
  } while (b < p.batch_size);
  return true;
}

// kFp8Keys: K pages hold FP8 key bytes (p.fp8_keys); a K block is re-scaled
// with MaterializeFp8KeyValue (a 16-byte copy when the multiplier is 1).
template <typename Index, bool kFp8Keys>
FP4KV_HD void MaterializeThreadT(const MaterializeLaunch& a, uint32_t cta_x, uint32_t cta_y,
                                 uint32_t tid) {
  const internal::MaterializeParams& p = a.p;
  const uint32_t item = cta_y * a.shape.threads + tid;
  if (item >= a.items) return;
  // This thread's block: head, entry, block within the row; K and V.
  uint32_t r, entry, blk;
  const uint32_t head = a.head_div.DivMod(item, &r);
  entry = a.entry_div.DivMod(r, &blk);
  uint8_t* const out_k = p.out + head * p.out_head + entry * p.out_entry + blk * kBlockSize;
  uint8_t* const out_v = out_k + p.out_kv;
  const uint8_t* const data_k = p.k.data + entry * p.k.data_entry + head * p.k.data_head +
                                blk * (kFp8Keys ? kBlockSize : kBlockBytes);
  const uint8_t* const scales_k =
      kFp8Keys ? nullptr : p.k.scales + entry * p.k.scale_entry + head * p.k.scale_head + blk;
  const uint8_t* const data_v =
      p.v.data + entry * p.v.data_entry + head * p.v.data_head + blk * kBlockBytes;
  const uint8_t* const scales_v =
      p.v.scales + entry * p.v.scale_entry + head * p.v.scale_head + blk;
  // Multipliers g / fp8_scale, once per thread.
  const float m_k = Fp8MaterializeMultiplier(p.k_scale.Get(), p.k_fp8_scale.Get());
  const float m_v = Fp8MaterializeMultiplier(p.v_scale.Get(), p.v_fp8_scale.Get());
  const bool fast_k = MaterializeMultiplierFast(m_k);
  const bool fast_v = MaterializeMultiplierFast(m_v);
  const uint32_t skip = a.zero_page ? 1 : 0;
  const uint32_t first = cta_x * a.shape.rows_per_cta;
  const uint32_t end = static_cast<uint32_t>(
      first + a.shape.rows_per_cta < a.rows ? first + a.shape.rows_per_cta : a.rows);
  // Level 1 of a group of pages: request metadata and source pages
  // (independent loads); per page whether it is written at all, zero (entry
  // past the length), and per K / V whether the source page is in range.
  auto resolve = [&](uint32_t r0, MaterializeGroup<Index>* g) {
    g->flags = 0;
    FP4KV_UNROLL
    for (int u = 0; u < kMaterializeUnroll; ++u) {
      g->out_page[u] = 0;
      g->src[u][0] = 0;
      g->src[u][1] = 0;
    }
    FP4KV_UNROLL
    for (int u = 0; u < kMaterializeUnroll; ++u) {
      const uint32_t row = r0 + u;
      if (row >= end) break;
      if (row < skip) {  // out page 0
        g->flags |= (kActive | kZero | kSrcK | kSrcV) << (4 * u);
        continue;
      }
      uint32_t j;
      const int b = a.batch_begin + static_cast<int>(a.pages_div.DivMod(row - skip, &j));
      const int32_t seq_len = p.seq_lens[b];
      const int32_t begin = p.kv_page_indptr[b];
      const int32_t reserved_end = p.kv_page_indptr[b + 1];
      const int64_t t = b * p.table_row_stride + j;
      const int64_t s0 = internal::TableEntry(p.block_tables, p.tables_i64, t);
      const int64_t s1 = internal::TableEntry(p.block_tables, p.tables_i64, t + p.table_kv_stride);
      g->src[u][0] = static_cast<Index>(s0);  // kept only when in range
      g->src[u][1] = static_cast<Index>(s1);
      const int64_t o = static_cast<int64_t>(begin) + j + 1;
      // j < internal::MaterializePages(p, b) without the division: j < max_pages
      // holds by construction, j < ceil(len / page_size) <=> j * page_size < len.
      const int64_t len = seq_len < 0 ? 0 : seq_len;
      const int64_t page_start = static_cast<int64_t>(j) * p.page_size;
      const bool used =
          page_start < len && static_cast<int64_t>(j) < static_cast<int64_t>(reserved_end) - begin;
      if (!used || o < 1 || o >= p.num_out_pages) continue;
      g->out_page[u] = static_cast<Index>(o);
      if (item == 0) {
        p.fp8_block_tables[b * p.fp8_table_row_stride + j] = static_cast<int32_t>(o);
      }
      const uint32_t f = kActive | (page_start + entry >= len ? kZero : 0u) |
                         (s0 >= 0 && s0 < p.num_pages ? kSrcK : 0u) |
                         (s1 >= 0 && s1 < p.num_pages ? kSrcV : 0u);
      g->flags |= f << (4 * u);
    }
  };
  // Level 2: packed codes and scale bytes.
  auto fetch = [&](const MaterializeGroup<Index>& g, MaterializeData<kFp8Keys>* d) {
    FP4KV_UNROLL
    for (int u = 0; u < kMaterializeUnroll; ++u) {
      d->codes[u][0] = U32x2{0, 0};
      d->codes[u][1] = U32x2{0, 0};
      d->sb[u][0] = 0;
      d->sb[u][1] = 0;
      if constexpr (kFp8Keys) d->key_bytes[u] = U32x4{0, 0, 0, 0};
      const uint32_t f = g.flags >> (4 * u);
      if ((f & (kActive | kZero)) != kActive) continue;
      if constexpr (kFp8Keys) {
        if (f & kSrcK) {
          d->key_bytes[u] = LoadInput16(data_k + static_cast<int64_t>(g.src[u][0]) * p.k.data_page);
        }
      } else if (f & kSrcK) {
        d->codes[u][0] = LoadReadOnly8(data_k + static_cast<int64_t>(g.src[u][0]) * p.k.data_page);
        d->sb[u][0] = LoadReadOnly1(scales_k + static_cast<int64_t>(g.src[u][0]) * p.k.scale_page);
      }
      if (f & kSrcV) {
        d->codes[u][1] = LoadReadOnly8(data_v + static_cast<int64_t>(g.src[u][1]) * p.v.data_page);
        d->sb[u][1] = LoadReadOnly1(scales_v + static_cast<int64_t>(g.src[u][1]) * p.v.scale_page);
      }
    }
  };
  // Software pipeline over groups: the next group's index chain is in flight
  // while this group's codes arrive and are converted and stored, so a group
  // costs about one memory latency instead of two.
  MaterializeGroup<Index> cur, next;
  MaterializeData<kFp8Keys> data;
  if (first < end) {
    resolve(first, &cur);
    fetch(cur, &data);
  }
  for (uint32_t r0 = first; r0 < end; r0 += kMaterializeUnroll) {
    const bool more = r0 + kMaterializeUnroll < end;
    if (more) resolve(r0 + kMaterializeUnroll, &next);
    FP4KV_UNROLL
    for (int u = 0; u < kMaterializeUnroll; ++u) {
      const uint32_t f = cur.flags >> (4 * u);
      if (!(f & kActive)) continue;
      const int64_t o = static_cast<int64_t>(cur.out_page[u]) * p.out_page;
      // A source page out of range writes nothing for that tensor.
      if (f & kSrcK) {
        U32x4 kb = U32x4{0, 0, 0, 0};
        if (!(f & kZero)) {
          if constexpr (kFp8Keys) {
            kb = MaterializeFp8KeyBlockFast(data.key_bytes[u], m_k);
          } else {
            kb = MaterializeBlockFast(data.codes[u][0], data.sb[u][0], m_k, fast_k);
          }
        }
        Store16(out_k + o, kb);
      }
      if (f & kSrcV) {
        Store16(out_v + o,
                (f & kZero) ? U32x4{0, 0, 0, 0}
                            : MaterializeBlockFast(data.codes[u][1], data.sb[u][1], m_v, fast_v));
      }
    }
    if (more) {
      cur = next;
      fetch(cur, &data);
    }
  }
}

FP4KV_HD void MaterializeThread(const MaterializeLaunch& a, uint32_t cta_x, uint32_t cta_y,
                                uint32_t tid) {
  if (a.p.fp8_keys) {
    if (a.wide_index) {
      MaterializeThreadT<int64_t, true>(a, cta_x, cta_y, tid);
    } else {
      MaterializeThreadT<uint32_t, true>(a, cta_x, cta_y, tid);
    }
  } else if (a.wide_index) {
    MaterializeThreadT<int64_t, false>(a, cta_x, cta_y, tid);
  } else {
    MaterializeThreadT<uint32_t, false>(a, cta_x, cta_y, tid);
  }
}

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_MATERIALIZE_CUH_
