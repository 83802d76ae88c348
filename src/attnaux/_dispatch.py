"""Backend choice: which backend serves a call, and why the others do not."""

import dataclasses

import jax
import jax.numpy as jnp

from . import _ffi
from ._canon import Problem
from ._flash import FWD_TARGET

BACKENDS = ("auto", "flash", "probs", "small_seq", "reference")


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What `attnaux.explain` returns.

    **Fields:**

    - `backend`: the backend that would run (`"flash"`, `"probs"`, `"small_seq"` or
      `"reference"`).
    - `implementation`: how it runs on this platform (for example `"C++ (XLA FFI, cpu)"`).
    - `platform`: the JAX platform the choice was made for (`"cpu"`, `"gpu"`, ...).
    - `reasons`: for every backend, why it was chosen or why not.
    """

    backend: str
    implementation: str
    platform: str
    reasons: dict[str, str]

    def __str__(self) -> str:
        lines = [f"backend: {self.backend} ({self.implementation}) on {self.platform}"]
        for name, why in self.reasons.items():
            mark = "*" if name == self.backend else "-"
            lines.append(f"  {mark} {name}: {why}")
        return "\n".join(lines)


def check_backend(backend: object) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}.")
    return backend


def _platform() -> str:
    return jax.default_backend()


def _flash_unavailable(problem: Problem, platform: str, return_probs: bool) -> str | None:
    if return_probs:
        return "does not save the probabilities (return_probs=True)"
    if problem.arrays.q.dtype == jnp.float64:
        return "float64 inputs run only on the reference backend"
    if not _ffi.has_target(FWD_TARGET, platform):
        if _ffi.IMPORT_ERROR is not None:
            return f"the compiled extension is not available ({_ffi.IMPORT_ERROR})"
        return f"no compiled implementation for the {platform!r} platform in this build"
    return None


def choose(problem: Problem, backend: str, return_probs: bool) -> Explanation:
    """Picks the backend for a validated call; raises if an explicit request cannot be served."""
    backend = check_backend(backend)
    platform = _platform()
    reasons: dict[str, str] = {}

    flash_no = _flash_unavailable(problem, platform, return_probs)
    reasons["flash"] = flash_no or "serves every option here; O(seq) memory"
    not_built = "not implemented in this version of attnaux"
    reasons["probs"] = not_built
    reasons["small_seq"] = not_built
    reasons["reference"] = "pure JAX; materialises the q_seq x kv_seq scores"

    if backend == "auto":
        chosen = "flash" if flash_no is None else "reference"
        if chosen == "reference":
            reasons["reference"] += "; chosen because flash cannot serve this call"
    else:
        chosen = backend
        why_not = {"flash": flash_no, "probs": not_built, "small_seq": not_built}.get(chosen)
        if why_not is not None:
            raise ValueError(f"backend={chosen!r} cannot serve this call: {why_not}.")
    implementation = {
        "flash": f"C++ (XLA FFI, {platform})",
        "reference": "pure JAX (XLA)",
    }[chosen]
    return Explanation(chosen, implementation, platform, reasons)
