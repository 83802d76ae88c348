"""The CUDA forward against the Pallas forward and FlashAttention-3, forward only, one process
(7 rounds of 20 calls, the candidates taking turns; the minimum and the median of the rounds):

    python tools/gpu_dev/fwd_ab.py 4x2048x16x128 1x8192x16x128

The arguments: shapes BxSxHxD, each run causal and not. (Until 2026-11-27's seventh session a
first argument listed development variants of the kernel.)"""

import dataclasses
import statistics
import sys
import time

import dew_flash_attn
import jax
import jax.numpy as jnp

from attnaux import _flash_hopper as fh


def forms(q, causal):
    b, s, h, d = q.shape
    none = jnp.zeros((b, h, 0, s), jnp.float32)
    cfg = dataclasses.replace(fh.default_config(d, s, banded=causal), cuda_forward=True)
    kw = dict(scale=d ** -0.5, softcap=None, geometry=fh.Geometry(causal, None, 0, s, s),
              tile_fn=None)
    ours = jax.jit(lambda q, k, v: fh.forward(q, k, v, none, none, config=cfg, **kw))
    pallas_cfg = dataclasses.replace(cfg, cuda_forward=False)
    pallas = jax.jit(lambda q, k, v: fh.forward(q, k, v, none, none, config=pallas_cfg, **kw))
    fa3 = jax.jit(lambda q, k, v: dew_flash_attn.flash_mha(q, k, v, is_causal=causal))
    return {"cuda": ours, "pallas": pallas, "fa3": fa3}


def main():
    for shape in sys.argv[1:]:
        b, s, h, d = (int(x) for x in shape.split("x"))
        q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16)
                   for kk in jax.random.split(jax.random.key(0), 3))
        for causal in (False, True):
            fns = forms(q, causal)
            for name in list(fns):  # a form this build or JAX cannot run is named and left out
                try:
                    jax.block_until_ready(fns[name](q, k, v))
                except Exception as e:  # noqa: BLE001
                    print(f"{shape} causal={int(causal)}: {name} left out: "
                          f"{str(e).splitlines()[0][:200]}", flush=True)
                    del fns[name]
            ref = fns["fa3"](q, k, v)
            ref = (ref[0] if isinstance(ref, tuple) else ref).astype(jnp.float32)
            times = {name: [] for name in fns}
            for rnd in range(7):
                for name, f in fns.items():
                    r = jax.block_until_ready(f(q, k, v))
                    if rnd == 0 and name == "cuda":
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
