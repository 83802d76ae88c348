"""Score programs: `score_mod` and `mask_mod` translated for the compiled kernels.

The CPU flash kernel evaluates `score_mod` and `mask_mod` inside its tile loop. It cannot call
back into JAX there, so `translate` turns the closure-converted functions of `_flex.convert`
into a small flat program of float32 register operations (a *score program*), which the C++
interpreter runs once per (query, key) element and differentiates for the captured arrays.
`evaluate` is a NumPy reference interpreter of the same specification, for the tests.

## The program (int32 words), version 1

Registers hold one float32 value per (query, key) element. Integers are represented exactly as
floats, which holds while every integer value stays below `2**24` in magnitude (`INT_EXACT`):
beyond that float32 cannot represent every integer, so indices, positions and integer arithmetic
of a translated function must stay inside that bound. Bools are 1.0 / 0.0.

- Input registers: 0 = score (float32), 1 = batch, 2 = head, 3 = q_idx, 4 = kv_idx.
- SSA: instruction `k` writes register `5 + k` (its `dst` field says so); `n_regs = 5 + n_instr`.
- Layout: a header of 8 words `[MAGIC, VERSION, n_regs, n_instr, score_out, mask_out, n_consts,
  n_literals]` (`score_out`/`mask_out` a register, or -1 without that function; `mask_out`'s
  register holds 1.0 / 0.0); then `n_consts` entries of 7 words `[offset, ndim, d0, d1, d2, d3,
  differentiable]` (offset in floats into the flat const buffer of `pack_consts`; unused dims 1;
  `ndim <= 4`); then `n_instr` instructions of 7 words `[op, dst, a, b, c, d, e]` (unused -1).
- Opcodes (the `Op` constants): `LIT` (dst = literals[a]); `LOAD` (dst = const[a][b, c, d, e],
  the first `ndim` of the index registers b..e, each clamped into `[0, dim - 1]` like
  `dynamic_slice`); `COPY` (dst = a; also the int <-> float and bool -> number conversions);
  `STOP` (dst = a without gradient); the unary operations on register a (`INTEGER_POW` takes its
  exponent as the immediate in field b); the binary operations on registers a, b; `SELECT`
  (dst = c if a != 0 else b, `lax.select_n(pred, false_case, true_case)`); `CLAMP`
  (dst = min(max(b, a), c), `lax.clamp(lo=a, x=b, hi=c)`).

`IDIV` truncates toward zero and gives -1 for a zero divisor (XLA's rule for integers). `REM` is
C's `fmod` (the sign of the dividend); a zero divisor gives NaN, like float `lax.rem`. XLA's
integer rule (`x rem 0 = x`) is written into the program by `translate`, as a `SELECT` on the
divisor, wherever the divisor of an integer `rem` is not a known non-zero: a register carries no
type, so `REM` itself cannot tell an integer from a float.
"""

import dataclasses
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

MAGIC = 0x5350
VERSION = 1
HEADER_WORDS = 8
CONST_WORDS = 7
INSTR_WORDS = 7
N_INPUTS = 5  # registers 0..4: score, batch, head, q_idx, kv_idx
MAX_CONST_NDIM = 4  # LOAD has four index fields
INT_EXACT = 2**24  # float32 represents every integer of smaller magnitude exactly
FOLD_MAX_ELEMENTS = 2**22  # the largest array that translation computes ahead of time


class Op:
    """The opcodes of the score program (version 1)."""

    LIT, LOAD, COPY, STOP = 0, 1, 2, 3
    NEG, ABS, SIGN, FLOOR, CEIL, ROUND_EVEN, ROUND_AWAY = 10, 11, 12, 13, 14, 15, 16
    EXP, LOG, LOG1P, EXPM1, TANH, LOGISTIC, SQRT, RSQRT = 17, 18, 19, 20, 21, 22, 23, 24
    TRUNC, NOT, NONZERO, INTEGER_POW, EXP2 = 25, 26, 27, 28, 29
    ADD, SUB, MUL, DIV, IDIV, REM, MAX, MIN, POW = 40, 41, 42, 43, 44, 45, 46, 47, 48
    LT, LE, GT, GE, EQ, NE, AND, OR, XOR = 50, 51, 52, 53, 54, 55, 56, 57, 58
    SELECT, CLAMP = 60, 61


_UNARY = {
    "neg": Op.NEG, "abs": Op.ABS, "sign": Op.SIGN, "floor": Op.FLOOR, "ceil": Op.CEIL,
    "exp": Op.EXP, "exp2": Op.EXP2, "log": Op.LOG, "log1p": Op.LOG1P, "expm1": Op.EXPM1,
    "tanh": Op.TANH, "logistic": Op.LOGISTIC, "sqrt": Op.SQRT, "rsqrt": Op.RSQRT,
}
_FLOAT_ONLY = {"floor", "ceil", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
               "sqrt", "rsqrt", "round", "pow"}
_BINARY = {
    "add": Op.ADD, "sub": Op.SUB, "mul": Op.MUL, "max": Op.MAX, "min": Op.MIN, "pow": Op.POW,
    "lt": Op.LT, "le": Op.LE, "gt": Op.GT, "ge": Op.GE, "eq": Op.EQ, "ne": Op.NE,
}
_LOGICAL = {"and": Op.AND, "or": Op.OR, "xor": Op.XOR}
_UNARY_OPS = set(_UNARY.values()) | {Op.ROUND_EVEN, Op.ROUND_AWAY, Op.TRUNC, Op.NOT, Op.NONZERO,
                                     Op.COPY, Op.STOP}
_BINARY_OPS = set(_BINARY.values()) | set(_LOGICAL.values()) | {Op.DIV, Op.IDIV, Op.REM}
# primitives whose nested jaxpr is inlined (the parameter holding it); custom_jvp/custom_vjp:
# the primal, as the kernel differentiates the primitives themselves
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat2": "jaxpr", "checkpoint": "jaxpr"}
_NAN = float("nan")  # one object, so that programs with a NaN literal compare equal


class Untranslatable(ValueError):
    """`score_mod` or `mask_mod` uses something the compiled kernels' score programs do not
    express. `function` is `"score_mod"` or `"mask_mod"`, `primitive` the JAX primitive (or the
    construct, such as a captured array of 5 dimensions) that stopped the translation."""

    def __init__(self, function: str, primitive: str, detail: str = ""):
        self.function = function
        self.primitive = primitive
        message = (f"`{function}` uses `{primitive}`, which the compiled kernels do not "
                   f"translate")
        super().__init__(message + (f" ({detail})" if detail else "") + ".")


@dataclasses.dataclass(frozen=True, eq=False)
class ScoreProgram:
    """A translated `score_mod`/`mask_mod` pair: the words of the program, its float32 literal
    table, and the table of captured arrays it reads (the user's consts, then `extras`).

    Hashable and comparable, to serve as a static cache key; literals compare by their float32
    bits (so `0.0` and `-0.0` differ and NaN equals NaN)."""

    words: tuple[int, ...]
    literals: tuple[float, ...]
    const_shapes: tuple[tuple[int, ...], ...]
    differentiable: tuple[bool, ...]
    n_user_consts: int

    def _key(self):
        bits = tuple(struct.unpack("<I", struct.pack("<f", x))[0] for x in self.literals)
        return (self.words, bits, self.const_shapes, self.differentiable, self.n_user_consts)

    def __eq__(self, other):
        return isinstance(other, ScoreProgram) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def attrs(self) -> dict:
        """The kernel's attributes: `{"program": int32[...], "literals": float32[...]}`."""
        return {"program": np.asarray(self.words, np.int32),
                "literals": np.asarray(self.literals, np.float32)}

    @property
    def size(self) -> int:
        """Floats in the flat const buffer (`pack_consts`)."""
        return sum(math.prod(s) for s in self.const_shapes)

    @property
    def n_instr(self) -> int:
        return self.words[3]

    @property
    def uses_batch(self) -> bool:
        """Whether the program reads the batch index (register 1): such a program cannot fold a
        vmapped axis into the kernel's batch (the index would run across the elements)."""
        start = HEADER_WORDS + len(self.const_shapes) * CONST_WORDS
        for k in range(self.n_instr):
            op, _, a, b, c, d, e = self.words[start + k * INSTR_WORDS:
                                              start + (k + 1) * INSTR_WORDS]
            reads = {Op.LIT: (), Op.LOAD: (b, c, d, e), Op.INTEGER_POW: (a,)}.get(op, (a, b, c))
            if 1 in reads:
                return True
        return 1 in (self.words[4], self.words[5])

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each const's offset (in floats) into the flat const buffer."""
        out, at = [], 0
        for s in self.const_shapes:
            out.append(at)
            at += math.prod(s)
        return tuple(out)


# ------------------------------------------------------------------------------------------------
# Values of jaxpr variables during translation
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Known:
    """A value known at translation time (a literal, a closed-over constant, or computed from
    them): becomes a `LIT` where a scalar is needed, a const-table extra where one is indexed."""

    value: np.ndarray


@dataclasses.dataclass(frozen=True)
class _View:
    """A window of const-table entry `table`: per entry dimension an offset (None = 0, an int,
    or `("reg", r)` already clamped, or `("raw", r)`: an unclamped start that `LOAD`'s own clamp
    into `[0, dim - 1]` makes right, as the window has size 1 there) and a size; `axes` lists the
    entry dimension behind each dimension of the value (None: an added dimension of size 1)."""

    table: int
    offsets: tuple
    sizes: tuple[int, ...]
    axes: tuple

    @property
    def shape(self):
        return tuple(1 if a is None else self.sizes[a] for a in self.axes)


@dataclasses.dataclass(frozen=True)
class _Vec:
    """A short 1-D vector of registers (the index vector of a `gather`)."""

    regs: tuple


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _allowed(dtype) -> bool:
    """float32, bool or an integer type: what float32 registers hold exactly (for integers,
    below `INT_EXACT`). float16/bfloat16/float64/complex would change the rounding."""
    dtype = np.dtype(dtype)
    return (dtype == np.float32 or dtype == np.bool_ or jnp.issubdtype(dtype, jnp.integer))


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


# ------------------------------------------------------------------------------------------------
# The translator
# ------------------------------------------------------------------------------------------------
class _Translator:
    def __init__(self, consts: Sequence, n_score: int):
        self.instrs: list[list[int]] = []  # [op, a, b, c, d, e]; dst is implied by position
        self.literals: list[float] = []
        self.lit_index: dict[int, int] = {}  # float32 bits -> literal index
        self.lit_reg: dict[int, int] = {}  # float32 bits -> register of its LIT
        self.loads: dict[tuple, int] = {}  # (table, index regs) -> register
        self.shapes: list[tuple[int, ...]] = []
        self.differentiable: list[bool] = []
        self.extras: list[Any] = []
        self.extra_of: dict[int, int] = {}  # id(array) -> table index
        self.keep_alive: list[Any] = []  # the arrays of extra_of, so their ids stay unique
        self.nonzero: set[int] = set()  # registers known to be non-zero
        self.function = "score_mod"
        for i, c in enumerate(consts):
            shape = tuple(int(d) for d in jnp.shape(c))
            self.function = "score_mod" if i < n_score else "mask_mod"
            self._check_ndim(shape)
            self.shapes.append(shape)
            self.differentiable.append(i < n_score and _is_float(_dtype_of(c)))

    # -- errors ----------------------------------------------------------------------------------
    def fail(self, primitive: str, detail: str = ""):
        raise Untranslatable(self.function, primitive, detail)

    def _check_ndim(self, shape):
        if len(shape) > MAX_CONST_NDIM:
            self.fail(f"a captured array of {len(shape)} dimensions",
                      f"shape {shape}; the kernels index arrays of at most {MAX_CONST_NDIM}")

    # -- emitting --------------------------------------------------------------------------------
    def emit(self, op: int, a: int = -1, b: int = -1, c: int = -1, d: int = -1,
             e: int = -1) -> int:
        self.instrs.append([op, a, b, c, d, e])
        return N_INPUTS + len(self.instrs) - 1

    def lit(self, value, dtype, what: str = "a literal", exact_check: bool = True) -> int:
        """The register of a literal (one `LIT` per distinct float32 value)."""
        dtype = np.dtype(dtype)
        if not _allowed(dtype):
            self.fail(f"{what} of type {_dtype_name(dtype)}")
        v = float(value)
        if exact_check and dtype != np.float32 and not dtype == np.bool_ and abs(v) > INT_EXACT:
            self.fail(f"the integer literal {int(value)}",
                      "beyond 2**24 in magnitude, which float32 registers do not hold exactly")
        f32 = np.float32(v)
        bits = int(f32.view(np.uint32))
        if bits not in self.lit_reg:
            if bits not in self.lit_index:
                self.lit_index[bits] = len(self.literals)
                self.literals.append(_NAN if math.isnan(f32) else float(f32))
            r = self.emit(Op.LIT, self.lit_index[bits])
            self.lit_reg[bits] = r
            if f32 != 0:
                self.nonzero.add(r)
        return self.lit_reg[bits]

    def table_for(self, array) -> int:
        """The const-table entry of an array the jaxpr closed over (or computed ahead)."""
        key = id(array)
        if key not in self.extra_of:
            shape = tuple(int(d) for d in jnp.shape(array))
            self._check_ndim(shape)
            self.keep_alive.append(array)
            self.extra_of[key] = len(self.shapes)
            self.shapes.append(shape)
            self.differentiable.append(False)
            self.extras.append(array)
        return self.extra_of[key]

    # -- values ----------------------------------------------------------------------------------
    def fresh_view(self, table: int) -> _View:
        shape = self.shapes[table]
        return _View(table, (None,) * len(shape), shape, tuple(range(len(shape))))

    def as_view(self, value, prim: str) -> _View:
        if isinstance(value, _View):
            return value
        if isinstance(value, _Known):
            return self.fresh_view(self.table_for(value.value))
        self.fail(prim, "indexing anything but a captured array")

    def reg(self, value, dtype, prim: str) -> int:
        """The register of a scalar-like value (any shape of one element)."""
        if isinstance(value, int):
            return value
        if isinstance(value, _Known):
            if value.value.size != 1:
                self.fail(prim, f"on an array of shape {value.value.shape}: the kernels "
                                f"compute one element at a time")
            return self.lit(value.value.reshape(()), value.value.dtype)
        if isinstance(value, _View):
            if math.prod(value.shape) != 1:
                self.fail(prim, f"on a captured array of shape {value.shape} (not indexed down "
                                f"to one element)")
            return self.load(value)
        if isinstance(value, _Vec) and len(value.regs) == 1:
            return value.regs[0]
        self.fail(prim, "on a non-scalar value")

    def load(self, view: _View) -> int:
        idx = []
        for off in view.offsets:
            if off is None:
                idx.append(self.lit(0, np.int32))
            elif isinstance(off, int):
                idx.append(self.lit(off, np.int32))
            else:
                idx.append(off[1])
        key = (view.table, tuple(idx))
        if key not in self.loads:
            self.loads[key] = self.emit(Op.LOAD, view.table, *idx)
        return self.loads[key]

    def slice_dim(self, view: _View, dim: int, start, size: int, prim: str) -> _View:
        """`view` restricted along its dimension `dim` to `size` elements from `start` (a
        register or known int), clamped like `dynamic_slice` into `[0, extent - size]`."""
        a = view.axes[dim]
        extent = 1 if a is None else view.sizes[a]
        if size > extent:
            self.fail(prim, f"a slice of {size} from {extent}")
        if extent - size == 0:
            return view  # the clamp leaves no choice
        offsets, sizes = list(view.offsets), list(view.sizes)
        old = offsets[a]
        if isinstance(start, _KnownInt):
            c = min(max(start.v, 0), extent - size)
            if old is None:
                offsets[a] = c
            elif isinstance(old, int):
                offsets[a] = old + c
            elif c:
                offsets[a] = ("reg", self.emit(Op.ADD, old[1], self.lit(c, np.int32)))
        elif old is None and size == 1:
            offsets[a] = ("raw", start)  # LOAD clamps into [0, extent - 1] itself
        else:
            c = self.emit(Op.CLAMP, self.lit(0, np.int32), start,
                          self.lit(extent - size, np.int32))
            if old is None:
                offsets[a] = ("reg", c)
            elif isinstance(old, int):
                offsets[a] = ("reg", self.emit(Op.ADD, self.lit(old, np.int32), c)
                              if old else c)
            else:
                offsets[a] = ("reg", self.emit(Op.ADD, old[1], c))
        sizes[a] = size
        return _View(view.table, tuple(offsets), tuple(sizes), view.axes)

    def index_value(self, value, dtype, prim):
        """A start index: `_KnownInt` when known now, else its register."""
        if isinstance(value, _Known):
            v = value.value.reshape(())
            return _KnownInt(int(v))
        return self.reg(value, dtype, prim)

    # -- jaxprs ----------------------------------------------------------------------------------
    def run(self, jaxpr, consts: Sequence, args: Sequence) -> list:
        env: dict = {}

        def read(atom):
            if isinstance(atom, jex_core.Literal):
                return _Known(np.asarray(atom.val, atom.aval.dtype))
            return env[atom]

        for var, c in zip(jaxpr.constvars, consts, strict=True):
            if isinstance(c, jax.core.Tracer):  # traced by an enclosing transformation
                env[var] = self.fresh_view(self.table_for(c))
            else:
                env[var] = _Known(np.asarray(c))
        for var, a in zip(jaxpr.invars, args, strict=True):
            env[var] = a
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            outs = self.equation(eqn, ins)
            for var, o in zip(eqn.outvars, outs, strict=True):
                env[var] = o
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn, ins) -> list:
        name = eqn.primitive.name
        if name in _CALLS:
            inner = eqn.params.get(_CALLS[name])
            if inner is None:
                self.fail(name, "its jaxpr was not found")
            if isinstance(inner, jex_core.ClosedJaxpr):
                return self.run(inner.jaxpr, inner.consts, ins)
            return self.run(inner, [], ins)
        for v in eqn.outvars:
            if not _allowed(v.aval.dtype):
                what = (f"{name} to {_dtype_name(v.aval.dtype)}" if name == "convert_element_type"
                        else f"{name} on {_dtype_name(v.aval.dtype)}")
                self.fail(what, "float32 registers would round differently")
        if (all(isinstance(x, _Known) for x in ins) and not eqn.effects
                and all(math.prod(v.aval.shape) <= FOLD_MAX_ELEMENTS for v in eqn.outvars)):
            # computed now, once (e.g. `jnp.arange(n)` or a cast of a closed-over table)
            with jax.ensure_compile_time_eval():
                outs = eqn.primitive.bind(*(x.value for x in ins), **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            return [_Known(np.asarray(o)) for o in outs]
        in_dtypes = [v.aval.dtype for v in eqn.invars]
        out = eqn.outvars[0].aval
        rule = getattr(self, "_" + name, None)
        if rule is not None:
            return [rule(eqn, ins, in_dtypes, out)]
        if name in _UNARY or name in _BINARY or name in _LOGICAL or name in (
                "round", "integer_pow", "div", "rem", "not", "select_n", "clamp", "square",
                "stop_gradient", "convert_element_type"):
            return [self.elementwise(name, eqn, ins, in_dtypes, out)]
        if name in ("copy", "copy_p"):
            return [ins[0]]  # same value, same gradient: the register itself
        detail = ""
        if name == "reduce_precision":
            detail = "it changes the rounding of float32"
        self.fail(name, detail)

    # -- elementwise -----------------------------------------------------------------------------
    def elementwise(self, name, eqn, ins, in_dtypes, out):
        n = math.prod(out.shape)
        vecs = [x for x in ins if isinstance(x, _Vec)]
        if n != 1 and not (vecs and all(len(v.regs) == n for v in vecs)):
            self.fail(name, f"on arrays of shape {out.shape}: the kernels compute one element "
                            f"at a time")
        if vecs:  # an index vector: element by element
            regs = []
            for k in range(n):
                parts = [x.regs[k] if isinstance(x, _Vec) else x for x in ins]
                regs.append(self.scalar_op(name, eqn, parts, in_dtypes, out.dtype))
            return _Vec(tuple(regs))
        return self.scalar_op(name, eqn, ins, in_dtypes, out.dtype)

    def scalar_op(self, name, eqn, ins, in_dtypes, out_dtype) -> int:
        regs = [self.reg(x, d, name) for x, d in zip(ins, in_dtypes, strict=True)]
        is_float = _is_float(in_dtypes[0]) if in_dtypes else False
        is_bool = np.dtype(in_dtypes[0]) == np.bool_ if in_dtypes else False
        if name in _FLOAT_ONLY and not _is_float(out_dtype):
            self.fail(f"{name} on {_dtype_name(out_dtype)}",
                      "only its float32 form is exact in float32 registers")
        if name in _UNARY:
            return self.emit(_UNARY[name], regs[0])
        if name == "round":
            method = int(eqn.params["rounding_method"])
            return self.emit(Op.ROUND_EVEN if method == 1 else Op.ROUND_AWAY, regs[0])
        if name == "integer_pow":
            return self.emit(Op.INTEGER_POW, regs[0], int(eqn.params["y"]))
        if name == "square":
            return self.emit(Op.MUL, regs[0], regs[0])
        if name == "stop_gradient":
            return self.emit(Op.STOP, regs[0])
        if name in _BINARY:
            return self.emit(_BINARY[name], regs[0], regs[1])
        if name == "div":
            return self.emit(Op.DIV if is_float else Op.IDIV, regs[0], regs[1])
        if name == "rem":
            r = self.emit(Op.REM, regs[0], regs[1])
            if is_float or regs[1] in self.nonzero:
                return r
            # XLA: an integer `x rem 0` is x (REM would give fmod's NaN)
            zero = self.emit(Op.EQ, regs[1], self.lit(0, np.int32))
            return self.emit(Op.SELECT, zero, r, regs[0])
        if name in _LOGICAL or name == "not":
            if not is_bool:
                self.fail(f"bitwise {name} on {_dtype_name(in_dtypes[0])}",
                          "only its bool form is exact in float32 registers")
            return (self.emit(Op.NOT, regs[0]) if name == "not"
                    else self.emit(_LOGICAL[name], regs[0], regs[1]))
        if name == "select_n":
            if len(regs) == 2:
                return regs[1]
            if len(regs) != 3:
                self.fail(f"select_n with {len(regs) - 1} cases", "only 2 are translated")
            r = self.emit(Op.SELECT, *regs)
            if regs[1] in self.nonzero and regs[2] in self.nonzero:
                self.nonzero.add(r)
            return r
        if name == "clamp":
            return self.emit(Op.CLAMP, *regs)
        if name == "convert_element_type":
            src, dst = np.dtype(in_dtypes[0]), np.dtype(out_dtype)
            if not _allowed(src):
                self.fail(f"convert_element_type from {_dtype_name(src)}",
                          "float32 registers would round differently")
            if dst == np.bool_:
                return regs[0] if src == np.bool_ else self.emit(Op.NONZERO, regs[0])
            if _is_float(src) and not _is_float(dst):
                return self.emit(Op.TRUNC, regs[0])
            return regs[0]  # the same number in a register: no instruction needed
        self.fail(name)

    # -- structural rules (arrays of captured values and index vectors) ---------------------------
    def _squeeze(self, eqn, ins, in_dtypes, out):
        x = ins[0]
        if isinstance(x, _View):
            dims = set(d % len(x.axes) for d in eqn.params["dimensions"])
            return _View(x.table, x.offsets, x.sizes,
                         tuple(a for i, a in enumerate(x.axes) if i not in dims))
        return self._reshape_scalar(x, in_dtypes, out, "squeeze")

    def _reshape_scalar(self, x, in_dtypes, out, name):
        if isinstance(x, int) and math.prod(out.shape) == 1:
            return x
        if isinstance(x, _Vec) and len(x.regs) == math.prod(out.shape) and (
                len(x.regs) == 1 or len([d for d in out.shape if d != 1]) == 1):
            return x if len(x.regs) > 1 else x.regs[0]
        if isinstance(x, _Known):
            return _Known(np.reshape(x.value, out.shape))
        self.fail(name, f"to shape {out.shape}: the kernels compute one element at a time")

    def _reshape(self, eqn, ins, in_dtypes, out):
        x = ins[0]
        if eqn.params.get("dimensions") not in (None, ()):
            self.fail("reshape", "with a transposition")
        if isinstance(x, _View):
            return self._reshape_view(x, out.shape, "reshape")
        return self._reshape_scalar(x, in_dtypes, out, "reshape")

    def _reshape_view(self, x: _View, shape, name) -> _View:
        """Only size-1 dimensions added or removed: anything else would mix elements."""
        old = [a for a in x.axes if (1 if a is None else x.sizes[a]) != 1]
        if [x.sizes[a] for a in old] != [d for d in shape if d != 1]:
            self.fail(name, f"of a captured array window {x.shape} to {tuple(shape)}")
        it = iter(old)
        axes = tuple(None if d == 1 else next(it) for d in shape)
        return _View(x.table, x.offsets, x.sizes, axes)

    def _broadcast_in_dim(self, eqn, ins, in_dtypes, out):
        x = ins[0]
        shape = tuple(out.shape)
        if isinstance(x, _View):
            dims = eqn.params["broadcast_dimensions"]
            if any(x.shape[i] != shape[d] for i, d in enumerate(dims)) or math.prod(
                    shape) != math.prod(x.shape):
                self.fail("broadcast_in_dim", f"of a captured array to {shape}")
            return self._reshape_view(x, shape, "broadcast_in_dim")
        if math.prod(shape) == 1:
            return self.reg(x, in_dtypes[0], "broadcast_in_dim")
        self.fail("broadcast_in_dim", f"to shape {shape}: the kernels compute one element at "
                                      f"a time")

    def _concatenate(self, eqn, ins, in_dtypes, out):
        if len(out.shape) != 1:
            self.fail("concatenate", f"to shape {out.shape}")
        regs = []
        for x, d in zip(ins, in_dtypes, strict=True):
            if isinstance(x, _Vec):
                regs.extend(x.regs)
            elif isinstance(x, _Known):
                regs.extend(self.lit(v, d) for v in np.ravel(x.value))
            else:
                regs.append(self.reg(x, d, "concatenate"))
        return _Vec(tuple(regs))

    def _dynamic_slice(self, eqn, ins, in_dtypes, out):
        view = self.as_view(ins[0], "dynamic_slice")
        sizes = eqn.params["slice_sizes"]
        for dim, (start, dt, size) in enumerate(zip(ins[1:], in_dtypes[1:], sizes, strict=True)):
            view = self.slice_dim(view, dim, self.index_value(start, dt, "dynamic_slice"),
                                  int(size), "dynamic_slice")
        return view

    def _slice(self, eqn, ins, in_dtypes, out):
        """A static window (`x[2:5]`, `x[0, 1]`) of a captured array."""
        x = ins[0]
        if not isinstance(x, (_View, _Known)):
            return self._reshape_scalar(x, in_dtypes, out, "slice")
        if any(st not in (None, 1) for st in (eqn.params.get("strides") or ())):
            self.fail("slice", "with strides")
        view = self.as_view(x, "slice")
        for dim, (lo, hi) in enumerate(zip(eqn.params["start_indices"],
                                           eqn.params["limit_indices"], strict=True)):
            view = self.slice_dim(view, dim, _KnownInt(int(lo)), int(hi) - int(lo), "slice")
        return view

    def _gather(self, eqn, ins, in_dtypes, out):
        """One index vector picking a window of a captured array (what `jnp.take` and
        `x.at[i].get()` emit): the same as `dynamic_slice`, then dropping the collapsed
        dimensions; with mode `fill` only where the window is one element."""
        params = eqn.params
        dn = params["dimension_numbers"]
        if dn.operand_batching_dims or dn.start_indices_batching_dims:
            self.fail("gather", "with batching dimensions")
        view = self.as_view(ins[0], "gather")
        idx, idx_dtype = ins[1], in_dtypes[1]
        idx_shape = eqn.invars[1].aval.shape
        k = len(dn.start_index_map)
        if not idx_shape or idx_shape[-1] != k or math.prod(idx_shape[:-1]) != 1:
            self.fail("gather", f"with indices of shape {idx_shape} (more than one element "
                                f"picked)")
        if isinstance(idx, _Vec):
            starts = list(idx.regs)
        elif isinstance(idx, _Known):
            starts = [_KnownInt(int(v)) for v in np.ravel(idx.value)]
        else:
            starts = [self.reg(idx, idx_dtype, "gather")]
        if len(starts) != k:
            self.fail("gather", "with an index vector of unexpected length")
        mode = str(params["mode"]).rsplit(".", 1)[-1].upper()
        fill = "FILL" in mode
        slice_sizes = [int(s) for s in params["slice_sizes"]]
        if fill and math.prod(slice_sizes) != 1:
            self.fail("gather", "in mode 'fill' picking more than one element")
        inside = None
        for dim, start in zip(dn.start_index_map, starts, strict=True):
            extent = view.shape[dim]
            if fill and not isinstance(start, _KnownInt):
                ok = self.emit(Op.AND, self.emit(Op.GE, start, self.lit(0, np.int32)),
                               self.emit(Op.LE, start, self.lit(extent - 1, np.int32)))
                inside = ok if inside is None else self.emit(Op.AND, inside, ok)
            elif fill and not 0 <= start.v < extent:
                inside = self.lit(0, np.bool_)
            view = self.slice_dim(view, dim, start, slice_sizes[dim], "gather")
        for dim, size in enumerate(slice_sizes):
            if size != view.shape[dim]:  # dimensions not indexed start at 0
                view = self.slice_dim(view, dim, _KnownInt(0), size, "gather")
        collapsed = set(dn.collapsed_slice_dims)
        view = _View(view.table, view.offsets, view.sizes,
                     tuple(a for i, a in enumerate(view.axes) if i not in collapsed))
        # the batch dimensions of the indices are all of size 1: only the window's order counts
        view = self._reshape_view(view, out.shape, "gather")
        if not fill or inside is None:
            return view
        value = self.load(view)
        dtype = np.dtype(out.dtype)
        fill_value = params.get("fill_value")
        if fill_value is None:  # jax.lax.gather's defaults for mode 'fill'
            fill_value = (np.nan if _is_float(dtype) else True if dtype == np.bool_ else
                          np.iinfo(dtype).min if jnp.issubdtype(dtype, jnp.signedinteger)
                          else np.iinfo(dtype).max)
        # the fill (-2**31 for int32) is only seen for out-of-range indices, where it is a
        # marker, not a number computed with: it need not be below 2**24
        return self.emit(Op.SELECT, inside, self.lit(fill_value, dtype, exact_check=False), value)


@dataclasses.dataclass(frozen=True)
class _KnownInt:
    v: int


def _dtype_of(c):
    dtype = getattr(c, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.result_type(c)


def _aval(c):
    return jax.ShapeDtypeStruct(tuple(jnp.shape(c)), _dtype_of(c))


# ------------------------------------------------------------------------------------------------
# translate
# ------------------------------------------------------------------------------------------------
def translate(score_fn: Callable | None, n_score_consts: int, mask_fn: Callable | None,
              n_mask_consts: int, consts: Sequence) -> tuple[ScoreProgram, tuple]:
    """The score program of the closure-converted `score_fn(s, b, h, qi, ki, *score_consts)` and
    `mask_fn(b, h, qi, ki, *mask_consts)` (either may be None), with
    `consts = (*score_consts, *mask_consts)` (arrays or tracers: only shapes and dtypes are read).

    Returns `(program, extras)`: `extras` are the arrays the functions closed over as constants
    (integer tables are not hoisted by `jax.closure_convert`) or that translation computed ahead
    of time from constants alone (such as `jnp.arange(n)`); they follow the user's consts in the
    const table and get no gradient.

    Raises `Untranslatable` naming the function and the primitive that has no translation.
    """
    consts = tuple(consts)
    if len(consts) != n_score_consts + n_mask_consts:
        raise ValueError(f"translate: {len(consts)} consts given for {n_score_consts} + "
                         f"{n_mask_consts}.")
    t = _Translator(consts, n_score_consts)
    s = jax.ShapeDtypeStruct((), jnp.float32)
    i = jax.ShapeDtypeStruct((), jnp.int32)
    score_out = mask_out = -1
    if score_fn is not None:
        t.function = "score_mod"
        avals = [_aval(c) for c in consts[:n_score_consts]]
        closed = jax.make_jaxpr(score_fn)(s, i, i, i, i, *avals)
        views = [t.fresh_view(k) for k in range(n_score_consts)]
        score_out = _output(t, closed, [0, 1, 2, 3, 4, *views], float_out=True)
    if mask_fn is not None:
        t.function = "mask_mod"
        avals = [_aval(c) for c in consts[n_score_consts:]]
        closed = jax.make_jaxpr(mask_fn)(i, i, i, i, *avals)
        views = [t.fresh_view(n_score_consts + k) for k in range(n_mask_consts)]
        mask_out = _output(t, closed, [1, 2, 3, 4, *views], float_out=False)
    return _finish(t, len(consts), score_out, mask_out)


def _output(t: _Translator, closed, args, float_out: bool) -> int:
    jaxpr = closed.jaxpr
    if len(jaxpr.outvars) != 1:
        t.fail(f"{len(jaxpr.outvars)} outputs", "one scalar is returned")
    aval = jaxpr.outvars[0].aval
    if aval.shape != ():
        t.fail(f"an output of shape {aval.shape}", "one scalar is returned")
    dtype = np.dtype(aval.dtype)
    if float_out and not _is_float(dtype):
        t.fail(f"an output of type {dtype.name}", "score_mod returns a float")
    if not float_out and dtype != np.bool_:
        t.fail(f"an output of type {dtype.name}", "mask_mod returns a bool")
    (value,) = t.run(jaxpr, closed.consts, args)
    return t.reg(value, dtype, "its output")


def _reg_fields(op: int) -> tuple[int, ...]:
    """Which of the fields a..e (0..4) of an instruction name registers."""
    if op == Op.LIT:
        return ()
    if op == Op.LOAD:
        return (1, 2, 3, 4)
    if op == Op.INTEGER_POW:
        return (0,)
    if op in (Op.SELECT, Op.CLAMP):
        return (0, 1, 2)
    if op in _BINARY_OPS:
        return (0, 1)
    return (0,)


def _finish(t: _Translator, n_user: int, score_out: int, mask_out: int):
    """Prune what the outputs do not use, renumber, and encode the words."""
    live = set(r for r in (score_out, mask_out) if r >= N_INPUTS)
    for k in range(len(t.instrs) - 1, -1, -1):
        if N_INPUTS + k in live:
            ins = t.instrs[k]
            live.update(ins[1 + f] for f in _reg_fields(ins[0]) if ins[1 + f] >= N_INPUTS)
    renumber = {r: r for r in range(N_INPUTS)}
    renumber[-1] = -1
    kept, literals, lit_of = [], [], {}
    used_tables = sorted({t.instrs[r - N_INPUTS][1] for r in live
                          if t.instrs[r - N_INPUTS][0] == Op.LOAD})
    tables = list(range(n_user)) + [x for x in used_tables if x >= n_user]
    table_of = {x: k for k, x in enumerate(tables)}
    for k, ins in enumerate(t.instrs):
        if N_INPUTS + k not in live:
            continue
        op, fields = ins[0], list(ins[1:])
        for f in _reg_fields(op):
            fields[f] = renumber[fields[f]]
        if op == Op.LIT:
            value = t.literals[fields[0]]
            bits = struct.unpack("<I", struct.pack("<f", value))[0]
            if bits not in lit_of:
                lit_of[bits] = len(literals)
                literals.append(value)
            fields[0] = lit_of[bits]
        elif op == Op.LOAD:
            fields[0] = table_of[fields[0]]
            nd = len(t.shapes[tables[fields[0]]])
            fields[1 + nd:] = [-1] * (4 - nd)
        renumber[N_INPUTS + k] = N_INPUTS + len(kept)
        kept.append([op, N_INPUTS + len(kept), *fields])
    shapes = tuple(t.shapes[x] for x in tables)
    words = [MAGIC, VERSION, N_INPUTS + len(kept), len(kept), renumber[score_out],
             renumber[mask_out], len(tables), len(literals)]
    offset = 0
    for x in tables:
        shape = t.shapes[x]
        words += [offset, len(shape), *shape, *([1] * (4 - len(shape))),
                  int(t.differentiable[x])]
        offset += math.prod(shape)
    for ins in kept:
        words += ins
    extras = tuple(t.extras[x - n_user] for x in tables[n_user:])
    program = ScoreProgram(tuple(int(w) for w in words), tuple(literals), shapes,
                           tuple(bool(t.differentiable[x]) for x in tables), n_user)
    return program, extras


# ------------------------------------------------------------------------------------------------
# The const buffer and its gradient
# ------------------------------------------------------------------------------------------------
def pack_consts(program: ScoreProgram, consts: Sequence, extras: Sequence) -> jax.Array:
    """`float32[program.size]`: every const of the table (the user's, then `extras`) flattened
    in C order, cast to float32 and concatenated (works on tracers)."""
    arrays = (*consts, *extras)
    if len(arrays) != len(program.const_shapes):
        raise ValueError(f"pack_consts: {len(arrays)} arrays for a table of "
                         f"{len(program.const_shapes)}.")
    parts = []
    for a, shape in zip(arrays, program.const_shapes, strict=True):
        if tuple(jnp.shape(a)) != shape:
            raise ValueError(f"pack_consts: an array of shape {jnp.shape(a)} where the program "
                             f"was translated for {shape}.")
        parts.append(jnp.ravel(jnp.asarray(a)).astype(jnp.float32))
    if not parts:
        return jnp.zeros((0,), jnp.float32)
    return jnp.concatenate(parts)


def unpack_gradients(program: ScoreProgram, flat, consts: Sequence) -> tuple:
    """One gradient per user const from `flat` (`float32[program.size]`, d(loss)/d(element) of
    every table element): reshaped and cast to the const's dtype for float consts, float0 zeros
    (JAX's gradient type of integers and bools) for the others."""
    out = []
    for c, shape, offset in zip(consts, program.const_shapes, program.offsets):
        dtype = _dtype_of(c)
        if jnp.issubdtype(dtype, jnp.inexact):
            out.append(flat[offset:offset + math.prod(shape)].reshape(shape).astype(dtype))
        else:
            out.append(np.zeros(shape, jax.dtypes.float0))
    return tuple(out)


# ------------------------------------------------------------------------------------------------
# The reference interpreter
# ------------------------------------------------------------------------------------------------
def _round_away(a):
    t = np.trunc(a)
    return np.where(np.abs(a - t) >= 0.5, t + np.sign(a), t).astype(np.float32)


def _integer_pow(x, y: int):
    """Square-and-multiply, as `lax.integer_pow` computes it."""
    if y == 0:
        return np.ones_like(x)
    acc, base, n = None, x, abs(y)
    while n:
        if n & 1:
            acc = base if acc is None else (acc * base).astype(np.float32)
        n >>= 1
        if n:
            base = (base * base).astype(np.float32)
    return (np.float32(1) / acc).astype(np.float32) if y < 0 else acc


_NP_UNARY = {
    Op.NEG: np.negative, Op.ABS: np.abs, Op.SIGN: np.sign, Op.FLOOR: np.floor,
    Op.CEIL: np.ceil, Op.ROUND_EVEN: np.round, Op.ROUND_AWAY: _round_away, Op.EXP: np.exp,
    Op.LOG: np.log, Op.LOG1P: np.log1p, Op.EXPM1: np.expm1, Op.TANH: np.tanh,
    Op.LOGISTIC: lambda a: np.float32(1) / (np.float32(1) + np.exp(-a)), Op.SQRT: np.sqrt,
    Op.RSQRT: lambda a: np.float32(1) / np.sqrt(a), Op.TRUNC: np.trunc,
    Op.NOT: lambda a: np.float32(1) - a, Op.NONZERO: lambda a: (a != 0),
    Op.EXP2: np.exp2, Op.COPY: lambda a: a, Op.STOP: lambda a: a,
}


def _idiv(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.trunc(a.astype(np.float64) / np.where(b == 0, 1, b))
    return np.where(b == 0, -1, q)


_NP_BINARY = {
    Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide,
    Op.IDIV: _idiv, Op.REM: np.fmod, Op.MAX: np.maximum, Op.MIN: np.minimum, Op.POW: np.power,
    Op.LT: np.less, Op.LE: np.less_equal, Op.GT: np.greater, Op.GE: np.greater_equal,
    Op.EQ: np.equal, Op.NE: np.not_equal,
    Op.AND: lambda a, b: (a != 0) & (b != 0), Op.OR: lambda a, b: (a != 0) | (b != 0),
    Op.XOR: lambda a, b: (a != 0) ^ (b != 0),
}


def evaluate(program: ScoreProgram, flat_consts, score, b, h, qi, ki):
    """Run `program` in NumPy float32 over broadcastable arrays of scores and indices: the
    reference interpreter of the specification. Returns `(score_out or None, mask_out as bool
    or None)`, broadcast to the inputs' common shape."""
    words = program.words
    if words[0] != MAGIC or words[1] != VERSION:
        raise ValueError(f"not a score program of version {VERSION}: header {words[:2]}.")
    _, _, n_regs, n_instr, score_out, mask_out, n_consts, n_literals = words[:HEADER_WORDS]
    flat = np.asarray(flat_consts, np.float32)
    inputs = np.broadcast_arrays(*(np.asarray(x, np.float32) for x in (score, b, h, qi, ki)))
    regs: list = [x.astype(np.float32) for x in inputs]
    tables = []
    at = HEADER_WORDS
    for _ in range(n_consts):
        offset, ndim, *dims, _diff = words[at:at + CONST_WORDS]
        shape = tuple(dims[:ndim])
        tables.append(flat[offset:offset + math.prod(shape)].reshape(shape))
        at += CONST_WORDS
    literals = np.asarray(program.literals, np.float32)
    assert len(literals) == n_literals
    with np.errstate(all="ignore"):
        for k in range(n_instr):
            op, dst, a, b_, c, d, e = words[at:at + INSTR_WORDS]
            at += INSTR_WORDS
            if dst != N_INPUTS + k:
                raise ValueError(f"instruction {k} writes register {dst}, not {N_INPUTS + k}.")
            if op == Op.LIT:
                r = np.full(inputs[0].shape, literals[a])
            elif op == Op.LOAD:
                table = tables[a]
                idx = tuple(np.clip(regs[x], 0, n - 1).astype(np.int64)
                            for x, n in zip((b_, c, d, e), table.shape))
                r = np.broadcast_to(table[idx] if idx else table, inputs[0].shape)
            elif op == Op.INTEGER_POW:
                r = _integer_pow(regs[a], b_)
            elif op == Op.SELECT:
                r = np.where(regs[a] != 0, regs[c], regs[b_])
            elif op == Op.CLAMP:
                r = np.minimum(np.maximum(regs[b_], regs[a]), regs[c])
            elif op in _NP_UNARY:
                r = _NP_UNARY[op](regs[a])
            elif op in _NP_BINARY:
                r = _NP_BINARY[op](regs[a], regs[b_])
            else:
                raise ValueError(f"unknown opcode {op} in instruction {k}.")
            regs.append(np.asarray(r).astype(np.float32))
    assert len(regs) == n_regs
    score_value = None if score_out < 0 else regs[score_out]
    mask_value = None if mask_out < 0 else regs[mask_out] != 0
    return score_value, mask_value
