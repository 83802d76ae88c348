"""The kernel-call layer: how every compiled backend calls its XLA FFI kernels, written once.

- `KernelOp`: one FFI target whose operands and results are named, each operand with its role
  under batching (`BATCH`: leading dim is the batch; `BROADCAST`: leading dim 1 or the batch, or
  absent; `SHARED`: one per call). Calling it takes and returns arrays by name. Its `custom_vmap`
  rule folds a vmapped axis into the kernel's batch dimension (one launch), and maps the elements
  one after another where folding would change results (dropout, whose counters use the batch
  index; a batched operand that is shared within a call).
- `compiled_vjp`: the `custom_vjp` pattern of every compiled backend (statics not
  differentiated, symbolic zeros arrive as `None`).
- `attention_primitive`: that pattern for a kernel pair with the canonical attention ABI
  (`docs/kernel_abi.md`): residuals, cotangents, and the parameter (bias, sink) gradients.
- `kernel_operands`, `gradient_shapes`, `attention_shapes`: the canonical operands by name and
  the result shapes every attention kernel shares.
- `fixed_order_sum`: reductions whose result does not depend on XLA's threading.

The rest of the layer is `_masking.py` (the masking rules and the hidden-row pass: q and k/v
rows that take part in no visible pair zeroed before a kernel multiplies them) and
`_partition.py` (the sharding rules of every kernel call, `jax.shard_map` and `jax.export`
support). They import nothing else of attnaux, so every backend sits above them.

Absent operands and results are `(0,)` arrays (the kernels' convention).
"""

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.custom_derivatives import SymbolicZero

from ._partition import (
    Layout,
    match_vma,
    partitioned,
    sharded_reduction,
    table_layout,
    unify_vma,
    vma,
)

Canonical = Any  # `_canon.Canonical`: the canonical arrays of a call (read by field)
Options = Any  # `_canon.Options`: its static options (read by field)

BATCH = "batch"  # leading dim is the batch
BROADCAST = "broadcast"  # leading dim 1 or the batch (bias, mask), or absent
SHARED = "shared"  # one per call (sink, dropout state), or absent

CANONICAL_OPERANDS: tuple[tuple[str, str], ...] = (
    ("q", BATCH), ("k", BATCH), ("v", BATCH), ("bias", BROADCAST), ("mask", BROADCAST),
    ("q_seqlens", BATCH), ("kv_seqlens", BATCH), ("q_segment_ids", BATCH),
    ("kv_segment_ids", BATCH), ("sink", SHARED), ("rng_state", SHARED),
)
"""The canonical attention operands, in the kernels' order (`docs/kernel_abi.md`)."""
OPERAND_NAMES = tuple(name for name, _ in CANONICAL_OPERANDS)
_ABSENT_DTYPES = dict(
    bias=jnp.float32, mask=jnp.bool_, q_segment_ids=jnp.int32, kv_segment_ids=jnp.int32,
    sink=jnp.float32, rng_state=jnp.uint32,
)


def absent(dtype) -> jax.Array:
    """The `(0,)` array that stands for an absent operand or result."""
    return jnp.zeros((0,), dtype)


def present(x: jax.Array) -> bool:
    return x.ndim > 1 or x.shape != (0,)


def is_symbolic_zero(ct: Any) -> bool:
    """Whether a cotangent is absent (a symbolic zero under `symbolic_zeros=True`)."""
    return ct is None or isinstance(ct, SymbolicZero)


# ------------------------------------------------------------------------------------------------
# One FFI target, its operands by name, its vmap rule
# ------------------------------------------------------------------------------------------------
Fold = Callable[[int, bool, jax.Array, int], jax.Array]


class KernelOp:
    """An XLA FFI target called with named operands; returns its results by name.

    **Arguments:**

    - `target`: the FFI target's name.
    - `operands`: `(name, role)` pairs in the kernel's argument order; role `BATCH`,
      `BROADCAST` or `SHARED` (see the module docstring).
    - `results`: the result names, in the kernel's order.
    - `shapes`: `shapes(operands) -> tuple[jax.ShapeDtypeStruct, ...]`, one per result, from the
      named operands (arrays or tracers).
    - `attrs`: the kernel's attributes (NumPy scalars, as the FFI wants them).
    - `returns`: the results the call returns (default all); others (a workspace) are dropped.
    - `result_like`: `{result: operand}` for a result shaped like a `BROADCAST` operand (a bias
      gradient): under vmap that operand is materialised over the batch and the result summed
      back where the operand's leading dim was 1.
    - `sequential_if_present`: operands whose presence forbids folding a vmapped axis into the
      batch (the dropout state: its counters use the batch index).
    - `folds`: `{operand: fold(axis_size, batched, x, batch)}` for an operand whose layout the
      roles do not describe.
    - `aliases`: `input_output_aliases` of the call, by position.
    - `layout`: `layout(name, shape) -> labels`, the dims of each operand and result for the
      sharding rules (`_partition.py`; default its table by name).
    - `dropout`: `(operand, follows_global_indices)`: the dropout state, and whether the
      kernel's counter takes a shard's origin (attnaux's kernels) or not (cuDNN's).
    - `kernel`: the call on one device's operands, in place of the plain FFI call (for a kernel
      that reshapes its operands first); returns the `returns` results.
    - `sequential`: under vmap, always map the elements one after another (a kernel whose
      leading dim is not a batch, such as packed sequences).

    Under `jax.jit` with sharded operands the call runs shard-local over batch and heads
    (`_partition.partitioned`); inside `jax.shard_map` it runs on the local block.
    """

    def __init__(
        self,
        target: str,
        operands: tuple[tuple[str, str], ...],
        results: tuple[str, ...],
        shapes: Callable[[Mapping[str, jax.Array]], tuple[jax.ShapeDtypeStruct, ...]],
        attrs: Mapping[str, Any],
        *,
        returns: tuple[str, ...] | None = None,
        result_like: Mapping[str, str] | None = None,
        sequential_if_present: tuple[str, ...] = (),
        folds: Mapping[str, Fold] | None = None,
        aliases: Mapping[int, int] | None = None,
        layout: Layout = table_layout,
        dropout: tuple[str, bool] | None = None,
        kernel: Callable[..., tuple[jax.Array, ...]] | None = None,
        sequential: bool = False,
    ):
        self.target = target
        self.operands = operands
        self.names = tuple(name for name, _ in operands)
        self.results = results
        self.returns = results if returns is None else returns
        self._keep = tuple(results.index(name) for name in self.returns)
        self._shapes = shapes
        self._attrs = dict(attrs)
        self._result_like = dict(result_like or {})
        self._sequential_if_present = sequential_if_present
        # A 12-word block state without dropout (context parallelism) folds like any operand:
        # only a drawn keep-mask depends on the batch index.
        self._drops = float(self._attrs.get("dropout_rate", 1.0)) > 0
        self._folds = dict(folds or {})
        self._aliases = dict(aliases or {})
        self._kernel = kernel
        self._sequential = sequential
        self._partitioned = partitioned(
            self._local_call, f"attnaux ({target})", self.names, self.returns, layout=layout,
            dropout=dropout,
        )
        self._call = custom_vmap(self._partitioned)
        self._call.def_vmap(self._vmap_rule)

    def __call__(self, **operands: jax.Array) -> dict[str, jax.Array]:
        if set(operands) != set(self.names):
            raise TypeError(
                f"{self.target} takes the operands {self.names}; got {tuple(operands)}."
            )
        args = tuple(operands[name] for name in self.names)
        # Inside `jax.shard_map` the results vary over the operands' manual axes (the traced
        # call itself loses them).
        axes = frozenset().union(*(vma(a) for a in args))
        outs = tuple(match_vma(o, axes) for o in self._call(*args))
        return dict(zip(self.returns, outs, strict=True))

    def _local_call(self, *args: jax.Array) -> tuple[jax.Array, ...]:
        # One device's call (the whole call when nothing is sharded): `_partition` runs it on
        # each shard's operands.
        if self._kernel is not None:
            return tuple(self._kernel(*args))
        named = dict(zip(self.names, args, strict=True))
        call = jax.ffi.ffi_call(
            self.target, tuple(self._shapes(named)), input_output_aliases=self._aliases or None
        )
        outs = call(*args, **self._attrs)
        return tuple(outs[i] for i in self._keep)

    def _vmap_rule(self, axis_size: int, in_batched, *args):
        # Per-element shapes (an element may not exist: the mapped axis can have size 0).
        shapes = {name: x.shape[1:] if b else x.shape
                  for name, x, b in zip(self.names, args, in_batched)}
        has = {name: len(shape) > 1 or shape != (0,) for name, shape in shapes.items()}
        shared_batched = any(
            b and role == SHARED and has[name]
            for (name, role), b in zip(self.operands, in_batched)
        )
        if (
            axis_size == 0
            or self._sequential
            or shared_batched
            or (self._drops and any(has[name] for name in self._sequential_if_present))
        ):
            # Folding would change results: a dropout state's counters use the batch index (so
            # `vmap(f)(x)[n]` would differ from `f(x[n])` and from `introspect.dropout_mask`), and
            # a per-element shared operand cannot share one launch. Map one after another.
            return self._map_sequentially(in_batched, args)
        one = {name: (x[0] if b else x) for name, x, b in zip(self.names, args, in_batched)}
        bsz = next(one[name].shape[0] for name, role in self.operands if role == BATCH)
        materialise = set(self._result_like.values())
        leading_one = set()
        folded = []
        for (name, role), x, b in zip(self.operands, args, in_batched):
            if name in self._folds:
                folded.append(self._folds[name](axis_size, b, x, bsz))
            elif role == SHARED or (role == BROADCAST and not has[name]):
                folded.append(one[name])
            elif role == BATCH:
                if not b:
                    x = jnp.broadcast_to(x, (axis_size, *x.shape))
                folded.append(x.reshape((axis_size * x.shape[1], *x.shape[2:])))
            else:  # BROADCAST, present: [1 or B, ...] per element
                if not b and x.shape[0] == 1 and name not in materialise:
                    folded.append(x)  # the kernel broadcasts it over the folded batch too
                    continue
                if not b:
                    x = jnp.broadcast_to(x, (axis_size, *x.shape))
                if x.shape[1] == 1:
                    leading_one.add(name)
                x = jnp.broadcast_to(x, (axis_size, bsz, *x.shape[2:]))
                folded.append(x.reshape((axis_size * bsz, *x.shape[2:])))
        outs = self._call(*folded)
        unfolded, batched = [], []
        for name, o in zip(self.returns, outs):
            if not present(o):
                unfolded.append(o)
                batched.append(False)
                continue
            o = o.reshape((axis_size, o.shape[0] // axis_size, *o.shape[1:]))
            if self._result_like.get(name) in leading_one:
                o = jnp.sum(o, axis=1, keepdims=True)
            unfolded.append(o)
            batched.append(True)
        return tuple(unfolded), tuple(batched)

    def _map_sequentially(self, in_batched, args):
        def one(mapped):
            it = iter(mapped)
            return self._call(*(next(it) if b else x for x, b in zip(args, in_batched)))

        outs = jax.lax.map(one, tuple(x for x, b in zip(args, in_batched) if b))
        unbatched, batched = [], []
        for o in outs:
            if o.ndim == 2 and o.shape[1] == 0:  # an absent result, (0,) per element
                unbatched.append(absent(o.dtype))
                batched.append(False)
            else:
                unbatched.append(o)
                batched.append(True)
        return tuple(unbatched), tuple(batched)


def add_sink(out: jax.Array, lse: jax.Array, sink: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Adds a per-head sink logit to every softmax denominator, after the fact (exact: the output
    is a P-weighted sum, so it scales by `exp(lse0 - lse)`). Rows without a visible key (lse0 =
    -inf) get `out = 0`, `lse = sink` and zero gradients."""
    s = sink.astype(jnp.float32)[None, :, None]
    shift = jax.lax.stop_gradient(jnp.maximum(lse, s))  # finite: the sink is
    lse_sink = shift + jnp.log(jnp.exp(lse - shift) + jnp.exp(s - shift))
    ratio = jnp.exp(lse - lse_sink)  # [B, Hq, Sq], 0 where lse0 = -inf
    out = (out.astype(jnp.float32) * ratio.transpose(0, 2, 1)[..., None]).astype(out.dtype)
    return out, lse_sink


def attention_attrs(options: Options) -> dict[str, Any]:
    """The attributes every attention kernel takes (`docs/kernel_abi.md`)."""
    return dict(
        scale=np.float32(options.scale),
        softcap=np.float32(options.softcap),
        causal=np.int32(options.causal),
        window_left=np.int64(options.window_left),
        window_right=np.int64(options.window_right),
        dropout_rate=np.float32(options.dropout_rate),
    )


def attention_shapes(ops: Mapping[str, jax.Array]) -> tuple[jax.ShapeDtypeStruct, ...]:
    """`out [B, Sq, Hq, Dv]` in the input dtype, float32 `lse` and `max` `[B, Hq, Sq]`."""
    q, v = ops["q"], ops["v"]
    bsz, q_seq, q_heads, _ = q.shape
    return (
        jax.ShapeDtypeStruct((bsz, q_seq, q_heads, v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32),
        jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32),
    )


def gradient_shapes(ops: Mapping[str, jax.Array]) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Results of every attention backward kernel: dq, dk, dv, and the full float32 dbias
    `[B, Hq, Sq, Skv]` when a bias is given (else `(0,)`)."""
    q, k, v, bias = ops["q"], ops["k"], ops["v"], ops["bias"]
    bsz, q_seq, q_heads, _ = q.shape
    dbias_shape = (bsz, q_heads, q_seq, k.shape[1]) if present(bias) else (0,)
    return (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct(dbias_shape, jnp.float32),
    )


GRADIENTS = ("dq", "dk", "dv", "dbias")


def kernel_operands(arrays: Canonical) -> dict[str, jax.Array]:
    """The canonical arrays by name, absent ones as `(0,)` arrays."""
    return {
        name: absent(_ABSENT_DTYPES[name]) if x is None else x
        for name, x in zip(OPERAND_NAMES, arrays, strict=True)
    }


# ------------------------------------------------------------------------------------------------
# Differentiation
# ------------------------------------------------------------------------------------------------
def compiled_vjp(forward: Callable, backward: Callable) -> Callable:
    """The `custom_vjp` of a compiled primitive: `f(static, *args)`.

    `forward(static, differentiating, *args) -> (outputs, residuals)`; `differentiating` is
    False for a call that is not differentiated (its residuals are dropped), so a kernel can skip
    writing them. `backward(static, residuals, cotangents) -> one cotangent (or None) per arg`;
    a cotangent that is a symbolic zero arrives as None, so no dense zero is built for it.
    `static` is hashable and not differentiated.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def primitive(static, *args):
        return forward(static, False, *args)[0]

    def fwd(static, *primals):  # CustomVJPPrimal wrappers (symbolic_zeros=True); None stays None
        return forward(static, True, *(None if p is None else p.value for p in primals))

    def bwd(static, residuals, cotangents):
        cotangents = tuple(None if is_symbolic_zero(c) else c for c in cotangents)
        return tuple(backward(static, residuals, cotangents))

    primitive.defvjp(fwd, bwd, symbolic_zeros=True)

    def call(static, *args):
        # Inside `jax.shard_map` every operand varies over the same axes, so each cotangent has
        # its primal's type (JAX sums the cotangent of an operand that did not vary).
        return primitive(static, *unify_vma(args))

    return call


def fixed_order_sum(x: jax.Array, axis: int) -> jax.Array:
    """Sum over `axis` (kept as size 1) by pairwise halving: elementwise adds only, so the result
    never depends on how XLA splits a reduction over threads (its own reductions do). In a
    program that runs on several devices, where `axis` may be sharded, it is XLA's sum instead
    (shard sums and one all-reduce: halving across devices would move data between them)."""
    return _fixed_order_sum_over(axis)(x)


@functools.cache
def _fixed_order_sum_over(axis: int) -> Callable[[jax.Array], jax.Array]:
    def local(x: jax.Array) -> jax.Array:
        return _halving_sum(x, axis)

    return sharded_reduction(local, axis)


def _halving_sum(x: jax.Array, axis: int) -> jax.Array:
    while x.shape[axis] > 1:
        n = x.shape[axis]
        half = n // 2
        low = jax.lax.slice_in_dim(x, 0, half, axis=axis)
        high = jax.lax.slice_in_dim(x, half, 2 * half, axis=axis)
        summed = low + high
        if n % 2:
            rest = jax.lax.slice_in_dim(x, 2 * half, n, axis=axis)
            summed = jax.lax.concatenate([summed, rest], axis)
        x = summed
    if x.shape[axis] == 0:
        x = jnp.zeros((*x.shape[:axis], 1, *x.shape[axis + 1:]), x.dtype)
    return x


def parameter_gradients(ops, out, lse, probs, dout, dlse, dprobs, dbias_full):
    """`(dbias, dsink)` of an attention backward: the kernel's full float32 dbias summed down to
    the bias's broadcast shape, and the sink's gradient from per-row terms. Either is None when
    that operand is absent; `dprobs` is `(0,)` when nothing depends on the probabilities."""
    bias, sink = ops["bias"], ops["sink"]
    dbias = None
    if present(bias):  # summed down to the bias's broadcast shape, in a fixed order
        dbias = dbias_full
        for axis in range(4):
            if bias.shape[axis] == 1 and dbias.shape[axis] != 1:
                dbias = fixed_order_sum(dbias, axis)
    dsink = None
    if present(sink):
        # lse, out and P depend on the sink only through lse: d lse / d sink = exp(sink - lse),
        # d out / d sink = -exp(sink - lse) * out, d P / d sink = -exp(sink - lse) * P. So
        # dsink = -sum_rows exp(sink - lse) * Dt with Dt = dout . out + rowsum(dP * P) - dlse.
        row_term = jnp.einsum(
            "bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32)
        ) - dlse
        if present(dprobs):
            row_term = row_term + jnp.einsum(
                "bhqk,bhqk->bhq", dprobs.astype(jnp.float32), probs.astype(jnp.float32)
            )
        terms = jnp.exp(sink[None, :, None] - lse) * row_term  # [B, Hq, Sq]
        dsink = -fixed_order_sum(fixed_order_sum(terms, 2), 0).reshape(sink.shape)
    return dbias, dsink


def attention_primitive(forward: Callable, backward: Callable) -> Callable:
    """The differentiable primitive of a kernel pair with the canonical attention ABI.

    `forward(options, ops, write_probs) -> (out, lse, max, probs)` where `probs` is `(0,)`
    unless written; `backward(options, ops, out, lse, probs, dout, dlse, dprobs) ->
    (dq, dk, dv, dbias_full)`. Returns `run(arrays, options, return_probs) -> (out, lse, max,
    probs or None)`: `probs` is written when returned or when differentiating (the residual of a
    backward that reads it), and is differentiable when returned. The bias and sink gradients
    come from `parameter_gradients`; a backward with no cotangent at all runs nothing.
    """

    def fwd(static, differentiating, *args):
        options, return_probs = static
        ops = dict(zip(OPERAND_NAMES, args, strict=True))
        out, lse, row_max, probs = forward(options, ops, differentiating or return_probs)
        primal_probs = probs if return_probs else absent(probs.dtype)
        return (out, lse, row_max, primal_probs), (args, out, lse, probs)

    def bwd(static, residuals, cotangents):
        options, return_probs = static
        args, out, lse, probs = residuals
        dout, dlse, _, dprobs = cotangents  # the row max carries no gradient
        if not return_probs:
            dprobs = None
        if dout is None and dlse is None and dprobs is None:
            return (None,) * len(args)
        ops = dict(zip(OPERAND_NAMES, args, strict=True))
        dout = jnp.zeros_like(out) if dout is None else dout.astype(out.dtype)
        dlse = jnp.zeros_like(lse) if dlse is None else dlse.astype(jnp.float32)
        dprobs = absent(probs.dtype) if dprobs is None else dprobs.astype(probs.dtype)
        dq, dk, dv, dbias_full = backward(options, ops, out, lse, probs, dout, dlse, dprobs)
        dbias, dsink = parameter_gradients(ops, out, lse, probs, dout, dlse, dprobs, dbias_full)
        grads = dict(q=dq, k=dk, v=dv, bias=dbias, sink=dsink)
        return tuple(grads.get(name) for name in OPERAND_NAMES)

    primitive = compiled_vjp(fwd, bwd)

    def run(arrays: Canonical, options: Options, return_probs: bool):
        ops = kernel_operands(arrays)
        out, lse, row_max, probs = primitive(
            (options, bool(return_probs)), *(ops[name] for name in OPERAND_NAMES)
        )
        return out, lse, row_max, (probs if return_probs else None)

    return run


# ------------------------------------------------------------------------------------------------
# The probability-saving kernel pairs (`probs` and `small_seq` on CPU, `small_seq` on CUDA)
# ------------------------------------------------------------------------------------------------
_PROBS_BACKWARD_EXTRA = (("dout", BATCH), ("probs", BATCH), ("dlse", BATCH), ("dprobs", BATCH))


def probs_kernel_primitive(fwd_target: str, bwd_target: str) -> Callable:
    """The primitive of a kernel pair with the probability-saving ABI (`docs/kernel_abi.md`):
    the forward returns `out, lse, max` and `P` (`[B, Hq, Sq, Skv]` before dropout, in the input
    dtype; `(0,)` when not asked for, so inference pays nothing for the residual), and the
    backward reads `P` (and the cotangent of `aux.probs`) instead of recomputing the scores."""

    @functools.cache
    def ops(options: Options, write_probs: bool) -> tuple[KernelOp, KernelOp]:
        def forward_shapes(named):
            q, k = named["q"], named["k"]
            bsz, q_seq, q_heads, _ = q.shape
            probs_shape = (bsz, q_heads, q_seq, k.shape[1]) if write_probs else (0,)
            return (*attention_shapes(named), jax.ShapeDtypeStruct(probs_shape, q.dtype))

        attrs = attention_attrs(options)
        forward = KernelOp(fwd_target, CANONICAL_OPERANDS, ("out", "lse", "max", "probs"),
                           forward_shapes, attrs, sequential_if_present=("rng_state",),
                           dropout=("rng_state", True))
        backward = KernelOp(bwd_target, CANONICAL_OPERANDS + _PROBS_BACKWARD_EXTRA, GRADIENTS,
                            gradient_shapes, attrs, sequential_if_present=("rng_state",),
                            dropout=("rng_state", True))
        return forward, backward

    def forward(options, named, write_probs):
        r = ops(options, write_probs)[0](**named)
        return r["out"], r["lse"], r["max"], r["probs"]

    def backward(options, named, out, lse, probs, dout, dlse, dprobs):
        r = ops(options, True)[1](**named, dout=dout, probs=probs, dlse=dlse, dprobs=dprobs)
        return r["dq"], r["dk"], r["dv"], r["dbias"]

    return attention_primitive(forward, backward)
