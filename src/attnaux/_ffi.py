"""Loads the compiled extension and registers its XLA FFI handlers with JAX."""

import importlib.util
import warnings

import jax

IMPORT_ERROR: str | None = None
if importlib.util.find_spec(f"{__package__}._ext") is None:  # a source checkout, never built
    _ext = None
    IMPORT_ERROR = "attnaux._ext is not built (run `pip install .` from the source checkout)"
else:
    try:
        from . import _ext
    except ImportError as error:  # built, but cannot load (e.g. for another CPU or Python)
        _ext = None
        IMPORT_ERROR = f"attnaux._ext failed to load: {type(error).__name__}: {error}"

REGISTERED: dict[str, tuple[str, ...]] = {}


def _cuda_library_hints() -> tuple[str, str]:
    """Paths of libcudnn.so.9 and libcudart.so.1x in the nvidia wheels ('' when not found), for
    the GPU module to dlopen when JAX has not loaded them yet."""
    import glob
    import importlib.util
    import os

    found = []
    for package, pattern in (("nvidia.cudnn", "lib/libcudnn.so.9"),
                             ("nvidia", "*/lib/libcudart.so.1[0-9]")):
        path = ""
        try:
            spec = importlib.util.find_spec(package)
            for root in (spec.submodule_search_locations or []) if spec else []:
                hits = sorted(glob.glob(os.path.join(root, pattern)))
                if hits:
                    path = hits[-1]
                    break
        except Exception:
            pass
        found.append(path)
    return found[0], found[1]

def cpu_amx_tiles() -> bool:
    """Whether the CPU `flash` kernels run bfloat16 products on AMX tiles here
    (csrc/cpu/cpu_gemm.h, `AmxUsable`): a build for a CPU with AMX, and the OS granting them."""
    return _ext is not None and bool(getattr(_ext, "amx_tiles", lambda: False)())


if _ext is not None:
    for _name, _capsule in _ext.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
        REGISTERED[_name] = ("cpu",)
else:
    warnings.warn(
        "attnaux's compiled kernels are unavailable, so only the pure-JAX `reference` backend "
        f"runs: {IMPORT_ERROR}.",
        RuntimeWarning,
        stacklevel=2,
    )


# The GPU handlers (cuDNN fused attention) live in a separate module, built only where CUDA and
# the cuDNN headers were found, so that importing attnaux never needs CUDA libraries.
CUDA_IMPORT_ERROR: str | None = None
if importlib.util.find_spec(f"{__package__}._ext_cuda") is None:
    _ext_cuda = None
    CUDA_IMPORT_ERROR = (
        "this is a CPU-only build: attnaux._ext_cuda was not built because, at build time, CMake "
        "found no CUDA toolkit, cuDNN headers or cuDNN frontend headers (the build log's "
        "'attnaux: CPU-only build' line names which; "
        "`pip install . -Ccmake.define.ATTNAUX_CUDA=ON` fails with the missing pieces listed)"
    )
else:
    try:
        from . import _ext_cuda
    except ImportError as error:  # built, but cannot load (another CUDA, say)
        _ext_cuda = None
        CUDA_IMPORT_ERROR = f"attnaux._ext_cuda failed to load: {type(error).__name__}: {error}"
if _ext_cuda is not None:
    CUDA_IMPORT_ERROR = None
    try:
        _ext_cuda.set_library_hints(*_cuda_library_hints())
        for _name, _capsule in _ext_cuda.registrations().items():
            jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
            # Same-named targets (softmax, small_seq) exist for both platforms: keep both.
            REGISTERED[_name] = (*REGISTERED.get(_name, ()), "gpu", "cuda")
    except Exception as error:  # a JAX without a CUDA platform, say
        CUDA_IMPORT_ERROR = f"registering the CUDA handlers failed: {type(error).__name__}: {error}"


# attnaux's own CUDA kernels (fused softmax, small_seq): a module of their own, registered under
# the CPU targets' names for platform "CUDA".
KERNELS_CUDA_ERROR: str | None = None
if _ext_cuda is not None and CUDA_IMPORT_ERROR is None:
    try:
        from . import _kernels_cuda

        for _name, _capsule in _kernels_cuda.registrations().items():
            jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
            # Same-named targets exist for both platforms: keep both.
            REGISTERED[_name] = (*REGISTERED.get(_name, ()), "gpu", "cuda")
    except Exception as error:
        KERNELS_CUDA_ERROR = f"{type(error).__name__}: {error}"


def _declare_export_stable(names) -> None:
    """Lets `jax.export` serialize calls of attnaux's targets with no safety check disabled.

    `jax.export` accepts only custom calls whose ABI is guaranteed stable. attnaux's is: every
    target's operands, attributes and results are documented in `docs/kernel_abi.md` and change
    only by extension (new optional words, new targets), never in meaning. An exported artifact
    then runs wherever `attnaux` (this version or a later one) is imported, which registers the
    targets. JAX keeps the list in a private set; without it, export needs
    `disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(name)]` (docs/sharding.md).
    """
    try:
        from jax._src.export import _export
    except ImportError:
        return
    stable = getattr(_export, "_CUSTOM_CALL_TARGETS_GUARANTEED_STABLE", None)
    if isinstance(stable, set):
        stable.update(names)


_declare_export_stable(REGISTERED)


def ext_cuda():
    """The compiled GPU module `attnaux._ext_cuda`, or None when it was not built."""
    return _ext_cuda


def has_target(name: str, platform: str) -> bool:
    """Whether the FFI target `name` was registered for `platform` ("cpu", "cuda")."""
    return platform in REGISTERED.get(name, ())


def target_unavailable(target: str, platform: str, dtype=None) -> str | None:
    """Why the FFI target `target` cannot serve a call with inputs of `dtype` on `platform`
    (not registered there, or float64 inputs, which no compiled kernel takes), or None."""
    if dtype is not None and dtype == "float64":
        return "float64 inputs run only on the reference backend"
    if not has_target(target, platform):
        if IMPORT_ERROR is not None:
            return f"the compiled extension is not available ({IMPORT_ERROR})"
        return f"no compiled implementation for the {platform!r} platform in this build"
    return None
