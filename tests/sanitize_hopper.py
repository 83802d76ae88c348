"""A small grid of attnaux's Hopper kernels (`_flash_hopper`: forward, dK/dV and dQ) for
NVIDIA's compute-sanitizer, which checks every memory access of every launch:

    compute-sanitizer --tool memcheck python tests/sanitize_hopper.py
    compute-sanitizer --tool racecheck python tests/sanitize_hopper.py

(not collected by pytest; on a Hopper GPU). The grid covers the geometries (causal top-left and
bottom-right, window, key padding), head dims 64 and 128, GQA, a tile function with per-row and
per-column inputs, packed tokens with block tables, dropout, and both forms of the backward (dQ
reduce-added inside the dK/dV kernel, and the two-kernel form); each call is checked against
nothing but finiteness here (the pytest files check the values)."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from attnaux import _flash_hopper as fh
from attnaux import _hopper_packed as hpk
from attnaux._canon import canonicalize, parse_statics


def _tile(s, q_pos, kv_pos, b, h, rows, cols):
    return s + rows[0] - cols[0], jax.lax.rem(q_pos + kv_pos, jnp.full_like(q_pos, 3)) != 0


TILE = fh.TileFn(_tile, 1, 1, True, "sanitize_hopper._tile")
STATE = jnp.concatenate([jax.random.bits(jax.random.key(0), (4,), jnp.uint32),
                         jnp.asarray([0, 0, 0, 0, 2, 256, 384, 0], jnp.uint32)])


def kernels(dim, hkv, causal, window, offset, tile, dropout, fused_dq=None):
    # 512 keys at head dim 64: the forward's 256-key tiles (`default_config`)
    b, sq, skv, hq = 1, 256, 512 if dim == 64 else 384, 2
    geo = fh.Geometry(causal, window, offset, skv - 37, sq)
    ks = [jax.random.fold_in(jax.random.key(1), i) for i in range(5)]
    q = jax.random.normal(ks[0], (b, sq, hq, dim), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, skv, hkv, dim), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, skv, hkv, dim), jnp.bfloat16)
    n = 1 if tile is not None else 0
    rows = jax.random.normal(ks[3], (b, hq, n, sq), jnp.float32)
    cols = jax.random.normal(ks[4], (b, hq, n, skv), jnp.float32)
    config = fh.default_config(dim, skv)
    if fused_dq is not None:
        config = dataclasses.replace(config, fused_dq=fused_dq)
    kw = dict(scale=dim ** -0.5, softcap=None, geometry=geo, tile_fn=tile, config=config)
    if dropout:
        kw.update(dropout=0.2, drop_state=STATE)
    out, lse, _ = fh.forward(q, k, v, rows, cols, **kw)
    grads = fh.backward(q, k, v, out, lse, out, jnp.zeros_like(lse), rows, cols, **kw)
    return (out, *grads[:3])


def packed(dropout):
    s, seg = 300, np.repeat(np.arange(3), 100)[None]
    ks = jax.random.split(jax.random.key(2), 3)
    q, k, v = (jax.random.normal(x, (1, s, 2, 64), jnp.bfloat16) for x in ks)
    statics = parse_statics(scale=None, causal=True, window=None, softcap=None,
                            dropout_rate=0.2 if dropout else 0.0)
    problem = canonicalize(q, k, v, statics, q_segment_ids=seg, kv_segment_ids=seg,
                           key=jax.random.key(3) if dropout else None)

    def loss(q, k, v):
        a = problem.arrays._replace(q=q, k=k, v=v)
        return hpk.run(a, problem.options, False)[0].astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


GRID = [  # (head dim, kv heads, causal, window, offset, tile function, dropout[, fused dQ])
    (64, 1, False, None, 0, None, False),
    (128, 2, True, None, 128, None, False),
    (64, 2, True, (40, 0), 0, None, False),
    (64, 2, True, (40, 0), 0, None, False, False),  # the two-kernel backward at 64
    (128, 2, True, None, 0, None, False, True),  # the fused backward at 128 (not the default)
    (128, 1, False, (30, 70), 0, TILE, False),
    (64, 1, True, None, 0, None, True),
]


def main() -> int:
    for case in GRID:
        for x in kernels(*case):
            assert bool(jnp.isfinite(x.astype(jnp.float32)).all()), case
        print("ok", case, flush=True)
    for dropout in (False, True):
        for x in packed(dropout):
            assert bool(jnp.isfinite(x.astype(jnp.float32)).all()), ("packed", dropout)
        print("ok packed, dropout", dropout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
