"""The one internal surface that `attnaux.introspect` may use besides the public API.

Like `equinox.internal`, these names are for attnaux's own subpackages: they may change between
releases without notice, and everything else under `attnaux._*` is private to the core. What is
here is what the diagnostics need to recompute a call's logits exactly as the backends define
them: the canonical problem of a call, the masking rules and the dropout keep-masks.

- `canonical_problem(q, k, v, **options)`: validates the keyword options of `attnaux.attention`
  that shape the logits (parsing the static ones once) and returns the canonical `Problem`.
- `AttnAux`: the public aux class (re-exported here so that introspect sits low in the import
  graph: it never needs the package facade `attnaux/__init__.py`).
- `Canonical`, `Options`, `Problem`: the canonical form (`docs/kernel_abi.md`).
- `static_float(name, value, allow_none=...)`: the validation of a static float option.
- `visibility(arrays, options, keys=None, kv_seq=None)`: the masking rules, in one place.
- `dropout_keep_mask(rng_state, rate, batch, heads, q_seq, kv_seq, columns=None)`: attnaux's
  documented Philox keep-mask.
- `cudnn_dropout_keep_mask(...)`: the keep-mask cuDNN drew (GPU `flash`), through cuDNN.
"""

from typing import Any

from ._aux import AttnAux as AttnAux
from ._canon import Canonical as Canonical
from ._canon import Options as Options
from ._canon import Problem as Problem
from ._canon import canonicalize as _canonicalize
from ._canon import parse_statics as _parse_statics
from ._canon import static_float as static_float
from ._masking import visibility as visibility
from ._philox import dropout_keep_mask as dropout_keep_mask


def canonical_problem(q: Any, k: Any, v: Any, **options: Any) -> Problem:
    """The validated canonical problem of `attnaux.attention(q, k, v, **options)` (the options
    that shape the logits, and `dropout_rate`/`key`; no backend is chosen)."""
    statics = _parse_statics(
        scale=options.pop("scale", None), causal=options.pop("causal", False),
        window=options.pop("window", None), softcap=options.pop("softcap", None),
        dropout_rate=options.pop("dropout_rate", 0.0),
    )
    return _canonicalize(q, k, v, statics, **options)


def cudnn_dropout_keep_mask(*args: Any, **kwargs: Any):
    """The keep-mask cuDNN drew for an aux with `dropout_impl == "cudnn"` (see
    `attnaux._flash_cudnn.cudnn_dropout_keep_mask`)."""
    from ._flash_cudnn import cudnn_dropout_keep_mask as replay

    return replay(*args, **kwargs)
