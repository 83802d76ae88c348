"""Shared fixtures and helpers for the attnaux tests.

Tests are flat in `tests/`, so other test files import from here directly:

```python
from conftest import DTYPES, TOL, assert_close, make_inputs, requires_flash
```

- `make_inputs(seed_or_key, batch, q_seq, kv_seq, q_heads, kv_heads, qk_dim, v_dim, dtype)`:
  random `q, k, v` in the BSHD layout of `attnaux.attention`.
- `TOL[dtype]`: `dict(out=(rtol, atol), lse=(rtol, atol), grad=(rtol, atol))`, the tolerances of
  the `flash`-vs-`reference` comparison (justified next to the table).
- `make_options(seed, batch, q_seq, kv_seq, q_heads, bias="B1QK", mask=..., ...)`: random
  bias / mask / seqlens / segment ids / sink keyword arguments from short specs.
- `attention_and_grads(q, k, v, w, u, backend=..., **options)`: `(out, aux, grads)` with the
  gradients of `probe_loss = sum(out * w) + sum(lse * u)` for q, k, v, bias, sink
  (`loss_weights(seed, q, v)` makes `w`, `u`).
- `assert_close(actual, expected, tol, what)`: the comparison those tolerances are meant for.
- `requires_flash`: skip marker for tests that need the compiled `flash` kernels.
- `@pytest.mark.gpu` tests are skipped unless JAX's default backend is a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnaux  # noqa: F401  (registers the compiled kernels, if built)
from attnaux import _ffi

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# ------------------------------------------------------------------------------------------------
# Tolerances, per input dtype, for `flash` against `reference` (both through the public API, on
# the same inputs). Both accumulate in float32; what differs is the order of the float32 sums
# (blocked online softmax vs one dense softmax) and, for the backward, that `flash` recomputes P
# from the saved lse and builds Dt = rowsum(dout * out) from the *stored* output (rounded to the
# input dtype), where the reference autodiffs through its float32 intermediates.
#
# Checked by `assert_close`: |actual - expected| <= atol * max(1, max|expected|) + rtol * |expected|
# i.e. atol is absolute for O(1) arrays and relative to the largest entry for larger ones
# (gradients of k and v sum over q_seq * group rows and grow with it), rtol is per element.
#
# - float32: float32 rounding is ~6e-8; sums of up to a few hundred terms in a different order
#   give ~1e-6. `out`/`lse` at 1e-5 leave a 10x margin; gradients pass through two more
#   reductions (dS @ K, dS^T @ Q) and a subtraction dP - Dt that cancels, so 1e-4.
# - bfloat16 (8 bits of mantissa, ulp = 2**-7 relative): `out` and the gradients are returned in
#   bfloat16, so two results that agree in float32 to 1e-6 can still round to neighbouring
#   values: 1 ulp = 7.8e-3 relative. rtol = 2 ulp (1.6e-2); atol 4e-3 covers entries near 0.
#   Gradients also inherit the bfloat16 rounding of `out` inside Dt (2**-9 relative), so
#   rtol = 3e-2, atol = 1e-2 (of the largest entry).
# - float16 (11 bits, ulp = 2**-10 = 9.8e-4): the same reasoning scaled by 8: out 2e-3 / 5e-4,
#   gradients 4e-3 / 2e-3.
# - lse and max are float32 for every input dtype, and the logits are float32 sums of exact
#   products of the (low-precision) inputs, so their tolerance does not depend on the dtype
#   beyond the sum order: 1e-5 for float32 inputs; 2e-5 for bf16/f16 (larger |q|, |k| entries
#   after rounding do not change this, the slack is for exp/log implementations). Rounding the
#   scaled q to the input dtype before the dot product (which the ABI does not allow) would give
#   ~1e-2 and fail here.
# ------------------------------------------------------------------------------------------------
TOL = {
    jnp.dtype(jnp.float32): dict(out=(1e-5, 1e-5), lse=(1e-5, 1e-5), grad=(1e-4, 1e-4)),
    jnp.dtype(jnp.bfloat16): dict(out=(1.6e-2, 4e-3), lse=(2e-5, 2e-5), grad=(3e-2, 1e-2)),
    jnp.dtype(jnp.float16): dict(out=(2e-3, 5e-4), lse=(2e-5, 2e-5), grad=(4e-3, 2e-3)),
}
for _dt in DTYPES:  # also index by the scalar type (TOL[jnp.bfloat16])
    TOL[_dt] = TOL[jnp.dtype(_dt)]


def tol(dtype, kind: str) -> tuple[float, float]:
    """`(rtol, atol)` of `kind` ("out", "lse" or "grad") for inputs of `dtype`."""
    return TOL[jnp.dtype(dtype)][kind]


def dtype_id(dtype) -> str:
    """Short name for test ids: f32, bf16, f16."""
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[jnp.dtype(dtype).name]


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------
def make_inputs(key_or_seed, batch, q_seq, kv_seq, q_heads, kv_heads, qk_dim, v_dim,
                dtype=jnp.float32):
    """Random standard-normal `q, k, v` as JAX arrays of `dtype`, in attnaux's BSHD layout.

    **Arguments:**

    - `key_or_seed`: an int seed (NumPy generator; cheap and reproducible) or a JAX PRNG key.
    - `batch`: the leading batch shape: a tuple (`()` for an unbatched call) or an int.
    - the rest: sizes; `dtype` is the dtype of all three.

    **Returns:**

    `q: [*batch, q_seq, q_heads, qk_dim]`, `k: [*batch, kv_seq, kv_heads, qk_dim]`,
    `v: [*batch, kv_seq, kv_heads, v_dim]`.
    """
    batch = (batch,) if isinstance(batch, (int, np.integer)) else tuple(batch)
    shapes = (
        (*batch, q_seq, q_heads, qk_dim),
        (*batch, kv_seq, kv_heads, qk_dim),
        (*batch, kv_seq, kv_heads, v_dim),
    )
    if isinstance(key_or_seed, (int, np.integer)):
        rng = np.random.default_rng(int(key_or_seed))
        return tuple(jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype) for s in shapes)
    keys = jax.random.split(key_or_seed, 3)
    return tuple(jax.random.normal(kk, s, jnp.float32).astype(dtype)
                 for kk, s in zip(keys, shapes, strict=True))


def _dims(spec, batch, q_heads, q_seq, kv_seq) -> tuple[int, ...]:
    """Shape from a spec string: B = every batch dim, b = a 1 per batch dim, H = q_heads,
    Q = q_seq, K = kv_seq, 1 = broadcast; a tuple of ints is taken as is."""
    if not isinstance(spec, str):
        return tuple(spec)
    sizes = {"H": (q_heads,), "Q": (q_seq,), "K": (kv_seq,), "1": (1,), "B": tuple(batch),
             "b": (1,) * len(batch)}
    return tuple(d for c in spec for d in sizes[c])


def make_options(seed, batch, q_seq, kv_seq, q_heads, *, bias=None, mask=None, q_seqlens=None,
                 kv_seqlens=None, segments=None, sink=False, **static) -> dict:
    """Random array options for `attnaux.attention` (and `oracle.attention`), as keyword args.

    **Arguments:**

    - `bias`, `mask`: a shape spec, e.g. `"B1QK"`, `"HQK"`, `"QK"`, `"bHQK"` (see `_dims`: B =
      all batch dims, b = ones for them, H/Q/K = q_heads/q_seq/kv_seq, 1 = broadcast) or a tuple.
      The bias is normal(0, 1) float32; the mask is True with probability 0.75.
    - `q_seqlens`, `kv_seqlens`: a list of lengths, tiled over the flattened batch (so `[0, 5]`
      gives lengths 0, 5, 0, 5, ...), `"rand"` for uniform lengths in `[0, seq]`, or `"edges"`
      for `seq, 0, rand, seq, 0, rand, ...` (full and empty sequences next to a partial one).
    - `segments`: number of packed segments: q and kv ids are each sorted runs of labels
      `0..segments-1` with random lengths (a segment may be empty on one side).
    - `sink`: True for a normal(0, 1) float32 sink per head.
    - `**static`: passed through (scale, causal, window, softcap, ...).
    """
    batch = (batch,) if isinstance(batch, (int, np.integer)) else tuple(batch)
    rng = np.random.default_rng(seed)
    nb = int(np.prod(batch))
    opts = dict(static)
    if bias is not None:
        shape = _dims(bias, batch, q_heads, q_seq, kv_seq)
        opts["bias"] = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    if mask is not None:
        shape = _dims(mask, batch, q_heads, q_seq, kv_seq)
        opts["mask"] = jnp.asarray(rng.random(shape) < 0.75)
    for name, spec, seq in (("q_seqlens", q_seqlens, q_seq), ("kv_seqlens", kv_seqlens, kv_seq)):
        if spec is None:
            continue
        if isinstance(spec, str):
            lens = rng.integers(0, seq + 1, nb)
            if spec == "edges":
                lens[0::3], lens[1::3] = seq, 0
            elif spec != "rand":
                raise ValueError(f"seqlens spec {spec!r}: use 'rand', 'edges' or a list")
        else:
            lens = np.resize(np.asarray(spec), nb)
        opts[name] = jnp.asarray(lens.reshape(batch).astype(np.int32))
    if segments is not None:
        ids = []
        for seq in (q_seq, kv_seq):
            rows = [np.sort(rng.integers(0, segments, seq)) for _ in range(nb)]
            ids.append(jnp.asarray(np.stack(rows).reshape(*batch, seq).astype(np.int32)))
        opts["q_segment_ids"], opts["kv_segment_ids"] = ids
    if sink:
        opts["sink"] = jnp.asarray(rng.standard_normal((q_heads,), dtype=np.float32))
    return opts


_DIFF_OPTIONS = ("bias", "sink")  # array options that get a gradient
_ARRAY_OPTIONS = ("mask", "q_seqlens", "kv_seqlens", "q_segment_ids", "kv_segment_ids", "key")


def loss_weights(seed, q, v):
    """Random float32 `(w, u)` for the test loss: `w` like the output, `u` like `aux.lse`."""
    rng = np.random.default_rng(seed + 10_000)
    *batch, q_seq, q_heads, _ = q.shape
    w = rng.standard_normal((*batch, q_seq, q_heads, v.shape[-1]), dtype=np.float32)
    u = rng.standard_normal((*batch, q_heads, q_seq), dtype=np.float32)
    return jnp.asarray(w), jnp.asarray(u)


def probe_loss(out, lse, w, u):
    """`sum(out * w) + sum(lse * u)` over rows with a finite lse: exercises both the output's and
    the lse's cotangent. Works on JAX and NumPy arrays alike."""
    xp = jnp if isinstance(out, jax.Array) else np
    lse_term = xp.where(xp.isfinite(lse), lse * u, 0.0)
    return xp.sum(out.astype(xp.float32 if xp is jnp else np.float64) * w) + xp.sum(lse_term)


def split_options(q, k, v, options):
    """Splits attention keyword arguments into `(diff, arrays, static)`: the differentiable
    arrays (`q`, `k`, `v`, `bias`, `sink`), the other arrays, and the static Python options."""
    diff = {"q": q, "k": k, "v": v}
    arrays, static = {}, {}
    for name, x in options.items():
        if name in _DIFF_OPTIONS and x is not None:
            diff[name] = x
        elif name in _ARRAY_OPTIONS and x is not None:
            arrays[name] = x
        else:
            static[name] = x
    return diff, arrays, static


def value_and_grads(backend, diff, arrays, static, w, u):
    """Traceable: `(out, aux, grads)` of `probe_loss` for one backend (see `split_options`)."""

    def loss(diff):
        extra = {n: x for n, x in diff.items() if n not in ("q", "k", "v")}
        out, aux = attnaux.attention(diff["q"], diff["k"], diff["v"], **extra, **arrays, **static,
                                     backend=backend)
        return probe_loss(out, aux.lse, w, u), (out, aux)

    (_, (out, aux)), grads = jax.value_and_grad(loss, has_aux=True)(diff)
    return out, aux, grads


def attention_and_grads(q, k, v, w, u, *, backend, **options):
    """Runs `attnaux.attention(q, k, v, backend=backend, **options)` under `jax.jit` and returns
    `(out, aux, grads)`, `grads` a dict with the gradients of `probe_loss(out, aux.lse, w, u)` for
    `q`, `k`, `v` and, when given, `bias` and `sink`."""
    diff, arrays, static = split_options(q, k, v, options)
    run = jax.jit(lambda diff, arrays, w, u: value_and_grads(backend, diff, arrays, static, w, u))
    return run(diff, arrays, w, u)


# ------------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------------
def _np64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def assert_close(actual, expected, tol: tuple[float, float], what: str = "") -> None:
    """Asserts `|actual - expected| <= atol * max(1, max|expected|) + rtol * |expected|`.

    Infinities must sit at the same places with the same sign (lse = max = -inf on rows without a
    visible key); NaN is never accepted in `actual`. On failure the message gives `what`, the
    largest absolute and relative errors and where they are.
    """
    rtol, atol = tol
    a, e = _np64(actual), _np64(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    assert not np.isnan(a).any(), f"{what}: NaN at {np.argwhere(np.isnan(a))[:5].tolist()}"
    assert not np.isnan(e).any(), f"{what}: NaN in the expected value"
    inf_a, inf_e = np.isinf(a), np.isinf(e)
    bad_inf = (inf_a | inf_e) & ~((a == e) & inf_a)
    if bad_inf.any():
        idx = tuple(np.argwhere(bad_inf)[0])
        raise AssertionError(
            f"{what}: infinities differ at {int(bad_inf.sum())} places, first {idx}: "
            f"actual {a[idx]} expected {e[idx]}"
        )
    fin = ~inf_e
    if not fin.any():
        return
    scale = max(1.0, float(np.max(np.abs(e[fin]))))
    with np.errstate(invalid="ignore"):
        err = np.where(fin, np.abs(a - e), 0.0)
    allowed = atol * scale + rtol * np.abs(np.where(fin, e, 0.0))
    if (err > allowed).any():
        worst = tuple(int(i) for i in np.unravel_index(np.argmax(err - allowed), err.shape))
        rel = err / np.maximum(np.abs(np.where(fin, e, 1.0)), 1e-30)
        raise AssertionError(
            f"{what}: {int((err > allowed).sum())} of {err.size} entries out of tolerance "
            f"(rtol={rtol}, atol={atol} x {scale:.3g}); max abs err {err.max():.3e}, "
            f"max rel err {rel[fin].max():.3e}; worst at {worst}: actual {a[worst]:.8g} "
            f"expected {e[worst]:.8g}"
        )


# ------------------------------------------------------------------------------------------------
# Markers
# ------------------------------------------------------------------------------------------------
HAS_FLASH = _ffi.has_target("attnaux_flash_fwd", "cpu")

requires_flash = pytest.mark.skipif(
    not HAS_FLASH,
    reason="the compiled `flash` kernels are not available (attnaux._ext is not built or did not "
    f"register 'attnaux_flash_fwd' for cpu: {_ffi.IMPORT_ERROR}); `pip install -e .` builds them",
)


def every_other(cases, *, single: bool = False):
    """A parametrize list with every other case (odd positions) behind the `slow` marker: the
    default run takes half of a family of alike cases, `pytest -m slow` the other half.
    `cases`: argument tuples, or single values with `single=True`, or `pytest.param`s."""
    out = []
    for i, case in enumerate(cases):
        if i % 2 == 0:
            out.append(case)
        elif isinstance(case, type(pytest.param(None))):
            out.append(pytest.param(*case.values, marks=[*case.marks, pytest.mark.slow],
                                    id=case.id))
        else:
            values = (case,) if single else tuple(case)
            out.append(pytest.param(*values, marks=pytest.mark.slow))
    return out


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and jax.default_backend() != "gpu":
        pytest.skip(f"needs a GPU; JAX's default backend is {jax.default_backend()!r}")


# Tests whose work runs in a background subprocess (tests/test_spmd.py: the 8-device suite) carry
# a `start_early` function: it is called once collection has selected them, so that subprocess
# runs beside the rest of the session (whose tests use about one core), and the test itself only
# waits for its result. Not under --collect-only / --setup-plan / --setup-only, nor in an xdist
# worker (each worker would start its own). Whatever still runs when the session ends is killed.
_STARTED_EARLY = []


def pytest_collection_finish(session):
    opt = session.config.option
    if (getattr(opt, "collectonly", False) or getattr(opt, "setupplan", False)
            or getattr(opt, "setuponly", False) or hasattr(session.config, "workerinput")):
        return
    for item in session.items:
        start = getattr(getattr(item, "function", None), "start_early", None)
        if start is not None:
            start()
            _STARTED_EARLY.append(item.module)


def pytest_sessionfinish(session):
    for module in _STARTED_EARLY:
        module.stop_all()


# The multi-device tests in tests/spmd need 8 devices, which JAX gets only when
# XLA_FLAGS=--xla_force_host_platform_device_count=8 is set before it starts: tests/test_spmd.py
# runs them in a subprocess, so this session does not collect them itself.
collect_ignore = [] if len(jax.devices()) >= 8 else ["spmd"]
