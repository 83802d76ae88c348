"""`flash` (the compiled C++ kernels) against `reference` (pure JAX), through the public API.

Every case compares out, aux.lse, aux.max and the gradients of
`probe_loss = sum(out * w) + sum(lse * u)` (random w, u; so the gradient through `aux.lse` is
checked too) with respect to q, k, v and, when given, bias and sink, with the per-dtype
tolerances of `conftest.TOL`. Both backends run inside one `jax.jit` per case (one compile).

Default grid (a few seconds of compute; most of the time is compilation):
- every option and several combinations at three shapes: short odd lengths inside one 64 x 64
  kernel tile, and two multi-tile shapes with q_seq < kv_seq and q_seq > kv_seq (float32);
- a subset of those options in bfloat16 and float16;
- lengths 1, 7, 113, 257 paired both ways x head dims 32/64/80/128 x the three dtypes (covering,
  not the full product), v_dim != qk_dim, GQA 8:2 and MQA;
- bias and mask broadcast over batch and heads, zero / one / two batch dims;
- flash against the float64 oracle directly (so a shared mistake of both backends shows), zero
  sizes, jit / vmap / grad behaviour, no recompilation on new data, thread-count independence
  and linear memory.
The full products (lengths x dims x dtypes x causal modes; options x dtypes x shapes) are marked
`slow` (run with `-m slow`).
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import (
    assert_close,
    dtype_id,
    every_other,
    loss_weights,
    make_inputs,
    make_options,
    requires_flash,
    split_options,
    tol,
    value_and_grads,
)
from thread_count import assert_same_on_one_and_all_cpus

import attnaux

pytestmark = requires_flash

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
DTYPES_ALL = [F32, BF16, F16]


# ------------------------------------------------------------------------------------------------
# The comparison
# ------------------------------------------------------------------------------------------------
def run_both(q, k, v, w, u, options):
    """`{"flash": (out, aux, grads), "reference": (...)}` from one jitted computation."""
    diff, arrays, static = split_options(q, k, v, options)

    def both(diff, arrays, w, u):
        return {b: value_and_grads(b, diff, arrays, static, w, u) for b in ("flash", "reference")}

    return jax.jit(both)(diff, arrays, w, u)


def check_parity(q, k, v, options, seed=0):
    """Asserts flash == reference (out, lse, max, every gradient) within `TOL[q.dtype]`; on
    failure lists every quantity that is out of tolerance with its largest errors."""
    w, u = loss_weights(seed, q, v)
    res = run_both(q, k, v, w, u, options)
    f_out, f_aux, f_grads = res["flash"]
    r_out, r_aux, r_grads = res["reference"]
    assert f_aux.backend == "flash" and r_aux.backend == "reference"
    assert f_out.dtype == q.dtype and f_aux.lse.dtype == jnp.float32
    assert set(f_grads) == set(r_grads)
    dtype = q.dtype
    checks = [("out", f_out, r_out, tol(dtype, "out")),
              ("lse", f_aux.lse, r_aux.lse, tol(dtype, "lse")),
              ("max", f_aux.max, r_aux.max, tol(dtype, "lse"))]
    checks += [(f"d{n}", f_grads[n], r_grads[n], tol(dtype, "grad")) for n in sorted(r_grads)]
    failures = []
    for name, got, want, t in checks:
        if got.shape != want.shape or got.dtype != want.dtype:
            failures.append(f"{name}: flash {got.shape} {got.dtype} vs reference "
                            f"{want.shape} {want.dtype}")
            continue
        try:
            assert_close(got, want, t, name)
        except AssertionError as e:
            failures.append(str(e))
    if failures:
        shapes = dict(q=q.shape, k=k.shape, v=v.shape, dtype=jnp.dtype(dtype).name)
        described = {n: (x.shape if hasattr(x, "shape") else x) for n, x in options.items()}
        raise AssertionError(f"flash != reference for {shapes} {described}:\n  "
                             + "\n  ".join(failures))


def build(seed, batch, sq, skv, hq, hkv, d, dv, dtype, opts):
    q, k, v = make_inputs(seed, batch, sq, skv, hq, hkv, d, dv, dtype)
    return q, k, v, make_options(seed + 1, batch, sq, skv, hq, **opts)


# ------------------------------------------------------------------------------------------------
# Every option, alone and combined
# ------------------------------------------------------------------------------------------------
OPTION_SETS = {
    "plain": {},
    "scale-0.3": dict(scale=0.3),
    "scale-3": dict(scale=3.0),
    "scale-8-peaky": dict(scale=8.0, causal=True),  # logits ~ +-100: exp overflows unshifted
    "bias-BHQK": dict(bias="BHQK"),
    "bias-B1QK": dict(bias="B1QK"),
    "bias-11QK": dict(bias="b1QK"),
    "bias-HQK": dict(bias="HQK"),
    "bias-QK": dict(bias="QK"),
    "bias-B11K": dict(bias="B11K"),
    "bias-1HQ1": dict(bias="bHQ1"),
    "mask-BHQK": dict(mask="BHQK"),
    "mask-B1QK": dict(mask="B1QK"),
    "mask-QK": dict(mask="QK"),
    "mask-B11K": dict(mask="B11K"),
    "causal-top_left": dict(causal=True),
    "causal-bottom_right": dict(causal="bottom_right"),
    "window-16-3": dict(window=(16, 3)),
    "window-0-0": dict(window=(0, 0)),
    "window-None-5": dict(window=(None, 5)),
    "window-40-None": dict(window=(40, None)),
    "window-64-0-top_left": dict(window=(64, 0), causal=True),
    "window-7-65-bottom_right": dict(window=(7, 65), causal="bottom_right"),
    "q_seqlens": dict(q_seqlens="edges"),
    "kv_seqlens": dict(kv_seqlens="edges"),
    "seqlens-out-of-range": dict(q_seqlens=[-2, 500, 5], kv_seqlens=[500, 3, -7],
                                 causal="bottom_right"),  # clamped to [0, seq]
    "seqlens-bottom_right": dict(q_seqlens="rand", kv_seqlens="edges", causal="bottom_right"),
    "seqlens-top_left-window": dict(q_seqlens="edges", kv_seqlens="rand", causal=True,
                                    window=(20, 0)),
    "segments-3": dict(segments=3),
    "segments-bottom_right-seqlens": dict(segments=4, causal="bottom_right", kv_seqlens="rand"),
    "softcap": dict(softcap=2.0, scale=1.0),
    "softcap-bias": dict(softcap=5.0, bias="B1QK"),
    "sink": dict(sink=True),
    "sink-mask-seqlens": dict(sink=True, mask="BHQK", q_seqlens="edges", kv_seqlens="edges"),
    "bias-mask-causal": dict(bias="BHQK", mask="B1QK", causal="bottom_right"),
    "all": dict(bias="B1QK", mask="bHQK", causal="bottom_right", window=(30, 2),
                q_seqlens="rand", kv_seqlens="rand", segments=2, softcap=3.0, sink=True),
}
# (sq, skv): inside one 64 x 64 tile, then several tiles with partial last tiles, both ways.
OPTION_SHAPES = {"9x23": (9, 23), "70x133": (70, 133), "133x70": (133, 70)}


def _option_cases(names, dtypes, shapes):
    return [
        pytest.param(name, dtype, shape, id=f"{name}-{shape}-{dtype_id(dtype)}")
        for dtype in dtypes for name in names for shape in shapes
    ]


def _run_option_case(name, dtype, shape, seed=0):
    sq, skv = OPTION_SHAPES[shape]
    q, k, v, opts = build(seed, (3,), sq, skv, 4, 2, 32, 32, dtype, OPTION_SETS[name])
    check_parity(q, k, v, opts, seed)


# Default: every option set in float32 at one shape, in turn the one-tile shape and a
# multi-tile one (alternating q_seq < kv_seq and q_seq > kv_seq); the other shape behind the
# slow marker, and the slow sweep runs every shape and dtype.
_MULTI_TILE = ["70x133", "133x70"]


@pytest.mark.parametrize(
    "name,dtype,shape",
    [c for n, name in enumerate(OPTION_SETS)
     for c in every_other(_option_cases([name], [F32], ["9x23", _MULTI_TILE[n % 4 // 2]])
                          [::1 if n % 2 == 0 else -1])])
def test_options(name, dtype, shape):
    _run_option_case(name, dtype, shape)


LOW_PRECISION_OPTIONS = ["plain", "bias-B1QK", "mask-BHQK", "causal-top_left",
                         "causal-bottom_right", "window-16-3", "seqlens-bottom_right",
                         "segments-bottom_right-seqlens", "softcap-bias", "sink-mask-seqlens",
                         "all"]


@pytest.mark.parametrize(
    "name,dtype,shape",
    [c for n, name in enumerate(LOW_PRECISION_OPTIONS)
     for c in _option_cases([name], [[BF16, F16][n % 2]], [_MULTI_TILE[n % 2]])]
    + _option_cases(["all"], [F16], ["70x133"]) + _option_cases(["all"], [BF16], ["133x70"]))
def test_options_low_precision(name, dtype, shape):
    _run_option_case(name, dtype, shape)


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype,shape", _option_cases(OPTION_SETS, DTYPES_ALL, OPTION_SHAPES))
def test_options_sweep(name, dtype, shape):
    _run_option_case(name, dtype, shape)


# ------------------------------------------------------------------------------------------------
# Lengths x head dims x dtypes
# ------------------------------------------------------------------------------------------------
LENGTH_PAIRS = [(1, 1), (1, 257), (257, 1), (7, 113), (113, 7), (113, 257), (257, 113),
                (257, 257)]
HEAD_DIMS = [32, 64, 80, 128]
CAUSAL_MODES = [False, "top_left", "bottom_right"]
HEADS = [(8, 2), (4, 1)]  # GQA 8:2 and MQA


def _shape_case(sq, skv, d, dv, hq, hkv, dtype, causal):
    c = {False: "full", "top_left": "tl", "bottom_right": "br"}[causal]
    return pytest.param(sq, skv, d, dv, hq, hkv, dtype, causal,
                        id=f"{sq}x{skv}-d{d}" + (f"-dv{dv}" if dv != d else "")
                        + f"-h{hq}:{hkv}-{c}-{dtype_id(dtype)}")


def _default_shape_cases():
    cases = []
    for t, dtype in enumerate(DTYPES_ALL):
        for n, (sq, skv) in enumerate(LENGTH_PAIRS):
            d = HEAD_DIMS[(n + t) % 4]  # every dtype sees every head dim twice
            hq, hkv = HEADS[(n + t) % 2]
            causal = CAUSAL_MODES[(n + 2 * t) % 3]
            cases.append(_shape_case(sq, skv, d, d, hq, hkv, dtype, causal))
    cases.append(_shape_case(113, 70, 64, 32, 8, 2, F32, "bottom_right"))  # v_dim != qk_dim
    cases.append(_shape_case(70, 113, 80, 128, 4, 1, BF16, False))
    cases.append(_shape_case(65, 64, 32, 16, 6, 3, F16, "top_left"))
    return cases


@pytest.mark.parametrize("sq,skv,d,dv,hq,hkv,dtype,causal", every_other(_default_shape_cases()))
def test_shapes(sq, skv, d, dv, hq, hkv, dtype, causal):
    q, k, v, opts = build(sq * 7 + skv, (1,), sq, skv, hq, hkv, d, dv, dtype, dict(causal=causal))
    check_parity(q, k, v, opts)


def _rotated_causal(n):
    """Four causal modes for the four head dims, rotated with the length pair `n`."""
    return CAUSAL_MODES[n % 3:] + CAUSAL_MODES[:n % 3] + [False]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sq,skv,d,dv,hq,hkv,dtype,causal",
    [_shape_case(sq, skv, d, d, 4, 2, dtype, causal)
     for dtype in DTYPES_ALL
     for n, (sq, skv) in enumerate((a, b) for a in (1, 7, 64, 65, 113, 257)
                                   for b in (1, 7, 64, 65, 113, 257))
     for d, causal in zip(HEAD_DIMS, _rotated_causal(n), strict=True)],
)
def test_shapes_sweep(sq, skv, d, dv, hq, hkv, dtype, causal):
    q, k, v, opts = build(sq * 7 + skv, (2,), sq, skv, hq, hkv, d, dv, dtype, dict(causal=causal))
    check_parity(q, k, v, opts)


# ------------------------------------------------------------------------------------------------
# Heads, batch dims and broadcasting (bias with its gradient)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hq,hkv,dtype", [
    pytest.param(8, 2, F32, id="gqa8:2-f32"), pytest.param(8, 1, BF16, id="mqa8:1-bf16"),
    pytest.param(4, 4, F16, id="mha4:4-f16"), pytest.param(6, 3, F32, id="gqa6:3-f32"),
    pytest.param(1, 1, BF16, id="single-head-bf16"), pytest.param(8, 1, F32, id="mqa8:1-f32")])
def test_heads(hq, hkv, dtype):
    opts = dict(bias="BHQK", causal="bottom_right", kv_seqlens="rand", sink=True)
    q, k, v, opts = build(hq * 10 + hkv, (2,), 67, 90, hq, hkv, 32, 32, dtype, opts)
    check_parity(q, k, v, opts)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("opts", [
    dict(causal=True), dict(window=(70, 5), kv_seqlens="rand"),
    dict(causal="bottom_right", segments=3), dict(mask="BHQK", q_seqlens="edges")], ids=str)
def test_bfloat16_head_dims(dim, opts):
    """bfloat16 at head dims 64 and 128: where the CPU has AMX, the forward's two products run on
    its tiles (cpu_gemm.h, AmxGemm64: keys in whole tiles of 16 and 32, zero-padded), else on
    VDPBF16PS or in float32; key counts that end inside a tile, windows and segments that start
    a tile's keys inside a block, GQA. Parity with the reference within `check_parity`'s
    bfloat16 tolerances (out, lse, max and the gradients)."""
    q, k, v, opts = build(dim + len(opts), (2,), 150, 203, 4, 2, dim, dim, BF16, opts)
    check_parity(q, k, v, opts)


BROADCAST_CASES = [
    # (batch, options) -- bias / mask specs: B = batch dims, b = ones for them, H, Q, K, 1
    ((), dict(causal="bottom_right")),
    ((), dict(bias="HQK", mask="QK")),
    ((), dict(bias="QK", q_seqlens=[50], kv_seqlens=[33])),
    ((), dict(bias="1QK", segments=2, sink=True)),
    ((2,), dict(bias="11QK")),
    ((2,), dict(bias="B1QK")),
    ((2,), dict(bias="HQK")),
    ((2,), dict(bias="QK", mask="B11K")),
    ((2,), dict(bias="B1Q1", mask="1HQK")),
    ((2, 3), dict(bias="BHQK", causal=True)),
    ((2, 3), dict(bias="bHQK", mask="BH1K")),
    ((2, 3), dict(bias=(1, 3, 1, 41, 57), mask=(2, 1, 4, 41, 57))),
    ((2, 3), dict(bias="QK", q_seqlens="edges", kv_seqlens="rand", segments=3,
                  causal="bottom_right")),
]


def _broadcast_id(batch, opts):
    def fmt(x):
        return "x".join(map(str, x)) if isinstance(x, (tuple, list)) else str(x)

    return "-".join([f"batch{fmt(batch) or 'None'}"] + [f"{n}={fmt(x)}" for n, x in opts.items()])


@pytest.mark.parametrize("batch,opts", [pytest.param(b, o, id=_broadcast_id(b, o))
                                        for b, o in BROADCAST_CASES])
def test_broadcast_and_batch_dims(batch, opts):
    q, k, v, opts = build(len(batch) + 5, batch, 41, 57, 4, 2, 32, 32, F32, opts)
    check_parity(q, k, v, opts)  # includes d(bias) in the bias's own (broadcast) shape


# ------------------------------------------------------------------------------------------------
# Flash against the float64 oracle directly, and zero sizes
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,dtype", [("all", F32), ("seqlens-top_left-window", F32),
                                        ("all", BF16)], ids=lambda x: x if isinstance(x, str)
                         else dtype_id(x))
def test_flash_matches_oracle(name, dtype):
    q, k, v, opts = build(9, (2,), 70, 133, 4, 2, 32, 32, dtype, OPTION_SETS[name])
    out, aux = attnaux.attention(q, k, v, backend="flash", **opts)
    want_out, want_lse, want_max, _ = oracle.attention(q, k, v, **opts)
    assert_close(out, want_out, tol(dtype, "out"), "out")
    assert_close(aux.lse, want_lse, tol(dtype, "lse"), "lse")
    assert_close(aux.max, want_max, tol(dtype, "lse"), "max")


@pytest.mark.parametrize("batch,sq,skv", [((0,), 5, 7), ((2,), 0, 7), ((2,), 5, 0),
                                          ((2,), 0, 0), ((2, 0), 3, 3)],
                         ids=["batch0", "sq0", "skv0", "sq0-skv0", "batch2x0"])
def test_zero_sizes(batch, sq, skv):
    """Zero-sized batch or sequences work: outputs of the right shapes; an empty key set gives
    out 0 and lse = max = -inf; gradients have the inputs' shapes and are zero."""
    q, k, v = make_inputs(0, batch, sq, skv, 4, 2, 16, 8)
    w, u = loss_weights(0, q, v)
    diff, arrays, static = split_options(q, k, v, {})
    out, aux, grads = jax.jit(
        lambda d, a, w, u: value_and_grads("flash", d, a, static, w, u))(diff, arrays, w, u)
    assert out.shape == (*batch, sq, 4, 8) and aux.lse.shape == (*batch, 4, sq)
    if skv == 0:
        assert np.all(np.asarray(out) == 0)
        assert np.all(np.asarray(aux.lse) == -np.inf) and np.all(np.asarray(aux.max) == -np.inf)
    for n in ("q", "k", "v"):
        assert grads[n].shape == diff[n].shape
        if sq == 0 or skv == 0:
            assert np.all(np.asarray(grads[n]) == 0)


# ------------------------------------------------------------------------------------------------
# jit / vmap / grad
# ------------------------------------------------------------------------------------------------
def _vmapped(backend, in_axes, q, k, v, bias, **static):
    def f(q, k, v, bias):
        out, aux = attnaux.attention(q, k, v, bias=bias, backend=backend, **static)
        return out, aux.lse, aux.max

    return jax.jit(jax.vmap(f, in_axes=in_axes))(q, k, v, bias)


@pytest.mark.parametrize("in_axes", [(0, 0, 0, None), (0, None, None, None), (None, 0, 0, 0),
                                     (None, None, None, 0), (1, 1, 1, 0)],
                         ids=["qkv", "q-only", "kv-and-bias", "bias-only", "axis1"])
def test_vmap(in_axes):
    """vmap over some or all arguments: flash equals reference and equals a Python loop."""
    n = 3
    rng = np.random.default_rng(0)

    def arg(axis, shape):
        if axis is None:
            return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
        shape = list(shape)
        shape.insert(axis, n)
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))

    q = arg(in_axes[0], (2, 37, 4, 16))
    k = arg(in_axes[1], (2, 70, 2, 16))
    v = arg(in_axes[2], (2, 70, 2, 16))
    bias = arg(in_axes[3], (1, 4, 37, 70))
    static = dict(causal="bottom_right")
    got = _vmapped("flash", in_axes, q, k, v, bias, **static)
    want = _vmapped("reference", in_axes, q, k, v, bias, **static)
    for name, g, r in zip(("out", "lse", "max"), got, want, strict=True):
        assert_close(g, r, tol(F32, "out" if name == "out" else "lse"), f"vmap {name}")
    for i in range(n):
        sl = [x if a is None else jnp.take(x, i, axis=a)
              for x, a in zip((q, k, v, bias), in_axes, strict=True)]
        out, aux = attnaux.attention(*sl[:3], bias=sl[3], backend="flash", **static)
        assert_close(got[0][i], out, (1e-6, 1e-6), f"vmap out [{i}] vs unbatched call")
        assert_close(got[1][i], aux.lse, (1e-6, 1e-6), f"vmap lse [{i}] vs unbatched call")


def test_vmap_of_grad_with_sink():
    """vmap of grad, including a sink mapped per element (the sequential path of the rule)."""
    q, k, v = make_inputs(4, (3,), 20, 30, 2, 1, 16, 16)
    sink = jnp.asarray(np.random.default_rng(4).standard_normal((3, 2)), jnp.float32)

    def loss(backend):
        def f(q, k, v, sink):
            out, aux = attnaux.attention(q[None], k[None], v[None], sink=sink, causal=True,
                                         backend=backend)
            return jnp.sum(out**2) + jnp.sum(aux.lse)
        return jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1, 2, 3))))

    got, want = loss("flash")(q, k, v, sink), loss("reference")(q, k, v, sink)
    for name, g, r in zip("qkvs", got, want, strict=True):
        assert_close(g, r, tol(F32, "grad"), f"vmap(grad) d{name}")


def test_no_recompile_on_new_data():
    """A second call with new data but the same shapes and options compiles nothing."""
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    def step(seed):
        q, k, v = make_inputs(seed, (2,), 33, 45, 4, 2, 16, 16)
        bias = jnp.asarray(np.random.default_rng(seed).standard_normal((2, 1, 33, 45)),
                           jnp.float32)
        out, aux = attnaux.attention(q, k, v, bias=bias, causal=True, backend="flash")
        g = jax.grad(lambda q: jnp.sum(attnaux.attention(q, k, v, bias=bias, causal=True,
                                                         backend="flash")[1].lse))(q)
        jax.block_until_ready((out, aux, g))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        step(0)
        first = len(compiles)
        step(1)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert first > 0, "the compile listener saw nothing: the JAX event name may have changed"
    assert len(compiles) == first, (
        f"{len(compiles) - first} compilation(s) on the second call with new data")


# ------------------------------------------------------------------------------------------------
# Thread-count independence and linear memory (in subprocesses)
# ------------------------------------------------------------------------------------------------
_THREADS_SCRIPT = textwrap.dedent("""
    import os, sys
    cpus = sorted(os.sched_getaffinity(0))
    if sys.argv[1] == "one":
        os.sched_setaffinity(0, {cpus[0]})
    import jax, jax.numpy as jnp, numpy as np
    import attnaux
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in
               [(2, 257, 4, 32), (2, 300, 2, 32), (2, 300, 2, 32)])
    bias = jnp.asarray(rng.standard_normal((2, 1, 257, 300), dtype=np.float32))
    def f(q, k, v, bias):
        out, aux = attnaux.attention(q, k, v, bias=bias, causal="bottom_right", backend="flash")
        return jnp.sum(out * out) + jnp.sum(aux.lse), (out, aux.lse, aux.max)
    (_, res), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, bias)
    # bfloat16 at head dim 64 (its products on AMX tiles where the CPU has them)
    q16, k16, v16 = (jnp.asarray(rng.standard_normal(s, dtype=np.float32), jnp.bfloat16)
                     for s in [(2, 257, 4, 64), (2, 300, 2, 64), (2, 300, 2, 64)])
    def f16(q, k, v):
        out, aux = attnaux.attention(q, k, v, causal=True, backend="flash")
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(aux.lse), (out, aux.lse)
    (_, (out16, lse16)), g16 = jax.jit(jax.value_and_grad(f16, argnums=(0, 1, 2),
                                                          has_aux=True))(q16, k16, v16)
    extra = (out16.astype(jnp.float32), lse16, *(g.astype(jnp.float32) for g in g16))
    np.savez(sys.argv[2], *[np.asarray(x) for x in (*res, *g, *extra)])
""")


def _child_env():
    # The child imports attnaux exactly as this process does (installed, or PYTHONPATH=src).
    return dict(os.environ, PYTHONWARNINGS="ignore")


def test_results_do_not_depend_on_thread_count(tmp_path):
    assert_same_on_one_and_all_cpus(_THREADS_SCRIPT, tmp_path,
                                    ["out", "lse", "max", "dq", "dk", "dv", "dbias",
                                     "out bf16", "lse bf16", "dq bf16", "dk bf16", "dv bf16"])


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time
    import jax, jax.numpy as jnp, numpy as np
    import attnaux
    backend, s = sys.argv[1], int(sys.argv[2])
    page_kib = os.sysconf("SC_PAGE_SIZE") // 1024
    def rss_kib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page_kib
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, s, 1, 32), dtype=np.float32)) for _ in range(3))
    def f(q, k, v):
        out, aux = attnaux.attention(q, k, v, causal=True, backend=backend)
        return jnp.sum(out) + jnp.sum(aux.lse)
    run = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, v).compile()
    jax.block_until_ready((q, k, v))
    base, peak, done = rss_kib(), [0], threading.Event()
    def sample():  # the current RSS every 0.5 ms while the computation runs
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib())
            time.sleep(0.0005)
    t = threading.Thread(target=sample)
    t.start()
    jax.block_until_ready(run(q, k, v))
    done.set()
    t.join()
    print(json.dumps(dict(grown_kib=max(0, peak[0] - base))))
""")


def test_memory_is_linear_in_sequence_length():
    """Growth of the resident memory (sampled every 0.5 ms) during a compiled forward+backward
    at 1 x seq x 1 x 32 (causal). The reference at seq 4096 is the control (it materialises the
    64 MiB float32 score matrix, so it shows that the measurement sees quadratic buffers). Flash
    must stay under an eighth of the score matrix at seq 8192 (its O(seq) buffers, inputs,
    gradients and packed copies, are ~2 KiB per row here: ~16 MiB) and grow like seq, not seq**2,
    from 4096 to 8192 (linear: x2; quadratic: x4)."""

    def grown(backend, s):
        proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, backend, str(s)],
                              check=True, env=_child_env(), timeout=300, capture_output=True,
                              text=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])["grown_kib"]

    def score_kib(s):
        return s * s * 4 // 1024

    control = grown("reference", 4096)
    assert control > score_kib(4096), f"control failed: the reference grew by {control} KiB"
    small, large = grown("flash", 4096), grown("flash", 8192)
    assert large < score_kib(8192) // 8, (
        f"flash grew the resident memory by {large} KiB at seq 8192 (the score matrix is "
        f"{score_kib(8192)} KiB; at seq 4096: {small} KiB)")
    assert large < 2.6 * small + 2048, (
        f"flash memory grows faster than linearly: {small} KiB at seq 4096, {large} KiB at 8192")
