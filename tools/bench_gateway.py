"""The agent gateway's overhead per call against the engine called directly, side by side.

    python tools/bench_gateway.py [--calls 40] [--new-tokens 16 64] [--repeats 3]

One process holds a random tiny chat model (`asyncrl.tiny_model`, `chat=True`) on the builtin
engine. `direct`: `engine.generate` of one chat prompt, `--calls` times. `gateway`: the same
calls made by an agent through the gateway (`task.agent`): an `EpisodeScheduler` with its
gateway in this process, the agent's `openai` client in a child process (so that the figures
are the server side's: HTTP, the OpenAI layer, the transcript, the scheduler's hand-over; the
client's CPU is the agent's own). Per call: this process's CPU seconds and wall seconds; the
overhead is gateway − direct, and its share of a direct call. Modes interleave `--repeats`
times; medians. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from asyncrl.agents.config import PythonAgentConfig
from asyncrl.agents.episode import AgentEpisodes
from asyncrl.engines.config import SamplingParams, TorchEngineConfig
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.gateway.config import GatewayConfig
from asyncrl.gateway.server import Gateway
from asyncrl.items import PromptItem
from asyncrl.rollout.scheduler import EpisodeScheduler
from asyncrl.tasks.build import build_agent
from asyncrl.tiny_model import save_random_tiny_model

MESSAGES = [{"role": "system", "content": "1+1=2"}, {"role": "user", "content": "12+34="}]
CLIENT = """
import json, sys, time
from openai import OpenAI
base_url, api_key, calls, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
messages = json.loads(sys.argv[5])
walls = []
for _ in range(calls):
    t0 = time.perf_counter()
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=new)
    walls.append(time.perf_counter() - t0)
    assert reply.usage.completion_tokens == new
print(json.dumps(walls))
"""
AGENT = """
import json, subprocess, sys

def run(item, base_url, api_key, calls, new, client, out):
    argv = [sys.executable, "-c", client, base_url, api_key, str(calls), str(new), item["prompt"]]
    walls = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    with open(out, "w") as f:
        f.write(walls)
    return 0.0
"""


def direct(engine: TorchEngine, prompt: list[int], calls: int, new: int) -> tuple[float, float]:
    params = SamplingParams(max_new_tokens=new, stop_token_ids=())
    cpu, walls = time.process_time(), []
    for _ in range(calls):
        t0 = time.perf_counter()
        (gen,) = engine.generate([prompt], params)
        walls.append(time.perf_counter() - t0)
        assert len(gen.token_ids) == new
    return (time.process_time() - cpu) / calls, statistics.median(walls)


def gateway(
    engine: TorchEngine, tokenizer: object, folder: Path, calls: int, new: int
) -> tuple[float, float]:
    out = folder / "walls.json"
    cfg = PythonAgentConfig(
        python_path=[str(folder)],
        path="bench_agent:run",
        max_calls=calls,
        kwargs={"calls": calls, "new": new, "client": CLIENT, "out": str(out)},
    )
    gw = Gateway(GatewayConfig(), tokenizer, len(tokenizer))  # type: ignore[arg-type]
    params = SamplingParams(max_new_tokens=new, stop_token_ids=())
    sched: EpisodeScheduler[str] = EpisodeScheduler(
        engine,
        _NoTask(),
        tokenizer,
        params,
        kind=AgentEpisodes(build_agent(cfg), cfg, gw),
    )
    try:
        sched.start("b", PromptItem("b", json.dumps(MESSAGES), [1], None), 1, "b")
        cpu = time.process_time()
        finished: list[object] = []
        while not finished:
            done, failed = sched.advance(0.05)
            assert not failed, failed
            finished += done
        cpu = time.process_time() - cpu
    finally:
        sched.close()
    walls = json.loads(out.read_text())
    return cpu / calls, statistics.median(walls)


class _NoTask:
    def score(self, item: object, text: str) -> float:
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    model = save_random_tiny_model(folder / "model", seed=0, chat=True)
    (folder / "bench_agent.py").write_text(AGENT)
    tokenizer = AutoTokenizer.from_pretrained(model)
    cfg = TorchEngineConfig.model_validate({"device": "cpu", "dtype": "float32", "seed": 0})
    engine = TorchEngine.from_config(cfg, model_path=str(model))
    prompt = list(
        tokenizer(
            tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
    )
    direct(engine, prompt, 5, max(args.new_tokens))  # warm-up: the first calls pay for setup
    result = {}
    for new in args.new_tokens:
        runs: dict[str, list[tuple[float, float]]] = {"direct": [], "gateway": []}
        for _ in range(args.repeats):
            runs["direct"].append(direct(engine, prompt, args.calls, new))
            runs["gateway"].append(gateway(engine, tokenizer, folder, args.calls, new))
        med = {
            mode: tuple(statistics.median(r[i] for r in rs) for i in (0, 1))
            for mode, rs in runs.items()
        }
        (d_cpu, d_wall), (g_cpu, g_wall) = med["direct"], med["gateway"]
        row = {
            "new_tokens": new,
            "direct_cpu_ms": 1e3 * d_cpu,
            "direct_wall_ms": 1e3 * d_wall,
            "gateway_cpu_ms": 1e3 * g_cpu,
            "gateway_wall_ms": 1e3 * g_wall,
            "overhead_cpu_ms": 1e3 * (g_cpu - d_cpu),
            "overhead_wall_ms": 1e3 * (g_wall - d_wall),
            "overhead_cpu_share": (g_cpu - d_cpu) / d_cpu,
            "overhead_wall_share": (g_wall - d_wall) / d_wall,
        }
        print(" ".join(f"{k}={v:.3g}" for k, v in row.items()), flush=True)
        result[str(new)] = row
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
