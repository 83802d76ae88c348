"""GPU benchmark of attnaux's own CUDA kernels, side by side in one run.

    python benchmarks/gpu_kernels.py            # everything
    python benchmarks/gpu_kernels.py small_seq  # one section: copy, softmax, small_seq, probs

- copy: the measured device-to-device bandwidth (an XLA elementwise negate and a jitted copy of a
  1 GiB bf16 array, bytes read + written; the faster counts). Every "% copy" below is against it.
- softmax at [8, 16, 2048, 2048] bf16: `attnaux.softmax` (probs, lse, max) against XLA's softmax,
  forward (bandwidth = logits read + probs written) and forward+backward.
- small_seq at batch 30720, 8 heads, head dim 128, kv_seq 16, bf16: forward and
  forward+backward (`jax.grad`) of `small_seq`, `flash` (cuDNN) and `reference`. Bandwidth counts
  the fewest bytes each pass must move: forward q, k, v read and out written; forward+backward
  adds the backward's q, k, v, dout and P read and dq, dk, dv written (k and v are read twice:
  the backward is a separate kernel).
- probs (XLA GEMMs around attnaux's CUDA softmax) against `reference` and `flash` at
  4x256x8x64, 4x512x8x64 and 16x512x16x64 bf16, plus a boolean-mask row (`flash` takes the mask
  as a 0 / -inf bias).

Timing: jitted, 3 warm-up calls, then the best of 5 rounds of the mean of 10 back-to-back calls.
"""

import sys
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


def row(cols, widths=(46, 11, 8, 8, 52)):
    print("| " + " | ".join(str(c).ljust(w) for c, w in zip(cols, widths)) + " |", flush=True)


def fwd_and_grad(backend, **options):
    """Jitted forward (out and aux) and gradient (of sum(out) w.r.t. q, k, v) of one backend."""
    fwd = jax.jit(lambda q, k, v: attnaux.attention(q, k, v, backend=backend, **options))
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attnaux.attention(
        q, k, v, backend=backend, **options)[0].astype(jnp.float32)), argnums=(0, 1, 2)))
    return fwd, grad


def copy_bandwidth():
    x = jnp.ones((1 << 29,), jnp.bfloat16)  # 1 GiB
    nbytes = 2 * x.size * 2
    t = min(timeit(jax.jit(lambda a: -a), x), timeit(jax.jit(lambda a: jnp.copy(a) + 0), x))
    bw = nbytes / t / 1e9
    row(("copy 1 GiB bf16 (read+write)", f"{t * 1e3:.3f}", f"{bw:.0f}", "100", ""))
    return bw


def softmax_section(copy_bw):
    shape = (8, 16, 2048, 2048)
    logits = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
    sbytes = 2 * logits.size * 2
    def ax(a):
        return attnaux.softmax(a, scale=0.125, backend="kernel")

    def xla(a):
        return jax.nn.softmax(a.astype(jnp.float32) * 0.125, axis=-1).astype(a.dtype)

    f_ax, f_xla = jax.jit(ax), jax.jit(xla)
    t_ax, t_xla = timeit(f_ax, logits), timeit(f_xla, logits)
    bw = sbytes / t_ax / 1e9
    row(("softmax fwd [8,16,2048,2048] bf16 attnaux", f"{t_ax * 1e3:.3f}", f"{bw:.0f}",
         f"{100 * bw / copy_bw:.1f}", f"{t_xla / t_ax:.2f}x vs XLA (f32 math)"))
    row(("softmax fwd XLA (f32 math)", f"{t_xla * 1e3:.3f}", f"{sbytes / t_xla / 1e9:.0f}",
         f"{100 * sbytes / t_xla / 1e9 / copy_bw:.1f}", ""))
    g = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(jnp.bfloat16)

    def grad_of(fn):
        return jax.jit(lambda a, g: jax.vjp(fn, a)[1](g)[0])

    t_axb = timeit(grad_of(lambda a: ax(a)[0]), logits, g)
    t_xlab = timeit(grad_of(xla), logits, g)
    row(("softmax fwd+bwd attnaux", f"{t_axb * 1e3:.3f}", "", "", f"{t_xlab / t_axb:.2f}x vs XLA"))
    row(("softmax fwd+bwd XLA", f"{t_xlab * 1e3:.3f}", "", "", ""))


def small_seq_section(copy_bw):
    b, h, d, skv = 30720, 8, 128, 16
    q = jax.random.normal(jax.random.key(2), (b, 1, h, d), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(3), (b, skv, h, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(4), (b, skv, h, d), jnp.bfloat16)
    qo, kv, p = q.size * 2, k.size * 2, b * h * skv * 2  # bytes of q (= out, dout), k (= v), P
    fwd_bytes = 2 * qo + 2 * kv  # q, k, v read; out written
    both_bytes = fwd_bytes + p + (2 * qo + 2 * kv + p) + (qo + 2 * kv)  # + P; bwd reads; grads
    times = {}
    for backend in ("small_seq", "flash", "reference"):
        try:
            fwd, grad = fwd_and_grad(backend)
            times[backend] = (timeit(fwd, q, k, v), timeit(grad, q, k, v))
        except Exception as error:  # a backend that does not serve this on this GPU
            print(f"  ({backend}: {type(error).__name__}: {str(error)[:150]})")
    for name, (tf, tb) in times.items():
        vs = ""
        if name == "small_seq":
            vs = "; ".join(f"{times[o][0] / tf:.2f}x / {times[o][1] / tb:.2f}x vs {o}"
                           for o in ("flash", "reference") if o in times)
        for what, t, nbytes in (("fwd", tf, fwd_bytes), ("fwd+bwd", tb, both_bytes)):
            bw = nbytes / t / 1e9
            row((f"{name} {what} 30720x1x8x128 kv16 bf16", f"{t * 1e3:.3f}", f"{bw:.0f}",
                 f"{100 * bw / copy_bw:.1f}", vs if what == "fwd" else ""))
    print(f"  auto picks: {attnaux.explain(q, k, v).backend}")


def probs_section(copy_bw):
    del copy_bw
    shapes = [(4, 256, 8, 64, False), (4, 512, 8, 64, False), (16, 512, 16, 64, False),
              (4, 512, 8, 64, True)]
    for bsz, s, h, d, masked in shapes:
        keys = jax.random.split(jax.random.key(5), 3)
        q, k, v = (jax.random.normal(kk, (bsz, s, h, d), jnp.bfloat16) for kk in keys)
        options = {"mask": jnp.tril(jnp.ones((s, s), bool))} if masked else {}
        res = {}
        for backend in ("probs", "reference", "flash"):
            try:
                fwd, grad = fwd_and_grad(backend, **options)
                res[backend] = (timeit(fwd, q, k, v), timeit(grad, q, k, v))
            except Exception as error:
                print(f"  ({backend} {bsz}x{s}x{h}x{d}: {str(error)[:120]})")
        label = f"{bsz}x{s}x{h}x{d} bf16" + (" bool mask" if masked else "")
        for backend, (tf, tb) in res.items():
            vs = ""
            if backend == "probs":
                vs = "; ".join(f"{res[o][0] / tf:.2f}x / {res[o][1] / tb:.2f}x vs {o}"
                               for o in ("reference", "flash") if o in res)
            row((f"{backend} {label}", f"{tf * 1e3:.3f}", "", "",
                 f"fwd+bwd {tb * 1e3:.3f} ms {vs}"))
        print(f"  auto picks: {attnaux.explain(q, k, v, **options).backend}")


def main():
    sections = sys.argv[1:] or ["softmax", "small_seq", "probs"]
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    row(("what", "time (ms)", "GB/s", "% copy", "vs (fwd / fwd+bwd)"))
    row(("---",) * 5)
    copy_bw = copy_bandwidth()
    for name in sections:
        {"softmax": softmax_section, "small_seq": small_seq_section,
         "probs": probs_section}[name](copy_bw)


if __name__ == "__main__":
    main()
