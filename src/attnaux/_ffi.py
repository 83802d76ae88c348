"""Loads the compiled extension and registers its XLA FFI handlers with JAX."""

import warnings

import jax

try:
    from . import _ext
except ImportError as error:  # a source checkout that was never built
    _ext = None
    IMPORT_ERROR: str | None = f"{type(error).__name__}: {error}"
else:
    IMPORT_ERROR = None

REGISTERED: dict[str, tuple[str, ...]] = {}

if _ext is not None:
    for _name, _capsule in _ext.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
        REGISTERED[_name] = ("cpu",)
else:
    warnings.warn(
        "attnaux's compiled extension could not be imported, so only the pure-JAX `reference` "
        f"backend is available ({IMPORT_ERROR}). Reinstall with `pip install .` to build it.",
        RuntimeWarning,
        stacklevel=2,
    )


def has_target(name: str, platform: str) -> bool:
    """Whether the FFI target `name` was registered for `platform` ("cpu", "cuda")."""
    return platform in REGISTERED.get(name, ())
