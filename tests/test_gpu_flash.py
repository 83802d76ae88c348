"""The GPU `flash` backend (cuDNN fused attention) against `reference`, on the GPU.

Every test here is marked `gpu` and skipped without a GPU (conftest.py), and skipped when this
build has no CUDA handlers (`attnaux._ext_cuda`). Both backends run through the public API on the
same inputs; the reference computes in float32 at HIGHEST matmul precision.

Tolerances: `out` and the gradients use conftest's TOL for the input dtype (cuDNN, like the CPU
kernel, accumulates in float32 and rounds P / dS to the input dtype for its tensor-core products,
which the bf16/f16 rows of TOL already allow for). `lse` and `max` get 1e-4 (relative, and absolute
of the largest entry) instead of 2e-5: cuDNN evaluates exp/log with the hardware's approximate
`ex2`/`lg2` (relative error ~2**-22 per call) on logits pre-multiplied by log2(e), then converts
back. Biases are rounded to the input dtype first, so the comparison does not depend on whether
cuDNN takes the float32 bias or (fallback) a bias converted to the input dtype.

Dropout on GPU is cuDNN's own Philox mask, not attnaux's CPU mask, so `reference` cannot be the
oracle there: the dropout tests replay the mask with `attnaux.introspect.dropout_mask` and
recompute out (and differentiate it) in float32 JAX from the reference probabilities and that
mask, with the same tolerances. A wrong mask would miss by O(rate * |v|), far outside them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_close,
    attention_and_grads,
    dtype_id,
    loss_weights,
    make_inputs,
    make_options,
    tol,
)

import attnaux
from attnaux import _ffi, _flash_cudnn
from attnaux import introspect as ai
from attnaux._internal import dropout_keep_mask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        _ffi.ext_cuda() is None,
        reason=f"no CUDA handlers: {_ffi.CUDA_IMPORT_ERROR}; see the README, "
        "'GPU build and test'",
    ),
]

STATS_TOL = (1e-4, 1e-4)

# (name, batch, q_seq, kv_seq, q_heads, kv_heads, qk_dim, v_dim, options)
CASES = [
    ("plain", 2, 128, 128, 4, 4, 64, 64, {}),
    ("odd_lengths_gqa", 2, 100, 77, 4, 2, 64, 64, {}),
    ("causal", 2, 128, 128, 4, 4, 64, 64, dict(causal=True)),
    ("causal_q_longer", 1, 160, 96, 4, 4, 64, 64, dict(causal=True)),
    ("bottom_right", 2, 96, 160, 4, 2, 64, 64, dict(causal="bottom_right")),
    ("bottom_right_q_longer", 2, 160, 96, 4, 4, 64, 64, dict(causal="bottom_right")),
    ("gqa_causal", 2, 128, 128, 8, 2, 64, 64, dict(causal=True)),
    ("mqa_d128", 2, 128, 128, 8, 1, 128, 128, {}),
    ("scale", 2, 128, 128, 4, 4, 64, 64, dict(scale=0.3)),
    ("d128_v64", 2, 128, 128, 4, 4, 128, 64, {}),
    ("d256", 1, 128, 128, 2, 2, 256, 256, dict(causal=True)),
    ("bias_full", 2, 128, 128, 4, 4, 64, 64, dict(bias="BHQK")),
    ("bias_heads", 2, 128, 128, 4, 4, 64, 64, dict(bias="bHQK")),
    ("bias_shared", 2, 128, 128, 4, 4, 64, 64, dict(bias="QK")),
    ("bias_batch", 2, 128, 128, 4, 4, 64, 64, dict(bias="B1QK")),
    ("bias_row_broadcast", 2, 128, 96, 4, 4, 64, 64, dict(bias="BH1K")),
    ("bias_causal", 2, 128, 128, 4, 2, 64, 64, dict(bias="bHQK", causal=True)),
    ("window_causal", 2, 128, 128, 4, 4, 64, 64, dict(window=(32, 0), causal=True)),
    ("window_two_sided", 2, 128, 128, 4, 4, 64, 64, dict(window=(16, 8))),
    ("window_left_only", 2, 128, 160, 4, 4, 64, 64, dict(window=(20, None))),
    ("window_bottom_right", 2, 96, 160, 4, 4, 64, 64,
     dict(window=(24, None), causal="bottom_right")),
    ("window_q_longer", 1, 160, 96, 4, 4, 64, 64, dict(window=(16, 4))),
    ("seqlens", 4, 128, 128, 4, 4, 64, 64, dict(q_seqlens="rand", kv_seqlens="rand")),
    ("seqlens_edges_causal", 6, 96, 96, 4, 2, 64, 64,
     dict(q_seqlens="edges", kv_seqlens="edges", causal=True)),
    ("seqlens_bias", 4, 128, 128, 4, 4, 64, 64, dict(kv_seqlens="rand", bias="BHQK")),
    ("seqlens_bottom_right", 4, 96, 128, 4, 4, 64, 64,
     dict(q_seqlens="rand", kv_seqlens="rand", causal="bottom_right")),
    ("seqlens_window", 4, 128, 128, 4, 4, 64, 64, dict(kv_seqlens="rand", window=(16, 4))),
    ("batch_dims", (2, 3), 64, 64, 4, 4, 64, 64, dict(causal=True)),
    ("unbatched", (), 64, 80, 4, 4, 64, 64, {}),
    # bias or dropout with bottom-right causal masking: the masks move into attnaux's score
    # modifier (cuDNN's built-in band does not combine with a bias there)
    ("bias_bottom_right", 2, 96, 160, 4, 2, 64, 64, dict(bias="bHQK", causal="bottom_right")),
    ("bias_bottom_right_seqlens", 4, 96, 128, 4, 4, 64, 64,
     dict(bias="BHQK", causal="bottom_right", q_seqlens="rand", kv_seqlens="rand")),
    # softcap: logits of std ~4 against caps of 2-5, so the tanh saturates
    ("softcap", 2, 128, 128, 4, 4, 64, 64, dict(softcap=2.0, scale=0.5)),
    ("softcap_causal_gqa", 2, 128, 128, 8, 2, 64, 64, dict(softcap=3.0, scale=0.5, causal=True)),
    ("softcap_bias_seqlens_window", 4, 128, 128, 4, 4, 64, 64,
     dict(softcap=4.0, scale=0.5, bias="bHQK", q_seqlens="rand", kv_seqlens="rand",
          window=(32, 8))),
    ("softcap_bottom_right", 2, 96, 160, 4, 4, 64, 64,
     dict(softcap=5.0, scale=0.5, causal="bottom_right")),
    ("softcap_seqlens", 4, 128, 128, 4, 4, 64, 64,
     dict(softcap=4.0, scale=0.5, q_seqlens="rand", kv_seqlens="rand")),
    ("softcap_window", 2, 128, 128, 4, 4, 64, 64, dict(softcap=4.0, scale=0.5, window=(32, 8))),
    ("softcap_bias", 2, 128, 128, 4, 4, 64, 64, dict(softcap=4.0, scale=0.5, bias="bHQK")),
    ("seqlens_bias_heads", 4, 128, 128, 4, 4, 64, 64,
     dict(q_seqlens="rand", kv_seqlens="rand", bias="bHQK")),
    # sink: applied after cuDNN (lse includes it, max does not); with seqlens "edges" rows with
    # no key have lse = sink
    ("sink", 2, 128, 128, 4, 4, 64, 64, dict(sink=True)),
    ("sink_causal_seqlens", 6, 96, 96, 4, 2, 64, 64,
     dict(sink=True, causal=True, q_seqlens="edges", kv_seqlens="edges")),
    ("sink_softcap_d256", 1, 128, 128, 2, 2, 256, 256, dict(sink=True, softcap=5.0, causal=True)),
    # segment ids: a constant [B, 1, Sq, Skv] bias (0 / -inf) for cuDNN; sorted random runs, so
    # some segments are empty on one side (rows with no visible key)
    ("segments", 2, 128, 128, 4, 4, 64, 64, dict(segments=3)),
    ("segments_causal_gqa", 2, 128, 128, 8, 2, 64, 64, dict(segments=4, causal=True)),
    ("segments_cross_bias_sink", 2, 96, 128, 4, 4, 64, 64,
     dict(segments=2, bias="BHQK", sink=True)),
    ("segments_seqlens_window", 4, 128, 128, 4, 4, 64, 64,
     dict(segments=3, kv_seqlens="rand", window=(24, 0))),
    # the call's bias shared over the batch: its gradient sums the per-element segment biases
    ("segments_bias_shared", 2, 128, 128, 4, 4, 64, 64, dict(segments=3, bias="QK")),
    ("segments_softcap", 2, 128, 128, 4, 2, 64, 64, dict(segments=3, softcap=4.0, scale=0.5)),
    ("segments_bottom_right_seqlens", 4, 96, 128, 4, 4, 64, 64,
     dict(segments=2, causal="bottom_right", q_seqlens="rand", kv_seqlens="rand")),
    ("segments_d256", 1, 128, 128, 2, 2, 256, 256, dict(segments=3, causal=True)),
    # boolean masks: a constant 0 / -inf bias, or folded into the call's bias
    ("mask_full", 2, 128, 128, 4, 4, 64, 64, dict(mask="BHQK")),
    ("mask_shared_causal_gqa", 2, 128, 128, 8, 2, 64, 64, dict(mask="QK", causal=True)),
    ("mask_row_broadcast_seqlens", 4, 128, 96, 4, 4, 64, 64,
     dict(mask="BH1K", q_seqlens="rand", kv_seqlens="rand")),
    ("mask_bias_segments", 2, 128, 128, 4, 4, 64, 64, dict(mask="B1QK", bias="bHQK", segments=2)),
]
F16_CASES = {"plain", "causal", "bottom_right", "bias_full", "seqlens", "window_causal", "d256",
             "softcap_causal_gqa", "sink", "segments_causal_gqa", "mask_full"}
PARAMS = [pytest.param(c, jnp.bfloat16, id=f"{c[0]}-bf16") for c in CASES] + [
    pytest.param(c, jnp.float16, id=f"{c[0]}-f16") for c in CASES if c[0] in F16_CASES
]


def _setup(case, dtype, seed=0):
    name, batch, q_seq, kv_seq, q_heads, kv_heads, qk_dim, v_dim, options = case
    batch = (batch,) if isinstance(batch, int) else batch
    q, k, v = make_inputs(seed, batch, q_seq, kv_seq, q_heads, kv_heads, qk_dim, v_dim, dtype)
    opts = make_options(seed + 1, batch, q_seq, kv_seq, q_heads, **options)
    if "bias" in opts:
        opts["bias"] = opts["bias"].astype(dtype).astype(jnp.float32)
    return q, k, v, opts


def _require_flash(q, k, v, opts):
    try:  # asked for by name: auto may prefer probs for small calls (gpu_prefers_probs)
        explanation = attnaux.explain(q, k, v, backend="flash", **opts)
    except ValueError as error:
        pytest.skip(f"cuDNN does not serve this configuration here: {error}")
    # segment ids go to attnaux's own kernels on a Hopper GPU (GPU_PACKED_ON_HOPPER); these
    # cases then check those kernels against the reference the same way
    assert explanation.implementation.startswith(("cuDNN", "attnaux's Hopper kernels"))


@pytest.mark.parametrize("case, dtype", PARAMS)
def test_parity_with_reference(case, dtype):
    q, k, v, opts = _setup(case, dtype)
    _require_flash(q, k, v, opts)
    w, u = loss_weights(3, q, v)  # the loss uses out and lse: gradients through aux.lse too
    out, aux, grads = attention_and_grads(q, k, v, w, u, backend="flash", **opts)
    r_out, r_aux, r_grads = attention_and_grads(q, k, v, w, u, backend="reference", **opts)
    assert aux.backend == "flash"
    assert out.dtype == q.dtype and aux.lse.dtype == jnp.float32
    assert_close(out, r_out, tol(dtype, "out"), "out")
    assert_close(aux.lse, r_aux.lse, STATS_TOL, "lse")
    assert_close(aux.max, r_aux.max, STATS_TOL, "max")
    for name in grads:
        assert_close(grads[name], r_grads[name], tol(dtype, "grad"), f"d{name}")


@pytest.mark.parametrize(
    "name", ["plain", "causal", "bias_heads", "seqlens", "window_two_sided", "d256", "segments",
             "segments_bias_shared", "mask_bias_segments"]
)
def test_gradients_without_lse_cotangent(name):
    """Only `out` in the loss: the backward runs with no lse term (symbolic zero)."""
    case = next(c for c in CASES if c[0] == name)
    q, k, v, opts = _setup(case, jnp.bfloat16, seed=5)
    _require_flash(q, k, v, opts)
    w, _ = loss_weights(7, q, v)
    diff = {"q": q, "k": k, "v": v}
    if "bias" in opts:
        diff["bias"] = opts.pop("bias")

    def loss(diff, backend):
        extra = {n: x for n, x in diff.items() if n not in ("q", "k", "v")}
        out, _ = attnaux.attention(diff["q"], diff["k"], diff["v"], backend=backend, **extra,
                                   **opts)
        return jnp.sum(out.astype(jnp.float32) * w)

    got = jax.jit(jax.grad(lambda d: loss(d, "flash")))(diff)
    want = jax.jit(jax.grad(lambda d: loss(d, "reference")))(diff)
    for n in got:
        assert_close(got[n], want[n], tol(jnp.bfloat16, "grad"), f"d{n}")


def test_lse_only_gradient():
    """A z-loss on lse alone (no output cotangent) flows through cuDNN's backward."""
    q, k, v = make_inputs(11, 2, 128, 128, 4, 4, 64, 64, jnp.bfloat16)

    def zloss(q, k, v, backend):
        _, aux = attnaux.attention(q, k, v, causal=True, backend=backend)
        return jnp.mean(aux.lse**2)

    got = jax.jit(jax.grad(lambda *a: zloss(*a, "flash"), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda *a: zloss(*a, "reference"), argnums=(0, 1, 2)))(q, k, v)
    for g, r, n in zip(got, want, "qkv", strict=True):
        assert_close(g, r, tol(jnp.bfloat16, "grad"), f"d{n}")


@pytest.mark.parametrize("fold", ["kernel", "xla", False])
def test_lse_cotangent_with_rows_outside_the_loss(fold, monkeypatch):
    """A z-loss on every row, the output loss on some rows only: rows whose dO is 0 still carry
    their lse cotangent (folded into O by the CUDA kernel or by XLA, or through extra columns),
    exact against reference."""
    monkeypatch.setattr(_flash_cudnn, "FOLD_LSE_COTANGENT", bool(fold))
    monkeypatch.setattr(_flash_cudnn, "FOLD_WITH_KERNEL", fold == "kernel")
    q, k, v = make_inputs(13, 2, 128, 128, 4, 2, 64, 64, jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (2, 128, 4, 64)).at[:, ::3].set(0.0)

    def loss(q, k, v, backend):
        out, aux = attnaux.attention(q, k, v, causal=True, backend=backend)
        return jnp.sum(out.astype(jnp.float32) * w) + 0.1 * jnp.mean(aux.lse**2)

    got = jax.jit(jax.grad(lambda *a: loss(*a, "flash"), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda *a: loss(*a, "reference"), argnums=(0, 1, 2)))(q, k, v)
    for g, r, n in zip(got, want, "qkv", strict=True):
        assert_close(g, r, tol(jnp.bfloat16, "grad"), f"d{n}")


@pytest.mark.skipif(not _ffi.has_target(_flash_cudnn.FOLD_TARGET, "cuda"),
                    reason="this build has no attnaux_fold_lse kernel")
@pytest.mark.parametrize("dv", [64, 128, 72])
def test_fold_kernel_matches_the_xla_fold(dv):
    """`attnaux_fold_lse` against `fold_lse_cotangent` (the same formulas in float32 JAX), with
    rows of every kind: dlse = 0 (O kept), an ordinary row, dO = 0 with dlse != 0 (the EPS
    column), and tiny dO. O' may differ by one bf16 rounding (the order of the row sums), dO'
    must be equal, and rowsum(dO' * O') must be D - dlse within bf16 rounding."""
    rng = np.random.default_rng(dv)
    rows = (3, 37, 4)  # [B, S, H]
    out = jnp.asarray(rng.standard_normal((*rows, dv)), jnp.bfloat16)
    dout = np.asarray(rng.standard_normal((*rows, dv)), np.float32)
    dlse = rng.standard_normal(rows).astype(np.float32)
    dlse[0, :5] = 0.0
    dout[1, :4] = 0.0  # dO = 0, dlse != 0: the EPS column
    dout[2, :3] = 1e-20  # |dO|^2 below the threshold
    dout = jnp.asarray(dout, jnp.bfloat16)
    fold = jax.jit(lambda o, d, g: _flash_cudnn._FOLD_OP(out=o, dout=d, dlse=g))
    got = fold(out, dout, jnp.asarray(dlse))
    want_o, want_d = _flash_cudnn.fold_lse_cotangent(out, dout, jnp.asarray(dlse))
    np.testing.assert_array_equal(np.asarray(got["dout_f"]), np.asarray(want_d))
    o32, w32 = (np.asarray(x, np.float32) for x in (got["out_f"], want_o))
    np.testing.assert_allclose(o32, w32, rtol=2**-7, atol=1e-6 * np.abs(w32).max())
    d32 = np.asarray(got["dout_f"], np.float32)
    row_term = (np.asarray(dout, np.float32) * np.asarray(out, np.float32)).sum(-1)
    folded_term = (d32 * o32).sum(-1)
    scale = (np.abs(np.asarray(dout, np.float32) * np.asarray(out, np.float32)).sum(-1)
             + np.abs(dlse))
    np.testing.assert_array_less(np.abs(folded_term - (row_term - dlse)), 2**-7 * scale + 1e-30)
    keep = dlse == 0
    np.testing.assert_array_equal(o32[keep], np.asarray(out, np.float32)[keep])


def test_cudnn_targets_in_hlo():
    q, k, v = make_inputs(0, 2, 64, 64, 4, 4, 64, 64, jnp.bfloat16)
    f = lambda q, k, v: attnaux.attention(q, k, v, causal=True)
    hlo = jax.jit(f).lower(q, k, v).as_text()
    assert "attnaux_flash_fwd_cudnn" in hlo

    def loss(q, k, v):
        out, aux = f(q, k, v)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(aux.lse)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert "attnaux_flash_fwd_cudnn" in hlo and "attnaux_flash_bwd_cudnn" in hlo
    assert "attnaux_flash_fwd\"" not in hlo  # not the CPU target


def test_graphs_are_built_once():
    ext = _ffi.ext_cuda()
    q, k, v = make_inputs(1, 2, 192, 192, 4, 4, 64, 64, jnp.bfloat16)

    def loss(q, k, v):
        out, aux = attnaux.attention(q, k, v, window=(40, 3))
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(aux.lse)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(g(q, k, v))
    before = ext.graph_cache_stats()
    for seed in range(3):
        q2, k2, v2 = make_inputs(seed + 100, 2, 192, 192, 4, 4, 64, 64, jnp.bfloat16)
        jax.block_until_ready(g(q2, k2, v2))
    # a fresh jit of the same computation reuses the cached graphs as well
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    after = ext.graph_cache_stats()
    assert after["builds"] == before["builds"], (before, after)
    assert after["size"] == before["size"]
    assert after["hits"] > before["hits"]


def test_not_served_on_gpu_goes_to_reference():
    q, k, v = make_inputs(0, 1, 64, 64, 2, 2, 64, 64, jnp.float32)
    ex = attnaux.explain(q, k, v)
    assert ex.backend != "flash" and "bfloat16" in ex.reasons["flash"]
    with pytest.raises(ValueError, match="flash"):
        attnaux.attention(q, k, v, backend="flash")
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    for opts, words in (
        (dict(softcap=5.0, bias=jnp.zeros((64, 64))), ("softcap", "bias gradient")),
    ):
        ex = attnaux.explain(qb, kb, vb, **opts)
        assert ex.backend != "flash", opts  # auto picks another backend (probs or reference)
        assert all(w in ex.reasons["flash"] for w in words), ex.reasons["flash"]
        with pytest.raises(ValueError, match=words[0]):
            attnaux.attention(qb, kb, vb, backend="flash", **opts)
        out, aux = attnaux.attention(qb, kb, vb, **opts)  # auto still works
        assert aux.backend != "flash"
    qo, ko, vo = make_inputs(0, 1, 64, 64, 2, 2, 60, 60, jnp.bfloat16)
    assert "multiples of 8" in attnaux.explain(qo, ko, vo).reasons["flash"]


def test_served_on_gpu():
    """softcap, sink, dropout, segment ids, a boolean mask and a bias with bottom-right causal
    masking run on cuDNN (segment ids on attnaux's Hopper kernels where they serve them)."""
    q, k, v = make_inputs(0, 1, 64, 64, 2, 2, 64, 64, jnp.bfloat16)
    key = jax.random.key(0)
    for opts in (
        dict(dropout_rate=0.1, key=key),
        dict(softcap=5.0),
        dict(sink=jnp.zeros((2,))),
        dict(bias=jnp.zeros((64, 64)), causal="bottom_right"),
        dict(dropout_rate=0.1, key=key, causal=True, softcap=3.0),
        dict(q_segment_ids=jnp.zeros((1, 64), jnp.int32)),
        dict(mask=jnp.ones((64, 64), bool)),
    ):
        ex = attnaux.explain(q, k, v, **opts)
        assert ex.backend == "flash", (opts, ex.reasons["flash"])
        on_hopper = "q_segment_ids" in opts and ex.packed.startswith("segment ids: attnaux")
        assert ex.implementation.startswith("attnaux's Hopper" if on_hopper else "cuDNN")


def test_vmap_segments_matches_reference():
    """vmap over calls with segment ids and a bias shared by the batch (the bias that folds the
    segments in is folded with the mapped axis, the bias gradient summed back)."""
    q, k, v = make_inputs(4, (3, 2), 96, 96, 4, 2, 64, 64, jnp.bfloat16)
    rng = np.random.default_rng(1)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (3, 2, 96)), axis=-1), jnp.int32)
    bias = jnp.asarray(rng.standard_normal((96, 96)), jnp.bfloat16).astype(jnp.float32)

    def loss(q, k, v, bias, backend):
        def one(q, k, v, seg):
            out, aux = attnaux.attention(q, k, v, bias=bias, q_segment_ids=seg, backend=backend)
            return out, jnp.where(jnp.isfinite(aux.lse), aux.lse, 0.0)

        out, lse = jax.vmap(one)(q, k, v, seg)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(lse)

    got = jax.jit(jax.value_and_grad(lambda *a: loss(*a, "flash"), argnums=(0, 1, 2, 3)))(
        q, k, v, bias)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(*a, "reference"), argnums=(0, 1, 2, 3)))(
        q, k, v, bias)
    assert_close(got[0], want[0], (2e-2, 0.0), "loss")
    for g, r, n in zip(got[1], want[1], ("q", "k", "v", "bias"), strict=True):
        assert_close(g, r, tol(jnp.bfloat16, "grad"), f"d{n}")


def test_vmap_matches_reference():
    q, k, v = make_inputs(2, (3, 2), 96, 96, 4, 2, 64, 64, jnp.bfloat16)
    bias = jnp.asarray(np.random.default_rng(0).standard_normal((3, 1, 4, 96, 96)), jnp.float32)
    bias = bias.astype(jnp.bfloat16).astype(jnp.float32)

    def f(q, k, v, bias, backend):
        out, aux = attnaux.attention(q, k, v, bias=bias, causal=True, backend=backend)
        return out, aux.lse

    def loss(q, k, v, bias, backend):
        out, lse = jax.vmap(lambda *a: f(*a, backend))(q, k, v, bias)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(lse)

    got = jax.jit(jax.value_and_grad(lambda *a: loss(*a, "flash"), argnums=(0, 1, 2, 3)))(
        q, k, v, bias)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(*a, "reference"), argnums=(0, 1, 2, 3)))(
        q, k, v, bias)
    for g, r, n in zip(got[1], want[1], ["q", "k", "v", "bias"], strict=True):
        assert_close(g, r, tol(jnp.bfloat16, "grad"), f"vmap d{n}")


def test_padding_never_reaches_outputs():
    q, k, v = make_inputs(4, 3, 96, 112, 4, 4, 64, 64, jnp.bfloat16)
    q_len = jnp.array([96, 50, 0], jnp.int32)
    kv_len = jnp.array([40, 112, 7], jnp.int32)
    rows_q = (jnp.arange(96)[None, :] >= q_len[:, None])[:, :, None, None]
    rows_k = (jnp.arange(112)[None, :] >= kv_len[:, None])[:, :, None, None]
    qn, kn, vn = jnp.where(rows_q, jnp.nan, q), jnp.where(rows_k, jnp.inf, k), jnp.where(
        rows_k, jnp.nan, v)
    w, u = loss_weights(0, q, v)
    opts = dict(q_seqlens=q_len, kv_seqlens=kv_len, causal=True)
    out, aux, grads = attention_and_grads(qn, kn, vn, w, u, backend="flash", **opts)
    r_out, r_aux, r_grads = attention_and_grads(q, k, v, w, u, backend="reference", **opts)
    assert_close(out, r_out, tol(jnp.bfloat16, "out"), "out")
    assert_close(aux.lse, r_aux.lse, STATS_TOL, "lse")
    for n in grads:
        assert np.isfinite(np.asarray(grads[n], np.float32)).all(), n
        assert_close(grads[n], r_grads[n], tol(jnp.bfloat16, "grad"), f"d{n}")


def test_zero_sized():
    q, k, v = make_inputs(0, 2, 16, 0, 2, 2, 64, 64, jnp.bfloat16)
    out, aux = attnaux.attention(q, k, v, backend="flash")
    assert out.shape == (2, 16, 2, 64) and not np.asarray(out, np.float32).any()
    assert np.isneginf(np.asarray(aux.lse)).all() and np.isneginf(np.asarray(aux.max)).all()


# ------------------------------------------------------------------------------------------------
# Dropout: cuDNN's Philox mask, replayed
# ------------------------------------------------------------------------------------------------
RATE = 0.2
# (name, batch, q_seq, kv_seq, q_heads, kv_heads, qk_dim, v_dim, options)
DROPOUT_CASES = [
    ("plain", 2, 128, 128, 4, 4, 64, 64, {}),
    ("odd_lengths_gqa", 2, 100, 77, 4, 2, 64, 64, {}),
    ("causal_gqa", 2, 128, 128, 8, 2, 64, 64, dict(causal=True)),
    ("d128_v64", 1, 128, 160, 4, 4, 128, 64, {}),
    ("seqlens_window", 3, 128, 128, 4, 4, 64, 64,
     dict(q_seqlens="rand", kv_seqlens="rand", window=(32, 4))),
    ("bias", 2, 128, 128, 4, 4, 64, 64, dict(bias="bHQK")),
    ("softcap_bottom_right", 2, 96, 160, 4, 4, 64, 64,
     dict(softcap=4.0, scale=0.5, causal="bottom_right")),
    ("segments_sink", 2, 128, 128, 4, 4, 64, 64, dict(segments=3, sink=True)),
    ("mask", 2, 128, 128, 4, 4, 64, 64, dict(mask="B1QK")),
    ("d256", 1, 128, 128, 2, 2, 256, 256, dict(causal=True)),
]


def _replayed(q, k, v, opts, keep, rate):
    """`(out, lse)` in float32 JAX: the reference probabilities of a dropout-free call (float32
    inputs, so float32 P), times `keep / (1 - rate)`, times v. Differentiable in q, k, v, bias,
    sink."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    _, aux = attnaux.attention(f32(q), f32(k), f32(v), backend="reference", return_probs=True,
                               **opts)
    group = q.shape[-2] // k.shape[-2]
    vv = jnp.repeat(f32(v), group, axis=-2)
    weights = jnp.where(keep, aux.probs / (1 - rate), 0.0)
    out = jnp.einsum("...hqk,...khd->...qhd", weights, vv, precision=jax.lax.Precision.HIGHEST)
    return out, aux.lse


def _dropout_setup(case, seed=0):
    name, batch, q_seq, kv_seq, q_heads, kv_heads, qk_dim, v_dim, options = case
    batch = (batch,) if isinstance(batch, int) else batch
    q, k, v = make_inputs(seed, batch, q_seq, kv_seq, q_heads, kv_heads, qk_dim, v_dim,
                          jnp.bfloat16)
    opts = make_options(seed + 1, batch, q_seq, kv_seq, q_heads, **options)
    if "bias" in opts:
        opts["bias"] = opts["bias"].astype(jnp.bfloat16).astype(jnp.float32)
    return q, k, v, opts


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=[c[0] for c in DROPOUT_CASES])
def test_dropout_replay(case):
    """out from the cuDNN call equals out recomputed from the replayed mask; lse is untouched."""
    q, k, v, opts = _dropout_setup(case)
    key = jax.random.key(3)
    _require_flash(q, k, v, dict(opts, dropout_rate=RATE, key=key))
    out, aux = attnaux.attention(q, k, v, dropout_rate=RATE, key=key, backend="flash", **opts)
    assert aux.backend == "flash" and aux.dropout_impl == "cudnn"
    keep = ai.dropout_mask(aux, q, k, dropout_rate=RATE)
    assert keep.shape == (*q.shape[:-3], q.shape[-2], q.shape[-3], k.shape[-3])
    assert keep.dtype == jnp.bool_
    # the replay is deterministic and keeps about 1 - rate of the entries
    assert np.array_equal(np.asarray(keep), np.asarray(ai.dropout_mask(aux, q, k,
                                                                       dropout_rate=RATE)))
    assert abs(float(jnp.mean(keep)) - (1 - RATE)) < 0.02
    want_out, want_lse = _replayed(q, k, v, opts, keep, RATE)
    assert_close(out, want_out, tol(jnp.bfloat16, "out"), "out from the replayed mask")
    assert_close(aux.lse, want_lse, STATS_TOL, "lse (dropout does not change it)")
    # attnaux's CPU mask is a different draw: it must not explain cuDNN's output
    cpu_keep = dropout_keep_mask(aux.rng_state, RATE, int(np.prod(q.shape[:-3])), q.shape[-2],
                                 q.shape[-3], k.shape[-3]).reshape(keep.shape)
    wrong, _ = _replayed(q, k, v, opts, cpu_keep, RATE)
    assert float(jnp.max(jnp.abs(wrong - out.astype(jnp.float32)))) > 0.1


@pytest.mark.parametrize("name", ["causal_gqa", "bias", "seqlens_window", "softcap_bottom_right",
                                  "segments_sink", "d256"])
def test_dropout_gradients(name):
    """Gradients of sum(out * w) + sum(lse * u) (lse cotangent included) through cuDNN's backward,
    which regenerates its mask, against JAX's gradients of the replayed float32 computation."""
    case = next(c for c in DROPOUT_CASES if c[0] == name)
    q, k, v, opts = _dropout_setup(case, seed=4)
    key = jax.random.key(5)
    _require_flash(q, k, v, dict(opts, dropout_rate=RATE, key=key))
    w, u = loss_weights(6, q, v)
    diff = {"q": q, "k": k, "v": v}
    for n in ("bias", "sink"):
        if n in opts:
            diff[n] = opts.pop(n)

    def flash_loss(diff):
        extra = {n: x for n, x in diff.items() if n not in ("q", "k", "v")}
        out, aux = attnaux.attention(diff["q"], diff["k"], diff["v"], dropout_rate=RATE, key=key,
                                     backend="flash", **extra, **opts)
        lse = jnp.where(jnp.isfinite(aux.lse), aux.lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(lse * u), aux

    (_, aux), got = jax.jit(jax.value_and_grad(flash_loss, has_aux=True))(diff)
    keep = ai.dropout_mask(aux, q, k, dropout_rate=RATE)

    def replay_loss(diff):
        extra = {n: x for n, x in diff.items() if n not in ("q", "k", "v")}
        out, lse = _replayed(diff["q"], diff["k"], diff["v"], dict(opts, **extra), keep, RATE)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out * w) + jnp.sum(lse * u)

    want = jax.jit(jax.grad(replay_loss))(
        {n: (x.astype(jnp.float32) if n in "qkv" else x) for n, x in diff.items()})
    for n in got:
        assert_close(got[n], want[n], tol(jnp.bfloat16, "grad"), f"d{n} with dropout")


def test_dropout_keys_and_vmap():
    q, k, v = make_inputs(7, (3, 2), 96, 96, 4, 2, 64, 64, jnp.bfloat16)
    key = jax.random.key(11)
    f = jax.jit(lambda q, k, v, key: attnaux.attention(q, k, v, dropout_rate=RATE, key=key,
                                                       causal=True, backend="flash"))
    out1, aux1 = f(q, k, v, key)
    out2, _ = f(q, k, v, key)
    out3, _ = f(q, k, v, jax.random.key(12))
    assert np.array_equal(np.asarray(out1, np.float32), np.asarray(out2, np.float32))
    assert not np.array_equal(np.asarray(out1, np.float32), np.asarray(out3, np.float32))
    # vmap over the leading axis with one key: element n equals the unbatched call on x[n], so
    # the replay of an element's aux holds for the vmapped output too
    mapped, aux_m = jax.vmap(lambda q, k, v: f(q, k, v, key))(q, k, v)
    for n in range(q.shape[0]):
        single, _ = f(q[n], k[n], v[n], key)
        assert_close(mapped[n], single, (1e-6, 1e-6), f"vmap element {n}")
    # the replay works under vmap too (one aux, the elements' shapes)
    keep = jax.vmap(lambda q, k: ai.dropout_mask(aux1, q, k, dropout_rate=RATE))(q, k)
    single = ai.dropout_mask(aux1, q[0], k[0], dropout_rate=RATE)
    for n in range(q.shape[0]):
        assert np.array_equal(np.asarray(keep[n]), np.asarray(single))


def test_attention_vjp_refuses_a_cudnn_mask():
    q, k, v = make_inputs(9, 1, 64, 64, 2, 2, 64, 64, jnp.bfloat16)
    out, aux = attnaux.attention(q, k, v, dropout_rate=RATE, key=jax.random.key(2),
                                 backend="flash")
    with pytest.raises(ValueError, match="cudnn"):
        ai.attention_vjp(q, k, v, out, aux, jnp.ones_like(out), dropout_rate=RATE)


# ------------------------------------------------------------------------------------------------
# Workspace
# ------------------------------------------------------------------------------------------------
def test_workspace_from_xla_scratch(monkeypatch):
    """By default cuDNN's workspace comes from XLA's FFI scratch allocator (the call's workspace
    output is empty); ATTNAUX_CUDNN_WORKSPACE=output sizes an output buffer instead. Both give
    the same gradients (to float32 rounding: cuDNN's dq uses atomics)."""
    q, k, v = make_inputs(10, 2, 192, 192, 4, 2, 64, 64, jnp.bfloat16)
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((4, 192, 192)), jnp.float32)

    def loss(q, k, v, bias):
        out, aux = attnaux.attention(q, k, v, bias=bias, causal=True, backend="flash")
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(aux.lse)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    no_workspace = "tensor<0xui8>"  # the workspace output of the FFI calls (StableHLO text)
    hlo = jax.jit(grad).lower(q, k, v, bias).as_text()
    assert "attnaux_flash_bwd_cudnn" in hlo and no_workspace in hlo
    got = jax.jit(grad)(q, k, v, bias)
    sizes = [what for key, what in _ffi.ext_cuda().graph_cache_entries() if key.startswith("bwd")]
    assert any("workspace 0 B" not in what for what in sizes), sizes  # scratch really used
    monkeypatch.setenv("ATTNAUX_CUDNN_WORKSPACE", "output")
    jax.clear_caches()  # the workspace output's shape is decided at trace time
    hlo = jax.jit(lambda *a: grad(*a)).lower(q, k, v, bias).as_text()
    assert "attnaux_flash_bwd_cudnn" in hlo and no_workspace not in hlo
    want = jax.jit(lambda *a: grad(*a))(q, k, v, bias)
    for g, r, n in zip(got, want, "qkvb", strict=True):
        assert_close(g, r, (1e-2, 1e-3), f"d{n} scratch vs output workspace")


def test_graph_cache_report():
    """Not a check: prints what was built (bias dtype taken, workspace) for the test log."""
    for key, what in _ffi.ext_cuda().graph_cache_entries():
        print(f"{key}: {what}")
    print("cuDNN version", _ffi.ext_cuda().cudnn_version(), "dtype ids", dtype_id(jnp.bfloat16))
