"""attnaux.introspect: diagnostics and custom-backward helpers built on `AttnAux`.

Everything here is pure JAX on the public aux, so it works under `jax.jit` and `jax.vmap`.
"""

from ._dropout import dropout_mask as dropout_mask

__all__ = ["dropout_mask"]
