// Throughput of AVX-512 FMA against AVX-512 BF16's VDPBF16PS on one core: the bound behind the
// CPU kernels' bfloat16 path (issue: bf16 at 1.5x the float32 speed). VDPBF16PS does twice an
// FMA's multiply-adds per instruction but issues at half the rate on the Xeons measured, so the
// bfloat16 products give no more FLOP/s than float32 FMAs; only AMX (not exposed here) would.
//
//   gcc -O2 -mavx512f -mavx512bf16 benchmarks/cpu_bf16_throughput.c -o /tmp/tp && /tmp/tp
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
int main(){ long n=100000000;
 __m512 a0=_mm512_set1_ps(1),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0; __m512 x=_mm512_set1_ps(1.0000001f), y=_mm512_set1_ps(0.9999999f);
 double t=now();
 for(long i=0;i<n;i++){ a0=_mm512_fmadd_ps(a0,x,y);a1=_mm512_fmadd_ps(a1,x,y);a2=_mm512_fmadd_ps(a2,x,y);a3=_mm512_fmadd_ps(a3,x,y);a4=_mm512_fmadd_ps(a4,x,y);a5=_mm512_fmadd_ps(a5,x,y);a6=_mm512_fmadd_ps(a6,x,y);a7=_mm512_fmadd_ps(a7,x,y);a8=_mm512_fmadd_ps(a8,x,y);a9=_mm512_fmadd_ps(a9,x,y);a10=_mm512_fmadd_ps(a10,x,y);a11=_mm512_fmadd_ps(a11,x,y);}
 double tf=now()-t;
 __m512bh bx=(__m512bh)_mm512_set1_epi32(0x3f803f80), by=bx;
 t=now();
 for(long i=0;i<n;i++){ a0=_mm512_dpbf16_ps(a0,bx,by);a1=_mm512_dpbf16_ps(a1,bx,by);a2=_mm512_dpbf16_ps(a2,bx,by);a3=_mm512_dpbf16_ps(a3,bx,by);a4=_mm512_dpbf16_ps(a4,bx,by);a5=_mm512_dpbf16_ps(a5,bx,by);a6=_mm512_dpbf16_ps(a6,bx,by);a7=_mm512_dpbf16_ps(a7,bx,by);a8=_mm512_dpbf16_ps(a8,bx,by);a9=_mm512_dpbf16_ps(a9,bx,by);a10=_mm512_dpbf16_ps(a10,bx,by);a11=_mm512_dpbf16_ps(a11,bx,by);}
 double tb=now()-t;
 __m512 s=_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a11));
 printf("FMA: %.1f GFLOP/s/core (%.2f instr/ns)  VDPBF16PS: %.1f GFLOP/s/core (%.2f instr/ns) %f\n", 12.0*n*32/tf/1e9, 12.0*n/tf/1e9, 12.0*n*64/tb/1e9, 12.0*n/tb/1e9, _mm512_reduce_add_ps(s));
}
