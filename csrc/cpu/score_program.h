// Score programs: `score_mod` and `mask_mod` evaluated inside the CPU flash kernels' tiles.
//
// src/attnaux/_score_program.py translates the two JAX functions (their jaxprs) into one flat
// SSA program over float32 registers, one value per (query, key) element (integers exact below
// 2^24, bools as 1/0); the layout and the opcodes are documented there and in
// docs/kernel_abi.md. Here it is parsed and checked once per call (ScoreProgram::Parse), run
// forward on a tile's scores (ApplyScoreProgram), and run backward (ScoreProgramBackward):
// reverse mode over the same instructions, one rule per opcode, so the derivative of the user's
// function is JAX's (the rules are lax's JVP rules, ties of max/min split evenly as JAX does)
// and the captured arrays' gradients are accumulated where LOAD read them.
//
// A tile is evaluated in chunks of kChunkRows keys x kBlockQ query lanes, so a register is
// 1 KiB and a program's registers stay in L1; the interpreter's dispatch costs one switch per
// instruction per chunk.
#ifndef ATTNAUX_CSRC_CPU_SCORE_PROGRAM_H_
#define ATTNAUX_CSRC_CPU_SCORE_PROGRAM_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/attention_tile.h"
#include "cpu/cpu_simd.h"

namespace attnaux::cpu {

enum ScoreOp : int32_t {
  kLit = 0, kLoad = 1, kCopy = 2, kStop = 3,
  kNeg = 10, kAbs = 11, kSign = 12, kFloor = 13, kCeil = 14, kRoundEven = 15, kRoundAway = 16,
  kExp = 17, kLog = 18, kLog1p = 19, kExpm1 = 20, kTanh = 21, kLogistic = 22, kSqrt = 23,
  kRsqrt = 24, kTrunc = 25, kNot = 26, kNonzero = 27, kIntegerPow = 28, kExp2 = 29,
  kAdd = 40, kSub = 41, kMul = 42, kDiv = 43, kIdiv = 44, kRem = 45, kMax = 46, kMin = 47,
  kPow = 48,
  kLt = 50, kLe = 51, kGt = 52, kGe = 53, kEq = 54, kNe = 55, kAnd = 56, kOr = 57, kXor = 58,
  kSelect = 60, kClamp = 61,
};

inline constexpr int32_t kProgramMagic = 0x5350;
inline constexpr int32_t kProgramVersion = 1;
inline constexpr int kHeaderWords = 8, kConstWords = 7, kInstrWords = 7;
inline constexpr int kInputRegs = 5;  // score, batch, head, q_idx, kv_idx
inline constexpr int64_t kChunkRows = 4;
inline constexpr int64_t kChunk = kChunkRows * kBlockQ;  // floats per register

struct ScoreProgram {
  struct Const {
    int64_t offset = 0;
    int32_t ndim = 0;
    int64_t dims[4] = {1, 1, 1, 1};
    bool differentiable = false;
  };
  struct Instr {
    int32_t op, dst, a, b, c, d, e;
  };
  int32_t n_regs = kInputRegs, score_out = -1, mask_out = -1;
  std::vector<Const> consts;
  std::vector<Instr> instrs;
  std::vector<float> literals;
  const float* data = nullptr;  // the flat const buffer
  int64_t data_size = 0;
  std::vector<char> active;  // per register: depends on the score or a differentiable const
  // per register: the same for every element of a tile (a function of batch, head, literals
  // and loads at such indices): computed once per tile, not per element
  std::vector<char> uniform;
  bool any_gradient_const = false;

  // Checks `words` completely (every register read is defined before, every index in range),
  // so that evaluation never reads out of bounds. Returns "" or what is wrong.
  static std::string Parse(const int32_t* words, int64_t n_words, const float* lits,
                           int64_t n_lits, const float* data, int64_t data_size,
                           ScoreProgram* out) {
    ScoreProgram& p = *out;
    if (n_words < kHeaderWords) return "the program is shorter than its header";
    if (words[0] != kProgramMagic || words[1] != kProgramVersion) {
      return "the program's header is not a version-1 score program";
    }
    const int32_t n_regs = words[2], n_instr = words[3], n_consts = words[6];
    if (n_instr < 0 || n_consts < 0 || n_regs != kInputRegs + n_instr || words[7] != n_lits) {
      return "the program's register, instruction or literal counts disagree";
    }
    if (n_words != kHeaderWords + int64_t{n_consts} * kConstWords +
                       int64_t{n_instr} * kInstrWords) {
      return "the program's length disagrees with its header";
    }
    p.n_regs = n_regs;
    p.score_out = words[4];
    p.mask_out = words[5];
    if (p.score_out < -1 || p.score_out >= n_regs || p.mask_out < -1 || p.mask_out >= n_regs) {
      return "the program's output register is out of range";
    }
    p.literals.assign(lits, lits + n_lits);
    p.data = data;
    p.data_size = data_size;
    const int32_t* w = words + kHeaderWords;
    for (int32_t c = 0; c < n_consts; ++c, w += kConstWords) {
      Const k;
      k.offset = w[0];
      k.ndim = w[1];
      if (k.ndim < 0 || k.ndim > 4) return "a const of the program has more than 4 dims";
      int64_t size = 1;
      for (int x = 0; x < 4; ++x) {
        k.dims[x] = x < k.ndim ? w[2 + x] : 1;
        if (k.dims[x] < 1) return "a const of the program has an empty dim";
        size *= k.dims[x];
      }
      if (k.offset < 0 || k.offset + size > data_size) {
        return "a const of the program lies outside the const buffer (score_consts)";
      }
      k.differentiable = w[6] != 0;
      p.any_gradient_const |= k.differentiable;
      p.consts.push_back(k);
    }
    p.active.assign(n_regs, 0);
    p.active[0] = 1;
    p.uniform.assign(n_regs, 0);
    p.uniform[1] = p.uniform[2] = 1;
    auto reg_ok = [&](int32_t r, int32_t dst) { return r >= 0 && r < dst; };
    for (int32_t k = 0; k < n_instr; ++k, w += kInstrWords) {
      Instr in{w[0], w[1], w[2], w[3], w[4], w[5], w[6]};
      if (in.dst != kInputRegs + k) return "an instruction of the program is not in SSA order";
      bool ok = true;
      bool act = false;
      switch (in.op) {
        case kLit:
          ok = in.a >= 0 && in.a < n_lits;
          break;
        case kLoad: {
          ok = in.a >= 0 && in.a < n_consts;
          if (ok) {
            const int32_t idx[4] = {in.b, in.c, in.d, in.e};
            for (int x = 0; x < p.consts[in.a].ndim; ++x) ok &= reg_ok(idx[x], in.dst);
            act = p.consts[in.a].differentiable;
          }
          break;
        }
        case kCopy: case kNeg: case kAbs: case kExp: case kLog: case kLog1p: case kExpm1:
        case kTanh: case kLogistic: case kSqrt: case kRsqrt: case kExp2: case kIntegerPow:
          ok = reg_ok(in.a, in.dst);
          act = ok && p.active[in.a];
          break;
        case kStop: case kSign: case kFloor: case kCeil: case kRoundEven: case kRoundAway:
        case kTrunc: case kNot: case kNonzero:
          ok = reg_ok(in.a, in.dst);
          break;
        case kAdd: case kSub: case kMul: case kDiv: case kMax: case kMin: case kPow:
          ok = reg_ok(in.a, in.dst) && reg_ok(in.b, in.dst);
          act = ok && (p.active[in.a] || p.active[in.b]);
          break;
        case kIdiv: case kRem: case kLt: case kLe: case kGt: case kGe: case kEq: case kNe:
        case kAnd: case kOr: case kXor:
          ok = reg_ok(in.a, in.dst) && reg_ok(in.b, in.dst);
          if (in.op == kRem && ok) act = p.active[in.a] || p.active[in.b];
          break;
        case kSelect:
          ok = reg_ok(in.a, in.dst) && reg_ok(in.b, in.dst) && reg_ok(in.c, in.dst);
          act = ok && (p.active[in.b] || p.active[in.c]);
          break;
        case kClamp:
          ok = reg_ok(in.a, in.dst) && reg_ok(in.b, in.dst) && reg_ok(in.c, in.dst);
          act = ok && p.active[in.b];
          break;
        default:
          return "the program has an unknown opcode " + std::to_string(in.op);
      }
      if (!ok) return "an instruction of the program reads an undefined register or const";
      p.active[in.dst] = act ? 1 : 0;
      p.uniform[in.dst] = p.UniformOperands(in) ? 1 : 0;
      p.instrs.push_back(in);
    }
    return "";
  }

  // Whether every register instruction `in` reads is uniform over a tile.
  bool UniformOperands(const Instr& in) const {
    switch (in.op) {
      case kLit:
        return true;
      case kLoad: {
        const int32_t idx[4] = {in.b, in.c, in.d, in.e};
        for (int x = 0; x < consts[in.a].ndim; ++x) {
          if (!uniform[idx[x]]) return false;
        }
        return true;
      }
      case kIntegerPow:
        return uniform[in.a] != 0;
      default:
        break;
    }
    const int32_t regs[3] = {in.a, in.b, in.c};
    for (int32_t r : regs) {
      if (r >= 0 && !uniform[r]) return false;
    }
    return true;
  }
};

// The global position of a tile: the batch and head of this call's (b, h) plus the block
// state's origin (a shard of a larger problem), and the first query row and key.
struct ProgramSite {
  float batch, head;
  int64_t q0, k0;  // global index of lane 0 / key row 0 of the tile
};

namespace program_detail {

inline float RoundEven(float x) { return std::nearbyint(x); }  // default rounding: to even
inline float RoundAway(float x) { return std::round(x); }

inline float Idiv(float a, float b) {
  if (b == 0.0f) return -1.0f;
  return std::trunc(static_cast<float>(static_cast<double>(a) / static_cast<double>(b)));
}

inline float IntegerPow(float x, int32_t n) {
  if (n == 0) return 1.0f;
  const bool inv = n < 0;
  uint32_t m = static_cast<uint32_t>(inv ? -static_cast<int64_t>(n) : n);
  float acc = 1.0f, base = x;
  // lax.integer_pow multiplies by repeated squaring; the same order of products.
  while (m > 0) {
    if (m & 1u) acc *= base;
    m >>= 1;
    if (m > 0) base *= base;
  }
  return inv ? 1.0f / acc : acc;
}

// The element index of a LOAD with each index clamped into its dim (dynamic_slice's rule).
inline int64_t LoadIndex(const ScoreProgram::Const& c, const float* const* idx, int64_t e) {
  int64_t flat = 0;
  for (int x = 0; x < c.ndim; ++x) {
    float v = idx[x][e];
    int64_t i = v != v ? 0 : static_cast<int64_t>(std::clamp(v, -1.0f, 2.0e9f));
    i = std::clamp<int64_t>(i, 0, c.dims[x] - 1);
    flat = flat * c.dims[x] + i;
  }
  return flat;
}

// The registers' storage of one chunk: n_regs x kChunk floats.
inline float* Reg(float* regs, int32_t r) { return regs + int64_t{r} * kChunk; }

}  // namespace program_detail

// Instruction `in` on elements [0, n) of the registers.
inline void EvalInstr(const ScoreProgram& prog, const ScoreProgram::Instr& in, float* regs,
                      int64_t n) {
  using namespace program_detail;
  float* y = Reg(regs, in.dst);
  const float* a = in.a >= 0 && in.op != kLit && in.op != kLoad ? Reg(regs, in.a) : nullptr;
  const float* b = in.b >= 0 && in.op != kLoad && in.op != kIntegerPow ? Reg(regs, in.b)
                                                                        : nullptr;
  const float* c = in.c >= 0 && in.op != kLoad ? Reg(regs, in.c) : nullptr;
  switch (in.op) {
    case kLit:
      std::fill(y, y + n, prog.literals[in.a]);
      break;
    case kLoad: {
      const ScoreProgram::Const& k = prog.consts[in.a];
      const float* idx[4] = {nullptr, nullptr, nullptr, nullptr};
      const int32_t regs_of[4] = {in.b, in.c, in.d, in.e};
      for (int x = 0; x < k.ndim; ++x) idx[x] = Reg(regs, regs_of[x]);
      const float* base = prog.data + k.offset;
      for (int64_t e = 0; e < n; ++e) y[e] = base[LoadIndex(k, idx, e)];
      break;
    }
    case kCopy: case kStop: std::copy(a, a + n, y); break;
    case kNeg: for (int64_t e = 0; e < n; ++e) y[e] = -a[e]; break;
    case kAbs: for (int64_t e = 0; e < n; ++e) y[e] = std::fabs(a[e]); break;
    case kSign:
      for (int64_t e = 0; e < n; ++e) {
        y[e] = a[e] > 0.0f ? 1.0f : a[e] < 0.0f ? -1.0f : a[e];  // 0, -0 and NaN stay
      }
      break;
    case kFloor: for (int64_t e = 0; e < n; ++e) y[e] = std::floor(a[e]); break;
    case kCeil: for (int64_t e = 0; e < n; ++e) y[e] = std::ceil(a[e]); break;
    case kRoundEven: for (int64_t e = 0; e < n; ++e) y[e] = RoundEven(a[e]); break;
    case kRoundAway: for (int64_t e = 0; e < n; ++e) y[e] = RoundAway(a[e]); break;
    case kTrunc: for (int64_t e = 0; e < n; ++e) y[e] = a[e] != a[e] ? 0.0f : std::trunc(a[e]); break;
    case kExp:
      for (int64_t e = 0; e < n; e += kLanes) {
        VecF x = Load(a + e);
        Store(y + e, x > 88.72f ? Splat(kInf) : Exp(x));
      }
      break;
    case kExp2: for (int64_t e = 0; e < n; ++e) y[e] = std::exp2(a[e]); break;
    case kLog: for (int64_t e = 0; e < n; ++e) y[e] = std::log(a[e]); break;
    case kLog1p: for (int64_t e = 0; e < n; ++e) y[e] = std::log1p(a[e]); break;
    case kExpm1: for (int64_t e = 0; e < n; ++e) y[e] = std::expm1(a[e]); break;
    case kTanh:
      for (int64_t e = 0; e < n; e += kLanes) Store(y + e, Tanh(Load(a + e)));
      break;
    case kLogistic:
      for (int64_t e = 0; e < n; ++e) y[e] = 1.0f / (1.0f + std::exp(-a[e]));
      break;
    case kSqrt: for (int64_t e = 0; e < n; ++e) y[e] = std::sqrt(a[e]); break;
    case kRsqrt: for (int64_t e = 0; e < n; ++e) y[e] = 1.0f / std::sqrt(a[e]); break;
    case kNot: for (int64_t e = 0; e < n; ++e) y[e] = a[e] != 0.0f ? 0.0f : 1.0f; break;
    case kNonzero: for (int64_t e = 0; e < n; ++e) y[e] = a[e] != 0.0f ? 1.0f : 0.0f; break;
    case kIntegerPow: for (int64_t e = 0; e < n; ++e) y[e] = IntegerPow(a[e], in.b); break;
    case kAdd: for (int64_t e = 0; e < n; ++e) y[e] = a[e] + b[e]; break;
    case kSub: for (int64_t e = 0; e < n; ++e) y[e] = a[e] - b[e]; break;
    case kMul: for (int64_t e = 0; e < n; ++e) y[e] = a[e] * b[e]; break;
    case kDiv: for (int64_t e = 0; e < n; ++e) y[e] = a[e] / b[e]; break;
    case kIdiv: for (int64_t e = 0; e < n; ++e) y[e] = Idiv(a[e], b[e]); break;
    case kRem:  // C's fmod; the translation spells XLA's integer x % 0 = x around it
      for (int64_t e = 0; e < n; ++e) y[e] = std::fmod(a[e], b[e]);
      break;
    case kMax:
      for (int64_t e = 0; e < n; ++e) {
        y[e] = a[e] != a[e] || b[e] != b[e] ? a[e] + b[e] : std::max(a[e], b[e]);
      }
      break;
    case kMin:
      for (int64_t e = 0; e < n; ++e) {
        y[e] = a[e] != a[e] || b[e] != b[e] ? a[e] + b[e] : std::min(a[e], b[e]);
      }
      break;
    case kPow: for (int64_t e = 0; e < n; ++e) y[e] = std::pow(a[e], b[e]); break;
    case kLt: for (int64_t e = 0; e < n; ++e) y[e] = a[e] < b[e] ? 1.0f : 0.0f; break;
    case kLe: for (int64_t e = 0; e < n; ++e) y[e] = a[e] <= b[e] ? 1.0f : 0.0f; break;
    case kGt: for (int64_t e = 0; e < n; ++e) y[e] = a[e] > b[e] ? 1.0f : 0.0f; break;
    case kGe: for (int64_t e = 0; e < n; ++e) y[e] = a[e] >= b[e] ? 1.0f : 0.0f; break;
    case kEq: for (int64_t e = 0; e < n; ++e) y[e] = a[e] == b[e] ? 1.0f : 0.0f; break;
    case kNe: for (int64_t e = 0; e < n; ++e) y[e] = a[e] != b[e] ? 1.0f : 0.0f; break;
    case kAnd:
      for (int64_t e = 0; e < n; ++e) y[e] = (a[e] != 0.0f && b[e] != 0.0f) ? 1.0f : 0.0f;
      break;
    case kOr:
      for (int64_t e = 0; e < n; ++e) y[e] = (a[e] != 0.0f || b[e] != 0.0f) ? 1.0f : 0.0f;
      break;
    case kXor:
      for (int64_t e = 0; e < n; ++e) y[e] = ((a[e] != 0.0f) != (b[e] != 0.0f)) ? 1.0f : 0.0f;
      break;
    case kSelect:
      for (int64_t e = 0; e < n; ++e) y[e] = a[e] != 0.0f ? c[e] : b[e];
      break;
    case kClamp:
      for (int64_t e = 0; e < n; ++e) y[e] = std::min(std::max(b[e], a[e]), c[e]);
      break;
    default:
      break;  // Parse rejected every other opcode
  }

}

// Fills the registers of one chunk: keys [r0, r0 + rows) of the tile (n = rows * kBlockQ
// elements, element e = row * kBlockQ + lane) from `score` (n floats). Uniform registers are
// computed on the tile's first chunk (r0 == 0) only, once, and filled over the chunk.
inline void RunProgramChunk(const ScoreProgram& prog, const ProgramSite& site, int64_t r0,
                            int64_t rows, const float* score, float* regs) {
  using namespace program_detail;
  const int64_t n = rows * kBlockQ;
  const bool first = r0 == 0;
  std::copy(score, score + n, Reg(regs, 0));
  if (first) {
    std::fill(Reg(regs, 1), Reg(regs, 1) + kChunk, site.batch);
    std::fill(Reg(regs, 2), Reg(regs, 2) + kChunk, site.head);
  }
  float* qi = Reg(regs, 3);
  float* ki = Reg(regs, 4);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t lane = 0; lane < kBlockQ; ++lane) {
      qi[r * kBlockQ + lane] = static_cast<float>(site.q0 + lane);
      ki[r * kBlockQ + lane] = static_cast<float>(site.k0 + r0 + r);
    }
  }
  for (const ScoreProgram::Instr& in : prog.instrs) {
    if (!prog.uniform[in.dst]) {
      EvalInstr(prog, in, regs, n);
    } else if (first) {
      EvalInstr(prog, in, regs, 1);
      float* y = Reg(regs, in.dst);
      std::fill(y + 1, y + kChunk, y[0]);
    }
  }
}

// The modified scores of a tile in place: st[r * kBlockQ + lane] for keys r < nk. `raw`, when
// not null, keeps the scores the program read (the backward recomputes from them).
// `apply_mask` false: mask_mod is known to keep every pair of the tile (its block table).
inline void ApplyScoreProgram(const ScoreProgram& prog, const ProgramSite& site, int64_t nk,
                              float* st, float* raw, std::vector<float>& regs,
                              bool apply_mask = true) {
  if (raw != nullptr) std::copy(st, st + nk * kBlockQ, raw);
  if (prog.score_out < 0 && !apply_mask) return;
  regs.resize(static_cast<size_t>(prog.n_regs) * kChunk);
  for (int64_t r0 = 0; r0 < nk; r0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, nk - r0);
    float* s = st + r0 * kBlockQ;
    RunProgramChunk(prog, site, r0, rows, s, regs.data());
    const int64_t n = rows * kBlockQ;
    if (prog.score_out >= 0) {
      const float* y = program_detail::Reg(regs.data(), prog.score_out);
      std::copy(y, y + n, s);
    }
    if (prog.mask_out >= 0 && apply_mask) {
      const float* m = program_detail::Reg(regs.data(), prog.mask_out);
      for (int64_t e = 0; e < n; ++e) s[e] = m[e] != 0.0f ? s[e] : -kInf;
    }
  }
}

// The backward of the program over a tile: `ds` (nk x kBlockQ) holds the gradient of the loss
// with respect to the modified scores on entry and with respect to the scores the program read
// (`raw`) on return. Elements whose incoming gradient is 0 (hidden pairs, P = 0) contribute 0
// everywhere, even where a derivative of the function is not finite there (JAX's `where`
// would give NaN). `dconsts` (the const buffer's size), when not null, accumulates the
// gradients of the differentiable consts in a fixed order.
inline void ScoreProgramBackward(const ScoreProgram& prog, const ProgramSite& site, int64_t nk,
                                 const float* raw, float* ds, float* dconsts,
                                 std::vector<float>& regs, std::vector<float>& adj) {
  using namespace program_detail;
  if (prog.score_out < 0) return;  // mask only: the scores pass through unchanged
  regs.resize(static_cast<size_t>(prog.n_regs) * kChunk);
  adj.resize(static_cast<size_t>(prog.n_regs) * kChunk);
  const bool want_consts = dconsts != nullptr && prog.any_gradient_const;
  for (int64_t r0 = 0; r0 < nk; r0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, nk - r0);
    const int64_t n = rows * kBlockQ;
    float* g = ds + r0 * kBlockQ;
    RunProgramChunk(prog, site, r0, rows, raw + r0 * kBlockQ, regs.data());
    for (int32_t r = 0; r < prog.n_regs; ++r) {
      if (prog.active[r]) std::fill(Reg(adj.data(), r), Reg(adj.data(), r) + n, 0.0f);
    }
    if (!prog.active[prog.score_out]) {  // the function ignores the score: gradient 0
      std::fill(g, g + n, 0.0f);
      continue;
    }
    std::copy(g, g + n, Reg(adj.data(), prog.score_out));
    for (auto it = prog.instrs.rbegin(); it != prog.instrs.rend(); ++it) {
      const ScoreProgram::Instr& in = *it;
      if (!prog.active[in.dst]) continue;
      const float* gy = Reg(adj.data(), in.dst);
      const float* y = Reg(regs.data(), in.dst);
      const float* a = in.op != kLit && in.op != kLoad && in.a >= 0 ? Reg(regs.data(), in.a)
                                                                    : nullptr;
      const float* b = (in.op >= kAdd && in.op <= kPow) || in.op == kSelect || in.op == kClamp
                           ? Reg(regs.data(), in.b) : nullptr;
      float* ga = a != nullptr && prog.active[in.a] ? Reg(adj.data(), in.a) : nullptr;
      float* gb = b != nullptr && prog.active[in.b] ? Reg(adj.data(), in.b) : nullptr;
      switch (in.op) {
        case kLoad: {
          if (!want_consts) break;
          const ScoreProgram::Const& k = prog.consts[in.a];
          const float* idx[4] = {nullptr, nullptr, nullptr, nullptr};
          const int32_t regs_of[4] = {in.b, in.c, in.d, in.e};
          for (int x = 0; x < k.ndim; ++x) idx[x] = Reg(regs.data(), regs_of[x]);
          float* base = dconsts + k.offset;
          if (prog.uniform[in.dst]) {  // one element of the const: the chunk's sum, once
            float sum = 0.0f;
            for (int64_t e = 0; e < n; ++e) sum += g[e] != 0.0f ? gy[e] : 0.0f;
            base[LoadIndex(k, idx, 0)] += sum;
            break;
          }
          for (int64_t e = 0; e < n; ++e) {
            if (g[e] != 0.0f) base[LoadIndex(k, idx, e)] += gy[e];
          }
          break;
        }
        case kCopy: for (int64_t e = 0; e < n; ++e) ga[e] += gy[e]; break;
        case kNeg: for (int64_t e = 0; e < n; ++e) ga[e] -= gy[e]; break;
        case kAbs:
          for (int64_t e = 0; e < n; ++e) {
            ga[e] += a[e] > 0.0f ? gy[e] : a[e] < 0.0f ? -gy[e] : 0.0f;
          }
          break;
        case kExp: for (int64_t e = 0; e < n; ++e) ga[e] += gy[e] * y[e]; break;
        case kExp2:
          for (int64_t e = 0; e < n; ++e) ga[e] += gy[e] * y[e] * 0.6931471805599453f;
          break;
        case kLog: for (int64_t e = 0; e < n; ++e) ga[e] += gy[e] / a[e]; break;
        case kLog1p: for (int64_t e = 0; e < n; ++e) ga[e] += gy[e] / (1.0f + a[e]); break;
        case kExpm1: for (int64_t e = 0; e < n; ++e) ga[e] += gy[e] * (y[e] + 1.0f); break;
        case kTanh: for (int64_t e = 0; e < n; ++e) ga[e] += gy[e] * (1.0f - y[e] * y[e]); break;
        case kLogistic:
          for (int64_t e = 0; e < n; ++e) ga[e] += gy[e] * y[e] * (1.0f - y[e]);
          break;
        case kSqrt: for (int64_t e = 0; e < n; ++e) ga[e] += gy[e] * 0.5f / y[e]; break;
        case kRsqrt:
          for (int64_t e = 0; e < n; ++e) ga[e] += gy[e] * -0.5f * y[e] / a[e];
          break;
        case kIntegerPow:
          for (int64_t e = 0; e < n; ++e) {
            ga[e] += in.b == 0 ? 0.0f : gy[e] * static_cast<float>(in.b) *
                                            IntegerPow(a[e], in.b - 1);
          }
          break;
        case kAdd:
          if (ga) for (int64_t e = 0; e < n; ++e) ga[e] += gy[e];
          if (gb) for (int64_t e = 0; e < n; ++e) gb[e] += gy[e];
          break;
        case kSub:
          if (ga) for (int64_t e = 0; e < n; ++e) ga[e] += gy[e];
          if (gb) for (int64_t e = 0; e < n; ++e) gb[e] -= gy[e];
          break;
        case kMul:
          if (ga) for (int64_t e = 0; e < n; ++e) ga[e] += gy[e] * b[e];
          if (gb) for (int64_t e = 0; e < n; ++e) gb[e] += gy[e] * a[e];
          break;
        case kDiv:
          if (ga) for (int64_t e = 0; e < n; ++e) ga[e] += gy[e] / b[e];
          if (gb) for (int64_t e = 0; e < n; ++e) gb[e] -= gy[e] * a[e] / (b[e] * b[e]);
          break;
        case kRem:  // rem(a, b) = a - b * trunc(a / b)
          if (ga) for (int64_t e = 0; e < n; ++e) ga[e] += gy[e];
          if (gb) {
            for (int64_t e = 0; e < n; ++e) gb[e] -= gy[e] * std::trunc(a[e] / b[e]);
          }
          break;
        case kMax: case kMin:
          // lax's rule: the gradient goes to the operand equal to the result, half to each on
          // a tie.
          for (int64_t e = 0; e < n; ++e) {
            const float wa = a[e] == y[e] ? (b[e] == y[e] ? 0.5f : 1.0f) : 0.0f;
            const float wb = b[e] == y[e] ? (a[e] == y[e] ? 0.5f : 1.0f) : 0.0f;
            if (ga) ga[e] += gy[e] * wa;
            if (gb) gb[e] += gy[e] * wb;
          }
          break;
        case kPow:
          if (ga) {
            for (int64_t e = 0; e < n; ++e) {
              ga[e] += b[e] == 0.0f ? 0.0f : gy[e] * b[e] * std::pow(a[e], b[e] - 1.0f);
            }
          }
          if (gb) {
            for (int64_t e = 0; e < n; ++e) {
              gb[e] += a[e] == 0.0f ? 0.0f : gy[e] * y[e] * std::log(a[e]);
            }
          }
          break;
        case kSelect: {
          const float* pred = Reg(regs.data(), in.a);
          float* gf = prog.active[in.b] ? Reg(adj.data(), in.b) : nullptr;
          float* gt = prog.active[in.c] ? Reg(adj.data(), in.c) : nullptr;
          for (int64_t e = 0; e < n; ++e) {
            if (pred[e] != 0.0f) {
              if (gt) gt[e] += gy[e];
            } else if (gf) {
              gf[e] += gy[e];
            }
          }
          break;
        }
        case kClamp: {  // lax's rule: the gradient passes where lo < x < hi
          const float* lo = Reg(regs.data(), in.a);
          const float* x = Reg(regs.data(), in.b);
          const float* hi = Reg(regs.data(), in.c);
          float* gx = Reg(adj.data(), in.b);
          for (int64_t e = 0; e < n; ++e) {
            if (x[e] > lo[e] && x[e] < hi[e]) gx[e] += gy[e];
          }
          break;
        }
        default:
          break;  // no derivative (rounding, comparisons, integer ops) or not active
      }
    }
    const float* g0 = Reg(adj.data(), 0);
    for (int64_t e = 0; e < n; ++e) g[e] = g[e] != 0.0f ? g0[e] : 0.0f;
  }
}

}  // namespace attnaux::cpu

#endif  // ATTNAUX_CSRC_CPU_SCORE_PROGRAM_H_
