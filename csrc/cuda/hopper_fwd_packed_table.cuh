// The block table of the packed Hopper forward (hopper_fwd_packed.cu), built on the device from
// the sequences' offsets by one CTA launched just before the forward on the same stream: the
// lengths are data, so no table is known at trace time, and building it in XLA took six small
// fusions and a memset (~11 us of an H100 before the kernel started, against FlashAttention-3's
// one 2.7 us `prepare_varlen_num_blocks`).
//
// A *run* is a stretch of query tokens with one set of keys: each sequence's first
// min(length, max_seqlen_q) tokens (its keys: the first min(length, max_seqlen_kv) of its key
// span); the tokens of a sequence past max_seqlen_q, and the tokens past the last sequence,
// are runs without keys, so that the forward writes their rows too (out 0, lse = max = -inf:
// what `varlen_attention` returns for tokens that no sequence covers), with no pass over out
// after it. The table (FwdParams::blocks, int32 [6, blocks]) lists each run's blocks of 128
// rows (with each block's sequence, -1 for a run without keys): the sequences with the most
// blocks first (a counting sort by blocks; sequences of kTableBuckets - 1 blocks or more share
// a bucket), each sequence's last block first (under a causal mask its heaviest), the runs
// without keys last; entries past the last block hold m_block -1. The order within a bucket
// follows the CTA's atomics: it changes which CTA takes which tile, never a result (no tile
// reads another's output). The forward takes a copy of the table with chunks of long
// sequences' blocks heaviest first (`forward_blocks`, ForwardOrder); the backward the table.
//
// With `tile_base` set, the same CTA also writes the packed backward's dQ tile bases: the
// 64-row tiles of each sequence's first min(span, tile_max_len) queries of `tile_offsets`,
// prefix-summed (tile_base[i]: the tiles of the sequences before i; [n + 1] entries), and each
// tile's sequence (`tile_seq`, [dq_tiles], -1 past the last sequence's tiles). Built here
// rather than by XLA (a cumsum and a concatenate: two more launches before the backward), and
// by the forward too, so that a self-attention backward reuses the forward's work buffer whole
// and launches no table kernel of its own (`PackedWork`).
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "cuda/hopper_kernel_utils.cuh"

namespace attnaux_hopper {

struct PackedTableParams {
  const int* q_offsets;   // [num_seqs + 1], non-decreasing, within [0, total_q]
  const int* kv_offsets;  // [num_seqs + 1], non-decreasing, within [0, total_kv]
  int num_seqs, total_q, max_seqlen_q, max_seqlen_kv;
  int* blocks;  // [6, block_count]
  int block_count;
  int* run_start;  // [2 * num_seqs + 1] scratch: each run's first entry
  int* tile_counter;
  int* tile_base;  // [num_seqs + 1] or null: the dQ tile bases of `tile_offsets`' sequences
  int* tile_seq;   // [dq_tiles]: each dQ tile's sequence (with tile_base)
  const int* tile_offsets;
  int tile_max_len, dq_tiles;
  // the forward's copy of the table ([6, block_count]), chunks of it heaviest first by the key
  // blocks that the mask (FwdParams' has_upper ... bottom_right) leaves each block
  // (`ForwardOrder`); null for the backward's table
  int* forward_blocks;
  bool has_upper, has_lower, bottom_right;
  int upper, lower;
};

// The int32 work buffer of the packed handlers (hopper_fwd_packed.cu, hopper_bwd_packed.cu),
// one layout for both, so the backward can take the forward's: the table [6, block_count], each
// run's first entry [2 n + 1], the dQ tile bases [n + 1], the forward's tile counter [1], each
// dQ tile's sequence [dq_tiles] (dq_tiles = q_tokens / 64 + n + 1: PackedDqTiles), the
// forward's order of the table [6, block_count] (ForwardOrder; the backward's CTAs keep the
// table's).
struct PackedWork {
  int64_t block_count, num_seqs, dq_tiles;
  int64_t run_start() const { return 6 * block_count; }
  int64_t tile_base() const { return run_start() + 2 * num_seqs + 1; }
  int64_t tile_counter() const { return tile_base() + num_seqs + 1; }
  int64_t tile_seq() const { return tile_counter() + 1; }
  int64_t forward_blocks() const { return tile_seq() + dq_tiles; }
  int64_t size() const { return forward_blocks() + 6 * block_count; }
};

// A bound on the sequences' dQ tiles of 64 rows: each at most one more than its whole tiles,
// and at least one a 64 tokens (the backward's first pass zeroes dq's uncovered rows by them).
inline int64_t PackedDqTiles(int64_t q_tokens, int64_t num_seqs) {
  return q_tokens / 64 + num_seqs + 1;
}

constexpr int kTableThreads = 1024;
constexpr int kTableBuckets = 2048;  // (2 per thread in the scan)
constexpr int kTableRows = 128;      // the forward's query block (FwdTraits' M)
constexpr int kDqTileRows = 64;      // the backward's query tile (BwdTraits' M)
constexpr int kTableChunk = 32;      // entries a chunk of ForwardOrder (a warp's lanes)
constexpr int kForwardOrderMinRows = 1024;  // the shortest sequence ForwardOrder sorts

// Run r of the call: r < n sequence r's tokens with keys; n <= r < 2n sequence r - n's tokens
// past max_seqlen_q; 2n the tokens past the last sequence.
struct PackedRun {
  int q_off, q_len, kv_off, kv_len, n_blocks;
};

__device__ inline PackedRun RunOf(const PackedTableParams& t, int r) {
  const int n = t.num_seqs;
  PackedRun run{};
  if (r == 2 * n) {
    run.q_off = t.q_offsets[n];
    run.q_len = t.total_q - run.q_off;
  } else {
    const int i = r < n ? r : r - n;
    const int span = t.q_offsets[i + 1] - t.q_offsets[i];
    const int in = min(span, t.max_seqlen_q);
    if (r < n) {
      run.q_off = t.q_offsets[i];
      run.q_len = in;
      run.kv_off = t.kv_offsets[i];
      run.kv_len = min(t.kv_offsets[i + 1] - t.kv_offsets[i], t.max_seqlen_kv);
    } else {
      run.q_off = t.q_offsets[i] + in;
      run.q_len = span - in;
    }
  }
  run.q_len = max(run.q_len, 0);
  run.kv_len = max(run.kv_len, 0);
  run.n_blocks = (run.q_len + kTableRows - 1) / kTableRows;
  return run;
}

__device__ inline int BucketOf(const PackedTableParams& t, int r, int n_blocks) {
  // the runs without keys in bucket 0, the last in the order
  return r < t.num_seqs ? min(n_blocks, kTableBuckets - 1) : 0;
}

// The key blocks of 128 that the mask leaves the query rows of a table entry (the forward
// kernel's `tile_at`, in blocks of 128 keys whatever its own): the entry's weight.
__device__ inline int EntryWeight(const PackedTableParams& t, int m_block, int q_len, int kv_len) {
  const int m0 = m_block * kTableRows;
  const int offset = t.bottom_right ? kv_len - q_len : 0;
  int hi = (kv_len + kTableRows - 1) / kTableRows, lo = 0;
  if (t.has_upper) hi = min(hi, FloorDiv(m0 + kTableRows - 1 + offset + t.upper, kTableRows) + 1);
  if (t.has_lower) lo = max(lo, FloorDiv(m0 + offset - t.lower, kTableRows));
  return max(hi - lo, 0);
}

// The forward's copy of the table [0, used): each chunk of kTableChunk consecutive entries whose
// runs all have kForwardOrderMinRows queries or more heaviest first (stable), a warp a chunk;
// the other chunks as they are. The table lists the sequences longest first, each one's blocks
// together, so equal documents come one after another: the CTAs, taking tiles from the
// counter, reach the last document's heavy blocks late and the kernel's tail waits for them
// (a list-scheduling model of 16 heads of 8 causal documents of 1024 tokens on 132 SMs: 1.031x
// the ideal makespan). Heaviest first across all documents (1.007x) reads every document's K
// and V in each wave of tiles: 64 MB at 8 x 1024 tokens x 16 heads x 128, more than the 50 MB
// L2. A chunk of 32 blocks of 128 queries keeps a wave's K and V at about 32 MB there (four
// such documents: 1.013x in the model; measured on an H200, the forward kernel 2.5% faster at
// 8 such documents, 1.3% at 16). With short sequences the tail is short already, and a
// sequence's few blocks, next to each other, share its K and V in L2 (sorted, 256-token
// documents measured 6% slower). The backward's CTAs keep the table's order (in this one the
// forward and backward of 8 such documents measured 3% slower).
__device__ inline void ForwardOrder(const PackedTableParams& t, int used) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, stride = t.block_count;
  const int end = min(used, stride);
  for (int g = used + threadIdx.x; g < stride; g += kTableThreads) t.forward_blocks[g] = -1;
  for (int c0 = warp * kTableChunk; c0 < end; c0 += kTableThreads / 32 * kTableChunk) {
    const int e = c0 + lane;
    int entry[6] = {0, 0, 0, 0, 0, 0};
    int heavier = 0;  // the sort key, minus 1 minus the weight (lanes past the end: after all)
    if (e < end) {
      for (int f = 0; f < 6; ++f) entry[f] = t.blocks[e + f * stride];
      heavier = -1 - EntryWeight(t, entry[0], entry[2], entry[4]);
    }
    int rank = lane;
    if (__all_sync(0xffffffffu, e >= end || entry[2] >= kForwardOrderMinRows)) {
      rank = 0;
      for (int l = 0; l < 32; ++l) {
        const int other = __shfl_sync(0xffffffffu, heavier, l);
        rank += int(other < heavier || (other == heavier && l < lane));
      }
    }
    if (e < end) {
      for (int f = 0; f < 6; ++f) t.forward_blocks[c0 + rank + f * stride] = entry[f];
    }
  }
}

// (static: the packed forward and backward each launch their own copy, in their own TUs)
static __global__ void __launch_bounds__(kTableThreads) PackedTableKernel(PackedTableParams t) {
  using Scan = cub::BlockScan<int, kTableThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int cursor[kTableBuckets];  // blocks in the bucket, then its next free entry
  __shared__ int used;
  const int tid = threadIdx.x;
  const int runs = 2 * t.num_seqs + 1;
  for (int b = tid; b < kTableBuckets; b += kTableThreads) cursor[b] = 0;
  if (tid == 0) *t.tile_counter = 0;
  __syncthreads();
  for (int r = tid; r < runs; r += kTableThreads) {
    const PackedRun run = RunOf(t, r);
    if (run.n_blocks > 0) atomicAdd(&cursor[BucketOf(t, r, run.n_blocks)], run.n_blocks);
  }
  __syncthreads();
  // each bucket's first entry: the blocks of the buckets above it (thread i holds buckets
  // kTableBuckets - 1 - 2i and the one below)
  const int hi = kTableBuckets - 1 - 2 * tid;
  const int mine[2] = {cursor[hi], cursor[hi - 1]};
  int before, total;
  Scan(scan_storage).ExclusiveSum(mine[0] + mine[1], before, total);
  cursor[hi] = before;
  cursor[hi - 1] = before + mine[0];
  if (tid == 0) used = total;
  __syncthreads();
  for (int r = tid; r < runs; r += kTableThreads) {
    const PackedRun run = RunOf(t, r);
    t.run_start[r] =
        run.n_blocks > 0 ? atomicAdd(&cursor[BucketOf(t, r, run.n_blocks)], run.n_blocks) : 0;
  }
  __syncthreads();  // (global writes of this CTA: visible to it after the barrier)
  // a warp a run: its lanes write the run's blocks, the last block first
  const int warp = tid / 32, lane = tid % 32, stride = t.block_count;
  for (int r = warp; r < runs; r += kTableThreads / 32) {
    const PackedRun run = RunOf(t, r);
    const int start = t.run_start[r];
    // (the offsets' contract keeps every block inside the table; the bound keeps a broken one
    // from writing past it)
    for (int j = lane; j < run.n_blocks && start + j < stride; j += 32) {
      int* entry = t.blocks + start + j;
      entry[0] = run.n_blocks - 1 - j;
      entry[stride] = run.q_off;
      entry[2 * stride] = run.q_len;
      entry[3 * stride] = run.kv_off;
      entry[4 * stride] = run.kv_len;
      entry[5 * stride] = r < t.num_seqs ? r : -1;
    }
  }
  for (int g = used + tid; g < t.block_count; g += kTableThreads) t.blocks[g] = -1;
  if (t.forward_blocks != nullptr) {
    __syncthreads();  // (the entries, written by other warps above)
    ForwardOrder(t, used);
  }
  if (t.tile_base == nullptr) return;  // (uniform: every thread returns)
  // the dQ tile bases, kTableThreads sequences a scan, carried across scans
  int carry = 0;
  for (int i0 = 0; i0 <= t.num_seqs; i0 += kTableThreads) {
    const int i = i0 + tid;
    int tiles = 0;
    if (i < t.num_seqs) {
      const int span = t.tile_offsets[i + 1] - t.tile_offsets[i];
      tiles = (max(min(span, t.tile_max_len), 0) + kDqTileRows - 1) / kDqTileRows;
    }
    __syncthreads();  // (scan_storage: the previous scan's readers are done)
    int before, total;
    Scan(scan_storage).ExclusiveSum(tiles, before, total);
    if (i <= t.num_seqs) t.tile_base[i] = carry + before;
    carry += total;
  }
  __syncthreads();  // (tile_base, written above: visible to this CTA after the barrier)
  // each tile's sequence, a warp a sequence; the tiles past the last sequence's: -1
  for (int i = warp; i < t.num_seqs; i += kTableThreads / 32) {
    const int first = t.tile_base[i], end = min(t.tile_base[i + 1], t.dq_tiles);
    for (int m = first + lane; m < end; m += 32) t.tile_seq[m] = i;
  }
  for (int m = carry + tid; m < t.dq_tiles; m += kTableThreads) t.tile_seq[m] = -1;
}

}  // namespace attnaux_hopper
