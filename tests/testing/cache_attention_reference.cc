#include "testing/cache_attention_reference.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "testing/kv_cache_harness.h"

namespace fp4kv {
namespace testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// f16 / bf16 bits as a double (exact), from the IEEE definitions.
double HalfBitsValue(uint16_t h, DType dtype) {
  if (dtype == DType::kBF16) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  const int sign = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0) {
    v = std::ldexp(static_cast<double>(m), -24);
  } else if (e == 31) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : kNaN;
  } else {
    v = std::ldexp(1.0 + m / 1024.0, e - 15);
  }
  return sign ? -v : v;
}

// One pool region of one layer on the host, addressed by (page, entry, head).
struct Region {
  std::vector<uint8_t> bytes;
  int64_t page = 0, entry = 0, head = 0;  // strides in bytes (u8 / e4m3 elements)

  Region(const TensorView& v, Layout layout) : bytes(DownloadView(v)) {
    if (v.ndim != 4) return;
    page = v.strides[0];
    entry = layout == Layout::kNHD ? v.strides[1] : v.strides[2];
    head = layout == Layout::kNHD ? v.strides[2] : v.strides[1];
  }
  const uint8_t* Row(int64_t p, int64_t e, int64_t h) const {
    return bytes.data() + p * page + e * entry + h * head;
  }
};

// Row of `dim` values of one (page, entry, head): NVFP4 (codes, block scales)
// or FP8 (one E4M3 code a value), times the global scale.
void DecodeRow(const Region& data, const Region* scales, int64_t p, int64_t e, int64_t h, int dim,
               double g, double* out) {
  const uint8_t* d = data.Row(p, e, h);
  if (scales == nullptr) {
    for (int i = 0; i < dim; ++i) out[i] = E4m3Value(d[i]) * g;
    return;
  }
  const uint8_t* s = scales->Row(p, e, h);
  for (int i = 0; i < dim; ++i) {
    const uint8_t byte = d[i / 2];
    const uint8_t nibble = i % 2 == 0 ? byte & 0x0f : byte >> 4;
    out[i] = E2m1Value(nibble) * E4m3Value(s[i / 16]) * g;
  }
}

}  // namespace

double E2m1Value(uint8_t nibble) {
  static constexpr double kMagnitude[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  const double v = kMagnitude[nibble & 7];
  return nibble & 8 ? -v : v;
}

double E4m3Value(uint8_t byte) {
  const int e = (byte >> 3) & 0xf, m = byte & 7;
  if (e == 15 && m == 7) return kNaN;
  const double v = e == 0 ? std::ldexp(static_cast<double>(m), -9)
                          : std::ldexp(1.0 + m / 8.0, e - 7);
  return byte & 0x80 ? -v : v;
}

std::vector<CacheAttentionRequest> StepRequests(absl::Span<const StepEntry> entries,
                                                int max_q_len) {
  std::vector<CacheAttentionRequest> out;
  int64_t row = 0;
  for (size_t b = 0; b < entries.size(); ++b) {
    if (max_q_len == 1) {
      out.push_back({entries[b].seq, static_cast<int64_t>(b), 1});
      continue;
    }
    if (entries[b].num_new_tokens > 0) {
      out.push_back({entries[b].seq, row, entries[b].num_new_tokens});
    }
    row += entries[b].num_new_tokens;
  }
  return out;
}

absl::StatusOr<CacheAttentionWant> CacheAttentionReference(
    const KVCache& cache, int layer, const std::vector<uint16_t>& q, int64_t rows,
    int num_qo_heads, absl::Span<const CacheAttentionRequest> requests, DType dtype,
    double sm_scale) {
  if (cache.device().is_cuda()) {
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaDeviceSynchronize: ", cudaGetErrorString(e)));
    }
  }
  const CacheGeometry& g = cache.geometry();
  const int H = g.num_kv_heads, Dk = g.head_dim_k, Dv = g.head_dim_v;
  if (num_qo_heads <= 0 || num_qo_heads % H != 0) {
    return absl::InvalidArgumentError("num_qo_heads: not a multiple of num_kv_heads");
  }
  const int group = num_qo_heads / H;
  if (static_cast<int64_t>(q.size()) != rows * num_qo_heads * Dk) {
    return absl::InvalidArgumentError(absl::StrCat("q: ", q.size(), " values, expected ",
                                                   rows * num_qo_heads * Dk));
  }
  absl::StatusOr<LayerScales> scales = cache.ReadScales(layer);
  if (!scales.ok()) return scales.status();
  const bool fp8_keys = g.key_format == KeyFormat::kFp8;
  const PagedCache views = cache.LayerCache(layer);
  const Region k_data(views.k_data, g.layout), v_data(views.v_data, g.layout),
      v_scales(views.v_scales, g.layout);
  const Region k_scales = fp8_keys ? Region(TensorView(), g.layout)
                                   : Region(views.k_scales, g.layout);
  if (k_data.bytes.empty() || v_data.bytes.empty() || v_scales.bytes.empty() ||
      (!fp8_keys && k_scales.bytes.empty())) {
    return absl::InternalError("could not copy the layer's pools");
  }
  const double scale = sm_scale > 0 ? sm_scale : 1.0 / std::sqrt(static_cast<double>(Dk));

  CacheAttentionWant w;
  w.rows = rows;
  w.num_qo_heads = num_qo_heads;
  w.head_dim_v = Dv;
  w.out.assign(static_cast<size_t>(rows * num_qo_heads * Dv), kNaN);
  w.lse.assign(static_cast<size_t>(rows * num_qo_heads), kNaN);
  w.magnitude.assign(static_cast<size_t>(rows * num_qo_heads), kNaN);
  std::vector<double> keys, values, logits, abs_out;
  for (const CacheAttentionRequest& r : requests) {
    absl::StatusOr<int64_t> len = cache.SequenceLength(r.seq);
    absl::StatusOr<absl::Span<const int32_t>> pages = cache.SequencePages(r.seq);
    if (!len.ok()) return len.status();
    if (!pages.ok()) return pages.status();
    const int64_t n = *len, ps = g.page_size;
    if (static_cast<int64_t>(pages->size()) * ps < n) {
      return absl::InternalError(absl::StrCat("sequence ", r.seq, ": ", pages->size(),
                                              " pages for ", n, " tokens"));
    }
    if (r.first_row < 0 || r.first_row + r.q_len > rows) {
      return absl::InvalidArgumentError(absl::StrCat("request of sequence ", r.seq, ": rows ",
                                                     r.first_row, " + ", r.q_len, " past ", rows));
    }
    // Every key and value of the sequence, [n, H, D], in double.
    keys.assign(static_cast<size_t>(n * H * Dk), 0.0);
    values.assign(static_cast<size_t>(n * H * Dv), 0.0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t page = (*pages)[t / ps], entry = t % ps;
      if (page < 0 || page >= g.num_pages) {
        return absl::InternalError(absl::StrCat("sequence ", r.seq, ": page ", page));
      }
      for (int h = 0; h < H; ++h) {
        DecodeRow(k_data, fp8_keys ? nullptr : &k_scales, page, entry, h, Dk, scales->k,
                  keys.data() + (t * H + h) * Dk);
        DecodeRow(v_data, &v_scales, page, entry, h, Dv, scales->v,
                  values.data() + (t * H + h) * Dv);
      }
    }
    for (int i = 0; i < r.q_len; ++i) {
      const int64_t pos = n - r.q_len + i;  // attends 0 .. pos
      if (pos < 0) continue;
      const int64_t row = r.first_row + i;
      for (int hq = 0; hq < num_qo_heads; ++hq) {
        const int h = hq / group;
        const uint16_t* qr = q.data() + (row * num_qo_heads + hq) * Dk;
        logits.assign(static_cast<size_t>(pos + 1), 0.0);
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t t = 0; t <= pos; ++t) {
          const double* k = keys.data() + (t * H + h) * Dk;
          double dot = 0.0;
          for (int d = 0; d < Dk; ++d) dot += HalfBitsValue(qr[d], dtype) * k[d];
          logits[t] = dot * scale;
          m = std::max(m, logits[t]);
        }
        double z = 0.0;
        double* o = w.out.data() + (row * num_qo_heads + hq) * Dv;
        for (int d = 0; d < Dv; ++d) o[d] = 0.0;
        abs_out.assign(static_cast<size_t>(Dv), 0.0);
        for (int64_t t = 0; t <= pos; ++t) {
          const double p = std::exp(logits[t] - m);
          z += p;
          const double* v = values.data() + (t * H + h) * Dv;
          for (int d = 0; d < Dv; ++d) {
            o[d] += p * v[d];
            abs_out[d] += p * std::fabs(v[d]);
          }
        }
        double mag = 0.0;
        for (int d = 0; d < Dv; ++d) {
          o[d] /= z;
          mag += (abs_out[d] / z) * (abs_out[d] / z);
        }
        w.magnitude[row * num_qo_heads + hq] = std::sqrt(mag);
        w.lse[row * num_qo_heads + hq] = m + std::log(z);
        ++w.queries;
      }
    }
  }
  return w;
}

std::string CompareCacheAttention(const CacheAttentionWant& want,
                                  const std::vector<uint16_t>& out,
                                  const std::vector<float>& lse, DType dtype,
                                  uint16_t out_poison, float lse_poison, double rel_tol,
                                  double lse_tol, double cancellation_tol, double* worst_ratio) {
  const int Hq = want.num_qo_heads, D = want.head_dim_v;
  if (static_cast<int64_t>(out.size()) != want.rows * Hq * D) {
    return absl::StrCat("out: ", out.size(), " values, expected ", want.rows * Hq * D);
  }
  if (!lse.empty() && static_cast<int64_t>(lse.size()) != want.rows * Hq) {
    return absl::StrCat("lse: ", lse.size(), " values, expected ", want.rows * Hq);
  }
  uint32_t lse_poison_bits;
  std::memcpy(&lse_poison_bits, &lse_poison, 4);
  const double abs_floor =
      2.0 * std::sqrt(static_cast<double>(D)) * std::ldexp(1.0, dtype == DType::kF16 ? -24 : -133);
  for (int64_t r = 0; r < want.rows; ++r) {
    for (int h = 0; h < Hq; ++h) {
      const int64_t i = r * Hq + h;
      const double* w = want.out.data() + i * D;
      const uint16_t* got = out.data() + i * D;
      const std::string where = absl::StrCat("row ", r, " head ", h);
      if (std::isnan(w[0])) {  // a row no request owns: untouched
        for (int d = 0; d < D; ++d) {
          if (got[d] != out_poison) {
            return absl::StrCat(where, ": written (element ", d, " = 0x", absl::Hex(got[d]),
                                "), but no request owns the row");
          }
        }
        if (!lse.empty()) {
          uint32_t bits;
          std::memcpy(&bits, &lse[i], 4);
          if (bits != lse_poison_bits) {
            return absl::StrCat(where, ": lse written (", lse[i], "), but no request owns the row");
          }
        }
        continue;
      }
      bool all_poison = true;
      double diff = 0.0, norm = 0.0;
      for (int d = 0; d < D; ++d) {
        all_poison = all_poison && got[d] == out_poison;
        const double g = HalfBitsValue(got[d], dtype);
        diff += (g - w[d]) * (g - w[d]);
        norm += w[d] * w[d];
      }
      if (all_poison) return absl::StrCat(where, ": not written (still poison)");
      diff = std::sqrt(diff);
      norm = std::sqrt(norm);
      const double mag = want.magnitude.empty() ? norm : want.magnitude[i];
      const double bound =
          cancellation_tol > 0 ? std::max(rel_tol * norm, cancellation_tol * mag) : rel_tol * norm;
      if (worst_ratio != nullptr) *worst_ratio = std::max(*worst_ratio, diff / (bound + abs_floor));
      if (!(diff <= bound + abs_floor)) {
        return absl::StrCat(where, ": ||got - want|| = ", diff, ", ||want|| = ", norm,
                            ", ||sum p|v||| = ", mag, " (rel tol ", rel_tol,
                            cancellation_tol > 0 ? absl::StrCat(", cancellation tol ",
                                                                cancellation_tol)
                                                 : std::string(),
                            "); first values: want ", w[0], " got ",
                            HalfBitsValue(got[0], dtype), ", want ", w[1], " got ",
                            HalfBitsValue(got[1], dtype));
      }
      if (!lse.empty() && !(std::fabs(lse[i] - want.lse[i]) <= lse_tol)) {
        return absl::StrCat(where, ": lse ", lse[i], ", want ", want.lse[i], " (tol ", lse_tol,
                            ")");
      }
    }
  }
  return "";
}

float CacheAttentionLsePoison() {
  const uint32_t bits = 0x01010101u * kCacheAttentionPoison;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::string RunAndCheckCacheAttention(const KVCache& c, const CacheAttention& op, int layer,
                                      absl::Span<const StepEntry> entries,
                                      const std::vector<uint16_t>& q, int64_t rows,
                                      int num_qo_heads, Stream stream,
                                      double cancellation_tol, double* worst_ratio) {
  const CacheGeometry& g = c.geometry();
  const Device dev = c.device();
  const int64_t q_elems = rows * num_qo_heads * g.head_dim_k;
  const int64_t o_elems = rows * num_qo_heads * g.head_dim_v;
  if (static_cast<int64_t>(q.size()) != q_elems) return "q has the wrong size";
  Buffer qb(dev, q_elems * 2), ob(dev, o_elems * 2), lb(dev, rows * num_qo_heads * 4);
  Buffer ws(dev, std::max<int64_t>(op.WorkspaceBytes(), 256));
  if (!qb.ok() || !ob.ok() || !lb.ok() || !ws.ok()) return "allocation failed";
  if (!qb.Upload(q.data(), q_elems * 2) || !ob.Fill(kCacheAttentionPoison) ||
      !lb.Fill(kCacheAttentionPoison) || !ws.Fill(0xff)) {
    return "upload or fill failed";
  }
  if (dev.is_cuda() && cudaDeviceSynchronize() != cudaSuccess) return "cudaDeviceSynchronize";
  const absl::Status s =
      op.Run(layer, qb.View(DType::kBF16, {rows, num_qo_heads, g.head_dim_k}),
             ob.View(DType::kBF16, {rows, num_qo_heads, g.head_dim_v}), ws.get(), ws.size(),
             stream, lb.View(DType::kF32, {rows, num_qo_heads}));
  if (!s.ok()) return "Run: " + s.ToString();
  if (dev.is_cuda()) {
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) return std::string("after Run: ") + cudaGetErrorString(e);
  }
  const std::vector<uint16_t> got = ob.DownloadAs<uint16_t>(o_elems);
  const std::vector<float> got_lse = lb.DownloadAs<float>(rows * num_qo_heads);
  if (got.empty() || got_lse.empty()) return "download failed";
  const int max_q_len = op.op().options().max_q_len;
  absl::StatusOr<CacheAttentionWant> want = CacheAttentionReference(
      c, layer, q, rows, num_qo_heads, StepRequests(entries, max_q_len));
  if (!want.ok()) return "reference: " + want.status().ToString();
  if (want->queries == 0) return "the step has no query: the check checks nothing";
  const uint16_t out_poison = 0x0101 * kCacheAttentionPoison;
  return CompareCacheAttention(*want, got, got_lse, DType::kBF16, out_poison,
                               CacheAttentionLsePoison(), 4e-3, 1e-3, cancellation_tol, worst_ratio);
}

}  // namespace testing
}  // namespace fp4kv
