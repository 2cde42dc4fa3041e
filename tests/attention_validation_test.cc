// Every validation rule of DecodeAttention::Create and Run: the status code,
// a message naming the argument and saying what was expected, and input and
// output memory byte-identical afterwards.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "fp4kv/attention.h"
#include "gtest/gtest.h"
#include "src/attention_params.h"
#include "testing/attention_case.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::AttentionCase;
using testing::AttentionSpec;

AttentionSpec FixtureSpec(int q_len, bool fp8_keys) {
  AttentionSpec s;
  s.fp8_keys = fp8_keys;
  s.batch = 3;
  s.num_kv_heads = 2;
  s.group = 2;
  s.min_seq_len = 5;
  s.max_seq_len = 40;
  s.q_len = q_len;
  s.lse = true;
  s.sinks = true;
  return s;
}

// Valid options and arguments over one case; each rule breaks one thing.
struct Fixture {
  explicit Fixture(int q_len, bool fp8_keys = false)
      : c(testing::MakeAttentionCase(FixtureSpec(q_len, fp8_keys), 3)),
        in(c.in),
        out(c.out),
        o(c.Options(Device::Cpu())),
        a(c.Args(in.data(), out.data(), Device::Cpu())),
        cache(c.Cache(in.data(), Device::Cpu())) {}

  AttentionCase c;
  std::vector<uint8_t> in, out;
  DecodeAttention::Options o;
  DecodeAttentionArgs a;
  PagedCache cache;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;

  int64_t B() const { return c.seq_lens.shape[0]; }
  int64_t M() const { return c.block_tables.shape[1]; }
};

enum class Stage { kCreate, kRun };

struct Rule {
  const char* name;
  int q_len;  // of the fixture: 3 (q_indptr given) or 1 (none)
  std::function<void(Fixture&)> mutate;
  Stage stage;
  const char* argument;  // the message must name it
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;
  bool fp8_keys = false;  // the fixture's cache holds FP8 keys
};

TensorView Misalign(TensorView t, int bytes) {
  t.data = static_cast<char*>(t.data) + bytes;
  return t;
}

// The FP8-key rules: a fixture over FP8 keys (and one NVFP4 fixture handed
// a cache that claims FP8 keys).
std::vector<Rule> Fp8KeyRules() {
  const Stage C = Stage::kCreate, R = Stage::kRun;
  const auto bad = absl::StatusCode::kInvalidArgument;
  return {
      {"fp8_geometry_key_format_unknown", 3,
       [](Fixture& f) { f.o.geometry.key_format = static_cast<KeyFormat>(7); }, C,
       "geometry.key_format", bad, true},
      {"fp8_cache_k_scales_given", 3, [](Fixture& f) { f.cache.k_scales = f.cache.v_scales; }, R,
       "cache.k_scales", bad, true},
      {"fp8_cache_k_data_nvfp4_width", 3,
       [](Fixture& f) { f.cache.k_data.shape[3] = f.c.spec.head_dim / 2; }, R, "cache.k_data", bad,
       true},
      {"fp8_cache_k_data_f16", 3, [](Fixture& f) { f.cache.k_data.dtype = DType::kF16; }, R,
       "cache.k_data", bad, true},
      {"fp8_cache_k_data_misaligned", 3,
       [](Fixture& f) { f.cache.k_data = Misalign(f.cache.k_data, 8); }, R, "cache.k_data", bad,
       true},
      {"fp8_cache_k_data_null", 3, [](Fixture& f) { f.cache.k_data.data = nullptr; }, R,
       "cache.k_data", bad, true},
      {"fp8_cache_says_nvfp4", 3, [](Fixture& f) { f.cache.key_format = KeyFormat::kNvfp4; }, R,
       "cache.key_format", bad, true},
      {"fp8_geometry_says_nvfp4", 3,
       [](Fixture& f) { f.o.geometry.key_format = KeyFormat::kNvfp4; }, R, "cache.key_format", bad,
       true},
      {"fp8_k_scale_zero", 3, [](Fixture& f) { f.a.k_scale = GlobalScale::Value(0.0f); }, R,
       "k_scale", bad, true},
      {"nvfp4_cache_says_fp8", 3, [](Fixture& f) { f.cache.key_format = KeyFormat::kFp8; }, R,
       "cache.key_format", bad, false},
  };
}

std::vector<Rule> Rules() {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Stage C = Stage::kCreate, R = Stage::kRun;
  return {
      // ------------------------------------------------------------ Create
      {"geometry_kv_heads_0", 3, [](Fixture& f) { f.o.geometry.num_kv_heads = 0; }, C,
       "geometry.num_kv_heads"},
      {"geometry_pages_0", 3, [](Fixture& f) { f.o.geometry.num_pages = 0; }, C,
       "geometry.num_pages"},
      {"head_dim_k_40", 3, [](Fixture& f) { f.o.geometry.head_dim_k = 40; }, C,
       "geometry.head_dim_k"},
      {"head_dim_k_96", 3, [](Fixture& f) { f.o.geometry.head_dim_k = 96; }, C,
       "geometry.head_dim_k"},
      {"head_dim_k_512", 3, [](Fixture& f) { f.o.geometry.head_dim_k = 512; }, C,
       "geometry.head_dim_k"},
      {"head_dim_v_32", 3, [](Fixture& f) { f.o.geometry.head_dim_v = 32; }, C,
       "geometry.head_dim_v"},
      {"qo_heads_0", 3, [](Fixture& f) { f.o.num_qo_heads = 0; }, C, "options.num_qo_heads"},
      {"qo_heads_negative", 3, [](Fixture& f) { f.o.num_qo_heads = -4; }, C,
       "options.num_qo_heads"},
      {"qo_heads_not_multiple", 3, [](Fixture& f) { f.o.num_qo_heads = 3; }, C,
       "options.num_qo_heads"},
      {"dtype_f32", 3, [](Fixture& f) { f.o.dtype = DType::kF32; }, C, "options.dtype"},
      {"table_dtype_u8", 3, [](Fixture& f) { f.o.table_dtype = DType::kU8; }, C,
       "options.table_dtype"},
      {"max_batch_0", 3, [](Fixture& f) { f.o.max_batch = 0; }, C, "options.max_batch"},
      {"max_pages_0", 3, [](Fixture& f) { f.o.max_pages_per_seq = 0; }, C,
       "options.max_pages_per_seq"},
      {"max_q_len_0", 3, [](Fixture& f) { f.o.max_q_len = 0; }, C, "options.max_q_len"},
      {"max_q_len_too_large", 3, [](Fixture& f) { f.o.max_q_len = kMaxAttentionQLen + 1; }, C,
       "options.max_q_len"},
      {"sm_scale_negative", 3, [](Fixture& f) { f.o.sm_scale = -0.125f; }, C, "options.sm_scale"},
      {"sm_scale_nan", 3, [nan](Fixture& f) { f.o.sm_scale = nan; }, C, "options.sm_scale"},
      {"sm_scale_inf", 3, [inf](Fixture& f) { f.o.sm_scale = inf; }, C, "options.sm_scale"},
      {"soft_cap_negative", 3, [](Fixture& f) { f.o.logits_soft_cap = -1.0f; }, C,
       "options.logits_soft_cap"},
      {"soft_cap_inf", 3, [inf](Fixture& f) { f.o.logits_soft_cap = inf; }, C,
       "options.logits_soft_cap"},
      {"soft_cap_nan", 3, [nan](Fixture& f) { f.o.logits_soft_cap = nan; }, C,
       "options.logits_soft_cap"},
      {"window_minus_2", 3, [](Fixture& f) { f.o.window_left = -2; }, C, "options.window_left"},
      {"device_negative_ordinal", 3, [](Fixture& f) { f.o.device = Device::Cuda(-1); }, C,
       "device"},
      // -------------------------------------------------------------- Run
      // cache
      {"cache_k_data_null", 3, [](Fixture& f) { f.cache.k_data.data = nullptr; }, R,
       "cache.k_data"},
      {"cache_v_data_pages", 3, [](Fixture& f) { f.cache.v_data.shape[0] -= 1; }, R,
       "cache.v_data"},
      {"cache_k_scales_dim", 3, [](Fixture& f) { f.cache.k_scales.shape[3] = 2; }, R,
       "cache.k_scales"},
      {"cache_layout", 3, [](Fixture& f) { f.cache.layout = Layout::kHND; }, R, "cache.layout"},
      {"cache_on_cuda", 3, [](Fixture& f) { f.cache.v_scales.device = Device::Cuda(0); }, R,
       "cache.v_scales"},
      // seq_lens
      {"seq_lens_null", 3, [](Fixture& f) { f.a.seq_lens.data = nullptr; }, R, "seq_lens"},
      {"seq_lens_i64", 3, [](Fixture& f) { f.a.seq_lens.dtype = DType::kI64; }, R, "seq_lens"},
      {"seq_lens_rank2", 3, [](Fixture& f) { f.a.seq_lens.ndim = 2; }, R, "seq_lens"},
      {"seq_lens_strided", 3, [](Fixture& f) { f.a.seq_lens.strides[0] = 2; }, R, "seq_lens"},
      {"seq_lens_empty_batch", 3, [](Fixture& f) { f.a.seq_lens.shape[0] = 0; }, R, "seq_lens"},
      {"batch_over_max", 3, [](Fixture& f) { f.o.max_batch = static_cast<int>(f.B()) - 1; }, R,
       "seq_lens"},
      {"seq_lens_on_cuda", 3, [](Fixture& f) { f.a.seq_lens.device = Device::Cuda(0); }, R,
       "seq_lens"},
      // block_tables
      {"tables_null", 3, [](Fixture& f) { f.a.block_tables.data = nullptr; }, R, "block_tables"},
      {"tables_i64_vs_i32", 3, [](Fixture& f) { f.a.block_tables.dtype = DType::kI64; }, R,
       "block_tables"},
      {"tables_rank1", 3, [](Fixture& f) { f.a.block_tables.ndim = 1; }, R, "block_tables"},
      {"tables_rows", 3, [](Fixture& f) { f.a.block_tables.shape[0] -= 1; }, R, "block_tables"},
      {"tables_width_0", 3, [](Fixture& f) { f.a.block_tables.shape[1] = 0; }, R, "block_tables"},
      {"tables_wider_than_max", 3,
       [](Fixture& f) { f.o.max_pages_per_seq = static_cast<int>(f.M()) - 1; }, R, "block_tables"},
      {"tables_inner_stride", 3, [](Fixture& f) { f.a.block_tables.strides[1] = 2; }, R,
       "block_tables"},
      // q
      {"q_null", 3, [](Fixture& f) { f.a.q.data = nullptr; }, R, "q"},
      {"q_f16_vs_bf16", 3, [](Fixture& f) { f.a.q.dtype = DType::kF16; }, R, "q"},
      {"q_rank2", 3, [](Fixture& f) { f.a.q.ndim = 2; }, R, "q"},
      {"q_heads", 3, [](Fixture& f) { f.a.q.shape[1] = 2; }, R, "q"},
      {"q_dim", 3, [](Fixture& f) { f.a.q.shape[2] = 128; }, R, "q"},
      {"q_inner_stride", 3, [](Fixture& f) { f.a.q.strides[2] = 2; }, R, "q"},
      {"q_misaligned", 3, [](Fixture& f) { f.a.q = Misalign(f.a.q, 2); }, R, "q"},
      {"q_head_stride_unaligned", 3, [](Fixture& f) { f.a.q.strides[1] = 68; }, R, "q"},
      {"q_on_cuda", 3, [](Fixture& f) { f.a.q.device = Device::Cuda(0); }, R, "q"},
      {"q_rows_without_indptr", 1,
       [](Fixture& f) {
         f.a.q.shape[0] += 1;
         f.a.out.shape[0] += 1;
         f.a.lse.shape[0] += 1;
       },
       R, "q"},
      // q_indptr
      {"q_indptr_missing", 3, [](Fixture& f) { f.a.q_indptr = TensorView(); }, R, "q_indptr"},
      {"q_indptr_length", 3, [](Fixture& f) { f.a.q_indptr.shape[0] -= 1; }, R, "q_indptr"},
      {"q_indptr_i64", 3, [](Fixture& f) { f.a.q_indptr.dtype = DType::kI64; }, R, "q_indptr"},
      {"q_indptr_null_given", 3, [](Fixture& f) { f.a.q_indptr.data = nullptr; }, R, "q_indptr"},
      {"q_indptr_optional_but_wrong", 1,
       [](Fixture& f) { f.a.q_indptr = TensorView::Contiguous(f.in.data(), DType::kI32, {f.B()}); },
       R, "q_indptr"},
      // out
      {"out_null", 3, [](Fixture& f) { f.a.out.data = nullptr; }, R, "out"},
      {"out_f16_vs_bf16", 3, [](Fixture& f) { f.a.out.dtype = DType::kF16; }, R, "out"},
      {"out_rows", 3, [](Fixture& f) { f.a.out.shape[0] -= 1; }, R, "out"},
      {"out_heads", 3, [](Fixture& f) { f.a.out.shape[1] += 1; }, R, "out"},
      {"out_dim", 3, [](Fixture& f) { f.a.out.shape[2] = 32; }, R, "out"},
      {"out_inner_stride", 3, [](Fixture& f) { f.a.out.strides[2] = 2; }, R, "out"},
      {"out_misaligned", 3, [](Fixture& f) { f.a.out = Misalign(f.a.out, 8); }, R, "out"},
      {"out_on_cuda", 3, [](Fixture& f) { f.a.out.device = Device::Cuda(0); }, R, "out"},
      // lse
      {"lse_missing", 3, [](Fixture& f) { f.a.lse = TensorView(); }, R, "lse"},
      {"lse_not_asked_for", 3, [](Fixture& f) { f.o.write_lse = false; }, R, "lse"},
      {"lse_bf16", 3, [](Fixture& f) { f.a.lse.dtype = DType::kBF16; }, R, "lse"},
      {"lse_rows", 3, [](Fixture& f) { f.a.lse.shape[0] += 1; }, R, "lse"},
      {"lse_inner_stride", 3, [](Fixture& f) { f.a.lse.strides[1] = 2; }, R, "lse"},
      {"lse_misaligned", 3, [](Fixture& f) { f.a.lse = Misalign(f.a.lse, 2); }, R, "lse"},
      // sinks
      {"sinks_missing", 3, [](Fixture& f) { f.a.sinks = TensorView(); }, R, "sinks"},
      {"sinks_not_asked_for", 3, [](Fixture& f) { f.o.has_sinks = false; }, R, "sinks"},
      {"sinks_length", 3, [](Fixture& f) { f.a.sinks.shape[0] += 1; }, R, "sinks"},
      {"sinks_f16", 3, [](Fixture& f) { f.a.sinks.dtype = DType::kF16; }, R, "sinks"},
      {"sinks_on_cuda", 3, [](Fixture& f) { f.a.sinks.device = Device::Cuda(0); }, R, "sinks"},
      // global scales
      {"k_scale_zero", 3, [](Fixture& f) { f.a.k_scale = GlobalScale::Value(0.0f); }, R, "k_scale"},
      {"k_scale_inf", 3, [inf](Fixture& f) { f.a.k_scale = GlobalScale::Value(inf); }, R,
       "k_scale"},
      {"v_scale_negative", 3, [](Fixture& f) { f.a.v_scale = GlobalScale::Value(-2.0f); }, R,
       "v_scale"},
      {"v_scale_nan", 3, [nan](Fixture& f) { f.a.v_scale = GlobalScale::Value(nan); }, R,
       "v_scale"},
      // workspace
      {"workspace_bytes_negative", 3, [](Fixture& f) { f.workspace_bytes = -1; }, R,
       "workspace_bytes"},
  };
}

class AttentionValidationTest : public ::testing::TestWithParam<Rule> {};

// Create + Run of the fixture, stopping at the stage that fails.
absl::Status CreateAndRun(Fixture& f, Stage* failed_at) {
  absl::StatusOr<DecodeAttention> op = DecodeAttention::Create(f.o);
  *failed_at = Stage::kCreate;
  if (!op.ok()) return op.status();
  *failed_at = Stage::kRun;
  return op->Run(f.a, f.cache, f.workspace, f.workspace_bytes);
}

void ExpectRejected(const Rule& r, const absl::Status& s) {
  EXPECT_EQ(s.code(), r.code) << s;
  EXPECT_NE(s.message().find(r.argument), std::string::npos)
      << "message does not name '" << r.argument << "': " << s.message();
  EXPECT_NE(s.message().find("expected"), std::string::npos) << s.message();
}

TEST_P(AttentionValidationTest, RejectsNamingTheArgumentAndWritesNothing) {
  const Rule& r = GetParam();
  {
    // The unmodified call is valid and writes, so the failure is the mutation's.
    Fixture ok(r.q_len, r.fp8_keys);
    Stage stage;
    ASSERT_TRUE(CreateAndRun(ok, &stage).ok());
    ASSERT_NE(ok.out, ok.c.out);
  }
  Fixture f(r.q_len, r.fp8_keys);
  r.mutate(f);
  const std::vector<uint8_t> in = f.in, out = f.out;
  Stage stage;
  const absl::Status s = CreateAndRun(f, &stage);
  ExpectRejected(r, s);
  EXPECT_EQ(stage, r.stage) << s;
  EXPECT_EQ(f.out, out) << "a rejected call wrote the outputs";
  EXPECT_EQ(f.in, in) << "a rejected call wrote the inputs";
}

TEST_P(AttentionValidationTest, FunctionalFormRejectsTheSame) {
  const Rule& r = GetParam();
  Fixture f(r.q_len, r.fp8_keys);
  r.mutate(f);
  const std::vector<uint8_t> out = f.out;
  ExpectRejected(r, DecodeAttentionPaged(f.o, f.a, f.cache, f.workspace, f.workspace_bytes));
  EXPECT_EQ(f.out, out);
}

INSTANTIATE_TEST_SUITE_P(Rules, AttentionValidationTest, ::testing::ValuesIn(Rules()),
                         [](const ::testing::TestParamInfo<Rule>& i) {
                           return std::string(i.param.name);
                         });
INSTANTIATE_TEST_SUITE_P(Fp8KeyRules, AttentionValidationTest, ::testing::ValuesIn(Fp8KeyRules()),
                         [](const ::testing::TestParamInfo<Rule>& i) {
                           return std::string(i.param.name);
                         });

TEST(AttentionValidation, Fp8KeysTakeU8OrE4m3Data) {
  Fixture f(3, /*fp8_keys=*/true);
  ASSERT_EQ(f.o.geometry.key_format, KeyFormat::kFp8);
  ASSERT_TRUE(DecodeAttentionPaged(f.o, f.a, f.cache, nullptr, 0).ok());
  const std::vector<uint8_t> u8_out = f.out;
  ASSERT_NE(u8_out, f.c.out);
  f.out = f.c.out;
  f.cache.k_data.dtype = DType::kE4M3;
  ASSERT_TRUE(DecodeAttentionPaged(f.o, f.a, f.cache, nullptr, 0).ok());
  EXPECT_EQ(f.out, u8_out);
}

TEST(AttentionValidation, CudaWithoutGpuFailsCleanly) {
  std::string why;
  if (testing::HasCudaDevice(&why)) GTEST_SKIP() << "a GPU is present; this checks the no-GPU path";
  Fixture f(3);
  f.o.device = Device::Cuda(0);
  const absl::StatusOr<DecodeAttention> op = DecodeAttention::Create(f.o);
  ASSERT_FALSE(op.ok());
  EXPECT_EQ(op.status().code(), absl::StatusCode::kFailedPrecondition) << op.status();
  EXPECT_NE(op.status().message().find("cuda:0"), std::string::npos) << op.status();
}

TEST(AttentionValidation, CpuNeedsNoWorkspaceAndIgnoresOne) {
  Fixture f(3);
  const absl::StatusOr<DecodeAttention> op = DecodeAttention::Create(f.o);
  ASSERT_TRUE(op.ok()) << op.status();
  EXPECT_EQ(op->WorkspaceBytes(), 0);
  std::vector<uint8_t> scratch(64);
  ASSERT_TRUE(op->Run(f.a, f.cache, nullptr, 0).ok());
  const std::vector<uint8_t> first = f.out;
  f.out = f.c.out;
  ASSERT_TRUE(op->Run(f.a, f.cache, scratch.data() + 1, 63).ok());
  EXPECT_EQ(f.out, first);
}

// The CUDA-only workspace rules, checked where they live (MakeAttentionParams
// touches no device memory, so CUDA-tagged host views serve).
struct CudaViews {
  Fixture f{3};
  DecodeAttention::Options o;
  DecodeAttentionArgs a;
  PagedCache cache;
  CudaViews() : o(f.o), a(f.a), cache(f.cache) {
    const Device cuda = Device::Cuda(0);
    o.device = cuda;
    for (TensorView* t : {&a.q, &a.q_indptr, &a.block_tables, &a.seq_lens, &a.out, &a.lse, &a.sinks,
                          &cache.k_data, &cache.v_data, &cache.k_scales, &cache.v_scales}) {
      t->device = cuda;
    }
  }
};

constexpr int kSms = 132;

TEST(AttentionValidation, CudaWorkspaceMustBeAligned) {
  CudaViews v;
  const int64_t need = internal::AttentionWorkspaceBytes(v.o, kSms);
  alignas(256) static uint8_t scratch[256 + 16];
  const int64_t bytes = std::max<int64_t>(need, 16);
  std::vector<uint8_t> big(need > 0 ? need + 512 : 0);
  uint8_t* base =
      need > 0 ? big.data() + (256 - reinterpret_cast<uintptr_t>(big.data()) % 256) : scratch;
  EXPECT_TRUE(internal::MakeAttentionParams(v.o, v.a, v.cache, base, bytes, kSms).ok());
  const auto s = internal::MakeAttentionParams(v.o, v.a, v.cache, base + 16, bytes, kSms);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("workspace: expected a 256-byte aligned"), std::string::npos)
      << s.status();
}

TEST(AttentionValidation, CudaWorkspaceMustBeLargeEnough) {
  CudaViews v;
  const int64_t need = internal::AttentionWorkspaceBytes(v.o, kSms);
  if (need == 0) GTEST_SKIP() << "the CUDA kernel asks for no workspace at these options";
  std::vector<uint8_t> big(need + 512);
  uint8_t* base = big.data() + (256 - reinterpret_cast<uintptr_t>(big.data()) % 256);
  EXPECT_TRUE(internal::MakeAttentionParams(v.o, v.a, v.cache, base, need, kSms).ok());
  auto s = internal::MakeAttentionParams(v.o, v.a, v.cache, base, need - 1, kSms);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("workspace_bytes: expected at least"), std::string::npos)
      << s.status();
  s = internal::MakeAttentionParams(v.o, v.a, v.cache, nullptr, need, kSms);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("workspace: expected a pointer"), std::string::npos)
      << s.status();
}

TEST(AttentionValidation, ParamsCarryTheResolvedOptions) {
  Fixture f(3);
  auto p = internal::MakeAttentionParams(f.o, f.a, f.cache, nullptr, 0);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->sm_scale, 0.125f);  // 1 / sqrt(64)
  EXPECT_EQ(p->group, 2);
  EXPECT_EQ(p->num_qo_heads, 4);
  EXPECT_EQ(p->batch_size, f.B());
  EXPECT_EQ(p->max_pages, f.M());
  EXPECT_EQ(p->total_q, f.c.q.shape[0]);
  EXPECT_EQ(p->max_batch, f.o.max_batch);
  EXPECT_NE(p->q_indptr, nullptr);
  EXPECT_NE(p->lse, nullptr);
  EXPECT_NE(p->sinks, nullptr);
  f.o.sm_scale = 0.3f;
  EXPECT_EQ(internal::MakeAttentionParams(f.o, f.a, f.cache, nullptr, 0)->sm_scale, 0.3f);
  Fixture one(1);
  auto p1 = internal::MakeAttentionParams(one.o, one.a, one.cache, nullptr, 0);
  ASSERT_TRUE(p1.ok()) << p1.status();
  EXPECT_EQ(p1->q_indptr, nullptr);
}

}  // namespace
}  // namespace fp4kv
