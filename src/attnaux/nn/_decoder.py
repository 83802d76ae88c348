import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._aux import AttnAux
from ._attention import MultiheadAttention


class DecoderBlock(eqx.Module):
    """Pre-norm transformer block: causal attention (attnaux) and an MLP, each residual."""

    attention_norm: eqx.nn.LayerNorm
    attention: MultiheadAttention
    mlp_norm: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, dim: int, num_heads: int, kv_heads: int, *, key: PRNGKeyArray):
        k_attn, k_in, k_out = jax.random.split(key, 3)
        self.attention_norm = eqx.nn.LayerNorm(dim)
        self.attention = MultiheadAttention(num_heads, dim, kv_heads=kv_heads, causal=True,
                                            key=k_attn)
        self.mlp_norm = eqx.nn.LayerNorm(dim)
        self.mlp_in = eqx.nn.Linear(dim, 4 * dim, key=k_in)
        self.mlp_out = eqx.nn.Linear(4 * dim, dim, key=k_out)

    def __call__(self, x: Float[Array, "seq dim"], *, return_probs: bool = False,
                 context: dict | None = None) -> tuple[Float[Array, "seq dim"], AttnAux]:
        h = jax.vmap(self.attention_norm)(x)
        attended, aux = self.attention(h, h, h, return_probs=return_probs, context=context)
        x = x + attended
        h = jax.vmap(self.mlp_norm)(x)
        x = x + jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(h)))
        return x, aux


class Decoder(eqx.Module):
    """A small decoder-only transformer built from [`attnaux.nn.MultiheadAttention`][]: token
    and position embeddings, `depth` pre-norm blocks with causal (GQA) attention, and an
    unembedding. Its call returns the logits and the [`AttnAux`][attnaux.AttnAux] of every layer.
    """

    token_embedding: eqx.nn.Embedding
    position_embedding: eqx.nn.Embedding
    blocks: list[DecoderBlock]
    final_norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, vocab: int, max_len: int, dim: int = 64, depth: int = 2,
                 num_heads: int = 4, kv_heads: int = 2, *, key: PRNGKeyArray):
        """**Arguments:**

        - `vocab`: number of tokens; `max_len`: longest sequence.
        - `dim`: model width; `depth`: number of blocks.
        - `num_heads`, `kv_heads`: query and key/value heads of each attention layer.
        - `key`: PRNG key for the initialisation.
        """
        keys = jax.random.split(key, depth + 3)
        self.token_embedding = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.position_embedding = eqx.nn.Embedding(max_len, dim, key=keys[1])
        self.blocks = [DecoderBlock(dim, num_heads, kv_heads, key=k) for k in keys[3:]]
        self.final_norm = eqx.nn.LayerNorm(dim)
        self.unembed = eqx.nn.Linear(dim, vocab, key=keys[2])

    def __call__(self, tokens: Int[Array, " seq"], *, return_probs: bool = False,
                 positions: Int[Array, " seq"] | None = None, context: dict | None = None
                 ) -> tuple[Float[Array, "seq vocab"], list[AttnAux]]:
        """**Arguments:**

        - `tokens`: `int[seq]` (unbatched; `jax.vmap` over a batch).
        - `return_probs`: also fill `aux.probs` in every layer's aux.
        - `positions`: the tokens' positions in the sequence (default `0 .. seq - 1`); under
          context parallelism, the global positions of this device's block.
        - `context`: context parallelism for every attention layer (inside `jax.shard_map`,
          `dict(axis_name=..., ...)`, see `MultiheadAttention` and `docs/parallel.md`).

        **Returns:**

        `(logits [seq, vocab], [aux of each layer])`.
        """
        if positions is None:
            positions = jnp.arange(tokens.shape[0])
        x = jax.vmap(self.token_embedding)(tokens) + jax.vmap(self.position_embedding)(positions)
        auxes = []
        for block in self.blocks:
            x, aux = block(x, return_probs=return_probs, context=context)
            auxes.append(aux)
        return jax.vmap(self.unembed)(jax.vmap(self.final_norm)(x)), auxes
