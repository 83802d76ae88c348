import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, jaxtyped

from attnaux._internal import AttnAux, Canonical, Options

from ._blockwise import (
    DEFAULT_BLOCK_SIZE,
    Arr,
    Layout,
    block_scores,
    canonical_problem,
    check_aux,
    check_block_size,
    compute_dtype,
    keep_block,
    kv_full,
    layout,
    pad_keys,
    probs_of,
    safe_lse,
    typechecker,
)


class AttnGrads(eqx.Module):
    """The gradients [`attnaux.introspect.attention_vjp`][] returns.

    **Fields:**

    - `q`, `k`, `v`: gradients with the shapes and dtypes of `q`, `k`, `v`.
    - `bias`: gradient with the shape and dtype of the `bias` given (summed over its broadcast
      dimensions), or `None` when no bias was given.
    - `sink`: `[q_heads]` gradient of the sink, or `None` when no sink was given.
    """

    q: Array
    k: Array
    v: Array
    bias: Array | None = None
    sink: Array | None = None


@functools.partial(jax.jit, static_argnames=("options", "lay", "kv_seq", "rate"))
def _backward(
    arrays: Canonical, out, dout, lse, dlse, rng_state, *, options: Options, lay: Layout,
    kv_seq: int, rate: float,
):
    compute = compute_dtype(arrays)
    padded = pad_keys(arrays, lay)
    bsz, q_seq, q_heads, qk_dim = arrays.q.shape
    kv_heads, v_dim = arrays.v.shape[2], arrays.v.shape[3]
    group = q_heads // kv_heads
    lse_safe = safe_lse(lse, compute)
    dout = dout.astype(compute)
    # Dt = rowsum(dout * out) - dlse: the per-row term of the softmax backward.
    d_row = jnp.einsum("bqhd,bqhd->bhq", dout, out.astype(compute)) - dlse.astype(compute)
    bias = arrays.bias
    bias_full = bias is not None and kv_full(bias, kv_seq)

    def reduce_bias(ds):  # [B, Hq, Sq, block] -> the canonical bias's broadcast dims
        axes = tuple(a for a in range(3) if bias.shape[a] == 1 and ds.shape[a] != 1)
        ds = jnp.sum(ds, axis=axes, keepdims=True)
        return ds if bias_full else jnp.sum(ds, axis=3, keepdims=True)

    def body(carry, n):
        dq, dbias = carry
        sc = block_scores(padded, options, lay, n, kv_seq, with_v=True)
        p = probs_of(sc, lse_safe)
        dout_z = jnp.where(sc.rows.transpose(0, 2, 1)[..., None], dout, 0)
        dout_z = dout_z.reshape(bsz, q_seq, kv_heads, group, v_dim)
        if rate > 0:
            keep = keep_block(rng_state, rate, (bsz, q_heads, q_seq), kv_seq, sc.j)
            drop = jnp.where(keep, 1 / (1 - rate), 0).astype(compute)
            p_drop = p * drop
        else:
            p_drop = p
        p5 = p_drop.reshape(bsz, kv_heads, group, q_seq, lay.block)
        dv = jnp.einsum("bhgqk,bqhgd->bkhd", p5, dout_z, precision=jax.lax.Precision.HIGHEST)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", dout_z, sc.v, precision=jax.lax.Precision.HIGHEST)
        dp = dp.reshape(bsz, q_heads, q_seq, lay.block)
        if rate > 0:
            dp = dp * drop
        ds = jnp.where(sc.visible, p * (dp - d_row[..., None]), 0)  # dL/ds; = dbias
        dr = ds
        if options.softcap > 0:
            dr = ds * (1 - jnp.tanh(sc.r / options.softcap) ** 2)
        dr5 = dr.reshape(bsz, kv_heads, group, q_seq, lay.block)
        dq = dq + options.scale * jnp.einsum(
            "bhgqk,bkhd->bqhgd", dr5, sc.k, precision=jax.lax.Precision.HIGHEST
        ).reshape(bsz, q_seq, q_heads, qk_dim)
        dk = options.scale * jnp.einsum(
            "bhgqk,bqhgd->bkhd", dr5, sc.q, precision=jax.lax.Precision.HIGHEST
        )
        db_blk = None
        if bias is not None:
            if bias_full:
                db_blk = reduce_bias(ds)
            else:
                dbias = dbias + reduce_bias(ds)
        return (dq, dbias), (dk, dv, db_blk)

    dq0 = jnp.zeros((bsz, q_seq, q_heads, qk_dim), compute)
    db0 = None
    if bias is not None and not bias_full:
        db0 = jnp.zeros(bias.shape[:3] + (1,), compute)
    (dq, dbias), (dk, dv, db_blocks) = jax.lax.scan(
        body, (dq0, db0), jnp.arange(lay.n_blocks, dtype=jnp.int32)
    )

    def keys_back(x):  # [n_blocks, B, block, ...] -> [B, kv_seq, ...]
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(x.shape[0], lay.padded, *x.shape[3:])[:, :kv_seq]

    dk, dv = keys_back(dk), keys_back(dv)
    if bias_full:  # [n_blocks, Bb, Hb, Sqb, block] -> [Bb, Hb, Sqb, kv_seq]
        dbias = jnp.moveaxis(db_blocks, 0, 3)
        dbias = dbias.reshape(*dbias.shape[:3], lay.padded)[..., :kv_seq]

    dsink = None
    if arrays.sink is not None:
        sink = arrays.sink.astype(compute)[None, :, None]
        share = jnp.where(jnp.isfinite(lse), jnp.exp(sink - lse.astype(compute)), 0)
        dsink = -jnp.sum(share * d_row, axis=(0, 2))
    return dq, dk, dv, dbias, dsink


def _sum_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums the broadcast dims of a gradient down to `shape` (numpy broadcasting rules)."""
    lead = x.ndim - len(shape)
    x = jnp.sum(x, axis=tuple(range(lead))) if lead > 0 else x
    pairs = enumerate(zip(x.shape, shape, strict=True))
    axes = tuple(a for a, (got, want) in pairs if want == 1 and got != 1)
    return jnp.sum(x, axis=axes, keepdims=True).reshape(shape)


@jaxtyped(typechecker=typechecker)
def attention_vjp(
    q: Float[Arr, "*batch q_seq q_heads qk_dim"],
    k: Float[Arr, "*batch kv_seq kv_heads qk_dim"],
    v: Float[Arr, "*batch kv_seq kv_heads v_dim"],
    out: Float[Arr, "*batch q_seq q_heads v_dim"],
    aux: AttnAux,
    dout: Float[Arr, "*batch q_seq q_heads v_dim"],
    dlse: Float[Arr, "*batch q_heads q_seq"] | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    **options,
) -> AttnGrads:
    """The backward pass of an attention call, from its output and `aux.lse`, in pure JAX.

    Computes the gradients of `attnaux.attention(q, k, v, **options)` for the cotangents `dout`
    (of the output) and `dlse` (of `aux.lse`), FlashAttention-2 style: the probabilities are
    recomputed from `aux.lse` one block of keys at a time (memory linear in sequence length) and

    ```
    D  = rowsum(dout * out) - dlse
    dP = dout @ v^T                     (times the dropout scale where kept)
    dS = P * (dP - D)                   (= the gradient of the bias)
    dR = dS * (1 - tanh(r / softcap)^2) (softcap only; r = scale * q @ k^T)
    dq = scale * dR @ k,   dk = scale * dR^T @ q,   dv = (P * drop)^T @ dout
    dsink = -sum_rows exp(sink - lse) * D
    ```

    It equals the fused backward (`jax.grad` through `attnaux.attention`) up to float32
    rounding. Use it to write a custom backward pass with `jax.custom_vjp` that changes the
    gradients of attention (clipping, scaling, recording them) without re-deriving attention's
    backward: see the guide (`docs/introspect.md`) for a complete example.

    **Arguments:**

    - `q`, `k`, `v`: the inputs of the call.
    - `out`, `aux`: what the call returned.
    - `dout`: the cotangent of `out`, `[*batch, q_seq, q_heads, v_dim]`.
    - `dlse`: the cotangent of `aux.lse`, `[*batch, q_heads, q_seq]`, or `None` for zero.
    - `block_size`: keys per block of the internal scan.
    - `**options`: the keywords of that call: `scale`, `bias`, `mask`, `causal`, `window`,
      `q_seqlens`, `kv_seqlens`, `q_segment_ids`, `kv_segment_ids`, `softcap`, `sink` and
      `dropout_rate` (the dropout mask is regenerated from `aux.rng_state`). `key`,
      `return_probs` and `backend` are accepted and ignored.

    **Returns:**

    An [`AttnGrads`][attnaux.introspect.AttnGrads] with `q`, `k`, `v` in the input dtypes and
    shapes, `bias` in the bias's shape (or `None`) and `sink` `[q_heads]` (or `None`).

    **Example:**

    ```python
    out, aux = ax.attention(q, k, v, causal=True)
    g = ai.attention_vjp(q, k, v, out, aux, dout=jnp.ones_like(out), causal=True)
    g.q, g.k, g.v        # equal to jax.grad of (out * 1).sum() with respect to q, k, v
    ```
    """
    block_size = check_block_size(block_size)
    problem, rate = canonical_problem("attention_vjp", q, k, v, options)
    check_aux("attention_vjp", aux, problem)
    arrays = problem.arrays
    batch = problem.batch_shape
    bsz, q_seq, q_heads, _ = arrays.q.shape
    kv_seq, _, v_dim = arrays.v.shape[1:]
    rows = (bsz, q_heads, q_seq)
    if tuple(jnp.shape(out)) != (*batch, q_seq, q_heads, v_dim):
        raise ValueError(
            f"`out` must have shape [*batch, q_seq, q_heads, v_dim] = "
            f"{(*batch, q_seq, q_heads, v_dim)}; got {tuple(jnp.shape(out))}."
        )
    if tuple(jnp.shape(dout)) != tuple(jnp.shape(out)):
        raise ValueError(
            f"`dout` must have the shape of `out`, {tuple(jnp.shape(out))}; got "
            f"{tuple(jnp.shape(dout))}."
        )
    rng_state = None
    if rate > 0:
        if aux.rng_state is None:
            raise ValueError(
                f"`dropout_rate={rate}` was given but `aux.rng_state` is None: the call that "
                "made `aux` used no dropout. Pass the dropout_rate of that call."
            )
        if aux.dropout_impl != "attnaux":
            raise ValueError(
                f"`aux.dropout_impl` is {aux.dropout_impl!r}: the dropout mask of that call was "
                "drawn by cuDNN (the GPU flash backend), and attention_vjp regenerates attnaux's "
                "own Philox mask block by block. Differentiate the attention call itself (its "
                "fused backward replays cuDNN's mask), or use backend='reference' for dropout."
            )
        rng_state = aux.rng_state
    lse = jnp.reshape(aux.lse, rows)
    dlse = jnp.zeros(rows, jnp.float32) if dlse is None else jnp.reshape(dlse, rows)
    dq, dk, dv, dbias, dsink = _backward(
        arrays, jnp.reshape(out, (bsz, q_seq, q_heads, v_dim)),
        jnp.reshape(dout, (bsz, q_seq, q_heads, v_dim)), lse, dlse, rng_state,
        options=problem.options, lay=layout(kv_seq, block_size), kv_seq=kv_seq, rate=rate,
    )
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    grads_bias = None
    bias = options.get("bias")
    if bias is not None:
        bias = jnp.asarray(bias)
        if dbias.shape[0] == 1:
            full = dbias.reshape((1,) * len(batch) + dbias.shape[1:])
        else:
            full = dbias.reshape(batch + dbias.shape[1:])
        grads_bias = _sum_to(full, tuple(bias.shape)).astype(bias.dtype)
    grads_sink = None
    if dsink is not None:
        grads_sink = dsink.astype(jnp.asarray(options["sink"]).dtype)
    return AttnGrads(
        q=dq.reshape(q.shape).astype(q.dtype),
        k=dk.reshape(k.shape).astype(k.dtype),
        v=dv.reshape(v.shape).astype(v.dtype),
        bias=grads_bias,
        sink=grads_sink,
    )


del np
