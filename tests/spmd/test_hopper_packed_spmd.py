"""Packed sequences on the Hopper kernels (`_hopper_packed`) under `jax.jit` with batch and heads
sharded 2 x 2 over host CPU devices, the kernels replaced by a stand-in
(`tests/hopper_emulation.py`): compiled with the stand-in behind a `jax.pure_callback` (opaque to
XLA, like the kernels' custom calls), each device runs its shard (no all-gather, all-to-all or
collective-permute in the compiled forward or gradient), and out, lse and the gradients equal
the unsharded call (float32; 1e-5 / 1e-4 relative to the largest entry)."""

import jax
import jax.numpy as jnp
from hopper_emulation import close, emulated_kernels, gathers_in
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attnaux import _hopper_packed as hpk
from attnaux._canon import canonicalize, parse_statics


def _run(q, k, v, seg):
    statics = parse_statics(scale=None, causal=True, window=None, softcap=None,
                            dropout_rate=0.0)
    problem = canonicalize(q, k, v, statics, q_segment_ids=seg, kv_segment_ids=seg)
    out, lse, _, _ = hpk.run(problem.arrays, problem.options, False)
    return out, lse


def _loss(q, k, v, seg):
    out, lse = _run(q, k, v, seg)
    return (out**2).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()


def test_packed_call_runs_per_shard():
    mesh = jax.make_mesh((2, 2), ("b", "h"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (4, 200, 4, 16))
    k, v = (jax.random.normal(kk, (4, 200, 2, 16)) for kk in keys[1:])
    seg = jnp.repeat(jnp.arange(5), 40)[None].repeat(4, 0).astype(jnp.int32)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    sharded = (put(q, P("b", None, "h")), put(k, P("b", None, "h")), put(v, P("b", None, "h")),
               put(seg, P("b")))
    # compiled with the kernels opaque to XLA (as their custom calls are): no collective
    # (executing a host callback on several CPU devices at once crashes jaxlib, so this
    # program is only compiled)
    with emulated_kernels(opaque=True):
        for name, fn in (("forward", jax.jit(_run)),
                         ("gradient", jax.jit(jax.grad(_loss, argnums=(0, 1, 2))))):
            text = fn.lower(*sharded).compile().as_text()
            found = gathers_in(text)
            assert not found, f"{name}: {found} in the compiled program"
    # the values, with the stand-in in plain JAX
    with emulated_kernels():
        out, lse = jax.jit(_run)(*sharded)
        dq, dk, dv = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))(*sharded)
        want_out, want_lse = jax.jit(_run)(q, k, v, seg)
        want = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))(q, k, v, seg)
    assert out.sharding.spec[0] == "b", out.sharding
    close(out, want_out, 1e-5, "out")
    close(lse, want_lse, 1e-5, "lse")
    for name, g_, w_ in zip("qkv", (dq, dk, dv), want):
        close(g_, w_, 1e-4, f"d{name}")
