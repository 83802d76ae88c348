// Throughput of AVX-512 FMA against AVX-512 BF16's VDPBF16PS on one core: the ceiling behind the
// CPU kernels' bfloat16 path (issue 25: bf16 at 1.5x the float32 speed). VDPBF16PS does 32
// multiply-adds where an FMA does 16; what matters is how often each issues.
//
//   gcc -O2 -mavx512f -mavx512bf16 benchmarks/cpu_bf16_throughput.c -o /tmp/tp && /tmp/tp
//
// Twelve independent chains (enough to cover either instruction's latency at two a cycle), each
// started from its own value and pinned in a register by an empty asm: identical chains, as an
// earlier version of this file had, are merged into one by the compiler, which then measures the
// latency of one chain instead of the throughput.
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

enum { kChains = 12 };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  const long n = 100000000;
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.001f * (i + 1));
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  double t = now();
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) {
      acc[i] = _mm512_fmadd_ps(acc[i], x, y);
      __asm__("" : "+v"(acc[i]));
    }
  }
  const double t_fma = now() - t;
  const __m512bh bx = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  const __m512bh by = (__m512bh)_mm512_set1_epi32(0x3f7f3f7f);
  t = now();
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) {
      acc[i] = _mm512_dpbf16_ps(acc[i], bx, by);
      __asm__("" : "+v"(acc[i]));
    }
  }
  const double t_bf16 = now() - t;
  __m512 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
  const double ops = (double)kChains * n;
  printf("FMA: %.1f GFLOP/s/core (%.2f instr/ns)  VDPBF16PS: %.1f GFLOP/s/core (%.2f instr/ns)"
         "  FLOP ratio %.2f  (%g)\n",
         ops * 32 / t_fma * 1e-9, ops / t_fma * 1e-9, ops * 64 / t_bf16 * 1e-9,
         ops / t_bf16 * 1e-9, (ops * 64 / t_bf16) / (ops * 32 / t_fma),
         (double)_mm512_reduce_add_ps(sum));
  return 0;
}
