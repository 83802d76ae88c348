// Philox-4x32-10 (Random123) and the dropout keep-mask of docs/kernel_abi.md, for the CPU kernels
// and the CUDA kernels alike: one definition, so that the GPU keep-mask is bitwise the CPU one.
#ifndef ATTNAUX_CSRC_COMMON_PHILOX_H_
#define ATTNAUX_CSRC_COMMON_PHILOX_H_

#include <cmath>
#include <cstdint>

#include "common/host_device.h"

namespace attnaux {

// The four 32-bit words of one Philox block.
struct PhiloxWords {
  uint32_t w[4];
  ATTNAUX_HOST_DEVICE uint32_t operator[](int i) const { return w[i]; }
};

// hi:lo = a * b: on the device mul.lo and mul.hi (as the CUDA kernels had it), on the host one
// 64-bit product (as the CPU kernels had it). The same bits either way.
ATTNAUX_HOST_DEVICE void MulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
#if defined(__CUDA_ARCH__)
  *lo = a * b;
  *hi = __umulhi(a, b);
#else
  const uint64_t p = uint64_t{a} * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
#endif
}

// counter = (c0, c1, c2, c3), key = (k0, k1).
ATTNAUX_HOST_DEVICE PhiloxWords Philox4x32x10(uint32_t c0, uint32_t c1, uint32_t c2,
                                                     uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  ATTNAUX_PRAGMA_UNROLL
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    MulHiLo(kM0, c0, &hi0, &lo0);
    MulHiLo(kM1, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return {{c0, c1, c2, c3}};
}

// keep = word >= threshold; threshold = uint32(min(floor(rate * 2^32), 2^32 - 1)). Host only: the
// handlers compute it once per call.
inline uint32_t DropoutThreshold(float rate) {
  double t = std::floor(static_cast<double>(rate) * 4294967296.0);
  if (!(t > 0.0)) return 0;
  if (t > 4294967295.0) return 0xffffffffu;
  return static_cast<uint32_t>(t);
}

// The four Philox words of element group `group` (elements 4 * group .. 4 * group + 3, row-major)
// of the [B, Hq, Sq, Skv] probability tensor; rng_state = (seed_lo, seed_hi, offset_lo,
// offset_hi): counter (group_lo, group_hi, offset_lo, offset_hi), key (seed_lo, seed_hi).
ATTNAUX_HOST_DEVICE PhiloxWords DropoutGroupWords(const uint32_t* rng_state, uint64_t group) {
  return Philox4x32x10(static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32),
                       rng_state[2], rng_state[3], rng_state[0], rng_state[1]);
}

// The four Philox words that cover linear indices (e & ~3) .. (e | 3).
ATTNAUX_HOST_DEVICE PhiloxWords DropoutWords(const uint32_t* rng_state, uint64_t e) {
  return DropoutGroupWords(rng_state, e >> 2);
}

}  // namespace attnaux

#endif  // ATTNAUX_CSRC_COMMON_PHILOX_H_
