// attnaux's own Hopper (sm_90a) attention backward, in CUDA C++ with CuTe: one kernel computes
// dK, dV and dQ with FlashAttention-3's five matrix products per tile pair and its operand
// placement (hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp, head dim 128: S and dP computed
// transposed, P^T and dS^T fed to the dV and dK products straight from the registers, dS shared
// through shared memory for dQ, whose float32 partial sums are added into a global buffer).
//
// A CTA owns 128 keys of one kv head (two warpgroups, 64 keys each, holding dK and dV for them in
// registers) and walks every query tile of 64 rows that can see them, over each query head of its
// GQA group. Per step (m: a query tile of one head):
//   S^T = K Q^T, dP^T = V dO^T                (wgmma, shared-memory operands)
//   P^T = exp2(S^T * scale log2 e - lse2)      (masked pairs 0)
//   dS^T = P^T * (dP^T - (D - dlse))           (the lse cotangent folded into the row term)
//   dV += P^T dO, dK += dS^T Q                 (wgmma, P^T and dS^T from the registers)
//   dQ_m += dS K                               (wgmma over both warpgroups' dS, a warpgroup per half
//                                               of the head dim; its float32 tile staged in shared
//                                               memory and bulk-reduce-added into dq_accum)
// Q, dO and the row statistics of step m+1 are loaded by every thread with cp.async while step m
// computes (two stages). dq_accum holds each warp's part of a warpgroup's 64 x kHeadDim/2 tile of
// a query tile contiguously, in the accumulator's register order (the caller reorders it, as
// FlashAttention-3's postprocess does), so that one bulk copy of each warp adds it. The float32
// additions into dq_accum come in a varying order: the caller keeps a bitwise reproducible path
// (the two-kernel Pallas backward) for XLA's deterministic mode.
//
// Where it stands (H100, docs/performance.md): correct (parity tests, compute-sanitizer memcheck
// clean) but 0.67-0.74x the Pallas backward forward+backward, so `Config.cuda_backward` is off by
// default. Removing parts one at a time (an earlier build, with a libm exp2f) showed the
// skeleton itself slow: with the softmax's exponentials, the dQ reduction, the per-step loads and
// the dS store all removed, the five products and two barriers a step ran at about the Pallas
// backward's whole speed. What FlashAttention-3 has and this kernel lacks: a producer warp with
// TMA loads and mbarrier pipelines (no barrier of all 256 threads a step) and register
// reallocation (setmaxnreg); ptxas also spills 56-68 bytes a thread here at 255 registers.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

#include "cuda/hopper_bwd_params.h"

namespace attnaux_hopper {

using namespace cute;

template <class Element_, int kHeadDim_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64;    // query rows a step
  static constexpr int kBlockN = 128;   // keys a CTA
  static constexpr int kThreads = 256;  // two warpgroups; warpgroup w owns keys [64 w, 64 w + 64)
  static constexpr int kStages = 2;     // Q and dO tiles in flight
  static_assert(kHeadDim % 64 == 0, "a row of K must fill whole 128-byte swizzle atoms");

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;

  // S^T = K Q^T and dP^T = V dO^T: [kBlockN, kBlockM], a warpgroup per 64 keys
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<BlockN, BlockM, HeadDim>>(),
      Layout<Shape<_2, _1, _1>>{}));
  // dV += P^T dO and dK += dS^T Q: [kBlockN, kHeadDim], A (P^T, dS^T) from the registers
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<BlockN, HeadDim, BlockM>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  // dQ = dS K: [kBlockM, kHeadDim], a warpgroup per half of the head dim
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<BlockM, Int<kHeadDim / 2>, BlockN>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_1, _2, _1>>{}));

  // Every tile is stored row-major in 128-byte swizzled atoms (K-major for the products that
  // read it as stored); the transposed views read the same bytes MN-major.
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, HeadDim, Int<kStages>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<BlockN, HeadDim>{}));
  using SmemLayoutdS = decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, BlockN>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<HeadDim, BlockM, Int<kStages>>{},
                                 Stride<BlockM, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<HeadDim, BlockN>{}, Stride<BlockN, _1>{})));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<BlockN, BlockM>{}, Stride<BlockM, _1>{})));

  // a warpgroup's dQ tile, 64 x kHeadDim / 2 float32
  static constexpr int kDqWarpgroupFloats = kBlockM * kHeadDim / 2;

  struct SharedStorage {
    alignas(1024) float dq[2][kDqWarpgroupFloats];
    alignas(1024) Element q[cosize_v<SmemLayoutQ>];
    alignas(1024) Element dout[cosize_v<SmemLayoutQ>];
    alignas(1024) Element k[cosize_v<SmemLayoutKV>];
    alignas(1024) Element v[cosize_v<SmemLayoutKV>];
    alignas(1024) Element ds[cosize_v<SmemLayoutdS>];
    alignas(16) float lse2[kStages][kBlockM];
    alignas(16) float row_term[kStages][kBlockM];
  };
  // the dynamic shared memory is aligned by hand to the swizzle atoms' 1024 bytes
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;

  // 16-byte cp.async: a thread copies 8 elements, kHeadDim / 8 threads a row
  static constexpr int kThreadsPerRow = kHeadDim / 8;
  using GmemTiledCopy = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{},
      Layout<Shape<Int<kThreads / kThreadsPerRow>, Int<kThreadsPerRow>>,
             Stride<Int<kThreadsPerRow>, _1>>{},
      Layout<Shape<_1, _8>>{}));
};

// wgmma of a whole K extent, issued as one batch; kWait >= 0 waits until at most kWait batches
// of this warpgroup are in flight (FlashAttention-3's `flash::gemm`).
template <bool kZeroInit, int kWait, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void gemm(Mma& mma, TA const& a, TB const& b, TC& c) {
  constexpr bool kRegisterA = !cute::is_base_of<GMMA::DescriptorIterator, typename Mma::FrgTypeA>::value;
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

__device__ __forceinline__ int FloorDiv(int a, int b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

__device__ __forceinline__ bool Visible(const BwdParams& p, int q, int kv) {
  return kv < p.kv_len && q < p.q_len && (!p.has_upper || kv <= q + p.offset + p.upper) &&
         (!p.has_lower || kv >= q + p.offset - p.lower);
}

// Visible without short-circuit branches (predicates and selects only), for the per-element
// loops of partly visible tiles
__device__ __forceinline__ bool VisibleNoBranch(const BwdParams& p, int q, int kv) {
  return static_cast<bool>(int(kv < p.kv_len) & int(q < p.q_len) &
                           (int(!p.has_upper) | int(kv <= q + p.offset + p.upper)) &
                           (int(!p.has_lower) | int(kv >= q + p.offset - p.lower)));
}

__device__ __forceinline__ void FenceAsyncShared() {
  // the generic proxy's shared-memory writes (cp.async, st.shared) made visible to the async
  // proxy (wgmma, bulk copies)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
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

// until this thread's bulk copies have read their shared memory
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

__device__ __forceinline__ void BulkWait() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    HopperBwdKernel(const __grid_constant__ BwdParams p) {
  using T = typename Traits::Element;
  constexpr int M = Traits::kBlockM, N = Traits::kBlockN, D = Traits::kHeadDim;
  using SharedStorage = typename Traits::SharedStorage;
  extern __shared__ char smem_raw[];
  SharedStorage& shared = *reinterpret_cast<SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  const int tid = threadIdx.x;
  const int n0 = blockIdx.x * N;
  const int kv_head = blockIdx.y, b = blockIdx.z;
  const int group = p.q_heads / p.kv_heads;
  const int64_t q_row = int64_t(p.q_heads) * D;    // elements between query rows
  const int64_t kv_row = int64_t(p.kv_heads) * D;  // between key rows

  // the query tiles whose rows see some key of [n0, n0 + N)
  int m_lo = 0;
  int m_hi = min((p.q_len + M - 1) / M, p.q_seq / M);
  if (p.has_upper) m_lo = max(m_lo, FloorDiv(n0 - p.offset - p.upper, M));
  if (p.has_lower) m_hi = min(m_hi, FloorDiv(n0 + N - 1 - p.offset + p.lower, M) + 1);
  if (n0 >= p.kv_len) m_hi = m_lo;
  const int n_m = max(m_hi - m_lo, 0);
  const int steps = group * n_m;

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<N>, Int<D>>{});
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<N>, Int<D>>{});
  clear(tdKrdK);
  clear(tdVrdV);

  Tensor sQ = make_tensor(make_smem_ptr(shared.q), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.dout), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v), typename Traits::SmemLayoutKV{});
  Tensor sdS = make_tensor(make_smem_ptr(shared.ds), typename Traits::SmemLayoutdS{});
  Tensor sQt = make_tensor(make_smem_ptr(shared.q), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(shared.dout), typename Traits::SmemLayoutQt{});
  Tensor sKt = make_tensor(make_smem_ptr(shared.k), typename Traits::SmemLayoutKt{});
  Tensor sdSt = make_tensor(make_smem_ptr(shared.ds), typename Traits::SmemLayoutdSt{});

  if (steps > 0) {
    typename Traits::GmemTiledCopy gmem_copy;
    auto thr_copy = gmem_copy.get_thread_slice(tid);
    {
      const int64_t at = (int64_t(b) * p.kv_seq + n0) * kv_row + int64_t(kv_head) * D;
      Tensor gK = make_tensor(make_gmem_ptr(static_cast<const T*>(p.k) + at),
                              Shape<Int<N>, Int<D>>{}, make_stride(kv_row, _1{}));
      Tensor gV = make_tensor(make_gmem_ptr(static_cast<const T*>(p.v) + at),
                              Shape<Int<N>, Int<D>>{}, make_stride(kv_row, _1{}));
      copy(gmem_copy, thr_copy.partition_S(gK), thr_copy.partition_D(sK));
      copy(gmem_copy, thr_copy.partition_S(gV), thr_copy.partition_D(sV));
      cp_async_fence();
    }
    // Q, dO, lse2 and the row term of a step into a stage
    auto load_step = [&](int step, int stage) {
      const int h = kv_head * group + step / n_m;
      const int m0 = (m_lo + step % n_m) * M;
      const int64_t at = (int64_t(b) * p.q_seq + m0) * q_row + int64_t(h) * D;
      Tensor gQ = make_tensor(make_gmem_ptr(static_cast<const T*>(p.q) + at),
                              Shape<Int<M>, Int<D>>{}, make_stride(q_row, _1{}));
      Tensor gdO = make_tensor(make_gmem_ptr(static_cast<const T*>(p.dout) + at),
                               Shape<Int<M>, Int<D>>{}, make_stride(q_row, _1{}));
      copy(gmem_copy, thr_copy.partition_S(gQ), thr_copy.partition_D(sQ(_, _, stage)));
      copy(gmem_copy, thr_copy.partition_S(gdO), thr_copy.partition_D(sdO(_, _, stage)));
      if (tid < 2 * M / 4) {  // 4 floats a thread: lse2, then the row term
        const int which = tid / (M / 4), at4 = (tid % (M / 4)) * 4;
        const float* src = p.stats + ((int64_t(b) * p.q_heads + h) * 2 + which) * p.q_seq + m0 + at4;
        float* dst = (which == 0 ? shared.lse2[stage] : shared.row_term[stage]) + at4;
        SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>::copy(
            *reinterpret_cast<const cute::uint128_t*>(src), *reinterpret_cast<cute::uint128_t*>(dst));
      }
      cp_async_fence();
    };
    load_step(0, 0);

    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
    auto wg_sdp = mma_sdp.get_slice(wg * 128);
    auto wg_dkv = mma_dkv.get_slice(wg * 128);
    auto wg_dq = mma_dq.get_slice(wg * 128);
    Tensor tSrK = wg_sdp.partition_fragment_A(sK);    // (MMA, MMA_M, MMA_K)
    Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);    // (MMA, MMA_N, MMA_K, STAGE)
    Tensor tdPrV = wg_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = wg_sdp.partition_fragment_B(sdO);
    Tensor tdVrdO = wg_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, STAGE)
    Tensor tdKrQ = wg_dkv.partition_fragment_B(sQt);
    Tensor tdQrdS = wg_dq.partition_fragment_A(sdS);
    Tensor tdQrK = wg_dq.partition_fragment_B(sKt);

    auto thr_sdp = mma_sdp.get_thread_slice(tid);
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<N>, Int<M>>{}));  // (key, row)
    // dS^T from the registers into sdS, transposed on the way by stmatrix (FlashAttention-3's
    // SM90_U16x8_STSM_T with S computed transposed)
    auto ds_store = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, T>{}, mma_sdp);
    auto thr_ds_store = ds_store.get_thread_slice(tid);
    Tensor tdSsdS = thr_ds_store.partition_D(as_position_independent_swizzle_tensor(sdSt));
    const int wg_thread = tid % 128, lane = tid % 32;
    float* dq_smem = shared.dq[wg] + (wg_thread / 32) * (Traits::kDqWarpgroupFloats / 4);

    for (int step = 0; step < steps; ++step) {
      const int stage = step & 1;
      const int h = kv_head * group + step / n_m;
      const int m0 = (m_lo + step % n_m) * M;
      if (lane == 0) BulkWaitRead();  // the last step's dQ tile has left shared memory
      cp_async_wait<0>();
      FenceAsyncShared();
      __syncthreads();  // this step's tiles are in; every product of the last step is done

      Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<N>, Int<M>>{});
      gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
      Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<N>, Int<M>>{});
      gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), tdPrdP);
      // the next step's loads are issued while the tensor cores run these two
      if (step + 1 < steps) load_step(step + 1, stage ^ 1);

      const bool full = n0 + N <= p.kv_len && m0 + M <= p.q_len &&
                        (!p.has_upper || n0 + N - 1 <= m0 + p.offset + p.upper) &&
                        (!p.has_lower || n0 >= m0 + M - 1 + p.offset - p.lower);
      warpgroup_wait<1>();  // S^T
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) {
        const int row = get<1>(tScS(i));
        const float prob = Exp2(tSrS(i) * p.scale_log2 - shared.lse2[stage][row]);
        tSrS(i) = (full || Visible(p, m0 + row, n0 + get<0>(tScS(i)))) ? prob : 0.0f;
      }
      warpgroup_wait<0>();  // dP^T
      CUTE_UNROLL
      for (int i = 0; i < size(tdPrdP); ++i) {
        const int row = get<1>(tScS(i));
        const float ds = tSrS(i) * (tdPrdP(i) - shared.row_term[stage][row]);
        tdPrdP(i) = tSrS(i) == 0.0f ? 0.0f : ds;  // (an invisible pair's dP may be anything)
      }
      Tensor rP = make_tensor_like<T>(tSrS);
      Tensor rdS = make_tensor_like<T>(tdPrdP);
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) {
        rP(i) = static_cast<T>(tSrS(i));
        rdS(i) = static_cast<T>(tdPrdP(i));
      }
      copy(ds_store, thr_ds_store.retile_S(rdS), tdSsdS);

      Tensor tdVrP = make_tensor(rP.data(), AccumulatorAsA(tSrS.layout()));
      gemm<false, -1>(mma_dkv, tdVrP, tdVrdO(_, _, _, stage), tdVrdV);
      FenceAsyncShared();
      __syncthreads();  // both warpgroups' dS are in shared memory
      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<M>, Int<D>>{});
      gemm<true, -1>(mma_dq, tdQrdS, tdQrK, tdQrdQ);
      Tensor tdKrdS = make_tensor(rdS.data(), AccumulatorAsA(tdPrdP.layout()));
      gemm<false, 1>(mma_dkv, tdKrdS, tdKrQ(_, _, _, stage), tdKrdK);  // dV and dQ done
      // each warp's part of the warpgroup's dQ tile, in the accumulator's register order (16
      // bytes a store), then bulk-reduce-added by its first lane: no wait on the other warps
      constexpr int kWarpFloats = Traits::kDqWarpgroupFloats / 4;
      static_assert(size(decltype(tdQrdQ){}) * 32 == kWarpFloats);
      CUTE_UNROLL
      for (int j = 0; j < size(tdQrdQ) / 4; ++j) {
        reinterpret_cast<float4*>(dq_smem)[j * 32 + lane] =
            make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3));
      }
      FenceAsyncShared();
      __syncwarp();
      if (lane == 0) {
        const int64_t tile = (int64_t(b) * p.q_heads + h) * (p.q_seq / M) + m0 / M;
        BulkReduceAdd(p.dq_accum + (tile * 2 + wg) * Traits::kDqWarpgroupFloats +
                          (wg_thread / 32) * kWarpFloats,
                      dq_smem, kWarpFloats * 4);
      }
      warpgroup_wait<0>();
    }
    if (lane == 0) BulkWait();
  }

  // dK (times the softmax scale) and dV of this CTA's keys; zeros where no row sees them
  Tensor tKVc = mma_dkv.get_thread_slice(tid).partition_C(
      make_identity_tensor(Shape<Int<N>, Int<D>>{}));  // (key, column)
  T* dk = static_cast<T*>(p.dk) + (int64_t(b) * p.kv_seq + n0) * kv_row + int64_t(kv_head) * D;
  T* dv = static_cast<T*>(p.dv) + (int64_t(b) * p.kv_seq + n0) * kv_row + int64_t(kv_head) * D;
  CUTE_UNROLL
  for (int i = 0; i < size(tdKrdK); i += 2) {
    const int64_t at = get<0>(tKVc(i)) * kv_row + get<1>(tKVc(i));
    dk[at] = static_cast<T>(tdKrdK(i) * p.scale);
    dk[at + 1] = static_cast<T>(tdKrdK(i + 1) * p.scale);
    dv[at] = static_cast<T>(tdVrdV(i));
    dv[at + 1] = static_cast<T>(tdVrdV(i + 1));
  }
}

}  // namespace attnaux_hopper
