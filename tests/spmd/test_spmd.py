"""attnaux under SPMD on 8 host CPU devices (issue 20): partitioned calls under `jax.jit` run
shard-local (no all-gather, all-to-all or collective-permute in the compiled HLO) and equal the
unsharded call; unsupported shardings raise an error that names them; `jax.shard_map` works with
both `check_vma` settings; a sharded dropout draws the unsharded call's keep-mask; export works
inside `shard_map`.

References: the unsharded call on one device (the same kernels, checked against float64 and
pure-JAX references by the main test suite) and, for the forward values, `backend="reference"`.
Tolerances: float32 inputs; the sharded and unsharded calls run the same kernels on the same rows
(only XLA's fusion of the surrounding code may differ), so 1e-5 for outputs and 1e-4 for
gradients, as in the main suite's float32 tolerance.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import attnaux as ax
from attnaux import introspect as ai

OUT_TOL = 1e-5
GRAD_TOL = 1e-4
GATHERS = ("all-gather", "all-to-all", "collective-permute")
B, S, H, KV, D = 8, 32, 4, 2, 16


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def collectives(compiled_text: str) -> dict[str, int]:
    found = {}
    for name in (*GATHERS, "all-reduce"):
        n = len(re.findall(rf"\b{name}(?:-start)?\(", compiled_text))
        if n:
            found[name] = n
    return found


def inputs(q_seq=S, kv_seq=S, batch=B, heads=H, kv_heads=KV, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (batch, q_seq, heads, D), jnp.float32)
    k = jax.random.normal(ks[1], (batch, kv_seq, kv_heads, D), jnp.float32)
    v = jax.random.normal(ks[2], (batch, kv_seq, kv_heads, D), jnp.float32)
    return q, k, v


def close(a, b, tol, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, float(np.max(np.abs(b)))) if b.size else 1.0
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol * scale:.3g}"


def padded(spec) -> tuple:
    return tuple(spec) + (None,) * 4


def put(mesh, spec, *arrays):
    return tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays)


def loss_of(backend, **options):
    def loss(q, k, v, *params):
        named = dict(zip(sorted(k for k in options if options[k] is None), params))
        out, aux = ax.attention(q, k, v, backend=backend, **{**options, **named})
        w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        u = jnp.sin(jnp.arange(aux.lse.size, dtype=jnp.float32)).reshape(aux.lse.shape)
        return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(aux.lse), aux.lse, 0) * u)

    return loss


# ------------------------------------------------------------------------------------------------
# Partitioning under jit
# ------------------------------------------------------------------------------------------------
SPECS = {
    "batch": P("data"), "heads": P(None, None, "model"), "batch+heads": P("data", None, "model"),
}
BACKENDS = ("flash", "probs", "small_seq")


@pytest.mark.parametrize("spec", SPECS, ids=list(SPECS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_partitioned_forward_and_gradients(mesh, backend, spec):
    kv_seq = 16 if backend == "small_seq" else S
    q_seq = 1 if backend == "small_seq" else S
    q, k, v = inputs(q_seq, kv_seq)
    sq, sk, sv = put(mesh, SPECS[spec], q, k, v)
    causal = backend != "small_seq"

    probs = backend != "flash"  # flash saves no probabilities

    def forward(q, k, v):
        return ax.attention(q, k, v, backend=backend, causal=causal, return_probs=probs)

    loss = loss_of(backend, causal=causal)
    fwd, grad = jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for fn in (fwd, grad):
        found = collectives(fn.lower(sq, sk, sv).compile().as_text())
        assert not found, f"{backend} {spec}: collectives in the compiled HLO: {found}"
    out, aux = fwd(sq, sk, sv)
    want, want_aux = forward(q, k, v)
    assert out.sharding.spec == SPECS[spec] or out.sharding.is_equivalent_to(sq.sharding, 4)
    full = tuple(SPECS[spec]) + (None,) * 4
    lse_spec = (full[0], full[2])
    assert padded(aux.lse.sharding.spec)[:2] == lse_spec
    close(out, want, OUT_TOL, "out")
    close(aux.lse, want_aux.lse, OUT_TOL, "lse")
    close(aux.max, want_aux.max, OUT_TOL, "max")
    if probs:
        assert padded(aux.probs.sharding.spec)[:2] == lse_spec
        close(aux.probs, want_aux.probs, OUT_TOL, "probs")
    for g, w, name in zip(grad(sq, sk, sv), jax.grad(loss, argnums=(0, 1, 2))(q, k, v), "qkv"):
        assert g.sharding.is_equivalent_to(put(mesh, SPECS[spec], g)[0].sharding, g.ndim)
        close(g, w, GRAD_TOL, f"d{name}")


OPTION_CASES = {
    "bias_mask_window_softcap": dict(window=(5, 3), softcap=20.0),
    "segments_seqlens_sink": dict(causal="bottom_right"),
}


@pytest.mark.parametrize("case", OPTION_CASES)
@pytest.mark.parametrize("backend", ("flash", "probs"))
def test_partitioned_options(mesh, backend, case):
    """Masks, bias, segment ids, seqlens and sink, sharded over batch and heads: shard-local in
    the forward; the gradient of a parameter shared over the batch (a `[1, H, S, S]` bias, the
    sink) is the only communication, an all-reduce of its partial sums."""
    q, k, v = inputs()
    rng = np.random.default_rng(1)
    options = dict(OPTION_CASES[case])
    params = {}
    if case == "bias_mask_window_softcap":
        params["bias"] = jnp.asarray(rng.standard_normal((1, H, S, S)), jnp.float32)
        options["mask"] = jnp.asarray(rng.random((B, 1, S, S)) < 0.8)
    else:
        seg = np.sort(rng.integers(0, 3, (B, S)), axis=1).astype(np.int32)
        options["q_segment_ids"] = options["kv_segment_ids"] = jnp.asarray(seg)
        options["q_seqlens"] = jnp.asarray(rng.integers(1, S + 1, B), jnp.int32)
        options["kv_seqlens"] = jnp.asarray(rng.integers(1, S + 1, B), jnp.int32)
        params["sink"] = jnp.asarray(rng.standard_normal(H), jnp.float32)
    spec = P("data", None, "model")
    sq, sk, sv = put(mesh, spec, q, k, v)
    names = sorted(params)

    def loss(q, k, v, *ps):
        out, aux = ax.attention(q, k, v, backend=backend, **options, **dict(zip(names, ps)))
        w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(aux.lse), aux.lse, 0))

    def forward(q, k, v, *ps):
        return ax.attention(q, k, v, backend=backend, **options, **dict(zip(names, ps)))

    ps = tuple(params[n] for n in names)
    fwd = jax.jit(forward)
    found = collectives(fwd.lower(sq, sk, sv, *ps).compile().as_text())
    assert not found, f"forward: {found}"
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(3 + len(ps)))))
    found = collectives(grad.lower(sq, sk, sv, *ps).compile().as_text())
    assert not any(name in found for name in GATHERS), f"backward: {found}"
    out, aux = fwd(sq, sk, sv, *ps)
    want, want_aux = forward(q, k, v, *ps)
    close(out, want, OUT_TOL, "out")
    close(aux.lse, want_aux.lse, OUT_TOL, "lse")
    got = grad(sq, sk, sv, *ps)
    for g, w, name in zip(got, jax.grad(loss, argnums=tuple(range(3 + len(ps))))(q, k, v, *ps),
                          ["q", "k", "v", *names]):
        close(g, w, GRAD_TOL, f"d{name}")


def test_gqa_heads_split_with_kv_heads(mesh):
    """Query heads sharded 2 ways under GQA 8:2: each shard reads its own kv head."""
    q, k, v = inputs(heads=8, kv_heads=2)
    sq, sk, sv = put(mesh, P(None, None, "model"), q, k, v)
    fwd = jax.jit(lambda q, k, v: ax.attention(q, k, v, backend="flash"))
    assert not collectives(fwd.lower(sq, sk, sv).compile().as_text())
    close(fwd(sq, sk, sv)[0], ax.attention(q, k, v, backend="reference")[0], OUT_TOL, "out")


def test_replicated_kv_is_sliced_locally(mesh):
    """q sharded, k and v replicated: each device slices its k/v shard (no communication)."""
    q, k, v = inputs()
    (sq,) = put(mesh, P("data", None, "model"), q)
    sk, sv = put(mesh, P(), k, v)
    fwd = jax.jit(lambda q, k, v: ax.attention(q, k, v, backend="flash"))
    assert not collectives(fwd.lower(sq, sk, sv).compile().as_text())
    close(fwd(sq, sk, sv)[0], ax.attention(q, k, v, backend="flash")[0], OUT_TOL, "out")


# ------------------------------------------------------------------------------------------------
# Shardings the kernels cannot take: a clear error, never a silent gather
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "heads", "kv_heads", "pattern"),
    [
        (P(None, "data"), H, KV, r"`q` is sharded along its q_seq axis.*attnaux\.parallel"),
        (P(None, None, None, "model"), H, KV, r"qk_dim axis.*replicate"),
        (P(None, None, "data"), 8, 2, r"kv heads dim \(2\) is split 4 ways.*divides kv_heads"),
    ],
    ids=["sequence", "head_dim", "kv_heads_not_divisible"],
)
def test_unsupported_shardings_raise(mesh, spec, heads, kv_heads, pattern):
    q, k, v = inputs(heads=heads, kv_heads=kv_heads)
    (sq,) = put(mesh, spec, q)
    # k and v come replicated when their heads cannot take q's sharding (device_put refuses it)
    sk, sv = put(mesh, spec if q.shape[2] == k.shape[2] * 2 and heads == H else P(), k, v)
    fwd = jax.jit(lambda q, k, v: ax.attention(q, k, v, backend="flash", causal=True))
    with pytest.raises(Exception, match=pattern):
        fwd(sq, sk, sv)


def test_explicit_mesh_partitions_and_raises_while_tracing():
    """A mesh of Explicit axes: batch sharding partitions; a sharded sequence is a ValueError
    raised while tracing (the shardings are in the types), naming the mesh axes."""
    mesh = jax.make_mesh((4, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    q, k, v = inputs()
    fwd = jax.jit(lambda q, k, v: ax.attention(q, k, v, backend="flash", causal=True))
    out, aux = fwd(*put(mesh, P("data", None, "model"), q, k, v))
    assert padded(out.sharding.spec)[:3] == ("data", None, "model")
    close(out, ax.attention(q, k, v, backend="flash", causal=True)[0], OUT_TOL, "out")
    with pytest.raises(ValueError, match=r"q_seq axis \(dim 1\), over mesh axes \('data',\)"):
        fwd(*put(mesh, P(None, "data"), q, k, v))


# ------------------------------------------------------------------------------------------------
# shard_map
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
@pytest.mark.parametrize("backend", ("flash", "probs", "small_seq", "reference"))
def test_shard_map(mesh, backend, check_vma):
    """Forward and gradients inside `jax.shard_map` over batch: the local call of each device,
    with a sink that is not sharded (its gradient summed over the devices)."""
    q_seq, kv_seq = (1, 16) if backend == "small_seq" else (S, S)
    q, k, v = inputs(q_seq, kv_seq)
    sink = jnp.linspace(-1.0, 1.0, H, dtype=jnp.float32)
    mask = jnp.asarray(np.random.default_rng(2).random((B, 1, q_seq, kv_seq)) < 0.8)
    flat = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def loss(q, k, v, sink, mask):  # a sum over rows, so the devices' losses add up to it
        out, aux = ax.attention(q, k, v, backend=backend, sink=sink, mask=mask)
        return jnp.sum(jnp.sin(out)) + jnp.sum(aux.lse)

    def local(q, k, v, sink, mask):
        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sink, mask)
        dq, dk, dv, dsink = grads
        if not check_vma:  # nothing tracks that sink was replicated: sum its gradient by hand
            dsink = jax.lax.psum(dsink, "x")
        return jax.lax.psum(value, "x"), dq, dk, dv, dsink

    batch = P("x")
    f = jax.jit(jax.shard_map(local, mesh=flat, in_specs=(batch, batch, batch, P(), batch),
                              out_specs=(P(), batch, batch, batch, P()), check_vma=check_vma))
    value, *grads = f(q, k, v, sink, mask)
    want_value, want = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sink, mask)
    close(value, want_value, GRAD_TOL, "loss")
    for g, w, name in zip(grads, want, ("q", "k", "v", "sink")):
        close(g, w, GRAD_TOL, f"d{name}")


# ------------------------------------------------------------------------------------------------
# Dropout: the sharded call draws the unsharded call's keep-mask
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ("flash", "probs", "small_seq"))
def test_sharded_dropout_mask_is_the_unsharded_one(mesh, backend):
    q_seq, kv_seq = (1, 16) if backend == "small_seq" else (S, S)
    q, k, v = inputs(q_seq, kv_seq)
    key = jax.random.key(7)
    sq, sk, sv = put(mesh, P("data", None, "model"), q, k, v)

    def forward(q, k, v):
        return ax.attention(q, k, v, backend=backend, dropout_rate=0.3, key=key)

    out, aux = jax.jit(forward)(sq, sk, sv)
    want, want_aux = forward(q, k, v)
    np.testing.assert_array_equal(np.asarray(aux.rng_state), np.asarray(want_aux.rng_state))
    close(out, want, OUT_TOL, "out with dropout")
    # and the replayed mask reproduces it: out = (P * keep / (1 - rate)) @ v
    keep = ai.dropout_mask(aux, q, k, dropout_rate=0.3)
    _, plain = ax.attention(q, k, v, backend="reference", return_probs=True)
    weights = plain.probs * keep / 0.7
    group = H // KV
    replay = jnp.einsum("bhqk,bkhd->bqhd", weights, jnp.repeat(v, group, axis=2))
    close(out, replay, 1e-4, "out vs the replayed keep-mask")
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v)[0] ** 2), argnums=(0, 1, 2)))
    want_grad = jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v)[0] ** 2), argnums=(0, 1, 2))
    for g, w, name in zip(grad(sq, sk, sv), want_grad(q, k, v), "qkv"):
        close(g, w, GRAD_TOL, f"d{name} with dropout")


# ------------------------------------------------------------------------------------------------
# Softmax
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ("kernel", "reference"))
def test_softmax_partitioned(mesh, backend):
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((B, H, 16, 24)), jnp.float32)
    mask = jnp.asarray(rng.random((B, 1, 16, 24)) < 0.8)
    (sl,) = put(mesh, P("data", "model"), logits)
    (sm,) = put(mesh, P("data"), mask)

    def loss(x, m):
        probs, aux = ax.softmax(x, mask=m, causal=True, backend=backend)
        return jnp.sum(probs * jnp.cos(x)) + jnp.sum(jnp.where(jnp.isfinite(aux.lse), aux.lse, 0))

    fwd = jax.jit(lambda x, m: ax.softmax(x, mask=m, causal=True, backend=backend))
    grad = jax.jit(jax.grad(loss))
    for fn in (fwd, grad):
        found = collectives(fn.lower(sl, sm).compile().as_text())
        assert not found, f"softmax {backend}: {found}"
    probs, aux = fwd(sl, sm)
    want, want_aux = ax.softmax(logits, mask=mask, causal=True, backend=backend)
    assert padded(probs.sharding.spec)[:2] == ("data", "model")
    close(probs, want, OUT_TOL, "probs")
    close(aux.lse, want_aux.lse, OUT_TOL, "lse")
    close(grad(sl, sm), jax.grad(loss)(logits, mask), GRAD_TOL, "dlogits")


# ------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------
def test_export_inside_shard_map_round_trip(mesh):
    """A multi-device function exports with attention inside `jax.shard_map` (the kernels are
    lowered per device; under plain jit they would need JAX's partitioning callback, which an
    exported artifact cannot carry)."""
    q, k, v = inputs()
    flat = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def local(q, k, v):
        return ax.attention(q, k, v, backend="flash", causal=True)

    f = jax.jit(jax.shard_map(local, mesh=flat, in_specs=P("x"), out_specs=P("x")))
    sq, sk, sv = put(flat, P("x"), q, k, v)
    exported = jax.export.export(f)(sq, sk, sv)
    restored = jax.export.deserialize(exported.serialize())
    out, aux = restored.call(sq, sk, sv)
    want, want_aux = local(q, k, v)
    close(out, want, OUT_TOL, "out")
    close(aux.lse, want_aux.lse, OUT_TOL, "lse")
    assert aux.backend == "flash"
