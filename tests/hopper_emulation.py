"""A pure-JAX stand-in for the Hopper kernels' packed calls (`_flash_hopper.forward` and
`backward` with a packed geometry), so that what wraps them (`_hopper_packed`: padding, token
infos, tables, partitioning over devices, vmap folding, the custom VJP) runs and is checked on
CPU. It computes what the kernels compute, from the same token infos, densely in float32:
visibility by `_flash_hopper._packed_visible`, a masked softmax, and the backward from the given
out and lse, as the kernels' (dS = P * (dP - (D - dlse))).

Use as a context manager: `with emulated_kernels(): ...` (it swaps the two module attributes
and clears JAX's caches around the swap)."""

import contextlib

import jax
import jax.numpy as jnp

from attnaux import _flash_hopper as fh


def _scores(q, k, v, infos, scale, softcap, geometry):
    """`(visible, s, tanh or None, q, k, v)`: the scores after scale and softcap (float32, not
    masked) and the operands in float32, k and v repeated over their query heads."""
    q_info, kv_info = infos
    visible = fh._packed_visible(geometry, q_info[:, 0, :, None], q_info[:, 1, :, None],
                                 kv_info[:, 0, None, :], kv_info[:, 1, None, :])[:, None]
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    kf, vf = jnp.repeat(kf, group, axis=2), jnp.repeat(vf, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf, precision="highest") * scale
    th = None
    if softcap is not None:
        th = jnp.tanh(s / softcap)
        s = th * softcap
    return visible, s, th, qf, kf, vf


def _dense(q, k, v, infos, scale, softcap, geometry):
    visible, s, _, _, _, vf = _scores(q, k, v, infos, scale, softcap, geometry)
    s = jnp.where(visible, s, -jnp.inf)
    m = s.max(-1)
    seen = jnp.isfinite(m)
    m_safe = jnp.where(seen, m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    denom = p.sum(-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(seen, denom, 1.0)[..., None], vf,
                     precision="highest")
    lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
    return out, lse, jnp.where(seen, m, -jnp.inf)


def fake_forward(q, k, v, rows, cols, *, scale, softcap, geometry, tile_fn, config,
                 tables=None, infos=None):
    assert geometry.packed and tile_fn is None and tables is not None
    out, lse, m = _dense(q, k, v, infos, scale, softcap, geometry)
    return out.astype(q.dtype), lse, m


def fake_backward(q, k, v, out, lse, dout, dlse, rows, cols, *, scale, softcap, geometry,
                  tile_fn, config, tables=None, infos=None):
    """As the kernels: P from the given `lse` (a block of a larger problem gets the whole
    problem's, so P is its share), dS = P * (dP - (rowsum(dO * O) - dlse))."""
    visible, s, th, qf, kf, vf = _scores(q, k, v, infos, scale, softcap, geometry)
    group = q.shape[2] // k.shape[2]
    lse_safe = jnp.where(jnp.isfinite(lse), lse, jnp.inf)  # rows that see nothing: P = 0
    p = jnp.where(visible, jnp.exp(s - lse_safe[..., None]), 0.0)
    do = dout.astype(jnp.float32)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, do, precision="highest")
    dp = jnp.einsum("bqhd,bkhd->bhqk", do, vf, precision="highest")
    row = jnp.einsum("bqhd,bqhd->bhq", do, out.astype(jnp.float32), precision="highest") - dlse
    ds = p * (dp - row[..., None])
    if th is not None:
        ds = ds * (1.0 - th * th)
    ds = ds * scale
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kf, precision="highest")
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, qf, precision="highest")

    def fold(x):  # query heads' shares back onto their kv head
        b, n, h, d = x.shape
        return x.reshape(b, n, h // group, group, d).sum(3)

    return (dq.astype(q.dtype), fold(dk).astype(k.dtype), fold(dv).astype(v.dtype), rows, cols)


def _not_run(*_):
    raise RuntimeError("the opaque stand-in is for compiling only: executing a host callback on "
                       "several CPU devices at once crashes jaxlib")


def opaque_forward(q, k, v, rows, cols, *, scale, softcap, geometry, tile_fn, config,
                   tables=None, infos=None):
    """A call of the forward's shapes behind `jax.pure_callback`: one XLA cannot look into or
    partition (as the kernels' custom calls), so that a test of the partitioning can fail. Its
    programs are compiled and inspected, never run."""
    stats = jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), stats, stats)
    return jax.pure_callback(_not_run, shapes, q, k, v, *infos, *tables)


def opaque_backward(q, k, v, out, lse, dout, dlse, rows, cols, *, scale, softcap, geometry,
                    tile_fn, config, tables=None, infos=None):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    dq, dk, dv = jax.pure_callback(_not_run, shapes, q, k, v, out, lse, dout, dlse, *infos,
                                   *tables)
    return dq, dk, dv, rows, cols


@contextlib.contextmanager
def emulated_kernels(opaque: bool = False):
    """`opaque`: calls of the kernels' shapes behind `jax.pure_callback`, for compiling only
    (`opaque_forward`)."""
    saved = fh.forward, fh.backward
    fh.forward, fh.backward = fake_forward, fake_backward
    if opaque:
        fh.forward, fh.backward = opaque_forward, opaque_backward
    jax.clear_caches()
    try:
        yield
    finally:
        fh.forward, fh.backward = saved
        jax.clear_caches()
