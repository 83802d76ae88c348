"""A training step of the example decoder on 8 host CPU devices: batch-sharded vs replicated.

`python benchmarks/spmd_step.py` (sets XLA_FLAGS for 8 host devices itself, before JAX starts).
The step is the demo's (`attnaux.nn.Decoder`, causal GQA attention through `attnaux.attention`,
a z-loss on every layer's `aux.lse`, an Adam-style update), jitted once per layout:

- `sharded`: the token batch sharded over the 8 devices, parameters replicated; each device
  computes its 1/8 of the batch (the partitioned kernels), and the parameter gradients are
  all-reduced.
- `replicated`: the same step with the batch replicated on the 8 devices: every device computes
  the whole batch, which is what an attention kernel without sharding rules did once XLA had
  gathered its operands.

The 8 host devices share this machine's cores, so the wall time of a step is the total work
divided by the cores: the sharded step does 1/8 of the replicated step's work, and its time
should be about 1/8 of it. Reported: median step time over `--repeats` runs (after one warm-up),
their ratio, and the collectives counted in each compiled HLO.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import attnaux  # noqa: E402
from attnaux import introspect as ai  # noqa: E402
from attnaux.nn import Decoder  # noqa: E402

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce")


def count_collectives(text: str) -> dict[str, int]:
    return {c: n for c in COLLECTIVES if (n := len(re.findall(rf"\b{c}(?:-start)?\(", text)))}


def make_step(model_static, z_loss_weight: float, learning_rate: float):
    def loss_fn(params, tokens):
        model = eqx.combine(params, model_static)
        logits, auxes = jax.vmap(model)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
        z = sum(ai.z_loss(aux) for aux in auxes) / len(auxes)
        return nll + z_loss_weight * z

    def step(params, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        params = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
        return params, loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence (512)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    key = jax.random.key(0)
    model = Decoder(args.vocab, args.seq, args.dim, args.depth, args.heads, args.kv_heads, key=key)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, args.vocab)
    step = make_step(static, 1e-4, 1e-3)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    print(f"attnaux {attnaux.__version__}, JAX {jax.__version__}, {len(devices)} host devices "
          f"on {os.cpu_count()} cores; decoder depth {args.depth}, dim {args.dim}, heads "
          f"{args.heads}:{args.kv_heads}, batch {args.batch} x seq {args.seq}, float32")
    results = {}
    for name, spec in (("sharded", P("data")), ("replicated", P())):
        batch = jax.device_put(tokens, NamedSharding(mesh, spec))
        jitted = jax.jit(step)
        compiled = jitted.lower(params, batch).compile()
        found = count_collectives(compiled.as_text())
        _, loss = compiled(params, batch)
        loss.block_until_ready()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            _, loss = compiled(params, batch)
            loss.block_until_ready()
            times.append(time.perf_counter() - start)
        results[name] = (statistics.median(times), min(times), max(times), found, float(loss))
    print("\n| layout | step median (ms) | min | max | loss | collectives in the HLO |")
    print("|---|---|---|---|---|---|")
    for name, (med, lo, hi, found, loss) in results.items():
        coll = ", ".join(f"{c} x{n}" for c, n in found.items()) or "none"
        print(f"| {name} | {med * 1e3:.1f} | {lo * 1e3:.1f} | {hi * 1e3:.1f} | {loss:.4f} "
              f"| {coll} |")
    ratio = results["sharded"][0] / results["replicated"][0]
    print(f"\nsharded / replicated step time: {ratio:.3f} (1/{len(devices)} = "
          f"{1 / len(devices):.3f} if the work split perfectly)")


if __name__ == "__main__":
    main()
