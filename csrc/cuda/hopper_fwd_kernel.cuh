// attnaux's own Hopper (sm_90a) attention forward, in CUDA C++ with CuTe, returning out, lse and
// max: FlashAttention-3's forward (hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp) at head dims 64, 128
// and 256 (the tiles: hopper_fwd.cu).
//
// Persistent: a CTA an SM takes tiles of 128 query rows of one query head in turn (the order:
// the kernel's first lines). In a CTA:
// - a producer warpgroup (24 registers after setmaxnreg): one thread loads each tile's Q (two
//   buffers where they fit: the next tile's while this one runs) and each key block's K and V
//   (kBlockN keys) by TMA into a two-stage mbarrier pipeline that runs on across tiles;
// - two consumer warpgroups (240 registers), 64 rows each, holding O (64 x D float32), the
//   row maxima and the partial row sums in registers, taking turns to issue their products
//   (ping-pong). Per key block j (intra-warpgroup overlap: the softmax of block j runs while
//   the tensor cores do block j - 1's P V):
//     issue S_j = Q K_j^T                      (wgmma, shared-memory operands)
//     issue O += P_{j-1} V_{j-1}               (wgmma, P from the registers, V read MN-major)
//     wait for S_j; release K_j; mask (partly visible blocks only), row max,
//       P_j = exp2(S_j c - m c)
//     wait for P V; release V_{j-1}; O *= exp2(m_old c - m_new c)
// K and V have empty barriers of their own: K_j's stage is free once S_j is done, so the
// producer loads K_{j+2} a whole step before it is needed (one barrier for both held K until
// P V was done, and the consumers waited for K each step: ncu, 19% of the samples).
// The epilogue divides O by the row sums, stages it in the warpgroup's rows of its tile's Q
// buffer and writes 16-byte rows; lse and max go out from the registers.
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

// kBlockN keys a step; kQBuffers tiles' Q in shared memory (2: the next tile's Q loads during
// this one's epilogue; 1 where shared memory holds no second, as at head dim 256: the producer
// then loads the next tile's first K block before it waits for the epilogue to free Q)
template <class Element_, int kHeadDim_, int kBlockN_, int kQBuffers_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // query rows a CTA; consumer warpgroup w: [64 w, 64 w + 64)
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kQBuffers = kQBuffers_;
  static constexpr int kStages = 2;    // K and V blocks in flight
  static constexpr int kThreads = 384;  // a producer warpgroup, then two consumer warpgroups
  static constexpr int kConsumerThreads = 256;
  static_assert(kHeadDim % 64 == 0, "a row of K must fill whole 128-byte swizzle atoms");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "P V takes the keys 16 at a time");
  static_assert(kQBuffers == 1 || kQBuffers == 2);

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
  using SmemLayoutQs =
      decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, HeadDim, Int<kQBuffers>>{}));
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
    // Q of kQBuffers tiles (two: the producer loads the next tile's while the consumers work
    // on this one); a warpgroup stages its O in its own rows of its tile's Q (its products
    // alone read them)
    alignas(1024) Element q[cosize_v<SmemLayoutQs>];
    alignas(1024) Element k[cosize_v<SmemLayoutKV>];
    alignas(1024) Element v[cosize_v<SmemLayoutKV>];
    alignas(8) uint64_t q_full[kQBuffers];
    alignas(8) uint64_t q_empty[kQBuffers];
    alignas(8) uint64_t k_full[kStages];
    alignas(8) uint64_t v_full[kStages];
    alignas(8) uint64_t k_empty[kStages];  // K released once S is done, V once P V is
    alignas(8) uint64_t v_empty[kStages];
  };
  // the dynamic shared memory is aligned by hand to the swizzle atoms' 1024 bytes
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 CTA may take");
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
  constexpr int kStages = Traits::kStages, kQBuffers = Traits::kQBuffers;
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

  // Persistent: gridDim.x CTAs (about one an SM) each take the list of tiles (query block,
  // head, batch) that the schedule gives them, in its order; the producer loads the next
  // tile's Q and K while the consumers finish the last one. The schedule (int32): gridDim.x + 1
  // offsets, then the tiles t = (batch * q_heads + head) * m_blocks + m_block, CTA c's tiles
  // at [offsets[c], offsets[c + 1]). `_flash_hopper._cuda_forward_schedule` builds it from the
  // static geometry: in groups of heads, the heavy query blocks first under a causal mask, each
  // tile to the CTA that runs out of work first by the tiles' key blocks (the list
  // scheduling a dynamic tile counter would do, without the counter; why the groups: there).
  // Entries out of range are skipped (no read past the arrays; a tile not listed keeps
  // whatever its output held: the schedule's builder lists each tile once).
  const int m_blocks = p.q_seq / M;
  const int tiles = m_blocks * p.q_heads * p.batch;
  const int* schedule = p.schedule;
  const int* schedule_tiles = schedule + gridDim.x + 1;
  const int list_begin = max(schedule[blockIdx.x], 0);
  const int list_end = min(schedule[blockIdx.x + 1], p.schedule_tiles);
  struct Tile {
    int m_block, h, b, n_lo, n_blocks;
  };
  auto tile_at = [&](int t) {
    Tile tile;
    const int head = t / m_blocks;
    tile.m_block = t % m_blocks;
    tile.h = head % p.q_heads;
    tile.b = head / p.q_heads;
    // the key blocks that some row of [m0, m0 + M) sees
    const int m0 = tile.m_block * M;
    int n_lo = 0;
    // (a last block past kv_seq: TMA fills the rows past it with zeros, the mask hides them)
    int n_hi = (min(p.kv_len, p.kv_seq) + N - 1) / N;
    if (p.has_upper) n_hi = min(n_hi, FloorDiv(m0 + M - 1 + p.offset + p.upper, N) + 1);
    if (p.has_lower) n_lo = max(n_lo, FloorDiv(m0 + p.offset - p.lower, N));
    if (m0 >= p.q_len) n_hi = n_lo;
    tile.n_lo = n_lo;
    tile.n_blocks = max(n_hi - n_lo, 0);
    return tile;
  };

  if (warp == 0 && cute::elect_one_sync()) {
    for (int j = 0; j < kQBuffers; ++j) {
      FullBarrier::init(&shared.q_full[j], 1);
      EmptyBarrier::init(&shared.q_empty[j], Traits::kConsumerThreads / 32);
    }
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&shared.k_full[s], 1);
      FullBarrier::init(&shared.v_full[s], 1);
      EmptyBarrier::init(&shared.k_empty[s], Traits::kConsumerThreads / 32);
      EmptyBarrier::init(&shared.v_empty[s], Traits::kConsumerThreads / 32);
    }
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(shared.q), typename Traits::SmemLayoutQs{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v), typename Traits::SmemLayoutKV{});

  if (warp < 4) {  // ---- producer warpgroup: one thread issues every load
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (warp == 0 && cute::elect_one_sync()) {
      Tensor mQ = params.tma_q.get_tma_tensor(make_shape(p.q_seq, D, p.q_heads, p.batch));
      Tensor mK = params.tma_k.get_tma_tensor(make_shape(p.kv_seq, D, p.kv_heads, p.batch));
      Tensor mV = params.tma_v.get_tma_tensor(make_shape(p.kv_seq, D, p.kv_heads, p.batch));
      auto tma_q = params.tma_q.get_slice(Int<0>{});
      auto tma_k = params.tma_k.get_slice(Int<0>{});
      auto tma_v = params.tma_v.get_slice(Int<0>{});
      int it = 0;       // K and V blocks loaded, over all tiles: the pipeline's position
      int q_loads = 0;  // tiles whose Q was loaded
      for (int entry = list_begin; entry < list_end; ++entry) {
        const int t = schedule_tiles[entry];
        if (t < 0 || t >= tiles) continue;
        const Tile tile = tile_at(t);
        if (tile.n_blocks == 0) continue;
        const int kv_head = tile.h / (p.q_heads / p.kv_heads);
        for (int i = 0; i < tile.n_blocks; ++i, ++it) {
          const int s = it % kStages;
          const int n_block = tile.n_lo + i;
          const int phase = ((it / kStages) - 1) & 1;
          if (it >= kStages) EmptyBarrier::wait(&shared.k_empty[s], phase);
          FullBarrier::arrive_and_expect_tx(&shared.k_full[s], Traits::kBlockBytes);
          copy(params.tma_k.with(shared.k_full[s]),
               tma_k.partition_S(local_tile(mK(_, _, kv_head, tile.b), Shape<Int<N>, Int<D>>{},
                                            make_coord(n_block, 0))),
               tma_k.partition_D(sK(_, _, s)));
          if (i == 0) {
            // Q after the tile's first K block: with one Q buffer the wait for the last
            // tile's epilogue (which stages O in it) then holds back no K load
            const int q_buf = q_loads % kQBuffers;
            if (q_loads >= kQBuffers) {
              EmptyBarrier::wait(&shared.q_empty[q_buf], ((q_loads / kQBuffers) - 1) & 1);
            }
            ++q_loads;
            FullBarrier::arrive_and_expect_tx(&shared.q_full[q_buf], Traits::kQBytes);
            copy(params.tma_q.with(shared.q_full[q_buf]),
                 tma_q.partition_S(local_tile(mQ(_, _, tile.h, tile.b), Shape<Int<M>, Int<D>>{},
                                              make_coord(tile.m_block, 0))),
                 tma_q.partition_D(sQ(_, _, q_buf)));
          }
          if (it >= kStages) EmptyBarrier::wait(&shared.v_empty[s], phase);
          FullBarrier::arrive_and_expect_tx(&shared.v_full[s], Traits::kBlockBytes);
          copy(params.tma_v.with(shared.v_full[s]),
               tma_v.partition_S(local_tile(mV(_, _, kv_head, tile.b), Shape<Int<N>, Int<D>>{},
                                            make_coord(n_block, 0))),
               tma_v.partition_D(sV(_, _, s)));
        }
      }
    }
    return;
  }

  // ---- consumer warpgroups
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int tid = threadIdx.x - 128;  // 0 .. 255
  const int wg = warp / 4 - 1;
  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  const float c = p.scale_log2;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<M>, Int<N>>{}));  // (row, key)
  Tensor sVt = make_tensor(make_smem_ptr(shared.v), typename Traits::SmemLayoutVt{});
  auto wg_qk = mma_qk.get_slice(wg * 128);
  auto wg_pv = mma_pv.get_slice(wg * 128);
  Tensor tSrQ = wg_qk.partition_fragment_A(sQ);    // (MMA, MMA_M, MMA_K, BUFFER)
  Tensor tSrK = wg_qk.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K, STAGE)
  Tensor tOrVt = wg_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, STAGE)
  Tensor tOsQ = mma_pv.get_thread_slice(tid).partition_C(sQ);  // (MMA, MMA_M, MMA_N, BUFFER)

  // ping-pong: the warpgroups take turns issuing their products (named barriers 4 and 5,
  // each met by the 128 threads of its warpgroup waiting and the other's 128 arriving), so
  // that one's softmax runs while the other's products keep the tensor cores busy; the first
  // turn is the first warpgroup's, by its own arrival
  // (measured within 1% of no turns at all so far, where the softmax is not the bound)
  auto wait_turn = [&] { asm volatile("bar.sync %0, 256;\n" ::"r"(4 + wg) : "memory"); };
  auto pass_turn = [&] { asm volatile("bar.arrive %0, 256;\n" ::"r"(5 - wg) : "memory"); };
  if (wg == 0) asm volatile("bar.arrive 4, 256;\n" ::: "memory");
  auto release = [&](uint64_t* barrier) {  // a warp's arrival on an empty barrier
    __syncwarp();
    if (lane == 0) EmptyBarrier::arrive(barrier);
  };

  int it = 0;       // K and V blocks consumed, over all tiles
  int q_loads = 0;  // tiles whose Q was loaded
  for (int entry = list_begin; entry < list_end; ++entry) {
    const int t = schedule_tiles[entry];
    if (t < 0 || t >= tiles) continue;
    const Tile tile = tile_at(t);
    const int m0 = tile.m_block * M;
    const int r0 = m0 + wg * 64;  // this warpgroup's first row
    const int n_blocks = tile.n_blocks;
    const int q_buf = q_loads % kQBuffers;  // this tile's Q buffer (where it has a Q)
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<M>, Int<D>>{});
    clear(tOrO);
    // the accumulators' value i lies in row half (i / 2) % 2 of the thread's two rows (the
    // wgmma C layout: values (2 columns, 2 rows 8 apart, N / 8 column groups))
    float row_max[2] = {-kInf, -kInf}, row_sum[2] = {0.0f, 0.0f};

    if (n_blocks > 0) {
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
          // the keys [lo, lo + width) that each of the thread's two rows sees (Visible, row by
          // row): a subtraction and an unsigned compare an element
          int lo[2], width[2];
          CUTE_UNROLL
          for (int r = 0; r < 2; ++r) {
            const int row = m0 + get<0>(tScS(2 * r));  // value 2 r: the thread's row r
            int hi = row < p.q_len ? p.kv_len : 0;
            if (p.has_upper) hi = min(hi, row + p.offset + p.upper + 1);
            lo[r] = p.has_lower ? max(row + p.offset - p.lower, 0) : 0;
            width[r] = max(hi - lo[r], 0);
          }
          CUTE_UNROLL
          for (int i = 0; i < size(tSrS); ++i) {
            const int r = (i / 2) % 2;
            const bool seen = unsigned(n0 + get<1>(tScS(i)) - lo[r]) < unsigned(width[r]);
            tSrS(i) = seen ? tSrS(i) : -kInf;
          }
        }
        // the row maxima and sums in four partial results a row (value i: partial (i / 4) % 4):
        // one chain of 32 dependent instructions a row left the warp waiting on each
        float part[2][4];
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          part[r][0] = row_max[r];
          part[r][1] = part[r][2] = part[r][3] = -kInf;
        }
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          float& m = part[(i / 2) % 2][(i / 4) % 4];
          m = fmaxf(m, tSrS(i));
        }
        float mx[2], ms[2];
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          mx[r] = fmaxf(fmaxf(part[r][0], part[r][1]), fmaxf(part[r][2], part[r][3]));
        }
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {  // the row's four threads (lanes 4 t1 + t0)
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
          ms[r] = mx[r] == -kInf ? 0.0f : mx[r] * c;  // (no -inf - -inf)
          corr[r] = row_max[r] == -kInf ? 0.0f : Exp2(row_max[r] * c - ms[r]);
          row_max[r] = mx[r];
        }
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) part[r][0] = part[r][1] = part[r][2] = part[r][3] = 0.0f;
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          tSrS(i) = Exp2(tSrS(i) * c - ms[(i / 2) % 2]);
          part[(i / 2) % 2][(i / 4) % 4] += tSrS(i);
        }
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          const float sum = (part[r][0] + part[r][1]) + (part[r][2] + part[r][3]);
          row_sum[r] = row_sum[r] * corr[r] + sum;
        }
      };
      auto to_p = [&](auto const& tSrS) {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) rP(i) = static_cast<T>(tSrS(i));
      };

      FullBarrier::wait(&shared.q_full[q_buf], (q_loads / kQBuffers) & 1);
      ++q_loads;
      float corr[2];
      {
        const int s = it % kStages;
        FullBarrier::wait(&shared.k_full[s], (it / kStages) & 1);
        Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<M>, Int<N>>{});
        wait_turn();
        gemm<true, -1>(mma_qk, tSrQ(_, _, _, q_buf), tSrK(_, _, _, s), tSrS);
        pass_turn();
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrS);
        release(&shared.k_empty[s]);
        softmax(tSrS, tile.n_lo * N, corr);
        to_p(tSrS);
        ++it;
      }
      for (int i = 1; i < n_blocks; ++i, ++it) {
        const int s = it % kStages, s_prev = (it - 1) % kStages;
        FullBarrier::wait(&shared.k_full[s], (it / kStages) & 1);
        FullBarrier::wait(&shared.v_full[s_prev], ((it - 1) / kStages) & 1);
        Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<M>, Int<N>>{});
        wait_turn();
        gemm<true, -1>(mma_qk, tSrQ(_, _, _, q_buf), tSrK(_, _, _, s), tSrS);
        gemm<false, -1>(mma_pv, tOrP, tOrVt(_, _, _, s_prev), tOrO);
        pass_turn();
        warpgroup_wait<1>();  // S_i
        // the fences keep the compiler from reading S before its wait or O before P V's
        warpgroup_fence_operand(tSrS);
        release(&shared.k_empty[s]);                      // K_i read
        softmax(tSrS, (tile.n_lo + i) * N, corr);
        warpgroup_fence_operand(tSrS);
        FenceRegisters(corr[0], corr[1], row_sum[0], row_sum[1]);
        // a named barrier of the warpgroup keeps most of the softmax above the wait: ptxas
        // moves register arithmetic across wgmma.wait_group freely (empty asm fences are gone
        // by then) and sank all of the exponentials below it, losing the overlap (ncu: 14% of
        // the samples at the wait)
        // (a store of the row sums to shared memory instead keeps all of them above it, and
        // measured 3-5% slower than this barrier, which keeps about a third)
        asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
        warpgroup_wait<0>();  // P_{i-1} V_{i-1}
        warpgroup_fence_operand(tOrO);
        release(&shared.v_empty[s_prev]);  // V_{i-1} read
        // (rescaling O only where a row's maximum moved, after a vote of the warp, measured
        // 3-4% slower: the branch let ptxas sink the exponentials below the wait again)
        CUTE_UNROLL
        for (int x = 0; x < size(tOrO); ++x) tOrO(x) *= corr[(x / 2) % 2];
        to_p(tSrS);
      }
      const int s_last = (it - 1) % kStages;
      FullBarrier::wait(&shared.v_full[s_last], ((it - 1) / kStages) & 1);
      gemm<false, 0>(mma_pv, tOrP, tOrVt(_, _, _, s_last), tOrO);
      release(&shared.v_empty[s_last]);
    }

    // ---- epilogue: O / row sums, lse and max (natural log); a row that sees nothing: 0,
    // -inf; a NaN the row sees: NaN in all three
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

    // O through the warpgroup's rows of its Q buffer (its products that read them are done)
    // to 16-byte rows out; only this warpgroup's 128 threads meet at its named barrier; then
    // the buffer is the producer's again. A tile without keys has no Q buffer: zeros go out
    // directly.
    constexpr int kChunks = D / 8;  // 16-byte chunks a row
    const int64_t q_row = int64_t(p.q_heads) * D;
    T* out = static_cast<T*>(p.out) + (int64_t(tile.b) * p.q_seq + r0) * q_row +
             int64_t(tile.h) * D;
    const int wg_thread = tid % 128;
    if (n_blocks > 0) {
      Tensor tOsO = tOsQ(_, _, _, q_buf);
      CUTE_UNROLL
      for (int x = 0; x < size(tOrO); x += 2) {  // values x, x + 1: adjacent columns
        T pair[2] = {static_cast<T>(tOrO(x)), static_cast<T>(tOrO(x + 1))};
        uint32_t bits;
        memcpy(&bits, pair, sizeof(bits));
        StoreShared32(&tOsO(x), bits);
      }
      asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
      CUTE_UNROLL
      for (int chunk = wg_thread; chunk < 64 * kChunks; chunk += 128) {
        const int row = chunk / kChunks, col = (chunk % kChunks) * 8;
        // a 16-byte chunk of a row stays whole under the 128-byte swizzle
        *reinterpret_cast<uint4*>(out + row * q_row + col) =
            LoadShared128(&sQ(wg * 64 + row, col, q_buf));
      }
      release(&shared.q_empty[q_buf]);
    } else {
      CUTE_UNROLL
      for (int chunk = wg_thread; chunk < 64 * kChunks; chunk += 128) {
        const int row = chunk / kChunks, col = (chunk % kChunks) * 8;
        *reinterpret_cast<uint4*>(out + row * q_row + col) = make_uint4(0, 0, 0, 0);
      }
    }
    if (lane % 4 == 0) {  // a row's four threads hold the same statistics
      const int64_t at = (int64_t(tile.b) * p.q_heads + tile.h) * p.q_seq;
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = m0 + get<0>(tScS(2 * r));  // value 2 r: the thread's row r
        p.lse[at + row] = lse[r];
        p.max[at + row] = mx_out[r];
      }
    }
  }
}

// The TMA descriptors of a call (built on the host from its pointers and sizes).
template <class Traits>
FwdKernelParams<Traits> MakeFwdKernelParams(const FwdParams& p) {
  using T = typename Traits::Element;
  constexpr int D = Traits::kHeadDim;
  auto seq_tensor = [&](const void* ptr, int seq, int heads) {
    return SequenceTensor<T, D>(ptr, seq, heads, p.batch);
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
