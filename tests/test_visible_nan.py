"""A NaN that a row sees makes that row NaN, as the float32 reference and `jax.nn.softmax` do.

NaN (or +inf) stored in a visible key gives that key a NaN score, so every entry of the row's
softmax is NaN: the row's output and `lse` must be NaN, never a row of zeros with `lse = -inf`
(which reads as "this row sees no key", and which introspect's `nonfinite` count could not tell
from a padding row). Rows that do not see the key (causal) stay finite and match the reference.
Every compiled CPU form is covered: the tiled flash kernel, decode with one row and with rows in
the vector lanes (float32 and bfloat16 products), probs and small_seq, with and without a sink;
on a GPU the same calls go to cuDNN and the CUDA kernels (a form a GPU backend cannot serve is
skipped there).
Tolerances against the reference on the clean rows: out 2e-5 float32, 2e-2 bfloat16 (relative to
the largest entry); lse ten times those, absolute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnaux as ax

FORMS = {
    # name: (backend, (b, sq, skv, hq, hk, d), dtype)
    "flash_tiled": ("flash", (1, 80, 90, 2, 2, 64), jnp.float32),
    "flash_tiled_bf16": ("flash", (1, 80, 90, 2, 2, 64), jnp.bfloat16),
    "decode_one_row": ("flash", (1, 1, 300, 2, 2, 64), jnp.float32),
    "decode_one_row_bf16": ("flash", (1, 1, 300, 2, 2, 128), jnp.bfloat16),
    "decode_lanes": ("flash", (1, 4, 300, 8, 2, 128), jnp.float32),
    "decode_lanes_bf16": ("flash", (1, 4, 300, 8, 2, 128), jnp.bfloat16),
    "probs": ("probs", (1, 40, 50, 2, 2, 32), jnp.float32),
    "small_seq": ("small_seq", (1, 1, 16, 2, 2, 32), jnp.float32),
    # segment ids: on a Hopper GPU attnaux's own kernels (Pallas Mosaic GPU) serve them
    "segments_bf16": ("flash", (1, 128, 128, 2, 2, 64), jnp.bfloat16),
}


@pytest.mark.parametrize("sink", [False, True], ids=["no_sink", "sink"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_visible_nan_makes_its_row_nan(form, sink):
    backend, (b, sq, skv, hq, hk, d), dtype = FORMS[form]
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype)
               for s in ((b, sq, hq, d), (b, skv, hk, d), (b, skv, hk, d)))
    poisoned = skv - sq // 2  # bottom-right causal: the later half of the rows sees it
    k = k.at[:, poisoned, 0, 3].set(jnp.nan)  # kv head 0 only
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32) if sink else None
    options = dict(causal="bottom_right", sink=sinks)
    if form.startswith("segments"):  # one document of every token but the first
        segments = jnp.asarray(np.minimum(np.arange(skv), 1)[None], jnp.int32)
        options.update(q_segment_ids=segments[:, skv - sq:], kv_segment_ids=segments)
    try:
        out, aux = jax.jit(lambda q, k, v: ax.attention(q, k, v, backend=backend,
                                                        **options))(q, k, v)
    except ValueError as e:
        if jax.default_backend() == "cpu" or "cannot serve" not in str(e):
            raise
        pytest.skip(f"not served on this GPU: {e}")
    assert aux.backend == backend
    want, want_aux = ax.attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                  backend="reference", **options)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    lse = np.asarray(aux.lse, np.float64)  # [b, hq, sq]
    want = np.asarray(want, np.float64)
    want_lse = np.asarray(want_aux.lse, np.float64)

    sees = np.zeros((b, sq, hq), bool)  # rows of the query heads of kv head 0 that see the key
    rows = np.arange(sq) + (skv - sq) >= poisoned
    group = hq // hk
    sees[:, rows, :group] = True
    assert np.isnan(want[sees]).all() and np.isfinite(want[~sees]).all()  # (the reference)
    assert np.isnan(out[sees]).all(), f"{int((~np.isnan(out[sees])).sum())} entries not NaN"
    assert np.isnan(lse.transpose(0, 2, 1)[sees]).all(), "lse of the rows that see the NaN"
    assert np.isfinite(out[~sees]).all() and np.isfinite(lse.transpose(0, 2, 1)[~sees]).all()
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    scale = max(1.0, np.abs(want[~sees]).max())
    np.testing.assert_allclose(out[~sees], want[~sees], rtol=0, atol=tol * scale)
    np.testing.assert_allclose(lse.transpose(0, 2, 1)[~sees],
                               want_lse.transpose(0, 2, 1)[~sees], rtol=0, atol=tol * 10)
    assert ax.explain(q, k, v, backend=backend, **options).backend == backend
