// The decode-attention test-case builder: the sweep covers what it claims,
// and every case holds well-formed NVFP4 pools, distinct pages per request,
// lengths and query rows within their capacities, and a poisoned output.
#include "testing/attention_case.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "fp4kv/format.h"
#include "gtest/gtest.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::AttentionCase;
using testing::AttentionSpec;
using testing::kPoison;

template <typename T>
T Get(const std::vector<uint8_t>& blob, const testing::ViewSpec& v, int64_t i) {
  T x;
  std::memcpy(&x, blob.data() + v.offset + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return x;
}

int64_t TableAt(const AttentionCase& c, int64_t b, int64_t j) {
  const int64_t i = b * c.block_tables.strides[0] + j;
  return c.spec.table_dtype == DType::kI64 ? Get<int64_t>(c.in, c.block_tables, i)
                                           : Get<int32_t>(c.in, c.block_tables, i);
}

TEST(AttentionSweep, CoversTheAdvertisedRanges) {
  const std::vector<AttentionSpec> sweep = testing::AttentionSweep();
  std::set<std::string> names;
  std::set<int> batches, groups, q_lens, dims, pages, exact;
  std::set<DType> dtypes, tables;
  std::set<Layout> layouts;
  int max_len = 0, caps = 0, windows = 0, sinks = 0, lses = 0, oobs = 0, stacked = 0, ptrs = 0;
  for (const AttentionSpec& s : sweep) {
    EXPECT_TRUE(names.insert(s.Name()).second) << "duplicate name " << s.Name();
    for (char ch : s.Name()) {
      EXPECT_TRUE(std::isalnum(static_cast<unsigned char>(ch)) || ch == '_') << s.Name();
    }
    batches.insert(s.batch);
    groups.insert(s.group);
    q_lens.insert(s.q_len);
    dims.insert(s.head_dim);
    pages.insert(s.page_size);
    dtypes.insert(s.dtype);
    tables.insert(s.table_dtype);
    layouts.insert(s.layout);
    if (s.min_seq_len == s.max_seq_len) exact.insert(s.max_seq_len);
    max_len = std::max(max_len, s.max_seq_len);
    caps += s.soft_cap > 0;
    windows += s.window_left >= 0;
    sinks += s.sinks;
    lses += s.lse;
    oobs += s.oob_pages;
    stacked += s.stacked;
    ptrs += s.pointer_scales;
  }
  for (int b : {1, 7, 64}) EXPECT_TRUE(batches.count(b)) << "batch " << b;
  for (int g : {1, 3, 4, 7, 8}) EXPECT_TRUE(groups.count(g)) << "group " << g;
  for (int q : {1, 3, 8}) EXPECT_TRUE(q_lens.count(q)) << "q_len " << q;
  for (int d : {64, 128, 256}) EXPECT_TRUE(dims.count(d)) << "head_dim " << d;
  for (int s : {1, 16, 17}) EXPECT_TRUE(pages.count(s)) << "page_size " << s;
  for (int l : {1, 15, 16, 17, 1000}) EXPECT_TRUE(exact.count(l)) << "exact length " << l;
  EXPECT_GE(max_len, 32768);
  EXPECT_EQ(dtypes.size(), 2u);
  EXPECT_EQ(tables.size(), 2u);
  EXPECT_EQ(layouts.size(), 2u);
  for (int n : {caps, windows, sinks, lses, oobs, stacked, ptrs}) EXPECT_GT(n, 0);
}

TEST(PrefillSweep, CoversTheAdvertisedRanges) {
  std::set<std::string> names;
  std::set<int> batches, groups, q_lens, dims, pages, cached;
  std::set<DType> dtypes, tables;
  std::set<Layout> layouts;
  int caps = 0, windows = 0, sinks = 0, lses = 0, oobs = 0, mixed = 0, fewer = 0, padding = 0;
  int plain = 0;  // no window, soft cap, sinks or lse
  for (const AttentionSpec& s : testing::PrefillSweep()) {
    EXPECT_TRUE(names.insert(s.Name()).second) << "duplicate name " << s.Name();
    for (char ch : s.Name()) {
      EXPECT_TRUE(std::isalnum(static_cast<unsigned char>(ch)) || ch == '_') << s.Name();
    }
    EXPECT_GT(s.q_len, kDecodeRowsQLen) << s.Name();
    EXPECT_FALSE(s.realkv) << s.Name();
    batches.insert(s.batch);
    groups.insert(s.group);
    q_lens.insert(s.q_len);
    dims.insert(s.head_dim);
    pages.insert(s.page_size);
    dtypes.insert(s.dtype);
    tables.insert(s.table_dtype);
    layouts.insert(s.layout);
    // Cached prefixes a full request of the spec can have.
    if (s.full_q) {
      for (int len = s.min_seq_len; len <= s.max_seq_len && len - s.q_len <= 3000; ++len) {
        if (len >= s.q_len) cached.insert(len - s.q_len);
      }
    }
    caps += s.soft_cap > 0;
    windows += s.window_left >= 0;
    sinks += s.sinks;
    lses += s.lse;
    oobs += s.oob_pages;
    mixed += s.mixed_q && s.batch > 1;
    fewer += !s.full_q && s.min_seq_len < s.q_len;
    padding += s.padding_rows;
    plain += s.soft_cap == 0 && s.window_left < 0 && !s.sinks && !s.lse;
  }
  for (int b : {1, 3, 8}) EXPECT_TRUE(batches.count(b)) << "batch " << b;
  for (int g : {1, 4, 7, 8}) EXPECT_TRUE(groups.count(g)) << "group " << g;
  for (int q : {17, 127, 128, 129, 1000, 4096}) EXPECT_TRUE(q_lens.count(q)) << "q_len " << q;
  for (int c : {0, 1, 15, 16, 17, 3000}) EXPECT_TRUE(cached.count(c)) << "cached prefix " << c;
  for (int d : {64, 128, 256}) EXPECT_TRUE(dims.count(d)) << "head_dim " << d;
  for (int p : {1, 16, 17}) EXPECT_TRUE(pages.count(p)) << "page_size " << p;
  EXPECT_EQ(dtypes.size(), 2u);
  EXPECT_EQ(tables.size(), 2u);
  EXPECT_EQ(layouts.size(), 2u);
  for (int n : {caps, windows, sinks, lses, oobs, mixed, fewer, padding, plain}) EXPECT_GT(n, 0);
  for (const AttentionSpec& s : testing::PrefillRealKvSweep()) {
    EXPECT_TRUE(s.realkv) << s.Name();
    EXPECT_GT(s.q_len, kDecodeRowsQLen) << s.Name();
    EXPECT_LE(s.max_seq_len, testing::kRealKvTokens) << s.Name();
    EXPECT_TRUE(names.insert(s.Name()).second) << "duplicate name " << s.Name();
  }
}

// Well-formedness of one case's inputs and outputs.
// `fresh`: made, not rewritten (the global scales were sized for these rows).
void ExpectWellFormed(const AttentionCase& c, bool fresh) {
  const AttentionSpec& s = c.spec;
  const CacheGeometry& g = c.geometry;
  const int64_t B = c.seq_lens.shape[0], M = c.block_tables.shape[1], S = g.page_size;
  ASSERT_EQ(B, s.batch + (s.padding_rows ? 2 : 0));
  ASSERT_EQ(M, (s.max_seq_len + S - 1) / S);
  EXPECT_TRUE(std::all_of(c.out.begin(), c.out.end(), [](uint8_t b) { return b == kPoison; }));

  // Lengths and pages.
  std::set<int64_t> used;
  int padding = 0, bad = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t len = Get<int32_t>(c.in, c.seq_lens, b);
    if (len <= 0) {
      ++padding;
      continue;
    }
    EXPECT_GE(len, s.min_seq_len);
    EXPECT_LE(len, s.max_seq_len);
    for (int64_t j = 0; j < (len + S - 1) / S; ++j) {
      const int64_t page = TableAt(c, b, j);
      if (page < 0 || page >= g.num_pages) {
        ++bad;
        continue;
      }
      EXPECT_TRUE(used.insert(page).second) << "page " << page << " used twice";
    }
  }
  EXPECT_EQ(padding, s.padding_rows ? 2 : 0);
  if (s.oob_pages && s.batch > 1) {
    EXPECT_GT(bad, 0);
  } else if (!s.oob_pages) {
    EXPECT_EQ(bad, 0);
  }

  // Query rows.
  const int64_t total_q = c.q.shape[0];
  if (s.q_len > 1) {
    ASSERT_GE(c.q_indptr.offset, 0);
    for (int64_t b = 0; b < B; ++b) {
      const int32_t lo = Get<int32_t>(c.in, c.q_indptr, b),
                    hi = Get<int32_t>(c.in, c.q_indptr, b + 1);
      EXPECT_LE(lo, hi);
      EXPECT_LE(hi - lo, s.q_len);
    }
    EXPECT_LE(Get<int32_t>(c.in, c.q_indptr, B), total_q);
    // full_q: every request that has rows has q_len of them, decode rows
    // (1 .. kDecodeRowsQLen) aside; mixed_q: both kinds when batch > 1.
    int decode = 0, longer = 0;
    for (int64_t b = 0; b < B; ++b) {
      if (Get<int32_t>(c.in, c.seq_lens, b) <= 0) continue;
      const int32_t n = Get<int32_t>(c.in, c.q_indptr, b + 1) - Get<int32_t>(c.in, c.q_indptr, b);
      EXPECT_GE(n, 1);
      if (n <= kDecodeRowsQLen) {
        ++decode;
      } else {
        ++longer;
      }
      if (s.full_q && (n > kDecodeRowsQLen || !s.mixed_q)) {
        EXPECT_EQ(n, s.q_len);
      }
    }
    if (s.mixed_q && s.batch > 1 && s.q_len > kDecodeRowsQLen && s.full_q) {
      EXPECT_GT(decode, 0);
      EXPECT_GT(longer, 0);
    }
  } else {
    EXPECT_LT(c.q_indptr.offset, 0);
    EXPECT_EQ(total_q, B);
  }
  const int Hq = s.num_kv_heads * s.group;
  double q_norm = 0.0;
  bool q_finite = true;
  for (int64_t r = 0; r < total_q; ++r) {
    for (int h = 0; h < Hq; ++h) {
      for (int d = 0; d < s.head_dim; ++d) {
        const uint16_t bits = Get<uint16_t>(c.in, c.q, r * c.q.strides[0] + h * c.q.strides[1] + d);
        const float x = s.dtype == DType::kF16 ? HalfBitsToFloat(bits) : Bf16BitsToFloat(bits);
        q_finite = q_finite && std::isfinite(x);
        q_norm += static_cast<double>(x) * x;
      }
    }
  }
  EXPECT_TRUE(q_finite);
  EXPECT_GT(q_norm, 0.0);

  // Pools: real block scales (no NaN or negative bytes), on a fresh case the
  // largest at the top of the E4M3 range (a global scale sized for the data),
  // and codes that are not all zero.
  const PagedCache cache = c.Cache(const_cast<uint8_t*>(c.in.data()), Device::Cpu());
  const bool fp8 = s.fp8_keys;
  EXPECT_EQ(c.geometry.fp8_keys(), fp8);
  EXPECT_EQ(cache.key_format, fp8 ? KeyFormat::kFp8 : KeyFormat::kNvfp4);
  if (fp8) {
    // FP8 keys: no K scales, rows of Dk E4M3 bytes, none NaN, and on a fresh
    // case the largest magnitude at the top of E4M3 (0x7e, 448: the key
    // scale is MakeFp8KeyScale of the rows' amax).
    EXPECT_TRUE(cache.k_scales.empty());
    const TensorView& k = cache.k_data;
    ASSERT_EQ(k.ndim, 4);
    EXPECT_EQ(k.shape[3], s.head_dim);
    uint8_t top = 0;
    for (int64_t p = 0; p < g.num_pages; ++p) {
      for (int64_t a = 0; a < k.shape[1]; ++a) {
        for (int64_t b = 0; b < k.shape[2]; ++b) {
          for (int64_t d = 0; d < k.shape[3]; ++d) {
            const uint8_t v = static_cast<const uint8_t*>(
                k.data)[p * k.strides[0] + a * k.strides[1] + b * k.strides[2] + d];
            ASSERT_NE(v & 0x7f, 0x7f) << "NaN key code";
            top = std::max<uint8_t>(top, v & 0x7f);
          }
        }
      }
    }
    if (fresh) {
      EXPECT_EQ(top, 0x7e) << "largest key code 0x" << std::hex << int{top};
    }
  }
  for (const TensorView* t : {&cache.k_scales, &cache.v_scales}) {
    if (t->empty()) continue;  // FP8 keys
    uint8_t top = 0;
    for (int64_t p = 0; p < g.num_pages; ++p) {
      for (int64_t a = 0; a < t->shape[1]; ++a) {
        for (int64_t b = 0; b < t->shape[2]; ++b) {
          for (int64_t k = 0; k < t->shape[3]; ++k) {
            const uint8_t v = static_cast<const uint8_t*>(
                t->data)[p * t->strides[0] + a * t->strides[1] + b * t->strides[2] + k];
            ASSERT_LE(v, 0x7e) << "scale byte 0x" << std::hex << int{v};
            top = std::max(top, v);
          }
        }
      }
    }
    if (fresh) {
      EXPECT_EQ(top, 0x7e) << "largest block scale 0x" << std::hex << int{top};
    }
  }
  for (const TensorView* t : {&cache.k_data, &cache.v_data}) {
    bool any = false;
    const uint8_t* p = static_cast<const uint8_t*>(t->data);
    const uint8_t mask = t == &cache.k_data && fp8 ? 0x7f : 0x77;
    for (int64_t i = 0; i < t->shape[1] * t->strides[1] && !any; ++i) any = (p[i] & mask) != 0;
    EXPECT_TRUE(any) << "page 0 holds only zero codes";
  }
  if (s.sinks) {
    for (int h = 0; h < Hq; ++h) EXPECT_TRUE(std::isfinite(Get<float>(c.in, c.sinks, h)));
  }
  for (const testing::ScaleSpec* sc : {&c.k_scale, &c.v_scale}) {
    EXPECT_GT(sc->value, 0.0f);
    EXPECT_TRUE(std::isfinite(sc->value));
    EXPECT_EQ(sc->offset >= 0, s.pointer_scales);
  }
}

class AttentionCaseTest : public ::testing::TestWithParam<AttentionSpec> {};

TEST_P(AttentionCaseTest, WellFormedBeforeAndAfterRewrite) {
  AttentionCase c = testing::MakeAttentionCase(GetParam(), 7);
  ExpectWellFormed(c, true);
  const std::vector<uint8_t> before = c.in;
  const int64_t q_off = c.q.offset, t_off = c.block_tables.offset;
  c.Rewrite(8);
  EXPECT_EQ(c.in.size(), before.size());
  EXPECT_EQ(c.q.offset, q_off);
  EXPECT_EQ(c.block_tables.offset, t_off);
  EXPECT_NE(c.in, before);
  ExpectWellFormed(c, false);
}

INSTANTIATE_TEST_SUITE_P(Sweep, AttentionCaseTest, ::testing::ValuesIn(testing::AttentionSweep()),
                         [](const auto& info) { return info.param.Name(); });
INSTANTIATE_TEST_SUITE_P(Fp8KeySweep, AttentionCaseTest,
                         ::testing::ValuesIn(testing::WithFp8Keys(testing::AttentionSweep())),
                         [](const auto& info) { return info.param.Name(); });

INSTANTIATE_TEST_SUITE_P(PrefillSweep, AttentionCaseTest,
                         ::testing::ValuesIn(testing::PrefillSweep()),
                         [](const auto& info) { return info.param.Name(); });
INSTANTIATE_TEST_SUITE_P(Fp8KeyPrefillSweep, AttentionCaseTest,
                         ::testing::ValuesIn(testing::WithFp8Keys(testing::PrefillSweep())),
                         [](const auto& info) { return info.param.Name(); });

TEST(AttentionCase, Fp8KeyRowsAreTheQuantizedKeys) {
  // Same seed, same rows: the FP8 case's key bytes are QuantizeFp8Key of
  // the rows the NVFP4 case quantized (its decoded keys are close to them),
  // and the values are byte for byte the NVFP4 case's.
  AttentionSpec s;
  s.batch = 2;
  s.max_seq_len = 33;
  AttentionSpec s8 = s;
  s8.fp8_keys = true;
  const AttentionCase a = testing::MakeAttentionCase(s, 9);
  const AttentionCase b = testing::MakeAttentionCase(s8, 9);
  EXPECT_EQ(b.spec.Name(), a.spec.Name() + "_k8");
  const PagedCache ca = a.Cache(const_cast<uint8_t*>(a.in.data()), Device::Cpu());
  const PagedCache cb = b.Cache(const_cast<uint8_t*>(b.in.data()), Device::Cpu());
  ASSERT_EQ(ca.v_data.ShapeString(), cb.v_data.ShapeString());
  ASSERT_EQ(ca.v_data.strides[0], cb.v_data.strides[0]);
  const auto bytes = [](const TensorView& t) {
    const uint8_t* p = static_cast<const uint8_t*>(t.data);
    return std::vector<uint8_t>(p, p + t.shape[0] * t.strides[0]);
  };
  EXPECT_EQ(bytes(ca.v_data), bytes(cb.v_data));
  EXPECT_EQ(bytes(ca.v_scales), bytes(cb.v_scales));
  // Decoded keys of both: the FP8 ones within E4M3's half ulp (2^-4
  // relative, or its subnormal step) of the NVFP4 ones' source, which the
  // NVFP4 keys approximate far more coarsely: compare the two relative L2s.
  const int D = s.head_dim;
  double e8 = 0.0, e4 = 0.0, n = 0.0;
  for (int64_t p = 0; p < a.geometry.num_pages; ++p) {
    for (int64_t e = 0; e < s.page_size; ++e) {
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        const uint8_t* k8 = static_cast<const uint8_t*>(cb.k_data.data) + p * cb.k_data.strides[0] +
                            e * cb.k_data.strides[1] + h * cb.k_data.strides[2];
        const uint8_t* k4 = static_cast<const uint8_t*>(ca.k_data.data) + p * ca.k_data.strides[0] +
                            e * ca.k_data.strides[1] + h * ca.k_data.strides[2];
        const uint8_t* s4 = static_cast<const uint8_t*>(ca.k_scales.data) +
                            p * ca.k_scales.strides[0] + e * ca.k_scales.strides[1] +
                            h * ca.k_scales.strides[2];
        for (int d = 0; d < D; ++d) {
          const double x8 = static_cast<double>(DequantFp8Key(k8[d], b.k_scale.value));
          const uint8_t code = d % 2 ? k4[d / 2] >> 4 : k4[d / 2] & 0xf;
          const double x4 =
              static_cast<double>(E2m1Decode(code)) * E4m3Decode(s4[d / 16]) * a.k_scale.value;
          e8 += (x8 - x4) * (x8 - x4);
          n += x8 * x8;
          e4 += x4 * x4;
        }
      }
    }
  }
  EXPECT_GT(n, 0.0);
  EXPECT_GT(e4, 0.0);
  // NVFP4 keys differ from the FP8 ones by NVFP4's own error (about 10%
  // relative L2 on these rows), far above E4M3's; a wrong row or scale
  // would give differences near 100%.
  EXPECT_LT(std::sqrt(e8 / n), 0.25);
  EXPECT_GT(std::sqrt(e8 / n), 0.01);
}

// nan_unattended writes NaN codes only where no request attends: the
// reference output is the one of the same case without them (bit for bit),
// and the pools do hold NaN bytes (so the GPU test that uses it tests
// something).
TEST(AttentionCase, NanUnattendedChangesOnlyUnattendedEntries) {
  for (bool fp8 : {false, true}) {
    for (int window : {-1, 9}) {
      AttentionSpec s;
      s.fp8_keys = fp8;
      s.window_left = window;
      s.page_size = 16;
      s.min_seq_len = 1;
      s.max_seq_len = 70;
      s.batch = 4;
      s.lse = true;
      const AttentionCase plain = testing::MakeAttentionCase(s, 11);
      s.nan_unattended = true;
      const AttentionCase nan = testing::MakeAttentionCase(s, 11);
      ASSERT_EQ(plain.in.size(), nan.in.size());
      int64_t changed = 0, nan_bytes = 0;
      for (size_t i = 0; i < plain.in.size(); ++i) {
        if (plain.in[i] != nan.in[i]) {
          ++changed;
          if (nan.in[i] == 0x7f) ++nan_bytes;
        }
      }
      EXPECT_GT(nan_bytes, 0) << "fp8 " << fp8 << " window " << window;
      EXPECT_EQ(changed, nan_bytes);
      EXPECT_EQ(testing::ReferenceAttentionOutputs(plain), testing::ReferenceAttentionOutputs(nan))
          << "fp8 " << fp8 << " window " << window;
    }
  }
}

TEST(AttentionCase, SameSeedSameBytesAndPaddingKeepsValues) {
  AttentionSpec s;
  s.q_len = 3;
  s.sinks = true;
  s.lse = true;
  const AttentionCase a = testing::MakeAttentionCase(s, 5);
  const AttentionCase b = testing::MakeAttentionCase(s, 5);
  EXPECT_EQ(a.in, b.in);
  s.padded = true;
  const AttentionCase p = testing::MakeAttentionCase(s, 5);
  ASSERT_EQ(p.q.shape, a.q.shape);
  EXPECT_NE(p.q.strides, a.q.strides);
  for (int64_t r = 0; r < a.q.shape[0]; ++r) {
    for (int64_t h = 0; h < a.q.shape[1]; ++h) {
      for (int64_t d = 0; d < a.q.shape[2]; ++d) {
        ASSERT_EQ(Get<uint16_t>(a.in, a.q, r * a.q.strides[0] + h * a.q.strides[1] + d),
                  Get<uint16_t>(p.in, p.q, r * p.q.strides[0] + h * p.q.strides[1] + d));
      }
    }
  }
}

TEST(AttentionCase, RealKvRowsComeFromTheFiles) {
  FP4KV_SKIP_WITHOUT_REALKV();
  for (int layer : testing::kRealKvLayers) {
    const testing::RealKvLayer* l = testing::LoadRealKvLayer(layer);
    ASSERT_NE(l, nullptr) << layer;
    ASSERT_EQ(l->q.size(), 1025u * 9 * 64);
    ASSERT_EQ(l->k.size(), 1025u * 3 * 64);
    ASSERT_EQ(l->v.size(), 1025u * 3 * 64);
    double kk = 0.0;
    for (uint16_t b : l->k) {
      const float x = Bf16BitsToFloat(b);
      ASSERT_TRUE(std::isfinite(x));
      kk += static_cast<double>(x) * x;
    }
    EXPECT_GT(kk, 0.0);
  }
  std::vector<AttentionSpec> real = testing::RealKvSweep();
  for (const AttentionSpec& s : testing::PrefillRealKvSweep()) real.push_back(s);
  for (const AttentionSpec& s : real) {
    const AttentionCase c = testing::MakeAttentionCase(s, 3);
    EXPECT_EQ(c.spec.num_kv_heads, 3);
    EXPECT_EQ(c.spec.group, 3);
    EXPECT_EQ(c.spec.head_dim, 64);
    ExpectWellFormed(c, true);
  }
}

}  // namespace
}  // namespace fp4kv
