// Division by a divisor fixed per buffer (the local expert count, the rank count, the grid) as a multiply-high and a
// shift.
// Layer: runtime/protocol (depends on hd.h only). Why: a kernel's `g / E_loc` with a runtime E_loc compiles to a
// ~20-instruction sequence, and the receive launches run such code once per launch from a cold instruction cache —
// Nsight Compute showed warps waiting on instruction fetch for most of a small-T receive (bench/RESULTS.md, session
// 12). The host computes the multiplier once (ComputeLlLayout); kernels and the CPU backend divide with it.
#pragma once

#include <cstdint>

#include "runtime/protocol/hd.h"

namespace llep::protocol {

/// n / divisor for 0 <= n < 2^31 and 1 <= divisor < 2^31 (every index llep divides is an int32 >= 0): with
/// s = ceil(log2(divisor)) and m = floor(2^32 * (2^s - divisor) / divisor) + 1, n / divisor = (mulhi(n, m) + n) >> s
/// (Granlund and Montgomery, "Division by invariant integers using multiplication", 1994; the sum fits 32 bits
/// because n < 2^31). Checked against `/` in ll_layout_test (FastDivisor*).
struct FastDivisor {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;  ///< divisor 1 (s = 0): mulhi(n, 1) = 0, so n / 1 = n
  uint32_t shift = 0;

  LLEP_HD static constexpr FastDivisor Make(uint32_t d) {
    FastDivisor f;
    f.divisor = d;
    while ((uint64_t{1} << f.shift) < d) ++f.shift;
    f.multiplier = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - d) / d + 1);
    return f;
  }
  LLEP_HD uint32_t MulHi(uint32_t n) const {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
    return __umulhi(n, multiplier);
#else
    return static_cast<uint32_t>((uint64_t{n} * multiplier) >> 32);
#endif
  }
  LLEP_HD int Div(int n) const { return static_cast<int>((MulHi(static_cast<uint32_t>(n)) + n) >> shift); }
  LLEP_HD int Mod(int n) const { return n - Div(n) * static_cast<int>(divisor); }
};

}  // namespace llep::protocol
