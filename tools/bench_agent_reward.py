"""Reward rises when an unchanged `openai` agent is trained through the gateway: the quickstart's
2-digit addition, each episode one call of a plain agent (`task.agent`) instead of the worker's
own turn.

    python tools/bench_agent_reward.py [--model DIR] [--steps 60] [--groups 16]

The warmed-up quickstart model (`asyncrl.tiny_model.build_tiny_model`, built into `--model` if
it is not there) gets a chat template that renders the user's message as the quickstart's
prompt (`<bos>12+34=`), so the agent's call asks exactly what the quickstart's turn does. The
agent returns None: the task's exact reward scores its answer. `asyncrl launch --role all` runs
the quickstart config with it for `--steps` steps (no evaluation: it runs in the trainer, which
serves no gateway). Prints each step's mean reward, then JSON: the mean of the first and the
last fifth of the steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from asyncrl.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parent.parent
AGENT = """
from openai import OpenAI

def solve(item, base_url, api_key):
    client = OpenAI(base_url=base_url, api_key=api_key)
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": item["prompt"]}], max_tokens=4)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "runs" / "models" / "tiny-add2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--groups", type=int, default=16)
    args = parser.parse_args()
    build_tiny_model(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-agent-reward-"))
    model = work / "model"
    shutil.copytree(args.model, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = "{{ bos_token }}{{ messages[-1]['content'] }}"
    tokenizer.save_pretrained(model)
    (work / "agent.py").write_text(AGENT)
    run_dir = work / "run"
    subprocess.run(
        [
            *(sys.executable, "-m", "asyncrl", "launch", "--role", "all"),
            *("--config", str(REPO / "configs" / "quickstart.yaml"), "--progress", "quiet"),
            f"run.dir={run_dir}",
            f"model.path={model}",
            "model.build_tiny=false",
            f"task.agent.python_path=[{work}]",
            "task.agent.path=agent:solve",
            f"trainer.max_steps={args.steps}",
            f"trainer.groups_per_step={args.groups}",
            "trainer.eval_every=0",
            "rollout.max_inflight_episodes=256",
            "metrics.port=0",
        ],
        check=True,
        cwd=REPO,
    )
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [line["reward_mean"] for line in lines if line.get("reward_mean") is not None]
    for step, reward in enumerate(rewards, 1):
        print(f"step {step}: reward {reward:.3f}")
    fifth = max(len(rewards) // 5, 1)
    first, last = statistics.mean(rewards[:fifth]), statistics.mean(rewards[-fifth:])
    print(json.dumps({"steps": len(rewards), "first_fifth": first, "last_fifth": last}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
