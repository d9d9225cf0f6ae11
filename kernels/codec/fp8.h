// Number formats on the wire: BF16, FP8 e4m3 (OCP "fn": no infinities, max 448) with per-128-channel fp32 scales,
// and UE8M0 scale bytes. Layer: kernels (host + device). The CPU backend uses these functions; CUDA kernels use
// the hardware conversions, and GPU tests compare the two bit for bit.
//
// Scale arithmetic reproduces DeepEP V1 exactly (internode_ll.cu at 567632d):
//   amax = fmaxf(1e-4, max |x|);  scale = 448 / amax;  scale_inv = amax * (1.0f / 448.0f)
//   round_scale: e = log2_ceil(amax * (1.0f / 448.0f)); scale = 2^-e; scale_inv = 2^e   (exponent-bit arithmetic)
//   code = e4m3_rn_satfinite(x * scale);  ue8m0 byte = bits(scale_inv) >> 23
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "runtime/protocol/hd.h"

namespace llep::kernels {

inline constexpr float kFp8E4m3Max = 448.0f;
inline constexpr float kFp8E4m3MaxInv = 1.0f / 448.0f;
inline constexpr float kFp8AmaxFloor = 1e-4f;

LLEP_HD uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
LLEP_HD float BitsToFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

LLEP_HD float Bf16ToFloat(uint16_t h) { return BitsToFloat(uint32_t{h} << 16); }

/// Round-to-nearest-even, NaN kept quiet (matches __float2bfloat16_rn).
LLEP_HD uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/// e4m3 → float. Code 0x7F/0xFF is NaN; there are no infinities.
LLEP_HD float E4m3ToFloat(uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  const float sign = (c & 0x80) ? -1.0f : 1.0f;
  if (e == 15 && m == 7) return NAN;
  if (e == 0) return sign * ldexpf(static_cast<float>(m), -9);
  return sign * ldexpf(1.0f + m / 8.0f, e - 7);
}

/// float → e4m3, round to nearest even, saturating finite and infinite values to ±448, NaN to 0x7F
/// (matches cvt.rn.satfinite.e4m3x2.f32 / __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)).
LLEP_HD uint8_t FloatToE4m3(float f) {
  const uint32_t u = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;                    // NaN
  if (a > FloatBits(kFp8E4m3Max)) return sign | 0x7E;  // beyond 448, incl. inf: saturate
  const int exp = static_cast<int>(a >> 23) - 127;
  if (exp < -6) {
    // Below the smallest normal (2^-6): e4m3 subnormals are m * 2^-9; the scaling by 2^9 is exact.
    const float q = rintf(BitsToFloat(a) * 512.0f);  // RNE; q == 8 encodes the smallest normal, 0x08
    return sign | static_cast<uint8_t>(q);
  }
  uint32_t keep = (a >> 20) & 7u;  // top 3 mantissa bits
  const uint32_t rem = a & 0xFFFFFu, half = 0x80000u;
  int e = exp;
  if (rem > half || (rem == half && (keep & 1u))) ++keep;
  if (keep == 8) {
    keep = 0;
    ++e;
  }
  uint32_t code = (static_cast<uint32_t>(e + 7) << 3) | keep;
  if (code > 0x7E) code = 0x7E;
  return sign | static_cast<uint8_t>(code);
}

/// max(acc, v) that ignores NaN in v, signalling NaNs included, as the GPU's max.f32 does. glibc's fmaxf follows
/// IEEE maxNum and returns NaN for a signalling NaN (bf16 0x7F81.. are signalling), which would make the host
/// amax differ from the GPU's, so host reductions use this instead.
LLEP_HD float MaxIgnoringNan(float acc, float v) { return v > acc ? v : acc; }

/// ceil(log2(x)) for a positive normal float, from its exponent bits (DeepEP's fast_log2_ceil).
LLEP_HD int Log2Ceil(float x) {
  const uint32_t b = FloatBits(x);
  const int exp = static_cast<int>((b >> 23) & 0xFF);
  return exp - 127 + ((b & 0x7FFFFFu) != 0 ? 1 : 0);
}
/// 2^e for e in the normal float range (DeepEP's fast_pow2).
LLEP_HD float Pow2(int e) { return BitsToFloat(static_cast<uint32_t>(e + 127) << 23); }

struct Fp8Scale {
  float scale;      ///< multiply x by this before converting
  float scale_inv;  ///< multiply the e4m3 value by this to dequantise (what travels)
};

/// Scales for one 128-channel group whose max |x| is `amax_raw` (the floor is applied here).
LLEP_HD Fp8Scale ComputeFp8Scale(float amax_raw, bool round_scale) {
  const float amax = fmaxf(kFp8AmaxFloor, amax_raw);
  if (round_scale) {
    const int e = Log2Ceil(amax * kFp8E4m3MaxInv);
    return {Pow2(-e), Pow2(e)};
  }
  return {kFp8E4m3Max / amax, amax * kFp8E4m3MaxInv};
}

/// UE8M0 byte of a power-of-two scale_inv (DeepEP: float bits >> 23).
LLEP_HD uint8_t Ue8m0FromScaleInv(float scale_inv) { return static_cast<uint8_t>(FloatBits(scale_inv) >> 23); }
LLEP_HD float ScaleInvFromUe8m0(uint8_t b) { return BitsToFloat(uint32_t{b} << 23); }

// AMD CDNA3 (MI300X) FP8 GEMMs read e4m3fnuz: bias 8 instead of 7, no negative zero, one NaN (0x80), max 240.
// The wire and llep's outputs stay e4m3fn (the DeepEP contract); a reader feeding such a GEMM converts where it reads
// (kernels/HIP_PORT.md). The same bits mean half the value in fnuz, so the conversion keeps every byte except the
// special codes and doubles the group's scale_inv: fn value = fnuz value * kFnToFnuzScaleInvFactor.

/// Factor on a 128-channel group's scale_inv when its codes are reread as e4m3fnuz.
inline constexpr float kFnToFnuzScaleInvFactor = 2.0f;

/// e4m3fn code -> the e4m3fnuz code of half its value: the same byte, but -0 (0x80, fnuz's NaN) becomes +0 and the
/// NaNs (0x7F, 0xFF: fnuz's ±240) become fnuz's NaN.
LLEP_HD uint8_t E4m3FnToFnuz(uint8_t c) {
  if ((c & 0x7F) == 0x7F) return 0x80;
  return c == 0x80 ? 0x00 : c;
}

/// e4m3fnuz code -> float (reference decoder for tests and host readers).
LLEP_HD float E4m3FnuzToFloat(uint8_t c) {
  if (c == 0x80) return NAN;
  const int e = (c >> 3) & 0xF, m = c & 7;
  const float sign = (c & 0x80) ? -1.0f : 1.0f;
  if (e == 0) return sign * ldexpf(static_cast<float>(m), -10);
  return sign * ldexpf(1.0f + m / 8.0f, e - 8);
}

}  // namespace llep::kernels
