// Runs one op of a test case on the GPU and compares with the CPU reference:
// once eagerly on the default stream, then captured in a CUDA graph on a
// non-default stream and replayed twice after the case's data and metadata
// were rewritten in place (same device addresses, new contents). Outputs are
// poisoned with cudaMemset before every run.
#ifndef FP4KV_TESTS_TESTING_GPU_HARNESS_H_
#define FP4KV_TESTS_TESTING_GPU_HARNESS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "testing/kernel_cases.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace testing {

// run(in_base, out_base, stream): the op on views at those bases (device
// views for the GPU, host views for the CPU; the stream is ignored there).
using CaseRun =
    std::function<absl::Status(uint8_t* in, uint8_t* out, Device device, Stream stream)>;

template <typename Case>
void ExpectGpuMatchesCpu(Case& c, const CaseRun& run, const std::string& name) {
  auto reference = [&]() {
    std::vector<uint8_t> in = c.in, out = c.out;
    const absl::Status s = run(in.data(), out.data(), Device::Cpu(), nullptr);
    EXPECT_TRUE(s.ok()) << name << ": CPU run: " << s;
    return out;
  };
  DeviceBuffer din(c.in.size()), dout(c.out.size());
  ASSERT_TRUE(din.ok() && dout.ok()) << name << ": cudaMalloc";
  uint8_t* in_dev = static_cast<uint8_t*>(din.get());
  uint8_t* out_dev = static_cast<uint8_t*>(dout.get());
  const Device cuda = Device::Cuda(0);

  // Eager run on the default stream.
  ASSERT_TRUE(din.Upload(c.in));
  ASSERT_TRUE(dout.Fill(kPoison));
  FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  {
    const absl::Status s = run(in_dev, out_dev, cuda, nullptr);
    ASSERT_TRUE(s.ok()) << name << ": " << s;
  }
  FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> got = dout.DownloadAs<uint8_t>(c.out.size());
  ASSERT_EQ(got.size(), c.out.size());
  const std::vector<uint8_t> want = reference();
  ASSERT_EQ(FirstDifference(want, got), "") << name << " (eager)";
  ASSERT_NE(want, c.out) << name << ": the case wrote nothing";

  // Captured once, replayed after rewriting the inputs in place.
  cudaStream_t stream = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status captured = run(in_dev, out_dev, cuda, stream);
  FP4KV_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(captured.ok()) << name << " (capture): " << captured;
  FP4KV_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 2; ++round) {
    c.Rewrite(1000 + round);
    ASSERT_TRUE(din.Upload(c.in));
    ASSERT_TRUE(dout.Fill(kPoison));
    FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
    FP4KV_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    FP4KV_ASSERT_CUDA(cudaStreamSynchronize(stream));
    got = dout.DownloadAs<uint8_t>(c.out.size());
    ASSERT_EQ(FirstDifference(reference(), got), "") << name << " (graph replay " << round << ")";
  }
  FP4KV_ASSERT_CUDA(cudaGraphExecDestroy(exec));
  FP4KV_ASSERT_CUDA(cudaGraphDestroy(graph));
  FP4KV_ASSERT_CUDA(cudaStreamDestroy(stream));
}

}  // namespace testing
}  // namespace fp4kv

#endif  // FP4KV_TESTS_TESTING_GPU_HARNESS_H_
