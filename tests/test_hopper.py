"""attnaux's own Hopper kernels (`_flash_hopper.py`) and `score_mod`/`mask_mod` on them
(`_hopper_mods.py`), against float32 references, on a Hopper GPU.

Every test is marked `gpu` (skipped without a GPU, conftest.py) and skipped on a GPU that is not a
Hopper (compute capability 9.x). Inputs are bfloat16; the references compute in float32 at HIGHEST
precision from the same (rounded) inputs. Tolerances, relative to the largest entry: 3e-2 for out
and the gradients (P and dS are rounded to bfloat16 for the tensor-core products, as in every
flash kernel), 1e-4 for lse and max (float32 statistics; exp2/log2 of the hardware's approximate
units).

Off a GPU, `test_split_matches_the_score_program` still runs: the split of a score program
between XLA and the kernel (`_hopper_mods.split`, `side_inputs`, `tile_fn`), evaluated in plain
JAX, against the score programs' NumPy interpreter."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnaux as ax
from attnaux import _ffi, _flex, _philox
from attnaux import _flash_hopper as fh
from attnaux import _hopper_mods as hm
from attnaux._score_program import Untranslatable, evaluate, pack_consts, translate

ON_HOPPER = (jax.default_backend() == "gpu"
             and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9."))


def _close(got, want, rel, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{what}: finiteness")
    scale = max(1e-6, np.abs(want[finite]).max(initial=0.0))
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=rel * scale, err_msg=what)


# ---- the kernels themselves, over the masking geometry
def _kernel_inputs(seed: int, dim: int, hkv: int, sq: int, skv: int, b=2, hq=4):
    """`(q, k, v, rows, cols, dout, dlse)` of a direct kernel call: bf16 q/k/v/dout, one
    float32 per-row and per-column input."""
    keys = [jax.random.fold_in(jax.random.key(seed), i) for i in range(7)]
    return (jax.random.normal(keys[0], (b, sq, hq, dim), jnp.bfloat16),
            jax.random.normal(keys[1], (b, skv, hkv, dim), jnp.bfloat16),
            jax.random.normal(keys[2], (b, skv, hkv, dim), jnp.bfloat16),
            jax.random.normal(keys[3], (b, hq, 1, sq), jnp.float32),
            jax.random.normal(keys[4], (b, hq, 1, skv), jnp.float32),
            jax.random.normal(keys[5], (b, sq, hq, dim), jnp.bfloat16),
            jax.random.normal(keys[6], (b, hq, sq), jnp.float32))


def _reference(q, k, v, rows, cols, scale, softcap, geo, tile):
    g = q.shape[2] // k.shape[2]
    s = _reference_scores(q, k, rows, cols, scale, softcap, geo, tile)
    vf = jnp.repeat(v.astype(jnp.float32), g, axis=2)
    m = s.max(-1)
    ms = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - ms[..., None])
    denom = p.sum(-1)
    seen = denom > 0
    out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(seen, denom, 1.0)[..., None], vf,
                     precision="highest")
    lse = jnp.where(seen, ms + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
    return out, lse, jnp.where(seen, m, -jnp.inf)


def _reference_scores(q, k, rows, cols, scale, softcap, geo, tile):
    """The modified scores `[B, Hq, Sq, Skv]` in float32, -inf where hidden."""
    b, sq, hq, _ = q.shape
    g = hq // k.shape[2]
    qf, kf = q.astype(jnp.float32), jnp.repeat(k.astype(jnp.float32), g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf, precision="highest") * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    qp = jnp.arange(sq)[:, None] + jnp.zeros((1, k.shape[1]), jnp.int32)
    kp = jnp.arange(k.shape[1])[None, :] + jnp.zeros((sq, 1), jnp.int32)
    vis = fh._geometry_visible(geo, qp, kp)[None, None]
    if tile is not None:
        s, extra = tile.fn(s, qp[None, None], kp[None, None], jnp.arange(b)[:, None, None, None],
                           jnp.arange(hq)[None, :, None, None],
                           tuple(rows[:, :, i, :, None] for i in range(rows.shape[2])),
                           tuple(cols[:, :, i, None, :] for i in range(cols.shape[2])))
        vis = vis & extra
    return jnp.where(vis, s, -jnp.inf)


def _tile(s, q_pos, kv_pos, b, h, rows, cols):
    s = s + rows[0] - cols[0] + 0.01 * h.astype(jnp.float32)
    return s, jax.lax.rem(q_pos + kv_pos, jnp.full_like(q_pos, 3)) != 0


TILE = fh.TileFn(_tile, 1, 1, True, "test_hopper._tile")
GEOMETRY_CASES = [  # (head dim, kv heads, causal, window, offset, softcap, tile function)
    (64, 2, False, None, 0, None, None),
    (64, 2, True, None, 0, None, None),
    (128, 2, True, None, 128, None, None),  # bottom-right alignment
    (128, 2, False, (70, 30), 0, None, None),
    (128, 1, True, None, 0, 30.0, None),
    (64, 4, False, None, 0, None, TILE),
    (128, 2, True, (100, 0), 0, 20.0, TILE),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GEOMETRY_CASES, ids=lambda c: "-".join(map(str, c[:6])))
def test_kernels_against_float32_reference(case):
    if not ON_HOPPER:
        pytest.skip("attnaux's own kernels need a Hopper GPU")
    dim, hkv, causal, window, offset, softcap, tile = case
    sq, skv = 384, 512
    geo = fh.Geometry(causal, window, offset, skv - 37, sq)  # 37 padding keys
    q, k, v, rows, cols, dout, dlse = _kernel_inputs(1, dim, hkv, sq, skv)
    scale, cfg = dim ** -0.5, fh.default_config(dim, skv)
    out, lse, mx = fh.forward(q, k, v, rows, cols, scale=scale, softcap=softcap, geometry=geo,
                              tile_fn=tile, config=cfg)
    r_out, r_lse, r_mx = _reference(q, k, v, rows, cols, scale, softcap, geo, tile)
    _close(out, r_out, 3e-2, "out")
    _close(lse, r_lse, 1e-4, "lse")
    _close(mx, r_mx, 1e-4, "max")
    cuda_fwd = dataclasses.replace(cfg, cuda_forward=True)
    if fh._cuda_forward_serves(q, cuda_fwd, softcap=softcap, geometry=geo, tile_fn=tile,
                               tables=None, dropout=None):  # the CUDA C++ forward, where built
        c_out, c_lse, c_mx = fh.forward(q, k, v, rows, cols, scale=scale, softcap=softcap,
                                        geometry=geo, tile_fn=tile, config=cuda_fwd)
        _close(c_out, r_out, 3e-2, "CUDA C++: out")
        _close(c_lse, r_lse, 1e-4, "CUDA C++: lse")
        _close(c_mx, r_mx, 1e-4, "CUDA C++: max")
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)
    grads, reproducible = _both_backwards(
        q, k, v, out, lse, dout, dlse, rows, cols, scale=scale, softcap=softcap, geometry=geo,
        tile_fn=tile, config=cfg)

    def ref(q, k, v, rows, cols):
        o, lse_, _ = _reference(q, k, v, rows, cols, scale, softcap, geo, tile)
        return o, jnp.where(jnp.isfinite(lse_), lse_, 0.0)

    _, pull = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)), rows, cols)
    r_grads = pull((dout.astype(jnp.float32), dlse))
    cuda = _cuda_backward_or_none(
        q, k, v, out, lse, dout, dlse, rows, cols, scale=scale, softcap=softcap, geometry=geo,
        tile_fn=tile, config=cfg)
    forms = [("default", grads), ("two kernels", reproducible)]
    if cuda is not None:  # plain scores at head dim 128, where the CUDA kernel is built
        forms.append(("CUDA C++", cuda))
    for form, got in forms:
        for name, g, r in zip(("dq", "dk", "dv", "drows", "dcols"), got, r_grads, strict=True):
            if tile is not None or name in ("dq", "dk", "dv"):
                _close(g.astype(jnp.float32), r, 3e-2, f"{form}: {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal, window, offset", [(True, None, 0), (True, None, 256),
                                                    (False, (90, 40), 0), (False, None, 0)])
def test_cuda_backward_over_many_heads(causal, window, offset):
    """The CUDA C++ backward where its CTA order has several sections: 12 (batch, kv head)
    pairs, the rows' statistics of 8 query tiles each made by the handler's first pass (with an
    lse cotangent and query rows past `q_len`), dq, dk and dv against the float32 reference.
    The sections hold 8 pairs and then the 4 left."""
    if not ON_HOPPER:
        pytest.skip("attnaux's own kernels need a Hopper GPU")
    sq, skv = 512, 640
    geo = fh.Geometry(causal, window, offset, skv - 50, sq - 20)
    q, k, v, rows, cols, dout, dlse = _kernel_inputs(3, 128, 4, sq, skv, b=3, hq=8)
    scale, cfg = 128 ** -0.5, fh.default_config(128, skv)
    out, lse, _ = fh.forward(q, k, v, rows, cols, scale=scale, softcap=None, geometry=geo,
                             tile_fn=None, config=cfg)
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)
    got = _cuda_backward_or_none(q, k, v, out, lse, dout, dlse, rows, cols, scale=scale,
                                 softcap=None, geometry=geo, tile_fn=None, config=cfg)
    if got is None:
        pytest.skip("the CUDA C++ backward is not built into this install")

    def ref(q, k, v):
        o, lse_, _ = _reference(q, k, v, rows, cols, scale, None, geo, None)
        return o, jnp.where(jnp.isfinite(lse_), lse_, 0.0)

    _, pull = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, g, r in zip(("dq", "dk", "dv"), got, pull((dout.astype(jnp.float32), dlse)),
                          strict=False):
        _close(g.astype(jnp.float32), r, 3e-2, name)


CUDA_FORWARD_CASES = [  # (head dim, kv heads, causal, window, offset)
    (64, 2, True, None, 0),
    (64, 1, False, (70, 30), 0),
    (128, 2, False, (200, 40), 128),
    (256, 2, False, None, 0),
    (256, 1, True, None, 128),
    (256, 2, True, (100, 0), 0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_FORWARD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_forward_head_dims(case):
    """The CUDA C++ forward at each head dim against the float32 reference: padding keys (37,
    masked in the last key block) and rows, several tiles a CTA, GQA, causal and windows."""
    if not ON_HOPPER or not _ffi.has_target(fh.CUDA_FORWARD_TARGET, "cuda"):
        pytest.skip("the CUDA C++ forward needs a Hopper GPU and its build")
    dim, hkv, causal, window, offset = case
    # 2 x 8 heads x 10 tiles of 128 rows: more tiles than SMs, so some CTAs take two
    sq, skv = 1280, 640
    geo = fh.Geometry(causal, window, offset, skv - 37, sq - 5)
    q, k, v, rows, cols, _, _ = _kernel_inputs(1, dim, hkv, sq, skv, b=2, hq=8)
    cfg = dataclasses.replace(fh.default_config(dim, skv), cuda_forward=True)
    assert fh._cuda_forward_serves(q, cfg, softcap=None, geometry=geo, tile_fn=None,
                                   tables=None, dropout=None)
    out, lse, mx = fh.forward(q, k, v, rows, cols, scale=dim ** -0.5, softcap=None,
                              geometry=geo, tile_fn=None, config=cfg)
    r_out, r_lse, r_mx = _reference(q, k, v, rows, cols, dim ** -0.5, None, geo, None)
    _close(out, r_out, 3e-2, "out")
    _close(lse, r_lse, 1e-4, "lse")
    _close(mx, r_mx, 1e-4, "max")


def _both_backwards(*args, config, **kw):
    """The default backward (plain scores on the CUDA C++ kernel where it was built, else dQ
    reduce-added inside the dK/dV kernel where it can be), and the two-kernel form
    (`fused_dq=False, cuda_backward=False`), which must be bitwise the same when run twice."""
    grads = fh.backward(*args, config=config, **kw)
    two = dataclasses.replace(config, fused_dq=False, cuda_backward=False)
    reproducible = fh.backward(*args, config=two, **kw)
    again = fh.backward(*args, config=two, **kw)
    for g, h in zip(reproducible, again, strict=True):  # no atomics: bitwise reproducible
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))
    return grads, reproducible


def _cuda_backward_or_none(*args, config, **kw):
    """The CUDA C++ backward's gradients where it serves the case (else None)."""
    cuda = dataclasses.replace(config, cuda_backward=True)
    if not fh._cuda_backward_serves(args[0], cuda, softcap=kw["softcap"],
                                    geometry=kw["geometry"], tile_fn=kw["tile_fn"],
                                    tables=kw.get("tables"), dropout=kw.get("dropout")):
        return None
    return fh.backward(*args, config=cuda, **kw)


def test_forward_key_tiles_by_head_dim_and_key_length():
    """256-key forward tiles at head dim 64 where they divide the (padded) keys, from 4096 keys
    on under a causal or window band; 128 elsewhere and where the key length is not given."""
    assert fh.default_config(64, 512).block_kv == 256
    assert fh.default_config(64, 384).block_kv == 128
    assert fh.default_config(64).block_kv == 128
    assert fh.default_config(64, 2048, banded=True).block_kv == 128
    assert fh.default_config(64, 4096, banded=True).block_kv == 256
    assert fh.default_config(128, 512).block_kv == 128
    assert fh.default_config(128, 4096, banded=True).block_kv == 128


def test_deterministic_ops_flag_selects_the_reproducible_backward(monkeypatch):
    """XLA's own switch for reproducible GPU results turns the reduce-added dQ off (on by
    default at head dim 64, where it is measured faster)."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert fh.default_config(64).fused_dq
    for value in ("--xla_gpu_deterministic_ops=true", "--xla_gpu_deterministic_ops"):
        monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x {value}")
        assert not fh.default_config(64).fused_dq
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    assert fh.default_config(64).fused_dq


def _cuda_routing(monkeypatch, target, decide, config, q):
    """`(serves, registered)` for the routing tests (no GPU needed): `serves(**changes)` asks
    `decide` (`_cuda_forward_serves` or `_cuda_backward_serves`) about plain causal scores
    with `q` and `config`, any argument changed, as if the FFI `target` were registered on
    CUDA, until the test sets `registered["yes"] = False`."""
    registered = {"yes": True}
    monkeypatch.setattr(_ffi, "has_target", lambda name, platform: (
        registered["yes"] and name == target and platform == "cuda"))
    geo = fh.Geometry(True, None, 0, 256, 256)

    def serves(q=q, config=config, geometry=geo, **kw):
        kw = {"softcap": None, "tile_fn": None, "tables": None, "dropout": None} | kw
        return decide(q, config, geometry=geometry, **kw)

    return serves, registered


def test_which_forward_the_cuda_kernel_serves(monkeypatch):
    """The CUDA C++ forward serves plain scores at head dims 64, 128 and 256 in 16-bit with
    whole 128-row query blocks, where asked for and built (no GPU needed: the routing alone)."""
    q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    serves, registered = _cuda_routing(
        monkeypatch, fh.CUDA_FORWARD_TARGET, fh._cuda_forward_serves,
        dataclasses.replace(fh.default_config(128), cuda_forward=True), q)
    assert serves() and serves(q=q.astype(jnp.float16))
    # opt-in: not yet measured ahead of the Pallas forward (`default_config`)
    assert not fh.default_config(128).cuda_forward and not serves(config=fh.default_config(128))
    assert not fh.default_config(128, 4096, banded=True).cuda_forward
    assert not serves(softcap=30.0) and not serves(tile_fn=TILE) and not serves(dropout=0.1)
    assert not serves(geometry=fh.Geometry(False, None, 0, 0, 0, packed=True))
    assert not serves(q=q.astype(jnp.float32)) and not serves(q=q[:, :192])
    assert serves(q=q[..., :64]) and serves(q=jnp.zeros((1, 256, 4, 256), jnp.bfloat16))
    assert not serves(q=q[..., :32]) and not serves(q=jnp.zeros((1, 256, 4, 192), jnp.bfloat16))
    registered["yes"] = False
    assert not serves()


@pytest.mark.parametrize("visibility", [
    (2048, 2048, 0, 1, 0, 0, 0),        # causal
    (2048, 2048, 0, 0, 0, 0, 0),        # no mask
    (1900, 1500, 400, 1, 0, 1, 300),    # bottom-right causal window, padding rows and keys
    (2048, 2048, 0, 0, 0, 1, 700),      # a lower bound alone
], ids=["causal", "none", "window", "lower"])
def test_cuda_forward_schedule_lists_every_tile_once_and_balances(visibility):
    """The CUDA forward's tile lists: offsets from 0 to the number of tiles, every tile in
    exactly one list, and (list scheduling) no CTA with more key blocks than the mean plus
    the heaviest tile; under a causal mask less than the zigzag rounds of equal tile counts
    gave (4 x 2048 x 16 heads: 1.27x the mean)."""
    heads, m_blocks, grid, block_kv = 64, 16, 132, 128
    schedule = fh._cuda_forward_schedule(heads, m_blocks, block_kv, 2048, visibility, grid)
    assert schedule.dtype == np.int32
    offsets, tiles = schedule[:grid + 1], schedule[grid + 1:]
    assert offsets[0] == 0 and offsets[-1] == len(tiles) == heads * m_blocks
    assert np.all(np.diff(offsets) >= 0)
    np.testing.assert_array_equal(np.sort(tiles), np.arange(heads * m_blocks))
    # the cost model, from the visibility rules row by row (independent of the builder's
    # block arithmetic): the key blocks that some row of a tile sees, the padding rows of a
    # tile with real rows included (the kernel walks the whole tile), plus one
    q_len, kv_len, offset, has_upper, upper, has_lower, lower = visibility
    rows = np.arange(2048)[:, None]
    keys = np.arange(2048)[None, :]
    seen = (rows // 128 * 128 < q_len) & (keys < kv_len)
    if has_upper:
        seen &= keys <= rows + offset + upper
    if has_lower:
        seen &= keys >= rows + offset - lower
    blocks = seen.reshape(m_blocks, 128, 2048 // block_kv, block_kv).any(axis=(1, 3))
    span = [(np.flatnonzero(b).max() - np.flatnonzero(b).min() + 1) if b.any() else 0
            for b in blocks]
    cost = np.asarray(span) + 1
    work = np.asarray([cost[tiles[a:b] % m_blocks].sum()
                       for a, b in zip(offsets[:-1], offsets[1:])])
    assert work.max() <= cost.sum() * heads / grid + cost.max(), (work.max(), work.mean())
    if visibility[3] and not visibility[5]:
        assert work.max() < 1.1 * work.mean(), (work.max(), work.mean())


def test_which_backward_the_cuda_kernel_serves(monkeypatch):
    """Plain scores at head dim 128 in 16-bit floats go to the CUDA C++ backward where it is
    registered and the config asks for it (`default_config`: except banded below 4096 keys)
    outside XLA's deterministic mode;
    every modifier, packing, dropout, float32 and other head dims keep the Pallas kernels."""
    monkeypatch.setenv("XLA_FLAGS", "")
    q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    serves, registered = _cuda_routing(
        monkeypatch, fh.CUDA_BACKWARD_TARGET, fh._cuda_backward_serves,
        dataclasses.replace(fh.default_config(128), cuda_backward=True), q)
    assert serves() and serves(q=q.astype(jnp.float16))
    # on by default at head dim 128 except banded below 4096 keys (measured slower there)
    assert fh.default_config(128).cuda_backward and fh.default_config(128, 4096).cuda_backward
    assert fh.default_config(128, 8192, banded=True).cuda_backward
    assert not fh.default_config(128, 2048, banded=True).cuda_backward
    assert not fh.default_config(128, banded=True).cuda_backward
    assert not fh.default_config(64).cuda_backward and not fh.default_config(256).cuda_backward
    assert serves(config=fh.default_config(128))
    assert not serves(config=fh.default_config(128, 2048, banded=True))
    assert not serves(softcap=30.0) and not serves(tile_fn=TILE) and not serves(dropout=0.1)
    assert not serves(geometry=fh.Geometry(False, None, 0, 0, 0, packed=True))
    assert not serves(q=q.astype(jnp.float32))
    assert not serves(q=q[..., :64]) and not serves(q=jnp.zeros((1, 256, 4, 256), jnp.bfloat16))
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    assert not serves()
    monkeypatch.setenv("XLA_FLAGS", "")
    registered["yes"] = False
    assert not serves()


# ---- dropout: attnaux's keep-mask drawn inside the kernels
def _block_state(seed: int, origin, sizes):
    """A 12-word block state: random seed and offset, `origin` (b0, h0, i0, j0), the whole
    problem's `sizes` (Hq', Sq', Skv') and no shift."""
    rng = jax.random.bits(jax.random.key(seed), (4,), jnp.uint32)
    return jnp.concatenate([rng, jnp.asarray([*origin, *sizes, 0], jnp.uint32)])


def test_dropout_rows_and_factor_are_the_whole_problems_mask():
    """What the kernels trace for dropout (`dropout_rows`, then `_drop_factor` a chunk of
    columns at a time) is, on plain arrays, the block's part of the whole problem's keep-mask
    (`dropout_keep_mask`, from the linear index in 64 bits): a block at an origin inside a
    problem of over 2**32 elements, so the index's high word and the carry matter."""
    bsz, heads, sq, skv = 2, 3, 40, 48
    whole = (4, 5, 600, 4_000_000_000)  # B', Hq', Sq', Skv': 4.8e13 elements
    origin = (1, 2, 520, 3_999_999_900)  # j0: most rows' low word carries
    state = _block_state(7, origin, whole[1:])
    rate = 0.3
    rows = fh.dropout_rows(state, bsz, heads, sq)
    seeds = tuple(jnp.asarray(fh._dropout_seeds(state)).astype(jnp.uint32))
    key_pos = jnp.broadcast_to(jnp.arange(skv, dtype=jnp.int32), (sq, skv))
    got = np.stack([np.stack([np.asarray(fh._drop_factor(
        rate, seeds, *(jnp.broadcast_to(rows[b, h, c][:, None], (sq, skv)) for c in range(2)),
        key_pos)) for h in range(heads)]) for b in range(bsz)])
    b0, h0, i0, j0 = origin
    cols = jnp.arange(j0, j0 + skv, dtype=jnp.uint32)
    for b in range(bsz):  # the whole mask is too big: the block's rows, one (b, h) at a time
        for h in range(heads):
            row = ((b0 + b) * whole[1] + h0 + h) * whole[2] + i0 + jnp.arange(sq)
            want = _philox.keep_at(state[:4], rate, row[:, None].astype(jnp.uint32),
                                   cols[None, :], np.uint32(whole[3]))
            np.testing.assert_array_equal(got[b, h] > 0, np.asarray(want), err_msg=f"{b}, {h}")
    kept = got[got > 0]
    np.testing.assert_allclose(kept, 1.0 / (1.0 - rate), rtol=1e-7)
    assert abs((got > 0).mean() - (1 - rate)) < 0.03
    # the rows' index words, exactly (Python integers), and a chunk whose keys carry into the
    # high word
    e = np.asarray(rows[..., 0, :], np.uint64) * 2**32 + np.asarray(rows[..., 1, :], np.uint64)
    bb, hh, ii = np.meshgrid(np.arange(bsz), np.arange(heads), np.arange(sq), indexing="ij")
    want_e = ((((b0 + bb) * whole[1] + h0 + hh) * whole[2] + i0 + ii).astype(np.uint64)
              * np.uint64(whole[3]) + np.uint64(j0))
    np.testing.assert_array_equal(e, want_e)
    e_first = np.uint64(7 * 2**32 + 2**32 - 20)  # keys 20.. of the row carry
    hi, lo = np.uint32(e_first >> np.uint64(32)), np.uint32(e_first & np.uint64(2**32 - 1))
    carried = fh._drop_factor(rate, seeds, jnp.full((1, 48), hi), jnp.full((1, 48), lo),
                              key_pos[:1])
    e_all = e_first + np.arange(48, dtype=np.uint64)
    words = _philox.keep_word(state[:4], jnp.asarray((e_all >> np.uint64(32)).astype(np.uint32)),
                              jnp.asarray((e_all & np.uint64(2**32 - 1)).astype(np.uint32)))
    np.testing.assert_array_equal(np.asarray(carried[0]) > 0,
                                  np.asarray(words) >= _philox.keep_threshold(rate))


DROPOUT_CASES = [  # (head dim, kv heads, causal, softcap, tile function, origin)
    (64, 2, False, None, None, (0, 0, 0, 0)),
    (128, 2, True, None, None, (1, 4, 256, 256)),
    (128, 1, True, 30.0, TILE, (3, 0, 384, 0)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_kernels_with_dropout_against_float32_reference(case):
    """The kernels draw attnaux's keep-mask for a block of a larger problem (the origin and
    sizes of a 12-word block state): out and the gradients equal a float32 reference that
    multiplies P by the mask drawn with `_philox.keep_at` (lse and max are of the scores);
    the two-kernel backward twice is bitwise the same."""
    if not ON_HOPPER:
        pytest.skip("attnaux's own kernels need a Hopper GPU")
    from hopper_emulation import _drop

    dim, hkv, causal, softcap, tile, origin = case
    sq, skv = 384, 512
    rate = 0.2
    state = _block_state(3, origin, (8, 1024, 1024))
    geo = fh.Geometry(causal, None, 0, skv - 37, sq)
    q, k, v, rows, cols, dout, dlse = _kernel_inputs(2, dim, hkv, sq, skv)
    scale, cfg = dim ** -0.5, fh.default_config(dim, skv)
    drop = dict(dropout=rate, drop_state=state)
    out, lse, mx = fh.forward(q, k, v, rows, cols, scale=scale, softcap=softcap, geometry=geo,
                              tile_fn=tile, config=cfg, **drop)
    factor = _drop(rate, state, q, k)
    g = q.shape[2] // hkv

    def ref(q, k, v, rows, cols):
        _, lse_, mx_ = _reference(q, k, v, rows, cols, scale, softcap, geo, tile)
        s = _reference_scores(q, k, rows, cols, scale, softcap, geo, tile)
        seen = jnp.isfinite(lse_)
        p = jnp.where(seen[..., None], jnp.exp(s - jnp.where(seen, lse_, 0.0)[..., None]), 0.0)
        o = jnp.einsum("bhqk,bkhd->bqhd", p * factor, jnp.repeat(v, g, axis=2),
                       precision="highest")
        return o, jnp.where(seen, lse_, 0.0), mx_

    f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
    (r_out, r_lse, r_mx), pull = jax.vjp(ref, *f32, rows, cols)
    _close(out, r_out, 3e-2, "out")
    _close(jnp.where(jnp.isfinite(lse), lse, 0.0), r_lse, 1e-4, "lse")
    _close(mx, r_mx, 1e-4, "max")
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)
    grads, reproducible = _both_backwards(
        q, k, v, out, lse, dout, dlse, rows, cols, scale=scale, softcap=softcap, geometry=geo,
        tile_fn=tile, config=cfg, **drop)
    r_grads = pull((dout.astype(jnp.float32), dlse, jnp.zeros_like(r_mx)))
    for form, got in (("default", grads), ("two kernels", reproducible)):
        for name, a, r in zip(("dq", "dk", "dv", "drows", "dcols"), got, r_grads, strict=True):
            if tile is not None or name in ("dq", "dk", "dv"):
                _close(a.astype(jnp.float32), r, 3e-2, f"{form}: {name}")


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_lengths_and_segment_ids_reach_the_kernels_in_the_mask_mod(monkeypatch, dropout):
    """On a Hopper GPU a call with functions and lengths / segment ids runs on the kernels with
    those folded into the mask_mod (`_mods.rules_as_mask`). Here on CPU, with the kernels'
    stand-in (`hopper_emulation`) and the platform checks answering as a Hopper GPU would: the
    dispatch takes that path and the result equals `reference` (NaN past the lengths); with
    dropout the kernels get the call's block state and draw the reference's mask."""
    from hopper_emulation import emulated_kernels

    from attnaux import _mods

    class AsOnAGpu:
        def __getattr__(self, name):
            return getattr(jax, name)

        @staticmethod
        def default_backend():
            return "gpu"

    monkeypatch.setattr(fh, "device_unavailable", lambda q, k, v: None)
    monkeypatch.setattr(_mods, "jax", AsOnAGpu())
    keys = jax.random.split(jax.random.key(8), 3)
    q = jax.random.normal(keys[0], (B, S, HQ, D))
    k, v = (jax.random.normal(x, (B, S, HK, D)) for x in keys[1:])
    q_len, kv_len = jnp.asarray([250, 61]), jnp.asarray([320, 130])
    q = jnp.where(jnp.arange(S)[None, :, None, None] >= q_len[:, None, None, None], jnp.nan, q)
    ids = DOCS[None].repeat(B, 0)
    options = dict(causal="bottom_right", window=(50, 0), q_seqlens=q_len, kv_seqlens=kv_len,
                   q_segment_ids=ids, kv_segment_ids=ids,
                   score_mod=lambda s, b, h, i, j: s + SLOPES[h] * (j - i))
    if dropout:
        options.update(dropout_rate=dropout, key=jax.random.key(2))
    assert "folded into the mask_mod" in str(ax.explain(q, k, v, **options))
    with emulated_kernels():
        out, aux = jax.jit(lambda q, k, v: ax.attention(q, k, v, **options))(q, k, v)
    assert aux.backend == "flash"
    want, want_aux = jax.jit(lambda q, k, v: ax.attention(q, k, v, backend="reference",
                                                          **options))(q, k, v)
    _close(out, want, 1e-5, "out")
    _close(aux.lse, want_aux.lse, 1e-5, "lse")


# ---- score_mod / mask_mod through attnaux.attention
B, S, HQ, HK, D = 2, 320, 4, 2, 64  # 320: a ragged last 128-row block
SLOPES = jnp.asarray([0.5, 0.25, 0.125, 0.0625])
DOCS = jnp.asarray(np.repeat(np.arange(5), S // 5), jnp.int32)
MOD_CASES = {
    "alibi_causal": lambda p: dict(
        causal=True, score_mod=lambda s, b, h, i, j: s + p["slopes"][h] * (j - i)),
    "tanh_gate_window_gqa": lambda p: dict(
        score_mod=lambda s, b, h, i, j: 4.0 * jnp.tanh(s / 4.0) * p["gate"][h],
        mask_mod=lambda b, h, i, j: (i - j < 70) & (j - i < 30)),
    "document_mask_softcap": lambda p: dict(
        softcap=8.0, mask_mod=lambda b, h, i, j: DOCS[i] == DOCS[j]),
    "prefix_lm_sliding_window_sink": lambda p: dict(
        sink=p["sink"],  # added after the kernels
        mask_mod=lambda b, h, i, j: (j < 16) | ((j <= i) & (i - j < 64)),
        score_mod=lambda s, b, h, i, j: s + p["bias_q"][i] - p["bias_k"][j]),
    "integer_ops_bottom_right": lambda p: dict(
        causal="bottom_right",
        score_mod=lambda s, b, h, i, j: s + ((i * 7 + j) % 5) * 0.1 - (i // 3) * 0.01,
        mask_mod=lambda b, h, i, j: (h != 1) | (j % 3 != 0)),
    # lengths, segment ids and the moving bottom-right diagonal folded into the mask_mod
    # (`_mods.rules_as_mask`), so the kernels serve them too
    "lengths_bottom_right_window_alibi": lambda p: dict(
        causal="bottom_right", window=(50, 0), q_seqlens=jnp.asarray([250, 61], jnp.int32),
        kv_seqlens=jnp.asarray([320, 130], jnp.int32),
        score_mod=lambda s, b, h, i, j: s + p["slopes"][h] * (j - i)),
    "segments_lengths_softcap_score_mod": lambda p: dict(
        causal=True, q_segment_ids=DOCS[None].repeat(B, 0),
        kv_segment_ids=DOCS[None].repeat(B, 0), q_seqlens=jnp.asarray([320, 199], jnp.int32),
        kv_seqlens=jnp.asarray([300, 320], jnp.int32),
        score_mod=lambda s, b, h, i, j: 8.0 * jnp.tanh(s / 8.0) + p["bias_k"][j]),
    # dropout: the kernels draw attnaux's keep-mask, the reference's with the same key
    "alibi_causal_dropout": lambda p: dict(
        causal=True, dropout_rate=0.2, key=jax.random.key(4),
        score_mod=lambda s, b, h, i, j: s + p["slopes"][h] * (j - i)),
    "segments_lengths_mask_dropout": lambda p: dict(
        q_segment_ids=DOCS[None].repeat(B, 0), kv_segment_ids=DOCS[None].repeat(B, 0),
        kv_seqlens=jnp.asarray([300, 320], jnp.int32), dropout_rate=0.3,
        key=jax.random.key(6), mask_mod=lambda b, h, i, j: (i - j < 70)),
}


def _params():
    keys = jax.random.split(jax.random.key(5), 3)
    return {"slopes": SLOPES, "gate": jnp.asarray([1.0, 0.5, 2.0, 1.5]),
            "bias_q": 0.3 * jax.random.normal(keys[0], (S,)),
            "bias_k": 0.3 * jax.random.normal(keys[1], (S,)),
            "sink": jnp.asarray([0.5, -1.0, 2.0, 0.0])}


def _mods_run(make, backend, q, k, v, w, u, params):
    def loss(q, k, v, params):
        out, aux = ax.attention(q, k, v, backend=backend, **make(params))
        lse = jnp.where(jnp.isfinite(aux.lse), aux.lse, 0.0)
        return (jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(lse * u),
                (out, aux.lse, aux.max, aux.backend))

    (_, (out, lse, mx, backend_used)), grads = jax.value_and_grad(
        loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, params)
    return (out, lse, mx), grads, backend_used


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MOD_CASES))
def test_score_mod_on_hopper_matches_the_reference(name):
    if not ON_HOPPER:
        pytest.skip("attnaux's own kernels need a Hopper GPU")
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, S, HQ, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, S, HK, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, S, HK, D), jnp.bfloat16)
    w = jax.random.normal(keys[3], (B, S, HQ, D))
    u = jax.random.normal(keys[4], (B, HQ, S))
    params = _params()
    make = MOD_CASES[name]
    explained = ax.explain(q, k, v, **make(params))
    assert "Hopper" in str(explained), explained
    (out, lse, mx), grads, used = _mods_run(make, "auto", q, k, v, w, u, params)
    assert used == "flash"
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (r_out, r_lse, r_mx), r_grads, _ = _mods_run(make, "reference", *f32, w, u, params)
    _close(out.astype(jnp.float32), r_out, 3e-2, "out")
    _close(lse, r_lse, 1e-4, "lse")
    _close(mx, r_mx, 1e-4, "max")
    for n, g, r in zip(("dq", "dk", "dv"), grads[:3], r_grads[:3], strict=True):
        _close(g.astype(jnp.float32), r, 3e-2, n)
    for n in params:
        _close(grads[3][n], r_grads[3][n], 3e-2, f"d{n} (captured)")


@pytest.mark.parametrize("name", sorted(MOD_CASES))
def test_split_matches_the_score_program(name):
    """The split (XLA side inputs + the kernel's tile function, here in plain JAX) computes
    what the program's NumPy interpreter computes, at every (batch, head, query, key)."""
    mods, consts = _flex.convert(MOD_CASES[name](_params()).get("score_mod"),
                                 MOD_CASES[name](_params()).get("mask_mod"))
    program, extras = translate(mods.score_scalar, mods.n_score, mods.mask_scalar, mods.n_mask,
                                consts)
    sp = hm.split(program)
    rows, cols = hm.side_inputs(sp, (*consts, *extras), B, HQ, S, S)
    tf = hm.tile_fn(sp)
    s = jax.random.normal(jax.random.key(0), (B, HQ, S, S), jnp.float32)
    b = jnp.arange(B)[:, None, None, None]
    h = jnp.arange(HQ)[None, :, None, None]
    i = jnp.arange(S)[None, None, :, None]
    j = jnp.arange(S)[None, None, None, :]
    got_s, got_m = tf.fn(s, i, j, b, h, tuple(rows[:, :, r, :, None] for r in range(tf.n_rows)),
                         tuple(cols[:, :, c, None, :] for c in range(tf.n_cols)))
    want_s, want_m = evaluate(program, np.asarray(pack_consts(program, consts, extras)),
                              np.asarray(s), np.asarray(b), np.asarray(h), np.asarray(i),
                              np.asarray(j))
    if want_s is not None:
        np.testing.assert_allclose(np.asarray(got_s), want_s, rtol=0, atol=1e-5)
    if want_m is not None:
        np.testing.assert_array_equal(np.broadcast_to(np.asarray(got_m), want_m.shape), want_m)


def test_a_table_read_per_pair_is_left_to_flex():
    rel = jnp.linspace(-1.0, 1.0, 2 * S)
    mods, consts = _flex.convert(lambda s, b, h, i, j: s + rel[i - j + S], None)
    program, _ = translate(mods.score_scalar, mods.n_score, mods.mask_scalar, mods.n_mask,
                           consts)
    with pytest.raises(Untranslatable, match="indexed by both q_idx and kv_idx"):
        hm.split(program)


def test_block_tables_of_a_causal_mask():
    """mask_mod's 64 x 64 table of a causal mask gives every block row the diagonal range."""
    n = 4
    tiles = np.tril(np.full((n, n), 2, np.int32), -1) + np.eye(n, dtype=np.int32)
    fwd, dq, dkv = hm.range_tables(tiles[None, None], n, n, 128, 1)
    np.testing.assert_array_equal(dq[0, 0], [[0, 1, 0, 0], [0, 2, 0, 1], [0, 3, 0, 2],
                                             [0, 4, 0, 3]])
    np.testing.assert_array_equal(dkv[0, 0], [[0, 4, 1, 4], [1, 4, 2, 4], [2, 4, 3, 4],
                                              [3, 4, 3, 3]])
    np.testing.assert_array_equal(fwd[0, 0], [[0, 1, 0, 0], [0, 1, 0, 0], [0, 2, 0, 1],
                                              [0, 2, 0, 1]])


# ---- GPU flash's forward on the Hopper kernel, cuDNN's backward
def _problem(q_seq=2048, kv_seq=2048, dim=128, **kw):
    from attnaux._canon import canonicalize, parse_statics

    q = jnp.zeros((1, q_seq, 4, dim), jnp.bfloat16)
    k = jnp.zeros((1, kv_seq, 2, dim), jnp.bfloat16)
    arrays = {n: kw.pop(n) for n in ("bias", "q_seqlens", "q_segment_ids", "kv_segment_ids")
              if n in kw}
    if kw.get("dropout_rate"):
        arrays["key"] = jax.random.key(0)
    return canonicalize(q, k, k, parse_statics(**{"scale": None, "causal": False,
                                                  "window": None, "softcap": None,
                                                  "dropout_rate": 0.0, **kw}), **arrays)


def test_the_forward_on_hopper_rule(monkeypatch):
    """`_dispatch.gpu_forward_on_hopper`: causal attention at head dim 128 with q_seq and kv_seq
    >= 2048 only (the device check stubbed, so that the rule itself runs off a Hopper GPU too)."""
    from attnaux import _dispatch

    monkeypatch.setattr(fh, "device_unavailable", lambda q, k, v: None)
    rule = _dispatch.gpu_forward_on_hopper
    causal = dict(causal="top_left")
    assert rule(_problem(**causal)) is not None
    assert rule(_problem(causal="bottom_right", window=(256, 0))) is not None
    assert rule(_problem(kv_seq=4096, causal="bottom_right")) is not None
    assert rule(_problem(q_seq=64, kv_seq=4096, causal="bottom_right")) is None  # not measured
    assert rule(_problem()) is None  # no mask: a tie with cuDNN
    assert rule(_problem(window=(256, 256))) is None
    assert rule(_problem(kv_seq=1024, **causal)) is None  # cuDNN measured faster
    assert rule(_problem(dim=64, **causal)) is None
    assert rule(_problem(softcap=30.0, **causal)) is None
    assert rule(_problem(dropout_rate=0.1, **causal)) is None
    assert rule(_problem(q_seq=4096, kv_seq=2048, causal="bottom_right")) is None  # padding
    assert rule(_problem(q_seqlens=jnp.array([100], jnp.int32), **causal)) is None
    assert rule(_problem(bias=jnp.zeros((1, 1, 2048, 2048), jnp.float32), **causal)) is None
    ids = jnp.zeros((1, 2048), jnp.int32)
    assert rule(_problem(q_segment_ids=ids, kv_segment_ids=ids, **causal)) is None
    monkeypatch.setattr(_dispatch, "GPU_FORWARD_ON_HOPPER", False)
    assert rule(_problem(**causal)) is None


def test_the_backward_on_cuda_rule(monkeypatch):
    """`_dispatch.gpu_backward_on_cuda`: causal attention without a window at head dim 128,
    16-bit, q_seq and kv_seq >= 1024 and q_seq a multiple of 64, the kernel built and XLA not
    asked for deterministic results (the device and build checks stubbed, so that the rule
    itself runs off a Hopper GPU too); the dispatch then pairs it with either forward."""
    from attnaux import _dispatch

    monkeypatch.setattr(fh, "device_unavailable", lambda q, k, v: None)
    monkeypatch.setattr(_ffi, "has_target", lambda name, platform: True)
    rule = _dispatch.gpu_backward_on_cuda
    causal = dict(causal="top_left")
    assert rule(_problem(**causal)) is not None
    assert rule(_problem(q_seq=1024, kv_seq=1024, **causal)) is not None
    assert rule(_problem(q_seq=1024, kv_seq=3072, causal="bottom_right")) is not None
    assert rule(_problem()) is None  # no mask: a tie with cuDNN
    assert rule(_problem(causal="top_left", window=(256, 0))) is None  # not measured
    assert rule(_problem(q_seq=512, kv_seq=512, **causal)) is None  # not measured
    assert rule(_problem(q_seq=1056, kv_seq=1056, **causal)) is None  # q_seq % 64
    assert rule(_problem(dim=64, **causal)) is None
    assert rule(_problem(softcap=30.0, **causal)) is None
    assert rule(_problem(dropout_rate=0.1, **causal)) is None
    assert rule(_problem(q_seqlens=jnp.array([100], jnp.int32), **causal)) is None
    assert rule(_problem(bias=jnp.zeros((1, 1, 2048, 2048), jnp.float32), **causal)) is None
    ids = jnp.zeros((1, 2048), jnp.int32)
    assert rule(_problem(q_segment_ids=ids, kv_segment_ids=ids, **causal)) is None
    monkeypatch.setattr(fh, "deterministic_requested", lambda: True)
    assert rule(_problem(**causal)) is None
    monkeypatch.setattr(fh, "deterministic_requested", lambda: False)
    monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(_dispatch._flash_cudnn, "unavailable", lambda problem, platform: None)
    monkeypatch.setattr(_dispatch, "GPU_FORWARD_ON_HOPPER", True)
    for q_seq, impl in ((2048, _dispatch.FLASH_HOPPER_BOTH),
                        (1024, _dispatch.FLASH_CUDA_BACKWARD)):
        choice = _dispatch.choose(_problem(q_seq=q_seq, kv_seq=q_seq, **causal), "flash",
                                  False)
        assert choice.implementation is impl, choice.explanation
    monkeypatch.setattr(_dispatch, "GPU_BACKWARD_ON_CUDA", False)
    assert rule(_problem(**causal)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("causal, q_seq, kv_seq, sink", [
    ("top_left", 1024, 1024, False), ("top_left", 2048, 2048, True),
    ("bottom_right", 1024, 1280, True)])
def test_flash_with_the_cuda_backward_matches_the_reference(causal, q_seq, kv_seq, sink):
    """`attention(backend="flash")` differentiated by the CUDA C++ backward, after cuDNN's
    forward (1024 tokens) or the Hopper forward (2048): out, lse and the gradients (with an lse
    cotangent) against `backend="reference"` in float32."""
    if not ON_HOPPER:
        pytest.skip("attnaux's own kernels need a Hopper GPU")
    if not _ffi.has_target(fh.CUDA_BACKWARD_TARGET, "gpu"):
        pytest.skip("the CUDA C++ backward is not built into this install")
    keys = [jax.random.fold_in(jax.random.key(4), i) for i in range(5)]
    q = jax.random.normal(keys[0], (2, q_seq, 8, 128), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (2, kv_seq, 2, 128), jnp.bfloat16) for kk in keys[1:3])
    dout = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    dlse = jax.random.normal(keys[4], (2, 8, q_seq), jnp.float32)
    kw = dict(causal=causal, sink=jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32) if sink else None)
    explained = ax.explain(q, k, v, backend="flash", **kw)
    assert "CUDA C++ Hopper backward" in explained.implementation, explained

    def f(backend, q, k, v):
        out, aux = ax.attention(q, k, v, backend=backend, **kw)
        return out, aux.lse

    got, pull = jax.vjp(functools.partial(f, "flash"), q, k, v)
    want, pull_ref = jax.vjp(functools.partial(f, "reference"),
                             *(x.astype(jnp.float32) for x in (q, k, v)))
    _close(got[0], want[0], 3e-2, "out")
    _close(got[1], want[1], 1e-4, "lse")
    for name, g, r in zip("qkv", pull((dout, dlse)), pull_ref((dout.astype(jnp.float32), dlse)),
                          strict=True):
        _close(g.astype(jnp.float32), r, 3e-2, f"d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal, window, q_seq, kv_seq, sink", [
    ("top_left", None, 2048, 2048, False), ("top_left", None, 2048, 2048, True),
    ("bottom_right", None, 2048, 2200, False), ("top_left", (300, 0), 2176, 2176, False)])
def test_flash_with_the_hopper_forward_matches_the_reference(causal, window, q_seq, kv_seq,
                                                             sink):
    """`attention(backend="flash")` where the forward runs on the Hopper kernel and cuDNN's
    backward differentiates it: out, lse, max and the gradients (with an lse cotangent)
    against `backend="reference"` in float32."""
    if not ON_HOPPER:
        pytest.skip("attnaux's own kernels need a Hopper GPU")
    keys = [jax.random.fold_in(jax.random.key(3), i) for i in range(5)]
    q = jax.random.normal(keys[0], (2, q_seq, 8, 128), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (2, kv_seq, 2, 128), jnp.bfloat16) for kk in keys[1:3])
    dout = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    dlse = jax.random.normal(keys[4], (2, 8, q_seq), jnp.float32)
    kw = dict(causal=causal, window=window,
              sink=jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32) if sink else None)
    explained = ax.explain(q, k, v, backend="flash", **kw)
    assert "Hopper forward" in explained.implementation, explained

    def f(backend, q, k, v):
        out, aux = ax.attention(q, k, v, backend=backend, **kw)
        return (out, aux.lse), aux.max

    got, pull, got_max = jax.vjp(functools.partial(f, "flash"), q, k, v, has_aux=True)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, pull_ref, want_max = jax.vjp(functools.partial(f, "reference"), *f32, has_aux=True)
    _close(got[0], want[0], 3e-2, "out")
    _close(got[1], want[1], 1e-4, "lse")
    _close(got_max, want_max, 1e-4, "max")
    for name, g, r in zip("qkv", pull((dout, dlse)), pull_ref((dout.astype(jnp.float32), dlse)),
                          strict=True):
        _close(g.astype(jnp.float32), r, 3e-2, f"d{name}")


@pytest.mark.parametrize("causal, sink", [("top_left", False), ("bottom_right", True)])
def test_the_hopper_forward_row_runs_the_forward_kernel(causal, sink):
    """The dispatch's `FLASH_HOPPER_FORWARD` row end to end up to the kernel, on the CPU with
    the Hopper kernel's stand-in (`tests/hopper_emulation.py`; a causal call without bias or
    mask reaches no cuDNN graph in the forward): `_flash_cudnn.run` with the Hopper kernel in
    cuDNN's place gives reference's out, lse and max, the sink applied after it."""
    from hopper_emulation import close, emulated_kernels

    from attnaux import _dispatch
    from attnaux._canon import canonicalize, parse_statics

    keys = [jax.random.fold_in(jax.random.key(5), i) for i in range(3)]
    q = jax.random.normal(keys[0], (2, 136, 4, 32))
    k, v = (jax.random.normal(kk, (2, 200, 2, 32)) for kk in keys[1:])
    sinks = jnp.linspace(-1.0, 1.0, 4) if sink else None
    statics = parse_statics(scale=None, causal=causal, window=None, softcap=None,
                            dropout_rate=0.0)
    problem = canonicalize(q, k, v, statics, sink=sinks)
    with emulated_kernels():
        out, lse, row_max, probs = jax.jit(
            lambda a: _dispatch.FLASH_HOPPER_FORWARD.module.run(a, problem.options, False)
        )(problem.arrays)
    assert probs is None
    want, aux = ax.attention(q, k, v, causal=causal, sink=sinks, backend="reference")
    close(out, want, 1e-5, "out")
    close(lse, aux.lse, 1e-5, "lse")
    close(row_max, aux.max, 1e-5, "max")


@pytest.mark.parametrize("causal, sink", [("top_left", False), ("bottom_right", True)])
def test_the_hopper_both_row_differentiates_with_the_backward_kernel(causal, sink):
    """The dispatch's `FLASH_HOPPER_BOTH` row end to end, differentiated, on the CPU with the
    Hopper kernels' stand-in (`tests/hopper_emulation.py`: the forward and the backward the CUDA
    kernel computes, so no cuDNN graph either way): `_flash_cudnn`'s VJP with
    `_hopper_mods.plain_backward` in cuDNN's backward's place gives reference's gradients of a
    loss with out, an lse term and the sink."""
    from hopper_emulation import close, emulated_kernels

    from attnaux import _dispatch
    from attnaux._canon import canonicalize, parse_statics

    keys = [jax.random.fold_in(jax.random.key(6), i) for i in range(4)]
    q = jax.random.normal(keys[0], (2, 136, 4, 32))
    k, v = (jax.random.normal(kk, (2, 200, 2, 32)) for kk in keys[1:3])
    w = jax.random.normal(keys[3], q.shape)
    sinks = jnp.linspace(-1.0, 1.0, 4) if sink else None
    statics = parse_statics(scale=None, causal=causal, window=None, softcap=None,
                            dropout_rate=0.0)

    def loss(run, q, k, v):
        problem = canonicalize(q, k, v, statics, sink=sinks)
        out, lse, _, _ = run(problem.arrays, problem.options)
        return jnp.sum(out * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) ** 2)

    def both(arrays, options):
        return _dispatch.FLASH_HOPPER_BOTH.module.run(arrays, options, False)

    def reference(arrays, options):
        return _dispatch.implementation("reference", "cpu").module.run(arrays, options, False)

    with emulated_kernels():
        got = jax.jit(jax.grad(functools.partial(loss, both), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", got, want, strict=True):
        close(g, r, 1e-4, f"d{name}")


@pytest.mark.parametrize("dim", [64, 128])
def test_cuda_dq_reorders_the_accumulator_order(dim):
    """`_cuda_dq` undoes the CUDA backward's dq_accum order: per query tile, two warpgroups'
    64 x dim/2 halves; in each, lane t0 + 4 t1 of warp t2 holds value v = v0 + 2 v1 + 4 v2 of
    row 16 t2 + 8 v1 + t1 and column 8 v2 + 2 t0 + v0 (the wgmma accumulator), written as 16-byte
    groups of 4 values, a warp's part contiguous. Built element by element in NumPy."""
    bsz, heads, tiles, half = 2, 3, 2, dim // 2
    per_warp = 64 * half // 4
    rng = np.random.default_rng(0)
    want = np.zeros((bsz, tiles * 64, heads, dim), np.float32)
    acc = np.zeros((bsz, heads, tiles, 2, 64 * half), np.float32)
    for b in range(bsz):
        for h in range(heads):
            for tile in range(tiles):
                for wg in range(2):
                    for t in range(128):
                        t0, t1, t2, lane = t % 4, (t // 4) % 8, t // 32, t % 32
                        for v in range(64 * half // 128):
                            v0, v1, v2 = v % 2, (v // 2) % 2, v // 4
                            value = rng.standard_normal()
                            want[b, tile * 64 + 16 * t2 + 8 * v1 + t1, h,
                                 wg * half + 8 * v2 + 2 * t0 + v0] = value
                            at = t2 * per_warp + 4 * (v2 * 32 + lane) + v % 4
                            acc[b, h, tile, wg, at] = value
    got = np.asarray(fh._cuda_dq(jnp.asarray(acc), 0.5, jnp.float32))
    np.testing.assert_array_equal(got, want * 0.5)
