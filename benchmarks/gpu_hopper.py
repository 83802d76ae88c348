"""GPU benchmark: attnaux's own Hopper kernels against cuDNN and FlashAttention-3, one run.

    python benchmarks/gpu_hopper.py            # every shape of gpu_flash.SHAPES, causal and not
    python benchmarks/gpu_hopper.py --quick    # two shapes
    python benchmarks/gpu_hopper.py --shapes 2x4096x32x64,8x1024x32x64   # these shapes
    python benchmarks/gpu_hopper.py --candidates hopper --config fused:fused_dq=True
        # an A/B of `_flash_hopper.Config` fields: each --config NAME:FIELD=VALUE[,...] adds a
        # candidate `NAME`, the Hopper kernels with those fields changed; `cuda_backward=False`
        # keeps the Pallas backward where `default_config` takes the CUDA C++ one
        # (csrc/cuda/hopper_bwd.cu, where it was built)

bf16 plain attention (no mask function), forward and forward+backward (`jax.vjp` of out with a
fixed cotangent), side by side and taking turns (`gpu_flash.timed`):

- `hopper`: attnaux's Pallas kernels (`_flash_hopper.forward`, and its backward as the VJP:
  dQ summed in the dK/dV kernel at head dim 64; at 128 the CUDA C++ backward where
  `default_config` takes it, else a second kernel for dQ), called directly;
- each `--config` candidate: the same with some `Config` fields changed;
- `cudnn`: cuDNN through attnaux's FFI handlers, forward and backward (`_flash_cudnn`);
- `flash`: `attnaux.attention(backend="flash")` as `auto` runs it for plain attention on GPU:
  where `_dispatch.gpu_forward_on_hopper` holds, the forward on the Hopper kernel and cuDNN's
  backward, elsewhere `cudnn`;
- `fa3`: FlashAttention-3 (`dew_flash_attn.flash_mha`, which must be importable).

TFLOP/s as FlashAttention counts them (4*b*h*s*s*d forward, halved for causal; forward+backward
3.5x the forward), the share of the H100's measured dense bf16 matrix throughput (798 TFLOP/s,
BENCHMARKS.md), and FA3's time over each one's (1.0 = parity, above = faster than FA3).
"""

import argparse
import ast
import dataclasses
import functools
import os
import re
import sys

import jax
import jax.numpy as jnp

import attnaux
from attnaux import _flash_cudnn
from attnaux import _flash_hopper as fh
from attnaux._canon import canonicalize, parse_statics

sys.path.insert(0, os.path.dirname(__file__))
import dew_flash_attn  # noqa: E402
from gpu_flash import SHAPES, timed  # noqa: E402

PEAK_TFLOPS = 798.0  # H100 SXM dense bf16 wgmma, measured (BENCHMARKS.md)


def hopper_candidate(**overrides):
    """Attention on the Hopper kernels (`_flash_hopper.forward`) with their backward as the VJP,
    configured as `default_config` with `overrides` (`Config` fields) on top. Plain attention,
    sequence lengths a multiple of 128 (no padding)."""

    def statics(q, causal):
        b, s, h, d = q.shape
        none = jnp.zeros((b, h, 0, s), jnp.float32)  # no row or column inputs
        config = dataclasses.replace(fh.default_config(d, s, banded=causal), **overrides)
        return none, dict(scale=d ** -0.5, softcap=None,
                          geometry=fh.Geometry(causal, None, 0, s, s), tile_fn=None,
                          config=config)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def attention(q, k, v, causal):
        none, kw = statics(q, causal)
        return fh.forward(q, k, v, none, none, **kw)[0]

    def forward(q, k, v, causal):
        none, kw = statics(q, causal)
        out, lse, _ = fh.forward(q, k, v, none, none, **kw)
        return out, (q, k, v, out, lse)

    def backward(causal, saved, dout):
        q, k, v, out, lse = saved
        none, kw = statics(q, causal)
        dq, dk, dv, _, _ = fh.backward(q, k, v, out, lse, dout, jnp.zeros_like(lse), none,
                                       none, **kw)
        return dq, dk, dv

    attention.defvjp(forward, backward)
    return attention


def parse_config(text: str):
    """`NAME:FIELD=VALUE[,FIELD=VALUE...]` -> (NAME, {FIELD: VALUE}), the values Python
    literals (`fused_dq=True`, `backward_registers=(232,40)`)."""
    name, sep, body = text.partition(":")
    fields = {f.name for f in dataclasses.fields(fh.Config)}
    if not sep or not name or not body:
        raise ValueError(f"--config {text!r}: expected NAME:FIELD=VALUE[,FIELD=VALUE...]")
    overrides = {}
    for item in re.split(r",(?=\s*\w+=)", body):  # (a tuple's commas stay in its value)
        field, eq, value = item.partition("=")
        field = field.strip()
        if not eq or field not in fields:
            raise ValueError(f"--config {text!r}: {item!r} is not FIELD=VALUE with FIELD one "
                             f"of {sorted(fields)}")
        try:
            overrides[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"--config {text!r}: {value!r} is not a Python literal") from None
    return name, overrides


hopper_attention = hopper_candidate()


def cudnn_attention(q, k, v, causal):
    """cuDNN forward and backward through attnaux's FFI handlers (`_flash_cudnn`, called past
    the dispatch, which would put the forward on the Hopper kernel at some shapes)."""
    problem = canonicalize(q, k, v, parse_statics(scale=None, causal=causal, window=None,
                                                  softcap=None, dropout_rate=0.0))
    return _flash_cudnn.flash_attention_cuda(problem.arrays, problem.options)[0]


CANDIDATES = {
    "hopper": hopper_attention,
    "cudnn": cudnn_attention,
    "flash": lambda q, k, v, c: attnaux.attention(q, k, v, causal=c, backend="flash")[0],
    "fa3": lambda q, k, v, c: dew_flash_attn.flash_mha(q, k, v, is_causal=c),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shapes only")
    parser.add_argument("--shapes", default=None, metavar="BxSxHxD[,...]",
                        help="these shapes instead of the benchmark's")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--candidates", default=",".join(CANDIDATES),
                        help="comma-separated subset of " + ", ".join(CANDIDATES)
                        + " (fa3 is always measured: the ratios are against it)")
    parser.add_argument("--config", action="append", default=[],
                        metavar="NAME:FIELD=VALUE[,...]",
                        help="adds candidate NAME: the Hopper kernels with these "
                        "_flash_hopper.Config fields changed (repeatable)")
    args = parser.parse_args()
    chosen = set(args.candidates.split(",")) | {"fa3"}
    unknown = chosen - set(CANDIDATES)
    if unknown:
        parser.error(f"--candidates: unknown {sorted(unknown)}; choose from {list(CANDIDATES)}")
    candidates = {n: f for n, f in CANDIDATES.items() if n in chosen}
    for text in args.config:
        try:
            name, overrides = parse_config(text)
        except ValueError as error:
            parser.error(str(error))
        if name in candidates:
            parser.error(f"--config {text!r}: the name {name!r} is taken")
        candidates[name] = hopper_candidate(**overrides)
    shapes = SHAPES[1:3] if args.quick else SHAPES
    if args.shapes:
        try:
            shapes = [tuple(int(n) for n in text.split("x")) for text in args.shapes.split(",")]
        except ValueError:
            parser.error(f"--shapes {args.shapes!r}: expected BxSxHxD[,BxSxHxD...]")
        if any(len(shape) != 4 for shape in shapes):
            parser.error(f"--shapes {args.shapes!r}: expected four sizes a shape, BxSxHxD")
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; bf16")
    names = list(candidates)
    print("| b x s x h x d | causal | pass | " + " | ".join(f"{n} TFLOP/s (% peak)"
                                                          for n in names)
          + " | " + " | ".join(f"fa3 / {n}" for n in names if n != "fa3") + " |")
    print("|---" * (3 + 2 * len(names) - 1) + "|")
    for b, s, h, d in shapes:
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys)
        for causal in (False, True):
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            fwd = {n: jax.jit(lambda q, k, v, f=f, c=causal: f(q, k, v, c))
                   for n, f in candidates.items()}
            fwd_bwd = {n: jax.jit(lambda q, k, v, do, f=f, c=causal: jax.vjp(
                lambda q, k, v: f(q, k, v, c), q, k, v)[1](do))
                for n, f in candidates.items()}
            t_f = timed(fwd, (q, k, v), rounds=args.rounds)
            t_fb = timed(fwd_bwd, (q, k, v, do), rounds=args.rounds)
            for label, t, work in (("fwd", t_f, flops), ("fwd+bwd", t_fb, 3.5 * flops)):
                rates = {n: work / t[n] / 1e12 for n in names}
                print(f"| {b}x{s}x{h}x{d} | {'yes' if causal else 'no'} | {label} | "
                      + " | ".join(f"{rates[n]:.0f} ({100 * rates[n] / PEAK_TFLOPS:.0f}%)"
                                   for n in names)
                      + " | " + " | ".join(f"{t['fa3'] / t[n]:.2f}" for n in names
                                           if n != "fa3") + " |", flush=True)


if __name__ == "__main__":
    main()
