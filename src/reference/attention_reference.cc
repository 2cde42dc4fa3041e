// CPU reference of decode attention: the definition of what the kernel
// computes, in fp64 over the values format.h decodes (see the contract in
// include/fp4kv/attention.h). Clear rather than fast: each request's K and V
// rows are decoded once per KV head and reused by its queries and qo heads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "fp4kv/format.h"
#include "src/attention_params.h"

namespace fp4kv {
namespace internal {
namespace {

double LoadHalf(const void* base, DType t, int64_t i) {
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return t == DType::kF16 ? HalfBitsToFloat(h) : Bf16BitsToFloat(h);
}

void StoreHalf(void* base, DType t, int64_t i, double x) {
  const float f = static_cast<float>(x);
  static_cast<uint16_t*>(base)[i] = t == DType::kF16 ? FloatToHalfBits(f) : FloatToBf16Bits(f);
}

// Decodes one pool row to e2m1(code) * e4m3(block scale), or to e4m3(code)
// for an FP8 key row (`fp8`), exact in fp32; the global scale is applied by
// the caller (in fp64, once per logit or output).
void DecodeRow(const PoolPtrs& pool, bool fp8, int64_t page, int64_t entry, int64_t head,
               float* out) {
  const uint8_t* data = pool.data + pool.DataOffset(page, entry, head);
  if (fp8) {
    for (int d = 0; d < pool.head_dim; ++d) out[d] = E4m3Decode(data[d]);
    return;
  }
  const uint8_t* scales = pool.scales + pool.ScaleOffset(page, entry, head);
  for (int blk = 0; blk < pool.head_dim / kBlockSize; ++blk) {
    const float s = E4m3Decode(scales[blk]);
    for (int i = 0; i < kBlockSize; ++i) {
      const uint8_t byte = data[blk * kBlockBytes + i / 2];
      const uint8_t code = (i % 2 == 0) ? (byte & 0xf) : (byte >> 4);
      out[blk * kBlockSize + i] = MulRn(E2m1Decode(code), s);
    }
  }
}

// One request's decoded K and V rows of one KV head; tokens whose page is
// outside the pool are not readable.
struct RequestRows {
  int64_t tokens = 0;
  std::vector<bool> readable;  // [tokens]
  std::vector<float> k, v;     // [tokens, Dk], [tokens, Dv]
};

void DecodeRequest(const AttentionParams& p, int b, int64_t tokens, int kv_head, RequestRows* r) {
  const int dk = p.k.head_dim, dv = p.v.head_dim;
  r->tokens = tokens;
  r->readable.assign(tokens, false);
  r->k.assign(tokens * dk, 0.0f);
  r->v.assign(tokens * dv, 0.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t page =
        TableEntry(p.block_tables, p.tables_i64, b * p.table_row_stride + t / p.page_size);
    if (page < 0 || page >= p.num_pages) continue;
    r->readable[t] = true;
    const int64_t entry = t % p.page_size;
    DecodeRow(p.k, p.fp8_keys, page, entry, kv_head, &r->k[t * dk]);
    DecodeRow(p.v, /*fp8=*/false, page, entry, kv_head, &r->v[t * dv]);
  }
}

// Attention of qo head `h` of q row `row`, at position `pos`, over the
// readable tokens in [lo, pos]; writes out (and lse).
void AttendOne(const AttentionParams& p, const RequestRows& r, int64_t row, int h, int64_t lo,
               int64_t pos) {
  const int dk = p.k.head_dim, dv = p.v.head_dim;
  const double logit_scale = static_cast<double>(p.sm_scale) * p.k_scale.Get();
  const double gv = p.v_scale.Get();
  const double cap = p.soft_cap;
  std::vector<double> q(dk);
  for (int d = 0; d < dk; ++d) {
    q[d] = LoadHalf(p.q, p.dtype, row * p.q_row_stride + h * p.q_head_stride + d);
  }
  std::vector<int64_t> tokens;
  std::vector<double> logits;
  for (int64_t t = lo; t <= pos; ++t) {
    if (!r.readable[t]) continue;
    double dot = 0.0;
    for (int d = 0; d < dk; ++d) dot += q[d] * r.k[t * dk + d];
    double logit = logit_scale * dot;
    if (cap > 0.0) logit = cap * std::tanh(logit / cap);
    tokens.push_back(t);
    logits.push_back(logit);
  }
  const int64_t out0 = row * p.out_row_stride + h * p.out_head_stride;
  float* lse = p.lse != nullptr ? p.lse + row * p.lse_row_stride + h : nullptr;
  if (tokens.empty()) {
    for (int d = 0; d < dv; ++d) StoreHalf(p.out, p.dtype, out0 + d, 0.0);
    if (p.ref_out_f64 != nullptr) {
      for (int d = 0; d < dv; ++d) p.ref_out_f64[out0 + d] = 0.0;
    }
    if (lse != nullptr) *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  double m = *std::max_element(logits.begin(), logits.end());
  const bool sink = p.sinks != nullptr;
  const double sink_logit = sink ? p.sinks[h] : 0.0;
  if (sink) m = std::max(m, sink_logit);
  double z = sink ? std::exp(sink_logit - m) : 0.0;
  std::vector<double> acc(dv, 0.0);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const double w = std::exp(logits[i] - m);
    z += w;
    for (int d = 0; d < dv; ++d) acc[d] += w * r.v[tokens[i] * dv + d];
  }
  for (int d = 0; d < dv; ++d) {
    const double x = gv * (acc[d] / z);
    StoreHalf(p.out, p.dtype, out0 + d, x);
    if (p.ref_out_f64 != nullptr) p.ref_out_f64[out0 + d] = x;
  }
  if (lse != nullptr) *lse = static_cast<float>(m + std::log(z));
}

}  // namespace

void ReferenceDecodeAttention(const AttentionParams& p) {
  RequestRows rows;
  for (int b = 0; b < p.batch_size; ++b) {
    if (p.seq_lens[b] <= 0) continue;  // padding row
    const int64_t tokens = AttentionTokens(p, b);
    int64_t q_begin = 0;
    int q_len = 0;
    AttentionQueryRows(p, b, &q_begin, &q_len);
    if (q_len == 0) continue;
    for (int kv_head = 0; kv_head < p.num_kv_heads; ++kv_head) {
      DecodeRequest(p, b, tokens, kv_head, &rows);
      for (int i = 0; i < q_len; ++i) {
        const int64_t pos = tokens - q_len + i;
        if (pos < 0) continue;  // the query precedes the request's first token
        const int64_t lo = p.window_left >= 0 ? std::max<int64_t>(0, pos - p.window_left) : 0;
        for (int h = kv_head * p.group; h < (kv_head + 1) * p.group; ++h) {
          AttendOne(p, rows, q_begin + i, h, lo, pos);
        }
      }
    }
  }
}

}  // namespace internal
}  // namespace fp4kv
