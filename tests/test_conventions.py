"""The conventions every backend keeps (DESIGN.md, docs/kernel_abi.md), for `flash` and `reference`.

- A row with no visible key (fully masked by mask, window, segment ids or bottom-right causal
  alignment; padding beyond `q_seqlens`; `kv_seqlens = 0`; an empty key sequence) gives output 0,
  `lse = max = -inf` (with a sink: `lse = sink`), and finite gradients that are zero for it.
- Stats are float32 for every input dtype.
- NaN and inf stored where nothing may look (q/k/v rows beyond the lengths, bias entries that are
  not visible, k/v rows the mask hides from every query) never reach outputs or gradients: the
  results equal, bit for bit, those with zeros there.
- `flash` gives bitwise the same results whatever the number of threads.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnaux
from attnaux import _ffi

HAS_FLASH = _ffi.has_target("attnaux_flash_fwd", "cpu")
requires_flash = pytest.mark.skipif(
    not HAS_FLASH, reason="the compiled flash kernel is not registered for cpu"
)
BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param("flash", id="flash", marks=requires_flash),
]
DTYPES = [
    pytest.param(jnp.float32, id="f32"),
    pytest.param(jnp.bfloat16, id="bf16"),
    pytest.param(jnp.float16, id="f16"),
]

B, HQ, HKV, D, DV = 2, 4, 2, 16, 8
GROUP = HQ // HKV


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _inputs(seed, sq, skv, dtype=jnp.float32):
    return (_normal(seed, (B, sq, HQ, D), dtype), _normal(seed + 1, (B, skv, HKV, D), dtype),
            _normal(seed + 2, (B, skv, HKV, DV), dtype), _normal(seed + 3, (B, HQ, sq, skv)))


# ------------------------------------------------------------------------------------------------
# Rows without a visible key. Each scenario gives the options and, written out by hand from the
# ABI's visibility rule, which rows `dead[b, h, i]` have no visible key.
# ------------------------------------------------------------------------------------------------
def _rows(sq, spec):
    """`dead[b, h, i]` from {b: rows} (same rows for every head)."""
    dead = np.zeros((B, HQ, sq), bool)
    for b, rows in spec.items():
        dead[b, :, list(rows)] = True
    return dead


def _scenario(name):
    if name == "mask":
        sq, skv = 6, 8
        rng = np.random.default_rng(0)
        mask = rng.random((B, HQ, sq, skv)) < 0.5
        mask[..., 0] = True
        mask[0, 1, 2, :] = False  # some rows of some heads see nothing
        mask[0, 3, 0, :] = False
        mask[1, 0, 5, :] = False
        mask[1, :, 3, :] = False
        dead = ~mask.any(-1)
        return sq, skv, dict(mask=jnp.asarray(mask)), dead
    if name == "window":
        # window (0, 0): query i sees key i only; rows 4, 5 have no key 4, 5 (kv_seq = 4)
        return 6, 4, dict(window=(0, 0)), _rows(6, {0: [4, 5], 1: [4, 5]})
    if name == "window_bottom_right":
        # bottom-right, q 6; batch 0 has 3 valid keys: off = -3, window (1, 0) sees
        # j in [i - 4, i - 3] and j < 3: rows 0..2 see none. Batch 1 (8 keys, off = 2) sees
        # j in [i + 1, i + 2]: every row sees a key.
        return 6, 8, dict(causal="bottom_right", window=(1, 0), kv_seqlens=jnp.asarray([3, 8])), \
            _rows(6, {0: [0, 1, 2]})
    if name == "segments":
        q_seg = jnp.asarray([[0, 0, 1, 1, 2, 2], [5, 5, 5, 1, 1, 1]])
        kv_seg = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
        return 6, 8, dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg), \
            _rows(6, {0: [4, 5], 1: [0, 1, 2]})
    if name == "causal_bottom_right_short_kv":
        # q 6, kv 4: the last query sees all keys, row i sees j <= i - 2: rows 0, 1 see none
        return 6, 4, dict(causal="bottom_right"), _rows(6, {0: [0, 1], 1: [0, 1]})
    if name == "causal_bottom_right_kv_seqlens":
        # batch 0: 2 valid keys, off = 2 - 6 = -4: rows 0..3 see none; batch 1 full: none dead
        return 6, 8, dict(causal="bottom_right", kv_seqlens=jnp.asarray([2, 8])), \
            _rows(6, {0: [0, 1, 2, 3]})
    if name == "q_seqlens":
        return 6, 8, dict(q_seqlens=jnp.asarray([3, 0])), _rows(6, {0: [3, 4, 5],
                                                                   1: range(6)})
    if name == "kv_seqlens_zero":
        return 6, 8, dict(kv_seqlens=jnp.asarray([0, 5])), _rows(6, {0: range(6)})
    if name == "empty_kv":
        return 5, 0, dict(), _rows(5, {0: range(5), 1: range(5)})
    raise KeyError(name)


SCENARIOS = ["mask", "window", "window_bottom_right", "segments", "causal_bottom_right_short_kv",
             "causal_bottom_right_kv_seqlens", "q_seqlens", "kv_seqlens_zero", "empty_kv"]


def _runner(backend, **options):
    """A jitted `(q, k, v, bias, sink) -> ((out, lse, max), (dq, dk, dv, dbias, dsink))`: the
    vjp of (out, lse) with cotangents that are nonzero everywhere (rows without a visible key
    included: a loss like sum(lse) sends them a cotangent too)."""
    def f(q, k, v, bias, sink):
        out, aux = attnaux.attention(q, k, v, bias=bias, sink=sink, backend=backend, **options)
        assert aux.backend == backend
        return out, aux.lse, aux.max

    @jax.jit
    def run(q, k, v, bias, sink=None):
        (out, lse, row_max), vjp = jax.vjp(f, q, k, v, bias, sink)
        d_out = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        d_lse = 1.0 + jnp.sin(jnp.arange(lse.size, dtype=jnp.float32)).reshape(lse.shape)
        grads = vjp((d_out.astype(out.dtype), d_lse, jnp.zeros_like(row_max)))
        return (out, lse, row_max), grads

    return run


def _run(backend, q, k, v, bias, sink=None, **options):
    return _runner(backend, **options)(q, k, v, bias, sink)


def _f64(x):
    return np.asarray(x, np.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", SCENARIOS)
def test_rows_without_a_visible_key(backend, name):
    sq, skv, options, dead = _scenario(name)
    q, k, v, bias = _inputs(1, sq, skv)
    (out, lse, row_max), (dq, dk, dv, dbias, _) = _run(backend, q, k, v, bias, **options)
    out, lse, row_max = _f64(out), _f64(lse), _f64(row_max)
    assert lse.dtype == row_max.dtype and lse.shape == (B, HQ, sq)

    out_bhq = out.transpose(0, 2, 1, 3)  # [B, Hq, Sq, Dv]
    assert np.all(out_bhq[dead] == 0), "output of rows without a visible key is not 0"
    assert np.all(lse[dead] == -np.inf), f"lse of dead rows: {lse[dead]}"
    assert np.all(row_max[dead] == -np.inf), f"max of dead rows: {row_max[dead]}"
    assert np.all(np.isfinite(lse[~dead])) and np.all(np.isfinite(row_max[~dead]))
    assert np.all(np.isfinite(out))
    assert np.all(lse[~dead] >= row_max[~dead] - 1e-6)

    for g_name, g in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), strict=True):
        assert np.all(np.isfinite(_f64(g))), f"{g_name} is not finite"
    dq_bhq = _f64(dq).transpose(0, 2, 1, 3)
    assert np.all(dq_bhq[dead] == 0), "dq of rows without a visible key is not 0"
    assert np.all(_f64(dbias)[dead] == 0), "dbias of rows without a visible key is not 0"
    for b in range(B):
        if dead[b].all():  # no query sees any key of this batch element
            assert np.all(_f64(dk)[b] == 0) and np.all(_f64(dv)[b] == 0)
    if not dead.all():
        assert np.any(_f64(dq) != 0)  # the gradients are not vacuous


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["mask", "segments", "causal_bottom_right_short_kv",
                                  "q_seqlens", "kv_seqlens_zero", "empty_kv"])
def test_rows_without_a_visible_key_with_sink(backend, name):
    sq, skv, options, dead = _scenario(name)
    q, k, v, bias = _inputs(2, sq, skv)
    sink = _normal(9, (HQ,))
    (out, lse, row_max), (dq, dk, dv, dbias, dsink) = _run(backend, q, k, v, bias, sink=sink,
                                                          **options)
    lse, row_max = np.asarray(lse), np.asarray(row_max)
    sink_rows = np.broadcast_to(np.asarray(sink, np.float32)[None, :, None], lse.shape)
    np.testing.assert_array_equal(lse[dead], sink_rows[dead], err_msg="lse of dead rows != sink")
    assert np.all(row_max[dead] == -np.inf), "max excludes the sink: -inf on dead rows"
    assert np.all(_f64(out).transpose(0, 2, 1, 3)[dead] == 0)
    assert np.all(np.isfinite(lse))
    assert np.all(lse[~dead] > row_max[~dead])  # the sink adds to every denominator
    for g_name, g in zip(("dq", "dk", "dv", "dbias", "dsink"), (dq, dk, dv, dbias, dsink),
                        strict=True):
        assert np.all(np.isfinite(_f64(g))), f"{g_name} is not finite"
    assert np.all(_f64(dq).transpose(0, 2, 1, 3)[dead] == 0)
    assert np.all(_f64(dbias)[dead] == 0)
    assert np.any(_f64(dsink) != 0)


# ------------------------------------------------------------------------------------------------
# Dtypes of the statistics
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_stats_are_float32(backend, dtype):
    q, k, v, bias = _inputs(3, 5, 7, dtype)
    out, aux = attnaux.attention(q, k, v, bias=bias.astype(dtype), causal="bottom_right",
                                 kv_seqlens=jnp.asarray([7, 0]), backend=backend)
    assert out.dtype == dtype
    assert aux.lse.dtype == jnp.float32 and aux.max.dtype == jnp.float32
    assert aux.lse.shape == aux.max.shape == (B, HQ, 5)
    assert np.all(np.isfinite(np.asarray(aux.lse[0]))) and np.all(aux.lse[1] == -np.inf)
    # the statistics stay float32 under transformations too
    dq = jax.grad(lambda q: jnp.sum(attnaux.attention(q, k, v, backend=backend)[1].lse))(q)
    assert dq.dtype == dtype
    aux_v = jax.vmap(lambda q, k, v: attnaux.attention(q, k, v, backend=backend)[1])(q, k, v)
    assert aux_v.lse.dtype == jnp.float32 and aux_v.max.dtype == jnp.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_probs_dtype(dtype):
    q, k, v, _ = _inputs(4, 5, 7, dtype)
    _, aux = attnaux.attention(q, k, v, return_probs=True)
    assert aux.lse.dtype == jnp.float32 and aux.max.dtype == jnp.float32
    assert aux.probs.dtype == (jnp.float32 if dtype == jnp.float32 else dtype)
    assert aux.probs.shape == (B, HQ, 5, 7)


# ------------------------------------------------------------------------------------------------
# NaN and inf where nothing may look
# ------------------------------------------------------------------------------------------------
POISON = np.array([np.nan, np.inf, -np.inf], np.float32)


def _poison(x, where):
    """`x` with NaN / +inf / -inf (cycling) at the boolean positions `where` (broadcast)."""
    x = np.array(x, np.float32)
    where = np.broadcast_to(where, x.shape)
    values = np.resize(POISON, int(where.sum()))
    x[where] = values
    return x


def _visible(sq, skv, q_len, kv_len, causal=0, window=(None, None), mask=None, q_seg=None,
             kv_seg=None):
    """`visible[b, h, i, j]` straight from the ABI's rule (NumPy)."""
    vis = np.zeros((B, HQ, sq, skv), bool)
    for b in range(B):
        ql, kl = min(max(q_len[b], 0), sq), min(max(kv_len[b], 0), skv)
        off = kl - ql if causal == 2 else 0
        for i in range(sq):
            for j in range(skv):
                ok = i < ql and j < kl
                ok &= causal == 0 or j <= i + off
                ok &= window[0] is None or j >= i + off - window[0]
                ok &= window[1] is None or j <= i + off + window[1]
                ok &= q_seg is None or q_seg[b][i] == kv_seg[b][j]
                vis[b, :, i, j] = ok
    if mask is not None:
        vis &= np.broadcast_to(mask, vis.shape)
    return vis


def _leak_scenario(name):
    """(sq, skv, options, visible, q_rows_dead[b, i], kv_rows_unused[b, j]) — the last two say
    where q and k/v may be poisoned: rows no head reads."""
    sq, skv = 7, 9
    if name == "padding":
        q_len, kv_len = [4, 7], [5, 0]
        options = dict(q_seqlens=jnp.asarray(q_len), kv_seqlens=jnp.asarray(kv_len))
        visible = _visible(sq, skv, q_len, kv_len)
    elif name == "mask_hides_kv_rows":
        rng = np.random.default_rng(5)
        mask = rng.random((B, 1, sq, skv)) < 0.6
        mask[..., 0] = True
        mask[0, ..., [2, 6]] = False  # key rows 2 and 6 of batch 0: hidden from every query
        mask[1, ..., 8] = False
        mask[1, 0, 3, :] = False  # and a query row that sees nothing
        options = dict(mask=jnp.asarray(mask))
        visible = _visible(sq, skv, [sq] * B, [skv] * B, mask=mask)
    elif name == "causal_window_segments":
        q_seg = [[0, 0, 0, 1, 1, 1, 1], [3, 3, 4, 4, 4, 4, 4]]
        kv_seg = [[0, 0, 0, 0, 1, 1, 1, 1, 1], [3, 3, 3, 3, 3, 4, 4, 4, 4]]
        kv_len = [9, 8]
        options = dict(causal="bottom_right", window=(3, None), kv_seqlens=jnp.asarray(kv_len),
                       q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg))
        visible = _visible(sq, skv, [sq] * B, kv_len, causal=2, window=(3, None), q_seg=q_seg,
                           kv_seg=kv_seg)
    else:
        raise KeyError(name)
    q_dead = ~visible.any(axis=(1, 3))  # [B, Sq]: rows no head of q reads a key for
    kv_unused = ~visible.any(axis=(1, 2))  # [B, Skv]: keys no query of any head sees
    return sq, skv, options, visible, q_dead, kv_unused


LEAK_SCENARIOS = ["padding", "mask_hides_kv_rows", "causal_window_segments"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", LEAK_SCENARIOS)
def test_nan_and_inf_where_nothing_looks_do_not_leak(backend, name):
    sq, skv, options, visible, q_dead, kv_unused = _leak_scenario(name)
    assert q_dead.any() or kv_unused.any()  # the scenario has somewhere to poison
    q, k, v, bias = (np.asarray(x) for x in _inputs(6, sq, skv))
    where = dict(q=q_dead[:, :, None, None], k=kv_unused[:, :, None, None],
                 v=kv_unused[:, :, None, None], bias=~visible)
    clean = dict(q=q, k=k, v=v, bias=bias)
    clean = {n: np.where(where[n], 0, x).astype(np.float32) for n, x in clean.items()}
    run = _runner(backend, **options)
    want = jax.tree.map(np.asarray, run(*map(jnp.asarray, clean.values())))
    names = ("out", "lse", "max", "dq", "dk", "dv", "dbias")
    problems = []
    # poison one input at a time (so that a failure says which), then all of them at once
    for poisoned_inputs in (("q",), ("k",), ("v",), ("bias",), ("q", "k", "v", "bias")):
        if not any(where[n].any() for n in poisoned_inputs):
            continue
        args = {n: _poison(x, where[n]) if n in poisoned_inputs else x for n, x in clean.items()}
        (out, lse, row_max), grads = run(*map(jnp.asarray, args.values()))
        got = [np.asarray(x) for x in (out, lse, row_max, *grads[:4])]
        label = "NaN/inf in invisible places of " + "+".join(poisoned_inputs)
        for n, x, e in zip(names, got, (*want[0], *want[1][:4]), strict=True):
            x64 = x.astype(np.float64)
            if np.isnan(x64).any():
                problems.append(f"{label}: NaN reached {n} ({int(np.isnan(x64).sum())} entries)")
            elif np.isposinf(x64).any() or (n not in ("lse", "max") and np.isinf(x64).any()):
                problems.append(f"{label}: inf reached {n}")
            elif not np.array_equal(x, e):
                problems.append(f"{label}: {n} differs from the result with zeros there")
        dq, dk, dv, dbias = (g.astype(np.float64) for g in got[3:])
        for n, g, w in (("dq", dq, q_dead), ("dk", dk, kv_unused), ("dv", dv, kv_unused),
                        ("dbias", dbias, ~visible)):
            if not np.all(g[w] == 0):
                problems.append(f"{label}: {n} is not 0 at the poisoned places")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_bias_broadcast_over_heads_where_masked(backend):
    """A broadcast bias [1, 1, Sq, Skv] with NaN where a (head-broadcast) mask is False."""
    sq, skv = 5, 6
    q, k, v, _ = _inputs(7, sq, skv)
    rng = np.random.default_rng(8)
    mask = rng.random((sq, skv)) < 0.6
    mask[:, 0] = True
    bias = rng.standard_normal((1, 1, sq, skv)).astype(np.float32)
    clean = np.where(mask, bias, 0).astype(np.float32)
    poisoned = _poison(bias, ~mask)
    want = _run(backend, q, k, v, jnp.asarray(clean), mask=jnp.asarray(mask))
    got = _run(backend, q, k, v, jnp.asarray(poisoned), mask=jnp.asarray(mask))
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
    assert np.all(np.isfinite(np.asarray(got[1][3])))


# ------------------------------------------------------------------------------------------------
# Thread independence of flash
# ------------------------------------------------------------------------------------------------
_THREAD_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import jax, jax.numpy as jnp
    import attnaux

    out_dir = sys.argv[1]

    def problem(seed, b, sq, skv, hq, hkv, d, dv, dtype, bias_heads):
        rng = np.random.default_rng(seed)
        q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), dtype)
        k = jnp.asarray(rng.standard_normal((b, skv, hkv, d)), dtype)
        v = jnp.asarray(rng.standard_normal((b, skv, hkv, dv)), dtype)
        bias = jnp.asarray(rng.standard_normal((b, bias_heads, sq, skv)), jnp.float32)
        d_out = jnp.asarray(rng.standard_normal((b, sq, hq, dv)), dtype)
        d_lse = jnp.asarray(rng.standard_normal((b, hq, sq)), jnp.float32)
        return q, k, v, bias, d_out, d_lse

    CASES = {
        # several batch elements and heads, GQA, bias, bottom-right causal with padding
        "gqa": (problem(0, 3, 190, 263, 8, 2, 64, 48, jnp.float32, 8),
                dict(causal="bottom_right", kv_seqlens=jnp.asarray([263, 200, 17]),
                     q_seqlens=jnp.asarray([190, 150, 190]))),
        # one (batch, head) pair with long rows: any split of the work is within one row block
        "long": (problem(1, 1, 640, 1100, 1, 1, 32, 32, jnp.float32, 1),
                 dict(window=(300, 40))),
        "bf16": (problem(2, 2, 130, 130, 4, 4, 80, 80, jnp.bfloat16, 4), dict(causal=True)),
        # a bias broadcast over the heads: its gradient is a sum over the heads
        "broadcast_bias": (problem(0, 3, 190, 263, 8, 2, 64, 48, jnp.float32, 1),
                           dict(causal="bottom_right")),
        # decode (decode_cpu.h): chunks of keys merged in order; 12 rows per kv head (the
        # matrix-product form) and 1 row (the dot-product form)
        "decode_rows": (problem(3, 2, 3, 5000, 8, 2, 64, 64, jnp.float32, 1),
                        dict(no_bias=True, kv_seqlens=jnp.asarray([5000, 4100]))),
        "decode_one": (problem(4, 2, 1, 4500, 4, 4, 64, 64, jnp.bfloat16, 1),
                       dict(no_bias=True, softcap=20.0)),
        # 16 bfloat16 rows per kv head: S and P V on AMX tiles where the CPU has them (the
        # last keys of a tile past a whole 16 scored on VDPBF16PS)
        "decode_rows_bf16": (problem(5, 2, 4, 3000, 8, 2, 128, 128, jnp.bfloat16, 1),
                             dict(no_bias=True, kv_seqlens=jnp.asarray([3000, 2301]))),
    }
    for name, ((q, k, v, bias, d_out, d_lse), options) in CASES.items():
        options = dict(options)
        use_bias = not options.pop("no_bias", False)

        def f(q, k, v, bias):
            out, aux = attnaux.attention(q, k, v, bias=bias if use_bias else None,
                                         backend="flash", **options)
            return out, aux.lse, aux.max
        (out, lse, row_max), vjp = jax.vjp(f, q, k, v, bias)
        dq, dk, dv, dbias = vjp((d_out, d_lse, jnp.zeros_like(row_max)))
        for field, x in dict(out=out, lse=lse, max=row_max, dq=dq, dk=dk, dv=dv,
                             dbias=dbias).items():
            np.save(f"{out_dir}/{name}.{field}.npy", np.asarray(x.astype(jnp.float32)))
    print("done")
    """
)


def _run_thread_script(tmp_path, label, prefix=(), extra_flags=""):
    out_dir = tmp_path / label
    out_dir.mkdir()
    script = tmp_path / "thread_script.py"
    script.write_text(_THREAD_SCRIPT)
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(attnaux.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    if extra_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + extra_flags).strip()
    proc = subprocess.run([*prefix, sys.executable, str(script), str(out_dir)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{label} run failed:\n{proc.stderr[-3000:]}"
    return {p.name: np.load(p) for p in sorted(out_dir.glob("*.npy"))}


@pytest.fixture(scope="module")
def thread_runs(tmp_path_factory):
    """The same flash forward and backward run normally, with XLA's Eigen thread pool off, and
    pinned to one core (when `taskset` is there and more than one core is)."""
    if not HAS_FLASH:
        pytest.skip("the compiled flash kernel is not registered for cpu")
    tmp_path = tmp_path_factory.mktemp("threads")
    runs = {"normal": _run_thread_script(tmp_path, "normal")}
    runs["single_thread_eigen"] = _run_thread_script(
        tmp_path, "eigen_off", extra_flags="--xla_cpu_multi_thread_eigen=false")
    if shutil.which("taskset") and len(os.sched_getaffinity(0)) > 1:
        runs["one_core"] = _run_thread_script(tmp_path, "one_core", prefix=("taskset", "-c", "0"))
    return runs


def _compare_thread_runs(runs, prefixes):
    normal = runs["normal"]
    names = [n for n in normal if n.startswith(prefixes)]
    assert names
    for label, result in runs.items():
        assert result.keys() == normal.keys()
        for name in names:
            assert not np.isnan(normal[name]).any(), name
            np.testing.assert_array_equal(result[name], normal[name],
                                          err_msg=f"{name} differs between normal and {label}")


@requires_flash
def test_flash_results_do_not_depend_on_threads(thread_runs):
    _compare_thread_runs(thread_runs, ("gqa.", "long.", "bf16.", "decode_rows.", "decode_one.",
                                       "decode_rows_bf16."))


@requires_flash
def test_flash_broadcast_bias_gradient_does_not_depend_on_threads(thread_runs):
    """The gradient of a bias broadcast over heads sums the kernel's per-head dbias: that sum
    must not depend on the thread count either."""
    _compare_thread_runs(thread_runs, ("broadcast_bias.",))
