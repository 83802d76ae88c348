"""attnaux's own Hopper (sm_90a) attention kernels, written in Pallas Mosaic GPU.

The forward is FlashAttention-3's design: per CTA two *consumer* warpgroups of 64 query rows each
and one *producer* warpgroup that streams K and V tiles with the bulk tensor copy engine (TMA)
into a ring of shared-memory slots; the consumers run the matrix products on wgmma and take turns
on the tensor cores (a *schedule barrier*: one warpgroup's softmax overlaps the other's matrix
products). At head dim 128 each warpgroup also overlaps itself (`_walk_overlapped`, FA3's
intra-warpgroup overlap): the softmax of tile t runs while P(t-1) V(t-1) is on the tensor cores.
CTAs run longest first across heads, in sections of heads whose K and V fit in L2 together
(`_cta_work`, FlashAttention-3's tile order). It returns what every attnaux backend returns: out,
and per row the natural-log `lse` and the `max` of the (modified, scaled) scores, float32. The
pipeline's protocol (barrier phases, slots in flight) is simulated on the CPU in
`tests/test_hopper_walk.py`.

What the kernels apply to the scores, in attnaux's order (`scale * q k^T`, `softcap`, the tile
function, then the masks): the causal (top-left / bottom-right) and window geometry with tile
skipping (a CTA visits only the key tiles its rows can see; only the tiles on a boundary pay for
the mask), the key-length bound, and a *tile function* `fn(s, q_pos, kv_pos, rows, cols) ->
(s, visible)` traced into the kernel (`_hopper_mods.py` builds it from a score program: the part
of `score_mod`/`mask_mod` that depends on both positions runs here; what depends on one side
only arrives as per-row and per-column float32 vectors).

The backward is two kernels of the same shape (dK/dV over query tiles for 64-key blocks, dQ over
key tiles for 64-row blocks), with the lse cotangent folded into the row term,
dS = P * (dP - (D - dlse)), at no extra cost; the tile function's derivative comes from
`jax.vjp` of the same function, traced into the kernels, and its row/column inputs receive their
gradients as row sums (dQ kernel) and column sums (dK/dV kernel). In this form each output
element is summed by one warpgroup in a fixed order, so the gradients are bitwise reproducible.

At head dim 64 (`Config.fused_dq`, `default_config`) the dK/dV kernel also sums dQ, as
FlashAttention-3 does (5 matrix products per tile pair instead of 7): the two warpgroups share
their dS tiles through shared memory and take turns on each query tile's dQ product, which is
bulk-reduce-added in float32 into a zeroed buffer. H100, bf16, forward+backward: 1.07-1.18x the
two kernels at head dim 64; at 128 the extra product spills the dK/dV kernel's registers and
runs 0.78-0.89x, so 128 keeps the two kernels. The reduce-adds' order varies from run to run:
XLA's `--xla_gpu_deterministic_ops` flag selects the two kernels everywhere.

A third backward, for plain scores at head dim 128, is CUDA C++ with CuTe
(`csrc/cuda/hopper_bwd_kernel.cuh`, built where the CUTLASS headers are found): one kernel in
FlashAttention-3's operand placement (S and dP transposed, P and dS fed to the dV and dK
products from the registers, dQ bulk-reduce-added in float32) and its feeding (a TMA producer
warpgroup, an mbarrier pipeline, setmaxnreg). It is exact and serves by default
(`Config.cuda_backward`, `default_config`) where it measured faster than the Pallas backward.

Pallas Mosaic GPU ships with jaxlib; it is imported lazily (only on a GPU), as it needs
`absl`, which CPU installs may lack.
"""

import dataclasses
import functools
import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
BLOCK_Q = 64  # query rows per consumer warpgroup (wgmma's M)
COMPUTE_WGS = 2
SUPPORTED_HEAD_DIMS = (64, 128)


def _pallas():
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    return pl, plgpu


def device_unavailable(q, k, v) -> str | None:
    """Why the Hopper kernels cannot take these arrays on this device (None: they can)."""
    devices = jax.devices()
    capability = getattr(devices[0], "compute_capability", "") if devices else ""
    if not str(capability).startswith("9."):
        return (f"attnaux's own kernels need a Hopper GPU (compute capability 9.x); this "
                f"device has {capability or 'none'}")
    try:
        _pallas()
    except ImportError as error:
        return f"Pallas Mosaic GPU does not import ({error})"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return (f"the Hopper kernels take bfloat16 or float16 q, k, v (got {q.dtype}, {k.dtype}, "
                f"{v.dtype})")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS or v.shape[-1] != q.shape[-1]:
        return (f"the Hopper kernels take head dims 64 and 128, equal for q/k and v (got "
                f"{q.shape[-1]} and {v.shape[-1]})")
    return None


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The static masking rules of a call, in the padded problem's coordinates.

    `offset`: key position aligned with query position 0 (0 top-left; kv_len - q_len
    bottom-right); causal means kv <= q + offset; a window (left, right) means
    q + offset - left <= kv <= q + offset + right. `kv_len`: keys at or beyond are padding.

    `packed`: positions, segments and padding come per token as data instead (`infos` of the
    kernels, `_packed_visible`): the rules above hold between a row's *aligned position* and a
    key's position, within a segment; `offset`, `kv_len` and `q_len` are then unused, and the
    block tables alone bound the tiles visited."""

    causal: bool
    window: tuple[int, int] | None
    offset: int
    kv_len: int
    q_len: int
    packed: bool = False


@dataclasses.dataclass(frozen=True)
class TileFn:
    """A function traced into the kernels: `fn(s, q_pos, kv_pos, b, h, rows, cols) -> (s,
    visible | None)`. `s` float32 scores of a tile, `q_pos`/`kv_pos` int32 tiles of the global
    positions, `b`/`h` int32 scalars (the batch and query-head index; from the kernels'
    `indices` where given), `rows`/`cols` tuples of float32 tiles (the per-row and
    per-column inputs broadcast). `n_rows`/`n_cols`: how many inputs of each kind. `key`: a
    hashable identity (the score program), so that the kernels are cached per function."""

    fn: Callable
    n_rows: int
    n_cols: int
    masks: bool
    key: object

    def __hash__(self):
        return hash((self.key, self.n_rows, self.n_cols, self.masks))

    def __eq__(self, other):
        return (isinstance(other, TileFn) and self.key == other.key
                and (self.n_rows, self.n_cols, self.masks)
                == (other.n_rows, other.n_cols, other.masks))


def _ranges(g: Geometry, q_lo, q_hi, block_kv: int, n_kv_tiles: int):
    """Key tiles `[lo, hi)` that rows `[q_lo, q_hi)` can see, and `[full_lo, full_hi)` inside it
    whose every pair is visible to every row (no mask needed). int32 scalars in the kernel."""
    i32 = jnp.int32
    if g.packed:  # the block tables bound the tiles
        return i32(0), i32(n_kv_tiles), i32(0), i32(n_kv_tiles)
    hi_pos = jnp.asarray(g.kv_len, i32)  # one past the last visible key
    lo_pos = jnp.asarray(0, i32)
    full_lo_pos = jnp.asarray(0, i32)  # first key seen by every row
    full_hi_pos = jnp.asarray(g.kv_len, i32)  # one past the last key seen by every row
    if g.causal:
        hi_pos = jnp.minimum(hi_pos, q_hi - 1 + g.offset + 1)
        full_hi_pos = jnp.minimum(full_hi_pos, q_lo + g.offset + 1)
    if g.window is not None:
        left, right = g.window
        hi_pos = jnp.minimum(hi_pos, q_hi - 1 + g.offset + right + 1)
        full_hi_pos = jnp.minimum(full_hi_pos, q_lo + g.offset + right + 1)
        lo_pos = jnp.maximum(lo_pos, q_lo + g.offset - left)
        full_lo_pos = jnp.maximum(full_lo_pos, q_hi - 1 + g.offset - left)
    full_hi_pos = jnp.where(q_hi > g.q_len, 0, full_hi_pos)  # rows of padding: masked
    hi = jnp.clip(lax.div(hi_pos + (block_kv - 1), i32(block_kv)), 0, n_kv_tiles)
    lo = jnp.clip(lax.div(jnp.maximum(lo_pos, 0), i32(block_kv)), 0, hi)
    full_lo = jnp.clip(lax.div(full_lo_pos + (block_kv - 1), i32(block_kv)), lo, hi)
    full_hi = jnp.clip(lax.div(jnp.maximum(full_hi_pos, 0), i32(block_kv)), full_lo, hi)
    return lo, hi, full_lo, full_hi


def _q_ranges(g: Geometry, k_lo, k_hi, block_q: int, n_q_tiles: int):
    """Query tiles `[lo, hi)` whose rows see some key of `[k_lo, k_hi)`, and `[full_lo,
    full_hi)` inside it whose rows see every key of it (the transpose of `_ranges`)."""
    i32 = jnp.int32
    if g.packed:
        return i32(0), i32(n_q_tiles), i32(0), i32(n_q_tiles)
    lo_pos = jnp.asarray(0, i32)
    hi_pos = jnp.asarray(g.q_len, i32)
    full_lo_pos = jnp.asarray(0, i32)
    full_hi_pos = jnp.asarray(g.q_len, i32)
    if g.causal:
        lo_pos = jnp.maximum(lo_pos, k_lo - g.offset)
        full_lo_pos = jnp.maximum(full_lo_pos, k_hi - 1 - g.offset)
    if g.window is not None:
        left, right = g.window
        lo_pos = jnp.maximum(lo_pos, k_lo - g.offset - right)
        full_lo_pos = jnp.maximum(full_lo_pos, k_hi - 1 - g.offset - right)
        hi_pos = jnp.minimum(hi_pos, k_hi - 1 - g.offset + left + 1)
        full_hi_pos = jnp.minimum(full_hi_pos, k_lo - g.offset + left + 1)
    hi_pos = jnp.where(k_lo >= g.kv_len, 0, hi_pos)  # keys that are all padding
    full_hi_pos = jnp.where(k_hi > g.kv_len, 0, full_hi_pos)  # a tile with padding keys
    hi = jnp.clip(lax.div(jnp.maximum(hi_pos, 0) + (block_q - 1), i32(block_q)), 0, n_q_tiles)
    lo = jnp.clip(lax.div(jnp.maximum(lo_pos, 0), i32(block_q)), 0, hi)
    full_lo = jnp.clip(lax.div(full_lo_pos + (block_q - 1), i32(block_q)), lo, hi)
    full_hi = jnp.clip(lax.div(jnp.maximum(full_hi_pos, 0), i32(block_q)), full_lo, hi)
    return lo, hi, full_lo, full_hi


def _all_masked(tile_fn, tables) -> bool:
    """Whether every visited tile needs the masks: a mask_mod without a block table."""
    return tile_fn is not None and tile_fn.masks and tables is None


def _with_table(ranges, table_ref, b, h, block):
    """`ranges` intersected with a block table's row `table_ref[b|0, h|0, block]`."""
    if table_ref is None:
        return ranges
    bt, ht = table_ref.shape[0], table_ref.shape[1]
    row = table_ref.at[b if bt > 1 else 0, h if ht > 1 else 0, block]
    lo_t, hi_t, full_lo_t, full_hi_t = (row[i] for i in range(4))
    lo, hi, full_lo, full_hi = ranges
    lo = jnp.maximum(lo, lo_t)
    hi = jnp.maximum(jnp.minimum(hi, hi_t), lo)
    full_lo = jnp.clip(jnp.maximum(full_lo, full_lo_t), lo, hi)
    full_hi = jnp.clip(jnp.minimum(full_hi, full_hi_t), full_lo, hi)
    return lo, hi, full_lo, full_hi


L2_STREAM_BYTES = 32 * 1024 * 1024  # what the CTAs running at once may stream through L2


def _cta_work(n_tiles: int, n_heads: int, bsz: int, stream_bytes: int, group: int = 1,
              longest: str = "last"):
    """`(tile, b, h)` of this CTA, from its place in a one-dimensional grid (`"cta"`).

    The GPU starts CTAs in grid order, one at a time per SM as one ends. Two things matter:
    - **Longest first.** Under a causal mask tiles cost different amounts (`longest`: `"last"`
      when the last tile sees the most, the forward and dQ; `"first"` for dK/dV). Starting the
      longest first keeps every SM busy to the end. Pallas's grid puts its *last* axis first,
      so a grid `(heads, tiles, batch)` ran each head's tiles longest first and then the next
      head's: the tail of short tiles of every head met the next head's long ones, ~10% of
      the causal time lost at 1024-8192 tokens (a list-schedule simulation of 132 SMs
      agreed with the measured gap).
    - **L2.** Every tile of one (batch, head) streams the same K and V (Q and dO for dK/dV):
      `stream_bytes` each. The CTAs are taken in sections of heads whose streams fit in
      `L2_STREAM_BYTES` together (FlashAttention-3's tile scheduler does the same), and inside
      a section tile by tile, longest first, each tile over the section's heads. `group`: query
      heads that share a stream (GQA) count once."""
    return _cta_place(lax.axis_index("cta"), n_tiles, n_heads, bsz, stream_bytes, group,
                      longest)


def _kv_stream_bytes(k) -> int:
    """What every query tile of one (batch, kv head) streams: its K and V (`_cta_work`'s
    `stream_bytes` for the forward and the dQ kernel)."""
    return 2 * k.shape[1] * k.shape[3] * k.dtype.itemsize


def _cta_place(cta, n_tiles: int, n_heads: int, bsz: int, stream_bytes: int, group: int,
               longest: str):
    """`_cta_work` for the CTA index `cta` (int32, any shape: `tests/test_hopper_walk.py`
    checks the order on the CPU)."""
    heads_all = n_heads * bsz
    fit = max(1, L2_STREAM_BYTES // max(stream_bytes, 1))
    section = min(heads_all, (1 << (fit.bit_length() - 1)) * group)
    i32 = jnp.int32
    first = lax.div(cta, i32(n_tiles * section)) * i32(section)  # the section's first head
    size = jnp.minimum(i32(section), i32(heads_all) - first)  # the last one may be short
    within = cta - first * i32(n_tiles)
    rank = lax.div(within, size)
    pair = first + lax.rem(within, size)
    tile = i32(n_tiles - 1) - rank if longest == "last" else rank
    return tile, lax.div(pair, i32(n_heads)), lax.rem(pair, i32(n_heads))


def _union(r0, r1):
    """The CTA's stream: from the first to the last tile of its two warpgroups' ranges."""
    big = jnp.int32(2**30)
    lo = jnp.minimum(jnp.where(r0[0] < r0[1], r0[0], big), jnp.where(r1[0] < r1[1], r1[0], big))
    hi = jnp.maximum(jnp.where(r0[0] < r0[1], r0[1], 0), jnp.where(r1[0] < r1[1], r1[1], 0))
    lo = jnp.minimum(lo, hi)
    return lo, hi


def _pick(wg, r0, r1):
    return tuple(jnp.where(wg == 0, a, b) for a, b in zip(r0, r1))


def _walk(cta_lo, cta_hi, ranges, visit, skip, carry, *, all_masked: bool):
    """A consumer's pass over its CTA's stream of tiles `[cta_lo, cta_hi)`: `skip` the steps
    outside its own `[lo, hi)` (they still release the slots, so the barriers' phases stay in
    step with the producer), `visit` the others, masked only outside `[full_lo, full_hi)`."""
    lo, hi, full_lo, full_hi = ranges
    lo = jnp.clip(lo, cta_lo, cta_hi)
    hi = jnp.clip(hi, lo, cta_hi)
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    lax.fori_loop(cta_lo, lo, skip, None)
    if all_masked:
        carry = lax.fori_loop(lo, hi, functools.partial(visit, masked=True), carry)
    else:
        carry = lax.fori_loop(lo, full_lo, functools.partial(visit, masked=True), carry)
        carry = lax.fori_loop(full_lo, full_hi, functools.partial(visit, masked=False), carry)
        carry = lax.fori_loop(full_hi, hi, functools.partial(visit, masked=True), carry)
    lax.fori_loop(hi, cta_hi, skip, None)
    return carry


def _accumulator_store(acc_ref, value):
    """Sets a wgmma accumulator (of `pl.run_scoped`) to `value`: `plgpu.ACC.init` serves only
    `pl.run_state`, whose scope returns nothing but the accumulators, and the overlapped forward
    needs the softmax's results out of the scope where its product runs."""
    from jax._src.pallas.mosaic_gpu.primitives import wgmma_accumulator_store
    wgmma_accumulator_store(acc_ref, value)


def _walk_overlapped(pl, plgpu, cta_lo, cta_hi, ranges, carry, *, scores, softmax, k_smem,
                     v_smem, q_smem, ready, free, slot_of, turns, shape, dtype,
                     all_masked: bool):
    """The forward consumer's pass with FlashAttention-3's intra-warpgroup overlap: step `t`
    issues S(t) = Q K(t)^T and then O += P(t-1) V(t-1) in one turn, and computes the softmax
    of S(t) while the second product runs; O is rescaled once that product is done. Steps
    outside the warpgroup's own `[lo, hi)` only release their slots and pass the turn on (each
    step of the stream takes exactly one turn and one wait on each of its barriers, so the
    phases stay paired with the producer and the other warpgroup)."""
    k_ready, v_ready = ready
    k_free, v_free = free
    my_turn, other_turn = turns
    lo, hi, full_lo, full_hi = ranges
    lo = jnp.clip(lo, cta_lo, cta_hi)
    hi = jnp.clip(hi, lo, cta_hi)

    def skip(step, _):
        slot = slot_of(step)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        plgpu.barrier_wait(my_turn)
        plgpu.barrier_arrive(other_turn)
        return None

    def first(c):
        acc, m, denom, _ = c
        slot = slot_of(lo)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(my_turn)

        def qk(s_ref):
            plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            plgpu.barrier_arrive(other_turn)
            return plgpu.wgmma_accumulator_load(s_ref, wait_n=0)

        s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        p, m, denom, _ = softmax(scores(s, lo, True), lo, m, denom)  # acc is 0
        return acc, m, denom, p.astype(dtype)

    def step_body(step, c, masked):
        acc, m, denom, p16 = c
        slot, prev = slot_of(step), slot_of(step - 1)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[prev])
        plgpu.barrier_wait(my_turn)

        def products(s_ref, o_ref):
            _accumulator_store(o_ref, acc)
            plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            plgpu.wgmma(o_ref, p16, v_smem.at[prev])
            plgpu.barrier_arrive(other_turn)
            s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S(t) done, P V may run
            plgpu.barrier_arrive(k_free.at[slot])
            p_new, m_new, denom_new, alpha = softmax(scores(s, step, masked), step, m, denom)
            acc_new = plgpu.wgmma_accumulator_load(o_ref, wait_n=0)
            # P(t-1) is an operand of the product in flight until here: keeping it alive (and
            # converting P(t) only now, as FlashAttention-3 does) stops the register allocator
            # from reusing its registers early, which makes ptxas serialize every wgmma
            acc_new, _ = lax.optimization_barrier((acc_new, p16))
            return acc_new, m_new, denom_new, p_new, alpha

        acc, m, denom, p, alpha = pl.run_scoped(
            products, plgpu.ACC(shape, jnp.float32), plgpu.ACC(acc.shape, jnp.float32))
        plgpu.barrier_arrive(v_free.at[prev])
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        return acc, m, denom, p.astype(dtype)

    def last(c):
        acc, m, denom, p16 = c
        slot = slot_of(hi - 1)
        plgpu.barrier_wait(v_ready.at[slot])

        def pv(o_ref):
            plgpu.wgmma(o_ref, p16, v_smem.at[slot])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m, denom, p16

    acc, m, denom = carry
    p16 = plgpu.layout_cast(jnp.zeros(shape, dtype), plgpu.Layout.WGMMA)
    c = (acc, m, denom, p16)
    lax.fori_loop(cta_lo, lo, skip, None)
    c = lax.cond(lo < hi, first, lambda c: c, c)
    after = jnp.minimum(lo + 1, hi)
    if all_masked:
        c = lax.fori_loop(after, hi, functools.partial(step_body, masked=True), c)
    else:
        full_lo = jnp.clip(full_lo, after, hi)
        full_hi = jnp.clip(full_hi, full_lo, hi)
        c = lax.fori_loop(after, full_lo, functools.partial(step_body, masked=True), c)
        c = lax.fori_loop(full_lo, full_hi, functools.partial(step_body, masked=False), c)
        c = lax.fori_loop(full_hi, hi, functools.partial(step_body, masked=True), c)
    c = lax.cond(lo < hi, last, lambda c: c, c)
    lax.fori_loop(hi, cta_hi, skip, None)
    return c[:3]


def _produce(pl, plgpu, cta_lo, cta_hi, stages: int, items):
    """The producer warpgroup: streams step `t` of `[cta_lo, cta_hi)` into slot `(t - cta_lo)
    % stages` for every `(source(t) -> GMEM view, SMEM slots, ready, free)` of `items`, waiting
    for the consumers to free a slot before refilling it."""

    def fill(step, slot, wait):
        for source, smem, ready, free in items:
            if wait:
                plgpu.barrier_wait(free.at[slot])
            plgpu.copy_gmem_to_smem(source(step), smem.at[slot], ready.at[slot])

    for i in range(stages):
        pl.when(cta_lo + i < cta_hi)(functools.partial(fill, cta_lo + i, i, False))

    @pl.loop(cta_lo + stages, cta_hi)
    def _(step):
        fill(step, lax.rem(step - cta_lo, jnp.array(stages, jnp.int32)), True)


def _geometry_visible(g: Geometry, q_pos, kv_pos):
    visible = (kv_pos < g.kv_len) & (q_pos < g.q_len)
    if g.causal:
        visible &= kv_pos <= q_pos + g.offset
    if g.window is not None:
        left, right = g.window
        visible &= (kv_pos >= q_pos + g.offset - left) & (kv_pos <= q_pos + g.offset + right)
    return visible


PAD_ROW = -(2**31)
"""The aligned position of a query row that is padding (`infos`): it sees no key."""


def _packed_visible(g: Geometry, q_seg, q_at, kv_seg, kv_at):
    """Which pairs of a tile are visible from per-token data: the same segment, a key that is
    not padding (position >= 0), a row that is not padding (`PAD_ROW`), and the causal and
    window rules between the row's aligned position and the key's position."""
    visible = (q_seg == kv_seg) & (kv_at >= 0) & (q_at != PAD_ROW)
    if g.causal:
        visible &= kv_at <= q_at
    if g.window is not None:
        left, right = g.window
        visible &= (kv_at >= q_at - left) & (kv_at <= q_at + right)
    return visible


_INLINED = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
            "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr"}


def _eval_lowerable(jaxpr, consts, args):
    """Evaluates `jaxpr` by binding its primitives again, with the two that Mosaic GPU does not
    lower replaced: `add_any` (jax.vjp's sum of cotangents) by `add`, `stop_gradient` (whose
    work is done once the derivative is traced) by the identity; nested calls inlined."""
    env = {}

    def read(v):
        return v.val if hasattr(v, "val") and not hasattr(v, "count") else env[v]

    for var, value in zip(jaxpr.constvars, consts):
        env[var] = value
    for var, value in zip(jaxpr.invars, args):
        env[var] = value
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "add_any":
            outs = [ins[0] + ins[1]]
        elif name == "stop_gradient":
            outs = ins[:1]
        elif name == "integer_pow":  # lowered for few exponents: square and multiply
            outs = [_power(ins[0], eqn.params["y"])]
        elif name in _INLINED:
            inner = eqn.params[_INLINED[name]]
            inner_jaxpr = getattr(inner, "jaxpr", inner)
            outs = _eval_lowerable(inner_jaxpr, getattr(inner, "consts", ()), ins)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def _power(x, y: int):
    if y == 0:
        return jnp.ones_like(x)
    acc, base, n = None, x, abs(y)
    while n:
        if n & 1:
            acc = base if acc is None else acc * base
        n >>= 1
        if n:
            base = base * base
    return lax.div(jnp.ones_like(acc), acc) if y < 0 else acc


def _lowerable(fn):
    """`fn`, traced to a jaxpr and emitted again through `_eval_lowerable`."""
    def run(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = _eval_lowerable(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), flat)
    return run


def _modify(s, q_pos, kv_pos, b, h, rows, cols, *, scale, softcap, tile_fn, geometry, masked):
    """The scores of a tile after scale, softcap, the tile function and the masks; the
    visibility (None when every pair is visible)."""
    s = s * scale
    if softcap is not None:
        s = jnp.tanh(s * (1.0 / softcap)) * softcap
    visible = None
    if tile_fn is not None:
        s, fn_visible = _lowerable(tile_fn.fn)(s, q_pos, kv_pos, b, h, rows, cols)
        if masked:  # a tile outside the masked steps is whole under mask_mod's block table
            visible = fn_visible
    if masked:
        geo = _geometry_visible(geometry, q_pos, kv_pos)
        visible = geo if visible is None else (visible & geo)
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    return s, visible


@dataclasses.dataclass(frozen=True)
class Config:
    """`block_kv`: keys per tile; `stages`: K/V tiles in flight; `overlap`: the forward's
    intra-warpgroup overlap (`_walk_overlapped`) instead of one product at a time; `fused_dq`:
    the backward sums dQ inside the dK/dV kernel (float32 bulk reduce-adds into a zeroed
    buffer, FlashAttention-3's way: 5 matrix products per tile pair) instead of a second kernel
    that recomputes S and dP (7). The fused order of the float32 additions varies from run to
    run; `fused_dq=False` is bitwise reproducible. `registers`: the registers a thread of the
    consumer and of the producer warpgroups asks for (`set_max_registers`; the three
    warpgroups' total must stay within the SM's 64K); `backward_*`: the same for the backward's
    kernels. The backward's three stages and FlashAttention-3's 240/24 split measured 1.00-1.06x
    forward+backward together (H100, bf16, 4x2048 and 1x8192 x16x128, 2x4096x32x64, causal and
    not, one A/B run); in the forward 240/24 measured 0.98-1.03x, within noise, and a third
    stage at head dim 128 (room for it since the row statistics skip shared memory) 0.99-1.02x
    two (H100, 2x6144 and 8x1536 x16x128, one A/B run), so two stay."""

    block_kv: int = 128
    stages: int = 2
    overlap: bool = True
    fused_dq: bool = True
    registers: tuple[int, int] = (232, 40)  # a thread's registers: consumers, producer
    backward_stages: int = 3  # the backward's streamed tiles in flight
    backward_registers: tuple[int, int] = (240, 24)
    # the forward's lse and max through shared memory and TMA instead of stored from the
    # registers: the registers' stores measured 0.96-1.03x (five of six shapes faster; H100,
    # head dims 128 and 64) and leave shared memory for a third stage at head dim 128
    stats_in_smem: bool = False
    # plain scores' backward (no softcap, tile function, dropout or packing) at head dim 128 in
    # the CUDA C++ kernel (csrc/cuda/hopper_bwd.cu, CuTe) where it was built: 5 products per
    # tile pair, dQ bulk-reduce-added in float32, so not bitwise reproducible (never under XLA's
    # deterministic mode). `default_config` says where it serves
    cuda_backward: bool = False
    # plain scores' forward (no softcap, tile function, dropout or packing) at head dims 64,
    # 128 and 256 in the CUDA C++ kernel (csrc/cuda/hopper_fwd.cu, CuTe: persistent,
    # FlashAttention-3's warp-specialized forward) where it was built. Opt-in: not yet ahead of
    # the Pallas forward (`default_config`)
    cuda_forward: bool = False


def default_config(head_dim: int, kv_seq: int | None = None, *, banded: bool = False) -> Config:
    """The kernels' configuration for a head dim and, where known (None: not known, or not
    to be widened), the padded key length the forward sees; `banded`: a causal or window
    geometry. At head dim 64 the forward takes 256-key tiles where they divide the keys and,
    when banded, from 4096 keys on: a tile's products there are short next to its fixed cost
    (the turn, the barriers, the row reductions). H100, bf16, forward, 256 / 128 keys: 1.08 /
    1.12 / 1.01 without a mask at 2x4096x32 / 1x16384x16 / 8x1024x32 x64, 1.06 / 1.13 causal at
    the first two, but 0.92 causal at 8x1024, where the diagonal's half-masked 256-key tiles
    cost more than the fewer turns save (docs/performance.md, 2026-11-27 third session). At
    head dim 128, 192 keys exceed the shared memory by 104 bytes and wgmma takes no 176-key
    P V (its K must be a multiple of 64)."""
    # the overlap measured 1.04-1.14x at head dim 128 and 0.96-0.98x at 64 (H100, bf16,
    # `benchmarks/gpu_hopper.py` shapes): at 64 the softmax is short next to the products'
    # issue, and the second accumulator's registers cost more than the overlap gives.
    # The fused dQ measured 1.07-1.18x the two-kernel backward forward+backward at head dim 64
    # (2x4096x32x64, 8x1024x16x64) and 0.78-0.89x at 128, where ptxas spilled 690-860 bytes a
    # thread in the dK/dV kernel beside dK's and dV's 64 x 128 float32 accumulators (32-250
    # without it; docs/performance.md, sixth session)
    # The CUDA C++ backward measured 1.09-1.21x the Pallas backward at head dim 128 (backward
    # alone, H100, bf16: 4x2048x16 and 1x8192x16 without a mask, 1x8192x16 causal) but 0.96x
    # causal at 4x2048 (0.94x forward+backward), where the diagonal's masked tiles weigh more:
    # it serves except banded below 4096 keys (docs/performance.md, 2026-11-27 fifth session)
    wide = (head_dim <= 64 and kv_seq is not None and kv_seq % 256 == 0
            and (not banded or kv_seq >= 4096))
    # The CUDA C++ forward (`cuda_forward`) stays opt-in: it measured 0.96-1.06x the Pallas
    # forward at head dims 64 and 128, causal or not, by the minimum of the rounds
    # (`tools/gpu_dev/fwd_ab.py`), 0.89-1.05x by the medians (`benchmarks/gpu_hopper.py`), and
    # 0.80-0.87x at 256 (H100, bf16; docs/performance.md, 2026-11-27 seventh session)
    cuda = head_dim == 128 and not (banded and (kv_seq is None or kv_seq < 4096))
    return Config(block_kv=256 if wide else 128 if head_dim <= 128 else 64, stages=2,
                  overlap=head_dim >= 128 and _accumulator_store_available(),
                  fused_dq=head_dim <= 64 and not deterministic_requested(),
                  cuda_backward=cuda)


def deterministic_requested() -> bool:
    """Whether XLA was asked for deterministic GPU results (`--xla_gpu_deterministic_ops=true`
    in `XLA_FLAGS`, XLA's own switch for this): the backward then takes its bitwise
    reproducible two-kernel form instead of reduce-adding dQ."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == "--xla_gpu_deterministic_ops":
            return value.lower() in ("", "true", "1")
    return False


@functools.cache
def _accumulator_store_available() -> bool:
    """Whether this JAX has the (private) wgmma accumulator store the overlap needs; without it
    the forward takes the plain walk, same results, one product at a time."""
    try:
        from jax._src.pallas.mosaic_gpu.primitives import wgmma_accumulator_store  # noqa: F401
    except ImportError:
        return False
    return True


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "geometry", "tile_fn",
                                             "config", "dropout"))
def forward(q, k, v, rows, cols, *, scale: float, softcap, geometry: Geometry, tile_fn,
            config: Config, tables=None, infos=None, indices=None, dropout=None,
            drop_state=None):
    """`(out, lse, max)` for padded `q [B, Sq, Hq, D]`, `k`/`v [B, Skv, Hkv, D]` (Sq a multiple
    of 128, Skv of `config.block_kv`); `rows [B, Hq, n_rows, Sq]`, `cols [B, Hq, n_cols, Skv]`
    float32 (n = 0: shape with 0). lse/max `[B, Hq, Sq]` float32, natural log. `tables`: None
    or the block tables of `_hopper_mods.range_tables` (int32 `[Bt, Ht, blocks, 4]`, forward,
    dQ, dK/dV): each warpgroup visits only its row's range of them. `infos`: for a `packed`
    geometry, `(q_info [B, 2, Sq], kv_info [B, 2, Skv])` int32, each token's segment and
    position (the row's aligned position; `PAD_ROW` / -1 for padding), with `tables` built
    from them (`_hopper_packed.tables`). `indices`: None, or `(batch [B], heads [Hq])` int32,
    the batch and query-head index that the tile function sees for each entry of the arrays
    (a shard's global indices, `_hopper_mods`); None: the entry's own index. Only the tile
    function sees them: every array is read at the entry's own index. `dropout`: None, or the
    rate (static) with `drop_state` the 12-word block state (`docs/kernel_abi.md`): P times
    attnaux's keep-mask over `1 - rate` meets V; lse and max are of the scores, as always."""
    if _cuda_forward_serves(q, config, softcap=softcap, geometry=geometry, tile_fn=tile_fn,
                            tables=tables, dropout=dropout):
        return _cuda_forward(q, k, v, scale=scale, geometry=geometry)
    pl, plgpu = _pallas()
    _check_packed(geometry, tile_fn, tables, infos)
    packed = geometry.packed
    by_index = indices is not None and tile_fn is not None
    bsz, q_seq, q_heads, dim = q.shape
    drop_args = _drop_args(dropout, drop_state, bsz, q_heads, q_seq)
    kv_seq, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    dtype = q.dtype
    block_q, block_kv = BLOCK_Q, config.block_kv
    n_kv_tiles = kv_seq // block_kv
    stages = max(1, min(config.stages, n_kv_tiles))
    if config.overlap and stages < 2 and n_kv_tiles > 1:
        # a skipping warpgroup waits for its step's data before passing the turn on, and with
        # one slot that data waits for the other warpgroup's turn (`tests/test_hopper_walk.py`)
        raise ValueError(f"the overlapped forward needs config.stages >= 2 for {n_kv_tiles} key "
                         f"tiles; got {config.stages}")
    n_rows = tile_fn.n_rows if tile_fn is not None else 0
    n_cols = tile_fn.n_cols if tile_fn is not None else 0
    wgmma = plgpu.Layout.WGMMA
    row_layout, col_layout = wgmma.reduce(1), wgmma.reduce(0)
    mod = functools.partial(_modify, scale=scale, softcap=softcap, tile_fn=tile_fn,
                            geometry=geometry)
    plain = tile_fn is None and softcap is None
    # the scores' max in units of q.k (plain) or of the modified score; exp2 of
    # (x * c - m * c) is one FMA per element
    exp_scale = (scale * LOG2E) if plain else LOG2E

    table = None if tables is None else tables[0]
    overlap = config.overlap
    n_cta_tiles = q_seq // (COMPUTE_WGS * block_q)

    def kernel(*refs):
        q_ref, k_ref, v_ref = refs[:3]
        at = 3
        rows_ref = refs[at] if n_rows else None
        at += bool(n_rows)
        cols_ref = refs[at] if n_cols else None
        at += bool(n_cols)
        table_ref = refs[at] if table is not None else None
        at += table is not None
        qinfo_ref, kvinfo_ref = refs[at:at + 2] if packed else (None, None)
        at += 2 * packed
        index_refs = refs[at:at + 2] if by_index else None
        at += 2 * by_index
        seed_ref, erow_ref = refs[at:at + 2] if dropout else (None, None)
        at += 2 * bool(dropout)
        out_ref, lse_ref, max_ref, scratch, barriers = refs[at:]
        qo_smem2, k_smem, v_smem, *stat_smem2 = scratch
        stat_smem2 = stat_smem2[0] if stat_smem2 else None
        k_ready, v_ready, q_ready, k_free, v_free, turn, turn2 = barriers
        q_tile, b, h = _cta_work(n_cta_tiles, q_heads, bsz, _kv_stream_bytes(k), group)
        wg = lax.axis_index("wg")
        kvh = lax.div(h, jnp.array(group, h.dtype))
        cta_q0 = q_tile * (COMPUTE_WGS * block_q)
        wg_ranges = [
            _with_table(_ranges(geometry, cta_q0 + w * block_q, cta_q0 + (w + 1) * block_q,
                                block_kv, n_kv_tiles),
                        table_ref, b, h, lax.div(cta_q0, jnp.int32(block_q)) + w)
            for w in range(COMPUTE_WGS)]
        cta_lo, cta_hi = _union(*wg_ranges)

        def slot_of(step):
            return lax.rem(step - cta_lo, jnp.array(stages, jnp.int32))

        def take_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        @pl.when(wg < COMPUTE_WGS)
        def _consumer():
            plgpu.set_max_registers(config.registers[0], action="increase")
            qo_smem = qo_smem2.at[wg]
            q0 = cta_q0 + wg * block_q
            own = _pick(wg, *wg_ranges)
            fn_b, fn_h = _fn_index(index_refs, b, h)  # what the tile function sees
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, block_q), h], qo_smem,
                                    q_ready.at[wg])
            # the position tiles (64 registers a thread each) are built where a step uses
            # them rather than living across the walk: 1.03-1.14x forward on causal shapes
            def q_pos_tile():
                return plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0,
                                              layout=wgmma) + q0

            def kv_iota_tile():
                return plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=wgmma)
            row_vals = tuple(
                lax.broadcast_in_dim(
                    plgpu.load(rows_ref.at[b, h, r, pl.ds(q0, block_q)], layout=row_layout,
                               optimized=False),
                    (block_q, block_kv), [0])
                for r in range(n_rows))
            q_info = tuple(plgpu.load(qinfo_ref.at[b, c, pl.ds(q0, block_q)], layout=row_layout,
                                      optimized=False) for c in range(2)) if packed else ()
            if dropout:
                seeds = _read_seeds(seed_ref)
                e_rows = tuple(
                    lax.broadcast_in_dim(
                        plgpu.load(erow_ref.at[b, h, c, pl.ds(q0, block_q)], layout=row_layout,
                                   optimized=False),
                        (block_q, block_kv), [0])
                    for c in range(2))
            plgpu.barrier_wait(q_ready.at[wg])
            m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout)
            denom = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), row_layout)
            acc = plgpu.layout_cast(jnp.full((block_q, dim), 0.0, jnp.float32), wgmma)

            if overlap:
                # strict alternation of the two warpgroups' matrix-product issues, as
                # FlashAttention-3's scheduler barrier: wait for my turn, issue, pass it on
                my_turn, other_turn = turn2.at[wg], turn2.at[1 - wg]
                pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turn2.at[0]))
            else:
                my_turn = other_turn = None
                pl.when(wg == 1)(take_turn)

            def wait_k(step):
                plgpu.barrier_wait(k_ready.at[slot_of(step)])

            def wait_next_k(step):
                # every step of the stream waits for its K exactly once (the barriers'
                # phases stay paired), at the end of the step before it: in the P.V product's
                # scope, the wait overlaps that asynchronous wgmma (as JAX's Pallas FA3
                # example does)
                pl.when(step + 1 < cta_hi)(functools.partial(wait_k, step + 1))

            if not overlap:  # (the overlapped walk waits for itself)
                pl.when(cta_lo < cta_hi)(functools.partial(wait_k, cta_lo))

            def skip(step, carry):
                slot = slot_of(step)
                plgpu.barrier_arrive(k_free.at[slot])
                take_turn()
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                take_turn()
                wait_next_k(step)
                return carry

            def scores(s, step, masked):
                """The (modified, masked) scores of step `step`'s tile."""
                if plain and not masked:
                    return s
                kv_pos = kv_iota_tile() + step * block_kv
                q_pos = q_pos_tile()
                cols_v = tuple(
                    lax.broadcast_in_dim(
                        plgpu.load(cols_ref.at[b, h, c, pl.ds(step * block_kv, block_kv)],
                                   layout=col_layout, optimized=False),
                        (block_q, block_kv), [1])
                    for c in range(n_cols))
                if packed:  # the rules from the tokens' data, on the tiles that need them
                    x = s if plain else mod(s, q_pos, kv_pos, fn_b, fn_h, row_vals,
                                            cols_v, masked=False)[0]
                    if masked:
                        kv_info = tuple(
                            plgpu.load(kvinfo_ref.at[b, c, pl.ds(step * block_kv, block_kv)],
                                       layout=col_layout, optimized=False) for c in range(2))
                        vis = _packed_visible(
                            geometry, *(lax.broadcast_in_dim(x_, s.shape, [0])
                                        for x_ in q_info),
                            *(lax.broadcast_in_dim(x_, s.shape, [1]) for x_ in kv_info))
                        x = jnp.where(vis, x, -jnp.inf)
                    return x
                if plain:  # only the masks: keep q.k units
                    return jnp.where(_geometry_visible(geometry, q_pos, kv_pos), s, -jnp.inf)
                return mod(s, q_pos, kv_pos, fn_b, fn_h, row_vals, cols_v, masked=masked)[0]

            def softmax(x, step, m, denom):
                """`(p, m_new, denom_new, alpha)`: P of the tile (times the dropout factor),
                the running max and denominator, and the factor that rescales the output."""
                m_new = jnp.maximum(m, x.max(axis=1))
                m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new) * exp_scale
                alpha = jnp.exp2(m * exp_scale - m_base)
                p = jnp.exp2(x * exp_scale - lax.broadcast_in_dim(m_base, x.shape, [0]))
                denom = denom * alpha + p.sum(axis=1)  # of P before dropout
                if dropout:
                    p = p * _drop_factor(dropout, seeds, *e_rows, kv_iota_tile() + step * block_kv,
                                          _wide_mulhilo)
                return p, m_new, denom, alpha

            def visit(step, carry, masked):
                acc, m, denom = carry
                slot = slot_of(step)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                    take_turn()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                p, m_new, denom, alpha = softmax(scores(s, step, masked), step, m, denom)
                p16 = p.astype(dtype)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                acc, denom, m_new, p16 = lax.optimization_barrier((acc, denom, m_new, p16))
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    wait_next_k(step)

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, denom

            if overlap:
                carry = _walk_overlapped(
                    pl, plgpu, cta_lo, cta_hi, own, (acc, m, denom), scores=scores,
                    softmax=softmax, k_smem=k_smem, v_smem=v_smem, q_smem=qo_smem,
                    ready=(k_ready, v_ready), free=(k_free, v_free), slot_of=slot_of,
                    turns=(my_turn, other_turn), shape=(block_q, block_kv), dtype=dtype,
                    all_masked=_all_masked(tile_fn, table) or bool(dropout))
            else:
                # with dropout every tile pays for the keep-mask anyway: one visit body (the
                # masks' share is small), a third of the code to compile
                carry = _walk(cta_lo, cta_hi, own, visit, skip, (acc, m, denom),
                              all_masked=_all_masked(tile_fn, table) or bool(dropout))
            acc, m, denom = carry
            if not overlap:
                pl.when(wg == 0)(take_turn)

            seen = denom > 0.0
            # a NaN the row sees (its P and sum NaN): out, lse and max NaN, as in the reference,
            # not the zeros and -inf of a row that sees no key
            broken = denom != denom
            empty = jnp.where(broken, jnp.nan, -jnp.inf)
            inv = jnp.where(seen, 1.0 / jnp.where(seen, denom, 1.0),
                            jnp.where(broken, jnp.nan, 0.0))
            out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
            qo_smem[...] = out.astype(dtype)
            row_max = m * scale if plain else m
            lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, denom, 1.0)), empty)
            stats = ((lse, lse_ref.at[b, h, pl.ds(q0, block_q)]),
                     (jnp.where(seen, row_max, empty), max_ref.at[b, h, pl.ds(q0, block_q)]))
            if config.stats_in_smem:
                for i, (value, _) in enumerate(stats):
                    stat_smem2.at[wg].at[i][...] = value
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(q0, block_q), h])
            for i, (value, dest) in enumerate(stats):
                if config.stats_in_smem:
                    plgpu.copy_smem_to_gmem(stat_smem2.at[wg].at[i], dest)
                else:  # straight from the registers (no shared memory for them)
                    dest[...] = value
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            plgpu.set_max_registers(config.registers[1], action="decrease")

            def kv_tile(ref):
                return lambda step: ref.at[b, pl.ds(step * block_kv, block_kv), kvh]

            _produce(pl, plgpu, cta_lo, cta_hi, stages,
                     [(kv_tile(k_ref), k_smem, k_ready, k_free),
                      (kv_tile(v_ref), v_smem, v_ready, v_free)])

    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    scratch = (
        plgpu.SMEM((COMPUTE_WGS, block_q, dim), dtype, transforms=(tiling, swizzle)),
        plgpu.SMEM((stages, block_kv, dim), dtype, transforms=(tiling, swizzle)),
        plgpu.SMEM((stages, block_kv, dim), dtype, transforms=(tiling, swizzle)),
    ) + ((plgpu.SMEM((COMPUTE_WGS, 2, block_q), jnp.float32),) if config.stats_in_smem else ())
    barriers = (
        plgpu.Barrier(num_barriers=stages),  # k_ready
        plgpu.Barrier(num_barriers=stages),  # v_ready
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # q_ready
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # k_free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # v_free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # turn: the tensor-core schedule
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # turn2: each warpgroup's turn (overlap)
    )
    stats = jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32)
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype), stats, stats),
        grid=(n_cta_tiles * q_heads * bsz,),
        grid_names=("cta",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types=(scratch, barriers),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v, *([rows] if n_rows else []), *([cols] if n_cols else []),
      *([table] if table is not None else []), *(infos if packed else ()),
      *(indices if by_index else ()), *drop_args)


def _drop_args(dropout, drop_state, bsz: int, q_heads: int, q_seq: int):
    """The kernels' dropout operands: the seed words and `dropout_rows` (none without)."""
    if not dropout:
        return ()
    if not 0.0 < dropout < 1.0:
        raise ValueError(f"`dropout` must be a rate in (0, 1) or None; got {dropout!r}")
    if drop_state is None or tuple(drop_state.shape) != (12,):
        raise ValueError("dropout in the Hopper kernels needs `drop_state`, the 12-word block "
                         f"state; got {None if drop_state is None else drop_state.shape}")
    return (_dropout_seeds(drop_state), dropout_rows(drop_state, bsz, q_heads, q_seq))


def _fn_index(index_refs, b, h):
    """The batch and head index the tile function sees at grid entry `(b, h)`: read from the
    `indices` refs (int32 GMEM, as the block tables are read), or `(b, h)` without them."""
    if index_refs is None:
        return b, h
    return index_refs[0][b], index_refs[1][h]


DROPOUT_CHUNK = 16
"""Columns of a tile whose dropout words are drawn together: Philox's four words of a chunk are
what lives in registers (a whole 64 x 128 tile's would be 256 registers a thread)."""


def dropout_rows(state, bsz: int, q_heads: int, q_seq: int):
    """uint32 `[B, Hq, 2, Sq]`: the high and low words of the linear index `e` of key 0 of
    every row of the local problem in the whole one, from the 12-word block state
    (`docs/kernel_abi.md`: `e = (((b0 + b) * Hq' + h0 + h) * Sq' + i0 + i) * Skv' + j0 + j`);
    the kernels add the key's `j`."""
    from ._philox import add_with_carry, mulhilo

    w = jnp.asarray(state, jnp.uint32)
    b = jnp.arange(bsz, dtype=jnp.uint32)[:, None, None]
    h = jnp.arange(q_heads, dtype=jnp.uint32)[None, :, None]
    i = jnp.arange(q_seq, dtype=jnp.uint32)[None, None, :]
    row = ((w[4] + b) * w[8] + w[5] + h) * w[9] + w[6] + i
    e_hi, e_lo = add_with_carry(*mulhilo(row, w[10]), w[7])
    return jnp.stack([e_hi, e_lo], axis=2)


def _dropout_seeds(state):
    """The seed and offset words of a block state as int32 (the kernels read them as scalars,
    as they read the block tables)."""
    return lax.bitcast_convert_type(jnp.asarray(state, jnp.uint32)[:4], jnp.int32)


def _wide_mulhilo(a, m):
    """`(hi, lo)` of uint32 `a` times the constant `m` inside the kernels: a tile's 32 x 32 ->
    64-bit products on the hardware multiplier (`arith.mului_extended`, one `mul.wide.u32`),
    where `_philox.mulhilo`'s 16-bit halves take 18 operations; a scalar as `_philox`'s."""
    from ._philox import mulhilo

    if getattr(a, "ndim", 0) == 0:
        return mulhilo(a, m)
    _, plgpu = _pallas()
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic import gpu as mgpu

    layout = plgpu.Layout.WGMMA
    out = plgpu.ShapeDtypeStruct(a.shape, jnp.uint32, layout=layout)
    signed_m = int(m) - 2**32 if int(m) >= 2**31 else int(m)  # the i32 attribute's value

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=(out, out))
    def products(_, x):
        def half(reg, which: int):
            return arith.MulUIExtendedOp(reg, mgpu.utils.c(signed_m, reg.type)).results[which]
        return x._pointwise(lambda r: half(r, 1)), x._pointwise(lambda r: half(r, 0))

    return products(plgpu.layout_cast(a, layout))


def _drop_factor(rate: float, seeds, e_hi, e_lo, key_pos, mulhilo=None):
    """`keep / (1 - rate)` of every pair of a tile (float32): attnaux's keep-mask
    (`_philox.keep_word`, the pure-JAX mask's own function) at `e = (e_hi, e_lo) + key_pos`,
    drawn `DROPOUT_CHUNK` columns at a time. `mulhilo`: the kernels' `_wide_mulhilo` (None:
    `_philox`'s, on plain arrays)."""
    from ._philox import add_with_carry, keep_threshold, keep_word
    from ._philox import mulhilo as portable_mulhilo

    mulhilo = mulhilo or portable_mulhilo

    threshold = keep_threshold(rate)
    kept = 1.0 / (1.0 - rate)
    parts = []
    for c in range(0, e_lo.shape[1], DROPOUT_CHUNK):
        cut = (slice(None), slice(c, c + DROPOUT_CHUNK))
        hi, lo = add_with_carry(e_hi[cut], e_lo[cut], key_pos[cut].astype(jnp.uint32))
        keep = keep_word(seeds, hi, lo, mulhilo) >= threshold
        parts.append(jnp.where(keep, jnp.float32(kept), jnp.float32(0.0)))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _read_seeds(seed_ref):
    return tuple(seed_ref[i].astype(jnp.uint32) for i in range(4))


def _check_packed(geometry: Geometry, tile_fn, tables, infos) -> None:
    if geometry.packed != (infos is not None):
        raise ValueError("`infos` must be given exactly when the geometry is packed")
    if geometry.packed and (tables is None or tile_fn is not None):
        raise ValueError("a packed geometry needs its block tables and takes no tile function")


def _tile_grads(mod, s, q_pos, kv_pos, b, h, row_vals, col_vals, masked: bool):
    """`(x, vjp)`: the modified scores of a tile and the function that maps their cotangent to
    those of the raw scores and of the row and column inputs.

    The tile function is elementwise (each score depends on its own pair's inputs), so its
    Jacobian is diagonal: `jax.linearize` once, applied to a one-hot tangent per input, gives
    the partial derivatives as tiles, in the same traced function as the scores (the function
    is evaluated once; no residual escapes `_lowerable`). Masked pairs have zero partials
    (`where`'s derivative) and a zero cotangent."""
    def f(s, rows, cols):
        return mod(s, q_pos, kv_pos, b, h, rows, cols, masked=masked)[0]

    def partials(s, rows, cols):
        x, lin = jax.linearize(f, s, rows, cols)
        one, zero = jnp.ones_like(s), jnp.zeros_like(s)
        zr, zc = (zero,) * len(rows), (zero,) * len(cols)
        d_s = lin(one, zr, zc)
        d_rows = tuple(lin(zero, zr[:i] + (one,) + zr[i + 1:], zc) for i in range(len(rows)))
        d_cols = tuple(lin(zero, zr, zc[:i] + (one,) + zc[i + 1:]) for i in range(len(cols)))
        return x, d_s, d_rows, d_cols

    x, d_s, d_rows, d_cols = _lowerable(partials)(s, row_vals, col_vals)

    def vjp(dx):
        return dx * d_s, tuple(dx * d for d in d_rows), tuple(dx * d for d in d_cols)

    return x, vjp


def _row_stats(out, lse, dout, dlse):
    """`[B, Hq, 2, Sq]` float32: per row the lse in log2 units (+inf for a row that sees
    nothing, so that P = 0 there) and the row term D - dlse, D = rowsum(dO * O).

    D is summed in the operands' `[B, Sq, Hq]` order and only then transposed: XLA fused the
    sum straight into the `[B, Hq, Sq]` stack as a loop that read O and dO across rows, 136 us
    against 24 + 2 for this form (H100, 4x2048x16x128 bf16; docs/performance.md, 2026-11-28
    eleventh session). The barrier keeps that fusion apart."""
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
    common = jnp.promote_types(out.dtype, dout.dtype)
    delta = jnp.einsum("bqhd,bqhd->bqh", dout.astype(common), out.astype(common),
                       preferred_element_type=jnp.float32)
    delta = jnp.swapaxes(jax.lax.optimization_barrier(delta), 1, 2)
    return jnp.stack([lse2, delta - dlse.astype(jnp.float32)], axis=2)


CUDA_BACKWARD_TARGET = "attnaux_hopper_bwd"
CUDA_FORWARD_TARGET = "attnaux_hopper_fwd"
CUDA_FORWARD_ROWS = 128  # the CUDA forward's query rows a tile (FwdTraits::kBlockM)
# its keys a step by head dim (csrc/cuda/hopper_fwd_kernel.cuh, LaunchFwd): the tile lists' cost
# model
CUDA_FORWARD_KEYS = {64: 128, 128: 128, 256: 64}


def _cuda_forward_serves(q, config: Config, *, softcap, geometry: Geometry, tile_fn, tables,
                         dropout) -> bool:
    """Whether `forward` runs on the CUDA C++ kernel (`_cuda_forward`): plain scores (scale,
    causal / window geometry, GQA), head dims 64, 128 and 256, 16-bit inputs, query rows in
    whole 128-row blocks, asked for by `config` and built into this install."""
    from ._ffi import has_target

    return (config.cuda_forward and softcap is None and tile_fn is None and tables is None
            and not dropout and not geometry.packed and q.shape[3] in (64, 128, 256)
            and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[1] % CUDA_FORWARD_ROWS == 0
            and has_target(CUDA_FORWARD_TARGET, "cuda"))


def _geometry_attrs(geometry: Geometry) -> dict:
    """The visibility attributes of the CUDA kernels' FFI calls (`BwdParams`, `FwdParams`)."""
    import numpy as np

    if geometry.causal and geometry.window is not None:
        upper = min(0, geometry.window[1])
    elif geometry.causal:
        upper = 0
    else:
        upper = geometry.window[1] if geometry.window is not None else 0
    return dict(q_len=np.int64(geometry.q_len), kv_len=np.int64(geometry.kv_len),
                offset=np.int64(geometry.offset),
                has_upper=np.int32(geometry.causal or geometry.window is not None),
                upper=np.int64(upper), has_lower=np.int32(geometry.window is not None),
                lower=np.int64(geometry.window[0] if geometry.window is not None else 0))


def _cuda_forward(q, k, v, *, scale: float, geometry: Geometry):
    """`forward` of plain scores on attnaux's CUDA C++ Hopper kernel (csrc/cuda/hopper_fwd.cu):
    persistent CTAs taking lists of tiles of 128 query rows of a head (`_cuda_forward_schedule`),
    key blocks of `CUDA_FORWARD_KEYS[head dim]`. Keys past `geometry.kv_len` are masked; V's rows
    there are zeroed first when there are any, as a masked key's P of 0 still meets its V row in
    the tensor cores (0 * NaN is NaN)."""
    import numpy as np

    kv_seq = k.shape[1]
    if geometry.kv_len < kv_seq:
        v = jnp.where((jnp.arange(kv_seq) < geometry.kv_len)[None, :, None, None], v, 0)
    if kv_seq % 128:  # the kernel's key blocks
        pad = [(0, 0), (0, -kv_seq % 128), (0, 0), (0, 0)]
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    bsz, q_seq, q_heads, dim = q.shape
    attrs = _geometry_attrs(geometry)
    grid = max(1, min(_sm_count(), bsz * q_heads * (q_seq // CUDA_FORWARD_ROWS)))
    schedule = _cuda_forward_schedule(
        bsz * q_heads, q_seq // CUDA_FORWARD_ROWS, CUDA_FORWARD_KEYS[dim], k.shape[1],
        tuple(int(attrs[n]) for n in ("q_len", "kv_len", "offset", "has_upper", "upper",
                                      "has_lower", "lower")), grid)
    stats = jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32)
    return jax.ffi.ffi_call(CUDA_FORWARD_TARGET, (
        jax.ShapeDtypeStruct(q.shape, q.dtype), stats, stats))(
        q, k, v, jnp.asarray(schedule), grid=np.int64(grid), scale=np.float32(scale), **attrs)


def _sm_count() -> int:
    """The streaming multiprocessors of the default device (the CUDA forward's persistent
    CTAs); 132, an H100 SXM's, where JAX does not say."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except RuntimeError:
        return 132


@functools.cache
def _cuda_forward_schedule(heads: int, m_blocks: int, block_kv: int, kv_seq: int,
                           visibility: tuple, grid: int):
    """The CUDA forward's tile lists (int32 numpy, hopper_fwd_kernel.cuh): `grid` + 1 offsets,
    then the tiles `head * m_blocks + m_block` (`head` = batch * q_heads + query head), CTA c's
    at `[offsets[c], offsets[c + 1])` (`grid` at least 1). `visibility`: `(q_len,
    kv_len, offset, has_upper, upper, has_lower, lower)` as `FwdParams`.

    The order, then the lists: without an upper bound on the keys (equal work a tile) a head's
    query blocks next to each other (the CTAs at work together read the same K and V through
    L2); under one, in groups of heads, the group's last (heaviest) query blocks first, a group
    two rounds of `grid` tiles and at least 16 heads (some 8 CTAs on a head at once). Measured
    (H100, forward TFLOP/s, the earlier zigzag rounds over this order): a head's blocks side by
    side left some CTAs the long blocks only (1 x 8192 x 16: 403); all heads in one group read
    K and V from memory again for every tile at 8 x 1024 x 128 heads (276, groups of 34: 339);
    groups of 6 heads at 1 x 8192 x 16: 545, of 16: 615. Each tile in this order goes to the
    CTA with the least work so far (its tiles' key blocks, plus one for a tile's Q, epilogue
    and pipeline fill): the list scheduling that a dynamic tile counter does, fixed at trace
    time. Against the zigzag rounds of equal tiles a CTA, the most work a CTA falls from 1.27
    to 1.08x the mean at 4 x 2048 x 16 heads causal, 1.23 -> 1.01 at 2 x 4096, 1.12 -> 1.03 at
    8 x 1024 (the cost model's figures); measured (H100, bf16, forward, `tools/gpu_dev/
    fwd_ab.py`), causal at 4 x 2048 x 16 x 128: 402 -> 467 TFLOP/s, 0.85 -> 0.98x the Pallas
    forward (docs/performance.md, 2026-11-27 seventh session)."""
    import heapq

    import numpy as np

    q_len, kv_len, offset, has_upper, upper, has_lower, lower = visibility
    m0 = np.arange(m_blocks) * CUDA_FORWARD_ROWS
    n_hi = np.full(m_blocks, -(-min(kv_len, kv_seq) // block_kv))
    n_lo = np.zeros(m_blocks, np.int64)
    if has_upper:
        n_hi = np.minimum(n_hi, (m0 + CUDA_FORWARD_ROWS - 1 + offset + upper) // block_kv + 1)
    if has_lower:
        n_lo = np.maximum(n_lo, (m0 + offset - lower) // block_kv)
    n_hi = np.where(m0 >= q_len, n_lo, n_hi)
    cost = np.maximum(n_hi - n_lo, 0) + 1  # key blocks, plus one for the tile's own work
    m_order = np.arange(m_blocks)[::-1]  # the last (under a causal mask, heaviest) first
    if has_upper:
        group = min(heads, max(16, 2 * (-(-grid // m_blocks))))
        order = np.concatenate([
            (np.arange(g, min(g + group, heads))[None, :] * m_blocks
             + m_order[:, None]).reshape(-1) for g in range(0, heads, group)])
    else:
        order = (np.arange(heads)[:, None] * m_blocks + m_order[None, :]).reshape(-1)
    # (with equal work a tile, ties going to the lowest CTA make this the round robin)
    lists = [[] for _ in range(grid)]
    load = [(0, c) for c in range(grid)]
    for t in order:
        work, c = heapq.heappop(load)
        lists[c].append(t)
        heapq.heappush(load, (work + int(cost[t % m_blocks]), c))
    offsets = np.cumsum([0] + [len(x) for x in lists])
    return np.concatenate([offsets, np.concatenate([np.asarray(x, np.int64) for x in lists])
                           ]).astype(np.int32)


def _cuda_backward_serves(q, config: Config, *, softcap, geometry: Geometry, tile_fn, tables,
                          dropout) -> bool:
    """Whether `backward` runs on the CUDA C++ kernel (`_cuda_backward`): plain scores (scale,
    causal / window geometry, GQA), head dim 128, 16-bit inputs, asked for by `config`, XLA not
    asked for deterministic results (its dQ sums come in a varying order), and built into this
    install."""
    from ._ffi import has_target

    return (config.cuda_backward and softcap is None and tile_fn is None and tables is None
            and not dropout and not geometry.packed and q.shape[3] == 128
            and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[1] % BLOCK_Q == 0
            and not deterministic_requested() and has_target(CUDA_BACKWARD_TARGET, "cuda"))


def _cuda_backward(q, k, v, out, lse, dout, dlse, rows, cols, *, scale: float,
                   geometry: Geometry):
    """`backward` of plain scores on attnaux's CUDA C++ Hopper kernel (csrc/cuda/hopper_bwd.cu):
    a first pass (`_row_stats` per row, the dQ sums zeroed), then one kernel, a CTA per 128
    keys of a kv head, FlashAttention-3's five products per tile pair, dQ's float32 partial
    sums bulk-reduce-added into a buffer that `_cuda_dq` reorders and scales."""
    import numpy as np

    kv_seq = k.shape[1]
    if kv_seq % 128:  # the kernel's key blocks (padding keys lie past geometry.kv_len)
        pad = [(0, 0), (0, -kv_seq % 128), (0, 0), (0, 0)]
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    bsz, q_seq, q_heads, dim = q.shape
    dq_shape = (bsz, q_heads, q_seq // BLOCK_Q, 2, BLOCK_Q * dim // 2)
    # the handler's first pass computes `_row_stats` into the last result (a work buffer) and
    # zeroes the dQ sums: XLA's fusion of `_row_stats` took 2-3x the time of that pass
    dq_sum, dk, dv, _ = jax.ffi.ffi_call(CUDA_BACKWARD_TARGET, (
        jax.ShapeDtypeStruct(dq_shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct((bsz, q_heads, 2, q_seq), jnp.float32)))(
        q, k, v, out.astype(q.dtype), dout.astype(q.dtype), lse.astype(jnp.float32),
        dlse.astype(jnp.float32), scale=np.float32(scale), **_geometry_attrs(geometry))
    return _cuda_dq(dq_sum, scale, q.dtype), dk[:, :kv_seq], dv[:, :kv_seq], rows, cols


def _cuda_dq(dq_sum, scale: float, dtype):
    """dQ `[B, Sq, Hq, D]` from the CUDA backward's float32 sums `[B, Hq, Sq / 64, 2, 32 D]`:
    per query tile of 64 rows, two warpgroups' 64 x D/2 halves, each in the order of the wgmma
    accumulator's registers. Lane t0 + 4 t1 of warp t2 holds value v = v0 + 2 v1 + 4 v2 of row
    16 t2 + 8 v1 + t1 and column 8 v2 + 2 t0 + v0, stored (16-byte stores of 4 values, a warp's
    part contiguous) at 8 D t2 + 128 v2 + 16 t1 + 4 t0 + 2 v1 + v0: the order (t2, v2, t1, t0,
    v1, v0)."""
    bsz, q_heads, tiles, _, size = dq_sum.shape
    half = size // BLOCK_Q
    x = dq_sum.reshape(bsz, q_heads, tiles, 2, 4, half // 8, 8, 4, 2, 2)
    # -> (b, tile, t2, v1, t1, head, half, v2, t0, v0): rows then columns
    x = x.transpose(0, 2, 4, 8, 6, 1, 3, 5, 7, 9)
    return (x.reshape(bsz, tiles * BLOCK_Q, q_heads, 2 * half) * scale).astype(dtype)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "geometry", "tile_fn",
                                             "config", "dropout"))
def backward(q, k, v, out, lse, dout, dlse, rows, cols, *, scale: float, softcap,
             geometry: Geometry, tile_fn, config: Config, tables=None, infos=None,
             indices=None, dropout=None, drop_state=None):
    """`(dq, dk, dv, drows, dcols)` of `forward` (same padded shapes), given the cotangents of
    out and lse. dS = P * (dP - (D - dlse)), D = rowsum(dO * O), in two kernels: dK/dV (a CTA
    per 128 keys of a kv head, over the query tiles of every query head of its group) and dQ (a
    CTA per 128 query rows, over the key tiles). A step issues its products in
    FlashAttention-3's order (S and dP together and the softmax while dP runs; in dK/dV, dV
    while dS is made): 1.01-1.09x the awaited order forward+backward (H100, performance.md).
    `tables`, `infos` and `indices` as for `forward`; with `dropout`, dP and the P that meets
    dO are those of the dropped P (the forward's keep-mask, drawn again)."""
    if _cuda_backward_serves(q, config, softcap=softcap, geometry=geometry, tile_fn=tile_fn,
                             tables=tables, dropout=dropout):
        return _cuda_backward(q, k, v, out, lse, dout, dlse, rows, cols, scale=scale,
                              geometry=geometry)
    pl, plgpu = _pallas()
    _check_packed(geometry, tile_fn, tables, infos)
    packed = geometry.packed
    by_index = indices is not None and tile_fn is not None
    bsz, q_seq, q_heads, dim = q.shape
    drop_args = _drop_args(dropout, drop_state, bsz, q_heads, q_seq)
    kv_seq, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    dtype = q.dtype
    n_rows = tile_fn.n_rows if tile_fn is not None else 0
    n_cols = tile_fn.n_cols if tile_fn is not None else 0
    plain = tile_fn is None and softcap is None
    exp_scale = (scale * LOG2E) if plain else LOG2E
    mod = functools.partial(_modify, scale=scale, softcap=softcap, tile_fn=tile_fn,
                            geometry=geometry)
    all_masked = _all_masked(tile_fn, tables) or bool(dropout)  # one visit body, as forward
    dq_table = None if tables is None else tables[1]
    dkv_table = None if tables is None else tables[2]
    wgmma = plgpu.Layout.WGMMA
    # per row: lse in log2 units (+inf for a row that sees nothing, so that P = 0 there) and
    # the row term D - dlse
    stats = _row_stats(out, lse, dout, dlse)
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    bq = bk = BLOCK_Q  # 64 x 64 tiles in the backward
    # dQ summed inside the dK/dV kernel; the row inputs' gradients are row sums, which the
    # transposed tiles of that kernel would have to reduce across its warps: those stay in the
    # dQ kernel
    fused = config.fused_dq and n_rows == 0
    # the fused dQ's dS and float32 staging tiles leave room for two stages at head dim 128
    # (three need 232648 bytes of shared memory, of 232448)
    stages = min(config.backward_stages, 2) if fused and dim > 64 else config.backward_stages
    # the fused dQ tile's columns per product (at head dim 128, 64 x 128 float32 beside dK's
    # and dV's accumulators spilled 690-710 bytes a thread, in halves 820-860: see
    # `default_config`)
    dq_cols = min(dim, 64)

    def row_input(ref, b, h, r, q0, layout, shape, dim_):
        return lax.broadcast_in_dim(
            plgpu.load(ref.at[b, h, r, pl.ds(q0, bq)], layout=layout, optimized=False),
            shape, [dim_])

    def info_vectors(ref, b, start, layout):
        """A token-info ref's segment and position over `[start, start + 64)`."""
        return tuple(plgpu.load(ref.at[b, c, pl.ds(start, bq)], layout=layout, optimized=False)
                     for c in range(2))

    def packed_visible(rows_info, keys_info, rows_dim, shape):
        """`_packed_visible` of a tile whose rows lie along `rows_dim`."""
        def wide(vectors, dim_):
            return tuple(lax.broadcast_in_dim(x, shape, [dim_]) for x in vectors)
        return _packed_visible(geometry, *wide(rows_info, rows_dim),
                               *wide(keys_info, 1 - rows_dim))

    def scores_and_probs(s, q_pos, kv_pos, b, h, row_vals, col_vals, lse_b, masked, vis=None):
        """P of a tile (lse_b broadcast), the modified scores' pullback (None when plain).
        `vis`: a packed geometry's visibility on a masked tile."""
        if packed:
            x, vjp = (s, None) if plain else _tile_grads(mod, s, q_pos, kv_pos, b, h, row_vals,
                                                         col_vals, False)
            if vis is not None:
                x = jnp.where(vis, x, -jnp.inf)
        elif plain:
            x = s if not masked else jnp.where(_geometry_visible(geometry, q_pos, kv_pos), s,
                                               -jnp.inf)
            vjp = None
        else:
            x, vjp = _tile_grads(mod, s, q_pos, kv_pos, b, h, row_vals, col_vals, masked)
        return jnp.exp2(x * exp_scale - lse_b), vjp

    # ---- dK, dV: grid (kv heads, key blocks of 128, batch); stream (query head, query tile)
    n_q_tiles = q_seq // bq

    def dkv_kernel(*refs):
        q_ref, k_ref, v_ref, do_ref, st_ref = refs[:5]
        i = 5
        rows_ref = refs[i] if n_rows else None
        i += bool(n_rows)
        cols_ref = refs[i] if n_cols else None
        i += bool(n_cols)
        table_ref = refs[i] if dkv_table is not None else None
        i += dkv_table is not None
        qinfo_ref, kvinfo_ref = refs[i:i + 2] if packed else (None, None)
        i += 2 * packed
        index_refs = refs[i:i + 2] if by_index else None
        i += 2 * by_index
        seed_ref, erow_ref = refs[i:i + 2] if dropout else (None, None)
        i += 2 * bool(dropout)
        dq_sum_ref = refs[i] if fused else None  # float32 dQ, zeroed; reduce-added into
        i += fused
        dk_ref, dv_ref = refs[i:i + 2]
        i += 2
        dcols_ref = refs[i] if n_cols else None
        i += bool(n_cols)
        scratch, barriers = refs[i:]
        k_smem2, v_smem2, q_smem, do_smem, st_smem, dcol_smem2 = scratch[:6]
        k_ready, v_ready, q_ready, do_ready, st_ready, q_free, do_free, st_free = barriers[:8]
        if fused:
            ds_smem, dq_stage = scratch[6:]
            ds_ready, both_done = barriers[8:]
        # the stream of a kv head: Q and dO of its group's query heads, and their row terms
        k_tile, b, kvh = _cta_work(kv_seq // (COMPUTE_WGS * bk), kv_heads, bsz,
                                   group * q_seq * (2 * dim * dtype.itemsize + 8),
                                   longest="first")
        wg = lax.axis_index("wg")
        cta_k0 = k_tile * (COMPUTE_WGS * bk)
        wg_ranges = [
            _with_table(_q_ranges(geometry, cta_k0 + w * bk, cta_k0 + (w + 1) * bk, bq,
                                  n_q_tiles),
                        table_ref, b, kvh, lax.div(cta_k0, jnp.int32(bk)) + w)
            for w in range(COMPUTE_WGS)]
        c_lo, c_hi = _union(*wg_ranges)
        n_steps = c_hi - c_lo  # per query head; the stream runs over group * n_steps

        def slot_of(t):
            return lax.rem(t, jnp.array(stages, jnp.int32))

        @pl.when(wg < COMPUTE_WGS)
        def _consumer():
            plgpu.set_max_registers(config.backward_registers[0], action="increase")
            k0 = cta_k0 + wg * bk
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(k0, bk), kvh], k_smem, k_ready.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(k0, bk), kvh], v_smem, v_ready.at[wg])
            own = _pick(wg, *wg_ranges)
            # the transposed tile: keys down (axis 0), queries across (axis 1)
            # position tiles (and, in the dQ kernel, the rows' lse and D tiles) are built in
            # the step that uses them, not held across the walk: 1.02-1.11x forward+backward
            def kv_pos_tile():
                return plgpu.broadcasted_iota(jnp.int32, (bk, bq), 0, layout=wgmma) + k0

            def q_iota_tile():
                return plgpu.broadcasted_iota(jnp.int32, (bk, bq), 1, layout=wgmma)

            own_keys = info_vectors(kvinfo_ref, b, k0, wgmma.reduce(1)) if packed else None
            plgpu.barrier_wait(k_ready.at[wg])
            plgpu.barrier_wait(v_ready.at[wg])
            zeros = plgpu.layout_cast(jnp.zeros((bk, dim), jnp.float32), wgmma)
            dk, dv = zeros, zeros
            seeds = _read_seeds(seed_ref) if dropout else None

            # The fused dQ. Step t's dQ tile is dS(t) (64 queries x the CTA's 128 keys) times
            # K, summed by warpgroup t % 2 alone, over both warpgroups' dS (shared through
            # shared memory): the two take turns, so neither waits for the other at every
            # step, and each product spans the whole head dim (no split of K's columns).
            # Buffers: dS is double-buffered by t % 2. Warpgroup w rewrites slot t % 2 at step
            # t after waiting (at step t - 1, its own dQ step when w != t % 2) for the other's
            # arrival of step t - 1, which follows that one's dQ product of step t - 2. The
            # float32 staging tile is one buffer: each warpgroup waits until its previous
            # reduce-add has read it before it arrives at a step's barrier, and the warpgroup
            # that writes it waits for that barrier.
            def share_ds(t, ds_b):
                parity = lax.rem(t, jnp.array(2, jnp.int32))
                ds_smem.at[parity, wg][...] = ds_b
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_ready.at[parity])

            def add_dq(t, q0, h):
                parity = lax.rem(t, jnp.array(2, jnp.int32))

                @pl.when(parity == wg)
                def _():
                    plgpu.barrier_wait(ds_ready.at[parity])

                    for c0 in range(0, dim, dq_cols):
                        def product(acc_ref, c0=c0):
                            for w in range(COMPUTE_WGS):
                                plgpu.wgmma(acc_ref, ds_smem.at[parity, w].transpose((1, 0)),
                                            k_smem2.at[w, :, pl.ds(c0, dq_cols)])
                            return acc_ref[...]

                        dq_stage.at[:, pl.ds(c0, dq_cols)][...] = pl.run_scoped(
                            product, plgpu.ACC((bq, dq_cols), jnp.float32))
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(dq_stage, dq_sum_ref.at[b, pl.ds(q0, bq), h],
                                            reduction_op="add")

            def per_head(g, carry):
                dk, dv = carry
                h = kvh * group + g
                fn_bh = _fn_index(index_refs, b, h)  # what the tile function sees
                base = g * n_steps - c_lo  # stream index of query tile j: base + j
                col_vals = tuple(row_input(cols_ref, b, h, c, k0, wgmma.reduce(1), (bk, bq), 0)
                                 for c in range(n_cols))
                dcol0 = tuple(plgpu.layout_cast(jnp.zeros((bk,), jnp.float32),
                                                wgmma.reduce(1)) for _ in range(n_cols))

                def skip(j, c):
                    slot = slot_of(base + j)
                    for ready, free in ((q_ready, q_free), (do_ready, do_free),
                                        (st_ready, st_free)):
                        plgpu.barrier_wait(ready.at[slot])
                        plgpu.barrier_arrive(free.at[slot])
                    if fused:  # the other warpgroup may see this query tile: a zero dS
                        share_ds(base + j, plgpu.layout_cast(
                            jnp.zeros((bk, bq), dtype), wgmma))
                        add_dq(base + j, j * bq, h)
                    return c

                def visit(j, c, masked):
                    dk, dv, dcols = c
                    slot = slot_of(base + j)
                    q0 = j * bq
                    plgpu.barrier_wait(q_ready.at[slot])
                    plgpu.barrier_wait(do_ready.at[slot])
                    plgpu.barrier_wait(st_ready.at[slot])

                    def row_term(i):
                        """Row statistic i (0: lse, 1: D - dlse) across the transposed tile,
                        read where it is used rather than held through the step."""
                        return lax.broadcast_in_dim(
                            plgpu.load(st_smem.at[slot, i], layout=wgmma.reduce(0)),
                            (bk, bq), [1])

                    # The step's four products in one scope, FlashAttention-3's order: S^T
                    # and dP^T are issued together and the softmax runs while dP^T does; dV
                    # runs while dS is made; dK is issued before either is awaited
                    def products(s_ref, dp_ref, dv_ref, dk_ref):
                        _accumulator_store(dv_ref, dv)
                        _accumulator_store(dk_ref, dk)
                        plgpu.wgmma(s_ref, k_smem, q_smem.at[slot].transpose((1, 0)))
                        plgpu.wgmma(dp_ref, v_smem, do_smem.at[slot].transpose((1, 0)))
                        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # dP^T may run
                        q_pos = q_iota_tile() + q0
                        kv_pos = kv_pos_tile()
                        row_vals = tuple(row_input(rows_ref, b, h, r, q0, wgmma.reduce(0),
                                                   (bk, bq), 1) for r in range(n_rows))
                        vis = None
                        if packed and masked:
                            rows_info = info_vectors(qinfo_ref, b, q0, wgmma.reduce(0))
                            vis = packed_visible(rows_info, own_keys, 1, (bk, bq))
                        p, vjp = scores_and_probs(s, q_pos, kv_pos, *fn_bh, row_vals,
                                                  col_vals, row_term(0), masked, vis)
                        drop = None
                        if dropout:  # the rows (queries) lie across this tile
                            drop = _drop_factor(dropout, seeds, *(
                                row_input(erow_ref, b, h, c_, q0, wgmma.reduce(0), (bk, bq), 1)
                                for c_ in range(2)), kv_pos, _wide_mulhilo)
                        p16 = (p if drop is None else p * drop).astype(dtype)
                        plgpu.wgmma(dv_ref, p16, do_smem.at[slot])
                        dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=1)  # dV may run
                        if drop is not None:
                            dp = dp * drop
                        ds = p * (dp - row_term(1))
                        plgpu.barrier_arrive(st_free.at[slot])
                        new_dcols = dcols
                        if vjp is not None:
                            ds, _, dcol_tiles = vjp(ds)
                            new_dcols = tuple(a + t.sum(axis=1)
                                              for a, t in zip(dcols, dcol_tiles))
                        ds_b = ds.astype(dtype)
                        if fused:
                            share_ds(base + j, ds_b)
                        plgpu.wgmma(dk_ref, ds_b, q_smem.at[slot])
                        new_dv = plgpu.wgmma_accumulator_load(dv_ref, wait_n=1)
                        new_dk = plgpu.wgmma_accumulator_load(dk_ref, wait_n=0)
                        # the register operands stay alive until their products are awaited
                        # (see `_walk_overlapped`)
                        new_dk, new_dv, _ = lax.optimization_barrier((new_dk, new_dv,
                                                                      (p16, ds_b)))
                        return new_dk, new_dv, new_dcols

                    dk, dv, dcols = pl.run_scoped(
                        products, plgpu.ACC((bk, bq), jnp.float32),
                        plgpu.ACC((bk, bq), jnp.float32), plgpu.ACC((bk, dim), jnp.float32),
                        plgpu.ACC((bk, dim), jnp.float32))
                    plgpu.barrier_arrive(do_free.at[slot])
                    plgpu.barrier_arrive(q_free.at[slot])
                    if fused:
                        add_dq(base + j, q0, h)
                    return dk, dv, dcols

                dk, dv, dcols = _walk(c_lo, c_hi, own, visit, skip, (dk, dv, dcol0),
                                      all_masked=all_masked)
                for c in range(n_cols):
                    dcol_smem = dcol_smem2.at[wg, c]
                    dcol_smem[...] = dcols[c]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(dcol_smem, dcols_ref.at[b, h, c, pl.ds(k0, bk)])
                    plgpu.wait_smem_to_gmem(0)
                return dk, dv

            dk, dv = lax.fori_loop(0, group, per_head, (dk, dv))
            if plain:
                dk = dk * scale
            if fused:  # the other warpgroup's last dQ product may still read this K
                plgpu.barrier_arrive(both_done.at[0])
                plgpu.barrier_wait(both_done.at[0])
            k_smem[...] = dk.astype(dtype)
            v_smem[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, pl.ds(k0, bk), kvh])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, pl.ds(k0, bk), kvh])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            plgpu.set_max_registers(config.backward_registers[1], action="decrease")

            def head_and_tile(t):
                g = lax.div(t, jnp.maximum(n_steps, 1))
                return kvh * group + g, c_lo + t - g * n_steps

            def q_tile(ref):
                def source(t):
                    h, j = head_and_tile(t)
                    return ref.at[b, pl.ds(j * bq, bq), h]
                return source

            def st_tile(t):
                h, j = head_and_tile(t)
                return st_ref.at[b, h, :, pl.ds(j * bq, bq)]

            _produce(pl, plgpu, 0, group * n_steps, stages,
                     [(q_tile(q_ref), q_smem, q_ready, q_free),
                      (q_tile(do_ref), do_smem, do_ready, do_free),
                      (st_tile, st_smem, st_ready, st_free)])

    kv_scratch = plgpu.SMEM((COMPUTE_WGS, bk, dim), dtype, transforms=(tiling, swizzle))
    q_scratch = plgpu.SMEM((stages, bq, dim), dtype, transforms=(tiling, swizzle))
    dkv_scratch = (kv_scratch, kv_scratch, q_scratch, q_scratch,
                   plgpu.SMEM((stages, 2, bq), jnp.float32),
                   plgpu.SMEM((COMPUTE_WGS, max(n_cols, 1), bk), jnp.float32))
    if fused:
        dkv_scratch += (
            plgpu.SMEM((2, COMPUTE_WGS, bk, bq), dtype, transforms=(tiling, swizzle)),  # dS
            # dQ on its way to the sum, swizzled: rows of float32 256 or 512 bytes apart would
            # put a warp's stores of 8 rows in the same banks
            plgpu.SMEM((bq, dim), jnp.float32,
                       transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),
        )
    dkv_barriers = (
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # k_ready
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # v_ready
        plgpu.Barrier(num_barriers=stages),  # q_ready
        plgpu.Barrier(num_barriers=stages),  # do_ready
        plgpu.Barrier(num_barriers=stages),  # st_ready
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # q_free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # do_free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # st_free
    ) + ((plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=2),  # ds_ready
          plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=1))  # both_done
         if fused else ())
    dkv_out = [jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)]
    if n_cols:
        dkv_out.append(jax.ShapeDtypeStruct(cols.shape, jnp.float32))
    extra = [*([rows] if n_rows else []), *([cols] if n_cols else [])]
    info_args = list(infos) if packed else []
    index_args = (list(indices) if by_index else []) + list(drop_args)
    dkv_extra = (extra + ([dkv_table] if dkv_table is not None else []) + info_args
                 + index_args)
    dq_extra = extra + ([dq_table] if dq_table is not None else []) + info_args + index_args
    dkv_call = plgpu.kernel(
        dkv_kernel,
        out_type=tuple(dkv_out),
        grid=(kv_seq // (COMPUTE_WGS * bk) * kv_heads * bsz,),
        grid_names=("cta",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types=(dkv_scratch, dkv_barriers),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    if fused:
        # the fused dQ: a zeroed float32 buffer the kernel reduce-adds into, a ref of
        # `pl.run_state` so that XLA aliases it to the kernel's output instead of copying.
        # (`jax.new_ref` did the same under `jit`, but its effect cannot be lowered inside
        # `custom_partitioning`, which serves the kernels under SPMD: `_partition.partitioned`.)
        def with_dq_sum(refs):
            dq_ref, *out_refs = refs
            for ref, value in zip(out_refs, dkv_call(q, k, v, dout, stats, *dkv_extra, dq_ref)):
                ref[...] = value

        dq, *dkv = pl.run_state(with_dq_sum)(
            (jnp.zeros(q.shape, jnp.float32),
             *(jnp.zeros(o.shape, o.dtype) for o in dkv_out)))
    else:
        dkv = dkv_call(q, k, v, dout, stats, *dkv_extra)
    dk, dv = dkv[0], dkv[1]
    dcols = dkv[2] if n_cols else cols
    if fused:
        return (dq * scale if plain else dq).astype(dtype), dk, dv, rows, dcols

    # ---- dQ: grid (query heads, query blocks of 128, batch); stream key tiles
    n_kv_tiles = kv_seq // bk

    def dq_kernel(*refs):
        q_ref, k_ref, v_ref, do_ref, st_ref = refs[:5]
        i = 5
        rows_ref = refs[i] if n_rows else None
        i += bool(n_rows)
        cols_ref = refs[i] if n_cols else None
        i += bool(n_cols)
        table_ref = refs[i] if dq_table is not None else None
        i += dq_table is not None
        qinfo_ref, kvinfo_ref = refs[i:i + 2] if packed else (None, None)
        i += 2 * packed
        index_refs = refs[i:i + 2] if by_index else None
        i += 2 * by_index
        seed_ref, erow_ref = refs[i:i + 2] if dropout else (None, None)
        i += 2 * bool(dropout)
        dq_ref = refs[i]
        i += 1
        drows_ref = refs[i] if n_rows else None
        i += bool(n_rows)
        scratch, barriers = refs[i:]
        q_smem2, do_smem2, st_smem2, k_smem, v_smem, drow_smem2 = scratch
        q_ready, do_ready, st_ready, k_ready, v_ready, k_free, v_free = barriers
        q_tile, b, h = _cta_work(q_seq // (COMPUTE_WGS * bq), q_heads, bsz,
                                 _kv_stream_bytes(k), group)
        wg = lax.axis_index("wg")
        kvh = lax.div(h, jnp.array(group, h.dtype))
        cta_q0 = q_tile * (COMPUTE_WGS * bq)
        wg_ranges = [
            _with_table(_ranges(geometry, cta_q0 + w * bq, cta_q0 + (w + 1) * bq, bk,
                                n_kv_tiles),
                        table_ref, b, h, lax.div(cta_q0, jnp.int32(bq)) + w)
            for w in range(COMPUTE_WGS)]
        c_lo, c_hi = _union(*wg_ranges)

        def slot_of(step):
            return lax.rem(step - c_lo, jnp.array(stages, jnp.int32))

        @pl.when(wg < COMPUTE_WGS)
        def _consumer():
            plgpu.set_max_registers(config.backward_registers[0], action="increase")
            q0 = cta_q0 + wg * bq
            q_smem, do_smem, st_smem = q_smem2.at[wg], do_smem2.at[wg], st_smem2.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], q_smem, q_ready.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[b, pl.ds(q0, bq), h], do_smem, do_ready.at[wg])
            plgpu.copy_gmem_to_smem(st_ref.at[b, h, :, pl.ds(q0, bq)], st_smem,
                                    st_ready.at[wg])
            own = _pick(wg, *wg_ranges)
            fn_b, fn_h = _fn_index(index_refs, b, h)  # what the tile function sees
            def q_pos_tile():
                return plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=wgmma) + q0

            def kv_iota_tile():
                return plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=wgmma)

            row_vals = tuple(row_input(rows_ref, b, h, r, q0, wgmma.reduce(1), (bq, bk), 0)
                             for r in range(n_rows))
            own_rows = info_vectors(qinfo_ref, b, q0, wgmma.reduce(1)) if packed else None
            if dropout:
                seeds = _read_seeds(seed_ref)
                e_rows = tuple(row_input(erow_ref, b, h, c_, q0, wgmma.reduce(1), (bq, bk), 0)
                               for c_ in range(2))
            plgpu.barrier_wait(q_ready.at[wg])
            plgpu.barrier_wait(do_ready.at[wg])
            plgpu.barrier_wait(st_ready.at[wg])
            lse_row = plgpu.load(st_smem.at[0], layout=wgmma.reduce(1))
            rt_row = plgpu.load(st_smem.at[1], layout=wgmma.reduce(1))

            def row_tile(row):
                return lax.broadcast_in_dim(row, (bq, bk), [0])

            dq = plgpu.layout_cast(jnp.zeros((bq, dim), jnp.float32), wgmma)
            drow0 = tuple(plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), wgmma.reduce(1))
                          for _ in range(n_rows))

            def skip(step, c):
                slot = slot_of(step)
                for ready, free in ((k_ready, k_free), (v_ready, v_free)):
                    plgpu.barrier_wait(ready.at[slot])
                    plgpu.barrier_arrive(free.at[slot])
                return c

            def visit(step, c, masked):
                dq, drows = c
                slot = slot_of(step)
                plgpu.barrier_wait(k_ready.at[slot])

                plgpu.barrier_wait(v_ready.at[slot])

                # FlashAttention-3's order: S and dP issued together, the softmax runs while
                # dP does
                def products(s_ref, dp_ref, dq_ref):
                    _accumulator_store(dq_ref, dq)
                    plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dp_ref, do_smem, v_smem.at[slot].transpose((1, 0)))
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # dP may run
                    kv_pos = kv_iota_tile() + step * bk
                    col_vals = tuple(row_input(cols_ref, b, h, c_, step * bk, wgmma.reduce(0),
                                               (bq, bk), 1) for c_ in range(n_cols))
                    vis = None
                    if packed and masked:
                        keys_info = info_vectors(kvinfo_ref, b, step * bk, wgmma.reduce(0))
                        vis = packed_visible(own_rows, keys_info, 0, (bq, bk))
                    p, vjp = scores_and_probs(s, q_pos_tile(), kv_pos, fn_b, fn_h, row_vals,
                                              col_vals, row_tile(lse_row), masked, vis)
                    dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)
                    if dropout:
                        dp = dp * _drop_factor(dropout, seeds, *e_rows, kv_pos, _wide_mulhilo)
                    ds = p * (dp - row_tile(rt_row))
                    new_drows = drows
                    if vjp is not None:
                        ds, drow_tiles, _ = vjp(ds)
                        new_drows = tuple(a + t.sum(axis=1) for a, t in zip(drows, drow_tiles))
                    ds_b = ds.astype(dtype)
                    plgpu.wgmma(dq_ref, ds_b, k_smem.at[slot])
                    new_dq = plgpu.wgmma_accumulator_load(dq_ref, wait_n=0)
                    # ds_b, the product's register operand, stays alive until it is awaited
                    new_dq, _ = lax.optimization_barrier((new_dq, ds_b))
                    return new_dq, new_drows

                dq, drows = pl.run_scoped(
                    products, plgpu.ACC((bq, bk), jnp.float32),
                    plgpu.ACC((bq, bk), jnp.float32), plgpu.ACC((bq, dim), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                return dq, drows

            dq, drows = _walk(c_lo, c_hi, own, visit, skip, (dq, drow0),
                              all_masked=all_masked)
            if plain:
                dq = dq * scale
            q_smem[...] = dq.astype(dtype)
            for r in range(n_rows):
                drow_smem2.at[wg, r][...] = drows[r]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, pl.ds(q0, bq), h])
            for r in range(n_rows):
                plgpu.copy_smem_to_gmem(drow_smem2.at[wg, r],
                                        drows_ref.at[b, h, r, pl.ds(q0, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            plgpu.set_max_registers(config.backward_registers[1], action="decrease")

            def kv_tile(ref):
                return lambda step: ref.at[b, pl.ds(step * bk, bk), kvh]

            _produce(pl, plgpu, c_lo, c_hi, stages,
                     [(kv_tile(k_ref), k_smem, k_ready, k_free),
                      (kv_tile(v_ref), v_smem, v_ready, v_free)])

    qd_scratch = plgpu.SMEM((COMPUTE_WGS, bq, dim), dtype, transforms=(tiling, swizzle))
    kvs_scratch = plgpu.SMEM((stages, bk, dim), dtype, transforms=(tiling, swizzle))
    dq_scratch = (qd_scratch, qd_scratch, plgpu.SMEM((COMPUTE_WGS, 2, bq), jnp.float32),
                  kvs_scratch, kvs_scratch,
                  plgpu.SMEM((COMPUTE_WGS, max(n_rows, 1), bq), jnp.float32))
    dq_barriers = (
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # q_ready
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # do_ready
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # st_ready
        plgpu.Barrier(num_barriers=stages),  # k_ready
        plgpu.Barrier(num_barriers=stages),  # v_ready
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # k_free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # v_free
    )
    dq_out = [jax.ShapeDtypeStruct(q.shape, dtype)]
    if n_rows:
        dq_out.append(jax.ShapeDtypeStruct(rows.shape, jnp.float32))
    dqr = plgpu.kernel(
        dq_kernel,
        out_type=tuple(dq_out),
        grid=(q_seq // (COMPUTE_WGS * bq) * q_heads * bsz,),
        grid_names=("cta",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types=(dq_scratch, dq_barriers),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v, dout, stats, *dq_extra)
    dq = dqr[0]
    drows = dqr[1] if n_rows else rows
    return dq, dk, dv, drows, dcols
