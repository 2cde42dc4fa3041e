// Quantize-append on the GPU against the CPU reference: every case of the
// shared sweep eagerly and as a replayed CUDA graph (testing/gpu_harness.h).
#include <cuda_runtime.h>

#include "fp4kv/ops.h"
#include "gtest/gtest.h"
#include "src/params.h"
#include "testing/gpu_harness.h"
#include "testing/kernel_cases.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

// Lets its dependents launch at once (sm_90+), spins for about `cycles`
// clock cycles, then writes the append's inputs: an append that read them
// before this grid completed would quantize the poison left there.
__global__ void LateWriterKernel(const uint8_t* src, uint8_t* dst, size_t n, long long cycles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

class GpuAppendTest : public ::testing::TestWithParam<testing::AppendSpec> {};

TEST_P(GpuAppendTest, MatchesCpuEagerAndInGraphs) {
  FP4KV_SKIP_WITHOUT_GPU();
  testing::AppendCase c = testing::MakeAppendCase(GetParam(), 42);
  auto cpu_op = Appender::Create(c.Options(Device::Cpu()));
  auto gpu_op = Appender::Create(c.Options(Device::Cuda(0)));
  ASSERT_TRUE(cpu_op.ok()) << cpu_op.status();
  ASSERT_TRUE(gpu_op.ok()) << gpu_op.status();
  testing::ExpectGpuMatchesCpu(
      c,
      [&](uint8_t* in, uint8_t* out, Device d, Stream s) {
        const Appender& op = d.is_cuda() ? *gpu_op : *cpu_op;
        return op.Run(c.Args(in, d, out), c.Cache(out, d), s);
      },
      GetParam().Name());
}

INSTANTIATE_TEST_SUITE_P(Sweep, GpuAppendTest, ::testing::ValuesIn(testing::AppendSweep()),
                         [](const auto& info) { return info.param.Name(); });

// An append right behind a kernel that writes its inputs late, and lets
// dependents launch early: launched as a programmatic dependent where the
// device allows it (AppendParams::overlap_launch), the append must still
// wait for that kernel's writes. Eagerly and as a replayed graph of both.
TEST(GpuAppendOrdering, ReadsWhatTheKernelBeforeItWrote) {
  FP4KV_SKIP_WITHOUT_GPU();
  testing::AppendSpec spec;  // NVFP4 keys, blocks in pairs
  testing::AppendCase c = testing::MakeAppendCase(spec, 77);
  auto cpu_op = Appender::Create(c.Options(Device::Cpu()));
  auto gpu_op = Appender::Create(c.Options(Device::Cuda(0)));
  ASSERT_TRUE(cpu_op.ok()) << cpu_op.status();
  ASSERT_TRUE(gpu_op.ok()) << gpu_op.status();
  bool overlap = false;
  ASSERT_TRUE(internal::AppendOverlapsLaunch(&overlap).ok());
  EXPECT_EQ(internal::AppendAccess::OverlapLaunch(*gpu_op), overlap);
  ::testing::Test::RecordProperty("overlap_launch", overlap ? 1 : 0);

  testing::DeviceBuffer src(c.in.size()), din(c.in.size()), dout(c.out.size());
  ASSERT_TRUE(src.ok() && din.ok() && dout.ok());
  uint8_t* in_dev = static_cast<uint8_t*>(din.get());
  uint8_t* out_dev = static_cast<uint8_t*>(dout.get());
  cudaStream_t stream = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto enqueue = [&]() -> absl::Status {
    LateWriterKernel<<<8, 256, 0, stream>>>(static_cast<const uint8_t*>(src.get()), in_dev,
                                            c.in.size(), 2000000);  // about 1 ms
    if (cudaGetLastError() != cudaSuccess) return absl::InternalError("LateWriterKernel launch");
    const Device d = Device::Cuda(0);
    return gpu_op->Run(c.Args(in_dev, d, out_dev), c.Cache(out_dev, d),
                       reinterpret_cast<Stream>(stream));
  };
  auto check = [&](const char* what) {
    std::vector<uint8_t> in = c.in, want = c.out;
    const absl::Status st = cpu_op->Run(c.Args(in.data(), Device::Cpu(), want.data()),
                                        c.Cache(want.data(), Device::Cpu()));
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_NE(want, c.out) << "the case wrote nothing";
    const std::vector<uint8_t> got = dout.DownloadAs<uint8_t>(c.out.size());
    ASSERT_EQ(testing::FirstDifference(want, got), "") << what;
  };
  auto prepare = [&]() {
    ASSERT_TRUE(src.Upload(c.in));
    ASSERT_TRUE(din.Fill(0xff));  // NaN rows, out-of-range indices
    ASSERT_TRUE(dout.Upload(c.out));
    FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  };

  prepare();
  ASSERT_TRUE(enqueue().ok());
  FP4KV_ASSERT_CUDA(cudaStreamSynchronize(stream));
  check("eager");

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  FP4KV_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status captured = enqueue();
  FP4KV_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(captured.ok()) << captured;
  FP4KV_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 2; ++round) {
    c.Rewrite(500 + round);
    prepare();
    FP4KV_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    FP4KV_ASSERT_CUDA(cudaStreamSynchronize(stream));
    check(round == 0 ? "graph replay 0" : "graph replay 1");
  }
  FP4KV_ASSERT_CUDA(cudaGraphExecDestroy(exec));
  FP4KV_ASSERT_CUDA(cudaGraphDestroy(graph));
  FP4KV_ASSERT_CUDA(cudaStreamDestroy(stream));
}

// The functional API goes through the same objects; one case each.
TEST(GpuAppendFunctional, BySlotAndPagedMatchCpu) {
  FP4KV_SKIP_WITHOUT_GPU();
  for (AppendIndexing indexing : {AppendIndexing::kSlot, AppendIndexing::kPaged}) {
    testing::AppendSpec spec;
    spec.indexing = indexing;
    spec.recipe = Recipe::FourOverSix();
    testing::AppendCase c = testing::MakeAppendCase(spec, 3);
    testing::ExpectGpuMatchesCpu(
        c,
        [&](uint8_t* in, uint8_t* out, Device d, Stream s) {
          const AppendArgs a = c.Args(in, d);
          if (indexing == AppendIndexing::kSlot) {
            return QuantizeAppendBySlot(a.key, a.value, a.slot_mapping, c.Cache(out, d), a.k_scale,
                                        a.v_scale, spec.recipe, s);
          }
          return QuantizeAppendPaged(a.key, a.value, a.batch_indices, a.positions, c.Cache(out, d),
                                     a.kv_indices, a.kv_indptr, a.kv_last_page_len, a.k_scale,
                                     a.v_scale, spec.recipe, s);
        },
        spec.Name());
  }
}

}  // namespace
}  // namespace fp4kv
