"""The verifiers runner (`task.type: verifiers`): runs in the verifiers venv (`task.python`), not
asyncrl's, so it imports nothing of asyncrl: only the standard library and `verifiers.v1`.

One long-lived process per rollout worker (and one per held-out evaluation), started as
`PYTHON -c RUN vf_runner.py SPEC` (`asyncrl.agents.verifiers.runner_argv`), SPEC a JSON map
(`env`, `python_path`, `env_args`, `runtime`, `splits`, `traces_dir`). It loads the
environment once (`load_environment`, verifiers' own path for every construction site),
enters `env.serving()` (its interception server) once, then
answers JSON lines on stdin, one JSON line each on stdout, many episodes at once:

    {"op": "tasks", "id": n, "split": "train"|"eval"}
        -> {"id": n, "tasks": [{"idx", "prompt", "data"}, ...]}   (data: the task's wire data)
    {"op": "episode", "id": n, "data": {...}, "base_url": url}
        -> {"id": n, "reward": number} | {"id": n, "error": text}
    {"op": "cancel", "id": n}                                     (no reply)

An episode is `env.run_slot` on the task rebuilt from its wire data (as verifiers' own env
server rebuilds a request's task), with an `EvalClient` relaying every model call of the
harness to the episode's gateway session (`base_url`): the gateway records the sampled ids,
log-probs and versions, so verifiers' traces need carry none. Its reward is the rubric's,
`Trace.reward`, over the episode's trainable traces (their mean when an env has several
agents). A failed episode (`Episode.ok` false) is an error with verifiers' own message. With
`traces_dir`, every episode is also appended to `traces_dir/runner-PID/traces.jsonl` by
verifiers' own writer (`append_episode`), as `vf-eval` saves its runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.configs.select import SelectConfig
from verifiers.v1.utils.loaders import load_environment, resolve_env_config
from verifiers.v1.utils.trace_store import append_episode

_KEY_VAR = "ASYNCRL_VF_SESSION_KEY"
"""Where the eval client reads its API key from; the session's base URL carries the key too."""


def build_env(spec: dict[str, Any]) -> vf.Env:
    for path in reversed(spec["python_path"]):
        sys.path.insert(0, path)
    args = dict(spec["env_args"])
    taskset = {"id": spec["env"], **args.pop("taskset", {})}
    agent = args.pop("agent", {})
    agent.setdefault("runtime", {"type": spec["runtime"]})
    agent.setdefault("harness", {"id": "null"})
    return load_environment(resolve_env_config({**args, "taskset": taskset, "agent": agent}))


def task_rows(env: vf.Env, select: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"idx": t.data.idx, "prompt": t.data.prompt_text, "data": t.data.model_dump(mode="json")}
        for t in env.taskset.select(SelectConfig(**select))
    ]


class Runner:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.env = build_env(spec)
        self.task_cls = type(self.env.taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        self.running: dict[int, asyncio.Task[None]] = {}
        self.traces: Path | None = None
        if spec["traces_dir"] is not None:
            self.traces = Path(spec["traces_dir"]) / f"runner-{os.getpid()}"
        self.write_lock = asyncio.Lock()

    def task(self, data: dict[str, Any]) -> vf.Task:
        return self.task_cls(self.data_cls.model_validate(data), self.env.config.taskset.task)

    async def episode(self, msg: dict[str, Any]) -> dict[str, Any]:
        os.environ[_KEY_VAR] = "session"  # the key travels in the base URL's path
        client = vf.EvalClientConfig(base_url=msg["base_url"], api_key_var=_KEY_VAR)
        ctx = vf.ModelContext(model="asyncrl-policy", client=client)
        (slot,) = self.env.slots(self.task(msg["data"]))
        episode = await self.env.run_slot(slot, ctx)
        if self.traces is not None:
            self.traces.mkdir(parents=True, exist_ok=True)
            await append_episode(self.traces, episode, self.write_lock)
        if not episode.ok:
            errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
            what = "; ".join(f"{e.type}: {e.message}" for e in errors[-2:]) or "not ok"
            return {"error": f"verifiers episode failed: {what}"[:600]}
        rewards = [t.reward for t in episode.traces if t.agent.trainable]
        return {"reward": sum(rewards) / len(rewards)}

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 26)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        async with self.env.serving():
            while line := await reader.readline():
                msg = json.loads(line)
                if msg["op"] == "cancel":
                    if (running := self.running.get(msg["id"])) is not None:
                        running.cancel()
                    continue
                self.running[msg["id"]] = asyncio.create_task(self.answer(msg))

    async def answer(self, msg: dict[str, Any]) -> None:
        reply: dict[str, Any]
        try:
            if msg["op"] == "tasks":
                reply = {"tasks": task_rows(self.env, self.spec["splits"][msg["split"]])}
            else:
                reply = await self.episode(msg)
        except asyncio.CancelledError:
            return
        except Exception as exc:  # the episode's failure, reported; the runner goes on
            reply = {"error": f"{type(exc).__name__}: {exc}"[:600]}
        finally:
            self.running.pop(msg["id"], None)
        print(json.dumps({"id": msg["id"], **reply}), flush=True)


def main() -> None:
    spec = json.loads(sys.argv[-1])
    # stdout is the protocol: whatever verifiers or a harness prints goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = out
    asyncio.run(Runner(spec).serve())


if __name__ == "__main__":
    main()
