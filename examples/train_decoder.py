"""Train a small decoder-only transformer built from `attnaux.nn` layers, on CPU.

    python examples/train_decoder.py --steps 300

The task is a copy task that only attention can solve: random tokens followed by the same tokens
again; the model is scored on the repeated half. Every 50 steps it logs, per layer, the max
logit of each head (from `aux.max`, via `attnaux.introspect.health`) and the mean attention
entropy; training uses a z-loss on every layer's `aux.lse` and QK-clip (MuonClip) driven by
`attnaux.introspect.qk_clip`. `python -m attnaux` runs the same code for fewer steps.
"""

import argparse

from attnaux import introspect as ai
from attnaux._cli.train import DemoConfig, final_auxes, train


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
