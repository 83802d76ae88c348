// Device helpers shared by attnaux's own Hopper kernels (hopper_fwd_kernel.cuh,
// hopper_bwd_kernel.cuh): wgmma batches, the accumulator-as-operand layout, the visibility
// test, proxy fences, exp2 and the bulk reduce-add.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace attnaux_hopper {

using namespace cute;

// wgmma of a whole K extent, issued as one batch; kWait >= 0 waits until at most kWait batches
// of this warpgroup are in flight (FlashAttention-3's `flash::gemm`).
template <bool kZeroInit, int kWait, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void gemm(Mma& mma, TA const& a, TB const& b, TC& c) {
  constexpr bool kRegisterA =
      !cute::is_base_of<GMMA::DescriptorIterator, typename Mma::FrgTypeA>::value;
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(c);
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TA&>(a));
}

// An accumulator's register layout ((2, 2, N / 8), MMA_M, MMA_N) read as the A operand of a
// register-sourced 16-bit wgmma, ((2, 2, 2), MMA_M, N / 16): the accumulator's columns become K.
template <class Layout0>
__device__ __forceinline__ auto AccumulatorAsA(Layout0 acc) {
  auto l = logical_divide(get<0, 2>(acc), Tile<_2>{});
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(l)), get<1>(acc),
                     coalesce(make_layout(get<0, 1>(l), get<2>(acc))));
}

// A [batch, seq, heads, D] array of T as the kernels' TMA copies see it: (seq, dim, heads,
// batch), the dim contiguous (host code: the TMA descriptors are built from it).
template <class T, int D>
auto SequenceTensor(const void* ptr, int seq, int heads, int batch) {
  return make_tensor(make_gmem_ptr(static_cast<T const*>(ptr)),
                     make_shape(int32_t(seq), int32_t(D), int32_t(heads), int32_t(batch)),
                     make_stride(int64_t(heads) * D, _1{}, int64_t(D), int64_t(seq) * heads * D));
}

__device__ __forceinline__ int FloorDiv(int a, int b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// whether query row q sees key kv, without short-circuit branches (predicates and selects only:
// it runs per element of the partly visible tiles)
template <class Params>  // BwdParams, FwdParams: q_len, kv_len, offset, upper, lower, has_*
__device__ __forceinline__ bool Visible(const Params& p, int q, int kv) {
  return static_cast<bool>(int(kv < p.kv_len) & int(q < p.q_len) &
                           (int(!p.has_upper) | int(kv <= q + p.offset + p.upper)) &
                           (int(!p.has_lower) | int(kv >= q + p.offset - p.lower)));
}

__device__ __forceinline__ void FenceAsyncShared() {
  // the generic proxy's shared-memory writes (st.shared, stmatrix) made visible to the async
  // proxy (wgmma, bulk copies)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Pins float registers to this point of the program for the compiler's front end (an empty
// volatile asm reading and writing them): their computation stays above it in the PTX. ptxas,
// which schedules the SASS, sees nothing of it (hopper_fwd_kernel.cuh: the P V wait).
__device__ __forceinline__ void FenceRegister(float& x) { asm volatile("" : "+f"(x)::"memory"); }
template <class... Floats>
__device__ __forceinline__ void FenceRegisters(Floats&... x) {
  (FenceRegister(x), ...);
}

// 2^x on the special function unit (flushes denormal results to 0, as FlashAttention's softmax)
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// float32 [bytes / 4] in shared memory added into global memory by the bulk copy engine
__device__ __forceinline__ void BulkReduceAdd(float* gmem, const float* smem, int bytes) {
  const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
      "cp.async.bulk.commit_group;\n" ::"l"(gmem),
      "r"(src), "r"(bytes)
      : "memory");
}

// named barriers (bar.sync waits, bar.arrive counts itself in and goes on; `threads` a multiple
// of 32, the same at every use of `id`)
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// until all but the newest `kPending` of this thread's bulk copy groups have read their shared
// memory
template <int kPending = 0>
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void BulkWait() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// Shared-memory accesses by address (st.shared / ld.shared), for pointers into CuTe's smem
// tensors, whose element references the compiler otherwise reads and writes generically
__device__ __forceinline__ void StoreShared128Zero(const void* smem) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(at), "r"(0) : "memory");
}

__device__ __forceinline__ uint4 LoadShared128(const void* smem) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(at)
               : "memory");
  return v;
}

// a 16-byte global store (st.global.v4): from the registers that LoadShared128 filled the
// compiler split the plain C++ store into four 4-byte ones
__device__ __forceinline__ void StoreGlobal128(void* gmem, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(gmem), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

}  // namespace attnaux_hopper
