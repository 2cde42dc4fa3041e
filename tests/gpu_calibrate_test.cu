// Calibrator on the GPU: device amax and global scale bit-identical with the
// CPU path on random data (NaN, negatives, -0, inf), on strided views, and
// under CUDA graph capture with the data rewritten between replays.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "fp4kv/calibrate.h"
#include "fp4kv/format.h"
#include "fp4kv/recipe.h"
#include "gtest/gtest.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace {

using testing::DeviceBuffer;
using testing::OnDevice;

constexpr uint8_t kPoisonByte = 0xA5;  // 0xA5A5A5A5 is a negative float, never an amax

// Random raw elements of `dtype` (2 or 4 bytes each) times `scale`, with NaNs
// of both signs, -0, negatives, and (f32 only) some -inf when `with_inf`.
std::vector<uint8_t> RandomElements(DType dtype, int64_t n, uint64_t seed, float scale,
                                    bool with_inf) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> special(0, 199);
  std::vector<uint8_t> out(n * DTypeSize(dtype));
  if (dtype == DType::kF32) {
    std::normal_distribution<float> normal(0.0f, scale);
    for (int64_t i = 0; i < n; ++i) {
      float x = normal(rng);
      const int s = special(rng);
      if (s == 0) x = std::nanf("");
      if (s == 1) x = -std::nanf("");
      if (s == 2) x = -0.0f;
      if (s == 3 && with_inf) x = -INFINITY;
      std::memcpy(&out[i * 4], &x, 4);
    }
  } else {
    std::vector<uint16_t> h = testing::RandomHalfBits(dtype, n, seed);
    for (int64_t i = 0; i < n; ++i) {
      if (scale != 1.0f) {
        const float x = dtype == DType::kF16 ? HalfBitsToFloat(h[i]) : Bf16BitsToFloat(h[i]);
        h[i] = dtype == DType::kF16 ? FloatToHalfBits(x * scale) : FloatToBf16Bits(x * scale);
      }
      const int s = special(rng);
      if (s == 0) h[i] = 0x7fff;
      if (s == 1) h[i] = dtype == DType::kF16 ? 0xfe01 : 0xffc1;  // -NaN
      if (s == 2) h[i] = 0x8000;
    }
    std::memcpy(out.data(), h.data(), out.size());
  }
  return out;
}

struct Result {
  uint32_t amax_bits = 0;
  uint32_t scale_bits = 0;
};

Result CpuResult(const TensorView& host_view, const Recipe& recipe) {
  absl::StatusOr<Calibrator> c =
      Calibrator::Create({host_view.numel(), host_view.dtype, Device::Cpu(), recipe});
  EXPECT_TRUE(c.ok()) << c.status();
  float amax = 0.0f, g = 0.0f;
  const absl::Status s = c->Run(host_view, &amax, &g);
  EXPECT_TRUE(s.ok()) << s;
  return {FloatBits(amax), FloatBits(g)};
}

// Device outputs: [amax, global_scale].
Result Download(const DeviceBuffer& out) {
  std::vector<float> v = out.DownloadAs<float>(2);
  EXPECT_EQ(v.size(), 2u);
  if (v.size() != 2) return {};
  return {FloatBits(v[0]), FloatBits(v[1])};
}

TEST(GpuCalibrator, MatchesCpuOnRandomData) {
  FP4KV_SKIP_WITHOUT_GPU();
  int round = 0;
  for (DType dtype : {DType::kF16, DType::kBF16, DType::kF32}) {
    for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{4099}, int64_t{(1 << 20) + 7}}) {
      for (const Recipe& recipe : {Recipe::Standard(), Recipe::FourOverSix(256)}) {
        ++round;
        const std::vector<uint8_t> host =
            RandomElements(dtype, n, 100 + round, 3.0f, /*with_inf=*/round % 3 == 0);
        const TensorView hv = TensorView::Contiguous(host.data(), dtype, {n});
        const Result want = CpuResult(hv, recipe);

        // A calibrator sized larger than this input, to check scratch reuse.
        absl::StatusOr<Calibrator> c =
            Calibrator::Create({2 * n + 5, dtype, Device::Cuda(0), recipe});
        ASSERT_TRUE(c.ok()) << c.status();
        DeviceBuffer in(host.size());
        DeviceBuffer out(2 * sizeof(float));
        ASSERT_TRUE(in.ok() && out.ok());
        ASSERT_TRUE(in.Upload(host));
        ASSERT_TRUE(out.Fill(kPoisonByte));
        float* d_out = static_cast<float*>(out.get());
        const absl::Status s = c->Run(OnDevice(hv, in.get()), d_out, d_out + 1);
        ASSERT_TRUE(s.ok()) << s;
        FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
        const Result got = Download(out);
        EXPECT_EQ(got.amax_bits, want.amax_bits) << DTypeName(dtype) << " n=" << n;
        EXPECT_EQ(got.scale_bits, want.scale_bits) << DTypeName(dtype) << " n=" << n;
      }
    }
  }
}

// RunFp8Key on the device: the same reduction as Run, then the FP8 key
// finalization; amax, g_k and the FP8 scale bit-identical with the CPU path.
TEST(GpuCalibrator, RunFp8KeyMatchesCpu) {
  FP4KV_SKIP_WITHOUT_GPU();
  int round = 0;
  for (DType dtype : {DType::kF16, DType::kBF16, DType::kF32}) {
    for (int64_t n : {int64_t{0}, int64_t{15}, int64_t{(1 << 18) + 3}}) {
      ++round;
      const std::vector<uint8_t> host =
          RandomElements(dtype, n, 300 + round, 2.0f, /*with_inf=*/false);
      const TensorView hv = TensorView::Contiguous(
          n > 0 ? static_cast<const void*>(host.data()) : nullptr, dtype, {n});
      absl::StatusOr<Calibrator> cpu =
          Calibrator::Create({n, dtype, Device::Cpu(), Recipe::FourOverSix(256)});
      ASSERT_TRUE(cpu.ok()) << cpu.status();
      float want[3] = {0.0f, 0.0f, 0.0f};
      ASSERT_TRUE(cpu->RunFp8Key(hv, &want[0], &want[1], nullptr, &want[2]).ok());
      EXPECT_EQ(want[1], MakeFp8KeyScale(want[0]));
      absl::StatusOr<Calibrator> c =
          Calibrator::Create({n + 1, dtype, Device::Cuda(0), Recipe::FourOverSix(256)});
      ASSERT_TRUE(c.ok()) << c.status();
      DeviceBuffer in(host.size() + 16);
      DeviceBuffer out(3 * sizeof(float));
      ASSERT_TRUE(in.ok() && out.ok());
      if (n > 0) {
        ASSERT_TRUE(in.Upload(host));
      }
      ASSERT_TRUE(out.Fill(kPoisonByte));
      float* d_out = static_cast<float*>(out.get());
      const absl::Status s =
          c->RunFp8Key(OnDevice(hv, in.get()), d_out, d_out + 1, nullptr, d_out + 2);
      ASSERT_TRUE(s.ok()) << s;
      FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
      const std::vector<float> got = out.DownloadAs<float>(3);
      ASSERT_EQ(got.size(), 3u);
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(FloatBits(got[i]), FloatBits(want[i]))
            << DTypeName(dtype) << " n=" << n << " output " << i;
      }
    }
  }
}

TEST(GpuCalibrator, StridedViewEmptyViewAndNoAmaxPointer) {
  FP4KV_SKIP_WITHOUT_GPU();
  // [2 (K/V), rows, heads, dim + pad] bf16; calibrate the K half without padding.
  const int64_t rows = 37, heads = 5, dim = 64, pad = 16;
  const int64_t total = 2 * rows * heads * (dim + pad);
  std::vector<uint8_t> host = RandomElements(DType::kBF16, total, 7, 1.0f, false);
  // Make the excluded part (V half and padding) hold the largest values.
  uint16_t* h = reinterpret_cast<uint16_t*>(host.data());
  for (int64_t i = 0; i < total; ++i) {
    const int64_t col = i % (dim + pad);
    if (i >= total / 2 || col >= dim) h[i] = FloatToBf16Bits(-1.0e6f);
  }
  const TensorView hk = TensorView::Strided(host.data(), DType::kBF16, {rows, heads, dim},
                                            {heads * (dim + pad), dim + pad, 1});
  const Recipe recipe = Recipe::FourOverSix(448, ErrorMetric::kMse, true);
  const Result want = CpuResult(hk, recipe);
  ASSERT_LT(BitsFloat(want.amax_bits), 1.0e6f);

  absl::StatusOr<Calibrator> c = Calibrator::Create({total, DType::kBF16, Device::Cuda(0), recipe});
  ASSERT_TRUE(c.ok()) << c.status();
  DeviceBuffer in(host.size());
  DeviceBuffer out(2 * sizeof(float));
  ASSERT_TRUE(in.ok() && out.ok() && in.Upload(host) && out.Fill(kPoisonByte));
  float* d_out = static_cast<float*>(out.get());
  ASSERT_TRUE(c->Run(OnDevice(hk, in.get()), d_out, d_out + 1).ok());
  FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  Result got = Download(out);
  EXPECT_EQ(got.amax_bits, want.amax_bits);
  EXPECT_EQ(got.scale_bits, want.scale_bits);

  // Transposed (non-collapsible) view of the same elements: same result.
  const TensorView ht = TensorView::Strided(host.data(), DType::kBF16, {heads, dim, rows},
                                            {dim + pad, 1, heads * (dim + pad)});
  ASSERT_TRUE(out.Fill(kPoisonByte));
  ASSERT_TRUE(c->Run(OnDevice(ht, in.get()), d_out, d_out + 1).ok());
  FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  got = Download(out);
  EXPECT_EQ(got.amax_bits, want.amax_bits);
  EXPECT_EQ(got.scale_bits, want.scale_bits);

  // amax omitted: only the global scale is written.
  ASSERT_TRUE(out.Fill(kPoisonByte));
  ASSERT_TRUE(c->Run(OnDevice(hk, in.get()), nullptr, d_out + 1).ok());
  FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  got = Download(out);
  EXPECT_EQ(got.amax_bits, 0xA5A5A5A5u);
  EXPECT_EQ(got.scale_bits, want.scale_bits);

  // Empty view: amax 0, global scale as for amax 1.
  ASSERT_TRUE(out.Fill(kPoisonByte));
  const TensorView empty =
      TensorView::Contiguous(static_cast<void*>(nullptr), DType::kBF16, {0, 64}, Device::Cuda(0));
  ASSERT_TRUE(c->Run(empty, d_out, d_out + 1).ok());
  FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  got = Download(out);
  EXPECT_EQ(got.amax_bits, 0u);
  EXPECT_EQ(got.scale_bits, FloatBits(MakeGlobalScale(0.0f, recipe)));
}

TEST(GpuCalibrator, InvalidRunEnqueuesNothing) {
  FP4KV_SKIP_WITHOUT_GPU();
  absl::StatusOr<Calibrator> c = Calibrator::Create({100, DType::kF16, Device::Cuda(0), Recipe()});
  ASSERT_TRUE(c.ok()) << c.status();
  DeviceBuffer in(200 * 2);
  DeviceBuffer out(2 * sizeof(float));
  ASSERT_TRUE(in.ok() && out.ok() && in.Fill(0x3c) && out.Fill(kPoisonByte));
  float* d_out = static_cast<float*>(out.get());
  const TensorView too_big = TensorView::Contiguous(in.get(), DType::kF16, {200}, Device::Cuda(0));
  EXPECT_EQ(c->Run(too_big, d_out, d_out + 1).code(), absl::StatusCode::kInvalidArgument);
  const TensorView wrong_dtype =
      TensorView::Contiguous(in.get(), DType::kBF16, {100}, Device::Cuda(0));
  EXPECT_EQ(c->Run(wrong_dtype, d_out, d_out + 1).code(), absl::StatusCode::kInvalidArgument);
  const TensorView on_cpu = TensorView::Contiguous(in.get(), DType::kF16, {100});
  EXPECT_EQ(c->Run(on_cpu, d_out, d_out + 1).code(), absl::StatusCode::kInvalidArgument);
  FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  const Result got = Download(out);
  EXPECT_EQ(got.amax_bits, 0xA5A5A5A5u);
  EXPECT_EQ(got.scale_bits, 0xA5A5A5A5u);
}

// Capture one Run() into a graph, then rewrite the input memory and replay:
// every replay calibrates from the data present at replay time.
TEST(GpuCalibrator, GraphReplayRecalibratesFromNewData) {
  FP4KV_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    const int64_t n = 3 * 8 * 128 + 16;
    const Recipe recipe = Recipe::FourOverSix(256, ErrorMetric::kMae);
    absl::StatusOr<Calibrator> c = Calibrator::Create({n, dtype, Device::Cuda(0), recipe});
    ASSERT_TRUE(c.ok()) << c.status();
    DeviceBuffer in(n * DTypeSize(dtype));
    DeviceBuffer out(2 * sizeof(float));
    ASSERT_TRUE(in.ok() && out.ok());
    float* d_out = static_cast<float*>(out.get());
    const TensorView flat = TensorView::Contiguous(in.get(), dtype, {n}, Device::Cuda(0));

    cudaStream_t stream;
    FP4KV_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // One eager run first (as a server does before capturing).
    std::vector<uint8_t> host = RandomElements(dtype, n, 1, 1.0f, false);
    ASSERT_TRUE(in.Upload(host));
    ASSERT_TRUE(c->Run(flat, d_out, d_out + 1, stream).ok());
    FP4KV_ASSERT_CUDA(cudaStreamSynchronize(stream));

    cudaGraph_t graph;
    FP4KV_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const absl::Status captured = c->Run(flat, d_out, d_out + 1, stream);
    FP4KV_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
    ASSERT_TRUE(captured.ok()) << captured;
    cudaGraphExec_t exec;
    FP4KV_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));

    uint32_t previous_amax = 0;
    for (int replay = 0; replay < 4; ++replay) {
      // New data of a different magnitude each time.
      const float scale = std::ldexp(1.0f, 3 * replay - 4);
      host = RandomElements(dtype, n, 50 + replay, scale, false);
      ASSERT_TRUE(in.Upload(host));
      ASSERT_TRUE(out.Fill(kPoisonByte));
      FP4KV_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
      FP4KV_ASSERT_CUDA(cudaStreamSynchronize(stream));
      const Result want = CpuResult(TensorView::Contiguous(host.data(), dtype, {n}), recipe);
      const Result got = Download(out);
      EXPECT_EQ(got.amax_bits, want.amax_bits) << "replay " << replay;
      EXPECT_EQ(got.scale_bits, want.scale_bits) << "replay " << replay;
      EXPECT_NE(want.amax_bits, previous_amax);  // the replays really see new data
      previous_amax = want.amax_bits;
    }
    FP4KV_ASSERT_CUDA(cudaGraphExecDestroy(exec));
    FP4KV_ASSERT_CUDA(cudaGraphDestroy(graph));
    FP4KV_ASSERT_CUDA(cudaStreamDestroy(stream));
  }
}

}  // namespace
}  // namespace fp4kv
