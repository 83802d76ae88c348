"""GPU benchmark: attnaux `flash` (cuDNN) against FlashAttention-3 on plain attention, one run.

    python benchmarks/gpu_fa3_gap.py
    ATTNAUX_CUDNN_HEUR=B python benchmarks/gpu_fa3_gap.py      # cuDNN's heuristics mode B
    ATTNAUX_CUDNN_PLAN=1 python benchmarks/gpu_fa3_gap.py      # cuDNN's second candidate plan
    ATTNAUX_CUDNN_VERBOSE=1 python benchmarks/gpu_fa3_gap.py   # lists cuDNN's candidates

bf16, the GPU shapes of shared/BENCHMARKS.md, causal and not: forward and forward+backward
(`jax.vjp` of out with a fixed cotangent) of `attnaux.attention(..., backend="flash")` and of
FlashAttention-3 (`dew_flash_attn.flash_mha`, which must be importable), the two taking turns
(`gpu_flash.timed`). Prints FA3 time / attnaux time (1.0 = parity) and both times in ms. The
`ATTNAUX_CUDNN_*` variables are read when cuDNN's graphs are built (measurement knobs of
`csrc/cuda/cudnn_graphs.h`); compare runs by their ratios, FA3 being measured in each.
"""

import os
import sys

import jax
import jax.numpy as jnp

import attnaux

sys.path.insert(0, os.path.dirname(__file__))
import dew_flash_attn  # noqa: E402
from gpu_flash import SHAPES, timed  # noqa: E402


def main():
    tag = (f"heuristics {os.environ.get('ATTNAUX_CUDNN_HEUR', 'A')}, "
           f"plan {os.environ.get('ATTNAUX_CUDNN_PLAN', 'the first')}")
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; bf16; cuDNN {tag}")
    print("| b x s x h x d | causal | fa3 / attnaux fwd | fwd+bwd | ms attnaux fwd / fwd+bwd "
          "| ms fa3 fwd / fwd+bwd |")
    print("|---|---|---|---|---|---|")
    for b, s, h, d in SHAPES:
        key = jax.random.key(0)
        q, k, v, w = (jax.random.normal(jax.random.fold_in(key, i), (b, s, h, d), jnp.bfloat16)
                      for i in range(4))
        for causal in (False, True):
            fns = {
                "ax": lambda q, k, v, c=causal: attnaux.attention(q, k, v, causal=c,
                                                                  backend="flash")[0],
                "fa3": lambda q, k, v, c=causal: dew_flash_attn.flash_mha(q, k, v, is_causal=c),
            }
            steps = {n: jax.jit(f) for n, f in fns.items()}
            steps.update({n + " fb": jax.jit(lambda q, k, v, f=f, w=w: jax.vjp(f, q, k, v)[1](w))
                          for n, f in fns.items()})
            t = timed(steps, (q, k, v), rounds=5)
            print(f"| {b}x{s}x{h}x{d} | {'yes' if causal else 'no'} "
                  f"| {t['fa3'] / t['ax']:.3f} | {t['fa3 fb'] / t['ax fb']:.3f} "
                  f"| {t['ax'] * 1e3:.3f} / {t['ax fb'] * 1e3:.3f} "
                  f"| {t['fa3'] * 1e3:.3f} / {t['fa3 fb'] * 1e3:.3f} |", flush=True)


if __name__ == "__main__":
    main()
