// Every validation rule: the status code, a message naming the argument, and
// that nothing was written.
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "fp4kv/ops.h"
#include "fp4kv/recipe.h"
#include "gtest/gtest.h"
#include "testing/host_cache.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::HostCache;
using testing::kPoison;

CacheGeometry Geo(int dk = 64, int dv = 64, int page_size = 4) {
  CacheGeometry g;
  g.num_kv_heads = 2;
  g.head_dim_k = dk;
  g.head_dim_v = dv;
  g.page_size = page_size;
  g.num_pages = 8;
  g.layout = Layout::kNHD;
  return g;
}

// Valid inputs of every op on one small cache; each test breaks one thing.
struct Fixture {
  CacheGeometry g = Geo();
  HostCache hc{g, false, kPoison};
  PagedCache cache = hc.cache();
  // Append
  std::vector<uint16_t> k = testing::RandomHalfBits(DType::kBF16, 3 * 2 * 64, 1);
  std::vector<uint16_t> v = testing::RandomHalfBits(DType::kBF16, 3 * 2 * 64, 2);
  std::vector<int32_t> batch_indices = {0, 0, 1}, positions = {0, 1, 0};
  std::vector<int32_t> kv_indices = {3, 5}, kv_indptr = {0, 1, 2}, last = {2, 1};
  std::vector<int64_t> slots = {1, 2, -1};
  TensorView key = TensorView::Contiguous(k.data(), DType::kBF16, {3, 2, 64});
  TensorView value = TensorView::Contiguous(v.data(), DType::kBF16, {3, 2, 64});
  TensorView bi = TensorView::Contiguous(batch_indices.data(), DType::kI32, {3});
  TensorView pos = TensorView::Contiguous(positions.data(), DType::kI32, {3});
  TensorView kvi = TensorView::Contiguous(kv_indices.data(), DType::kI32, {2});
  TensorView indptr = TensorView::Contiguous(kv_indptr.data(), DType::kI32, {3});
  TensorView last_len = TensorView::Contiguous(last.data(), DType::kI32, {2});
  TensorView slot_mapping = TensorView::Contiguous(slots.data(), DType::kI64, {3});
  GlobalScale k_scale = GlobalScale::Value(0.5f), v_scale = GlobalScale::Value(0.25f);
  Recipe recipe;
  // Dequantize
  std::vector<int32_t> tables = {3, 0, 5, 0};
  std::vector<int32_t> lens = {2, 1};
  std::vector<uint16_t> k_out_buf = std::vector<uint16_t>(2 * 8 * 2 * 64, 0xA5A5);
  std::vector<uint16_t> v_out_buf = std::vector<uint16_t>(2 * 8 * 2 * 64, 0xA5A5);
  TensorView block_tables = TensorView::Contiguous(tables.data(), DType::kI32, {2, 2});
  TensorView seq_lens = TensorView::Contiguous(lens.data(), DType::kI32, {2});
  TensorView k_out = TensorView::Contiguous(k_out_buf.data(), DType::kBF16, {2, 8, 2, 64});
  TensorView v_out = TensorView::Contiguous(v_out_buf.data(), DType::kBF16, {2, 8, 2, 64});
  // Materialize
  std::vector<int32_t> page_indptr = {0, 2, 4};
  std::vector<uint8_t> fp8_buf = std::vector<uint8_t>(5 * 2 * 2 * 4 * 64, kPoison);
  std::vector<int32_t> fp8_tables_buf = {-1, -1, -1, -1};
  TensorView kv_page_indptr = TensorView::Contiguous(page_indptr.data(), DType::kI32, {3});
  TensorView fp8_out = TensorView::Contiguous(fp8_buf.data(), DType::kE4M3, {5, 2, 2, 4, 64});
  TensorView fp8_tables = TensorView::Contiguous(fp8_tables_buf.data(), DType::kI32, {2, 2});
  // Linear
  std::vector<uint8_t> packed_buf = std::vector<uint8_t>(6 * 32, kPoison);
  std::vector<uint8_t> scale_buf = std::vector<uint8_t>(6 * 4, kPoison);
  TensorView lin_in = TensorView::Contiguous(k.data(), DType::kBF16, {6, 64});
  TensorView packed = TensorView::Contiguous(packed_buf.data(), DType::kU8, {6, 32});
  TensorView scales = TensorView::Contiguous(scale_buf.data(), DType::kE4M3, {6, 4});
  std::vector<uint16_t> lin_out_buf = std::vector<uint16_t>(6 * 64, 0xA5A5);
  TensorView lin_out = TensorView::Contiguous(lin_out_buf.data(), DType::kBF16, {6, 64});

  absl::Status AppendPaged() {
    return QuantizeAppendPaged(key, value, bi, pos, cache, kvi, indptr, last_len, k_scale, v_scale,
                               recipe);
  }
  absl::Status AppendSlot() {
    return QuantizeAppendBySlot(key, value, slot_mapping, cache, k_scale, v_scale, recipe);
  }
  absl::Status Dequant() {
    return DequantizePaged(cache, block_tables, seq_lens, k_out, v_out, k_scale, v_scale);
  }
  absl::Status Materialize() {
    return MaterializeFp8(cache, block_tables, seq_lens, kv_page_indptr, fp8_out, fp8_tables, k_scale,
                          v_scale, GlobalScale::Value(3.0f), GlobalScale::Value(1.5f));
  }
  absl::Status Quantize() { return QuantizeLinear(lin_in, packed, scales, k_scale, recipe); }
  absl::Status Dequantize() { return DequantizeLinear(packed, scales, lin_out, k_scale); }

  // Everything any op may write.
  std::vector<uint8_t> State() const {
    std::vector<uint8_t> s = hc.Snapshot();
    auto add = [&s](const void* p, size_t n) {
      const uint8_t* b = static_cast<const uint8_t*>(p);
      s.insert(s.end(), b, b + n);
    };
    add(k_out_buf.data(), k_out_buf.size() * 2);
    add(v_out_buf.data(), v_out_buf.size() * 2);
    add(fp8_buf.data(), fp8_buf.size());
    add(fp8_tables_buf.data(), fp8_tables_buf.size() * 4);
    add(packed_buf.data(), packed_buf.size());
    add(scale_buf.data(), scale_buf.size());
    add(lin_out_buf.data(), lin_out_buf.size() * 2);
    return s;
  }
};

struct Case {
  const char* name;
  std::function<void(Fixture&)> mutate;
  std::function<absl::Status(Fixture&)> op;
  const char* argument;  // the message must name it
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;
};

absl::Status Paged(Fixture& f) { return f.AppendPaged(); }
absl::Status Slot(Fixture& f) { return f.AppendSlot(); }
absl::Status Deq(Fixture& f) { return f.Dequant(); }
absl::Status Mat(Fixture& f) { return f.Materialize(); }
absl::Status LinQ(Fixture& f) { return f.Quantize(); }
absl::Status LinD(Fixture& f) { return f.Dequantize(); }

TensorView Misalign(TensorView t, int bytes) {
  t.data = static_cast<char*>(t.data) + bytes;
  return t;
}

std::vector<Case> Cases() {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  return {
      // dtype
      {"key_f32", [](Fixture& f) { f.key.dtype = DType::kF32; }, Paged, "append_key"},
      {"value_dtype_differs", [](Fixture& f) { f.value.dtype = DType::kF16; }, Paged, "append_value"},
      {"data_not_u8", [](Fixture& f) { f.cache.k_data.dtype = DType::kI32; }, Slot, "cache.k_data"},
      {"scales_f16", [](Fixture& f) { f.cache.v_scales.dtype = DType::kF16; }, Deq, "cache.v_scales"},
      {"out_dtype_differs", [](Fixture& f) { f.v_out.dtype = DType::kF16; }, Deq, "v_out"},
      {"linear_out_f32", [](Fixture& f) { f.lin_out.dtype = DType::kF32; }, LinD, "output"},
      {"batch_indices_i64", [](Fixture& f) { f.bi.dtype = DType::kI64; }, Paged, "batch_indices"},
      {"slot_mapping_i32", [](Fixture& f) { f.slot_mapping.dtype = DType::kI32; }, Slot, "slot_mapping"},
      {"fp8_out_f16", [](Fixture& f) { f.fp8_out.dtype = DType::kF16; }, Mat, "out"},
      // rank
      {"key_rank2", [](Fixture& f) { f.key.ndim = 2; }, Paged, "append_key"},
      {"cache_rank3", [](Fixture& f) { f.cache.k_scales.ndim = 3; }, Paged, "cache.k_scales"},
      {"k_out_rank3", [](Fixture& f) { f.k_out.ndim = 3; }, Deq, "k_out"},
      {"tables_rank1", [](Fixture& f) { f.block_tables.ndim = 1; }, Deq, "block_tables"},
      // shape mismatches
      {"value_rows", [](Fixture& f) { f.value.shape[0] = 2; }, Paged, "append_value"},
      {"value_heads", [](Fixture& f) { f.value.shape[1] = 1; }, Slot, "append_value"},
      {"key_dim", [](Fixture& f) { f.key.shape[2] = 32; }, Paged, "append_key"},
      {"k_scales_dim", [](Fixture& f) { f.cache.k_scales.shape[3] = 3; }, Paged, "cache.k_scales"},
      {"v_data_pages", [](Fixture& f) { f.cache.v_data.shape[0] = 7; }, Deq, "cache.v_data"},
      {"v_out_len", [](Fixture& f) { f.v_out.shape[1] = 7; }, Deq, "v_out"},
      {"k_out_heads", [](Fixture& f) { f.k_out.shape[2] = 3; }, Deq, "k_out"},
      {"fp8_out_page_size", [](Fixture& f) { f.fp8_out.shape[3] = 8; }, Mat, "out"},
      {"fp8_tables_shape", [](Fixture& f) { f.fp8_tables.shape[1] = 3; }, Mat, "fp8_block_tables"},
      {"linear_packed_cols", [](Fixture& f) { f.packed.shape[1] = 30; }, LinQ, "packed"},
      {"linear_scales_rows", [](Fixture& f) { f.scales.shape[0] = 5; }, LinQ, "scales"},
      {"linear_cols_not_16", [](Fixture& f) { f.lin_in.shape[1] = 40; f.lin_in.strides[0] = 40; }, LinQ, "input"},
      {"slot_mapping_longer", [](Fixture& f) { f.slot_mapping.shape[0] = 4; }, Slot, "slot_mapping"},
      // head_dim rule
      {"head_dim_24", [](Fixture& f) {
         f.cache.k_data.shape[3] = 12;
         f.cache.k_scales.shape[3] = 1;
       }, Paged, "head_dim_k"},
      {"materialize_head_dim_48", [](Fixture& f) {
         f.cache.k_data.shape[3] = 24;
         f.cache.v_data.shape[3] = 24;
         f.cache.k_scales.shape[3] = 3;
         f.cache.v_scales.shape[3] = 3;
       }, Mat, "head_dim_k"},
      // non-contiguous inner dimension
      {"key_inner_stride", [](Fixture& f) { f.key.strides[2] = 2; }, Paged, "append_key"},
      {"k_data_inner_stride", [](Fixture& f) { f.cache.k_data.strides[3] = 2; }, Slot, "cache.k_data"},
      {"k_out_inner_stride", [](Fixture& f) { f.k_out.strides[3] = 2; }, Deq, "k_out"},
      {"positions_stride", [](Fixture& f) { f.pos.strides[0] = 2; }, Paged, "positions"},
      // alignment
      {"key_misaligned", [](Fixture& f) { f.key = Misalign(f.key, 2); }, Paged, "append_key"},
      {"key_row_stride_unaligned", [](Fixture& f) { f.key.strides[0] = 2 * 64 + 4; f.key.shape[0] = 2; f.value.shape[0] = 2; f.slot_mapping.shape[0] = 2; }, Slot, "append_key"},
      {"k_data_misaligned", [](Fixture& f) { f.cache.k_data = Misalign(f.cache.k_data, 4); }, Paged, "cache.k_data"},
      {"v_out_misaligned", [](Fixture& f) { f.v_out = Misalign(f.v_out, 8); }, Deq, "v_out"},
      {"fp8_out_misaligned", [](Fixture& f) { f.fp8_out = Misalign(f.fp8_out, 4); }, Mat, "out"},
      {"linear_packed_misaligned", [](Fixture& f) { f.packed = Misalign(f.packed, 4); }, LinQ, "packed"},
      // devices
      {"key_on_cuda", [](Fixture& f) { f.key.device = Device::Cuda(0); }, Paged, "append_key"},
      {"tables_on_cuda", [](Fixture& f) { f.block_tables.device = Device::Cuda(0); }, Deq, "block_tables"},
      {"scales_on_other_gpu", [](Fixture& f) { f.cache.v_scales.device = Device::Cuda(1); }, Slot, "cache.v_scales"},
      // global scales
      {"k_scale_zero", [](Fixture& f) { f.k_scale = GlobalScale::Value(0.0f); }, Paged, "k_scale"},
      {"v_scale_negative", [](Fixture& f) { f.v_scale = GlobalScale::Value(-1.0f); }, Slot, "v_scale"},
      {"k_scale_inf", [inf](Fixture& f) { f.k_scale = GlobalScale::Value(inf); }, Deq, "k_scale"},
      {"v_scale_nan", [nan](Fixture& f) { f.v_scale = GlobalScale::Value(nan); }, Mat, "v_scale"},
      {"linear_scale_nan", [nan](Fixture& f) { f.k_scale = GlobalScale::Value(nan); }, LinQ, "global_scale"},
      // index dtypes
      {"tables_f32", [](Fixture& f) { f.block_tables.dtype = DType::kF32; }, Deq, "block_tables"},
      {"materialize_tables_u8", [](Fixture& f) { f.block_tables.dtype = DType::kU8; }, Mat, "block_tables"},
      {"seq_lens_i64", [](Fixture& f) { f.seq_lens.dtype = DType::kI64; }, Deq, "seq_lens"},
      {"materialize_seq_lens_i64", [](Fixture& f) { f.seq_lens.dtype = DType::kI64; }, Mat, "seq_lens"},
      // batch sizes
      {"seq_lens_batch", [](Fixture& f) { f.seq_lens.shape[0] = 3; }, Deq, "seq_lens"},
      {"last_page_len_batch", [](Fixture& f) { f.last_len.shape[0] = 1; }, Paged, "kv_last_page_len"},
      {"batch_indices_len", [](Fixture& f) { f.bi.shape[0] = 2; }, Paged, "batch_indices"},
      {"kv_page_indptr_batch", [](Fixture& f) { f.kv_page_indptr.shape[0] = 2; }, Mat, "kv_page_indptr"},
      {"k_out_batch", [](Fixture& f) { f.k_out.shape[0] = 3; }, Deq, "k_out"},
      // materializer page size
      {"materialize_page_size_3", [](Fixture& f) {
         for (TensorView* t : {&f.cache.k_data, &f.cache.v_data, &f.cache.k_scales, &f.cache.v_scales}) t->shape[1] = 3;
       }, Mat, "page_size"},
      // null pointers
      {"null_kv_indices", [](Fixture& f) { f.kvi.data = nullptr; }, Paged, "kv_indices"},
      // recipe
      {"recipe_e4m3_max", [](Fixture& f) { f.recipe = Recipe::FourOverSix(300); }, Paged, "recipe.e4m3_max"},
      {"recipe_standard_fast_math", [](Fixture& f) { f.recipe.fast_math = true; }, LinQ, "recipe.fast_math"},
  };
}

class ValidationTest : public ::testing::TestWithParam<Case> {};

TEST_P(ValidationTest, RejectsWithNamedArgumentAndChangesNothing) {
  const Case& c = GetParam();
  Fixture f;
  // The unmodified call must be valid, so the failure below is the mutation's.
  {
    Fixture ok;
    ASSERT_TRUE(c.op(ok).ok()) << c.op(ok);
  }
  c.mutate(f);
  const std::vector<uint8_t> before = f.State();
  const absl::Status s = c.op(f);
  EXPECT_EQ(s.code(), c.code) << s;
  EXPECT_NE(s.message().find(c.argument), std::string::npos)
      << "message does not name '" << c.argument << "': " << s.message();
  EXPECT_NE(s.message().find("expected"), std::string::npos) << s.message();
  EXPECT_EQ(f.State(), before) << "a rejected call wrote memory";
}

INSTANTIATE_TEST_SUITE_P(Rules, ValidationTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

TEST(Validation, CudaTensorsWithoutGpuFailCleanly) {
  std::string why;
  if (testing::HasCudaDevice(&why)) GTEST_SKIP() << "a GPU is present; this checks the no-GPU path";
  Fixture f;
  for (TensorView* t : {&f.cache.k_data, &f.cache.v_data, &f.cache.k_scales, &f.cache.v_scales, &f.key,
                        &f.value, &f.slot_mapping}) {
    t->device = Device::Cuda(0);
  }
  const std::vector<uint8_t> before = f.State();
  const absl::Status s = f.AppendSlot();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("cuda:0"), std::string::npos) << s.message();
  EXPECT_EQ(f.State(), before);
}

TEST(Validation, GeometryRules) {
  CacheGeometry g = Geo();
  EXPECT_TRUE(g.Validate().ok());
  g.head_dim_v = 40;
  EXPECT_NE(g.Validate().message().find("head_dim_v"), std::string::npos);
  g = Geo();
  g.page_size = 0;
  EXPECT_NE(g.Validate().message().find("page_size"), std::string::npos);
  g = Geo();
  g.num_kv_heads = -1;
  EXPECT_NE(g.Validate().message().find("num_kv_heads"), std::string::npos);
  g = Geo();
  g.num_pages = 0;
  EXPECT_EQ(g.Validate().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Validation, StackedFormRules) {
  std::vector<uint8_t> d(8 * 3 * 4 * 2 * 32), s(8 * 3 * 4 * 2 * 4);
  auto r = PagedCache::FromStacked(TensorView::Contiguous(d.data(), DType::kU8, {8, 3, 4, 2, 32}),
                                   TensorView::Contiguous(s.data(), DType::kU8, {8, 3, 4, 2, 4}),
                                   Layout::kNHD);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cache.data"), std::string::npos) << r.status();
  auto r2 = PagedCache::FromStacked(TensorView::Contiguous(d.data(), DType::kU8, {8, 2, 4, 2}),
                                    TensorView::Contiguous(s.data(), DType::kU8, {8, 2, 4, 2, 4}),
                                    Layout::kNHD);
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status().message().find("rank 5"), std::string::npos) << r2.status();
}

// FP8-key caches (K8V4): key scales must be absent, key rows Dk bytes of
// E4M3 / u8, the cache's key format must match the op's; a rejected call
// writes nothing. The valid call writes.
TEST(Validation, Fp8KeyCacheRules) {
  struct Fp8Case {
    const char* name;
    std::function<void(Fixture&)> mutate;
    std::function<absl::Status(Fixture&)> op;
    const char* argument;
  };
  const std::vector<Fp8Case> cases = {
      {"k_scales_given", [](Fixture& f) { f.cache.k_scales = f.hc.cache().k_scales; }, Slot,
       "cache.k_scales"},
      {"k_scales_given_dequant", [](Fixture& f) { f.cache.k_scales = f.hc.cache().k_scales; }, Deq,
       "cache.k_scales"},
      // The functional API reads the geometry off the cache; an op object
      // holds it, so a key row of Dk / 2 bytes is the cache's fault.
      {"k_data_nvfp4_inner_dim", [](Fixture& f) { f.cache.k_data.shape[3] = 32; },
       [](Fixture& f) {
         CacheGeometry g8 = Geo();
         g8.key_format = KeyFormat::kFp8;
         absl::StatusOr<Appender> op =
             Appender::Create({g8, DType::kBF16, AppendIndexing::kSlot, Recipe(), Device::Cpu()});
         if (!op.ok()) return op.status();
         AppendArgs a;
         a.key = f.key;
         a.value = f.value;
         a.slot_mapping = f.slot_mapping;
         a.k_scale = f.k_scale;
         a.v_scale = f.v_scale;
         return op->Run(a, f.cache, nullptr);
       },
       "cache.k_data"},
      {"k_data_inner_dim_mat", [](Fixture& f) { f.cache.k_data.shape[3] = 32; },
       [](Fixture& f) {
         CacheGeometry g8 = Geo();
         g8.key_format = KeyFormat::kFp8;
         absl::StatusOr<Materializer> op =
             Materializer::Create({g8, DType::kI32, false, Device::Cpu()});
         if (!op.ok()) return op.status();
         return op->Run({f.block_tables, f.seq_lens, f.kv_page_indptr, f.fp8_out, f.fp8_tables,
                         f.k_scale, f.v_scale, GlobalScale::Value(3.0f), GlobalScale::Value(1.5f)},
                        f.cache, nullptr);
       },
       "cache.k_data"},
      {"k_data_bf16", [](Fixture& f) { f.cache.k_data.dtype = DType::kBF16; }, Slot,
       "cache.k_data"},
      {"k_data_misaligned", [](Fixture& f) { f.cache.k_data = Misalign(f.cache.k_data, 8); }, Slot,
       "cache.k_data"},
      {"labelled_nvfp4", [](Fixture& f) { f.cache.key_format = KeyFormat::kNvfp4; }, Slot,
       "cache.k_scales"},
      {"nvfp4_op_fp8_cache", [](Fixture&) {},
       [](Fixture& f) {
         absl::StatusOr<Appender> op = Appender::Create(
             {Geo(), DType::kBF16, AppendIndexing::kSlot, Recipe(), Device::Cpu()});
         if (!op.ok()) return op.status();
         AppendArgs a;
         a.key = f.key;
         a.value = f.value;
         a.slot_mapping = f.slot_mapping;
         a.k_scale = f.k_scale;
         a.v_scale = f.v_scale;
         return op->Run(a, f.cache, nullptr);
       },
       "cache.key_format"},
  };
  CacheGeometry g = Geo();
  g.key_format = KeyFormat::kFp8;
  for (const Fp8Case& c : cases) {
    SCOPED_TRACE(c.name);
    Fixture f;
    HostCache hc(g, false, kPoison);
    f.cache = hc.cache();
    const std::vector<uint8_t> before = hc.Snapshot(), outputs = f.State();
    c.mutate(f);
    const absl::Status s = c.op(f);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(c.argument), std::string::npos) << s;
    EXPECT_EQ(hc.Snapshot(), before);
    EXPECT_EQ(f.State(), outputs);
  }
  Fixture f;
  HostCache hc(g, false, kPoison);
  f.cache = hc.cache();
  const std::vector<uint8_t> before = hc.Snapshot();
  ASSERT_TRUE(f.AppendSlot().ok());
  EXPECT_NE(hc.Snapshot(), before);
  EXPECT_TRUE(f.Dequant().ok());
  EXPECT_TRUE(f.Materialize().ok());
  // A stacked view cannot hold FP8 keys; the tuple view's geometry says kFp8.
  absl::StatusOr<CacheGeometry> got = hc.cache().Geometry();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->key_format, KeyFormat::kFp8);
  EXPECT_EQ(got->head_dim_k, 64);
}

// scale_events must be given exactly when counting is on, 8-byte aligned;
// a rejected append writes neither the pool nor the counters.
TEST(Validation, ScaleEventCounters) {
  Fixture f;
  Appender::Options o{f.g, DType::kBF16, AppendIndexing::kSlot, Recipe(), Device::Cpu(), true};
  absl::StatusOr<Appender> counting = Appender::Create(o);
  ASSERT_TRUE(counting.ok()) << counting.status();
  o.count_scale_events = false;
  absl::StatusOr<Appender> plain = Appender::Create(o);
  ASSERT_TRUE(plain.ok()) << plain.status();
  AppendArgs a;
  a.key = f.key;
  a.value = f.value;
  a.slot_mapping = f.slot_mapping;
  a.k_scale = f.k_scale;
  a.v_scale = f.v_scale;
  alignas(8) uint64_t counters[5] = {7, 7, 7, 7, 7};
  const std::vector<uint8_t> before = f.hc.Snapshot();
  absl::Status s = counting->Run(a, f.cache);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("scale_events: expected"), std::string::npos) << s;
  a.scale_events = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(counters) + 4);
  s = counting->Run(a, f.cache);
  EXPECT_NE(s.message().find("scale_events: expected an 8-byte aligned"), std::string::npos) << s;
  a.scale_events = counters;
  s = plain->Run(a, f.cache);
  EXPECT_NE(s.message().find("scale_events: expected a null pointer"), std::string::npos) << s;
  EXPECT_EQ(f.hc.Snapshot(), before);
  for (uint64_t c : counters) EXPECT_EQ(c, 7u);
  // Accepted: the events of the two rows with a slot are added.
  uint64_t want[4] = {7, 7, 7, 7};
  for (int row = 0; row < 2; ++row) {
    for (int kv = 0; kv < 2; ++kv) {
      const std::vector<uint16_t>& src = kv ? f.v : f.k;
      const float g = kv ? f.v_scale.value : f.k_scale.value;
      for (int blk = 0; blk < 2 * 64 / kBlockSize; ++blk) {
        float x[kBlockSize];
        for (int i = 0; i < kBlockSize; ++i) {
          x[i] = Bf16BitsToFloat(src[row * 128 + blk * kBlockSize + i]);
        }
        uint32_t packed[2];
        const ScaleEvent e = ClassifyBlockScale(BlockAmax(x), g, QuantizeBlock(x, g, Recipe(), packed));
        want[2 * kv] += e == ScaleEvent::kSaturated;
        want[2 * kv + 1] += e == ScaleEvent::kUnderflow;
      }
    }
  }
  ASSERT_TRUE(counting->Run(a, f.cache).ok());
  EXPECT_NE(f.hc.Snapshot(), before);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(counters[i], want[i]) << i;
  EXPECT_EQ(counters[4], 7u);
}

TEST(Validation, OpObjectOptions) {
  Appender::Options o;
  o.geometry = Geo();
  o.input_dtype = DType::kF32;
  auto a = Appender::Create(o);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("options.input_dtype"), std::string::npos);
  Dequantizer::Options d;
  d.geometry = Geo();
  d.table_dtype = DType::kI32;
  d.output_dtype = DType::kU8;
  EXPECT_NE(Dequantizer::Create(d).status().message().find("options.output_dtype"), std::string::npos);
  Materializer::Options m;
  m.geometry = Geo(64, 128, 4);
  EXPECT_NE(Materializer::Create(m).status().message().find("head_dim_v"), std::string::npos);
  EXPECT_FALSE(MinFp8Scale(0.0f).ok());
  EXPECT_FALSE(MinFp8Scale(std::numeric_limits<float>::infinity()).ok());
}

}  // namespace
}  // namespace fp4kv
