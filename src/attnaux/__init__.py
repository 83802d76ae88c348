"""attnaux: fused attention and softmax for JAX that always return their softmax statistics.

```python
import attnaux as ax
out, aux = ax.attention(q, k, v, causal=True)
aux.lse, aux.max  # float32 [*batch, q_heads, q_seq]
```
"""

from . import _ffi as _ffi  # registers the compiled kernels with XLA on import
from ._attention import attention as attention, explain as explain
from ._aux import AttnAux as AttnAux
from ._dispatch import Explanation as Explanation

__version__ = "0.1.0"

__all__ = ["AttnAux", "Explanation", "attention", "explain", "introspect"]


def __getattr__(name):
    if name == "introspect":  # lazily, so `import attnaux` stays light
        import importlib

        return importlib.import_module("attnaux.introspect")
    raise AttributeError(f"module 'attnaux' has no attribute {name!r}")
