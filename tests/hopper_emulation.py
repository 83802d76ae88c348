"""A pure-JAX stand-in for the Hopper kernels' packed calls (`_flash_hopper.forward` and
`backward` with a packed geometry), so that what wraps them (`_hopper_packed`: padding, token
infos, tables, partitioning over devices, vmap folding, the custom VJP) runs and is checked on
CPU. It computes what the kernels compute, from the same token infos, densely in float32:
visibility by `_flash_hopper._packed_visible`, a masked softmax, and the backward from the given
out and lse, as the kernels' (dS = P * (dP - (D - dlse))).

Use as a context manager: `with emulated_kernels(): ...` (it swaps the two module attributes
and clears JAX's caches around the swap)."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

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


def _numpy_dense(q, k, v, q_info, kv_info, scale, softcap, geometry):
    """`(p [B, Hq, Sq, Skv], tanh or None, v repeated)` in float64 NumPy."""
    visible = np.asarray(fh._packed_visible(
        geometry, q_info[:, 0, :, None], q_info[:, 1, :, None], kv_info[:, 0, None, :],
        kv_info[:, 1, None, :]))[:, None]
    group = q.shape[2] // k.shape[2]
    kf, vf = (np.repeat(np.asarray(x, np.float64), group, axis=2) for x in (k, v))
    s = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), kf) * scale
    th = None
    if softcap is not None:
        th = np.tanh(s / softcap)
        s = th * softcap
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    denom = e.sum(-1, keepdims=True)
    p = e / np.where(denom > 0, denom, 1.0)
    lse = np.where(denom[..., 0] > 0, m[..., 0] + np.log(np.where(denom > 0, denom, 1.0))[..., 0],
                   -np.inf)
    return p, s, th, kf, vf, lse


def _numpy_forward(q, k, v, q_info, kv_info, *, scale, softcap, geometry, dtype):
    p, s, _, _, vf, lse = _numpy_dense(q, k, v, q_info, kv_info, scale, softcap, geometry)
    out = np.einsum("bhqk,bkhd->bqhd", p, vf)
    return (out.astype(dtype), lse.astype(np.float32),
            np.where(np.isfinite(lse), s.max(-1), -np.inf).astype(np.float32))


def _numpy_backward(q, k, v, out, lse, dout, dlse, q_info, kv_info, *, scale, softcap,
                    geometry):
    _, s, th, kf, vf, _ = _numpy_dense(q, k, v, q_info, kv_info, scale, softcap, geometry)
    lse = np.asarray(lse, np.float64)
    p = np.exp(s - np.where(np.isfinite(lse), lse, np.inf)[..., None])  # the given lse's P
    do = np.asarray(dout, np.float64)
    group = q.shape[2] // k.shape[2]
    dv = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vf)
    row = np.einsum("bqhd,bqhd->bhq", do, np.asarray(out, np.float64)) - np.asarray(dlse)
    ds = p * (dp - row[..., None])
    if th is not None:
        ds = ds * (1.0 - th * th)
    ds = ds * scale
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kf)
    dk = np.einsum("bhqk,bqhd->bkhd", ds, np.asarray(q, np.float64))

    def fold(x):  # query heads' shares back onto their kv head
        b, s_, h, d = x.shape
        return x.reshape(b, s_, h // group, group, d).sum(3)

    return (dq.astype(q.dtype), fold(dk).astype(k.dtype), fold(dv).astype(v.dtype))


def opaque_forward(q, k, v, rows, cols, *, scale, softcap, geometry, tile_fn, config,
                   tables=None, infos=None):
    """`fake_forward` in NumPy behind `jax.pure_callback`: a call XLA cannot look into or
    partition (as the kernels' custom calls), so that a test of the partitioning can fail."""
    stats = jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), stats, stats)
    host = functools.partial(_numpy_forward, scale=scale, softcap=softcap, geometry=geometry,
                             dtype=q.dtype)
    return jax.pure_callback(host, shapes, q, k, v, *infos)


def opaque_backward(q, k, v, out, lse, dout, dlse, rows, cols, *, scale, softcap, geometry,
                    tile_fn, config, tables=None, infos=None):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    host = functools.partial(_numpy_backward, scale=scale, softcap=softcap, geometry=geometry)
    dq, dk, dv = jax.pure_callback(host, shapes, q, k, v, out, lse, dout, dlse, *infos)
    return dq, dk, dv, rows, cols


@contextlib.contextmanager
def emulated_kernels(opaque: bool = False):
    """`opaque`: the NumPy stand-in behind `jax.pure_callback` (`opaque_forward`)."""
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
