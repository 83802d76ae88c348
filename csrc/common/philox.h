// Philox-4x32-10 (Random123) and the dropout keep-mask of docs/kernel_abi.md.
#ifndef ATTNAUX_CSRC_COMMON_PHILOX_H_
#define ATTNAUX_CSRC_COMMON_PHILOX_H_

#include <array>
#include <cmath>
#include <cstdint>

namespace attnaux {

inline std::array<uint32_t, 4> Philox4x32x10(std::array<uint32_t, 4> counter,
                                             std::array<uint32_t, 2> key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    uint64_t p0 = uint64_t{kM0} * c0;
    uint64_t p1 = uint64_t{kM1} * c2;
    uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    uint32_t n1 = static_cast<uint32_t>(p1);
    uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    uint32_t n3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
  }
  return {c0, c1, c2, c3};
}

// keep = word >= threshold; threshold = uint32(min(floor(rate * 2^32), 2^32 - 1)).
inline uint32_t DropoutThreshold(float rate) {
  double t = std::floor(static_cast<double>(rate) * 4294967296.0);
  if (!(t > 0.0)) return 0;
  if (t > 4294967295.0) return 0xffffffffu;
  return static_cast<uint32_t>(t);
}

// The four Philox words that cover linear indices (e & ~3) .. (e | 3) of the [B, Hq, Sq, Skv]
// probability tensor; rng_state = (seed_lo, seed_hi, offset_lo, offset_hi).
inline std::array<uint32_t, 4> DropoutWords(const uint32_t* rng_state, uint64_t e) {
  uint64_t group = e >> 2;
  return Philox4x32x10({static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32),
                        rng_state[2], rng_state[3]},
                       {rng_state[0], rng_state[1]});
}

}  // namespace attnaux

#endif  // ATTNAUX_CSRC_COMMON_PHILOX_H_
