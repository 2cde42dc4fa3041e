// Decode attention on the GPU against the fp64 CPU reference: eagerly on
// the default stream, then captured once in a CUDA graph and replayed after
// Rewrite() changed lengths, tables, padding rows, data and pointer scales in
// place (same addresses). Outputs are poisoned before every run;
// CompareAttentionOutputs checks per-(row, head) relative L2 error against
// the reference's unrounded fp64 outputs, lse, and that every byte the
// contract leaves alone is still poison. NVFP4 and FP8 E4M3 keys alike.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fp4kv/attention.h"
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
Want Reference(const AttentionCase& c) {
  Want w;
  w.blob = testing::ReferenceAttentionOutputs(c, &w.exact);
  return w;
}

std::string Compare(const AttentionCase& c, const std::vector<uint8_t>& got) {
  const Want w = Reference(c);
  return testing::CompareAttentionOutputs(c, w.blob, got, RelTol(c.spec), kLseTol, &w.exact);
}

void ExpectGpuMatchesReference(AttentionCase& c, const std::string& name) {
  const Device cuda = Device::Cuda(0);
  auto op = DecodeAttention::Create(c.Options(cuda));
  ASSERT_TRUE(op.ok()) << name << ": " << op.status();
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

}  // namespace
}  // namespace fp4kv
