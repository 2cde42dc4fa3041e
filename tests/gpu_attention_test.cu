// Decode attention on the GPU against the fp64 CPU reference: eagerly on
// the default stream, then captured once in a CUDA graph and replayed after
// Rewrite() changed lengths, tables, padding rows, data and pointer scales in
// place (same addresses). Outputs are poisoned before every run;
// CompareAttentionOutputs checks per-(row, head) relative L2 error against
// the reference's unrounded fp64 outputs, lse, and that every byte the
// contract leaves alone is still poison. NVFP4 and FP8 E4M3 keys alike.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fp4kv/attention.h"
#include "fp4kv/device/page_reader.cuh"
#include "fp4kv/format.h"
#include "gtest/gtest.h"
#include "testing/attention_case.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::AttentionCase;
using testing::AttentionSpec;

constexpr double kLseTol = 1e-3;

double RelTol(const AttentionSpec& s) { return s.dtype == DType::kBF16 ? 4e-3 : 1.5e-3; }

// The reference for the case's current inputs: the output blob (lse, and
// out as Run writes it) and the unrounded fp64 outputs the kernel's out is
// compared with (a bf16 output rounds once; comparing with the already
// rounded reference would count two roundings).
struct Want {
  std::vector<uint8_t> blob;
  std::vector<double> exact;
};

// The reference of the last few input states, by their bytes and fixed
// scale values: both kernel families run the same states (the eager inputs
// and the rewrites of the same seeds), and the long prefill cases' reference
// costs seconds.
struct CachedWant {
  std::string name;
  std::vector<uint8_t> in;
  float k_scale = 0, v_scale = 0;
  Want want;
};

const Want& Reference(const AttentionCase& c) {
  static std::vector<CachedWant>* cache = new std::vector<CachedWant>();
  const std::string name = c.spec.Name();
  for (const CachedWant& w : *cache) {
    if (w.name == name && w.k_scale == c.k_scale.value && w.v_scale == c.v_scale.value &&
        w.in == c.in) {
      return w.want;
    }
  }
  if (cache->size() >= 4) cache->erase(cache->begin());
  CachedWant w{name, c.in, c.k_scale.value, c.v_scale.value, Want()};
  w.want.blob = testing::ReferenceAttentionOutputs(c, &w.want.exact);
  cache->push_back(std::move(w));
  return cache->back().want;
}

std::string Compare(const AttentionCase& c, const std::vector<uint8_t>& got) {
  const Want& w = Reference(c);
  return testing::CompareAttentionOutputs(c, w.blob, got, RelTol(c.spec), kLseTol, &w.exact);
}

// Sets environment variable `var` (read by DecodeAttention::Create) for its
// lifetime; "" leaves it unset.
class ScopedEnv {
 public:
  ScopedEnv(const char* var, const char* value) : var_(var) {
    const char* old = std::getenv(var);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value[0] != '\0') {
      setenv(var, value, 1);
    } else {
      unsetenv(var);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(var_.c_str(), old_.c_str(), 1);
    } else {
      unsetenv(var_.c_str());
    }
  }

 private:
  std::string var_;
  bool had_ = false;
  std::string old_;
};

// The kernel families a case runs on (FP4KV_ATTENTION_KERNEL,
// FP4KV_PREFILL_KERNEL): tokens in M with TMA copies for every shape they
// can describe, with the default prefill family (the wgmma kernel on an
// H200; where TMA cannot run, e.g. without a GPU of compute capability 9.0,
// the default choice instead); rows in M forced; and tokens in M with
// cp.async copies (the sm_80 decode kernel, and the default's choice for
// NVFP4 keys) forced together with the mma.sync prefill kernel.
struct KernelFamilies {
  const char* decode;
  const char* prefill;
};
constexpr KernelFamilies kFamilies[] = {
    {"tokens_in_m_tma", ""}, {"rows_in_m", ""}, {"tokens_in_m", "mma"}};

// Whether the TMA decode kernel can run here (FP4KV_ATTENTION_KERNEL=
// tokens_in_m_tma succeeds at Create()).
bool TmaDecodeAvailable() {
#if defined(FP4KV_LIBRARY_HAS_SM90A)
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

void ExpectFamilyMatchesReference(AttentionCase& c, const std::string& name, bool graph_rounds);

// The families an op chose are the ones FP4KV_ATTENTION_KERNEL and
// FP4KV_PREFILL_KERNEL ask for, or by default the fastest this build and
// GPU run (TMA decode and the wgmma prefill at head dim 64 / 128 on an
// sm_90a build on compute capability 9.0): Create() must not fall back
// silently. The log names them for every case.
void ExpectFamiliesAsAsked(const DecodeAttention& op, const std::string& name) {
  const char* decode_env = std::getenv("FP4KV_ATTENTION_KERNEL");
  const char* prefill_env = std::getenv("FP4KV_PREFILL_KERNEL");
  const std::string decode = decode_env != nullptr ? decode_env : "";
  const std::string prefill = prefill_env != nullptr ? prefill_env : "";
  const bool sm90a = TmaDecodeAvailable();
  std::string want_decode = decode;
  if (decode.empty() || decode == "auto") want_decode = sm90a ? "tokens_in_m_tma" : "tokens_in_m";
  if (decode == "tokens_in_m_tma") want_decode = "tokens_in_m_tma_all";
  const int d = op.options().geometry.head_dim_v;
  std::string want_prefill = prefill;
  if (op.options().max_q_len <= kDecodeRowsQLen) {
    want_prefill = "none";
  } else if (prefill.empty() || prefill == "auto") {
    want_prefill = sm90a && (d == 64 || d == 128) ? "wgmma" : "mma";
  }
  std::printf("[ family   ] %s: decode %s, prefill %s\n", name.c_str(), op.decode_family(),
              op.prefill_family());
  EXPECT_EQ(op.decode_family(), want_decode) << name;
  EXPECT_EQ(op.prefill_family(), want_prefill) << name;
}

// Every kernel family against the reference: an eager Run, then (with
// graph_rounds) two replays of one captured graph after rewriting the inputs.
void ExpectGpuMatchesReference(AttentionCase& c, const std::string& name,
                               bool graph_rounds = true) {
  const bool prefill = c.Options(Device::Cuda(0)).max_q_len > kDecodeRowsQLen;
  const bool tma = TmaDecodeAvailable();
  for (const KernelFamilies& f : kFamilies) {
    const bool tma_family = std::string(f.decode) == "tokens_in_m_tma";
    ScopedEnv decode("FP4KV_ATTENTION_KERNEL", tma_family && !tma ? "" : f.decode);
    ScopedEnv prefill_family("FP4KV_PREFILL_KERNEL", prefill ? f.prefill : "");
    std::string label = f.decode[0] != '\0' ? f.decode : "default";
    if (prefill && f.prefill[0] != '\0') label += std::string(", prefill ") + f.prefill;
    ExpectFamilyMatchesReference(c, name + " [" + label + "]", graph_rounds);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

void ExpectFamilyMatchesReference(AttentionCase& c, const std::string& name, bool graph_rounds) {
  const Device cuda = Device::Cuda(0);
  auto op = DecodeAttention::Create(c.Options(cuda));
  ASSERT_TRUE(op.ok()) << name << ": " << op.status();
  ExpectFamiliesAsAsked(*op, name);
  testing::DeviceBuffer din(c.in.size()), dout(c.out.size());
  testing::DeviceBuffer ws(static_cast<size_t>(op->WorkspaceBytes() > 0 ? op->WorkspaceBytes() : 256));
  ASSERT_TRUE(din.ok() && dout.ok() && ws.ok()) << name << ": cudaMalloc";
  uint8_t* in_dev = static_cast<uint8_t*>(din.get());
  uint8_t* out_dev = static_cast<uint8_t*>(dout.get());
  auto run = [&](Stream s) {
    return op->Run(c.Args(in_dev, out_dev, cuda), c.Cache(in_dev, cuda), ws.get(),
                   op->WorkspaceBytes(), s);
  };

  // Eager, default stream. The workspace is poisoned too: it is scratch.
  ASSERT_TRUE(din.Upload(c.in));
  ASSERT_TRUE(dout.Fill(testing::kPoison));
  ASSERT_TRUE(ws.Fill(0xff));
  FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  {
    const absl::Status s = run(nullptr);
    ASSERT_TRUE(s.ok()) << name << ": " << s;
  }
  FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> got = dout.DownloadAs<uint8_t>(c.out.size());
  ASSERT_EQ(got.size(), c.out.size());
  ASSERT_EQ(Compare(c, got), "") << name << " (eager)";
  if (!graph_rounds) return;

  // Captured once, replayed after rewriting the inputs in place.
  cudaStream_t stream = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status captured = run(stream);
  FP4KV_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(captured.ok()) << name << " (capture): " << captured;
  FP4KV_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 2; ++round) {
    c.Rewrite(1000 + round);
    ASSERT_TRUE(din.Upload(c.in));
    ASSERT_TRUE(dout.Fill(testing::kPoison));
    FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
    FP4KV_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    FP4KV_ASSERT_CUDA(cudaStreamSynchronize(stream));
    got = dout.DownloadAs<uint8_t>(c.out.size());
    ASSERT_EQ(Compare(c, got), "") << name << " (graph replay " << round << ")";
  }
  FP4KV_ASSERT_CUDA(cudaGraphExecDestroy(exec));
  FP4KV_ASSERT_CUDA(cudaGraphDestroy(graph));
  FP4KV_ASSERT_CUDA(cudaStreamDestroy(stream));
}

class GpuAttentionTest : public ::testing::TestWithParam<AttentionSpec> {};

TEST(GpuAttentionFamily, UnknownFamilyIsRejectedAtCreate) {
  FP4KV_SKIP_WITHOUT_GPU();
  AttentionSpec spec;
  AttentionCase c = testing::MakeAttentionCase(spec, 5);
  ScopedEnv scoped("FP4KV_ATTENTION_KERNEL", "fastest");
  auto op = DecodeAttention::Create(c.Options(Device::Cuda(0)));
  ASSERT_FALSE(op.ok());
  EXPECT_EQ(op.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(op.status().message().find("FP4KV_ATTENTION_KERNEL"), std::string::npos)
      << op.status();
}

TEST(GpuAttentionFamily, TmaDecodeFamilyFromTheEnvironment) {
  FP4KV_SKIP_WITHOUT_GPU();
  AttentionSpec spec;
  AttentionCase c = testing::MakeAttentionCase(spec, 5);
  for (const char* name : {"auto", "tokens_in_m", "rows_in_m"}) {
    ScopedEnv scoped("FP4KV_ATTENTION_KERNEL", name);
    auto op = DecodeAttention::Create(c.Options(Device::Cuda(0)));
    EXPECT_TRUE(op.ok()) << name << ": " << op.status();
  }
  int major = 0, minor = 0;
  FP4KV_ASSERT_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  FP4KV_ASSERT_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
#if defined(FP4KV_LIBRARY_HAS_SM90A)
  const bool tma = major == 9 && minor == 0;
#else
  const bool tma = false;
#endif
  ScopedEnv scoped("FP4KV_ATTENTION_KERNEL", "tokens_in_m_tma");
  auto op = DecodeAttention::Create(c.Options(Device::Cuda(0)));
  if (tma) {
    EXPECT_TRUE(op.ok()) << op.status();
  } else {
    ASSERT_FALSE(op.ok());
    EXPECT_EQ(op.status().code(), absl::StatusCode::kFailedPrecondition) << op.status();
  }
}

// Kernels that copy whole 16-token tiles of a page (the TMA decode kernel)
// read entries no request attends: past a request's length and, with a
// window, before it. NaN block scales and FP8 key bytes there must not reach
// the output. Both layouts (NHD: per-entry scale rows of all heads; HND: one
// contiguous run per head), head dims 64/128/256, NVFP4 and FP8 keys, page
// sizes that are and are not multiples of 16, windows that start mid-tile.
TEST(GpuAttentionTma, NanInUnattendedEntriesNeverReachTheOutput) {
  FP4KV_SKIP_WITHOUT_GPU();
  int n = 0;
  for (Layout layout : {Layout::kNHD, Layout::kHND}) {
    for (int d : {64, 128, 256}) {
      for (bool fp8 : {false, true}) {
        for (int page : {16, 32, 8}) {
          AttentionSpec spec;
          spec.layout = layout;
          spec.head_dim = d;
          spec.fp8_keys = fp8;
          spec.page_size = page;
          spec.num_kv_heads = 4;
          spec.group = 4;
          spec.batch = 4;
          spec.min_seq_len = 1;
          spec.max_seq_len = 150;
          spec.nan_unattended = true;
          spec.window_left = (n % 3 == 1) ? 37 : -1;
          spec.lse = n % 2 == 0;
          AttentionCase c = testing::MakeAttentionCase(spec, 300 + n);
          ExpectGpuMatchesReference(c, spec.Name(), /*graph_rounds=*/n % 4 == 0);
          if (HasFatalFailure()) return;
          ++n;
        }
      }
    }
  }
}

TEST(GpuAttentionFamily, PrefillFamilyFromTheEnvironment) {
  FP4KV_SKIP_WITHOUT_GPU();
  AttentionSpec spec;
  spec.q_len = 40;  // max_q_len 40: an op that launches the prefill kernel
  spec.max_seq_len = 80;
  AttentionCase c = testing::MakeAttentionCase(spec, 5);
  {
    ScopedEnv scoped("FP4KV_PREFILL_KERNEL", "fastest");
    auto op = DecodeAttention::Create(c.Options(Device::Cuda(0)));
    ASSERT_FALSE(op.ok());
    EXPECT_EQ(op.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(op.status().message().find("FP4KV_PREFILL_KERNEL"), std::string::npos)
        << op.status();
  }
  {
    ScopedEnv scoped("FP4KV_PREFILL_KERNEL", "mma");
    EXPECT_TRUE(DecodeAttention::Create(c.Options(Device::Cuda(0))).ok());
  }
  int major = 0, minor = 0;
  FP4KV_ASSERT_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  FP4KV_ASSERT_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
#if defined(FP4KV_LIBRARY_HAS_SM90A)
  const bool wgmma = major == 9 && minor == 0;
#else
  const bool wgmma = false;
#endif
  ScopedEnv scoped("FP4KV_PREFILL_KERNEL", "wgmma");
  auto op = DecodeAttention::Create(c.Options(Device::Cuda(0)));
  if (wgmma) {
    EXPECT_TRUE(op.ok()) << op.status();
  } else {
    ASSERT_FALSE(op.ok());
    EXPECT_EQ(op.status().code(), absl::StatusCode::kFailedPrecondition) << op.status();
  }
  // Head dim 256 has no wgmma kernel.
  AttentionSpec wide = spec;
  wide.head_dim = 256;
  AttentionCase cw = testing::MakeAttentionCase(wide, 5);
  auto op256 = DecodeAttention::Create(cw.Options(Device::Cuda(0)));
  ASSERT_FALSE(op256.ok());
  EXPECT_EQ(op256.status().code(), absl::StatusCode::kFailedPrecondition) << op256.status();
}

TEST_P(GpuAttentionTest, MatchesReferenceEagerAndInGraphs) {
  FP4KV_SKIP_WITHOUT_GPU();
  AttentionCase c = testing::MakeAttentionCase(GetParam(), 23);
  ExpectGpuMatchesReference(c, GetParam().Name());
}

INSTANTIATE_TEST_SUITE_P(Sweep, GpuAttentionTest, ::testing::ValuesIn(testing::AttentionSweep()),
                         [](const auto& info) { return info.param.Name(); });

class GpuAttentionRealKvTest : public ::testing::TestWithParam<AttentionSpec> {};

TEST_P(GpuAttentionRealKvTest, MatchesReferenceEagerAndInGraphs) {
  FP4KV_SKIP_WITHOUT_GPU();
  FP4KV_SKIP_WITHOUT_REALKV();
  AttentionCase c = testing::MakeAttentionCase(GetParam(), 29);
  ExpectGpuMatchesReference(c, GetParam().Name());
}

INSTANTIATE_TEST_SUITE_P(RealKv, GpuAttentionRealKvTest,
                         ::testing::ValuesIn(testing::RealKvSweep()),
                         [](const auto& info) { return info.param.Name(); });

// Prefill and extend chunks (more than kDecodeRowsQLen new tokens a
// request, the prefill kernel's share on CUDA), alone and mixed with decode
// rows in one Run; the graph captured with one mix of decode and prefill
// requests replays for the other mixes Rewrite() makes.
INSTANTIATE_TEST_SUITE_P(PrefillSweep, GpuAttentionTest,
                         ::testing::ValuesIn(testing::PrefillSweep()),
                         [](const auto& info) { return info.param.Name(); });
INSTANTIATE_TEST_SUITE_P(Fp8KeyPrefillSweep, GpuAttentionTest,
                         ::testing::ValuesIn(testing::WithFp8Keys(testing::PrefillSweep())),
                         [](const auto& info) { return info.param.Name(); });
INSTANTIATE_TEST_SUITE_P(PrefillRealKv, GpuAttentionRealKvTest,
                         ::testing::ValuesIn(testing::PrefillRealKvSweep()),
                         [](const auto& info) { return info.param.Name(); });
INSTANTIATE_TEST_SUITE_P(Fp8KeyPrefillRealKv, GpuAttentionRealKvTest,
                         ::testing::ValuesIn(testing::WithFp8Keys(testing::PrefillRealKvSweep())),
                         [](const auto& info) { return info.param.Name(); });

// A graph replay against an eager Run on the same inputs, bit for bit:
// captured once on the case's first mix of decode rows and prefill chunks,
// replayed after Rewrite() changed the mix (which requests are decode rows,
// every request's rows and length, tables, data), then the same inputs run
// eagerly with the outputs poisoned again. (The reference check of the
// replays is MatchesReferenceEagerAndInGraphs.)
class GpuAttentionGraphTest : public ::testing::TestWithParam<AttentionSpec> {};

TEST_P(GpuAttentionGraphTest, ReplayEqualsEagerBitForBit) {
  FP4KV_SKIP_WITHOUT_GPU();
  AttentionCase c = testing::MakeAttentionCase(GetParam(), 41);
  const Device cuda = Device::Cuda(0);
  auto op = DecodeAttention::Create(c.Options(cuda));
  ASSERT_TRUE(op.ok()) << op.status();
  testing::DeviceBuffer din(c.in.size()), dout(c.out.size());
  testing::DeviceBuffer ws(
      static_cast<size_t>(op->WorkspaceBytes() > 0 ? op->WorkspaceBytes() : 256));
  ASSERT_TRUE(din.ok() && dout.ok() && ws.ok()) << "cudaMalloc";
  uint8_t* in_dev = static_cast<uint8_t*>(din.get());
  uint8_t* out_dev = static_cast<uint8_t*>(dout.get());
  cudaStream_t stream = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto run = [&] {
    return op->Run(c.Args(in_dev, out_dev, cuda), c.Cache(in_dev, cuda), ws.get(),
                   op->WorkspaceBytes(), stream);
  };
  ASSERT_TRUE(din.Upload(c.in));
  ASSERT_TRUE(ws.Fill(0xff));
  FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status captured = run();
  FP4KV_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(captured.ok()) << captured;
  FP4KV_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 3; ++round) {
    if (round > 0) c.Rewrite(2000 + round);
    ASSERT_TRUE(din.Upload(c.in));
    ASSERT_TRUE(dout.Fill(testing::kPoison));
    FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
    FP4KV_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    FP4KV_ASSERT_CUDA(cudaStreamSynchronize(stream));
    const std::vector<uint8_t> replayed = dout.DownloadAs<uint8_t>(c.out.size());
    ASSERT_TRUE(dout.Fill(testing::kPoison));
    FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
    const absl::Status eager = run();
    ASSERT_TRUE(eager.ok()) << eager;
    FP4KV_ASSERT_CUDA(cudaStreamSynchronize(stream));
    const std::vector<uint8_t> direct = dout.DownloadAs<uint8_t>(c.out.size());
    ASSERT_EQ(replayed.size(), c.out.size());
    ASSERT_EQ(direct.size(), c.out.size());
    size_t first = 0;
    while (first < direct.size() && direct[first] == replayed[first]) ++first;
    EXPECT_EQ(first, direct.size())
        << "round " << round << ": output byte " << first << " (blob offset; out at "
        << c.out_view.offset << ", lse at " << c.lse.offset << ") differs: replay 0x" << std::hex
        << int{replayed[first]} << ", eager 0x" << int{direct[first]};
    EXPECT_NE(direct, c.out) << "round " << round << ": nothing written";
  }
  FP4KV_ASSERT_CUDA(cudaGraphExecDestroy(exec));
  FP4KV_ASSERT_CUDA(cudaGraphDestroy(graph));
  FP4KV_ASSERT_CUDA(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(PrefillGraph, GpuAttentionGraphTest,
                         ::testing::ValuesIn(testing::PrefillSweep()),
                         [](const auto& info) { return info.param.Name(); });
INSTANTIATE_TEST_SUITE_P(Fp8KeyPrefillGraph, GpuAttentionGraphTest,
                         ::testing::ValuesIn(testing::WithFp8Keys(testing::PrefillSweep())),
                         [](const auto& info) { return info.param.Name(); });

// FP8 E4M3 keys with NVFP4 values: the same sweeps, the same tolerances.
INSTANTIATE_TEST_SUITE_P(Fp8KeySweep, GpuAttentionTest,
                         ::testing::ValuesIn(testing::WithFp8Keys(testing::AttentionSweep())),
                         [](const auto& info) { return info.param.Name(); });
INSTANTIATE_TEST_SUITE_P(Fp8KeyPage16, GpuAttentionTest,
                         ::testing::ValuesIn(testing::Fp8KeyPage16Sweep()),
                         [](const auto& info) { return info.param.Name(); });
INSTANTIATE_TEST_SUITE_P(Fp8KeyRealKv, GpuAttentionRealKvTest,
                         ::testing::ValuesIn(testing::WithFp8Keys(testing::RealKvSweep())),
                         [](const auto& info) { return info.param.Name(); });

// Requests of more than kDecodeRowsQLen new tokens (the prefill kernel),
// alone and beside decode-sized ones, a first set; PrefillSweep covers the
// full list.
std::vector<AttentionSpec> PrefillSmokeSpecs() {
  std::vector<AttentionSpec> out;
  const int dims[] = {64, 128, 256};
  for (int i = 0; i < 6; ++i) {
    AttentionSpec s;
    s.batch = i % 2 ? 3 : 1;
    s.group = i % 3 == 0 ? 4 : (i % 3 == 1 ? 1 : 7);
    s.num_kv_heads = 2;
    s.head_dim = dims[i % 3];
    s.page_size = i < 3 ? 16 : 17;
    s.layout = i % 2 ? Layout::kHND : Layout::kNHD;
    s.dtype = i % 4 == 1 ? DType::kF16 : DType::kBF16;
    s.q_len = i % 2 ? 40 : 129;
    s.min_seq_len = s.batch == 1 ? 300 : 1;
    s.max_seq_len = 300;
    s.lse = true;
    s.sinks = i == 4;
    s.soft_cap = i == 2 ? 30.0f : 0.0f;
    s.window_left = i == 5 ? 50 : -1;
    s.oob_pages = i == 3;
    out.push_back(s);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(PrefillSmoke, GpuAttentionTest, ::testing::ValuesIn(PrefillSmokeSpecs()),
                         [](const auto& info) { return info.param.Name(); });
INSTANTIATE_TEST_SUITE_P(Fp8KeyPrefillSmoke, GpuAttentionTest,
                         ::testing::ValuesIn(testing::WithFp8Keys(PrefillSmokeSpecs())),
                         [](const auto& info) { return info.param.Name(); });

// Decode items long enough that each warp's range spans more than 32
// page-table columns: the tile copy's fast path reads the table 32 columns
// at a time, and these cases cross from one read to the next (with
// out-of-range entries among the columns in the second). The split-KV
// schedule divides a request only when there are fewer items than about 0.8
// of the resident CTAs, so it takes 64 requests x 8 KV heads of 2400 tokens
// (no split on a GPU of up to about 600 resident CTAs: a warp reads about
// 600 tokens = 38 pages of 16). Building such a case costs seconds of CPU
// time, so each runs eagerly in every family, without the graph rounds the
// sweeps cover.
TEST(GpuAttentionLongRange, WarpRangesCrossTheTableReload) {
  FP4KV_SKIP_WITHOUT_GPU();
  std::vector<AttentionSpec> specs;
  for (int i = 0; i < 2; ++i) {
    AttentionSpec s;
    s.batch = 64;
    s.num_kv_heads = 8;
    s.group = i == 0 ? 1 : 4;
    s.head_dim = 64;
    s.page_size = 16;
    s.layout = i == 0 ? Layout::kNHD : Layout::kHND;
    s.dtype = i == 0 ? DType::kBF16 : DType::kF16;
    s.table_dtype = i == 0 ? DType::kI32 : DType::kI64;
    s.min_seq_len = 2400;
    s.max_seq_len = 2400;
    s.lse = true;
    s.oob_pages = i == 1;
    specs.push_back(s);
  }
  // NVFP4 keys for the first, FP8 keys for the second.
  specs[1] = testing::WithFp8Keys(std::vector<AttentionSpec>{specs[1]})[0];
  for (const AttentionSpec& spec : specs) {
    AttentionCase c = testing::MakeAttentionCase(spec, 47);
    ExpectGpuMatchesReference(c, spec.Name(), /*graph_rounds=*/false);
    if (HasFatalFailure()) return;
  }
}

// One long request of one KV head: the split-KV schedule cuts it into more
// chunks than one round of the merge kernel reads (a round covers 32 splits
// at head dim 64, 16 at 128, 8 at 256; 5000 tokens in chunks of 64 are 79
// splits, 3000 are 47), so each row's partials are merged over several
// rounds. The sweeps' single requests (at most 1000 tokens: 16 splits) fit
// one round below head dim 256.
TEST(GpuAttentionLongSplit, MergeTakesSeveralRounds) {
  FP4KV_SKIP_WITHOUT_GPU();
  std::vector<AttentionSpec> specs;
  constexpr int kDims[] = {64, 128, 256};
  for (int i = 0; i < 3; ++i) {
    AttentionSpec s;
    s.batch = 1;
    s.num_kv_heads = 1;
    s.group = i == 1 ? 4 : 8;
    s.head_dim = kDims[i];
    s.page_size = 16;
    s.layout = i == 2 ? Layout::kHND : Layout::kNHD;
    s.dtype = i == 1 ? DType::kF16 : DType::kBF16;
    s.min_seq_len = s.max_seq_len = i == 2 ? 3000 : 5000;
    s.lse = true;
    s.sinks = i == 0;
    specs.push_back(s);
  }
  // FP8 keys for the head dim 128 case as well.
  specs.push_back(testing::WithFp8Keys(std::vector<AttentionSpec>{specs[1]})[0]);
  for (const AttentionSpec& spec : specs) {
    AttentionCase c = testing::MakeAttentionCase(spec, 53);
    ExpectGpuMatchesReference(c, spec.Name(), /*graph_rounds=*/true);
    if (HasFatalFailure()) return;
  }
}

// The public FP8 key readers of page_reader.cuh over all 256 codes, laid
// out as one key row of a pool: Fp8KeyWordToHalf2 (times Fp8KeyHalfScale())
// and LoadFp8KeyFloat must give e4m3(code) exactly for every finite code.
__global__ void Fp8KeyReaderKernel(const uint8_t* row, uint32_t* words, float* loaded,
                                   float* half_scale, int* arch) {
  const int t = threadIdx.x;  // 64 threads: one word of 4 codes each
  device::PagePool pool;
  pool.data = row;
  uint32_t lo, hi;
  device::Fp8KeyWordToHalf2(reinterpret_cast<const uint32_t*>(row)[t], &lo, &hi);
  words[2 * t] = lo;
  words[2 * t + 1] = hi;
  for (int j = 0; j < 4; ++j) loaded[4 * t + j] = device::LoadFp8KeyFloat(pool, 0, 0, 0, 4 * t + j);
  if (t == 0) {
    *half_scale = device::Fp8KeyHalfScale();
#ifdef __CUDA_ARCH__
    *arch = __CUDA_ARCH__;  // the code that ran (compute_80 PTX on an sm_90 part: 800)
#endif
  }
}

TEST(GpuPageReader, Fp8KeyReadersDecodeEveryCode) {
  FP4KV_SKIP_WITHOUT_GPU();
  std::vector<uint8_t> codes(256);
  for (int i = 0; i < 256; ++i) codes[i] = static_cast<uint8_t>((i * 77 + 5) % 256);  // a permutation
  testing::DeviceBuffer row(256), words(128 * 4), loaded(256 * 4), scale(4), arch(4);
  ASSERT_TRUE(row.ok() && words.ok() && loaded.ok() && scale.ok() && arch.ok());
  ASSERT_TRUE(row.Upload(codes));
  ASSERT_TRUE(words.Fill(testing::kPoison) && loaded.Fill(testing::kPoison) &&
              arch.Fill(testing::kPoison));
  Fp8KeyReaderKernel<<<1, 64>>>(static_cast<const uint8_t*>(row.get()),
                                static_cast<uint32_t*>(words.get()),
                                static_cast<float*>(loaded.get()), static_cast<float*>(scale.get()),
                                static_cast<int*>(arch.get()));
  FP4KV_ASSERT_CUDA(cudaGetLastError());
  FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<uint32_t> w = words.DownloadAs<uint32_t>(128);
  const std::vector<float> l = loaded.DownloadAs<float>(256);
  const std::vector<float> hs = scale.DownloadAs<float>(1);
  ASSERT_EQ(w.size(), 128u);
  ASSERT_EQ(l.size(), 256u);
  ASSERT_EQ(hs.size(), 1u);
  // The readers' path is chosen when the code is compiled, not by the device:
  // the compute_80 PTX build runs the sm_80 path on any newer GPU.
  const std::vector<int> ran = arch.DownloadAs<int>(1);
  ASSERT_EQ(ran.size(), 1u);
  ASSERT_GE(ran[0], 800) << "the kernel did not report its architecture";
  const bool hw = ran[0] >= 890;
  EXPECT_EQ(hs[0], hw ? 1.0f : 256.0f);
  for (int i = 0; i < 256; ++i) {
    const uint8_t code = codes[i];
    // Value i of the row: word i / 4, register {v0, v1} or {v2, v3}.
    const uint32_t reg = w[2 * (i / 4) + (i % 4) / 2];
    const uint16_t bits = static_cast<uint16_t>(i % 2 ? reg >> 16 : reg & 0xffffu);
    const double from_word = static_cast<double>(HalfBitsToFloat(bits)) * hs[0];
    const float want = E4m3Decode(code);
    if ((code & 0x7f) == 0x7f) {  // NaN: NaN on sm_89+, +-480 by bit placement on sm_80
      EXPECT_TRUE(std::isnan(l[i])) << "code 0x" << std::hex << int{code};
      if (hw) {
        EXPECT_TRUE(std::isnan(from_word)) << "code 0x" << std::hex << int{code};
      } else {
        EXPECT_EQ(from_word, code & 0x80 ? -480.0 : 480.0) << "code 0x" << std::hex << int{code};
      }
      continue;
    }
    EXPECT_EQ(from_word, static_cast<double>(want)) << "code 0x" << std::hex << int{code};
    EXPECT_EQ(l[i], want) << "code 0x" << std::hex << int{code};
    EXPECT_EQ(std::signbit(from_word), std::signbit(want)) << "code 0x" << std::hex << int{code};
  }
}

}  // namespace
}  // namespace fp4kv
