"""Dropout on a GPU: attnaux's Hopper kernels (attnaux's Philox keep-mask drawn in the kernel,
what context parallelism runs on a Hopper GPU) against the same kernels without dropout and
against cuDNN with and without its own dropout, and an ALiBi `score_mod` with dropout on the
Hopper kernels against `flex`; ms forward and forward+backward (median of 20), bf16, causal.
`python benchmarks/gpu_dropout.py` on a Hopper GPU."""

import time

import jax
import jax.numpy as jnp
import numpy as np

import attnaux as ax
from attnaux import _hopper_packed as hpk
from attnaux._canon import canonicalize, parse_statics

B, S, H, D = 4, 2048, 16, 128
KEY = jax.random.key(1)


def hopper(rate):
    def f(q, k, v):
        st = parse_statics(scale=None, causal=True, window=None, softcap=None, dropout_rate=rate)
        p = canonicalize(q, k, v, st, key=KEY if rate else None)
        return hpk.run(p.arrays, p.options, False)[0]

    return f


def cudnn(rate):
    def f(q, k, v):
        return ax.attention(q, k, v, causal=True, dropout_rate=rate, key=KEY if rate else None,
                            backend="flash")[0]

    return f


def alibi(backend, rate):
    slopes = 2.0 ** -jnp.arange(1, H + 1, dtype=jnp.float32)

    def f(q, k, v):
        return ax.attention(q, k, v, causal=True, dropout_rate=rate, key=KEY if rate else None,
                            score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i),
                            backend=backend)[0]

    return f


def forward_backward(f):
    def loss(q, k, v):
        return (f(q, k, v).astype(jnp.float32) ** 2).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


def median_ms(f, args, n=20):
    f = jax.jit(f)
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def main():
    ks = jax.random.split(jax.random.key(0), 3)
    args = tuple(jax.random.normal(x, (B, S, H, D), jnp.bfloat16) for x in ks)
    print(jax.devices()[0].device_kind, f"{B}x{S}x{H}x{D} bf16 causal")
    for name, make in (("Hopper kernels", hopper), ("cuDNN", cudnn)):
        for rate in (0.0, 0.1):
            fwd = median_ms(make(rate), args)
            both = median_ms(forward_backward(make(rate)), args)
            print(f"{name}, dropout {rate}: fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms", flush=True)
    for backend in ("auto", "flex"):
        fwd = median_ms(alibi(backend, 0.1), args, n=5)
        both = median_ms(forward_backward(alibi(backend, 0.1)), args, n=5)
        print(f"ALiBi score_mod, backend={backend}, dropout 0.1: fwd {fwd:.3f} ms, "
              f"fwd+bwd {both:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
