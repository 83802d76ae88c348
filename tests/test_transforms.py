"""`jax.jit`, `jax.grad` and `jax.vmap` of `attnaux.attention`, for `flash` and `reference`.

- jit and vmap (over all arguments, over only some, nested, vmap of grad, grad of vmap, over a
  zero-sized axis) agree with a Python loop of unbatched calls;
- a second call with new data but the same shapes does not trace (so does not compile) again,
  under an outer `jax.jit` and for eager calls (`attention` jits internally);
- `aux.max` carries no gradient; the gradient through `aux.lse` is right (against an independent
  pure-JAX log-sum-exp and against finite differences);
- `AttnAux` is a pytree; unbatched and zero-sized-batch calls work;
- `explain()` says what `auto` picks, with a reason for every backend, and agrees with
  `aux.backend`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnaux
import attnaux._attention as attention_module
from attnaux import _ffi

HAS_FLASH = _ffi.has_target("attnaux_flash_fwd", "cpu")
requires_flash = pytest.mark.skipif(
    not HAS_FLASH, reason="the compiled flash kernel is not registered for cpu"
)
BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param("flash", id="flash", marks=requires_flash),
]
ALL_BACKENDS = ("flash", "probs", "small_seq", "reference")

# vmap vs loop and jit vs eager run the same float32 arithmetic per element; only the order of
# sums inside XLA's dots may differ with the batch shape.
TOL = dict(rtol=2e-5, atol=2e-6)

SQ, SKV, HQ, HKV, D, DV = 7, 9, 4, 2, 16, 8
N = 3  # size of the vmapped axis


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _assert_tree_close(actual, expected, what="", **tol):
    tol = tol or TOL
    leaves_a, tree_a = jax.tree.flatten(actual)
    leaves_e, tree_e = jax.tree.flatten(expected)
    assert tree_a == tree_e, f"{what}: structure {tree_a} != {tree_e}"
    for i, (a, e) in enumerate(zip(leaves_a, leaves_e, strict=True)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, f"{what} leaf {i}: shape {a.shape} != {e.shape}"
        np.testing.assert_allclose(a, e, err_msg=f"{what} leaf {i}", **tol)


# ------------------------------------------------------------------------------------------------
# One unbatched problem (no batch dims) with every kind of per-example argument, so that vmapping
# over any subset of them is meaningful: q, k, v, bias [Hq, Sq, Skv], mask [Sq, Skv], and the
# valid lengths (scalars, as `*batch = ()`), with bottom-right causal alignment so that the
# lengths change what every row sees.
# ------------------------------------------------------------------------------------------------
ARG_NAMES = ("q", "k", "v", "bias", "mask", "q_len", "kv_len")


def _unbatched_args(seed):
    rng = np.random.default_rng(seed)
    mask = rng.random((SQ, SKV)) < 0.8
    mask[:, -1] = True  # every row keeps a key
    return dict(
        q=_normal(seed, (SQ, HQ, D)),
        k=_normal(seed + 1, (SKV, HKV, D)),
        v=_normal(seed + 2, (SKV, HKV, DV)),
        bias=_normal(seed + 3, (HQ, SQ, SKV)),
        mask=jnp.asarray(mask),
        q_len=jnp.asarray(rng.integers(SQ - 2, SQ + 1), jnp.int32),
        kv_len=jnp.asarray(rng.integers(SKV - 3, SKV + 1), jnp.int32),
    )


def _batched_args(seed, n=N):
    per = [_unbatched_args(seed + 10 * i) for i in range(n)]
    return {name: jnp.stack([p[name] for p in per]) for name in ARG_NAMES}


def _f(backend):
    def f(q, k, v, bias, mask, q_len, kv_len):
        if q.ndim == 4:  # a batched call: the mask [N, Sq, Skv] needs its heads axis
            mask = mask[:, None]
        out, aux = attnaux.attention(
            q, k, v, bias=bias, mask=mask, q_seqlens=q_len, kv_seqlens=kv_len,
            causal="bottom_right", backend=backend,
        )
        assert aux.backend == backend
        return out, aux.lse, aux.max

    return f


def _loss(backend):
    """A scalar using both outputs with gradients: out and lse (the finite rows of it)."""
    f = _f(backend)

    def loss(q, k, v, bias, mask, q_len, kv_len):
        out, lse, _ = f(q, k, v, bias, mask, q_len, kv_len)
        # weights that depend on the per-example position only, so that a batched loss is the
        # sum of the per-example ones
        w_out = jnp.cos(jnp.arange(SQ * HQ * DV, dtype=jnp.float32)).reshape(SQ, HQ, DV)
        w_lse = jnp.sin(jnp.arange(HQ * SQ, dtype=jnp.float32)).reshape(HQ, SQ)
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)

    return loss


DIFF_ARGNUMS = (0, 1, 2, 3)  # q, k, v, bias


# Jitted once per backend and reused by every loop below (eager grads compile many small pieces).
@functools.cache
def _jf(backend):
    return jax.jit(_f(backend))


@functools.cache
def _jgrad(backend):
    return jax.jit(jax.grad(_loss(backend), argnums=DIFF_ARGNUMS))


def _take(x, axis, i):
    return jnp.take(x, i, axis=axis)


def _loop(fn, args, in_axes, n):
    """Stacks `fn` over a Python loop of the unbatched slices."""
    results = []
    for i in range(n):
        pairs = zip(args, in_axes, strict=True)
        sliced = [a if ax is None else _take(a, ax, i) for a, ax in pairs]
        results.append(fn(*sliced))
    return jax.tree.map(lambda *xs: jnp.stack(xs), *results)


# Subsets of arguments to vmap over (the others are shared by every example).
VMAP_CASES = {
    "all": ("q", "k", "v", "bias", "mask", "q_len", "kv_len"),
    "q_only": ("q",),
    "kv_only": ("k", "v"),
    "bias_only": ("bias",),
    "mask_only": ("mask",),
    "seqlens_only": ("q_len", "kv_len"),
    "q_and_bias": ("q", "bias"),
}


def _in_axes(mapped):
    return tuple(0 if name in mapped else None for name in ARG_NAMES)


def _args_for(mapped, seed=0):
    batched, shared = _batched_args(seed), _unbatched_args(seed + 1000)
    return [batched[n] if n in mapped else shared[n] for n in ARG_NAMES]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(VMAP_CASES))
def test_vmap_matches_loop(backend, case):
    mapped = VMAP_CASES[case]
    in_axes = _in_axes(mapped)
    args = _args_for(mapped)
    got = jax.vmap(_f(backend), in_axes=in_axes)(*args)
    want = _loop(_jf(backend), args, in_axes, N)
    _assert_tree_close(got, want, f"vmap over {case}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_over_a_non_leading_axis(backend):
    """in_axes=1 for q, out_axes=1 for the outputs."""
    args = _args_for(("q", "k", "v"))
    q_axis1 = jnp.moveaxis(args[0], 0, 1)  # [Sq, N, Hq, D]
    got = jax.jit(jax.vmap(_f(backend), in_axes=(1, 0, 0, None, None, None, None), out_axes=1))(
        q_axis1, *args[1:])
    want = _loop(_jf(backend), args, _in_axes(("q", "k", "v")), N)
    _assert_tree_close(jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), got), want, "vmap axis 1")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["all", "q_only", "kv_only", "bias_only"])
def test_vmap_of_grad_matches_loop(backend, case):
    mapped = VMAP_CASES[case]
    in_axes = _in_axes(mapped)
    args = _args_for(mapped, seed=5)
    grad = jax.grad(_loss(backend), argnums=DIFF_ARGNUMS)
    got = jax.jit(jax.vmap(grad, in_axes=in_axes))(*args)
    want = _loop(_jgrad(backend), args, in_axes, N)
    _assert_tree_close(got, want, f"vmap(grad) over {case}", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["all", "q_only", "kv_only", "bias_only"])
def test_grad_of_vmap_matches_loop(backend, case):
    """Gradients of a loss summed over a vmapped axis: stacked for mapped arguments, summed over
    the examples for shared ones."""
    mapped = VMAP_CASES[case]
    in_axes = _in_axes(mapped)
    args = _args_for(mapped, seed=7)
    loss = _loss(backend)

    def batched_loss(*a):
        return jnp.sum(jax.vmap(loss, in_axes=in_axes)(*a))

    got = jax.jit(jax.grad(batched_loss, argnums=DIFF_ARGNUMS))(*args)
    per = _loop(_jgrad(backend), args, in_axes, N)
    want = tuple(p if in_axes[i] == 0 else jnp.sum(p, axis=0) for i, p in enumerate(per))
    _assert_tree_close(got, want, f"grad(vmap) over {case}", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nested_vmap(backend):
    """Outer vmap over everything (size 2), inner over q and kv_len only (size N)."""
    outer = _batched_args(20, n=2)
    q = jnp.stack([_batched_args(30 + i)["q"] for i in range(2)])  # [2, N, Sq, Hq, D]
    kv_len = jnp.asarray([[SKV, SKV - 1, SKV - 3], [SKV - 2, SKV, 1]], jnp.int32)
    inner_axes = (0, None, None, None, None, None, 0)
    nested = jax.vmap(jax.vmap(_f(backend), in_axes=inner_axes))
    args = (q, outer["k"], outer["v"], outer["bias"], outer["mask"], outer["q_len"], kv_len)
    got = nested(*args)
    want = jax.tree.map(
        lambda *xs: jnp.stack(xs),
        *[_loop(_jf(backend), [a[j] for a in args], inner_axes, N) for j in range(2)],
    )
    _assert_tree_close(got, want, "nested vmap")


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_of_a_batched_call(backend):
    """vmap over a call that has batch dims of its own, with a bias broadcast over them."""
    rng = np.random.default_rng(3)
    q = _normal(40, (N, 2, SQ, HQ, D))
    k = _normal(41, (N, 2, SKV, HKV, D))
    v = _normal(42, (N, 2, SKV, HKV, DV))
    bias = _normal(43, (N, 1, HQ, SQ, SKV))  # broadcast over the inner batch
    kv_len = jnp.asarray(rng.integers(1, SKV + 1, (N, 2)), jnp.int32)

    def f(q, k, v, bias, kv_len):
        out, aux = attnaux.attention(q, k, v, bias=bias, kv_seqlens=kv_len, causal=True,
                                     backend=backend)
        return out, aux.lse, aux.max

    got = jax.vmap(f)(q, k, v, bias, kv_len)
    want = _loop(jax.jit(f), (q, k, v, bias, kv_len), (0,) * 5, N)
    _assert_tree_close(got, want, "vmap of a batched call")


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_over_sink(backend):
    """A sink per mapped example (the flash batching rule maps such calls one by one)."""
    args = _args_for(("q",), seed=50)
    sinks = _normal(51, (N, HQ))

    def f(q, sink, k, v):
        out, aux = attnaux.attention(q, k, v, sink=sink, backend=backend)
        return out, aux.lse, aux.max

    got = jax.vmap(f, in_axes=(0, 0, None, None))(args[0], sinks, args[1], args[2])
    want = _loop(jax.jit(f), (args[0], sinks, args[1], args[2]), (0, 0, None, None), N)
    _assert_tree_close(got, want, "vmap over sink")

    def loss(q, s, k, v):
        out, lse, _ = f(q, s, k, v)
        return jnp.sum(out * jnp.cos(jnp.arange(DV))) + jnp.sum(lse * jnp.sin(jnp.arange(SQ)))

    got_g = jax.jit(jax.grad(lambda q, s: jnp.sum(jax.vmap(loss, in_axes=(0, 0, None, None))(
        q, s, args[1], args[2])), argnums=(0, 1)))(args[0], sinks)
    want_g = _loop(jax.jit(jax.grad(loss, argnums=(0, 1))), (args[0], sinks, args[1], args[2]),
                   (0, 0, None, None), N)
    _assert_tree_close(got_g, want_g, "grad through vmap over sink", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_over_zero_sized_axis(backend):
    args = _args_for(VMAP_CASES["all"])
    empty = [a[:0] for a in args]
    out, lse, row_max = jax.vmap(_f(backend))(*empty)
    assert out.shape == (0, SQ, HQ, DV) and lse.shape == (0, HQ, SQ) == row_max.shape
    grads = jax.jit(jax.vmap(jax.grad(_loss(backend), argnums=DIFF_ARGNUMS)))(*empty)
    assert [g.shape for g in grads] == [a.shape for a in empty[:4]]


# ------------------------------------------------------------------------------------------------
# jit and grad
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_jit_matches_eager(backend):
    args = list(_batched_args(60, n=2).values())
    f = _f(backend)
    _assert_tree_close(jax.jit(f)(*args), f(*args), "jit vs eager")
    # eager grad (attention jits inside) vs grad under jit
    grad = jax.grad(_loss(backend), argnums=DIFF_ARGNUMS)
    _assert_tree_close(jax.jit(grad)(*args), grad(*args), "jit(grad) vs grad",
                       rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_grad_matches_loop(backend):
    """grad of a batched call (batch dims inside) = per-example grads."""
    b = _batched_args(70)
    args = [b[n] for n in ARG_NAMES]
    got = jax.jit(jax.grad(_loss(backend), argnums=DIFF_ARGNUMS))(*args)
    want = _loop(_jgrad(backend), args, (0,) * 7, N)
    _assert_tree_close(got, want, "grad batched vs loop", rtol=1e-4, atol=1e-5)


def _count_traces(monkeypatch):
    """Counts how often `attention`'s internal jit traces (it canonicalises once per trace)."""
    calls = []
    original = attention_module.canonicalize

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_module, "canonicalize", counting)
    return calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_retrace_under_jit(backend):
    traces = []

    @jax.jit
    def f(q, k, v, bias, mask, q_len, kv_len):
        traces.append(1)  # runs only while tracing
        return _f(backend)(q, k, v, bias, mask, q_len, kv_len)

    first = list(_batched_args(80).values())
    second = list(_batched_args(81).values())
    out1 = f(*first)
    out2 = f(*second)
    assert len(traces) == 1
    assert not np.allclose(np.asarray(out1[0]), np.asarray(out2[0]))  # new data, new result
    _assert_tree_close(out2, _f(backend)(*second), "second jit call")

    grad_traces = []

    @jax.jit
    def g(*args):
        grad_traces.append(1)
        return jax.grad(_loss(backend), argnums=DIFF_ARGNUMS)(*args)

    g(*first)
    g(*second)
    assert len(grad_traces) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_retrace_for_eager_calls(backend, monkeypatch):
    """`attnaux.attention` jits internally: a second eager call with new data (including new
    lengths, mask and bias values) but the same shapes does not trace again; a new shape does."""
    traces = _count_traces(monkeypatch)
    cache = getattr(attention_module._attention_jit, "_cache_size", None)
    shape = (2, 11, HQ, D)
    rng = np.random.default_rng(0)

    def call(seed, q_seq=11):
        q = _normal(seed, (2, q_seq, HQ, D))
        k = _normal(seed + 1, (2, 13, HKV, D))
        v = _normal(seed + 2, (2, 13, HKV, DV))
        bias = _normal(seed + 3, (2, 1, q_seq, 13))
        mask = jnp.asarray(rng.random((q_seq, 13)) < 0.7)
        kv_len = jnp.asarray(rng.integers(1, 14, (2,)), jnp.int32)
        return attnaux.attention(q, k, v, bias=bias, mask=mask, kv_seqlens=kv_len, causal=True,
                                 window=(5, None), backend=backend)

    call(100)
    n_traces = len(traces)
    size = cache() if cache else None
    call(200)
    call(300)
    assert len(traces) == n_traces, "an eager call with new data but the same shapes retraced"
    if cache:
        assert cache() == size
    # the counter does count: a new shape traces once more
    call(400, q_seq=shape[1] + 1)
    assert len(traces) == n_traces + 1
    if cache:
        assert cache() == size + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_retrace_for_eager_grad(backend, monkeypatch):
    traces = _count_traces(monkeypatch)
    loss = _loss(backend)
    grad = jax.grad(loss, argnums=DIFF_ARGNUMS)
    grad(*_batched_args(110).values())
    n_traces = len(traces)
    grad(*_batched_args(111).values())
    assert len(traces) == n_traces


# ------------------------------------------------------------------------------------------------
# Gradients through the statistics
# ------------------------------------------------------------------------------------------------
def _dense_problem(seed):
    """A batched problem with GQA, a bias and a mask that leaves every row a key."""
    rng = np.random.default_rng(seed)
    q = _normal(seed, (2, SQ, HQ, D))
    k = _normal(seed + 1, (2, SKV, HKV, D))
    v = _normal(seed + 2, (2, SKV, HKV, DV))
    bias = _normal(seed + 3, (2, HQ, SQ, SKV))
    mask = rng.random((2, 1, SQ, SKV)) < 0.7
    mask[..., 0] = True
    return q, k, v, bias, jnp.asarray(mask)


def _oracle_lse(q, k, v, bias, mask, scale):
    """log-sum-exp of the masked logits in plain JAX, nothing shared with attnaux."""
    group = q.shape[-2] // k.shape[-2]
    kk = jnp.repeat(k, group, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", q, kk, precision="highest") * scale + bias
    s = jnp.where(mask, s, -jnp.inf)
    return jax.nn.logsumexp(s, axis=-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_carries_no_gradient(backend):
    q, k, v, bias, mask = _dense_problem(120)

    def loss(q, k, v, bias):
        _, aux = attnaux.attention(q, k, v, bias=bias, mask=mask, backend=backend)
        return jnp.sum(aux.max * jnp.arange(1.0, 1.0 + aux.max.size).reshape(aux.max.shape))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for name, g in zip("q k v bias".split(), grads, strict=True):
        assert np.all(np.asarray(g) == 0), f"d sum(aux.max) / d {name} is not zero"
    # whereas max itself is the real row maximum (so the test above is not vacuous)
    _, aux = attnaux.attention(q, k, v, bias=bias, mask=mask, backend=backend)
    assert np.all(np.isfinite(np.asarray(aux.max)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_through_lse_matches_independent_oracle(backend):
    q, k, v, bias, mask = _dense_problem(130)
    scale = 0.3
    w = _normal(131, (2, HQ, SQ))

    def loss(q, k, v, bias):
        _, aux = attnaux.attention(q, k, v, bias=bias, mask=mask, scale=scale, backend=backend)
        return jnp.sum(aux.lse * w) + 0.01 * jnp.mean(aux.lse ** 2)  # with a z-loss term

    def oracle(q, k, v, bias):
        lse = _oracle_lse(q, k, v, bias, mask, scale)
        return jnp.sum(lse * w) + 0.01 * jnp.mean(lse ** 2)

    np.testing.assert_allclose(jax.jit(loss)(q, k, v, bias), jax.jit(oracle)(q, k, v, bias),
                               rtol=1e-5)
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    want = jax.jit(jax.grad(oracle, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for name, g, e in zip("q k v bias".split(), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5,
                                   err_msg=f"d lse-loss / d {name}")
    assert np.all(np.asarray(got[2]) == 0)  # lse does not depend on v


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_through_out_and_lse_matches_finite_differences(backend):
    """Directional derivative of a loss on out and lse vs central differences."""
    q, k, v, bias, mask = _dense_problem(140)
    w_out = _normal(141, (2, SQ, HQ, DV))
    w_lse = _normal(142, (2, HQ, SQ))

    @jax.jit
    def loss(q, k, v, bias):
        out, aux = attnaux.attention(q, k, v, bias=bias, mask=mask, causal=True,
                                     backend=backend)
        return jnp.sum(out * w_out) + jnp.sum(aux.lse * w_lse)

    primals = (q, k, v, bias)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*primals)
    eps = 1e-2
    for i, name in enumerate("q k v bias".split()):
        direction = _normal(150 + i, primals[i].shape)
        plus = list(primals)
        minus = list(primals)
        plus[i] = primals[i] + eps * direction
        minus[i] = primals[i] - eps * direction
        fd = (float(loss(*plus)) - float(loss(*minus))) / (2 * eps)
        analytic = float(jnp.vdot(grads[i], direction))
        assert abs(fd - analytic) <= 2e-2 * max(1.0, abs(fd)), (name, fd, analytic)


# ------------------------------------------------------------------------------------------------
# AttnAux as a pytree
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_attnaux_is_a_pytree(backend):
    q, k, v, bias, mask = _dense_problem(160)
    out, aux = attnaux.attention(q, k, v, backend=backend)
    assert isinstance(aux, attnaux.AttnAux)
    leaves, treedef = jax.tree.flatten(aux)
    assert len(leaves) == 2  # lse and max; probs and rng_state are None
    assert any(leaf is aux.lse for leaf in leaves) and any(leaf is aux.max for leaf in leaves)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert isinstance(rebuilt, attnaux.AttnAux) and rebuilt.backend == backend
    doubled = jax.tree.map(lambda x: 2 * x, aux)
    assert isinstance(doubled, attnaux.AttnAux) and doubled.backend == backend
    np.testing.assert_array_equal(doubled.lse, 2 * aux.lse)

    # returned from jit (the static backend rides in the treedef)
    out_j, aux_j = jax.jit(lambda q, k, v: attnaux.attention(q, k, v, backend=backend))(q, k, v)
    assert isinstance(aux_j, attnaux.AttnAux) and aux_j.backend == backend
    _assert_tree_close((out_j, aux_j), (out, aux), "jit return")
    # passed into jit as an argument
    total = jax.jit(lambda a: a.lse.sum() + a.max.sum())(aux)
    np.testing.assert_allclose(total, aux.lse.sum() + aux.max.sum(), rtol=1e-6)
    # vmapped out
    aux_v = jax.vmap(lambda q: attnaux.attention(q, k[:1], v[:1], backend=backend)[1])(q[:, None])
    assert isinstance(aux_v, attnaux.AttnAux) and aux_v.lse.shape == (2, 1, HQ, SQ)


def test_attnaux_pytree_with_probs():
    q, k, v, _, _ = _dense_problem(170)
    _, aux = attnaux.attention(q, k, v, return_probs=True)
    assert aux.backend != "flash" and aux.probs is not None
    assert len(jax.tree.leaves(aux)) == 3
    _, aux_j = jax.jit(lambda q: attnaux.attention(q, k, v, return_probs=True))(q)
    np.testing.assert_allclose(aux_j.probs, aux.probs, **TOL)


def test_backend_is_static_in_the_treedef():
    q, k, v, _, _ = _dense_problem(175)
    _, aux = attnaux.attention(q, k, v, backend="reference")
    other = attnaux.AttnAux(lse=aux.lse, max=aux.max, backend="flash")
    assert jax.tree.structure(aux) != jax.tree.structure(other)


# ------------------------------------------------------------------------------------------------
# Unbatched and zero-sized calls
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_unbatched_call_matches_batch_of_one(backend):
    a = _unbatched_args(180)
    kwargs = dict(causal="bottom_right", backend=backend)
    out, aux = attnaux.attention(a["q"], a["k"], a["v"], bias=a["bias"], mask=a["mask"],
                                 q_seqlens=a["q_len"], kv_seqlens=a["kv_len"], **kwargs)
    assert out.shape == (SQ, HQ, DV) and aux.lse.shape == (HQ, SQ) == aux.max.shape
    out1, aux1 = attnaux.attention(a["q"][None], a["k"][None], a["v"][None],
                                   bias=a["bias"][None], mask=a["mask"],
                                   q_seqlens=a["q_len"][None], kv_seqlens=a["kv_len"][None],
                                   **kwargs)
    _assert_tree_close((out, aux.lse, aux.max), (out1[0], aux1.lse[0], aux1.max[0]), "unbatched")
    g = jax.grad(lambda q: jnp.sum(attnaux.attention(q, a["k"], a["v"], **kwargs)[0]))(a["q"])
    assert g.shape == a["q"].shape and np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_batch_dims_match_flattened(backend):
    q = _normal(190, (2, 3, SQ, HQ, D))
    k = _normal(191, (2, 3, SKV, HKV, D))
    v = _normal(192, (2, 3, SKV, HKV, DV))
    bias = _normal(193, (3, 1, SQ, SKV))  # broadcast over the first batch dim and the heads
    kv_len = jnp.asarray(np.arange(6).reshape(2, 3) % SKV + 1, jnp.int32)
    out, aux = attnaux.attention(q, k, v, bias=bias, kv_seqlens=kv_len, backend=backend)
    assert out.shape == (2, 3, SQ, HQ, DV) and aux.lse.shape == (2, 3, HQ, SQ)
    flat_bias = jnp.broadcast_to(bias, (2, 3, 1, SQ, SKV)).reshape(6, 1, SQ, SKV)
    out_f, aux_f = attnaux.attention(q.reshape(6, SQ, HQ, D), k.reshape(6, SKV, HKV, D),
                                     v.reshape(6, SKV, HKV, DV), bias=flat_bias,
                                     kv_seqlens=kv_len.reshape(6), backend=backend)
    _assert_tree_close((out.reshape(out_f.shape), aux.lse.reshape(aux_f.lse.shape)),
                       (out_f, aux_f.lse), "batch dims (2, 3) vs flattened 6")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", [(0,), (2, 0)], ids=["0", "2x0"])
def test_zero_sized_batch(backend, batch):
    q = jnp.zeros((*batch, SQ, HQ, D))
    k = jnp.zeros((*batch, SKV, HKV, D))
    v = jnp.zeros((*batch, SKV, HKV, DV))
    bias = jnp.zeros((HQ, SQ, SKV))
    out, aux = attnaux.attention(q, k, v, bias=bias, causal=True, backend=backend)
    assert out.shape == (*batch, SQ, HQ, DV) and out.dtype == q.dtype
    assert aux.lse.shape == (*batch, HQ, SQ) == aux.max.shape
    assert aux.lse.dtype == jnp.float32

    def loss(q, k, v, bias):
        out, aux = attnaux.attention(q, k, v, bias=bias, causal=True, backend=backend)
        return jnp.sum(out) + jnp.sum(aux.lse)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, bias.shape]
    assert np.all(np.asarray(grads[3]) == 0)


# ------------------------------------------------------------------------------------------------
# explain()
# ------------------------------------------------------------------------------------------------
EXPLAIN_OPTIONS = {
    "default": dict(),
    "causal_window": dict(causal="bottom_right", window=(3, 0)),
    "bias_mask": dict(bias=jnp.zeros((SQ, SKV)), mask=jnp.ones((1, HQ, SQ, SKV), bool)),
    "seqlens_segments": dict(kv_seqlens=jnp.array([3, 9]), q_segment_ids=jnp.zeros((2, SQ), int),
                             kv_segment_ids=jnp.zeros((2, SKV), int)),
    "return_probs": dict(return_probs=True),
    "reference": dict(backend="reference"),
    "softcap_sink": dict(softcap=20.0, sink=jnp.zeros((HQ,))),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", list(EXPLAIN_OPTIONS))
def test_explain_agrees_with_what_runs(case, dtype):
    options = EXPLAIN_OPTIONS[case]
    q = _normal(200, (2, SQ, HQ, D), dtype)
    k = _normal(201, (2, SKV, HKV, D), dtype)
    v = _normal(202, (2, SKV, HKV, DV), dtype)
    explanation = attnaux.explain(q, k, v, **options)
    assert isinstance(explanation, attnaux.Explanation)
    assert set(explanation.reasons) == set(ALL_BACKENDS)
    assert all(isinstance(r, str) and r for r in explanation.reasons.values())
    assert explanation.platform == jax.default_backend()
    assert explanation.implementation
    _, aux = attnaux.attention(q, k, v, **options)
    assert aux.backend == explanation.backend
    # the same answer from shapes alone, and inside jit
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    assert attnaux.explain(*structs, **options).backend == explanation.backend
    _, aux_j = jax.jit(lambda q, k, v: attnaux.attention(q, k, v, **options))(q, k, v)
    assert aux_j.backend == explanation.backend


def test_explain_auto_choice_and_reasons():
    q = _normal(210, (2, SQ, HQ, D))
    k = _normal(211, (2, SKV, HKV, D))
    v = _normal(212, (2, SKV, HKV, DV))
    auto = attnaux.explain(q, k, v)
    if HAS_FLASH:  # a compiled backend serves the call: auto does not fall back to reference
        assert auto.backend != "reference"
        assert "C++" in auto.implementation
        assert "serves" in auto.reasons["flash"]
    else:
        assert auto.backend == "reference"
        assert "not available" in auto.reasons["flash"] or "no compiled" in auto.reasons["flash"]
    assert str(auto).startswith(f"backend: {auto.backend}")
    for name in ALL_BACKENDS:
        assert name in str(auto)
    # small_seq is for q_seq == 1: the reason says why it does not serve q_seq = 7
    assert "q_seq" in auto.reasons["small_seq"]

    probs = attnaux.explain(q, k, v, return_probs=True)
    assert probs.backend != "flash"  # flash does not save the probabilities
    assert "return_probs" in probs.reasons["flash"] or "probab" in probs.reasons["flash"]
    _, aux = attnaux.attention(q, k, v, return_probs=True)
    assert aux.backend == probs.backend and aux.probs is not None

    ref = attnaux.explain(q, k, v, backend="reference")
    assert ref.backend == "reference" and ref.implementation


@requires_flash
def test_explain_flash_explicit():
    q = _normal(220, (2, SQ, HQ, D))
    k = _normal(221, (2, SKV, HKV, D))
    v = _normal(222, (2, SKV, HKV, DV))
    e = attnaux.explain(q, k, v, backend="flash")
    assert e.backend == "flash" and e.implementation == "C++ (XLA FFI, cpu)"
    _, aux = attnaux.attention(q, k, v, backend="flash")
    assert aux.backend == "flash"
