// Portable SIMD helpers for the CPU kernels: one float vector type (GCC vector extensions, so any
// -march compiles: AVX-512 gives 16 lanes, AVX/AVX2 8, anything else 4), vectorised exp and tanh,
// and scalar bf16/f16 <-> float conversion by bit manipulation.
#ifndef ATTNAUX_CSRC_CPU_CPU_SIMD_H_
#define ATTNAUX_CSRC_CPU_CPU_SIMD_H_

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace attnaux::cpu {

#if defined(__AVX512F__)
inline constexpr int kLanes = 16;
#elif defined(__AVX__)
inline constexpr int kLanes = 8;
#else
inline constexpr int kLanes = 4;
#endif

typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kLanes * sizeof(int32_t))));

// memcpy compiles to one unaligned vector move and is alias-safe.
inline VecF Load(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, VecF v) { std::memcpy(p, &v, sizeof(v)); }
// x - 0 is x for every x (-0 included), so the compiler folds it into a broadcast, and into an
// FMA's broadcast memory operand; `VecF{} + x` is not foldable (0 + -0 is +0) and cost an add and
// a register broadcast per use on the FMA ports: 1.3-1.5x on every matrix product.
inline VecF Splat(float x) { return x - VecF{}; }
inline VecF Max(VecF a, VecF b) { return a > b ? a : b; }

// exp(x) to about 1 ulp (Cody-Waite reduction + Cephes' degree-6 polynomial). Exactly 0 for
// x < ln(2^-126) (flushes what would be subnormal), in particular for -inf; NaN stays NaN. Only
// used for x <= ~88, which is all attention needs (arguments are differences to a maximum).
inline VecF Exp(VecF x) {
  const VecF kHi = Splat(88.3762626647949f);
  const VecF kLo = Splat(-87.3365447505531f);
  const float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer.
#if defined(__AVX512F__)
  // One min for the upper clamp (min(kHi, x) keeps a NaN x); no lower clamp: vscalefps takes any
  // n, and x < kLo is replaced by 0 at the end. Bitwise the portable version's results.
  static_assert(kLanes == 16, "AVX-512 vectors");
  __m512 xm;
  std::memcpy(&xm, &x, sizeof(xm));
  const __m512 xcm = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), xm);
  VecF xc;
  std::memcpy(&xc, &xcm, sizeof(xc));
#else
  VecF xc = x > kHi ? kHi : x;
  xc = xc < kLo ? kLo : xc;
#endif
  VecF t = xc * 1.44269504088896341f + kMagic;
  VecF n = t - kMagic;
  VecF r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  VecF poly = Splat(1.9875691500e-4f);
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * (r * r) + r + 1.0f;
#if defined(__AVX512F__)
  // poly * 2^n in one instruction (the same exact product as building 2^n's bits below)
  __m512 pm, nm;
  std::memcpy(&pm, &poly, sizeof(pm));
  std::memcpy(&nm, &n, sizeof(nm));
  const __m512 scaled = _mm512_scalef_ps(pm, nm);
  VecF result;
  std::memcpy(&result, &scaled, sizeof(result));
  (void)kHi;
#else
  VecI magic_bits = (VecI)Splat(kMagic);
  VecI n_int = (VecI)t - magic_bits;
  VecF pow2 = (VecF)((n_int + 127) << 23);
  VecF result = poly * pow2;
#endif
  return x < kLo ? VecF{} : result;
}

// tanh(x): an odd Taylor polynomial near 0 (where (1 - e) / (1 + e) loses relative accuracy),
// else (1 - e) / (1 + e) with e = exp(-2|x|); NaN stays NaN.
inline VecF Tanh(VecF x) {
  VecI sign = (VecI)x & (int32_t)0x80000000;
  VecF a = (VecF)((VecI)x & 0x7fffffff);
  VecF e = Exp(a * -2.0f);
  VecF big = (1.0f - e) / (1.0f + e);
  VecF a2 = a * a;
  VecF small = a + a * a2 * (-1.0f / 3 + a2 * (2.0f / 15 + a2 * (-17.0f / 315)));
  VecF mag = a < 0.0625f ? small : big;
  return (VecF)((VecI)mag | sign);
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(uint32_t{h} << 16); }

// kLanes bfloat16 values widened to float32 (the same bits as Bf16ToFloat, a vector at a time).
typedef uint16_t VecBf16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t VecU32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
inline VecF LoadBf16(const uint16_t* p) {
  VecBf16 h;
  std::memcpy(&h, p, sizeof(h));
  const VecU32 bits = __builtin_convertvector(h, VecU32) << 16;
  VecF v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// Round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float HalfToFloat(uint16_t h) {
  uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in float.
    float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return BitsToFloat(sign | FloatToBits(magnitude));
  }
  return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Round to nearest even, overflow to inf, NaN stays NaN (F. Giesen's float_to_half_fast3_rtne).
inline uint16_t FloatToHalf(float f) {
  uint32_t u = FloatToBits(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t out;
  if (u >= (127u + 16u) << 23) {
    out = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < (113u << 23)) {
    // Subnormal or zero half: let the FPU round by adding 0.5 (whose ulp is 2^-24).
    float denorm = BitsToFloat(u) + 0.5f;
    out = FloatToBits(denorm) - FloatToBits(0.5f);
  } else {
    uint32_t mantissa_odd = (u >> 13) & 1u;
    u += (uint32_t(15 - 127) << 23) + 0xfffu;
    u += mantissa_odd;
    out = u >> 13;
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

}  // namespace attnaux::cpu

#endif  // ATTNAUX_CSRC_CPU_CPU_SIMD_H_
