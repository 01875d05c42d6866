"""Build the offline quickstart model (a char-level Qwen2 warmed up on a+b).

    python tools/make_tiny_model.py --out DIR [--digits 2] [--seed 0]

Skips the work when DIR already holds a complete model. Prints the model's info record
(accuracies, build seconds) as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="model directory to create")
    parser.add_argument("--digits", type=int, default=2, help="digits of each operand")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and batch-order seed")
    args = parser.parse_args()

    from asyncrl.engines.tiny_model import build_tiny_model

    info = build_tiny_model(args.out, digits=args.digits, seed=args.seed)
    if not info["reached_target"]:
        print(f"warning: warm-up stopped at {info['warmup_steps']} steps short of its targets")
    print(json.dumps(info))


if __name__ == "__main__":
    main()
