// The CPU reference of every op, through the public functional API on CPU
// tensors: indexing, layouts, forms, contracts on untouched memory, and
// round-trip accuracy.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "fp4kv/format.h"
#include "fp4kv/ops.h"
#include "gtest/gtest.h"
#include "testing/host_cache.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::HostCache;
using testing::kPoison;
using testing::RandomHalfBits;

// Global decode scales large enough that no test value saturates the block
// scale (RandomHalfBits stays below 6 * 448 * 1.0).
constexpr float kGk = 1.25f;
constexpr float kGv = 1.5f;

// One batch of requests with prior lengths, appended rows and their pages.
struct Scenario {
  int batch = 0;
  std::vector<int32_t> prior, added;  // per request
  std::vector<int32_t> kv_indices, kv_indptr, kv_last_page_len;
  std::vector<int32_t> batch_indices, positions;  // per appended row
  int64_t nnz = 0;
  int max_pages = 0;

  // Request b's pages, for block tables.
  std::vector<int64_t> Table(int b) const {
    return std::vector<int64_t>(kv_indices.begin() + kv_indptr[b], kv_indices.begin() + kv_indptr[b + 1]);
  }
  int32_t Len(int b) const { return prior[b] + added[b]; }
};

Scenario MakeScenario(const CacheGeometry& g, int batch, int max_prior, int max_added, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Scenario s;
  s.batch = batch;
  std::vector<int32_t> perm(g.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  int64_t next = 0;
  s.kv_indptr.push_back(0);
  for (int b = 0; b < batch; ++b) {
    const int32_t prior = static_cast<int32_t>(rng() % (max_prior + 1));
    const int32_t added = 1 + static_cast<int32_t>(rng() % max_added);
    s.prior.push_back(prior);
    s.added.push_back(added);
    const int pages = (prior + added + g.page_size - 1) / g.page_size;
    for (int p = 0; p < pages; ++p) s.kv_indices.push_back(perm.at(next++));
    s.kv_indptr.push_back(static_cast<int32_t>(s.kv_indices.size()));
    s.kv_last_page_len.push_back((prior + added - 1) % g.page_size + 1);
    s.max_pages = std::max(s.max_pages, pages);
    for (int t = 0; t < added; ++t) {
      s.batch_indices.push_back(b);
      s.positions.push_back(prior + t);
    }
  }
  s.nnz = static_cast<int64_t>(s.positions.size());
  return s;
}

CacheGeometry Geo(int heads, int dk, int dv, int page_size, int64_t pages, Layout layout) {
  CacheGeometry g;
  g.num_kv_heads = heads;
  g.head_dim_k = dk;
  g.head_dim_v = dv;
  g.page_size = page_size;
  g.num_pages = pages;
  g.layout = layout;
  return g;
}

// Rows of K and V to append, as raw f16/bf16 bits.
struct Rows {
  DType dtype;
  std::vector<uint16_t> k, v;
  TensorView key(const CacheGeometry& g, int64_t n) {
    return TensorView::Contiguous(k.data(), dtype, {n, g.num_kv_heads, g.head_dim_k});
  }
  TensorView value(const CacheGeometry& g, int64_t n) {
    return TensorView::Contiguous(v.data(), dtype, {n, g.num_kv_heads, g.head_dim_v});
  }
};

Rows MakeRows(const CacheGeometry& g, DType dtype, int64_t n, uint64_t seed) {
  return Rows{dtype, RandomHalfBits(dtype, n * g.num_kv_heads * g.head_dim_k, seed),
              RandomHalfBits(dtype, n * g.num_kv_heads * g.head_dim_v, seed + 1)};
}

TensorView I32(std::vector<int32_t>& v) {
  return TensorView::Contiguous(v.data(), DType::kI32, {static_cast<int64_t>(v.size())});
}

float ToFloat(DType t, uint16_t h) { return t == DType::kF16 ? HalfBitsToFloat(h) : Bf16BitsToFloat(h); }

// The expected bytes of one row: data then scales, computed with the format
// functions directly.
std::vector<uint8_t> ExpectedRow(const uint16_t* src, DType dtype, int dim, float g, const Recipe& r) {
  std::vector<uint8_t> data, scales;
  for (int blk = 0; blk < dim / 16; ++blk) {
    float x[16];
    for (int i = 0; i < 16; ++i) x[i] = ToFloat(dtype, src[blk * 16 + i]);
    uint32_t packed[2];
    scales.push_back(QuantizeBlock(x, g, r, packed));
    for (int i = 0; i < 8; ++i) data.push_back(static_cast<uint8_t>(packed[i / 4] >> (8 * (i % 4))));
  }
  data.insert(data.end(), scales.begin(), scales.end());
  return data;
}

// The expected bytes of one FP8 key row: QuantizeFp8Key of every value.
std::vector<uint8_t> ExpectedFp8KeyRow(const uint16_t* src, DType dtype, int dim, float g) {
  std::vector<uint8_t> data;
  const float r = Fp8KeyEncodeMultiplier(g);
  for (int i = 0; i < dim; ++i) data.push_back(QuantizeFp8Key(ToFloat(dtype, src[i]), r));
  return data;
}

absl::Status AppendPaged(Scenario& s, Rows& rows, HostCache& hc, const Recipe& recipe = Recipe()) {
  const CacheGeometry& g = hc.geometry();
  return QuantizeAppendPaged(rows.key(g, s.nnz), rows.value(g, s.nnz), I32(s.batch_indices),
                             I32(s.positions), hc.cache(), I32(s.kv_indices), I32(s.kv_indptr),
                             I32(s.kv_last_page_len), GlobalScale::Value(kGk),
                             GlobalScale::Value(kGv), recipe);
}

struct SweepCase {
  int page_size;
  int heads;
  int dk, dv;
  Layout layout;
  DType dtype;
  bool stacked;
  KeyFormat key_format = KeyFormat::kNvfp4;
};

class AppendSweep : public ::testing::TestWithParam<SweepCase> {};

// Every appended row lands at its page and entry with exactly the bytes the
// format functions give, and nothing else in the cache changes.
TEST_P(AppendSweep, RowsLandWhereIndexedWithExactBytes) {
  const SweepCase c = GetParam();
  CacheGeometry g = Geo(c.heads, c.dk, c.dv, c.page_size, 64, c.layout);
  g.key_format = c.key_format;
  for (int batch : {1, 7}) {
    Scenario s = MakeScenario(g, batch, 2 * c.page_size + 1, 2 * c.page_size + 3, 100 + batch);
    ASSERT_LE(static_cast<int64_t>(s.kv_indices.size()), g.num_pages);
    HostCache hc(g, c.stacked, kPoison);
    Rows rows = MakeRows(g, c.dtype, s.nnz, 7 * batch);
    ASSERT_TRUE(AppendPaged(s, rows, hc).ok());
    std::vector<bool> written(g.num_pages * g.page_size, false);
    for (int64_t i = 0; i < s.nnz; ++i) {
      const int b = s.batch_indices[i];
      const int pos = s.positions[i];
      const int64_t page = s.kv_indices[s.kv_indptr[b] + pos / g.page_size];
      const int entry = pos % g.page_size;
      written[page * g.page_size + entry] = true;
      for (int h = 0; h < g.num_kv_heads; ++h) {
        const uint16_t* k_src = &rows.k[(i * g.num_kv_heads + h) * g.head_dim_k];
        EXPECT_EQ(hc.Row(false, page, entry, h),
                  g.fp8_keys() ? ExpectedFp8KeyRow(k_src, c.dtype, g.head_dim_k, kGk)
                               : ExpectedRow(k_src, c.dtype, g.head_dim_k, kGk, Recipe()))
            << "K row " << i << " head " << h;
        EXPECT_EQ(hc.Row(true, page, entry, h),
                  ExpectedRow(&rows.v[(i * g.num_kv_heads + h) * g.head_dim_v], c.dtype, g.head_dim_v,
                              kGv, Recipe()))
            << "V row " << i << " head " << h;
      }
    }
    // Slots not appended to keep the poison.
    for (int64_t page = 0; page < g.num_pages; ++page) {
      for (int e = 0; e < g.page_size; ++e) {
        if (written[page * g.page_size + e]) continue;
        for (int h = 0; h < g.num_kv_heads; ++h) {
          for (bool is_v : {false, true}) {
            for (uint8_t byte : hc.Row(is_v, page, e, h)) ASSERT_EQ(byte, kPoison);
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Reference, AppendSweep,
    ::testing::Values(SweepCase{1, 2, 64, 64, Layout::kNHD, DType::kBF16, false},
                      SweepCase{3, 3, 64, 128, Layout::kHND, DType::kF16, false},
                      SweepCase{4, 1, 128, 128, Layout::kNHD, DType::kF16, true},
                      SweepCase{16, 2, 128, 64, Layout::kNHD, DType::kBF16, false},
                      SweepCase{17, 2, 16, 16, Layout::kHND, DType::kBF16, true},
                      SweepCase{16, 1, 256, 256, Layout::kHND, DType::kBF16, false},
                      // FP8 keys (K8V4)
                      SweepCase{1, 2, 64, 64, Layout::kNHD, DType::kBF16, false, KeyFormat::kFp8},
                      SweepCase{3, 3, 64, 128, Layout::kHND, DType::kF16, false, KeyFormat::kFp8},
                      SweepCase{16, 2, 128, 64, Layout::kNHD, DType::kF16, false, KeyFormat::kFp8},
                      SweepCase{17, 2, 16, 16, Layout::kHND, DType::kBF16, false,
                                KeyFormat::kFp8}));

// Append + dequantize: every stored value is within the format's error of
// what was appended, positions >= seq_len keep the poison, i32 and i64
// tables agree, and NHD / HND / stacked all give the same values.
TEST(ReferenceOps, RoundTripLayoutsFormsAndTables) {
  const DType dtype = DType::kBF16;
  std::vector<std::vector<uint16_t>> outputs;
  for (Layout layout : {Layout::kNHD, Layout::kHND}) {
    for (bool stacked : {false, true}) {
      for (DType table_dtype : {DType::kI32, DType::kI64}) {
        const CacheGeometry g = Geo(2, 64, 64, 5, 40, layout);
        Scenario s = MakeScenario(g, 5, 9, 12, 42);
        HostCache hc(g, stacked, kPoison);
        Rows rows = MakeRows(g, dtype, s.nnz, 99);
        ASSERT_TRUE(AppendPaged(s, rows, hc).ok());
        // Only the appended positions hold data: read them back with seq_lens =
        // prior + added and check positions < prior stay poisoned in the output
        // only if never written (they were never written: read only new rows).
        const int max_len = 1 + *std::max_element(s.added.begin(), s.added.end()) +
                            *std::max_element(s.prior.begin(), s.prior.end());
        std::vector<int64_t> t64(s.batch * s.max_pages, 0);
        std::vector<int32_t> t32(s.batch * s.max_pages, 0);
        std::vector<int32_t> lens(s.batch);
        for (int b = 0; b < s.batch; ++b) {
          std::vector<int64_t> t = s.Table(b);
          for (size_t j = 0; j < t.size(); ++j) {
            t64[b * s.max_pages + j] = t[j];
            t32[b * s.max_pages + j] = static_cast<int32_t>(t[j]);
          }
          lens[b] = s.Len(b);
        }
        const int64_t out_elems = static_cast<int64_t>(s.batch) * max_len * g.num_kv_heads * g.head_dim_k;
        std::vector<uint16_t> k_out(out_elems, 0xA5A5), v_out(out_elems, 0xA5A5);
        TensorView tables =
            table_dtype == DType::kI64
                ? TensorView::Contiguous(t64.data(), DType::kI64, {s.batch, s.max_pages})
                : TensorView::Contiguous(t32.data(), DType::kI32, {s.batch, s.max_pages});
        ASSERT_TRUE(DequantizePaged(
                        hc.cache(), tables, I32(lens),
                        TensorView::Contiguous(k_out.data(), dtype, {s.batch, max_len, g.num_kv_heads, g.head_dim_k}),
                        TensorView::Contiguous(v_out.data(), dtype, {s.batch, max_len, g.num_kv_heads, g.head_dim_v}),
                        GlobalScale::Value(kGk), GlobalScale::Value(kGv))
                        .ok());
        const int64_t row = static_cast<int64_t>(g.num_kv_heads) * g.head_dim_k;
        for (int b = 0; b < s.batch; ++b) {
          for (int t = s.Len(b); t < max_len; ++t) {
            for (int64_t e = 0; e < row; ++e) {
              ASSERT_EQ(k_out[(b * max_len + t) * row + e], 0xA5A5) << "K past seq_len written";
              ASSERT_EQ(v_out[(b * max_len + t) * row + e], 0xA5A5) << "V past seq_len written";
            }
          }
        }
        // Appended rows reconstruct within the format's error.
        for (int64_t i = 0; i < s.nnz; ++i) {
          const int b = s.batch_indices[i], t = s.positions[i];
          for (int which = 0; which < 2; ++which) {
            const std::vector<uint16_t>& in = which ? rows.v : rows.k;
            const std::vector<uint16_t>& out = which ? v_out : k_out;
            for (int64_t blk = 0; blk < row / 16; ++blk) {
              float amax = 0;
              for (int j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(ToFloat(dtype, in[i * row + blk * 16 + j])));
              for (int j = 0; j < 16; ++j) {
                const float x = ToFloat(dtype, in[i * row + blk * 16 + j]);
                const float y = ToFloat(dtype, out[(b * max_len + t) * row + blk * 16 + j]);
                // Half the top E2M1 step (2 units of amax/6) is amax/6; the
                // E4M3 scale adds at most 1/16 relative and bf16 output 1/256.
                // Blocks whose scale falls to E4M3 subnormals (< 2^-6 * g)
                // lose relative precision: an absolute floor of a few of the
                // smallest scale steps (2^-9 * g) covers them.
                const float g = which ? kGv : kGk;
                ASSERT_LE(std::fabs(x - y), 0.19f * amax + 8.0f * 0.001953125f * g)
                    << "row " << i << " value " << j;
              }
            }
          }
        }
        // Keep the appended rows only, to compare across layouts/forms/tables.
        std::vector<uint16_t> got;
        for (int64_t i = 0; i < s.nnz; ++i) {
          const int b = s.batch_indices[i], t = s.positions[i];
          got.insert(got.end(), k_out.begin() + (b * max_len + t) * row, k_out.begin() + (b * max_len + t + 1) * row);
          got.insert(got.end(), v_out.begin() + (b * max_len + t) * row, v_out.begin() + (b * max_len + t + 1) * row);
        }
        outputs.push_back(got);
      }
    }
  }
  for (size_t i = 1; i < outputs.size(); ++i) EXPECT_EQ(outputs[i], outputs[0]) << "variant " << i;
}

// Prefill that ends mid-page, then single-token decode steps continuing the
// partially filled page and crossing into new pages, gives the same bytes as
// appending everything at once.
TEST(ReferenceOps, DecodeContinuesPartialPageSameBytesAsOneShot) {
  const CacheGeometry g = Geo(2, 64, 128, 4, 8, Layout::kNHD);
  const int total = 11;  // 2.75 pages
  Rows rows = MakeRows(g, DType::kF16, total, 5);
  std::vector<int32_t> pages = {6, 1, 3};
  std::vector<int32_t> indptr = {0, 3};
  auto run = [&](HostCache& hc, int from, int to) {
    std::vector<int32_t> bi(to - from, 0), pos(to - from);
    std::iota(pos.begin(), pos.end(), from);
    std::vector<int32_t> last = {(to - 1) % g.page_size + 1};
    Rows part{DType::kF16,
              std::vector<uint16_t>(rows.k.begin() + from * 2 * 64, rows.k.begin() + to * 2 * 64),
              std::vector<uint16_t>(rows.v.begin() + from * 2 * 128, rows.v.begin() + to * 2 * 128)};
    return QuantizeAppendPaged(part.key(g, to - from), part.value(g, to - from), I32(bi), I32(pos),
                               hc.cache(), I32(pages), I32(indptr), I32(last), GlobalScale::Value(kGk),
                               GlobalScale::Value(kGv));
  };
  HostCache once(g, false, kPoison), steps(g, false, kPoison);
  ASSERT_TRUE(run(once, 0, total).ok());
  ASSERT_TRUE(run(steps, 0, 6).ok());  // prefill ends inside page 1
  for (int t = 6; t < total; ++t) ASSERT_TRUE(run(steps, t, t + 1).ok());
  EXPECT_EQ(steps.Snapshot(), once.Snapshot());
}

// Slot-based append writes the same bytes as index-based append, skips
// negative (padding) slots and reads only the first len(slot_mapping) rows.
TEST(ReferenceOps, SlotAppendMatchesPagedAndSkipsPadding) {
  const CacheGeometry g = Geo(2, 64, 64, 3, 30, Layout::kHND);
  Scenario s = MakeScenario(g, 4, 5, 6, 8);
  Rows rows = MakeRows(g, DType::kBF16, s.nnz + 3, 12);  // 3 padded rows past the mapping
  HostCache paged(g, false, kPoison), slotted(g, false, kPoison);
  ASSERT_TRUE(AppendPaged(s, rows, paged).ok());
  std::vector<int64_t> slots;
  for (int64_t i = 0; i < s.nnz; ++i) {
    const int b = s.batch_indices[i], pos = s.positions[i];
    slots.push_back(static_cast<int64_t>(s.kv_indices[s.kv_indptr[b] + pos / g.page_size]) * g.page_size +
                    pos % g.page_size);
  }
  // Interleave padding rows: mapping row r -> slot or -1, and feed rows in the
  // same order, so the rows at -1 must be skipped.
  std::vector<int64_t> mapping;
  Rows fed{DType::kBF16, {}, {}};
  const int64_t row = static_cast<int64_t>(g.num_kv_heads) * g.head_dim_k;
  for (int64_t i = 0; i < s.nnz; ++i) {
    if (i % 3 == 1) {
      mapping.push_back(-1);
      fed.k.insert(fed.k.end(), rows.k.begin() + (s.nnz + 1) * row, rows.k.begin() + (s.nnz + 2) * row);
      fed.v.insert(fed.v.end(), rows.v.begin() + (s.nnz + 1) * row, rows.v.begin() + (s.nnz + 2) * row);
    }
    mapping.push_back(slots[i]);
    fed.k.insert(fed.k.end(), rows.k.begin() + i * row, rows.k.begin() + (i + 1) * row);
    fed.v.insert(fed.v.end(), rows.v.begin() + i * row, rows.v.begin() + (i + 1) * row);
  }
  const int64_t n = static_cast<int64_t>(mapping.size());
  // Two extra rows past the mapping that must not be read.
  fed.k.insert(fed.k.end(), rows.k.begin() + s.nnz * row, rows.k.begin() + (s.nnz + 2) * row);
  fed.v.insert(fed.v.end(), rows.v.begin() + s.nnz * row, rows.v.begin() + (s.nnz + 2) * row);
  ASSERT_TRUE(QuantizeAppendBySlot(fed.key(g, n + 2), fed.value(g, n + 2),
                                   TensorView::Contiguous(mapping.data(), DType::kI64, {n}),
                                   slotted.cache(), GlobalScale::Value(kGk), GlobalScale::Value(kGv))
                  .ok());
  EXPECT_EQ(slotted.Snapshot(), paged.Snapshot());
}

// Values the host cannot check have defined behaviour: out-of-range batch
// index, position past the request's pages, page index out of range, and a
// slot past the pool write nothing.
TEST(ReferenceOps, OutOfRangeIndicesWriteNothing) {
  const CacheGeometry g = Geo(1, 16, 16, 4, 4, Layout::kNHD);
  Rows rows = MakeRows(g, DType::kBF16, 4, 3);
  std::vector<int32_t> pages = {2, 99};  // second page index is out of range
  std::vector<int32_t> indptr = {0, 2};
  std::vector<int32_t> last = {4};
  std::vector<int32_t> bi = {0, 5, 0, 0};      // batch index 5 is out of range
  std::vector<int32_t> pos = {1, 0, 9, 5};     // pos 9 is past 2 pages; pos 5 -> page 99
  HostCache hc(g, false, kPoison);
  ASSERT_TRUE(QuantizeAppendPaged(rows.key(g, 4), rows.value(g, 4), I32(bi), I32(pos), hc.cache(),
                                  I32(pages), I32(indptr), I32(last), GlobalScale::Value(kGk),
                                  GlobalScale::Value(kGv))
                  .ok());
  HostCache expect(g, false, kPoison);
  std::vector<int32_t> bi1 = {0}, pos1 = {1};
  Rows first{DType::kBF16, std::vector<uint16_t>(rows.k.begin(), rows.k.begin() + 16),
             std::vector<uint16_t>(rows.v.begin(), rows.v.begin() + 16)};
  ASSERT_TRUE(QuantizeAppendPaged(first.key(g, 1), first.value(g, 1), I32(bi1), I32(pos1),
                                  expect.cache(), I32(pages), I32(indptr), I32(last),
                                  GlobalScale::Value(kGk), GlobalScale::Value(kGv))
                  .ok());
  EXPECT_EQ(hc.Snapshot(), expect.Snapshot());

  std::vector<int64_t> slots = {-1, 16, 1000, -7};
  HostCache hs(g, false, kPoison);
  ASSERT_TRUE(QuantizeAppendBySlot(rows.key(g, 4), rows.value(g, 4),
                                   TensorView::Contiguous(slots.data(), DType::kI64, {4}), hs.cache(),
                                   GlobalScale::Value(kGk), GlobalScale::Value(kGv))
                  .ok());
  EXPECT_EQ(hs.Snapshot(), HostCache(g, false, kPoison).Snapshot());
}

// Global scales given as pointers (host memory for CPU tensors) give the same
// bytes as values.
TEST(ReferenceOps, ScalePointersEqualValues) {
  const CacheGeometry g = Geo(2, 32, 32, 4, 8, Layout::kNHD);
  Rows rows = MakeRows(g, DType::kBF16, 5, 77);
  std::vector<int64_t> slots = {0, 5, 9, 30, 2};
  const float gk = kGk, gv = kGv;
  HostCache a(g, false, kPoison), b(g, false, kPoison);
  TensorView map = TensorView::Contiguous(slots.data(), DType::kI64, {5});
  ASSERT_TRUE(QuantizeAppendBySlot(rows.key(g, 5), rows.value(g, 5), map, a.cache(),
                                   GlobalScale::Value(gk), GlobalScale::Value(gv))
                  .ok());
  ASSERT_TRUE(QuantizeAppendBySlot(rows.key(g, 5), rows.value(g, 5), map, b.cache(),
                                   GlobalScale::Pointer(&gk), GlobalScale::Pointer(&gv))
                  .ok());
  EXPECT_EQ(a.Snapshot(), b.Snapshot());
}

// Materialize: page 0 zeroed, request pages at indptr[b]+j+1 with the FP8 of
// each stored value, tails of partial pages zero, table entries past the
// active pages and out pages past indptr[B] untouched; separate K/V tables.
TEST(ReferenceOps, MaterializeFp8Contract) {
  for (bool separate : {false, true}) {
    for (Layout layout : {Layout::kNHD, Layout::kHND}) {
      const CacheGeometry g = Geo(2, 64, 64, 4, 40, layout);
      const int batch = 3;
      std::vector<int32_t> lens = {5, 8, 1};
      std::vector<int32_t> indptr = {0, 3, 5, 7};  // request 0 reserves one page more than needed
      const int max_pages = 3;
      const int64_t out_pages = 1 + indptr.back() + 2;  // two spare pages stay poisoned
      HostCache hc(g, false, kPoison);
      // Fill the whole pool with random valid bytes (any bytes are valid codes/scales
      // except NaN scales; avoid 0x7f/0xff scales).
      std::vector<uint8_t> all = testing::RandomBytes(hc.Snapshot().size(), 3);
      {
        const PagedCache& c = hc.cache();
        size_t off = 0;
        for (const TensorView* t : {&c.k_data, &c.k_scales, &c.v_data, &c.v_scales}) {
          uint8_t* p = static_cast<uint8_t*>(t->data);
          for (int64_t i = 0; i < t->numel(); ++i) {
            uint8_t v = all[off++];
            if (t == &c.k_scales || t == &c.v_scales) v &= 0x77;  // positive, finite, modest scales
            p[i] = v;
          }
        }
      }
      std::vector<int32_t> tables(batch * (separate ? 2 : 1) * max_pages, -5);
      std::mt19937 rng(9);
      for (auto& t : tables) t = static_cast<int32_t>(rng() % g.num_pages);
      std::vector<uint8_t> out(out_pages * 2 * g.num_kv_heads * g.page_size * g.head_dim_k, kPoison);
      std::vector<int32_t> fp8_tables(batch * max_pages, -3);
      const float k_fp8 = *MinFp8Scale(kGk), v_fp8 = *MinFp8Scale(kGv);
      TensorView tv = separate ? TensorView::Contiguous(tables.data(), DType::kI32, {batch, 2, max_pages})
                               : TensorView::Contiguous(tables.data(), DType::kI32, {batch, max_pages});
      ASSERT_TRUE(MaterializeFp8(hc.cache(), tv, I32(lens), I32(indptr),
                                 TensorView::Contiguous(out.data(), DType::kE4M3,
                                                        {out_pages, 2, g.num_kv_heads, g.page_size, g.head_dim_k}),
                                 TensorView::Contiguous(fp8_tables.data(), DType::kI32, {batch, max_pages}),
                                 GlobalScale::Value(kGk), GlobalScale::Value(kGv), GlobalScale::Value(k_fp8),
                                 GlobalScale::Value(v_fp8))
                      .ok());
      const int64_t page_bytes = 2LL * g.num_kv_heads * g.page_size * g.head_dim_k;
      for (int64_t i = 0; i < page_bytes; ++i) ASSERT_EQ(out[i], 0) << "page 0 byte " << i;
      for (int64_t i = (1 + indptr.back()) * page_bytes; i < out_pages * page_bytes; ++i) {
        ASSERT_EQ(out[i], kPoison) << "page past indptr[B] written";
      }
      const float mult[2] = {kGk / k_fp8, kGv / v_fp8};
      for (int b = 0; b < batch; ++b) {
        const int active = (lens[b] + g.page_size - 1) / g.page_size;
        for (int j = 0; j < max_pages; ++j) {
          if (j >= active) {
            EXPECT_EQ(fp8_tables[b * max_pages + j], -3) << "unused table entry written";
            continue;
          }
          const int o = indptr[b] + j + 1;
          ASSERT_EQ(fp8_tables[b * max_pages + j], o);
          for (int kv = 0; kv < 2; ++kv) {
            const int src = tables[(b * (separate ? 2 : 1) + (separate ? kv : 0)) * max_pages + j];
            for (int h = 0; h < g.num_kv_heads; ++h) {
              for (int e = 0; e < g.page_size; ++e) {
                const std::vector<uint8_t> r = hc.Row(kv == 1, src, e, h);
                const uint8_t* dst = &out[o * page_bytes + ((kv * g.num_kv_heads + h) * g.page_size + e) * g.head_dim_k];
                for (int d = 0; d < g.head_dim_k; ++d) {
                  uint8_t want = 0;
                  if (j * g.page_size + e < lens[b]) {
                    const uint8_t code = (r[d / 2] >> (4 * (d % 2))) & 0xf;
                    const float s = E4m3Decode(r[g.head_dim_k / 2 + d / 16]);
                    // The documented arithmetic order: (e2m1 * s) * (g / fp8_scale).
                    want = E4m3Encode((E2m1Decode(code) * s) * mult[kv]);
                  }
                  ASSERT_EQ(dst[d], want) << "b " << b << " j " << j << " kv " << kv << " e " << e << " d " << d;
                }
              }
            }
          }
        }
      }
    }
  }
}

// Linear quantize produces the bytes of the paged quantizer for the same rows
// and dequantizes within the format's error; rows are independent of strides.
TEST(ReferenceOps, LinearRoundTripMatchesPagedBytes) {
  const int64_t m = 37, k = 128;
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> in = RandomHalfBits(dtype, m * k, 21);
    std::vector<uint8_t> packed(m * k / 2, kPoison), scales(m * k / 16, kPoison);
    const float gs = 0.02f;
    ASSERT_TRUE(QuantizeLinear(TensorView::Contiguous(in.data(), dtype, {m, k}),
                               TensorView::Contiguous(packed.data(), DType::kU8, {m, k / 2}),
                               TensorView::Contiguous(scales.data(), DType::kE4M3, {m, k / 16}),
                               GlobalScale::Value(gs))
                    .ok());
    for (int64_t r = 0; r < m; ++r) {
      std::vector<uint8_t> want = ExpectedRow(&in[r * k], dtype, static_cast<int>(k), gs, Recipe());
      std::vector<uint8_t> got;
      for (int64_t j = 0; j < k / 2; ++j) got.push_back(packed[r * k / 2 + j]);
      for (int64_t j = 0; j < k / 16; ++j) got.push_back(scales[r * k / 16 + j]);
      ASSERT_EQ(got, want) << "row " << r;
    }
    std::vector<uint16_t> out(m * k, 0xA5A5);
    ASSERT_TRUE(DequantizeLinear(TensorView::Contiguous(packed.data(), DType::kU8, {m, k / 2}),
                                 TensorView::Contiguous(scales.data(), DType::kE4M3, {m, k / 16}),
                                 TensorView::Contiguous(out.data(), dtype, {m, k}), GlobalScale::Value(gs))
                    .ok());
    for (int64_t i = 0; i < m * k; ++i) {
      uint32_t pk[2] = {0, 0};
      const int64_t r = i / k, blk = (i % k) / 16;
      for (int j = 0; j < 8; ++j) pk[j / 4] |= static_cast<uint32_t>(packed[r * k / 2 + blk * 8 + j]) << (8 * (j % 4));
      float y[16];
      DequantizeBlock(pk, scales[r * k / 16 + blk], gs, y);
      const uint16_t want = dtype == DType::kF16 ? FloatToHalfBits(y[i % 16]) : FloatToBf16Bits(y[i % 16]);
      ASSERT_EQ(out[i], want) << "element " << i;
    }
  }
}

// A strided (row-padded) input gives the same bytes as a contiguous one.
TEST(ReferenceOps, StridedInputRows) {
  const int64_t m = 9, k = 64, pitch = 96;
  std::vector<uint16_t> dense = RandomHalfBits(DType::kBF16, m * k, 4);
  std::vector<uint16_t> padded(m * pitch, 0x7fff);
  for (int64_t r = 0; r < m; ++r) std::copy_n(&dense[r * k], k, &padded[r * pitch]);
  std::vector<uint8_t> p1(m * k / 2), s1(m * k / 16), p2(m * k / 2), s2(m * k / 16);
  ASSERT_TRUE(QuantizeLinear(TensorView::Contiguous(dense.data(), DType::kBF16, {m, k}),
                             TensorView::Contiguous(p1.data(), DType::kU8, {m, k / 2}),
                             TensorView::Contiguous(s1.data(), DType::kE4M3, {m, k / 16}), GlobalScale::Value(0.1f))
                  .ok());
  ASSERT_TRUE(QuantizeLinear(TensorView::Strided(padded.data(), DType::kBF16, {m, k}, {pitch, 1}),
                             TensorView::Contiguous(p2.data(), DType::kU8, {m, k / 2}),
                             TensorView::Contiguous(s2.data(), DType::kE4M3, {m, k / 16}), GlobalScale::Value(0.1f))
                  .ok());
  EXPECT_EQ(p1, p2);
  EXPECT_EQ(s1, s2);
}

// 4over6 recipes flow through the paged append to the bytes QuantizeBlock
// gives under that recipe.
TEST(ReferenceOps, RecipeReachesPagedAppend) {
  const CacheGeometry g = Geo(1, 64, 64, 4, 8, Layout::kNHD);
  Scenario s = MakeScenario(g, 2, 3, 4, 31);
  Rows rows = MakeRows(g, DType::kBF16, s.nnz, 17);
  const Recipe r = Recipe::FourOverSix(256, ErrorMetric::kMse, false);
  HostCache hc(g, false, kPoison);
  ASSERT_TRUE(AppendPaged(s, rows, hc, r).ok());
  int differs = 0;
  for (int64_t i = 0; i < s.nnz; ++i) {
    const int b = s.batch_indices[i], pos = s.positions[i];
    const int64_t page = s.kv_indices[s.kv_indptr[b] + pos / g.page_size];
    const std::vector<uint8_t> want = ExpectedRow(&rows.k[i * 64], DType::kBF16, 64, kGk, r);
    EXPECT_EQ(hc.Row(false, page, pos % g.page_size, 0), want);
    differs += want != ExpectedRow(&rows.k[i * 64], DType::kBF16, 64, kGk, Recipe());
  }
  EXPECT_GT(differs, 0) << "4over6 never chose differently from the standard recipe";
}

// K8V4 end to end on the CPU: slot append, dequantize, materialize (copy and
// re-scale) and whole-cache quantize agree with the FP8 key rules of
// format.h; values are stored exactly as in an NVFP4-key cache.
TEST(ReferenceOps, Fp8KeysThroughEveryOp) {
  for (Layout layout : {Layout::kNHD, Layout::kHND}) {
    constexpr int H = 2, D = 64, S = 16, P = 8;
    CacheGeometry g = Geo(H, D, D, S, P, layout);
    CacheGeometry g4 = g;
    g.key_format = KeyFormat::kFp8;
    const int64_t n = int64_t{P} * S;
    Rows rows = MakeRows(g, DType::kBF16, n, 91);
    float amax = 0.0f;
    for (uint16_t b : rows.k) amax = std::max(amax, std::fabs(Bf16BitsToFloat(b)));
    const float gk = MakeFp8KeyScale(amax);
    // Slots: page p gets the rows [p * S, p * S + S) of page perm[p].
    std::vector<int64_t> slots(n);
    const int32_t perm[P] = {5, 2, 7, 0, 3, 6, 1, 4};
    for (int64_t i = 0; i < n; ++i) slots[i] = perm[i / S] * S + i % S;
    const TensorView sm = TensorView::Contiguous(slots.data(), DType::kI64, {n});
    HostCache hc(g, false, kPoison), hc4(g4, false, kPoison);
    ASSERT_TRUE(QuantizeAppendBySlot(rows.key(g, n), rows.value(g, n), sm, hc.cache(),
                                     GlobalScale::Value(gk), GlobalScale::Value(kGv), Recipe())
                    .ok());
    ASSERT_TRUE(QuantizeAppendBySlot(rows.key(g, n), rows.value(g, n), sm, hc4.cache(),
                                     GlobalScale::Value(kGk), GlobalScale::Value(kGv), Recipe())
                    .ok());
    for (int64_t i = 0; i < n; ++i) {
      for (int h = 0; h < H; ++h) {
        ASSERT_EQ(hc.Row(false, perm[i / S], i % S, h),
                  ExpectedFp8KeyRow(&rows.k[(i * H + h) * D], DType::kBF16, D, gk));
        ASSERT_EQ(hc.Row(true, perm[i / S], i % S, h), hc4.Row(true, perm[i / S], i % S, h));
      }
    }
    // Dequantize one request over all pages: K is DequantFp8Key of the bytes,
    // within E4M3's half step of the input; V as in the NVFP4-key cache.
    std::vector<int32_t> table(perm, perm + P), len = {static_cast<int32_t>(n - 5)};
    std::vector<uint16_t> k_out(n * H * D, 0xA5A5), v_out(n * H * D, 0xA5A5), v4_out = v_out,
                                                                              k4_out = k_out;
    const TensorView bt = TensorView::Contiguous(table.data(), DType::kI32, {1, P});
    ASSERT_TRUE(DequantizePaged(hc.cache(), bt, I32(len),
                                TensorView::Contiguous(k_out.data(), DType::kBF16, {1, n, H, D}),
                                TensorView::Contiguous(v_out.data(), DType::kBF16, {1, n, H, D}),
                                GlobalScale::Value(gk), GlobalScale::Value(kGv))
                    .ok());
    ASSERT_TRUE(DequantizePaged(hc4.cache(), bt, I32(len),
                                TensorView::Contiguous(k4_out.data(), DType::kBF16, {1, n, H, D}),
                                TensorView::Contiguous(v4_out.data(), DType::kBF16, {1, n, H, D}),
                                GlobalScale::Value(kGk), GlobalScale::Value(kGv))
                    .ok());
    EXPECT_EQ(v_out, v4_out);
    const float r = Fp8KeyEncodeMultiplier(gk);
    for (int64_t t = 0; t < n; ++t) {
      for (int h = 0; h < H; ++h) {
        const std::vector<uint8_t> bytes = hc.Row(false, perm[t / S], t % S, h);
        for (int d = 0; d < D; ++d) {
          const uint16_t got = k_out[(t * H + h) * D + d];
          if (t >= len[0]) {
            ASSERT_EQ(got, 0xA5A5) << "past the length";
            continue;
          }
          ASSERT_EQ(got, FloatToBf16Bits(DequantFp8Key(bytes[d], gk)));
          const float x = Bf16BitsToFloat(rows.k[(t * H + h) * D + d]);
          const float y = Bf16BitsToFloat(got);
          // Normal E4M3 codes: 3 mantissa bits (relative step 1/8); below
          // 2^-6 the step is 2^-9 in units of g_k; plus bf16 rounding.
          ASSERT_LE(std::fabs(y - x), std::fabs(x) / 15 + gk * 0.002f) << x << " -> " << y;
          ASSERT_EQ(bytes[d], QuantizeFp8Key(x, r));
        }
      }
    }
    // Materialize: k_fp8_scale g_k copies the key bytes, 2 g_k re-scales them.
    std::vector<int32_t> indptr = {0, P}, len_all = {static_cast<int32_t>(n)};
    for (float factor : {1.0f, 2.0f}) {
      std::vector<uint8_t> out((P + 1) * 2 * H * S * D, kPoison);
      std::vector<int32_t> fp8_table(P, -1);
      const float kf = gk * factor;
      ASSERT_TRUE(
          MaterializeFp8(hc.cache(), bt, I32(len_all), I32(indptr),
                         TensorView::Contiguous(out.data(), DType::kE4M3, {P + 1, 2, H, S, D}),
                         TensorView::Contiguous(fp8_table.data(), DType::kI32, {1, P}),
                         GlobalScale::Value(gk), GlobalScale::Value(kGv), GlobalScale::Value(kf),
                         GlobalScale::Value(MinFp8ScaleFor(kGv)))
              .ok());
      const float m = Fp8MaterializeMultiplier(gk, kf);
      for (int j = 0; j < P; ++j) {
        ASSERT_EQ(fp8_table[j], j + 1);
        for (int h = 0; h < H; ++h) {
          for (int e = 0; e < S; ++e) {
            const std::vector<uint8_t> bytes = hc.Row(false, perm[j], e, h);
            const uint8_t* o = &out[((static_cast<size_t>(j) + 1) * 2 * H + h) * S * D + e * D];
            for (int d = 0; d < D; ++d) {
              ASSERT_EQ(o[d], factor == 1.0f ? bytes[d] : MaterializeFp8KeyValue(bytes[d], m));
            }
          }
        }
      }
    }
    // Whole-cache quantize of the same tokens (bf16 pages in slot order):
    // the bytes of the append; computed scales give g_k = MakeFp8KeyScale(amax).
    std::vector<uint16_t> src_k(n * H * D), src_v(n * H * D);
    const bool nhd = layout == Layout::kNHD;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = slots[i] / S, e = slots[i] % S;
      for (int h = 0; h < H; ++h) {
        const int64_t dst = nhd ? ((p * S + e) * H + h) * D : ((p * H + h) * S + e) * D;
        std::copy_n(&rows.k[(i * H + h) * D], D, &src_k[dst]);
        std::copy_n(&rows.v[(i * H + h) * D], D, &src_v[dst]);
      }
    }
    const std::vector<int64_t> shape =
        nhd ? std::vector<int64_t>{P, S, H, D} : std::vector<int64_t>{P, H, S, D};
    const HalfPagedCache src{TensorView::Contiguous(src_k.data(), DType::kBF16, shape),
                             TensorView::Contiguous(src_v.data(), DType::kBF16, shape), layout};
    HostCache hq(g, false, kPoison);
    ASSERT_TRUE(QuantizePagedCache(src, hq.cache(), GlobalScale::Value(gk), GlobalScale::Value(kGv),
                                   nullptr, nullptr, Recipe())
                    .ok());
    EXPECT_EQ(hq.Snapshot(), hc.Snapshot());
    HostCache hs(g, false, kPoison);
    float k_out_scale = 0.0f, v_out_scale = 0.0f;
    ASSERT_TRUE(QuantizePagedCache(src, hs.cache(), GlobalScale::Value(1.0f),
                                   GlobalScale::Value(1.0f), &k_out_scale, &v_out_scale, Recipe())
                    .ok());
    EXPECT_EQ(k_out_scale, gk);
    EXPECT_EQ(hs.Snapshot().size(), hc.Snapshot().size());
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(hs.Row(false, perm[i / S], i % S, 0), hc.Row(false, perm[i / S], i % S, 0));
    }
  }
}

}  // namespace
}  // namespace fp4kv
