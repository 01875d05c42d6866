"""Build the offline quickstart model (a char-level Qwen2, or with --moe a Qwen3-MoE, warmed up
on a+b).

    python tools/make_tiny_model.py --out DIR [--digits 2] [--seed 0] [--moe]
    python tools/make_tiny_model.py --out DIR --random-for CONFIG [--seed 0]

Skips the work when DIR already holds a complete model. Prints the model's info record
(accuracies, build seconds) as JSON on the last line. `--random-for` builds an untrained model
instead, whose characters are those of CONFIG's reasoning-gym task (its questions and answers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="model directory to create")
    parser.add_argument("--digits", type=int, default=2, help="digits of each operand")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and batch-order seed")
    parser.add_argument("--random-for", metavar="CONFIG", help="untrained, for CONFIG's task")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE (8 experts, top-2)")
    args = parser.parse_args()

    if args.random_for:
        from asyncrl.config import load_config
        from asyncrl.model import is_complete
        from asyncrl.tasks.config import ReasoningGymTaskConfig
        from asyncrl.tasks.gym import characters
        from asyncrl.tiny_model import save_random_tiny_model

        task = load_config(args.random_for).task
        if not isinstance(task, ReasoningGymTaskConfig):
            parser.error(f"--random-for: {args.random_for} has task.type={task.type}")
        chars = characters(task)
        if not is_complete(Path(args.out)):
            save_random_tiny_model(args.out, seed=args.seed, chars=chars, moe=args.moe)
        print(json.dumps({"out": args.out, "chars": len(chars)}))
        return

    from asyncrl.tiny_model import build_tiny_model

    info = build_tiny_model(args.out, digits=args.digits, seed=args.seed, moe=args.moe)
    if not info["reached_target"]:
        print(f"warning: warm-up stopped at {info['warmup_steps']} steps short of its targets")
    print(json.dumps(info))


if __name__ == "__main__":
    main()
