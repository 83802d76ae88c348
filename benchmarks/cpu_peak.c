/* The multiply-add peak of this machine's cores and the rate at which they read memory, for
 * benchmarks/cpu_vs_torch.py's decode bounds.
 *
 *   cc -O2 -march=native -pthread benchmarks/cpu_peak.c -o cpu_peak && ./cpu_peak THREADS SECONDS
 *
 * prints three lines, "fma32 R", "dpbf16 R" and "read B": R is the float32 multiply-adds per
 * second of all THREADS threads together, from 512-bit FMAs and from VDPBF16PS (two bfloat16
 * products summed into each float32 lane; "dpbf16 0" where the compiler does not target AVX-512
 * BF16). 24 independent accumulator chains a thread, operands in registers: the issue rate, not
 * a latency. A decode key of a kv head with r query rows and head dim d takes 2 r d
 * multiply-adds (scores and values) whatever the kernel, so R bounds the rate at which any
 * kernel can read its keys. B is the bytes per second that THREADS threads read from memory
 * together, each its own slice of a 256 MiB buffer in order with 512-bit loads summed into four
 * accumulators (the best of 5 passes): a kernel that only reads K and V once (decode) reads
 * them no faster. (A copy's bytes read + written, the benchmark's other figure, can be well
 * above B: on a 2-core Xeon VM B was 59% of it.) */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <time.h>

#define CHAINS 24
#define STEPS 4096

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

struct job { double seconds; int bf16; double macs; float sink; };

/* One pass: STEPS rounds of CHAINS independent FMAs (or VDPBF16PS) on 24 named accumulators.
 * The empty asm keeps them in registers (an array of them would be stored to memory each
 * round, and those stores, not the products, would set the rate) and keeps each round's
 * instructions from being merged. */
#define EACH(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) \
  X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
#define DECLARE(i) __m512 a##i = _mm512_set1_ps((float)(i));
#define KEEP                                                                               \
  __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),      \
                   "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));         \
  __asm__ volatile("" : "+v"(a12), "+v"(a13), "+v"(a14), "+v"(a15), "+v"(a16), "+v"(a17), \
                   "+v"(a18), "+v"(a19), "+v"(a20), "+v"(a21), "+v"(a22), "+v"(a23));
#define SUM(i) + _mm512_reduce_add_ps(a##i)

static float fma_pass(void) {
  EACH(DECLARE)
  const __m512 x = _mm512_set1_ps(0.5f), y = _mm512_set1_ps(1.0f);
#define FMA(i) a##i = _mm512_fmadd_ps(a##i, x, y);
  for (int s = 0; s < STEPS; ++s) {
    EACH(FMA)
    KEEP
  }
  return 0.0f EACH(SUM);
}

#ifdef __AVX512BF16__
static float dpbf16_pass(void) {
  EACH(DECLARE)
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f00);  /* 0.5 */
  const __m512bh y = (__m512bh)_mm512_set1_epi16(0x3c00);  /* 2^-7: the sums stay small */
#define DOT(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
  for (int s = 0; s < STEPS; ++s) {
    EACH(DOT)
    KEEP
  }
  return 0.0f EACH(SUM);
}
#endif

static void *run(void *arg) {
  struct job *job = arg;
  long passes = 0;
  double start = now(), elapsed;
  do {
#ifdef __AVX512BF16__
    job->sink += job->bf16 ? dpbf16_pass() : fma_pass();
#else
    job->sink += fma_pass();
#endif
    ++passes;
  } while ((elapsed = now() - start) < job->seconds);
  /* a 512-bit FMA is 16 float32 multiply-adds; a VDPBF16PS 32 bfloat16 products */
  job->macs = (double)passes * STEPS * CHAINS * (job->bf16 ? 32 : 16) / elapsed;
  return NULL;
}

/* runs fn(args + t * size) on `threads` threads at once and waits for them all */
static void run_threads(int threads, void *(*fn)(void *), void *args, size_t size) {
  pthread_t ids[256];
  for (int t = 0; t < threads; ++t) {
    if (pthread_create(&ids[t], NULL, fn, (char *)args + t * size) != 0) {
      fprintf(stderr, "cpu_peak: could not start thread %d of %d\n", t + 1, threads);
      exit(1);
    }
  }
  for (int t = 0; t < threads; ++t) pthread_join(ids[t], NULL);
}

static double peak(int threads, double seconds, int bf16) {
  struct job jobs[256];
  double total = 0;
  for (int t = 0; t < threads; ++t) jobs[t] = (struct job){seconds, bf16, 0, 0};
  run_threads(threads, run, jobs, sizeof(jobs[0]));
  for (int t = 0; t < threads; ++t) total += jobs[t].macs;
  return total;
}

#define READ_BYTES (256u << 20)

struct reader { const float *data; size_t floats; float sink; };

static void *read_slice(void *arg) {
  struct reader *r = arg;
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i + 64 <= r->floats; i += 64) {
    s0 = _mm512_add_ps(s0, _mm512_load_ps(r->data + i));
    s1 = _mm512_add_ps(s1, _mm512_load_ps(r->data + i + 16));
    s2 = _mm512_add_ps(s2, _mm512_load_ps(r->data + i + 32));
    s3 = _mm512_add_ps(s3, _mm512_load_ps(r->data + i + 48));
  }
  r->sink = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
  return NULL;
}

static double read_rate(int threads) {
  float *data = aligned_alloc(64, READ_BYTES);
  if (data == NULL) return 0;
  const size_t floats = READ_BYTES / sizeof(float);
  for (size_t i = 0; i < floats; ++i) data[i] = 1.0f; /* every page touched, not zero pages */
  const size_t slice = floats / threads / 64 * 64;
  struct reader readers[256];
  double fastest = 1e30, sink = 0;
  for (int pass = 0; pass < 5; ++pass) {
    for (int t = 0; t < threads; ++t) readers[t] = (struct reader){data + t * slice, slice, 0};
    double start = now();
    run_threads(threads, read_slice, readers, sizeof(readers[0]));
    const double elapsed = now() - start;
    for (int t = 0; t < threads; ++t) sink += readers[t].sink;
    if (elapsed < fastest) fastest = elapsed;
  }
  free(data);
  /* (the sums keep the loads; printed, to stderr, only where far from what was stored) */
  const double stored = 5.0 * (double)slice * threads;
  if (sink < 0.99 * stored || sink > 1.01 * stored) fprintf(stderr, "cpu_peak: sum %g\n", sink);
  return (double)slice * threads * sizeof(float) / fastest;
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 1;
  double seconds = argc > 2 ? atof(argv[2]) : 0.3;
  if (threads < 1 || threads > 256 || !(seconds > 0)) {
    fprintf(stderr, "usage: cpu_peak THREADS(1-256) SECONDS(> 0)\n");
    return 2;
  }
  printf("fma32 %.6g\n", peak(threads, seconds, 0));
#ifdef __AVX512BF16__
  printf("dpbf16 %.6g\n", peak(threads, seconds, 1));
#else
  printf("dpbf16 0\n");
#endif
  printf("read %.6g\n", read_rate(threads));
  return 0;
}
