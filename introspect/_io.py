import json
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from attnaux._internal import AttnAux

_FORMAT = "attnaux.introspect.aux-collection"
_VERSION = 1
_FIELDS = ("lse", "max", "probs", "rng_state")


def _to_numpy(name: str, field: str, x) -> np.ndarray:
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"save(): `{name}.{field}` is a traced value; save outside `jax.jit` (return the aux "
            "from the jitted function and save the result)."
        )
    return np.asarray(x)


def save(path: str | os.PathLike, collection: Mapping[str, AttnAux]) -> None:
    """Saves a collection of `AttnAux` (for example one per layer) to a `.npz` file.

    Every field is stored (fields that are `None` are recorded as absent, and `backend` as
    text), so [`load`][attnaux.introspect.load] gives back equal auxes. bfloat16/float16 arrays
    keep their dtype. Nothing is pickled.

    **Arguments:**

    - `path`: the file to write; NumPy appends `.npz` when the name has no such suffix.
    - `collection`: `{name: aux}`, names being any strings (layer names, for example), in the
      order they should be reported.

    **Returns:**

    `None`.

    **Example:**

    ```python
    auxes = {f"layer{i}": aux_i for i, aux_i in enumerate(layer_auxes)}
    ai.save("step1000.npz", auxes)
    loaded = ai.load("step1000.npz")          # {"layer0": AttnAux(...), ...}
    ```
    """
    if isinstance(collection, AttnAux) or not isinstance(collection, Mapping):
        raise TypeError(
            "save() takes a mapping {name: AttnAux}, for example {'layer0': aux}; got an object "
            f"of type {type(collection).__name__}."
        )
    arrays: dict[str, np.ndarray] = {}
    entries = []
    for index, (name, aux) in enumerate(collection.items()):
        if not isinstance(name, str):
            raise TypeError(f"save(): collection names must be strings; got {name!r}.")
        if not isinstance(aux, AttnAux):
            raise TypeError(
                f"save(): entry {name!r} must be an AttnAux; got an object of type "
                f"{type(aux).__name__}."
            )
        fields = {}
        for field in _FIELDS:
            x = getattr(aux, field)
            if x is None:
                continue
            x = _to_numpy(name, field, x)
            dtype = str(x.dtype)
            if x.dtype.kind == "V" or dtype in ("bfloat16", "float16"):
                x = x.view(np.uint16)  # npz stores ml_dtypes arrays as opaque bytes otherwise
            arrays[f"{index}.{field}"] = x
            fields[field] = dtype
        entries.append({"name": name, "backend": aux.backend, "dropout_impl": aux.dropout_impl,
                        "fields": fields})
    meta = {"format": _FORMAT, "version": _VERSION, "entries": entries}
    arrays["__meta__"] = np.array(json.dumps(meta))
    np.savez(path, **arrays)


def load(path: str | os.PathLike) -> dict[str, AttnAux]:
    """Loads a collection written by [`save`][attnaux.introspect.save].

    **Arguments:**

    - `path`: the `.npz` file.

    **Returns:**

    `{name: AttnAux}` in the saved order, with JAX arrays in the saved dtypes, `None` for the
    fields that were `None`, and the saved `backend`.

    **Example:**

    ```python
    for name, aux in ai.load("step1000.npz").items():
        print(name, ai.max_logit(aux))
    ```
    """
    with np.load(path, allow_pickle=False) as data:
        if "__meta__" not in data:
            raise ValueError(
                f"{os.fspath(path)!r} is not an aux collection written by "
                "attnaux.introspect.save (it has no '__meta__' entry)."
            )
        meta = json.loads(str(data["__meta__"]))
        if meta.get("format") != _FORMAT or meta.get("version", 0) > _VERSION:
            raise ValueError(
                f"{os.fspath(path)!r} holds format {meta.get('format')!r} version "
                f"{meta.get('version')!r}; this attnaux reads {_FORMAT!r} up to version {_VERSION}."
            )
        collection = {}
        for index, entry in enumerate(meta["entries"]):
            fields = {}
            for field, dtype in entry["fields"].items():
                x = data[f"{index}.{field}"]
                if str(x.dtype) != dtype:
                    x = x.view(jnp.dtype(dtype))
                fields[field] = jnp.asarray(x)
            collection[entry["name"]] = AttnAux(
                backend=entry["backend"], dropout_impl=entry.get("dropout_impl", "attnaux"),
                **fields
            )
    return collection
