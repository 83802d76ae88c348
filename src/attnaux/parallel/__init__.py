"""`attnaux.parallel`: context parallelism, exact attention over a sequence sharded across
devices (see `docs/parallel.md`).

- `ring_attention(q, k, v, *, axis_name, strategy="ring", layout="contiguous", **options)`:
  inside `jax.shard_map` over the mesh axis that shards the sequence.
- `context_parallel_attention(q, k, v, *, mesh, axis_name, **options)`: the same on global
  sequence-sharded arrays, with the `shard_map` written for you.
- `zigzag(x, num_devices, axis=...)`, `unzigzag(...)`: the load-balanced layout for causal
  attention, and back.
"""

from ._ring import context_parallel_attention as context_parallel_attention
from ._ring import ring_attention as ring_attention
from ._ring import unzigzag as unzigzag
from ._ring import zigzag as zigzag

__all__ = ["context_parallel_attention", "ring_attention", "unzigzag", "zigzag"]
