"""Train a small decoder-only transformer built from `attnaux.nn` layers, on CPU.

    python examples/train_decoder.py --steps 300

A self-contained training loop on attnaux's public API (copy it into your project): the task is a
copy task that only attention can solve, random tokens followed by the same tokens again, scored
on the repeated half. Training uses a z-loss on every layer's `aux.lse` (it differentiates
through the fused kernel) and QK-clip (MuonClip) from `aux.max` via
`attnaux.introspect.qk_clip`. Every 50 steps it logs the training batch's loss, the max logit of
each head on that batch before QK-clip and how many heads the clip scaled down; then, on a
held-out evaluation batch after the step, the copy accuracy and per layer the max logit and mean
attention entropy of each head (`attnaux.introspect.health`). At the end it saves every layer's
aux for `python -m attnaux.introspect report`. `python -m attnaux` runs the same loop for fewer
steps.
"""

import argparse
import dataclasses
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from attnaux import introspect as ai
from attnaux.nn import Decoder


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--clip-threshold", type=float, default=12.0,
                        help="QK-clip: the largest logit allowed per head")
    parser.add_argument("--save", default="decoder-aux.npz",
                        help="where to save the final aux of every layer")
    args = parser.parse_args()
    config = DemoConfig(steps=args.steps, clip_threshold=args.clip_threshold)
    model, _ = train(config)
    collection = final_auxes(model, config)
    ai.save(args.save, collection)
    print(f"saved the aux of {len(collection)} layers to {args.save}; report it with "
          f"`python -m attnaux.introspect report {args.save}`")


if __name__ == "__main__":
    main()
