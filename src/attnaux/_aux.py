import json

import equinox as eqx
import jax
from jaxtyping import Array, Float, UInt32


class AttnAux(eqx.Module):
    """The softmax statistics every attnaux call returns next to its output.

    `AttnAux` is an `eqx.Module`, so it is a pytree: it passes through `jax.jit`, `jax.vmap`,
    `jax.grad` and `jax.tree_util` like any other. Gradients flow through `lse` and `probs`;
    `max` is returned under `jax.lax.stop_gradient`.

    **Fields:**

    - `lse`: `float32[*batch, q_heads, q_seq]`, the natural-log log-sum-exp of the final logits of
      every softmax row (after scale, softcap, bias and masks; the sink term included). A row with
      no visible key has `lse = -inf`, or `lse = sink` when a sink is given.
    - `max`: `float32[*batch, q_heads, q_seq]`, the row maximum of the same logits over the visible
      keys (the sink excluded); `-inf` for a row with no visible key. Carries no gradient.
    - `probs`: `[*batch, q_heads, q_seq, kv_seq]` softmax probabilities before dropout, filled
      exactly when the call asked for them with `return_probs=True` (whichever backend ran), and
      `None` otherwise. Float32 for float32 inputs, else the input dtype.
    - `rng_state`: `uint32[4]` (seed as 2 words, offset as 2 words) that determines the dropout
      keep-mask exactly, or `None` without dropout.
    - `backend`: which backend ran (`"flash"`, `"probs"`, `"small_seq"`, `"reference"`, or
      `"flex"` for `score_mod`/`mask_mod`); static.
    - `dropout_impl`: which generator drew the dropout keep-mask from `rng_state`; static.
      `"attnaux"`: attnaux's documented Philox layout (the CPU kernels and `reference`);
      `"cudnn"`: cuDNN's own Philox (the GPU `flash` backend). `attnaux.introspect.dropout_mask`
      replays either.
    """

    lse: Float[Array, "*batch q_heads q_seq"]
    max: Float[Array, "*batch q_heads q_seq"]
    probs: Float[Array, "*batch q_heads q_seq kv_seq"] | None = None
    rng_state: UInt32[Array, "4"] | None = None
    backend: str = eqx.field(static=True, default="reference")
    dropout_impl: str = eqx.field(static=True, default="attnaux")


def unflatten(batch_shape, out, lse, row_max, probs, rng_state, backend: str,
              dropout_impl: str):
    """`(out, AttnAux)` of a call on the canonical `[B, ...]` results, the leading batch dim
    unflattened to `batch_shape`; `max` carries no gradient."""
    def shaped(x):
        return x.reshape((*batch_shape, *x.shape[1:]))

    aux = AttnAux(lse=shaped(lse), max=jax.lax.stop_gradient(shaped(row_max)),
                  probs=None if probs is None else shaped(probs), rng_state=rng_state,
                  backend=backend, dropout_impl=dropout_impl)
    return shaped(out), aux


# `jax.export` serializes the output pytree of an exported function: AttnAux's node is
# registered under a stable name, with its static fields (`backend`, `dropout_impl`) as JSON.
_BACKENDS = ("flash", "probs", "small_seq", "reference", "kernel", "flex")
_DROPOUT_IMPLS = ("attnaux", "cudnn")


def _node_data(backend: str, dropout_impl: str):
    template = AttnAux(lse=0.0, max=0.0, backend=backend, dropout_impl=dropout_impl)
    return jax.tree_util.tree_structure(template).node_data()[1]


def _serialize_auxdata(auxdata) -> bytes:
    for backend in _BACKENDS:
        for impl in _DROPOUT_IMPLS:
            if _node_data(backend, impl) == auxdata:
                return json.dumps({"backend": backend, "dropout_impl": impl}).encode()
    raise ValueError(f"cannot serialize an AttnAux with static fields {auxdata!r}.")


def _deserialize_auxdata(data: bytes):
    fields = json.loads(data.decode())
    return _node_data(fields["backend"], fields["dropout_impl"])


try:
    jax.export.register_pytree_node_serialization(
        AttnAux, serialized_name="attnaux.AttnAux", serialize_auxdata=_serialize_auxdata,
        deserialize_auxdata=_deserialize_auxdata,
    )
except (AttributeError, ValueError):  # a JAX without it, or registered twice (a reload)
    pass
