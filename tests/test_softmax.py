"""`attnaux.softmax`: the fused scaled / masked / causal softmax and its statistics.

- parity of both paths (`kernel`, `reference`) with a float64 NumPy oracle and with
  `jax.nn.softmax` (scale and mask applied in JAX), for the three fusions, odd sizes (q_seq = 1,
  kv_seq 1, 7, 113, 4097 and 65536), masks broadcast over batch and heads, three dtypes;
- fully masked rows: probs 0, lse = max = -inf, zero (finite) gradients; NaN at masked positions
  never leaks;
- gradients through probs and through aux.lse: kernel vs jax.grad of the pure-JAX path, vs plain
  JAX autodiff of `jax.nn.softmax` / `logsumexp`, and vs float64 finite differences;
- jit, vmap (over logits, over the mask, both, nested, of grad) against loops;
- every bad input raises with a message naming the argument; the C++ handler's own checks.

Kernel tests skip cleanly when the compiled softmax kernel is not registered.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnaux
from attnaux import _softmax, _softmax_kernel
from attnaux._softmax import softmax, softmax_kernel_available

HAS_KERNEL = bool(softmax_kernel_available((1, 1), jnp.float32))
requires_kernel = pytest.mark.skipif(
    not HAS_KERNEL,
    reason="the compiled softmax kernel is not registered: "
    f"{softmax_kernel_available((1, 1), jnp.float32).reason}",
)
BACKENDS = [
    pytest.param("kernel", id="kernel", marks=requires_kernel),
    pytest.param("reference", id="reference"),
]
DTYPES = [
    pytest.param(jnp.float32, id="f32"),
    pytest.param(jnp.bfloat16, id="bf16"),
    pytest.param(jnp.float16, id="f16"),
]
CAUSALS = [
    pytest.param(False, id="scaled"),
    pytest.param(True, id="top_left"),
    pytest.param("bottom_right", id="bottom_right"),
]

# ------------------------------------------------------------------------------------------------
# Tolerances against the float64 oracle evaluated on the *same* (already rounded) inputs, so the
# only errors are the float32 arithmetic inside and the rounding of probs to the output dtype.
# Checked as |actual - expected| <= atol * max(1, max|expected|) + rtol * |expected|.
#
# - probs, float32: exp to ~1 ulp, a float32 row sum (relative error ~ sqrt(kv_seq) * 6e-8 in
#   practice, far below its worst case), one reciprocal and one product: 1e-5 relative for rows
#   up to 4097 keys; 5e-5 for 65536. atol 1e-7 only matters for entries below 1e-2.
# - probs, bfloat16 / float16: the float32 result is rounded to the output dtype, half an ulp:
#   2**-9 = 2e-3 (bf16), 2**-12 = 2.4e-4 (f16); rtol = 1 ulp (7.8e-3, 9.8e-4) leaves 2x for the
#   float32 error. float16 is subnormal below 6.1e-5 (spacing 6e-8): atol 1e-7.
# - lse and max: float32 for every dtype, the same float32 arithmetic as above on log-scale
#   values of size ~ log(kv_seq) + max: 1e-5 relative to max(1, |lse|); max is exact up to the
#   product with scale (2e-7).
# - kernel vs reference path: both float32 inside; they differ in exp implementation and sum
#   order only, so the float32 tolerances above apply to both (bf16/f16 may round to
#   neighbouring values: 1 ulp).
# - gradients (float32): two more float32 reductions and a cancelling subtraction dP - Dt:
#   1e-5 relative to the largest entry (atol) and 1e-4 per element; bf16/f16 gradients are
#   computed from the stored low-precision probs and rounded: 2 ulp relative to the largest.
# ------------------------------------------------------------------------------------------------
PROBS_TOL = {
    jnp.dtype(jnp.float32): (1e-5, 1e-7),
    jnp.dtype(jnp.bfloat16): (7.8e-3, 1e-7),
    jnp.dtype(jnp.float16): (9.8e-4, 1e-7),
}
LSE_TOL = (1e-5, 1e-5)
GRAD_TOL = {
    jnp.dtype(jnp.float32): (1e-4, 1e-5),
    jnp.dtype(jnp.bfloat16): (3e-2, 1.6e-2),
    jnp.dtype(jnp.float16): (4e-3, 2e-3),
}


def assert_close(actual, expected, tol, what=""):
    """|a - e| <= atol * max(1, max|e|) + rtol * |e|; infinities equal; no NaN."""
    rtol, atol = tol
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert not np.isnan(a).any(), f"{what}: NaN in actual"
    assert not np.isnan(e).any(), f"{what}: NaN in expected"
    inf = np.isinf(a) | np.isinf(e)
    assert (a[inf] == e[inf]).all(), f"{what}: infinities differ"
    fin = ~inf
    if not fin.any():
        return
    scale = max(1.0, float(np.abs(e[fin]).max()))
    err = np.abs(a[fin] - e[fin])
    allowed = atol * scale + rtol * np.abs(e[fin])
    bad = err > allowed
    assert not bad.any(), (
        f"{what}: {int(bad.sum())}/{err.size} out of tolerance (rtol={rtol}, atol={atol}); max "
        f"abs err {err.max():.3e}, worst excess {(err - allowed).max():.3e}"
    )


# ------------------------------------------------------------------------------------------------
# Oracles
# ------------------------------------------------------------------------------------------------
def visible_np(shape, mask=None, causal=False):
    q_seq, kv_seq = shape[-2:]
    vis = np.ones(shape, bool)
    if causal:
        offset = kv_seq - q_seq if causal == "bottom_right" else 0
        i = np.arange(q_seq)[:, None]
        j = np.arange(kv_seq)[None, :]
        vis &= j <= i + offset
    if mask is not None:
        vis &= np.asarray(mask)
    return vis


def softmax_np(x, scale=1.0, mask=None, causal=False):
    """float64 NumPy oracle: (probs, lse, max)."""
    x = np.asarray(x).astype(np.float64)
    vis = visible_np(x.shape, mask, causal)
    s = np.where(vis, x * scale, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    shift = np.where(np.isfinite(m), m, 0.0)
    e = np.where(vis, np.exp(s - shift[..., None]), 0.0)
    total = e.sum(-1)
    probs = e / np.where(total > 0, total, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return probs, lse, m


def rand(shape, dtype=jnp.float32, seed=0, scale=2.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(scale * rng.standard_normal(shape, dtype=np.float32), dtype)


def rand_mask(shape, seed=1, p=0.75):
    return jnp.asarray(np.random.default_rng(seed).random(shape) < p)


def check_against_numpy(x, probs, aux, *, scale, mask, causal, kv_tol_scale=1.0):
    p64, lse64, max64 = softmax_np(x, scale, mask, causal)
    rtol, atol = PROBS_TOL[jnp.dtype(x.dtype)]
    if jnp.dtype(x.dtype) == jnp.float32:
        rtol *= kv_tol_scale
    assert probs.dtype == x.dtype and probs.shape == x.shape
    assert aux.lse.dtype == jnp.float32 and aux.max.dtype == jnp.float32
    assert aux.lse.shape == x.shape[:-1] and aux.max.shape == x.shape[:-1]
    assert aux.probs is None and aux.rng_state is None
    assert_close(probs, p64, (rtol, atol), "probs")
    assert_close(aux.lse, lse64, (LSE_TOL[0] * kv_tol_scale, LSE_TOL[1]), "lse")
    assert_close(aux.max, max64, (2e-7, 0.0), "max")


# ------------------------------------------------------------------------------------------------
# Forward parity
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSALS)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_fusions_dtypes(backend, dtype, causal, masked):
    shape = (2, 3, 7, 113)
    x = rand(shape, dtype)
    mask = rand_mask((2, 1, 7, 113)) if masked else None
    probs, aux = softmax(x, scale=0.37, mask=mask, causal=causal, backend=backend)
    assert aux.backend == backend
    check_against_numpy(x, probs, aux, scale=0.37, mask=mask, causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape",
    [
        (1, 1),
        (3, 1, 1),
        (2, 4, 1, 7),
        (2, 1, 113),
        (1, 3, 5, 7),
        (2, 2, 6, 4097),
        (4, 1, 4097),
        (9, 2),
        (2, 3, 17, 33),
    ],
    ids=str,
)
@pytest.mark.parametrize("causal", CAUSALS)
def test_odd_sizes(backend, shape, causal):
    x = rand(shape, seed=3)
    mask = rand_mask(shape[-2:], seed=4, p=0.8)
    probs, aux = softmax(x, scale=-1.3, mask=mask, causal=causal, backend=backend)
    check_against_numpy(x, probs, aux, scale=-1.3, mask=mask, causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_row_65536(backend):
    x = rand((1, 2, 2, 65536), seed=5, scale=4.0)
    probs, aux = softmax(x, scale=1.5, causal="bottom_right", backend=backend)
    check_against_numpy(
        x, probs, aux, scale=1.5, mask=None, causal="bottom_right", kv_tol_scale=5.0
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_seq", [1, 2, 15, 16, 17, 31, 32, 33, 255, 1000, 16385, 65536, 100003])
@pytest.mark.parametrize("q_seq", [1, 3, 64])
def test_size_sweep(backend, dtype, kv_seq, q_seq):
    if q_seq * kv_seq > 2_000_000:
        pytest.skip("too large for the sweep")
    x = rand((2, q_seq, kv_seq), dtype, seed=kv_seq + q_seq)
    mask = rand_mask((q_seq, kv_seq), seed=kv_seq, p=0.9)
    for causal in (False, True, "bottom_right"):
        probs, aux = softmax(x, scale=0.9, mask=mask, causal=causal, backend=backend)
        check_against_numpy(
            x,
            probs,
            aux,
            scale=0.9,
            mask=mask,
            causal=causal,
            kv_tol_scale=5.0 if kv_seq > 5000 else 1.0,
        )


MASK_SHAPES = [
    (5, 9),  # [q_seq, kv_seq]
    (9,),  # one key mask for every row
    (2, 1, 1, 9),  # key padding per batch element
    (1, 3, 5, 9),  # per head
    (2, 1, 5, 9),  # per batch, shared by heads
    (2, 3, 1, 9),  # per batch and head, shared by rows
    (2, 3, 5, 1),  # whole rows on or off
    (1, 1, 1, 1),
    (2, 3, 5, 9),  # full
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
def test_broadcast_masks(backend, mask_shape):
    x = rand((2, 3, 5, 9), seed=7)
    mask = rand_mask(mask_shape, seed=8, p=0.7)
    probs, aux = softmax(x, scale=0.5, mask=mask, causal="bottom_right", backend=backend)
    check_against_numpy(x, probs, aux, scale=0.5, mask=mask, causal="bottom_right")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "mask_shape",
    [(2, 1, 4, 1, 5, 6), (2, 1, 1, 3, 5, 6), (1, 3, 4, 1, 1, 6), (2, 3, 1, 1, 1, 1)],
    ids=str,
)
def test_broadcast_masks_many_batch_dims(backend, mask_shape):
    # Batch dims (2, 3, 4) and heads 3: patterns that vary over non-adjacent dimensions.
    x = rand((2, 3, 4, 3, 5, 6), seed=9)
    mask = rand_mask(mask_shape, seed=10, p=0.6)
    probs, aux = softmax(x, scale=1.0, mask=mask, backend=backend)
    check_against_numpy(x, probs, aux, scale=1.0, mask=mask, causal=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", CAUSALS)
def test_against_jax_nn_softmax(backend, causal):
    """jax.nn.softmax with the scale and mask applied in JAX (rows with a visible key)."""
    shape = (3, 4, 16, 40)
    x = rand(shape, seed=11)
    mask = rand_mask((3, 1, 16, 40), seed=12, p=0.8).at[..., 39].set(True)  # no empty row
    vis = jnp.asarray(visible_np(shape, mask, causal))
    expected = jax.nn.softmax(jnp.where(vis, 0.3 * x, -jnp.inf), axis=-1)
    expected_lse = jax.nn.logsumexp(jnp.where(vis, 0.3 * x, -jnp.inf), axis=-1)
    probs, aux = softmax(x, scale=0.3, mask=mask, causal=causal, backend=backend)
    rows = np.isfinite(np.asarray(expected_lse))
    assert_close(np.asarray(probs)[rows], np.asarray(expected)[rows], PROBS_TOL[jnp.dtype(x.dtype)])
    assert_close(np.asarray(aux.lse)[rows], np.asarray(expected_lse)[rows], LSE_TOL)


@requires_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSALS)
def test_kernel_matches_reference_path(dtype, causal):
    x = rand((2, 3, 9, 77), dtype, seed=13)
    mask = rand_mask((3, 9, 77), seed=14)
    pk, ak = softmax(x, scale=0.8, mask=mask, causal=causal, backend="kernel")
    pr, ar = softmax(x, scale=0.8, mask=mask, causal=causal, backend="reference")
    assert ak.backend == "kernel" and ar.backend == "reference"
    assert_close(pk, pr, PROBS_TOL[jnp.dtype(dtype)], "probs")
    assert_close(ak.lse, ar.lse, LSE_TOL, "lse")
    assert_close(ak.max, ar.max, (0.0, 0.0), "max")


_HUGE_PAGE_SCRIPT = """
import hashlib, jax, jax.numpy as jnp
from attnaux import softmax
x = jax.random.normal(jax.random.key(0), (1, 2, 1024, 4104), jnp.float32)  # 33.6 MB
mask = jax.random.bernoulli(jax.random.key(1), 0.9, (1, 1, 1024, 4104))
f = jax.jit(jax.value_and_grad(lambda x: softmax(x, scale=0.3, mask=mask)[0][..., ::7].sum()))
probs, aux = softmax(x, scale=0.3, mask=mask, backend="kernel")
_, grad = f(x)
print(hashlib.sha256(b"".join(bytes(memoryview(jax.device_get(a)))
      for a in (probs, aux.lse, aux.max, grad))).hexdigest())
"""


@requires_kernel
def test_huge_page_advice_does_not_change_results():
    # Outputs of at least 32 MiB are advised MADV_HUGEPAGE (csrc/cpu/cpu_memory.h); the advice is a
    # hint to the OS, so results must be bitwise those with it switched off.
    digests = []
    for setting in ("1", "0"):
        env = dict(os.environ, ATTNAUX_CPU_HUGE_PAGES=setting)
        run = subprocess.run(
            [sys.executable, "-c", _HUGE_PAGE_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        digests.append(run.stdout.strip())
    assert digests[0] == digests[1]


def test_auto_picks_kernel_when_available():
    x = rand((2, 3, 4))
    _, aux = softmax(x)
    assert aux.backend == ("kernel" if HAS_KERNEL else "reference")
    _, aux64 = softmax(np.zeros((2, 3), np.float64))  # float64 is float32 without x64
    assert aux64.backend == ("kernel" if HAS_KERNEL else "reference")


# ------------------------------------------------------------------------------------------------
# Fully masked rows, zero sizes, non-finite values at masked positions
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows(backend, dtype):
    x = rand((2, 3, 6, 20), dtype, seed=15)
    mask = np.array(rand_mask((2, 3, 6, 20), seed=16))
    mask[0, 1, 2] = False  # one empty row
    mask[1, :, 4] = False  # one empty row in every head
    mask = jnp.asarray(mask)
    # bottom_right with q_seq > kv_seq: the first rows see no key at all.
    for causal, m in ((False, mask), ("bottom_right", None)):
        xx = x if m is not None else rand((2, 9, 4), dtype, seed=17)
        probs, aux = softmax(xx, scale=2.0, mask=m, causal=causal, backend=backend)
        empty = ~visible_np(xx.shape, m, causal).any(-1)
        assert empty.any()
        assert (np.asarray(probs, np.float32)[empty] == 0).all()
        assert (np.asarray(aux.lse)[empty] == -np.inf).all()
        assert (np.asarray(aux.max)[empty] == -np.inf).all()
        check_against_numpy(xx, probs, aux, scale=2.0, mask=m, causal=causal)

        def loss(xx, m=m, causal=causal, empty=empty):
            p, a = softmax(xx, scale=2.0, mask=m, causal=causal, backend=backend)
            return jnp.sum(p.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(empty, a.lse, 0.0))

        g = np.asarray(jax.grad(loss)(xx), np.float32)
        assert np.isfinite(g).all()
        assert (g[empty] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_at_masked_positions_never_leaks(backend):
    x = np.array(rand((2, 4, 8), seed=18))
    mask = np.array(rand_mask((2, 4, 8), seed=19, p=0.6))
    mask[:, :, 0] = True
    x[~mask] = np.nan
    x[0, 0, ~mask[0, 0]] = np.inf
    x = jnp.asarray(x)
    probs, aux = softmax(x, mask=jnp.asarray(mask), backend=backend)
    assert np.isfinite(np.asarray(probs)).all() and np.isfinite(np.asarray(aux.lse)).all()
    g = jax.grad(lambda x: jnp.sum(softmax(x, mask=jnp.asarray(mask), backend=backend)[1].lse))(x)
    assert np.isfinite(np.asarray(g)).all()
    assert (np.asarray(g)[~mask] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 0, 4), (2, 3, 0), (0, 0)], ids=str)
def test_zero_sizes(backend, shape):
    x = jnp.zeros(shape, jnp.float32)
    probs, aux = softmax(x, causal=True, backend=backend)
    assert probs.shape == shape and aux.lse.shape == shape[:-1]
    assert (np.asarray(aux.lse) == -np.inf).all()
    g = jax.grad(lambda x: jnp.sum(softmax(x, backend=backend)[0]))(x)
    assert g.shape == shape


# ------------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------------
def probe(probs, lse, w, u):
    """sum(probs * w) + sum(lse * u) over rows with a finite lse: both cotangents at once."""
    return jnp.sum(probs.astype(jnp.float32) * w) + jnp.sum(
        jnp.where(jnp.isfinite(lse), lse * u, 0)
    )


def grads(x, w, u, **kwargs):
    def loss(x):
        probs, aux = softmax(x, **kwargs)
        return probe(probs, aux.lse, w, u)

    return jax.jit(jax.grad(loss))(x)


GRAD_CASES = [
    pytest.param(jnp.float32, which, id=f"f32-{which}") for which in ("probs", "lse", "both")
] + [
    pytest.param(jnp.bfloat16, "both", id="bf16-both"),
    pytest.param(jnp.float16, "both", id="f16-both"),
]


@requires_kernel
@pytest.mark.parametrize("dtype,which", GRAD_CASES)
@pytest.mark.parametrize("causal", CAUSALS)
def test_kernel_grad_vs_reference_path(dtype, which, causal):
    shape = (2, 3, 7, 50)
    x = rand(shape, dtype, seed=20)
    mask = rand_mask((2, 1, 7, 50), seed=21)
    w = rand(shape, seed=22, scale=1.0) * (which != "lse")
    u = rand(shape[:-1], seed=23, scale=1.0) * (which != "probs")
    kw = dict(scale=0.6, mask=mask, causal=causal)
    gk = grads(x, w, u, backend="kernel", **kw)
    gr = grads(x, w, u, backend="reference", **kw)
    assert gk.dtype == dtype
    assert_close(gk, gr, GRAD_TOL[jnp.dtype(dtype)], "dlogits")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", CAUSALS)
def test_grad_vs_jax_autodiff(backend, causal):
    """Against plain JAX autodiff of jax.nn.softmax / logsumexp (rows with a visible key)."""
    shape = (2, 2, 6, 24)
    x = rand(shape, seed=24)
    mask = rand_mask((2, 2, 6, 24), seed=25).at[..., 23].set(True)
    vis = jnp.asarray(visible_np(shape, mask, causal))
    w, u = rand(shape, seed=26, scale=1.0), rand(shape[:-1], seed=27, scale=1.0)

    def plain(x):
        s = jnp.where(vis, -0.7 * x, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)
        rows = jnp.isfinite(lse)
        p = jax.nn.softmax(jnp.where(rows[..., None], s, 0.0), axis=-1, where=vis)
        return probe(jnp.where(rows[..., None], p, 0.0), lse, w, u)

    expected = jax.grad(plain)(x)
    actual = grads(x, w, u, scale=-0.7, mask=mask, causal=causal, backend=backend)
    assert_close(actual, expected, GRAD_TOL[jnp.dtype(jnp.float32)], "dlogits")


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_vs_float64_finite_differences(backend):
    shape = (2, 3, 5, 11)
    x = rand(shape, seed=28, scale=1.0)
    mask = np.array(rand_mask((3, 5, 11), seed=29))
    mask[1, 2] = False  # an empty row
    w = np.random.default_rng(30).standard_normal(shape)
    u = np.random.default_rng(31).standard_normal(shape[:-1])
    scale, causal = 1.7, "bottom_right"

    def loss64(x64):
        p, lse, _ = softmax_np(x64, scale, mask, causal)
        return np.sum(p * w) + np.sum(np.where(np.isfinite(lse), lse * u, 0.0))

    g = np.asarray(
        grads(
            x,
            jnp.asarray(w, jnp.float32),
            jnp.asarray(u, jnp.float32),
            scale=scale,
            mask=jnp.asarray(mask),
            causal=causal,
            backend=backend,
        ),
        np.float64,
    )
    x64 = np.asarray(x, np.float64)
    rng = np.random.default_rng(32)
    h = 1e-5
    for _ in range(6):
        v = rng.standard_normal(shape)
        fd = (loss64(x64 + h * v) - loss64(x64 - h * v)) / (2 * h)
        np.testing.assert_allclose(np.sum(g * v), fd, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_has_no_gradient(backend):
    x = rand((2, 3, 9), seed=33)
    g = jax.grad(lambda x: jnp.sum(softmax(x, backend=backend)[1].max))(x)
    assert (np.asarray(g) == 0).all()


# ------------------------------------------------------------------------------------------------
# jit and vmap
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_jit_matches_eager_and_does_not_retrace(backend):
    x = rand((2, 3, 5, 12), seed=34)
    mask = rand_mask((5, 12), seed=35)
    f = jax.jit(lambda x, m: softmax(x, scale=0.5, mask=m, causal=True, backend=backend))
    pj, aj = f(x, mask)
    pe, ae = softmax(x, scale=0.5, mask=mask, causal=True, backend=backend)
    np.testing.assert_array_equal(pj, pe)
    np.testing.assert_array_equal(aj.lse, ae.lse)
    before = _softmax._softmax_jit._cache_size()
    softmax(x + 1, scale=0.5, mask=~mask, causal=True, backend=backend)
    assert _softmax._softmax_jit._cache_size() == before


def loop(fn, *args):
    outs = [fn(*(a[i] for a in args)) for i in range(args[0].shape[0])]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "in_axes,mask_shape",
    [
        ((0, None), (4, 1, 13)),  # logits only
        ((0, 0), (3, 2, 1, 5, 13)),  # both; the mapped mask varies over batch (outer = 1)
        ((0, 0), (3, 4, 5, 13)),  # both; the mapped mask varies over heads only (outer = 2)
        ((None, 0), (3, 1, 4, 1, 13)),  # mask only
    ],
    ids=["logits", "both_batch", "both_heads", "mask"],
)
def test_vmap_matches_loop(backend, in_axes, mask_shape):
    x = rand((3, 2, 4, 5, 13) if in_axes[0] == 0 else (2, 4, 5, 13), seed=36)
    mask = rand_mask(mask_shape, seed=37)

    def f(x, m):
        probs, aux = softmax(x, scale=0.9, mask=m, causal="bottom_right", backend=backend)
        return probs, aux.lse, aux.max

    got = jax.vmap(f, in_axes=in_axes)(x, mask)
    if in_axes == (0, None):
        want = loop(lambda x: f(x, mask), x)
    elif in_axes == (None, 0):
        want = loop(lambda m: f(x, m), mask)
    else:
        want = loop(f, x, mask)
    for g, w_ in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w_, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nested_vmap_and_vmap_of_grad(backend):
    x = rand((2, 3, 4, 6, 10), seed=38)
    mask = rand_mask((3, 1, 6, 10), seed=39)
    w = rand((6, 10), seed=40, scale=1.0)

    def loss(x, m):
        probs, aux = softmax(x, scale=1.1, mask=m, causal=True, backend=backend)
        return jnp.sum(probs * w) + jnp.sum(jnp.where(jnp.isfinite(aux.lse), aux.lse, 0))

    inner = jax.vmap(jax.grad(loss), in_axes=(0, 0))  # over the 3 (mask mapped too)
    got = jax.jit(jax.vmap(inner, in_axes=(0, None)))(x, mask)
    want = jnp.stack(
        [jnp.stack([jax.grad(loss)(x[a, b], mask[b]) for b in range(3)]) for a in range(2)]
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # grad of vmap
    g2 = jax.grad(lambda x: jnp.sum(jax.vmap(loss)(x, mask)))(x[0])
    np.testing.assert_allclose(g2, want[0], rtol=1e-5, atol=1e-6)


def test_vmap_size_zero():
    x = jnp.zeros((0, 3, 4, 5))
    probs, aux = jax.vmap(lambda x: softmax(x))(x)
    assert probs.shape == (0, 3, 4, 5) and aux.lse.shape == (0, 3, 4)


def test_aux_is_a_pytree():
    _, aux = softmax(rand((2, 3, 4)))
    leaves = jax.tree_util.tree_leaves(aux)
    assert len(leaves) == 2  # lse, max (probs and rng_state are None)
    assert isinstance(aux, attnaux.AttnAux)


def test_exported_from_attnaux():
    if not hasattr(attnaux, "softmax"):
        pytest.skip("attnaux.softmax is not re-exported from attnaux/__init__.py yet")
    assert attnaux.softmax is softmax
    assert attnaux.softmax_kernel_available is softmax_kernel_available


# ------------------------------------------------------------------------------------------------
# softmax_kernel_available
# ------------------------------------------------------------------------------------------------
def test_kernel_available_api():
    res = softmax_kernel_available(
        (2, 4, 16, 16), jnp.bfloat16, mask=jnp.ones((16, 16), bool), causal="bottom_right"
    )
    ok, reason = res
    assert bool(res) is ok is HAS_KERNEL and isinstance(reason, str) and reason
    assert bool(softmax_kernel_available(rand((3, 4)))) is HAS_KERNEL
    assert bool(softmax_kernel_available(jax.ShapeDtypeStruct((3, 4), jnp.float16))) is HAS_KERNEL
    with jax.enable_x64(True):
        ok64, why64 = softmax_kernel_available((3, 4), np.float64)
    assert not ok64 and "float64" in why64


def test_float64_runs_on_the_reference_path():
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(41).standard_normal((2, 3, 5, 9)))
        mask = rand_mask((5, 9), seed=42)
        probs, aux = softmax(x, scale=0.3, mask=mask, causal=True)
        assert aux.backend == "reference" and probs.dtype == jnp.float64
        p64, lse64, _ = softmax_np(x, 0.3, mask, True)
        assert_close(probs, p64, (1e-12, 1e-14), "probs")
        assert_close(aux.lse, lse64, (1e-12, 1e-14), "lse")
        with pytest.raises(ValueError, match="backend='kernel'.*float64"):
            softmax(x, backend="kernel")


@pytest.mark.skipif(HAS_KERNEL, reason="the kernel is registered here")
def test_kernel_backend_raises_without_kernel():
    with pytest.raises(ValueError, match="backend='kernel'"):
        softmax(rand((2, 3)), backend="kernel")


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------
BAD = [
    (
        dict(logits=jnp.zeros((4,))),
        ValueError,
        r"`logits` must have shape .*at least.*got shape \(4,\)",
    ),
    (dict(logits=jnp.zeros(())), ValueError, r"`logits` must have shape"),
    (
        dict(logits=jnp.zeros((3, 4), jnp.int32)),
        TypeError,
        r"`logits` must have a floating dtype.*int32",
    ),
    (dict(logits=jnp.zeros((3, 4), bool)), TypeError, r"`logits` must have a floating dtype.*bool"),
    (dict(logits=[[1.0, 2.0]]), TypeError, r"`logits` must be a JAX or NumPy array.*list"),
    (dict(mask=jnp.ones((2, 3, 4))), TypeError, r"`mask` must be a boolean array.*float32"),
    (dict(mask=jnp.ones((3, 4), jnp.int32)), TypeError, r"`mask` must be a boolean array.*int32"),
    (dict(mask=jnp.ones((5,), bool)), ValueError, r"`mask` of shape \(5,\) does not broadcast"),
    (
        dict(mask=jnp.ones((3, 3, 4), bool)),
        ValueError,
        r"`mask` of shape \(3, 3, 4\) does not broadcast",
    ),
    (dict(mask=jnp.ones((1, 1, 2, 3, 4), bool)), ValueError, r"`mask` .* more dimensions"),
    (dict(mask=[[True]]), TypeError, r"`mask` must be None or a boolean"),
    (dict(backend="flash"), ValueError, r"`backend` must be one of 'auto', 'kernel', 'reference'"),
    (dict(causal="top"), ValueError, r"`causal` must be one of False, True"),
    (dict(causal=2), ValueError, r"`causal` must be one of"),
    (dict(scale=float("inf")), ValueError, r"`scale` must be finite"),
    (dict(scale="2"), TypeError, r"`scale` must be a Python float"),
    (dict(scale=None), TypeError, r"`scale` must be a Python float"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD, ids=lambda v: None)
def test_bad_input(kwargs, error, match):
    kwargs = dict(kwargs)
    logits = kwargs.pop("logits", jnp.zeros((2, 3, 4)))
    with pytest.raises(error, match=match):
        softmax(logits, **kwargs)


def test_traced_scale_is_rejected():
    with pytest.raises(TypeError, match=r"`scale` must be a static Python float"):
        jax.jit(lambda x, s: softmax(x, scale=s))(jnp.zeros((2, 3)), 2.0)


def test_kernel_available_bad_input():
    with pytest.raises(ValueError, match="`logits_shape_or_array` must have shape"):
        softmax_kernel_available((4,))
    with pytest.raises(TypeError, match="`logits_shape_or_array` must have a floating dtype"):
        softmax_kernel_available((4, 4), jnp.int32)
    with pytest.raises(ValueError, match="`mask` of shape"):
        softmax_kernel_available((4, 4), mask=jnp.ones((3,), bool))
    with pytest.raises(TypeError, match="`dtype` bfloat16 differs"):
        softmax_kernel_available(jnp.zeros((2, 2)), jnp.bfloat16)


@requires_kernel
@pytest.mark.parametrize(
    "mask,attrs,outs,match",
    [
        (np.ones((2, 3, 3), bool), {}, None, r"`mask` of shape \[2, 3, 3\] does not broadcast"),
        (np.ones((3, 1, 1), bool), {}, None, r"`mask` leading size 3"),
        (np.ones((1, 4, 5), np.float32), {}, None, r"`mask` must be PRED"),
        (
            np.zeros((0,), bool),
            dict(causal=np.int32(3)),
            None,
            r"attribute `causal` must be 0, 1 or 2",
        ),
        (np.ones((2, 4, 5), bool), dict(mask_div=np.int64(0)), None, r"`mask_div` must be >= 1"),
        (np.zeros((0,), bool), {}, ((2, 4, 5), (2, 5)), r"outputs `lse` and `max` must be F32"),
        (np.zeros((0,), bool), {}, ((2, 4, 6), (2, 4)), r"output `probs` must have"),
    ],
)
def test_ffi_handler_validates(mask, attrs, outs, match):
    """The C++ handler checks every input itself (the Python layer never sends these)."""
    logits = jnp.zeros((2, 4, 5))
    probs_shape, stats_shape = outs or ((2, 4, 5), (2, 4))
    call = jax.ffi.ffi_call(
        _softmax_kernel.FWD_TARGET,
        (
            jax.ShapeDtypeStruct(probs_shape, jnp.float32),
            jax.ShapeDtypeStruct(stats_shape, jnp.float32),
            jax.ShapeDtypeStruct(stats_shape, jnp.float32),
        ),
    )
    attrs = dict(dict(scale=np.float32(1.0), causal=np.int32(0), mask_div=np.int64(1)), **attrs)
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(call(logits, jnp.asarray(mask), **attrs))


@requires_kernel
def test_ffi_backward_handler_validates():
    p = jnp.zeros((2, 4, 5))
    call = jax.ffi.ffi_call(_softmax_kernel.BWD_TARGET, jax.ShapeDtypeStruct(p.shape, p.dtype))
    with pytest.raises(Exception, match=r"`dlse` must be F32 of shape \[2, 4\]"):
        jax.block_until_ready(call(p, p, jnp.zeros((2, 5)), scale=np.float32(1.0)))
    with pytest.raises(Exception, match=r"`dprobs` must have the dtype and shape"):
        jax.block_until_ready(call(p, p[:1], jnp.zeros((2, 4)), scale=np.float32(1.0)))
