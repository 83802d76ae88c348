import functools

import jax
import jax.numpy as jnp
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
    layout,
    pad_keys,
    probs_of,
    safe_lse,
    typechecker,
    unflatten,
)


@functools.partial(jax.jit, static_argnames=("options", "lay", "kv_seq", "what"))
def _scan(arrays: Canonical, lse, *, options: Options, lay: Layout, kv_seq: int, what: str):
    compute = compute_dtype(arrays)
    lse_safe = safe_lse(lse, compute)
    padded = pad_keys(arrays, lay)
    bsz, q_seq, q_heads, _ = arrays.q.shape

    def body(acc, n):
        scores = block_scores(padded, options, lay, n, kv_seq, with_v=False)
        p = probs_of(scores, lse_safe)
        if what == "probs":
            return acc, p
        # -P log P with log P = s - lse on visible entries; 0 elsewhere.
        term = jnp.where(scores.visible, -p * (scores.s - lse_safe[..., None]), 0)
        return acc + jnp.sum(term, axis=-1), None

    init = jnp.zeros((bsz, q_heads, q_seq), compute)
    acc, blocks = jax.lax.scan(body, init, jnp.arange(lay.n_blocks, dtype=jnp.int32))
    if what == "probs":
        # [n_blocks, B, Hq, Sq, block] -> [B, Hq, Sq, kv_seq]
        probs = jnp.moveaxis(blocks, 0, 3).reshape(bsz, q_heads, q_seq, lay.padded)
        return probs[..., :kv_seq]
    return acc


def _run(fn_name, q, k, aux, block_size, mask_options, what):
    block_size = check_block_size(block_size)
    problem, _ = canonical_problem(fn_name, q, k, k, mask_options)
    check_aux(fn_name, aux, problem)
    arrays = problem.arrays
    bsz, q_seq, q_heads, _ = arrays.q.shape
    kv_seq = arrays.k.shape[1]
    lse = jnp.reshape(aux.lse, (bsz, q_heads, q_seq))
    result = _scan(
        arrays, lse, options=problem.options, lay=layout(kv_seq, block_size), kv_seq=kv_seq,
        what=what,
    )
    return unflatten(result, problem.batch_shape)


@jaxtyped(typechecker=typechecker)
def recompute_probs(
    q: Float[Arr, "*batch q_seq q_heads qk_dim"],
    k: Float[Arr, "*batch kv_seq kv_heads qk_dim"],
    aux: AttnAux,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    **mask_options,
) -> Float[Array, "*batch q_heads q_seq kv_seq"]:
    """Recomputes the exact softmax probabilities of an attention call from its `aux.lse`.

    `P[i, j] = exp(s[i, j] - lse[i])` on the keys row `i` may see, 0 elsewhere, where `s` are the
    logits exactly as the kernels define them (scale, softcap, bias, masks; see
    `docs/kernel_abi.md`). Only `aux.lse` is read, so this works after any backend, including
    `flash`, which does not keep the probabilities. The result is the probabilities before
    dropout, like `aux.probs`; with a sink the row sums are `1 - exp(sink - lse)`. Rows with no
    visible key are all zeros.

    The result is `q_seq x kv_seq` per head by nature; for a per-row statistic that never forms
    it, see [`attnaux.introspect.entropy`][].

    **Arguments:**

    - `q`, `k`: the queries and keys of the call, `[*batch, seq, heads, qk_dim]`.
    - `aux`: the `AttnAux` that call returned.
    - `block_size`: keys per block of the internal scan (affects speed only).
    - `**mask_options`: the keywords of that call which shape the logits: `scale`, `bias`,
      `mask`, `causal`, `window`, `q_seqlens`, `kv_seqlens`, `q_segment_ids`, `kv_segment_ids`,
      `softcap`, `sink`. The other keywords of `attnaux.attention` (`dropout_rate`, `key`,
      `return_probs`, `backend`) are accepted and ignored, so one options dict serves both.

    **Returns:**

    `float32[*batch, q_heads, q_seq, kv_seq]` (float64 for float64 inputs).

    **Example:**

    ```python
    import jax, attnaux as ax
    from attnaux import introspect as ai

    q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 4, 8)) for i in range(3))
    out, aux = ax.attention(q, k, v, causal=True)          # any backend; aux.probs may be None
    p = ai.recompute_probs(q, k, aux, causal=True)          # [2, 4, 16, 16]
    p.sum(-1)                                               # 1 on every row
    ```
    """
    return _run("recompute_probs", q, k, aux, block_size, mask_options, "probs")


@jaxtyped(typechecker=typechecker)
def entropy(
    q: Float[Arr, "*batch q_seq q_heads qk_dim"],
    k: Float[Arr, "*batch kv_seq kv_heads qk_dim"],
    aux: AttnAux,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    **mask_options,
) -> Float[Array, "*batch q_heads q_seq"]:
    """The entropy `-sum_j P[i, j] log P[i, j]` of every softmax row, computed block by block.

    The probabilities are recomputed from `aux.lse` one block of `block_size` keys at a time
    (a `lax.scan`), so memory is linear in the sequence lengths: this works for sequences whose
    `q_seq x kv_seq` probabilities would not fit. The sum runs over the real keys only: with a
    sink, its share of the row is not a term. Rows with no visible key have entropy 0.

    Low entropy means attention collapsed onto few keys (a uniform row over `n` keys has
    entropy `log n`); entropy collapse is a classic early sign of training instability.

    **Arguments:**

    - `q`, `k`: the queries and keys of the call.
    - `aux`: the `AttnAux` that call returned (only `aux.lse` is read).
    - `block_size`: keys per block; memory is `O(batch * heads * q_seq * block_size)`.
    - `**mask_options`: the keywords of the call that shape the logits, as for
      [`attnaux.introspect.recompute_probs`][].

    **Returns:**

    `float32[*batch, q_heads, q_seq]` in nats (float64 for float64 inputs).

    **Example:**

    ```python
    out, aux = ax.attention(q, k, v, causal=True)
    h = ai.entropy(q, k, aux, causal=True)      # [2, 4, 16]
    h.mean(axis=(0, 2))                         # mean entropy per head
    ```
    """
    return _run("entropy", q, k, aux, block_size, mask_options, "entropy")
