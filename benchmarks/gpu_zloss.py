"""GPU benchmark: what a loss on `aux.lse` (a z-loss) costs on top of attnaux's fused backward.

    python benchmarks/gpu_zloss.py

Side by side in one run, bf16, causal, the shapes of issue 23, forward+backward (`jax.grad` of a
loss, jitted) of:

- `plain`: `sum(out * w)`, no lse cotangent;
- `z-loss`: `sum(out * w) + 1e-4 * mean(lse^2)`, the lse cotangent folded into O by attnaux's
  CUDA kernel `attnaux_fold_lse` (one pass over O and dO, then one cuDNN backward);
- `z-loss (xla fold)`: the same fold as XLA's fusion of `_flash_cudnn.fold_lse_cotangent`;
- `z-loss (columns)`: the same loss through the extra-column path (O, dO and V with 8 more
  columns), which every call took before;
- `lse only`: `mean(lse^2)` (no output cotangent: the extra-column path);
- `jax.nn cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` with the plain loss.

Timing as `benchmarks/gpu_flash.py` (median of rounds, candidates taking turns). Prints ms and
the ratio of each to `plain`.
"""

import os
import sys

import jax
import jax.numpy as jnp

import attnaux
from attnaux import _flash_cudnn

sys.path.insert(0, os.path.dirname(__file__))
from gpu_flash import timed  # noqa: E402

SHAPES = [(8, 2048, 16, 64), (8, 1024, 16, 128), (2, 4096, 16, 128)]


def _loss(kind):
    def loss(q, k, v, w):
        if kind == "jax.nn cudnn":
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            return jnp.sum(out.astype(jnp.float32) * w)
        out, aux = attnaux.attention(q, k, v, causal=True, backend="flash")
        plain = jnp.sum(out.astype(jnp.float32) * w)
        zloss = 1e-4 * jnp.mean(aux.lse**2)
        return {"plain": plain, "lse only": zloss}.get(kind, plain + zloss)
    return loss


def _grad(kind, fold, args):
    """The compiled step, traced afresh with the fold `fold` ("kernel", "xla" or False: the
    extra columns); attnaux's inner jit would otherwise reuse the first variant's trace."""
    def step(q, k, v, w):
        return jax.grad(_loss(kind), argnums=(0, 1, 2))(q, k, v, w)
    _flash_cudnn.FOLD_LSE_COTANGENT = bool(fold)
    _flash_cudnn.FOLD_WITH_KERNEL = fold == "kernel"
    jax.clear_caches()
    try:
        return jax.jit(step).lower(*args).compile()
    finally:
        _flash_cudnn.FOLD_LSE_COTANGENT = True
        _flash_cudnn.FOLD_WITH_KERNEL = True


def main():
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    names = ["plain", "z-loss", "z-loss (xla fold)", "z-loss (columns)", "lse only",
             "jax.nn cudnn"]
    print("| shape (b x s x h x d) | " + " | ".join(names) + " | z-loss / plain |")
    print("|---|" + "---|" * (len(names) + 1))
    for b, s, h, d in SHAPES:
        key = jax.random.key(0)
        q, k, v, w = (jax.random.normal(jax.random.fold_in(key, i), (b, s, h, d), jnp.bfloat16)
                      for i in range(4))
        w = w.astype(jnp.float32)
        args = (q, k, v, w)
        fns = {"plain": _grad("plain", "kernel", args),
               "z-loss": _grad("z-loss", "kernel", args),
               "z-loss (xla fold)": _grad("z-loss", "xla", args),
               "z-loss (columns)": _grad("z-loss", False, args),
               "lse only": _grad("lse only", "kernel", args),
               "jax.nn cudnn": _grad("jax.nn cudnn", "kernel", args)}
        t = timed(fns, args)
        cells = [f"{t[n] * 1e3:.3f} ({t[n] / t['plain']:.2f}x)" for n in names]
        print(f"| {b}x{s}x{h}x{d} | " + " | ".join(cells) + f" | {t['z-loss'] / t['plain']:.2f}x |")
    print("(ms, median of rounds; in parentheses: the ratio to plain)")


if __name__ == "__main__":
    main()
