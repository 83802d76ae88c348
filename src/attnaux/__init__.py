"""attnaux: fused attention and softmax for JAX that always return their softmax statistics.

```python
import attnaux as ax
out, aux = ax.attention(q, k, v, causal=True)
aux.lse, aux.max  # float32 [*batch, q_heads, q_seq]
```
"""

from . import _ffi as _ffi  # registers the compiled kernels with XLA on import
from ._attention import attention as attention
from ._attention import explain as explain
from ._aux import AttnAux as AttnAux
from ._dispatch import Explanation as Explanation
from ._softmax import (
    KernelAvailability as KernelAvailability,
)
from ._softmax import (
    softmax as softmax,
)
from ._softmax import (
    softmax_kernel_available as softmax_kernel_available,
)
from ._varlen import cu_seqlens_to_segment_ids as cu_seqlens_to_segment_ids
from ._varlen import segment_ids_to_cu_seqlens as segment_ids_to_cu_seqlens
from ._varlen import varlen_attention as varlen_attention
from ._version import __version__ as __version__

__all__ = [
    "AttnAux",
    "Explanation",
    "KernelAvailability",
    "attention",
    "cu_seqlens_to_segment_ids",
    "explain",
    "introspect",
    "nn",
    "segment_ids_to_cu_seqlens",
    "softmax",
    "softmax_kernel_available",
    "varlen_attention",
]


def __getattr__(name):
    if name in ("introspect", "nn"):  # lazily, so `import attnaux` stays light
        import importlib

        return importlib.import_module(f"attnaux.{name}")
    raise AttributeError(f"module 'attnaux' has no attribute {name!r}")
