"""The CUDA forward against the Pallas forward and FlashAttention-3, forward only, one process
(7 rounds of 20 calls, the candidates taking turns; the minimum and the median of the rounds):

    python tools/gpu_dev/fwd_ab.py 0 4x2048x16x128 1x8192x16x128

The first argument lists the values of `ATTNAUX_FWD_VARIANT` to take turns, for a development
build whose launcher reads it (0 otherwise); then shapes BxSxHxD, each causal and not."""

import dataclasses
import os
import statistics
import sys
import time

import dew_flash_attn
import jax
import jax.numpy as jnp

from attnaux import _flash_hopper as fh


def forms(q, causal, variants):
    b, s, h, d = q.shape
    none = jnp.zeros((b, h, 0, s), jnp.float32)
    cfg = dataclasses.replace(fh.default_config(d, s, banded=causal), cuda_forward=True)
    kw = dict(scale=d ** -0.5, softcap=None, geometry=fh.Geometry(causal, None, 0, s, s),
              tile_fn=None, config=cfg)
    ours = jax.jit(lambda q, k, v: fh.forward(q, k, v, none, none, **kw))
    pallas_kw = kw | {"config": dataclasses.replace(cfg, cuda_forward=False)}
    pallas = jax.jit(lambda q, k, v: fh.forward(q, k, v, none, none, **pallas_kw))
    fa3 = jax.jit(lambda q, k, v: dew_flash_attn.flash_mha(q, k, v, is_causal=causal))
    return {f"v{x}": ours for x in variants} | {"pallas": pallas, "fa3": fa3}


def main():
    variants = [int(x) for x in sys.argv[1].split(",")]
    for shape in sys.argv[2:]:
        b, s, h, d = (int(x) for x in shape.split("x"))
        q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16)
                   for kk in jax.random.split(jax.random.key(0), 3))
        for causal in (False, True):
            fns = forms(q, causal, variants)
            ref = fns["fa3"](q, k, v)
            ref = (ref[0] if isinstance(ref, tuple) else ref).astype(jnp.float32)
            times = {name: [] for name in fns}
            for rnd in range(7):
                for name, f in fns.items():
                    if name.startswith("v"):
                        os.environ["ATTNAUX_FWD_VARIANT"] = name[1:]
                    r = jax.block_until_ready(f(q, k, v))
                    if rnd == 0 and name.startswith("v"):
                        err = float(jnp.abs(r[0].astype(jnp.float32) - ref).max())
                        assert err < 0.02, (name, err)
                    t = time.perf_counter()
                    for _ in range(20):
                        r = f(q, k, v)
                    jax.block_until_ready(r)
                    times[name].append((time.perf_counter() - t) / 20)
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            print(f"{shape} causal={int(causal)} fwd TFLOP/s (min / median): " + ", ".join(
                f"{n} {flops / min(t) / 1e12:.0f} / {flops / statistics.median(t) / 1e12:.0f}"
                for n, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
