"""Command line: `python -m attnaux [demo]` runs the demonstration (one attention call and its
aux, then a short training run of a small decoder with its attention health report), and
`python -m attnaux bench` the CPU benchmark (`attnaux/_cli/bench.py`). `python -m attnaux
<command> --help` explains each command's options.

The demonstration's training is a copy task that only attention can solve: a sequence of random
tokens followed by the same tokens again; the model is scored on predicting the repeated half.
Training uses a z-loss on every layer's `aux.lse` (which differentiates through the fused
kernel) and QK-clip (MuonClip's per-head rescaling of the query projection, from `aux.max`).
`examples/train_decoder.py` is the same loop as a standalone script.
"""

import argparse
import dataclasses
import pathlib
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from attnaux import introspect as ai
from attnaux._attention import attention, explain
from attnaux._cli import bench as _bench
from attnaux._version import __version__
from attnaux.nn import Decoder


def demo(args: argparse.Namespace) -> int:
    """A batched causal GQA attention on the default device; prints the output and its aux."""
    b, s, q_heads, kv_heads, d = args.batch, args.seq, args.q_heads, args.kv_heads, args.head_dim
    kq, kk, kv = jax.random.split(jax.random.key(args.seed), 3)
    q = jax.random.normal(kq, (b, s, q_heads, d), jnp.float32)
    k = jax.random.normal(kk, (b, s, kv_heads, d), jnp.float32)
    v = jax.random.normal(kv, (b, s, kv_heads, d), jnp.float32)

    print(f"attnaux {__version__} on JAX {jax.__version__} ({jax.default_backend()})")
    print(f"q {list(q.shape)}, k/v {list(k.shape)} float32 (GQA {q_heads}:{kv_heads}), "
          "causal=True\n")
    print(explain(q, k, v, causal=True))

    start = time.perf_counter()
    out, aux = jax.block_until_ready(attention(q, k, v, causal=True))
    took = time.perf_counter() - start

    head_max = jnp.max(aux.max, axis=(0, 2))  # max of aux.max over batch and rows, per head
    visible = jnp.isfinite(aux.lse)
    mean_lse = jnp.sum(jnp.where(visible, aux.lse, 0.0)) / jnp.maximum(jnp.sum(visible), 1)
    empty = int(jnp.sum(~visible))
    print(f"\nbackend that ran: {aux.backend}  ({took * 1e3:.0f} ms, compile included)")
    print(f"out: {list(out.shape)} {out.dtype}")
    print(f"aux.lse: {list(aux.lse.shape)} {aux.lse.dtype}   aux.max: {list(aux.max.shape)} "
          f"{aux.max.dtype}   (batch, q_heads, q_seq)")
    print("max logit per head: " + " ".join(f"{x:.3f}" for x in np.asarray(head_max)))
    print(f"mean lse: {float(mean_lse):.4f} (rows with a visible key)")
    print(f"rows with no visible key: {empty} of {aux.lse.size} (causal: every row sees key 0, "
          "so 0 is expected)")
    print(f"out finite: {bool(jnp.all(jnp.isfinite(out)))}")
    if args.steps > 0:
        return train_demo(args)
    return 0


def train_demo(args: argparse.Namespace) -> int:
    """Trains the small decoder of `attnaux.nn`, saves every layer's aux, prints its health
    report and writes the heatmap PNG."""
    config = DemoConfig(steps=args.steps, log_every=max(args.steps // 2, 1),
                              clip_threshold=args.clip_threshold, seed=args.seed)
    print(f"\nTraining a {config.depth}-layer decoder (attnaux.nn, GQA {config.num_heads}:"
          f"{config.kv_heads}, causal) on a copy task for {config.steps} steps, with a z-loss on "
          f"aux.lse and QK-clip at max logit {config.clip_threshold:g}.\nEach log: the training "
          "batch's loss and per-head max logit before QK-clip (the figures the clip acts on),\n"
          "then a held-out evaluation batch's accuracy, max logit and entropy, after the step.")
    model, _ = train(config)
    collection = final_auxes(model, config)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = out_dir / "attnaux-demo-aux.npz"
    ai.save(saved, collection)
    print(f"\nSaved the aux of {len(collection)} layers, on a fresh batch after training, to "
          f"{saved}. Health per head on that batch:")
    reports = {name: ai.health(aux) for name, aux in collection.items()}
    print(ai.HealthReport.table_of(reports))
    png = out_dir / "attnaux-demo-heads.png"
    try:
        ai.plot(collection, png, clip_threshold=config.clip_threshold,
                title=f"attnaux demo: decoder after {config.steps} steps, on a fresh batch")
    except ImportError as error:
        print(f"(no PNG: {error})")
    else:
        print(f"Wrote {png}; `python -m attnaux.introspect report {saved}` reprints this report.")
    return 0


@dataclasses.dataclass
class DemoConfig:
    steps: int = 300
    batch: int = 32
    half: int = 12  # the sequence is `half` random tokens, then the same tokens again
    vocab: int = 16
    dim: int = 64
    depth: int = 2
    num_heads: int = 4
    kv_heads: int = 2
    learning_rate: float = 3e-3
    z_loss_weight: float = 1e-4
    clip_threshold: float = 12.0  # QK-clip: max logit allowed per head
    log_every: int = 50
    seed: int = 0


def make_batch(key, config: DemoConfig) -> jax.Array:
    first = jax.random.randint(key, (config.batch, config.half), 0, config.vocab)
    return jnp.concatenate([first, first], axis=1)


def _adam_init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return zeros, zeros, jnp.zeros((), jnp.int32)


def _adam_update(grads, state, learning_rate, b1=0.9, b2=0.99, eps=1e-8):
    m, v, t = state
    t = t + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    scale = learning_rate * jnp.sqrt(1 - b2**t) / (1 - b1**t)
    updates = jax.tree.map(lambda m, v: -scale * m / (jnp.sqrt(v) + eps), m, v)
    return updates, (m, v, t)


def qk_clip_model(model: Decoder, auxes, threshold: float) -> tuple[Decoder, jax.Array]:
    """MuonClip: scales the query projection of every head whose max logit exceeded `threshold`
    by `threshold / max_logit`, so its logits shrink by that factor (exact with shared kv heads,
    unlike splitting the factor between query and key). Returns the model and the factors."""
    factors = []
    for i, aux in enumerate(auxes):
        factor = ai.qk_clip(aux, threshold)  # [num_heads]
        factors.append(factor)
        proj = model.blocks[i].attention.query_proj
        per_row = jnp.repeat(factor, proj.out_features // factor.shape[0])
        model = eqx.tree_at(lambda m, i=i: m.blocks[i].attention.query_proj.weight, model,
                            proj.weight * per_row[:, None])
        if proj.bias is not None:
            model = eqx.tree_at(lambda m, i=i: m.blocks[i].attention.query_proj.bias, model,
                                proj.bias * per_row)
    return model, jnp.stack(factors)


def train(config: DemoConfig, *, progress: bool = True, log=print):
    """Trains the decoder; returns `(model, history)`. `history` holds one dict per log step."""
    key = jax.random.key(config.seed)
    model_key, data_key = jax.random.split(key)
    model = Decoder(config.vocab, 2 * config.half, config.dim, config.depth, config.num_heads,
                    config.kv_heads, key=model_key)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = _adam_init(params)

    def loss_fn(params, tokens):
        model = eqx.combine(params, static)
        logits, auxes = jax.vmap(model)(tokens[:, :-1])
        targets = tokens[:, 1:]
        logp = jax.nn.log_softmax(logits[:, config.half - 1:])
        nll = -jnp.mean(jnp.take_along_axis(logp, targets[:, config.half - 1:, None], -1))
        z = sum(ai.z_loss(aux) for aux in auxes) / len(auxes)
        return nll + config.z_loss_weight * z, (nll, auxes)

    @jax.jit
    def step(params, opt_state, tokens):
        (_, (nll, auxes)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = _adam_update(grads, opt_state, config.learning_rate)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        # The max logit of each head on this training batch, before the clip that it decides.
        max_logits = jnp.stack([ai.max_logit(aux) for aux in auxes])
        model, factors = qk_clip_model(eqx.combine(params, static), auxes,
                                       config.clip_threshold)
        params = eqx.filter(model, eqx.is_inexact_array)
        return params, opt_state, nll, max_logits, factors

    @jax.jit
    def evaluate(params, tokens):
        model = eqx.combine(params, static)
        logits, auxes = jax.vmap(lambda t: model(t, return_probs=True))(tokens[:, :-1])
        predicted = jnp.argmax(logits[:, config.half - 1:], -1)
        accuracy = jnp.mean(predicted == tokens[:, config.half:])
        return accuracy, auxes

    history = []
    start = time.perf_counter()
    for i in range(1, config.steps + 1):
        tokens = make_batch(jax.random.fold_in(data_key, i), config)
        params, opt_state, nll, max_logits, factors = step(params, opt_state, tokens)
        if progress:
            _progress_bar(i, config.steps, float(nll), start)
        if i % config.log_every == 0 or i == config.steps:
            # "train/": this step's training batch, before the update and the clip;
            # "eval/": a held-out batch, on the model after the step (clip included).
            entry = {"step": i, "train/loss": float(nll),
                     "train/clipped_heads": int(jnp.sum(factors < 1)),
                     "train/heads": int(factors.size)}
            for layer in range(config.depth):
                entry[f"train/layer{layer}/max_logit"] = np.asarray(max_logits[layer])
            eval_tokens = make_batch(jax.random.fold_in(data_key, 1_000_000 + i), config)
            accuracy, auxes = evaluate(params, eval_tokens)
            entry["eval/accuracy"] = float(accuracy)
            for layer, aux in enumerate(auxes):
                report = ai.health(aux)
                entry[f"eval/layer{layer}/max_logit"] = np.asarray(report.max_logit)
                entry[f"eval/layer{layer}/entropy"] = np.asarray(report.mean_entropy)
            history.append(entry)
            if progress and sys.stderr.isatty():
                sys.stderr.write("\n")
            log(_format_log(entry, config.depth, config.clip_threshold))
    return eqx.combine(params, static), history


def _progress_bar(i: int, total: int, loss: float, start: float) -> None:
    interactive = sys.stderr.isatty()
    if not interactive and i % max(total // 10, 1) and i != total:
        return  # in a log file, one line per tenth of the run
    width = 30
    done = int(width * i / total)
    rate = i / max(time.perf_counter() - start, 1e-9)
    bar = "#" * done + "." * (width - done)
    sys.stderr.write(f"{chr(13) if interactive else ''}training [{bar}] {i}/{total}"
                     f" loss {loss:.3f} ({rate:.1f} steps/s)"
                     f"{'' if interactive else chr(10)}")
    sys.stderr.flush()


def _format_log(entry: dict, depth: int, clip_threshold: float) -> str:
    """One log entry: the training batch's figures (the ones QK-clip acted on), then the
    evaluation batch's, each labelled with the batch it was measured on."""

    def row(values, width):
        return " ".join(f"{x:{width}.2f}" for x in values)

    parts = [f"step {entry['step']:4d}  training batch: loss {entry['train/loss']:.3f}, "
             f"heads clipped {entry['train/clipped_heads']} of {entry['train/heads']} "
             f"(max logit above {clip_threshold:g} before the clip)"]
    for layer in range(depth):
        parts.append(f"    layer {layer}: max logit per head "
                     f"[{row(entry[f'train/layer{layer}/max_logit'], 5)}]")
    parts.append(f"  evaluation batch, after the step: copy accuracy "
                 f"{entry['eval/accuracy']:.2f}")
    for layer in range(depth):
        parts.append(f"    layer {layer}: max logit per head "
                     f"[{row(entry[f'eval/layer{layer}/max_logit'], 5)}]  entropy "
                     f"[{row(entry[f'eval/layer{layer}/entropy'], 4)}]")
    return "\n".join(parts)


def final_auxes(model: Decoder, config: DemoConfig) -> dict:
    """The aux of every layer on a fresh batch, with probabilities, keyed `layer0`, `layer1`..."""
    tokens = make_batch(jax.random.key(config.seed + 1), config)
    _, auxes = jax.vmap(lambda t: model(t, return_probs=True))(tokens[:, :-1])
    return {f"layer{i}": aux for i, aux in enumerate(auxes)}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}.")
    return value


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m attnaux",
        description="attnaux: fused attention for JAX that returns its softmax statistics. "
                    "Without a command, runs the demo.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{demo,bench}")

    d = commands.add_parser(
        "demo", help="one attention call and its aux statistics, then a short training run with "
                     "a health report (the default command).",
        description="Runs attnaux.attention(q, k, v, causal=True) on the default device with "
                    "random float32 inputs and prints the output shape, which backend ran "
                    "(with attnaux.explain), and the aux statistics. Then trains a small "
                    "decoder built from attnaux.nn layers for --steps steps (z-loss on lse, "
                    "QK-clip from aux.max), saves every layer's aux, prints the per-head health "
                    "report and writes a PNG heatmap (needs matplotlib: pip install "
                    "'attnaux[plot]').")
    d.add_argument("--batch", type=_positive, default=2, help="batch size (default: 2).")
    d.add_argument("--seq", type=_positive, default=128, help="sequence length (default: 128).")
    d.add_argument("--q-heads", type=_positive, default=8, help="query heads (default: 8).")
    d.add_argument("--kv-heads", type=_positive, default=2,
                   help="key/value heads; must divide --q-heads (default: 2).")
    d.add_argument("--head-dim", type=_positive, default=64, help="head dimension (default: 64).")
    d.add_argument("--seed", type=int, default=0, help="PRNG seed of the inputs (default: 0).")
    d.add_argument("--steps", type=int, default=60,
                   help="training steps of the decoder demonstration; 0 skips it (default: 60).")
    d.add_argument("--clip-threshold", type=float, default=12.0,
                   help="QK-clip: the largest logit allowed per head (default: 12).")
    d.add_argument("--out-dir", default=".",
                   help="where to write attnaux-demo-aux.npz and attnaux-demo-heads.png "
                        "(default: the current directory).")
    d.set_defaults(func=demo)

    bench = commands.add_parser(
        "bench", help="CPU benchmark: GFLOP/s and peak memory of attnaux flash against XLA.",
        description=_bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _bench.add_arguments(bench)
    bench.set_defaults(func=_bench.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in ("demo", "bench", "-h", "--help"):
        argv = ["demo", *argv]  # no command: the demo, with any options given
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
