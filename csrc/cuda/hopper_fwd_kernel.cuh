// attnaux's own Hopper (sm_90a) attention forward, in CUDA C++ with CuTe, returning out, lse and
// max: FlashAttention-3's forward at head dim 128 (hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp)
// without its inter-warpgroup ping-pong so far.
//
// A CTA owns 128 query rows of one query head:
// - a producer warpgroup (24 registers after setmaxnreg): one thread loads Q once and each key
//   block's K and V (128 keys) by TMA into a two-stage mbarrier pipeline, K and V on barriers
//   of their own so that S can start before V has landed;
// - two consumer warpgroups (240 registers), 64 rows each, holding O (64 x 128 float32), the
//   row maxima and the partial row sums in registers. Per key block j (intra-warpgroup
//   overlap: the softmax of block j runs while the tensor cores do block j - 1's P V):
//     issue S_j = Q K_j^T                      (wgmma, shared-memory operands)
//     issue O += P_{j-1} V_{j-1}               (wgmma, P from the registers, V read MN-major)
//     wait for S_j; mask (partly visible blocks only), row max, P_j = exp2(S_j c - m c)
//     wait for P V; release stage j - 1; O *= exp2(m_old c - m_new c)
// The epilogue divides O by the row sums, stages it in the warpgroup's half of Q's shared
// memory and writes 16-byte rows; lse and max go out from the registers.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "cuda/hopper_fwd_params.h"
#include "cuda/hopper_kernel_utils.cuh"

namespace attnaux_hopper {

template <class Element_, int kHeadDim_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // query rows a CTA; consumer warpgroup w: [64 w, 64 w + 64)
  static constexpr int kBlockN = 128;  // keys a step
  static constexpr int kStages = 2;    // K and V blocks in flight
  static constexpr int kThreads = 384;  // a producer warpgroup, then two consumer warpgroups
  static constexpr int kConsumerThreads = 256;
  static_assert(kHeadDim % 64 == 0, "a row of K must fill whole 128-byte swizzle atoms");

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;

  // S = Q K^T: [kBlockM, kBlockN], a warpgroup per 64 rows
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<BlockM, BlockN, HeadDim>>(),
      Layout<Shape<_2, _1, _1>>{}));
  // O += P V: [kBlockM, kHeadDim], P from the registers, V (keys x dim as stored) read MN-major
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<BlockM, HeadDim, BlockN>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));

  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, HeadDim>{}));
  using SmemLayoutKVOne = decltype(tile_to_shape(SmemAtom{}, Shape<BlockN, HeadDim>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<BlockN, HeadDim, Int<kStages>>{}));
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<HeadDim, BlockN, Int<kStages>>{},
                                  Stride<BlockN, _1, Int<kBlockN * kHeadDim>>{})));

  // global tensors as TMA sees them: (seq, dim, heads, batch)
  using ShapeSeq = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideSeq = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemSeq = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                       ShapeSeq{}, StrideSeq{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemSeq{}, SmemLayoutQ{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemSeq{}, SmemLayoutKVOne{}));

  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBlockBytes = kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    alignas(1024) Element q[cosize_v<SmemLayoutQ>];  // then O, each warpgroup its own rows
    alignas(1024) Element k[cosize_v<SmemLayoutKV>];
    alignas(1024) Element v[cosize_v<SmemLayoutKV>];
    alignas(8) uint64_t q_full;
    alignas(8) uint64_t k_full[kStages];
    alignas(8) uint64_t v_full[kStages];
    alignas(8) uint64_t empty[kStages];
  };
  // the dynamic shared memory is aligned by hand to the swizzle atoms' 1024 bytes
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
};

template <class Traits>
struct FwdKernelParams {
  FwdParams p;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k, tma_v;
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    HopperFwdKernel(const __grid_constant__ FwdKernelParams<Traits> params) {
  using T = typename Traits::Element;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  constexpr int M = Traits::kBlockM, N = Traits::kBlockN, D = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr float kInf = __builtin_huge_valf();
  using SharedStorage = typename Traits::SharedStorage;
  const FwdParams& p = params.p;
  extern __shared__ char smem_raw[];
  // aligned by an offset into smem_raw (not through an integer, which would make every access
  // to `shared` a generic one: hopper_bwd_kernel.cuh)
  SharedStorage& shared = *reinterpret_cast<SharedStorage*>(
      smem_raw +
      ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023)) & 1023));

  const int warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
  const int lane = threadIdx.x % 32;
  const int m_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int m0 = m_block * M;
  const int kv_head = h / (p.q_heads / p.kv_heads);

  // the key blocks that some row of [m0, m0 + M) sees
  int n_lo = 0;
  int n_hi = min((p.kv_len + N - 1) / N, p.kv_seq / N);
  if (p.has_upper) n_hi = min(n_hi, FloorDiv(m0 + M - 1 + p.offset + p.upper, N) + 1);
  if (p.has_lower) n_lo = max(n_lo, FloorDiv(m0 + p.offset - p.lower, N));
  if (m0 >= p.q_len) n_hi = n_lo;
  const int n_blocks = max(n_hi - n_lo, 0);

  if (warp == 0 && cute::elect_one_sync()) {
    FullBarrier::init(&shared.q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&shared.k_full[s], 1);
      FullBarrier::init(&shared.v_full[s], 1);
      EmptyBarrier::init(&shared.empty[s], Traits::kConsumerThreads / 32);
    }
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(shared.q), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v), typename Traits::SmemLayoutKV{});

  if (warp < 4) {  // ---- producer warpgroup: one thread issues every load
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (warp == 0 && cute::elect_one_sync() && n_blocks > 0) {
      Tensor mQ = params.tma_q.get_tma_tensor(make_shape(p.q_seq, D, p.q_heads, p.batch));
      Tensor mK = params.tma_k.get_tma_tensor(make_shape(p.kv_seq, D, p.kv_heads, p.batch));
      Tensor mV = params.tma_v.get_tma_tensor(make_shape(p.kv_seq, D, p.kv_heads, p.batch));
      auto tma_q = params.tma_q.get_slice(Int<0>{});
      auto tma_k = params.tma_k.get_slice(Int<0>{});
      auto tma_v = params.tma_v.get_slice(Int<0>{});
      FullBarrier::arrive_and_expect_tx(&shared.q_full, Traits::kQBytes);
      copy(params.tma_q.with(shared.q_full),
           tma_q.partition_S(local_tile(mQ(_, _, h, b), Shape<Int<M>, Int<D>>{},
                                        make_coord(m_block, 0))),
           tma_q.partition_D(sQ));
      for (int i = 0; i < n_blocks; ++i) {
        const int s = i % kStages;
        if (i >= kStages) EmptyBarrier::wait(&shared.empty[s], ((i / kStages) - 1) & 1);
        const int n_block = n_lo + i;
        FullBarrier::arrive_and_expect_tx(&shared.k_full[s], Traits::kBlockBytes);
        copy(params.tma_k.with(shared.k_full[s]),
             tma_k.partition_S(local_tile(mK(_, _, kv_head, b), Shape<Int<N>, Int<D>>{},
                                          make_coord(n_block, 0))),
             tma_k.partition_D(sK(_, _, s)));
        FullBarrier::arrive_and_expect_tx(&shared.v_full[s], Traits::kBlockBytes);
        copy(params.tma_v.with(shared.v_full[s]),
             tma_v.partition_S(local_tile(mV(_, _, kv_head, b), Shape<Int<N>, Int<D>>{},
                                          make_coord(n_block, 0))),
             tma_v.partition_D(sV(_, _, s)));
      }
    }
    return;
  }

  // ---- consumer warpgroups
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int tid = threadIdx.x - 128;  // 0 .. 255
  const int wg = warp / 4 - 1;
  const int r0 = m0 + wg * 64;  // this warpgroup's first row
  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<M>, Int<D>>{});
  clear(tOrO);
  // the accumulators' value i lies in row half (i / 2) % 2 of the thread's two rows (the wgmma
  // C layout: values (2 columns, 2 rows 8 apart, N / 8 column groups))
  float row_max[2] = {-kInf, -kInf}, row_sum[2] = {0.0f, 0.0f};
  const float c = p.scale_log2;

  auto thr_qk = mma_qk.get_thread_slice(tid);
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<M>, Int<N>>{}));  // (row, key)

  if (n_blocks > 0) {
    Tensor sVt = make_tensor(make_smem_ptr(shared.v), typename Traits::SmemLayoutVt{});
    auto wg_qk = mma_qk.get_slice(wg * 128);
    auto wg_pv = mma_pv.get_slice(wg * 128);
    Tensor tSrQ = wg_qk.partition_fragment_A(sQ);    // (MMA, MMA_M, MMA_K)
    Tensor tSrK = wg_qk.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K, STAGE)
    Tensor tOrVt = wg_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, STAGE)
    Tensor rP = make_tensor_like<T>(partition_fragment_C(mma_qk, Shape<Int<M>, Int<N>>{}));
    Tensor tOrP = make_tensor(rP.data(), AccumulatorAsA(rP.layout()));

    // every pair of rows [r0, r0 + 64) x keys [n0, n0 + N) visible
    auto whole = [&](int n0) {
      return n0 + N <= p.kv_len && r0 + 64 <= p.q_len &&
             (!p.has_upper || n0 + N - 1 <= r0 + p.offset + p.upper) &&
             (!p.has_lower || n0 >= r0 + 63 + p.offset - p.lower);
    };
    // the online softmax of a block's scores in place (exp2 units), corr: the factor of the
    // rows' earlier O and sums
    auto softmax = [&](auto& tSrS, int n0, float (&corr)[2]) {
      if (!whole(n0)) {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          tSrS(i) = Visible(p, m0 + get<0>(tScS(i)), n0 + get<1>(tScS(i))) ? tSrS(i) : -kInf;
        }
      }
      float mx[2] = {row_max[0], row_max[1]};
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) mx[(i / 2) % 2] = fmaxf(mx[(i / 2) % 2], tSrS(i));
      float ms[2];
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {  // the row's four threads (lanes 4 t1 + t0)
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        ms[r] = mx[r] == -kInf ? 0.0f : mx[r] * c;  // (no -inf - -inf)
        corr[r] = row_max[r] == -kInf ? 0.0f : Exp2(row_max[r] * c - ms[r]);
        row_max[r] = mx[r];
      }
      float sum[2] = {0.0f, 0.0f};
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) {
        tSrS(i) = Exp2(tSrS(i) * c - ms[(i / 2) % 2]);
        sum[(i / 2) % 2] += tSrS(i);
      }
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) row_sum[r] = row_sum[r] * corr[r] + sum[r];
    };
    auto to_p = [&](auto const& tSrS) {
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) rP(i) = static_cast<T>(tSrS(i));
    };

    FullBarrier::wait(&shared.q_full, 0);
    float corr[2];
    {
      FullBarrier::wait(&shared.k_full[0], 0);
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<M>, Int<N>>{});
      gemm<true, 0>(mma_qk, tSrQ, tSrK(_, _, _, 0), tSrS);
      softmax(tSrS, n_lo * N, corr);
      to_p(tSrS);
    }
    for (int i = 1; i < n_blocks; ++i) {
      const int s = i % kStages, s_prev = (i - 1) % kStages;
      FullBarrier::wait(&shared.k_full[s], (i / kStages) & 1);
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<M>, Int<N>>{});
      gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, s), tSrS);
      FullBarrier::wait(&shared.v_full[s_prev], ((i - 1) / kStages) & 1);
      gemm<false, -1>(mma_pv, tOrP, tOrVt(_, _, _, s_prev), tOrO);
      warpgroup_wait<1>();  // S_i
      softmax(tSrS, (n_lo + i) * N, corr);
      warpgroup_wait<0>();  // P_{i-1} V_{i-1}
      __syncwarp();
      if (lane == 0) EmptyBarrier::arrive(&shared.empty[s_prev]);  // K and V of stage s_prev read
      CUTE_UNROLL
      for (int x = 0; x < size(tOrO); ++x) tOrO(x) *= corr[(x / 2) % 2];
      to_p(tSrS);
    }
    const int s_last = (n_blocks - 1) % kStages;
    FullBarrier::wait(&shared.v_full[s_last], ((n_blocks - 1) / kStages) & 1);
    gemm<false, 0>(mma_pv, tOrP, tOrVt(_, _, _, s_last), tOrO);
  }

  // ---- epilogue: O / row sums, lse and max (natural log); a row that sees nothing: 0, -inf;
  // a NaN the row sees: NaN in all three
  float inv[2], lse[2], mx_out[2];
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    const bool seen = row_sum[r] > 0.0f;
    const bool broken = row_sum[r] != row_sum[r];
    const float empty = broken ? __int_as_float(0x7fc00000) : -kInf;
    inv[r] = seen ? 1.0f / row_sum[r] : (broken ? __int_as_float(0x7fc00000) : 0.0f);
    mx_out[r] = seen ? row_max[r] * p.scale : empty;
    lse[r] = seen ? row_max[r] * p.scale + logf(row_sum[r]) : empty;
  }
  CUTE_UNROLL
  for (int x = 0; x < size(tOrO); ++x) tOrO(x) *= inv[(x / 2) % 2];

  // the warpgroup's rows of sQ (every product reading them is done) take O, then 16-byte rows
  // out; only this warpgroup's 128 threads meet at its named barrier
  Tensor sO = make_tensor(make_smem_ptr(shared.q), typename Traits::SmemLayoutQ{});
  Tensor tOsO = mma_pv.get_thread_slice(tid).partition_C(sO);
  CUTE_UNROLL
  for (int x = 0; x < size(tOrO); x += 2) {  // values x, x + 1: adjacent columns
    T pair[2] = {static_cast<T>(tOrO(x)), static_cast<T>(tOrO(x + 1))};
    uint32_t bits;
    memcpy(&bits, pair, sizeof(bits));
    StoreShared32(&tOsO(x), bits);
  }
  asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
  constexpr int kChunks = D / 8;  // 16-byte chunks a row
  const int64_t q_row = int64_t(p.q_heads) * D;
  T* out = static_cast<T*>(p.out) + (int64_t(b) * p.q_seq + r0) * q_row + int64_t(h) * D;
  const int wg_thread = tid % 128;
  CUTE_UNROLL
  for (int chunk = wg_thread; chunk < 64 * kChunks; chunk += 128) {
    const int row = chunk / kChunks, col = (chunk % kChunks) * 8;
    // a 16-byte chunk of a row stays whole under the 128-byte swizzle
    *reinterpret_cast<uint4*>(out + row * q_row + col) = LoadShared128(&sO(wg * 64 + row, col));
  }
  if (lane % 4 == 0) {  // a row's four threads hold the same statistics
    const int64_t at = (int64_t(b) * p.q_heads + h) * p.q_seq;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int row = m0 + get<0>(tScS(2 * r));  // value 2 r: the thread's row r
      p.lse[at + row] = lse[r];
      p.max[at + row] = mx_out[r];
    }
  }
}

// The TMA descriptors of a call (built on the host from its pointers and sizes).
template <class Traits>
FwdKernelParams<Traits> MakeFwdKernelParams(const FwdParams& p) {
  using T = typename Traits::Element;
  constexpr int D = Traits::kHeadDim;
  auto seq_tensor = [&](const void* ptr, int seq, int heads) {
    return make_tensor(make_gmem_ptr(static_cast<T const*>(ptr)),
                       make_shape(int32_t(seq), int32_t(D), int32_t(heads), int32_t(p.batch)),
                       make_stride(int64_t(heads) * D, _1{}, int64_t(D), int64_t(seq) * heads * D));
  };
  FwdKernelParams<Traits> w{};
  w.p = p;
  w.tma_q = make_tma_copy(SM90_TMA_LOAD{}, seq_tensor(p.q, p.q_seq, p.q_heads),
                          typename Traits::SmemLayoutQ{});
  w.tma_k = make_tma_copy(SM90_TMA_LOAD{}, seq_tensor(p.k, p.kv_seq, p.kv_heads),
                          typename Traits::SmemLayoutKVOne{});
  w.tma_v = make_tma_copy(SM90_TMA_LOAD{}, seq_tensor(p.v, p.kv_seq, p.kv_heads),
                          typename Traits::SmemLayoutKVOne{});
  return w;
}

}  // namespace attnaux_hopper
