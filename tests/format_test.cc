// Tests of the number format (include/fp4kv/format.h) on the CPU.
//
// Scalar conversions are checked bit for bit against the CUDA toolkit's own
// host conversions (cuda_fp8.h, cuda_fp4.h, cuda_fp16.h, cuda_bf16.h), which
// define the rounding that the hardware conversion instructions implement.
// Block quantization is checked against an independent recomputation in
// double precision and against error bounds derived from the format.
#include "fp4kv/format.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fp4kv/ops.h"
#include "gtest/gtest.h"

namespace fp4kv {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------
// The toolkit's conversions, the oracle for every scalar test.
// ---------------------------------------------------------------------------
uint8_t ToolkitE4m3(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }

float ToolkitE4m3ToFloat(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
}

uint8_t ToolkitE2m1(float x) { return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest); }

float ToolkitE2m1ToFloat(uint8_t c) {
  return __half2float(__half(__nv_cvt_fp4_to_halfraw(c, __NV_E2M1)));
}

uint16_t ToolkitHalfBits(float x) { return __half_raw(__float2half_rn(x)).x; }
uint16_t ToolkitBf16Bits(float x) { return __nv_bfloat16_raw(__float2bfloat16_rn(x)).x; }

float ToolkitHalfToFloat(uint16_t h) {
  __half_raw r;
  r.x = h;
  return __half2float(__half(r));
}

float ToolkitBf16ToFloat(uint16_t h) {
  __nv_bfloat16_raw r;
  r.x = h;
  return __bfloat162float(__nv_bfloat16(r));
}

std::string Hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

// Runs ours(x) and ref(x) over `xs` and reports the first mismatches (by
// input bit pattern) plus their total count.
template <typename Ours, typename Ref>
void ExpectSameEncoding(const std::vector<float>& xs, Ours ours, Ref ref, const char* what) {
  int64_t mismatches = 0;
  for (float x : xs) {
    const uint32_t a = ours(x), b = ref(x);
    if (a != b) {
      if (++mismatches <= 8) {
        ADD_FAILURE() << what << "(" << x << " = bits " << Hex(FloatBits(x)) << "): ours "
                      << Hex(a) << ", toolkit " << Hex(b);
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << what << ": mismatches out of " << xs.size();
}

// Same value, with NaN equal to NaN.
bool SameFloat(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return FloatBits(a) == FloatBits(b);
}

// Appends x with both signs and its neighbours one ulp either way.
void AddWithNeighbours(std::vector<float>* xs, float x) {
  for (float v : {x, -x}) {
    xs->push_back(v);
    xs->push_back(std::nextafter(v, kInf));
    xs->push_back(std::nextafter(v, -kInf));
  }
}

std::vector<float> RandomBitPatterns(int64_t n, uint64_t seed, bool allow_nan) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<float> xs;
  xs.reserve(n);
  while (static_cast<int64_t>(xs.size()) < n) {
    const float x = BitsFloat(static_cast<uint32_t>(rng()));
    if (!allow_nan && std::isnan(x)) continue;
    xs.push_back(x);
  }
  return xs;
}

// Values on, between and near the points of a format grid: a random grid
// value or midpoint of two neighbours, moved by a random number of fp32 ulps
// (often zero), with a random sign.
std::vector<float> RandomNearGrid(const std::vector<float>& grid, int64_t n, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_int_distribution<size_t> pick(0, grid.size() - 2);
  std::uniform_int_distribution<int> kind(0, 3);
  std::uniform_int_distribution<int> ulps(-40, 40);
  std::vector<float> xs;
  xs.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const size_t j = pick(rng);
    float x = kind(rng) < 2 ? grid[j] : 0.5f * (grid[j] + grid[j + 1]);  // midpoint exact
    const int k = kind(rng) == 0 ? 0 : ulps(rng);
    for (int s = 0; s < (k < 0 ? -k : k); ++s) x = std::nextafter(x, k < 0 ? -kInf : kInf);
    xs.push_back((rng() & 1u) ? -x : x);
  }
  return xs;
}

// Log-uniform magnitudes over [2^lo, 2^hi) with a random sign.
std::vector<float> RandomLogUniform(int64_t n, int lo, int hi, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> e(static_cast<float>(lo), static_cast<float>(hi));
  std::vector<float> xs;
  xs.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const float x = std::exp2(e(rng));
    xs.push_back((rng() & 1u) ? -x : x);
  }
  return xs;
}

// Positive E4M3 values by code 0x00..0x7e, from the definition (not from
// format.h): exponent field 0 is subnormal, m * 2^-9; else (1 + m/8) 2^(e-7).
std::vector<double> E4m3PositiveTable() {
  std::vector<double> t;
  for (int c = 0; c <= 0x7e; ++c) {
    const int e = c >> 3, m = c & 7;
    t.push_back(e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7));
  }
  return t;
}

const double kE2m1PositiveTable[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

// Nearest table entry to v >= 0, ties to the even code, saturating at the
// last entry: the definition of round-to-nearest-even onto a small grid.
template <typename Table>
int NearestCode(const Table& table, int n, double v) {
  if (v >= table[n - 1]) return n - 1;
  int best = 0;
  for (int c = 1; c < n; ++c) {
    const double d = std::fabs(v - table[c]), db = std::fabs(v - table[best]);
    if (d < db || (d == db && (c % 2 == 0))) best = c;
  }
  return best;
}

std::vector<float> E4m3PositiveGrid() {
  std::vector<float> grid;
  for (double v : E4m3PositiveTable()) grid.push_back(static_cast<float>(v));
  grid.push_back(480.0f);  // one step past the top, so midpoints reach 464
  return grid;
}

// ===========================================================================
// E4M3
// ===========================================================================
TEST(E4m3, DecodeAllCodesMatchToolkit) {
  const std::vector<double> table = E4m3PositiveTable();
  for (int b = 0; b < 256; ++b) {
    const uint8_t byte = static_cast<uint8_t>(b);
    const float ours = E4m3Decode(byte);
    EXPECT_TRUE(SameFloat(ours, ToolkitE4m3ToFloat(byte)))
        << "code " << Hex(b) << ": ours " << ours << ", toolkit " << ToolkitE4m3ToFloat(byte);
    if ((b & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(ours)) << Hex(b);
    } else {
      const double want = (b & 0x80) ? -table[b & 0x7f] : table[b & 0x7f];
      EXPECT_EQ(static_cast<double>(ours), want) << Hex(b);
      EXPECT_EQ(std::signbit(ours), (b & 0x80) != 0) << Hex(b);
      // Every finite code is a fixed point of encode(decode(.)).
      EXPECT_EQ(E4m3Encode(ours), byte) << Hex(b);
    }
  }
  EXPECT_EQ(E4m3Decode(0x7e), 448.0f);
  EXPECT_EQ(E4m3Decode(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(E4m3Decode(0x08), std::ldexp(1.0f, -6));
}

TEST(E4m3, EncodeRandomBitPatternsMatchToolkit) {
  ExpectSameEncoding(RandomBitPatterns(1000000, 1, /*allow_nan=*/true), E4m3Encode, ToolkitE4m3,
                     "E4m3Encode");
}

TEST(E4m3, EncodeNearGridMatchesToolkit) {
  ExpectSameEncoding(RandomNearGrid(E4m3PositiveGrid(), 1000000, 2), E4m3Encode, ToolkitE4m3,
                     "E4m3Encode");
  ExpectSameEncoding(RandomLogUniform(300000, -14, 11, 3), E4m3Encode, ToolkitE4m3, "E4m3Encode");
}

TEST(E4m3, EncodeEveryTieAndItsNeighboursMatchToolkit) {
  const std::vector<float> grid = E4m3PositiveGrid();
  std::vector<float> xs;
  for (size_t j = 0; j + 1 < grid.size(); ++j) {
    const float mid = 0.5f * (grid[j] + grid[j + 1]);
    ASSERT_EQ(static_cast<double>(mid), 0.5 * (grid[j] + static_cast<double>(grid[j + 1])));
    AddWithNeighbours(&xs, mid);
  }
  ExpectSameEncoding(xs, E4m3Encode, ToolkitE4m3, "E4m3Encode");
  // Ties go to the even code, both in the subnormal and the normal range.
  EXPECT_EQ(E4m3Encode(std::ldexp(1.0f, -10)), 0x00);       // 0 | 2^-9
  EXPECT_EQ(E4m3Encode(std::ldexp(3.0f, -10)), 0x02);       // 2^-9 | 2^-8
  EXPECT_EQ(E4m3Encode(1.0625f), 0x38);                     // 1 | 1.125
  EXPECT_EQ(E4m3Encode(1.1875f), 0x3a);                     // 1.125 | 1.25
  EXPECT_EQ(E4m3Encode(-1.1875f), 0xba);
}

TEST(E4m3, EncodeSpecialValuesMatchToolkit) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> xs = {0.0f, -0.0f, kInf, -kInf, nan, -nan,
                           BitsFloat(0x7f800001u), BitsFloat(0xff800001u),  // signalling NaNs
                           BitsFloat(0x7fffffffu), BitsFloat(0xffffffffu),
                           448.0f, 448.0001f, 463.99f, 464.0f, 465.0f, 1e30f, FLT_MAX,
                           std::ldexp(1.0f, -10), std::nextafter(std::ldexp(1.0f, -10), 0.0f),
                           std::ldexp(1.0f, -11), FLT_MIN, FLT_TRUE_MIN, 1e-30f};
  std::vector<float> signed_xs;
  for (float x : xs) {
    signed_xs.push_back(x);
    signed_xs.push_back(-x);
  }
  for (int c = 1; c <= 7; ++c) {  // every subnormal code, and next to it
    AddWithNeighbours(&signed_xs, std::ldexp(static_cast<float>(c), -9));
  }
  ExpectSameEncoding(signed_xs, E4m3Encode, ToolkitE4m3, "E4m3Encode");
  // The documented bytes.
  EXPECT_EQ(E4m3Encode(0.0f), 0x00);
  EXPECT_EQ(E4m3Encode(-0.0f), 0x80);
  EXPECT_EQ(E4m3Encode(kInf), 0x7e);
  EXPECT_EQ(E4m3Encode(-kInf), 0xfe);
  EXPECT_EQ(E4m3Encode(1e30f), 0x7e);
  EXPECT_EQ(E4m3Encode(464.0f), 0x7e);
  EXPECT_EQ(E4m3Encode(-465.0f), 0xfe);
  EXPECT_EQ(E4m3Encode(nan), 0x7f);
  EXPECT_EQ(E4m3Encode(-nan), 0x7f);
  EXPECT_EQ(E4m3Encode(std::nextafter(std::ldexp(1.0f, -10), 0.0f)), 0x00);
  EXPECT_EQ(E4m3Encode(-std::nextafter(std::ldexp(1.0f, -10), 0.0f)), 0x80);
  EXPECT_EQ(E4m3Encode(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
}

// ===========================================================================
// E2M1
// ===========================================================================
TEST(E2m1, DecodeAllCodesMatchToolkit) {
  for (int c = 0; c < 16; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float ours = E2m1Decode(code);
    EXPECT_TRUE(SameFloat(ours, ToolkitE2m1ToFloat(code))) << "code " << c;
    const double want = (c & 8) ? -kE2m1PositiveTable[c & 7] : kE2m1PositiveTable[c & 7];
    EXPECT_EQ(static_cast<double>(ours), want) << c;
    EXPECT_EQ(std::signbit(ours), (c & 8) != 0) << c;
    EXPECT_EQ(E2m1Encode(ours), code) << c;
  }
}

TEST(E2m1, EveryTieRoundsToEvenLikeToolkit) {
  const struct {
    float x;
    uint8_t code;
  } ties[] = {{0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6}, {5.0f, 6}};
  std::vector<float> xs;
  for (const auto& t : ties) {
    EXPECT_EQ(E2m1Encode(t.x), t.code) << t.x;
    EXPECT_EQ(E2m1Encode(-t.x), t.code | 0x8) << -t.x;
    // One ulp either side leaves the tie: down to the lower code, up to the upper.
    const uint8_t lower = ToolkitE2m1(std::nextafter(t.x, 0.0f));
    const uint8_t upper = ToolkitE2m1(std::nextafter(t.x, kInf));
    EXPECT_EQ(upper, lower + 1) << t.x;
    AddWithNeighbours(&xs, t.x);
  }
  ExpectSameEncoding(xs, E2m1Encode, ToolkitE2m1, "E2m1Encode");
}

TEST(E2m1, SpecialValuesMatchToolkit) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> xs = {0.0f, 6.0f, 6.0001f, 7.0f, 1e30f, FLT_MAX, kInf, nan,
                           BitsFloat(0x7f800001u), BitsFloat(0x7fffffffu), FLT_TRUE_MIN, 1e-30f};
  std::vector<float> signed_xs;
  for (float x : xs) {
    signed_xs.push_back(x);
    signed_xs.push_back(-x);
  }
  ExpectSameEncoding(signed_xs, E2m1Encode, ToolkitE2m1, "E2m1Encode");
  EXPECT_EQ(E2m1Encode(0.0f), 0x0);
  EXPECT_EQ(E2m1Encode(-0.0f), 0x8);
  EXPECT_EQ(E2m1Encode(-FLT_TRUE_MIN), 0x8);  // the sign survives a flush to zero
  EXPECT_EQ(E2m1Encode(6.0001f), 0x7);
  EXPECT_EQ(E2m1Encode(-1e30f), 0xf);
  EXPECT_EQ(E2m1Encode(kInf), 0x7);
  EXPECT_EQ(E2m1Encode(-kInf), 0xf);
  // NaN of either sign becomes +6, as the toolkit does.
  EXPECT_EQ(E2m1Encode(nan), 0x7);
  EXPECT_EQ(E2m1Encode(-nan), 0x7);
  EXPECT_EQ(ToolkitE2m1(-nan), 0x7);
}

TEST(E2m1, RandomValuesMatchToolkit) {
  std::vector<float> grid(kE2m1PositiveTable, kE2m1PositiveTable + 8);
  grid.push_back(8.0f);  // midpoint 7 lies in the saturating range
  ExpectSameEncoding(RandomBitPatterns(1000000, 4, /*allow_nan=*/true), E2m1Encode, ToolkitE2m1,
                     "E2m1Encode");
  ExpectSameEncoding(RandomNearGrid(grid, 1000000, 5), E2m1Encode, ToolkitE2m1, "E2m1Encode");
  ExpectSameEncoding(RandomLogUniform(300000, -4, 4, 6), E2m1Encode, ToolkitE2m1, "E2m1Encode");
}

// ===========================================================================
// fp16 / bf16
// ===========================================================================
TEST(HalfBf16, DecodeAllPatternsMatchToolkit) {
  int bad_half = 0, bad_bf16 = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t b = static_cast<uint16_t>(h);
    if (!SameFloat(HalfBitsToFloat(b), ToolkitHalfToFloat(b)) && ++bad_half <= 8) {
      ADD_FAILURE() << "HalfBitsToFloat(" << Hex(h) << ") = " << HalfBitsToFloat(b)
                    << ", toolkit " << ToolkitHalfToFloat(b);
    }
    if (!SameFloat(Bf16BitsToFloat(b), ToolkitBf16ToFloat(b)) && ++bad_bf16 <= 8) {
      ADD_FAILURE() << "Bf16BitsToFloat(" << Hex(h) << ") = " << Bf16BitsToFloat(b)
                    << ", toolkit " << ToolkitBf16ToFloat(b);
    }
  }
  EXPECT_EQ(bad_half, 0);
  EXPECT_EQ(bad_bf16, 0);
}

TEST(HalfBf16, EncodeRandomBitPatternsMatchToolkit) {
  const std::vector<float> xs = RandomBitPatterns(1000000, 7, /*allow_nan=*/false);
  ExpectSameEncoding(xs, FloatToHalfBits, ToolkitHalfBits, "FloatToHalfBits");
  ExpectSameEncoding(xs, FloatToBf16Bits, ToolkitBf16Bits, "FloatToBf16Bits");
  // Magnitudes inside the fp16 range, where the bit patterns above rarely land.
  const std::vector<float> in_range = RandomLogUniform(1000000, -26, 17, 8);
  ExpectSameEncoding(in_range, FloatToHalfBits, ToolkitHalfBits, "FloatToHalfBits");
}

TEST(HalfBf16, EncodeEveryTieMatchesToolkit) {
  // fp16: the midpoint of every pair of neighbouring finite halves (and of
  // 65504 and 65536, the overflow threshold), with neighbours.
  std::vector<float> xs;
  for (uint32_t h = 0; h < 0x7c00u; ++h) {
    const float lo = HalfBitsToFloat(static_cast<uint16_t>(h));
    const float hi = h + 1 == 0x7c00u ? 65536.0f : HalfBitsToFloat(static_cast<uint16_t>(h + 1));
    AddWithNeighbours(&xs, 0.5f * (lo + hi));
  }
  ExpectSameEncoding(xs, FloatToHalfBits, ToolkitHalfBits, "FloatToHalfBits");
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7c00);  // tie between 65504 (odd) and 65536
  EXPECT_EQ(FloatToHalfBits(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -25)), 0x0000);   // tie between 0 and 2^-24
  EXPECT_EQ(FloatToHalfBits(-std::ldexp(3.0f, -25)), 0x8002);  // tie between 1 and 2 ulps
  // bf16: every bf16 pattern with the dropped half exactly a tie, or one
  // below or above it.
  std::vector<float> bxs;
  for (uint32_t u = 0; u < 65536; ++u) {
    if (((u >> 7) & 0xffu) == 0xffu) continue;  // inf/NaN exponent
    for (uint32_t low : {0x7fffu, 0x8000u, 0x8001u}) bxs.push_back(BitsFloat((u << 16) | low));
  }
  ExpectSameEncoding(bxs, FloatToBf16Bits, ToolkitBf16Bits, "FloatToBf16Bits");
  EXPECT_EQ(FloatToBf16Bits(BitsFloat(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(FloatToBf16Bits(BitsFloat(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(FloatToBf16Bits(BitsFloat(0x7f7f8000u)), 0x7f80);  // overflow to inf
}

TEST(HalfBf16, NanGivesCanonical7fff) {
  for (uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu,
                        0xffffffffu, 0x7fa00000u}) {
    EXPECT_EQ(FloatToHalfBits(BitsFloat(bits)), 0x7fff) << Hex(bits);
    EXPECT_EQ(FloatToBf16Bits(BitsFloat(bits)), 0x7fff) << Hex(bits);
  }
  EXPECT_EQ(FloatToHalfBits(kInf), 0x7c00);
  EXPECT_EQ(FloatToHalfBits(-kInf), 0xfc00);
  EXPECT_EQ(FloatToBf16Bits(-kInf), 0xff80);
}

// Every sign, exponent and combination of the top 11 mantissa bits, with the
// low 12 bits empty, minimal, just below half, half, or full. For E2M1 (1
// mantissa bit), E4M3 (3), fp16 (10) and bf16 (7) this is every combination
// of kept bits, round bit and sticky bits at every exponent, so every
// rounding decision the formats can make, subnormal targets included.
TEST(AllFormats, StructuredSweepMatchesToolkit) {
  std::vector<float> xs;
  xs.reserve(2 * 256 * 2048 * 5);
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t exp = 0; exp < 256; ++exp) {
      for (uint32_t top = 0; top < 2048; ++top) {
        for (uint32_t low : {0x000u, 0x001u, 0x7ffu, 0x800u, 0xfffu}) {
          xs.push_back(BitsFloat((sign << 31) | (exp << 23) | (top << 12) | low));
        }
      }
    }
  }
  ExpectSameEncoding(xs, E4m3Encode, ToolkitE4m3, "E4m3Encode");
  ExpectSameEncoding(xs, E2m1Encode, ToolkitE2m1, "E2m1Encode");
  std::vector<float> no_nan;
  for (float x : xs) {
    if (!std::isnan(x)) no_nan.push_back(x);
  }
  ExpectSameEncoding(no_nan, FloatToHalfBits, ToolkitHalfBits, "FloatToHalfBits");
  ExpectSameEncoding(no_nan, FloatToBf16Bits, ToolkitBf16Bits, "FloatToBf16Bits");
}

// ===========================================================================
// One block
// ===========================================================================
struct Block {
  float x[kBlockSize];
};

uint8_t CodeAt(const uint32_t (&packed)[2], int i) {
  return static_cast<uint8_t>((packed[i / 8] >> (4 * (i % 8))) & 0xfu);
}

// The standard recipe recomputed step by step in double, using the tables
// above instead of format.h's bit manipulation. Each fp32 operation of the
// recipe is reproduced as an exact (or innocuously double-rounded) double
// operation followed by one rounding to float:
//   amax = max |x_i| (NaN ignored); zero -> scale 0, codes 0
//   q = fp32(amax / fp32(6 g));      b = nearest E4M3 code of q (ties even, saturating)
//   s = value(b);  r = fp32(1 / fp32(s g)), 0 if s or s g is 0, FLT_MAX if infinite
//   code_i = sign(x_i r) | nearest E2M1 code of |fp32(x_i r)|; NaN -> 0x7
struct Recomputed {
  uint8_t scale_byte = 0;
  uint8_t codes[kBlockSize] = {};
  float s = 0, r = 0;
};

Recomputed RecomputeStandard(const Block& blk, float g) {
  static const std::vector<double> e4m3 = E4m3PositiveTable();
  Recomputed out;
  double amax = 0;
  for (float v : blk.x) {
    if (!std::isnan(v)) amax = std::max(amax, std::fabs(static_cast<double>(v)));
  }
  if (amax == 0) return out;
  const float six_g = static_cast<float>(6.0 * g);
  const float q = static_cast<float>(amax / six_g);
  out.scale_byte = static_cast<uint8_t>(NearestCode(e4m3, static_cast<int>(e4m3.size()), q));
  out.s = static_cast<float>(e4m3[out.scale_byte]);
  const float sg = static_cast<float>(static_cast<double>(out.s) * g);
  out.r = (out.s == 0 || sg == 0) ? 0.0f : static_cast<float>(1.0 / sg);
  if (std::isinf(out.r)) out.r = FLT_MAX;
  for (int i = 0; i < kBlockSize; ++i) {
    const float y = static_cast<float>(static_cast<double>(blk.x[i]) * out.r);
    if (std::isnan(y)) {
      out.codes[i] = 0x7;
      continue;
    }
    out.codes[i] = static_cast<uint8_t>((std::signbit(y) ? 8 : 0) |
                                        NearestCode(kE2m1PositiveTable, 8, std::fabs(y)));
  }
  return out;
}

void ExpectMatchesRecomputed(const Block& blk, float g, const char* what) {
  uint32_t packed[2];
  const uint8_t b = QuantizeBlock(blk.x, g, Recipe::Standard(), packed);
  const Recomputed want = RecomputeStandard(blk, g);
  ASSERT_EQ(b, want.scale_byte) << what << " g=" << g;
  for (int i = 0; i < kBlockSize; ++i) {
    ASSERT_EQ(CodeAt(packed, i), want.codes[i]) << what << " element " << i << " x=" << blk.x[i]
                                                << " g=" << g;
  }
}

// Half an E2M1 step at normalized magnitude y (>= 0), or the saturation
// error above 6: the largest |y - e2m1(y)|.
double E2m1MaxError(double y) {
  if (y <= 2) return 0.25;
  if (y <= 4) return 0.5;
  if (y <= 6) return 1.0;
  return y - 6.0;
}

// Error bound of one element, derived from the format.
//
// With T = s g (the block's dequantization step unit), the quantizer encodes
// y = |x| r with r = 1/T (one fp32 rounding), and dequantization returns
// (e2m1 * s) * g (one more fp32 rounding, e2m1 * s is exact). So
//   |x - dq| <= E2m1MaxError(|x| / T) * T + slack,
// where E2m1MaxError is half an E2M1 step (0.25 below 2, 0.5 below 4, 1 up to
// 6) or y - 6 when y saturates, and slack covers three fp32 roundings
// (relative 2^-24 each) of values of size at most |x| + 6 T.
//
// The E4M3 rounding of the scale bounds y: s = e4m3(amax / (6 g)) is within a
// relative half-ulp 2^-4 of amax / (6 g) whenever that quotient is a normal
// E4M3 value ([2^-6, 448]), so amax / T <= 6 / (1 - 2^-4) = 6.4: saturation
// costs at most 0.4 T, below the top half-step, and every element satisfies
//   |x - dq| <= T <= (1 + 2^-4) amax / 6   (about 0.177 amax).
double ElementBound(float x, float s, float g) {
  const double t = static_cast<double>(s) * g;
  const double ax = std::fabs(static_cast<double>(x));
  if (t == 0) return ax;  // zero scale: everything flushes to zero
  const double slack = 4.0 * std::ldexp(ax + 6.0 * t, -24);
  return E2m1MaxError(ax / t) * t + slack;
}

TEST(Block, GaussianRoundTripWithinFormatBounds) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> octave(-6.0f, 6.0f);
  constexpr int kBlocks = 20000;
  std::vector<Block> blocks(kBlocks);
  float global_amax = 0;
  for (Block& b : blocks) {
    const float sigma = std::exp2(octave(rng));
    for (float& v : b.x) {
      v = sigma * normal(rng);
      global_amax = std::max(global_amax, std::fabs(v));
    }
  }
  // The usual per-tensor choice: the largest block maps to the top of E4M3.
  const float g = global_amax / (kE2m1Max * kE4m3Max);
  double worst_ratio = 0, worst_rel_to_amax = 0;
  int normal_scale_blocks = 0;
  for (const Block& blk : blocks) {
    uint32_t packed[2];
    const uint8_t b = QuantizeBlock(blk.x, g, Recipe::Standard(), packed);
    float dq[kBlockSize];
    DequantizeBlock(packed, b, g, dq);
    const float s = E4m3Decode(b);
    double amax = 0;
    for (float v : blk.x) amax = std::max(amax, std::fabs(static_cast<double>(v)));
    const double ideal = amax / (6.0 * g);
    if (ideal >= std::ldexp(1.0, -6) && ideal <= 448.0) {
      ++normal_scale_blocks;
      ASSERT_LE(std::fabs(s - ideal), std::ldexp(ideal, -4) * (1 + 1e-6)) << "scale rounding";
    }
    for (int i = 0; i < kBlockSize; ++i) {
      const double err = std::fabs(static_cast<double>(blk.x[i]) - dq[i]);
      const double bound = ElementBound(blk.x[i], s, g);
      ASSERT_LE(err, bound) << "x=" << blk.x[i] << " dq=" << dq[i] << " s=" << s << " g=" << g;
      worst_ratio = std::max(worst_ratio, err / bound);
      if (ideal >= std::ldexp(1.0, -6) && ideal <= 448.0) {
        const double rel = err / amax;
        ASSERT_LE(rel, (1.0 + 1.0 / 16) / 6.0 * (1 + 1e-6)) << "x=" << blk.x[i];
        worst_rel_to_amax = std::max(worst_rel_to_amax, rel);
      }
    }
  }
  EXPECT_GT(normal_scale_blocks, kBlocks * 9 / 10);
  // The bounds are tight enough to matter: random data comes close to them.
  EXPECT_GT(worst_ratio, 0.9);
  EXPECT_GT(worst_rel_to_amax, 0.1);
}

TEST(Block, MatchesIndependentRecomputation) {
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> octave(-30.0f, 30.0f);
  std::uniform_real_distribution<float> gexp(-40.0f, 40.0f);
  for (int n = 0; n < 20000; ++n) {
    Block blk;
    const float sigma = std::exp2(octave(rng));
    for (float& v : blk.x) v = sigma * normal(rng);
    const float g = std::exp2(gexp(rng));
    ExpectMatchesRecomputed(blk, g, "random");
    if (HasFatalFailure()) return;
  }
}

TEST(Block, ScaleIsAmaxOverSixGRoundedToE4m3) {
  // g = 1 and amax 6 * v for every E4M3 value v (and the midpoints between
  // them): the scale byte is exactly that value's code (ties even).
  const std::vector<double> table = E4m3PositiveTable();
  for (size_t c = 1; c < table.size(); ++c) {
    Block blk = {};
    blk.x[3] = static_cast<float>(6.0 * table[c]);
    uint32_t packed[2];
    EXPECT_EQ(QuantizeBlock(blk.x, 1.0f, Recipe::Standard(), packed), c);
    EXPECT_EQ(CodeAt(packed, 3), 0x7) << c;  // amax itself encodes to 6
    for (int i = 0; i < kBlockSize; ++i) {
      if (i != 3) {
        EXPECT_EQ(CodeAt(packed, i), 0) << c;
      }
    }
    ExpectMatchesRecomputed(blk, 1.0f, "grid");
  }
  // Above the E4M3 range the scale saturates and so do the codes.
  Block big = {};
  big.x[0] = 6.0f * 1000.0f;
  big.x[1] = -6.0f * 1000.0f;
  big.x[2] = 10.0f;
  uint32_t packed[2];
  EXPECT_EQ(QuantizeBlock(big.x, 1.0f, Recipe::Standard(), packed), 0x7e);
  EXPECT_EQ(CodeAt(packed, 0), 0x7);
  EXPECT_EQ(CodeAt(packed, 1), 0xf);
  EXPECT_EQ(CodeAt(packed, 2), 0x0);  // 10 / 448 = 0.022 -> 0
}

TEST(Block, ZeroBlockGivesZeroScaleAndCodes) {
  for (float z : {0.0f, -0.0f}) {
    Block blk;
    for (float& v : blk.x) v = z;
    uint32_t packed[2] = {0xdeadbeefu, 0xdeadbeefu};
    EXPECT_EQ(QuantizeBlock(blk.x, 0.25f, Recipe::Standard(), packed), 0);
    EXPECT_EQ(packed[0], 0u);
    EXPECT_EQ(packed[1], 0u);
    float dq[kBlockSize];
    DequantizeBlock(packed, 0, 0.25f, dq);
    for (float v : dq) EXPECT_EQ(FloatBits(v), 0u);
  }
  // A mix of +0 and -0 is a zero block too: all codes 0 (no sign kept).
  Block mixed = {};
  mixed.x[5] = -0.0f;
  uint32_t packed[2];
  EXPECT_EQ(QuantizeBlock(mixed.x, 1.0f, Recipe::Standard(), packed), 0);
  EXPECT_EQ(packed[0] | packed[1], 0u);
}

TEST(Block, OutlierKeepsItsBoundAndTheRestFlushToZero) {
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float g = 0.1f;  // outliers 50..249: amax / (6 g) in the normal E4M3 range
  for (int n = 0; n < 200; ++n) {
    Block blk;
    for (float& v : blk.x) v = 0.01f * normal(rng);
    const int at = n % kBlockSize;
    blk.x[at] = (n % 2 ? -1.0f : 1.0f) * (50.0f + n);
    uint32_t packed[2];
    const uint8_t b = QuantizeBlock(blk.x, g, Recipe::Standard(), packed);
    const float s = E4m3Decode(b);
    float dq[kBlockSize];
    DequantizeBlock(packed, b, g, dq);
    // The outlier sets amax, so its normalized magnitude amax / (s g) is
    // in [6 / (1 + 1/16), 6 / (1 - 1/16)] = [5.65, 6.4]: it encodes to +-6.
    const uint8_t oc = CodeAt(packed, at);
    EXPECT_EQ(oc & 7, 7) << "code " << int(oc);
    EXPECT_EQ((oc & 8) != 0, blk.x[at] < 0);
    EXPECT_LE(std::fabs(static_cast<double>(blk.x[at]) - dq[at]), ElementBound(blk.x[at], s, g));
    EXPECT_LE(std::fabs(static_cast<double>(blk.x[at]) - dq[at]),
              (1.0 + 1.0 / 16) / 6.0 * std::fabs(blk.x[at]));
    // Everything else is below a quarter step of the outlier's scale: it
    // flushes to a zero code that keeps its sign and decodes to a signed zero.
    for (int i = 0; i < kBlockSize; ++i) {
      if (i == at) continue;
      ASSERT_LT(std::fabs(blk.x[i]) / (static_cast<double>(s) * g), 0.25);
      EXPECT_EQ(CodeAt(packed, i), blk.x[i] < 0 ? 0x8 : 0x0) << i;
      EXPECT_EQ(dq[i], 0.0f);
      EXPECT_EQ(std::signbit(dq[i]), std::signbit(blk.x[i]));
    }
    ExpectMatchesRecomputed(blk, g, "outlier");
  }
}

TEST(Block, NegativeZeroKeepsItsSignInANonzeroBlock) {
  Block blk = {};
  blk.x[0] = 3.0f;
  blk.x[1] = -0.0f;
  blk.x[2] = -1e-6f;  // rounds to zero, sign kept
  blk.x[3] = 0.0f;
  uint32_t packed[2];
  const uint8_t b = QuantizeBlock(blk.x, 1.0f, Recipe::Standard(), packed);
  EXPECT_EQ(b, E4m3Encode(0.5f));  // 3 / 6
  EXPECT_EQ(CodeAt(packed, 0), 0x7);
  EXPECT_EQ(CodeAt(packed, 1), 0x8);
  EXPECT_EQ(CodeAt(packed, 2), 0x8);
  EXPECT_EQ(CodeAt(packed, 3), 0x0);
  float dq[kBlockSize];
  DequantizeBlock(packed, b, 1.0f, dq);
  EXPECT_EQ(dq[0], 3.0f);
  EXPECT_EQ(FloatBits(dq[1]), 0x80000000u);
  EXPECT_EQ(FloatBits(dq[2]), 0x80000000u);
  EXPECT_EQ(FloatBits(dq[3]), 0x00000000u);
  // Decoding a -0 code gives -0 at every scale.
  for (int sb = 0; sb < 0x7f; ++sb) {
    EXPECT_EQ(FloatBits(DequantValue(0x8, E4m3Decode(static_cast<uint8_t>(sb)), 0.37f)),
              0x80000000u);
  }
}

TEST(Block, NibbleOrderElement2iIsLowNibbleOfByteI) {
  // With g = 1 and amax 6 the scale is exactly 1 (byte 0x38), so element i
  // gets code i when it holds the value of code i.
  Block blk;
  for (int i = 0; i < kBlockSize; ++i) blk.x[i] = E2m1Decode(static_cast<uint8_t>(i));
  uint32_t packed[2];
  ASSERT_EQ(QuantizeBlock(blk.x, 1.0f, Recipe::Standard(), packed), 0x38);
  const uint8_t want[kBlockBytes] = {0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe};
  for (int i = 0; i < kBlockBytes; ++i) {
    // Byte i of the block is byte i % 4 (little-endian) of word i / 4.
    EXPECT_EQ(static_cast<uint8_t>(packed[i / 4] >> (8 * (i % 4))), want[i]) << "byte " << i;
  }
  EXPECT_EQ(packed[0], 0x76543210u);
  EXPECT_EQ(packed[1], 0xfedcba98u);
  float dq[kBlockSize];
  DequantizeBlock(packed, 0x38, 1.0f, dq);
  for (int i = 0; i < kBlockSize; ++i) EXPECT_TRUE(SameFloat(dq[i], blk.x[i])) << i;
}

TEST(Block, InfAndNanInputsGiveTheDocumentedBytes) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  uint32_t packed[2];
  {
    // +-inf: amax is inf, the scale saturates to 448 (0x7e), inf codes are +-6,
    // finite values are encoded under s = 448 (here they flush to zero).
    Block blk = {};
    blk.x[0] = kInf;
    blk.x[1] = -kInf;
    blk.x[2] = 1.0f;
    blk.x[3] = -1.0f;
    EXPECT_EQ(QuantizeBlock(blk.x, 1.0f, Recipe::Standard(), packed), 0x7e);
    EXPECT_EQ(CodeAt(packed, 0), 0x7);
    EXPECT_EQ(CodeAt(packed, 1), 0xf);
    EXPECT_EQ(CodeAt(packed, 2), 0x0);
    EXPECT_EQ(CodeAt(packed, 3), 0x8);
    ExpectMatchesRecomputed(blk, 1.0f, "inf");
  }
  {
    // NaN is ignored by amax; the NaN element itself encodes to +6 (0x7).
    Block blk = {};
    blk.x[0] = nan;
    blk.x[1] = -nan;
    blk.x[2] = 3.0f;
    blk.x[3] = -1.5f;
    EXPECT_EQ(QuantizeBlock(blk.x, 1.0f, Recipe::Standard(), packed), E4m3Encode(0.5f));
    EXPECT_EQ(CodeAt(packed, 0), 0x7);
    EXPECT_EQ(CodeAt(packed, 1), 0x7);
    EXPECT_EQ(CodeAt(packed, 2), 0x7);
    EXPECT_EQ(CodeAt(packed, 3), 0xd);  // -1.5 / 0.5 = -3
    ExpectMatchesRecomputed(blk, 1.0f, "nan");
  }
  {
    // A block of only NaN (and zeros) has amax 0: a zero block.
    Block blk = {};
    blk.x[7] = nan;
    blk.x[8] = -nan;
    EXPECT_EQ(QuantizeBlock(blk.x, 1.0f, Recipe::Standard(), packed), 0);
    EXPECT_EQ(packed[0] | packed[1], 0u);
  }
}

TEST(Block, TinyAndHugeGlobalScales) {
  uint32_t packed[2];
  {
    // g tiny: s * g underflows to a subnormal and 1 / (s g) overflows; r is
    // clamped to FLT_MAX so zeros stay zero codes (never NaN -> 0x7).
    const float g = FLT_TRUE_MIN;
    Block blk = {};
    blk.x[0] = 100.0f * FLT_TRUE_MIN;
    blk.x[1] = -30.0f * FLT_TRUE_MIN;
    blk.x[2] = -0.0f;
    const uint8_t b = QuantizeBlock(blk.x, g, Recipe::Standard(), packed);
    EXPECT_EQ(b, E4m3Encode(100.0f / 6.0f));
    const float sg = E4m3Decode(b) * g;
    ASSERT_TRUE(std::isinf(1.0f / sg)) << "the case under test";
    for (int i = 3; i < kBlockSize; ++i) EXPECT_EQ(CodeAt(packed, i), 0x0) << i;
    EXPECT_EQ(CodeAt(packed, 2), 0x8);
    EXPECT_EQ(CodeAt(packed, 0), E2m1Encode(blk.x[0] * FLT_MAX));
    EXPECT_EQ(CodeAt(packed, 1), E2m1Encode(blk.x[1] * FLT_MAX));
    ExpectMatchesRecomputed(blk, g, "tiny g");
  }
  {
    // amax = g = the smallest subnormal: s = e4m3(1/6) but s * g rounds to
    // 0, so r = 0 and every code is a (signed) zero.
    const float g = FLT_TRUE_MIN;
    Block blk = {};
    blk.x[0] = FLT_TRUE_MIN;
    blk.x[1] = -FLT_TRUE_MIN;
    const uint8_t b = QuantizeBlock(blk.x, g, Recipe::Standard(), packed);
    EXPECT_EQ(b, E4m3Encode(1.0f / 6.0f));
    EXPECT_EQ(CodeAt(packed, 0), 0x0);
    EXPECT_EQ(CodeAt(packed, 1), 0x8);
    ExpectMatchesRecomputed(blk, g, "s g underflow");
  }
  {
    // g huge: amax / (6 g) is below half the smallest E4M3 subnormal, the
    // scale byte is 0, r = 0 and every code is a signed zero.
    Block blk = {};
    for (int i = 0; i < kBlockSize; ++i) blk.x[i] = (i % 2 ? -1.0f : 1.0f) * (i + 1);
    EXPECT_EQ(QuantizeBlock(blk.x, 1e30f, Recipe::Standard(), packed), 0);
    for (int i = 0; i < kBlockSize; ++i) EXPECT_EQ(CodeAt(packed, i), i % 2 ? 0x8 : 0x0) << i;
    ExpectMatchesRecomputed(blk, 1e30f, "huge g");
  }
}

TEST(Block, DequantValueIsOneRoundingOfTheExactProduct) {
  // (e2m1 * s) is exact in fp32 (2 + 4 significant bits), so the only
  // rounding is the product with g; the f16/bf16 outputs round that fp32
  // value once more, to nearest even.
  std::mt19937 rng(16);
  std::uniform_real_distribution<float> e(-30.0f, 30.0f);
  for (int n = 0; n < 40; ++n) {
    const float g = std::exp2(e(rng));
    for (int sb = 0; sb < 0x7f; ++sb) {
      const float s = E4m3Decode(static_cast<uint8_t>(sb));
      for (int c = 0; c < 16; ++c) {
        const double exact = static_cast<double>(E2m1Decode(static_cast<uint8_t>(c))) * s;
        ASSERT_EQ(static_cast<double>(MulRn(E2m1Decode(static_cast<uint8_t>(c)), s)), exact);
        const float want = static_cast<float>(exact * g);
        const float got = DequantValue(static_cast<uint8_t>(c), s, g);
        ASSERT_EQ(FloatBits(got), FloatBits(want)) << c << " " << sb << " " << g;
        ASSERT_EQ(FloatToHalfBits(got), ToolkitHalfBits(want));
        ASSERT_EQ(FloatToBf16Bits(got), ToolkitBf16Bits(want));
      }
    }
  }
}

// The worked example of docs/format.md, byte for byte. If this changes, the
// document must change with it.
TEST(Block, WorkedExampleOfFormatDoc) {
  const Block blk = {{0.75f, -1.6875f, 2.5f, 0.015625f, -0.328125f, 5.0f, -4.375f, 1.0f, 0.0f,
                      -0.0f, 5.875f, -2.625f, 0.25f, 1.25f, -6.375f, 3.3125f}};
  const float g = 0.5f;
  uint32_t packed[2];
  const uint8_t b = QuantizeBlock(blk.x, g, Recipe::Standard(), packed);
  // amax / (6 g) = 6.375 / 3 = 2.125, a tie between 2.0 (0x40) and 2.25
  // (0x41): the even code wins.
  EXPECT_EQ(b, 0x40);
  EXPECT_EQ(E4m3Decode(b), 2.0f);
  const uint8_t want_bytes[kBlockBytes] = {0xb2, 0x04, 0x69, 0x2e, 0x80, 0xd7, 0x20, 0x5f};
  for (int i = 0; i < kBlockBytes; ++i) {
    EXPECT_EQ(static_cast<uint8_t>(packed[i / 4] >> (8 * (i % 4))), want_bytes[i]) << "byte " << i;
  }
  const float want_dq[kBlockSize] = {1.0f, -1.5f, 2.0f, 0.0f,  -0.5f, 4.0f, -4.0f, 1.0f,
                                     0.0f, -0.0f, 6.0f, -3.0f, 0.0f,  1.0f, -6.0f, 3.0f};
  float dq[kBlockSize];
  DequantizeBlock(packed, b, g, dq);
  for (int i = 0; i < kBlockSize; ++i) {
    EXPECT_EQ(FloatBits(dq[i]), FloatBits(want_dq[i])) << i << ": " << dq[i];
  }
  // Dequantized to bf16 and fp16 (exact here).
  EXPECT_EQ(FloatToBf16Bits(dq[14]), 0xc0c0);
  EXPECT_EQ(FloatToHalfBits(dq[14]), 0xc600);
  EXPECT_EQ(FloatToHalfBits(dq[9]), 0x8000);
  ExpectMatchesRecomputed(blk, g, "worked example");
  // FP8 materialization under the smallest safe FP8 scale, MinFp8Scale(0.5) = 3:
  // multiplier m = 0.5 / 3, fp8_i = e4m3((e2m1_i * 2) * m).
  absl::StatusOr<float> fp8_scale = MinFp8Scale(g);
  ASSERT_TRUE(fp8_scale.ok()) << fp8_scale.status();
  EXPECT_EQ(*fp8_scale, 3.0f);
  const float m = Fp8MaterializeMultiplier(g, *fp8_scale);
  EXPECT_EQ(FloatBits(m), 0x3e2aaaabu);
  const uint8_t want_fp8[kBlockSize] = {0x2b, 0xb0, 0x33, 0x00, 0xa3, 0x3b, 0xbb, 0x2b,
                                        0x00, 0x80, 0x40, 0xb8, 0x00, 0x2b, 0xc0, 0x38};
  for (int i = 0; i < kBlockSize; ++i) {
    EXPECT_EQ(MaterializeFp8Value(CodeAt(packed, i), E4m3Decode(b), m), want_fp8[i]) << i;
  }
}

// ===========================================================================
// FP8 materialization and MinFp8Scale
// ===========================================================================
TEST(Fp8Materialize, ValueIsE4m3OfProductLikeToolkit) {
  std::mt19937 rng(14);
  std::uniform_real_distribution<float> e(-12.0f, 12.0f);
  int64_t mismatches = 0;
  for (int n = 0; n < 60; ++n) {
    const float g = std::exp2(e(rng));
    const float fp8 = std::exp2(e(rng));
    const float m = Fp8MaterializeMultiplier(g, fp8);
    ASSERT_EQ(m, static_cast<float>(static_cast<double>(g) / fp8));
    for (int sb = 0; sb < 256; ++sb) {
      if ((sb & 0x7f) == 0x7f) continue;
      const float s = E4m3Decode(static_cast<uint8_t>(sb));
      for (int c = 0; c < 16; ++c) {
        // e2m1 * s is exact; one fp32 rounding of the product with m.
        const double v = static_cast<double>(E2m1Decode(static_cast<uint8_t>(c))) * s;
        const uint8_t want = ToolkitE4m3(static_cast<float>(v * m));
        const uint8_t got = MaterializeFp8Value(static_cast<uint8_t>(c), s, m);
        if (got != want && ++mismatches <= 8) {
          ADD_FAILURE() << "code " << c << " scale " << Hex(sb) << " m " << m << ": ours "
                        << Hex(got) << ", toolkit " << Hex(want);
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// FP8 keys: the encode is one fp32 product with the reciprocal, then the
// toolkit's saturating E4M3 conversion; the decode is one fp32 product.
TEST(Fp8Keys, EncodeAndDecodeAreOneRoundingEach) {
  std::mt19937 rng(41);
  std::uniform_real_distribution<float> e(-20.0f, 20.0f);
  std::normal_distribution<float> x(0.0f, 1.0f);
  int64_t mismatches = 0;
  for (int n = 0; n < 200; ++n) {
    const float g = std::exp2(e(rng));
    const float r = Fp8KeyEncodeMultiplier(g);
    ASSERT_EQ(r, static_cast<float>(1.0 / static_cast<double>(g)));
    for (int i = 0; i < 256; ++i) {
      const float v = x(rng) * g * 300.0f;
      const uint8_t want = ToolkitE4m3(static_cast<float>(static_cast<double>(v) * r));
      const uint8_t got = QuantizeFp8Key(v, r);
      if (got != want && ++mismatches <= 8) {
        ADD_FAILURE() << "x " << v << " g " << g << ": ours " << Hex(got) << ", toolkit "
                      << Hex(want);
      }
    }
    for (int c = 0; c < 256; ++c) {
      if ((c & 0x7f) == 0x7f) continue;
      const double want = static_cast<double>(E4m3Decode(static_cast<uint8_t>(c))) * g;
      EXPECT_EQ(DequantFp8Key(static_cast<uint8_t>(c), g), static_cast<float>(want));
    }
  }
  EXPECT_EQ(mismatches, 0);
  // Saturation, zeros, NaN and a subnormal scale (clamped reciprocal).
  EXPECT_EQ(QuantizeFp8Key(1e30f, 1.0f), 0x7e);
  EXPECT_EQ(QuantizeFp8Key(-1e30f, 1.0f), 0xfe);
  EXPECT_EQ(QuantizeFp8Key(std::nanf(""), 1.0f), 0x7f);
  const float tiny = BitsFloat(0x00000100u);
  EXPECT_EQ(Fp8KeyEncodeMultiplier(tiny), BitsFloat(0x7f7fffffu));
  EXPECT_EQ(QuantizeFp8Key(0.0f, Fp8KeyEncodeMultiplier(tiny)), 0x00);
  EXPECT_EQ(QuantizeFp8Key(1e-30f, Fp8KeyEncodeMultiplier(tiny)), 0x7e);
}

TEST(Fp8Keys, ScaleMapsAmaxToTheTopOfE4m3) {
  for (float amax : {1e-3f, 0.5f, 3.0f, 448.0f, 1e6f, 3e37f}) {
    const float g = MakeFp8KeyScale(amax);
    EXPECT_EQ(g, static_cast<float>(static_cast<double>(amax) / 448.0)) << amax;
    EXPECT_TRUE(IsValidGlobalScale(g));
    EXPECT_EQ(QuantizeFp8Key(amax, Fp8KeyEncodeMultiplier(g)), 0x7e) << amax;
  }
  EXPECT_EQ(MakeFp8KeyScale(0.0f), MakeFp8KeyScale(1.0f));
  EXPECT_EQ(MakeFp8KeyScale(-2.0f), MakeFp8KeyScale(1.0f));
  EXPECT_EQ(MakeFp8KeyScale(std::nanf("")), MakeFp8KeyScale(1.0f));
  EXPECT_EQ(MakeFp8KeyScale(1e-44f), BitsFloat(0x00800000u));
  EXPECT_EQ(MakeFp8KeyScale(INFINITY), MaxGlobalScale());
  EXPECT_TRUE(std::isfinite(448.0f * MaxGlobalScale()));
}

TEST(Fp8Keys, MaterializeCopiesUnderEqualScalesAndReencodesOtherwise) {
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> e(-6.0f, 6.0f);
  for (int c = 0; c < 256; ++c) {
    EXPECT_EQ(MaterializeFp8KeyValue(static_cast<uint8_t>(c), 1.0f), c);  // NaN codes too
  }
  for (int n = 0; n < 50; ++n) {
    const float g = std::exp2(e(rng)), f = std::exp2(e(rng));
    const float m = Fp8MaterializeMultiplier(g, f);
    if (m == 1.0f) continue;
    for (int c = 0; c < 256; ++c) {
      if ((c & 0x7f) == 0x7f) continue;
      const float v = E4m3Decode(static_cast<uint8_t>(c));
      EXPECT_EQ(MaterializeFp8KeyValue(static_cast<uint8_t>(c), m),
                ToolkitE4m3(static_cast<float>(static_cast<double>(v) * m)));
    }
  }
  EXPECT_EQ(MinFp8ScaleForFp8Keys(0.25f), 0.25f);
  EXPECT_EQ(Fp8MaterializeMultiplier(0.25f, MinFp8ScaleForFp8Keys(0.25f)), 1.0f);
}

TEST(Fp8Materialize, MinFp8ScaleIsTheSmallestNonSaturatingScale) {
  std::mt19937 rng(15);
  // Every valid g: up to MaxGlobalScale() (about 2^116.6); subnormal g too.
  std::uniform_real_distribution<float> e(-148.0f, 116.5f);
  const float top = kE2m1Max * kE4m3Max;  // the largest magnitude a cache holds, over g
  for (int n = 0; n < 3000; ++n) {
    const float g = std::exp2(e(rng));
    ASSERT_TRUE(g > 0 && std::isfinite(g));
    absl::StatusOr<float> fs = MinFp8Scale(g);
    ASSERT_TRUE(fs.ok()) << g << ": " << fs.status();
    const float f = *fs;
    ASSERT_TRUE(f > 0 && std::isfinite(f)) << g;
    EXPECT_LE(MulRn(top, Fp8MaterializeMultiplier(g, f)), kE4m3Max) << "g=" << g;
    const float below = std::nextafter(f, 0.0f);
    if (below > 0) {
      EXPECT_GT(MulRn(top, Fp8MaterializeMultiplier(g, below)), kE4m3Max) << "g=" << g;
    }
    // About 6 g (within a few ulps where 6 g is normal).
    if (6.0 * g >= FLT_MIN) {
      EXPECT_NEAR(f / (6.0 * g), 1.0, 1e-6) << g;
    }
    // The largest cached value materializes to 448 itself, not a clipped value.
    EXPECT_EQ(MaterializeFp8Value(0x7, kE4m3Max, Fp8MaterializeMultiplier(g, f)), 0x7e) << g;
  }
}

TEST(Fp8Materialize, MinFp8ScaleRejectsInvalidGlobalScale) {
  for (float g : {0.0f, -0.0f, -1.0f, -FLT_TRUE_MIN, kInf, -kInf,
                  std::numeric_limits<float>::quiet_NaN(), FLT_MAX, FLT_MAX / 5.0f,
                  FLT_MAX / 7.0f, std::nextafter(MaxGlobalScale(), FLT_MAX)}) {
    absl::StatusOr<float> fs = MinFp8Scale(g);
    ASSERT_FALSE(fs.ok()) << g;
    EXPECT_EQ(fs.status().code(), absl::StatusCode::kInvalidArgument) << g;
    EXPECT_NE(fs.status().message().find("global_scale"), std::string::npos) << fs.status();
  }
  EXPECT_TRUE(MinFp8Scale(MaxGlobalScale()).ok());
  EXPECT_TRUE(MinFp8Scale(FLT_TRUE_MIN).ok());
}

TEST(GlobalScaleRange, MaxGlobalScaleIsTheLargestWithAFiniteTopValue) {
  const float top = kE2m1Max * kE4m3Max;  // 2688
  EXPECT_TRUE(std::isfinite(MulRn(top, MaxGlobalScale())));
  EXPECT_FALSE(std::isfinite(MulRn(top, std::nextafter(MaxGlobalScale(), FLT_MAX))));
  EXPECT_TRUE(IsValidGlobalScale(MaxGlobalScale()));
  EXPECT_TRUE(IsValidGlobalScale(FLT_TRUE_MIN));
  for (float g : {0.0f, -1.0f, kInf, std::nanf(""), FLT_MAX / 6.0f}) {
    EXPECT_FALSE(IsValidGlobalScale(g)) << g;
  }
}

TEST(GlobalScaleRange, ExtremeInputsUnderTheLargestScaleKeepTheDocumentedBytes) {
  // Under g = MaxGlobalScale() every product is finite: scale bytes stay in
  // 0x00..0x7E, infinities encode to +-6 with their sign.
  const float g = MaxGlobalScale();
  float x[kBlockSize];
  for (int i = 0; i < kBlockSize; ++i) x[i] = (i % 2 ? -1.0f : 1.0f) * FLT_MAX / (i + 1);
  x[3] = -kInf;
  x[4] = kInf;
  for (const Recipe& r : {Recipe::Standard(), Recipe::FourOverSix(256, ErrorMetric::kMse)}) {
    uint32_t packed[2];
    const uint8_t b = QuantizeBlock(x, g, r, packed);
    EXPECT_LE(b, 0x7e);
    EXPECT_EQ((packed[0] >> 12) & 0xfu, 0xfu);  // element 3: -inf -> -6
    EXPECT_EQ((packed[0] >> 16) & 0xfu, 0x7u);  // element 4: +inf -> +6
  }
}

}  // namespace
}  // namespace fp4kv
