"""Bad input gets a `ValueError`/`TypeError` whose message names the argument.

Every case runs three ways:

- through the undecorated `attnaux.attention.__wrapped__` (what runs with jaxtyping off): the
  explicit checks in `_canon.py` / `_dispatch.py` must raise, with a message naming the argument,
  what was expected and what came;
- through `attnaux._internal.canonical_problem` directly (for the cases that are its job),
  and through `attnaux.explain`, which validates the same way;
- through the public `attnaux.attention`, where jaxtyping + beartype see some of the mistakes
  first and raise a `jaxtyping.TypeCheckError` (a `TypeError`) that names the parameter.

The compiled handler re-checks its inputs: calling the FFI target directly with inconsistent
shapes must give an error naming the argument, never a crash (run in a subprocess so that a crash
fails the test instead of killing the session).
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import attnaux
from attnaux import _ffi, _internal

HAS_FLASH = _ffi.has_target("attnaux_flash_fwd", "cpu")
requires_flash = pytest.mark.skipif(
    not HAS_FLASH, reason="the compiled flash kernel is not registered for cpu"
)

B, SQ, SKV, HQ, HKV, D, DV = 2, 5, 6, 4, 2, 8, 3


def _qkv(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, SQ, HQ, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, SKV, HKV, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, SKV, HKV, DV)), dtype)
    return q, k, v


Q, K, V = _qkv()
KEY = jax.random.key(0)


class Case:
    """One bad call.

    `call(fn)` makes the call through `fn` (one of the entry points); `exc`/`match` are what the
    explicit checks must raise; `param` is the parameter jaxtyping rejects first on the public
    path (None when jaxtyping cannot see the mistake and the explicit check must fire there too);
    `canon` says whether the canonical form (`_internal.canonical_problem`) is responsible for
    the check.
    """

    def __init__(self, id, call, exc, match, param=None, canon=True):
        self.id, self.call, self.exc, self.match, self.param, self.canon = (
            id, call, exc, match, param, canon
        )


def _kw(**kwargs):
    return lambda fn: fn(Q, K, V, **kwargs)


def _args(q, k, v, **kwargs):
    return lambda fn: fn(q, k, v, **kwargs)


def _jit_scale(fn):
    return jax.jit(lambda s: fn(Q, K, V, scale=s))(0.5)


def _jit_softcap(fn):
    return jax.jit(lambda s: fn(Q, K, V, softcap=s))(0.5)


F32 = jnp.float32
CASES = [
    # --- ranks and shapes of q, k, v -----------------------------------------------------------
    Case("q_rank2", _args(jnp.zeros((SQ, D)), K, V), ValueError,
         r"`q` must have shape \[\*batch, seq, heads, dim\].*got shape \(5, 8\)", "q"),
    Case("k_rank_mismatch", _args(Q, K[0], V), ValueError,
         r"`q`, `k` and `v` must have the same number of dimensions.*k: \(6, 2, 8\)", "k"),
    Case("v_rank_mismatch", _args(Q, K, V[None]), ValueError,
         r"`q`, `k` and `v` must have the same number of dimensions.*v: \(1, 2, 6, 2, 3\)", "v"),
    Case("head_dim_differs", _args(Q, jnp.zeros((B, SKV, HKV, D + 1)), V), ValueError,
         r"`k` must have the same head dimension.*8.*k\.shape=\(2, 6, 2, 9\)", "k"),
    Case("v_seq_differs", _args(Q, K, jnp.zeros((B, SKV + 1, HKV, DV))), ValueError,
         r"`v` must have shape \[\*batch, kv_seq=6, kv_heads=2, v_dim\].*\(2, 7, 2, 3\)", "v"),
    Case("v_heads_differ", _args(Q, K, jnp.zeros((B, SKV, HKV * 2, DV))), ValueError,
         r"`v` must have shape .*kv_heads=2.*\(2, 6, 4, 3\)", "v"),
    Case("kv_heads_not_dividing",
         _args(Q, jnp.zeros((B, SKV, 3, D)), jnp.zeros((B, SKV, 3, DV))), ValueError,
         r"multiple of the number of key/value heads.*q_heads=4.*kv_heads=3", None),
    Case("kv_heads_zero",
         _args(Q, jnp.zeros((B, SKV, 0, D)), jnp.zeros((B, SKV, 0, DV))), ValueError,
         r"multiple of the number of key/value heads.*kv_heads=0", None),
    Case("batch_differs", _args(Q, K[:1], V[:1]), ValueError,
         r"same batch dimensions.*q batch \(2,\).*k batch \(1,\)", "k"),
    Case("batch_differs_v", _args(Q, K, V[:1]), ValueError,
         r"same batch dimensions.*v batch \(1,\)", "v"),
    Case("q_not_array", _args(Q.tolist(), K, V), TypeError,
         r"`q` must be a JAX or NumPy array; got .*list", "q"),
    # --- dtypes of q, k, v ---------------------------------------------------------------------
    Case("q_int", _args(Q.astype(jnp.int32), K, V), TypeError,
         r"`q` must have a floating dtype.*got int32", "q"),
    Case("v_bool", _args(Q, K, V > 0), TypeError,
         r"`v` must have a floating dtype.*got bool", "v"),
    Case("dtype_mismatch", _args(Q.astype(jnp.bfloat16), K, V), TypeError,
         r"`q`, `k` and `v` must share one dtype; got q: bfloat16, k: float32, v: float32", None),
    Case("dtype_mismatch_v", _args(Q, K, V.astype(jnp.float16)), TypeError,
         r"must share one dtype.*v: float16", None),
    # --- mask ----------------------------------------------------------------------------------
    Case("mask_int", _kw(mask=jnp.ones((SQ, SKV), jnp.int32)), TypeError,
         r"`mask` must be a boolean array.*got dtype int32 with shape \(5, 6\)", "mask"),
    Case("mask_float", _kw(mask=jnp.ones((B, HQ, SQ, SKV))), TypeError,
         r"`mask` must be a boolean array.*got dtype float32", "mask"),
    Case("mask_not_broadcast", _kw(mask=jnp.ones((SQ, SKV + 1), bool)), ValueError,
         r"`mask` of shape \(5, 7\) does not broadcast to .*\(2, 4, 5, 6\)", "mask"),
    Case("mask_heads_not_broadcast", _kw(mask=jnp.ones((3, SQ, SKV), bool)), ValueError,
         r"`mask` of shape \(3, 5, 6\) does not broadcast", "mask"),
    Case("mask_batch_not_broadcast", _kw(mask=jnp.ones((3, 1, SQ, SKV), bool)), ValueError,
         r"`mask` of shape \(3, 1, 5, 6\) does not broadcast", "mask"),
    Case("mask_rank1_wrong", _kw(mask=jnp.ones((SKV + 1,), bool)), ValueError,
         r"`mask` of shape \(7,\) does not broadcast to .*kv_seq=6", "mask"),
    Case("mask_rank5", _kw(mask=jnp.ones((1, B, HQ, SQ, SKV), bool)), ValueError,
         r"`mask` must broadcast to .* at most 4 dimensions; got shape \(1, 2, 4, 5, 6\)",
         "mask"),
    # --- bias ----------------------------------------------------------------------------------
    Case("bias_not_broadcast", _kw(bias=jnp.zeros((B, HQ, SQ, SKV + 1))), ValueError,
         r"`bias` of shape \(2, 4, 5, 7\) does not broadcast to .*\(2, 4, 5, 6\)", "bias"),
    Case("bias_q_seq_wrong", _kw(bias=jnp.zeros((SQ + 2, SKV))), ValueError,
         r"`bias` of shape \(7, 6\) does not broadcast", "bias"),
    Case("bias_batch_wrong", _kw(bias=jnp.zeros((3, 1, SQ, SKV))), ValueError,
         r"`bias` of shape \(3, 1, 5, 6\) does not broadcast", "bias"),
    Case("bias_int", _kw(bias=jnp.zeros((SQ, SKV), jnp.int32)), TypeError,
         r"`bias` must have a floating dtype.*got int32", "bias"),
    # --- sequence lengths ----------------------------------------------------------------------
    Case("q_seqlens_float", _kw(q_seqlens=jnp.array([3.0, 5.0])), TypeError,
         r"`q_seqlens` must have an integer dtype; got float32 with shape \(2,\)", "q_seqlens"),
    Case("kv_seqlens_float", _kw(kv_seqlens=np.array([3.0, 5.0])), TypeError,
         r"`kv_seqlens` must have an integer dtype; got float", "kv_seqlens"),
    Case("kv_seqlens_shape", _kw(kv_seqlens=jnp.array([3, 5, 6])), ValueError,
         r"`kv_seqlens` must have shape \[\*batch\] = \(2,\).*got shape \(3,\)", "kv_seqlens"),
    Case("q_seqlens_scalar", _kw(q_seqlens=jnp.array(3)), ValueError,
         r"`q_seqlens` must have shape \[\*batch\] = \(2,\).*got shape \(\)", "q_seqlens"),
    Case("q_seqlens_list", _kw(q_seqlens=[3, 5]), TypeError,
         r"`q_seqlens` must be a JAX or NumPy array", "q_seqlens"),
    # --- segment ids ---------------------------------------------------------------------------
    Case("q_segment_ids_shape",
         _kw(q_segment_ids=jnp.zeros((B, SQ - 1), int), kv_segment_ids=jnp.zeros((B, SKV), int)),
         ValueError, r"`q_segment_ids` must have shape \[\*batch, q_seq\] = \(2, 5\); got shape "
         r"\(2, 4\)", "q_segment_ids"),
    Case("kv_segment_ids_shape",
         _kw(q_segment_ids=jnp.zeros((B, SQ), int), kv_segment_ids=jnp.zeros((B, SQ), int)),
         ValueError, r"`kv_segment_ids` must have shape \[\*batch, kv_seq\] = \(2, 6\); got "
         r"shape \(2, 5\)", "kv_segment_ids"),
    Case("segment_ids_unbatched",
         _kw(q_segment_ids=jnp.zeros((SQ,), int), kv_segment_ids=jnp.zeros((SKV,), int)),
         ValueError, r"`q_segment_ids` must have shape .*\(2, 5\); got shape \(5,\)",
         "q_segment_ids"),
    Case("segment_ids_float",
         _kw(q_segment_ids=jnp.zeros((B, SQ)), kv_segment_ids=jnp.zeros((B, SKV), int)),
         TypeError, r"`q_segment_ids` must have an integer dtype; got float32", "q_segment_ids"),
    Case("only_q_segment_ids_lengths_differ", _kw(q_segment_ids=jnp.zeros((B, SQ), int)),
         ValueError, r"Only `q_segment_ids` was given.*q_seq=5.*kv_seq=6.*pass both", None),
    # --- window, causal, backend ---------------------------------------------------------------
    Case("window_negative_left", _kw(window=(-1, 2)), ValueError,
         r"`window` sizes must be >= 0.*left=-1", None),
    Case("window_negative_right", _kw(window=(0, -3)), ValueError,
         r"`window` sizes must be >= 0.*right=-3", None),
    Case("window_three", _kw(window=(1, 2, 3)), ValueError,
         r"`window` must be None or a pair \(left, right\).*\(1, 2, 3\)", "window"),
    Case("window_float", _kw(window=(1.5, 2)), TypeError,
         r"`window` left size must be an int >= 0 or None; got 1\.5", "window"),
    Case("causal_unknown_str", _kw(causal="bottom-right"), ValueError,
         r"`causal` must be one of False, True .*'top_left' or 'bottom_right'; got "
         r"'bottom-right'", None),
    Case("causal_int", _kw(causal=2), ValueError,
         r"`causal` must be one of .*; got 2", "causal"),
    Case("backend_unknown", _kw(backend="fast"), ValueError,
         r"`backend` must be one of 'auto', 'flash', 'probs', 'small_seq', 'reference'; got "
         r"'fast'", None, canon=False),
    Case("backend_not_str", _kw(backend=None), ValueError,
         r"`backend` must be one of .*; got None", "backend", canon=False),
    # small_seq serves q_seq == 1 only (q_seq is 5 here)
    Case("backend_small_seq", _kw(backend="small_seq"), ValueError,
         r"backend='small_seq' cannot serve this call: .*q_seq", None, canon=False),
    Case("return_probs_flash", _kw(return_probs=True, backend="flash"), ValueError,
         r"backend='flash' cannot serve this call: .*probabilities.*return_probs=True", None,
         canon=False),
    Case("return_probs_not_bool", _kw(return_probs=1), TypeError,
         r"`return_probs` must be a bool; got 1", "return_probs", canon=False),
    # --- scale, softcap ------------------------------------------------------------------------
    Case("scale_traced", _jit_scale, TypeError,
         r"`scale` must be a static Python float.*traced", None),
    Case("scale_str", _kw(scale="0.5"), TypeError, r"`scale` must be a Python float; got '0.5'",
         "scale"),
    Case("scale_inf", _kw(scale=float("inf")), ValueError, r"`scale` must be finite; got inf",
         None),
    Case("softcap_zero", _kw(softcap=0.0), ValueError,
         r"`softcap` must be a positive float or None; got 0\.0", None),
    Case("softcap_negative", _kw(softcap=-2.0), ValueError,
         r"`softcap` must be a positive float or None; got -2\.0", None),
    Case("softcap_traced", _jit_softcap, TypeError, r"`softcap` must be a static Python float",
         None),
    # --- sink ----------------------------------------------------------------------------------
    Case("sink_wrong_length", _kw(sink=jnp.zeros((HQ - 1,))), ValueError,
         r"`sink` must have shape \[q_heads\] = \(4,\).*got shape \(3,\)", "sink"),
    Case("sink_kv_heads", _kw(sink=jnp.zeros((HKV,))), ValueError,
         r"`sink` must have shape \[q_heads\] = \(4,\).*got shape \(2,\)", "sink"),
    Case("sink_2d", _kw(sink=jnp.zeros((1, HQ))), ValueError,
         r"`sink` must have shape \[q_heads\].*got shape \(1, 4\)", "sink"),
    Case("sink_int", _kw(sink=jnp.zeros((HQ,), jnp.int32)), TypeError,
         r"`sink` must have a floating dtype.*got int32", "sink"),
    # --- dropout and key -----------------------------------------------------------------------
    Case("dropout_one", _kw(dropout_rate=1.0, key=KEY), ValueError,
         r"`dropout_rate` must be in \[0, 1\); got 1\.0", None),
    Case("dropout_negative", _kw(dropout_rate=-0.1, key=KEY), ValueError,
         r"`dropout_rate` must be in \[0, 1\); got -0\.1", None),
    Case("dropout_large", _kw(dropout_rate=1.5, key=KEY), ValueError,
         r"`dropout_rate` must be in \[0, 1\); got 1\.5", None),
    Case("dropout_nan", _kw(dropout_rate=float("nan"), key=KEY), ValueError,
         r"`dropout_rate` must be finite", None),
    Case("dropout_without_key", _kw(dropout_rate=0.1), ValueError,
         r"`dropout_rate=0\.1` needs a PRNG key.*key=jax\.random\.key", None),
    Case("key_float_array", _kw(dropout_rate=0.1, key=jnp.zeros((3,))), TypeError,
         r"`key` must be a single JAX PRNG key.*shape \(3,\).*float32", "key"),
    Case("key_batch_of_keys", _kw(dropout_rate=0.1, key=jax.random.split(KEY, 2)), TypeError,
         r"`key` must be a single JAX PRNG key.*shape \(2,\)", "key"),
    Case("key_python_int", _kw(dropout_rate=0.1, key=0), TypeError,
         r"`key` must be a single JAX PRNG key", "key"),
    Case("key_uint32_wrong_length", _kw(dropout_rate=0.1, key=jnp.zeros((4,), jnp.uint32)),
         TypeError, r"`key` must be a single JAX PRNG key.*shape \(4,\).*uint32", None),
    Case("key_bad_without_dropout", _kw(key=jnp.zeros((3,))), TypeError,
         r"`key` must be a single JAX PRNG key", "key"),
]
IDS = [c.id for c in CASES]

UNCHECKED = attnaux.attention.__wrapped__


def test_unchecked_entry_point_is_the_undecorated_function():
    assert UNCHECKED is not attnaux.attention
    assert UNCHECKED.__name__ == "attention"
    out, aux = UNCHECKED(Q, K, V)  # the good call works without jaxtyping
    assert out.shape == (B, SQ, HQ, DV) and aux.lse.shape == (B, HQ, SQ)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_explicit_check_without_jaxtyping(case):
    """With jaxtyping out of the way, the explicit checks name the argument and what came."""
    with pytest.raises(case.exc, match=case.match) as info:
        case.call(UNCHECKED)
    assert not isinstance(info.value, jaxtyping.TypeCheckError)


CANON_CASES = [c for c in CASES if c.canon]


@pytest.mark.parametrize("case", CANON_CASES, ids=[c.id for c in CANON_CASES])
def test_canonicalize_checks(case):
    with pytest.raises(case.exc, match=case.match):
        case.call(_internal.canonical_problem)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_public_entry_point(case):
    """Through `attnaux.attention`: every mistake is the same one short sentence as without
    jaxtyping; where jaxtyping saw it first, its full report (naming the parameter) is the
    cause."""
    with pytest.raises(case.exc, match=case.match) as info:
        case.call(attnaux.attention)
    assert not isinstance(info.value, jaxtyping.TypeCheckError)
    assert len(str(info.value).splitlines()) <= 2, str(info.value)
    if case.param is not None and not jaxtyping.config.jaxtyping_disable:
        cause = info.value.__cause__
        assert isinstance(cause, jaxtyping.TypeCheckError), repr(cause)
        assert f"parameter '{case.param}'" in str(cause)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_explain_validates_the_same_way(case):
    """`explain` takes the arguments of `attention` and rejects the same mistakes."""
    with pytest.raises(case.exc, match=case.match):
        case.call(attnaux.explain)


def test_shape_error_is_short_with_jaxtypings_report_as_cause():
    """A shape mismatch jaxtyping sees comes out as one sentence naming the argument, the
    expected shape with its bound sizes and what came; jaxtyping's report is the cause."""
    if jaxtyping.config.jaxtyping_disable:
        pytest.skip("jaxtyping checking is disabled (JAXTYPING_DISABLE)")
    k_bad = jnp.zeros((B, SKV, HKV, D + 1))
    with pytest.raises(ValueError) as info:
        attnaux.attention(Q, k_bad, V)
    message = str(info.value)
    assert message.startswith("`k` must have the same head dimension"), message
    assert "8" in message and "(2, 6, 2, 9)" in message  # expected and what came
    cause = info.value.__cause__
    assert isinstance(cause, jaxtyping.TypeCheckError)
    assert "parameter 'k'" in str(cause) and "f32[2,6,2,9]" in str(cause)
    v_bad = jnp.zeros((B, SKV + 1, HKV, DV))
    with pytest.raises(ValueError, match=r"`v` must have shape \[\*batch, kv_seq=6, kv_heads=2"):
        attnaux.attention(Q, K, v_bad)
    with pytest.raises(TypeError, match=r"`q` must have a floating dtype.*int32"):
        attnaux.attention(Q.astype(jnp.int32), K, V)
    with pytest.raises(ValueError, match=r"`mask` of shape \(5, 7\) .*q_seq=5, kv_seq=6"):
        attnaux.attention(Q, K, V, mask=jnp.ones((SQ, SKV + 1), bool))


def test_jaxtyping_checks_at_trace_time_under_jit():
    """Under `jax.jit` the shape check still fires (at trace time), before any kernel."""
    bias = jnp.zeros((B, HQ, SQ, SKV + 1))
    with pytest.raises(ValueError, match=r"`bias` of shape \(2, 4, 5, 7\)") as info:
        jax.jit(lambda q, k, v, b: attnaux.attention(q, k, v, bias=b))(Q, K, V, bias)
    if not jaxtyping.config.jaxtyping_disable:
        assert "parameter 'bias'" in str(info.value.__cause__)
    with pytest.raises(ValueError, match=r"`bias` of shape \(2, 4, 5, 7\)"):
        jax.jit(lambda q, k, v, b: UNCHECKED(q, k, v, bias=b))(Q, K, V, bias)


def test_errors_under_vmap_name_the_argument():
    """Under `jax.vmap` the mapped axis is invisible, and the message describes the per-example
    shapes the user wrote."""
    qs = jnp.stack([Q, Q])
    ks = jnp.stack([jnp.zeros((B, SKV, 3, D))] * 2)
    vs = jnp.stack([jnp.zeros((B, SKV, 3, DV))] * 2)
    with pytest.raises(ValueError, match=r"q_heads=4 .*kv_heads=3"):
        jax.vmap(lambda q, k, v: attnaux.attention(q, k, v))(qs, ks, vs)


def test_good_calls_pass_validation():
    """The checks are not so eager that they reject what the contract allows (so the cases
    above fail for the stated reason): broadcast bias and mask of every allowed rank, GQA,
    seqlens as NumPy ints, one segment-id array for equal lengths, windows with None sides."""
    q, k, v = Q, K, V
    good = [
        dict(bias=jnp.zeros((SQ, SKV)), mask=jnp.ones((SQ, SKV), bool)),
        dict(bias=jnp.zeros((1, SKV)), mask=jnp.ones((SQ, 1), bool)),
        dict(bias=jnp.zeros((SKV,)), mask=jnp.arange(SKV) <= 3),  # rank 1, as jax.nn takes it
        dict(bias=jnp.zeros(()), mask=jnp.asarray(True)),  # rank 0
        dict(window=(np.int64(2), 0)),  # NumPy ints, as the parser accepts them
        dict(bias=jnp.zeros((HQ, 1, SKV)), mask=jnp.ones((1, HQ, SQ, SKV), bool)),
        dict(bias=jnp.zeros((B, 1, SQ, SKV)), mask=np.ones((B, HQ, SQ, SKV), bool)),
        dict(q_seqlens=np.array([1, 5], np.int64), kv_seqlens=jnp.array([0, 6], jnp.int32)),
        dict(window=(None, 0), causal="bottom_right"),
        dict(window=(2, None), causal=True),
        dict(scale=1, softcap=30.0, sink=jnp.zeros((HQ,))),
        dict(dropout_rate=0.0, key=KEY, backend="reference"),
        dict(return_probs=True, backend="reference"),
        dict(q_segment_ids=jnp.zeros((B, SQ), int), kv_segment_ids=jnp.zeros((B, SKV), int)),
    ]
    for kwargs in good:
        out, aux = attnaux.attention(q, k, v, **kwargs)
        assert out.shape == (B, SQ, HQ, DV), kwargs
    q6 = jnp.zeros((B, SKV, HQ, D))
    out, _ = attnaux.attention(q6, k, v, q_segment_ids=jnp.zeros((B, SKV), int))
    assert out.shape == (B, SKV, HQ, DV)


def _probs_target():
    from attnaux._probs_cpu import FWD_TARGET

    return FWD_TARGET


def test_explicit_probs_backend():
    """`backend="probs"` either runs (where its kernel is built) or says clearly why not."""
    target = _probs_target()
    if target is not None and _ffi.has_target(target, "cpu"):
        out, aux = attnaux.attention(Q, K, V, backend="probs")
        assert aux.backend == "probs" and out.shape == (B, SQ, HQ, DV)
        return
    for fn in (attnaux.attention, UNCHECKED, attnaux.explain):
        with pytest.raises(ValueError, match=r"backend='probs' cannot serve this call: \S"):
            fn(Q, K, V, backend="probs")


def test_flash_unavailable_is_a_clear_error():
    """Asking for `flash` where it cannot run says so (and names the reason); `auto` falls back."""
    if HAS_FLASH:
        pytest.skip("flash is available here")
    with pytest.raises(ValueError, match=r"backend='flash' cannot serve this call: .*compiled"):
        attnaux.attention(Q, K, V, backend="flash")


# ------------------------------------------------------------------------------------------------
# The compiled handler re-checks its inputs.
# ------------------------------------------------------------------------------------------------
# Canonical (kernel ABI) sizes of the direct FFI calls.
FB, FSQ, FSKV, FHQ, FHKV, FD, FDV = 2, 4, 5, 4, 2, 8, 3


def _ffi_inputs():
    rng = np.random.default_rng(1)
    f32 = np.float32
    return dict(
        q=rng.standard_normal((FB, FSQ, FHQ, FD)).astype(f32),
        k=rng.standard_normal((FB, FSKV, FHKV, FD)).astype(f32),
        v=rng.standard_normal((FB, FSKV, FHKV, FDV)).astype(f32),
        bias=np.zeros((0,), f32),
        mask=np.zeros((0,), bool),
        q_seqlens=np.full((FB,), FSQ, np.int32),
        kv_seqlens=np.full((FB,), FSKV, np.int32),
        q_segment_ids=np.zeros((0,), np.int32),
        kv_segment_ids=np.zeros((0,), np.int32),
        sink=np.zeros((0,), f32),
        rng_state=np.zeros((0,), np.uint32),
    )


def _ffi_attrs():
    return dict(scale=np.float32(FD ** -0.5), softcap=np.float32(0.0), causal=np.int32(0),
                window_left=np.int64(-1), window_right=np.int64(-1),
                dropout_rate=np.float32(0.0))


def _ffi_outputs(inputs):
    b, sq, hq, _ = inputs["q"].shape
    dv = inputs["v"].shape[-1]
    return dict(
        out=jax.ShapeDtypeStruct((b, sq, hq, dv), inputs["q"].dtype),
        lse=jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
        max=jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
    )


def _ffi_mutations():
    """name -> (function editing (inputs, attrs, outputs) in place, regex the error must match)."""
    f32, i32 = np.float32, np.int32

    def inp(**new):
        return lambda i, a, o: i.update(new)

    def att(**new):
        return lambda i, a, o: a.update(new)

    def outp(**new):
        return lambda i, a, o: o.update(new)

    return {
        "valid": (lambda i, a, o: None, None),
        "kv_heads_not_dividing": (
            inp(k=np.zeros((FB, FSKV, 3, FD), f32), v=np.zeros((FB, FSKV, 3, FDV), f32)),
            r"query heads.*multiple of the number of kv heads.*k dim 2 = 3"),
        "k_head_dim": (inp(k=np.zeros((FB, FSKV, FHKV, FD + 1), f32)), r"\bk must have shape"),
        "k_batch": (inp(k=np.zeros((FB + 1, FSKV, FHKV, FD), f32)), r"\bk must have shape"),
        "v_seq": (inp(v=np.zeros((FB, FSKV + 1, FHKV, FDV), f32)), r"\bv must have shape"),
        "q_rank3": (lambda i, a, o: (i.update(q=i["q"][0]),
                                     o.update(out=jax.ShapeDtypeStruct((FSQ, FHQ, FDV), f32))),
                    r"\bq must have shape"),
        "qkv_dtype": (inp(k=np.zeros((FB, FSKV, FHKV, FD), np.float16)),
                      r"q, k and v must share one dtype"),
        "bias_dim_neither_one_nor_full": (inp(bias=np.zeros((1, FHQ - 1, FSQ, FSKV), f32)),
                                          r"\bbias must have shape"),
        "bias_rank3": (inp(bias=np.zeros((FHQ, FSQ, FSKV), f32)), r"\bbias must have shape"),
        "mask_dim_neither_one_nor_full": (inp(mask=np.ones((FB, 1, FSQ + 1, FSKV), bool)),
                                          r"\bmask must have shape"),
        "q_seqlens_length": (inp(q_seqlens=np.full((FB + 1,), FSQ, i32)),
                             r"\bq_seqlens must have shape"),
        "kv_seqlens_length": (inp(kv_seqlens=np.full((1,), FSKV, i32)),
                              r"\bkv_seqlens must have shape"),
        "segment_ids_alone": (inp(q_segment_ids=np.zeros((FB, FSQ), i32)),
                              r"q_segment_ids and kv_segment_ids must be given together"),
        "kv_segment_ids_shape": (inp(q_segment_ids=np.zeros((FB, FSQ), i32),
                                     kv_segment_ids=np.zeros((FB, FSQ), i32)),
                                 r"\bkv_segment_ids must have shape"),
        "sink_length": (inp(sink=np.zeros((FHKV,), f32)), r"\bsink must have shape"),
        "rng_state_missing": (att(dropout_rate=np.float32(0.1)), r"\brng_state must have shape"),
        "rng_state_without_dropout": (inp(rng_state=np.zeros((4,), np.uint32)),
                                      r"\brng_state must have shape"),
        "dropout_rate_one": (lambda i, a, o: (i.update(rng_state=np.zeros((4,), np.uint32)),
                                              a.update(dropout_rate=np.float32(1.0))),
                             r"\bdropout_rate must be in \[0, 1\)"),
        "causal_3": (att(causal=np.int32(3)), r"\bcausal must be 0"),
        "window_negative": (att(window_left=np.int64(-2)), r"window_left and window_right"),
        "softcap_negative": (att(softcap=np.float32(-1.0)), r"\bsoftcap must be"),
        "out_shape": (outp(out=jax.ShapeDtypeStruct((FB, FSQ, FHQ, FDV + 1), f32)),
                      r"\bout\b.*must have shape"),
        "lse_shape": (outp(lse=jax.ShapeDtypeStruct((FB, FHQ, FSQ + 1), f32)),
                      r"\blse\b.*must have shape"),
    }


def _run_ffi_case(name):
    """Runs one direct call of the forward target; returns a JSON-able result."""
    edit, _ = _ffi_mutations()[name]
    inputs, attrs, outputs = _ffi_inputs(), _ffi_attrs(), None
    outputs = _ffi_outputs(inputs)
    edit(inputs, attrs, outputs)
    call = jax.ffi.ffi_call("attnaux_flash_fwd", (outputs["out"], outputs["lse"], outputs["max"]))
    try:
        out, lse, row_max = call(*inputs.values(), **attrs)
        jax.block_until_ready(out)
    except Exception as error:  # noqa: BLE001  (the test inspects what came)
        return dict(ok=False, type=type(error).__name__, message=str(error))
    expected_out, aux = attnaux.attention(
        jnp.asarray(inputs["q"]), jnp.asarray(inputs["k"]), jnp.asarray(inputs["v"]),
        scale=float(attrs["scale"]), backend="reference",
    ) if name == "valid" else (None, None)
    result = dict(ok=True)
    if name == "valid":
        result["max_err"] = float(np.max(np.abs(np.asarray(out) - np.asarray(expected_out))))
        result["lse_err"] = float(np.max(np.abs(np.asarray(lse) - np.asarray(aux.lse))))
    return result


_FFI_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import test_errors
with open(sys.argv[2], "a") as log:
    for name in sys.argv[3:]:
        log.write(json.dumps(dict(name=name, started=True)) + "\n"); log.flush()
        result = test_errors._run_ffi_case(name)
        log.write(json.dumps(dict(name=name, **result)) + "\n"); log.flush()
"""


@pytest.fixture(scope="module")
def ffi_results(tmp_path_factory):
    """Runs every direct FFI call in a subprocess; a crash is recorded against the call that was
    running, and the remaining calls continue in a fresh process."""
    if not HAS_FLASH:
        pytest.skip("the compiled flash kernel is not registered for cpu")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    log = tmp_path_factory.mktemp("ffi") / "results.jsonl"
    pending = list(_ffi_mutations())
    results = {}
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(attnaux.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    while pending:
        proc = subprocess.run(
            [sys.executable, "-c", _FFI_SCRIPT, tests_dir, str(log), *pending],
            capture_output=True, text=True, env=env, timeout=300,
        )
        started = None
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            if entry.pop("started", False):
                started = entry["name"]
            else:
                results[entry["name"]] = entry
                started = None
        if started is not None:  # the process died inside this call
            results[started] = dict(ok=False, type="crash", rc=proc.returncode,
                                    message=proc.stderr[-2000:])
        remaining = [n for n in pending if n not in results]
        if remaining and len(remaining) == len(pending):  # no progress: not the handler's fault
            raise RuntimeError(f"the FFI subprocess failed before any call ran:\n{proc.stderr}")
        pending = remaining
    return results


@requires_flash
def test_ffi_valid_call_works(ffi_results):
    """The baseline of the bad calls below is a correct call (so they fail for their reason)."""
    result = ffi_results["valid"]
    assert result["ok"], result
    assert result["max_err"] < 1e-5 and result["lse_err"] < 1e-5, result


@requires_flash
@pytest.mark.parametrize("name", [n for n in _ffi_mutations() if n != "valid"])
def test_ffi_handler_rejects_bad_input(ffi_results, name):
    result = ffi_results[name]
    assert not result["ok"], f"the handler accepted the inconsistent call {name!r}"
    assert result["type"] != "crash", f"the handler crashed (rc={result.get('rc')}): " + \
        result["message"]
    pattern = _ffi_mutations()[name][1]
    assert re.search(pattern, result["message"]), result["message"]
    assert "attnaux_flash" in result["message"]
