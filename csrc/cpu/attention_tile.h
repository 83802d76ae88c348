// The building blocks of the CPU attention kernels' tiles (attention_cpu.h, probs_cpu.h,
// small_seq_cpu.h): tile sizes, recycled float32 scratch, row conversion from/to the input dtype,
// and the work space of one tile.
#ifndef ATTNAUX_CSRC_CPU_ATTENTION_TILE_H_
#define ATTNAUX_CSRC_CPU_ATTENTION_TILE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include "common/attention_params.h"
#include "cpu/cpu_gemm.h"
#include "cpu/cpu_simd.h"

namespace attnaux::cpu {

inline constexpr int64_t kBlockQ = 64;  // query rows per tile (vector lanes)
inline constexpr int64_t kBlockK = 64;  // keys per tile
inline constexpr int64_t kQVectors = kBlockQ / kLanes;
static_assert(kBlockQ % kLanes == 0, "a query block must be whole vectors");

inline constexpr float kInf = std::numeric_limits<float>::infinity();

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t RoundUpLanes(int64_t n) { return CeilDiv(n, kLanes) * kLanes; }

// Large scratch buffers are recycled between calls: a fresh multi-megabyte allocation is fresh
// pages from the kernel, and faulting them in cost ~10% of a call. Contents are never reused
// (every reader writes first), so recycling cannot change results.
class BufferCache {
 public:
  static BufferCache& Get() {
    static BufferCache* cache = new BufferCache();  // never destroyed: safe at exit
    return *cache;
  }
  // A buffer of at least `bytes` (a multiple of 64); *capacity gets its real size.
  float* Take(size_t bytes, size_t* capacity) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = entries_.size();
      for (size_t i = 0; i < entries_.size(); ++i) {
        if (entries_[i].bytes >= bytes && entries_[i].bytes <= 2 * bytes &&
            (best == entries_.size() || entries_[i].bytes < entries_[best].bytes)) {
          best = i;
        }
      }
      if (best != entries_.size()) {
        Entry e = entries_[best];
        entries_.erase(entries_.begin() + best);
        cached_bytes_ -= e.bytes;
        *capacity = e.bytes;
        return e.data;
      }
    }
    *capacity = bytes;
    return static_cast<float*>(std::aligned_alloc(64, bytes));
  }
  // The newest buffers stay: when the cache is full the oldest go. (Keeping the old ones and
  // freeing the new had a process that moved on to other shapes, another layer's or another
  // length's, miss on every call: a bfloat16 forward+backward at 1x2048x8x128 ran at 406
  // instead of 615 GFLOP/s after a few other shapes, faulting in ~92 MB of pages per call.)
  void Give(float* data, size_t bytes) {
    if (data == nullptr) return;
    if (bytes < kMinCachedBytes || bytes > kMaxCachedBytes) {
      std::free(data);
      return;
    }
    std::vector<float*> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (!entries_.empty() &&
             (entries_.size() >= kMaxEntries || cached_bytes_ + bytes > kMaxCachedBytes)) {
        evicted.push_back(entries_.front().data);
        cached_bytes_ -= entries_.front().bytes;
        entries_.erase(entries_.begin());
      }
      entries_.push_back({data, bytes});
      cached_bytes_ += bytes;
    }
    for (float* old : evicted) std::free(old);
  }

 private:
  static constexpr size_t kMinCachedBytes = size_t{1} << 20;
  static constexpr size_t kMaxCachedBytes = size_t{1} << 30;
  static constexpr size_t kMaxEntries = 16;
  struct Entry {
    float* data;
    size_t bytes;
  };
  std::mutex mu_;
  std::vector<Entry> entries_;
  size_t cached_bytes_ = 0;
};

// 64-byte aligned float scratch, uninitialised.
class FloatBuffer {
 public:
  FloatBuffer() = default;
  explicit FloatBuffer(int64_t n) {
    size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float);
    bytes = (bytes + 63) / 64 * 64;
    data_ = BufferCache::Get().Take(bytes, &capacity_);
  }
  FloatBuffer(const FloatBuffer&) = delete;
  FloatBuffer& operator=(const FloatBuffer&) = delete;
  ~FloatBuffer() { BufferCache::Get().Give(data_, capacity_); }
  float* get() const { return data_; }

 private:
  float* data_ = nullptr;
  size_t capacity_ = 0;
};

inline void LoadRow(Elem elem, const void* base, int64_t offset, int64_t n, float* dst) {
  switch (elem) {
    case Elem::kF32: {
      // a vector at a time, inline: memcpy's call (rep movsb for rows of a few hundred bytes)
      // cost more than the copy in the kernels' row-by-row staging loops
      const float* src = static_cast<const float*>(base) + offset;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) Store(dst + i, Load(src + i));
      for (; i < n; ++i) dst[i] = src[i];
      break;
    }
    case Elem::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) Store(dst + i, LoadBf16(src + i));
      for (; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
      break;
    }
    case Elem::kF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(src[i]);
      break;
    }
  }
}

inline void StoreRow(Elem elem, void* base, int64_t offset, int64_t n, const float* src) {
  switch (elem) {
    case Elem::kF32:
      std::memcpy(static_cast<float*>(base) + offset, src, n * sizeof(float));
      break;
    case Elem::kBF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16(src[i]);
      break;
    }
    case Elem::kF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = FloatToHalf(src[i]);
      break;
    }
  }
}

#if defined(__AVX512F__)
inline constexpr bool kHasTranspose16 = true;
// dst[c * ds + r] = src[r * ss + c] for r, c < 16, in registers (four rounds of shuffles); dst
// rows stored non-temporally when `stream` (then dst must be 64-byte aligned, ds a multiple of 16).
inline void Transpose16(const float* src, int64_t ss, float* dst, int64_t ds, bool stream) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ss);
  for (int i = 0; i < 16; i += 2) {  // per 128-bit group k: r_i[4k], r_i+1[4k], r_i[4k+1], ...
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[4g + c], group k: rows 4g..4g+3 of column 4k + c
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 u = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 w = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 u2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 w2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
    t[c] = _mm512_shuffle_f32x4(u, u2, _MM_SHUFFLE(2, 0, 2, 0));       // column c
    t[8 + c] = _mm512_shuffle_f32x4(u, u2, _MM_SHUFFLE(3, 1, 3, 1));   // column 8 + c
    t[4 + c] = _mm512_shuffle_f32x4(w, w2, _MM_SHUFFLE(2, 0, 2, 0));   // column 4 + c
    t[12 + c] = _mm512_shuffle_f32x4(w, w2, _MM_SHUFFLE(3, 1, 3, 1));  // column 12 + c
  }
  if (stream) {
    for (int i = 0; i < 16; ++i) _mm512_stream_ps(dst + i * ds, t[i]);
  } else {
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ds, t[i]);
  }
}
#else
inline constexpr bool kHasTranspose16 = false;
inline void Transpose16(const float*, int64_t, float*, int64_t, bool) {}
#endif

// Whether all n values are finite: x * 0 is 0 for finite x and NaN for NaN and inf (the kernels
// are built without fast-math, so this is not folded away).
// A vector of lanes at a time (one scalar chain of adds cost more than reading the rows).
inline bool AllFinite(const float* x, int64_t n) {
  VecF acc = VecF{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += Load(x + i) * 0.0f;
  float tail = 0.0f;
  for (; i < n; ++i) tail += x[i] * 0.0f;
  bool ok = tail == 0.0f;
  for (int lane = 0; lane < kLanes; ++lane) ok &= acc[lane] == 0.0f;
  return ok;
}

// A row's final statistics from its max `mx` and `sum` = sum_j exp(s_j - mx) over the keys it
// sees (mx = -inf: none): `max` and `lse` as the kernels return them, and `factor`, what its
// accumulated output (weighted by exp(s - mx)) is multiplied by. With a sink, the sink's term
// joins the sum (`lse` includes it, `max` does not). A NaN the row sees gives NaN, as in the
// reference (not an empty row). A padding row (`valid` false: past q_len) has max -inf, lse the
// sink (or -inf) and output 0. The tiled forward (attention_cpu.h) and the decode forms' merge
// (decode_cpu.h) both end their rows here: one formula for both.
struct RowEnd {
  float max, lse, factor;
};

inline RowEnd FinishRow(bool valid, float mx, float sum, bool has_sink, float sink) {
  if (!valid) return {-kInf, has_sink ? sink : -kInf, 0.0f};
  if (std::isnan(sum) || std::isnan(mx)) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    return {nan, nan, nan};
  }
  if (has_sink) {
    const float big = std::max(mx, sink);
    const float scaled = mx == -kInf ? 0.0f : sum * std::exp(mx - big);
    const float denom = scaled + std::exp(sink - big);
    return {mx, big + std::log(denom), mx == -kInf ? 0.0f : std::exp(mx - big) / denom};
  }
  if (mx != -kInf && sum > 0.0f) return {mx, mx + std::log(sum), 1.0f / sum};
  return {mx, -kInf, 0.0f};
}

// Work space of one tile (kBlockK x kBlockQ each; `words`: bfloat16 operands of the backward's
// pair products, attention_cpu.h), and, sized on first use, `clean`: copies of packed rows with
// the rows a tile hides zeroed (attention_cpu.h, HiddenInTile); with a score program
// (score_program.h) its registers, their adjoints and the scores it read (`raw`).
struct TileScratch {
  FloatBuffer scores, tanh, probs, dprobs, drop, words;
  std::vector<float> clean, program_regs, program_adj, raw;
  TileScratch()
      : scores(kBlockK * kBlockQ),
        tanh(kBlockK * kBlockQ),
        probs(kBlockK * kBlockQ),
        dprobs(kBlockK * kBlockQ),
        drop(kBlockK * kBlockQ),
        words(kHasBf16Pairs ? kBlockK * kBlockQ : 0) {}
};

}  // namespace attnaux::cpu

#endif  // ATTNAUX_CSRC_CPU_ATTENTION_TILE_H_
