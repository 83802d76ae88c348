"""Context parallelism (`attnaux.parallel`, issue 21) on 8 host CPU devices: the sequence
sharded over 2, 4 or 8 devices gives the unsharded `attnaux.attention` (flash) result.

Reference: `attnaux.attention(..., backend="flash")` on the whole sequence, one device (itself
checked against float64 and pure-JAX references by the main suite). Tolerances, float32: the
ring merges per-block softmax results by their lse (a different summation order than one
kernel's running sums), so outputs and lse agree to ~1e-6; gradients pass through the merge and
two more reductions, 1e-5 relative to their largest entry (sums over up to 64 keys).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import attnaux as ax
import attnaux.parallel as par

OUT_TOL, GRAD_TOL = 1e-5, 1e-5
B, S, H, KV, D = 2, 64, 4, 2, 8


def mesh_of(n):
    return jax.make_mesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])


def inputs(seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, S, H, D), dtype),
            jax.random.normal(ks[1], (B, S, KV, D), dtype),
            jax.random.normal(ks[2], (B, S, KV, D), dtype))


def close(a, b, tol, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), finite), f"{what}: non-finite entries differ"
    scale = max(1.0, float(np.max(np.abs(b[finite])))) if finite.any() else 1.0
    err = float(np.max(np.abs(np.where(finite, a, 0.0) - np.where(finite, b, 0.0))))
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol * scale:.3g}"


def run_cp(n, strategy, layout, q, k, v, arrays=None, **options):
    """out, lse, max and the gradient function through the jit-level entry, in natural order."""
    arrays = dict(arrays or {})
    mesh = mesh_of(n)
    zz = layout == "zigzag"

    def perm(x, axis):
        return par.zigzag(x, n, axis=axis) if zz else x

    def unperm(x, axis):
        return par.unzigzag(x, n, axis=axis) if zz else x

    def call(q, k, v, arrays):
        seq_arrays = {name: perm(x, -1) if name.endswith("segment_ids") else x
                      for name, x in arrays.items()}
        out, aux = par.context_parallel_attention(
            perm(q, 1), perm(k, 1), perm(v, 1), mesh=mesh, axis_name="sp", strategy=strategy,
            layout=layout, **seq_arrays, **options)
        return unperm(out, 1), unperm(aux.lse, 2), unperm(aux.max, 2)

    return jax.jit(call), arrays


def reference(q, k, v, arrays, **options):
    out, aux = ax.attention(q, k, v, backend="flash", **arrays, **options)
    return out, aux.lse, aux.max


def loss_of(fn, arrays, with_values=False):
    """A scalar loss of `fn`'s out and lse; `with_values=True` also returns `(out, lse, max)`
    as `has_aux` values, so one compiled program checks the forward values and the gradients."""
    def loss(q, k, v, *params):
        named = dict(arrays)
        if params:
            named["sink"] = params[0]
        out, lse, row_max = fn(q, k, v, named)
        w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        value = jnp.sum(out * w) + 0.3 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return (value, (out, lse, row_max)) if with_values else value
    return loss


def grads_and_values(fn, arrays, argnums=(0, 1, 2)):
    """`(grads, (out, lse, max))` of `loss_of(fn, arrays)`: the forward values come out of the
    gradient's program (the forward runs inside it), so a case compiles one program, not two.
    The forward-only path (no VJP) is checked by the dropout, shard_map and loop tests."""
    return jax.grad(loss_of(fn, arrays, with_values=True), argnums=argnums, has_aux=True)


# Every strategy x layout x mask on 2 devices; on 4 and 8, the combinations that differ in how
# blocks travel and which are skipped (kept small: CI runs this on 2 cores).
CASES = [(2, s, lay, c) for s in ("ring", "allgather") for lay in ("contiguous", "zigzag")
         for c in (False, True)]
CASES += [(n, s, lay, c) for n in (4, 8) for s, lay, c in
          (("ring", "zigzag", True), ("allgather", "contiguous", True),
           ("ring", "contiguous", False))]
# The plain ring-zigzag causal call on 4 devices is part of every causal ring-zigzag case of
# `test_options_at_global_positions` and of the ring dropout test (4 devices, causal, zigzag, with
# options on top): in the slow sweep only. 2 and 8 devices keep their plain case here.
_COVERED_CASES = ((4, "ring", "zigzag", True),)
CASE_IDS = [f"{n}-{s}-{lay}-{'causal' if c else 'full'}" for n, s, lay, c in CASES]
_CASE_PARAMS = [pytest.param(*case, id=case_id,
                             marks=[pytest.mark.slow] if case in _COVERED_CASES else [])
                for case, case_id in zip(CASES, CASE_IDS)]


@pytest.mark.parametrize(("n", "strategy", "layout", "causal"), _CASE_PARAMS)
def test_exact_against_the_unsharded_call(n, strategy, layout, causal):
    q, k, v = inputs()
    fn, arrays = run_cp(n, strategy, layout, q, k, v, causal=causal)
    grads, values = jax.jit(grads_and_values(fn, arrays))(q, k, v)
    want_grads, want = grads_and_values(
        lambda q, k, v, a: reference(q, k, v, a, causal=causal), arrays)(q, k, v)
    for got, expected, name in zip(values, want, ("out", "lse", "max")):
        close(got, expected, OUT_TOL, name)
    for g, w, name in zip(grads, want_grads, "qkv"):
        close(g, w, GRAD_TOL, f"d{name}")


OPTION_CASES = {
    "segments": lambda rng: dict(arrays=dict(
        q_segment_ids=jnp.asarray(np.sort(rng.integers(0, 4, (B, S)), axis=1), jnp.int32),
        kv_segment_ids=None)),
    "seqlens": lambda rng: dict(arrays=dict(q_seqlens=jnp.asarray([50, 13], jnp.int32),
                                            kv_seqlens=jnp.asarray([64, 29], jnp.int32))),
    "window": lambda rng: dict(arrays={}, window=(9, 0)),
    "window_two_sided_no_causal": lambda rng: dict(arrays={}, window=(5, 12), causal=False),
    "bottom_right": lambda rng: dict(arrays={}, causal="bottom_right"),
    "bottom_right_lengths_window": lambda rng: dict(
        arrays=dict(q_seqlens=jnp.asarray([50, 13], jnp.int32),
                    kv_seqlens=jnp.asarray([64, 29], jnp.int32)),
        causal="bottom_right", window=(17, 0)),
    "window_segments_seqlens": lambda rng: dict(arrays=dict(
        q_segment_ids=jnp.asarray(np.sort(rng.integers(0, 3, (B, S)), axis=1), jnp.int32),
        q_seqlens=jnp.asarray([60, 33], jnp.int32), kv_seqlens=jnp.asarray([64, 40], jnp.int32)),
        window=(20, 3)),
    "sink_softcap_scale": lambda rng: dict(arrays=dict(sink=jnp.asarray(rng.standard_normal(H),
                                                                        jnp.float32)),
                                           softcap=3.0, scale=0.5),
    # The two cases above in one call: what the ring runs in the default run.
    "window_two_sided_no_causal_sink_softcap_scale": lambda rng: dict(
        arrays=dict(sink=jnp.asarray(rng.standard_normal(H), jnp.float32)),
        window=(5, 12), causal=False, softcap=3.0, scale=0.5),
}


# The ring (each case a large program to compile: a switch over block kinds per chunk pair, per
# hop) runs the combined cases in the default run; the single cases they combine are in the slow
# sweep only (`tests/test_spmd.py::test_spmd_slow_sweep...`): window, lengths and bottom-right
# in bottom_right_lengths_window / window_segments_seqlens; segments in window_segments_seqlens
# (the same q = kv segment ids); the two-sided window without causal, sink, softcap and scale in
# window_two_sided_no_causal_sink_softcap_scale. allgather (cheap to compile) runs every single
# case in the default run, and their combination only in the slow sweep.
_RING_DEFAULT = ("bottom_right_lengths_window", "window_segments_seqlens",
                 "window_two_sided_no_causal_sink_softcap_scale")
_COMBINED = ("window_two_sided_no_causal_sink_softcap_scale",)


def _option_marks(strategy, case):
    slow = case not in _RING_DEFAULT if strategy == "ring" else case in _COMBINED
    return [pytest.mark.slow] if slow else []


_OPTION_PARAMS = [
    pytest.param(case, strategy, layout, id=f"{strategy}-{layout}-{case}",
                 marks=_option_marks(strategy, case))
    for strategy, layout in (("ring", "zigzag"), ("allgather", "contiguous"))
    for case in OPTION_CASES
]


@pytest.mark.parametrize(("case", "strategy", "layout"), _OPTION_PARAMS)
def test_options_at_global_positions(case, strategy, layout):
    rng = np.random.default_rng(1)
    spec = OPTION_CASES[case](rng)
    arrays = spec.pop("arrays")
    if "q_segment_ids" in arrays:
        arrays["kv_segment_ids"] = arrays["q_segment_ids"]
    spec.setdefault("causal", True)
    q, k, v = inputs(2)
    fn, arrays = run_cp(4, strategy, layout, q, k, v, arrays, **spec)
    params = (arrays.pop("sink"),) if "sink" in arrays else ()
    argnums = tuple(range(3 + len(params)))
    grads, values = jax.jit(grads_and_values(fn, arrays, argnums))(q, k, v, *params)
    want_grads, want = grads_and_values(lambda q, k, v, a: reference(q, k, v, a, **spec),
                                        arrays, argnums)(q, k, v, *params)
    for g, w, name in zip(values, want, ("out", "lse", "max")):
        close(g, w, OUT_TOL, name)
    for g, w, name in zip(grads, want_grads, ("q", "k", "v", "sink")):
        close(g, w, GRAD_TOL, f"d{name}")


def check_case(case, seed, **extra):
    """A context-parallel case `(strategy, layout, options, arrays)` on 4 devices against the
    unsharded call: out, lse, max and the gradients."""
    strategy, layout, options, arrays = case
    arrays = {name: jnp.asarray(x, jnp.int32) for name, x in arrays.items()}
    if "q_segment_ids" in arrays:
        arrays["kv_segment_ids"] = arrays["q_segment_ids"]
    arrays.update(extra.pop("arrays", {}))
    q, k, v = inputs(seed)
    fn, arrays = run_cp(4, strategy, layout, q, k, v, arrays, **extra, **options)
    grads, values = jax.jit(grads_and_values(fn, arrays))(q, k, v)
    want_grads, want = grads_and_values(
        lambda q, k, v, a: reference(q, k, v, a, **options), arrays)(q, k, v)
    for got, expected, name in zip(values, want, ("out", "lse", "max")):
        close(got, expected, OUT_TOL, name)
    for g, w, name in zip(grads, want_grads, "qkv"):
        close(g, w, GRAD_TOL, f"d{name}")


# The static calls that serve a backend whose masks are graph attributes (cuDNN on GPU: each
# block one call chosen by its diagonal shift, a window band or a slice of the block), run here
# on the CPU kernels made to take them (`FOLLOWS_BLOCK_STATE = False`: the block state's shift
# word is then 0, so the kernels apply only the call's static masks, as cuDNN does). S = 64 on
# 4 devices: chunks of 16 (contiguous) or 8 (zigzag); windows shorter and longer than a chunk.
STATIC_CASES = {
    "ring-zigzag-causal-window3": ("ring", "zigzag", dict(causal=True, window=(3, 0)), {}),
    "ring-zigzag-causal-window9-segments-seqlens": (
        "ring", "zigzag", dict(causal=True, window=(9, 0)),
        dict(q_segment_ids=np.repeat(np.arange(4), 16)[None].repeat(B, 0),
             q_seqlens=[60, 33], kv_seqlens=[64, 40])),
    "allgather-contiguous-two-sided-window": (
        "allgather", "contiguous", dict(causal=False, window=(5, 20)), {}),
    "ring-contiguous-full-softcap": ("ring", "contiguous", dict(causal=False, softcap=3.0), {}),
    # the diagonal moves per row by kv_len - q_len: +14 / +16, -27 / +24, +5 / +5
    "ring-zigzag-bottom-right-lengths": ("ring", "zigzag", dict(causal="bottom_right"),
                                         dict(q_seqlens=[50, 13], kv_seqlens=[64, 29])),
    "allgather-contiguous-bottom-right-lengths-segments": (
        "allgather", "contiguous", dict(causal="bottom_right"),
        dict(q_segment_ids=np.repeat(np.arange(4), 16)[None].repeat(B, 0),
             q_seqlens=[64, 40], kv_seqlens=[37, 64])),
    "ring-contiguous-bottom-right-lengths-short": (
        "ring", "contiguous", dict(causal="bottom_right"),
        dict(q_seqlens=[59, 3], kv_seqlens=[64, 8])),
}


@pytest.mark.parametrize("case", STATIC_CASES, ids=list(STATIC_CASES))
def test_static_mask_calls_equal_the_unsharded_call(case, monkeypatch):
    from attnaux import _flash_cpu

    monkeypatch.setattr(_flash_cpu, "FOLLOWS_BLOCK_STATE", False, raising=False)
    check_case(STATIC_CASES[case], 6)


# A window with a bottom-right mask and lengths, which cuDNN's static calls cannot place (the
# band moves per row by data): on GPU attnaux's Hopper kernels serve it, taking each block's
# shift from its block state. Here the kernels are their pure-JAX stand-in
# (`tests/hopper_emulation.py`), so what runs is `_hopper_packed`'s part: the token infos with
# the shift, the visiting ranges, `block_backward` with the whole problem's out and lse.
HOPPER_CASES = {
    "ring-zigzag-bottom-right-lengths-window9": (
        "ring", "zigzag", dict(causal="bottom_right", window=(9, 0)),
        dict(q_seqlens=[50, 13], kv_seqlens=[64, 29])),
    "allgather-contiguous-bottom-right-lengths-window20-segments-softcap": (
        "allgather", "contiguous", dict(causal="bottom_right", window=(20, 0), softcap=3.0),
        dict(q_segment_ids=np.repeat(np.arange(4), 16)[None].repeat(B, 0),
             q_seqlens=[64, 40], kv_seqlens=[37, 64])),
}


@pytest.mark.parametrize("case", HOPPER_CASES, ids=list(HOPPER_CASES))
def test_moving_window_on_the_hopper_kernels(case, monkeypatch):
    from hopper_emulation import emulated_kernels

    from attnaux import _hopper_packed
    from attnaux.parallel import _ring

    monkeypatch.setattr(_ring, "_backend_module", lambda backend, platform: _hopper_packed)
    with emulated_kernels():
        check_case(HOPPER_CASES[case], 7)


# Dropout at global positions with `backend="flex"` (the blockwise JAX path as the block backend:
# what serves dropout on GPU) and the CPU kernels, also where a bottom-right mask with lengths
# runs the blocks row by row (each row's call then carries its batch row in the dropout origin).
DROPOUT_CASES = {
    "ring-zigzag-causal-window-dropout": (
        "ring", "zigzag", dict(causal=True, window=(20, 0), dropout_rate=0.25), {}),
    "allgather-contiguous-bottom-right-lengths-segments-dropout": (
        "allgather", "contiguous", dict(causal="bottom_right", dropout_rate=0.1, softcap=3.0),
        dict(q_segment_ids=np.repeat(np.arange(4), 16)[None].repeat(B, 0),
             q_seqlens=[64, 40], kv_seqlens=[37, 64])),
}


@pytest.mark.parametrize("backend", ["flex", "flash"])
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=list(DROPOUT_CASES))
def test_block_backends_draw_the_unsharded_mask(case, backend):
    check_case(DROPOUT_CASES[case], 8, backend=backend,
               arrays=dict(key=jax.random.key(11)))


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=list(DROPOUT_CASES))
def test_hopper_kernels_draw_the_unsharded_mask(case, monkeypatch):
    """Dropout on the blocks of attnaux's Hopper kernels (what serves it on a Hopper GPU, where
    cuDNN's generator cannot draw a block's part), with their pure-JAX stand-in: each block's
    12-word state reaches the kernels with its origin, so the mask is the unsharded call's."""
    from hopper_emulation import emulated_kernels

    from attnaux import _hopper_packed
    from attnaux.parallel import _ring

    monkeypatch.setattr(_ring, "_backend_module", lambda backend, platform: _hopper_packed)
    with emulated_kernels():
        check_case(DROPOUT_CASES[case], 8, arrays=dict(key=jax.random.key(11)))


@pytest.mark.parametrize(("strategy", "layout"), [("ring", "zigzag"), ("allgather", "contiguous")])
def test_dropout_mask_is_the_unsharded_one(strategy, layout):
    q, k, v = inputs(3)
    key = jax.random.key(11)
    arrays = dict(key=key)
    fn, arrays = run_cp(4, strategy, layout, q, k, v, arrays, causal=True, dropout_rate=0.25)
    got = fn(q, k, v, arrays)
    want = reference(q, k, v, arrays, causal=True, dropout_rate=0.25)
    close(got[0], want[0], OUT_TOL, "out with dropout")
    got = jax.jit(jax.grad(loss_of(fn, arrays), argnums=(0, 1, 2)))(q, k, v)
    expected = jax.grad(
        loss_of(lambda q, k, v, a: reference(q, k, v, a, causal=True, dropout_rate=0.25), arrays),
        argnums=(0, 1, 2))(q, k, v)
    for g, w, name in zip(got, expected, "qkv"):
        close(g, w, GRAD_TOL, f"d{name} with dropout")


@pytest.mark.parametrize("check_vma", [True, False])
def test_ring_attention_inside_shard_map(check_vma):
    q, k, v = inputs(4)
    mesh = mesh_of(4)

    def local(q, k, v):
        out, aux = par.ring_attention(q, k, v, axis_name="sp", causal=True)
        return out, aux.lse

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(None, "sp"),
                              out_specs=(P(None, "sp"), P(None, None, "sp")),
                              check_vma=check_vma))
    out, lse = f(q, k, v)
    want = reference(q, k, v, {}, causal=True)
    close(out, want[0], OUT_TOL, "out")
    close(lse, want[1], OUT_TOL, "lse")
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)[0])), argnums=(0, 1, 2)))
    expected = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(reference(q, k, v, {}, causal=True)[0])),
                        argnums=(0, 1, 2))
    for got, w, name in zip(g(q, k, v), expected(q, k, v), "qkv"):
        close(got, w, GRAD_TOL, f"d{name}")


def test_outputs_are_sequence_sharded_and_the_ring_is_a_loop():
    """`NamedSharding` out; the compiled program has the same number of kernel calls for 2 and
    8 devices (a loop over the ring, not an unrolled one), and the ring strategy moves k and v
    with collective-permutes only."""
    q, k, v = inputs()
    counts = {}
    for n in (2, 8):
        mesh = mesh_of(n)
        sharding = NamedSharding(mesh, P(None, "sp"))
        sq, sk, sv = (jax.device_put(x, sharding) for x in (q, k, v))
        f = jax.jit(lambda q, k, v, mesh=mesh: par.context_parallel_attention(
            q, k, v, mesh=mesh, axis_name="sp", causal=True))
        out, aux = f(sq, sk, sv)
        assert out.sharding.is_equivalent_to(sharding, 4)
        assert tuple(aux.lse.sharding.spec)[:3] == (None, None, "sp")
        text = f.lower(sq, sk, sv).compile().as_text()
        counts[n] = len(re.findall(r"attnaux_flash_fwd", text))
        assert "all-gather" not in text and "all-to-all" not in text
    assert counts[2] == counts[8], counts


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        (dict(bias=jnp.zeros((S, S))), r"`bias` is not supported by context parallelism"),
        (dict(return_probs=True), r"`return_probs` is not supported by context parallelism"),
        (dict(strategy="tree"), r"`strategy` must be one of"),
        (dict(layout="striped"), r"`layout` must be one of"),
    ],
    ids=["bias", "return_probs", "strategy", "layout"],
)
def test_unsupported_options_raise(options, pattern):
    q, k, v = inputs()
    mesh = mesh_of(2)
    with pytest.raises(ValueError, match=pattern):
        par.context_parallel_attention(q, k, v, mesh=mesh, axis_name="sp", **options)


def test_zigzag_round_trip_and_balance():
    x = jnp.arange(2 * 16).reshape(2, 16)
    z = par.zigzag(x, 4, axis=1)
    np.testing.assert_array_equal(np.asarray(par.unzigzag(z, 4, axis=1)), np.asarray(x))
    # device i holds chunks i and 7 - i of 8: the same number of causal pairs on every device
    chunks = np.asarray(z[0]).reshape(4, 2, 2)[:, :, 0] // 2
    work = [sum(c + 1 for c in dev) for dev in chunks.tolist()]
    assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match="2 \\* num_devices = 8 equal chunks"):
        par.zigzag(jnp.zeros((2, 12)), 4, axis=1)


@pytest.mark.parametrize("layout", [pytest.param("contiguous", marks=pytest.mark.slow), "zigzag"])
def test_decoder_with_context_parallelism(layout):
    """`attnaux.nn.Decoder` with `context=...` inside `shard_map` over the sequence: the loss
    and every parameter gradient equal the decoder's on the whole sequence (one device).
    One block: each block is one more ring program to compile (a Python loop over blocks), and
    a second block would run the same context-parallel call on the first one's output."""
    import equinox as eqx

    from attnaux.nn import Decoder

    n, seq = 4, 64
    mesh = mesh_of(n)
    model = Decoder(vocab=32, max_len=seq, dim=16, depth=1, num_heads=4, kv_heads=2,
                    key=jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (2, seq), 0, 32)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    zz = layout == "zigzag"
    positions = jnp.arange(seq)
    if zz:
        tokens_in, positions_in = par.zigzag(tokens, n, axis=1), par.zigzag(positions, n, axis=0)
    else:
        tokens_in, positions_in = tokens, positions

    def token_loss(logits, tokens):  # a sum over tokens: the devices' parts add up
        return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1))

    def cp_loss(params, tokens, positions):
        m = eqx.combine(params, static)
        ctx = dict(axis_name="sp", layout=layout)
        logits, _ = jax.vmap(lambda t: m(t, positions=positions, context=ctx))(tokens)
        return jax.lax.psum(token_loss(logits, tokens), "sp")

    def plain_loss(params, tokens):
        logits, _ = jax.vmap(eqx.combine(params, static))(tokens)
        return token_loss(logits, tokens)

    f = jax.jit(jax.shard_map(jax.value_and_grad(cp_loss), mesh=mesh,
                              in_specs=(P(), P(None, "sp"), P("sp")), out_specs=P()))
    value, grads = f(params, tokens_in, positions_in)
    want_value, want = jax.value_and_grad(plain_loss)(params, tokens)
    close(value, want_value, 1e-5, "loss")
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        close(g, w, 1e-4, "parameter gradient")
