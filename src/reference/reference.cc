// CPU reference of every op: plain loops over the shared format functions.
// This is the definition of the bytes every kernel must reproduce.
#include <cstring>

#include "fp4kv/format.h"
#include "fp4kv/recipe.h"
#include "src/params.h"

namespace fp4kv {
namespace internal {
namespace {

float LoadFloat(const void* base, DType t, int64_t i) {
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return t == DType::kF16 ? HalfBitsToFloat(h) : Bf16BitsToFloat(h);
}

void StoreFloat(void* base, DType t, int64_t i, float x) {
  static_cast<uint16_t*>(base)[i] = t == DType::kF16 ? FloatToHalfBits(x) : FloatToBf16Bits(x);
}

void StorePacked(uint8_t* dst, const uint32_t (&packed)[2]) {
  for (int i = 0; i < kBlockBytes; ++i) dst[i] = static_cast<uint8_t>(packed[i / 4] >> (8 * (i % 4)));
}

void LoadPacked(const uint8_t* src, uint32_t (&packed)[2]) {
  packed[0] = packed[1] = 0;
  for (int i = 0; i < kBlockBytes; ++i) packed[i / 4] |= static_cast<uint32_t>(src[i]) << (8 * (i % 4));
}

// Quantizes one [head_dim] row into a pool row. events, when not null, gets
// the row's saturated ([0]) and underflowed ([1]) blocks added.
void QuantizeRow(const void* src, DType dtype, int64_t src_offset, int head_dim, float g,
                 const Recipe& recipe, uint8_t* data, uint8_t* scales,
                 uint64_t* events = nullptr) {
  for (int blk = 0; blk < head_dim / kBlockSize; ++blk) {
    float x[kBlockSize];
    for (int i = 0; i < kBlockSize; ++i) x[i] = LoadFloat(src, dtype, src_offset + blk * kBlockSize + i);
    uint32_t packed[2];
    scales[blk] = QuantizeBlock(x, g, recipe, packed);
    StorePacked(data + blk * kBlockBytes, packed);
    if (events != nullptr) {
      const ScaleEvent e = ClassifyBlockScale(BlockAmax(x), g, scales[blk]);
      if (e == ScaleEvent::kSaturated) ++events[0];
      if (e == ScaleEvent::kUnderflow) ++events[1];
    }
  }
}

// Quantizes one [head_dim] key row into head_dim FP8 key bytes. events, when
// not null, gets the row's saturated ([0]) and underflowed ([1]) 16-value
// groups added (ClassifyFp8KeyBlock).
void QuantizeFp8KeyRow(const void* src, DType dtype, int64_t src_offset, int head_dim, float g,
                       uint8_t* data, uint64_t* events = nullptr) {
  const float r = Fp8KeyEncodeMultiplier(g);
  for (int blk = 0; blk < head_dim / kBlockSize; ++blk) {
    float amax = 0.0f;
    for (int i = 0; i < kBlockSize; ++i) {
      const float x = LoadFloat(src, dtype, src_offset + blk * kBlockSize + i);
      data[blk * kBlockSize + i] = QuantizeFp8Key(x, r);
      const float a = AbsF(x);
      amax = a > amax ? a : amax;  // NaN ignored
    }
    if (events != nullptr) {
      const ScaleEvent e = ClassifyFp8KeyBlock(amax, r);
      if (e == ScaleEvent::kSaturated) ++events[0];
      if (e == ScaleEvent::kUnderflow) ++events[1];
    }
  }
}

void DequantizeFp8KeyRow(const uint8_t* data, int head_dim, float g, void* dst, DType dtype,
                         int64_t dst_offset) {
  for (int i = 0; i < head_dim; ++i)
    StoreFloat(dst, dtype, dst_offset + i, DequantFp8Key(data[i], g));
}

// Dequantizes one pool row into [head_dim] f16/bf16 values.
void DequantizeRow(const uint8_t* data, const uint8_t* scales, int head_dim, float g, void* dst,
                   DType dtype, int64_t dst_offset) {
  for (int blk = 0; blk < head_dim / kBlockSize; ++blk) {
    uint32_t packed[2];
    LoadPacked(data + blk * kBlockBytes, packed);
    float y[kBlockSize];
    DequantizeBlock(packed, scales[blk], g, y);
    for (int i = 0; i < kBlockSize; ++i) StoreFloat(dst, dtype, dst_offset + blk * kBlockSize + i, y[i]);
  }
}

}  // namespace

void ReferenceAppend(const AppendParams& p) {
  const float gk = p.k_scale.Get();
  const float gv = p.v_scale.Get();
  for (int64_t i = 0; i < p.nnz; ++i) {
    int64_t page;
    int entry;
    if (!ResolveAppendRow(p, i, &page, &entry)) continue;
    for (int h = 0; h < p.num_heads; ++h) {
      if (p.fp8_keys) {
        QuantizeFp8KeyRow(p.key, p.input_dtype, i * p.key_row_stride + h * p.key_head_stride,
                          p.k.head_dim, gk, p.k.data + p.k.DataOffset(page, entry, h),
                          p.scale_events);
      } else {
        QuantizeRow(p.key, p.input_dtype, i * p.key_row_stride + h * p.key_head_stride,
                    p.k.head_dim, gk, p.recipe, p.k.data + p.k.DataOffset(page, entry, h),
                    p.k.scales + p.k.ScaleOffset(page, entry, h), p.scale_events);
      }
      QuantizeRow(p.value, p.input_dtype, i * p.value_row_stride + h * p.value_head_stride,
                  p.v.head_dim, gv, p.recipe, p.v.data + p.v.DataOffset(page, entry, h),
                  p.v.scales + p.v.ScaleOffset(page, entry, h),
                  p.scale_events == nullptr ? nullptr : p.scale_events + 2);
    }
  }
}

void ReferenceDequantize(const DequantParams& p) {
  const float gk = p.k_scale.Get();
  const float gv = p.v_scale.Get();
  for (int b = 0; b < p.batch_size; ++b) {
    const int64_t n = DequantTokens(p, b);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t page =
          TableEntry(p.block_tables, p.tables_i64, b * p.table_row_stride + t / p.page_size);
      if (page < 0 || page >= p.num_pages) continue;
      const int64_t entry = t % p.page_size;
      for (int h = 0; h < p.num_heads; ++h) {
        const int64_t k_dst = b * p.k_out_batch + t * p.k_out_token + h * p.k_out_head;
        if (p.fp8_keys) {
          DequantizeFp8KeyRow(p.k.data + p.k.DataOffset(page, entry, h), p.k.head_dim, gk, p.k_out,
                              p.output_dtype, k_dst);
        } else {
          DequantizeRow(p.k.data + p.k.DataOffset(page, entry, h),
                        p.k.scales + p.k.ScaleOffset(page, entry, h), p.k.head_dim, gk, p.k_out,
                        p.output_dtype, k_dst);
        }
        DequantizeRow(p.v.data + p.v.DataOffset(page, entry, h),
                      p.v.scales + p.v.ScaleOffset(page, entry, h), p.v.head_dim, gv, p.v_out,
                      p.output_dtype, b * p.v_out_batch + t * p.v_out_token + h * p.v_out_head);
      }
    }
  }
}

void ReferenceMaterialize(const MaterializeParams& p) {
  // Out page 0 is the zero page.
  for (int kv = 0; kv < 2; ++kv) {
    for (int h = 0; h < p.num_heads; ++h) {
      for (int e = 0; e < p.page_size; ++e) {
        std::memset(p.out + kv * p.out_kv + h * p.out_head + e * p.out_entry, 0, p.head_dim);
      }
    }
  }
  const float mult[2] = {Fp8MaterializeMultiplier(p.k_scale.Get(), p.k_fp8_scale.Get()),
                         Fp8MaterializeMultiplier(p.v_scale.Get(), p.v_fp8_scale.Get())};
  const PoolPtrs* pools[2] = {&p.k, &p.v};
  for (int b = 0; b < p.batch_size; ++b) {
    const int64_t len = p.seq_lens[b] < 0 ? 0 : p.seq_lens[b];
    const int64_t pages = MaterializePages(p, b);
    for (int64_t j = 0; j < pages; ++j) {
      const int64_t o = static_cast<int64_t>(p.kv_page_indptr[b]) + j + 1;
      if (o < 1 || o >= p.num_out_pages) continue;
      p.fp8_block_tables[b * p.fp8_table_row_stride + j] = static_cast<int32_t>(o);
      for (int kv = 0; kv < 2; ++kv) {
        const int64_t src = TableEntry(p.block_tables, p.tables_i64,
                                       b * p.table_row_stride + kv * p.table_kv_stride + j);
        if (src < 0 || src >= p.num_pages) continue;
        const PoolPtrs& pool = *pools[kv];
        for (int h = 0; h < p.num_heads; ++h) {
          for (int e = 0; e < p.page_size; ++e) {
            uint8_t* dst = p.out + o * p.out_page + kv * p.out_kv + h * p.out_head + e * p.out_entry;
            if (j * p.page_size + e >= len) {
              std::memset(dst, 0, p.head_dim);
              continue;
            }
            const uint8_t* data = pool.data + pool.DataOffset(src, e, h);
            if (kv == 0 && p.fp8_keys) {
              for (int i = 0; i < p.head_dim; ++i)
                dst[i] = MaterializeFp8KeyValue(data[i], mult[0]);
              continue;
            }
            const uint8_t* scales = pool.scales + pool.ScaleOffset(src, e, h);
            for (int blk = 0; blk < p.head_dim / kBlockSize; ++blk) {
              const float s = E4m3Decode(scales[blk]);
              for (int i = 0; i < kBlockSize; ++i) {
                const uint8_t byte = data[blk * kBlockBytes + i / 2];
                const uint8_t code = (i % 2 == 0) ? (byte & 0xf) : (byte >> 4);
                dst[blk * kBlockSize + i] = MaterializeFp8Value(code, s, mult[kv]);
              }
            }
          }
        }
      }
    }
  }
}

void ReferenceQuantizeLinear(const LinearQuantParams& p) {
  const float g = p.scale.Get();
  for (int64_t r = 0; r < p.rows; ++r) {
    QuantizeRow(p.input, p.dtype, r * p.input_row_stride, static_cast<int>(p.cols), g, p.recipe,
                p.packed + r * p.packed_row_stride, p.scales + r * p.scale_row_stride);
  }
}

void ReferenceDequantizeLinear(const LinearDequantParams& p) {
  const float g = p.scale.Get();
  for (int64_t r = 0; r < p.rows; ++r) {
    DequantizeRow(p.packed + r * p.packed_row_stride, p.scales + r * p.scale_row_stride,
                  static_cast<int>(p.cols), g, p.output, p.dtype, r * p.output_row_stride);
  }
}

void ReferenceCalibrateRows(const RowCalibrationParams& p) {
  if (p.flags[0] != 0 && p.flags[1] != 0) return;
  float amax[2] = {0.0f, 0.0f};
  for (int64_t r = 0; r < p.rows; ++r) {
    if (p.slot_mapping[r] < 0) continue;
    for (int kv = 0; kv < 2; ++kv) {
      const void* base = kv == 0 ? p.key : p.value;
      const int64_t rs = kv == 0 ? p.key_row_stride : p.value_row_stride;
      const int64_t hs = kv == 0 ? p.key_head_stride : p.value_head_stride;
      const int dim = kv == 0 ? p.head_dim_k : p.head_dim_v;
      for (int h = 0; h < p.num_heads; ++h) {
        for (int d = 0; d < dim; ++d) {
          const float a = AbsF(LoadFloat(base, p.dtype, r * rs + h * hs + d));
          amax[kv] = a > amax[kv] ? a : amax[kv];  // NaN ignored
        }
      }
    }
  }
  for (int kv = 0; kv < 2; ++kv) {
    if (p.flags[kv] != 0 || !(amax[kv] > 0.0f)) continue;
    const float a = MulRn(amax[kv], p.headroom);
    const bool fp8 = kv == 0 && p.fp8_keys;
    const float g = fp8 ? MakeFp8KeyScale(a) : MakeGlobalScale(a, p.recipe);
    p.scales[kv] = g;
    p.scales[2 + kv] = fp8 ? MinFp8ScaleForFp8Keys(g) : MinFp8ScaleFor(g);
    p.flags[kv] = 1;
    if (p.host_flags != nullptr) p.host_flags[kv] = 1;
  }
}

void ReferenceReencode(const ReencodeParams& p) {
  const float old_g = *p.old_scale;
  const float new_g = *p.new_scale;
  if (p.fp8_keys) {
    const float r = Fp8KeyEncodeMultiplier(new_g);
    for (int64_t i = 0; i < p.blocks * kBlockSize; ++i) {
      p.data[i] = QuantizeFp8Key(DequantFp8Key(p.data[i], old_g), r);
    }
    return;
  }
  for (int64_t i = 0; i < p.blocks; ++i) {
    uint32_t packed[2];
    LoadPacked(p.data + i * kBlockBytes, packed);
    float x[kBlockSize];
    DequantizeBlock(packed, p.scales[i], old_g, x);
    p.scales[i] = QuantizeBlock(x, new_g, p.recipe, packed);
    StorePacked(p.data + i * kBlockBytes, packed);
  }
}

// Calls f(src_page, entry, dst_page) for every row of a cache quantization
// that writes.
template <typename F>
void ForEachCacheRow(const QuantizeCacheParams& p, F&& f) {
  for (int64_t r = 0; r < p.rows; ++r) {
    int64_t src, dst;
    if (!ResolveCacheRow(p, r / p.page_size, &src, &dst)) continue;
    f(src, r % p.page_size, dst);
  }
}

void ReferenceQuantizeCache(const QuantizeCacheParams& p) {
  if (p.compute_scales) {
    float amax[2] = {0.0f, 0.0f};
    ForEachCacheRow(p, [&](int64_t src, int64_t e, int64_t) {
      for (int kv = 0; kv < 2; ++kv) {
        const void* base = kv == 0 ? p.k_src : p.v_src;
        const int64_t row = kv == 0 ? src * p.k_src_page + e * p.k_src_entry
                                    : src * p.v_src_page + e * p.v_src_entry;
        const int64_t hs = kv == 0 ? p.k_src_head : p.v_src_head;
        const int dim = kv == 0 ? p.k.head_dim : p.v.head_dim;
        for (int h = 0; h < p.num_heads; ++h) {
          for (int d = 0; d < dim; ++d) {
            const float a = AbsF(LoadFloat(base, p.dtype, row + h * hs + d));
            amax[kv] = a > amax[kv] ? a : amax[kv];  // NaN ignored
          }
        }
      }
    });
    FinishCacheScales(p, amax);
  }
  const float gk = p.k_scale.Get();
  const float gv = p.v_scale.Get();
  ForEachCacheRow(p, [&](int64_t src, int64_t e, int64_t dst) {
    for (int h = 0; h < p.num_heads; ++h) {
      const int64_t k_src = src * p.k_src_page + e * p.k_src_entry + h * p.k_src_head;
      if (p.fp8_keys) {
        QuantizeFp8KeyRow(p.k_src, p.dtype, k_src, p.k.head_dim, gk,
                          p.k.data + p.k.DataOffset(dst, e, h));
      } else {
        QuantizeRow(p.k_src, p.dtype, k_src, p.k.head_dim, gk, p.recipe,
                    p.k.data + p.k.DataOffset(dst, e, h), p.k.scales + p.k.ScaleOffset(dst, e, h));
      }
      QuantizeRow(p.v_src, p.dtype, src * p.v_src_page + e * p.v_src_entry + h * p.v_src_head,
                  p.v.head_dim, gv, p.recipe, p.v.data + p.v.DataOffset(dst, e, h),
                  p.v.scales + p.v.ScaleOffset(dst, e, h));
    }
  });
}

}  // namespace internal
}  // namespace fp4kv
