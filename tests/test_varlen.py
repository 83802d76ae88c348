"""`attnaux.varlen_attention` and the cu_seqlens helpers: parity with the pure-JAX `reference`
run on each sequence alone (float32, tolerance 2e-5 on CPU; bf16 on GPU, 2e-2), padding tokens,
bad input, jit / grad / vmap. The GPU tests (cuDNN's ragged layout, attnaux's Hopper kernels and
its CUDA forward) skip without a GPU."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnaux as ax
from attnaux import _dispatch, _ffi, _hopper_packed, _masking, introspect

GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not GPU, reason="needs a GPU (cuDNN's packed layout)")
# float32 with an explicit `flash` is the CPU kernel; cuDNN takes bfloat16/float16 (the GPU
# tests below cover it)
cpu_flash = pytest.mark.skipif(GPU, reason="float32 flash is the CPU kernel")


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _arrays(q_lens, kv_lens, *, heads=(4, 2), dims=(16, 16), extra=(3, 2), dtype=jnp.float32,
            seed=0):
    rng = np.random.default_rng(seed)
    tq, tk = sum(q_lens) + extra[0], sum(kv_lens) + extra[1]
    q = rng.standard_normal((tq, heads[0], dims[0]))
    k = rng.standard_normal((tk, heads[1], dims[0]))
    v = rng.standard_normal((tk, heads[1], dims[1]))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _nan_padded(q_lens, kv_lens, **kwargs):
    """`(q, k, v, cu_q, cu_kv)`: `_arrays(q_lens, kv_lens, **kwargs)` with NaN stored in the
    padding tokens past the last sequence, and the sequences' offsets."""
    q, k, v = _arrays(q_lens, kv_lens, **kwargs)
    nq, nk = sum(q_lens), sum(kv_lens)
    q, k, v = q.at[nq:].set(jnp.nan), k.at[nk:].set(jnp.nan), v.at[nk:].set(jnp.nan)
    return q, k, v, _cu(q_lens), _cu(kv_lens)


def _per_sequence(q, k, v, cu_q, cu_kv, **options):
    """The reference: each sequence alone, in float32, through `attention(backend="reference")`
    (pure JAX) on the sequences padded by hand with their lengths; padding tokens 0 / -inf.
    Differentiable in q, k and v."""
    cu_q, cu_kv = np.asarray(cu_q), np.asarray(cu_kv)
    q_len, kv_len = np.diff(cu_q), np.diff(cu_kv)
    mq, mk = max(int(q_len.max(initial=0)), 1), max(int(kv_len.max(initial=0)), 1)
    rows_q = np.minimum(cu_q[:-1, None] + np.arange(mq), q.shape[0] - 1)
    rows_kv = np.minimum(cu_kv[:-1, None] + np.arange(mk), k.shape[0] - 1)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    seq = np.searchsorted(cu_q[1:], np.arange(q.shape[0]), side="right")
    covered = seq < len(q_len)
    seq = np.minimum(seq, len(q_len) - 1)
    pos = np.clip(np.arange(q.shape[0]) - cu_q[seq], 0, mq - 1)

    @jax.jit  # (compiled, forward and gradient: op by op the reference took seconds a call)
    def run(q, k, v):
        out, aux = ax.attention(q[rows_q], k[rows_kv], v[rows_kv], q_seqlens=q_len,
                                kv_seqlens=kv_len, backend="reference", **options)
        out = jnp.where(covered[:, None, None], out[seq, pos], 0.0)
        lse = jnp.where(covered[None], aux.lse[seq, :, pos].T, -jnp.inf)
        return out, lse

    return run(f32(q), f32(k), f32(v))


def _compare(out, aux, want_out, want_lse, tol):
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=tol, rtol=tol)
    got = np.asarray(aux.lse)
    assert np.array_equal(np.isneginf(got), np.isneginf(np.asarray(want_lse)))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got[finite], np.asarray(want_lse)[finite], atol=tol, rtol=tol)


# empty sequences, length 1, longer than a tile (the CPU tile is 64 rows), padding at the end
Q_LENS = (5, 0, 1, 70, 9)
KV_LENS = (7, 3, 1, 66, 0)
OPTIONS = [
    dict(),
    dict(causal=True),
    dict(causal="bottom_right"),
    dict(window=(4, 0)),
    dict(causal=True, softcap=5.0),
    dict(scale=0.3, window=(3, 2)),
]


@pytest.mark.parametrize("backend", ["flash", "probs", pytest.param("reference",
                                                                   marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", OPTIONS, ids=str)
@cpu_flash
def test_parity_cpu(backend, options):
    q, k, v = _arrays(Q_LENS, KV_LENS)
    cu_q, cu_kv = _cu(Q_LENS), _cu(KV_LENS)
    out, aux = ax.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                   max_seqlen_q=70, max_seqlen_kv=66, backend=backend, **options)
    assert out.shape == (q.shape[0], 4, 16) and aux.lse.shape == aux.max.shape == (4, q.shape[0])
    want_out, want_lse = _per_sequence(q, k, v, cu_q, cu_kv, **options)
    _compare(out, aux, want_out, want_lse, 2e-5)
    assert not np.asarray(out[sum(Q_LENS):]).any()  # padding tokens
    assert np.isneginf(np.asarray(aux.max[:, sum(Q_LENS):])).all()


def _loss_fn(fn, with_lse=True):
    def loss(q, k, v):
        out, aux = fn(q, k, v)
        w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        lse = jnp.where(jnp.isfinite(aux.lse), aux.lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * w) + (0.1 * jnp.sum(lse**2) if with_lse else 0)
    return loss


@pytest.mark.parametrize("backend", ["flash", pytest.param("probs", marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(2, 5)), dict()], ids=str)
@cpu_flash
def test_gradients_cpu(backend, options):
    q, k, v = _arrays(Q_LENS, KV_LENS, heads=(4, 1))
    cu_q, cu_kv = _cu(Q_LENS), _cu(KV_LENS)
    sink = jnp.asarray([0.5, -1.0, 0.0, 2.0])

    def ours(q, k, v):
        return ax.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                   max_seqlen_q=70, max_seqlen_kv=66, backend=backend,
                                   sink=sink, **options)

    def ref(q, k, v):
        out, lse = _per_sequence(q, k, v, cu_q, cu_kv, sink=sink, **options)
        return out, ax.AttnAux(lse=lse, max=lse)

    got = jax.grad(_loss_fn(ours), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(_loss_fn(ref), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)
    # padding tokens get zero gradients
    assert not np.asarray(got[0][sum(Q_LENS):]).any()
    assert not np.asarray(got[1][sum(KV_LENS):]).any()


@cpu_flash
def test_nan_in_padding_never_leaks():
    q, k, v, cu_q, cu_kv = _nan_padded(Q_LENS, KV_LENS)
    for backend in ("flash", "probs", "reference"):
        def fn(q, k, v, backend=backend):
            return ax.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                       max_seqlen_q=70, max_seqlen_kv=66, causal=True,
                                       backend=backend)
        out, aux = fn(q, k, v)
        assert np.isfinite(np.asarray(out)).all(), backend
        grads = jax.grad(_loss_fn(fn, with_lse=False), argnums=(0, 1, 2))(q, k, v)
        assert all(np.isfinite(np.asarray(g)).all() for g in grads), backend


LOOSE = 1000  # a `max_seqlen_*` far above every length: padding to it would be ~10x the row


@pytest.mark.parametrize("shared", [False, True], ids=["cross", "self"])
@pytest.mark.parametrize("options", OPTIONS, ids=str)
@cpu_flash
def test_loose_bound_runs_in_one_packed_row_cpu(options, shared):
    """With a loose `max_seqlen_*` the CPU kernels take the sequences in one packed row with
    segment ids (each in a tile-aligned region, the row's causal diagonal aligned with each
    sequence's own): out, lse and the gradients (with an lse term and a sink, GQA) match the
    per-sequence reference, NaN in the padding tokens never reaches a row, and `explain` says
    so. `shared`: the same offsets object on both sides (self-attention: a shorter row)."""
    kv_lens = Q_LENS if shared else KV_LENS
    q, k, v, cu_q, cu_kv = _nan_padded(Q_LENS, kv_lens, heads=(4, 1))
    if shared:
        cu_kv = cu_q
    sink = jnp.asarray([0.5, -1.0, 0.0, 2.0])
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=LOOSE, max_seqlen_kv=LOOSE,
                backend="flash", **options)
    packed = ax.explain(q, k, v, **args).packed
    assert "one packed row" in packed, packed
    clean = tuple(jnp.nan_to_num(x) for x in (q, k, v))
    out, aux = ax.varlen_attention(q, k, v, **args)
    want_out, want_lse = _per_sequence(*clean, cu_q, cu_kv, **options)
    _compare(out, aux, want_out, want_lse, 2e-5)
    assert np.isneginf(np.asarray(aux.max[:, sum(Q_LENS):])).all()

    def ours(q, k, v):
        return ax.varlen_attention(q, k, v, sink=sink, **args)

    def ref(q, k, v):
        out, lse = _per_sequence(q, k, v, cu_q, cu_kv, sink=sink, **options)
        return out, ax.AttnAux(lse=lse, max=lse)

    got = jax.jit(jax.grad(_loss_fn(ours), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(_loss_fn(ref), argnums=(0, 1, 2))(*clean)
    for g, w in zip(got, want):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("bound", [70, LOOSE], ids=["padded", "packed_row"])
@cpu_flash
def test_nan_in_one_sequence_stays_there_cpu(bound):
    """A NaN stored in a token of one sequence makes that sequence's rows NaN (as the reference
    does) and no other's: with the tight bound each sequence is padded alone, with a loose one
    each sits in tile-aligned regions of the packed row, so no tile holds two sequences."""
    q, k, v = _arrays(Q_LENS, Q_LENS)
    cu = _cu(Q_LENS)
    poisoned = int(cu[3]) + 10  # a token of sequence 3 (70 tokens)
    v = v.at[poisoned].set(jnp.nan)
    out, aux = ax.varlen_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=bound,
                                   max_seqlen_kv=bound, backend="flash")
    others = np.ones(q.shape[0], bool)
    others[cu[3]:cu[4]] = False
    want_out, want_lse = _per_sequence(q, k, v, cu, cu)
    assert np.isnan(np.asarray(out[cu[3]:cu[4]])).all()
    np.testing.assert_allclose(out[others], want_out[others], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("tokens", [(0, 300), (300, 0), (0, 0)], ids=str)
def test_loose_bound_with_an_empty_side(tokens):
    """No query or no key tokens with a loose bound: zeros and -inf, no layout built."""
    tq, tk = tokens
    q, k, v = jnp.ones((tq, 2, 16)), jnp.ones((tk, 2, 16)), jnp.ones((tk, 2, 16))
    cu_q, cu_kv = (np.asarray([0, 100, 200, t], np.int32) if t else np.zeros(4, np.int32)
                   for t in tokens)
    out, aux = ax.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                   max_seqlen_q=LOOSE, max_seqlen_kv=LOOSE, causal=True)
    assert out.shape == (tq, 2, 16) and not np.asarray(out).any()
    assert aux.lse.shape == (2, tq) and np.isneginf(np.asarray(aux.lse)).all()


@cpu_flash
def test_loose_bound_under_jit_with_traced_offsets():
    """The packed row under `jit` with traced offsets (one array for both sides, as
    self-attention is written) and under `vmap` over a batch of queries: the same results as
    the tight bound's padded call."""
    q, k, v = _arrays(Q_LENS, Q_LENS)
    cu = jnp.asarray(_cu(Q_LENS))

    def call(q, k, v, cu, bound):
        return ax.varlen_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=bound,
                                   max_seqlen_kv=bound, causal=True)

    loose = jax.jit(lambda q, k, v, cu: call(q, k, v, cu, LOOSE))(q, k, v, cu)
    tight = call(q, k, v, cu, 70)
    np.testing.assert_allclose(loose[0], tight[0], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(loose[1].lse, tight[1].lse, atol=2e-5, rtol=2e-5)
    batch = jax.vmap(lambda q: call(q, k, v, cu, LOOSE)[0])(jnp.stack([q, 2 * q]))
    np.testing.assert_allclose(batch[1], call(2 * q, k, v, cu, 70)[0], atol=2e-5, rtol=2e-5)


def test_jit_vmap_and_traced_offsets():
    q, k, v = _arrays(Q_LENS, KV_LENS)
    cu_q, cu_kv = _cu(Q_LENS), _cu(KV_LENS)

    @jax.jit
    def f(q, k, v, cu_q, cu_kv):
        return ax.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                   max_seqlen_q=70, max_seqlen_kv=66, causal=True)

    out, aux = f(q, k, v, cu_q, cu_kv)
    want_out, want_lse = _per_sequence(q, k, v, cu_q, cu_kv, causal=True)
    _compare(out, aux, want_out, want_lse, 2e-5)
    # vmap over a leading axis: each element its own packing
    qs, ks, vs = (jnp.stack([x, x[::-1]]) for x in (q, k, v))
    outs, auxs = jax.vmap(f, in_axes=(0, 0, 0, None, None))(qs, ks, vs, cu_q, cu_kv)
    np.testing.assert_allclose(outs[0], out, atol=1e-6)
    want_out, _ = _per_sequence(q[::-1], k[::-1], v[::-1], cu_q, cu_kv, causal=True)
    np.testing.assert_allclose(outs[1], want_out, atol=2e-5)


def test_traced_bad_offsets_are_clamped_not_read_out_of_bounds():
    q, k, v = _arrays((4, 4), (4, 4), extra=(0, 0))
    f = jax.jit(lambda cu: ax.varlen_attention(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=3, max_seqlen_kv=3)[0])
    # past the end, decreasing, and a sequence longer than max_seqlen: clamped, cut, finite
    out = f(jnp.asarray([0, 5, 100], jnp.int32))
    assert np.isfinite(np.asarray(out)).all()
    want, _ = _per_sequence(q, k, v, [0, 3, 5, 8], [0, 3, 5, 8])  # [0, 3) and [5, 8) alone
    np.testing.assert_allclose(out[:3], want[:3], atol=2e-5)
    np.testing.assert_allclose(out[5:8], want[5:8], atol=2e-5)
    assert not np.asarray(out[3:5]).any()
    out = f(jnp.asarray([0, 6, 2], jnp.int32))  # decreasing: the second sequence is empty
    assert not np.asarray(out[3:]).any()


def test_dropout_mask_replay():
    q, k, v = _arrays(Q_LENS, KV_LENS)
    cu_q, cu_kv = _cu(Q_LENS), _cu(KV_LENS)
    key = jax.random.key(3)
    out, aux = ax.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                   max_seqlen_q=70, max_seqlen_kv=66, dropout_rate=0.3, key=key,
                                   return_probs=True, backend="probs")
    n = len(Q_LENS)
    keep = introspect.dropout_mask(aux, jnp.zeros((n, 70, 4, 16)), jnp.zeros((n, 66, 2, 16)),
                                   dropout_rate=0.3)
    p = aux.probs * keep / 0.7  # [n, H, 70, 66]
    for i in range(n):
        a, b, c, d = cu_q[i], cu_q[i + 1], cu_kv[i], cu_kv[i + 1]
        if b == a or d == c:
            continue
        vv = jnp.repeat(v[c:d], 2, axis=1)
        want = jnp.einsum("hqk,khd->qhd", p[i, :, : b - a, : d - c], vv,
                          precision=jax.lax.Precision.HIGHEST)  # (not TF32 on a GPU)
        np.testing.assert_allclose(out[a:b], want, atol=2e-5)


def test_segment_ids_round_trip():
    ids = jnp.asarray([7, 7, 3, 3, 3, 7, 1, -1, -1], jnp.int32)
    cu = ax.segment_ids_to_cu_seqlens(ids, max_segments=6, padding_id=-1)
    np.testing.assert_array_equal(cu, [0, 2, 5, 6, 7, 7, 7])
    back = ax.cu_seqlens_to_segment_ids(cu, 9)
    np.testing.assert_array_equal(back, [0, 0, 1, 1, 1, 2, 3, -1, -1])
    jitted = jax.jit(lambda x: ax.segment_ids_to_cu_seqlens(x, max_segments=2))(ids)
    np.testing.assert_array_equal(jitted, [0, 2, 5])  # runs past the bound: uncovered
    with pytest.raises(ValueError, match="more than `max_segments=2`"):
        ax.segment_ids_to_cu_seqlens(ids, max_segments=2)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(cu_seqlens_q=np.asarray([0, 3, 9], np.int64)), "must be int32"),
        (dict(cu_seqlens_q=np.asarray([1, 3, 9], np.int32)), "must start at 0"),
        (dict(cu_seqlens_q=np.asarray([0, 5, 3], np.int32)), "non-decreasing"),
        (dict(cu_seqlens_q=np.asarray([0, 3, 99], np.int32)), "past the 12 tokens of `q`"),
        (dict(cu_seqlens_q=np.asarray([0, 3], np.int32)), "same number of sequences"),
        (dict(max_seqlen_q=4), "more than `max_seqlen_q=4`"),
        (dict(max_seqlen_kv=2.0), "static Python int"),
        (dict(mask=np.ones((3, 3), bool)), "unknown options"),
    ],
)
def test_bad_input(change, match):
    q, k, v = _arrays((3, 6), (3, 6), extra=(3, 3))
    args = dict(cu_seqlens_q=_cu((3, 6)), cu_seqlens_kv=_cu((3, 6)), max_seqlen_q=6,
                max_seqlen_kv=6)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        ax.varlen_attention(q, k, v, **args)


def test_explain_says_how_packed_input_is_served():
    q, k, v = (x.astype(jnp.bfloat16) if GPU else x for x in _arrays(Q_LENS, KV_LENS))
    e = ax.explain(q, k, v, cu_seqlens_q=_cu(Q_LENS), cu_seqlens_kv=_cu(KV_LENS),
                   max_seqlen_q=70, max_seqlen_kv=66, causal=True, backend="flash")
    assert e.backend == "flash"
    expected = ("Hopper", "ragged") if GPU else ("padded",)
    assert any(word in e.packed for word in expected), e.packed


# ------------------------------------------------------------------------------------------------
# GPU: packed tokens read in place (attnaux's Hopper kernels, cuDNN's packed (THD) layout)
# ------------------------------------------------------------------------------------------------
GPU_Q_LENS = (130, 0, 1, 257, 64, 33)
GPU_KV_LENS = (130, 5, 1, 257, 64, 0)
ON_HOPPER = GPU and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


CUDA_THEN_HOPPER = "the backward on attnaux's Hopper kernels"  # `explain` of "cuda-hopper"


@pytest.fixture(params=["hopper", "ragged", "cuda", "cuda-hopper"])
def packed_path(request):
    """The way GPU `flash` reads packed tokens: attnaux's Hopper kernels (Pallas), cuDNN's
    ragged layout, attnaux's CUDA forward with cuDNN's ragged backward, or that forward with
    the Hopper kernels' packed backward (`_dispatch.GPU_VARLEN_PREFERS_HOPPER`,
    `GPU_VARLEN_CUDA_FORWARD` and `GPU_VARLEN_CUDNN_BACKWARD_MAX_SPREAD`, read at trace time:
    JAX's caches are cleared around the change). Yields what `explain(...).packed` says."""
    if request.param != "ragged" and not ON_HOPPER:
        pytest.skip("needs a Hopper GPU")
    if (request.param.startswith("cuda")
            and not _ffi.has_target(_hopper_packed.CUDA_FORWARD_TARGET, "gpu")):
        pytest.skip("this build has no CUDA C++ Hopper kernels")
    with _varlen_flags(request.param == "hopper", request.param.startswith("cuda"),
                       hopper_backward=request.param == "cuda-hopper"):
        yield {"hopper": "Hopper", "ragged": "ragged", "cuda": "CUDA C++",
               "cuda-hopper": CUDA_THEN_HOPPER}[request.param]


@contextlib.contextmanager
def _varlen_flags(prefers_hopper: bool, cuda_forward: bool, hopper_backward: bool = False,
                  cuda_backward: bool = False):
    """`_dispatch`'s varlen switches for a test (the CUDA forward at any `max_seqlen_q`; with
    `hopper_backward`, the Hopper kernels' packed backward in place of cuDNN's whatever its
    spread; with `cuda_backward`, the CUDA kernels both ways at any `max_seqlen_q`, else never),
    JAX's caches cleared around the change (the switches are read at trace time)."""
    names = ("GPU_VARLEN_PREFERS_HOPPER", "GPU_VARLEN_CUDA_FORWARD",
             "GPU_VARLEN_CUDA_FORWARD_MIN_SEQ", "GPU_VARLEN_CUDNN_BACKWARD_MAX_SPREAD",
             "GPU_VARLEN_CUDA_BACKWARD", "GPU_VARLEN_CUDA_BACKWARD_MIN_SEQ")
    saved = tuple(getattr(_dispatch, name) for name in names)
    spread = -1.0 if hopper_backward else float("inf")
    for name, value in zip(names, (prefers_hopper, cuda_forward, 0, spread, cuda_backward, 0)):
        setattr(_dispatch, name, value)
    jax.clear_caches()
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(_dispatch, name, value)
        jax.clear_caches()


def _check_gpu_against_reference(fn, q, k, v, cu_q, cu_kv, options, *, jit=False):
    """`fn(q, k, v)` (a 16-bit varlen call) against `_per_sequence` in float32 on the inputs
    with NaN made 0: out and lse within 2e-2, the gradients of a loss with an lse term finite
    and within 6e-2; returns the gradients."""
    wrap = jax.jit if jit else (lambda f: f)
    out, aux = wrap(fn)(q, k, v)
    clean = tuple(jnp.nan_to_num(x).astype(jnp.float32) for x in (q, k, v))
    want_out, want_lse = _per_sequence(*clean, cu_q, cu_kv, **options)
    _compare(out, aux, want_out, want_lse, 2e-2)

    def ref(q, k, v):
        out, lse = _per_sequence(q, k, v, cu_q, cu_kv, **options)
        return out, ax.AttnAux(lse=lse, max=lse)

    got = wrap(jax.grad(_loss_fn(fn), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(_loss_fn(ref), argnums=(0, 1, 2))(*clean)
    for g, w in zip(got, want):
        g = np.asarray(g, np.float32)
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, w, atol=6e-2, rtol=6e-2)
    return got


@gpu_only
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(causal="bottom_right"),
                                     dict(window=(32, 0)), dict(causal=True, softcap=20.0)],
                         ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_gpu_ragged_parity(options, heads, packed_path):
    q, k, v, cu_q, cu_kv = _nan_padded(GPU_Q_LENS, GPU_KV_LENS, heads=heads, dims=(64, 64),
                                       extra=(7, 9), dtype=jnp.bfloat16)
    nq, nk = sum(GPU_Q_LENS), sum(GPU_KV_LENS)
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=257, max_seqlen_kv=257,
                backend="flash", **options)
    # (softcap: not on the CUDA forward, so cuDNN's ragged layout serves it, or with the Hopper
    # kernels' backward chosen, the Hopper kernels both ways)
    served = packed_path
    if "softcap" in options and packed_path in ("CUDA C++", CUDA_THEN_HOPPER):
        served = "ragged" if packed_path == "CUDA C++" else "on attnaux's Hopper kernels: one"
    assert served in ax.explain(q, k, v, **args).packed
    fn = lambda q, k, v: ax.varlen_attention(q, k, v, **args)  # noqa: E731
    got = _check_gpu_against_reference(fn, q, k, v, cu_q, cu_kv, options)
    assert not np.asarray(got[0][nq:], np.float32).any()
    assert not np.asarray(got[1][nk:], np.float32).any()


CUDA_BOTH = "attnaux's CUDA C++ Hopper kernels both ways"  # `explain` of "cuda-cuda"


@gpu_only
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(causal="bottom_right"),
                                     dict(window=(32, 0)), dict(causal=True, window=(20, 0))],
                         ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_gpu_cuda_backward_parity(options, heads):
    """attnaux's CUDA kernels both ways over packed tokens at head dim 128 (mode `cuda-cuda`):
    empty sequences on either side, length 1, sequences longer than a key block, NaN in the
    padding tokens; out, lse and the gradients of a loss with an lse term against the
    per-sequence reference, and zero gradients for the padding tokens."""
    if not ON_HOPPER or not _ffi.has_target(_hopper_packed.CUDA_BACKWARD_TARGET, "gpu"):
        pytest.skip("needs a Hopper GPU and the CUDA C++ Hopper kernels")
    q, k, v, cu_q, cu_kv = _nan_padded(GPU_Q_LENS, GPU_KV_LENS, heads=heads, dims=(128, 128),
                                       extra=(7, 9), dtype=jnp.bfloat16)
    nq, nk = sum(GPU_Q_LENS), sum(GPU_KV_LENS)
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=257, max_seqlen_kv=257,
                backend="flash", **options)
    with _varlen_flags(False, True, cuda_backward=True):
        assert CUDA_BOTH in ax.explain(q, k, v, **args).packed
        fn = lambda q, k, v: ax.varlen_attention(q, k, v, **args)  # noqa: E731
        got = _check_gpu_against_reference(fn, q, k, v, cu_q, cu_kv, options, jit=True)
    assert not np.asarray(got[0][nq:], np.float32).any()
    assert not np.asarray(got[1][nk:], np.float32).any()
    assert not np.asarray(got[2][nk:], np.float32).any()


@gpu_only
@pytest.mark.parametrize("with_lse", [True, False], ids=["lse_term", "no_lse_term"])
@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(32, 0))], ids=str)
def test_gpu_cuda_backward_shared_offsets(options, with_lse):
    """Self-attention over packed tokens (one offsets array, padding tokens holding NaN) on
    attnaux's CUDA kernels both ways: the backward takes the forward's block table and dQ tile
    bases (no table kernel of its own) and, without an lse term in the loss, no lse cotangent;
    the gradients against the per-sequence reference (float32 on the inputs with NaN made 0,
    6e-2) and zero for the padding tokens."""
    if not ON_HOPPER or not _ffi.has_target(_hopper_packed.CUDA_BACKWARD_TARGET, "gpu"):
        pytest.skip("needs a Hopper GPU and the CUDA C++ Hopper kernels")
    q, k, v, cu, _ = _nan_padded(GPU_Q_LENS, GPU_Q_LENS, heads=(8, 2), dims=(128, 128),
                                 extra=(9, 9), dtype=jnp.bfloat16)
    args = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=257, max_seqlen_kv=257,
                backend="flash", **options)

    def ref(q, k, v):
        out, lse = _per_sequence(q, k, v, cu, cu, **options)
        return out, ax.AttnAux(lse=lse, max=lse)

    with _varlen_flags(False, True, cuda_backward=True):
        assert CUDA_BOTH in ax.explain(q, k, v, **args).packed
        fn = lambda q, k, v: ax.varlen_attention(q, k, v, **args)  # noqa: E731
        got = jax.jit(jax.grad(_loss_fn(fn, with_lse), argnums=(0, 1, 2)))(q, k, v)
    clean = tuple(jnp.nan_to_num(x).astype(jnp.float32) for x in (q, k, v))
    want = jax.grad(_loss_fn(ref, with_lse), argnums=(0, 1, 2))(*clean)
    for name, g, w in zip("qkv", got, want, strict=True):
        g = np.asarray(g, np.float32)
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, w, atol=6e-2, rtol=6e-2, err_msg=f"d{name}")
        assert not g[sum(GPU_Q_LENS):].any(), f"d{name} in the padding"


@gpu_only
@pytest.mark.parametrize("options", [dict(causal=True), dict()], ids=str)
def test_gpu_cuda_backward_nan_in_one_sequence(options):
    """A NaN stored in the first token of a sequence (q, k and v) reaches no other sequence's
    outputs or gradients on attnaux's CUDA kernels both ways: the blocks of the sequences
    before it (one of 130 tokens, one of 1) load that token past their own ends and zero it
    first."""
    if not ON_HOPPER or not _ffi.has_target(_hopper_packed.CUDA_BACKWARD_TARGET, "gpu"):
        pytest.skip("needs a Hopper GPU and the CUDA C++ Hopper kernels")
    lens = (130, 1, 257, 64)
    q, k, v = _arrays(lens, lens, heads=(8, 2), dims=(128, 128), extra=(0, 0),
                      dtype=jnp.bfloat16)
    cu = _cu(lens)
    bad = int(cu[2])
    q, k, v = (x.at[bad].set(jnp.nan) for x in (q, k, v))
    others = np.ones(q.shape[0], bool)
    others[cu[2]:cu[3]] = False
    args = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=257, max_seqlen_kv=257,
                backend="flash", **options)

    def loss(fn):
        def value(q, k, v):
            out, aux = fn(q, k, v)
            w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
            kept = jnp.asarray(others)
            lse = jnp.where(kept[None, :] & jnp.isfinite(aux.lse), aux.lse, 0.0)
            return (jnp.sum(jnp.where(kept[:, None, None], out.astype(jnp.float32) * w, 0))
                    + 0.1 * jnp.sum(lse ** 2))
        return value

    def ref(q, k, v):
        out, lse = _per_sequence(q, k, v, cu, cu, **options)
        return out, ax.AttnAux(lse=lse, max=lse)

    with _varlen_flags(False, True, cuda_backward=True):
        fn = lambda q, k, v: ax.varlen_attention(q, k, v, **args)  # noqa: E731
        assert CUDA_BOTH in ax.explain(q, k, v, **args).packed
        out, _ = jax.jit(fn)(q, k, v)
        got = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)
    # (the reference on the inputs with the NaN made 0: its padding gathers other sequences'
    # tokens, so a NaN there would reach every sequence's dq through 0 * NaN; the other
    # sequences' values are the same either way)
    f32 = tuple(jnp.nan_to_num(x).astype(jnp.float32) for x in (q, k, v))
    want_out, _ = _per_sequence(*f32, cu, cu, **options)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(*f32)
    np.testing.assert_allclose(np.asarray(out, np.float32)[others],
                               np.asarray(want_out)[others], atol=2e-2, rtol=2e-2)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32)[others], np.asarray(w)[others]
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, w, atol=6e-2, rtol=6e-2)


def _emulated_cuda_forward(cfg, q, k, v, q_offsets, kv_offsets, with_stats=False):
    """What `_hopper_packed.cuda_forward` computes, densely in float32 from the offsets alone
    (sequence i: tokens from its offset, `min(span, max_seqlen_*)` of them; rules of
    `_masking.visibility`, bottom-right per sequence): `(out, lse, max, None)` of the packed
    tokens `[1, T, H, D]` / `[1, Hq, Tq]`, out 0 and lse = max = -inf on rows that see no key."""
    def packing(offsets, tokens, most):  # (each token's sequence, position, covered; lengths)
        lengths = jnp.minimum(jnp.diff(offsets), most)
        return (*_masking.token_rows(offsets, lengths, tokens), lengths)

    qs, qp, q_in, q_len = packing(q_offsets, q.shape[1], cfg.max_seqlen_q)
    ks, kp, k_in, k_len = packing(kv_offsets, k.shape[1], cfg.max_seqlen_kv)
    i, j = qp[:, None], kp[None, :]
    offset = (k_len - q_len)[qs][:, None] if cfg.causal == 2 else 0
    visible = q_in[:, None] & k_in[None, :] & (qs[:, None] == ks[None, :])
    if cfg.causal:
        visible &= j <= i + offset
    if cfg.window_left >= 0:
        visible &= j >= i + offset - cfg.window_left
    if cfg.window_right >= 0:
        visible &= j <= i + offset + cfg.window_right
    # (the kernels zero the tokens no sequence covers before any product: 0 * NaN is NaN)
    group = q.shape[2] // k.shape[2]
    qf = jnp.where(q_in[:, None, None], q[0].astype(jnp.float32), 0.0)
    kf, vf = (jnp.repeat(jnp.where(k_in[:, None, None], x[0].astype(jnp.float32), 0.0), group,
                         axis=1) for x in (k, v))
    s = jnp.einsum("qhd,khd->hqk", qf, kf, precision="highest") * cfg.scale
    s = jnp.where(visible[None], s, -jnp.inf)
    row_max = jnp.max(s, axis=-1)
    shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    e = jnp.where(visible[None], jnp.exp(s - shift[..., None]), 0.0)
    total = jnp.sum(e, axis=-1)
    seen = total > 0
    lse = jnp.where(seen, shift + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    out = jnp.einsum("hqk,khd->qhd", e / jnp.where(seen, total, 1.0)[..., None], vf,
                     precision="highest")
    return out[None].astype(q.dtype), lse[None], row_max[None], None


def _emulated_cuda_forward_with_work(cfg, q, k, v, q_offsets, kv_offsets, with_work):
    """`_hopper_packed.cuda_forward_with_work`'s stand-in: `_emulated_cuda_forward`'s, no work
    buffer (records whether one was asked for)."""
    _WORK_ASKED.append(with_work)
    return (*_emulated_cuda_forward(cfg, q, k, v, q_offsets, kv_offsets)[:3], None)


_WORK_ASKED = []


def _emulated_cuda_backward(cfg, q, k, v, out, lse, dout, dlse, q_offsets, kv_offsets,
                            work=None):
    """What `_hopper_packed.cuda_backward` computes: the gradients of the emulated forward's out
    and lse for the cotangents `dout` and `dlse` (None: zero; zero for the rows that see no
    key)."""
    def run(q, k, v):
        o, lse_, _, _ = _emulated_cuda_forward(cfg, q, k, v, q_offsets, kv_offsets)
        return o.astype(jnp.float32), lse_
    if dlse is None:
        dlse = jnp.zeros_like(lse)
    _, pull = jax.vjp(run, q, k, v)
    return tuple(g.astype(q.dtype) for g in pull((dout.astype(jnp.float32),
                                                  jnp.where(jnp.isfinite(lse), dlse, 0.0))))


@pytest.mark.parametrize("options, with_sink", [
    (dict(causal=True), True), (dict(window=(6, 2)), False),
    pytest.param(dict(causal="bottom_right"), True, marks=pytest.mark.slow),
    pytest.param(dict(), False, marks=pytest.mark.slow)], ids=str)
def test_the_cuda_both_mode_wraps_the_kernels(monkeypatch, options, with_sink):
    """`varlen_attention`'s mode `cuda-cuda` (attnaux's CUDA kernels both ways, the default on
    a Hopper GPU at head dim 128) end to end on the CPU: the kernels' pure-JAX stand-ins
    (`_emulated_cuda_forward`/`_backward`, computing from the offsets as the kernels do) in
    place of the FFI calls and the plan's mode forced; `_hopper_packed`'s custom VJP, the sink
    folded after the kernels and the lse cotangent passed to the backward give the
    per-sequence reference's out, lse and gradients (float32, 2e-5), with NaN in the padding
    tokens and zero gradients there; `jit`, `grad` and `vmap` over a leading batch."""
    from attnaux import _varlen

    planned = _varlen._plan
    modes = []

    def plan(*args, **kwargs):
        problem, choice, mode, explanation, sides = planned(*args, **kwargs)
        modes.append(mode)
        return problem, choice, "cuda-cuda", explanation, sides

    monkeypatch.setattr(_varlen, "_plan", plan)
    monkeypatch.setattr(_hopper_packed, "cuda_forward_with_work",
                        _emulated_cuda_forward_with_work)
    monkeypatch.setattr(_hopper_packed, "cuda_backward", _emulated_cuda_backward)
    jax.clear_caches()
    _WORK_ASKED.clear()
    q, k, v, cu_q, cu_kv = _nan_padded(Q_LENS, KV_LENS, heads=(4, 2), dims=(16, 16))
    sink = jnp.asarray([0.5, -1.0, 0.0, 2.0]) if with_sink else None
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=max(Q_LENS),
                max_seqlen_kv=max(KV_LENS), sink=sink, **options)

    def fn(q, k, v):
        return ax.varlen_attention(q, k, v, **args)

    def ref(q, k, v):
        out, lse = _per_sequence(q, k, v, cu_q, cu_kv, sink=sink, **options)
        return out, ax.AttnAux(lse=lse, max=lse)

    try:
        out, aux = jax.jit(fn)(q, k, v)
        got = jax.jit(jax.grad(_loss_fn(fn), argnums=(0, 1, 2)))(q, k, v)
        batched, _ = jax.vmap(fn)(q[None], k[None], v[None])
    finally:
        jax.clear_caches()
    assert modes  # the plan ran (and its mode was replaced)
    assert _WORK_ASKED and not any(_WORK_ASKED)  # (two sides' offsets: no table to share)
    clean = tuple(jnp.nan_to_num(x) for x in (q, k, v))
    want_out, want_lse = _per_sequence(*clean, cu_q, cu_kv, sink=sink, **options)
    _compare(out, aux, want_out, want_lse, 2e-5)
    np.testing.assert_allclose(np.asarray(batched[0]), np.asarray(out), atol=1e-6, rtol=1e-6)
    want = jax.grad(_loss_fn(ref), argnums=(0, 1, 2))(*clean)
    nq, nk = sum(Q_LENS), sum(KV_LENS)
    for name, g, w in zip("qkv", got, want, strict=True):
        g = np.asarray(g)
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=f"d{name}")
        assert not g[(nq if name == "q" else nk):].any(), f"d{name} in the padding"


@pytest.mark.parametrize("with_lse", [True, False], ids=["lse_term", "no_lse_term"])
def test_the_cuda_both_mode_shares_the_forward_work(monkeypatch, with_lse):
    """Mode `cuda-cuda` with one offsets array both sides (self-attention): the custom VJP asks
    the forward for its work buffer (block table, dQ tile bases) only when differentiated, and
    hands it and a None lse cotangent (a loss without an lse term) to the backward; out and the
    gradients as the per-sequence reference's (float32, 2e-5). The kernels: pure-JAX stand-ins
    as in `test_the_cuda_both_mode_wraps_the_kernels`."""
    from attnaux import _varlen

    planned = _varlen._plan

    def plan(*args, **kwargs):
        problem, choice, _, explanation, sides = planned(*args, **kwargs)
        return problem, choice, "cuda-cuda", explanation, sides

    monkeypatch.setattr(_varlen, "_plan", plan)
    monkeypatch.setattr(_hopper_packed, "cuda_forward_with_work",
                        _emulated_cuda_forward_with_work)
    dlses = []

    def backward(*args):
        dlses.append(args[7])
        return _emulated_cuda_backward(*args)

    monkeypatch.setattr(_hopper_packed, "cuda_backward", backward)
    jax.clear_caches()
    _WORK_ASKED.clear()
    q, k, v, cu, _ = _nan_padded(Q_LENS, Q_LENS, heads=(4, 2), dims=(16, 16), extra=(3, 3))
    args = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(Q_LENS),
                max_seqlen_kv=max(Q_LENS), causal=True)

    def fn(q, k, v):
        return ax.varlen_attention(q, k, v, **args)

    def ref(q, k, v):
        out, lse = _per_sequence(q, k, v, cu, cu, causal=True)
        return out, ax.AttnAux(lse=lse, max=lse)

    try:
        jax.jit(fn)(q, k, v)
        assert _WORK_ASKED == [False]  # (not differentiated: no work buffer kept)
        got = jax.jit(jax.grad(_loss_fn(fn, with_lse), argnums=(0, 1, 2)))(q, k, v)
    finally:
        jax.clear_caches()
    assert _WORK_ASKED[1:] == [True]
    assert (dlses[0] is None) == (not with_lse)
    clean = tuple(jnp.nan_to_num(x) for x in (q, k, v))
    want = jax.grad(_loss_fn(ref, with_lse), argnums=(0, 1, 2))(*clean)
    for name, g, w in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, atol=2e-5, rtol=2e-5, err_msg=f"d{name}")
        assert not np.asarray(g)[sum(Q_LENS):].any(), f"d{name} in the padding"


def test_which_way_gpu_flash_serves_packed_tokens(monkeypatch):
    """The plan's rule for GPU `flash` on a Hopper GPU (the platform checks answering as there,
    on the CPU): attnaux's CUDA kernels both ways from `GPU_VARLEN_CUDA_BACKWARD_MIN_SEQ` query
    rows, else (or with either CUDA switch off, or where the CUDA backward cannot serve) the
    CUDA forward with cuDNN's ragged backward, and `explain`'s text says why."""
    from attnaux import _flash_cudnn, _varlen
    from attnaux._canon import parse_statics

    chosen = _varlen.choose
    monkeypatch.setattr(_varlen, "choose", lambda *a: chosen(*a)._replace(
        implementation=_dispatch.implementation("flash", "gpu")))
    monkeypatch.setattr(_flash_cudnn, "ragged_unavailable", lambda *a: None)
    monkeypatch.setattr(_hopper_packed, "varlen_unavailable", lambda *a: None)
    monkeypatch.setattr(_hopper_packed, "cuda_forward_unavailable", lambda *a: None)
    backward_no = {"why": None}
    monkeypatch.setattr(_hopper_packed, "cuda_backward_unavailable",
                        lambda *a: backward_no["why"])
    statics = parse_statics(scale=None, causal=True, window=None, softcap=None,
                            dropout_rate=0.0)
    q = k = v = jnp.zeros((1024, 2, 128), jnp.bfloat16)
    cu = jnp.asarray([0, 300, 1024], jnp.int32)

    def plan(most=724):
        _, _, mode, explanation, _ = _varlen._plan(
            q, k, v, cu, cu, None, None, statics=statics, max_seqlen_q=most,
            max_seqlen_kv=most, return_probs=False, backend="flash")
        return mode, explanation.packed

    mode, how = plan()
    assert mode == "cuda-cuda" and "both ways" in how, how
    monkeypatch.setattr(_dispatch, "GPU_VARLEN_CUDA_BACKWARD_MIN_SEQ", 725)
    mode, how = plan()
    assert mode == "cuda" and "below GPU_VARLEN_CUDA_BACKWARD_MIN_SEQ" in how, how
    monkeypatch.setattr(_dispatch, "GPU_VARLEN_CUDA_BACKWARD_MIN_SEQ", 724)
    assert plan()[0] == "cuda-cuda"
    backward_no["why"] = "it takes head dim 128 (got 64)"
    mode, how = plan()
    assert mode == "cuda" and "attnaux's CUDA backward: it takes head dim 128" in how, how
    backward_no["why"] = None
    monkeypatch.setattr(_dispatch, "GPU_VARLEN_CUDA_BACKWARD", False)
    mode, how = plan()
    assert mode == "cuda" and "GPU_VARLEN_CUDA_BACKWARD is off" in how, how
    monkeypatch.setattr(_dispatch, "GPU_VARLEN_CUDA_BACKWARD", True)
    monkeypatch.setattr(_dispatch, "GPU_VARLEN_CUDA_FORWARD", False)
    assert plan()[0] == "ragged"


@gpu_only
@pytest.mark.parametrize("dim,backward", [(128, "cudnn"), (256, "cudnn"), (128, "hopper"),
                                          (128, "cuda")])
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(causal="bottom_right"),
                                     dict(causal=True, window=(200, 0))], ids=str)
def test_gpu_cuda_forward_long_sequences(dim, backward, options):
    """attnaux's CUDA forward over packed tokens at head dims 128 and 256, differentiated by
    cuDNN's ragged backward, the Hopper kernels' packed one or attnaux's CUDA one: sequences of
    several 128-row blocks and key blocks, lengths that end inside a block, empty ones, queries
    and keys of different lengths, GQA; NaN in the padding tokens never reaches a row."""
    if not ON_HOPPER or not _ffi.has_target(_hopper_packed.CUDA_FORWARD_TARGET, "gpu"):
        pytest.skip("needs a Hopper GPU and the CUDA C++ Hopper kernels")
    q_lens, kv_lens = (700, 1, 0, 385, 129, 64), (700, 300, 6, 513, 129, 0)
    q, k, v, cu_q, cu_kv = _nan_padded(q_lens, kv_lens, heads=(8, 2), dims=(dim, dim),
                                       extra=(11, 70), dtype=jnp.bfloat16)
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=700, max_seqlen_kv=700,
                backend="flash", **options)
    with _varlen_flags(False, True, hopper_backward=backward == "hopper",
                       cuda_backward=backward == "cuda"):
        packed = ax.explain(q, k, v, **args).packed
        assert "CUDA C++" in packed and (CUDA_THEN_HOPPER in packed) == (backward == "hopper")
        assert (CUDA_BOTH in packed) == (backward == "cuda"), packed
        fn = lambda q, k, v: ax.varlen_attention(q, k, v, **args)  # noqa: E731
        _check_gpu_against_reference(fn, q, k, v, cu_q, cu_kv, options, jit=True)


@gpu_only
def test_gpu_loose_bound_takes_the_hopper_backward():
    """`auto` with `max_seqlen_*` the number of tokens and 64 sequences: cuDNN's ragged backward
    would launch 42.7x the tiles the tokens fill (`_dispatch.cudnn_backward_spread`), so the
    Hopper kernels' packed backward differentiates the CUDA forward; with the longest sequence
    as the bound, cuDNN's ragged backward does."""
    if not ON_HOPPER or not _ffi.has_target(_hopper_packed.CUDA_FORWARD_TARGET, "gpu"):
        pytest.skip("needs a Hopper GPU and the CUDA C++ Hopper kernels")
    lens = (256,) * 64
    q = k = v = jnp.zeros((sum(lens), 4, 64), jnp.bfloat16)
    assert _dispatch.cudnn_backward_spread(64, 16384, 16384, 16384, 16384) > (
        _dispatch.GPU_VARLEN_CUDNN_BACKWARD_MAX_SPREAD)

    def packed(bound):
        return ax.explain(q, k, v, cu_seqlens_q=_cu(lens), cu_seqlens_kv=_cu(lens),
                          max_seqlen_q=bound, max_seqlen_kv=bound, causal=True,
                          backend="flash").packed

    loose, tight = packed(sum(lens)), packed(256)
    assert CUDA_THEN_HOPPER in loose and "GPU_VARLEN_CUDNN_BACKWARD_MAX_SPREAD" in loose, loose
    assert CUDA_THEN_HOPPER not in tight and "cuDNN's ragged" in tight, tight


def _cuda_table_reference(cu_q, cu_kv, total_q, max_q, max_kv):
    """The CUDA forward's runs (hopper_fwd_packed_table.cuh) in NumPy: `(bucket, q_off, q_len,
    kv_off, kv_len, seq, blocks)` for each sequence's tokens up to `max_q`, its tokens past it
    and the tokens past the last sequence (no keys, sequence -1, bucket -1: last)."""
    runs = []
    for i in range(len(cu_q) - 1):
        span = int(cu_q[i + 1] - cu_q[i])
        q_len, kv_len = min(span, max_q), min(int(cu_kv[i + 1] - cu_kv[i]), max_kv)
        runs.append((min(-(-q_len // 128), 2047), int(cu_q[i]), q_len, int(cu_kv[i]), kv_len,
                     i))
        runs.append((-1, int(cu_q[i]) + q_len, span - q_len, 0, 0, -1))
    runs.append((-1, int(cu_q[-1]), total_q - int(cu_q[-1]), 0, 0, -1))
    return [(*run, -(-run[2] // 128)) for run in runs if run[2] > 0]


@gpu_only
@pytest.mark.parametrize("q_lens,max_q,extra", [
    ((300, 0, 1, 128, 129), 300, 3), ((5,), 5, 0), ((0, 0), 1, 40),
    ((1000, 2000, 1), 1500, 200),  # a sequence past max_seqlen_q: its tail a run without keys
    (tuple(range(0, 3000, 97)), 2910, 5),
    (tuple((i * 37) % 300 for i in range(1100)), 299, 130)])
def test_gpu_cuda_forward_block_table(q_lens, max_q, extra):
    """The CUDA forward's block table, built on the device (hopper_fwd_packed_table.cuh), read
    back from its work buffer: every 128-row block of every run once (each sequence's tokens up
    to `max_seqlen_q` with its keys; its tokens past that, and the tokens past the last
    sequence, without keys), the sequences with the most blocks first and the runs without keys
    last, each run's blocks together, its last first; -1 after the last block. After it in the
    buffer (`PackedWork`), for the packed backward: each sequence's first dQ tile of 64 rows and
    each tile's sequence (-1 past the last), then the forward's order of the table. The rows of
    the runs without keys (NaN in q there) come out 0 with lse = max = -inf; the statistics per
    sequence for cuDNN's backward are the lse of the sequence's rows, +inf where it is -inf."""
    if not ON_HOPPER or not _ffi.has_target(_hopper_packed.CUDA_FORWARD_TARGET, "gpu"):
        pytest.skip("needs a Hopper GPU and the CUDA C++ Hopper kernels")
    q_lens = np.asarray(q_lens, np.int32)
    kv_lens = q_lens[::-1].copy()
    cu_q, cu_kv = _cu(q_lens), _cu(kv_lens)
    total_q, total_kv, max_kv = int(cu_q[-1]) + extra, max(int(cu_kv[-1]), 1), max_q
    key = jax.random.key(3)
    q = jax.random.normal(key, (1, total_q, 2, 64), jnp.bfloat16)
    k = v = jax.random.normal(jax.random.fold_in(key, 1), (1, total_kv, 2, 64), jnp.bfloat16)
    runs = _cuda_table_reference(cu_q, cu_kv, total_q, max_q, max_kv)
    keyless = np.zeros(total_q, bool)
    for _, q_off, q_len, _, kv_len, _, _ in runs:
        keyless[q_off:q_off + q_len] = kv_len == 0
    q = jnp.where(jnp.asarray(keyless)[None, :, None, None], jnp.nan, q)
    n = len(q_lens)
    count = _hopper_packed.cuda_block_count(total_q, n)
    stats = jax.ShapeDtypeStruct((1, 2, total_q), jnp.float32)
    out, lse, row_max, per_sequence, work = jax.ffi.ffi_call(
        _hopper_packed.CUDA_FORWARD_TARGET, (
            jax.ShapeDtypeStruct(q.shape, q.dtype), stats, stats,
            jax.ShapeDtypeStruct((n, 2, max_q), jnp.float32),
            _hopper_packed._work_shape(total_q, total_q, n)))(
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_kv), grid=np.int64(8),
        block_count=np.int64(count), max_seqlen_q=np.int64(max_q),
        max_seqlen_kv=np.int64(max_kv), scale=np.float32(0.125), bottom_right=np.int32(0),
        has_upper=np.int32(0), upper=np.int64(0), has_lower=np.int32(0), lower=np.int64(0),
        backward_tiles=np.int32(1))
    table = np.asarray(work)[:6 * count].reshape(6, count)
    used = sum(run[-1] for run in runs)
    assert (table[0, used:] == -1).all()
    at = 0
    buckets = []
    by_start = {run[1]: run for run in runs if run[-1] > 0}
    while at < used:  # each run's blocks together, its last block first
        run = by_start[int(table[1, at])]
        bucket, q_off, q_len, kv_off, kv_len, seq, blocks = run
        want = np.stack([np.arange(blocks)[::-1], *(np.full(blocks, x)
                                                    for x in (q_off, q_len, kv_off, kv_len, seq))])
        np.testing.assert_array_equal(table[:, at:at + blocks], want)
        buckets.append(bucket)
        del by_start[q_off]
        at += blocks
    assert not by_start and at == used  # every run once
    assert buckets == sorted(buckets, reverse=True)  # most blocks first, keyless runs last
    # the forward's order of it, at the buffer's end: chunks of 32 entries (kTableChunk) whose
    # runs all have 1024 queries or more (kForwardOrderMinRows) heaviest first, stably (no
    # mask here: a block's weight is its run's key blocks), the others as in the table
    dq_tiles = total_q // 64 + n + 1
    forward = np.asarray(work)[6 * count + 3 * n + 3 + dq_tiles:].reshape(6, count)
    assert (forward[0, used:] == -1).all()
    sorted_chunks = 0
    for c0 in range(0, used, 32):
        part = table[:, c0:min(c0 + 32, used)]  # (past `used` only m_block is written)
        if (part[2] >= 1024).all():
            weight = -(-part[4] // 128)
            order = np.argsort(-weight, kind="stable")
            sorted_chunks += (order != np.arange(part.shape[1])).any()
            part = part[:, order]
        np.testing.assert_array_equal(forward[:, c0:c0 + part.shape[1]], part)
    # (in `range(0, 3000, 97)` the keys are the queries reversed: the first chunks re-ordered)
    assert sorted_chunks > 0 or max_q < 2048
    # the dQ tiles: [6 count][2 n + 1 runs' entries][n + 1 tile bases][counter][tile's sequence]
    tiles = -(-np.minimum(np.diff(cu_q), max_q) // 64)
    base = np.concatenate([[0], np.cumsum(tiles)])
    words = np.asarray(work)
    np.testing.assert_array_equal(words[6 * count + 2 * n + 1:][:n + 1], base)
    tile_seq = words[6 * count + 3 * n + 3:][:dq_tiles]
    np.testing.assert_array_equal(tile_seq[:base[-1]], np.repeat(np.arange(n), tiles))
    assert (tile_seq[base[-1]:] == -1).all()
    assert not np.asarray(out[0, keyless], np.float32).any()
    assert np.isneginf(np.asarray(lse[0][:, keyless])).all()
    assert np.isneginf(np.asarray(row_max[0][:, keyless])).all()
    assert np.isfinite(np.asarray(out[0, ~keyless], np.float32)).all()
    lse, per_sequence = np.asarray(lse[0]), np.asarray(per_sequence)
    for i in range(n):
        q_len = min(int(q_lens[i]), max_q)
        want = lse[:, cu_q[i]:cu_q[i] + q_len]
        np.testing.assert_array_equal(per_sequence[i, :, :q_len],
                                      np.where(np.isneginf(want), np.inf, want))


@gpu_only
def test_gpu_ragged_matches_batched_flash():
    # equal lengths: the packed call equals the batched cuDNN call of the same documents
    n, length = 4, 256
    q, k, v = _arrays((length,) * n, (length,) * n, heads=(8, 8), dims=(128, 128), extra=(0, 0),
                      dtype=jnp.bfloat16)
    cu = _cu((length,) * n)
    out, aux = ax.varlen_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                   max_seqlen_q=length, max_seqlen_kv=length, causal=True)
    batched = lambda x: x.reshape(n, length, *x.shape[1:])  # noqa: E731
    want, want_aux = ax.attention(batched(q), batched(k), batched(v), causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(want.reshape(out.shape), np.float32), atol=1e-2)
    np.testing.assert_allclose(aux.lse, want_aux.lse.transpose(1, 0, 2).reshape(8, -1),
                               atol=1e-3)


def test_no_keys_or_no_sequences():
    q, k, v = _arrays((3, 2), (0, 0), extra=(1, 0))
    sink = jnp.asarray([0.5, 1.0, -1.0, 2.0])
    out, aux = ax.varlen_attention(q, k, v, cu_seqlens_q=_cu((3, 2)), cu_seqlens_kv=_cu((0, 0)),
                                   max_seqlen_q=3, max_seqlen_kv=1, sink=sink)
    assert not np.asarray(out).any()
    np.testing.assert_array_equal(aux.lse[:, :5], np.repeat(np.asarray(sink)[:, None], 5, 1))
    assert np.isneginf(np.asarray(aux.lse[:, 5:])).all()
    out, aux = ax.varlen_attention(q, q, q, cu_seqlens_q=np.zeros(1, np.int32),
                                   cu_seqlens_kv=np.zeros(1, np.int32), max_seqlen_q=1,
                                   max_seqlen_kv=1)
    assert not np.asarray(out).any() and np.isneginf(np.asarray(aux.lse)).all()
