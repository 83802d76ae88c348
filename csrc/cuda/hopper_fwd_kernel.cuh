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

// wgmma's N sizes other than 256, 192, 128, 96, 64, 32, 16 and 8 (160, 176 and 80 among them:
// FlashAttention-3's key blocks at head dims 128 and 256): without this CuTe's selector builds
// S = Q K^T of such a block from N = 16 or 32 atoms, 11 wgmma where one does
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

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
    // packed sequences: the tile the producer took from the counter, decoded (valid, m_block,
    // h, n_lo, n_blocks, q_base, q_len, kv_len, offset, seq: Tile's fields the consumers use)
    int tile_slot[10];
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

// The named barriers (0 is __syncthreads): 2 + w, warpgroup w's own; 4 + w, its turn to issue
// products; with packed sequences 6 + 2 w and 7 + 2 w, the tile slot's full and empty barriers
// of warpgroup w (its 128 threads and the producer's warp: a barrier per warpgroup, so that
// one warpgroup can start its next tile while the other finishes, as without the slot)
constexpr int kTileFullBarrier = 6, kTileEmptyBarrier = 7, kTileSlotThreads = 32 + 128;

template <class Traits, bool kPacked>
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
  //
  // Packed sequences (kPacked) instead take their tiles from a counter, as FlashAttention-3's
  // varlen scheduler does: the lengths are data, so no list is known at trace time. The
  // producer's first thread takes a CTA's first tile (blockIdx.x) and each next one
  // (gridDim.x + the counter's old value) and decodes it (its block's rows and keys: one
  // round of global reads) while the tile before is loading, right after that tile's first
  // loads; its warp publishes each tile in `tile_slot` (the slot's full barriers) before its
  // loads; each consumer warpgroup copies the slot, frees it (its empty barrier) and computes
  // the tile. (Each consumer decoding the tile itself, two dependent reads, and both
  // warpgroups meeting at one barrier measured 0.250 ms against the dense kernel's 0.167 on
  // the same 16 causal documents of 1024 tokens; the producer decoding each tile as it
  // published it, 0.218.) The query blocks come in the table's forward order
  // (hopper_fwd_packed_table.cuh: the longest sequences first, each sequence's last, under a
  // causal mask heaviest, block first; chunks of 32 blocks of sequences of 1024 queries or more
  // heaviest first: ForwardOrder), a block's heads next to each other.
  const int m_blocks = p.q_seq / M;
  const int tiles = kPacked ? p.block_count * p.q_heads : m_blocks * p.q_heads * p.batch;
  const int* schedule = p.schedule;
  const int* schedule_tiles = kPacked ? nullptr : schedule + gridDim.x + 1;
  const int list_begin = kPacked ? 0 : max(schedule[blockIdx.x], 0);
  const int list_end = kPacked ? 0 : min(schedule[blockIdx.x + 1], p.schedule_tiles);
  // A tile's rows and keys, counted from its sequence's first token (q_base, k_base: the
  // sequence's first tokens in the arrays' seq dim), and what its rows see in those
  // coordinates: with packed sequences, the sequence's; otherwise the parameters' (read from
  // them where used, the accessors below: copies in the tile cost the dense kernel registers,
  // ptxas 0 -> 76 spilled bytes at head dim 128)
  struct Tile {
    bool valid;
    int m_block, h, b, n_lo, n_blocks;
    int q_base, k_base, q_len, kv_len, offset, seq;  // packed sequences only
  };
  auto q_base_of = [&](const Tile& tile) { return kPacked ? tile.q_base : 0; };
  auto k_base_of = [&](const Tile& tile) { return kPacked ? tile.k_base : 0; };
  auto q_len_of = [&](const Tile& tile) { return kPacked ? tile.q_len : p.q_len; };
  auto kv_len_of = [&](const Tile& tile) { return kPacked ? tile.kv_len : p.kv_len; };
  auto offset_of = [&](const Tile& tile) { return kPacked ? tile.offset : p.offset; };
  auto tile_at = [&](int t) {
    Tile tile;
    tile.valid = t >= 0 && t < tiles;
    if (!tile.valid) return tile;
    if constexpr (kPacked) {
      const int pair = t / p.q_heads;
      const int* block = p.blocks + pair;
      const int stride = p.block_count;
      tile.m_block = block[0];
      tile.q_base = block[stride];
      tile.q_len = block[2 * stride];
      tile.k_base = block[3 * stride];
      tile.kv_len = block[4 * stride];
      tile.seq = block[5 * stride];
      tile.valid = tile.m_block >= 0;
      if (!tile.valid) return tile;
      tile.h = t % p.q_heads;
      tile.b = 0;
      tile.offset = p.offset + (p.bottom_right ? tile.kv_len - tile.q_len : 0);
    } else {
      const int head = t / m_blocks;
      tile.m_block = t % m_blocks;
      tile.h = head % p.q_heads;
      tile.b = head / p.q_heads;
    }
    // the key blocks that some row of [m0, m0 + M) sees
    const int m0 = tile.m_block * M;
    int n_lo = 0;
    // (a last block past the keys: TMA fills the rows past the arrays with zeros, the mask
    // hides them and the next sequence's keys)
    int n_hi = (min(kv_len_of(tile), p.kv_seq) + N - 1) / N;
    if (p.has_upper) n_hi = min(n_hi, FloorDiv(m0 + M - 1 + offset_of(tile) + p.upper, N) + 1);
    if (p.has_lower) n_lo = max(n_lo, FloorDiv(m0 + offset_of(tile) - p.lower, N));
    if (m0 >= q_len_of(tile)) n_hi = n_lo;
    tile.n_lo = n_lo;
    tile.n_blocks = max(n_hi - n_lo, 0);
    return tile;
  };
  auto named_sync = [](int barrier, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(barrier), "r"(threads) : "memory");
  };
  auto named_arrive = [](int barrier, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(barrier), "r"(threads) : "memory");
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
    if (warp == 0) {
      const bool leader = cute::elect_one_sync();
      Tensor mQ = params.tma_q.get_tma_tensor(make_shape(p.q_seq, D, p.q_heads, p.batch));
      Tensor mK = params.tma_k.get_tma_tensor(make_shape(p.kv_seq, D, p.kv_heads, p.batch));
      Tensor mV = params.tma_v.get_tma_tensor(make_shape(p.kv_seq, D, p.kv_heads, p.batch));
      auto tma_q = params.tma_q.get_slice(Int<0>{});
      auto tma_k = params.tma_k.get_slice(Int<0>{});
      auto tma_v = params.tma_v.get_slice(Int<0>{});
      int it = 0;       // K and V blocks loaded, over all tiles: the pipeline's position
      int q_loads = 0;  // tiles whose Q was loaded
      // the leader's loads of a tile's Q and key blocks; `after_first` runs after the first
      // block's loads
      auto load = [&](const Tile& tile, auto&& after_first) {
        const int kv_head = tile.h / (p.q_heads / p.kv_heads);
        Tensor gQ = domain_offset(make_coord(q_base_of(tile), 0), mQ(_, _, tile.h, tile.b));
        Tensor gK = domain_offset(make_coord(k_base_of(tile), 0), mK(_, _, kv_head, tile.b));
        Tensor gV = domain_offset(make_coord(k_base_of(tile), 0), mV(_, _, kv_head, tile.b));
        for (int i = 0; i < tile.n_blocks; ++i, ++it) {
          const int s = it % kStages;
          const int n_block = tile.n_lo + i;
          const int phase = ((it / kStages) - 1) & 1;
          if (it >= kStages) EmptyBarrier::wait(&shared.k_empty[s], phase);
          FullBarrier::arrive_and_expect_tx(&shared.k_full[s], Traits::kBlockBytes);
          copy(params.tma_k.with(shared.k_full[s]),
               tma_k.partition_S(local_tile(gK, Shape<Int<N>, Int<D>>{}, make_coord(n_block, 0))),
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
                 tma_q.partition_S(
                     local_tile(gQ, Shape<Int<M>, Int<D>>{}, make_coord(tile.m_block, 0))),
                 tma_q.partition_D(sQ(_, _, q_buf)));
          }
          if (it >= kStages) EmptyBarrier::wait(&shared.v_empty[s], phase);
          FullBarrier::arrive_and_expect_tx(&shared.v_full[s], Traits::kBlockBytes);
          copy(params.tma_v.with(shared.v_full[s]),
               tma_v.partition_S(local_tile(gV, Shape<Int<N>, Int<D>>{}, make_coord(n_block, 0))),
               tma_v.partition_D(sV(_, _, s)));
          if (i == 0) after_first();
        }
      };
      if constexpr (!kPacked) {
        if (leader) {
          for (int entry = list_begin; entry < list_end; ++entry) {
            const Tile tile = tile_at(schedule_tiles[entry]);
            if (tile.valid && tile.n_blocks > 0) load(tile, [] {});
          }
        }
      } else {
        // the whole warp meets the tile slot's barriers; lane 0 takes, decodes and loads the
        // tiles (`tile` and `claimed` are lane 0's)
        Tile tile;
        tile.valid = false;
        int claimed = 0;
        if (lane == 0) tile = tile_at(blockIdx.x);
        auto take_next = [&] {  // lane 0: the next tile, decoded
          claimed = int(gridDim.x) + atomicAdd(p.tile_counter, 1);
          return tile_at(claimed);
        };
        for (bool first = true;; first = false) {
          if (!first) {
            named_sync(kTileEmptyBarrier, kTileSlotThreads);
            named_sync(kTileEmptyBarrier + 2, kTileSlotThreads);
          }
          if (lane == 0) {
            int* slot = shared.tile_slot;
            slot[0] = tile.valid;
            slot[1] = tile.m_block;
            slot[2] = tile.h;
            slot[3] = tile.n_lo;
            slot[4] = tile.n_blocks;
            slot[5] = tile.q_base;
            slot[6] = tile.q_len;
            slot[7] = tile.kv_len;
            slot[8] = tile.offset;
            slot[9] = tile.seq;
          }
          named_arrive(kTileFullBarrier, kTileSlotThreads);
          named_arrive(kTileFullBarrier + 2, kTileSlotThreads);
          if (!__shfl_sync(0xffffffffu, int(tile.valid), 0)) break;
          if (lane == 0) {
            Tile next;
            if (tile.n_blocks > 0) {
              load(tile, [&] { next = take_next(); });
            } else {
              next = take_next();
            }
            tile = next;
          }
          __syncwarp();
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
  for (int entry = list_begin;; ++entry) {
    Tile tile;
    if constexpr (kPacked) {
      named_sync(kTileFullBarrier + 2 * wg, kTileSlotThreads);
      const int* slot = shared.tile_slot;
      tile.valid = slot[0];
      if (!tile.valid) break;  // (the producer stopped there too: no empty barrier to meet)
      tile.m_block = slot[1];
      tile.h = slot[2];
      tile.b = 0;
      tile.n_lo = slot[3];
      tile.n_blocks = slot[4];
      tile.q_base = slot[5];
      tile.q_len = slot[6];
      tile.kv_len = slot[7];
      tile.offset = slot[8];
      tile.seq = slot[9];
      named_arrive(kTileEmptyBarrier + 2 * wg, kTileSlotThreads);
    } else {
      if (entry >= list_end) break;
      tile = tile_at(schedule_tiles[entry]);
      if (!tile.valid) continue;
    }
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
        // (packed sequences: rows past the sequence's end are computed and never stored, so
        // their rule is left out: the consumers keep fewer of the tile's values in registers)
        return n0 + N <= kv_len_of(tile) && (kPacked || r0 + 64 <= q_len_of(tile)) &&
               (!p.has_upper || n0 + N - 1 <= r0 + offset_of(tile) + p.upper) &&
               (!p.has_lower || n0 >= r0 + 63 + offset_of(tile) - p.lower);
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
            int hi = (kPacked || row < q_len_of(tile)) ? kv_len_of(tile) : 0;
            if (p.has_upper) hi = min(hi, row + offset_of(tile) + p.upper + 1);
            lo[r] = p.has_lower ? max(row + offset_of(tile) - p.lower, 0) : 0;
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
      if constexpr (kPacked) {
        // The tile's last key block can reach past its sequence's keys (into the next
        // sequence's, or padding): those keys' P is 0, but 0 * NaN is NaN in the tensor cores,
        // so their V rows are zeroed here first, by each warpgroup for its own product (both
        // write the same zeros; the stage stays loaded until both have released it). Only
        // this block can: no block past the keys is visited. (In place of a `where` over all
        // of V before the call: 47 us at 16384 tokens x 16 heads x 128 on an H100.)
        const int keys_in = kv_len_of(tile) - (tile.n_lo + n_blocks - 1) * N;
        if (keys_in < N) {
          constexpr int kChunks = D / 8;  // 16-byte chunks a row, whole under the swizzle
          for (int chunk = tid % 128 + max(keys_in, 0) * kChunks; chunk < N * kChunks;
               chunk += 128) {
            StoreShared128Zero(&sV(chunk / kChunks, (chunk % kChunks) * 8, s_last));
          }
          cutlass::arch::fence_view_async_shared();  // the generic stores, before wgmma reads
          asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
        }
      }
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
    // directly. With packed sequences only the sequence's own rows go out (the next ones are
    // the next sequence's).
    constexpr int kChunks = D / 8;  // 16-byte chunks a row
    const int64_t q_row = int64_t(p.q_heads) * D;
    const int head = tile.h, q_base = q_base_of(tile), q_len = q_len_of(tile);
    T* out = static_cast<T*>(p.out) + (int64_t(tile.b) * p.q_seq + q_base + r0) * q_row +
             int64_t(head) * D;
    const int wg_thread = tid % 128;
    const int rows_out = kPacked ? min(q_len - r0, 64) : 64;
    if (n_blocks > 0) {
      // into shared memory by stmatrix (8 a thread; as the backward's dK and dV): pair by pair
      // the swizzled addresses took ptxas ~390 instructions a tile, most of a key block's worth
      auto o_store = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, T>{}, mma_pv);
      auto thr_o_store = o_store.get_thread_slice(tid);
      Tensor rO = make_tensor_like<T>(tOrO);
      CUTE_UNROLL
      for (int x = 0; x < size(tOrO); ++x) rO(x) = static_cast<T>(tOrO(x));
      Tensor sO = make_tensor(make_smem_ptr(shared.q + q_buf * (M * D)),
                              typename Traits::SmemLayoutQ{});
      copy(o_store, thr_o_store.retile_S(rO),
           thr_o_store.partition_D(as_position_independent_swizzle_tensor(sO)));
      asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
      CUTE_UNROLL
      for (int chunk = wg_thread; chunk < 64 * kChunks; chunk += 128) {
        const int row = chunk / kChunks, col = (chunk % kChunks) * 8;
        // a 16-byte chunk of a row stays whole under the 128-byte swizzle
        if (!kPacked || row < rows_out) {
          *reinterpret_cast<uint4*>(out + row * q_row + col) =
              LoadShared128(&sQ(wg * 64 + row, col, q_buf));
        }
      }
      release(&shared.q_empty[q_buf]);
    } else {
      CUTE_UNROLL
      for (int chunk = wg_thread; chunk < 64 * kChunks; chunk += 128) {
        const int row = chunk / kChunks, col = (chunk % kChunks) * 8;
        if (!kPacked || row < rows_out) {
          *reinterpret_cast<uint4*>(out + row * q_row + col) = make_uint4(0, 0, 0, 0);
        }
      }
    }
    if (lane % 4 == 0) {  // a row's four threads hold the same statistics
      const int64_t at = (int64_t(tile.b) * p.q_heads + head) * p.q_seq + q_base;
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = m0 + get<0>(tScS(2 * r));  // value 2 r: the thread's row r
        if (!kPacked || row < q_len) {
          p.lse[at + row] = lse[r];
          p.max[at + row] = mx_out[r];
        }
        if constexpr (kPacked) {
          // cuDNN's ragged statistics (FwdParams::stats): +inf where P is 0 throughout
          if (p.stats != nullptr && tile.seq >= 0 && row < p.stats_rows) {
            const bool counted = row < q_len && lse[r] != -kInf;
            p.stats[(int64_t(tile.seq) * p.q_heads + head) * p.stats_rows + row] =
                counted ? lse[r] : kInf;
          }
        }
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

template <class Traits, bool kPacked>
cudaError_t LaunchFwdTraits(const FwdParams& p, cudaStream_t stream) {
  auto kernel = HopperFwdKernel<Traits, kPacked>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  // the TMA descriptors of this call's tensors, passed as a __grid_constant__ parameter
  const FwdKernelParams<Traits> params = MakeFwdKernelParams<Traits>(p);
  // persistent: about one CTA an SM, each taking its list of tiles (packed sequences: its
  // tiles from the counter)
  kernel<<<dim3(p.grid), Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

// The kernel of each head dim (FwdTraits: keys a step, tiles' Q in shared memory), from
// FlashAttention-3's tiles and what was measured (H100, bf16, forward alone,
// tools/gpu_dev/fwd_ab.py; docs/performance.md, 2026-11-27 seventh session):
// - head dims 64 and 128: 128 keys, two Q buffers (64: 192 keys measured 0.88-1.05x);
// - head dim 256: 64 keys, one Q buffer (a second does not fit); FlashAttention-3's 80 keys
//   measured 0.67-0.78x (ptxas spills there: 224 bytes against 184 at 64).
// Against the 128 keys at head dim 128, FA3's 176 (one Q buffer) with its 64x176 wgmma
// (H200, 2026-11-28 twenty-first session): 1.00-1.01x at 1x8192x16 without a mask, 0.77-0.96x
// at 8x1024, 4x2048 causal and 1x8192 causal. (The seventh session's 160 and 176 keys at 128,
// and the 80 at 256 above, ran on wgmma of N = 32 or 16, before
// CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED above: not FA3's tiles.)
// `_flash_hopper.CUDA_FORWARD_KEYS` repeats these key blocks for the tile lists' cost model.
// Development builds of other tiles at head dim 128 (tools/gpu_dev/README.md):
#ifndef ATTNAUX_FWD_128_KEYS
#define ATTNAUX_FWD_128_KEYS 128
#endif
#ifndef ATTNAUX_FWD_128_QBUFFERS
#define ATTNAUX_FWD_128_QBUFFERS 2
#endif
template <class T, bool kPacked>
cudaError_t LaunchFwd(const FwdParams& p, int dim, cudaStream_t stream) {
  if (dim == 64) return LaunchFwdTraits<FwdTraits<T, 64, 128, 2>, kPacked>(p, stream);
  if (dim == 128) {
    return LaunchFwdTraits<FwdTraits<T, 128, ATTNAUX_FWD_128_KEYS, ATTNAUX_FWD_128_QBUFFERS>,
                           kPacked>(p, stream);
  }
  return LaunchFwdTraits<FwdTraits<T, 256, 64, 1>, kPacked>(p, stream);
}

}  // namespace attnaux_hopper
