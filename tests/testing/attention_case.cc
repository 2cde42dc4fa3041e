#include "testing/attention_case.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "fp4kv/format.h"
#include "src/attention_params.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace testing {
namespace {

constexpr int kPaddingRows = 2;     // seq_len 0 and -3
constexpr int64_t kSpareQRows = 2;  // q rows past the last request's (q_len > 1)
constexpr int kRealKvQHeads = 9, kRealKvKvHeads = 3, kRealKvDim = 64;

template <typename T>
void Put(std::vector<uint8_t>& blob, const ViewSpec& v, int64_t i, T value) {
  std::memcpy(blob.data() + v.offset + i * static_cast<int64_t>(sizeof(T)), &value, sizeof(T));
}

template <typename T>
T Get(const std::vector<uint8_t>& blob, const ViewSpec& v, int64_t i) {
  T value;
  std::memcpy(&value, blob.data() + v.offset + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return value;
}

void PutIndex(std::vector<uint8_t>& blob, const ViewSpec& v, int64_t i, int64_t value) {
  if (v.dtype == DType::kI64) {
    Put<int64_t>(blob, v, i, value);
  } else {
    Put<int32_t>(blob, v, i, static_cast<int32_t>(value));
  }
}

float HalfValue(DType t, uint16_t h) {
  return t == DType::kF16 ? HalfBitsToFloat(h) : Bf16BitsToFloat(h);
}

uint16_t HalfBits(DType t, float x) {
  return t == DType::kF16 ? FloatToHalfBits(x) : FloatToBf16Bits(x);
}

ScaleSpec MakeScale(BlobLayout& layout, bool pointer) {
  ScaleSpec s;
  if (pointer) s.offset = layout.Add(DType::kF32, {1}).offset;
  return s;
}

// A block-table entry outside [0, num_pages), drawn from the edges and far
// values (i64 tables also get values no i32 can hold).
int64_t BadPage(std::mt19937_64& rng, int64_t num_pages, bool i64) {
  const int64_t i32_bad[] = {-1, num_pages, num_pages + 7, -1000000,
                             std::numeric_limits<int32_t>::max()};
  if (i64 && rng() % 3 == 0) return rng() % 2 ? int64_t{1} << 40 : -(int64_t{1} << 36);
  return i32_bad[rng() % 5];
}

// Pointers into one pool row (K or V) of the case's input blob.
uint8_t* RowBytes(const TensorView& t, Layout layout, int64_t page, int64_t entry, int64_t head) {
  const int e = layout == Layout::kNHD ? 1 : 2;
  const int h = layout == Layout::kNHD ? 2 : 1;
  return static_cast<uint8_t*>(t.data) + page * t.strides[0] + entry * t.strides[e] +
         head * t.strides[h];
}

// Quantizes one row of f16/bf16 bits into (data, scales) with the standard recipe.
void QuantizeRowInto(const uint16_t* bits, DType dtype, int dim, float g, uint8_t* data,
                     uint8_t* scales) {
  for (int blk = 0; blk < dim / kBlockSize; ++blk) {
    float x[kBlockSize];
    for (int i = 0; i < kBlockSize; ++i) x[i] = HalfValue(dtype, bits[blk * kBlockSize + i]);
    uint32_t packed[2];
    scales[blk] = QuantizeBlock(x, g, Recipe::Standard(), packed);
    for (int i = 0; i < kBlockBytes; ++i) {
      data[blk * kBlockBytes + i] = static_cast<uint8_t>(packed[i / 4] >> (8 * (i % 4)));
    }
  }
}

float AmaxOf(const std::vector<uint16_t>& bits, DType dtype) {
  float amax = 0.0f;
  for (uint16_t b : bits) {
    const float a = std::fabs(HalfValue(dtype, b));
    if (a > amax) amax = a;
  }
  return amax;
}

// Global decode scale mapping amax to the top of both formats (6 * 448).
float ScaleFor(float amax) { return amax > 0.0f ? amax / (6.0f * kE4m3Max) : 1.0f; }

// Rescales every nonzero row to an L2 norm of sqrt(dim) times a random factor
// in [1/2, 2]. The blocks inside a row keep their spread over many octaves;
// rows no longer differ by orders of magnitude, so softmax weights spread
// over many tokens instead of one outlier row taking them all.
void NormalizeRows(std::vector<uint16_t>& bits, DType dtype, int dim, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> octaves(-1.0, 1.0);
  for (size_t r = 0; r + dim <= bits.size(); r += dim) {
    double n = 0.0;
    for (int d = 0; d < dim; ++d) {
      const double x = HalfValue(dtype, bits[r + d]);
      n += x * x;
    }
    if (n == 0.0) continue;
    const double f = std::sqrt(dim / n) * std::exp2(octaves(rng));
    for (int d = 0; d < dim; ++d) {
      bits[r + d] = HalfBits(dtype, static_cast<float>(HalfValue(dtype, bits[r + d]) * f));
    }
  }
}

// Median L2 norm of a sample of rows of `dim` values.
double MedianRowNorm(const std::vector<uint16_t>& bits, DType dtype, int dim) {
  const int64_t rows = static_cast<int64_t>(bits.size()) / dim;
  const int64_t step = std::max<int64_t>(1, rows / 2048);
  std::vector<double> norms;
  for (int64_t r = 0; r < rows; r += step) {
    double s = 0.0;
    for (int d = 0; d < dim; ++d) {
      const double x = HalfValue(dtype, bits[r * dim + d]);
      s += x * x;
    }
    norms.push_back(std::sqrt(s));
  }
  std::nth_element(norms.begin(), norms.begin() + norms.size() / 2, norms.end());
  const double m = norms[norms.size() / 2];
  return m > 0.0 ? m : 1.0;
}

// Fills every input of the case from `seed`. `first`: fixed scale values are
// chosen here (later calls keep them).
void FillCase(AttentionCase& c, uint64_t seed, bool first) {
  std::mt19937_64 rng(seed);
  const AttentionSpec& s = c.spec;
  const CacheGeometry& g = c.geometry;
  const int64_t B = c.seq_lens.shape[0], M = c.block_tables.shape[1];
  const int64_t S = g.page_size, P = g.num_pages;
  const int H = g.num_kv_heads, D = g.head_dim_k, Hq = H * s.group;
  const bool i64 = s.table_dtype == DType::kI64;

  // Padding rows at random places, then lengths.
  std::vector<int> pad_rank(B, -1);
  if (s.padding_rows) {
    std::vector<int64_t> order(B);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int k = 0; k < kPaddingRows && k < B; ++k) pad_rank[order[k]] = k;
  }
  std::vector<int64_t> len(B);
  int first_request = -1;
  for (int64_t b = 0; b < B; ++b) {
    if (pad_rank[b] >= 0) {
      len[b] = pad_rank[b] == 0 ? 0 : -3;
    } else {
      len[b] = s.min_seq_len + static_cast<int64_t>(rng() % (s.max_seq_len - s.min_seq_len + 1));
      if (first_request < 0) first_request = static_cast<int>(b);
    }
    Put<int32_t>(c.in, c.seq_lens, b, static_cast<int32_t>(len[b]));
  }

  // Block tables: each request its own pages from a permutation of the pool.
  // Entries past a request's pages are never read: in-range pages of others
  // or out-of-range values.
  std::vector<int64_t> perm(P);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int64_t> page_owner(P, -1), page_index(P, -1);
  int64_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t need = len[b] > 0 ? (len[b] + S - 1) / S : 0;
    const bool all_bad = s.oob_pages && b == first_request && s.batch > 1;
    for (int64_t j = 0; j < M; ++j) {
      int64_t page;
      if (j < need) {
        page = perm[next++];
        page_owner[page] = b;
        page_index[page] = j;
        if (s.oob_pages && (all_bad || rng() % 6 == 0)) page = BadPage(rng, P, i64);
      } else {
        page = rng() % 3 == 0 ? BadPage(rng, P, i64) : static_cast<int64_t>(rng() % P);
      }
      PutIndex(c.in, c.block_tables, b * c.block_tables.strides[0] + j, page);
    }
  }

  // Query rows per request.
  std::vector<int64_t> q_begin(B), q_count(B);
  if (s.q_len > 1) {
    int64_t indptr = static_cast<int64_t>(rng() % 2);  // may start past row 0
    Put<int32_t>(c.in, c.q_indptr, 0, static_cast<int32_t>(indptr));
    // Mixed steps: which requests get decode rows (the first of a shuffled
    // order does, the second does not, the others at random).
    std::vector<bool> decode_rows(B, false);
    if (s.mixed_q) {
      std::vector<int64_t> requests;
      for (int64_t b = 0; b < B; ++b) {
        if (pad_rank[b] < 0) requests.push_back(b);
      }
      std::shuffle(requests.begin(), requests.end(), rng);
      for (size_t k = 0; k < requests.size(); ++k) {
        decode_rows[requests[k]] = k == 0 || (k > 1 && rng() % 2 == 0);
      }
    }
    const int64_t decode_max = std::min<int64_t>(s.q_len, kDecodeRowsQLen);
    for (int64_t b = 0; b < B; ++b) {
      int64_t n;
      if (decode_rows[b]) {
        n = 1 + static_cast<int64_t>(rng() % decode_max);
      } else if (s.full_q) {
        n = s.q_len;
      } else {
        n = rng() % 2 ? s.q_len : 1 + static_cast<int64_t>(rng() % s.q_len);
      }
      if (pad_rank[b] >= 0 && rng() % 2) n = 0;
      q_begin[b] = indptr;
      q_count[b] = n;
      indptr += n;
      Put<int32_t>(c.in, c.q_indptr, b + 1, static_cast<int32_t>(indptr));
    }
  } else {
    for (int64_t b = 0; b < B; ++b) {
      q_begin[b] = b;
      q_count[b] = 1;
    }
  }

  // Rows of K and V for every pool row (logical order (page, entry, head)),
  // and the real positions of each request when realkv.
  const int64_t pool_rows = P * S * H;
  std::vector<uint16_t> kbits, vbits;
  const RealKvLayer* real = s.realkv ? LoadRealKvLayer(kRealKvLayers[rng() % 4]) : nullptr;
  std::vector<int64_t> offset(B, 0);
  if (real != nullptr) {
    kbits.resize(pool_rows * D);
    vbits.resize(pool_rows * D);
    for (int64_t b = 0; b < B; ++b) {
      if (len[b] > 0 && rng() % 3 != 0) offset[b] = rng() % (kRealKvTokens - len[b] + 1);
    }
    for (int64_t page = 0; page < P; ++page) {
      for (int64_t e = 0; e < S; ++e) {
        int64_t pos = static_cast<int64_t>(rng() % kRealKvTokens);
        const int64_t b = page_owner[page];
        if (b >= 0 && page_index[page] * S + e < len[b]) pos = offset[b] + page_index[page] * S + e;
        for (int h = 0; h < H; ++h) {
          const int64_t dst = ((page * S + e) * H + h) * D;
          const int64_t src = (pos * kRealKvKvHeads + h) * kRealKvDim;
          for (int d = 0; d < D; ++d) {
            kbits[dst + d] = HalfBits(s.dtype, Bf16BitsToFloat(real->k[src + d]));
            vbits[dst + d] = HalfBits(s.dtype, Bf16BitsToFloat(real->v[src + d]));
          }
        }
      }
    }
  } else {
    kbits = RandomHalfBits(s.dtype, pool_rows * D, seed + 1);
    vbits = RandomHalfBits(s.dtype, pool_rows * D, seed + 2);
    NormalizeRows(kbits, s.dtype, D, rng);
    NormalizeRows(vbits, s.dtype, D, rng);
  }

  // Global scales from the rows' amax (FP8 keys: amax on E4M3's top);
  // pointer scales move by a factor 0.5 / 1 / 2 on rewrites (0.5 saturates
  // the largest blocks, or FP8 keys, a little).
  const float factors[] = {0.5f, 1.0f, 2.0f};
  const bool fp8 = g.fp8_keys();
  for (auto [scale, bits] :
       {std::pair<ScaleSpec*, const std::vector<uint16_t>*>{&c.k_scale, &kbits},
        std::pair<ScaleSpec*, const std::vector<uint16_t>*>{&c.v_scale, &vbits}}) {
    const float amax = AmaxOf(*bits, s.dtype);
    const float base = fp8 && scale == &c.k_scale ? MakeFp8KeyScale(amax) : ScaleFor(amax);
    if (first) {
      scale->value = base;
    } else if (scale->offset >= 0) {
      scale->value = base * factors[rng() % 3];
    }
    if (scale->offset >= 0) std::memcpy(c.in.data() + scale->offset, &scale->value, sizeof(float));
  }

  // Quantize every pool row.
  const PagedCache cache = c.Cache(c.in.data(), Device::Cpu());
  const float k_mul = Fp8KeyEncodeMultiplier(c.k_scale.value);
  for (int64_t page = 0; page < P; ++page) {
    for (int64_t e = 0; e < S; ++e) {
      for (int h = 0; h < H; ++h) {
        const int64_t row = ((page * S + e) * H + h) * D;
        if (fp8) {
          uint8_t* dst = RowBytes(cache.k_data, g.layout, page, e, h);
          for (int d = 0; d < D; ++d) {
            dst[d] = QuantizeFp8Key(HalfValue(s.dtype, kbits[row + d]), k_mul);
          }
        } else {
          QuantizeRowInto(kbits.data() + row, s.dtype, D, c.k_scale.value,
                          RowBytes(cache.k_data, g.layout, page, e, h),
                          RowBytes(cache.k_scales, g.layout, page, e, h));
        }
        QuantizeRowInto(vbits.data() + row, s.dtype, D, c.v_scale.value,
                        RowBytes(cache.v_data, g.layout, page, e, h),
                        RowBytes(cache.v_scales, g.layout, page, e, h));
      }
    }
  }
  if (s.nan_unattended) {
    for (int64_t page = 0; page < P; ++page) {
      const int64_t b = page_owner[page];
      if (b < 0) continue;
      int64_t lo = 0;
      if (s.window_left >= 0 && s.q_len == 1) lo = std::max<int64_t>(0, len[b] - 1 - s.window_left);
      for (int64_t e = 0; e < S; ++e) {
        const int64_t pos = page_index[page] * S + e;
        if (pos >= lo && pos < len[b]) continue;
        for (int h = 0; h < H; ++h) {
          if (fp8) {
            std::memset(RowBytes(cache.k_data, g.layout, page, e, h), 0x7f, D);
          } else {
            std::memset(RowBytes(cache.k_scales, g.layout, page, e, h), 0x7f, D / kBlockSize);
          }
          std::memset(RowBytes(cache.v_scales, g.layout, page, e, h), 0x7f, D / kBlockSize);
        }
      }
    }
  }

  // Queries: normal values scaled so that sm_scale * q . k has a spread of a
  // few units on a median key; realkv rows get the model's query at their
  // position.
  const int64_t total_q = c.q.shape[0];
  const double sm = 1.0 / std::sqrt(static_cast<double>(D));
  const float qs = static_cast<float>(2.5 / (sm * MedianRowNorm(kbits, s.dtype, D)));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t r = 0; r < total_q; ++r) {
    for (int h = 0; h < Hq; ++h) {
      for (int d = 0; d < D; ++d) {
        float x = normal(rng) * qs;
        if (x == 0.0f) x = qs;
        Put<uint16_t>(c.in, c.q, r * c.q.strides[0] + h * c.q.strides[1] + d, HalfBits(s.dtype, x));
      }
    }
  }
  if (real != nullptr) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < q_count[b] && len[b] > 0; ++i) {
        const int64_t pos = len[b] - q_count[b] + i;
        if (pos < 0) continue;
        const int64_t r = q_begin[b] + i;
        for (int h = 0; h < Hq; ++h) {
          const int64_t src = ((offset[b] + pos) * kRealKvQHeads + h) * kRealKvDim;
          for (int d = 0; d < D; ++d) {
            Put<uint16_t>(c.in, c.q, r * c.q.strides[0] + h * c.q.strides[1] + d,
                          HalfBits(s.dtype, Bf16BitsToFloat(real->q[src + d])));
          }
        }
      }
    }
  }

  if (s.sinks) {
    std::uniform_real_distribution<float> sink(-2.0f, 8.0f);
    for (int h = 0; h < Hq; ++h) Put<float>(c.in, c.sinks, h, sink(rng));
  }
}

std::string FloatTag(float x) {
  std::string t = absl::StrCat(x);
  std::replace(t.begin(), t.end(), '.', 'p');
  std::replace(t.begin(), t.end(), '-', 'm');
  return t;
}

// ---------------------------------------------------------------- realkv
std::string RealKvFile(const std::string& dir, int layer, const char* what) {
  return absl::StrCat(dir, "/layer", layer < 10 ? "0" : "", layer, "_", what, ".bf16");
}

int64_t RealKvBytes(const char* what) {
  return static_cast<int64_t>(kRealKvTokens) * (what[0] == 'q' ? kRealKvQHeads : kRealKvKvHeads) *
         kRealKvDim * 2;
}

bool RealKvDirComplete(const std::filesystem::path& dir) {
  for (int layer : kRealKvLayers) {
    for (const char* what : {"q", "k", "v"}) {
      std::error_code ec;
      const auto size = std::filesystem::file_size(RealKvFile(dir.string(), layer, what), ec);
      if (ec || static_cast<int64_t>(size) != RealKvBytes(what)) return false;
    }
  }
  return true;
}

// The realkv directory, or "" with the reason in *why.
std::string FindRealKvDir(std::string* why) {
  if (const char* env = std::getenv("FP4KV_REALKV_DIR"); env != nullptr && *env != '\0') {
    if (RealKvDirComplete(env)) return env;
    *why = absl::StrCat("FP4KV_REALKV_DIR=", env, " does not hold the 12 layer files");
    return "";
  }
  std::error_code ec;
  std::vector<std::filesystem::path> starts = {
      std::filesystem::absolute(std::filesystem::path(__FILE__), ec).parent_path()};
  const std::filesystem::path cwd = std::filesystem::current_path(ec);
  if (!ec) starts.push_back(cwd);
  for (std::filesystem::path p : starts) {
    while (!p.empty()) {
      const std::filesystem::path dir = p / "shared" / "data" / "realkv";
      if (RealKvDirComplete(dir)) return dir.string();
      if (p == p.parent_path()) break;
      p = p.parent_path();
    }
  }
  // The project's own copy: tests/data/realkv.
  if (!starts.empty()) {
    const std::filesystem::path own = starts[0].parent_path() / "data" / "realkv";
    if (RealKvDirComplete(own)) return own.string();
  }
  *why = absl::StrCat("no complete shared/data/realkv above ", __FILE__,
                      " or the working directory, and no tests/data/realkv (set FP4KV_REALKV_DIR)");
  return "";
}

bool ReadBits(const std::string& file, int64_t bytes, std::vector<uint16_t>* out) {
  std::ifstream f(file, std::ios::binary);
  if (!f) return false;
  out->resize(bytes / 2);
  f.read(reinterpret_cast<char*>(out->data()), bytes);
  return f.gcount() == bytes;
}

}  // namespace

// --------------------------------------------------------------- the case
std::string AttentionSpec::Name() const {
  return absl::StrCat(
      "b", batch, "_h", num_kv_heads, "x", group, "_d", head_dim, "_s", page_size,
      layout == Layout::kNHD ? "_nhd" : "_hnd", stacked ? "_stacked" : "_tuple",
      dtype == DType::kBF16 ? "_bf16" : "_f16", table_dtype == DType::kI64 ? "_i64" : "_i32",
      "_len", min_seq_len, "to", max_seq_len, padding_rows ? "_padrows" : "", "_q", q_len,
      full_q ? "_full" : "", mixed_q ? "_mixed" : "",
      soft_cap > 0 ? "_cap" + FloatTag(soft_cap) : "",
      window_left >= 0 ? absl::StrCat("_win", window_left) : "", sinks ? "_sinks" : "",
      lse ? "_lse" : "", pointer_scales ? "_ptr" : "", oob_pages ? "_oob" : "",
      realkv ? "_realkv" : "", extra_pages > 0 ? absl::StrCat("_x", extra_pages) : "",
      padded ? "_padded" : "", fp8_keys ? "_k8" : "", nan_unattended ? "_nan" : "");
}

AttentionCase MakeAttentionCase(const AttentionSpec& spec_in, uint64_t seed) {
  AttentionCase c;
  AttentionSpec& s = c.spec;
  s = spec_in;
  if (s.realkv) {
    s.num_kv_heads = kRealKvKvHeads;
    s.group = kRealKvQHeads / kRealKvKvHeads;
    s.head_dim = kRealKvDim;
    s.max_seq_len = std::min(s.max_seq_len, kRealKvTokens);
    s.min_seq_len = std::min(s.min_seq_len, s.max_seq_len);
  }
  s.min_seq_len = std::clamp(s.min_seq_len, 0, s.max_seq_len);
  if (s.fp8_keys) s.stacked = false;
  const int64_t B = s.batch + (s.padding_rows ? kPaddingRows : 0);
  const int64_t M = (s.max_seq_len + s.page_size - 1) / s.page_size;
  const int Hq = s.num_kv_heads * s.group;
  c.geometry = CacheGeometry{
      s.num_kv_heads, s.head_dim, s.head_dim, s.page_size, s.batch * M + 1 + s.extra_pages,
      s.layout, s.fp8_keys ? KeyFormat::kFp8 : KeyFormat::kNvfp4};
  const int64_t total_q = s.q_len > 1 ? B * s.q_len + kSpareQRows : B;
  const int64_t pad = s.padded ? 8 : 0;  // 16 bytes of f16/bf16

  BlobLayout in;
  if (s.fp8_keys) {
    // K rows of Dk E4M3 bytes, no K scales (pool.k_scales stays unset).
    const CacheGeometry& g = c.geometry;
    const int64_t a = g.layout == Layout::kNHD ? g.page_size : g.num_kv_heads;
    const int64_t b = g.layout == Layout::kNHD ? g.num_kv_heads : g.page_size;
    c.pool.geometry = g;
    c.pool.stacked = false;
    c.pool.k_data = in.Add(DType::kU8, {g.num_pages, a, b, g.head_dim_k});
    c.pool.v_data = in.Add(DType::kU8, {g.num_pages, a, b, g.head_dim_v / 2});
    c.pool.v_scales = in.Add(DType::kE4M3, {g.num_pages, a, b, g.head_dim_v / kBlockSize});
  } else {
    c.pool = AddPool(in, c.geometry, s.stacked);
  }
  c.q = in.Add(s.dtype, {total_q, Hq, s.head_dim}, pad);
  if (s.q_len > 1) c.q_indptr = in.Add(DType::kI32, {B + 1});
  c.block_tables = in.Add(s.table_dtype, {B, M}, 3);
  c.seq_lens = in.Add(DType::kI32, {B});
  if (s.sinks) c.sinks = in.Add(DType::kF32, {Hq});
  c.k_scale = MakeScale(in, s.pointer_scales);
  c.v_scale = MakeScale(in, s.pointer_scales);
  c.in.assign(in.size(), kPoison);

  BlobLayout out;
  c.out_view = out.Add(s.dtype, {total_q, Hq, s.head_dim}, pad);
  if (s.lse) c.lse = out.Add(DType::kF32, {total_q, Hq}, s.padded ? 3 : 0);
  c.out.assign(out.size(), kPoison);
  FillCase(c, seed, true);
  return c;
}

void AttentionCase::Rewrite(uint64_t seed) { FillCase(*this, seed, false); }

PagedCache AttentionCase::Cache(uint8_t* in_base, Device device) const {
  if (geometry.fp8_keys()) {
    return PagedCache::Fp8Keys(pool.k_data.At(in_base, device), pool.v_data.At(in_base, device),
                               pool.v_scales.At(in_base, device), geometry.layout);
  }
  return pool.At(in_base, device);
}

DecodeAttention::Options AttentionCase::Options(Device device) const {
  DecodeAttention::Options o;
  o.geometry = geometry;
  o.num_qo_heads = spec.num_kv_heads * spec.group;
  o.dtype = spec.dtype;
  o.table_dtype = spec.table_dtype;
  o.max_batch = static_cast<int>(seq_lens.shape[0]) + 1;
  o.max_pages_per_seq = static_cast<int>(block_tables.shape[1]);
  o.max_q_len = spec.q_len;
  o.sm_scale = 0.0f;
  o.logits_soft_cap = spec.soft_cap;
  o.window_left = spec.window_left;
  o.has_sinks = spec.sinks;
  o.write_lse = spec.lse;
  o.device = device;
  return o;
}

DecodeAttentionArgs AttentionCase::Args(uint8_t* in_base, uint8_t* out_base, Device device) const {
  DecodeAttentionArgs a;
  a.q = q.At(in_base, device);
  a.q_indptr = q_indptr.At(in_base, device);
  a.block_tables = block_tables.At(in_base, device);
  a.seq_lens = seq_lens.At(in_base, device);
  a.out = out_view.At(out_base, device);
  a.lse = lse.At(out_base, device);
  a.sinks = sinks.At(in_base, device);
  a.k_scale = k_scale.At(in_base);
  a.v_scale = v_scale.At(in_base);
  return a;
}

std::vector<AttentionQuery> AttentionQueries(const AttentionCase& c) {
  std::vector<AttentionQuery> out;
  const int64_t B = c.seq_lens.shape[0];
  const int64_t cap = c.block_tables.shape[1] * c.geometry.page_size;
  const int64_t total_q = c.q.shape[0];
  for (int64_t b = 0; b < B; ++b) {
    const int64_t raw = Get<int32_t>(c.in, c.seq_lens, b);
    if (raw <= 0) continue;
    const int64_t n = std::min(raw, cap);
    int64_t begin = b, qlen = 1;
    if (c.q_indptr.offset >= 0) {
      begin = Get<int32_t>(c.in, c.q_indptr, b);
      qlen = std::clamp<int64_t>(Get<int32_t>(c.in, c.q_indptr, b + 1) - begin, 0, c.spec.q_len);
      if (begin < 0 || begin >= total_q) qlen = 0;
      qlen = std::min(qlen, total_q - begin);
    }
    for (int64_t i = 0; i < qlen; ++i) {
      const int64_t pos = n - qlen + i;
      if (pos < 0) continue;
      out.push_back(AttentionQuery{static_cast<int>(b), static_cast<int>(i), begin + i, pos, n});
    }
  }
  return out;
}

std::vector<uint8_t> ReferenceAttentionOutputs(const AttentionCase& c,
                                               std::vector<double>* exact) {
  std::vector<uint8_t> in = c.in, out = c.out;
  const Device cpu = Device::Cpu();
  absl::StatusOr<internal::AttentionParams> p = internal::MakeAttentionParams(
      c.Options(cpu), c.Args(in.data(), out.data(), cpu), c.Cache(in.data(), cpu), nullptr, 0);
  if (exact != nullptr) {
    exact->assign(static_cast<size_t>(c.out_view.bytes / 2),
                  std::numeric_limits<double>::quiet_NaN());
  }
  if (!p.ok()) return out;  // the comparison then reports the untouched outputs
  if (exact != nullptr) p->ref_out_f64 = exact->data();
  if (p->total_q > 0) internal::ReferenceDecodeAttention(*p);
  return out;
}

std::string CompareAttentionOutputs(const AttentionCase& c, const std::vector<uint8_t>& want,
                                    const std::vector<uint8_t>& got, double rel_tol,
                                    double lse_tol, const std::vector<double>* exact) {
  if (want.size() != c.out.size() || got.size() != c.out.size()) {
    return absl::StrCat("blob sizes differ: case ", c.out.size(), ", want ", want.size(), ", got ",
                        got.size());
  }
  if (exact != nullptr && static_cast<int64_t>(exact->size()) != c.out_view.bytes / 2) {
    return absl::StrCat("exact outputs: ", exact->size(), " values, out has ",
                        c.out_view.bytes / 2);
  }
  const DType dt = c.spec.dtype;
  const int Hq = c.spec.num_kv_heads * c.spec.group;
  const int D = c.geometry.head_dim_v;
  // Two ulps of the dtype's smallest subnormal per element: f16 rows of tiny
  // values carry few significant bits, so their relative error means little.
  const double abs_floor =
      2.0 * std::sqrt(static_cast<double>(D)) * std::ldexp(1.0, dt == DType::kF16 ? -24 : -133);
  std::vector<bool> written(c.out.size(), false);
  for (const AttentionQuery& q : AttentionQueries(c)) {
    const std::string where = absl::StrCat("request ", q.request, " query ", q.index, " (row ",
                                           q.row, ", position ", q.position, " of ", q.tokens, ")");
    for (int h = 0; h < Hq; ++h) {
      const int64_t e0 = q.row * c.out_view.strides[0] + h * c.out_view.strides[1];
      double diff = 0.0, norm = 0.0, got_norm = 0.0;
      bool finite = true;
      for (int d = 0; d < D; ++d) {
        const int64_t byte = c.out_view.offset + (e0 + d) * 2;
        written[byte] = written[byte + 1] = true;
        const double w = exact != nullptr ? (*exact)[e0 + d]
                                          : HalfValue(dt, Get<uint16_t>(want, c.out_view, e0 + d));
        const double g = HalfValue(dt, Get<uint16_t>(got, c.out_view, e0 + d));
        if (!std::isfinite(g) || !std::isfinite(w)) finite = false;
        diff += (g - w) * (g - w);
        norm += w * w;
        got_norm += g * g;
      }
      diff = std::sqrt(diff);
      norm = std::sqrt(norm);
      // Both comparisons allow abs_floor (two subnormal ulps per element):
      // below the output format's normal range its own resolution is an
      // error no kernel can avoid, whether the reference is rounded or not.
      const bool ok = finite && diff <= rel_tol * norm + abs_floor;
      if (!ok) {
        std::string values;
        for (int d = 0; d < std::min(D, 4); ++d) {
          absl::StrAppend(&values, d ? ", " : "", "want ",
                          exact != nullptr ? (*exact)[e0 + d]
                                           : HalfValue(dt, Get<uint16_t>(want, c.out_view, e0 + d)),
                          " got ",
                          HalfValue(dt, Get<uint16_t>(got, c.out_view, e0 + d)));
        }
        return absl::StrCat(where, " head ", h, ": out ", finite ? "" : "not finite, ",
                            "||got - want|| = ", diff, ", ||want|| = ", norm,
                            ", ||got|| = ", std::sqrt(got_norm), " (rel tol ", rel_tol,
                            ", abs floor ", abs_floor, "); first values: ", values);
      }
      if (c.lse.offset < 0) continue;
      const int64_t l = q.row * c.lse.strides[0] + h * c.lse.strides[1];
      const int64_t byte = c.lse.offset + l * 4;
      for (int k = 0; k < 4; ++k) written[byte + k] = true;
      const float lw = Get<float>(want, c.lse, l), lg = Get<float>(got, c.lse, l);
      const bool both_ninf = std::isinf(lw) && lw < 0 && std::isinf(lg) && lg < 0;
      if (!both_ninf && !(std::fabs(static_cast<double>(lg) - lw) <= lse_tol)) {
        return absl::StrCat(where, " head ", h, ": lse want ", lw, ", got ", lg, " (tol ", lse_tol,
                            ")");
      }
    }
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (written[i] || got[i] == kPoison) continue;
    const int64_t at = static_cast<int64_t>(i);
    std::string what = "a gap between tensors";
    if (at >= c.out_view.offset && at < c.out_view.offset + c.out_view.bytes) {
      const int64_t e = (at - c.out_view.offset) / 2;
      what = absl::StrCat("out element ", e, " (row ", e / c.out_view.strides[0], ", head ",
                          (e % c.out_view.strides[0]) / c.out_view.strides[1], ")");
    } else if (c.lse.offset >= 0 && at >= c.lse.offset && at < c.lse.offset + c.lse.bytes) {
      const int64_t e = (at - c.lse.offset) / 4;
      what = absl::StrCat("lse element ", e, " (row ", e / c.lse.strides[0], ")");
    }
    return absl::StrCat("byte ", i, " of the output blob, in ", what,
                        ", was written but the contract leaves it alone (0x", absl::Hex(got[i]),
                        ")");
  }
  return "";
}

// ----------------------------------------------------------------- sweeps
std::vector<AttentionSpec> AttentionSweep() {
  constexpr int kBatches[] = {1, 7, 64};
  constexpr int kGroups[] = {1, 3, 4, 7, 8};
  constexpr int kQLens[] = {1, 3, 8};
  constexpr int kDims[] = {64, 128, 256};
  constexpr int kPages[] = {1, 16, 17};
  constexpr int kExact[] = {1, 15, 16, 17, 1000};  // single-request lengths
  constexpr int kMaxLen[] = {17, 300, 1000};       // 7-request lengths
  std::vector<AttentionSpec> out;
  for (int i = 0; i < 30; ++i) {
    AttentionSpec s;
    s.batch = kBatches[i % 3];
    s.group = kGroups[i % 5];
    s.q_len = kQLens[(i / 3) % 3];
    s.head_dim = kDims[(i / 2) % 3];
    s.page_size = kPages[(i / 4) % 3];
    s.layout = (i / 6) % 2 ? Layout::kHND : Layout::kNHD;
    s.stacked = i % 7 == 5;
    s.dtype = (i / 5) % 2 ? DType::kF16 : DType::kBF16;
    s.table_dtype = (i / 3) % 2 ? DType::kI64 : DType::kI32;
    if (s.batch == 1) {
      s.min_seq_len = s.max_seq_len = kExact[(i / 3) % 5];
      s.num_kv_heads = 2;
    } else if (s.batch == 7) {
      s.min_seq_len = 1;
      s.max_seq_len = kMaxLen[(i / 3) % 3];
      s.num_kv_heads = i % 2 ? 1 : 2;
    } else {
      s.min_seq_len = 1;
      s.max_seq_len = 90;
      s.num_kv_heads = 1;
      s.q_len = std::min(s.q_len, 3);
    }
    s.soft_cap = i % 4 == 1 ? 30.0f : (i % 9 == 4 ? 2.5f : 0.0f);
    s.window_left = i % 5 == 2 ? 6 : (i % 8 == 6 ? 200 : (i % 13 == 0 ? 0 : -1));
    s.sinks = i % 3 == 2 || i % 10 == 1;
    s.lse = i % 2 == 0 || i % 7 == 3;
    s.pointer_scales = i % 4 == 3;
    s.oob_pages = i % 6 == 1 || i % 6 == 4;
    s.padded = i % 5 == 4;
    s.padding_rows = i % 8 != 7;
    s.extra_pages = i % 3 == 0 ? 5 : 0;
    out.push_back(s);
  }
  // One long context over few requests.
  AttentionSpec big;
  big.batch = 2;
  big.min_seq_len = 32700;
  big.max_seq_len = 33000;
  big.num_kv_heads = 2;
  big.group = 4;
  big.head_dim = 128;
  big.page_size = 16;
  big.lse = true;
  big.sinks = true;
  out.push_back(big);
  // Short exact lengths around a page boundary, many queries, every option.
  for (int len : {15, 16, 17}) {
    AttentionSpec s;
    s.batch = 7;
    s.min_seq_len = s.max_seq_len = len;
    s.page_size = 16;
    s.group = 8;
    s.num_kv_heads = 1;
    s.q_len = 8;
    s.layout = len == 16 ? Layout::kHND : Layout::kNHD;
    s.dtype = len == 17 ? DType::kF16 : DType::kBF16;
    s.window_left = len == 15 ? 3 : -1;
    s.soft_cap = len == 17 ? 10.0f : 0.0f;
    s.sinks = len != 16;
    s.lse = true;
    s.oob_pages = len == 16;
    out.push_back(s);
  }
  // Drop accidental duplicates so every name is unique.
  std::set<std::string> seen;
  std::vector<AttentionSpec> unique;
  for (const AttentionSpec& s : out) {
    if (seen.insert(s.Name()).second) unique.push_back(s);
  }
  return unique;
}

std::vector<AttentionSpec> RealKvSweep() {
  std::vector<AttentionSpec> out;
  const auto real = []() {
    AttentionSpec s;
    s.realkv = true;
    s.num_kv_heads = kRealKvKvHeads;
    s.group = kRealKvQHeads / kRealKvKvHeads;
    s.head_dim = kRealKvDim;
    return s;
  };
  AttentionSpec s = real();
  s.batch = 4;
  s.min_seq_len = 1;
  s.max_seq_len = kRealKvTokens;
  s.lse = true;
  out.push_back(s);
  s = real();
  s.batch = 2;
  s.min_seq_len = s.max_seq_len = kRealKvTokens;
  s.q_len = 8;
  s.page_size = 17;
  s.layout = Layout::kHND;
  s.dtype = DType::kF16;
  s.sinks = true;
  s.soft_cap = 30.0f;
  s.lse = true;
  out.push_back(s);
  s = real();
  s.batch = 3;
  s.min_seq_len = 200;
  s.max_seq_len = kRealKvTokens;
  s.window_left = 128;
  s.stacked = true;
  s.page_size = 1;
  s.table_dtype = DType::kI64;
  s.pointer_scales = true;
  out.push_back(s);
  s = real();
  s.batch = 5;
  s.min_seq_len = 1;
  s.max_seq_len = 600;
  s.q_len = 3;
  s.oob_pages = true;
  s.lse = true;
  s.padded = true;
  out.push_back(s);
  return out;
}

std::vector<AttentionSpec> PrefillSweep() {
  // One spec per line: requests, KV heads x group, head dim, page size,
  // q_len and lengths (cached prefix = length - q_len with full_q).
  const auto spec = [](int batch, int kv_heads, int group, int dim, int page, int q_len,
                       int min_len, int max_len) {
    AttentionSpec s;
    s.batch = batch;
    s.num_kv_heads = kv_heads;
    s.group = group;
    s.head_dim = dim;
    s.page_size = page;
    s.q_len = q_len;
    s.min_seq_len = min_len;
    s.max_seq_len = max_len;
    s.full_q = true;
    return s;
  };
  std::vector<AttentionSpec> out;
  // 17 new tokens (one past the decode rows) over no cached prefix.
  AttentionSpec s = spec(3, 2, 4, 64, 16, 17, 17, 17);
  s.lse = true;
  out.push_back(s);
  // 17 over 1: page 1, i64 tables, window, sinks, pointer scales.
  s = spec(8, 1, 7, 128, 1, 17, 18, 18);
  s.layout = Layout::kHND;
  s.dtype = DType::kF16;
  s.table_dtype = DType::kI64;
  s.window_left = 6;
  s.sinks = true;
  s.pointer_scales = true;
  out.push_back(s);
  // 127 over 15: head dim 256, page 17, soft cap, out-of-range pages.
  s = spec(3, 1, 8, 256, 17, 127, 142, 142);
  s.soft_cap = 30.0f;
  s.lse = true;
  s.oob_pages = true;
  out.push_back(s);
  // 128 over 16 mixed with decode rows: stacked pools, a window.
  s = spec(8, 2, 1, 64, 16, 128, 144, 144);
  s.layout = Layout::kHND;
  s.mixed_q = true;
  s.window_left = 100;
  s.lse = true;
  s.stacked = true;
  out.push_back(s);
  // 129 over 17 mixed with decode rows: padded views, sinks, i64 tables.
  s = spec(3, 1, 4, 128, 17, 129, 146, 146);
  s.dtype = DType::kF16;
  s.table_dtype = DType::kI64;
  s.mixed_q = true;
  s.sinks = true;
  s.lse = true;
  s.padded = true;
  out.push_back(s);
  // 1000 over 3000.
  s = spec(1, 1, 4, 128, 16, 1000, 4000, 4000);
  s.sinks = true;
  s.lse = true;
  out.push_back(s);
  // 4096 over nothing (a whole prompt), two requests, page 17.
  s = spec(2, 1, 1, 64, 17, 4096, 4096, 4096);
  s.layout = Layout::kHND;
  s.dtype = DType::kF16;
  s.table_dtype = DType::kI64;
  s.lse = true;
  out.push_back(s);
  // 4096 over 3000, no padding rows.
  s = spec(1, 1, 2, 64, 16, 4096, 7096, 7096);
  s.lse = true;
  s.padding_rows = false;
  out.push_back(s);
  // 17 over 3000: one query tile over many key tiles; pages past the tables.
  s = spec(3, 1, 8, 256, 16, 17, 3017, 3017);
  s.layout = Layout::kHND;
  s.lse = true;
  s.oob_pages = true;
  s.extra_pages = 5;
  out.push_back(s);
  // Up to 129 rows over lengths 1 .. 300: fewer rows for some requests, and
  // queries before a short request's first token (negative positions).
  s = spec(8, 1, 7, 64, 17, 129, 1, 300);
  s.full_q = false;
  s.dtype = DType::kF16;
  s.soft_cap = 2.5f;
  s.oob_pages = true;
  s.lse = true;
  out.push_back(s);
  // 1000 over 0 .. 200 mixed with decode rows over about 1100, a window.
  s = spec(8, 2, 1, 128, 16, 1000, 1000, 1200);
  s.mixed_q = true;
  s.window_left = 300;
  s.table_dtype = DType::kI64;
  s.lse = true;
  out.push_back(s);
  // 128 over 0, page 1, head dim 256.
  s = spec(1, 1, 8, 256, 1, 128, 128, 128);
  s.layout = Layout::kHND;
  s.sinks = true;
  s.lse = true;
  out.push_back(s);
  // 17 over 0 .. 23 mixed with decode rows: window 0, soft cap, sinks.
  s = spec(8, 1, 4, 64, 16, 17, 17, 40);
  s.mixed_q = true;
  s.window_left = 0;
  s.soft_cap = 10.0f;
  s.sinks = true;
  s.lse = true;
  out.push_back(s);
  // 127 over 0 or 1, page 1, a window.
  s = spec(3, 2, 1, 128, 1, 127, 127, 128);
  s.layout = Layout::kHND;
  s.dtype = DType::kF16;
  s.table_dtype = DType::kI64;
  s.window_left = 6;
  s.padded = true;
  out.push_back(s);
  // 4096 over 4, mixed with decode rows over 4100, pointer scales, no lse.
  s = spec(3, 1, 1, 64, 16, 4096, 4100, 4100);
  s.mixed_q = true;
  s.pointer_scales = true;
  out.push_back(s);
  return out;
}

std::vector<AttentionSpec> PrefillRealKvSweep() {
  const auto real = []() {
    AttentionSpec s;
    s.realkv = true;
    s.num_kv_heads = kRealKvKvHeads;
    s.group = kRealKvQHeads / kRealKvKvHeads;
    s.head_dim = kRealKvDim;
    s.full_q = true;
    s.lse = true;
    return s;
  };
  std::vector<AttentionSpec> out;
  // 1000 new tokens over 25 cached: the whole of the model's rows.
  AttentionSpec s = real();
  s.batch = 1;
  s.q_len = 1000;
  s.min_seq_len = s.max_seq_len = kRealKvTokens;
  out.push_back(s);
  // Chunks of 300 over 0 .. 725 cached mixed with decode rows: HND, page 17,
  // f16, sinks, soft cap.
  s = real();
  s.batch = 3;
  s.q_len = 300;
  s.min_seq_len = 300;
  s.max_seq_len = kRealKvTokens;
  s.mixed_q = true;
  s.page_size = 17;
  s.layout = Layout::kHND;
  s.dtype = DType::kF16;
  s.sinks = true;
  s.soft_cap = 30.0f;
  out.push_back(s);
  // 129 over 896 with a window: page 1, i64 tables, stacked, pointer scales.
  s = real();
  s.batch = 2;
  s.q_len = 129;
  s.min_seq_len = s.max_seq_len = kRealKvTokens;
  s.window_left = 128;
  s.page_size = 1;
  s.table_dtype = DType::kI64;
  s.stacked = true;
  s.pointer_scales = true;
  out.push_back(s);
  return out;
}

std::vector<AttentionSpec> WithFp8Keys(const std::vector<AttentionSpec>& specs) {
  std::vector<AttentionSpec> out;
  std::set<std::string> seen;
  for (AttentionSpec s : specs) {
    s.fp8_keys = true;
    s.stacked = false;
    if (seen.insert(s.Name()).second) out.push_back(s);
  }
  return out;
}

std::vector<AttentionSpec> Fp8KeyPage16Sweep() {
  std::vector<AttentionSpec> out;
  constexpr int kGroups[] = {1, 4, 8, 3};
  constexpr int kQLens[] = {1, 4, 8, 1};
  for (int i = 0; i < 8; ++i) {
    AttentionSpec s;
    s.fp8_keys = true;
    s.head_dim = 128;
    s.page_size = 16;
    s.batch = i % 2 ? 5 : 2;
    s.num_kv_heads = i % 3 == 0 ? 2 : 1;
    s.group = kGroups[i % 4];
    s.q_len = kQLens[(i / 2) % 4];
    s.min_seq_len = i % 2 ? 1 : 600;
    s.max_seq_len = i % 2 ? 700 : 5000;  // long ones split
    s.layout = i % 4 < 2 ? Layout::kNHD : Layout::kHND;
    s.dtype = i % 2 ? DType::kF16 : DType::kBF16;
    s.table_dtype = i % 3 == 1 ? DType::kI64 : DType::kI32;
    s.window_left = i == 2 ? 300 : -1;
    s.soft_cap = i == 3 ? 30.0f : 0.0f;
    s.sinks = i % 3 == 2;
    s.lse = i % 2 == 0;
    s.oob_pages = i == 5;
    s.padded = i == 6;
    s.pointer_scales = i == 7;
    out.push_back(s);
  }
  return out;
}

// ----------------------------------------------------------------- realkv
bool RealKvAvailable(std::string* why) {
  std::string reason;
  const bool ok = !FindRealKvDir(&reason).empty();
  if (!ok && why != nullptr) *why = reason;
  return ok;
}

const RealKvLayer* LoadRealKvLayer(int layer) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<RealKvLayer>>* cache =
      new std::map<int, std::unique_ptr<RealKvLayer>>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(layer);
  if (it != cache->end()) return it->second.get();
  std::string why;
  const std::string dir = FindRealKvDir(&why);
  std::unique_ptr<RealKvLayer> l;
  if (!dir.empty()) {
    l = std::make_unique<RealKvLayer>();
    if (!ReadBits(RealKvFile(dir, layer, "q"), RealKvBytes("q"), &l->q) ||
        !ReadBits(RealKvFile(dir, layer, "k"), RealKvBytes("k"), &l->k) ||
        !ReadBits(RealKvFile(dir, layer, "v"), RealKvBytes("v"), &l->v)) {
      l.reset();
    }
  }
  const RealKvLayer* result = l.get();
  (*cache)[layer] = std::move(l);
  return result;
}

}  // namespace testing
}  // namespace fp4kv
