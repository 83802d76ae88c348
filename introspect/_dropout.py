import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped

from attnaux._internal import AttnAux, cudnn_dropout_keep_mask, dropout_keep_mask


@jaxtyped(typechecker=beartype)
def dropout_mask(
    aux: AttnAux,
    q: Float[Array, "*batch q_seq q_heads qk_dim"],
    k: Float[Array, "*batch kv_seq kv_heads qk_dim"],
    *,
    dropout_rate: float,
) -> Bool[Array, "*batch q_heads q_seq kv_seq"]:
    """Regenerates, bit for bit, the dropout keep-mask an attnaux kernel used.

    The mask is a pure function of `aux.rng_state`, the shapes and the rate: Philox-4x32-10 over a
    counter built from the element's `(batch, head, q index, kv index)` (see the dropout section
    of the docs), so it does not depend on tiling, threads or backend. An aux made by the GPU
    `flash` backend (`aux.dropout_impl == "cudnn"`) holds a mask cuDNN drew with its own Philox
    layout from the same `rng_state`; it is replayed through cuDNN (on the GPU), bit for bit.

    **Arguments:**

    - `aux`: the aux of a call made with `dropout_rate > 0`.
    - `q`, `k`: the query and key arrays of that call (only their shapes are used, and for a
      cuDNN mask q's dtype).
    - `dropout_rate`: the rate of that call.

    **Returns:**

    `bool[*batch, q_heads, q_seq, kv_seq]`, `True` where the probability was kept (and scaled by
    `1 / (1 - dropout_rate)`).
    """
    if aux.rng_state is None:
        raise ValueError("`aux.rng_state` is None: the call that made `aux` used no dropout.")
    if not 0.0 < dropout_rate < 1.0:
        raise ValueError(f"`dropout_rate` must be in (0, 1); got {dropout_rate}.")
    batch = q.shape[:-3]
    q_seq, q_heads = q.shape[-3], q.shape[-2]
    kv_seq = k.shape[-3]
    bsz = 1
    for d in batch:
        bsz *= d
    if aux.dropout_impl == "cudnn":  # the GPU flash backend: cuDNN's Philox, through cuDNN
        keep = cudnn_dropout_keep_mask(aux.rng_state, dropout_rate, bsz, q_heads, k.shape[-2],
                                       q_seq, kv_seq, q.shape[-1], q.dtype)
    else:
        keep = dropout_keep_mask(aux.rng_state, dropout_rate, bsz, q_heads, q_seq, kv_seq)
    return jnp.reshape(keep, (*batch, q_heads, q_seq, kv_seq))


del jax
