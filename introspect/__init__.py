"""attnaux.introspect: diagnostics and custom-backward helpers built on `AttnAux`.

Everything here is pure JAX on the public aux, so it works under `jax.jit` and `jax.vmap`
(`save`, `load` and `plot` are host-side I/O).

```python
from attnaux import introspect as ai
ai.max_logit(aux), ai.qk_clip(aux, 100.0)         # QK-clip (MuonClip)
ai.recompute_probs(q, k, aux, causal=True)         # exact P from aux.lse
ai.entropy(q, k, aux, causal=True)                 # per-row entropy, memory linear in seq
ai.attention_vjp(q, k, v, out, aux, dout)          # the backward from aux, for custom_vjp
ai.merge([(out_1, aux_1), (out_2, aux_2)])         # attention over the union of key blocks
ai.z_loss(aux)                                     # mean lse**2; differentiable
ai.health(aux); ai.save(path, {...}); ai.load(path); ai.plot(report, "heads.png")
ai.dropout_mask(aux, q, k, dropout_rate=0.1)       # the exact dropout keep-mask
```
See `docs/introspect.md` for a guide with a worked example of each.
"""

from ._dropout import dropout_mask as dropout_mask
from ._health import HealthReport as HealthReport
from ._health import health as health
from ._io import load as load
from ._io import save as save
from ._merge import merge as merge
from ._plot import plot as plot
from ._recompute import entropy as entropy
from ._recompute import recompute_probs as recompute_probs
from ._stats import max_logit as max_logit
from ._stats import qk_clip as qk_clip
from ._stats import z_loss as z_loss
from ._vjp import AttnGrads as AttnGrads
from ._vjp import attention_vjp as attention_vjp

__all__ = [
    "AttnGrads",
    "HealthReport",
    "attention_vjp",
    "dropout_mask",
    "entropy",
    "health",
    "load",
    "max_logit",
    "merge",
    "plot",
    "qk_clip",
    "recompute_probs",
    "save",
    "z_loss",
]
