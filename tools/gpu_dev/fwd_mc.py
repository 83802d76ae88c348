# a small grid of the CUDA forward for compute-sanitizer (memcheck, racecheck): head dims 64,
# 128 and 256, causal, window, GQA, padding keys and rows; 140 tiles, so that on an H100 (132
# SMs) some CTAs take a second tile (the Q buffers' reuse)
import dataclasses

import jax
import jax.numpy as jnp

from attnaux import _flash_hopper as fh

for d, causal, window in ((128, True, None), (128, False, (70, 30)), (64, False, None),
                          (256, True, None), (256, False, (70, 30))):
    b, sq, skv, hq, hkv = 1, 1280, 512, 14, 2
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, skv, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, skv, hkv, d), jnp.bfloat16)
    none = jnp.zeros((b, hq, 0, sq), jnp.float32)
    nonek = jnp.zeros((b, hq, 0, skv), jnp.float32)
    geo = fh.Geometry(causal, window, 0, skv - 37, sq - 5)
    cfg = dataclasses.replace(fh.default_config(d, skv), cuda_forward=True)
    out, lse, mx = fh.forward(q, k, v, none, nonek, scale=d ** -0.5, softcap=None, geometry=geo,
                              tile_fn=None, config=cfg)
    print(d, causal, window, float(jnp.abs(out.astype(jnp.float32)).sum()),
          int(jnp.isinf(lse).sum()), int(jnp.isinf(mx).sum()))
