// The kernels' fast formulations as compiled for the device (real FFMA,
// FMNMX, prmt, max.u16x2, cvt and f16x2 instructions) against the format.h
// definitions evaluated on the device, over every 32-bit input pattern.
// fast_format_test.cc proves the same formulas on the host; this checks that
// the device instructions behave as the host emulations assume.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>

#include "fp4kv/format.h"
#include "gtest/gtest.h"
#include "kernels/device_util.cuh"
#include "kernels/fast_format.cuh"
#include "testing/test_util.h"

namespace fp4kv {
namespace kernels {
namespace {

enum Check : int {
  kE2m1Encode,
  kE2m1Round,
  kE2m1Code,
  kE4m3Encode,
  kPackBf16,
  kPackF16,
  kUnpackF16,
  kHalfSub,
  kHalfAdd,
  kHalfMul,
  kMaxU16,
  kPrmt,
  kE4m3Encode2,
  kNumChecks
};
const char* const kNames[] = {"FastE2m1Encode",  "E2m1RoundMagnitude",
                              "E2m1CodeOfValue", "FastE4m3EncodeNonNeg",
                              "Pack2<bf16>",     "Pack2<f16>",
                              "Unpack2<f16>",    "H2Sub",
                              "H2Add",           "H2Mul",
                              "MaxU16x2",        "Prmt",
                              "E4m3Encode2"};

// Reference f16 op result: RoundToHalf of the fp32 op (the reference's own
// emulation); NaN results only need to be NaN.
__device__ bool HalfOpMatches(uint32_t got, float want) {
  const uint16_t g = static_cast<uint16_t>(got);
  const uint16_t w = FloatToHalfBits(want);
  const bool g_nan = (g & 0x7fffu) > 0x7c00u, w_nan = (w & 0x7fffu) > 0x7c00u;
  return g_nan || w_nan ? g_nan == w_nan : g == w;
}

// Checks patterns k * step for k < 2^32 / step (step 1: every pattern).
__global__ void CheckEveryPattern(unsigned long long* bad, unsigned int* first, uint32_t step) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  const uint64_t count = ((uint64_t{1} << 32) + step - 1) / step;
  for (uint64_t k = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; k < count; k += stride) {
    const uint32_t u = static_cast<uint32_t>(k * step);
    const float y = BitsFloat(u);
    bool fail[kNumChecks] = {};
    const uint8_t ref = E2m1Encode(y);
    fail[kE2m1Encode] = FastE2m1Encode(y) != ref;
    if ((u >> 31) == 0 && u <= 0x7f800000u) {
      const float r = E2m1RoundMagnitude(y);
      fail[kE2m1Round] = FloatBits(r) != FloatBits(E2m1Decode(ref));
      fail[kE2m1Code] = E2m1CodeOfValue(r) != ref;
      fail[kE4m3Encode] = FastE4m3EncodeNonNeg(y) != E4m3Encode(y);
    }
    if ((u & 0x7fffffffu) <= 0x7f800000u) {  // not NaN: the hardware conversions
      fail[kPackBf16] = (Pack2<true>(y, 1.0f) & 0xffffu) != FloatToBf16Bits(y);
      fail[kPackF16] = (Pack2<false>(y, 1.0f) & 0xffffu) != FloatToHalfBits(y);
    }
    // The pattern as two halves a (low) and b (high).
    const uint32_t a = u & 0xffffu, b = u >> 16;
    if ((a & 0x7fffu) <= 0x7c00u) {
      float lo, hi;
      Unpack2<false>(u, &lo, &hi);
      fail[kUnpackF16] = FloatBits(lo) != FloatBits(HalfBitsToFloat(static_cast<uint16_t>(a)));
    }
    const float fa = HalfBitsToFloat(static_cast<uint16_t>(a));
    const float fb = HalfBitsToFloat(static_cast<uint16_t>(b));
    fail[kHalfSub] = !HalfOpMatches(H2Sub(a, b), SubRn(fa, fb));
    fail[kHalfAdd] = !HalfOpMatches(H2Add(a, b), AddRn(fa, fb));
    fail[kHalfMul] = !HalfOpMatches(H2Mul(a, b), MulRn(fa, fb));
    {
      const uint32_t m = MaxU16x2(u, 0x80017fffu);
      const uint32_t lo = a > 0x7fffu ? a : 0x7fffu, hi = b > 0x8001u ? b : 0x8001u;
      fail[kMaxU16] = m != (lo | (hi << 16));
    }
    {
      // prmt against the documented selection, sign replication included.
      const uint32_t x = u * 2654435761u, sel = u & 0xffffu;
      const uint32_t p = Prmt(u, x, sel);
      uint32_t want = 0;
      for (int n = 0; n < 4; ++n) {
        const uint32_t nib = (sel >> (4 * n)) & 0xfu;
        const uint32_t idx = nib & 7u;
        uint32_t byte = ((idx < 4 ? u : x) >> (8 * (idx & 3u))) & 0xffu;
        if (nib & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;
        want |= byte << (8 * n);
      }
      fail[kPrmt] = p != want;
    }
    {
      // Every pattern in both halves: on sm_89+ the cvt.rn.satfinite.e4m3x2
      // instruction, NaN of either sign included.
      const uint32_t want = E4m3Encode(y);
      fail[kE4m3Encode2] = E4m3Encode2(y, 1.0f) != (want | 0x3800u) ||
                           E4m3Encode2(-2.0f, y) != (0xc0u | (want << 8));
    }
    for (int k = 0; k < kNumChecks; ++k) {
      if (fail[k]) {
        atomicAdd(&bad[k], 1ull);
        atomicMin(&first[k], u);
      }
    }
  }
}

TEST(GpuFastFormat, DeviceInstructionsMatchFormatOverEveryPattern) {
  FP4KV_SKIP_WITHOUT_GPU();
  testing::DeviceBuffer bad(kNumChecks * sizeof(unsigned long long));
  testing::DeviceBuffer first(kNumChecks * sizeof(unsigned int));
  ASSERT_TRUE(bad.ok() && first.ok());
  ASSERT_TRUE(bad.Fill(0));
  ASSERT_TRUE(first.Fill(0xff));
  // FP4KV_PATTERN_STEP=n checks every n-th pattern only (gpu_check.sh sets it
  // under compute-sanitizer, which slows this kernel down a lot).
  const char* env = std::getenv("FP4KV_PATTERN_STEP");
  const uint32_t step =
      env != nullptr && std::atoi(env) > 0 ? static_cast<uint32_t>(std::atoi(env)) : 1;
  CheckEveryPattern<<<132 * 16, 256>>>(static_cast<unsigned long long*>(bad.get()),
                                       static_cast<unsigned int*>(first.get()), step);
  FP4KV_ASSERT_CUDA(cudaGetLastError());
  FP4KV_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto counts = bad.DownloadAs<unsigned long long>(kNumChecks);
  const auto firsts = first.DownloadAs<unsigned int>(kNumChecks);
  ASSERT_EQ(counts.size(), static_cast<size_t>(kNumChecks));
  for (int k = 0; k < kNumChecks; ++k) {
    EXPECT_EQ(counts[k], 0u) << kNames[k] << ": first mismatch at pattern 0x" << std::hex
                             << firsts[k];
  }
}

}  // namespace
}  // namespace kernels
}  // namespace fp4kv
