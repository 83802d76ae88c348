"""GPU benchmark of attnaux's own CUDA kernels, side by side in one run.

    python benchmarks/gpu_kernels.py

- copy: the measured device-to-device bandwidth (an XLA elementwise negate, read + write, and
  a jitted `jnp.copy`; the faster one counts) on a 1 GiB bf16 array;
- softmax at [8, 16, 2048, 2048] bf16, forward: `attnaux.softmax` (probs, lse, max) vs XLA's
  `jax.nn.softmax`; bandwidth = (read + write of the logits) / time, and its share of copy;
- small_seq at batch 30720, 8 heads, head dim 128, kv_seq 16, bf16: forward and forward+backward
  against `flash` (cuDNN) and `reference`; bandwidth = bytes of q, k, v, out (forward);
- probs vs reference at kv_seq 256 / 512 (when `probs` runs on this GPU).

Timing: jitted, 3 warm-up calls, then the best of 5 rounds of the mean of 10 back-to-back calls.
"""

import time

import jax
import jax.numpy as jnp

import attnaux


def timeit(fn, *args, rounds=5, calls=10):
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = fn(*args)
        jax.block_until_ready(r)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def row(cols, widths=(44, 12, 12, 12, 30)):
    print("| " + " | ".join(str(c).ljust(w) for c, w in zip(cols, widths)) + " |", flush=True)


def main():
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    row(("what", "time (ms)", "GB/s", "% copy", "vs"))
    row(("---",) * 5)
    # Copy bandwidth
    x = jnp.ones((1 << 29,), jnp.bfloat16)  # 1 GiB
    nbytes = 2 * x.size * 2
    t_neg = timeit(jax.jit(lambda a: -a), x)
    t_cpy = timeit(jax.jit(lambda a: jnp.copy(a) + 0), x)
    t_copy = min(t_neg, t_cpy)
    copy_bw = nbytes / t_copy / 1e9
    row(("copy 1 GiB bf16 (read+write)", f"{t_copy * 1e3:.3f}", f"{copy_bw:.0f}", "100", ""))
    del x

    # Softmax
    shape = (8, 16, 2048, 2048)
    logits = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
    sbytes = 2 * logits.size * 2
    f_ax = jax.jit(lambda a: attnaux.softmax(a, scale=0.125, backend="kernel"))
    f_xla = jax.jit(lambda a: jax.nn.softmax(a.astype(jnp.float32) * 0.125, axis=-1).astype(a.dtype))
    f_xla_bf = jax.jit(lambda a: jax.nn.softmax(a * 0.125, axis=-1))
    t_ax = timeit(f_ax, logits)
    t_xla = timeit(f_xla, logits)
    t_xla_bf = timeit(f_xla_bf, logits)
    bw = sbytes / t_ax / 1e9
    row(("softmax fwd [8,16,2048,2048] bf16 attnaux", f"{t_ax * 1e3:.3f}", f"{bw:.0f}",
         f"{100 * bw / copy_bw:.1f}", f"{t_xla / t_ax:.2f}x vs XLA f32-math"))
    row(("softmax fwd XLA (f32 math)", f"{t_xla * 1e3:.3f}", f"{sbytes / t_xla / 1e9:.0f}",
         f"{100 * sbytes / t_xla / 1e9 / copy_bw:.1f}", ""))
    row(("softmax fwd XLA (jax.nn.softmax bf16)", f"{t_xla_bf * 1e3:.3f}",
         f"{sbytes / t_xla_bf / 1e9:.0f}", f"{100 * sbytes / t_xla_bf / 1e9 / copy_bw:.1f}", ""))
    g = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(jnp.bfloat16)

    def grad_of(fn):
        return jax.jit(lambda a, g: jax.vjp(fn, a)[1](g)[0])

    t_axb = timeit(grad_of(lambda a: attnaux.softmax(a, scale=0.125, backend="kernel")[0]), logits, g)
    t_xlab = timeit(grad_of(lambda a: jax.nn.softmax(a.astype(jnp.float32) * 0.125, axis=-1)
                            .astype(a.dtype)), logits, g)
    row(("softmax fwd+bwd attnaux", f"{t_axb * 1e3:.3f}", "", "", f"{t_xlab / t_axb:.2f}x vs XLA"))
    row(("softmax fwd+bwd XLA", f"{t_xlab * 1e3:.3f}", "", "", ""))
    del logits, g

    # small_seq
    b, h, d, skv = 30720, 8, 128, 16
    q = jax.random.normal(jax.random.key(2), (b, 1, h, d), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(3), (b, skv, h, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(4), (b, skv, h, d), jnp.bfloat16)
    qbytes = (q.size * 2 + k.size + v.size + q.size) * 2
    times = {}
    for backend in ("small_seq", "flash", "reference"):
        try:
            fwd = jax.jit(lambda q, k, v, be=backend: attnaux.attention(q, k, v, backend=be))
            tf = timeit(fwd, q, k, v)
            loss = jax.jit(jax.grad(lambda q, k, v, be=backend: jnp.sum(
                attnaux.attention(q, k, v, backend=be)[0].astype(jnp.float32)), argnums=(0, 1, 2)))
            tb = timeit(loss, q, k, v)
            times[backend] = (tf, tb)
        except Exception as error:  # e.g. a backend that does not serve this on this GPU
            print(f"  ({backend}: {type(error).__name__}: {str(error)[:150]})")
    if "small_seq" in times:
        tf, tb = times["small_seq"]
        bw = qbytes / tf / 1e9
        vs = ", ".join(f"{times[o][0] / tf:.2f}x / {times[o][1] / tb:.2f}x vs {o}"
                       for o in ("flash", "reference") if o in times)
        row(("small_seq fwd 30720x8x128 kv16 bf16", f"{tf * 1e3:.3f}", f"{bw:.0f}",
             f"{100 * bw / copy_bw:.1f}", vs + " (fwd / fwd+bwd)"))
    for o, (tf, tb) in times.items():
        row((f"  {o}: fwd / fwd+bwd", f"{tf * 1e3:.3f}", f"{qbytes / tf / 1e9:.0f}",
             f"{100 * qbytes / tf / 1e9 / copy_bw:.1f}", f"fwd+bwd {tb * 1e3:.3f} ms"))
    del q, k, v

    # probs
    for skv in (256, 512):
        b, s, h, d = 8, skv, 16, 128
        q = jax.random.normal(jax.random.key(5), (b, s, h, d), jnp.bfloat16)
        res = {}
        for backend in ("probs", "reference"):
            e = attnaux.explain(q, q, q, backend="auto")
            try:
                fwd = jax.jit(lambda q, be=backend: attnaux.attention(q, q, q, backend=be))
                tb = timeit(jax.jit(jax.grad(lambda q, be=backend: jnp.sum(
                    attnaux.attention(q, q, q, backend=be)[0].astype(jnp.float32)))), q)
                res[backend] = (timeit(fwd, q), tb)
            except Exception as error:
                res[backend] = None
                print(f"  (probs kv {skv}: {backend} not served: {str(error)[:160]})")
        for backend, r in res.items():
            if r is not None:
                row((f"{backend} fwd / fwd+bwd 8x{skv}x16x128 bf16", f"{r[0] * 1e3:.3f}", "", "",
                     f"fwd+bwd {r[1] * 1e3:.3f} ms"))
        print(f"  auto picks: {e.backend}")


if __name__ == "__main__":
    main()
