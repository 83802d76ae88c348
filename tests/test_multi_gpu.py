"""attnaux on several GPUs of one host (issue 27), through NCCL: what `tests/spmd` checks on 8
host CPU devices, on real GPUs with the GPU kernels (cuDNN `flash`, attnaux's CUDA `probs`).

- Batch / head sharding under `jax.jit`: the compiled programs (forward and gradients) hold no
  collective at all, and the values equal the unsharded call on one GPU; also for the calls
  `flash` serves on attnaux's Hopper kernels (segment ids, score_mod/mask_mod).
- Dropout under batch / head sharding: `probs` (attnaux's generator, which follows each shard's
  global origin) draws the unsharded call's keep-mask; cuDNN `flash`, whose generator cannot,
  raises (docs/sharding.md).
- Context parallelism (`attnaux.parallel`) on 2, 4 (and 8) GPUs: ring and all-gather, contiguous
  and zigzag, causal and not, GQA, segment ids, global lengths, windows, softcap and sink: out,
  lse, max and the gradients (through `aux.lse` too) equal `attnaux.attention(backend="flash")`
  of the whole sequence on one GPU, also with a bottom-right mask and lengths, and with a window
  on top of it on a Hopper GPU (attnaux's own kernels serve those blocks); dropout runs on
  attnaux's Hopper kernels and with `backend="flex"` (blockwise JAX), both drawing attnaux's
  generator's mask (the `reference` call's), and is refused on other GPUs, as is that window.

Skipped without 2 or more GPUs (CI has none). Tolerances: bfloat16 inputs for cuDNN; both sides
round `out` and the gradients to bfloat16 (1 ulp = 7.8e-3 relative), and the ring merges block
results in float32 in another order than one kernel's running sums; cuDNN's backward accumulates
dq with atomics. So `out` and gradients within 2e-2 of the largest reference entry (as
`tests/test_parallel_one_device.py`), lse and max (float32 statistics of the same bfloat16
products) within 1e-3 of it. `probs` runs in float32 at the highest matmul precision: 1e-5.
"""

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import attnaux as ax
import attnaux.parallel as par
from attnaux import introspect as ai

ON_HOPPER = (jax.default_backend() == "gpu"
             and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9."))


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPUS = _gpus()
COUNTS = [n for n in (2, 4, 8) if n <= len(GPUS)]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(len(GPUS) < 2, reason="needs 2 or more GPUs of one host")]

BF16_TOL, STAT_TOL, F32_TOL = 2e-2, 1e-3, 1e-5
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def collectives(compiled_text: str) -> dict[str, int]:
    return {c: n for c in COLLECTIVES
            if (n := len(re.findall(rf"\b{c}(?:-start)?\(", compiled_text)))}


def close(a, b, tol, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), finite), f"{what}: non-finite entries differ"
    scale = max(1.0, float(np.max(np.abs(b[finite])))) if finite.any() else 1.0
    diff = np.where(finite, a, 0.0) - np.where(finite, b, 0.0)
    err = float(np.max(np.abs(diff))) if a.size else 0.0
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol * scale:.3g}"


def check(values, grads, want, want_grads):
    """`(out, lse, max)` and the gradients (q, k, v[, sink]) against the one-GPU call's."""
    for got, expected, name in zip(values, want, ("out", "lse", "max")):
        close(got, expected, BF16_TOL if name == "out" else STAT_TOL, name)
    for g, w, name in zip(grads, want_grads, ("q", "k", "v", "sink")):
        close(g, w, BF16_TOL, f"d{name}")


def inputs(batch, seq, heads, kv_heads, dim, dtype=jnp.bfloat16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, (batch, seq, h, dim), dtype)
                 for key, h in zip(ks, (heads, kv_heads, kv_heads)))


def one_gpu(*arrays):
    return tuple(None if x is None else jax.device_put(x, GPUS[0]) for x in arrays)


def probe_loss(attend):
    """`sum(out * w) + 0.3 * sum(lse)` (finite rows) of `attend(*args) -> (out, aux)`, with
    `(out, lse, max)` as has_aux values (one program checks the values and the gradients)."""
    def loss(*args):
        out, aux = attend(*args)
        w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        lse = jnp.where(jnp.isfinite(aux.lse), aux.lse, 0.0)
        value = jnp.sum(out.astype(jnp.float32) * w) + 0.3 * jnp.sum(lse)
        return value, (out, aux.lse, aux.max)
    return loss


class _Stats(NamedTuple):
    lse: jax.Array
    max: jax.Array


# ------------------------------------------------------------------------------------------------
# Batch and head sharding under jit: shard-local kernels
# ------------------------------------------------------------------------------------------------
SHARDING_OPTIONS = {
    "causal": dict(causal=True),
    "window_softcap_lengths_sink": dict(causal=True, window=(96, 0), softcap=30.0),
}


@pytest.mark.parametrize("spec_name", ["batch", "heads", "batch+heads"])
@pytest.mark.parametrize("case", SHARDING_OPTIONS)
def test_flash_sharded_over_batch_and_heads_is_shard_local(spec_name, case):
    n = len(GPUS)
    if spec_name == "batch+heads":
        if n < 4:
            pytest.skip("a 2-D mesh needs 4 GPUs")
        mesh = jax.make_mesh((n // 2, 2), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        spec = P("data", None, "model")
    else:
        mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        spec = P("data") if spec_name == "batch" else P(None, None, "data")
    batch, heads, kv_heads = 2 * n, 4 * n, 2 * n
    q, k, v = inputs(batch, 384, heads, kv_heads, 128)
    options = dict(SHARDING_OPTIONS[case], backend="flash")
    extra = ()
    if case != "causal":
        rng = np.random.default_rng(0)
        options["kv_seqlens"] = jnp.asarray(rng.integers(1, 385, batch), jnp.int32)
        extra = (jnp.asarray(rng.standard_normal(heads), jnp.float32),)

    def attend(q, k, v, *sink):
        return ax.attention(q, k, v, sink=sink[0] if sink else None, **options)

    argnums = tuple(range(3 + len(extra)))
    grad = jax.grad(probe_loss(attend), argnums=argnums, has_aux=True)
    sharded = tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
    sink_sharding = NamedSharding(mesh, P(None if spec_name == "batch" else spec[-1]))
    sharded += tuple(jax.device_put(s, sink_sharding) for s in extra)
    for what, fn in (("forward", jax.jit(attend)), ("gradients", jax.jit(grad))):
        found = collectives(fn.lower(*sharded).compile().as_text())
        if what == "gradients" and extra and spec_name != "heads":
            found.pop("all-reduce", None)  # the sink's gradient sums over the sharded batch
        assert not found, f"{spec_name} {what}: collectives in the compiled HLO: {found}"
    grads, values = jax.jit(grad)(*sharded)
    want_grads, want = jax.jit(grad)(*one_gpu(q, k, v, *extra))
    check(values, grads, want, want_grads)


def _hopper_case(case, batch, heads, seq):
    """Options of a call that `flash` serves on attnaux's Hopper kernels: segment ids
    (`_hopper_packed`) or score_mod/mask_mod reading the batch and head index and a captured
    per-head array (`_hopper_mods`)."""
    rng = np.random.default_rng(1)
    if case == "segment_ids":
        ids = jnp.asarray(np.sort(rng.integers(0, 4, (batch, seq)), axis=1), jnp.int32)
        return dict(causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    slopes = jnp.asarray(rng.uniform(0.01, 0.1, heads), jnp.float32)
    return dict(score_mod=lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j) + 0.05 * b,
                mask_mod=lambda b, h, i, j: (j <= i) | (h % 2 == 0))


@pytest.mark.parametrize("spec_name", ["batch", "heads"])
@pytest.mark.parametrize("case", ["segment_ids", "score_mod"])
@pytest.mark.parametrize("dim", [64, 128])
def test_hopper_kernels_sharded_over_batch_and_heads_are_shard_local(spec_name, case, dim):
    """The Hopper kernel calls are partitioned like the cuDNN ones: each GPU runs its shard
    (no collective in the compiled forward or gradients) and the shards see their global
    batch and head indices (the score_mod reads both). Head dim 64 takes the backward that
    sums dQ inside the dK/dV kernel (reduce-adds into a `pl.run_state` buffer; `jax.new_ref`'s
    effect could not be lowered inside `custom_partitioning`), 128 the two kernels."""
    if not ON_HOPPER:
        pytest.skip("attnaux's own kernels need a Hopper GPU")
    n = len(GPUS)
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = P("data") if spec_name == "batch" else P(None, None, "data")
    batch, heads, kv_heads, seq = 2 * n, 4 * n, 2 * n, 384
    q, k, v = inputs(batch, seq, heads, kv_heads, dim, seed=4)
    options = dict(_hopper_case(case, batch, heads, seq), backend="flash")
    assert "Hopper" in str(ax.explain(*one_gpu(q, k, v), **options))

    def attend(q, k, v):
        return ax.attention(q, k, v, **options)

    grad = jax.grad(probe_loss(attend), argnums=(0, 1, 2), has_aux=True)
    sharded = tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
    for what, fn in (("forward", jax.jit(attend)), ("gradients", jax.jit(grad))):
        found = collectives(fn.lower(*sharded).compile().as_text())
        assert not found, f"{case} {spec_name} {what}: collectives in the compiled HLO: {found}"
    grads, values = jax.jit(grad)(*sharded)
    want_grads, want = jax.jit(grad)(*one_gpu(q, k, v))
    check(values, grads, want, want_grads)


# ------------------------------------------------------------------------------------------------
# Dropout under batch and head sharding
# ------------------------------------------------------------------------------------------------
def test_sharded_dropout_draws_the_unsharded_mask():
    n = len(GPUS)
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = inputs(2 * n, 64, 2 * n, n, 32, jnp.float32, seed=3)
    key = jax.random.key(11)

    def attend(q, k, v):
        return ax.attention(q, k, v, backend="probs", causal=True, dropout_rate=0.25, key=key)

    with jax.default_matmul_precision("highest"):
        for spec in (P("data"), P(None, None, "data")):
            sharded = tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
            out, aux = jax.jit(attend)(*sharded)
            want, want_aux = jax.jit(attend)(*one_gpu(q, k, v))
            np.testing.assert_array_equal(np.asarray(aux.rng_state),
                                          np.asarray(want_aux.rng_state))
            close(out, want, F32_TOL, f"out with dropout, {spec}")
        keep = jax.device_put(ai.dropout_mask(aux, q, k, dropout_rate=0.25), GPUS[0])
        _, plain = ax.attention(*one_gpu(q, k, v), backend="reference", causal=True,
                                return_probs=True)
        weights = plain.probs * keep / 0.75
        replay = jnp.einsum("bhqk,bkhd->bqhd", weights, jnp.repeat(one_gpu(v)[0], 2, axis=2))
        close(out, replay, 1e-4, "out vs the replayed keep-mask")


def test_sharded_cudnn_dropout_raises():
    n = len(GPUS)
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = inputs(2 * n, 64, 4, 2, 64)
    sharded = tuple(jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v))
    # raised by the partitioner's callback while compiling (JAX may re-raise it wrapped)
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match="dropout"):
        jax.jit(lambda q, k, v: ax.attention(q, k, v, backend="flash", dropout_rate=0.1,
                                             key=jax.random.key(0)))(*sharded)


# ------------------------------------------------------------------------------------------------
# Context parallelism
# ------------------------------------------------------------------------------------------------
def cp_attend(n, strategy, layout, **options):
    """`context_parallel_attention` over the first n GPUs, taking and returning natural order."""
    mesh = jax.make_mesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=GPUS[:n])
    zz = layout == "zigzag"

    def perm(x, axis):
        return par.zigzag(x, n, axis=axis) if zz else x

    def unperm(x, axis):
        return par.unzigzag(x, n, axis=axis) if zz else x

    def attend(q, k, v, *sink, segment_ids=None):
        segs = {}
        if segment_ids is not None:
            segs = dict(q_segment_ids=perm(segment_ids, -1), kv_segment_ids=perm(segment_ids, -1))
        out, aux = par.context_parallel_attention(
            perm(q, 1), perm(k, 1), perm(v, 1), mesh=mesh, axis_name="sp", strategy=strategy,
            layout=layout, sink=sink[0] if sink else None, **segs, **options)
        return unperm(out, 1), _Stats(unperm(aux.lse, 2), unperm(aux.max, 2))

    return attend


CP_CASES = [(n, s, lay, c) for n in COUNTS for s, lay, c in
            (("ring", "zigzag", True), ("ring", "contiguous", True), ("ring", "contiguous", False),
             ("allgather", "zigzag", True), ("allgather", "contiguous", False))]


@pytest.mark.parametrize(("n", "strategy", "layout", "causal"), CP_CASES,
                         ids=[f"{n}-{s}-{lay}-{'causal' if c else 'full'}"
                              for n, s, lay, c in CP_CASES])
def test_context_parallel_equals_the_one_gpu_call(n, strategy, layout, causal):
    q, k, v = inputs(2, 256 * n, 8, 2, 128, seed=n)
    cp = jax.grad(probe_loss(cp_attend(n, strategy, layout, causal=causal)),
                  argnums=(0, 1, 2), has_aux=True)
    plain = jax.grad(probe_loss(lambda q, k, v: ax.attention(q, k, v, causal=causal,
                                                             backend="flash")),
                     argnums=(0, 1, 2), has_aux=True)
    compiled = jax.jit(cp).lower(q, k, v).compile().as_text()
    found = collectives(compiled)
    if strategy == "ring":
        assert "collective-permute" in found and "all-gather" not in found, found
    else:
        assert "all-gather" in found, found
    grads, values = jax.jit(cp)(q, k, v)
    want_grads, want = jax.jit(plain)(*one_gpu(q, k, v))
    check(values, grads, want, want_grads)


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_context_parallel_options_at_global_positions(strategy):
    """GQA, segment ids travelling with their keys, global lengths, softcap and a sink."""
    n = COUNTS[-1]
    seq = 256 * n
    q, k, v = inputs(2, seq, 8, 4, 64, seed=5)
    rng = np.random.default_rng(5)
    segment_ids = jnp.asarray(np.sort(rng.integers(0, 5, (2, seq)), axis=1), jnp.int32)
    lengths = jnp.asarray([seq, seq - 3 * seq // 8], jnp.int32)
    sink = jnp.asarray(rng.standard_normal(8), jnp.float32)
    options = dict(causal=True, softcap=20.0, q_seqlens=lengths, kv_seqlens=lengths)
    cp_fn = cp_attend(n, strategy, "zigzag", **options)
    cp = jax.grad(probe_loss(lambda q, k, v, s: cp_fn(q, k, v, s, segment_ids=segment_ids)),
                  argnums=(0, 1, 2, 3), has_aux=True)
    plain = jax.grad(probe_loss(lambda q, k, v, s: ax.attention(
        q, k, v, sink=s, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
        backend="flash", **options)), argnums=(0, 1, 2, 3), has_aux=True)
    grads, values = jax.jit(cp)(q, k, v, sink)
    want_grads, want = jax.jit(plain)(*one_gpu(q, k, v, sink))
    check(values, grads, want, want_grads)


@pytest.mark.parametrize(("strategy", "layout", "options"), [
    ("ring", "zigzag", dict(causal=True, window=(100, 0))),
    ("allgather", "contiguous", dict(causal=False, window=(300, 50))),
    ("ring", "zigzag", dict(causal="bottom_right", q_seqlens=jnp.asarray([700, 200]),
                            kv_seqlens=jnp.asarray([1024, 150]))),
    ("ring", "zigzag", dict(causal="bottom_right", q_seqlens=jnp.asarray([700, 200]),
                            kv_seqlens=jnp.asarray([1024, 150]), window=(64, 0))),
], ids=["causal-window", "two-sided-window", "bottom-right-lengths",
        "bottom-right-lengths-window"])
def test_context_parallel_windows(strategy, layout, options):
    """Windows shorter and longer than a chunk (128 tokens with zigzag, 256 contiguous): static
    cuDNN bands, and slices of a block where a band starts right of its diagonal; a bottom-right
    mask with lengths, whose diagonal moves per row (lengths for the 1024 tokens of 4 GPUs)."""
    n = COUNTS[-1]
    if "q_seqlens" in options and n != 4:
        pytest.skip("the lengths are chosen for 4 GPUs (1024 tokens)")
    if "q_seqlens" in options and "window" in options and not ON_HOPPER:
        pytest.skip("a window with a bottom-right mask and lengths needs a Hopper GPU")
    q, k, v = inputs(2, 256 * n, 8, 4, 64, seed=6)
    cp = jax.grad(probe_loss(cp_attend(n, strategy, layout, **options)), argnums=(0, 1, 2),
                  has_aux=True)
    plain = jax.grad(probe_loss(lambda q, k, v: ax.attention(q, k, v, backend="flash",
                                                             **options)),
                     argnums=(0, 1, 2), has_aux=True)
    grads, values = jax.jit(cp)(q, k, v)
    want_grads, want = jax.jit(plain)(*one_gpu(q, k, v))
    check(values, grads, want, want_grads)


def test_context_parallel_dropout_with_flex_blocks():
    """`backend="flex"` under context parallelism on GPUs: each block draws its part of the
    unsharded call's keep-mask (attnaux's generator), so the values and gradients equal the
    `reference` backend (the same generator) on one GPU with the same key; float32 inputs."""
    n = COUNTS[-1]
    q, k, v = inputs(1, 128 * n, 4, 2, 64, dtype=jnp.float32, seed=9)
    options = dict(causal=True, window=(150, 0), dropout_rate=0.2, key=jax.random.key(4))
    cp = jax.grad(probe_loss(cp_attend(n, "ring", "zigzag", backend="flex", **options)),
                  argnums=(0, 1, 2), has_aux=True)
    plain = jax.grad(probe_loss(lambda q, k, v: ax.attention(q, k, v, backend="reference",
                                                             **options)),
                     argnums=(0, 1, 2), has_aux=True)
    with jax.default_matmul_precision("highest"):  # float32 products, not TF32, both sides
        grads, values = jax.jit(cp)(q, k, v)
        want_grads, want = jax.jit(plain)(*one_gpu(q, k, v))
    for got, expected, name in zip(values, want, ("out", "lse", "max")):
        close(got, expected, 1e-4, name)
    for g, w, name in zip(grads, want_grads, "qkv"):
        close(g, w, 1e-4, f"d{name}")


@pytest.mark.skipif(not ON_HOPPER, reason="needs Hopper GPUs (attnaux's own kernels)")
def test_context_parallel_dropout_on_the_hopper_kernels():
    """Dropout under context parallelism with the default backend on Hopper GPUs: attnaux's
    own kernels serve the blocks, each drawing its part of the unsharded call's keep-mask, so
    the values and gradients equal the `reference` backend (the same generator) on one GPU
    with the same key; bfloat16 inputs on both sides."""
    n = COUNTS[-1]
    q, k, v = inputs(2, 256 * n, 8, 4, 64, seed=10)
    options = dict(causal=True, window=(300, 0), dropout_rate=0.2, key=jax.random.key(5),
                   kv_seqlens=jnp.asarray([256 * n, 256 * n - 77]))
    cp = jax.grad(probe_loss(cp_attend(n, "ring", "zigzag", **options)), argnums=(0, 1, 2),
                  has_aux=True)
    plain = jax.grad(probe_loss(lambda q, k, v: ax.attention(q, k, v, backend="reference",
                                                             **options)),
                     argnums=(0, 1, 2), has_aux=True)
    grads, values = jax.jit(cp)(q, k, v)
    want_grads, want = jax.jit(plain)(*one_gpu(q, k, v))
    check(values, grads, want, want_grads)


@pytest.mark.parametrize("options", [
    dict(dropout_rate=0.1, causal=True),
    dict(causal="bottom_right", kv_seqlens=jnp.asarray([400]), window=(64, 0))])
def test_context_parallel_refuses_what_cudnn_cannot_place(options):
    if ON_HOPPER:
        pytest.skip("attnaux's Hopper kernels serve it (test_context_parallel_windows, "
                    "test_context_parallel_dropout_on_the_hopper_kernels)")
    q, k, v = inputs(1, 512, 4, 4, 64)
    if "dropout_rate" in options:
        options = dict(options, key=jax.random.key(0))
    with pytest.raises(ValueError, match="context parallelism"):
        jax.jit(cp_attend(2, "ring", "zigzag", **options))(q, k, v)
