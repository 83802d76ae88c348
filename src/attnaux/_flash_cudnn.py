"""The `flash` backend on NVIDIA GPUs: cuDNN's fused attention behind attnaux's XLA FFI handlers.

The handlers (`csrc/cuda/flash_cuda.cc`, module `attnaux._ext_cuda`) build one cuDNN frontend
graph per static configuration and cache it. What cuDNN does not give directly is done here,
exactly:

- **lse and max**: cuDNN's forward emits `Max` and `Sum_exp`; `lse = max + log(sum_exp)` is one
  small XLA fusion after it, so the forward returns out, lse and max.
- **Gradient through lse**: cuDNN's backward forms `D = rowsum(dO * O)` and has no input for an
  lse cotangent; O enters it nowhere else. With both cotangents (a z-loss next to the output
  loss; bfloat16) `dlse` is folded into O: `O' = O - (dlse / |dO|^2) dO` has `rowsum(dO * O') =
  D - dlse`, one elementwise pass before one plain backward (`fold_lse_cotangent`; measured
  1.20-1.42x the plain forward+backward on an H100, against 1.48-1.97x for the columns below,
  `benchmarks/gpu_zloss.py`). An lse-only loss (dO = 0) and float16 append columns instead:
  `O' = [O, -dlse]`, `dO' = [dO, 1]`, `V' = [V, 0]` gives `rowsum(dO' * O') = D - dlse` while
  `dO' . V'^T = dO . V^T` (the column carries `-dlse` split into three bf16/f16 parts, summed by
  cuDNN in float32). Without an lse cotangent (`custom_vjp` symbolic zeros) none of this runs.
  Both hold with dropout too: cuDNN forms `dS = P * (mask * dP / (1 - rate) - D)`, so
  `D - dlse` gives the `+ P * dlse` term.
- **Sink**: cuDNN's own sink token would enter its `Max` output (attnaux's `max` excludes the
  sink), so the sink is applied after cuDNN, exactly: with `lse0` the row's log-sum-exp without
  it, `lse = logaddexp(lse0, sink)` and `out = out0 * exp(lse0 - lse)` (the output is a
  P-weighted sum, dropout included, so it rescales). Its gradient is JAX's, through these two
  lines and the fused backward (which then always has an lse cotangent).
- **Dropout**: cuDNN draws its keep-mask with its own Philox generator, seeded from
  `aux.rng_state` (words 0-1: the int64 seed, words 2-3: the int64 offset), and its backward
  regenerates the same mask. That mask is not attnaux's documented CPU mask;
  `cudnn_dropout_keep_mask` regenerates it through cuDNN's RNG dump output, and
  `attnaux.introspect.dropout_mask` calls it for an aux with `dropout_impl == "cudnn"`.
- **Softcap**: attnaux's own score modifier inside cuDNN's kernel (softcap's tanh forward and
  its derivative backward). cuDNN takes no built-in mask next to a score modifier, so there the
  causal, window and padding masks are in the modifier as well (also for a bias or dropout with
  bottom-right causal masking, which cuDNN's built-in mask does not combine with). Not with a
  bias: cuDNN's backward then gives a wrong bias gradient (`_SOFTCAP_BIAS_WHY`).
- **Segment ids and a boolean mask** go to cuDNN as a bias, `[1|B, 1|Hq, Sq, Skv]`: the call's
  bias (or 0) where the mask is True and `q_segment_ids[i] == kv_segment_ids[j]`, -inf
  elsewhere; without a bias of the call it is a constant (in the input dtype, where 0 and -inf
  are exact) and the backward writes no bias gradient. For segment ids, measured on an H200 with
  cuDNN 9.19, this beats a select in attnaux's score modifier (the forward through it was exact
  but 1.4-1.5x slower at 8x1024x16x128, and cuDNN's backward applied it wrongly: dQ, dK and dV
  off by O(1)). cuDNN's packed layout (ragged offsets) would need one batch entry per segment, a
  data-dependent count.
- **Rows with no visible key** (padding rows past `q_seqlens`, windows that see nothing, a query
  whose segment has no key): outputs are set to 0 / -inf here, the backward gets `lse = +inf` for
  them (so cuDNN's recomputed P is 0, never NaN) and zero cotangents, and their gradients are
  selected to 0.

The bias goes to cuDNN in float32 when it takes it, else (cuDNN 9.19) rounded to the input dtype;
its gradient comes back in that dtype.

cuDNN's workspace comes from XLA's FFI scratch allocator; `ATTNAUX_CUDNN_WORKSPACE=output` makes
it an output buffer of the call instead, sized at trace time (for an XLA whose FFI offers no
scratch allocator).

Not served on GPU (`unavailable` says why; `auto` then picks another backend): float32/float64
inputs, softcap with a bias, `return_probs`, head dims that are not multiples of 8
in [8, 256], and any configuration cuDNN itself rejects (asked at trace time through
`_ext_cuda.check_support`).
"""

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from ._canon import Canonical, Options, Problem
from ._kernel_call import (
    BATCH,
    BROADCAST,
    SHARED,
    KernelOp,
    absent,
    add_sink,
    attention_attrs,
    compiled_vjp,
    present,
)
from ._masking import token_rows, zero_hidden_rows
from ._partition import BATCH as BATCH_DIM
from ._partition import HEADS, KV_HEADS

FWD_TARGET = "attnaux_flash_fwd_cudnn"
BWD_TARGET = "attnaux_flash_bwd_cudnn"
MAX_HEAD_DIM = 256
_NOT_BUILT = "the CUDA toolkit, cuDNN or cudnn-frontend headers were not found at build time"
_EXTRA_COLUMNS = 8  # columns appended to O/dO/V for the lse cotangent (cuDNN wants multiples of 8)
_WORKSPACE_MODES = ("scratch", "output")

FOLD_LSE_COTANGENT = True
"""Whether a bfloat16 backward with both cotangents folds `dlse` into O (`fold_lse_cotangent`);
False takes the extra-column path always (benchmarks/gpu_zloss.py compares the two). Read when a
call is traced (it keys the call's `Config`)."""

FOLD_TARGET = "attnaux_fold_lse"
FOLD_WITH_KERNEL = True
"""Whether the fold runs as attnaux's CUDA kernel `attnaux_fold_lse` (csrc/cuda/fold_lse.cu: one
pass that reads O and dO once and writes O'; dO' aliases dO, only its rare rows with dO = 0
rewritten) where it is built, or as the XLA fusion of `fold_lse_cotangent` (two reads of O and
dO, O' and dO' both written). Read when a call is traced, like `FOLD_LSE_COTANGENT`."""

_SOFTCAP_BIAS_WHY = (
    "the cuDNN path does not serve softcap together with a bias: cuDNN 9.19's fused backward "
    "takes the bias gradient after the softcap derivative (dbias measured wrong on an H200), "
    "while the bias is added after the softcap"
)


def _workspace_mode() -> str:
    mode = os.environ.get("ATTNAUX_CUDNN_WORKSPACE", "scratch")
    if mode not in _WORKSPACE_MODES:
        raise ValueError(
            f"ATTNAUX_CUDNN_WORKSPACE must be one of {_WORKSPACE_MODES}; got {mode!r}."
        )
    return mode


class Config(NamedTuple):
    """Static configuration of the GPU kernels (hashable: keys the traced functions)."""

    scale: float
    causal: int
    window_left: int
    window_right: int
    padding: bool
    with_max: bool
    softcap: float = 0.0
    dropout_rate: float = 0.0
    masked: bool = False  # a boolean mask or segment ids (in the bias): rows may see no key
    composite: bool = False  # forward: pin cuDNN's composite implementation (measurements only)
    bias_grad: bool = True  # backward with a bias: write its gradient (off: a mask-only bias)
    ragged: bool = False  # packed sequences (cuDNN's THD layout through ragged offsets)
    max_seqlen_q: int = 0  # ragged: the padded lengths cuDNN's graph is built for
    max_seqlen_kv: int = 0
    fold_lse: bool = True  # backward: `FOLD_LSE_COTANGENT` when the call was traced
    fold_kernel: bool = False  # the fold through `attnaux_fold_lse` (`FOLD_WITH_KERNEL`, built)
    # a kernel run in cuDNN's forward's place, `(cfg, q, k, v) -> (out, lse, max)`, its lse the
    # backward's stats (`_dispatch.FLASH_HOPPER_FORWARD`: attnaux's Hopper kernel); with
    # `ragged`, `(cfg, q, k, v, q_len, kv_len, q_offsets, kv_offsets) -> (out, lse, max)`, the
    # statistics per token `[1, Hq, Tq]` (`_hopper_packed.cuda_forward`); None: cuDNN
    forward_kernel: Callable | None = None
    # a kernel run in cuDNN's backward's place, `(cfg, q, k, v, out, lse, dout, dlse) -> (dq,
    # dk, dv)` (`_dispatch.gpu_backward_on_cuda`: attnaux's CUDA C++ Hopper backward, plain
    # attention only: no padding, mask, bias or dropout); None: cuDNN
    backward_kernel: Callable | None = None


def padding_needed(options: Options, q_seq: int, kv_seq: int) -> bool:
    """Whether cuDNN's padding mask (with the sequence lengths) is used: when lengths were given,
    and when a bottom-right or windowed mask has q_seq > kv_seq (cuDNN needs it then)."""
    if getattr(options, "has_seqlens", True):
        return True
    return q_seq > kv_seq and (options.causal == 2 or options.window_left >= 0)


def _device_ordinal() -> int:
    try:
        dev = jax.local_devices(backend="gpu")[0]
        hw = getattr(dev, "local_hardware_id", None)
        return int(hw) if hw is not None else int(dev.id)
    except Exception:  # pragma: no cover - no GPU
        return 0


def _f32(x: float) -> float:
    """`x` rounded to float32, as the handler's attribute (and the graph key) sees it."""
    return float(np.float32(x))


def unavailable(problem: Problem, platform: str) -> str | None:
    """Why the GPU `flash` backend cannot serve `problem`, or None when it can."""
    a, o = problem.arrays, problem.options
    if not _ffi.has_target(FWD_TARGET, platform):
        return (
            "this build of attnaux has no CUDA handlers "
            f"({_ffi.CUDA_IMPORT_ERROR or _NOT_BUILT})"
        )
    dtype = jnp.dtype(a.q.dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return (
            f"cuDNN fused attention takes bfloat16 or float16 inputs, got {dtype.name} "
            "(cast q, k and v to bfloat16 to use it)"
        )
    if o.softcap > 0 and a.bias is not None:
        return _SOFTCAP_BIAS_WHY
    _, _, _, qk_dim = a.q.shape
    v_dim = a.v.shape[-1]
    for name, dim in (("qk_dim", qk_dim), ("v_dim", v_dim)):
        if dim % 8 != 0 or not 8 <= dim <= MAX_HEAD_DIM:
            return f"cuDNN needs head dims that are multiples of 8 in [8, 256]; got {name}={dim}"
    bsz, q_seq, q_heads, _ = a.q.shape
    kv_seq, kv_heads = a.k.shape[1], a.k.shape[2]
    if 0 in (bsz, q_seq, kv_seq, q_heads):
        return None  # zero-sized: answered without cuDNN
    masked = a.q_segment_ids is not None or a.mask is not None
    cfg = _config(o, q_seq, kv_seq, with_max=True, masked=masked, bias=a.bias is not None)
    bias_b, bias_h = _bias_dims(a, bsz)
    why, _ = _check(cfg, dtype.name, bsz, q_heads, kv_heads, q_seq, kv_seq, qk_dim, v_dim,
                    bias_b, bias_h)
    return why or None


@functools.lru_cache(maxsize=4096)
def _plan(cfg: "Config", backward: bool, dtype: str, bsz, q_heads, kv_heads, q_seq, kv_seq,
          qk_dim, v_dim, bias_b, bias_h, try_f32_bias: bool,
          rng_dump: bool = False, total_q: int = 0, total_kv: int = 0) -> tuple[str, bool, int]:
    """Builds (once: the C++ cache keeps it) the cuDNN graph of one call and returns `(reason or
    "", whether it takes the bias in float32, workspace bytes)`. Packed sequences (`cfg.ragged`)
    also take the tokens of q and of k/v, which size a backward's accumulators."""
    return _ffi.ext_cuda().check_support(
        _device_ordinal(), 0 if dtype == "bfloat16" else 1, bsz, q_heads, kv_heads, q_seq,
        kv_seq, qk_dim, v_dim, bias_b, bias_h, cfg.padding, cfg.causal, cfg.window_left,
        cfg.window_right, _f32(cfg.scale), backward, cfg.with_max, try_f32_bias,
        softcap=_f32(cfg.softcap), dropout=_f32(cfg.dropout_rate), rng_dump=rng_dump,
        composite=cfg.composite, bias_grad=cfg.bias_grad, ragged=cfg.ragged,
        total_q=total_q if cfg.ragged else 0, total_kv=total_kv if cfg.ragged else 0,
    )


@functools.lru_cache(maxsize=4096)
def _check(cfg: "Config", dtype: str, bsz, q_heads, kv_heads, q_seq, kv_seq, qk_dim, v_dim,
           bias_b, bias_h, total_q: int = 0, total_kv: int = 0) -> tuple[str, bool]:
    """Whether cuDNN serves the forward and the backward of this static configuration (asked once;
    the graphs stay cached, so the kernels find them): `(reason or "", bias in float32?)`. A bias
    goes in float32 when both graphs take it so, else in the input dtype; the bias made of a mask
    or segment ids alone (0 / -inf, exact in any dtype) always in the input dtype (half the bytes
    of float32)."""
    shapes = (dtype, bsz, q_heads, kv_heads, q_seq, kv_seq, qk_dim, v_dim, bias_b, bias_h)
    why, fwd_f32, _ = _plan(cfg, False, *shapes, cfg.bias_grad)
    if why:
        return why, True
    why, bwd_f32, _ = _plan(cfg, True, *shapes, fwd_f32, total_q=total_q, total_kv=total_kv)
    if why:
        return why, True
    if fwd_f32 and not bwd_f32:
        why, _, _ = _plan(cfg, False, *shapes, False)
        if why:
            return why, True
    return "", fwd_f32 and bwd_f32


def _workspace(cfg: "Config", backward: bool, q, k, v, bias,
               rng_dump: bool = False) -> jax.ShapeDtypeStruct:
    """The workspace output of the FFI call: `(0,)` (cuDNN's workspace then comes from XLA's
    scratch allocator), or a buffer of the plan's size with ATTNAUX_CUDNN_WORKSPACE=output.
    Raises if cuDNN cannot build the graph."""
    bias_b, bias_h = (bias.shape[0], bias.shape[1]) if present(bias) else (0, 0)
    why, _, size = _plan(cfg, backward, jnp.dtype(q.dtype).name, q.shape[0], q.shape[2],
                         k.shape[2], q.shape[1], k.shape[1], q.shape[3], v.shape[3], bias_b,
                         bias_h, (not present(bias)) or bias.dtype == jnp.float32, rng_dump)
    if why:
        raise ValueError(f"backend='flash' (cuDNN) cannot run this call: {why}")
    size = max(int(size), 1) if _workspace_mode() == "output" else 0
    return jax.ShapeDtypeStruct((size,), jnp.uint8)


def _config(options: Options, q_seq: int, kv_seq: int, *, with_max: bool,
            masked: bool = False, bias: bool = False) -> Config:
    """The static configuration of a call; `masked`: a boolean mask or segment ids, `bias`:
    whether the call has a bias (without one, the bias made of the mask is a constant)."""
    return Config(
        scale=float(options.scale),
        causal=int(options.causal),
        window_left=int(options.window_left),
        window_right=int(options.window_right),
        padding=padding_needed(options, q_seq, kv_seq),
        with_max=bool(with_max),
        softcap=float(options.softcap),
        dropout_rate=float(options.dropout_rate),
        masked=bool(masked),
        bias_grad=bool(bias) or not masked,
        fold_lse=bool(FOLD_LSE_COTANGENT),
        fold_kernel=bool(FOLD_WITH_KERNEL) and _ffi.has_target(FOLD_TARGET, "cuda"),
    )


def _bias_dims(a: Canonical, bsz: int) -> tuple[int, int]:
    """The batch and head dims (1 or full) of the bias cuDNN gets, `(0, 0)` for none: the call's
    bias, with the boolean mask and the segment ids folded in."""
    parts = [x.shape[:2] for x in (a.bias, a.mask) if x is not None]
    if a.q_segment_ids is not None:
        parts.append((bsz, 1))
    if not parts:
        return 0, 0
    return max(p[0] for p in parts), max(p[1] for p in parts)


def _masked_bias(a: Canonical, bias, dtype, bsz: int, q_seq: int, kv_seq: int) -> jax.Array:
    """The boolean mask and the segment ids as a bias (`_bias_dims`' dims, `dtype`): `bias`
    (`[1|B, 1|Hq, Sq, Skv]`, or None for 0) where the mask is True and `q_segment_ids[b, i] ==
    kv_segment_ids[b, j]`, -inf elsewhere (cuDNN's P is 0 there)."""
    keep = a.mask
    if a.q_segment_ids is not None:
        q_seg, kv_seg = (x.astype(jnp.int32) for x in (a.q_segment_ids, a.kv_segment_ids))
        same = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]  # [B, 1, Sq, Skv]
        keep = same if keep is None else keep & same
    shape = (*_bias_dims(a, bsz), q_seq, kv_seq)
    keep = jnp.broadcast_to(keep, shape)
    hidden = jnp.asarray(-jnp.inf, dtype)
    if bias is None:
        return jnp.where(keep, jnp.asarray(0, dtype), hidden)
    return jnp.where(keep, jnp.broadcast_to(bias, shape), hidden)


def _attrs(cfg: Config) -> dict:
    # The attention attributes of every kernel (Config has those fields), cuDNN's padding and
    # the packed layout.
    return dict(attention_attrs(cfg), padding=np.int32(cfg.padding),
                ragged=np.int32(cfg.ragged), max_seqlen_q=np.int64(cfg.max_seqlen_q),
                max_seqlen_kv=np.int64(cfg.max_seqlen_kv))


# ------------------------------------------------------------------------------------------------
# The two FFI targets. Under vmap the kernel-call layer folds the mapped axis into the batch (one
# launch), materialising the bias over it (its gradient comes back per element); with dropout it
# maps one element after another (folding would move each element's rows to other batch indices
# of cuDNN's mask, so `vmap(f)(x)[n]` would differ from `f(x[n])` and from the replayed mask).
# ------------------------------------------------------------------------------------------------
_OPERANDS = (("q", BATCH), ("k", BATCH), ("v", BATCH), ("bias", BROADCAST), ("q_len", BATCH),
             ("kv_len", BATCH), ("rng", SHARED), ("offsets", SHARED))
_BACKWARD_EXTRA = (("out", BATCH), ("dout", BATCH), ("stats", BATCH))


@functools.cache
def _ops(cfg: Config) -> tuple[KernelOp, KernelOp]:
    def forward_shapes(ops):
        q, k, v, bias = ops["q"], ops["k"], ops["v"], ops["bias"]
        bsz, q_seq, q_heads, _ = q.shape
        stats = jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32)
        row_max = stats if cfg.with_max else jax.ShapeDtypeStruct((0,), jnp.float32)
        return (jax.ShapeDtypeStruct((bsz, q_seq, q_heads, v.shape[-1]), q.dtype), stats,
                row_max, jax.ShapeDtypeStruct((0,), jnp.float32),
                _workspace(cfg, False, q, k, v, bias))

    def backward_shapes(ops):
        q, k, v, bias = ops["q"], ops["k"], ops["v"], ops["bias"]
        wanted = present(bias) and cfg.bias_grad  # else dbias is (0,): no gradient written
        return (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(bias.shape if wanted else (0,), bias.dtype),
            _workspace(cfg, True, q, k, v, bias),
        )

    forward = KernelOp(
        FWD_TARGET, _OPERANDS, ("out", "stats", "max", "rng_dump", "workspace"), forward_shapes,
        dict(with_max=np.int32(cfg.with_max), composite=np.int32(cfg.composite),
             rng_dump=np.int32(0), **_attrs(cfg)),
        returns=("out", "stats", "max"), sequential_if_present=("rng",), dropout=("rng", False),
    )
    backward = KernelOp(
        BWD_TARGET, _OPERANDS + _BACKWARD_EXTRA, ("dq", "dk", "dv", "dbias", "workspace"),
        backward_shapes, _attrs(cfg), returns=("dq", "dk", "dv", "dbias"),
        result_like={"dbias": "bias"}, sequential_if_present=("rng",), dropout=("rng", False),
    )
    return forward, backward


# ------------------------------------------------------------------------------------------------
# Rows with no visible key
# ------------------------------------------------------------------------------------------------
def _visible_rows(cfg: Config, q_len, kv_len, q_seq: int) -> jax.Array:
    """`[B, Sq]` bool: query row i is real (i < q_len) and sees at least one key (the mask and
    the segment ids aside: those are judged from cuDNN's row max)."""
    i = jnp.arange(q_seq, dtype=jnp.int32)[None, :]
    ql, kl = q_len[:, None], kv_len[:, None]
    off = kl - ql if cfg.causal == 2 else jnp.zeros_like(ql)
    right = 0 if cfg.causal else cfg.window_right
    lo = jnp.maximum(0, i + off - cfg.window_left) if cfg.window_left >= 0 else jnp.zeros_like(i)
    hi = jnp.minimum(kl - 1, i + off + right) if right >= 0 else kl - 1
    return (i < ql) & (lo <= hi)


_FOLD_MIN_NORM2 = 1e-30  # rows of dO with a smaller squared norm are replaced (`_FOLD_EPS`)
_FOLD_EPS = 2.0**-60  # dO of such a row: EPS in column 0 (its dP = EPS * V[:, 0]: negligible)


def _folds(cfg: Config, dtype) -> bool:
    # bfloat16 has float32's exponent range, which EPS and dlse / EPS need; float16 does not, and
    # takes the extra-column path. So do calls with dropout: there the fold's rounding of O' put
    # dK out of the GPU tests' tolerance (test_dropout_gradients[d256] on an H100).
    return (cfg.fold_lse and cfg.dropout_rate == 0
            and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16))


def fold_lse_cotangent(out: jax.Array, dout: jax.Array, dlse: jax.Array):
    """`(out', dout')`: the lse cotangent folded into the O (and dO) cuDNN's backward reads.

    cuDNN forms the row term `D = rowsum(dO * O)` from the O it is given, and O enters its
    backward nowhere else. `O' = O - (dlse / |dO|^2) dO` has `rowsum(dO * O') = D - dlse`, so
    one plain backward call gives `dS = P * (dP - (D - dlse))`: the gradient through `aux.lse`
    at the cost of one elementwise pass, with no extra columns (which cost copies of O, dO and V
    and cuDNN's slower `v_dim + 8` kernels). O' is rounded to the input dtype: the row term then
    carries that dtype's relative rounding error on `sum |dO * O| + |dlse|`, as a bf16
    backward's other terms do. Rows with `dlse = 0` keep O exactly.

    A row whose dO is 0 (its output not in the loss) cannot carry `dlse` through O: its dO
    becomes `EPS * e_0` and its `O'[0] = (D - dlse) / EPS`, which adds `EPS * V[:, 0]` (2**-60
    relative) to its dP and to dV. bfloat16 only (`_folds`). `dlse` is `[..., Sq, Hq]` like
    `out`'s rows."""
    d32, o32 = dout.astype(jnp.float32), out.astype(jnp.float32)
    # per-row scalars first (two row reductions), then one elementwise pass writes O' and dO'
    norm2 = jnp.sum(d32 * d32, axis=-1)
    row_term = jnp.sum(d32 * o32, axis=-1)
    carried = dlse != 0
    stuck = carried & (norm2 <= _FOLD_MIN_NORM2)
    gamma = jnp.where(carried & ~stuck, dlse / jnp.where(stuck, 1.0, norm2), 0.0)[..., None]
    column = ((row_term - dlse) / _FOLD_EPS)[..., None]
    first = jnp.arange(out.shape[-1]) == 0
    stuck = stuck[..., None]
    out_f = jnp.where(stuck, jnp.where(first, column, o32), o32 - gamma * d32).astype(out.dtype)
    dout_f = jnp.where(stuck, jnp.where(first, _FOLD_EPS, 0.0), d32).astype(dout.dtype)
    return out_f, dout_f


def _fold_layout(name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    del shape
    return (BATCH_DIM, "q_seq", HEADS) if name == "dlse" else (BATCH_DIM, "q_seq", HEADS, "v_dim")


_FOLD_OP = KernelOp(
    FOLD_TARGET, (("out", BATCH), ("dout", BATCH), ("dlse", BATCH)), ("out_f", "dout_f"),
    lambda ops: (jax.ShapeDtypeStruct(ops["out"].shape, ops["out"].dtype),
                 jax.ShapeDtypeStruct(ops["dout"].shape, ops["dout"].dtype)),
    {}, aliases={1: 1}, layout=_fold_layout,
)


def _fold(cfg: Config, out: jax.Array, dout: jax.Array, dlse: jax.Array):
    """`fold_lse_cotangent`, through the CUDA kernel where `cfg` says so (same semantics)."""
    if not cfg.fold_kernel:
        return fold_lse_cotangent(out, dout, dlse)
    r = _FOLD_OP(out=out, dout=dout, dlse=dlse.astype(jnp.float32))
    return r["out_f"], r["dout_f"]


def backward_with_columns(call, k, v, out, dout, parts):
    """The gradients with the lse cotangent through extra columns (exact; `Dv + 8` columns).

    `call(v, out, dout)` runs cuDNN's backward and returns `(dq, dk, dv, ...)`; `parts` is
    `-dlse` split into three input-dtype parts per row (`_split3`), shaped like `out`'s rows.
    `O' = [O, parts]`, `dO' = [dO, 1]`, `V' = [V, 0]` gives `rowsum(dO' * O') = D - dlse` while
    `dO' . V'^T = dO . V^T`. Without room for the columns (`Dv + 8 > 256`), a second backward with
    `O = parts`, `dO = 1`, `V = 0` has dP = 0 and D = -dlse, so its dS = P * dlse exactly (with or
    without dropout); its gradients, dV aside, are added to the first call's."""
    extra, v_dim = _EXTRA_COLUMNS, v.shape[-1]
    pad = jnp.zeros((*parts.shape[:-1], extra - 3), parts.dtype)
    if v_dim + extra <= MAX_HEAD_DIM:
        out_x = jnp.concatenate([out, parts, pad], axis=-1)
        dout_x = jnp.concatenate([dout, jnp.ones_like(parts), pad], axis=-1)
        v_x = jnp.concatenate([v, jnp.zeros((*v.shape[:-1], extra), v.dtype)], axis=-1)
        dq, dk, dv, *rest = call(v_x, out_x, dout_x)
        return (dq, dk, dv[..., :v_dim], *rest)
    grads = call(v, out, dout)
    o_1 = jnp.concatenate([parts, pad], axis=-1)
    do_1 = jnp.concatenate([jnp.ones_like(parts), pad], axis=-1)
    more = call(jnp.zeros((*k.shape[:3], extra), v.dtype), o_1, do_1)
    return tuple(
        g if i == 2 or not present(g)
        else (g.astype(jnp.float32) + g1.astype(jnp.float32)).astype(g.dtype)
        for i, (g, g1) in enumerate(zip(grads, more, strict=True))
    )


def _split3(x: jax.Array, dtype) -> jax.Array:
    """float32 `x` as three `dtype` parts whose float32 sum is `x` to ~24 bits: [..., 3]."""
    hi = x.astype(dtype)
    r = x - hi.astype(jnp.float32)
    mid = r.astype(dtype)
    lo = (r - mid.astype(jnp.float32)).astype(dtype)
    return jnp.stack([hi, mid, lo], axis=-1)


# ------------------------------------------------------------------------------------------------
# The differentiable core
# ------------------------------------------------------------------------------------------------
def _forward(cfg: Config, q, k, v, bias, q_len, kv_len, rng):
    if cfg.forward_kernel is not None:
        # plain attention where every row sees a key (`_dispatch.gpu_forward_on_hopper`):
        # out, lse and max as cuDNN's, and lse is what cuDNN's backward takes as its stats
        out, lse, row_max = cfg.forward_kernel(cfg, q, k, v)
        return out, lse, row_max, lse
    r = _ops(cfg)[0](q=q, k=k, v=v, bias=bias, q_len=q_len, kv_len=kv_len, rng=rng,
                     offsets=absent(jnp.int32))
    out, stats, row_max = r["out"], r["stats"], r["max"]
    if cfg.with_max:  # cuDNN gave Max and Sum_exp
        lse = row_max + jnp.log(stats)
    else:  # cuDNN gave its Stats (lse) alone
        lse = row_max = stats
    stats = lse
    if cfg.padding or cfg.masked:
        r = jnp.ones(lse.shape, bool)
        if cfg.padding:
            r &= _visible_rows(cfg, q_len, kv_len, q.shape[1])[:, None, :]
        if cfg.masked:
            # A query that the mask or its segment leaves no key: cuDNN's row max stays -inf
            # (NaN counts as not seen as well).
            r &= row_max > -jnp.inf
        out = jnp.where(r.transpose(0, 2, 1)[..., None], out, 0)
        stats = jnp.where(r, lse, jnp.inf)  # recomputed P = exp(s - inf) = 0 for such rows
        lse = jnp.where(r, lse, -jnp.inf)
        row_max = jnp.where(r, row_max, -jnp.inf)
    return out, lse, row_max, stats


def _core_fwd(cfg: Config, differentiating: bool, *args):
    out, lse, row_max, stats = _forward(cfg, *args)
    return (out, lse, row_max), (args, out, stats)


def _core_bwd(cfg: Config, residuals, cotangents):
    (q, k, v, bias, q_len, kv_len, rng), out, stats = residuals
    dout, dlse, _ = cotangents  # the row max carries no gradient; absent ones are None
    no_out, no_lse = dout is None, dlse is None
    if no_out and no_lse:
        return (None,) * 7
    dout = jnp.zeros_like(out) if no_out else dout.astype(out.dtype)
    if not no_lse:
        dlse = dlse.astype(jnp.float32)
    if cfg.backward_kernel is not None:  # plain attention: every row sees a key, stats is lse
        dq, dk, dv = cfg.backward_kernel(cfg, q, k, v, out, stats, dout,
                                         jnp.zeros_like(stats) if no_lse else dlse)
        return (dq, dk, dv, None, None, None, None)
    q_seq, kv_seq = q.shape[1], k.shape[1]
    if cfg.padding or cfg.masked:
        visible = stats < jnp.inf  # [B, Hq, Sq]: the forward set +inf for rows seeing nothing
        dout = jnp.where(visible.transpose(0, 2, 1)[..., None], dout, 0)
        if not no_lse:
            dlse = jnp.where(visible, dlse, 0.0)
    backward_op = _ops(cfg)[1]

    def call(v, out, dout):
        r = backward_op(q=q, k=k, v=v, bias=bias, q_len=q_len, kv_len=kv_len, rng=rng,
                        offsets=absent(jnp.int32), out=out, dout=dout, stats=stats)
        return r["dq"], r["dk"], r["dv"], r["dbias"]

    if no_lse:
        dq, dk, dv, dbias = call(v, out, dout)
    elif no_out or not _folds(cfg, out.dtype):
        parts = _split3(-dlse, q.dtype).transpose(0, 2, 1, 3)  # [B, Sq, Hq, 3], sum = -dlse
        dq, dk, dv, dbias = backward_with_columns(call, k, v, out, dout, parts)
    else:
        folded, dout_f = _fold(cfg, out, dout, dlse.transpose(0, 2, 1))
        dq, dk, dv, dbias = call(v, folded, dout_f)
    if cfg.padding:
        q_rows = jnp.arange(q_seq)[None, :] < q_len[:, None]
        kv_rows = (jnp.arange(kv_seq)[None, :] < kv_len[:, None])[:, :, None, None]
        dq = jnp.where(q_rows[:, :, None, None], dq, 0)
        dk = jnp.where(kv_rows, dk, 0)
        dv = jnp.where(kv_rows, dv, 0)
        # dbias needs nothing: cuDNN's dS is 0 at padded rows (lse = +inf) and masked keys, and
        # the handler zeroes dbias first in case cuDNN skips them.
    # no gradient for a constant bias (made of a mask or segment ids alone)
    return (dq, dk, dv, dbias if present(dbias) else None, None, None, None)


_core = compiled_vjp(_core_fwd, _core_bwd)


def _prepare(arrays: Canonical, options: Options, *, with_max: bool = True,
             composite: bool = False):
    """`(cfg, (q, k, v, bias, q_len, kv_len, rng))`: the static configuration of a (non-empty)
    call and the operands of its cuDNN graphs: hidden and padding rows zeroed, the mask and
    the segment ids folded into the bias."""
    q, k, v = arrays.q, arrays.k, arrays.v
    bsz, q_seq, q_heads, _ = q.shape
    kv_seq, v_dim = k.shape[1], v.shape[-1]
    masked = arrays.q_segment_ids is not None or arrays.mask is not None
    if masked:
        # Rows hidden by the mask or the segment ids still enter cuDNN's products with weight 0
        # (0 * NaN): zero them first, as the CPU kernels do.
        arrays = zero_hidden_rows(arrays, options)
        q, k, v = arrays.q, arrays.k, arrays.v
    cfg = _config(options, q_seq, kv_seq, with_max=with_max, masked=masked,
                  bias=arrays.bias is not None)
    cfg = cfg._replace(composite=bool(composite))
    bias = arrays.bias
    if bias is None and not masked:
        bias = absent(jnp.float32)
    else:  # cuDNN broadcasts batch and heads; the sequence dims are materialised
        served = cfg._replace(with_max=True, composite=False)  # the graphs `unavailable` built
        _, bias_f32 = _check(served, jnp.dtype(q.dtype).name, bsz, q_heads, k.shape[2], q_seq,
                             kv_seq, q.shape[-1], v_dim, *_bias_dims(arrays, bsz))
        # float32 when cuDNN takes it, else rounded to the input dtype (its gradient comes back
        # in that dtype and flows to the float32 bias through the cast)
        dtype = jnp.float32 if bias_f32 else q.dtype
        if bias is not None:
            bias = jnp.broadcast_to(
                bias.astype(dtype), (bias.shape[0], bias.shape[1], q_seq, kv_seq)
            )
        if masked:  # (its gradient flows to the call's bias through the selection)
            bias = _masked_bias(arrays, bias, dtype, bsz, q_seq, kv_seq)
    q_len = jnp.clip(arrays.q_seqlens.astype(jnp.int32), 0, q_seq)
    kv_len = jnp.clip(arrays.kv_seqlens.astype(jnp.int32), 0, kv_seq)
    if cfg.padding:
        # cuDNN's tiles may still load rows past the lengths (0 * NaN = NaN in P @ V): padding
        # never reaches it. Gradients of these rows are 0 through the selection.
        q_rows = (jnp.arange(q_seq)[None, :] < q_len[:, None])[:, :, None, None]
        kv_rows = (jnp.arange(kv_seq)[None, :] < kv_len[:, None])[:, :, None, None]
        q = jnp.where(q_rows, q, 0)
        k = jnp.where(kv_rows, k, 0)
        v = jnp.where(kv_rows, v, 0)
    rng = arrays.rng_state if cfg.dropout_rate > 0 else jnp.zeros((0,), jnp.uint32)
    return cfg, (q, k, v, bias, q_len, kv_len, rng)


def flash_attention_cuda(
    arrays: Canonical, options: Options, *, with_max: bool = True, composite: bool = False,
    forward_kernel: Callable | None = None, backward_kernel: Callable | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(out [B,Sq,Hq,Dv], lse [B,Hq,Sq], max [B,Hq,Sq])` through cuDNN (`unavailable` is None).

    `forward_kernel` (the dispatch's `FLASH_HOPPER_FORWARD`, where `gpu_forward_on_hopper`
    holds: attnaux's Hopper kernel) runs the forward instead of cuDNN's, `(cfg, q, k, v) ->
    (out, lse, max)`, and cuDNN's backward differentiates it from its out and lse.
    `backward_kernel` (where `gpu_backward_on_cuda` holds: attnaux's CUDA C++ Hopper backward)
    runs the backward instead of cuDNN's, from the forward's out and lse, `(cfg, q, k, v, out,
    lse, dout, dlse) -> (dq, dk, dv)`.

    `with_max=False` asks cuDNN for its Stats (lse) alone and returns lse in place of max, and
    `composite=True` pins cuDNN's composite SDPA implementation for the forward (the frontend
    otherwise picks, and may pick its "unified" one for a Stats-only graph); both exist to
    measure what the max costs (benchmarks/gpu_flash.py).
    """
    q, k, v = arrays.q, arrays.k, arrays.v
    bsz, q_seq, q_heads, _ = q.shape
    kv_seq, v_dim = k.shape[1], v.shape[-1]
    if 0 in (bsz, q_seq, q_heads, kv_seq):
        # Nothing for cuDNN to do: every row (if any) sees no key.
        out = jnp.zeros((bsz, q_seq, q_heads, v_dim), q.dtype)
        none = jnp.full((bsz, q_heads, q_seq), -jnp.inf, jnp.float32)
        lse = none
        if arrays.sink is not None:
            out, lse = add_sink(out, none, arrays.sink)
        return out, lse, none
    cfg, core_args = _prepare(arrays, options, with_max=with_max, composite=composite)
    cfg = cfg._replace(forward_kernel=forward_kernel, backward_kernel=backward_kernel)
    out, lse, row_max = _core(cfg, *core_args)
    if arrays.sink is not None:
        out, lse = add_sink(out, lse, arrays.sink)
    return out, lse, row_max


def run(arrays: Canonical, options: Options, return_probs: bool, *,
        forward_kernel: Callable | None = None, backward_kernel: Callable | None = None):
    """`(out, lse, max, None)` through cuDNN: the dispatch's entry (see `flash_attention_cuda`)."""
    del return_probs  # flash saves no probabilities (the dispatch never asks it to)
    return (*flash_attention_cuda(arrays, options, forward_kernel=forward_kernel,
                                  backward_kernel=backward_kernel), None)


FOLLOWS_BLOCK_STATE = False
"""cuDNN's masks are static graph attributes: a block call cannot take the diagonal shift (or
the dropout origin) of a 12-word block state, so context parallelism gives it static calls
(`parallel._ring._band`: a block, or a slice of it, under a static causal / window band) and no
dropout."""


def block_backward(arrays: Canonical, options: Options, out, lse, dout, dlse):
    """`(dq, dk, dv)` of one block of a larger attention (context parallelism): cuDNN's backward
    with the *whole* problem's `out` and `lse` as its residuals, so that it recomputes the whole
    problem's probabilities on this block's keys and the row term `rowsum(dout * out) - dlse`:
    the block's exact share of the gradients (rows that see no key at all get lse = +inf, so
    P = 0). The zeroing of hidden and padding rows is differentiated like the forward's."""
    config = []  # the static configuration, found while preparing (once)

    def prepared(q, k, v):
        cfg, (q, k, v, *rest) = _prepare(arrays._replace(q=q, k=k, v=v), options)
        config.append(cfg)
        return (q, k, v), tuple(rest)

    (q, k, v), undo, (bias, q_len, kv_len, rng) = jax.vjp(
        prepared, arrays.q, arrays.k, arrays.v, has_aux=True
    )
    cfg = config[0]
    stats = jnp.where(jnp.isfinite(lse), lse, jnp.inf)
    grads = _core_bwd(cfg, ((q, k, v, bias, q_len, kv_len, rng), out, stats),
                      (dout, dlse, None))
    return undo(tuple(g.astype(x.dtype) for g, x in zip(grads[:3], (q, k, v))))


# ------------------------------------------------------------------------------------------------
# Dropout mask replay
# ------------------------------------------------------------------------------------------------
def cudnn_dropout_keep_mask(
    rng_state: jax.Array, rate: float, batch: int, q_heads: int, kv_heads: int, q_seq: int,
    kv_seq: int, qk_dim: int, dtype,
) -> jax.Array:
    """The `bool[batch, q_heads, q_seq, kv_seq]` keep-mask cuDNN draws for `rng_state` and `rate`,
    through its RNG dump: a forward graph of these shapes with dropout, run on zeros, that also
    writes the mask it applied. cuDNN's Philox counters depend on the (batch, head, row, column)
    of each entry and on the shapes, not on the data or on the masks, which is what makes the
    replay exact (tests/test_gpu_flash.py checks it against the outputs of real calls)."""
    if not _ffi.has_target(FWD_TARGET, "gpu"):
        raise ValueError(
            "this aux was made by cuDNN (dropout_impl='cudnn'), and replaying cuDNN's mask needs "
            "attnaux's CUDA handlers, which this build lacks "
            f"({_ffi.CUDA_IMPORT_ERROR or _NOT_BUILT})."
        )
    shape = (batch, q_heads, q_seq, kv_seq)
    if 0 in shape:
        return jnp.zeros(shape, bool)
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        dtype = jnp.dtype(jnp.bfloat16)  # the mask does not depend on the dtype of the data
    cfg = Config(scale=1.0, causal=0, window_left=-1, window_right=-1, padding=False,
                 with_max=True, dropout_rate=float(rate))
    q = jnp.zeros((batch, q_seq, q_heads, qk_dim), dtype)
    k = jnp.zeros((batch, kv_seq, kv_heads, qk_dim), dtype)
    bias = jnp.zeros((0,), jnp.float32)
    stats = jax.ShapeDtypeStruct((batch, q_heads, q_seq), jnp.float32)
    call = jax.ffi.ffi_call(
        FWD_TARGET,
        (jax.ShapeDtypeStruct((batch, q_seq, q_heads, qk_dim), dtype), stats, stats,
         jax.ShapeDtypeStruct(shape, jnp.float32),
         _workspace(cfg, False, q, k, k, bias, rng_dump=True)),
        vmap_method="sequential",
    )
    lens = jnp.zeros((batch,), jnp.int32)
    dump = call(q, k, k, bias, lens, lens, jnp.asarray(rng_state, jnp.uint32), absent(jnp.int32),
                with_max=np.int32(1), composite=np.int32(0), rng_dump=np.int32(1),
                **_attrs(cfg))[3]
    return dump > 0.5



# ------------------------------------------------------------------------------------------------
# Packed sequences (`attnaux.varlen_attention`): cuDNN's ragged (THD) layout
# ------------------------------------------------------------------------------------------------
# q, k and v stay packed, `[1, tokens, heads, dim]`: cuDNN reads sequence i from the element
# offset `offsets[i]` of each tensor, with the padded sizes `max_seqlen_*` and the lengths as its
# padding mask, so nothing is gathered, padded or scattered, and the graph does not depend on the
# number of tokens. It writes only the tokens some sequence covers: `attnaux_zero_rows` then sets
# the outputs and gradients of the other tokens (and of rows that see no key) to 0, touching only
# those rows. The statistics come per sequence, `[num_seqs, q_heads, max_seqlen_q]`.
ZERO_ROWS_TARGET = "attnaux_zero_rows"
_OFFSET_ROW = 8  # each row of the offsets operand padded to a multiple of 8 int32 (32 bytes)
_INT32_MAX = 2**31 - 1

_RAGGED_LAYOUTS = {
    "q": ("one", "q_tokens", HEADS, "qk_dim"), "dq": ("one", "q_tokens", HEADS, "qk_dim"),
    "k": ("one", "kv_tokens", KV_HEADS, "qk_dim"), "dk": ("one", "kv_tokens", KV_HEADS, "qk_dim"),
    "v": ("one", "kv_tokens", KV_HEADS, "v_dim"), "dv": ("one", "kv_tokens", KV_HEADS, "v_dim"),
    "out": ("one", "q_tokens", HEADS, "v_dim"), "dout": ("one", "q_tokens", HEADS, "v_dim"),
    "stats": ("seqs", HEADS, "q_seq"), "max": ("seqs", HEADS, "q_seq"),
    "q_len": ("seqs",), "kv_len": ("seqs",), "q_offsets": ("bounds",), "kv_offsets": ("bounds",),
    "q_keep": ("q_tokens",), "kv_keep": ("kv_tokens",),
}


def _ragged_layout(name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    """The dims of the packed-layout operands: heads may be sharded, tokens and sequences not."""
    del shape
    return _RAGGED_LAYOUTS[name]


def _element_offsets(q_offsets, kv_offsets, q, k, v, out_dim: int) -> jax.Array:
    """int32 `[4, R]`: the element offset of each sequence in q, k, v and out (R >= num_seqs + 1,
    rows padded for alignment), from the token offsets and this device's head counts."""
    rows = [q_offsets * (q.shape[2] * q.shape[3]), kv_offsets * (k.shape[2] * k.shape[3]),
            kv_offsets * (v.shape[2] * v.shape[3]), q_offsets * (q.shape[2] * out_dim)]
    width = -(-q_offsets.shape[0] // _OFFSET_ROW) * _OFFSET_ROW
    table = jnp.stack(rows).astype(jnp.int32)
    return jnp.pad(table, ((0, 0), (0, width - table.shape[1])), mode="edge")


def _zero_rows(x: jax.Array, keep: jax.Array) -> jax.Array:
    """`x` `[1, T, ...]` with the rows of tokens where `keep` is False set to 0, in place."""
    flat = x.reshape(x.shape[1], -1)
    call = jax.ffi.ffi_call(ZERO_ROWS_TARGET, jax.ShapeDtypeStruct(flat.shape, flat.dtype),
                            input_output_aliases={0: 0})
    return call(flat, keep).reshape(x.shape)


def _ragged_workspace(cfg: Config, backward: bool, num_seqs: int, q, k, v) -> jax.ShapeDtypeStruct:
    why, _, size = _plan(cfg, backward, jnp.dtype(q.dtype).name, num_seqs, q.shape[2],
                         k.shape[2], cfg.max_seqlen_q, cfg.max_seqlen_kv, q.shape[3], v.shape[3],
                         0, 0, True, total_q=q.shape[1], total_kv=k.shape[1])
    if why:
        raise ValueError(f"backend='flash' (cuDNN) cannot run these packed sequences: {why}")
    size = max(int(size), 1) if _workspace_mode() == "output" else 0
    return jax.ShapeDtypeStruct((size,), jnp.uint8)


_RAGGED_FORWARD = ("q", "k", "v", "q_len", "kv_len", "q_offsets", "kv_offsets", "q_keep")
_RAGGED_BACKWARD = (*_RAGGED_FORWARD, "kv_keep", "out", "dout", "stats")


@functools.cache
def _ragged_ops(cfg: Config) -> tuple[KernelOp, KernelOp]:
    attrs = _attrs(cfg)
    none_f32 = (0,)  # the absent keep-mask and dbias results

    def forward_shapes(ops):
        q, v, n = ops["q"], ops["v"], ops["q_len"].shape[0]
        rows = jax.ShapeDtypeStruct((n, q.shape[2], cfg.max_seqlen_q), jnp.float32)
        return (jax.ShapeDtypeStruct((*q.shape[:3], v.shape[-1]), q.dtype), rows, rows)

    def forward(q, k, v, q_len, kv_len, q_offsets, kv_offsets, q_keep):
        out, rows, _ = forward_shapes(dict(q=q, v=v, q_len=q_len))
        call = jax.ffi.ffi_call(FWD_TARGET, (
            out, rows, rows, jax.ShapeDtypeStruct(none_f32, jnp.float32),
            _ragged_workspace(cfg, False, q_len.shape[0], q, k, v)))
        offsets = _element_offsets(q_offsets, kv_offsets, q, k, v, v.shape[-1])
        out, sum_exp, row_max, _, _ = call(
            q, k, v, absent(jnp.float32), q_len, kv_len, absent(jnp.uint32), offsets,
            with_max=np.int32(cfg.with_max), composite=np.int32(0), rng_dump=np.int32(0),
            **attrs)
        return _zero_rows(out, q_keep), sum_exp, row_max

    def backward_shapes(ops):
        return tuple(jax.ShapeDtypeStruct(ops[n].shape, ops[n].dtype) for n in ("q", "k", "v"))

    def backward(q, k, v, q_len, kv_len, q_offsets, kv_offsets, q_keep, kv_keep, out, dout,
                 stats):
        dq, dk, dv = backward_shapes(dict(q=q, k=k, v=v))
        call = jax.ffi.ffi_call(BWD_TARGET, (
            dq, dk, dv, jax.ShapeDtypeStruct(none_f32, jnp.float32),
            _ragged_workspace(cfg, True, q_len.shape[0], q, k, v)))
        offsets = _element_offsets(q_offsets, kv_offsets, q, k, v, out.shape[-1])
        dq, dk, dv, _, _ = call(q, k, v, absent(jnp.float32), q_len, kv_len,
                                absent(jnp.uint32), offsets, out, dout, stats, **attrs)
        return _zero_rows(dq, q_keep), _zero_rows(dk, kv_keep), _zero_rows(dv, kv_keep)

    ops = tuple(
        KernelOp(target, tuple((name, SHARED) for name in names), results, shapes, {},
                 layout=_ragged_layout, kernel=kernel, sequential=True)
        for target, names, results, shapes, kernel in (
            (FWD_TARGET, _RAGGED_FORWARD, ("out", "stats", "max"), forward_shapes, forward),
            (BWD_TARGET, _RAGGED_BACKWARD, ("dq", "dk", "dv"), backward_shapes, backward),
        )
    )
    return ops[0], ops[1]


def _ragged_fwd(cfg: Config, differentiating: bool, q, k, v, q_len, kv_len, q_offsets,
                kv_offsets, q_keep, kv_keep):
    args = (q, k, v, q_len, kv_len, q_offsets, kv_offsets, q_keep, kv_keep)
    if cfg.forward_kernel is not None:
        # attnaux's CUDA forward over the packed tokens (`_hopper_packed.cuda_forward`): out,
        # lse and max per token `[1, Hq, Tq]`, every row written (a row that sees no key, or
        # that no sequence covers: 0, -inf, -inf; the lengths follow from the offsets and
        # `max_seqlen_*`, as `q_len`/`kv_len` do); when differentiating, also the lse per
        # sequence as cuDNN's backward takes it (its stats, written by the same kernel)
        out, lse, row_max, stats = cfg.forward_kernel(cfg, q, k, v, q_offsets, kv_offsets,
                                                      differentiating)
        return (out, lse, row_max), (args, out, stats)
    r = _ragged_ops(cfg)[0](q=q, k=k, v=v, q_len=q_len, kv_len=kv_len, q_offsets=q_offsets,
                            kv_offsets=kv_offsets, q_keep=q_keep)
    out, sum_exp, row_max = r["out"], r["stats"], r["max"]
    lse = row_max + jnp.log(sum_exp)
    seen = _visible_rows(cfg, q_len, kv_len, cfg.max_seqlen_q)[:, None, :]
    stats = jnp.where(seen, lse, jnp.inf)  # recomputed P = 0 for rows that see nothing
    lse = jnp.where(seen, lse, -jnp.inf)
    row_max = jnp.where(seen, row_max, -jnp.inf)
    return (out, lse, row_max), (args, out, stats)


def _ragged_bwd(cfg: Config, residuals, cotangents):
    (q, k, v, q_len, kv_len, q_offsets, kv_offsets, q_keep, kv_keep), out, stats = residuals
    dout, dlse, _ = cotangents
    nones = (None,) * 6
    if dout is None and dlse is None:
        return (None, None, None, *nones)
    dout = jnp.zeros_like(out) if dout is None else dout.astype(out.dtype)
    backward_op = _ragged_ops(cfg)[1]

    def call(v, out, dout):
        r = backward_op(q=q, k=k, v=v, q_len=q_len, kv_len=kv_len, q_offsets=q_offsets,
                        kv_offsets=kv_offsets, q_keep=q_keep, kv_keep=kv_keep, out=out,
                        dout=dout, stats=stats)
        return r["dq"], r["dk"], r["dv"]

    if dlse is None:
        return (*call(v, out, dout), *nones)
    no_out = cotangents[0] is None
    # The lse cotangent as `_core_bwd` carries it, per token: `dlse` of the token's row of its
    # sequence (0 for padding tokens and rows that see no key: `q_keep` is False there).
    if cfg.forward_kernel is not None:  # the lse came per token
        per_token = jnp.where(q_keep[:, None], dlse[0].T.astype(jnp.float32), 0.0)[None]
    else:
        seq, pos, _ = token_rows(q_offsets, q_len, q.shape[1])
        pos = jnp.clip(pos, 0, cfg.max_seqlen_q - 1)
        dlse = jnp.where(stats < jnp.inf, dlse.astype(jnp.float32), 0.0)
        per_token = jnp.where(q_keep[:, None], dlse[seq, :, pos], 0.0)[None]  # [1, T, Hq]
    dout = jnp.where(q_keep[None, :, None, None], dout, 0)

    if no_out or not _folds(cfg, out.dtype):
        parts = _split3(-per_token, q.dtype)  # [1, T, Hq, 3]
        return (*backward_with_columns(call, k, v, out, dout, parts), *nones)
    folded, dout_f = _fold(cfg, out, dout, per_token)
    return (*call(v, folded, dout_f), *nones)


_ragged_core = compiled_vjp(_ragged_fwd, _ragged_bwd)


def ragged_config(options: Options, max_seqlen_q: int, max_seqlen_kv: int) -> Config:
    """The static configuration of a packed call."""
    cfg = _config(options, max_seqlen_q, max_seqlen_kv, with_max=True)
    return cfg._replace(padding=True, ragged=True, max_seqlen_q=int(max_seqlen_q),
                        max_seqlen_kv=int(max_seqlen_kv))


def ragged_unavailable(options: Options, dtype, num_seqs: int, q_tokens: int, kv_tokens: int,
                       q_heads: int, kv_heads: int, qk_dim: int, v_dim: int, max_seqlen_q: int,
                       max_seqlen_kv: int, platform: str) -> str | None:
    """Why cuDNN's packed layout cannot serve a packed call (None when it can)."""
    if not _ffi.has_target(FWD_TARGET, platform) or not _ffi.has_target(ZERO_ROWS_TARGET,
                                                                         platform):
        return ("this build of attnaux has no CUDA handlers "
                f"({_ffi.CUDA_IMPORT_ERROR or _NOT_BUILT})")
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN fused attention takes bfloat16 or float16 inputs, got {dtype.name}"
    if options.dropout_rate > 0:
        return ("dropout in cuDNN's packed layout draws a mask that `introspect.dropout_mask` "
                "cannot replay; packed calls with dropout run padded per sequence")
    for name, dim in (("qk_dim", qk_dim), ("v_dim", v_dim)):
        if dim % 8 != 0 or not 8 <= dim <= MAX_HEAD_DIM:
            return f"cuDNN needs head dims that are multiples of 8 in [8, 256]; got {name}={dim}"
    widest = max(qk_dim, v_dim + _EXTRA_COLUMNS)
    if max(q_tokens * q_heads, kv_tokens * kv_heads) * widest > _INT32_MAX:
        return "more than 2**31 elements per tensor (cuDNN's ragged offsets are int32)"
    if 0 in (num_seqs, q_tokens, kv_tokens, q_heads):
        return None  # answered without cuDNN
    cfg = ragged_config(options, max_seqlen_q, max_seqlen_kv)
    why, _ = _check(cfg, dtype.name, num_seqs, q_heads, kv_heads, max_seqlen_q, max_seqlen_kv,
                    qk_dim, v_dim, 0, 0, q_tokens, kv_tokens)
    return why or None


def ragged_attention_cuda(q, k, v, *, q_offsets, kv_offsets, q_len, kv_len, q_keep, kv_keep,
                          options: Options, max_seqlen_q: int, max_seqlen_kv: int,
                          forward_kernel: Callable | None = None):
    """`(out [Tq, Hq, Dv], lse, max)` of packed sequences through cuDNN's ragged layout, the
    statistics per sequence `[num_seqs, Hq, max_seqlen_q]` (with `forward_kernel`: per token
    `[Hq, Tq]`, -inf at the tokens that no sequence covers)
    (`ragged_unavailable` is None; no sink: the caller adds it). `*_offsets`: int32 `[n + 1]`
    token offsets, non-decreasing, within the tokens; `*_len`: int32 `[n]`, each at most its
    span and `max_seqlen_*`;
    `q_keep`/`kv_keep`: bool per token, covered by a sequence (and, for queries, seeing a key).
    `forward_kernel`: runs in cuDNN's forward's place (`_hopper_packed.cuda_forward`), cuDNN's
    backward differentiating it; None: cuDNN's forward."""
    cfg = ragged_config(options, max_seqlen_q, max_seqlen_kv)._replace(
        forward_kernel=forward_kernel)
    out, lse, row_max = _ragged_core(cfg, q[None], k[None], v[None], q_len, kv_len, q_offsets,
                                     kv_offsets, q_keep, kv_keep)
    if forward_kernel is not None:
        return out[0], lse[0], row_max[0]
    return out[0], lse, row_max
