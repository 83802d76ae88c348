# a small grid of the CUDA forward for compute-sanitizer (memcheck, racecheck): causal, window,
# GQA, padding keys and rows
import dataclasses

import jax
import jax.numpy as jnp

from attnaux import _flash_hopper as fh

for causal, window in ((True, None), (False, (70, 30)), (False, None)):
    b, sq, skv, hq, hkv, d = 1, 384, 512, 4, 2, 128
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
    print(causal, window, float(jnp.abs(out.astype(jnp.float32)).sum()),
          int(jnp.isinf(lse).sum()), int(jnp.isinf(mx).sum()))
