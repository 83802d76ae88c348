"""`score_mod` / `mask_mod` on the Hopper kernels (`_hopper_mods.run`, called as the dispatch
calls it on a Hopper GPU) under `jax.jit` with batch and heads sharded 2 x 2 over host CPU
devices, the kernels replaced by a stand-in (`tests/hopper_emulation.py`):

- compiled with the stand-in behind a `jax.pure_callback` (opaque to XLA, like the kernels'
  custom calls), each device runs its shard: no all-gather, all-to-all or collective-permute in
  the compiled forward or gradient;
- with the stand-in in plain JAX, out, lse and the gradients of q, k, v and of the captured
  arrays equal the unsharded call (float32; 1e-5 / 1e-4 relative to the largest entry), with a
  score_mod whose in-kernel part reads the batch and head index (each shard's tile function
  sees the global ones) and a mask_mod whose block table is per head (sliced with the heads,
  its batch dim of 1 left whole) or per batch row and head;
- under `jax.shard_map` (batch split, every device its block) the same call and gradients equal
  the unsharded one."""

import jax
import jax.numpy as jnp
import pytest
from hopper_emulation import close, emulated_kernels, gathers_in, mods_attention
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import attnaux as ax

MASKS = {  # mask_mod's table of 64 x 64 tiles: [1, Hq, ...] and [B, Hq, ...]
    "per_head": lambda b, h, i, j: (j <= i) & (i - j < 50 + 40 * h),
    "per_batch_and_head": lambda b, h, i, j: (j <= i) & (i - j < 40 + 30 * h + 50 * b),
}


def _score_mod(slopes, w):
    """The batch and head index read inside the kernel (`(i - j) * h`, `s * b`: a product with
    a per-pair value) and ahead of it (`slopes[h]`, `w[b]`: per-row inputs)."""
    return lambda s, b, h, i, j: (s + slopes[h] * (j - i) * 0.05 + (i - j) * h * 0.01
                                  + s * b * 0.1 + w[b])


def _run(q, k, v, slopes, w, mask="per_head"):
    out, lse, _ = mods_attention(q, k, v, _score_mod(slopes, w), MASKS[mask])
    return out, lse


def _loss(q, k, v, slopes, w, mask="per_head"):
    out, lse = _run(q, k, v, slopes, w, mask)
    return (out**2).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()


def _operands():
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (4, 200, 4, 16))
    k, v = (jax.random.normal(kk, (4, 200, 2, 16)) for kk in keys[1:3])  # GQA, group 2
    slopes = jax.random.uniform(keys[3], (4,))
    w = jax.random.normal(keys[4], (4,))
    return q, k, v, slopes, w


def _mesh():
    return jax.make_mesh((2, 2), ("b", "h"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_the_sharded_call_has_no_collective():
    """Compiled with the kernels opaque to XLA: each device runs its shard (executing a host
    callback on several CPU devices at once crashes jaxlib, so these programs are compiled
    only)."""
    mesh = _mesh()
    q, k, v, slopes, w = _operands()
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    sharded = (put(q, P("b", None, "h")), put(k, P("b", None, "h")), put(v, P("b", None, "h")),
               put(slopes, P()), put(w, P()))
    grad = jax.grad(_loss, argnums=(0, 1, 2, 3, 4))
    with emulated_kernels(opaque=True):
        for name, fn in (("forward", jax.jit(_run)), ("gradient", jax.jit(grad))):
            text = fn.lower(*sharded).compile().as_text()
            found = gathers_in(text)
            assert not found, f"{name}: {found} in the compiled program"


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_the_sharded_call_equals_the_unsharded_one(mask):
    mesh = _mesh()
    q, k, v, slopes, w = _operands()
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    sharded = (put(q, P("b", None, "h")), put(k, P("b", None, "h")), put(v, P("b", None, "h")),
               slopes, w)
    run = jax.jit(lambda *a: _run(*a, mask))
    grad = jax.jit(jax.grad(lambda *a: _loss(*a, mask), argnums=(0, 1, 2, 3, 4)))
    with emulated_kernels():
        out, lse = run(*sharded)
        grads = grad(*sharded)
        want_out, want_lse = run(q, k, v, slopes, w)
        want = grad(q, k, v, slopes, w)
    assert out.sharding.spec[:3] == ("b", None, "h"), out.sharding
    close(out, want_out, 1e-5, "out")
    close(lse, want_lse, 1e-5, "lse")
    for name, g_, w_ in zip(("q", "k", "v", "slopes", "w"), grads, want, strict=True):
        close(g_, w_, 1e-4, f"d{name}")
    # the unsharded call is the materialised reference's
    r_out, r_aux = ax.attention(q, k, v, score_mod=_score_mod(slopes, w), mask_mod=MASKS[mask],
                                backend="reference")
    close(want_out, r_out, 1e-5, "out against the materialised reference")
    close(want_lse, r_aux.lse, 1e-5, "lse against the materialised reference")


def test_under_shard_map():
    """Batch split over 2 devices inside `jax.shard_map` (heads whole, so that the head index
    each device's function sees is the global one; no term of the batch index, which is each
    block's own there): the gradients equal the unsharded call's,
    the captured arrays' summed over the devices by shard_map."""
    mesh = jax.make_mesh((2,), ("b",), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v, slopes, _ = _operands()

    def loss(q, k, v, slopes):
        out, lse, _ = mods_attention(q, k, v, lambda s, b, h, i, j: (
            s + slopes[h] * (j - i) * 0.05 + (i - j) * h * 0.01), MASKS["per_head"])
        return (out**2).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    grads = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2, 3)), mesh=mesh,
                          in_specs=(P("b"), P("b"), P("b"), P()),
                          out_specs=(P("b"), P("b"), P("b"), P()))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    with emulated_kernels():
        got = jax.jit(grads)(put(q, P("b")), put(k, P("b")), put(v, P("b")), slopes)
        want = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, slopes)
    for name, g_, w_ in zip(("q", "k", "v", "slopes"), got, want, strict=True):
        close(g_, w_, 1e-4, f"d{name} under shard_map")


def test_vmap_of_the_sharded_call():
    """`jax.vmap` over a leading axis, the batch under it sharded 2 x 2 with the heads: the
    mapped axis folds into the batch (one call), and each element's tile function still sees
    its own batch index, so the gradients equal each element's unsharded call."""
    mesh = _mesh()
    q, k, v, slopes, w = _operands()
    q2 = jnp.stack([q, -0.5 * q])
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    grad = jax.grad(_loss, argnums=(0, 1, 2, 3, 4))
    with emulated_kernels():
        got = jax.jit(jax.vmap(grad, in_axes=(0, None, None, None, None)))(
            put(q2, P(None, "b", None, "h")), put(k, P("b", None, "h")),
            put(v, P("b", None, "h")), slopes, w)
        want = [jax.jit(grad)(x, k, v, slopes, w) for x in q2]
    for i, each in enumerate(want):
        for name, g_, w_ in zip(("q", "k", "v", "slopes", "w"), got, each, strict=True):
            close(g_[i], w_, 1e-4, f"d{name} of element {i}")


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_the_flash_forward_on_hopper_sharded(causal):
    """`_hopper_mods.plain_forward`, the forward GPU `flash` runs on the Hopper kernel (cuDNN's
    backward after it, `_dispatch.gpu_forward_on_hopper`), with batch and heads sharded 2 x 2:
    no collective in the compiled program (the kernel opaque), and out, lse and max equal the
    unsharded call and `reference` (136 query rows against 200 keys: padded to 256 inside,
    GQA, a bottom-right offset of 64)."""
    from attnaux import _flash_cudnn
    from attnaux import _hopper_mods as hm

    mesh = _mesh()
    q, k, v, _, _ = _operands()
    q = q[:, :136]
    cfg = _flash_cudnn.Config(scale=0.3, causal=1 if causal == "top_left" else 2,
                              window_left=-1, window_right=-1, padding=False, with_max=True)
    run = jax.jit(lambda q, k, v: hm.plain_forward(cfg, q, k, v))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("b", None, "h")))  # noqa: E731
    sharded = (put(q), put(k), put(v))
    with emulated_kernels(opaque=True):
        found = gathers_in(run.lower(*sharded).compile().as_text())
    assert not found, f"{found} in the compiled program"
    with emulated_kernels():
        got = run(*sharded)
        want = run(q, k, v)
    r_out, r_aux = ax.attention(q, k, v, scale=0.3, causal=causal, backend="reference")
    for name, g_, w_, r_ in zip(("out", "lse", "max"), got, want, (r_out, r_aux.lse, r_aux.max),
                                strict=True):
        close(g_, w_, 1e-5, name)
        close(w_, r_, 1e-5, f"{name} against the reference")
