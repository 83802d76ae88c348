"""`python -m attnaux demo`: one attention call and its aux statistics, then a short training run
of a small decoder with its attention health report."""

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import attnaux


def demo(args: argparse.Namespace) -> int:
    """A batched causal GQA attention on the default device; prints the output and its aux."""
    b, s, q_heads, kv_heads, d = args.batch, args.seq, args.q_heads, args.kv_heads, args.head_dim
    kq, kk, kv = jax.random.split(jax.random.key(args.seed), 3)
    q = jax.random.normal(kq, (b, s, q_heads, d), jnp.float32)
    k = jax.random.normal(kk, (b, s, kv_heads, d), jnp.float32)
    v = jax.random.normal(kv, (b, s, kv_heads, d), jnp.float32)

    print(f"attnaux {attnaux.__version__} on JAX {jax.__version__} ({jax.default_backend()})")
    print(f"q {list(q.shape)}, k/v {list(k.shape)} float32 (GQA {q_heads}:{kv_heads}), "
          "causal=True\n")
    print(attnaux.explain(q, k, v, causal=True))

    start = time.perf_counter()
    out, aux = jax.block_until_ready(attnaux.attention(q, k, v, causal=True))
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
    from attnaux import introspect as ai

    from . import train

    config = train.DemoConfig(steps=args.steps, log_every=max(args.steps // 2, 1),
                              clip_threshold=args.clip_threshold, seed=args.seed)
    print(f"\nTraining a {config.depth}-layer decoder (attnaux.nn, GQA {config.num_heads}:"
          f"{config.kv_heads}, causal) on a copy task for {config.steps} steps, with a z-loss on "
          f"aux.lse and QK-clip at max logit {config.clip_threshold}:")
    model, _ = train.train(config)
    collection = train.final_auxes(model, config)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = out_dir / "attnaux-demo-aux.npz"
    ai.save(saved, collection)
    print(f"\nSaved the aux of {len(collection)} layers to {saved}. Health per head:")
    reports = {name: ai.health(aux) for name, aux in collection.items()}
    print(ai.HealthReport.table_of(reports))
    png = out_dir / "attnaux-demo-heads.png"
    try:
        ai.plot(collection, png)
    except ImportError as error:
        print(f"(no PNG: {error})")
    else:
        print(f"Wrote {png}; `python -m attnaux.introspect report {saved}` reprints this report.")
    return 0
