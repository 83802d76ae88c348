// attnaux's own Hopper (sm_90a) attention backward, in CUDA C++ with CuTe: one kernel computes
// dK, dV and dQ with FlashAttention-3's five matrix products per tile pair and its operand
// placement (hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp, head dim 128: S and dP computed
// transposed, P^T and dS^T fed to the dV and dK products straight from the registers, dS shared
// through shared memory for dQ, whose float32 partial sums are added into a global buffer), fed
// as FlashAttention-3 feeds its own.
//
// A CTA owns 128 keys of one kv head and walks every query tile of 64 rows that can see them,
// over each query head of its GQA group:
// - a producer warpgroup (24 registers after setmaxnreg): one thread loads K and V once and the
//   Q, dO and row statistics of each step by TMA into a two-stage mbarrier pipeline; another
//   warp bulk-reduce-adds each consumer warpgroup's dQ tile into dq_accum (FlashAttention-3's
//   `store_dq`): the consumers issue no copies and wait only for their staging to be read;
// - two consumer warpgroups (240 registers), 64 keys each, holding dK and dV in registers. Per
//   step (m: a query tile of one head):
//     S^T = K Q^T, dP^T = V dO^T                (wgmma, shared-memory operands)
//     P^T = exp2(S^T * scale log2 e - lse2)      (masked pairs 0)
//     dS^T = P^T * (dP^T - (D - dlse))           (the lse cotangent folded into the row term)
//     dV += P^T dO, dK += dS^T Q                 (wgmma, P^T and dS^T from the registers)
//     dQ_m += dS K                               (wgmma over both warpgroups' dS, a warpgroup
//                                                 per half of the head dim; its float32 tile
//                                                 staged in shared memory, handed to the
//                                                 producer's dQ warp by named barriers)
//   dS is double-buffered, so the consumers' one barrier a step is the one that publishes it.
// dq_accum holds each consumer warp's part of a warpgroup's 64 x kHeadDim/2 tile of a query tile
// contiguously, in the accumulator's register order (the caller reorders it, as
// FlashAttention-3's postprocess does). The float32 additions into dq_accum come in a varying
// order: the caller keeps a bitwise reproducible path (the two-kernel Pallas backward) for XLA's
// deterministic mode.
//
// Where it stands (H100, docs/performance.md, 2026-11-27 fifth session): 1.09-1.21x the Pallas
// backward at 4x2048 and 1x8192 keys x 16 heads (causal at 2048: 0.96x); cuDNN's and
// FlashAttention-3's backwards are still ahead. The first form of this kernel (every thread
// loading by cp.async, two barriers of all 256 threads a step) ran at 0.67-0.74x the Pallas one.
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

#include "cuda/hopper_bwd_params.h"
#include "cuda/hopper_kernel_utils.cuh"

namespace attnaux_hopper {

using namespace cute;

template <class Element_, int kHeadDim_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64;    // query rows a step
  static constexpr int kBlockN = 128;   // keys a CTA
  static constexpr int kThreads = 384;  // a producer warpgroup, then two consumer warpgroups
  static constexpr int kConsumerThreads = 256;  // consumer warpgroup w owns keys [64 w, 64 w + 64)
  static constexpr int kStages = 2;     // Q, dO and row statistics in flight
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
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<HeadDim, BlockM, Int<kStages>>{},
                                 Stride<BlockM, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<HeadDim, BlockN>{}, Stride<BlockN, _1>{})));

  // a warpgroup's dQ tile, 64 x kHeadDim / 2 float32
  static constexpr int kDqWarpgroupFloats = kBlockM * kHeadDim / 2;

  using SmemLayoutQOne = decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, HeadDim>{}));
  using SmemLayoutdS = decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, BlockN, _2>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<BlockN, BlockM, _2>{},
                                  Stride<BlockM, _1, Int<kBlockM * kBlockN>>{})));
  using SmemLayoutStats = Layout<Shape<BlockM, _2>>;  // (row, lse2 | row term)

  // global tensors as TMA sees them: (seq, dim, heads, batch) and the stats (seq, 2, heads, batch)
  using ShapeSeq = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideSeq = Stride<int64_t, _1, int64_t, int64_t>;
  using StrideStats = Stride<_1, int64_t, int64_t, int64_t>;
  using GmemSeq = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                       ShapeSeq{}, StrideSeq{}));
  using GmemStats = decltype(make_tensor(make_gmem_ptr(static_cast<float const*>(nullptr)),
                                         ShapeSeq{}, StrideStats{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemSeq{}, SmemLayoutQOne{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemSeq{}, SmemLayoutKV{}));
  using TmaStats = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemStats{}, SmemLayoutStats{}));

  static constexpr uint32_t kStepBytes =
      2 * kBlockM * kHeadDim * sizeof(Element) + 2 * kBlockM * sizeof(float);
  static constexpr uint32_t kKvBytes = 2 * kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    alignas(1024) float dq[2][kDqWarpgroupFloats];
    alignas(1024) Element q[cosize_v<SmemLayoutQ>];
    alignas(1024) Element dout[cosize_v<SmemLayoutQ>];
    alignas(1024) Element k[cosize_v<SmemLayoutKV>];
    alignas(1024) Element v[cosize_v<SmemLayoutKV>];
    alignas(1024) Element ds[cosize_v<SmemLayoutdS>];
    alignas(16) float stats[kStages][2][kBlockM];
    alignas(8) uint64_t full[kStages];
    alignas(8) uint64_t empty[kStages];
    alignas(8) uint64_t kv_full;
  };
  // the dynamic shared memory is aligned by hand to the swizzle atoms' 1024 bytes
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
};

template <class Traits>
struct KernelParams {
  BwdParams p;
  typename Traits::TmaQ tma_q, tma_dout;
  typename Traits::TmaKV tma_k, tma_v;
  typename Traits::TmaStats tma_stats;
};

// Which key block of which kv head and batch a CTA takes (FlashAttention-3's LPT order for its
// causal backward): the (batch, kv head) pairs in sections of `p.section` whose Q, dO and dQ
// sums fit in L2 together (the handler's `section`), and within a section key block by key
// block, the first first: under a causal mask it sees the most query tiles, the last the
// fewest (a window's blocks see about as many each, and the handler's geometries never have a
// lower bound without an upper one).
struct BwdTile {
  int n_block, kv_head, b;
};

__device__ __forceinline__ BwdTile BwdTileOf(const BwdParams& p, int block_n, int index) {
  const int n_blocks = p.kv_seq / block_n;
  const int pairs = p.kv_heads * p.batch;
  const int section = index / (p.section * n_blocks);
  const int in_section = index - section * (p.section * n_blocks);
  const int section_pairs = min(p.section, pairs - section * p.section);  // the last: the rest
  const int n_block = in_section / section_pairs;
  const int pair = section * p.section + (in_section - n_block * section_pairs);
  return BwdTile{n_block, pair % p.kv_heads, pair / p.kv_heads};
}

// Named barriers beside the consumers' 1 (256 threads): a consumer warpgroup's dQ staging full
// (2 + wg) and empty again (4 + wg), each between its 128 threads and the dQ warp.
constexpr int kDqFullBarrier = 2, kDqEmptyBarrier = 4, kDqBarrierThreads = 128 + 32;

// kPacked: packed sequences (hopper_bwd_packed.cu). The CTAs follow the key side's block table,
// kv head by kv head (index = entry x kv_heads + kv head): each takes one 128-key block of one
// run (`p.blocks`: the table's order, the sequences with the most key blocks first; within a
// sequence its first block first, where the table lists the last first), every query tile of
// its sequence that sees the block, and the sequence's own visibility (its lengths, its causal
// alignment). Rows of a tile past its sequence's end (the next sequence's, or padding) are
// zeroed in shared memory before the products read them (0 * NaN is NaN in the tensor cores);
// dK and dV are written for the block's own keys alone (a run without queries: zeros); dQ's
// tiles are the sequence's own, from `p.tile_base[seq]`.
template <class Traits, bool kPacked>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    HopperBwdKernel(const __grid_constant__ KernelParams<Traits> params) {
  using T = typename Traits::Element;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  constexpr int M = Traits::kBlockM, N = Traits::kBlockN, D = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  using SharedStorage = typename Traits::SharedStorage;
  const BwdParams& p = params.p;
  extern __shared__ char smem_raw[];
  // aligned to the swizzle atoms' 1024 bytes by an offset into smem_raw, not through an integer:
  // the compiler then still knows every pointer into `shared` is a shared-memory address
  // (ld.shared / st.shared; a round trip through uintptr_t made them generic loads and stores,
  // and the dQ staging's fence a MEMBAR.ALL.CTA: 15-20% of the consumers' stall samples in ncu)
  SharedStorage& shared = *reinterpret_cast<SharedStorage*>(
      smem_raw +
      ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023)) & 1023));

  const int warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
  const int lane = threadIdx.x % 32;
  // this CTA's key block and what its rows see: the call's bounds (dense) or its sequence's
  // (packed: q_base / k_base its first query / key token, dq_base its first dQ tile)
  BwdTile tile;
  int q_base = 0, k_base = 0, dq_base = 0;
  int q_len = p.q_len, kv_len = p.kv_len, offset = p.offset;
  if constexpr (kPacked) {
    const int entry = blockIdx.x / p.kv_heads;
    const int* block = p.blocks + entry;
    const int stride = p.block_count;
    const int last_first = block[0];
    if (last_first < 0) return;  // past the table's last block (no barrier is met yet)
    k_base = block[stride];
    kv_len = block[2 * stride];
    q_base = block[3 * stride];
    q_len = block[4 * stride];  // 0 for a run without queries
    const int seq = block[5 * stride];
    tile = BwdTile{(kv_len + N - 1) / N - 1 - last_first, int(blockIdx.x) % p.kv_heads, 0};
    offset = p.offset + (p.bottom_right ? kv_len - q_len : 0);
    dq_base = seq >= 0 ? p.tile_base[seq] : 0;
  } else {
    tile = BwdTileOf(p, N, blockIdx.x);
  }
  const int n0 = tile.n_block * N;
  const int kv_head = tile.kv_head, b = tile.b;
  const int group = p.q_heads / p.kv_heads;
  const int64_t kv_row = int64_t(p.kv_heads) * D;  // elements between key rows

  // the query tiles whose rows see some key of [n0, n0 + N)
  int m_lo = 0;
  int m_hi = kPacked ? (q_len + M - 1) / M : min((p.q_len + M - 1) / M, p.q_seq / M);
  if (p.has_upper) m_lo = max(m_lo, FloorDiv(n0 - offset - p.upper, M));
  if (p.has_lower) m_hi = min(m_hi, FloorDiv(n0 + N - 1 - offset + p.lower, M) + 1);
  if (n0 >= kv_len) m_hi = m_lo;
  const int n_m = max(m_hi - m_lo, 0);
  const int steps = group * n_m;

  if (warp == 0 && cute::elect_one_sync()) {
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&shared.full[s], 1);
      EmptyBarrier::init(&shared.empty[s], Traits::kConsumerThreads / 32);
    }
    FullBarrier::init(&shared.kv_full, 1);
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(shared.q), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.dout), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v), typename Traits::SmemLayoutKV{});

  if (warp < 4) {  // ---- producer warpgroup: one thread issues every load
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (warp == 0 && cute::elect_one_sync() && steps > 0) {
      Tensor mK = params.tma_k.get_tma_tensor(make_shape(p.kv_seq, D, p.kv_heads, p.batch));
      Tensor mV = params.tma_v.get_tma_tensor(make_shape(p.kv_seq, D, p.kv_heads, p.batch));
      Tensor gK = local_tile(domain_offset(make_coord(k_base, 0), mK(_, _, kv_head, b)),
                             Shape<Int<N>, Int<D>>{}, make_coord(tile.n_block, 0));
      Tensor gV = local_tile(domain_offset(make_coord(k_base, 0), mV(_, _, kv_head, b)),
                             Shape<Int<N>, Int<D>>{}, make_coord(tile.n_block, 0));
      auto tma_k = params.tma_k.get_slice(Int<0>{});
      auto tma_v = params.tma_v.get_slice(Int<0>{});
      FullBarrier::arrive_and_expect_tx(&shared.kv_full, Traits::kKvBytes);
      copy(params.tma_k.with(shared.kv_full), tma_k.partition_S(gK), tma_k.partition_D(sK));
      copy(params.tma_v.with(shared.kv_full), tma_v.partition_S(gV), tma_v.partition_D(sV));

      Tensor mQ = params.tma_q.get_tma_tensor(make_shape(p.q_seq, D, p.q_heads, p.batch));
      Tensor mdO = params.tma_dout.get_tma_tensor(make_shape(p.q_seq, D, p.q_heads, p.batch));
      Tensor mS =
          params.tma_stats.get_tma_tensor(make_shape(p.stats_seq, 2, p.q_heads, p.batch));
      auto tma_q = params.tma_q.get_slice(Int<0>{});
      auto tma_do = params.tma_dout.get_slice(Int<0>{});
      auto tma_s = params.tma_stats.get_slice(Int<0>{});
      int h = kv_head * group, m_block = m_lo;
      for (int step = 0; step < steps; ++step) {
        const int s = step % kStages;
        if (step >= kStages) EmptyBarrier::wait(&shared.empty[s], ((step / kStages) - 1) & 1);
        Tensor sS = make_tensor(make_smem_ptr(&shared.stats[s][0][0]),
                                typename Traits::SmemLayoutStats{});
        FullBarrier::arrive_and_expect_tx(&shared.full[s], Traits::kStepBytes);
        const auto q_rows = make_coord(q_base, 0);
        copy(params.tma_q.with(shared.full[s]),
             tma_q.partition_S(local_tile(domain_offset(q_rows, mQ(_, _, h, b)),
                                          Shape<Int<M>, Int<D>>{}, make_coord(m_block, 0))),
             tma_q.partition_D(sQ(_, _, s)));
        copy(params.tma_dout.with(shared.full[s]),
             tma_do.partition_S(local_tile(domain_offset(q_rows, mdO(_, _, h, b)),
                                           Shape<Int<M>, Int<D>>{}, make_coord(m_block, 0))),
             tma_do.partition_D(sdO(_, _, s)));
        // (the statistics by dQ tile: an aligned start, as TMA needs on a tensor's innermost
        // dim, where the rows are)
        copy(params.tma_stats.with(shared.full[s]),
             tma_s.partition_S(local_tile(domain_offset(make_coord(dq_base * M, 0),
                                                        mS(_, _, h, b)),
                                          Shape<Int<M>, _2>{}, make_coord(m_block, 0))),
             tma_s.partition_D(sS));
        if (++m_block == m_hi) m_block = m_lo, ++h;  // (no division by n_m a step)
      }
    } else if (warp == 1 && steps > 0) {
      // the dQ warp: each consumer warpgroup's tile of a step, added into dq_accum by one bulk
      // copy (one a warpgroup where each warp's own quarter took four times the copies and
      // the consumers' waits on them); the warpgroup's staging is free again once the copy
      // has read it
      const bool leader = cute::elect_one_sync();
      int h = kv_head * group, m_block = m_lo;
      for (int step = 0; step < steps; ++step) {
        const int64_t q_tile = (int64_t(b) * p.q_heads + h) * p.dq_tiles + dq_base + m_block;
        CUTE_UNROLL
        for (int wg = 0; wg < 2; ++wg) {
          NamedBarrierSync(kDqFullBarrier + wg, kDqBarrierThreads);
          if (leader) {
            BulkReduceAdd(p.dq_accum + (q_tile * 2 + wg) * Traits::kDqWarpgroupFloats,
                          shared.dq[wg], Traits::kDqWarpgroupFloats * 4);
          }
        }
        if (leader) BulkWaitRead<1>();  // warpgroup 0's copy
        __syncwarp();
        NamedBarrierArrive(kDqEmptyBarrier, kDqBarrierThreads);
        if (leader) BulkWaitRead<0>();
        __syncwarp();
        NamedBarrierArrive(kDqEmptyBarrier + 1, kDqBarrierThreads);
        if (++m_block == m_hi) m_block = m_lo, ++h;
      }
      if (leader) BulkWait();
    }
    return;
  }

  // ---- consumer warpgroups
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int tid = threadIdx.x - 128;  // 0 .. 255
  const int wg = warp / 4 - 1;
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<N>, Int<D>>{});
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<N>, Int<D>>{});
  clear(tdKrdK);
  clear(tdVrdV);

  if (steps > 0) {
    Tensor sdS = make_tensor(make_smem_ptr(shared.ds), typename Traits::SmemLayoutdS{});
    Tensor sQt = make_tensor(make_smem_ptr(shared.q), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(shared.dout), typename Traits::SmemLayoutQt{});
    Tensor sKt = make_tensor(make_smem_ptr(shared.k), typename Traits::SmemLayoutKt{});
    Tensor sdSt = make_tensor(make_smem_ptr(shared.ds), typename Traits::SmemLayoutdSt{});

    auto wg_sdp = mma_sdp.get_slice(wg * 128);
    auto wg_dkv = mma_dkv.get_slice(wg * 128);
    auto wg_dq = mma_dq.get_slice(wg * 128);
    Tensor tSrK = wg_sdp.partition_fragment_A(sK);      // (MMA, MMA_M, MMA_K)
    Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);      // (MMA, MMA_N, MMA_K, STAGE)
    Tensor tdPrV = wg_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = wg_sdp.partition_fragment_B(sdO);
    Tensor tdVrdO = wg_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, STAGE)
    Tensor tdKrQ = wg_dkv.partition_fragment_B(sQt);
    Tensor tdQrdS = wg_dq.partition_fragment_A(sdS);    // (MMA, MMA_M, MMA_K, STAGE)
    Tensor tdQrK = wg_dq.partition_fragment_B(sKt);

    auto thr_sdp = mma_sdp.get_thread_slice(tid);
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<N>, Int<M>>{}));  // (key, row)
    // dS^T from the registers into sdS, transposed on the way by stmatrix (FlashAttention-3's
    // SM90_U16x8_STSM_T with S computed transposed)
    auto ds_store = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, T>{}, mma_sdp);
    auto thr_ds_store = ds_store.get_thread_slice(tid);
    Tensor tdSsdS = thr_ds_store.partition_D(as_position_independent_swizzle_tensor(sdSt));
    const int wg_thread = tid % 128;
    float* dq_smem = shared.dq[wg] + (wg_thread / 32) * (Traits::kDqWarpgroupFloats / 4);
    // the dQ staging starts empty: this warpgroup's first warp stands in for the dQ warp's
    // arrival
    if (wg_thread < 32) NamedBarrierArrive(kDqEmptyBarrier + wg, kDqBarrierThreads);

    // packed: zeroes rows [from, rows) of a shared tile (16-byte chunks, whole under the
    // swizzle) with every consumer thread, then publishes the zeros to the tensor cores
    auto zero_rows = [&](auto&& tile_a, auto&& tile_b, int from, int rows) {
      constexpr int kChunks = D / 8;
      for (int chunk = tid + max(from, 0) * kChunks; chunk < rows * kChunks;
           chunk += Traits::kConsumerThreads) {
        StoreShared128Zero(&tile_a(chunk / kChunks, (chunk % kChunks) * 8));
        StoreShared128Zero(&tile_b(chunk / kChunks, (chunk % kChunks) * 8));
      }
      FenceAsyncShared();  // the generic stores, before wgmma reads
      asm volatile("bar.sync 1, 256;\n" ::: "memory");
    };

    FullBarrier::wait(&shared.kv_full, 0);
    if constexpr (kPacked) {
      // keys past the sequence's end (the next sequence's, or padding): their P and dS are 0,
      // but K meets every row in dQ = dS K and V every row in dP = dO V^T
      if (kv_len - n0 < N) zero_rows(sK, sV, kv_len - n0, N);
    }
    int h = kv_head * group, m_block = m_lo;
    for (int step = 0; step < steps; ++step) {
      const int s = step % kStages;
      const int ds_stage = step & 1;
      const int m0 = m_block * M;
      FullBarrier::wait(&shared.full[s], (step / kStages) & 1);
      if constexpr (kPacked) {  // rows past the sequence's end meet every key in dK and dV
        if (q_len - m0 < M) zero_rows(sQ(_, _, s), sdO(_, _, s), q_len - m0, M);
      }

      Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<N>, Int<M>>{});
      gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, s), tSrS);
      Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<N>, Int<M>>{});
      gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, s), tdPrdP);

      const bool full = n0 + N <= kv_len && m0 + M <= q_len &&
                        (!p.has_upper || n0 + N - 1 <= m0 + offset + p.upper) &&
                        (!p.has_lower || n0 >= m0 + M - 1 + offset - p.lower);
      // this thread's rows' statistics into registers while the products run (a shared-memory
      // load right before each use stalled the exponentials). In SM90's wgmma accumulator a
      // thread's values 4j .. 4j + 3 sit in the query columns c, c + 1, c, c + 1 (c even), so
      // each pair of columns is one 8-byte load: 16 loads a step where a load per distinct
      // column took 32, which ncu counted as the shared loads this kernel did beyond
      // FlashAttention-3's (2.49 M against 1.31 M at 8192 tokens / 8 documents)
      constexpr int kPairs = size(decltype(tSrS){}) / 4;
      static_assert(kPairs * 4 == size(decltype(tSrS){}), "whole (2, 2) value groups");
      float2 lse2[kPairs], row_term[kPairs];
      CUTE_UNROLL
      for (int j = 0; j < kPairs; ++j) {
        lse2[j] = *reinterpret_cast<const float2*>(&shared.stats[s][0][get<1>(tScS(4 * j))]);
      }
      auto pair_at = [](const float2 (&pairs)[kPairs], int i) {
        return i % 2 == 0 ? pairs[i / 4].x : pairs[i / 4].y;
      };
      warpgroup_wait<1>();  // S^T
      if (full) {  // two loops, so that no element of a whole tile branches
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          tSrS(i) = Exp2(tSrS(i) * p.scale_log2 - pair_at(lse2, i));
        }
        CUTE_UNROLL
        for (int j = 0; j < kPairs; ++j) {
          row_term[j] =
              *reinterpret_cast<const float2*>(&shared.stats[s][1][get<1>(tScS(4 * j))]);
        }
        warpgroup_wait<0>();  // dP^T
        CUTE_UNROLL
        for (int i = 0; i < size(tdPrdP); ++i) {
          tdPrdP(i) = tSrS(i) * (tdPrdP(i) - pair_at(row_term, i));
        }
      } else {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          const int q = m0 + get<1>(tScS(i)), kv = n0 + get<0>(tScS(i));
          // (Visible's test with this CTA's bounds: predicates and selects only)
          const bool visible = static_cast<bool>(
              int(kv < kv_len) & int(q < q_len) &
              (int(!p.has_upper) | int(kv <= q + offset + p.upper)) &
              (int(!p.has_lower) | int(kv >= q + offset - p.lower)));
          tSrS(i) = visible ? Exp2(tSrS(i) * p.scale_log2 - pair_at(lse2, i)) : 0.0f;
        }
        CUTE_UNROLL
        for (int j = 0; j < kPairs; ++j) {
          row_term[j] =
              *reinterpret_cast<const float2*>(&shared.stats[s][1][get<1>(tScS(4 * j))]);
        }
        warpgroup_wait<0>();  // dP^T
        CUTE_UNROLL
        for (int i = 0; i < size(tdPrdP); ++i) {  // an invisible pair's dP may be anything
          const float ds = tSrS(i) * (tdPrdP(i) - pair_at(row_term, i));
          tdPrdP(i) = tSrS(i) == 0.0f ? 0.0f : ds;
        }
      }
      Tensor rP = make_tensor_like<T>(tSrS);
      Tensor rdS = make_tensor_like<T>(tdPrdP);
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) {
        rP(i) = static_cast<T>(tSrS(i));
        rdS(i) = static_cast<T>(tdPrdP(i));
      }
      // sdS[ds_stage] was last read by the dQ product two steps ago, which every consumer
      // awaited before the last step's barrier below
      copy(ds_store, thr_ds_store.retile_S(rdS), tdSsdS(_, _, _, ds_stage));

      Tensor tdVrP = make_tensor(rP.data(), AccumulatorAsA(tSrS.layout()));
      gemm<false, -1>(mma_dkv, tdVrP, tdVrdO(_, _, _, s), tdVrdV);
      FenceAsyncShared();
      asm volatile("bar.sync 1, 256;\n" ::: "memory");  // both warpgroups' dS are in
      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<M>, Int<D>>{});
      gemm<true, -1>(mma_dq, tdQrdS(_, _, _, ds_stage), tdQrK, tdQrdQ);
      Tensor tdKrdS = make_tensor(rdS.data(), AccumulatorAsA(tdPrdP.layout()));
      gemm<false, 1>(mma_dkv, tdKrdS, tdKrQ(_, _, _, s), tdKrdK);  // dV and dQ done
      // each warp's part of the warpgroup's dQ tile, in the accumulator's register order (16
      // bytes a store), into the staging once the dQ warp's last copy has read it
      constexpr int kWarpFloats = Traits::kDqWarpgroupFloats / 4;
      static_assert(size(decltype(tdQrdQ){}) * 32 == kWarpFloats);
      NamedBarrierSync(kDqEmptyBarrier + wg, kDqBarrierThreads);
      CUTE_UNROLL
      for (int j = 0; j < size(tdQrdQ) / 4; ++j) {
        reinterpret_cast<float4*>(dq_smem)[j * 32 + lane] =
            make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3));
      }
      FenceAsyncShared();  // the generic stores, before the bulk copy reads them
      NamedBarrierArrive(kDqFullBarrier + wg, kDqBarrierThreads);
      warpgroup_wait<0>();
      __syncwarp();
      if (lane == 0) EmptyBarrier::arrive(&shared.empty[s]);  // Q, dO, stats of stage s read
      if (++m_block == m_hi) m_block = m_lo, ++h;
    }
  }

  // dK (times the softmax scale) and dV through shared memory (the Q and dO stages, free once
  // both warpgroups' last products are done), then out in 16-byte rows: writing the
  // accumulators' element pairs straight to global memory took ~8% of the kernel at 2048 keys.
  // Into shared memory by stmatrix (FlashAttention-3's epilogue): element by element the
  // compiler made them 128 generic 2-byte stores a thread, with 40 bytes of spilled addresses
  asm volatile("bar.sync 1, 256;\n" ::: "memory");  // every product of the loop is done
  Tensor sdK = make_tensor(make_smem_ptr(shared.q), typename Traits::SmemLayoutKV{});
  Tensor sdV = make_tensor(make_smem_ptr(shared.dout), typename Traits::SmemLayoutKV{});
  {
    auto dkv_store = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, T>{}, mma_dkv);
    auto thr_dkv_store = dkv_store.get_thread_slice(tid);
    Tensor rdK = make_tensor_like<T>(tdKrdK);
    Tensor rdV = make_tensor_like<T>(tdVrdV);
    CUTE_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) {
      rdK(i) = static_cast<T>(tdKrdK(i) * p.scale);
      rdV(i) = static_cast<T>(tdVrdV(i));
    }
    copy(dkv_store, thr_dkv_store.retile_S(rdK),
         thr_dkv_store.partition_D(as_position_independent_swizzle_tensor(sdK)));
    copy(dkv_store, thr_dkv_store.retile_S(rdV),
         thr_dkv_store.partition_D(as_position_independent_swizzle_tensor(sdV)));
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  constexpr int kChunks = D / 8;  // 16-byte chunks a row
  const int64_t first_key = (int64_t(b) * p.kv_seq + k_base + n0) * kv_row + int64_t(kv_head) * D;
  T* dk = static_cast<T*>(p.dk) + first_key;
  T* dv = static_cast<T*>(p.dv) + first_key;
  const int keys_out = kPacked ? min(kv_len - n0, N) : N;  // packed: the block's own keys
  static_assert(N * kChunks % Traits::kConsumerThreads == 0);
  CUTE_UNROLL
  for (int i = 0; i < N * kChunks / Traits::kConsumerThreads; ++i) {
    const int c = tid + i * Traits::kConsumerThreads;
    const int row = c / kChunks, col = (c % kChunks) * 8;
    // a 16-byte chunk of a row stays whole under the 128-byte swizzle
    if (!kPacked || row < keys_out) {
      const uint4 k_chunk = LoadShared128(&sdK(row, col));
      const uint4 v_chunk = LoadShared128(&sdV(row, col));
      StoreGlobal128(dk + row * kv_row + col, k_chunk);
      StoreGlobal128(dv + row * kv_row + col, v_chunk);
    }
  }
}

// The TMA descriptors of a call (built on the host from its pointers and sizes).
template <class Traits>
KernelParams<Traits> MakeKernelParams(const BwdParams& p) {
  using T = typename Traits::Element;
  constexpr int D = Traits::kHeadDim;
  auto seq_tensor = [&](const void* ptr, int seq, int heads) {
    return SequenceTensor<T, D>(ptr, seq, heads, p.batch);
  };
  KernelParams<Traits> w{};
  w.p = p;
  w.tma_q = make_tma_copy(SM90_TMA_LOAD{}, seq_tensor(p.q, p.q_seq, p.q_heads),
                          typename Traits::SmemLayoutQOne{});
  w.tma_dout = make_tma_copy(SM90_TMA_LOAD{}, seq_tensor(p.dout, p.q_seq, p.q_heads),
                             typename Traits::SmemLayoutQOne{});
  w.tma_k = make_tma_copy(SM90_TMA_LOAD{}, seq_tensor(p.k, p.kv_seq, p.kv_heads),
                          typename Traits::SmemLayoutKV{});
  w.tma_v = make_tma_copy(SM90_TMA_LOAD{}, seq_tensor(p.v, p.kv_seq, p.kv_heads),
                          typename Traits::SmemLayoutKV{});
  Tensor stats = make_tensor(
      make_gmem_ptr(p.stats),
      make_shape(int32_t(p.stats_seq), int32_t(2), int32_t(p.q_heads), int32_t(p.batch)),
      make_stride(_1{}, int64_t(p.stats_seq), int64_t(2) * p.stats_seq,
                  int64_t(2) * p.q_heads * p.stats_seq));
  w.tma_stats = make_tma_copy(SM90_TMA_LOAD{}, stats, typename Traits::SmemLayoutStats{});
  return w;
}

}  // namespace attnaux_hopper
