// The `small_seq` attention primitive on CUDA (docs/kernel_abi.md; `attnaux_small_seq_fwd` /
// `_bwd`, same target names and ABI as the CPU handlers): q_seq == 1 and kv_seq <= 16, memory
// bound; see the section below for the access pattern. Deterministic: no atomics. Dropout uses
// the Philox layout of docs/kernel_abi.md (common/philox.h), so the keep-mask is bitwise the CPU
// one.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "common/attention_params.h"
#include "common/attention_validate.h"
#include "cuda/attention_rows.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/ffi_utils.cuh"
#include "cuda/kernels_cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace attnaux_cuda_kernels {

using attnaux::ValidationRules;

constexpr int kSmallMaxKeys = 16;

// ================================================================================================
// small_seq: q_seq == 1, kv_seq <= 16
//
// Memory bound: each (batch, kv head) owns kv_seq rows of K and of V, read once. A *group* of
// LANES lanes (8, 16 or 32: a power of two, so several groups share a warp) owns one query row
// in the forward and one (batch, kv head) in the backward. Its lanes split the head dim into
// 16-byte vectors, so one load instruction of the group reads whole rows, coalesced; the kv_seq
// rows of a lane's chunk are all requested before any arithmetic (16 x 16 bytes in flight per
// lane; about 120 registers, so 16 warps per SM). The partial dot products are summed across the
// group with shuffles; each lane then holds every logit and does the softmax of the <= 16 values
// itself. Measured on an H200 at batch 30720, 8 heads, head dim 128, kv_seq 16, bf16: forward
// 83% of the device copy bandwidth, forward+backward 85% (benchmarks/gpu_kernels.py). Splitting
// the forward into a K kernel and a V kernel (one stream of loads per warp, as XLA's reference
// path runs it) measured slower (66%) and was dropped.
// ================================================================================================
constexpr int kSmallThreads = 256;
// At least two blocks (16 warps) per SM: caps registers at 128, so that ptxas does not convert
// all 16 loaded rows to float at once (which took bf16 to 180+ registers and 8 warps per SM).
constexpr int kSmallMinBlocks = 2;

template <int LANES>
__device__ __forceinline__ uint32_t GroupBallot(bool pred) {
  const uint32_t ballot = __ballot_sync(0xffffffffu, pred);
  if constexpr (LANES == 32) {
    return ballot;
  } else {
    const int first = (threadIdx.x & 31) & ~(LANES - 1);
    return (ballot >> first) & ((1u << LANES) - 1u);
  }
}

// Bit j (j < 16) = pred(j), each lane evaluating the keys j with j % LANES == its lane.
template <int LANES, typename Pred>
__device__ __forceinline__ uint32_t KeyBits(int gl, const Pred& pred) {
  uint32_t bits = 0;
#pragma unroll
  for (int j0 = 0; j0 < kSmallMaxKeys; j0 += LANES) bits |= GroupBallot<LANES>(pred(j0 + gl)) << j0;
  return bits & ((1u << kSmallMaxKeys) - 1u);
}

template <int LANES, int N>
__device__ __forceinline__ void GroupSum(float (&x)[N]) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) {
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] += __shfl_xor_sync(0xffffffffu, x[j], o);
  }
}

// out[j] = src[j] (as float) for the keys in `bits`, 0 elsewhere, in every lane of the group:
// each lane reads the keys j % LANES == its lane, the group shares them.
template <typename T, int LANES>
__device__ __forceinline__ void GroupGather(const T* src, uint32_t bits, int gl, float (&out)[kSmallMaxKeys]) {
  constexpr int kPer = (kSmallMaxKeys + LANES - 1) / LANES;
  float mine[kPer];
#pragma unroll
  for (int s = 0; s < kPer; ++s) {
    const int j = s * LANES + gl;
    mine[s] = (j < kSmallMaxKeys && (bits >> j & 1u)) ? ToF<T>(src[j]) : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) out[j] = __shfl_sync(0xffffffffu, mine[j / LANES], j % LANES, LANES);
}

// Calls f(j) for the keys j < 16 that this lane writes (j % LANES == its lane); j is a constant
// after unrolling, so f may index register arrays with it.
template <int LANES, typename F>
__device__ __forceinline__ void ForOwnKeys(int gl, const F& f) {
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    if (j % LANES == gl) f(j);
  }
}

struct SmallKeys {
  uint32_t load = 0;     // keys inside the row's band: their K/V rows are read
  uint32_t visible = 0;  // of those, the keys the mask and the segment ids do not hide
  bool padding = true;
};

template <int LANES>
__device__ __forceinline__ SmallKeys SmallKeysOf(const AttentionParams& a, int64_t b, int64_t h, int gl) {
  const RowBand band = Band(a, b, 0);
  const RowHide hide = Hide(a, b, h, 0);
  SmallKeys r;
  r.padding = band.padding;
  r.load = KeyBits<LANES>(gl, [&](int j) { return j >= band.lo && j < band.hi; });
  if (a.mask != nullptr || a.q_segment_ids != nullptr) {
    r.visible = KeyBits<LANES>(gl, [&](int j) { return j >= band.lo && j < band.hi && NotHidden(a, hide, j); });
  } else {
    r.visible = r.load;
  }
  return r;
}

// Bit j = the dropout keep bit of key j of the query row of (b, h) (all ones without dropout).
template <int LANES>
__device__ __forceinline__ uint32_t SmallKeepBits(const AttentionParams& a, int64_t b, int64_t h,
                                                  int gl) {
  if (a.rng_state == nullptr) return (1u << kSmallMaxKeys) - 1u;
  return KeyBits<LANES>(gl, [&](int j) {
    return j < a.kv_len && DropoutWord(a.rng_state, a.DropoutIndex(b, h, 0, j)) >= a.drop_threshold;
  });
}

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> LoadVec(const T* p) {
  return *reinterpret_cast<const Vec<T, VEC>*>(p);
}

// r[j] = the VEC elements at d0 of row j, for the keys in `bits` (zeros for the others).
template <typename T, int VEC>
__device__ __forceinline__ void LoadRows(const T* base, int64_t stride, int64_t d0, uint32_t bits,
                                         Vec<T, VEC> (&r)[kSmallMaxKeys]) {
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    if (bits >> j & 1u) {
      r[j] = LoadVec<T, VEC>(base + j * stride + d0);
    } else {
      r[j] = Vec<T, VEC>{};  // zero bits
    }
  }
}

// acc[j] += <x, r[j]> over this lane's VEC elements, for the keys in `bits`.
template <typename T, int VEC>
__device__ __forceinline__ void DotRows(const Vec<T, VEC>& x, const Vec<T, VEC> (&r)[kSmallMaxKeys],
                                        uint32_t bits, float (&acc)[kSmallMaxKeys]) {
  float xf[VEC];
  ToFloats<T, VEC>(x, xf);
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    if (bits >> j & 1u) {
      float rf[VEC];
      ToFloats<T, VEC>(r[j], rf);
#pragma unroll
      for (int t = 0; t < VEC; ++t) acc[j] = fmaf(xf[t], rf[t], acc[j]);
    }
  }
}

// acc = sum over the keys in `bits` of w[j] * r[j]; keys outside `bits` are skipped, not
// multiplied by 0 (their rows may hold inf or NaN).
template <typename T, int VEC>
__device__ __forceinline__ void WeightedRows(const float (&w)[kSmallMaxKeys], const Vec<T, VEC> (&r)[kSmallMaxKeys],
                                             uint32_t bits, float (&acc)[VEC]) {
#pragma unroll
  for (int t = 0; t < VEC; ++t) acc[t] = 0.0f;
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    if (bits >> j & 1u) {
      float rf[VEC];
      ToFloats<T, VEC>(r[j], rf);
#pragma unroll
      for (int t = 0; t < VEC; ++t) acc[t] = fmaf(w[j], rf[t], acc[t]);
    }
  }
}

template <typename T, int VEC, int LANES>
__global__ void __launch_bounds__(kSmallThreads, kSmallMinBlocks)
    SmallSeqFwd(AttentionParams a, T* __restrict__ out, float* __restrict__ lse, float* __restrict__ row_max,
                T* __restrict__ probs) {
  using V = Vec<T, VEC>;
  constexpr int kStep = LANES * VEC;  // head-dim elements one pass of the group covers
  const int gl = threadIdx.x % LANES;
  const int64_t rows = a.batch * a.q_heads;
  const int64_t wanted = static_cast<int64_t>(blockIdx.x) * (kSmallThreads / LANES) + threadIdx.x / LANES;
  const bool owner = wanted < rows;  // groups past the end redo the last row and write nothing
  const int64_t row = owner ? wanted : rows - 1;
  const int64_t b = row / a.q_heads, h = row - b * a.q_heads;
  const int64_t hk = h / (a.q_heads / a.kv_heads);
  const SmallKeys keys = SmallKeysOf<LANES>(a, b, h, gl);
  const uint32_t keep = SmallKeepBits<LANES>(a, b, h, gl);
  const int64_t k_stride = a.kv_heads * a.head_dim, v_stride = a.kv_heads * a.v_dim;
  const T* q = static_cast<const T*>(a.q) + row * a.head_dim;  // [B, 1, Hq, D]
  const T* k_rows = static_cast<const T*>(a.k) + (b * a.kv_len * a.kv_heads + hk) * a.head_dim;
  const T* v_rows = static_cast<const T*>(a.v) + (b * a.kv_len * a.kv_heads + hk) * a.v_dim;
  const int64_t d_first = static_cast<int64_t>(gl) * VEC;

  float s[kSmallMaxKeys];
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) s[j] = 0.0f;
  for (int64_t d0 = d_first; d0 < a.head_dim; d0 += kStep) {
    V rows[kSmallMaxKeys];
    LoadRows<T, VEC>(k_rows, k_stride, d0, keys.load, rows);
    DotRows<T, VEC>(LoadVec<T, VEC>(q + d0), rows, keys.load, s);
  }
  GroupSum<LANES>(s);

  const float* bias_row = BiasRow(a, b, h, 0);
  float m = -kInf;
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    s[j] = (keys.visible >> j & 1u) ? Logit(a, bias_row, s[j], j) : -kInf;
    m = fmaxf(m, s[j]);
  }
  const float shift = m == -kInf ? 0.0f : m;
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) sum += (keys.visible >> j & 1u) ? expf(s[j] - shift) : 0.0f;
  const RowStats st = RowStatistics(a, h, m, sum);  // P divided by the row sum
  const float l = st.lse;
  float p[kSmallMaxKeys], w[kSmallMaxKeys];
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    p[j] = (st.scale != 0.0f && (keys.visible >> j & 1u)) ? expf(s[j] - st.shift) * st.scale
                                                           : 0.0f;
    w[j] = (keep >> j & 1u) ? p[j] * (a.rng_state != nullptr ? a.drop_scale : 1.0f) : 0.0f;
  }
  if (owner && probs != nullptr) {
    ForOwnKeys<LANES>(gl, [&](int j) {
      if (j < a.kv_len) probs[row * a.kv_len + j] = FromF<T>(p[j]);
    });
  }
  T* o = out + row * a.v_dim;
  for (int64_t d0 = d_first; d0 < a.v_dim; d0 += kStep) {
    V rows[kSmallMaxKeys];
    LoadRows<T, VEC>(v_rows, v_stride, d0, keys.load, rows);
    float acc[VEC];
    WeightedRows<T, VEC>(w, rows, keys.visible, acc);
    if (owner) StoreF<T, VEC>(o + d0, acc);
  }
  if (owner && gl == 0) {
    lse[row] = keys.padding ? (a.sink != nullptr ? a.sink[h] : -kInf) : l;
    row_max[row] = m;
  }
}

struct SmallBwdIo {
  const void* dout = nullptr;
  const void* probs = nullptr;
  const float* dlse = nullptr;
  const void* dprobs = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* dbias = nullptr;
};

constexpr int kBwdKeysPerPass = 4;  // keys whose dk / dv one pass of a group accumulates

// Backward: a group owns one (batch, kv head). Phase 1 walks the group's query heads in order:
// dov = dout . v and (with softcap) q . k, dS and dR from the saved P, dq and dbias, and keeps
// the per-key coefficients scale * dR and P * drop in shared memory. Phase 2 forms dk and dv of
// the group's keys from them, summing over the query heads in a fixed order: no atomics, and
// every output element is written by exactly one lane.
template <typename T, int VEC, int LANES>
__global__ void __launch_bounds__(kSmallThreads, kSmallMinBlocks) SmallSeqBwd(AttentionParams a, SmallBwdIo io) {
  extern __shared__ float coef_smem[];
  using V = Vec<T, VEC>;
  constexpr int kStep = LANES * VEC;
  const int gl = threadIdx.x % LANES, slot = threadIdx.x / LANES;
  const int64_t units = a.batch * a.kv_heads, group = a.q_heads / a.kv_heads;
  const int64_t wanted = static_cast<int64_t>(blockIdx.x) * (blockDim.x / LANES) + slot;
  const bool owner = wanted < units;
  const int64_t unit = owner ? wanted : units - 1;
  const int64_t b = unit / a.kv_heads, hk = unit - b * a.kv_heads;
  // [group][2][16]: scale * dR, then P * drop, of every query head of the unit
  float* coef = coef_smem + static_cast<int64_t>(slot) * group * 2 * kSmallMaxKeys;
  const int64_t k_stride = a.kv_heads * a.head_dim, v_stride = a.kv_heads * a.v_dim;
  const T* k_rows = static_cast<const T*>(a.k) + (b * a.kv_len * a.kv_heads + hk) * a.head_dim;
  const T* v_rows = static_cast<const T*>(a.v) + (b * a.kv_len * a.kv_heads + hk) * a.v_dim;
  const int64_t d_first = static_cast<int64_t>(gl) * VEC;
  const bool softcap = a.softcap > 0.0f;

  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g, row = b * a.q_heads + h;
    const SmallKeys keys = SmallKeysOf<LANES>(a, b, h, gl);
    const uint32_t keep = SmallKeepBits<LANES>(a, b, h, gl);
    const T* q = static_cast<const T*>(a.q) + row * a.head_dim;
    const T* dout = static_cast<const T*>(io.dout) + row * a.v_dim;
    float dov[kSmallMaxKeys], qk[kSmallMaxKeys];
#pragma unroll
    for (int j = 0; j < kSmallMaxKeys; ++j) dov[j] = qk[j] = 0.0f;
    for (int64_t d0 = d_first; d0 < a.v_dim; d0 += kStep) {
      V rows[kSmallMaxKeys];
      LoadRows<T, VEC>(v_rows, v_stride, d0, keys.load, rows);
      DotRows<T, VEC>(LoadVec<T, VEC>(dout + d0), rows, keys.load, dov);
    }
    GroupSum<LANES>(dov);
    if (softcap) {  // the raw scores, for the derivative of the tanh
      for (int64_t d0 = d_first; d0 < a.head_dim; d0 += kStep) {
        V rows[kSmallMaxKeys];
        LoadRows<T, VEC>(k_rows, k_stride, d0, keys.load, rows);
        DotRows<T, VEC>(LoadVec<T, VEC>(q + d0), rows, keys.load, qk);
      }
      GroupSum<LANES>(qk);
    }
    float p[kSmallMaxKeys], gp[kSmallMaxKeys];
    GroupGather<T, LANES>(static_cast<const T*>(io.probs) + row * a.kv_len, keys.visible, gl, p);
    if (io.dprobs != nullptr) {
      GroupGather<T, LANES>(static_cast<const T*>(io.dprobs) + row * a.kv_len, keys.visible, gl, gp);
    } else {
#pragma unroll
      for (int j = 0; j < kSmallMaxKeys; ++j) gp[j] = 0.0f;
    }
    const float drop = a.rng_state != nullptr ? a.drop_scale : 1.0f;
    float dpt[kSmallMaxKeys];
    float dt = 0.0f;
#pragma unroll
    for (int j = 0; j < kSmallMaxKeys; ++j) {
      const float dj = (keep >> j & 1u) ? drop : 0.0f;
      dpt[j] = (keys.visible >> j & 1u) ? dj * dov[j] + gp[j] : 0.0f;
      if (p[j] != 0.0f) dt += p[j] * dpt[j];
    }
    dt -= io.dlse[row];
    float ds[kSmallMaxKeys], dr[kSmallMaxKeys];
#pragma unroll
    for (int j = 0; j < kSmallMaxKeys; ++j) {
      ds[j] = p[j] != 0.0f ? p[j] * (dpt[j] - dt) : 0.0f;
      float deriv = 1.0f;
      if (softcap && p[j] != 0.0f) {
        const float t = tanhf(a.scale * qk[j] / a.softcap);
        deriv = 1.0f - t * t;
      }
      dr[j] = a.scale * (ds[j] * deriv);
    }
    if (owner && io.dbias != nullptr) {
      ForOwnKeys<LANES>(gl, [&](int j) {
        if (j < a.kv_len) io.dbias[row * a.kv_len + j] = ds[j];
      });
    }
    ForOwnKeys<LANES>(gl, [&](int j) {
      coef[(g * 2) * kSmallMaxKeys + j] = dr[j];
      coef[(g * 2 + 1) * kSmallMaxKeys + j] = (keep >> j & 1u) ? p[j] * drop : 0.0f;
    });
    // dq = sum_j scale * dR[j] * k[j]
    T* dq = static_cast<T*>(io.dq) + row * a.head_dim;
    for (int64_t d0 = d_first; d0 < a.head_dim; d0 += kStep) {
      V rows[kSmallMaxKeys];
      LoadRows<T, VEC>(k_rows, k_stride, d0, keys.load, rows);
      float acc[VEC];
      WeightedRows<T, VEC>(dr, rows, keys.visible, acc);
      if (owner) StoreF<T, VEC>(dq + d0, acc);
    }
  }
  __syncwarp();

  // dk[j] = sum_g coef_dR[g][j] * q[g];  dv[j] = sum_g coef_Pdrop[g][j] * dout[g]. A zero
  // coefficient is skipped rather than multiplied, so NaN in a padding row of q or dout stays out.
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t dim = pass == 0 ? a.head_dim : a.v_dim;
    const T* src = static_cast<const T*>(pass == 0 ? a.q : io.dout) + (b * a.q_heads + hk * group) * dim;
    T* dst = static_cast<T*>(pass == 0 ? io.dk : io.dv) + (b * a.kv_len * a.kv_heads + hk) * dim;
    const int64_t dst_stride = a.kv_heads * dim;
    for (int64_t j0 = 0; j0 < a.kv_len; j0 += kBwdKeysPerPass) {
      for (int64_t d0 = d_first; d0 < dim; d0 += kStep) {
        float acc[kBwdKeysPerPass][VEC];
#pragma unroll
        for (int jj = 0; jj < kBwdKeysPerPass; ++jj)
#pragma unroll
          for (int t = 0; t < VEC; ++t) acc[jj][t] = 0.0f;
        for (int64_t g = 0; g < group; ++g) {
          float x[VEC];
          LoadF<T, VEC>(src + g * dim + d0, x);
#pragma unroll
          for (int jj = 0; jj < kBwdKeysPerPass; ++jj) {
            const float c = coef[(g * 2 + pass) * kSmallMaxKeys + j0 + jj];
            if (c != 0.0f) {
#pragma unroll
              for (int t = 0; t < VEC; ++t) acc[jj][t] = fmaf(c, x[t], acc[jj][t]);
            }
          }
        }
#pragma unroll
        for (int jj = 0; jj < kBwdKeysPerPass; ++jj) {
          if (owner && j0 + jj < a.kv_len) StoreF<T, VEC>(dst + (j0 + jj) * dst_stride + d0, acc[jj]);
        }
      }
    }
  }
}

// 16-byte vectors when the head dims allow them (and the buffers are aligned), else one element.
template <typename T>
int SmallVec(const AttentionParams& a, std::initializer_list<const void*> buffers) {
  constexpr int kWide = static_cast<int>(16 / sizeof(T));
  if (a.head_dim % kWide != 0 || a.v_dim % kWide != 0) return 1;
  for (const void* p : buffers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return kWide;
}

// Lanes per group: enough for one vector per lane over the wider head dim, 8 to 32.
inline int SmallLanes(const AttentionParams& a, int vec) {
  const int64_t widest = a.head_dim > a.v_dim ? a.head_dim : a.v_dim;
  const int64_t chunks = (widest + vec - 1) / vec;
  return chunks <= 8 ? 8 : (chunks <= 16 ? 16 : 32);
}

template <typename T, typename Fn>
cudaError_t SmallDispatch(int vec, int lanes, const Fn& fn) {
  constexpr int kWide = static_cast<int>(16 / sizeof(T));
  auto by_lanes = [&](auto vec_tag) {
    switch (lanes) {
      case 8: return fn(vec_tag, std::integral_constant<int, 8>{});
      case 16: return fn(vec_tag, std::integral_constant<int, 16>{});
      default: return fn(vec_tag, std::integral_constant<int, 32>{});
    }
  };
  if (vec == kWide) return by_lanes(std::integral_constant<int, kWide>{});
  return by_lanes(std::integral_constant<int, 1>{});
}

template <typename T>
cudaError_t LaunchSmallFwd(cudaStream_t stream, const AttentionParams& a, void* out, float* lse, float* mx,
                           void* probs) {
  const int vec = SmallVec<T>(a, {a.q, a.k, a.v, out});
  const int lanes = SmallLanes(a, vec);
  const int64_t rows = a.batch * a.q_heads;
  const int64_t per_block = kSmallThreads / lanes;
  const dim3 grid(static_cast<unsigned>((rows + per_block - 1) / per_block));
  return SmallDispatch<T>(vec, lanes, [&](auto vec_tag, auto lanes_tag) {
    constexpr int VEC = decltype(vec_tag)::value, LANES = decltype(lanes_tag)::value;
    SmallSeqFwd<T, VEC, LANES><<<grid, kSmallThreads, 0, stream>>>(
        a, static_cast<T*>(out), lse, mx, static_cast<T*>(probs));
    return cudaGetLastError();
  });
}

constexpr size_t kSmallBwdSmemLimit = 200 * 1024;

// Groups per block of the backward: all of kSmallThreads while their coefficients fit in 48 KiB
// of shared memory, fewer (down to one warp's worth) for large query-head groups.
inline int64_t SmallBwdGroupsPerBlock(const AttentionParams& a, int lanes, size_t* smem) {
  const size_t per_group = static_cast<size_t>(a.q_heads / a.kv_heads) * 2 * kSmallMaxKeys * sizeof(float);
  int64_t groups = kSmallThreads / lanes;
  while (groups > 32 / lanes && groups * per_group > 48 * 1024) groups /= 2;
  *smem = groups * per_group;
  return groups;
}

template <typename T>
cudaError_t LaunchSmallBwd(cudaStream_t stream, const AttentionParams& a, const SmallBwdIo& io) {
  const int vec = SmallVec<T>(a, {a.q, a.k, a.v, io.dout, io.dq, io.dk, io.dv});
  const int lanes = SmallLanes(a, vec);
  size_t smem = 0;
  const int64_t groups = SmallBwdGroupsPerBlock(a, lanes, &smem);
  const int64_t units = a.batch * a.kv_heads;
  if ((units + groups - 1) / groups >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>((units + groups - 1) / groups));
  const dim3 block(static_cast<unsigned>(groups * lanes));
  return SmallDispatch<T>(vec, lanes, [&](auto vec_tag, auto lanes_tag) {
    constexpr int VEC = decltype(vec_tag)::value, LANES = decltype(lanes_tag)::value;
    if (smem > 48 * 1024) {
      const cudaError_t err = cudaFuncSetAttribute(SmallSeqBwd<T, VEC, LANES>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(smem));
      if (err != cudaSuccess) return err;
    }
    SmallSeqBwd<T, VEC, LANES><<<grid, block, smem, stream>>>(a, io);
    return cudaGetLastError();
  });
}

// ================================================================================================
// FFI handlers
// ================================================================================================
constexpr const char* kSmallTarget = "attnaux_small_seq";

ffi::Error SmallInvalid(const std::string& m) { return AttnInvalid(kSmallTarget, m); }

ffi::Error SmallValidate(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                         ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                         ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer sink,
                         ffi::AnyBuffer rng, float scale, float softcap, int32_t causal,
                         int64_t window_left, int64_t window_right, float dropout_rate,
                         AttentionParams* a) {
  if (auto e = attnaux::ValidateAttentionInputs(
          kSmallTarget, ValidationRules::kCuda,
          {q, k, v, bias, mask, q_seqlens, kv_seqlens, q_seg, kv_seg, sink, rng, scale, softcap,
           causal, window_left, window_right, dropout_rate},
          a);
      e.failure()) {
    return e;
  }
  if (a->q_len != 1 || a->kv_len > kSmallMaxKeys) {
    return SmallInvalid("needs q_seq == 1 and kv_seq <= 16, got q_seq=" + std::to_string(a->q_len) +
                        " and kv_seq=" + std::to_string(a->kv_len) + ".");
  }
  if (a->batch * a->q_heads >= (int64_t{1} << 31) * (kSmallThreads / 32)) {
    return SmallInvalid("too many rows for one launch.");
  }
  return ffi::Error::Success();
}

ffi::Error SmallFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens,
                        ffi::AnyBuffer kv_seqlens, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                        ffi::AnyBuffer sink, ffi::AnyBuffer rng, float scale, float softcap,
                        int32_t causal, int64_t window_left, int64_t window_right,
                        float dropout_rate, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> row_max,
                        ffi::Result<ffi::AnyBuffer> probs) {
  AttentionParams a;
  if (auto e = SmallValidate(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_seg, kv_seg, sink, rng,
                             scale, softcap, causal, window_left, window_right, dropout_rate, &a);
      e.failure()) {
    return e;
  }
  const int64_t B = a.batch, Hq = a.q_heads;
  if (out->element_type() != q.element_type() || !SameDims(out->dimensions(), {B, 1, Hq, a.v_dim})) {
    return SmallInvalid("output `out` must be [B, 1, Hq, Dv] of q's dtype.");
  }
  for (auto* s : {&lse, &row_max}) {
    if ((*s)->element_type() != ffi::DataType::F32 || !SameDims((*s)->dimensions(), {B, Hq, 1})) {
      return SmallInvalid("outputs `lse` and `max` must be F32 [B, Hq, 1].");
    }
  }
  void* probs_p = nullptr;
  if (!Absent(*probs)) {
    if (probs->element_type() != q.element_type() || !SameDims(probs->dimensions(), {B, Hq, 1, a.kv_len})) {
      return SmallInvalid("output `probs` must be [B, Hq, 1, kv_seq] of q's dtype, or (0,).");
    }
    probs_p = probs->untyped_data();
  }
  if (B * Hq == 0) return ffi::Error::Success();
  return CudaResult("attnaux_small_seq_fwd", DispatchT(q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return LaunchSmallFwd<T>(stream, a, out->untyped_data(), static_cast<float*>(lse->untyped_data()),
                             static_cast<float*>(row_max->untyped_data()), probs_p);
  }));
}

ffi::Error SmallBwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens,
                        ffi::AnyBuffer kv_seqlens, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                        ffi::AnyBuffer sink, ffi::AnyBuffer rng, ffi::AnyBuffer dout,
                        ffi::AnyBuffer probs, ffi::AnyBuffer dlse, ffi::AnyBuffer dprobs,
                        float scale, float softcap, int32_t causal, int64_t window_left,
                        int64_t window_right, float dropout_rate, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> dbias) {
  AttentionParams a;
  if (auto e = SmallValidate(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_seg, kv_seg, sink, rng,
                             scale, softcap, causal, window_left, window_right, dropout_rate, &a);
      e.failure()) {
    return e;
  }
  const int64_t B = a.batch, Hq = a.q_heads, Hk = a.kv_heads, Skv = a.kv_len;
  const auto dt = q.element_type();
  if (dout.element_type() != dt || !SameDims(dout.dimensions(), {B, 1, Hq, a.v_dim})) return SmallInvalid("`dout` must be [B, 1, Hq, Dv] of q's dtype.");
  if (probs.element_type() != dt || !SameDims(probs.dimensions(), {B, Hq, 1, Skv})) return SmallInvalid("`probs` must be [B, Hq, 1, kv_seq] of q's dtype.");
  if (dlse.element_type() != ffi::DataType::F32 || !SameDims(dlse.dimensions(), {B, Hq, 1})) return SmallInvalid("`dlse` must be F32 [B, Hq, 1].");
  SmallBwdIo io;
  if (!Absent(dprobs)) {
    if (dprobs.element_type() != dt || !SameDims(dprobs.dimensions(), {B, Hq, 1, Skv})) return SmallInvalid("`dprobs` must be like `probs` or (0,).");
    io.dprobs = dprobs.untyped_data();
  }
  if (dq->element_type() != dt || !SameDims(dq->dimensions(), {B, 1, Hq, a.head_dim}) ||
      dk->element_type() != dt || !SameDims(dk->dimensions(), {B, Skv, Hk, a.head_dim}) ||
      dv->element_type() != dt || !SameDims(dv->dimensions(), {B, Skv, Hk, a.v_dim})) {
    return SmallInvalid("outputs `dq`, `dk`, `dv` must have the shapes and dtype of q, k, v.");
  }
  if (a.bias != nullptr) {
    if (dbias->element_type() != ffi::DataType::F32 || !SameDims(dbias->dimensions(), {B, Hq, 1, Skv})) return SmallInvalid("output `dbias` must be F32 [B, Hq, 1, kv_seq].");
    io.dbias = static_cast<float*>(dbias->untyped_data());
  }
  if (B * Hk == 0) return ffi::Error::Success();
  const int64_t group = Hq / Hk;
  if (static_cast<size_t>(group) * 2 * kSmallMaxKeys * sizeof(float) * 4 > kSmallBwdSmemLimit) {
    return SmallInvalid("the GPU backward supports at most " +
                        std::to_string(kSmallBwdSmemLimit / (2 * kSmallMaxKeys * sizeof(float) * 4)) +
                        " query heads per kv head; got " + std::to_string(group) + ".");
  }
  io.dout = dout.untyped_data();
  io.probs = probs.untyped_data();
  io.dlse = static_cast<const float*>(dlse.untyped_data());
  io.dq = dq->untyped_data();
  io.dk = dk->untyped_data();
  io.dv = dv->untyped_data();
  return CudaResult("attnaux_small_seq_bwd", DispatchT(dt, [&](auto tag) {
    using T = decltype(tag);
    return LaunchSmallBwd<T>(stream, a, io);
  }));
}

}  // namespace attnaux_cuda_kernels

namespace ak = attnaux_cuda_kernels;

// attnaux_small_seq_fwd on CUDA: out, lse, max and (unless its output is (0,)) the
// probabilities P.
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxSmallSeqFwdCuda, ak::SmallFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  ATTNAUX_CUDA_ATTENTION_INPUTS ATTNAUX_CUDA_ATTENTION_ATTRS
                                  .Ret<ffi::AnyBuffer>()   // out
                                  .Ret<ffi::AnyBuffer>()   // lse
                                  .Ret<ffi::AnyBuffer>()   // max
                                  .Ret<ffi::AnyBuffer>(),  // probs or (0,)
                              {ffi::Traits::kCmdBufferCompatible});

// attnaux_small_seq_bwd on CUDA: dq, dk, dv, dbias from the saved P (and the cotangents of out,
// lse, P).
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxSmallSeqBwdCuda, ak::SmallBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  ATTNAUX_CUDA_ATTENTION_INPUTS
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::AnyBuffer>()  // probs
                                  .Arg<ffi::AnyBuffer>()  // dlse
                                  .Arg<ffi::AnyBuffer>()  // dprobs or (0,)
                                  ATTNAUX_CUDA_ATTENTION_ATTRS
                                  .Ret<ffi::AnyBuffer>()   // dq
                                  .Ret<ffi::AnyBuffer>()   // dk
                                  .Ret<ffi::AnyBuffer>()   // dv
                                  .Ret<ffi::AnyBuffer>(),  // dbias or (0,)
                              {ffi::Traits::kCmdBufferCompatible});
