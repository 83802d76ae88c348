"""attnaux's own Hopper (sm_90a) attention kernels, written in Pallas Mosaic GPU.

The forward is FlashAttention-3's design: per CTA two *consumer* warpgroups of 64 query rows each
and one *producer* warpgroup that streams K and V tiles with the bulk tensor copy engine (TMA)
into a ring of shared-memory slots; the consumers run the matrix products on wgmma and take turns
on the tensor cores (a *schedule barrier*: one warpgroup's softmax overlaps the other's matrix
products). It returns what every attnaux backend returns: out, and per row the natural-log
`lse` and the `max` of the (modified, scaled) scores, float32.

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
gradients as row sums (dQ kernel) and column sums (dK/dV kernel).

Pallas Mosaic GPU ships with jaxlib; it is imported lazily (only on a GPU), as it needs
`absl`, which CPU installs may lack.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
BLOCK_Q = 64  # query rows per consumer warpgroup (wgmma's M)
COMPUTE_WGS = 2
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def _pallas():
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    return pl, plgpu


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The static masking rules of a call, in the padded problem's coordinates.

    `offset`: key position aligned with query position 0 (0 top-left; kv_len - q_len
    bottom-right); causal means kv <= q + offset; a window (left, right) means
    q + offset - left <= kv <= q + offset + right. `kv_len`: keys at or beyond are padding."""

    causal: bool
    window: tuple[int, int] | None
    offset: int
    kv_len: int
    q_len: int


@dataclasses.dataclass(frozen=True)
class TileFn:
    """A function traced into the kernels: `fn(s, q_pos, kv_pos, b, h, rows, cols) -> (s,
    visible | None)`. `s` float32 scores of a tile, `q_pos`/`kv_pos` int32 tiles of the global
    positions, `b`/`h` int32 scalars, `rows`/`cols` tuples of float32 tiles (the per-row and
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
    hi = jnp.clip(lax.div(hi_pos + (block_kv - 1), i32(block_kv)), 0, n_kv_tiles)
    lo = jnp.clip(lax.div(jnp.maximum(lo_pos, 0), i32(block_kv)), 0, hi)
    full_lo = jnp.clip(lax.div(full_lo_pos + (block_kv - 1), i32(block_kv)), lo, hi)
    full_hi = jnp.clip(lax.div(jnp.maximum(full_hi_pos, 0), i32(block_kv)), full_lo, hi)
    return lo, hi, full_lo, full_hi


def _geometry_visible(g: Geometry, q_pos, kv_pos):
    visible = kv_pos < g.kv_len
    if g.causal:
        visible &= kv_pos <= q_pos + g.offset
    if g.window is not None:
        left, right = g.window
        visible &= (kv_pos >= q_pos + g.offset - left) & (kv_pos <= q_pos + g.offset + right)
    return visible


def _modify(s, q_pos, kv_pos, b, h, rows, cols, *, scale, softcap, tile_fn, geometry, masked):
    """The scores of a tile after scale, softcap, the tile function and the masks; the
    visibility (None when every pair is visible)."""
    s = s * scale
    if softcap is not None:
        s = jnp.tanh(s * (1.0 / softcap)) * softcap
    visible = None
    if tile_fn is not None:
        s, visible = tile_fn.fn(s, q_pos, kv_pos, b, h, rows, cols)
    if masked:
        geo = _geometry_visible(geometry, q_pos, kv_pos)
        visible = geo if visible is None else (visible & geo)
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    return s, visible


@dataclasses.dataclass(frozen=True)
class Config:
    block_kv: int = 128
    stages: int = 2


def default_config(head_dim: int) -> Config:
    return Config(block_kv=128 if head_dim <= 128 else 64, stages=2)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "geometry", "tile_fn",
                                             "config"))
def forward(q, k, v, rows, cols, *, scale: float, softcap, geometry: Geometry, tile_fn,
            config: Config):
    """`(out, lse, max)` for padded `q [B, Sq, Hq, D]`, `k`/`v [B, Skv, Hkv, D]` (Sq a multiple
    of 128, Skv of `config.block_kv`); `rows [B, Hq, n_rows, Sq]`, `cols [B, Hq, n_cols, Skv]`
    float32 (n = 0: shape with 0). lse/max `[B, Hq, Sq]` float32, natural log."""
    pl, plgpu = _pallas()
    bsz, q_seq, q_heads, dim = q.shape
    kv_seq, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    dtype = q.dtype
    block_q, block_kv = BLOCK_Q, config.block_kv
    n_kv_tiles = kv_seq // block_kv
    stages = max(1, min(config.stages, n_kv_tiles))
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

    def kernel(*refs):
        q_ref, k_ref, v_ref = refs[:3]
        rows_ref = refs[3] if n_rows else None
        cols_ref = refs[3 + bool(n_rows)] if n_cols else None
        out_ref, lse_ref, max_ref, scratch, barriers = refs[3 + bool(n_rows) + bool(n_cols):]
        qo_smem2, k_smem, v_smem, stat_smem2 = scratch
        k_ready, v_ready, q_ready, k_free, v_free, turn = barriers
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        kvh = lax.div(h, jnp.array(group, h.dtype))
        cta_q0 = lax.axis_index("q_tiles") * (COMPUTE_WGS * block_q)
        cta_lo, cta_hi, _, _ = _ranges(geometry, cta_q0, cta_q0 + COMPUTE_WGS * block_q,
                                       block_kv, n_kv_tiles)

        def slot_of(step):
            return lax.rem(step - cta_lo, jnp.array(stages, jnp.int32))

        def take_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        @pl.when(wg < COMPUTE_WGS)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            q0 = cta_q0 + wg * block_q
            lo, hi, full_lo, full_hi = _ranges(geometry, q0, q0 + block_q, block_kv,
                                               n_kv_tiles)
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, block_q), h], qo_smem,
                                    q_ready.at[wg])
            q_pos = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0,
                                           layout=wgmma) + q0
            kv_iota = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=wgmma)
            row_vals = tuple(
                lax.broadcast_in_dim(
                    plgpu.load(rows_ref.at[b, h, r, pl.ds(q0, block_q)], layout=row_layout, optimized=False),
                    (block_q, block_kv), [0])
                for r in range(n_rows))
            plgpu.barrier_wait(q_ready.at[wg])
            m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout)
            l = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), row_layout)
            acc = plgpu.layout_cast(jnp.full((block_q, dim), 0.0, jnp.float32), wgmma)

            pl.when(wg == 1)(take_turn)

            def skip(step, carry):
                slot = slot_of(step)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                take_turn()
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                take_turn()
                return carry

            def visit(step, carry, masked):
                acc, m, l = carry
                slot = slot_of(step)
                plgpu.barrier_wait(k_ready.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                    take_turn()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if plain and not masked:
                    x = s
                else:
                    kv_pos = kv_iota + step * block_kv
                    cols_v = tuple(
                        lax.broadcast_in_dim(
                            plgpu.load(cols_ref.at[b, h, c, pl.ds(step * block_kv, block_kv)],
                                       layout=col_layout, optimized=False),
                            (block_q, block_kv), [1])
                        for c in range(n_cols))
                    if plain:  # only the masks: keep q.k units
                        x = jnp.where(_geometry_visible(geometry, q_pos, kv_pos), s, -jnp.inf)
                    else:
                        x, _ = mod(s, q_pos, kv_pos, b, h, row_vals, cols_v, masked=masked)
                m_new = jnp.maximum(m, x.max(axis=1))
                m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new) * exp_scale
                alpha = jnp.exp2(m * exp_scale - m_base)
                p = jnp.exp2(x * exp_scale - lax.broadcast_in_dim(m_base, x.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            needs_mask = not (tile_fn is None or not tile_fn.masks)
            carry = (acc, m, l)
            lax.fori_loop(cta_lo, lo, skip, None)
            if needs_mask:
                carry = lax.fori_loop(lo, hi, functools.partial(visit, masked=True), carry)
            else:
                carry = lax.fori_loop(lo, full_lo, functools.partial(visit, masked=True), carry)
                carry = lax.fori_loop(full_lo, full_hi, functools.partial(visit, masked=False),
                                      carry)
                carry = lax.fori_loop(full_hi, hi, functools.partial(visit, masked=True), carry)
            lax.fori_loop(hi, cta_hi, skip, None)
            acc, m, l = carry
            pl.when(wg == 0)(take_turn)

            seen = l > 0.0
            inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
            out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
            qo_smem[...] = out.astype(dtype)
            row_max = m * scale if plain else m
            lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
            stat_smem = stat_smem2.at[wg]
            stat_smem.at[0][...] = lse
            stat_smem.at[1][...] = jnp.where(seen, row_max, -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(q0, block_q), h])
            plgpu.copy_smem_to_gmem(stat_smem.at[0], lse_ref.at[b, h, pl.ds(q0, block_q)])
            plgpu.copy_smem_to_gmem(stat_smem.at[1], max_ref.at[b, h, pl.ds(q0, block_q)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            def load(step, slot):
                src = (b, pl.ds(step * block_kv, block_kv), kvh)
                return src

            for i in range(stages):
                @pl.when(cta_lo + i < cta_hi)
                def _():
                    src = load(cta_lo + i, i)
                    plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[i], k_ready.at[i])
                    plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[i], v_ready.at[i])

            @pl.loop(cta_lo + stages, cta_hi)
            def _(step):
                slot = slot_of(step)
                src = load(step, slot)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_ready.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_ready.at[slot])

    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    scratch = (
        plgpu.SMEM((COMPUTE_WGS, block_q, dim), dtype, transforms=(tiling, swizzle)),
        plgpu.SMEM((stages, block_kv, dim), dtype, transforms=(tiling, swizzle)),
        plgpu.SMEM((stages, block_kv, dim), dtype, transforms=(tiling, swizzle)),
        plgpu.SMEM((COMPUTE_WGS, 2, block_q), jnp.float32),
    )
    barriers = (
        plgpu.Barrier(num_barriers=stages),  # k_ready
        plgpu.Barrier(num_barriers=stages),  # v_ready
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # q_ready
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # k_free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # v_free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # turn: the tensor-core schedule
    )
    stats = jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32)
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype), stats, stats),
        grid=(q_heads, q_seq // (COMPUTE_WGS * block_q), bsz),
        grid_names=("heads", "q_tiles", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types=(scratch, barriers),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v, *([rows] if n_rows else []), *([cols] if n_cols else []))
