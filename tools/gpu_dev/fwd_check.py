# the CUDA C++ forward against the Pallas one (same inputs): agreement and
# forward TFLOP/s, one process, forms taking turns; the second half of each argument list:
# shapes BxSxHxD
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp

from attnaux import _flash_hopper as fh

for shape in sys.argv[1:]:
    b, s, h, d = (int(x) for x in shape.split("x"))
    for causal in (False, True):
        ks = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks)
        none = jnp.zeros((b, h, 0, s), jnp.float32)
        geo = fh.Geometry(causal, None, 0, s, s)
        base = fh.default_config(d, s, banded=causal)
        cfgs = {"pallas": base, "cuda": dataclasses.replace(base, cuda_forward=True)}
        kw = dict(scale=d ** -0.5, softcap=None, geometry=geo, tile_fn=None)
        fns = {n: jax.jit(lambda q, k, v, c=c, none=none, kw=kw:
                          fh.forward(q, k, v, none, none, config=c, **kw))
               for n, c in cfgs.items()}
        res = {n: jax.block_until_ready(f(q, k, v)) for n, f in fns.items()}
        for name, i in (("out", 0), ("lse", 1), ("max", 2)):
            a, r = (res[n][i].astype(jnp.float32) for n in ("cuda", "pallas"))
            print(f"{shape} causal={causal} {name}: |cuda-pallas| {float(jnp.abs(a - r).max()):.3g}"
                  f" scale {float(jnp.abs(r).max()):.3g}", flush=True)
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        best = {n: 1e9 for n in fns}
        for _ in range(5):
            for n, f in fns.items():
                t = time.perf_counter()
                for _ in range(20):
                    r = f(q, k, v)
                jax.block_until_ready(r)
                best[n] = min(best[n], (time.perf_counter() - t) / 20)
        print(f"{shape} causal={causal} forward TFLOP/s: " +
              ", ".join(f"{n} {flops / t / 1e12:.0f}" for n, t in best.items()), flush=True)
