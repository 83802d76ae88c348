from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, jaxtyped

from attnaux._internal import AttnAux

from ._blockwise import Arr, typechecker


@jaxtyped(typechecker=typechecker)
def merge(
    parts: Sequence[tuple[Float[Arr, "*batch q_seq q_heads v_dim"], AttnAux]],
) -> tuple[Float[Array, "*batch q_seq q_heads v_dim"], AttnAux]:
    """Combines attention over disjoint blocks of keys into attention over all of them.

    For the same queries attended over disjoint key sets `K_1, ..., K_n` (ring attention,
    chunked prefill, a KV cache split across devices), the results over their union are

    ```
    lse = logsumexp_i lse_i
    max = max_i max_i
    out = sum_i exp(lse_i - lse) * out_i
    ```

    exactly (up to rounding), with the same masking conventions: a row that saw no key in a
    block (`lse_i = -inf`, `out_i = 0`) gets nothing from it, and a row that saw no key in any
    block gets `out = 0`, `lse = max = -inf`. Differentiable through `out_i` and `lse_i`.

    **Sinks:** a sink is one extra term in the softmax denominator, so it must be counted once:
    pass `sink=` to the call of exactly one block (the sink then enters the merged `lse` once
    and the merged output is the one of the full call with that sink). Passing it to every block
    counts it once per block.

    **Dropout:** outputs computed with dropout merge correctly (each block's output is already
    scaled by its own keep-mask), but the merged aux has `rng_state=None`, as no single state
    describes the union. The merged aux has `probs=None`, and `backend` is the blocks' backend
    when they agree, else `"mixed"`.

    **Arguments:**

    - `parts`: a non-empty sequence of `(out_i, aux_i)` from attention calls with the same
      queries over disjoint key sets; all `out_i` of one shape `[*batch, q_seq, q_heads, v_dim]`.

    **Returns:**

    `(out, aux)`: the output in the dtype of `out_1` (combined in float32) and an `AttnAux`
    with the merged `lse` and `max`.

    **Example:**

    ```python
    # keys split in two halves; padding the second half's tail away with kv_seqlens works too
    o1, a1 = ax.attention(q, k[:, :512], v[:, :512], sink=sink)       # the sink in one block
    o2, a2 = ax.attention(q, k[:, 512:], v[:, 512:])
    out, aux = ai.merge([(o1, a1), (o2, a2)])   # == ax.attention(q, k, v, sink=sink)
    ```
    """
    parts = list(parts)
    if not parts:
        raise ValueError("merge() needs at least one (out, aux) pair; got an empty sequence.")
    shape = tuple(jnp.shape(parts[0][0]))
    for index, part in enumerate(parts):
        if not (isinstance(part, tuple) and len(part) == 2 and isinstance(part[1], AttnAux)):
            raise TypeError(
                f"merge() takes a sequence of (out, aux) pairs as attnaux.attention returns them; "
                f"item {index} is a {type(part).__name__}."
            )
        out, aux = part
        if tuple(jnp.shape(out)) != shape:
            raise ValueError(
                f"All outputs passed to merge() must have one shape; item 0 has {shape}, item "
                f"{index} has {tuple(jnp.shape(out))}."
            )
        want = (*shape[:-3], shape[-2], shape[-3])
        for name in ("lse", "max"):
            got = tuple(jnp.shape(getattr(aux, name)))
            if got != want:
                raise ValueError(
                    f"`aux.{name}` of item {index} must have shape [*batch, q_heads, q_seq] = "
                    f"{want} to match its output {shape}; got {got}."
                )
    out_dtype = jnp.asarray(parts[0][0]).dtype
    lses = jnp.stack([aux.lse.astype(jnp.float32) for _, aux in parts])
    maxes = jnp.stack([aux.max.astype(jnp.float32) for _, aux in parts])
    top = jax.lax.stop_gradient(jnp.max(lses, axis=0))
    seen = jnp.isfinite(top)
    shift = jnp.where(seen, top, 0)
    weights = jnp.exp(lses - shift)  # 0 for blocks with lse = -inf
    total = jnp.sum(weights, axis=0)
    lse = jnp.where(seen, shift + jnp.log(jnp.where(seen, total, 1)), -jnp.inf)
    lse_safe = jnp.where(seen, lse, 0)
    out = 0
    for (out_i, _), lse_i in zip(parts, lses, strict=True):
        w = jnp.where(seen, jnp.exp(lse_i - lse_safe), 0)  # [*batch, q_heads, q_seq]
        out_i = jnp.where(jnp.isfinite(lse_i).swapaxes(-1, -2)[..., None], out_i, 0)
        out = out + jnp.swapaxes(w, -1, -2)[..., None] * out_i.astype(jnp.float32)
    backends = {aux.backend for _, aux in parts}
    backend = backends.pop() if len(backends) == 1 else "mixed"
    aux = AttnAux(
        lse=lse,
        max=jax.lax.stop_gradient(jnp.max(maxes, axis=0)),
        probs=None,
        rng_state=None,
        backend=backend,
    )
    return jnp.asarray(out).astype(out_dtype), aux
