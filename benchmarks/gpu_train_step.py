"""GPU benchmark: a GPT-style training step with attnaux's attention and with the alternatives.

    python benchmarks/gpu_train_step.py                 # the shape of issue 23 (below)
    python benchmarks/gpu_train_step.py --layers 2      # a quicker look

A decoder-only transformer written in plain JAX (pre-RMSNorm blocks: fused QKV projection, causal
attention, output projection, a 4x GELU MLP; tied embedding and LM head, float32 cross-entropy),
bf16 parameters and activations, default 12 layers, dim 1024, 16 heads x 64, sequence 2048,
batch 8, vocabulary 32768. One step = loss, gradients of every parameter, an SGD update, jitted.
The attention of every layer is, side by side in one run:

- `jax.nn cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, no statistics;
- `attnaux`: `attnaux.attention(..., causal=True)` (`auto`: cuDNN `flash` on the GPU), aux unused;
- `attnaux + z-loss + max`: the same call, plus a z-loss `1e-4 * mean(aux.lse**2)` of every layer
  in the loss (its gradient goes through the fused backward) and the per-head max logit of every
  layer read from `aux.max` and returned with the loss (what QK-clip reads);
- `fa3`: FlashAttention-3 (`dew_flash_attn.flash_mha`) when that package is importable;
- with `--breakdown` also `attnaux + z-loss` and `attnaux + max` (each statistic alone).

Timing: `gpu_flash.timed` (median over rounds of back-to-back steps, the candidates taking turns).
Prints ms per step and the ratio of each to `jax.nn cudnn`; the target of issue 23 is `attnaux +
z-loss + max` within 1.02x of `jax.nn cudnn`.
"""

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp

import attnaux

sys.path.insert(0, os.path.dirname(__file__))
from gpu_flash import timed  # noqa: E402

try:
    import dew_flash_attn
except ImportError:  # FlashAttention-3 is optional
    dew_flash_attn = None

Z_LOSS = 1e-4


def _attend(kind, q, k, v):
    """`(out, z-loss term, max logit per head or None)` of one layer's attention."""
    if kind == "jax.nn cudnn":
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return out, 0, None
    if kind == "fa3":
        return dew_flash_attn.flash_mha(q, k, v, is_causal=True), 0, None
    out, aux = attnaux.attention(q, k, v, causal=True)
    z = Z_LOSS * jnp.mean(aux.lse**2) if "z-loss" in kind else 0
    mx = jnp.max(aux.max, axis=(0, 2)) if "max" in kind else None
    return out, z, mx


def init(key, layers, dim, heads, vocab):
    keys = jax.random.split(key, 4 * layers + 1)
    normal = lambda k, shape, fan_in: (  # noqa: E731
        jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(jnp.bfloat16)
    blocks = [dict(qkv=normal(keys[4 * i], (dim, 3 * dim), dim),
                   proj=normal(keys[4 * i + 1], (dim, dim), dim),
                   up=normal(keys[4 * i + 2], (dim, 4 * dim), dim),
                   down=normal(keys[4 * i + 3], (4 * dim, dim), 4 * dim),
                   norm1=jnp.ones((dim,), jnp.bfloat16), norm2=jnp.ones((dim,), jnp.bfloat16))
              for i in range(layers)]
    return dict(embed=normal(keys[-1], (vocab, dim), 1), blocks=blocks,
                norm=jnp.ones((dim,), jnp.bfloat16))


def _rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return x32.astype(x.dtype) * scale


def loss_fn(kind, heads, params, tokens):
    b, s = tokens.shape
    x = params["embed"][tokens[:, :-1]]
    extra, maxes = 0.0, []
    for blk in params["blocks"]:
        qkv = (_rms_norm(x, blk["norm1"]) @ blk["qkv"]).reshape(b, s - 1, 3, heads, -1)
        out, z, mx = _attend(kind, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        extra, maxes = extra + z, maxes + ([] if mx is None else [mx])
        x = x + out.reshape(b, s - 1, -1) @ blk["proj"]
        x = x + jax.nn.gelu(_rms_norm(x, blk["norm2"]) @ blk["up"]) @ blk["down"]
    logits = (_rms_norm(x, params["norm"]) @ params["embed"].T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    return nll + extra, jnp.stack(maxes) if maxes else jnp.zeros(())


def make_step(kind, heads, lr=1e-3):
    def step(params, tokens):
        (loss, maxes), grads = jax.value_and_grad(
            lambda p: loss_fn(kind, heads, p, tokens), has_aux=True)(params)
        params = jax.tree.map(lambda p, g: (p - lr * g).astype(p.dtype), params, grads)
        return params, loss, maxes
    return jax.jit(step)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()
    params = init(jax.random.key(0), args.layers, args.dim, args.heads, args.vocab)
    # seq + 1 tokens: the model reads `seq` of them and predicts the next
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, args.vocab)
    kinds = ["jax.nn cudnn", "attnaux", "attnaux + z-loss + max"]
    if args.breakdown:
        kinds += ["attnaux + z-loss", "attnaux + max"]
    if dew_flash_attn is not None:
        kinds.append("fa3")
    steps = {kind: make_step(kind, args.heads) for kind in kinds}
    times = timed(steps, (params, tokens), rounds=args.rounds, round_s=0.3)
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; {args.layers} layers, "
          f"dim {args.dim}, {args.heads} heads x {args.dim // args.heads}, seq {args.seq}, "
          f"batch {args.batch}, vocab {args.vocab}, bf16")
    print("| attention | ms per step | / jax.nn cudnn |")
    print("|---|---|---|")
    for kind in kinds:
        print(f"| {kind} | {times[kind] * 1e3:.2f} | "
              f"{times[kind] / times['jax.nn cudnn']:.3f}x |")


if __name__ == "__main__":
    main()
