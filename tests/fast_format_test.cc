// The kernels' fast formulations (kernels/fast_format.cuh) against format.h:
// scalar encoders over every input bit pattern, block functions on random
// and special blocks, and the host emulations of the device helpers.
#include "kernels/fast_format.cuh"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fp4kv/format.h"
#include "gtest/gtest.h"
#include "kernels/device_util.cuh"
#include "testing/test_util.h"

namespace fp4kv {
namespace kernels {
namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr uint64_t kStride = 61;  // sanitizer builds: a strided subset
#else
constexpr uint64_t kStride = 1;
#endif

// Every 32-bit pattern u (every kStride-th one under sanitizers, plus all
// patterns near the interesting boundaries): FastE2m1Encode == E2m1Encode;
// for u >= 0 not NaN also E2m1RoundMagnitude, E2m1CodeOfValue and
// FastE4m3EncodeNonNeg against their format.h definitions.
TEST(FastFormat, ScalarEncodersOverEveryFloat) {
  const int kThreads = std::max(2u, std::thread::hardware_concurrency());
  constexpr uint64_t kTotal = uint64_t{1} << 32;
  std::atomic<uint64_t> bad_e2m1{0}, bad_round{0}, bad_code{0}, bad_e4m3{0};
  std::atomic<uint64_t> first_bad{kTotal};
  auto work = [&](uint64_t begin, uint64_t end) {
    uint64_t be = 0, br = 0, bc = 0, b4 = 0;
    for (uint64_t v = begin; v < end; v += kStride) {
      const uint32_t u = static_cast<uint32_t>(v);
      const float y = BitsFloat(u);
      const uint8_t ref = E2m1Encode(y);
      bool bad = false;
      if (FastE2m1Encode(y) != ref) {
        ++be;
        bad = true;
      }
      if ((u >> 31) == 0 && u <= 0x7f800000u) {
        const float r = E2m1RoundMagnitude(y);
        if (FloatBits(r) != FloatBits(E2m1Decode(ref))) {
          ++br;
          bad = true;
        }
        if (E2m1CodeOfValue(r) != ref) {
          ++bc;
          bad = true;
        }
        if (FastE4m3EncodeNonNeg(y) != E4m3Encode(y)) {
          ++b4;
          bad = true;
        }
      }
      if (bad) {
        uint64_t cur = first_bad.load();
        while (v < cur && !first_bad.compare_exchange_weak(cur, v)) {
        }
      }
    }
    bad_e2m1 += be;
    bad_round += br;
    bad_code += bc;
    bad_e4m3 += b4;
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back(work, kTotal / kThreads * t, kTotal / kThreads * (t + 1));
  }
  for (auto& t : threads) t.join();
  if (kStride != 1) {
    // Boundaries of both formats, their neighbours and the specials.
    const float points[] = {0.0f,         0.25f,         0.75f, 1.25f,  1.75f,  2.5f,
                            3.5f,         5.0f,          6.0f,  448.0f, 464.0f, 0.015625f,
                            0.001953125f, 0.0009765625f, 1.0f,  2.0f,   4.0f};
    for (float p : points) {
      for (int d = -4096; d <= 4096; ++d) {
        const uint32_t u = FloatBits(p) + static_cast<uint32_t>(d);
        work(u, uint64_t{u} + 1);
        work(u | 0x80000000u, uint64_t{u | 0x80000000u} + 1);
      }
    }
    for (uint32_t u : {0x7f800000u, 0x7f800001u, 0x7fc00000u, 0x7fffffffu, 0x00000001u}) {
      work(u, uint64_t{u} + 1);
      work(u | 0x80000000u, uint64_t{u | 0x80000000u} + 1);
    }
  }
  EXPECT_EQ(bad_e2m1.load(), 0u) << "first mismatch at 0x" << std::hex << first_bad.load();
  EXPECT_EQ(bad_round.load(), 0u) << "first mismatch at 0x" << std::hex << first_bad.load();
  EXPECT_EQ(bad_code.load(), 0u) << "first mismatch at 0x" << std::hex << first_bad.load();
  EXPECT_EQ(bad_e4m3.load(), 0u) << "first mismatch at 0x" << std::hex << first_bad.load();
}

TEST(FastFormat, DecodersMatchFormat) {
  for (uint32_t b = 0; b <= 0x7e; ++b) {
    EXPECT_EQ(FloatBits(FastE4m3DecodeNonNeg(b)), FloatBits(E4m3Decode(static_cast<uint8_t>(b))))
        << "byte " << b;
  }
  for (uint32_t c = 0; c < 16; ++c) {
    EXPECT_EQ(FloatBits(FastE2m1Decode(c)), FloatBits(E2m1Decode(static_cast<uint8_t>(c))))
        << "code " << c;
  }
}

// ---------------------------------------------------------------------------
// Device helper emulations
// ---------------------------------------------------------------------------
TEST(DeviceUtil, PrmtFollowsPtxDefaultMode) {
  const uint32_t a = 0x83828180u, b = 0x07060504u;  // bytes 0..7: 80 81 82 83 04 05 06 07
  EXPECT_EQ(Prmt(a, b, 0x3210u), a);
  EXPECT_EQ(Prmt(a, b, 0x7654u), b);
  EXPECT_EQ(Prmt(a, b, 0x4501u), 0x04058081u);
  // Bit 3 of a selector nibble replicates the selected byte's sign bit.
  EXPECT_EQ(Prmt(a, b, 0x8c08u), 0xff0080ffu);  // bytes ff 80 00 ff
  // Only the low 16 bits select.
  EXPECT_EQ(Prmt(a, b, 0xabcd3210u), a);
}

TEST(DeviceUtil, MaxU16x2) {
  EXPECT_EQ(MaxU16x2(0x00017fffu, 0x80000001u), 0x80007fffu);
  EXPECT_EQ(MaxU16x2(0xffff0000u, 0x0001ffffu), 0xffffffffu);
}

TEST(DeviceUtil, FastDivmodMatchesDivision) {
  std::mt19937_64 rng(7);
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 300; ++d) divisors.push_back(d);
  for (uint32_t d :
       {1000u, 1024u, 4095u, 65535u, 65536u, 1000003u, (1u << 30) - 1, 1u << 30, 0x7fffffffu}) {
    divisors.push_back(d);
  }
  for (int i = 0; i < 200; ++i) divisors.push_back(1 + static_cast<uint32_t>(rng() % 0x7fffffffu));
  for (uint32_t d : divisors) {
    const FastDivmod f = FastDivmod::Make(d);
    std::vector<uint32_t> ns = {0, 1, d - 1, d, d + 1, 0x7fffffffu, 0x7ffffffeu};
    for (uint32_t k : {2u, 3u, 1000u, 0x7fffffffu / d}) {
      const uint64_t m = uint64_t{k} * d;
      if (m <= 0x7fffffffu) {
        ns.push_back(static_cast<uint32_t>(m));
        ns.push_back(static_cast<uint32_t>(m - 1));
        if (m < 0x7fffffffu) ns.push_back(static_cast<uint32_t>(m + 1));
      }
    }
    for (int i = 0; i < 300; ++i) ns.push_back(static_cast<uint32_t>(rng() % 0x80000000u));
    for (uint32_t n : ns) {
      if (n > 0x7fffffffu) continue;
      uint32_t rem;
      const uint32_t q = f.DivMod(n, &rem);
      ASSERT_EQ(q, n / d) << n << " / " << d;
      ASSERT_EQ(rem, n % d) << n << " % " << d;
    }
  }
}

TEST(DeviceUtil, SignNibbles) {
  std::mt19937_64 rng(3);
  for (int i = 0; i < 10000; ++i) {
    uint32_t w[4];
    uint32_t want = 0;
    for (int j = 0; j < 4; ++j) {
      w[j] = static_cast<uint32_t>(rng());
      want |= ((w[j] >> 15) & 1u) << (8 * j + 3);
      want |= ((w[j] >> 31) & 1u) << (8 * j + 7);
    }
    ASSERT_EQ(SignNibbles(w[0], w[1], w[2], w[3]), want);
  }
}

// ---------------------------------------------------------------------------
// Blocks
// ---------------------------------------------------------------------------

// Global scales: typical, extreme but valid, and outside the contract
// (those take the fallback and must still match).
std::vector<float> TestScales() {
  return {1.0f,
          0.37f,
          1.0f / 2688.0f,
          3.1e-5f,
          17.0f,
          1e-20f,
          6e-39f /* subnormal */,
          1.2e-44f,
          1e30f,
          5.9e37f /* 6g overflows */,
          3.4e38f,
          0.0f,
          -1.0f,
          std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN()};
}

std::vector<Recipe> TestRecipes() {
  return {Recipe::Standard(), Recipe::FourOverSix(256, ErrorMetric::kMae, false),
          Recipe::FourOverSix(448, ErrorMetric::kMse, false),
          Recipe::FourOverSix(256, ErrorMetric::kMae, true),
          Recipe::FourOverSix(256, ErrorMetric::kMse, true)};
}

template <bool kBf16, RecipeVariant kVariant>
uint8_t FastQuantize(const uint32_t (&w)[8], float g, const Recipe& r, uint32_t (&packed)[2]) {
  return QuantizeBlockFast<kBf16, kVariant>(w, MakeQuantScale(g), r, packed);
}

template <bool kBf16>
uint8_t FastQuantizeAny(const uint32_t (&w)[8], float g, const Recipe& r, uint32_t (&packed)[2]) {
  switch (VariantOf(r)) {
    case RecipeVariant::kStandard:
      return FastQuantize<kBf16, RecipeVariant::kStandard>(w, g, r, packed);
    case RecipeVariant::kMae:
      return FastQuantize<kBf16, RecipeVariant::kMae>(w, g, r, packed);
    case RecipeVariant::kMse:
      return FastQuantize<kBf16, RecipeVariant::kMse>(w, g, r, packed);
    case RecipeVariant::kMaeHalf:
      return FastQuantize<kBf16, RecipeVariant::kMaeHalf>(w, g, r, packed);
    case RecipeVariant::kMseHalf:
      return FastQuantize<kBf16, RecipeVariant::kMseHalf>(w, g, r, packed);
  }
  return 0;
}

// Blocks of raw halves: random data plus blocks with specials.
std::vector<std::vector<uint16_t>> TestBlocks(DType dtype, int random_blocks, uint64_t seed) {
  std::vector<std::vector<uint16_t>> blocks;
  const std::vector<uint16_t> bits =
      testing::RandomHalfBits(dtype, int64_t{random_blocks} * 16, seed);
  for (int b = 0; b < random_blocks; ++b) {
    blocks.emplace_back(bits.begin() + b * 16, bits.begin() + (b + 1) * 16);
  }
  const bool bf = dtype == DType::kBF16;
  const uint16_t inf = bf ? 0x7f80 : 0x7c00, nan = bf ? 0x7fc0 : 0x7e00, max = bf ? 0x7f7f : 0x7bff;
  const uint16_t specials[] = {inf,    static_cast<uint16_t>(inf | 0x8000),
                               nan,    static_cast<uint16_t>(nan | 0x8000),
                               max,    static_cast<uint16_t>(max | 0x8000),
                               0x0001, 0x8001,
                               0x8000, 0x0000};
  std::mt19937_64 rng(seed ^ 0x5eed);
  for (int b = 0; b < 400; ++b) {
    std::vector<uint16_t> blk(bits.begin() + (b % random_blocks) * 16,
                              bits.begin() + (b % random_blocks + 1) * 16);
    const int n = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < n; ++k) blk[rng() % 16] = specials[rng() % 10];
    blocks.push_back(blk);
  }
  blocks.push_back(std::vector<uint16_t>(16, nan));
  blocks.push_back(std::vector<uint16_t>(16, 0x8000));
  blocks.push_back(std::vector<uint16_t>(16, 0x0001));
  // Values on the E2M1 thresholds at scale 1 (amax 6 -> block scale 1 for g = 1).
  const float thr[] = {6.0f,  0.25f,  0.75f,  1.25f,  1.75f,  2.5f,  3.5f,  5.0f,
                       -6.0f, -0.25f, -0.75f, -1.25f, -1.75f, -2.5f, -3.5f, -5.0f};
  std::vector<uint16_t> t(16);
  for (int i = 0; i < 16; ++i) t[i] = bf ? FloatToBf16Bits(thr[i]) : FloatToHalfBits(thr[i]);
  blocks.push_back(t);
  return blocks;
}

void ToWords(const std::vector<uint16_t>& h, uint32_t (&w)[8]) {
  for (int j = 0; j < 8; ++j) w[j] = h[2 * j] | (static_cast<uint32_t>(h[2 * j + 1]) << 16);
}

class QuantizeBlockTest : public ::testing::TestWithParam<DType> {};

TEST_P(QuantizeBlockTest, FastAndFallbackMatchQuantizeBlock) {
  const DType dtype = GetParam();
  const bool bf = dtype == DType::kBF16;
  const auto blocks = TestBlocks(dtype, 4000, bf ? 11 : 12);
  int64_t checked = 0, fours = 0;
  for (const Recipe& recipe : TestRecipes()) {
    for (float g : TestScales()) {
      for (const auto& h : blocks) {
        float x[kBlockSize];
        for (int i = 0; i < kBlockSize; ++i)
          x[i] = bf ? Bf16BitsToFloat(h[i]) : HalfBitsToFloat(h[i]);
        uint32_t ref[2];
        const uint8_t ref_b = QuantizeBlock(x, g, recipe, ref);
        uint32_t w[8];
        ToWords(h, w);
        uint32_t got[2];
        const uint8_t got_b = bf ? FastQuantizeAny<true>(w, g, recipe, got)
                                 : FastQuantizeAny<false>(w, g, recipe, got);
        Words8 words;
        for (int j = 0; j < 8; ++j) words.w[j] = w[j];
        const QuantizedBlock gen = QuantizeBlockGeneric(words, bf, g, recipe);
        ASSERT_EQ(got_b, ref_b) << "g=" << g << " kind=" << int(recipe.kind) << " block "
                                << checked;
        ASSERT_EQ(got[0], ref[0]) << "g=" << g << " kind=" << int(recipe.kind) << " block "
                                  << checked;
        ASSERT_EQ(got[1], ref[1]) << "g=" << g << " kind=" << int(recipe.kind) << " block "
                                  << checked;
        ASSERT_EQ(gen.scale, ref_b);
        ASSERT_EQ(gen.packed[0], ref[0]);
        ASSERT_EQ(gen.packed[1], ref[1]);
        ++checked;
      }
    }
  }
  // The 4over6 recipes must sometimes pick the amax/4 candidate, or the
  // comparison above would not exercise it.
  for (const auto& h : blocks) {
    float x[kBlockSize];
    for (int i = 0; i < kBlockSize; ++i) x[i] = bf ? Bf16BitsToFloat(h[i]) : HalfBitsToFloat(h[i]);
    uint32_t p6[2], p46[2];
    if (QuantizeBlock(x, 1.0f, Recipe::Standard(), p6) !=
        QuantizeBlock(x, 1.0f, Recipe::FourOverSix(), p46)) {
      ++fours;
    }
  }
  EXPECT_GT(fours, 100);
  EXPECT_GT(checked, 100000);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantizeBlockTest, ::testing::Values(DType::kF16, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// Blocks whose amax sits at the rounding midpoints of the block scale, where
// |x| r is largest (up to 6 * 17/16 for amax / 6): the fast path without the
// E2M1 cap / clamp (TightScale) must still match QuantizeBlock there.
TEST(QuantizeBlockTight, AmaxAtScaleMidpoints) {
  std::mt19937_64 rng(21);
  int64_t checked = 0;
  for (bool bf : {false, true}) {
    for (const Recipe& recipe : TestRecipes()) {
      for (float g : {1.0f, 0.37f, 3e-3f, 1e-29f, 1e29f}) {
        for (uint32_t b = 0; b < 0x7e; ++b) {
          const float mid = 0.5f * (E4m3Decode(static_cast<uint8_t>(b)) +
                                    E4m3Decode(static_cast<uint8_t>(b + 1)));
          for (float k : {6.0f, 4.0f}) {
            const float target = MulRn(mid, MulRn(k, g));
            const uint16_t t = bf ? FloatToBf16Bits(target) : FloatToHalfBits(target);
            for (int delta = -2; delta <= 2; ++delta) {
              const uint16_t a = static_cast<uint16_t>(t + delta);
              if ((a & 0x7fffu) >= (bf ? 0x7f80u : 0x7c00u) || (a & 0x7fffu) == 0) continue;
              std::vector<uint16_t> h(16);
              for (int i = 0; i < 16; ++i) {
                uint16_t v = i == 0 ? a : static_cast<uint16_t>(rng() % (a & 0x7fffu) + 1);
                if (rng() % 4 == 0) v = a & 0x7fffu;
                h[i] = static_cast<uint16_t>(v | ((rng() & 1) ? 0x8000u : 0u));
              }
              float x[kBlockSize];
              for (int i = 0; i < kBlockSize; ++i)
                x[i] = bf ? Bf16BitsToFloat(h[i]) : HalfBitsToFloat(h[i]);
              uint32_t ref[2], w[8], got[2];
              const uint8_t ref_b = QuantizeBlock(x, g, recipe, ref);
              ToWords(h, w);
              const uint8_t got_b = bf ? FastQuantizeAny<true>(w, g, recipe, got)
                                       : FastQuantizeAny<false>(w, g, recipe, got);
              ASSERT_EQ(got_b, ref_b) << "g=" << g << " b=" << b << " bf=" << bf;
              ASSERT_EQ(got[0], ref[0]) << "g=" << g << " b=" << b << " bf=" << bf;
              ASSERT_EQ(got[1], ref[1]) << "g=" << g << " b=" << b << " bf=" << bf;
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 10000);
}

TEST(E2m1CodeOfValueAt, PlacesTheCodeInEveryNibble) {
  for (uint32_t c = 0; c < 8; ++c) {
    const float v = E2m1Decode(static_cast<uint8_t>(c));
    for (int k = 0; k < 8; ++k) {
      EXPECT_EQ(E2m1CodeOfValueAt(v, k), c << (4 * k)) << "code " << c << " nibble " << k;
    }
  }
}

TEST(DequantizeBlock, MatchesDequantValueForEveryScaleByte) {
  std::mt19937_64 rng(7);
  const float gs[] = {1.0f,
                      0.37f,
                      1e-30f,
                      1e30f,
                      3.4e38f,
                      1e-40f,
                      0.0f,
                      -0.0f,
                      -2.0f,
                      -3.4e38f,
                      std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()};
  for (bool bf : {false, true}) {
    for (float g : gs) {
      const bool g_finite = IsFiniteBits(FloatBits(g));
      for (uint32_t sb = 0; sb < 256; ++sb) {
        for (int k = 0; k < 8; ++k) {
          const U32x2 codes = k == 0   ? U32x2{0x76543210u, 0xfedcba98u}
                              : k == 1 ? U32x2{0xfedcba98u, 0x76543210u}
                                       : U32x2{static_cast<uint32_t>(rng()),
                                               static_cast<uint32_t>(rng())};
          const Words8Out got =
              bf ? DequantizeBlockFast<true>(codes, static_cast<uint8_t>(sb), g, g_finite)
                 : DequantizeBlockFast<false>(codes, static_cast<uint8_t>(sb), g, g_finite);
          const uint32_t gw[8] = {got.lo.x, got.lo.y, got.lo.z, got.lo.w,
                                  got.hi.x, got.hi.y, got.hi.z, got.hi.w};
          const float s = E4m3Decode(static_cast<uint8_t>(sb));
          for (int i = 0; i < 16; ++i) {
            const uint32_t word = i < 8 ? codes.x : codes.y;
            const float v = DequantValue(static_cast<uint8_t>((word >> (4 * (i % 8))) & 0xfu), s, g);
            const uint16_t want = bf ? FloatToBf16Bits(v) : FloatToHalfBits(v);
            const uint16_t have = static_cast<uint16_t>(gw[i / 2] >> (16 * (i % 2)));
            ASSERT_EQ(have, want) << "bf16=" << bf << " g=" << g << " sb=" << sb << " i=" << i;
          }
        }
      }
    }
  }
}

TEST(MaterializeBlock, MatchesMaterializeFp8ValueForEveryScaleByte) {
  std::mt19937_64 rng(9);
  const float ms[] = {1.0f, 0.5f,   1.0f / 6.0f, 1e-20f,  1e20f,
                      0.0f, 1e-40f, 3.4e38f,     7.3e-3f, std::numeric_limits<float>::infinity(),
                      -0.0f, -2.0f};
  for (float m : ms) {
    for (uint32_t sb = 0; sb < 256; ++sb) {
      for (int k = 0; k < 6; ++k) {
        const U32x2 codes = k == 0
                                ? U32x2{0x76543210u, 0xfedcba98u}
                                : U32x2{static_cast<uint32_t>(rng()), static_cast<uint32_t>(rng())};
        const U32x4 got =
            MaterializeBlockFast(codes, static_cast<uint8_t>(sb), m, MaterializeMultiplierFast(m));
        const uint32_t gw[4] = {got.x, got.y, got.z, got.w};
        const float s = E4m3Decode(static_cast<uint8_t>(sb));
        for (int i = 0; i < 16; ++i) {
          const uint32_t word = i < 8 ? codes.x : codes.y;
          const uint8_t c = static_cast<uint8_t>((word >> (4 * (i % 8))) & 0xfu);
          const uint8_t want = MaterializeFp8Value(c, s, m);
          const uint8_t have = static_cast<uint8_t>(gw[i / 4] >> (8 * (i % 4)));
          ASSERT_EQ(have, want) << "m=" << m << " sb=" << sb << " i=" << i << " code=" << int(c);
        }
      }
    }
  }
}

// FP8 keys: the 16-byte block forms against QuantizeFp8Key / DequantFp8Key /
// MaterializeFp8KeyValue, every code byte in every position.
U32x4 BytesOf(const uint8_t (&b)[16]) {
  uint32_t w[4] = {};
  for (int i = 0; i < 16; ++i) w[i / 4] |= static_cast<uint32_t>(b[i]) << (8 * (i % 4));
  return U32x4{w[0], w[1], w[2], w[3]};
}

TEST(Fp8KeyBlock, QuantizeMatchesQuantizeFp8Key) {
  std::mt19937_64 rng(11);
  const float gs[] = {1.0f, 0.37f / 448, 1e-30f, 3e-3f, 1e30f, 1e-40f, 3.4e38f};
  for (bool bf : {false, true}) {
    const DType t = bf ? DType::kBF16 : DType::kF16;
    for (float g : gs) {
      const float r = Fp8KeyEncodeMultiplier(g);
      for (int k = 0; k < 400; ++k) {
        // Random halves (NaN, inf, subnormal among them), and every pattern
        // of the low 16 bits over 16-value blocks.
        std::vector<uint16_t> h = testing::RandomHalfBits(t, 16, rng());
        if (k < 4096 / 16 && k % 2 == 0) {
          for (int i = 0; i < 16; ++i) h[i] = static_cast<uint16_t>(rng());
        }
        uint32_t w[8];
        for (int j = 0; j < 8; ++j) w[j] = h[2 * j] | (static_cast<uint32_t>(h[2 * j + 1]) << 16);
        const U32x4 got =
            bf ? QuantizeFp8KeyBlockFast<true>(w, r) : QuantizeFp8KeyBlockFast<false>(w, r);
        for (int i = 0; i < 16; ++i) {
          const float x = bf ? Bf16BitsToFloat(h[i]) : HalfBitsToFloat(h[i]);
          ASSERT_EQ(ByteOf(got, i), QuantizeFp8Key(x, r))
              << "bf16=" << bf << " g=" << g << " i=" << i;
        }
      }
    }
  }
}

TEST(Fp8KeyBlock, DequantizeMatchesDequantFp8KeyForEveryCode) {
  const float gs[] = {1.0f,
                      0.37f,
                      1e-30f,
                      1e30f,
                      3.4e38f,
                      1e-40f,
                      0.0f,
                      -0.0f,
                      -2.0f,
                      std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()};
  for (bool bf : {false, true}) {
    for (float g : gs) {
      const bool g_finite = IsFiniteBits(FloatBits(g));
      for (int base = 0; base < 256; base += 16) {
        for (int rot = 0; rot < 16; ++rot) {  // every code in every position
          uint8_t b[16];
          for (int i = 0; i < 16; ++i) b[i] = static_cast<uint8_t>(base + (i + rot) % 16);
          const Words8Out got = bf ? DequantFp8KeyBlockFast<true>(BytesOf(b), g, g_finite)
                                   : DequantFp8KeyBlockFast<false>(BytesOf(b), g, g_finite);
          const uint32_t gw[8] = {got.lo.x, got.lo.y, got.lo.z, got.lo.w,
                                  got.hi.x, got.hi.y, got.hi.z, got.hi.w};
          for (int i = 0; i < 16; ++i) {
            const float v = DequantFp8Key(b[i], g);
            const uint16_t want = bf ? FloatToBf16Bits(v) : FloatToHalfBits(v);
            ASSERT_EQ(static_cast<uint16_t>(gw[i / 2] >> (16 * (i % 2))), want)
                << "bf16=" << bf << " g=" << g << " code=" << int(b[i]);
          }
        }
      }
    }
  }
}

TEST(Fp8KeyBlock, MaterializeMatchesMaterializeFp8KeyValueForEveryCode) {
  const float ms[] = {1.0f,  0.5f, 2.0f,   1.0f / 3.0f, 1e-20f,
                      1e20f, 0.0f, 1e-40f, 3.4e38f,     std::numeric_limits<float>::infinity(),
                      -0.0f, -2.0f};
  for (float m : ms) {
    for (int base = 0; base < 256; base += 16) {
      for (int rot = 0; rot < 16; ++rot) {
        uint8_t b[16];
        for (int i = 0; i < 16; ++i) b[i] = static_cast<uint8_t>(base + (i + rot) % 16);
        const U32x4 got = MaterializeFp8KeyBlockFast(BytesOf(b), m);
        for (int i = 0; i < 16; ++i) {
          ASSERT_EQ(ByteOf(got, i), MaterializeFp8KeyValue(b[i], m))
              << "m=" << m << " code=" << int(b[i]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace kernels
}  // namespace fp4kv
