"""Tests of `attnaux.introspect` against independent computations.

The oracle is `np_attention`: attention written out in float64 NumPy from the semantics of
`docs/kernel_abi.md`, sharing no code with attnaux. Gradients are checked against `jax.vjp`
through `attnaux.attention` (the fused backward of whichever backend runs).

Tolerances: float32 results against the float64 oracle use `atol = rtol = 2e-5` for values of
order 1 (probabilities, lse, entropy) and `1e-4` for gradients and outputs, a few float32 ulps of
the magnitudes involved; where both sides run the same float32 arithmetic the bound is `1e-6`.
"""

import math
import os
import pathlib
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import every_other

import attnaux as ax
from attnaux import introspect as ai
from attnaux._internal import canonical_problem, dropout_keep_mask, visibility

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "introspect.md"
TOL = dict(atol=2e-5, rtol=2e-5)
GTOL = dict(atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- float64 oracle
def np_attention(q, k, v, *, scale=None, bias=None, mask=None, causal=False, window=None,
                 q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None,
                 softcap=None, sink=None):
    """float64 attention for `[B, S, H, D]` inputs: (out, lse, max, P, visible)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    bsz, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + np.broadcast_to(np.asarray(bias, np.float64), s.shape)
    ql = np.full(bsz, sq) if q_seqlens is None else np.clip(np.asarray(q_seqlens), 0, sq)
    kl = np.full(bsz, skv) if kv_seqlens is None else np.clip(np.asarray(kv_seqlens), 0, skv)
    i = np.arange(sq)[None, None, :, None]
    j = np.arange(skv)[None, None, None, :]
    vis = (i < ql[:, None, None, None]) & (j < kl[:, None, None, None])
    off = (kl - ql)[:, None, None, None] if causal == "bottom_right" else 0
    if causal:
        vis = vis & (j <= i + off)
    if window is not None:
        left, right = window
        if left is not None:
            vis = vis & (j >= i + off - left)
        if right is not None:
            vis = vis & (j <= i + off + right)
    if mask is not None:
        vis = vis & np.asarray(mask)
    if q_segment_ids is not None:
        qs = np.asarray(q_segment_ids)
        ks = qs if kv_segment_ids is None else np.asarray(kv_segment_ids)
        vis = vis & (qs[:, None, :, None] == ks[:, None, None, :])
    vis = np.broadcast_to(vis, s.shape)
    masked = np.where(vis, s, -np.inf)
    row_max = masked.max(-1)
    terms = [np.where(vis, np.exp(s - np.where(np.isfinite(row_max), row_max, 0)[..., None]), 0)]
    shift = np.where(np.isfinite(row_max), row_max, 0)
    total = terms[0].sum(-1)
    if sink is not None:
        sk = np.asarray(sink, np.float64)[None, :, None]
        lse = np.logaddexp(np.where(total > 0, shift + np.log(np.where(total > 0, total, 1)),
                                    -np.inf), sk)
    else:
        lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1)), -np.inf)
    p = np.where(vis, np.exp(s - np.where(np.isfinite(lse), lse, 0)[..., None]), 0)
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    return out, lse, row_max, p, vis


def np_entropy(p):
    p = np.asarray(p, np.float64)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), axis=-1)


def _data(seed, bsz=2, sq=7, skv=13, hq=4, hkv=2, d=8, dv=6, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (bsz, sq, hq, d), dtype)
    k = jax.random.normal(ks[1], (bsz, skv, hkv, d), dtype)
    v = jax.random.normal(ks[2], (bsz, skv, hkv, dv), dtype)
    return q, k, v


def _configs():
    """Option sets covering every mask option; shapes as in `_data()`."""
    rng = np.random.default_rng(0)
    bias_full = rng.normal(size=(2, 4, 7, 13)).astype(np.float32)
    bias_bcast = rng.normal(size=(1, 4, 1, 13)).astype(np.float32)
    bias_rows = rng.normal(size=(2, 1, 7, 1)).astype(np.float32)
    mask = rng.random((2, 1, 7, 13)) < 0.7
    mask[0, 0, 3] = False  # a fully masked row
    segs_q = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 2, 2, 2]], np.int32)
    segs_k = np.array([[0] * 5 + [1] * 8, [0] * 4 + [1] * 4 + [2] * 5], np.int32)
    return {
        "plain": {},
        "causal_gqa_scale": dict(causal=True, scale=0.5),
        "bottom_right_seqlens_window": dict(
            causal="bottom_right", window=(4, 1), q_seqlens=np.array([7, 4], np.int32),
            kv_seqlens=np.array([13, 9], np.int32)),
        "mask_bias_softcap": dict(mask=mask, bias=bias_full, softcap=2.5),
        "segments_sink_bias": dict(q_segment_ids=segs_q, kv_segment_ids=segs_k,
                                   sink=np.array([0.3, -0.5, 1.0, 0.0], np.float32),
                                   bias=bias_bcast),
        "rows_bias_window_sink": dict(window=(None, 2), bias=bias_rows, mask=mask,
                                      sink=np.array([2.0, 0.1, -1.0, 0.5], np.float32)),
    }


CONFIGS = _configs()


def _np_opts(opts):
    return {name: (np.asarray(x) if isinstance(x, (np.ndarray, jax.Array)) else x)
            for name, x in opts.items()}


# ----------------------------------------------------------------------------- QK-clip
def test_max_logit_and_qk_clip_against_float64():
    q, k, v = _data(1)
    q = q * jnp.array([1.0, 4.0, 0.3, 1.0])[:, None]  # heads with very different logit scales
    mask = np.ones((1, 4, 7, 13), bool)
    mask[0, 3] = False  # head 3: every row masked
    mask[0, 0, 2] = False  # one masked row in head 0
    opts = dict(mask=mask, causal=True)
    out, aux = ax.attention(q, k, v, **opts)
    _, _, row_max, _, _ = np_attention(q, k, v, **opts)
    want = np.max(np.where(np.isfinite(row_max), row_max, -np.inf), axis=(0, 2))
    got = ai.max_logit(aux)
    assert got.shape == (4,) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, **TOL)
    assert got[3] == -np.inf
    np.testing.assert_array_equal(jax.jit(ai.max_logit)(aux), got)

    threshold = float(np.sort(want[:3])[1])  # between the smallest and largest head maximum
    clip = ai.qk_clip(aux, threshold)
    want_clip = np.where(want > threshold, threshold / np.where(want > 0, want, 1), 1.0)
    np.testing.assert_allclose(clip, want_clip, **TOL)
    assert clip[3] == 1.0 and np.all(clip <= 1) and np.all(clip > 0)
    np.testing.assert_allclose(jax.jit(ai.qk_clip)(aux, jnp.float32(threshold)), clip, **TOL)

    # vmap over the batch: one maximum per element, whose max is the batch maximum.
    per = jax.vmap(ai.max_logit)(aux)
    assert per.shape == (2, 4)
    np.testing.assert_allclose(per.max(0), got, **TOL)

    # Non-positive maxima need no clipping.
    neg = ax.AttnAux(lse=jnp.full((1, 3, 2), 0.5), max=jnp.array([[[-1.0, -2.0], [0.0, 0.0],
                                                                    [-jnp.inf, 3.0]]]))
    np.testing.assert_allclose(ai.qk_clip(neg, 2.0), [1.0, 1.0, 2.0 / 3.0], **TOL)
    with pytest.raises(ValueError, match="threshold"):
        ai.qk_clip(aux, 0.0)


# ----------------------------------------------------------------------------- recompute / entropy
@pytest.mark.parametrize("name", every_other(list(CONFIGS), single=True))
def test_recompute_probs_and_entropy(name):
    opts = CONFIGS[name]
    q, k, v = _data(2)
    out, aux = ax.attention(q, k, v, return_probs=True, backend="reference", **opts)
    _, lse64, _, p64, _ = np_attention(q, k, v, **_np_opts(opts))
    np.testing.assert_allclose(aux.lse, lse64, **TOL)  # the oracle agrees with attnaux

    p = ai.recompute_probs(q, k, aux, block_size=4, **opts)  # 13 keys: a ragged last block
    assert p.shape == (2, 4, 7, 13) and p.dtype == jnp.float32
    np.testing.assert_allclose(p, aux.probs, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(p, p64, **TOL)

    h = ai.entropy(q, k, aux, block_size=4, **opts)
    assert h.shape == (2, 4, 7) and h.dtype == jnp.float32
    np.testing.assert_allclose(h, np_entropy(aux.probs), **TOL)
    np.testing.assert_allclose(h, np_entropy(p64), **TOL)
    no_key = ~np.isfinite(np.asarray(aux.max))
    assert np.all(np.asarray(h)[no_key] == 0)


def test_block_visibility_matches_reference_visibility():
    from attnaux.introspect._blockwise import block_visibility, layout, pad_keys
    q, k, v = _data(3)
    for opts in CONFIGS.values():
        problem = canonical_problem(q, k, v, **{n: x for n, x in opts.items()})
        want = visibility(problem.arrays, problem.options)
        lay = layout(13, 5)
        padded = pad_keys(problem.arrays, lay)
        blocks = []
        for n in range(lay.n_blocks):
            j = n * 5 + jnp.arange(5)
            mask = padded.mask
            if mask is not None and mask.shape[-1] != 1:
                mask = mask[..., n * 5:(n + 1) * 5]
            seg = padded.kv_segment_ids
            seg = None if seg is None else seg[:, n * 5:(n + 1) * 5]
            blocks.append(block_visibility(padded, problem.options, j, mask, seg, 13))
        got = jnp.concatenate(blocks, axis=-1)[..., :13]
        np.testing.assert_array_equal(got, want)


def test_entropy_and_probs_jit_vmap():
    q, k, v = _data(4)
    opts = dict(causal=True, softcap=3.0)
    out, aux = ax.attention(q, k, v, return_probs=True, **opts)
    want = np_entropy(aux.probs)
    jitted = jax.jit(lambda q, k, aux: ai.entropy(q, k, aux, block_size=3, **opts))
    np.testing.assert_allclose(jitted(q, k, aux), want, **TOL)
    mapped = jax.vmap(lambda q, k, aux: ai.entropy(q, k, aux, **opts))(q, k, aux)
    np.testing.assert_allclose(mapped, want, **TOL)
    p = jax.jit(jax.vmap(lambda q, k, aux: ai.recompute_probs(q, k, aux, **opts)))(q, k, aux)
    np.testing.assert_allclose(p, aux.probs, atol=1e-6, rtol=1e-6)
    # Unbatched and with several batch dimensions.
    out1, aux1 = ax.attention(q[0], k[0], v[0], **opts)
    np.testing.assert_allclose(ai.entropy(q[0], k[0], aux1, **opts), want[0], **TOL)
    q2, k2, v2 = (x.reshape(1, *x.shape) for x in (q, k, v))
    out2, aux2 = ax.attention(q2, k2, v2, **opts)
    np.testing.assert_allclose(ai.entropy(q2, k2, aux2, **opts), want[None], **TOL)


def _max_intermediate(jaxpr) -> int:
    """The largest number of elements of any value in a (closed) jaxpr, sub-jaxprs included."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in [*eqn.outvars, *eqn.invars]:
            shape = getattr(getattr(var, "aval", None), "shape", ())
            biggest = max(biggest, math.prod(shape))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    biggest = max(biggest, _max_intermediate(getattr(inner, "jaxpr", inner)))
    return biggest


def test_entropy_memory_is_linear_in_sequence_length():
    seq = 1024
    q = jax.ShapeDtypeStruct((1, seq, 1, 16), jnp.float32)
    aux = ax.AttnAux(lse=jax.ShapeDtypeStruct((1, 1, seq), jnp.float32),
                     max=jax.ShapeDtypeStruct((1, 1, seq), jnp.float32))
    jaxpr = jax.make_jaxpr(lambda q, k, aux: ai.entropy(q, k, aux, causal=True, block_size=64))(
        q, q, aux)
    biggest = _max_intermediate(jaxpr.jaxpr)
    assert biggest <= seq * 64, biggest  # one [q_seq, block] tile, never [q_seq, kv_seq]


# ----------------------------------------------------------------------------- attention_vjp
VJP_CONFIGS = ["plain", "causal_gqa_scale", "bottom_right_seqlens_window", "mask_bias_softcap",
               "segments_sink_bias", "rows_bias_window_sink"]


def _fused_vjp(q, k, v, opts, dout, dlse, **extra):
    diff = {n: jnp.asarray(opts[n]) for n in ("bias", "sink") if n in opts}
    rest = {n: x for n, x in opts.items() if n not in diff}

    def f(q, k, v, diff):
        out, aux = ax.attention(q, k, v, **rest, **diff, **extra)
        return out, aux.lse

    (out, lse), vjp = jax.vjp(f, q, k, v, diff)
    return vjp((dout, dlse))


@pytest.mark.parametrize("name", every_other(VJP_CONFIGS, single=True))
def test_attention_vjp_equals_fused_backward(name):
    opts = CONFIGS[name]
    q, k, v = _data(5)
    out, aux = ax.attention(q, k, v, **opts)
    kd, kl = jax.random.split(jax.random.key(6))
    dout = jax.random.normal(kd, out.shape)
    dlse = jax.random.normal(kl, aux.lse.shape)
    dq, dk, dv, ddiff = _fused_vjp(q, k, v, opts, dout, dlse)
    g = ai.attention_vjp(q, k, v, out, aux, dout, dlse, block_size=4, **opts)
    assert isinstance(g, ai.AttnGrads)
    for got, want in ((g.q, dq), (g.k, dk), (g.v, dv)):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, **GTOL)
    if "bias" in opts:
        assert g.bias.shape == np.shape(opts["bias"])
        np.testing.assert_allclose(g.bias, ddiff["bias"], **GTOL)
    else:
        assert g.bias is None
    if "sink" in opts:
        np.testing.assert_allclose(g.sink, ddiff["sink"], **GTOL)
    else:
        assert g.sink is None
    if name != "plain":
        return
    # Without dlse: the gradient of the output alone.
    g0 = ai.attention_vjp(q, k, v, out, aux, dout, **opts)
    dq0 = _fused_vjp(q, k, v, opts, dout, jnp.zeros_like(aux.lse))[0]
    np.testing.assert_allclose(g0.q, dq0, **GTOL)


def test_attention_vjp_jit_vmap_dropout_and_bias_shapes():
    q, k, v = _data(7)
    # A 2-D bias (broadcast over batch and heads), dropout regenerated from aux.rng_state.
    bias = jax.random.normal(jax.random.key(8), (7, 13))
    opts = dict(causal=True, bias=bias, dropout_rate=0.25)
    key = jax.random.key(9)
    out, aux = ax.attention(q, k, v, key=key, **opts)
    dout = jax.random.normal(jax.random.key(10), out.shape)
    dq, dk, dv, ddiff = _fused_vjp(q, k, v, opts, dout, jnp.zeros_like(aux.lse), key=key)
    vjp = jax.jit(lambda q, k, v, out, aux, dout, bias: ai.attention_vjp(
        q, k, v, out, aux, dout, causal=True, bias=bias, dropout_rate=0.25, block_size=5))
    g = vjp(q, k, v, out, aux, dout, bias)
    for got, want in ((g.q, dq), (g.k, dk), (g.v, dv), (g.bias, ddiff["bias"])):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, **GTOL)
    # The block-wise keep-mask is the one of dropout_mask (and of the kernels).
    keep = ai.dropout_mask(aux, q, k, dropout_rate=0.25)
    np.testing.assert_array_equal(keep, dropout_keep_mask(aux.rng_state, 0.25, 2, 4, 7, 13))
    with pytest.raises(ValueError, match="rng_state"):
        ai.attention_vjp(q, k, v, out, ax.attention(q, k, v)[1], dout, dropout_rate=0.25)

    # bfloat16 inputs: gradients in bfloat16, equal to the fused ones up to bfloat16 rounding.
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out, aux = ax.attention(qb, kb, vb, causal=True)
    doutb = dout.astype(jnp.bfloat16)
    want = _fused_vjp(qb, kb, vb, dict(causal=True), doutb, jnp.zeros_like(aux.lse))
    g = ai.attention_vjp(qb, kb, vb, out, aux, doutb, causal=True)
    for got, w in ((g.q, want[0]), (g.k, want[1]), (g.v, want[2])):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(w, np.float32),
                                   atol=3e-2, rtol=3e-2)

    # vmap over the batch axis gives the per-example gradients.
    opts = dict(causal="bottom_right", kv_seqlens=jnp.array([13, 6]))
    out, aux = ax.attention(q, k, v, **opts)
    dq, dk, dv, _ = _fused_vjp(q, k, v, opts, dout, jnp.zeros_like(aux.lse))
    mapped = jax.vmap(lambda q, k, v, out, aux, dout, kl: ai.attention_vjp(
        q, k, v, out, aux, dout, causal="bottom_right", kv_seqlens=kl))(
        q, k, v, out, aux, dout, opts["kv_seqlens"])
    for got, want in ((mapped.q, dq), (mapped.k, dk), (mapped.v, dv)):
        np.testing.assert_allclose(got, want, **GTOL)


def test_attention_vjp_never_reads_padding():
    q, k, v = _data(11)
    kl = jnp.array([9, 13])
    poison = jnp.arange(13)[None, :, None, None] >= kl[:, None, None, None]
    k_bad = jnp.where(poison, jnp.nan, k)
    v_bad = jnp.where(poison, jnp.inf, v)
    out, aux = ax.attention(q, k_bad, v_bad, kv_seqlens=kl, causal=True)
    g = ai.attention_vjp(q, k_bad, v_bad, out, aux, jnp.ones_like(out), kv_seqlens=kl,
                         causal=True, block_size=4)
    for x in (g.q, g.k, g.v):
        assert np.all(np.isfinite(x))


def test_validation_messages():
    q, k, v = _data(12)
    out, aux = ax.attention(q, k, v)
    with pytest.raises(TypeError, match="unexpected keyword.*causall"):
        ai.entropy(q, k, aux, causall=True)
    with pytest.raises(ValueError, match="aux.lse"):
        ai.entropy(q[:, :3], k, aux)
    with pytest.raises(ValueError, match="causal"):
        ai.recompute_probs(q, k, aux, causal="top")
    with pytest.raises(ValueError, match="block_size"):
        ai.entropy(q, k, aux, block_size=0)
    with pytest.raises((TypeError, ValueError), match="dout"):  # jaxtyping's TypeCheckError
        ai.attention_vjp(q, k, v, out, aux, out[:, :2])
    with pytest.raises(ValueError, match="empty"):
        ai.merge([])
    with pytest.raises(ValueError, match="one shape"):
        ai.merge([(out, aux), (out[:, :2], aux)])
    with pytest.raises(ValueError, match="saturation"):
        ai.health(aux, saturation=0.0)


def test_zero_length_sequences():
    for sq, skv in ((3, 0), (0, 4)):
        q, k = jnp.ones((2, sq, 2, 4)), jnp.ones((2, skv, 1, 4))
        out, aux = ax.attention(q, k, k)
        assert ai.recompute_probs(q, k, aux).shape == (2, 2, sq, skv)
        np.testing.assert_array_equal(ai.entropy(q, k, aux), np.zeros((2, 2, sq)))
        g = ai.attention_vjp(q, k, k, out, aux, jnp.ones_like(out))
        assert g.q.shape == q.shape and g.k.shape == k.shape
        assert np.all(np.asarray(g.q) == 0) and np.all(np.asarray(g.k) == 0)
        assert ai.z_loss(aux) == 0
        assert np.all(np.asarray(ai.max_logit(aux)) == -np.inf)


# ----------------------------------------------------------------------------- custom backward
def _docs_block(marker: str) -> str:
    text = DOCS.read_text()
    match = re.search(rf"<!-- test: {marker} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"docs/introspect.md has no block marked {marker}"
    return match.group(1)


def test_custom_backward_example_from_docs():
    namespace: dict = {}
    exec(compile(_docs_block("custom_backward"), str(DOCS), "exec"), namespace)
    clipped_attention = namespace["clipped_attention"]
    max_norm = namespace["MAX_NORM"]
    q, k, v = _data(13, hq=4, hkv=4)
    loss = lambda attn: lambda q, k, v: jnp.sum(attn(q, k, v) ** 2)
    plain = lambda q, k, v: ax.attention(q, k, v, causal=True)[0]
    got = jax.jit(jax.grad(loss(clipped_attention), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w, np.float64)
        norm = np.sqrt(np.sum(w**2, axis=(0, 1, 3)))
        expected = w * np.minimum(1.0, max_norm / norm)[:, None]
        np.testing.assert_allclose(g, expected, **GTOL)
        got_norm = np.sqrt(np.sum(np.asarray(g, np.float64) ** 2, axis=(0, 1, 3)))
        assert np.all(got_norm <= max_norm * (1 + 1e-5))
    assert np.any(np.sqrt(np.sum(np.asarray(want[0]) ** 2, axis=(0, 1, 3))) > max_norm)


# ----------------------------------------------------------------------------- merge
def _split_attention(q, k, v, bounds, *, sink=None, q_seqlens=None):
    """Attention over key blocks [a, b) with a causal mask in global positions.

    Every block is given the same padded length (`kv_seqlens` cuts the ragged last block), and a
    sink only to the first block.
    """
    width = max(b - a for a, b in bounds)
    sq, skv = q.shape[1], k.shape[1]
    parts = []
    for index, (a, b) in enumerate(bounds):
        pad = [(0, 0), (0, width - (b - a)), (0, 0), (0, 0)]
        kb, vb = jnp.pad(k[:, a:b], pad), jnp.pad(v[:, a:b], pad)
        j = a + np.arange(width)
        mask = (j[None, :] <= np.arange(sq)[:, None]) & (j[None, :] < skv)
        parts.append(ax.attention(
            q, kb, vb, mask=mask, kv_seqlens=jnp.full((q.shape[0],), b - a, jnp.int32),
            q_seqlens=q_seqlens, sink=sink if index == 0 else None))
    return parts


@pytest.mark.parametrize("bounds", [
    [(0, 6), (6, 13)],
    [(0, 3), (3, 6), (6, 9), (9, 12), (12, 13)],
])
def test_merge_equals_full_call(bounds):
    q, k, v = _data(14, sq=13, skv=13)
    sink = jnp.array([0.5, -1.0, 0.0, 2.0])
    ql = jnp.array([13, 10])
    for use_sink in (False, True):
        s = sink if use_sink else None
        parts = _split_attention(q, k, v, bounds, sink=s, q_seqlens=ql)
        # Causal: query rows before a block's first key see nothing in it.
        assert np.any(~np.isfinite(np.asarray(parts[-1][1].max[0])))
        out, aux = ai.merge(parts)
        full_out, full_aux = ax.attention(q, k, v, causal=True, q_seqlens=ql, sink=s)
        np.testing.assert_allclose(out, full_out, **GTOL)
        np.testing.assert_allclose(aux.lse, full_aux.lse, **TOL)
        np.testing.assert_array_equal(aux.max, full_aux.max)
        o64, lse64, max64, _, _ = np_attention(q, k, v, causal=True, q_seqlens=ql, sink=s)
        np.testing.assert_allclose(out, o64, **GTOL)
        np.testing.assert_allclose(aux.lse, lse64, **TOL)
        assert aux.probs is None and aux.rng_state is None
        # padding rows: nothing seen anywhere
        assert np.all(np.asarray(out)[1, 10:] == 0)
        if not use_sink:
            assert np.all(np.asarray(aux.lse)[1, :, 10:] == -np.inf)
    # jit, and gradients through merge equal those of the full call.
    merged = jax.jit(ai.merge)(parts)
    np.testing.assert_allclose(merged[0], out, atol=1e-6, rtol=1e-6)

    def loss_split(q):
        out, aux = ai.merge(_split_attention(q, k, v, bounds, q_seqlens=ql))
        return jnp.sum(out**2) + ai.z_loss(aux)

    def loss_full(q):
        out, aux = ax.attention(q, k, v, causal=True, q_seqlens=ql)
        return jnp.sum(out**2) + ai.z_loss(aux)

    np.testing.assert_allclose(jax.grad(loss_split)(q), jax.grad(loss_full)(q), **GTOL)


def test_merge_vmap_and_single_block():
    q, k, v = _data(15)
    out, aux = ax.attention(q, k, v)
    one = ai.merge([(out, aux)])
    np.testing.assert_allclose(one[0], out, atol=1e-6)
    np.testing.assert_allclose(one[1].lse, aux.lse, atol=1e-6)
    parts = [ax.attention(q, k[:, :5], v[:, :5]), ax.attention(q, k[:, 5:], v[:, 5:])]
    mapped = jax.vmap(lambda a, b: ai.merge([a, b]))(*parts)
    np.testing.assert_allclose(mapped[0], out, **GTOL)
    np.testing.assert_allclose(mapped[1].lse, aux.lse, **TOL)


# ----------------------------------------------------------------------------- z-loss
def test_z_loss_value_and_gradient():
    q, k, v = _data(16)
    mask = np.ones((2, 4, 7, 13), bool)
    mask[1, 2, 4] = False
    sink = jnp.array([0.2, -0.3, 1.0, 0.0])
    opts = dict(causal="bottom_right", q_seqlens=jnp.array([7, 5]), mask=mask)
    _, aux = ax.attention(q, k, v, sink=sink, **opts)
    _, lse64, max64, _, _ = np_attention(q, k, v, sink=sink, **_np_opts(opts))
    rows = np.isfinite(max64)
    assert not rows.all()
    np.testing.assert_allclose(ai.z_loss(aux), np.mean(lse64[rows] ** 2), **TOL)
    np.testing.assert_allclose(jax.jit(ai.z_loss)(aux), np.mean(lse64[rows] ** 2), **TOL)
    per = jax.vmap(ai.z_loss)(aux)
    np.testing.assert_allclose(per, [np.mean(lse64[b][rows[b]] ** 2) for b in range(2)], **TOL)
    empty = ax.AttnAux(lse=jnp.full((1, 2, 3), -jnp.inf), max=jnp.full((1, 2, 3), -jnp.inf))
    assert ai.z_loss(empty) == 0

    fused = "flash" if ax.explain(q, k, v, **opts).backend == "flash" else "reference"

    def loss(q, k, sink, backend):
        _, aux = ax.attention(q, k, v, sink=sink, backend=backend, **opts)
        return ai.z_loss(aux)

    g_fused = jax.grad(loss, argnums=(0, 1, 2))(q, k, sink, fused)
    g_ref = jax.grad(loss, argnums=(0, 1, 2))(q, k, sink, "reference")
    for a, b in zip(g_fused, g_ref, strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, **GTOL)
    # ... and equals attention_vjp with the z-loss's lse cotangent.
    out, aux = ax.attention(q, k, v, sink=sink, **opts)
    dlse = jax.grad(ai.z_loss)(aux).lse
    g = ai.attention_vjp(q, k, v, out, aux, jnp.zeros_like(out), dlse, sink=sink, **opts)
    np.testing.assert_allclose(g.q, g_ref[0], **GTOL)
    np.testing.assert_allclose(g.sink, g_ref[2], **GTOL)


# ----------------------------------------------------------------------------- health
def test_health_counts_against_numpy():
    inf, nan = np.inf, np.nan
    # [batch=1, heads=3, q_seq=5]
    lse = np.array([[[2.0, -inf, 0.3, 5.0, nan],
                     [1.0, 1.0, inf, -inf, 0.7],
                     [0.5, 0.5, 0.5, 0.5, 0.5]]], np.float32)
    mx = np.array([[[1.0, -inf, -inf, 4.999, 1.0],
                    [0.0, 1.0, 0.0, 1.0, -inf],
                    [-0.5, 0.499, 0.0, 0.2, 0.3]]], np.float32)
    aux = ax.AttnAux(lse=jnp.asarray(lse), max=jnp.asarray(mx))
    rep = ai.health(aux, saturation=0.01)
    assert isinstance(rep, ai.HealthReport) and isinstance(rep, eqx.Module)
    np.testing.assert_array_equal(rep.rows, [5, 5, 5])
    # masked: max = -inf with lse -inf or finite (sink): head0 rows 1, 2; head1 row 4
    np.testing.assert_array_equal(rep.masked, [2, 1, 0])
    # nonfinite: head0 row 4 (NaN lse); head1 row 2 (+inf lse), row 3 (finite max, lse -inf)
    np.testing.assert_array_equal(rep.nonfinite, [1, 2, 0])
    # saturated: lse - max < 0.01: head0 row 3 (0.001); head1 row 1 (0); head2 row 1 (0.001)
    np.testing.assert_array_equal(rep.saturated, [1, 1, 1])
    np.testing.assert_allclose(rep.max_logit, [4.999, 1.0, 0.499], **TOL)
    np.testing.assert_allclose(rep.mean_max_logit, [(1 + 4.999) / 2, 0.5, np.mean(mx[0, 2])],
                               **TOL)
    np.testing.assert_allclose(rep.mean_lse, [3.5, 1.0, 0.5], **TOL)
    assert rep.mean_entropy is None
    np.testing.assert_array_equal(jax.jit(ai.health)(aux).saturated, rep.saturated)

    # With probabilities: mean entropy over rows that see a key.
    q, k, v = _data(17)
    opts = dict(causal=True, q_seqlens=jnp.array([7, 3]))
    out, aux = ax.attention(q, k, v, return_probs=True, **opts)
    _, lse64, max64, p64, _ = np_attention(q, k, v, **_np_opts(opts))
    rep = ai.health(aux)
    ent = np_entropy(p64)
    seen = np.isfinite(max64)
    want_ent = [ent[:, h][seen[:, h]].mean() for h in range(4)]
    np.testing.assert_allclose(rep.mean_entropy, want_ent, **TOL)
    np.testing.assert_array_equal(rep.masked, [4, 4, 4, 4])
    np.testing.assert_array_equal(rep.nonfinite, [0, 0, 0, 0])
    gap = np.where(seen, lse64, 0.0) - np.where(seen, max64, 0.0)  # (rows seeing nothing: 0)
    want_sat = [np.sum((gap[:, h] < 0.01) & seen[:, h]) for h in range(4)]
    np.testing.assert_array_equal(rep.saturated, want_sat)
    assert min(want_sat) >= 2  # causal row 0 sees one key in each batch element
    mapped = jax.vmap(ai.health)(aux)
    assert mapped.masked.shape == (2, 4)
    np.testing.assert_array_equal(mapped.masked.sum(0), rep.masked)


# ----------------------------------------------------------------------------- save / load / plot
def test_save_load_round_trip(tmp_path):
    q, k, v = _data(18)
    _, a0 = ax.attention(q, k, v, return_probs=True, causal=True)
    _, a1 = ax.attention(q, k, v, dropout_rate=0.1, key=jax.random.key(0))
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    _, a2 = ax.attention(qb, kb, vb, return_probs=True)
    a3 = ax.AttnAux(lse=jnp.zeros((3, 2)), max=jnp.zeros((3, 2)), backend="flash")
    collection = {"layer0": a0, "layer 1/dropout": a1, "bf16": a2, "unbatched": a3}
    path = tmp_path / "aux.npz"
    ai.save(path, collection)
    loaded = ai.load(path)
    assert list(loaded) == list(collection)
    for name, want in collection.items():
        got = loaded[name]
        assert isinstance(got, ax.AttnAux) and got.backend == want.backend
        for field in ("lse", "max", "probs", "rng_state"):
            w, g = getattr(want, field), getattr(got, field)
            if w is None:
                assert g is None, (name, field)
            else:
                assert g.dtype == w.dtype and g.shape == w.shape, (name, field)
                np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(w, np.float64))
    assert loaded["bf16"].probs.dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="mapping"):
        ai.save(path, a0)
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not an aux collection"):
        ai.load(tmp_path / "other.npz")


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install "
                        "attnaux[plot]); plot() cannot draw without it")
    q, k, v = _data(19)
    _, a0 = ax.attention(q, k, v, return_probs=True, causal=True)
    _, a1 = ax.attention(q[..., :2, :], k[..., :1, :], v[..., :1, :])  # fewer heads
    for target in ({"l0": a0, "l1": a1}, ai.health(a0), {"l0": ai.health(a0)}):
        path = tmp_path / "heads.png"
        ai.plot(target, path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        path.unlink()
    with pytest.raises(ValueError, match="metrics"):
        ai.plot(a0, tmp_path / "x.png", metrics=("nope",))


def test_plot_refuses_an_extension_it_does_not_write_before_any_work(monkeypatch, tmp_path):
    # No matplotlib and not even a report: the path is checked first, with a clear message.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for name in ("heads.jpg", "heads", "heads.png.txt"):
        with pytest.raises(ValueError, match=re.escape(name)) as error:
            ai.plot("not a report", tmp_path / name)
        assert all(ext in str(error.value) for ext in (".png", ".svg", ".pdf"))
        assert not (tmp_path / name).exists()


def test_plot_writes_the_format_its_extension_names(tmp_path):
    pytest.importorskip("matplotlib", reason="plot() cannot draw without matplotlib")
    aux = ax.AttnAux(lse=jnp.zeros((1, 2, 3)), max=jnp.zeros((1, 2, 3)))
    for name, magic in (("h.PNG", b"\x89PNG"), ("h.svg", b"<?xml"), ("h.pdf", b"%PDF")):
        ai.plot(aux, tmp_path / name)
        assert (tmp_path / name).read_bytes().startswith(magic), name


def test_plot_has_a_title_the_clip_threshold_and_defines_what_it_shows(monkeypatch, tmp_path):
    """The figure reads on its own: a title; the QK-clip threshold marked on the max logit panel
    (heads above it outlined); "saturated" defined; no colour bar on a panel whose value is the
    same everywhere (no non-finite rows); "n/a" where a layer has no probabilities."""
    pytest.importorskip("matplotlib", reason="plot() cannot draw without matplotlib")
    import matplotlib.figure
    import matplotlib.patches
    import matplotlib.text

    figures = []
    savefig = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    q, k, v = _data(19)
    _, a0 = ax.attention(q, k, v, return_probs=True, causal=True)
    _, a1 = ax.attention(q[..., :2, :], k[..., :1, :], v[..., :1, :])  # no probs, fewer heads
    reports = {"l0": ai.health(a0), "l1": ai.health(a1)}
    logits = np.concatenate([np.asarray(r.max_logit) for r in reports.values()])
    threshold = float(np.median(logits))
    above = int(np.sum(logits > threshold))
    assert 0 < above < logits.size
    saturated = np.concatenate([np.asarray(r.saturated) / np.asarray(r.rows)
                                for r in reports.values()])
    assert np.ptp(saturated) > 0 and all(int(np.sum(r.nonfinite)) == 0 for r in reports.values())
    path = tmp_path / "heads.png"
    ai.plot({"l0": a0, "l1": a1}, path, clip_threshold=threshold)
    assert path.read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    assert "Attention health per head" in texts
    panels = {a.get_title().splitlines()[0]: a for a in fig.axes
              if a.get_label() != "<colorbar>" and a.get_title()}
    assert len(panels) == 5, list(panels)
    colorbars = [a for a in fig.axes if a.get_label() == "<colorbar>"]
    assert len(colorbars) == 4  # none on the non-finite panel, which is 0 everywhere
    (nonfinite,) = [t for t in panels if t.startswith("non-finite rows")]
    assert nonfinite.endswith("0 in every head")

    max_panel = panels["max logit"]
    assert f"QK-clip threshold {threshold:g}" in max_panel.get_title()
    assert f"{above} of {logits.size} heads above" in max_panel.get_title()
    outlines = [p for p in max_panel.patches if isinstance(p, matplotlib.patches.Rectangle)
                and p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)]
    assert len(outlines) == above
    assert "lse - max < 0.01" in panels["saturated rows (fraction)"].get_title()

    entropy = panels["mean entropy (nats)"]
    cells = [t.get_text() for t in entropy.texts]
    assert cells.count("n/a") == 2 and "nan" not in cells  # layer l1: 2 heads, no probs
    assert "return_probs" in entropy.get_title()

    figures.clear()
    ai.plot(reports, path, title="after 10 steps")
    assert "after 10 steps" in [t.get_text() for t in figures[0].findobj(matplotlib.text.Text)]
    with pytest.raises(ValueError, match="clip_threshold"):
        ai.plot(reports, path, clip_threshold=float("nan"))


def test_aux_docstring_says_probs_is_filled_exactly_with_return_probs():
    doc = " ".join(ax.AttnAux.__doc__.split())
    probs = doc.split("- `probs`:")[1].split("- `rng_state`")[0]
    assert "return_probs=True" in probs and "backend that ran does not save" not in probs


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    aux = ax.AttnAux(lse=jnp.zeros((1, 2, 3)), max=jnp.zeros((1, 2, 3)))
    with pytest.raises(ImportError, match=re.escape("pip install attnaux[plot]")):
        ai.plot(aux, tmp_path / "x.png")


def _subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def test_cli_report(tmp_path):
    aux = ax.AttnAux(lse=jnp.array([[[1.0, -jnp.inf, jnp.nan]]]),
                     max=jnp.array([[[0.5, -jnp.inf, 0.0]]]))
    path = tmp_path / "collection.npz"
    ai.save(path, {"attn.0": aux, "attn.1": aux})
    png = tmp_path / "out.png"
    have_mpl = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        have_mpl = False
    args = [sys.executable, "-m", "attnaux.introspect", "report", str(path)]
    args += ["--png", str(png)] if have_mpl else ["--no-png"]
    result = subprocess.run(args, capture_output=True, text=True, env=_subprocess_env(),
                            timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split()[:2] == ["attn.0", "0"] for line in lines if line.strip())
    assert any(line.split()[:2] == ["attn.1", "0"] for line in lines if line.strip())
    assert "nonfinite" in result.stdout and "WARNING" in result.stdout
    if have_mpl:
        assert png.read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run([sys.executable, "-m", "attnaux.introspect", "report",
                          str(tmp_path / "missing.npz")], capture_output=True, text=True,
                         env=_subprocess_env(), timeout=300)
    assert bad.returncode == 2 and "does not exist" in bad.stderr


# ----------------------------------------------------------------------------- end to end
class _Layer(eqx.Module):
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array

    def __init__(self, key, d_model=16, heads=4, kv_heads=2, head_dim=8):
        kq, kk, kv, ko = jax.random.split(key, 4)
        s = 1 / math.sqrt(d_model)
        self.wq = jax.random.normal(kq, (d_model, heads, head_dim)) * s
        self.wk = jax.random.normal(kk, (d_model, kv_heads, head_dim)) * s
        self.wv = jax.random.normal(kv, (d_model, kv_heads, head_dim)) * s
        self.wo = jax.random.normal(ko, (heads, head_dim, d_model)) * s / math.sqrt(heads)

    def __call__(self, x, q_seqlens):
        q = jnp.einsum("bsd,dhe->bshe", x, self.wq)
        k = jnp.einsum("bsd,dhe->bshe", x, self.wk)
        v = jnp.einsum("bsd,dhe->bshe", x, self.wv)
        out, aux = ax.attention(q, k, v, causal=True, q_seqlens=q_seqlens, kv_seqlens=q_seqlens)
        return x + jnp.einsum("bshe,hed->bsd", out, self.wo), aux


def test_end_to_end_training_with_z_loss_save_load_report(tmp_path):
    keys = jax.random.split(jax.random.key(20), 4)
    model = [_Layer(keys[0]), _Layer(keys[1])]
    x = jax.random.normal(keys[2], (2, 12, 16)) * 2.0
    y = jax.random.normal(keys[3], (2, 12, 16))
    lengths = jnp.array([12, 9])

    def forward(model, x):
        auxes = {}
        for i, layer in enumerate(model):
            x, auxes[f"layer{i}"] = layer(x, lengths)
        return x, auxes

    def loss_fn(model):
        h, auxes = forward(model, x)
        z = sum(ai.z_loss(a) for a in auxes.values())
        return jnp.mean((h - y) ** 2) + 0.01 * z, z

    @jax.jit
    def step(model):
        (loss, z), grads = jax.value_and_grad(loss_fn, has_aux=True)(model)
        model = jax.tree.map(lambda p, g: p - 0.02 * g, model, grads)
        return model, loss, z

    zs = []
    for _ in range(4):
        model, loss, z = step(model)
        assert np.isfinite(loss)
        zs.append(float(z))
    assert zs[-1] < zs[0]  # the z-loss term (initially large: lse ~ 7) is being minimised

    _, auxes = jax.jit(forward)(model, x)
    path = tmp_path / "train.npz"
    ai.save(path, auxes)
    loaded = ai.load(path)
    assert list(loaded) == ["layer0", "layer1"]
    reports = {name: ai.health(a) for name, a in loaded.items()}
    for name, rep in reports.items():
        np.testing.assert_array_equal(rep.rows, [24] * 4)
        np.testing.assert_array_equal(rep.masked, [3] * 4)  # the 3 padding rows
        np.testing.assert_array_equal(rep.nonfinite, [0] * 4)
        np.testing.assert_allclose(rep.max_logit, ai.max_logit(auxes[name]))
    from attnaux.introspect.__main__ import main

    assert main(["report", str(path), "--no-png"]) == 0
    table = ai.HealthReport.table_of(reports)
    assert table.count("layer0") == 4 and table.count("layer1") == 4


def test_health_report_prints_its_table():
    """`print(report)` / `report.table()` give the per-head table through the public API, the
    same rows as a collection's table."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 6, 3, 4)) for i in range(3))
    _, aux = ax.attention(q, k, v, causal=True)
    report = ai.health(aux)
    lines = str(report).splitlines()
    assert lines[0].split()[:3] == ["layer", "head", "rows"]
    assert len(lines) == 2 + 3  # header, rule, one line per head
    assert report.table(name="attn").splitlines()[2].startswith("attn")
    assert ai.HealthReport.table_of({"aux": report}) == str(report)
    assert all(line.split()[2] == "12" for line in lines[2:])  # 2 batches x 6 rows per head
