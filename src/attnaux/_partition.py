"""The sharding rules of the kernel-call layer: how every compiled kernel call runs under SPMD.

A compiled kernel is an XLA custom call, which XLA's partitioner cannot look into: left alone it
gathers every operand and runs the whole problem on every device. `partitioned` wraps a kernel
call in `jax.experimental.custom_partitioning` with rules derived from one table, `LAYOUTS`,
that names the dims of every operand and result of every kernel:

- dims labelled `batch`, `heads`, `kv_heads` (and a softmax's leading dims `lead0`, `lead1`,
  ...) may be sharded: each device runs the kernel on its shard, with no communication. Query and
  kv heads split together (under GQA the kv heads split the same number of ways, so that local
  query head `h` still reads local kv head `h // group`);
- every other dim (sequence, head dim, the dropout state) must be replicated: a sharded sequence
  is context parallelism (`attnaux.parallel`), which the kernels alone cannot do, so it is an
  error naming the operand, the dim and the mesh axes, never a silent gather.

Shardy propagates shardings through the kernel with the matching einsum-like rule (query heads
as the compound factor `(kv_heads group)`); the partition callback then checks the shardings it
is handed (in XLA's terms: ways per dim and device order, so no mesh axis needs a name) and
lowers the kernel on the local shapes. A kernel whose dropout counter follows global indices
gets the shard's origin (`dropout_origin`, from `arange` operands sharded like the batch and the
heads), so a sharded call draws the mask of the unsharded one. Inside `jax.shard_map` (every
mesh axis manual) the kernel is lowered as it is, and `match_vma` gives its results the varying
axes of its operands.

Each call is one primitive (`device_aware`) whose lowering picks the partitioned form only where
the program runs on several devices: `jax.export` lowers without devices, where JAX refuses
`custom_partitioning`, and gets the plain kernel call (on one device, or inside `shard_map`).

This module imports nothing else of attnaux.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend
import jax.interpreters.mlir
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning

BATCH = "batch"
HEADS = "heads"
KV_HEADS = "kv_heads"

_Q = (BATCH, "q_seq", HEADS, "qk_dim")
_K = (BATCH, "kv_seq", KV_HEADS, "qk_dim")
_V = (BATCH, "kv_seq", KV_HEADS, "v_dim")
_OUT = (BATCH, "q_seq", HEADS, "v_dim")
_ROWS = (BATCH, HEADS, "q_seq")
_PAIRS = (BATCH, HEADS, "q_seq", "kv_seq")

LAYOUTS: dict[str, tuple[str, ...]] = {
    # the canonical operands (docs/kernel_abi.md); bias and mask dims of size 1 broadcast
    "q": _Q, "k": _K, "v": _V, "bias": _PAIRS, "mask": _PAIRS,
    "q_seqlens": (BATCH,), "kv_seqlens": (BATCH,), "q_segment_ids": (BATCH, "q_seq"),
    "kv_segment_ids": (BATCH, "kv_seq"), "sink": (HEADS,), "rng_state": ("rng_state",),
    # results and backward operands
    "out": _OUT, "dout": _OUT, "lse": _ROWS, "dlse": _ROWS, "max": _ROWS, "probs": _PAIRS,
    "dprobs": _PAIRS, "dq": _Q, "dk": _K, "dv": _V, "dbias": _PAIRS,
    # the CUDA probs kernels and cuDNN's
    "scores": _PAIRS, "dp": _PAIRS, "weights": _PAIRS, "ds": _PAIRS, "stats": _ROWS,
    "q_len": (BATCH,), "kv_len": (BATCH,), "rng": ("rng_state",), "offsets": ("offsets",),
    # score_mod / mask_mod in the CPU kernels: the flat captured arrays, the block table of
    # 64 x 64 tiles (dims of size 1 broadcast), each (batch, head)'s share of their gradient
    "score_consts": ("score_consts",), "tile_mask": (BATCH, HEADS, "q_tiles", "kv_tiles"),
    "dscore_consts": (BATCH, HEADS, "score_consts"),
}
"""The dims of every named operand and result of the attention kernels."""

_NAMES = {BATCH: "batch", HEADS: "heads", KV_HEADS: "kv heads"}


def shardable(label: str) -> bool:
    return label in (BATCH, HEADS, KV_HEADS) or label.startswith("lead")


def leading_layout(ndim: int, trailing: tuple[str, ...]) -> tuple[str, ...]:
    """`lead0, lead1, ...` then `trailing`: the layout of an array with free leading dims."""
    return (*(f"lead{i}" for i in range(ndim - len(trailing))), *trailing)


Layout = Callable[[str, tuple[int, ...]], tuple[str, ...]]


def table_layout(name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    """The dims of operand or result `name` (`("absent",)` for a `(0,)` absent one)."""
    if tuple(shape) == (0,) and len(LAYOUTS[name]) != 1:
        return ("absent",)
    return LAYOUTS[name]


# ------------------------------------------------------------------------------------------------
# Varying manual axes (jax.shard_map with check_vma=True)
# ------------------------------------------------------------------------------------------------
def vma(x: Any) -> frozenset:
    """The varying manual axes of `x` (empty outside `jax.shard_map`)."""
    aval = jax.typeof(x)
    axes = getattr(aval, "vma", None)  # JAX <= 0.9
    if axes is None:  # JAX >= 0.10: the varying part of the manual axis type
        axes = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(axes or ())


def match_vma(x: jax.Array, axes: frozenset) -> jax.Array:
    """`x` marked as varying over `axes` too (a no-op outside `jax.shard_map`)."""
    missing = tuple(sorted(axes - vma(x)))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying")


def unify_vma(args: Sequence[Any]) -> tuple[Any, ...]:
    """`args` all marked varying over the union of their varying axes, so that a `custom_vjp`
    gives every cotangent the type of its primal (JAX sums the cotangent of an input that was
    not varying when it transposes the cast)."""
    axes = frozenset().union(*(vma(a) for a in args if a is not None))
    if not axes:
        return tuple(args)
    return tuple(None if a is None else match_vma(a, axes) for a in args)


def folded(fn, broadcast_batch: tuple[int, ...] = (), no_batch: tuple[int, ...] = (),
           sequential: bool = False):
    """`fn` (every operand and result with the batch first) under `jax.vmap`: the mapped axis
    folded into the batch, one kernel launch. An operand that is not mapped is broadcast first,
    except those at `broadcast_batch` (block tables), whose batch dim of 1 broadcasts inside the
    kernels, and those at `no_batch` (head ids: the same for every mapped element).
    `sequential`: map the elements one after another instead (a dropout state's counters use
    the batch index, so a folded call would draw another mask than `fn` of each element)."""
    wrapped = custom_vmap(fn)

    @wrapped.def_vmap
    def _(axis_size, in_batched, *args):
        if sequential:
            mapped = [x for x, m in zip(args, in_batched) if m]

            def one(xs):
                it = iter(xs)
                return wrapped(*(next(it) if m else x for x, m in zip(args, in_batched)))

            outs = jax.lax.map(one, mapped)
            return tuple(outs), (True,) * len(outs)
        bsz = args[0].shape[1] if in_batched[0] else args[0].shape[0]

        def fold(i, x, mapped):
            if i in no_batch:
                if mapped:
                    raise ValueError(f"operand {i} of {getattr(fn, '__name__', fn)} has no "
                                     "batch axis, so it cannot be mapped by jax.vmap")
                return x
            if i in broadcast_batch:
                if not mapped and x.shape[0] == 1:
                    return x
                if mapped:
                    x = jnp.broadcast_to(x, (axis_size, bsz, *x.shape[2:]))
            if not mapped:
                x = jnp.broadcast_to(x, (axis_size, *x.shape))
            return x.reshape(axis_size * x.shape[1], *x.shape[2:])

        outs = wrapped(*(fold(i, x, m) for i, (x, m) in enumerate(zip(args, in_batched))))
        return (tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs),
                (True,) * len(outs))

    return wrapped


def varying_like_operands(fn):
    """`fn` whose results vary over the manual axes its operands vary over (inside
    `jax.shard_map`, where a kernel call's results would otherwise lose them)."""
    def call(*args):
        axes = frozenset().union(*(vma(x) for x in args))
        return tuple(match_vma(o, axes) for o in fn(*args))
    return call


# ------------------------------------------------------------------------------------------------
# The plan of one partitioned call, in XLA's sharding terms (tile counts per dim, device order)
# ------------------------------------------------------------------------------------------------
def _tiling(sharding: Any, ndim: int) -> tuple[tuple[int, ...], np.ndarray | None]:
    """`(ways, devices)`: how many ways each dim of an operand is split, and the device ids as
    an array of shape `(*ways, rest)` (`rest`: the devices that hold the same tile). A
    `NamedSharding` and a `GSPMDSharding` (what JAX hands over without a mesh) alike."""
    hlo = sharding._to_xla_hlo_sharding(ndim)
    if hlo.is_replicated() or not hlo.is_tiled():
        return (1,) * ndim, None
    dims = list(hlo.tile_assignment_dimensions())
    ways = tuple(int(d) for d in dims[:ndim])
    devices = np.asarray(hlo.tile_assignment_devices()).reshape(*ways, -1)
    return ways, devices


def _group(label: str) -> str:
    """Query and kv heads split together, as one group."""
    return HEADS if label == KV_HEADS else label


class Plan:
    """How a call splits: `ways[group]` for each split group (the batch; the heads, query and
    kv heads together; a softmax's leading dims) and the device grid they follow, checked
    against the operands' shardings (`what` names the kernel in errors)."""

    def __init__(self, what: str, named: Mapping[str, Any], layout: Layout,
                 names: Sequence[str]):
        self.what = what
        self.layout = layout
        self.sizes: dict[str, int] = {}
        for name in names:
            for label, size in zip(layout(name, named[name].shape), named[name].shape,
                                   strict=True):
                self.sizes[label] = max(self.sizes.get(label, 0), size)
        self.grid: np.ndarray | None = None
        self.keys: list[str] = []
        self.ways: dict[str, int] = {}
        for name in names:
            x = named[name]
            labels = layout(name, x.shape)
            ways, devices = _tiling(x.sharding, len(x.shape))
            for dim, (label, n) in enumerate(zip(labels, ways, strict=True)):
                if n > 1 and not shardable(label):
                    raise ValueError(self._unshardable(name, dim, label, n))
            if self.grid is None and devices is not None:
                self._take_grid(labels, x.shape, ways, devices)
        self._check()

    def _take_grid(self, labels, shape, ways, devices) -> None:
        """The device grid of the first operand split over shardable dims (full size): one grid
        axis per split group (batch, heads, a softmax's leading dims), then the replicas."""
        kept: dict[str, int] = {}
        for dim, (label, size, n) in enumerate(zip(labels, shape, ways, strict=True)):
            key = _group(label)
            if n > 1 and shardable(label) and size == self.sizes[label] and key not in kept:
                kept[key] = dim
        if not kept:
            return
        rest = [d for d in range(len(shape)) if d not in kept.values()] + [len(shape)]
        grid = devices.transpose(list(kept.values()) + rest)
        self.keys = list(kept)
        self.ways = {key: ways[dim] for key, dim in kept.items()}
        self.grid = grid.reshape(*self.ways.values(), -1)

    def _unshardable(self, name: str, dim: int, label: str, ways: int) -> str:
        return self._unshardable_message(self.what, name, dim, label, f"split {ways} ways")

    @staticmethod
    def _unshardable_message(what: str, name: str, dim: int, label: str, how: str) -> str:
        where = f"`{name}` is sharded along its {label} axis (dim {dim}), {how}"
        if label in ("q_seq", "kv_seq"):
            return (
                f"{what}: {where}. The compiled kernels partition over batch and heads "
                "only; attention over a sharded sequence is context parallelism: use "
                "`attnaux.parallel` (ring or all-gather of k and v), or replicate the sequence "
                "first (`jax.lax.with_sharding_constraint(x, P(..., None, ...))`)."
            )
        return (
            f"{what}: {where}. The compiled kernels partition over batch and heads only; "
            "replicate that axis first (`jax.lax.with_sharding_constraint`)."
        )

    def _check(self) -> None:
        for key, ways in self.ways.items():
            for label in [lab for lab in self.sizes if _group(lab) == key]:
                size = self.sizes[label]
                if ways > 1 and size % ways:
                    hint = ""
                    if label == KV_HEADS:
                        hint = (
                            " Query and kv heads split together (local query head h reads local "
                            "kv head h // group): shard the heads a number of ways that divides "
                            "kv_heads, or repeat k and v over their heads first."
                        )
                    raise ValueError(
                        f"{self.what}: the {_NAMES.get(label, label)} dim ({size}) is split "
                        f"{ways} ways, which does not divide it.{hint}"
                    )

    @property
    def sharded(self) -> bool:
        return self.grid is not None

    def hlo_sharding(self, name: str, shape: tuple[int, ...]):
        """The sharding this plan gives operand or result `name`: its batch and heads dims
        (full size) split along the grid, everything else replicated."""
        from jax._src.lib import xla_client as xc

        if self.grid is None:
            return xc.HloSharding.replicate()
        tiles, used = [], []
        for label, size in zip(self.layout(name, shape), shape, strict=True):
            key = _group(label)
            n = self.ways.get(key, 1) if shardable(label) else 1
            axis = self.keys.index(key) if n > 1 else None
            if axis is None or size != self.sizes[label] or axis in used:
                tiles.append(1)
            else:
                tiles.append(n)
                used.append(axis)
        if not used:
            return xc.HloSharding.replicate()
        order = used + [a for a in range(len(self.keys)) if a not in used] + [len(self.keys)]
        devices = self.grid.transpose(order).reshape(-1)
        replicas = devices.size // math.prod(tiles)
        op = xc.OpSharding()
        op.type = xc.OpSharding.Type.OTHER
        op.tile_assignment_dimensions = tiles + ([replicas] if replicas > 1 else [])
        op.tile_assignment_devices = [int(d) for d in devices]
        op.replicate_on_last_tile_dim = replicas > 1
        return xc.HloSharding.from_proto(op)

    def sharding(self, device_sharding: Any, name: str, shape: tuple[int, ...]):
        """`hlo_sharding` as a JAX sharding on the devices of `device_sharding`."""
        from jax._src.sharding_impls import GSPMDSharding

        return GSPMDSharding(device_sharding._device_assignment, self.hlo_sharding(name, shape))


def dropout_origin(rng: jax.Array, b0: jax.Array, h0: jax.Array, q_heads: int, q_seq: int,
                   kv_seq: int) -> jax.Array:
    """The 12-word dropout state of a shard (`docs/kernel_abi.md`): the seed and offset, then the
    shard's origin `(batch, head, q, kv)` in the global `[B, Hq, Sq, Skv]` probabilities and
    the global `(heads, q_len, kv_len)`, so the kernel's counter is the unsharded call's."""
    rng = rng.astype(jnp.uint32)
    b0, h0 = b0.astype(jnp.uint32), h0.astype(jnp.uint32)
    if rng.shape[0] == 12:  # already a block of a larger problem (context parallelism)
        return rng.at[4].add(b0).at[5].add(h0)
    words = jnp.stack([b0, h0, jnp.uint32(0), jnp.uint32(0), jnp.uint32(q_heads),
                       jnp.uint32(q_seq), jnp.uint32(kv_seq), jnp.uint32(0)])
    return jnp.concatenate([rng, words])


def block_state(rng_state: jax.Array, q: jax.Array, k: jax.Array) -> jax.Array:
    """The 12-word block state of a call (`docs/kernel_abi.md`) from its `rng_state`, for
    kernels that always take one (attnaux's Hopper kernels): a block of a larger problem keeps
    its own (context parallelism); 4 words get the origin 0 and the sizes of `q [B, Sq, Hq, D]`
    and `k [B, Skv, Hkv, D]`, which must be the call's unpadded ones."""
    if rng_state.shape[0] == 12:
        return rng_state.astype(jnp.uint32)
    zero = jnp.uint32(0)
    return dropout_origin(rng_state, zero, zero, q.shape[2], q.shape[1], k.shape[1])


# ------------------------------------------------------------------------------------------------
# The einsum-like rule for Shardy
# ------------------------------------------------------------------------------------------------
def sharding_rule(layout: Layout, operands: Sequence[tuple[str, tuple[int, ...]]],
                  results: Sequence[tuple[str, tuple[int, ...]]]):
    """`(rule, factor_sizes)` for `custom_partitioning`: one factor per shardable label (query
    heads the compound `(n g)` of kv heads and the group), a factor of its own for every other
    dim (so nothing propagates along a sequence)."""
    sizes: dict[str, int] = {}
    for name, shape in (*operands, *results):
        for label, size in zip(layout(name, shape), shape, strict=True):
            sizes[label] = max(sizes.get(label, 0), size)
    q_heads, kv_heads = sizes.get(HEADS, 0), sizes.get(KV_HEADS, 0)
    group = q_heads // kv_heads if kv_heads and q_heads % kv_heads == 0 else 0
    factor_sizes: dict[str, int] = {}
    counter = iter(range(10**6))

    def factor(label: str, size: int) -> str:
        if not shardable(label) or size != sizes[label] or size <= 1:
            return f"u{next(counter)}"
        if label == BATCH:
            return "b"
        if label == KV_HEADS and group:
            return "n"
        if label == HEADS and group > 1:
            factor_sizes["g"] = group
            return "(n g)"
        if label == HEADS and group == 1:
            return "n"
        if label == HEADS and not kv_heads:
            return "h"
        return label.replace("lead", "l") if label.startswith("lead") else f"x{next(counter)}"

    def side(values):
        return ", ".join(
            " ".join(factor(label, size) for label, size in zip(layout(n, s), s, strict=True))
            for n, s in values
        )

    return f"{side(operands)} -> {side(results)}", factor_sizes


# ------------------------------------------------------------------------------------------------
# The wrapper
# ------------------------------------------------------------------------------------------------
_INDEX_OPERANDS = ("batch_index", "head_index")


def _index_layout(layout: Layout) -> Layout:
    def with_index(name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
        if name == "batch_index":
            return (BATCH,)
        if name == "head_index":
            return (HEADS,)
        return layout(name, shape)

    return with_index


def partitioned(
    local: Callable[..., tuple[jax.Array, ...]],
    what: str,
    operand_names: tuple[str, ...],
    result_names: tuple[str, ...],
    *,
    layout: Layout = table_layout,
    dropout: tuple[str, bool] | None = None,
) -> Callable[..., tuple[jax.Array, ...]]:
    """`local(*operands) -> results` (one device's call), partitioned over the shardable dims.

    `dropout = (operand, follows_global_indices)` names the dropout state. When it is present,
    a kernel whose counter follows global indices also gets the operands `batch_index` and
    `head_index` (`arange` over the batch and the query heads, sharded like them), whose first
    local entries are the shard's origin (`dropout_origin`); so no mesh axis needs a name. A
    kernel whose generator cannot follow (cuDNN's) raises when the call is split, since every
    device would draw the mask of a different problem.
    """

    def build(names: tuple[str, ...], with_index: bool):
        lay = _index_layout(layout) if with_index else layout
        base = len(operand_names)

        def body(*args):
            return tuple(local(*args[:base]))

        def plan_of(arg_shapes) -> Plan:
            return Plan(what, dict(zip(names, arg_shapes, strict=True)), lay, names)

        def lower_with(plan: Plan, arg_shapes):
            if dropout is None or not plan.sharded:
                return body
            rng_index = operand_names.index(dropout[0])
            if arg_shapes[rng_index].shape == (0,):
                return body
            if not dropout[1]:
                raise ValueError(
                    f"{what}: dropout here draws its keep-mask with cuDNN's own counter layout, "
                    "which cannot follow a call split over batch or heads (each device would "
                    "draw the mask of a different problem). Use a backend whose mask follows "
                    "global indices under sharding (`backend='probs'` or `'reference'`), or "
                    "shard the call by hand with `jax.shard_map`."
                )
            named = dict(zip(names, arg_shapes, strict=True))
            q_heads, q_seq = named["q"].shape[2], named["q"].shape[1]
            kv_seq = named["k"].shape[1]

            def lower(*args):
                args = list(args)
                b0, h0 = args[base][:1].sum(), args[base + 1][:1].sum()  # 0 for an empty shard
                args[rng_index] = dropout_origin(args[rng_index], b0, h0, q_heads, q_seq, kv_seq)
                return tuple(local(*args[:base]))

            return lower

        def partition(mesh, arg_shapes, result_shape):
            plan = plan_of(arg_shapes)
            ref = arg_shapes[0].sharding
            arg_shardings = tuple(
                plan.sharding(ref, n, a.shape) for n, a in zip(names, arg_shapes, strict=True)
            )
            result_shardings = tuple(
                plan.sharding(ref, n, r.shape)
                for n, r in zip(result_names, result_shape, strict=True)
            )
            return mesh, lower_with(plan, arg_shapes), result_shardings, arg_shardings

        def infer(mesh, arg_shapes, result_shape):
            plan = plan_of(arg_shapes)
            ref = arg_shapes[0].sharding
            return tuple(plan.sharding(ref, n, r.shape) for n, r in zip(result_names, result_shape))

        def rule(mesh, operand_types, result_types):
            ops = [(n, tuple(t.shape)) for n, t in zip(names, operand_types, strict=True)]
            res = [(n, tuple(t.shape)) for n, t in zip(result_names, result_types, strict=True)]
            return sharding_rule(lay, ops, res)

        wrapped = custom_partitioning(body)
        wrapped.def_partition(
            partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
            propagate_user_sharding=None, decode_shardings=False,
        )
        return device_aware(body, wrapped, what)

    plain = build(operand_names, False)
    indexed = build(operand_names + _INDEX_OPERANDS, True) if dropout and dropout[1] else None

    def call(*args):
        _check_explicit(what, layout, operand_names, args)
        if indexed is not None and args[operand_names.index(dropout[0])].shape != (0,):
            named = dict(zip(operand_names, args, strict=True))
            bsz, _, q_heads, _ = named["q"].shape
            return indexed(*args, jnp.arange(bsz, dtype=jnp.int32),
                           jnp.arange(q_heads, dtype=jnp.int32))
        return plain(*args)

    return call


def _check_explicit(what: str, layout: Layout, names: Sequence[str], args: Sequence[Any]) -> None:
    """With explicitly sharded inputs (a mesh of `Explicit` axes) the shardings are known while
    tracing: an unsupported one fails here, naming the mesh axes, rather than at compile time."""
    for name, x in zip(names, args, strict=True):
        sharding = getattr(jax.typeof(x), "sharding", None)
        spec = getattr(sharding, "spec", None)
        if not spec:
            continue
        sizes = dict(getattr(sharding.mesh, "shape", {}))
        for dim, (label, entry) in enumerate(zip(layout(name, x.shape), spec)):
            axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            if math.prod(sizes.get(a, 2) for a in axes) > 1 and not shardable(label):
                raise ValueError(
                    Plan._unshardable_message(what, name, dim, label, f"over mesh axes {axes}")
                )


def sharded_reduction(local: Callable[[jax.Array], jax.Array], axis: int) -> Callable:
    """`local` (a reduction over `axis`, kept as size 1, in a fixed order that does not depend
    on XLA's threading), or, where the program runs on several devices and `axis` may be
    sharded, XLA's own sum (each device sums its shard, one all-reduce adds them); ordering
    elementwise adds across a sharded dim would move data between devices instead."""

    def body(x):
        return (local(x),)

    def summed(x):
        return (jnp.sum(x, axis=axis, keepdims=True),)

    call_body = device_aware(body, summed, "attnaux (a parameter gradient's sum)")
    mapped = custom_vmap(lambda x: call_body(x)[0])

    @mapped.def_vmap
    def _(axis_size, in_batched, x):  # the mapped axis is axis 0: reduce the next ones
        del axis_size, in_batched
        return jax.vmap(local)(x), True

    def call(x):  # inside `jax.shard_map` the sum varies like `x` (the traced call loses it)
        return match_vma(mapped(x), vma(x))

    return call


# ------------------------------------------------------------------------------------------------
# Lowering with or without devices (jax.export)
# ------------------------------------------------------------------------------------------------
_kernel_call_p = jax.extend.core.Primitive("attnaux_kernel_call")
_kernel_call_p.multiple_results = True


@_kernel_call_p.def_abstract_eval
def _abstract_eval(*avals, body, partitioned, what, out_avals):
    return out_avals


@_kernel_call_p.def_impl
def _impl(*args, body, partitioned, what, out_avals):
    return jax.jit(body)(*args)


def _lowering(ctx, *values, body, partitioned, what, out_avals):
    axis_context = ctx.module_context.axis_context
    devices = getattr(axis_context, "device_assignment", None)
    num_devices = getattr(axis_context, "num_devices", 1)
    manual = frozenset(getattr(axis_context, "manual_axes", ()) or ())
    mesh = getattr(axis_context, "mesh", None)
    if manual and mesh is not None and manual == frozenset(mesh.axis_names):
        # Inside `jax.shard_map` (every mesh axis manual): the kernel runs on the local block.
        return jax.interpreters.mlir.lower_fun(body, multiple_results=True)(ctx, *values)
    params = getattr(ctx.module_context, "lowering_parameters", None)
    exporting = bool(getattr(params, "for_export", False))
    if devices is None and num_devices > 1 and not exporting:
        # A jit over several devices that JAX lowers without its device list (it passes one
        # only to primitives it knows need it, and listing this one would forbid jax.export).
        # The partitioning needs only the mesh's shape: shardings are positions in it, so any
        # devices of that number stand in for the computation's own.
        ctx = _with_devices(ctx, axis_context, num_devices)
        return jax.interpreters.mlir.lower_fun(partitioned, multiple_results=True)(ctx, *values)
    if devices is None and num_devices > 1:
        # Lowered for several devices without knowing which (jax.export): the partitioning is a
        # callback into this process at compile time, which an exported artifact cannot carry,
        # and a plain custom call would be gathered onto every device.
        raise ValueError(
            f"{what}: exporting attnaux for {num_devices} devices under jax.jit is not "
            "supported (its partitioning is a compile-time callback into this process, which an "
            "artifact cannot carry). Put the attention inside `jax.shard_map`, which lowers the "
            "kernels per device and exports (docs/sharding.md)."
        )
    # `custom_partitioning` lowers `body` itself on one device and inside `jax.shard_map`.
    fn = body if devices is None and num_devices <= 1 else partitioned
    return jax.interpreters.mlir.lower_fun(fn, multiple_results=True)(ctx, *values)


def _with_devices(ctx, axis_context, num_devices: int):
    """`ctx` with `num_devices` devices in its sharding context (see `_lowering`)."""
    platforms = getattr(ctx.module_context, "platforms", None) or (None,)
    try:
        devices = jax.devices(platforms[0])
    except RuntimeError:
        devices = jax.devices()
    if len(devices) < num_devices:
        raise ValueError(
            f"attnaux: lowering for {num_devices} devices, but this process sees only "
            f"{len(devices)}."
        )
    axis_context = dataclasses.replace(axis_context, device_assignment=tuple(devices[:num_devices]))
    return ctx.replace(module_context=ctx.module_context.replace(axis_context=axis_context))


jax.interpreters.mlir.register_lowering(_kernel_call_p, _lowering)


def device_aware(body: Callable, partitioned: Callable, what: str) -> Callable:
    """`body`'s call as one primitive whose lowering is `partitioned` (the `custom_partitioning`
    of `body`) where the devices are known, else `body`. `jax.export` lowers with no devices, and
    JAX refuses to lower `custom_partitioning` there at all; this is what lets a function that
    calls attnaux export (on one device, or per device inside `jax.shard_map`)."""

    def call(*args):
        out_avals = tuple(
            jax.core.ShapedArray(o.shape, o.dtype) for o in jax.eval_shape(body, *args)
        )
        return tuple(_kernel_call_p.bind(*args, body=body, partitioned=partitioned, what=what,
                                         out_avals=out_avals))

    return call
