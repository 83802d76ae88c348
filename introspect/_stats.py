import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float32, jaxtyped

from attnaux._internal import AttnAux

from ._blockwise import Arr, typechecker


def _check_aux(fn_name: str, aux) -> None:
    if not isinstance(aux, AttnAux):
        raise TypeError(
            f"{fn_name}() needs the `AttnAux` returned by attnaux.attention; got an object of "
            f"type {type(aux).__name__}."
        )
    if jnp.ndim(aux.max) < 2:
        raise ValueError(
            f"{fn_name}(): `aux.max` must have shape [*batch, q_heads, q_seq]; got shape "
            f"{tuple(jnp.shape(aux.max))}."
        )


@jaxtyped(typechecker=typechecker)
def max_logit(aux: AttnAux) -> Float32[Array, " q_heads"]:
    """The largest attention logit of every head: `aux.max` reduced over batch and rows.

    Rows with no visible key (`aux.max = -inf`) take no part; a head whose rows are all masked
    gets `-inf`. The logits are the final ones (after scale, softcap and bias), so this is the
    statistic QK-clip (MuonClip) watches. Like `aux.max`, it carries no gradient.

    Under `jax.vmap` over a batch axis it gives one maximum per mapped element; take `.max(0)`
    of that for the batch maximum.

    **Arguments:**

    - `aux`: the `AttnAux` of an attention call.

    **Returns:**

    `float32[q_heads]`.

    **Example:**

    ```python
    out, aux = ax.attention(q, k, v)         # q: [batch, seq, 4 heads, dim]
    ai.max_logit(aux)                         # float32[4]
    ```
    """
    _check_aux("max_logit", aux)
    row_max = jax.lax.stop_gradient(aux.max).astype(jnp.float32)
    heads = row_max.shape[-2]
    row_max = jnp.moveaxis(row_max, -2, 0).reshape(heads, -1)
    if row_max.shape[1] == 0:
        return jnp.full((heads,), -jnp.inf, jnp.float32)
    return jnp.max(row_max, axis=1)


@jaxtyped(typechecker=typechecker)
def qk_clip(aux: AttnAux, threshold: float | Float[Arr, ""]) -> Float32[Array, " q_heads"]:
    """MuonClip's per-head factors `min(1, threshold / max_logit)`.

    A head whose largest logit exceeds `threshold` gets the factor `threshold / max_logit < 1`;
    scaling its query and key projections by `sqrt(factor)` each (or its query projection by
    `factor`) brings that logit back to `threshold`. Heads at or below the threshold, and heads
    whose largest logit is `<= 0` or `-inf` (all rows masked), get 1: there is nothing to clip.
    Never NaN.

    **Arguments:**

    - `aux`: the `AttnAux` of an attention call.
    - `threshold`: the largest logit allowed, `> 0` (MuonClip uses 100).

    **Returns:**

    `float32[q_heads]` in `(0, 1]`.

    **Example:**

    ```python
    out, aux = ax.attention(x @ wq, x @ wk, x @ wv)   # wq: [d_model, heads, head_dim]
    gamma = ai.qk_clip(aux, 100.0)                    # [heads]
    wq = wq * jnp.sqrt(gamma)[:, None]                # after the optimiser step
    wk = wk * jnp.sqrt(gamma)[:, None]                # (MHA; see the guide for GQA)
    ```
    """
    if isinstance(threshold, (int, float)) and not threshold > 0:
        raise ValueError(f"`threshold` must be > 0; got {threshold}.")
    m = max_logit(aux)
    t = jnp.asarray(threshold, jnp.float32)
    clip = m > t  # False for -inf, for m <= 0 and for NaN
    return jnp.where(clip, t / jnp.where(clip, m, 1.0), 1.0).astype(jnp.float32)


@jaxtyped(typechecker=typechecker)
def z_loss(aux: AttnAux) -> Float[Array, ""]:
    """The attention z-loss: the mean of `lse**2` over rows that see at least one key.

    Penalising the log-sum-exp keeps attention logits from drifting to large magnitudes (the
    z-loss of PaLM and ST-MoE, applied to attention). Rows with no visible key (fully masked,
    padding; recognised by `aux.max = -inf`, so also with a sink) are left out, and the mean is
    over the remaining rows of every batch element and head; 0 when there is none.

    Differentiable: its gradient flows through `aux.lse` into q, k (and bias, sink) through
    whichever backend ran, including the fused `flash` kernel.

    **Arguments:**

    - `aux`: the `AttnAux` of an attention call.

    **Returns:**

    A float32 scalar.

    **Example:**

    ```python
    def loss(params, x):
        out, aux = ax.attention(x @ params["wq"], x @ params["wk"], x @ params["wv"],
                                causal=True)
        return task_loss(out) + 1e-4 * ai.z_loss(aux)
    ```
    """
    _check_aux("z_loss", aux)
    seen = jnp.isfinite(jax.lax.stop_gradient(aux.max)) & jnp.isfinite(
        jax.lax.stop_gradient(aux.lse)
    )
    lse = jnp.where(seen, aux.lse, 0).astype(jnp.float32)
    count = jnp.sum(seen)
    return jnp.sum(lse**2) / jnp.maximum(count, 1).astype(jnp.float32)
