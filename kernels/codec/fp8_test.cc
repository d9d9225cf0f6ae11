// The reference codecs against brute force: e4m3 conversion picks the nearest code with ties to even and
// saturates like cvt.rn.satfinite; BF16 rounds to nearest even; scales follow DeepEP's arithmetic exactly.
#include "kernels/codec/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

namespace llep::kernels {
namespace {

// Nearest finite e4m3 code by exhaustive search; ties go to the even code (even mantissa LSB).
uint8_t BruteForceE4m3(float x) {
  if (std::isnan(x)) return 0x7F;
  const float a = std::fabs(x);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (a > 448.0f) return sign | 0x7E;
  int best = 0;
  double best_err = 1e300;
  for (int c = 0; c <= 0x7E; ++c) {
    const double err = std::fabs(static_cast<double>(E4m3ToFloat(static_cast<uint8_t>(c))) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return sign | static_cast<uint8_t>(best);
}

TEST(E4m3Test, DecodesKnownCodes) {
  EXPECT_EQ(E4m3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0xFE), -448.0f);
  EXPECT_EQ(E4m3ToFloat(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(E4m3ToFloat(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(E4m3ToFloat(0x38), 1.0f);
  EXPECT_TRUE(std::isnan(E4m3ToFloat(0x7F)));
  EXPECT_TRUE(std::isnan(E4m3ToFloat(0xFF)));
}

TEST(E4m3Test, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(FloatToE4m3(E4m3ToFloat(static_cast<uint8_t>(c))), c) << "code " << c;
  }
}

TEST(E4m3Test, MidpointsRoundToEven) {
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = E4m3ToFloat(static_cast<uint8_t>(c)), hi = E4m3ToFloat(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;  // exact in float
    const uint8_t want = (c & 1) == 0 ? c : c + 1;
    EXPECT_EQ(FloatToE4m3(mid), want) << "between codes " << c << " and " << c + 1;
    EXPECT_EQ(FloatToE4m3(-mid), 0x80 | want);
    EXPECT_EQ(FloatToE4m3(std::nextafter(mid, 0.0f)), c);
    EXPECT_EQ(FloatToE4m3(std::nextafter(mid, 1e9f)), c + 1);
  }
}

TEST(E4m3Test, SaturatesAndKeepsNan) {
  EXPECT_EQ(FloatToE4m3(448.0f), 0x7E);
  EXPECT_EQ(FloatToE4m3(463.9f), 0x7E);
  EXPECT_EQ(FloatToE4m3(464.0f), 0x7E);
  EXPECT_EQ(FloatToE4m3(1e30f), 0x7E);
  EXPECT_EQ(FloatToE4m3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(FloatToE4m3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(FloatToE4m3(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(FloatToE4m3(std::ldexp(1.0f, -11)), 0x00);  // below half the smallest subnormal
  EXPECT_EQ(FloatToE4m3(-0.0f), 0x80);
}

TEST(E4m3Test, MatchesBruteForceOnRandomFloats) {
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-14, 10);
  for (int i = 0; i < 300000; ++i) {
    float x = std::ldexp(mant(rng), expo(rng));
    if (rng() & 1) x = -x;
    ASSERT_EQ(FloatToE4m3(x), BruteForceE4m3(x)) << "x = " << x;
  }
}

TEST(Bf16Test, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x3F808000u)), 0x3F80);  // tie, even stays
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x3F818000u)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x3F808001u)), 0x3F81);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    if (!std::isnan(f)) ASSERT_EQ(FloatToBf16(f), h);
  }
}

TEST(ScaleTest, FollowsDeepEpArithmetic) {
  const Fp8Scale floor = ComputeFp8Scale(0.0f, false);
  EXPECT_EQ(floor.scale, 448.0f / 1e-4f);
  EXPECT_EQ(floor.scale_inv, 1e-4f * (1.0f / 448.0f));
  const Fp8Scale s = ComputeFp8Scale(3.7f, false);
  EXPECT_EQ(s.scale, 448.0f / 3.7f);
  EXPECT_EQ(s.scale_inv, 3.7f * (1.0f / 448.0f));
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-12.0f, 12.0f);
  for (int i = 0; i < 10000; ++i) {
    const float amax = std::exp2(u(rng));
    const Fp8Scale r = ComputeFp8Scale(amax, true);
    const float exact = std::fmax(amax, 1e-4f) * (1.0f / 448.0f);
    // Power of two, the smallest one >= amax / 448: nothing rounds past 448 after scaling.
    EXPECT_EQ(FloatBits(r.scale_inv) & 0x7FFFFFu, 0u);
    EXPECT_GE(r.scale_inv, exact);
    EXPECT_LT(r.scale_inv, 2 * exact);
    EXPECT_EQ(r.scale * r.scale_inv, 1.0f);
    EXPECT_EQ(ScaleInvFromUe8m0(Ue8m0FromScaleInv(r.scale_inv)), r.scale_inv);
  }
  EXPECT_EQ(Log2Ceil(1.0f), 0);
  EXPECT_EQ(Log2Ceil(1.5f), 1);
  EXPECT_EQ(Log2Ceil(0.25f), -2);
  EXPECT_EQ(Ue8m0FromScaleInv(1.0f), 127);
}

}  // namespace
}  // namespace llep::kernels

namespace llep::kernels {
namespace {

TEST(ScaleTest, AmaxIgnoresEveryNanLikeTheGpu) {
  const float snan = BitsToFloat(0x7F810000u), qnan = BitsToFloat(0x7FC10000u);
  EXPECT_EQ(MaxIgnoringNan(INFINITY, snan), INFINITY);
  EXPECT_EQ(MaxIgnoringNan(2.0f, qnan), 2.0f);
  EXPECT_EQ(MaxIgnoringNan(2.0f, 3.0f), 3.0f);
  EXPECT_EQ(MaxIgnoringNan(0.0f, INFINITY), INFINITY);
}

}  // namespace
}  // namespace llep::kernels

namespace llep::kernels {
namespace {

// Every e4m3fn code reread as e4m3fnuz after E4m3FnToFnuz, with the group's scale_inv doubled, has the fn value;
// NaNs stay NaN; nothing maps to fnuz's NaN but a NaN (a finite value never turns into one).
TEST(E4m3FnuzTest, EveryFnCodeKeepsItsValue) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const uint8_t fn = static_cast<uint8_t>(c), fnuz = E4m3FnToFnuz(fn);
    const float want = E4m3ToFloat(fn);
    if (std::isnan(want)) {
      EXPECT_EQ(fnuz, 0x80) << c;
      ++nans;
      continue;
    }
    EXPECT_NE(fnuz, 0x80) << c;
    EXPECT_EQ(E4m3FnuzToFloat(fnuz) * kFnToFnuzScaleInvFactor, want) << c;
  }
  EXPECT_EQ(nans, 2);
}

// The fnuz decoder against its definition: bias 8, subnormals m * 2^-10, 0x80 the only NaN, ±240 the extremes.
TEST(E4m3FnuzTest, DecoderFollowsTheFormat) {
  EXPECT_EQ(E4m3FnuzToFloat(0x7F), 240.0f);
  EXPECT_EQ(E4m3FnuzToFloat(0xFF), -240.0f);
  EXPECT_EQ(E4m3FnuzToFloat(0x01), std::ldexp(1.0f, -10));
  EXPECT_EQ(E4m3FnuzToFloat(0x08), std::ldexp(1.0f, -7));
  EXPECT_EQ(E4m3FnuzToFloat(0x00), 0.0f);
  int nans = 0;
  for (int c = 0; c < 256; ++c) nans += std::isnan(E4m3FnuzToFloat(static_cast<uint8_t>(c))) ? 1 : 0;
  EXPECT_EQ(nans, 1);
}

}  // namespace
}  // namespace llep::kernels
