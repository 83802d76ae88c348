import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._attention import attention
from .._aux import AttnAux
from .._canon import parse_causal

_ProcessHeads = Callable[
    [Float[Array, "q_seq num_heads qk_size"], Float[Array, "kv_seq kv_heads qk_size"],
     Float[Array, "kv_seq kv_heads vo_size"]],
    tuple[Float[Array, "q_seq num_heads qk_size"], Float[Array, "kv_seq kv_heads qk_size"],
          Float[Array, "kv_seq kv_heads vo_size"]],
]


class MultiheadAttention(eqx.Module):
    """A drop-in for `equinox.nn.MultiheadAttention` that returns `(out, aux)`.

    Same constructor arguments, field names and parameter shapes as equinox's layer (so the
    weights of one load into the other), same call signature; the attention itself runs on
    attnaux backends and the call also returns the [`AttnAux`][attnaux.AttnAux] of the layer
    (`aux.lse` and `aux.max` of shape `[num_heads, q_seq]`).

    Extra options: `kv_heads` (grouped-query attention: the key and value projections produce
    `kv_heads` heads, shared by `num_heads // kv_heads` query heads each), `causal` and `backend`
    (defaults for every call, which may override them), and `dropout_rate` at call time.

    One difference from equinox: a query row whose mask hides every key gets output 0 (before the
    output projection) and `lse = -inf`; equinox attends uniformly to every key in that case.
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    num_heads: int = eqx.field(static=True)
    query_size: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    qk_size: int = eqx.field(static=True)
    vo_size: int = eqx.field(static=True)
    use_query_bias: bool = eqx.field(static=True)
    use_key_bias: bool = eqx.field(static=True)
    use_value_bias: bool = eqx.field(static=True)
    use_output_bias: bool = eqx.field(static=True)
    kv_heads: int = eqx.field(static=True)
    causal: bool | str = eqx.field(static=True)
    backend: str = eqx.field(static=True)

    def __init__(
        self,
        num_heads: int,
        query_size: int,
        key_size: int | None = None,
        value_size: int | None = None,
        output_size: int | None = None,
        qk_size: int | None = None,
        vo_size: int | None = None,
        use_query_bias: bool = False,
        use_key_bias: bool = False,
        use_value_bias: bool = False,
        use_output_bias: bool = False,
        dropout_p: float = 0.0,
        inference: bool = False,
        dtype=None,
        *,
        kv_heads: int | None = None,
        causal: bool | str = False,
        backend: str = "auto",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        The arguments of `equinox.nn.MultiheadAttention` (`num_heads`, `query_size`,
        `key_size`, `value_size`, `output_size`, `qk_size`, `vo_size`, `use_*_bias`,
        `dropout_p`, `inference`, `dtype`, `key`), and, keyword-only:

        - `kv_heads`: number of key/value heads (GQA/MQA); must divide `num_heads`. Defaults to
          `num_heads` (the equinox layout).
        - `causal`: default causal masking for every call (`False`, `True`, `"top_left"`,
          `"bottom_right"`).
        - `backend`: default attnaux backend (`"auto"`, `"flash"`, `"reference"`, ...).
        """
        kv_heads = num_heads if kv_heads is None else kv_heads
        if kv_heads <= 0 or num_heads % kv_heads != 0:
            raise ValueError(
                f"`kv_heads` must be a positive divisor of `num_heads`={num_heads}; got {kv_heads}."
            )
        parse_causal(causal)
        qkey, kkey, vkey, okey = jax.random.split(key, 4)
        key_size = query_size if key_size is None else key_size
        value_size = query_size if value_size is None else value_size
        qk_size = query_size // num_heads if qk_size is None else qk_size
        vo_size = query_size // num_heads if vo_size is None else vo_size
        output_size = query_size if output_size is None else output_size

        linear = eqx.nn.Linear
        self.query_proj = linear(query_size, num_heads * qk_size, use_bias=use_query_bias,
                                 dtype=dtype, key=qkey)
        self.key_proj = linear(key_size, kv_heads * qk_size, use_bias=use_key_bias, dtype=dtype,
                               key=kkey)
        self.value_proj = linear(value_size, kv_heads * vo_size, use_bias=use_value_bias,
                                 dtype=dtype, key=vkey)
        self.output_proj = linear(num_heads * vo_size, output_size, use_bias=use_output_bias,
                                  dtype=dtype, key=okey)
        self.dropout = eqx.nn.Dropout(dropout_p, inference=inference)

        self.num_heads = num_heads
        self.query_size = query_size
        self.key_size = key_size
        self.value_size = value_size
        self.output_size = output_size
        self.qk_size = qk_size
        self.vo_size = vo_size
        self.use_query_bias = use_query_bias
        self.use_key_bias = use_key_bias
        self.use_value_bias = use_value_bias
        self.use_output_bias = use_output_bias
        self.kv_heads = kv_heads
        self.causal = causal
        self.backend = backend

    def __call__(
        self,
        query: Float[Array, "q_seq q_size"],
        key_: Float[Array, "kv_seq k_size"],
        value: Float[Array, "kv_seq v_size"],
        mask: None | Bool[Array, "q_seq kv_seq"] | Bool[Array, "num_heads q_seq kv_seq"] = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
        process_heads: None | _ProcessHeads = None,
        causal: bool | str | None = None,
        dropout_rate: float | None = None,
        backend: str | None = None,
        return_probs: bool = False,
        context: dict | None = None,
    ) -> tuple[Float[Array, "q_seq o_size"], AttnAux]:
        """**Arguments:**

        - `query`: `(q_seq, query_size)`; `key_`: `(kv_seq, key_size)`; `value`:
          `(kv_seq, value_size)`. Unbatched, as in equinox: `jax.vmap` over a batch.
        - `mask`: boolean `(q_seq, kv_seq)` or `(num_heads, q_seq, kv_seq)`, `True` = attend.
        - `key`: PRNG key for dropout (keyword-only).
        - `inference`: overrides the layer's `inference` flag (no dropout when `True`).
        - `deterministic`: deprecated alias of `inference`, as in equinox.
        - `process_heads`: a function of `(query_heads, key_heads, value_heads)` applied after
          the projections (for example rotary embeddings); must keep their shapes.
        - `causal`, `backend`: override the layer's defaults for this call.
        - `dropout_rate`: overrides `dropout_p` for this call.
        - `return_probs`: also return the attention probabilities in `aux.probs`.
        - `context`: context parallelism: inside `jax.shard_map` over a mesh axis that shards
          the sequence, `dict(axis_name=..., strategy=..., layout=...)` runs the attention as
          `attnaux.parallel.ring_attention` (query, key and value are this device's block;
          `mask` and `return_probs` are not available then). See `docs/parallel.md`.

        **Returns:**

        `(out, aux)`: `out` of shape `(q_seq, output_size)` and the
        [`AttnAux`][attnaux.AttnAux] of the attention (`lse`, `max`: `(num_heads, q_seq)`).
        """
        if deterministic is not None:
            inference = deterministic
            warnings.warn(
                "MultiheadAttention()(deterministic=...) is deprecated in favour of "
                "MultiheadAttention()(inference=...)",
                stacklevel=2,
            )
        if key_.shape[0] != value.shape[0]:
            raise ValueError(
                "`key_` and `value` must be sequences of equal length; got "
                f"{key_.shape[0]} and {value.shape[0]}."
            )
        q_heads = self._project(self.query_proj, query, self.num_heads)
        k_heads = self._project(self.key_proj, key_, self.kv_heads)
        v_heads = self._project(self.value_proj, value, self.kv_heads)
        if process_heads is not None:
            shapes = (q_heads.shape, k_heads.shape, v_heads.shape)
            q_heads, k_heads, v_heads = process_heads(q_heads, k_heads, v_heads)
            if (q_heads.shape, k_heads.shape, v_heads.shape) != shapes:
                raise ValueError("process_heads must not change the shape of the heads.")

        if inference is None:
            inference = self.dropout.inference
        rate = self.dropout.p if dropout_rate is None else dropout_rate
        if inference or rate == 0:
            rate, key = 0.0, None
        elif key is None:
            raise RuntimeError(
                "MultiheadAttention has dropout but no `key` was given; pass `key=...` or "
                "`inference=True`."
            )
        if context is not None:
            from ..parallel import ring_attention

            if mask is not None or return_probs:
                raise ValueError(
                    "`mask` and `return_probs` are not available with `context` (context "
                    "parallelism): a dense mask or probability matrix of the whole sequence is "
                    "what it avoids; use `causal`."
                )
            out, aux = ring_attention(
                q_heads, k_heads, v_heads, causal=self.causal if causal is None else causal,
                dropout_rate=float(rate), key=key,
                backend=self.backend if backend is None else backend,
                **context,
            )
            out = out.reshape(query.shape[0], self.num_heads * self.vo_size)
            return jax.vmap(self.output_proj)(out), aux
        out, aux = attention(
            q_heads, k_heads, v_heads, mask=mask,
            causal=self.causal if causal is None else causal,
            dropout_rate=float(rate), key=key,
            backend=self.backend if backend is None else backend, return_probs=return_probs,
        )
        out = out.reshape(query.shape[0], self.num_heads * self.vo_size)
        return jax.vmap(self.output_proj)(out), aux

    @staticmethod
    def _project(proj: eqx.nn.Linear, x: Array, heads: int) -> Array:
        return jax.vmap(proj)(x).reshape(x.shape[0], heads, -1)


del jnp
